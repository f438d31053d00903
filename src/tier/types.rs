//! The tier's vocabulary: result codes, hold counts, write modes, page
//! views, errors, status and per-key stages.

use std::fmt;
use std::sync::Arc;

use cxlkv_controlplane::proto::Location;
use cxlkv_dataplane::map::MappedRegion;

use crate::client::staged::PlacedPage;

/// Per-key result of a tier operation (the reference's shared L1 error
/// enumeration). Numbers are stable (the C ABI uses them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum TierCode {
    /// The operation applied to this key.
    Success = 0,
    /// Not staged here, not in the directory, or not resolvable.
    KeyNotExist = 1,
    /// The key is mid-write on this tier (or a completed private temporary
    /// nobody holds).
    KeyNotReadable = 2,
    /// Already staged here, or already registered in the directory.
    KeyNotWritable = 3,
    /// Registration failed or its outcome is unknown; a promote of a key
    /// already read-staged; a finish of an idle private temporary.
    KeyInWrongState = 4,
    /// Delete refused: held here, pinned by someone, or the delete's
    /// outcome is unknown (retry later).
    KeyIsLocked = 5,
    /// The allocator could not fit the whole batch.
    OutOfMemory = 6,
}

impl TierCode {
    /// The reference's name (`SUCCESS`, `KEY_NOT_EXIST`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            TierCode::Success => "SUCCESS",
            TierCode::KeyNotExist => "KEY_NOT_EXIST",
            TierCode::KeyNotReadable => "KEY_NOT_READABLE",
            TierCode::KeyNotWritable => "KEY_NOT_WRITABLE",
            TierCode::KeyInWrongState => "KEY_IN_WRONG_STATE",
            TierCode::KeyIsLocked => "KEY_IS_LOCKED",
            TierCode::OutOfMemory => "OUT_OF_MEMORY",
        }
    }
}

impl fmt::Display for TierCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Read holds per key for one call: a total, clamped to
/// `1..=`[`Holds::MAX`]. `N` reserves of `T` holds are balanced by finishes
/// releasing `N·T` in any split; a finish never releases more than is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holds(u32);

impl Holds {
    /// One hold: the default of every read-type call.
    pub const ONE: Holds = Holds(1);
    /// Most holds one call takes or releases per key (the reference's
    /// `MAX_READ_LOCK_COUNT`).
    pub const MAX: u32 = 128;

    /// `total` holds, clamped to `1..=128` (a warning is logged on clamp).
    pub fn total(total: i64) -> Holds {
        let clamped = total.clamp(1, i64::from(Self::MAX));
        if clamped != total {
            tracing::warn!(total, clamped, "read hold count clamped to 1..=128");
        }
        Holds(clamped as u32)
    }

    /// The reference's `extra_count` form: `1 + extra_count`, with
    /// `extra_count` clamped to `0..=127` (MLA models with TP > 1, where
    /// each worker consumes one hold of the same key).
    pub fn from_extra_count(extra_count: i64) -> Holds {
        let clamped = extra_count.clamp(0, i64::from(Self::MAX) - 1);
        if clamped != extra_count {
            tracing::warn!(extra_count, clamped, "extra_count clamped to 0..=127");
        }
        Holds(1 + clamped as u32)
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for Holds {
    fn default() -> Self {
        Holds::ONE
    }
}

/// `reserve_write`'s mode. Only [`WriteMode::New`] is supported: a
/// registered shared page is never updated in place (keys are write-once),
/// and the others are refused with an argument error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WriteMode {
    /// Only keys that exist nowhere (staged here or registered).
    #[default]
    New,
    /// Only existing keys (refused).
    Update,
    /// Both (refused).
    All,
}

/// A chunk's page in the shared pool, zero-copy: a pointer and a length
/// into this process's mapping of the page's region. The mapping stays
/// mapped while any clone of the view lives, so the pointer never dangles;
/// the **bytes** are protected only while the reservation that returned
/// the view lasts — until the matching `finish_*`, or `delete`, `clear`,
/// `close`, or the TTL sweeper reclaiming it. Reading after that may see
/// another chunk's bytes; writing after that corrupts another chunk.
#[derive(Clone)]
pub struct TierPage {
    mapping: Arc<MappedRegion>,
    location: Location,
    page_size_bytes: usize,
}

impl TierPage {
    pub(crate) fn from_placed(p: PlacedPage) -> TierPage {
        debug_assert!(
            p.mapping
                .page(
                    p.page_size_bytes,
                    p.location.page_index(),
                    p.location.len_bytes as usize
                )
                .is_ok(),
            "a placed page lies inside its mapping"
        );
        TierPage {
            mapping: p.mapping,
            location: p.location,
            page_size_bytes: p.page_size_bytes,
        }
    }

