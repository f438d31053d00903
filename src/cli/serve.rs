//! `cxlkv serve`: the directory server with its embedded pool manager.
//!
//! With no arguments it serves the embedded default pool (a 2 GiB file
//! `/dev/shm/cxlkv.pool`, created on demand, its pool-manager state next to
//! it) on the default Unix socket ([`crate::server::default_socket_path`]).
//! Configuration comes from [`crate::config`] (`[server]`, `[directory]`,
//! `[pool]`; flags, then `CXLKV_<SECTION>_<KEY>`, then the file, then
//! defaults). Once it serves it prints one line `listening <endpoint>…` on
//! standard output, and tells systemd `READY=1` when `$NOTIFY_SOCKET` is
//! set (the unit is `Type=notify`); logs go to standard error (`CXLKV_LOG`,
//! default `info`).
//! SIGTERM or SIGINT (or SIGHUP) stop it gracefully, SIGINT and SIGHUP
//! only if not ignored when it started (`nohup cxlkv serve &` survives its
//! terminal hanging up; the `signals` module says why): every connection
//! closed (sessions end, pins released), region frees in flight waited for,
//! the embedded pool manager's journal committed and checkpointed, the
//! socket file removed; a
//! second signal, or 30 s (`signals::STOP_DEADLINE`), cuts that stop short.
//! It exits non-zero, naming the reason, when it cannot start, when its stop
//! was cut short, or when its embedded pool manager or its transport's
//! event loop fails while serving (a restart recovers).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::notify;
use super::signals::{self, STOP_DEADLINE};
use crate::config::{self, Override};
use crate::server::Server;

/// How often the main thread checks the embedded pool manager and the
/// transport while it waits for a signal.
const SIGNAL_POLL: Duration = Duration::from_millis(500);

/// Flags of `cxlkv serve`; each overrides one configuration key.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Configuration file (TOML). Default: `$CXLKV_CONFIG`, else none.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Unix socket to listen on (`[server] socket`).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Also listen on TCP, `host:port` (`[server] tcp`).
    #[arg(long)]
    pub tcp: Option<String>,
    /// File with the secret TCP clients must present, mode 0600 or
    /// stricter (`[server] tcp_secret_file`).
    #[arg(long)]
    pub tcp_secret_file: Option<PathBuf>,
    /// Accept TCP clients without a secret (`[server] tcp_insecure`).
    #[arg(long)]
    pub tcp_insecure: bool,
    /// Connections served at once (`[server] max_connections`).
    #[arg(long)]
    pub max_connections: Option<u64>,
    /// The directory's stable identity (`[server] directory_id`).
    #[arg(long)]
    pub directory_id: Option<String>,
    /// Use a `cxlkv pool` daemon, `unix:PATH` or `tcp:HOST:PORT`, instead
    /// of the embedded pool manager (`[server] pool_daemon`).
    #[arg(long)]
    pub pool_daemon: Option<String>,
    /// A pool of the embedded pool manager,
    /// `PATH[,size=SIZE][,align=ALIGN][,visibility=coherent|flush]` (repeat
    /// for several; `[pool] pools`; refused with a pool daemon).
    #[arg(long = "pool", value_name = "SPEC")]
    pub pools: Vec<String>,
    /// The embedded pool manager's state directory (`[pool] state_dir`;
    /// refused with a pool daemon).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Session lease (`[directory] lease_ms`).
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// Instance grace period (`[directory] grace_ms`).
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// The quota of every instance, in bytes of regions, or e.g. `8GiB`; 0
    /// none (`[directory] quota_bytes`).
    #[arg(long)]
    pub quota: Option<String>,
    /// Enable full LRU eviction (`[directory] lru`).
    #[arg(long)]
    pub lru: bool,
    /// Disable eviction of gone owners' keys (`[directory]
    /// orphan_eviction`).
    #[arg(long)]
    pub no_orphan_eviction: bool,
    /// Report pins held longer than this (`[directory] long_pin_ms`).
    #[arg(long)]
    pub long_pin_ms: Option<u64>,
    /// Serve Prometheus metrics at `http://HOST:PORT/metrics` (`[server]
    /// metrics_addr`).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Print the resolved configuration (secrets `<redacted>`) and exit;
    /// exits 1, naming the key, if the server would refuse it.
    #[arg(long)]
    pub print_config: bool,
}

fn int(flag: &str, v: u64) -> anyhow::Result<toml::Value> {
    Ok(toml::Value::Integer(
        i64::try_from(v).with_context(|| format!("--{flag} {v} is too large"))?,
    ))
}

