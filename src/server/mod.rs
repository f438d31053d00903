//! The server assembly: the directory state machine driven by the transport,
//! with the pool manager embedded — what `cxlkv serve` runs, and what tests
//! start in-process with [`Server::start`].
//!
//! ## Threads
//!
//! - the transport's event loop (`cxlkv-transport`): owns every socket and
//!   the [`Directory`]; decodes,
//!   validates, calls the directory, encodes replies (`handler.rs`);
//! - a ticker (`cxlkv-ticker`): wakes the loop every `tick_ms` through the
//!   transport's `Completer` so that the directory's `tick` (lease and grace
//!   expiry, eviction), retries of failed frees and pool statistics run on
//!   the loop thread. It sleeps in between: no busy loop;
//! - the pool manager: answers on whatever thread it runs (in process, the
//!   calling one); answers come back through the handler's mailbox and a
//!   wake.
//!
//! ## Lifecycle
//!
//! [`Server::start`] opens the pool, asks the pool manager for the regions
//! it holds for this directory id and builds the directory with
//! `Directory::recover` from them (a restarted server is a restarted
//! directory: live clients reattach with their tokens within the grace
//! period), binds the Unix socket (and TCP if configured), and starts the
//! threads. [`ServerHandle::shutdown`] stops the ticker and the loop (every
//! connection is closed, every session ends, its pins are released), waits a
//! bounded time for region frees in flight, and removes the socket file.
//!
//! ## Metrics
//!
//! With [`ServerConfig::metrics_listen`] set, a `cxlkv-metrics` thread
//! answers `GET /metrics` over HTTP (`metrics_http.rs`): each scrape posts a
//! control event to the loop, which answers with a snapshot (the `Stats`
//! figures and the fixed-bucket latency histograms of `metrics.rs`); the
//! text is rendered on the metrics thread. A scrape waits at most
//! [`METRICS_SNAPSHOT_TIMEOUT`] for the loop. The loop takes at most one
//! snapshot per [`METRICS_MIN_INTERVAL`]: a scrape sooner after the last
//! one gets that one's text (`ScrapeCache`), so a local user looping
//! `curl` on the endpoint cannot keep the loop walking every pin (a
//! snapshot counts the long-held pins) instead of serving requests.
//!
//! ## Identity
//!
//! Unix peers are identified by `SO_PEERCRED` (pid, uid, gid), never by a
//! payload; they receive the pool descriptors with `Welcome` (`SCM_RIGHTS`).
//! TCP peers must present the configured pre-shared secret in
//! `Hello`/`Reattach` unless `tcp_insecure_no_secret` is set; they get the
//! pools' UUIDs and paths instead of descriptors.

mod handler;
pub mod metrics;
mod metrics_http;
mod pool;
mod wire;

use std::io;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cxlkv_controlplane::directory::{ConfigError, Directory, DirectoryConfig, DirectoryStats};
use cxlkv_controlplane::pool::StoreConfig;
use cxlkv_controlplane::pool::service::{PoolCore, PoolService, PoolSpec, ServiceConfig, TcpAuth};
use cxlkv_controlplane::proto;
use cxlkv_controlplane::transport::{self, Endpoint, TransportError};
use cxlkv_dataplane::ids::PoolId;

use handler::{Control, DirectoryHandler, Event, HandlerParts, Mailbox};
use metrics_http::MetricsEndpoint;
pub use pool::PoolManagerConfig;

/// The embedded default pool: a file under `/dev/shm` (RAM-backed), the
/// same one `cxlkv pool` defaults to.
pub const DEFAULT_POOL_PATH: &str = "/dev/shm/cxlkv.pool";
/// 2 GiB: a fraction of RAM on any machine that runs inference.
pub const DEFAULT_POOL_SIZE_BYTES: u64 = cxlkv_dataplane::backing::DEFAULT_POOL_SIZE_BYTES;
/// Default region size (DESIGN §3: max(64 MiB, one page)).
pub const DEFAULT_REGION_BYTES: u64 = 64 << 20;
/// Name of the server's socket in its runtime directory.
pub const SOCKET_FILE: &str = "cxlkv.sock";

/// Where `cxlkv serve` listens by default (and where clients look first):
/// `/run/cxlkv/cxlkv.sock` as root; otherwise
/// `$XDG_RUNTIME_DIR/cxlkv/cxlkv.sock`, or `/tmp/cxlkv-<uid>/cxlkv.sock`
/// without `XDG_RUNTIME_DIR` — the same directories as `cxlkv pool`'s
/// socket.
pub fn default_socket_path() -> PathBuf {
    runtime_socket_path(SOCKET_FILE)
}

/// `file` in cxlkv's runtime directory for this process: `/run/cxlkv` as
/// root (effective uid 0), else `$XDG_RUNTIME_DIR/cxlkv`, else
/// `/tmp/cxlkv-<uid>`. Where both daemons put their sockets by default.
pub(crate) fn runtime_socket_path(file: &str) -> PathBuf {
    // SAFETY: geteuid and getuid have no preconditions and cannot fail.
    let (euid, uid) = unsafe { (libc::geteuid(), libc::getuid()) };
    socket_path_in_runtime_dir(
        file,
        euid == 0,
        std::env::var_os("XDG_RUNTIME_DIR").as_deref(),
        uid,
    )
}

/// [`runtime_socket_path`] for a given identity and environment.
fn socket_path_in_runtime_dir(
    file: &str,
    root: bool,
    xdg_runtime_dir: Option<&std::ffi::OsStr>,
    uid: u32,
) -> PathBuf {
    if root {
        return Path::new("/run/cxlkv").join(file);
    }
    match xdg_runtime_dir {
        Some(d) => Path::new(d).join("cxlkv").join(file),
        None => PathBuf::from(format!("/tmp/cxlkv-{uid}")).join(file),
    }
}

/// The directory's default stable identity (its owner label at the pool
/// manager: a restarted server with the same id finds its regions).
pub const DEFAULT_DIRECTORY_ID: &str = "cxlkv";

/// How long a connection may take to open a session by default
/// ([`ServerConfig::hello_timeout_ms`]).
pub const DEFAULT_HELLO_TIMEOUT_MS: u64 = 5_000;
/// The `hello_timeout_ms` a server accepts: 100 ms to 10 minutes.
pub const HELLO_TIMEOUT_MS_RANGE: std::ops::RangeInclusive<u64> = 100..=600_000;

/// How long shutdown waits for region frees the pool manager has not
/// confirmed yet.
const SHUTDOWN_FREE_WAIT: Duration = Duration::from_secs(2);

/// How long a `/metrics` scrape waits for the event loop's snapshot before
/// it is answered `503`.
pub const METRICS_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(5);

