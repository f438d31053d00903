//! The ledger: the pool manager's durable state — pools, regions, free
//! extents, the region-id high-water mark — and the one function that changes
//! it, [`Ledger::apply`].
//!
//! Everything that must survive a crash is here, and nothing else: the live
//! manager and the journal replay both mutate the ledger only by applying
//! [`Record`]s, so "what replay rebuilds" and "what the live manager did" are
//! the same code. `apply` checks every precondition before it changes
//! anything: a record that does not fit the current state is refused and the
//! ledger is left as it was (for replay, that means the journal is
//! inconsistent and recovery refuses to start).
//!
//! Geometry: a pool of `size_bytes` with alignment `a` allocates from
//! `[a, ⌊size/a⌋·a)`. The first aligned block holds the pool's identity header
//! (see [`super::header`]) and is never handed out; a tail shorter than one
//! block is unused. Every region's offset and length are multiples of `a`, so
//! every free extent is too.
//!
//! Invariants ([`Ledger::verify`], run after recovery and by tests after every
//! step): per pool, regions and free extents are aligned, lie in the usable
//! range, do not overlap, and together cover it exactly (free + allocated =
//! capacity); free extents are maximal; every region's pool exists; every
//! region id is in `1..next_region`; the per-pool counters match.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::extents::{ExtentError, FreeExtents};
use super::record::Record;
use super::types::{AllocTag, DirectoryId, OwnerLabel, PoolId, PoolUuid, RegionId, RegionRecord};

/// Smallest pool alignment accepted (one base page).
pub const MIN_ALIGNMENT_BYTES: u64 = 4 << 10;
/// Largest pool alignment accepted (one 1 GiB huge page).
pub const MAX_ALIGNMENT_BYTES: u64 = 1 << 30;
/// Largest pool accepted (64 PiB); keeps `offset + len` far from overflow.
pub const MAX_POOL_BYTES: u64 = 1 << 56;
/// Most pools one manager serves.
pub const MAX_POOLS: usize = 256;
/// Most live regions one manager tracks (bounds memory, checkpoint size and
/// the free-extent arena).
pub const MAX_REGIONS: usize = 1 << 22;

/// A pool as the ledger records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolInfo {
    pub id: PoolId,
    pub uuid: PoolUuid,
    pub size_bytes: u64,
    pub alignment_bytes: u64,
    /// The epoch of the last manager that took this pool (0: never taken).
    pub epoch: u64,
}

impl PoolInfo {
    /// First allocatable byte: the identity header owns the first block.
    pub fn usable_start(&self) -> u64 {
        self.alignment_bytes
    }

    /// One past the last allocatable byte.
    pub fn usable_end(&self) -> u64 {
        self.size_bytes / self.alignment_bytes * self.alignment_bytes
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.usable_end() - self.usable_start()
    }
}

/// Why a pool's size and alignment are unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    #[error(
        "alignment {alignment_bytes} is not a power of two in [{MIN_ALIGNMENT_BYTES}, {MAX_ALIGNMENT_BYTES}]"
    )]
    BadAlignment { alignment_bytes: u64 },
    #[error("size {size_bytes} exceeds the limit of {MAX_POOL_BYTES} bytes")]
    TooLarge { size_bytes: u64 },
    #[error(
        "size {size_bytes} holds fewer than two blocks of {alignment_bytes} bytes (header + one region)"
    )]
    TooSmall {
        size_bytes: u64,
        alignment_bytes: u64,
    },
}

/// Checks that a pool of this size and alignment can exist.
pub fn check_geometry(size_bytes: u64, alignment_bytes: u64) -> Result<(), GeometryError> {
    if !alignment_bytes.is_power_of_two()
        || !(MIN_ALIGNMENT_BYTES..=MAX_ALIGNMENT_BYTES).contains(&alignment_bytes)
    {
        return Err(GeometryError::BadAlignment { alignment_bytes });
    }
    if size_bytes > MAX_POOL_BYTES {
        return Err(GeometryError::TooLarge { size_bytes });
    }
    if size_bytes / alignment_bytes < 2 {
        return Err(GeometryError::TooSmall {
            size_bytes,
            alignment_bytes,
        });
    }
    Ok(())
}

/// The durable state in a plain form: what a checkpoint stores and what tests
/// compare. Pools are in id order, regions in id order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The next region id to issue (the high-water mark); ids below it have
    /// been issued, whether or not the region still exists.
    pub next_region: RegionId,
    pub pools: Vec<PoolInfo>,
    pub regions: Vec<RegionRecord>,
}

