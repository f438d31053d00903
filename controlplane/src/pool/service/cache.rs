//! The per-directory reply cache of the exactly-once rules
//! (`docs/protocol.md`, "Exactly-once effects"): the last
//! [`REPLY_CACHE_LEN`](super::REPLY_CACHE_LEN) answers to a directory's
//! mutating requests, by `seq`.
//!
//! A cached `seq` is answered from the cache without running again; a `seq`
//! at or below the highest one evicted is `SequenceTooOld` (whether it ran
//! cannot be told); anything else runs. Eviction takes the lowest `seq`
//! first, so out-of-order arrivals within the window are fine.

use std::collections::BTreeMap;

use crate::proto::{ErrorCode, RegionHandle};

use super::PoolServiceError;

/// A cached answer (only mutating requests are cached).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cached {
    Allocated(RegionHandle),
    Freed { region: u64 },
    Failed(PoolServiceError),
}

/// What the cache says about an incoming `seq`.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Answer with this, do not run.
    Replay(Cached),
    /// Refuse: the `seq` fell out of the window.
    TooOld(PoolServiceError),
    /// Run the request, then [`SeqCache::insert`] its answer.
    Run,
}

#[derive(Debug)]
pub(crate) struct SeqCache {
    entries: BTreeMap<u64, Cached>,
    capacity: usize,
    /// Highest `seq` evicted so far (0: none).
    evicted_max: u64,
    /// Highest `seq` ever run for this directory in this process.
    highest: u64,
}

impl SeqCache {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "a reply cache holds at least one reply");
        Self {
            entries: BTreeMap::new(),
            capacity,
            evicted_max: 0,
            highest: 0,
        }
    }

    pub fn check(&self, seq: u64) -> Verdict {
        if let Some(c) = self.entries.get(&seq) {
            return Verdict::Replay(c.clone());
        }
        if seq <= self.evicted_max {
            let oldest = self.entries.keys().next().copied().unwrap_or(self.highest);
            return Verdict::TooOld(PoolServiceError::new(
                ErrorCode::SequenceTooOld,
                format!(
                    "seq {seq} is older than the reply cache (oldest cached seq {oldest}); list the regions to find out what happened"
                ),
                oldest,
            ));
        }
        Verdict::Run
    }

    pub fn insert(&mut self, seq: u64, answer: Cached) {
        self.highest = self.highest.max(seq);
        self.entries.insert(seq, answer);
        while self.entries.len() > self.capacity {
            let (evicted, _) = self.entries.pop_first().expect("over capacity, not empty");
            self.evicted_max = self.evicted_max.max(evicted);
        }
    }

    /// The highest `seq` run (for `PoolWelcome.last_seq`).
    pub fn highest(&self) -> u64 {
        self.highest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_seqs_replay_evicted_ones_are_too_old_and_new_ones_run() {
        let mut c = SeqCache::new(2);
        assert!(matches!(c.check(5), Verdict::Run));
        c.insert(5, Cached::Freed { region: 5 });
        c.insert(7, Cached::Freed { region: 7 });
        // Out of order inside the window: still runs.
        assert!(matches!(c.check(6), Verdict::Run));
        c.insert(6, Cached::Freed { region: 6 });
        // 5 was evicted (lowest first).
        match c.check(5) {
            Verdict::TooOld(e) => {
                assert_eq!(e.error_code(), Some(ErrorCode::SequenceTooOld));
                assert_eq!(e.limit, 6);
            }
            other => panic!("expected too old, got {other:?}"),
        }
        assert!(matches!(c.check(4), Verdict::TooOld(_)));
        assert!(matches!(
            c.check(7),
            Verdict::Replay(Cached::Freed { region: 7 })
        ));
        assert!(matches!(c.check(8), Verdict::Run));
        assert_eq!(c.highest(), 7);
    }
}
