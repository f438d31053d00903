//! The directory: the metadata server's state machine (DESIGN §4), sans-IO.
//!
//! It maps `(layout, key)` to a [`Location`] (region, page, generation,
//! length), counts pins per key per session, assigns regions to instances,
//! counts the keys in each region, hands freed pages back to their owners,
//! and decides when a region goes back to the pool manager. It never touches
//! KV bytes, a socket, a file or a clock.
//!
//! ## How a driver uses it
//!
//! The server calls [`Directory`] from one event-loop thread (`&mut self`, no
//! locks inside). Every entry point takes the decoded request as plain values
//! — keys as `&[u8]` slices borrowed from the validated receive buffer — the
//! calling session and `now`, and returns the reply. Work for the outside
//! world is queued as [`Effect`]s, which the driver drains after each call
//! with [`Directory::drain_effects`]: allocate or free a region at the pool
//! manager, end a session's connection. A region request is answered
//! [`RegionReply::Deferred`]; the driver completes it by passing the pool
//! manager's answer to [`Directory::region_allocated`]. The driver calls
//! [`Directory::tick`] periodically (lease and grace expiry, eviction),
//! reports pool fill levels with [`Directory::pool_usage`], and records the
//! latency it measures with [`Directory::record_latency`].
//!
//! ## Semantics in one place
//!
//! - **Instances and sessions.** `hello` creates an instance (name + random
//!   secret) and its first session; `reattach` adds a session to an instance
//!   presenting its secret (after a reconnect: `Resumed`, everything intact),
//!   or rebuilds it (after a directory restart, or after it was declared gone:
//!   `Recovered`, proven by the pool manager's region tokens; repeated to
//!   every reattach until a session of the instance makes a request, since
//!   the first answer may have been lost). Any request
//!   renews its session's lease; a session without requests for
//!   `session_lease` dies, and an instance with no session for
//!   `instance_grace` is gone. TCP peers need the pre-shared secret unless
//!   `tcp_requires_secret` is off. A `hello` naming an instance that has no
//!   session, from the same principal (Unix uid, or TCP), takes it over (the
//!   old incarnation is declared gone on the spot) — with a holder probe
//!   installed (`set_holder_probe`, as the server does) only once every
//!   other process that held it has exited, since a live one still has its
//!   regions mapped; an instance held over TCP then waits out its grace.
//! - **Exactly-once.** Per-instance sequence numbers, a window of
//!   `reply_window` numbers, cached replies (see *Exactly-once window* below).
//! - **Registry.** `register` → per entry `Inserted | Duplicate(winner) |
//!   Rejected(reason)`; `lookup(keys, pins)` takes pins atomically with the
//!   lookup and lists the regions it names; `exists`; `unpin` (never
//!   underflows: an unpin of pins not held is reported `NotPinned` and changes
//!   nothing); `delete` → `Deleted | Pinned | Missing`. Anyone may delete.
//! - **Pins belong to a session**, with no expiry of their own: they are
//!   released when the session ends (connection closed, lease expired, admin
//!   `end_session`). Pins held longer than `long_held_pin` are reported. A
//!   session pins at most `max_pinned_keys_per_session` distinct keys, and
//!   all sessions together at most `max_pinned_entries` (session, key)
//!   pairs: a pinning lookup that could cross either is refused whole.
//! - **Regions.** Requested for an instance and a layout; the grant carries
//!   the token. When an owner is gone, each of its regions with no keys is
//!   freed at once, the others when their last key is deleted; their keys stay
//!   readable meanwhile. An owner may return a region with no keys.
//! - **Freed-page notices.** Deleting a key (by anyone, or evicting it) queues
//!   `{seq, region, page, generation}` for the region's owner, if present;
//!   every response to the owner carries the oldest unacknowledged ones until
//!   it acknowledges them. An owner that is gone gets none: its pages die with
//!   the region. A notice can name a page whose `register` reply the owner has
//!   not received yet (the reply was lost and the key deleted before the
//!   retry): the owner then frees the page when that reply arrives.
//! - **Capacity.** Quotas count *region bytes* owned or pending per instance
//!   (pages are allocated client-side, so region bytes are what an instance
//!   actually takes from the pool). Orphaned keys are evicted, region by
//!   region, oldest orphan first, while the pools are above a watermark
//!   (default on); an optional LRU evicts the least recently used unpinned key
//!   in O(1), under the same pool watermarks. A pinned key is never evicted.
//! - **Usage piggyback.** Every reply to an instance carries its owned and
//!   used bytes and the pools' free bytes.
//! - **Restart.** State is in memory. A restarted directory is built with
//!   [`Directory::recover`] from the pool manager's list of this directory's
//!   regions and their owner labels; their owners reattach with their tokens
//!   within `instance_grace` and re-register their keys; regions whose owner
//!   does not come back are freed. Orphaned keys (owner gone) do not survive a
//!   restart, and a key deleted just before it whose notice had not reached
//!   its owner comes back when the owner re-registers it (its bytes are
//!   intact: keys are write-once).
//!
//! ## Exactly-once window
//!
//! Mutating requests carry [`Sequence`]. With `high` the highest executed
//! number of the instance and `W = reply_window`: a number above `high` runs;
//! one in `(high - W, high]` runs if it has not, and otherwise gets its cached
//! reply; anything lower (or below the instance's floor) is refused with
//! `SequenceTooOld`; a number above [`MAX_SEQUENCE`] is refused with
//! `SequenceOutOfRange`. Clients keep fewer than `W` numbers between their oldest
//! unanswered request and their newest. Error replies are not cached and do
//! not consume the number. A pinning lookup's cached reply is only given to the
//! session that ran it (its pins belong to that session); a retry on another
//! session gets `PinsHeldByOtherSession` and should look up again.
//!
//! ## Invariants
//!
//! [`Directory::check_invariants`] verifies all of them (tests and the
//! deterministic simulation call it after every step): table and slab agree;
//! a key's pin total is the sum over live sessions; a region's key count is
//! the keys in it; a registered page has exactly one key; no region is freed
//! while a key points into it; a region whose owner is gone has keys; the LRU
//! holds exactly the unpinned keys; per-instance and global totals match;
//! each region id is recorded at most once (the region table's id and
//! extent indexes name exactly its live slots), no two regions held —
//! recorded, or unclaimed since a restart — share a byte of a pool, and a
//! region held unclaimed is in one instance's list and not also recorded.

