//! The key index: `(layout, key) → entry`, the directory's hot path.
//!
//! Entries live in a slab (`Vec<Option<Entry>>`, slots reused through a free
//! list) and are named everywhere by their `u32` slot. A table of
//! `(entry hash, slot)` words ([`HashSlots`]) finds them; the key bytes are
//! stored once, in the entry (a `Box<[u8]>`: one allocation of exactly the
//! key's length). A probe is one hash of the key, one scan of the table for
//! the cached 32-bit hash, and one comparison of the key bytes.
//!
//! The hash is foldhash keyed with seeds drawn from the directory's random
//! source at start: a peer cannot predict which keys collide without
//! recovering the seed, so it cannot cheaply build a colliding key set.
//! The table keeps each key's 32-bit hash beside its slot, so a resize
//! places every word again without reading an entry or a key; the entry
//! does not keep it too (a removal takes it from the caller, which hashed
//! the key to find it, or hashes the key again).
//!
//! Memory (checked by `cxlkv bench directory-memory`): 48 bytes of entry, the
//! allocator's header and rounding on the key box (about 12 bytes for a 100-byte
//! key), and 8 bytes per table bucket at a load of 37.5–75 %.

use std::hash::Hasher;

use foldhash::SharedSeed;
use foldhash::fast::FoldHasher;

use super::hash_slots::HashSlots;

/// A cheap bijective integer mixer (splitmix64's finaliser).
#[inline]
pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// "No slot": ends an intrusive list.
pub(crate) const NIL: u32 = u32::MAX;
/// `find_batch`'s mark for a key whose first candidate is not it
/// (slots stay below `MAX_KEYS_CEILING`, so it names none).
const RETRY: u32 = u32::MAX - 1;
const _: () = assert!(super::config::MAX_KEYS_CEILING <= RETRY as usize);

/// Keys between two stages of [`KeyIndex::find_batch`]'s pipeline: how far
/// ahead of its use each line is prefetched. Measured in one process with
/// 64 Ki keys registered, 512-key calls alternating call by call
/// (`docs/benchmarks.md`, session 13): distances of 8, 12, 16 and 24 keys
/// all within 2 % of each other.
const PIPELINE_DISTANCE: usize = 16;

/// Asks the CPU to start loading the cache line at `p` (a hint: no effect
/// on what the program computes, and no fault for any address).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
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
    /// Pins summed over all sessions (each session's share is in its ledger).
    pub pins: u32,
    /// Intrusive list of the keys registered in the same region.
    pub region_prev: u32,
    pub region_next: u32,
}

const _: () = assert!(
    std::mem::size_of::<Option<Entry>>() == 48,
    "entry layout grew: check the memory budget (bench directory-memory)"
);

#[derive(Debug)]
pub(crate) struct KeyIndex {
    table: HashSlots,
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    shared_seed: SharedSeed,
    per_hasher_seed: u64,
}

