//! The transport handler that drives the directory: one instance lives on the
//! transport's event-loop thread and owns the [`Directory`].
//!
//! Per request frame: checked decode (`proto::decode_request`), a directory
//! call with keys borrowed from the receive buffer, the reply encoded and
//! queued, the directory's effects carried out, the latency recorded. Work
//! that finishes elsewhere (pool-manager answers) and timers come back
//! through the [`Mailbox`] and [`Completer::wake`]: the loop then calls
//! [`Handler::on_wake`], which applies them on this thread. Nothing here
//! blocks.
//!
//! Connections and sessions: a connection has at most one session, opened by
//! `Hello` or `Reattach`; every other request on a connection without one
//! gets `HelloRequired`. Closing the connection ends the session
//! (`Directory::session_closed`); the directory ending a session (lease
//! expiry, admin) closes its connection.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::mpsc::SyncSender;
use std::time::{Duration, Instant};

use cxlkv_controlplane::directory::{
    self as dir, Caller, Completion, DeferredId, Directory, DirectoryError, DirectoryStats, Effect,
    InstanceId, OpKind, Peer, PoolRequestId, PresentedRegion, RegionReply, RegisterEntry, Sequence,
    SessionEndReason, SessionId, Time, UnpinEntry,
};
use cxlkv_controlplane::frame::{Frame, FrameHeader, HEADER_BYTES, MAX_FRAME_BYTES};
use cxlkv_controlplane::proto::{
    self, AnyRequest, ArchivedHello, ArchivedReattach, ErrorCode, ErrorReply, KeyBitmap, Kind,
    Limits, Message, PoolInfo, ProtoError, RefusedRegion, ReplyMeta,
};
use cxlkv_controlplane::transport::{
    Admit, Completer, ConnId, DisconnectReason, Handler, PeerInfo, Refusal, RefuseReason,
    Rejection, Replies,
};
use cxlkv_dataplane::ids::RegionId;
use foldhash::fast::FixedState;
use parking_lot::Mutex;

use cxlkv_controlplane::pool::service::{PoolReply, PoolRequest, PoolService, PoolServiceError};

use super::metrics::{MetricsSnapshot, OpLatencies, kind_of};
use super::pool::{dup_fds, worth_retrying};
use super::wire;

/// Pool-manager answers and control requests, posted from other threads for
/// the loop thread. Its length is bounded by construction: one entry per
/// pool request in flight (bounded by the directory's pending-request and
/// region limits) and per control call (one per caller, each waits for its
/// answer; of the metrics endpoint's, at most one is queued: see
/// `metrics_source`).
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    events: Mutex<VecDeque<Event>>,
}

impl Mailbox {
    pub fn post(&self, event: Event, completer: &Completer) {
        self.events.lock().push_back(event);
        // The loop may be stopping; the event then dies with it.
        if let Err(e) = completer.wake() {
            tracing::debug!(error = %e, "event posted to a stopping server");
        }
    }

    fn take(&self) -> VecDeque<Event> {
        std::mem::take(&mut *self.events.lock())
    }
}

/// Something for the loop thread to apply.
#[derive(Debug)]
pub(crate) enum Event {
    Allocated {
        request: PoolRequestId,
        result: Result<proto::RegionHandle, PoolServiceError>,
    },
    Freed {
        handle: dir::RegionHandle,
        owner: InstanceId,
        attempt: u32,
        result: Result<(), PoolServiceError>,
    },
    /// A pool report, with the directory's mark of when it was asked for.
    PoolStats(
        Result<proto::PoolStatsReply, PoolServiceError>,
        dir::PoolReportMark,
    ),
    Control(Control),
}

/// Requests from the [`ServerHandle`](super::ServerHandle).
#[derive(Debug)]
pub(crate) enum Control {
    Stats(SyncSender<DirectoryStats>),
    /// A snapshot for one `/metrics` scrape.
    Metrics(SyncSender<MetricsSnapshot>),
}

/// Per connection.
#[derive(Debug)]
struct Conn {
    peer: PeerInfo,
    session: Option<ConnSession>,
    /// For the stats' session table.
    info: Option<SessionInfo>,
}

#[derive(Debug)]
struct SessionInfo {
    instance: String,
    opened: Instant,
    last_request: Instant,
    requests: u64,
}

#[derive(Debug, Clone, Copy)]
struct ConnSession {
    id: SessionId,
    /// The instance's quota (piggybacked on replies).
    quota_bytes: Option<u64>,
}

/// A `RequestRegion` reply waiting for the pool manager.
#[derive(Debug)]
struct PendingReply {
    conn: ConnId,
    request_id: u64,
    started: Instant,
}

/// A region free the pool manager did not confirm, waiting to be sent again.
#[derive(Debug)]
struct FreeRetry {
    due: Instant,
    handle: dir::RegionHandle,
    owner: InstanceId,
    attempt: u32,
}

/// First and longest wait before a failed free is sent again.
const FREE_RETRY_FIRST: Duration = Duration::from_millis(100);
const FREE_RETRY_MAX: Duration = Duration::from_secs(5);
/// How often the pools' fill levels are asked for.
const POOL_STATS_EVERY: Duration = Duration::from_secs(1);
/// Pins held past `long_held_pin` are looked for (a walk of every pin) and
/// logged once per that threshold, and never more often than this.
const LONG_PIN_REPORT_MIN_EVERY: Duration = Duration::from_secs(1);
/// Capacity of the buffer replies are encoded in (64 KiB: below glibc's
/// `mmap` threshold, so a fresh one is warm heap memory, not page faults).
const REPLY_BUFFER_BYTES: usize = 64 << 10;
/// Replies at least this long are handed to the transport in the buffer
/// they were encoded in ([`Replies::send_frame`]). Shorter ones are copied
/// into a frame of their size ([`Replies::send`]): for them the copy costs
/// no more than the hand-over (a new buffer, the old one shrunk), and the
/// one-key path stays as it was measured.
const HANDOFF_MIN_BYTES: usize = 4 << 10;

/// What the handler needs besides the directory.
pub(crate) struct HandlerParts {
    pub directory: Directory,
    pub directory_id: String,
    pub pool: Arc<dyn PoolService>,
    pub pools: Vec<PoolInfo>,
    pub pool_fds: Vec<OwnedFd>,
    pub mailbox: Arc<Mailbox>,
    pub completer: Completer,
    pub origin: Instant,
    pub tcp_secret: Option<Vec<u8>>,
    /// A connection without a session this long after it was accepted is
    /// closed.
    pub hello_timeout: Duration,
    /// TCP connections without a session admitted at once; more are
    /// refused `Busy`.
    pub max_sessionless_tcp: usize,
    pub max_inflight_per_conn: usize,
    pub default_region_bytes: u64,
    pub tick_every: Duration,
    pub server_uid: u32,
    /// The regions `Directory::recover` started from.
    pub recovered_regions: Vec<RegionId>,
}

