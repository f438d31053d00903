//! The benches' records carry what the issues' checks and the bench
//! contract read, each consistent with the others: the directory benches
//! (`cxlkv bench exists|lookup`: `batch`, `keys_per_s`, `p50_us`, `p99_us`
//! and ratios against the raw exchange, per batch of 1, 64 and 512 keys;
//! `cxlkv bench directory-memory`: `bytes_per_key`), `rtt` (the backends
//! that ran, wire sizes, paired ratios, io_uring cases skipped where
//! io_uring is unavailable), `copy` and `store` (the pool they measured on,
//! the flushed baseline, chunk sizes from the environment), `share` (the
//! consumed comparison as `ratio`), `alloc` and `pool` (threads from the
//! environment); every documented target (`scripts/bench-targets.tsv`)
//! that matches a case finds its metric in it; the servers a bench started
//! end when it is killed; `cxlkv bench --help` lists the scenarios; an
//! empty `--pool` file is refused saying how to size it, the scenario
//! after `pool` on the same pool does not wait out a 10 s lease, and a
//! bench removes what a bench killed outright left in `/dev/shm` and
//! `$TMPDIR`. Runs the
//! debug binary's `--quick` form with one
//! repetition: the figures are meaningless there, their presence and
//! arithmetic are not.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Runs `cxlkv bench SCENARIO --quick --reps 1 --json`; every line of its
/// standard output must be one JSON object of that scenario.
fn bench(scenario: &str) -> Vec<Value> {
    bench_with(scenario, &[], &[])
}

/// [`bench`] with more arguments and environment variables.
fn bench_with(scenario: &str, args: &[&str], env: &[(&str, &str)]) -> Vec<Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.args(["bench", scenario, "--quick", "--reps", "1", "--json"])
        .args(args)
        .env_remove("CXLKV_BENCH_POOL")
        .env_remove("CXLKV_BENCH_THREADS")
        .env_remove("CXLKV_BENCH_CHUNK_SIZES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_bench(scenario, &mut cmd)
}

fn run_bench(scenario: &str, cmd: &mut Command) -> Vec<Value> {
    let out = cmd.output().expect("run cxlkv bench");
    assert!(
        out.status.success(),
        "cxlkv bench {scenario} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("UTF-8 output");
    let records: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!records.is_empty(), "{scenario}: no records");
    for r in &records {
        assert_eq!(r["scenario"], scenario);
        for field in ["ours", "baseline", "ratio"] {
            assert!(
                r[field].as_f64().is_some_and(f64::is_finite),
                "{scenario} {}: {field} = {:?}",
                r["case"],
                r[field]
            );
        }
        // Every record says what memory it measured on.
        for field in ["pool", "dest"] {
            assert!(
                r[field].as_str().is_some_and(|s| !s.is_empty()),
                "{scenario} {}: {field} = {:?}",
                r["case"],
                r[field]
            );
        }
    }
    assert_documented_targets_apply(scenario, &stdout);
    records
}

/// Every documented target (`scripts/bench-targets.tsv`) whose case pattern
/// matches a record names a metric that record carries as a number, as
/// `scripts/bench_report.py` evaluates it: a pattern wider than the cases
/// its metric belongs to fills `summary.md` with "n/a" for cases the target
/// is not about. Skipped where python3 is missing.
fn assert_documented_targets_apply(scenario: &str, jsonl: &str) {
    const CHECK: &str = r#"
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import bench_report
targets = bench_report.read_targets(Path(sys.argv[2]))
for line in sys.stdin:
    record = json.loads(line)
    if record.get("skipped") is True:
        continue
    for target, value, met in bench_report.evaluate_targets(record, targets):
        if value is None:
            print(f"{record['case']}: {target['metric']} (case pattern {target['case_pattern']})")
"#;
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
    let child = Command::new("python3")
        .arg("-c")
        .arg(CHECK)
        .arg(&scripts)
        .arg(scripts.join("bench-targets.tsv"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("python3 not found: documented targets not checked");
        return;
    };
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("python3's stdin");
        stdin
            .write_all(jsonl.as_bytes())
            .expect("write the records");
    }
    let out = child.wait_with_output().expect("run python3");
    assert!(out.status.success(), "the target check failed to run");
    let unmet = String::from_utf8_lossy(&out.stdout);
    assert!(
        unmet.trim().is_empty(),
        "{scenario}: documented targets match cases that lack their metric:\n{unmet}"
    );
}

