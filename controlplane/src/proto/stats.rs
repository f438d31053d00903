//! The directory's statistics: one request, one reply shaped for three
//! consumers — `cxlkv stats` (one-shot report), `cxlkv top` (polled every
//! second, diffs the counters) and a Prometheus exporter (counters and gauges
//! as they are, latency as summary quantiles).
//!
//! Totals, per-operation counters and pools are always present; the larger
//! per-instance, per-session, per-region and long-pin tables only when asked
//! for, each capped at `max_rows` rows (at most [`MAX_STATS_ROWS`](super::MAX_STATS_ROWS)) with
//! `truncated` set when a table was cut. Counters are cumulative since the
//! directory started (`uptime_ms`); gauges are instantaneous. Keys appear only
//! as a short prefix in the long-pin table.

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

/// Summary of a latency distribution (nanoseconds, since start).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct LatencySummary {
    pub count: u64,
    pub mean_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
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
    /// Requests answered with an `ErrorReply`.
    pub errors: u64,
    /// Answered from the reply cache (retries).
    pub replayed: u64,
    /// Time in the directory, from decoded request to encoded reply.
    pub latency: LatencySummary,
}

/// Directory-wide gauges and counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct DirectoryTotals {
    /// Gauge: registered keys.
    pub keys: u64,
    /// Gauge: page bytes of registered keys.
    pub used_bytes: u64,
    /// Gauge: bytes of regions assigned to instances.
    pub owned_bytes: u64,
    pub regions: u64,
    /// Gauge: regions of gone owners kept alive by their keys.
    pub deferred_regions: u64,
    /// Gauge: keys whose owning instance is gone.
    pub orphan_keys: u64,
    /// Gauge: pins held, all sessions.
    pub pins: u64,
    pub pinned_keys: u64,
    pub instances_live: u64,
    /// Gauge: instances whose sessions all died, within the grace period.
    pub instances_gone: u64,
    pub sessions: u64,
    /// Gauge: freed-page notices not yet acknowledged.
    pub notices_pending: u64,
    /// Counter: orphaned keys evicted at the watermark.
    pub evictions_orphan: u64,
    /// Counter: keys evicted by the optional server-side LRU.
    pub evictions_lru: u64,
    /// Counter: sessions ended by lease expiry.
    pub sessions_expired: u64,
    /// Counter: sessions ended by `EndSession`.
    pub sessions_ended: u64,
}

/// One pool as the directory sees it (from the pool manager).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolRow {
    pub pool: u32,
    pub size_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    /// Regions of this directory in the pool.
    pub regions: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct InstanceRow {
    pub instance_id: String,
    pub client_name: String,
    /// False while the instance is gone but within its grace period.
    pub present: bool,
    pub sessions: u32,
    pub regions: u32,
    pub owned_bytes: u64,
    pub used_bytes: u64,
    /// 0: no quota.
    pub quota_bytes: u64,
    pub keys: u64,
    /// Pins held by the instance's sessions.
    pub pins: u64,
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
    pub pins: u64,
    pub requests: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionRow {
    pub region: u64,
    pub pool: u32,
    pub layout: Layout,
    pub len_bytes: u64,
    pub owner_instance: String,
    pub owner_present: bool,
    /// Keys registered in the region.
    pub keys: u64,
    pub used_bytes: u64,
    /// Returned by its owner (or owner gone) but kept alive by its keys.
    pub deferred: bool,
}

/// A key pinned for longer than the directory's long-pin threshold.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct LongPinRow {
    pub session_id: u64,
    pub instance_id: String,
    pub layout: Layout,
    /// The key's first bytes (at most [`STATS_KEY_PREFIX_BYTES`](super::STATS_KEY_PREFIX_BYTES)).
    pub key_prefix: Vec<u8>,
    pub key_len_bytes: u32,
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
    /// One row per request kind seen, by kind number.
    pub ops: Vec<OpStats>,
    pub pools: Vec<PoolRow>,
    pub instances: Vec<InstanceRow>,
    pub sessions: Vec<SessionRow>,
    pub regions: Vec<RegionRow>,
    pub long_pins: Vec<LongPinRow>,
    /// Pins held longer than this are listed in `long_pins`.
    pub long_pin_threshold_ms: u64,
    /// True when an optional table had more than `max_rows` rows.
    pub truncated: bool,
}
