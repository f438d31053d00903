//! The server side: one event-loop thread owns every socket and calls a
//! [`Handler`] for each connection event and each complete frame.
//!
//! Backend-independent logic lives here in `Core`: the connection table,
//! frame delivery with its in-flight bound, routing of replies (including
//! those posted by other threads through a [`Completer`]), the bounded send
//! queue, close bookkeeping and the fault-injection hook. The two backends
//! (`uring`, `epoll`) only move bytes between sockets and `Core` and decide
//! how the loop waits.
//!
//! Invariants:
//! - A [`ConnId`] names one connection for its whole life: slots are reused,
//!   but each reuse bumps a generation, so a late reply to a closed
//!   connection is dropped instead of reaching its successor.
//! - `Handler::on_disconnect` runs exactly once per admitted connection, and
//!   no callback names that connection afterwards.
//! - Every queue is bounded: frames in flight per connection
//!   (`max_inflight_per_conn`), bytes queued per connection
//!   (`max_send_queue_bytes`, overflow drops that connection), completions
//!   posted from other threads (`max_pending_completions`).
//! - A connection's in-flight entry is removed only by a reply to that
//!   request, never by the rejection of another frame that carries its id.
//! - A connection leaves `Open` for good: it then reads nothing more
//!   (`ConnState`), and it is closed within `partial_frame_timeout_ms` even
//!   if its peer never takes its last replies.
//!
//! **Closing.** The handler closes a connection after the replies queued
//! before it (`Draining`). A peer that ends its stream (`recv` returns 0:
//! it may only have shut down its writing half after pipelining requests)
//! still gets every reply — those queued and those of its requests in
//! flight — and then end of stream (`InputEnded`), unless it is gone
//! altogether (a Unix peer that closed its socket: `POLLHUP`), which closes
//! at once as before. A write that fails closes at once either way.

pub(crate) mod epoll;
pub(crate) mod uring;

use std::collections::{HashMap, VecDeque, hash_map};
use std::fmt;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::net::TcpListener;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::TransportError;
use super::config::{Backend, Endpoint, ServerConfig};
use super::sys::{self, MAX_FDS_PER_FRAME, PeerCred};
use crate::frame::{
    Decoded, Frame, FrameDecoder, FrameError, FrameHeader, HEADER_BYTES, PROTOCOL_VERSION,
    encode_frame, frame_len,
};

#[cfg(feature = "fault-injection")]
use super::fault::{FaultPlan, ReplyFault, ReplyInfo, RequestFault, RequestInfo};

/// Names one connection for its whole life (slot + generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

impl ConnId {
    fn new(slot: u32, generation: u32) -> Self {
        Self(u64::from(generation) << 32 | u64::from(slot))
    }
    fn slot(self) -> u32 {
        self.0 as u32
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
    #[cfg(all(test, feature = "fault-injection"))]
    pub(crate) fn for_tests(raw: u64) -> Self {
        Self(raw)
    }

    /// A stable number for logs.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn#{}.{}", self.slot(), self.generation())
    }
}

/// Who is on the other end, as the kernel reports it (never from payloads).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerInfo {
    /// A Unix-socket peer and its `SO_PEERCRED` credentials.
    Unix(PeerCred),
    /// A TCP peer address.
    Tcp(SocketAddr),
}

impl PeerInfo {
    /// Descriptors can only be passed to Unix-socket peers.
    pub fn can_receive_fds(&self) -> bool {
        matches!(self, PeerInfo::Unix(_))
    }
}

/// A frame the transport sends (request id 0) before closing a connection it
/// refuses; the handler builds the payload, the transport knows no messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: u16,
    pub payload: Vec<u8>,
}

/// Answer of [`Handler::on_connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    Accept,
    /// Close the connection, after sending the refusal frame if there is one.
    Refuse(Option<Refusal>),
}

/// Why the transport refused a connection before the handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefuseReason {
    TooManyConnections { limit: usize },
}

/// Why a frame with an intact header was not delivered to `on_frame`. The
/// handler answers `header.request_id` with an error reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// Wrong protocol version or oversized payload (payload skipped).
    Frame(FrameError),
    /// The connection already has `limit` requests in flight.
    TooManyInFlight { limit: usize },
    /// A request with this id is already in flight on this connection. The
    /// original stays in flight, untouched, and gets its own reply later.
    /// The rejection reply necessarily carries the same request id (it is
    /// all the peer can match); the peer tells the two apart by order — the
    /// rejection is queued when the duplicate arrives, while the original
    /// is still unanswered, so it reaches the peer first (unless a fault
    /// plan reorders replies) — and by content (the handler's error names
    /// the reason). An [`RpcClient`](super::RpcClient) never reuses an id
    /// in flight; only a raw or broken peer sees this.
    DuplicateRequestId,
}

/// Why a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DisconnectReason {
    /// The peer closed its end (possibly in the middle of a frame). A peer
    /// that only ended its stream (`shutdown(SHUT_WR)`) hears this once the
    /// replies to its requests were written.
    PeerClosed,
    /// Bytes that are not our framing (bad magic, reserved bits).
    Protocol(FrameError),
    /// The peer stopped reading and its queue overflowed.
    SendQueueFull { limit_bytes: usize },
    /// A frame stayed incomplete longer than `partial_frame_timeout_ms`.
    PartialFrameTimeout,
    /// No frame arrived for `idle_timeout_ms`, nothing in flight.
    IdleTimeout,
    /// The handler (or an admission refusal) closed it.
    ClosedByServer,
    /// A socket error.
    Io(io::ErrorKind),
    /// The fault-injection plan reset it.
    FaultReset,
    /// The server is shutting down.
    Shutdown,
    /// The connection was closing (closed by the handler, or its peer had
    /// ended its stream) and did not take its last replies within
    /// `partial_frame_timeout_ms`: a peer that stops (or is slow) reading,
    /// or a request of the handler's still unanswered then (a deferred
    /// one), whose reply is dropped.
    DrainTimeout,
}

/// Callbacks of the event loop; all run on the loop thread, one at a time.
/// They must not block: slow work goes to another thread, which answers
/// through a [`Completer`].
pub trait Handler: Send + 'static {
    /// A connection arrived (within `max_connections`).
    fn on_connect(&mut self, conn: ConnId, peer: &PeerInfo) -> Admit {
        let _ = (conn, peer);
        Admit::Accept
    }
    /// The transport refused a connection on its own (connection limit). The
    /// returned frame, if any, is sent best-effort before closing.
    fn on_refused(&mut self, peer: &PeerInfo, why: RefuseReason) -> Option<Refusal> {
        let _ = (peer, why);
        None
    }
    /// One complete request. Answer now through `out`, or later through a
    /// [`Completer`]; the request counts as in flight until a frame with its
    /// request id is queued for this connection (other than the rejection
    /// of a later frame that reuses its id).
    fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies);
    /// A request the transport refused (see [`Rejection`]); the connection
    /// stays open. Build an error reply for `header.request_id`.
    fn on_rejected(&mut self, conn: ConnId, header: FrameHeader, why: Rejection, out: &mut Replies);
    /// The connection is gone; replies to it are dropped from now on.
    fn on_disconnect(&mut self, conn: ConnId, why: &DisconnectReason) {
        let _ = (conn, why);
    }
    /// Another thread called [`Completer::wake`].
    fn on_wake(&mut self, out: &mut Replies) {
        let _ = out;
    }
}

/// A reply the loop will send (encoded frame + descriptors).
pub(crate) struct OutFrame {
    pub conn: ConnId,
    pub request_id: u64,
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    /// Already passed through the fault plan (delayed or held frames).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub faulted: bool,
}

impl OutFrame {
    #[cfg(feature = "fault-injection")]
    fn kind(&self) -> u16 {
        u16::from_le_bytes([self.bytes[6], self.bytes[7]])
    }
}

pub(crate) enum Action {
    Send(OutFrame),
    Close(ConnId),
}

/// What went wrong queueing a reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("{count} descriptors on one frame (at most {MAX_FDS_PER_FRAME})")]
    TooManyFds { count: usize },
    /// A frame handed over whole ([`Replies::send_frame`]) is not one: it
    /// is shorter than a header, or its length disagrees with its header's
    /// (a header that is corrupt or of another version is `Frame`).
    #[error("a {len}-byte frame does not match its header: {detail}")]
    NotAFrame { len: usize, detail: String },
    #[error("the server is shutting down")]
    Stopped,
    #[error("{limit} completions already pending")]
    Full { limit: usize },
    #[error("cannot queue a completion: {0}")]
    Wake(io::Error),
}

/// Replies and closes produced by one handler call, applied in order after it
/// returns.
#[derive(Default)]
pub struct Replies {
    actions: Vec<Action>,
}

