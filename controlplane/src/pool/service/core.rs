//! The core thread: owns the manager, the store, the names file and the open
//! pools; applies commands in arrival order; commits and releases replies
//! (see the module essay of [`super`] for the rules it follows).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::cache::{Cached, SeqCache, exactly_once};
use super::names::{self, NameKind, NamesFile};
use super::pools::OpenPool;
use super::wire::{self, PoolWireHandler};
use super::{
    LocalPool, MAX_QUEUED_REQUESTS, PoolReply, PoolRequest, PoolServiceError, PoolSession,
    REPLY_CACHE_LEN, ServiceConfig, ServiceError, TcpAuth, check_config,
};
use crate::pool::liveness::{self, Liveness};
use crate::pool::manager::MAX_ATTACH_HANDLES;
use crate::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, OwnerLabel,
    PoolId, PoolManager, PoolStore, PoolTarget, RegionId, Reply, Request, StoreError, Token,
};
use crate::proto::{
    self, ErrorCode, MAX_LIST_REGIONS, MAX_NAME_BYTES, MAX_POOL_OWNERS, OwnerUsage, PoolStatsReply,
    PoolUsage, PoolWelcome, RefusedRegion, RegionHandle, RegionList, RegionToken,
    RegionsReattached,
};
use crate::transport::{Completer, ConnId, Endpoint, ServerConfig, ServerHandle};

/// Most commands handled between two flushes (bounds the time timers and
/// held replies wait behind a flood of requests).
const MAX_COMMANDS_PER_ROUND: usize = 4096;
/// Within a round, whether a lease renewal is due is checked every this
/// many commands (each may sync the journal: 4096 of them at a few
/// milliseconds each would outlast the default 10 s lease).
const RENEWAL_CHECK_EVERY: usize = 64;
/// Most reaper ticks per round (each reclaims at most 1024 regions).
const MAX_TICKS_PER_ROUND: usize = 16;
/// How often reply caches of directories the manager forgot are dropped.
const CACHE_PRUNE_MS: u64 = 10_000;

/// How a session reaches its peer.
#[derive(Debug, Clone)]
pub(crate) enum SessionTransport {
    /// A Unix-socket connection (descriptors can be passed).
    Unix {
        completer: Completer,
        conn: ConnId,
    },
    Tcp {
        completer: Completer,
        conn: ConnId,
    },
    /// A [`LocalPool`] in this process (answers through callbacks).
    InProcess,
}

/// One request, as the core runs it (the front ends convert to this).
#[derive(Debug)]
pub(crate) enum Op {
    Hello {
        protocol_min: u16,
        protocol_max: u16,
        directory_id: String,
        secret: Option<Vec<u8>>,
    },
    Alloc {
        seq: u64,
        pool: Option<u32>,
        len_bytes: u64,
        /// The wire's `owner.directory_id` (must be the session's); `None`
        /// in process (the session's, by construction).
        directory_id: Option<String>,
        instance_id: String,
    },
    Free {
        seq: u64,
        region: u64,
        token: RegionToken,
    },
    Reattach {
        handles: Vec<RegionHandle>,
    },
    List {
        after_region: u64,
        max_handles: u32,
    },
    Stats,
}

impl Op {
    /// The op for an in-process request numbered `seq` (ignored when not
    /// mutating).
    pub(crate) fn from_request(request: PoolRequest, seq: u64) -> Self {
        match request {
            PoolRequest::Alloc {
                pool,
                len_bytes,
                instance_id,
            } => Op::Alloc {
                seq,
                pool,
                len_bytes,
                directory_id: None,
                instance_id,
            },
            PoolRequest::Free { region, token } => Op::Free { seq, region, token },
            PoolRequest::Reattach { handles } => Op::Reattach { handles },
            PoolRequest::List {
                after_region,
                max_handles,
            } => Op::List {
                after_region,
                max_handles,
            },
            PoolRequest::Stats => Op::Stats,
        }
    }
}

/// Where an answer goes.
pub(crate) enum ReplyTo {
    /// The frame with this request id on the session's connection.
    Wire {
        request_id: u64,
    },
    Callback(Callback),
}

/// A [`PoolCallback`](super::PoolCallback) that is called exactly once:
/// with the answer ([`Callback::call`]) or, dropped unanswered, with the
/// "stopped" error.
///
/// Why the drop answers: a front end checks `stopped` and then sends, and a
/// core that stops sets `stopped`, drains its queue once more
/// (`refuse_queued`) and drops it. A request sent between that last drain
/// and the drop is dropped with the queue, and a plain boxed closure would
/// go with it uncalled: its caller (the directory's server, waiting on a
/// region) would never hear. The same holds for anything a panicking core
/// drops. A wire request needs nothing of the kind: its connection is
/// closed when the transport stops.
pub(crate) struct Callback(Option<super::PoolCallback>);

impl Callback {
    pub(crate) fn new(f: super::PoolCallback) -> Self {
        Self(Some(f))
    }

    /// Calls the callback with `answer`.
    pub(crate) fn call(mut self, answer: Result<PoolReply, PoolServiceError>) {
        if let Some(f) = self.0.take() {
            f(answer);
        }
    }
}

impl Drop for Callback {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(Err(stopped_error()));
        }
    }
}

impl std::fmt::Debug for ReplyTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyTo::Wire { request_id } => write!(f, "Wire({request_id})"),
            ReplyTo::Callback(_) => f.write_str("Callback"),
        }
    }
}

#[derive(Debug)]
pub(crate) enum Command {
    Open {
        session: u64,
        caller: Caller,
        transport: SessionTransport,
    },
    Request {
        session: u64,
        op: Op,
        reply: ReplyTo,
    },
    Closed {
        session: u64,
    },
    Stop,
}

/// Counters of the core (monotonic).
#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    commits: AtomicU64,
    records: AtomicU64,
    checkpoints: AtomicU64,
    reclaimed: AtomicU64,
}

