"""The client: sessions, layouts, zero-copy views and writable leases.

Memory safety of views
----------------------
A :class:`View` is a chunk *in place* in the shared pool: its
:meth:`View.memoryview` is a read-only ``memoryview`` over the pool's bytes
(no copy). The pin that keeps the chunk in place is released by
:meth:`View.release` (or the ``with`` block's end). Releasing while a
memoryview of it — or a slice, a cast, a NumPy array made from one — is
still alive would leave that memoryview reading memory that may be reused,
so it is refused:

- every :meth:`View.memoryview` call exports the bytes through a fresh
  ctypes array at the chunk's address; the memoryview, and everything
  derived from it, holds that array (it is the buffer's exporter), and the
  view keeps only a *weak* reference to it. The array therefore lives
  exactly as long as some memoryview of it does;
- :meth:`View.release` refuses with ``BufferError`` while any of those
  arrays is alive (after one garbage collection, for memoryviews kept only
  by reference cycles), leaving the view valid and readable; once they are
  all gone it releases the pin, and :meth:`View.memoryview` raises
  :class:`ViewReleasedError` from then on;
- each array also holds the pin, so a view object collected while a
  memoryview of it lives keeps its pin until that memoryview goes; and the
  pin holds its :class:`Client`, so neither garbage collection nor
  :meth:`Client.close` ends the session (which would release the pin in
  the directory) while a view is unreleased: an explicit close is deferred
  until the last view is released (see :meth:`Client.close`).

Leases use the same mechanism for their writable memoryviews: registering
or aborting a lease while one is alive raises ``BufferError``, so no write
through Python can follow publication, and a lease object is kept alive by
its memoryviews; an unconsumed lease holds its client's session as a view
does. (This relies on CPython freeing objects when their last reference
goes, as the GIL build does.) A lease's memoryview is asked of the library
at each call, which refuses a lease whose region was revoked.

Views, leases, layouts and clients refuse ``copy.copy``, ``copy.deepcopy``
and pickling (``TypeError``): a copy would share the pin, lease, handle or
hold on the session, but not the state above that guards it.

Thread safety: a :class:`Client` and its :class:`Layout` objects may be
used from several threads at once (the C library is thread-safe and ctypes
releases the GIL around every call). A :class:`Lease` is written by one
thread at a time; a :class:`View` must not be released while another
thread reads its memoryview (the export check covers memoryviews, not a
raw address taken from one).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import itertools
import operator
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

from . import _native as N
from .errors import (
    ArgumentError,
    ClosedError,
    HandleError,
    Status,
    ViewReleasedError,
    check,
    error_for,
)
from .keys import ObjectKey

BytesLike = Union[bytes, bytearray, memoryview, str]

#: What one key (or one chunk) may be. Each is also an iterable — of
#: characters or of ints — so one given where a batch is expected would be
#: taken for that many keys: batch calls refuse them.
_SINGLE = (str, bytes, bytearray, memoryview)


def _c_uint(value: int, ctype, name: str) -> int:
    """``value`` checked against the unsigned C type ``ctype`` it is passed
    as: ctypes keeps only the low bits (``2**64 + 5`` becomes 5, ``-1``
    becomes ``2**64 - 1``), so an int out of range would silently name
    another fingerprint, length or size. ``name`` (the call and argument)
    is what the error names."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    bits = 8 * ctypes.sizeof(ctype)
    if not 0 <= value < 1 << bits:
        raise ArgumentError(
            Status.INVALID_ARGUMENT,
            f"{name}={value} is out of range for its C type (0 to 2**{bits} - 1)",
        )
    return value


#: Most entries one batch call carries: the library's limit (see
#: ``_native.MAX_BATCH``).
MAX_BATCH = N.MAX_BATCH


def _batch_too_large(call: str, n: Union[int, str]) -> ArgumentError:
    return ArgumentError(
        Status.BATCH_TOO_LARGE,
        f"{call}: a batch of {n} exceeds the library's limit of {MAX_BATCH} "
        "(cxlkv.MAX_BATCH; the directory's may be lower: Client.session()['max_batch'])",
    )


def _batch_count(n: int, call: str) -> int:
    """A batch size given as an int (``batch_alloc(n)``), refused above
    :data:`MAX_BATCH` before anything is allocated for it: the library
    refuses it anyway, and an array of ``10**12`` result slots would raise
    ``MemoryError`` (or take the memory) first."""
    n = _c_uint(n, ctypes.c_size_t, f"{call}: n")
    if n > MAX_BATCH:
        raise _batch_too_large(call, n)
    return n


def _bounded(items: Iterable, call: str) -> list:
    """The entries of a batch as a list, at most :data:`MAX_BATCH` of them:
    a longer one is refused having read no more than one entry past the
    limit (an endless iterator included) and allocated nothing for it."""
    try:
        n = len(items)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is not None and n > MAX_BATCH:
        raise _batch_too_large(call, n)
    out = list(itertools.islice(items, MAX_BATCH + 1))
    if len(out) > MAX_BATCH:
        raise _batch_too_large(call, f"more than {MAX_BATCH}")
    return out


def _inherited(client: "Client") -> bool:
    """Whether ``client`` was connected by another process: this one was
    forked from it. The library refuses such a client's handles (and
    everything made from it: :class:`HandleError`), so that nothing here
    can use or end the parent's session; closing, releasing or aborting
    them here only marks this process's copies done."""
    return client._pid != os.getpid()


