"""The client API end to end against a real server process."""

from __future__ import annotations

import gc
import itertools
import os
import pathlib
import threading

import pytest

import cxlkv
from conftest import PAGE


def test_put_then_get_reads_the_bytes_in_place(layout):
    data = bytes(range(256)) * 20
    assert layout.put(b"k1", data).inserted
    with layout.get(b"k1") as view:
        mv = view.memoryview()
        assert mv == data and len(view) == len(data)
        assert view.location.len_bytes == len(data)
        with layout.get(b"k1") as again:
            assert again.address() == view.address(), "both views are the pool's bytes"
        del mv


def test_batches_answer_per_key_and_absent_keys_give_none(layout):
    items = [(f"key-{i}", bytes([i]) * (100 + i)) for i in range(10)]
    assert all(r.inserted for r in layout.batch_put(items))
    keys = [k for k, _ in items] + ["absent"]
    assert layout.batch_exists(keys) == [True] * 10 + [False]
    with layout.batch_get(keys) as views:
        assert views[-1] is None
        for (k, v), view in zip(items, views):
            assert bytes(view) == v and view.key == k.encode()
        pinned = layout.batch_delete(keys)
        assert {r.outcome for r in pinned[:-1]} == {"pinned"} and pinned[0].pins == 1
        assert pinned[-1].outcome == "missing"
    assert all(v.released for v in views if v is not None)
    assert [r.outcome for r in layout.batch_delete(keys)] == ["deleted"] * 10 + ["missing"]
    assert layout.batch_get([]) == [] and layout.batch_put([]) == []


def test_a_lease_is_written_in_place_and_consumed_by_registration(layout):
    lease = layout.alloc()
    assert lease.capacity == PAGE
    page = lease.memoryview()
    page[:5] = b"hello"
    with pytest.raises(BufferError):
        layout.register(b"lease-key", lease)  # the memoryview could write after publication
    del page
    lease.set_len(5)
    assert layout.register(b"lease-key", lease).inserted
    with pytest.raises(cxlkv.ViewReleasedError):
        lease.memoryview()
    with layout.get(b"lease-key") as view:
        assert bytes(view) == b"hello"
        dup = layout.put(b"lease-key", b"other")
        assert dup.outcome == "duplicate" and dup.winner == view.location


def test_leases_written_by_copy_register_in_one_batch_and_aborts_give_pages_back(layout):
    leases = layout.batch_alloc(3)
    for i, lease in enumerate(leases):
        lease.write(f"chunk {i}".encode())
    leases[2].abort()
    before = layout.info()["free_pages"]
    results = layout.batch_register([("a", leases[0]), ("b", leases[1])])
    assert [r.outcome for r in results] == ["inserted", "inserted"]
    with layout.get("b") as v:
        assert bytes(v) == b"chunk 1"
    with layout.alloc() as unused:  # aborted at the end of the block
        assert layout.info()["free_pages"] == before - 1
        del unused
    assert layout.info()["free_pages"] == before
    assert layout.info()["refused_frees"] == 0


def test_errors_carry_their_status_and_message(client, layout):
    with pytest.raises(cxlkv.ArgumentError) as e:
        client.layout(1000, 1)
    assert e.value.status == cxlkv.Status.INVALID_PAGE_SIZE
    assert "1000" in e.value.message and isinstance(e.value, ValueError)
    with pytest.raises(cxlkv.ArgumentError) as e:
        layout.put(b"", b"x")
    assert e.value.status == cxlkv.Status.KEY_LENGTH
    with pytest.raises(cxlkv.ArgumentError) as e:
        layout.put(b"x" * 600, b"x")
    assert e.value.status == cxlkv.Status.KEY_LENGTH
    with pytest.raises(cxlkv.ArgumentError) as e:
        layout.put(b"k", b"x" * (PAGE + 1))
    assert e.value.status == cxlkv.Status.CHUNK_LENGTH
    with pytest.raises(cxlkv.ConnectionLostError) as e:
        cxlkv.Client.connect("/nonexistent/cxlkv.sock", request_timeout_ms=200)
    assert isinstance(e.value, ConnectionError)
    with pytest.raises(TypeError):
        cxlkv.Client.connect("/x", no_such_field=1)