impl Counters {
    // Relaxed throughout: independent monotonic tallies, read for reporting;
    // no other memory is published through them.
    fn bump(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// A copy of the core's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    pub requests: u64,
    /// Journal commits (each one `fdatasync`, or two when it advances the
    /// journal header's claim).
    pub commits: u64,
    /// Journal records committed.
    pub records: u64,
    pub checkpoints: u64,
    /// Regions the reaper reclaimed.
    pub reclaimed: u64,
}

/// What the front ends share with the core.
#[derive(Debug)]
struct LinkShared {
    queued_requests: AtomicUsize,
    next_session: AtomicU64,
    stopped: AtomicBool,
    failure: Mutex<Option<String>>,
    counters: Counters,
}

/// A front end's handle on the core: sends commands, never blocks.
#[derive(Debug, Clone)]
pub(crate) struct CoreLink {
    tx: mpsc::Sender<Command>,
    shared: Arc<LinkShared>,
}

fn stopped_error() -> PoolServiceError {
    PoolServiceError::new(
        ErrorCode::Internal,
        "the pool service has stopped; retry with the same seq once it is back",
        0,
    )
}

impl CoreLink {
    /// A session id, unique for the life of the process.
    pub fn new_session(&self) -> u64 {
        // Relaxed: ids only need to be unique; nothing is published with them.
        self.shared.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Opens a session. Sessions are bounded by the transport's connection
    /// limit (and by the callers of `attach_local`), so this send is not
    /// counted against the request bound.
    pub fn open(&self, session: u64, caller: Caller, transport: SessionTransport) -> bool {
        self.tx
            .send(Command::Open {
                session,
                caller,
                transport,
            })
            .is_ok()
    }

    pub fn closed(&self, session: u64) {
        // A stopped core has nothing left to close.
        let _ = self.tx.send(Command::Closed { session });
    }

    /// Queues a request; on refusal (`Busy`, stopped) the reply target comes
    /// back with the error to answer it with.
    pub fn request(
        &self,
        session: u64,
        op: Op,
        reply: ReplyTo,
    ) -> Result<(), (ReplyTo, PoolServiceError)> {
        // Acquire pairs with the core's Release store, though nothing else is
        // published with the flag: a front end that misses it still finds
        // the channel closed, or its command answered by `refuse_queued`.
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err((reply, stopped_error()));
        }
        // Relaxed: the counter is a bound, not a synchronisation point; the
        // channel orders the command itself.
        let before = self.shared.queued_requests.fetch_add(1, Ordering::Relaxed);
        if before >= MAX_QUEUED_REQUESTS {
            self.shared.queued_requests.fetch_sub(1, Ordering::Relaxed);
            return Err((
                reply,
                PoolServiceError::new(
                    ErrorCode::Busy,
                    format!(
                        "{MAX_QUEUED_REQUESTS} requests are queued for the pool manager; retry with the same seq"
                    ),
                    MAX_QUEUED_REQUESTS as u64,
                ),
            ));
        }
        match self.tx.send(Command::Request { session, op, reply }) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError(cmd)) => {
                self.shared.queued_requests.fetch_sub(1, Ordering::Relaxed);
                match cmd {
                    Command::Request { reply, .. } => Err((reply, stopped_error())),
                    _ => unreachable!("the command sent was a request"),
                }
            }
        }
    }
}

#[derive(Debug)]
struct Session {
    caller: Caller,
    transport: SessionTransport,
    directory: Option<(DirectoryId, Arc<str>)>,
}

/// Where a released answer goes, resolved when it was produced (the
/// session may be closed by the time it is released).
enum Route {
    Wire {
        completer: Completer,
        conn: ConnId,
        request_id: u64,
    },
    Callback(Callback),
}

struct Outgoing {
    route: Route,
    answer: Result<PoolReply, PoolServiceError>,
}

/// What a graceful stop did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Sequence number of the last committed journal record.
    pub committed_seq: u64,
    /// A final checkpoint was written (the journal is empty on disk).
    pub checkpointed: bool,
}

/// The running pool service: the core thread and, once [`PoolCore::listen`]
/// was called, the transport serving the pool protocol. Stops gracefully
/// with [`PoolCore::shutdown`] (or on drop).
pub struct PoolCore {
    link: CoreLink,
    join: Option<JoinHandle<Result<ShutdownReport, ServiceError>>>,
    server: Option<ServerHandle<PoolWireHandler>>,
    pools: Vec<proto::PoolInfo>,
}

impl std::fmt::Debug for PoolCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolCore")
            .field("pools", &self.pools.len())
            .field("listening", &self.server.is_some())
            .finish_non_exhaustive()
    }
}

impl PoolCore {
    /// Recovers the state directory, opens and fences every pool, and starts
    /// the core thread. Every refusal (state directory or pool in use by
    /// another manager, corrupt state, foreign pool, …) is returned here,
    /// before anything is served.
    pub fn start(cfg: ServiceConfig) -> Result<Self, ServiceError> {
        let (core, link, rx) = Core::open(cfg)?;
        let pools = core.pools.iter().map(OpenPool::info).collect();
        let join = std::thread::Builder::new()
            .name("cxlkv-pool-core".into())
            .spawn(move || core.run(rx))
            .map_err(ServiceError::Thread)?;
        Ok(Self {
            link,
            join: Some(join),
            server: None,
            pools,
        })
    }

    /// Serves the pool protocol on `endpoints` (Unix sockets and TCP). A
    /// stale Unix socket file (nobody accepts on it) is replaced; one in use
    /// is refused. Returns the bound endpoints (TCP port 0 resolved).
    pub fn listen(
        &mut self,
        endpoints: &[Endpoint],
        mut server_cfg: ServerConfig,
    ) -> Result<Vec<Endpoint>, ServiceError> {
        if self.server.is_some() {
            return Err(ServiceError::Config(
                "the pool service already listens".into(),
            ));
        }
        for ep in endpoints {
            if let Endpoint::Unix(path) = ep {
                wire::prepare_socket_path(path)?;
            }
        }
        server_cfg.max_inflight_per_conn = server_cfg
            .max_inflight_per_conn
            .min(super::MAX_INFLIGHT_PER_CONN);
        // A directory's connection sends something at least every
        // `RemoteConfig::ping_ms`; one silent for this long lost its peer
        // (a host gone without closing), whose regions then wait out the
        // grace period as after a close.
        server_cfg
            .idle_timeout_ms
            .get_or_insert(super::IDLE_TIMEOUT_MS);
        let server = crate::transport::Server::bind(server_cfg, endpoints)?;
        let bound = server.endpoints().to_vec();
        let handler = PoolWireHandler::new(self.link.clone(), server.completer());
        tracing::info!(endpoints = ?bound, backend = %server.backend(), "pool service listening");
        self.server = Some(server.spawn(handler)?);
        Ok(bound)
    }

    /// Opens an in-process session for `directory_id` (the `PoolHello` of
    /// `cxlkv serve`'s directory).
    pub fn attach_local(
        &self,
        directory_id: &str,
        timeout: Duration,
    ) -> Result<(LocalPool, PoolSession), PoolServiceError> {
        LocalPool::attach(self.link.clone(), directory_id, timeout)
    }

    /// The pools this service opened, as announced to directories.
    pub fn pools(&self) -> &[proto::PoolInfo] {
        &self.pools
    }

    pub fn stats(&self) -> CoreStats {
        let c = &self.link.shared.counters;
        // Relaxed: see `Counters::bump`.
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CoreStats {
            requests: l(&c.requests),
            commits: l(&c.commits),
            records: l(&c.records),
            checkpoints: l(&c.checkpoints),
            reclaimed: l(&c.reclaimed),
        }
    }

    /// Why the core stopped on its own (a failed journal write or sync), if
    /// it did. The owner must then exit; a restart recovers.
    pub fn failure(&self) -> Option<String> {
        self.link.shared.failure.lock().clone()
    }

    /// True while the core serves.
    pub fn is_running(&self) -> bool {
        // Acquire: see `CoreLink::request`.
        !self.link.shared.stopped.load(Ordering::Acquire)
    }

