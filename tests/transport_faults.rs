//! The whole stack (client library → transport → directory) against a
//! server whose transport drops, delays, duplicates and reorders replies,
//! resets connections, or faces a client that stops reading (feature
//! `fault-injection`). For every fault kind: every call returns within its
//! deadline (measured: the slowest call against the client's configured
//! bound; no call may hang), the workload's results are exact, and once the
//! clients are gone the server is back to its baseline — no session, pin,
//! key, instance or region left behind (`state_of` equal to the state before
//! the clients came).
//!
//! Related: `client_faults.rs` runs one client through a mix of the same
//! faults and checks the client's side (pages, notices, re-pinning after a
//! reconnect); `server_faults.rs` checks the directory's exactly-once
//! answers to retried requests; `controlplane/tests/transport_faults.rs`
//! and `transport_robustness.rs` test each fault mode and the slow-reader
//! bound on the bare transport.

#![cfg(feature = "fault-injection")]

mod client_support;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use client_support::*;
use cxlkv::client::{Client, ClientConfig, DeleteOutcome, RegisterOutcome};
use cxlkv::server::{Server, ServerHandle};
use cxlkv_controlplane::proto::{self, Kind};
use cxlkv_controlplane::transport::fault::{
    FaultPlan, FaultScript, ReplyFault, ReplyInfo, ReplyMatch, RequestFault, RequestInfo,
};

/// Per-attempt deadline of the clients under test.
const REQUEST_TIMEOUT_MS: u64 = 200;
const MAX_RETRIES: u32 = 8;
const RECONNECT_TIMEOUT_MS: u64 = 3_000;
/// How long the server may take to get back to its baseline after the
/// clients left (instance grace 300 ms, ticks of 20 ms; generous for a
/// loaded machine).
const SETTLE: Duration = Duration::from_secs(20);

fn faulty_client_config(server: &ServerHandle) -> ClientConfig {
    let mut c = client_config(server);
    c.request_timeout_ms = REQUEST_TIMEOUT_MS;
    c.max_retries = MAX_RETRIES;
    c.reconnect_timeout_ms = RECONNECT_TIMEOUT_MS;
    c
}

/// The longest one call may take by the client's configuration: every
/// attempt runs to its deadline and each one first waits out a full
/// reconnect. A call slower than this hangs.
fn call_bound() -> Duration {
    Duration::from_millis(
        (u64::from(MAX_RETRIES) + 1) * (REQUEST_TIMEOUT_MS + RECONNECT_TIMEOUT_MS),
    )
}

/// The directory's state without counters (see `common::state_of`).
fn state(server: &ServerHandle) -> String {
    let s = server.directory_stats().unwrap();
    format!(
        "keys={} pins={} sessions={} instances={} regions={} region_bytes={} orphaned={} pending={} per_pool={:?}",
        s.keys,
        s.pins,
        s.sessions,
        s.instances,
        s.regions,
        s.region_bytes,
        s.orphaned_regions,
        s.pending_region_requests,
        s.per_pool
            .iter()
            .map(|p| (p.pool, p.regions, p.region_bytes, p.keys, p.used_bytes))
            .collect::<Vec<_>>()
    )
}

#[track_caller]
fn back_to(server: &ServerHandle, baseline: &str, what: &str) {
    let mut last = String::new();
    let settled = wait_until(SETTLE, || {
        last = state(server);
        last == baseline
    });
    assert!(
        settled,
        "{what}: the server did not return to its baseline\n  baseline {baseline}\n  now      {last}"
    );
}

/// Applies `fault` to one in `every` replies to a key operation, or (for
/// `RequestFault::Reset`) resets the connection at one in `every` key
/// operation requests — chosen by a seeded pseudo-random sequence, not
/// strictly every `every`-th: a retried call sends the same few requests per
/// attempt, and a strict period can line up with them so that the same call
/// is hit on every attempt (seen on a loaded machine: a delete reset nine
/// times in a row). With independent one-in-`every` draws a call fails all
/// its attempts with probability `every^-(MAX_RETRIES + 1)`.
struct EveryNth {
    every: u64,
    reply: Option<ReplyFault>,
    /// xorshift64 state (non-zero).
    rng: u64,
    fired: Arc<AtomicU64>,
}

