//! The `cxlkv` command line.
//!
//! Subcommands are thin: each parses its flags and calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::bench::Reporter;

pub mod chaos;
pub mod demo;
mod notify;
pub mod pool;
pub mod serve;
mod signals;
pub mod stats;
pub mod top;

#[derive(Debug, Parser)]
#[command(
    name = "cxlkv",
    version,
    about = "KV-cache storage engine on shared (CXL) memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one benchmark scenario (bench contract: docs/benchmarks.md).
    Bench(BenchArgs),
    /// The main job on one machine, nothing to set up: instance processes
    /// share KV chunks through a pool; report vs a TCP transfer.
    Demo(demo::DemoArgs),
    /// Kill instances, the server and the pool manager at random under a
    /// workload, and check that nothing is lost, leaked or torn.
    Chaos(chaos::ChaosArgs),
    /// One instance process of `cxlkv chaos` (started by it).
    #[command(hide = true)]
    ChaosInstance(chaos::InstanceArgs),
    /// Run the pool manager as a standalone daemon (several directories
    /// sharing one device).
    Pool(pool::PoolArgs),
    /// Run the directory server with its embedded pool manager (with no
    /// arguments: the default pool under /dev/shm, the default socket).
    Serve(serve::ServeArgs),
    /// Print a running server's statistics (a table, or `--json`).
    Stats(stats::StatsArgs),
    /// Watch a running server live (pools, operations, instances, pins).
    Top(top::TopArgs),
}

/// Flags shared by every bench scenario.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The scenario to run (see `cxlkv bench --list`).
    #[arg(required_unless_present = "list")]
    pub scenario: Option<String>,
    /// Print JSON Lines (one object per case) and nothing else on stdout.
    #[arg(long)]
    pub json: bool,
    /// List the scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Pool to measure on: a `/dev/daxX.Y` device, or an existing file on
    /// hugetlbfs, tmpfs or a DAX file system (a short file is grown). The
    /// bench WRITES into it (`copy` overwrites its first bytes; its header
    /// block is zeroed before each server starts): never a pool that holds
    /// data. Taken by every scenario but `alloc` and `directory-memory`.
    /// Default: a temporary file under `/dev/shm` per server (the embedded
    /// default backing).
    #[arg(long, env = "CXLKV_BENCH_POOL")]
    pub pool: Option<PathBuf>,
    /// Repetitions per case; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// A CI-sized run: fewer and smaller cases, seconds not minutes.
    #[arg(long)]
    pub quick: bool,
    /// `bench pool`: directory in which the journals are kept (default
    /// `/dev/shm`); one on a real disk includes the cost of `fdatasync`. The
    /// other scenarios ignore it (with a note).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Threads, for the scenarios that take them: `alloc` (cases
    /// `threads=1` and `threads=N`), `pool` (N clients); the others ignore it
    /// (with a note). Overrides `CXLKV_BENCH_THREADS`.
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
            .range(1..=crate::bench::MAX_THREADS as u64)
    )]
    pub threads: Option<usize>,
    /// Chunk sizes, comma-separated (`4096`, `64KiB`, `1MiB`, `1GiB`; at most
    /// 1 GiB each), for the scenarios that take them: `copy` (its sizes),
    /// `store` (one case per size); the others ignore it (with a note).
    /// Overrides `CXLKV_BENCH_CHUNK_SIZES`.
    #[arg(long, value_name = "LIST")]
    pub chunk_sizes: Option<String>,
}

