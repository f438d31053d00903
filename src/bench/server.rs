//! `cxlkv bench exists` and `cxlkv bench lookup`: key operations through the
//! real server on a Unix socket, against a raw socket exchange of the same
//! request and reply sizes measured in the same run.
//!
//! **Setup.** The server runs in a **forked child process** (as deployed:
//! its own scheduler accounting and allocator, not a thread of the bench),
//! started with [`Server::start`](crate::server::Server::start) on a private socket and pool
//! ([`ServerConfig::ephemeral`]), and killed after the scenario. It is forked
//! rather than exec'd as `cxlkv serve` so that the bench measures exactly the
//! server code and needs neither a configuration nor the binary's path. The
//! bench process registers `KEYS` 100-byte keys (4 KiB pages, 64 MiB
//! regions) through it once.
//!
//! **What is timed.** One call: `RpcClient::call` with a request encoded
//! beforehand (encoding is the client library's cost, not the server's),
//! until the reply frame is in hand. Each call asks for a different window of
//! `batch` registered keys (all hit), built before the first call: between
//! two calls the bench only encodes (and, for `lookup`, unpins), so that
//! ours, like the raw baseline's server, is still polling when the next
//! call arrives instead of having gone to sleep (`Windows`). `lookup` takes
//! one pin per key; the matching `Unpin` follows each call **outside** the
//! timed section, so every timed lookup starts from the same state (no pins
//! held) and pays for taking its pins — but not for releasing them, which a
//! reader that pins, reads and unpins also pays (the client sends its
//! queued unpins ahead of its next request: `cxlkv bench rtt`'s `op=get`
//! times that whole cycle for one key). Mutating requests say `replies_received_below = seq`, as a
//! client that has all its replies does, so the reply cache stays small.
//!
//! **Baseline.** A forked child that busy-polls a Unix socket and answers
//! every request of our request's wire size with our reply's wire size; the
//! bench busy-polls too. It is the transport floor: no framing, no decode, no
//! directory. `ratio` = raw p50 ÷ our p50 (higher is better, 1 would be the
//! floor). Reps alternate raw and ours; each rep's p50 is taken and the
//! median over reps is reported, with `p99_us` over all our calls.
//! `ratio_min`/`ratio_max` are the lowest and highest of the reps' own
//! ratios (each rep's raw p50 ÷ its p50): on a shared host the raw exchange
//! drifts between phases, and the spread shows how far one run's ratio can
//! be trusted (`cxlkv bench rtt` reports the same pair).
//! `ratio_paired_median` is the median of those per-rep ratios; `ratio`
//! itself is a ratio of medians (median raw p50 ÷ median p50), which can
//! differ from it when the host drifts between reps.
//!
//! `server_p50_us_le`/`server_p99_us_le` are the server's own time per call
//! (frame received → reply queued), from its statistics, and they are
//! **bounds, not measurements**: the server keeps a log-linear histogram
//! (8 buckets per power of two) and reports the upper edge of the bucket
//! the percentile falls in (capped at the largest value seen), so the true
//! percentile lies up to 12.5 % below. The statistics expose only these
//! percentiles and a count, not the buckets, so they cannot be restricted
//! to the timed calls: each case runs against a fresh server, and the
//! histogram holds every call of the operation it has answered before the
//! figures are read — the warm-up calls of every rep as well as the timed
//! ones (`server_histogram_calls`, against `server_timed_calls`). The rest
//! of a call is the transport and the client.
//! `keys_per_s` is `batch / p50`: what one caller gets at the typical call
//! time (a mean would mostly measure the other processes of a busy host).
//! `server_backend` is the transport the forked server runs on (`uring`
//! unless io_uring is unavailable or `CXLKV_IO=fallback`), since the two
//! measure differently on large requests.
//!
//! **Floor (`exists` only).** Each rep also times the same calls under a
//! layout nobody registered (`FLOOR_LAYOUT`): the request and reply have
//! the same wire sizes and go through the same transport, framing, checked
//! access and key checks, but the directory answers "absent" without
//! hashing or probing a key. `floor_p50_us` is that call's p50 (median over
//! reps) and `floor_ratio` = raw p50 ÷ floor p50: the best `ratio` the
//! framework around the key index allows on this host, so that a miss can
//! be split into transport and framing (`floor_p50_us − raw_p50_us`) and
//! the index's own work (`p50_us − floor_p50_us`).