def test_a_closed_client_fails_its_layouts_but_not_its_views(server, fingerprint):
    client = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    layout = client.layout(PAGE, fingerprint)
    layout.put(b"k", b"survives")
    view = layout.get(b"k")
    client.close()
    with pytest.raises(cxlkv.ClosedError):
        layout.exists(b"k")
    with pytest.raises(cxlkv.ClosedError):
        client.layout(PAGE, fingerprint)
    assert bytes(view) == b"survives", "a view outlives its client"
    view.release()
    layout.close()
    with pytest.raises(cxlkv.HandleError):
        layout.exists(b"k")


def test_stats_usage_session_and_directory(client, layout):
    layout.put(b"s", b"v")
    assert client.stats()["requests"] >= 2
    assert client.usage()["instance_used_bytes"] >= PAGE
    session = client.session()
    assert session["session_id"] != 0 and session["owned_keys"] >= 1
    d = client.directory_stats()
    assert d["keys"] >= 1
    assert d["max_pinned_entries"] > 0 and d["pin_ledger_bytes"] >= 0 and "pinned_entries" in d
    assert client.instance_id
    client.flush_unpins()
    assert client.map_all_regions() >= 0
    info = layout.info()
    assert info["page_size_bytes"] == PAGE and info["region_bytes"] >= 4 << 20


def test_map_callbacks_report_every_region_with_its_address(server, fingerprint):
    maps, unmaps = [], []
    client = cxlkv.Client.connect(
        server.socket,
        region_size_bytes=4 << 20,
        on_map=lambda *info: maps.append(info),
        on_unmap=lambda *info: unmaps.append(info),
    )
    layout = client.layout(PAGE, fingerprint)
    layout.put(b"m", b"mapped")
    assert len(maps) == 1
    region, _offset, base, length = maps[0]
    with layout.get(b"m") as view:
        assert base <= view.address() < base + length, "the view lies in the mapped region"
        assert view.location.region_id == region
    layout.close()
    client.close()
    assert [u[0] for u in unmaps] == [region]


def test_a_map_callback_that_cannot_be_called_with_the_region_is_refused_at_connect(tmp_path):
    # Accepted, it would raise at every mapping, printed and ignored: an
    # engine would never register the pool's memory with its device.
    absent = str(tmp_path / "no-server.sock")  # refused before connecting
    for bad in (5, "on_map", lambda region: None, lambda a, b, c, d, e: None):
        for name in ("on_map", "on_unmap"):
            with pytest.raises(TypeError, match=name):
                cxlkv.Client.connect(absent, **{name: bad})
    # What may be called with the four numbers (and read_only=, if it asks)
    # is accepted: the connection is what fails here.
    for good in (
        lambda *info: None,
        lambda region, offset, base, length, read_only=False: None,
        lambda region, offset, base, length, **more: None,
        print,
    ):
        with pytest.raises(cxlkv.ConnectionLostError):
            cxlkv.Client.connect(absent, on_map=good, on_unmap=good)


def test_a_callback_taking_read_only_learns_that_peer_regions_are_mapped_read_only(server, fingerprint):
    writer = cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20)
    wl = writer.layout(PAGE, fingerprint)
    wl.put(b"ro", b"published")
    seen = []
    reader = cxlkv.Client.connect(
        server.socket,
        region_size_bytes=4 << 20,
        on_map=lambda region, _off, _base, _len, read_only: seen.append((region, read_only)),
    )
    rl = reader.layout(PAGE, fingerprint)
    rl.put(b"own", b"mine")
    with rl.get(b"ro") as view:
        peer = view.location.region_id
    with rl.get(b"own") as view:
        own = view.location.region_id
    assert (peer, True) in seen, "the writer's region is read-only here"
    assert (own, False) in seen, "the reader's own region is writable"
    rl.close()
    reader.close()
    wl.close()
    writer.close()


