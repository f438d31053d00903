"""The L1 tier from Python: the reference's shared conformance suite
(``l1-tier-reference.md`` §7.1, all 15 cases) against a real server, and
what the Python layer adds — pages as memoryviews that raise once their
reservation ends, listeners and events, and a reader in another process."""

from __future__ import annotations

import copy
import decimal
import fractions
import gc
import inspect
import itertools
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cxlkv
from cxlkv import L1Tier, TierCode
from conftest import PAGE

CHUNK_BYTES = 100 * 2 * 512 * 2 // 64  # the reference's (100, 2, 512) bf16 layout, scaled to the page


def key(i: int) -> bytes:
    """Keys differ by a 4-byte big-endian chunk hash, as in the reference."""
    return cxlkv.ObjectKey("conformance-model", 0, i.to_bytes(4, "big")).encode()


class Recorder:
    """A listener recording every call."""

    def __init__(self):
        self.calls: list[tuple[str, list[bytes]]] = []

    def __getattr__(self, name):
        if name in ("reserved_read", "read_finished", "reserved_write", "write_finished",
                    "finish_write_and_reserve_read", "deleted", "accessed"):
            return lambda keys, name=name: self.calls.append((name, keys))
        raise AttributeError(name)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]


@pytest.fixture
def tier(layout):
    with L1Tier(layout) as t:
        yield t
        t.check_invariants()


def fill(k: bytes) -> int:
    """The byte key ``k``'s chunk is filled with."""
    return sum(k) % 256


def write(tier: L1Tier, k: bytes) -> None:
    """The suite's helper: reserve_write(new, retained) then finish_write."""
    [(code, page)] = tier.reserve_write([k], [False], CHUNK_BYTES)
    assert code == TierCode.SUCCESS
    mv = page.memoryview()
    mv[:] = bytes([fill(k)]) * len(mv)
    del mv
    assert tier.finish_write([k]) == [TierCode.SUCCESS]


def test_conformance_1_reserve_read_of_a_never_written_key(tier):
    assert tier.reserve_read([key(1)]) == [(TierCode.KEY_NOT_EXIST, None)]


def test_conformance_2_round_trip(tier):
    write(tier, key(2))
    [(code, page)] = tier.reserve_read([key(2)])
    assert code == TierCode.SUCCESS and bytes(page) == bytes([fill(key(2))]) * CHUNK_BYTES
    [(code2, page2)] = tier.unsafe_read([key(2)])
    assert code2 == TierCode.SUCCESS and page2.address() == page.address()
    assert tier.finish_read([key(2)]) == [TierCode.SUCCESS]


def test_conformance_3_reserve_write_twice_on_an_in_flight_key(tier):
    [(first, _)] = tier.reserve_write([key(3)], [False], CHUNK_BYTES)
    assert first == TierCode.SUCCESS
    assert tier.reserve_write([key(3)], [False], CHUNK_BYTES) == [(TierCode.KEY_NOT_WRITABLE, None)]


def test_conformance_4_unsafe_read_without_reserve_read(tier):
    write(tier, key(4))
    [(code, page)] = tier.unsafe_read([key(4)])
    assert code != TierCode.SUCCESS and page is None


def test_conformance_5_delete_is_locked_while_read_held(tier):
    write(tier, key(5))
    tier.reserve_read([key(5)])
    assert tier.delete([key(5)]) == [TierCode.KEY_IS_LOCKED]
    tier.finish_read([key(5)])
    assert tier.delete([key(5)]) == [TierCode.SUCCESS]


def test_conformance_6_extra_count_holds_need_as_many_finishes(tier):
    write(tier, key(6))
    tier.reserve_read([key(6)], extra_count=2)
    assert tier.delete([key(6)]) == [TierCode.KEY_IS_LOCKED]
    for _ in range(3):
        assert tier.finish_read([key(6)]) == [TierCode.SUCCESS]
    assert tier.delete([key(6)]) == [TierCode.SUCCESS]


def test_conformance_7_clear_keeps_held_reads(tier):
    write(tier, key(7))
    tier.reserve_read([key(7)])
    tier.clear()
    assert tier.unsafe_read([key(7)])[0][0] == TierCode.SUCCESS
    tier.finish_read([key(7)])


def test_conformance_8_evictability_follows_the_read_hold(tier):
    write(tier, key(8))
    assert tier.is_key_evictable(key(8))
    tier.reserve_read([key(8)])
    assert not tier.is_key_evictable(key(8))
    tier.finish_read([key(8)])
    assert tier.is_key_evictable(key(8))


def test_conformance_9_retained_promote(tier):
    [(code, page)] = tier.reserve_write([key(9)], [False], CHUNK_BYTES)
    assert code == TierCode.SUCCESS
    page.memoryview()[:4] = b"from"
    [(code, held)] = tier.finish_write_and_reserve_read([key(9)])
    assert code == TierCode.SUCCESS and bytes(held)[:4] == b"from"
    assert tier.unsafe_read([key(9)])[0][0] == TierCode.SUCCESS
    assert tier.delete([key(9)]) == [TierCode.KEY_IS_LOCKED]
    tier.finish_read([key(9)])
    assert tier.delete([key(9)]) == [TierCode.SUCCESS]


