//! The pipelining client: many threads share one connection, each request
//! carries its own request id and deadline, and replies are matched by id
//! in whatever order they come back.
//!
//! **Leader/follower, no reader thread.** A thread waiting for its reply
//! tries to become the connection's *leader* (a `try_lock` on the reader
//! state). The leader reads the socket — polling without sleeping for
//! `spin_us` after the last bytes arrived, then blocking in the kernel until
//! its own deadline — and hands every reply it decodes to the thread that
//! waits for it. When the leader's own reply has come, it gives up the role
//! and unparks one sleeping waiter whose reply is still outstanding, which
//! becomes the next leader. Other waiters (followers) poll their own slot
//! for `spin_us`, then park until their deadline. A lone caller therefore
//! reads its own reply on its own thread: no cross-thread wake-up, which
//! costs ~50 µs on an idle vCPU here, sits on the round trip.
//!
//! **Two ways to read** ([`Backend`]), chosen like the server's: the
//! *syscall* wire (`fallback.rs`: `recvmsg`/`recv`, `poll` to sleep) and the
//! *io_uring* wire (`uring.rs`: one receive in flight at a time, straight
//! into the decoder's buffer, submitted by the current leader; the leader
//! polls the completion queue in memory, enters the kernel only when the
//! ring's TASKRUN flag says receive work waits for it, and sleeps in
//! `io_uring_enter`). The io_uring receive is one-shot, not multishot, and
//! never outlives a leader's turn: without SQPOLL the kernel runs a
//! receive's completion work in the thread that *submitted* it, so a
//! receive left armed by a thread that went on to other work would stall
//! the next leader. Sends are plain non-blocking system calls on both wires
//! (one per frame while the socket takes it, made by the calling thread
//! under the send lock, which keeps frames whole on the stream): a `send` of
//! the frame copied into the send buffer, or, for payloads of 16 KiB and
//! more, a vectored `sendmsg` of header, the caller's payload and padding,
//! which spares the copy.
//!
//! The syscall wire is the default (`BackendChoice::Auto`): a reply costs
//! it one `recvmsg`, while the io_uring wire arms a poll per reply and
//! completes it through kernel task work; it measured slower (see the
//! transport essay). The io_uring wire has a side
//! effect to know about: when a connection's ring is torn down, the kernel
//! sends every thread that ever submitted to it (every thread that led) a
//! one-time notification to drop its per-thread state, which interrupts a
//! blocking call of that thread that reports `EINTR` rather than restarting
//! (a socket read with a timeout, `epoll_wait`). Code on such threads must
//! retry on `EINTR`, as it must for signals anyway.
//!
//! **Pending requests** live in a slab of at most `max_inflight` slots. A
//! request id is the slot's index (low 32 bits) and the slot's generation
//! (high 32 bits, never 0, bumped on every reuse), so a reply finds its
//! slot without hashing, and a reply to a slot since reused fails the
//! generation check: it is dropped and counted as late. A per-slot atomic
//! holds the id whose result is ready, so waiters poll it without a lock.
//!
//! **Handoff invariant.** Whenever the reader lock is free and some parked
//! waiter's reply is outstanding, the leader that frees the lock unparks
//! such a waiter. A waiter registers (under the table lock, counted in
//! `parked`) and then issues a SeqCst fence before it checks the reader
//! lock and parks; a leader unlocks and then issues a SeqCst fence before
//! it reads `parked`. Either the leader sees the registration, or the waiter
//! sees the lock free and leads itself.
//!
//! **Deadlines and bounds.** Each request has a deadline: when it passes,
//! the call fails with [`ClientError::Timeout`], its slot is freed, and a
//! reply that arrives later is dropped and counted (`late_replies`).
//! Requests in flight are bounded by `max_inflight` (an error, never an
//! unbounded wait); a send that cannot make progress before the deadline
//! fails, and if it had written part of a frame the connection is closed
//! (the byte stream can no longer be framed). When the connection dies,
//! every pending request is completed with [`ClientError::Closed`].
//!
//! **Descriptors.** On Unix sockets replies may carry descriptors
//! (`SCM_RIGHTS`), so both wires read Unix sockets with `recvmsg` and a
//! control buffer (measured: ~70 ns more per read than `recv`; the kernel
//! discards descriptors sent to a plain `recv`, so the cheaper call would
//! need the server to announce such frames). The server sends a frame that
//! carries descriptors alone in its `sendmsg`, and the kernel ends a
//! receive after the message that carried descriptors; so descriptors
//! received by a receive covering stream bytes `[a, b)` belong to the frame
//! that starts in `[a, b)` and reaches `b`.

mod fallback;
mod uring;

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::config::{Backend, BackendChoice, ClientConfig, Endpoint, IoConfig};
use super::ring::{self, Role};
use super::spin::Spinner;
use super::{TransportError, sys};
use crate::frame::{
    Decoded, FRAME_ALIGN, FrameDecoder, FrameError, FrameHeader, encode_frame, padding, wire_len,
};

