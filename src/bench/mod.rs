//! `cxlkv bench`: the bench contract of DESIGN §7.
//!
//! Every scenario measures cxlkv (`ours`) and a baseline or physical ceiling
//! (`baseline`) **in the same run**, interleaved where possible, and reports
//! the median of several repetitions. `ratio > 1` always means cxlkv is
//! better: for throughputs `ours / baseline`, for latencies `baseline / ours`.
//! With `--json` a scenario prints JSON Lines (one object per case) and
//! nothing else on standard output; without it, a human-readable table.
//!
//! **Which pool.** Every scenario that starts a server or maps a pool
//! measures on `--pool` when given (`pool_target`), and every record of
//! those says where (`pool`, `dest`).
//!
//! **Threads and chunk sizes** come from the flags `--threads N` and
//! `--chunk-sizes LIST`, or, when a flag is not given, from the environment,
//! as `scripts/hwbench.sh` passes them too: `CXLKV_BENCH_THREADS=N` and
//! `CXLKV_BENCH_CHUNK_SIZES=64KiB,1MiB,…`. They are taken by the scenarios in
//! [`THREADS_TAKEN_BY`] and [`CHUNK_SIZES_TAKEN_BY`], which echo them in
//! their records (`threads`, `chunk_bytes`, and `sizes_from`: which of the
//! two gave the sizes); a malformed value is an error. The other scenarios
//! do not read them: a flag given to one of those is checked and then
//! ignored with a note on standard error ([`check_flags`]), the variables
//! are not read at all (hwbench sets them for every scenario of a run).
//! Scenarios read them through [`threads`] and [`chunk_sizes`] only.
//!
//! **Files.** Everything a bench creates in `/dev/shm` and `$TMPDIR` is
//! named after its pid and removed when it ends; what a bench killed
//! outright (`SIGKILL`) could not remove, the next bench removes before it
//! runs, with a note on standard error (`stale`).

pub mod alloc;
pub mod copy;
pub mod directory_memory;
pub(crate) mod forked_server;
pub mod load;
pub mod pool;
pub(crate) mod pool_target;
pub mod rtt;
mod rtt_get;
mod rtt_split;
pub mod server;
pub mod share;
pub(crate) mod stale;
pub mod store;
pub mod tier;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::cli::BenchArgs;

/// Which direction of a figure is better; decides how `ratio` is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// Throughputs (GB/s, ops/s): `ratio = ours / baseline`.
    Higher,
    /// Latencies and durations: `ratio = baseline / ours`.
    Lower,
}

/// One line of the bench contract.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub scenario: String,
    pub case: String,
    pub ours: f64,
    pub baseline: f64,
    pub unit: String,
    pub ratio: f64,
    /// Scenario-specific fields, flattened into the same JSON object.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Record {
    /// Builds a record; `ratio` follows from `better`.
    pub fn new(
        scenario: &str,
        case: impl Into<String>,
        ours: f64,
        baseline: f64,
        unit: &str,
        better: Better,
    ) -> Self {
        let ratio = match better {
            Better::Higher if baseline > 0.0 => ours / baseline,
            Better::Lower if ours > 0.0 => baseline / ours,
            _ => 0.0,
        };
        Self {
            scenario: scenario.to_owned(),
            case: case.into(),
            ours,
            baseline,
            unit: unit.to_owned(),
            ratio,
            extra: serde_json::Map::new(),
        }
    }

    /// Adds a scenario-specific field.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extra.insert(key.to_owned(), value.into());
        self
    }
}

/// Where records go: JSON Lines on stdout, or a human table.
#[derive(Debug)]
pub struct Reporter {
    json: bool,
    header_printed: bool,
}

impl Reporter {
    pub fn new(json: bool) -> Self {
        Self {
            json,
            header_printed: false,
        }
    }

    /// True in `--json` mode: scenarios must then keep stdout clean (progress
    /// and notes go to stderr).
    pub fn is_json(&self) -> bool {
        self.json
    }