use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::frame::{Frame, HEADER_BYTES, frame_len};
use cxlkv_controlplane::proto::{self, Kind, Layout, Message, RequestMeta};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient};

use super::forked_server::ForkedServer;
use super::pool_target::BenchPool;
use super::rtt::{Kind as Transport, paired_ratios, raw_latencies, with_paired};
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;
use crate::server::ServerConfig;

/// Keys registered for the scenario.
const KEYS: usize = 64 << 10;
const KEY_BYTES: usize = 100;
pub(super) const LAYOUT: Layout = Layout {
    page_size_bytes: 4096,
    fingerprint: 0xbe4c,
};
/// A layout with no keys: `exists` under it is the floor (module docs). Same
/// encoded size as `LAYOUT`.
const FLOOR_LAYOUT: Layout = Layout {
    page_size_bytes: 4096,
    fingerprint: 0xf100,
};
const REGION_BYTES: u64 = 64 << 20;
const BATCHES: [usize; 3] = [1, 64, 512];
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Which operation a scenario times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Exists,
    Lookup,
}

impl Op {
    fn scenario(self) -> &'static str {
        match self {
            Op::Exists => "exists",
            Op::Lookup => "lookup",
        }
    }
}

fn start_server(target: &BenchPool) -> anyhow::Result<ForkedServer> {
    let mut cfg = ServerConfig::ephemeral("bench");
    cfg.default_region_bytes = REGION_BYTES;
    cfg.pool_size_bytes = 512 << 20;
    // The session is idle while the raw baseline runs, which on a loaded
    // host can take longer than the default lease.
    cfg.directory.session_lease = Duration::from_secs(3600);
    ForkedServer::start(cfg, target)
}

/// The client side: a session, its sequence numbers, encoding scratch.
pub(super) struct Client {
    pub(super) rpc: RpcClient,
    next_seq: u64,
    buf: Vec<u8>,
}

/// An encoded request payload (8-aligned start not needed: the transport
/// copies it into a frame).
pub(super) fn payload<M: Message>(buf: &mut Vec<u8>, msg: &M) -> anyhow::Result<Vec<u8>> {
    buf.clear();
    proto::encode(0, msg, buf)?;
    let len = u32::from_le_bytes(buf[16..20].try_into()?) as usize;
    Ok(buf[HEADER_BYTES..HEADER_BYTES + len].to_vec())
}

impl Client {
    pub(super) fn connect(ep: &Endpoint, cfg: ClientConfig) -> anyhow::Result<Client> {
        let rpc = RpcClient::connect(ep, cfg)?;
        Ok(Client {
            rpc,
            next_seq: 1,
            buf: Vec::new(),
        })
    }

    pub(super) fn seq(&mut self) -> RequestMeta {
        let seq = self.next_seq;
        self.next_seq += 1;
        RequestMeta {
            seq,
            notice_ack: 0,
            replies_received_below: seq,
        }
    }

    /// Sends a request and checks that the reply is `R` (not an error).
    pub(super) fn call<M: Message, R: Message>(&mut self, msg: &M) -> anyhow::Result<R> {
        let p = payload(&mut self.buf, msg)?;
        let reply = self.rpc.call(M::KIND.as_u16(), &p, CALL_TIMEOUT)?;
        let frame = Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        match proto::access_reply::<R>(frame)? {
            Ok(r) => Ok(proto::deserialize::<R>(r)?),
            Err(e) => anyhow::bail!("{:?}: {} (code {})", M::KIND, e.message(), e.code()),
        }
    }
}

pub(super) fn key(i: usize) -> Vec<u8> {
    let mut k = format!("bench/layer-kv/chunk-{i:010}/").into_bytes();
    k.resize(KEY_BYTES, b'.');
    k
}

