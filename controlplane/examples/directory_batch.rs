//! The directory's batch operations in one process, no transport: per-call
//! latency of `exists`, `lookup` (no pin), `lookup` with one pin, and the
//! `unpin` that follows it, over windows of consecutive registered keys.
//!
//! For A/B comparisons of the index and the registry that the end-to-end
//! benches (`cxlkv bench exists|lookup`) cannot resolve on a noisy host:
//! build both versions, run them alternately, compare the percentiles. Also
//! a steady target for `perf record`.
//!
//! ```sh
//! cargo run --release -p cxlkv-controlplane --example directory_batch -- \
//!     [--keys 65536] [--batch 512] [--calls 4000] [--op all|exists|lookup|lookup_pin|stats] \
//!     [--pollute BYTES] [--fresh 0|1] [--random 0|1]
//! ```
//!
//! Keys are 100 bytes, registered in regions of 64 MiB with 4 KiB pages;
//! call `i` takes the `batch` keys from `(i × batch) mod (keys − batch)` on.
//! `--pollute` writes that many bytes of other memory before each call (a
//! stand-in for the server's receive buffers and replies). Prints p10, p50
//! and p90 in µs per operation. `--fresh 1` copies the window's keys into
//! one buffer before each call, as the server's receive puts a request's
//! keys side by side in recently written memory (without it they are
//! separate allocations, last read one window of calls ago). `--random 1`
//! draws each call's keys at random from all registered keys instead of a
//! window of consecutive ones (requests in another order than
//! registrations; a key may be drawn twice in one call, and then takes and
//! drops two pins); it implies `--fresh 1`. With `--op all` the operations
//! take turns on the same window, so the later ones find its keys in cache:
//! compare one `--op` at a time. `--op stats` pins every key once and
//! times the statistics snapshot (`Directory::stats`) with none and with
//! all of those pins long-held.

use std::time::Instant;

use cxlkv_controlplane::directory::{
    Caller, Directory, DirectoryConfig, Effect, Hello, Layout, Location, Peer, RegionHandle,
    RegionToken, RegisterEntry, Sequence, Time, UnpinEntry,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};

const LAYOUT: Layout = Layout {
    page_size_bytes: 4096,
    fingerprint: 7,
};
const REGION_BYTES: u64 = 64 << 20;
const KEY_BYTES: usize = 100;
const OPS: [&str; 3] = ["exists", "lookup", "lookup_pin"];

struct Args {
    keys: usize,
    batch: usize,
    calls: usize,
    op: String,
    pollute: usize,
    fresh: bool,
    random: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        keys: 64 << 10,
        batch: 512,
        calls: 4000,
        op: "all".into(),
        pollute: 0,
        fresh: false,
        random: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--keys" => a.keys = number()?,
            "--batch" => a.batch = number()?,
            "--calls" => a.calls = number()?,
            "--pollute" => a.pollute = number()?,
            "--op" => a.op = value.clone(),
            "--fresh" => a.fresh = number()? != 0,
            "--random" => a.random = number()? != 0,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    a.fresh |= a.random;
    if a.batch == 0 || a.batch >= a.keys || a.calls == 0 {
        return Err("need 0 < batch < keys and calls > 0".into());
    }
    if a.op != "all" && a.op != "stats" && !OPS.contains(&a.op.as_str()) {
        return Err(format!("--op: one of all, stats, {}", OPS.join(", ")));
    }
    Ok(a)
}

fn key(i: usize) -> Vec<u8> {
    let mut k = format!("bench-key-{i:010}-").into_bytes();
    k.resize(KEY_BYTES, b'x');
    k
}

/// A directory with one session and keys registered by it.
struct Populated {
    dir: Directory,
    caller: Caller,
    /// The session's last sequence number.
    seq: u64,
    keys: Vec<Vec<u8>>,
}

/// A directory with one session and `n` keys registered.
fn populate(n: usize) -> Result<Populated, Box<dyn std::error::Error>> {
    let mut dir = Directory::new(DirectoryConfig::default(), [0x42; 32])?;
    let welcome = dir.hello(
        Hello {
            instance: "batch",
            quota_bytes: None,
        },
        Peer::Unix {
            pid: std::process::id(),
            uid: 0,
            gid: 0,
        },
        Time::ZERO,
    )?;
    let caller = Caller {
        session: welcome.session,
        notice_ack: 0,
    };
    let mut seq = 0;
    let mut next = || {
        seq += 1;
        Sequence {
            seq,
            replies_received_below: seq,
        }
    };
    let pages_per_region = (REGION_BYTES / LAYOUT.page_size_bytes) as usize;
    let mut regions = Vec::new();
    while regions.len() < n.div_ceil(pages_per_region) {
        dir.request_region(&caller, next(), LAYOUT, REGION_BYTES, Time::ZERO)?;
        let effects: Vec<Effect> = dir.drain_effects().collect();
        for effect in effects {
            if let Effect::AllocateRegion {
                request, len_bytes, ..
            } = effect
            {
                let id = RegionId(regions.len() as u64 + 1);
                let handle = RegionHandle {
                    region: id,
                    pool: PoolId(0),
                    offset_bytes: id.0 * REGION_BYTES,
                    len_bytes,
                    token: RegionToken([id.0 as u8; 32]),
                };
                for done in dir.region_allocated(request, Ok(handle)) {
                    done.result?;
                }
                regions.push(id);
            }
        }
    }
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    for start in (0..n).step_by(4096) {
        let entries = (start..(start + 4096).min(n)).map(|i| RegisterEntry {
            key: &keys[i][..],
            location: Location {
                region: regions[i / pages_per_region],
                page: PageIndex((i % pages_per_region) as u32),
                generation: Generation(1),
                len_bytes: 4096,
            },
        });
        dir.register(&caller, next(), LAYOUT, entries, Time::ZERO)?;
    }
    Ok(Populated {
        dir,
        caller,
        seq,
        keys,
    })
}

