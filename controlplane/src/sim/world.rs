//! The simulated world: clients, the directory's process, the pool manager's
//! process, the network between them, the event loop, the fault schedule,
//! and the oracle that checks everything after every event.

use std::collections::{BTreeMap, BTreeSet};

use cxlkv_dataplane::ids::RegionId;

use crate::directory::{
    Caller, Completion, DeferredId, DeleteOutcome, Directory, DirectoryError, Effect, Hello,
    InstanceId, Layout, Location, LookupReply, Peer, PoolRequestId, Reattach, ReattachKind,
    RecoveredRegion, RegionGrant, RegionHandle, RegionReply, RegionStatus, RegionToken,
    RegisterEntry, RegisterOutcome, Reply, SessionEndReason, SessionId, Time, UnpinEntry,
    UnpinOutcome,
};
use crate::pool::{Handle, PoolError, Token};

use super::client::{Client, ClientCounters, Observation, PageState, Role};
use super::msg::{
    ClientReply, ClientRequest, ConnId, Message, PoolReply, PoolReplyBody, PoolRequest,
};
use super::net::{Ctx, Event, NetCounters};
use super::params::{
    BLOCK_BYTES, INSTANCE_GRACE_NS, LAYOUTS, LinkFaults, MS, POOL_GRACE_MS, Params, SEC,
    SESSION_LEASE_NS, Scale, TICK_NS,
};
use super::pool_node::{PoolCounters, PoolNode, directory_process, owner_label, pool_caller};
use super::rng::SimRng;

/// How long the world may take to settle after faults heal, to clean up,
/// and to drain, before that counts as a liveness failure.
const PHASE_LIMIT_NS: u64 = 90 * SEC;
/// A pool request without an answer for this long is sent again.
const POOL_RETRY_NS: u64 = 100 * MS;

/// A failed run: what broke, when, and how to see it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub seed: u64,
    pub event: u64,
    pub at_ns: u64,
    pub what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} failed at event {} (t = {:.6} s): {}",
            self.seed,
            self.event,
            self.at_ns as f64 / 1e9,
            self.what
        )
    }
}

/// What a passing run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub seed: u64,
    pub events: u64,
    /// Invariant checks run (one full check per event).
    pub checks: u64,
    pub simulated_ns: u64,
    pub clients: usize,
    pub client_crashes: u64,
    pub directory_restarts: u64,
    pub pool_restarts: u64,
    pub partitions: u64,
    /// Breaks of the directory's pool-manager connection, both ends alive.
    pub pool_link_breaks: u64,
    pub net: NetCounters,
    pub pool: PoolCounters,
    pub client: ClientCounters,
    pub keys_registered: u64,
    pub keys_deleted: u64,
    pub notices_checked: u64,
    pub retries_compared: u64,
    /// Keys of lookup and exists replies compared with the oracle.
    pub reads_checked: u64,
    pub rare: RarePaths,
    /// A digest of the run's trajectory: equal for equal seeds.
    pub trajectory: u64,
}

/// How often the rare paths ran: the proof that the checks above them
/// were exercised (the long form fails a campaign where one that should
/// run never did; `examples/sim.rs`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RarePaths {
    /// Keys evicted as orphans, by the LRU, and passed over by the LRU for
    /// a full notice queue (the directory's counters, over its restarts).
    pub evicted_orphan: u64,
    pub evicted_lru: u64,
    pub lru_skipped: u64,
    /// Region requests refused for the instance's quota.
    pub quota_refusals: u64,
    /// Deletes refused `busy` for an owner's full notice queue.
    pub notice_backlog_refusals: u64,
    /// The longest notice queue of one instance seen (in the periodic full
    /// statistics snapshot).
    pub notice_backlog_peak: u64,
    /// `Recovered` reattaches, and regions they presented that the
    /// directory answered `NotOwned`.
    pub recovered_reattaches: u64,
    pub reattach_regions_refused: u64,
    /// Retries answered `ReplyEvicted` (each checked to have run before).
    pub replies_evicted: u64,
    /// Keys the LRU evicted from a live owner's region, whose freed-page
    /// notice the oracle then expects (and checks arrives).
    pub lru_keys_owed_notices: u64,
    /// Sessions ended by their lease, and instances gone when their grace
    /// ran out, each as the oracle's own clock expected.
    pub sessions_expired: u64,
    pub instances_expired: u64,
}

impl RarePaths {
    pub fn add(&mut self, o: &Self) {
        self.evicted_orphan += o.evicted_orphan;
        self.evicted_lru += o.evicted_lru;
        self.lru_skipped += o.lru_skipped;
        self.quota_refusals += o.quota_refusals;
        self.notice_backlog_refusals += o.notice_backlog_refusals;
        self.notice_backlog_peak = self.notice_backlog_peak.max(o.notice_backlog_peak);
        self.recovered_reattaches += o.recovered_reattaches;
        self.reattach_regions_refused += o.reattach_regions_refused;
        self.replies_evicted += o.replies_evicted;
        self.lru_keys_owed_notices += o.lru_keys_owed_notices;
        self.sessions_expired += o.sessions_expired;
        self.instances_expired += o.instances_expired;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Run,
    /// Faults healed; waiting for everyone to settle.
    Heal {
        since: u64,
    },
    /// Clients gone; the janitor deletes every key.
    Clean {
        since: u64,
    },
    /// Waiting for sessions, instances and regions to go away.
    Drain {
        since: u64,
    },
    Done,
}

#[derive(Debug, Clone)]
struct DirConn {
    client: usize,
    process: u32,
    session: Option<SessionId>,
}

#[derive(Debug, Clone)]
enum PoolWork {
    Alloc {
        request: PoolRequestId,
        instance: u64,
        len_bytes: u64,
    },
    Free {
        handle: Handle,
    },
}

#[derive(Debug, Clone)]
struct PoolOut {
    work: PoolWork,
    /// Its `seq`, the same on every resend (an allocation's tag).
    seq: u64,
    sent_ns: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DirState {
    Down,
    /// Waiting for the pool manager's list of this directory's regions.
    Starting {
        rejoin: u64,
        sent_ns: u64,
    },
    Up,
}

/// A deferred region reply, and whom it goes to.
#[derive(Debug, Clone, Copy)]
struct DeferredTo {
    conn: ConnId,
    req_id: u64,
    client: usize,
    life: u64,
    seq: u64,
}

/// The directory's process: the real `Directory` and the driver around it.
#[derive(Debug)]
struct DirNode {
    incarnation: u32,
    state: DirState,
    dir: Option<Directory>,
    conns: BTreeMap<ConnId, DirConn>,
    deferred: BTreeMap<DeferredId, DeferredTo>,
    /// Every region this directory holds at the pool manager (what it
    /// presents when the pool manager restarts).
    handles: BTreeMap<RegionId, Handle>,
    pool_out: BTreeMap<u64, PoolOut>,
    /// The pool-manager incarnation this directory is attached to.
    attached_to: Option<u32>,
    /// The connection its pool requests go on.
    pool_conn: u64,
    attach: Option<(u64, u64)>,
    next_pool_id: u64,
    /// How each allocation it resolved was answered (the region, or `None`
    /// for a refusal): a late copy's answer must repeat it.
    allocs_resolved: BTreeMap<u64, Option<RegionId>>,
}

/// A client instance's life at the directory: from the `hello` (or the
/// `Recovered` reattach after being declared gone) that created it, to the
/// moment the directory forgets the instance. Directory restarts do not end
/// a life: the client recovers it.
///
/// When a life ends is the oracle's own reckoning, not read from the
/// directory: its last session ended (connection closed, admin, or a lease
/// the oracle saw run out, `Oracle::last_seen`) and `INSTANCE_GRACE_NS`
/// passed by a directory tick; or a restarted directory was not given a
/// region of it. `World::check_lives` then compares the directory's
/// instances with the lives the oracle holds.
#[derive(Debug, Clone, Copy)]
struct Life {
    id: u64,
    process: u32,
    ended: bool,
    /// Since when it has had no session (`None` while it has one).
    absent_since: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum RecordedBody {
    Register(Vec<RegisterOutcome>),
    Lookup(LookupReply),
    Unpin(Vec<UnpinOutcome>),
    Delete(Vec<DeleteOutcome>),
    Grant(RegionGrant),
    Returned,
}

#[derive(Debug, Clone)]
struct OracleKey {
    location: Location,
    owner: usize,
    life: u64,
    incarnation: u32,
}

/// What the directory must hold, kept independently of it.
#[derive(Debug, Default)]
struct Oracle {
    keys: BTreeMap<(usize, Vec<u8>), OracleKey>,
    pins: BTreeMap<(SessionId, usize, Vec<u8>), u32>,
    sessions: BTreeMap<SessionId, (usize, u64)>,
    /// When the directory last heard from each live session: the time of
    /// its handshake or of its last request (every request renews the
    /// lease first, whatever it answers).
    last_seen: BTreeMap<SessionId, u64>,
    lives: Vec<Option<Life>>,
    next_life: u64,
    /// First reply of every executed mutating request, by (client, life,
    /// directory incarnation, seq).
    replies: BTreeMap<(usize, u64, u32, u64), RecordedBody>,
    /// Notices each client must receive: (region, page, generation) → the
    /// (life, directory incarnation) of each deletion that queued one.
    notices: Vec<ExpectedNotices>,
}

/// One client's expected notices: (region, page, generation) → the (life,
/// directory incarnation) of each deletion that queued one.
type ExpectedNotices = BTreeMap<(RegionId, u32, u32), Vec<(u64, u32)>>;

impl Oracle {
    /// A freed-page notice for `loc` is owed to the client named `owner`
    /// (its current life, from directory incarnation `incarnation`).
    /// `false` if no client has that name.
    fn owe_notice(
        &mut self,
        clients: &[Client],
        owner: &str,
        loc: Location,
        incarnation: u32,
    ) -> bool {
        let Some(oc) = clients.iter().position(|c| c.name == owner) else {
            return false;
        };
        let owner_life = self.lives[oc].map_or(0, |l| l.id);
        self.notices[oc]
            .entry((loc.region, loc.page.0, loc.generation.0))
            .or_default()
            .push((owner_life, incarnation));
        true
    }

