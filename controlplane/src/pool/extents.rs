//! The free space of one pool: a set of disjoint, fully coalesced extents
//! with first-fit search in O(log n).
//!
//! First fit means the *lowest-addressed* free extent that is long enough.
//! A plain ordered map finds an extent by address but not the first long
//! enough one without a scan, and a map ordered by length finds best fit, not
//! first fit. So the extents live in a treap keyed by start address whose
//! nodes also carry the longest extent in their subtree: the search walks
//! down taking the leftmost subtree that can fit, O(depth).
//!
//! Nodes live in an arena (`Vec<Node>`) and are linked by `u32` indices;
//! freed slots are reused, so steady-state operation does not allocate.
//! Priorities come from a counter scrambled by splitmix64: deterministic
//! (replays and tests are reproducible) yet independent of the addresses, so
//! the expected depth is O(log n) whatever the allocation pattern.
//!
//! Invariants (checked by [`FreeExtents::check`]):
//! - extents are disjoint, non-empty and *maximal*: two free extents never
//!   touch (a release coalesces with both neighbours);
//! - in-order traversal is sorted by start; parents have priority ≥ children;
//! - every node's `max_len` is the longest extent in its subtree;
//! - `free_bytes` is the sum of all lengths.
//!
//! Alignment is the caller's business: the ledger only ever carves and
//! releases aligned extents, so every free extent stays aligned.

use std::fmt;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    start: u64,
    len: u64,
    /// Longest `len` in the subtree rooted here.
    max_len: u64,
    priority: u64,
    left: u32,
    right: u32,
}

/// What was wrong with a carve or release: the ledger turns these into
/// corruption errors (a journal record or a request that does not fit the
/// free space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExtentError {
    #[error("extent [{start:#x}, +{len:#x}) is not entirely free")]
    NotFree { start: u64, len: u64 },
    #[error("extent [{start:#x}, +{len:#x}) overlaps free space")]
    OverlapsFree { start: u64, len: u64 },
    #[error("extent [{start:#x}, +{len:#x}) is empty or wraps around")]
    Malformed { start: u64, len: u64 },
}

/// The free extents of one pool.
#[derive(Clone)]
pub struct FreeExtents {
    nodes: Vec<Node>,
    vacant: Vec<u32>,
    root: u32,
    count: usize,
    free_bytes: u64,
    priority_counter: u64,
}

impl fmt::Debug for FreeExtents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FreeExtents")
            .field("count", &self.count)
            .field("free_bytes", &self.free_bytes)
            .field("largest", &self.largest())
            .finish()
    }
}

