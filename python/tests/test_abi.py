"""The ctypes declarations match ``cxlkv.h``: a C program compiled against
the header prints every struct's size and field offsets and every
constant, which must equal what the package declares."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cxlkv import Status
from cxlkv import _native as N
from cxlkv.tier import TierCode

HEADER_DIR = Path(os.environ.get("CXLKV_INCLUDE", Path(__file__).resolve().parents[2] / "ffi" / "include"))

STRUCTS = {
    "cxlkv_map_info": N.MapInfo,
    "cxlkv_map_callbacks": N.MapCallbacks,
    "cxlkv_pool_path": N.PoolPath,
    "cxlkv_config": N.Config,
    "cxlkv_layout_options": N.LayoutOptions,
    "cxlkv_client_stats": N.ClientStats,
    "cxlkv_usage": N.Usage,
    "cxlkv_session_info": N.SessionInfo,
    "cxlkv_directory_stats": N.DirectoryStats,
    "cxlkv_layout_info": N.LayoutInfo,
    "cxlkv_location": N.Location,
    "cxlkv_register_result": N.RegisterResult,
    "cxlkv_bytes": N.Bytes,
    "cxlkv_view": N.View,
    "cxlkv_delete_result": N.DeleteResult,
    "cxlkv_tier_page": N.TierPage,
    "cxlkv_tier_config": N.TierConfig,
    "cxlkv_tier_listener": N.TierListener,
    "cxlkv_tier_status": N.TierStatus,
    "cxlkv_tier_key_stage": N.TierKeyStage,
    "cxlkv_tier_stats": N.TierStats,
}

CONSTANTS = {
    "CXLKV_CONFIG_EAGER_MAP": N.CONFIG_EAGER_MAP,
    "CXLKV_CONFIG_NO_AUTO_EXPAND": N.CONFIG_NO_AUTO_EXPAND,
    "CXLKV_VISIBILITY_SERVER": N.VISIBILITY_SERVER,
    "CXLKV_VISIBILITY_COHERENT": N.VISIBILITY_COHERENT,
    "CXLKV_VISIBILITY_FLUSH": N.VISIBILITY_FLUSH,
    "CXLKV_REGISTER_NONE": N.REGISTER_NONE,
    "CXLKV_REGISTER_INSERTED": N.REGISTER_INSERTED,
    "CXLKV_REGISTER_DUPLICATE": N.REGISTER_DUPLICATE,
    "CXLKV_REGISTER_REJECTED": N.REGISTER_REJECTED,
    "CXLKV_DELETE_NONE": N.DELETE_NONE,
    "CXLKV_DELETE_DELETED": N.DELETE_DELETED,
    "CXLKV_DELETE_PINNED": N.DELETE_PINNED,
    "CXLKV_DELETE_MISSING": N.DELETE_MISSING,
    "CXLKV_ABI_VERSION_MAJOR": N.ABI_MAJOR,
    "CXLKV_TIER_MAX_HOLDS": N.TIER_MAX_HOLDS,
    "CXLKV_TIER_HOLD_MAPPINGS": N.TIER_HOLD_MAPPINGS,
    **{f"CXLKV_STATUS_{s.name}": s.value for s in Status},
    **{f"CXLKV_TIER_{c.name}": c.value for c in TierCode},
    **{f"CXLKV_TIER_WRITE_{mode.upper()}": n for mode, n in N.TIER_WRITE_MODES.items()},
    **{f"CXLKV_TIER_EVENT_{name[len('L1_'):]}": n for n, name in N.TIER_EVENTS.items()},
}


def c_program() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <cxlkv.h>", "int main(void) {"]
    for cname, struct in STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof({cname}));')
        for field, _ in struct._fields_:
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    for name in CONSTANTS:
        lines.append(f'printf("{name} %lld\\n", (long long)({name}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def c_values(tmp_path) -> dict[str, int]:
    return run_c(tmp_path, c_program())


def c_values_of(tmp_path, names: list[str]) -> dict[str, int]:
    lines = ["#include <stdio.h>", "#include <cxlkv.h>", "int main(void) {"]
    lines += [f'printf("{n} %lld\\n", (long long)({n}));' for n in names]
    return run_c(tmp_path, "\n".join(lines + ["return 0;", "}"]))


def compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to read the header with")
    return cc


def run_c(tmp_path, program: str) -> dict[str, int]:
    cc = compiler()
    src = tmp_path / "abi.c"
    src.write_text(program)
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-I", str(HEADER_DIR), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_struct_sizes_and_offsets_match_the_header(tmp_path):
    c = c_values(tmp_path)
    for cname, struct in STRUCTS.items():
        assert c[cname] == ctypes.sizeof(struct), cname
        for field, _ in struct._fields_:
            assert c[f"{cname}.{field}"] == getattr(struct, field).offset, f"{cname}.{field}"


def test_constants_and_statuses_match_the_header(tmp_path):
    c = c_values(tmp_path)
    for name, value in CONSTANTS.items():
        assert c[name] == value, name


def test_the_header_minor_is_at_least_the_packages(tmp_path):
    assert c_values_of(tmp_path, ["CXLKV_ABI_VERSION_MINOR"])["CXLKV_ABI_VERSION_MINOR"] >= N.ABI_MINOR
    assert N.lib.cxlkv_abi_version() & 0xFFFF >= N.ABI_MINOR


def enumerators(prefix: str) -> set[str]:
    header = (HEADER_DIR / "cxlkv.h").read_text()
    return set(re.findall(rf"^\s*({prefix}\w+) = ", header, re.MULTILINE))


def test_every_tier_mode_event_and_code_in_the_header_is_known_here():
    assert enumerators("CXLKV_TIER_WRITE_") == {f"CXLKV_TIER_WRITE_{m.upper()}" for m in N.TIER_WRITE_MODES}
    assert enumerators("CXLKV_TIER_EVENT_") == {
        f"CXLKV_TIER_EVENT_{name[len('L1_'):]}" for name in N.TIER_EVENTS.values()
    }
    codes = enumerators("CXLKV_TIER_") - enumerators("CXLKV_TIER_WRITE_") - enumerators("CXLKV_TIER_EVENT_")
    assert codes == {f"CXLKV_TIER_{c.name}" for c in TierCode}


def test_the_key_stages_match_the_headers_comment():
    header = (HEADER_DIR / "cxlkv.h").read_text()
    struct = header[header.index("typedef struct cxlkv_tier_key_stage") :]
    comment = re.search(r"//\s*(0:[^\n]*)\n\s*uint32_t stage;", struct)
    assert comment, "the comment on cxlkv_tier_key_stage.stage"
    stages = {int(n): name.replace("-", "_") for n, name in re.findall(r"(\d+): ([\w-]+)", comment.group(1))}
    assert stages == N.TIER_STAGES


def test_every_status_in_the_header_is_known_here():
    header = (HEADER_DIR / "cxlkv.h").read_text()
    in_header = {
        line.split("=")[0].strip()[len("CXLKV_STATUS_"):]
        for line in header.splitlines()
        if line.strip().startswith("CXLKV_STATUS_") and "=" in line
    }
    assert in_header == {s.name for s in Status}


def test_every_function_in_the_header_has_a_signature_here():
    header = (HEADER_DIR / "cxlkv.h").read_text()
    functions = set(re.findall(r"^[a-z].*\b(cxlkv_\w+)\(", header, re.MULTILINE))
    assert len(functions) > 30
    for f in sorted(functions):
        assert getattr(N.lib, f).argtypes is not None, f"{f} has no ctypes signature"


FAKE_LIBRARY = """
#include <stdint.h>
uint32_t cxlkv_abi_version(void) { return VERSION; }
"""


@pytest.mark.parametrize(
    "version, complaint",
    [
        ((N.ABI_MAJOR + 1) << 16, f"ABI {N.ABI_MAJOR + 1}.0"),
        ((N.ABI_MAJOR << 16) | (N.ABI_MINOR - 1), "at least"),
    ],
)
def test_a_library_of_another_abi_is_refused_at_import(tmp_path, version, complaint):
    """Checked before any other symbol is looked up: a library of another
    ABI (here one exporting nothing but ``cxlkv_abi_version``) gives the
    intended ImportError, not a missing symbol."""
    src = tmp_path / "fake.c"
    src.write_text(FAKE_LIBRARY)
    lib = tmp_path / "libcxlkv.so"
    subprocess.run(
        [compiler(), "-shared", "-fPIC", f"-DVERSION={version}u", str(src), "-o", str(lib)], check=True
    )
    probe = textwrap.dedent(
        """
        try:
            import cxlkv
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "CXLKV_LIB": str(lib)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError:") and "ABI" in out.stdout and complaint in out.stdout


def test_max_batch_is_the_librarys_limit():
    # Not in the header: the library is asked. A batch of MAX_BATCH + 1 is
    # refused for its length before anything else is looked at; one of
    # MAX_BATCH gets past that check (to the NULL array here).
    lib = N.lib
    assert lib.cxlkv_batch_alloc(None, N.MAX_BATCH + 1, None) == Status.BATCH_TOO_LARGE
    assert lib.cxlkv_batch_alloc(None, N.MAX_BATCH, None) == Status.INVALID_ARGUMENT