mod capacity;
mod config;
mod error;
mod hash_slots;
mod inspect;
mod keys;
mod layouts;
mod lifecycle;
mod lru;
mod notices;
mod pin_ledger;
mod regions;
mod registry;
mod rng;
mod sequence;
mod sessions;
mod stats;
mod types;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use cxlkv_dataplane::ids::{PoolId, RegionId};
use foldhash::fast::FixedState;
use layouts::LayoutTable;

pub use config::{
    ConfigError, DirectoryConfig, EvictionConfig, MAX_BATCH_CEILING, MAX_INSTANCE_ID_BYTES,
    MAX_KEY_BYTES, MAX_KEYS_CEILING, MAX_PAGE_SIZE_BYTES, MAX_PENDING_REGION_REQUESTS_CEILING,
    MAX_PINNED_ENTRIES_CEILING, MAX_PINS_PER_KEY, MAX_REGION_BYTES_CEILING, MAX_SEQUENCE,
    PAGE_SIZE_ALIGN_BYTES,
};
pub use error::{DirectoryError, RejectReason};
pub use inspect::{DirectoryTotals, InvariantViolation, KeyInfo, RegionInfo};
pub use stats::{
    DirectoryStats, EvictionCounters, InstanceStats, LatencySummary, LongHeldPin, LongHeldPins,
    OpCounters, OpStats, OutcomeCounters, PoolStats,
};
pub use types::{
    Caller, Completion, DeferredId, DeleteOutcome, Effect, EndedSession, FreedPageNotice,
    InstanceId, InstanceSecret, Layout, Limits, Location, LookupReply, OpKind, Peer, PoolRequestId,
    Principal, ReattachKind, Reattached, RecoveredRegion, RegionDescriptor, RegionGrant,
    RegionHandle, RegionReply, RegionStatus, RegionToken, RegisterEntry, RegisterOutcome, Reply,
    Sequence, SessionEndReason, SessionId, Time, UnpinEntry, UnpinOutcome, Usage, Welcome,
};

