//! `cxlkv pool`: the pool manager as a standalone daemon, so that several
//! directories (several `cxlkv serve` processes, or directories on other
//! hosts) share one device.
//!
//! Configuration comes from [`crate::config`] (`[pool]`; flags, then
//! `CXLKV_POOL_*`, then the file, then defaults). The daemon recovers its state directory, opens and
//! fences its pools, listens on its Unix socket (and TCP if configured),
//! prints one line `listening <endpoint>…` on standard output once it
//! serves (and tells systemd `READY=1` when `$NOTIFY_SOCKET` is set), and
//! logs with `tracing` on standard error (`CXLKV_LOG`, default `info` for
//! this command). SIGTERM or SIGINT (or SIGHUP) stop it gracefully, SIGINT
//! and SIGHUP only if not ignored when it started (`nohup cxlkv pool &`
//! survives its terminal hanging up; the `signals` module says why): no new
//! requests, the journal committed and checkpointed, the locks released; a
//! second signal, or 30 s (`signals::STOP_DEADLINE`), cuts that stop short.
//! It exits non-zero, naming the reason, when it cannot start (another
//! manager holds the state directory or a pool, a corrupt state, a foreign
//! pool), when its stop was cut short, or when its journal or its
//! transport's event loop fails while serving (fail-stop; a restart
//! recovers).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use cxlkv_controlplane::pool::service::PoolCore;
use cxlkv_controlplane::transport::{Endpoint, LoopWatch};

use super::notify;
use super::signals::{
    STOP_DEADLINE, block_stop_signals, cut_short, signal_name, stop_within, wait_signal,
};
use crate::config::{self, Override};

/// How often the main thread checks that the core and the transport still
/// run while it waits for a signal.
const SIGNAL_POLL: Duration = Duration::from_millis(500);

/// Flags of `cxlkv pool`; each one overrides its `[pool]` key.
#[derive(Debug, Args)]
pub struct PoolArgs {
    /// Configuration file (TOML). Default: `$CXLKV_CONFIG`, else none.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A pool, `PATH[,size=SIZE][,align=ALIGN][,visibility=coherent|flush]`
    /// (repeat for several; replaces `[pool] pools`).
    #[arg(long = "pool", value_name = "SPEC")]
    pub pools: Vec<String>,
    /// State directory: journal, checkpoint, secret, lock (`[pool]
    /// state_dir`; default next to a first pool under `/dev/shm`, else
    /// `/var/lib/cxlkv/pool` as root).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Unix socket to listen on (`[pool] socket`; default
    /// `/run/cxlkv/pool.sock` as root).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Also listen on TCP, `host:port` (`[pool] tcp`).
    #[arg(long)]
    pub tcp: Option<String>,
    /// File with the secret TCP directories must present, mode 0600 or
    /// stricter (`[pool] tcp_secret_file`).
    #[arg(long)]
    pub tcp_secret_file: Option<PathBuf>,
    /// Accept TCP directories without a secret, on trusted networks only
    /// (`[pool] tcp_insecure`).
    #[arg(long)]
    pub tcp_insecure: bool,
    /// Journal sync: `per-record` or `group` (`[pool] sync`).
    #[arg(long, value_parser = ["per-record", "group"])]
    pub sync: Option<String>,
    /// Largest commit group under `--sync group` (`[pool]
    /// group_max_records`).
    #[arg(long)]
    pub group_max_records: Option<u64>,
    /// Committed journal records between checkpoints (`[pool]
    /// checkpoint_every_records`).
    #[arg(long)]
    pub checkpoint_every_records: Option<u64>,
    /// How long a gone directory's regions wait for a reattach (`[pool]
    /// grace_ms`).
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// Pool-header lease length, renewed every third of it (`[pool]
    /// lease_ms`).
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// Do not pass pool descriptors to local directories (`[pool] pass_fds
    /// = false`).
    #[arg(long)]
    pub no_pass_fds: bool,
    /// Print the resolved configuration (`[pool]` and `[transport]`) and
    /// exit; exits 1, naming the key, if the daemon would refuse it.
    #[arg(long)]
    pub print_config: bool,
}

fn int(flag: &str, v: u64) -> anyhow::Result<toml::Value> {
    Ok(toml::Value::Integer(
        i64::try_from(v).with_context(|| format!("--{flag} {v} is too large"))?,
    ))
}