/// Bytes asked of the decoder per receive.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// Reads that drain what a resetting peer sent before the reset.
const MAX_DRAIN_READS: usize = 64;
/// Largest `ClientConfig::max_inflight`: bounds the slab (one atomic and one
/// entry per slot).
pub const MAX_CLIENT_INFLIGHT: usize = 1 << 16;
/// A send buffer that a large request grew past this is released after it.
const SEND_BUFFER_KEEP_BYTES: usize = 256 << 10;
/// Payloads at least this large go out from the caller's slice, with the
/// header and padding beside it in one vectored `sendmsg`, instead of being
/// copied into the send buffer first: the copy (~2 µs for a 55 KB 512-key
/// request on this VM) would sit on the call's critical path. Smaller
/// frames take the copy and a plain `send`, which is cheaper than building
/// a message header.
const VECTORED_SEND_MIN_BYTES: usize = 16 << 10;

/// What went wrong with a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// `request_id` is the transport's own number for the request (a
    /// table slot and generation, meaningless to a user reading the
    /// message, so kept out of it).
    #[error("no reply within {timeout_ms} ms")]
    Timeout { request_id: u64, timeout_ms: u64 },
    #[error("{limit} requests already in flight on this connection")]
    TooManyInFlight { limit: usize },
    #[error("connection to {endpoint} closed: {cause}")]
    Closed {
        endpoint: String,
        cause: String,
        notice: Option<Box<Reply>>,
    },
    #[error("cannot frame the request: {0}")]
    Frame(#[from] FrameError),
    #[error("the server's reply to request {request_id} was refused: {error}")]
    BadReply { request_id: u64, error: FrameError },
    #[error("cannot connect to {endpoint}: {source}")]
    Connect { endpoint: String, source: io::Error },
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// A reply frame, its payload 8-aligned in memory (ready for rkyv's checked
/// access), and any descriptors that came with it.
pub struct Reply {
    pub header: FrameHeader,
    words: Vec<u64>,
    pub fds: Vec<OwnedFd>,
}

impl Reply {
    fn new(header: FrameHeader, payload: &[u8], fds: Vec<OwnedFd>) -> Self {
        // Not zeroed first: a 16 KiB reply is written once, not twice.
        let n = payload.len().div_ceil(8);
        let mut words: Vec<u64> = Vec::with_capacity(n);
        // SAFETY: the allocation holds `n` words, at least `payload.len()`
        // bytes; u8 has no alignment requirement and any byte pattern is a
        // valid u64. The copy initialises the first `payload.len()` bytes and
        // the tail write the rest of the last word (the `n * 8 -
        // payload.len() < 8` padding bytes), so all `n` words are initialised
        // before `set_len`.
        unsafe {
            let bytes = words.as_mut_ptr().cast::<u8>();
            std::ptr::copy_nonoverlapping(payload.as_ptr(), bytes, payload.len());
            std::ptr::write_bytes(bytes.add(payload.len()), 0, n * 8 - payload.len());
            words.set_len(n);
        }
        Self { header, words, fds }
    }

    pub fn kind(&self) -> u16 {
        self.header.kind
    }

    /// The payload, 8-aligned.
    pub fn payload(&self) -> &[u8] {
        // SAFETY: `words` holds `payload_len` initialised bytes (see `new`).
        unsafe {
            std::slice::from_raw_parts(
                self.words.as_ptr().cast::<u8>(),
                self.header.payload_len as usize,
            )
        }
    }

    fn copy_without_fds(&self) -> Reply {
        Reply::new(self.header, self.payload(), Vec::new())
    }
}

impl fmt::Debug for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reply")
            .field("header", &self.header)
            .field("fds", &self.fds.len())
            .finish()
    }
}

/// Counters of a client (monotonic).
#[derive(Debug, Default)]
pub struct ClientStats {
    pub requests: AtomicU64,
    pub timeouts: AtomicU64,
    /// Replies that arrived after their request timed out (or duplicates).
    pub late_replies: AtomicU64,
    /// Frames with request id 0 (server notices, refusals).
    pub notices: AtomicU64,
    /// Descriptors that arrived with no frame to attach to (closed).
    pub stray_fds: AtomicU64,
    /// Times a thread took over reading the socket.
    pub leader_turns: AtomicU64,
}

