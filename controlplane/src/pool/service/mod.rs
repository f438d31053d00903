//! The pool service: the I/O around the sans-IO [`PoolManager`](super::PoolManager) — pools
//! opened and fenced, the journal written and synced, replies released only
//! once durable, timers, and the two ways a directory reaches it.
//!
//! # Shape
//!
//! One thread, the **core** ([`PoolCore`]), owns everything stateful: the
//! [`PoolManager`](super::PoolManager), the [`PoolStore`](super::PoolStore) (journal and checkpoints), the owner
//! names file ([`names`]), the open pools with their header blocks
//! and leases ([`pools`], [`paths`]), the per-directory reply caches and the queue of
//! replies held for durability. Everything else talks to it through one
//! channel of commands, so requests are applied in the order they arrive and
//! no lock is held across a `fdatasync`.
//!
//! Two front ends feed it, with the same semantics:
//!
//! - **the wire** ([`wire`]): a transport [`Handler`](crate::transport::Handler)
//!   for the pool protocol (`PoolHello`, `AllocRegion`, `FreeRegion`,
//!   `ReattachRegions`, `ListRegions`, `PoolStats`), used by the `cxlkv pool`
//!   daemon ([`PoolCore::listen`]). It validates each frame at the edge,
//!   answers protocol errors itself, and forwards the rest; the core answers
//!   through the transport's [`Completer`](crate::transport::Completer).
//! - **in process** ([`LocalPool`]): for `cxlkv serve`, where the directory
//!   and the pool manager share a process — the same core, the same journal
//!   writer, the same request path, without a socket.
//!
//! The directory's server calls either through the [`PoolService`] trait;
//! [`RemotePool`] is its implementation over a socket to a `cxlkv pool`
//! daemon (pipelined, with reconnect, `PoolHello` and `ReattachRegions` after
//! the daemon restarts).
//!
//! # The release rule (durability before replies)
//!
//! The core handles every command that is ready, in order. A reply — any
//! reply, with or without journal records, success or error — is sent only
//! once every record pushed before it is durable: it goes out at once when
//! nothing is pending, and is held otherwise. Held replies are released, in
//! order, right after the commit that covers them. With
//! `SyncPolicy::PerRecord` the core commits after each request that pushed
//! records; with `SyncPolicy::Group` it commits when the group is full
//! (`max_batch_records`) or when no further command is ready — so requests
//! that arrive while one `fdatasync` runs share the next one. A checkpoint
//! follows a commit when `checkpoint_every_records` were committed since the
//! last one. New owner names are synced to the names file before the journal
//! commit that first uses them. A failed write or sync stops the core
//! (fail-stop): held replies are never sent (their connections are closed,
//! their callbacks get `Internal` "outcome unknown"), and only a restart
//! (replay) brings memory and disk back together.
//!
//! # Identity and exactly-once
//!
//! The caller of a request comes from the transport, never from a payload:
//! a Unix peer is its process ([`liveness::identify`] of the `SO_PEERCRED`
//! pid: pid + start time), a TCP peer or an in-process session is its
//! connection. A directory names itself in `PoolHello`; directory and
//! instance names (strings on the wire) map to the manager's 64-bit ids by a
//! BLAKE3 key derivation ([`names::label_id`]), and the names are kept
//! durably so that listing a directory's regions after a restart gives the
//! names back.
//!
//! `AllocRegion` and `FreeRegion` carry a per-directory `seq`. The core keeps
//! the last [`REPLY_CACHE_LEN`] replies per directory: a cached `seq` is
//! answered from the cache, a `seq` at or below one already evicted gets
//! `SequenceTooOld`. An allocation is journaled with its `seq` as the
//! manager's [`AllocTag`](super::AllocTag), so a retry after a pool-manager
//! crash (the cache is then gone) returns the region already allocated
//! instead of a second one. `PoolWelcome.last_seq` is the highest `seq` seen
//! for the directory (or the highest live tag after a restart).
//!
//! # Timers
//!
//! The core sleeps in a channel receive whose timeout is the earliest of:
//! the reaper's next deadline ([`PoolManager::next_deadline`](super::PoolManager::next_deadline)), the next
//! lease renewal (every `lease_ms / 3`), and — while local directories are
//! attached — the next liveness probe (every `clamp(grace_ms / 4, 10, 1000)`
//! ms). No timer thread and no busy loop.
//!
//! # Lease
//!
//! Each pool's header carries this manager's lease (`lease_ms`, default
//! 10 s), renewed every `lease_ms / 3` from the core. A renewal that finds
//! another holder or epoch takes the pool offline at once (logged as an
//! error). See `docs/pool-manager.md` §8 for what the lease does and does not
//! guarantee.
//!
//! [`liveness::identify`]: super::liveness::identify