    /// The first byte of the chunk.
    pub fn as_ptr(&self) -> *const u8 {
        // In bounds: the page was checked to lie in the mapping when the
        // view was made; `wrapping_add` keeps this free of `unsafe`.
        self.mapping
            .ffi_base_ptr()
            .wrapping_add(self.location.page as usize * self.page_size_bytes)
    }

    /// The first byte, for writing (only through a view returned by
    /// `reserve_write`, before the key's `finish_write`).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.as_ptr().cast_mut()
    }

    /// Bytes of the chunk.
    pub fn len_bytes(&self) -> usize {
        self.location.len_bytes as usize
    }

    /// Bytes of the page (the most a chunk can hold).
    pub fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// Where the chunk lives (region, page, generation, length).
    pub fn location(&self) -> Location {
        self.location
    }

    /// True when both views name the same page of the same mapping (the
    /// reference's "the identical staged object").
    pub fn same_page(&self, other: &TierPage) -> bool {
        self.as_ptr() == other.as_ptr()
    }

    /// The chunk's bytes.
    ///
    /// # Safety
    ///
    /// The reservation that returned this view is still held (see the type
    /// docs), and nobody writes the bytes while the slice lives: for a read
    /// view that is the protocol (a registered page is never written while
    /// pinned); for a write view, no `as_mut_slice` of it is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the pointer and length lie in the live mapping (checked
        // when the view was made; `self.mapping` keeps it mapped); the caller
        // guarantees no write overlaps the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len_bytes()) }
    }

    /// The chunk's bytes, writable.
    ///
    /// # Safety
    ///
    /// This is a view returned by `reserve_write` whose key has not been
    /// finished, dropped or reclaimed yet, and no other slice of the same
    /// page (from a clone of this view) is alive while this one is.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; the page is an unregistered allocation this
        // tier holds exclusively, and the caller guarantees this is the only
        // live slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len_bytes()) }
    }
}

impl fmt::Debug for TierPage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierPage")
            .field("location", &self.location)
            .field("page_size_bytes", &self.page_size_bytes)
            .finish()
    }
}

/// A read-type result for one key: the code, and the page with `Success`.
#[derive(Debug, Clone)]
pub struct KeyPage {
    pub code: TierCode,
    pub page: Option<TierPage>,
}

impl KeyPage {
    pub(crate) fn failed(code: TierCode) -> KeyPage {
        KeyPage { code, page: None }
    }

    pub(crate) fn success(page: TierPage) -> KeyPage {
        KeyPage {
            code: TierCode::Success,
            page: Some(page),
        }
    }

    pub fn is_success(&self) -> bool {
        self.code == TierCode::Success
    }
}

/// `get_l1_memory_desc`'s answer type: it has no value. The shared pool has
/// no single registrable region (regions come and go, peers' regions are
/// mapped on demand); engines that register host memory with a device use
/// the client's map observers (`Client::add_map_observer`) instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L1MemoryDesc {}

/// `get_object_state`'s answer type: it has no value. Membership lives in
/// the directory, so the tier has no local object table to describe
/// (diagnostics: [`super::L1Tier::inspect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectState {}

/// Where a key stands on this tier (diagnostics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyStage {
    /// In neither staging map (it may or may not be in the directory).
    Untracked,
    /// Write-reserved, not finished.
    WriteStaged { temporary: bool },
    /// Read-staged: `holds` local holds backed by `pinned` directory pins
    /// (0 for a private temporary; `holds == 0` is an idle completed
    /// temporary).
    ReadStaged {
        holds: u64,
        pinned: u64,
        temporary: bool,
    },
}

/// `report_status`'s answer (the stock keys plus `backend`).
#[derive(Debug, Clone, PartialEq)]
pub struct TierStatus {
    /// [`super::L1Tier::memcheck`].
    pub is_healthy: bool,
    /// `"cxlkv"`.
    pub backend: &'static str,
    /// Staged reads + staged writes.
    pub total_object_count: u64,
    pub write_locked_count: u64,
    /// Read-staged entries with at least one hold (an idle completed
    /// temporary is not read-locked).
    pub read_locked_count: u64,
    /// Temporary entries in either map.
    pub temporary_count: u64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// used / total, 0 when total is 0.
    pub memory_usage_ratio: f64,
    pub write_ttl_seconds: f64,
    pub read_ttl_seconds: f64,
}

/// What one TTL sweep reclaimed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Expired write reservations whose pages went back to the allocator.
    pub writes: u64,
    /// Expired read stagings (pins released, private pages reclaimed).
    pub reads: u64,
}