class _NotCopyable:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling. The object
    owns something that must be given back exactly once — a view's pin, a
    lease, a handle, a hold on the session — and the state that guards
    that (a released flag, the live memoryviews); a copy would share the
    one but not the other: a view's copy would still read its chunk after
    ``release()``, a lease's copy would give its hold on the session back
    twice."""

    __slots__ = ()

    #: Why, in the error: what the object owns that a copy would share.
    _NOT_COPYABLE_WHY = (
        "it owns a pin, lease, handle or hold on the session that only this object may give back"
    )

    def _refuse(self, what: str):
        raise TypeError(f"a {type(self).__name__} cannot be {what}: {self._NOT_COPYABLE_WHY}")

    def __copy__(self):
        self._refuse("copied")

    def __deepcopy__(self, memo):
        self._refuse("copied")

    def __reduce__(self):
        self._refuse("pickled")


@contextlib.contextmanager
def _unless_unwinding(exc_type):
    """Around a ``with`` block's release (of a view, a batch of views, a
    lease, a tier): the ``BufferError`` of a memoryview still alive is
    dropped when the block is left by an exception — most likely raised
    before the block's ``del`` of that memoryview, which the traceback now
    holds. The caller's exception goes on (an ``except`` for it still
    catches it), and the object is released, aborted or closed when
    collected, once its last memoryview goes."""
    try:
        yield
    except BufferError:
        if exc_type is None:
            raise


def _as_buffer(obj: BytesLike, keep: list) -> tuple[int, int]:
    """``(address, length)`` of ``obj``'s bytes, without a copy for bytes,
    bytearray and writable C-contiguous buffers (read-only buffers of other
    types, and Fortran-ordered ones — a transposed array —, are copied
    once, in logical order as ``bytes()`` gives them); ``keep`` holds what
    must outlive the call."""
    if isinstance(obj, str):
        obj = obj.encode()
    if isinstance(obj, bytes):
        if not obj:
            return 0, 0
        p = ctypes.c_char_p(obj)
        keep.append(p)
        return ctypes.cast(p, ctypes.c_void_p).value, len(obj)
    mv = memoryview(obj)
    if mv.nbytes == 0:
        return 0, 0
    if not mv.contiguous:
        raise ArgumentError(Status.INVALID_ARGUMENT, "buffers must be contiguous")
    if mv.readonly or not mv.c_contiguous:
        # Only a C-contiguous view casts to bytes in place.
        return _as_buffer(mv.tobytes(), keep)
    arr = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B"))
    keep.append(arr)
    return ctypes.addressof(arr), mv.nbytes


def _bytes_array(items: Sequence[BytesLike], keep: list, what: Optional[str] = None):
    """The C array of ``items``' buffers. ``what`` (``"batch_put(items):
    item"``) names an item that is not a buffer in the error, by its
    position: ``memoryview()``'s own message names neither."""
    arr = (N.Bytes * len(items))()
    for i, item in enumerate(items):
        try:
            arr[i].data, arr[i].len = _as_buffer(item, keep)
        except TypeError as e:
            if what is None:
                raise
            raise TypeError(f"{what} {i}: the chunk is not bytes-like: {e}") from None
        except ArgumentError as e:
            if what is None:
                raise
            raise ArgumentError(e.status, f"{what} {i}: {e.message}") from None
    keep.append(arr)
    return arr


class _Exports:
    """The buffers exported from one piece of pool memory (see the module
    docs): fresh ctypes arrays at its address, tracked by weak references
    (ctypes arrays are unhashable, so by ``id``; an entry is removed when
    its array dies, before the ``id`` can be reused)."""

    __slots__ = ("_refs",)

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def export(self, address: int, length: int, owner: object, readonly: bool) -> memoryview:
        arr = (ctypes.c_ubyte * length).from_address(address)
        # Whoever holds the array (every memoryview of it) holds the owner.
        arr._cxlkv_owner = owner
        refs, key = self._refs, id(arr)
        refs[key] = weakref.ref(arr, lambda _dead: refs.pop(key, None))
        mv = memoryview(arr).cast("B")
        return mv.toreadonly() if readonly else mv

    def _any(self) -> bool:
        return any(r() is not None for r in list(self._refs.values()))

    def alive(self) -> bool:
        if not self._any():
            return False
        # A memoryview kept only by a reference cycle is dead but not freed.
        gc.collect()
        return self._any()


@dataclass(frozen=True)
class Location:
    """Where a chunk lives in the pool."""

    region_id: int
    page: int
    generation: int
    len_bytes: int

    @classmethod
    def _from(cls, raw: N.Location) -> "Location":
        return cls(raw.region_id, raw.page, raw.generation, raw.len_bytes)


@dataclass(frozen=True)
class RegisterResult:
    """What happened to one registration: ``inserted``; else ``duplicate``
    (``winner`` is the existing chunk) or ``rejected`` (``reject_reason``,
    the wire's number)."""

    outcome: str
    reject_reason: int = 0
    winner: Optional[Location] = None

    @property
    def inserted(self) -> bool:
        return self.outcome == "inserted"

    @classmethod
    def _from(cls, raw: N.RegisterResult) -> "RegisterResult":
        if raw.outcome == N.REGISTER_INSERTED:
            return cls("inserted")
        if raw.outcome == N.REGISTER_DUPLICATE:
            return cls("duplicate", winner=Location._from(raw.winner))
        return cls("rejected", reject_reason=raw.reject_reason)


@dataclass(frozen=True)
class DeleteResult:
    """``deleted``, ``pinned`` (``pins`` held; nothing changed) or
    ``missing``."""

    outcome: str
    pins: int = 0

    @classmethod
    def _from(cls, raw: N.DeleteResult) -> "DeleteResult":
        name = {N.DELETE_DELETED: "deleted", N.DELETE_PINNED: "pinned"}.get(raw.outcome, "missing")
        return cls(name, raw.pins)