def test_threads_share_one_client(layout):
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                k = f"t{t}-{i}"
                assert layout.put(k, k.encode() * 10).inserted
                with layout.get(k) as v:
                    assert bytes(v) == k.encode() * 10
                assert layout.delete(k).outcome == "deleted"
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_bytes_like_inputs_are_accepted(layout):
    assert layout.put(bytearray(b"ba"), bytearray(b"from a bytearray")).inserted
    assert layout.put(memoryview(b"mv"), memoryview(b"from a read-only memoryview")).inserted
    with layout.batch_get([b"ba", "mv"]) as (a, b):
        assert bytes(a) == b"from a bytearray" and bytes(b) == b"from a read-only memoryview"


def test_a_bad_key_or_chunk_in_a_batch_of_pairs_is_named_by_its_call_and_position(layout):
    # As for batch_get's keys: in a batch of thousands, the bare "not
    # NoneType" of memoryview() or of the key check names neither.
    with pytest.raises(TypeError, match=r"batch_put\(items\): item 1: .*key.* not NoneType"):
        layout.batch_put([(b"a", b"x"), (None, b"y")])
    with pytest.raises(TypeError, match=r"batch_put\(items\): item 2: .*chunk.* not 'NoneType'"):
        layout.batch_put([(b"a", b"x"), (b"b", b"y"), (b"c", None)])
    with pytest.raises(TypeError, match=r"batch_put\(items\): item 0: .*chunk.* not 'int'"):
        layout.put(b"a", 5)
    lease = layout.alloc()
    with pytest.raises(TypeError, match=r"batch_register\(entries\): item 1: .*key.* not int"):
        layout.batch_register([(b"a", layout.alloc()), (7, lease)])
    with pytest.raises(TypeError, match=r"Lease.write\(data\): .* not 'NoneType'"):
        lease.write(None)
    lease.abort()
    assert layout.batch_exists([b"a", b"b", b"c"]) == [False] * 3


def test_a_client_secret_that_is_not_bytes_like_is_named_in_the_error(tmp_path):
    with pytest.raises(TypeError, match=r"connect\(\): client_secret .* not 'int'"):
        cxlkv.Client.connect(str(tmp_path / "absent.sock"), client_secret=5)


def test_a_fortran_ordered_buffer_is_stored_as_its_bytes_writable_or_not(layout):
    # A transposed NumPy array or torch tensor is contiguous in Fortran
    # order, not C order: memoryview.cast() refuses it. Its bytes are stored
    # in logical (C) order, as bytes() of it gives them, whether or not it
    # is writable.
    testbuffer = pytest.importorskip("_testbuffer")
    flags = testbuffer.ND_FORTRAN
    for writable in (False, True):
        buf = testbuffer.ndarray(
            list(range(12)),
            shape=[3, 4],
            format="B",
            flags=flags | (testbuffer.ND_WRITABLE if writable else 0),
        )
        mv = memoryview(buf)
        assert mv.f_contiguous and not mv.c_contiguous and mv.readonly is not writable
        expected = mv.tobytes()
        assert layout.put(f"fortran-put-{writable}", buf).inserted
        assert layout.batch_put([(f"fortran-batch-{writable}", buf)])[0].inserted
        lease = layout.alloc()
        lease.write(buf)
        assert len(lease) == len(expected)
        assert layout.register(f"fortran-lease-{writable}", lease).inserted
        keys = [f"fortran-{how}-{writable}" for how in ("put", "batch", "lease")]
        with layout.batch_get(keys) as views:
            assert [bytes(v) for v in views] == [expected] * 3


