//! The pipelining client: many threads share one connection, each request
//! carries a fresh request id and a deadline, and replies are matched by id
//! in whatever order they come back.
//!
//! **Leader/follower, no reader thread.** A thread waiting for its reply
//! tries to become the connection's *leader* (a `try_lock` on the reader
//! state). The leader reads the socket — polling without sleeping for
//! `spin_us` after the last bytes arrived, then blocking in the kernel until
//! its own deadline — and hands every reply it decodes to the thread that
//! waits for it. When the leader's own reply has come, it gives up the role
//! and unparks one waiter whose reply is still outstanding, which becomes
//! the next leader. Other waiters (followers) spin on their own slot for
//! `spin_us`, then park until their deadline. A lone caller therefore reads
//! its own reply on its own thread: no cross-thread wake-up, which costs
//! ~50 µs on an idle vCPU here, sits on the round trip.
//!
//! **Handoff invariant.** Whenever the reader lock is free and some waiter's
//! reply is outstanding, a thread that leaves (leader done, or any waiter
//! leaving) unparks such a waiter. The registration of a waiter and the
//! leader's release are each followed by a SeqCst fence, so either the
//! leaving thread sees the waiter, or the waiter sees the lock free.
//!
//! **Deadlines and bounds.** Each request has a deadline: when it passes,
//! the call fails with [`ClientError::Timeout`], its id is forgotten, and a
//! reply that arrives later is dropped and counted (`late_replies`).
//! Requests in flight are bounded by `max_inflight` (an error, never an
//! unbounded wait); a send that cannot make progress before the deadline
//! fails, and if it had written part of a frame the connection is closed
//! (the byte stream can no longer be framed).
//!
//! **Descriptors.** On Unix sockets replies may carry descriptors
//! (`SCM_RIGHTS`). The server sends such a frame alone in its `sendmsg`, and
//! the kernel ends a `recvmsg` after the message that carried descriptors;
//! so descriptors received by a `recvmsg` covering stream bytes `[a, b)`
//! belong to the frame that starts in `[a, b)` and reaches `b`.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::TransportError;
use super::config::{Backend, ClientConfig, Endpoint};
use super::sys;
use crate::frame::{Decoded, FrameDecoder, FrameError, FrameHeader, encode_frame, frame_len};

/// Bytes asked of the decoder per receive.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// Reads that drain what a resetting peer sent before the reset.
const MAX_DRAIN_READS: usize = 64;

/// What went wrong with a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("no reply to request {request_id} within {timeout_ms} ms")]
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
        let mut words = vec![0u64; payload.len().div_ceil(8)];
        // SAFETY: `words` holds at least `payload.len()` bytes; u8 has no
        // alignment requirement and any byte pattern is a valid u64.
        unsafe {
            std::ptr::copy_nonoverlapping(
                payload.as_ptr(),
                words.as_mut_ptr().cast::<u8>(),
                payload.len(),
            )
        };
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
    /// Replies that arrived after their request timed out.
    pub late_replies: AtomicU64,
    /// Frames with request id 0 (server notices, refusals).
    pub notices: AtomicU64,
    /// Descriptors that arrived with no frame to attach to (closed).
    pub stray_fds: AtomicU64,
    /// Times a thread took over reading the socket.
    pub leader_turns: AtomicU64,
}

struct Slot {
    done: AtomicBool,
    result: Mutex<Option<Result<Reply, ClientError>>>,
    waiter: Mutex<Option<Thread>>,
}

impl Slot {
    fn complete(&self, r: Result<Reply, ClientError>) {
        *self.result.lock() = Some(r);
        // Release: publishes `result` to the waiter's Acquire load of `done`.
        self.done.store(true, Ordering::Release);
        if let Some(t) = self.waiter.lock().as_ref() {
            t.unpark();
        }
    }
}

enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Sock::Unix(s) => s.as_fd(),
            Sock::Tcp(s) => s.as_fd(),
        }
    }
}

/// The leader's state: the decoder and descriptors not yet tied to a frame.
struct Reader {
    decoder: FrameDecoder,
    /// `(start, end, fds)`: descriptors received by a `recvmsg` that covered
    /// stream bytes `start..end`.
    fd_batches: VecDeque<(u64, u64, Vec<OwnedFd>)>,
    scratch_fds: Vec<OwnedFd>,
}

