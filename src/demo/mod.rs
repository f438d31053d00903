//! `cxlkv demo`: the system doing its job on one machine, with nothing to
//! set up — the README's first command.
//!
//! The coordinator (this process) starts a server in process on a private
//! pool file under `/dev/shm` (or `--pool`), then starts instance processes
//! (the same binary, `cxlkv demo --instance <i>`; see [`instance`]) that
//! behave like inference engines on a prefix-heavy workload ([`workload`]):
//! instance 0 prefills the documents' shared prefixes (disaggregated
//! prefill), then the peer instances serve requests — hits are read in
//! place from whichever instance wrote them, misses are written for the
//! others — and fetch the same shared chunks over loopback TCP from their
//! writers as the transfer baseline ([`tcp`]).
//! It merges their measurements ([`meter`]) into a [`Report`].
//!
//! Why the server runs in process and not as a `cxlkv serve` child: it is
//! one thing fewer to start, watch and kill, its shutdown removes the pool
//! file, its state and its socket (`remove_pool_on_shutdown`), and the
//! coordinator around it only waits on pipes, so it takes no CPU time from
//! the server (which does no data-path work either).
//! The instances must be processes of their own: sharing across processes
//! is the point.
//!
//! Cleanup is not optional: instances are stopped and checked gone
//! ([`fleet`]) on every path, success, error or signal (the caller passes a
//! flag its SIGINT/SIGTERM handler sets); the server, then the pool file
//! and state directory, go after them.

pub mod fleet;
pub mod instance;
pub mod meter;
pub mod tcp;
pub mod workload;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::server::{PoolManagerConfig, Server, ServerConfig};
use fleet::Fleet;
use instance::InstanceReport;
use meter::{Meter, Op, Percentiles};

/// Bound on the instances' start (connect, map, listen): generous, a debug
/// build on a loaded machine is slow.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on the prefill.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on the end of the run beyond its duration (the last request, the
/// report).
const RUN_GRACE: Duration = Duration::from_secs(60);
/// How often waits look at the stop flag and redraw the progress bar.
const POLL: Duration = Duration::from_millis(100);
/// Largest pool the demo creates by itself.
const MAX_POOL_BYTES: u64 = 16 << 30;
/// Pool alignment (regions and pool sizes are multiples of it).
const ALIGN_BYTES: u64 = 2 << 20;

/// Limits of the options.
pub const MAX_INSTANCES: u32 = 64;
pub const MAX_DOCUMENTS: u32 = 100_000;
pub const MIN_CHUNK_BYTES: u64 = 4 << 10;
pub const MAX_CHUNK_BYTES: u64 = 64 << 20;
pub const MAX_DURATION_S: u64 = 3600;

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Instance processes, the prefill instance included (at least 2).
    pub instances: u32,
    /// Bytes per KV chunk (one pool page): a multiple of 4 KiB.
    pub chunk_size_bytes: u64,
    pub documents: u32,
    /// How long the instances serve requests (after the prefill).
    pub duration: Duration,
    /// The pool: created (and removed afterwards) if it does not exist; an
    /// existing file or device is used and kept. `None`: a private file
    /// under `/dev/shm`.
    pub pool: Option<PathBuf>,
    /// Draw a progress bar on standard error.
    pub progress: bool,
}

impl DemoConfig {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (2..=MAX_INSTANCES).contains(&self.instances),
            "--instances {} must be 2..={MAX_INSTANCES} (one prefill, at least one peer)",
            self.instances
        );
        anyhow::ensure!(
            (1..=MAX_DOCUMENTS).contains(&self.documents),
            "--documents {} must be 1..={MAX_DOCUMENTS}",
            self.documents
        );
        anyhow::ensure!(
            (MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&self.chunk_size_bytes)
                && self.chunk_size_bytes.is_multiple_of(MIN_CHUNK_BYTES),
            "--chunk-size {} must be a multiple of 4 KiB between 4 KiB and 64 MiB",
            self.chunk_size_bytes
        );
        let s = self.duration.as_secs();
        anyhow::ensure!(
            (1..=MAX_DURATION_S).contains(&s),
            "--duration {s} must be 1..={MAX_DURATION_S} seconds"
        );
        Ok(())
    }

    /// Each instance's region size: 16 chunks or 4 MiB, whichever is
    /// larger, aligned.
    fn region_size_bytes(&self) -> u64 {
        align_up((16 * self.chunk_size_bytes).max(4 << 20))
    }

    /// A pool that holds every chunk the workload can write, the pages of
    /// lost write races, and every instance's partly filled regions.
    fn pool_size_bytes(&self) -> anyhow::Result<u64> {
        let chunks = workload::total_chunks(self.documents);
        let data = chunks * self.chunk_size_bytes;
        let regions = 2 * u64::from(self.instances) * self.region_size_bytes();
        let size = align_up(data + data / 4 + regions + (64 << 20));
        anyhow::ensure!(
            size <= MAX_POOL_BYTES,
            "this workload needs a {} MiB pool (at most {} MiB): use fewer --documents or a smaller --chunk-size",
            size >> 20,
            MAX_POOL_BYTES >> 20
        );
        Ok(size)
    }
}

fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN_BYTES) * ALIGN_BYTES
}

/// What the demo measured. Throughputs are bytes over time spent inside
/// the operation, summed over instances (GB/s = 10⁹ bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub instances: u32,
    pub documents: u32,
    pub chunk_size_bytes: u64,
    pub duration_s: f64,
    pub pool: PathBuf,
    /// The pool file's size (0: a device, size not known here).
    pub pool_size_bytes: u64,
    /// Whether the pool was created for the run (and removed after it).
    pub pool_created: bool,
    pub requests: u64,
    /// Keys inserted, by every instance.
    pub chunks_written: u64,
    /// Of which by the prefill.
    pub prefill_chunks: u64,
    /// Writes that lost a race for the same key to another instance.
    pub duplicate_writes: u64,
    /// Lookups that hit.
    pub chunks_read: u64,
    /// Hits served from another instance's writes (read in place).
    pub chunks_shared: u64,
    pub misses: u64,
    pub hit_rate: f64,
    /// Hits whose length and checksum equal what their writer wrote.
    pub verified_reads: u64,
    pub corrupt_reads: u64,
    pub bytes_stored: u64,
    pub bytes_read: u64,
    pub store_gbps: f64,
    pub read_gbps: f64,
    /// The shared hits fetched over loopback TCP from their writers.
    pub tcp_reads: u64,
    pub tcp_corrupt_reads: u64,
    pub tcp_not_served: u64,
    pub tcp_bytes_read: u64,
    pub tcp_read_gbps: f64,
    /// `read_gbps / tcp_read_gbps`.
    pub read_vs_tcp_ratio: f64,
    /// p50/p99 per operation (`store`, `lookup`, `read`, `tcp_read`).
    pub latency_us: BTreeMap<&'static str, Percentiles>,
    /// Instance processes still alive when the demo finished (reaped and
    /// process groups checked): must be 0.
    pub leftover_processes: usize,
}

