//! The values the pool manager talks about: who is calling, who owns a
//! region, what a region handle carries, and what time it is.
//!
//! These are plain data. The only behaviour here is formatting; tokens are
//! computed and checked in [`super::token`].

use std::fmt;

pub use cxlkv_dataplane::ids::{PoolId, RegionId};

/// A monotonic time in milliseconds from an arbitrary origin, supplied by the
/// driver with every input. The state machine never reads a clock, and never
/// persists one of these: the origin changes across restarts (and reboots).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct MonotonicMs(pub u64);

impl MonotonicMs {
    /// `self + ms`, saturating (a grace period never wraps into the past).
    pub fn plus_ms(self, ms: u64) -> Self {
        Self(self.0.saturating_add(ms))
    }

    /// Milliseconds from `self` until `later` (0 if `later` is not later).
    pub fn ms_until(self, later: Self) -> u64 {
        later.0.saturating_sub(self.0)
    }
}

/// A directory's stable name, chosen by the directory (configured or
/// generated once and kept), presented on every attach. It is a label, not a
/// credential: ownership of a region is proven by its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DirectoryId(pub u64);

/// A client instance of a directory, as numbered by that directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InstanceId(pub u64);

impl fmt::Display for DirectoryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dir{:#x}", self.0)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "inst{:#x}", self.0)
    }
}

/// Who a region belongs to: the directory that allocated it and the client
/// instance that directory assigned it to. Both are covered by the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OwnerLabel {
    pub directory: DirectoryId,
    pub instance: InstanceId,
}

impl fmt::Display for OwnerLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.directory, self.instance)
    }
}

/// A pool's UUID, as written in its identity header. Hosts sharing a device
/// find their local path for a pool by this value.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PoolUuid(pub [u8; 16]);

impl fmt::Display for PoolUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for PoolUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolUuid({self})")
    }
}

/// A pool manager's name in the lease slots of pool headers: derived from the
/// manager's secret, so it is stable across restarts of one state directory
/// and differs between state directories.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ManagerId(pub [u8; 16]);

impl fmt::Display for ManagerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ManagerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManagerId({self})")
    }
}

/// A local process, named so that a reused pid is not mistaken for the
/// process that had it before: `start_time_ticks` is field 22 of
/// `/proc/<pid>/stat` (clock ticks after boot), which differs between two
/// processes that get the same pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessIdentity {
    pub pid: u32,
    pub start_time_ticks: u64,
}

impl fmt::Display for ProcessIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pid {} (started at tick {})",
            self.pid, self.start_time_ticks
        )
    }
}

/// The caller of a request, as established by the driver — never read from a
/// payload.
///
/// A local caller is judged by its process (it stays the same caller across
/// reconnects, and is gone when the process is); a remote caller is one
/// connection (gone when the connection is). The transport must never reuse a
/// connection id within one run of the pool manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Caller {
    Local(ProcessIdentity),
    Remote { connection: u64 },
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(p) => write!(f, "local {p}"),
            Self::Remote { connection } => write!(f, "remote connection {connection}"),
        }
    }
}

/// Size of a region token in bytes (256 bits of keyed BLAKE3).
pub const TOKEN_BYTES: usize = 32;

/// The capability half of a handle: a keyed hash over the handle's fields.
/// Compared in constant time; its `Debug` shows only a prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub [u8; TOKEN_BYTES]);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Token({:02x}{:02x}{:02x}{:02x}…)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

/// A directory-chosen name for one logical allocation, so that a retried
/// `Alloc` (after a lost reply, or a manager crash after the commit) returns
/// the region already allocated instead of leaking a second one. Unique per
/// directory among its live regions; `AllocTag::NONE` opts out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllocTag(pub u64);

impl AllocTag {
    pub const NONE: Self = Self(0);
}

/// A region as the ledger records it: where it is, who owns it, and the tag
/// it was allocated under. Immutable from allocation to free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionRecord {
    pub id: RegionId,
    pub pool: PoolId,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub owner: OwnerLabel,
    pub tag: AllocTag,
}

impl RegionRecord {
    /// One past the last byte of the region within its pool.
    pub fn end_bytes(&self) -> u64 {
        self.offset_bytes + self.len_bytes
    }

    /// True when `h` names exactly this region (token not checked here).
    pub fn matches(&self, h: &Handle) -> bool {
        self.id == h.region
            && self.pool == h.pool
            && self.offset_bytes == h.offset_bytes
            && self.len_bytes == h.len_bytes
            && self.owner == h.owner
    }
}

/// What a directory holds for a region: the region's fields plus the token
/// that proves it was issued to this owner. Directories hand handles to their
/// client instances, which hand them back after a directory restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle {
    pub region: RegionId,
    pub pool: PoolId,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub owner: OwnerLabel,
    pub token: Token,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_prints_in_the_canonical_8_4_4_4_12_form() {
        let u = PoolUuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ]);
        assert_eq!(u.to_string(), "12345678-9abc-def0-0123-456789abcdef");
    }

    #[test]
    fn token_debug_does_not_print_the_whole_token() {
        let t = Token([0xab; TOKEN_BYTES]);
        let s = format!("{t:?}");
        assert!(s.len() < 2 * TOKEN_BYTES, "{s}");
    }

    #[test]
    fn time_arithmetic_saturates() {
        assert_eq!(MonotonicMs(u64::MAX - 1).plus_ms(10), MonotonicMs(u64::MAX));
        assert_eq!(MonotonicMs(10).ms_until(MonotonicMs(4)), 0);
        assert_eq!(MonotonicMs(4).ms_until(MonotonicMs(10)), 6);
    }
}