class _Pin(_NotCopyable):
    """Owns one view's guard; releases it once, explicitly or when
    collected. Until then it holds its client (a hold on the session, and
    the map callbacks that the release may call): every memoryview of the
    view holds the pin, so no memoryview outlives the session."""

    __slots__ = ("_raw", "_client")

    def __init__(self, raw: N.View, client: "Client"):
        # The hold first: if the session is already gone it raises, and
        # this pin never owns the guard (nor gives back a hold it lacks).
        client._hold()
        self._raw = raw
        self._client = client

    def release(self) -> None:
        client = getattr(self, "_client", None)  # unset if __init__ raised
        if client is None:
            return
        # Taken under the client's lock: two threads releasing one view must
        # not both release its guard and both give back its hold (one hold
        # too few would end the session under other views).
        with client._lock:
            raw, self._raw = self._raw, None
        if raw is None:
            return
        # A forked child's copy: the pin is the parent's.
        status = 0 if _inherited(client) else N.lib.cxlkv_release(ctypes.byref(raw))
        err = error_for(status) if status != 0 else None  # this thread's message, now
        self._client = None
        client._unhold()
        if err is not None:
            raise err

    def __del__(self):
        try:
            self.release()
        except Exception:  # nothing to report it to
            pass


class View(_NotCopyable):
    """A chunk in place in the shared pool, pinned until released (see the
    module docs). Use as a context manager, or call :meth:`release`. A
    ``with`` block left by an exception while a memoryview of the view is
    alive lets that exception through (not the release's ``BufferError``):
    the view is then released when collected, after its last memoryview."""

    __slots__ = ("key", "location", "_len", "_address", "_pin", "_exports")

    def __init__(self, key: bytes, raw: N.View, client: "Client"):
        self.key = key
        self.location = Location._from(raw.location)
        self._len = raw.len_bytes
        self._address = raw.data
        self._exports = _Exports()
        # The pin holds the client (its session and map callbacks) until
        # released; every memoryview holds the pin. Made last: a view whose
        # construction failed never took the guard (Layout.batch_get
        # releases it).
        self._pin = _Pin(raw, client)

    def __len__(self) -> int:
        return self._len

    @property
    def released(self) -> bool:
        return self._address is None

    def _live(self) -> int:
        if self._address is None:
            raise ViewReleasedError(f"the view of {self.key!r} was released")
        return self._address

    def memoryview(self) -> memoryview:
        """A read-only memoryview of the chunk's bytes in the pool (zero
        copy). Raises :class:`ViewReleasedError` after release."""
        return self._exports.export(self._live(), self._len, self._pin, readonly=True)

    def __bytes__(self) -> bytes:
        """A copy of the chunk."""
        return self.memoryview().tobytes()

    def address(self) -> int:
        """The chunk's address in this process (for engines that hand it to
        a device); valid until release, which nothing here can check."""
        return self._live()

    def release(self) -> None:
        """Releases the pin. Raises ``BufferError`` (and keeps the view)
        while a memoryview of it is alive; a no-op once released."""
        if self._address is None:
            return
        if self._exports.alive():
            raise BufferError(
                f"a memoryview of the view of {self.key!r} is still alive; "
                "release or drop it before releasing the view"
            )
        self._address = None
        self._pin.release()

    def __enter__(self) -> "View":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _unless_unwinding(exc_type):
            self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self._len} bytes"
        return f"View({self.key!r}, {state})"


class ViewBatch(list):
    """The result of :meth:`Layout.batch_get`: a list of :class:`View` (or
    ``None`` for absent keys); as a context manager, releases them all
    (those with a live memoryview when left by an exception: when
    collected, as :class:`View`)."""

    def release(self) -> None:
        first = None
        for v in self:
            if v is not None:
                try:
                    v.release()
                except BufferError as e:
                    first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "ViewBatch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _unless_unwinding(exc_type):
            self.release()