def test_conformance_10_temporary_promote(tier):
    [(code, _)] = tier.reserve_write([key(10)], [True], CHUNK_BYTES)
    assert code == TierCode.SUCCESS
    assert tier.finish_write_and_reserve_read([key(10)])[0][0] == TierCode.SUCCESS
    assert tier.unsafe_read([key(10)])[0][0] == TierCode.SUCCESS
    assert tier.finish_read([key(10)]) == [TierCode.SUCCESS]
    assert tier.unsafe_read([key(10)]) == [(TierCode.KEY_NOT_EXIST, None)]


def test_conformance_11_promote_never_fires_write_finished(tier):
    tier.reserve_write([key(11)], [False], CHUNK_BYTES)
    rec = Recorder()
    tier.register_listener(rec)
    tier.finish_write_and_reserve_read([key(11)])
    assert ("finish_write_and_reserve_read", [key(11)]) in rec.calls
    assert "write_finished" not in rec.names()
    tier.finish_read([key(11)])


def test_conformance_12_reserve_read_of_a_write_reserved_key(tier):
    tier.reserve_write([key(12)], [False], CHUNK_BYTES)
    assert tier.reserve_read([key(12)]) == [(TierCode.KEY_NOT_READABLE, None)]


def test_conformance_13_finishes_of_never_reserved_keys(tier):
    assert tier.finish_read([key(13)]) == [TierCode.KEY_NOT_EXIST]
    assert tier.finish_write([key(13)]) == [TierCode.KEY_NOT_EXIST]


def test_conformance_14_delete_of_a_missing_key(tier):
    assert tier.delete([key(14)]) == [TierCode.KEY_NOT_EXIST]


def test_conformance_15_listener_lifecycle(tier):
    rec = Recorder()
    tier.register_listener(rec)
    k = key(15)
    [(_, page)] = tier.reserve_write([k], [False], CHUNK_BYTES)
    del page
    tier.finish_write([k])
    tier.reserve_read([k])
    tier.touch_keys([k])
    tier.finish_read([k])
    assert tier.delete([k]) == [TierCode.SUCCESS]
    heard = [(n, keys) for n, keys in rec.calls if keys]
    assert heard == [
        ("reserved_write", [k]),
        ("write_finished", [k]),
        ("reserved_read", [k]),
        ("accessed", [k]),
        ("read_finished", [k]),
        ("deleted", [k]),
    ]


def test_the_protocols_17_operations_are_all_there():
    ops = [
        "register_listener", "reserve_read", "unsafe_read", "finish_read", "reserve_write",
        "finish_write", "finish_write_and_reserve_read", "delete", "touch_keys", "clear",
        "is_key_evictable", "get_memory_usage", "get_l1_memory_desc", "close", "report_status",
        "get_object_state", "memcheck",
    ]
    for op in ops:
        assert callable(getattr(L1Tier, op)), op
    assert list(inspect.signature(L1Tier.reserve_read).parameters)[:3] == ["self", "keys", "extra_count"]
    assert inspect.signature(L1Tier.delete).parameters["force"].default is False


# --- beyond the suite ----------------------------------------------------------


def test_status_usage_and_the_parity_answers(tier):
    write(tier, key(20))
    tier.reserve_read([key(20)])
    status = tier.report_status()
    assert status["backend"] == "cxlkv" and status["is_healthy"]
    assert status["read_locked_count"] == 1 and status["write_ttl_seconds"] == 600
    used, total = tier.get_memory_usage()
    assert used >= PAGE and total >= used
    assert tier.get_l1_memory_desc() is None and tier.get_object_state(key(20)) is None
    assert tier.memcheck()
    assert tier.inspect(key(20)) == {"stage": "read_staged", "temporary": False, "holds": 1, "pinned": 1}
    assert tier.stats()["lookups"] >= 1
    tier.finish_read([key(20)])


def test_bad_calls_are_refused_as_a_whole(tier):
    with pytest.raises(cxlkv.TierArgumentError) as e:
        tier.reserve_read([key(21), key(21)])
    assert e.value.status == cxlkv.Status.TIER_DUPLICATE_KEY and isinstance(e.value, ValueError)
    with pytest.raises(cxlkv.TierArgumentError):
        tier.reserve_write([key(21)], [False], CHUNK_BYTES, mode="all")
    with pytest.raises(cxlkv.TierArgumentError):
        tier.reserve_write([key(21), key(22)], [False], CHUNK_BYTES)
    assert tier.inspect(key(21))["stage"] == "untracked"


def test_a_listener_calling_back_into_its_tier_is_refused_not_deadlocked(tier):
    seen = []

    class Reentrant:
        def write_finished(self, keys):
            try:
                tier.report_status()
            except cxlkv.TierError as e:
                seen.append(e.status)
            seen.append(tier.is_key_evictable(keys[0]))  # lock-free: answered

    tier.register_listener(Reentrant())
    write(tier, key(23))
    assert seen == [cxlkv.Status.TIER_REENTRANT, True]


