//! Statistics: counters kept as the directory runs, latency histograms the
//! driver feeds (the directory never reads a clock), and the snapshot type
//! [`DirectoryStats`] that `Directory::stats` assembles on demand.

use std::time::Duration;

use cxlkv_dataplane::ids::PoolId;

use super::types::{InstanceId, OpKind, SessionId};

/// A log-linear latency histogram over nanoseconds: exact below 8 ns, then 8
/// buckets per power of two (≤ 12.5 % relative error). Fixed size, no
/// allocation when recording.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    buckets: Box<[u64; BUCKETS]>,
    count: u64,
    max_ns: u64,
}

const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = (SUB + (64 - SUB_BITS as u64) * SUB) as usize;

impl Histogram {
    pub fn new() -> Self {
        Self {
            buckets: Box::new([0; BUCKETS]),
            count: 0,
            max_ns: 0,
        }
    }

    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let e = 63 - v.leading_zeros();
        let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
        (SUB + u64::from(e - SUB_BITS) * SUB + sub) as usize
    }

    /// The largest value that falls in bucket `i`.
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let e = (i - SUB) / SUB + u64::from(SUB_BITS);
        let sub = (i - SUB) % SUB;
        let low = (1u64 << e) | (sub << (e - u64::from(SUB_BITS)));
        low.saturating_add((1u64 << (e - u64::from(SUB_BITS))) - 1)
    }

    pub fn record(&mut self, ns: u64) {
        self.buckets[Self::index(ns)] += 1;
        self.count += 1;
        self.max_ns = self.max_ns.max(ns);
    }

    /// The `pct` percentile (0..=100), as the upper edge of its bucket.
    pub fn percentile(&self, pct: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((pct / 100.0) * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Self::upper(i).min(self.max_ns);
            }
        }
        self.max_ns
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            p50_ns: self.percentile(50.0),
            p99_ns: self.percentile(99.0),
            max_ns: self.max_ns,
        }
    }
}

/// Percentiles of one operation's latency, as recorded by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// Calls, keys and refusals of one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpCounters {
    pub calls: u64,
    /// Batch entries processed (0 for unbatched operations).
    pub keys: u64,
    /// Calls refused with a `DirectoryError`.
    pub errors: u64,
}

/// What the operations answered, summed since start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutcomeCounters {
    pub inserted: u64,
    pub duplicate: u64,
    pub rejected: u64,
    /// Rejections for a stale generation (a subset of `rejected`).
    pub stale_generation: u64,
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    pub exists_hits: u64,
    pub exists_misses: u64,
    pub pins_taken: u64,
    pub deleted: u64,
    pub delete_pinned: u64,
    pub delete_missing: u64,
    pub unpinned: u64,
    /// Unpins of pins the session did not hold (double unpins).
    pub not_pinned: u64,
    /// Retried requests answered from the reply cache.
    pub retries_answered: u64,
    pub sequence_too_old: u64,
    pub replies_evicted: u64,
    pub notices_issued: u64,
    pub sessions_expired: u64,
    pub sessions_closed: u64,
    pub sessions_ended_by_admin: u64,
    pub instances_gone: u64,
    pub regions_granted: u64,
    pub regions_returned: u64,
    /// Regions given back to the pool manager, all causes: returned by
    /// their owner; a gone owner's, at once or with their last key; grants
    /// refused (short, over the quota) or whose requester had left; and
    /// regions left unclaimed after a restart.
    pub regions_freed: u64,
    /// Regions whose free waited for their last key (owner gone with keys).
    pub regions_deferred: u64,
}

/// Keys removed by the directory's own capacity policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EvictionCounters {
    pub orphan_keys: u64,
    pub lru_keys: u64,
    /// LRU candidates passed over because their owner's notice queue was full.
    pub lru_skipped: u64,
}

/// One operation's counters and latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpStats {
    pub op: OpKind,
    pub counters: OpCounters,
    pub latency: LatencySummary,
}

/// One instance's view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceStats {
    pub instance: InstanceId,
    pub sessions: usize,
    /// Waiting for a reattach after a directory restart.
    pub awaiting_reattach: bool,
    pub regions: usize,
    pub owned_bytes: u64,
    pub pending_region_bytes: u64,
    pub keys: u64,
    pub used_bytes: u64,
    pub pins_held: u64,
    pub notices_pending: usize,
    pub cached_replies: usize,
    pub cached_reply_bytes: usize,
    pub quota_bytes: Option<u64>,
}