/// Entry point of the `cxlkv` binary.
pub fn main() -> ExitCode {
    // `cxlkv bench --help` (and `cxlkv bench SCENARIO --help`) ends with
    // the scenarios and what each measures.
    let command = Cli::command().mut_subcommand("bench", |c| c.after_help(bench_after_help()));
    let cli = Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Bench(args) => {
            init_tracing("warn");
            run_bench(&args)
        }
        Command::Demo(args) => {
            init_tracing("warn");
            demo::run(&args)
        }
        Command::Chaos(args) => {
            init_tracing("warn");
            match chaos::run(&args) {
                Ok(true) => Ok(()),
                Ok(false) => return ExitCode::FAILURE,
                Err(e) => Err(e),
            }
        }
        Command::ChaosInstance(args) => {
            init_tracing("warn");
            chaos::run_instance(&args)
        }
        Command::Pool(args) => {
            init_tracing("info");
            pool::run(&args)
        }
        Command::Serve(args) => {
            init_tracing("info");
            serve::run(&args)
        }
        Command::Stats(args) => {
            init_tracing("warn");
            stats::run(&args)
        }
        Command::Top(args) => {
            init_tracing("error");
            top::run(&args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, as `{:#}` prints them, but each
/// said once ([`ErrorChain`]): many error types put their cause in their
/// own message *and* return it as `source()` (`pool P: cannot open pool P`
/// over `cannot open pool P`), which `{:#}` would repeat.
fn error_text(err: &anyhow::Error) -> String {
    crate::client::ErrorChain(err.as_ref()).to_string()
}

/// Logs to stderr, filtered by `CXLKV_LOG` (default: `default_level`).
fn init_tracing(default_level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("CXLKV_LOG").unwrap_or_else(|_| EnvFilter::new(default_level));
    // Logs go to stderr so that `--json` output on stdout stays machine-readable.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// A bench scenario: its name, a one-line description, and its entry point.
pub(crate) type Scenario = (
    &'static str,
    &'static str,
    fn(&BenchArgs, &mut Reporter) -> anyhow::Result<()>,
);

pub(crate) const SCENARIOS: &[Scenario] = &[
    (
        "copy",
        "copy_in GB/s vs ptr::copy_nonoverlapping into the pool (--pool, else dest=shm and hugetlb; plus a written-back memcpy baseline)",
        crate::bench::copy::run,
    ),
    (
        "rtt",
        "control-plane round trip (transport) vs a raw busy-polling socket ping-pong",
        crate::bench::rtt::run,
    ),
    (
        "alloc",
        "page allocator alloc+free pairs/s vs a Mutex<Vec> free list (threads=1, threads=2)",
        crate::bench::alloc::run,
    ),
    (
        "store",
        "client batch_put GB/s vs memcpy of the same bytes into a region of the same pool (--pool, else /dev/shm)",
        crate::bench::store::run,
    ),
    (
        "share",
        "a second process reads 16 x 4 MiB chunks in place vs over loopback TCP (warm, cold)",
        crate::bench::share::run,
    ),
    (
        "exists",
        "Exists through the real server (Unix socket, 100-byte keys) vs a raw socket exchange of the same sizes (batch=1, 64, 512)",
        crate::bench::server::run_exists,
    ),
    (
        "lookup",
        "Lookup with one pin per key through the real server vs a raw socket exchange of the same sizes (batch=1, 64, 512)",
        crate::bench::server::run_lookup,
    ),
    (
        "directory-memory",
        "directory state machine: resident bytes per key (1 M keys) and ns per key",
        crate::bench::directory_memory::run,
    ),
    (
        "pool",
        "alloc+free through a cxlkv pool daemon vs the pool state machine in process",
        crate::bench::pool::run,
    ),
    (
        "tier",
        "L1 tier reserve_read+finish_read keys/s (64-key batches) vs batch_get + explicit unpin flush",
        crate::bench::tier::run,
    ),
    (
        "load",
        "64 client connections x put/get/exists/delete against one `cxlkv serve` vs the same mix from 1 connection; p99, server RSS",
        crate::bench::load::run,
    ),
];

/// The end of `cxlkv bench --help`: every scenario with what it measures,
/// and where its cases, fields and targets are described.
fn bench_after_help() -> String {
    let mut text = String::from("Scenarios (also `cxlkv bench --list`):\n");
    for (name, about, _) in SCENARIOS {
        text.push_str(&format!("  {name:<18} {about}\n"));
    }
    text.push_str(
        "\nEach measures cxlkv (`ours`) and a baseline in the same run; `ratio > 1` means cxlkv \
         is better. Cases, record fields and documented targets: docs/benchmarks.md. The \
         whole suite, with a report: scripts/hwbench.sh.",
    );
    text
}

fn run_bench(args: &BenchArgs) -> anyhow::Result<()> {
    if args.list {
        for (name, about, _) in SCENARIOS {
            println!("{name:<18} {about}");
        }
        return Ok(());
    }
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    let name = args.scenario.as_deref().unwrap_or_default();
    let Some((_, _, run)) = SCENARIOS.iter().find(|(n, _, _)| *n == name) else {
        let known: Vec<&str> = SCENARIOS.iter().map(|(n, _, _)| *n).collect();
        anyhow::bail!(
            "unknown bench scenario {name:?}; known: {}",
            known.join(", ")
        );
    };
    let mut reporter = Reporter::new(args.json);
    crate::bench::check_flags(name, args, &reporter)?;
    // What benches killed outright left in /dev/shm and $TMPDIR (their pools
    // take RAM until removed).
    crate::bench::stale::sweep(&reporter);
    run(args, &mut reporter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// An error whose message already holds its cause's text is printed
    /// with each cause once (a refused pool used to read `cannot open pool
    /// P: cannot open pool P: No such file or directory`).
    #[test]
    fn an_error_is_printed_with_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot open pool /dev/dax9.9")]
        struct Open(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("pool /dev/dax9.9: {0}")]
        struct Pool(#[source] Open);
        let enoent = std::io::Error::from_raw_os_error(libc::ENOENT);
        let err = anyhow::Error::from(Pool(Open(enoent))).context("cannot start the pool manager");
        assert_eq!(
            error_text(&err),
            format!(
                "cannot start the pool manager: pool /dev/dax9.9: cannot open pool /dev/dax9.9: {}",
                std::io::Error::from_raw_os_error(libc::ENOENT)
            )
        );
        // Causes that are not repeated are all kept, in order.
        let err = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_text(&err), "outer: middle: inner");
    }

    /// `--tcp HOST:PORT` of `stats` and `top` takes a host name, as
    /// `serve --tcp`, `pool --tcp` and the C API's `tcp_addr` do (it used to
    /// be parsed as an IP socket address only).
    #[test]
    fn stats_and_top_take_a_host_name_in_tcp() {
        use crate::client::ServerAddr;
        let client_config = |tool: &str, addr: &str| {
            let cli = Cli::try_parse_from(["cxlkv", tool, "--tcp", addr])
                .unwrap_or_else(|e| panic!("{tool} --tcp {addr}: {e}"));
            let (Command::Stats(stats::StatsArgs { connect, .. })
            | Command::Top(top::TopArgs { connect, .. })) = &cli.command
            else {
                panic!("{tool} parsed as {:?}", cli.command)
            };
            connect.client_config(tool)
        };
        for tool in ["stats", "top"] {
            let cfg = client_config(tool, "localhost:7411").expect("localhost resolves");
            match cfg.server {
                ServerAddr::Tcp(addr) => {
                    assert!(addr.ip().is_loopback() && addr.port() == 7411, "{addr}")
                }
                other => panic!("{tool}: {other:?}"),
            }
            let e = client_config(tool, "localhost").unwrap_err().to_string();
            assert!(e.contains("--tcp") && e.contains("host:port"), "{e}");
        }
    }
}
