//! Interned layouts: `Layout` ↔ a small index, counted by their users.
//!
//! Keys and regions name their layout by a `u32` index (the key index folds
//! it into a key's hash; a region record keeps it). An index is held by
//! every region record of its layout and by every region request still
//! waiting for the pool manager; a key lives in a region of its own layout,
//! so it needs no count of its own. When the last holder goes, the layout
//! is forgotten and its index is reused.
//!
//! Why release: `max_layouts` bounds the layouts in use at once, not the
//! layouts ever seen. A directory that interned layouts forever would, after
//! a long enough uptime of fleets cycling models (each model its own
//! layout), refuse every new layout until restarted. Reusing an index is
//! safe because nothing outlives its last holder: no region of the layout
//! is left, so no key is, and a reply or a statistic names the `Layout`
//! itself, never its index.

use std::collections::HashMap;

use foldhash::fast::FixedState;

use super::types::Layout;

#[derive(Debug)]
pub(crate) struct LayoutTable {
    /// The layout at each index; stale at a free index.
    layouts: Vec<Layout>,
    /// Holders per index (region records and pending region requests); 0
    /// at a free index.
    holders: Vec<u32>,
    ix: HashMap<Layout, u32, FixedState>,
    /// Indexes whose layout was forgotten, for reuse.
    free: Vec<u32>,
}

impl LayoutTable {
    pub fn new(seed: u64) -> Self {
        Self {
            layouts: Vec::new(),
            holders: Vec::new(),
            ix: HashMap::with_hasher(FixedState::with_seed(seed)),
            free: Vec::new(),
        }
    }

    /// The index of `layout` while something holds it.
    #[inline]
    pub fn get(&self, layout: &Layout) -> Option<u32> {
        self.ix.get(layout).copied()
    }

    /// The layout at a held index.
    #[inline]
    pub fn layout(&self, ix: u32) -> Layout {
        debug_assert!(self.holders[ix as usize] > 0, "layout index {ix} is free");
        self.layouts[ix as usize]
    }

    /// Layouts held.
    pub fn len(&self) -> usize {
        self.ix.len()
    }

    /// One more holder of `layout`, interning it if nobody held it; its
    /// index. The caller checked the `max_layouts` limit.
    pub fn acquire(&mut self, layout: Layout) -> u32 {
        let ix = match self.ix.get(&layout) {
            Some(&ix) => ix,
            None => {
                let ix = match self.free.pop() {
                    Some(ix) => {
                        self.layouts[ix as usize] = layout;
                        ix
                    }
                    None => {
                        let ix = u32::try_from(self.layouts.len())
                            .expect("invariant: max_layouts fits u32");
                        self.layouts.push(layout);
                        self.holders.push(0);
                        ix
                    }
                };
                self.ix.insert(layout, ix);
                ix
            }
        };
        self.holders[ix as usize] += 1;
        ix
    }

    /// One holder of index `ix` fewer; the last one forgets the layout.
    pub fn release(&mut self, ix: u32) {
        let held = &mut self.holders[ix as usize];
        *held = held
            .checked_sub(1)
            .expect("invariant: a layout index is released once per holder");
        if *held == 0 {
            let removed = self.ix.remove(&self.layouts[ix as usize]);
            debug_assert_eq!(removed, Some(ix));
            self.free.push(ix);
        }
    }

    /// Every held layout with its index and holder count, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, Layout, u32)> + '_ {
        self.layouts
            .iter()
            .zip(&self.holders)
            .enumerate()
            .filter(|(_, (_, h))| **h > 0)
            .map(|(ix, (l, h))| (ix as u32, *l, *h))
    }

    /// Whether the map and the holder counts agree (for `check_invariants`).
    pub fn consistent(&self) -> Result<(), String> {
        for (ix, layout, _) in self.iter() {
            if self.ix.get(&layout) != Some(&ix) {
                return Err(format!("held layout index {ix} is not in the map"));
            }
        }
        if self.iter().count() != self.ix.len() {
            return Err("the layout map names an index nobody holds".into());
        }
        if self.free.len() + self.ix.len() != self.layouts.len() {
            return Err("a layout index is neither held nor free".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(fingerprint: u64) -> Layout {
        Layout {
            page_size_bytes: 4096,
            fingerprint,
        }
    }

    #[test]
    fn a_layout_is_forgotten_with_its_last_holder_and_its_index_reused() {
        let mut t = LayoutTable::new(1);
        let a = t.acquire(l(1));
        assert_eq!(t.acquire(l(1)), a, "the same layout, the same index");
        let b = t.acquire(l(2));
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        t.release(a);
        assert_eq!(t.get(&l(1)), Some(a), "one holder left");
        t.release(a);
        assert_eq!(t.get(&l(1)), None, "forgotten");
        assert_eq!(t.len(), 1);
        let c = t.acquire(l(3));
        assert_eq!(c, a, "the free index is reused");
        assert_eq!(t.layout(c), l(3));
        assert_eq!(t.layout(b), l(2));
        t.consistent().unwrap();
        let held: Vec<_> = t.iter().collect();
        assert_eq!(held, vec![(a, l(3), 1), (b, l(2), 1)]);
    }
}
