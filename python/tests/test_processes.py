"""Sharing across processes: the documented examples (producer and consumer
in separate interpreters), a consumer reading another process's chunks in
place, cross-language with the C producer when it is built, and a killed
process whose views held pins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import PAGE, run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_FINGERPRINT = 0x7079746F6E


def test_the_documented_producer_and_consumer_share_chunks(server):
    produced = run_python(EXAMPLES / "producer.py", server.socket, "24")
    assert produced.returncode == 0, produced.stderr
    assert "24 inserted" in produced.stdout
    consumed = run_python(EXAMPLES / "consumer.py", server.socket, "24")
    assert consumed.returncode == 0, consumed.stderr
    assert "24 of 24 chunks intact" in consumed.stdout and "24 deleted" in consumed.stdout


def test_the_consumer_may_start_before_the_producer(server):
    consumer = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "consumer.py"), server.socket, "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    produced = run_python(EXAMPLES / "producer.py", server.socket, "8")
    out, err = consumer.communicate(timeout=120)
    assert produced.returncode == 0 and consumer.returncode == 0, (produced.stderr, err)
    assert "8 of 8 chunks intact" in out


def test_a_reader_sees_another_processes_chunks(server, client):
    produced = run_python(EXAMPLES / "producer.py", server.socket, "6")
    assert produced.returncode == 0, produced.stderr
    sys.path.insert(0, str(EXAMPLES))
    try:
        import producer  # the example's key and chunk functions
    finally:
        sys.path.pop(0)
    layout = client.layout(PAGE, EXAMPLE_FINGERPRINT)
    keys = [producer.key(i) for i in range(6)]
    with layout.batch_get(keys) as views:
        for i, v in enumerate(views):
            assert bytes(v) == producer.chunk(i)
    assert all(r.outcome == "deleted" for r in layout.batch_delete(keys))
    layout.close()


HOLDER = textwrap.dedent(
    """
    import sys, cxlkv
    client = cxlkv.Client.connect(sys.argv[1])
    layout = client.layout({page}, int(sys.argv[2]))
    view = layout.get(b"held")
    assert view is not None
    print("holding", flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_a_killed_process_does_not_leave_its_pins_behind(server, client, fingerprint):
    layout = client.layout(PAGE, fingerprint)
    layout.put(b"held", b"pinned by another process")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(page=PAGE), server.socket, str(fingerprint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "holding"
    assert layout.delete(b"held").outcome == "pinned"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    # Its session ends with its connection; the pins go with it.
    deadline = time.monotonic() + 20
    while (outcome := layout.delete(b"held").outcome) == "pinned" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome == "deleted"
    layout.close()


FORKER = textwrap.dedent(
    """
    import os, sys, time, cxlkv
    client = cxlkv.Client.connect(sys.argv[1])
    layout = client.layout({page}, int(sys.argv[2]))
    layout.put(b"fork-held", b"the parent's chunk")
    view = layout.get(b"fork-held")
    session = client.session()["session_id"]
    pid = os.fork()
    if pid == 0:
        try:
            layout.exists(b"fork-held")
            print("child: an inherited handle was accepted", flush=True)
        except cxlkv.HandleError as e:
            print("child: refused" if "forked" in e.message else f"child: {{e}}", flush=True)
        own = cxlkv.Client.connect(sys.argv[1])
        with own.layout({page}, int(sys.argv[2])).get(b"fork-held") as v:
            print("child: its own client reads", bytes(v).decode(), flush=True)
        own.close()
        # Ending the inherited objects (a `with` block's exit does) only
        # ends this process's copies, quietly.
        view.release()
        layout.close()
        client.close()
        print("child: released and closed its copies", flush=True)
        sys.exit(0)  # a normal exit: the inherited client's finalizers run
    _, status = os.waitpid(pid, 0)
    print("parent: the child exited with", status, flush=True)
    print("parent: same session", client.session()["session_id"] == session, flush=True)
    with cxlkv.Client.connect(sys.argv[1]) as peer:
        peer_layout = peer.layout({page}, int(sys.argv[2]))
        print("parent: a peer's delete is", peer_layout.delete(b"fork-held").outcome, flush=True)
        print("parent: the view reads", bytes(view).decode(), flush=True)
        view.release()
        client.flush_unpins()
        deadline = time.monotonic() + 20
        while (outcome := peer_layout.delete(b"fork-held").outcome) == "pinned":
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print("parent: after the release, a peer's delete is", outcome, flush=True)
    client.close()
    """
)


def test_a_forked_child_neither_uses_nor_ends_the_parents_session(server, fingerprint):
    """A child forked from a process with a client (multiprocessing's
    default start method on Linux) inherits the Python objects: using one
    is refused, ending one ends only the child's copy, and the child's
    exit, which runs their finalizers, must not close the parent's session
    — that would drop the pins of the parent's views (reliability entry
    143)."""
    forker = subprocess.run(
        [sys.executable, "-c", FORKER.format(page=PAGE), server.socket, str(fingerprint)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert forker.stdout.splitlines() == [
        "child: refused",
        "child: its own client reads the parent's chunk",
        "child: released and closed its copies",
        "parent: the child exited with 0",
        "parent: same session True",
        "parent: a peer's delete is pinned",
        "parent: the view reads the parent's chunk",
        "parent: after the release, a peer's delete is deleted",
    ], forker.stderr
    assert forker.returncode == 0, forker.stderr


C_PRODUCER = os.environ.get("CXLKV_TEST_C_PRODUCER")


@pytest.mark.skipif(not C_PRODUCER, reason="CXLKV_TEST_C_PRODUCER not set (scripts/test-ffi.sh sets it)")
def test_python_reads_what_the_c_producer_wrote(server, client):
    produced = subprocess.run([C_PRODUCER, server.socket, "10"], capture_output=True, text=True, timeout=120)
    assert produced.returncode == 0, produced.stderr
    layout = client.layout(PAGE, 0x6578616D706C65)  # the C examples' layout
    keys = [f"example/chunk/{i}" for i in range(10)]
    with layout.batch_get(keys) as views:
        for i, v in enumerate(views):
            expected = bytes((i * 31 + j * 7) % 256 for j in range(4096 * (i % 4 + 1) + i))
            assert bytes(v) == expected
    assert all(r.outcome == "deleted" for r in layout.batch_delete(keys))
    layout.close()


def test_the_documented_tier_example_runs(server):
    done = run_python(EXAMPLES / "tier.py", server.socket)
    assert done.returncode == 0, done.stderr
    assert "3 written through, 0 left in the policy, 0 staged, bytes intact" in done.stdout
