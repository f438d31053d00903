//! The key index: `(layout, key) → entry`, the directory's hot path.
//!
//! Entries live in a slab (`Vec<Option<Entry>>`, slots reused through a free
//! list) and are named everywhere by their `u32` slot. A table of
//! `(entry hash, slot)` words ([`HashSlots`]) finds them. Beside the slab,
//! in a second array indexed by the same slot, each key has a
//! [`KeyRecord`]: its layout, its length and its first
//! [`INLINE_KEY_BYTES`] bytes, 128 bytes aligned to a cache line. A key
//! longer than that is kept whole in `long_keys` as well (the record keeps
//! its prefix, so that a comparison rejects most other keys before the
//! map). A probe is one hash of the key, one scan of the table for the
//! cached 32-bit hash, and one comparison against the slot's record.
//!
//! Why the record, and not the key in the entry (a `Box<[u8]>`, as before
//! session 20): whether a key is there is the question every `exists` and
//! `lookup` asks, and with the key in a box of its own it cost three
//! dependent cache misses per key — the table, the entry (for the layout
//! and the box's address), the key bytes (two or three lines) — four to six
//! lines in all, which a batch's pipeline can only overlap as far as the
//! core's line-fill buffers allow (about a dozen misses in flight). The
//! record's address follows from the slot, and it holds everything a
//! comparison reads: three lines per key for a 100-byte key, two
//! dependent. Measured in `docs/benchmarks.md`, session 20.
//!
//! The hash is foldhash keyed with seeds drawn from the directory's random
//! source at start: a peer cannot predict which keys collide without
//! recovering the seed, so it cannot cheaply build a colliding key set.
//! The table keeps each key's 32-bit hash beside its slot, so a resize
//! places every word again without reading an entry or a key; the entry
//! does not keep it too (a removal takes it from the caller, which hashed
//! the key to find it, or hashes the key again).
//!
//! Memory (checked by `cxlkv bench directory-memory`): 32 bytes of entry,
//! 128 bytes of record, and 8 bytes per table bucket at a load of
//! 37.5–75 %; a key longer than [`INLINE_KEY_BYTES`] adds its own box and
//! a map entry. Short keys pay for the record's unused bytes: 160 bytes
//! plus the table per key whatever its length up to 120 bytes (the key
//! bytes themselves included).

use std::collections::HashMap;
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

/// One registered key (its bytes and layout are in its [`KeyRecord`]).
#[derive(Debug)]
pub(crate) struct Entry {
    /// Slot of the region in the region table.
    pub region: u32,
    pub page: u32,
    pub generation: u32,
    pub len_bytes: u32,
    /// Pins summed over all sessions (each session's share is in its ledger).
    pub pins: u32,
    /// Intrusive list of the keys registered in the same region.
    pub region_prev: u32,
    pub region_next: u32,
}

/// A slot of the entry slab: aligned so that an entry never straddles two
/// cache lines (a lookup reads one line per key found).
#[derive(Debug)]
#[repr(align(32))]
struct EntrySlot(Option<Entry>);

const _: () = assert!(
    std::mem::size_of::<EntrySlot>() == 32,
    "entry layout grew: check the memory budget (bench directory-memory)"
);

/// Key bytes a [`KeyRecord`] holds: the whole key up to this length, its
/// prefix beyond. 120 makes the record two cache lines; keys of LMCache's
/// form (format, model name, world size, worker, chunk hash) typically fit.
pub(crate) const INLINE_KEY_BYTES: usize = 120;

/// What a comparison reads of a registered key, at an address that follows
/// from its slot: the interned layout, the key's length, and its bytes (the
/// first [`INLINE_KEY_BYTES`] of a longer key). Cache-line aligned, so a key
/// of up to 56 bytes is one line, up to 120 two.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct KeyRecord {
    layout: u32,
    len: u32,
    bytes: [u8; INLINE_KEY_BYTES],
}

const _: () = assert!(std::mem::size_of::<KeyRecord>() == 128);

impl KeyRecord {
    const VACANT: Self = Self {
        layout: u32::MAX,
        len: 0,
        bytes: [0; INLINE_KEY_BYTES],
    };

    fn new(layout: u32, key: &[u8]) -> Self {
        let mut r = Self {
            layout,
            len: u32::try_from(key.len()).expect("invariant: keys are at most MAX_KEY_BYTES"),
            bytes: [0; INLINE_KEY_BYTES],
        };
        let inline = key.len().min(INLINE_KEY_BYTES);
        r.bytes[..inline].copy_from_slice(&key[..inline]);
        r
    }
}

