//! cxlkv's one configuration mechanism: a TOML file, environment variables,
//! command-line flags — merged key by key with one precedence:
//!
//! **flags > environment > file > built-in defaults.**
//!
//! The file (`--config PATH`, or `$CXLKV_CONFIG`) has one table per section
//! (`[pool]`, `[server]`, `[directory]`, `[transport]`).
//! Every key `k` of section `s` can be set from the environment as
//! `CXLKV_<S>_<K>` (upper case; e.g. `CXLKV_POOL_GRACE_MS=5000`); the value
//! is read as a TOML value when it parses as one (`5000`, `true`,
//! `[{path = "/dev/shm/a"}]`) and as a string otherwise
//! (`/dev/shm/cxlkv.pool`, `per-record`) — or when the key takes a string
//! (`CXLKV_SERVER_DIRECTORY_ID=7`); an empty variable counts as unset. Flags override single keys the
//! same way ([`Override`]). Only variables of known sections ([`SECTIONS`])
//! are read, so `CXLKV_LOG` or `CXLKV_IO` never collide; an unknown key in a
//! known section — in the file, the environment or a flag — is an error that
//! names it.
//!
//! **Adding a section** (for the next engineer): add a field to [`Config`]
//! with `#[serde(default)]`, its name to [`SECTIONS`], a struct with
//! `#[serde(deny_unknown_fields, default)]` and documented defaults, and a
//! table under "Configuration" in `docs/operations.md`.
//!
//! Sizes accept integers (bytes) or strings with a binary suffix (`"2GiB"`,
//! `"64MiB"`, `"4KiB"`). The `[pool]` section resolves to the pool
//! service's configuration with [`PoolConfig::resolve`], which fills in the
//! defaults documented there.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use cxlkv_controlplane::pool::service::{PoolSpec, ServiceConfig, TcpAuth, Visibility};
use cxlkv_controlplane::pool::{StoreConfig, SyncPolicy, store::MAX_GROUP_RECORDS};
use cxlkv_dataplane::backing::{DEFAULT_POOL_DIR, DEFAULT_POOL_SIZE_BYTES};
use serde::Deserialize;

/// Prefix of every configuration variable.
pub const ENV_PREFIX: &str = "CXLKV_";
/// Environment variable naming the configuration file (like `--config`).
pub const CONFIG_ENV: &str = "CXLKV_CONFIG";
/// The sections the environment layer reads (`CXLKV_<SECTION>_<KEY>`).
pub const SECTIONS: &[&str] = &["pool", "server", "directory", "transport"];

/// Name of the embedded default pool file, under [`DEFAULT_POOL_DIR`].
pub const DEFAULT_POOL_FILE: &str = "cxlkv.pool";

/// Why a TCP listener's `tcp_secret_file` and `tcp_insecure` may not both
/// be set: whichever won, the other would be silently ignored, and one of
/// them would turn authentication off.
const SECRET_AND_INSECURE: &str =
    "tcp_insecure = true and tcp_secret_file contradict each other: set one of them";

/// What went wrong loading the configuration; each variant names the source
/// (file, variable or flag) and the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    // The underlying errors are in the message, not `source()`: a caller
    // printing the chain (`{:#}`) would say them twice.
    #[error("cannot read configuration file {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("configuration file {}: {error}", path.display())]
    Parse {
        path: PathBuf,
        error: Box<toml::de::Error>,
    },
    #[error("configuration {origin}: section [{section}] is not a table")]
    NotATable { origin: String, section: String },
    /// A key unknown or of the wrong type; `origin` says where the value
    /// came from (`file PATH`, `environment variable CXLKV_…`, `a flag`) when
    /// the error names a key that was set.
    #[error("invalid configuration{}: {error}", at_origin(origin))]
    Invalid {
        origin: Option<String>,
        error: Box<toml::de::Error>,
    },
    #[error("configuration [{section}] {key}: {reason}")]
    Value {
        section: &'static str,
        key: &'static str,
        reason: String,
    },
}

fn at_origin(origin: &Option<String>) -> String {
    match origin {
        Some(o) => format!(" (from {o})"),
        None => String::new(),
    }
}

/// Where the key a deserialisation error names was set: the last of
/// `origins` (section, key, origin; in the order they were applied) that
/// sets it. The error names the key in its message (`unknown field
/// `name``) or its path (`in `section.key``).
fn origin_of(origins: &[(String, String, String)], error: &toml::de::Error) -> Option<String> {
    let text = error.to_string();
    let path = text
        .rsplit_once("in `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(path, _)| path)
        .unwrap_or("");
    let unknown = error
        .message()
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name);
    let (section, key) = match unknown {
        // An unknown section: the file's top level.
        Some(name) if path.is_empty() => (name, ""),
        Some(name) => (path, name),
        None => {
            let (section, rest) = path.split_once('.')?;
            let key = rest.split(['.', '[']).next().unwrap_or(rest);
            (section, key)
        }
    };
    origins
        .iter()
        .rev()
        .find(|(s, k, _)| s == section && (k == key || k.is_empty() || key.is_empty()))
        .map(|(_, _, origin)| origin.clone())
}

/// One key set by a flag (or by any caller that wants to set a key last).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub section: &'static str,
    pub key: &'static str,
    pub value: toml::Value,
}

impl Override {
    pub fn new(section: &'static str, key: &'static str, value: impl Into<toml::Value>) -> Self {
        Self {
            section,
            key,
            value: value.into(),
        }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub pool: PoolConfig,
    pub server: ServerSection,
    pub directory: DirectorySection,
    pub transport: TransportSection,
}

/// `[transport]`: how the control plane's server event loop does its I/O,
/// for `cxlkv serve` and `cxlkv pool` alike. The defaults are the measured
/// ones (the `transport` module essay and `cxlkv bench rtt`); change them
/// after measuring on the target machine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSection {
    /// `auto` (io_uring, else the epoll fallback with one log line),
    /// `uring` (io_uring or fail), `fallback` (epoll). `CXLKV_IO` applies
    /// under `auto`.
    pub backend: String,
    /// Polling without sleeping after the last event before blocking (µs).
    /// Waking a sleeping vCPU costs tens of µs: a spin bridges short gaps.
    pub spin_us: u32,
    /// While the loop spins, read the connection the last request came on
    /// with plain `recv`s instead of through io_uring or epoll.
    pub spin_recv: bool,
    /// io_uring: a kernel thread polls the submission queue (costs a core
    /// while busy).
    pub sqpoll: bool,
    /// io_uring: the SQPOLL thread sleeps after this much idle time.
    pub sqpoll_idle_ms: u32,
    /// io_uring task-work mode: `defer`, `coop` or `interrupt`.
    pub taskrun: String,
    /// io_uring submission-queue entries of the server ring.
    pub ring_entries: u32,
    /// io_uring receive: `direct` (into each connection's decoder) or
    /// `provided` (multishot into a shared ring of buffers).
    pub recv: String,
    /// io_uring provided receive buffers (`recv = "provided"`): bytes each ...
    #[serde(deserialize_with = "de_bytes")]
    pub recv_buffer_bytes: u64,
    /// ... and how many (a power of two, at most 32768).
    pub recv_buffer_count: u16,
    /// Requests of one connection in the server and not answered yet; more
    /// are rejected with `TooManyInFlight`.
    pub max_inflight_per_conn: usize,
    /// Bytes queued for one connection and not yet taken by its socket; a
    /// peer that stops reading is disconnected beyond this.
    #[serde(deserialize_with = "de_bytes")]
    pub max_send_queue_bytes: u64,
    /// A connection holding an incomplete frame this long is closed.
    pub partial_frame_timeout_ms: u64,
}

impl Default for TransportSection {
    fn default() -> Self {
        let t = cxlkv_controlplane::transport::ServerConfig::default();
        Self {
            backend: "auto".to_owned(),
            spin_us: t.io.spin_us,
            spin_recv: t.io.spin_recv,
            sqpoll: t.io.sqpoll,
            sqpoll_idle_ms: t.io.sqpoll_idle_ms,
            taskrun: "defer".to_owned(),
            ring_entries: t.io.ring_entries,
            recv: "direct".to_owned(),
            recv_buffer_bytes: u64::from(t.io.recv_buffer_bytes),
            recv_buffer_count: t.io.recv_buffer_count,
            max_inflight_per_conn: t.max_inflight_per_conn,
            max_send_queue_bytes: t.max_send_queue_bytes as u64,
            partial_frame_timeout_ms: t.partial_frame_timeout_ms,
        }
    }
}