impl EveryNth {
    fn new(every: u64, reply: Option<ReplyFault>, fired: Arc<AtomicU64>) -> Self {
        Self {
            every,
            reply,
            rng: 0x9E37_79B9_7F4A_7C15,
            fired,
        }
    }

    /// One draw: true with probability 1/`every`.
    fn hit(&mut self) -> bool {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x.is_multiple_of(self.every)
    }
}

fn is_key_op(kind: Option<u16>) -> bool {
    [
        Kind::Register,
        Kind::Lookup,
        Kind::Exists,
        Kind::Unpin,
        Kind::Delete,
    ]
    .iter()
    .any(|k| kind == Some(k.as_u16()))
}

impl FaultPlan for EveryNth {
    fn on_request(&mut self, req: &RequestInfo) -> RequestFault {
        if self.reply.is_some() || !is_key_op(Some(req.header.kind)) {
            return RequestFault::Deliver;
        }
        if self.hit() {
            // Relaxed: a tally read after the workload joined.
            self.fired.fetch_add(1, Ordering::Relaxed);
            return RequestFault::Reset;
        }
        RequestFault::Deliver
    }

    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        let Some(fault) = self.reply else {
            return ReplyFault::Deliver;
        };
        if !is_key_op(reply.request_kind) {
            return ReplyFault::Deliver;
        }
        if self.hit() {
            // Relaxed: as above.
            self.fired.fetch_add(1, Ordering::Relaxed);
            return fault;
        }
        ReplyFault::Deliver
    }
}

/// Slowest call seen by a workload.
#[derive(Debug, Default, Clone, Copy)]
struct Latency {
    calls: u64,
    max: Duration,
}

impl Latency {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let r = f();
        self.calls += 1;
        self.max = self.max.max(start.elapsed());
        r
    }
}

/// One client's workload: put, get (bytes checked), exists, delete, with
/// a read guard held across the next round so that pins live through the
/// faults. Returns its latency record.
fn workload(server: &ServerHandle, worker: u64, rounds: u64) -> Latency {
    let client = Client::connect(faulty_client_config(server)).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let mut lat = Latency::default();
    let mut held = None;
    for round in 0..rounds {
        let i = worker * 1_000_000 + round;
        let (k, v) = (key(i), chunk(i, 1000));
        assert_eq!(
            lat.time(|| layout.put(&k, &v)).unwrap(),
            RegisterOutcome::Inserted
        );
        let guard = lat.time(|| layout.get(&k)).unwrap().expect("just put");
        assert_eq!(&guard[..], &v[..]);
        assert!(lat.time(|| layout.exists(&k)).unwrap());
        // The previous round's key: its guard is dropped only now.
        if let Some((pk, g)) = held.replace((k, guard)) {
            drop(g);
            assert_eq!(
                lat.time(|| layout.delete(&pk)).unwrap(),
                DeleteOutcome::Deleted
            );
        }
    }
    if let Some((pk, g)) = held.take() {
        drop(g);
        assert_eq!(
            lat.time(|| layout.delete(&pk)).unwrap(),
            DeleteOutcome::Deleted
        );
    }
    lat.time(|| client.flush_unpins()).unwrap();
    assert_eq!(client.owned_keys(), 0);
    assert_eq!(client.unresolved_registrations(), 0);
    assert_eq!(layout.refused_frees(), 0, "no page freed twice");
    drop(layout);
    client.close().unwrap();
    lat
}