fn num(r: &Value, field: &str) -> f64 {
    r[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{}: {field} missing or not a number", r["case"]))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn exists_and_lookup_report_the_issue_fields_for_batches_of_1_64_and_512() {
    for scenario in ["exists", "lookup"] {
        let records = bench(scenario);
        let cases: Vec<&str> = records.iter().filter_map(|r| r["case"].as_str()).collect();
        assert_eq!(cases, ["batch=1", "batch=64", "batch=512"], "{scenario}");
        for r in &records {
            let batch = r["batch"].as_u64().expect("batch is an integer");
            assert_eq!(r["case"], format!("batch={batch}"));
            assert_eq!(r["key_bytes"], 100, "100-byte keys");
            assert_eq!(r["unit"], "us");
            let (p50, p99, raw) = (num(r, "p50_us"), num(r, "p99_us"), num(r, "raw_p50_us"));
            assert!(p50 > 0.0 && raw > 0.0, "{scenario} {batch}: {p50} {raw}");
            assert!(p99 >= p50, "{scenario} {batch}: p99 {p99} below p50 {p50}");
            // `ours` is our call time and the baseline the raw exchange's:
            // ratio > 1 would mean faster than the transport alone.
            assert!(close(num(r, "ours"), p50));
            assert!(close(num(r, "baseline"), raw));
            assert!(
                close(num(r, "ratio"), raw / p50),
                "{scenario} {batch}: ratio"
            );
            // With one rep its own ratio is the case's; with more, the
            // median ratio lies between the reps' extremes.
            let (lo, hi) = (num(r, "ratio_min"), num(r, "ratio_max"));
            assert!(
                close(lo, num(r, "ratio")) && close(hi, num(r, "ratio")),
                "{scenario} {batch}: one rep's ratio_min {lo} and ratio_max {hi}"
            );
            assert!(close(num(r, "ratio_paired_median"), num(r, "ratio")));
            // The server's figures are histogram bounds over every call of
            // the operation, warm-up included, and named so.
            assert!(r.get("server_p50_us").is_none() && r.get("server_p99_us").is_none());
            let (s50, s99) = (num(r, "server_p50_us_le"), num(r, "server_p99_us_le"));
            assert!(s50 > 0.0 && s99 >= s50, "{scenario} {batch}: {s50} {s99}");
            assert!(
                num(r, "server_histogram_calls") >= num(r, "server_timed_calls"),
                "{scenario} {batch}: the histogram holds the timed calls and the warm-up"
            );
            assert_eq!(r["pool"], "default");
            assert_eq!(r["dest"], "shm");
            assert!(
                close(num(r, "keys_per_s"), batch as f64 / (p50 * 1e-6)),
                "{scenario} {batch}: keys_per_s is batch / p50"
            );
            if scenario == "lookup" {
                assert_eq!(r["pins"], 1, "a lookup takes a pin per key");
            }
        }
    }
}

#[test]
fn directory_memory_reports_resident_bytes_per_key_beyond_the_key_bytes() {
    let records = bench("directory-memory");
    let mem = records
        .iter()
        .find(|r| r["bytes_per_key"].is_number())
        .expect("a record with bytes_per_key");
    assert_eq!(mem["unit"], "B/key");
    let case = mem["case"].as_str().expect("case");
    let keys: f64 = case
        .split(',')
        .find_map(|kv| kv.strip_prefix("keys="))
        .and_then(|v| v.parse().ok())
        .expect("keys= in the case");
    assert!(case.contains("key_bytes=100"), "{case}");
    let per_key = num(mem, "bytes_per_key");
    assert!(close(num(mem, "ours"), per_key));
    // Resident growth per key, less the key's own 100 bytes.
    assert!(
        close(per_key, num(mem, "rss_delta_bytes") / keys - 100.0),
        "bytes_per_key {per_key} is not rss_delta_bytes / keys - 100"
    );
    // An index entry, a table bucket and the allocator's overhead: tens of
    // bytes, not none and not kilobytes.
    assert!((16.0..1024.0).contains(&per_key), "{per_key} B/key");
    assert_eq!(num(mem, "target_bytes_per_key"), 96.0);
    assert!(num(mem, "naive_hashmap_bytes_per_key") > 0.0);
}

/// Checks what every executed `rtt` record carries; returns the `op=get`
/// record.
fn check_rtt_records(records: &[Value]) -> &Value {
    for r in records.iter().filter(|r| r["skipped"] != true) {
        let case = r["case"].as_str().expect("case");
        // A split case has a raw peer at one end (the other is ours).
        let raw_end = match case {
            "transport=unix,split=client" => Some("server_backend"),
            "transport=unix,split=server" => Some("client_backend"),
            _ => None,
        };
        for field in ["server_backend", "client_backend"] {
            let backend = r[field].as_str().unwrap_or_default();
            if raw_end == Some(field) {
                assert_eq!(backend, "raw", "{case}: {field}");
            } else {
                assert!(
                    backend == "uring" || backend == "fallback",
                    "{case}: {field} = {backend:?}"
                );
            }
        }
        let (lo, hi, paired) = (
            num(r, "ratio_min"),
            num(r, "ratio_max"),
            num(r, "ratio_paired_median"),
        );
        assert!(lo <= paired && paired <= hi, "{case}: {lo} {paired} {hi}");
        assert!(num(r, "request_wire_bytes") > 0.0 && num(r, "reply_wire_bytes") > 0.0);
    }
    let get = records
        .iter()
        .find(|r| r["case"] == "op=get,transport=unix,backend=default")
        .expect("the op=get case");
    // The baseline exchanges what one get does: the previous get's Unpin
    // and this get's Lookup, and their two replies.
    assert!(close(
        num(get, "request_wire_bytes"),
        num(get, "lookup_request_wire_bytes") + num(get, "unpin_request_wire_bytes")
    ));
    assert!(close(
        num(get, "reply_wire_bytes"),
        num(get, "lookup_reply_wire_bytes") + num(get, "unpin_reply_wire_bytes")
    ));
    let per_get = num(get, "requests_per_get");
    assert!((1.5..=2.5).contains(&per_get), "{per_get} requests per get");
    get
}

#[test]
fn rtt_records_name_their_backends_wire_sizes_and_paired_ratios() {
    let records = bench("rtt");
    check_rtt_records(&records);
    // The split cases: each end against a raw peer, its share above the
    // raw exchange, over the same wire sizes as the default case.
    let default = records
        .iter()
        .find(|r| r["case"] == "transport=unix,backend=default")
        .expect("the default case");
    for case in ["transport=unix,split=client", "transport=unix,split=server"] {
        let r = records
            .iter()
            .find(|r| r["case"] == case)
            .unwrap_or_else(|| panic!("the {case} case"));
        assert!(
            num(r, "p50_us") > 0.0 && num(r, "raw_p50_us") > 0.0,
            "{case}"
        );
        assert!(
            close(num(r, "share_us"), num(r, "p50_us") - num(r, "raw_p50_us")),
            "{case}"
        );
        for field in ["request_wire_bytes", "reply_wire_bytes"] {
            assert_eq!(r[field], default[field], "{case}: {field}");
        }
    }
    let uring = records
        .iter()
        .find(|r| r["case"] == "transport=unix,backend=uring")
        .expect("the io_uring case is reported, run or skipped");
    if uring["skipped"] != true {
        assert_eq!(uring["server_backend"], "uring");
        assert_eq!(uring["client_backend"], "uring");
    }
}

/// A seccomp filter making `io_uring_setup(2)` (425 on every architecture)
/// fail with `ENOSYS`, as on a kernel without io_uring.
fn deny_io_uring() -> std::io::Result<()> {
    let filter = [
        // Load the system call number.
        libc::sock_filter {
            code: 0x20,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: 0x15,
            jt: 0,
            jf: 1,
            k: 425,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: plain prctl calls on this (child) process; `prog` and the
    // filter it points to outlive the call, which copies them.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[test]
fn rtt_without_io_uring_skips_the_io_uring_case_and_reports_the_rest() {
    let can_filter = {
        let mut probe = Command::new("true");
        // SAFETY: the closure only makes async-signal-safe prctl calls.
        unsafe { probe.pre_exec(deny_io_uring) };
        probe.status().is_ok_and(|s| s.success())
    };
    if !can_filter {
        eprintln!("skipped: cannot install a seccomp filter here");
        return;
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.args(["bench", "rtt", "--quick", "--reps", "1", "--json"])
        .env_remove("CXLKV_BENCH_POOL")
        .env_remove("CXLKV_IO");
    // SAFETY: as above.
    unsafe { cmd.pre_exec(deny_io_uring) };
    let records = run_bench("rtt", &mut cmd);
    let skipped: Vec<&Value> = records.iter().filter(|r| r["skipped"] == true).collect();
    assert_eq!(skipped.len(), 1, "only the io_uring case is skipped");
    let uring = skipped[0];
    assert_eq!(uring["case"], "transport=unix,backend=uring");
    assert_eq!(uring["ratio"], 0.0);
    assert!(
        uring["skip_reason"]
            .as_str()
            .is_some_and(|why| why.contains("io_uring")),
        "{uring}"
    );
    // The scenario went on past it, on the fallback backends.
    check_rtt_records(&records);
    for r in records.iter().filter(|r| r["skipped"] != true) {
        // (`split=client`'s server is the raw frame peer.)
        if r["server_backend"] != "raw" {
            assert_eq!(r["server_backend"], "fallback", "{}", r["case"]);
        }
    }
    assert!(
        records
            .iter()
            .any(|r| r["case"] == "transport=unix,backend=default,inflight=64")
    );
}

/// Bytes of `path` backed by memory (a sparse file's written part).
fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).expect("the pool file").blocks() * 512
}

#[test]
fn copy_and_store_measure_on_the_given_pool_and_report_the_flushed_baseline() {
    let dir = tempfile::Builder::new()
        .prefix("cxlkv-bench-test-")
        .tempdir_in("/dev/shm")
        .expect("a directory under /dev/shm");
    let pool = dir.path().join("pool");
    std::fs::File::create(&pool)
        .and_then(|f| f.set_len(2 << 30))
        .expect("a sparse pool file");
    let pool_arg = pool.to_str().expect("a UTF-8 path");

    let copy = bench_with(
        "copy",
        &["--pool", pool_arg],
        &[("CXLKV_BENCH_CHUNK_SIZES", "64KiB,1MiB")],
    );
    let cases: Vec<&str> = copy.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(cases, ["size=64KiB,dest=shm", "size=1MiB,dest=shm"]);
    for r in &copy {
        assert_eq!(r["pool"], pool_arg);
        assert_eq!(r["sizes_from"], "CXLKV_BENCH_CHUNK_SIZES");
        assert_eq!(r["chunk_bytes"], r["size_bytes"]);
        let flushed = num(r, "baseline_flushed_gbps");
        assert!(flushed > 0.0);
        assert!(close(num(r, "ratio_flushed"), num(r, "ours") / flushed));
        assert!(close(num(r, "ratio"), num(r, "ours") / num(r, "baseline")));
        // Eight caches' worth per rep, unless the --quick bound (512 MiB)
        // cuts it.
        let want = (8.0 * num(r, "llc_bytes")).min(512.0 * 1024.0 * 1024.0);
        assert!(num(r, "rep_bytes") >= want, "{r}");
        assert!(r["evict_between"].is_string() && r["flush_instruction"].is_string());
    }
    let after_copy = allocated_bytes(&pool);

    // copy overwrote the pool's first bytes: store's server must still take
    // it, and write its chunks into it.
    let store = bench_with(
        "store",
        &["--pool", pool_arg],
        &[("CXLKV_BENCH_CHUNK_SIZES", "1MiB")],
    );
    assert_eq!(store.len(), 1);
    let r = &store[0];
    assert_eq!(r["case"], "chunk=1MiB,batch=16");
    assert_eq!(r["pool"], pool_arg);
    assert_eq!(r["dest"], "shm");
    assert_eq!(r["chunk_bytes"], 1 << 20);
    assert!(num(r, "baseline_flushed_gbps") > 0.0 && num(r, "nt_gbps") > 0.0);
    assert!(
        allocated_bytes(&pool) > after_copy,
        "store did not write into --pool"
    );
    assert!(pool.exists(), "the operator's pool is never removed");
}

#[test]
fn share_compares_bytes_consumed_and_keeps_the_views_figures_apart() {
    for r in &bench("share") {
        let (ours, base) = (num(r, "ours_consumed_ms"), num(r, "baseline_consumed_ms"));
        assert!(close(num(r, "ours"), ours) && close(num(r, "baseline"), base));
        assert!(close(num(r, "ratio"), base / ours));
        assert!(close(num(r, "ratio_consumed"), num(r, "ratio")));
        assert!(close(
            num(r, "ratio_views"),
            num(r, "baseline_received_ms") / num(r, "ours_views_ms")
        ));
        assert!(close(
            num(r, "chunks_per_s"),
            num(r, "chunks") / (ours / 1e3)
        ));
        assert_eq!(r["pool"], "default");
    }
}

#[test]
fn alloc_and_pool_take_their_threads_from_the_environment() {
    let threads = [("CXLKV_BENCH_THREADS", "3")];
    let alloc = bench_with("alloc", &[], &threads);
    let cases: Vec<&str> = alloc.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(cases, ["threads=1", "threads=3"]);
    for r in &alloc {
        assert_eq!(r["pool"], "none");
        assert_eq!(r["dest"], "heap");
    }
    let pool = bench_with("pool", &[], &threads);
    let cases: Vec<&str> = pool.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(
        cases,
        [
            "sync=per-record,clients=1",
            "sync=group,clients=1",
            "sync=per-record,clients=3",
            "sync=group,clients=3"
        ]
    );
    assert!(pool.iter().all(|r| r["threads"] == 3));

    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", "alloc", "--quick", "--json"])
        .env("CXLKV_BENCH_THREADS", "many")
        .output()
        .expect("run cxlkv bench");
    assert!(!out.status.success(), "a malformed thread count is refused");
    assert!(out.stdout.is_empty());
}

#[test]
fn the_threads_flag_overrides_the_environment_and_is_range_checked() {
    let alloc = bench_with(
        "alloc",
        &["--threads", "3"],
        &[("CXLKV_BENCH_THREADS", "5")],
    );
    let cases: Vec<&str> = alloc.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(cases, ["threads=1", "threads=3"]);
    for bad in ["0", "1025", "many"] {
        let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
            .args(["bench", "alloc", "--quick", "--json", "--threads", bad])
            .output()
            .expect("run cxlkv bench");
        assert!(!out.status.success(), "--threads {bad} is refused");
        assert!(out.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--threads"), "names the flag: {stderr}");
    }
}

#[test]
fn the_chunk_sizes_flag_sets_the_sizes_and_a_flag_a_scenario_does_not_take_is_noted() {
    let copy = bench_with(
        "copy",
        &["--chunk-sizes", "64KiB"],
        &[("CXLKV_BENCH_CHUNK_SIZES", "1MiB")],
    );
    // One size, on `/dev/shm` and (where huge pages can be had) hugetlbfs.
    let cases: Vec<&str> = copy.iter().filter_map(|r| r["case"].as_str()).collect();
    assert!(cases.contains(&"size=64KiB,dest=shm"), "{cases:?}");
    assert!(
        cases.iter().all(|c| c.starts_with("size=64KiB,")),
        "{cases:?}"
    );
    assert!(copy.iter().all(|r| r["sizes_from"] == "--chunk-sizes"));

    // `directory-memory` takes neither: both flags are noted as ignored and
    // the scenario runs as without them.
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args([
            "bench",
            "directory-memory",
            "--quick",
            "--reps",
            "1",
            "--json",
        ])
        .args(["--threads", "2", "--chunk-sizes", "1MiB"])
        .output()
        .expect("run cxlkv bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--threads is ignored by `directory-memory` (taken by: alloc, pool)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("--chunk-sizes is ignored by `directory-memory` (taken by: copy, store)"),
        "{stderr}"
    );

    // `alloc` keeps its state in process memory and has no journal: `--pool`
    // and `--state-dir` are noted as ignored (a pool path it never opens is
    // not an error), not silently dropped.
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", "alloc", "--quick", "--reps", "1", "--json"])
        .args(["--pool", "/nonexistent/cxlkv-pool", "--state-dir", "/tmp"])
        .env_remove("CXLKV_BENCH_THREADS")
        .output()
        .expect("run cxlkv bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--pool (or CXLKV_BENCH_POOL) is ignored by `alloc`"),
        "{stderr}"
    );
    assert!(
        stderr.contains("--state-dir is ignored by `alloc` (taken by: pool)"),
        "{stderr}"
    );

    // A malformed list is refused even where it would be ignored, before
    // anything runs.
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", "directory-memory", "--quick", "--json"])
        .args(["--chunk-sizes", "1MB"])
        .output()
        .expect("run cxlkv bench");
    assert!(
        !out.status.success(),
        "a malformed --chunk-sizes is refused"
    );
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--chunk-sizes"));
}

/// The live children of process `parent` (not zombies).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // "pid (comm) state ppid ...": comm may hold spaces.
                    let (_, rest) = stat.rsplit_once(") ")?;
                    let mut fields = rest.split_whitespace();
                    let state = fields.next()?;
                    let ppid: i32 = fields.next()?.parse().ok()?;
                    Some(state != "Z" && ppid == parent)
                })
                .unwrap_or(false)
        })
        .collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(") ")?.1.split_whitespace().next()? != "Z"))
        .unwrap_or(false)
}

