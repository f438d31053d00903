//! `cxlkv bench directory-memory`: what the directory costs per key, in
//! resident memory and in CPU, on the in-process state machine (no server,
//! no transport).
//!
//! **Memory** (case `keys=…,key_bytes=100`): the resident set (RSS, from
//! `/proc/self/statm`) before and after registering N keys of 100 bytes each,
//! in 4 KiB pages (the smallest page size, so the per-page knowledge of the
//! regions weighs the most), divided by N, minus the 100 key bytes
//! themselves: `bytes_per_key`. RSS is the honest measure here: it counts
//! what the machine actually pays — allocator headers and rounding, table
//! control bytes, growth slack that was touched, per-region page state — and
//! nothing that was merely reserved. Keys are generated on the fly (never
//! stored by the bench), and every buffer the bench itself uses is allocated
//! before the first reading. `ours` = bytes_per_key; `baseline` = the same
//! figure for a naive `HashMap<Vec<u8>, Location>` (std) holding the same
//! keys, measured in the same run, so `ratio` = naive ÷ ours (> 1: the
//! directory is the more compact, although it also keeps pins, regions,
//! page generations and LRU links, which the naive map does not). The
//! target (≤ 96 bytes per key) is checked on `bytes_per_key` itself
//! (`target_bytes_per_key`, `target_met`).
//!
//! **CPU** (cases `op=…`): nanoseconds per key of `exists` and `lookup`
//! batches against the same N-key directory, random existing keys, median of
//! `--reps` passes; `baseline` = the naive `HashMap` (std SipHash) probing the
//! same keys, so `ratio` = naive ÷ ours. These exclude the transport and the
//! rkyv decoding that `cxlkv bench exists|lookup` include.
//!
//! The directory's state lives in this process's memory, never in a pool:
//! `--pool` does not apply (`pool` = `none`, `dest` = `heap`).

use std::time::Instant;

use anyhow::{Context, ensure};
use cxlkv_controlplane::directory::{
    Caller, Directory, DirectoryConfig, Effect, Hello, Layout, Location, Peer, RegionHandle,
    RegionToken, RegisterEntry, RegisterOutcome, Sequence, Time, UnpinEntry,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};

use super::{Better, Record, Reporter, median};
use crate::cli::BenchArgs;

const SCENARIO: &str = "directory-memory";
const KEY_BYTES: usize = 100;
const TARGET_BYTES_PER_KEY: f64 = 96.0;
const PAGE_SIZE_BYTES: u64 = 4096;
const REGION_BYTES: u64 = 64 << 20;
const BATCH: usize = 4096;
const LAYOUT: Layout = Layout {
    page_size_bytes: PAGE_SIZE_BYTES,
    fingerprint: 0x00C0_FFEE,
};

/// Key `i`: 100 deterministic pseudo-random bytes.
fn make_key(i: u64, out: &mut [u8; KEY_BYTES]) {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for chunk in out.chunks_mut(8) {
        x ^= x >> 33;
        x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        x ^= x >> 29;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    out[..8].copy_from_slice(&i.to_le_bytes());
}

fn resident_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").context("reading /proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .context("no resident field in /proc/self/statm")?
        .parse()
        .context("parsing /proc/self/statm")?;
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    ensure!(page > 0, "sysconf(_SC_PAGESIZE) failed");
    Ok(pages * page as u64)
}

/// A directory with one instance, its session, and a counter of sequence
/// numbers; regions are granted in-process.
struct Setup {
    dir: Directory,
    caller: Caller,
    next_seq: u64,
    next_region: u64,
}

impl Setup {
    fn new() -> anyhow::Result<Self> {
        let mut dir = Directory::new(DirectoryConfig::default(), [0x42; 32])?;
        let welcome = dir.hello(
            Hello {
                instance: "bench",
                quota_bytes: None,
            },
            Peer::Unix {
                pid: std::process::id(),
                uid: 0,
                gid: 0,
            },
            Time::ZERO,
        )?;
        Ok(Self {
            dir,
            caller: Caller {
                session: welcome.session,
                notice_ack: 0,
            },
            next_seq: 1,
            next_region: 1,
        })
    }

