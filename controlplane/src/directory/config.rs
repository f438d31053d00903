//! Limits and tunables. Every queue, batch and table of the directory has a
//! bound here; each bound is checked where input enters and reported in the
//! error that refuses it.

use std::time::Duration;

/// Longest key, in bytes (DESIGN §3).
pub const MAX_KEY_BYTES: usize = 512;
/// Longest instance id, in bytes.
pub const MAX_INSTANCE_ID_BYTES: usize = 128;
/// Largest page size of a layout (a page length must fit a `u32`).
pub const MAX_PAGE_SIZE_BYTES: u64 = 1 << 30;
/// Page sizes are multiples of this.
pub const PAGE_SIZE_ALIGN_BYTES: u64 = 4096;
/// Most pins one key can hold, summed over sessions.
pub const MAX_PINS_PER_KEY: u32 = 1 << 30;
/// Largest sequence number (of requests, of freed-page notices) a client may
/// use or present. Far beyond any real counter (2^62 requests at a billion a
/// second last 146 years), it keeps the window and notice arithmetic
/// (`high + 1`, the next notice number) from overflowing on hostile input.
pub const MAX_SEQUENCE: u64 = 1 << 62;
/// Hard ceilings the configuration cannot exceed (they keep internal indices
/// in `u32` and cached reply sizes sane).
pub const MAX_BATCH_CEILING: usize = 1 << 16;
pub const MAX_KEYS_CEILING: usize = (u32::MAX - 1) as usize;
/// Largest `max_region_bytes`: 16 TiB, the pool manager's own limit on one
/// region ([`pool::manager::MAX_REGION_BYTES`](crate::pool::manager::MAX_REGION_BYTES)):
/// a directory allowing more passed larger requests on only to have every
/// one refused there (`RegionTooLarge`). It also keeps an instance's byte
/// counts (owned + pending + one request) far from `u64::MAX`: with at
/// most [`MAX_PENDING_REGION_REQUESTS_CEILING`] requests pending, the
/// pending bytes stay below 2^60.
pub const MAX_REGION_BYTES_CEILING: u64 = crate::pool::manager::MAX_REGION_BYTES;
/// Largest `max_pending_region_requests_per_instance` (see
/// [`MAX_REGION_BYTES_CEILING`]).
pub const MAX_PENDING_REGION_REQUESTS_CEILING: usize = 1 << 12;
const _: () = assert!(
    (MAX_REGION_BYTES_CEILING as u128) * (MAX_PENDING_REGION_REQUESTS_CEILING as u128) <= 1 << 60,
    "an instance's pending region bytes fit a u64 with room to spare"
);
/// Largest `max_pinned_entries`: at up to 160 bytes of ledger per pair,
/// 2^32 pairs are 640 GiB — a ceiling on typing errors, not a size anyone
/// should run with.
pub const MAX_PINNED_ENTRIES_CEILING: usize = u32::MAX as usize;

/// Eviction policy (DESIGN §4 "Capacity").
#[derive(Debug, Clone, PartialEq)]
pub struct EvictionConfig {
    /// Evict keys of orphaned regions (owner gone; no engine's LRU will ever
    /// see them) while the pools are fuller than `pool_high_watermark`, and
    /// after the pool manager refused a region for want of space
    /// ([`Directory::region_refused_for_space`](super::Directory::region_refused_for_space)),
    /// in both cases down to `pool_low_watermark`.
    pub orphans: bool,
    /// Fraction of pool bytes allocated above which eviction starts.
    pub pool_high_watermark: f64,
    /// Eviction stops once the pools are at most this full.
    pub pool_low_watermark: f64,
    /// Full LRU over all unpinned keys (for engines without a policy of their
    /// own). Starts when the pools are fuller than `pool_high_watermark`
    /// *and* the held regions are at least `lru_high_fill` full of
    /// registered pages; then runs until the pools are at most
    /// `pool_low_watermark` full *or* the regions at most `lru_low_fill`
    /// full (the same hysteresis as orphan eviction, on both measures).
    /// Evicting a live owner's key hands the page back to the owner through
    /// a freed-page notice; a key whose owner's notice queue is full is
    /// passed over where it lies (it keeps its place in the LRU order), at
    /// most `max_evictions_per_tick` of them per tick.
    pub lru: bool,
    pub lru_high_fill: f64,
    pub lru_low_fill: f64,
    /// Most keys evicted per `tick`, most keys the LRU passes over per tick,
    /// and most orphaned regions holding a pin that orphan eviction passes
    /// over per tick (plus the first in line, which keeps its place): it
    /// bounds the pause, a tick visits at most about twice this many keys
    /// and regions.
    pub max_evictions_per_tick: usize,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        Self {
            orphans: true,
            pool_high_watermark: 0.90,
            pool_low_watermark: 0.80,
            lru: false,
            lru_high_fill: 0.95,
            lru_low_fill: 0.90,
            max_evictions_per_tick: 4096,
        }
    }
}