impl TransportSection {
    /// The transport server configuration these keys describe (connection
    /// limits other than these keep the transport's defaults; `cxlkv serve`
    /// sets `max_connections` from `[server]`).
    pub fn server_config(
        &self,
    ) -> Result<cxlkv_controlplane::transport::ServerConfig, ConfigError> {
        use cxlkv_controlplane::transport::{BackendChoice, RecvMode, TaskRun};
        let invalid = |key: &'static str, reason: String| ConfigError::Value {
            section: "transport",
            key,
            reason,
        };
        let mut t = cxlkv_controlplane::transport::ServerConfig::default();
        t.io.backend = match self.backend.as_str() {
            "auto" => BackendChoice::Auto,
            "uring" => BackendChoice::Uring,
            "fallback" => BackendChoice::Fallback,
            other => {
                return Err(invalid(
                    "backend",
                    format!("{other:?} is not auto, uring or fallback"),
                ));
            }
        };
        t.io.taskrun = match self.taskrun.as_str() {
            "defer" => TaskRun::Defer,
            "coop" => TaskRun::Coop,
            "interrupt" => TaskRun::Interrupt,
            other => {
                return Err(invalid(
                    "taskrun",
                    format!("{other:?} is not defer, coop or interrupt"),
                ));
            }
        };
        t.io.recv = match self.recv.as_str() {
            "direct" => RecvMode::Direct,
            "provided" => RecvMode::Provided,
            other => {
                return Err(invalid(
                    "recv",
                    format!("{other:?} is not direct or provided"),
                ));
            }
        };
        t.io.spin_us = self.spin_us;
        t.io.spin_recv = self.spin_recv;
        t.io.sqpoll = self.sqpoll;
        t.io.sqpoll_idle_ms = self.sqpoll_idle_ms;
        if !(1..=32_768).contains(&self.ring_entries) {
            return Err(invalid(
                "ring_entries",
                format!("{} is not in 1..=32768", self.ring_entries),
            ));
        }
        t.io.ring_entries = self.ring_entries;
        t.io.recv_buffer_bytes = u32::try_from(self.recv_buffer_bytes)
            .ok()
            .filter(|b| (4096..=(16 << 20)).contains(b))
            .ok_or_else(|| {
                invalid(
                    "recv_buffer_bytes",
                    format!("{} is not between 4KiB and 16MiB", self.recv_buffer_bytes),
                )
            })?;
        if !self.recv_buffer_count.is_power_of_two() || self.recv_buffer_count > 32_768 {
            return Err(invalid(
                "recv_buffer_count",
                format!(
                    "{} is not a power of two up to 32768",
                    self.recv_buffer_count
                ),
            ));
        }
        t.io.recv_buffer_count = self.recv_buffer_count;
        // The bound on both together, as the server checks it at bind.
        t.io.check_recv_buffers()
            .map_err(|e| invalid("recv_buffer_count", e.to_string()))?;
        if self.max_inflight_per_conn == 0 {
            return Err(invalid(
                "max_inflight_per_conn",
                "must be at least 1".into(),
            ));
        }
        t.max_inflight_per_conn = self.max_inflight_per_conn;
        let min_queue = cxlkv_controlplane::frame::MAX_FRAME_BYTES as u64;
        if self.max_send_queue_bytes < min_queue {
            return Err(invalid(
                "max_send_queue_bytes",
                format!(
                    "{} is below one maximum frame ({min_queue} bytes)",
                    self.max_send_queue_bytes
                ),
            ));
        }
        t.max_send_queue_bytes = usize::try_from(self.max_send_queue_bytes)
            .map_err(|_| invalid("max_send_queue_bytes", "too large".into()))?;
        if self.partial_frame_timeout_ms == 0 {
            return Err(invalid(
                "partial_frame_timeout_ms",
                "must be at least 1".into(),
            ));
        }
        t.partial_frame_timeout_ms = self.partial_frame_timeout_ms;
        Ok(t)
    }
}

/// `[pool]`: the pool manager (`cxlkv pool`, and the pool manager embedded
/// in `cxlkv serve`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Pools, in order. Empty: the embedded default (a 2 GiB file
    /// `/dev/shm/cxlkv.pool`, created on demand).
    pub pools: Vec<PoolEntry>,
    /// Journal, checkpoint, secret, names, lock. Default: see
    /// [`PoolConfig::resolve`].
    pub state_dir: Option<PathBuf>,
    /// The daemon's Unix socket. Default: `/run/cxlkv/pool.sock` as root,
    /// else `$XDG_RUNTIME_DIR/cxlkv/pool.sock` (or `/tmp/cxlkv-<uid>/pool.sock`).
    pub socket: Option<PathBuf>,
    /// Also listen on TCP at this address (`host:port`). Off by default.
    pub tcp: Option<String>,
    /// File holding the pre-shared secret TCP directories present (mode
    /// 0600 or stricter). Required with `tcp` unless `tcp_insecure`.
    pub tcp_secret_file: Option<PathBuf>,
    /// Accept TCP directories without a secret (trusted networks only).
    pub tcp_insecure: bool,
    /// `per-record` (an `fdatasync` per request that changed state) or
    /// `group` (requests arriving during a sync share the next one).
    pub sync: SyncMode,
    /// Largest group under `sync = "group"` (1..=4096 records).
    pub group_max_records: usize,
    /// Committed records between checkpoints.
    pub checkpoint_every_records: u64,
    /// How long a gone directory's regions wait for a reattach.
    pub grace_ms: u64,
    /// Lease written into each pool header, renewed every `lease_ms / 3`.
    pub lease_ms: u64,
    /// Pass pool descriptors to local directories (`SCM_RIGHTS`).
    pub pass_fds: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            pools: Vec::new(),
            state_dir: None,
            socket: None,
            tcp: None,
            tcp_secret_file: None,
            tcp_insecure: false,
            sync: SyncMode::PerRecord,
            group_max_records: 256,
            checkpoint_every_records: 4096,
            grace_ms: 30_000,
            lease_ms: 10_000,
            pass_fds: true,
        }
    }
}

/// `[server]`: `cxlkv serve`'s listeners, identity and timers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    /// The Unix socket clients connect to. Default:
    /// [`crate::server::default_socket_path`].
    pub socket: Option<PathBuf>,
    /// The socket's permission bits as a string of octal digits (`"0660"`,
    /// the default: the server's user and group may connect, whatever the
    /// umask). Connecting is being handed the pool (docs/security.md).
    #[serde(deserialize_with = "de_opt_mode")]
    pub socket_mode: Option<u32>,
    /// Also listen on TCP at this address (`host:port`). Off by default.
    pub tcp: Option<String>,
    /// File holding the pre-shared secret TCP clients present (mode 0600 or
    /// stricter). Required with `tcp` unless `tcp_insecure`.
    pub tcp_secret_file: Option<PathBuf>,
    /// Accept TCP clients without a secret (trusted networks only).
    pub tcp_insecure: bool,
    /// Connections served at once; more are refused with `Busy`.
    pub max_connections: usize,
    /// A connection that has not opened a session this long after it was
    /// accepted is closed.
    pub hello_timeout_ms: u64,
    /// The directory's stable identity at the pool manager.
    pub directory_id: String,
    /// Region size when a request asks for the default (0 bytes; cxlkv's
    /// own clients always ask for their layout's region size).
    #[serde(deserialize_with = "de_bytes")]
    pub default_region_bytes: u64,
    /// How often the directory's timers run.
    pub tick_ms: u64,
    /// Use a `cxlkv pool` daemon at this endpoint (`unix:PATH` or
    /// `tcp:HOST:PORT`) instead of the embedded pool manager (`[pool]` is
    /// then unused).
    pub pool_daemon: Option<String>,
    /// File holding the secret of a TCP pool daemon.
    pub pool_daemon_secret_file: Option<PathBuf>,
    /// Serve Prometheus metrics at `http://<this>/metrics` (`host:port`).
    /// Off by default.
    pub metrics_addr: Option<String>,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            socket: None,
            socket_mode: None,
            tcp: None,
            tcp_secret_file: None,
            tcp_insecure: false,
            max_connections: 1024,
            hello_timeout_ms: crate::server::DEFAULT_HELLO_TIMEOUT_MS,
            directory_id: crate::server::DEFAULT_DIRECTORY_ID.to_owned(),
            default_region_bytes: crate::server::DEFAULT_REGION_BYTES,
            tick_ms: 100,
            pool_daemon: None,
            pool_daemon_secret_file: None,
            metrics_addr: None,
        }
    }
}

/// `[directory]`: the directory's semantics and limits (DESIGN §4).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectorySection {
    /// A session without requests for this long dies (its pins released).
    pub lease_ms: u64,
    /// An instance without sessions for this long is gone; also how long a
    /// restarted directory waits for reattaches.
    pub grace_ms: u64,
    /// Largest per-instance quota (bytes of regions); also the quota of
    /// instances that ask for none. 0: unlimited.
    #[serde(deserialize_with = "de_bytes")]
    pub quota_bytes: u64,
    /// Evict keys of gone owners while the pools are fuller than
    /// `high_watermark`.
    pub orphan_eviction: bool,
    /// Pool fill (0..=1) above which eviction starts ...
    pub high_watermark: f64,
    /// ... and at or below which it stops.
    pub low_watermark: f64,
    /// Full LRU eviction of unpinned keys (engines without a policy).
    pub lru: bool,
    /// Fill of the held regions (0..=1) the LRU starts at, and stops at.
    pub lru_high_fill: f64,
    pub lru_low_fill: f64,
    /// Most keys evicted per tick.
    pub max_evictions_per_tick: usize,
    /// Pins held longer than this are reported as long-held.
    pub long_pin_ms: u64,
    /// Most entries per batch request (at most 4096).
    pub max_batch: usize,
    /// Most pins one lookup takes per key (128..=1024: an L1 tier takes up
    /// to 128 read holds on a key in one call).
    pub max_pins_per_call: u32,
    /// Most keys held.
    pub max_keys: usize,
    pub max_sessions: usize,
    /// Sessions of one instance at once.
    pub max_sessions_per_instance: usize,
    pub max_instances: usize,
    /// Layouts in use at once (a layout counts while a region of it exists
    /// or is requested).
    pub max_layouts: usize,
    /// Distinct keys one session may hold pins on.
    pub max_pinned_keys_per_session: usize,
    /// (session, key) pairs with pins held, over all sessions: bounds the
    /// directory's pin ledgers (docs/operations.md gives the memory).
    pub max_pinned_entries: usize,
    /// Width of the exactly-once window, in sequence numbers (a multiple of
    /// 64).
    pub reply_window: u64,
    /// Bytes of cached replies per instance.
    #[serde(deserialize_with = "de_bytes")]
    pub reply_cache_bytes: u64,
    /// Largest region one request may ask for.
    #[serde(deserialize_with = "de_bytes")]
    pub max_region_bytes: u64,
}

