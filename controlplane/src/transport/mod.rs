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
//! **Backends.** io_uring (multishot accept, multishot receive into a
//! provided-buffer ring, `SENDMSG`) and an epoll fallback, chosen by
//! [`IoConfig::backend`], else `CXLKV_IO=uring|fallback`, else io_uring if a
//! functional probe (a real multishot receive) succeeds, else the fallback
//! with one `warn!` line per process. The client reads with plain system
//! calls on either backend: its leader/follower design (see `client.rs`)
//! makes the waiting thread read its own reply, and a receive there costs
//! one system call either way.
//!
//! **Waiting.** Both ends poll without sleeping for `spin_us` (default 200)
//! after their last event, then block in the kernel. While polling they
//! *yield* the CPU each iteration: on this 2-vCPU machine under a load of
//! ~6 (other builds) client and server often share one vCPU, and a pure
//! busy spin shorter than the scheduler slice only delays the peer — we
//! measured ~410 µs round trips with a 200 µs pure spin (≈ one spin on each
//! side), 7 µs with a 1000 µs spin (the scheduler preempts the spinner), and
//! 7.7 µs / p99 50 µs with yielding 200 µs spins. Sleeping at once
//! (`spin_us = 0`) gave 10.8 µs. io_uring rings use `COOP_TASKRUN |
//! TASKRUN_FLAG` by default (the loop checks a flag in shared memory and
//! enters the kernel only when receive work is pending): measured p50
//! 7.0 µs vs 8.1 µs for `DEFER_TASKRUN` and 10.0 µs for interrupt-driven
//! task work. SQPOLL is off: it needs a core of its own, which a 2-vCPU
//! host does not have, and this kernel refused SQPOLL combined with
//! COOP_TASKRUN (EINVAL). All of it is in [`IoConfig`].
//!
//! **Bounds.** Connections (`max_connections`, refused with a
//! handler-built frame), requests in flight per connection (rejected with
//! [`Rejection::TooManyInFlight`]), bytes queued per connection (a peer that
//! stops reading is dropped), time a partial frame may sit
//! (`partial_frame_timeout_ms`), completions pending from other threads,
//! and on the client requests in flight and a deadline per request.
//!
//! **Bad input.** An intact header with a wrong version or oversized
//! payload reaches [`Handler::on_rejected`] (the connection lives); a
//! corrupt header closes only that connection.
//!
//! **Fault injection** (feature `fault-injection`, module `fault`): a
//! [`fault::FaultPlan`] consulted on the server's request and reply path —
//! drop, delay, duplicate or reorder a reply, reset a connection — with the
//! scripted [`fault::FaultScript`].

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
    Backend, BackendChoice, ClientConfig, Endpoint, IO_ENV, IoConfig, ServerConfig, TaskRun,
};
pub use server::{
    Admit, Completer, ConnId, DisconnectReason, Handler, PeerInfo, Refusal, RefuseReason,
    Rejection, Replies, ReplyError, Server, ServerHandle, ServerStats, ServerStatsSnapshot,
};
pub use sys::{MAX_FDS_PER_FRAME, PeerCred};

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