impl Default for FreeExtents {
    fn default() -> Self {
        Self::new()
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl FreeExtents {
    pub fn new() -> Self {
        Self {
            nodes: Vec::new(),
            vacant: Vec::new(),
            root: NIL,
            count: 0,
            free_bytes: 0,
            priority_counter: 0,
        }
    }

    /// Number of free extents.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Length of the longest free extent (0 when nothing is free).
    pub fn largest(&self) -> u64 {
        if self.root == NIL {
            0
        } else {
            self.nodes[self.root as usize].max_len
        }
    }

    /// Start of the lowest-addressed free extent of at least `len` bytes.
    pub fn first_fit(&self, len: u64) -> Option<u64> {
        let mut t = self.root;
        if t == NIL || self.nodes[t as usize].max_len < len {
            return None;
        }
        // Invariant of the walk: the subtree at `t` contains a fit.
        loop {
            let n = &self.nodes[t as usize];
            if n.left != NIL && self.nodes[n.left as usize].max_len >= len {
                t = n.left;
            } else if n.len >= len {
                return Some(n.start);
            } else {
                debug_assert!(n.right != NIL && self.nodes[n.right as usize].max_len >= len);
                t = n.right;
            }
        }
    }

    /// The free extent with the greatest start ≤ `at`, as `(start, len)`.
    pub fn floor(&self, at: u64) -> Option<(u64, u64)> {
        let mut t = self.root;
        let mut best = None;
        while t != NIL {
            let n = &self.nodes[t as usize];
            if n.start <= at {
                best = Some((n.start, n.len));
                t = n.right;
            } else {
                t = n.left;
            }
        }
        best
    }

    /// The free extent with the smallest start ≥ `at`, as `(start, len)`.
    pub fn ceiling(&self, at: u64) -> Option<(u64, u64)> {
        let mut t = self.root;
        let mut best = None;
        while t != NIL {
            let n = &self.nodes[t as usize];
            if n.start >= at {
                best = Some((n.start, n.len));
                t = n.left;
            } else {
                t = n.right;
            }
        }
        best
    }

    /// Removes `[start, start + len)` from the free space; it must lie inside
    /// one free extent. The remnants on either side stay free.
    pub fn carve(&mut self, start: u64, len: u64) -> Result<(), ExtentError> {
        let end = checked_end(start, len)?;
        let (s, l) = self
            .floor(start)
            .ok_or(ExtentError::NotFree { start, len })?;
        let e = s + l;
        if end > e {
            return Err(ExtentError::NotFree { start, len });
        }
        self.remove(s);
        if start > s {
            self.insert(s, start - s);
        }
        if e > end {
            self.insert(end, e - end);
        }
        self.free_bytes -= len;
        Ok(())
    }

    /// Returns `[start, start + len)` to the free space, coalescing with free
    /// neighbours. It must not overlap any free extent.
    pub fn release(&mut self, start: u64, len: u64) -> Result<(), ExtentError> {
        let end = checked_end(start, len)?;
        let mut merged_start = start;
        let mut merged_end = end;
        let before = self.floor(start);
        if let Some((s, l)) = before
            && s + l > start
        {
            return Err(ExtentError::OverlapsFree { start, len });
        }
        let after = self.ceiling(start);
        if let Some((s, _)) = after
            && s < end
        {
            return Err(ExtentError::OverlapsFree { start, len });
        }
        if let Some((s, l)) = before
            && s + l == start
        {
            self.remove(s);
            merged_start = s;
        }
        if let Some((s, l)) = after
            && s == end
        {
            self.remove(s);
            merged_end = s + l;
        }
        self.insert(merged_start, merged_end - merged_start);
        self.free_bytes += len;
        Ok(())
    }

    /// Calls `f(start, len)` for every free extent in address order.
    /// Iterative (an explicit stack bounded by the tree depth).
    pub fn for_each(&self, mut f: impl FnMut(u64, u64)) {
        let mut stack = Vec::new();
        let mut t = self.root;
        while t != NIL || !stack.is_empty() {
            while t != NIL {
                stack.push(t);
                t = self.nodes[t as usize].left;
            }
            if let Some(top) = stack.pop() {
                let n = &self.nodes[top as usize];
                f(n.start, n.len);
                t = n.right;
            }
        }
    }

    /// Verifies the structural invariants listed in the module essay.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut sum = 0u64;
        let mut prev_end: Option<u64> = None;
        let mut err = None;
        self.for_each(|s, l| {
            count += 1;
            sum += l;
            if err.is_none() {
                if l == 0 {
                    err = Some(format!("empty free extent at {s:#x}"));
                } else if let Some(pe) = prev_end
                    && s <= pe
                {
                    err = Some(format!(
                        "free extent at {s:#x} touches or overlaps the previous one (ends {pe:#x})"
                    ));
                }
            }
            prev_end = Some(s + l);
        });
        if let Some(e) = err {
            return Err(e);
        }
        if count != self.count {
            return Err(format!("{count} extents found, {} counted", self.count));
        }
        if sum != self.free_bytes {
            return Err(format!(
                "{sum} free bytes found, {} counted",
                self.free_bytes
            ));
        }
        self.check_node(self.root).map(|_| ())
    }

    /// Returns the subtree's max length after checking heap order and
    /// augmentation below `t`.
    fn check_node(&self, t: u32) -> Result<u64, String> {
        if t == NIL {
            return Ok(0);
        }
        let n = &self.nodes[t as usize];
        let mut max = n.len;
        for c in [n.left, n.right] {
            if c != NIL {
                if self.nodes[c as usize].priority > n.priority {
                    return Err(format!("heap order broken under extent {:#x}", n.start));
                }
                max = max.max(self.check_node(c)?);
            }
        }
        if max != n.max_len {
            return Err(format!(
                "max_len of extent {:#x} is {}, should be {max}",
                n.start, n.max_len
            ));
        }
        Ok(max)
    }

    fn insert(&mut self, start: u64, len: u64) {
        let node = self.new_node(start, len);
        let (l, r) = self.split(self.root, start);
        let l = self.merge(l, node);
        self.root = self.merge(l, r);
        self.count += 1;
    }

    /// Removes the extent starting exactly at `start` (which must exist).
    fn remove(&mut self, start: u64) {
        let (l, r) = self.split(self.root, start);
        let (m, r) = self.split(r, start + 1);
        assert!(
            m != NIL && self.nodes[m as usize].start == start,
            "remove: no free extent starts at {start:#x} (caller checked it exists)"
        );
        debug_assert!(self.nodes[m as usize].left == NIL && self.nodes[m as usize].right == NIL);
        self.vacant.push(m);
        self.root = self.merge(l, r);
        self.count -= 1;
    }

    fn new_node(&mut self, start: u64, len: u64) -> u32 {
        self.priority_counter += 1;
        let node = Node {
            start,
            len,
            max_len: len,
            priority: splitmix64(self.priority_counter),
            left: NIL,
            right: NIL,
        };
        match self.vacant.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                let i = u32::try_from(self.nodes.len())
                    .ok()
                    .filter(|&i| i != NIL)
                    .expect(
                        "free extents are bounded by MAX_REGIONS + MAX_POOLS, far below u32::MAX",
                    );
                self.nodes.push(node);
                i
            }
        }
    }

    fn update(&mut self, t: u32) {
        let n = self.nodes[t as usize];
        let mut max = n.len;
        if n.left != NIL {
            max = max.max(self.nodes[n.left as usize].max_len);
        }
        if n.right != NIL {
            max = max.max(self.nodes[n.right as usize].max_len);
        }
        self.nodes[t as usize].max_len = max;
    }

    /// Splits `t` into (starts < key, starts ≥ key).
    fn split(&mut self, t: u32, key: u64) -> (u32, u32) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.nodes[t as usize].start < key {
            let (l, r) = self.split(self.nodes[t as usize].right, key);
            self.nodes[t as usize].right = l;
            self.update(t);
            (t, r)
        } else {
            let (l, r) = self.split(self.nodes[t as usize].left, key);
            self.nodes[t as usize].left = r;
            self.update(t);
            (l, t)
        }
    }

    /// Joins two treaps where every start in `a` is below every start in `b`.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.nodes[a as usize].priority > self.nodes[b as usize].priority {
            let r = self.merge(self.nodes[a as usize].right, b);
            self.nodes[a as usize].right = r;
            self.update(a);
            a
        } else {
            let l = self.merge(a, self.nodes[b as usize].left);
            self.nodes[b as usize].left = l;
            self.update(b);
            b
        }
    }
}

