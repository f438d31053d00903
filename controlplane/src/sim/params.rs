//! What one seed simulates: drawn from the seed itself, so that the seeds
//! together cover small and large worlds, calm and hostile networks, and
//! every restart kind, and a failing seed still names everything it ran.

use std::time::Duration;

use crate::directory::{DirectoryConfig, EvictionConfig, Layout};

use super::rng::SimRng;

pub(crate) const MS: u64 = 1_000_000;
pub(crate) const SEC: u64 = 1_000 * MS;
/// The pool's alignment and the regions' unit.
pub(crate) const BLOCK_BYTES: u64 = 2 << 20;
pub(crate) const LAYOUTS: [Layout; 2] = [
    Layout {
        page_size_bytes: 512 << 10,
        fingerprint: 0xA,
    },
    Layout {
        page_size_bytes: 1 << 20,
        fingerprint: 0xB,
    },
];
pub(crate) const SESSION_LEASE_NS: u64 = 2 * SEC;
pub(crate) const INSTANCE_GRACE_NS: u64 = 3 * SEC;
/// The pool manager's grace for a gone directory: longer than a directory
/// restart plus its rejoin, as the deployment must configure it.
pub(crate) const POOL_GRACE_MS: u64 = 4_000;
pub(crate) const TICK_NS: u64 = 100 * MS;

/// How big and how hostile a run is (the long form goes further).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// CI: a few clients, a few simulated seconds.
    Short,
    /// Long campaigns: more clients, longer runs, more restarts.
    Long,
}

/// One link's misbehaviour.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkFaults {
    pub drop_p: f64,
    pub dup_p: f64,
    /// A message takes `base..=base+jitter`, or with `slow_p` up to
    /// `slow_max_ns` more (which reorders it behind later ones).
    pub base_ns: u64,
    pub jitter_ns: u64,
    pub slow_p: f64,
    pub slow_max_ns: u64,
}

impl LinkFaults {
    fn draw(rng: &mut SimRng, hostile: bool) -> Self {
        let pick = |rng: &mut SimRng, options: &[f64]| options[rng.index(options.len())];
        Self {
            drop_p: if hostile {
                pick(rng, &[0.0, 0.01, 0.03, 0.08])
            } else {
                0.0
            },
            dup_p: if hostile {
                pick(rng, &[0.0, 0.01, 0.05])
            } else {
                0.0
            },
            base_ns: rng.range(20_000, 300_000),
            jitter_ns: rng.range(0, 500_000),
            slow_p: pick(rng, &[0.0, 0.02, 0.1]),
            slow_max_ns: rng.range(1, 60) * MS,
        }
    }
}

/// Everything a seed decides before the run starts.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub clients: usize,
    pub layouts: usize,
    pub keys_per_layout: u8,
    pub pool_blocks: u64,
    /// Simulated time with workload and faults; then faults heal.
    pub run_ns: u64,
    pub client_link: LinkFaults,
    pub pool_link: LinkFaults,
    /// Mean time between partitions of some client's link (0: none).
    pub client_partition_every_ns: u64,
    pub client_partition_max_ns: u64,
    pub pool_partition_every_ns: u64,
    pub client_crash_every_ns: u64,
    pub directory_restarts: u32,
    pub pool_restarts: u32,
    pub admin_end_session_every_ns: u64,
    /// The directory reaches the pool manager over TCP: the pool manager's
    /// caller is the connection, whose close ends it (else the local
    /// socket: the caller is the directory's process).
    pub pool_over_tcp: bool,
    /// Mean time between breaks of the directory's pool-manager
    /// connection with both processes alive (0: none).
    pub pool_link_break_every_ns: u64,
    /// Group commit: replies wait for a commit up to this long (0: per
    /// record).
    pub commit_delay_max_ns: u64,
    /// Chance that a commit's sync stalls for 0.1 to 2 s.
    pub sync_stall_p: f64,
    pub checkpoint_every_records: u64,
    pub client_op_interval_ns: u64,
    pub max_outstanding: usize,
    pub directory: DirectoryConfig,
}

