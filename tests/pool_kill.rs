//! A real `cxlkv pool` process, SIGKILLed in the middle of a pipelined
//! stream of allocations, restarted on the same state directory; its state
//! is then checked against what the client saw acknowledged:
//!
//! - every acknowledged allocation is present, once, with the same handle
//!   (fields and token);
//! - every allocation sent but not acknowledged is either present — and then
//!   a retry with the same `seq` (its allocation tag) returns exactly it — or
//!   absent, and the retry allocates it now;
//! - no region is unaccounted for, and no two regions overlap.
//!
//! Per-record sync and group commit, on the default transport and on the
//! fallback (`CXLKV_IO=fallback`).

mod pool_support;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use cxlkv_controlplane::proto::{AllocRegion, Message, RegionAllocated, RegionHandle};
use cxlkv_controlplane::transport::PendingCall;
use pool_support::{
    Daemon, DaemonSpec, TIMEOUT, Wire, alloc_msg, decode_reply, payload_of, shm_dir,
};

const DIRECTORY: &str = "dir-kill";
/// Allocations the stream would send if the daemon lived.
const STREAM_LEN: u64 = 4000;
/// Requests in flight at once.
const WINDOW: usize = 64;
/// The daemon is killed once this many allocations were acknowledged.
const KILL_AFTER_ACKS: usize = 400;

fn kill_mid_stream(name: &str, sync: &'static str, io: Option<&'static str>) {
    let dir = shm_dir(name);
    let mut spec = DaemonSpec::new(dir.path());
    spec.sync = sync;
    spec.io = io;
    let mut daemon = Daemon::start(&spec);
    let wire = Wire::unix(&spec.socket());
    assert_eq!(wire.hello(DIRECTORY).last_seq, 0);

    let mut acked: BTreeMap<u64, RegionHandle> = BTreeMap::new();
    let mut unacked: BTreeSet<u64> = BTreeSet::new();
    let mut inflight: VecDeque<(u64, PendingCall)> = VecDeque::new();
    let mut next_seq = 1;
    let mut killed = false;
    loop {
        let kill_now = !killed && acked.len() >= KILL_AFTER_ACKS;
        while !killed && next_seq <= STREAM_LEN && inflight.len() < WINDOW {
            let msg = alloc_msg(DIRECTORY, next_seq);
            match wire
                .client
                .start(AllocRegion::KIND.as_u16(), &payload_of(&msg), TIMEOUT)
            {
                Ok(call) => inflight.push_back((next_seq, call)),
                Err(e) => panic!("sending seq {next_seq} failed while the daemon was alive: {e}"),
            }
            next_seq += 1;
        }
        if kill_now {
            // Right after a fresh window went out: some of it is committed
            // and not answered, some not committed, some not even read.
            daemon.kill();
            killed = true;
        }
        let Some((seq, call)) = inflight.pop_front() else {
            break;
        };
        match call.wait() {
            Ok(reply) => {
                let r = decode_reply::<RegionAllocated>(reply.header, reply.payload())
                    .unwrap_or_else(|e| panic!("allocation {seq} refused: {e:?}"));
                acked.insert(seq, r.handle);
            }
            Err(_) => {
                assert!(killed, "request {seq} failed while the daemon was alive");
                unacked.insert(seq);
            }
        }
    }
    assert!(killed, "the stream ended before the kill");
    assert!(acked.len() >= KILL_AFTER_ACKS);
    drop(wire);

    let _restarted = Daemon::start(&spec);
    let wire = Wire::unix(&spec.socket());
    let welcome = wire.hello(DIRECTORY);
    assert!(
        welcome.last_seq >= *acked.keys().last().unwrap(),
        "last_seq {} below an acknowledged seq",
        welcome.last_seq
    );
    let present: BTreeMap<u64, RegionHandle> =
        wire.list().into_iter().map(|h| (h.region, h)).collect();
    for (seq, h) in &acked {
        assert_eq!(
            present.get(&h.region),
            Some(h),
            "acknowledged allocation seq {seq} is missing or changed"
        );
    }
    let mut accounted: BTreeSet<u64> = acked.values().map(|h| h.region).collect();
    let (mut were_present, mut were_absent) = (0, 0);
    for &seq in &unacked {
        let h = wire
            .alloc(DIRECTORY, seq)
            .unwrap_or_else(|e| panic!("retry of seq {seq} refused: {e:?}"));
        assert!(
            accounted.insert(h.region),
            "the retry of seq {seq} returned region {} which another allocation has",
            h.region
        );
        match present.get(&h.region) {
            Some(p) => {
                assert_eq!(p, &h, "the retry of seq {seq} returned a changed handle");
                were_present += 1;
            }
            None => were_absent += 1,
        }
    }
    for region in present.keys() {
        assert!(
            accounted.contains(region),
            "region {region} survived the crash but belongs to no allocation of the stream"
        );
    }
    let mut all: Vec<RegionHandle> = wire.list();
    assert_eq!(
        all.len(),
        acked.len() + unacked.len(),
        "each allocation exactly once"
    );
    all.sort_by_key(|h| (h.pool, h.offset_bytes));
    for pair in all.windows(2) {
        if pair[0].pool == pair[1].pool {
            assert!(
                pair[0].offset_bytes + pair[0].len_bytes <= pair[1].offset_bytes,
                "regions {} and {} overlap",
                pair[0].region,
                pair[1].region
            );
        }
    }
    eprintln!(
        "{name}: {} acknowledged, {} unacknowledged ({were_present} committed before the kill, {were_absent} not)",
        acked.len(),
        unacked.len()
    );
}

#[test]
fn pool_kill_mid_stream_with_per_record_sync_keeps_every_acknowledged_allocation() {
    kill_mid_stream("kill-per-record", "per-record", None);
}

#[test]
fn pool_kill_mid_stream_with_group_commit_keeps_every_acknowledged_allocation() {
    kill_mid_stream("kill-group", "group", None);
}

#[test]
fn pool_kill_mid_stream_on_the_fallback_transport_keeps_every_acknowledged_allocation() {
    kill_mid_stream("kill-fallback", "group", Some("fallback"));
}