class Lease(_NotCopyable):
    """A writable page no key names yet: write it (``write``, or in place
    through :meth:`memoryview` then :meth:`set_len`), then register it with
    :meth:`Layout.register`. Dropped unregistered, its page goes back.
    Until then it holds its client's session (see :meth:`Client.close`):
    the page is the instance's only while the session lasts. As a context
    manager it aborts an unregistered lease (when left by an exception
    while a memoryview of it is alive: when collected, as :class:`View`)."""

    __slots__ = (
        "_handle",
        "_capacity",
        "_len",
        "_exports",
        "_layout",
        "_session",
        "__weakref__",
    )

    def __init__(self, handle: int, layout: "Layout"):
        self._session = None
        self._handle = handle
        # The layout's page size, not asked of cxlkv_lease_data: that call
        # marks the page written (a write-back when the lease goes, on a
        # pool that needs one), and is made by memoryview() only.
        self._capacity = layout._page_size_bytes
        self._len = 0
        self._exports = _Exports()
        self._layout = layout
        layout._client._hold()
        self._session = layout._client

    @property
    def capacity(self) -> int:
        """The page size: the most a chunk can hold."""
        return self._capacity

    def _live(self) -> int:
        if self._handle is None:
            raise ViewReleasedError("the lease was registered or aborted")
        return self._handle

    def memoryview(self) -> memoryview:
        """The whole page, writable, in place in the pool. Every memoryview
        of it must be gone before the lease is registered or aborted.
        Asks the library each time (no round trip), so a lease whose region
        was revoked — its client closed in C, a reattach refused — raises
        :class:`HandleError` (``REGION_REVOKED``) as :meth:`write` does,
        rather than handing out a page that may be another instance's."""
        data, cap = ctypes.c_void_p(), ctypes.c_uint64()
        check(N.lib.cxlkv_lease_data(self._live(), ctypes.byref(data), ctypes.byref(cap)))
        return self._exports.export(data.value, cap.value, self, readonly=False)

    def write(self, data: BytesLike) -> None:
        """Copies ``data`` to the start of the page (non-temporal stores for
        large chunks) and sets the length."""
        keep: list = []
        try:
            addr, n = _as_buffer(data, keep)
        except TypeError as e:
            raise TypeError(f"Lease.write(data): the chunk is not bytes-like: {e}") from None
        check(N.lib.cxlkv_lease_write(self._live(), addr, n))
        self._len = n

    def set_len(self, len_bytes: int) -> None:
        """Sets the chunk's length after writing through :meth:`memoryview`."""
        len_bytes = _c_uint(len_bytes, ctypes.c_uint64, "Lease.set_len(): len_bytes")
        check(N.lib.cxlkv_lease_set_len(self._live(), len_bytes))
        self._len = len_bytes

    def __len__(self) -> int:
        return self._len

    def _check_unexported(self) -> None:
        self._live()
        if self._exports.alive():
            raise BufferError("a memoryview of the lease is still alive; drop it first")

    def _take(self) -> int:
        """Hands the handle over (registration or abort consumes it; call
        :meth:`_unhold` after that call)."""
        self._check_unexported()
        handle, self._handle = self._handle, None
        return handle

    def _unhold(self) -> None:
        """Gives up the hold on the session, once the handle was consumed."""
        client, self._session = getattr(self, "_session", None), None
        if client is not None:
            client._unhold()

    def abort(self) -> None:
        """Gives the page back (a no-op once registered or aborted)."""
        if self._handle is not None:
            handle = self._take()
            # A forked child's copy: the page is the parent's.
            status = 0 if _inherited(self._layout._client) else N.lib.cxlkv_lease_abort(handle)
            err = error_for(status) if status != 0 else None  # this thread's message, now
            self._unhold()
            if err is not None:
                raise err

    def __del__(self):
        # No memoryview is alive (each would hold this object).
        handle, self._handle = getattr(self, "_handle", None), None
        try:
            if handle is not None:
                N.lib.cxlkv_lease_abort(handle)
        finally:
            self._unhold()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _unless_unwinding(exc_type):
            self.abort()


def _key(k: BytesLike) -> bytes:
    """A key's bytes: ``str`` as UTF-8, bytes-like objects as they are.
    Anything else is refused: ``bytes(5)`` is five zero bytes, so an
    ``int`` would otherwise name a different key silently."""
    if isinstance(k, str):
        return k.encode()
    if isinstance(k, (bytes, bytearray, memoryview)):
        return bytes(k)
    # An ObjectKey (a named tuple) is encoded by its caller: keys come back
    # from listeners as bytes, which would not compare equal to it.
    hint = "; give its .encode()" if callable(getattr(k, "encode", None)) else ""
    raise TypeError(
        f"a key is bytes, bytearray, memoryview or str, not {type(k).__name__}{hint}"
    )


def _keys(keys: Iterable[BytesLike], call: str) -> list[bytes]:
    """The keys of a batch call. One key alone is refused: ``"key"`` is an
    iterable of the keys ``"k"``, ``"e"``, ``"y"``."""
    if isinstance(keys, _SINGLE):
        raise TypeError(
            f"{call}(keys): expected an iterable of keys, not a single {type(keys).__name__} "
            "(give one key as [key])"
        )
    if isinstance(keys, ObjectKey):
        # A named tuple: its fields would be taken as keys.
        raise TypeError(
            f"{call}(keys): expected an iterable of keys, not a single ObjectKey "
            "(give one key as [key.encode()])"
        )
    out = []
    for i, k in enumerate(_bounded(keys, call)):
        try:
            out.append(_key(k))
        except TypeError as e:
            # Which call and which key: the bare message names neither.
            raise TypeError(f"{call}(keys): key {i}: {e}") from None
    return out


def _pairs(items: Iterable[tuple], call: str, second: str, param: str = "items") -> list[tuple]:
    """The ``(key, second)`` pairs of a batch call, keys converted (an error
    names ``call``, its parameter ``param`` and the item's position). A
    mapping is refused — iterating it gives its keys, and a two-character
    key would unpack as a key and its value (``{"ab": data}`` would store
    ``b"b"`` under ``"a"``) — and so is a str or bytes-like object as the
    whole or as one pair, for the same reason."""
    if isinstance(items, Mapping):
        raise TypeError(
            f"{call}({param}): expected an iterable of (key, {second}) pairs, not a "
            f"{type(items).__name__} (pass its .items())"
        )
    if isinstance(items, _SINGLE):
        raise TypeError(
            f"{call}({param}): expected an iterable of (key, {second}) pairs, "
            f"not a {type(items).__name__}"
        )
    out = []
    for i, item in enumerate(_bounded(items, call)):
        if isinstance(item, _SINGLE) or isinstance(item, Mapping):
            raise TypeError(
                f"{call}({param}): item {i} is a {type(item).__name__}, not a (key, {second}) pair"
            )
        try:
            k, v = item
        except (TypeError, ValueError):
            raise TypeError(
                f"{call}({param}): item {i} is not a (key, {second}) pair "
                f"(a {type(item).__name__})"
            ) from None
        try:
            out.append((_key(k), v))
        except TypeError as e:
            raise TypeError(f"{call}({param}): item {i}: {e}") from None
    return out


