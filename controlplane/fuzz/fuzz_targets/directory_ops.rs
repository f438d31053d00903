//! The directory state machine driven by fuzzed operation sequences: every
//! entry point, with well-formed and malformed arguments mixed (known and
//! unknown sessions, real and forged secrets and tokens, keys of legal and
//! illegal lengths, fresh, repeated and ancient sequence numbers, notice
//! acknowledgements behind, at and ahead of what was issued, pool answers
//! for known, unknown and repeated allocations, restarts recovering from
//! real and duplicated region lists, the last registry request sent again on
//! its session or another), under a configuration with small limits so that
//! every limit is reached. The choices lean towards valid requests — live
//! sessions, the instance's next sequence number, locations in the caller's
//! own regions at a fresh generation, pins the session holds — so that keys,
//! pins and notices pile up rather than every request being refused early.
//!
//! A reference model follows the directory from its own replies: the keys
//! and their locations (from `register` and `delete` outcomes, from the keys
//! a tick's eviction removed — read back and bounded by the eviction
//! counters — and from restarts), each live session's pins (from pinning
//! lookups and unpins, released when the session ends), the newest
//! generation registered on each page, each instance's state (attached,
//! awaiting its reattach after a restart, or absent) and its queue of
//! freed-page notices (one for every key removed from a region whose owner
//! is present; acknowledged by the requests of its sessions).
//!
//! After every operation:
//! - `Directory::check_invariants` passes;
//! - every `exists` and fresh `lookup` answer is the model's (present or
//!   absent, and the location: region, page, generation, length), and a
//!   lookup lists each region it names once, with the descriptor of the
//!   pool manager's grant;
//! - every fresh `register`, `unpin` and `delete` outcome agrees with the
//!   model (`Inserted` only for a new key on a page free and at a newer
//!   generation, `Duplicate` naming the model's location, `PageInUse` and
//!   `StaleGeneration` only when the model says so; `Unpinned` exactly when
//!   the session holds the pins; `Deleted`, `Pinned` with all sessions' pins,
//!   `Missing`); a retry answered from the reply cache (counted in
//!   `retries_answered`) repeats the original reply word for word, and no
//!   sequence number runs twice in one incarnation of an instance;
//! - every key of the model is in the directory at its location with the
//!   model's pin count, and the directory holds no other key; a region is
//!   freed only when no key of the model points into it; a tick removes at
//!   most `max_evictions_per_tick` keys, as many as it counts, none pinned,
//!   and none of a present owner's without the LRU;
//! - sessions, instances and their states, pins per instance and pending
//!   notices per instance match the model; a call on a session that is not
//!   live is refused as such, an acknowledgement ahead of the notices issued
//!   is refused, and one within them is applied; every reply carries exactly
//!   the model's oldest unacknowledged notices of the caller's instance, in
//!   order (keys evicted by one tick may reach the queue in any order among
//!   themselves), and a queue never exceeds `notice_queue_limit`;
//! - a refused request changed nothing but what it may: a second directory
//!   (the twin) is driven with the same calls, except that a refused request
//!   is replaced, on the twin, by what it may still apply — nothing for
//!   `hello`, `reattach` and `end_session`; for a request of a session, its
//!   notice acknowledgement (a heartbeat acknowledging the same) and possibly
//!   its `replies_received_below` (a request with the same claim refused by
//!   the reply window) — and then the two state digests must be equal, and
//!   the two must queue the same effects (none for a refusal). Every call
//!   both run must answer alike.

#![no_main]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Debug;
use std::time::Duration;

use cxlkv_controlplane::directory::{
    Caller, DeleteOutcome, Directory, DirectoryConfig, DirectoryError, DirectoryStats, Effect,
    EvictionConfig, FreedPageNotice, Hello, InstanceId, InstanceSecret, Layout, Location,
    LookupReply, MAX_SEQUENCE, Peer, PoolRequestId, PresentedRegion, Reattach, ReattachKind,
    RecoveredRegion, RegionGrant, RegionHandle, RegionStatus, RegionToken, RegisterEntry,
    RegisterOutcome, RejectReason, Sequence, SessionEndReason, SessionId, Time, UnpinEntry,
    UnpinOutcome,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};
use libfuzzer_sys::arbitrary::{Result as AResult, Unstructured};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 4] = ["alpha", "beta", "gamma", "bad name"];
const LAYOUTS: [Layout; 3] = [
    Layout {
        page_size_bytes: 4096,
        fingerprint: 1,
    },
    Layout {
        page_size_bytes: 8192,
        fingerprint: 2,
    },
    Layout {
        page_size_bytes: 1000,
        fingerprint: 3,
    },
];
const NOTICES_PER_RESPONSE: usize = 2;
const NOTICE_QUEUE_LIMIT: usize = 8;
const MAX_EVICTIONS_PER_TICK: usize = 3;

/// The operations a step may take.
#[derive(Debug, Clone, Copy)]
enum Op {
    Hello,
    Reattach,
    Heartbeat,
    Close,
    EndSession,
    Tick,
    Register,
    Lookup,
    Exists,
    Unpin,
    Delete,
    RequestRegion,
    RegionAllocated,
    ReturnRegion,
    PoolUsage,
    Retry,
    Restart,
    EndAndTick,
}

/// Each operation with its weight out of 64: mostly registry requests, few
/// session ends and restarts, so that keys, pins and notices pile up.
///
/// The generators below put the common, valid choice where a byte of 0
/// leads (the low end of a range, the `true` side of a ratio) and the rare
/// or malformed ones elsewhere: `arbitrary` maps 0 bytes and exhausted input
/// there, and fuzzed inputs are full of them.
const OPS: [(Op, u8); 18] = [
    (Op::Register, 10),
    (Op::Hello, 4),
    (Op::Reattach, 3),
    (Op::Heartbeat, 2),
    (Op::Close, 1),
    (Op::EndSession, 1),
    (Op::Tick, 4),
    (Op::Exists, 4),
    (Op::Unpin, 4),
    (Op::Restart, 1),
    (Op::Delete, 6),
    (Op::RequestRegion, 4),
    (Op::RegionAllocated, 4),
    (Op::EndAndTick, 1),
    (Op::ReturnRegion, 2),
    (Op::PoolUsage, 2),
    (Op::Retry, 3),
    (Op::Lookup, 8),
];

const _: () = {
    let mut total = 0;
    let mut i = 0;
    while i < OPS.len() {
        total += OPS[i].1 as u32;
        i += 1;
    }
    assert!(total == 64);
};

fn op(u: &mut Unstructured<'_>) -> AResult<Op> {
    let mut x = u.int_in_range(0..=63u8)?;
    for (op, weight) in OPS {
        if x < weight {
            return Ok(op);
        }
        x -= weight;
    }
    unreachable!("the weights add up to 64")
}