/// The event loop takes at most one metrics snapshot per this interval
/// (scrapers ask every 15 s or so; a faster loop of requests gets the last
/// text again).
pub const METRICS_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Everything a server needs to start. `ServerConfig::default()` is what
/// `cxlkv serve` runs with no arguments; fields may be changed one by one
/// (the struct is `#[non_exhaustive]`: new fields come with defaults).
/// Its `Debug` form (`cxlkv serve --print-config`) says whether a TCP
/// secret is set, never what it is.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Unix socket to listen on. A stale socket file (nobody listening) is
    /// replaced; a live one is an error.
    pub socket_path: PathBuf,
    /// The Unix socket's permission bits, set before it listens, whatever
    /// the umask (default 0660: the server's user and group may connect —
    /// and connecting is being handed the pool, docs/security.md). The
    /// owner's write bit is required (connecting needs it).
    pub socket_mode: u32,
    /// Also listen on TCP here (port 0 picks a free port).
    pub tcp_listen: Option<SocketAddr>,
    /// The pre-shared secret TCP clients must present.
    pub tcp_secret: Option<Vec<u8>>,
    /// Accept TCP clients without a secret (trusted networks only). Not
    /// together with `tcp_secret` (refused: the secret would not be asked
    /// for).
    pub tcp_insecure_no_secret: bool,
    /// Connections served at once; more are refused with `Busy`. TCP
    /// connections that have not opened a session take at most half of
    /// them (rounded up): the rest stay for Unix clients and sessions.
    pub max_connections: usize,
    /// A connection that has not opened a session (`Hello`/`Reattach`)
    /// this long after it was accepted is closed (checked every `tick_ms`).
    /// In [`HELLO_TIMEOUT_MS_RANGE`].
    pub hello_timeout_ms: u64,
    /// The directory's stable identity at the pool manager.
    pub directory_id: String,
    pub directory: DirectoryConfig,
    /// The embedded pool file, created at `pool_size_bytes` when missing
    /// (an initialised pool is never resized: a larger size is refused),
    /// when `pool_manager` is not set.
    pub pool_path: PathBuf,
    pub pool_size_bytes: u64,
    /// Where the pool manager runs and what it serves. `None`: embedded,
    /// one pool at `pool_path`, its state directory by the rule of every
    /// embedded pool manager ([`crate::config::default_state_dir`]: next to
    /// a pool under `/dev/shm`, `<pool_path>.state`; the host's state
    /// directory for a device or a file elsewhere), the pool service's
    /// defaults otherwise.
    pub pool_manager: Option<PoolManagerConfig>,
    /// Remove the embedded pool files and the pool manager's state
    /// directory on shutdown (temporary servers: tests, benches) — never
    /// the host's shared state directory
    /// ([`crate::config::host_state_dir`]).
    pub remove_pool_on_shutdown: bool,
    /// Region size when a request asks for "the default" (0 bytes): raw
    /// protocol clients; cxlkv's own clients always ask for their
    /// `LayoutOptions::region_size_bytes`.
    pub default_region_bytes: u64,
    /// How often the directory's timers run (lease and grace expiry,
    /// eviction, free retries).
    pub tick_ms: u64,
    /// Transport knobs (backend, spinning, io_uring setup).
    pub io: transport::IoConfig,
    /// Serve Prometheus metrics over HTTP at `http://<this>/metrics` (port
    /// 0 picks a free port). Off by default.
    pub metrics_listen: Option<SocketAddr>,
    /// Requests of one connection in the server and not answered yet; more
    /// are rejected with `TooManyInFlight`.
    pub max_inflight_per_conn: usize,
    /// Bytes queued for one connection and not yet taken by its socket; a
    /// peer that stops reading is disconnected beyond this.
    pub max_send_queue_bytes: usize,
    /// A connection holding an incomplete frame this long is closed.
    pub partial_frame_timeout_ms: u64,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured whole, so that a new field cannot be left out.
        let Self {
            socket_path,
            socket_mode,
            tcp_listen,
            tcp_secret,
            tcp_insecure_no_secret,
            max_connections,
            hello_timeout_ms,
            directory_id,
            directory,
            pool_path,
            pool_size_bytes,
            pool_manager,
            remove_pool_on_shutdown,
            default_region_bytes,
            tick_ms,
            io,
            metrics_listen,
            max_inflight_per_conn,
            max_send_queue_bytes,
            partial_frame_timeout_ms,
        } = self;
        let mut d = f.debug_struct("ServerConfig");
        d.field("socket_path", socket_path)
            .field("socket_mode", &format_args!("{socket_mode:#o}"))
            .field("tcp_listen", tcp_listen)
            .field(
                "tcp_secret",
                &tcp_secret.as_ref().map(|_| cxlkv_controlplane::Redacted),
            )
            .field("tcp_insecure_no_secret", tcp_insecure_no_secret)
            .field("max_connections", max_connections)
            .field("hello_timeout_ms", hello_timeout_ms)
            .field("directory_id", directory_id)
            .field("directory", directory);
        // The embedded default pool's fields describe the pool only when no
        // pool manager is configured; otherwise `pool_manager` names the
        // pools (a device's or an existing file's size is not configured at
        // all) and printing them would show a pool that is not used.
        if pool_manager.is_none() {
            d.field("pool_path", pool_path)
                .field("pool_size_bytes", pool_size_bytes);
        }
        d.field("pool_manager", pool_manager)
            .field("remove_pool_on_shutdown", remove_pool_on_shutdown)
            .field("default_region_bytes", default_region_bytes)
            .field("tick_ms", tick_ms)
            .field("io", io)
            .field("metrics_listen", metrics_listen)
            .field("max_inflight_per_conn", max_inflight_per_conn)
            .field("max_send_queue_bytes", max_send_queue_bytes)
            .field("partial_frame_timeout_ms", partial_frame_timeout_ms)
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        let transport_defaults = transport::ServerConfig::default();
        Self {
            socket_path: default_socket_path(),
            socket_mode: transport_defaults.unix_socket_mode,
            tcp_listen: None,
            tcp_secret: None,
            tcp_insecure_no_secret: false,
            max_connections: 1024,
            hello_timeout_ms: DEFAULT_HELLO_TIMEOUT_MS,
            directory_id: DEFAULT_DIRECTORY_ID.to_owned(),
            directory: DirectoryConfig::default(),
            pool_path: PathBuf::from(DEFAULT_POOL_PATH),
            pool_size_bytes: DEFAULT_POOL_SIZE_BYTES,
            pool_manager: None,
            remove_pool_on_shutdown: false,
            default_region_bytes: DEFAULT_REGION_BYTES,
            tick_ms: 100,
            io: transport::IoConfig::default(),
            metrics_listen: None,
            max_inflight_per_conn: transport_defaults.max_inflight_per_conn,
            max_send_queue_bytes: transport_defaults.max_send_queue_bytes,
            partial_frame_timeout_ms: transport_defaults.partial_frame_timeout_ms,
        }
    }
}