/// Runs the demo. `stop` is set by the caller's signal handler; the demo
/// then stops everything it started and returns an error.
pub fn run(cfg: &DemoConfig, stop: &AtomicBool) -> anyhow::Result<Report> {
    cfg.validate()?;
    let pool_size_bytes = cfg.pool_size_bytes()?;
    let region_size_bytes = cfg.region_size_bytes();
    let mut server_cfg = ServerConfig::ephemeral("demo");
    // The private state directory of the embedded pool manager, removed
    // afterwards even when the pool is the caller's: the state directory
    // of the run's ephemeral pool name under /dev/shm (by the rule of every
    // embedded pool manager, next to it), never one next to a device.
    let state_dir = crate::config::default_state_dir(&server_cfg.pool_path);
    anyhow::ensure!(
        state_dir != crate::config::host_state_dir(),
        "the demo's scratch state directory would be the host's {}",
        state_dir.display()
    );
    let (pool, pool_created) = match &cfg.pool {
        Some(p) => (p.clone(), !p.exists()),
        None => (server_cfg.pool_path.clone(), true),
    };
    server_cfg.pool_path = pool.clone();
    server_cfg.pool_size_bytes = pool_size_bytes;
    server_cfg.remove_pool_on_shutdown = pool_created;
    let PoolManagerConfig::Embedded(mut service) = server_cfg.pool_manager_config() else {
        unreachable!("no pool manager configured: the embedded one");
    };
    service.state_dir = state_dir.clone();
    if !pool_created {
        for p in &mut service.pools {
            p.create_size_bytes = None;
        }
    }
    server_cfg.pool_manager = Some(PoolManagerConfig::Embedded(service));
    let _scratch = Scratch(
        [state_dir, server_cfg.socket_path.clone()]
            .into_iter()
            .chain(pool_created.then(|| pool.clone()))
            .collect(),
    );
    let server = Server::start(server_cfg).context("starting the server")?;
    let exe = std::env::current_exe().context("finding this executable")?;
    let progress = Progress::new(cfg.progress, cfg.duration);
    let mut fleet = Fleet::default();
    let plan = Plan {
        cfg,
        exe: &exe,
        socket: server.socket_path(),
        region_size_bytes,
        stop,
        progress: &progress,
    };
    let outcome = plan.drive(&mut fleet);
    let leftover_processes = fleet.stop();
    progress.finish();
    let reports = outcome.with_context(|| {
        format!(
            "stopped {} instance processes ({leftover_processes} still alive)",
            fleet.len()
        )
    })?;
    server.shutdown().context("stopping the server")?;
    let mut report = merge(cfg, &reports)?;
    // An existing pool keeps its own size (a device reports 0 here).
    report.pool_size_bytes = if pool_created {
        pool_size_bytes
    } else {
        std::fs::metadata(&pool).map_or(0, |m| m.len())
    };
    report.pool = pool;
    report.pool_created = pool_created;
    report.leftover_processes = leftover_processes;
    Ok(report)
}

/// Files and directories removed on drop (whatever the server's shutdown
/// did not already remove, e.g. after a failed start).
struct Scratch(Vec<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in &self.0 {
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
            if let Err(e) = removed
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove");
            }
        }
    }
}

/// One run's phases, driving the fleet.
struct Plan<'a> {
    cfg: &'a DemoConfig,
    exe: &'a Path,
    socket: &'a Path,
    region_size_bytes: u64,
    stop: &'a AtomicBool,
    progress: &'a Progress,
}

impl Plan<'_> {
    /// Starts the instances, prefills, runs, and collects their reports.
    fn drive(&self, fleet: &mut Fleet) -> anyhow::Result<Vec<InstanceReport>> {
        let cfg = self.cfg;
        self.progress
            .message(&format!("starting {} instance processes", cfg.instances));
        for i in 0..cfg.instances {
            fleet.spawn(self.exe, &self.instance_args(i))?;
        }
        let all: Vec<usize> = (0..fleet.len()).collect();
        let ready = self.collect(fleet, "ready", &all, READY_TIMEOUT, None)?;
        let mut ports = Vec::with_capacity(ready.len());
        for (i, rest) in ready.iter().enumerate() {
            let port: u16 = rest
                .parse()
                .with_context(|| format!("instance {i} said ready {rest:?}"))?;
            ports.push(port.to_string());
        }
        self.progress
            .message("instance 0 prefills every document's prefix");
        fleet.send(0, "prefill")?;
        let prefilled = self.collect(fleet, "prefilled", &[0], PREFILL_TIMEOUT, None)?;
        let run = format!("run {}", ports.join(" "));
        let peers: Vec<usize> = (1..fleet.len()).collect();
        for &i in &peers {
            fleet.send(i, &run)?;
        }
        let started = Instant::now();
        let done = self.collect(
            fleet,
            "done",
            &peers,
            cfg.duration + RUN_GRACE,
            Some(started),
        )?;
        for i in 0..fleet.len() {
            fleet.send(i, "exit")?;
        }
        prefilled
            .iter()
            .chain(&done)
            .enumerate()
            .map(|(i, json)| {
                serde_json::from_str::<InstanceReport>(json)
                    .with_context(|| format!("instance {i}'s report"))
            })
            .collect()
    }

    fn instance_args(&self, index: u32) -> Vec<String> {
        let cfg = self.cfg;
        vec![
            "demo".into(),
            "--instance".into(),
            index.to_string(),
            "--instances".into(),
            cfg.instances.to_string(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--parent-pid".into(),
            std::process::id().to_string(),
            "--chunk-size".into(),
            cfg.chunk_size_bytes.to_string(),
            "--documents".into(),
            cfg.documents.to_string(),
            "--duration".into(),
            cfg.duration.as_secs().to_string(),
            "--region-size".into(),
            self.region_size_bytes.to_string(),
        ]
    }

    /// Waits until each instance in `from` said `word …`; returns what
    /// followed the word, in the order of `from`. Progress lines update the
    /// bar (the run started at `run_started`).
    fn collect(
        &self,
        fleet: &Fleet,
        word: &str,
        from: &[usize],
        timeout: Duration,
        run_started: Option<Instant>,
    ) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        let mut answers: Vec<Option<String>> = vec![None; from.len()];
        let mut progress: Vec<(u64, u64, u64)> = vec![(0, 0, 0); fleet.len()];
        while answers.iter().any(Option::is_none) {
            // Relaxed: a flag polled every POLL; no data is published with it.
            if self.stop.load(Ordering::Relaxed) {
                anyhow::bail!("interrupted by a signal");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "instances did not say {word:?} within {} s",
                timeout.as_secs()
            );
            if let Some(started) = run_started {
                self.progress.run(started.elapsed(), &progress);
            }
            let Some((i, line)) = fleet.next_event(POLL) else {
                continue;
            };
            let line = line.with_context(|| format!("instance {i} exited before {word:?}"))?;
            let (first, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            if first == "progress" {
                let n: Vec<u64> = rest.split(' ').filter_map(|x| x.parse().ok()).collect();
                if let ([a, b, c], Some(slot)) = (n.as_slice(), progress.get_mut(i)) {
                    *slot = (*a, *b, *c);
                }
                continue;
            }
            let slot = from
                .iter()
                .position(|&f| f == i)
                .filter(|_| first == word)
                .with_context(|| {
                    format!("instance {i} said {line:?} while {word:?} was awaited")
                })?;
            answers[slot] = Some(rest.to_owned());
        }
        Ok(answers.into_iter().flatten().collect())
    }
}