fn config(u: &mut Unstructured<'_>) -> AResult<DirectoryConfig> {
    Ok(DirectoryConfig {
        max_batch: 8,
        max_pins_per_call: 4,
        max_keys: 24,
        max_sessions: 6,
        max_sessions_per_instance: 3,
        max_instances: 3,
        max_layouts: 2,
        max_regions_per_instance: 4,
        max_pending_region_requests_per_instance: 2,
        max_region_bytes: 64 << 10,
        max_pinned_keys_per_session: 6,
        // Below sessions × keys per session, so that the fuzzer meets it.
        max_pinned_entries: 20,
        session_lease: Duration::from_millis(1000),
        instance_grace: Duration::from_millis(2000),
        reply_window: 64,
        reply_cache_bytes_per_instance: *u.choose(&[1usize << 20, 1000, 200])?,
        notice_queue_limit: NOTICE_QUEUE_LIMIT,
        notices_per_response: NOTICES_PER_RESPONSE,
        tcp_requires_secret: true,
        max_instance_quota_bytes: if u.arbitrary()? { Some(96 << 10) } else { None },
        long_held_pin: Duration::from_millis(500),
        long_held_pins_listed: 2,
        ended_sessions_remembered: 4,
        eviction: EvictionConfig {
            orphans: u.arbitrary()?,
            pool_high_watermark: 0.5,
            pool_low_watermark: 0.25,
            lru: u.arbitrary()?,
            lru_high_fill: 0.2,
            lru_low_fill: 0.1,
            max_evictions_per_tick: MAX_EVICTIONS_PER_TICK,
        },
    })
}

/// Mostly one of six short keys; sometimes an empty, an oversized or an
/// arbitrary one.
fn key(u: &mut Unstructured<'_>) -> AResult<Vec<u8>> {
    Ok(match u.int_in_range(0..=63u8)? {
        61 => Vec::new(),
        62 => vec![b'x'; 513],
        63 => u.arbitrary::<Vec<u8>>()?,
        k => vec![b'k', k % 6],
    })
}

/// 1 to 9 keys (one more than `max_batch`), or none.
fn keys(u: &mut Unstructured<'_>) -> AResult<Vec<Vec<u8>>> {
    let n = match u.int_in_range(0..=9usize)? {
        9 => 0,
        n => n + 1,
    };
    (0..n).map(|_| key(u)).collect()
}

fn name_ix(id: &InstanceId) -> usize {
    NAMES
        .iter()
        .position(|n| *n == id.as_str())
        .expect("only the fuzzer's names are instances")
}

/// Serial-number order of generations, as the directory compares them.
fn newer(generation: u32, newest: u32) -> bool {
    (generation.wrapping_sub(newest) as i32) > 0
}

// --- the reference model ----------------------------------------------------

/// A key of the directory's key space: its layout (page size, fingerprint)
/// and its bytes. (`Layout` has no order; the model's maps are ordered so
/// that a run is deterministic.)
type KeyId = (u64, u64, Vec<u8>);

fn key_id(layout: &Layout, key: &[u8]) -> KeyId {
    (layout.page_size_bytes, layout.fingerprint, key.to_vec())
}

fn layout_of(id: &KeyId) -> Layout {
    Layout {
        page_size_bytes: id.0,
        fingerprint: id.1,
    }
}

/// What a freed-page notice says: region, page, generation.
type Freed = (RegionId, PageIndex, Generation);

/// One queued notice: known, or one of a group of keys a tick evicted for
/// the same owner (their order in the queue is the LRU's, which the model
/// does not follow): the first reply carrying it says which.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Known(Freed),
    OneOf(usize),
}

/// An instance's queue of unacknowledged freed-page notices.
#[derive(Debug)]
struct Notices {
    next_seq: u64,
    queue: VecDeque<(u64, Slot)>,
}

impl Notices {
    fn starting_at(first_seq: u64) -> Self {
        Self {
            next_seq: first_seq,
            queue: VecDeque::new(),
        }
    }

    fn highest_issued(&self) -> u64 {
        self.next_seq - 1
    }

    fn ack(&mut self, ack: u64) {
        while self.queue.front().is_some_and(|(seq, _)| *seq <= ack) {
            self.queue.pop_front();
        }
    }

    fn push(&mut self, slot: Slot) {
        self.queue.push_back((self.next_seq, slot));
        self.next_seq += 1;
    }
}