struct Inner {
    sock: Sock,
    endpoint: Endpoint,
    cfg: ClientConfig,
    send_lock: Mutex<()>,
    pending: Mutex<HashMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
    reader: Mutex<Reader>,
    closed: AtomicBool,
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
    slot: Option<Arc<Slot>>,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl RpcClient {
    /// Connects (blocking, bounded by `connect_timeout_ms`).
    pub fn connect(endpoint: &Endpoint, cfg: ClientConfig) -> Result<RpcClient, ClientError> {
        let err = |source: io::Error| ClientError::Connect {
            endpoint: endpoint.to_string(),
            source,
        };
        // Validates CXLKV_IO even though this client reads with plain
        // system calls (see the transport essay).
        let _ = super::pick_backend(&cfg.io)?;
        let sock = match endpoint {
            Endpoint::Unix(path) => {
                // A Unix connect does not block on a listening socket (it
                // fails with EAGAIN when the backlog is full).
                let s = UnixStream::connect(path).map_err(err)?;
                s.set_nonblocking(true).map_err(err)?;
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
        Ok(RpcClient {
            inner: Arc::new(Inner {
                sock,
                endpoint: endpoint.clone(),
                cfg,
                send_lock: Mutex::new(()),
                pending: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                reader: Mutex::new(Reader {
                    decoder: FrameDecoder::new(),
                    fd_batches: VecDeque::new(),
                    scratch_fds: Vec::new(),
                }),
                closed: AtomicBool::new(false),
                close_cause: Mutex::new(None),
                last_notice: Mutex::new(None),
                stats: ClientStats::default(),
            }),
        })
    }

    /// The backend whose waiting strategy this client follows (it always
    /// reads with plain system calls; see the transport essay).
    pub fn backend(&self) -> Backend {
        Backend::Fallback
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
        // Relaxed: ids only need to be unique, not ordered with anything.
        let request_id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut bytes = Vec::new();
        encode_frame(&mut bytes, kind, request_id, payload)?;
        let slot = Arc::new(Slot {
            done: AtomicBool::new(false),
            result: Mutex::new(None),
            waiter: Mutex::new(None),
        });
        {
            let mut pending = inner.pending.lock();
            if pending.len() >= inner.cfg.max_inflight {
                return Err(ClientError::TooManyInFlight {
                    limit: inner.cfg.max_inflight,
                });
            }
            // Registered before sending: the reply may come back at once.
            pending.insert(request_id, Arc::clone(&slot));
        }
        ClientStats::bump(&inner.stats.requests);
        let call = PendingCall {
            client: self.clone(),
            request_id,
            deadline,
            timeout,
            slot: Some(slot),
        };
        self.send_frame(&bytes, request_id, deadline, timeout)?;
        Ok(call)
    }

    fn check_open(&self) -> Result<(), ClientError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(self.inner.closed_error());
        }
        Ok(())
    }

    /// Writes a whole frame before `deadline`.
    fn send_frame(
        &self,
        bytes: &[u8],
        request_id: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let inner = &self.inner;
        let timeout_err = || ClientError::Timeout {
            request_id,
            timeout_ms: timeout.as_millis() as u64,
        };
        let Some(_guard) = inner.send_lock.try_lock_until(deadline) else {
            return Err(timeout_err());
        };
        let mut written = 0;
        while written < bytes.len() {
            self.check_open()?;
            match sys::send(inner.sock.fd(), &bytes[written..]) {
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
                    inner.fail_all(format!("send: {e}"), None);
                    return Err(inner.closed_error());
                }
            }
        }
        Ok(())
    }
}

