//! `cxlkv chaos`: a soak test that kills things and checks that nothing is
//! lost, leaked or torn (DESIGN §8, issue 10).
//!
//! # Shape
//!
//! The driver ([`run`]) starts, under a fresh run directory in `/dev/shm`,
//! a `cxlkv pool` daemon (the pool manager, with its own state directory),
//! a `cxlkv serve` using it (`--pool-daemon`, so that each can be restarted
//! without the other), and N instance processes (the hidden `cxlkv
//! chaos-instance`, module [`instance`]): writers, readers and L1-tier
//! users running a seeded random workload on one layout. Then, step by
//! step until the duration is over:
//!
//! 1. wait a random time below `kill_interval_ms`, SIGKILL a random
//!    instance — wherever it is: mid-register, mid-delete, holding pins —
//!    and start its successor (a new incarnation, a new instance id, the
//!    same ledger);
//! 2. every `server_restart_every` steps restart the server, every
//!    `pool_restart_every` steps the pool manager, alternating SIGKILL and
//!    SIGTERM; after a server restart, wait for the live instances to
//!    reattach;
//! 3. check the invariants ([`check::Checker`]): dead incarnations hold no
//!    session and no pin; the pool manager's regions for the directory
//!    match the directory's; the directory holds no key the ledgers cannot
//!    account for; every acknowledged key is readable with its exact bytes
//!    unless a documented rule removed it.
//!
//! At the end every instance is killed, the checks run once more (keys of
//! dead writers must still be there), every key is deleted, and the pool
//! manager's free space must come back to its value before the first
//! instance started, within the directory's grace period. Then the server
//! and the pool manager are stopped with SIGTERM, the run directory is
//! removed — unless the run did not pass: its logs and ledgers are the
//! evidence, and the report says where they are — and any process still
//! mentioning it is reported.
//!
//! A run passes only when every counter of a violation is 0 and no
//! violation was recorded ([`ChaosReport::passed`]): every check that
//! records a violation also counts it in a field of its own. A child that
//! exits by itself — found at a step, or when it is stopped — is a crash.
//! The children do not inherit the operator's `CXLKV_*` configuration
//! variables (module `procs`); the transport backend of a run is chosen
//! with `CXLKV_IO` ([`io_from_env`]), passed to every child explicitly.
//!
//! Every wait is bounded; a Ctrl-C (SIGINT) or SIGTERM ends the loop early
//! and still runs the cleanup.

pub mod check;
pub mod instance;
pub mod ledger;
pub mod payload;
mod procs;

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use check::{Checker, History};
use cxlkv_controlplane::transport::{BackendChoice, IO_ENV, TransportError};
use ledger::now_ms;
use payload::SplitMix64;
use procs::{ChildEnv, Proc, Stop, Stopped, arg};

/// The workload's layout: 16 KiB pages (a chunk is 1..=16 KiB), regions of
/// 2 MiB (128 pages, the pool alignment).
pub const PAGE_SIZE_BYTES: u64 = 16 << 10;
pub const REGION_SIZE_BYTES: u64 = 2 << 20;
pub const FINGERPRINT: u64 = 0xC4A0_5000_0000_0001;
/// The directory id the chaos server uses at the pool manager.
pub const DIRECTORY_ID: &str = "chaos";
/// The pool: small enough for any CI machine's `/dev/shm`, large enough
/// that the workload stays far below the orphan-eviction watermark.
pub const POOL_SIZE_BYTES: u64 = 256 << 20;
/// The pool manager keeps a gone directory's regions this long: longer
/// than any server restart of the run.
const POOL_GRACE_MS: u64 = 120_000;
/// How long the live instances may take to reattach after a server restart.
const REATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// Slack over the directory's grace period for the final reclaim.
const RECLAIM_SLACK: Duration = Duration::from_secs(60);
/// Longest `--grace-ms`: the final reclaim waits for the grace period.
pub const MAX_GRACE_MS: u64 = 3_600_000;
/// Longest `--duration` (a week): every deadline of the run stays far from
/// overflowing the clock.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Most `--instances`: each is a process (re-started at every kill of it)
/// holding a region or two of the 256 MiB pool; 16 is four times the
/// default and every documented run, keeps the pool far below the
/// orphan-eviction watermark and a 2-vCPU CI machine responsive.
pub const MAX_INSTANCES: u32 = 16;
/// Shortest `--kill-interval-ms`: under it the loop kills and restarts
/// instances back to back (a kill every step, the driver busy restarting
/// processes instead of the workload running); the documented runs use
/// 1000 and 1500.
pub const MIN_KILL_INTERVAL_MS: u64 = 100;
/// Longest `--kill-interval-ms` (an hour, as `--grace-ms`): a longer one
/// kills nothing within any sensible run.
pub const MAX_KILL_INTERVAL_MS: u64 = 3_600_000;

