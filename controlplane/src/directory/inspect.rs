//! Looking inside: the statistics snapshot, the invariant checker and the
//! state digest. The last two walk the whole state (O(keys + pins)); tests and
//! the deterministic simulation call them after every step, the server never.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::Duration;

use foldhash::fast::FixedState;

use super::Directory;
use super::keys::NIL;
use super::keys::mix;
use super::pin_ledger;
use super::regions::Owner;
use super::stats::{DirectoryStats, InstanceStats, LongHeldPin, LongHeldPins, OpStats, PoolStats};
use super::types::{InstanceId, Layout, Location, OpKind, RegionDescriptor, SessionId, Time};
use cxlkv_dataplane::ids::RegionId;

/// What the directory holds for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyInfo {
    pub location: Location,
    /// Pins summed over all live sessions.
    pub pins: u32,
}

/// What the directory holds for one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    pub descriptor: RegionDescriptor,
    pub layout: Layout,
    /// The owning instance, or `None` once it is gone (the region is then
    /// freed with its last key).
    pub owner: Option<InstanceId>,
    /// The owner label the region was allocated for.
    pub owner_label: InstanceId,
    /// Keys registered in it.
    pub keys: u32,
}

/// Keys, pins and regions, as [`Directory::stats`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectoryTotals {
    pub keys: u64,
    pub pins: u64,
    pub regions: u64,
}

/// A broken invariant, with what was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("directory invariant violated: {0}")]
pub struct InvariantViolation(pub String);

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(InvariantViolation(format!($($fmt)+)));
        }
    };
}

impl Directory {
    /// A snapshot of everything the directory counts. The totals, the pin
    /// bookkeeping among them (`pinned_entries`, `pin_ledger_bytes`), are
    /// running counts; what it walks is the instances, the regions and —
    /// for `long_held_pins` — every pin held.
    pub fn stats(&mut self, now: Time) -> DirectoryStats {
        self.count_call(OpKind::Stats, 0, false);
        let mut per_instance: Vec<InstanceStats> = self
            .instances
            .iter()
            .flatten()
            .map(|inst| {
                let (cached_replies, cached_reply_bytes) = inst.replies.cached();
                InstanceStats {
                    instance: inst.id.clone(),
                    sessions: inst.sessions.len(),
                    awaiting_reattach: inst.secret.is_none(),
                    regions: inst.regions.len(),
                    owned_bytes: inst.owned_bytes,
                    pending_region_bytes: inst.pending_bytes,
                    keys: inst.keys,
                    used_bytes: inst.used_bytes,
                    pins_held: inst
                        .sessions
                        .iter()
                        .filter_map(|s| self.sessions.get(s))
                        .map(|s| s.pin_total)
                        .sum(),
                    notices_pending: inst.notices.pending(),
                    cached_replies,
                    cached_reply_bytes,
                    quota_bytes: inst.quota_bytes,
                }
            })
            .collect();
        per_instance.sort_by(|a, b| a.instance.cmp(&b.instance));

        let mut per_pool: std::collections::BTreeMap<_, PoolStats> = self
            .pools
            .iter()
            .map(|(&pool, u)| {
                (
                    pool,
                    PoolStats {
                        pool,
                        regions: 0,
                        region_bytes: 0,
                        orphaned_regions: 0,
                        keys: 0,
                        used_bytes: 0,
                        reported_total_bytes: u.reported_total_bytes,
                        estimated_free_bytes: u.estimated_free(),
                    },
                )
            })
            .collect();
        let mut orphaned_regions = 0;
        for (_, r) in self.regions.iter() {
            let pool = r.handle.pool;
            let p = per_pool.entry(pool).or_insert(PoolStats {
                pool,
                regions: 0,
                region_bytes: 0,
                orphaned_regions: 0,
                keys: 0,
                used_bytes: 0,
                reported_total_bytes: 0,
                estimated_free_bytes: 0,
            });
            p.regions += 1;
            p.region_bytes += r.handle.len_bytes;
            p.keys += u64::from(r.keys);
            p.used_bytes += u64::from(r.keys) * r.page_size_bytes;
            if matches!(r.owner, Owner::Gone { .. }) {
                p.orphaned_regions += 1;
                orphaned_regions += 1;
            }
        }

        let long_held_pins = self.long_held_pins(now);

        DirectoryStats {
            directory_epoch: self.epoch,
            keys: self.keys.len() as u64,
            page_bytes: self.totals.page_bytes,
            value_bytes: self.totals.value_bytes,
            key_bytes: self.totals.key_bytes,
            pins: self.totals.pins,
            pinned_keys: self.totals.pinned_keys,
            pinned_entries: self.totals.pin_entries,
            max_pinned_entries: self.config.max_pinned_entries as u64,
            pin_ledger_bytes: self.pin_ledger_bytes(),
            sessions: self.sessions.len() as u64,
            instances: self.instance_ix.len() as u64,
            regions: self.regions.len() as u64,
            region_bytes: self.totals.region_bytes,
            orphaned_regions,
            pending_region_requests: self.pending.len() as u64,
            layouts: self.layouts.len() as u64,
            per_instance,
            per_pool: per_pool.into_values().collect(),
            ops: OpKind::ALL
                .iter()
                .map(|&op| OpStats {
                    op,
                    counters: self.counters.ops[op.index()],
                    latency: self.counters.latency[op.index()].summary(),
                })
                .collect(),
            outcomes: self.counters.outcomes,
            evictions: self.counters.evictions,
            long_held_pins,
        }
    }