impl ClientStats {
    // Relaxed: independent tallies, read for reporting only.
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

impl PendingCall {
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Waits for the reply until the request's deadline.
    pub fn wait(mut self) -> Result<Reply, ClientError> {
        let slot = self.slot.take().expect("a pending call is waited for once");
        let inner = Arc::clone(&self.client.inner);
        *slot.waiter.lock() = Some(std::thread::current());
        // SeqCst fence: see "Handoff invariant" in the module essay.
        fence(Ordering::SeqCst);
        let spin = Duration::from_micros(u64::from(inner.cfg.io.spin_us));
        let mut follower_since: Option<Instant> = None;
        let result = loop {
            // Acquire pairs with the Release in `Slot::complete`.
            if slot.done.load(Ordering::Acquire) {
                break slot
                    .result
                    .lock()
                    .take()
                    .expect("a done slot holds its result");
            }
            let now = Instant::now();
            if now >= self.deadline {
                break self.expire(&inner, &slot);
            }
            if inner.closed.load(Ordering::Acquire) {
                inner.pending.lock().remove(&self.request_id);
                break Err(inner.closed_error());
            }
            if let Some(mut reader) = inner.reader.try_lock() {
                ClientStats::bump(&inner.stats.leader_turns);
                inner.lead(&mut reader, &slot, self.deadline);
                drop(reader);
                follower_since = None;
                continue;
            }
            let since = *follower_since.get_or_insert(now);
            if now.duration_since(since) < spin {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(self.deadline - now);
            }
        };
        *slot.waiter.lock() = None;
        inner.hand_off();
        result
    }

    /// The deadline passed: forget the request, unless its reply raced in
    /// (then it was removed from `pending` by the dispatcher and is ours).
    fn expire(&self, inner: &Inner, slot: &Slot) -> Result<Reply, ClientError> {
        let forgotten = inner.pending.lock().remove(&self.request_id).is_some();
        if !forgotten {
            // A dispatcher took the slot out of `pending` and is inside
            // `Slot::complete`, which takes no lock we hold: it finishes.
            while !slot.done.load(Ordering::Acquire) {
                std::thread::yield_now(); // see the server loop: the peer may share this vCPU
            }
            if let Some(r) = slot.result.lock().take() {
                return r;
            }
        }
        ClientStats::bump(&inner.stats.timeouts);
        Err(ClientError::Timeout {
            request_id: self.request_id,
            timeout_ms: self.timeout.as_millis() as u64,
        })
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if self.slot.take().is_some() {
            // Never waited for: free its in-flight slot; a reply is late.
            self.client.inner.pending.lock().remove(&self.request_id);
        }
    }
}

impl Inner {
    fn closed_error(&self) -> ClientError {
        let (cause, notice) = self.close_cause.lock().as_ref().map_or_else(
            || ("closed".to_owned(), None),
            |(c, n)| {
                (
                    c.clone(),
                    n.as_ref()
                        .map(|r| Box::new(Reply::new(r.header, r.payload(), Vec::new()))),
                )
            },
        );
        ClientError::Closed {
            endpoint: self.endpoint.to_string(),
            cause,
            notice,
        }
    }

    /// Marks the connection dead and fails every pending request.
    fn fail_all(&self, cause: String, notice: Option<Box<Reply>>) {
        {
            let mut c = self.close_cause.lock();
            if c.is_none() {
                *c = Some((cause, notice));
            }
        }
        self.closed.store(true, Ordering::Release);
        // Shut the socket so a leader blocked in poll wakes up.
        let _ = sys::shutdown(self.sock.fd());
        let slots: Vec<_> = self.pending.lock().drain().map(|(_, s)| s).collect();
        for s in slots {
            s.complete(Err(self.closed_error()));
        }
    }

    /// Unparks a waiter whose reply is outstanding if nobody reads.
    fn hand_off(&self) {
        // SeqCst fence: see "Handoff invariant" in the module essay.
        fence(Ordering::SeqCst);
        if self.reader.is_locked() {
            return;
        }
        let pending = self.pending.lock();
        for s in pending.values() {
            if !s.done.load(Ordering::Acquire)
                && let Some(t) = s.waiter.lock().as_ref()
            {
                t.unpark();
                return;
            }
        }
    }

