//! `cxlkv bench tier`: the L1 tier's read cycle — `reserve_read` then
//! `finish_read` of a 64-key batch — against the same keys read through the
//! plain client: `batch_get` (pinned views) then an explicit release
//! (`flush_unpins` after the guards drop). Both make the same two round
//! trips per batch (a pinning `Lookup`, then an `Unpin` that is answered
//! before the call returns), so the ratio is the tier's own cost: staging
//! maps, argument checks, the key mirror, listener dispatch.
//!
//! What keeps it honest:
//! - **Same keys, same server, same client.** One in-process server, one
//!   client, one layout; the tier is built over that layout. The keys are
//!   registered once, up front, and every batch of both contestants reads
//!   64 of them, cycling through all batches.
//! - **Same work per batch.** Both take one pin per key and release it
//!   before the next batch; the baseline's release is the explicit flush,
//!   not the maintenance thread's deferred one.
//! - **Same run, interleaved batch by batch.** Each repetition alternates
//!   one batch of each, switching which goes first, so a burst of noise
//!   hits both alike; figures are medians of `--reps`. Before timing, both
//!   read every key back and the bytes are compared.
//!
//! The server's pool is `--pool` when given (`pool`, `dest`).

use std::time::{Duration, Instant};

use anyhow::Context;

use super::pool_target::BenchPool;
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions, RegisterOutcome};
use crate::server::{Server, ServerConfig};
use crate::tier::{Holds, L1Tier, TierCode, TierConfig};

const SCENARIO: &str = "tier";
const BATCH: usize = 64;
/// Distinct batches of keys (the cycle both contestants read).
const BATCHES: usize = 16;
const PAGE_BYTES: u64 = 16 << 10;
const CHUNK_BYTES: usize = 4096;
/// Batches each contestant reads per repetition.
const BATCHES_PER_REP: usize = 2000;
const QUICK_BATCHES_PER_REP: usize = 200;

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let target = BenchPool::from_args(args)?;
    let mut cfg = ServerConfig::ephemeral("bench-tier");
    let _pool = target.configure(&mut cfg)?;
    let server = Server::start(cfg).context("starting the in-process server")?;
    let client = Client::connect(ClientConfig::unix(server.socket_path()))
        .context("connecting the client")?;
    let layout = client.layout_with(
        PAGE_BYTES,
        0x7153_0001,
        LayoutOptions {
            initial_reservation_bytes: PAGE_BYTES * (BATCH * BATCHES) as u64,
            region_size_bytes: 0,
            auto_expand: true,
        },
    )?;
    let batches = register_keys(&layout)?;
    let tier = L1Tier::new(layout.clone(), TierConfig::default())?;
    check(&tier, &layout, &batches)?;

    let per_rep = if args.quick {
        QUICK_BATCHES_PER_REP
    } else {
        BATCHES_PER_REP
    };
    let keys_per_rep = (per_rep * BATCH) as f64;
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    let (mut ours_batch_us, mut base_batch_us) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let (mut t_ours, mut t_base) = (Duration::ZERO, Duration::ZERO);
        for j in 0..per_rep {
            let keys = &batches[j % batches.len()];
            // Batch by batch, alternating which goes first: a burst of
            // noise on this shared machine hits both alike.
            if j % 2 == 0 {
                t_ours += tier_batch(&tier, keys, &mut ours_batch_us)?;
                t_base += client_batch(&client, &layout, keys, &mut base_batch_us)?;
            } else {
                t_base += client_batch(&client, &layout, keys, &mut base_batch_us)?;
                t_ours += tier_batch(&tier, keys, &mut ours_batch_us)?;
            }
        }
        ours.push(keys_per_rep / t_ours.as_secs_f64());
        base.push(keys_per_rep / t_base.as_secs_f64());
    }
    let stats = tier.stats();
    anyhow::ensure!(
        stats.pins_lost == 0,
        "the tier lost pins during the run: {stats:?}"
    );
    let (o, b) = (median(&mut ours), median(&mut base));
    let rec = Record::new(
        SCENARIO,
        format!("batch={BATCH},holds=1"),
        o,
        b,
        "keys/s",
        Better::Higher,
    )
    .with("ours_batch_us_p50", percentile(&mut ours_batch_us, 50.0))
    .with("ours_batch_us_p99", percentile(&mut ours_batch_us, 99.0))
    .with(
        "baseline_batch_us_p50",
        percentile(&mut base_batch_us, 50.0),
    )
    .with(
        "baseline_batch_us_p99",
        percentile(&mut base_batch_us, 99.0),
    )
    .with("baseline_op", "batch_get+flush_unpins")
    .with("round_trips_per_batch", 2)
    .with("batches_per_rep", per_rep as u64)
    .with("distinct_keys", (BATCH * BATCHES) as u64)
    .with("reps", args.reps as u64)
    .with("server", "in-process");
    r.emit(&target.tag(rec))?;
    tier.close()?;
    client.close()?;
    server.shutdown().context("stopping the server")?;
    Ok(())
}