    /// Pins held longer than `long_held_pin`: every one counted, the
    /// `long_held_pins_listed` oldest listed (part of [`stats`](Self::stats);
    /// the server also logs them periodically). Walks every pin held, and
    /// keeps only the oldest few while it does: a bounded heap of their
    /// ranks, the instance named only for those listed. (It collected every
    /// long-held pin first, each with its instance's name copied, then
    /// selected: with 1 M pins all long-held a snapshot took 69–95 ms of the
    /// server's loop, now 6–9 ms, the walk alone 2.4–4.5 ms;
    /// `examples/directory_batch --op stats`, reliability defect 35.)
    pub fn long_held_pins(&self, now: Time) -> LongHeldPins {
        /// A long-held pin while the walk runs. Ordered oldest first, then
        /// by session; the heap's top is the youngest of those kept.
        #[derive(PartialEq, Eq, PartialOrd, Ord)]
        struct Rank {
            held_for: std::cmp::Reverse<Duration>,
            session: SessionId,
            instance: u32,
            pins: u32,
        }
        let threshold = self.config.long_held_pin;
        let listed = self.config.long_held_pins_listed;
        let mut oldest: BinaryHeap<Rank> = BinaryHeap::with_capacity(listed.min(1024) + 1);
        let mut count = 0u64;
        for (&session, s) in &self.sessions {
            for (_, held) in s.pins.iter() {
                let held_for = now.saturating_since(held.since);
                if held_for < threshold {
                    continue;
                }
                count += 1;
                let rank = Rank {
                    held_for: std::cmp::Reverse(held_for),
                    session,
                    instance: s.instance,
                    pins: held.count,
                };
                if oldest.len() < listed {
                    oldest.push(rank);
                } else if let Some(mut youngest) = oldest.peek_mut()
                    && rank < *youngest
                {
                    // Replaced in place; the heap restores its order when
                    // `youngest` goes out of scope.
                    *youngest = rank;
                }
            }
        }
        LongHeldPins {
            threshold,
            count,
            oldest: oldest
                .into_sorted_vec()
                .into_iter()
                .map(|r| LongHeldPin {
                    session: r.session,
                    instance: self.instance(r.instance).id.clone(),
                    pins: r.pins,
                    held_for: r.held_for.0,
                })
                .collect(),
        }
    }

    /// The three totals the simulation compares after every event, read
    /// from the same fields [`Directory::stats`] reports (without building
    /// the rest of the snapshot or counting a call).
    pub fn totals(&self) -> DirectoryTotals {
        DirectoryTotals {
            keys: self.keys.len() as u64,
            pins: self.totals.pins,
            regions: self.regions.len() as u64,
        }
    }

    /// Bytes the sessions' pin ledgers hold (16 a bucket): bounded through
    /// `max_pinned_entries` (`DirectoryConfig`).
    pub fn pin_ledger_bytes(&self) -> u64 {
        self.totals.ledger_buckets * pin_ledger::BUCKET_BYTES
    }

    /// One key, read without a session and without touching anything (admin
    /// tools, tests, the simulation).
    pub fn inspect_key(&self, layout: &Layout, key: &[u8]) -> Option<KeyInfo> {
        let lix = self.layouts.get(layout)?;
        let es = self.keys.find(lix, key, self.keys.hash(lix, key))?;
        Some(KeyInfo {
            location: self.location_of(es),
            pins: self.keys.get(es).pins,
        })
    }