pub(crate) struct DirectoryHandler {
    dir: Directory,
    directory_id: String,
    pool: Arc<dyn PoolService>,
    pools: Vec<PoolInfo>,
    pool_fds: Vec<OwnedFd>,
    /// Region lengths are rounded up to this (the largest pool alignment).
    align_bytes: u64,
    default_region_bytes: u64,
    limits: Limits,
    lease_ms: u32,
    mailbox: Arc<Mailbox>,
    completer: Completer,
    origin: Instant,
    tcp_secret: Option<Vec<u8>>,
    server_uid: u32,
    hello_timeout: Duration,
    max_sessionless_tcp: usize,
    /// Every connection accepted, with the time it must have opened a
    /// session by, in acceptance order (so in deadline order: the timeout
    /// is fixed). An entry whose connection is gone or has a session is
    /// dropped when it comes due, or sooner when the queue outgrows twice
    /// the connections (a peer connecting and closing in a loop would
    /// otherwise grow it by its accept rate times the timeout).
    hello_deadlines: VecDeque<(Instant, ConnId)>,
    /// TCP connections without a session (what `max_sessionless_tcp`
    /// bounds), kept as connections come, open sessions, lose them and go.
    sessionless_tcp: usize,
    // Keys the server assigns (no peer chooses them): a fixed fast hash;
    // `conns` is probed on every request.
    conns: HashMap<ConnId, Conn, FixedState>,
    sessions: HashMap<SessionId, ConnId, FixedState>,
    pending: HashMap<DeferredId, PendingReply, FixedState>,
    /// Every region the directory holds (for the stats' region table):
    /// added when granted, confirmed or recovered, removed when freed.
    regions: BTreeSet<RegionId>,
    free_retries: Vec<FreeRetry>,
    /// Fixed-bucket latency histograms for `/metrics` (the directory's own
    /// are reported as quantiles only).
    latencies: OpLatencies,
    /// Frees submitted and not answered yet (shutdown waits for them).
    frees_in_flight: usize,
    tick_every: Duration,
    next_tick: Instant,
    next_pool_stats: Instant,
    /// When pins held past the threshold are next looked for and logged.
    next_pin_report: Instant,
    anon_instances: u64,
    shutdown_closed: usize,
    /// Encoding scratch, reused across replies.
    buf: Vec<u8>,
}

impl std::fmt::Debug for DirectoryHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectoryHandler")
            .field("directory_id", &self.directory_id)
            .field("connections", &self.conns.len())
            .field("sessions", &self.sessions.len())
            .finish_non_exhaustive()
    }
}

impl DirectoryHandler {
    pub fn new(p: HandlerParts) -> Self {
        let cfg = p.directory.config();
        let limits = Limits {
            max_frame_bytes: MAX_FRAME_BYTES as u32,
            max_key_bytes: dir::MAX_KEY_BYTES as u32,
            max_batch: cfg.max_batch.min(proto::MAX_BATCH) as u32,
            max_inflight: p.max_inflight_per_conn.min(u32::MAX as usize) as u32,
            max_pins_per_key: cfg.max_pins_per_call.min(proto::MAX_PINS_PER_KEY as u32),
            reply_cache_len: cfg.reply_window.min(u64::from(u32::MAX)) as u32,
        };
        let lease_ms = cfg.session_lease.as_millis().min(u128::from(u32::MAX)) as u32;
        let align_bytes = p.pools.iter().map(|i| i.align_bytes).max().unwrap_or(4096);
        let now = Instant::now();
        Self {
            dir: p.directory,
            directory_id: p.directory_id,
            pool: p.pool,
            pools: p.pools,
            pool_fds: p.pool_fds,
            align_bytes,
            default_region_bytes: p.default_region_bytes,
            limits,
            lease_ms,
            mailbox: p.mailbox,
            completer: p.completer,
            origin: p.origin,
            tcp_secret: p.tcp_secret,
            server_uid: p.server_uid,
            hello_timeout: p.hello_timeout,
            max_sessionless_tcp: p.max_sessionless_tcp.max(1),
            hello_deadlines: VecDeque::new(),
            sessionless_tcp: 0,
            conns: HashMap::default(),
            sessions: HashMap::default(),
            pending: HashMap::default(),
            regions: p.recovered_regions.into_iter().collect(),
            free_retries: Vec::new(),
            latencies: OpLatencies::default(),
            frees_in_flight: 0,
            tick_every: p.tick_every,
            next_tick: now + p.tick_every,
            next_pool_stats: now + POOL_STATS_EVERY,
            next_pin_report: now + LONG_PIN_REPORT_MIN_EVERY,
            anon_instances: 0,
            shutdown_closed: 0,
            buf: Vec::with_capacity(REPLY_BUFFER_BYTES),
        }
    }

    fn now(&self) -> Time {
        self.time_at(Instant::now())
    }

    /// The directory's time at `t` (nanoseconds since the server started).
    fn time_at(&self, t: Instant) -> Time {
        Time::from_nanos(
            t.saturating_duration_since(self.origin)
                .as_nanos()
                .min(u128::from(u64::MAX)) as u64,
        )
    }

    /// Sessions whose connection the server's shutdown closed.
    pub fn sessions_closed_at_shutdown(&self) -> usize {
        self.shutdown_closed
    }

    /// Frees not yet confirmed by the pool manager (in flight or waiting to
    /// be retried).
    pub fn frees_outstanding(&self) -> usize {
        self.frees_in_flight + self.free_retries.len()
    }

    /// Records a request's time in the server, in the directory's
    /// histograms (quantiles for `Stats`) and in the fixed-bucket ones (for
    /// `/metrics`).
    fn record_latency(&mut self, op: OpKind, elapsed: Duration) {
        self.dir.record_latency(op, elapsed);
        self.latencies.record(op, elapsed);
    }

    fn metrics_snapshot(&mut self) -> MetricsSnapshot {
        let stats = self.stats_reply(
            ReplyMeta::default(),
            proto::sections::INSTANCES,
            proto::MAX_STATS_ROWS,
        );
        MetricsSnapshot {
            stats,
            latencies: self.latencies.clone(),
            pool_paths: self
                .pools
                .iter()
                .map(|p| (p.pool, p.path.clone()))
                .collect(),
            deferred_region_replies: self.pending.len() as u64,
        }
    }

    // --- replies ----------------------------------------------------------

    /// Encodes `msg` and queues it as the reply to `request_id`.
    fn send<M: Message>(&mut self, out: &mut Replies, conn: ConnId, request_id: u64, msg: &M) {
        self.send_with_fds(out, conn, request_id, msg, Vec::new());
    }

    fn send_with_fds<M: Message>(
        &mut self,
        out: &mut Replies,
        conn: ConnId,
        request_id: u64,
        msg: &M,
        fds: Vec<OwnedFd>,
    ) {
        self.buf.clear();
        let encoded = proto::encode(request_id, msg, &mut self.buf);
        self.queue_encoded(out, conn, request_id, M::KIND, encoded, fds);
    }

    /// [`send`](Self::send) for a value that archives as `M` (see
    /// [`proto::encode_as`]).
    fn send_as<M: Message, T: proto::EncodesAs<M>>(
        &mut self,
        out: &mut Replies,
        conn: ConnId,
        request_id: u64,
        value: &T,
    ) {
        self.buf.clear();
        let encoded = proto::encode_as::<M, T>(request_id, value, &mut self.buf);
        self.queue_encoded(out, conn, request_id, M::KIND, encoded, Vec::new());
    }

    /// Queues the frame `self.buf` holds (the result of encoding it), or an
    /// `Internal` error reply if it did not encode.
    fn queue_encoded(
        &mut self,
        out: &mut Replies,
        conn: ConnId,
        request_id: u64,
        kind: Kind,
        encoded: Result<usize, ProtoError>,
        fds: Vec<OwnedFd>,
    ) {
        if let Err(e) = encoded {
            tracing::error!(error = %e, kind = ?kind, "reply does not encode");
            let reply = ErrorReply::new(ErrorCode::Internal, e.to_string(), 0);
            return self.send_error(out, conn, request_id, &reply);
        }
        let sent = if self.buf.len() >= HANDOFF_MIN_BYTES {
            // A large reply (a 512-key lookup's is 16 KiB) goes to the
            // transport as encoded, not copied into a new frame there.
            let frame = std::mem::replace(&mut self.buf, Vec::with_capacity(REPLY_BUFFER_BYTES));
            out.send_frame(conn, frame, fds)
        } else {
            let mut len = [0u8; 4];
            len.copy_from_slice(&self.buf[16..20]);
            let payload_len = u32::from_le_bytes(len) as usize;
            let payload = &self.buf[HEADER_BYTES..HEADER_BYTES + payload_len];
            if fds.is_empty() {
                out.send(conn, kind.as_u16(), request_id, payload)
            } else {
                out.send_with_fds(conn, kind.as_u16(), request_id, payload, fds)
            }
        };
        if let Err(e) = sent {
            tracing::error!(error = %e, conn = %conn, "reply could not be queued");
        }
    }

