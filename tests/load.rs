//! The short form of `cxlkv bench load` (src/bench/load.rs): 64 concurrent
//! client connections run put/get/exists/delete against one `cxlkv serve`
//! process for a few seconds. No operation fails, every phase makes
//! progress, and the server's resident memory after the run stays within a
//! margin of its size after the warm-up (a leak per operation would grow it
//! by far more over tens of thousands of operations). No timing is
//! asserted.

use std::time::Duration;

use cxlkv::bench::load::{CONNECTIONS, LoadConfig, run_load};

/// Growth allowed between the warmed-up and the final RSS: allocator
/// arenas and caches settling, not per-operation state.
const RSS_MARGIN_KIB: u64 = 16 << 10;

#[test]
fn sixty_four_connections_of_mixed_operations_fail_nothing_and_server_memory_stays_bounded() {
    let report = run_load(&LoadConfig {
        cxlkv_exe: env!("CARGO_BIN_EXE_cxlkv").into(),
        connections: CONNECTIONS,
        phase: Duration::from_millis(1500),
        reps: 1,
    })
    .expect("the load run completes");
    let ops: u64 = report
        .load
        .iter()
        .chain(&report.baseline)
        .map(|p| p.ops)
        .sum();
    eprintln!(
        "load: {:.0} ops/s with {CONNECTIONS} connections, {:.0} with 1; p99 {:.0} us; \
         RSS {} KiB after warm-up, {} KiB at the end, {} KiB max; {ops} ops",
        report.load[0].ops_per_s,
        report.baseline[0].ops_per_s,
        report.load[0].latency_us_p99,
        report.rss_after_warmup_kib,
        report.rss_final_kib,
        report.rss_max_kib,
    );
    assert_eq!(report.errors, 0, "no operation failed");
    assert!(
        report
            .load
            .iter()
            .all(|p| p.ops > 0 && p.connections == CONNECTIONS)
    );
    assert!(
        report
            .baseline
            .iter()
            .all(|p| p.ops > 0 && p.connections == 1)
    );
    assert!(report.rss_kib.len() >= 2, "the server's memory was sampled");
    assert!(
        report.rss_final_kib
            <= report.rss_after_warmup_kib + report.rss_after_warmup_kib / 4 + RSS_MARGIN_KIB,
        "server RSS grew from {} KiB to {} KiB",
        report.rss_after_warmup_kib,
        report.rss_final_kib
    );
}
