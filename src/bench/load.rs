//! `cxlkv bench load`: 64 concurrent client connections run a mixed
//! workload against one `cxlkv serve` process for a fixed time, while the
//! server's resident memory is sampled.
//!
//! **The workload.** Each connection is its own [`Client`] (own session, own
//! regions) on its own thread, looping until the phase ends over:
//! `put` a fresh key (allocate, copy 1 KiB, publish, `Register`), `get` it
//! back (`Lookup` with a pin, read in place, bytes compared, unpin), `exists`
//! on a key written a few rounds earlier, and `delete` of the oldest key once
//! the connection keeps [`LIVE_KEYS`] keys — so the server's key count and
//! memory are steady and any growth is a leak. Every operation is timed,
//! but only one that succeeded counts in `ops`, the rates and the
//! latencies; a failed call, wrong bytes, a key `exists` does not find or
//! a delete that does not delete counts in `errors` instead (none are
//! expected, and the scenario fails if any occurred).
//!
//! **The baseline** is the same workload from **one** connection against
//! the same server, in the same run (phases alternate, reps interleaved).
//! `ratio = ours / baseline` is therefore the server's aggregate throughput
//! with 64 concurrent connections relative to a single one: above 1 the
//! server turns concurrency into throughput (it pipelines and batches across
//! connections); below 1 it would collapse under contention. It is not a
//! comparison with another product. On a 2-vCPU host the 64 client threads
//! and the server share the same two CPUs, so the ratio is bounded by how
//! much of a single connection's round trip is waiting rather than CPU.
//!
//! **Server memory.** The server is a child process (`cxlkv serve`, the
//! same binary), so its `VmRSS` (from `/proc/<pid>/status`) is the
//! server's alone; it is sampled every [`RSS_SAMPLE_EVERY`]. A warm-up
//! phase (all connections, untimed) comes first; `rss_after_warmup_kib` is
//! taken at its end and `rss_final_kib` after the last phase. Bounded
//! memory means the final figure stays within a margin of the warmed-up
//! one (`tests/load.rs` asserts it; the bench reports both and the
//! samples).
//!
//! Phase length: 10 s (`--quick`: 2 s), or `CXLKV_BENCH_LOAD_PHASE_S`.
//!
//! The server's pool is `--pool` when given (its header block zeroed first
//! and a temporary state directory, see `pool_target`), else a temporary
//! `/dev/shm` file (`pool`, `dest`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::pool_target::BenchPool;
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig, DeleteOutcome, LayoutHandle, LayoutOptions};

const SCENARIO: &str = "load";
/// Concurrent connections of the measured phases.
pub const CONNECTIONS: usize = 64;
/// Keys each connection keeps registered; older ones are deleted.
pub const LIVE_KEYS: usize = 16;
const PAGE_BYTES: u64 = 4096;
const VALUE_BYTES: usize = 1024;
const FINGERPRINT: u64 = 0x10AD;
/// Server memory sampling period.
pub const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Bound on the server's start-up.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The server's pool size.
const POOL_BYTES: u64 = 1 << 30;
const PHASE_S: f64 = 10.0;
const QUICK_PHASE_S: f64 = 2.0;
/// Most RSS samples reported in a record (evenly thinned).
const MAX_REPORTED_SAMPLES: usize = 60;

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The `cxlkv` binary whose `serve` is measured.
    pub cxlkv_exe: PathBuf,
    pub connections: usize,
    /// Length of each measured phase (and of the warm-up).
    pub phase: Duration,
    /// Repetitions of (baseline phase, load phase).
    pub reps: usize,
}

/// One timed phase.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PhaseResult {
    pub connections: usize,
    /// Operations that succeeded (the rate and latencies are theirs).
    pub ops: u64,
    /// Operations that failed or answered wrongly (not in `ops`).
    pub errors: u64,
    pub elapsed: Duration,
    pub ops_per_s: f64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
}

/// Everything measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// One per repetition, with `connections` connections.
    pub load: Vec<PhaseResult>,
    /// One per repetition, with one connection.
    pub baseline: Vec<PhaseResult>,
    /// Errors in every phase, the warm-up included.
    pub errors: u64,
    /// (seconds since the server started, VmRSS KiB).
    pub rss_kib: Vec<(f64, u64)>,
    pub rss_after_warmup_kib: u64,
    pub rss_final_kib: u64,
    pub rss_max_kib: u64,
}