impl ClientStats {
    // Relaxed: independent tallies, read for reporting only.
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// One pending-request slot of the slab.
#[derive(Default)]
struct Entry {
    /// The request id occupying this slot; 0 when the slot is free.
    id: u64,
    generation: u32,
    result: Option<Result<Reply, ClientError>>,
    /// Set while the caller sleeps (parks) waiting for this reply.
    waiter: Option<Thread>,
}

/// The slab of pending requests (under `Inner::table`).
#[derive(Default)]
struct Table {
    entries: Vec<Entry>,
    free: Vec<u32>,
}

impl Table {
    /// Takes a slot and gives it a fresh request id, unless `limit` slots
    /// are in use.
    fn alloc(&mut self, limit: usize) -> Option<(u32, u64)> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if self.entries.len() < limit => {
                self.entries.push(Entry::default());
                // Fits: limit ≤ MAX_CLIENT_INFLIGHT.
                (self.entries.len() - 1) as u32
            }
            None => return None,
        };
        let e = &mut self.entries[slot as usize];
        debug_assert_eq!(e.id, 0, "a free slot holds no request");
        // Never 0, so no request id is 0 (the id of server notices).
        e.generation = e.generation.wrapping_add(1).max(1);
        e.id = u64::from(e.generation) << 32 | u64::from(slot);
        Some((slot, e.id))
    }

    /// The slot index a request id names.
    fn slot_of(id: u64) -> usize {
        (id & u64::from(u32::MAX)) as usize
    }

    fn entry_mut(&mut self, id: u64) -> Option<&mut Entry> {
        self.entries
            .get_mut(Self::slot_of(id))
            .filter(|e| e.id == id)
    }

    /// Frees the slot of `id` (if it still holds it): returns the result it
    /// held and whether a waiter was registered.
    fn release(&mut self, id: u64) -> (Option<Result<Reply, ClientError>>, bool) {
        let Some(e) = self.entry_mut(id) else {
            return (None, false);
        };
        e.id = 0;
        let result = e.result.take();
        let was_parked = e.waiter.take().is_some();
        self.free.push(Self::slot_of(id) as u32);
        (result, was_parked)
    }
}

enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Sock::Unix(s) => s.as_fd(),
            Sock::Tcp(s) => s.as_fd(),
        }
    }
}

/// What one read attempt produced.
enum Read {
    /// Nothing arrived (yet).
    Nothing,
    /// `n` bytes were appended to the decoder; descriptors that came with
    /// them were appended to the reader's `fds`.
    Bytes {
        n: usize,
        fds_truncated: bool,
    },
    /// The peer closed its end.
    Eof,
    Failed(io::Error),
}

/// How the leader reads: the syscall wire or the io_uring wire. Each owns
/// the decoder, since an io_uring receive writes into its buffer.
enum Wire {
    Syscall(fallback::SyscallWire),
    Uring(Box<uring::UringWire>),
}

impl Wire {
    /// One attempt to read without sleeping.
    fn read(&mut self, sock: BorrowedFd<'_>, fds: &mut Vec<OwnedFd>, accept_fds: bool) -> Read {
        match self {
            Wire::Syscall(w) => w.read(sock, fds, accept_fds),
            Wire::Uring(w) => w.read(fds, accept_fds),
        }
    }

    /// Sleeps until bytes may have arrived, or `timeout`.
    fn block(&mut self, sock: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
        match self {
            Wire::Syscall(_) => fallback::block(sock, timeout),
            Wire::Uring(w) => w.block(timeout),
        }
    }

    /// Ends the leader's turn: no receive may stay in flight (see the
    /// module essay). Returns what a cancelled receive had got.
    fn quiesce(&mut self, fds: &mut Vec<OwnedFd>) -> Read {
        match self {
            Wire::Syscall(_) => Read::Nothing,
            Wire::Uring(w) => w.quiesce(fds),
        }
    }

    /// The decoder, unless a receive into its buffer is in flight.
    fn decoder(&mut self) -> Option<&mut FrameDecoder> {
        match self {
            Wire::Syscall(w) => Some(&mut w.decoder),
            Wire::Uring(w) => w.decoder(),
        }
    }

    fn backend(&self) -> Backend {
        match self {
            Wire::Syscall(_) => Backend::Fallback,
            Wire::Uring(_) => Backend::Uring,
        }
    }
}

/// The leader's state.
struct Reader {
    wire: Wire,
    /// Stream offset of the next byte to arrive.
    stream_bytes: u64,
    /// `(start, end, fds)`: descriptors received by a receive that covered
    /// stream bytes `start..end`, not yet tied to a frame.
    fd_batches: VecDeque<(u64, u64, Vec<OwnedFd>)>,
    /// Descriptors of the last receive.
    fds: Vec<OwnedFd>,
}

struct Inner {
    // Field order matters: the reader (whose io_uring may point into its
    // buffers and at the socket) is dropped before the socket.
    reader: Mutex<Reader>,
    sock: Sock,
    endpoint: Endpoint,
    cfg: ClientConfig,
    backend: Backend,
    /// The encoded frame being sent; its lock is the send lock.
    send_buf: Mutex<Vec<u8>>,
    table: Mutex<Table>,
    /// Per slot: the request id whose result the slot holds (see essay).
    done: Box<[AtomicU64]>,
    /// Waiters registered to be unparked (entries with `waiter` set).
    parked: AtomicUsize,
    closed: AtomicBool,
    /// Replies may still carry descriptors (see [`RpcClient::decline_fds`]).
    accept_fds: AtomicBool,
    close_cause: Mutex<Option<(String, Option<Box<Reply>>)>>,
    last_notice: Mutex<Option<Reply>>,
    stats: ClientStats,
}

/// A pipelining RPC client over one connection; clone it freely (clones
/// share the connection).
#[derive(Clone)]
pub struct RpcClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for RpcClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcClient")
            .field("endpoint", &self.inner.endpoint)
            .field("backend", &self.backend())
            .finish_non_exhaustive()
    }
}

/// A request sent and not yet answered; [`PendingCall::wait`] for its reply.
#[derive(Debug)]
#[must_use = "a pending call holds an in-flight slot until waited for or dropped"]
pub struct PendingCall {
    client: RpcClient,
    request_id: u64,
    deadline: Instant,
    timeout: Duration,
    /// The slot is still ours to free (not yet taken by `wait`).
    live: bool,
}

