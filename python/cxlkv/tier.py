"""The L1 tier: the engine-facing staged protocol of LMCache's L1 manager
(reserve and finish reads and writes, promotes, temporaries, delete,
clear, a TTL sweeper, listeners and events) on the shared pool.

The 17 operations keep the reference's names and parameters
(``l1-tier-reference.md``), with three differences: key lists are answered
with lists in input order (a key repeated within one call is refused with
:class:`~cxlkv.errors.TierArgumentError`, so a list is the reference's map);
``reserve_write`` takes the chunk length instead of a tensor layout (the
layout is bound when the tier is created); and read holds may be given as a
total (``holds=``) besides the reference's ``extra_count``. A call's
``keys`` are an iterable of keys: one key alone (a ``str``, ``bytes``,
``bytearray`` or ``memoryview``, each itself an iterable) raises
``TypeError`` before anything is done, as in :class:`~cxlkv.Layout`'s batch
calls. ``extra_count``, ``holds`` and ``len_bytes`` outside their C
argument's range raise :class:`~cxlkv.errors.ArgumentError` rather than
losing their high bits (or, for a negative count, becoming one hold).

Pages
-----
Read-type results carry a :class:`TierPage`: the chunk in place in the
pool. :meth:`TierPage.memoryview` is zero copy — writable for pages from
:meth:`L1Tier.reserve_write` (until the key is finished), read-only
otherwise. A page is valid while the tier holds the reservation that
returned it. The tier guards that the way views are guarded
(:mod:`cxlkv.client`): every memoryview is exported through a ctypes
array tracked weakly; an operation that may end a key's reservation
(``finish_*``, ``delete``, ``clear``, ``close``, ``sweep_now``) raises
``BufferError`` and changes nothing while a memoryview of that key's page
is alive; while it runs, :meth:`TierPage.memoryview` of those pages raises
``BufferError`` (on another thread, or from one of the call's listeners —
the check and the refusal are one step, so no memoryview slips in between);
afterwards it marks the pages whose reservation ended as released — their
:meth:`TierPage.memoryview` raises :class:`~cxlkv.errors.ViewReleasedError`
— and the others are exportable again. Every memoryview also holds the
tier (and through it the layout and client), so a tier object dropped while
a memoryview of one of its pages lives is closed only when that memoryview
goes.

What Python cannot guard is the tier's own TTL sweeper thread, which
reclaims an *expired* reservation whatever Python holds (as the reference's
TTL locks do): keep the TTLs above the longest time a page is used. A
memoryview kept past the sweep never faults — every page, and every
memoryview of it, holds the mapping of its region (the tier is opened with
``CXLKV_TIER_HOLD_MAPPINGS``), so the region stays mapped until the last of
them goes — but its bytes are no longer protected: reading may see another
chunk's, and writing into a write page corrupts whatever the pool put there
since. TTLs are given in seconds and rounded up to whole milliseconds.

A tier and its pages refuse ``copy.copy``, ``copy.deepcopy`` and pickling
(``TypeError``): a copied page is not one the tier tracks, so it would not
be released when its reservation ends and would go on reading a page that
may be reused; a copied tier would close the tier's handle and give its
hold on the session back a second time when collected.

An open tier holds its client's session: :meth:`Client.close
<cxlkv.Client.close>` ends it only once the tier is closed too (the tier's
read reservations are pins of that session). After the client's close,
every operation but :meth:`L1Tier.close` raises
:class:`~cxlkv.errors.ClosedError` (and
:class:`~cxlkv.errors.ConnectionLostError` once the client's instance
cannot be resumed after a reconnect); a call during which the client is
closed (by one of its listeners, say) completes: it returns its results,
and the pages whose reservation it ended are released.

Listeners are Python objects with any of the methods ``reserved_read``,
``read_finished``, ``reserved_write``, ``write_finished``,
``finish_write_and_reserve_read``, ``deleted``, ``accessed``, each called
with a list of ``bytes`` keys — synchronously, on the calling thread, under
the tier's lock (except ``accessed``): a listener must not call back into
the same tier (that raises :class:`~cxlkv.errors.TierError`). Exceptions in
listeners are printed and ignored. An object with none of those methods
(or with one not callable) is refused with ``TypeError``: registered, it
would never be called. ``on_event`` is called the same way, under the
tier's lock: a slow one delays every locked call of the tier.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import math
import threading
import weakref
from typing import Callable, Iterable, Optional, Sequence

from . import _native as N
from .client import (
    BytesLike,
    Layout,
    Location,
    _as_buffer,
    _bytes_array,
    _c_uint,
    _Exports,
    _inherited,
    _key,
    _keys,
    _NotCopyable,
    _unless_unwinding,
)
from .errors import (
    ArgumentError,
    Error,
    HandleError,
    Status,
    TierArgumentError,
    ViewReleasedError,
    check,
    error_for,
)


class TierCode(enum.IntEnum):
    """Per-key result (the reference's shared L1 error enumeration)."""

    SUCCESS = 0
    KEY_NOT_EXIST = 1
    KEY_NOT_READABLE = 2
    KEY_NOT_WRITABLE = 3
    KEY_IN_WRONG_STATE = 4
    KEY_IS_LOCKED = 5
    OUT_OF_MEMORY = 6
    #: No result: the call failed (it raised). Never seen in a returned list.
    NOT_DONE = 7


class TierPage(_NotCopyable):
    """A chunk's page from a tier reservation (see the module docs)."""

    _NOT_COPYABLE_WHY = (
        "its tier marks only this object released when the reservation ends (a copy would "
        "go on reading a page that may be reused)"
    )

    __slots__ = (
        "key",
        "location",
        "page_size_bytes",
        "writable",
        "_len",
        "_address",
        "_hold",
        "_ending",
        "_exports",
        "_tier",
        "__weakref__",
    )

    def __init__(
        self,
        key: bytes,
        raw: N.TierPage,
        writable: bool,
        tier: "L1Tier",
        hold: "_MappingHold",
    ):
        self.key = key
        self.location = Location._from(raw.location)
        self.page_size_bytes = raw.page_size_bytes
        self.writable = writable
        self._len = raw.len_bytes
        self._address = raw.data
        # Keeps the page mapped: held by this object until its reservation
        # ends (as far as Python sees), and by every memoryview of it.
        self._hold = hold
        # How many calls that may end this page's reservation are in
        # progress (see L1Tier._ending): no memoryview is exported while
        # one is.
        self._ending = 0
        self._exports = _Exports()
        # Weak: a page object alone does not keep its tier open; a
        # memoryview of it does (see memoryview()).
        self._tier = weakref.ref(tier)

    def __len__(self) -> int:
        return self._len

    @property
    def released(self) -> bool:
        return self._address is None

    def _live(self) -> tuple[int, "L1Tier"]:
        tier = self._tier()
        address = self._address
        if address is None or tier is None:
            raise ViewReleasedError(f"the reservation of {self.key!r} ended")
        if self._ending:
            raise BufferError(
                f"a call that may end the reservation of {self.key!r} is in progress (on "
                "another thread, or this is one of its listeners): no memoryview of its page "
                "until it returns"
            )
        return address, tier

    def memoryview(self) -> memoryview:
        """The chunk's bytes in the pool (zero copy). The memoryview holds
        this page, its mapping and its tier: the tier is not closed by
        garbage collection while a memoryview of one of its pages lives.
        Raises ``BufferError`` while a call that may end the page's
        reservation is in progress."""
        tier = self._tier()
        if tier is None:
            raise ViewReleasedError(f"the reservation of {self.key!r} ended")
        # Under the tier's export lock: a call that may end the reservation
        # checks for memoryviews and marks the page ending under it too, so
        # an export either comes first (and the call is refused) or is
        # refused.
        with tier._export_lock:
            address, tier = self._live()
            return self._exports.export(
                address, self._len, (self, tier, self._hold), readonly=not self.writable
            )

    def address(self) -> int:
        """The page's address. Raises ``ViewReleasedError`` once the
        reservation has ended, and ``BufferError`` while a call that may end
        it runs (as ``memoryview()`` does)."""
        return self._live()[0]

    def __bytes__(self) -> bytes:
        return self.memoryview().tobytes()

    def _release(self) -> None:
        self._address = None
        # The mapping stays held as long as a memoryview of the page does.
        self._hold = None

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self._len} bytes"
        return f"TierPage({self.key!r}, {state})"