    /// Stops gracefully: the transport first (no new requests), then the
    /// core, which commits what is pending, releases held replies, writes a
    /// final checkpoint and releases its locks.
    pub fn shutdown(mut self) -> Result<ShutdownReport, ServiceError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<ShutdownReport, ServiceError> {
        if let Some(server) = self.server.take()
            && let Err(e) = server.shutdown()
        {
            tracing::warn!(error = %e, "transport stopped with an error");
        }
        let Some(join) = self.join.take() else {
            return Err(ServiceError::Stopped("already stopped".into()));
        };
        // A core that already failed has dropped its receiver.
        let _ = self.link.tx.send(Command::Stop);
        match join.join() {
            Ok(r) => r,
            Err(_) => Err(ServiceError::Stopped("the core thread panicked".into())),
        }
    }
}

impl Drop for PoolCore {
    fn drop(&mut self) {
        if self.join.is_some()
            && let Err(e) = self.stop()
        {
            tracing::warn!(error = %e, "pool service stopped with an error");
        }
    }
}

/// The state owned by the core thread.
struct Core {
    cfg: ServiceConfig,
    manager: PoolManager,
    store: PoolStore,
    names: NamesFile,
    pools: Vec<OpenPool>,
    sessions: HashMap<u64, Session>,
    /// Open sessions per caller: a local caller is its process, which may
    /// hold several connections.
    caller_sessions: HashMap<Caller, usize>,
    caches: HashMap<DirectoryId, SeqCache<Cached>>,
    held: VecDeque<Outgoing>,
    origin: Instant,
    next_renew: MonotonicMs,
    next_probe: MonotonicMs,
    next_prune: MonotonicMs,
    scratch: Vec<u8>,
    shared: Arc<LinkShared>,
}

/// A failure that stops the core.
#[derive(Debug, thiserror::Error)]
enum Fatal {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Names(#[from] names::NamesError),
}

fn err(code: ErrorCode, message: impl Into<String>) -> PoolServiceError {
    PoolServiceError::new(code, message, 0)
}

impl Core {
    /// Recovers, opens the pools, and returns the core with the link to it
    /// and its command receiver (not yet running).
    fn open(cfg: ServiceConfig) -> Result<(Self, CoreLink, mpsc::Receiver<Command>), ServiceError> {
        check_config(&cfg)?;
        let recovered = PoolStore::open(
            &cfg.state_dir,
            cfg.store,
            ManagerConfig {
                grace_ms: cfg.grace_ms,
            },
            MonotonicMs(0),
        )?;
        let mut store = recovered.store;
        store.set_io_faults(cfg.io_faults.clone());
        let mut manager = recovered.manager;
        let mut names = NamesFile::open(&cfg.state_dir)?;
        names.set_io_faults(cfg.io_faults.clone());
        let mut pools = Vec::with_capacity(cfg.pools.len());
        for spec in &cfg.pools {
            pools.push(OpenPool::open(
                spec,
                &mut manager,
                &mut store,
                cfg.lease_ms,
            )?);
        }
        // Time 0 of the recovered state (every region's grace period ends
        // at `grace_ms` after it) is now, once replay and the pools' opening
        // are done: directories can reattach only from here, and a long
        // replay must not eat into the time they have.
        let origin = Instant::now();
        if cfg.pass_fds && pools.len() > crate::transport::MAX_FDS_PER_FRAME {
            tracing::warn!(
                pools = pools.len(),
                max = crate::transport::MAX_FDS_PER_FRAME,
                "more pools than descriptors fit in one frame: pool descriptors are not passed"
            );
        }
        let shared = Arc::new(LinkShared {
            queued_requests: AtomicUsize::new(0),
            next_session: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            failure: Mutex::new(None),
            counters: Counters::default(),
        });
        let (tx, rx) = mpsc::channel();
        let renew_ms = cfg.lease_renew_ms();
        let probe_ms = cfg.probe_interval_ms();
        let core = Core {
            manager,
            store,
            names,
            pools,
            sessions: HashMap::new(),
            caller_sessions: HashMap::new(),
            caches: HashMap::new(),
            held: VecDeque::new(),
            origin,
            next_renew: MonotonicMs(renew_ms),
            next_probe: MonotonicMs(probe_ms),
            next_prune: MonotonicMs(CACHE_PRUNE_MS),
            scratch: Vec::new(),
            shared: Arc::clone(&shared),
            cfg,
        };
        Ok((core, CoreLink { tx, shared }, rx))
    }

    fn now(&self) -> MonotonicMs {
        MonotonicMs(self.origin.elapsed().as_millis() as u64)
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) -> Result<ShutdownReport, ServiceError> {
        let result = self.serve(&rx);
        // Release: see the Acquire in `CoreLink::request`.
        self.shared.stopped.store(true, Ordering::Release);
        match result {
            Ok(()) => {
                self.refuse_queued(&rx);
                drop(rx);
                self.finish()
            }
            Err(fatal) => {
                let msg = fatal.to_string();
                tracing::error!(error = %msg, "pool service stopping: the journal or names file failed (fail-stop)");
                *self.shared.failure.lock() = Some(msg.clone());
                self.abandon_held();
                self.refuse_queued(&rx);
                drop(rx);
                Err(ServiceError::Stopped(msg))
            }
        }
    }

    /// Answers what is still queued once the core stops (the front ends see
    /// `stopped` from now on and answer new requests themselves): callbacks
    /// get an error, connections are closed — every callback is called
    /// exactly once, and no request is answered as if it ran.
    fn refuse_queued(&mut self, rx: &mpsc::Receiver<Command>) {
        while let Ok(cmd) = rx.try_recv() {
            let Command::Request { session, reply, .. } = cmd else {
                continue;
            };
            match reply {
                ReplyTo::Callback(cb) => cb.call(Err(stopped_error())),
                ReplyTo::Wire { .. } => {
                    if let Some(Session {
                        transport:
                            SessionTransport::Unix { completer, conn }
                            | SessionTransport::Tcp { completer, conn },
                        ..
                    }) = self.sessions.get(&session)
                    {
                        let _ = completer.close(*conn);
                    }
                }
            }
        }
    }

    fn serve(&mut self, rx: &mpsc::Receiver<Command>) -> Result<(), Fatal> {
        loop {
            self.run_timers();
            self.flush()?;
            let now = self.now();
            let wait_ms = now.ms_until(self.next_wake());
            let first = match rx.recv_timeout(Duration::from_millis(wait_ms)) {
                Ok(cmd) => cmd,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            };
            let mut next = Some(first);
            let mut handled: usize = 0;
            while let Some(cmd) = next.take() {
                if matches!(cmd, Command::Stop) {
                    self.flush()?;
                    return Ok(());
                }
                self.handle(cmd)?;
                handled += 1;
                // A round of syncing commands on a slow device can outlast a
                // lease renewal period: the round ends early for it.
                let renewal_due =
                    handled.is_multiple_of(RENEWAL_CHECK_EVERY) && self.now() >= self.next_renew;
                if handled < MAX_COMMANDS_PER_ROUND && !renewal_due {
                    next = rx.try_recv().ok();
                }
            }
            self.flush()?;
        }
    }

