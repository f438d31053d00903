//! `cxlkv bench rtt`, case `op=get,transport=unix,backend=default`: one
//! key's `get` through the client — lookup with a pin, a view in place, the
//! guard dropped — against the raw busy-polling socket ping-pong of the
//! other rtt cases, measured in the same run.
//!
//! **What one timed get exchanges.** The guard dropped by the previous get
//! queued its unpin, and the client sends queued unpins ahead of its next
//! request: so a get in a loop writes an `Unpin` frame (one key, one count)
//! and then a `Lookup` frame (one key, one pin), and reads both replies.
//! `requests_per_get` is what the client's own counter saw during the timed
//! gets (2 when every get carried the previous one's unpin; the maintenance
//! thread may send one itself after `unpin_delay_us`). The baseline
//! exchanges the same messages the same way: the `Unpin` frame's bytes and
//! then the `Lookup` frame's, each with a `send` of its own, answered by the
//! raw peer each as it completes, then both replies read
//! (`request_wire_bytes` = the two requests, `reply_wire_bytes` = the two
//! replies; each size measured before the first rep by sending the same
//! messages — same layout, same key, the same server — on a session of the
//! bench's own: `lookup_*_wire_bytes`, `unpin_*_wire_bytes`). (Until session
//! 23 the baseline sent the summed bytes in one ping-pong, one request and
//! one reply fewer than ours: a faster baseline than the same work.)
//!
//! `ratio`, `ratio_paired_median`, `ratio_min`/`ratio_max`,
//! `server_backend` and `client_backend` are as in the other rtt cases
//! (`client_backend` is what the client's transport configuration resolves
//! to here, read from the measuring session, which uses the same one).
//!
//! The directory server runs in a forked child. The raw echo peer is forked
//! for each repetition too, so this process must be single-threaded then:
//! each repetition's client is connected after the raw measurement and
//! closed (its maintenance thread joined) before the next one.

use std::time::Instant;

use anyhow::Context;
use cxlkv_controlplane::frame::{Frame, frame_len};
use cxlkv_controlplane::proto::{self, Kind as MsgKind, Layout, Message};
use cxlkv_controlplane::transport::Endpoint;

use super::forked_server::{ForkedServer, bench_config};
use super::pool_target::BenchPool;
use super::rtt::{Kind, paired_ratios, raw_exchanges, with_paired};
use super::server::{Client as SessionClient, payload, populate};
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig};

const SCENARIO: &str = "rtt";
const CASE: &str = "op=get,transport=unix,backend=default";
const PAGE_BYTES: u64 = 64 << 10;
const FINGERPRINT: u64 = 1;
const VALUE_BYTES: usize = 4096;
const KEY: &[u8] = b"rtt-get-key-0000000000000000";
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Wire sizes (frame header included) of what one get exchanges.
struct Wire {
    lookup_request: usize,
    lookup_reply: usize,
    unpin_request: usize,
    unpin_reply: usize,
    client_backend: String,
}

/// Runs the case (called from `rtt::run`).
pub(super) fn run(args: &BenchArgs, r: &mut Reporter, target: &BenchPool) -> anyhow::Result<()> {
    let n = if args.quick { 2_000 } else { 20_000 };
    let server = ForkedServer::start(bench_config("bench-rtt-get", 512 << 20), target)?;
    let wire = measure_wire(&server)?;
    let request_wire = wire.unpin_request + wire.lookup_request;
    let reply_wire = wire.unpin_reply + wire.lookup_reply;
    let (mut ours_p50, mut raw_p50, mut all_ours) = (Vec::new(), Vec::new(), Vec::new());
    let (mut requests, mut gets) = (0u64, 0u64);
    for _ in 0..args.reps {
        // Two messages, each sent on its own, as our client sends the
        // queued unpin and then the lookup.
        let msgs = [
            (wire.unpin_request, wire.unpin_reply),
            (wire.lookup_request, wire.lookup_reply),
        ];
        let mut raw = raw_exchanges(Kind::Unix, &msgs, n, None)?;
        raw_p50.push(percentile(&mut raw, 50.0));
        let (mut ours, sent) = our_latencies(&server, n)?;
        requests += sent;
        gets += ours.len() as u64;
        ours_p50.push(percentile(&mut ours, 50.0));
        all_ours.extend(ours);
    }
    let ratios = paired_ratios(&raw_p50, &ours_p50, false);
    let (ours, base) = (median(&mut ours_p50), median(&mut raw_p50));
    let rec = Record::new(SCENARIO, CASE, ours, base, "us", Better::Lower)
        .with("p50_us", ours)
        .with("p99_us", percentile(&mut all_ours, 99.0))
        .with("raw_p50_us", base)
        .with("handler", "directory")
        .with("server", "forked process")
        .with("server_backend", server.backend())
        .with("client_backend", wire.client_backend.as_str())
        .with("request_wire_bytes", request_wire as u64)
        .with("reply_wire_bytes", reply_wire as u64)
        .with("lookup_request_wire_bytes", wire.lookup_request as u64)
        .with("lookup_reply_wire_bytes", wire.lookup_reply as u64)
        .with("unpin_request_wire_bytes", wire.unpin_request as u64)
        .with("unpin_reply_wire_bytes", wire.unpin_reply as u64)
        .with(
            "requests_per_get",
            if gets > 0 {
                requests as f64 / gets as f64
            } else {
                0.0
            },
        )
        .with("gets_per_rep", n as u64)
        .with("reps", args.reps as u64)
        .with(
            "measures",
            "client get: the previous get's Unpin and this get's Lookup(pins=1) sent, both replies read, view + guard drop; baseline: the same two requests and replies as raw frames, each request with its own send and answered as it completes",
        );
    r.emit(&target.tag(with_paired(rec, ratios)))?;
    Ok(())
}