    /// A session opened at `now` for life `life` of client `client`.
    fn open_session(&mut self, session: SessionId, client: usize, life: u64, now: u64) {
        self.sessions.insert(session, (client, life));
        self.last_seen.insert(session, now);
        if let Some(l) = self.lives[client].as_mut() {
            l.absent_since = None;
        }
    }

    /// A session ended at `now`: its pins go; if it was its life's last,
    /// the life's grace starts.
    fn end_session(&mut self, session: SessionId, now: u64) {
        self.last_seen.remove(&session);
        if let Some((client, life)) = self.sessions.remove(&session)
            && !self.sessions.values().any(|&s| s == (client, life))
            && let Some(l) = self.lives[client].as_mut()
            && l.id == life
        {
            l.absent_since = Some(now);
        }
        let keys: Vec<_> = self
            .pins
            .range((session, 0, Vec::new())..)
            .take_while(|((s, _, _), _)| *s == session)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.pins.remove(&k);
        }
    }

    fn new_life(&mut self, client: usize, process: u32) -> u64 {
        self.next_life += 1;
        self.lives[client] = Some(Life {
            id: self.next_life,
            process,
            ended: false,
            absent_since: None,
        });
        self.next_life
    }

    /// Records a reply; `true` when it is the first (the request ran now),
    /// `Err` when a retry's reply differs from the original.
    fn record(&mut self, key: (usize, u64, u32, u64), body: RecordedBody) -> Result<bool, String> {
        match self.replies.get(&key) {
            None => {
                self.replies.insert(key, body);
                Ok(true)
            }
            Some(first) if *first == body => Ok(false),
            Some(first) => Err(format!(
                "retry of seq {} (client {}, life {}) answered {body:?}, the original was {first:?}",
                key.3, key.0, key.1
            )),
        }
    }
}

fn layout_index(layout: &Layout) -> usize {
    LAYOUTS
        .iter()
        .position(|l| l == layout)
        .expect("clients only use the simulation's layouts")
}

fn dir_handle(h: &Handle) -> RegionHandle {
    RegionHandle {
        region: h.region,
        pool: h.pool,
        offset_bytes: h.offset_bytes,
        len_bytes: h.len_bytes,
        token: RegionToken(h.token.0),
    }
}

fn pool_handle(h: &RegionHandle, instance: u64) -> Handle {
    Handle {
        region: h.region,
        pool: h.pool,
        offset_bytes: h.offset_bytes,
        len_bytes: h.len_bytes,
        owner: owner_label(instance),
        token: Token(h.token.0),
    }
}

/// Every this many checks, the check also builds the directory's full
/// statistics snapshot (the totals it compares every time come from the
/// same fields; the snapshot's other work is what this keeps exercised).
const STATS_EVERY: u64 = 64;

/// The world of one seed.
#[derive(Debug)]
pub(crate) struct World {
    seed: u64,
    params: Params,
    ctx: Ctx,
    clients: Vec<Client>,
    dirn: DirNode,
    pool: PoolNode,
    oracle: Oracle,
    phase: Phase,
    next_conn: ConnId,
    /// The next directory → pool-manager connection's number.
    next_pool_conn: u64,
    /// The directory incarnation each connection was opened to.
    conn_incarnation: BTreeMap<ConnId, u32>,
    /// The incarnation that sent the reply being delivered.
    reply_from: Option<u32>,
    report: Report,
    max_events: u64,
    /// Stamps (`Ledger::stamp`) of the last verified pool-manager and durable
    /// ledgers: a ledger no event changed is not verified again (0 is never
    /// a stamp).
    verified_stamps: [u64; 2],
}

impl World {
    pub fn new(seed: u64, scale: Scale, trace: bool) -> Result<Self, Failure> {
        let mut rng = SimRng::new(seed);
        let params = Params::draw(&mut rng, scale, seed);
        let mut ctx = Ctx::new(rng, params.clients, params.client_link, params.pool_link);
        ctx.trace = trace;
        let fail = |what: String| Failure {
            seed,
            event: 0,
            at_ns: 0,
            what,
        };
        let pool = PoolNode::new(
            &mut ctx,
            params.pool_blocks,
            params.commit_delay_max_ns,
            params.sync_stall_p,
            params.checkpoint_every_records,
        )
        .map_err(fail)?;
        let clients: Vec<Client> = (0..params.clients)
            .map(|i| Client::new(i, format!("c{i}"), Role::Worker))
            .collect();
        let n = clients.len() + 1;
        let mut world = Self {
            seed,
            ctx,
            clients,
            dirn: DirNode {
                incarnation: 0,
                state: DirState::Down,
                dir: None,
                conns: BTreeMap::new(),
                deferred: BTreeMap::new(),
                handles: BTreeMap::new(),
                pool_out: BTreeMap::new(),
                attached_to: None,
                pool_conn: 1,
                attach: None,
                next_pool_id: 1,
                allocs_resolved: BTreeMap::new(),
            },
            pool,
            oracle: Oracle {
                lives: vec![None; n],
                notices: vec![BTreeMap::new(); n],
                ..Oracle::default()
            },
            phase: Phase::Run,
            next_conn: 1,
            next_pool_conn: 2,
            conn_incarnation: BTreeMap::new(),
            reply_from: None,
            verified_stamps: [0; 2],
            report: Report {
                seed,
                clients: params.clients,
                ..Report::default()
            },
            max_events: match scale {
                Scale::Short => 400_000,
                Scale::Long => 4_000_000,
            },
            params,
        };
        world.directory_start().map_err(fail)?;
        world.schedule_faults();
        Ok(world)
    }

    fn schedule_faults(&mut self) {
        let run = self.params.run_ns;
        let ctx = &mut self.ctx;
        ctx.at(run, Event::Heal);
        ctx.at(TICK_NS, Event::DirectoryTick);
        ctx.at(TICK_NS / 2, Event::PoolTick);
        for c in 0..self.params.clients {
            let t = ctx.rng.range(0, 20 * MS);
            ctx.at(t, Event::ClientWake(c));
        }
        for _ in 0..self.params.directory_restarts {
            let t = ctx.rng.range(run / 10, run * 9 / 10);
            ctx.at(t, Event::DirectoryCrash);
        }
        for _ in 0..self.params.pool_restarts {
            let t = ctx.rng.range(run / 10, run * 9 / 10);
            ctx.at(t, Event::PoolCrash);
        }
        let first = |ctx: &mut Ctx, every: u64, ev: Event| {
            if every > 0 {
                let t = ctx.rng.range(every / 2, every * 3 / 2);
                ctx.at(t, ev);
            }
        };
        let p = &self.params;
        first(ctx, p.client_crash_every_ns, Event::ClientCrash);
        first(ctx, p.client_partition_every_ns, Event::PartitionClient);
        first(ctx, p.pool_partition_every_ns, Event::PartitionPoolLink);
        first(ctx, p.admin_end_session_every_ns, Event::AdminEndSession);
        first(ctx, p.pool_link_break_every_ns, Event::BreakPoolLink);
    }

    fn again(&mut self, every: u64, ev: Event) {
        if every > 0 && self.phase == Phase::Run {
            let t = self.ctx.rng.range(every / 2, every * 3 / 2);
            self.ctx.after(t, ev);
        }
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.ctx.trace {
            println!(
                "{:>11.6}s #{:<7} {}",
                self.ctx.now as f64 / 1e9,
                self.report.events,
                what()
            );
        }
    }

    /// Runs the seed to the end.
    pub fn run(mut self) -> Result<Report, Failure> {
        while self.phase != Phase::Done {
            let Some(event) = self.ctx.pop() else {
                return Err(self.failure(String::from("the event queue ran dry")));
            };
            self.report.events += 1;
            if self.report.events > self.max_events {
                return Err(self.failure(format!(
                    "more than {} events: a livelock, or a run far too busy",
                    self.max_events
                )));
            }
            self.report.trajectory = self
                .report
                .trajectory
                .rotate_left(5)
                .wrapping_add(self.ctx.now ^ self.report.events);
            if self.ctx.trace {
                let e = format!("{event:?}");
                self.trace(|| e);
            }
            let r = self
                .step(event)
                .and_then(|()| self.observe())
                .and_then(|()| self.check());
            if let Err(what) = r {
                return Err(self.failure(what));
            }
        }
        self.harvest_eviction_counters();
        self.report.simulated_ns = self.ctx.now;
        self.report.net = self.ctx.net;
        self.report.pool = self.pool.counters;
        for c in &self.clients {
            let a = &mut self.report.client;
            let b = c.counters;
            a.requests += b.requests;
            a.retries += b.retries;
            a.reconnects += b.reconnects;
            a.notices_applied += b.notices_applied;
            a.stale_notices += b.stale_notices;
            a.reregistered += b.reregistered;
            a.replies_evicted += b.replies_evicted;
        }
        Ok(self.report)
    }

    /// Adds the eviction counters of the directory incarnation about to
    /// end (or of the last one) to the report.
    fn harvest_eviction_counters(&mut self) {
        if let Some(dir) = self.dirn.dir.as_mut() {
            let e = dir.stats(Time::from_nanos(self.ctx.now)).evictions;
            let r = &mut self.report.rare;
            r.evicted_orphan += e.orphan_keys;
            r.evicted_lru += e.lru_keys;
            r.lru_skipped += e.lru_skipped;
        }
    }

    fn failure(&self, what: String) -> Failure {
        Failure {
            seed: self.seed,
            event: self.report.events,
            at_ns: self.ctx.now,
            what,
        }
    }

    // --- events -------------------------------------------------------------