def test_events_carry_the_references_names(layout):
    events = []
    with L1Tier(layout, on_event=lambda name, keys: events.append((name, keys))) as t:
        write(t, key(24))
        t.reserve_read([key(24)])
        t.finish_read([key(24)])
        t.delete([key(24)])
    names = [n for n, _ in events]
    assert names == [
        "L1_WRITE_RESERVED",
        "L1_WRITE_FINISHED",
        "L1_READ_RESERVED",
        "L1_READ_FINISHED",
        "L1_KEYS_EVICTED",  # finish_read: nothing reclaimed
        "L1_KEYS_EVICTED",
    ]
    assert events[1] == ("L1_WRITE_FINISHED", [key(24)])


def test_a_page_memoryview_blocks_the_finish_and_the_page_raises_after(tier):
    write(tier, key(25))
    [(_, page)] = tier.reserve_read([key(25)])
    mv = page.memoryview()
    assert mv.readonly
    with pytest.raises(BufferError):
        tier.finish_read([key(25)])
    assert tier.inspect(key(25))["holds"] == 1, "nothing changed"
    del mv
    tier.finish_read([key(25)])
    assert page.released
    with pytest.raises(cxlkv.ViewReleasedError):
        page.memoryview()


def test_a_write_page_is_writable_until_its_finish(tier):
    [(_, page)] = tier.reserve_write([key(26)], [False], 10)
    mv = page.memoryview()
    mv[:] = b"0123456789"
    with pytest.raises(BufferError):
        tier.finish_write([key(26)])
    del mv
    tier.finish_write([key(26)])
    with pytest.raises(cxlkv.ViewReleasedError):
        page.memoryview()
    [(_, held)] = tier.reserve_read([key(26)])
    assert bytes(held) == b"0123456789"
    tier.finish_read([key(26)])


def test_holds_outlive_a_partial_finish(tier):
    write(tier, key(27))
    [(_, page)] = tier.reserve_read([key(27)], holds=2)
    tier.finish_read([key(27)])
    assert not page.released and bytes(page)[:1] == bytes([fill(key(27))])
    tier.finish_read([key(27)])
    assert page.released


def test_expired_reservations_are_swept(layout):
    with L1Tier(layout, write_ttl_s=0.001) as t:
        [(_, page)] = t.reserve_write([key(28)], [False], 10)
        time.sleep(0.02)
        assert t.sweep_now() == (1, 0)
        assert page.released
        assert t.finish_write([key(28)]) == [TierCode.KEY_NOT_EXIST]


def test_close_releases_every_page(layout):
    t = L1Tier(layout)
    write(t, key(29))
    [(_, page)] = t.reserve_read([key(29)])
    t.close()
    assert page.released
    with pytest.raises(cxlkv.HandleError):
        t.reserve_read([key(29)])


def test_a_page_memoryview_keeps_its_tier_open(layout):
    layout.alloc().abort()  # the layout has a region: free_pages is steady
    before = layout.info()["free_pages"]
    t = L1Tier(layout)
    [(code, page)] = t.reserve_write([key(40)], [True], CHUNK_BYTES)
    assert code == TierCode.SUCCESS
    mv = page.memoryview()
    del t, page
    gc.collect()
    assert layout.info()["free_pages"] == before - 1, "the tier is open: its write page is reserved"
    mv[:4] = b"live"
    del mv
    gc.collect()
    assert layout.info()["free_pages"] == before, "the tier closed with its last memoryview"


