//! The answers a directory's last tagged allocations got, so that every copy
//! of one `Alloc` gets the same answer (exactly-once).
//!
//! A tag alone, looked up in the ledger, makes a retry idempotent only while
//! the region it allocated is live. A copy that arrives after the first one
//! *failed* (say `NoSpace`, and space was freed since), or after the region
//! it allocated was freed, would otherwise run again and allocate a region
//! that no answer the directory still waits for will ever name: a leak (the
//! deterministic simulation found both, seeds 23,819 and 55,862). So the
//! manager keeps, per directory, the answer of each of its last
//! [`TAG_ANSWERS_PER_DIRECTORY`] tagged allocations: a failure is replayed as
//! it was; a success whose region has left the ledger is answered
//! `RegionAlreadyFreed` for that region — never the old handle, which would
//! hand out space that may belong to someone else by now.
//!
//! Why a count-bounded window is enough: a directory speaks through one
//! connection at a time (`DirectoryAttachedElsewhere`), a connection is an
//! ordered stream with at most `MAX_INFLIGHT_PER_CONN` requests in flight,
//! and every request that runs between two copies of one request was sent
//! before the second copy and not yet answered — so fewer than that many
//! other tagged allocations separate two copies.
//!
//! Why it is volatile (not journaled, not in the checkpoint): a copy can only
//! reach the manager process its connection was opened to. After a restart
//! the directory reconnects and resends only the requests it has no answer
//! for; a copy of a request it already has the answer of died with the old
//! connection. The answers are also dropped when the directory's entry is
//! (its caller gone and no regions left): its connection is closed then too.
//!
//! Memory: at most [`TAG_ANSWERS_PER_DIRECTORY`] answers per tracked
//! directory; a look-up is a linear scan of them, small next to the journal
//! write an allocation costs.

use std::collections::VecDeque;

use super::manager::PoolError;
use super::types::{AllocTag, RegionId};

/// Tagged-allocation answers remembered per directory: at least the
/// in-flight bound of one pool connection (`service::MAX_INFLIGHT_PER_CONN`,
/// checked there), the same window as the service's reply cache.
pub const TAG_ANSWERS_PER_DIRECTORY: usize = 256;

/// How one tagged allocation was answered when it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TagAnswer {
    Allocated(RegionId),
    Refused(PoolError),
}

/// One directory's window of answers, oldest first.
#[derive(Debug, Clone, Default)]
pub(crate) struct TagAnswers {
    answers: VecDeque<(AllocTag, TagAnswer)>,
}

impl TagAnswers {
    pub fn get(&self, tag: AllocTag) -> Option<&TagAnswer> {
        self.answers
            .iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, answer)| answer)
    }

    /// Remembers the answer of a tagged allocation that ran (a tag runs at
    /// most once while it is in the window, so it is not there yet).
    pub fn remember(&mut self, tag: AllocTag, answer: TagAnswer) {
        debug_assert!(
            tag != AllocTag::NONE,
            "untagged allocations are not retried"
        );
        debug_assert!(self.get(tag).is_none(), "a tag in the window never runs");
        if self.answers.len() == TAG_ANSWERS_PER_DIRECTORY {
            self.answers.pop_front();
        }
        self.answers.push_back((tag, answer));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.answers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_answer_leaves_the_window_first() {
        let mut a = TagAnswers::default();
        for t in 1..=TAG_ANSWERS_PER_DIRECTORY as u64 + 1 {
            a.remember(AllocTag(t), TagAnswer::Allocated(RegionId(t)));
        }
        assert_eq!(a.len(), TAG_ANSWERS_PER_DIRECTORY);
        assert_eq!(a.get(AllocTag(1)), None, "the oldest was evicted");
        assert_eq!(a.get(AllocTag(2)), Some(&TagAnswer::Allocated(RegionId(2))));
        let last = TAG_ANSWERS_PER_DIRECTORY as u64 + 1;
        assert_eq!(
            a.get(AllocTag(last)),
            Some(&TagAnswer::Allocated(RegionId(last)))
        );
    }

    #[test]
    fn a_refusal_is_kept_as_it_was() {
        let mut a = TagAnswers::default();
        let e = PoolError::NoSpace {
            len_bytes: 4,
            pool: None,
            largest_free_bytes: 2,
        };
        a.remember(AllocTag(9), TagAnswer::Refused(e.clone()));
        assert_eq!(a.get(AllocTag(9)), Some(&TagAnswer::Refused(e)));
        assert_eq!(a.get(AllocTag(8)), None);
    }
}