/// The directory's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectoryConfig {
    /// Most entries in one batch request.
    pub max_batch: usize,
    /// Most pins one lookup takes per key.
    pub max_pins_per_call: u32,
    /// Most keys the directory holds (registration beyond it is refused).
    pub max_keys: usize,
    pub max_sessions: usize,
    pub max_sessions_per_instance: usize,
    pub max_instances: usize,
    /// Most layouts in use at once: a layout counts while a region of it
    /// exists or is requested, and is forgotten with the last of them.
    pub max_layouts: usize,
    pub max_regions_per_instance: usize,
    /// At most [`MAX_PENDING_REGION_REQUESTS_CEILING`].
    pub max_pending_region_requests_per_instance: usize,
    /// Largest region one request may ask for (at most
    /// [`MAX_REGION_BYTES_CEILING`]).
    pub max_region_bytes: u64,
    /// Most distinct keys one session may hold pins on.
    pub max_pinned_keys_per_session: usize,
    /// Most (session, key) pairs with pins held, over all sessions: the
    /// directory-wide bound on pin ledgers. A pinning lookup that could
    /// cross it (counting every key it names as a new pair, as the
    /// per-session limit does) is refused as a whole (`PinnedEntryLimit`,
    /// wire code `busy`) and changes nothing.
    ///
    /// Memory: a session's pin ledger takes 16 bytes a bucket. It starts
    /// small and never shrinks below 1 024 buckets (16 KiB, room for 512
    /// pairs); above that it has fewer than 8 buckets per pair it holds,
    /// unless unpins thinned it out — and a ledger left thin by an unpin is
    /// rebuilt to fit whenever all ledgers together hold more than 2
    /// buckets per pair this limit allows (below that budget a session
    /// that pins and unpins large batches keeps its table, rather than
    /// rebuilding it on every call). So all ledgers together stay under
    /// `16 B × (10 × max_pinned_entries + 1 024 × max_sessions)`: with the
    /// defaults (4 Mi pairs, 4 096 sessions) 640 MiB + 64 MiB, where
    /// without this limit 4 096 sessions pinning 1 Mi keys each (their own
    /// limit) could take 128 GiB. A walk of every pin (stats, `/metrics`,
    /// the long-held-pin log) is bounded by the same buckets. Four sessions
    /// at their own limit, or a thousand holding 4 096 pins each, fit.
    pub max_pinned_entries: usize,
    /// A session without requests for this long is dead.
    pub session_lease: Duration,
    /// An instance without sessions for this long is gone (its regions are
    /// freed or deferred, its keys orphaned). After a restart, also how long
    /// the recovered regions wait for their owner's reattach.
    pub instance_grace: Duration,
    /// Width of the exactly-once window, in sequence numbers.
    pub reply_window: u64,
    /// Bytes of cached reply bodies kept per instance; beyond it the oldest
    /// are dropped (their retries get `ReplyEvicted`, never a re-execution).
    pub reply_cache_bytes_per_instance: usize,
    /// Most unacknowledged freed-page notices queued per instance.
    pub notice_queue_limit: usize,
    /// Most notices carried by one response.
    pub notices_per_response: usize,
    /// Refuse TCP peers that did not present the pre-shared client secret.
    pub tcp_requires_secret: bool,
    /// The largest quota an instance may ask for; also the quota of instances
    /// that ask for none. `None`: unlimited.
    pub max_instance_quota_bytes: Option<u64>,
    /// Pins held longer than this are reported as long-held.
    pub long_held_pin: Duration,
    /// Most long-held pins listed individually in stats (all are counted).
    pub long_held_pins_listed: usize,
    /// Ended-session ids remembered, so their next call gets `SessionEnded`
    /// rather than `UnknownSession`.
    pub ended_sessions_remembered: usize,
    pub eviction: EvictionConfig,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self {
            max_batch: 4096,
            max_pins_per_call: 1024,
            max_keys: 64 << 20,
            max_sessions: 4096,
            max_sessions_per_instance: 256,
            max_instances: 1024,
            max_layouts: 256,
            max_regions_per_instance: 16384,
            max_pending_region_requests_per_instance: 16,
            max_region_bytes: 1 << 40,
            max_pinned_keys_per_session: 1 << 20,
            max_pinned_entries: 1 << 22,
            session_lease: Duration::from_secs(10),
            instance_grace: Duration::from_secs(30),
            reply_window: 1024,
            reply_cache_bytes_per_instance: 8 << 20,
            notice_queue_limit: 1 << 16,
            notices_per_response: 256,
            tcp_requires_secret: true,
            max_instance_quota_bytes: None,
            long_held_pin: Duration::from_secs(60),
            long_held_pins_listed: 16,
            ended_sessions_remembered: 4096,
            eviction: EvictionConfig::default(),
        }
    }
}