/// A bench stopped by a signal — Ctrl-C, or `timeout` at hwbench's time
/// limit — runs no destructors: the servers it started (`rtt`'s forked
/// server, which outlives `SIGINT` and `SIGTERM`; `load`'s `cxlkv serve`)
/// must end with it, not run on holding its output, a pool and CPU.
#[test]
fn the_servers_a_bench_started_end_when_the_bench_is_killed() {
    let mut leftovers = Vec::new();
    for scenario in ["rtt", "load"] {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
            .args(["bench", scenario, "--reps", "50", "--json"])
            .env_remove("CXLKV_BENCH_POOL")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start cxlkv bench");
        let pid = i32::try_from(bench.id()).expect("pid fits in pid_t");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let servers = loop {
            let children = children_of(pid);
            if !children.is_empty() {
                break children;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{scenario}: no server started"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        // Let the server get going (its signal handling installed).
        std::thread::sleep(std::time::Duration::from_millis(500));
        // SAFETY: kill() takes no pointers; `pid` is our unreaped child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let _ = bench.wait();
        for server in servers {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while alive(server) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if alive(server) {
                // SAFETY: kill() takes no pointers; the pid is the server the
                // bench we started left running.
                unsafe { libc::kill(server, libc::SIGKILL) };
                leftovers.push(format!("{scenario}: process {server}"));
            }
        }
        // The files the killed bench could not remove (hwbench removes
        // them after a scenario it stopped): named after its pid.
        let tmp = std::env::temp_dir();
        for dir in [Path::new("/dev/shm"), tmp.as_path()] {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("cxlkv-")
                    && (name.contains(&format!("-{pid}-")) || name.contains(&format!("-{pid}.")))
                {
                    let path = entry.path();
                    let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
                }
            }
        }
    }
    assert!(leftovers.is_empty(), "still running: {leftovers:?}");
}

/// A bench killed outright (`SIGKILL`, nothing of it runs) leaves its
/// server's pool and state directory in `/dev/shm` and its sockets in
/// `$TMPDIR`, named after its pid: the next bench removes them, saying so
/// on standard error, and leaves a live process's entries and names not of
/// the bench alone (reliability entry 157). The killed bench's sockets go
/// to a private `$TMPDIR`, which only this test's benches sweep: its
/// `/dev/shm` entries may also be swept by a bench of a test running
/// beside this one.
#[test]
fn a_bench_removes_what_a_killed_bench_left() {
    let tmp = tempfile::tempdir().unwrap();
    let mut bench = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", "rtt", "--reps", "50", "--json"])
        .env_remove("CXLKV_BENCH_POOL")
        .env("TMPDIR", tmp.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start cxlkv bench");
    let pid = bench.id();
    let named = |dir: &Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("cxlkv-")
                    && (name.contains(&format!("-{pid}-")) || name.contains(&format!("-{pid}.")))
            })
            .map(|e| e.path())
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while named(tmp.path()).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the bench made no socket"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    bench.kill().expect("SIGKILL the bench");
    bench.wait().expect("reap the bench");
    // Its forked server ends with it (SIGKILL); wait for its files to stop
    // changing.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let left = named(tmp.path());
    assert!(!left.is_empty(), "the killed bench left no socket");
    let shm_left = named(Path::new("/dev/shm"));

    // Planted: a dead bench's state directory with a file in it; this live
    // test process's entry under a bench name; a dead pid under a name that
    // is not the bench's.
    let dead = pid;
    let planted_dead = tmp.path().join(format!("cxlkv-bench-state-{dead}-AbC"));
    std::fs::create_dir(&planted_dead).unwrap();
    std::fs::write(planted_dead.join("journal"), b"x").unwrap();
    let live = tmp
        .path()
        .join(format!("cxlkv-bench-{}-0-0.sock", std::process::id()));
    let foreign = tmp.path().join(format!("cxlkv-t-{dead}-0.sock"));
    for p in [&live, &foreign] {
        std::fs::write(p, b"x").unwrap();
    }

    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", "alloc", "--quick", "--reps", "1", "--json"])
        .env("TMPDIR", tmp.path())
        .env_remove("CXLKV_BENCH_THREADS")
        .output()
        .expect("run cxlkv bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for path in left.iter().chain([&planted_dead]) {
        assert!(!path.exists(), "{} left:\n{stderr}", path.display());
        assert!(
            stderr.contains(&format!(
                "note: removed {}, left by bench process {dead}, which is gone",
                path.display()
            )),
            "{} not named:\n{stderr}",
            path.display()
        );
    }
    for path in &shm_left {
        assert!(!path.exists(), "{} left", path.display());
    }
    assert!(live.exists(), "a live process's entry was removed");
    assert!(
        foreign.exists(),
        "an entry not named as the bench's was removed"
    );
}

