//! A session's pin ledger: entry slot → pins held (count, since).
//!
//! An open-addressing table with linear probing and backward-shift deletion,
//! specialised for `u32` slots. It replaces a `HashMap<u32, HeldPin>` that a
//! pinning `lookup` updated once per key found:
//!
//! - **no tombstones.** A SwissTable removal can leave a tombstone, and the
//!   tombstones left by a session that pins a batch and unpins it lengthen
//!   every later probe until the table rehashes itself. Backward-shift
//!   deletion moves the rest of the run back instead, so a table holds only
//!   live slots and empty buckets;
//! - **one array probed.** The slots are an array of their own (16 per
//!   cache line); counts and times sit in parallel arrays read only at the
//!   bucket found.
//!
//! The bucket of a slot is a multiply-shift hash by an odd multiplier drawn
//! at random when the directory starts. Slot numbers never leave the
//! directory, and the multiplier is secret, so a client choosing which keys
//! to pin cannot choose slots that all land in one run. The load stays at most 1/2: an
//! insert probes 1.5 buckets on average, a miss 2.5.
//!
//! Memory: 16 bytes per bucket, so 32–64 bytes per key pinned while the
//! ledger grows. A ledger keeps its size as it empties (shrinking on every
//! unpin would make a session that pins and unpins whole batches rebuild it
//! on every call); the directory rebuilds a thinned-out ledger to fit
//! ([`PinLedger::shrink_to_fit`]) only when all ledgers together are over
//! their budget, and never below [`MIN_KEPT_BUCKETS`]. The session's
//! pinned-key limit (`max_pinned_keys_per_session`) bounds one ledger, the
//! directory-wide `max_pinned_entries` all of them (`DirectoryConfig`).
//!
//! Measured in one process (`examples/directory_batch --op lookup_pin`,
//! 64 Ki keys, `docs/benchmarks.md` session 11): a lookup taking one pin on
//! each of 512 keys 22.2 → 19.3 µs, the unpin that follows 20.4 → 16.9 µs.

use super::keys::NIL;
use super::types::Time;

/// Pins one session holds on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeldPin {
    pub count: u32,
    /// When the session went from no pins to some pins on this key.
    pub since: Time,
}

/// The empty bucket's mark: no live entry has slot [`NIL`].
const EMPTY: u32 = NIL;
/// Buckets of a ledger's first allocation.
const MIN_BUCKETS: usize = 16;
/// Bytes of one bucket: its slot, count and time.
pub(crate) const BUCKET_BYTES: u64 =
    (size_of::<u32>() + size_of::<u32>() + size_of::<Time>()) as u64;
/// A ledger is never shrunk below this many buckets (16 KiB, room for 512
/// keys): a session pinning and unpinning batches of up to 512 keys never
/// rebuilds its ledger.
pub(crate) const MIN_KEPT_BUCKETS: usize = 1024;

const _: () = assert!(
    BUCKET_BYTES == 16,
    "the memory figures in the docs assume 16"
);

#[derive(Debug)]
pub(crate) struct PinLedger {
    /// Entry slot per bucket, or [`EMPTY`]. Empty until the first pin.
    slots: Vec<u32>,
    /// `counts[b]` and `since[b]` belong to `slots[b]` (unspecified where it
    /// is empty).
    counts: Vec<u32>,
    since: Vec<Time>,
    len: usize,
    /// Odd: multiplication by it is a bijection on `u64`.
    multiplier: u64,
    /// `64 - log2(buckets)`: the hash's top bits pick the bucket.
    shift: u32,
}