#[test]
fn every_fault_kind_leaves_nothing_behind_and_no_call_outlives_its_deadline() {
    let cases: [(&str, Option<ReplyFault>); 6] = [
        ("drop", Some(ReplyFault::Drop)),
        ("delay", Some(ReplyFault::Delay(Duration::from_millis(350)))),
        ("duplicate", Some(ReplyFault::Duplicate)),
        ("reorder", Some(ReplyFault::Reorder)),
        ("reset-on-reply", Some(ReplyFault::Reset)),
        ("reset-on-request", None),
    ];
    for (name, fault) in cases {
        let fired = Arc::new(AtomicU64::new(0));
        let plan = EveryNth::new(7, fault, Arc::clone(&fired));
        let server = Server::start_with_faults(server_config(name), Box::new(plan)).unwrap();
        let baseline = state(&server);
        let lat: Vec<Latency> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|w| {
                    let server = &server;
                    s.spawn(move || workload(server, w, 25))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let max = lat.iter().map(|l| l.max).max().unwrap();
        let calls: u64 = lat.iter().map(|l| l.calls).sum();
        eprintln!(
            "{name}: {} faults over {calls} calls; slowest call {} ms (per-attempt deadline {REQUEST_TIMEOUT_MS} ms, bound {} ms)",
            fired.load(Ordering::Relaxed),
            max.as_millis(),
            call_bound().as_millis()
        );
        assert!(
            fired.load(Ordering::Relaxed) >= 5,
            "{name}: the faults fired"
        );
        assert!(max <= call_bound(), "{name}: a call took {max:?}");
        back_to(&server, &baseline, name);
        server.shutdown().unwrap();
    }
}

#[test]
fn a_server_that_stops_answering_fails_calls_by_their_deadline_and_keeps_no_pins() {
    let script = FaultScript::new();
    let server =
        Server::start_with_faults(server_config("silent"), Box::new(script.clone())).unwrap();
    let baseline = state(&server);
    let writer = Client::connect(faulty_client_config(&server)).unwrap();
    let wl = writer.layout(PAGE, FINGERPRINT).unwrap();
    wl.put(b"k", &chunk(1, 100)).unwrap();
    let reader = Client::connect(faulty_client_config(&server)).unwrap();
    let rl = reader.layout(PAGE, FINGERPRINT).unwrap();
    let live = rl.get(b"k").unwrap().expect("present");

    // Every Lookup is executed (pins taken) but never answered.
    let _ = script
        .clone()
        .drop_reply(ReplyMatch::request_kind(Kind::Lookup.as_u16()));
    let mut lat = Latency::default();
    for _ in 0..2 {
        let r = lat.time(|| rl.get(b"k"));
        assert!(r.is_err(), "no answer, no guard: {r:?}");
    }
    let per_call = Duration::from_millis((u64::from(MAX_RETRIES) + 1) * REQUEST_TIMEOUT_MS);
    eprintln!(
        "silent lookups failed after at most {} ms ({} ms of attempts configured)",
        lat.max.as_millis(),
        per_call.as_millis()
    );
    assert!(
        reader.stats().retries >= 2 * u64::from(MAX_RETRIES),
        "every attempt was made: {:?}",
        reader.stats()
    );
    assert!(lat.max <= call_bound(), "{:?}", lat.max);
    script.clear();

    // The unanswered lookups' pins do not outlive the failure: only the
    // live guard's pin remains, and the key is deletable once it goes.
    assert!(rl.exists(b"k").unwrap());
    assert!(
        wait_until(SETTLE, || server.directory_stats().unwrap().pins == 1),
        "pins left: {}",
        server.directory_stats().unwrap().pins
    );
    assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Pinned { pins: 1 });
    assert_eq!(&live[..], &chunk(1, 100)[..]);
    drop(live);
    reader.flush_unpins().unwrap();
    assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    drop((rl, wl));
    reader.close().unwrap();
    writer.close().unwrap();
    back_to(&server, &baseline, "silent");
}

/// Writes `frames` to `s` until the server drops the connection (or all are
/// written); returns how many bytes went out.
fn flood(mut s: &UnixStream, frames: &[u8], copies: usize) -> usize {
    let mut sent = 0;
    for _ in 0..copies {
        if s.write_all(frames).is_err() {
            break;
        }
        sent += frames.len();
    }
    sent
}