def test_page_tracking_does_not_grow_with_every_key(tier):
    batch = 100
    for b in range(10_000 // batch):
        keys = [key(100_000 + b * batch + i) for i in range(batch)]
        written = tier.reserve_write(keys, [False] * batch, 16)
        assert all(code == TierCode.SUCCESS for code, _ in written)
        assert tier.finish_write(keys) == [TierCode.SUCCESS] * batch
        read = tier.reserve_read(keys)
        assert all(code == TierCode.SUCCESS for code, _ in read)
        assert tier.finish_read(keys) == [TierCode.SUCCESS] * batch
        assert tier.delete(keys) == [TierCode.SUCCESS] * batch
    del written, read
    assert len(tier._pages) <= 2 * batch, "entries of finished keys are pruned"


def test_threads_stage_while_another_clears_and_sweeps(tier, layout):
    threads_n, per_thread = 4, 150
    keys = [[f"thread-{t}-{i}".encode() for i in range(per_thread)] for t in range(threads_n)]
    for ks in keys:
        assert all(r.inserted for r in layout.batch_put((k, b"x") for k in ks))
    errors: list = []
    done = threading.Event()

    def reader(ks):
        try:
            for k in ks:
                # (No memoryview: clear() would rightly refuse while one lives.)
                [(code, page)] = tier.reserve_read([k])
                assert code == TierCode.SUCCESS and len(page) == 1
                assert tier.finish_read([k]) == [TierCode.SUCCESS]
        except BaseException as e:  # reported below
            errors.append(e)

    def janitor():
        try:
            while not done.is_set():
                tier.clear()
                tier.sweep_now()
        except BaseException as e:  # reported below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        readers = [threading.Thread(target=reader, args=(ks,)) for ks in keys]
        sweeper = threading.Thread(target=janitor)
        sweeper.start()
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        done.set()
        sweeper.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    for ks in keys:
        assert {r.outcome for r in layout.batch_delete(ks)} == {"deleted"}


def test_a_close_refused_from_a_listener_leaves_the_tier_open(server, layout, fingerprint):
    k = key(41)
    with cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20) as peer_client:
        peer = peer_client.layout(PAGE, fingerprint)
        t = L1Tier(layout)
        refused = []

        class Closer:
            def write_finished(self, keys):
                try:
                    t.close()
                except cxlkv.TierError as e:
                    refused.append(e.status)

        t.register_listener(Closer())
        write(t, k)
        assert refused == [cxlkv.Status.TIER_REENTRANT]
        [(code, page)] = t.reserve_read([k])  # the tier still works
        assert code == TierCode.SUCCESS and not page.released
        assert peer.delete(k).outcome == "pinned"
        t.close()
        assert page.released
        assert peer.delete(k).outcome == "deleted", "the close released the tier's pins"


def _closing_client_on(callback: str, client: cxlkv.Client) -> object:
    """A listener whose ``callback`` closes ``client``, in the middle of a
    tier call."""

    class Closer:
        pass

    closer = Closer()
    setattr(closer, callback, lambda keys: client.close())
    return closer


@pytest.mark.parametrize("op", ["finish_read", "delete", "clear"])
def test_a_listener_closing_the_client_does_not_undo_the_call_that_took_effect(
    client, layout, op
):
    # Found by a review: the call's C side took effect, then its
    # revalidation of the pages asked the closed client and raised
    # ClosedError — finish_read's page stayed usable though its pin was gone.
    held = key(46)
    t = L1Tier(layout)
    write(t, held)
    [(code, page)] = t.reserve_read([held])
    assert code == TierCode.SUCCESS
    if op == "finish_read":
        t.register_listener(_closing_client_on("read_finished", client))
        assert t.finish_read([held]) == [TierCode.SUCCESS]
        assert page.released, "the reservation ended with the call"
        with pytest.raises(cxlkv.ViewReleasedError):
            page.memoryview()
    else:
        if op == "delete":
            t.register_listener(_closing_client_on("deleted", client))
            assert t.delete([held]) == [TierCode.KEY_IS_LOCKED]
        else:
            temp = key(47)
            [(code, _)] = t.reserve_write([temp], [True], CHUNK_BYTES)
            assert code == TierCode.SUCCESS
            assert t.finish_write([temp]) == [TierCode.SUCCESS]
            t.register_listener(_closing_client_on("deleted", client))
            t.clear()  # reclaims the idle temporary: `deleted` fires
        assert not page.released, "the held read is still held"
        assert bytes(page) == bytes([fill(held)]) * CHUNK_BYTES
    with pytest.raises(cxlkv.ClosedError):
        t.reserve_read([held])
    t.close()
    assert page.released


def test_reserve_write_with_more_flags_than_keys_is_a_length_mismatch(tier):
    with pytest.raises(cxlkv.TierArgumentError) as e:
        tier.reserve_write([key(42)], [False, True], CHUNK_BYTES)
    assert e.value.status == cxlkv.Status.TIER_LENGTH_MISMATCH
    assert tier.inspect(key(42))["stage"] == "untracked"


def test_a_whole_page_reservation_needs_no_open_layout_handle(client, fingerprint):
    layout = client.layout(PAGE, fingerprint)
    with L1Tier(layout) as t:
        layout.close()
        [(code, page)] = t.reserve_write([key(43)], [True])
        assert code == TierCode.SUCCESS and len(page) == PAGE
        assert t.finish_write([key(43)]) == [TierCode.SUCCESS]


def test_sub_millisecond_ttls_round_up_and_bad_constructor_arguments_are_refused(layout):
    with L1Tier(layout, write_ttl_s=0.0004, read_ttl_s=0.3) as t:
        status = t.report_status()
        assert status["write_ttl_seconds"] == 0.001 and status["read_ttl_seconds"] == 0.3
    for bad in (0, -1, float("nan"), float("inf"), 365 * 86400 + 1, 2**62):
        with pytest.raises(cxlkv.ArgumentError, match=r"write_ttl_s=.*at most 31536000"):
            L1Tier(layout, write_ttl_s=bad)
    with L1Tier(layout, read_ttl_s=365 * 86400) as t:
        assert t.report_status()["read_ttl_seconds"] == 365 * 86400
    with pytest.raises(TypeError, match=r"L1Tier\(layout\): expected a cxlkv.Layout .* not Client"):
        L1Tier(layout._client)
    with pytest.raises(TypeError, match=r"L1Tier\(on_event\): expected a callable"):
        L1Tier(layout, on_event="L1_WRITE_FINISHED")
    # Not a number: float() would take "600" and name no argument for None.
    for bad in ("600", b"600", None, True, object()):
        with pytest.raises(TypeError, match=r"read_ttl_s must be a number of seconds"):
            L1Tier(layout, read_ttl_s=bad)
    # Any other number float() takes is one: Decimal, Fraction.
    for good, seconds in ((decimal.Decimal("1.5"), 1.5), (fractions.Fraction(1, 2), 0.5)):
        with L1Tier(layout, read_ttl_s=good) as t:
            assert t.report_status()["read_ttl_seconds"] == seconds