impl fmt::Debug for Replies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replies")
            .field("queued", &self.actions.len())
            .finish()
    }
}

fn encode(kind: u16, request_id: u64, payload: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut bytes = Vec::new();
    encode_frame(&mut bytes, kind, request_id, payload)?;
    Ok(bytes)
}

/// The header of `frame` if it is one whole frame of this protocol version.
fn check_frame(frame: &[u8]) -> Result<FrameHeader, ReplyError> {
    let not_a_frame = |detail: String| ReplyError::NotAFrame {
        len: frame.len(),
        detail,
    };
    let Some(head) = frame.first_chunk::<HEADER_BYTES>() else {
        return Err(not_a_frame(format!(
            "shorter than a {HEADER_BYTES}-byte header"
        )));
    };
    let header = FrameHeader::decode(head)?;
    if header.version != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion {
            found: header.version,
        }
        .into());
    }
    // Checks the size limit too.
    FrameHeader::new(header.kind, header.request_id, header.payload_len as usize)?;
    let expected = frame_len(header.payload_len as usize);
    if frame.len() != expected {
        return Err(not_a_frame(format!(
            "its header announces a {expected}-byte frame"
        )));
    }
    Ok(header)
}

impl Replies {
    /// Queues a reply frame for `conn`. Replies to closed connections are
    /// dropped silently (counted in the server stats).
    pub fn send(
        &mut self,
        conn: ConnId,
        kind: u16,
        request_id: u64,
        payload: &[u8],
    ) -> Result<(), ReplyError> {
        let bytes = encode(kind, request_id, payload)?;
        self.actions.push(Action::Send(OutFrame {
            conn,
            request_id,
            bytes,
            fds: Vec::new(),
            faulted: false,
        }));
        Ok(())
    }

    /// Queues a reply that carries descriptors (`SCM_RIGHTS`; Unix peers
    /// only — see [`PeerInfo::can_receive_fds`]). The transport closes its
    /// copies once they are sent.
    pub fn send_with_fds(
        &mut self,
        conn: ConnId,
        kind: u16,
        request_id: u64,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(), ReplyError> {
        if fds.len() > MAX_FDS_PER_FRAME {
            return Err(ReplyError::TooManyFds { count: fds.len() });
        }
        let bytes = encode(kind, request_id, payload)?;
        self.actions.push(Action::Send(OutFrame {
            conn,
            request_id,
            bytes,
            fds,
            faulted: false,
        }));
        Ok(())
    }

    /// Queues a whole frame the handler encoded itself (header, payload,
    /// padding, as [`encode_frame`] lays them out) without copying it: for
    /// large replies, which would otherwise be encoded once by the handler
    /// and copied into a new frame here. The header is checked (magic,
    /// version, length against the frame's); the payload is the handler's.
    /// The buffer is shrunk to the frame (in place, no copy, with glibc):
    /// send queues are bounded by the bytes they hold, so a queued frame
    /// must not keep a larger allocation alive.
    pub fn send_frame(
        &mut self,
        conn: ConnId,
        mut frame: Vec<u8>,
        fds: Vec<OwnedFd>,
    ) -> Result<(), ReplyError> {
        if fds.len() > MAX_FDS_PER_FRAME {
            return Err(ReplyError::TooManyFds { count: fds.len() });
        }
        let header = check_frame(&frame)?;
        frame.shrink_to_fit();
        self.actions.push(Action::Send(OutFrame {
            conn,
            request_id: header.request_id,
            bytes: frame,
            fds,
            faulted: false,
        }));
        Ok(())
    }

    /// Closes `conn` once the replies queued before this call are sent; no
    /// further request of it is delivered.
    pub fn close(&mut self, conn: ConnId) {
        self.actions.push(Action::Close(conn));
    }

    fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }
}

/// State shared between the loop and [`Completer`]s.
pub(crate) struct Shared {
    queue: Mutex<Vec<Action>>,
    /// Set when `queue` is non-empty or a wake was asked for; lets a spinning
    /// loop poll one atomic instead of a lock.
    has_work: AtomicBool,
    wake_handler: AtomicBool,
    /// The loop is (about to be) blocked in the kernel and needs the eventfd.
    sleeping: AtomicBool,
    pub(crate) stop: AtomicBool,
    pub(crate) eventfd: OwnedFd,
    max_pending: usize,
    pub(crate) stats: ServerStats,
}

impl Shared {
    fn new(max_pending: usize) -> io::Result<Self> {
        Ok(Self {
            queue: Mutex::new(Vec::new()),
            has_work: AtomicBool::new(false),
            wake_handler: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            eventfd: sys::eventfd()?,
            max_pending,
            stats: ServerStats::default(),
        })
    }

    /// Wakes the loop if it sleeps. SeqCst pairs with `Core::prepare_sleep`:
    /// either the loop sees `has_work`, or this sees `sleeping` (Dekker).
    fn notify(&self) -> io::Result<()> {
        self.has_work.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            sys::eventfd_signal(self.eventfd.as_fd())?;
        }
        Ok(())
    }

    pub(crate) fn request_stop(&self) -> io::Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        self.notify()
    }
}

/// A thread-safe, cloneable handle that posts replies to the loop from other
/// threads (after a journal sync, a pool-manager round trip, ...) or wakes it
/// so that [`Handler::on_wake`] runs. Posting never blocks on the loop.
#[derive(Clone)]
pub struct Completer {
    shared: Arc<Shared>,
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer").finish_non_exhaustive()
    }
}

impl Completer {
    fn post(&self, action: Action) -> Result<(), ReplyError> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(ReplyError::Stopped);
        }
        {
            let mut q = self.shared.queue.lock();
            if q.len() >= self.shared.max_pending {
                return Err(ReplyError::Full {
                    limit: self.shared.max_pending,
                });
            }
            q.push(action);
        }
        self.shared.notify().map_err(ReplyError::Wake)
    }

    /// Posts a reply for `conn` (same rules as [`Replies::send`]).
    pub fn complete(
        &self,
        conn: ConnId,
        kind: u16,
        request_id: u64,
        payload: &[u8],
    ) -> Result<(), ReplyError> {
        let bytes = encode(kind, request_id, payload)?;
        self.post(Action::Send(OutFrame {
            conn,
            request_id,
            bytes,
            fds: Vec::new(),
            faulted: false,
        }))
    }

    /// Posts a reply with descriptors (same rules as [`Replies::send_with_fds`]).
    pub fn complete_with_fds(
        &self,
        conn: ConnId,
        kind: u16,
        request_id: u64,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(), ReplyError> {
        if fds.len() > MAX_FDS_PER_FRAME {
            return Err(ReplyError::TooManyFds { count: fds.len() });
        }
        let bytes = encode(kind, request_id, payload)?;
        self.post(Action::Send(OutFrame {
            conn,
            request_id,
            bytes,
            fds,
            faulted: false,
        }))
    }

    /// Closes `conn` after the replies posted before this call.
    pub fn close(&self, conn: ConnId) -> Result<(), ReplyError> {
        self.post(Action::Close(conn))
    }

    /// Makes the loop call [`Handler::on_wake`] (coalesced: several wakes
    /// before the loop notices give one call).
    pub fn wake(&self) -> Result<(), ReplyError> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(ReplyError::Stopped);
        }
        self.shared.wake_handler.store(true, Ordering::SeqCst);
        self.shared.notify().map_err(ReplyError::Wake)
    }
}

/// Counters of a running server (monotonic; read with [`ServerHandle::stats`]).
#[derive(Debug, Default)]
pub struct ServerStats {
    pub accepted: AtomicU64,
    pub refused: AtomicU64,
    pub disconnected: AtomicU64,
    pub frames_in: AtomicU64,
    pub frames_rejected: AtomicU64,
    pub replies_queued: AtomicU64,
    /// Replies addressed to connections that were already closed.
    pub replies_to_closed: AtomicU64,
    /// Connections dropped because they stopped reading.
    pub slow_reader_drops: AtomicU64,
    /// Connections closed for corrupt framing.
    pub protocol_drops: AtomicU64,
    /// Replies the fault plan dropped, delayed, duplicated or held back, and
    /// connections it reset.
    pub faults_applied: AtomicU64,
    /// io_uring with provided buffers (`RecvMode::Provided`): receives that
    /// found every live provided buffer in use (each grows the live set, up
    /// to `recv_buffer_count`, and re-arms). Always 0 with direct receives.
    pub recv_buffers_exhausted: AtomicU64,
    /// Receives made with a plain `recv` on the connection the loop polls
    /// while it spins ([`IoConfig::spin_recv`](super::IoConfig::spin_recv)).
    pub polled_reads: AtomicU64,
}

