"""The ctypes declarations match ``cxlkv.h``: a C program compiled against
the header prints every struct's size and field offsets and every
constant, which must equal what the package declares."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
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
    **{f"CXLKV_STATUS_{s.name}": s.value for s in Status},
    **{f"CXLKV_TIER_{c.name}": c.value for c in TierCode},
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
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to read the header with")
    src = tmp_path / "abi.c"
    src.write_text(c_program())
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
