//! Listener callbacks and observability events.
//!
//! Listeners are the engine's controllers: its eviction policy (LRU order;
//! a key leaves the policy only through [`Listener::deleted`]) and its
//! store controller ([`Listener::write_finished`] is the write-through
//! trigger that copies a key to L2). That is why a promote never emits
//! `write_finished`, a temporary completion never does, and a refused
//! delete never emits `deleted`.
//!
//! Listeners run synchronously, in registration order, on the calling
//! thread and — except for `accessed` (`touch_keys`) — under the tier's
//! lock. They must not call back into the same tier: such a call is
//! detected and answered with [`TierError::Reentrant`](super::TierError),
//! never a deadlock. A listener may call *another* tier, provided no
//! listener of that tier calls back into this one from another thread (two
//! tiers' locks taken in opposite orders by two threads would deadlock, as
//! any two locks would). Key lists are in the call's input order. The TTL
//! sweeper and `close` never notify.
//!
//! Events ([`EventSink`]) are for observability only; they carry the same
//! key lists.

use std::fmt;

/// The engine's view of the tier's key lifecycle (seven callbacks, each
/// given the keys concerned, possibly none). Every method has an empty
/// default so an implementation names only what it uses.
pub trait Listener: Send + Sync {
    /// `reserve_read` staged these keys (hits only).
    fn reserved_read(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// `finish_read` released holds on these keys.
    fn read_finished(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// `reserve_write` staged these keys for writing.
    fn reserved_write(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// `finish_write` registered these keys in the directory (never a
    /// temporary key): the write-through trigger.
    fn write_finished(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// A promote (L2 → L1) completed these keys and holds them for reading.
    fn finish_write_and_reserve_read(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// These keys were removed (from the directory, or a private temporary
    /// page was reclaimed): they leave the eviction policy.
    fn deleted(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
    /// `touch_keys` (recency only; no state change).
    fn accessed(&self, keys: &[&[u8]]) {
        let _ = keys;
    }
}

/// An observability event (the reference's `L1_*` event-bus names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierEvent {
    ReadReserved,
    ReadFinished,
    WriteReserved,
    WriteFinished,
    WriteFinishedAndReadReserved,
    KeysEvicted,
}

impl TierEvent {
    /// The reference's event name (`L1_READ_RESERVED`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            TierEvent::ReadReserved => "L1_READ_RESERVED",
            TierEvent::ReadFinished => "L1_READ_FINISHED",
            TierEvent::WriteReserved => "L1_WRITE_RESERVED",
            TierEvent::WriteFinished => "L1_WRITE_FINISHED",
            TierEvent::WriteFinishedAndReadReserved => "L1_WRITE_FINISHED_AND_READ_RESERVED",
            TierEvent::KeysEvicted => "L1_KEYS_EVICTED",
        }
    }
}

impl fmt::Display for TierEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Receives the tier's events (publish-only; called like listeners, under
/// the tier's lock, and bound by the same no-re-entry rule).
pub trait EventSink: Send + Sync {
    fn publish(&self, event: TierEvent, keys: &[&[u8]]);
}

/// Which callback to fire (internal dispatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Callback {
    ReservedRead,
    ReadFinished,
    ReservedWrite,
    WriteFinished,
    FinishWriteAndReserveRead,
    Deleted,
    Accessed,
}

impl Callback {
    pub fn call(self, l: &dyn Listener, keys: &[&[u8]]) {
        match self {
            Callback::ReservedRead => l.reserved_read(keys),
            Callback::ReadFinished => l.read_finished(keys),
            Callback::ReservedWrite => l.reserved_write(keys),
            Callback::WriteFinished => l.write_finished(keys),
            Callback::FinishWriteAndReserveRead => l.finish_write_and_reserve_read(keys),
            Callback::Deleted => l.deleted(keys),
            Callback::Accessed => l.accessed(keys),
        }
    }
}
