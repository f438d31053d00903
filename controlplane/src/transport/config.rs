//! Configuration of the transport: which backend, how it waits, and its
//! limits. Defaults come from measurements recorded in the module essay
//! (`transport/mod.rs`).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::TransportError;
use super::server::LoopWatch;

/// Environment variable that forces a backend when the config says `Auto`.
pub const IO_ENV: &str = "CXLKV_IO";

/// Which I/O backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BackendChoice {
    /// `CXLKV_IO` if set, else the measured default: on the server
    /// io_uring, falling back (with one log line) when io_uring cannot be set
    /// up; on the client the syscall wire, which measured faster for its
    /// request/reply pattern (see the transport essay).
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// The server's epoll backend; the client's syscall wire.
    Fallback,
}

/// The backend actually running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    Uring,
    Fallback,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Uring => "uring",
            Backend::Fallback => "fallback",
        })
    }
}

impl BackendChoice {
    /// The choice after applying `CXLKV_IO` (only when `self` is `Auto`).
    pub fn resolve_env(self) -> Result<BackendChoice, TransportError> {
        if self != BackendChoice::Auto {
            return Ok(self);
        }
        match std::env::var(IO_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(BackendChoice::Auto),
            Ok(v) if v == "uring" => Ok(BackendChoice::Uring),
            Ok(v) if v == "fallback" => Ok(BackendChoice::Fallback),
            Ok(v) if v.is_empty() || v == "auto" => Ok(BackendChoice::Auto),
            Ok(v) => Err(TransportError::BadEnv {
                var: IO_ENV,
                value: v,
            }),
            Err(std::env::VarError::NotUnicode(v)) => Err(TransportError::BadEnv {
                var: IO_ENV,
                value: v.to_string_lossy().into_owned(),
            }),
        }
    }
}

/// How io_uring runs the work that completes a socket receive (it runs in
/// the submitting thread's context). See the transport essay for the
/// measurements behind the default and `ring.rs` for the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum TaskRun {
    /// `COOP_TASKRUN | TASKRUN_FLAG`: no inter-processor interrupt; the
    /// kernel raises a flag in the shared ring that the spinning loop checks
    /// and enters the kernel only then.
    Coop,
    /// `SINGLE_ISSUER | DEFER_TASKRUN | TASKRUN_FLAG`: the work waits in a
    /// per-ring list until the loop asks for completions (the flag says
    /// when). Server rings only: a client ring gets `Coop` instead, since
    /// its reading role moves between threads.
    #[default]
    Defer,
    /// Kernel default: task work interrupts the thread.
    Interrupt,
}

/// How the io_uring server receives ([`IoConfig::recv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum RecvMode {
    /// One receive at a time per connection, straight into the connection's
    /// frame decoder, re-armed after each completion: the bytes are copied
    /// once, by the kernel, as the epoll backend's `recv` does.
    #[default]
    Direct,
    /// One multishot receive per connection into buffers provided from a
    /// ring shared by all connections (`recv_buffer_bytes`,
    /// `recv_buffer_count`), each copied into the decoder and handed back:
    /// no re-arm per receive, but every byte is copied twice.
    Provided,
}

/// Knobs shared by the server loop and the client's reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoConfig {
    pub backend: BackendChoice,
    /// How long a waiter polls (without sleeping) after its last event before
    /// it blocks in the kernel. Waking a sleeping vCPU costs ~50 µs here, so
    /// spinning through short gaps is what keeps round trips near the raw
    /// socket's.
    pub spin_us: u32,
    /// Server: while the loop spins, read the connection the last request
    /// arrived on with plain non-blocking `recv(2)` calls, one a turn, until
    /// it sends nothing for 50 µs or the loop sleeps — instead of through the
    /// ring (io_uring: no receive is kept in the ring for it meanwhile) or
    /// epoll's readiness. A one-key request then costs the loop one `recv`,
    /// as in the raw exchange, instead of an `io_uring_enter` that runs the
    /// ring's receive (measured here ~1.3 µs against ~1.1 µs) or an
    /// `epoll_wait` plus a `recv`. One connection at most: with many busy
    /// connections it costs one `recv` a turn. On by default; no effect
    /// with `spin_us = 0` (the loop never spins) or with io_uring's
    /// [`RecvMode::Provided`] (its receive stays in the ring); the client
    /// ignores it.
    pub spin_recv: bool,
    /// io_uring: a kernel thread polls the submission queue and runs the
    /// receive work, so the loop never enters the kernel while busy (costs a
    /// core while busy; `taskrun` does not apply, the kernel refuses SQPOLL
    /// with those flags; see the module essay for why it is off by default).
    pub sqpoll: bool,
    /// io_uring: the SQPOLL thread sleeps after this much idle time.
    pub sqpoll_idle_ms: u32,
    pub taskrun: TaskRun,
    /// io_uring submission-queue entries of the server's ring (the
    /// completion queue is twice this). A client ring has a fixed 4: it
    /// holds at most a receive and its cancellation.
    pub ring_entries: u32,
    /// io_uring: how the server receives. `Direct` by default: measured
    /// against `Provided` with two forked servers and one client alternating
    /// between them (`docs/benchmarks.md`, session 10), a 55 KB request's
    /// round trip took 5–6 µs less, a one-key round trip the same or less.
    pub recv: RecvMode,
    /// io_uring provided receive buffers of the server ([`RecvMode::Provided`]
    /// only): bytes each (a receive completes with at most this many bytes;
    /// more than the frame decoder has room for is taken in pieces) ...
    pub recv_buffer_bytes: u32,
    /// ... and at most how many (a power of two, ≤ 32768; all of them
    /// together at most [`MAX_RECV_BUFFER_POOL_BYTES`]). The server
    /// starts with 16 in circulation, so that receives land in memory that
    /// is still in cache, and doubles that each time a receive finds them
    /// all in use (counted in `ServerStats::recv_buffers_exhausted`).
    pub recv_buffer_count: u16,
}

