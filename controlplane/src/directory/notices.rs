//! Freed-page notices: the per-owner queue that hands deleted keys' pages back
//! to the instance that owns their region (DESIGN §3, page reclamation (c)).
//!
//! Notices are numbered per instance from 1 with no gaps. Every response to
//! the owner carries the oldest unacknowledged ones, in order; the owner
//! applies those above the highest number it already applied and acknowledges
//! that number in its next request (`Caller::notice_ack`), which removes them
//! here. A reply lost on the way is therefore harmless: the same notices ride
//! on the next response. The owner's allocator additionally ignores a notice
//! whose generation is stale, so a page is never freed twice. Because a
//! `register` reply can be lost and retried, a notice may reach the owner
//! before the reply that registered its page; the owner must then remember
//! the page as already freed when the reply arrives.

use std::collections::VecDeque;

use cxlkv_dataplane::ids::{Generation, PageIndex, RegionId};

use super::error::DirectoryError;
use super::types::FreedPageNotice;

#[derive(Debug)]
pub(crate) struct NoticeQueue {
    /// Number of the next notice issued.
    next_seq: u64,
    queue: VecDeque<FreedPageNotice>,
}

impl NoticeQueue {
    /// A queue whose first notice will be numbered `first_seq` (≥ 1).
    pub fn new(first_seq: u64) -> Self {
        debug_assert!(first_seq >= 1);
        Self {
            next_seq: first_seq,
            queue: VecDeque::new(),
        }
    }

    pub fn highest_issued(&self) -> u64 {
        self.next_seq - 1
    }

    pub fn pending(&self) -> usize {
        self.queue.len()
    }

    /// The owner applied every notice up to `ack`.
    pub fn ack(&mut self, ack: u64) -> Result<(), DirectoryError> {
        if ack > self.highest_issued() {
            return Err(DirectoryError::NoticeAckAhead {
                ack,
                highest_issued: self.highest_issued(),
            });
        }
        while self.queue.front().is_some_and(|n| n.seq <= ack) {
            self.queue.pop_front();
        }
        Ok(())
    }

    /// Queues a notice (the caller checked the queue limit beforehand).
    pub fn push(&mut self, region: RegionId, page: PageIndex, generation: Generation) {
        self.queue.push_back(FreedPageNotice {
            seq: self.next_seq,
            region,
            page,
            generation,
        });
        self.next_seq += 1;
    }

    /// The oldest `max` unacknowledged notices.
    pub fn oldest(&self, max: usize) -> Vec<FreedPageNotice> {
        self.queue.iter().take(max).copied().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &FreedPageNotice> {
        self.queue.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acknowledged_notices_are_not_resent_and_acks_cannot_run_ahead() {
        let mut q = NoticeQueue::new(1);
        for p in 0..3 {
            q.push(RegionId(1), PageIndex(p), Generation(1));
        }
        assert_eq!(
            q.oldest(2).iter().map(|n| n.seq).collect::<Vec<_>>(),
            [1, 2]
        );
        q.ack(2).unwrap();
        assert_eq!(q.oldest(8).iter().map(|n| n.seq).collect::<Vec<_>>(), [3]);
        q.ack(1).unwrap();
        assert_eq!(q.pending(), 1, "an older ack changes nothing");
        assert_eq!(
            q.ack(4),
            Err(DirectoryError::NoticeAckAhead {
                ack: 4,
                highest_issued: 3
            })
        );
        assert_eq!(q.pending(), 1);
    }
}
