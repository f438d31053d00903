"""Exceptions: every non-OK status of the C ABI becomes one, carrying the
status number, its stable name and the library's message.

The classes group statuses by what a caller does about them:

- :class:`ArgumentError` (also a ``ValueError``): fix the call;
- :class:`HandleError`: a handle was freed (or never valid, or belongs to
  the process this one was forked from), or a lease's region was revoked;
- :class:`ClosedError`: the client was closed;
- :class:`CapacityError`: out of pages, quota, layouts or handles;
- :class:`ConnectionLostError` (also a ``ConnectionError``): the server is
  unreachable or did not answer;
- :class:`IndeterminateError`: a request may or may not have taken effect;
- :class:`BusyError`: too many requests in flight, here (``BUSY``) or at
  the server (``SERVER_BUSY``, also a :class:`ServerError`): retry later;
- :class:`ServerError`: the server refused (``code`` is its wire code);
- :class:`TierError`: the L1 tier refused a whole call
  (:class:`TierArgumentError` for bad arguments, also an
  :class:`ArgumentError`);
- :class:`InternalError`: a bug or an unexpected failure below.

:class:`ViewReleasedError` is raised by this package itself, when a
released view or a consumed lease is used.
"""

from __future__ import annotations

import enum

from . import _native


class Status(enum.IntEnum):
    """``enum cxlkv_status`` (stable numbers)."""

    OK = 0
    INVALID_ARGUMENT = 1
    BAD_HANDLE = 2
    PANIC = 3
    BUFFER_TOO_SMALL = 4
    TOO_MANY_HANDLES = 5
    CONFIG = 10
    KEY_LENGTH = 11
    BATCH_TOO_LARGE = 12
    INVALID_PAGE_SIZE = 13
    CHUNK_LENGTH = 14
    FOREIGN_LEASE = 15
    TOO_MANY_LAYOUTS = 16
    OUT_OF_MEMORY = 20
    QUOTA_EXCEEDED = 21
    POOL = 30
    MAP = 31
    REGION_REVOKED = 32
    PROTOCOL = 40
    UNANSWERED = 41
    INDETERMINATE = 42
    CONNECT = 43
    DISCONNECTED = 44
    BUSY = 45
    CLOSED = 46
    OTHER = 99
    SERVER_UNKNOWN = 100
    SERVER_MALFORMED = 101
    SERVER_UNSUPPORTED_VERSION = 102
    SERVER_FRAME_TOO_LARGE = 103
    SERVER_KEY_TOO_LONG = 104
    SERVER_BATCH_TOO_LARGE = 105
    SERVER_UNKNOWN_KIND = 106
    SERVER_UNKNOWN_REGION = 107
    SERVER_NOT_OWNER = 108
    SERVER_BAD_TOKEN = 109
    SERVER_WRONG_LAYOUT = 110
    SERVER_QUOTA_EXCEEDED = 111
    SERVER_OUT_OF_SPACE = 112
    SERVER_AUTHENTICATION_REQUIRED = 113
    SERVER_AUTHENTICATION_FAILED = 114
    SERVER_SESSION_ENDED = 115
    SERVER_BUSY = 116
    SERVER_TIMEOUT = 117
    SERVER_SEQUENCE_TOO_OLD = 118
    SERVER_INVALID_ARGUMENT = 119
    SERVER_INTERNAL = 120
    SERVER_HELLO_REQUIRED = 121
    SERVER_INSTANCE_IN_USE = 122
    SERVER_INSTANCE_GONE = 123
    SERVER_REPLY_EVICTED = 124
    SERVER_PINS_HELD_BY_OTHER_SESSION = 125
    SERVER_REGION_NOT_EMPTY = 126
    SERVER_OWNERSHIP_NOT_PROVEN = 127
    TIER_DUPLICATE_KEY = 200
    TIER_LENGTH_MISMATCH = 201
    TIER_UNSUPPORTED_MODE = 202
    TIER_REENTRANT = 203
    TIER_CLOSED = 204
    TIER_INVARIANT = 205