/// Hello, regions, and keys `0..keys` registered.
pub(super) fn populate(c: &mut Client, keys: usize) -> anyhow::Result<()> {
    let _: proto::Welcome = c.call(&proto::Hello {
        meta: RequestMeta::default(),
        protocol_min: proto::PROTOCOL_MIN,
        protocol_max: proto::PROTOCOL_MAX,
        instance_id: "bench".into(),
        client_name: "cxlkv bench".into(),
        client_secret: None,
    })?;
    // As the client library does after its welcome (the timed calls then
    // read replies with `recv`, as a real client's do).
    c.rpc.decline_fds();
    let pages_per_region = (REGION_BYTES / LAYOUT.page_size_bytes) as usize;
    let mut registered = 0;
    while registered < keys {
        let meta = c.seq();
        let granted: proto::RegionGranted = c.call(&proto::RequestRegion {
            meta,
            layout: LAYOUT,
            len_bytes: REGION_BYTES,
        })?;
        let in_region = pages_per_region.min(keys - registered);
        for first in (0..in_region).step_by(proto::MAX_BATCH) {
            let n = proto::MAX_BATCH.min(in_region - first);
            let entries = (first..first + n)
                .map(|page| proto::RegisterEntry {
                    key: key(registered + page),
                    location: proto::Location {
                        region: granted.desc.region,
                        page: page as u32,
                        generation: 1,
                        len_bytes: LAYOUT.page_size_bytes as u32,
                    },
                })
                .collect();
            let meta = c.seq();
            let reply: proto::RegisterReply = c.call(&proto::Register {
                meta,
                layout: LAYOUT,
                entries,
            })?;
            anyhow::ensure!(
                reply
                    .outcomes
                    .iter()
                    .all(|o| *o == proto::RegisterOutcome::Inserted),
                "registration refused"
            );
        }
        registered += in_region;
    }
    Ok(())
}

/// The keys of every call's window, built before any call is timed: call
/// `i` asks for keys `start..start + batch` with `start = i * batch mod
/// (KEYS - batch)`, which repeats after `(KEYS - batch) / gcd(batch, KEYS -
/// batch)` calls. Building a window's 512 keys takes ~150 µs, which between
/// two calls left the server idle past its spin window
/// (`IoConfig::spin_us`), so that most calls paid its wake-up, while the
/// raw baseline's server never sleeps (module docs; `docs/benchmarks.md`,
/// session 8).
struct Windows {
    keys: Vec<Vec<Vec<u8>>>,
}

impl Windows {
    fn new(batch: usize) -> Self {
        let span = KEYS - batch;
        let period = span / gcd(batch, span);
        let keys = (0..period)
            .map(|w| {
                let start = w * batch % span;
                (start..start + batch).map(key).collect()
            })
            .collect();
        Windows { keys }
    }

    /// Call `i`'s keys, lent until [`put_back`](Self::put_back).
    fn take(&mut self, i: usize) -> Vec<Vec<u8>> {
        let w = i % self.keys.len();
        std::mem::take(&mut self.keys[w])
    }