    fn step(&mut self, event: Event) -> Result<(), String> {
        match event {
            Event::Deliver(msg) => self.deliver(msg),
            Event::ClientWake(c) => {
                self.client_wake(c);
                Ok(())
            }
            Event::ClientCrash => {
                self.client_crash();
                Ok(())
            }
            Event::ClientRestart(c) => {
                if self.phase != Phase::Done && !self.clients[c].alive {
                    self.clients[c].restart(self.ctx.now);
                    if matches!(self.phase, Phase::Heal { .. }) {
                        self.clients[c].quiet = true;
                    }
                }
                Ok(())
            }
            Event::ConnReset { client, conn } => {
                if self.clients[client].conn_id() == Some(conn) {
                    self.clients[client].drop_conn(&mut self.ctx);
                }
                Ok(())
            }
            Event::ConnClosedAtDirectory { incarnation, conn } => {
                self.conn_closed_at_directory(incarnation, conn);
                Ok(())
            }
            Event::DirectoryTick => self.directory_tick(),
            Event::DirectoryCrash => {
                self.directory_crash();
                Ok(())
            }
            Event::DirectoryStart => self.directory_start(),
            Event::PoolLinkReset {
                directory_incarnation,
            } => {
                if directory_incarnation == self.dirn.incarnation {
                    self.pool_reconnect();
                }
                Ok(())
            }
            Event::PoolTick => {
                self.pool.tick(&mut self.ctx);
                if self.pool.crash_due() {
                    self.pool_crash_now();
                }
                self.ctx.after(TICK_NS, Event::PoolTick);
                Ok(())
            }
            Event::PoolCommit { incarnation } => {
                if incarnation == self.pool.incarnation {
                    self.pool.commit(&mut self.ctx);
                }
                Ok(())
            }
            Event::PoolCrash => {
                self.pool_crash();
                Ok(())
            }
            Event::PoolStart => {
                self.pool.start(&mut self.ctx)?;
                Ok(())
            }
            Event::PoolCallerGone { caller } => {
                self.pool.caller_gone(&self.ctx, &caller);
                Ok(())
            }
            Event::BreakPoolLink => {
                if self.phase == Phase::Run {
                    if self.dirn.state != DirState::Down {
                        self.report.pool_link_breaks += 1;
                        self.trace(|| format!("pool connection {} breaks", self.dirn.pool_conn));
                        self.pool_reconnect();
                    }
                    self.again(self.params.pool_link_break_every_ns, Event::BreakPoolLink);
                }
                Ok(())
            }
            Event::PartitionClient => {
                if self.phase == Phase::Run {
                    let c = self.ctx.rng.index(self.params.clients);
                    let d = self
                        .ctx
                        .rng
                        .range(20 * MS, self.params.client_partition_max_ns);
                    self.ctx.client_partitioned_until[c] = self.ctx.now + d;
                    self.report.partitions += 1;
                    self.again(
                        self.params.client_partition_every_ns,
                        Event::PartitionClient,
                    );
                }
                Ok(())
            }
            Event::PartitionPoolLink => {
                if self.phase == Phase::Run {
                    let d = self.ctx.rng.range(10 * MS, SEC);
                    self.ctx.pool_partitioned_until = self.ctx.now + d;
                    self.report.partitions += 1;
                    self.again(
                        self.params.pool_partition_every_ns,
                        Event::PartitionPoolLink,
                    );
                }
                Ok(())
            }
            Event::AdminEndSession => {
                self.admin_end_session()?;
                self.again(
                    self.params.admin_end_session_every_ns,
                    Event::AdminEndSession,
                );
                Ok(())
            }
            Event::Heal => {
                self.heal();
                Ok(())
            }
        }
    }

    fn heal(&mut self) {
        if self.pool.crash_armed() {
            self.pool_crash_now();
        }
        let calm = LinkFaults {
            drop_p: 0.0,
            dup_p: 0.0,
            slow_p: 0.0,
            ..self.params.client_link
        };
        self.ctx.client_link = calm;
        self.ctx.pool_link = LinkFaults {
            drop_p: 0.0,
            dup_p: 0.0,
            slow_p: 0.0,
            ..self.params.pool_link
        };
        for until in &mut self.ctx.client_partitioned_until {
            *until = 0;
        }
        self.ctx.pool_partitioned_until = 0;
        for c in &mut self.clients {
            c.quiet = true;
        }
        self.phase = Phase::Heal {
            since: self.ctx.now,
        };
    }

    fn client_wake(&mut self, c: usize) {
        if self.clients[c].wants_connection(self.ctx.now) {
            let conn = self.next_conn;
            self.next_conn += 1;
            self.conn_incarnation.insert(conn, self.dirn.incarnation);
            if self.dirn.state == DirState::Up {
                self.dirn.conns.insert(
                    conn,
                    DirConn {
                        client: c,
                        process: self.clients[c].process,
                        session: None,
                    },
                );
            } else {
                let d = self.ctx.notify_delay();
                self.ctx.after(d, Event::ConnReset { client: c, conn });
            }
            self.clients[c].connected(&mut self.ctx, conn);
        }
        let next = if self.clients[c].alive {
            self.clients[c].wake(&mut self.ctx, &self.params)
        } else {
            self.ctx.now + 100 * MS
        };
        self.ctx.at(next, Event::ClientWake(c));
    }

    fn client_crash(&mut self) {
        if self.phase != Phase::Run {
            return;
        }
        let c = self.ctx.rng.index(self.params.clients);
        if self.clients[c].alive {
            self.report.client_crashes += 1;
            if let Some(conn) = self.clients[c].conn_id()
                && self.ctx.rng.chance(0.85)
            {
                let d = self.ctx.notify_delay();
                let incarnation = self.dirn.incarnation;
                self.ctx
                    .after(d, Event::ConnClosedAtDirectory { incarnation, conn });
            }
            self.clients[c].crash();
            let d = self.ctx.rng.range(20 * MS, 3 * SEC);
            self.ctx.after(d, Event::ClientRestart(c));
        }
        self.again(self.params.client_crash_every_ns, Event::ClientCrash);
    }

    fn conn_closed_at_directory(&mut self, incarnation: u32, conn: ConnId) {
        if incarnation != self.dirn.incarnation {
            return;
        }
        let Some(dc) = self.dirn.conns.remove(&conn) else {
            return;
        };
        // Its deferred region requests stay listed: the directory still
        // completes them (and caches a grant, which a retry on the next
        // connection gets, or `ReplyEvicted`), so the oracle must record
        // the grant; the reply itself goes nowhere.
        if let (Some(session), Some(dir)) = (dc.session, self.dirn.dir.as_mut()) {
            dir.session_closed(session, Time::from_nanos(self.ctx.now));
            self.oracle.end_session(session, self.ctx.now);
        }
    }

    fn admin_end_session(&mut self) -> Result<(), String> {
        let sessions: Vec<SessionId> = self.dirn.conns.values().filter_map(|c| c.session).collect();
        if sessions.is_empty() || self.dirn.state != DirState::Up {
            return Ok(());
        }
        let s = sessions[self.ctx.rng.index(sessions.len())];
        let now = Time::from_nanos(self.ctx.now);
        if let Some(dir) = self.dirn.dir.as_mut() {
            let _ = dir.end_session(s, now);
        }
        self.directory_effects()
    }

    // --- the directory's process -------------------------------------------

    fn directory_crash(&mut self) {
        if self.dirn.state == DirState::Down || self.phase != Phase::Run {
            return;
        }
        self.report.directory_restarts += 1;
        let old = self.dirn.incarnation;
        self.trace(|| format!("directory incarnation {old} dies"));
        self.harvest_eviction_counters();
        let conns = std::mem::take(&mut self.dirn.conns);
        for (conn, dc) in conns {
            let d = self.ctx.notify_delay();
            self.ctx.after(
                d,
                Event::ConnReset {
                    client: dc.client,
                    conn,
                },
            );
        }
        let old_pool_conn = self.dirn.pool_conn;
        self.dirn = DirNode {
            incarnation: old + 1,
            state: DirState::Down,
            dir: None,
            conns: BTreeMap::new(),
            deferred: BTreeMap::new(),
            handles: BTreeMap::new(),
            pool_out: BTreeMap::new(),
            attached_to: None,
            pool_conn: self.next_pool_conn,
            attach: None,
            next_pool_id: 1,
            allocs_resolved: BTreeMap::new(),
        };
        let sessions: Vec<SessionId> = self.oracle.sessions.keys().copied().collect();
        for s in sessions {
            self.oracle.end_session(s, self.ctx.now);
        }
        let down = self.ctx.rng.range(10 * MS, 1_500 * MS);
        self.ctx.after(down, Event::DirectoryStart);
        self.next_pool_conn += 1;
        // Over TCP the pool manager sees the connection close; on the local
        // socket its liveness probe finds the process gone, later.
        let (caller, after) = if self.params.pool_over_tcp {
            (
                pool_caller(true, old, old_pool_conn),
                self.ctx.notify_delay(),
            )
        } else {
            (directory_process(old), self.ctx.rng.range(MS, 500 * MS))
        };
        self.ctx.after(after, Event::PoolCallerGone { caller });
    }

    /// The directory's connection to the pool manager is gone: its next
    /// request goes on a new one, which attaches first. Over TCP the pool
    /// manager sees the old one close, which ends its caller there.
    fn pool_reconnect(&mut self) {
        let old = self.dirn.pool_conn;
        self.dirn.pool_conn = self.next_pool_conn;
        self.next_pool_conn += 1;
        self.dirn.attached_to = None;
        self.dirn.attach = None;
        if self.params.pool_over_tcp {
            let d = self.ctx.notify_delay();
            self.ctx.after(
                d,
                Event::PoolCallerGone {
                    caller: pool_caller(true, self.dirn.incarnation, old),
                },
            );
        }
    }