/// What one [`Core::recv_once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvOnce {
    /// `n` bytes arrived, of the `asked` there was room for, and the frames
    /// they complete were delivered.
    Read { n: usize, asked: usize },
    /// Nothing to read now.
    Empty,
    /// A signal interrupted the call: nothing read, try again.
    Interrupted,
    /// The connection takes no more input: not `Open` (any more), its
    /// stream ended, or the receive failed and closed it.
    Over,
}

/// How long the polled connection may send nothing before the loop goes
/// back to waiting for it through its backend ([`Polled`]).
pub(crate) const POLLED_IDLE: Duration = Duration::from_micros(50);

/// The connection a spinning loop reads with plain non-blocking `recv`s
/// ([`IoConfig::spin_recv`](super::IoConfig::spin_recv), the module essay
/// of `transport`): the last one a request arrived on, while it keeps
/// sending. At most one, so the extra `recv` a turn costs stays one
/// system call however many connections there are. The backend reads it
/// with [`Polled::poll`] every turn and stops when [`Polled::poll`] says
/// it went idle, when the loop is about to sleep, or when it closes; the
/// io_uring backend keeps no receive in the ring for it meanwhile.
#[derive(Debug, Default)]
pub(crate) struct Polled {
    current: Option<(ConnId, Instant)>,
}

/// What one [`Polled::poll`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PolledRead {
    /// No connection is polled.
    None,
    /// Bytes arrived and were processed.
    Read,
    /// Nothing yet; still polled.
    Empty,
    /// Nothing for [`POLLED_IDLE`]: the caller stops polling it
    /// ([`Polled::take`]) and waits for it through its backend again.
    Idle,
    /// The connection takes no more input (closed, ended, or gone); it is
    /// no longer polled.
    Over,
}

impl Polled {
    /// The connection a request just arrived on becomes the polled one if
    /// none is. True if it did (or already was).
    pub(crate) fn offer(&mut self, id: ConnId, now: Instant) -> bool {
        match self.current {
            None => {
                self.current = Some((id, now));
                true
            }
            Some((cur, _)) => cur == id,
        }
    }

    /// The polled connection, if one is polled (it may have closed since:
    /// [`Polled::poll`] finds out).
    pub(crate) fn id(&self) -> Option<ConnId> {
        self.current.map(|(id, _)| id)
    }

    /// The connection in `slot` is being released: if it is the polled
    /// one, it is no longer (the slot's next connection is not it).
    pub(crate) fn forget_slot(&mut self, slot: u32) {
        if self.current.is_some_and(|(id, _)| id.slot() == slot) {
            self.current = None;
        }
    }

    /// Stops polling; returns the connection that was polled.
    pub(crate) fn take(&mut self) -> Option<ConnId> {
        self.current.take().map(|(id, _)| id)
    }

    /// One non-blocking `recv` from the polled connection, if any.
    pub(crate) fn poll<H: Handler>(&mut self, core: &mut Core<H>, now: Instant) -> PolledRead {
        let Some((id, last_data)) = self.current else {
            return PolledRead::None;
        };
        if core.conn_mut(id.slot()).map(|c| c.id) != Some(id) {
            self.current = None;
            return PolledRead::Over;
        }
        match core.recv_once(id.slot(), now, POLLED_RECV_ROOM) {
            RecvOnce::Read { .. } => {
                ServerStats::bump(&core.shared.stats.polled_reads);
                self.current = Some((id, now));
                PolledRead::Read
            }
            RecvOnce::Empty | RecvOnce::Interrupted => {
                if now.saturating_duration_since(last_data) > POLLED_IDLE {
                    PolledRead::Idle
                } else {
                    PolledRead::Empty
                }
            }
            RecvOnce::Over => {
                self.current = None;
                PolledRead::Over
            }
        }
    }
}

/// Room a polled `recv` asks the decoder for: as much as a receive
/// through either backend takes at once.
const POLLED_RECV_ROOM: usize = 64 << 10;

/// A plain copy of [`ServerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStatsSnapshot {
    pub accepted: u64,
    pub refused: u64,
    pub disconnected: u64,
    pub frames_in: u64,
    pub frames_rejected: u64,
    pub replies_queued: u64,
    pub replies_to_closed: u64,
    pub slow_reader_drops: u64,
    pub protocol_drops: u64,
    pub faults_applied: u64,
    pub recv_buffers_exhausted: u64,
    pub polled_reads: u64,
}

impl ServerStats {
    // Relaxed throughout: counters are independent monotonic tallies read
    // for reporting; no other memory is published through them.
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    pub fn snapshot(&self) -> ServerStatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServerStatsSnapshot {
            accepted: l(&self.accepted),
            refused: l(&self.refused),
            disconnected: l(&self.disconnected),
            frames_in: l(&self.frames_in),
            frames_rejected: l(&self.frames_rejected),
            replies_queued: l(&self.replies_queued),
            replies_to_closed: l(&self.replies_to_closed),
            slow_reader_drops: l(&self.slow_reader_drops),
            protocol_drops: l(&self.protocol_drops),
            faults_applied: l(&self.faults_applied),
            recv_buffers_exhausted: l(&self.recv_buffers_exhausted),
            polled_reads: l(&self.polled_reads),
        }
    }
}

/// Bytes queued for one socket, in order. Descriptors travel with the first
/// `sendmsg` that carries their frame's first byte, and such a frame is sent
/// alone in its `sendmsg`, so the receiver can tie them to it (see
/// `client.rs`).
#[derive(Default)]
pub(crate) struct SendQueue {
    frames: VecDeque<OutFrame>,
    /// Bytes of the front frame already written.
    front_offset: usize,
    bytes: usize,
}

/// Most frames gathered into one `sendmsg`.
pub(crate) const MAX_IOVECS: usize = 64;
/// Most bytes moved into one io_uring send (unless a single frame is larger).
pub(crate) const MAX_BATCH_BYTES: usize = 256 << 10;

impl SendQueue {
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn push(&mut self, f: OutFrame) {
        self.bytes += f.bytes.len();
        self.frames.push_back(f);
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.front_offset = 0;
        self.bytes = 0;
    }

    /// The unsent bytes of the only queued frame, if it is alone and has no
    /// descriptors to attach (the common reply: one plain `send` will do).
    pub fn lone_frame(&self) -> Option<&[u8]> {
        if self.frames.len() != 1 {
            return None;
        }
        let f = self.frames.front()?;
        // `advance` drops descriptors once their first byte is sent.
        f.fds.is_empty().then(|| &f.bytes[self.front_offset..])
    }