/// What an instance does (module [`instance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Writer,
    Reader,
    Tier,
}

impl Role {
    /// The first letter of its instance ids.
    pub fn letter(self) -> char {
        match self {
            Role::Writer => 'w',
            Role::Reader => 'r',
            Role::Tier => 't',
        }
    }

    /// Slot `slot`'s role: writer, reader, tier, writer, …
    pub fn of_slot(slot: u32) -> Role {
        match slot % 3 {
            0 => Role::Writer,
            1 => Role::Reader,
            _ => Role::Tier,
        }
    }

    fn as_arg(self) -> &'static str {
        match self {
            Role::Writer => "writer",
            Role::Reader => "reader",
            Role::Tier => "tier",
        }
    }
}

/// The knobs of a chaos run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub duration: Duration,
    pub instances: u32,
    pub seed: u64,
    pub kill_interval_ms: u64,
    /// Restart the server every this many steps (0: never).
    pub server_restart_every: u64,
    /// Restart the pool manager every this many steps (0: never).
    pub pool_restart_every: u64,
    /// The directory's instance grace period (`--grace-ms` of the server).
    pub grace_ms: u64,
    /// Keep the run directory (ledgers, logs) even when the run passed (one
    /// that did not pass is always kept).
    pub keep_run_dir: bool,
    /// The transport backend of every process of the run (`CXLKV_IO` of
    /// each child; `None`: their default), see [`io_from_env`].
    pub io: Option<String>,
}

/// A chaos configuration that cannot give a meaningful run, found before
/// anything starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosConfigError {
    #[error("--instances {instances} is not in 1..={max} (each is a process)")]
    Instances { instances: u32, max: u32 },
    #[error("--kill-interval-ms {ms} is not in {min}..={max}")]
    KillInterval { ms: u64, min: u64, max: u64 },
    #[error(
        "--grace-ms {grace_ms} is under {min_ms} ms, the shortest instance grace period a server accepts (it would refuse to start)"
    )]
    GraceTooShort { grace_ms: u64, min_ms: u64 },
    #[error("--grace-ms {grace_ms} is over {max_ms} ms (the run's end waits for the grace period)")]
    GraceTooLong { grace_ms: u64, max_ms: u64 },
    #[error("--duration {duration_s} s is over {max_s} s")]
    DurationTooLong { duration_s: u64, max_s: u64 },
}

impl ChaosConfig {
    /// Checks every knob, including those passed through to the server
    /// against the server's own limits ([`crate::server::MIN_INSTANCE_GRACE`]),
    /// so that a bad one is refused at once and by its flag's name instead
    /// of by a server that does not come up.
    pub fn validate(&self) -> Result<(), ChaosConfigError> {
        let min_grace_ms = crate::server::MIN_INSTANCE_GRACE.as_millis() as u64;
        if !(1..=MAX_INSTANCES).contains(&self.instances) {
            return Err(ChaosConfigError::Instances {
                instances: self.instances,
                max: MAX_INSTANCES,
            });
        }
        if !(MIN_KILL_INTERVAL_MS..=MAX_KILL_INTERVAL_MS).contains(&self.kill_interval_ms) {
            return Err(ChaosConfigError::KillInterval {
                ms: self.kill_interval_ms,
                min: MIN_KILL_INTERVAL_MS,
                max: MAX_KILL_INTERVAL_MS,
            });
        }
        if self.grace_ms < min_grace_ms {
            return Err(ChaosConfigError::GraceTooShort {
                grace_ms: self.grace_ms,
                min_ms: min_grace_ms,
            });
        }
        if self.grace_ms > MAX_GRACE_MS {
            return Err(ChaosConfigError::GraceTooLong {
                grace_ms: self.grace_ms,
                max_ms: MAX_GRACE_MS,
            });
        }
        if self.duration > MAX_DURATION {
            return Err(ChaosConfigError::DurationTooLong {
                duration_s: self.duration.as_secs(),
                max_s: MAX_DURATION.as_secs(),
            });
        }
        Ok(())
    }
}

