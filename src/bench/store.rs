//! `cxlkv bench store`: `batch_put` into the shared pool through the client
//! (allocate, copy, publish, one `Register` round trip per batch) against a
//! plain `memcpy` of the same bytes into the same pool — the physical
//! ceiling of storing a chunk.
//!
//! What keeps the comparison honest:
//! - **Same bytes, same memory, same footprint.** Both contestants copy the
//!   same source chunks into prefaulted `MAP_SHARED` mappings of the same
//!   pool: `--pool` (a CXL device, a hugetlbfs file, …) or the embedded
//!   default under `/dev/shm` (`pool`, `dest`). Ours keeps the last `W`
//!   batches registered and deletes the batch before them after each put,
//!   so its pages cycle through `W + 1` batches' worth of memory (at least
//!   twice the last-level cache) and every put finds cold pages, as a KV
//!   cache being filled does; the baseline cycles its destination through a
//!   footprint of the same size, in a region the same server's pool manager
//!   granted (so on a device it is the device's memory, and never pages ours
//!   is using).
//! - **Only the operation is timed.** Ours times `batch_put` alone (the
//!   delete that recycles pages is outside the timer); the baseline times the
//!   copies alone.
//! - **No contestant pays for another's write-backs.** `memcpy` leaves up to
//!   a cache's worth of dirty lines behind. After each contestant, untimed,
//!   every line it may have left in the cache is written back and evicted
//!   (`clflushopt`, else `clflush`; our live batches through read views,
//!   the baseline's whole region), so each timer starts clean.
//! - **Long enough to pay for its own write-backs.** Each contestant stores
//!   `rep_bytes` per repetition, at least eight times the last-level cache
//!   (bounded), so `memcpy`'s deferred write-backs land mostly in its own
//!   timer.
//! - **Same run, interleaved.** Each repetition times ours, then the
//!   baseline, then the two variants below, for the same number of batches;
//!   every figure is the median of `--reps`. `nt_gbps` is the copy engine
//!   alone into the baseline's region (what the client's copy can reach);
//!   `baseline_flushed_gbps` is `memcpy` then every line written back
//!   (`clwb`, else `clflushopt`) and an `sfence` per chunk — what a `memcpy`
//!   must add before another host may read the chunk from memory shared
//!   without coherence (`ratio` stays `ours / baseline`, the plain
//!   `memcpy`; `ratio_flushed` is `ours / baseline_flushed_gbps`).
//!
//! Cases: `chunk=1MiB,batch=1`, `chunk=4MiB,batch=16`, `chunk=32MiB,batch=4`;
//! with `CXLKV_BENCH_CHUNK_SIZES`, one case per size, with
//! `batch = clamp(64 MiB / chunk, 1, 16)`.
//!
//! The server runs in this process (its threads only answer the register
//! and delete round trips). The bytes of the first stored batch are read
//! back and compared before anything is timed.

use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::proto::{self, Layout};
use cxlkv_controlplane::transport::{ClientConfig as RpcConfig, Endpoint};

use super::copy::{evict, rep_bytes_noted};
use super::pool_target::BenchPool;
use super::server::{Client as SessionClient, populate};
use super::{Better, Record, Reporter, median, size_label};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions, RegisterOutcome};
use crate::dataplane::backing::{self, Extent, OpenOptions};
use crate::dataplane::copy::{self, CopyPath};
use crate::dataplane::ids::{PageIndex, RegionId};
use crate::dataplane::map::{MapObservers, MappedRegion, Populate};
use crate::dataplane::visibility::{self, Visibility, VisibilityOps};
use crate::server::{Server, ServerConfig, ServerHandle};