    /// The owner of one region, borrowed: `None` if the region is unknown
    /// or its owner is gone (what [`RegionInfo::owner`] says, without the
    /// copies [`Directory::inspect_region`] makes).
    pub fn region_owner(&self, region: RegionId) -> Option<&InstanceId> {
        let r = self.regions.get(self.regions.slot_of(region)?);
        match r.owner {
            Owner::Present(o) => Some(&self.instance(o).id),
            Owner::Gone { .. } => None,
        }
    }

    /// One region, read without touching anything.
    pub fn inspect_region(&self, region: RegionId) -> Option<RegionInfo> {
        let r = self.regions.get(self.regions.slot_of(region)?);
        Some(RegionInfo {
            descriptor: r.handle.descriptor(r.page_size_bytes),
            layout: self.layouts.layout(r.layout),
            owner: match r.owner {
                Owner::Present(o) => Some(self.instance(o).id.clone()),
                Owner::Gone { .. } => None,
            },
            owner_label: r.owner_id.clone(),
            keys: r.keys,
        })
    }

    /// Verifies every structural invariant (see the module docs).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        // Keys, their regions and pages.
        let mut live = 0usize;
        let mut per_region: HashMap<u32, u32, FixedState> = HashMap::default();
        let (mut page_bytes, mut value_bytes, mut key_bytes) = (0u64, 0u64, 0u64);
        // First: reading a key below relies on its record.
        self.keys.check_records().map_err(InvariantViolation)?;
        for (es, e) in self.keys.iter() {
            live += 1;
            ensure!(
                self.keys.find(
                    self.keys.layout(es),
                    self.keys.key(es),
                    self.keys.hash_of(es)
                ) == Some(es),
                "entry {es}: not found through the table under its hash"
            );
            let Some(region) = self.regions.try_get(e.region) else {
                return Err(InvariantViolation(format!(
                    "entry {es} points into freed region slot {}",
                    e.region
                )));
            };
            ensure!(
                region.layout == self.keys.layout(es),
                "entry {es}: layout differs from its region's"
            );
            ensure!(e.page < region.pages, "entry {es}: page beyond region");
            ensure!(
                region.page_states.is_registered(e.page),
                "entry {es}: its page is not marked registered"
            );
            ensure!(
                region.page_states.newest(e.page) == Some(e.generation),
                "entry {es}: its generation is not the page's newest"
            );
            ensure!(
                e.len_bytes >= 1 && u64::from(e.len_bytes) <= region.page_size_bytes,
                "entry {es}: length out of range"
            );
            *per_region.entry(e.region).or_default() += 1;
            page_bytes += region.page_size_bytes;
            value_bytes += u64::from(e.len_bytes);
            key_bytes += self.keys.key(es).len() as u64;
        }
        ensure!(
            live == self.keys.len(),
            "table holds {} keys, slab {live}",
            self.keys.len()
        );
        ensure!(
            page_bytes == self.totals.page_bytes,
            "page byte total drifted"
        );
        ensure!(
            value_bytes == self.totals.value_bytes,
            "value byte total drifted"
        );
        ensure!(key_bytes == self.totals.key_bytes, "key byte total drifted");

        // Layouts: held by exactly their regions and pending requests.
        self.layouts.consistent().map_err(InvariantViolation)?;
        let mut holders: HashMap<u32, u32, FixedState> = HashMap::default();
        let held = self.regions.iter().map(|(_, r)| r.layout);
        for ix in held.chain(self.pending.values().map(|p| p.layout_ix)) {
            *holders.entry(ix).or_default() += 1;
        }
        for (ix, layout, count) in self.layouts.iter() {
            ensure!(
                holders.remove(&ix) == Some(count),
                "layout {layout:?}: {count} holders counted, not its regions and requests"
            );
        }
        ensure!(
            holders.is_empty(),
            "a region or request holds a forgotten layout index"
        );