#[test]
fn a_client_that_stops_reading_is_dropped_and_leaks_nothing() {
    let server = Server::start(server_config("slow-reader")).unwrap();
    let baseline = state(&server);
    let writer = Client::connect(faulty_client_config(&server)).unwrap();
    let wl = writer.layout(PAGE, FINGERPRINT).unwrap();
    wl.put(b"k", &chunk(1, 100)).unwrap();

    // The slow reader: a session, a pin, then requests whose replies
    // (~128 KiB each: 4096 absent keys) it never reads.
    let slow = UnixStream::connect(server.socket_path()).unwrap();
    let mut raw = Vec::new();
    let hello = proto::Hello {
        meta: proto::RequestMeta::default(),
        protocol_min: 1,
        protocol_max: 1,
        instance_id: "slow".into(),
        client_name: "test".into(),
        client_secret: None,
    };
    proto::encode(1, &hello, &mut raw).unwrap();
    let pin = proto::Lookup {
        meta: proto::RequestMeta {
            seq: 1,
            ..proto::RequestMeta::default()
        },
        layout: proto::Layout {
            page_size_bytes: PAGE,
            fingerprint: FINGERPRINT,
        },
        keys: vec![b"k".to_vec()],
        pins: 1,
    };
    proto::encode(2, &pin, &mut raw).unwrap();
    (&slow).write_all(&raw).unwrap();
    assert!(
        wait_until(SETTLE, || server.directory_stats().unwrap().pins == 1),
        "the slow reader's pin is taken"
    );
    let mut batch = Vec::new();
    let keys: Vec<Vec<u8>> = (0..proto::MAX_BATCH as u32)
        .map(|i| format!("absent-{i}").into_bytes())
        .collect();
    for id in 0..16u64 {
        let exists = proto::Lookup {
            meta: proto::RequestMeta::default(),
            layout: pin.layout,
            keys: keys.clone(),
            pins: 0,
        };
        proto::encode(100 + id, &exists, &mut batch).unwrap();
    }
    // Request ids repeat from one copy to the next; each is answered
    // before the next copy arrives only if the server keeps up, so
    // duplicates may be refused: any reply fills the queue all the same.
    let flooder = {
        let slow = slow.try_clone().unwrap();
        std::thread::spawn(move || flood(&slow, &batch, 400))
    };
    // Meanwhile everyone else is served.
    let mut lat = Latency::default();
    let dropped = wait_until(Duration::from_secs(60), || {
        assert!(lat.time(|| wl.exists(b"k")).unwrap());
        server
            .transport_stats()
            .is_some_and(|t| t.slow_reader_drops >= 1)
    });
    let sent = flooder.join().unwrap();
    assert!(dropped, "the slow reader is dropped ({sent} bytes sent)");
    eprintln!(
        "slow reader dropped after {} MiB of requests; {} calls of another client meanwhile, slowest {} ms",
        sent >> 20,
        lat.calls,
        lat.max.as_millis()
    );
    assert!(lat.max <= call_bound());
    // Its session and pin went with its connection.
    assert!(wait_until(SETTLE, || server
        .directory_stats()
        .unwrap()
        .pins
        == 0));
    assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    drop(slow);
    drop(wl);
    writer.close().unwrap();
    back_to(&server, &baseline, "slow reader");
}

/// A fault plan that panics on the loop thread at the first request of
/// `kind`: a stand-in for any bug that kills the transport's event loop.
struct LoopDiesOn(Kind);

impl FaultPlan for LoopDiesOn {
    fn on_request(&mut self, req: &RequestInfo) -> RequestFault {
        assert_ne!(
            req.header.kind, self.0 as u16,
            "the fault plan kills the transport loop"
        );
        RequestFault::Deliver
    }
}

/// A transport loop that dies stops serving every connection; the server
/// says so (`transport_failure`, what `cxlkv serve` polls to exit non-zero
/// instead of staying up serving nobody), and its stop reports it too.
#[test]
fn a_transport_loop_that_dies_is_reported_to_the_servers_owner() {
    let server = Server::start_with_faults(
        server_config("loop-dies"),
        Box::new(LoopDiesOn(Kind::Stats)),
    )
    .unwrap();
    assert_eq!(server.transport_failure(), None);
    let mut s = UnixStream::connect(server.socket_path()).unwrap();
    let mut frame = Vec::new();
    cxlkv_controlplane::frame::encode_frame(&mut frame, Kind::Stats as u16, 1, b"").unwrap();
    s.write_all(&frame).unwrap();
    let mut failure = None;
    assert!(
        wait_until(SETTLE, || {
            failure = server.transport_failure();
            failure.is_some()
        }),
        "the loop's death went unnoticed"
    );
    let failure = failure.unwrap();
    assert!(
        failure.contains("panicked") && failure.contains("kills the transport loop"),
        "{failure}"
    );
    assert!(server.shutdown().is_err(), "the stop reports the dead loop");
}