impl Default for Snapshot {
    /// The state of a manager that has never done anything.
    fn default() -> Self {
        Self {
            next_region: FIRST_REGION_ID,
            pools: Vec::new(),
            regions: Vec::new(),
        }
    }
}

/// Region ids start at 1 so that 0 never names a region on the wire.
pub const FIRST_REGION_ID: RegionId = RegionId(1);

/// A record (or snapshot entry) that does not fit the ledger. Nothing was
/// changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("pool {pool} added out of order (next pool id is {expected})")]
    PoolOutOfOrder { pool: PoolId, expected: PoolId },
    #[error("pool uuid {uuid} is already pool {existing}")]
    DuplicateUuid { uuid: PoolUuid, existing: PoolId },
    #[error("pool {pool}: {source}")]
    Geometry { pool: PoolId, source: GeometryError },
    #[error("more than {MAX_POOLS} pools")]
    TooManyPools,
    #[error("unknown pool {pool}")]
    UnknownPool { pool: PoolId },
    #[error("pool {pool}: epoch {epoch} does not increase the current epoch {current}")]
    EpochNotIncreasing {
        pool: PoolId,
        current: u64,
        epoch: u64,
    },
    #[error("region {region} out of order (the next region id is {expected})")]
    RegionOutOfOrder {
        region: RegionId,
        expected: RegionId,
    },
    #[error(
        "region {region} [{offset_bytes:#x}, +{len_bytes:#x}) is not aligned to {alignment_bytes} in pool {pool}"
    )]
    Misaligned {
        region: RegionId,
        pool: PoolId,
        offset_bytes: u64,
        len_bytes: u64,
        alignment_bytes: u64,
    },
    #[error(
        "region {region} [{offset_bytes:#x}, +{len_bytes:#x}) lies outside the usable range of pool {pool}"
    )]
    OutOfRange {
        region: RegionId,
        pool: PoolId,
        offset_bytes: u64,
        len_bytes: u64,
    },
    #[error("region {region} in pool {pool}: {source}")]
    Extent {
        region: RegionId,
        pool: PoolId,
        source: ExtentError,
    },
    #[error("more than {MAX_REGIONS} live regions")]
    TooManyRegions,
    #[error("unknown region {region}")]
    UnknownRegion { region: RegionId },
    #[error(
        "region {region}: directory {directory} already has live region {existing} under tag {tag:?}"
    )]
    DuplicateTag {
        region: RegionId,
        directory: DirectoryId,
        tag: AllocTag,
        existing: RegionId,
    },
}

/// An invariant the ledger must hold, found broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant violated: {what}")]
pub struct InvariantError {
    pub what: String,
}

fn broken(what: String) -> InvariantError {
    InvariantError { what }
}

#[derive(Debug, Clone)]
struct PoolLedger {
    info: PoolInfo,
    free: FreeExtents,
    regions: u64,
    allocated_bytes: u64,
    /// Live regions per owner label (entries are removed at zero).
    owners: BTreeMap<OwnerLabel, u64>,
}

/// Per-pool figures derived from the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub free_extents: u64,
    pub regions: u64,
    pub owners: u64,
}

/// The durable state. See the module essay.
#[derive(Debug, Clone)]
pub struct Ledger {
    pools: Vec<PoolLedger>,
    regions: BTreeMap<RegionId, RegionRecord>,
    /// Live regions allocated under a tag, by (directory, tag).
    tags: BTreeMap<(DirectoryId, AllocTag), RegionId>,
    next_region: RegionId,
    /// See [`Ledger::stamp`].
    stamp: u64,
}

/// Source of [`Ledger::stamp`] values, shared by every ledger in the process
/// so that no two states of two ledgers share a stamp either.
static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

fn fresh_stamp() -> u64 {
    NEXT_STAMP.fetch_add(1, Ordering::Relaxed)
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new()
    }
}

impl Ledger {
    pub fn new() -> Self {
        Self {
            pools: Vec::new(),
            regions: BTreeMap::new(),
            tags: BTreeMap::new(),
            next_region: FIRST_REGION_ID,
            stamp: fresh_stamp(),
        }
    }