    /// The graceful end: everything is committed (by `serve`); checkpoint so
    /// the next start replays nothing, then drop the locks.
    fn finish(mut self) -> Result<ShutdownReport, ServiceError> {
        let checkpointed = self.store.journal_ref().records_since_checkpoint() > 0;
        if checkpointed {
            self.checkpoint()
                .map_err(|e| ServiceError::Stopped(e.to_string()))?;
        }
        let committed_seq = self.store.journal_ref().committed_seq();
        tracing::info!(committed_seq, checkpointed, "pool service stopped");
        Ok(ShutdownReport {
            committed_seq,
            checkpointed,
        })
    }

    /// Fail-stop: held replies are never sent as successes. Connections are
    /// closed (their peers resend with the same seq after the restart);
    /// callbacks learn that the outcome is unknown.
    fn abandon_held(&mut self) {
        for out in self.held.drain(..) {
            match out.route {
                Route::Wire {
                    completer, conn, ..
                } => {
                    let _ = completer.close(conn);
                }
                Route::Callback(cb) => cb.call(Err(err(
                    ErrorCode::Internal,
                    "the pool manager's journal failed: outcome unknown; retry with the same seq after it restarts",
                ))),
            }
        }
    }

    fn next_wake(&self) -> MonotonicMs {
        let mut wake = self.next_renew.min(self.next_prune);
        if let Some(d) = self.manager.next_deadline() {
            wake = wake.min(d);
        }
        if self.manager.local_callers().next().is_some() {
            wake = wake.min(self.next_probe);
        }
        wake
    }

    fn run_timers(&mut self) {
        let now = self.now();
        for _ in 0..MAX_TICKS_PER_ROUND {
            if self.manager.next_deadline().is_none_or(|d| d > now) {
                break;
            }
            let report = self.manager.tick(now, self.store.journal());
            for r in &report.reclaimed {
                let d = r.owner.directory;
                tracing::info!(region = %r.id, pool = %r.pool, directory_id = %d, directory = %self.directory_name(d, None), instance = %r.owner.instance, len_bytes = r.len_bytes, "reclaimed a region of a gone directory");
            }
            Counters::bump(
                &self.shared.counters.reclaimed,
                report.reclaimed.len() as u64,
            );
            if !report.more_due {
                break;
            }
        }
        if now >= self.next_renew {
            for pool in &mut self.pools {
                if let Err(e) = pool.renew(&mut self.manager, self.cfg.lease_ms) {
                    tracing::error!(pool = %pool.id, error = %e, "pool lease lost: no more allocations from this pool");
                }
            }
            self.next_renew = now.plus_ms(self.cfg.lease_renew_ms());
        }
        if now >= self.next_probe {
            self.probe_local_callers(now);
            self.next_probe = now.plus_ms(self.cfg.probe_interval_ms());
        }
        if now >= self.next_prune {
            let manager = &self.manager;
            self.caches
                .retain(|d, _| manager.directory(*d, now).is_some());
            self.next_prune = now.plus_ms(CACHE_PRUNE_MS);
        }
    }

    fn probe_local_callers(&mut self, now: MonotonicMs) {
        let callers: Vec<_> = self.manager.local_callers().collect();
        for p in callers {
            self.probe_one(p, now, None);
        }
    }

    /// The name the logs give directory `d` beside its id (`directory` beside
    /// `directory_id`), the same in every line about it: the name it
    /// attached with — from the names file, else from `bound`, the one a
    /// session just closed spoke for, else from an open session's — or, if
    /// the core knows none, the names file's escape form of the id.
    fn directory_name(&self, d: DirectoryId, bound: Option<&(DirectoryId, Arc<str>)>) -> String {
        if let Some(name) = self.names.name(NameKind::Directory, d.0) {
            return name.to_string();
        }
        bound
            .into_iter()
            .chain(self.sessions.values().filter_map(|s| s.directory.as_ref()))
            .find(|(id, _)| *id == d)
            .map_or_else(|| names::escape(d.0), |(_, name)| name.to_string())
    }

    /// Probes local caller `p`; `bound` is the directory its last session,
    /// just closed, spoke for (for the log's name).
    fn probe_one(
        &mut self,
        p: crate::pool::ProcessIdentity,
        now: MonotonicMs,
        bound: Option<&(DirectoryId, Arc<str>)>,
    ) {
        match liveness::probe(&p) {
            Ok(Liveness::Alive) => {}
            Ok(state) => {
                if let Some(d) = self.manager.caller_gone(&Caller::Local(p), now) {
                    tracing::info!(directory_id = %d, directory = %self.directory_name(d, bound), process = %p, ?state, grace_ms = self.cfg.grace_ms, "local directory process is gone; its regions wait for a reattach");
                }
            }
            Err(e) => {
                tracing::warn!(process = %p, error = %e, "cannot probe a local directory process")
            }
        }
    }