@pytest.mark.parametrize("bad", [5, 0, 1.5, None, [1, 2]])
def test_a_key_that_is_not_bytes_or_str_is_refused_not_converted(layout, bad):
    # bytes(5) is five zero bytes: an int must not name that key silently.
    name = type(bad).__name__
    calls = [
        lambda: layout.put(bad, b"x"),
        lambda: layout.get(bad),
        lambda: layout.exists(bad),
        lambda: layout.delete(bad),
        lambda: layout.batch_get([b"ok", bad]),
        lambda: layout.register(bad, layout.alloc()),
    ]
    with cxlkv.L1Tier(layout) as tier:
        calls += [
            lambda: tier.reserve_read([bad]),
            lambda: tier.reserve_write([bad], [False]),
            lambda: tier.delete([bad]),
            lambda: tier.is_key_evictable(bad),
            lambda: tier.inspect(bad),
        ]
        for call in calls:
            with pytest.raises(TypeError, match=f"not {name}"):
                call()
    assert not layout.exists(bytes(5))
    assert layout.put(b"\0" * 5, b"zeros").inserted, "nothing was written under five zero bytes"


def test_a_refused_batch_register_takes_no_lease(client, layout, fingerprint):
    layout.alloc().abort()  # the layout has a region: free_pages is steady
    before = layout.info()["free_pages"]

    a, b = layout.batch_alloc(2)
    with pytest.raises(ValueError) as e:
        layout.batch_register([("x", a), ("y", b), ("z", a)])
    refused_as = type(e.value)
    del a, b, e  # (the traceback holds the call's locals)
    gc.collect()
    assert layout.info()["free_pages"] == before, "neither lease was taken: both pages went back"
    assert issubclass(refused_as, cxlkv.ArgumentError), "the same lease twice"

    registered, fresh = layout.batch_alloc(2)
    registered.write(b"r")
    assert layout.register("registered", registered).inserted
    with pytest.raises(cxlkv.ViewReleasedError):
        layout.batch_register([("x", fresh), ("y", registered)])
    fresh.write(b"still usable")
    del fresh
    gc.collect()
    assert layout.info()["free_pages"] == before - 1, "only the registered page is used"

    other = client.layout(PAGE, fingerprint)  # a second handle to the same layout
    lease = other.alloc()
    other.close()
    with pytest.raises(cxlkv.HandleError):
        other.register("h", lease)
    del lease
    gc.collect()
    assert layout.info()["free_pages"] == before - 1, "the lease went back when collected"


def test_connect_refuses_length_and_pointer_fields(server):
    for bad in (
        {"client_secret_len": 256},
        {"pool_paths_len": 1},
        {"pool_paths": None},
        {"size": 8},
        {"map_callbacks": None},
    ):
        with pytest.raises(TypeError):
            cxlkv.Client.connect(server.socket, client_secret=b"x", **bad)
    with pytest.raises(cxlkv.ArgumentError):
        cxlkv.Client.connect(server.socket, max_retries=-1)
    with cxlkv.Client.connect(server.socket, max_retries=3, unpin_delay_us=0) as c:
        assert c.instance_id


def test_connect_refuses_flags_which_its_own_keywords_set(server):
    # ``flags`` is what ``eager_map`` and ``auto_expand`` set: taken by
    # name it silently overrode them (``auto_expand=False, flags=0`` turned
    # auto-expansion back on).
    with pytest.raises(TypeError, match="eager_map"):
        cxlkv.Client.connect(server.socket, auto_expand=False, flags=0)


def test_connect_takes_a_path_of_any_kind_and_refuses_other_types_and_nul(server):
    for path in (server.socket, os.fsencode(server.socket), pathlib.Path(server.socket)):
        with cxlkv.Client.connect(path) as c:  # bytes were once the path "b'/...'"
            assert c.instance_id
    for name, bad in (
        ("socket_path", 5),
        ("tcp_addr", b"127.0.0.1:7411"),
        ("instance_id", 5),
        ("client_name", b"engine"),
    ):
        with pytest.raises(TypeError, match=name):
            cxlkv.Client.connect(**{"socket_path": server.socket, name: bad})
    # C reads a string up to its first NUL: these would be another path or
    # name, silently.
    for kwargs in (
        {"socket_path": server.socket + "\0.other"},
        {"socket_path": server.socket, "instance_id": "engine\0-1"},
    ):
        with pytest.raises(cxlkv.ArgumentError, match="NUL"):
            cxlkv.Client.connect(**kwargs)