const SCENARIO: &str = "store";
const MIB: usize = 1 << 20;
/// Bytes each contestant stores per repetition, at least; raised to
/// `LLC_MULTIPLE` × the last-level cache up to the `MAX_` bound.
const REP_BYTES: usize = 512 * MIB;
const QUICK_REP_BYTES: usize = 128 * MIB;
const MAX_REP_BYTES: usize = 4 << 30;
const QUICK_MAX_REP_BYTES: usize = 512 * MIB;
/// Assumed last-level cache where sysfs does not say.
const FALLBACK_LLC_BYTES: usize = 64 * MIB;
/// Bytes per batch of a case built from `--chunk-sizes` (or its variable),
/// and its bounds on chunks per batch.
const ENV_BATCH_BYTES: usize = 64 * MIB;
const ENV_MAX_BATCH: usize = 16;
/// Most batches a contestant stores per repetition (small chunks would
/// otherwise make `rep_bytes` hundreds of thousands of round trips).
const MAX_BATCHES_PER_REP: usize = 4096;

/// `(chunk bytes, chunks per batch)`.
const CASES: &[(usize, usize)] = &[(MIB, 1), (4 * MIB, 16), (32 * MIB, 4)];

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let target = BenchPool::from_args(args)?;
    let (cases, sizes_from): (Vec<(usize, usize)>, &str) = match super::chunk_sizes(args)? {
        Some((sizes, from)) => (
            sizes
                .into_iter()
                .map(|chunk| (chunk, (ENV_BATCH_BYTES / chunk).clamp(1, ENV_MAX_BATCH)))
                .collect(),
            from,
        ),
        None => (CASES.to_vec(), "default"),
    };
    let llc = super::copy::llc_bytes().unwrap_or(FALLBACK_LLC_BYTES);
    let footprint = 2 * llc;
    let rep_bytes = if args.quick {
        rep_bytes_noted(r, llc, QUICK_REP_BYTES, QUICK_MAX_REP_BYTES)
    } else {
        rep_bytes_noted(r, llc, REP_BYTES, MAX_REP_BYTES)
    };
    let largest_batch = cases
        .iter()
        .map(|(c, b)| page_bytes(*c) * b)
        .max()
        .unwrap_or(MIB);
    let mut cfg = ServerConfig::ephemeral("bench-store");
    // One case at a time holds regions: our footprint plus a batch and
    // the baseline's as much again, rounded up to whole regions, plus slack
    // for rounding.
    cfg.pool_size_bytes =
        (2 * (footprint + 2 * largest_batch) as u64 + (256 << 20)).next_multiple_of(1 << 30);
    // Each case's client is closed after it; its regions go back quickly.
    cfg.directory.instance_grace = Duration::from_millis(200);
    // The baseline's session is idle while ours runs, which on a loaded
    // host can take longer than the default lease; its region must stay
    // its own meanwhile.
    cfg.directory.session_lease = Duration::from_secs(3600);
    let _pool = target.configure(&mut cfg)?;
    let server = Server::start(cfg).context("starting the in-process server")?;
    r.note(&format!(
        "footprint per contestant {} MiB (2 x LLC {} MiB); {} MiB per repetition; pool {} ({})",
        footprint / MIB,
        llc / MIB,
        rep_bytes / MIB,
        target.label(),
        target.dest()
    ));
    for (i, &(chunk, batch)) in cases.iter().enumerate() {
        let case = Case {
            chunk,
            batch,
            name: format!("chunk={},batch={batch}", size_label(chunk)),
            footprint,
            fingerprint: 0x5709_E000 + i as u64,
        };
        let client = Client::connect(ClientConfig::unix(server.socket_path()))
            .context("connecting the client")?;
        let rec = measure(args, &server, &client, &case, rep_bytes)
            .with_context(|| format!("case {}", case.name))?;
        r.emit(
            &target
                .tag(rec)
                .with("sizes_from", sizes_from)
                .with("chunk_bytes", chunk as u64),
        )?;
        client.close()?;
        let freed = wait_for(Duration::from_secs(30), || {
            server.directory_stats().is_ok_and(|s| s.regions == 0)
        });
        anyhow::ensure!(
            freed,
            "the regions of case {} were not freed in time",
            case.name
        );
    }
    server.shutdown().context("stopping the server")?;
    Ok(())
}