        // Regions.
        let (mut region_bytes, mut region_page_bytes) = (0u64, 0u64);
        for (rs, r) in self.regions.iter() {
            region_bytes += r.handle.len_bytes;
            region_page_bytes += u64::from(r.pages) * r.page_size_bytes;
            let counted = per_region.get(&rs).copied().unwrap_or(0);
            ensure!(
                r.keys == counted,
                "region {}: refcount {} but {counted} keys",
                r.handle.region,
                r.keys
            );
            ensure!(
                r.page_states.registered_count() == u64::from(r.keys),
                "region {}: registered pages differ from keys",
                r.handle.region
            );
            let (mut n, mut pinned) = (0u32, 0u32);
            let mut cur = r.key_head;
            while cur != NIL {
                ensure!(
                    self.keys.is_live(cur),
                    "region {}: list names a dead slot",
                    r.handle.region
                );
                ensure!(
                    self.keys.get(cur).region == rs,
                    "region {}: list names a foreign key",
                    r.handle.region
                );
                n += 1;
                pinned += u32::from(self.keys.get(cur).pins > 0);
                ensure!(
                    n <= r.keys,
                    "region {}: key list longer than refcount",
                    r.handle.region
                );
                cur = self.keys.get(cur).region_next;
            }
            ensure!(
                n == r.keys,
                "region {}: key list shorter than refcount",
                r.handle.region
            );
            ensure!(
                pinned == r.pinned_keys,
                "region {}: {} pinned keys counted, {pinned} in its list",
                r.handle.region,
                r.pinned_keys
            );
            match r.owner {
                Owner::Present(o) => {
                    let inst = self.instances.get(o as usize).and_then(|i| i.as_ref());
                    ensure!(
                        inst.is_some_and(|i| i.regions.contains(&rs) && i.id == r.owner_id),
                        "region {}: owner slot {o} does not list it",
                        r.handle.region
                    );
                    ensure!(
                        !r.orphan_queued,
                        "region {}: owner present, yet queued as an orphan",
                        r.handle.region
                    );
                }
                Owner::Gone { .. } => {
                    ensure!(
                        r.keys > 0,
                        "region {}: owner gone and no keys, yet not freed",
                        r.handle.region
                    );
                    let queued = self
                        .orphans
                        .iter()
                        .filter(|&&(s, id)| s == rs && id == r.handle.region)
                        .count();
                    ensure!(
                        queued == 1 && r.orphan_queued,
                        "region {}: orphan queued {queued} times (flag {})",
                        r.handle.region,
                        r.orphan_queued
                    );
                }
            }
        }
        self.regions.consistent().map_err(InvariantViolation)?;
        // Regions held unclaimed since a restart: each in one instance's
        // list, the index their union, none also a region record.
        let mut unclaimed = 0usize;
        for inst in self.instances.iter().flatten() {
            for h in &inst.unclaimed {
                unclaimed += 1;
                ensure!(
                    self.unclaimed.holds(h),
                    "region {} unclaimed by {} but not indexed",
                    h.region,
                    inst.id
                );
                ensure!(
                    self.regions.slot_of(h.region).is_none()
                        && self.regions.overlapping(h).is_none(),
                    "region {} unclaimed by {}: it, or a region sharing its bytes, is also recorded",
                    h.region,
                    inst.id
                );
            }
        }
        self.unclaimed
            .consistent(unclaimed)
            .map_err(InvariantViolation)?;
        ensure!(
            region_bytes == self.totals.region_bytes,
            "region byte total drifted"
        );
        ensure!(
            region_page_bytes == self.totals.region_page_bytes,
            "region page byte total drifted"
        );
        ensure!(
            self.scratch_counts.iter().all(|&c| c == 0),
            "notice room counts left set between calls"
        );
        let mut stale = 0;
        for &(rs, id) in &self.orphans {
            match self.regions.get_if(rs, id) {
                None => stale += 1,
                Some(r) => ensure!(
                    matches!(r.owner, Owner::Gone { .. }),
                    "orphan queue names region {id}, which is not an orphan"
                ),
            }
        }
        ensure!(
            stale == self.orphans_stale && stale <= self.orphans.len() / 2,
            "orphan queue: {stale} stale entries of {}, {} counted",
            self.orphans.len(),
            self.orphans_stale
        );