class Layout(_NotCopyable):
    """A layout (page size + fingerprint) of a client: its own regions and
    key space. Every ``batch_*`` call is one round trip. Keys are ``bytes``,
    ``bytearray``, ``memoryview`` or ``str`` (UTF-8); anything else raises
    ``TypeError``."""

    def __init__(self, handle: int, client: "Client", page_size_bytes: int):
        self._handle = handle
        self._client = client
        self._page_size_bytes = page_size_bytes  # its leases' capacity

    def _h(self) -> int:
        if self._handle is None:
            raise HandleError(Status.BAD_HANDLE, "the layout was closed")
        self._client._check_open()
        return self._handle

    def close(self) -> None:
        """Frees the handle (the layout's keys and regions stay)."""
        handle, self._handle = self._handle, None
        # A forked child's copy: the layout handle is the parent's.
        if handle is not None and not _inherited(self._client):
            check(N.lib.cxlkv_layout_close(handle))

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            N.lib.cxlkv_layout_close(handle)

    def __enter__(self) -> "Layout":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def info(self) -> dict:
        """Page size, fingerprint, region bytes, free pages, refused frees."""
        out = N.sized(N.LayoutInfo)
        check(N.lib.cxlkv_query_layout(self._h(), ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.LAYOUT_INFO_FIELDS}

    @property
    def page_size_bytes(self) -> int:
        return self.info()["page_size_bytes"]

    # --- write -----------------------------------------------------------

    def alloc(self) -> Lease:
        return self.batch_alloc(1)[0]

    def batch_alloc(self, n: int) -> list[Lease]:
        """``n`` writable pages, all or none."""
        n = _batch_count(n, "batch_alloc()")
        raw = (ctypes.c_void_p * max(n, 1))()
        # The call's own hold keeps a close() on another thread from ending
        # the session before each lease has taken its hold.
        with self._client._using():
            check(N.lib.cxlkv_batch_alloc(self._h(), n, raw))
            leases: list[Lease] = []
            try:
                for i in range(n):
                    leases.append(Lease(raw[i], self))
            except BaseException:
                for i in range(len(leases), n):
                    N.lib.cxlkv_lease_abort(raw[i])
                raise
        return leases

    def register(self, key: BytesLike, lease: Lease) -> RegisterResult:
        return self.batch_register([(key, lease)])[0]

    def batch_register(self, entries: Iterable[tuple[BytesLike, Lease]]) -> list[RegisterResult]:
        """Publishes and registers written leases (one round trip). Once
        the call reaches the library every lease is consumed, whatever the
        outcome (a failed call gives the pages back). What this package
        refuses first takes no lease: a closed layout or client, a lease
        given twice (:class:`ArgumentError`), a consumed lease
        (:class:`ViewReleasedError`), a lease with a live memoryview
        (``BufferError``)."""
        entries = _pairs(entries, "batch_register", "lease", "entries")
        n = len(entries)
        keys = [k for k, _ in entries]
        leases = [lease for _, lease in entries]
        seen: set[int] = set()
        for lease in leases:
            if not isinstance(lease, Lease):
                raise TypeError(f"expected a Lease, got {type(lease).__name__}")
            if id(lease) in seen:
                raise ArgumentError(
                    Status.INVALID_ARGUMENT, "batch_register: the same lease is given twice"
                )
            seen.add(id(lease))
            lease._check_unexported()
        layout = self._h()
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (N.RegisterResult * max(n, 1))()
        handles = (ctypes.c_void_p * max(n, 1))()
        # From here on nothing raises before the call, which consumes every
        # handle it is given whatever its status.
        for i, lease in enumerate(leases):
            handles[i], lease._handle = lease._handle, None
        status = N.lib.cxlkv_batch_register(layout, karr, handles, n, out)
        err = error_for(status) if status != 0 else None  # this thread's message, now
        for lease in leases:
            lease._unhold()
        if err is not None:
            raise err
        return [RegisterResult._from(out[i]) for i in range(n)]

    def put(self, key: BytesLike, data: BytesLike) -> RegisterResult:
        return self.batch_put([(key, data)])[0]

    def batch_put(self, items: Iterable[tuple[BytesLike, BytesLike]]) -> list[RegisterResult]:
        """Allocates, copies, publishes and registers each ``(key, data)``
        (an iterable of pairs: a dict is refused, pass its ``.items()``)."""
        items = _pairs(items, "batch_put", "data")
        keep: list = []
        karr = _bytes_array([k for k, _ in items], keep)
        varr = _bytes_array([v for _, v in items], keep, "batch_put(items): item")
        out = (N.RegisterResult * max(len(items), 1))()
        check(N.lib.cxlkv_batch_put(self._h(), karr, varr, len(items), out))
        return [RegisterResult._from(out[i]) for i in range(len(items))]

    # --- read --------------------------------------------------------------

    def get(self, key: BytesLike) -> Optional[View]:
        """The chunk under ``key``, pinned and in place; ``None`` if absent."""
        return self.batch_get([key])[0]

    def batch_get(self, keys: Iterable[BytesLike]) -> ViewBatch:
        """Pins and maps every key in one round trip (``None`` for absent
        keys)."""
        keys = _keys(keys, "batch_get")
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (N.View * max(len(keys), 1))()
        # The call's own hold keeps a close() on another thread from ending
        # the session (and with it the pins just taken) before each view's
        # pin has taken its hold.
        with self._client._using():
            check(N.lib.cxlkv_batch_get(self._h(), karr, len(keys), out))
            views = ViewBatch()
            try:
                for i, k in enumerate(keys):
                    if out[i].guard:
                        raw = N.View.from_buffer_copy(out[i])
                        views.append(View(k, raw, self._client))
                    else:
                        views.append(None)
            except BaseException:
                # The guards no view took (a view's pin is made last, so
                # the view that failed took none).
                for i in range(len(views), len(keys)):
                    if out[i].guard:
                        N.lib.cxlkv_release(ctypes.byref(out[i]))
                raise
        return views

    def exists(self, key: BytesLike) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Iterable[BytesLike]) -> list[bool]:
        keys = _keys(keys, "batch_exists")
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (ctypes.c_bool * max(len(keys), 1))()
        check(N.lib.cxlkv_batch_exists(self._h(), karr, len(keys), out))
        return [bool(out[i]) for i in range(len(keys))]

    def delete(self, key: BytesLike) -> DeleteResult:
        return self.batch_delete([key])[0]

    def batch_delete(self, keys: Iterable[BytesLike]) -> list[DeleteResult]:
        """Deletes keys: ``deleted``, ``pinned`` or ``missing`` each."""
        keys = _keys(keys, "batch_delete")
        keep: list = []
        karr = _bytes_array(keys, keep)
        out = (N.DeleteResult * max(len(keys), 1))()
        check(N.lib.cxlkv_batch_delete(self._h(), karr, len(keys), out))
        return [DeleteResult._from(out[i]) for i in range(len(keys))]


