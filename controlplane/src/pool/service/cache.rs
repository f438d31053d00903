//! The per-directory reply cache of the exactly-once rules
//! (`docs/protocol.md`, "Exactly-once effects"): the last
//! [`REPLY_CACHE_LEN`](super::REPLY_CACHE_LEN) answers to a directory's
//! mutating requests, by `seq`, and [`exactly_once`], the one function that
//! decides whether a request runs.
//!
//! A cached `seq` is answered from the cache without running again; a `seq`
//! at or below the highest one evicted is `SequenceTooOld` (whether it ran
//! cannot be told); anything else runs. Eviction takes the lowest `seq`
//! first, so out-of-order arrivals within the window are fine.
//!
//! Sans-IO and generic over the cached answer, so that the simulation
//! (`crate::sim`) runs the same rule as the service's core, in front of the
//! same [`PoolManager`](crate::pool::PoolManager).

use std::collections::BTreeMap;

use crate::proto::{ErrorCode, RegionHandle};

use super::PoolServiceError;

/// A cached answer of the service (only mutating requests are cached).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cached {
    Allocated(RegionHandle),
    Freed { region: u64 },
    Failed(PoolServiceError),
}

/// What the cache says about an incoming `seq`.
#[derive(Debug)]
pub(crate) enum Verdict<T> {
    /// Answer with this, do not run.
    Replay(T),
    /// Refuse: the `seq` fell out of the window.
    TooOld(TooOld),
    /// Run the request, then [`SeqCache::insert`] its answer.
    Run,
}

/// A `seq` older than the reply cache: whether it ran cannot be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooOld {
    pub seq: u64,
    /// The oldest `seq` still cached (or the highest run, when none is).
    pub oldest: u64,
}

impl From<TooOld> for PoolServiceError {
    fn from(t: TooOld) -> Self {
        PoolServiceError::new(
            ErrorCode::SequenceTooOld,
            format!(
                "seq {} is older than the reply cache (oldest cached seq {}); list the regions to find out what happened",
                t.seq, t.oldest
            ),
            t.oldest,
        )
    }
}

#[derive(Debug)]
pub(crate) struct SeqCache<T> {
    entries: BTreeMap<u64, T>,
    capacity: usize,
    /// Highest `seq` evicted so far (0: none).
    evicted_max: u64,
    /// Highest `seq` ever run for this directory in this process.
    highest: u64,
}

impl<T: Clone> SeqCache<T> {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "a reply cache holds at least one reply");
        Self {
            entries: BTreeMap::new(),
            capacity,
            evicted_max: 0,
            highest: 0,
        }
    }

    pub fn check(&self, seq: u64) -> Verdict<T> {
        if let Some(c) = self.entries.get(&seq) {
            return Verdict::Replay(c.clone());
        }
        if seq <= self.evicted_max {
            let oldest = self.entries.keys().next().copied().unwrap_or(self.highest);
            return Verdict::TooOld(TooOld { seq, oldest });
        }
        Verdict::Run
    }

    pub fn insert(&mut self, seq: u64, answer: T) {
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

/// A directory's mutating request under the exactly-once rules: a cached
/// `seq` is answered from the cache without running `run`; one older than
/// the window is [`TooOld`]; anything else runs, and its answer — success or
/// the state machine's refusal, both in `T` — is cached. `run`'s own `Err`
/// is a refusal before the state machine (bad arguments): not cached, the
/// `seq` left unused.
///
/// An allocation's answer, run now or replayed, must then be kept at the
/// manager ([`PoolManager::keep_retried`](crate::pool::PoolManager::keep_retried)):
/// a replay may come on a later connection, after the first one's close
/// queued the region for reclaim.
pub(crate) fn exactly_once<T: Clone, E>(
    cache: &mut SeqCache<T>,
    seq: u64,
    run: impl FnOnce() -> Result<T, E>,
) -> Result<Result<T, E>, TooOld> {
    match cache.check(seq) {
        Verdict::Replay(answer) => Ok(Ok(answer)),
        Verdict::TooOld(t) => Err(t),
        Verdict::Run => {
            let answer = run();
            if let Ok(a) = &answer {
                cache.insert(seq, a.clone());
            }
            Ok(answer)
        }
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
            Verdict::TooOld(t) => {
                let e = PoolServiceError::from(t);
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

    #[test]
    fn a_request_runs_once_its_refusals_before_running_are_not_cached() {
        let mut c: SeqCache<u32> = SeqCache::new(4);
        let runs = std::cell::Cell::new(0);
        let once = |c: &mut SeqCache<u32>, seq, answer: Result<u32, &'static str>| {
            exactly_once(c, seq, || {
                runs.set(runs.get() + 1);
                answer
            })
        };
        assert_eq!(once(&mut c, 1, Ok(10)), Ok(Ok(10)));
        // The retry is answered from the cache, whatever it would do now.
        assert_eq!(once(&mut c, 1, Ok(99)), Ok(Ok(10)));
        // Refused before running: the seq stays unused and runs later.
        assert_eq!(once(&mut c, 2, Err("bad")), Ok(Err("bad")));
        assert_eq!(once(&mut c, 2, Ok(20)), Ok(Ok(20)));
        assert_eq!(runs.get(), 3);
        for seq in 3..=6 {
            assert_eq!(once(&mut c, seq, Ok(0)), Ok(Ok(0)));
        }
        assert_eq!(once(&mut c, 1, Ok(0)), Err(TooOld { seq: 1, oldest: 3 }));
    }
}