/// A configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{field} = {value} is out of range ({expected})")]
    OutOfRange {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
}

impl DirectoryConfig {
    /// Checks every field; the directory refuses to start on a bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn check(
            ok: bool,
            field: &'static str,
            value: impl ToString,
            expected: &'static str,
        ) -> Result<(), ConfigError> {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange {
                    field,
                    value: value.to_string(),
                    expected,
                })
            }
        }
        let fraction = |x: f64| (0.0..=1.0).contains(&x);
        check(
            (1..=MAX_BATCH_CEILING).contains(&self.max_batch),
            "max_batch",
            self.max_batch,
            "1..=65536",
        )?;
        check(
            (1..=MAX_PINS_PER_KEY / MAX_BATCH_CEILING as u32).contains(&self.max_pins_per_call),
            "max_pins_per_call",
            self.max_pins_per_call,
            "1..=16384",
        )?;
        check(
            (1..=MAX_KEYS_CEILING).contains(&self.max_keys),
            "max_keys",
            self.max_keys,
            "1..=2^32-2",
        )?;
        check(
            self.max_sessions >= 1,
            "max_sessions",
            self.max_sessions,
            ">= 1",
        )?;
        check(
            self.max_sessions_per_instance >= 1,
            "max_sessions_per_instance",
            self.max_sessions_per_instance,
            ">= 1",
        )?;
        check(
            (1..=u32::MAX as usize / 2).contains(&self.max_instances),
            "max_instances",
            self.max_instances,
            "1..=2^31",
        )?;
        check(
            (1..=u32::MAX as usize / 2).contains(&self.max_layouts),
            "max_layouts",
            self.max_layouts,
            "1..=2^31",
        )?;
        check(
            self.max_regions_per_instance >= 1,
            "max_regions_per_instance",
            self.max_regions_per_instance,
            ">= 1",
        )?;
        check(
            (1..=MAX_PENDING_REGION_REQUESTS_CEILING)
                .contains(&self.max_pending_region_requests_per_instance),
            "max_pending_region_requests_per_instance",
            self.max_pending_region_requests_per_instance,
            "1..=4096",
        )?;
        check(
            (PAGE_SIZE_ALIGN_BYTES..=MAX_REGION_BYTES_CEILING).contains(&self.max_region_bytes),
            "max_region_bytes",
            self.max_region_bytes,
            "4096..=2^44",
        )?;
        check(
            self.max_pinned_keys_per_session >= 1,
            "max_pinned_keys_per_session",
            self.max_pinned_keys_per_session,
            ">= 1",
        )?;
        check(
            (1..=MAX_PINNED_ENTRIES_CEILING).contains(&self.max_pinned_entries),
            "max_pinned_entries",
            self.max_pinned_entries,
            "1..=2^32-1",
        )?;
        check(
            !self.session_lease.is_zero(),
            "session_lease",
            format!("{:?}", self.session_lease),
            "> 0",
        )?;
        check(
            (64..=1 << 20).contains(&self.reply_window) && self.reply_window.is_multiple_of(64),
            "reply_window",
            self.reply_window,
            "a multiple of 64 in 64..=2^20",
        )?;
        check(
            self.notice_queue_limit >= self.max_batch,
            "notice_queue_limit",
            self.notice_queue_limit,
            ">= max_batch",
        )?;
        // Clients refuse a reply carrying more notices than the protocol's
        // maximum: an owner with a longer backlog would get no reply it
        // accepts, ever.
        const _: () = assert!(crate::proto::MAX_NOTICES_PER_REPLY == 1024);
        check(
            (1..=crate::proto::MAX_NOTICES_PER_REPLY).contains(&self.notices_per_response),
            "notices_per_response",
            self.notices_per_response,
            "1..=1024 (the protocol's MAX_NOTICES_PER_REPLY)",
        )?;
        let e = &self.eviction;
        check(
            fraction(e.pool_high_watermark),
            "eviction.pool_high_watermark",
            e.pool_high_watermark,
            "0..=1",
        )?;
        check(
            fraction(e.pool_low_watermark) && e.pool_low_watermark <= e.pool_high_watermark,
            "eviction.pool_low_watermark",
            e.pool_low_watermark,
            "0..=pool_high_watermark",
        )?;
        check(
            fraction(e.lru_high_fill),
            "eviction.lru_high_fill",
            e.lru_high_fill,
            "0..=1",
        )?;
        check(
            fraction(e.lru_low_fill) && e.lru_low_fill <= e.lru_high_fill,
            "eviction.lru_low_fill",
            e.lru_low_fill,
            "0..=lru_high_fill",
        )?;
        check(
            e.max_evictions_per_tick >= 1,
            "eviction.max_evictions_per_tick",
            e.max_evictions_per_tick,
            ">= 1",
        )?;
        Ok(())
    }
}
