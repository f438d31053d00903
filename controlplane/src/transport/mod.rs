//! Transport: moves frames between clients and the server's event loop.
//!
//! The transport knows frames (`crate::frame`), not messages. A [`Server`]
//! owns every socket on one event-loop thread and calls a [`Handler`] for
//! connection events and complete frames; the handler answers at once
//! through [`Replies`] or later from any thread through a [`Completer`]
//! (after a journal sync or a pool-manager round trip), without blocking
//! other connections. Unix peers are identified by `SO_PEERCRED`
//! ([`PeerInfo`]); replies can carry descriptors (`SCM_RIGHTS`). The
//! [`RpcClient`] pipelines requests from many threads over one connection,
//! matching replies by request id, each with its own deadline.
//!
//! **Backends.** The server: io_uring (multishot accept; by default one
//! receive per connection straight into its frame decoder, re-armed after
//! each completion, or a multishot receive into a provided-buffer ring
//! with [`RecvMode::Provided`]; batched submissions; a lone reply with no
//! send in flight is written at once with one non-blocking `send`, and
//! whatever the socket does not take — or a batch, or a frame carrying
//! descriptors — goes through the ring as a `SEND` or `SENDMSG`) or an
//! epoll fallback. The client (`client/`): a *syscall wire*
//! (`recvmsg`/`recv`, `poll` to sleep) or an *io_uring wire* (one receive at
//! a time into the decoder, armed by the thread that currently reads).
//! Each end takes [`IoConfig::backend`], else `CXLKV_IO=uring|fallback`,
//! else its measured default: the server takes io_uring if a functional
//! probe ([`probe_uring`]: a real multishot receive) succeeds, else the
//! fallback with one `warn!` line per process; the client takes the
//! syscall wire, which measured faster (below): a reply costs it one
//! `recvmsg` — one `recv` once the caller has declined descriptors after
//! the session's opening reply ([`RpcClient::decline_fds`]) — while the
//! io_uring wire arms a poll per reply and completes it through kernel
//! task work. Client sends are plain non-blocking system calls on both
//! wires (one per frame either way: `send`, or a vectored `sendmsg` that
//! spares copying a payload of 16 KiB or more).
//!
//! **Waiting.** Both ends poll without sleeping for `spin_us` (default 200)
//! after their last event, then block in the kernel (`epoll_wait`,
//! `io_uring_enter`, `poll`). Between two polls a poller yields the CPU,
//! unless its last yield came back within 1.5 µs — nobody else wanted the
//! CPU — in which case it polls without yielding for the next 10 µs
//! (`spin.rs`). Yielding is what a loaded host needs: on this 2-vCPU VM at
//! load ~6–8, client and server mostly share one vCPU, and every
//! microsecond a poller keeps the CPU without yielding is added to the
//! round trip (p50 6.9 µs yielding at each poll; 12.0 / 27.3 / 57.3 µs when
//! each wait first polled 5 / 20 / 50 µs without yielding; the previous
//! design's 200 µs pure spin gave ~410 µs). Not yielding when alone is what
//! a quiet host needs: there a `sched_yield` is a ~350 ns system call that
//! doubles the polling period (an adaptive vs an always-yielding client
//! against the same server: ratio 0.669 vs 0.646 and 0.661 vs 0.645 with
//! the host quieted as below; 0.650 vs 0.636 under load). These
//! comparisons and the task-run ones below come from a scratch harness
//! that interleaves blocks of 2000 round trips of several configurations
//! against one server; the rest is `cxlkv bench rtt`. An io_uring server that spins checks the ring's
//! TASKRUN flag and enters the kernel only when receive work waits, then
//! reaps at once (it used to yield first).
//!
//! **The polled connection** ([`IoConfig::spin_recv`], on by default; not
//! with `spin_us = 0` or [`RecvMode::Provided`]).
//! While the server loop spins it reads the connection the last request
//! came on with plain non-blocking `recv`s, one a turn, as the raw
//! exchange's server does, until that connection sends nothing for 50 µs,
//! the loop goes to sleep, or it closes; then it waits for it through its
//! backend again. An io_uring loop keeps no receive in the ring for it
//! meanwhile (the two would race for the decoder's bytes) and, on a turn
//! the polled read found bytes, still lets the kernel run the ring's
//! pending receive work, so one connection that never stops sending does
//! not hold the others' requests back; an epoll loop asks epoll every
//! fourth turn while it polls. Why: a one-key round trip split into its
//! parts (a raw client against our server, our client against a raw frame
//! server, both against the raw exchange, in one run) put ~0.1–0.5 µs on
//! the client and ~1.0–1.3 µs on the server above the raw exchange, and `rdtsc`
//! probes in the io_uring loop put the largest part on the receive: the
//! `io_uring_enter` that runs it took ~3,450 cycles (1.3 µs) on average
//! against ~2,900 for a plain `recv` of the same bytes in the same loop;
//! an epoll loop pays an `epoll_wait` before its `recv`. Alternated
//! against the same code with it off, one client, one-key `Exists`
//! (`docs/benchmarks.md`, session 30), a round trip's p50 fell by ~0.5 µs
//! with io_uring (ratio to the raw exchange 0.64–0.84 against 0.57–0.75).
//!
//! **io_uring flags** ([`TaskRun`], `ring.rs`). Server rings default to
//! `DEFER_TASKRUN` (with `SINGLE_ISSUER` and `TASKRUN_FLAG`): receive work
//! waits in the ring until the loop asks for it, without signalling a
//! task. Quieted host, same harness, median over 8 blocks of the per-block
//! ratio, two runs each: defer 0.713 / 0.714, coop 0.642 / 0.662, coop +
//! single issuer 0.655 / 0.673, interrupt 0.525 / 0.521. Under load defer
//! and coop tie at the median (0.644 / 0.639 / 0.637 vs 0.628 / 0.646 /
//! 0.627; defer's lower quartile is lower). Client rings use coop (a
//! single-issuer ring cannot follow the reading role from thread to
//! thread). **SQPOLL is off**: the kernel refuses it with any task-run flag
//! (`EINVAL` on 6.18), so an SQPOLL ring has none (`TaskRun` does not
//! apply); on this shared 2-vCPU host its kernel thread, which burns CPU
//! while it polls, does not get a vCPU when the receive work it owns is
//! due: a round trip took 5.2 µs in one rep (ratio 1.00) and 6.2 ms at the
//! median (`sqpoll=on`); a request after a pause of 5–20 ms took 11–12 ms
//! (3.3 ms after 50 ms), whatever `sqpoll_idle_ms` (1, 3, 10, 30) and even
//! with the server loop still spinning; with SQPOLL rings on both ends the
//! median was 28 ms. It would need a core of its own.
//!
//! **Measurements** (2-vCPU VM, kernel 6.18, shared with other builds at
//! load ~10; `ratio` = raw busy-polling ping-pong p50 ÷ ours, one-key byte
//! counts, target ≥ 0.67 for `transport=unix,backend=default`). A quiet
//! host is stood in for by real-time priority for our threads (`chrt -f 1
//! cxlkv bench rtt --quick --reps 5`; never with SQPOLL cases, whose
//! kernel thread would starve). Ratios, one per run:
//!
//! | case (`cxlkv bench rtt …`)       | quieted, before | quieted, now | loaded, before      | loaded, now         |
//! |----------------------------------|-----------------|--------------|---------------------|---------------------|
//! | `unix,backend=default`           | 0.571, 0.587    | 0.684, 0.699 | 0.483, 0.627, 0.644 | 0.685, 0.645, 0.700 |
//! | `unix,backend=fallback`          | 0.633, 0.658    | 0.709, 0.714 | 0.476, 0.651, 0.481 | 0.701, 0.700, 0.560 |
//! | `unix,backend=uring` (both ends) | —               | 0.516, 0.547 | —                   | 0.592, 0.535, 0.627 |
//! | `tcp,backend=default`            | 0.772, 0.746    | 0.876, 0.876 | 0.632, 0.815, 0.640 | 0.874, 0.832, 1.058 |
//! | `unix,…,idle_gap_ms=1`           | 0.282, 0.313    | 0.333, 0.313 | (raw side starved)  | (raw side starved)  |
//! | `inflight=64`, ours in req/s     | 497 k, 476 k    | 552 k, 621 k | 275 k, 143 k, 339 k | 213 k, 241 k, 217 k |
//!
//! "Before" is the previous commit of this module (syscall client with a
//! hash map of pending requests, `COOP_TASKRUN`, a yield at every poll).
//! After a 1 ms pause ours takes ~38 µs against the raw pair's ~12 µs: the
//! raw peers never sleep, ours sleep after `spin_us`. Polling through the
//! pause (`spin_us=2000,idle_gap_ms=1`) bought nothing under load (34 µs
//! vs 24 µs for the default in the same run); it is not measured quieted.
//! Loaded runs scatter: per rep, `unix,backend=default` ranged 0.48–0.74.
//! The full run (`cxlkv bench rtt --reps 5`, loaded) adds the variants:
//! `taskrun=coop` 0.535, `taskrun=interrupt` 0.547, `spin_us=0` 0.601
//! (under load a sleeping poller is woken onto a busy vCPU cheaply; on an
//! idle one a wake-up costs ~50 µs), `client=uring` 0.516 against the
//! syscall wire's 0.700 in the same run.
//!
//! **Bounds.** Connections (`max_connections`, refused with a
//! handler-built frame), requests in flight per connection (rejected with
//! [`Rejection::TooManyInFlight`]), bytes queued per connection (a peer that
//! stops reading is dropped), time a partial frame may sit and time a
//! closing connection may take to take its last replies (both
//! `partial_frame_timeout_ms`), completions pending from other threads,
//! provided receive buffers ([`MAX_RECV_BUFFER_POOL_BYTES`]), and on the
//! client requests in flight (`max_inflight`, at most
//! [`MAX_CLIENT_INFLIGHT`]) and a deadline per request. An `accept` that
//! fails for lack of descriptors pauses accepting (10–100 ms, a timer of
//! the loop, one warning per 10 s) instead of being retried at once.
//!
//! **Closing.** A peer that ends its stream (`shutdown(SHUT_WR)` after
//! pipelining requests) gets every reply, then end of stream; a write error
//! closes at once. A Unix peer that closes fully afterwards is noticed at
//! once by the fallback backend (its hangup), by io_uring at the next
//! failed write or the drain bound; replies a fault plan holds back
//! (`Delay`) are not waited for (`server` module).
//!
//! **A loop that ends.** The loop ends when asked ([`ServerHandle`]'s
//! `shutdown`), or on its own — an I/O error of the loop, or a panic (of
//! the handler, say) — closing every connection. [`ServerHandle::failure`]
//! and a [`LoopWatch`] (which an owner that does not hold the handle
//! passes in through [`ServerConfig::loop_watch`]) say so, so that the
//! process can exit instead of serving nobody.
//!
//! **Bad input.** An intact header with a wrong version or oversized
//! payload reaches [`Handler::on_rejected`] (the connection lives); a
//! corrupt header closes only that connection.
//!
//! **Fault injection** (feature `fault-injection`, module `fault`): a
//! `fault::FaultPlan` consulted on the server's request and reply path —
//! drop, delay, duplicate or reorder a reply, reset a connection — with the
//! scripted `fault::FaultScript` (plain names: the module exists only with
//! the feature, and `cargo doc` without it would find no target).

