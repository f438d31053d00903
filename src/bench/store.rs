//! `cxlkv bench store`: `batch_put` into the shared pool through the client
//! (allocate, copy, publish, one `Register` round trip per batch) against a
//! plain `memcpy` of the same bytes into the same kind of mapping — the
//! physical ceiling of storing a chunk.
//!
//! What keeps the comparison honest:
//! - **Same bytes, same memory, same footprint.** Both contestants copy the
//!   same source chunks into `MAP_SHARED`, prefaulted `/dev/shm` mappings.
//!   Ours keeps the last `W` batches registered and deletes the batch before
//!   them after each put, so its pages cycle through `W + 1` batches' worth of
//!   memory (at least twice the last-level cache) and every put finds cold
//!   pages, as a KV cache being filled does; the baseline cycles its
//!   destination through a footprint of the same size.
//! - **Only the operation is timed.** Ours times `batch_put` alone (the
//!   delete that recycles pages is outside the timer); the baseline times the
//!   copies alone.
//! - **Same run, interleaved.** Each repetition times ours, then the
//!   baseline, for the same number of batches; every figure is the median of
//!   `--reps`. A third figure, `nt_gbps`, is the copy engine alone into the
//!   baseline mapping (what the client's copy can reach).
//!
//! The server runs in this process (its threads only answer the register
//! and delete round trips). The bytes of the first stored batch are read
//! back and compared before anything is timed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{Better, Record, Reporter, median};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions, RegisterOutcome};
use crate::dataplane::backing::{self, Extent, OpenOptions};
use crate::dataplane::copy::{self, CopyPath};
use crate::dataplane::ids::{PageIndex, RegionId};
use crate::dataplane::map::{MapObservers, MappedRegion, Populate};
use crate::server::{Server, ServerConfig};

const SCENARIO: &str = "store";
const MIB: usize = 1 << 20;
/// Bytes each contestant stores per repetition.
const REP_BYTES: usize = 512 * MIB;
const QUICK_REP_BYTES: usize = 128 * MIB;
/// Assumed last-level cache where sysfs does not say.
const FALLBACK_LLC_BYTES: usize = 64 * MIB;

/// `(chunk bytes, chunks per batch, case name)`.
const CASES: &[(usize, usize, &str)] = &[
    (MIB, 1, "chunk=1MiB,batch=1"),
    (4 * MIB, 16, "chunk=4MiB,batch=16"),
    (32 * MIB, 4, "chunk=32MiB,batch=4"),
];

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let llc = super::copy::llc_bytes().unwrap_or(FALLBACK_LLC_BYTES);
    let footprint = 2 * llc;
    let largest_batch = CASES.iter().map(|(c, b, _)| c * b).max().unwrap_or(MIB);
    let mut cfg = ServerConfig::ephemeral("bench-store");
    // One case at a time holds regions: its footprint plus a batch, rounded
    // up to whole regions, plus slack for rounding.
    cfg.pool_size_bytes =
        ((footprint + 2 * largest_batch) as u64 + (256 << 20)).next_multiple_of(1 << 30);
    // Each case's client is closed after it; its regions go back quickly.
    cfg.directory.instance_grace = Duration::from_millis(200);
    let server = Server::start(cfg).context("starting the in-process server")?;
    r.note(&format!(
        "footprint per contestant {} MiB (2 x LLC {} MiB); pool {} MiB",
        footprint / MIB,
        llc / MIB,
        server_pool_mib(&server)
    ));
    for (i, &(chunk, batch, name)) in CASES.iter().enumerate() {
        let case = Case {
            chunk,
            batch,
            name,
            footprint,
            fingerprint: 0x5709_E000 + i as u64,
        };
        let client = Client::connect(ClientConfig::unix(server.socket_path()))
            .context("connecting the client")?;
        measure(args, r, &client, &case).with_context(|| format!("case {name}"))?;
        client.close()?;
        let freed = wait_for(Duration::from_secs(30), || {
            server.directory_stats().is_ok_and(|s| s.regions == 0)
        });
        anyhow::ensure!(freed, "the regions of case {name} were not freed in time");
    }
    server.shutdown().context("stopping the server")?;
    Ok(())
}

fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn server_pool_mib(server: &crate::server::ServerHandle) -> u64 {
    server
        .pool_paths()
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len() >> 20)
        .sum()
}

struct Case {
    chunk: usize,
    batch: usize,
    name: &'static str,
    footprint: usize,
    fingerprint: u64,
}

impl Case {
    fn batch_bytes(&self) -> usize {
        self.chunk * self.batch
    }

    /// Batches kept registered (`W`): with the one being written, they span
    /// at least the footprint.
    fn window(&self) -> usize {
        self.footprint.div_ceil(self.batch_bytes()).max(1)
    }
}

fn measure(args: &BenchArgs, r: &mut Reporter, client: &Client, case: &Case) -> anyhow::Result<()> {
    let rep_bytes = if args.quick {
        QUICK_REP_BYTES
    } else {
        REP_BYTES
    };
    let batches_per_rep = (rep_bytes / case.batch_bytes()).max(2);
    let window = case.window();
    let layout = client.layout_with(
        case.chunk as u64,
        case.fingerprint,
        LayoutOptions {
            // Every region the cycle needs, mapped and populated up front.
            initial_reservation_bytes: ((window + 1) * case.batch_bytes()) as u64,
            region_size_bytes: 0,
            auto_expand: true,
        },
    )?;
    let sources: Vec<Vec<u8>> = (0..case.batch)
        .map(|i| {
            (0..case.chunk)
                .map(|j| (j as u8) ^ ((j >> 12) as u8) ^ (i as u8).wrapping_mul(31))
                .collect()
        })
        .collect();
    let mut ours = Ours {
        layout,
        sources: &sources,
        window,
        live: std::collections::VecDeque::new(),
        next: 0,
    };
    let baseline = Baseline::new(case, &sources)?;

    // Warm up and check: the first batch reads back byte for byte.
    ours.put_batch()?;
    let first = ours.live.front().context("a batch was stored")?.clone();
    for (key, src) in first.iter().zip(&sources) {
        let g = ours.layout.get(key)?.context("a stored key is found")?;
        anyhow::ensure!(g[..] == src[..], "stored bytes differ from the source");
    }
    baseline.copy_batches(1, CopyPath::Plain, &mut 0)?;

    let (mut ours_gbps, mut base_gbps, mut nt_gbps) = (Vec::new(), Vec::new(), Vec::new());
    let mut put_ms = Vec::new();
    let mut slot = 0usize;
    let bytes = (batches_per_rep * case.batch_bytes()) as f64;
    for _ in 0..args.reps {
        let mut timed = Duration::ZERO;
        for _ in 0..batches_per_rep {
            let t = ours.put_batch()?;
            put_ms.push(t.as_secs_f64() * 1e3);
            timed += t;
        }
        ours_gbps.push(bytes / timed.as_secs_f64() / 1e9);
        let t = baseline.copy_batches(batches_per_rep, CopyPath::Plain, &mut slot)?;
        base_gbps.push(bytes / t.as_secs_f64() / 1e9);
        let nt = copy::choose_copy_in(case.chunk);
        let t = baseline.copy_batches(batches_per_rep, nt, &mut slot)?;
        nt_gbps.push(bytes / t.as_secs_f64() / 1e9);
    }
    ours.drain()?;
    let (o, b) = (median(&mut ours_gbps), median(&mut base_gbps));
    let rec = Record::new(SCENARIO, case.name, o, b, "GB/s", Better::Higher)
        .with("nt_gbps", median(&mut nt_gbps))
        .with("copy_path", copy::choose_copy_in(case.chunk).as_str())
        .with("batch_put_ms_p50", median(&mut put_ms))
        .with("batches_per_rep", batches_per_rep as u64)
        .with("window_batches", window as u64)
        .with("footprint_mib", (case.footprint / MIB) as u64)
        .with("reps", args.reps as u64)
        .with("server", "in-process")
        .with("dest", "shm");
    r.emit(&rec)?;
    Ok(())
}

