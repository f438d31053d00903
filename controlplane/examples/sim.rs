//! The deterministic simulation's long form: many seeds on a few threads,
//! or one seed replayed with its event log.
//!
//! ```text
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seeds 1000000 --threads 2 [--first 0] [--long] [--minutes 30]
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seed 1234 [--long] --trace
//! ```
//!
//! Prints progress every 10 s and a summary (seeds, events, invariant
//! checks, simulated time, seeds per second); every failing seed is printed
//! with the command that replays it. Exits non-zero if any seed failed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::sim::{Failure, Report, Scale, replay_command, run_seed};

#[derive(Debug)]
struct Args {
    first: u64,
    seeds: u64,
    threads: usize,
    scale: Scale,
    trace: bool,
    minutes: Option<u64>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        first: 0,
        seeds: 1000,
        threads: 1,
        scale: Scale::Short,
        trace: false,
        minutes: None,
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
    }
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
        match run_seed(args.first, args.scale, args.trace) {
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
                    match run_seed(seed, args.scale, false) {
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
         {} dropped and {} duplicated messages; {} notices checked, {} replies compared",
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
    );
    if !f.is_empty() {
        std::process::exit(1);
    }
}