/// A chunk's page: its size rounded up to whole 4 KiB granules.
fn page_bytes(chunk: usize) -> usize {
    chunk.next_multiple_of(backing::PAGE_GRANULE_BYTES as usize)
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

struct Case {
    chunk: usize,
    batch: usize,
    name: String,
    footprint: usize,
    fingerprint: u64,
}

impl Case {
    fn page_bytes(&self) -> usize {
        page_bytes(self.chunk)
    }

    fn batch_bytes(&self) -> usize {
        self.chunk * self.batch
    }

    /// Batches kept registered (`W`): with the one being written, they span
    /// at least the footprint.
    fn window(&self) -> usize {
        self.footprint
            .div_ceil(self.page_bytes() * self.batch)
            .max(1)
    }
}

/// The baseline's variants (module docs).
#[derive(Clone, Copy)]
enum Copier {
    Plain,
    PlainFlushed,
    Engine(CopyPath),
}

fn measure(
    args: &BenchArgs,
    server: &ServerHandle,
    client: &Client,
    case: &Case,
    rep_bytes: usize,
) -> anyhow::Result<Record> {
    let batches_per_rep = (rep_bytes / case.batch_bytes()).clamp(2, MAX_BATCHES_PER_REP);
    let window = case.window();
    let layout = client.layout_with(
        case.page_bytes() as u64,
        case.fingerprint,
        LayoutOptions {
            // Every region the cycle needs, mapped and populated up front.
            initial_reservation_bytes: ((window + 1) * case.batch * case.page_bytes()) as u64,
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
    let baseline = Baseline::new(server, case, &sources)?;

    // Warm up and check: the first batch reads back byte for byte.
    ours.put_batch()?;
    let first = ours.live.front().context("a batch was stored")?.clone();
    for (key, src) in first.iter().zip(&sources) {
        let g = ours.layout.get(key)?.context("a stored key is found")?;
        anyhow::ensure!(g[..] == src[..], "stored bytes differ from the source");
    }
    baseline.copy_batches(1, Copier::Plain, &mut 0)?;
    ours.evict_live(client)?;
    baseline.evict_all()?;

    let (mut ours_gbps, mut base_gbps, mut nt_gbps, mut flushed_gbps) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut put_ms = Vec::new();
    let mut slot = 0usize;
    let bytes = (batches_per_rep * case.batch_bytes()) as f64;
    let nt = copy::choose_copy_in(case.chunk);
    for _ in 0..args.reps {
        let mut timed = Duration::ZERO;
        for _ in 0..batches_per_rep {
            let t = ours.put_batch()?;
            put_ms.push(t.as_secs_f64() * 1e3);
            timed += t;
        }
        ours_gbps.push(bytes / timed.as_secs_f64() / 1e9);
        ours.evict_live(client)?;
        for (copier, samples) in [
            (Copier::Plain, &mut base_gbps),
            (Copier::Engine(nt), &mut nt_gbps),
            (Copier::PlainFlushed, &mut flushed_gbps),
        ] {
            let t = baseline.copy_batches(batches_per_rep, copier, &mut slot)?;
            samples.push(bytes / t.as_secs_f64() / 1e9);
            baseline.evict_all()?;
        }
    }
    ours.drain()?;
    drop(baseline);
    let (o, b) = (median(&mut ours_gbps), median(&mut base_gbps));
    let flushed = median(&mut flushed_gbps);
    Ok(
        Record::new(SCENARIO, &case.name, o, b, "GB/s", Better::Higher)
            .with("nt_gbps", median(&mut nt_gbps))
            .with("baseline_flushed_gbps", flushed)
            .with(
                "ratio_flushed",
                if flushed > 0.0 { o / flushed } else { 0.0 },
            )
            .with("flush_instruction", visibility::line_flush().as_str())
            .with("evict_between", visibility::line_evict().as_str())
            .with("copy_path", nt.as_str())
            .with("batch_put_ms_p50", median(&mut put_ms))
            .with("batches_per_rep", batches_per_rep as u64)
            .with("rep_bytes", (batches_per_rep * case.batch_bytes()) as u64)
            .with("window_batches", window as u64)
            .with("footprint_mib", (case.footprint / MIB) as u64)
            .with("reps", args.reps as u64)
            .with("server", "in-process"),
    )
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

    /// Untimed: writes back and evicts the pages of every live batch (the
    /// last footprint's worth of puts, all that can still be cached), then
    /// sends the read views' unpins, so the next contestant pays for
    /// neither.
    fn evict_live(&self, client: &Client) -> anyhow::Result<()> {
        for keys in &self.live {
            for guard in self.layout.batch_get(keys)? {
                evict(&guard.context("a live key is missing")?);
            }
        }
        client.flush_unpins()?;
        Ok(())
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

/// The ceiling: the same chunks copied into a region of the same pool,
/// granted by the same server to a session of the bench's own, whose
/// destination slots cycle through the same footprint.
struct Baseline<'a> {
    region: MappedRegion,
    /// Holds the region: it returns to the pool when the session closes.
    _session: SessionClient,
    sources: &'a [Vec<u8>],
    chunk: usize,
    page_bytes: usize,
    slots: usize,
}

impl<'a> Baseline<'a> {
    fn new(server: &ServerHandle, case: &Case, sources: &'a [Vec<u8>]) -> anyhow::Result<Self> {
        let slots = (case.window() + 1) * case.batch;
        let page_bytes = case.page_bytes();
        let mut session = SessionClient::connect(
            &Endpoint::Unix(server.socket_path().to_owned()),
            RpcConfig::default(),
        )?;
        populate(&mut session, 0)?;
        let meta = session.seq();
        let granted: proto::RegionGranted = session.call(&proto::RequestRegion {
            meta,
            layout: Layout {
                page_size_bytes: page_bytes as u64,
                fingerprint: case.fingerprint ^ 0xBA5E,
            },
            len_bytes: (slots * page_bytes) as u64,
        })?;
        let [pool_path] = server.pool_paths() else {
            anyhow::bail!("the bench server serves one pool");
        };
        anyhow::ensure!(granted.desc.pool == 0, "a region of the one pool");
        let pool = backing::open(pool_path, &OpenOptions::new())
            .with_context(|| format!("opening {}", pool_path.display()))?;
        // SAFETY: the pool manager granted this extent to the bench's own
        // session, which holds it until this value drops (the directory
        // frees a region only after its instance is gone), so no one else
        // maps it for writing; this thread writes its slots through one
        // view at a time and reads them (the evictions) only in between.
        let region = unsafe {
            MappedRegion::map(
                pool.as_ref(),
                RegionId(granted.desc.region),
                Extent::new(granted.desc.offset_bytes, granted.desc.len_bytes),
                Populate::Eager,
                &MapObservers::new(),
            )
        }?;
        Ok(Self {
            region,
            _session: session,
            sources,
            chunk: case.chunk,
            page_bytes,
            slots,
        })
    }

    /// Copies `batches` batches with `copier`, continuing the slot cycle at
    /// `*slot`; returns the time the copies took.
    fn copy_batches(
        &self,
        batches: usize,
        copier: Copier,
        slot: &mut usize,
    ) -> anyhow::Result<Duration> {
        let publish = VisibilityOps::for_mode(Visibility::Flush);
        let mut total = Duration::ZERO;
        for _ in 0..batches {
            let t = Instant::now();
            for src in self.sources {
                // SAFETY: see `new`: each slot is written through one view at
                // a time by this thread only.
                let mut dst = unsafe {
                    self.region
                        .page_mut(self.page_bytes, PageIndex(*slot as u32), self.chunk)
                }?;
                match copier {
                    Copier::Plain => dst.copy_from_slice(src),
                    Copier::PlainFlushed => {
                        dst.copy_from_slice(src);
                        publish.publish(&dst);
                    }
                    Copier::Engine(path) => copy::copy_with(path, &mut dst, src)?,
                }
                *slot = (*slot + 1) % self.slots;
            }
            total += t.elapsed();
        }
        Ok(total)
    }

    /// Untimed: writes back and evicts the whole region.
    fn evict_all(&self) -> anyhow::Result<()> {
        let len = self.region.len_bytes();
        evict(self.region.page(len, PageIndex(0), len)?.as_bytes());
        Ok(())
    }
}
