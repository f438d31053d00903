//! [`RemotePool`]: the [`PoolService`] of a directory whose pool manager is
//! a `cxlkv pool` daemon, over one pipelined [`RpcClient`] connection.
//!
//! One driver thread owns the connection. It takes submitted requests (up
//! to `max_inflight` at once), sends them pipelined, and waits for the
//! replies in submission order (the daemon releases them in that order) —
//! requests submitted while it waits are sent with the next batch, which is
//! what lets the daemon's group commit share one `fdatasync` among them.
//!
//! **Retries (exactly-once).** Mutating requests carry a `seq` taken at
//! submission from a counter that starts at the welcome's `last_seq + 1`.
//! A request whose reply is lost — a deadline passes, or the connection
//! breaks — is resent with the **same** `seq` (the daemon's reply cache, or
//! after a daemon restart its allocation tags, answer it exactly once),
//! until `retry_window_ms` after its submission; `Busy` is retried the same
//! way. Then it fails with `Timeout`.
//!
//! **Abandoned allocations.** An `AllocRegion` that times out may still
//! have run: its reply, not the request, may be what was lost. Its caller
//! is answered `Timeout` and takes it as refused, so a region allocated
//! anyway would belong to nobody until this directory's session ended. The
//! driver therefore keeps resending such an allocation (same `seq`, in its
//! place in `seq` order, with no deadline) until the daemon answers it; an
//! answer that allocated is freed at once with a `FreeRegion` of its own
//! (also resent until answered). At most [`MAX_ABANDONED`] are kept; one
//! more is logged and left to the session's end.
//!
//! **Pings.** With nothing to send for `ping_ms` (5 s), the driver sends a
//! `PoolStats`: the daemon closes connections silent for its idle timeout
//! (30 s), which is how it notices a directory host gone without closing,
//! and a daemon gone that way is noticed here (the ping times out).
//!
//! **Reconnect.** When the connection breaks, the driver reconnects (a pause
//! of `reconnect_backoff_ms` between attempts), sends `PoolHello` again and
//! then `ReattachRegions` with every region this session holds — those it
//! allocated or reattached and whose free was not answered (freed, gone or
//! refused for good: the directory dropped it) — so a restarted daemon does
//! not reclaim them after its grace period; then it resends the requests in
//! flight, in `seq` order. A region the reattach is refused that this
//! session is not freeing — the daemon reclaimed it, because the directory
//! was unreachable for longer than its grace period (or the daemon
//! restarted and the grace passed before the reconnect), or lost it — ends
//! the session as a changed pool list does (below): the daemon may grant
//! those bytes again while the directory's keys still point into them, and
//! only a directory restart drops those keys (clients presenting the region
//! are told `NotOwned`). Descriptors from the first welcome stay valid
//! across daemon restarts (they are open descriptions of the same pool
//! files); those of later welcomes are dropped.
//!
//! **A daemon back with other pools.** The directory announced the first
//! welcome's pools to its clients and passed them its descriptors, and
//! keeps no way to tell them of another list. If a reconnect's welcome
//! lists other pools — one added, removed, or a different pool (UUID, size,
//! alignment, kind or visibility) at an index — the driver stops there, before
//! reattaching: every request in flight and every later one is refused
//! (`SessionEnded`), and [`PoolService::failure`] says why, so the
//! directory server exits and its restart (a directory restart: clients
//! reattach) starts from the pools the daemon serves now. A changed path
//! alone (a device renumbered, the same UUID) is not a change: the pool is
//! the same.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::wire::encode_payload;
use super::{PoolCallback, PoolReply, PoolRequest, PoolService, PoolServiceError, PoolSession};
use crate::frame::Frame;
use crate::proto::{
    self, AllocRegion, ErrorCode, FreeRegion, ListRegions, MAX_REATTACH_REGIONS, Message,
    OwnerLabel, PROTOCOL_MAX, PROTOCOL_MIN, PoolHello, PoolInfo, PoolStats, PoolStatsReply,
    PoolWelcome, ProtoError, ReattachRegions, RefusedRegion, RegionAllocated, RegionFreed,
    RegionHandle, RegionList, RegionsReattached, RequestMeta,
};
use crate::transport::{ClientConfig, ClientError, Endpoint, PendingCall, RpcClient};

