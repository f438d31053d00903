"""The C ABI as ctypes sees it: finding and loading libcxlkv, the structs
of ``cxlkv.h`` and the signature of every function.

Nothing here is public. The struct layouts and constants mirror the header
by hand; ``tests/test_abi.py`` compiles a C program against the header and
checks every size, offset and number against these declarations.

Where the library is looked for, in order:

1. ``$CXLKV_LIB`` (a path to ``libcxlkv.so``);
2. next to this file (``pip install`` copies it there);
3. the Cargo target directory of the source tree this file lives in
   (``target/release``, then ``target/debug``), for running from a checkout;
4. the system's library path (``ctypes.util.find_library("cxlkv")``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

#: The ABI major this package speaks (``CXLKV_ABI_VERSION_MAJOR``).
ABI_MAJOR = 0
#: The oldest ABI minor with everything this package declares
#: (``CXLKV_ABI_VERSION_MINOR``; 4: ``CXLKV_TIER_HOLD_MAPPINGS`` and
#: ``cxlkv_tier_release_page``).
ABI_MINOR = 4

_HERE = Path(__file__).resolve().parent


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("CXLKV_LIB")
    if env:
        out.append(Path(env))
    out.append(_HERE / "libcxlkv.so")
    repo = _HERE.parent.parent
    if (repo / "ffi" / "Cargo.toml").is_file():
        target = Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
        out += [target / "release" / "libcxlkv.so", target / "debug" / "libcxlkv.so"]
    return out


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if path.is_file():
            return ctypes.CDLL(str(path))
        tried.append(str(path))
    system = ctypes.util.find_library("cxlkv")
    if system:
        return ctypes.CDLL(system)
    tried.append("the system library path")
    raise ImportError(
        "cxlkv: libcxlkv.so not found (looked at: "
        + ", ".join(tried)
        + "); set CXLKV_LIB to its path, or build it with `cargo build --release -p cxlkv-ffi`"
    )


def _check_abi(lib: ctypes.CDLL) -> None:
    """Refuses a library of another ABI major, or of an older minor than
    the package needs, before any other symbol is looked up (a library of
    another ABI may lack them, which would hide the reason)."""
    try:
        version_fn = lib.cxlkv_abi_version
    except AttributeError:
        raise ImportError(f"cxlkv: {lib._name} has no cxlkv_abi_version: not a libcxlkv") from None
    version_fn.restype = c_uint32
    version_fn.argtypes = []
    version = version_fn()
    major, minor = version >> 16, version & 0xFFFF
    if major != ABI_MAJOR or minor < ABI_MINOR:
        raise ImportError(
            f"cxlkv: the loaded libcxlkv ({lib._name}) speaks ABI {major}.{minor}, "
            f"this package needs ABI {ABI_MAJOR}.x with x at least {ABI_MINOR}"
        )


lib = _load()
_check_abi(lib)

# --- structs (cxlkv.h) ------------------------------------------------------


class MapInfo(Structure):
    _fields_ = [
        ("region_id", c_uint64),
        ("offset_bytes", c_uint64),
        ("base", c_void_p),
        ("len_bytes", c_uint64),
        ("read_only", c_bool),
    ]


MAP_FN = CFUNCTYPE(None, c_void_p, POINTER(MapInfo))


class MapCallbacks(Structure):
    _fields_ = [("on_map", MAP_FN), ("before_unmap", MAP_FN), ("user_data", c_void_p)]


class PoolPath(Structure):
    _fields_ = [("uuid", c_uint8 * 16), ("path", c_char_p)]


class Config(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("flags", c_uint32),
        ("socket_path", c_char_p),
        ("tcp_addr", c_char_p),
        ("client_secret", c_void_p),
        ("client_secret_len", c_size_t),
        ("instance_id", c_char_p),
        ("client_name", c_char_p),
        ("pool_paths", POINTER(PoolPath)),
        ("pool_paths_len", c_size_t),
        ("visibility", c_uint32),
        ("unpin_delay_us", c_uint32),
        ("max_retries", c_uint32),
        ("max_peer_mappings", c_uint32),
        ("initial_reservation_bytes", c_uint64),
        ("region_size_bytes", c_uint64),
        ("quota_bytes", c_uint64),
        ("idle_region_return_ms", c_uint64),
        ("request_timeout_ms", c_uint64),
        ("reconnect_timeout_ms", c_uint64),
        ("reconnect_backoff_min_ms", c_uint64),
        ("reconnect_backoff_max_ms", c_uint64),
        ("map_callbacks", MapCallbacks),
    ]


class LayoutOptions(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("flags", c_uint32),
        ("initial_reservation_bytes", c_uint64),
        ("region_size_bytes", c_uint64),
    ]


def _counters(*names: str) -> list:
    return [("size", c_uint32), ("reserved", c_uint32)] + [(n, c_uint64) for n in names]


CLIENT_STATS_FIELDS = (
    "requests",
    "retries",
    "reconnects",
    "directory_restarts",
    "keys_reregistered",
    "keys_lost_with_regions",
    "regions_refused",
    "regions_acquired",
    "regions_returned",
    "peer_regions_mapped",
    "peer_regions_evicted",
    "pages_freed_by_notice",
    "stale_notices",
    "notices_unknown_region",
    "notice_gaps",
    "duplicates",
    "rejections",
    "unpin_batches",
    "unpins_not_held",
    "unpins_dropped",
    "views_invalidated",
    "registers_unresolved",
    "heartbeats",
)
USAGE_FIELDS = (
    "instance_used_bytes",
    "instance_owned_bytes",
    "instance_quota_bytes",
    "pool_free_bytes",
)
SESSION_FIELDS = (
    "session_id",
    "directory_epoch",
    "owned_keys",
    "unresolved_registrations",
    "max_batch",
    "max_key_bytes",
)
DIRECTORY_FIELDS = (
    "uptime_ms",
    "directory_epoch",
    "keys",
    "used_bytes",
    "value_bytes",
    "key_bytes",
    "owned_bytes",
    "regions",
    "deferred_regions",
    "pending_region_requests",
    "pins",
    "pinned_keys",
    "instances_live",
    "instances_absent",
    "sessions",
    "notices_pending",
    "layouts",
    "long_held_pins",
    "evictions_orphan",
    "evictions_lru",
    "evictions_lru_skipped",
    "sessions_expired",
    "sessions_closed",
    "sessions_ended",
    "instances_gone",
    "regions_granted",
    "regions_returned",
    "regions_freed",
    "regions_deferred",
    "notices_issued",
    "inserted",
    "duplicate",
    "rejected",
    "stale_generation",
    "lookup_hits",
    "lookup_misses",
    "exists_hits",
    "exists_misses",
    "pinned_entries",
    "max_pinned_entries",
    "pin_ledger_bytes",
)
LAYOUT_INFO_FIELDS = (
    "page_size_bytes",
    "fingerprint",
    "region_bytes",
    "free_pages",
    "refused_frees",
)


class ClientStats(Structure):
    _fields_ = _counters(*CLIENT_STATS_FIELDS)


class Usage(Structure):
    _fields_ = _counters(*USAGE_FIELDS)


class SessionInfo(Structure):
    _fields_ = _counters(*SESSION_FIELDS[:4]) + [
        ("max_batch", c_uint32),
        ("max_key_bytes", c_uint32),
    ]


class DirectoryStats(Structure):
    _fields_ = _counters(*DIRECTORY_FIELDS)


class LayoutInfo(Structure):
    _fields_ = _counters(*LAYOUT_INFO_FIELDS)


class Location(Structure):
    _fields_ = [
        ("region_id", c_uint64),
        ("page", c_uint32),
        ("generation", c_uint32),
        ("len_bytes", c_uint32),
        ("reserved", c_uint32),
    ]


class RegisterResult(Structure):
    _fields_ = [("outcome", c_uint32), ("reject_reason", c_uint32), ("winner", Location)]


class Bytes(Structure):
    _fields_ = [("data", c_void_p), ("len", c_size_t)]


class View(Structure):
    _fields_ = [
        ("guard", c_void_p),
        ("data", c_void_p),
        ("len_bytes", c_uint64),
        ("location", Location),
    ]


class DeleteResult(Structure):
    _fields_ = [("outcome", c_uint32), ("pins", c_uint32)]


class TierPage(Structure):
    _fields_ = [
        ("code", c_uint32),
        ("reserved", c_uint32),
        ("data", c_void_p),
        ("len_bytes", c_uint64),
        ("page_size_bytes", c_uint64),
        ("location", Location),
    ]


TIER_KEYS_FN = CFUNCTYPE(None, c_void_p, POINTER(Bytes), c_size_t)
TIER_EVENT_FN = CFUNCTYPE(None, c_void_p, c_uint32, POINTER(Bytes), c_size_t)

LISTENER_CALLBACKS = (
    "reserved_read",
    "read_finished",
    "reserved_write",
    "write_finished",
    "finish_write_and_reserve_read",
    "deleted",
    "accessed",
)


class TierConfig(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("flags", c_uint32),
        ("write_ttl_ms", c_uint64),
        ("read_ttl_ms", c_uint64),
        ("on_event", TIER_EVENT_FN),
        ("event_user_data", c_void_p),
    ]


class TierListener(Structure):
    _fields_ = (
        [("size", c_uint32), ("reserved", c_uint32)]
        + [(name, TIER_KEYS_FN) for name in LISTENER_CALLBACKS]
        + [("user_data", c_void_p)]
    )


TIER_STATUS_COUNTS = (
    "total_object_count",
    "write_locked_count",
    "read_locked_count",
    "temporary_count",
    "memory_used_bytes",
    "memory_total_bytes",
)
TIER_STATUS_RATIOS = ("memory_usage_ratio", "write_ttl_seconds", "read_ttl_seconds")


class TierStatus(Structure):
    _fields_ = (
        [("size", c_uint32), ("is_healthy", c_uint32), ("backend", c_char_p)]
        + [(n, c_uint64) for n in TIER_STATUS_COUNTS]
        + [(n, ctypes.c_double) for n in TIER_STATUS_RATIOS]
    )


class TierKeyStage(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("stage", c_uint32),
        ("temporary", c_uint32),
        ("reserved", c_uint32),
        ("holds", c_uint64),
        ("pinned", c_uint64),
    ]


TIER_STATS_FIELDS = (
    "lookups",
    "unpin_round_trips",
    "pins_released",
    "pins_lost",
    "registers",
    "registers_unresolved",
    "exists",
    "deletes",
    "temporaries_reclaimed",
    "swept",
)


class TierStats(Structure):
    _fields_ = _counters(*TIER_STATS_FIELDS)


# --- constants (cxlkv.h) ----------------------------------------------------

CONFIG_EAGER_MAP = 1 << 0
CONFIG_NO_AUTO_EXPAND = 1 << 1

VISIBILITY_SERVER = 0
VISIBILITY_COHERENT = 1
VISIBILITY_FLUSH = 2

REGISTER_NONE = 0
REGISTER_INSERTED = 1
REGISTER_DUPLICATE = 2
REGISTER_REJECTED = 3

DELETE_NONE = 0
DELETE_DELETED = 1
DELETE_PINNED = 2
DELETE_MISSING = 3

TIER_MAX_HOLDS = 128
TIER_HOLD_MAPPINGS = 1 << 0
#: Most entries one batch call of the library carries (``proto::MAX_BATCH``;
#: every ``cxlkv_batch_*`` and ``cxlkv_tier_*`` call given more returns
#: ``CXLKV_STATUS_BATCH_TOO_LARGE``). Not in the header: ``test_abi.py``
#: checks it against the library. The directory's own limit may be lower
#: (``Client.session()["max_batch"]``); the library enforces that one.
MAX_BATCH = 4096
TIER_WRITE_MODES = {"new": 0, "update": 1, "all": 2}
TIER_EVENTS = {
    1: "L1_READ_RESERVED",
    2: "L1_READ_FINISHED",
    3: "L1_WRITE_RESERVED",
    4: "L1_WRITE_FINISHED",
    5: "L1_WRITE_FINISHED_AND_READ_RESERVED",
    6: "L1_KEYS_EVICTED",
}
TIER_STAGES = {0: "untracked", 1: "write_staged", 2: "read_staged"}

# --- functions ----------------------------------------------------------------

status_t = c_int32
P = POINTER


def _fn(name: str, restype, *argtypes) -> None:
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)


_fn("cxlkv_abi_version", c_uint32)
_fn("cxlkv_version", c_char_p)
_fn("cxlkv_last_error", c_char_p)
_fn("cxlkv_status_name", c_char_p, c_int32)
_fn("cxlkv_config_init", status_t, P(Config), c_uint32)
_fn("cxlkv_layout_options_init", status_t, P(LayoutOptions), c_uint32)
_fn("cxlkv_connect", status_t, P(Config), P(c_void_p))
_fn("cxlkv_close", status_t, c_void_p)
_fn("cxlkv_query_stats", status_t, c_void_p, P(ClientStats))
_fn("cxlkv_query_usage", status_t, c_void_p, P(Usage))
_fn("cxlkv_query_session", status_t, c_void_p, P(SessionInfo))
_fn("cxlkv_instance_id", status_t, c_void_p, P(c_char), c_size_t, P(c_size_t))
_fn("cxlkv_flush_unpins", status_t, c_void_p)
_fn("cxlkv_map_all_regions", status_t, c_void_p, P(c_size_t))
_fn("cxlkv_query_directory", status_t, c_void_p, P(DirectoryStats))
_fn("cxlkv_add_map_observer", status_t, c_void_p, P(MapCallbacks), P(c_void_p))
_fn("cxlkv_remove_map_observer", status_t, c_void_p)
_fn("cxlkv_layout_open", status_t, c_void_p, c_uint64, c_uint64, P(LayoutOptions), P(c_void_p))
_fn("cxlkv_layout_close", status_t, c_void_p)
_fn("cxlkv_query_layout", status_t, c_void_p, P(LayoutInfo))
_fn("cxlkv_alloc", status_t, c_void_p, P(c_void_p))
_fn("cxlkv_batch_alloc", status_t, c_void_p, c_size_t, P(c_void_p))
_fn("cxlkv_lease_data", status_t, c_void_p, P(c_void_p), P(c_uint64))
_fn("cxlkv_lease_set_len", status_t, c_void_p, c_uint64)
_fn("cxlkv_lease_write", status_t, c_void_p, c_void_p, c_size_t)
_fn("cxlkv_lease_abort", status_t, c_void_p)
_fn("cxlkv_register", status_t, c_void_p, c_void_p, c_size_t, c_void_p, P(RegisterResult))
_fn("cxlkv_batch_register", status_t, c_void_p, P(Bytes), P(c_void_p), c_size_t, P(RegisterResult))
_fn("cxlkv_put", status_t, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, P(RegisterResult))
_fn("cxlkv_batch_put", status_t, c_void_p, P(Bytes), P(Bytes), c_size_t, P(RegisterResult))
_fn("cxlkv_get", status_t, c_void_p, c_void_p, c_size_t, P(View))
_fn("cxlkv_batch_get", status_t, c_void_p, P(Bytes), c_size_t, P(View))
_fn("cxlkv_release", status_t, P(View))
_fn("cxlkv_batch_release", status_t, P(View), c_size_t)
_fn("cxlkv_exists", status_t, c_void_p, c_void_p, c_size_t, P(c_bool))
_fn("cxlkv_batch_exists", status_t, c_void_p, P(Bytes), c_size_t, P(c_bool))
_fn("cxlkv_delete", status_t, c_void_p, c_void_p, c_size_t, P(DeleteResult))
_fn("cxlkv_batch_delete", status_t, c_void_p, P(Bytes), c_size_t, P(DeleteResult))

_fn("cxlkv_tier_config_init", status_t, P(TierConfig), c_uint32)
_fn("cxlkv_tier_open", status_t, c_void_p, P(TierConfig), P(c_void_p))
_fn("cxlkv_tier_close", status_t, c_void_p)
_fn("cxlkv_tier_release_page", status_t, c_void_p)
_fn("cxlkv_tier_register_listener", status_t, c_void_p, P(TierListener))
_fn("cxlkv_tier_reserve_read", status_t, c_void_p, P(Bytes), c_size_t, c_uint32, P(TierPage))
_fn("cxlkv_tier_unsafe_read", status_t, c_void_p, P(Bytes), c_size_t, P(TierPage))
_fn("cxlkv_tier_finish_read", status_t, c_void_p, P(Bytes), c_size_t, c_uint32, P(c_uint32))
_fn(
    "cxlkv_tier_reserve_write",
    status_t,
    c_void_p,
    P(Bytes),
    P(c_uint8),
    c_size_t,
    c_uint64,
    c_uint32,
    P(TierPage),
)
_fn("cxlkv_tier_finish_write", status_t, c_void_p, P(Bytes), c_size_t, P(c_uint32))
_fn(
    "cxlkv_tier_finish_write_and_reserve_read",
    status_t,
    c_void_p,
    P(Bytes),
    c_size_t,
    c_uint32,
    P(TierPage),
)
_fn("cxlkv_tier_delete", status_t, c_void_p, P(Bytes), c_size_t, c_bool, P(c_uint32))
_fn("cxlkv_tier_touch_keys", status_t, c_void_p, P(Bytes), c_size_t)
_fn("cxlkv_tier_clear", status_t, c_void_p, c_bool)
_fn("cxlkv_tier_is_key_evictable", status_t, c_void_p, c_void_p, c_size_t, P(c_bool))
_fn("cxlkv_tier_get_memory_usage", status_t, c_void_p, P(c_uint64), P(c_uint64))
_fn("cxlkv_tier_get_l1_memory_desc", status_t, c_void_p, P(c_bool))
_fn("cxlkv_tier_get_object_state", status_t, c_void_p, c_void_p, c_size_t, P(c_bool))
_fn("cxlkv_tier_memcheck", status_t, c_void_p, P(c_bool))
_fn("cxlkv_tier_report_status", status_t, c_void_p, P(TierStatus))
_fn("cxlkv_tier_inspect", status_t, c_void_p, c_void_p, c_size_t, P(TierKeyStage))
_fn("cxlkv_tier_query_stats", status_t, c_void_p, P(TierStats))
_fn("cxlkv_tier_sweep_now", status_t, c_void_p, P(c_uint64), P(c_uint64))
_fn("cxlkv_tier_check_invariants", status_t, c_void_p)

def last_error() -> str:
    raw = lib.cxlkv_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def status_name(status: int) -> str:
    return lib.cxlkv_status_name(status).decode()


def sized(struct_type):
    """A versioned out-struct with its ``size`` set."""
    s = struct_type()
    s.size = ctypes.sizeof(struct_type)
    return s