    fn directory_start(&mut self) -> Result<(), String> {
        if self.dirn.state != DirState::Down {
            return Ok(());
        }
        let rejoin = self.dirn.next_pool_id;
        self.dirn.next_pool_id += 1;
        self.dirn.state = DirState::Starting {
            rejoin,
            sent_ns: self.ctx.now,
        };
        self.send_pool(rejoin, PoolRequest::Rejoin);
        Ok(())
    }

    /// Sends on the directory's connection to the pool manager: the one it
    /// is attached through, or else a new one to the process now serving.
    fn send_pool(&mut self, id: u64, request: PoolRequest) {
        let msg = Message::ToPool {
            directory_incarnation: self.dirn.incarnation,
            pool_incarnation: self.dirn.attached_to.unwrap_or(self.pool.incarnation),
            pool_conn: self.dirn.pool_conn,
            id,
            request,
        };
        self.ctx.send_pool_link(msg);
    }

    fn directory_tick(&mut self) -> Result<(), String> {
        self.ctx.after(TICK_NS, Event::DirectoryTick);
        let now_ns = self.ctx.now;
        match self.dirn.state {
            DirState::Down => {}
            DirState::Starting { rejoin, sent_ns } => {
                if now_ns >= sent_ns + POOL_RETRY_NS {
                    self.dirn.state = DirState::Starting {
                        rejoin,
                        sent_ns: now_ns,
                    };
                    self.send_pool(rejoin, PoolRequest::Rejoin);
                }
            }
            DirState::Up => {
                if let Some(dir) = self.dirn.dir.as_mut() {
                    dir.tick(Time::from_nanos(now_ns));
                }
                self.directory_effects()?;
                self.expire_by_oracle()?;
                self.check_lives()?;
                self.pool_retries();
            }
        }
        self.advance_phase()
    }

    fn pool_retries(&mut self) {
        let now_ns = self.ctx.now;
        if self.dirn.attached_to.is_none() {
            let due = self
                .dirn
                .attach
                .is_none_or(|(_, sent)| now_ns >= sent + POOL_RETRY_NS);
            if due {
                let id = self.dirn.next_pool_id;
                self.dirn.next_pool_id += 1;
                self.dirn.attach = Some((id, now_ns));
                let handles = self.dirn.handles.values().copied().collect();
                self.send_pool(id, PoolRequest::Attach { handles });
            }
            return;
        }
        let due: Vec<u64> = self
            .dirn
            .pool_out
            .iter()
            .filter(|(_, o)| o.sent_ns.is_none_or(|t| now_ns >= t + POOL_RETRY_NS))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.send_pool_work(id);
        }
    }

    fn send_pool_work(&mut self, id: u64) {
        let Some(out) = self.dirn.pool_out.get_mut(&id) else {
            return;
        };
        out.sent_ns = Some(self.ctx.now);
        let seq = out.seq;
        let request = match &out.work {
            PoolWork::Alloc {
                instance,
                len_bytes,
                ..
            } => PoolRequest::Alloc {
                instance: *instance,
                len_bytes: *len_bytes,
                seq,
            },
            PoolWork::Free { handle } => PoolRequest::Free {
                handle: *handle,
                seq,
            },
        };
        self.send_pool(id, request);
    }

    fn queue_pool_work(&mut self, work: PoolWork) {
        let id = self.dirn.next_pool_id;
        self.dirn.next_pool_id += 1;
        // Unique among the directory's requests across its restarts (ids
        // restart at 1), and rising, as the service's reply cache wants.
        let seq = u64::from(self.dirn.incarnation + 1) << 40 | id;
        self.dirn.pool_out.insert(
            id,
            PoolOut {
                work,
                seq,
                sent_ns: None,
            },
        );
        if self.dirn.attached_to.is_some() {
            self.send_pool_work(id);
        }
    }

    fn instance_number(&self, id: &InstanceId) -> Result<u64, String> {
        self.clients
            .iter()
            .position(|c| c.name == id.as_str())
            .map(|i| i as u64 + 1)
            .ok_or_else(|| format!("unknown instance name {id}"))
    }