impl PinLedger {
    /// An empty ledger whose buckets are keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            slots: Vec::new(),
            counts: Vec::new(),
            since: Vec::new(),
            len: 0,
            multiplier: seed | 1,
            shift: 64,
        }
    }

    /// Keys with pins held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Buckets allocated (16 bytes each).
    pub fn buckets(&self) -> usize {
        self.slots.len()
    }

    /// Whether the ledger is thin: more than [`MIN_KEPT_BUCKETS`] buckets,
    /// fewer than one key held per 8 (a ledger that grew holds at least one
    /// per 4).
    pub fn is_thin(&self) -> bool {
        self.slots.len() > MIN_KEPT_BUCKETS && self.len * 8 < self.slots.len()
    }

    /// Rebuilds a thin ledger at the smallest power of two of at least 4
    /// buckets per key held (load 1/4, as right after a growth), and at
    /// least [`MIN_KEPT_BUCKETS`]. Costs one pass over the old buckets,
    /// paid for by the unpins that thinned it (at least 3/8 of its buckets'
    /// worth since it last grew or shrank).
    pub fn shrink_to_fit(&mut self) {
        debug_assert!(self.is_thin(), "only a thin ledger is shrunk");
        let buckets = (self.len * 4).next_power_of_two().max(MIN_KEPT_BUCKETS);
        self.rebuild(buckets);
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, slot: u32) -> usize {
        // Multiply-shift: the product's top bits (`shift < 64` once a bucket
        // exists).
        (u64::from(slot).wrapping_mul(self.multiplier) >> self.shift) as usize
    }

    /// The bucket holding `slot`, if any.
    #[inline]
    fn find(&self, slot: u32) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut b = self.home(slot);
        loop {
            match self.slots[b] {
                s if s == slot => return Some(b),
                EMPTY => return None,
                _ => b = (b + 1) & mask,
            }
        }
    }

    /// The pins held on `slot`, if any.
    #[cfg(test)]
    pub fn get(&self, slot: u32) -> Option<HeldPin> {
        self.find(slot).map(|b| HeldPin {
            count: self.counts[b],
            since: self.since[b],
        })
    }

    /// Adds `count` pins on `slot`; `now` becomes its `since` if it had none.
    ///
    /// The count must not overflow: callers keep every key's total below
    /// `MAX_PINS_PER_KEY`.
    #[inline]
    pub fn take(&mut self, slot: u32, count: u32, now: Time) {
        debug_assert_ne!(slot, EMPTY, "slot NIL names no entry");
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut b = self.home(slot);
        loop {
            match self.slots[b] {
                s if s == slot => {
                    self.counts[b] += count;
                    return;
                }
                EMPTY => {
                    self.slots[b] = slot;
                    self.counts[b] = count;
                    self.since[b] = now;
                    self.len += 1;
                    return;
                }
                _ => b = (b + 1) & mask,
            }
        }
    }

    /// Gives up `count` of the pins held on `slot`. `false`, and nothing
    /// changes, if fewer than `count` are held (a count never underflows).
    pub fn release(&mut self, slot: u32, count: u32) -> bool {
        let Some(b) = self.find(slot) else {
            return false;
        };
        if self.counts[b] < count {
            return false;
        }
        self.counts[b] -= count;
        if self.counts[b] == 0 {
            self.remove_at(b);
        }
        true
    }

    /// Empties bucket `b` and moves back every later entry of its run that
    /// may sit there (backward-shift deletion): afterwards every entry is
    /// still reachable from its home without crossing an empty bucket.
    fn remove_at(&mut self, b: usize) {
        let mask = self.mask();
        let mut hole = b;
        let mut next = b;
        loop {
            next = (next + 1) & mask;
            let slot = self.slots[next];
            if slot == EMPTY {
                break;
            }
            // The entry at `next` may fill the hole iff the hole lies on its
            // probe path: no farther back from `next` than its home is.
            let from_home = next.wrapping_sub(self.home(slot)) & mask;
            let from_hole = next.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = slot;
                self.counts[hole] = self.counts[next];
                self.since[hole] = self.since[next];
                hole = next;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    /// Twice the buckets (16 at first), every entry placed again.
    fn grow(&mut self) {
        self.rebuild((self.slots.len() * 2).max(MIN_BUCKETS));
    }

    /// `buckets` buckets (a power of two, at least twice the keys held),
    /// every entry placed again.
    fn rebuild(&mut self, buckets: usize) {
        debug_assert!(buckets.is_power_of_two() && buckets >= self.len * 2);
        let slots = std::mem::replace(&mut self.slots, vec![EMPTY; buckets]);
        let counts = std::mem::replace(&mut self.counts, vec![0; buckets]);
        let since = std::mem::replace(&mut self.since, vec![Time::ZERO; buckets]);
        self.shift = 64 - buckets.trailing_zeros();
        self.len = 0;
        for ((slot, count), since) in slots.into_iter().zip(counts).zip(since) {
            if slot != EMPTY {
                self.take(slot, count, since);
            }
        }
    }

    /// Every key with pins held, in no particular order (an empty ledger's
    /// buckets are not walked).
    pub fn iter(&self) -> impl Iterator<Item = (u32, HeldPin)> + '_ {
        let buckets = if self.len == 0 { 0 } else { self.slots.len() };
        self.slots[..buckets]
            .iter()
            .zip(&self.counts)
            .zip(&self.since)
            .filter(|((slot, _), _)| **slot != EMPTY)
            .map(|((&slot, &count), &since)| (slot, HeldPin { count, since }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn t(n: u64) -> Time {
        Time::from_nanos(n)
    }

    #[test]
    fn pins_add_up_and_release_never_underflows() {
        let mut l = PinLedger::new(7);
        assert_eq!(l.get(3), None);
        assert!(!l.release(3, 1), "nothing held");
        l.take(3, 2, t(10));
        l.take(3, 1, t(20));
        assert_eq!(
            l.get(3),
            Some(HeldPin {
                count: 3,
                since: t(10)
            }),
            "since is when the first pin was taken"
        );
        assert!(!l.release(3, 4), "more than held");
        assert_eq!(
            l.get(3).map(|h| h.count),
            Some(3),
            "a refused release changes nothing"
        );
        assert!(l.release(3, 3));
        assert_eq!(l.get(3), None);
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn removals_in_a_full_run_keep_every_other_entry_reachable() {
        // Multiplier 1 with 16 buckets puts every slot below 2^60 in bucket
        // 0: one run holds them all, and removing from its middle must move
        // the rest back.
        let mut l = PinLedger::new(1);
        for s in 0..7 {
            l.take(s, 1, t(u64::from(s)));
        }
        assert_eq!(l.slots.len(), 16);
        for gone in [3, 0, 6] {
            assert!(l.release(gone, 1));
            assert_eq!(l.get(gone), None);
        }
        for s in [1, 2, 4, 5] {
            assert_eq!(l.get(s).map(|h| h.since), Some(t(u64::from(s))), "slot {s}");
        }
        assert_eq!(l.len(), 4);
    }

    #[test]
    fn a_thin_ledger_shrinks_to_fit_and_keeps_every_entry() {
        let mut l = PinLedger::new(0x9E37_79B9);
        for s in 0..2000 {
            l.take(s, 1, t(u64::from(s)));
        }
        assert_eq!(l.buckets(), 4096);
        for s in 0..1900 {
            assert!(l.release(s, 1));
        }
        assert!(l.is_thin(), "100 keys in 4096 buckets");
        l.shrink_to_fit();
        assert_eq!(l.buckets(), MIN_KEPT_BUCKETS, "never below the floor");
        assert!(!l.is_thin());
        assert_eq!(l.len(), 100);
        for s in 1900..2000 {
            assert_eq!(l.get(s).map(|h| h.since), Some(t(u64::from(s))), "slot {s}");
        }
        for s in 0..1900 {
            assert_eq!(l.get(s), None);
        }
        // Above the floor it keeps 4 buckets per key.
        for s in 2000..2500 {
            l.take(s, 1, t(0));
        }
        assert_eq!(l.buckets(), 2048);
        for s in 1900..2250 {
            assert!(l.release(s, 1));
        }
        assert!(l.is_thin(), "250 keys in 2048 buckets");
        l.shrink_to_fit();
        assert_eq!((l.buckets(), l.len()), (1024, 250));
        assert_eq!(l.iter().count(), 250);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take(u32, u32),
        Release(u32, u32),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Few distinct slots so that takes and releases meet; seeds below 4
        // (multipliers 1 and 3) put them all in one run.
        let op = prop_oneof![
            (0u32..40, 1u32..4).prop_map(|(s, c)| Op::Take(s, c)),
            (0u32..40, 1u32..4).prop_map(|(s, c)| Op::Release(s, c)),
        ];
        prop::collection::vec(op, 0..400)
    }

    proptest! {
        /// The ledger answers as a `HashMap` does after any sequence of
        /// takes and releases, whatever the seed.
        #[test]
        fn behaves_as_a_map(seed in prop_oneof![0u64..4, any::<u64>()], ops in ops()) {
            let mut l = PinLedger::new(seed);
            let mut model: HashMap<u32, HeldPin> = HashMap::new();
            for (i, op) in ops.into_iter().enumerate() {
                let now = t(i as u64);
                match op {
                    Op::Take(s, c) => {
                        l.take(s, c, now);
                        model
                            .entry(s)
                            .and_modify(|h| h.count += c)
                            .or_insert(HeldPin { count: c, since: now });
                    }
                    Op::Release(s, c) => {
                        let expect = model.get(&s).is_some_and(|h| h.count >= c);
                        prop_assert_eq!(l.release(s, c), expect);
                        if expect {
                            let h = model.get_mut(&s).unwrap();
                            h.count -= c;
                            if h.count == 0 {
                                model.remove(&s);
                            }
                        }
                    }
                }
                prop_assert_eq!(l.len(), model.len());
                prop_assert!(l.len() * 2 <= l.slots.len().max(1));
            }
            for s in 0..40 {
                prop_assert_eq!(l.get(s), model.get(&s).copied());
            }
            let mut listed: Vec<(u32, HeldPin)> = l.iter().collect();
            listed.sort_by_key(|(s, _)| *s);
            let mut expected: Vec<(u32, HeldPin)> = model.into_iter().collect();
            expected.sort_by_key(|(s, _)| *s);
            prop_assert_eq!(listed, expected);
        }
    }
}