        // Pins.
        let mut pins_by_entry: HashMap<u32, u64, FixedState> = HashMap::default();
        let mut pin_total = 0u64;
        let (mut pin_entries, mut ledger_buckets) = (0u64, 0u64);
        for (sid, s) in &self.sessions {
            pin_entries += s.pins.len() as u64;
            ledger_buckets += s.pins.buckets() as u64;
            let mut sum = 0u64;
            for (es, held) in s.pins.iter() {
                ensure!(held.count > 0, "session {sid}: empty ledger entry");
                ensure!(
                    self.keys.is_live(es),
                    "session {sid}: pins a dead slot {es}"
                );
                *pins_by_entry.entry(es).or_default() += u64::from(held.count);
                sum += u64::from(held.count);
            }
            ensure!(sum == s.pin_total, "session {sid}: pin total drifted");
            pin_total += sum;
            let inst = self
                .instances
                .get(s.instance as usize)
                .and_then(|i| i.as_ref());
            ensure!(
                inst.is_some_and(|i| i.sessions.contains(sid)),
                "session {sid}: its instance does not list it"
            );
        }
        let mut pinned_keys = 0u64;
        for (es, e) in self.keys.iter() {
            let sum = pins_by_entry.get(&es).copied().unwrap_or(0);
            ensure!(
                u64::from(e.pins) == sum,
                "entry {es}: {} pins, sessions hold {sum}",
                e.pins
            );
            if e.pins > 0 {
                pinned_keys += 1;
            }
            if let Some(lru) = &self.lru {
                ensure!(
                    lru.is_linked(es) == (e.pins == 0),
                    "entry {es}: LRU membership wrong"
                );
            }
        }
        ensure!(pin_total == self.totals.pins, "pin total drifted");
        ensure!(
            pin_entries == self.totals.pin_entries,
            "pinned (session, key) pair count drifted"
        );
        ensure!(
            ledger_buckets == self.totals.ledger_buckets,
            "pin ledger bucket count drifted"
        );
        ensure!(
            pin_entries <= self.config.max_pinned_entries as u64,
            "{pin_entries} pinned (session, key) pairs, over the limit"
        );
        ensure!(
            pinned_keys == self.totals.pinned_keys,
            "pinned key count drifted"
        );
        if let Some(lru) = &self.lru {
            ensure!(
                lru.len() as u64 == live as u64 - pinned_keys,
                "LRU length wrong"
            );
            ensure!(
                lru.iter_from_least_recent().count() == lru.len(),
                "LRU list and count disagree"
            );
            ensure!(
                lru.resume().is_none_or(|s| lru.is_linked(s)),
                "LRU resume point names an unlinked slot"
            );
            ensure!(
                self.lru_evicting || lru.resume().is_none(),
                "LRU resume point set outside an eviction round"
            );
        }