def test_a_ttl_too_large_for_a_float_is_out_of_range_not_an_overflow(layout):
    # float() of such a number raises OverflowError, which named neither
    # the argument nor the range; an infinite TTL is an ArgumentError.
    for bad in (10**400, -(10**400), fractions.Fraction(10**400, 3)):
        with pytest.raises(cxlkv.ArgumentError, match=r"write_ttl_s=.*at most 31536000"):
            L1Tier(layout, write_ttl_s=bad)


HOLDER = textwrap.dedent(
    """
    import sys, cxlkv
    client = cxlkv.Client.connect(sys.argv[1])
    layout = client.layout({page}, int(sys.argv[2]))
    tier = cxlkv.L1Tier(layout)
    [(code, page)] = tier.reserve_read([bytes.fromhex(sys.argv[3])])
    assert code == cxlkv.TierCode.SUCCESS, code
    print("holding", bytes(page)[:1].hex(), flush=True)
    sys.stdin.readline()
    del page
    print("finished", tier.finish_read([bytes.fromhex(sys.argv[3])])[0].name, flush=True)
    sys.stdin.readline()
    """
)


def test_another_processes_read_hold_blocks_delete_until_its_finish(server, tier, fingerprint):
    k = key(30)
    write(tier, k)
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(page=PAGE), server.socket, str(fingerprint), k.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline().split() == ["holding", f"{fill(k):02x}"]
        assert tier.delete([k]) == [TierCode.KEY_IS_LOCKED], "pinned by the other process"
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().split() == ["finished", "SUCCESS"]
        assert tier.delete([k]) == [TierCode.SUCCESS], "finish_read released its pins at once"
    finally:
        other.kill()
        other.wait()


SMALL_BATCH = 64


@pytest.fixture(scope="module")
def small_batch_server():
    """A server whose sessions carry at most SMALL_BATCH keys per call."""
    from conftest import Server

    s = Server(env={"CXLKV_DIRECTORY_MAX_BATCH": str(SMALL_BATCH)})
    yield s
    s.stop()


def test_more_live_pages_than_one_call_carries_are_revalidated_in_batches(
    small_batch_server, fingerprint
):
    # After clear or sweep_now the tier asks which of every tracked read
    # page is still held: more keys than the session's batch limit.
    keys = [key(1000 + i) for i in range(SMALL_BATCH + 36)]
    with cxlkv.Client.connect(small_batch_server.socket, region_size_bytes=4 << 20) as client:
        with client.layout(PAGE, fingerprint) as lay, L1Tier(lay) as tier:
            with pytest.raises(cxlkv.ArgumentError) as e:
                tier.reserve_read(keys)
            assert e.value.status == cxlkv.Status.BATCH_TOO_LARGE, "the limit is the server's"
            for at in range(0, len(keys), SMALL_BATCH):
                batch = keys[at : at + SMALL_BATCH]
                assert lay.batch_put([(k, bytes([fill(k)]) * 64) for k in batch])
            pages = []
            for at in range(0, len(keys), SMALL_BATCH):
                results = tier.reserve_read(keys[at : at + SMALL_BATCH])
                assert [code for code, _ in results] == [TierCode.SUCCESS] * len(results)
                pages += [page for _, page in results]
            assert tier.sweep_now() == (0, 0)
            assert not any(p.released for p in pages), "every read is still held"
            tier.clear()
            assert not any(p.released for p in pages), "a non-force clear keeps held reads"
            tier.clear(force=True)
            assert all(p.released for p in pages), "a forced clear ended every reservation"
            assert tier.report_status()["read_locked_count"] == 0
            assert tier.sweep_now() == (0, 0)
            tier.check_invariants()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_tier_and_its_pages_refuse_to_be_copied_or_pickled(tier, how):
    # A copied page is not tracked by the tier: it would stay unreleased
    # when its reservation ends and read a page that may be reused. A copied
    # tier, collected, would close the original's handle and give its hold
    # on the session back a second time.
    duplicate = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    write(tier, key(50))
    [(code, page)] = tier.reserve_read([key(50)])
    assert code == TierCode.SUCCESS
    for obj in (page, tier):
        with pytest.raises(TypeError, match=type(obj).__name__):
            duplicate(obj)
    assert bytes(page) == bytes([fill(key(50))]) * CHUNK_BYTES, "the originals still work"
    assert tier.finish_read([key(50)]) == [TierCode.SUCCESS]
    assert page.released