/// The transport backend the driver's `CXLKV_IO` chooses for the run,
/// checked the way the transport reads it: `None` when it is unset, empty
/// or `auto` (each process picks its default), else the value, which the
/// driver's own client uses and every child gets explicitly (the children's
/// other `CXLKV_*` variables are removed). `CXLKV_TRANSPORT_BACKEND` is
/// not passed on: it is configuration of the servers only, and the run's
/// servers take no configuration from the operator's environment.
pub fn io_from_env() -> Result<Option<String>, TransportError> {
    Ok(match BackendChoice::Auto.resolve_env()? {
        BackendChoice::Auto => None,
        _ => std::env::var(IO_ENV).ok(),
    })
}

/// The result of a run: printed as one JSON object by `cxlkv chaos --json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChaosReport {
    pub seed: u64,
    pub duration_s: f64,
    pub instances: u32,
    /// The transport backend the run asked for (`CXLKV_IO`), or `auto`.
    pub io: String,
    pub steps: u64,
    pub kills: u64,
    pub server_restarts: u64,
    pub server_kills: u64,
    pub pool_restarts: u64,
    pub pool_kills: u64,
    pub instance_crashes: u64,
    /// The server or the pool manager exited without being told to.
    pub daemon_crashes: u64,
    /// The server or the pool manager did not exit with status 0 after
    /// SIGTERM (at a restart or at the end), or could not be reaped.
    pub daemon_stop_failures: u64,
    /// Live instances that had not reattached 30 s after a server restart.
    pub reattach_failures: u64,
    pub checks: u64,
    pub acknowledged_keys: u64,
    pub deleted_keys: u64,
    pub keys_verified: u64,
    pub reads_verified: u64,
    /// Views readers held past a lost pin that could not be checked: the
    /// key was gone or had moved when the view was due (each view is
    /// judged on its own; one whose key is still where it reads is
    /// checked and counted in `reads_verified`).
    pub held_reads_skipped: u64,
    /// Acknowledged by a live instance and not readable intact.
    pub lost_keys: u64,
    /// Acknowledged by an instance since killed, missing with no rule to
    /// explain it.
    pub lost_orphan_keys: u64,
    pub corrupt_keys: u64,
    /// Keys of dead writers removed by a directory restart (documented).
    pub keys_gone_by_restart: u64,
    /// Keys the directory evicted from orphaned regions. The pool is sized
    /// so that none is with the default restarts (`POOL_SIZE_BYTES`;
    /// `tests/chaos.rs` asserts 0); a run without server restarts may
    /// reach the watermark. Reported, not a failure by itself.
    pub orphan_evictions: u64,
    /// Keys of dead writers missing after an orphan eviction that was seen
    /// after the writer's death (documented; excused).
    pub keys_gone_by_eviction: u64,
    pub leaked_pins: u64,
    /// Dead incarnations the directory still showed with a session.
    pub dead_sessions: u64,
    /// Checks at which the directory's pin total was not the sum of its
    /// instances' pins.
    pub pin_total_mismatches: u64,
    /// Pages of pool space not back after everything was deleted, plus
    /// keys the directory still held.
    pub leaked_pages: u64,
    pub region_mismatches: u64,
    /// Regions the directory still held after everything was deleted and
    /// the reclaim wait was over.
    pub regions_left: u64,
    pub unaccounted_keys: u64,
    /// Keys answered `Deleted` that existed again later.
    pub resurrected_keys: u64,
    pub torn_reads: u64,
    /// Failed calls of unexpected kinds, and their kinds.
    pub errors: u64,
    pub error_kinds: std::collections::BTreeMap<String, u64>,
    /// Failed calls of the kinds a restart under a call causes.
    pub expected_errors: u64,
    pub expected_error_kinds: std::collections::BTreeMap<String, u64>,
    /// Expected error kinds whose count went over its bound
    /// (`check::EXPECTED_ERRORS_PER_RESTART_AND_INSTANCE` × instances ×
    /// server and pool-manager restarts; none without a restart).
    pub expected_errors_over_bound: u64,
    pub ledger_malformed_lines: u64,
    pub baseline_free_bytes: u64,
    pub final_free_bytes: u64,
    pub leftover_processes: u64,
    pub interrupted: bool,
    /// The first violations, in words.
    pub violations: Vec<String>,
    /// Why the run stopped early, if it did.
    pub aborted: Option<String>,
    /// Where the run directory (child logs, ledgers) was kept: with
    /// `--keep-run-dir`, or because the run did not pass.
    pub run_dir: Option<String>,
}

