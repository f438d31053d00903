//! The optional full LRU: an intrusive doubly-linked list over entry slots,
//! kept in a vector parallel to the key slab (so it costs nothing when LRU
//! eviction is off).
//!
//! Invariant: an entry is on the list iff it is live and unpinned. Pinning a
//! key unlinks it and releasing its last pin links it at the most-recent end,
//! so the least-recent end is always evictable: eviction, touch, link and
//! unlink are each O(1), with no skipping over pinned keys.
//!
//! Eviction may still pass over a key (its owner can take no more freed-page
//! notices). Such a key keeps its place — moving it to the most-recent end
//! would rank a stalled owner's cold keys above everyone's recently used
//! ones — and the list keeps a *resume point*: the next scan of the same
//! eviction round starts there instead of walking over the same keys
//! again. Every key less recent than the resume point was passed over in
//! this round (keys are only ever linked at the most-recent end); unlinking
//! the resume point moves it to its more recent neighbour, so it always
//! names a linked slot or none.

use super::keys::NIL;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link {
    prev: NIL,
    next: NIL,
};

#[derive(Debug)]
pub(crate) struct Lru {
    links: Vec<Link>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    len: usize,
    /// Where the next eviction scan starts ([`NIL`]: at `tail`).
    resume: u32,
}

impl Lru {
    pub fn new() -> Self {
        Self {
            links: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
            resume: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Links `slot` at the most-recent end. It must not be linked.
    pub fn link_front(&mut self, slot: u32) {
        let i = slot as usize;
        if i >= self.links.len() {
            self.links.resize(i + 1, UNLINKED);
        }
        debug_assert!(!self.is_linked(slot), "slot {slot} linked twice");
        self.links[i] = Link {
            prev: NIL,
            next: self.head,
        };
        if self.head != NIL {
            self.links[self.head as usize].prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
        self.len += 1;
    }

    /// Unlinks `slot`. It must be linked.
    pub fn unlink(&mut self, slot: u32) {
        debug_assert!(self.is_linked(slot), "slot {slot} not linked");
        let Link { prev, next } = self.links[slot as usize];
        if prev != NIL {
            self.links[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.links[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.links[slot as usize] = UNLINKED;
        self.len -= 1;
        if self.resume == slot {
            self.resume = prev;
        }
    }

    /// Moves a linked `slot` to the most-recent end.
    pub fn touch(&mut self, slot: u32) {
        if self.head != slot {
            self.unlink(slot);
            self.link_front(slot);
        }
    }

    /// The least recently used slot (tests).
    #[cfg(test)]
    pub fn least_recent(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// Where an eviction scan starts: the resume point, or the least
    /// recently used slot.
    pub fn scan_start(&self) -> Option<u32> {
        let start = if self.resume != NIL {
            self.resume
        } else {
            self.tail
        };
        (start != NIL).then_some(start)
    }

    /// The next more recently used slot after a linked `slot`.
    pub fn more_recent(&self, slot: u32) -> Option<u32> {
        debug_assert!(self.is_linked(slot), "slot {slot} not linked");
        let prev = self.links[slot as usize].prev;
        (prev != NIL).then_some(prev)
    }

    /// Sets where the next scan starts: a linked slot, or `None` for the
    /// least recently used one.
    pub fn set_resume(&mut self, slot: Option<u32>) {
        debug_assert!(
            slot.is_none_or(|s| self.is_linked(s)),
            "resume at an unlinked slot"
        );
        self.resume = slot.unwrap_or(NIL);
    }

    /// The resume point, if set (checks and the state digest).
    pub fn resume(&self) -> Option<u32> {
        (self.resume != NIL).then_some(self.resume)
    }

    pub fn is_linked(&self, slot: u32) -> bool {
        self.links
            .get(slot as usize)
            .is_some_and(|l| l.prev != NIL || l.next != NIL || self.head == slot)
    }

    /// Slots from least to most recent (checks).
    pub fn iter_from_least_recent(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.tail;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let slot = cur;
            cur = self.links[slot as usize].prev;
            Some(slot)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_follows_use_and_unlinking_keeps_the_list_whole() {
        let mut lru = Lru::new();
        for s in 0..4 {
            lru.link_front(s);
        }
        lru.touch(0);
        assert_eq!(
            lru.iter_from_least_recent().collect::<Vec<_>>(),
            [1, 2, 3, 0]
        );
        lru.unlink(2);
        lru.unlink(1);
        assert_eq!(lru.least_recent(), Some(3));
        assert_eq!(lru.len(), 2);
        lru.unlink(0);
        lru.unlink(3);
        assert_eq!(lru.least_recent(), None);
        assert!(!lru.is_linked(3));
    }

    #[test]
    fn the_resume_point_moves_to_the_more_recent_neighbour_when_unlinked() {
        let mut lru = Lru::new();
        for s in 0..4 {
            lru.link_front(s);
        }
        // Least to most recent: 0 1 2 3.
        assert_eq!(lru.scan_start(), Some(0));
        lru.set_resume(Some(1));
        assert_eq!(lru.scan_start(), Some(1));
        lru.touch(1);
        assert_eq!(lru.resume(), Some(2), "touched away: its neighbour");
        lru.unlink(2);
        assert_eq!(lru.resume(), Some(3));
        assert_eq!(lru.more_recent(3), Some(1));
        lru.touch(3);
        assert_eq!(lru.resume(), Some(1));
        lru.unlink(1);
        assert_eq!(lru.resume(), Some(3), "the most recent");
        lru.unlink(3);
        assert_eq!(lru.resume(), None, "past the most recent: start over");
        assert_eq!(lru.scan_start(), Some(0));
    }
}
