//! `cxlkv demo` as a user runs it: the built binary, small parameters.
//!
//! - `--json` prints one JSON object whose figures prove the job was done:
//!   chunks read in place across instances, every read's bytes equal to
//!   what was written, the TCP baseline measured, no process left behind,
//!   and nothing left in `/dev/shm` or the temporary directory.
//! - SIGINT in the middle of a run stops everything it started: no instance
//!   process, pool file, pool-manager state or socket survives.

mod child_guard;

use child_guard::Guard;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on one demo run in a debug build on a loaded machine.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

fn demo(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.arg("demo")
        .args(args)
        .env("CXLKV_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Waits for the child's exit (bounded), returning (success, stdout,
/// stderr).
fn finish(guard: &mut Guard) -> (bool, String, String) {
    let mut child = guard.0.take().expect("a running demo");
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the demo did not finish within {RUN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    let mut err = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.success(), out, err)
}

/// Files the demo with pid `pid` names after itself, in `/dev/shm` and the
/// temporary directory (pool, pool-manager state, socket).
fn leftovers_of(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("cxlkv-demo-{pid}-");
    [PathBuf::from("/dev/shm"), std::env::temp_dir()]
        .iter()
        .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .collect()
}

/// Pids of the live processes started with `--parent-pid <pid>`: the
/// demo's instances.
fn instances_of(pid: u32) -> Vec<u32> {
    let needle = format!("--parent-pid\0{pid}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_bytes()))
        })
        .collect()
}

fn field<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v.get(name)
        .unwrap_or_else(|| panic!("no {name:?} in the report: {v}"))
}

fn u(v: &serde_json::Value, name: &str) -> u64 {
    field(v, name)
        .as_u64()
        .unwrap_or_else(|| panic!("{name} is not an integer: {v}"))
}

fn f(v: &serde_json::Value, name: &str) -> f64 {
    field(v, name)
        .as_f64()
        .unwrap_or_else(|| panic!("{name} is not a number: {v}"))
}

#[test]
fn demo_json_reports_verified_cross_instance_reads_and_leaves_nothing_behind() {
    let chunk: u64 = 64 << 10;
    let documents: u64 = 4;
    let mut guard = Guard(Some(
        demo(&[
            "--json",
            "--instances",
            "3",
            "--documents",
            &documents.to_string(),
            "--chunk-size",
            &chunk.to_string(),
            "--duration",
            "2",
        ])
        .spawn()
        .unwrap(),
    ));
    let pid = guard.0.as_ref().unwrap().id();
    let (ok, out, err) = finish(&mut guard);
    assert!(ok, "the demo failed: {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one JSON object on stdout: {out:?}");
    let r: serde_json::Value = serde_json::from_str(lines[0]).unwrap();

    assert_eq!(u(&r, "instances"), 3);
    assert_eq!(u(&r, "leftover_processes"), 0);
    // The prefill wrote every document's prefix; peers wrote at least one
    // suffix each time they missed.
    assert!(u(&r, "chunks_written") >= documents * 8, "{r}");
    assert!(u(&r, "chunks_shared") > 0, "{r}");
    assert!(u(&r, "chunks_shared") <= u(&r, "chunks_read"), "{r}");
    // Bytes read equal bytes written, for every hit, in place and over TCP.
    let reads = u(&r, "chunks_read");
    assert_eq!(u(&r, "corrupt_reads"), 0, "{r}");
    assert_eq!(u(&r, "verified_reads"), reads, "{r}");
    assert_eq!(u(&r, "bytes_read"), reads * chunk, "{r}");
    assert_eq!(u(&r, "tcp_corrupt_reads"), 0, "{r}");
    assert!(u(&r, "tcp_reads") > 0, "the baseline ran: {r}");
    assert_eq!(u(&r, "tcp_bytes_read"), u(&r, "tcp_reads") * chunk, "{r}");
    let hit_rate = f(&r, "hit_rate");
    let misses = u(&r, "misses");
    assert!(
        (hit_rate - reads as f64 / (reads + misses) as f64).abs() < 1e-9,
        "{r}"
    );
    for name in ["store_gbps", "read_gbps", "tcp_read_gbps"] {
        assert!(f(&r, name) > 0.0, "{name}: {r}");
    }
    let latency = field(&r, "latency_us");
    for op in ["store", "lookup", "read", "tcp_read"] {
        let p = field(latency, op);
        assert!(u(p, "count") > 0, "{op}: {r}");
        assert!(f(p, "p50") > 0.0 && f(p, "p50") <= f(p, "p99"), "{op}: {r}");
    }
    assert!(instances_of(pid).is_empty(), "instance processes survived");
    assert_eq!(leftovers_of(pid), Vec::<PathBuf>::new());
}

#[test]
fn sigint_mid_run_leaves_no_processes_or_pool_files() {
    let pool = PathBuf::from(format!(
        "/dev/shm/cxlkv-test-demo-sigint-{}.pool",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&pool);
    let instances = 3;
    let mut guard = Guard(Some(
        demo(&[
            "--json",
            "--instances",
            &instances.to_string(),
            "--documents",
            "4",
            "--chunk-size",
            "64KiB",
            "--duration",
            "60",
            "--pool",
            pool.to_str().unwrap(),
        ])
        .spawn()
        .unwrap(),
    ));
    let pid = guard.0.as_ref().unwrap().id();
    // Mid-run: the pool exists and every instance process is up.
    let deadline = Instant::now() + RUN_TIMEOUT;
    let running = loop {
        let running = instances_of(pid);
        if running.len() == instances && pool.exists() {
            break running;
        }
        assert!(
            Instant::now() < deadline,
            "the demo did not start its instances"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_secs(1));
    let demo_pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: signals the demo process this test started and still owns.
    assert_eq!(unsafe { libc::kill(demo_pid, libc::SIGINT) }, 0);
    let (ok, out, err) = finish(&mut guard);
    assert!(!ok, "an interrupted demo exits non-zero");
    assert!(out.is_empty(), "no report after an interruption: {out:?}");
    assert!(err.contains("interrupted"), "{err}");
    for p in running {
        let gone = !Path::new(&format!("/proc/{p}")).exists();
        assert!(gone, "instance process {p} survived");
    }
    assert!(instances_of(pid).is_empty());
    assert!(!pool.exists(), "the pool file it created survived");
    assert_eq!(leftovers_of(pid), Vec::<PathBuf>::new());
}