pub(crate) mod cache;
mod core;
pub mod local;
pub mod names;
pub mod paths;
pub mod pools;
pub mod remote;
pub mod wire;

use std::fmt;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use crate::proto::{
    ErrorCode, ErrorReply, PoolStatsReply, PoolWelcome, RegionHandle, RegionList, RegionToken,
    RegionsReattached,
};

pub use self::core::{CoreStats, PoolCore, ShutdownReport};
pub use cxlkv_dataplane::visibility::Visibility;
pub use local::LocalPool;
pub use remote::{RemoteConfig, RemotePool};

use super::io_faults::IoFaults;
use super::store::{StoreConfig, StoreError};

/// Replies kept per directory for exactly-once retries (at least the
/// in-flight bound of a pool connection, [`MAX_INFLIGHT_PER_CONN`]).
pub const REPLY_CACHE_LEN: usize = 256;
/// Requests one pool connection may have in flight (the transport rejects
/// more with `Busy`).
pub const MAX_INFLIGHT_PER_CONN: usize = 256;
// Every copy of a request that can still arrive is within the manager's
// window of tagged-allocation answers (see `pool::tag_answers`).
const _: () = assert!(super::TAG_ANSWERS_PER_DIRECTORY >= MAX_INFLIGHT_PER_CONN);
/// Requests queued for the core from all front ends together; more get
/// `Busy` at once (not cached, `seq` not consumed).
pub const MAX_QUEUED_REQUESTS: usize = 8192;
/// Most pools one service opens (the protocol's `MAX_POOLS`).
pub const MAX_SERVICE_POOLS: usize = crate::proto::MAX_POOLS;

const _: () = assert!(REPLY_CACHE_LEN >= MAX_INFLIGHT_PER_CONN);

/// One pool the service opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// A `/dev/daxX.Y` device or a file (tmpfs, hugetlbfs, DAX filesystem).
    pub path: PathBuf,
    /// For a file: create it (mode 0600) at this size if missing, or size it
    /// if it holds no pool yet (first block all zero); an initialised pool
    /// is never resized, and a larger size than its header's is refused
    /// (see `pools`). For a device: the size it must have at least. `None`:
    /// open as is.
    pub create_size_bytes: Option<u64>,
    /// Region alignment (power of two ≥ 4 KiB); default 2 MiB, raised to the
    /// device's or hugetlbfs's page size.
    pub align_bytes: Option<u64>,
    /// How writes become visible across hosts; default `Flush` for a device
    /// (it may be shared by hosts without coherence), `Coherent` otherwise.
    pub visibility: Option<Visibility>,
}

/// How TCP peers authenticate (Unix peers are vouched for by the socket's
/// file permissions and `SO_PEERCRED`).
#[derive(Clone, PartialEq, Eq, Default)]
pub enum TcpAuth {
    /// `PoolHello.secret` must equal this (compared in constant time).
    Secret(Vec<u8>),
    /// No secret asked: only for a trusted network, chosen explicitly.
    #[default]
    Disabled,
}