/// The progress bar (hidden when not asked for).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(enabled: bool, duration: Duration) -> Self {
        let bar = enabled.then(|| {
            let len_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(len_ms),
                indicatif::ProgressDrawTarget::stderr(),
            );
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{spinner} [{bar:30}] {percent:>3}% {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.enable_steady_tick(Duration::from_millis(100));
            bar
        });
        Self { bar }
    }

    fn message(&self, msg: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(msg.to_owned());
        }
    }

    /// `per_instance`: the latest (requests, hits, misses) of each.
    fn run(&self, elapsed: Duration, per_instance: &[(u64, u64, u64)]) {
        let Some(bar) = &self.bar else { return };
        let (requests, hits, misses) = per_instance
            .iter()
            .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
        bar.set_position(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
        bar.set_message(format!(
            "{requests} requests, {hits} chunks read in place, hit rate {:.1}%",
            100.0 * ratio(hits, hits + misses)
        ));
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Sums the instances' reports.
fn merge(cfg: &DemoConfig, reports: &[InstanceReport]) -> anyhow::Result<Report> {
    let mut meters: BTreeMap<&'static str, Meter> = Op::ALL
        .iter()
        .map(|op| (op.name(), Meter::default()))
        .collect();
    let sum = |f: fn(&InstanceReport) -> u64| reports.iter().map(f).sum::<u64>();
    for r in reports {
        for (name, meter) in &mut meters {
            if let Some(rec) = r.ops.get(*name) {
                meter.absorb(rec)?;
            }
        }
    }
    let m = |op: Op| &meters[op.name()];
    let (hits, misses) = (sum(|r| r.hits), sum(|r| r.misses));
    let (read, tcp) = (m(Op::Read).gbps(), m(Op::TcpRead).gbps());
    Ok(Report {
        instances: cfg.instances,
        documents: cfg.documents,
        chunk_size_bytes: cfg.chunk_size_bytes,
        duration_s: cfg.duration.as_secs_f64(),
        pool: PathBuf::new(),
        pool_size_bytes: 0,
        pool_created: false,
        requests: sum(|r| r.requests),
        chunks_written: sum(|r| r.chunks_written),
        prefill_chunks: sum(|r| r.prefill_chunks),
        duplicate_writes: sum(|r| r.duplicate_writes),
        chunks_read: hits,
        chunks_shared: sum(|r| r.shared_hits),
        misses,
        hit_rate: ratio(hits, hits + misses),
        verified_reads: sum(|r| r.verified_reads),
        corrupt_reads: sum(|r| r.corrupt_reads),
        bytes_stored: m(Op::Store).bytes(),
        bytes_read: m(Op::Read).bytes(),
        store_gbps: m(Op::Store).gbps(),
        read_gbps: read,
        tcp_reads: sum(|r| r.tcp_verified_reads + r.tcp_corrupt_reads),
        tcp_corrupt_reads: sum(|r| r.tcp_corrupt_reads),
        tcp_not_served: sum(|r| r.tcp_not_served),
        tcp_bytes_read: m(Op::TcpRead).bytes(),
        tcp_read_gbps: tcp,
        read_vs_tcp_ratio: if tcp > 0.0 { read / tcp } else { 0.0 },
        latency_us: meters
            .iter()
            .map(|(name, meter)| (*name, meter.percentiles_us()))
            .collect(),
        leftover_processes: 0,
    })
}

impl Report {
    /// The report for humans.
    pub fn print_human(&self, out: &mut impl Write) -> std::io::Result<()> {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        writeln!(
            out,
            "cxlkv demo: {} instance processes (1 prefill + {} peer{}), {} documents, {} KiB chunks, {} s",
            self.instances,
            self.instances - 1,
            if self.instances == 2 { "" } else { "s" },
            self.documents,
            self.chunk_size_bytes >> 10,
            self.duration_s
        )?;
        writeln!(
            out,
            "pool: {} ({} MiB, {})",
            self.pool.display(),
            self.pool_size_bytes >> 20,
            if self.pool_created {
                "created for this run and removed"
            } else {
                "existing, kept"
            }
        )?;
        writeln!(out)?;
        writeln!(out, "requests          {:>10}", self.requests)?;
        writeln!(
            out,
            "chunks written    {:>10}   ({:.0} MiB; {} by the prefill, {} lost a write race)",
            self.chunks_written,
            mib(self.chunks_written * self.chunk_size_bytes),
            self.prefill_chunks,
            self.duplicate_writes
        )?;
        writeln!(
            out,
            "chunks read       {:>10}   (hit rate {:.1}%; {} shared: written by another instance)",
            self.chunks_read,
            100.0 * self.hit_rate,
            self.chunks_shared
        )?;
        writeln!(
            out,
            "verified reads    {:>10}   ({} corrupt; over TCP {} verified, {} corrupt)",
            self.verified_reads,
            self.corrupt_reads,
            self.tcp_reads - self.tcp_corrupt_reads,
            self.tcp_corrupt_reads
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "{:<28} {:>8} {:>10} {:>10} {:>9}",
            "operation", "GB/s", "p50 us", "p99 us", "count"
        )?;
        let rows: [(&str, &str, Option<f64>); 4] = [
            ("store", "store (batch_put)", Some(self.store_gbps)),
            ("lookup", "lookup (batch_get)", None),
            ("read", "read in place", Some(self.read_gbps)),
            (
                "tcp_read",
                "read over loopback TCP",
                Some(self.tcp_read_gbps),
            ),
        ];
        for (key, label, gbps) in rows {
            let p = self.latency_us.get(key).copied().unwrap_or_default();
            let gbps = gbps.map_or_else(|| "-".to_owned(), |g| format!("{g:.2}"));
            writeln!(
                out,
                "{label:<28} {gbps:>8} {:>10.1} {:>10.1} {:>9}",
                p.p50, p.p99, p.count
            )?;
        }
        writeln!(out)?;
        writeln!(
            out,
            "in place vs TCP: {:.2}x the throughput, on the same chunks in the same run",
            self.read_vs_tcp_ratio
        )?;
        writeln!(
            out,
            "  (GB/s: bytes over time inside the operation; read = lookup + reading every byte;"
        )?;
        writeln!(
            out,
            "   TCP = the writer sends the chunk, the reader receives it into its own buffer and reads it;"
        )?;
        writeln!(
            out,
            "   TCP readers are told each chunk's writer for free: no lookup, a conservative baseline)"
        )?;
        writeln!(out, "leftover processes: {}", self.leftover_processes)
    }
}