impl ChaosReport {
    /// True when no invariant was violated and nothing was left behind:
    /// every counter of a violation is 0 and no violation was recorded (a
    /// check that only records one still fails the run).
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
            && self.lost_keys == 0
            && self.lost_orphan_keys == 0
            && self.corrupt_keys == 0
            && self.leaked_pins == 0
            && self.dead_sessions == 0
            && self.pin_total_mismatches == 0
            && self.leaked_pages == 0
            && self.region_mismatches == 0
            && self.regions_left == 0
            && self.unaccounted_keys == 0
            && self.resurrected_keys == 0
            && self.torn_reads == 0
            && self.errors == 0
            && self.expected_errors_over_bound == 0
            && self.instance_crashes == 0
            && self.daemon_crashes == 0
            && self.daemon_stop_failures == 0
            && self.reattach_failures == 0
            && self.leftover_processes == 0
            && self.aborted.is_none()
    }
}

/// Paths of the run.
struct Paths {
    dir: PathBuf,
    pool: PathBuf,
    pool_state: PathBuf,
    pool_socket: PathBuf,
    socket: PathBuf,
}

impl Paths {
    fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            pool: dir.join("pool"),
            pool_state: dir.join("pool-state"),
            pool_socket: dir.join("pool.sock"),
            socket: dir.join("server.sock"),
        }
    }
}

/// One instance slot: its role, current incarnation and process.
struct Slot {
    role: Role,
    incarnation: u32,
    proc: Option<Proc>,
}

/// The driver's state.
struct Driver<'a> {
    cfg: &'a ChaosConfig,
    paths: Paths,
    rng: SplitMix64,
    pool: Option<Proc>,
    server: Option<Proc>,
    slots: Vec<Slot>,
    history: History,
    checker: Checker,
    child_env: ChildEnv,
    report: ChaosReport,
    /// Incarnations killed since the last pin check.
    recently_dead: Vec<String>,
    all_dead: Vec<String>,
    log_serial: u64,
}

/// Runs a chaos soak (see the module essay). `stop_requested` is polled
/// between and inside steps (Ctrl-C). Errors are returned only when the
/// run cannot start (a bad configuration, [`ChaosConfig::validate`]); a
/// failure later is reported in `aborted`, and the run directory is kept.
pub fn run(cfg: &ChaosConfig, stop_requested: &dyn Fn() -> bool) -> anyhow::Result<ChaosReport> {
    cfg.validate()?;
    let dir = tempfile::Builder::new()
        .prefix(&format!("cxlkv-chaos-{}-", cfg.seed))
        .tempdir_in("/dev/shm")
        .context("cannot create the run directory under /dev/shm")?;
    let paths = Paths::new(dir.path());
    let checker = Checker::new(
        &paths.dir,
        cfg.instances,
        paths.socket.clone(),
        paths.pool_socket.clone(),
    );
    let mut d = Driver {
        cfg,
        paths,
        rng: SplitMix64::new(cfg.seed),
        pool: None,
        server: None,
        slots: (0..cfg.instances)
            .map(|s| Slot {
                role: Role::of_slot(s),
                incarnation: 0,
                proc: None,
            })
            .collect(),
        history: History::default(),
        checker,
        child_env: ChildEnv::new(cfg.io.clone()),
        report: ChaosReport {
            seed: cfg.seed,
            instances: cfg.instances,
            io: cfg.io.clone().unwrap_or_else(|| "auto".into()),
            ..ChaosReport::default()
        },
        recently_dead: Vec::new(),
        all_dead: Vec::new(),
        log_serial: 0,
    };
    let started = Instant::now();
    if let Err(e) = d.soak(stop_requested) {
        d.report.aborted = Some(format!("{e:#}"));
    }
    d.report.interrupted = stop_requested();
    d.cleanup();
    d.report.duration_s = started.elapsed().as_secs_f64();
    let leftovers = procs::leftover_processes(d.paths.dir.as_path());
    for (pid, cmd) in &leftovers {
        tracing::error!(pid, cmd, "process left behind");
    }
    d.report.leftover_processes = leftovers.len() as u64;
    let passed = d.report.passed();
    if cfg.keep_run_dir || !passed {
        let kept = dir.keep();
        if passed {
            tracing::warn!(dir = %kept.display(), "run directory kept");
        } else {
            tracing::error!(
                dir = %kept.display(),
                "the run did not pass: its run directory (child logs, ledgers) is kept; remove it when done"
            );
        }
        d.report.run_dir = Some(kept.display().to_string());
    }
    Ok(d.report)
}