/// Parses `PATH[,size=SIZE][,align=ALIGN][,visibility=…]` into a TOML table.
pub(crate) fn pool_spec(spec: &str) -> anyhow::Result<toml::Value> {
    let mut parts = spec.split(',');
    let path = parts.next().unwrap_or_default();
    anyhow::ensure!(!path.is_empty(), "--pool {spec:?}: the path is empty");
    let mut t = toml::Table::new();
    t.insert("path".into(), toml::Value::String(path.into()));
    for part in parts {
        let (k, v) = part
            .split_once('=')
            .with_context(|| format!("--pool {spec:?}: {part:?} is not key=value"))?;
        let value = match k {
            "size" | "align" => {
                let n =
                    config::parse_bytes(v).map_err(|e| anyhow::anyhow!("--pool {spec:?}: {e}"))?;
                int("pool", n)?
            }
            "visibility" => toml::Value::String(v.into()),
            other => {
                anyhow::bail!("--pool {spec:?}: unknown key {other:?} (size, align, visibility)")
            }
        };
        let key = match k {
            "size" => "size_bytes",
            "align" => "align_bytes",
            other => other,
        };
        t.insert(key.into(), value);
    }
    Ok(toml::Value::Table(t))
}

impl PoolArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self) -> anyhow::Result<Vec<Override>> {
        let mut o = Vec::new();
        let path = |p: &PathBuf| toml::Value::String(p.to_string_lossy().into_owned());
        if !self.pools.is_empty() {
            let pools = self
                .pools
                .iter()
                .map(|s| pool_spec(s))
                .collect::<anyhow::Result<Vec<_>>>()?;
            o.push(Override::new("pool", "pools", toml::Value::Array(pools)));
        }
        if let Some(p) = &self.state_dir {
            o.push(Override::new("pool", "state_dir", path(p)));
        }
        if let Some(p) = &self.socket {
            o.push(Override::new("pool", "socket", path(p)));
        }
        if let Some(a) = &self.tcp {
            o.push(Override::new("pool", "tcp", a.clone()));
        }
        if let Some(p) = &self.tcp_secret_file {
            o.push(Override::new("pool", "tcp_secret_file", path(p)));
        }
        if self.tcp_insecure {
            o.push(Override::new("pool", "tcp_insecure", true));
        }
        if let Some(s) = &self.sync {
            o.push(Override::new("pool", "sync", s.clone()));
        }
        for (key, v) in [
            ("group_max_records", self.group_max_records),
            ("checkpoint_every_records", self.checkpoint_every_records),
            ("grace_ms", self.grace_ms),
            ("lease_ms", self.lease_ms),
        ] {
            if let Some(v) = v {
                o.push(Override::new("pool", key, int(key, v)?));
            }
        }
        if self.no_pass_fds {
            o.push(Override::new("pool", "pass_fds", false));
        }
        Ok(o)
    }
}

