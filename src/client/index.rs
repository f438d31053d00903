//! The keys this instance registered and that still exist, by location.
//!
//! After a directory restart the instance registers its keys again (DESIGN
//! §4, §8): this index is what it registers. It is keyed by location
//! `(region, page)` rather than by key because the event that removes an
//! entry — a freed-page notice, after anyone deleted the key — names a
//! location, and a page holds at most one key. Per entry: the key bytes, the
//! layout, the generation and the length (≈ key + 56 bytes).
//!
//! **The race with notices.** A notice can overtake the reply of the
//! `Register` that put its key in place (the reply was lost and the key
//! deleted before the retry). Both paths therefore run under the page's
//! shard lock: a notice removes the entry of its generation and frees the
//! page; a register reply records `Inserted` only if the page is still
//! allocated at the registered generation. Whichever comes second sees what
//! the first did, so the index never names a page the allocator has handed
//! out again.

use std::collections::HashMap;

use parking_lot::Mutex;

use cxlkv_controlplane::proto::Location;

const SHARDS: usize = 16;

#[derive(Debug)]
struct Entry {
    layout_ix: u32,
    generation: u32,
    len_bytes: u32,
    key: Box<[u8]>,
}

/// One registered key, as re-registration needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IndexedKey {
    pub layout_ix: u32,
    pub key: Vec<u8>,
    pub location: Location,
}

/// One shard: `(region, page)` → the key registered there.
type Shard = Mutex<HashMap<(u64, u32), Entry>>;

#[derive(Debug)]
pub(crate) struct KeyIndex {
    shards: Box<[Shard]>,
}

impl Default for KeyIndex {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }
}

impl KeyIndex {
    fn shard(&self, region: u64, page: u32) -> &Shard {
        let h = region
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(page));
        &self.shards[(h >> 59) as usize % SHARDS]
    }

    /// Records a key the directory answered `Inserted` for, unless
    /// `still_allocated` says the page was freed meanwhile (a notice overtook
    /// the reply). Returns whether it was recorded.
    pub fn record_inserted(
        &self,
        layout_ix: u32,
        key: &[u8],
        location: Location,
        still_allocated: impl FnOnce() -> bool,
    ) -> bool {
        let mut shard = self.shard(location.region, location.page).lock();
        if !still_allocated() {
            return false;
        }
        shard.insert(
            (location.region, location.page),
            Entry {
                layout_ix,
                generation: location.generation,
                len_bytes: location.len_bytes,
                key: key.into(),
            },
        );
        true
    }

    /// Applies a freed-page notice: forgets the key at `(region, page)` if it
    /// was registered at `generation`, and runs `free` under the same lock
    /// (see the module docs). Returns whether an entry was removed.
    pub fn forget_freed(
        &self,
        region: u64,
        page: u32,
        generation: u32,
        free: impl FnOnce(),
    ) -> bool {
        let mut shard = self.shard(region, page).lock();
        let removed = match shard.get(&(region, page)) {
            Some(e) if e.generation == generation => {
                shard.remove(&(region, page));
                true
            }
            _ => false,
        };
        free();
        removed
    }

    /// Forgets every key in `region` (refused or lost with a directory
    /// restart); returns how many.
    pub fn forget_region(&self, region: u64) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock();
                let before = s.len();
                s.retain(|(r, _), _| *r != region);
                before - s.len()
            })
            .sum()
    }

    /// Every recorded key (a copy: re-registration sends them in batches
    /// while notices keep arriving).
    pub fn snapshot(&self) -> Vec<IndexedKey> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            for (&(region, page), e) in s.lock().iter() {
                out.push(IndexedKey {
                    layout_ix: e.layout_ix,
                    key: e.key.to_vec(),
                    location: Location {
                        region,
                        page,
                        generation: e.generation,
                        len_bytes: e.len_bytes,
                    },
                });
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(region: u64, page: u32, generation: u32) -> Location {
        Location {
            region,
            page,
            generation,
            len_bytes: 100,
        }
    }

    #[test]
    fn a_notice_removes_only_the_generation_it_names_and_always_runs_the_free() {
        let index = KeyIndex::default();
        assert!(index.record_inserted(0, b"k", loc(1, 2, 5), || true));
        let mut freed = 0;
        assert!(!index.forget_freed(1, 2, 4, || freed += 1));
        assert_eq!(index.len(), 1);
        assert!(index.forget_freed(1, 2, 5, || freed += 1));
        assert_eq!(index.len(), 0);
        assert_eq!(freed, 2, "the allocator decides about stale frees");
    }

    #[test]
    fn a_reply_after_its_notice_does_not_record_the_key() {
        let index = KeyIndex::default();
        assert!(!index.record_inserted(0, b"k", loc(1, 2, 5), || false));
        assert_eq!(index.len(), 0);
    }

    #[test]
    fn snapshot_and_region_forgetting_see_every_shard() {
        let index = KeyIndex::default();
        for r in 0..50u64 {
            for p in 0..4u32 {
                let key = format!("k{r}-{p}");
                index.record_inserted(1, key.as_bytes(), loc(r, p, 1), || true);
            }
        }
        assert_eq!(index.snapshot().len(), 200);
        assert_eq!(index.forget_region(7), 4);
        assert_eq!(index.len(), 196);
        let snap = index.snapshot();
        assert!(snap.iter().all(|k| k.location.region != 7));
        let k = snap
            .iter()
            .find(|k| k.location.region == 9 && k.location.page == 3)
            .unwrap();
        assert_eq!(k.key, b"k9-3");
        assert_eq!(k.layout_ix, 1);
    }
}