class _MappingHold:
    """One hold on the mapping of a page a tier returned (the tier is
    opened with ``CXLKV_TIER_HOLD_MAPPINGS``): while it lives, the page's
    address stays mapped, however its reservation ended — the tier's TTL
    sweeper included — so a memoryview kept too long reads stale bytes
    rather than faulting. Given back when collected. It keeps the client's
    map callbacks alive too: giving back the last hold on a mapping the
    client has retired unmaps it, and calls its ``on_unmap`` — which must
    not have been collected with the client by then."""

    __slots__ = ("_address", "_keep")

    def __init__(self, address: int, keep: list):
        self._address = address
        self._keep = keep

    def __del__(self, _release=N.lib.cxlkv_tier_release_page):
        address, self._address = self._address, None
        if address is not None:
            # Fails only for an address holding no hold (not one of ours),
            # or held before this process was forked: a child's copy of the
            # parent's hold releases nothing.
            _release(address)


def _tracked(ref: weakref.ref) -> bool:
    """Whether a tracked page still matters: alive and not released."""
    page = ref()
    return page is not None and not page.released


#: The longest TTL the library takes (``MAX_TTL``: one year), in seconds.
_MAX_TTL_S = 365 * 24 * 3600


def _ttl_ms(name: str, seconds: float) -> int:
    """A TTL in whole milliseconds, rounded up (a positive TTL never
    becomes 0). A number only — an int, a float, a ``Decimal``, a
    ``Fraction``, anything ``float()`` converts that is not text:
    ``float("600")`` would take a str, and ``float(None)`` would raise a
    ``TypeError`` that names no argument."""
    wrong = isinstance(seconds, (bool, str, bytes, bytearray, memoryview)) or seconds is None
    try:
        ms = float(seconds) * 1000 if not wrong else None
    except OverflowError:
        ms = math.inf  # a number, too large for a float: out of range below
    except (TypeError, ValueError):
        ms = None
    if ms is None:
        raise TypeError(
            f"L1Tier(): {name} must be a number of seconds, not {type(seconds).__name__}"
        )
    if not (math.isfinite(ms) and 0 < ms <= _MAX_TTL_S * 1000):
        raise ArgumentError(
            Status.INVALID_ARGUMENT,
            f"L1Tier(): {name}={seconds!r}: a TTL is a positive number of seconds, at most "
            f"{_MAX_TTL_S} (one year)",
        )
    return max(1, math.ceil(round(ms, 6)))


