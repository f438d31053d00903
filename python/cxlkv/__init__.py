"""cxlkv: share KV-cache chunks between inference processes through a pool
of shared (CXL) memory — a thin layer over the C ABI (``libcxlkv.so``,
through ctypes; no compiled extension of its own).

::

    import cxlkv

    with cxlkv.Client.connect("/tmp/cxlkv.sock") as client:
        layout = client.layout(page_size_bytes=64 << 10, fingerprint=0x1234)
        layout.put(b"key", b"bytes")
        with layout.get(b"key") as view:   # in place, pinned
            data = view.memoryview()       # zero copy, read-only
            ...
            del data                       # before the view is released

The L1 tier (LMCache's staged protocol) is :class:`L1Tier`. See
``docs/python.md``.
"""

from . import _native
from .client import (
    MAX_BATCH,
    Client,
    DeleteResult,
    Layout,
    Lease,
    Location,
    RegisterResult,
    View,
    ViewBatch,
)
from .errors import (
    ArgumentError,
    BusyError,
    CapacityError,
    ClosedError,
    ConnectionLostError,
    Error,
    HandleError,
    IndeterminateError,
    InternalError,
    ServerBusyError,
    ServerError,
    Status,
    TierArgumentError,
    TierError,
    ViewReleasedError,
)
from .keys import ObjectKey, object_key
from .tier import L1Tier, TierCode, TierPage

__version__ = _native.lib.cxlkv_version().decode()

__all__ = [
    "MAX_BATCH",
    "ArgumentError",
    "BusyError",
    "CapacityError",
    "Client",
    "ClosedError",
    "ConnectionLostError",
    "DeleteResult",
    "Error",
    "HandleError",
    "IndeterminateError",
    "InternalError",
    "L1Tier",
    "Layout",
    "Lease",
    "Location",
    "ObjectKey",
    "RegisterResult",
    "ServerBusyError",
    "ServerError",
    "Status",
    "TierArgumentError",
    "TierCode",
    "TierError",
    "TierPage",
    "View",
    "ViewBatch",
    "ViewReleasedError",
    "object_key",
]
