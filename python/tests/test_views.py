"""Views are memoryviews over the shared pool that can never read freed
memory: a released view raises, and a view is not released while any
memoryview of it (or a slice, or a memoryview in a reference cycle) lives."""

from __future__ import annotations

import copy
import ctypes
import gc
import pickle
import threading

import pytest

import cxlkv
from conftest import PAGE


@pytest.fixture
def view(layout):
    layout.put(b"v", bytes(range(200)))
    v = layout.get(b"v")
    yield v
    v.release()


def test_a_released_view_raises_instead_of_dangling(view):
    view.release()
    assert view.released
    for use in (view.memoryview, view.address, lambda: bytes(view)):
        with pytest.raises(cxlkv.ViewReleasedError):
            use()
    view.release()  # idempotent


def test_a_retained_memoryview_blocks_release_and_stays_readable(view):
    mv = view.memoryview()
    with pytest.raises(BufferError):
        view.release()
    assert not view.released and mv[:3] == bytes([0, 1, 2])
    del mv
    view.release()
    assert view.released


def test_a_retained_slice_or_cast_blocks_release(view):
    part = view.memoryview()[10:20]
    with pytest.raises(BufferError):
        view.release()
    assert part == bytes(range(10, 20))
    del part
    words = view.memoryview().cast("I")
    with pytest.raises(BufferError):
        view.release()
    del words
    view.release()


def test_a_memoryview_only_in_a_reference_cycle_does_not_block_release(view):
    cycle = [view.memoryview()]
    cycle.append(cycle)
    del cycle
    view.release()  # collects the cycle first


def test_memoryviews_are_read_only(view):
    mv = view.memoryview()
    with pytest.raises(TypeError):
        mv[0] = 1
    del mv


def test_a_view_collected_unreleased_releases_its_pin(client, layout):
    layout.put(b"c", b"collected")
    v = layout.get(b"c")
    assert layout.delete(b"c").outcome == "pinned"
    del v
    gc.collect()
    client.flush_unpins()
    assert layout.delete(b"c").outcome == "deleted"


def test_a_memoryview_outliving_its_view_object_keeps_the_pin(client, layout):
    layout.put(b"o", b"outlives")
    v = layout.get(b"o")
    mv = v.memoryview()
    del v
    gc.collect()
    client.flush_unpins()
    assert layout.delete(b"o").outcome == "pinned", "the memoryview still reads the chunk"
    assert mv == b"outlives"
    del mv
    gc.collect()
    client.flush_unpins()
    assert layout.delete(b"o").outcome == "deleted"


class _CallersError(Exception):
    pass


def test_an_exception_in_a_with_block_is_not_replaced_by_the_live_memoryviews_buffererror(
    client, layout
):
    # The documented idiom deletes the memoryview at the end of the block;
    # an exception before that line leaves it alive. The caller's exception
    # must propagate (an `except` for it must still catch it), not a
    # BufferError from the exit: the view, lease or tier is then released,
    # aborted or closed once the memoryview goes, as when collected.
    layout.put(b"x1", b"one")
    layout.put(b"x2", b"two")
    with pytest.raises(_CallersError):
        with layout.get(b"x1") as view:
            data = view.memoryview()
            raise _CallersError()
    assert not view.released and data == b"one"
    with pytest.raises(_CallersError):
        with layout.batch_get([b"x1", b"x2"]) as views:
            more = views[1].memoryview()
            raise _CallersError()
    assert views[0].released and not views[1].released
    with pytest.raises(_CallersError):
        with layout.alloc() as lease:
            page = lease.memoryview()
            raise _CallersError()
    with pytest.raises(_CallersError):
        with cxlkv.L1Tier(layout) as tier:
            [(_, tier_page)] = tier.reserve_write([b"x3"], [False], 3)
            written = tier_page.memoryview()
            raise _CallersError()
    assert layout.batch_delete([b"x1", b"x2"]) == [cxlkv.DeleteResult("pinned", 1)] * 2
    # Without an exception, the exit still refuses.
    with pytest.raises(BufferError):
        with layout.get(b"x1") as again:
            kept = again.memoryview()
    del data, more, page, kept, written
    view.release()
    views.release()
    again.release()
    lease.abort()
    tier.close()
    client.flush_unpins()
    assert layout.batch_delete([b"x1", b"x2"]) == [cxlkv.DeleteResult("deleted")] * 2
    assert not layout.exists(b"x3")


def test_the_memoryview_is_the_pools_memory_not_a_copy(layout):
    lease = layout.alloc()
    page = lease.memoryview()
    written_at = ctypes.addressof(page.obj)
    page[:4] = b"same"
    del page
    lease.set_len(4)
    layout.register(b"same", lease)
    with layout.get(b"same") as v:
        mv = v.memoryview()
        assert ctypes.addressof(mv.obj) == written_at == v.address()
        del mv


def test_a_memoryview_keeps_its_client_and_session_alive(server, fingerprint):
    with cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20) as peer_client:
        peer = peer_client.layout(PAGE, fingerprint)
        unmapped = []
        client = cxlkv.Client.connect(
            server.socket, region_size_bytes=4 << 20, on_unmap=lambda *info: unmapped.append(info)
        )
        lay = client.layout(PAGE, fingerprint)
        lay.put(b"s", b"session")
        mv = lay.get(b"s").memoryview()
        del client, lay
        gc.collect()
        assert peer.delete(b"s").outcome == "pinned", "the session (and its pin) is still open"
        assert mv == b"session" and unmapped == []
        del mv
        gc.collect()
        assert len(unmapped) == 1, "the region was unmapped through the live callback"
        assert peer.delete(b"s").outcome == "deleted", "the client closed with its last memoryview"