/// First pause between connect attempts while a Unix listener's backlog is
/// full; doubled per attempt up to [`UNIX_CONNECT_RETRY_MAX`].
const UNIX_CONNECT_RETRY_MIN: Duration = Duration::from_millis(1);
const UNIX_CONNECT_RETRY_MAX: Duration = Duration::from_millis(50);

/// Connects to the Unix socket at `path` within `timeout`; the stream is
/// non-blocking. A Unix stream connect completes at once or finds the
/// listener's backlog full; a *blocking* socket then sleeps until the
/// listener accepts, without bound (a wedged server with `SOMAXCONN`
/// clients queued would hold every caller forever), so the socket is
/// non-blocking (`EAGAIN` instead) and the connect is retried, with a
/// growing pause, until `timeout` runs out: then `TimedOut`, naming the
/// limit.
fn connect_unix(path: &std::path::Path, timeout: Duration) -> io::Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let mut pause = UNIX_CONNECT_RETRY_MIN;
    loop {
        if let Some(s) = sys::connect_nonblocking(path)? {
            return Ok(s);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the listener's backlog stayed full for connect_timeout_ms = {} ms \
                     (a server that does not accept)",
                    timeout.as_millis()
                ),
            ));
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(UNIX_CONNECT_RETRY_MAX);
    }
}

/// The io_uring flags a client ring gets from `io` (see `ring`).
fn client_io(io: &IoConfig) -> IoConfig {
    IoConfig {
        taskrun: ring::effective_taskrun(io, Role::Client),
        ..io.clone()
    }
}

impl RpcClient {
    /// Connects (blocking, bounded by `connect_timeout_ms` on Unix sockets
    /// and TCP alike) and sets up the
    /// backend: `IoConfig::backend`, else `CXLKV_IO`, else the syscall wire
    /// (the measured default; see [`BackendChoice::Auto`]).
    pub fn connect(endpoint: &Endpoint, cfg: ClientConfig) -> Result<RpcClient, ClientError> {
        if cfg.max_inflight == 0 || cfg.max_inflight > MAX_CLIENT_INFLIGHT {
            return Err(TransportError::Config(
                "max_inflight must be between 1 and MAX_CLIENT_INFLIGHT",
            )
            .into());
        }
        let err = |source: io::Error| ClientError::Connect {
            endpoint: endpoint.to_string(),
            source,
        };
        let io_cfg = client_io(&cfg.io);
        // Auto means the syscall wire here (see the transport essay);
        // io_uring only when asked for, and then it must work.
        let use_uring = io_cfg.backend.resolve_env()? == BackendChoice::Uring;
        if use_uring {
            super::probe_uring(&io_cfg)?;
        }
        let sock = match endpoint {
            Endpoint::Unix(path) => {
                let s = connect_unix(path, Duration::from_millis(cfg.connect_timeout_ms))
                    .map_err(err)?;
                Sock::Unix(s)
            }
            Endpoint::Tcp(addr) => {
                let s =
                    TcpStream::connect_timeout(addr, Duration::from_millis(cfg.connect_timeout_ms))
                        .map_err(err)?;
                s.set_nodelay(true).map_err(err)?;
                s.set_nonblocking(true).map_err(err)?;
                Sock::Tcp(s)
            }
        };
        let with_fds = matches!(sock, Sock::Unix(_));
        let wire = if use_uring {
            let w = uring::UringWire::new(&io_cfg, sock.fd(), with_fds)
                .map_err(TransportError::UringUnavailable)?;
            Wire::Uring(Box::new(w))
        } else {
            Wire::Syscall(fallback::SyscallWire::new(with_fds))
        };
        let done = (0..cfg.max_inflight).map(|_| AtomicU64::new(0)).collect();
        let backend = wire.backend();
        Ok(RpcClient {
            inner: Arc::new(Inner {
                reader: Mutex::new(Reader {
                    wire,
                    stream_bytes: 0,
                    fd_batches: VecDeque::new(),
                    fds: Vec::new(),
                }),
                sock,
                endpoint: endpoint.clone(),
                cfg,
                backend,
                send_buf: Mutex::new(Vec::new()),
                table: Mutex::new(Table::default()),
                done,
                parked: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
                accept_fds: AtomicBool::new(true),
                close_cause: Mutex::new(None),
                last_notice: Mutex::new(None),
                stats: ClientStats::default(),
            }),
        })
    }

    /// The backend this connection reads with.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    pub fn stats(&self) -> &ClientStats {
        &self.inner.stats
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// The last frame with request id 0 the server sent (a notice or the
    /// reason it refused or closed the connection).
    pub fn last_notice(&self) -> Option<(FrameHeader, Vec<u8>)> {
        self.inner
            .last_notice
            .lock()
            .as_ref()
            .map(|r| (r.header, r.payload().to_vec()))
    }

