//! Region records: who owns each region, which layout it serves, how many keys
//! point into it, and what the directory knows about each of its pages.
//!
//! Invariants (checked by `Directory::check_invariants`):
//! - `keys` equals the number of entries whose location names the region, and
//!   equals the length of its intrusive key list;
//! - a page is marked registered iff exactly one entry names it;
//! - a region whose owner is gone has `keys > 0` — the moment its last key
//!   goes, it is returned to the pool manager and its record removed. So no
//!   region is ever freed while a key points into it.

use std::collections::{BTreeMap, HashMap, HashSet};

use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};
use foldhash::fast::FixedState;

use super::error::RejectReason;
use super::keys::{NIL, mix};
use super::types::{InstanceId, RegionHandle, Time};

/// Whether a region's owner is still around.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Owned by the instance in this slot.
    Present(u32),
    /// The owner is gone; the region waits for its last key to be deleted.
    Gone { since: Time },
}

/// Per-page knowledge: the newest generation registered there, and whether a
/// key is registered there now. Zero-initialised allocations, so the pages of
/// a large region that were never registered cost no resident memory.
#[derive(Debug)]
pub(crate) struct PageStates {
    newest_generation: Vec<u32>,
    seen: Vec<u64>,
    registered: Vec<u64>,
}

/// Whether `generation` comes after `newest` in serial-number order (RFC
/// 1982 over `u32`). A page's generations count up from a random start and
/// wrap from `u32::MAX` to 1 (the allocator never issues 0), so a plain `>`
/// would refuse every registration of the page after the wrap, for good.
/// Up to 2^31 − 1 steps ahead is newer; a page is not registered that many
/// times between two of its registrations the directory sees.
pub(crate) fn is_newer(generation: u32, newest: u32) -> bool {
    (generation.wrapping_sub(newest) as i32) > 0
}

fn bit(page: u32) -> (usize, u64) {
    ((page / 64) as usize, 1u64 << (page % 64))
}

impl PageStates {
    fn new(pages: u32) -> Self {
        let words = (pages as usize).div_ceil(64);
        Self {
            newest_generation: vec![0; pages as usize],
            seen: vec![0; words],
            registered: vec![0; words],
        }
    }

    pub fn is_registered(&self, page: u32) -> bool {
        let (w, m) = bit(page);
        self.registered[w] & m != 0
    }

    /// Whether `(page, generation)` may be registered now.
    pub fn check(&self, page: u32, generation: u32) -> Result<(), RejectReason> {
        let (w, m) = bit(page);
        if self.registered[w] & m != 0 {
            return Err(RejectReason::PageInUse {
                page: PageIndex(page),
            });
        }
        let newest = self.newest_generation[page as usize];
        // 0 is never issued; taken as newer than a generation 2^31 or more
        // away, it would block the page until its generations came round.
        if generation == 0 || (self.seen[w] & m != 0 && !is_newer(generation, newest)) {
            return Err(RejectReason::StaleGeneration {
                generation: Generation(generation),
                newest_seen: Generation(newest),
            });
        }
        Ok(())
    }

    /// The newest generation registered on `page`, if any ever was.
    pub fn newest(&self, page: u32) -> Option<u32> {
        let (w, m) = bit(page);
        (self.seen[w] & m != 0).then(|| self.newest_generation[page as usize])
    }

    pub fn register(&mut self, page: u32, generation: u32) {
        let (w, m) = bit(page);
        debug_assert!(self.registered[w] & m == 0);
        self.registered[w] |= m;
        self.seen[w] |= m;
        self.newest_generation[page as usize] = generation;
    }

    pub fn release(&mut self, page: u32) {
        let (w, m) = bit(page);
        debug_assert!(self.registered[w] & m != 0);
        self.registered[w] &= !m;
    }

    pub fn registered_count(&self) -> u64 {
        self.registered
            .iter()
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    /// A digest of the page knowledge (for `Directory::state_digest`).
    pub fn digest(&self) -> u64 {
        let mut acc = 0u64;
        for (i, (&s, &r)) in self.seen.iter().zip(&self.registered).enumerate() {
            let mut bits = s;
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                let page = i as u64 * 64 + u64::from(b);
                let g = u64::from(self.newest_generation[page as usize]);
                let reg = (r >> b) & 1;
                acc = acc.wrapping_add(mix(page ^ (g << 24) ^ (reg << 63)));
            }
        }
        acc
    }
}