impl ServerConfig {
    /// A private server for a test or a bench: a unique socket under the
    /// temporary directory and a unique 256 MiB pool under `/dev/shm` (its
    /// pool-manager state next to it, `<pool>.state`), all removed on
    /// shutdown. `tag` goes into the names (for humans).
    pub fn ephemeral(tag: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Relaxed: only uniqueness within the process matters.
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let unique = format!("{tag}-{pid}-{n}-{nanos:x}");
        Self {
            socket_path: std::env::temp_dir().join(format!("cxlkv-{unique}.sock")),
            directory_id: format!("cxlkv-{unique}"),
            pool_path: PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool")),
            pool_size_bytes: 256 << 20,
            remove_pool_on_shutdown: true,
            default_region_bytes: 4 << 20,
            ..Self::default()
        }
    }

    /// The pool manager this configuration asks for: `pool_manager`, or the
    /// embedded default over `pool_path`.
    pub fn pool_manager_config(&self) -> PoolManagerConfig {
        if let Some(c) = &self.pool_manager {
            return c.clone();
        }
        PoolManagerConfig::Embedded(ServiceConfig {
            pools: vec![PoolSpec {
                path: self.pool_path.clone(),
                create_size_bytes: Some(self.pool_size_bytes),
                align_bytes: None,
                visibility: None,
            }],
            state_dir: crate::config::default_state_dir(&self.pool_path),
            store: StoreConfig::default(),
            grace_ms: 30_000,
            lease_ms: 10_000,
            pass_fds: true,
            tcp_auth: TcpAuth::Disabled,
            io_faults: Default::default(),
        })
    }

    /// Checks the fields the directory does not check itself (first, where
    /// the server's range is narrower than the directory's own), then the
    /// directory's.
    pub fn validate(&self) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError::Config(m));
        let d = &self.directory;
        if !(1..=proto::MAX_BATCH).contains(&d.max_batch) {
            return bad(format!(
                "directory.max_batch = {} is not in 1..={} (the protocol's MAX_BATCH)",
                d.max_batch,
                proto::MAX_BATCH
            ));
        }
        let pins = crate::tier::Holds::MAX..=proto::MAX_PINS_PER_KEY as u32;
        if !pins.contains(&d.max_pins_per_call) {
            return bad(format!(
                "directory.max_pins_per_call = {} is not in {}..={}: at least the most read holds an L1 tier takes on a key in one call, at most the protocol's MAX_PINS_PER_KEY",
                d.max_pins_per_call,
                pins.start(),
                pins.end()
            ));
        }
        if d.session_lease < MIN_SESSION_LEASE {
            return bad(format!(
                "directory.session_lease (lease_ms) = {} ms is under {} ms: clients heartbeat every third of it, and a shorter lease ends live sessions (and drops their pins) on any scheduling hiccup",
                d.session_lease.as_millis(),
                MIN_SESSION_LEASE.as_millis()
            ));
        }
        if d.instance_grace < MIN_INSTANCE_GRACE {
            return bad(format!(
                "directory.instance_grace (grace_ms) = {} ms is under {} ms: an instance must have time to reconnect before its regions are freed under its mappings",
                d.instance_grace.as_millis(),
                MIN_INSTANCE_GRACE.as_millis()
            ));
        }
        self.directory.validate()?;
        // Before the pool is opened: the listener binds only after it.
        crate::config::check_unix_socket_path(&self.socket_path)
            .or_else(|r| bad(format!("[server] socket: {r}")))?;
        if self.socket_mode & !0o777 != 0 || self.socket_mode & 0o200 == 0 {
            return bad(format!(
                "socket_mode {:#o} must be permission bits (at most 0o777) including the owner's write bit (0o200: connecting needs write permission)",
                self.socket_mode
            ));
        }
        if self.directory_id.is_empty() || self.directory_id.len() > proto::MAX_NAME_BYTES {
            return bad(format!(
                "directory_id must be 1..={} bytes",
                proto::MAX_NAME_BYTES
            ));
        }
        if self.tcp_listen.is_some() && self.tcp_secret.is_none() && !self.tcp_insecure_no_secret {
            return bad(
                "a TCP listener needs a client secret (or, on a trusted network, \
                 insecure-no-secret)"
                    .into(),
            );
        }
        if self.tcp_secret.is_some() && self.tcp_insecure_no_secret {
            // The directory enforces a secret only when
            // `tcp_insecure_no_secret` is off: together, the configured
            // secret would silently not be asked for.
            return bad(
                "tcp_secret and tcp_insecure_no_secret contradict each other \
                 (with both, the secret would not be enforced): set one of them"
                    .into(),
            );
        }
        if let Some(s) = &self.tcp_secret
            && (s.is_empty() || s.len() > proto::MAX_SECRET_BYTES)
        {
            return bad(format!(
                "the TCP secret must be 1..={} bytes",
                proto::MAX_SECRET_BYTES
            ));
        }
        if self.max_connections == 0 {
            return bad("max_connections must be at least 1".into());
        }
        if !HELLO_TIMEOUT_MS_RANGE.contains(&self.hello_timeout_ms) {
            return bad(format!(
                "hello_timeout_ms = {} is not in {}..={}: a connection must have time to say Hello, and one that never does holds a connection slot that long",
                self.hello_timeout_ms,
                HELLO_TIMEOUT_MS_RANGE.start(),
                HELLO_TIMEOUT_MS_RANGE.end()
            ));
        }
        if self.tick_ms == 0 || self.tick_ms > 10_000 {
            return bad(format!("tick_ms = {} is not in 1..=10000", self.tick_ms));
        }
        // `CXLKV_IO` under `backend = "auto"`: refused at bind otherwise.
        self.io.backend.resolve_env()?;
        if let PoolManagerConfig::Embedded(c) = self.pool_manager_config() {
            if c.pools.is_empty() {
                return bad("the embedded pool manager needs at least one pool".into());
            }
            crate::config::check_state_dir_location(&c.state_dir)
                .map_err(|r| ServerError::Config(format!("embedded pool manager: {r}")))?;
            c.validate()
                .map_err(|e| ServerError::Config(format!("embedded pool manager: {e}")))?;
        }
        if self.default_region_bytes == 0 {
            return bad("default_region_bytes must be positive".into());
        }
        if self.default_region_bytes > d.max_region_bytes {
            return bad(format!(
                "default_region_bytes = {} is over directory.max_region_bytes = {}: every request for the default would be refused",
                self.default_region_bytes, d.max_region_bytes
            ));
        }
        if let Some(q) = d.max_instance_quota_bytes
            && self.default_region_bytes > q
        {
            return bad(format!(
                "default_region_bytes = {} is over the instance quota directory.max_instance_quota_bytes (quota_bytes) = {q}: no instance could take a region of the default size",
                self.default_region_bytes
            ));
        }
        // Every embedded pool that is created at a known size: the default
        // region must fit one of them. (A pool given without a size is an
        // existing file or device, measured only when opened.)
        if let PoolManagerConfig::Embedded(c) = self.pool_manager_config() {
            let sizes: Option<Vec<u64>> = c.pools.iter().map(|p| p.create_size_bytes).collect();
            if let Some(largest) = sizes.and_then(|s| s.into_iter().max())
                && self.default_region_bytes >= largest
            {
                return bad(format!(
                    "default_region_bytes = {} does not fit the embedded pool{}: the largest is {largest} bytes and its first block holds the pool header, so a region must be smaller than that",
                    self.default_region_bytes,
                    if c.pools.len() > 1 { "s" } else { "" },
                ));
            }
        }
        Ok(())
    }
}