/// The client side: puts batches, keeping the last `window` registered.
struct Ours<'a> {
    layout: LayoutHandle,
    sources: &'a [Vec<u8>],
    window: usize,
    live: std::collections::VecDeque<Vec<Vec<u8>>>,
    next: u64,
}

impl Ours<'_> {
    /// Stores one batch under fresh keys (timed), then deletes the oldest
    /// batch beyond the window (not timed): its pages come back through the
    /// freed-page notices on the delete's reply.
    fn put_batch(&mut self) -> anyhow::Result<Duration> {
        let keys: Vec<Vec<u8>> = (0..self.sources.len())
            .map(|i| format!("store-{}-{i}", self.next).into_bytes())
            .collect();
        self.next += 1;
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .map(Vec::as_slice)
            .zip(self.sources.iter().map(Vec::as_slice))
            .collect();
        let t = Instant::now();
        let outcomes = self.layout.batch_put(&items)?;
        let elapsed = t.elapsed();
        anyhow::ensure!(
            outcomes.iter().all(|o| *o == RegisterOutcome::Inserted),
            "a fresh key was not inserted: {outcomes:?}"
        );
        self.live.push_back(keys);
        while self.live.len() > self.window {
            self.delete_oldest()?;
        }
        Ok(elapsed)
    }

    fn delete_oldest(&mut self) -> anyhow::Result<()> {
        if let Some(old) = self.live.pop_front() {
            self.layout.batch_delete(&old)?;
        }
        Ok(())
    }

    fn drain(&mut self) -> anyhow::Result<()> {
        while !self.live.is_empty() {
            self.delete_oldest()?;
        }
        Ok(())
    }
}

/// The ceiling: the same chunks copied into a mapping of a `/dev/shm` file
/// whose destination slots cycle through the same footprint.
struct Baseline<'a> {
    region: MappedRegion,
    path: PathBuf,
    sources: &'a [Vec<u8>],
    chunk: usize,
    slots: usize,
}

impl<'a> Baseline<'a> {
    fn new(case: &Case, sources: &'a [Vec<u8>]) -> anyhow::Result<Self> {
        let slots = (case.window() + 1) * case.batch;
        let len = ((slots * case.chunk) as u64).next_multiple_of(backing::DEFAULT_ALIGN_BYTES);
        let path = PathBuf::from(backing::DEFAULT_POOL_DIR).join(format!(
            "cxlkv-bench-store-{}-{}",
            std::process::id(),
            case.fingerprint
        ));
        let pool = backing::open(&path, &OpenOptions::new().create_size_bytes(len))
            .with_context(|| format!("creating {}", path.display()))?;
        // SAFETY: this bench process created the file and is its only user;
        // it writes pages only through `page_mut` views, one at a time, and
        // never reads them while writing.
        let region = unsafe {
            MappedRegion::map(
                pool.as_ref(),
                RegionId(0),
                Extent::new(0, len),
                Populate::Eager,
                &MapObservers::new(),
            )
        }?;
        Ok(Self {
            region,
            path,
            sources,
            chunk: case.chunk,
            slots,
        })
    }

    /// Copies `batches` batches with `path`, continuing the slot cycle at
    /// `*slot`; returns the time the copies took.
    fn copy_batches(
        &self,
        batches: usize,
        path: CopyPath,
        slot: &mut usize,
    ) -> anyhow::Result<Duration> {
        let mut total = Duration::ZERO;
        for _ in 0..batches {
            let t = Instant::now();
            for src in self.sources {
                // SAFETY: see `new`: each slot is written through one view at
                // a time by this thread only.
                let mut dst = unsafe {
                    self.region
                        .page_mut(self.chunk, PageIndex(*slot as u32), self.chunk)
                }?;
                copy::copy_with(path, &mut dst, src)?;
                *slot = (*slot + 1) % self.slots;
            }
            total += t.elapsed();
        }
        Ok(total)
    }
}

impl Drop for Baseline<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
