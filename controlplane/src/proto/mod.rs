//! Protocol v1: the messages of the control plane, how they are encoded into
//! frames, and how received frames are validated.
//!
//! # Shape
//!
//! Each message is a Rust struct archived with rkyv 0.8 ([`Message`]); its
//! [`Kind`] goes in the frame header ([`crate::frame`]), its archive is the
//! payload. Two conversations use it: client ↔ directory ([`directory`]
//! module: `Hello`, `Register`, `Lookup`, …) and directory ↔ pool manager
//! ([`pool`] module: `PoolHello`, `AllocRegion`, …). Every request kind has
//! one reply kind (`request | 0x8000`), or [`ErrorReply`] when it failed as a
//! whole. Key operations are batch-native: a single-key call is a batch of
//! one, and per-key answers are per-key outcomes at the key's index.
//!
//! # Validation at the edge
//!
//! A received payload is read only through [`access`] (or
//! [`decode_request`] / [`decode_reply`] / [`access_reply`], which call it):
//! rkyv's checked access first, then this protocol's limits and field rules
//! ([`validate`]). After that the receiver works on the archived form in the
//! receive buffer: keys are `&[u8]` slices (`ArchivedLookup::keys`, …),
//! small values convert to plain Rust values by `From`. Nothing here uses
//! unchecked access. Every failure is a typed [`ProtoError`] that maps to a
//! stable [`ErrorCode`] and the limit involved ([`ProtoError::to_reply`]).
//!
//! # Invariants
//!
//! - Every archived type has alignment ≤ [`FRAME_ALIGN`] (const-asserted
//!   below), so an 8-aligned payload — which [`crate::frame::FrameDecoder`]
//!   guarantees — is enough for checked access to succeed on valid data.
//! - The largest legal message of every kind fits in one frame
//!   ([`MAX_PAYLOAD_BYTES`]); the tests encode each maximum.
//! - Kind and error numbers, and the order of every archived enum's
//!   variants, are stable: changing them is a new protocol version.
//!
//! # Exactly-once effects
//!
//! Mutating requests (`Register`, `Lookup` with `pins > 0`, `Unpin`,
//! `Delete`, `RequestRegion`, `ReturnRegion`, `EndSession`; towards the pool
//! manager `AllocRegion`, `FreeRegion`) carry a non-zero `seq` from a
//! per-instance counter (per directory for the pool manager) that never
//! repeats; read-only ones carry `seq` 0. The directory keeps a window of
//! [`Limits::reply_cache_len`] sequence numbers per instance: a `seq` it
//! executed is not executed again — its cached reply is sent (with the new
//! request id) — and one below the window gets
//! [`ErrorCode::SequenceTooOld`]. Only successful replies are cached; errors
//! do not consume the `seq`. `RequestMeta::replies_received_below` lets a
//! client release cached replies early. A client whose reply was lost
//! resends the same request with the same `seq` — after a reconnect, on the
//! reattached instance — and never guesses from a lookup.
//!
//! # Freed-page notices
//!
//! When a key is deleted, the directory queues a [`FreedPage`] notice for
//! the owner of its page, numbered per instance 1, 2, 3, …. Every directory
//! reply to that instance carries the unacknowledged notices (oldest first,
//! at most [`MAX_NOTICES_PER_REPLY`]); the owner applies them in order,
//! frees a page only if its current generation is the notice's, and reports
//! the highest notice applied in `notice_ack` of its next request. Notices
//! at or below the acknowledged number are dropped by the directory and
//! skipped by the owner, so a resent notice is harmless and a page is never
//! freed twice.
//!
//! The full specification, with byte layouts and every field, is
//! `docs/protocol.md`.

mod codec;
mod common;
pub mod directory;
mod error;
mod key_list;
mod keys_from;
mod kind;
pub mod pool;
pub mod stats;
pub mod validate;

#[cfg(any(test, feature = "samples"))]
pub mod samples;

#[cfg(test)]
mod tests;

pub use codec::{
    AnyReply, AnyRequest, Archived, ArchivedDirectoryReply, ArchivedRequest, Deserializer, Encoder,
    EncodesAs, Message, access, access_reply, decode_reply, decode_request, deserialize, encode,
    encode_as, negotiate,
};
pub use common::*;
pub use directory::*;
pub use error::{ArchivedErrorReply, ErrorCode, ErrorReply, ProtoError};
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub use key_list::reference as key_list_reference;
pub use key_list::{ArchivedKeyList, KeyList};
pub use keys_from::{DeleteFrom, ExistsFrom, LookupFrom, UnpinFrom};
pub use kind::{Kind, Service};
pub use pool::*;
pub use stats::*;

use crate::frame::{FRAME_ALIGN, MAX_FRAME_BYTES, MAX_PAYLOAD_BYTES, PROTOCOL_VERSION};

/// Oldest protocol version this build speaks.
pub const PROTOCOL_MIN: u16 = 1;
/// Newest protocol version this build speaks (the frame header's version).
pub const PROTOCOL_MAX: u16 = PROTOCOL_VERSION;