/// Shortest `directory.session_lease` a server accepts.
pub const MIN_SESSION_LEASE: Duration = Duration::from_millis(100);
/// Shortest `directory.instance_grace` a server accepts.
pub const MIN_INSTANCE_GRACE: Duration = Duration::from_millis(100);

/// The configuration file's name for a directory field, where the two
/// differ (`[directory]` keys, docs/operations.md).
fn config_file_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "session_lease" => "lease_ms",
        "instance_grace" => "grace_ms",
        "max_instance_quota_bytes" => "quota_bytes",
        "long_held_pin" => "long_pin_ms",
        "reply_cache_bytes_per_instance" => "reply_cache_bytes",
        "eviction.orphans" => "orphan_eviction",
        "eviction.pool_high_watermark" => "high_watermark",
        "eviction.pool_low_watermark" => "low_watermark",
        "eviction.lru" => "lru",
        "eviction.lru_high_fill" => "lru_high_fill",
        "eviction.lru_low_fill" => "lru_low_fill",
        "eviction.max_evictions_per_tick" => "max_evictions_per_tick",
        _ => return None,
    })
}

fn directory_error_hint(e: &ConfigError) -> String {
    match e {
        ConfigError::OutOfRange { field, .. } => match config_file_key(field) {
            // Where the operator set it: the file's key or its variable
            // (the flags set no `[directory]` key).
            Some(key) => format!(
                " ([directory] {key} in a configuration file, CXLKV_DIRECTORY_{} in the environment)",
                key.to_ascii_uppercase()
            ),
            None => String::new(),
        },
        _ => String::new(),
    }
}

/// Why a server could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("invalid directory configuration: {0}{hint}", hint = directory_error_hint(.0))]
    Directory(#[from] ConfigError),
    #[error("the pool manager: {0}")]
    PoolService(String),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("a server is already listening on {}", path.display())]
    AlreadyRunning { path: PathBuf },
    #[error("socket path {}: {source}", path.display())]
    SocketPath { path: PathBuf, source: io::Error },
    #[error("cannot draw random bytes: {0}")]
    Random(io::Error),
    #[error("cannot start the {name} thread: {source}")]
    Thread {
        name: &'static str,
        source: io::Error,
    },
    #[error("the server's event loop is gone")]
    Stopped,
    #[error("cannot listen for metrics on {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
}

/// A running server. Dropping it shuts it down (errors are logged).
#[derive(Debug)]
pub struct ServerHandle {
    transport: Option<transport::ServerHandle<DirectoryHandler>>,
    ticker: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    /// Stopped first: a scrape in progress still finds the loop.
    metrics: Option<MetricsEndpoint>,
    mailbox: Arc<Mailbox>,
    completer: transport::Completer,
    /// The embedded pool manager, stopped (journal synced, checkpointed)
    /// after the directory.
    pool_core: Option<PoolCore>,
    /// The directory's pool session, to ask whether it failed
    /// (`pool_failure`); weak, so that the handler's is the one that keeps
    /// it, and dropping the handler ends it as before.
    pool_service: Weak<dyn PoolService>,
    socket_path: PathBuf,
    tcp_addr: Option<SocketAddr>,
    /// The transport backend the server runs on (io_uring or the fallback).
    backend: transport::Backend,
    pool_paths: Vec<PathBuf>,
    /// Files and directories removed after shutdown (ephemeral servers).
    remove_after: Vec<PathBuf>,
}

/// What shutdown found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Sessions that were open when the server stopped (all are closed).
    pub sessions_closed: usize,
    /// Region frees the pool manager had not confirmed when shutdown gave up
    /// waiting. The regions stay with this directory id at the pool manager;
    /// the next start's recovery frees them after the grace period.
    pub frees_unconfirmed: usize,
}

/// The server entry point (see the module essay).
#[derive(Debug)]
pub struct Server;

impl Server {
    /// Starts a server on threads of this process and returns once it
    /// listens.
    pub fn start(config: ServerConfig) -> Result<ServerHandle, ServerError> {
        Self::start_inner(config, |_| {})
    }

    /// [`Server::start`] with the transport's fault plan installed (tests).
    #[cfg(feature = "fault-injection")]
    pub fn start_with_faults(
        config: ServerConfig,
        plan: Box<dyn transport::fault::FaultPlan>,
    ) -> Result<ServerHandle, ServerError> {
        let mut plan = Some(plan);
        Self::start_inner(config, move |server| {
            if let Some(p) = plan.take() {
                server.set_fault_plan(p);
            }
        })
    }