impl Default for Notices {
    fn default() -> Self {
        Self::starting_at(1)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Status {
    #[default]
    Absent,
    /// Recovered by a restart, waiting for its owner's reattach.
    Awaiting,
    /// Has a secret: created by `hello` or `reattach`.
    Attached,
}

#[derive(Debug, Default)]
struct MInst {
    status: Status,
    notices: Notices,
}

/// A reply a retry must get again.
#[derive(Debug, Clone, PartialEq)]
enum Body {
    Register(Vec<RegisterOutcome>),
    Lookup(LookupReply),
    Unpin(Vec<UnpinOutcome>),
    Delete(Vec<DeleteOutcome>),
}

#[derive(Debug, Default)]
struct Model {
    keys: BTreeMap<KeyId, Location>,
    pins: BTreeMap<(SessionId, KeyId), u32>,
    /// The newest generation registered on each page, while its region
    /// record lives.
    newest: BTreeMap<(RegionId, u32), u32>,
    /// Live sessions and their instance.
    sessions: BTreeMap<SessionId, usize>,
    instances: [MInst; NAMES.len()],
    /// The fresh replies of each instance's current incarnation, by sequence
    /// number.
    replies: BTreeMap<(usize, u64), Body>,
    /// The notices of each `Slot::OneOf` group not yet seen in a reply.
    groups: Vec<Vec<Freed>>,
}

impl Model {
    fn pins_on(&self, id: &KeyId) -> u32 {
        self.pins
            .iter()
            .filter(|((_, k), _)| k == id)
            .map(|(_, &p)| p)
            .sum()
    }

    fn pins_of(&self, session: SessionId) -> u64 {
        self.pins
            .iter()
            .filter(|((s, _), _)| *s == session)
            .map(|(_, &p)| u64::from(p))
            .sum()
    }

    fn sessions_of(&self, ix: usize) -> usize {
        self.sessions.values().filter(|&&i| i == ix).count()
    }

    fn end_session(&mut self, session: SessionId) {
        self.sessions.remove(&session);
        self.pins.retain(|(s, _), _| *s != session);
    }

    /// A new incarnation of instance `ix`: a fresh reply window and notice
    /// queue.
    fn incarnation(&mut self, ix: usize, first_notice: u64) {
        let inst = &mut self.instances[ix];
        inst.status = Status::Attached;
        inst.notices = Notices::starting_at(first_notice);
        self.replies.retain(|(i, _), _| *i != ix);
    }

    fn gone(&mut self, ix: usize) {
        assert_eq!(
            self.sessions_of(ix),
            0,
            "instance {} went with live sessions",
            NAMES[ix]
        );
        self.instances[ix] = MInst::default();
        self.replies.retain(|(i, _), _| *i != ix);
    }

    fn key_at(&self, region: RegionId, page: PageIndex) -> Option<&KeyId> {
        self.keys
            .iter()
            .find(|(_, l)| l.region == region && l.page == page)
            .map(|(id, _)| id)
    }
}

/// What a refused request may still have applied (see the module docs).
#[derive(Debug, Clone, Copy)]
enum Refusal {
    Nothing,
    /// The caller's notice acknowledgement, and its `replies_received_below`
    /// if above 1.
    Caller {
        caller: Caller,
        below: u64,
    },
}

/// Counters as of the end of the previous step.
#[derive(Debug, Default)]
struct Seen {
    retries: u64,
    orphan_evictions: u64,
    lru_evictions: u64,
}

/// A registry request, kept so that a later step can send it again (a
/// retry, on the same session or another).
#[derive(Debug, Clone)]
enum Req {
    Register {
        seq: Sequence,
        layout: Layout,
        entries: Vec<(Vec<u8>, Location)>,
    },
    Lookup {
        seq: Option<Sequence>,
        layout: Layout,
        keys: Vec<Vec<u8>>,
        pins: u32,
    },
    Unpin {
        seq: Sequence,
        layout: Layout,
        entries: Vec<(Vec<u8>, u32)>,
    },
    Delete {
        seq: Sequence,
        layout: Layout,
        keys: Vec<Vec<u8>>,
    },
}

struct World {
    dir: Directory,
    /// Driven alike, but for refusals (see `refused`).
    twin: Directory,
    config: DirectoryConfig,
    now_ns: u64,
    /// Every session issued, live or not.
    sessions: Vec<SessionId>,
    secrets: Vec<(usize, InstanceSecret)>,
    /// Regions granted and not freed, with the instance they were granted
    /// to (or confirmed to by a reattach).
    grants: Vec<(usize, RegionGrant)>,
    /// Allocations asked of the pool manager: owner and bytes asked.
    pending: Vec<(PoolRequestId, usize, u64)>,
    next_region: u64,
    restarts: u64,
    /// Per instance name, the sequence number its requests mostly use next
    /// (counting up from its incarnation's first accepted one).
    next_seq: [u64; NAMES.len()],
    /// The last registry request sent, and its session.
    last: Option<(SessionId, Req)>,
    model: Model,
    seen: Seen,
}

impl World {
    fn now(&self) -> Time {
        Time::from_nanos(self.now_ns)
    }

    /// Mostly a live session; else one issued before, or any number.
    fn session(&self, u: &mut Unstructured<'_>) -> AResult<SessionId> {
        let live: Vec<SessionId> = self.model.sessions.keys().copied().collect();
        if !live.is_empty() && u.ratio(5, 6)? {
            return Ok(*u.choose(&live)?);
        }
        self.any_session(u)
    }

    /// Any session issued, or any number: the target of a session's end,
    /// which would leave few live sessions if it mostly named live ones.
    fn any_session(&self, u: &mut Unstructured<'_>) -> AResult<SessionId> {
        if !self.sessions.is_empty() && u.ratio(3, 4)? {
            return Ok(*u.choose(&self.sessions)?);
        }
        Ok(SessionId(u.int_in_range(0..=40u64)?))
    }

    /// A caller on `session`, acknowledging — for a live session — every
    /// notice its instance was issued, some of those pending (lagging
    /// behind), nothing, one more than issued, or an arbitrary number.
    fn caller_on(&self, u: &mut Unstructured<'_>, session: SessionId) -> AResult<Caller> {
        let (highest, pending) = self.model.sessions.get(&session).map_or((0, 0), |&ix| {
            let notices = &self.model.instances[ix].notices;
            (notices.highest_issued(), notices.queue.len() as u64)
        });
        let notice_ack = match u.int_in_range(0..=31u8)? {
            0..=9 => highest,
            10..=15 => u.int_in_range(highest.saturating_sub(pending)..=highest)?,
            16 => u.int_in_range(0..=12u64)?,
            17 => highest + 1,
            _ => 0,
        };
        Ok(Caller {
            session,
            notice_ack,
        })
    }

    fn caller(&self, u: &mut Unstructured<'_>) -> AResult<Caller> {
        let session = self.session(u)?;
        self.caller_on(u, session)
    }

    /// The instance of `caller`'s session, if live.
    fn instance_of(&self, caller: &Caller) -> Option<usize> {
        self.model.sessions.get(&caller.session).copied()
    }

    /// Mostly the next number of `caller`'s instance; else an old, zero or
    /// out-of-range one.
    fn seq(&mut self, u: &mut Unstructured<'_>, caller: &Caller) -> AResult<Sequence> {
        let ix = self.instance_of(caller);
        let seq = match (u.int_in_range(0..=9u8)?, ix) {
            (7, _) => u.arbitrary()?,
            (8, _) => 0,
            (9, _) | (_, None) => u.int_in_range(1..=90u64)?,
            (_, Some(ix)) => {
                self.next_seq[ix] += 1;
                self.next_seq[ix] - 1
            }
        };
        let below = if u.ratio(3, 4)? {
            0
        } else {
            u.int_in_range(0..=seq.min(90))?
        };
        Ok(Sequence {
            seq,
            replies_received_below: below,
        })
    }

    /// Mostly one of the two valid layouts.
    fn layout(&self, u: &mut Unstructured<'_>) -> AResult<Layout> {
        let mut l = LAYOUTS[match u.int_in_range(0..=7u8)? {
            7 => 2,
            x => usize::from(x % 2),
        }];
        if !u.ratio(15, 16)? {
            l.fingerprint = u.arbitrary()?;
        }
        Ok(l)
    }

    /// The grants of instance `owner` (of `layout`, if given).
    fn own(&self, owner: Option<usize>, layout: Option<Layout>) -> Vec<RegionGrant> {
        self.grants
            .iter()
            .filter(|(o, g)| Some(*o) == owner && layout.is_none_or(|l| l == g.layout))
            .map(|(_, g)| *g)
            .collect()
    }

    /// Mostly the layout of one of `owner`'s regions.
    fn register_layout(&self, u: &mut Unstructured<'_>, owner: Option<usize>) -> AResult<Layout> {
        let own = self.own(owner, None);
        if !own.is_empty() && u.ratio(3, 4)? {
            return Ok(u.choose(&own)?.layout);
        }
        self.layout(u)
    }

    /// Mostly a valid location in a region of `owner` serving `layout` (a
    /// page inside it, a generation above the newest seen there, a length
    /// within the page); else anything.
    fn location(
        &self,
        u: &mut Unstructured<'_>,
        owner: Option<usize>,
        layout: Layout,
    ) -> AResult<Location> {
        let own = self.own(owner, Some(layout));
        if !own.is_empty() && u.ratio(4, 5)? {
            let g = u.choose(&own)?;
            let page_size = g.layout.page_size_bytes;
            let pages = (g.handle.len_bytes / page_size) as u32;
            if pages > 0 {
                let page = u.int_in_range(0..=pages - 1)?;
                let newest = self.model.newest.get(&(g.handle.region, page)).copied();
                let generation = match newest {
                    Some(n) if u.ratio(7, 8)? => n.wrapping_add(1).max(1),
                    _ => u.int_in_range(1..=5u32)?,
                };
                return Ok(Location {
                    region: g.handle.region,
                    page: PageIndex(page),
                    generation: Generation(generation),
                    len_bytes: u.int_in_range(1..=page_size as u32)?,
                });
            }
        }
        // An unknown region refuses the whole request: rarely.
        let region = if self.grants.is_empty() || !u.ratio(31, 32)? {
            RegionId(u.int_in_range(0..=20u64)?)
        } else {
            u.choose(&self.grants)?.1.handle.region
        };
        Ok(Location {
            region,
            page: PageIndex(u.int_in_range(0..=17u32)?),
            generation: Generation(u.int_in_range(0..=5u32)?),
            len_bytes: *u.choose(&[0u32, 1, 4096, 4097, 8192, u32::MAX])?,
        })
    }

    // --- driving the directory and its twin ------------------------------

    /// Runs `call` on the directory; if it succeeds, on the twin too (which
    /// must answer alike); if it is refused, reproduces on the twin what the
    /// refusal may have applied and compares the two.
    fn both<T: PartialEq + Debug>(
        &mut self,
        refusal: Refusal,
        call: impl Fn(&mut Directory) -> Result<T, DirectoryError>,
    ) -> Result<T, DirectoryError> {
        let r = call(&mut self.dir);
        match &r {
            Ok(_) => assert_eq!(
                call(&mut self.twin),
                r,
                "the twin, driven alike, answered otherwise"
            ),
            Err(_) => self.refused(refusal, &r),
        }
        r
    }

    /// The directory refused a request: the twin, which has not seen it,
    /// applies what the refusal may still apply — the caller's notice
    /// acknowledgement, as a heartbeat acknowledging the same does, and the
    /// caller's `replies_received_below`, as a request with the same claim
    /// refused by the reply window (a sequence number out of range) does —
    /// and the digests must then agree (the second only if the first alone
    /// does not: a refusal found before the reply window leaves the claim
    /// unapplied, one found after applies it).
    fn refused<T: Debug>(&mut self, refusal: Refusal, r: &Result<T, DirectoryError>) {
        let digest = self.dir.state_digest();
        if let Refusal::Caller { caller, below } = refusal {
            let now = self.now();
            let _ = self.twin.heartbeat(&caller, now);
            if below > 1 && self.twin.state_digest() != digest {
                let claim = Sequence {
                    seq: MAX_SEQUENCE + 1,
                    replies_received_below: below,
                };
                let _ = self.twin.return_region(&caller, claim, RegionId(0), now);
            }
        }
        assert_eq!(
            self.dir.state_digest(),
            self.twin.state_digest(),
            "a refused request ({r:?}, {refusal:?}) changed more than it may"
        );
    }

    // --- model checks -------------------------------------------------------

    /// The model's side of a request of `caller`'s session: a call on a
    /// session that is not live must be refused as such; an acknowledgement
    /// ahead of the notices issued, with `NoticeAckAhead`; any other
    /// acknowledgement is applied. Returns the instance if the request got
    /// past its session (it may still be refused).
    fn enter<T: Debug>(&mut self, caller: &Caller, r: &Result<T, DirectoryError>) -> Option<usize> {
        let Some(&ix) = self.model.sessions.get(&caller.session) else {
            assert!(
                matches!(
                    r,
                    Err(DirectoryError::UnknownSession { .. } | DirectoryError::SessionEnded { .. })
                ),
                "a call on session {} (not live) was answered {r:?}",
                caller.session
            );
            return None;
        };
        let notices = &mut self.model.instances[ix].notices;
        let highest = notices.highest_issued();
        if caller.notice_ack > highest {
            assert!(
                matches!(r, Err(DirectoryError::NoticeAckAhead { ack, highest_issued })
                    if *ack == caller.notice_ack && *highest_issued == highest),
                "an acknowledgement of notice {} of {highest} issued to {} was answered {r:?}",
                caller.notice_ack,
                NAMES[ix]
            );
            return None;
        }
        assert!(
            !matches!(
                r,
                Err(DirectoryError::UnknownSession { .. }
                    | DirectoryError::SessionEnded { .. }
                    | DirectoryError::NoticeAckAhead { .. })
            ),
            "a call on live session {} of {} acknowledging {} of {highest} notices was answered {r:?}",
            caller.session,
            NAMES[ix],
            caller.notice_ack
        );
        notices.ack(caller.notice_ack);
        Some(ix)
    }

    /// Whether the reply just given for `seq` of instance `ix` was a fresh
    /// execution (then it is recorded) rather than a retry answered from the
    /// reply cache (then it must be the recorded one).
    fn fresh(&mut self, ix: usize, seq: u64, body: Body) -> bool {
        let retries = self.dir.stats(self.now()).outcomes.retries_answered;
        let answered = retries - self.seen.retries;
        self.seen.retries = retries;
        match answered {
            0 => {
                let prior = self.model.replies.insert((ix, seq), body);
                assert!(
                    prior.is_none(),
                    "seq {seq} of {} ran twice (first {prior:?})",
                    NAMES[ix]
                );
                true
            }
            1 => {
                assert_eq!(
                    self.model.replies.get(&(ix, seq)),
                    Some(&body),
                    "a retry of seq {seq} of {} got another reply than the original",
                    NAMES[ix]
                );
                false
            }
            n => panic!("one request counted {n} retries answered"),
        }
    }

    /// A reply to instance `ix` carries its oldest unacknowledged notices.
    fn check_notices(&mut self, ix: usize, got: &[FreedPageNotice]) {
        let Model {
            instances, groups, ..
        } = &mut self.model;
        let queue = &mut instances[ix].notices.queue;
        let want: Vec<u64> = queue
            .iter()
            .take(NOTICES_PER_RESPONSE)
            .map(|(s, _)| *s)
            .collect();
        let seqs: Vec<u64> = got.iter().map(|n| n.seq).collect();
        assert_eq!(seqs, want, "notices of {} carried by a reply", NAMES[ix]);
        for (n, (_, slot)) in got.iter().zip(queue.iter_mut()) {
            let freed = (n.region, n.page, n.generation);
            match *slot {
                Slot::Known(k) => assert_eq!(freed, k, "notice {} of {}", n.seq, NAMES[ix]),
                Slot::OneOf(g) => {
                    let Some(i) = groups[g].iter().position(|f| *f == freed) else {
                        panic!(
                            "notice {n:?} of {} names no key evicted ({:?})",
                            NAMES[ix], groups[g]
                        );
                    };
                    groups[g].swap_remove(i);
                    *slot = Slot::Known(freed);
                }
            }
        }
    }

    /// The instance owning `region` now (present), if any.
    fn owner_of(&self, region: RegionId) -> Option<usize> {
        self.dir.region_owner(region).map(name_ix)
    }

    /// A key left the directory: its page goes back to its region's owner,
    /// if present.
    fn removed(&mut self, id: &KeyId) {
        let loc = self
            .model
            .keys
            .remove(id)
            .expect("model: a removed key was there");
        if let Some(ix) = self.owner_of(loc.region) {
            self.model.instances[ix].notices.push(Slot::Known((
                loc.region,
                loc.page,
                loc.generation,
            )));
        }
    }

    fn check_lookup(&self, layout: Layout, ks: &[Vec<u8>], reply: &LookupReply) {
        assert_eq!(reply.locations.len(), ks.len());
        let mut named = BTreeSet::new();
        for (k, got) in ks.iter().zip(&reply.locations) {
            let want = self.model.keys.get(&key_id(&layout, k));
            assert_eq!(got.as_ref(), want, "lookup of {k:?} under {layout:?}");
            if let Some(l) = got {
                named.insert(l.region);
            }
        }
        let listed: Vec<RegionId> = reply.regions.iter().map(|d| d.region).collect();
        let unique: BTreeSet<RegionId> = listed.iter().copied().collect();
        assert_eq!(
            listed.len(),
            unique.len(),
            "a region listed twice: {listed:?}"
        );
        assert_eq!(unique, named, "regions listed and regions named differ");
        for d in &reply.regions {
            let Some((_, g)) = self
                .grants
                .iter()
                .find(|(_, g)| g.handle.region == d.region)
            else {
                panic!("lookup names region {} never granted", d.region);
            };
            assert_eq!(*d, g.handle.descriptor(layout.page_size_bytes));
        }
    }

    fn model_register(
        &mut self,
        layout: Layout,
        entries: &[(Vec<u8>, Location)],
        outcomes: &[RegisterOutcome],
    ) {
        assert_eq!(outcomes.len(), entries.len());
        for ((k, loc), o) in entries.iter().zip(outcomes) {
            let id = key_id(&layout, k);
            let page = (loc.region, loc.page.0);
            let newest = self.model.newest.get(&page).copied();
            let present = self.model.keys.get(&id).copied();
            match *o {
                RegisterOutcome::Inserted => {
                    assert_eq!(present, None, "{k:?} inserted over {present:?}");
                    let other = self.model.key_at(loc.region, loc.page);
                    assert_eq!(other, None, "{k:?} inserted on a page in use");
                    assert!(
                        loc.generation.0 != 0 && newest.is_none_or(|n| newer(loc.generation.0, n)),
                        "{k:?} inserted at {loc:?}, not newer than generation {newest:?}"
                    );
                    self.model.keys.insert(id, *loc);
                    self.model.newest.insert(page, loc.generation.0);
                }
                RegisterOutcome::Duplicate(winner) => {
                    assert_eq!(Some(winner), present, "duplicate of {k:?}");
                }
                RegisterOutcome::Rejected(RejectReason::PageInUse { page: p }) => {
                    assert_eq!(
                        present, None,
                        "{k:?} registered: a duplicate, not PageInUse"
                    );
                    assert_eq!(p, loc.page);
                    assert!(
                        self.model.key_at(loc.region, loc.page).is_some(),
                        "PageInUse for {loc:?}, which no key uses"
                    );
                }
                RegisterOutcome::Rejected(RejectReason::StaleGeneration {
                    generation,
                    newest_seen,
                }) => {
                    assert_eq!(present, None, "{k:?} registered: a duplicate, not stale");
                    assert_eq!(generation, loc.generation);
                    assert!(self.model.key_at(loc.region, loc.page).is_none());
                    let stale = match newest {
                        Some(n) => newest_seen.0 == n && !newer(generation.0, n),
                        None => newest_seen.0 == 0,
                    };
                    assert!(
                        stale || generation.0 == 0,
                        "StaleGeneration for {loc:?}: newest {newest:?}, said {newest_seen:?}"
                    );
                }
                RegisterOutcome::Rejected(_) => {}
            }
        }
    }

    fn model_unpin(
        &mut self,
        session: SessionId,
        layout: Layout,
        entries: &[(Vec<u8>, u32)],
        outcomes: &[UnpinOutcome],
    ) {
        assert_eq!(outcomes.len(), entries.len());
        for ((k, count), o) in entries.iter().zip(outcomes) {
            let held = (session, key_id(&layout, k));
            let want = match self.model.pins.get_mut(&held) {
                Some(n) if *n >= *count => {
                    *n -= count;
                    if *n == 0 {
                        self.model.pins.remove(&held);
                    }
                    UnpinOutcome::Unpinned
                }
                _ => UnpinOutcome::NotPinned,
            };
            assert_eq!(*o, want, "unpin of {count} on {k:?} by {session}");
        }
    }

    fn model_delete(&mut self, layout: Layout, ks: &[Vec<u8>], outcomes: &[DeleteOutcome]) {
        assert_eq!(outcomes.len(), ks.len());
        for (k, o) in ks.iter().zip(outcomes) {
            let id = key_id(&layout, k);
            let want = if !self.model.keys.contains_key(&id) {
                DeleteOutcome::Missing
            } else if self.model.pins_on(&id) > 0 {
                DeleteOutcome::Pinned {
                    pins: self.model.pins_on(&id),
                }
            } else {
                self.removed(&id);
                DeleteOutcome::Deleted
            };
            assert_eq!(*o, want, "delete of {k:?}");
        }
    }

    // --- the steps ------------------------------------------------------------

    fn step(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        let now = self.now();
        let mut ticked = false;
        match op(u)? {
            Op::Hello => self.hello(u)?,
            Op::Reattach => self.reattach(u)?,
            Op::Heartbeat => {
                let caller = self.caller(u)?;
                let refusal = Refusal::Caller { caller, below: 0 };
                let r = self.both(refusal, |d| d.heartbeat(&caller, now));
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    self.check_notices(ix, &reply.notices);
                }
            }
            Op::Close => {
                let s = self.any_session(u)?;
                self.dir.session_closed(s, now);
                self.twin.session_closed(s, now);
                self.model.end_session(s);
            }
            Op::EndSession => {
                let s = self.any_session(u)?;
                self.end_session(s);
            }
            Op::Tick => {
                let ms = if u.ratio(7, 8)? {
                    u.int_in_range(0..=300u64)?
                } else {
                    u.int_in_range(0..=3000u64)?
                };
                self.now_ns += ms * 1_000_000;
                self.dir.tick(self.now());
                self.twin.tick(self.now());
                ticked = true;
            }
            Op::Register => {
                let caller = self.caller(u)?;
                let seq = self.seq(u, &caller)?;
                let owner = self.instance_of(&caller);
                let layout = self.register_layout(u, owner)?;
                let n = u.int_in_range(0..=9usize)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push((key(u)?, self.location(u, owner, layout)?));
                }
                let req = Req::Register {
                    seq,
                    layout,
                    entries,
                };
                self.exec(caller, req);
            }
            Op::Lookup => {
                let caller = self.caller(u)?;
                let seq = self.seq(u, &caller)?;
                let seq = if u.ratio(3, 4)? { Some(seq) } else { None };
                let layout = self.layout(u)?;
                let pins = *u.choose(&[1u32, 0, 2, 0, 1, 4, 0, 5])?;
                let mut keys = keys(u)?;
                // A pinning lookup of more keys than a session may pin is
                // refused whole: mostly a few.
                if pins > 0 && u.ratio(3, 4)? {
                    keys.truncate(3);
                }
                let req = Req::Lookup {
                    seq,
                    layout,
                    keys,
                    pins,
                };
                self.exec(caller, req);
            }
            Op::Exists => {
                let caller = self.caller(u)?;
                let layout = self.layout(u)?;
                let ks = keys(u)?;
                let refusal = Refusal::Caller { caller, below: 0 };
                let r = self.both(refusal, |d| {
                    d.exists(&caller, layout, ks.iter().map(|k| k.as_slice()), now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    assert_eq!(reply.body.len(), ks.len());
                    for (k, &found) in ks.iter().zip(&reply.body) {
                        let want = self.model.keys.contains_key(&key_id(&layout, k));
                        assert_eq!(found, want, "exists of {k:?} under {layout:?}");
                    }
                    self.check_notices(ix, &reply.notices);
                }
            }
            Op::Unpin => {
                // Mostly a session holding pins, and pins it holds (of one
                // layout); else anything.
                let pinning: Vec<SessionId> = self.model.pins.keys().map(|(s, _)| *s).collect();
                let caller = if !pinning.is_empty() && u.ratio(3, 4)? {
                    let session = *u.choose(&pinning)?;
                    self.caller_on(u, session)?
                } else {
                    self.caller(u)?
                };
                let seq = self.seq(u, &caller)?;
                let held: Vec<(KeyId, u32)> = self
                    .model
                    .pins
                    .iter()
                    .filter(|((s, _), _)| *s == caller.session)
                    .map(|((_, id), n)| (id.clone(), *n))
                    .collect();
                let mut entries = Vec::new();
                let layout = if !held.is_empty() && u.ratio(3, 4)? {
                    let (first, _) = u.choose(&held)?;
                    let layout = layout_of(first);
                    for (id, n) in &held {
                        if layout_of(id) == layout && u.ratio(2, 3)? {
                            let count = if u.ratio(3, 4)? { *n } else { n + 1 };
                            entries.push((id.2.clone(), count));
                        }
                    }
                    layout
                } else {
                    for k in keys(u)? {
                        entries.push((k, *u.choose(&[1u32, 1, 2, 1, 2, 3, 4, 0])?));
                    }
                    self.layout(u)?
                };
                let req = Req::Unpin {
                    seq,
                    layout,
                    entries,
                };
                self.exec(caller, req);
            }
            Op::Delete => {
                let caller = self.caller(u)?;
                let seq = self.seq(u, &caller)?;
                let req = Req::Delete {
                    seq,
                    layout: self.layout(u)?,
                    keys: keys(u)?,
                };
                self.exec(caller, req);
            }
            Op::RequestRegion => {
                let caller = self.caller(u)?;
                let seq = self.seq(u, &caller)?;
                let layout = self.register_layout(u, None)?;
                let len_bytes = match u.int_in_range(0..=7u8)? {
                    5 => layout.page_size_bytes,
                    6 => 0,
                    7 => 1 << 20,
                    _ => *u.choose(&[16u64 << 10, 32 << 10, 64 << 10])?,
                };
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.replies_received_below,
                };
                let r = self.both(refusal, |d| {
                    d.request_region(&caller, seq, layout, len_bytes, now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    self.check_notices(ix, &reply.notices);
                }
            }
            Op::RegionAllocated => self.region_allocated(u)?,
            Op::ReturnRegion => {
                let caller = self.caller(u)?;
                let seq = self.seq(u, &caller)?;
                let region = match self.grants.is_empty() || !u.ratio(7, 8)? {
                    true => RegionId(u.int_in_range(0..=20u64)?),
                    false => u.choose(&self.grants)?.1.handle.region,
                };
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.replies_received_below,
                };
                let r = self.both(refusal, |d| d.return_region(&caller, seq, region, now));
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    self.check_notices(ix, &reply.notices);
                }
            }
            Op::PoolUsage => {
                let total = u.int_in_range(0..=512u64)? << 10;
                let free = u.int_in_range(0..=600u64)? << 10;
                let pool = PoolId(u.int_in_range(0..=1u32)?);
                self.dir.pool_usage(pool, total, free);
                self.twin.pool_usage(pool, total, free);
            }
            // The choice of a restart rides on one more byte: the bytes
            // that select it are frequent in the fuzzer's dictionary.
            Op::Restart if !u.ratio(3, 4)? => self.restart(u)?,
            Op::Restart => {}
            Op::Retry => {
                // The last registry request again (a retry), on its session
                // or another.
                let Some((session, req)) = self.last.clone() else {
                    return Ok(());
                };
                let session = if u.arbitrary()? {
                    session
                } else {
                    self.session(u)?
                };
                let caller = self.caller_on(u, session)?;
                self.exec(caller, req);
            }
            Op::EndAndTick => {
                let s = self.any_session(u)?;
                self.end_session(s);
                self.now_ns += 1_000_000;
                self.dir.tick(self.now());
                self.twin.tick(self.now());
                ticked = true;
            }
        }
        self.finish(ticked);
        Ok(())
    }

    fn hello(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        let now = self.now();
        let name = *u.choose(&NAMES)?;
        let peer = match u.int_in_range(0..=3u8)? {
            3 => Peer::Tcp {
                secret_matched: u.arbitrary()?,
            },
            n => Peer::Unix {
                pid: 7,
                uid: u32::from(n) + 1,
                gid: 0,
            },
        };
        let quota_bytes = if u.ratio(3, 4)? {
            None
        } else {
            Some(u.int_in_range(0..=200u64)? << 10)
        };
        let hello = Hello {
            instance: name,
            quota_bytes,
        };
        let r = self.both(Refusal::Nothing, |d| d.hello(hello, peer, now));
        if let Ok(w) = r {
            let ix = name_ix(&InstanceId::new(name).expect("a welcomed name is valid"));
            match self.model.instances[ix].status {
                Status::Awaiting => panic!("hello took over {name}, awaiting its reattach"),
                Status::Attached => assert_eq!(
                    self.model.sessions_of(ix),
                    0,
                    "hello took over {name}, which has live sessions"
                ),
                Status::Absent => {}
            }
            self.model.incarnation(ix, 1);
            self.next_seq[ix] = 1;
            let prior = self.model.sessions.insert(w.session, ix);
            assert_eq!(prior, None, "session {} issued twice", w.session);
            self.sessions.push(w.session);
            self.secrets.push((ix, w.secret));
        }
        Ok(())
    }

    fn reattach(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        let now = self.now();
        let ix = u.int_in_range(0..=NAMES.len() - 1)?;
        let secret = match self.secrets.iter().rfind(|(i, _)| *i == ix) {
            Some((_, s)) if u.ratio(7, 8)? => *s,
            _ => InstanceSecret(u.arbitrary()?),
        };
        let mut regions = Vec::new();
        for (owner, g) in &self.grants {
            if (*owner == ix || !u.ratio(7, 8)?) && u.ratio(3, 4)? {
                let mut handle = g.handle;
                if !u.ratio(9, 10)? {
                    handle.token = RegionToken(u.arbitrary()?);
                }
                let layout = if u.ratio(9, 10)? {
                    g.layout
                } else {
                    self.layout(u)?
                };
                regions.push(PresentedRegion { handle, layout });
            }
        }
        if !u.ratio(15, 16)? && !regions.is_empty() {
            regions.push(regions[0]);
        }
        let highest = self.model.instances[ix].notices.highest_issued();
        let notice_ack = match u.int_in_range(0..=7u8)? {
            0..=2 => highest,
            4 => u.arbitrary()?,
            5 => u.int_in_range(0..=12u64)?,
            6 => highest + 1,
            _ => 0,
        };
        let req = Reattach {
            instance: NAMES[ix],
            secret,
            regions: &regions,
            next_seq: match u.int_in_range(0..=7u8)? {
                5 => u.arbitrary()?,
                6 | 7 => u.int_in_range(0..=100u64)?,
                _ => self.next_seq[ix],
            },
            notice_ack,
            quota_bytes: None,
        };
        let peer = Peer::Unix {
            pid: 7,
            uid: 1,
            gid: 0,
        };
        let status = self.model.instances[ix].status;
        let r = self.both(Refusal::Nothing, |d| d.reattach(req, peer, now));
        let Ok(a) = r else {
            return Ok(());
        };
        match status {
            Status::Attached => {
                assert!(
                    notice_ack <= highest,
                    "a reattach acknowledging notice {notice_ack} of {highest} issued"
                );
                self.model.instances[ix].notices.ack(notice_ack);
            }
            Status::Awaiting | Status::Absent => {
                assert_eq!(a.kind, ReattachKind::Recovered);
                self.model.incarnation(ix, notice_ack.saturating_add(1));
            }
        }
        self.next_seq[ix] = self.next_seq[ix].max(a.oldest_accepted_seq);
        let prior = self.model.sessions.insert(a.session, ix);
        assert_eq!(prior, None, "session {} issued twice", a.session);
        self.sessions.push(a.session);
        self.secrets.push((ix, secret));
        self.check_notices(ix, &a.notices);
        for (p, v) in regions.iter().zip(&a.regions) {
            if *v == RegionStatus::Confirmed
                && let Some(g) = self
                    .grants
                    .iter_mut()
                    .find(|(_, g)| g.handle.region == p.handle.region)
            {
                *g = (
                    ix,
                    RegionGrant {
                        handle: g.1.handle,
                        layout: p.layout,
                    },
                );
            }
        }
        Ok(())
    }

    /// The pool manager answers an allocation: mostly one asked for, with a
    /// new region of the size asked; sometimes an unknown or repeated one,
    /// a region id reused, a short region, or a failure.
    fn region_allocated(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        if self.pending.is_empty() && u.ratio(7, 8)? {
            return Ok(());
        }
        let (request, owner, asked) = if self.pending.is_empty() {
            (PoolRequestId(u.int_in_range(0..=10u64)?), None, 4096)
        } else {
            let i = u.int_in_range(0..=self.pending.len() - 1)?;
            let (request, owner, asked) = if u.ratio(7, 8)? {
                self.pending.swap_remove(i)
            } else {
                self.pending[i]
            };
            (request, Some(owner), asked)
        };
        let result = if !u.ratio(5, 6)? {
            Err(String::from("no space"))
        } else {
            let region = if u.ratio(9, 10)? {
                self.next_region += 1;
                RegionId(self.next_region)
            } else {
                RegionId(u.int_in_range(0..=self.next_region)?)
            };
            let len_bytes = if u.ratio(3, 4)? {
                asked
            } else {
                *u.choose(&[4096u64, 16 << 10, 32 << 10, 64 << 10])?
            };
            Ok(RegionHandle {
                region,
                pool: PoolId(0),
                offset_bytes: region.0 << 16,
                len_bytes,
                token: RegionToken([region.0 as u8; 32]),
            })
        };
        let completions = self.dir.region_allocated(request, result.clone());
        let twin = self.twin.region_allocated(request, result);
        assert_eq!(completions, twin, "the twin completed otherwise");
        for c in completions {
            if let Ok(reply) = c.result {
                let owner = owner.expect("a grant answers a request made");
                assert_eq!(self.model.instances[owner].status, Status::Attached);
                self.check_notices(owner, &reply.notices);
                if !self
                    .grants
                    .iter()
                    .any(|(_, g)| g.handle.region == reply.body.handle.region)
                {
                    self.grants.push((owner, reply.body));
                }
            }
        }
        Ok(())
    }

    /// A restart: recovered from the regions held (some listed twice, some
    /// under another owner).
    fn restart(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        let now = self.now();
        let mut regions = Vec::new();
        for (owner, g) in &self.grants {
            let owner = if u.ratio(9, 10)? {
                *owner
            } else {
                u.int_in_range(0..=2usize)?
            };
            let Ok(owner) = InstanceId::new(NAMES[owner]) else {
                continue;
            };
            let r = RecoveredRegion {
                handle: g.handle,
                owner,
            };
            if !u.ratio(9, 10)? {
                regions.push(r.clone());
            }
            regions.push(r);
        }
        self.restarts += 1;
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&self.restarts.to_le_bytes());
        let recover = || {
            Directory::recover(self.config.clone(), seed, now, regions.clone())
                .expect("the fuzz configuration is valid")
        };
        self.dir = recover();
        self.twin = recover();
        self.pending.clear();
        // Everything but the regions is gone; each region's first listing
        // names the instance that awaits its reattach.
        self.model = Model::default();
        let mut listed = BTreeSet::new();
        for r in &regions {
            if listed.insert(r.handle.region) {
                self.model.instances[name_ix(&r.owner)].status = Status::Awaiting;
            }
        }
        self.seen = Seen::default();
        Ok(())
    }

