"""A real cxlkv server process for the tests (the ``cxlkv-test-server``
binary: ``$CXLKV_TEST_SERVER``, else the source tree's Cargo build), on a
temporary socket and a small pool under /dev/shm; stopped (SIGTERM) at the
end. Each test gets its own layout fingerprint, hence its own key space."""

from __future__ import annotations

import itertools
import os
import select
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import cxlkv

REPO = Path(__file__).resolve().parents[2]
PAGE = 64 << 10
READY_TIMEOUT_S = 60


def server_binary() -> str:
    env = os.environ.get("CXLKV_TEST_SERVER")
    if env:
        return env
    for profile in ("debug", "release"):
        path = REPO / "target" / profile / "examples" / "cxlkv-test-server"
        if path.is_file():
            return str(path)
    raise RuntimeError(
        "no cxlkv-test-server: set CXLKV_TEST_SERVER, or run "
        "`cargo build -p cxlkv-ffi --example cxlkv-test-server`"
    )


class Server:
    def __init__(self, session_lease_ms: int = 2000):
        self.dir = tempfile.mkdtemp(prefix="cxlkv-py-")
        self.socket = os.path.join(self.dir, "cxlkv.sock")
        self.pool = f"/dev/shm/cxlkv-py-{uuid.uuid4().hex}.pool"
        self.proc = subprocess.Popen(
            [
                server_binary(),
                "--socket", self.socket,
                "--pool", self.pool,
                "--pool-size-mib", "256",
                "--session-lease-ms", str(session_lease_ms),
                "--instance-grace-ms", "300",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("ready"):
            self.stop()
            raise RuntimeError(f"cxlkv-test-server did not start: {line!r}")

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
        for f in Path(self.dir).glob("*"):
            f.unlink()
        os.rmdir(self.dir)


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