/// Slots per chunk of a [`Chunked`] array.
const CHUNK_SLOTS: usize = 4096;

/// An array that grows by chunks of [`CHUNK_SLOTS`] elements, each allocated
/// once at its full size and never moved: growing copies nothing, and at most
/// one chunk is allocated and not yet used (untouched, so not resident).
///
/// Why not a `Vec`: the key records and entries are over-aligned (64 and 32
/// bytes), and the system allocator grows an over-aligned block by
/// allocating a new one and copying, not in place. With `Vec`s a million
/// keys cost 98.3 resident bytes each beyond their bytes, with chunks 81.8
/// (`cxlkv bench directory-memory`, session 20): the blocks given up on the
/// way stay resident (glibc serves large blocks from its heap once large
/// blocks have been freed, and keeps the heap's free space).
#[derive(Debug)]
struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Chunked<T> {
    fn new() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, value: T) {
        if self.len == self.chunks.len() * CHUNK_SLOTS {
            self.chunks.push(Vec::with_capacity(CHUNK_SLOTS));
        }
        let last = self
            .chunks
            .last_mut()
            .expect("invariant: a chunk with room");
        debug_assert!(last.len() < CHUNK_SLOTS);
        last.push(value);
        self.len += 1;
    }

    fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / CHUNK_SLOTS)?.get(i % CHUNK_SLOTS)
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<T> std::ops::Index<usize> for Chunked<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.chunks[i / CHUNK_SLOTS][i % CHUNK_SLOTS]
    }
}

impl<T> std::ops::IndexMut<usize> for Chunked<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i / CHUNK_SLOTS][i % CHUNK_SLOTS]
    }
}

/// What the caller of [`KeyIndex::find_batch`] reads of the keys found,
/// beyond their slots: what the pipeline prefetches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Nothing (an existence check).
    Done,
    /// Their entries (a lookup, an unpin, a delete).
    ReadEntries,
}

#[derive(Debug)]
pub(crate) struct KeyIndex {
    table: HashSlots,
    entries: Chunked<EntrySlot>,
    /// `records[slot]` is the key of `entries[slot]` (`KeyRecord::VACANT`
    /// where that is `None`): always as long as `entries`.
    records: Chunked<KeyRecord>,
    /// Every live key longer than [`INLINE_KEY_BYTES`], whole, by slot.
    long_keys: HashMap<u32, Box<[u8]>>,
    free: Vec<u32>,
    shared_seed: SharedSeed,
    per_hasher_seed: u64,
}