use keys::KeyIndex;
use lru::Lru;
use regions::RegionTable;
use rng::Rng;
use sessions::{Instance, Session};
use stats::Counters;

/// A `hello`: the first contact of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello<'a> {
    pub instance: &'a str,
    /// The quota the instance asks for (capped by the server's maximum).
    pub quota_bytes: Option<u64>,
}

/// A region an instance presents in a `reattach`: the pool manager's handle
/// (with its token) and the layout the instance uses it for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PresentedRegion {
    pub handle: RegionHandle,
    pub layout: Layout,
}

/// A `reattach`: a new session of an existing instance, after a reconnect or
/// a directory restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reattach<'a> {
    pub instance: &'a str,
    pub secret: InstanceSecret,
    /// Every region the instance believes it owns.
    pub regions: &'a [PresentedRegion],
    /// The instance's next sequence number: on a `Recovered` reattach,
    /// numbers below it are refused (they went to a previous incarnation).
    pub next_seq: u64,
    /// The highest freed-page notice the instance applied: acknowledged on a
    /// `Resumed` reattach, the numbering base on a `Recovered` one.
    pub notice_ack: u64,
    pub quota_bytes: Option<u64>,
}

/// The pool manager's fill level of one pool, as last reported.
#[derive(Debug, Clone, Copy, Default)]
struct PoolUsage {
    reported_total_bytes: u64,
    reported_free_bytes: u64,
    /// Bytes this directory allocated / freed since the report.
    allocated_since: u64,
    freed_since: u64,
    /// Bytes this directory ever freed in the pool (never reset): what a
    /// [`PoolReportMark`] records.
    freed_total: u64,
}

/// What the directory had freed in each pool when a pool report was asked
/// for ([`Directory::pool_report_mark`]), so that the report, when it comes,
/// replaces only what it can know about ([`Directory::pool_usage_as_of`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolReportMark {
    freed_total: Vec<(PoolId, u64)>,
}

impl PoolUsage {
    /// A region of `len_bytes` was given back (its free is on its way).
    fn freed(&mut self, len_bytes: u64) {
        self.freed_since = self.freed_since.saturating_add(len_bytes);
        self.freed_total = self.freed_total.saturating_add(len_bytes);
    }

    fn estimated_free(&self) -> u64 {
        self.reported_free_bytes
            .saturating_add(self.freed_since)
            .saturating_sub(self.allocated_since)
            .min(self.reported_total_bytes)
    }
}

/// A region request waiting for the pool manager.
#[derive(Debug)]
struct PendingRegion {
    /// The requesting instance's slot, or `None` once it is gone (the region
    /// is then freed on arrival).
    instance: Option<u32>,
    /// The owner label the region is allocated for.
    owner: InstanceId,
    layout: Layout,
    layout_ix: u32,
    len_bytes: u64,
    seq: u64,
    /// Replies to complete: the original request and retries of it.
    waiters: Vec<(DeferredId, SessionId)>,
}

/// Most replies waiting on one pending region request (the original and its
/// retries).
const MAX_REGION_WAITERS: usize = 8;

/// Running totals over all keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Totals {
    page_bytes: u64,
    value_bytes: u64,
    key_bytes: u64,
    pins: u64,
    pinned_keys: u64,
    /// (session, key) pairs with pins held: the sessions' ledger lengths
    /// summed (bounded by `max_pinned_entries`).
    pin_entries: u64,
    /// The sessions' ledger buckets summed (`pin_ledger`).
    ledger_buckets: u64,
    /// Bytes of all region records held (owned or orphaned).
    region_bytes: u64,
    /// Bytes of the whole pages those regions can hold (each region's
    /// pages × its page size): a region's tail past its last whole page
    /// holds no key, so the LRU's region fill is over this, not
    /// `region_bytes`.
    region_page_bytes: u64,
}

