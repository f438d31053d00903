//! `cxlkv demo`: the README's first command (see [`crate::demo`]).
//!
//! With no flags it runs 4 instance processes on 32 documents of 256 KiB
//! chunks for 10 s on a private pool under `/dev/shm`, draws a progress bar
//! when standard error is a terminal, and prints a report (`--json`: one
//! JSON object and nothing else on standard output). SIGINT and SIGTERM
//! stop the run: everything it started is stopped and removed, and it exits
//! non-zero. The hidden `--instance` flags are the instance processes' own
//! command line.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::config::parse_bytes;
use crate::demo::{self, DemoConfig, instance::InstanceConfig};

/// Flags of `cxlkv demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Instance processes: one prefill instance and its peers.
    #[arg(long, default_value_t = 4)]
    pub instances: u32,
    /// Bytes per KV chunk (one pool page), a multiple of 4 KiB: e.g. 65536,
    /// 256KiB, 2MiB.
    #[arg(long, default_value = "256KiB", value_parser = parse_bytes)]
    pub chunk_size: u64,
    /// Documents whose prefixes the instances share.
    #[arg(long, default_value_t = 32)]
    pub documents: u32,
    /// Seconds the instances serve requests (after the prefill).
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Pool file or device; created and removed if it does not exist, kept
    /// otherwise. Default: a private file under /dev/shm.
    #[arg(long)]
    pub pool: Option<PathBuf>,
    /// Print one JSON object and nothing else on standard output.
    #[arg(long)]
    pub json: bool,
    /// Run as instance process N (started by the demo itself).
    #[arg(long, hide = true, requires_all = ["socket", "parent_pid", "region_size"])]
    pub instance: Option<u32>,
    #[arg(long, hide = true)]
    pub socket: Option<PathBuf>,
    #[arg(long, hide = true)]
    pub parent_pid: Option<u32>,
    #[arg(long, hide = true)]
    pub region_size: Option<u64>,
}

/// Entry point of `cxlkv demo`.
pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    if let Some(index) = args.instance {
        return run_instance(index, args);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing the signal handler")?;
    }
    let cfg = DemoConfig {
        instances: args.instances,
        chunk_size_bytes: args.chunk_size,
        documents: args.documents,
        duration: Duration::from_secs(args.duration),
        pool: args.pool.clone(),
        progress: std::io::stderr().is_terminal(),
    };
    let report = demo::run(&cfg, &stop)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &report)?;
        std::io::Write::write_all(&mut out, b"\n")?;
    } else {
        report.print_human(&mut out)?;
    }
    anyhow::ensure!(
        report.leftover_processes == 0,
        "{} instance processes survived SIGKILL",
        report.leftover_processes
    );
    Ok(())
}

fn run_instance(index: u32, args: &DemoArgs) -> anyhow::Result<()> {
    let missing = |flag: &str| format!("--instance needs {flag}");
    let cfg = InstanceConfig {
        index,
        instances: args.instances,
        socket: args.socket.clone().with_context(|| missing("--socket"))?,
        parent_pid: args.parent_pid.with_context(|| missing("--parent-pid"))?,
        chunk_size_bytes: usize::try_from(args.chunk_size).context("--chunk-size")?,
        documents: args.documents,
        region_size_bytes: args.region_size.with_context(|| missing("--region-size"))?,
        duration: Duration::from_secs(args.duration),
    };
    demo::instance::run(cfg).with_context(|| format!("demo instance {index}"))
}
