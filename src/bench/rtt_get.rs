//! `cxlkv bench rtt`, case `op=get,transport=unix,backend=default`: one
//! key's `get` through the client — lookup with a pin, a view in place, the
//! guard dropped (its unpin sent ahead of the next request, pipelined) —
//! against the raw busy-polling socket ping-pong of the other rtt cases,
//! measured in the same run.
//!
//! The directory server runs in a forked child. The raw echo peer is forked
//! for each repetition too, so this process must be single-threaded then:
//! each repetition's client is connected after the raw measurement and
//! closed (its maintenance thread joined) before the next one.

use std::time::Instant;

use super::forked_server::{ForkedServer, bench_config};
use super::rtt::{Kind, ONE_KEY_REPLY_WIRE_BYTES, ONE_KEY_REQUEST_WIRE_BYTES, raw_latencies};
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig};

const SCENARIO: &str = "rtt";
const CASE: &str = "op=get,transport=unix,backend=default";
const PAGE_BYTES: u64 = 64 << 10;
const KEY: &[u8] = b"rtt-get-key-0000000000000000";

/// Runs the case (called from `rtt::run`).
pub(super) fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let n = if args.quick { 2_000 } else { 20_000 };
    let server = ForkedServer::start(bench_config("bench-rtt-get", 512 << 20))?;
    let (mut ours_p50, mut raw_p50, mut all_ours) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let mut raw = raw_latencies(
            Kind::Unix,
            (ONE_KEY_REQUEST_WIRE_BYTES, ONE_KEY_REPLY_WIRE_BYTES),
            n,
            None,
        )?;
        raw_p50.push(percentile(&mut raw, 50.0));
        let mut ours = our_latencies(&server, n)?;
        ours_p50.push(percentile(&mut ours, 50.0));
        all_ours.extend(ours);
    }
    let (ours, base) = (median(&mut ours_p50), median(&mut raw_p50));
    let rec = Record::new(SCENARIO, CASE, ours, base, "us", Better::Lower)
        .with("p50_us", ours)
        .with("p99_us", percentile(&mut all_ours, 99.0))
        .with("raw_p50_us", base)
        .with("handler", "directory")
        .with("server", "forked process")
        .with("gets_per_rep", n as u64)
        .with("reps", args.reps as u64)
        .with(
            "measures",
            "client get: Lookup(pins=1) round trip + view + guard drop; the unpin rides ahead of the next Lookup",
        );
    r.emit(&rec)?;
    Ok(())
}

fn our_latencies(server: &ForkedServer, n: usize) -> anyhow::Result<Vec<f64>> {
    let client = Client::connect(ClientConfig::unix(server.socket()))?;
    let layout = client.layout(PAGE_BYTES, 1)?;
    layout.put(KEY, &[7u8; 4096])?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        let g = layout.get(KEY)?;
        anyhow::ensure!(g.as_ref().is_some_and(|g| g.len() == 4096), "key lost");
        drop(g);
        if i >= n / 10 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    layout.delete(KEY)?;
    drop(layout);
    client.close()?;
    Ok(out)
}