    /// Commits what is pending (names first), releases held replies, and
    /// checkpoints when due.
    fn flush(&mut self) -> Result<(), Fatal> {
        let pending = self.store.journal_ref().pending_records();
        if pending > 0 || self.names.has_pending() {
            self.names.commit()?;
            let report = self.store.commit()?;
            if report.records > 0 {
                let c = &self.shared.counters;
                Counters::bump(&c.commits, 1);
                Counters::bump(&c.records, report.records as u64);
            }
        }
        while let Some(out) = self.held.pop_front() {
            self.send(out);
        }
        if self.store.checkpoint_due() {
            self.checkpoint()?;
        }
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<(), Fatal> {
        let mut in_use: HashSet<(NameKind, u64)> = HashSet::new();
        for r in self.manager.regions() {
            in_use.insert((NameKind::Directory, r.owner.directory.0));
            in_use.insert((NameKind::Instance, r.owner.instance.0));
        }
        self.names.compact(|k, id| in_use.contains(&(k, id)))?;
        let report = self.store.checkpoint(&self.manager)?;
        Counters::bump(&self.shared.counters.checkpoints, 1);
        tracing::debug!(
            seq = report.seq,
            len_bytes = report.len_bytes,
            "checkpoint written"
        );
        Ok(())
    }

    fn send(&mut self, out: Outgoing) {
        match out.route {
            Route::Callback(cb) => cb.call(out.answer),
            Route::Wire {
                completer,
                conn,
                request_id,
            } => wire::send_answer(&completer, conn, request_id, out.answer, &mut self.scratch),
        }
    }

    fn handle(&mut self, cmd: Command) -> Result<(), Fatal> {
        match cmd {
            Command::Open {
                session,
                caller,
                transport,
            } => {
                *self.caller_sessions.entry(caller).or_insert(0) += 1;
                self.sessions.insert(
                    session,
                    Session {
                        caller,
                        transport,
                        directory: None,
                    },
                );
            }
            Command::Closed { session } => self.close_session(session),
            Command::Request { session, op, reply } => {
                // Relaxed: the bound's counter (see `CoreLink::request`).
                self.shared.queued_requests.fetch_sub(1, Ordering::Relaxed);
                Counters::bump(&self.shared.counters.requests, 1);
                let now = self.now();
                let (route, answer) = match self.sessions.get(&session) {
                    None => {
                        // The session closed before its request ran: the
                        // peer is gone, only a callback can still hear.
                        match reply {
                            ReplyTo::Callback(cb) => cb.call(Err(err(
                                ErrorCode::SessionEnded,
                                "the pool session was closed",
                            ))),
                            ReplyTo::Wire { .. } => {}
                        }
                        return Ok(());
                    }
                    Some(s) => {
                        let route = match (reply, &s.transport) {
                            (ReplyTo::Callback(cb), _) => Route::Callback(cb),
                            (
                                ReplyTo::Wire { request_id },
                                SessionTransport::Unix { completer, conn }
                                | SessionTransport::Tcp { completer, conn },
                            ) => Route::Wire {
                                completer: completer.clone(),
                                conn: *conn,
                                request_id,
                            },
                            (ReplyTo::Wire { .. }, SessionTransport::InProcess) => {
                                unreachable!("in-process sessions answer through callbacks")
                            }
                        };
                        (route, self.execute(session, op, now))
                    }
                };
                let out = Outgoing { route, answer };
                if self.store.journal_ref().pending_records() == 0 && self.held.is_empty() {
                    self.send(out);
                } else {
                    self.held.push_back(out);
                }
                if self.store.commit_due() {
                    self.flush()?;
                }
            }
            Command::Stop => unreachable!("handled by the loop"),
        }
        Ok(())
    }

    fn close_session(&mut self, session: u64) {
        let Some(s) = self.sessions.remove(&session) else {
            return;
        };
        let left = match self.caller_sessions.get_mut(&s.caller) {
            Some(n) => {
                *n -= 1;
                *n
            }
            None => 0,
        };
        if left > 0 {
            return;
        }
        self.caller_sessions.remove(&s.caller);
        let now = self.now();
        match s.caller {
            Caller::Remote { .. } => {
                if let Some(d) = self.manager.caller_gone(&s.caller, now) {
                    tracing::info!(directory_id = %d, directory = %self.directory_name(d, s.directory.as_ref()), session, grace_ms = self.cfg.grace_ms, "directory connection closed; its regions wait for a reattach");
                }
            }
            // A local caller is its process: gone only when the process is.
            // It usually closes its sockets before it becomes a zombie, so
            // this probe often still sees it alive; the periodic probe
            // catches it next.
            Caller::Local(p) => self.probe_one(p, now, s.directory.as_ref()),
        }
    }

    fn execute(
        &mut self,
        session: u64,
        op: Op,
        now: MonotonicMs,
    ) -> Result<PoolReply, PoolServiceError> {
        match op {
            Op::Hello {
                protocol_min,
                protocol_max,
                directory_id,
                secret,
            } => self.hello(
                session,
                protocol_min,
                protocol_max,
                directory_id,
                secret,
                now,
            ),
            Op::Stats => Ok(PoolReply::Stats(self.pool_stats())),
            Op::Alloc {
                seq,
                pool,
                len_bytes,
                directory_id,
                instance_id,
            } => {
                let (caller, dir, dir_name) = self.bound(session)?;
                if directory_id.as_deref().is_some_and(|d| d != &*dir_name) {
                    return Err(err(
                        ErrorCode::NotOwner,
                        format!(
                            "owner.directory_id {:?} is not this connection's directory {dir_name:?}",
                            directory_id.unwrap_or_default()
                        ),
                    ));
                }
                let answer = self.mutating(dir, seq, |core| {
                    core.alloc(&caller, &dir_name, pool, len_bytes, &instance_id, seq, now)
                })?;
                // Run now or answered from the cache: in the second case the
                // retry may come on a later connection, after the first one's
                // close put the region on the reaper's queue (its directory
                // never learnt of it, so will not present it), or after the
                // region was reclaimed. Keep it, or refuse to name it.
                if let PoolReply::Allocated(h) = &answer {
                    self.manager
                        .keep_retried(&caller, RegionId(h.region))
                        .map_err(|e| PoolServiceError::from(&e))?;
                }
                Ok(answer)
            }
            Op::Free { seq, region, token } => {
                let (caller, dir, _) = self.bound(session)?;
                self.mutating(dir, seq, |core| core.free(&caller, region, token, now))
            }
            Op::Reattach { handles } => {
                let (caller, dir, _) = self.bound(session)?;
                self.reattach(&caller, dir, &handles, now)
            }
            Op::List {
                after_region,
                max_handles,
            } => {
                let (_, dir, dir_name) = self.bound(session)?;
                self.list(dir, &dir_name, after_region, max_handles)
            }
        }
    }

    /// The session's caller and directory, or `HelloRequired`.
    fn bound(&self, session: u64) -> Result<(Caller, DirectoryId, Arc<str>), PoolServiceError> {
        let s = self
            .sessions
            .get(&session)
            .expect("execute() runs only for open sessions");
        match &s.directory {
            Some((d, name)) => Ok((s.caller, *d, Arc::clone(name))),
            None => Err(err(
                ErrorCode::HelloRequired,
                "send PoolHello first: this connection speaks for no directory yet",
            )),
        }
    }

    /// Runs a mutating request under the reply cache's rules.
    fn mutating(
        &mut self,
        dir: DirectoryId,
        seq: u64,
        run: impl FnOnce(&mut Self) -> Result<Result<Cached, PoolServiceError>, PoolServiceError>,
    ) -> Result<PoolReply, PoolServiceError> {
        // Kept far from overflow: `last_seq + 1` is where a directory's next
        // session counts from (and a seq is an allocation's journaled tag).
        if seq > crate::directory::MAX_SEQUENCE {
            return Err(PoolServiceError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "seq {seq} is above the largest accepted, {}",
                    crate::directory::MAX_SEQUENCE
                ),
                crate::directory::MAX_SEQUENCE,
            ));
        }
        // Out of the map while `run` has `self` (nothing it runs reads the
        // caches).
        let mut cache = self
            .caches
            .remove(&dir)
            .unwrap_or_else(|| SeqCache::new(REPLY_CACHE_LEN));
        // Outer Err of `run`: refused before the state machine (not cached,
        // seq not consumed); inner: the state machine's answer (cached).
        let answer = exactly_once(&mut cache, seq, || {
            run(self).map(|a| a.unwrap_or_else(Cached::Failed))
        });
        self.caches.insert(dir, cache);
        from_cached(answer??)
    }