impl Driver<'_> {
    fn log_path(&mut self, name: &str) -> PathBuf {
        self.log_serial += 1;
        self.paths
            .dir
            .join(format!("log-{:05}-{name}", self.log_serial))
    }

    fn start_pool(&mut self) -> anyhow::Result<()> {
        let p = &self.paths;
        let args = vec![
            "pool".to_owned(),
            "--pool".to_owned(),
            format!("{},size={POOL_SIZE_BYTES}", p.pool.display()),
            "--state-dir".to_owned(),
            arg(&p.pool_state),
            "--socket".to_owned(),
            arg(&p.pool_socket),
            "--grace-ms".to_owned(),
            POOL_GRACE_MS.to_string(),
        ];
        let log = self.log_path("pool");
        let cmd = procs::command(&args, &log, &self.child_env)?;
        self.pool = Some(Proc::spawn_daemon("the pool manager".into(), cmd, log)?);
        Ok(())
    }

    fn start_server(&mut self) -> anyhow::Result<()> {
        let p = &self.paths;
        let args = vec![
            "serve".to_owned(),
            "--socket".to_owned(),
            arg(&p.socket),
            "--pool-daemon".to_owned(),
            format!("unix:{}", p.pool_socket.display()),
            "--directory-id".to_owned(),
            DIRECTORY_ID.to_owned(),
            "--grace-ms".to_owned(),
            self.cfg.grace_ms.to_string(),
        ];
        let log = self.log_path("server");
        let cmd = procs::command(&args, &log, &self.child_env)?;
        self.server = Some(Proc::spawn_daemon("the server".into(), cmd, log)?);
        Ok(())
    }

    fn start_instance(&mut self, slot: u32) -> anyhow::Result<()> {
        let s = &mut self.slots[slot as usize];
        s.incarnation += 1;
        let (role, incarnation) = (s.role, s.incarnation);
        let args = vec![
            "chaos-instance".to_owned(),
            "--run-dir".to_owned(),
            arg(&self.paths.dir),
            "--socket".to_owned(),
            arg(&self.paths.socket),
            "--slots".to_owned(),
            self.cfg.instances.to_string(),
            "--slot".to_owned(),
            slot.to_string(),
            "--incarnation".to_owned(),
            incarnation.to_string(),
            "--role".to_owned(),
            role.as_arg().to_owned(),
            "--seed".to_owned(),
            self.cfg.seed.to_string(),
        ];
        let id = instance::instance_id(role, slot, incarnation);
        let log = self.log_path(&id);
        let cmd = procs::command(&args, &log, &self.child_env)?;
        self.slots[slot as usize].proc = Some(Proc::spawn(id, cmd, log)?);
        Ok(())
    }

    /// Records the death of slot `slot`'s current incarnation.
    fn died(&mut self, slot: u32) {
        let s = &self.slots[slot as usize];
        self.history.deaths.insert((slot, s.incarnation), now_ms());
        let id = instance::instance_id(s.role, slot, s.incarnation);
        self.recently_dead.push(id.clone());
        self.all_dead.push(id);
    }

    /// Sleeps `total`, in slices, unless a stop is requested.
    fn sleep(&self, total: Duration, stop_requested: &dyn Fn() -> bool) {
        let end = Instant::now() + total;
        while Instant::now() < end && !stop_requested() {
            std::thread::sleep(Duration::from_millis(20).min(end - Instant::now()));
        }
    }

    fn soak(&mut self, stop_requested: &dyn Fn() -> bool) -> anyhow::Result<()> {
        self.start_pool()?;
        self.start_server()?;
        let baseline = self.checker.pool_stats()?;
        self.report.baseline_free_bytes = baseline.pools.iter().map(|p| p.free_bytes).sum();
        for slot in 0..self.cfg.instances {
            self.start_instance(slot)?;
        }
        let deadline = Instant::now() + self.cfg.duration;
        let mut server_kill = true;
        let mut pool_kill = true;
        while Instant::now() < deadline && !stop_requested() {
            let wait = self.rng.below(self.cfg.kill_interval_ms);
            self.sleep(Duration::from_millis(wait), stop_requested);
            if stop_requested() {
                break;
            }
            self.reap_crashed()?;
            self.reap_crashed_daemons()?;
            let slot = self.rng.below(u64::from(self.cfg.instances)) as u32;
            self.kill_instance(slot);
            self.died(slot);
            self.report.kills += 1;
            self.start_instance(slot)?;
            self.report.steps += 1;
            let step = self.report.steps;
            if self.cfg.server_restart_every > 0
                && step.is_multiple_of(self.cfg.server_restart_every)
            {
                let how = if server_kill { Stop::Kill } else { Stop::Term };
                server_kill = !server_kill;
                self.restart_server(how)?;
            }
            if self.cfg.pool_restart_every > 0 && step.is_multiple_of(self.cfg.pool_restart_every) {
                let how = if pool_kill { Stop::Kill } else { Stop::Term };
                pool_kill = !pool_kill;
                self.restart_pool(how)?;
            }
            self.check()?;
        }
        self.finish()
    }

    /// Counts a crash: `p` exited by itself with `status`.
    fn crashed(&mut self, p: &Proc, status: ExitStatus, daemon: bool) {
        if daemon {
            self.report.daemon_crashes += 1;
        } else {
            self.report.instance_crashes += 1;
        }
        let who = if daemon {
            p.name.clone()
        } else {
            format!("instance {}", p.name)
        };
        self.checker.tally.violation(format!(
            "{who} exited by itself ({status}); the end of its log {}:\n{}",
            p.log.display(),
            procs::log_tail(&p.log)
        ));
    }

    /// SIGKILLs slot `slot`'s process, if it has one (false if not); one
    /// that had already exited by itself is counted as a crash.
    fn kill_instance(&mut self, slot: u32) -> bool {
        let Some(mut p) = self.slots[slot as usize].proc.take() else {
            return false;
        };
        match p.stop(Stop::Kill) {
            Stopped::ExitedBefore(status) => self.crashed(&p, status, false),
            Stopped::ByUs(_) => {}
            // Reported with the leftover processes at the end.
            Stopped::NotReaped => tracing::error!(name = %p.name, "not reaped after SIGKILL"),
        }
        true
    }

    /// Stops the server or the pool manager with `how`. One that had
    /// already exited by itself is a crash; one that did not exit with
    /// status 0 after SIGTERM, or could not be reaped, a stop failure.
    fn stop_daemon(&mut self, mut p: Proc, how: Stop) {
        let failure = match p.stop(how) {
            Stopped::ExitedBefore(status) => {
                self.crashed(&p, status, true);
                return;
            }
            Stopped::ByUs(status) if how == Stop::Term && !status.success() => {
                format!("ended ({status}) after SIGTERM instead of exiting with 0")
            }
            Stopped::ByUs(_) => return,
            Stopped::NotReaped => format!("could not be reaped after {}", how.signal_name()),
        };
        self.report.daemon_stop_failures += 1;
        self.checker.tally.violation(format!(
            "{} {failure}; the end of its log {}:\n{}",
            p.name,
            p.log.display(),
            procs::log_tail(&p.log)
        ));
    }

    /// Restarts instances that exited by themselves (each is a crash).
    fn reap_crashed(&mut self) -> anyhow::Result<()> {
        for slot in 0..self.cfg.instances {
            let exited = self.slots[slot as usize]
                .proc
                .as_mut()
                .and_then(Proc::exited);
            if let Some(status) = exited {
                if let Some(p) = self.slots[slot as usize].proc.take() {
                    self.crashed(&p, status, false);
                }
                self.died(slot);
                self.start_instance(slot)?;
            }
        }
        Ok(())
    }

    /// Restarts the server or the pool manager if it exited by itself.
    fn reap_crashed_daemons(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.pool.as_mut().and_then(Proc::exited) {
            if let Some(p) = self.pool.take() {
                self.crashed(&p, status, true);
            }
            self.start_pool()?;
        }
        if let Some(status) = self.server.as_mut().and_then(Proc::exited) {
            if let Some(p) = self.server.take() {
                self.crashed(&p, status, true);
            }
            self.start_server()?;
        }
        Ok(())
    }

    /// Instance ids with a live session now.
    fn attached_ids(&mut self) -> anyhow::Result<Vec<String>> {
        let stats = self.checker.directory_stats()?;
        Ok(stats
            .instances
            .iter()
            .filter(|r| r.sessions > 0 && r.instance_id != "checker")
            .map(|r| r.instance_id.clone())
            .collect())
    }

    fn restart_server(&mut self, how: Stop) -> anyhow::Result<()> {
        let before = self.attached_ids()?;
        self.history.server_restarts.push(now_ms());
        if let Some(s) = self.server.take() {
            self.stop_daemon(s, how);
        }
        self.report.server_restarts += 1;
        if how == Stop::Kill {
            self.report.server_kills += 1;
        }
        self.start_server()?;
        // Live instances reattach and register their keys again; wait
        // for every one that was attached (and is still alive).
        let deadline = Instant::now() + REATTACH_TIMEOUT;
        loop {
            let now = self.attached_ids()?;
            let missing: Vec<&String> = before
                .iter()
                .filter(|id| !now.contains(id) && !self.all_dead.contains(id))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let msg = format!(
                    "instances {missing:?} did not reattach within {} s of a server restart",
                    REATTACH_TIMEOUT.as_secs()
                );
                self.checker.tally.violation(msg);
                self.report.reattach_failures += missing.len() as u64;
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn restart_pool(&mut self, how: Stop) -> anyhow::Result<()> {
        if let Some(p) = self.pool.take() {
            self.stop_daemon(p, how);
        }
        self.report.pool_restarts += 1;
        if how == Stop::Kill {
            self.report.pool_kills += 1;
        }
        self.start_pool()
    }

    fn check(&mut self) -> anyhow::Result<()> {
        let dead = std::mem::take(&mut self.recently_dead);
        self.checker.check_dead_pins(&dead)?;
        self.checker.check_regions()?;
        self.checker.check_unaccounted(&self.history)?;
        self.checker.check_keys(&self.history)?;
        self.checker.check_resurrected(&self.history)
    }

    /// The end of the run: kill every instance (one that had exited by
    /// itself since the last step is a crash), check once more, delete
    /// everything, and wait for the pool to come back to its baseline.
    fn finish(&mut self) -> anyhow::Result<()> {
        for slot in 0..self.cfg.instances {
            if self.kill_instance(slot) {
                self.died(slot);
            }
        }
        let all_dead = self.all_dead.clone();
        self.recently_dead.clear();
        self.checker.check_dead_pins(&all_dead)?;
        self.checker.check_regions()?;
        self.checker.check_keys(&self.history)?;
        self.checker.check_resurrected(&self.history)?;
        let pinned = self.checker.delete_all(&self.history)?;
        if pinned > 0 {
            self.checker.tally.violation(format!(
                "{pinned} keys stayed pinned with no instance alive"
            ));
            self.report.leaked_pins += pinned;
        }
        self.checker.close();
        let deadline = Instant::now() + Duration::from_millis(self.cfg.grace_ms) + RECLAIM_SLACK;
        loop {
            let pool = self.checker.pool_stats()?;
            let free: u64 = pool.pools.iter().map(|p| p.free_bytes).sum();
            self.report.final_free_bytes = free;
            let dir = self.checker.directory_stats()?;
            let back = free == self.report.baseline_free_bytes
                && dir.totals.keys == 0
                && dir.totals.regions == 0;
            if back || Instant::now() >= deadline {
                let missing = self.report.baseline_free_bytes.saturating_sub(free);
                self.report.leaked_pages = missing.div_ceil(PAGE_SIZE_BYTES) + dir.totals.keys;
                self.report.regions_left = dir.totals.regions;
                if !back {
                    self.checker.tally.violation(format!(
                        "after deleting everything: {missing} bytes of the pool not free, {} keys and {} regions left in the directory",
                        dir.totals.keys, dir.totals.regions
                    ));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.checker.close();
        Ok(())
    }

    /// Stops everything (instances, then server and pool manager with
    /// SIGTERM; crashes and stop failures counted as during the run) and
    /// folds the checker's tally into the report.
    fn cleanup(&mut self) {
        self.checker.close();
        for slot in 0..self.cfg.instances {
            self.kill_instance(slot);
        }
        for p in [self.server.take(), self.pool.take()].into_iter().flatten() {
            self.stop_daemon(p, Stop::Term);
        }
        let t = std::mem::take(&mut self.checker.tally);
        let r = &mut self.report;
        r.checks = t.checks;
        r.acknowledged_keys = t.acknowledged_keys;
        r.deleted_keys = t.deleted_keys;
        r.keys_verified = t.keys_verified;
        r.reads_verified = t.reads_verified;
        r.held_reads_skipped = t.held_reads_skipped;
        r.lost_keys = t.lost_keys;
        r.lost_orphan_keys = t.lost_orphan_keys;
        r.corrupt_keys = t.corrupt_keys;
        r.keys_gone_by_restart = t.keys_gone_by_restart;
        r.orphan_evictions = t.orphan_evictions;
        r.keys_gone_by_eviction = t.keys_gone_by_eviction;
        r.leaked_pins += t.leaked_pins;
        r.dead_sessions = t.dead_sessions;
        r.pin_total_mismatches = t.pin_total_mismatches;
        r.region_mismatches = t.region_mismatches;
        r.unaccounted_keys = t.unaccounted_keys;
        r.resurrected_keys = t.resurrected_keys;
        r.torn_reads = t.torn_reads;
        r.errors = t.errors.values().sum();
        r.error_kinds = t.errors;
        r.expected_errors = t.expected_errors.values().sum();
        let mut violations = t.violations;
        for (kind, n, bound) in check::expected_errors_over_bound(
            &t.expected_errors,
            self.cfg.instances,
            r.server_restarts + r.pool_restarts,
        ) {
            r.expected_errors_over_bound += 1;
            let msg = format!(
                "{n} failed calls of the expected kind {kind}, over its bound {bound} ({} per restart and instance; {} server and {} pool-manager restarts, {} instances)",
                check::EXPECTED_ERRORS_PER_RESTART_AND_INSTANCE,
                r.server_restarts,
                r.pool_restarts,
                self.cfg.instances
            );
            tracing::error!("chaos invariant violated: {msg}");
            if violations.len() < check::MAX_VIOLATIONS {
                violations.push(msg);
            }
        }
        r.expected_error_kinds = t.expected_errors;
        r.ledger_malformed_lines = t.ledger_malformed_lines;
        r.violations = violations;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ChaosConfig {
        ChaosConfig {
            duration: Duration::from_secs(20),
            instances: 4,
            seed: 1,
            kill_interval_ms: 1000,
            server_restart_every: 3,
            pool_restart_every: 4,
            grace_ms: 5000,
            keep_run_dir: false,
            io: None,
        }
    }

    #[test]
    fn a_report_with_a_recorded_violation_does_not_pass_even_with_every_counter_zero() {
        assert!(ChaosReport::default().passed());
        let report = ChaosReport {
            violations: vec!["the server exited with exit status: 1 after SIGTERM, not 0".into()],
            ..ChaosReport::default()
        };
        assert!(!report.passed());
    }

    #[test]
    fn each_counter_of_a_check_that_records_a_violation_fails_the_run() {
        type Set = fn(&mut ChaosReport);
        let counters: [(&str, Set); 5] = [
            ("daemon_stop_failures", |r| r.daemon_stop_failures = 1),
            ("dead_sessions", |r| r.dead_sessions = 1),
            ("pin_total_mismatches", |r| r.pin_total_mismatches = 1),
            ("regions_left", |r| r.regions_left = 1),
            ("expected_errors_over_bound", |r| {
                r.expected_errors_over_bound = 1
            }),
        ];
        for (name, set) in counters {
            let mut report = ChaosReport::default();
            set(&mut report);
            assert!(!report.passed(), "{name} = 1 passed");
        }
    }

    #[test]
    fn a_grace_period_the_server_would_refuse_is_refused_up_front_by_its_flag() {
        let min_ms = crate::server::MIN_INSTANCE_GRACE.as_millis() as u64;
        let short = ChaosConfig {
            grace_ms: min_ms - 1,
            ..config()
        };
        let err = short.validate().expect_err("under the server's minimum");
        assert_eq!(
            err,
            ChaosConfigError::GraceTooShort {
                grace_ms: min_ms - 1,
                min_ms
            }
        );
        assert!(err.to_string().contains("--grace-ms"), "{err}");
        let at_min = ChaosConfig {
            grace_ms: min_ms,
            ..config()
        };
        assert_eq!(at_min.validate(), Ok(()));
        let long = ChaosConfig {
            grace_ms: MAX_GRACE_MS + 1,
            ..config()
        };
        assert!(matches!(
            long.validate(),
            Err(ChaosConfigError::GraceTooLong { .. })
        ));
    }

    #[test]
    fn a_duration_or_counts_that_cannot_make_a_run_are_refused_up_front() {
        let cases = [
            ChaosConfig {
                instances: 0,
                ..config()
            },
            ChaosConfig {
                instances: MAX_INSTANCES + 1,
                ..config()
            },
            ChaosConfig {
                kill_interval_ms: 0,
                ..config()
            },
            ChaosConfig {
                kill_interval_ms: MIN_KILL_INTERVAL_MS - 1,
                ..config()
            },
            ChaosConfig {
                kill_interval_ms: MAX_KILL_INTERVAL_MS + 1,
                ..config()
            },
            ChaosConfig {
                duration: MAX_DURATION + Duration::from_secs(1),
                ..config()
            },
        ];
        for cfg in cases {
            assert!(cfg.validate().is_err(), "{cfg:?} accepted");
        }
        assert_eq!(config().validate(), Ok(()));
        for edge in [
            ChaosConfig {
                instances: MAX_INSTANCES,
                ..config()
            },
            ChaosConfig {
                kill_interval_ms: MIN_KILL_INTERVAL_MS,
                ..config()
            },
            ChaosConfig {
                kill_interval_ms: MAX_KILL_INTERVAL_MS,
                ..config()
            },
        ] {
            assert_eq!(edge.validate(), Ok(()), "{edge:?}");
        }
    }
}