impl KeyIndex {
    pub fn new(seed: [u64; 2]) -> Self {
        Self {
            table: HashSlots::new(),
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
        self.table.candidates(hash).find(|&slot| {
            let e = self.get(slot);
            e.layout == layout && *e.key == *key
        })
    }

    /// [`find`](Self::find) for a batch of keys of one layout (`hashes[i]`
    /// is key `i`'s hash): pushes each key's slot, or [`NIL`], onto `out`
    /// (cleared first). The same answers, computed as a software pipeline
    /// so that the cache misses of a batch overlap instead of following one
    /// another. A key passes through four stages, each [`PIPELINE_DISTANCE`]
    /// keys behind the one before:
    ///
    /// 1. its table line prefetched;
    /// 2. the table scanned for its first candidate (the first word with
    ///    its 32-bit hash), that entry's lines prefetched;
    /// 3. the entry's layout checked, the key bytes' lines prefetched;
    /// 4. the key bytes compared.
    ///
    /// Every load but the first is of a line prefetched a stage earlier. A
    /// key whose first candidate is not it (another key with the same
    /// 32-bit hash, or the same hash under another layout) takes the plain
    /// `find`.
    ///
    /// Why: a key costs three dependent cache misses (table, entry, key
    /// bytes) once the index outgrows the caches and requests come in
    /// another order than registrations; one key after another they
    /// dominated `exists` and `lookup`. The four passes over windows of
    /// 64 keys that this replaced (each pass's misses overlapping, the
    /// first load of every pass waiting for them) took 20–39 % longer with
    /// 64 Ki and 1 M keys registered, the same with 1 Ki
    /// (`docs/benchmarks.md`, session 13).
    pub fn find_batch<'k>(
        &self,
        layout: u32,
        keys: impl Iterator<Item = &'k [u8]>,
        hashes: &[u32],
        out: &mut Vec<u32>,
    ) {
        out.clear();
        out.resize(hashes.len(), NIL);
        // A batch shorter than the distance has all its keys in flight at
        // once anyway: stages `n` apart take `4n` steps instead of `n + 48`
        // (a one-key lookup would otherwise idle through 48 of 49). The
        // full distance is a constant in its own copy of the loop.
        match hashes.len() {
            n if n >= PIPELINE_DISTANCE => {
                self.find_pipelined(layout, keys, hashes, out, PIPELINE_DISTANCE);
            }
            n => self.find_pipelined(layout, keys, hashes, out, n.max(1)),
        }
    }