    #[allow(clippy::too_many_arguments)]
    fn alloc(
        &mut self,
        caller: &Caller,
        dir_name: &str,
        pool: Option<u32>,
        len_bytes: u64,
        instance_name: &str,
        seq: u64,
        now: MonotonicMs,
    ) -> Result<Result<Cached, PoolServiceError>, PoolServiceError> {
        if instance_name.is_empty() || instance_name.len() > MAX_NAME_BYTES {
            return Err(PoolServiceError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "instance_id must be 1..={MAX_NAME_BYTES} bytes, got {}",
                    instance_name.len()
                ),
                MAX_NAME_BYTES as u64,
            ));
        }
        let instance = self
            .names
            .check(NameKind::Instance, instance_name)
            .map_err(|e| err(ErrorCode::InvalidArgument, e.to_string()))?;
        let (target, align) = match pool {
            Some(p) => (
                PoolTarget::Pool(PoolId(p)),
                self.manager
                    .pool(PoolId(p))
                    .map_or(1, |info| info.alignment_bytes),
            ),
            None => (
                PoolTarget::Any,
                self.pools
                    .iter()
                    .filter(|p| p.online)
                    .map(|p| p.backing.align_bytes())
                    .max()
                    .unwrap_or(1),
            ),
        };
        // Rounded up to the alignment (of the pool, or the largest of the
        // online pools, which every smaller power of two divides). An
        // overflow is left for the manager to refuse as too large.
        let len_bytes = len_bytes
            .checked_next_multiple_of(align)
            .unwrap_or(len_bytes);
        let request = Request::Alloc {
            target,
            len_bytes,
            instance: InstanceId(instance),
            tag: AllocTag(seq),
        };
        match self
            .manager
            .handle(caller, request, now, self.store.journal())
        {
            Ok(Reply::Allocated(h)) => {
                self.names.note(NameKind::Directory, dir_name);
                self.names.note(NameKind::Instance, instance_name);
                Ok(Ok(Cached::Allocated(wire_handle(
                    &h,
                    dir_name,
                    instance_name,
                ))))
            }
            Ok(other) => unreachable!("an allocation answers Allocated, got {other:?}"),
            Err(e) => Ok(Err(PoolServiceError::from(&e))),
        }
    }

    fn free(
        &mut self,
        caller: &Caller,
        region: u64,
        token: RegionToken,
        now: MonotonicMs,
    ) -> Result<Result<Cached, PoolServiceError>, PoolServiceError> {
        let Some(r) = self.manager.region(RegionId(region)) else {
            return Ok(Err(err(
                ErrorCode::UnknownRegion,
                format!("region {region} does not exist (never issued, or already freed)"),
            )));
        };
        let handle = Handle {
            region: r.id,
            pool: r.pool,
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes,
            owner: r.owner,
            token: Token(token.0),
        };
        match self
            .manager
            .handle(caller, Request::Free { handle }, now, self.store.journal())
        {
            Ok(Reply::Freed { region, .. }) => Ok(Ok(Cached::Freed { region: region.0 })),
            Ok(other) => unreachable!("a free answers Freed, got {other:?}"),
            Err(e) => Ok(Err(PoolServiceError::from(&e))),
        }
    }

    fn reattach(
        &mut self,
        caller: &Caller,
        dir: DirectoryId,
        handles: &[RegionHandle],
        now: MonotonicMs,
    ) -> Result<PoolReply, PoolServiceError> {
        let mut accepted = Vec::new();
        let mut refused = Vec::new();
        for chunk in handles.chunks(MAX_ATTACH_HANDLES) {
            let converted: Vec<Handle> = chunk.iter().map(manager_handle).collect();
            let report = match self.manager.handle(
                caller,
                Request::Attach {
                    directory: dir,
                    handles: &converted,
                },
                now,
                self.store.journal(),
            ) {
                Ok(Reply::Attached(report)) => report,
                Ok(other) => unreachable!("an attach answers Attached, got {other:?}"),
                Err(e) => return Err(PoolServiceError::from(&e)),
            };
            for (h, verdict) in chunk.iter().zip(report.verdicts) {
                match verdict {
                    Ok(()) => {
                        accepted.push(h.region);
                        // Token-verified names: keep them (they may be
                        // missing after a lost names file).
                        if self
                            .names
                            .check(NameKind::Instance, &h.owner.instance_id)
                            .is_ok()
                            && self
                                .names
                                .check(NameKind::Directory, &h.owner.directory_id)
                                .is_ok()
                        {
                            self.names.note(NameKind::Directory, &h.owner.directory_id);
                            self.names.note(NameKind::Instance, &h.owner.instance_id);
                        }
                    }
                    Err(e) => refused.push(RefusedRegion {
                        region: h.region,
                        code: super::wire_code(&e).0.as_u16(),
                    }),
                }
            }
        }
        Ok(PoolReply::Reattached(RegionsReattached {
            accepted,
            refused,
        }))
    }

    fn list(
        &self,
        dir: DirectoryId,
        dir_name: &str,
        after_region: u64,
        max_handles: u32,
    ) -> Result<PoolReply, PoolServiceError> {
        let max = max_handles as usize;
        if max == 0 || max > MAX_LIST_REGIONS {
            return Err(PoolServiceError::new(
                ErrorCode::InvalidArgument,
                format!("max_handles = {max_handles} must be in 1..={MAX_LIST_REGIONS}"),
                MAX_LIST_REGIONS as u64,
            ));
        }
        let mut handles = Vec::with_capacity(max.min(64));
        let mut more = false;
        for r in self.manager.regions_of(dir, RegionId(after_region)) {
            if handles.len() == max {
                more = true;
                break;
            }
            let h = self.manager.handle_of(&r);
            let instance = self.names.display(NameKind::Instance, r.owner.instance.0);
            handles.push(wire_handle(&h, dir_name, &instance));
        }
        Ok(PoolReply::Regions(RegionList { handles, more }))
    }

    fn hello(
        &mut self,
        session: u64,
        protocol_min: u16,
        protocol_max: u16,
        directory_name: String,
        secret: Option<Vec<u8>>,
        now: MonotonicMs,
    ) -> Result<PoolReply, PoolServiceError> {
        let version = proto::negotiate(protocol_min, protocol_max)
            .map_err(|e| PoolServiceError::from(e.to_reply()))?;
        let s = self
            .sessions
            .get(&session)
            .expect("execute() runs only for open sessions");
        if let (SessionTransport::Tcp { .. }, TcpAuth::Secret(expected)) =
            (&s.transport, &self.cfg.tcp_auth)
        {
            match &secret {
                None => {
                    return Err(err(
                        ErrorCode::AuthenticationRequired,
                        "this TCP listener requires the pool secret in PoolHello.secret",
                    ));
                }
                // Compared as BLAKE3 hashes, in constant time, whatever the
                // lengths.
                Some(given) if blake3::hash(given) != *blake3::hash(expected).as_bytes() => {
                    return Err(err(
                        ErrorCode::AuthenticationFailed,
                        "PoolHello.secret does not match this pool manager's secret",
                    ));
                }
                Some(_) => {}
            }
        }
        if directory_name.is_empty() || directory_name.len() > MAX_NAME_BYTES {
            return Err(PoolServiceError::new(
                ErrorCode::InvalidArgument,
                format!("directory_id must be 1..={MAX_NAME_BYTES} bytes"),
                MAX_NAME_BYTES as u64,
            ));
        }
        if let Some((_, bound)) = &s.directory
            && **bound != *directory_name
        {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!(
                    "this connection already speaks for directory {bound:?}, not {directory_name:?}"
                ),
            ));
        }
        let dir = self
            .names
            .check(NameKind::Directory, &directory_name)
            .map_err(|e| err(ErrorCode::InvalidArgument, e.to_string()))?;
        let dir = DirectoryId(dir);
        let caller = s.caller;
        let can_fds = !matches!(s.transport, SessionTransport::Tcp { .. });
        match self.manager.handle(
            &caller,
            Request::Attach {
                directory: dir,
                handles: &[],
            },
            now,
            self.store.journal(),
        ) {
            Ok(_) => {}
            Err(e) => return Err(PoolServiceError::from(&e)),
        }
        self.sessions
            .get_mut(&session)
            .expect("checked above")
            .directory = Some((dir, Arc::from(directory_name.as_str())));
        let mut last_seq = self.caches.get(&dir).map_or(0, SeqCache::highest);
        let mut regions_held = 0u64;
        for r in self.manager.regions_of(dir, RegionId(0)) {
            last_seq = last_seq.max(r.tag.0);
            regions_held += 1;
        }
        let pools: Vec<proto::PoolInfo> = self.pools.iter().map(OpenPool::info).collect();
        let fds = if can_fds
            && self.cfg.pass_fds
            && self.pools.len() <= crate::transport::MAX_FDS_PER_FRAME
        {
            self.pool_fds()
        } else {
            Vec::new()
        };
        let welcome = PoolWelcome {
            protocol_version: version,
            manager_epoch: self.pools.iter().map(OpenPool::epoch).max().unwrap_or(0),
            pools,
            fds_passed: fds.len() as u32,
            regions_held,
            last_seq,
        };
        tracing::info!(directory_id = %dir, directory = %directory_name, %caller, regions_held, last_seq, "directory attached");
        Ok(PoolReply::Welcome { welcome, fds })
    }

    /// Duplicates of every pool's descriptor, or none if one cannot be
    /// duplicated (all or nothing: `fds_passed` is 0 or the pool count).
    fn pool_fds(&self) -> Vec<OwnedFd> {
        let mut fds = Vec::with_capacity(self.pools.len());
        for p in &self.pools {
            match p.backing.fd().try_clone_to_owned() {
                Ok(fd) => fds.push(fd),
                Err(e) => {
                    tracing::warn!(pool = %p.id, error = %e, "cannot duplicate a pool descriptor; none are passed");
                    return Vec::new();
                }
            }
        }
        fds
    }

    fn pool_stats(&self) -> PoolStatsReply {
        let stats = self.manager.stats();
        // Bytes and regions per (pool, directory).
        let mut by_owner: HashMap<(PoolId, DirectoryId), (u64, u64)> = HashMap::new();
        for r in self.manager.regions() {
            let e = by_owner
                .entry((r.pool, r.owner.directory))
                .or_insert((0, 0));
            e.0 += 1;
            e.1 += r.len_bytes;
        }
        let pools = stats
            .pools
            .iter()
            .take(proto::MAX_POOLS)
            .map(|p| {
                let mut owners: Vec<_> = by_owner
                    .iter()
                    .filter(|((pool, _), _)| *pool == p.pool)
                    .map(|((_, d), (regions, bytes))| (*d, *regions, *bytes))
                    .collect();
                // The largest holders first, when they do not all fit.
                owners.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
                PoolUsage {
                    pool: p.pool.0,
                    total_bytes: p.capacity_bytes,
                    free_bytes: p.free_bytes,
                    largest_free_bytes: p.largest_free_bytes,
                    regions: p.regions,
                    owners: owners
                        .into_iter()
                        .take(MAX_POOL_OWNERS)
                        .map(|(d, regions, bytes)| OwnerUsage {
                            directory_id: self.names.display(NameKind::Directory, d.0),
                            regions,
                            bytes,
                        })
                        .collect(),
                }
            })
            .collect();
        PoolStatsReply {
            manager_epoch: self.pools.iter().map(OpenPool::epoch).max().unwrap_or(0),
            pools,
        }
    }
}