    /// Emits one record immediately (so a long scenario streams its cases).
    pub fn emit(&mut self, record: &Record) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        if self.json {
            let line = serde_json::to_string(record).map_err(std::io::Error::other)?;
            writeln!(out, "{line}")?;
        } else {
            if !self.header_printed {
                writeln!(
                    out,
                    "{:<10} {:<40} {:>14} {:>14} {:<10} {:>7}  extra",
                    "scenario", "case", "ours", "baseline", "unit", "ratio"
                )?;
                self.header_printed = true;
            }
            let extra = if record.extra.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(record.extra.clone()).to_string()
            };
            writeln!(
                out,
                "{:<10} {:<40} {:>14.3} {:>14.3} {:<10} {:>7.3}  {}",
                record.scenario,
                record.case,
                record.ours,
                record.baseline,
                record.unit,
                record.ratio,
                extra
            )?;
        }
        out.flush()
    }

    /// A note for the human reader; always on stderr so `--json` stays clean.
    pub fn note(&self, msg: &str) {
        eprintln!("note: {msg}");
    }
}

/// Median of a non-empty sample (the mean of the middle two for even sizes).
///
/// # Panics
/// On an empty sample: every scenario runs at least one repetition.
pub fn median(samples: &mut [f64]) -> f64 {
    assert!(!samples.is_empty(), "median of an empty sample");
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    }
}