    /// Declares that no later reply on this connection carries descriptors
    /// (the directory and the pool manager send them only with the reply
    /// that opens a session: `Welcome`, `Reattached`, `PoolWelcome`).
    /// From then on replies are read with `recv` instead of `recvmsg`: the
    /// leader polls with `recv` between replies, and a `recvmsg` costs
    /// ~100 ns more per call here (copying the message header and iovec in,
    /// the control buffer out) — a fifth of the client's polling time in a
    /// profile of the one-key round trip. Descriptors a peer still attaches
    /// are closed by the kernel, never delivered (`MSG_CTRUNC`); the frame
    /// itself arrives intact. Call it after the opening reply was received;
    /// calling it earlier loses that reply's descriptors. No-op on TCP.
    pub fn decline_fds(&self) {
        // Relaxed: see the load in `lead`.
        self.inner.accept_fds.store(false, Ordering::Relaxed);
    }

    /// Sends a request and waits for its reply (at most `timeout`).
    pub fn call(&self, kind: u16, payload: &[u8], timeout: Duration) -> Result<Reply, ClientError> {
        self.start(kind, payload, timeout)?.wait()
    }

    /// Sends a request and returns without waiting, so one thread can have
    /// several requests in flight. The deadline starts now.
    pub fn start(
        &self,
        kind: u16,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<PendingCall, ClientError> {
        let inner = &self.inner;
        let deadline = Instant::now() + timeout;
        self.check_open()?;
        // Checked before a slot is taken: an oversized request never
        // reaches the wire.
        FrameHeader::new(kind, 0, payload.len())?;
        let (_, request_id) = inner.table.lock().alloc(inner.cfg.max_inflight).ok_or(
            ClientError::TooManyInFlight {
                limit: inner.cfg.max_inflight,
            },
        )?;
        let call = PendingCall {
            client: self.clone(),
            request_id,
            deadline,
            timeout,
            live: true,
        };
        // `fail_all` completes every registered request; one registered
        // after its sweep sees `closed` here (the table lock orders the two).
        self.check_open()?;
        ClientStats::bump(&inner.stats.requests);
        self.send_frame(kind, payload, request_id, deadline, timeout)?;
        Ok(call)
    }

    fn check_open(&self) -> Result<(), ClientError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(self.inner.closed_error());
        }
        Ok(())
    }

    /// Encodes a frame and writes all of it before `deadline`.
    fn send_frame(
        &self,
        kind: u16,
        payload: &[u8],
        request_id: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let inner = &self.inner;
        let timeout_err = || ClientError::Timeout {
            request_id,
            timeout_ms: timeout.as_millis() as u64,
        };
        // Held until the whole frame is written: frames stay whole on the
        // stream.
        let Some(mut buf) = inner.send_buf.try_lock_until(deadline) else {
            return Err(timeout_err());
        };
        if payload.len() >= VECTORED_SEND_MIN_BYTES {
            let header = FrameHeader::new(kind, request_id, payload.len())?.encode();
            let pad = [0u8; FRAME_ALIGN];
            let parts = [&header[..], payload, &pad[..padding(payload.len())]];
            return self.write_all(&parts, deadline, timeout_err);
        }
        buf.clear();
        encode_frame(&mut buf, kind, request_id, payload)?;
        let result = self.write_all(&[&buf], deadline, timeout_err);
        if buf.capacity() > SEND_BUFFER_KEEP_BYTES {
            *buf = Vec::new();
        }
        result
    }

    /// Writes `parts`, in order, as one stretch of the stream before
    /// `deadline` (the caller holds the send lock): one `send` for a single
    /// part, a vectored `sendmsg` for several.
    fn write_all(
        &self,
        parts: &[&[u8]],
        deadline: Instant,
        timeout_err: impl Fn() -> ClientError,
    ) -> Result<(), ClientError> {
        const MAX_PARTS: usize = 3;
        debug_assert!(
            parts.len() <= MAX_PARTS,
            "frames are sent in at most 3 parts"
        );
        let inner = &self.inner;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut written = 0;
        while written < total {
            self.check_open()?;
            // What is left: the parts after `written`, the first cut.
            let mut left = [IoSlice::new(&[]); MAX_PARTS];
            let mut n = 0;
            let mut skip = written;
            for part in parts {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                left[n] = IoSlice::new(&part[skip..]);
                skip = 0;
                n += 1;
            }
            let sent = match &left[..n] {
                [one] => sys::send(inner.sock.fd(), one),
                several => sys::send_with_fds(inner.sock.fd(), several, &[]),
            };
            match sent {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        if written > 0 {
                            inner.fail_all(
                                "a request timed out half-written; the stream is unframed".into(),
                                None,
                            );
                        }
                        return Err(timeout_err());
                    }
                    if let Err(e) = sys::poll_one(inner.sock.fd(), libc::POLLOUT, deadline - now) {
                        inner.fail_all(format!("poll for writing: {e}"), None);
                        return Err(inner.closed_error());
                    }
                }
                Err(e) => {
                    inner.fail_on_send(&e);
                    return Err(inner.closed_error());
                }
            }
        }
        Ok(())
    }
}