class Error(Exception):
    """A failed cxlkv call: ``status`` (an ``int``, a :class:`Status` when
    known), ``status_name`` and the library's ``message``."""

    def __init__(self, status: int, message: str):
        try:
            self.status: int = Status(status)
        except ValueError:
            self.status = status
        self.status_name = _native.status_name(status)
        self.message = message
        super().__init__(f"{self.status_name}: {message}")

    def __reduce__(self):
        # Rebuilt from the constructor's own arguments (the default would
        # call it with ``args``, the one formatted string, and fail):
        # pickling is how multiprocessing and concurrent.futures hand a
        # worker's exception to its parent, and copy.copy uses it too.
        return (type(self), (int(self.status), self.message), self.__dict__)


class ArgumentError(Error, ValueError):
    """The call's arguments were refused; nothing changed."""


class HandleError(Error):
    """A handle was already freed, is not a handle of the right type, or
    was inherited across ``os.fork()`` (a client and what it made belong
    to the process that connected it) (``BAD_HANDLE``); or a lease's region
    was revoked: its client closed, or the directory refused a reattach
    (``REGION_REVOKED``)."""


class ClosedError(Error):
    """The client was closed."""


class CapacityError(Error):
    """No page could be had, or a quota or count limit was reached."""


class ConnectionLostError(Error, ConnectionError):
    """The server could not be reached, or did not answer in time."""


class IndeterminateError(Error):
    """The request may or may not have taken effect."""


class ServerError(Error):
    """The server refused the request; ``code`` is the wire error code."""

    @property
    def code(self) -> int:
        return int(self.status) - 100


class BusyError(Error):
    """Too many requests were in flight — in this client (``BUSY``: the
    server's reply window is full) or at the server (``SERVER_BUSY``, a
    :class:`ServerBusyError`); the request was refused before it took
    effect: retry later."""


class ServerBusyError(BusyError, ServerError):
    """The server refused the request as busy (``SERVER_BUSY``): a
    :class:`BusyError` and a :class:`ServerError`."""


class TierError(Error):
    """The L1 tier refused the whole call (e.g. a re-entrant call from a
    listener, or inconsistent arguments); nothing changed."""


class TierArgumentError(TierError, ArgumentError):
    """The L1 tier refused the call's arguments (a key repeated within the
    call, per-key lists of different lengths, an unsupported write mode)."""


class InternalError(Error):
    """A bug or an unexpected failure below (the message says what)."""


class ViewReleasedError(ValueError):
    """A view was used after its release, or a lease after registration or
    abort (the memory behind it may be reused)."""


_BY_STATUS = {
    Status.INVALID_ARGUMENT: ArgumentError,
    Status.BUFFER_TOO_SMALL: ArgumentError,
    Status.CONFIG: ArgumentError,
    Status.KEY_LENGTH: ArgumentError,
    Status.BATCH_TOO_LARGE: ArgumentError,
    Status.INVALID_PAGE_SIZE: ArgumentError,
    Status.CHUNK_LENGTH: ArgumentError,
    Status.FOREIGN_LEASE: ArgumentError,
    Status.BAD_HANDLE: HandleError,
    Status.REGION_REVOKED: HandleError,
    Status.CLOSED: ClosedError,
    Status.TOO_MANY_HANDLES: CapacityError,
    Status.TOO_MANY_LAYOUTS: CapacityError,
    Status.OUT_OF_MEMORY: CapacityError,
    Status.QUOTA_EXCEEDED: CapacityError,
    Status.UNANSWERED: ConnectionLostError,
    Status.CONNECT: ConnectionLostError,
    Status.DISCONNECTED: ConnectionLostError,
    Status.INDETERMINATE: IndeterminateError,
    Status.BUSY: BusyError,
    Status.SERVER_BUSY: ServerBusyError,
    Status.TIER_DUPLICATE_KEY: TierArgumentError,
    Status.TIER_LENGTH_MISMATCH: TierArgumentError,
    Status.TIER_UNSUPPORTED_MODE: TierArgumentError,
}


def error_for(status: int) -> Error:
    """The exception for a non-OK ``status``, with this thread's message."""
    message = _native.last_error()
    if status in _BY_STATUS:
        cls = _BY_STATUS[status]
    elif 100 <= status < 200:
        cls = ServerError
    elif 200 <= status < 300:
        cls = TierError
    else:
        cls = InternalError
    return cls(status, message)


def check(status: int) -> None:
    if status != 0:
        raise error_for(status)