/// Most bytes of provided receive buffers a server reserves
/// (`recv_buffer_count × recv_buffer_bytes`; the default is 4 MiB). The
/// server allocates them all when it starts: an unbounded product (up to
/// 512 GiB) would abort the process there instead of refusing the
/// configuration.
pub const MAX_RECV_BUFFER_POOL_BYTES: usize = 256 << 20;

/// Most provided receive buffers (the kernel's limit on a buffer ring).
const MAX_RECV_BUFFER_COUNT: u16 = 32768;

impl IoConfig {
    /// Checks the provided receive buffers (checked whatever the receive
    /// mode, so that a configuration does not become invalid by switching
    /// modes).
    pub fn check_recv_buffers(&self) -> Result<(), TransportError> {
        if !self.recv_buffer_count.is_power_of_two()
            || self.recv_buffer_count > MAX_RECV_BUFFER_COUNT
        {
            return Err(TransportError::Config(
                "recv_buffer_count must be a power of two ≤ 32768",
            ));
        }
        if self.recv_buffer_bytes == 0 {
            return Err(TransportError::Config("recv_buffer_bytes must be positive"));
        }
        let total = usize::from(self.recv_buffer_count) * self.recv_buffer_bytes as usize;
        if total > MAX_RECV_BUFFER_POOL_BYTES {
            return Err(TransportError::Config(
                "recv_buffer_count × recv_buffer_bytes must be at most 256 MiB",
            ));
        }
        Ok(())
    }
}

impl Default for IoConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            spin_us: 200,
            spin_recv: true,
            sqpoll: false,
            sqpoll_idle_ms: 10,
            taskrun: TaskRun::Defer,
            ring_entries: 256,
            recv: RecvMode::Direct,
            recv_buffer_bytes: 16 << 10,
            recv_buffer_count: 256,
        }
    }
}

/// Limits and knobs of a [`Server`](super::Server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub io: IoConfig,
    /// Connections served at once; more are refused (the handler may
    /// explain why in a frame) and closed.
    pub max_connections: usize,
    /// Requests of one connection delivered to the handler and not answered
    /// yet; more are rejected (`Rejection::TooManyInFlight`).
    pub max_inflight_per_conn: usize,
    /// Bytes queued for one connection and not yet taken by its socket. A
    /// peer that stops reading is disconnected when this overflows. At least
    /// one maximum frame.
    pub max_send_queue_bytes: usize,
    /// A connection that holds an incomplete frame this long is closed. It
    /// also bounds how long a closing connection — closed by the handler,
    /// or whose peer ended its stream — may take to take its last replies
    /// (`DisconnectReason::DrainTimeout`).
    pub partial_frame_timeout_ms: u64,
    /// A connection that delivers no frame for this long, with none of its
    /// requests in flight, is closed (`DisconnectReason::IdleTimeout`): how
    /// a server learns of a peer whose host vanished without closing (no
    /// FIN, no RST), when its protocol has the peer send something
    /// periodically. `None`: never (the default).
    pub idle_timeout_ms: Option<u64>,
    /// Completions posted from other threads and not yet picked up by the
    /// loop; `Completer` calls fail with `Full` beyond this.
    pub max_pending_completions: usize,
    /// Where the server reports whether its loop runs (see [`LoopWatch`]),
    /// for an owner that does not hold its handle; `None`: a watch of its
    /// own ([`ServerHandle::watch`](super::ServerHandle::watch)).
    pub loop_watch: Option<LoopWatch>,
    /// Permission bits of each Unix socket file the server binds, set
    /// whatever the process umask ([`DEFAULT_UNIX_SOCKET_MODE`]). Whoever
    /// can connect gets the pool's descriptor: keep "others" out.
    pub unix_socket_mode: u32,
}

/// The mode of a listening Unix socket file: its owner and its group
/// (connecting needs write permission). The group is the process's (e.g.
/// `cxlkv` under the systemd units) or the directory's when it is setgid.
pub const DEFAULT_UNIX_SOCKET_MODE: u32 = 0o660;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            io: IoConfig::default(),
            max_connections: 1024,
            max_inflight_per_conn: 1024,
            max_send_queue_bytes: 2 * crate::frame::MAX_FRAME_BYTES,
            partial_frame_timeout_ms: 30_000,
            idle_timeout_ms: None,
            max_pending_completions: 65_536,
            loop_watch: None,
            unix_socket_mode: DEFAULT_UNIX_SOCKET_MODE,
        }
    }
}

/// Knobs of an [`RpcClient`](super::RpcClient).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    pub io: IoConfig,
    /// Requests in flight on the connection; `call` fails with
    /// `TooManyInFlight` beyond this (it never waits for room).
    pub max_inflight: usize,
    /// Bound on `RpcClient::connect`'s wait for the connection: a TCP
    /// handshake, or room in a Unix listener's full backlog (retried until
    /// then; a server that stopped accepting does not hold the caller
    /// longer). Past it the connect fails with `ClientError::Connect`
    /// whose source is `io::ErrorKind::TimedOut`.
    pub connect_timeout_ms: u64,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            io: IoConfig::default(),
            max_inflight: 1024,
            connect_timeout_ms: 5_000,
        }
    }
}

/// Where a server listens or a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}