    fn send_error(&mut self, out: &mut Replies, conn: ConnId, request_id: u64, e: &ErrorReply) {
        self.buf.clear();
        match proto::encode(request_id, e, &mut self.buf) {
            Ok(_) => {
                let mut len = [0u8; 4];
                len.copy_from_slice(&self.buf[16..20]);
                let payload_len = u32::from_le_bytes(len) as usize;
                let payload = &self.buf[HEADER_BYTES..HEADER_BYTES + payload_len];
                if let Err(err) = out.send(conn, Kind::ErrorReply.as_u16(), request_id, payload) {
                    tracing::error!(error = %err, conn = %conn, "error reply could not be queued");
                }
            }
            Err(err) => tracing::error!(error = %err, "error reply does not encode"),
        }
    }

    fn meta(
        &self,
        session: &ConnSession,
        notices: &[dir::FreedPageNotice],
        usage: &dir::Usage,
    ) -> ReplyMeta {
        wire::reply_meta(notices, usage, session.quota_bytes)
    }

    // --- requests ---------------------------------------------------------

    fn op_of(kind: Kind) -> Option<OpKind> {
        Some(match kind {
            Kind::Hello => OpKind::Hello,
            Kind::Reattach => OpKind::Reattach,
            Kind::Heartbeat | Kind::MapRegion => OpKind::Heartbeat,
            Kind::Register => OpKind::Register,
            Kind::Lookup => OpKind::Lookup,
            Kind::Exists => OpKind::Exists,
            Kind::Unpin => OpKind::Unpin,
            Kind::Delete => OpKind::Delete,
            Kind::RequestRegion => OpKind::RequestRegion,
            Kind::ReturnRegion => OpKind::ReturnRegion,
            Kind::Stats => OpKind::Stats,
            Kind::EndSession => OpKind::EndSession,
            _ => return None,
        })
    }

    /// Answers `req`; returns whether the answer is deferred (a
    /// `RequestRegion` waiting for the pool manager: its latency is
    /// recorded when the answer is queued).
    fn dispatch(
        &mut self,
        conn: ConnId,
        request_id: u64,
        req: AnyRequest<'_>,
        out: &mut Replies,
        started: Instant,
    ) -> bool {
        let session = self.conns.get(&conn).and_then(|c| c.session);
        match (req, session) {
            (AnyRequest::Hello(h), None) => self.hello(conn, request_id, h, out),
            (AnyRequest::Reattach(r), None) => self.reattach(conn, request_id, r, out),
            (AnyRequest::Hello(_) | AnyRequest::Reattach(_), Some(_)) => {
                let e = ErrorReply::new(
                    ErrorCode::InvalidArgument,
                    "this connection already has a session; open another connection",
                    0,
                );
                self.send_error(out, conn, request_id, &e);
            }
            (
                AnyRequest::PoolHello(_)
                | AnyRequest::AllocRegion(_)
                | AnyRequest::FreeRegion(_)
                | AnyRequest::ReattachRegions(_)
                | AnyRequest::ListRegions(_)
                | AnyRequest::PoolStats(_),
                _,
            ) => {
                let e = ErrorReply::new(
                    ErrorCode::UnknownKind,
                    format!(
                        "{:?} is a pool-manager request; this is a directory socket",
                        req.kind()
                    ),
                    0,
                );
                self.send_error(out, conn, request_id, &e);
            }
            (_, None) => {
                let e = ErrorReply::new(
                    ErrorCode::HelloRequired,
                    format!("{:?} before Hello or Reattach", req.kind()),
                    0,
                );
                self.send_error(out, conn, request_id, &e);
            }
            (req, Some(s)) => {
                return self.session_request(conn, request_id, s, req, out, started);
            }
        }
        false
    }

    /// The identity the kernel gave the connection, and for TCP whether the
    /// presented client secret is the configured one.
    fn peer(&self, conn: ConnId, client_secret: Option<&[u8]>) -> Option<Peer> {
        Some(match &self.conns.get(&conn)?.peer {
            PeerInfo::Unix(cred) => Peer::Unix {
                pid: u32::try_from(cred.pid).unwrap_or(0),
                uid: cred.uid,
                gid: cred.gid,
            },
            _ => Peer::Tcp {
                secret_matched: match (&self.tcp_secret, client_secret) {
                    (Some(expected), Some(given)) => wire::secret_matches(given, expected),
                    _ => false,
                },
            },
        })
    }