impl Default for DirectorySection {
    fn default() -> Self {
        let d = cxlkv_controlplane::directory::DirectoryConfig::default();
        Self {
            lease_ms: d.session_lease.as_millis() as u64,
            grace_ms: d.instance_grace.as_millis() as u64,
            quota_bytes: d.max_instance_quota_bytes.unwrap_or(0),
            orphan_eviction: d.eviction.orphans,
            high_watermark: d.eviction.pool_high_watermark,
            low_watermark: d.eviction.pool_low_watermark,
            lru: d.eviction.lru,
            lru_high_fill: d.eviction.lru_high_fill,
            lru_low_fill: d.eviction.lru_low_fill,
            max_evictions_per_tick: d.eviction.max_evictions_per_tick,
            long_pin_ms: d.long_held_pin.as_millis() as u64,
            max_batch: d.max_batch,
            max_pins_per_call: d.max_pins_per_call,
            max_keys: d.max_keys,
            max_sessions: d.max_sessions,
            max_sessions_per_instance: d.max_sessions_per_instance,
            max_instances: d.max_instances,
            max_layouts: d.max_layouts,
            max_pinned_keys_per_session: d.max_pinned_keys_per_session,
            max_pinned_entries: d.max_pinned_entries,
            reply_window: d.reply_window,
            reply_cache_bytes: d.reply_cache_bytes_per_instance as u64,
            max_region_bytes: d.max_region_bytes,
        }
    }
}

impl DirectorySection {
    /// The directory's configuration (its own checks run when the server
    /// starts).
    pub fn directory_config(&self) -> cxlkv_controlplane::directory::DirectoryConfig {
        use cxlkv_controlplane::directory::{DirectoryConfig, EvictionConfig};
        use std::time::Duration;
        let base = DirectoryConfig::default();
        DirectoryConfig {
            session_lease: Duration::from_millis(self.lease_ms),
            instance_grace: Duration::from_millis(self.grace_ms),
            max_instance_quota_bytes: (self.quota_bytes > 0).then_some(self.quota_bytes),
            eviction: EvictionConfig {
                orphans: self.orphan_eviction,
                pool_high_watermark: self.high_watermark,
                pool_low_watermark: self.low_watermark,
                lru: self.lru,
                lru_high_fill: self.lru_high_fill,
                lru_low_fill: self.lru_low_fill,
                max_evictions_per_tick: self.max_evictions_per_tick,
            },
            long_held_pin: Duration::from_millis(self.long_pin_ms),
            max_batch: self.max_batch,
            max_pins_per_call: self.max_pins_per_call,
            max_keys: self.max_keys,
            max_sessions: self.max_sessions,
            max_sessions_per_instance: self.max_sessions_per_instance,
            max_instances: self.max_instances,
            max_layouts: self.max_layouts,
            max_pinned_keys_per_session: self.max_pinned_keys_per_session,
            max_pinned_entries: self.max_pinned_entries,
            reply_window: self.reply_window,
            reply_cache_bytes_per_instance: usize::try_from(self.reply_cache_bytes)
                .unwrap_or(usize::MAX),
            max_region_bytes: self.max_region_bytes,
            ..base
        }
    }
}

impl Config {
    /// `cxlkv serve`'s server configuration: `[server]` and `[directory]`,
    /// and the embedded pool manager from `[pool]` (or the daemon named by
    /// `[server] pool_daemon`), every default filled in.
    pub fn server_config(&self) -> Result<crate::server::ServerConfig, ConfigError> {
        use crate::server::{PoolManagerConfig, ServerConfig};
        use cxlkv_controlplane::pool::service::RemoteConfig;
        use cxlkv_controlplane::transport::Endpoint;
        let invalid = |key: &'static str, reason: String| ConfigError::Value {
            section: "server",
            key,
            reason,
        };
        let s = &self.server;
        let mut c = ServerConfig::default();
        if let Some(p) = &s.socket {
            c.socket_path = p.clone();
        }
        if let Some(mode) = s.socket_mode {
            c.socket_mode = mode;
        }
        c.tcp_listen = match &s.tcp {
            None => None,
            Some(t) => Some(host_port(t).map_err(|r| invalid("tcp", r))?),
        };
        c.metrics_listen = match &s.metrics_addr {
            None => None,
            Some(a) => Some(host_port(a).map_err(|r| invalid("metrics_addr", r))?),
        };
        if s.tcp_insecure && s.tcp_secret_file.is_some() {
            return Err(invalid("tcp_insecure", SECRET_AND_INSECURE.into()));
        }
        c.tcp_secret = match &s.tcp_secret_file {
            Some(path) => Some(read_secret(path).map_err(|r| invalid("tcp_secret_file", r))?),
            None => None,
        };
        c.tcp_insecure_no_secret = s.tcp_insecure;
        if c.tcp_listen.is_some() && c.tcp_secret.is_none() && !s.tcp_insecure {
            return Err(invalid(
                "tcp",
                "a TCP listener needs tcp_secret_file (or tcp_insecure = true on a trusted network)"
                    .into(),
            ));
        }
        c.max_connections = s.max_connections;
        let hello = crate::server::HELLO_TIMEOUT_MS_RANGE;
        if !hello.contains(&s.hello_timeout_ms) {
            return Err(invalid(
                "hello_timeout_ms",
                format!(
                    "{} is not in {}..={}",
                    s.hello_timeout_ms,
                    hello.start(),
                    hello.end()
                ),
            ));
        }
        c.hello_timeout_ms = s.hello_timeout_ms;
        let t = self.transport.server_config()?;
        c.io = t.io;
        c.max_inflight_per_conn = t.max_inflight_per_conn;
        c.max_send_queue_bytes = t.max_send_queue_bytes;
        c.partial_frame_timeout_ms = t.partial_frame_timeout_ms;
        c.directory_id = s.directory_id.clone();
        c.default_region_bytes = s.default_region_bytes;
        c.tick_ms = s.tick_ms;
        c.directory = self.directory.directory_config();
        c.pool_manager = Some(match &s.pool_daemon {
            None => {
                let resolved = self.pool.resolve_embedded()?;
                // What the embedded pool manager will open, also in the
                // fields that describe the embedded pool without one, so
                // that no field names a pool that is not used.
                let first = &resolved.service.pools[0];
                c.pool_path = first.path.clone();
                if let Some(size) = first.create_size_bytes {
                    c.pool_size_bytes = size;
                }
                PoolManagerConfig::Embedded(resolved.service)
            }
            Some(ep) => {
                let endpoint = parse_endpoint(ep).map_err(|r| invalid("pool_daemon", r))?;
                if self.pool != PoolConfig::default() {
                    // A file shared with the daemon holds them: not an
                    // error, but nothing here uses them.
                    tracing::warn!(
                        pool_daemon = %ep,
                        "[pool] keys are set but unused: the pool daemon's pools are served"
                    );
                }
                let mut remote = RemoteConfig::new(endpoint, s.directory_id.clone());
                remote.secret = match &s.pool_daemon_secret_file {
                    Some(path) => {
                        Some(read_secret(path).map_err(|r| invalid("pool_daemon_secret_file", r))?)
                    }
                    None => None,
                };
                if matches!(remote.endpoint, Endpoint::Tcp(_)) && remote.secret.is_none() {
                    tracing::warn!(
                        "pool daemon over TCP without a secret: it must run with tcp_insecure"
                    );
                }
                PoolManagerConfig::Remote(remote)
            }
        });
        Ok(c)
    }
}

/// `unix:PATH` or `tcp:HOST:PORT` (a bare path is a Unix socket).
fn parse_endpoint(s: &str) -> Result<cxlkv_controlplane::transport::Endpoint, String> {
    use cxlkv_controlplane::transport::Endpoint;
    if let Some(addr) = s.strip_prefix("tcp:") {
        return host_port(addr)
            .map(Endpoint::Tcp)
            .map_err(|r| format!("{s:?}: {r}"));
    }
    let path = s.strip_prefix("unix:").unwrap_or(s);
    if path.is_empty() {
        return Err(format!("{s:?}: empty socket path"));
    }
    Ok(Endpoint::Unix(PathBuf::from(path)))
}

/// `HOST:PORT` as a socket address: an IP address (`127.0.0.1:7411`,
/// `[::1]:7411`) as it is, a host name (`localhost:7411`) resolved once,
/// now, to its first address. (Also how the C API reads `tcp_addr`.)
pub fn host_port(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let mut addrs = s
        .to_socket_addrs()
        .map_err(|e| format!("{s:?} is not host:port, or the host does not resolve ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| format!("{s:?}: the host resolves to no address"))
}

/// A file mode: a string of one to four octal digits, optionally after
/// `0o` (`"0660"`, `"660"`, `"0o660"`). Integers are refused: `660` in TOML
/// is decimal (0o1224), and `440` would silently mean 0o670.
fn de_opt_mode<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Number(i64),
    }
    let text = match Option::<Raw>::deserialize(d)? {
        None => return Ok(None),
        Some(Raw::Number(n)) => {
            return Err(serde::de::Error::custom(format!(
                "a mode is a string of octal digits (\"0660\"), not the integer {n}"
            )));
        }
        Some(Raw::Text(t)) => t,
    };
    parse_mode(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn parse_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b))
    {
        return Err(format!(
            "{text:?} is not a mode: one to four octal digits, e.g. \"0660\""
        ));
    }
    let mode = u32::from_str_radix(digits, 8).map_err(|e| format!("{text:?}: {e}"))?;
    if mode & !0o777 != 0 {
        return Err(format!(
            "{text:?} sets bits beyond the permission bits (setuid, setgid, sticky)"
        ));
    }
    Ok(mode)
}

fn de_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    de_opt_bytes(d)?.ok_or_else(|| serde::de::Error::custom("a byte count is required"))
}