impl fmt::Debug for TcpAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TcpAuth::Secret(_) => f.write_str("Secret(<redacted>)"),
            TcpAuth::Disabled => f.write_str("Disabled"),
        }
    }
}

/// Everything the service needs to start.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Pools to open, in order (at least one, at most [`MAX_SERVICE_POOLS`]).
    pub pools: Vec<PoolSpec>,
    /// The state directory (journal, checkpoint, secret, names, lock).
    pub state_dir: PathBuf,
    pub store: StoreConfig,
    /// How long a gone directory's regions wait for a reattach.
    pub grace_ms: u64,
    /// Length of the lease written into each pool header; renewed every
    /// `lease_ms / 3`.
    pub lease_ms: u64,
    /// Pass the pool descriptors to local directories with `PoolWelcome`
    /// (`SCM_RIGHTS`; only when there are at most
    /// [`MAX_FDS_PER_FRAME`](crate::transport::MAX_FDS_PER_FRAME) pools).
    pub pass_fds: bool,
    pub tcp_auth: TcpAuth,
    /// Storage failures to inject into the journal, checkpoints and names
    /// file: for tests (feature `fault-injection`; without it the default
    /// injects nothing and there is no other value).
    pub io_faults: IoFaults,
}

/// Smallest accepted `lease_ms` (the renewal period is a third of it).
pub const MIN_LEASE_MS: u64 = 300;

/// A directory connection that sends nothing for this long is closed, as if
/// its peer had closed it (its regions wait for a reattach): how the
/// service learns of a directory whose host vanished without closing. The
/// default of [`PoolCore::listen`](core::PoolCore::listen)'s
/// `idle_timeout_ms`; a [`RemotePool`] pings every
/// [`RemoteConfig::ping_ms`](remote::RemoteConfig::ping_ms) (5 s) when idle.
pub const IDLE_TIMEOUT_MS: u64 = 30_000;

impl ServiceConfig {
    /// Every check [`PoolCore::start`](core::PoolCore::start) makes before it
    /// opens anything (what `--print-config` can tell without starting).
    pub fn validate(&self) -> Result<(), ServiceError> {
        check_config(self)?;
        self.store.validate()?;
        Ok(())
    }

    /// The renewal period of the pool leases.
    pub fn lease_renew_ms(&self) -> u64 {
        self.lease_ms / 3
    }

    /// The period of liveness probes of local directories.
    pub fn probe_interval_ms(&self) -> u64 {
        (self.grace_ms / 4).clamp(10, 1000)
    }
}

/// Why the service could not start (or had to stop).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    #[error("invalid pool service configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Pool(#[from] pools::OpenError),
    #[error(transparent)]
    Names(#[from] names::NamesError),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    #[error("cannot start the pool service thread: {0}")]
    Thread(std::io::Error),
    #[error("the pool service core stopped: {0}")]
    Stopped(String),
}

/// A request from a directory to its pool manager — what the wire messages
/// carry, without the transport's parts (`seq` is assigned by the
/// [`PoolService`] implementation; the directory comes from the session).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolRequest {
    /// A region of at least `len_bytes` (rounded up to the pool alignment)
    /// from `pool` (or any online pool), labelled for `instance_id`.
    Alloc {
        pool: Option<u32>,
        len_bytes: u64,
        instance_id: String,
    },
    /// Return a region of this directory (its token proves ownership).
    Free { region: u64, token: RegionToken },
    /// Keep these regions (after a reconnect or a restart); idempotent.
    Reattach { handles: Vec<RegionHandle> },
    /// This directory's regions with ids above `after_region`, at most
    /// `max_handles` (1..=`MAX_LIST_REGIONS`).
    List { after_region: u64, max_handles: u32 },
    /// Pool occupancy.
    Stats,
}

impl PoolRequest {
    /// True for requests that change state (they carry a `seq`).
    pub fn is_mutating(&self) -> bool {
        matches!(self, PoolRequest::Alloc { .. } | PoolRequest::Free { .. })
    }
}