/// Percentile (0..=100) of a sample by nearest rank; sorts in place.
///
/// # Panics
/// On an empty sample.
pub fn percentile(samples: &mut [f64], pct: f64) -> f64 {
    assert!(!samples.is_empty(), "percentile of an empty sample");
    samples.sort_by(f64::total_cmp);
    let rank = ((pct / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

/// `CXLKV_BENCH_THREADS`: the thread count for scenarios that take one.
pub const THREADS_ENV: &str = "CXLKV_BENCH_THREADS";
/// `CXLKV_BENCH_CHUNK_SIZES`: chunk sizes for scenarios that take them.
pub const CHUNK_SIZES_ENV: &str = "CXLKV_BENCH_CHUNK_SIZES";
/// Most threads a scenario accepts from [`THREADS_ENV`].
pub const MAX_THREADS: usize = 1024;
/// Largest chunk accepted from [`CHUNK_SIZES_ENV`] (1 GiB).
pub const MAX_CHUNK_BYTES: usize = 1 << 30;
/// Most sizes in [`CHUNK_SIZES_ENV`].
pub const MAX_CHUNK_SIZES: usize = 32;

/// Scenarios that take a thread count (`scripts/hwbench.sh` keeps the same
/// list in `THREADS_TAKEN_BY`; a unit test compares them).
pub const THREADS_TAKEN_BY: &[&str] = &["alloc", "pool"];
/// Scenarios that take chunk sizes (hwbench's `CHUNKS_TAKEN_BY`).
pub const CHUNK_SIZES_TAKEN_BY: &[&str] = &["copy", "store"];

/// Scenarios that take `--state-dir`.
pub const STATE_DIR_TAKEN_BY: &[&str] = &["pool"];
/// Scenarios whose state is in process memory, never in a pool: `--pool`
/// (or `CXLKV_BENCH_POOL`) does not apply to them (records say `pool`
/// `none`).
pub const POOL_IGNORED_BY: &[&str] = &["alloc", "directory-memory"];

/// Before scenario `name` runs: a malformed `--chunk-sizes` is refused
/// whichever scenario it was given to (`--threads` is checked by the
/// parser), and a flag the scenario does not take is noted as ignored.
pub fn check_flags(name: &str, args: &BenchArgs, reporter: &Reporter) -> anyhow::Result<()> {
    if let Some(raw) = &args.chunk_sizes {
        parse_chunk_sizes(raw).with_context(|| format!("--chunk-sizes {raw:?}"))?;
    }
    if args.pool.is_some() && POOL_IGNORED_BY.contains(&name) {
        reporter.note(&format!(
            "--pool (or CXLKV_BENCH_POOL) is ignored by `{name}`: its state is in this \
             process's memory (records say pool: none)"
        ));
    }
    let ignored = [
        ("--threads", args.threads.is_some(), THREADS_TAKEN_BY),
        (
            "--chunk-sizes",
            args.chunk_sizes.is_some(),
            CHUNK_SIZES_TAKEN_BY,
        ),
        ("--state-dir", args.state_dir.is_some(), STATE_DIR_TAKEN_BY),
    ];
    for (flag, given, takers) in ignored {
        if given && !takers.contains(&name) {
            reporter.note(&format!(
                "{flag} is ignored by `{name}` (taken by: {})",
                takers.join(", ")
            ));
        }
    }
    Ok(())
}

/// The thread count for a scenario in [`THREADS_TAKEN_BY`]: `--threads`
/// (range-checked by the parser), else [`THREADS_ENV`], else `None` (the
/// scenario's own cases).
pub fn threads(args: &BenchArgs) -> anyhow::Result<Option<usize>> {
    match args.threads {
        Some(n) => Ok(Some(n)),
        None => env_threads(),
    }
}

/// The chunk sizes for a scenario in [`CHUNK_SIZES_TAKEN_BY`], with where
/// they came from (a record's `sizes_from`): `--chunk-sizes`, else
/// [`CHUNK_SIZES_ENV`], else `None` (the scenario's own sizes).
pub fn chunk_sizes(args: &BenchArgs) -> anyhow::Result<Option<(Vec<usize>, &'static str)>> {
    if let Some(raw) = &args.chunk_sizes {
        let sizes = parse_chunk_sizes(raw).with_context(|| format!("--chunk-sizes {raw:?}"))?;
        return Ok(Some((sizes, "--chunk-sizes")));
    }
    Ok(env_chunk_sizes()?.map(|sizes| (sizes, CHUNK_SIZES_ENV)))
}

/// The thread count in [`THREADS_ENV`], if set (1..=[`MAX_THREADS`]).
fn env_threads() -> anyhow::Result<Option<usize>> {
    let Some(raw) = env_value(THREADS_ENV)? else {
        return Ok(None);
    };
    let threads: usize = raw
        .trim()
        .parse()
        .ok()
        .filter(|n| (1..=MAX_THREADS).contains(n))
        .ok_or_else(|| {
            anyhow::anyhow!("{THREADS_ENV}={raw:?} is not a thread count in 1..={MAX_THREADS}")
        })?;
    Ok(Some(threads))
}

/// The sizes in [`CHUNK_SIZES_ENV`], if set: comma-separated, each a number
/// of bytes with an optional `B`, `KiB`, `MiB` or `GiB`, at most
/// [`MAX_CHUNK_BYTES`]; duplicates dropped, order kept.
fn env_chunk_sizes() -> anyhow::Result<Option<Vec<usize>>> {
    let Some(raw) = env_value(CHUNK_SIZES_ENV)? else {
        return Ok(None);
    };
    parse_chunk_sizes(&raw)
        .map(Some)
        .with_context(|| format!("{CHUNK_SIZES_ENV}={raw:?}"))
}

fn env_value(var: &str) -> anyhow::Result<Option<String>> {
    match std::env::var(var) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => anyhow::bail!("{var} is not UTF-8"),
    }
}

fn parse_chunk_sizes(raw: &str) -> anyhow::Result<Vec<usize>> {
    let mut sizes = Vec::new();
    for item in raw.split(',') {
        let size = parse_size(item.trim())?;
        if !sizes.contains(&size) {
            sizes.push(size);
        }
    }
    anyhow::ensure!(
        sizes.len() <= MAX_CHUNK_SIZES,
        "{} sizes; at most {MAX_CHUNK_SIZES}",
        sizes.len()
    );
    Ok(sizes)
}

/// `4096`, `100B`, `64KiB`, `1MiB`, `1GiB`.
fn parse_size(item: &str) -> anyhow::Result<usize> {
    let split = item
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(item.len());
    let (digits, unit) = item.split_at(split);
    let scale: usize = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => anyhow::bail!("{item:?} is not a size like 4096, 64KiB, 1MiB or 1GiB"),
    };
    let size = digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .with_context(|| format!("{item:?} is not a size like 4096, 64KiB, 1MiB or 1GiB"))?;
    anyhow::ensure!(
        (1..=MAX_CHUNK_BYTES).contains(&size),
        "{item:?} is outside 1 B..=1 GiB"
    );
    Ok(size)
}

/// A size as the cases name it: `64KiB`, `16MiB`, or bytes.
pub fn size_label(size: usize) -> String {
    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    if size >= MIB && size.is_multiple_of(MIB) {
        format!("{}MiB", size / MIB)
    } else if size >= KIB && size.is_multiple_of(KIB) {
        format!("{}KiB", size / KIB)
    } else {
        size.to_string()
    }
}

/// In a child the bench started (after `fork`, or in `pre_exec`): have the
/// kernel send it `signal` when the thread that started it ends — with the
/// bench, however it ends (a signal runs none of the destructors that stop
/// its servers). Fails if the bench (`parent`) is already gone. Makes only
/// system calls and allocates nothing, so it is safe between `fork` and
/// `exec`.
pub(crate) fn die_with_parent(signal: libc::c_int, parent: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes integers and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The bench may have ended before the prctl: nobody would signal then.
    // SAFETY: getppid() takes no arguments.
    if unsafe { libc::getppid() } != parent {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

/// A command for a process the bench spawns, which the kernel sends
/// SIGTERM when the bench ends, however it ends ([`die_with_parent`]).
///
/// Its environment is the bench's without the operator's configuration
/// ([`bench_child_env_removals`]): a `cxlkv serve` or `cxlkv pool` the bench
/// starts runs on the flags the bench gives it, as the bench's in-process
/// servers do, whatever `CXLKV_CONFIG` or `CXLKV_<SECTION>_<KEY>` the shell
/// exports. Only `CXLKV_IO` (the transport backend, which the in-process
/// servers honour too) passes through.
pub(crate) fn command_ending_with_bench(
    program: impl AsRef<std::ffi::OsStr>,
) -> anyhow::Result<std::process::Command> {
    use std::os::unix::process::CommandExt;
    let parent = libc::pid_t::try_from(std::process::id()).context("this pid fits in pid_t")?;
    let mut command = std::process::Command::new(program);
    for name in bench_child_env_removals(std::env::vars_os().map(|(name, _)| name)) {
        command.env_remove(name);
    }
    // SAFETY: the hook only makes two system calls and allocates nothing,
    // as code between fork and exec must.
    unsafe {
        command.pre_exec(move || die_with_parent(libc::SIGTERM, parent));
    }
    Ok(command)
}

/// The variables of `names` a bench child must not inherit: every
/// `CXLKV_*` variable (the configuration layer's prefix, `CXLKV_LOG`
/// included: each child sets its own) but `CXLKV_IO`.
fn bench_child_env_removals(
    names: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    names
        .into_iter()
        .filter(|name| {
            name.as_encoded_bytes()
                .starts_with(crate::config::ENV_PREFIX.as_bytes())
                && name.as_os_str() != cxlkv_controlplane::transport::IO_ENV
        })
        .collect()
}

/// Runs `body(i, setup(i)?)` for `i` in `0..threads`, each on a thread of
/// its own, all released together from a barrier once every `setup` (a
/// warm-up, untimed) is done. Returns the wall time from the first `body`'s
/// start to the last one's finish, each read by the thread running it, and
/// the bodies' results in order.
///
/// The threads read the clock themselves: a coordinating thread that reads
/// it after the barrier starts it whenever it is scheduled again — on a
/// busy host after the workers did part or all of their work, which
/// reported `alloc threads=1` at 0.06 ns per pair (reliability entry 147).
pub fn timed_together<S, T: Send>(
    threads: usize,
    setup: impl Fn(usize) -> anyhow::Result<S> + Sync,
    body: impl Fn(usize, S) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<(Duration, Vec<T>)> {
    anyhow::ensure!(threads >= 1, "timed_together needs at least one thread");
    let start = std::sync::Barrier::new(threads);
    let results: Vec<anyhow::Result<(Instant, Instant, T)>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|i| {
                let (start, setup, body) = (&start, &setup, &body);
                scope.spawn(move || {
                    let prepared = setup(i);
                    // Every thread reaches the barrier, error or not, so
                    // that nobody waits forever.
                    start.wait();
                    let prepared = prepared?;
                    let started = Instant::now();
                    let result = body(i, prepared)?;
                    Ok((started, Instant::now(), result))
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let mut window: Option<(Instant, Instant)> = None;
    let mut out = Vec::with_capacity(threads);
    for result in results {
        let (started, finished, value) = result?;
        window = Some(match window {
            None => (started, finished),
            Some((a, b)) => (a.min(started), b.max(finished)),
        });
        out.push(value);
    }
    let wall = window.map_or(Duration::ZERO, |(a, b)| b.duration_since(a));
    Ok((wall, out))
}

/// Times `f` once.
pub fn time<R>(f: impl FnOnce() -> R) -> (R, Duration) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_above_one_when_ours_is_better() {
        let thr = Record::new("s", "c", 2.0, 1.0, "GB/s", Better::Higher);
        assert!((thr.ratio - 2.0).abs() < 1e-12);
        let lat = Record::new("s", "c", 5.0, 10.0, "us", Better::Lower);
        assert!((lat.ratio - 2.0).abs() < 1e-12);
    }

    #[test]
    fn record_serializes_flat_with_extra_fields() {
        let r = Record::new("copy", "size=1MiB", 10.0, 9.0, "GB/s", Better::Higher).with("reps", 5);
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        for k in [
            "scenario", "case", "ours", "baseline", "unit", "ratio", "reps",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
    }

    #[test]
    fn bench_children_drop_the_operators_configuration_but_keep_the_backend() {
        let names = [
            "CXLKV_CONFIG",
            "CXLKV_DIRECTORY_LEASE_MS",
            "CXLKV_TRANSPORT_SPIN_US",
            "CXLKV_LOG",
            "CXLKV_IO",
            "PATH",
            "XCXLKV_CONFIG",
        ]
        .map(std::ffi::OsString::from);
        assert_eq!(
            bench_child_env_removals(names),
            [
                "CXLKV_CONFIG",
                "CXLKV_DIRECTORY_LEASE_MS",
                "CXLKV_TRANSPORT_SPIN_US",
                "CXLKV_LOG"
            ]
            .map(std::ffi::OsString::from)
        );
    }

    #[test]
    fn chunk_sizes_parse_with_binary_units_and_bounds() {
        assert_eq!(
            parse_chunk_sizes("4096,64KiB,1MiB,1GiB,100B").unwrap(),
            [4096, 64 << 10, 1 << 20, 1 << 30, 100]
        );
        assert_eq!(parse_chunk_sizes("1MiB,1MiB").unwrap(), [1 << 20]);
        for bad in ["", "0", "2GiB", "1MB", "MiB", "-1", "1.5MiB"] {
            assert!(parse_chunk_sizes(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(size_label(64 << 10), "64KiB");
        assert_eq!(size_label(16 << 20), "16MiB");
        assert_eq!(size_label(1000), "1000");
    }

    #[test]
    fn the_scenarios_that_take_threads_and_chunk_sizes_are_the_ones_hwbench_names() {
        let script = include_str!("../../scripts/hwbench.sh");
        let listed = |var: &str| -> Vec<String> {
            let prefix = format!("readonly {var}=\"");
            let line = script
                .lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .unwrap_or_else(|| panic!("hwbench.sh sets {var}"));
            let names = line.strip_suffix('"').expect("a quoted list");
            names.split_whitespace().map(str::to_owned).collect()
        };
        assert_eq!(listed("THREADS_TAKEN_BY"), THREADS_TAKEN_BY);
        assert_eq!(listed("CHUNKS_TAKEN_BY"), CHUNK_SIZES_TAKEN_BY);
        let known: Vec<&str> = crate::cli::SCENARIOS.iter().map(|(n, _, _)| *n).collect();
        for name in THREADS_TAKEN_BY
            .iter()
            .chain(CHUNK_SIZES_TAKEN_BY)
            .chain(STATE_DIR_TAKEN_BY)
            .chain(POOL_IGNORED_BY)
        {
            assert!(known.contains(name), "{name} is not a scenario");
        }
    }

    #[test]
    fn median_and_percentile() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
    }
}