fn from_cached(c: Cached) -> Result<PoolReply, PoolServiceError> {
    match c {
        Cached::Allocated(h) => Ok(PoolReply::Allocated(h)),
        Cached::Freed { region } => Ok(PoolReply::Freed { region }),
        Cached::Failed(e) => Err(e),
    }
}

/// The wire form of a manager handle, with the owner's names.
fn wire_handle(h: &Handle, directory: &str, instance: &str) -> RegionHandle {
    RegionHandle {
        region: h.region.0,
        pool: h.pool.0,
        offset_bytes: h.offset_bytes,
        len_bytes: h.len_bytes,
        owner: proto::OwnerLabel {
            directory_id: directory.to_owned(),
            instance_id: instance.to_owned(),
        },
        token: RegionToken(h.token.0),
    }
}

/// The manager form of a wire handle: names become ids.
fn manager_handle(h: &RegionHandle) -> Handle {
    Handle {
        region: RegionId(h.region),
        pool: PoolId(h.pool),
        offset_bytes: h.offset_bytes,
        len_bytes: h.len_bytes,
        owner: OwnerLabel {
            directory: names::directory_id(&h.owner.directory_id),
            instance: names::instance_id(&h.owner.instance_id),
        },
        token: Token(h.token.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::service::PoolSpec;
    use crate::pool::{StoreConfig, SyncPolicy};

    fn config(dir: &std::path::Path, sync: SyncPolicy) -> ServiceConfig {
        ServiceConfig {
            pools: vec![PoolSpec {
                path: dir.join("pool"),
                create_size_bytes: Some(16 << 20),
                align_bytes: Some(4096),
                visibility: None,
            }],
            state_dir: dir.join("state"),
            store: StoreConfig {
                sync,
                checkpoint_every_records: 4096,
            },
            grace_ms: 60_000,
            lease_ms: 10_000,
            pass_fds: false,
            tcp_auth: TcpAuth::Disabled,
            io_faults: Default::default(),
        }
    }

    type Log = Arc<Mutex<Vec<(&'static str, u64, Result<PoolReply, PoolServiceError>)>>>;

    /// Queues `ops` (after a hello) and a stop *before* the core runs, so the
    /// core sees them all ready at once; runs it on this thread. Returns, per
    /// answer in release order: its label, the commits done when it was
    /// released, and the answer.
    fn run_batch(
        sync: SyncPolicy,
        ops: Vec<(&'static str, Op)>,
    ) -> Vec<(&'static str, u64, Result<PoolReply, PoolServiceError>)> {
        let dir = tempfile::Builder::new()
            .prefix("cxlkv-core-")
            .tempdir_in("/dev/shm")
            .unwrap();
        let (core, link, rx) = Core::open(config(dir.path(), sync)).unwrap();
        let session = link.new_session();
        assert!(link.open(
            session,
            Caller::Remote {
                connection: session
            },
            SessionTransport::InProcess
        ));
        let log: Log = Arc::new(Mutex::new(Vec::new()));
        let hello = Op::Hello {
            protocol_min: 1,
            protocol_max: 1,
            directory_id: "dir-a".into(),
            secret: None,
        };
        for (label, op) in std::iter::once(("hello", hello)).chain(ops) {
            let log = Arc::clone(&log);
            let shared = Arc::clone(&link.shared);
            let done: super::super::PoolCallback = Box::new(move |r| {
                let commits = shared.counters.commits.load(Ordering::Relaxed);
                log.lock().push((label, commits, r));
            });
            link.request(session, op, ReplyTo::Callback(Callback::new(done)))
                .unwrap();
        }
        link.tx.send(Command::Stop).unwrap();
        core.run(rx).unwrap();
        std::mem::take(&mut *log.lock())
    }

    fn alloc(seq: u64) -> Op {
        Op::Alloc {
            seq,
            pool: None,
            len_bytes: 4096,
            directory_id: None,
            instance_id: "inst".into(),
        }
    }

    fn labels_and_commits(
        log: &[(&'static str, u64, Result<PoolReply, PoolServiceError>)],
    ) -> Vec<(&'static str, u64)> {
        log.iter().map(|(l, c, _)| (*l, *c)).collect()
    }

    #[test]
    fn group_commit_releases_every_ready_reply_after_one_sync_in_order() {
        let log = run_batch(
            SyncPolicy::Group {
                max_batch_records: 64,
            },
            vec![("a1", alloc(1)), ("stats", Op::Stats), ("a2", alloc(2))],
        );
        // The stats reply pushed nothing but follows a pending record: it
        // waits for the same commit.
        assert_eq!(
            labels_and_commits(&log),
            [("hello", 0), ("a1", 1), ("stats", 1), ("a2", 1)]
        );
        assert!(log.iter().all(|(_, _, r)| r.is_ok()));
    }

    #[test]
    fn per_record_sync_commits_each_mutation_and_answers_reads_at_once() {
        let log = run_batch(
            SyncPolicy::PerRecord,
            vec![("a1", alloc(1)), ("stats", Op::Stats), ("a2", alloc(2))],
        );
        assert_eq!(
            labels_and_commits(&log),
            [("hello", 0), ("a1", 1), ("stats", 1), ("a2", 2)]
        );
    }

    #[test]
    fn a_retry_in_the_same_group_is_answered_from_the_cache_after_the_commit() {
        let log = run_batch(
            SyncPolicy::Group {
                max_batch_records: 64,
            },
            vec![("a1", alloc(1)), ("retry", alloc(1))],
        );
        assert_eq!(
            labels_and_commits(&log),
            [("hello", 0), ("a1", 1), ("retry", 1)]
        );
        match (&log[1].2, &log[2].2) {
            (Ok(PoolReply::Allocated(a)), Ok(PoolReply::Allocated(b))) => assert_eq!(a, b),
            other => panic!("expected two equal allocations, got {other:?}"),
        }
    }

    #[test]
    fn a_full_group_commits_before_the_queue_is_drained() {
        let ops = (1..=5).map(|s| ("a", alloc(s))).collect();
        let log = run_batch(
            SyncPolicy::Group {
                max_batch_records: 2,
            },
            ops,
        );
        let commits: Vec<u64> = log.iter().skip(1).map(|(_, c, _)| *c).collect();
        assert_eq!(commits, [1, 1, 2, 2, 3]);
    }

    /// The instant `refuse_queued` cannot cover: a front end that checked
    /// `stopped` just before the core set it sends after the core's last
    /// drain, and the request goes down with the queue. Its callback is
    /// still answered, once, with the stopped error.
    #[test]
    fn a_request_dropped_with_a_stopped_cores_queue_is_answered_stopped_once() {
        let (tx, rx) = mpsc::channel();
        let answers = Arc::new(Mutex::new(Vec::new()));
        let done: super::super::PoolCallback = {
            let answers = Arc::clone(&answers);
            Box::new(move |r| answers.lock().push(r))
        };
        tx.send(Command::Request {
            session: 1,
            op: Op::Stats,
            reply: ReplyTo::Callback(Callback::new(done)),
        })
        .unwrap();
        drop(rx);
        let answers = answers.lock();
        assert_eq!(answers.len(), 1, "answered exactly once");
        let e = answers[0].as_ref().expect_err("answered with an error");
        assert_eq!(e.error_code(), Some(ErrorCode::Internal));
        assert!(e.to_string().contains("stopped"), "{e}");
    }

    /// An answered callback is not answered again when it is dropped.
    #[test]
    fn a_called_callback_is_not_called_again_on_drop() {
        let calls = Arc::new(AtomicU64::new(0));
        let cb = {
            let calls = Arc::clone(&calls);
            Callback::new(Box::new(move |r| {
                assert!(r.is_ok(), "the answer given, not the drop's");
                calls.fetch_add(1, Ordering::Relaxed);
            }))
        };
        cb.call(Ok(PoolReply::Freed { region: 7 }));
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn requests_queued_behind_a_stop_get_an_error_exactly_once() {
        let dir = tempfile::Builder::new()
            .prefix("cxlkv-core-")
            .tempdir_in("/dev/shm")
            .unwrap();
        let (core, link, rx) = Core::open(config(dir.path(), SyncPolicy::PerRecord)).unwrap();
        let session = link.new_session();
        assert!(link.open(
            session,
            Caller::Remote {
                connection: session
            },
            SessionTransport::InProcess
        ));
        link.tx.send(Command::Stop).unwrap();
        let answers = Arc::new(Mutex::new(Vec::new()));
        for seq in 1..=3 {
            let answers = Arc::clone(&answers);
            let done: super::super::PoolCallback = Box::new(move |r| answers.lock().push(r));
            link.request(session, alloc(seq), ReplyTo::Callback(Callback::new(done)))
                .unwrap();
        }
        let report = core.run(rx).unwrap();
        let answers = answers.lock();
        assert_eq!(answers.len(), 3);
        assert!(answers.iter().all(|r| {
            r.as_ref()
                .is_err_and(|e| e.error_code() == Some(ErrorCode::Internal))
        }));
        assert!(link.shared.failure.lock().is_none());
        // Nothing ran: the stop came first.
        assert_eq!(report.committed_seq, 2, "only the pool's own records");
        let done: super::super::PoolCallback = Box::new(|r| {
            assert!(r.is_err(), "a stopped core refuses at once");
        });
        assert!(
            link.request(session, Op::Stats, ReplyTo::Callback(Callback::new(done)))
                .is_err()
        );
    }

    #[test]
    fn requests_before_the_hello_and_foreign_owners_are_refused_without_effect() {
        let dir = tempfile::Builder::new()
            .prefix("cxlkv-core-")
            .tempdir_in("/dev/shm")
            .unwrap();
        let (mut core, link, _rx) = Core::open(config(dir.path(), SyncPolicy::PerRecord)).unwrap();
        let session = link.new_session();
        core.handle(Command::Open {
            session,
            caller: Caller::Remote { connection: 1 },
            transport: SessionTransport::InProcess,
        })
        .unwrap();
        let now = core.now();
        let e = core.execute(session, alloc(1), now).unwrap_err();
        assert_eq!(e.error_code(), Some(ErrorCode::HelloRequired));
        assert!(
            core.execute(session, Op::Stats, now).is_ok(),
            "stats need no hello"
        );
        core.execute(
            session,
            Op::Hello {
                protocol_min: 1,
                protocol_max: 1,
                directory_id: "dir-a".into(),
                secret: None,
            },
            now,
        )
        .unwrap();
        let e = core
            .execute(
                session,
                Op::Alloc {
                    seq: 1,
                    pool: None,
                    len_bytes: 4096,
                    directory_id: Some("dir-b".into()),
                    instance_id: "i".into(),
                },
                now,
            )
            .unwrap_err();
        assert_eq!(e.error_code(), Some(ErrorCode::NotOwner));
        assert_eq!(core.store.journal_ref().pending_records(), 0);
        // Refused before the state machine: the seq was not consumed.
        assert!(core.execute(session, alloc(1), now).is_ok());
    }
}