/// One pool of `[pool] pools`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolEntry {
    pub path: PathBuf,
    /// For a file: created (0600) at this size if missing (or holding no
    /// pool yet); an initialised pool is never resized, a larger size is
    /// refused. For a device: its minimum size.
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub size_bytes: Option<u64>,
    /// Region alignment (default 2 MiB).
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub align_bytes: Option<u64>,
    /// `coherent` or `flush`; default `flush` for devices, `coherent` for files.
    #[serde(default)]
    pub visibility: Option<VisibilityName>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    PerRecord,
    Group,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VisibilityName {
    Coherent,
    Flush,
}

/// An integer, or a string with a binary suffix (anything else is refused
/// with a message saying so, not serde's "did not match any variant").
#[derive(Deserialize)]
#[serde(untagged)]
enum Bytes {
    Int(u64),
    Text(String),
    Other(toml::Value),
}

fn de_opt_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Bytes>::deserialize(d)? {
        None => Ok(None),
        Some(Bytes::Int(n)) => Ok(Some(n)),
        Some(Bytes::Text(s)) => parse_bytes(&s).map(Some).map_err(serde::de::Error::custom),
        Some(Bytes::Other(v)) => Err(serde::de::Error::custom(format!(
            "{v} is not a byte count: a non-negative integer or a string such as \"64MiB\""
        ))),
    }
}

/// Parses `123`, `4KiB`, `64MiB`, `2GiB`, `1TiB` (also `K`, `M`, `G`, `T`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 4096, 64MiB, 2GiB)"))?;
    let shift = match suffix.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        other => {
            return Err(format!(
                "unknown size suffix {other:?} in {s:?} (use KiB, MiB, GiB, TiB)"
            ));
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))
}

/// Reads variable `section.key`'s value as a TOML value if it is one, else
/// a string — and as a string when the key takes one, whatever it looks
/// like (`CXLKV_SERVER_DIRECTORY_ID=7` is the id `"7"`, not an integer the
/// key would refuse): the typed value is tried against the key alone, and
/// the raw text is used if only it fits.
fn env_value(section: &str, key: &str, raw: &str) -> toml::Value {
    let raw_string = || toml::Value::String(raw.to_owned());
    let typed = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(raw_string),
        Err(_) => return raw_string(),
    };
    if typed.is_str() {
        return typed;
    }
    let fits = |v: toml::Value| {
        let mut keys = toml::Table::new();
        keys.insert(key.to_owned(), v);
        let mut t = toml::Table::new();
        t.insert(section.to_owned(), toml::Value::Table(keys));
        t.try_into::<Config>().is_ok()
    };
    if !fits(typed.clone()) && fits(raw_string()) {
        raw_string()
    } else {
        typed
    }
}

fn section_mut<'a>(
    table: &'a mut toml::Table,
    section: &str,
    origin: &str,
) -> Result<&'a mut toml::Table, ConfigError> {
    match table
        .entry(section.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
    {
        toml::Value::Table(t) => Ok(t),
        _ => Err(ConfigError::NotATable {
            origin: origin.to_owned(),
            section: section.to_owned(),
        }),
    }
}

/// Loads the configuration: `file` (if any), then the `CXLKV_*` variables
/// of `env`, then `flags`, then the defaults for whatever is left.
pub fn load(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    flags: &[Override],
) -> Result<Config, ConfigError> {
    let mut table = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
                path: path.to_path_buf(),
                error,
            })?;
            toml::from_str::<toml::Table>(&text).map_err(|error| ConfigError::Parse {
                path: path.to_path_buf(),
                error: Box::new(error),
            })?
        }
        None => toml::Table::new(),
    };
    // (section, key, where it was set), in the order applied: an invalid
    // key's error says where to look for it.
    let mut origins: Vec<(String, String, String)> = Vec::new();
    if let Some(path) = file {
        let origin = format!("file {}", path.display());
        for (section, value) in &table {
            match value {
                toml::Value::Table(keys) => origins.extend(
                    keys.keys()
                        .map(|k| (section.clone(), k.clone(), origin.clone())),
                ),
                _ => origins.push((section.clone(), String::new(), origin.clone())),
            }
        }
    }
    let mut vars: Vec<(String, String)> = env.into_iter().collect();
    // Deterministic order (the process environment has none).
    vars.sort();
    for (name, raw) in vars {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        for section in SECTIONS {
            let prefix = format!("{}_", section.to_ascii_uppercase());
            if let Some(key) = rest.strip_prefix(&prefix) {
                if raw.is_empty() {
                    // Set but empty (`CXLKV_SERVER_TCP=`): unset, as a
                    // shell user means it.
                    continue;
                }
                let origin = format!("environment variable {name}");
                let key = key.to_ascii_lowercase();
                let value = env_value(section, &key, &raw);
                section_mut(&mut table, section, &origin)?.insert(key.clone(), value);
                origins.push(((*section).to_owned(), key, origin));
            }
        }
    }
    for o in flags {
        section_mut(&mut table, o.section, "flag")?.insert(o.key.to_owned(), o.value.clone());
        origins.push((o.section.to_owned(), o.key.to_owned(), "a flag".to_owned()));
    }
    table
        .try_into::<Config>()
        .map_err(|error| ConfigError::Invalid {
            origin: origin_of(&origins, &error),
            error: Box::new(error),
        })
}