/// How to reach the daemon and how hard to try. Its `Debug` form says
/// whether a secret is set, never what it is.
#[derive(Clone)]
pub struct RemoteConfig {
    pub endpoint: Endpoint,
    /// This directory's stable name (`PoolHello.directory_id`).
    pub directory_id: String,
    /// The pool secret, for TCP listeners that require it.
    pub secret: Option<Vec<u8>>,
    pub client: ClientConfig,
    /// Deadline of one attempt of one request.
    pub request_timeout_ms: u64,
    /// How long after its submission a request is retried before it fails
    /// with `Timeout`.
    pub retry_window_ms: u64,
    /// Pause between reconnection attempts (and `Busy` retries).
    pub reconnect_backoff_ms: u64,
    /// Requests submitted and not answered; more are answered `Busy` at once.
    pub max_queued: usize,
    /// Requests on the wire at once.
    pub max_inflight: usize,
    /// With nothing else to send for this long, send a `PoolStats`: the
    /// daemon closes a connection silent for its idle timeout
    /// ([`IDLE_TIMEOUT_MS`](super::IDLE_TIMEOUT_MS), 30 s), and a daemon
    /// gone without closing is noticed (the ping times out, the driver
    /// reconnects). Well under the daemon's idle timeout.
    pub ping_ms: u64,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured whole, so that a new field cannot be left out.
        let Self {
            endpoint,
            directory_id,
            secret,
            client,
            request_timeout_ms,
            retry_window_ms,
            reconnect_backoff_ms,
            max_queued,
            max_inflight,
            ping_ms,
        } = self;
        f.debug_struct("RemoteConfig")
            .field("endpoint", endpoint)
            .field("directory_id", directory_id)
            .field("secret", &secret.as_ref().map(|_| crate::Redacted))
            .field("client", client)
            .field("request_timeout_ms", request_timeout_ms)
            .field("retry_window_ms", retry_window_ms)
            .field("reconnect_backoff_ms", reconnect_backoff_ms)
            .field("max_queued", max_queued)
            .field("max_inflight", max_inflight)
            .field("ping_ms", ping_ms)
            .finish()
    }
}

impl RemoteConfig {
    pub fn new(endpoint: Endpoint, directory_id: impl Into<String>) -> Self {
        Self {
            endpoint,
            directory_id: directory_id.into(),
            secret: None,
            client: ClientConfig::default(),
            request_timeout_ms: 10_000,
            retry_window_ms: 60_000,
            reconnect_backoff_ms: 200,
            max_queued: 4096,
            max_inflight: 128,
            ping_ms: 5_000,
        }
    }
}

/// Abandoned requests (see the module essay) kept at once.
pub const MAX_ABANDONED: usize = 64;

struct Submission {
    seq: u64,
    request: PoolRequest,
    done: PoolCallback,
    submitted: Instant,
}

struct Shared {
    welcome: Mutex<PoolWelcome>,
    closing: AtomicBool,
    /// Set once, by the driver, when the daemon came back with other pools
    /// (module docs); the driver has stopped by then.
    failure: Mutex<Option<String>>,
}

/// The remote [`PoolService`] (see the module essay).
pub struct RemotePool {
    tx: Option<mpsc::SyncSender<Submission>>,
    /// Shared with the driver, which takes a `seq` for the frees that undo
    /// abandoned allocations.
    next_seq: Arc<Mutex<u64>>,
    shared: Arc<Shared>,
    join: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RemotePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemotePool").finish_non_exhaustive()
    }
}

fn client_error(e: &ClientError) -> PoolServiceError {
    let code = match e {
        ClientError::Timeout { .. } => ErrorCode::Timeout,
        ClientError::TooManyInFlight { .. } => ErrorCode::Busy,
        _ => ErrorCode::Internal,
    };
    PoolServiceError::new(code, format!("pool manager unreachable: {e}"), 0)
}