impl PendingCall {
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Waits for the reply until the request's deadline.
    pub fn wait(mut self) -> Result<Reply, ClientError> {
        let inner = Arc::clone(&self.client.inner);
        let id = self.request_id;
        let spin = Duration::from_micros(u64::from(inner.cfg.io.spin_us));
        let mut idle_since: Option<Instant> = None;
        let mut registered = false;
        let mut spinner = Spinner::default();
        loop {
            if inner.is_done(id) {
                self.live = false;
                return inner.take(id);
            }
            let now = Instant::now();
            if now >= self.deadline {
                self.live = false;
                return inner.expire(id, self.timeout);
            }
            if let Some(mut reader) = inner.reader.try_lock() {
                ClientStats::bump(&inner.stats.leader_turns);
                inner.lead(&mut reader, id, now, self.deadline);
                drop(reader);
                inner.hand_off(id);
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < spin {
                spinner.pause(now);
                continue;
            }
            if !registered {
                inner.register_waiter(id);
                registered = true;
            }
            // SeqCst fence: see "Handoff invariant" in the module essay.
            fence(Ordering::SeqCst);
            if inner.is_done(id) || !inner.reader.is_locked() {
                continue;
            }
            std::thread::park_timeout(self.deadline - now);
        }
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if self.live {
            // Never waited for: free the slot; its reply will be late.
            let inner = &self.client.inner;
            let (result, was_parked) = inner.table.lock().release(self.request_id);
            debug_assert!(!was_parked, "only `wait` registers a waiter");
            drop(result); // outside the lock: it may close descriptors
        }
    }
}

impl Inner {
    fn is_done(&self, id: u64) -> bool {
        // Acquire pairs with the Release in `complete`/`fail_all`: the
        // result stored before it is visible (we also read it under the lock).
        self.done[Table::slot_of(id)].load(Ordering::Acquire) == id
    }

    /// Takes the result of a done request and frees its slot.
    fn take(&self, id: u64) -> Result<Reply, ClientError> {
        let (result, was_parked) = self.table.lock().release(id);
        if was_parked {
            // Relaxed: a count read after a SeqCst fence (see `hand_off`).
            self.parked.fetch_sub(1, Ordering::Relaxed);
        }
        result.expect("a done slot holds its result until its waiter takes it")
    }

    /// The deadline passed: free the slot, unless the reply raced in.
    fn expire(&self, id: u64, timeout: Duration) -> Result<Reply, ClientError> {
        let (result, was_parked) = self.table.lock().release(id);
        if was_parked {
            self.parked.fetch_sub(1, Ordering::Relaxed);
            // A leader may have just unparked this waiter to read next; it
            // leaves instead, so the turn goes on to another.
            self.hand_off(id);
        }
        if let Some(r) = result {
            return r;
        }
        ClientStats::bump(&self.stats.timeouts);
        Err(ClientError::Timeout {
            request_id: id,
            timeout_ms: timeout.as_millis() as u64,
        })
    }