    /// Fills `iov` with the next run of bytes to write and returns the
    /// descriptors to attach (only ever for a frame sent alone, from its
    /// first byte).
    pub fn gather<'a>(&'a self, iov: &mut Vec<IoSlice<'a>>, fds: &mut Vec<RawFd>) {
        iov.clear();
        fds.clear();
        for (i, f) in self.frames.iter().enumerate() {
            let off = if i == 0 { self.front_offset } else { 0 };
            let carries_fds = off == 0 && !f.fds.is_empty();
            if carries_fds && i > 0 {
                break;
            }
            iov.push(IoSlice::new(&f.bytes[off..]));
            if carries_fds {
                fds.extend(f.fds.iter().map(AsRawFd::as_raw_fd));
                break;
            }
            if iov.len() == MAX_IOVECS {
                break;
            }
        }
    }

    /// Moves the next run of frames to write into `out` (same grouping as
    /// `gather`, at most `MAX_BATCH_BYTES` unless one frame is larger), for
    /// a backend whose writes outlive this call (io_uring). Only valid while
    /// nothing was partially written through `advance`.
    pub fn pop_batch(&mut self, out: &mut Vec<OutFrame>) {
        debug_assert_eq!(self.front_offset, 0);
        let mut bytes = 0;
        while let Some(f) = self.frames.front() {
            let carries_fds = !f.fds.is_empty();
            if !out.is_empty()
                && (carries_fds
                    || bytes + f.bytes.len() > MAX_BATCH_BYTES
                    || out.len() == MAX_IOVECS)
            {
                break;
            }
            let f = self.frames.pop_front().expect("front exists");
            bytes += f.bytes.len();
            self.bytes -= f.bytes.len();
            out.push(f);
            if carries_fds {
                break;
            }
        }
    }

    /// Records that `n` bytes were written; closes sent descriptors.
    pub fn advance(&mut self, mut n: usize) {
        self.bytes -= n;
        while n > 0 {
            let front = self
                .frames
                .front_mut()
                .expect("advance past the queued bytes");
            if self.front_offset == 0 {
                // The kernel took its own references with the first byte.
                front.fds.clear();
            }
            let left = front.bytes.len() - self.front_offset;
            if n < left {
                self.front_offset += n;
                return;
            }
            n -= left;
            self.front_offset = 0;
            self.frames.pop_front();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnState {
    Open,
    /// The peer ended its stream: nothing more is read; replies to its
    /// requests in flight are still taken, and the connection closes
    /// (`PeerClosed`) once none is in flight and every reply is written.
    InputEnded,
    /// Closing once the send queue is empty (the handler closed it); input
    /// is ignored and new replies are dropped.
    Draining,
    /// Closed from the handler's point of view; the backend tears it down.
    Dead,
}

/// What `Core` knows about an in-flight request.
#[derive(Clone, Copy)]
struct InFlight {
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    kind: u16,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    nth_of_kind: u64,
}

pub(crate) struct Conn {
    pub fd: OwnedFd,
    pub id: ConnId,
    pub decoder: FrameDecoder,
    pub sendq: SendQueue,
    pub state: ConnState,
    /// Keyed by the client's request ids: a randomly seeded hash (a peer
    /// cannot aim collisions at it), foldhash rather than std's SipHash
    /// because it is probed twice per request.
    inflight: HashMap<u64, InFlight, foldhash::fast::RandomState>,
    partial_since: Option<Instant>,
    /// When its last frame arrived (or it was accepted): `idle_timeout_ms`.
    last_frame: Instant,
    /// When the connection left `Open` (`InputEnded` or `Draining`): it is
    /// closed `partial_frame_timeout_ms` later if still there.
    closing_since: Option<Instant>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    frames_in: u64,
    /// A reply held back to be sent after the next one (fault: reorder).
    #[cfg(feature = "fault-injection")]
    held: Option<(Instant, OutFrame)>,
}

/// How long a reply held back for reordering waits for a successor.
#[cfg(feature = "fault-injection")]
const REORDER_MAX_HOLD: Duration = Duration::from_millis(200);

/// The backend-independent server state.
pub(crate) struct Core<H> {
    pub handler: H,
    pub cfg: ServerConfig,
    pub conns: Vec<Option<Conn>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    live: usize,
    pub shared: Arc<Shared>,
    scratch: Replies,
    /// Slots with newly queued output (may repeat; the backend dedups).
    pub dirty: Vec<u32>,
    /// Slots that became `Dead` and await teardown by the backend.
    pub dead: Vec<u32>,
    /// Slots that left `Open` (they read nothing more): the epoll backend
    /// stops watching their input; the io_uring backend has nothing to do.
    pub input_closed: Vec<u32>,
    /// When `run_timers` has something to do next (None: nothing pending).
    next_timer_at: Option<Instant>,
    #[cfg(feature = "fault-injection")]
    fault: Option<Box<dyn FaultPlan>>,
    #[cfg(feature = "fault-injection")]
    delayed: Vec<(Instant, OutFrame)>,
    #[cfg(feature = "fault-injection")]
    kind_counts: HashMap<u16, u64>,
    #[cfg(feature = "fault-injection")]
    replies_total: u64,
}

impl<H: Handler> Core<H> {
    fn new(handler: H, cfg: ServerConfig, shared: Arc<Shared>) -> Self {
        Self {
            handler,
            cfg,
            conns: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            live: 0,
            shared,
            scratch: Replies::default(),
            dirty: Vec::new(),
            dead: Vec::new(),
            input_closed: Vec::new(),
            next_timer_at: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
            #[cfg(feature = "fault-injection")]
            delayed: Vec::new(),
            #[cfg(feature = "fault-injection")]
            kind_counts: HashMap::new(),
            #[cfg(feature = "fault-injection")]
            replies_total: 0,
        }
    }

    pub fn conn_mut(&mut self, slot: u32) -> Option<&mut Conn> {
        self.conns.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Admits a freshly accepted socket, or refuses it. Returns its slot.
    pub fn admit(&mut self, fd: OwnedFd, peer: PeerInfo) -> Option<u32> {
        if self.live >= self.cfg.max_connections {
            ServerStats::bump(&self.shared.stats.refused);
            let why = RefuseReason::TooManyConnections {
                limit: self.cfg.max_connections,
            };
            if let Some(r) = self.handler.on_refused(&peer, why) {
                send_refusal(&fd, &r);
            }
            return None;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                (self.conns.len() - 1) as u32
            }
        };
        let id = ConnId::new(slot, self.generations[slot as usize]);
        match self.handler.on_connect(id, &peer) {
            Admit::Accept => {}
            Admit::Refuse(r) => {
                ServerStats::bump(&self.shared.stats.refused);
                if let Some(r) = r {
                    send_refusal(&fd, &r);
                }
                self.free.push(slot);
                return None;
            }
        }
        ServerStats::bump(&self.shared.stats.accepted);
        self.live += 1;
        let now = Instant::now();
        if let Some(idle) = self.cfg.idle_timeout_ms {
            self.schedule(now + Duration::from_millis(idle));
        }
        self.conns[slot as usize] = Some(Conn {
            fd,
            id,
            decoder: FrameDecoder::new(),
            sendq: SendQueue::default(),
            state: ConnState::Open,
            inflight: HashMap::default(),
            partial_since: None,
            last_frame: now,
            closing_since: None,
            frames_in: 0,
            #[cfg(feature = "fault-injection")]
            held: None,
        });
        Some(slot)
    }

    /// One non-blocking `recv` from `slot`'s socket straight into its
    /// decoder (with room for at least `room` bytes), and the frames it
    /// completes delivered. End of stream and errors are acted on here.
    pub fn recv_once(&mut self, slot: u32, now: Instant, room: usize) -> RecvOnce {
        let Some(conn) = self.conn_mut(slot) else {
            return RecvOnce::Over;
        };
        if conn.state != ConnState::Open {
            return RecvOnce::Over;
        }
        let spare = conn.decoder.spare(room);
        let asked = spare.len();
        match sys::recv(conn.fd.as_fd(), spare) {
            Ok(0) => {
                let gone = sys::peer_hung_up(conn.fd.as_fd());
                self.input_ended(slot, now, gone);
                RecvOnce::Over
            }
            Ok(n) => {
                conn.decoder.filled(n);
                self.process_input(slot, now);
                RecvOnce::Read { n, asked }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => RecvOnce::Empty,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => RecvOnce::Interrupted,
            Err(e) => {
                self.close(slot, DisconnectReason::Io(e.kind()));
                RecvOnce::Over
            }
        }
    }

    /// Decodes and delivers every complete frame buffered for `slot`.
    pub fn process_input(&mut self, slot: u32, now: Instant) {
        loop {
            let Some(conn) = self.conns.get_mut(slot as usize).and_then(Option::as_mut) else {
                return;
            };
            if conn.state != ConnState::Open {
                return;
            }
            let id = conn.id;
            let limit = self.cfg.max_inflight_per_conn;
            let mut out = std::mem::take(&mut self.scratch);
            let handler = &mut self.handler;
            let stats = &self.shared.stats;
            let mut fatal = None;
            // The request id this call's handler answered with a rejection.
            let mut rejected = None;
            #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
            let mut reset = false;
            match conn.decoder.decode() {
                Ok(None) => {
                    // Mid-frame includes a rejected frame's payload still
                    // being skipped: a peer that announced 4 GiB and
                    // stalled is timed out like any partial frame.
                    conn.partial_since = match (conn.decoder.mid_frame(), conn.partial_since) {
                        (false, _) => None,
                        (true, Some(t)) => Some(t),
                        (true, None) => Some(now),
                    };
                    if let Some(t) = conn.partial_since {
                        let due = t + Duration::from_millis(self.cfg.partial_frame_timeout_ms);
                        self.schedule(due);
                    }
                    self.scratch = out;
                    return;
                }
                Err(e) => fatal = Some(e),
                Ok(Some(Decoded::Rejected { header, error })) => {
                    ServerStats::bump(&stats.frames_rejected);
                    conn.partial_since = None;
                    conn.last_frame = now;
                    rejected = Some(header.request_id);
                    handler.on_rejected(id, header, Rejection::Frame(error), &mut out);
                }
                Ok(Some(Decoded::Frame(frame))) => {
                    ServerStats::bump(&stats.frames_in);
                    conn.frames_in += 1;
                    conn.partial_since = None;
                    conn.last_frame = now;
                    let rid = frame.header.request_id;
                    #[cfg(feature = "fault-injection")]
                    let nth_of_kind = {
                        let c = self.kind_counts.entry(frame.header.kind).or_insert(0);
                        *c += 1;
                        *c
                    };
                    #[cfg(not(feature = "fault-injection"))]
                    let nth_of_kind = 0;
                    #[cfg(feature = "fault-injection")]
                    if let Some(plan) = self.fault.as_mut() {
                        let info = RequestInfo {
                            conn: id,
                            header: frame.header,
                            nth_on_conn: conn.frames_in,
                        };
                        if plan.on_request(&info) == RequestFault::Reset {
                            reset = true;
                        }
                    }
                    if reset {
                        // Not delivered: the connection dies with it.
                    } else {
                        let full = conn.inflight.len() >= limit;
                        match conn.inflight.entry(rid) {
                            hash_map::Entry::Occupied(_) => {
                                ServerStats::bump(&stats.frames_rejected);
                                rejected = Some(rid);
                                handler.on_rejected(
                                    id,
                                    frame.header,
                                    Rejection::DuplicateRequestId,
                                    &mut out,
                                );
                            }
                            hash_map::Entry::Vacant(_) if full => {
                                ServerStats::bump(&stats.frames_rejected);
                                rejected = Some(rid);
                                handler.on_rejected(
                                    id,
                                    frame.header,
                                    Rejection::TooManyInFlight { limit },
                                    &mut out,
                                );
                            }
                            hash_map::Entry::Vacant(v) => {
                                v.insert(InFlight {
                                    kind: frame.header.kind,
                                    nth_of_kind,
                                });
                                handler.on_frame(id, frame, &mut out);
                            }
                        }
                    }
                }
            }
            if let Some(e) = fatal {
                self.scratch = out;
                ServerStats::bump(&self.shared.stats.protocol_drops);
                self.close(slot, DisconnectReason::Protocol(e));
                return;
            }
            if reset {
                self.scratch = out;
                ServerStats::bump(&self.shared.stats.faults_applied);
                self.reset(slot);
                return;
            }
            self.apply_replies(&mut out, now, rejected.map(|rid| (id, rid)));
            self.scratch = out;
        }
    }

    /// Applies the actions of one handler call (or a batch of completions).
    fn apply(&mut self, out: &mut Replies, now: Instant) {
        self.apply_replies(out, now, None);
    }

    /// [`Core::apply`] for a handler call that answered a rejected frame:
    /// a reply on `rejected`'s connection with its request id is the
    /// rejection, not the reply of a request in flight with that id (a
    /// duplicate's original), whose entry it must leave alone.
    fn apply_replies(&mut self, out: &mut Replies, now: Instant, rejected: Option<(ConnId, u64)>) {
        for action in out.actions.drain(..) {
            match action {
                Action::Send(f) => {
                    let answers = rejected != Some((f.conn, f.request_id));
                    self.route(f, now, answers);
                }
                Action::Close(id) => {
                    if let Some(slot) = self.live_slot(id) {
                        self.drain_then_close(slot, now);
                    }
                }
            }
        }
    }

    /// The slot of `id` if it still accepts output (open, or its peer ended
    /// its stream and waits for replies; not draining or dead).
    fn live_slot(&self, id: ConnId) -> Option<u32> {
        let slot = id.slot();
        match self.conns.get(slot as usize) {
            Some(Some(c))
                if c.id == id && matches!(c.state, ConnState::Open | ConnState::InputEnded) =>
            {
                Some(slot)
            }
            _ => None,
        }
    }

    /// Makes sure `run_timers` runs by `at`.
    fn schedule(&mut self, at: Instant) {
        self.next_timer_at = Some(self.next_timer_at.map_or(at, |t| t.min(at)));
    }

    /// When the loop must wake up for timers at the latest.
    pub fn next_timer(&self) -> Option<Instant> {
        self.next_timer_at
    }

    pub fn timers_due(&self, now: Instant) -> bool {
        self.next_timer_at.is_some_and(|t| now >= t)
    }

    /// Sends one reply frame toward its connection (through the fault
    /// plan). `answers`: it is the reply of the request in flight with its
    /// id (false for the reply to a rejected frame).
    fn route(&mut self, f: OutFrame, now: Instant, answers: bool) {
        let Some(slot) = self.live_slot(f.conn) else {
            ServerStats::bump(&self.shared.stats.replies_to_closed);
            return;
        };
        let conn = self.conns[slot as usize].as_mut().expect("live slot");
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_variables))]
        let answered = if answers {
            conn.inflight.remove(&f.request_id)
        } else {
            None
        };
        if conn.state == ConnState::InputEnded {
            // Its last reply may be dropped (a fault) rather than queued: the
            // backend's flush then finds nothing to write and finishes it.
            self.dirty.push(slot);
        }
        ServerStats::bump(&self.shared.stats.replies_queued);
        #[cfg(feature = "fault-injection")]
        if !f.faulted && self.fault.is_some() {
            self.route_faulted(slot, f, answered, now);
            return;
        }
        let _ = now;
        self.enqueue(slot, f);
    }

    /// Appends to the send queue, dropping the connection on overflow.
    fn enqueue(&mut self, slot: u32, f: OutFrame) {
        let limit = self.cfg.max_send_queue_bytes;
        let conn = self.conns[slot as usize].as_mut().expect("live slot");
        if conn.sendq.bytes() + f.bytes.len() > limit {
            ServerStats::bump(&self.shared.stats.slow_reader_drops);
            self.close(slot, DisconnectReason::SendQueueFull { limit_bytes: limit });
            return;
        }
        conn.sendq.push(f);
        self.dirty.push(slot);
        #[cfg(feature = "fault-injection")]
        if let Some((_, held)) = self.conns[slot as usize]
            .as_mut()
            .and_then(|c| c.held.take())
        {
            // Reorder: the held reply goes out right after its successor.
            self.enqueue(slot, held);
        }
    }

    #[cfg(feature = "fault-injection")]
    fn route_faulted(
        &mut self,
        slot: u32,
        mut f: OutFrame,
        answered: Option<InFlight>,
        now: Instant,
    ) {
        self.replies_total += 1;
        let info = ReplyInfo {
            conn: f.conn,
            kind: f.kind(),
            request_id: f.request_id,
            request_kind: answered.map(|a| a.kind),
            nth_of_request_kind: answered.map(|a| a.nth_of_kind),
            nth_reply: self.replies_total,
        };
        let plan = self.fault.as_mut().expect("checked by caller");
        let fault = plan.on_reply(&info);
        if fault != ReplyFault::Deliver {
            ServerStats::bump(&self.shared.stats.faults_applied);
        }
        f.faulted = true;
        match fault {
            ReplyFault::Deliver => self.enqueue(slot, f),
            ReplyFault::Drop => {}
            ReplyFault::Delay(d) => {
                self.schedule(now + d);
                self.delayed.push((now + d, f));
            }
            ReplyFault::Duplicate => {
                let fds = f.fds.iter().filter_map(|fd| fd.try_clone().ok()).collect();
                let copy = OutFrame {
                    conn: f.conn,
                    request_id: f.request_id,
                    bytes: f.bytes.clone(),
                    fds,
                    faulted: true,
                };
                self.enqueue(slot, f);
                if self.live_slot(copy.conn).is_some() {
                    self.enqueue(slot, copy);
                }
            }
            ReplyFault::Reorder => {
                let conn = self.conns[slot as usize].as_mut().expect("live slot");
                if let Some((_, earlier)) = conn.held.replace((now + REORDER_MAX_HOLD, f)) {
                    // Only one reply is held at a time; an earlier one goes now.
                    self.enqueue(slot, earlier);
                }
                self.schedule(now + REORDER_MAX_HOLD);
            }
            ReplyFault::Reset => self.reset(slot),
        }
    }

    /// Releases delayed and held replies that are due; closes connections
    /// stuck on a partial frame or on their last replies. Returns the next
    /// deadline, if any.
    pub fn run_timers(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut earliest = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        #[cfg(feature = "fault-injection")]
        {
            let mut i = 0;
            while i < self.delayed.len() {
                if self.delayed[i].0 <= now {
                    let (_, f) = self.delayed.swap_remove(i);
                    match self.live_slot(f.conn) {
                        Some(slot) => self.enqueue(slot, f),
                        None => ServerStats::bump(&self.shared.stats.replies_to_closed),
                    }
                } else {
                    earliest(self.delayed[i].0);
                    i += 1;
                }
            }
        }
        let timeout = Duration::from_millis(self.cfg.partial_frame_timeout_ms);
        let idle = self.cfg.idle_timeout_ms.map(Duration::from_millis);
        let mut stuck = Vec::new();
        let mut undrained = Vec::new();
        let mut idled = Vec::new();
        #[cfg(feature = "fault-injection")]
        let mut due = Vec::new();
        for (slot, c) in self.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            if c.state == ConnState::Dead {
                continue;
            }
            if let Some(since) = c.partial_since {
                if now >= since + timeout {
                    stuck.push(slot as u32);
                } else {
                    earliest(since + timeout);
                }
            }
            if let Some(since) = c.closing_since {
                if now >= since + timeout {
                    undrained.push(slot as u32);
                } else {
                    earliest(since + timeout);
                }
            }
            if let Some(idle) = idle
                && c.state == ConnState::Open
            {
                if !c.inflight.is_empty() {
                    // Busy, not idle: looked at again one period on.
                    earliest(now + idle);
                } else if now >= c.last_frame + idle {
                    idled.push(slot as u32);
                } else {
                    earliest(c.last_frame + idle);
                }
            }
            #[cfg(feature = "fault-injection")]
            if let Some((t, _)) = &c.held {
                if *t <= now {
                    due.push(slot as u32);
                } else {
                    earliest(*t);
                }
            }
        }
        #[cfg(feature = "fault-injection")]
        for slot in due {
            if let Some((_, f)) = self.conns[slot as usize]
                .as_mut()
                .and_then(|c| c.held.take())
            {
                self.enqueue(slot, f);
            }
        }
        for slot in stuck {
            self.close(slot, DisconnectReason::PartialFrameTimeout);
        }
        for slot in undrained {
            self.close(slot, DisconnectReason::DrainTimeout);
        }
        for slot in idled {
            self.close(slot, DisconnectReason::IdleTimeout);
        }
        self.next_timer_at = next;
        next
    }

    /// Picks up completions and wake requests posted by other threads.
    pub fn run_completions(&mut self, now: Instant) {
        // Acquire pairs with the SeqCst store in `notify`: seeing the flag
        // means the queue push before it is visible under the lock anyway.
        // A plain load first: the loop calls this on every poll, and a swap
        // is a locked read-modify-write that takes the flag's cache line
        // exclusive (from the posting thread's core) even when it is false.
        // A `notify` racing past the load is seen on the next poll, as one
        // racing past the swap would be.
        if !self.shared.has_work.load(Ordering::Acquire)
            || !self.shared.has_work.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let mut out = std::mem::take(&mut self.scratch);
        std::mem::swap(&mut out.actions, &mut *self.shared.queue.lock());
        self.apply(&mut out, now);
        if self.shared.wake_handler.swap(false, Ordering::AcqRel) {
            self.handler.on_wake(&mut out);
            self.apply(&mut out, now);
        }
        debug_assert!(out.is_empty());
        self.scratch = out;
    }

    /// True if other threads posted work since the last `run_completions`.
    pub fn has_work(&self) -> bool {
        self.shared.has_work.load(Ordering::Acquire) || self.shared.stop.load(Ordering::Acquire)
    }

    /// Announces that the loop is about to block. Returns false (and stays
    /// awake) if work arrived meanwhile. SeqCst: see `Shared::notify`.
    pub fn prepare_sleep(&self) -> bool {
        self.shared.sleeping.store(true, Ordering::SeqCst);
        if self.shared.has_work.load(Ordering::SeqCst) || self.shared.stop.load(Ordering::SeqCst) {
            self.shared.sleeping.store(false, Ordering::Relaxed);
            return false;
        }
        true
    }

    pub fn woke_up(&self) {
        // Relaxed: a stale `true` only costs a poster one spare eventfd write.
        self.shared.sleeping.store(false, Ordering::Relaxed);
    }

    /// Called by the backend when everything queued for a connection is
    /// written (its send queue is empty and no write of it is in progress):
    /// a closing connection whose work is done is closed.
    pub fn on_flushed(&mut self, slot: u32) {
        let Some(c) = self.conn_mut(slot) else { return };
        if !c.sendq.is_empty() {
            return;
        }
        #[cfg(feature = "fault-injection")]
        let holds_a_reply = c.held.is_some();
        #[cfg(not(feature = "fault-injection"))]
        let holds_a_reply = false;
        let done = match c.state {
            ConnState::Draining => Some(DisconnectReason::ClosedByServer),
            ConnState::InputEnded if c.inflight.is_empty() && !holds_a_reply => {
                Some(DisconnectReason::PeerClosed)
            }
            _ => None,
        };
        if let Some(why) = done {
            self.close(slot, why);
        }
    }

    /// The connection reads nothing more: counts down its closing bound
    /// and tells the backend (`input_closed`).
    fn leave_open(&mut self, slot: u32, to: ConnState, now: Instant) {
        debug_assert!(matches!(to, ConnState::InputEnded | ConnState::Draining));
        let Some(c) = self.conn_mut(slot) else { return };
        let was_open = c.state == ConnState::Open;
        c.state = to;
        c.partial_since = None;
        let due = *c.closing_since.get_or_insert(now)
            + Duration::from_millis(self.cfg.partial_frame_timeout_ms);
        if was_open {
            self.input_closed.push(slot);
        }
        self.schedule(due);
        // The backend's flush closes it once everything is written (at
        // once if nothing is queued or being written).
        self.dirty.push(slot);
    }

    /// The handler closes the connection: after the replies queued so far
    /// (including any the backend is writing), within the closing bound.
    fn drain_then_close(&mut self, slot: u32, now: Instant) {
        self.leave_open(slot, ConnState::Draining, now);
    }

    /// A receive returned end of stream. `peer_gone`: the peer closed its
    /// socket altogether (nobody would read a reply), not just its writing
    /// half.
    pub fn input_ended(&mut self, slot: u32, now: Instant, peer_gone: bool) {
        let Some(state) = self.conn_mut(slot).map(|c| c.state) else {
            return;
        };
        match state {
            ConnState::Dead => {}
            _ if peer_gone => self.close(slot, DisconnectReason::PeerClosed),
            ConnState::Open => self.leave_open(slot, ConnState::InputEnded, now),
            // Already closing: it keeps draining what it has queued.
            ConnState::InputEnded | ConnState::Draining => {}
        }
    }

    /// A write failed: the connection is closed at once. A peer that had
    /// ended its stream and then went away is reported as `PeerClosed`.
    pub fn write_failed(&mut self, slot: u32, kind: io::ErrorKind) {
        let input_ended = self
            .conn_mut(slot)
            .is_some_and(|c| c.state == ConnState::InputEnded);
        let why = if input_ended {
            DisconnectReason::PeerClosed
        } else {
            DisconnectReason::Io(kind)
        };
        self.close(slot, why);
    }

    /// Abortive close (fault injection): RST on TCP, queued replies dropped.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    fn reset(&mut self, slot: u32) {
        if let Some(c) = self.conn_mut(slot) {
            // Best effort: on Unix sockets SO_LINGER has no RST to send.
            let _ = sys::set_linger_zero(c.fd.as_fd());
        }
        self.close(slot, DisconnectReason::FaultReset);
    }

    /// Ends a connection now: the handler hears of it once, queued output is
    /// dropped, and the backend is asked to tear the socket down.
    pub fn close(&mut self, slot: u32, why: DisconnectReason) {
        let Some(c) = self.conns.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        if c.state == ConnState::Dead {
            return;
        }
        c.state = ConnState::Dead;
        c.sendq.clear();
        c.inflight.clear();
        #[cfg(feature = "fault-injection")]
        {
            c.held = None;
        }
        let id = c.id;
        tracing::debug!(conn = %id, reason = ?why, "connection closed");
        ServerStats::bump(&self.shared.stats.disconnected);
        self.handler.on_disconnect(id, &why);
        self.dead.push(slot);
    }

    /// Frees a dead slot once the backend has retired its I/O; returns the
    /// socket to close.
    pub fn release(&mut self, slot: u32) -> Option<OwnedFd> {
        let c = self.conns.get_mut(slot as usize)?.take()?;
        debug_assert_eq!(c.state, ConnState::Dead);
        self.generations[slot as usize] = self.generations[slot as usize].wrapping_add(1);
        self.free.push(slot);
        self.live -= 1;
        Some(c.fd)
    }

    /// Closes every connection (server shutdown).
    pub fn close_all(&mut self) {
        for slot in 0..self.conns.len() as u32 {
            self.close(slot, DisconnectReason::Shutdown);
        }
    }
}