    /// Names the current state: a ledger takes a fresh process-wide stamp
    /// when it is built and whenever a record is applied to it, so two reads
    /// of an equal stamp saw the same state (a clone keeps its original's
    /// stamp and state until either changes). Lets a caller that checks
    /// after every step skip [`Ledger::verify`] for a ledger it already
    /// verified.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    pub fn next_region(&self) -> RegionId {
        self.next_region
    }

    pub fn region(&self, id: RegionId) -> Option<&RegionRecord> {
        self.regions.get(&id)
    }

    /// The live region `directory` allocated under `tag`.
    pub fn region_by_tag(&self, directory: DirectoryId, tag: AllocTag) -> Option<&RegionRecord> {
        if tag == AllocTag::NONE {
            return None;
        }
        self.tags
            .get(&(directory, tag))
            .and_then(|id| self.regions.get(id))
    }

    pub fn regions(&self) -> impl Iterator<Item = &RegionRecord> {
        self.regions.values()
    }

    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    pub fn pool(&self, id: PoolId) -> Option<&PoolInfo> {
        self.pools.get(id.0 as usize).map(|p| &p.info)
    }

    pub fn pools(&self) -> impl Iterator<Item = &PoolInfo> {
        self.pools.iter().map(|p| &p.info)
    }

    pub fn pool_by_uuid(&self, uuid: PoolUuid) -> Option<PoolId> {
        self.pools
            .iter()
            .find(|p| p.info.uuid == uuid)
            .map(|p| p.info.id)
    }

    pub fn usage(&self, id: PoolId) -> Option<PoolUsage> {
        self.pools.get(id.0 as usize).map(|p| PoolUsage {
            capacity_bytes: p.info.capacity_bytes(),
            free_bytes: p.free.free_bytes(),
            largest_free_bytes: p.free.largest(),
            free_extents: p.free.count() as u64,
            regions: p.regions,
            owners: p.owners.len() as u64,
        })
    }

    /// Lowest aligned offset in `pool` where `len_bytes` fit.
    pub fn first_fit(&self, pool: PoolId, len_bytes: u64) -> Option<u64> {
        let p = self.pools.get(pool.0 as usize)?;
        let at = p.free.first_fit(len_bytes)?;
        debug_assert_eq!(at % p.info.alignment_bytes, 0, "free extents stay aligned");
        Some(at)
    }

    /// Applies one record; on error nothing changed.
    pub fn apply(&mut self, record: &Record) -> Result<(), LedgerError> {
        self.stamp = fresh_stamp();
        match *record {
            Record::PoolAdded {
                pool,
                uuid,
                size_bytes,
                alignment_bytes,
            } => self.add_pool(PoolInfo {
                id: pool,
                uuid,
                size_bytes,
                alignment_bytes,
                epoch: 0,
            }),
            Record::PoolEpoch { pool, epoch } => {
                let p = self
                    .pools
                    .get_mut(pool.0 as usize)
                    .ok_or(LedgerError::UnknownPool { pool })?;
                if epoch <= p.info.epoch {
                    return Err(LedgerError::EpochNotIncreasing {
                        pool,
                        current: p.info.epoch,
                        epoch,
                    });
                }
                p.info.epoch = epoch;
                Ok(())
            }
            Record::Allocated(region) => {
                if region.id != self.next_region {
                    return Err(LedgerError::RegionOutOfOrder {
                        region: region.id,
                        expected: self.next_region,
                    });
                }
                self.insert_region(region)?;
                self.next_region = RegionId(region.id.0 + 1);
                Ok(())
            }
            Record::Freed { region } | Record::Reclaimed { region } => self.remove_region(region),
        }
    }

    fn add_pool(&mut self, info: PoolInfo) -> Result<(), LedgerError> {
        let expected = PoolId(self.pools.len() as u32);
        if info.id != expected {
            return Err(LedgerError::PoolOutOfOrder {
                pool: info.id,
                expected,
            });
        }
        if self.pools.len() >= MAX_POOLS {
            return Err(LedgerError::TooManyPools);
        }
        if let Some(existing) = self.pool_by_uuid(info.uuid) {
            return Err(LedgerError::DuplicateUuid {
                uuid: info.uuid,
                existing,
            });
        }
        check_geometry(info.size_bytes, info.alignment_bytes).map_err(|source| {
            LedgerError::Geometry {
                pool: info.id,
                source,
            }
        })?;
        let mut free = FreeExtents::new();
        free.release(info.usable_start(), info.capacity_bytes())
            .expect("an empty extent set accepts the non-empty usable range (geometry checked)");
        self.pools.push(PoolLedger {
            info,
            free,
            regions: 0,
            allocated_bytes: 0,
            owners: BTreeMap::new(),
        });
        Ok(())
    }

    fn insert_region(&mut self, r: RegionRecord) -> Result<(), LedgerError> {
        if self.regions.len() >= MAX_REGIONS {
            return Err(LedgerError::TooManyRegions);
        }
        let p = self
            .pools
            .get_mut(r.pool.0 as usize)
            .ok_or(LedgerError::UnknownPool { pool: r.pool })?;
        let a = p.info.alignment_bytes;
        if r.len_bytes == 0 || !r.offset_bytes.is_multiple_of(a) || !r.len_bytes.is_multiple_of(a) {
            return Err(LedgerError::Misaligned {
                region: r.id,
                pool: r.pool,
                offset_bytes: r.offset_bytes,
                len_bytes: r.len_bytes,
                alignment_bytes: a,
            });
        }
        let in_range = r.offset_bytes >= p.info.usable_start()
            && r.offset_bytes
                .checked_add(r.len_bytes)
                .is_some_and(|e| e <= p.info.usable_end());
        if !in_range {
            return Err(LedgerError::OutOfRange {
                region: r.id,
                pool: r.pool,
                offset_bytes: r.offset_bytes,
                len_bytes: r.len_bytes,
            });
        }
        if self.regions.contains_key(&r.id) {
            return Err(LedgerError::RegionOutOfOrder {
                region: r.id,
                expected: self.next_region,
            });
        }
        if r.tag != AllocTag::NONE
            && let Some(&existing) = self.tags.get(&(r.owner.directory, r.tag))
        {
            return Err(LedgerError::DuplicateTag {
                region: r.id,
                directory: r.owner.directory,
                tag: r.tag,
                existing,
            });
        }
        p.free
            .carve(r.offset_bytes, r.len_bytes)
            .map_err(|source| LedgerError::Extent {
                region: r.id,
                pool: r.pool,
                source,
            })?;
        p.regions += 1;
        p.allocated_bytes += r.len_bytes;
        *p.owners.entry(r.owner).or_insert(0) += 1;
        if r.tag != AllocTag::NONE {
            self.tags.insert((r.owner.directory, r.tag), r.id);
        }
        self.regions.insert(r.id, r);
        Ok(())
    }

    fn remove_region(&mut self, id: RegionId) -> Result<(), LedgerError> {
        let r = *self
            .regions
            .get(&id)
            .ok_or(LedgerError::UnknownRegion { region: id })?;
        let p = self.pools.get_mut(r.pool.0 as usize).expect(
            "a live region's pool exists (checked when it was inserted; pools are never removed)",
        );
        p.free
            .release(r.offset_bytes, r.len_bytes)
            .map_err(|source| LedgerError::Extent {
                region: id,
                pool: r.pool,
                source,
            })?;
        p.regions -= 1;
        p.allocated_bytes -= r.len_bytes;
        match p.owners.get_mut(&r.owner) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                p.owners.remove(&r.owner);
            }
        }
        if r.tag != AllocTag::NONE {
            self.tags.remove(&(r.owner.directory, r.tag));
        }
        self.regions.remove(&id);
        Ok(())
    }

    /// The durable state as plain values.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            next_region: self.next_region,
            pools: self.pools.iter().map(|p| p.info).collect(),
            regions: self.regions.values().copied().collect(),
        }
    }

    /// Rebuilds a ledger from a snapshot, with the same checks as replay.
    pub fn from_snapshot(s: &Snapshot) -> Result<Self, LedgerError> {
        let mut l = Self::new();
        for info in &s.pools {
            l.add_pool(PoolInfo { epoch: 0, ..*info })?;
            if info.epoch > 0 {
                l.apply(&Record::PoolEpoch {
                    pool: info.id,
                    epoch: info.epoch,
                })?;
            }
        }
        let mut prev: Option<RegionId> = None;
        for r in &s.regions {
            if prev.is_some_and(|p| r.id <= p) || r.id < FIRST_REGION_ID || r.id >= s.next_region {
                return Err(LedgerError::RegionOutOfOrder {
                    region: r.id,
                    expected: s.next_region,
                });
            }
            l.insert_region(*r)?;
            prev = Some(r.id);
        }
        if s.next_region < FIRST_REGION_ID {
            return Err(LedgerError::RegionOutOfOrder {
                region: s.next_region,
                expected: FIRST_REGION_ID,
            });
        }
        l.next_region = s.next_region;
        Ok(l)
    }

    /// Checks every invariant of the module essay from scratch. O(n log n).
    pub fn verify(&self) -> Result<(), InvariantError> {
        let mut by_pool: Vec<Vec<&RegionRecord>> = vec![Vec::new(); self.pools.len()];
        let mut tagged = 0usize;
        for (id, r) in &self.regions {
            if r.tag != AllocTag::NONE {
                tagged += 1;
                if self.tags.get(&(r.owner.directory, r.tag)) != Some(id) {
                    return Err(broken(format!(
                        "region {id}'s tag {:?} is not indexed to it",
                        r.tag
                    )));
                }
            }
            if *id != r.id {
                return Err(broken(format!("region keyed {id} records id {}", r.id)));
            }
            if r.id < FIRST_REGION_ID || r.id >= self.next_region {
                return Err(broken(format!(
                    "region {} is outside the issued ids [{FIRST_REGION_ID}, {})",
                    r.id, self.next_region
                )));
            }
            match by_pool.get_mut(r.pool.0 as usize) {
                Some(v) => v.push(r),
                None => {
                    return Err(broken(format!(
                        "region {} names missing pool {}",
                        r.id, r.pool
                    )));
                }
            }
        }
        if tagged != self.tags.len() {
            return Err(broken(format!(
                "{} tags indexed, {tagged} tagged regions",
                self.tags.len()
            )));
        }
        for (i, (p, regions)) in self.pools.iter().zip(by_pool.iter_mut()).enumerate() {
            let id = p.info.id;
            if id.0 as usize != i {
                return Err(broken(format!("pool at index {i} has id {id}")));
            }
            if let Err(e) = check_geometry(p.info.size_bytes, p.info.alignment_bytes) {
                return Err(broken(format!("pool {id}: {e}")));
            }
            if let Err(e) = p.free.check() {
                return Err(broken(format!("pool {id} free extents: {e}")));
            }
            regions.sort_unstable_by_key(|r| r.offset_bytes);
            self.verify_cover(p, regions)?;
        }
        Ok(())
    }

    /// Walks regions and free extents of one pool in address order: they
    /// must tile the usable range exactly, and no two free extents touch.
    fn verify_cover(
        &self,
        p: &PoolLedger,
        regions: &[&RegionRecord],
    ) -> Result<(), InvariantError> {
        let id = p.info.id;
        let a = p.info.alignment_bytes;
        let mut free = Vec::with_capacity(p.free.count());
        p.free.for_each(|s, l| free.push((s, l)));
        let mut cursor = p.info.usable_start();
        let (mut ri, mut fi) = (0, 0);
        let mut last_was_free = false;
        let mut allocated = 0u64;
        let mut owners: BTreeMap<OwnerLabel, u64> = BTreeMap::new();
        while ri < regions.len() || fi < free.len() {
            let take_free = match (regions.get(ri), free.get(fi)) {
                (Some(r), Some(f)) => f.0 < r.offset_bytes,
                (None, Some(_)) => true,
                _ => false,
            };
            let (start, len, what) = if take_free {
                let f = free[fi];
                fi += 1;
                if last_was_free {
                    return Err(broken(format!(
                        "pool {id}: free extents touch at {:#x}",
                        f.0
                    )));
                }
                (f.0, f.1, Piece::Free)
            } else {
                let r = regions[ri];
                ri += 1;
                allocated += r.len_bytes;
                *owners.entry(r.owner).or_insert(0) += 1;
                (r.offset_bytes, r.len_bytes, Piece::Region(r.id))
            };
            last_was_free = take_free;
            if len == 0 || start % a != 0 || len % a != 0 {
                return Err(broken(format!(
                    "pool {id}: {what} [{start:#x}, +{len:#x}) is empty or not aligned to {a}"
                )));
            }
            if start != cursor {
                return Err(broken(format!(
                    "pool {id}: {what} starts at {start:#x}, expected {cursor:#x} ({})",
                    if start < cursor { "overlap" } else { "hole" }
                )));
            }
            cursor = start + len;
        }
        if cursor != p.info.usable_end() {
            return Err(broken(format!(
                "pool {id}: regions and free extents end at {cursor:#x}, usable range ends at {:#x}",
                p.info.usable_end()
            )));
        }
        if allocated != p.allocated_bytes || regions.len() as u64 != p.regions {
            return Err(broken(format!(
                "pool {id}: counted {} regions / {} bytes, found {} / {allocated}",
                p.regions,
                p.allocated_bytes,
                regions.len()
            )));
        }
        if allocated + p.free.free_bytes() != p.info.capacity_bytes() {
            return Err(broken(format!(
                "pool {id}: free {} + allocated {allocated} != capacity {}",
                p.free.free_bytes(),
                p.info.capacity_bytes()
            )));
        }
        if owners != p.owners {
            return Err(broken(format!(
                "pool {id}: owner counts disagree with the regions"
            )));
        }
        Ok(())
    }
}