    /// [`find_batch`](Self::find_batch)'s pipeline, stages `d` keys apart
    /// (`out` holds one [`NIL`] per hash).
    #[inline(always)]
    fn find_pipelined<'k>(
        &self,
        layout: u32,
        mut keys: impl Iterator<Item = &'k [u8]>,
        hashes: &[u32],
        out: &mut [u32],
        d: usize,
    ) {
        let n = hashes.len();
        for t in 0..n + 3 * d {
            if t < n {
                self.table.prefetch_home(hashes[t]);
            }
            if t >= d && t - d < n {
                let i = t - d;
                let c = self.table.first(hashes[i]);
                if c != NIL {
                    let e: *const Option<Entry> = &self.entries[c as usize];
                    // An entry may straddle two lines: both.
                    prefetch(e);
                    prefetch(e.cast::<u8>().wrapping_add(size_of::<Option<Entry>>() - 1));
                }
                out[i] = c;
            }
            if t >= 2 * d && t - 2 * d < n {
                let i = t - 2 * d;
                if out[i] != NIL {
                    let e = self.get(out[i]);
                    if e.layout == layout {
                        // Every line of the key, the last one included.
                        let (p, len) = (e.key.as_ptr(), e.key.len());
                        let mut off = 0;
                        while off < len {
                            prefetch(p.wrapping_add(off));
                            off += 64;
                        }
                        prefetch(p.wrapping_add(len.saturating_sub(1)));
                    } else {
                        out[i] = RETRY;
                    }
                }
            }
            if t >= 3 * d && t - 3 * d < n {
                let i = t - 3 * d;
                let Some(key) = keys.next() else {
                    debug_assert!(false, "one key per hash");
                    return;
                };
                let retry = match out[i] {
                    NIL => false,
                    RETRY => true,
                    slot => *self.get(slot).key != *key,
                };
                if retry {
                    out[i] = self.find(layout, key, hashes[i]).unwrap_or(NIL);
                }
            }
        }
    }

    /// Inserts an entry whose `(layout, key)` is known to be absent, under
    /// `hash`: [`hash`](Self::hash) of its layout and key (only tests force
    /// another, to make keys collide; such an entry cannot be removed).
    pub fn insert(&mut self, entry: Entry, hash: u32) -> u32 {
        debug_assert!(self.find(entry.layout, &entry.key, hash).is_none());
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
        self.table.insert(hash, slot);
        slot
    }

    /// The hash the entry in `slot` is stored under (its key hashed again:
    /// for callers that do not have it at hand).
    pub fn hash_of(&self, slot: u32) -> u32 {
        let e = self.get(slot);
        self.hash(e.layout, &e.key)
    }

    /// Removes the entry in `slot`, stored under `hash`, from the table and
    /// the slab.
    pub fn remove(&mut self, slot: u32, hash: u32) -> Entry {
        debug_assert_eq!(hash, self.hash_of(slot), "the entry's own hash");
        let removed = self.table.remove(hash, slot);
        assert!(removed, "invariant: every live slot is in the table");
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

    fn entry(layout: u32, key: &[u8]) -> Entry {
        Entry {
            key: key.into(),
            region: 0,
            page: 0,
            generation: 0,
            len_bytes: 1,
            layout,
            pins: 0,
            region_prev: NIL,
            region_next: NIL,
        }
    }

    /// Inserts `key` under `layout` with its true hash.
    fn add(ix: &mut KeyIndex, layout: u32, key: &[u8]) -> u32 {
        let hash = ix.hash(layout, key);
        ix.insert(entry(layout, key), hash)
    }

    #[test]
    fn the_same_key_under_two_layouts_is_two_keys() {
        let mut ix = KeyIndex::new([1, 2]);
        let a = add(&mut ix, 0, b"k");
        let b = add(&mut ix, 1, b"k");
        assert_ne!(a, b);
        assert_eq!(ix.find(0, b"k", ix.hash(0, b"k")), Some(a));
        assert_eq!(ix.find(1, b"k", ix.hash(1, b"k")), Some(b));
        assert_eq!(ix.find(2, b"k", ix.hash(2, b"k")), None);
    }

    #[test]
    fn removed_slots_are_reused_and_survive_table_growth() {
        let mut ix = KeyIndex::new([3, 4]);
        let keys: Vec<Vec<u8>> = (0..10_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let slots: Vec<u32> = keys.iter().map(|k| add(&mut ix, 0, k)).collect();
        for (k, &s) in keys.iter().zip(&slots).step_by(2) {
            let hash = ix.hash(0, k);
            assert_eq!(&*ix.remove(s, hash).key, k.as_slice());
        }
        assert_eq!(ix.len(), 5_000);
        let again = add(&mut ix, 0, b"new");
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
            add(&mut ix, 0, k);
        }
        add(&mut ix, 1, &keys[1]);
        // Present, absent, and another layout's keys, mixed; batches of
        // every length around the pipeline's stage boundaries.
        for layout in [0, 1, 2] {
            let hashes: Vec<u32> = keys.iter().map(|k| ix.hash(layout, k)).collect();
            let d = PIPELINE_DISTANCE;
            for len in [
                0,
                1,
                d - 1,
                d,
                d + 1,
                3 * d - 1,
                3 * d,
                3 * d + 1,
                keys.len(),
            ] {
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
    fn a_batch_find_resolves_full_hash_collisions() {
        // Forced collisions: every key's 32-bit hash is the same, so the
        // first candidate is usually another key and `find` must decide.
        let mut ix = KeyIndex::new([7, 8]);
        // Longer than the pipeline, so every stage runs beside the others.
        let n = 4 * PIPELINE_DISTANCE as u32 + 7;
        let keys: Vec<Vec<u8>> = (0..n).map(|i| i.to_le_bytes().to_vec()).collect();
        for k in keys.iter().step_by(2) {
            ix.insert(entry(0, k), 42);
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
    fn a_batch_find_passes_over_the_same_key_under_another_layout() {
        // The same bytes and the same 32-bit hash under two layouts, the
        // other layout's entry first in the probe.
        let mut ix = KeyIndex::new([9, 10]);
        let other = ix.insert(entry(1, b"k"), 42);
        let ours = ix.insert(entry(0, b"k"), 42);
        assert_eq!(ix.table.first(42), other, "the other layout's comes first");
        let mut out = Vec::new();
        for (layout, expected) in [(0, ours), (1, other), (2, NIL)] {
            ix.find_batch(layout, [&b"k"[..]].into_iter(), &[42], &mut out);
            assert_eq!(out, vec![expected], "layout {layout}");
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