/// A session opened on `client`: the welcome and its descriptors.
fn hello(client: &RpcClient, cfg: &RemoteConfig) -> Result<PoolSession, PoolServiceError> {
    let msg = PoolHello {
        meta: RequestMeta::default(),
        protocol_min: PROTOCOL_MIN,
        protocol_max: PROTOCOL_MAX,
        directory_id: cfg.directory_id.clone(),
        secret: cfg.secret.clone(),
    };
    let mut scratch = Vec::new();
    let payload = encode_payload(&msg, &mut scratch)
        .map_err(|e| PoolServiceError::from(e.to_reply()))?
        .to_vec();
    let timeout = Duration::from_millis(cfg.request_timeout_ms);
    let mut reply = client
        .call(PoolHello::KIND.as_u16(), &payload, timeout)
        .map_err(|e| client_error(&e))?;
    let welcome: PoolWelcome = decode(&reply)?;
    let fds = std::mem::take(&mut reply.fds);
    // Only the welcome carries descriptors (RpcClient::decline_fds).
    client.decline_fds();
    if fds.len() != welcome.fds_passed as usize {
        return Err(PoolServiceError::new(
            ErrorCode::Malformed,
            format!(
                "the welcome announced {} descriptors, {} arrived",
                welcome.fds_passed,
                fds.len()
            ),
            0,
        ));
    }
    Ok(PoolSession { welcome, fds })
}

/// The expected reply `M`, or the daemon's error.
fn decode<M: Message>(reply: &crate::transport::Reply) -> Result<M, PoolServiceError> {
    let frame = Frame {
        header: reply.header,
        payload: reply.payload(),
    };
    let to_err = |e: ProtoError| {
        PoolServiceError::new(
            ErrorCode::Malformed,
            format!("bad reply from the pool manager: {e}"),
            0,
        )
    };
    match proto::access_reply::<M>(frame).map_err(to_err)? {
        Ok(archived) => proto::deserialize::<M>(archived).map_err(to_err),
        Err(e) => Err(PoolServiceError {
            code: e.code(),
            message: e.message().to_owned(),
            limit: e.limit(),
        }),
    }
}

