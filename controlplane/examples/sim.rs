//! The deterministic simulation's long form: many seeds on a few threads,
//! or one seed replayed with its event log.
//!
//! ```text
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seeds 1000000 --threads 2 [--first 0] [--long] [--minutes 30] [--no-rare-check]
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seed 1234 [--long] --trace
//! ```
//!
//! With the directory's and the pool manager's `debug_assert!`s (and
//! overflow checks) on, in a target directory of its own so that the
//! ordinary release build stays as it is:
//!
//! ```text
//! CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
//!     cargo run --release --target-dir target/sim-debug-assert \
//!     -p cxlkv-controlplane --features sim --example sim -- --seeds 300 --threads 2
//! ```
//!
//! Prints progress every 10 s and a summary (seeds, events, invariant
//! checks, simulated time, seeds per second, whether debug assertions were
//! on, and how often each rare path ran); every failing seed is printed
//! with the command that replays it — a seed that panics (a failed
//! `assert!` or `debug_assert!` in the code under test) is reported as that
//! seed's failure and the campaign goes on. Exits non-zero if any seed
//! failed, or if a campaign of at least [`RARE_MIN_SEEDS`] seeds never ran
//! one of the rare paths (`RarePaths`): the checks above that path were
//! then not exercised (`--no-rare-check` waives this, for a campaign run in
//! parts).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::sim::{Failure, RarePaths, Report, Scale, replay_command, run_seed};

/// A campaign of at least this many seeds must run every rare path (but
/// the rarest: `rare_missing`).
const RARE_MIN_SEEDS: u64 = 1_000;

#[derive(Debug)]
struct Args {
    first: u64,
    seeds: u64,
    threads: usize,
    scale: Scale,
    trace: bool,
    minutes: Option<u64>,
    rare_check: bool,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        first: 0,
        seeds: 1000,
        threads: 1,
        scale: Scale::Short,
        trace: false,
        minutes: None,
        rare_check: true,
    };
    let mut it = std::env::args().skip(1);
    let number = |v: Option<String>, what: &str| -> Result<u64, String> {
        v.ok_or(format!("{what} needs a value"))?
            .parse()
            .map_err(|e| format!("{what}: {e}"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seed" => {
                args.first = number(it.next(), "--seed")?;
                args.seeds = 1;
            }
            "--first" => args.first = number(it.next(), "--first")?,
            "--seeds" => args.seeds = number(it.next(), "--seeds")?,
            "--threads" => args.threads = number(it.next(), "--threads")?.max(1) as usize,
            "--minutes" => args.minutes = Some(number(it.next(), "--minutes")?),
            "--long" => args.scale = Scale::Long,
            "--trace" => args.trace = true,
            "--no-rare-check" => args.rare_check = false,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

#[derive(Default)]
struct Totals {
    seeds: u64,
    events: u64,
    checks: u64,
    simulated_ns: u64,
    client_crashes: u64,
    directory_restarts: u64,
    pool_restarts: u64,
    torn_tail_bytes: u64,
    partitions: u64,
    pool_link_breaks: u64,
    dropped: u64,
    duplicated: u64,
    notices: u64,
    retries: u64,
    reads: u64,
    rare: RarePaths,
}

impl Totals {
    fn add(&mut self, r: &Report) {
        self.seeds += 1;
        self.events += r.events;
        self.checks += r.checks;
        self.simulated_ns += r.simulated_ns;
        self.client_crashes += r.client_crashes;
        self.directory_restarts += r.directory_restarts;
        self.pool_restarts += r.pool_restarts;
        self.torn_tail_bytes += r.pool.torn_tail_bytes;
        self.partitions += r.partitions;
        self.pool_link_breaks += r.pool_link_breaks;
        self.dropped += r.net.dropped;
        self.duplicated += r.net.duplicated;
        self.notices += r.notices_checked;
        self.retries += r.retries_compared;
        self.reads += r.reads_checked;
        self.rare.add(&r.rare);
    }
}

/// Runs one seed; a panic is that seed's failure, not the campaign's end.
fn run_caught(seed: u64, scale: Scale, trace: bool) -> Result<Report, Failure> {
    std::panic::catch_unwind(|| run_seed(seed, scale, trace)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| String::from("(a panic without a message)"));
        Err(Failure {
            seed,
            event: 0,
            at_ns: 0,
            what: format!("panicked (event and time unknown): {what}"),
        })
    })
}