/// Sends what a get sends — a pinning `Lookup` of the key, then the
/// `Unpin` of that pin — on a session of the bench's own, and measures the
/// four frames. The key is put (and deleted after) by a client as the
/// timed gets do.
fn measure_wire(server: &ForkedServer) -> anyhow::Result<Wire> {
    let cfg = ClientConfig::unix(server.socket());
    let transport = cfg.transport.clone();
    let client = Client::connect(cfg)?;
    let layout = client.layout(PAGE_BYTES, FINGERPRINT)?;
    layout.put(KEY, &[7u8; VALUE_BYTES])?;
    let wire = (|| {
        let mut s = SessionClient::connect(&Endpoint::Unix(server.socket().to_owned()), transport)?;
        populate(&mut s, 0)?;
        let layout = Layout {
            page_size_bytes: PAGE_BYTES,
            fingerprint: FINGERPRINT,
        };
        let mut buf = Vec::new();
        let lookup = payload(
            &mut buf,
            &proto::Lookup {
                meta: s.seq(),
                layout,
                keys: vec![KEY.to_vec()],
                pins: 1,
            },
        )?;
        let reply = s
            .rpc
            .call(proto::Lookup::KIND.as_u16(), &lookup, CALL_TIMEOUT)?;
        let frame = Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        match proto::access_reply::<proto::LookupReply>(frame)? {
            Ok(found) => anyhow::ensure!(
                found.locations().filter(Option::is_some).count() == 1,
                "the put key was not found"
            ),
            Err(e) => anyhow::bail!("lookup: {}", e.message()),
        }
        let lookup_reply = frame_len(reply.payload().len());
        let unpin = payload(
            &mut buf,
            &proto::Unpin {
                meta: s.seq(),
                layout,
                keys: vec![KEY.to_vec()],
                counts: vec![1],
            },
        )?;
        let reply = s.rpc.call(MsgKind::Unpin.as_u16(), &unpin, CALL_TIMEOUT)?;
        Ok::<_, anyhow::Error>(Wire {
            lookup_request: frame_len(lookup.len()),
            lookup_reply,
            unpin_request: frame_len(unpin.len()),
            unpin_reply: frame_len(reply.payload().len()),
            client_backend: s.rpc.backend().to_string(),
        })
    })()
    .context("measuring a get's frames")?;
    layout.delete(KEY)?;
    drop(layout);
    client.close()?;
    Ok(wire)
}

/// `n` timed gets (after `n / 10` untimed): their latencies (µs) and the
/// requests the client sent during them.
fn our_latencies(server: &ForkedServer, n: usize) -> anyhow::Result<(Vec<f64>, u64)> {
    let client = Client::connect(ClientConfig::unix(server.socket()))?;
    let layout = client.layout(PAGE_BYTES, FINGERPRINT)?;
    layout.put(KEY, &[7u8; VALUE_BYTES])?;
    let mut out = Vec::with_capacity(n);
    let mut sent_before = 0;
    for i in 0..n + n / 10 {
        if i == n / 10 {
            sent_before = client.stats().requests;
        }
        let t = Instant::now();
        let g = layout.get(KEY)?;
        anyhow::ensure!(
            g.as_ref().is_some_and(|g| g.len() == VALUE_BYTES),
            "key lost"
        );
        drop(g);
        if i >= n / 10 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let sent = client.stats().requests - sent_before;
    layout.delete(KEY)?;
    drop(layout);
    client.close()?;
    Ok((out, sent))
}