        // Instances.
        ensure!(
            self.instance_ix.len() == self.instances.iter().flatten().count(),
            "instance index and slab disagree"
        );
        for (name, &slot) in &self.instance_ix {
            let Some(inst) = self.instances.get(slot as usize).and_then(|i| i.as_ref()) else {
                return Err(InvariantViolation(format!(
                    "instance {name}: dead slot {slot}"
                )));
            };
            ensure!(&inst.id == name, "instance {name}: slot holds {}", inst.id);
            ensure!(
                inst.absent_since.is_some() == inst.sessions.is_empty(),
                "instance {name}: absence and sessions disagree"
            );
            for sid in &inst.sessions {
                ensure!(
                    self.sessions.get(sid).is_some_and(|s| s.instance == slot),
                    "instance {name}: lists foreign session {sid}"
                );
            }
            let (mut owned, mut keys, mut used) = (0u64, 0u64, 0u64);
            for &rs in &inst.regions {
                let r = self.regions.get(rs);
                ensure!(
                    r.owner == Owner::Present(slot),
                    "instance {name}: lists a region it does not own"
                );
                owned += r.handle.len_bytes;
                keys += u64::from(r.keys);
                used += u64::from(r.keys) * r.page_size_bytes;
            }
            ensure!(
                owned == inst.owned_bytes,
                "instance {name}: owned bytes drifted"
            );
            ensure!(keys == inst.keys, "instance {name}: key count drifted");
            ensure!(
                used == inst.used_bytes,
                "instance {name}: used bytes drifted"
            );
            let pending: Vec<_> = self
                .pending
                .values()
                .filter(|p| p.instance == Some(slot))
                .collect();
            ensure!(
                pending.len() == inst.pending_requests,
                "instance {name}: pending count drifted"
            );
            ensure!(
                pending.iter().map(|p| p.len_bytes).sum::<u64>() == inst.pending_bytes,
                "instance {name}: pending bytes drifted"
            );
            let first = inst.notices.highest_issued() + 1 - inst.notices.pending() as u64;
            for (expect, n) in (first..).zip(inst.notices.iter()) {
                ensure!(
                    n.seq == expect,
                    "instance {name}: notice numbering has a gap"
                );
            }
        }
        Ok(())
    }

    /// A digest of the semantic state: keys and locations, pins per session,
    /// regions and page knowledge, instances (secrets, sessions, quotas,
    /// notices, executed and cached sequence numbers), pending requests, LRU
    /// and orphan order, id counters. Leaves out clocks (lease renewals) and
    /// statistics. Two directories built by the same steps from the same seed
    /// have equal digests; a refused request leaves it unchanged.
    pub fn state_digest(&self) -> u64 {
        let hs = FixedState::with_seed(0x5EED);
        let h = |f: &dyn Fn(&mut dyn Hasher)| {
            let mut hasher = hs.build_hasher();
            f(&mut hasher);
            mix(hasher.finish())
        };
        let mut acc = 0u64;
        let mut add = |x: u64| acc = acc.wrapping_add(x);
        for (es, e) in self.keys.iter() {
            let layout = self.layouts.layout(self.keys.layout(es));
            let region = self.regions.get(e.region).handle.region;
            add(h(&|s| {
                (
                    1u8,
                    es,
                    layout,
                    self.keys.key(es),
                    region,
                    e.page,
                    e.generation,
                    e.len_bytes,
                    e.pins,
                )
                    .hash(&mut HashWrap(s))
            }));
        }
        for (rs, r) in self.regions.iter() {
            let owner = match r.owner {
                Owner::Present(o) => Some(self.instance(o).id.clone()),
                Owner::Gone { .. } => None,
            };
            add(h(&|s| {
                (
                    2u8,
                    rs,
                    r.handle,
                    self.layouts.layout(r.layout),
                    &owner,
                    &r.owner_id,
                    r.keys,
                )
                    .hash(&mut HashWrap(s))
            }));
            add(mix(r.page_states.digest() ^ r.handle.region.0));
        }
        for (slot, inst) in self.instances.iter().enumerate() {
            let Some(inst) = inst else { continue };
            let mut sessions = inst.sessions.clone();
            sessions.sort_unstable();
            let executed: Vec<u64> = inst.replies.executed_seqs().collect();
            let cached: Vec<u64> = inst.replies.cached_seqs().collect();
            let notices: Vec<_> = inst.notices.iter().copied().collect();
            let mut regions = inst.regions.clone();
            regions.sort_unstable();
            add(h(&|s| {
                (
                    (3u8, slot, &inst.id),
                    (inst.secret.map(|x| x.0), inst.principal, &sessions),
                    inst.absent_since.is_some(),
                    inst.quota_bytes,
                    &regions,
                    &inst.unclaimed,
                    (inst.owned_bytes, inst.pending_bytes, inst.pending_requests),
                    (inst.keys, inst.used_bytes),
                    (inst.notices.highest_issued(), &notices),
                    (inst.replies.oldest_accepted(), &executed, &cached),
                )
                    .hash(&mut HashWrap(s))
            }));
        }
        for (sid, sess) in &self.sessions {
            let mut pins: Vec<(u32, u32)> = sess.pins.iter().map(|(k, v)| (k, v.count)).collect();
            pins.sort_unstable();
            add(h(&|s| {
                (4u8, sid, sess.instance, sess.pin_total, &pins).hash(&mut HashWrap(s))
            }));
        }
        for (req, p) in &self.pending {
            add(h(&|s| {
                (
                    5u8,
                    req,
                    p.instance,
                    &p.owner,
                    p.layout,
                    p.len_bytes,
                    p.seq,
                    &p.waiters,
                )
                    .hash(&mut HashWrap(s))
            }));
        }
        for sid in &self.ended {
            add(h(&|s| (6u8, sid).hash(&mut HashWrap(s))));
        }
        let lru: Vec<u32> = self
            .lru
            .as_ref()
            .map(|l| l.iter_from_least_recent().collect())
            .unwrap_or_default();
        let lru_resume = self.lru.as_ref().and_then(|l| l.resume());
        // Live entries only: where stale ones sit is not state.
        let orphans: Vec<_> = self
            .orphans
            .iter()
            .copied()
            .filter(|&(rs, id)| self.regions.get_if(rs, id).is_some())
            .collect();
        let layouts: Vec<_> = self.layouts.iter().collect();
        add(h(&|s| {
            (
                7u8,
                &layouts,
                (&lru, lru_resume),
                &orphans,
                self.next_session,
                self.next_deferred,
                self.next_pool_request,
            )
                .hash(&mut HashWrap(s))
        }));
        acc
    }
}

/// Adapts `&mut dyn Hasher` to the `Hasher` bound of `Hash::hash`.
struct HashWrap<'a>(&'a mut dyn Hasher);

impl Hasher for HashWrap<'_> {
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes)
    }
}
