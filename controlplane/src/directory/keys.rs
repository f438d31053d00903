//! The key index: `(layout, key) → entry`, the directory's hot path.
//!
//! Entries live in a slab (`Vec<Option<Entry>>`, slots reused through a free
//! list) and are named everywhere by their `u32` slot. A SwissTable
//! ([`hashbrown::HashTable`]) holds only slots; the key bytes are stored once,
//! in the entry (a `Box<[u8]>`: one allocation of exactly the key's length).
//! A probe is one hash of the key, one table probe, and one comparison of the
//! cached 32-bit hash before the key bytes are compared.
//!
//! The hash is foldhash keyed with seeds drawn from the directory's random
//! source at start: a peer cannot predict which keys collide without
//! recovering the seed, so it cannot cheaply build a colliding key set.
//! Table hashes are derived from the 32-bit hash cached in each entry, so a
//! table resize rehashes from the entries without reading a key.
//!
//! Memory (checked by `cxlkv bench directory-memory`): 56 bytes of entry, the
//! allocator's header and rounding on the key box (about 12 bytes for a 100-byte
//! key), and 5 bytes per table bucket at a load of 44–88 %.

use std::hash::Hasher;

use foldhash::SharedSeed;
use foldhash::fast::FoldHasher;
use hashbrown::HashTable;

/// A cheap bijective integer mixer (splitmix64's finaliser).
#[inline]
pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// "No slot": ends an intrusive list.
pub(crate) const NIL: u32 = u32::MAX;
/// `find_batch`'s mark for a key whose first candidate bucket is not it
/// (slots stay below `MAX_KEYS_CEILING`, so it names none).
const RETRY: u32 = u32::MAX - 1;
const _: () = assert!(super::config::MAX_KEYS_CEILING <= RETRY as usize);

/// Keys [`KeyIndex::find_batch`] has in flight: enough misses to overlap,
/// few enough that their lines stay in L1 until used (64 keys touch ~320
/// lines, 20 KiB). Measured in one process, windows alternating call by
/// call over 512-key calls (`docs/benchmarks.md`, session 9): windows of
/// 16, 32, 64 and 128 keys took 100, 92, 90 and 89 % of the time with
/// 64 Ki keys registered, 100, 89, 85 and 84 % with 1 Mi.
const FIND_WINDOW: usize = 64;

/// Asks the CPU to start loading the cache line at `p` (a hint: no effect
/// on what the program computes, and no fault for any address).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and changes no program state, whatever
    // the address; SSE (which provides it) is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One registered key.
#[derive(Debug)]
pub(crate) struct Entry {
    pub key: Box<[u8]>,
    /// Slot of the region in the region table.
    pub region: u32,
    pub page: u32,
    pub generation: u32,
    pub len_bytes: u32,
    /// Interned layout index.
    pub layout: u32,
    /// Cached key hash (see the module docs).
    pub hash: u32,
    /// Pins summed over all sessions (each session's share is in its ledger).
    pub pins: u32,
    /// Intrusive list of the keys registered in the same region.
    pub region_prev: u32,
    pub region_next: u32,
}

const _: () = assert!(
    std::mem::size_of::<Option<Entry>>() == 56,
    "entry layout grew: check the memory budget (bench directory-memory)"
);