/// What `verify_cover` is looking at, named only when an error needs it:
/// the check runs after every simulated event, so it must not format.
#[derive(Clone, Copy)]
enum Piece {
    Free,
    Region(RegionId),
}

impl fmt::Display for Piece {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Piece::Free => f.write_str("free extent"),
            Piece::Region(id) => write!(f, "region {id}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::types::{DirectoryId, InstanceId};

    const MIB: u64 = 1 << 20;

    fn pool_added(id: u32, size: u64) -> Record {
        Record::PoolAdded {
            pool: PoolId(id),
            uuid: PoolUuid([id as u8 + 1; 16]),
            size_bytes: size,
            alignment_bytes: 2 * MIB,
        }
    }

    fn alloc(id: u64, pool: u32, off: u64, len: u64) -> Record {
        Record::Allocated(RegionRecord {
            id: RegionId(id),
            pool: PoolId(pool),
            offset_bytes: off,
            len_bytes: len,
            owner: OwnerLabel {
                directory: DirectoryId(1),
                instance: InstanceId(id % 3),
            },
            tag: AllocTag(id),
        })
    }

    #[test]
    fn a_stamp_changes_with_every_applied_record_and_is_never_shared_by_two_ledgers() {
        let mut a = Ledger::new();
        let b = Ledger::new();
        assert_ne!(
            a.stamp(),
            0,
            "0 is free for callers to mean 'never verified'"
        );
        assert_ne!(a.stamp(), b.stamp());
        let mut seen = vec![a.stamp(), b.stamp()];
        for record in [pool_added(0, 64 * MIB), alloc(1, 0, 2 * MIB, 4 * MIB)] {
            a.apply(&record).unwrap();
            assert!(!seen.contains(&a.stamp()), "a changed ledger kept a stamp");
            seen.push(a.stamp());
        }
        // A rejected record changes nothing, but may still take a stamp:
        // a new stamp only ever costs a needless verify.
        let _ = a.apply(&alloc(1, 0, 2 * MIB, 4 * MIB));
        let c = a.clone();
        assert_eq!(c.stamp(), a.stamp(), "a clone holds the same state");
        assert_eq!(c.snapshot(), a.snapshot());
        let restored = Ledger::from_snapshot(&a.snapshot()).unwrap();
        assert!(!seen.contains(&restored.stamp()) && restored.stamp() != a.stamp());
    }

    #[test]
    fn the_first_block_and_a_partial_tail_are_never_allocatable() {
        let mut l = Ledger::new();
        l.apply(&pool_added(0, 9 * MIB)).unwrap(); // blocks at 0,2,4,6 MiB; 8..9 MiB unused
        let u = l.usage(PoolId(0)).unwrap();
        assert_eq!(u.capacity_bytes, 6 * MIB);
        assert_eq!(l.first_fit(PoolId(0), 2 * MIB), Some(2 * MIB));
        assert_eq!(
            l.apply(&alloc(1, 0, 0, 2 * MIB)),
            Err(LedgerError::OutOfRange {
                region: RegionId(1),
                pool: PoolId(0),
                offset_bytes: 0,
                len_bytes: 2 * MIB
            })
        );
        assert!(matches!(
            l.apply(&alloc(1, 0, 6 * MIB, 4 * MIB)),
            Err(LedgerError::OutOfRange { .. })
        ));
        l.verify().unwrap();
    }

    #[test]
    fn rejected_records_change_nothing() {
        let mut l = Ledger::new();
        l.apply(&pool_added(0, 64 * MIB)).unwrap();
        l.apply(&alloc(1, 0, 2 * MIB, 4 * MIB)).unwrap();
        let before = l.snapshot();
        let bad = [
            pool_added(0, 64 * MIB),        // out of order
            pool_added(1, 3 * MIB),         // too small
            alloc(1, 0, 10 * MIB, 2 * MIB), // id reused
            alloc(3, 0, 10 * MIB, 2 * MIB), // id skips
            alloc(2, 0, 4 * MIB, 2 * MIB),  // overlaps region 1
            alloc(2, 0, 3 * MIB, 2 * MIB),  // misaligned
            alloc(2, 7, 8 * MIB, 2 * MIB),  // unknown pool
            Record::Freed {
                region: RegionId(9),
            }, // unknown region
            Record::PoolEpoch {
                pool: PoolId(0),
                epoch: 0,
            }, // not increasing
        ];
        for r in bad {
            assert!(l.apply(&r).is_err(), "{r:?} must be refused");
            assert_eq!(l.snapshot(), before, "{r:?} changed the ledger");
            l.verify().unwrap();
        }
    }

    #[test]
    fn a_tag_names_at_most_one_live_region_per_directory() {
        let mut l = Ledger::new();
        l.apply(&pool_added(0, 64 * MIB)).unwrap();
        l.apply(&alloc(1, 0, 2 * MIB, 2 * MIB)).unwrap();
        let Record::Allocated(mut again) = alloc(2, 0, 4 * MIB, 2 * MIB) else {
            unreachable!()
        };
        again.tag = AllocTag(1);
        assert!(matches!(
            l.apply(&Record::Allocated(again)),
            Err(LedgerError::DuplicateTag {
                existing: RegionId(1),
                ..
            })
        ));
        assert_eq!(
            l.region_by_tag(DirectoryId(1), AllocTag(1)).map(|r| r.id),
            Some(RegionId(1))
        );
        l.apply(&Record::Freed {
            region: RegionId(1),
        })
        .unwrap();
        assert_eq!(l.region_by_tag(DirectoryId(1), AllocTag(1)), None);
        l.apply(&Record::Allocated(again)).unwrap();
        l.verify().unwrap();
    }

    #[test]
    fn snapshot_round_trip_rebuilds_the_same_free_space() {
        let mut l = Ledger::new();
        l.apply(&pool_added(0, 64 * MIB)).unwrap();
        l.apply(&pool_added(1, 32 * MIB)).unwrap();
        l.apply(&Record::PoolEpoch {
            pool: PoolId(1),
            epoch: 3,
        })
        .unwrap();
        l.apply(&alloc(1, 0, 2 * MIB, 4 * MIB)).unwrap();
        l.apply(&alloc(2, 0, 8 * MIB, 2 * MIB)).unwrap();
        l.apply(&alloc(3, 1, 4 * MIB, 8 * MIB)).unwrap();
        l.apply(&Record::Freed {
            region: RegionId(1),
        })
        .unwrap();
        let s = l.snapshot();
        let back = Ledger::from_snapshot(&s).unwrap();
        back.verify().unwrap();
        assert_eq!(back.snapshot(), s);
        for p in [PoolId(0), PoolId(1)] {
            assert_eq!(back.usage(p), l.usage(p));
        }
        assert_eq!(back.next_region(), RegionId(4));
    }

    #[test]
    fn snapshots_with_overlaps_or_ids_above_the_mark_are_refused() {
        let mut l = Ledger::new();
        l.apply(&pool_added(0, 64 * MIB)).unwrap();
        l.apply(&alloc(1, 0, 2 * MIB, 4 * MIB)).unwrap();
        l.apply(&alloc(2, 0, 6 * MIB, 4 * MIB)).unwrap();
        let good = l.snapshot();
        let mut overlap = good.clone();
        overlap.regions[1].offset_bytes = 4 * MIB;
        assert!(matches!(
            Ledger::from_snapshot(&overlap),
            Err(LedgerError::Extent { .. })
        ));
        let mut above = good.clone();
        above.next_region = RegionId(2);
        assert!(matches!(
            Ledger::from_snapshot(&above),
            Err(LedgerError::RegionOutOfOrder { .. })
        ));
        let mut orphan = good;
        orphan.regions[0].pool = PoolId(5);
        assert!(matches!(
            Ledger::from_snapshot(&orphan),
            Err(LedgerError::UnknownPool { .. })
        ));
    }
}