/// The answer to a [`PoolRequest`] (or to the session's hello).
#[derive(Debug)]
pub enum PoolReply {
    /// The session is open: pools, `last_seq`, and the pool descriptors
    /// (`welcome.fds_passed` of them, in `welcome.pools` order).
    Welcome {
        welcome: PoolWelcome,
        fds: Vec<OwnedFd>,
    },
    /// Journaled (durable) before this reply was released.
    Allocated(RegionHandle),
    Freed {
        region: u64,
    },
    Reattached(RegionsReattached),
    Regions(RegionList),
    Stats(PoolStatsReply),
}

/// A request that failed as a whole: the wire's `ErrorReply`, with a
/// [`ErrorCode`] number, a message and the limit involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool manager: {message} (code {code}, limit {limit})")]
pub struct PoolServiceError {
    pub code: u16,
    pub message: String,
    pub limit: u64,
}

impl PoolServiceError {
    pub fn new(code: ErrorCode, message: impl Into<String>, limit: u64) -> Self {
        ErrorReply::new(code, message, limit).into()
    }

    /// The code; `None` for a number this build does not know.
    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_u16(self.code)
    }

    /// True when the same request may succeed if sent again with the same
    /// `seq` (`Busy`, `Timeout`).
    pub fn is_transient(&self) -> bool {
        self.error_code().is_some_and(ErrorCode::is_transient)
    }

    pub fn to_reply(&self) -> ErrorReply {
        ErrorReply::new(
            ErrorCode::from_u16(self.code).unwrap_or(ErrorCode::Internal),
            self.message.clone(),
            self.limit,
        )
    }
}

impl From<ErrorReply> for PoolServiceError {
    fn from(e: ErrorReply) -> Self {
        Self {
            code: e.code,
            message: e.message,
            limit: e.limit,
        }
    }
}

/// Receives the answer to one submitted request. Called exactly once, on a
/// service thread (the core for [`LocalPool`], the connection driver for
/// [`RemotePool`]); it must not block — hand the result to your own thread
/// (e.g. push it into a queue and call the transport's
/// [`Completer::wake`](crate::transport::Completer::wake)).
pub type PoolCallback = Box<dyn FnOnce(Result<PoolReply, PoolServiceError>) + Send + 'static>;

/// What a directory's server calls to reach its pool manager, in process
/// ([`LocalPool`]) or over a socket ([`RemotePool`]).
///
/// A `PoolService` value is one *session*: it speaks for the directory it
/// was opened with (`PoolHello`), numbers that directory's mutating
/// requests (`seq`, from `PoolWelcome.last_seq + 1`), and delivers each
/// answer once, through the callback given with the request. Answers to
/// mutating requests are released only after their journal records are
/// durable.
pub trait PoolService: Send + Sync + fmt::Debug {
    /// Submits `request`; `done` gets the answer exactly once. Never blocks
    /// on the pool manager; a full queue answers `Busy` at once.
    fn submit(&self, request: PoolRequest, done: PoolCallback);

    /// The session's latest welcome (pools, manager epoch); it changes when
    /// a [`RemotePool`] reconnects to a restarted daemon.
    fn welcome(&self) -> PoolWelcome;

    /// Why this session can no longer serve its directory, once it cannot:
    /// a [`RemotePool`] whose daemon came back serving other pools than
    /// the ones the directory started with (see its "Reconnect"). Every
    /// request is then refused (`SessionEnded`); the directory must stop,
    /// and its restart recovers with the pools the daemon serves now.
    fn failure(&self) -> Option<String> {
        None
    }