@pytest.mark.parametrize(
    "single",
    ["ka", b"ka", bytearray(b"ka"), memoryview(b"ka"), cxlkv.ObjectKey("k", 0, b"a")],
    ids=["str", "bytes", "bytearray", "memoryview", "ObjectKey"],
)
def test_a_single_key_given_for_keys_is_refused_before_anything_is_done(tier, single):
    # "ka" is an iterable of the keys "k" and "a" (and b"ka" of two ints):
    # it must not reserve, finish or delete those keys.
    for k in (b"k", b"a"):
        write(tier, k)
    tier.reserve_read([b"k"])
    rec = Recorder()
    tier.register_listener(rec)
    before = tier.stats()
    calls = {
        "reserve_read": lambda: tier.reserve_read(single),
        "unsafe_read": lambda: tier.unsafe_read(single),
        "finish_read": lambda: tier.finish_read(single),
        "reserve_write": lambda: tier.reserve_write(single, [False, False], CHUNK_BYTES),
        "finish_write": lambda: tier.finish_write(single),
        "finish_write_and_reserve_read": lambda: tier.finish_write_and_reserve_read(single),
        "delete": lambda: tier.delete(single),
        "touch_keys": lambda: tier.touch_keys(single),
    }
    for name, call in calls.items():
        refused = rf"{name}\(keys\): expected an iterable of keys, not a single"
        with pytest.raises(TypeError, match=refused):
            call()
    # A str for the flags would be as many true flags.
    with pytest.raises(TypeError, match="is_temporary"):
        tier.reserve_write([b"x", b"y"], "no", CHUNK_BYTES)
    assert rec.calls == [], "no call reached the tier"
    assert tier.stats() == before
    assert tier.inspect(b"k")["holds"] == 1, "the hold taken before, no other"
    for k in (b"a", b"x", b"y"):
        assert tier.inspect(k)["stage"] == "untracked"
    assert tier.finish_read([b"k"]) == [TierCode.SUCCESS]


def test_a_key_of_the_wrong_type_is_named_by_its_call_and_position(tier):
    with pytest.raises(TypeError, match=r"finish_read\(keys\): key 1: .* not int"):
        tier.finish_read([b"a", 7])
    with pytest.raises(TypeError, match=r"delete\(keys\): key 0: .* ObjectKey; give its .encode"):
        tier.delete([cxlkv.ObjectKey("m", 0, b"\x01")])


class _ReferenceNamedListener:
    """A listener written for the reference's manager (its §2.3 names)."""

    def __init__(self):
        self.calls = []

    def on_l1_keys_write_finished(self, keys):
        self.calls.append(keys)

    def on_l1_keys_deleted_by_manager(self, keys):
        self.calls.append(keys)


class _NotCallable:
    deleted = "evict"


def test_a_listener_that_would_never_be_called_is_refused(tier):
    # Registered, such a listener is silently never called: an eviction
    # policy never told of a deletion, a store controller never of a write.
    with pytest.raises(TypeError, match=r"none of the listener methods .*never be called$"):
        tier.register_listener(object())
    ref = _ReferenceNamedListener()
    with pytest.raises(
        TypeError,
        match=r"rename on_l1_keys_write_finished -> write_finished, "
        r"on_l1_keys_deleted_by_manager -> deleted\)",
    ):
        tier.register_listener(ref)
    with pytest.raises(TypeError, match=r"listener's deleted is a str, not a method"):
        tier.register_listener(_NotCallable())
    # Nothing was registered; a listener with the package's names is called.
    rec = Recorder()
    tier.register_listener(rec)
    write(tier, key(70))
    assert ref.calls == []
    assert rec.calls == [("reserved_write", [key(70)]), ("write_finished", [key(70)])]


def test_an_int_outside_its_c_type_is_refused_not_truncated_or_clamped(tier):
    # ctypes keeps the low bits: a length of 2**64 + n would reserve n
    # bytes; a negative count used to be clamped to one hold.
    write(tier, key(51))
    [(code, page)] = tier.reserve_read([key(51)])
    assert code == TierCode.SUCCESS
    for name, bad in (
        ("extra_count", lambda: tier.reserve_read([key(51)], extra_count=-1)),
        ("extra_count", lambda: tier.reserve_read([key(51)], extra_count=1 << 32)),
        ("holds", lambda: tier.reserve_read([key(51)], holds=-1)),
        ("holds", lambda: tier.reserve_read([key(51)], holds=1 << 32)),
        ("extra_count", lambda: tier.finish_read([key(51)], extra_count=-2)),
        ("holds", lambda: tier.finish_read([key(51)], holds=(1 << 32) + 1)),
        ("len_bytes", lambda: tier.reserve_write([key(52)], [False], (1 << 64) + CHUNK_BYTES)),
        ("len_bytes", lambda: tier.reserve_write([key(52)], [False], -1)),
    ):
        with pytest.raises(cxlkv.ArgumentError, match=rf"{name}=.* out of range") as e:
            bad()
        assert e.value.status == cxlkv.Status.INVALID_ARGUMENT
    assert tier.inspect(key(51))["holds"] == 1, "no hold taken or given back"
    assert tier.inspect(key(52))["stage"] == "untracked"
    [(code, _)] = tier.reserve_write([key(53)], [True], CHUNK_BYTES)
    with pytest.raises(cxlkv.ArgumentError, match="holds"):
        tier.finish_write_and_reserve_read([key(53)], holds=-1)
    assert tier.inspect(key(53))["stage"] == "write_staged"
    with pytest.raises(TypeError, match="holds"):
        tier.reserve_read([key(51)], holds=1.5)
    assert tier.finish_read([key(51)]) == [TierCode.SUCCESS]
    assert page.released
    assert tier.finish_write([key(53)]) == [TierCode.SUCCESS]