/// First pause of accepting after the process ran out of descriptors (or
/// socket memory); doubled at each failure that follows, up to
/// [`ACCEPT_PAUSE_MAX`], back to this after an accept succeeds.
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(10);
const ACCEPT_PAUSE_MAX: Duration = Duration::from_millis(100);
/// While accepts keep failing for lack of descriptors, one warning per this
/// much time (with the count of failures since the last one).
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// What a backend does when `accept` fails because the process (or the
/// system) is out of descriptors or socket memory. The connection stays in
/// the listener's backlog, so an accept retried at once fails again at
/// once: a loop that retried would spin, logging each failure. Instead the
/// backend stops accepting on that listener until [`AcceptPause::due`]
/// (a timer of the loop), then tries again; the waiting peers are served
/// once descriptors are free. Warnings are rate-limited.
#[derive(Debug)]
pub(crate) struct AcceptPause {
    delay: Duration,
    resume_at: Option<Instant>,
    failures_unreported: u64,
    warned_at: Option<Instant>,
}

impl Default for AcceptPause {
    fn default() -> Self {
        Self {
            delay: ACCEPT_PAUSE_MIN,
            resume_at: None,
            failures_unreported: 0,
            warned_at: None,
        }
    }
}

impl AcceptPause {
    /// An accept error that concerns only the connection it was for (the
    /// peer gave up before it was accepted): the next accept may work at
    /// once. Any other — out of descriptors (`EMFILE`, `ENFILE`) or memory
    /// (`ENOBUFS`, `ENOMEM`), or worse — would repeat: accepting pauses.
    pub fn is_transient(errno: i32) -> bool {
        matches!(
            errno,
            libc::ECONNABORTED | libc::EINTR | libc::EPROTO | libc::EPERM
        )
    }