/// A `cxlkv serve` child on private paths; killed and cleaned up on drop.
struct ServeChild {
    child: Child,
    socket: PathBuf,
    pool: PathBuf,
    /// False for the operator's `--pool`, which is never removed.
    remove_pool: bool,
    state_dir: PathBuf,
}

impl ServeChild {
    fn start(exe: &Path, target: &BenchPool) -> anyhow::Result<Self> {
        let unique = format!("load-{}-{:x}", std::process::id(), nanos());
        let socket = std::env::temp_dir().join(format!("cxlkv-{unique}.sock"));
        let state_dir = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
        let (pool, remove_pool) = match target.path() {
            Some(p) => {
                target.prepare(POOL_BYTES)?;
                (p.to_owned(), false)
            }
            None => (PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool")), true),
        };
        let mut command = super::command_ending_with_bench(exe)?;
        let mut child = command
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--pool")
            .arg(format!("{},size={POOL_BYTES}", pool.display()))
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--grace-ms")
            .arg("500")
            .env("CXLKV_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let server = Self {
            child,
            socket,
            pool,
            remove_pool,
            state_dir,
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let line = rx
            .recv_timeout(START_TIMEOUT)
            .context("cxlkv serve did not say where it listens")?;
        anyhow::ensure!(line.starts_with("listening"), "cxlkv serve said {line:?}");
        Ok(server)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
        if self.remove_pool {
            let _ = std::fs::remove_file(&self.pool);
        }
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// `VmRSS` of `pid` in KiB.
pub fn vm_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no VmRSS line in /proc/{pid}/status"))
}

/// Samples the server's RSS until stopped.
struct RssSampler {
    stop: Arc<AtomicBool>,
    join: std::thread::JoinHandle<Vec<(f64, u64)>>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let join = std::thread::spawn(move || {
            let start = Instant::now();
            let mut samples = Vec::new();
            // Relaxed: a stop request; the join publishes the samples.
            while !flag.load(Ordering::Relaxed) {
                if let Ok(kib) = vm_rss_kib(pid) {
                    samples.push((start.elapsed().as_secs_f64(), kib));
                }
                std::thread::sleep(RSS_SAMPLE_EVERY);
            }
            samples
        });
        Self { stop, join }
    }

    fn finish(self) -> Vec<(f64, u64)> {
        // Relaxed: see above.
        self.stop.store(true, Ordering::Relaxed);
        self.join.join().unwrap_or_default()
    }
}

/// One connection's state across phases: its client, layout and the keys
/// it keeps alive.
struct Worker {
    client: Client,
    layout: LayoutHandle,
    id: usize,
    next: u64,
    live: std::collections::VecDeque<Vec<u8>>,
}

fn value(worker: usize, i: u64) -> Vec<u8> {
    let mut x = (worker as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i;
    (0..VALUE_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What one connection did in one phase.
#[derive(Default)]
struct Tally {
    ops: u64,
    errors: u64,
    latency_us: Vec<f64>,
}

impl Tally {
    /// Times `f`; counts it as an operation (with its latency) if it
    /// succeeded and `ok` accepts its answer, else as an error. Returns
    /// whether it counted as an operation.
    fn op<T>(
        &mut self,
        f: impl FnOnce() -> Result<T, crate::client::ClientError>,
        ok: impl FnOnce(&T) -> bool,
    ) -> bool {
        let start = Instant::now();
        let r = f();
        let us = start.elapsed().as_secs_f64() * 1e6;
        match r {
            Ok(v) if ok(&v) => {
                self.ops += 1;
                self.latency_us.push(us);
                true
            }
            Ok(_) => {
                self.errors += 1;
                tracing::warn!("load: a call answered wrongly");
                false
            }
            Err(e) => {
                self.errors += 1;
                tracing::warn!(error = %e, "load: a call failed");
                false
            }
        }
    }
}

impl Worker {
    fn connect(socket: &Path, id: usize) -> anyhow::Result<Self> {
        let mut cfg = ClientConfig::unix(socket);
        cfg.client_name = format!("load-{id}");
        let client = Client::connect(cfg).context("connecting a load client")?;
        let layout = client.layout_with(
            PAGE_BYTES,
            FINGERPRINT,
            LayoutOptions {
                initial_reservation_bytes: 0,
                region_size_bytes: 2 << 20,
                auto_expand: true,
            },
        )?;
        Ok(Self {
            client,
            layout,
            id,
            next: 0,
            live: std::collections::VecDeque::new(),
        })
    }

    /// One round of the mix: put, get (checked), exists, delete.
    fn round(&mut self, t: &mut Tally) {
        let i = self.next;
        self.next += 1;
        let key = format!("load-{}-{i}", self.id).into_bytes();
        let v = value(self.id, i);
        let layout = &self.layout;
        if !t.op(|| layout.put(&key, &v), |_| true) {
            return;
        }
        t.op(
            || layout.get(&key),
            |guard| guard.as_ref().is_some_and(|g| g[..] == v[..]),
        );
        self.live.push_back(key);
        let probe = &self.live[self.live.len() / 2];
        t.op(|| layout.exists(probe), |found| *found);
        if self.live.len() > LIVE_KEYS {
            let oldest = self
                .live
                .pop_front()
                .expect("invariant: more than LIVE_KEYS");
            t.op(
                || layout.delete(&oldest),
                |outcome| matches!(outcome, DeleteOutcome::Deleted),
            );
        }
    }

    /// Deletes every key it keeps (between phases; not timed).
    fn drain(&mut self) -> u64 {
        let mut errors = 0;
        for key in std::mem::take(&mut self.live) {
            if !matches!(self.layout.delete(&key), Ok(DeleteOutcome::Deleted)) {
                errors += 1;
            }
        }
        errors
    }
}

/// Runs every worker of `workers` for `phase` on its own thread.
fn phase(workers: &mut [Worker], phase: Duration) -> PhaseResult {
    let start = Instant::now();
    let deadline = start + phase;
    let ran: Vec<(Tally, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .iter_mut()
            .map(|w| {
                s.spawn(move || {
                    let mut t = Tally::default();
                    while Instant::now() < deadline {
                        w.round(&mut t);
                    }
                    let ended = Instant::now();
                    t.errors += w.drain();
                    (t, ended)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    let failed = Tally {
                        errors: 1,
                        ..Tally::default()
                    };
                    (failed, Instant::now())
                })
            })
            .collect()
    });
    // The phase lasts until its last connection's last round ended.
    let elapsed = ran.iter().map(|(_, end)| *end).max().unwrap_or(deadline) - start;
    let tallies: Vec<Tally> = ran.into_iter().map(|(t, _)| t).collect();
    let ops: u64 = tallies.iter().map(|t| t.ops).sum();
    let errors: u64 = tallies.iter().map(|t| t.errors).sum();
    let mut lat: Vec<f64> = tallies.into_iter().flat_map(|t| t.latency_us).collect();
    let (p50, p99) = if lat.is_empty() {
        (0.0, 0.0)
    } else {
        (percentile(&mut lat, 50.0), percentile(&mut lat, 99.0))
    };
    PhaseResult {
        connections: workers.len(),
        ops,
        errors,
        elapsed,
        ops_per_s: ops as f64 / elapsed.as_secs_f64(),
        latency_us_p50: p50,
        latency_us_p99: p99,
    }
}

/// Starts the server on the embedded default pool, connects the clients,
/// runs warm-up then `reps` × (baseline, load) phases (alternating which
/// goes first), and reports.
pub fn run_load(cfg: &LoadConfig) -> anyhow::Result<LoadReport> {
    run_load_on(cfg, &BenchPool::embedded_default())
}

/// [`run_load`] with the server on `target`'s pool.
fn run_load_on(cfg: &LoadConfig, target: &BenchPool) -> anyhow::Result<LoadReport> {
    anyhow::ensure!(cfg.connections >= 1 && cfg.reps >= 1, "nothing to run");
    let server = ServeChild::start(&cfg.cxlkv_exe, target)?;
    let sampler = RssSampler::start(server.pid());
    let result = (|| {
        let mut workers = (0..cfg.connections)
            .map(|id| Worker::connect(&server.socket, id))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let warmup = phase(&mut workers, cfg.phase);
        let rss_after_warmup_kib = vm_rss_kib(server.pid())?;
        let mut errors = warmup.errors;
        let (mut load, mut baseline) = (Vec::new(), Vec::new());
        for rep in 0..cfg.reps {
            for first in [rep % 2 == 0, rep % 2 != 0] {
                let r = if first {
                    phase(&mut workers, cfg.phase)
                } else {
                    phase(&mut workers[..1], cfg.phase)
                };
                errors += r.errors;
                if first {
                    load.push(r);
                } else {
                    baseline.push(r);
                }
            }
        }
        let rss_final_kib = vm_rss_kib(server.pid())?;
        for w in workers {
            drop(w.layout);
            w.client.close().context("closing a load client")?;
        }
        Ok::<_, anyhow::Error>((load, baseline, errors, rss_after_warmup_kib, rss_final_kib))
    })();
    let rss_kib = sampler.finish();
    drop(server);
    let (load, baseline, errors, rss_after_warmup_kib, rss_final_kib) = result?;
    let rss_max_kib = rss_kib.iter().map(|s| s.1).max().unwrap_or(rss_final_kib);
    Ok(LoadReport {
        load,
        baseline,
        errors,
        rss_kib,
        rss_after_warmup_kib,
        rss_final_kib,
        rss_max_kib,
    })
}

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let phase_s = match std::env::var("CXLKV_BENCH_LOAD_PHASE_S") {
        Ok(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0 && s.is_finite())
            .with_context(|| format!("CXLKV_BENCH_LOAD_PHASE_S={v:?} is not a positive number"))?,
        Err(_) if args.quick => QUICK_PHASE_S,
        Err(_) => PHASE_S,
    };
    let cfg = LoadConfig {
        cxlkv_exe: std::env::current_exe().context("the cxlkv binary's path")?,
        connections: CONNECTIONS,
        phase: Duration::from_secs_f64(phase_s),
        reps: args.reps,
    };
    r.note(&format!(
        "load: warm-up + {} x ({} s with {} connections, {} s with 1), server RSS every {} ms",
        cfg.reps,
        phase_s,
        cfg.connections,
        phase_s,
        RSS_SAMPLE_EVERY.as_millis()
    ));
    let target = BenchPool::from_args(args)?;
    let report = run_load_on(&cfg, &target)?;
    let med = |v: &[PhaseResult], f: fn(&PhaseResult) -> f64| {
        median(&mut v.iter().map(f).collect::<Vec<_>>())
    };
    let step = report.rss_kib.len().div_ceil(MAX_REPORTED_SAMPLES).max(1);
    let samples: Vec<serde_json::Value> = report
        .rss_kib
        .iter()
        .step_by(step)
        .map(|(t, kib)| serde_json::json!([(t * 10.0).round() / 10.0, kib]))
        .collect();
    let record = Record::new(
        SCENARIO,
        format!("connections={},mix=put+get+exists+delete", cfg.connections),
        med(&report.load, |p| p.ops_per_s),
        med(&report.baseline, |p| p.ops_per_s),
        "ops/s",
        Better::Higher,
    )
    .with(
        "baseline_is",
        "the same mix from 1 connection, same server, same run",
    )
    .with("latency_us_p50", med(&report.load, |p| p.latency_us_p50))
    .with("latency_us_p99", med(&report.load, |p| p.latency_us_p99))
    .with(
        "baseline_latency_us_p99",
        med(&report.baseline, |p| p.latency_us_p99),
    )
    .with("ops", report.load.iter().map(|p| p.ops).sum::<u64>())
    .with(
        "baseline_ops",
        report.baseline.iter().map(|p| p.ops).sum::<u64>(),
    )
    .with("errors", report.errors)
    .with("phase_s", phase_s)
    .with("reps", cfg.reps as u64)
    .with("rss_after_warmup_kib", report.rss_after_warmup_kib)
    .with("rss_final_kib", report.rss_final_kib)
    .with("rss_max_kib", report.rss_max_kib)
    .with("rss_samples_s_kib", samples);
    r.emit(&target.tag(record))?;
    anyhow::ensure!(report.errors == 0, "{} operations failed", report.errors);
    Ok(())
}