    fn is_tcp(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|c| !matches!(c.peer, PeerInfo::Unix(_)))
    }

    /// The error reply for a failed `Hello`/`Reattach`; TCP authentication
    /// failures also close the connection (no second guess on it).
    fn refuse_opening(
        &mut self,
        conn: ConnId,
        request_id: u64,
        e: &DirectoryError,
        secret_given: bool,
        out: &mut Replies,
    ) {
        let mut reply = wire::directory_error(e);
        let auth = matches!(e, DirectoryError::TcpSecretRequired);
        if auth && secret_given {
            reply = ErrorReply::new(
                ErrorCode::AuthenticationFailed,
                "the client secret does not match this listener's: give the client the contents of the server's tcp_secret_file (without its trailing newline)",
                0,
            );
        }
        self.send_error(out, conn, request_id, &reply);
        if auth && self.is_tcp(conn) {
            out.close(conn);
        }
    }

    fn welcome_for(
        &self,
        version: u16,
        instance_id: String,
        secret: dir::InstanceSecret,
        session: SessionId,
        directory_epoch: u64,
        meta: ReplyMeta,
    ) -> proto::Welcome {
        proto::Welcome {
            meta,
            protocol_version: version,
            instance_id,
            instance_secret: proto::InstanceSecret(secret.0),
            session_id: session.0,
            directory_id: self.directory_id.clone(),
            directory_epoch,
            limits: self.limits,
            lease_ms: self.lease_ms,
            pools: self.pools.clone(),
            fds_passed: 0,
        }
    }

    /// Pool descriptors for a Unix peer (none for TCP, or if duplicating
    /// fails: the client then opens the pools by path).
    fn fds_for(&self, conn: ConnId) -> Vec<OwnedFd> {
        if self.is_tcp(conn) || self.pool_fds.len() != self.pools.len() {
            return Vec::new();
        }
        match dup_fds(&self.pool_fds) {
            Ok(fds) => fds,
            Err(e) => {
                tracing::warn!(error = %e, "cannot duplicate pool descriptors; clients open by path");
                Vec::new()
            }
        }
    }

    fn open_session(
        &mut self,
        conn: ConnId,
        id: SessionId,
        quota_bytes: Option<u64>,
        instance: &str,
    ) {
        if let Some(c) = self.conns.get_mut(&conn) {
            if c.session.is_none() && is_tcp(&c.peer) {
                self.sessionless_tcp -= 1;
            }
            c.session = Some(ConnSession { id, quota_bytes });
            let now = Instant::now();
            c.info = Some(SessionInfo {
                instance: instance.to_owned(),
                opened: now,
                last_request: now,
                requests: 1,
            });
        }
        self.sessions.insert(id, conn);
    }

    fn hello(&mut self, conn: ConnId, request_id: u64, h: &ArchivedHello, out: &mut Replies) {
        let version = match proto::negotiate(h.protocol_min.to_native(), h.protocol_max.to_native())
        {
            Ok(v) => v,
            Err(e) => return self.send_error(out, conn, request_id, &e.to_reply()),
        };
        let secret = h.client_secret.as_ref().map(|s| s.as_slice());
        let Some(peer) = self.peer(conn, secret) else {
            return;
        };
        let name = if h.instance_id.is_empty() {
            self.anon_instances += 1;
            // Unpredictable: another client that could guess the next
            // name (epoch and counter are in its own welcome) could take it
            // first and make this hello fail with `InstanceInUse`. (A
            // failed draw leaves zeros: the counter still makes it unique
            // among anonymous names.)
            let mut r = [0u8; 8];
            let _ = cxlkv_controlplane::pool::sys::random_bytes(&mut r);
            format!(
                "anon-{:x}-{}-{:016x}",
                self.dir.epoch(),
                self.anon_instances,
                u64::from_le_bytes(r)
            )
        } else {
            h.instance_id.as_str().to_owned()
        };
        let now = self.now();
        let result = self.dir.hello(
            dir::Hello {
                instance: &name,
                quota_bytes: None,
            },
            peer,
            now,
        );
        let w = match result {
            Ok(w) => w,
            Err(e) => return self.refuse_opening(conn, request_id, &e, secret.is_some(), out),
        };
        self.open_session(conn, w.session, w.quota_bytes, &name);
        // The client's name is only logged (escaped: any UTF-8 is allowed).
        tracing::info!(
            session = %w.session,
            instance = ?name,
            client = ?h.client_name.as_str(),
            "session opened"
        );
        let fds = self.fds_for(conn);
        let meta = wire::reply_meta(&[], &w.usage, w.quota_bytes);
        let mut welcome =
            self.welcome_for(version, name, w.secret, w.session, w.directory_epoch, meta);
        welcome.fds_passed = fds.len() as u32;
        self.send_with_fds(out, conn, request_id, &welcome, fds);
        self.apply_effects(Some(out));
    }

    fn reattach(&mut self, conn: ConnId, request_id: u64, r: &ArchivedReattach, out: &mut Replies) {
        let version = match proto::negotiate(r.protocol_min.to_native(), r.protocol_max.to_native())
        {
            Ok(v) => v,
            Err(e) => return self.send_error(out, conn, request_id, &e.to_reply()),
        };
        let secret = r.client_secret.as_ref().map(|s| s.as_slice());
        let Some(peer) = self.peer(conn, secret) else {
            return;
        };
        let presented: Vec<PresentedRegion> = r
            .regions
            .iter()
            .map(|o| PresentedRegion {
                handle: dir::RegionHandle {
                    region: RegionId(o.desc.region.to_native()),
                    pool: cxlkv_dataplane::ids::PoolId(o.desc.pool.to_native()),
                    offset_bytes: o.desc.offset_bytes.to_native(),
                    len_bytes: o.desc.len_bytes.to_native(),
                    token: dir::RegionToken(*o.token.as_bytes()),
                },
                layout: wire::layout(&o.layout),
            })
            .collect();
        let instance_secret = dir::InstanceSecret(*r.instance_secret.as_bytes());
        let now = self.now();
        let result = self.dir.reattach(
            dir::Reattach {
                instance: r.instance_id.as_str(),
                secret: instance_secret,
                regions: &presented,
                next_seq: r.next_seq.to_native(),
                notice_ack: r.meta.notice_ack.to_native(),
                quota_bytes: None,
            },
            peer,
            now,
        );
        let a = match result {
            Ok(a) => a,
            Err(e) => return self.refuse_opening(conn, request_id, &e, secret.is_some(), out),
        };
        self.open_session(conn, a.session, a.quota_bytes, r.instance_id.as_str());
        tracing::info!(
            session = %a.session,
            instance = ?r.instance_id.as_str(),
            client = ?r.client_name.as_str(),
            kind = ?a.kind,
            "session reattached"
        );
        let mut accepted = Vec::new();
        let mut refused = Vec::new();
        for (p, status) in presented.iter().zip(&a.regions) {
            match status {
                dir::RegionStatus::Confirmed => {
                    accepted.push(p.handle.region.0);
                    self.regions.insert(p.handle.region);
                }
                _ => refused.push(RefusedRegion {
                    region: p.handle.region.0,
                    code: ErrorCode::NotOwner.as_u16(),
                }),
            }
        }
        let fds = self.fds_for(conn);
        let meta = wire::reply_meta(&a.notices, &a.usage, a.quota_bytes);
        let mut welcome = self.welcome_for(
            version,
            r.instance_id.as_str().to_owned(),
            instance_secret,
            a.session,
            a.directory_epoch,
            meta,
        );
        welcome.fds_passed = fds.len() as u32;
        let reply = proto::Reattached {
            welcome,
            resumed: a.kind == dir::ReattachKind::Resumed,
            accepted,
            refused,
            oldest_accepted_seq: a.oldest_accepted_seq,
        };
        self.send_with_fds(out, conn, request_id, &reply, fds);
        self.apply_effects(Some(out));
    }

    /// A request on a connection with a session; returns whether its
    /// answer is deferred (see [`dispatch`](Self::dispatch)).
    fn session_request(
        &mut self,
        conn: ConnId,
        request_id: u64,
        s: ConnSession,
        req: AnyRequest<'_>,
        out: &mut Replies,
        started: Instant,
    ) -> bool {
        let mut deferred = false;
        let meta = req.meta();
        let caller = Caller {
            session: s.id,
            notice_ack: meta.notice_ack,
        };
        let seq = Sequence {
            seq: meta.seq,
            replies_received_below: meta.replies_received_below,
        };
        // The directory's clock from the frame's arrival stamp: one clock
        // read fewer per request (each costs ~50 ns on this VM's TSC).
        let now = self.time_at(started);
        let result: Result<(), DirectoryError> = match req {
            AnyRequest::Heartbeat(_) => self.dir.heartbeat(&caller, now).map(|r| {
                let reply = proto::HeartbeatReply {
                    meta: self.meta(&s, &r.notices, &r.usage),
                    lease_ms: self.lease_ms,
                };
                self.send(out, conn, request_id, &reply);
            }),
            AnyRequest::Lookup(l) => {
                let seq = (l.pins() > 0).then_some(seq);
                self.dir
                    .lookup(
                        &caller,
                        seq,
                        wire::layout(&l.layout),
                        l.keys(),
                        l.pins(),
                        now,
                    )
                    .map(|r| {
                        let reply = proto::LookupReplyFrom {
                            meta: self.meta(&s, &r.notices, &r.usage),
                            locations: r
                                .body
                                .locations
                                .iter()
                                .map(|l| l.as_ref().map(wire::wire_location)),
                            regions: r.body.regions.iter().map(wire::wire_desc).collect(),
                        };
                        self.send_as::<proto::LookupReply, _>(out, conn, request_id, &reply);
                    })
            }
            AnyRequest::Exists(e) => self
                .dir
                .exists(&caller, wire::layout(&e.layout), e.keys(), now)
                .map(|r| {
                    let reply = proto::ExistsReply {
                        meta: self.meta(&s, &r.notices, &r.usage),
                        present: r.body.iter().copied().collect::<KeyBitmap>(),
                    };
                    self.send(out, conn, request_id, &reply);
                }),
            AnyRequest::Register(g) => {
                let entries = g.entries.iter().map(|e| RegisterEntry {
                    key: e.key.as_slice(),
                    location: wire::location(&e.location),
                });
                self.dir
                    .register(&caller, seq, wire::layout(&g.layout), entries, now)
                    .map(|r| {
                        let outcomes: Option<Vec<_>> =
                            r.body.iter().map(wire::register_outcome).collect();
                        match outcomes {
                            Some(outcomes) => {
                                let reply = proto::RegisterReply {
                                    meta: self.meta(&s, &r.notices, &r.usage),
                                    outcomes,
                                };
                                self.send(out, conn, request_id, &reply);
                            }
                            None => {
                                tracing::error!(outcomes = ?r.body, "a rejection reason has no wire form");
                                let e = ErrorReply::new(
                                    ErrorCode::Internal,
                                    "a registration outcome has no wire form in this build",
                                    0,
                                );
                                self.send_error(out, conn, request_id, &e);
                            }
                        }
                    })
            }
            AnyRequest::Unpin(u) => {
                let entries = u.keys.iter().zip(u.counts.iter()).map(|(k, c)| UnpinEntry {
                    key: k.as_slice(),
                    count: c.to_native(),
                });
                self.dir
                    .unpin(&caller, seq, wire::layout(&u.layout), entries, now)
                    .map(|r| {
                        let reply = proto::UnpinReply {
                            meta: self.meta(&s, &r.notices, &r.usage),
                            outcomes: r.body.iter().map(wire::unpin_outcome).collect(),
                        };
                        self.send(out, conn, request_id, &reply);
                    })
            }
            AnyRequest::Delete(d) => {
                let layout = wire::layout(&d.layout);
                self.dir
                    .delete(&caller, seq, layout, d.keys(), now)
                    .map(|r| {
                        // The pin counts come with the outcomes (cached with
                        // them): a retry gets the first reply's counts.
                        let outcomes = r.body.iter().map(wire::delete_outcome).collect();
                        let reply = proto::DeleteReply {
                            meta: self.meta(&s, &r.notices, &r.usage),
                            outcomes,
                        };
                        self.send(out, conn, request_id, &reply);
                    })
            }
            AnyRequest::RequestRegion(q) => {
                let layout = wire::layout(&q.layout);
                let asked = match q.len_bytes.to_native() {
                    0 => self.default_region_bytes.max(layout.page_size_bytes),
                    n => n,
                };
                let len_bytes = asked
                    .checked_next_multiple_of(self.align_bytes)
                    .unwrap_or(asked);
                self.dir
                    .request_region(&caller, seq, layout, len_bytes, now)
                    .map(|r| match r.body {
                        RegionReply::Granted(g) => {
                            let reply = self.granted(&s, &g, &r.notices, &r.usage);
                            self.send(out, conn, request_id, &reply);
                        }
                        RegionReply::Deferred(id) => {
                            deferred = true;
                            self.pending.insert(
                                id,
                                PendingReply {
                                    conn,
                                    request_id,
                                    started,
                                },
                            );
                        }
                    })
            }
            AnyRequest::ReturnRegion(q) => {
                let region = q.region.to_native();
                self.dir
                    .return_region(&caller, seq, RegionId(region), now)
                    .map(|r| {
                        let reply = proto::RegionReturned {
                            meta: self.meta(&s, &r.notices, &r.usage),
                            region,
                        };
                        self.send(out, conn, request_id, &reply);
                    })
            }
            AnyRequest::MapRegion(m) if m.regions().len() > self.dir.config().max_batch => {
                // The batch limit this directory announced (the protocol's
                // own bound was checked at the edge).
                Err(DirectoryError::BatchTooLarge {
                    len: m.regions().len(),
                    max: self.dir.config().max_batch,
                })
            }
            AnyRequest::MapRegion(m) => self.dir.heartbeat(&caller, now).map(|r| {
                let descs = m
                    .regions()
                    .map(|id| {
                        self.dir
                            .inspect_region(RegionId(id))
                            .map(|i| wire::wire_desc(&i.descriptor))
                    })
                    .collect();
                let reply = proto::RegionMap {
                    meta: self.meta(&s, &r.notices, &r.usage),
                    descs,
                };
                self.send(out, conn, request_id, &reply);
            }),
            AnyRequest::EndSession(e) => self.end_session(conn, request_id, &caller, &s, e, out),
            AnyRequest::Stats(q) => self.dir.renew(&caller, now).map(|r| {
                let meta = self.meta(&s, &r.notices, &r.usage);
                let reply = self.stats_reply(
                    meta,
                    q.sections.to_native(),
                    q.max_rows.to_native() as usize,
                );
                self.send(out, conn, request_id, &reply);
            }),
            AnyRequest::Hello(_)
            | AnyRequest::Reattach(_)
            | AnyRequest::PoolHello(_)
            | AnyRequest::AllocRegion(_)
            | AnyRequest::FreeRegion(_)
            | AnyRequest::ReattachRegions(_)
            | AnyRequest::ListRegions(_)
            | AnyRequest::PoolStats(_) => unreachable!("dispatch() routes these elsewhere"),
        };
        if let Err(e) = result {
            self.send_error(out, conn, request_id, &wire::directory_error(&e));
        }
        self.apply_effects(Some(out));
        deferred
    }

    fn end_session(
        &mut self,
        conn: ConnId,
        request_id: u64,
        caller: &Caller,
        s: &ConnSession,
        e: &proto::ArchivedEndSession,
        out: &mut Replies,
    ) -> Result<(), DirectoryError> {
        let admin = match self.conns.get(&conn).map(|c| &c.peer) {
            Some(PeerInfo::Unix(cred)) => cred.uid == 0 || cred.uid == self.server_uid,
            _ => false,
        };
        if !admin {
            let reply = ErrorReply::new(
                ErrorCode::AuthenticationFailed,
                "EndSession is for the server's own user (or root) on the Unix socket",
                0,
            );
            self.send_error(out, conn, request_id, &reply);
            return Ok(());
        }
        let target = SessionId(e.session_id.to_native());
        let now = self.now();
        let seq = Sequence {
            seq: e.meta.seq.to_native(),
            replies_received_below: e.meta.replies_received_below.to_native(),
        };
        let ended = self.dir.end_session_request(caller, seq, target, now)?;
        // The caller may have ended its own session: then the reply carries
        // no notices (there is no live session to renew).
        let meta = match self.dir.renew(caller, now) {
            Ok(r) => self.meta(s, &r.notices, &r.usage),
            Err(_) => ReplyMeta::default(),
        };
        let reply = proto::SessionEnded {
            meta,
            session_id: target.0,
            pins_released: ended.pins_released,
        };
        self.send(out, conn, request_id, &reply);
        Ok(())
    }

    /// The wire form of the directory's statistics, plus what only the
    /// server knows (sessions, regions).
    fn stats_reply(
        &mut self,
        meta: ReplyMeta,
        sections: u32,
        max_rows: usize,
    ) -> proto::StatsReply {
        use proto::sections as sec;
        let now = self.now();
        let st = self.dir.stats(now);
        let mut truncated = false;
        let mut cap = |len: usize| {
            truncated |= len > max_rows;
            len.min(max_rows)
        };
        let o = &st.outcomes;
        let e = &st.evictions;
        let totals = proto::DirectoryTotals {
            keys: st.keys,
            used_bytes: st.page_bytes,
            value_bytes: st.value_bytes,
            key_bytes: st.key_bytes,
            owned_bytes: st.region_bytes,
            regions: st.regions,
            deferred_regions: st.orphaned_regions,
            pending_region_requests: st.pending_region_requests,
            pins: st.pins,
            pinned_keys: st.pinned_keys,
            instances_live: st.per_instance.iter().filter(|i| i.sessions > 0).count() as u64,
            instances_absent: st.per_instance.iter().filter(|i| i.sessions == 0).count() as u64,
            sessions: st.sessions,
            notices_pending: st
                .per_instance
                .iter()
                .map(|i| i.notices_pending as u64)
                .sum(),
            layouts: st.layouts,
            long_held_pins: st.long_held_pins.count,
            evictions_orphan: e.orphan_keys,
            evictions_lru: e.lru_keys,
            evictions_lru_skipped: e.lru_skipped,
            sessions_expired: o.sessions_expired,
            sessions_closed: o.sessions_closed,
            sessions_ended: o.sessions_ended_by_admin,
            instances_gone: o.instances_gone,
            regions_granted: o.regions_granted,
            regions_returned: o.regions_returned,
            regions_freed: o.regions_freed,
            regions_deferred: o.regions_deferred,
            notices_issued: o.notices_issued,
            pinned_entries: st.pinned_entries,
            max_pinned_entries: st.max_pinned_entries,
            pin_ledger_bytes: st.pin_ledger_bytes,
        };
        let outcomes = proto::OutcomeTotals {
            inserted: o.inserted,
            duplicate: o.duplicate,
            rejected: o.rejected,
            stale_generation: o.stale_generation,
            lookup_hits: o.lookup_hits,
            lookup_misses: o.lookup_misses,
            exists_hits: o.exists_hits,
            exists_misses: o.exists_misses,
            pins_taken: o.pins_taken,
            unpinned: o.unpinned,
            not_pinned: o.not_pinned,
            deleted: o.deleted,
            delete_pinned: o.delete_pinned,
            delete_missing: o.delete_missing,
            retries_answered: o.retries_answered,
            sequence_too_old: o.sequence_too_old,
            replies_evicted: o.replies_evicted,
        };
        let ops = st
            .ops
            .iter()
            .map(|op| proto::OpStats {
                kind: kind_of(op.op).as_u16(),
                requests: op.counters.calls,
                items: op.counters.keys,
                errors: op.counters.errors,
                latency: proto::LatencySummary {
                    count: op.latency.count,
                    p50_ns: op.latency.p50_ns,
                    p99_ns: op.latency.p99_ns,
                    max_ns: op.latency.max_ns,
                },
            })
            .collect();
        let pools = st
            .per_pool
            .iter()
            .take(proto::MAX_POOLS)
            .map(|p| proto::PoolRow {
                pool: p.pool.0,
                size_bytes: p.reported_total_bytes,
                free_bytes: p.estimated_free_bytes,
                regions: p.regions,
                region_bytes: p.region_bytes,
                orphaned_regions: p.orphaned_regions,
                keys: p.keys,
                used_bytes: p.used_bytes,
            })
            .collect();
        let mut instances = Vec::new();
        if sections & sec::INSTANCES != 0 {
            let n = cap(st.per_instance.len());
            instances = st.per_instance[..n]
                .iter()
                .map(|i| proto::InstanceRow {
                    instance_id: i.instance.as_str().to_owned(),
                    sessions: i.sessions.min(u32::MAX as usize) as u32,
                    awaiting_reattach: i.awaiting_reattach,
                    regions: i.regions.min(u32::MAX as usize) as u32,
                    owned_bytes: i.owned_bytes,
                    pending_region_bytes: i.pending_region_bytes,
                    used_bytes: i.used_bytes,
                    quota_bytes: i.quota_bytes.unwrap_or(0),
                    keys: i.keys,
                    pins: i.pins_held,
                    notices_pending: i.notices_pending.min(u32::MAX as usize) as u32,
                    cached_replies: i.cached_replies.min(u32::MAX as usize) as u32,
                    cached_reply_bytes: i.cached_reply_bytes as u64,
                })
                .collect();
        }
        let mut sessions = Vec::new();
        if sections & sec::SESSIONS != 0 {
            let clock = Instant::now();
            let mut rows: Vec<proto::SessionRow> = self
                .conns
                .values()
                .filter_map(|c| {
                    let s = c.session?;
                    let info = c.info.as_ref()?;
                    let (transport, pid, uid) = match &c.peer {
                        PeerInfo::Unix(cred) => (
                            proto::Transport::Unix,
                            u32::try_from(cred.pid).unwrap_or(0),
                            cred.uid,
                        ),
                        _ => (proto::Transport::Tcp, 0, 0),
                    };
                    Some(proto::SessionRow {
                        session_id: s.id.0,
                        instance_id: info.instance.clone(),
                        transport,
                        pid,
                        uid,
                        age_ms: clock.saturating_duration_since(info.opened).as_millis() as u64,
                        idle_ms: clock
                            .saturating_duration_since(info.last_request)
                            .as_millis() as u64,
                        requests: info.requests,
                    })
                })
                .collect();
            rows.sort_by_key(|r| r.session_id);
            let n = cap(rows.len());
            rows.truncate(n);
            sessions = rows;
        }
        let mut regions = Vec::new();
        if sections & sec::REGIONS != 0 {
            let n = cap(self.regions.len());
            regions = self
                .regions
                .iter()
                .take(n)
                .filter_map(|&id| self.dir.inspect_region(id))
                .map(|r| proto::RegionRow {
                    region: r.descriptor.region.0,
                    pool: r.descriptor.pool.0,
                    layout: wire::wire_layout(r.layout),
                    len_bytes: r.descriptor.len_bytes,
                    owner_instance: r.owner_label.as_str().to_owned(),
                    owner_present: r.owner.is_some(),
                    keys: u64::from(r.keys),
                    used_bytes: u64::from(r.keys) * r.descriptor.page_size_bytes,
                    deferred: r.owner.is_none(),
                })
                .collect();
        }
        let mut long_pins = Vec::new();
        if sections & sec::LONG_PINS != 0 {
            let n = cap(st.long_held_pins.oldest.len());
            long_pins = st.long_held_pins.oldest[..n]
                .iter()
                .map(|p| proto::LongPinRow {
                    session_id: p.session.0,
                    instance_id: p.instance.as_str().to_owned(),
                    pins: p.pins,
                    held_ms: p.held_for.as_millis() as u64,
                })
                .collect();
        }
        proto::StatsReply {
            meta,
            directory_id: self.directory_id.clone(),
            directory_epoch: st.directory_epoch,
            uptime_ms: self.origin.elapsed().as_millis() as u64,
            totals,
            outcomes,
            ops,
            pools,
            instances,
            sessions,
            regions,
            long_pins,
            long_pin_threshold_ms: st.long_held_pins.threshold.as_millis() as u64,
            truncated,
        }
    }

    fn granted(
        &self,
        s: &ConnSession,
        g: &dir::RegionGrant,
        notices: &[dir::FreedPageNotice],
        usage: &dir::Usage,
    ) -> proto::RegionGranted {
        proto::RegionGranted {
            meta: self.meta(s, notices, usage),
            desc: wire::wire_desc(&g.handle.descriptor(g.layout.page_size_bytes)),
            layout: wire::wire_layout(g.layout),
            token: proto::RegionToken(g.handle.token.0),
        }
    }

    // --- effects and events -----------------------------------------------

    /// Carries out what the directory asked for. `out` is absent in
    /// callbacks that cannot queue replies (`on_disconnect`): closes then go
    /// through the completer.
    fn apply_effects(&mut self, mut out: Option<&mut Replies>) {
        let effects: Vec<Effect> = self.dir.drain_effects().collect();
        for effect in effects {
            match effect {
                Effect::AllocateRegion {
                    request,
                    owner,
                    layout: _,
                    len_bytes,
                } => {
                    let mailbox = Arc::clone(&self.mailbox);
                    let completer = self.completer.clone();
                    self.pool.submit(
                        PoolRequest::Alloc {
                            pool: None,
                            len_bytes,
                            instance_id: owner.as_str().to_owned(),
                        },
                        Box::new(move |r| {
                            let result = r.and_then(|reply| match reply {
                                PoolReply::Allocated(h) => Ok(h),
                                other => Err(unexpected_reply(&other)),
                            });
                            mailbox.post(Event::Allocated { request, result }, &completer);
                        }),
                    );
                }
                Effect::FreeRegion { handle, owner } => {
                    self.regions.remove(&handle.region);
                    self.submit_free(handle, owner, 0);
                }
                Effect::SessionEnded { session, reason } => {
                    if reason == SessionEndReason::ConnectionClosed {
                        continue;
                    }
                    tracing::info!(session = %session, ?reason, "session ended; closing its connection");
                    if let Some(conn) = self.sessions.remove(&session) {
                        // `take` runs whenever the connection is there.
                        if let Some(c) = self.conns.get_mut(&conn)
                            && c.session.take().is_some()
                            && is_tcp(&c.peer)
                        {
                            self.sessionless_tcp += 1;
                        }
                        match out.as_deref_mut() {
                            Some(out) => out.close(conn),
                            None => {
                                if let Err(e) = self.completer.close(conn) {
                                    tracing::debug!(error = %e, "cannot close a connection");
                                }
                            }
                        }
                    }
                }
                other => tracing::error!(effect = ?other, "directory effect not handled"),
            }
        }
    }

    fn submit_free(&mut self, handle: dir::RegionHandle, owner: InstanceId, attempt: u32) {
        let mailbox = Arc::clone(&self.mailbox);
        let completer = self.completer.clone();
        self.frees_in_flight += 1;
        self.pool.submit(
            PoolRequest::Free {
                region: handle.region.0,
                token: proto::RegionToken(handle.token.0),
            },
            Box::new(move |r| {
                let result = r.and_then(|reply| match reply {
                    PoolReply::Freed { .. } => Ok(()),
                    other => Err(unexpected_reply(&other)),
                });
                mailbox.post(
                    Event::Freed {
                        handle,
                        owner,
                        attempt,
                        result,
                    },
                    &completer,
                );
            }),
        );
    }

    /// Applies the events posted since the last wake, runs due timers.
    fn run_events(&mut self, out: &mut Replies) {
        self.apply_events(Some(&mut *out));
        let now = Instant::now();
        self.resubmit_due_frees(now);
        self.close_sessionless_overdue(now, out);
        if now >= self.next_tick {
            self.next_tick = now + self.tick_every;
            let t = self.now();
            self.dir.tick(t);
        }
        if now >= self.next_pin_report {
            let threshold = self.dir.config().long_held_pin;
            self.next_pin_report = now + threshold.max(LONG_PIN_REPORT_MIN_EVERY);
            self.report_long_held_pins();
        }
        self.apply_effects(Some(out));
        if now >= self.next_pool_stats {
            // After the effects: every free decided so far is submitted
            // before this request, so the report counts exactly the frees
            // the mark counts (the pool manager answers in order).
            self.next_pool_stats = now + POOL_STATS_EVERY;
            let mark = self.dir.pool_report_mark();
            let mailbox = Arc::clone(&self.mailbox);
            let completer = self.completer.clone();
            self.pool.submit(
                PoolRequest::Stats,
                Box::new(move |r| {
                    let result = r.and_then(|reply| match reply {
                        PoolReply::Stats(s) => Ok(s),
                        other => Err(unexpected_reply(&other)),
                    });
                    mailbox.post(Event::PoolStats(result, mark), &completer);
                }),
            );
        }
    }

    /// What the shutdown's wait for frees in flight runs once the loop is
    /// gone: the pool manager's answers applied and failed frees sent again,
    /// and nothing else. Not the directory's timers: the sessions the
    /// shutdown closed put their instances in their grace period, and a
    /// tick during the wait would let a short grace expire and free their
    /// regions — which their clients still map, and would present again to
    /// the restarted server.
    pub fn drain_at_shutdown(&mut self) {
        self.apply_events(None);
        self.resubmit_due_frees(Instant::now());
        self.apply_effects(None);
    }

    /// Closes the connections that have not opened a session within the
    /// hello timeout: a peer that never says `Hello` (a TCP peer without
    /// the secret, a port scanner, a stuck client) must not keep a
    /// connection slot — every later client would be refused `Busy`.
    fn close_sessionless_overdue(&mut self, now: Instant, out: &mut Replies) {
        while let Some(&(due, conn)) = self.hello_deadlines.front() {
            if due > now {
                break;
            }
            self.hello_deadlines.pop_front();
            let Some(c) = self.conns.get(&conn) else {
                continue;
            };
            if c.session.is_some() {
                continue;
            }
            tracing::info!(
                conn = %conn,
                peer = ?c.peer,
                timeout_ms = self.hello_timeout.as_millis() as u64,
                "closing a connection that opened no session in time"
            );
            out.close(conn);
        }
    }

    /// TCP connections that have not opened a session, counted (what
    /// `sessionless_tcp` keeps; for the debug check).
    fn count_sessionless_tcp(&self) -> usize {
        self.conns
            .values()
            .filter(|c| c.session.is_none() && is_tcp(&c.peer))
            .count()
    }

    /// Sends again the failed frees whose backoff has passed.
    fn resubmit_due_frees(&mut self, now: Instant) {
        if self.free_retries.is_empty() {
            return;
        }
        let due: Vec<FreeRetry>;
        (due, self.free_retries) = std::mem::take(&mut self.free_retries)
            .into_iter()
            .partition(|r| r.due <= now);
        for r in due {
            self.submit_free(r.handle, r.owner, r.attempt);
        }
    }

    /// Applies the events posted since the last call.
    fn apply_events(&mut self, mut out: Option<&mut Replies>) {
        for event in self.mailbox.take() {
            match event {
                Event::Allocated { request, result } => {
                    // Orphaned keys may hold the room it lacked.
                    if result
                        .as_ref()
                        .is_err_and(|e| e.error_code() == Some(ErrorCode::OutOfSpace))
                    {
                        self.dir.region_refused_for_space();
                    }
                    let failure = result.as_ref().err().cloned();
                    let completions = self.dir.region_allocated(
                        request,
                        result
                            .map(|h| wire::dir_handle(&h))
                            .map_err(|e| e.to_string()),
                    );
                    for c in completions {
                        self.complete_region(c, failure.as_ref(), out.as_deref_mut());
                    }
                }
                Event::Freed {
                    handle,
                    owner,
                    attempt,
                    result,
                } => {
                    self.frees_in_flight -= 1;
                    match result {
                        Ok(()) => tracing::debug!(region = %handle.region, "region freed"),
                        Err(e) if worth_retrying(&e) => {
                            let backoff = FREE_RETRY_FIRST
                                .saturating_mul(1 << attempt.min(8))
                                .min(FREE_RETRY_MAX);
                            tracing::warn!(region = %handle.region, error = %e, retry_in_ms = backoff.as_millis() as u64, "region free failed; retrying");
                            self.free_retries.push(FreeRetry {
                                due: Instant::now() + backoff,
                                handle,
                                owner,
                                attempt: attempt.saturating_add(1),
                            });
                        }
                        Err(e) => {
                            tracing::error!(region = %handle.region, owner = %owner, error = %e, "the pool manager refused a region free; not retried");
                        }
                    }
                }
                Event::PoolStats(Ok(stats), mark) => {
                    for p in &stats.pools {
                        self.dir.pool_usage_as_of(
                            &mark,
                            cxlkv_dataplane::ids::PoolId(p.pool),
                            p.total_bytes,
                            p.free_bytes,
                        );
                    }
                }
                Event::PoolStats(Err(e), _) => {
                    tracing::warn!(error = %e, "pool manager statistics unavailable")
                }
                Event::Control(Control::Stats(reply)) => {
                    let now = self.now();
                    // The caller may have given up waiting.
                    let _ = reply.send(self.dir.stats(now));
                }
                Event::Control(Control::Metrics(reply)) => {
                    // The scrape may have given up waiting.
                    let _ = reply.send(self.metrics_snapshot());
                }
            }
        }
    }

    /// Logs the pins held past the threshold, if any (DESIGN §4: long-held
    /// pins are reported in the stats and the log): a reader that never
    /// unpins keeps its pages from being freed, and only an operator can
    /// end its session.
    fn report_long_held_pins(&mut self) {
        let long = self.dir.long_held_pins(self.now());
        if long.count == 0 {
            return;
        }
        // `oldest` is empty when the stats list none (`long_held_pins_listed`
        // 0): the count is still worth a line.
        let oldest = long.oldest.first();
        tracing::warn!(
            pins = long.count,
            threshold_s = long.threshold.as_secs(),
            oldest_session = oldest.map(|o| o.session.0),
            oldest_instance = oldest.map(|o| tracing::field::display(&o.instance)),
            oldest_held_s = oldest.map(|o| o.held_for.as_secs()),
            "keys pinned longer than the threshold: their pages cannot be freed \
             (`cxlkv stats` lists them; ending a session releases its pins)"
        );
    }

    fn complete_region(
        &mut self,
        c: Completion,
        failure: Option<&PoolServiceError>,
        out: Option<&mut Replies>,
    ) {
        if let Ok(r) = &c.result {
            self.regions.insert(r.body.handle.region);
        }
        let Some(p) = self.pending.remove(&c.deferred) else {
            return;
        };
        let Some(out) = out else {
            return;
        };
        let Some(s) = self
            .conns
            .get(&p.conn)
            .and_then(|conn| conn.session)
            .filter(|s| s.id == c.session)
        else {
            return;
        };
        match &c.result {
            Ok(r) => {
                let reply = self.granted(&s, &r.body, &r.notices, &r.usage);
                self.send(out, p.conn, p.request_id, &reply);
            }
            Err(DirectoryError::RegionAllocationFailed { reason }) => {
                // A refusal by the pool manager goes on with its code, limit
                // and message; the message alone, since the reply carries
                // the code and the limit (`reason` is the whole error,
                // `… (code 12, limit N)`, which the client's rendering
                // then followed with `(limit N)` again).
                let e = match failure.and_then(|f| f.error_code().map(|c| (c, f))) {
                    Some((code, f)) => ErrorReply::new(
                        code,
                        format!("region allocation failed: pool manager: {}", f.message),
                        f.limit,
                    ),
                    None => ErrorReply::new(
                        ErrorCode::OutOfSpace,
                        format!("region allocation failed: {reason}"),
                        0,
                    ),
                };
                self.send_error(out, p.conn, p.request_id, &e);
            }
            Err(e) => {
                let reply = wire::directory_error(e);
                self.send_error(out, p.conn, p.request_id, &reply);
            }
        }
        self.record_latency(OpKind::RequestRegion, p.started.elapsed());
    }
}