    /// Accepting failed with `err` (not transient): pauses it.
    pub fn pause(&mut self, err: &io::Error, now: Instant) {
        self.failures_unreported += 1;
        if self
            .warned_at
            .is_none_or(|t| now.duration_since(t) >= ACCEPT_WARN_EVERY)
        {
            tracing::warn!(
                error = %err,
                failed_accepts = self.failures_unreported,
                pause_ms = self.delay.as_millis() as u64,
                "cannot accept connections: they stay queued; accepting pauses, then retries"
            );
            self.warned_at = Some(now);
            self.failures_unreported = 0;
        }
        self.resume_at = Some(now + self.delay);
        self.delay = (self.delay * 2).min(ACCEPT_PAUSE_MAX);
    }

    /// An accept succeeded: the next exhaustion pauses briefly again.
    pub fn accepted(&mut self) {
        self.delay = ACCEPT_PAUSE_MIN;
    }

    /// When accepting resumes, if it is paused.
    pub fn deadline(&self) -> Option<Instant> {
        self.resume_at
    }

    /// True (once) when the pause is over: the caller accepts again.
    pub fn due(&mut self, now: Instant) -> bool {
        if self.resume_at.is_some_and(|t| now >= t) {
            self.resume_at = None;
            return true;
        }
        false
    }
}