impl Params {
    pub fn draw(rng: &mut SimRng, scale: Scale, seed: u64) -> Self {
        let long = scale == Scale::Long;
        let hostile = rng.chance(0.85);
        let clients = if long {
            rng.range(2, 8)
        } else {
            rng.range(2, 5)
        } as usize;
        let run_ns = if long {
            rng.range(2, 20) * SEC
        } else {
            rng.range(1_500, 3_000) * MS
        };
        let every = |rng: &mut SimRng, on_p: f64, lo_ms: u64, hi_ms: u64| {
            if hostile && rng.chance(on_p) {
                rng.range(lo_ms, hi_ms) * MS
            } else {
                0
            }
        };
        let restarts = |rng: &mut SimRng| -> u32 {
            if !hostile {
                return 0;
            }
            match rng.below(10) {
                0..=4 => 0,
                5..=7 => 1,
                _ => {
                    if long {
                        rng.range(2, 4) as u32
                    } else {
                        2
                    }
                }
            }
        };
        let mut directory = DirectoryConfig {
            max_batch: 16,
            session_lease: Duration::from_nanos(SESSION_LEASE_NS),
            instance_grace: Duration::from_nanos(INSTANCE_GRACE_NS),
            reply_window: 64,
            notice_queue_limit: 64,
            notices_per_response: [1usize, 2, 4, 256][rng.index(4)],
            tcp_requires_secret: true,
            max_region_bytes: 8 * BLOCK_BYTES,
            max_pending_region_requests_per_instance: 2,
            max_regions_per_instance: 6,
            ..DirectoryConfig::default()
        };
        if rng.chance(0.3) {
            directory.max_instance_quota_bytes = Some(rng.range(2, 6) * BLOCK_BYTES);
        }
        directory.eviction = EvictionConfig {
            orphans: rng.chance(0.5),
            pool_high_watermark: [0.5, 0.7, 0.9][rng.index(3)],
            pool_low_watermark: 0.3,
            lru: false,
            max_evictions_per_tick: rng.range(1, 16) as usize,
            ..EvictionConfig::default()
        };
        Self {
            clients,
            layouts: rng.range(1, 2) as usize,
            keys_per_layout: rng.range(6, 20) as u8,
            pool_blocks: rng.range(6, 40),
            run_ns,
            client_link: LinkFaults::draw(rng, hostile),
            pool_link: LinkFaults::draw(rng, hostile),
            client_partition_every_ns: every(rng, 0.5, 300, 3_000),
            client_partition_max_ns: rng.range(50, if long { 8_000 } else { 3_000 }) * MS,
            pool_partition_every_ns: every(rng, 0.3, 300, 3_000),
            client_crash_every_ns: every(rng, 0.6, 300, 4_000),
            directory_restarts: restarts(rng),
            pool_restarts: restarts(rng),
            admin_end_session_every_ns: every(rng, 0.2, 300, 3_000),
            commit_delay_max_ns: if rng.chance(0.5) {
                rng.range(1, 5) * MS
            } else {
                0
            },
            sync_stall_p: if hostile && rng.chance(0.3) {
                [0.01, 0.05, 0.15][rng.index(3)]
            } else {
                0.0
            },
            checkpoint_every_records: rng.range(2, 40),
            client_op_interval_ns: rng.range(2, 40) * MS,
            max_outstanding: rng.range(1, 4) as usize,
            directory,
            pool_over_tcp: false,
            pool_link_break_every_ns: 0,
        }
        .with_pool_link(seed, hostile)
        .with_edges(seed)
    }

    /// The pool link's kind and breaks, drawn from a stream of their own:
    /// a seed that reaches the pool manager over the local socket without
    /// breaks replays the world it did before these existed (the seeds
    /// named in regression tests among them).
    fn with_pool_link(mut self, seed: u64, hostile: bool) -> Self {
        let mut rng = SimRng::new(seed ^ 0x706f_6f6c_6c69_6e6b);
        self.pool_over_tcp = rng.chance(0.5);
        if hostile && rng.chance(0.5) {
            self.pool_link_break_every_ns = rng.range(200, 2_000) * MS;
        }
        self
    }

    /// The rare paths' settings, drawn from a stream of their own (as
    /// `with_pool_link`, so that the other settings of a seed are as they
    /// were before these): LRU eviction in a fifth of the seeds, with fill
    /// thresholds the simulation's small regions reach; in three tenths a
    /// notice queue limit of 2, 4 or 8 instead of 64 (the batch limit
    /// lowered to match, as the configuration requires), so that an owner's
    /// queue fills and deletes are refused `busy` and the LRU passes keys
    /// over; and in a quarter a reply cache of a few hundred bytes per
    /// instance, so that a retry whose first reply was lost finds its body
    /// dropped (`ReplyEvicted`).
    fn with_edges(mut self, seed: u64) -> Self {
        let mut rng = SimRng::new(seed ^ 0x6564_6765_735f_7631);
        let d = &mut self.directory;
        if rng.chance(0.2) {
            let e = &mut d.eviction;
            e.lru = true;
            e.lru_high_fill = [0.2, 0.35, 0.5][rng.index(3)];
            e.lru_low_fill = e.lru_high_fill / 2.0;
            e.pool_high_watermark = [0.1, 0.2, 0.4][rng.index(3)];
            e.pool_low_watermark = e.pool_high_watermark / 2.0;
        }
        if rng.chance(0.3) {
            d.notice_queue_limit = [2, 4, 8][rng.index(3)];
            d.max_batch = d.max_batch.min(d.notice_queue_limit);
        }
        if rng.chance(0.25) {
            d.reply_cache_bytes_per_instance = [128, 256, 512][rng.index(3)];
        }
        self
    }
}
