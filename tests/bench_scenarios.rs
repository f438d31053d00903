//! The directory benches' records carry what the issue's checks read
//! (`cxlkv bench exists|lookup`: `batch`, `keys_per_s`, `p50_us`, `p99_us`
//! and a ratio against the raw exchange, per batch of 1, 64 and 512 keys;
//! `cxlkv bench directory-memory`: `bytes_per_key`), each consistent with
//! the others. Runs the debug binary's `--quick` form with one repetition:
//! the figures are meaningless there, their presence and arithmetic are not.

use std::process::Command;

use serde_json::Value;

/// Runs `cxlkv bench SCENARIO --quick --reps 1 --json`; every line of its
/// standard output must be one JSON object of that scenario.
fn bench(scenario: &str) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["bench", scenario, "--quick", "--reps", "1", "--json"])
        .output()
        .expect("run cxlkv bench");
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
    }
    records
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
