"""A real cxlkv server process for the tests (``cxlkv serve``: the binary
``$CXLKV_BIN``, else the source tree's Cargo build), on a temporary socket,
a small pool under /dev/shm and a temporary state directory; stopped
(SIGTERM) at the end and its files removed. Each test gets its own layout
fingerprint, hence its own key space."""

from __future__ import annotations

import itertools
import os
import select
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Optional

import pytest

import cxlkv

REPO = Path(__file__).resolve().parents[2]
PAGE = 64 << 10
READY_TIMEOUT_S = 60


def cxlkv_binary() -> str:
    env = os.environ.get("CXLKV_BIN")
    if env:
        return env
    for profile in ("debug", "release"):
        path = REPO / "target" / profile / "cxlkv"
        if path.is_file():
            return str(path)
    raise RuntimeError("no cxlkv binary: set CXLKV_BIN, or run `cargo build --bin cxlkv`")


class Server:
    """``env``: more environment for the server (its ``CXLKV_*``
    settings, e.g. ``CXLKV_DIRECTORY_MAX_BATCH``)."""

    def __init__(self, session_lease_ms: int = 2000, env: Optional[dict] = None):
        self.dir = tempfile.mkdtemp(prefix="cxlkv-py-")
        self.socket = os.path.join(self.dir, "cxlkv.sock")
        self.pool = f"/dev/shm/cxlkv-py-{uuid.uuid4().hex}.pool"
        self.proc = subprocess.Popen(
            [
                cxlkv_binary(), "serve",
                "--socket", self.socket,
                # Room for every test's regions: a closed test client's
                # regions that still hold keys stay until orphan eviction
                # (a tick, above the watermark) frees them, and the suite
                # opens a client per test (tmpfs: only bytes written cost).
                "--pool", f"{self.pool},size=1GiB",
                "--state-dir", os.path.join(self.dir, "state"),
                "--lease-ms", str(session_lease_ms),
                "--grace-ms", "300",
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "CXLKV_LOG": "warn", **(env or {})},
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("listening"):
            self.stop()
            raise RuntimeError(f"cxlkv serve did not start: {line!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.pool):
            os.unlink(self.pool)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()
    assert s.proc.returncode == 0, "the server shut down cleanly"


_fingerprints = itertools.count(0x5E57_0000)


@pytest.fixture
def fingerprint() -> int:
    return next(_fingerprints)


@pytest.fixture
def client(server):
    c = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    yield c
    c.close()


@pytest.fixture
def layout(client, fingerprint):
    with client.layout(PAGE, fingerprint) as l:
        yield l


def run_python(script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs a Python script in a fresh interpreter (same cxlkv package)."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