    fn start_inner(
        config: ServerConfig,
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))] mut prepare: impl FnMut(
            &mut transport::Server,
        ),
    ) -> Result<ServerHandle, ServerError> {
        config.validate()?;
        let mut directory_cfg = config.directory.clone();
        directory_cfg.tcp_requires_secret = !config.tcp_insecure_no_secret;
        let pool_cfg = config.pool_manager_config();
        let removable = removable_on_shutdown(&pool_cfg, config.remove_pool_on_shutdown);
        let cleanup = |why: &ServerError| {
            remove_paths(&removable);
            tracing::error!(error = %why, "server start failed");
        };
        let started = (|| {
            // Before the pool is opened (or created): a server already
            // listening here fails the start without touching any file.
            prepare_socket(&config.socket_path)?;
            let opened = pool::open(&pool_cfg, &config.directory_id)?;
            let mut pool_core = opened.core;
            let result = (|| {
                let recovered = pool::recover(opened.service.as_ref())?;
                if !recovered.is_empty() {
                    tracing::info!(
                        regions = recovered.len(),
                        "recovering the directory from the pool manager's regions"
                    );
                }
                let usage = pool::usage(opened.service.as_ref())?;
                Ok::<_, ServerError>((recovered, usage))
            })();
            let (recovered, usage) = match result {
                Ok(r) => r,
                Err(e) => {
                    drop(opened.service);
                    if let Some(core) = pool_core.take()
                        && let Err(stop) = core.shutdown()
                    {
                        tracing::warn!(error = %stop, "pool manager stopped with an error");
                    }
                    return Err(e);
                }
            };
            let pool = opened.service;
            let session = opened.session;
            let origin = Instant::now();
            let mut seed = [0u8; 32];
            cxlkv_controlplane::pool::sys::random_bytes(&mut seed).map_err(ServerError::Random)?;
            let recovered_regions = recovered.iter().map(|r| r.handle.region).collect();
            let mut directory =
                Directory::recover(directory_cfg.clone(), seed, dir_time(origin), recovered)?;
            // A `Hello` takes over an instance in its grace period only when
            // every process that held it has exited (DESIGN §4).
            directory.set_holder_probe(cxlkv_controlplane::pool::liveness::may_run);
            for p in usage {
                if p.total_bytes < crate::client::DEFAULT_REGION_SIZE_BYTES {
                    tracing::warn!(
                        pool = p.pool,
                        total_bytes = p.total_bytes,
                        "this pool cannot hold one region of the size cxlkv's clients ask for unless told otherwise (64 MiB): give it more, or set the clients' region_size_bytes lower"
                    );
                }
                directory.pool_usage(PoolId(p.pool), p.total_bytes, p.free_bytes);
            }
            // Bound before anything is served, so that a port in use fails
            // the start.
            let metrics_listener = config
                .metrics_listen
                .map(MetricsEndpoint::bind)
                .transpose()?;
            let mut endpoints = vec![Endpoint::Unix(config.socket_path.clone())];
            if let Some(addr) = config.tcp_listen {
                endpoints.push(Endpoint::Tcp(addr));
            }
            let tcfg = transport::ServerConfig {
                io: config.io.clone(),
                max_connections: config.max_connections,
                max_inflight_per_conn: config.max_inflight_per_conn,
                max_send_queue_bytes: config.max_send_queue_bytes,
                partial_frame_timeout_ms: config.partial_frame_timeout_ms,
                unix_socket_mode: config.socket_mode,
                ..transport::ServerConfig::default()
            };
            if config.socket_mode & 0o002 != 0 {
                tracing::warn!(
                    mode = %format_args!("{:#o}", config.socket_mode),
                    "the Unix socket is world-writable: every local user may connect and map the pool"
                );
            }
            let mut server = transport::Server::bind(tcfg.clone(), &endpoints)?;
            prepare(&mut server);
            let tcp_addr = server.endpoints().iter().find_map(|e| match e {
                Endpoint::Tcp(a) => Some(*a),
                _ => None,
            });
            let completer = server.completer();
            let mailbox = Arc::new(Mailbox::default());
            let handler = DirectoryHandler::new(HandlerParts {
                directory,
                directory_id: config.directory_id.clone(),
                pool: Arc::clone(&pool),
                pools: session.welcome.pools.clone(),
                pool_fds: session.fds,
                mailbox: Arc::clone(&mailbox),
                completer: completer.clone(),
                origin,
                tcp_secret: config.tcp_secret.clone(),
                hello_timeout: Duration::from_millis(config.hello_timeout_ms),
                max_sessionless_tcp: config.max_connections.div_ceil(2),
                max_inflight_per_conn: tcfg.max_inflight_per_conn,
                default_region_bytes: config.default_region_bytes,
                tick_every: Duration::from_millis(config.tick_ms),
                // SAFETY: geteuid has no preconditions and cannot fail.
                server_uid: unsafe { libc::geteuid() },
                recovered_regions,
            });
            let backend = server.backend();
            let transport = server.spawn(handler)?;
            let ticker = spawn_ticker(completer.clone(), Duration::from_millis(config.tick_ms))?;
            let metrics = metrics_listener
                .map(|l| {
                    MetricsEndpoint::spawn(
                        l,
                        metrics_source(Arc::clone(&mailbox), completer.clone()),
                    )
                })
                .transpose()?;
            let pool_paths: Vec<PathBuf> = session
                .welcome
                .pools
                .iter()
                .map(|p| PathBuf::from(&p.path))
                .collect();
            tracing::info!(
                socket = %config.socket_path.display(),
                tcp = ?tcp_addr,
                metrics = ?metrics.as_ref().map(MetricsEndpoint::addr),
                pools = ?pool_paths,
                %backend,
                "server listening"
            );
            let pool_service = Arc::downgrade(&pool);
            drop(pool);
            Ok(ServerHandle {
                transport: Some(transport),
                ticker: Some(ticker),
                metrics,
                mailbox,
                completer,
                pool_core,
                pool_service,
                socket_path: config.socket_path.clone(),
                tcp_addr,
                backend,
                pool_paths,
                remove_after: removable.clone(),
            })
        })();
        started.inspect_err(cleanup)
    }
}

/// What the metrics thread calls per scrape: a snapshot from the loop,
/// rendered here.
///
/// At most one snapshot request is ever queued in the mailbox: a scrape
/// that timed out leaves its request there, and the next scrape waits for
/// that one's answer instead of posting another.
fn metrics_source(
    mailbox: Arc<Mailbox>,
    completer: transport::Completer,
) -> metrics_http::RenderFn {
    let outstanding = parking_lot::Mutex::new(None::<mpsc::Receiver<metrics::MetricsSnapshot>>);
    let cache = parking_lot::Mutex::new(ScrapeCache::new(METRICS_MIN_INTERVAL));
    Box::new(move || {
        cache.lock().get(Instant::now(), || {
            snapshot_text(&outstanding, &mailbox, &completer)
        })
    })
}

/// The text of the last successful scrape, served again to scrapes within
/// `min_interval` of it; a failed scrape is not kept.
#[derive(Debug)]
struct ScrapeCache {
    min_interval: Duration,
    last: Option<(Instant, String)>,
}

impl ScrapeCache {
    fn new(min_interval: Duration) -> Self {
        Self {
            min_interval,
            last: None,
        }
    }

    /// The cached text if it is younger than `min_interval` at `now`, else
    /// `fetch`'s (kept if it succeeded).
    fn get(
        &mut self,
        now: Instant,
        fetch: impl FnOnce() -> Result<String, String>,
    ) -> Result<String, String> {
        if let Some((at, text)) = &self.last
            && now.saturating_duration_since(*at) < self.min_interval
        {
            return Ok(text.clone());
        }
        let text = fetch()?;
        self.last = Some((now, text.clone()));
        Ok(text)
    }
}

/// One snapshot from the loop, rendered (see [`metrics_source`]).
fn snapshot_text(
    outstanding: &parking_lot::Mutex<Option<mpsc::Receiver<metrics::MetricsSnapshot>>>,
    mailbox: &Mailbox,
    completer: &transport::Completer,
) -> Result<String, String> {
    let mut slot = outstanding.lock();
    let rx = slot.take().unwrap_or_else(|| {
        let (tx, rx) = mpsc::sync_channel(1);
        mailbox.post(Event::Control(Control::Metrics(tx)), completer);
        rx
    });
    match rx.recv_timeout(METRICS_SNAPSHOT_TIMEOUT) {
        Ok(snap) => Ok(metrics::render(&snap)),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            *slot = Some(rx);
            Err("the server's event loop did not answer in time\n".to_owned())
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err("the server's event loop is gone\n".to_owned())
        }
    }
}