    /// Makes `id`'s waiter findable by a leader that leaves (it will park).
    fn register_waiter(&self, id: u64) {
        let mut t = self.table.lock();
        if let Some(e) = t.entry_mut(id)
            && e.waiter.is_none()
        {
            e.waiter = Some(std::thread::current());
            // SeqCst: the store side of the handoff (see `hand_off`).
            self.parked.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Unparks a waiter whose reply is outstanding if nobody reads — never
    /// request `exclude`'s own, the caller's: a leader leaving because its
    /// own deadline passed still has its entry registered and unanswered,
    /// and waking itself would leave every other waiter parked with the
    /// reader free (their replies unread until their deadlines).
    fn hand_off(&self, exclude: u64) {
        // SeqCst fence: see "Handoff invariant" in the module essay; the
        // loads after it may be Relaxed.
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) == 0 || self.reader.is_locked() {
            return;
        }
        let next = self
            .table
            .lock()
            .entries
            .iter()
            .find(|e| e.id != 0 && e.id != exclude && e.result.is_none() && e.waiter.is_some())
            .and_then(|e| e.waiter.clone());
        if let Some(t) = next {
            t.unpark();
        }
    }

    fn closed_error(&self) -> ClientError {
        let (cause, notice) = self.close_cause.lock().as_ref().map_or_else(
            || ("closed".to_owned(), None),
            |(c, n)| {
                (
                    c.clone(),
                    n.as_ref().map(|r| Box::new(r.copy_without_fds())),
                )
            },
        );
        ClientError::Closed {
            endpoint: self.endpoint.to_string(),
            cause,
            notice,
        }
    }

    fn notice_copy(&self) -> Option<Box<Reply>> {
        self.last_notice
            .lock()
            .as_ref()
            .map(|n| Box::new(n.copy_without_fds()))
    }

    /// Marks the connection dead and completes every pending request with
    /// `Closed`.
    fn fail_all(&self, cause: String, notice: Option<Box<Reply>>) {
        {
            let mut c = self.close_cause.lock();
            if c.is_none() {
                *c = Some((cause, notice));
            }
        }
        // SeqCst (a Release would do): ordered before the sweep below by
        // the table lock, which is what `start` relies on.
        self.closed.store(true, Ordering::SeqCst);
        // Shut the socket so a leader sleeping in the kernel wakes up.
        let _ = sys::shutdown(self.sock.fd());
        let mut wake = Vec::new();
        {
            let mut t = self.table.lock();
            for (slot, e) in t.entries.iter_mut().enumerate() {
                if e.id != 0 && e.result.is_none() {
                    e.result = Some(Err(self.closed_error()));
                    // Release: publishes the result to `is_done`.
                    self.done[slot].store(e.id, Ordering::Release);
                    wake.extend(e.waiter.clone());
                }
            }
        }
        for t in wake {
            t.unpark();
        }
    }

    /// Hands a decoded reply to its request, or counts it as late.
    fn complete(&self, id: u64, reply: Result<Reply, ClientError>) {
        let mut unclaimed = None;
        let waiter = {
            let mut t = self.table.lock();
            match t.entry_mut(id) {
                Some(e) if e.result.is_none() => {
                    e.result = Some(reply);
                    // Release: publishes the result to `is_done`.
                    self.done[Table::slot_of(id)].store(id, Ordering::Release);
                    e.waiter.clone()
                }
                _ => {
                    unclaimed = Some(reply);
                    None
                }
            }
        };
        if let Some(t) = waiter {
            t.unpark();
        }
        if unclaimed.is_some() {
            ClientStats::bump(&self.stats.late_replies);
        }
    }

    /// Reads and dispatches replies until `id`'s is done, the deadline
    /// passes or the connection dies. Leaves no receive in flight. `now` is
    /// the caller's latest clock reading (one read fewer per call: each
    /// costs tens of nanoseconds on a VM).
    fn lead(&self, reader: &mut Reader, id: u64, now: Instant, deadline: Instant) {
        let spin = Duration::from_micros(u64::from(self.cfg.io.spin_us));
        let mut spinner = Spinner::default();
        let mut active_until = now + spin;
        while !self.closed.load(Ordering::Acquire) {
            // Relaxed: `decline_fds` is called by the thread that received
            // the last descriptor-carrying reply, after it did (its own
            // program order); another reader may see the change a read late,
            // which only costs a `recvmsg` instead of a `recv`.
            let accept_fds = self.accept_fds.load(Ordering::Relaxed);
            let read = reader
                .wire
                .read(self.sock.fd(), &mut reader.fds, accept_fds);
            let got = self.absorb(reader, read);
            if self.is_done(id) || self.closed.load(Ordering::Acquire) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if got {
                active_until = now + spin;
            } else if now < active_until {
                spinner.pause(now);
            } else {
                if let Err(e) = reader.wire.block(self.sock.fd(), deadline - now) {
                    self.fail_all(format!("wait for a reply: {e}"), None);
                    break;
                }
                active_until = Instant::now() + spin;
            }
        }
        let last = reader.wire.quiesce(&mut reader.fds);
        self.absorb(reader, last);
    }

    /// Acts on one read: dispatches what arrived, or fails the connection.
    /// True if bytes arrived.
    fn absorb(&self, reader: &mut Reader, read: Read) -> bool {
        match read {
            Read::Nothing => false,
            Read::Bytes { n, fds_truncated } => {
                if fds_truncated {
                    tracing::warn!(
                        "descriptors dropped by the kernel: more than one frame may carry"
                    );
                }
                let start = reader.stream_bytes;
                reader.stream_bytes += n as u64;
                if !reader.fds.is_empty() {
                    let fds = std::mem::take(&mut reader.fds);
                    reader.fd_batches.push_back((start, start + n as u64, fds));
                }
                self.dispatch(reader);
                true
            }
            Read::Eof => {
                self.dispatch(reader);
                self.fail_all(
                    "the server closed the connection".into(),
                    self.notice_copy(),
                );
                false
            }
            Read::Failed(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                // A Unix peer that closes with our request unread reports
                // a reset first; what it sent before (a refusal frame) is
                // still readable after it.
                self.drain(reader);
                self.fail_all(format!("receive: {e}"), self.notice_copy());
                false
            }
            Read::Failed(e) => {
                self.fail_all(format!("receive: {e}"), None);
                false
            }
        }
    }

    /// Reads (bounded) and dispatches what a peer that is closing or has
    /// reset the connection sent before, so that its notice (a refusal)
    /// reaches the close error. Descriptors are not collected: the
    /// connection is dying.
    fn drain(&self, reader: &mut Reader) {
        for _ in 0..MAX_DRAIN_READS {
            let Some(decoder) = reader.wire.decoder() else {
                return;
            };
            match sys::recv(self.sock.fd(), decoder.spare(READ_CHUNK_BYTES)) {
                Ok(n) if n > 0 => {
                    decoder.filled(n);
                    reader.stream_bytes += n as u64;
                    self.dispatch(reader);
                }
                _ => return,
            }
        }
    }

    /// A send failed: the server may have closed after saying why (a
    /// refusal frame, sent before it read our request). Collect that
    /// notice if no leader is reading, then fail the connection.
    fn fail_on_send(&self, e: &io::Error) {
        if let Some(mut reader) = self.reader.try_lock() {
            self.drain(&mut reader);
        }
        self.fail_all(format!("send: {e}"), self.notice_copy());
    }

    fn dispatch(&self, reader: &mut Reader) {
        let Reader {
            wire, fd_batches, ..
        } = reader;
        // Only reached between receives: a wire with a receive in flight
        // has just reported it complete.
        let Some(decoder) = wire.decoder() else {
            debug_assert!(false, "dispatch while a receive is in flight");
            return;
        };
        loop {
            let at = decoder.next_frame_offset();
            let (header, reply) = match decoder.decode() {
                Ok(None) => return,
                Err(e) => {
                    self.fail_all(format!("corrupt reply stream: {e}"), None);
                    return;
                }
                Ok(Some(Decoded::Rejected { header, error })) => (
                    header,
                    Err(ClientError::BadReply {
                        request_id: header.request_id,
                        error,
                    }),
                ),
                Ok(Some(Decoded::Frame(f))) => {
                    (f.header, Ok(Reply::new(f.header, f.payload, Vec::new())))
                }
            };
            // `wire_len`, not `frame_len`: a rejected (oversized) header's
            // length may overflow a 32-bit `usize`.
            let fds = take_fds(fd_batches, at, wire_len(header.payload_len), &self.stats);
            let reply = reply.map(|mut r| {
                r.fds = fds;
                r
            });
            if header.request_id == 0 {
                ClientStats::bump(&self.stats.notices);
                if let Ok(r) = reply {
                    *self.last_notice.lock() = Some(r);
                }
                continue;
            }
            self.complete(header.request_id, reply);
        }
    }
}

/// The descriptors that arrived with the frame at stream offset `at` of
/// `len` bytes (see the module essay); batches that precede it are strays.
fn take_fds(
    batches: &mut VecDeque<(u64, u64, Vec<OwnedFd>)>,
    at: u64,
    len: u64,
    stats: &ClientStats,
) -> Vec<OwnedFd> {
    while let Some(&(start, end, _)) = batches.front() {
        if start > at {
            return Vec::new();
        }
        if end <= at {
            let (_, _, stray) = batches.pop_front().expect("front exists");
            // Relaxed: a tally.
            stats
                .stray_fds
                .fetch_add(stray.len() as u64, Ordering::Relaxed);
            continue;
        }
        // start <= at < end: the batch came with this frame's first bytes;
        // it is this frame's if the frame reaches the end of that receive.
        if at + len >= end {
            return batches
                .pop_front()
                .map(|(_, _, fds)| fds)
                .unwrap_or_default();
        }
        return Vec::new();
    }
    Vec::new()
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = sys::shutdown(self.sock.fd());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_never_zero_and_a_reused_slot_gets_a_new_id() {
        let mut t = Table::default();
        let (s0, a) = t.alloc(2).expect("room for two");
        let (_, b) = t.alloc(2).expect("room for two");
        assert!(t.alloc(2).is_none(), "the limit holds");
        assert!(a != 0 && b != 0 && a != b);
        assert!(matches!(t.release(a), (None, false)));
        let (s2, c) = t.alloc(2).expect("a slot was freed");
        assert_eq!(s2, s0, "the freed slot is reused");
        assert_ne!(c, a, "with a new generation");
        assert!(
            t.entry_mut(a).is_none(),
            "a late reply to the old id finds nothing"
        );
        assert!(t.entry_mut(c).is_some());
        assert_eq!(Table::slot_of(c), s0 as usize);
    }

    #[test]
    fn a_generation_that_wraps_skips_zero() {
        let mut t = Table::default();
        let (slot, id) = t.alloc(1).expect("room");
        t.entries[slot as usize].generation = u32::MAX;
        t.release(id);
        let (_, id) = t.alloc(1).expect("room");
        assert_eq!(id >> 32, 1, "generation 0 would make id 0 possible");
    }

    #[test]
    fn releasing_a_stale_id_leaves_the_new_occupant_alone() {
        let mut t = Table::default();
        let (_, old) = t.alloc(1).expect("room");
        t.release(old);
        let (_, new) = t.alloc(1).expect("room");
        assert!(matches!(t.release(old), (None, false)));
        assert!(t.entry_mut(new).is_some(), "still registered");
    }

    fn memfd() -> OwnedFd {
        // SAFETY: a NUL-terminated name; a non-negative result is a new fd.
        let raw = unsafe { libc::memfd_create(c"cxlkv-unit".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        unsafe { sys::own_fd(raw) }
    }

    #[test]
    fn descriptors_go_to_the_frame_that_reaches_the_end_of_their_receive() {
        let stats = ClientStats::default();
        // A receive of bytes 100..300 brought one descriptor.
        let mut batches = VecDeque::from([(100, 300, vec![memfd()])]);
        // A frame that ends inside the receive is not the carrier...
        assert!(take_fds(&mut batches, 100, 64, &stats).is_empty());
        // ...the one that starts inside it and reaches its end is.
        assert_eq!(take_fds(&mut batches, 164, 136, &stats).len(), 1);
        assert!(batches.is_empty());
        // A batch no frame claimed is a stray once frames pass it.
        let mut batches = VecDeque::from([(0, 64, vec![memfd()])]);
        assert!(take_fds(&mut batches, 64, 64, &stats).is_empty());
        assert_eq!(stats.stray_fds.load(Ordering::Relaxed), 1);
    }
}