impl KeyIndex {
    pub fn new(seed: [u64; 2]) -> Self {
        Self {
            table: HashSlots::new(),
            entries: Chunked::new(),
            records: Chunked::new(),
            long_keys: HashMap::new(),
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

    /// Whether the live entry in `slot` is `(layout, key)`.
    #[inline(always)]
    fn is(&self, slot: u32, layout: u32, key: &[u8]) -> bool {
        let r = &self.records[slot as usize];
        if r.layout != layout || r.len as usize != key.len() {
            return false;
        }
        if key.len() <= INLINE_KEY_BYTES {
            r.bytes[..key.len()] == *key
        } else {
            r.bytes[..] == key[..INLINE_KEY_BYTES] && *self.long_keys[&slot] == *key
        }
    }

    /// The slot of `(layout, key)`, whose hash is `hash`.
    #[inline]
    pub fn find(&self, layout: u32, key: &[u8], hash: u32) -> Option<u32> {
        self.table
            .candidates(hash)
            .find(|&slot| self.is(slot, layout, key))
    }

    /// [`find`](Self::find) for a batch of keys of one layout (`hashes[i]`
    /// is key `i`'s hash): pushes each key's slot, or [`NIL`], onto `out`
    /// (cleared first). The same answers, computed as a software pipeline
    /// so that the cache misses of a batch overlap instead of following one
    /// another. A key passes through three stages, each
    /// [`PIPELINE_DISTANCE`] keys behind the one before:
    ///
    /// 1. its table line prefetched;
    /// 2. the table scanned for its first candidate (the first word with
    ///    its 32-bit hash), the lines of that candidate's record that a key
    ///    of this length covers prefetched, and with [`Then::ReadEntries`]
    ///    its entry's line too;
    /// 3. the record compared with the key.
    ///
    /// Every load but the first is of a line prefetched a stage earlier. A
    /// key whose first candidate is not it (another key with the same
    /// 32-bit hash, or the same hash under another layout) takes the plain
    /// `find`.
    ///
    /// Why: a key costs two dependent cache misses (table, record) once the
    /// index outgrows the caches and requests come in another order than
    /// registrations; one key after another they dominated `exists` and
    /// `lookup`. The four passes over windows of 64 keys that an earlier
    /// pipeline replaced (each pass's misses overlapping, the first load of
    /// every pass waiting for them) took 20–39 % longer with 64 Ki and 1 M
    /// keys registered, the same with 1 Ki (`docs/benchmarks.md`, session
    /// 13).
    pub fn find_batch<'k>(
        &self,
        layout: u32,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        hashes: &[u32],
        then: Then,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        out.resize(hashes.len(), NIL);
        // A batch shorter than the distance has all its keys in flight at
        // once anyway: stages `n` apart take `3n` steps instead of `n + 32`
        // (a one-key lookup would otherwise idle through 32 of 33). The
        // full distance is a constant in its own copy of the loop.
        match hashes.len() {
            n if n >= PIPELINE_DISTANCE => {
                self.find_pipelined(layout, keys, hashes, then, out, PIPELINE_DISTANCE);
            }
            n => self.find_pipelined(layout, keys, hashes, then, out, n.max(1)),
        }
    }

    /// [`find_batch`](Self::find_batch)'s pipeline, stages `d` keys apart
    /// (`out` holds one [`NIL`] per hash).
    #[inline(always)]
    fn find_pipelined<'k>(
        &self,
        layout: u32,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        hashes: &[u32],
        then: Then,
        out: &mut [u32],
        d: usize,
    ) {
        let n = hashes.len();
        // Stage 2 needs each key's length, stage 3 its bytes.
        let mut lengths = keys.clone().map(<[u8]>::len);
        let mut keys = keys;
        for t in 0..n + 2 * d {
            if t < n {
                self.table.prefetch_home(hashes[t]);
            }
            if t >= d && t - d < n {
                let i = t - d;
                let c = self.table.first(hashes[i]);
                let len = lengths.next().unwrap_or(0);
                if c != NIL {
                    let r: *const KeyRecord = &self.records[c as usize];
                    prefetch(r);
                    // The second line only if the key reaches into it (an
                    // equal key does).
                    if len > 64 - 2 * size_of::<u32>() {
                        prefetch(r.cast::<u8>().wrapping_add(64));
                    }
                    if then == Then::ReadEntries {
                        // 32-byte entries from an aligned slab: one line.
                        prefetch::<EntrySlot>(&self.entries[c as usize]);
                    }
                }
                out[i] = c;
            }
            if t >= 2 * d && t - 2 * d < n {
                let i = t - 2 * d;
                let Some(key) = keys.next() else {
                    debug_assert!(false, "one key per hash");
                    return;
                };
                let c = out[i];
                if c != NIL && !self.is(c, layout, key) {
                    out[i] = self.find(layout, key, hashes[i]).unwrap_or(NIL);
                }
            }
        }
    }

    /// Inserts `key` under `layout` with its entry, known to be absent,
    /// under `hash`: [`hash`](Self::hash) of its layout and key (only tests
    /// force another, to make keys collide; such an entry cannot be
    /// removed).
    pub fn insert(&mut self, layout: u32, key: &[u8], entry: Entry, hash: u32) -> u32 {
        debug_assert!(self.find(layout, key, hash).is_none());
        let record = KeyRecord::new(layout, key);
        let slot = match self.free.pop() {
            Some(slot) => {
                debug_assert!(self.entries[slot as usize].0.is_none());
                self.entries[slot as usize] = EntrySlot(Some(entry));
                self.records[slot as usize] = record;
                slot
            }
            None => {
                let slot = u32::try_from(self.entries.len())
                    .expect("invariant: max_keys keeps slots below u32::MAX");
                self.entries.push(EntrySlot(Some(entry)));
                self.records.push(record);
                slot
            }
        };
        if key.len() > INLINE_KEY_BYTES {
            self.long_keys.insert(slot, key.into());
        }
        self.table.insert(hash, slot);
        slot
    }

    /// The key bytes of the live entry in `slot`.
    #[inline]
    pub fn key(&self, slot: u32) -> &[u8] {
        debug_assert!(self.is_live(slot), "slot {slot} names no live entry");
        let r = &self.records[slot as usize];
        let len = r.len as usize;
        if len <= INLINE_KEY_BYTES {
            &r.bytes[..len]
        } else {
            &self.long_keys[&slot]
        }
    }