/// The earlier of two optional deadlines.
pub(crate) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Best-effort, non-blocking send of a refusal frame on a fresh socket (its
/// buffer is empty, so one small frame fits).
fn send_refusal(fd: &OwnedFd, r: &Refusal) {
    match encode(r.kind, 0, &r.payload) {
        Ok(bytes) => {
            if let Err(e) = sys::send(fd.as_fd(), &bytes) {
                tracing::debug!(error = %e, "could not send a refusal frame");
            }
        }
        Err(e) => tracing::warn!(error = %e, "refusal payload cannot be framed"),
    }
}

/// A bound listening socket.
#[derive(Debug)]
pub(crate) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Unix(l) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }

    /// Peer information of a socket accepted from this listener.
    pub fn peer_of(&self, fd: &OwnedFd) -> io::Result<PeerInfo> {
        match self {
            Listener::Unix(_) => sys::peer_cred(fd.as_fd()).map(PeerInfo::Unix),
            Listener::Tcp(_) => {
                let s = std::net::TcpStream::from(fd.try_clone()?);
                // Latency over throughput: replies are small and must not wait.
                s.set_nodelay(true)?;
                s.peer_addr().map(PeerInfo::Tcp)
            }
        }
    }
}

/// Whether a server's event loop runs, and why it ended if it ended on its
/// own — an error of the loop, or a panic (of a handler, say) — rather than
/// because it was asked to stop. A loop that ends closes every connection:
/// a process that serves through it must notice and exit
/// (`cxlkv serve`, `cxlkv pool` poll this).
///
/// Every [`ServerHandle`] has one ([`ServerHandle::watch`]). An owner that
/// does not hold the handle (the pool daemon: its handle lives inside the
/// pool core) hands one in through [`ServerConfig::loop_watch`]. One watch
/// per server.
#[derive(Clone, Default)]
pub struct LoopWatch {
    inner: Arc<WatchState>,
}

#[derive(Default)]
struct WatchState {
    /// One of the `LOOP_*` values.
    state: AtomicU8,
    failure: Mutex<Option<String>>,
}

const LOOP_NOT_STARTED: u8 = 0;
const LOOP_RUNNING: u8 = 1;
const LOOP_STOPPED: u8 = 2;
const LOOP_FAILED: u8 = 3;

impl LoopWatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// True from the moment the server is spawned until its loop ends.
    pub fn is_running(&self) -> bool {
        // Acquire pairs with the Release store in `ended`: a caller that
        // sees the loop ended then finds its failure recorded.
        self.inner.state.load(Ordering::Acquire) == LOOP_RUNNING
    }

    /// Why the loop ended on its own, if it did (`None` while it runs, and
    /// after a requested stop).
    pub fn failure(&self) -> Option<String> {
        self.inner.failure.lock().clone()
    }

    fn started(&self) {
        // Relaxed: nothing is published with this store. `spawn` makes it
        // before it hands out the handle (the thread that gets the handle
        // sees it through the hand-over), and the loop thread repeats it
        // before the loop starts, so it cannot land after `ended`.
        self.inner.state.store(LOOP_RUNNING, Ordering::Relaxed);
    }

    fn ended(&self, failure: Option<String>) {
        let state = if failure.is_some() {
            LOOP_FAILED
        } else {
            LOOP_STOPPED
        };
        *self.inner.failure.lock() = failure;
        self.inner.state.store(state, Ordering::Release);
    }
}

impl PartialEq for LoopWatch {
    /// The same watch (configurations compare equal when they share one).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for LoopWatch {}

impl fmt::Debug for LoopWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.inner.state.load(Ordering::Acquire) {
            LOOP_NOT_STARTED => "not started",
            LOOP_RUNNING => "running",
            LOOP_STOPPED => "stopped",
            _ => "failed",
        };
        f.debug_struct("LoopWatch")
            .field("state", &state)
            .field("failure", &self.failure())
            .finish()
    }
}