    fn put_back(&mut self, i: usize, keys: Vec<Vec<u8>>) {
        let w = i % self.keys.len();
        self.keys[w] = keys;
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Our calls under `layout`: returns the latency of each (µs) and the wire
/// sizes of the request and reply frames.
fn ours(
    c: &mut Client,
    windows: &mut Windows,
    op: Op,
    layout: Layout,
    batch: usize,
    calls: usize,
) -> anyhow::Result<(Vec<f64>, usize, usize)> {
    let mut lat = Vec::with_capacity(calls);
    let (mut req_wire, mut rep_wire) = (0, 0);
    let warmup = calls / 10;
    for i in 0..warmup + calls {
        let keys = windows.take(i);
        let (kind, p, keys) = match op {
            Op::Exists => {
                let msg = proto::Exists {
                    meta: RequestMeta::default(),
                    layout,
                    keys,
                };
                (Kind::Exists, payload(&mut c.buf, &msg)?, msg.keys)
            }
            Op::Lookup => {
                let msg = proto::Lookup {
                    meta: c.seq(),
                    layout,
                    keys,
                    pins: 1,
                };
                (Kind::Lookup, payload(&mut c.buf, &msg)?, msg.keys)
            }
        };
        let t = Instant::now();
        let reply = c.rpc.call(kind.as_u16(), &p, CALL_TIMEOUT)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        req_wire = frame_len(p.len());
        rep_wire = frame_len(reply.payload().len());
        let expected = if layout == LAYOUT { batch } else { 0 };
        check_reply(op, expected, &reply)?;
        let keys = if op == Op::Lookup {
            let unpin = proto::Unpin {
                meta: c.seq(),
                layout,
                counts: vec![1; keys.len()],
                keys,
            };
            let _: proto::UnpinReply = c.call(&unpin)?;
            unpin.keys
        } else {
            keys
        };
        windows.put_back(i, keys);
        if i >= warmup {
            lat.push(us);
        }
    }
    Ok((lat, req_wire, rep_wire))
}

/// Exactly `expected` keys were found (outside the timed section).
fn check_reply(
    op: Op,
    expected: usize,
    reply: &cxlkv_controlplane::transport::Reply,
) -> anyhow::Result<()> {
    let frame = Frame {
        header: reply.header,
        payload: reply.payload(),
    };
    let found = match op {
        Op::Exists => match proto::access_reply::<proto::ExistsReply>(frame)? {
            Ok(r) => r.present.iter().filter(|&p| p).count(),
            Err(e) => anyhow::bail!("exists: {}", e.message()),
        },
        Op::Lookup => match proto::access_reply::<proto::LookupReply>(frame)? {
            Ok(r) => r.locations().filter(Option::is_some).count(),
            Err(e) => anyhow::bail!("lookup: {}", e.message()),
        },
    };
    anyhow::ensure!(found == expected, "{found} keys found, {expected} expected");
    Ok(())
}

fn calls_for(batch: usize, quick: bool) -> usize {
    let full = match batch {
        1 => 20_000,
        64 => 5_000,
        _ => 2_000,
    };
    if quick { full / 10 } else { full }
}

/// The server's statistics for `kind` (frame received → reply queued):
/// p50 and p99 as bucket upper bounds in µs, and how many calls the
/// histogram holds (module docs).
struct ServerLatency {
    p50_us_le: f64,
    p99_us_le: f64,
    calls: u64,
}

fn server_latency(c: &mut Client, kind: Kind) -> anyhow::Result<ServerLatency> {
    let stats: proto::StatsReply = c.call(&proto::Stats {
        meta: RequestMeta::default(),
        sections: 0,
        max_rows: 0,
    })?;
    let op = stats
        .ops
        .iter()
        .find(|o| o.kind == kind.as_u16())
        .context("no statistics for the operation")?;
    Ok(ServerLatency {
        p50_us_le: op.latency.p50_ns as f64 / 1e3,
        p99_us_le: op.latency.p99_ns as f64 / 1e3,
        calls: op.latency.count,
    })
}

fn run_op(args: &BenchArgs, r: &mut Reporter, op: Op) -> anyhow::Result<()> {
    let target = BenchPool::from_args(args)?;
    for batch in BATCHES {
        // A fresh server per case, so that its latency statistics are this
        // case's.
        let server = start_server(&target)?;
        let server_backend = server.backend().to_owned();
        let mut c = Client::connect(
            &Endpoint::Unix(server.socket().to_owned()),
            ClientConfig::default(),
        )?;
        populate(&mut c, KEYS)?;
        let mut windows = Windows::new(batch);
        let calls = calls_for(batch, args.quick);
        let (mut ours_p50, mut raw_p50, mut all_ours) = (Vec::new(), Vec::new(), Vec::new());
        let (mut req_wire, mut rep_wire) = (0, 0);
        for _ in 0..args.reps {
            let (mut lat, q, p) = ours(&mut c, &mut windows, op, LAYOUT, batch, calls)?;
            (req_wire, rep_wire) = (q, p);
            ours_p50.push(percentile(&mut lat, 50.0));
            all_ours.extend(lat);
            let mut raw_lat = raw_latencies(Transport::Unix, (req_wire, rep_wire), calls, None)?;
            raw_p50.push(percentile(&mut raw_lat, 50.0));
        }
        let kind = match op {
            Op::Exists => Kind::Exists,
            Op::Lookup => Kind::Lookup,
        };
        // Read before the floor runs, whose calls the server counts too.
        let server_latency = server_latency(&mut c, kind)?;
        let floor = match op {
            Op::Exists => Some(floor(
                &mut c,
                &mut windows,
                batch,
                calls,
                args.reps,
                (req_wire, rep_wire),
            )?),
            Op::Lookup => None,
        };
        drop(c);
        drop(server);
        // Each rep's own ratio (its raw exchange against its calls), before
        // the medians reorder the p50s.
        let ratios = paired_ratios(&raw_p50, &ours_p50, false);
        let (p50, base) = (median(&mut ours_p50), median(&mut raw_p50));
        let keys_per_s = batch as f64 / (p50 * 1e-6);
        let rec = Record::new(
            op.scenario(),
            format!("batch={batch}"),
            p50,
            base,
            "us",
            Better::Lower,
        )
        .with("batch", batch as u64)
        .with("keys_per_s", keys_per_s)
        .with("p50_us", p50)
        .with("p99_us", percentile(&mut all_ours, 99.0))
        .with("raw_p50_us", base)
        .with("server_p50_us_le", server_latency.p50_us_le)
        .with("server_p99_us_le", server_latency.p99_us_le)
        .with("server_histogram_calls", server_latency.calls)
        .with("server_timed_calls", (calls * args.reps) as u64)
        .with(
            "server_latency_is",
            "bucket upper bounds (8 buckets per power of two) over every call since the server started, warm-up included",
        )
        .with("key_bytes", KEY_BYTES as u64)
        .with("pins", u64::from(op == Op::Lookup))
        .with("server", "forked process")
        .with("server_backend", server_backend.as_str())
        .with("calls_per_rep", calls as u64)
        .with("reps", args.reps as u64)
        .with("request_wire_bytes", req_wire as u64)
        .with("reply_wire_bytes", rep_wire as u64);
        let rec = target.tag(with_paired(rec, ratios));
        let rec = match floor {
            Some((floor_p50, floor_raw_p50)) => rec
                .with("floor_p50_us", floor_p50)
                .with("floor_raw_p50_us", floor_raw_p50)
                .with("floor_ratio", floor_raw_p50 / floor_p50),
            None => rec,
        };
        r.emit(&rec)?;
    }
    Ok(())
}

/// The floor of an `exists` case (module docs): `Exists` under
/// `FLOOR_LAYOUT`, each rep alternating with a raw exchange of the same
/// sizes. Returns the medians over reps of the floor's p50 and the raw p50.
fn floor(
    c: &mut Client,
    windows: &mut Windows,
    batch: usize,
    calls: usize,
    reps: usize,
    wire: (usize, usize),
) -> anyhow::Result<(f64, f64)> {
    let (mut floor_p50, mut raw_p50) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (mut lat, q, p) = ours(c, windows, Op::Exists, FLOOR_LAYOUT, batch, calls)?;
        anyhow::ensure!(
            (q, p) == wire,
            "the floor's frames ({q}, {p} bytes) differ from the case's ({}, {} bytes)",
            wire.0,
            wire.1
        );
        floor_p50.push(percentile(&mut lat, 50.0));
        let mut raw_lat = raw_latencies(Transport::Unix, wire, calls, None)?;
        raw_p50.push(percentile(&mut raw_lat, 50.0));
    }
    Ok((median(&mut floor_p50), median(&mut raw_p50)))
}

/// `cxlkv bench exists` (registered in `cli::SCENARIOS`).
pub fn run_exists(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    run_op(args, r, Op::Exists)
}

/// `cxlkv bench lookup` (registered in `cli::SCENARIOS`).
pub fn run_lookup(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    run_op(args, r, Op::Lookup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_call_gets_its_own_window_of_keys_and_lending_them_loses_none() {
        for batch in BATCHES {
            let span = KEYS - batch;
            let mut windows = Windows::new(batch);
            // Two full periods and a bit: every call's keys are the range
            // the call number names, whichever window serves it.
            for i in 0..2 * windows.keys.len() + 3 {
                let keys = windows.take(i);
                let start = i * batch % span;
                assert_eq!(keys.len(), batch, "batch {batch}, call {i}");
                assert_eq!(keys[0], key(start), "batch {batch}, call {i}");
                assert_eq!(
                    keys[batch - 1],
                    key(start + batch - 1),
                    "batch {batch}, call {i}"
                );
                windows.put_back(i, keys);
            }
        }
    }
}