MapCallback = Callable[[int, int, int, int], None]


#: The ``cxlkv_config`` fields ``Client.connect(**more)`` accepts: the
#: integer settings. Not ``size``, lengths (``client_secret_len``,
#: ``pool_paths_len``: they describe a buffer, set with it), pointers, or
#: ``flags`` (``eager_map`` and ``auto_expand`` set it: taken by name too,
#: it would override them).
_CONNECT_MORE = {
    name: ctype
    for name, ctype in N.Config._fields_
    if ctype in (ctypes.c_uint32, ctypes.c_uint64)
    and name not in ("size", "flags")
    and not name.endswith("_len")
}


class Client(_NotCopyable):
    """A session with the cxlkv server. Use :meth:`connect`; close with
    :meth:`close` or a ``with`` block. Views and leases stay valid after
    close — views readable and pinned — until released (the session ends
    with the last of them, see :meth:`close`). A client belongs to the
    process that connected it: in a child made by ``os.fork()`` it and
    everything made from it raise :class:`HandleError`, and their
    finalizers leave the parent's session alone — connect anew there."""

    def __init__(self, handle: int, callbacks: list, layout_defaults: tuple[int, int, int]):
        self._handle = handle  # the C client, until cxlkv_close
        # The layout settings it was connected with, as cxlkv_layout_options
        # fields (initial_reservation_bytes, region_size_bytes, flags): what
        # layout() fills an option left unset with.
        self._layout_defaults = layout_defaults
        # ctypes callback objects must outlive every call into them: the
        # objects that can still unmap a region (layouts, leases, views'
        # pins, tiers) hold this client.
        self._callbacks = callbacks
        self._closed = False  # close() was called
        self._holds = 0  # unreleased views, unconsumed leases, open tiers
        self._lock = threading.RLock()
        self._pid = os.getpid()  # the process whose session this is

    @classmethod
    def connect(
        cls,
        socket_path: Optional[Union[str, bytes, os.PathLike]] = None,
        *,
        tcp_addr: Optional[str] = None,
        client_secret: Optional[bytes] = None,
        instance_id: Optional[str] = None,
        client_name: Optional[str] = None,
        region_size_bytes: Optional[int] = None,
        initial_reservation_bytes: Optional[int] = None,
        auto_expand: bool = True,
        eager_map: bool = False,
        quota_bytes: Optional[int] = None,
        request_timeout_ms: Optional[int] = None,
        on_map: Optional[MapCallback] = None,
        on_unmap: Optional[MapCallback] = None,
        **more: int,
    ) -> "Client":
        """Connects to a server on ``socket_path`` (a ``str``, ``bytes`` or
        ``os.PathLike`` path) or ``tcp_addr`` (``"host:port"``: an IP
        address or a host name, resolved now to its first address).
        ``tcp_addr``, ``instance_id`` and ``client_name`` are ``str``;
        another type raises ``TypeError``, a NUL character inside any of
        them :class:`ArgumentError`. ``on_map(region_id, offset_bytes, base_address,
        len_bytes)`` and ``on_unmap(...)`` are told of every region mapped
        and unmapped (from any thread; exceptions in them are printed and
        ignored); one that is not callable, or whose signature cannot take
        those four arguments, raises ``TypeError`` before connecting. A
        callback that takes a ``read_only`` keyword (or ``**kwargs``) is
        also told whether the mapping is read-only: peers'
        regions are mapped ``PROT_READ`` (a write into them faults), so a
        device registration of them must say so (CUDA:
        ``cudaHostRegisterReadOnly``). They run under the client's mapping locks, so they must
        not call into cxlkv — no method of this or another client, layout,
        view, lease or tier, from the callback or a thread it waits for: a
        call that maps a region would deadlock. Other ``cxlkv_config``
        integer settings may be passed by name (``max_retries=5``,
        ``unpin_delay_us=0``, ...); lengths, pointers, ``size`` and
        ``flags`` (set by ``eager_map`` and ``auto_expand``) may not
        (``TypeError``). An integer setting, named here or not, out of its
        field's range raises :class:`ArgumentError` (ctypes would keep only
        its low bits)."""
        cfg = N.Config()
        check(N.lib.cxlkv_config_init(ctypes.byref(cfg), ctypes.sizeof(cfg)))
        keep: list = []
        if socket_path is not None:
            cfg.socket_path = _c_string(socket_path, "socket_path", path=True)
        if tcp_addr is not None:
            cfg.tcp_addr = _c_string(tcp_addr, "tcp_addr")
        if client_secret is not None:
            try:
                cfg.client_secret, cfg.client_secret_len = _as_buffer(client_secret, keep)
            except TypeError as e:
                raise TypeError(f"connect(): client_secret is not bytes-like: {e}") from None
        if instance_id is not None:
            cfg.instance_id = _c_string(instance_id, "instance_id")
        if client_name is not None:
            cfg.client_name = _c_string(client_name, "client_name")
        for name, value in (
            ("region_size_bytes", region_size_bytes),
            ("initial_reservation_bytes", initial_reservation_bytes),
            ("quota_bytes", quota_bytes),
            ("request_timeout_ms", request_timeout_ms),
        ):
            if value is not None:
                setattr(cfg, name, _c_uint(value, ctypes.c_uint64, f"connect(): {name}"))
        cfg.flags = (N.CONFIG_EAGER_MAP if eager_map else 0) | (
            0 if auto_expand else N.CONFIG_NO_AUTO_EXPAND
        )
        for name, value in more.items():
            ctype = _CONNECT_MORE.get(name)
            if name == "flags":
                raise TypeError("connect(): pass eager_map= and auto_expand=, not flags=")
            if ctype is None:
                raise TypeError(f"connect() got an unexpected keyword argument {name!r}")
            setattr(cfg, name, _c_uint(value, ctype, f"connect(): {name}"))
        callbacks = []
        if on_map is not None or on_unmap is not None:
            cfg.map_callbacks.on_map = _map_fn(on_map, callbacks, "on_map")
            cfg.map_callbacks.before_unmap = _map_fn(on_unmap, callbacks, "on_unmap")
        handle = ctypes.c_void_p()
        check(N.lib.cxlkv_connect(ctypes.byref(cfg), ctypes.byref(handle)))
        layout_defaults = (
            cfg.initial_reservation_bytes,
            cfg.region_size_bytes,
            cfg.flags & N.CONFIG_NO_AUTO_EXPAND,
        )
        return cls(handle.value, callbacks, layout_defaults)

    def _check_open(self) -> None:
        if self._closed or self._handle is None:
            raise ClosedError(Status.CLOSED, "the client was closed")

    def _h(self) -> int:
        self._check_open()
        return self._handle

    def _hold(self) -> None:
        """A view's pin, a lease or a tier now depends on the session.
        Raises :class:`ClosedError` if the session already ended (a holder
        made from a call that did not hold it through :meth:`_using`)."""
        with self._lock:
            if self._handle is None:
                raise ClosedError(Status.CLOSED, "the client was closed")
            self._holds += 1

    @contextlib.contextmanager
    def _using(self):
        """Holds the session for the length of a call that makes holders
        (views, leases, a tier): between the C call returning what depends
        on the session and those objects taking their own holds, a
        :meth:`close` on another thread must not see no hold and end the
        session (releasing the pins just taken). The check that the client
        is open and the hold are one step under the lock, so a close that
        came first is seen here (:class:`ClosedError`), and one that comes
        later is deferred until this hold goes."""
        with self._lock:
            self._check_open()
            self._holds += 1
        try:
            yield
        finally:
            self._unhold()

    def _unhold(self) -> None:
        """The reverse of :meth:`_hold`; ends the session if it was closed
        meanwhile and this was the last hold (errors of that deferred
        close are not reported: the handle is freed whatever happens)."""
        with self._lock:
            self._holds -= 1
            handle = None
            if self._closed and self._holds == 0:
                handle, self._handle = self._handle, None
        if handle is not None:
            N.lib.cxlkv_close(handle)

    def close(self) -> None:
        """Closes the client: from now on it and its layouts (and tiers)
        raise :class:`ClosedError`. The session ends — pending unpins are
        sent first — now if no view is unreleased, no lease unconsumed and
        no tier open, else when the last of them is released, registered,
        aborted, closed or collected; a call returning views, leases or a
        tier on another thread holds the session until they hold it (see
        :meth:`_using`). (When the session ends, the directory
        releases its pins and the instance's pages may go to others: a view
        or lease used after that could read or write reused memory, which
        is why the end waits for them.) Idempotent; an error of a deferred
        end is not reported. In a process forked from the one that
        connected, it only marks this copy closed."""
        with self._lock:
            self._closed = True
            # A forked child's copy: the session is the parent's (the
            # library would refuse the handle); nothing to end here.
            if self._holds > 0 or _inherited(self):
                return
            handle, self._handle = self._handle, None
        if handle is not None:
            check(N.lib.cxlkv_close(handle))

    def __del__(self):
        # Nothing holds the client any more: no view, layout, lease or tier.
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            N.lib.cxlkv_close(handle)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def layout(
        self,
        page_size_bytes: int,
        fingerprint: int,
        *,
        initial_reservation_bytes: Optional[int] = None,
        region_size_bytes: Optional[int] = None,
        auto_expand: Optional[bool] = None,
    ) -> Layout:
        """The layout ``(page_size_bytes, fingerprint)``. The options apply
        when this client creates it (a layout it already has keeps its
        own); each one left ``None`` is the client's configuration — what
        :meth:`connect` was given, else the library's default — whether or
        not another option is given."""
        page_size_bytes = _c_uint(page_size_bytes, ctypes.c_uint64, "layout(): page_size_bytes")
        fingerprint = _c_uint(fingerprint, ctypes.c_uint64, "layout(): fingerprint")
        opts = None
        if (initial_reservation_bytes, region_size_bytes, auto_expand) != (None, None, None):
            opts = N.LayoutOptions()
            check(N.lib.cxlkv_layout_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
            # The client's settings first (as cxlkv_layout_open does with
            # no options at all), then what this call overrides.
            (
                opts.initial_reservation_bytes,
                opts.region_size_bytes,
                opts.flags,
            ) = self._layout_defaults
            if initial_reservation_bytes is not None:
                opts.initial_reservation_bytes = _c_uint(
                    initial_reservation_bytes,
                    ctypes.c_uint64,
                    "layout(): initial_reservation_bytes",
                )
            if region_size_bytes is not None:
                opts.region_size_bytes = _c_uint(
                    region_size_bytes, ctypes.c_uint64, "layout(): region_size_bytes"
                )
            if auto_expand is not None:
                opts.flags = 0 if auto_expand else N.CONFIG_NO_AUTO_EXPAND
        handle = ctypes.c_void_p()
        check(
            N.lib.cxlkv_layout_open(
                self._h(),
                page_size_bytes,
                fingerprint,
                ctypes.byref(opts) if opts is not None else None,
                ctypes.byref(handle),
            )
        )
        return Layout(handle.value, self, page_size_bytes)

    def stats(self) -> dict:
        """The client's counters."""
        out = N.sized(N.ClientStats)
        check(N.lib.cxlkv_query_stats(self._h(), ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.CLIENT_STATS_FIELDS}

    def usage(self) -> dict:
        """This instance's memory accounting (no round trip)."""
        out = N.sized(N.Usage)
        check(N.lib.cxlkv_query_usage(self._h(), ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.USAGE_FIELDS}

    def session(self) -> dict:
        """Session id, directory epoch, owned keys, unresolved registrations,
        and the directory's limits: ``max_batch`` (most keys per batch call)
        and ``max_key_bytes``."""
        self._check_open()
        return self._held_session()

    def _held_session(self) -> dict:
        """:meth:`session` for a holder of the session (an open tier): the
        C client lives as long as it is held, so this works after
        :meth:`close` too (a tier's listener may close the client in the
        middle of a tier call, whose follow-up still needs the limits)."""
        handle = self._handle
        if handle is None:
            raise ClosedError(Status.CLOSED, "the client was closed")
        out = N.sized(N.SessionInfo)
        check(N.lib.cxlkv_query_session(handle, ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.SESSION_FIELDS}

    def directory_stats(self) -> dict:
        """The directory's totals (one round trip)."""
        out = N.sized(N.DirectoryStats)
        check(N.lib.cxlkv_query_directory(self._h(), ctypes.byref(out)))
        return {f: getattr(out, f) for f in N.DIRECTORY_FIELDS}

    @property
    def instance_id(self) -> str:
        n = ctypes.c_size_t()
        buf = ctypes.create_string_buffer(256)
        check(N.lib.cxlkv_instance_id(self._h(), buf, len(buf), ctypes.byref(n)))
        return buf.value.decode()

    def flush_unpins(self) -> None:
        """Sends the unpins of released views now."""
        check(N.lib.cxlkv_flush_unpins(self._h()))

    def map_all_regions(self) -> int:
        """Maps every region of other instances now; how many were mapped."""
        n = ctypes.c_size_t()
        check(N.lib.cxlkv_map_all_regions(self._h(), ctypes.byref(n)))
        return n.value


def _c_string(value: object, name: str, path: bool = False) -> bytes:
    """A ``connect()`` string argument as the NUL-terminated C string the
    library reads. ``socket_path`` is a path — ``str``, ``bytes`` or
    ``os.PathLike``, as ``open()`` takes (``str()`` of ``bytes`` would be
    the path ``"b'/tmp/...'"``); the others are ``str``. Anything else
    raises ``TypeError``, and a NUL inside raises :class:`ArgumentError`
    (C would read the string only up to it: another path or name)."""
    if path and isinstance(value, (str, bytes, os.PathLike)):
        encoded = os.fsencode(value)
    elif isinstance(value, str):
        encoded = value.encode()
    else:
        kinds = "a str, bytes or os.PathLike path" if path else "a str"
        raise TypeError(f"connect(): {name} must be {kinds}, not {type(value).__name__}")
    if b"\0" in encoded:
        raise ArgumentError(
            Status.INVALID_ARGUMENT, f"connect(): {name} {value!r} contains a NUL character"
        )
    return encoded


def _takes_keyword(f: Callable, name: str) -> bool:
    """Whether ``f`` accepts the keyword argument ``name`` (by name or
    through ``**kwargs``); callables whose signature cannot be read do not."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == name and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
        for p in params
    )


def _map_fn(f: Optional[MapCallback], keep: list, name: str):
    if f is None:
        return N.MAP_FN()
    # Refused now, before connecting: else every mapping would raise in the
    # callback, printed and ignored (a device never told of the memory).
    if not callable(f):
        raise TypeError(
            f"connect(): {name} must be a callable (region_id, offset_bytes, base_address, "
            f"len_bytes), not {type(f).__name__}"
        )
    wants_read_only = _takes_keyword(f, "read_only")
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):
        signature = None  # cannot be read (a builtin): taken as it is
    if signature is not None:
        try:
            signature.bind(0, 0, 0, 0, **({"read_only": False} if wants_read_only else {}))
        except TypeError as e:
            raise TypeError(
                f"connect(): {name} cannot be called as {name}(region_id, offset_bytes, "
                f"base_address, len_bytes): {e}"
            ) from None

    def trampoline(_user_data, info):
        i = info.contents
        if wants_read_only:
            f(i.region_id, i.offset_bytes, i.base or 0, i.len_bytes, read_only=bool(i.read_only))
        else:
            f(i.region_id, i.offset_bytes, i.base or 0, i.len_bytes)

    cb = N.MAP_FN(trampoline)
    keep.append(cb)
    return cb