/// The message of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// A server: bound listeners and a configuration, not yet running.
pub struct Server {
    cfg: ServerConfig,
    listeners: Vec<Listener>,
    endpoints: Vec<Endpoint>,
    shared: Arc<Shared>,
    backend: Backend,
    watch: LoopWatch,
    #[cfg(feature = "fault-injection")]
    fault: Option<Box<dyn FaultPlan>>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("endpoints", &self.endpoints)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds every endpoint (a Unix path must not exist yet; TCP port 0
    /// picks a free port) and picks the backend.
    pub fn bind(cfg: ServerConfig, endpoints: &[Endpoint]) -> Result<Server, TransportError> {
        if cfg.max_send_queue_bytes < crate::frame::MAX_FRAME_BYTES {
            return Err(TransportError::Config(
                "max_send_queue_bytes must hold one maximum frame",
            ));
        }
        if cfg.max_connections == 0 || cfg.max_inflight_per_conn == 0 {
            return Err(TransportError::Config(
                "connection and in-flight limits must be positive",
            ));
        }
        if cfg.unix_socket_mode & !0o777 != 0 {
            return Err(TransportError::Config(
                "unix_socket_mode has bits outside 0o777 (permission bits only)",
            ));
        }
        cfg.io.check_recv_buffers()?;
        let backend = super::pick_backend(&cfg.io)?;
        let mut listeners = Vec::new();
        let mut bound = Vec::new();
        for ep in endpoints {
            let bind_err = |source| TransportError::Bind {
                endpoint: ep.clone(),
                source,
            };
            match ep {
                Endpoint::Unix(path) => {
                    let l =
                        sys::bind_unix_listener(path, cfg.unix_socket_mode).map_err(bind_err)?;
                    l.set_nonblocking(true).map_err(bind_err)?;
                    bound.push(ep.clone());
                    listeners.push(Listener::Unix(l));
                }
                Endpoint::Tcp(addr) => {
                    let l = TcpListener::bind(addr).map_err(bind_err)?;
                    l.set_nonblocking(true).map_err(bind_err)?;
                    bound.push(Endpoint::Tcp(l.local_addr().map_err(bind_err)?));
                    listeners.push(Listener::Tcp(l));
                }
            }
        }
        let shared =
            Arc::new(Shared::new(cfg.max_pending_completions).map_err(TransportError::Setup)?);
        let watch = cfg.loop_watch.clone().unwrap_or_default();
        Ok(Server {
            cfg,
            listeners,
            endpoints: bound,
            shared,
            backend,
            watch,
            #[cfg(feature = "fault-injection")]
            fault: None,
        })
    }

    /// The endpoints actually bound (TCP with its real port).
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// A handle for other threads to post replies or wake the loop.
    pub fn completer(&self) -> Completer {
        Completer {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Whether the loop runs, once spawned (see [`LoopWatch`]).
    pub fn watch(&self) -> LoopWatch {
        self.watch.clone()
    }

    /// Installs a fault plan consulted on every request and reply.
    #[cfg(feature = "fault-injection")]
    pub fn set_fault_plan(&mut self, plan: Box<dyn FaultPlan>) {
        self.fault = Some(plan);
    }

    /// Runs the event loop on a new thread.
    pub fn spawn<H: Handler>(self, handler: H) -> Result<ServerHandle<H>, TransportError> {
        let shared = Arc::clone(&self.shared);
        let endpoints = self.endpoints.clone();
        let backend = self.backend;
        let watch = self.watch.clone();
        // Before the handle exists: it reports a running loop from the start.
        watch.started();
        let join = std::thread::Builder::new()
            .name("cxlkv-transport".into())
            .spawn(move || self.run(handler))
            .map_err(TransportError::Setup)?;
        Ok(ServerHandle {
            join: Some(join),
            shared,
            endpoints,
            backend,
            watch,
        })
    }

    /// Runs the event loop on the calling thread until a
    /// [`ServerHandle`]-less stop: used by `spawn`, and by callers that own a
    /// thread already. Returns the handler. Its end is recorded in the
    /// server's [`LoopWatch`] (and logged when it is a failure); a panic on
    /// the loop is recorded, then resumed.
    pub fn run<H: Handler>(self, handler: H) -> Result<H, TransportError> {
        let watch = self.watch.clone();
        let shared = Arc::clone(&self.shared);
        watch.started();
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_loop(handler)));
        let failure = match &result {
            Ok(Ok(_)) if stop_requested(&shared) => None,
            Ok(Ok(_)) => Some("the transport event loop ended without being asked to".to_owned()),
            Ok(Err(e)) => Some(e.to_string()),
            Err(payload) => Some(format!(
                "the transport event loop panicked: {}",
                panic_message(payload.as_ref())
            )),
        };
        if let Some(why) = &failure {
            tracing::error!(failure = %why, "the transport event loop ended: nothing is served any more");
        }
        // Completers and wakes fail (`Stopped`) from now on instead of
        // queueing for a loop that is gone. Release: pairs with their
        // Acquire loads, as `request_stop`'s SeqCst store does.
        shared.stop.store(true, Ordering::Release);
        watch.ended(failure);
        match result {
            Ok(r) => r,
            Err(payload) => std::panic::resume_unwind(payload),
        }
    }

    fn run_loop<H: Handler>(self, handler: H) -> Result<H, TransportError> {
        let Server {
            cfg,
            listeners,
            shared,
            backend,
            endpoints: _,
            watch: _,
            ..
        } = self;
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
        let mut core = Core::new(handler, cfg, shared);
        #[cfg(feature = "fault-injection")]
        {
            core.fault = self.fault;
        }
        // Unix socket paths are ours to remove (we created them in `bind`),
        // however the loop ends: a guard, so that a loop that panics does
        // not leave them behind (its listeners close as it unwinds).
        let _paths = RemoveOnDrop(
            listeners
                .iter()
                .filter_map(|l| match l {
                    Listener::Unix(u) => u.local_addr().ok()?.as_pathname().map(ToOwned::to_owned),
                    _ => None,
                })
                .collect(),
        );
        let result = match backend {
            Backend::Uring => uring::run(&mut core, &listeners),
            Backend::Fallback => epoll::run(&mut core, &listeners),
        };
        result.map(|()| core.handler)
    }
}

/// Removes its paths when dropped, unwinding included.
struct RemoveOnDrop(Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A running server: stop it, read its stats, post completions, know
/// whether its loop still runs.
#[derive(Debug)]
pub struct ServerHandle<H> {
    join: Option<JoinHandle<Result<H, TransportError>>>,
    shared: Arc<Shared>,
    endpoints: Vec<Endpoint>,
    backend: Backend,
    watch: LoopWatch,
}

impl<H> ServerHandle<H> {
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn completer(&self) -> Completer {
        Completer {
            shared: Arc::clone(&self.shared),
        }
    }

    pub fn stats(&self) -> ServerStatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// False once the loop has ended — on request, or on its own (see
    /// [`ServerHandle::failure`]).
    pub fn is_running(&self) -> bool {
        self.watch.is_running()
    }

    /// Why the loop ended on its own (an error, a panic), if it did: no
    /// connection is served any more, and the owner should exit.
    pub fn failure(&self) -> Option<String> {
        self.watch.failure()
    }

    /// A watch on the loop for other threads (see [`LoopWatch`]).
    pub fn watch(&self) -> LoopWatch {
        self.watch.clone()
    }

    /// Stops the loop (every connection is closed, the handler hears
    /// `Shutdown` for each) and returns the handler. Closing does not flush:
    /// replies not yet written — queued, or held back by a fault plan's
    /// `Delay` or `Reorder` — are discarded.
    pub fn shutdown(mut self) -> Result<H, TransportError> {
        self.stop_and_join()
            .unwrap_or(Err(TransportError::LoopPanicked))
    }

    fn stop_and_join(&mut self) -> Option<Result<H, TransportError>> {
        let join = self.join.take()?;
        if let Err(e) = self.shared.request_stop() {
            tracing::warn!(error = %e, "could not wake the transport loop to stop it");
        }
        Some(join.join().unwrap_or(Err(TransportError::LoopPanicked)))
    }
}

impl<H> Drop for ServerHandle<H> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.stop_and_join() {
            tracing::warn!(error = %e, "transport loop ended with an error");
        }
    }
}

/// Shared by both backends: the loop stops when asked.
pub(crate) fn stop_requested(shared: &Shared) -> bool {
    shared.stop.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole_frame() -> Vec<u8> {
        let mut whole = Vec::new();
        encode_frame(&mut whole, 7, 9, b"twelve bytes").unwrap();
        whole
    }

    /// `send_frame` queues only whole frames of this protocol: a frame cut
    /// short, one with bytes after its end, one without a whole header, or
    /// one of another version is refused and nothing is queued.
    #[test]
    fn a_handed_over_frame_that_disagrees_with_its_header_is_refused() {
        let conn = ConnId::new(1, 1);
        let whole = whole_frame();
        let mut long = whole.clone();
        long.extend_from_slice(&[0; 8]);
        let mut other_version = whole.clone();
        other_version[4] = 0xEE;
        let mut out = Replies::default();
        for (bad, what) in [
            (whole[..whole.len() - 8].to_vec(), "cut short"),
            (long, "bytes after its end"),
            (whole[..HEADER_BYTES - 1].to_vec(), "no whole header"),
            (other_version, "another version"),
        ] {
            match out.send_frame(conn, bad, Vec::new()) {
                Err(ReplyError::NotAFrame { .. } | ReplyError::Frame(_)) => {}
                other => panic!("{what}: {other:?}"),
            }
        }
        assert!(out.is_empty());
    }

    /// Provided receive buffers are allocated whole when the loop starts:
    /// a configuration asking for more than `MAX_RECV_BUFFER_POOL_BYTES`
    /// (up to 512 GiB: an allocation failure aborts the process) or of a
    /// shape the kernel refuses is refused at bind, with the reason.
    #[test]
    fn receive_buffers_beyond_their_bound_are_refused_at_bind() {
        let with = |bytes: u32, count: u16| {
            let mut cfg = ServerConfig::default();
            cfg.io.backend = crate::transport::BackendChoice::Fallback;
            cfg.io.recv_buffer_bytes = bytes;
            cfg.io.recv_buffer_count = count;
            Server::bind(cfg, &[])
        };
        for (bytes, count) in [(16 << 20, 32768), (16 << 20, 32), (4096, 3), (0, 16)] {
            assert!(
                matches!(with(bytes, count), Err(TransportError::Config(_))),
                "{count} × {bytes} bytes"
            );
        }
        assert!(with(16 << 20, 16).is_ok(), "256 MiB is within the bound");
        assert!(with(16 << 10, 256).is_ok(), "the defaults");
    }

    /// A whole frame is queued as it is, under the request id its header
    /// names, in an allocation no larger than it (send queues are bounded
    /// by the bytes they hold).
    #[test]
    fn a_whole_frame_is_queued_unchanged_and_without_spare_capacity() {
        let conn = ConnId::new(1, 1);
        let mut out = Replies::default();
        let mut roomy = Vec::with_capacity(64 << 10);
        roomy.extend_from_slice(&whole_frame());
        out.send_frame(conn, roomy, Vec::new()).unwrap();
        match out.actions.as_slice() {
            [Action::Send(f)] => {
                assert_eq!((f.conn, f.request_id), (conn, 9));
                assert_eq!(f.bytes, whole_frame());
                assert!(
                    f.bytes.capacity() < 2 * f.bytes.len(),
                    "{}",
                    f.bytes.capacity()
                );
            }
            _ => panic!("expected one send"),
        }
    }
}
