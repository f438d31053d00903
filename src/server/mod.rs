//! The server assembly: the directory state machine driven by the transport,
//! with the pool manager embedded — what `cxlkv serve` runs, and what tests
//! start in-process with [`Server::start`].
//!
//! ## Threads
//!
//! - the transport's event loop (`cxlkv-transport`): owns every socket and
//!   the [`Directory`](cxlkv_controlplane::directory::Directory); decodes,
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
//! ## Identity
//!
//! Unix peers are identified by `SO_PEERCRED` (pid, uid, gid), never by a
//! payload; they receive the pool descriptors with `Welcome` (`SCM_RIGHTS`).
//! TCP peers must present the configured pre-shared secret in
//! `Hello`/`Reattach` unless `tcp_insecure_no_secret` is set; they get the
//! pools' UUIDs and paths instead of descriptors.

mod handler;
pub mod pool;
mod wire;

use std::io;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cxlkv_controlplane::directory::{
    ConfigError, Directory, DirectoryConfig, DirectoryStats, InstanceId, RecoveredRegion,
};
use cxlkv_controlplane::proto;
use cxlkv_controlplane::transport::{self, Endpoint, TransportError};
use cxlkv_dataplane::ids::PoolId;

use handler::{Control, DirectoryHandler, Event, HandlerParts, Mailbox};
use pool::{
    EmbeddedPool, EmbeddedPoolError, EmbeddedPoolSpec, PoolReply, PoolRequest, PoolService,
};

/// Where `cxlkv serve` listens by default.
pub const DEFAULT_SOCKET_PATH: &str = "/tmp/cxlkv.sock";
/// The embedded default pool: a file under `/dev/shm` (RAM-backed).
pub const DEFAULT_POOL_PATH: &str = "/dev/shm/cxlkv-pool";
/// 2 GiB: a fraction of RAM on any machine that runs inference.
pub const DEFAULT_POOL_SIZE_BYTES: u64 = 2 << 30;
/// Default region size (DESIGN §3: max(64 MiB, one page)).
pub const DEFAULT_REGION_BYTES: u64 = 64 << 20;
/// The directory's default stable identity (its owner label at the pool
/// manager: a restarted server with the same id finds its regions).
pub const DEFAULT_DIRECTORY_ID: &str = "cxlkv";

/// How long shutdown waits for region frees the pool manager has not
/// confirmed yet.
const SHUTDOWN_FREE_WAIT: Duration = Duration::from_secs(2);
/// How long start-up waits for the pool manager's list of regions.
const POOL_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Most pages of `ListRegions` read at start-up (16 M regions).
const MAX_LIST_PAGES: usize = 4096;

/// Everything a server needs to start. `ServerConfig::default()` is what
/// `cxlkv serve` runs with no arguments; fields may be changed one by one
/// (the struct is `#[non_exhaustive]`: new fields come with defaults).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Unix socket to listen on. A stale socket file (nobody listening) is
    /// replaced; a live one is an error.
    pub socket_path: PathBuf,
    /// Also listen on TCP here (port 0 picks a free port).
    pub tcp_listen: Option<SocketAddr>,
    /// The pre-shared secret TCP clients must present.
    pub tcp_secret: Option<Vec<u8>>,
    /// Accept TCP clients without a secret (trusted networks only).
    pub tcp_insecure_no_secret: bool,
    /// Connections served at once; more are refused with `Busy`.
    pub max_connections: usize,
    /// The directory's stable identity at the pool manager.
    pub directory_id: String,
    pub directory: DirectoryConfig,
    /// The embedded pool file, created (or grown) to `pool_size_bytes`.
    pub pool_path: PathBuf,
    pub pool_size_bytes: u64,
    /// Remove the pool file on shutdown (temporary servers: tests, benches).
    pub remove_pool_on_shutdown: bool,
    /// Region size when a client asks for "the default" (0 bytes).
    pub default_region_bytes: u64,
    /// How often the directory's timers run (lease and grace expiry,
    /// eviction, free retries).
    pub tick_ms: u64,
    /// Transport knobs (backend, spinning, in-flight limits).
    pub io: transport::IoConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            socket_path: PathBuf::from(DEFAULT_SOCKET_PATH),
            tcp_listen: None,
            tcp_secret: None,
            tcp_insecure_no_secret: false,
            max_connections: 1024,
            directory_id: DEFAULT_DIRECTORY_ID.to_owned(),
            directory: DirectoryConfig::default(),
            pool_path: PathBuf::from(DEFAULT_POOL_PATH),
            pool_size_bytes: DEFAULT_POOL_SIZE_BYTES,
            remove_pool_on_shutdown: false,
            default_region_bytes: DEFAULT_REGION_BYTES,
            tick_ms: 100,
            io: transport::IoConfig::default(),
        }
    }
}

