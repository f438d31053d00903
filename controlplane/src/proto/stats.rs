//! The directory's statistics: one request, one reply shaped for three
//! consumers — `cxlkv stats` (one-shot report), `cxlkv top` (polled every
//! second, diffs the counters) and a Prometheus exporter (counters and gauges
//! as they are, latency as summary quantiles).
//!
//! Totals, per-operation counters and pools are always present; the larger
//! per-instance, per-session, per-region and long-pin tables only when asked
//! for, each capped at `max_rows` rows (at most [`MAX_STATS_ROWS`](super::MAX_STATS_ROWS)) with
//! `truncated` set when a table was cut. Counters are cumulative since the
//! directory started (`uptime_ms`); gauges are instantaneous. Keys never
//! appear.

use rkyv::{Archive, Deserialize, Serialize};

use super::common::{Layout, ReplyMeta, RequestMeta};

/// Bits of [`Stats::sections`]: which optional tables to include.
pub mod sections {
    /// [`super::StatsReply::instances`].
    pub const INSTANCES: u32 = 1 << 0;
    /// [`super::StatsReply::sessions`].
    pub const SESSIONS: u32 = 1 << 1;
    /// [`super::StatsReply::regions`].
    pub const REGIONS: u32 = 1 << 2;
    /// [`super::StatsReply::long_pins`].
    pub const LONG_PINS: u32 = 1 << 3;
    /// Every table.
    pub const ALL: u32 = INSTANCES | SESSIONS | REGIONS | LONG_PINS;
}

/// Asks for statistics (read-only).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Stats {
    pub meta: RequestMeta,
    /// Bits of [`sections`]; unknown bits are refused.
    pub sections: u32,
    /// Rows per optional table, at most [`MAX_STATS_ROWS`](super::MAX_STATS_ROWS).
    pub max_rows: u32,
}

/// Summary of a latency distribution (nanoseconds, since start), as the
/// directory's log-linear histogram reports it (each percentile is the
/// upper edge of its bucket: at most 12.5 % above the true value).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// Counters of one request kind.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct OpStats {
    /// A request [`Kind`](super::Kind) number.
    pub kind: u16,
    pub requests: u64,
    /// Keys (entries, regions) processed: a batch of 16 counts 16.
    pub items: u64,
    /// Requests the directory refused with an error.
    pub errors: u64,
    /// Time in the server, from the received frame to the queued reply.
    pub latency: LatencySummary,
}

/// Directory-wide gauges and counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct DirectoryTotals {
    /// Gauge: registered keys.
    pub keys: u64,
    /// Gauge: registered keys × their layout's page size.
    pub used_bytes: u64,
    /// Gauge: sum of registered chunk lengths.
    pub value_bytes: u64,
    /// Gauge: sum of key lengths.
    pub key_bytes: u64,
    /// Gauge: bytes of the regions the directory holds (owned or orphaned).
    pub owned_bytes: u64,
    pub regions: u64,
    /// Gauge: regions whose owner is gone, kept alive by their keys.
    pub deferred_regions: u64,
    /// Gauge: region requests waiting for the pool manager.
    pub pending_region_requests: u64,
    /// Gauge: pins held, all sessions.
    pub pins: u64,
    pub pinned_keys: u64,
    /// Gauge: instances with at least one session.
    pub instances_live: u64,
    /// Gauge: instances without a session, within their grace period (or
    /// awaiting their reattach after a restart).
    pub instances_absent: u64,
    pub sessions: u64,
    /// Gauge: freed-page notices not yet acknowledged.
    pub notices_pending: u64,
    pub layouts: u64,
    /// Gauge: (session, key) pairs pinned longer than the long-pin
    /// threshold.
    pub long_held_pins: u64,
    /// Counter: orphaned keys evicted at the watermark.
    pub evictions_orphan: u64,
    /// Counter: keys evicted by the optional server-side LRU.
    pub evictions_lru: u64,
    /// Counter: LRU candidates passed over (their owner's notice queue was
    /// full).
    pub evictions_lru_skipped: u64,
    /// Counter: sessions ended by lease expiry.
    pub sessions_expired: u64,
    /// Counter: sessions ended because their connection closed.
    pub sessions_closed: u64,
    /// Counter: sessions ended by `EndSession`.
    pub sessions_ended: u64,
    /// Counter: instances declared gone (grace expired, or taken over).
    pub instances_gone: u64,
    /// Counter: regions granted, returned by their owner, given back to the
    /// pool manager (all causes), and whose free waited for their last key.
    pub regions_granted: u64,
    pub regions_returned: u64,
    pub regions_freed: u64,
    pub regions_deferred: u64,
    /// Counter: freed-page notices issued.
    pub notices_issued: u64,
    /// Gauge: (session, key) pairs with pins held, all sessions: what
    /// `max_pinned_entries` bounds (a pinning lookup that could cross it
    /// is refused `Busy`).
    pub pinned_entries: u64,
    /// The directory's `max_pinned_entries`.
    pub max_pinned_entries: u64,
    /// Gauge: bytes the sessions' pin ledgers hold.
    pub pin_ledger_bytes: u64,
}