impl ServeArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self) -> anyhow::Result<Vec<Override>> {
        let mut o = Vec::new();
        let path = |p: &PathBuf| toml::Value::String(p.to_string_lossy().into_owned());
        if let Some(p) = &self.socket {
            o.push(Override::new("server", "socket", path(p)));
        }
        if let Some(t) = &self.tcp {
            o.push(Override::new("server", "tcp", t.clone()));
        }
        if let Some(p) = &self.tcp_secret_file {
            o.push(Override::new("server", "tcp_secret_file", path(p)));
        }
        if self.tcp_insecure {
            o.push(Override::new("server", "tcp_insecure", true));
        }
        if let Some(n) = self.max_connections {
            o.push(Override::new(
                "server",
                "max_connections",
                int("max-connections", n)?,
            ));
        }
        if let Some(a) = &self.metrics_addr {
            o.push(Override::new("server", "metrics_addr", a.clone()));
        }
        if let Some(id) = &self.directory_id {
            o.push(Override::new("server", "directory_id", id.clone()));
        }
        if let Some(ep) = &self.pool_daemon {
            o.push(Override::new("server", "pool_daemon", ep.clone()));
        }
        if !self.pools.is_empty() {
            let pools = self
                .pools
                .iter()
                .map(|s| super::pool::pool_spec(s))
                .collect::<anyhow::Result<Vec<_>>>()?;
            o.push(Override::new("pool", "pools", toml::Value::Array(pools)));
        }
        if let Some(p) = &self.state_dir {
            o.push(Override::new("pool", "state_dir", path(p)));
        }
        for (key, flag, v) in [
            ("lease_ms", "lease-ms", self.lease_ms),
            ("grace_ms", "grace-ms", self.grace_ms),
            ("long_pin_ms", "long-pin-ms", self.long_pin_ms),
        ] {
            if let Some(v) = v {
                o.push(Override::new("directory", key, int(flag, v)?));
            }
        }
        if let Some(q) = &self.quota {
            let n = config::parse_bytes(q).map_err(|e| anyhow::anyhow!("--quota: {e}"))?;
            o.push(Override::new("directory", "quota_bytes", int("quota", n)?));
        }
        if self.lru {
            o.push(Override::new("directory", "lru", true));
        }
        if self.no_orphan_eviction {
            o.push(Override::new("directory", "orphan_eviction", false));
        }
        Ok(o)
    }
}

/// Runs the server until SIGTERM/SIGINT (see the module essay).
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // Before any thread starts, so that every thread inherits the mask and
    // the signals wait for `sigtimedwait` here.
    let signals = signals::block_stop_signals()?;
    let cfg = config::load_from_process(args.config.as_deref(), &args.overrides()?)?;
    if let Some(daemon) = &cfg.server.pool_daemon {
        // `[pool]` configures the embedded pool manager, which a daemon
        // replaces: a pool named on this command line would be silently
        // unused (the daemon serves its own pools).
        let flags: Vec<&str> = [
            ("--pool", !args.pools.is_empty()),
            ("--state-dir", args.state_dir.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect();
        let one = flags.len() == 1;
        anyhow::ensure!(
            flags.is_empty(),
            "{} {} the embedded pool manager, unused with [server] pool_daemon = {daemon:?}: \
             the daemon serves its own pools (`cxlkv pool --pool`); drop {} or the daemon",
            flags.join(" and "),
            if one { "configures" } else { "configure" },
            if one { "it" } else { "them" },
        );
    }
    let server_cfg = cfg.server_config()?;
    if args.print_config {
        println!("{server_cfg:#?}");
        // The checks `Server::start` makes before it opens anything, so that
        // a printed configuration that could not start says so.
        server_cfg
            .validate()
            .context("this configuration would not start")?;
        return Ok(());
    }
    let server = Server::start(server_cfg).context("cannot start the server")?;
    let mut endpoints = vec![format!("unix:{}", server.socket_path().display())];
    if let Some(addr) = server.tcp_addr() {
        endpoints.push(format!("tcp:{addr}"));
    }
    if let Some(addr) = server.metrics_addr() {
        endpoints.push(format!("metrics:http://{addr}/metrics"));
    }
    println!("listening {}", endpoints.join(" "));
    // Under systemd (`Type=notify`): started means listening.
    notify::notify("READY=1");
    tracing::info!(
        endpoints = %endpoints.join(" "),
        pools = ?server.pool_paths(),
        "cxlkv serve: serving"
    );
    let stopped_by = loop {
        if let Some(sig) = signals::wait_signal(&signals, SIGNAL_POLL) {
            break sig;
        }
        if let Some(failure) = server.pool_failure() {
            // Logged where it was found; the exit's error says it again.
            let _ = signals::stop_within(&signals, STOP_DEADLINE, move || server.shutdown());
            anyhow::bail!("{failure}");
        }
        if let Some(failure) = server.transport_failure() {
            // Nothing is served any more: exit, so that a supervisor
            // restarts a server that serves.
            tracing::error!(%failure, "the transport stopped serving; exiting");
            let _ = signals::stop_within(&signals, STOP_DEADLINE, move || server.shutdown());
            anyhow::bail!("the transport event loop stopped: {failure}");
        }
    };
    tracing::info!(signal = %signals::signal_name(stopped_by), "stopping");
    notify::notify("STOPPING=1");
    let report = signals::stop_within(&signals, STOP_DEADLINE, move || server.shutdown())
        .map_err(signals::cut_short)?
        .context("graceful shutdown failed")?;
    tracing::info!(
        sessions_closed = report.sessions_closed,
        frees_unconfirmed = report.frees_unconfirmed,
        "server stopped"
    );
    Ok(())
}
