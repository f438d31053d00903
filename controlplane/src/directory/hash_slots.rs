//! The key index's table: entry hash → entry slot.
//!
//! An open-addressing table of 64-bit words, each a key's 32-bit entry hash
//! beside its entry's slot, with linear probing and backward-shift deletion
//! (the pin ledger's scheme, `pin_ledger.rs`). It replaces a SwissTable of
//! slots (`hashbrown::HashTable<u32>`), which found a key in two dependent
//! steps: the control bytes (a 7-bit tag per bucket) said which bucket, and
//! that bucket's slot number, in another array, was a second cache miss.
//! Here the word that matches is the slot number, and a full 32-bit hash
//! matches another key only about once in 2^32 comparisons, so:
//!
//! - a probe reads one array, usually one cache line, whose address follows
//!   from the hash alone, so it can be prefetched a stage ahead of the probe
//!   ([`prefetch_home`](HashSlots::prefetch_home), used by
//!   `KeyIndex::find_batch`'s pipeline);
//! - a resize places every word again from the word alone, reading no entry
//!   and no key.
//!
//! The load stays at most 3/4: a hit reads 2.5 words on average, a miss 8.5,
//! one or two cache lines. Memory: 8 bytes per bucket, so 10.7–21.3 bytes
//! per key (16.8 with a million keys in 2 Mi buckets). A table large enough
//! to hold whole 2 MiB pages asks for transparent huge pages when it is
//! allocated (`advise_huge_pages`), so that its random probes do not also
//! miss the TLB once it outgrows it.
//!
//! The bucket of a hash is the top bits of its product with an odd constant
//! (Fibonacci hashing). The entry hash is keyed (`keys.rs`), so a client
//! cannot choose keys whose hashes share a run.

use super::keys::{NIL, prefetch};

/// The empty bucket's word: slot [`NIL`] names no entry.
const EMPTY: u64 = u64::MAX;
/// Buckets of a new table.
const MIN_BUCKETS: usize = 16;
/// Odd: multiplication by it is a bijection on `u64`.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline(always)]
fn word(hash: u32, slot: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(slot)
}

#[inline(always)]
fn slot_of(w: u64) -> u32 {
    w as u32
}

#[inline(always)]
fn hash_of(w: u64) -> u32 {
    (w >> 32) as u32
}

/// Asks the kernel to back the whole 2 MiB pages inside `len` words from
/// `p` (an allocation of ours, not yet written) with transparent huge
/// pages, where it honours the hint (THP `enabled` set to `madvise`, the
/// common default; `always` needs no hint, `never` ignores it). Failure is
/// ignored: it is a hint.
///
/// Why: probes land on random buckets, so once the table outgrows what the
/// TLB covers in 4 KiB pages nearly every probe also misses the TLB. With
/// 1 Mi keys (a 16 MiB table), 512-key `exists` batches over keys registered
/// together took 9–15 % less time with the hint, and 2–7 % less over keys
/// drawn at random (in one process, with and without alternated call by
/// call; `docs/benchmarks.md`, session 14). The table is written whole at
/// once, so huge pages cost no memory it would not touch anyway. A table
/// too small to hold an aligned huge page whole gets no call; a larger one
/// gets one per doubling.
fn advise_huge_pages(p: *const u64, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, stop)) = whole_huge_pages(p as usize, len * size_of::<u64>()) {
        // SAFETY: [start, stop) lies inside the caller's allocation of `len`
        // words from `p` (`whole_huge_pages` rounds inwards). MADV_HUGEPAGE
        // changes how the kernel may back those pages, never their contents
        // or whether they are mapped: no memory of anyone else's is
        // touched, none of ours changes.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                stop - start,
                libc::MADV_HUGEPAGE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len);
}

/// The 2 MiB pages wholly inside `bytes` from address `first`, as
/// `[start, stop)`, or `None` if there is none.
fn whole_huge_pages(first: usize, bytes: usize) -> Option<(usize, usize)> {
    const HUGE: usize = 2 << 20;
    let start = first.checked_next_multiple_of(HUGE)?;
    let stop = first.checked_add(bytes)? / HUGE * HUGE;
    (stop > start).then_some((start, stop))
}

