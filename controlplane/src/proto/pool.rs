//! Messages between a directory and the pool manager (DESIGN §5), spoken on
//! the pool manager's own socket (`cxlkv pool`), or in-process when the pool
//! manager is embedded in `cxlkv serve`.
//!
//! The directory is the pool manager's only kind of client. Requests carry a
//! [`RequestMeta`] (`notice_ack` is always 0 here); replies carry no
//! [`ReplyMeta`](super::ReplyMeta). The connection's directory identity is
//! the one its `PoolHello` named.

use rkyv::{Archive, Deserialize, Serialize};

use super::common::{OwnerLabel, PoolInfo, RefusedRegion, RegionHandle, RegionToken, RequestMeta};

/// First request on a pool-manager connection.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolHello {
    pub meta: RequestMeta,
    pub protocol_min: u16,
    pub protocol_max: u16,
    /// Stable identity of the directory (non-empty). A restarted directory
    /// uses the same id to find and reattach its regions.
    pub directory_id: String,
    /// Pre-shared secret required on TCP; `None` on Unix sockets.
    pub secret: Option<Vec<u8>>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolWelcome {
    pub protocol_version: u16,
    /// Changes when another pool-manager process takes over the pools.
    pub manager_epoch: u64,
    pub pools: Vec<PoolInfo>,
    /// Pool descriptors sent with `SCM_RIGHTS`: 0 or `pools.len()`, in
    /// `pools` order (the directory hands them on to its local clients).
    pub fds_passed: u32,
    /// Regions this directory id already holds (after a directory restart):
    /// list them with `ListRegions`.
    pub regions_held: u64,
    /// Highest `seq` this manager has applied for this directory id (0: none).
    /// A restarted directory numbers its mutating requests from
    /// `last_seq + 1`, so that they never collide with cached replies.
    pub last_seq: u64,
}

/// Carves a region out of a pool (mutating).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct AllocRegion {
    pub meta: RequestMeta,
    /// A specific pool, or `None`: the pool manager picks one.
    pub pool: Option<u32>,
    /// Requested length (non-zero), rounded up to the pool alignment.
    pub len_bytes: u64,
    /// Whom the region is for; `owner.directory_id` must be the
    /// connection's directory.
    pub owner: OwnerLabel,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionAllocated {
    /// Journaled before this reply was sent.
    pub handle: RegionHandle,
}

/// Returns a region to its pool (mutating).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct FreeRegion {
    pub meta: RequestMeta,
    pub region: u64,
    pub token: RegionToken,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionFreed {
    pub region: u64,
}

/// A directory that reconnected (or restarted) confirms the regions it
/// still uses; regions of a dead directory that are not reattached within
/// the grace period are reclaimed. Idempotent, so `seq` 0.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ReattachRegions {
    pub meta: RequestMeta,
    /// At most [`MAX_REATTACH_REGIONS`](super::MAX_REATTACH_REGIONS).
    pub handles: Vec<RegionHandle>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionsReattached {
    pub accepted: Vec<u64>,
    pub refused: Vec<RefusedRegion>,
}

/// Lists the regions the connection's directory holds, by increasing region
/// id, one page at a time (read-only).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ListRegions {
    pub meta: RequestMeta,
    /// Start after this region id (0: from the start).
    pub after_region: u64,
    /// Page size, at most [`MAX_LIST_REGIONS`](super::MAX_LIST_REGIONS).
    pub max_handles: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionList {
    pub handles: Vec<RegionHandle>,
    /// True when more regions follow the last one listed.
    pub more: bool,
}

/// Pool occupancy (read-only).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolStats {
    pub meta: RequestMeta,
}

/// Region bytes one directory holds in a pool.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct OwnerUsage {
    pub directory_id: String,
    pub regions: u64,
    pub bytes: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolUsage {
    pub pool: u32,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Largest contiguous free extent: the largest region that can be
    /// allocated now.
    pub largest_free_bytes: u64,
    pub regions: u64,
    /// Per directory, at most [`MAX_POOL_OWNERS`](super::MAX_POOL_OWNERS).
    pub owners: Vec<OwnerUsage>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolStatsReply {
    pub manager_epoch: u64,
    pub pools: Vec<PoolUsage>,
}