#[derive(Debug)]
pub(crate) struct Region {
    pub handle: RegionHandle,
    pub layout: u32,
    pub page_size_bytes: u64,
    pub pages: u32,
    pub owner: Owner,
    /// The owner label (kept after the owner is gone, for the free).
    pub owner_id: InstanceId,
    pub keys: u32,
    /// Its keys with at least one pin. Orphan eviction passes a region
    /// while any is pinned: its bytes cannot go back to the pool before the
    /// pin does, so evicting its other keys would lose readable data and
    /// free nothing (and walking them would cost a tick the whole list).
    pub pinned_keys: u32,
    /// It has an entry in the directory's orphan queue (its owner is gone
    /// and eviction has not taken it out to work on it).
    pub orphan_queued: bool,
    /// Head of the intrusive list of its keys.
    pub key_head: u32,
    /// Last lookup that listed this region (dedupes descriptors per reply).
    pub stamp: u64,
    pub page_states: PageStates,
}

impl Region {
    pub fn new(
        handle: RegionHandle,
        layout: u32,
        page_size_bytes: u64,
        owner: u32,
        owner_id: InstanceId,
    ) -> Self {
        let pages = u32::try_from(handle.len_bytes / page_size_bytes).unwrap_or(u32::MAX);
        Self {
            handle,
            layout,
            page_size_bytes,
            pages,
            owner: Owner::Present(owner),
            owner_id,
            keys: 0,
            pinned_keys: 0,
            orphan_queued: false,
            key_head: NIL,
            stamp: 0,
            page_states: PageStates::new(pages),
        }
    }
}

/// The byte ranges of a set of regions in their pools, to find the one a
/// new range overlaps. Ranges held never overlap each other (a grant that
/// would is refused), so the range starting last before a new range's end
/// is the only one that can overlap it.
#[derive(Debug, Default)]
pub(crate) struct Extents(BTreeMap<(PoolId, u64, RegionId), u64>);

impl Extents {
    pub fn insert(&mut self, h: &RegionHandle) {
        self.0
            .insert((h.pool, h.offset_bytes, h.region), h.len_bytes);
    }

    pub fn remove(&mut self, h: &RegionHandle) {
        self.0.remove(&(h.pool, h.offset_bytes, h.region));
    }

    /// A region whose range overlaps `h`'s (another id, or `h`'s own).
    pub fn overlapping(&self, h: &RegionHandle) -> Option<RegionId> {
        let end = h.offset_bytes.saturating_add(h.len_bytes);
        let (&(pool, start, id), &len) = self.0.range(..(h.pool, end, RegionId(0))).next_back()?;
        (pool == h.pool && h.len_bytes > 0 && start.saturating_add(len) > h.offset_bytes)
            .then_some(id)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `h`'s range is held under its id.
    pub fn holds(&self, h: &RegionHandle) -> bool {
        self.0.get(&(h.pool, h.offset_bytes, h.region)) == Some(&h.len_bytes)
    }

    /// No two ranges overlap (for `check_invariants`).
    pub fn disjoint(&self) -> Result<(), String> {
        let mut prev: Option<(PoolId, u64, RegionId)> = None;
        for (&(pool, start, id), &len) in &self.0 {
            if let Some((p, end, other)) = prev
                && p == pool
                && end > start
            {
                return Err(format!("regions {other} and {id} overlap in pool {pool:?}"));
            }
            prev = Some((pool, start.saturating_add(len), id));
        }
        Ok(())
    }
}

/// The regions instances hold unclaimed after a restart (the union of
/// their `unclaimed` lists), by id and by byte range: a grant of one of
/// these ids, or overlapping one of these ranges, is refused.
#[derive(Debug)]
pub(crate) struct Unclaimed {
    ids: HashSet<RegionId, FixedState>,
    extents: Extents,
}

impl Unclaimed {
    pub fn new(seed: u64) -> Self {
        Self {
            ids: HashSet::with_hasher(FixedState::with_seed(seed)),
            extents: Extents::default(),
        }
    }