impl RemotePool {
    /// Connects, says `PoolHello`, and starts the driver. Fails if the daemon
    /// is unreachable now (later outages are ridden out, see the essay).
    pub fn connect(cfg: RemoteConfig) -> Result<(Self, PoolSession), PoolServiceError> {
        if cfg.max_inflight == 0 || cfg.max_queued == 0 || cfg.ping_ms == 0 {
            return Err(PoolServiceError::new(
                ErrorCode::InvalidArgument,
                "max_inflight, max_queued and ping_ms must be positive",
                0,
            ));
        }
        let client =
            RpcClient::connect(&cfg.endpoint, cfg.client.clone()).map_err(|e| client_error(&e))?;
        let session = hello(&client, &cfg)?;
        let shared = Arc::new(Shared {
            welcome: Mutex::new(session.welcome.clone()),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let (tx, rx) = mpsc::sync_channel(cfg.max_queued);
        let next_seq = Arc::new(Mutex::new(session.welcome.last_seq.saturating_add(1)));
        let driver = Driver {
            client: Some(client),
            cfg,
            rx,
            flights: VecDeque::new(),
            abandoned: 0,
            next_seq: Arc::clone(&next_seq),
            held: BTreeMap::new(),
            shared: Arc::clone(&shared),
            scratch: Vec::new(),
        };
        let join = std::thread::Builder::new()
            .name("cxlkv-pool-client".into())
            .spawn(move || driver.run())
            .map_err(|e| {
                PoolServiceError::new(
                    ErrorCode::Internal,
                    format!("cannot start a thread: {e}"),
                    0,
                )
            })?;
        Ok((
            Self {
                tx: Some(tx),
                next_seq,
                shared,
                join: Some(join),
            },
            session,
        ))
    }
}

impl PoolService for RemotePool {
    fn submit(&self, request: PoolRequest, done: PoolCallback) {
        let Some(tx) = &self.tx else {
            done(Err(PoolServiceError::new(
                ErrorCode::SessionEnded,
                "the pool session is closed",
                0,
            )));
            return;
        };
        let mut next = self.next_seq.lock();
        let mutating = request.is_mutating();
        let sub = Submission {
            seq: if mutating { *next } else { 0 },
            request,
            done,
            submitted: Instant::now(),
        };
        match tx.try_send(sub) {
            Ok(()) => {
                if mutating {
                    *next += 1;
                }
            }
            Err(mpsc::TrySendError::Full(sub)) => {
                drop(next);
                (sub.done)(Err(PoolServiceError::new(
                    ErrorCode::Busy,
                    "too many pool requests queued in this process",
                    0,
                )));
            }
            Err(mpsc::TrySendError::Disconnected(sub)) => {
                drop(next);
                (sub.done)(Err(PoolServiceError::new(
                    ErrorCode::SessionEnded,
                    "the pool session's driver has stopped",
                    0,
                )));
            }
        }
    }

    fn welcome(&self) -> PoolWelcome {
        self.shared.welcome.lock().clone()
    }

    fn failure(&self) -> Option<String> {
        self.shared.failure.lock().clone()
    }
}

/// Why the directory must stop when a reattach was refused regions it
/// holds and is not freeing: the pool manager reclaimed them (this
/// directory was unreachable for longer than its grace period, or it
/// restarted and the grace passed before the reconnect) or lost them, and
/// may grant their bytes again — while this directory still lets keys
/// point into them. A directory restart recovers: the regions are no
/// longer listed, so clients presenting them are told `NotOwned` and drop
/// their keys.
fn lost_regions_text(endpoint: &Endpoint, lost: &[RefusedRegion]) -> String {
    const SHOWN: usize = 8;
    let named: Vec<String> = lost
        .iter()
        .take(SHOWN)
        .map(|r| {
            let code = ErrorCode::from_u16(r.code).map_or("unknown code", ErrorCode::name);
            format!("{} ({code})", r.region)
        })
        .collect();
    let more = match lost.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    format!(
        "the pool manager at {endpoint} no longer gives this directory {} region(s) it holds: {}{more}; it reclaimed them (this directory was unreachable for longer than the pool manager's grace period) or lost them, and may grant their bytes again: this directory must restart (its clients reattach, and keys in those regions are dropped)",
        lost.len(),
        named.join(", ")
    )
}

/// How `now` differs from `before` as a list of pools (module docs: a
/// changed path alone is no change), or `None`.
fn pool_list_change(before: &[PoolInfo], now: &[PoolInfo]) -> Option<String> {
    let same = |a: &PoolInfo, b: &PoolInfo| {
        (
            a.pool,
            a.uuid,
            a.size_bytes,
            a.align_bytes,
            a.kind,
            a.visibility,
        ) == (
            b.pool,
            b.uuid,
            b.size_bytes,
            b.align_bytes,
            b.kind,
            b.visibility,
        )
    };
    if before.len() == now.len() && before.iter().zip(now).all(|(a, b)| same(a, b)) {
        return None;
    }
    let describe = |pools: &[PoolInfo]| {
        let list: Vec<String> = pools
            .iter()
            .map(|p| format!("{} ({}, {} bytes)", p.pool, p.path, p.size_bytes))
            .collect();
        format!("[{}]", list.join(", "))
    };
    Some(format!(
        "pools {} instead of {}",
        describe(now),
        describe(before)
    ))
}

impl Drop for RemotePool {
    /// Fails what is still queued (`SessionEnded`) and stops the driver; may
    /// wait for the driver's step in progress: one request attempt
    /// (`request_timeout_ms`) or one reconnection (backoff, connect, hello,
    /// and a `request_timeout_ms` per reattach chunk).
    fn drop(&mut self) {
        // Release/Acquire: nothing else is published with the flag; the
        // dropped sender tells the driver the same thing through the channel.
        self.shared.closing.store(true, Ordering::Release);
        self.tx = None;
        if let Some(join) = self.join.take()
            && join.join().is_err()
        {
            tracing::error!("the pool client driver panicked");
        }
    }
}

struct Flight {
    sub: Submission,
    kind: u16,
    payload: Vec<u8>,
    call: Option<PendingCall>,
    /// Do not resend before this (after `Busy`).
    not_before: Option<Instant>,
    /// Its caller was answered already (see "Abandoned allocations"): it
    /// is resent until the daemon answers, with no deadline.
    abandoned: bool,
}

struct Driver {
    cfg: RemoteConfig,
    client: Option<RpcClient>,
    rx: mpsc::Receiver<Submission>,
    flights: VecDeque<Flight>,
    /// How many of `flights` are abandoned (at most [`MAX_ABANDONED`]);
    /// they do not count against `max_inflight` when taking submissions.
    abandoned: usize,
    next_seq: Arc<Mutex<u64>>,
    /// Regions this session holds: re-presented after a reconnect.
    held: BTreeMap<u64, RegionHandle>,
    shared: Arc<Shared>,
    scratch: Vec<u8>,
}

/// What became of a flight's attempt.
enum Outcome {
    Done(Result<PoolReply, PoolServiceError>),
    Resend { after_busy: bool },
    Broken,
}

impl Driver {
    fn run(mut self) {
        let mut open = true;
        loop {
            if self.shared.closing.load(Ordering::Acquire) {
                self.fail_all("the pool session was closed");
                return;
            }
            let failure = self.shared.failure.lock().clone();
            if let Some(why) = failure {
                // The queue is emptied and closed under the lock `submit`
                // holds across its send, so that no submission lands in a
                // receiver about to be dropped (its callback would never
                // run); later ones find it closed (`SessionEnded`). The
                // callbacks run after, outside the lock: one may submit.
                let queued: Vec<Submission> = {
                    let _submit = self.next_seq.lock();
                    let queued = std::iter::from_fn(|| self.rx.try_recv().ok()).collect();
                    let (_, closed) = mpsc::sync_channel(1);
                    drop(std::mem::replace(&mut self.rx, closed));
                    queued
                };
                self.fail_all(&why);
                for sub in queued {
                    (sub.done)(Err(PoolServiceError::new(ErrorCode::SessionEnded, &why, 0)));
                }
                return;
            }
            if self.flights.is_empty() {
                if !open {
                    return;
                }
                match self
                    .rx
                    .recv_timeout(Duration::from_millis(self.cfg.ping_ms))
                {
                    Ok(sub) => self.push(sub),
                    Err(mpsc::RecvTimeoutError::Timeout) => self.push(Submission {
                        seq: 0,
                        request: PoolRequest::Stats,
                        done: Box::new(drop),
                        submitted: Instant::now(),
                    }),
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while open && self.flights.len() - self.abandoned < self.cfg.max_inflight {
                match self.rx.try_recv() {
                    Ok(sub) => self.push(sub),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            self.expire();
            if self.flights.is_empty() {
                continue;
            }
            if self.client.as_ref().is_none_or(RpcClient::is_closed) && !self.reconnect() {
                continue;
            }
            if !self.send_unsent() {
                self.lose_connection("a request could not be sent");
                continue;
            }
            self.wait_front();
        }
    }

    fn push(&mut self, sub: Submission) {
        let meta = RequestMeta {
            seq: sub.seq,
            ..RequestMeta::default()
        };
        let dir = self.cfg.directory_id.clone();
        let encoded = match &sub.request {
            PoolRequest::Alloc {
                pool,
                len_bytes,
                instance_id,
            } => self.encode(&AllocRegion {
                meta,
                pool: *pool,
                len_bytes: *len_bytes,
                owner: OwnerLabel {
                    directory_id: dir,
                    instance_id: instance_id.clone(),
                },
            }),
            PoolRequest::Free { region, token } => self.encode(&FreeRegion {
                meta,
                region: *region,
                token: *token,
            }),
            PoolRequest::Reattach { handles } => self.encode(&ReattachRegions {
                meta,
                handles: handles.clone(),
            }),
            PoolRequest::List {
                after_region,
                max_handles,
            } => self.encode(&ListRegions {
                meta,
                after_region: *after_region,
                max_handles: *max_handles,
            }),
            PoolRequest::Stats => self.encode(&PoolStats { meta }),
        };
        match encoded {
            Ok((kind, payload)) => self.flights.push_back(Flight {
                sub,
                kind,
                payload,
                call: None,
                not_before: None,
                abandoned: false,
            }),
            Err(e) => (sub.done)(Err(e)),
        }
    }

    fn encode<M: Message>(&mut self, msg: &M) -> Result<(u16, Vec<u8>), PoolServiceError> {
        let payload = encode_payload(msg, &mut self.scratch)
            .map_err(|e| PoolServiceError::from(e.to_reply()))?;
        Ok((M::KIND.as_u16(), payload.to_vec()))
    }

    /// Fails the flights whose retry window has passed, on the wire or not
    /// (only the front one is waited for: one behind an abandoned
    /// allocation would otherwise wait as long as the daemon stays silent);
    /// an allocation among them stays, abandoned (see the module essay),
    /// while there is room.
    fn expire(&mut self) {
        let window = Duration::from_millis(self.cfg.retry_window_ms);
        let now = Instant::now();
        let mut keep = VecDeque::with_capacity(self.flights.len());
        for mut f in self.flights.drain(..) {
            if f.abandoned || now < f.sub.submitted + window {
                keep.push_back(f);
                continue;
            }
            let done = std::mem::replace(&mut f.sub.done, Box::new(drop));
            done(Err(PoolServiceError::new(
                ErrorCode::Timeout,
                format!(
                    "no answer from the pool manager within {} ms (retried)",
                    self.cfg.retry_window_ms
                ),
                self.cfg.retry_window_ms,
            )));
            if !matches!(f.sub.request, PoolRequest::Alloc { .. }) {
                continue;
            }
            if self.abandoned < MAX_ABANDONED {
                tracing::warn!(
                    seq = f.sub.seq,
                    "an allocation timed out; resending it until the pool manager answers, to free what it allocated"
                );
                f.abandoned = true;
                self.abandoned += 1;
                keep.push_back(f);
            } else {
                tracing::error!(
                    seq = f.sub.seq,
                    max = MAX_ABANDONED,
                    "an allocation timed out with too many abandoned ones pending; a region it allocated stays held until this directory's session ends"
                );
            }
        }
        self.flights = keep;
    }

    /// Queues a free of `handle`, allocated by an abandoned request. It
    /// takes the next `seq` (so it may travel ahead of submissions still in
    /// the channel; the daemon's reply cache takes `seq`s in any order).
    fn undo(&mut self, handle: RegionHandle) {
        let region = handle.region;
        let mut next = self.next_seq.lock();
        let sub = Submission {
            seq: *next,
            request: PoolRequest::Free {
                region,
                token: handle.token,
            },
            done: Box::new(move |r| match r {
                Ok(_) => tracing::info!(region, "freed the region of an abandoned allocation"),
                Err(e) => {
                    tracing::error!(region, error = %e, "cannot free the region of an abandoned allocation")
                }
            }),
            submitted: Instant::now(),
        };
        *next += 1;
        drop(next);
        let before = self.flights.len();
        self.push(sub);
        if self.flights.len() > before
            && let Some(f) = self.flights.back_mut()
        {
            f.abandoned = true;
            self.abandoned += 1;
        }
    }

    fn fail_all(&mut self, why: &str) {
        let err = || PoolServiceError::new(ErrorCode::SessionEnded, why, 0);
        self.abandoned = 0;
        for f in self.flights.drain(..) {
            (f.sub.done)(Err(err()));
        }
        while let Ok(sub) = self.rx.try_recv() {
            (sub.done)(Err(err()));
        }
    }

    /// Drops the connection, saying so once, where the loss is noticed (a
    /// send that failed, a closed connection met by a wait or found by
    /// `reconnect`): the warning used to be given only in `reconnect`,
    /// which found the connection already dropped by the other two — a
    /// pool manager killed under the server was logged only as
    /// "reconnected", seconds later.
    fn lose_connection(&mut self, why: &str) {
        if self.client.take().is_some() {
            tracing::warn!(endpoint = %self.cfg.endpoint, why, "connection to the pool manager lost; reconnecting");
        }
    }

    /// One reconnection attempt (after the backoff): hello, reattach, and
    /// every flight marked for resending. False when it failed.
    fn reconnect(&mut self) -> bool {
        let backoff = Duration::from_millis(self.cfg.reconnect_backoff_ms);
        self.lose_connection("the connection closed");
        for f in &mut self.flights {
            f.call = None;
        }
        std::thread::sleep(backoff);
        let client = match RpcClient::connect(&self.cfg.endpoint, self.cfg.client.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "pool manager not reachable yet");
                return false;
            }
        };
        let session = match hello(&client, &self.cfg) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "pool manager refused the hello after a reconnect");
                return false;
            }
        };
        let before = self.shared.welcome.lock().pools.clone();
        if let Some(change) = pool_list_change(&before, &session.welcome.pools) {
            let why = format!(
                "the pool manager at {} came back serving {change}: this directory must restart to serve them (its clients reattach)",
                self.cfg.endpoint
            );
            tracing::error!("{why}");
            *self.shared.failure.lock() = Some(why);
            return false;
        }
        if !self.reattach(&client) {
            return false;
        }
        tracing::info!(
            endpoint = %self.cfg.endpoint,
            manager_epoch = session.welcome.manager_epoch,
            regions = self.held.len(),
            "reconnected to the pool manager"
        );
        *self.shared.welcome.lock() = session.welcome;
        self.client = Some(client);
        true
    }

    fn reattach(&mut self, client: &RpcClient) -> bool {
        let handles: Vec<RegionHandle> = self.held.values().cloned().collect();
        let timeout = Duration::from_millis(self.cfg.request_timeout_ms);
        for chunk in handles.chunks(MAX_REATTACH_REGIONS) {
            let msg = ReattachRegions {
                meta: RequestMeta::default(),
                handles: chunk.to_vec(),
            };
            let Ok((kind, payload)) = self.encode(&msg) else {
                return false;
            };
            let reply = match client.call(kind, &payload, timeout) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "reattach after a reconnect failed");
                    return false;
                }
            };
            match decode::<RegionsReattached>(&reply) {
                Ok(r) => {
                    let mut lost = Vec::new();
                    for refused in r.refused {
                        self.held.remove(&refused.region);
                        if self.freeing(refused.region) {
                            // Gone either way (its free ran before the
                            // connection broke, or the daemon reclaimed it):
                            // the free, resent, is told `UnknownRegion`,
                            // which the directory takes as done.
                            tracing::info!(
                                region = refused.region,
                                "a region being freed was already gone on reattach"
                            );
                        } else {
                            lost.push(refused);
                        }
                    }
                    if !lost.is_empty() {
                        let why = lost_regions_text(&self.cfg.endpoint, &lost);
                        tracing::error!("{why}");
                        *self.shared.failure.lock() = Some(why);
                        return false;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reattach after a reconnect refused");
                    return false;
                }
            }
        }
        true
    }

    /// Whether a free of `region` is in flight (taken from the submission
    /// queue: on the wire, or waiting to be resent). One still in the queue
    /// is not seen: a refusal racing it ends the session, a restart that
    /// was not needed but loses nothing.
    fn freeing(&self, region: u64) -> bool {
        self.flights
            .iter()
            .any(|f| matches!(f.sub.request, PoolRequest::Free { region: r, .. } if r == region))
    }

    /// Starts every flight not on the wire. False when the connection broke.
    fn send_unsent(&mut self) -> bool {
        let Some(client) = self.client.clone() else {
            return false;
        };
        let timeout = Duration::from_millis(self.cfg.request_timeout_ms);
        let now = Instant::now();
        for f in &mut self.flights {
            if f.call.is_some() || f.not_before.is_some_and(|t| now < t) {
                continue;
            }
            match client.start(f.kind, &f.payload, timeout) {
                Ok(call) => {
                    f.call = Some(call);
                    f.not_before = None;
                }
                Err(ClientError::TooManyInFlight { .. }) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "sending to the pool manager failed");
                    return false;
                }
            }
        }
        true
    }

    /// Waits for the oldest flight's reply and acts on it.
    fn wait_front(&mut self) {
        let Some(front) = self.flights.front_mut() else {
            return;
        };
        let Some(call) = front.call.take() else {
            // Held back after `Busy` (or the client's own in-flight bound):
            // wait out the pause, then resend.
            let pause = front.not_before.map_or(Duration::from_millis(1), |t| {
                t.saturating_duration_since(Instant::now())
            });
            std::thread::sleep(pause);
            return;
        };
        let outcome = match call.wait() {
            Ok(reply) => self.outcome(&reply),
            Err(ClientError::Timeout { .. }) => Outcome::Resend { after_busy: false },
            Err(ClientError::Closed { .. }) => Outcome::Broken,
            Err(e) => Outcome::Done(Err(client_error(&e))),
        };
        match outcome {
            Outcome::Done(result) => {
                let f = self.flights.pop_front().expect("the front exists");
                if f.abandoned {
                    self.abandoned -= 1;
                    match (&f.sub.request, &result) {
                        (PoolRequest::Alloc { .. }, Ok(PoolReply::Allocated(h))) => {
                            self.undo(h.clone());
                        }
                        (PoolRequest::Alloc { .. }, Err(e))
                            if e.error_code() == Some(ErrorCode::SequenceTooOld) =>
                        {
                            tracing::error!(
                                seq = f.sub.seq,
                                error = %e,
                                "an abandoned allocation's outcome cannot be told; a region it allocated stays held until this directory's session ends"
                            );
                        }
                        (PoolRequest::Alloc { .. }, Err(e)) => tracing::info!(
                            seq = f.sub.seq,
                            error = %e,
                            "an abandoned allocation was refused; nothing to free"
                        ),
                        _ => {}
                    }
                }
                (f.sub.done)(result);
            }
            Outcome::Resend { after_busy } => {
                let front = self.flights.front_mut().expect("the front exists");
                if after_busy {
                    front.not_before =
                        Some(Instant::now() + Duration::from_millis(self.cfg.reconnect_backoff_ms));
                }
            }
            Outcome::Broken => self.lose_connection("the connection closed"),
        }
    }

    fn outcome(&mut self, reply: &crate::transport::Reply) -> Outcome {
        let front = self.flights.front().expect("the front exists");
        let result = match &front.sub.request {
            PoolRequest::Alloc { .. } => decode::<RegionAllocated>(reply).map(|r| {
                self.held.insert(r.handle.region, r.handle.clone());
                PoolReply::Allocated(r.handle)
            }),
            PoolRequest::Free { region, .. } => {
                let region = *region;
                let r = decode::<RegionFreed>(reply);
                // Answered — freed, already gone, or refused for good — this
                // session no longer holds it: the directory dropped its
                // record before freeing it, so it is never presented again.
                // One the manager still counts as this directory's (a free
                // refused for good) is then reclaimed after its grace once
                // a reconnect's reattach leaves it out, instead of being
                // kept alive by every reattach. (A transient refusal is
                // resent: below.)
                if !r.as_ref().is_err_and(PoolServiceError::is_transient) {
                    self.held.remove(&region);
                }
                r.map(|f| PoolReply::Freed { region: f.region })
            }
            PoolRequest::Reattach { handles } => decode::<RegionsReattached>(reply).map(|r| {
                for h in handles {
                    if r.accepted.contains(&h.region) {
                        self.held.insert(h.region, h.clone());
                    }
                }
                PoolReply::Reattached(r)
            }),
            PoolRequest::List { .. } => decode::<RegionList>(reply).map(PoolReply::Regions),
            PoolRequest::Stats => decode::<PoolStatsReply>(reply).map(PoolReply::Stats),
        };
        match result {
            Err(e) if e.is_transient() => Outcome::Resend { after_busy: true },
            other => Outcome::Done(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_says_whether_a_secret_is_set_never_what_it_is() {
        let mut c = RemoteConfig::new(Endpoint::Tcp("127.0.0.1:7412".parse().unwrap()), "dir-a");
        assert!(format!("{c:?}").contains("secret: None"));
        c.secret = Some(b"s3cret-bytes".to_vec());
        let text = format!("{c:?}");
        assert!(text.contains("secret: Some(<redacted>)"), "{text}");
        assert!(
            !text.contains("s3cret") && !text.contains("[115, 51"),
            "{text}"
        );
        assert!(text.contains("directory_id: \"dir-a\""), "{text}");
    }

    #[test]
    fn a_pool_list_changes_with_any_pool_but_not_with_a_path_alone() {
        use crate::proto::{BackingKind, VisibilityMode};
        let pool = |i: u32| PoolInfo {
            pool: i,
            uuid: [i as u8; 16],
            size_bytes: 1 << 30,
            align_bytes: 2 << 20,
            path: format!("/dev/dax{i}.0"),
            kind: BackingKind::DevDax,
            visibility: VisibilityMode::Flush,
        };
        let before = [pool(0), pool(1)];
        assert_eq!(pool_list_change(&before, &before), None);
        let mut renumbered = before.clone();
        renumbered[1].path = "/dev/dax7.0".into();
        assert_eq!(pool_list_change(&before, &renumbered), None);
        let change = pool_list_change(&before, &before[..1]).expect("one pool fewer");
        assert!(
            change.starts_with("pools [0 (/dev/dax0.0, 1073741824 bytes)] instead of [0 ("),
            "{change}"
        );
        assert!(pool_list_change(&before, &[pool(0), pool(1), pool(2)]).is_some());
        for edit in [
            |p: &mut PoolInfo| p.uuid[0] ^= 1,
            |p: &mut PoolInfo| p.size_bytes *= 2,
            |p: &mut PoolInfo| p.align_bytes *= 2,
            |p: &mut PoolInfo| p.kind = BackingKind::File,
            |p: &mut PoolInfo| p.visibility = VisibilityMode::Coherent,
            |p: &mut PoolInfo| p.pool = 5,
        ] {
            let mut other = before.clone();
            edit(&mut other[1]);
            assert!(pool_list_change(&before, &other).is_some(), "{other:?}");
        }
    }
}