    /// The interned layout of the live entry in `slot`.
    #[inline]
    pub fn layout(&self, slot: u32) -> u32 {
        debug_assert!(self.is_live(slot), "slot {slot} names no live entry");
        self.records[slot as usize].layout
    }

    /// Checks the key records against the keys kept whole (for the
    /// directory's invariant checker): every live key longer than a record
    /// holds is kept whole, with the record's length and prefix, and
    /// nothing else is.
    pub fn check_records(&self) -> Result<(), String> {
        let mut long = 0;
        for (slot, _) in self.iter() {
            let r = &self.records[slot as usize];
            if r.len as usize <= INLINE_KEY_BYTES {
                continue;
            }
            long += 1;
            match self.long_keys.get(&slot) {
                None => return Err(format!("slot {slot}: a {}-byte key not kept whole", r.len)),
                Some(k) if k.len() != r.len as usize || k[..INLINE_KEY_BYTES] != r.bytes => {
                    return Err(format!(
                        "slot {slot}: the whole key differs from its record"
                    ));
                }
                Some(_) => {}
            }
        }
        if long != self.long_keys.len() {
            return Err(format!(
                "{long} live keys are longer than a record, {} kept whole",
                self.long_keys.len()
            ));
        }
        Ok(())
    }

    /// The hash the entry in `slot` is stored under (its key hashed again:
    /// for callers that do not have it at hand).
    pub fn hash_of(&self, slot: u32) -> u32 {
        self.hash(self.layout(slot), self.key(slot))
    }

    /// Removes the entry in `slot`, stored under `hash`, from the table and
    /// the slab.
    pub fn remove(&mut self, slot: u32, hash: u32) -> Entry {
        debug_assert_eq!(hash, self.hash_of(slot), "the entry's own hash");
        let removed = self.table.remove(hash, slot);
        assert!(removed, "invariant: every live slot is in the table");
        let entry = self.entries[slot as usize]
            .0
            .take()
            .expect("invariant: removing a live slot");
        if self.records[slot as usize].len as usize > INLINE_KEY_BYTES {
            self.long_keys.remove(&slot);
        }
        self.records[slot as usize] = KeyRecord::VACANT;
        self.free.push(slot);
        entry
    }

    #[inline]
    pub fn get(&self, slot: u32) -> &Entry {
        self.entries[slot as usize]
            .0
            .as_ref()
            .expect("invariant: slot names a live entry")
    }

    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Entry {
        self.entries[slot as usize]
            .0
            .as_mut()
            .expect("invariant: slot names a live entry")
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether `slot` holds a live entry.
    #[inline]
    pub fn is_live(&self, slot: u32) -> bool {
        self.entries
            .get(slot as usize)
            .is_some_and(|e| e.0.is_some())
    }

    /// Every live entry with its slot, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Entry)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.0.as_ref().map(|e| (slot as u32, e)))
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

    fn entry() -> Entry {
        Entry {
            region: 0,
            page: 0,
            generation: 0,
            len_bytes: 1,
            pins: 0,
            region_prev: NIL,
            region_next: NIL,
        }
    }

    /// Inserts `key` under `layout` with its true hash.
    fn add(ix: &mut KeyIndex, layout: u32, key: &[u8]) -> u32 {
        let hash = ix.hash(layout, key);
        ix.insert(layout, key, entry(), hash)
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
            assert_eq!(ix.key(s), k.as_slice());
            ix.remove(s, hash);
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
                    if len % 2 == 0 {
                        Then::Done
                    } else {
                        Then::ReadEntries
                    },
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
            ix.insert(0, k, entry(), 42);
        }
        let hashes = vec![42u32; keys.len()];
        let mut out = Vec::new();
        ix.find_batch(
            0,
            keys.iter().map(Vec::as_slice),
            &hashes,
            Then::ReadEntries,
            &mut out,
        );
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
        let other = ix.insert(1, b"k", entry(), 42);
        let ours = ix.insert(0, b"k", entry(), 42);
        assert_eq!(ix.table.first(42), other, "the other layout's comes first");
        let mut out = Vec::new();
        for (layout, expected) in [(0, ours), (1, other), (2, NIL)] {
            ix.find_batch(layout, [&b"k"[..]].into_iter(), &[42], Then::Done, &mut out);
            assert_eq!(out, vec![expected], "layout {layout}");
        }
    }