/// The directory state machine. See the module documentation.
#[derive(Debug)]
pub struct Directory {
    config: DirectoryConfig,
    epoch: u64,
    rng: Rng,
    /// Whether a process id may still run (`set_holder_probe`).
    holder_probe: Option<fn(u32) -> bool>,
    /// Seed for the small id-keyed maps.
    map_seed: u64,
    keys: KeyIndex,
    regions: RegionTable,
    /// Layouts in use, by index (held by regions and region requests).
    layouts: LayoutTable,
    instances: Vec<Option<Instance>>,
    free_instance_slots: Vec<u32>,
    instance_ix: HashMap<InstanceId, u32, FixedState>,
    sessions: HashMap<SessionId, Session, FixedState>,
    /// Recently ended sessions (bounded, oldest first), so their next call
    /// gets `SessionEnded`.
    ended: HashSet<SessionId, FixedState>,
    ended_order: VecDeque<SessionId>,
    pending: HashMap<PoolRequestId, PendingRegion, FixedState>,
    /// The regions instances hold unclaimed after a restart (never also
    /// in `regions`).
    unclaimed: regions::Unclaimed,
    pools: BTreeMap<PoolId, PoolUsage>,
    lru: Option<Lru>,
    /// Regions whose owner is gone, oldest orphan first (slot, id: a slot may
    /// have been reused, so entries are checked when popped). An orphaned
    /// region freed by a delete leaves its entry behind (stale, counted in
    /// `orphans_stale`) rather than costing a scan of the queue; stale
    /// entries are dropped when popped, and all at once when they outnumber
    /// the live ones (checked after each is added and after each eviction
    /// round), so between operations the queue holds at most twice the
    /// orphaned regions.
    orphans: VecDeque<(u32, RegionId)>,
    orphans_stale: usize,
    orphan_evicting: bool,
    lru_evicting: bool,
    effects: Vec<Effect>,
    counters: Counters,
    totals: Totals,
    /// Per-request scratch, reused so hot paths do not allocate per key.
    scratch_slots: Vec<u32>,
    scratch_hashes: Vec<u32>,
    scratch_key_hashes: Vec<u64>,
    scratch_counts: Vec<u32>,
    lookup_stamp: u64,
    next_session: u64,
    next_deferred: u64,
    next_pool_request: u64,
}