/// The rare paths that a campaign of `seeds` seeds should have run and
/// did not, by name. Each ran at least a hundred times in 2,000 seeds
/// (390,000–391,999), but a region refused at a reattach: 3 times, so it is
/// required from 5,000 seeds on.
fn rare_missing(r: &RarePaths, seeds: u64) -> Vec<&'static str> {
    [
        ("orphan evictions", r.evicted_orphan, RARE_MIN_SEEDS),
        ("LRU evictions", r.evicted_lru, RARE_MIN_SEEDS),
        (
            "LRU passes over a full notice queue",
            r.lru_skipped,
            RARE_MIN_SEEDS,
        ),
        (
            "LRU-evicted keys owed a notice",
            r.lru_keys_owed_notices,
            RARE_MIN_SEEDS,
        ),
        ("quota refusals", r.quota_refusals, RARE_MIN_SEEDS),
        (
            "deletes refused for a notice backlog",
            r.notice_backlog_refusals,
            RARE_MIN_SEEDS,
        ),
        (
            "Recovered reattaches",
            r.recovered_reattaches,
            RARE_MIN_SEEDS,
        ),
        (
            "retries answered ReplyEvicted",
            r.replies_evicted,
            RARE_MIN_SEEDS,
        ),
        (
            "sessions expired by lease",
            r.sessions_expired,
            RARE_MIN_SEEDS,
        ),
        (
            "instances gone by grace",
            r.instances_expired,
            RARE_MIN_SEEDS,
        ),
        (
            "reattach regions refused NotOwned",
            r.reattach_regions_refused,
            5 * RARE_MIN_SEEDS,
        ),
    ]
    .into_iter()
    .filter(|&(_, n, from)| n == 0 && seeds >= from)
    .map(|(name, _, _)| name)
    .collect()
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if args.seeds == 1 {
        match run_caught(args.first, args.scale, args.trace) {
            Ok(r) => println!("seed {} passed: {r:?}", args.first),
            Err(f) => {
                println!("{f}");
                std::process::exit(1);
            }
        }
        return;
    }
    let next = AtomicU64::new(args.first);
    let end = args.first.saturating_add(args.seeds);
    let stop = AtomicBool::new(false);
    let totals = Mutex::new(Totals::default());
    let failures: Mutex<Vec<Failure>> = Mutex::new(Vec::new());
    let start = Instant::now();
    let deadline = args.minutes.map(|m| start + Duration::from_secs(m * 60));
    std::thread::scope(|s| {
        for _ in 0..args.threads {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end || deadline.is_some_and(|d| Instant::now() >= d) {
                        break;
                    }
                    match run_caught(seed, args.scale, false) {
                        Ok(r) => totals.lock().expect("no panics hold it").add(&r),
                        Err(f) => {
                            println!("FAIL {f}\n  replay: {}", replay_command(seed, args.scale));
                            failures.lock().expect("no panics hold it").push(f);
                        }
                    }
                }
            });
        }
        s.spawn(|| {
            let mut last = Instant::now();
            while next.load(Ordering::Relaxed) < end && deadline.is_none_or(|d| Instant::now() < d)
            {
                std::thread::sleep(Duration::from_millis(200));
                if last.elapsed() >= Duration::from_secs(10) {
                    last = Instant::now();
                    let t = totals.lock().expect("no panics hold it");
                    let secs = start.elapsed().as_secs_f64();
                    println!(
                        "[{secs:>7.0} s] {} seeds ({:.1}/s), {} events, {} failures",
                        t.seeds,
                        t.seeds as f64 / secs,
                        t.events,
                        failures.lock().expect("no panics hold it").len()
                    );
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    let t = totals.lock().expect("no panics hold it");
    let f = failures.lock().expect("no panics hold it");
    let secs = start.elapsed().as_secs_f64();
    println!(
        "seeds {} (from {}, {:?}), failures {}, events {}, invariant checks {}, simulated {:.0} s, \
         wall {secs:.0} s, {:.1} seeds/s, {:.0} events/s; faults: {} client crashes, {} directory \
         restarts, {} pool restarts ({} torn-tail bytes), {} partitions, {} pool connection breaks, \
         {} dropped and {} duplicated messages; {} notices checked, {} replies compared, {} \
         looked-up keys checked; debug assertions {}",
        t.seeds,
        args.first,
        args.scale,
        f.len(),
        t.events,
        t.checks,
        t.simulated_ns as f64 / 1e9,
        t.seeds as f64 / secs,
        t.events as f64 / secs,
        t.client_crashes,
        t.directory_restarts,
        t.pool_restarts,
        t.torn_tail_bytes,
        t.partitions,
        t.pool_link_breaks,
        t.dropped,
        t.duplicated,
        t.notices,
        t.retries,
        t.reads,
        if cfg!(debug_assertions) { "on" } else { "off" },
    );
    let r = &t.rare;
    println!(
        "rare paths: {} orphan and {} LRU evictions, {} LRU passes over a full notice queue, \
         {} LRU-evicted keys owed a notice, {} quota refusals, {} deletes refused for a notice \
         backlog (longest queue seen {}), {} Recovered reattaches, {} reattach regions refused, \
         {} retries answered ReplyEvicted, {} sessions expired, {} instances gone by grace",
        r.evicted_orphan,
        r.evicted_lru,
        r.lru_skipped,
        r.lru_keys_owed_notices,
        r.quota_refusals,
        r.notice_backlog_refusals,
        r.notice_backlog_peak,
        r.recovered_reattaches,
        r.reattach_regions_refused,
        r.replies_evicted,
        r.sessions_expired,
        r.instances_expired,
    );
    let mut failed = !f.is_empty();
    // (A failed seed counts: it ran its paths up to its failure, though
    // its counters are lost.)
    let run = t.seeds + f.len() as u64;
    let missing = rare_missing(r, run);
    if args.rare_check && !missing.is_empty() {
        println!(
            "FAIL: {run} seeds never ran: {} (the checks over those paths were not exercised)",
            missing.join(", ")
        );
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
}