/// Runs the daemon until SIGTERM/SIGINT (see the module essay).
pub fn run(args: &PoolArgs) -> anyhow::Result<()> {
    let signals = block_stop_signals()?;
    let cfg = config::load_from_process(args.config.as_deref(), &args.overrides()?)?;
    // Both sections the daemon reads, resolved before anything starts: a
    // `[transport]` key it would refuse fails here, printed or not.
    let resolved = cfg.pool.resolve()?;
    // The listener binds once the pools are open (or created): a socket
    // path it could not bind is refused before.
    config::check_unix_socket_path(&resolved.socket)
        .map_err(|r| anyhow::anyhow!("configuration [pool] socket: {r}"))?;
    let mut server_cfg = cfg.transport.server_config()?;
    if args.print_config {
        // Every section the daemon reads (secrets `<redacted>` by their
        // `Debug`).
        println!("pool: {resolved:#?}\ntransport: {server_cfg:#?}");
        // The checks `PoolCore::start` makes before it opens anything, so
        // that a printed configuration that could not start says so.
        resolved
            .service
            .validate()
            .context("this configuration would not start")?;
        // `CXLKV_IO` under `backend = "auto"`, which the transport reads at
        // bind.
        server_cfg
            .io
            .backend
            .resolve_env()
            .context("this configuration would not start")?;
        return Ok(());
    }
    // Before the pools are opened (or created): a daemon already answering
    // on this socket fails the start without touching any file. (A stale
    // socket is left for the listener to replace.)
    refuse_socket_in_use(&resolved.socket)?;
    let mut core =
        PoolCore::start(resolved.service.clone()).context("cannot start the pool manager")?;
    let mut endpoints = vec![Endpoint::Unix(resolved.socket.clone())];
    if let Some(addr) = resolved.tcp {
        endpoints.push(Endpoint::Tcp(addr));
    }
    // The transport's handle lives in the core: its loop reports here.
    let transport = LoopWatch::new();
    server_cfg.loop_watch = Some(transport.clone());
    let bound = core
        .listen(&endpoints, server_cfg)
        .context("cannot listen")?;
    let shown: Vec<String> = bound.iter().map(ToString::to_string).collect();
    println!("listening {}", shown.join(" "));
    // Under systemd (`Type=notify`): started means listening, so that
    // `cxlkv serve` ordered after this unit finds the socket.
    notify::notify("READY=1");
    tracing::info!(
        state_dir = %resolved.service.state_dir.display(),
        pools = core.pools().len(),
        endpoints = %shown.join(" "),
        "pool manager serving"
    );
    let stopped_by = loop {
        if let Some(sig) = wait_signal(&signals, SIGNAL_POLL) {
            break Some(sig);
        }
        if !core.is_running() {
            break None;
        }
        if let Some(failure) = transport.failure() {
            // Nothing is served any more: exit, so that a supervisor
            // restarts a daemon that serves.
            tracing::error!(%failure, "the transport stopped serving; exiting");
            let _ = stop_within(&signals, STOP_DEADLINE, move || core.shutdown());
            anyhow::bail!("the pool manager's transport event loop stopped: {failure}");
        }
    };
    if let Some(failure) = core.failure() {
        let _ = stop_within(&signals, STOP_DEADLINE, move || core.shutdown());
        anyhow::bail!("the pool manager stopped: {failure}");
    }
    match stopped_by {
        Some(sig) => tracing::info!(signal = %signal_name(sig), "stopping"),
        None => tracing::info!("stopping: the pool manager's core stopped by itself"),
    }
    notify::notify("STOPPING=1");
    let report = stop_within(&signals, STOP_DEADLINE, move || core.shutdown())
        .map_err(cut_short)?
        .context("graceful shutdown failed")?;
    tracing::info!(
        committed_seq = report.committed_seq,
        checkpointed = report.checkpointed,
        "pool manager stopped"
    );
    Ok(())
}

/// How long a listener that accepts but does not answer may take to go
/// away (a daemon being killed) before it counts as in use.
const SOCKET_PATIENCE: Duration = Duration::from_secs(5);

/// Refuses `socket` if a process listens on it — a pool manager answering
/// (another daemon), or a listener that accepts and stays silent — before
/// the pool manager opens or creates anything; the listener makes the same
/// check when it binds, but only after the pools are open.
fn refuse_socket_in_use(socket: &std::path::Path) -> anyhow::Result<()> {
    use cxlkv_controlplane::transport::{ExistingSocket, classify_existing_socket};
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {}
        // Missing, or not a socket (the listener refuses that, naming it).
        _ => return Ok(()),
    }
    let state = classify_existing_socket(socket, answers_as_pool_manager, SOCKET_PATIENCE)
        .with_context(|| format!("cannot probe socket {}", socket.display()))?;
    match state {
        ExistingSocket::Stale => Ok(()),
        ExistingSocket::Answering => anyhow::bail!(
            "socket {} is in use by another process (a pool manager answers on it); \
             refusing to start a second one: stop it, or give this one its own [pool] socket \
             (--socket)",
            socket.display()
        ),
        ExistingSocket::SilentListener => anyhow::bail!(
            "socket {}: a listener accepts on it but does not answer as a pool manager \
             (a stalled one, or another program's socket); not replacing it",
            socket.display()
        ),
    }
}

/// Whether a pool manager answers a `PoolStats` frame on `stream` within
/// half a second.
fn answers_as_pool_manager(stream: &std::os::unix::net::UnixStream) -> bool {
    use cxlkv_controlplane::frame::{FrameHeader, HEADER_BYTES};
    use cxlkv_controlplane::proto;
    use std::io::{Read, Write};
    let mut stream = stream;
    let mut probe = || -> std::io::Result<bool> {
        stream.set_read_timeout(Some(Duration::from_millis(500)))?;
        stream.set_write_timeout(Some(Duration::from_millis(500)))?;
        let mut frame = Vec::new();
        proto::encode(
            1,
            &proto::PoolStats {
                meta: proto::RequestMeta::default(),
            },
            &mut frame,
        )
        .map_err(std::io::Error::other)?;
        stream.write_all(&frame)?;
        let mut header = [0u8; HEADER_BYTES];
        stream.read_exact(&mut header)?;
        Ok(FrameHeader::decode(&header).is_ok_and(|h| h.request_id == 1))
    };
    probe().unwrap_or(false)
}