impl Directory {
    /// A directory with no state (first start).
    pub fn new(config: DirectoryConfig, seed: [u8; 32]) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut rng = Rng::new(seed);
        let epoch = rng.u64();
        let key_seed = [rng.u64(), rng.u64()];
        let map_seed = rng.u64();
        let lru = config.eviction.lru.then(Lru::new);
        Ok(Self {
            epoch,
            map_seed,
            keys: KeyIndex::new(key_seed),
            regions: RegionTable::new(map_seed),
            layouts: LayoutTable::new(map_seed),
            instances: Vec::new(),
            free_instance_slots: Vec::new(),
            instance_ix: HashMap::with_hasher(FixedState::with_seed(map_seed)),
            sessions: HashMap::with_hasher(FixedState::with_seed(map_seed)),
            ended: HashSet::with_hasher(FixedState::with_seed(map_seed)),
            ended_order: VecDeque::new(),
            pending: HashMap::with_hasher(FixedState::with_seed(map_seed)),
            unclaimed: regions::Unclaimed::new(map_seed),
            pools: BTreeMap::new(),
            lru,
            orphans: VecDeque::new(),
            orphans_stale: 0,
            orphan_evicting: false,
            lru_evicting: false,
            effects: Vec::new(),
            counters: Counters::new(),
            totals: Totals::default(),
            scratch_slots: Vec::new(),
            scratch_hashes: Vec::new(),
            scratch_key_hashes: Vec::new(),
            scratch_counts: Vec::new(),
            lookup_stamp: 0,
            next_session: 1,
            next_deferred: 1,
            next_pool_request: 1,
            rng,
            holder_probe: None,
            config,
        })
    }

    /// Tells the directory how to check whether a process may still run
    /// (the server: `/proc`, `pool::liveness::may_run`). With it, a `Hello`
    /// takes over an instance without sessions only when every other
    /// process that held a session of it is known to have exited (a
    /// restarted engine reusing its configured instance id); an instance
    /// held over TCP, or by a process that may run, is refused with
    /// `InstanceIdInUse` until its grace period ends or it reattaches.
    /// Without one (a directory driven in a test or the simulation, which
    /// have no processes), the same principal suffices.
    pub fn set_holder_probe(&mut self, probe: fn(u32) -> bool) {
        self.holder_probe = Some(probe);
    }

    /// A directory restarting: `regions` are the regions the pool manager
    /// holds for this directory, with their owner labels. Each owner becomes an
    /// instance awaiting its reattach for `instance_grace`; regions not
    /// claimed by then are freed.
    pub fn recover(
        config: DirectoryConfig,
        seed: [u8; 32],
        now: Time,
        regions: impl IntoIterator<Item = RecoveredRegion>,
    ) -> Result<Self, ConfigError> {
        let mut dir = Self::new(config, seed)?;
        for RecoveredRegion { handle, owner } in regions {
            if !dir.unclaimed.insert(&handle) {
                continue;
            }
            let slot = match dir.instance_ix.get(&owner) {
                Some(&slot) => slot,
                None => {
                    let quota = dir.config.max_instance_quota_bytes;
                    let window = dir.config.reply_window;
                    dir.add_instance(Instance::new(owner, None, None, quota, 1, 1, window, now))
                }
            };
            dir.instance_mut(slot).unclaimed.push(handle);
        }
        Ok(dir)
    }

    /// Takes the effects queued since the last call. Drain after every call.
    pub fn drain_effects(&mut self) -> std::vec::Drain<'_, Effect> {
        self.effects.drain(..)
    }

    /// The configuration in force.
    pub fn config(&self) -> &DirectoryConfig {
        &self.config
    }

    /// Random per incarnation (changes across restarts).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The limits published to clients.
    pub fn limits(&self) -> Limits {
        Limits {
            max_key_bytes: MAX_KEY_BYTES,
            max_batch: self.config.max_batch,
            max_pins_per_call: self.config.max_pins_per_call,
            reply_window: self.config.reply_window,
            notices_per_response: self.config.notices_per_response,
            session_lease: self.config.session_lease,
            instance_grace: self.config.instance_grace,
        }
    }

    /// Records a latency the driver measured for one request of `op`.
    pub fn record_latency(&mut self, op: OpKind, elapsed: std::time::Duration) {
        self.counters.latency[op.index()].record(types::duration_nanos(elapsed));
    }

    // --- small shared helpers ---------------------------------------------

    fn instance(&self, slot: u32) -> &Instance {
        self.instances[slot as usize]
            .as_ref()
            .expect("invariant: slot names a live instance")
    }

    fn instance_mut(&mut self, slot: u32) -> &mut Instance {
        self.instances[slot as usize]
            .as_mut()
            .expect("invariant: slot names a live instance")
    }

    fn add_instance(&mut self, instance: Instance) -> u32 {
        let id = instance.id.clone();
        let slot = match self.free_instance_slots.pop() {
            Some(slot) => {
                self.instances[slot as usize] = Some(instance);
                slot
            }
            None => {
                self.instances.push(Some(instance));
                u32::try_from(self.instances.len() - 1)
                    .expect("invariant: max_instances keeps slots in u32")
            }
        };
        self.instance_ix.insert(id, slot);
        slot
    }

    /// Usage figures for the instance in `slot`.
    fn usage(&self, slot: u32) -> Usage {
        let inst = self.instance(slot);
        Usage {
            owned_bytes: inst.owned_bytes,
            used_bytes: inst.used_bytes,
            pool_free_bytes: self.pools.values().map(PoolUsage::estimated_free).sum(),
        }
    }

    /// Wraps a body with what rides on every response to the instance.
    fn reply<T>(&self, slot: u32, body: T) -> Reply<T> {
        Reply {
            body,
            notices: self
                .instance(slot)
                .notices
                .oldest(self.config.notices_per_response),
            usage: self.usage(slot),
        }
    }

    /// Validates a layout.
    fn check_layout(layout: &Layout) -> Result<(), DirectoryError> {
        let ps = layout.page_size_bytes;
        if ps == 0 || !ps.is_multiple_of(PAGE_SIZE_ALIGN_BYTES) || ps > MAX_PAGE_SIZE_BYTES {
            return Err(DirectoryError::InvalidLayout {
                page_size_bytes: ps,
                max_bytes: MAX_PAGE_SIZE_BYTES,
            });
        }
        Ok(())
    }

    /// Whether `new` more layouts could be interned.
    fn check_layout_room(&self, new: usize) -> Result<(), DirectoryError> {
        if self.layouts.len() + new > self.config.max_layouts {
            return Err(DirectoryError::TooManyLayouts {
                max: self.config.max_layouts,
            });
        }
        Ok(())
    }

    fn count_call(&mut self, op: OpKind, keys: usize, failed: bool) {
        let c = self.counters.op(op);
        c.calls += 1;
        c.keys += keys as u64;
        if failed {
            c.errors += 1;
        }
    }
}