    /// The next sequence number; all earlier replies count as received, so
    /// the reply cache holds one reply at a time (as with a real client).
    fn seq(&mut self) -> Sequence {
        let seq = self.next_seq;
        self.next_seq += 1;
        Sequence {
            seq,
            replies_received_below: seq,
        }
    }

    fn region(&mut self) -> anyhow::Result<RegionId> {
        let seq = self.seq();
        self.dir
            .request_region(&self.caller, seq, LAYOUT, REGION_BYTES, Time::ZERO)?;
        let effects: Vec<Effect> = self.dir.drain_effects().collect();
        for effect in effects {
            if let Effect::AllocateRegion {
                request, len_bytes, ..
            } = effect
            {
                let id = RegionId(self.next_region);
                self.next_region += 1;
                let handle = RegionHandle {
                    region: id,
                    pool: PoolId(0),
                    offset_bytes: id.0 * REGION_BYTES,
                    len_bytes,
                    token: RegionToken([id.0 as u8; 32]),
                };
                let done = self.dir.region_allocated(request, Ok(handle));
                ensure!(done.iter().all(|c| c.result.is_ok()), "region grant failed");
                return Ok(id);
            }
        }
        anyhow::bail!("the directory asked for no region")
    }
}

pub fn run(args: &BenchArgs, out: &mut Reporter) -> anyhow::Result<()> {
    let n: u64 = if args.quick { 100_000 } else { 1_000_000 };
    let pages_per_region = REGION_BYTES / PAGE_SIZE_BYTES;
    // Everything the bench itself needs is allocated before the first reading.
    let mut keys = vec![[0u8; KEY_BYTES]; BATCH];
    let mut setup = Setup::new()?;
    let regions_needed = n.div_ceil(pages_per_region) as usize;
    let mut regions = Vec::with_capacity(regions_needed);

    let before = resident_bytes()?;
    for _ in 0..regions_needed {
        regions.push(setup.region()?);
    }
    let mut i = 0u64;
    while i < n {
        let len = BATCH.min((n - i) as usize);
        for (j, k) in keys[..len].iter_mut().enumerate() {
            make_key(i + j as u64, k);
        }
        let seq = setup.seq();
        let entries = keys[..len].iter().enumerate().map(|(j, key)| {
            let idx = i + j as u64;
            RegisterEntry {
                key: &key[..],
                location: Location {
                    region: regions[(idx / pages_per_region) as usize],
                    page: PageIndex((idx % pages_per_region) as u32),
                    generation: Generation(1),
                    len_bytes: PAGE_SIZE_BYTES as u32,
                },
            }
        });
        let reply = setup
            .dir
            .register(&setup.caller, seq, LAYOUT, entries, Time::ZERO)?;
        ensure!(
            reply.body.iter().all(|o| *o == RegisterOutcome::Inserted),
            "a benchmark key was not inserted"
        );
        i += len as u64;
    }
    let after = resident_bytes()?;
    let stats = setup.dir.stats(Time::ZERO);
    ensure!(
        stats.keys == n,
        "expected {n} keys, the directory holds {}",
        stats.keys
    );
    let ours = (after - before) as f64 / n as f64 - KEY_BYTES as f64;

    // The naive map, measured on top (nothing was freed in between, so it
    // cannot reuse the directory's memory).
    let naive_before = resident_bytes()?;
    let mut naive: std::collections::HashMap<Vec<u8>, Location> = std::collections::HashMap::new();
    let mut key = [0u8; KEY_BYTES];
    for idx in 0..n {
        make_key(idx, &mut key);
        naive.insert(
            key.to_vec(),
            Location {
                region: regions[(idx / pages_per_region) as usize],
                page: PageIndex((idx % pages_per_region) as u32),
                generation: Generation(1),
                len_bytes: PAGE_SIZE_BYTES as u32,
            },
        );
    }
    let naive_after = resident_bytes()?;
    let naive_per_key = (naive_after - naive_before) as f64 / n as f64 - KEY_BYTES as f64;

    out.emit(
        &Record::new(
            SCENARIO,
            format!("keys={n},key_bytes={KEY_BYTES}"),
            ours,
            naive_per_key,
            "B/key",
            Better::Lower,
        )
        .with("bytes_per_key", ours)
        .with("naive_hashmap_bytes_per_key", naive_per_key)
        .with("target_bytes_per_key", TARGET_BYTES_PER_KEY)
        .with("target_met", ours <= TARGET_BYTES_PER_KEY)
        .with("rss_delta_bytes", after - before)
        .with("page_size_bytes", PAGE_SIZE_BYTES)
        .with("regions", regions.len())
        .with("reps", 1)
        .with("pool", "none")
        .with("dest", "heap"),
    )?;
    out.note(
        "memory: one measurement (RSS is deterministic here; repetitions would reuse freed memory)",
    );

    // CPU per key, on the same directory.
    let probes: usize = if args.quick { 1 << 15 } else { 1 << 18 };
    let mut probe_keys = vec![[0u8; KEY_BYTES]; probes];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for k in &mut probe_keys {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        make_key(x % n, k);
    }
    for (op, batch) in [
        ("exists", 512),
        ("lookup", 512),
        ("lookup_pin", 512),
        ("lookup", 1),
    ] {
        let mut ours_ns = Vec::with_capacity(args.reps);
        let mut naive_ns = Vec::with_capacity(args.reps);
        for _ in 0..args.reps {
            let start = Instant::now();
            for chunk in probe_keys.chunks(batch) {
                let keys = chunk.iter().map(|k| &k[..]);
                match op {
                    "exists" => {
                        let r = setup.dir.exists(&setup.caller, LAYOUT, keys, Time::ZERO)?;
                        debug_assert!(r.body.iter().all(|&f| f));
                    }
                    "lookup" => {
                        setup
                            .dir
                            .lookup(&setup.caller, None, LAYOUT, keys, 0, Time::ZERO)?;
                    }
                    _ => {
                        let seq = setup.seq();
                        setup
                            .dir
                            .lookup(&setup.caller, Some(seq), LAYOUT, keys, 1, Time::ZERO)?;
                    }
                }
            }
            ours_ns.push(start.elapsed().as_nanos() as f64 / probes as f64);
            if op == "lookup_pin" {
                // Release the pins, untimed.
                for chunk in probe_keys.chunks(batch) {
                    let seq = setup.seq();
                    let entries = chunk.iter().map(|k| UnpinEntry {
                        key: &k[..],
                        count: 1,
                    });
                    setup
                        .dir
                        .unpin(&setup.caller, seq, LAYOUT, entries, Time::ZERO)?;
                }
            }
            let start = Instant::now();
            let mut found = 0usize;
            for k in &probe_keys {
                found += usize::from(std::hint::black_box(naive.get(&k[..])).is_some());
            }
            naive_ns.push(start.elapsed().as_nanos() as f64 / probes as f64);
            ensure!(found == probes, "naive map lost keys");
        }
        let ours = median(&mut ours_ns);
        let base = median(&mut naive_ns);
        out.emit(
            &Record::new(
                SCENARIO,
                format!("op={op},batch={batch},keys={n}"),
                ours,
                base,
                "ns/key",
                Better::Lower,
            )
            .with("keys_per_s", 1e9 / ours)
            .with("reps", args.reps)
            .with("pool", "none")
            .with("dest", "heap"),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_distinct_and_full_length() {
        let mut seen = std::collections::HashSet::new();
        let mut k = [0u8; KEY_BYTES];
        for i in 0..10_000 {
            make_key(i, &mut k);
            assert!(seen.insert(k.to_vec()));
        }
    }

    /// The reading follows memory as it is touched: 64 MiB written grows it
    /// by about that much (the bench's figure is a difference of two
    /// readings). Other tests of the binary run on other threads and may
    /// allocate or free meanwhile, so both bounds are loose.
    #[test]
    fn resident_bytes_grows_with_the_memory_touched() {
        const TOUCHED: u64 = 64 << 20;
        let before = resident_bytes().unwrap();
        assert!(before > 1 << 20, "{before}");
        let mut block = vec![0u8; TOUCHED as usize];
        for b in block.iter_mut().step_by(4096) {
            *b = 1;
        }
        let after = resident_bytes().unwrap();
        std::hint::black_box(&block);
        let grown = after.saturating_sub(before);
        assert!(
            (TOUCHED * 3 / 4..TOUCHED + (64 << 20)).contains(&grown),
            "resident grew by {grown} bytes after touching {TOUCHED}"
        );
    }
}
