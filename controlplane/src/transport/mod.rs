//! Transport: moves frames between clients and the server's event loop.
//!
//! (Essay completed below once measured.)

pub mod client;
pub mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod server;
pub mod sys;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

pub use client::{ClientError, ClientStats, PendingCall, Reply, RpcClient};
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