/// `cxlkv bench SCENARIO --help` — what a user types to learn what a
/// scenario measures — lists every scenario of `--list` with its
/// description, and says where cases and fields are documented.
#[test]
fn bench_help_lists_every_scenario_and_where_its_records_are_described() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
            .args(args)
            .output()
            .expect("run cxlkv");
        assert!(out.status.success(), "cxlkv {args:?} failed");
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let list = run(&["bench", "--list"]);
    let help = run(&["bench", "copy", "--help"]);
    for line in list.lines() {
        assert!(
            help.contains(line.trim_end()),
            "{line:?} missing from:\n{help}"
        );
    }
    assert!(help.contains("docs/benchmarks.md"), "{help}");
    assert!(help.contains("WRITES into it"), "--pool's warning: {help}");
}

/// `--pool` naming an empty file (made with `touch`) is refused before
/// anything runs, saying how to give it a size, by every scenario that
/// measures on a pool (it used to say "0 usable bytes; at least 2097152 are
/// needed", and nothing of how to fix it).
#[test]
fn an_empty_pool_file_is_refused_with_how_to_size_it() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
    let pool = dir.path().join("pool");
    std::fs::write(&pool, b"").expect("an empty file");
    for scenario in ["copy", "store"] {
        let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
            .args([
                "bench", scenario, "--quick", "--reps", "1", "--json", "--pool",
            ])
            .arg(&pool)
            .output()
            .expect("run cxlkv bench");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{scenario}: {stderr}");
        assert!(
            out.stdout.is_empty(),
            "{scenario}: records on an empty pool"
        );
        assert!(
            stderr.contains("is an empty file") && stderr.contains("truncate -s"),
            "{scenario}: {stderr}"
        );
    }
}

/// On `--pool`, the next scenario waits out the lease the one before left
/// in the pool's header. `pool`'s daemon (killed after each case) used the
/// default lease, 10 s, where the bench's servers use 1 s: the scenario
/// after it on the same pool (`tier` in hwbench's order) spent 10 s
/// waiting.
#[test]
fn the_scenario_after_pool_on_the_same_pool_does_not_wait_out_a_long_lease() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
    let pool = dir.path().join("pool");
    std::fs::File::create(&pool)
        .and_then(|f| f.set_len(512 << 20))
        .expect("a 512 MiB pool file");
    let pool = pool.to_str().expect("UTF-8 path");
    bench_with("pool", &["--pool", pool], &[]);
    let started = std::time::Instant::now();
    bench_with("tier", &["--pool", pool], &[]);
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(6),
        "bench tier after bench pool took {took:?}"
    );
}