def test_the_installed_package_is_marked_typed():
    """``py.typed`` ships with the package, so type checkers use its
    annotations (without it mypy skips the package as untyped)."""
    assert (pathlib.Path(cxlkv.__file__).parent / "py.typed").is_file()


def test_busy_statuses_are_busy_errors():
    local = cxlkv.errors.error_for(cxlkv.Status.BUSY)
    assert isinstance(local, cxlkv.BusyError) and not isinstance(local, cxlkv.InternalError)
    server = cxlkv.errors.error_for(cxlkv.Status.SERVER_BUSY)
    assert isinstance(server, cxlkv.BusyError) and isinstance(server, cxlkv.ServerError)
    assert server.code == 16


def _raise_key_length(_):
    raise cxlkv.errors.error_for(cxlkv.Status.KEY_LENGTH)


def test_every_error_survives_pickling_and_copying_with_its_class_status_and_message():
    # multiprocessing and concurrent.futures send a worker's exception to
    # the parent pickled: one that cannot be rebuilt breaks the pool.
    import copy
    import pickle

    for status in [s for s in cxlkv.Status if s != cxlkv.Status.OK] + [777]:
        cls = type(cxlkv.errors.error_for(status))
        err = cls(status, f"the message of {status}")
        for again in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
            assert type(again) is type(err)
            assert (again.status, again.status_name, again.message, str(again)) == (
                err.status,
                err.status_name,
                err.message,
                str(err),
            )
            assert type(again.status) is type(err.status)


def test_an_error_raised_in_a_worker_process_reaches_the_parent_as_itself():
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with pytest.raises(cxlkv.ArgumentError) as e:
            pool.submit(_raise_key_length, None).result(timeout=60)
    assert e.value.status == cxlkv.Status.KEY_LENGTH