pub mod client;
pub mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod ring;
pub mod server;
mod spin;
pub mod sys;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

pub use client::{ClientError, ClientStats, MAX_CLIENT_INFLIGHT, PendingCall, Reply, RpcClient};
pub use config::{
    Backend, BackendChoice, ClientConfig, DEFAULT_UNIX_SOCKET_MODE, Endpoint, IO_ENV, IoConfig,
    MAX_RECV_BUFFER_POOL_BYTES, RecvMode, ServerConfig, TaskRun,
};
pub use server::{
    Admit, Completer, ConnId, DisconnectReason, Handler, LoopWatch, PeerInfo, Refusal,
    RefuseReason, Rejection, Replies, ReplyError, Server, ServerHandle, ServerStats,
    ServerStatsSnapshot,
};
pub use sys::{
    ExistingSocket, MAX_FDS_PER_FRAME, PeerCred, check_socket_dir, classify_existing_socket,
    prepare_socket_dir,
};

/// Errors setting up or running the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("environment variable {var}={value:?} is not one of uring, fallback, auto")]
    BadEnv { var: &'static str, value: String },
    #[error("io_uring was requested but cannot be set up: {0}")]
    UringUnavailable(io::Error),
    #[error("invalid transport configuration: {0}")]
    Config(&'static str),
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        endpoint: Endpoint,
        source: io::Error,
    },
    #[error("transport setup failed: {0}")]
    Setup(io::Error),
    #[error("transport event loop failed: {0}")]
    Io(io::Error),
    #[error("the transport event loop panicked")]
    LoopPanicked,
}