/// The frame sent to a connection refused at accept.
fn refusal(reply: &ErrorReply) -> Option<Refusal> {
    let mut buf = Vec::new();
    proto::encode(0, reply, &mut buf).ok()?;
    let mut plen = [0u8; 4];
    plen.copy_from_slice(&buf[16..20]);
    let payload_len = u32::from_le_bytes(plen) as usize;
    Some(Refusal {
        kind: Kind::ErrorReply.as_u16(),
        payload: buf[HEADER_BYTES..HEADER_BYTES + payload_len].to_vec(),
    })
}

/// A peer that came over TCP (authenticated by the secret, not its uid).
fn is_tcp(peer: &PeerInfo) -> bool {
    !matches!(peer, PeerInfo::Unix(_))
}

fn unexpected_reply(reply: &PoolReply) -> PoolServiceError {
    PoolServiceError::new(
        ErrorCode::Internal,
        format!("unexpected pool manager answer {reply:?}"),
        0,
    )
}

impl Handler for DirectoryHandler {
    fn on_connect(&mut self, conn: ConnId, peer: &PeerInfo) -> Admit {
        // Unauthenticated TCP peers cannot take every slot: Unix clients
        // and sessions keep the rest.
        debug_assert_eq!(self.sessionless_tcp, self.count_sessionless_tcp());
        if is_tcp(peer) && self.sessionless_tcp >= self.max_sessionless_tcp {
            let limit = self.max_sessionless_tcp;
            tracing::debug!(peer = ?peer, limit, "TCP connection refused: too many without a session");
            let reply = ErrorReply::new(
                ErrorCode::Busy,
                format!("{limit} TCP connections without a session already; open one with Hello"),
                limit as u64,
            );
            return Admit::Refuse(refusal(&reply));
        }
        if self.hello_deadlines.len() >= 2 * self.conns.len().max(16) {
            // Mostly entries of connections gone or in session: drop them
            // (amortised: the queue at least halves, so this runs once per
            // as many accepts as it keeps).
            let conns = &self.conns;
            self.hello_deadlines
                .retain(|(_, c)| conns.get(c).is_some_and(|c| c.session.is_none()));
        }
        self.hello_deadlines
            .push_back((Instant::now() + self.hello_timeout, conn));
        debug_assert!(
            self.hello_deadlines.len() <= 2 * self.conns.len().max(16),
            "the hello-deadline queue outgrew its bound"
        );
        if is_tcp(peer) {
            self.sessionless_tcp += 1;
        }
        self.conns.insert(
            conn,
            Conn {
                peer: peer.clone(),
                session: None,
                info: None,
            },
        );
        Admit::Accept
    }