    /// Submits and waits (at most `timeout`): for start-up, tools and
    /// tests; a server's request path uses [`PoolService::submit`].
    fn call(&self, request: PoolRequest, timeout: Duration) -> Result<PoolReply, PoolServiceError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.submit(
            request,
            Box::new(move |r| {
                // The receiver may have timed out and gone: nothing to do.
                let _ = tx.send(r);
            }),
        );
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(PoolServiceError::new(
                ErrorCode::Timeout,
                format!(
                    "no answer from the pool manager within {} ms",
                    timeout.as_millis()
                ),
                timeout.as_millis() as u64,
            ))
        })
    }
}

/// A session's opening: the welcome and the pool descriptors that came with
/// it (`welcome.fds_passed` of them; none over TCP or with fd passing off).
#[derive(Debug)]
pub struct PoolSession {
    pub welcome: PoolWelcome,
    pub fds: Vec<OwnedFd>,
}

/// The conversions between the manager's values and the wire's, shared by
/// every front end.
pub(crate) fn wire_code(e: &super::PoolError) -> (ErrorCode, u64) {
    use super::PoolError as E;
    match e {
        E::NotAttached { .. } => (ErrorCode::HelloRequired, 0),
        E::CallerBoundElsewhere { .. } => (ErrorCode::InvalidArgument, 0),
        E::DirectoryAttachedElsewhere { .. } => (ErrorCode::InstanceInUse, 0),
        E::TooManyHandles { max, .. } => (ErrorCode::BatchTooLarge, *max as u64),
        E::TooManyDirectories { max } => (ErrorCode::Busy, *max as u64),
        E::ZeroLength => (ErrorCode::InvalidArgument, 0),
        E::RegionTooLarge { max_bytes, .. } => (ErrorCode::InvalidArgument, *max_bytes),
        E::LengthNotAligned {
            alignment_bytes, ..
        } => (ErrorCode::InvalidArgument, *alignment_bytes),
        E::UnknownPool { .. } => (ErrorCode::InvalidArgument, 0),
        E::PoolOffline { .. } | E::NoOnlinePool => (ErrorCode::OutOfSpace, 0),
        E::NoSpace {
            largest_free_bytes, ..
        } => (ErrorCode::OutOfSpace, *largest_free_bytes),
        E::TooManyRegions { max } => (ErrorCode::OutOfSpace, *max as u64),
        E::BadToken { .. } | E::HandleMismatch { .. } => (ErrorCode::BadToken, 0),
        E::UnknownRegion { .. } | E::RegionAlreadyFreed { .. } => (ErrorCode::UnknownRegion, 0),
        E::WrongOwner { .. } => (ErrorCode::NotOwner, 0),
        E::TagReused { .. } => (ErrorCode::InvalidArgument, 0),
        _ => (ErrorCode::Internal, 0),
    }
}

impl From<&super::PoolError> for PoolServiceError {
    fn from(e: &super::PoolError) -> Self {
        let (code, limit) = wire_code(e);
        PoolServiceError::new(code, format!("{e} (pool error {})", e.code()), limit)
    }
}

/// Checks a configuration before anything is opened.
pub(crate) fn check_config(cfg: &ServiceConfig) -> Result<(), ServiceError> {
    let bad = |m: String| Err(ServiceError::Config(m));
    if cfg.pools.is_empty() {
        return bad("at least one pool is needed".into());
    }
    if cfg.pools.len() > MAX_SERVICE_POOLS {
        return bad(format!(
            "{} pools configured, at most {MAX_SERVICE_POOLS}",
            cfg.pools.len()
        ));
    }
    for (i, p) in cfg.pools.iter().enumerate() {
        if cfg.pools[..i].iter().any(|q| q.path == p.path) {
            return bad(format!("pool {} is listed twice", p.path.display()));
        }
    }
    if cfg.lease_ms < MIN_LEASE_MS {
        return bad(format!(
            "lease_ms = {} is below the minimum {MIN_LEASE_MS}",
            cfg.lease_ms
        ));
    }
    if cfg.grace_ms == 0 {
        return bad("grace_ms must be at least 1".into());
    }
    Ok(())
}