/// What `remove_pool_on_shutdown` removes: the embedded pool manager's
/// pool files and its state directory, unless that is the host's shared
/// one (where a device or disk pool's state goes by default), which other
/// pool managers of the user may use.
fn removable_on_shutdown(pool_cfg: &PoolManagerConfig, remove: bool) -> Vec<PathBuf> {
    match (pool_cfg, remove) {
        (PoolManagerConfig::Embedded(c), true) => c
            .pools
            .iter()
            .map(|p| p.path.clone())
            .chain((c.state_dir != crate::config::host_state_dir()).then(|| c.state_dir.clone()))
            .collect(),
        _ => Vec::new(),
    }
}

/// Removes files and directory trees, logging what cannot be removed.
fn remove_paths(paths: &[PathBuf]) {
    for p in paths {
        let removed = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %p.display(), error = %e, "cannot remove"),
        }
    }
}

fn dir_time(origin: Instant) -> cxlkv_controlplane::directory::Time {
    cxlkv_controlplane::directory::Time::from_nanos(
        origin.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64,
    )
}

/// Makes `path` bindable: creates its directory (0755), checks that no
/// other user can replace a socket in it
/// ([`prepare_socket_dir`](cxlkv_controlplane::transport::prepare_socket_dir)),
/// and removes a stale socket file (nobody answers on it: a killed
/// server's). A socket on which a server answers, or a file that is not a
/// socket, is refused.
fn prepare_socket(path: &Path) -> Result<(), ServerError> {
    use std::os::unix::fs::FileTypeExt;
    let err = |source| ServerError::SocketPath {
        path: path.to_owned(),
        source,
    };
    cxlkv_controlplane::transport::prepare_socket_dir(path).map_err(err)?;
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(err(e)),
        Ok(meta) => meta,
    };
    if !meta.file_type().is_socket() {
        return Err(err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "exists and is not a socket",
        )));
    }
    use cxlkv_controlplane::transport::{ExistingSocket, classify_existing_socket};
    match classify_existing_socket(path, answers, STALE_SOCKET_PATIENCE).map_err(err)? {
        ExistingSocket::Answering => Err(ServerError::AlreadyRunning {
            path: path.to_owned(),
        }),
        ExistingSocket::Stale => remove_stale(path).map_err(err),
        ExistingSocket::SilentListener => Err(err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "a listener accepts on it but does not answer as a cxlkv server \
             (a stalled server, or another program's socket); not replacing it",
        ))),
    }
}

/// How long a socket whose listener accepts but does not answer may take
/// to go away (a killed process's listener is torn down a moment after)
/// before it counts as alive (`classify_existing_socket`).
const STALE_SOCKET_PATIENCE: Duration = Duration::from_secs(5);

fn remove_stale(path: &Path) -> io::Result<()> {
    tracing::info!(path = %path.display(), "replacing a stale socket file");
    std::fs::remove_file(path)
}

/// Whether a server answers a frame on `stream` within half a second.
fn answers(mut stream: &UnixStream) -> bool {
    use std::io::{Read, Write};
    let mut frame = Vec::new();
    let hb = proto::Heartbeat {
        meta: proto::RequestMeta::default(),
    };
    if proto::encode(1, &hb, &mut frame).is_err()
        || stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .is_err()
        || stream.write_all(&frame).is_err()
    {
        return false;
    }
    let mut header = [0u8; cxlkv_controlplane::frame::HEADER_BYTES];
    stream.read_exact(&mut header).is_ok()
        && cxlkv_controlplane::frame::FrameHeader::decode(&header).is_ok()
}

/// Wakes the loop every `every` until its sender is dropped.
fn spawn_ticker(
    completer: transport::Completer,
    every: Duration,
) -> Result<(mpsc::Sender<()>, JoinHandle<()>), ServerError> {
    let (tx, rx) = mpsc::channel::<()>();
    let join = std::thread::Builder::new()
        .name("cxlkv-ticker".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                if completer.wake().is_err() {
                    return;
                }
            }
        })
        .map_err(|source| ServerError::Thread {
            name: "ticker",
            source,
        })?;
    Ok((tx, join))
}

impl ServerHandle {
    /// The Unix socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// The TCP address actually bound, if TCP is configured.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The metrics endpoint's address actually bound, if metrics are
    /// configured.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::addr)
    }

    /// The transport backend serving connections (io_uring, or the
    /// fallback when io_uring is unavailable or was not chosen).
    pub fn backend(&self) -> transport::Backend {
        self.backend
    }

    /// The pools' paths on this host, in pool-index order.
    pub fn pool_paths(&self) -> &[PathBuf] {
        &self.pool_paths
    }

    /// Why the pool manager can no longer serve this directory, if it
    /// cannot: the embedded one stopped on its own (a failed journal write
    /// or sync: fail-stop), or a `cxlkv pool` daemon came back serving
    /// other pools than the server started with
    /// ([`PoolService::failure`]). The server must then exit; a restart
    /// recovers.
    pub fn pool_failure(&self) -> Option<String> {
        if let Some(f) = self.pool_core.as_ref().and_then(PoolCore::failure) {
            return Some(format!("the embedded pool manager stopped: {f}"));
        }
        self.pool_service.upgrade().and_then(|s| s.failure())
    }

    /// Why the transport's event loop ended on its own (a panic, an I/O
    /// error of the loop), if it did: every connection is gone and none is
    /// accepted any more. The server must then exit; a restart serves again.
    pub fn transport_failure(&self) -> Option<String> {
        self.transport
            .as_ref()
            .and_then(transport::ServerHandle::failure)
    }

    /// A snapshot of the directory's statistics (asked of the loop thread).
    pub fn directory_stats(&self) -> Result<DirectoryStats, ServerError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.mailbox
            .post(Event::Control(Control::Stats(tx)), &self.completer);
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| ServerError::Stopped)
    }

    /// The transport's counters (connections, frames, slow readers dropped,
    /// faults applied); `None` once the server has stopped.
    pub fn transport_stats(&self) -> Option<transport::ServerStatsSnapshot> {
        self.transport.as_ref().map(|t| t.stats())
    }

    /// Stops the server: every connection closed (their sessions end and
    /// release their pins), region frees in flight waited for (bounded), the
    /// socket file removed.
    pub fn shutdown(mut self) -> Result<ShutdownReport, ServerError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<ShutdownReport, ServerError> {
        if let Some(m) = self.metrics.take() {
            m.stop();
        }
        if let Some((tx, join)) = self.ticker.take() {
            drop(tx);
            let _ = join.join();
        }
        let Some(transport) = self.transport.take() else {
            return Err(ServerError::Stopped);
        };
        let mut handler = match transport.shutdown() {
            Ok(h) => h,
            Err(e) => {
                // The loop died (`transport_failure`), and the handler with
                // it: the rest of the stop still runs.
                self.stop_pool_core();
                remove_paths(&self.remove_after);
                return Err(e.into());
            }
        };
        let sessions_closed = handler.sessions_closed_at_shutdown();
        // The loop is gone: apply the pool manager's answers here until the
        // frees in flight are confirmed (or the wait runs out). Only that:
        // the directory's timers would expire the instances whose sessions
        // the shutdown just closed (`drain_at_shutdown`).
        let deadline = Instant::now() + SHUTDOWN_FREE_WAIT;
        while handler.frees_outstanding() > 0 && Instant::now() < deadline {
            handler.drain_at_shutdown();
            std::thread::sleep(Duration::from_millis(5));
        }
        let frees_unconfirmed = handler.frees_outstanding();
        if frees_unconfirmed > 0 {
            tracing::warn!(
                frees_unconfirmed,
                "shutdown: region frees not confirmed; the next start frees them after the grace period"
            );
        }
        drop(handler);
        self.stop_pool_core();
        remove_paths(&self.remove_after);
        tracing::info!(sessions_closed, "server stopped");
        Ok(ShutdownReport {
            sessions_closed,
            frees_unconfirmed,
        })
    }
}