    /// Sends a registry request on `caller`'s session, checks the reply
    /// against the model and updates it (for a fresh execution).
    fn exec(&mut self, caller: Caller, req: Req) {
        let now = self.now();
        self.last = Some((caller.session, req.clone()));
        match req {
            Req::Register {
                seq,
                layout,
                entries,
            } => {
                let batch: Vec<RegisterEntry<'_>> = entries
                    .iter()
                    .map(|(k, l)| RegisterEntry {
                        key: k,
                        location: *l,
                    })
                    .collect();
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.replies_received_below,
                };
                let r = self.both(refusal, |d| {
                    d.register(&caller, seq, layout, batch.iter().copied(), now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    if self.fresh(ix, seq.seq, Body::Register(reply.body.clone())) {
                        self.model_register(layout, &entries, &reply.body);
                    }
                    self.check_notices(ix, &reply.notices);
                }
            }
            Req::Lookup {
                seq,
                layout,
                keys,
                pins,
            } => {
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.map_or(0, |s| s.replies_received_below),
                };
                let r = self.both(refusal, |d| {
                    let ks = keys.iter().map(|k| k.as_slice());
                    d.lookup(&caller, seq, layout, ks, pins, now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    let fresh = pins == 0 || {
                        let seq = seq.expect("a pinning lookup carries a sequence number");
                        self.fresh(ix, seq.seq, Body::Lookup(reply.body.clone()))
                    };
                    if fresh {
                        self.check_lookup(layout, &keys, &reply.body);
                        for (k, l) in keys.iter().zip(&reply.body.locations) {
                            if pins > 0 && l.is_some() {
                                let held = (caller.session, key_id(&layout, k));
                                *self.model.pins.entry(held).or_default() += pins;
                            }
                        }
                    }
                    self.check_notices(ix, &reply.notices);
                }
            }
            Req::Unpin {
                seq,
                layout,
                entries,
            } => {
                let batch: Vec<UnpinEntry<'_>> = entries
                    .iter()
                    .map(|(k, count)| UnpinEntry {
                        key: k,
                        count: *count,
                    })
                    .collect();
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.replies_received_below,
                };
                let r = self.both(refusal, |d| {
                    d.unpin(&caller, seq, layout, batch.iter().copied(), now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    if self.fresh(ix, seq.seq, Body::Unpin(reply.body.clone())) {
                        self.model_unpin(caller.session, layout, &entries, &reply.body);
                    }
                    self.check_notices(ix, &reply.notices);
                }
            }
            Req::Delete { seq, layout, keys } => {
                let refusal = Refusal::Caller {
                    caller,
                    below: seq.replies_received_below,
                };
                let r = self.both(refusal, |d| {
                    d.delete(&caller, seq, layout, keys.iter().map(|k| k.as_slice()), now)
                });
                if let Some(ix) = self.enter(&caller, &r)
                    && let Ok(reply) = &r
                {
                    if self.fresh(ix, seq.seq, Body::Delete(reply.body.clone())) {
                        self.model_delete(layout, &keys, &reply.body);
                    }
                    self.check_notices(ix, &reply.notices);
                }
            }
        }
    }

    /// An admin ends session `s`: it must be live exactly when the model
    /// says so, and release the model's pins.
    fn end_session(&mut self, s: SessionId) {
        let now = self.now();
        let r = self.both(Refusal::Nothing, |d| d.end_session(s, now));
        match r {
            Ok(ended) => {
                let ix = *self
                    .model
                    .sessions
                    .get(&s)
                    .unwrap_or_else(|| panic!("ended session {s}, which was not live"));
                assert_eq!(ended.pins_released, self.model.pins_of(s), "pins of {s}");
                self.model.end_session(s);
                assert_eq!(
                    ended.instance_left_without_sessions,
                    self.model.sessions_of(ix) == 0
                );
            }
            Err(DirectoryError::NoSuchTarget { .. }) => assert!(
                !self.model.sessions.contains_key(&s),
                "live session {s} could not be ended"
            ),
            Err(e) => panic!("end_session({s}): {e}"),
        }
    }

    /// After every step: effects, evictions and expiries, then the checks.
    fn finish(&mut self, ticked: bool) {
        let effects: Vec<Effect> = self.dir.drain_effects().collect();
        let twin: Vec<Effect> = self.twin.drain_effects().collect();
        assert_eq!(effects, twin, "the twin queued other effects");
        for e in &effects {
            if let Effect::SessionEnded { session, reason } = e {
                let live = self.model.sessions.contains_key(session);
                match reason {
                    SessionEndReason::LeaseExpired => {
                        assert!(live, "session {session} expired, but was not live");
                        self.model.end_session(*session);
                    }
                    SessionEndReason::EndedByAdmin => {
                        assert!(!live, "session {session} ended by admin, still live")
                    }
                    SessionEndReason::ConnectionClosed => {
                        panic!("a closed connection is not an effect")
                    }
                }
            }
        }
        let stats = self.dir.stats(self.now());
        if ticked {
            self.evicted(&stats);
            for (ix, name) in NAMES.iter().enumerate() {
                let listed = stats
                    .per_instance
                    .iter()
                    .any(|i| i.instance.as_str() == *name);
                if self.model.instances[ix].status != Status::Absent && !listed {
                    self.model.gone(ix);
                }
            }
        }
        for e in effects {
            match e {
                Effect::AllocateRegion {
                    request,
                    owner,
                    len_bytes,
                    ..
                } => {
                    self.pending.push((request, name_ix(&owner), len_bytes));
                }
                Effect::FreeRegion { handle, .. } => {
                    let region = handle.region;
                    if let Some((id, loc)) =
                        self.model.keys.iter().find(|(_, l)| l.region == region)
                    {
                        panic!("region {region} freed while {id:?} is registered at {loc:?}");
                    }
                    self.model.newest.retain(|(r, _), _| *r != region);
                    self.grants.retain(|(_, g)| g.handle.region != region);
                }
                _ => {}
            }
        }
        if let Err(v) = self.dir.check_invariants() {
            panic!("{v}");
        }
        self.check_model(&stats);
        self.seen = Seen {
            retries: stats.outcomes.retries_answered,
            orphan_evictions: stats.evictions.orphan_keys,
            lru_evictions: stats.evictions.lru_keys,
        };
    }

    /// The keys a tick evicted: those of the model the directory no longer
    /// holds, as many as it counted, none pinned, none of a present owner's
    /// without the LRU; their notices go to their owners, in an order the
    /// model leaves open.
    fn evicted(&mut self, stats: &DirectoryStats) {
        let gone: Vec<KeyId> = self
            .model
            .keys
            .keys()
            .filter(|id| self.dir.inspect_key(&layout_of(id), &id.2).is_none())
            .cloned()
            .collect();
        let orphan = stats.evictions.orphan_keys - self.seen.orphan_evictions;
        let lru = stats.evictions.lru_keys - self.seen.lru_evictions;
        assert_eq!(
            gone.len() as u64,
            orphan + lru,
            "keys gone in a tick: {gone:?}"
        );
        assert!(gone.len() <= MAX_EVICTIONS_PER_TICK);
        let eviction = &self.config.eviction;
        assert!(eviction.orphans || orphan == 0, "orphan eviction is off");
        assert!(eviction.lru || lru == 0, "LRU eviction is off");
        let mut freed: BTreeMap<usize, Vec<Freed>> = BTreeMap::new();
        for id in &gone {
            assert_eq!(self.model.pins_on(id), 0, "pinned key {id:?} evicted");
            let loc = self
                .model
                .keys
                .remove(id)
                .expect("model: evicted key was there");
            if let Some(ix) = self.owner_of(loc.region) {
                freed
                    .entry(ix)
                    .or_default()
                    .push((loc.region, loc.page, loc.generation));
            }
        }
        let owned: usize = freed.values().map(Vec::len).sum();
        assert!(
            owned as u64 <= lru,
            "{owned} keys of present owners evicted, {lru} by the LRU"
        );
        for (ix, f) in freed {
            let notices = &mut self.model.instances[ix].notices;
            if let [one] = f.as_slice() {
                notices.push(Slot::Known(*one));
            } else {
                let g = self.model.groups.len();
                for _ in 0..f.len() {
                    notices.push(Slot::OneOf(g));
                }
                self.model.groups.push(f);
            }
        }
    }

    /// The directory holds exactly the model's keys, pins, sessions,
    /// instances and notice queues.
    fn check_model(&self, stats: &DirectoryStats) {
        let m = &self.model;
        assert_eq!(stats.keys, m.keys.len() as u64, "key count");
        for (id, loc) in &m.keys {
            let Some(info) = self.dir.inspect_key(&layout_of(id), &id.2) else {
                panic!("key {id:?}, registered at {loc:?}, is gone");
            };
            assert_eq!(info.location, *loc, "location of {id:?}");
            assert_eq!(info.pins, m.pins_on(id), "pins on {id:?}");
        }
        let pins: u64 = m.pins.values().map(|&p| u64::from(p)).sum();
        assert_eq!(stats.pins, pins, "pins held");
        assert_eq!(stats.sessions, m.sessions.len() as u64, "live sessions");
        let mut instances = 0;
        for (ix, inst) in m.instances.iter().enumerate() {
            let listed = stats
                .per_instance
                .iter()
                .find(|i| i.instance.as_str() == NAMES[ix]);
            let Some(s) = listed else {
                assert_eq!(
                    inst.status,
                    Status::Absent,
                    "instance {} is gone",
                    NAMES[ix]
                );
                continue;
            };
            instances += 1;
            match inst.status {
                Status::Absent => panic!("instance {} is there", NAMES[ix]),
                Status::Awaiting => {
                    assert!(s.awaiting_reattach, "{} reattached", NAMES[ix]);
                    assert_eq!(s.sessions, 0);
                }
                Status::Attached => {
                    assert!(!s.awaiting_reattach, "{} awaits a reattach", NAMES[ix]);
                    assert_eq!(s.sessions, m.sessions_of(ix), "sessions of {}", NAMES[ix]);
                    let held: u64 = m
                        .sessions
                        .iter()
                        .filter(|(_, i)| **i == ix)
                        .map(|(s, _)| m.pins_of(*s))
                        .sum();
                    assert_eq!(s.pins_held, held, "pins held by {}", NAMES[ix]);
                }
            }
            assert_eq!(
                s.notices_pending,
                inst.notices.queue.len(),
                "notices pending for {}",
                NAMES[ix]
            );
            assert!(inst.notices.queue.len() <= NOTICE_QUEUE_LIMIT);
        }
        assert_eq!(stats.instances, instances, "instances");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(config) = config(&mut u) else {
        return;
    };
    let new = || Directory::new(config.clone(), [7; 32]).expect("the fuzz configuration is valid");
    let mut world = World {
        dir: new(),
        twin: new(),
        config: config.clone(),
        now_ns: 1,
        sessions: Vec::new(),
        secrets: Vec::new(),
        grants: Vec::new(),
        pending: Vec::new(),
        next_region: 0,
        restarts: 0,
        next_seq: [1; NAMES.len()],
        last: None,
        model: Model::default(),
        seen: Seen::default(),
    };
    for _ in 0..256 {
        if u.is_empty() || world.step(&mut u).is_err() {
            break;
        }
    }
});