/// Counters of what the tier did (monotonic since creation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierStats {
    /// Pinning lookups sent (one per `reserve_read` or retained promote
    /// that needed the directory).
    pub lookups: u64,
    /// `Unpin` round trips made by finishes, sweeps, drains and rollbacks.
    pub unpin_round_trips: u64,
    /// Pins released (as the directory answered).
    pub pins_released: u64,
    /// Pins the directory no longer held (lost with a session).
    pub pins_lost: u64,
    /// `Register` batches sent by `finish_write` and retained promotes.
    pub registers: u64,
    /// Registrations whose outcome is unknown (left to the client, which
    /// keeps the pages until it knows).
    pub registers_unresolved: u64,
    /// `Exists` batches sent by `reserve_write`.
    pub exists: u64,
    /// `Delete` batches sent.
    pub deletes: u64,
    /// Private temporary pages reclaimed.
    pub temporaries_reclaimed: u64,
    /// Entries reclaimed by the sweeper.
    pub swept: u64,
}

/// A broken invariant (I1–I7 of the reference, and the mirrors the tier
/// keeps): which, for which key, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant {invariant} broken for key {key:?}: {detail}")]
pub struct InvariantViolation {
    pub invariant: &'static str,
    pub key: Vec<u8>,
    pub detail: String,
}

/// Why a tier call was refused as a whole (nothing changed). Per-key
/// outcomes are [`TierCode`]s, never errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("{op}: key {index} repeats key {first_index} of the same call")]
    DuplicateKey {
        op: &'static str,
        index: usize,
        first_index: usize,
    },
    #[error("{op}: {keys} keys but {flags} is_temporary flags")]
    LengthMismatch {
        op: &'static str,
        keys: usize,
        flags: usize,
    },
    #[error("{op}: key {index} is {len_bytes} bytes; keys are 1..={max_bytes} bytes")]
    KeyLength {
        op: &'static str,
        index: usize,
        len_bytes: usize,
        max_bytes: usize,
    },
    #[error("{op}: batch of {len} keys exceeds the limit of {max}")]
    BatchTooLarge {
        op: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "reserve_write: mode {mode:?} is not supported, only New (a registered page is never updated in place)"
    )]
    UnsupportedMode { mode: WriteMode },
    #[error("reserve_write: chunks of {len_bytes} bytes; pages hold 1..={page_size_bytes}")]
    ChunkLength {
        len_bytes: usize,
        page_size_bytes: usize,
    },
    #[error("invalid tier configuration: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error(
        "{op} was called from a listener of the same tier: listeners run under the tier's lock and must not call back into it"
    )]
    Reentrant { op: &'static str },
    #[error("{op}: the tier is closed")]
    Closed { op: &'static str },
    /// The tier's client was closed: its session, and with it every pin
    /// and registration path, is gone, so no operation can be answered per
    /// key. Only the tier's `close` is left to do.
    #[error("{op}: the tier's client is closed")]
    ClientClosed { op: &'static str },
    /// The tier's client can never be used again: its instance could not
    /// be resumed after a reconnect (the directory refused it for good), so,
    /// as after a close, no operation can be answered per key.
    #[error("{op}: the tier's client cannot be resumed: {reason}")]
    ClientFailed { op: &'static str, reason: String },
    #[error("cannot start the sweeper thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error(transparent)]
    Invariant(#[from] InvariantViolation),
}

impl TierError {
    /// True for the argument errors of the spec (bad input; the call
    /// changed nothing).
    pub fn is_argument_error(&self) -> bool {
        matches!(
            self,
            TierError::DuplicateKey { .. }
                | TierError::LengthMismatch { .. }
                | TierError::KeyLength { .. }
                | TierError::BatchTooLarge { .. }
                | TierError::UnsupportedMode { .. }
                | TierError::ChunkLength { .. }
                | TierError::Config { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_totals_clamped_to_one_through_128() {
        assert_eq!(Holds::total(0).get(), 1);
        assert_eq!(Holds::total(-5).get(), 1);
        assert_eq!(Holds::total(3).get(), 3);
        assert_eq!(Holds::total(1000).get(), 128);
    }

    #[test]
    fn extra_count_maps_to_one_plus_clamped_extra() {
        assert_eq!(Holds::from_extra_count(-3).get(), 1);
        assert_eq!(Holds::from_extra_count(0).get(), 1);
        assert_eq!(Holds::from_extra_count(2).get(), 3);
        assert_eq!(Holds::from_extra_count(127).get(), 128);
        assert_eq!(Holds::from_extra_count(1000).get(), 128);
    }

    #[test]
    fn codes_have_stable_numbers_and_reference_names() {
        let all = [
            (TierCode::Success, 0, "SUCCESS"),
            (TierCode::KeyNotExist, 1, "KEY_NOT_EXIST"),
            (TierCode::KeyNotReadable, 2, "KEY_NOT_READABLE"),
            (TierCode::KeyNotWritable, 3, "KEY_NOT_WRITABLE"),
            (TierCode::KeyInWrongState, 4, "KEY_IN_WRONG_STATE"),
            (TierCode::KeyIsLocked, 5, "KEY_IS_LOCKED"),
            (TierCode::OutOfMemory, 6, "OUT_OF_MEMORY"),
        ];
        for (code, n, name) in all {
            assert_eq!(code as u32, n);
            assert_eq!(code.as_str(), name);
        }
    }
}