/// An order-sensitive fingerprint of a request, to recognise a retry: the
/// sum of every value added, each mixed with its position.
///
/// The terms do not depend on one another, so the CPU overlaps their
/// multiplies, where a chain `fp = mix(fp ^ x)` made every key of a batch
/// wait for the previous key's two multiplies. The position makes the sum
/// order-sensitive: the same keys in another order are another request.
#[derive(Debug, Clone, Copy)]
struct Fingerprint {
    sum: u64,
    added: u64,
}

impl Fingerprint {
    fn new(op: OpKind, layout: Option<&Layout>) -> Self {
        let mut fp = Fingerprint {
            sum: 0x243F_6A88_85A3_08D3 ^ op as u64,
            added: 0,
        };
        if let Some(l) = layout {
            fp.add(l.page_size_bytes);
            fp.add(l.fingerprint);
        }
        fp
    }

    #[inline]
    fn add(&mut self, x: u64) {
        self.added += 1;
        let term = keys::mix(x ^ self.added.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.sum = self.sum.wrapping_add(term);
    }

    /// The fingerprint of everything added so far.
    fn value(&self) -> u64 {
        keys::mix(self.sum ^ self.added)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The server moves the directory into its event-loop thread.
    const _: () = {
        const fn assert_send<T: Send>() {}
        assert_send::<Directory>();
    };

    #[test]
    fn the_default_configuration_is_valid_and_a_bad_value_is_named() {
        DirectoryConfig::default().validate().unwrap();
        let bad = DirectoryConfig {
            reply_window: 100,
            ..DirectoryConfig::default()
        };
        let err = Directory::new(bad, [0; 32]).unwrap_err();
        assert!(err.to_string().contains("reply_window"), "{err}");
        let bad = DirectoryConfig {
            eviction: EvictionConfig {
                pool_low_watermark: 0.95,
                ..EvictionConfig::default()
            },
            ..DirectoryConfig::default()
        };
        assert!(bad.validate().is_err());
    }

    /// Found by a review of the directory: `max_region_bytes` had no upper
    /// bound, so an instance's pending region bytes (summed unchecked)
    /// could overflow.
    #[test]
    fn region_sizes_and_pending_requests_are_capped_so_byte_counts_cannot_overflow() {
        let with = |max_region_bytes, pending| DirectoryConfig {
            max_region_bytes,
            max_pending_region_requests_per_instance: pending,
            ..DirectoryConfig::default()
        };
        let err = with(u64::MAX, 16).validate().unwrap_err();
        assert!(err.to_string().contains("max_region_bytes"), "{err}");
        assert!(with(MAX_REGION_BYTES_CEILING + 1, 16).validate().is_err());
        with(
            MAX_REGION_BYTES_CEILING,
            MAX_PENDING_REGION_REQUESTS_CEILING,
        )
        .validate()
        .unwrap();
        let err = with(1 << 40, MAX_PENDING_REGION_REQUESTS_CEILING + 1)
            .validate()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("max_pending_region_requests_per_instance"),
            "{err}"
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_directory_and_another_seed_another_epoch() {
        let a = Directory::new(DirectoryConfig::default(), [3; 32]).unwrap();
        let b = Directory::new(DirectoryConfig::default(), [3; 32]).unwrap();
        let c = Directory::new(DirectoryConfig::default(), [4; 32]).unwrap();
        assert_eq!(a.epoch(), b.epoch());
        assert_eq!(a.state_digest(), b.state_digest());
        assert_ne!(a.epoch(), c.epoch());
    }
}