def _holds(call: str, extra_count: int, holds: Optional[int]) -> int:
    """The total holds of ``call``: ``holds`` if given, else ``1 +
    extra_count``. Each is refused outside the C argument's range (a
    ``uint32_t``) rather than clamped or truncated, so a negative count is
    an error, not one hold; within it the library clamps the total to
    1..=128, so ``1 + extra_count`` past the range is passed as its top."""
    extra_count = _c_uint(extra_count, ctypes.c_uint32, f"{call}(): extra_count")
    if holds is not None:
        return _c_uint(holds, ctypes.c_uint32, f"{call}(): holds")
    return min(1 + extra_count, 0xFFFF_FFFF)


class L1Tier(_NotCopyable):
    """The L1 tier over one :class:`~cxlkv.Layout` (see the module docs).
    Thread-safe; a context manager (``close`` at the end; left by an
    exception while a memoryview of a page is alive, the tier is closed
    when collected instead, and the exception goes on). TTLs are in
    seconds, rounded up to whole milliseconds (1 ms to one year)."""

    #: Pages tracked (keys) after which a tracking call prunes every key.
    _PRUNE_MIN = 1024

    def __init__(
        self,
        layout: Layout,
        *,
        write_ttl_s: float = 600.0,
        read_ttl_s: float = 300.0,
        on_event: Optional[Callable[[str, list], None]] = None,
    ):
        self._handle = None
        if not isinstance(layout, Layout):
            raise TypeError(
                f"L1Tier(layout): expected a cxlkv.Layout (client.layout(page_size_bytes, "
                f"fingerprint)), not {type(layout).__name__}"
            )
        if on_event is not None and not callable(on_event):
            # Else every event would raise in the callback, printed and ignored.
            raise TypeError(
                f"L1Tier(on_event): expected a callable (name, keys), not {type(on_event).__name__}"
            )
        # Taken by every export of a page's memoryview and by a call that
        # may end reservations to check for memoryviews and mark its pages
        # ending (see _ending); reentrant for the garbage collector's sake.
        self._export_lock = threading.RLock()
        cfg = N.TierConfig()
        check(N.lib.cxlkv_tier_config_init(ctypes.byref(cfg), ctypes.sizeof(cfg)))
        # Every page returned holds its mapping (see _MappingHold).
        cfg.flags = N.TIER_HOLD_MAPPINGS
        cfg.write_ttl_ms = _ttl_ms("write_ttl_s", write_ttl_s)
        cfg.read_ttl_ms = _ttl_ms("read_ttl_s", read_ttl_s)
        # ctypes callback objects must outlive every call into them.
        self._callbacks: list = []
        if on_event is not None:

            def event(_user, code, keys, n):
                on_event(N.TIER_EVENTS.get(code, str(code)), _keys_from_c(keys, n))

            cfg.on_event = N.TIER_EVENT_FN(event)
            self._callbacks.append(cfg.on_event)
        # The page size, for reserve_write's default (the tier holds its
        # own reference to the layout: the Layout object may be closed).
        self._page_size = layout.page_size_bytes
        # The pages handed out, weakly, by key; guarded by the lock and
        # pruned of dead and released pages as keys are finished.
        self._pages_lock = threading.Lock()
        self._pages: dict[bytes, list] = {}
        self._prune_at = self._PRUNE_MIN
        self._layout = layout
        self._client = layout._client
        handle = ctypes.c_void_p()
        # An open tier's reservations are pins of the client's session: the
        # call holds the session (a close() on another thread is deferred)
        # until the tier has taken its own hold.
        with self._client._using():
            check(N.lib.cxlkv_tier_open(layout._h(), ctypes.byref(cfg), ctypes.byref(handle)))
            self._client._hold()
            self._handle = handle.value

    # --- plumbing -----------------------------------------------------------

    def _h(self) -> int:
        self._client._check_open()
        return self._h_held()

    def _h_held(self) -> int:
        """The handle for what a call does after its C call took effect
        (revalidating its pages). Unlike :meth:`_h`, it does not refuse a
        closed client: a listener of that call may have closed it, and the
        follow-up must still run, or pages whose reservation ended would
        stay usable. It can: the tier holds the client's session, so the C
        client lives until the tier is closed."""
        if self._handle is None:
            raise HandleError(Status.BAD_HANDLE, "the tier was closed")
        return self._handle

    def _track(self, page: TierPage) -> None:
        ref = weakref.ref(page)
        with self._pages_lock:
            if self._handle is None:
                # close() (on another thread) ran while the call that
                # returned this page was in flight: its revalidation did not
                # see the page, and the reservation ended with the tier.
                page._release()
                return
            refs = self._pages.get(page.key)
            if refs is None:
                self._pages[page.key] = [ref]
            else:
                refs[:] = [r for r in refs if _tracked(r)]
                refs.append(ref)
            if len(self._pages) >= self._prune_at:
                self._prune_locked(None)
                self._prune_at = max(self._PRUNE_MIN, 2 * len(self._pages))

    def _prune(self, keys: Optional[Iterable[bytes]]) -> None:
        """Forgets the dead and released pages of ``keys`` (``None``: all),
        and the keys left with none."""
        with self._pages_lock:
            self._prune_locked(keys)

    def _prune_locked(self, keys: Optional[Iterable[bytes]]) -> None:
        for k in list(self._pages) if keys is None else keys:
            refs = self._pages.get(k)
            if refs is None:
                continue
            refs[:] = [r for r in refs if _tracked(r)]
            if not refs:
                del self._pages[k]

    def _live_pages(self, keys: Optional[Iterable[bytes]] = None) -> list[TierPage]:
        out = []
        with self._pages_lock:
            groups = self._pages.values() if keys is None else [self._pages.get(k, ()) for k in keys]
            for refs in groups:
                for r in refs:
                    p = r()
                    if p is not None and not p.released:
                        out.append(p)
        return out

    @contextlib.contextmanager
    def _ending(self, keys: Optional[Sequence[bytes]]):
        """Around a call that may end the reservations of ``keys``
        (``None``: every key): refuses (``BufferError``, nothing done)
        while a memoryview of one of their pages is alive; else marks
        those pages ending until the call is over — their
        :meth:`TierPage.memoryview` raises ``BufferError`` meanwhile, so
        none is exported while the C call runs (the GIL released, its
        listeners called) nor before the call's revalidation has released
        the pages whose reservation ended. The marks are taken off however
        the call ends: on an error the pages are exportable again."""
        pages = self._live_pages(keys)
        # First with a garbage collection (a memoryview kept only by a
        # cycle is dead), outside the lock: the collector may run any
        # finalizer.
        self._refuse_exported(pages, collect=True)
        with self._export_lock:
            # Again under the lock, for memoryviews exported meanwhile.
            self._refuse_exported(pages, collect=False)
            for p in pages:
                p._ending += 1
        try:
            yield
        finally:
            with self._export_lock:
                for p in pages:
                    p._ending -= 1

    @staticmethod
    def _refuse_exported(pages: list[TierPage], collect: bool) -> None:
        for p in pages:
            if p._address is not None and (
                p._exports.alive() if collect else p._exports._any()
            ):
                raise BufferError(
                    f"a memoryview of the page of {p.key!r} is still alive; drop it before "
                    "an operation that may end its reservation"
                )

    def _revalidate(self, keys: Optional[Sequence[bytes]], writes_ended: bool) -> None:
        """Marks released the pages of ``keys`` (``None``: all) whose
        reservation ended: every write page if ``writes_ended``, and read
        pages that are no longer this key's held page."""
        pages = self._live_pages(keys)
        if not pages:
            self._prune(keys)
            return
        read_keys = sorted({p.key for p in pages if not p.writable})
        current: dict[bytes, Optional[int]] = {}
        if read_keys and self._handle is not None:
            try:
                held = self._held_pages(read_keys)
            except Error:
                # The call took effect, but which reservations it ended
                # cannot be asked (the tier was closed on another thread):
                # every page of these keys is taken as ended. One still held
                # is only a page to ask for again (``unsafe_read``); raising
                # instead would hide the call's results and leave usable a
                # page that may be reused.
                held = []
            for k, (code, page) in zip(read_keys, held):
                current[k] = page.address() if code == TierCode.SUCCESS else None
        for p in pages:
            if p.writable:
                if writes_ended or self._handle is None:
                    p._release()
            elif current.get(p.key) != p._address:
                p._release()
        del pages
        self._prune(keys)

    def _held_pages(self, keys: Sequence[bytes]) -> list:
        """``unsafe_read`` of any number of keys (untracked pages), in
        batches the session accepts: the pages tracked may be of more keys
        than one call may carry (after ``clear`` or ``sweep_now``, every
        key with a live page)."""
        limit = max(1, self._client._held_session()["max_batch"])
        out: list = []
        for at in range(0, len(keys), limit):
            out += self._call_pages("unsafe", keys[at : at + limit], held=True)
        return out

    def _call_pages(self, op: str, keys: Sequence[bytes], *extra, held: bool = False) -> list:
        """The C call ``op`` for ``keys``; ``held``: a follow-up of a call
        that took effect (see :meth:`_h_held`)."""
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (N.TierPage * max(len(keys), 1))()
        h = self._h_held() if held else self._h()
        if op == "reserve_read":
            check(N.lib.cxlkv_tier_reserve_read(h, karr, len(keys), extra[0], out))
        elif op == "unsafe":
            check(N.lib.cxlkv_tier_unsafe_read(h, karr, len(keys), out))
        elif op == "promote":
            check(N.lib.cxlkv_tier_finish_write_and_reserve_read(h, karr, len(keys), extra[0], out))
        elif op == "reserve_write":
            flags, len_bytes, mode = extra
            check(N.lib.cxlkv_tier_reserve_write(h, karr, flags, len(keys), len_bytes, mode, out))
        # First, before anything that may raise: the library took a
        # mapping hold per page returned, and each is given back only by
        # its _MappingHold.
        keep = self._client._callbacks
        holds = [
            _MappingHold(out[i].data, keep) if out[i].data else None for i in range(len(keys))
        ]
        results = []
        writable = op == "reserve_write"
        for i, k in enumerate(keys):
            code = TierCode(out[i].code)
            if code == TierCode.SUCCESS and out[i].data:
                page = TierPage(k, out[i], writable, self, holds[i])
                if op != "unsafe":
                    self._track(page)
                results.append((code, page))
            else:
                results.append((code, None))
        return results

    def _call_codes(self, fn, keys: Sequence[bytes], *args) -> list[TierCode]:
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (ctypes.c_uint32 * max(len(keys), 1))()
        check(fn(self._h(), karr, len(keys), *args, out))
        return [TierCode(out[i]) for i in range(len(keys))]

    # --- the 17 operations ------------------------------------------------------

    def register_listener(self, listener: object) -> None:
        """Appends a listener (see the module docs). Raises ``TypeError``,
        registering nothing, for an object with none of the seven methods
        (a listener that would never be called: misspelled, or written
        with the reference's ``on_l1_keys_*`` names) or with one of them
        not callable."""
        methods = _listener_methods(listener)
        raw = N.TierListener()
        raw.size = ctypes.sizeof(raw)
        for name, method in methods.items():

            def trampoline(_user, keys, n, method=method):
                method(_keys_from_c(keys, n))

            cb = N.TIER_KEYS_FN(trampoline)
            self._callbacks.append(cb)
            setattr(raw, name, cb)
        check(N.lib.cxlkv_tier_register_listener(self._h(), ctypes.byref(raw)))

    def reserve_read(
        self, keys: Iterable[BytesLike], extra_count: int = 0, *, holds: Optional[int] = None
    ) -> list[tuple[TierCode, Optional[TierPage]]]:
        """Takes ``1 + extra_count`` (or ``holds``) read holds per key and
        returns ``(code, page)`` per key."""
        keys = _keys(keys, "reserve_read")
        total = _holds("reserve_read", extra_count, holds)
        return self._call_pages("reserve_read", keys, total)

    def unsafe_read(self, keys: Iterable[BytesLike]) -> list[tuple[TierCode, Optional[TierPage]]]:
        """The staged pages, with no new hold (between ``reserve_read`` and
        its ``finish_read`` only)."""
        keys = _keys(keys, "unsafe_read")
        results = self._call_pages("unsafe", keys)
        for _, page in results:
            if page is not None:
                self._track(page)
        return results

    def finish_read(
        self, keys: Iterable[BytesLike], extra_count: int = 0, *, holds: Optional[int] = None
    ) -> list[TierCode]:
        """Releases holds (and the pins behind them, before returning)."""
        keys = _keys(keys, "finish_read")
        total = _holds("finish_read", extra_count, holds)
        with self._ending(keys):
            codes = self._call_codes(N.lib.cxlkv_tier_finish_read, keys, total)
            self._revalidate(keys, writes_ended=False)
        return codes

    def reserve_write(
        self,
        keys: Iterable[BytesLike],
        is_temporary: Sequence[bool],
        len_bytes: Optional[int] = None,
        mode: str = "new",
    ) -> list[tuple[TierCode, Optional[TierPage]]]:
        """Reserves a page per key for a chunk of ``len_bytes`` (default: a
        whole page), written in place through the page's writable
        memoryview. Only ``mode="new"`` (keys are write-once)."""
        keys = _keys(keys, "reserve_write")
        if isinstance(is_temporary, str):
            # Its characters would be as many true flags.
            raise TypeError("reserve_write(is_temporary): expected one flag per key, not a str")
        # Bounded like the keys: one flag per key, an endless iterable read
        # no further than one flag past them.
        flags_given = list(itertools.islice(is_temporary, len(keys) + 1))
        if mode not in N.TIER_WRITE_MODES:
            raise ArgumentError(Status.INVALID_ARGUMENT, f"mode {mode!r} is not new, update or all")
        if len(flags_given) != len(keys):
            given = len(flags_given) if len(flags_given) <= len(keys) else f"more than {len(keys)}"
            raise TierArgumentError(
                Status.TIER_LENGTH_MISMATCH,
                f"reserve_write: {len(keys)} keys but {given} is_temporary flags",
            )
        is_temporary = flags_given
        flags = (ctypes.c_uint8 * max(len(keys), 1))(*[1 if t else 0 for t in is_temporary])
        if len_bytes is None:
            len_bytes = self._page_size
        len_bytes = _c_uint(len_bytes, ctypes.c_uint64, "reserve_write(): len_bytes")
        return self._call_pages(
            "reserve_write", keys, flags, len_bytes, N.TIER_WRITE_MODES[mode]
        )

    def finish_write(self, keys: Iterable[BytesLike]) -> list[TierCode]:
        """Completes writes: temporaries privately, retained keys registered
        (one round trip)."""
        keys = _keys(keys, "finish_write")
        with self._ending(keys):
            codes = self._call_codes(N.lib.cxlkv_tier_finish_write, keys)
            self._revalidate(keys, writes_ended=True)
        return codes

    def finish_write_and_reserve_read(
        self, keys: Iterable[BytesLike], extra_count: int = 0, *, holds: Optional[int] = None
    ) -> list[tuple[TierCode, Optional[TierPage]]]:
        """The L2 → L1 promote: completes the writes and holds the keys for
        reading (never reported as written)."""
        keys = _keys(keys, "finish_write_and_reserve_read")
        total = _holds("finish_write_and_reserve_read", extra_count, holds)
        with self._ending(keys):
            results = self._call_pages("promote", keys, total)
            fresh = {id(p) for _, p in results if p is not None}
            for p in self._live_pages(keys):
                if p.writable and id(p) not in fresh:
                    p._release()
        self._prune(keys)
        return results

    def delete(self, keys: Iterable[BytesLike], force: bool = False) -> list[TierCode]:
        """Deletes keys (``force`` is accepted and ignored, as in the
        reference)."""
        keys = _keys(keys, "delete")
        with self._ending(keys):
            codes = self._call_codes(N.lib.cxlkv_tier_delete, keys, bool(force))
            self._revalidate(keys, writes_ended=False)
        return codes

    def touch_keys(self, keys: Iterable[BytesLike]) -> None:
        """Tells the listeners ``accessed(keys)``."""
        keys = _keys(keys, "touch_keys")
        keep: list = []
        karr = _bytes_array(keys, keep)
        check(N.lib.cxlkv_tier_touch_keys(self._h(), karr, len(keys)))

    def clear(self, force: bool = False) -> None:
        """Drops local staging (never shared data); ``force`` drops all of
        it."""
        with self._ending(None):
            check(N.lib.cxlkv_tier_clear(self._h(), bool(force)))
            if force:
                # Nothing is staged any more: every page's reservation
                # ended, no need to ask which.
                for p in self._live_pages():
                    p._release()
                self._prune(None)
            else:
                self._revalidate(None, writes_ended=False)

    def is_key_evictable(self, key: BytesLike) -> bool:
        out = ctypes.c_bool()
        keep: list = []
        addr, n = _as_buffer(_key(key), keep)
        check(N.lib.cxlkv_tier_is_key_evictable(self._h(), addr, n, ctypes.byref(out)))
        return out.value

    def get_memory_usage(self) -> tuple[int, int]:
        """``(used, total)`` bytes, with no round trip."""
        used, total = ctypes.c_uint64(), ctypes.c_uint64()
        check(N.lib.cxlkv_tier_get_memory_usage(self._h(), ctypes.byref(used), ctypes.byref(total)))
        return used.value, total.value

    def get_l1_memory_desc(self) -> None:
        """Always ``None``: the shared pool has no single registrable region
        (use the client's ``on_map`` / ``on_unmap`` callbacks)."""
        out = ctypes.c_bool()
        check(N.lib.cxlkv_tier_get_l1_memory_desc(self._h(), ctypes.byref(out)))
        return None

    def get_object_state(self, key: BytesLike) -> None:
        """Always ``None``: membership lives in the directory (see
        :meth:`inspect`)."""
        out = ctypes.c_bool()
        keep: list = []
        addr, n = _as_buffer(_key(key), keep)
        check(N.lib.cxlkv_tier_get_object_state(self._h(), addr, n, ctypes.byref(out)))
        return None

    def memcheck(self) -> bool:
        out = ctypes.c_bool()
        check(N.lib.cxlkv_tier_memcheck(self._h(), ctypes.byref(out)))
        return out.value

    def report_status(self) -> dict:
        """The stock status keys plus ``backend``."""
        out = N.sized(N.TierStatus)
        check(N.lib.cxlkv_tier_report_status(self._h(), ctypes.byref(out)))
        status = {"is_healthy": bool(out.is_healthy), "backend": out.backend.decode()}
        status.update({n: getattr(out, n) for n in N.TIER_STATUS_COUNTS})
        status.update({n: getattr(out, n) for n in N.TIER_STATUS_RATIOS})
        return status

    def close(self) -> None:
        """Stops the sweeper and drains the staging; every page of the tier
        is released (and the client's session, if the client was closed
        and nothing else holds it, ends). Raises ``BufferError`` (and stays
        open) while a memoryview of one of its pages is alive, and
        :class:`~cxlkv.errors.TierError` (``TIER_REENTRANT``; the tier stays
        open) from a listener of this tier. Idempotent; allowed after the
        client's close."""
        if self._handle is None:
            return
        if _inherited(self._client):
            # A forked child's copy: the tier is the parent's.
            self._handle = None
            return
        with self._ending(None):
            with self._pages_lock:
                handle, self._handle = self._handle, None
            if handle is None:
                return  # another thread closed it
            status = N.lib.cxlkv_tier_close(handle)
            err = error_for(status) if status != 0 else None  # this thread's message, now
            if status == Status.TIER_REENTRANT:
                # Refused (from a listener): the C tier and its handle stay.
                self._handle = handle
                raise err
            # Any other status: the handle is freed all the same.
            self._revalidate(None, writes_ended=True)
        self._client._unhold()
        if err is not None:
            raise err

    # --- beyond the 17 ------------------------------------------------------

    def inspect(self, key: BytesLike) -> dict:
        """Where ``key`` stands here: ``stage`` (``untracked``,
        ``write_staged``, ``read_staged``), ``temporary``, ``holds``,
        ``pinned``."""
        return self._inspect(self._h(), key)

    def _inspect(self, handle: int, key: BytesLike) -> dict:
        out = N.sized(N.TierKeyStage)
        keep: list = []
        addr, n = _as_buffer(_key(key), keep)
        check(N.lib.cxlkv_tier_inspect(handle, addr, n, ctypes.byref(out)))
        return {
            "stage": N.TIER_STAGES.get(out.stage, str(out.stage)),
            "temporary": bool(out.temporary),
            "holds": out.holds,
            "pinned": out.pinned,
        }

    def stats(self) -> dict:
        out = N.sized(N.TierStats)
        check(N.lib.cxlkv_tier_query_stats(self._h(), ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.TIER_STATS_FIELDS}

    def sweep_now(self) -> tuple[int, int]:
        """Runs one TTL sweep now: ``(writes, reads)`` reclaimed."""
        writes, reads = ctypes.c_uint64(), ctypes.c_uint64()
        with self._ending(None):
            check(
                N.lib.cxlkv_tier_sweep_now(self._h(), ctypes.byref(writes), ctypes.byref(reads))
            )
            live = self._live_pages()
            write_keys = [p.key for p in live if p.writable]
            if write_keys:
                try:
                    h = self._h_held()
                    stages = {k: self._inspect(h, k)["stage"] for k in set(write_keys)}
                except Error:
                    stages = {}  # cannot be asked: every write page taken as ended
                for p in live:
                    if p.writable and stages.get(p.key) != "write_staged":
                        p._release()
            self._revalidate(None, writes_ended=False)
        return writes.value, reads.value

    def check_invariants(self) -> None:
        check(N.lib.cxlkv_tier_check_invariants(self._h()))

    def __enter__(self) -> "L1Tier":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _unless_unwinding(exc_type):
            self.close()

    def __del__(self):
        # No memoryview of a page is alive (each would hold this object).
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is None:
            return
        try:
            # A page's weak reference still reaches this object while this
            # runs: its pages are marked ending first, so that none is
            # exported from another thread meanwhile (never unmarked: they
            # are released below).
            with self._export_lock:
                pages = self._live_pages()
                for p in pages:
                    p._ending += 1
            N.lib.cxlkv_tier_close(handle)
            for p in pages:
                p._release()
        finally:
            self._client._unhold()


#: The reference's listener method names (its §2.3), by this package's.
_REFERENCE_CALLBACKS = {
    "reserved_read": "on_l1_keys_reserved_read",
    "read_finished": "on_l1_keys_read_finished",
    "reserved_write": "on_l1_keys_reserved_write",
    "write_finished": "on_l1_keys_write_finished",
    "finish_write_and_reserve_read": "on_l1_keys_finish_write_and_reserve_read",
    "deleted": "on_l1_keys_deleted_by_manager",
    "accessed": "on_l1_keys_accessed",
}


def _listener_methods(listener: object) -> dict:
    """The listener's callbacks by name, checked: at least one, each
    callable. A listener none of whose methods has a callback's name would
    be registered and never called — the eviction policy never told of a
    deletion, the store controller never of a write — so it is refused."""
    methods = {}
    for name in N.LISTENER_CALLBACKS:
        method = getattr(listener, name, None)
        if method is None:
            continue
        if not callable(method):
            raise TypeError(
                f"register_listener(): the listener's {name} is a {type(method).__name__}, "
                "not a method"
            )
        methods[name] = method
    if not methods:
        reference = [
            f"{theirs} -> {ours}"
            for ours, theirs in _REFERENCE_CALLBACKS.items()
            if callable(getattr(listener, theirs, None))
        ]
        hint = (
            f" (it has the reference's names: rename {', '.join(reference)})"
            if reference
            else ""
        )
        raise TypeError(
            f"register_listener(): a {type(listener).__name__} has none of the listener "
            f"methods {', '.join(N.LISTENER_CALLBACKS)}, so it would never be called{hint}"
        )
    return methods


def _keys_from_c(keys, n: int) -> list[bytes]:
    return [ctypes.string_at(keys[i].data, keys[i].len) for i in range(n)]
