"""Packs libcxlkv.so into the package (the only non-Python file).

``pip install ./python`` finds the library, in order: ``$CXLKV_LIB``; else,
in a cxlkv source tree, ``cargo build --release -p cxlkv-ffi`` and the
result in the Cargo target directory. The wheel is tagged for the platform
(it carries a native library), though it has no extension module.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def find_or_build_library() -> Path:
    env = os.environ.get("CXLKV_LIB")
    if env:
        path = Path(env)
        if not path.is_file():
            raise SystemExit(f"CXLKV_LIB={env} is not a file")
        return path
    repo = HERE.parent
    if not (repo / "ffi" / "Cargo.toml").is_file():
        raise SystemExit(
            "libcxlkv.so not found: set CXLKV_LIB to its path, or install from a cxlkv source tree"
        )
    subprocess.run(["cargo", "build", "--release", "-p", "cxlkv-ffi"], cwd=repo, check=True)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(json.loads(meta.stdout)["target_directory"]) / "release" / "libcxlkv.so"


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "cxlkv" / "libcxlkv.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(find_or_build_library(), dest)


class PlatformDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=PlatformDistribution)
