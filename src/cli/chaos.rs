//! `cxlkv chaos`: the chaos soak (module [`crate::chaos`]), and the hidden
//! `cxlkv chaos-instance` its instance processes run.
//!
//! `cxlkv chaos --duration 60 --json` prints one JSON object (the
//! [`ChaosReport`](crate::chaos::ChaosReport)) on standard output and
//! nothing else; without `--json` a pretty-printed one and a verdict line.
//! Logs go to standard error (`CXLKV_LOG`, default `warn`; the children's
//! logs, `CXLKV_CHAOS_CHILD_LOG`, default `warn`, go to files in the run
//! directory, kept with `--keep-run-dir` and whenever the run did not pass:
//! the report's `run_dir` says where). It exits non-zero when an invariant
//! was violated, and with an error before starting anything when a flag is
//! out of range (e.g. a `--grace-ms` the server would refuse). The
//! children get none of the operator's `CXLKV_*` variables; `CXLKV_IO`
//! (`uring` / `fallback`) chooses the transport backend of the whole run
//! and is passed to each of them. SIGINT (Ctrl-C) or SIGTERM end the soak
//! early (SIGINT and SIGHUP unless ignored when it started, as in
//! `cxlkv serve`): the final checks and the cleanup still run and the report
//! says `"interrupted": true`.

use std::cell::Cell;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::chaos::{self, ChaosConfig, Role, instance::InstanceSpec};

/// Flags of `cxlkv chaos`.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// How long to run the kill loop, in seconds (the final checks and the
    /// reclaim wait come after it).
    #[arg(long, default_value_t = 60)]
    pub duration: u64,
    /// Print one JSON object and nothing else on stdout.
    #[arg(long)]
    pub json: bool,
    /// Instance processes (roles cycle writer, reader, tier); 1..=16.
    #[arg(long, default_value_t = 4)]
    pub instances: u32,
    /// Seed of the run (default: from the clock; printed in the report).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Kills come at a random moment within each interval of this length;
    /// 100..=3600000.
    #[arg(long, default_value_t = 1500)]
    pub kill_interval_ms: u64,
    /// Restart the server every this many kills (alternately SIGKILL and
    /// SIGTERM); 0: never.
    #[arg(long, default_value_t = 4)]
    pub server_restart_every: u64,
    /// Restart the pool manager every this many kills (alternately SIGKILL
    /// and SIGTERM); 0: never.
    #[arg(long, default_value_t = 5)]
    pub pool_restart_every: u64,
    /// The directory's instance grace period, in ms (how long a dead
    /// instance's empty regions wait, and restarted directories wait for
    /// their instances); at least the server's minimum, 100.
    #[arg(long, default_value_t = 5000)]
    pub grace_ms: u64,
    /// Keep the run directory (ledgers, child logs) even when the run
    /// passed (a run that did not pass always keeps it).
    #[arg(long)]
    pub keep_run_dir: bool,
}

/// Flags of the hidden `cxlkv chaos-instance` (started by `cxlkv chaos`).
#[derive(Debug, Args)]
pub struct InstanceArgs {
    #[arg(long)]
    pub run_dir: PathBuf,
    #[arg(long)]
    pub socket: PathBuf,
    #[arg(long)]
    pub slots: u32,
    #[arg(long)]
    pub slot: u32,
    #[arg(long)]
    pub incarnation: u32,
    #[arg(long, value_enum)]
    pub role: Role,
    #[arg(long)]
    pub seed: u64,
}

/// Runs `cxlkv chaos`; `Ok(false)` when an invariant was violated.
pub fn run(args: &ChaosArgs) -> anyhow::Result<bool> {
    // Before any thread starts, so that every thread inherits the mask and
    // a Ctrl-C waits to be taken here instead of killing the driver before
    // its cleanup. Children get an empty mask (std resets it at spawn).
    let signals = super::signals::block_stop_signals()?;
    let stopped = Cell::new(false);
    let stop_requested = || {
        if !stopped.get() && super::signals::wait_signal(&signals, Duration::ZERO).is_some() {
            tracing::warn!("stop requested: finishing the run and cleaning up");
            stopped.set(true);
        }
        stopped.get()
    };
    let cfg = ChaosConfig {
        duration: Duration::from_secs(args.duration),
        instances: args.instances,
        seed: args.seed.unwrap_or_else(chaos::ledger::now_ms),
        kill_interval_ms: args.kill_interval_ms,
        server_restart_every: args.server_restart_every,
        pool_restart_every: args.pool_restart_every,
        grace_ms: args.grace_ms,
        keep_run_dir: args.keep_run_dir,
        io: chaos::io_from_env()?,
    };
    let report = chaos::run(&cfg, &stop_requested)?;
    let passed = report.passed();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
        println!(
            "chaos: {} (seed {})",
            if passed { "PASSED" } else { "FAILED" },
            report.seed
        );
        if let Some(dir) = &report.run_dir {
            println!("chaos: run directory kept: {dir}");
        }
    }
    Ok(passed)
}

/// Runs one chaos instance until it is killed.
pub fn run_instance(args: &InstanceArgs) -> anyhow::Result<()> {
    chaos::instance::run(InstanceSpec {
        run_dir: args.run_dir.clone(),
        socket: args.socket.clone(),
        slots: args.slots,
        slot: args.slot,
        incarnation: args.incarnation,
        role: args.role,
        seed: args.seed,
    })
}