fn percentiles(name: &str, v: &mut [f64]) {
    v.sort_by(f64::total_cmp);
    let at = |q: usize| v[(v.len() * q / 100).min(v.len() - 1)];
    println!(
        "{name:<10} p10 {:>8.2} µs   p50 {:>8.2} µs   p90 {:>8.2} µs",
        at(10),
        at(50),
        at(90)
    );
}

/// `--op stats`: every key pinned once by the session (`batch` keys per
/// lookup), then `calls` statistics snapshots (at most 100) while no pin is
/// long-held, and as many once every pin is (the clock moved past
/// `long_held_pin`): what a `Stats` request costs the server's loop.
fn stats_with_every_key_pinned(
    dir: &mut Directory,
    caller: &Caller,
    next: &mut impl FnMut() -> Sequence,
    keys: &[Vec<u8>],
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    for window in keys.chunks(args.batch) {
        let window = window.iter().map(|k| &k[..]);
        dir.lookup(caller, Some(next()), LAYOUT, window, 1, Time::ZERO)?;
    }
    let late = Time::ZERO.saturating_add(DirectoryConfig::default().long_held_pin * 2);
    println!(
        "{} keys of {KEY_BYTES} bytes, each pinned once by one session",
        keys.len()
    );
    for (label, now) in [("stats young", Time::ZERO), ("stats long", late)] {
        let mut t = Vec::new();
        for _ in 0..args.calls.min(100) {
            let began = Instant::now();
            let stats = std::hint::black_box(dir.stats(now));
            t.push(began.elapsed().as_secs_f64() * 1e6);
            let expected = if now == late { keys.len() as u64 } else { 0 };
            assert_eq!(stats.long_held_pins.count, expected);
        }
        percentiles(label, &mut t);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args().map_err(|e| format!("directory_batch: {e}"))?;
    let Populated {
        mut dir,
        caller,
        mut seq,
        keys,
    } = populate(args.keys)?;
    let mut next = || {
        seq += 1;
        Sequence {
            seq,
            replies_received_below: seq,
        }
    };
    if args.op == "stats" {
        return stats_with_every_key_pinned(&mut dir, &caller, &mut next, &keys, &args);
    }
    let mut junk = vec![0u8; args.pollute];
    let mut times: Vec<(&str, Vec<f64>)> = OPS
        .iter()
        .filter(|op| args.op == "all" || args.op == **op)
        .map(|op| (*op, Vec::with_capacity(args.calls)))
        .collect();
    let mut unpin_times = Vec::with_capacity(args.calls);
    let mut request = Vec::with_capacity(args.batch * KEY_BYTES);
    let mut draw = 0x9E37_79B9_7F4A_7C15u64;
    let span = args.keys - args.batch;
    for call in 0..args.calls {
        let start = (call * args.batch) % span;
        let window: Vec<&Vec<u8>> = if args.random {
            (0..args.batch)
                .map(|_| {
                    // xorshift64: any fixed sequence of keys will do.
                    draw ^= draw << 13;
                    draw ^= draw >> 7;
                    draw ^= draw << 17;
                    &keys[(draw % args.keys as u64) as usize]
                })
                .collect()
        } else {
            keys[start..start + args.batch].iter().collect()
        };
        for (op, t) in &mut times {
            junk.iter_mut().for_each(|b| *b = b.wrapping_add(1));
            std::hint::black_box(&junk);
            if args.fresh {
                request.clear();
                window.iter().for_each(|k| request.extend_from_slice(k));
            }
            let window_keys: Vec<&[u8]> = if args.fresh {
                request.chunks(KEY_BYTES).collect()
            } else {
                window.iter().map(|k| &k[..]).collect()
            };
            let window_keys = window_keys.iter().copied();
            let began = Instant::now();
            match *op {
                "exists" => {
                    std::hint::black_box(dir.exists(&caller, LAYOUT, window_keys, Time::ZERO)?);
                }
                "lookup" => {
                    std::hint::black_box(dir.lookup(
                        &caller,
                        None,
                        LAYOUT,
                        window_keys,
                        0,
                        Time::ZERO,
                    )?);
                }
                _ => {
                    std::hint::black_box(dir.lookup(
                        &caller,
                        Some(next()),
                        LAYOUT,
                        window_keys,
                        1,
                        Time::ZERO,
                    )?);
                }
            }
            t.push(began.elapsed().as_secs_f64() * 1e6);
            if *op == "lookup_pin" {
                let entries = window.iter().map(|k| UnpinEntry {
                    key: &k[..],
                    count: 1,
                });
                let began = Instant::now();
                std::hint::black_box(dir.unpin(&caller, next(), LAYOUT, entries, Time::ZERO)?);
                unpin_times.push(began.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    println!(
        "{} keys of {KEY_BYTES} bytes, {} calls of {} keys, {} bytes of other writes per call, \
         keys {}",
        args.keys,
        args.calls,
        args.batch,
        args.pollute,
        if args.fresh {
            "copied into one buffer"
        } else {
            "in their own allocations"
        }
    );
    for (op, t) in &mut times {
        percentiles(op, t);
    }
    if !unpin_times.is_empty() {
        percentiles("unpin", &mut unpin_times);
    }
    Ok(())
}