    /// Keys around the record's inline length: shorter, exactly as long,
    /// one byte longer, much longer, and pairs equal in their first
    /// `INLINE_KEY_BYTES` bytes that differ after (the record alone cannot
    /// tell those apart) or only in length.
    fn keys_around_the_inline_length() -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        for len in [0, 1, 56, 57, 64, 119, 120, 121, 200, 512] {
            keys.push((0..len).map(|i| (i * 7 + len) as u8).collect::<Vec<u8>>());
        }
        let prefix: Vec<u8> = (0..INLINE_KEY_BYTES).map(|i| i as u8).collect();
        for tail in [&b""[..], b"a", b"b", b"ab", &[0u8; 300]] {
            let mut k = prefix.clone();
            k.extend_from_slice(tail);
            keys.push(k);
        }
        keys.push(prefix[..INLINE_KEY_BYTES - 1].to_vec());
        keys
    }

    #[test]
    fn keys_longer_than_a_record_are_found_removed_and_told_apart_by_their_tails() {
        let mut ix = KeyIndex::new([11, 12]);
        let keys = keys_around_the_inline_length();
        let slots: Vec<u32> = keys.iter().map(|k| add(&mut ix, 0, k)).collect();
        for (k, &s) in keys.iter().zip(&slots) {
            assert_eq!(ix.key(s), k.as_slice(), "key of {} bytes", k.len());
            assert_eq!(ix.layout(s), 0);
            assert_eq!(ix.find(0, k, ix.hash(0, k)), Some(s));
            assert_eq!(ix.find(1, k, ix.hash(1, k)), None);
        }
        let long = |k: &Vec<u8>| k.len() > INLINE_KEY_BYTES;
        assert_eq!(ix.long_keys.len(), keys.iter().filter(|k| long(k)).count());
        // The same hash for every key: each one's first candidate is
        // usually another key, often one with the same record prefix.
        let mut forced = KeyIndex::new([13, 14]);
        let forced_slots: Vec<u32> = keys
            .iter()
            .map(|k| forced.insert(0, k, entry(), 42))
            .collect();
        let mut out = Vec::new();
        forced.find_batch(
            0,
            keys.iter().map(Vec::as_slice),
            &vec![42; keys.len()],
            Then::ReadEntries,
            &mut out,
        );
        assert_eq!(out, forced_slots);
        // Removing every other key frees its box; the rest stay findable.
        for (i, (k, &s)) in keys.iter().zip(&slots).enumerate() {
            if i % 2 == 0 {
                ix.remove(s, ix.hash(0, k));
            }
        }
        for (i, k) in keys.iter().enumerate() {
            let found = ix.find(0, k, ix.hash(0, k));
            assert_eq!(found.is_some(), i % 2 == 1, "key {i} of {} bytes", k.len());
        }
        let live_long = keys
            .iter()
            .enumerate()
            .filter(|(i, k)| i % 2 == 1 && long(k));
        assert_eq!(ix.long_keys.len(), live_long.count());
        // A freed slot reused by a short key keeps no trace of a long one.
        let reused = add(&mut ix, 0, b"short");
        assert_eq!(ix.key(reused), b"short");
        assert!(!ix.long_keys.contains_key(&reused));
    }

    #[test]
    fn the_slab_grows_by_chunks_and_keeps_every_slot_in_place() {
        let mut ix = KeyIndex::new([15, 16]);
        let n = 2 * CHUNK_SLOTS + 3;
        let keys: Vec<Vec<u8>> = (0..n as u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let first = add(&mut ix, 0, &keys[0]);
        let record: *const KeyRecord = &ix.records[first as usize];
        for k in &keys[1..] {
            add(&mut ix, 0, k);
        }
        assert_eq!(ix.records.chunks.len(), 3);
        assert!(
            std::ptr::eq(record, &ix.records[first as usize]),
            "records never move"
        );
        assert_eq!(ix.records.len(), ix.entries.len());
        for (i, k) in keys.iter().enumerate() {
            let s = ix.find(0, k, ix.hash(0, k)).expect("registered");
            assert_eq!(s as usize, i);
            assert_eq!(
                (&raw const ix.records[i]).addr() % 64,
                0,
                "record {i} aligned"
            );
            assert_eq!(
                (&raw const ix.entries[i]).addr() % 32,
                0,
                "entry {i} aligned"
            );
        }
        assert_eq!(ix.iter().count(), n);
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