def test_a_tier_batch_over_the_librarys_limit_is_refused_before_anything_is_allocated(tier):
    # Reliability entry 107: as the layout's batch calls.
    endless = itertools.repeat(key(1))
    for call in (tier.reserve_read, tier.unsafe_read, tier.finish_read, tier.touch_keys):
        with pytest.raises(cxlkv.ArgumentError, match=f"more than {cxlkv.MAX_BATCH} exceeds") as e:
            call(endless)
        assert e.value.status == cxlkv.Status.BATCH_TOO_LARGE
    with pytest.raises(cxlkv.TierArgumentError, match="more than 1 is_temporary flags") as e:
        tier.reserve_write([key(43)], itertools.repeat(False), CHUNK_BYTES)
    assert e.value.status == cxlkv.Status.TIER_LENGTH_MISMATCH
    assert tier.inspect(key(43))["stage"] == "untracked"



def _try_export(page) -> object:
    """``page.memoryview()``, or the type of what it raised."""
    try:
        return page.memoryview()
    except (BufferError, cxlkv.ViewReleasedError) as e:
        return type(e)


# (operation, the listener callback that runs inside its C call)
_ENDING_CALLS = [
    ("finish_read", "read_finished"),
    ("finish_write", "write_finished"),
    ("promote", "finish_write_and_reserve_read"),
    ("delete", "deleted"),
    ("clear_force", "deleted"),
    # No listener runs inside these two: their C function is wrapped to ask
    # first (as another thread may while the real call runs).
    ("sweep_now", None),
    ("close", None),
]


@pytest.mark.parametrize("op,callback", _ENDING_CALLS, ids=[op for op, _ in _ENDING_CALLS])
def test_no_memoryview_is_exported_while_a_call_may_end_its_reservation(
    layout, monkeypatch, op, callback
):
    # Found by a review: a call checked that no memoryview was alive, then
    # ran its C call (the GIL released, a round trip inside) while
    # page.memoryview() looked only at the page's address, cleared after
    # the call — a listener (or another thread) got a memoryview that
    # outlived the reservation: writable into a registered shared chunk
    # after finish_write, reading a page that may be reused after
    # finish_read.
    k = key(60 + [op for op, _ in _ENDING_CALLS].index(op))
    exported: list = []
    target: list = []  # the page to ask for, once set

    def inside(*_):
        if target:
            exported.append(_try_export(target[0]))

    if callback is None:
        name = f"cxlkv_tier_{op}"
        real = getattr(cxlkv._native.lib, name)

        def wrapped(*args):
            inside()
            return real(*args)

        monkeypatch.setattr(cxlkv._native.lib, name, wrapped)
    t = L1Tier(layout, write_ttl_s=0.001 if op == "sweep_now" else 600.0)
    try:
        if callback is not None:
            listener = type("Exporter", (), {callback: lambda self, keys: inside()})()
            t.register_listener(listener)
        if op in ("finish_write", "promote", "sweep_now"):
            [(code, page)] = t.reserve_write([k], [op == "promote"], CHUNK_BYTES)
        else:
            write(t, k)
            [(code, page)] = t.reserve_read([k])
        assert code == TierCode.SUCCESS
        target.append(page)
        if op == "finish_read":
            assert t.finish_read([k]) == [TierCode.SUCCESS]
        elif op == "finish_write":
            assert t.finish_write([k]) == [TierCode.SUCCESS]
        elif op == "promote":
            [(code, _)] = t.finish_write_and_reserve_read([k])
            assert code == TierCode.SUCCESS
        elif op == "delete":
            # Refused (the key is held here), but `deleted` fires inside.
            assert t.delete([k]) == [TierCode.KEY_IS_LOCKED]
        elif op == "clear_force":
            t.clear(force=True)
        elif op == "sweep_now":
            time.sleep(0.01)
            assert t.sweep_now() == (1, 0)
        else:
            t.close()
        leaked = [e for e in exported if isinstance(e, memoryview)]
        for mv in leaked:
            mv.release()
        assert exported == [BufferError], f"{op}: inside the call, memoryview() gave {exported}"
        if op == "delete":
            # The call did not end the reservation: the page is usable again.
            assert not page.released and bytes(page) == bytes([fill(k)]) * CHUNK_BYTES
            assert t.finish_read([k]) == [TierCode.SUCCESS]
        assert page.released
    finally:
        monkeypatch.undo()
        t.close()