impl ServerHandle {
    /// Stops the embedded pool manager, if any (journal committed,
    /// checkpointed).
    fn stop_pool_core(&mut self) {
        if let Some(core) = self.pool_core.take() {
            match core.shutdown() {
                Ok(r) => tracing::info!(
                    committed_seq = r.committed_seq,
                    checkpointed = r.checkpointed,
                    "pool manager stopped"
                ),
                Err(e) => tracing::warn!(error = %e, "pool manager stopped with an error"),
            }
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.transport.is_some()
            && let Err(e) = self.stop()
        {
            tracing::warn!(error = %e, "server shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn metrics_scrapes_within_the_interval_reuse_the_last_snapshot_and_failures_are_not_kept() {
        use super::ScrapeCache;
        use std::time::{Duration, Instant};
        let mut cache = ScrapeCache::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let taken = std::cell::Cell::new(0);
        let fetch = |text: &str| {
            taken.set(taken.get() + 1);
            Ok::<_, String>(text.to_owned())
        };
        assert_eq!(cache.get(t0, || fetch("a")), Ok("a".into()));
        for ms in [1, 500, 999] {
            let at = t0 + Duration::from_millis(ms);
            assert_eq!(cache.get(at, || fetch("b")), Ok("a".into()), "{ms} ms");
        }
        assert_eq!(
            taken.get(),
            1,
            "one snapshot for four scrapes within the second"
        );
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(cache.get(t1, || fetch("c")), Ok("c".into()));
        assert_eq!(taken.get(), 2);
        // A failure is answered as such and not kept: the next scrape asks
        // the loop again.
        let t2 = t1 + Duration::from_secs(2);
        assert!(cache.get(t2, || Err("gone".into())).is_err());
        assert_eq!(cache.get(t2, || fetch("d")), Ok("d".into()));
    }

    use std::ffi::OsStr;
    use std::path::Path;

    use super::socket_path_in_runtime_dir as path;
    use super::{PoolManagerConfig, ServerConfig, ServerError, removable_on_shutdown};
    use crate::config::{PoolConfig, PoolEntry, default_state_dir, host_state_dir};

    fn embedded(cfg: &ServerConfig) -> cxlkv_controlplane::pool::service::ServiceConfig {
        match cfg.pool_manager_config() {
            PoolManagerConfig::Embedded(c) => c,
            other => panic!("not embedded: {other:?}"),
        }
    }

    /// An API-embedded server over `/dev/daxX.Y` (no `pool_manager`) used
    /// to put its pool manager's journal at `/dev/daxX.Y.state`: on
    /// devtmpfs, RAM lost at reboot while the device keeps its regions,
    /// and as root a directory created in `/dev`. `cxlkv pool` and
    /// `cxlkv serve` had a second, better rule; every embedded pool manager
    /// now follows that one.
    #[test]
    fn a_device_pools_state_is_kept_off_dev_by_the_one_rule_of_every_embedded_manager() {
        for pool in [
            "/dev/dax0.0",
            "/dev/pmem0",
            "/dev/hugepages/cxlkv.pool",
            "/dev/shm/../dax0.0",
            "/mnt/cxl/cxlkv.pool",
        ] {
            let cfg = ServerConfig {
                pool_path: pool.into(),
                ..ServerConfig::default()
            };
            let state = embedded(&cfg).state_dir;
            assert!(!state.starts_with("/dev"), "{pool}: state in {state:?}");
            assert_eq!(state, host_state_dir(), "{pool}");
            let resolved = PoolConfig {
                pools: vec![PoolEntry {
                    path: pool.into(),
                    size_bytes: None,
                    align_bytes: None,
                    visibility: None,
                }],
                ..PoolConfig::default()
            }
            .resolve()
            .unwrap();
            assert_eq!(resolved.service.state_dir, state, "{pool}: two rules");
            cfg.validate().unwrap();
        }
        // A pool in RAM keeps its state in RAM, next to it.
        let shm = ServerConfig::ephemeral("state-rule");
        let mut beside = shm.pool_path.clone().into_os_string();
        beside.push(".state");
        assert_eq!(embedded(&shm).state_dir, Path::new(&beside));
        assert_eq!(default_state_dir(&shm.pool_path), Path::new(&beside));
    }

    /// A state directory configured under `/dev` (not `/dev/shm`) is
    /// refused before anything is created, naming it.
    #[test]
    fn a_state_directory_under_dev_is_refused_by_the_server_and_the_pool_config() {
        let mut cfg = ServerConfig::ephemeral("state-dev");
        let mut service = embedded(&cfg);
        service.state_dir = "/dev/cxlkv-test.state".into();
        cfg.pool_manager = Some(PoolManagerConfig::Embedded(service));
        let err = cfg.validate().unwrap_err();
        assert!(
            matches!(&err, ServerError::Config(m) if m.contains("/dev/cxlkv-test.state") && m.contains("devtmpfs")),
            "{err}"
        );
        let err = super::Server::start(cfg).map(drop).unwrap_err();
        assert!(err.to_string().contains("/dev/cxlkv-test.state"), "{err}");
        assert!(!Path::new("/dev/cxlkv-test.state").exists());

        let err = PoolConfig {
            state_dir: Some("/dev/dax0.0.state".into()),
            ..PoolConfig::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("/dev/dax0.0.state"), "{err}");
        for ok in ["/dev/shm/x.state", "/var/lib/cxlkv/pool", "/devices/x"] {
            PoolConfig {
                state_dir: Some(ok.into()),
                ..PoolConfig::default()
            }
            .resolve()
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    /// `remove_pool_on_shutdown` removes a pool's own state directory, never
    /// the host's shared one (a device or disk pool's default).
    #[test]
    fn removing_a_temporary_pool_never_removes_the_hosts_shared_state_directory() {
        let shm = ServerConfig::ephemeral("state-rm");
        let removed = removable_on_shutdown(&shm.pool_manager_config(), true);
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert!(removed.contains(&embedded(&shm).state_dir));
        let disk = ServerConfig {
            pool_path: "/mnt/cxl/temporary.pool".into(),
            remove_pool_on_shutdown: true,
            ..ServerConfig::default()
        };
        let removed = removable_on_shutdown(&disk.pool_manager_config(), true);
        assert_eq!(removed, vec![disk.pool_path.clone()]);
        assert!(removable_on_shutdown(&shm.pool_manager_config(), false).is_empty());
    }

    /// Found by a review of the L1 tier (session 22): a directory letting
    /// a lookup take fewer pins per key than a tier's 128 read holds
    /// refused such reserves (the tier reported the keys missing) and the
    /// reattach that takes them again.
    #[test]
    fn a_pin_limit_per_call_under_the_tiers_most_holds_is_refused() {
        let mut cfg = ServerConfig::ephemeral("pin-limit");
        cfg.directory.max_pins_per_call = crate::tier::Holds::MAX - 1;
        let err = cfg.validate().unwrap_err();
        assert!(
            matches!(&err, ServerError::Config(m) if m.contains("max_pins_per_call = 127")),
            "{err}"
        );
        cfg.directory.max_pins_per_call = crate::tier::Holds::MAX;
        cfg.validate().unwrap();
    }

    fn refused(cfg: &ServerConfig) -> String {
        cfg.validate().expect_err("refused").to_string()
    }

    /// Found by a review of the server's configuration (session 23): a
    /// 1 ms lease ended heartbeating sessions (and dropped their pins) nine
    /// times a second, a zero grace freed regions under their mappings.
    #[test]
    fn a_lease_or_grace_too_short_for_live_clients_is_refused() {
        let mut cfg = ServerConfig::ephemeral("short-lease");
        cfg.directory.session_lease = std::time::Duration::from_millis(1);
        let m = refused(&cfg);
        assert!(m.contains("lease_ms) = 1 ms is under 100 ms"), "{m}");
        cfg.directory.session_lease = super::MIN_SESSION_LEASE;
        cfg.directory.instance_grace = std::time::Duration::ZERO;
        let m = refused(&cfg);
        assert!(m.contains("grace_ms) = 0 ms is under 100 ms"), "{m}");
        cfg.directory.instance_grace = super::MIN_INSTANCE_GRACE;
        cfg.validate().unwrap();
    }

    /// Same review: a default region over the largest region a request may
    /// take, over the quota or over the pool started and then refused every
    /// client that asked for the default.
    #[test]
    fn a_default_region_no_request_could_get_is_refused() {
        let mut cfg = ServerConfig::ephemeral("region-default");
        cfg.directory.max_region_bytes = 8 << 20;
        cfg.default_region_bytes = 16 << 20;
        assert!(refused(&cfg).contains("over directory.max_region_bytes"));
        cfg.directory.max_region_bytes = 1 << 40;
        cfg.directory.max_instance_quota_bytes = Some(8 << 20);
        assert!(refused(&cfg).contains("over the instance quota"));
        cfg.directory.max_instance_quota_bytes = None;
        cfg.default_region_bytes = cfg.pool_size_bytes;
        assert!(refused(&cfg).contains("does not fit the embedded pool"));
        cfg.default_region_bytes = 4 << 20;
        cfg.validate().unwrap();
    }

    /// Found by a review of the docs against the code (session 26): the
    /// directory accepted a `max_region_bytes` up to 256 TiB, while the
    /// pool manager refuses every region over 16 TiB (`RegionTooLarge`).
    #[test]
    fn a_largest_region_over_the_pool_managers_limit_is_refused() {
        let mut cfg = ServerConfig::ephemeral("region-ceiling");
        cfg.directory.max_region_bytes = cxlkv_controlplane::pool::manager::MAX_REGION_BYTES;
        cfg.validate().unwrap();
        cfg.directory.max_region_bytes += 4096;
        let m = refused(&cfg);
        assert!(m.contains("max_region_bytes") && m.contains("2^44"), "{m}");
    }

    /// Found by a review of the docs against the code (session 26): the
    /// pool check above ran only for a configuration without a pool
    /// manager, while `cxlkv serve` always names its embedded one, so a
    /// default region larger than every embedded pool started a server
    /// whose every default request failed.
    #[test]
    fn a_default_region_over_every_embedded_pool_is_refused_as_serve_configures_it() {
        let mut cfg = ServerConfig::ephemeral("region-embedded");
        let PoolManagerConfig::Embedded(mut service) = cfg.pool_manager_config() else {
            panic!("the ephemeral configuration embeds its pool manager");
        };
        service.pools[0].create_size_bytes = Some(48 << 20);
        let mut second = service.pools[0].clone();
        second.path = second.path.with_extension("second");
        second.create_size_bytes = Some(32 << 20);
        service.pools.push(second);
        cfg.pool_manager = Some(PoolManagerConfig::Embedded(service.clone()));
        cfg.default_region_bytes = 64 << 20;
        let m = refused(&cfg);
        assert!(
            m.contains("does not fit the embedded pools: the largest is 50331648 bytes"),
            "{m}"
        );
        cfg.default_region_bytes = 40 << 20;
        cfg.validate().unwrap();
        // A pool given without a size (an existing file or device) is
        // measured only when opened: nothing to check it against here.
        service.pools[1].create_size_bytes = None;
        cfg.pool_manager = Some(PoolManagerConfig::Embedded(service));
        cfg.default_region_bytes = 64 << 20;
        cfg.validate().unwrap();
    }

    /// Same review: the directory's own range for a field the server
    /// narrows was reported instead of the server's, and under the
    /// directory's field names rather than the configuration file's.
    #[test]
    fn a_refused_value_is_reported_with_its_real_range_and_file_key() {
        let mut cfg = ServerConfig::ephemeral("ranges");
        cfg.directory.max_batch = 5000;
        assert!(
            refused(&cfg).contains("not in 1..=4096"),
            "{}",
            refused(&cfg)
        );
        cfg.directory.max_batch = 4096;
        cfg.directory.max_pins_per_call = 2000;
        assert!(
            refused(&cfg).contains("not in 128..=1024"),
            "{}",
            refused(&cfg)
        );
        cfg.directory.max_pins_per_call = 1024;
        cfg.directory.eviction.pool_low_watermark = 0.95;
        let m = refused(&cfg);
        assert!(m.contains("[directory] low_watermark"), "{m}");
    }

    #[test]
    fn the_default_socket_is_in_run_for_root_then_the_runtime_dir_then_tmp() {
        let xdg = Some(OsStr::new("/run/user/1000"));
        assert_eq!(
            path("cxlkv.sock", true, xdg, 0),
            Path::new("/run/cxlkv/cxlkv.sock"),
            "root ignores XDG_RUNTIME_DIR"
        );
        assert_eq!(
            path("cxlkv.sock", false, xdg, 1000),
            Path::new("/run/user/1000/cxlkv/cxlkv.sock")
        );
        assert_eq!(
            path("cxlkv.sock", false, None, 1000),
            Path::new("/tmp/cxlkv-1000/cxlkv.sock")
        );
        assert_eq!(
            path("pool.sock", false, None, 1000),
            Path::new("/tmp/cxlkv-1000/pool.sock"),
            "the pool manager's socket sits beside it"
        );
    }
}