/// Whether the one-time "io_uring unavailable" line was logged.
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Checks that io_uring with `io`'s flags works here (kernel version,
/// seccomp policy) with the functional probe `BackendChoice::Auto` relies
/// on (a real multishot receive into a provided-buffer ring; cached per
/// flag set). Lets tests and tools ask without binding a server.
pub fn probe_uring(io: &IoConfig) -> Result<(), TransportError> {
    server::uring::probe(io).map_err(TransportError::UringUnavailable)
}

/// Resolves the backend: explicit config, else `CXLKV_IO`, else io_uring if
/// a ring with the features we need can be created, else the fallback (with
/// one log line per process).
pub(crate) fn pick_backend(io_cfg: &IoConfig) -> Result<Backend, TransportError> {
    match io_cfg.backend.resolve_env()? {
        BackendChoice::Fallback => Ok(Backend::Fallback),
        BackendChoice::Uring => {
            server::uring::probe(io_cfg).map_err(TransportError::UringUnavailable)?;
            Ok(Backend::Uring)
        }
        BackendChoice::Auto => match server::uring::probe(io_cfg) {
            Ok(()) => Ok(Backend::Uring),
            Err(e) => {
                if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "io_uring unavailable; using the epoll fallback transport");
                }
                Ok(Backend::Fallback)
            }
        },
    }
}