impl ServerConfig {
    /// A private server for a test or a bench: a unique socket under the
    /// temporary directory and a unique 256 MiB pool under `/dev/shm`, both
    /// removed on shutdown. `tag` goes into the names (for humans).
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

    /// Checks the fields the directory does not check itself.
    pub fn validate(&self) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError::Config(m));
        self.directory.validate()?;
        if self.directory.max_batch > proto::MAX_BATCH {
            return bad(format!(
                "directory.max_batch = {} is over the protocol's MAX_BATCH = {}",
                self.directory.max_batch,
                proto::MAX_BATCH
            ));
        }
        if self.directory.max_pins_per_call as usize > proto::MAX_PINS_PER_KEY {
            return bad(format!(
                "directory.max_pins_per_call = {} is over the protocol's MAX_PINS_PER_KEY = {}",
                self.directory.max_pins_per_call,
                proto::MAX_PINS_PER_KEY
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
        if self.tick_ms == 0 || self.tick_ms > 10_000 {
            return bad(format!("tick_ms = {} is not in 1..=10000", self.tick_ms));
        }
        if self.default_region_bytes == 0 {
            return bad("default_region_bytes must be positive".into());
        }
        Ok(())
    }
}

/// Why a server could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Directory(#[from] ConfigError),
    #[error(transparent)]
    Pool(#[from] EmbeddedPoolError),
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
}

/// A running server. Dropping it shuts it down (errors are logged).
#[derive(Debug)]
pub struct ServerHandle {
    transport: Option<transport::ServerHandle<DirectoryHandler>>,
    ticker: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    mailbox: Arc<Mailbox>,
    completer: transport::Completer,
    socket_path: PathBuf,
    tcp_addr: Option<SocketAddr>,
    pool_paths: Vec<PathBuf>,
    remove_pool: bool,
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
        let spec = EmbeddedPoolSpec {
            path: config.pool_path.clone(),
            size_bytes: config.pool_size_bytes,
            grace_ms: directory_cfg.instance_grace.as_millis() as u64,
        };
        let (pool, session) = EmbeddedPool::open(&spec, &config.directory_id)?;
        let remove_pool = |why: &ServerError| {
            if config.remove_pool_on_shutdown {
                let _ = std::fs::remove_file(&config.pool_path);
            }
            tracing::error!(error = %why, "server start failed");
        };
        let started = (|| {
            let recovered = list_regions(pool.as_ref())?;
            if !recovered.is_empty() {
                tracing::info!(
                    regions = recovered.len(),
                    "recovering the directory from the pool manager's regions"
                );
            }
            let origin = Instant::now();
            let mut seed = [0u8; 32];
            cxlkv_controlplane::pool::sys::random_bytes(&mut seed).map_err(ServerError::Random)?;
            let recovered_regions = recovered.iter().map(|r| r.handle.region).collect();
            let mut directory =
                Directory::recover(directory_cfg.clone(), seed, dir_time(origin), recovered)?;
            for p in pool_usage(pool.as_ref())? {
                directory.pool_usage(PoolId(p.pool), p.total_bytes, p.free_bytes);
            }
            prepare_socket(&config.socket_path)?;
            let mut endpoints = vec![Endpoint::Unix(config.socket_path.clone())];
            if let Some(addr) = config.tcp_listen {
                endpoints.push(Endpoint::Tcp(addr));
            }
            let tcfg = transport::ServerConfig {
                io: config.io.clone(),
                max_connections: config.max_connections,
                ..transport::ServerConfig::default()
            };
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
                pool: Arc::clone(&pool) as Arc<dyn PoolService>,
                pools: session.welcome.pools.clone(),
                pool_fds: session.fds,
                mailbox: Arc::clone(&mailbox),
                completer: completer.clone(),
                origin,
                tcp_secret: config.tcp_secret.clone(),
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
            tracing::info!(
                socket = %config.socket_path.display(),
                tcp = ?tcp_addr,
                pool = %config.pool_path.display(),
                %backend,
                "server listening"
            );
            Ok(ServerHandle {
                transport: Some(transport),
                ticker: Some(ticker),
                mailbox,
                completer,
                socket_path: config.socket_path.clone(),
                tcp_addr,
                pool_paths: vec![config.pool_path.clone()],
                remove_pool: config.remove_pool_on_shutdown,
            })
        })();
        started.inspect_err(remove_pool)
    }
}

fn dir_time(origin: Instant) -> cxlkv_controlplane::directory::Time {
    cxlkv_controlplane::directory::Time::from_nanos(
        origin.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64,
    )
}