/// What the key operations answered, summed since start (counters).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct OutcomeTotals {
    pub inserted: u64,
    pub duplicate: u64,
    pub rejected: u64,
    /// Rejections for a stale page generation (a subset of `rejected`).
    pub stale_generation: u64,
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    pub exists_hits: u64,
    pub exists_misses: u64,
    pub pins_taken: u64,
    pub unpinned: u64,
    /// Unpins of pins the session did not hold (double unpins).
    pub not_pinned: u64,
    pub deleted: u64,
    pub delete_pinned: u64,
    pub delete_missing: u64,
    /// Retried requests answered from the reply cache.
    pub retries_answered: u64,
    pub sequence_too_old: u64,
    pub replies_evicted: u64,
}

/// One pool as the directory sees it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolRow {
    pub pool: u32,
    /// Allocatable bytes, as last reported by the pool manager.
    pub size_bytes: u64,
    /// Free bytes as last reported, adjusted by this directory's own
    /// allocations and frees since.
    pub free_bytes: u64,
    /// Regions of this directory in the pool, and their bytes.
    pub regions: u64,
    pub region_bytes: u64,
    pub orphaned_regions: u64,
    pub keys: u64,
    pub used_bytes: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct InstanceRow {
    pub instance_id: String,
    /// Sessions open now (0: the instance is within its grace period).
    pub sessions: u32,
    /// Recovered after a directory restart, its owner's reattach pending.
    pub awaiting_reattach: bool,
    pub regions: u32,
    pub owned_bytes: u64,
    /// Bytes of region requests waiting for the pool manager.
    pub pending_region_bytes: u64,
    pub used_bytes: u64,
    /// 0: no quota.
    pub quota_bytes: u64,
    pub keys: u64,
    /// Pins held by the instance's sessions.
    pub pins: u64,
    pub notices_pending: u32,
    /// Replies kept for exactly-once retries, and their bytes.
    pub cached_replies: u32,
    pub cached_reply_bytes: u64,
}

/// How a session is connected.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Transport {
    Unix = 0,
    Tcp = 1,
    /// In the server's own process (embedded client).
    InProcess = 2,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct SessionRow {
    pub session_id: u64,
    pub instance_id: String,
    pub transport: Transport,
    /// From `SO_PEERCRED` on Unix sockets; 0 when unknown.
    pub pid: u32,
    pub uid: u32,
    pub age_ms: u64,
    /// Since the session's last request.
    pub idle_ms: u64,
    pub requests: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionRow {
    pub region: u64,
    pub pool: u32,
    pub layout: Layout,
    pub len_bytes: u64,
    /// The instance the region was allocated for.
    pub owner_instance: String,
    pub owner_present: bool,
    /// Keys registered in the region.
    pub keys: u64,
    /// `keys` × the layout's page size.
    pub used_bytes: u64,
    /// Its owner is gone and its keys keep it alive: freed with its last key.
    pub deferred: bool,
}

/// A session holding a pin for longer than the directory's long-pin
/// threshold.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct LongPinRow {
    pub session_id: u64,
    pub instance_id: String,
    /// Pins this session holds on the key.
    pub pins: u32,
    /// Since the session's oldest pin on the key was taken.
    pub held_ms: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct StatsReply {
    pub meta: ReplyMeta,
    pub directory_id: String,
    pub directory_epoch: u64,
    pub uptime_ms: u64,
    pub totals: DirectoryTotals,
    pub outcomes: OutcomeTotals,
    /// One row per request kind, by kind number.
    pub ops: Vec<OpStats>,
    pub pools: Vec<PoolRow>,
    pub instances: Vec<InstanceRow>,
    pub sessions: Vec<SessionRow>,
    pub regions: Vec<RegionRow>,
    /// The oldest long-held pins, oldest first (all are counted in
    /// `totals.long_held_pins`).
    pub long_pins: Vec<LongPinRow>,
    /// Pins held longer than this are long-held.
    pub long_pin_threshold_ms: u64,
    /// True when an optional table had more than `max_rows` rows.
    pub truncated: bool,
}