#[derive(Debug)]
pub(crate) struct HashSlots {
    /// `hash << 32 | slot` per bucket, or [`EMPTY`]; a power of two long.
    words: Vec<u64>,
    len: usize,
    /// `64 - log2(buckets)`: the spread hash's top bits pick the bucket.
    shift: u32,
}

impl HashSlots {
    pub fn new() -> Self {
        Self {
            words: vec![EMPTY; MIN_BUCKETS],
            len: 0,
            shift: 64 - MIN_BUCKETS.trailing_zeros(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.words.len() - 1
    }

    #[inline(always)]
    fn home(&self, hash: u32) -> usize {
        (u64::from(hash).wrapping_mul(SPREAD) >> self.shift) as usize
    }

    /// Starts loading the cache line where a probe for `hash` begins.
    #[inline(always)]
    pub fn prefetch_home(&self, hash: u32) {
        prefetch(self.words.as_ptr().wrapping_add(self.home(hash)));
    }

    /// The first slot stored under `hash` in probe order, or [`NIL`].
    #[inline]
    pub fn first(&self, hash: u32) -> u32 {
        self.candidates(hash).next().unwrap_or(NIL)
    }

    /// Every slot stored under `hash`, in probe order.
    #[inline]
    pub fn candidates(&self, hash: u32) -> impl Iterator<Item = u32> + '_ {
        let mask = self.mask();
        let mut b = self.home(hash);
        std::iter::from_fn(move || {
            loop {
                let w = self.words[b];
                if w == EMPTY {
                    return None;
                }
                b = (b + 1) & mask;
                if hash_of(w) == hash {
                    return Some(slot_of(w));
                }
            }
        })
    }

    /// Stores `slot` under `hash`. The pair must not be stored already.
    pub fn insert(&mut self, hash: u32, slot: u32) {
        debug_assert_ne!(slot, NIL, "slot NIL names no entry");
        debug_assert!(!self.candidates(hash).any(|s| s == slot));
        if (self.len + 1) * 4 > self.words.len() * 3 {
            self.grow();
        }
        self.place(word(hash, slot));
        self.len += 1;
    }

    /// Puts `w` in the first empty bucket of its probe path.
    fn place(&mut self, w: u64) {
        let mask = self.mask();
        let mut b = self.home(hash_of(w));
        while self.words[b] != EMPTY {
            b = (b + 1) & mask;
        }
        self.words[b] = w;
    }

    /// Removes `slot`, stored under `hash`; `false` if it is not stored.
    pub fn remove(&mut self, hash: u32, slot: u32) -> bool {
        let target = word(hash, slot);
        let mask = self.mask();
        let mut b = self.home(hash);
        loop {
            match self.words[b] {
                EMPTY => return false,
                w if w == target => break,
                _ => b = (b + 1) & mask,
            }
        }
        // Backward shift: empty bucket `b`, then move back every later word
        // of its run that may sit in the hole, so that every word stays
        // reachable from its home without crossing an empty bucket.
        let mut hole = b;
        let mut next = b;
        loop {
            next = (next + 1) & mask;
            let w = self.words[next];
            if w == EMPTY {
                break;
            }
            // The word at `next` may fill the hole iff the hole lies on its
            // probe path: no farther back from `next` than its home is.
            let from_home = next.wrapping_sub(self.home(hash_of(w))) & mask;
            let from_hole = next.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.words[hole] = w;
                hole = next;
            }
        }
        self.words[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Twice the buckets, every word placed again.
    fn grow(&mut self) {
        let buckets = self.words.len() * 2;
        let mut words = Vec::with_capacity(buckets);
        // Before the first write: pages not touched yet are huge from their
        // first fault (memory the allocator reuses keeps its small pages
        // until the kernel collapses them).
        advise_huge_pages(words.as_ptr(), buckets);
        words.resize(buckets, EMPTY);
        let old = std::mem::replace(&mut self.words, words);
        self.shift = 64 - buckets.trailing_zeros();
        for w in old {
            if w != EMPTY {
                self.place(w);
            }
        }
    }

    /// Buckets allocated (for tests of the load bound).
    #[cfg(test)]
    fn buckets(&self) -> usize {
        self.words.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_huge_page_hint_covers_only_whole_pages_inside_the_allocation() {
        const M: usize = 1 << 20;
        // No whole page inside: too short, or straddling a boundary.
        assert_eq!(whole_huge_pages(2 * M, 2 * M - 1), None);
        assert_eq!(whole_huge_pages(3 * M, 5 * M / 2), None);
        assert_eq!(whole_huge_pages(2 * M + 8, 4 * M - 16), None);
        // One whole page inside an unaligned 3 MiB.
        assert_eq!(whole_huge_pages(3 * M, 3 * M), Some((4 * M, 6 * M)));
        // Aligned both ends: all of it.
        assert_eq!(whole_huge_pages(2 * M, 4 * M), Some((2 * M, 6 * M)));
        // Unaligned: rounded inwards at both ends.
        assert_eq!(whole_huge_pages(M + 16, 16 * M), Some((2 * M, 16 * M)));
        // No overflow at the top of the address space.
        assert_eq!(whole_huge_pages(usize::MAX - M, 2 * M), None);
    }

    fn sorted(it: impl Iterator<Item = u32>) -> Vec<u32> {
        let mut v: Vec<u32> = it.collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn slots_under_one_hash_are_all_found_and_removed_one_by_one() {
        let mut t = HashSlots::new();
        for s in 0..5 {
            t.insert(7, s);
        }
        t.insert(8, 9);
        assert_eq!(sorted(t.candidates(7)), vec![0, 1, 2, 3, 4]);
        assert!(t.remove(7, 2));
        assert!(!t.remove(7, 2), "removed already");
        assert!(!t.remove(8, 3), "stored under another hash");
        assert_eq!(sorted(t.candidates(7)), vec![0, 1, 3, 4]);
        assert_eq!(t.first(8), 9);
        assert_eq!(t.first(6), NIL);
        assert_eq!(t.len(), 5);
    }

    #[test]
    fn a_run_that_wraps_around_the_end_survives_removals() {
        // Hashes whose home is the last bucket: the run wraps to bucket 0.
        let t0 = HashSlots::new();
        let last: Vec<u32> = (0..u32::MAX)
            .filter(|&h| t0.home(h) == MIN_BUCKETS - 1)
            .take(6)
            .collect();
        let mut t = HashSlots::new();
        for (s, &h) in last.iter().enumerate() {
            t.insert(h, s as u32);
        }
        assert_eq!(t.buckets(), MIN_BUCKETS, "no growth: the run must wrap");
        for gone in [0usize, 3] {
            assert!(t.remove(last[gone], gone as u32));
        }
        for (s, &h) in last.iter().enumerate() {
            let expect = if s == 0 || s == 3 { NIL } else { s as u32 };
            assert_eq!(t.first(h), expect, "slot {s}");
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u32),
        Remove(u32, u32),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Few distinct hashes, so that runs form and hashes repeat; enough
        // pairs to grow the table several times.
        let op = prop_oneof![
            3 => (0u32..64, 0u32..200).prop_map(|(h, s)| Op::Insert(h, s)),
            2 => (0u32..64, 0u32..200).prop_map(|(h, s)| Op::Remove(h, s)),
        ];
        prop::collection::vec(op, 0..600)
    }

    proptest! {
        /// The table answers as a set of `(hash, slot)` pairs does after
        /// any sequence of inserts and removes, and stays at most 3/4 full.
        #[test]
        fn behaves_as_a_set_of_pairs(ops in ops()) {
            let mut t = HashSlots::new();
            let mut model: HashSet<(u32, u32)> = HashSet::new();
            for op in ops {
                match op {
                    Op::Insert(h, s) => {
                        if model.insert((h, s)) {
                            t.insert(h, s);
                        }
                    }
                    Op::Remove(h, s) => {
                        prop_assert_eq!(t.remove(h, s), model.remove(&(h, s)));
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                prop_assert!(t.len() * 4 <= t.buckets() * 3);
            }
            for h in 0..64 {
                let expected = sorted(model.iter().filter(|p| p.0 == h).map(|p| p.1));
                prop_assert_eq!(sorted(t.candidates(h)), expected);
            }
        }
    }
}