    /// Carries out the directory's effects.
    fn directory_effects(&mut self) -> Result<(), String> {
        let Some(dir) = self.dirn.dir.as_mut() else {
            return Ok(());
        };
        let effects: Vec<Effect> = dir.drain_effects().collect();
        for e in effects {
            match e {
                Effect::AllocateRegion {
                    request,
                    owner,
                    len_bytes,
                    ..
                } => {
                    let instance = self.instance_number(&owner)?;
                    self.queue_pool_work(PoolWork::Alloc {
                        request,
                        instance,
                        len_bytes,
                    });
                }
                Effect::FreeRegion { handle, owner } => {
                    let instance = self.instance_number(&owner)?;
                    self.dirn.handles.remove(&handle.region);
                    self.queue_pool_work(PoolWork::Free {
                        handle: pool_handle(&handle, instance),
                    });
                }
                Effect::SessionEnded { session, reason } => {
                    if reason == SessionEndReason::LeaseExpired {
                        // Only when the oracle's clock says the lease ran
                        // out (the tick then checks that none outlives it).
                        let seen = self.oracle.last_seen.get(&session).copied();
                        if seen.is_none_or(|t| self.ctx.now - t < SESSION_LEASE_NS) {
                            return Err(format!(
                                "session {session} expired by lease; the oracle last heard from it at {seen:?} (now {})",
                                self.ctx.now
                            ));
                        }
                        self.report.rare.sessions_expired += 1;
                    }
                    self.oracle.end_session(session, self.ctx.now);
                    if reason == SessionEndReason::LeaseExpired {
                        let conn = self
                            .dirn
                            .conns
                            .iter()
                            .find(|(_, c)| c.session == Some(session))
                            .map(|(id, c)| (*id, c.client));
                        if let Some((conn, client)) = conn {
                            self.dirn.conns.remove(&conn);
                            let d = self.ctx.notify_delay();
                            self.ctx.after(d, Event::ConnReset { client, conn });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    // --- messages ------------------------------------------------------------

    fn deliver(&mut self, msg: Message) -> Result<(), String> {
        match msg {
            Message::ToDirectory {
                conn,
                req_id,
                request,
            } => {
                if self.dirn.state != DirState::Up || !self.dirn.conns.contains_key(&conn) {
                    return Ok(());
                }
                let client = self.dirn.conns[&conn].client;
                if let Some(reply) = self.directory_call(conn, req_id, request)? {
                    self.ctx.send_client_link(
                        client,
                        Message::ToClient {
                            client,
                            conn,
                            req_id,
                            reply,
                        },
                    );
                }
                self.directory_effects()
            }
            Message::ToClient {
                client,
                conn,
                req_id,
                reply,
            } => {
                self.reply_from = self.conn_incarnation.get(&conn).copied();
                let c = &mut self.clients[client];
                c.on_reply(&mut self.ctx, &self.params, conn, req_id, reply);
                Ok(())
            }
            Message::ToPool {
                directory_incarnation,
                pool_incarnation,
                pool_conn,
                id,
                request,
            } => {
                if pool_incarnation != self.pool.incarnation
                    || directory_incarnation != self.dirn.incarnation
                    || pool_conn != self.dirn.pool_conn
                {
                    // Its connection closed when one of its ends died, or
                    // the directory left it. (A dead directory's attach
                    // must not bind its caller after the pool manager's
                    // probe found the process gone.)
                    return Ok(());
                }
                let caller =
                    pool_caller(self.params.pool_over_tcp, directory_incarnation, pool_conn);
                self.pool.handle(
                    &mut self.ctx,
                    caller,
                    directory_incarnation,
                    pool_conn,
                    id,
                    request,
                )?;
                if self.pool.crash_due() {
                    self.pool_crash_now();
                }
                Ok(())
            }
            Message::FromPool {
                pool_incarnation,
                directory_incarnation,
                pool_conn,
                id,
                reply,
            } => {
                if directory_incarnation != self.dirn.incarnation
                    || self.dirn.state == DirState::Down
                    || pool_conn != self.dirn.pool_conn
                {
                    return Ok(());
                }
                self.pool_reply(pool_incarnation, id, reply)
            }
        }
    }

    fn pool_reply(&mut self, pool_inc: u32, id: u64, reply: PoolReply) -> Result<(), String> {
        // A reply from a process that has died since ends with its
        // connection: a stream delivers the reply, then the close. The reset
        // event may overtake the reply here, so the close is applied now.
        let link_open = pool_inc == self.pool.incarnation;
        if let DirState::Starting { rejoin, .. } = self.dirn.state {
            if id != rejoin {
                return Ok(());
            }
            let Ok(PoolReplyBody::Rejoined(handles)) = &reply.result else {
                return Ok(());
            };
            let handles = handles.clone();
            let mut regions = Vec::new();
            for h in &handles {
                let owner = self
                    .clients
                    .get((h.owner.instance.0 as usize).wrapping_sub(1))
                    .map(|c| c.name.clone())
                    .ok_or_else(|| format!("region {} of unknown instance", h.region))?;
                regions.push(RecoveredRegion {
                    handle: dir_handle(h),
                    owner: InstanceId::new(&owner).map_err(|e| e.to_string())?,
                });
                self.dirn.handles.insert(h.region, *h);
            }
            let mut seed = [0u8; 32];
            seed[..8].copy_from_slice(&self.seed.to_le_bytes());
            seed[8..12].copy_from_slice(&self.dirn.incarnation.to_le_bytes());
            let dir = Directory::recover(
                self.params.directory.clone(),
                seed,
                Time::from_nanos(self.ctx.now),
                regions,
            )
            .map_err(|e| format!("directory configuration: {e}"))?;
            self.trace(|| {
                format!(
                    "directory incarnation {} up, {} regions recovered",
                    self.dirn.incarnation,
                    handles.len()
                )
            });
            self.dirn.dir = Some(dir);
            self.dirn.state = DirState::Up;
            self.dirn.attached_to = link_open.then_some(pool_inc);
            self.usage(&reply);
            // Each owner of a region the pool manager listed becomes an
            // instance awaiting its reattach (a life of its own unless its
            // live one carries on); every other life is over.
            let owners: BTreeSet<usize> = handles
                .iter()
                .map(|h| h.owner.instance.0 as usize - 1)
                .collect();
            let now = self.ctx.now;
            for c in 0..self.oracle.lives.len() {
                let live = self.oracle.lives[c].is_some_and(|l| !l.ended);
                if owners.contains(&c) {
                    if !live {
                        self.oracle.new_life(c, u32::MAX);
                    }
                    if let Some(l) = self.oracle.lives[c].as_mut() {
                        l.absent_since = Some(now);
                    }
                } else if let Some(l) = self.oracle.lives[c].as_mut() {
                    l.ended = true;
                }
            }
            return self.check_lives();
        }
        if self.dirn.attach.is_some_and(|(a, _)| a == id) {
            if !link_open {
                // Sent again, on a new connection, when its retry is due.
                return Ok(());
            }
            self.usage(&reply);
            match reply.result {
                Ok(PoolReplyBody::Attached(report)) => {
                    for (v, h) in report.verdicts.iter().zip(self.dirn.handles.values()) {
                        if let Err(e) = v {
                            return Err(format!(
                                "the pool manager refused region {} the directory holds: {e}",
                                h.region
                            ));
                        }
                    }
                    self.dirn.attach = None;
                    self.dirn.attached_to = Some(pool_inc);
                    let ids: Vec<u64> = self.dirn.pool_out.keys().copied().collect();
                    for id in ids {
                        self.send_pool_work(id);
                    }
                }
                Ok(other) => return Err(format!("attach answered {other:?}")),
                Err(_) => {}
            }
            return Ok(());
        }
        if self.dirn.attached_to != Some(pool_inc) {
            // An answer on a connection the directory has left: a copy of
            // the request was (or will be) resent on the new one.
            return Ok(());
        }
        self.usage(&reply);
        let Some(out) = self.dirn.pool_out.get(&id) else {
            // A late copy's answer to a request already resolved. Exactly
            // once: an allocation it reports must be the one the request was
            // resolved with, else nothing will ever free it (a leak).
            if let Ok(PoolReplyBody::Allocated(h)) = reply.result {
                let first = self.dirn.allocs_resolved.get(&id).copied().flatten();
                if first != Some(h.region) {
                    return Err(format!(
                        "a late copy of pool request {id} allocated region {}; the request was resolved with {first:?}",
                        h.region
                    ));
                }
            }
            return Ok(());
        };
        match (&out.work, reply.result) {
            (_, Err(PoolError::NotAttached { .. })) => {
                self.dirn.attached_to = None;
            }
            (PoolWork::Alloc { request, .. }, Ok(PoolReplyBody::Allocated(h))) => {
                let request = *request;
                self.dirn.pool_out.remove(&id);
                self.dirn.allocs_resolved.insert(id, Some(h.region));
                self.dirn.handles.insert(h.region, h);
                let completions = match self.dirn.dir.as_mut() {
                    Some(dir) => dir.region_allocated(request, Ok(dir_handle(&h))),
                    None => Vec::new(),
                };
                self.complete_regions(completions)?;
                self.directory_effects()?;
            }
            (PoolWork::Alloc { request, .. }, Err(e)) => {
                if matches!(e, PoolError::TagReused { .. }) {
                    return Err(format!("allocation tag reused: {e}"));
                }
                let request = *request;
                self.dirn.pool_out.remove(&id);
                self.dirn.allocs_resolved.insert(id, None);
                let completions = match self.dirn.dir.as_mut() {
                    Some(dir) => dir.region_allocated(request, Err(e.to_string())),
                    None => Vec::new(),
                };
                self.complete_regions(completions)?;
                self.directory_effects()?;
            }
            (PoolWork::Free { .. }, Ok(PoolReplyBody::Freed))
            | (PoolWork::Free { .. }, Err(PoolError::RegionAlreadyFreed { .. })) => {
                self.dirn.pool_out.remove(&id);
            }
            (work, r) => return Err(format!("pool manager answered {r:?} to {work:?}")),
        }
        Ok(())
    }

    fn usage(&mut self, reply: &PoolReply) {
        if let Some(dir) = self.dirn.dir.as_mut() {
            dir.pool_usage(self.pool.pool, reply.capacity_bytes, reply.free_bytes);
        }
    }

    fn complete_regions(&mut self, completions: Vec<Completion>) -> Result<(), String> {
        for c in completions {
            let Some(to) = self.dirn.deferred.remove(&c.deferred) else {
                continue;
            };
            let reply = match c.result {
                Ok(reply) => {
                    let key = (to.client, to.life, self.dirn.incarnation, to.seq);
                    self.oracle.record(key, RecordedBody::Grant(reply.body))?;
                    self.report.retries_compared += 1;
                    ClientReply::Region(reply)
                }
                Err(e) => {
                    if matches!(e, DirectoryError::QuotaExceeded { .. }) {
                        self.report.rare.quota_refusals += 1;
                    }
                    ClientReply::Error(e)
                }
            };
            if self.dirn.conns.contains_key(&to.conn) {
                self.ctx.send_client_link(
                    to.client,
                    Message::ToClient {
                        client: to.client,
                        conn: to.conn,
                        req_id: to.req_id,
                        reply,
                    },
                );
            }
        }
        Ok(())
    }

    /// One client request through the directory, with the oracle's
    /// bookkeeping. `None`: deferred (a region request).
    fn directory_call(
        &mut self,
        conn: ConnId,
        req_id: u64,
        request: ClientRequest,
    ) -> Result<Option<ClientReply>, String> {
        let now = Time::from_nanos(self.ctx.now);
        let dc = self.dirn.conns[&conn].clone();
        let c = dc.client;
        let name = self.clients[c].name.clone();
        let peer = Peer::Unix {
            pid: 100 + 1000 * c as u32 + dc.process,
            uid: 1000,
            gid: 1000,
        };
        let incarnation = self.dirn.incarnation;
        let dir = self
            .dirn
            .dir
            .as_mut()
            .expect("an up directory has a state machine");
        let handshake = matches!(
            request,
            ClientRequest::Hello | ClientRequest::Reattach { .. }
        );
        if handshake && dc.session.is_some() {
            return Ok(Some(ClientReply::AlreadyAttached));
        }
        let Some(session) = dc.session.or(handshake.then_some(SessionId(0))) else {
            return Ok(Some(ClientReply::Error(DirectoryError::UnknownSession {
                session: SessionId(0),
            })));
        };
        let life = self.oracle.sessions.get(&session).map_or(0, |s| s.1);
        if !handshake && let Some(t) = self.oracle.last_seen.get_mut(&session) {
            // Every request renews the lease before anything else.
            *t = self.ctx.now;
        }
        let caller = |ack: u64| Caller {
            session,
            notice_ack: ack,
        };
        let reply = match request {
            ClientRequest::Hello => {
                match dir.hello(
                    Hello {
                        instance: &name,
                        quota_bytes: None,
                    },
                    peer,
                    now,
                ) {
                    Ok(w) => {
                        self.dirn.conns.get_mut(&conn).expect("listed").session = Some(w.session);
                        let process = self.clients[c].process;
                        let life = self.oracle.new_life(c, process);
                        self.oracle.open_session(w.session, c, life, self.ctx.now);
                        ClientReply::Welcome(w)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Reattach {
                secret,
                regions,
                next_seq,
                notice_ack,
            } => {
                let req = Reattach {
                    instance: &name,
                    secret,
                    regions: &regions,
                    next_seq,
                    notice_ack,
                    quota_bytes: None,
                };
                match dir.reattach(req, peer, now) {
                    Ok(r) => {
                        self.dirn.conns.get_mut(&conn).expect("listed").session = Some(r.session);
                        let process = self.clients[c].process;
                        let life = match (r.kind, self.oracle.lives[c]) {
                            (ReattachKind::Resumed, Some(l)) if !l.ended => l.id,
                            (ReattachKind::Resumed, l) => {
                                return Err(format!(
                                    "client {name} resumed an instance the oracle holds gone ({l:?})"
                                ));
                            }
                            (ReattachKind::Recovered, Some(l))
                                if !l.ended && l.process == process =>
                            {
                                l.id
                            }
                            (ReattachKind::Recovered, _) => self.oracle.new_life(c, process),
                        };
                        self.oracle.open_session(r.session, c, life, self.ctx.now);
                        ClientReply::Reattached(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Heartbeat { ack } => match dir.heartbeat(&caller(ack), now) {
                Ok(r) => ClientReply::Heartbeat(r),
                Err(e) => ClientReply::Error(e),
            },
            ClientRequest::Register {
                ack,
                seq,
                layout,
                entries,
            } => {
                let lix = layout_index(&layout);
                let r = dir.register(
                    &caller(ack),
                    seq,
                    layout,
                    entries.iter().map(|(key, location)| RegisterEntry {
                        key,
                        location: *location,
                    }),
                    now,
                );
                match r {
                    Ok(r) => {
                        let key = (c, life, incarnation, seq.seq);
                        self.report.retries_compared += 1;
                        if self
                            .oracle
                            .record(key, RecordedBody::Register(r.body.clone()))?
                        {
                            for ((k, loc), o) in entries.iter().zip(&r.body) {
                                if *o == RegisterOutcome::Inserted {
                                    self.report.keys_registered += 1;
                                    self.oracle.keys.insert(
                                        (lix, k.clone()),
                                        OracleKey {
                                            location: *loc,
                                            owner: c,
                                            life,
                                            incarnation,
                                        },
                                    );
                                }
                            }
                        }
                        ClientReply::Register(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Lookup {
                ack,
                seq,
                layout,
                keys,
                pins,
            } => {
                let lix = layout_index(&layout);
                let r = dir.lookup(
                    &caller(ack),
                    seq,
                    layout,
                    keys.iter().map(|k| k.as_slice()),
                    pins,
                    now,
                );
                match r {
                    Ok(r) => {
                        let mut fresh = true;
                        if pins > 0 {
                            let seq = seq.expect("pinning lookups carry a seq").seq;
                            self.report.retries_compared += 1;
                            fresh = self.oracle.record(
                                (c, life, incarnation, seq),
                                RecordedBody::Lookup(r.body.clone()),
                            )?;
                            if fresh {
                                for (k, loc) in keys.iter().zip(&r.body.locations) {
                                    if loc.is_some() {
                                        *self
                                            .oracle
                                            .pins
                                            .entry((session, lix, k.clone()))
                                            .or_default() += pins;
                                    }
                                }
                            }
                        }
                        if fresh {
                            // (A retry's answer is the first one's, checked
                            // when it ran.)
                            self.check_lookup(lix, &keys, &r.body)?;
                        }
                        ClientReply::Lookup(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Exists { ack, layout, keys } => {
                let lix = layout_index(&layout);
                match dir.exists(&caller(ack), layout, keys.iter().map(|k| k.as_slice()), now) {
                    Ok(r) => {
                        self.check_exists(lix, &keys, &r.body)?;
                        ClientReply::Exists(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Unpin {
                ack,
                seq,
                layout,
                entries,
            } => {
                let lix = layout_index(&layout);
                let r = dir.unpin(
                    &caller(ack),
                    seq,
                    layout,
                    entries
                        .iter()
                        .map(|(key, count)| UnpinEntry { key, count: *count }),
                    now,
                );
                match r {
                    Ok(r) => {
                        self.report.retries_compared += 1;
                        let fresh = self.oracle.record(
                            (c, life, incarnation, seq.seq),
                            RecordedBody::Unpin(r.body.clone()),
                        )?;
                        if fresh {
                            for ((k, count), o) in entries.iter().zip(&r.body) {
                                if *o != UnpinOutcome::Unpinned {
                                    continue;
                                }
                                let id = (session, lix, k.clone());
                                let held = self.oracle.pins.get_mut(&id).ok_or_else(|| {
                                    format!("unpin released pins on {k:?} that session {session} never took")
                                })?;
                                *held = held.checked_sub(*count).ok_or_else(|| {
                                    format!("unpin released more pins on {k:?} than session {session} held")
                                })?;
                                if *held == 0 {
                                    self.oracle.pins.remove(&id);
                                }
                            }
                        }
                        ClientReply::Unpin(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::Delete {
                ack,
                seq,
                layout,
                keys,
            } => {
                let lix = layout_index(&layout);
                let before: Vec<Option<(Location, Option<InstanceId>)>> = keys
                    .iter()
                    .map(|k| {
                        let info = dir.inspect_key(&layout, k)?;
                        let owner = dir.inspect_region(info.location.region)?.owner;
                        Some((info.location, owner))
                    })
                    .collect();
                let r = dir.delete(
                    &caller(ack),
                    seq,
                    layout,
                    keys.iter().map(|k| k.as_slice()),
                    now,
                );
                match r {
                    Ok(r) => {
                        self.report.retries_compared += 1;
                        let fresh = self.oracle.record(
                            (c, life, incarnation, seq.seq),
                            RecordedBody::Delete(r.body.clone()),
                        )?;
                        if fresh {
                            for ((k, o), b) in keys.iter().zip(&r.body).zip(&before) {
                                if *o != DeleteOutcome::Deleted {
                                    continue;
                                }
                                self.report.keys_deleted += 1;
                                self.oracle.keys.remove(&(lix, k.clone()));
                                let Some((loc, Some(owner))) = b else {
                                    continue;
                                };
                                self.oracle.owe_notice(
                                    &self.clients,
                                    owner.as_str(),
                                    *loc,
                                    incarnation,
                                );
                            }
                        }
                        ClientReply::Delete(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
            ClientRequest::RequestRegion {
                ack,
                seq,
                layout,
                len_bytes,
            } => match dir.request_region(&caller(ack), seq, layout, len_bytes, now) {
                Ok(Reply {
                    body: RegionReply::Granted(grant),
                    notices,
                    usage,
                }) => {
                    self.report.retries_compared += 1;
                    self.oracle
                        .record((c, life, incarnation, seq.seq), RecordedBody::Grant(grant))?;
                    ClientReply::Region(Reply {
                        body: grant,
                        notices,
                        usage,
                    })
                }
                Ok(Reply {
                    body: RegionReply::Deferred(id),
                    ..
                }) => {
                    self.dirn.deferred.insert(
                        id,
                        DeferredTo {
                            conn,
                            req_id,
                            client: c,
                            life,
                            seq: seq.seq,
                        },
                    );
                    return Ok(None);
                }
                Err(e) => ClientReply::Error(e),
            },
            ClientRequest::ReturnRegion { ack, seq, region } => {
                match dir.return_region(&caller(ack), seq, region, now) {
                    Ok(r) => {
                        self.report.retries_compared += 1;
                        self.oracle
                            .record((c, life, incarnation, seq.seq), RecordedBody::Returned)?;
                        ClientReply::Returned(r)
                    }
                    Err(e) => ClientReply::Error(e),
                }
            }
        };
        match &reply {
            ClientReply::Error(DirectoryError::ReplyEvicted { seq }) => {
                // Exactly once at the window's edge: a number whose body
                // was dropped must have run (and so been recorded).
                if !self
                    .oracle
                    .replies
                    .contains_key(&(c, life, incarnation, *seq))
                {
                    return Err(format!(
                        "client {name}'s seq {seq} answered ReplyEvicted, yet it never ran (life {life})"
                    ));
                }
                self.report.rare.replies_evicted += 1;
            }
            ClientReply::Error(DirectoryError::QuotaExceeded { .. }) => {
                self.report.rare.quota_refusals += 1;
            }
            ClientReply::Error(DirectoryError::NoticeBacklog { .. }) => {
                self.report.rare.notice_backlog_refusals += 1;
            }
            ClientReply::Reattached(r) => {
                if r.kind == ReattachKind::Recovered {
                    self.report.rare.recovered_reattaches += 1;
                }
                self.report.rare.reattach_regions_refused += r
                    .regions
                    .iter()
                    .filter(|v| **v == RegionStatus::NotOwned)
                    .count() as u64;
            }
            _ => {}
        }
        if handshake {
            self.check_lives()?;
        }
        Ok(Some(reply))
    }

    // --- reads ------------------------------------------------------------------

    /// Where the oracle holds `key` in this directory incarnation. The
    /// oracle is exact here: it changes with every call the directory
    /// answers, and a key the directory dropped on its own (eviction) has
    /// been reconciled by the check after the event that dropped it, so
    /// nothing is in flux while one request runs. (Requests in flight on
    /// the network are not yet executed; the reply is compared at the
    /// moment the directory produces it, not when the client receives it.)
    fn oracle_location(&self, lix: usize, key: &[u8]) -> Option<Location> {
        self.oracle
            .keys
            .get(&(lix, key.to_vec()))
            .filter(|k| k.incarnation == self.dirn.incarnation)
            .map(|k| k.location)
    }

    /// A lookup's answer: each key found exactly where the oracle holds it,
    /// or not found if the oracle holds none; each region a location names
    /// is described once, with the extent the pool manager committed.
    fn check_lookup(
        &mut self,
        lix: usize,
        keys: &[Vec<u8>],
        r: &LookupReply,
    ) -> Result<(), String> {
        if r.locations.len() != keys.len() {
            return Err(format!(
                "lookup answered {} locations for {} keys",
                r.locations.len(),
                keys.len()
            ));
        }
        for (k, got) in keys.iter().zip(&r.locations) {
            self.report.reads_checked += 1;
            let want = self.oracle_location(lix, k);
            if *got != want {
                return Err(format!(
                    "lookup of {k:?} answered {got:?}; the oracle holds {want:?}"
                ));
            }
            if let Some(loc) = got {
                let described = r.regions.iter().filter(|d| d.region == loc.region).count();
                if described != 1 {
                    return Err(format!(
                        "lookup names region {} and describes it {described} times",
                        loc.region
                    ));
                }
            }
        }
        for d in &r.regions {
            let named = r.locations.iter().flatten().any(|l| l.region == d.region);
            let pool = self.pool.durable.region(d.region);
            let same = pool
                .is_some_and(|p| p.offset_bytes == d.offset_bytes && p.len_bytes == d.len_bytes);
            if !named || !same || d.page_size_bytes != LAYOUTS[lix].page_size_bytes {
                return Err(format!(
                    "lookup describes region {d:?} (named by a location: {named}); the pool manager holds {pool:?}"
                ));
            }
        }
        Ok(())
    }

    /// An exists answer: true exactly for the keys the oracle holds.
    fn check_exists(&mut self, lix: usize, keys: &[Vec<u8>], found: &[bool]) -> Result<(), String> {
        if found.len() != keys.len() {
            return Err(format!(
                "exists answered {} flags for {} keys",
                found.len(),
                keys.len()
            ));
        }
        for (k, &f) in keys.iter().zip(found) {
            self.report.reads_checked += 1;
            let want = self.oracle_location(lix, k).is_some();
            if f != want {
                return Err(format!(
                    "exists of {k:?} answered {f}; the oracle holds it: {want}"
                ));
            }
        }
        Ok(())
    }

    // --- the pool manager's process -----------------------------------------

    /// A pool-manager crash: at once, or (more often) at the next moment it
    /// has records pending, so that the crash cuts an uncommitted tail.
    fn pool_crash(&mut self) {
        if !self.pool.is_up() || self.phase != Phase::Run {
            return;
        }
        if !self.pool.crash_due() && self.ctx.rng.chance(0.6) {
            self.pool.arm_crash();
            return;
        }
        self.pool_crash_now();
    }

    fn pool_crash_now(&mut self) {
        self.report.pool_restarts += 1;
        self.trace(|| format!("pool manager incarnation {} dies", self.pool.incarnation));
        self.pool.crash(&mut self.ctx);
        let down = self.ctx.rng.range(10 * MS, SEC);
        self.ctx.after(down, Event::PoolStart);
        let d = self.ctx.notify_delay();
        self.ctx.after(
            d,
            Event::PoolLinkReset {
                directory_incarnation: self.dirn.incarnation,
            },
        );
    }

    // --- the oracle -----------------------------------------------------------

    /// After a directory tick: no session outlives its lease by the
    /// oracle's clock, and a life without sessions for `INSTANCE_GRACE_NS`
    /// is over (the directory must have forgotten its instance:
    /// `check_lives`).
    fn expire_by_oracle(&mut self) -> Result<(), String> {
        let now = self.ctx.now;
        if let Some((s, t)) = self
            .oracle
            .last_seen
            .iter()
            .find(|&(_, &t)| now - t >= SESSION_LEASE_NS)
        {
            return Err(format!(
                "session {s}, last heard from at {t}, outlived its lease (now {now})"
            ));
        }
        for life in self.oracle.lives.iter_mut().flatten() {
            if !life.ended
                && life
                    .absent_since
                    .is_some_and(|t| now - t >= INSTANCE_GRACE_NS)
            {
                life.ended = true;
                self.report.rare.instances_expired += 1;
            }
        }
        Ok(())
    }

    /// The directory holds an instance for exactly the clients whose life
    /// the oracle holds live (`Life`).
    fn check_lives(&mut self) -> Result<(), String> {
        let Some(dir) = self.dirn.dir.as_mut() else {
            return Ok(());
        };
        let mut present: BTreeSet<String> = dir
            .stats(Time::from_nanos(self.ctx.now))
            .per_instance
            .iter()
            .map(|i| i.instance.as_str().to_owned())
            .collect();
        for (c, client) in self.clients.iter().enumerate() {
            let life = self.oracle.lives[c];
            let live = life.is_some_and(|l| !l.ended);
            if present.remove(&client.name) != live {
                return Err(format!(
                    "client {}: the directory {} its instance; the oracle holds its life {life:?}",
                    client.name,
                    if live { "has forgotten" } else { "still holds" },
                ));
            }
        }
        if let Some(name) = present.first() {
            return Err(format!("the directory holds instance {name} of no client"));
        }
        Ok(())
    }

    /// Client observations: violations, notices, writes, closes.
    fn observe(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            let observations = std::mem::take(&mut self.clients[c].observations);
            for o in observations {
                match o {
                    Observation::Violation(what) => return Err(what),
                    Observation::NoticeApplied(n) => {
                        self.report.notices_checked += 1;
                        let key = (n.region, n.page.0, n.generation.0);
                        // The notice answers a deletion by the incarnation
                        // that sent the reply carrying it.
                        let from = self.reply_from;
                        let expected = self.oracle.notices[c]
                            .get_mut(&key)
                            .and_then(|d| Some((d.iter().position(|x| Some(x.1) == from)?, d)));
                        match expected {
                            Some((i, deletions)) => {
                                deletions.remove(i);
                                if deletions.is_empty() {
                                    self.oracle.notices[c].remove(&key);
                                }
                            }
                            _ => {
                                return Err(format!(
                                    "client {} got notice {n:?} for no deletion of its page",
                                    self.clients[c].name
                                ));
                            }
                        }
                    }
                    Observation::Wrote { region, page } => self.check_write(c, region, page)?,
                    Observation::Closed(conn) => {
                        let partitioned = self.ctx.client_partitioned_until
                            [c.min(self.ctx.client_partitioned_until.len() - 1)]
                            > self.ctx.now;
                        if !partitioned || self.ctx.rng.chance(0.5) {
                            let d = self.ctx.notify_delay();
                            let incarnation = self.dirn.incarnation;
                            self.ctx
                                .after(d, Event::ConnClosedAtDirectory { incarnation, conn });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// A client wrote a page: the region must be live at the pool under its
    /// label and, if the directory knows it, owned by it; no key may be
    /// registered on that page.
    fn check_write(&self, c: usize, region: RegionId, page: u32) -> Result<(), String> {
        let name = &self.clients[c].name;
        let Some(r) = self.pool.durable.region(region) else {
            return Err(format!(
                "client {name} wrote into region {region}, which the pool manager does not hold"
            ));
        };
        if r.owner.instance.0 != c as u64 + 1 {
            return Err(format!(
                "client {name} wrote into region {region} of {}",
                r.owner
            ));
        }
        if let Some(dir) = self.dirn.dir.as_ref()
            && let Some(info) = dir.inspect_region(region)
            && info.owner.as_ref().is_none_or(|o| o.as_str() != name)
        {
            return Err(format!(
                "client {name} wrote into region {region}, owned by {:?} at the directory",
                info.owner
            ));
        }
        if let Some(dir) = self.dirn.dir.as_ref() {
            for ((lix, key), k) in &self.oracle.keys {
                if k.incarnation == self.dirn.incarnation
                    && k.location.region == region
                    && k.location.page.0 == page
                    && dir
                        .inspect_key(&LAYOUTS[*lix], key)
                        .is_some_and(|i| i.location == k.location)
                {
                    return Err(format!(
                        "client {name} wrote page {page} of region {region}, where key {key:?} is registered"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every invariant, after every event.
    fn check(&mut self) -> Result<(), String> {
        self.report.checks += 1;
        if let Some(m) = self.pool.manager.as_ref() {
            if m.ledger().stamp() != self.verified_stamps[0] {
                m.ledger()
                    .verify()
                    .map_err(|e| format!("pool manager: {e}"))?;
                self.verified_stamps[0] = m.ledger().stamp();
            }
            m.check_bookkeeping()
                .map_err(|e| format!("pool manager: {e}"))?;
            let stats = m.stats();
            let p = stats.pools.first().ok_or("the pool vanished")?;
            let allocated: u64 = m.regions().map(|r| r.len_bytes).sum();
            if p.free_bytes + allocated != p.capacity_bytes {
                return Err(format!(
                    "pool: free {} + allocated {allocated} != capacity {}",
                    p.free_bytes, p.capacity_bytes
                ));
            }
        }
        if self.pool.durable.stamp() != self.verified_stamps[1] {
            self.pool
                .durable
                .verify()
                .map_err(|e| format!("durable ledger: {e}"))?;
            // Committed regions never overlap and lie inside the pool,
            // past its header block (`PoolNode::new`: the pool is the
            // header block plus `capacity_bytes`).
            let pool_end = self.pool.capacity_bytes + BLOCK_BYTES;
            let mut extents: Vec<(u64, u64, RegionId)> = self
                .pool
                .durable
                .regions()
                .map(|r| (r.offset_bytes, r.len_bytes, r.id))
                .collect();
            extents.sort_unstable();
            let mut end = BLOCK_BYTES;
            for (offset, len, id) in extents {
                let last = offset.checked_add(len).filter(|&e| e <= pool_end);
                if offset < end || last.is_none() {
                    return Err(format!(
                        "durable region {id} at {offset}+{len} overlaps the header or the previous region (ending at {end}) or leaves the pool (ending at {pool_end})"
                    ));
                }
                end = last.unwrap_or(end);
            }
            self.verified_stamps[1] = self.pool.durable.stamp();
        }
        if self.dirn.state != DirState::Up {
            return Ok(());
        }
        let dir = self.dirn.dir.as_ref().expect("up");
        dir.check_invariants().map_err(|e| e.to_string())?;
        let incarnation = self.dirn.incarnation;
        let eviction = self.params.directory.eviction.orphans;
        let lru = self.params.directory.eviction.lru;

        // Keys: the directory holds exactly the acknowledged, undeleted keys
        // of this incarnation, at their locations, with the pins the live
        // sessions took; a key may be missing only if its owner's instance
        // is gone and orphans are evicted.
        let mut present = 0u64;
        let mut per_region: BTreeMap<RegionId, u32> = BTreeMap::new();
        let mut registered: BTreeSet<(RegionId, u32)> = BTreeSet::new();
        let mut gone = Vec::new();
        // Pins the live sessions took, summed per key once (not per key
        // over every pin: this runs after every event).
        let mut pins_of: BTreeMap<(usize, &[u8]), u32> = BTreeMap::new();
        for ((_, lix, key), n) in &self.oracle.pins {
            *pins_of.entry((*lix, key.as_slice())).or_default() += *n;
        }
        for ((lix, key), k) in &self.oracle.keys {
            if k.incarnation != incarnation {
                continue;
            }
            match dir.inspect_key(&LAYOUTS[*lix], key) {
                Some(info) => {
                    present += 1;
                    if info.location != k.location {
                        return Err(format!(
                            "key {key:?} moved: acknowledged at {:?}, now {:?}",
                            k.location, info.location
                        ));
                    }
                    *per_region.entry(info.location.region).or_default() += 1;
                    registered.insert((info.location.region, info.location.page.0));
                    let pins = pins_of.get(&(*lix, key.as_slice())).copied().unwrap_or(0);
                    if info.pins != pins {
                        return Err(format!(
                            "key {key:?} holds {} pins, live sessions took {pins}",
                            info.pins
                        ));
                    }
                }
                None => {
                    // Evicted: an orphan (its owner's instance gone), or by
                    // the LRU (any owner); never a pinned key.
                    let ended =
                        self.oracle.lives[k.owner].is_some_and(|l| l.id != k.life || l.ended);
                    let pins = pins_of.get(&(*lix, key.as_slice())).copied().unwrap_or(0);
                    if !((ended && eviction) || lru) || pins > 0 {
                        return Err(format!(
                            "key {key:?} of client {} (life {}) acknowledged at {:?} is gone (owner life ended: {ended}, orphan eviction: {eviction}, LRU: {lru}, pins: {pins})",
                            self.clients[k.owner].name, k.life, k.location
                        ));
                    }
                    gone.push(((*lix, key.clone()), k.location));
                }
            }
        }
        for (k, loc) in gone {
            self.oracle.keys.remove(&k);
            // An eviction from a region whose owner is present hands the
            // page back to it: the notice is owed (as for a delete), and
            // `final_notice_check` sees that it arrives.
            let Some(owner) = dir.region_owner(loc.region) else {
                continue;
            };
            if self
                .oracle
                .owe_notice(&self.clients, owner.as_str(), loc, incarnation)
            {
                self.report.rare.lru_keys_owed_notices += 1;
            }
        }
        if self.report.checks.is_multiple_of(STATS_EVERY) {
            // The full snapshot (it counts a call, so it takes `&mut`):
            // it must agree with the totals compared below.
            let dir = self.dirn.dir.as_mut().expect("up");
            let full = dir.stats(Time::from_nanos(self.ctx.now));
            let totals = dir.totals();
            let peak = full
                .per_instance
                .iter()
                .map(|i| i.notices_pending as u64)
                .max()
                .unwrap_or(0);
            let rare = &mut self.report.rare;
            rare.notice_backlog_peak = rare.notice_backlog_peak.max(peak);
            if (full.keys, full.pins, full.regions) != (totals.keys, totals.pins, totals.regions) {
                return Err(format!(
                    "statistics report {} keys, {} pins, {} regions; totals {totals:?}",
                    full.keys, full.pins, full.regions
                ));
            }
        }
        let dir = self.dirn.dir.as_ref().expect("up");
        let stats = dir.totals();
        if stats.keys != present {
            return Err(format!(
                "the directory holds {} keys, {present} acknowledged",
                stats.keys
            ));
        }
        let pins: u64 = self.oracle.pins.values().map(|&n| u64::from(n)).sum();
        if stats.pins != pins {
            return Err(format!(
                "the directory counts {} pins, live sessions took {pins}",
                stats.pins
            ));
        }

        // Regions: each is live at the pool (committed) with the same extent
        // and owner label, and counts the keys in it.
        let mut ids: BTreeSet<RegionId> = self.dirn.handles.keys().copied().collect();
        ids.extend(self.pool.durable.regions().map(|r| r.id));
        let mut held = 0u64;
        // Regions holding an acknowledged key that the walk below found
        // at both the directory and the pool manager.
        let mut key_regions_found = BTreeSet::new();
        for id in ids {
            let Some(info) = dir.inspect_region(id) else {
                continue;
            };
            held += 1;
            if per_region.contains_key(&id) {
                key_regions_found.insert(id);
            }
            let Some(r) = self.pool.durable.region(id) else {
                return Err(format!(
                    "the directory holds region {id}, which the pool manager has not committed (or freed)"
                ));
            };
            let label = self.instance_number(&info.owner_label)?;
            if r.offset_bytes != info.descriptor.offset_bytes
                || r.len_bytes != info.descriptor.len_bytes
                || r.owner != owner_label(label)
            {
                return Err(format!(
                    "region {id}: directory {info:?}, pool manager {r:?}"
                ));
            }
            let counted = per_region.get(&id).copied().unwrap_or(0);
            if info.keys != counted {
                return Err(format!(
                    "region {id} counts {} keys, {counted} acknowledged keys are in it",
                    info.keys
                ));
            }
        }
        if key_regions_found.len() != per_region.len() {
            let lost = per_region.keys().find(|id| !key_regions_found.contains(id));
            return Err(format!(
                "a key is registered in region {lost:?}, which the directory or the pool manager does not hold"
            ));
        }
        if held != stats.regions {
            return Err(format!(
                "the directory holds {} regions, {held} found at the pool manager",
                stats.regions
            ));
        }

        // Clients: a page a live owner believes free holds no key.
        for (c, client) in self.clients.iter().enumerate() {
            if !client.alive || !client.session_ready() {
                continue;
            }
            let live = self.oracle.lives[c].is_some_and(|l| !l.ended);
            if !live {
                continue;
            }
            for (&id, r) in &client.regions {
                let owned = dir
                    .region_owner(id)
                    .is_some_and(|o| o.as_str() == client.name);
                if !owned {
                    continue;
                }
                for (p, page) in r.pages.iter().enumerate() {
                    if page.state == PageState::Free && registered.contains(&(id, p as u32)) {
                        return Err(format!(
                            "client {} believes page {p} of region {id} free; a key is registered there",
                            client.name
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    // --- phases ----------------------------------------------------------------

    fn everyone_settled(&self) -> Option<String> {
        if self.dirn.state != DirState::Up {
            return Some(String::from("directory not up"));
        }
        if !self.pool.is_up() {
            return Some(String::from("pool manager not up"));
        }
        if self.dirn.attached_to.is_none() || !self.dirn.pool_out.is_empty() {
            return Some(format!(
                "directory: attached {:?}, {} pool requests outstanding",
                self.dirn.attached_to,
                self.dirn.pool_out.len()
            ));
        }
        for c in &self.clients {
            if c.role == Role::Worker && !c.settled() {
                return Some(format!("client {} not settled", c.name));
            }
        }
        None
    }

    /// Live clients whose instance still has notices queued.
    fn notices_pending(&mut self) -> Option<String> {
        let dir = self.dirn.dir.as_mut()?;
        let stats = dir.stats(Time::from_nanos(self.ctx.now));
        for i in stats.per_instance {
            let live = self
                .clients
                .iter()
                .any(|c| c.name == i.instance.as_str() && c.alive && !c.done && c.session_ready());
            if live && i.notices_pending > 0 {
                return Some(format!(
                    "{} notices queued for {}",
                    i.notices_pending, i.instance
                ));
            }
        }
        None
    }

    /// After settling: every deletion of a live client's page in this
    /// incarnation and life reached it as a notice.
    fn final_notice_check(&self) -> Result<(), String> {
        for (c, client) in self.clients.iter().enumerate() {
            let Some(life) = self.oracle.lives[c] else {
                continue;
            };
            if !client.alive || !client.session_ready() || life.ended {
                continue;
            }
            for (key, deletions) in &self.oracle.notices[c] {
                if deletions.contains(&(life.id, self.dirn.incarnation)) {
                    return Err(format!(
                        "client {}: the notice for page {key:?} never arrived",
                        client.name
                    ));
                }
            }
        }
        Ok(())
    }

    fn advance_phase(&mut self) -> Result<(), String> {
        let now = self.ctx.now;
        match self.phase {
            Phase::Run | Phase::Done => Ok(()),
            Phase::Heal { since } => {
                match self.everyone_settled().or_else(|| self.notices_pending()) {
                    None => {
                        self.final_key_check()?;
                        self.final_notice_check()?;
                        self.trace(|| String::from("settled; clients leave, the janitor cleans"));
                        for c in &mut self.clients {
                            c.done = true;
                            c.drop_conn(&mut self.ctx);
                        }
                        let j = self.clients.len();
                        let mut janitor = Client::new(j, String::from("janitor"), Role::Janitor);
                        janitor.start_janitor(&self.params);
                        self.clients.push(janitor);
                        self.ctx.client_partitioned_until.push(0);
                        self.ctx.after(MS, Event::ClientWake(j));
                        self.phase = Phase::Clean { since: now };
                        Ok(())
                    }
                    Some(why) if now > since + PHASE_LIMIT_NS => {
                        Err(format!("faults healed, yet nothing settles: {why}"))
                    }
                    Some(_) => Ok(()),
                }
            }
            Phase::Clean { since } => {
                let j = self.clients.len() - 1;
                if self.clients[j].janitor_finished() {
                    self.clients[j].done = true;
                    self.clients[j].drop_conn(&mut self.ctx);
                    self.phase = Phase::Drain { since: now };
                    Ok(())
                } else if now > since + PHASE_LIMIT_NS {
                    Err(String::from("the janitor could not delete every key"))
                } else {
                    Ok(())
                }
            }
            Phase::Drain { since } => {
                let dir = self.dirn.dir.as_mut().expect("up since healing");
                let stats = dir.stats(Time::from_nanos(now));
                let pool = self
                    .pool
                    .manager
                    .as_ref()
                    .map(|m| m.stats())
                    .ok_or("pool manager down while draining")?;
                let baseline = stats.keys == 0
                    && stats.pins == 0
                    && stats.sessions == 0
                    && stats.instances == 0
                    && stats.regions == 0
                    && stats.region_bytes == 0
                    && stats.pending_region_requests == 0
                    && self.dirn.pool_out.is_empty()
                    && pool.live_regions == 0
                    && pool.pools.iter().all(|p| p.free_bytes == p.capacity_bytes);
                let waited = now >= since + SESSION_LEASE_NS + INSTANCE_GRACE_NS + 2 * TICK_NS;
                if baseline && waited {
                    self.phase = Phase::Done;
                    Ok(())
                } else if now > since + PHASE_LIMIT_NS + POOL_GRACE_MS * MS {
                    Err(format!(
                        "not back to baseline: directory keys {} pins {} sessions {} instances {} regions {} pending {}, pool requests {}, pool regions {}: {:?}",
                        stats.keys,
                        stats.pins,
                        stats.sessions,
                        stats.instances,
                        stats.regions,
                        stats.pending_region_requests,
                        self.dirn.pool_out.len(),
                        pool.live_regions,
                        self.pool
                            .manager
                            .as_ref()
                            .map(|m| m.snapshot().regions)
                            .unwrap_or_default()
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// After healing: every key a live client registered in an earlier
    /// directory incarnation has been registered again.
    fn final_key_check(&self) -> Result<(), String> {
        for ((_, key), k) in &self.oracle.keys {
            if k.incarnation == self.dirn.incarnation {
                continue;
            }
            let owner = &self.clients[k.owner];
            let live = self.oracle.lives[k.owner]
                .is_some_and(|l| l.id == k.life && !l.ended && l.process == owner.process)
                && owner.alive;
            if live {
                return Err(format!(
                    "key {key:?} of live client {} was not registered again after the directory restarted",
                    owner.name
                ));
            }
        }
        Ok(())
    }
}