    fn on_refused(&mut self, _peer: &PeerInfo, why: RefuseReason) -> Option<Refusal> {
        let RefuseReason::TooManyConnections { limit } = why else {
            return None;
        };
        let reply = ErrorReply::new(
            ErrorCode::Busy,
            format!("connection limit reached ({limit})"),
            limit as u64,
        );
        refusal(&reply)
    }

    fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies) {
        let started = Instant::now();
        let request_id = frame.header.request_id;
        let req = match proto::decode_request(frame) {
            Ok(req) => req,
            Err(e) => {
                tracing::debug!(conn = %conn, error = %e, "request refused at the edge");
                return self.send_error(out, conn, request_id, &e.to_reply());
            }
        };
        let op = Self::op_of(req.kind());
        if let Some(info) = self.conns.get_mut(&conn).and_then(|c| c.info.as_mut()) {
            info.last_request = started;
            info.requests += 1;
        }
        let deferred = self.dispatch(conn, request_id, req, out, started);
        // Every request answered now is counted here, `RequestRegion`
        // included (a refusal, a grant from the directory's free space, a
        // retry answered from the reply cache); one waiting for the pool
        // manager is counted when its answer is queued (`complete_region`).
        if let Some(op) = op
            && !deferred
        {
            self.record_latency(op, started.elapsed());
        }
    }

    fn on_rejected(
        &mut self,
        conn: ConnId,
        header: FrameHeader,
        why: Rejection,
        out: &mut Replies,
    ) {
        let reply = match why {
            Rejection::Frame(e) => ProtoError::Frame(e).to_reply(),
            Rejection::TooManyInFlight { limit } => ErrorReply::new(
                ErrorCode::Busy,
                format!("{limit} requests already in flight on this connection"),
                limit as u64,
            ),
            Rejection::DuplicateRequestId => ErrorReply::new(
                ErrorCode::InvalidArgument,
                format!(
                    "request id {} is already in flight on this connection",
                    header.request_id
                ),
                0,
            ),
            other => ErrorReply::new(ErrorCode::Internal, format!("{other:?}"), 0),
        };
        self.send_error(out, conn, header.request_id, &reply);
    }

    fn on_disconnect(&mut self, conn: ConnId, why: &DisconnectReason) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        // Region replies deferred for this connection can no longer be
        // sent; the directory may drop their waiters without completing
        // them (a retry from a later session frees their places:
        // reliability defect 140), so they go now rather than on a
        // completion that may never come.
        self.pending.retain(|_, p| p.conn != conn);
        if c.session.is_none() && is_tcp(&c.peer) {
            self.sessionless_tcp -= 1;
        }
        if let Some(s) = c.session {
            tracing::debug!(conn = %conn, session = %s.id, reason = ?why, "session's connection closed");
            self.sessions.remove(&s.id);
            if matches!(why, DisconnectReason::Shutdown) {
                self.shutdown_closed += 1;
            }
            let now = self.now();
            self.dir.session_closed(s.id, now);
            self.apply_effects(None);
        }
    }

    fn on_wake(&mut self, out: &mut Replies) {
        self.run_events(out);
    }
}