    /// Adds `h`; false (nothing added) when its id is held already.
    pub fn insert(&mut self, h: &RegionHandle) -> bool {
        let added = self.ids.insert(h.region);
        if added {
            self.extents.insert(h);
        }
        added
    }

    pub fn remove(&mut self, h: &RegionHandle) {
        self.ids.remove(&h.region);
        self.extents.remove(h);
    }

    pub fn contains(&self, id: RegionId) -> bool {
        self.ids.contains(&id)
    }

    /// A region held whose byte range overlaps `h`'s.
    pub fn overlapping(&self, h: &RegionHandle) -> Option<RegionId> {
        self.extents.overlapping(h)
    }

    /// Whether `h` is held, by its id and its range.
    pub fn holds(&self, h: &RegionHandle) -> bool {
        self.ids.contains(&h.region) && self.extents.holds(h)
    }

    /// Exactly `count` regions are held, by id and by range, and no two
    /// ranges overlap (for `check_invariants`).
    pub fn consistent(&self, count: usize) -> Result<(), String> {
        if self.ids.len() != count || self.extents.len() != count {
            return Err(format!(
                "{} unclaimed ids and {} ranges indexed, {count} in the instances' lists",
                self.ids.len(),
                self.extents.len()
            ));
        }
        self.extents.disjoint()
    }
}

#[derive(Debug)]
pub(crate) struct RegionTable {
    slots: Vec<Option<Region>>,
    free: Vec<u32>,
    by_id: HashMap<RegionId, u32, FixedState>,
    extents: Extents,
}

impl RegionTable {
    pub fn new(seed: u64) -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::with_hasher(FixedState::with_seed(seed)),
            extents: Extents::default(),
        }
    }

    pub fn insert(&mut self, region: Region) -> u32 {
        let id = region.handle.region;
        debug_assert!(!self.by_id.contains_key(&id));
        self.extents.insert(&region.handle);
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(region);
                slot
            }
            None => {
                self.slots.push(Some(region));
                u32::try_from(self.slots.len() - 1)
                    .expect("invariant: region count is bounded far below u32::MAX")
            }
        };
        self.by_id.insert(id, slot);
        slot
    }

    pub fn remove(&mut self, slot: u32) -> Region {
        let region = self.slots[slot as usize]
            .take()
            .expect("invariant: removing a live region slot");
        self.by_id.remove(&region.handle.region);
        self.extents.remove(&region.handle);
        self.free.push(slot);
        region
    }

    pub fn slot_of(&self, id: RegionId) -> Option<u32> {
        self.by_id.get(&id).copied()
    }

    /// A recorded region whose byte range overlaps `h`'s.
    pub fn overlapping(&self, h: &RegionHandle) -> Option<RegionId> {
        self.extents.overlapping(h)
    }

    #[inline]
    pub fn get(&self, slot: u32) -> &Region {
        self.slots[slot as usize]
            .as_ref()
            .expect("invariant: slot names a live region")
    }

    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Region {
        self.slots[slot as usize]
            .as_mut()
            .expect("invariant: slot names a live region")
    }

    /// The region in `slot`, if the slot is live.
    pub fn try_get(&self, slot: u32) -> Option<&Region> {
        self.slots.get(slot as usize).and_then(|r| r.as_ref())
    }

    /// The region in `slot`, if that slot still holds region `id`.
    pub fn get_if(&self, slot: u32, id: RegionId) -> Option<&Region> {
        self.slots
            .get(slot as usize)
            .and_then(|r| r.as_ref())
            .filter(|r| r.handle.region == id)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The id and extent indexes name exactly the live slots, each by its
    /// region's id and range, no two ranges overlap, and the free list names
    /// exactly the empty slots (for `check_invariants`).
    pub fn consistent(&self) -> Result<(), String> {
        let mut live = 0usize;
        for (slot, r) in self.iter() {
            live += 1;
            if self.by_id.get(&r.handle.region) != Some(&slot) || !self.extents.holds(&r.handle) {
                return Err(format!(
                    "region {} in slot {slot} is not indexed there",
                    r.handle.region
                ));
            }
        }
        if live != self.by_id.len() || live != self.extents.len() {
            return Err(format!(
                "{} region ids and {} extents indexed, {live} live slots",
                self.by_id.len(),
                self.extents.len()
            ));
        }
        self.extents.disjoint()?;
        let empty = self.slots.len() - live;
        let mut free = self.free.clone();
        free.sort_unstable();
        free.dedup();
        let free_ok = free.len() == empty
            && self.free.len() == empty
            && free
                .iter()
                .all(|&s| self.slots.get(s as usize).is_some_and(Option::is_none));
        if !free_ok {
            return Err(format!(
                "free list of {} slots, {empty} empty",
                self.free.len()
            ));
        }
        Ok(())
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &Region)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i as u32, r)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(id: u64, pool: u32, offset_bytes: u64, len_bytes: u64) -> RegionHandle {
        RegionHandle {
            region: RegionId(id),
            pool: PoolId(pool),
            offset_bytes,
            len_bytes,
            token: super::super::types::RegionToken([0; 32]),
        }
    }

    /// Every way a range can meet the held ones: before, after, touching,
    /// inside, around, across two, in another pool, empty.
    #[test]
    fn an_extent_overlaps_exactly_the_held_ranges_it_shares_a_byte_with() {
        let mut e = Extents::default();
        e.insert(&range(1, 0, 100, 50)); // [100, 150)
        e.insert(&range(2, 0, 200, 50)); // [200, 250)
        e.insert(&range(3, 1, 0, 1000)); // pool 1
        let hit = |o, l| e.overlapping(&range(9, 0, o, l)).map(|id| id.0);
        assert_eq!(hit(0, 100), None, "ends where 1 starts");
        assert_eq!(hit(150, 50), None, "between 1 and 2, touching both");
        assert_eq!(hit(250, 10), None, "after 2");
        assert_eq!(hit(149, 1), Some(1), "1's last byte");
        assert_eq!(hit(120, 10), Some(1), "inside 1");
        assert_eq!(hit(50, 300), Some(2), "around both: the later one");
        assert_eq!(hit(140, 70), Some(2), "across both");
        assert_eq!(hit(199, 1), None, "the byte before 2");
        assert_eq!(hit(120, 0), None, "an empty range overlaps nothing");
        assert_eq!(e.overlapping(&range(9, 2, 100, 50)), None, "another pool");
        assert_eq!(e.disjoint(), Ok(()));
        e.insert(&range(4, 0, 140, 20));
        assert!(e.disjoint().is_err(), "4 overlaps 1");
        e.remove(&range(4, 0, 140, 20));
        assert!(!e.holds(&range(4, 0, 140, 20)) && e.holds(&range(1, 0, 100, 50)));
        assert_eq!(e.len(), 3);
    }

    #[test]
    fn a_page_takes_only_newer_generations_and_one_key_at_a_time() {
        let mut p = PageStates::new(100);
        assert_eq!(p.check(70, 1), Ok(()));
        assert!(
            matches!(p.check(70, 0), Err(RejectReason::StaleGeneration { .. })),
            "0 is never a generation"
        );
        p.register(70, 5);
        assert!(matches!(
            p.check(70, 6),
            Err(RejectReason::PageInUse { .. })
        ));
        p.release(70);
        assert!(matches!(
            p.check(70, 5),
            Err(RejectReason::StaleGeneration { .. })
        ));
        assert!(matches!(
            p.check(70, 4),
            Err(RejectReason::StaleGeneration { .. })
        ));
        assert_eq!(p.check(70, 6), Ok(()));
        assert_eq!(p.check(71, 1), Ok(()), "other pages are unaffected");
    }

    /// The allocator's generations wrap from `u32::MAX` to 1: the page
    /// registers again after the wrap, and an older generation from before
    /// it is still refused.
    #[test]
    fn a_page_registers_again_after_its_generation_wraps() {
        let mut p = PageStates::new(1);
        p.register(0, u32::MAX - 1);
        p.release(0);
        assert_eq!(p.check(0, u32::MAX), Ok(()));
        p.register(0, u32::MAX);
        p.release(0);
        assert_eq!(p.check(0, 1), Ok(()), "the generation after u32::MAX");
        p.register(0, 1);
        p.release(0);
        for stale in [u32::MAX, u32::MAX - 1, 1] {
            assert!(
                matches!(p.check(0, stale), Err(RejectReason::StaleGeneration { .. })),
                "{stale}"
            );
        }
        assert_eq!(p.check(0, 2), Ok(()));
    }
}