/// Spreads a 32-bit hash over the 64 bits hashbrown reads (low bits pick the
/// bucket, the top 7 bits are the control tag). Multiplication by an odd
/// constant is a bijection, so distinct 32-bit hashes stay distinct.
#[inline]
fn table_hash(h: u32) -> u64 {
    u64::from(h).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[derive(Debug)]
pub(crate) struct KeyIndex {
    table: HashTable<u32>,
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    shared_seed: SharedSeed,
    per_hasher_seed: u64,
}

impl KeyIndex {
    pub fn new(seed: [u64; 2]) -> Self {
        Self {
            table: HashTable::new(),
            entries: Vec::new(),
            free: Vec::new(),
            shared_seed: SharedSeed::from_u64(seed[0]),
            per_hasher_seed: seed[1],
        }
    }

    /// The keyed hash of a key's bytes. It does not depend on the layout, so
    /// request fingerprints (which must not change when a layout is first
    /// used) are built from it too.
    #[inline]
    pub fn key_hash(&self, key: &[u8]) -> u64 {
        let mut h = FoldHasher::with_seed(self.per_hasher_seed, &self.shared_seed);
        h.write(key);
        h.finish()
    }

    /// The entry hash of `(layout, key)`, from the key's hash: the layout
    /// folded in, then one 64×64→128-bit multiply whose halves are XORed
    /// (foldhash's own mixing step), folded to 32 bits.
    ///
    /// One multiply, not splitmix64's two with their shifts: this ran on
    /// every key of every batch, and the shorter chain took 7–9 % off an
    /// in-process 512-key `exists` (9.7–9.8 → 8.8–8.9 µs with 1 Ki keys,
    /// 12.4–12.6 → 11.7–11.9 µs with 64 Ki; `examples/directory_batch`,
    /// `docs/benchmarks.md`, session 11). The key hash is keyed and already
    /// mixed; this step only has to spread the layout over every bit.
    #[inline]
    pub fn entry_hash(key_hash: u64, layout: u32) -> u32 {
        let x = key_hash ^ (u64::from(layout) + 1).wrapping_mul(0xA076_1D64_78BD_642F);
        let m = u128::from(x) * 0x9E37_79B9_7F4A_7C15;
        let h = (m as u64) ^ ((m >> 64) as u64);
        (h ^ (h >> 32)) as u32
    }

    /// The entry hash of `(layout, key)`.
    #[inline]
    pub fn hash(&self, layout: u32, key: &[u8]) -> u32 {
        Self::entry_hash(self.key_hash(key), layout)
    }

    /// The slot of `(layout, key)`, whose hash is `hash`.
    #[inline]
    pub fn find(&self, layout: u32, key: &[u8], hash: u32) -> Option<u32> {
        let entries = &self.entries;
        self.table
            .find(table_hash(hash), |&slot| match &entries[slot as usize] {
                Some(e) => e.hash == hash && e.layout == layout && *e.key == *key,
                None => false,
            })
            .copied()
    }

    /// [`find`](Self::find) for a batch of keys of one layout (`hashes[i]`
    /// is key `i`'s hash): pushes each key's slot, or [`NIL`], onto `out`
    /// (cleared first). The same answers, in four passes so that the cache
    /// misses of a batch overlap instead of following one another: each
    /// key's first candidate bucket (control bytes), its slot number
    /// prefetched; the slot numbers read, each entry prefetched; the cached
    /// hashes checked, the key bytes prefetched; the key bytes compared. A
    /// key whose first candidate is not it (a 7-bit tag collision) takes the
    /// plain `find`.
    ///
    /// Why: a key costs several dependent cache misses (control bytes, slot
    /// number, entry, key bytes) once the index outgrows the caches and
    /// requests come in another order than registrations; one key after
    /// another they dominated `exists` and `lookup`. The slot number's miss
    /// was the hottest instruction of the server's batched probe until it
    /// got a pass of its own (`docs/benchmarks.md`, session 8).
    pub fn find_batch<'k>(
        &self,
        layout: u32,
        mut keys: impl Iterator<Item = &'k [u8]>,
        hashes: &[u32],
        out: &mut Vec<u32>,
    ) {
        out.clear();
        for hs in hashes.chunks(FIND_WINDOW) {
            let base = out.len();
            // The first bucket with each key's tag (what `find` would
            // compare first): the table's control bytes say which, and the
            // slot number it holds is prefetched, not read (the closure
            // ignores it), so that these misses overlap too.
            let mut first: [Option<&u32>; FIND_WINDOW] = [None; FIND_WINDOW];
            for (f, &h) in first.iter_mut().zip(hs) {
                *f = self.table.find(table_hash(h), |_| true);
                if let Some(slot) = *f {
                    prefetch(slot);
                }
            }
            // The slot numbers, each one's entry prefetched.
            for f in &first[..hs.len()] {
                let c = f.copied().unwrap_or(NIL);
                if c != NIL {
                    prefetch(&self.entries[c as usize]);
                }
                out.push(c);
            }
            for (c, &h) in out[base..].iter_mut().zip(hs) {
                if *c == NIL {
                    continue;
                }
                match &self.entries[*c as usize] {
                    Some(e) if e.hash == h && e.layout == layout => {
                        // A key spans up to `MAX_KEY_BYTES`: its first and
                        // last lines (the middle ones of the longest keys
                        // follow by the hardware's own prefetch).
                        prefetch(e.key.as_ptr());
                        prefetch(e.key.as_ptr().wrapping_add(e.key.len().saturating_sub(1)));
                    }
                    _ => *c = RETRY,
                }
            }
            for (c, &h) in out[base..].iter_mut().zip(hs) {
                let Some(key) = keys.next() else {
                    debug_assert!(false, "one key per hash");
                    return;
                };
                let retry = match *c {
                    NIL => false,
                    RETRY => true,
                    slot => *self.get(slot).key != *key,
                };
                if retry {
                    *c = self.find(layout, key, h).unwrap_or(NIL);
                }
            }
        }
    }

    /// Inserts an entry whose `(layout, key)` is known to be absent.
    pub fn insert(&mut self, entry: Entry) -> u32 {
        debug_assert!(self.find(entry.layout, &entry.key, entry.hash).is_none());
        let hash = entry.hash;
        let slot = match self.free.pop() {
            Some(slot) => {
                debug_assert!(self.entries[slot as usize].is_none());
                self.entries[slot as usize] = Some(entry);
                slot
            }
            None => {
                let slot = u32::try_from(self.entries.len())
                    .expect("invariant: max_keys keeps slots below u32::MAX");
                self.entries.push(Some(entry));
                slot
            }
        };
        let entries = &self.entries;
        self.table.insert_unique(table_hash(hash), slot, |&s| {
            table_hash(
                entries[s as usize]
                    .as_ref()
                    .expect("invariant: the table names live slots only")
                    .hash,
            )
        });
        slot
    }

    /// Removes the entry in `slot` from the table and the slab.
    pub fn remove(&mut self, slot: u32) -> Entry {
        let hash = self.get(slot).hash;
        match self.table.find_entry(table_hash(hash), |&s| s == slot) {
            Ok(found) => {
                found.remove();
            }
            Err(_) => unreachable!("invariant: every live slot is in the table"),
        }
        let entry = self.entries[slot as usize]
            .take()
            .expect("invariant: removing a live slot");
        self.free.push(slot);
        entry
    }

    #[inline]
    pub fn get(&self, slot: u32) -> &Entry {
        self.entries[slot as usize]
            .as_ref()
            .expect("invariant: slot names a live entry")
    }

    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Entry {
        self.entries[slot as usize]
            .as_mut()
            .expect("invariant: slot names a live entry")
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether `slot` holds a live entry.
    #[inline]
    pub fn is_live(&self, slot: u32) -> bool {
        self.entries.get(slot as usize).is_some_and(Option::is_some)
    }

    /// Every live entry with its slot, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Entry)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.as_ref().map(|e| (slot as u32, e)))
    }

    /// Appends `slot` to the front of a region's key list whose head is
    /// `*head`.
    pub fn region_list_push(&mut self, head: &mut u32, slot: u32) {
        let old = *head;
        {
            let e = self.get_mut(slot);
            e.region_prev = NIL;
            e.region_next = old;
        }
        if old != NIL {
            self.get_mut(old).region_prev = slot;
        }
        *head = slot;
    }

    /// Unlinks `slot` from its region's key list whose head is `*head`.
    pub fn region_list_unlink(&mut self, head: &mut u32, slot: u32) {
        let (prev, next) = {
            let e = self.get(slot);
            (e.region_prev, e.region_next)
        };
        if prev == NIL {
            debug_assert_eq!(*head, slot);
            *head = next;
        } else {
            self.get_mut(prev).region_next = next;
        }
        if next != NIL {
            self.get_mut(next).region_prev = prev;
        }
        let e = self.get_mut(slot);
        e.region_prev = NIL;
        e.region_next = NIL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ix: &KeyIndex, layout: u32, key: &[u8]) -> Entry {
        Entry {
            key: key.into(),
            region: 0,
            page: 0,
            generation: 0,
            len_bytes: 1,
            layout,
            hash: ix.hash(layout, key),
            pins: 0,
            region_prev: NIL,
            region_next: NIL,
        }
    }

    #[test]
    fn the_same_key_under_two_layouts_is_two_keys() {
        let mut ix = KeyIndex::new([1, 2]);
        let a = ix.insert(entry(&ix, 0, b"k"));
        let b = ix.insert(entry(&ix, 1, b"k"));
        assert_ne!(a, b);
        assert_eq!(ix.find(0, b"k", ix.hash(0, b"k")), Some(a));
        assert_eq!(ix.find(1, b"k", ix.hash(1, b"k")), Some(b));
        assert_eq!(ix.find(2, b"k", ix.hash(2, b"k")), None);
    }

    #[test]
    fn removed_slots_are_reused_and_survive_table_growth() {
        let mut ix = KeyIndex::new([3, 4]);
        let keys: Vec<Vec<u8>> = (0..10_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let slots: Vec<u32> = keys.iter().map(|k| ix.insert(entry(&ix, 0, k))).collect();
        for (k, &s) in keys.iter().zip(&slots).step_by(2) {
            assert_eq!(&*ix.remove(s).key, k.as_slice());
        }
        assert_eq!(ix.len(), 5_000);
        let again = ix.insert(entry(&ix, 0, b"new"));
        assert!(slots.contains(&again), "a freed slot is reused");
        for (i, k) in keys.iter().enumerate() {
            let found = ix.find(0, k, ix.hash(0, k));
            assert_eq!(found.is_some(), i % 2 == 1, "key {i}");
        }
    }

    #[test]
    fn a_batch_find_answers_as_find_does() {
        let mut ix = KeyIndex::new([5, 6]);
        let keys: Vec<Vec<u8>> = (0..20_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        for k in keys.iter().step_by(2) {
            ix.insert(entry(&ix, 0, k));
        }
        ix.insert(entry(&ix, 1, &keys[1]));
        // Present, absent, and another layout's keys, mixed; batches of
        // every length around the window.
        for layout in [0, 1, 2] {
            let hashes: Vec<u32> = keys.iter().map(|k| ix.hash(layout, k)).collect();
            let w = FIND_WINDOW;
            for len in [0, 1, w - 1, w, w + 1, 2 * w + 1, keys.len()] {
                let mut out = Vec::new();
                ix.find_batch(
                    layout,
                    keys[..len].iter().map(Vec::as_slice),
                    &hashes[..len],
                    &mut out,
                );
                assert_eq!(out.len(), len);
                for (i, k) in keys[..len].iter().enumerate() {
                    let expected = ix.find(layout, k, hashes[i]).unwrap_or(NIL);
                    assert_eq!(out[i], expected, "layout {layout}, len {len}, key {i}");
                }
            }
        }
    }

    #[test]
    fn a_batch_find_resolves_tag_collisions() {
        // Forced collisions: every key's 32-bit hash is the same, so the
        // first candidate is usually another key and `find` must decide.
        let mut ix = KeyIndex::new([7, 8]);
        // More than two windows, the last one partial.
        let n = 2 * FIND_WINDOW as u32 + 7;
        let keys: Vec<Vec<u8>> = (0..n).map(|i| i.to_le_bytes().to_vec()).collect();
        for k in keys.iter().step_by(2) {
            let mut e = entry(&ix, 0, k);
            e.hash = 42;
            ix.insert(e);
        }
        let hashes = vec![42u32; keys.len()];
        let mut out = Vec::new();
        ix.find_batch(0, keys.iter().map(Vec::as_slice), &hashes, &mut out);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(out[i], ix.find(0, k, 42).unwrap_or(NIL), "key {i}");
            assert_eq!(out[i] != NIL, i % 2 == 0, "key {i}");
        }
    }

    #[test]
    fn the_hash_depends_on_the_seed() {
        let a = KeyIndex::new([1, 1]);
        let b = KeyIndex::new([2, 1]);
        let differ = (0..64u32)
            .filter(|i| a.hash(0, &i.to_le_bytes()) != b.hash(0, &i.to_le_bytes()))
            .count();
        assert!(differ > 60);
    }
}