fn bench_key(batch: usize, i: usize) -> Vec<u8> {
    format!("bench-tier-{batch:03}-{i:03}").into_bytes()
}

fn bench_bytes(batch: usize, i: usize) -> Vec<u8> {
    (0..CHUNK_BYTES)
        .map(|j| (j as u8) ^ (i as u8).wrapping_mul(31) ^ (batch as u8))
        .collect()
}

/// Registers every key; returns the batches.
fn register_keys(layout: &LayoutHandle) -> anyhow::Result<Vec<Vec<Vec<u8>>>> {
    let mut batches = Vec::with_capacity(BATCHES);
    for b in 0..BATCHES {
        let items: Vec<(Vec<u8>, Vec<u8>)> = (0..BATCH)
            .map(|i| (bench_key(b, i), bench_bytes(b, i)))
            .collect();
        let outcomes = layout.batch_put(&items)?;
        anyhow::ensure!(
            outcomes.iter().all(|o| *o == RegisterOutcome::Inserted),
            "a fresh key was not inserted: {outcomes:?}"
        );
        batches.push(items.into_iter().map(|(k, _)| k).collect());
    }
    Ok(batches)
}

/// Both contestants read every key back with the right bytes.
fn check(tier: &L1Tier, layout: &LayoutHandle, batches: &[Vec<Vec<u8>>]) -> anyhow::Result<()> {
    for (b, keys) in batches.iter().enumerate() {
        let got = tier.reserve_read(keys, Holds::ONE)?;
        for (i, p) in got.iter().enumerate() {
            let page = p
                .page
                .as_ref()
                .with_context(|| format!("tier: key {i} of batch {b}: {}", p.code))?;
            // SAFETY: held by this reservation until the finish below; a
            // registered page is never written while pinned.
            let bytes = unsafe { page.as_slice() };
            anyhow::ensure!(bytes == bench_bytes(b, i), "tier: bytes differ");
        }
        let codes = tier.finish_read(keys, Holds::ONE)?;
        anyhow::ensure!(codes.iter().all(|c| *c == TierCode::Success));
        for (i, g) in layout.batch_get(keys)?.into_iter().enumerate() {
            let g = g.with_context(|| format!("client: key {i} of batch {b} missing"))?;
            anyhow::ensure!(g[..] == bench_bytes(b, i)[..], "client: bytes differ");
        }
    }
    Ok(())
}

/// One batch through the tier: `reserve_read` then `finish_read`.
fn tier_batch(
    tier: &L1Tier,
    keys: &[Vec<u8>],
    batch_us: &mut Vec<f64>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let got = tier.reserve_read(keys, Holds::ONE)?;
    let codes = tier.finish_read(keys, Holds::ONE)?;
    let e = t.elapsed();
    anyhow::ensure!(
        got.iter().all(|p| p.code == TierCode::Success)
            && codes.iter().all(|c| *c == TierCode::Success),
        "a tier read failed"
    );
    batch_us.push(e.as_secs_f64() * 1e6);
    Ok(e)
}

/// One batch through `batch_get`, the guards dropped, the release flushed.
fn client_batch(
    client: &Client,
    layout: &LayoutHandle,
    keys: &[Vec<u8>],
    batch_us: &mut Vec<f64>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let guards = layout.batch_get(keys)?;
    let found = guards.iter().all(Option::is_some);
    drop(guards);
    client.flush_unpins()?;
    let e = t.elapsed();
    anyhow::ensure!(found, "a client read missed");
    batch_us.push(e.as_secs_f64() * 1e6);
    Ok(e)
}