/// Every region the pool manager holds for this directory, as the directory
/// recovers them.
fn list_regions(pool: &dyn PoolService) -> Result<Vec<RecoveredRegion>, ServerError> {
    let mut out = Vec::new();
    let mut after_region = 0;
    for _ in 0..MAX_LIST_PAGES {
        let (tx, rx) = mpsc::sync_channel(1);
        pool.submit(
            PoolRequest::List {
                after_region,
                max_handles: proto::MAX_LIST_REGIONS as u32,
            },
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let list = match rx.recv_timeout(POOL_CALL_TIMEOUT) {
            Ok(Ok(PoolReply::Regions(list))) => list,
            Ok(Ok(other)) => {
                return Err(ServerError::PoolService(format!(
                    "unexpected answer to ListRegions: {other:?}"
                )));
            }
            Ok(Err(e)) => return Err(ServerError::PoolService(e.to_string())),
            Err(_) => {
                return Err(ServerError::PoolService(format!(
                    "no answer to ListRegions within {} s",
                    POOL_CALL_TIMEOUT.as_secs()
                )));
            }
        };
        for h in &list.handles {
            let owner = InstanceId::new(&h.owner.instance_id).map_err(|e| {
                ServerError::PoolService(format!("region {} has owner label {e}", h.region))
            })?;
            out.push(RecoveredRegion {
                handle: wire::dir_handle(h),
                owner,
            });
            after_region = after_region.max(h.region);
        }
        if !list.more {
            return Ok(out);
        }
    }
    Err(ServerError::PoolService(format!(
        "more than {MAX_LIST_PAGES} pages of regions"
    )))
}

/// The pools' fill levels, asked at start so that the first replies carry
/// them.
fn pool_usage(pool: &dyn PoolService) -> Result<Vec<proto::PoolUsage>, ServerError> {
    let (tx, rx) = mpsc::sync_channel(1);
    pool.submit(
        PoolRequest::Stats,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    match rx.recv_timeout(POOL_CALL_TIMEOUT) {
        Ok(Ok(PoolReply::Stats(s))) => Ok(s.pools),
        Ok(Ok(other)) => Err(ServerError::PoolService(format!(
            "unexpected answer to PoolStats: {other:?}"
        ))),
        Ok(Err(e)) => Err(ServerError::PoolService(e.to_string())),
        Err(_) => Err(ServerError::PoolService(format!(
            "no answer to PoolStats within {} s",
            POOL_CALL_TIMEOUT.as_secs()
        ))),
    }
}

/// Makes `path` bindable: a stale socket file (nobody accepts on it) is
/// removed; a live one means another server runs there.
fn prepare_socket(path: &Path) -> Result<(), ServerError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ServerError::SocketPath {
            path: path.to_owned(),
            source,
        }),
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(ServerError::SocketPath {
                    path: path.to_owned(),
                    source: io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "exists and is not a socket",
                    ),
                });
            }
            match UnixStream::connect(path) {
                Ok(_) => Err(ServerError::AlreadyRunning {
                    path: path.to_owned(),
                }),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "removing a stale socket file");
                    std::fs::remove_file(path).map_err(|source| ServerError::SocketPath {
                        path: path.to_owned(),
                        source,
                    })
                }
                Err(source) => Err(ServerError::SocketPath {
                    path: path.to_owned(),
                    source,
                }),
            }
        }
    }
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

    /// The pools' paths on this host, in pool-index order.
    pub fn pool_paths(&self) -> &[PathBuf] {
        &self.pool_paths
    }

    /// A snapshot of the directory's statistics (asked of the loop thread).
    pub fn directory_stats(&self) -> Result<DirectoryStats, ServerError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.mailbox
            .post(Event::Control(Control::Stats(tx)), &self.completer);
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| ServerError::Stopped)
    }

    /// Stops the server: every connection closed (their sessions end and
    /// release their pins), region frees in flight waited for (bounded), the
    /// socket file removed.
    pub fn shutdown(mut self) -> Result<ShutdownReport, ServerError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<ShutdownReport, ServerError> {
        if let Some((tx, join)) = self.ticker.take() {
            drop(tx);
            let _ = join.join();
        }
        let Some(transport) = self.transport.take() else {
            return Err(ServerError::Stopped);
        };
        let mut handler = transport.shutdown()?;
        let sessions_closed = handler.sessions_closed_at_shutdown();
        // The loop is gone: apply the pool manager's answers here until the
        // frees in flight are confirmed (or the wait runs out).
        let deadline = Instant::now() + SHUTDOWN_FREE_WAIT;
        while handler.frees_outstanding() > 0 && Instant::now() < deadline {
            handler.run_events(None);
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
        if self.remove_pool {
            for p in &self.pool_paths {
                if let Err(e) = std::fs::remove_file(p) {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove the pool file");
                }
            }
        }
        tracing::info!(sessions_closed, "server stopped");
        Ok(ShutdownReport {
            sessions_closed,
            frees_unconfirmed,
        })
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