def test_a_layout_option_given_alone_keeps_the_clients_other_layout_settings(server, fingerprint):
    # Unset options are the client's configuration (no auto-expansion,
    # 4 MiB regions), not the library's defaults (auto-expansion, 64 MiB).
    with cxlkv.Client.connect(server.socket, region_size_bytes=4 << 20, auto_expand=False) as c:
        with c.layout(PAGE, fingerprint, initial_reservation_bytes=4 << 20) as lay:
            leases = lay.batch_alloc((4 << 20) // PAGE)
            with pytest.raises(cxlkv.CapacityError):
                lay.alloc()
            assert lay.info()["region_bytes"] == 4 << 20
            for lease in leases:
                lease.abort()
        # An option given alone overrides only itself: auto_expand=True on a
        # client that does not expand.
        with c.layout(PAGE, fingerprint + 0x10_0000, auto_expand=True) as lay:
            leases = lay.batch_alloc((4 << 20) // PAGE + 1)
            assert lay.info()["region_bytes"] == 8 << 20, "expanded by one 4 MiB region"
            for lease in leases:
                lease.abort()


@pytest.mark.parametrize("single", ["key", b"key", bytearray(b"key"), memoryview(b"key")])
def test_a_single_key_given_for_a_batch_of_keys_is_refused_not_split(layout, single):
    # A str is an iterable of characters (and bytes of ints): "key" must not
    # be taken for the keys "k", "e", "y".
    for call in (layout.batch_exists, layout.batch_delete, layout.batch_get):
        with pytest.raises(TypeError, match="keys"):
            call(single)
    assert not layout.exists("k")


def test_a_mapping_or_a_bare_string_given_for_batch_pairs_is_refused_not_split(layout):
    data = b"x" * 10
    for bad in ({"ab": data}, "ab", b"ab", [("ok", data), "ab"], [("k", data, "extra")]):
        with pytest.raises(TypeError, match="pair"):
            layout.batch_put(bad)
    assert layout.batch_exists(["a", "ok", "k"]) == [False, False, False], "nothing was written"
    lease = layout.alloc()
    for bad in ({"ab": lease}, [("k", lease), "ab"]):
        with pytest.raises(TypeError, match="pair"):
            layout.batch_register(bad)
    lease.write(b"not taken")
    assert layout.register("l", lease).inserted, "the refused calls took no lease"


def test_an_int_outside_its_c_type_is_refused_not_truncated(server, client, layout, fingerprint):
    # ctypes keeps the low bits: 2**64 + F would open fingerprint F.
    for bad in (
        lambda: client.layout(PAGE, 1 << 64),
        lambda: client.layout(PAGE, -1),
        lambda: client.layout((1 << 64) + PAGE, fingerprint),
        lambda: client.layout(PAGE, fingerprint, initial_reservation_bytes=-1),
        lambda: client.layout(PAGE, fingerprint, region_size_bytes=(1 << 64) + (4 << 20)),
        lambda: layout.batch_alloc(-1),
        lambda: cxlkv.Client.connect(server.socket, region_size_bytes=(1 << 64) + (4 << 20)),
        lambda: cxlkv.Client.connect(server.socket, quota_bytes=-1),
        lambda: cxlkv.Client.connect(server.socket, request_timeout_ms=1 << 64),
        lambda: cxlkv.Client.connect(server.socket, max_retries=1 << 32),
    ):
        with pytest.raises(cxlkv.ArgumentError, match="out of range") as e:
            bad()
        assert e.value.status == cxlkv.Status.INVALID_ARGUMENT
    with layout.alloc() as lease:
        lease.write(b"abc")
        for n in ((1 << 64) + 1, -1):
            with pytest.raises(cxlkv.ArgumentError, match="len_bytes"):
                lease.set_len(n)
        assert len(lease) == 3
    with pytest.raises(TypeError, match="fingerprint"):
        client.layout(PAGE, 1.5)


def _free_pages(layout) -> int:
    return layout.info()["free_pages"]


def test_a_batch_over_the_librarys_limit_is_refused_before_anything_is_allocated(client, layout):
    # Reliability entry 107: batch_alloc(10**12) built a 10**12-slot ctypes
    # array before the library could refuse it — MemoryError, or (for a
    # size the allocator grants) gigabytes taken for nothing. Key lists and
    # pairs were read whole first, an endless iterator for ever.
    limit = cxlkv.MAX_BATCH
    free = _free_pages(layout)
    for n in (10**12, 2**63, limit + 1):
        with pytest.raises(cxlkv.ArgumentError, match=f"batch of {n} exceeds the library's limit of {limit}") as e:
            layout.batch_alloc(n)
        assert e.value.status == cxlkv.Status.BATCH_TOO_LARGE
        assert isinstance(e.value, ValueError)
    assert _free_pages(layout) == free, "no lease was taken"
    too_many = [b"k%d" % i for i in range(limit + 1)]
    endless = lambda: itertools.repeat(b"k")  # noqa: E731
    for call in (layout.batch_get, layout.batch_exists, layout.batch_delete):
        for keys, said in ((too_many, str(limit + 1)), (endless(), f"more than {limit}")):
            with pytest.raises(cxlkv.ArgumentError, match=f"batch of {said} exceeds") as e:
                call(keys)
            assert e.value.status == cxlkv.Status.BATCH_TOO_LARGE
    for items in ([(k, b"v") for k in too_many], itertools.repeat((b"k", b"v"))):
        with pytest.raises(cxlkv.ArgumentError, match="exceeds the library's limit"):
            layout.batch_put(items)
    lease = layout.alloc()
    lease.write(b"x")
    with pytest.raises(cxlkv.ArgumentError, match="exceeds the library's limit"):
        layout.batch_register(itertools.repeat((b"k", lease)))
    assert layout.register(b"batch-limit-lease", lease).inserted, "the refused call took no lease"
    # The limit itself is accepted (by the library; the directory's own may
    # be lower and is the library's to enforce).
    session_limit = min(limit, client.session()["max_batch"])
    assert layout.batch_exists([b"absent"] * session_limit) == [False] * session_limit