fn checked_end(start: u64, len: u64) -> Result<u64, ExtentError> {
    match start.checked_add(len) {
        Some(end) if len > 0 => Ok(end),
        _ => Err(ExtentError::Malformed { start, len }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference: a sorted, coalesced `Vec<(start, len)>`.
    #[derive(Debug, Default)]
    struct Model(Vec<(u64, u64)>);

    impl Model {
        fn first_fit(&self, len: u64) -> Option<u64> {
            self.0.iter().find(|e| e.1 >= len).map(|e| e.0)
        }
        fn carve(&mut self, start: u64, len: u64) -> bool {
            let Some(i) = self
                .0
                .iter()
                .position(|&(s, l)| s <= start && start + len <= s + l)
            else {
                return false;
            };
            let (s, l) = self.0.remove(i);
            let mut at = i;
            if start > s {
                self.0.insert(at, (s, start - s));
                at += 1;
            }
            if s + l > start + len {
                self.0.insert(at, (start + len, s + l - start - len));
            }
            true
        }
        fn release(&mut self, start: u64, len: u64) -> bool {
            if self
                .0
                .iter()
                .any(|&(s, l)| s < start + len && start < s + l)
            {
                return false;
            }
            self.0.push((start, len));
            self.0.sort_unstable();
            let mut out: Vec<(u64, u64)> = Vec::new();
            for &(s, l) in &self.0 {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == s => last.1 += l,
                    _ => out.push((s, l)),
                }
            }
            self.0 = out;
            true
        }
    }

    fn contents(f: &FreeExtents) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        f.for_each(|s, l| v.push((s, l)));
        v
    }

    #[test]
    fn release_coalesces_with_both_neighbours() {
        let mut f = FreeExtents::new();
        f.release(0, 100).unwrap();
        f.carve(10, 20).unwrap();
        f.carve(40, 10).unwrap();
        assert_eq!(contents(&f), vec![(0, 10), (30, 10), (50, 50)]);
        f.release(10, 20).unwrap();
        assert_eq!(contents(&f), vec![(0, 40), (50, 50)]);
        f.release(40, 10).unwrap();
        assert_eq!(contents(&f), vec![(0, 100)]);
        assert_eq!(f.free_bytes(), 100);
        f.check().unwrap();
    }

    #[test]
    fn double_release_and_carving_used_space_are_refused_without_change() {
        let mut f = FreeExtents::new();
        f.release(0, 100).unwrap();
        f.carve(20, 20).unwrap();
        let before = contents(&f);
        assert_eq!(
            f.release(30, 20),
            Err(ExtentError::OverlapsFree { start: 30, len: 20 })
        );
        assert_eq!(
            f.release(10, 5),
            Err(ExtentError::OverlapsFree { start: 10, len: 5 })
        );
        assert_eq!(
            f.carve(20, 5),
            Err(ExtentError::NotFree { start: 20, len: 5 })
        );
        assert_eq!(
            f.carve(35, 10),
            Err(ExtentError::NotFree { start: 35, len: 10 })
        );
        assert_eq!(
            f.carve(u64::MAX, 2),
            Err(ExtentError::Malformed {
                start: u64::MAX,
                len: 2
            })
        );
        assert_eq!(
            f.release(5, 0),
            Err(ExtentError::Malformed { start: 5, len: 0 })
        );
        assert_eq!(contents(&f), before);
        f.check().unwrap();
    }

    #[test]
    fn first_fit_takes_the_lowest_address_not_the_best_fit() {
        let mut f = FreeExtents::new();
        f.release(0, 1000).unwrap();
        f.carve(50, 100).unwrap(); // free: [0,50) [150,1000)
        f.carve(160, 10).unwrap(); // free: [0,50) [150,160) [170,1000)
        assert_eq!(f.first_fit(10), Some(0));
        assert_eq!(f.first_fit(51), Some(170));
        assert_eq!(f.first_fit(10_000), None);
        assert_eq!(f.largest(), 830);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        CarveAt(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..40).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
            (0u64..1100, 1u64..30).prop_map(|(s, l)| Op::CarveAt(s, l)),
        ]
    }

    proptest! {
        #[test]
        fn matches_a_sorted_list_under_random_alloc_and_free(ops in prop::collection::vec(op(), 1..300)) {
            let mut f = FreeExtents::new();
            let mut m = Model::default();
            f.release(0, 1000).unwrap();
            m.release(0, 1000);
            let mut used: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let got = f.first_fit(len);
                        prop_assert_eq!(got, m.first_fit(len));
                        if let Some(s) = got {
                            f.carve(s, len).unwrap();
                            prop_assert!(m.carve(s, len));
                            used.push((s, len));
                        }
                    }
                    Op::Free(i) => {
                        if !used.is_empty() {
                            let (s, l) = used.swap_remove(i % used.len());
                            f.release(s, l).unwrap();
                            prop_assert!(m.release(s, l));
                            // A second release of the same extent must fail.
                            prop_assert!(f.release(s, l).is_err());
                        }
                    }
                    Op::CarveAt(s, l) => {
                        let ok = f.carve(s, l).is_ok();
                        prop_assert_eq!(ok, m.carve(s, l));
                        if ok {
                            used.push((s, l));
                        }
                    }
                }
                prop_assert_eq!(contents(&f), m.0.clone());
                prop_assert_eq!(f.largest(), m.0.iter().map(|e| e.1).max().unwrap_or(0));
                prop_assert_eq!(f.count(), m.0.len());
                if let Err(e) = f.check() {
                    prop_assert!(false, "invariant: {}", e);
                }
            }
        }
    }
}