/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 512;
/// Most keys (entries, regions) in one request or per-key reply.
pub const MAX_BATCH: usize = 4096;
/// Most pins one `Lookup` takes per key, and most one `Unpin` releases.
pub const MAX_PINS_PER_KEY: usize = 1024;
/// Longest instance id, client name or directory id, in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Longest client (or directory) pre-shared secret, in bytes.
pub const MAX_SECRET_BYTES: usize = 256;
/// Longest pool path, in bytes (Linux `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest `ErrorReply` message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Most pools one pool manager serves.
pub const MAX_POOLS: usize = 64;
/// Most freed-page notices carried by one reply.
pub const MAX_NOTICES_PER_REPLY: usize = 1024;
/// Most regions in one `Reattach` or `ReattachRegions` (e.g. 32 GiB of
/// 2 MiB regions).
pub const MAX_REATTACH_REGIONS: usize = 16384;
/// Most handles in one `RegionList` page.
pub const MAX_LIST_REGIONS: usize = 4096;
/// Most directories listed per pool in `PoolStatsReply` (a pool manager
/// serves a handful of directories).
pub const MAX_POOL_OWNERS: usize = 64;
/// Most rows in each optional stats table.
pub const MAX_STATS_ROWS: usize = 2048;
/// Page sizes are multiples of this.
pub const PAGE_QUANTUM_BYTES: u64 = 4096;
/// Largest page size (chunk lengths are `u32`).
pub const MAX_PAGE_BYTES: u64 = 1 << 30;

const _: () = assert!(
    MAX_PAGE_BYTES <= u32::MAX as u64,
    "Location::len_bytes is a u32"
);
const _: () = assert!(
    MAX_FRAME_BYTES <= u32::MAX as usize,
    "Limits::max_frame_bytes is a u32"
);
const _: () = assert!(
    MAX_PAYLOAD_BYTES < i32::MAX as usize,
    "rkyv pointer_width_32 offsets"
);

impl Limits {
    /// This build's protocol limits, with the server-chosen in-flight bound
    /// and reply-cache length.
    pub const fn protocol(max_inflight: u32, reply_cache_len: u32) -> Self {
        Self {
            max_frame_bytes: MAX_FRAME_BYTES as u32,
            max_key_bytes: MAX_KEY_BYTES as u32,
            max_batch: MAX_BATCH as u32,
            max_inflight,
            max_pins_per_key: MAX_PINS_PER_KEY as u32,
            reply_cache_len,
        }
    }
}

/// Asserts at compile time that each archived type needs no more alignment
/// than a frame payload has.
macro_rules! assert_archived_align {
    ($($ty:ty),* $(,)?) => {
        $(const _: () = assert!(
            std::mem::align_of::<Archived<$ty>>() <= FRAME_ALIGN,
            concat!("archived ", stringify!($ty), " is over-aligned for a frame payload"),
        );)*
    };
}

assert_archived_align!(
    Location,
    Layout,
    RegionDesc,
    RegionToken,
    InstanceSecret,
    RequestMeta,
    FreedPage,
    Usage,
    ReplyMeta,
    Limits,
    BackingKind,
    VisibilityMode,
    PoolInfo,
    OwnerLabel,
    RegionHandle,
    RefusedRegion,
    KeyBitmap,
    Hello,
    Welcome,
    OwnedRegion,
    Reattach,
    Reattached,
    Heartbeat,
    HeartbeatReply,
    RequestRegion,
    RegionGranted,
    ReturnRegion,
    RegionReturned,
    MapRegion,
    RegionMap,
    RegisterEntry,
    Register,
    RejectReason,
    RegisterOutcome,
    RegisterReply,
    Lookup,
    LookupReply,
    Exists,
    ExistsReply,
    Unpin,
    UnpinOutcome,
    UnpinReply,
    Delete,
    DeleteOutcome,
    DeleteReply,
    EndSession,
    SessionEnded,
    Stats,
    LatencySummary,
    OpStats,
    DirectoryTotals,
    OutcomeTotals,
    PoolRow,
    InstanceRow,
    Transport,
    SessionRow,
    RegionRow,
    LongPinRow,
    StatsReply,
    ErrorReply,
    PoolHello,
    PoolWelcome,
    AllocRegion,
    RegionAllocated,
    FreeRegion,
    RegionFreed,
    ReattachRegions,
    RegionsReattached,
    ListRegions,
    RegionList,
    PoolStats,
    OwnerUsage,
    PoolUsage,
    PoolStatsReply,
);

// Hot wire structs: their archived size is part of the per-key cost.
const _: () = assert!(std::mem::size_of::<Archived<Location>>() == 24);
const _: () = assert!(std::mem::size_of::<Archived<RequestMeta>>() == 24);
const _: () = assert!(std::mem::size_of::<Archived<FreedPage>>() == 24);
const _: () = assert!(std::mem::size_of::<Archived<RegionDesc>>() == 40);
const _: () = assert!(
    std::mem::size_of::<Archived<Vec<u8>>>() == 8,
    "pointer_width_32"
);