/// Loads from the process: `--config` (else `$CXLKV_CONFIG`), the process
/// environment, and the flags.
pub fn load_from_process(
    config_file: Option<&Path>,
    flags: &[Override],
) -> Result<Config, ConfigError> {
    let from_env = std::env::var_os(CONFIG_ENV).map(PathBuf::from);
    let file = config_file.map(Path::to_path_buf).or(from_env);
    let env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    load(file.as_deref(), env, flags)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The pool service's configuration and where the daemon listens, with
/// every default filled in.
#[derive(Debug, Clone)]
pub struct ResolvedPool {
    pub service: ServiceConfig,
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
}

impl PoolConfig {
    /// Fills in the defaults:
    ///
    /// - pools: the embedded default, `/dev/shm/cxlkv.pool`, 2 GiB, created
    ///   on demand;
    /// - state directory: for a first pool under `/dev/shm`, next to it
    ///   (`<pool path>.state`) — the pool is RAM, so is its state, and a
    ///   reboot loses both together; otherwise `/var/lib/cxlkv/pool` as root,
    ///   or `$XDG_STATE_HOME/cxlkv/pool` (`~/.local/state/cxlkv/pool`);
    /// - socket: `/run/cxlkv/pool.sock` as root, else
    ///   `$XDG_RUNTIME_DIR/cxlkv/pool.sock`, else `/tmp/cxlkv-<uid>/pool.sock`.
    pub fn resolve(&self) -> Result<ResolvedPool, ConfigError> {
        let invalid = |key: &'static str, reason: String| ConfigError::Value {
            section: "pool",
            key,
            reason,
        };
        let pools: Vec<PoolSpec> = if self.pools.is_empty() {
            vec![PoolSpec {
                path: Path::new(DEFAULT_POOL_DIR).join(DEFAULT_POOL_FILE),
                create_size_bytes: Some(DEFAULT_POOL_SIZE_BYTES),
                align_bytes: None,
                visibility: None,
            }]
        } else {
            self.pools
                .iter()
                .map(|p| PoolSpec {
                    path: p.path.clone(),
                    create_size_bytes: p.size_bytes,
                    align_bytes: p.align_bytes,
                    visibility: p.visibility.map(|v| match v {
                        VisibilityName::Coherent => Visibility::Coherent,
                        VisibilityName::Flush => Visibility::Flush,
                    }),
                })
                .collect()
        };
        for p in &pools {
            if let Some(align) = p.align_bytes {
                check_pool_alignment(align).map_err(|r| {
                    invalid(
                        "pools",
                        format!("pool {}: align_bytes {r}", p.path.display()),
                    )
                })?;
            }
        }
        let state_dir = match &self.state_dir {
            Some(d) => d.clone(),
            None => default_state_dir(&pools[0].path),
        };
        check_state_dir_location(&state_dir).map_err(|r| invalid("state_dir", r))?;
        let sync = match self.sync {
            SyncMode::PerRecord => SyncPolicy::PerRecord,
            SyncMode::Group => {
                if !(1..=MAX_GROUP_RECORDS).contains(&self.group_max_records) {
                    return Err(invalid(
                        "group_max_records",
                        format!(
                            "{} is not in 1..={MAX_GROUP_RECORDS}",
                            self.group_max_records
                        ),
                    ));
                }
                SyncPolicy::Group {
                    max_batch_records: self.group_max_records,
                }
            }
        };
        let tcp = match &self.tcp {
            None => None,
            Some(s) => Some(host_port(s).map_err(|r| invalid("tcp", r))?),
        };
        let tcp_auth = match (&tcp, &self.tcp_secret_file, self.tcp_insecure) {
            (_, Some(_), true) => {
                return Err(invalid("tcp_insecure", SECRET_AND_INSECURE.into()));
            }
            (_, Some(path), false) => {
                TcpAuth::Secret(read_secret(path).map_err(|r| invalid("tcp_secret_file", r))?)
            }
            (Some(_), None, false) => {
                return Err(invalid(
                    "tcp",
                    "a TCP listener needs tcp_secret_file (or tcp_insecure = true on a trusted network)".into(),
                ));
            }
            _ => TcpAuth::Disabled,
        };
        Ok(ResolvedPool {
            service: ServiceConfig {
                pools,
                state_dir,
                store: StoreConfig {
                    sync,
                    checkpoint_every_records: self.checkpoint_every_records,
                },
                grace_ms: self.grace_ms,
                lease_ms: self.lease_ms,
                pass_fds: self.pass_fds,
                tcp_auth,
                io_faults: Default::default(),
            },
            socket: self.socket.clone().unwrap_or_else(default_socket),
            tcp,
        })
    }

    /// [`resolve`](Self::resolve) for the pool manager `cxlkv serve`
    /// embeds. It has no listener of its own, so `socket`, `tcp`,
    /// `tcp_secret_file` and `tcp_insecure` do not apply: they are neither
    /// checked nor read (a file shared with a `cxlkv pool` daemon, or a
    /// secret only the daemon's user can read, does not stop `serve`), and
    /// a warning names those that are set.
    pub fn resolve_embedded(&self) -> Result<ResolvedPool, ConfigError> {
        let ignored: Vec<&str> = [
            ("socket", self.socket.is_some()),
            ("tcp", self.tcp.is_some()),
            ("tcp_secret_file", self.tcp_secret_file.is_some()),
            ("tcp_insecure", self.tcp_insecure),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect();
        if !ignored.is_empty() {
            tracing::warn!(
                keys = %ignored.join(", "),
                "[pool] keys of the pool daemon's listener are ignored: the pool manager \
                 embedded in `cxlkv serve` does not listen"
            );
        }
        PoolConfig {
            socket: None,
            tcp: None,
            tcp_secret_file: None,
            tcp_insecure: false,
            ..self.clone()
        }
        .resolve()
    }
}

/// The pool manager's state directory when none is configured, for a first
/// pool at `first_pool`: the one rule of every embedded pool manager
/// (`cxlkv pool`, `cxlkv serve`, [`crate::server::Server::start`] without
/// `pool_manager`, `cxlkv demo`).
///
/// - A pool under `/dev/shm`: next to it, `<pool path>.state` — the pool is
///   RAM, so is its state, and a reboot loses both together.
/// - Anything else — a device (`/dev/daxX.Y`: its directory is devtmpfs,
///   RAM that a reboot empties while the device keeps its regions, and
///   root's to write), a hugetlbfs mount, a file on disk: the host's
///   [`host_state_dir`].
pub fn default_state_dir(first_pool: &Path) -> PathBuf {
    if is_under_dev_shm(first_pool) {
        let mut s = first_pool.as_os_str().to_owned();
        s.push(".state");
        return PathBuf::from(s);
    }
    host_state_dir()
}

/// The host's pool-manager state directory: `/var/lib/cxlkv/pool` as root,
/// else `$XDG_STATE_HOME/cxlkv/pool` (`~/.local/state/cxlkv/pool`). Shared
/// by every pool manager of the user, so never removed with a pool.
pub fn host_state_dir() -> PathBuf {
    if is_root() {
        return PathBuf::from("/var/lib/cxlkv/pool");
    }
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/state")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("cxlkv/pool")
}

/// Refuses a state directory under `/dev` other than `/dev/shm`: `/dev` is
/// devtmpfs (RAM: the journal would be lost at reboot while a device pool
/// keeps its regions) and the kernel's, not a place to create directories.
/// The check is on the path as written (`..` counts as leaving `/dev/shm`).
pub fn check_state_dir_location(dir: &Path) -> Result<(), String> {
    if dir.starts_with("/dev") && !is_under_dev_shm(dir) {
        return Err(format!(
            "state directory {} is under /dev (devtmpfs: lost at reboot; only /dev/shm is for files): \
             set one on a persistent file system, e.g. {}",
            dir.display(),
            host_state_dir().display()
        ));
    }
    Ok(())
}

/// Refuses a pool alignment the pool manager would refuse when it opens the
/// pool (a power of two from 4 KiB to 1 GiB), so that `--print-config`
/// says so and a start fails before it creates any file.
pub fn check_pool_alignment(align_bytes: u64) -> Result<(), String> {
    use cxlkv_controlplane::pool::ledger::{MAX_ALIGNMENT_BYTES, MIN_ALIGNMENT_BYTES};
    if align_bytes.is_power_of_two()
        && (MIN_ALIGNMENT_BYTES..=MAX_ALIGNMENT_BYTES).contains(&align_bytes)
    {
        return Ok(());
    }
    Err(format!(
        "= {align_bytes} is not a power of two from {MIN_ALIGNMENT_BYTES} (4 KiB) to \
         {MAX_ALIGNMENT_BYTES} (1 GiB): e.g. 2MiB, the default"
    ))
}

/// The longest Unix socket path `bind` and `connect` take: `sockaddr_un`'s
/// `sun_path` less its terminating NUL.
pub const MAX_UNIX_SOCKET_PATH_BYTES: usize = 107;

/// Refuses a Unix socket path that `sockaddr_un` cannot hold (or with a
/// NUL byte), naming its length and the limit: the listener would fail to
/// bind only once the pool had been opened.
pub fn check_unix_socket_path(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    if bytes.contains(&0) {
        return Err(format!("{} has a NUL byte", path.display()));
    }
    if bytes.len() > MAX_UNIX_SOCKET_PATH_BYTES {
        return Err(format!(
            "{} is {} bytes, longer than a Unix socket path can be \
             ({MAX_UNIX_SOCKET_PATH_BYTES} bytes: sockaddr_un's sun_path): choose a shorter path",
            path.display(),
            bytes.len()
        ));
    }
    Ok(())
}

/// `path` is under [`DEFAULT_POOL_DIR`] (`/dev/shm`) with no `..` in it.
fn is_under_dev_shm(path: &Path) -> bool {
    path.starts_with(DEFAULT_POOL_DIR)
        && !path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
}

fn default_socket() -> PathBuf {
    crate::server::runtime_socket_path("pool.sock")
}

/// Reads a secret file: at most 256 bytes, not readable by group or others;
/// one trailing newline is not part of the secret.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} has mode {mode:o}: readable by group or others; chmod 600 it",
            path.display()
        ));
    }
    let mut bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
    }
    if bytes.is_empty() || bytes.len() > cxlkv_controlplane::proto::MAX_SECRET_BYTES {
        return Err(format!(
            "{} holds {} bytes; a secret is 1..={} bytes",
            path.display(),
            bytes.len(),
            cxlkv_controlplane::proto::MAX_SECRET_BYTES
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn flags_beat_environment_beat_file_beat_defaults() {
        let f = file("[pool]\ngrace_ms = 1\nlease_ms = 2000\ncheckpoint_every_records = 7\n");
        let vars = env(&[
            ("CXLKV_POOL_GRACE_MS", "5"),
            ("CXLKV_POOL_LEASE_MS", "3000"),
        ]);
        let flags = [Override::new("pool", "grace_ms", 9i64)];
        let c = load(Some(f.path()), vars, &flags).unwrap();
        assert_eq!(c.pool.grace_ms, 9, "flag wins");
        assert_eq!(c.pool.lease_ms, 3000, "environment beats the file");
        assert_eq!(c.pool.checkpoint_every_records, 7, "file beats the default");
        assert_eq!(c.pool.group_max_records, 256, "default");
    }

    #[test]
    fn environment_values_are_toml_when_they_parse_and_strings_otherwise() {
        let vars = env(&[
            ("CXLKV_POOL_SYNC", "group"),
            ("CXLKV_POOL_STATE_DIR", "/tmp/x y"),
            ("CXLKV_POOL_PASS_FDS", "false"),
            (
                "CXLKV_POOL_POOLS",
                r#"[{path = "/dev/shm/a", size_bytes = "64MiB", align_bytes = 4096}]"#,
            ),
            ("CXLKV_LOG", "debug"),
            ("CXLKV_IO", "fallback"),
        ]);
        let c = load(None, vars, &[]).unwrap();
        assert_eq!(c.pool.sync, SyncMode::Group);
        assert_eq!(c.pool.state_dir.as_deref(), Some(Path::new("/tmp/x y")));
        assert!(!c.pool.pass_fds);
        assert_eq!(c.pool.pools[0].size_bytes, Some(64 << 20));
        assert_eq!(c.pool.pools[0].align_bytes, Some(4096));
    }

    #[test]
    fn unknown_keys_are_refused_wherever_they_come_from() {
        let e = load(None, env(&[("CXLKV_POOL_GRACE", "1")]), &[]).unwrap_err();
        assert!(e.to_string().contains("grace"), "{e}");
        let f = file("[pool]\nstate_dri = \"/x\"\n");
        let e = load(Some(f.path()), Vec::new(), &[]).unwrap_err();
        assert!(e.to_string().contains("state_dri"), "{e}");
        let f = file("[pol]\n");
        assert!(load(Some(f.path()), Vec::new(), &[]).is_err());
    }

    #[test]
    fn an_invalid_key_says_where_it_was_set() {
        let f = file("[server]\ntick_ms = \"fast\"\n[directory]\nlease_ms = 5000\n");
        let at_file = format!("(from file {})", f.path().display());
        let e = load(Some(f.path()), env(&[]), &[]).unwrap_err().to_string();
        assert!(e.contains(&at_file) && e.contains("tick_ms"), "{e}");
        // The environment's value replaces the file's: the error is the
        // variable's, and a good variable mends a bad file.
        let vars = env(&[("CXLKV_SERVER_TICK_MS", "soon")]);
        let e = load(Some(f.path()), vars, &[]).unwrap_err().to_string();
        assert!(
            e.contains("(from environment variable CXLKV_SERVER_TICK_MS)"),
            "{e}"
        );
        let vars = env(&[("CXLKV_SERVER_TICK_MS", "50")]);
        assert_eq!(load(Some(f.path()), vars, &[]).unwrap().server.tick_ms, 50);
        // An unknown key from each source.
        let vars = env(&[("CXLKV_DIRECTORY_LEASEMS", "1")]);
        let e = load(None, vars, &[]).unwrap_err().to_string();
        assert!(
            e.contains("(from environment variable CXLKV_DIRECTORY_LEASEMS)")
                && e.contains("leasems"),
            "{e}"
        );
        let flags = [Override::new("directory", "lease", 1i64)];
        let e = load(Some(f.path()), env(&[]), &flags)
            .unwrap_err()
            .to_string();
        assert!(e.contains("(from a flag)") && e.contains("lease"), "{e}");
        let f = file("[servr]\ntick_ms = 5\n");
        let e = load(Some(f.path()), env(&[]), &[]).unwrap_err().to_string();
        let at_file = format!("(from file {})", f.path().display());
        assert!(e.contains(&at_file) && e.contains("servr"), "{e}");
        let f = file("tick_ms = 5\n");
        let e = load(Some(f.path()), env(&[]), &[]).unwrap_err().to_string();
        let at_file = format!("(from file {})", f.path().display());
        assert!(e.contains(&at_file) && e.contains("tick_ms"), "{e}");
    }

    #[test]
    fn a_configuration_file_that_cannot_be_read_or_parsed_says_why_once() {
        // `cxlkv` prints an error with its causes (`{:#}`): each once.
        let e = load(Some(Path::new("/nonexistent/cxlkv.toml")), env(&[]), &[]).unwrap_err();
        let text = format!("{:#}", anyhow::Error::from(e));
        assert_eq!(
            text.matches("No such file or directory").count(),
            1,
            "{text}"
        );
        assert!(text.contains("/nonexistent/cxlkv.toml"), "{text}");
        let f = file("[server\n");
        let e = load(Some(f.path()), env(&[]), &[]).unwrap_err();
        let text = format!("{:#}", anyhow::Error::from(e));
        assert_eq!(text.matches("unclosed table").count(), 1, "{text}");
    }

    #[test]
    fn defaults_resolve_to_the_embedded_pool_with_its_state_next_to_it() {
        let r = PoolConfig::default().resolve().unwrap();
        assert_eq!(r.service.pools.len(), 1);
        assert_eq!(r.service.pools[0].path, Path::new("/dev/shm/cxlkv.pool"));
        assert_eq!(r.service.pools[0].create_size_bytes, Some(2 << 30));
        assert_eq!(r.service.state_dir, Path::new("/dev/shm/cxlkv.pool.state"));
        assert_eq!(r.service.store.sync, SyncPolicy::PerRecord);
        assert!(r.socket.ends_with("pool.sock"));
        assert!(r.tcp.is_none());
    }

    #[test]
    fn tcp_without_a_secret_is_refused_unless_insecure_is_chosen() {
        let mut p = PoolConfig {
            tcp: Some("127.0.0.1:0".into()),
            ..PoolConfig::default()
        };
        assert!(
            p.resolve()
                .unwrap_err()
                .to_string()
                .contains("tcp_secret_file")
        );
        p.tcp_insecure = true;
        assert_eq!(p.resolve().unwrap().service.tcp_auth, TcpAuth::Disabled);
    }

    #[test]
    fn receive_buffers_are_bounded_together_as_the_server_binds_them() {
        let c = load(
            None,
            env(&[
                ("CXLKV_TRANSPORT_RECV_BUFFER_BYTES", "16MiB"),
                ("CXLKV_TRANSPORT_RECV_BUFFER_COUNT", "32"),
            ]),
            &[],
        )
        .unwrap();
        let e = c.server_config().unwrap_err().to_string();
        assert!(e.contains("256 MiB"), "{e}");
    }

    #[test]
    fn an_environment_value_for_a_string_key_stays_a_string_and_an_empty_one_is_unset() {
        let c = load(
            None,
            env(&[
                ("CXLKV_SERVER_DIRECTORY_ID", "7"),
                ("CXLKV_SERVER_TCP", ""),
                ("CXLKV_POOL_STATE_DIR", "true"),
                ("CXLKV_SERVER_TICK_MS", "9"),
            ]),
            &[],
        )
        .unwrap();
        assert_eq!(c.server.directory_id, "7");
        assert_eq!(c.server.tcp, None, "empty: unset");
        assert_eq!(c.pool.state_dir.as_deref(), Some(Path::new("true")));
        assert_eq!(c.server.tick_ms, 9, "numbers stay numbers");
        // A value no type of the key takes is still refused, naming it.
        let e = load(None, env(&[("CXLKV_SERVER_TICK_MS", "soon")]), &[]).unwrap_err();
        assert!(e.to_string().contains("tick_ms"), "{e}");
    }

    #[test]
    fn the_socket_mode_is_octal_text_from_the_file_or_the_environment_and_integers_are_refused() {
        let f = file("[server]\nsocket_mode = \"0640\"\n");
        let c = load(Some(f.path()), env(&[]), &[]).unwrap();
        assert_eq!(c.server_config().unwrap().socket_mode, 0o640);
        let c = load(
            Some(f.path()),
            env(&[("CXLKV_SERVER_SOCKET_MODE", "600")]),
            &[],
        )
        .unwrap();
        assert_eq!(
            c.server_config().unwrap().socket_mode,
            0o600,
            "octal digits, not the decimal 600"
        );
        let c = load(None, env(&[]), &[]).unwrap();
        assert_eq!(c.server_config().unwrap().socket_mode, 0o660, "default");
        for (text, says) in [
            ("socket_mode = 440", "not the integer 440"),
            ("socket_mode = \"0980\"", "not a mode"),
            ("socket_mode = \"\"", "not a mode"),
            ("socket_mode = \"4660\"", "beyond the permission bits"),
        ] {
            let f = file(&format!("[server]\n{text}\n"));
            let e = load(Some(f.path()), env(&[]), &[]).unwrap_err();
            let chain = format!("{e} {:?}", e);
            assert!(chain.contains(says), "{text}: {chain}");
        }
    }

    #[test]
    fn server_and_directory_sections_follow_the_same_precedence() {
        let f = file(
            "[server]\nsocket = \"/tmp/from-file.sock\"\ntick_ms = 7\n\n[directory]\nlease_ms = 1000\nquota_bytes = \"1GiB\"\nlru = true\n",
        );
        let vars = env(&[
            ("CXLKV_SERVER_TICK_MS", "9"),
            ("CXLKV_DIRECTORY_LEASE_MS", "2000"),
        ]);
        let flags = [Override::new("directory", "lease_ms", 3000i64)];
        let c = load(Some(f.path()), vars, &flags).unwrap();
        assert_eq!(c.directory.lease_ms, 3000, "flag wins");
        assert_eq!(c.server.tick_ms, 9, "environment beats the file");
        assert_eq!(
            c.server.socket.as_deref(),
            Some(Path::new("/tmp/from-file.sock"))
        );
        assert_eq!(c.directory.quota_bytes, 1 << 30);
        let s = c.server_config().unwrap();
        assert_eq!(s.tick_ms, 9);
        assert_eq!(s.directory.session_lease, std::time::Duration::from_secs(3));
        assert_eq!(s.directory.max_instance_quota_bytes, Some(1 << 30));
        assert!(s.directory.eviction.lru);
        assert_eq!(s.socket_path, Path::new("/tmp/from-file.sock"));
    }

    /// Found by a review of the directory: the pin limits and the sessions
    /// per instance could not be set from the configuration, and there was
    /// no directory-wide pin limit to set.
    #[test]
    fn the_directorys_pin_session_and_layout_limits_are_configurable_and_checked() {
        let f = file(
            "[directory]\nmax_pinned_keys_per_session = 1000\nmax_pinned_entries = 5000\nmax_sessions_per_instance = 3\nmax_layouts = 7\n",
        );
        let vars = env(&[("CXLKV_DIRECTORY_MAX_PINNED_ENTRIES", "6000")]);
        let c = load(Some(f.path()), vars, &[]).unwrap();
        let s = c.server_config().unwrap();
        let d = &s.directory;
        assert_eq!(
            (
                d.max_pinned_keys_per_session,
                d.max_pinned_entries,
                d.max_sessions_per_instance,
                d.max_layouts
            ),
            (1000, 6000, 3, 7)
        );
        s.validate().unwrap();
        for (key, bad) in [
            ("max_pinned_entries", 0i64),
            ("max_pinned_keys_per_session", 0),
            ("max_sessions_per_instance", 0),
            ("max_layouts", 0),
        ] {
            let c = load(None, env(&[]), &[Override::new("directory", key, bad)]).unwrap();
            let e = c
                .server_config()
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        let defaults = cxlkv_controlplane::directory::DirectoryConfig::default();
        let s = Config::default().server_config().unwrap();
        assert_eq!(s.directory.max_pinned_entries, defaults.max_pinned_entries);
    }

    /// `[server] hello_timeout_ms` (found by a review of `src/server/`,
    /// session 25: a connection that never said `Hello` held its slot
    /// forever) is read from the file or the environment and bounded.
    #[test]
    fn the_hello_timeout_is_a_server_key_and_is_bounded() {
        let c = load(None, env(&[("CXLKV_SERVER_HELLO_TIMEOUT_MS", "2500")]), &[]).unwrap();
        assert_eq!(c.server_config().unwrap().hello_timeout_ms, 2500);
        for bad in [0i64, 99, 600_001] {
            let c = load(
                None,
                env(&[]),
                &[Override::new("server", "hello_timeout_ms", bad)],
            )
            .unwrap();
            let e = c.server_config().unwrap_err().to_string();
            assert!(
                e.contains("hello_timeout_ms") && e.contains("100..=600000"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn server_defaults_are_the_servers_defaults() {
        let s = Config::default().server_config().unwrap();
        let d = crate::server::ServerConfig::default();
        assert_eq!(s.socket_path, d.socket_path);
        assert_eq!(s.directory, d.directory);
        assert_eq!(s.pool_path, Path::new("/dev/shm/cxlkv.pool"));
        assert_eq!(s.max_connections, d.max_connections);
        assert_eq!(s.hello_timeout_ms, d.hello_timeout_ms);
        assert!(s.tcp_listen.is_none());
        let e = load(None, env(&[("CXLKV_DIRECTORY_LEASE", "1")]), &[]).unwrap_err();
        assert!(e.to_string().contains("lease"), "{e}");
    }

    #[test]
    fn a_server_tcp_listener_needs_a_secret_or_insecure() {
        let mut c = Config::default();
        c.server.tcp = Some("127.0.0.1:0".into());
        assert!(
            c.server_config()
                .unwrap_err()
                .to_string()
                .contains("tcp_secret_file")
        );
        c.server.tcp_insecure = true;
        assert!(c.server_config().unwrap().tcp_insecure_no_secret);
    }

    #[test]
    fn a_tcp_secret_file_and_tcp_insecure_together_are_refused() {
        let secret = file("s3cret-bytes");
        let mut c = Config::default();
        c.server.tcp = Some("127.0.0.1:0".into());
        c.server.tcp_secret_file = Some(secret.path().to_owned());
        c.server.tcp_insecure = true;
        let e = c.server_config().unwrap_err().to_string();
        assert!(e.contains("contradict"), "{e}");
        c.server.tcp_insecure = false;
        assert!(!c.server_config().unwrap().tcp_insecure_no_secret);
        let mut p = PoolConfig {
            tcp: Some("127.0.0.1:0".into()),
            tcp_secret_file: Some(secret.path().to_owned()),
            tcp_insecure: true,
            ..PoolConfig::default()
        };
        let e = p.resolve().unwrap_err().to_string();
        assert!(e.contains("contradict"), "{e}");
        p.tcp_insecure = false;
        assert!(matches!(
            p.resolve().unwrap().service.tcp_auth,
            TcpAuth::Secret(_)
        ));
    }

    #[test]
    fn the_pool_daemons_listener_keys_do_not_apply_to_the_embedded_pool_manager() {
        // Keys `cxlkv pool` would refuse: a bad address, a secret file that
        // does not exist, and both a secret and `tcp_insecure`.
        let mut c = Config::default();
        c.pool.socket = Some("/nonexistent/pool.sock".into());
        c.pool.tcp = Some("not an address".into());
        c.pool.tcp_secret_file = Some("/nonexistent/secret".into());
        c.pool.tcp_insecure = true;
        assert!(c.pool.resolve().is_err(), "the daemon checks them");
        let server = c.server_config().expect("serve does not read them");
        let Some(crate::server::PoolManagerConfig::Embedded(embedded)) = server.pool_manager else {
            panic!("the embedded pool manager");
        };
        assert!(matches!(embedded.tcp_auth, TcpAuth::Disabled));
        // What does apply still is checked.
        c.pool.group_max_records = 0;
        c.pool.sync = SyncMode::Group;
        let e = c.server_config().unwrap_err().to_string();
        assert!(e.contains("group_max_records"), "{e}");
    }

    #[test]
    fn a_printed_server_config_says_whether_a_secret_is_set_never_what_it_is() {
        let secret = file("s3cret-bytes");
        let mut c = Config::default();
        c.server.tcp = Some("127.0.0.1:0".into());
        let printed = |c: &Config| format!("{:#?}", c.server_config().unwrap());
        c.server.tcp_insecure = true;
        assert!(printed(&c).contains("tcp_secret: None"));
        c.server.tcp_insecure = false;
        c.server.tcp_secret_file = Some(secret.path().to_owned());
        let text = printed(&c);
        assert!(
            text.contains("tcp_secret: Some(\n        <redacted>,"),
            "{text}"
        );
        let bytes = format!("{:?}", b"s3cret-bytes".to_vec());
        let first = &bytes[..bytes.find(',').unwrap()];
        assert!(!text.contains("s3cret") && !text.contains(first), "{text}");
        // The other fields are still there.
        assert!(text.contains("tcp_listen: Some(") && text.contains("directory_id:"));
    }

    #[test]
    fn a_printed_server_config_shows_the_pool_size_that_will_be_created() {
        let f = file("[[pool.pools]]\npath = \"/dev/shm/other.pool\"\nsize_bytes = \"8GiB\"\n");
        let c = load(Some(f.path()), env(&[]), &[]).unwrap();
        let s = c.server_config().unwrap();
        assert_eq!(s.pool_path, Path::new("/dev/shm/other.pool"));
        assert_eq!(s.pool_size_bytes, 8 << 30);
        let Some(crate::server::PoolManagerConfig::Embedded(service)) = &s.pool_manager else {
            panic!("the embedded pool manager")
        };
        assert_eq!(service.pools[0].create_size_bytes, Some(8 << 30));
    }

    #[test]
    fn tcp_addresses_take_a_host_name_or_an_ip_address() {
        assert_eq!(
            host_port("127.0.0.1:7411").unwrap(),
            "127.0.0.1:7411".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            host_port("[::1]:7411").unwrap(),
            "[::1]:7411".parse::<SocketAddr>().unwrap()
        );
        let local = host_port("localhost:7411").unwrap();
        assert!(local.ip().is_loopback() && local.port() == 7411, "{local}");
        for bad in ["localhost", "7411", "localhost:port", ""] {
            assert!(host_port(bad).is_err(), "{bad:?}");
        }
        let mut c = Config::default();
        c.server.tcp = Some("localhost:0".into());
        c.server.tcp_insecure = true;
        assert!(
            c.server_config()
                .unwrap()
                .tcp_listen
                .unwrap()
                .ip()
                .is_loopback()
        );
        let e = parse_endpoint("tcp:localhost:7412").unwrap();
        assert!(matches!(e, cxlkv_controlplane::transport::Endpoint::Tcp(a) if a.port() == 7412));
    }

    #[test]
    fn the_metrics_address_follows_the_precedence_and_must_be_host_port() {
        let f = file("[server]\nmetrics_addr = \"127.0.0.1:1\"\n");
        let c = load(Some(f.path()), env(&[]), &[]).unwrap();
        assert_eq!(
            c.server_config().unwrap().metrics_listen,
            Some("127.0.0.1:1".parse().unwrap()),
            "file"
        );
        let vars = env(&[("CXLKV_SERVER_METRICS_ADDR", "127.0.0.1:2")]);
        let c = load(Some(f.path()), vars.clone(), &[]).unwrap();
        assert_eq!(c.server.metrics_addr.as_deref(), Some("127.0.0.1:2"), "env");
        let flags = [Override::new("server", "metrics_addr", "127.0.0.1:3")];
        let c = load(Some(f.path()), vars, &flags).unwrap();
        assert_eq!(
            c.server_config().unwrap().metrics_listen,
            Some("127.0.0.1:3".parse().unwrap()),
            "flag"
        );
        assert!(
            Config::default()
                .server_config()
                .unwrap()
                .metrics_listen
                .is_none()
        );
        let mut c = Config::default();
        c.server.metrics_addr = Some("localhost".into());
        let e = c.server_config().unwrap_err().to_string();
        assert!(e.contains("metrics_addr"), "{e}");
    }

    #[test]
    fn a_pool_daemon_endpoint_is_unix_or_tcp() {
        assert!(matches!(
            parse_endpoint("unix:/run/cxlkv/pool.sock"),
            Ok(cxlkv_controlplane::transport::Endpoint::Unix(_))
        ));
        assert!(matches!(
            parse_endpoint("tcp:10.0.0.1:7000"),
            Ok(cxlkv_controlplane::transport::Endpoint::Tcp(_))
        ));
        assert!(parse_endpoint("tcp:nowhere").is_err());
    }

    #[test]
    fn transport_keys_reach_both_servers_and_bad_values_name_their_key() {
        let f = file(
            "[transport]\nbackend = \"fallback\"\nspin_us = 50\ntaskrun = \"coop\"\nrecv = \"provided\"\nrecv_buffer_bytes = \"64KiB\"\n",
        );
        let c = load(
            Some(f.path()),
            env(&[("CXLKV_TRANSPORT_MAX_INFLIGHT_PER_CONN", "16")]),
            &[Override::new("transport", "partial_frame_timeout_ms", 500)],
        )
        .unwrap();
        let t = c.transport.server_config().unwrap();
        assert_eq!(
            t.io.backend,
            cxlkv_controlplane::transport::BackendChoice::Fallback
        );
        assert_eq!(t.io.taskrun, cxlkv_controlplane::transport::TaskRun::Coop);
        assert_eq!(t.io.recv, cxlkv_controlplane::transport::RecvMode::Provided);
        assert_eq!((t.io.spin_us, t.io.recv_buffer_bytes), (50, 64 << 10));
        assert_eq!(
            (t.max_inflight_per_conn, t.partial_frame_timeout_ms),
            (16, 500)
        );
        let server = c.server_config().unwrap();
        assert_eq!(server.io, t.io);
        assert_eq!(
            (
                server.max_inflight_per_conn,
                server.partial_frame_timeout_ms
            ),
            (16, 500)
        );
        // The defaults are the transport's own.
        let d = TransportSection::default().server_config().unwrap();
        let t0 = cxlkv_controlplane::transport::ServerConfig::default();
        assert_eq!(d.io, t0.io);
        assert_eq!(d.max_send_queue_bytes, t0.max_send_queue_bytes);
        for (key, value) in [
            ("backend", toml::Value::from("io_uring")),
            ("taskrun", toml::Value::from("sometimes")),
            ("recv", toml::Value::from("zero-copy")),
            ("recv_buffer_count", toml::Value::from(100)),
            ("recv_buffer_bytes", toml::Value::from(100)),
            ("max_send_queue_bytes", toml::Value::from(4096)),
            ("max_inflight_per_conn", toml::Value::from(0)),
        ] {
            let c = load(None, env(&[]), &[Override::new("transport", key, value)]).unwrap();
            let e = c.transport.server_config().unwrap_err().to_string();
            assert!(e.contains(&format!("[transport] {key}")), "{key}: {e}");
        }
    }

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("4KiB").unwrap(), 4096);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("3M").unwrap(), 3 << 20);
        assert!(parse_bytes("2GB").is_err());
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }

    /// Found by a review of the configuration (session 23): serde's "data
    /// did not match any variant of untagged enum Bytes" instead.
    #[test]
    fn a_byte_count_of_the_wrong_kind_is_refused_saying_what_a_byte_count_is() {
        for (text, shown) in [
            ("default_region_bytes = -5", "-5"),
            ("default_region_bytes = 1.5", "1.5"),
            ("default_region_bytes = true", "true"),
        ] {
            let f = file(&format!("[server]\n{text}\n"));
            let e = load(Some(f.path()), env(&[]), &[]).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{shown} is not a byte count")) && !e.contains("variant"),
                "{text}: {e}"
            );
        }
    }

    /// Every TOML example of docs/operations.md loads: its keys exist, in
    /// their sections, with values of their types (an operator copies them).
    #[test]
    fn the_operations_guides_toml_examples_load() {
        let doc = include_str!("../docs/operations.md");
        let mut examples = 0;
        for block in doc.split("```toml\n").skip(1) {
            let text = block.split("```").next().unwrap();
            let f = file(text);
            let c = load(Some(f.path()), env(&[]), &[])
                .unwrap_or_else(|e| panic!("{e}\nin the example:\n{text}"));
            assert_ne!(c, Config::default(), "the example sets something:\n{text}");
            examples += 1;
        }
        assert!(examples >= 2, "{examples} TOML examples");
    }

    fn leak(key: &str) -> &'static str {
        Box::leak(key.to_owned().into_boxed_str())
    }

    /// One row of a configuration table of docs/operations.md.
    struct DocRow {
        section: &'static str,
        key: String,
        flag: Option<String>,
        env: Option<String>,
        default: String,
    }

    /// The rows of the `[pool]`, `[server]`, `[directory]` and `[transport]`
    /// tables under "Configuration" (a row's first cell names its key; the
    /// columns are found by their headers).
    fn documented_keys() -> Vec<DocRow> {
        let doc = include_str!("../docs/operations.md");
        let mut rows = Vec::new();
        for section in SECTIONS {
            let heading = format!("### `[{section}]`");
            let at = doc.find(&heading).unwrap_or_else(|| panic!("no {heading}"));
            let mut lines = doc[at..].lines().skip_while(|l| !l.starts_with("| key |"));
            let header: Vec<&str> = lines.next().unwrap().split('|').map(str::trim).collect();
            let col = |name: &str| header.iter().position(|h| *h == name);
            let (flag, env, default) = (col("flag"), col("env"), col("default").unwrap());
            let ticked = |cell: &str| cell.split('`').nth(1).map(str::to_owned);
            for line in lines.skip(1).take_while(|l| l.starts_with('|')) {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                rows.push(DocRow {
                    section,
                    key: ticked(cells[1]).expect("a key"),
                    flag: flag
                        .and_then(|c| ticked(cells[c]))
                        .map(|f| f.split(' ').next().unwrap().to_owned()),
                    env: env.and_then(|c| ticked(cells[c])),
                    default: cells[default].to_owned(),
                });
            }
        }
        rows
    }

    /// The documented default as a value to set, or `None` for a default
    /// that is not a value (`see below`, `off`, `—`, `2 × max frame`).
    fn documented_default(text: &str) -> Option<toml::Value> {
        let text = text.split(" (").next().unwrap().replace('`', "");
        if text == "off" {
            return None;
        }
        if let Ok(mut t) = toml::from_str::<toml::Table>(&format!("v = {text}")) {
            return t.remove("v");
        }
        let (n, unit) = text.split_once(' ').unwrap_or((&text, ""));
        if n.parse::<u64>().is_ok() && ["KiB", "MiB", "GiB", "TiB"].contains(&unit) {
            return Some(toml::Value::String(format!("{n}{unit}")));
        }
        let word = |c: char| c.is_ascii_lowercase() || c == '-';
        (!text.is_empty() && text.chars().all(word)).then_some(toml::Value::String(text))
    }

    /// A configuration that starts as the defaults do: equal, or resolving
    /// to the same server and pool-manager configurations (`socket_mode =
    /// "0660"` is the default mode, spelt out).
    fn same_as_defaults(c: &Config) -> bool {
        let d = Config::default();
        c == &d
            || (format!("{:?}", c.server_config()) == format!("{:?}", d.server_config())
                && format!("{:?}", c.pool.resolve()) == format!("{:?}", d.pool.resolve()))
    }

    /// The flags of `cxlkv serve` and `cxlkv pool` (besides `--config` and
    /// `--print-config`), each with the one key it sets.
    fn flags_and_keys() -> Vec<(&'static str, String, Override)> {
        use clap::{Args, FromArgMatches};
        fn each<A: Args + FromArgMatches>(
            command: &'static str,
            overrides: impl Fn(&A) -> Vec<Override>,
        ) -> Vec<(&'static str, String, Override)> {
            let cmd = A::augment_args(clap::Command::new(command));
            let mut out = Vec::new();
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if ["config", "print-config"].contains(&long) {
                    continue;
                }
                let flag = format!("--{long}");
                let mut argv = vec![command.to_owned(), flag.clone()];
                if arg.get_action().takes_values() {
                    argv.push(if long == "sync" { "group" } else { "1" }.to_owned());
                }
                let matches = cmd.clone().try_get_matches_from(&argv).unwrap();
                let mut set = overrides(&A::from_arg_matches(&matches).unwrap());
                assert_eq!(set.len(), 1, "{command} {flag} sets one key");
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                let named = format!("`[{}] {}", set[0].section, set[0].key);
                assert!(
                    help.contains(&named),
                    "{command} {flag}'s help names {named}`: {help}"
                );
                out.push((command, flag, set.remove(0)));
            }
            out
        }
        let mut all = each("serve", |a: &crate::cli::serve::ServeArgs| {
            a.overrides().unwrap()
        });
        all.extend(each("pool", |a: &crate::cli::pool::PoolArgs| {
            a.overrides().unwrap()
        }));
        all
    }

    /// Every row of the configuration reference in docs/operations.md is a
    /// key of its section, with the environment variable, the flag and the
    /// default it documents, and the precedence holds for it: the
    /// environment's value beats the file's, the flag's beats the
    /// environment's. Every key and every flag is documented, and each
    /// flag's help names its key.
    #[test]
    fn the_configuration_reference_matches_every_key_flag_variable_and_default() {
        let rows = documented_keys();
        let bogus = || toml::Value::Table(toml::Table::new());
        let mut defaults_checked = 0;
        for row in &rows {
            let (section, key) = (row.section, row.key.as_str());
            if key.starts_with("pools[]") {
                continue; // the fields of a pool entry, in `pools`
            }
            let name = format!("[{section}] {key}");
            let variable = format!("CXLKV_{}_{}", section, key).to_ascii_uppercase();
            if let Some(env) = &row.env {
                assert_eq!(env, &variable, "{name}: its variable");
            }
            // The key exists: a value of the wrong type is refused, but not
            // as an unknown key.
            let e = load(
                None,
                env(&[]),
                &[Override::new(section, leak(key), bogus())],
            )
            .unwrap_err()
            .to_string();
            assert!(!e.contains("unknown field"), "{name}: {e}");
            if let Some(value) = documented_default(&row.default) {
                defaults_checked += 1;
                let flag = [Override::new(section, leak(key), value.clone())];
                let c = load(None, env(&[]), &flag).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(same_as_defaults(&c), "{name}: the default is not {value}");
                // The variable, over a file that sets the key wrong.
                let raw = match &value {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let f = file(&format!("[{section}]\n{key} = {{}}\n"));
                let c = load(Some(f.path()), env(&[(&variable, &raw)]), &[])
                    .unwrap_or_else(|e| panic!("{name}: {variable}={raw} over the file: {e}"));
                assert!(same_as_defaults(&c), "{name}: {variable}={raw}");
            }
        }
        assert!(
            defaults_checked >= 40,
            "{defaults_checked} defaults checked"
        );
        // Every key of every section has a row.
        for section in SECTIONS {
            let flag = [Override::new(section, "no_such_key", 1i64)];
            let e = load(None, env(&[]), &flag).unwrap_err().to_string();
            let listed = e.split("expected one of").nth(1).expect("the keys listed");
            let listed = listed.lines().next().unwrap_or_default();
            for key in listed.split('`').skip(1).step_by(2) {
                assert!(
                    rows.iter().any(|r| r.section == *section && r.key == key),
                    "[{section}] {key} is not in docs/operations.md"
                );
            }
        }
        // Every flag is its key's documented flag (`serve`'s `[pool]` flags
        // are `cxlkv pool`'s), and beats the environment.
        for (command, flag, set) in flags_and_keys() {
            let (section, key) = (set.section, set.key);
            let row = rows
                .iter()
                .find(|r| r.section == section && r.key == key)
                .unwrap_or_else(|| panic!("{command} {flag}: [{section}] {key} undocumented"));
            assert_eq!(
                row.flag.as_deref(),
                Some(flag.as_str()),
                "{command} {flag} sets [{section}] {key}"
            );
            // A variable of another value (a string key's "{}", any other
            // key's wrong type) loses to the flag.
            let variable = format!("CXLKV_{section}_{key}").to_ascii_uppercase();
            let alone = load(None, env(&[]), std::slice::from_ref(&set)).unwrap();
            let vars = env(&[(&variable, "{}")]);
            let both = load(None, vars.clone(), std::slice::from_ref(&set));
            assert_eq!(
                both.ok().as_ref(),
                Some(&alone),
                "{command} {flag} over {variable}"
            );
            assert_ne!(
                load(None, vars, &[]).ok().as_ref(),
                Some(&alone),
                "{variable}"
            );
        }
    }
}