def test_a_memoryview_asked_for_on_another_thread_during_a_finish_is_refused(layout):
    # The same defect as above, from another thread: the listener parks
    # the finish_write call inside its C call until the other thread has
    # asked for the page's memoryview.
    k = key(70)
    asked = threading.Event()
    inside = threading.Event()
    result: list = []

    class Parker:
        def write_finished(self, keys):
            inside.set()
            assert asked.wait(10), "the other thread never asked"

    with L1Tier(layout) as t:
        t.register_listener(Parker())
        [(code, page)] = t.reserve_write([k], [False], CHUNK_BYTES)
        assert code == TierCode.SUCCESS

        def other():
            assert inside.wait(10), "the finish never reached its listener"
            result.append(_try_export(page))
            asked.set()

        thread = threading.Thread(target=other)
        thread.start()
        try:
            assert t.finish_write([k]) == [TierCode.SUCCESS]
        finally:
            asked.set()
            thread.join(10)
        leaked = [r for r in result if isinstance(r, memoryview)]
        for mv in leaked:
            mv.release()
        assert result == [BufferError], f"another thread got {result} during finish_write"
        assert page.released


def test_a_failed_ending_call_leaves_its_pages_exportable(client, layout):
    # The pages marked for a call are unmarked when it raises (here after
    # the marking: the client is closed, so the C call is refused), not
    # left refusing every memoryview.
    k = key(71)
    t = L1Tier(layout)
    write(t, k)
    [(code, page)] = t.reserve_read([k])
    assert code == TierCode.SUCCESS
    client.close()  # deferred: the tier holds the session
    with pytest.raises(cxlkv.ClosedError):
        t.finish_read([k])
    assert not page.released
    mv = page.memoryview()
    assert bytes(mv[:1]) == bytes([fill(k)])
    del mv
    t.close()
    assert page.released


KEPT_PAST_THE_SWEEP = textwrap.dedent(
    """
    import sys, threading, time, cxlkv
    socket, fingerprint = sys.argv[1], int(sys.argv[2])
    unmapped = []
    def on_unmap(region_id, offset_bytes, base, len_bytes):
        unmapped.append(region_id)
    def wait_for(what, cond, timeout_s=10):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)
    # Two other instances publish a key each, in their own regions.
    producers = [cxlkv.Client.connect(socket, region_size_bytes=4 << 20) for _ in range(2)]
    for client, k, fill in zip(producers, (b"k1", b"k2"), (b"A", b"B")):
        assert client.layout({page}, fingerprint).put(k, fill * 1000).inserted
    # The reader keeps at most one peer region mapped.
    reader = cxlkv.Client.connect(
        socket, region_size_bytes=4 << 20, max_peer_mappings=1, on_unmap=on_unmap
    )
    layout = reader.layout({page}, fingerprint)
    tier = cxlkv.L1Tier(layout, write_ttl_s=0.2, read_ttl_s=0.2)
    [(code, page)] = tier.reserve_read([b"k1"])
    assert code == cxlkv.TierCode.SUCCESS, code
    region = page.location.region_id
    mv = page.memoryview()
    # The tier's own sweeper (every second here) reclaims the expired read:
    # nothing Python does can stop it.
    wait_for("the sweeper reclaimed the read", lambda: tier.stats()["swept"] == 1)
    # Reading the other key maps its region and evicts the first one.
    with layout.get(b"k2"):
        pass
    assert reader.stats()["peer_regions_evicted"] == 1
    time.sleep(0.6)  # the maintenance thread's ticks (100 ms) would unmap it
    print("kept", bytes(mv[:4]).decode(), flush=True)  # faulted here (SIGSEGV)
    assert region not in unmapped, "the region was unmapped under a live memoryview"
    del mv, page
    wait_for("the region unmapped once its last memoryview went", lambda: region in unmapped)
    print("unmapped", flush=True)
    tier.close()
    reader.close()
    """
)


def test_a_memoryview_kept_past_the_ttl_sweep_stays_mapped(server, fingerprint):
    # Found by a review: the memoryview held the page and the tier, not the
    # mapping behind it — the staging entry held that, and the sweeper
    # dropped it. Evicting the peer region from the mapping cache then
    # unmapped it, and reading the memoryview killed the process (SIGSEGV)
    # instead of reading stale bytes. Pages now hold their mapping
    # (CXLKV_TIER_HOLD_MAPPINGS) until their last memoryview goes.
    done = subprocess.run(
        [sys.executable, "-c", KEPT_PAST_THE_SWEEP.format(page=PAGE), server.socket,
         str(fingerprint)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split("\n")[:2] == ["kept AAAA", "unmapped"]