/// One pool's view from this directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub pool: PoolId,
    pub regions: u64,
    pub region_bytes: u64,
    /// Regions whose owner is gone (freed when their last key goes).
    pub orphaned_regions: u64,
    pub keys: u64,
    pub used_bytes: u64,
    /// As last reported by the pool manager (0 if never).
    pub reported_total_bytes: u64,
    /// Reported free bytes adjusted by this directory's allocations and frees
    /// since the report.
    pub estimated_free_bytes: u64,
}

/// A pin held longer than the configured threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LongHeldPin {
    pub session: SessionId,
    pub instance: InstanceId,
    pub pins: u32,
    pub held_for: Duration,
}

/// Pins held longer than `threshold`: all counted, the oldest listed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LongHeldPins {
    pub threshold: Duration,
    /// `(session, key)` pairs whose first pin is older than the threshold.
    pub count: u64,
    /// The oldest of them, oldest first.
    pub oldest: Vec<LongHeldPin>,
}

/// A snapshot of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectoryStats {
    pub directory_epoch: u64,
    pub keys: u64,
    /// Registered keys × their layout's page size.
    pub page_bytes: u64,
    /// Sum of registered lengths.
    pub value_bytes: u64,
    pub key_bytes: u64,
    pub pins: u64,
    pub pinned_keys: u64,
    /// (session, key) pairs with pins held: what `max_pinned_entries`
    /// bounds (a pinning lookup that could cross it is refused `busy`).
    /// Kept as a running count, not walked.
    pub pinned_entries: u64,
    /// `DirectoryConfig::max_pinned_entries`, for the ratio.
    pub max_pinned_entries: u64,
    /// Bytes the sessions' pin ledgers hold
    /// ([`Directory::pin_ledger_bytes`](super::Directory::pin_ledger_bytes)):
    /// a running count of their buckets, not walked.
    pub pin_ledger_bytes: u64,
    pub sessions: u64,
    pub instances: u64,
    pub regions: u64,
    pub region_bytes: u64,
    pub orphaned_regions: u64,
    pub pending_region_requests: u64,
    /// Layouts in use: held by a region or a pending region request.
    pub layouts: u64,
    pub per_instance: Vec<InstanceStats>,
    pub per_pool: Vec<PoolStats>,
    pub ops: Vec<OpStats>,
    pub outcomes: OutcomeCounters,
    pub evictions: EvictionCounters,
    pub long_held_pins: LongHeldPins,
}

/// The running counters.
#[derive(Debug, Clone)]
pub(crate) struct Counters {
    pub ops: [OpCounters; OpKind::ALL.len()],
    pub latency: Vec<Histogram>,
    pub outcomes: OutcomeCounters,
    pub evictions: EvictionCounters,
}

impl Counters {
    pub fn new() -> Self {
        Self {
            ops: [OpCounters::default(); OpKind::ALL.len()],
            latency: OpKind::ALL.iter().map(|_| Histogram::new()).collect(),
            outcomes: OutcomeCounters::default(),
            evictions: EvictionCounters::default(),
        }
    }

    pub fn op(&mut self, op: OpKind) -> &mut OpCounters {
        &mut self.ops[op.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_bound_every_value_within_an_eighth() {
        for v in [
            0u64,
            1,
            7,
            8,
            9,
            15,
            16,
            17,
            1000,
            123_456,
            u64::MAX / 3,
            u64::MAX,
        ] {
            let i = Histogram::index(v);
            assert!(i < BUCKETS);
            let up = Histogram::upper(i);
            assert!(up >= v, "{v} > upper {up}");
            assert!(up - v <= v / 8 + 1, "{v}: bucket too wide ({up})");
            if i > 0 {
                assert!(Histogram::upper(i - 1) < v, "{v} belongs to a lower bucket");
            }
        }
    }

    #[test]
    fn percentiles_follow_the_recorded_distribution() {
        let mut h = Histogram::new();
        for ns in 1..=1000 {
            h.record(ns);
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        assert!((450..=570).contains(&s.p50_ns), "{s:?}");
        assert!((980..=1000).contains(&s.p99_ns), "{s:?}");
        assert_eq!(s.max_ns, 1000);
    }
}