    /// Reads and dispatches replies until `mine` is done, the deadline
    /// passes or the connection dies.
    fn lead(&self, reader: &mut Reader, mine: &Slot, deadline: Instant) {
        let spin = Duration::from_micros(u64::from(self.cfg.io.spin_us));
        let mut active_until = Instant::now() + spin;
        loop {
            let got = self.pump(reader);
            if mine.done.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            if got {
                active_until = now + spin;
            } else if now >= active_until {
                match sys::poll_one(self.sock.fd(), libc::POLLIN, deadline - now) {
                    Ok(_) => active_until = Instant::now() + spin,
                    Err(e) => {
                        self.fail_all(format!("poll for reading: {e}"), None);
                        return;
                    }
                }
            } else {
                std::thread::yield_now(); // see the server loop: the peer may share this vCPU
            }
        }
    }

    /// One non-blocking read and dispatch of whatever frames completed.
    /// True if bytes arrived.
    fn pump(&self, reader: &mut Reader) -> bool {
        let start = reader.decoder.next_frame_offset() + reader.decoder.buffered() as u64;
        let spare = reader.decoder.spare(READ_CHUNK_BYTES);
        let res = match &self.sock {
            Sock::Unix(s) => sys::recv_with_fds(s.as_fd(), spare, &mut reader.scratch_fds),
            Sock::Tcp(s) => sys::recv(s.as_fd(), spare).map(|bytes| sys::Received {
                bytes,
                fds_truncated: false,
            }),
        };
        match res {
            Ok(r) if r.bytes == 0 => {
                self.dispatch(reader);
                let notice = self
                    .last_notice
                    .lock()
                    .as_ref()
                    .map(|n| Box::new(Reply::new(n.header, n.payload(), Vec::new())));
                self.fail_all("the server closed the connection".into(), notice);
                false
            }
            Ok(r) => {
                reader.decoder.filled(r.bytes);
                if r.fds_truncated {
                    tracing::warn!(
                        "descriptors dropped by the kernel: more than one frame may carry"
                    );
                }
                if !reader.scratch_fds.is_empty() {
                    let fds = std::mem::take(&mut reader.scratch_fds);
                    reader
                        .fd_batches
                        .push_back((start, start + r.bytes as u64, fds));
                }
                self.dispatch(reader);
                true
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                false
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                // A Unix peer that closes with our request unread reports
                // a reset first; what it sent before (a refusal frame) is
                // still readable after it. Drain it (bounded), then fail.
                for _ in 0..MAX_DRAIN_READS {
                    let spare = reader.decoder.spare(READ_CHUNK_BYTES);
                    match sys::recv(self.sock.fd(), spare) {
                        Ok(n) if n > 0 => {
                            reader.decoder.filled(n);
                            self.dispatch(reader);
                        }
                        _ => break,
                    }
                }
                let notice = self
                    .last_notice
                    .lock()
                    .as_ref()
                    .map(|n| Box::new(Reply::new(n.header, n.payload(), Vec::new())));
                self.fail_all(format!("receive: {e}"), notice);
                false
            }
            Err(e) => {
                self.fail_all(format!("receive: {e}"), None);
                false
            }
        }
    }

    fn dispatch(&self, reader: &mut Reader) {
        loop {
            let at = reader.decoder.next_frame_offset();
            let (header, reply) = match reader.decoder.decode() {
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
                Ok(Some(Decoded::Frame(f))) => (f.header, Ok((f.header, f.payload.to_vec()))),
            };
            let fds = take_fds(
                &mut reader.fd_batches,
                at,
                frame_len(header.payload_len as usize) as u64,
                &self.stats,
            );
            let reply = reply.map(|(h, p)| Reply::new(h, &p, fds));
            if header.request_id == 0 {
                ClientStats::bump(&self.stats.notices);
                if let Ok(r) = reply {
                    *self.last_notice.lock() = Some(r);
                }
                continue;
            }
            match self.pending.lock().remove(&header.request_id) {
                Some(slot) => slot.complete(reply),
                None => ClientStats::bump(&self.stats.late_replies),
            }
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
        if end <= at || start > at {
            if start > at {
                return Vec::new();
            }
            let (_, _, stray) = batches.pop_front().expect("front exists");
            stats
                .stray_fds
                .fetch_add(stray.len() as u64, Ordering::Relaxed);
            continue;
        }
        // start <= at < end
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