def test_closing_a_client_with_an_unreleased_view_defers_the_session_end(server, fingerprint):
    with cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20) as peer_client:
        peer = peer_client.layout(PAGE, fingerprint)
        client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
        lay = client.layout(PAGE, fingerprint)
        lay.put(b"d", b"deferred")
        view = lay.get(b"d")
        lease = lay.alloc()
        client.close()
        with pytest.raises(cxlkv.ClosedError):
            lay.exists(b"d")
        with pytest.raises(cxlkv.ClosedError):
            client.flush_unpins()
        assert peer.delete(b"d").outcome == "pinned", "the view is still pinned"
        assert bytes(view) == b"deferred"
        view.release()
        lease.write(b"still the instance's page")
        assert client._handle is not None, "the unconsumed lease holds the session"
        lease.abort()  # the last one: the session ends now
        assert client._handle is None
        assert peer.delete(b"d").outcome == "deleted"
        client.close()  # idempotent


def _close_on_another_thread(client):
    """What a close() on another thread does at this point: run it there,
    to its end."""
    t = threading.Thread(target=client.close)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "close() returned"


def test_a_close_racing_a_get_waits_for_the_view_it_returns(server, fingerprint, monkeypatch):
    # The window: cxlkv_batch_get has returned pinned guards, the view's pin
    # has not taken its hold yet. A close() there must not end the session
    # (which releases the pins) under the view about to be returned.
    with cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20) as peer_client:
        peer = peer_client.layout(PAGE, fingerprint)
        client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
        lay = client.layout(PAGE, fingerprint)
        lay.put(b"race", b"protected")
        pin_init = cxlkv.client._Pin.__init__

        def close_first(pin, raw, c):
            _close_on_another_thread(c)
            pin_init(pin, raw, c)

        monkeypatch.setattr(cxlkv.client._Pin, "__init__", close_first)
        view = lay.get(b"race")
        monkeypatch.undo()
        assert peer.delete(b"race").outcome == "pinned", "the view's pin outlived the close"
        assert client._closed and client._handle is not None, "the end waits for the view"
        assert bytes(view) == b"protected"
        view.release()  # the last holder: the session ends now
        assert client._handle is None
        assert peer.delete(b"race").outcome == "deleted"
        with pytest.raises(cxlkv.ClosedError):
            client._hold()  # nothing can depend on an ended session any more


def test_a_close_racing_an_alloc_waits_for_the_leases_it_returns(server, fingerprint, monkeypatch):
    client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    lay = client.layout(PAGE, fingerprint)
    lease_init = cxlkv.client.Lease.__init__

    def close_first(lease, handle, layout):
        _close_on_another_thread(layout._client)
        lease_init(lease, handle, layout)

    monkeypatch.setattr(cxlkv.client.Lease, "__init__", close_first)
    leases = lay.batch_alloc(2)
    monkeypatch.undo()
    assert client._closed and client._handle is not None, "the end waits for the leases"
    for lease in leases:
        lease.write(b"still the instance's page")
    leases[0].abort()
    assert client._handle is not None
    leases[1].abort()  # the last holder: the session ends now
    assert client._handle is None


def test_a_close_racing_a_tier_open_waits_for_the_tier(server, fingerprint, monkeypatch):
    client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    lay = client.layout(PAGE, fingerprint)
    tier_open, checked = cxlkv.tier.N.lib.cxlkv_tier_open, cxlkv.tier.check
    opened = []

    def record_open(*args):
        opened.append(True)
        return tier_open(*args)

    def close_after_the_open(status):
        # The check of cxlkv_tier_open's status: the tier is open in C, the
        # Python tier has not taken its hold yet.
        checked(status)
        if opened and not client._closed:
            _close_on_another_thread(client)

    monkeypatch.setattr(cxlkv.tier.N.lib, "cxlkv_tier_open", record_open)
    monkeypatch.setattr(cxlkv.tier, "check", close_after_the_open)
    tier = cxlkv.L1Tier(lay)
    monkeypatch.undo()
    assert client._closed and client._handle is not None, "the end waits for the tier"
    tier.close()  # the last holder: the session ends now
    assert client._handle is None


def test_a_lease_of_a_revoked_region_refuses_its_memoryview_as_it_refuses_write(
    server, fingerprint
):
    client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    lay = client.layout(PAGE, fingerprint)
    lease = lay.alloc()
    page = lease.memoryview()
    page[:4] = b"mine"
    del page
    # What an explicit cxlkv_close does to the instance's unconsumed leases
    # (as a reattach the directory refused does): their regions are revoked,
    # the page may go to another instance once the grace period ends.
    handle, client._handle = client._handle, None
    cxlkv.client.N.lib.cxlkv_close(handle)
    with pytest.raises(cxlkv.HandleError) as by_write:
        lease.write(b"x")
    with pytest.raises(cxlkv.HandleError) as by_view:
        lease.memoryview()
    assert by_view.value.status == by_write.value.status == cxlkv.Status.REGION_REVOKED
    del by_view, by_write  # (the tracebacks hold the lease)
    lease.abort()
    lay.close()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_views_leases_and_their_owners_refuse_to_be_copied_or_pickled(client, layout, how):
    # A copy would share the pin (or the lease, or the hold on the session)
    # but not the state that guards it: after view.release() the copy would
    # still read a chunk that may be reused, and a copied lease would give
    # its hold on the session back twice.
    duplicate = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": pickle.dumps,
    }[how]
    layout.put(b"c", b"copied?")
    view = layout.get(b"c")
    lease = layout.alloc()
    for obj in (view, view._pin, lease, layout, client):
        with pytest.raises(TypeError, match=type(obj).__name__):
            duplicate(obj)
    view.release()
    lease.abort()
    with layout.get(b"c") as again:
        assert bytes(again) == b"copied?", "the originals still work"
