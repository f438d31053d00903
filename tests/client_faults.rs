//! The client against a server whose transport loses, duplicates, delays
//! and reorders replies and resets connections (the transport's fault hook;
//! `--features fault-injection`). Whatever the network does, the workload's
//! results are exact, nothing leaks and nothing is freed twice: every
//! retried request keeps its sequence number and is answered once, and
//! page generations make any stale free harmless.

#![cfg(feature = "fault-injection")]

mod client_support;
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use client_support::*;
use cxlkv::client::{Client, DeleteOutcome, RegisterOutcome};
use cxlkv::server::{Server, ServerConfig, ServerHandle};
use cxlkv_controlplane::proto::Kind;
use cxlkv_controlplane::transport::fault::{
    FaultPlan, FaultScript, ReplyFault, ReplyInfo, ReplyMatch, RequestFault, RequestInfo,
};

/// Deterministic chaos on the key operations' replies, and two connection
/// resets mid-run. Counts what it did.
struct Chaos {
    replies: u64,
    requests: u64,
    fired: Arc<AtomicU64>,
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

impl FaultPlan for Chaos {
    fn on_request(&mut self, _req: &RequestInfo) -> RequestFault {
        self.requests += 1;
        if self.requests == 60 || self.requests == 180 {
            self.fired.fetch_add(1, Ordering::Relaxed);
            return RequestFault::Reset;
        }
        RequestFault::Deliver
    }

    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        if !is_key_op(reply.request_kind) {
            return ReplyFault::Deliver;
        }
        self.replies += 1;
        let fault = match self.replies % 11 {
            2 => ReplyFault::Drop,
            5 => ReplyFault::Duplicate,
            7 => ReplyFault::Reorder,
            9 => ReplyFault::Delay(Duration::from_millis(30)),
            _ => ReplyFault::Deliver,
        };
        if fault != ReplyFault::Deliver {
            self.fired.fetch_add(1, Ordering::Relaxed);
        }
        fault
    }
}

#[test]
fn lost_duplicated_and_reordered_replies_leak_nothing_and_free_nothing_twice() {
    let fired = Arc::new(AtomicU64::new(0));
    let plan = Chaos {
        replies: 0,
        requests: 0,
        fired: Arc::clone(&fired),
    };
    let server = Server::start_with_faults(server_config("faults"), Box::new(plan)).unwrap();
    let mut cfg = client_config(&server);
    // Short deadlines make lost replies cheap; enough retries that a slow
    // but delivered reply on a loaded machine never exhausts them.
    cfg.request_timeout_ms = 250;
    cfg.max_retries = 20;
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();

    let n = 160u64;
    for batch in (0..n).collect::<Vec<_>>().chunks(8) {
        let items: Vec<(Vec<u8>, Vec<u8>)> =
            batch.iter().map(|&i| (key(i), chunk(i, 2000))).collect();
        let outcomes = layout.batch_put(&items).unwrap();
        assert_eq!(outcomes, vec![RegisterOutcome::Inserted; batch.len()]);
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| k.as_slice()).collect();
        for ((_, want), got) in items.iter().zip(layout.batch_get(&keys).unwrap()) {
            assert_eq!(&got.unwrap()[..], &want[..]);
        }
        assert_eq!(layout.batch_exists(&keys).unwrap(), vec![true; batch.len()]);
    }
    assert_eq!(client.owned_keys(), n as usize);
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    for batch in keys.chunks(16) {
        let outcomes = layout.batch_delete(batch).unwrap();
        assert_eq!(
            outcomes,
            vec![DeleteOutcome::Deleted; batch.len()],
            "deleted exactly once, never Missing on a retry"
        );
    }
    client.flush_unpins().unwrap();
    // A request after the last delete carries its acknowledgement and picks
    // up any notice still pending.
    assert!(!layout.exists(key(0)).unwrap());

    let stats = client.stats();
    assert!(fired.load(Ordering::Relaxed) >= 20, "the faults fired");
    assert!(stats.retries > 0 && stats.reconnects >= 1, "{stats:?}");
    assert_eq!(client.owned_keys(), 0);
    assert_eq!(client.unresolved_registrations(), 0);
    assert_eq!(
        layout.free_pages(),
        layout.region_bytes() / PAGE,
        "every page is back: nothing leaked"
    );
    assert_eq!(layout.refused_frees(), 0, "no page was freed twice");
    assert_eq!(stats.stale_notices, 0);
    let dir = server.directory_stats().unwrap();
    assert_eq!((dir.keys, dir.pins), (0, 0));
}

/// Resets the connection that sends the next request after `arm()`.
struct ResetOnDemand {
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl FaultPlan for ResetOnDemand {
    fn on_request(&mut self, _req: &RequestInfo) -> RequestFault {
        if self.armed.swap(false, Ordering::Relaxed) {
            RequestFault::Reset
        } else {
            RequestFault::Deliver
        }
    }
}

#[test]
fn a_reconnected_client_takes_its_live_guards_pins_again() {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan = ResetOnDemand {
        armed: Arc::clone(&armed),
    };
    let server = Server::start_with_faults(server_config("faults-repin"), Box::new(plan)).unwrap();
    let a = Client::connect(client_config(&server)).unwrap();
    let b = Client::connect(client_config(&server)).unwrap();
    let al = a.layout(PAGE, FINGERPRINT).unwrap();
    let bl = b.layout(PAGE, FINGERPRINT).unwrap();
    al.batch_put(&[(b"held", chunk(1, 100)), (b"free", chunk(2, 100))])
        .unwrap();
    let guard = al.get(b"held").unwrap().unwrap();
    let session = a.session_id();

    armed.store(true, Ordering::Relaxed);
    // This request's connection is reset: the client reattaches, the old
    // session's pin is gone, and the live guard's pin is taken again.
    assert!(al.exists(b"free").unwrap());
    assert_ne!(a.session_id(), session, "a new session");
    assert_eq!(a.stats().reconnects, 1);
    assert_eq!(a.stats().views_invalidated, 0);
    assert_eq!(
        bl.delete(b"held").unwrap(),
        DeleteOutcome::Pinned { pins: 1 },
        "the guard still protects its page"
    );
    assert_eq!(&guard[..], &chunk(1, 100)[..]);
    drop(guard);
    a.flush_unpins().unwrap();
    assert_eq!(bl.delete(b"held").unwrap(), DeleteOutcome::Deleted);
    // A's page came back through a notice on its next reply.
    assert!(!al.exists(b"held").unwrap());
    assert_eq!(a.owned_keys(), 1);
}

/// Resets the connection instead of delivering the next `Lookup` reply
/// after `arm()` (the lookup has run: its pins are taken).
struct ResetLookupReply {
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl FaultPlan for ResetLookupReply {
    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        if reply.request_kind == Some(Kind::Lookup.as_u16())
            && self.armed.swap(false, Ordering::Relaxed)
        {
            ReplyFault::Reset
        } else {
            ReplyFault::Deliver
        }
    }
}

/// A pinning lookup that ran but whose reply was lost with its connection
/// holds its pins on a session that is gone: retried under the same number
/// on the new session it could only be refused (`PinsHeldByOtherSession`).
/// The client renews the number as it reconnects, so one retry is enough,
/// and the dead session's pin is released with it.
#[test]
fn a_pinning_lookup_whose_reply_died_with_its_connection_runs_again_with_one_retry() {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan = ResetLookupReply {
        armed: Arc::clone(&armed),
    };
    let server =
        Server::start_with_faults(server_config("faults-relookup"), Box::new(plan)).unwrap();
    let mut cfg = client_config(&server);
    cfg.max_retries = 1;
    let a = Client::connect(cfg).unwrap();
    let al = a.layout(PAGE, FINGERPRINT).unwrap();
    al.put(b"k", &chunk(1, 100)).unwrap();
    let session = a.session_id();

    armed.store(true, Ordering::Relaxed);
    let guard = al.get(b"k").unwrap().expect("present");
    assert_eq!(&guard[..], &chunk(1, 100)[..]);
    assert_ne!(a.session_id(), session, "a new session");
    let stats = a.stats();
    assert_eq!((stats.reconnects, stats.retries), (1, 1), "{stats:?}");
    assert!(
        wait_until(Duration::from_secs(10), || server
            .directory_stats()
            .unwrap()
            .pins
            == 1),
        "only the live guard's pin is held: {:?}",
        server.directory_stats().unwrap()
    );
    drop(guard);
    a.flush_unpins().unwrap();
    assert_eq!(server.directory_stats().unwrap().pins, 0);
}

/// Resets every connection that sends a request while armed; once
/// disarmed, drops the replies of the next `reattach_replies_to_lose`
/// `Reattach`es.
struct ResetWhileArmed {
    armed: Arc<std::sync::atomic::AtomicBool>,
    reattach_replies_to_lose: Arc<AtomicU64>,
}

impl ResetWhileArmed {
    fn new(armed: &Arc<std::sync::atomic::AtomicBool>, reattach_replies_to_lose: u64) -> Self {
        Self {
            armed: Arc::clone(armed),
            reattach_replies_to_lose: Arc::new(AtomicU64::new(reattach_replies_to_lose)),
        }
    }
}

/// Arms `armed` now and disarms it from another thread `after` this long.
fn arm_for(
    armed: &Arc<std::sync::atomic::AtomicBool>,
    after: Duration,
) -> std::thread::JoinHandle<()> {
    armed.store(true, Ordering::Relaxed);
    let armed = Arc::clone(armed);
    std::thread::spawn(move || {
        std::thread::sleep(after);
        armed.store(false, Ordering::Relaxed);
    })
}

impl FaultPlan for ResetWhileArmed {
    fn on_request(&mut self, _req: &RequestInfo) -> RequestFault {
        if self.armed.load(Ordering::Relaxed) {
            RequestFault::Reset
        } else {
            RequestFault::Deliver
        }
    }

    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        let to_lose = &self.reattach_replies_to_lose;
        if reply.request_kind == Some(Kind::Reattach.as_u16())
            && !self.armed.load(Ordering::Relaxed)
            && to_lose
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        {
            ReplyFault::Drop
        } else {
            ReplyFault::Deliver
        }
    }
}

#[test]
fn an_instance_that_expired_while_disconnected_gets_its_regions_revoked() {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan = ResetWhileArmed::new(&armed, 0);
    // Grace 300 ms: an instance unreachable for longer is gone.
    let server = Server::start_with_faults(server_config("faults-expiry"), Box::new(plan)).unwrap();
    let a = Client::connect(client_config(&server)).unwrap();
    let al = a.layout(PAGE, FINGERPRINT).unwrap();
    al.put(b"kept", &chunk(1, 100)).unwrap();
    let mut lease = al.alloc().unwrap();
    lease.write(b"before").unwrap();

    // Every request and reattach is reset for a second: the instance
    // expires meanwhile (its key keeps its region alive for readers).
    let waiter = arm_for(&armed, Duration::from_secs(1));
    assert!(al.exists(b"kept").unwrap(), "answered after the reattach");
    waiter.join().unwrap();

    let stats = a.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(stats.regions_refused, 1, "the expired instance's region");
    assert_eq!(a.owned_keys(), 0, "its keys are no longer this instance's");
    assert!(matches!(
        lease.write(b"after"),
        Err(cxlkv::client::ClientError::RegionRevoked { .. })
    ));
    drop(lease);
    // The client goes on with new regions; the orphaned key stays readable.
    assert_eq!(
        al.put(b"new", &chunk(2, 100)).unwrap(),
        RegisterOutcome::Inserted
    );
    let b = Client::connect(client_config(&server)).unwrap();
    let bl = b.layout(PAGE, FINGERPRINT).unwrap();
    assert_eq!(&bl.get(b"kept").unwrap().unwrap()[..], &chunk(1, 100)[..]);
}

/// The same expiry, but the answer of the `Reattach` that recovers the
/// instance (`resumed: false`) is lost. The retry finds the instance the
/// lost attempt recovered; the directory still answers `resumed: false`,
/// since no session of the recovered instance has made a request, and the
/// client counts the recovery. Were it told `resumed: true`, it would take
/// its sequence numbers and pending requests for the previous
/// incarnation's as still valid.
#[test]
fn an_expiry_whose_recovering_reattach_reply_was_lost_is_still_seen_as_a_recovery() {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan = ResetWhileArmed::new(&armed, 1);
    let lost = Arc::clone(&plan.reattach_replies_to_lose);
    // The instance expires while the connection is down (2 s), but not
    // again between the lost answer and the retry (which comes after one
    // request timeout).
    let mut server_cfg = server_config("faults-expiry-lost");
    server_cfg.directory.instance_grace = Duration::from_millis(1000);
    let server = Server::start_with_faults(server_cfg, Box::new(plan)).unwrap();
    let mut cfg = client_config(&server);
    cfg.request_timeout_ms = 300;
    let a = Client::connect(cfg).unwrap();
    let al = a.layout(PAGE, FINGERPRINT).unwrap();
    al.put(b"kept", &chunk(1, 100)).unwrap();

    let waiter = arm_for(&armed, Duration::from_secs(2));
    assert!(al.exists(b"kept").unwrap(), "answered after the reattach");
    waiter.join().unwrap();
    assert_eq!(
        lost.load(Ordering::Relaxed),
        0,
        "one reattach reply was lost"
    );

    let stats = a.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(
        stats.directory_restarts, 1,
        "the recovery was seen: {stats:?}"
    );
    assert_eq!(stats.regions_refused, 1, "the expired instance's region");
    assert_eq!(a.owned_keys(), 0);
    assert_eq!(
        al.put(b"new", &chunk(2, 100)).unwrap(),
        RegisterOutcome::Inserted
    );
    assert_eq!(&al.get(b"kept").unwrap().unwrap()[..], &chunk(1, 100)[..]);
}

/// The defect of docs/reliability.md ("Defects found", 4): a region grant
/// whose reply is lost (dropped on the first server), then a directory
/// restart. The restarted directory recovers the granted region for the
/// instance, which holds no token for it, and refuses its token-less
/// reattach with `OwnershipNotProven`. The client waits out the grace
/// period instead of giving up, reattaches as a fresh instance, and its
/// put and get succeed; the lost region goes back to the pool, and once
/// the key is deleted and the client gone the pool manager holds nothing
/// for this directory (a third start recovers no region, and the free space
/// is the baseline's).
#[test]
fn an_instance_whose_first_region_grant_was_lost_in_a_directory_restart_reattaches_and_leaks_nothing()
 {
    let mut cfg = server_config("faults-lost-grant");
    cfg.remove_pool_on_shutdown = false;
    cfg.directory.instance_grace = Duration::from_secs(1);
    let _cleanup = RemoveOnDrop(server_files(&cfg));
    let script =
        FaultScript::new().drop_reply(ReplyMatch::request_kind(Kind::RequestRegion.as_u16()));
    let server = Server::start_with_faults(cfg.clone(), Box::new(script.clone())).unwrap();
    let baseline_free_bytes = server.directory_stats().unwrap().per_pool[0].estimated_free_bytes;
    assert!(
        baseline_free_bytes > 0,
        "the pool manager reported its space"
    );

    let mut client_cfg = client_config(&server);
    client_cfg.request_timeout_ms = 250;
    client_cfg.max_retries = 40;
    client_cfg.reconnect_timeout_ms = 10_000;
    let client = Client::connect(client_cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let value = chunk(7, 3000);
    let restarted = std::thread::scope(|s| {
        // The first put asks for the layout's first region; every reply to
        // that request is dropped, so the put is still retrying when the
        // server goes away.
        let put = s.spawn(|| layout.put(b"k", &value));
        assert!(
            wait_until(Duration::from_secs(20), || script.fired(0) >= 1),
            "the region was granted and its reply dropped"
        );
        assert_eq!(server.directory_stats().unwrap().regions, 1);
        server.shutdown().unwrap();
        let restarted = Server::start(cfg.clone()).unwrap();
        let recovered = restarted.directory_stats().unwrap();
        assert_eq!(
            recovered
                .per_instance
                .iter()
                .map(|i| i.awaiting_reattach)
                .collect::<Vec<_>>(),
            vec![true],
            "the restarted directory recovered the lost grant for the instance"
        );
        let outcome = put.join().expect("the put thread does not panic");
        assert_eq!(outcome.unwrap(), RegisterOutcome::Inserted);
        restarted
    });
    let stats = client.stats();
    assert!(stats.reattaches_awaiting_grace >= 1, "{stats:?}");
    assert_eq!(stats.directory_restarts, 1, "{stats:?}");
    assert_eq!(&layout.get(b"k").unwrap().unwrap()[..], &value[..]);
    assert!(
        wait_until(Duration::from_secs(20), || {
            restarted.directory_stats().unwrap().outcomes.regions_freed == 1
        }),
        "the lost grant went back to the pool"
    );
    let dir = restarted.directory_stats().unwrap();
    assert_eq!((dir.keys, dir.regions), (1, 1), "one new region, one key");

    assert_eq!(layout.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    drop(layout);
    drop(client);
    assert!(
        wait_until(Duration::from_secs(20), || {
            let d = restarted.directory_stats().unwrap();
            (d.instances, d.regions) == (0, 0)
        }),
        "the closed client's instance and region are gone after its grace"
    );
    assert_eq!(restarted.shutdown().unwrap().frees_unconfirmed, 0);

    cfg.remove_pool_on_shutdown = true;
    let last = Server::start(cfg).unwrap();
    let after = last.directory_stats().unwrap();
    assert!(
        after.per_instance.is_empty(),
        "the pool manager holds no region for this directory: {:?}",
        after.per_instance
    );
    assert_eq!(after.per_pool[0].estimated_free_bytes, baseline_free_bytes);
    last.shutdown().unwrap();
}

/// A server whose pool and state outlive its shutdown (the caller restarts
/// it from `cfg` and removes the pool at the end; `RemoveOnDrop` cleans up
/// after a failure), with sessions and instances that outlast the restart,
/// and a client whose requests time out quickly and whose reconnects wait
/// up to 20 s.
fn restartable(tag: &str) -> (ServerConfig, RemoveOnDrop, ServerHandle, Client) {
    let mut cfg = server_config(tag);
    cfg.remove_pool_on_shutdown = false;
    cfg.directory.session_lease = Duration::from_secs(30);
    cfg.directory.instance_grace = Duration::from_secs(30);
    let cleanup = RemoveOnDrop(server_files(&cfg));
    let server = Server::start(cfg.clone()).unwrap();
    let mut client_cfg = client_config(&server);
    client_cfg.request_timeout_ms = 300;
    client_cfg.reconnect_timeout_ms = 20_000;
    let client = Client::connect(client_cfg).unwrap();
    (cfg, cleanup, server, client)
}

/// A restarted directory answers the first `Reattach` with `resumed: false`
/// (it recovered the instance from the pool manager). When that answer is
/// lost, the retry finds the instance already recovered and answers
/// `resumed: true` — but with a new `directory_epoch`. The client takes the
/// new epoch for the restart it is and registers its keys again: without
/// that, every key it owned would be gone from the index for good.
#[test]
fn a_restart_whose_first_reattach_reply_was_lost_is_still_seen_and_keys_registered_again() {
    let (mut cfg, _cleanup, server, client) = restartable("faults-lost-reattach");
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let value = chunk(3, 2000);
    layout.put(b"owned", &value).unwrap();
    server.shutdown().unwrap();

    let script =
        FaultScript::new().drop_reply(ReplyMatch::request_kind(Kind::Reattach.as_u16()).nth(1));
    let restarted = Server::start_with_faults(cfg.clone(), Box::new(script.clone())).unwrap();
    assert!(
        layout.exists(b"owned").unwrap(),
        "registered again after the reattach"
    );
    assert_eq!(script.fired(0), 1, "the first reattach reply was lost");
    assert_eq!(client.stats().directory_restarts, 1);
    assert_eq!(&layout.get(b"owned").unwrap().unwrap()[..], &value[..]);
    drop(layout);
    drop(client);
    restarted.shutdown().unwrap();
    cfg.remove_pool_on_shutdown = true;
    Server::start(cfg).unwrap().shutdown().unwrap();
}

/// A request that never left the client did not run. Here the connection
/// has room for one request in flight and a slow `Exists` holds it: the
/// registration behind it is refused by the transport on every attempt.
/// It reports a definite failure and its page goes back to the allocator;
/// counted as "may have taken effect", it would be parked (its page held
/// until the directory answers a retry) and reported as indeterminate.
#[test]
fn a_registration_that_never_left_the_client_fails_definitely_and_frees_its_page() {
    let script = FaultScript::new().delay_replies(
        ReplyMatch::request_kind(Kind::Exists.as_u16()),
        Duration::from_millis(1500),
    );
    let server =
        Server::start_with_faults(server_config("faults-unsent"), Box::new(script)).unwrap();
    let mut cfg = client_config(&server);
    cfg.transport.max_inflight = 1;
    cfg.request_timeout_ms = 5_000;
    cfg.max_retries = 2;
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    layout.put(b"first", &chunk(1, 100)).unwrap();
    let free_before = layout.free_pages();

    std::thread::scope(|s| {
        let slow = s.spawn(|| layout.exists(b"first"));
        std::thread::sleep(Duration::from_millis(300));
        let refused = layout.put(b"second", &chunk(2, 100));
        assert!(
            matches!(refused, Err(cxlkv::client::ClientError::Unanswered { .. })),
            "a definite failure: {refused:?}"
        );
        assert!(slow.join().unwrap().unwrap());
    });
    let stats = client.stats();
    assert_eq!(stats.registers_unresolved, 0, "nothing parked: {stats:?}");
    assert_eq!(layout.free_pages(), free_before, "the page went back");
    assert!(!layout.exists(b"second").unwrap());
    assert_eq!(
        layout.put(b"second", &chunk(2, 100)).unwrap(),
        RegisterOutcome::Inserted
    );
}

/// Drops the replies to requests of one kind while armed.
struct DropRepliesOf {
    kind: Kind,
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl DropRepliesOf {
    /// Armed from the start, for good.
    fn always(kind: Kind) -> Self {
        Self {
            kind,
            armed: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }
}

impl FaultPlan for DropRepliesOf {
    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        if reply.request_kind == Some(self.kind.as_u16()) && self.armed.load(Ordering::Relaxed) {
            ReplyFault::Drop
        } else {
            ReplyFault::Deliver
        }
    }
}

/// A region request granted by the directory whose every answer was lost
/// leaves the instance owning a region the client does not know. It must
/// not stay that way for the instance's lifetime: the client keeps the
/// request, sends it again with its number once the directory answers, and
/// adopts the grant (no new region is requested for the room it gives),
/// and an idle region so adopted is returned like any other.
#[test]
fn a_region_grant_whose_answer_was_lost_is_adopted_not_leaked() {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = Server::start_with_faults(
        server_config("faults-lost-grant"),
        Box::new(DropRepliesOf {
            kind: Kind::RequestRegion,
            armed: Arc::clone(&armed),
        }),
    )
    .unwrap();
    let mut cfg = client_config(&server);
    cfg.request_timeout_ms = 300;
    cfg.max_retries = 1;
    // Long enough that the adopted region is still there for the put
    // below on a loaded machine; short enough to see it returned after.
    cfg.idle_region_return_ms = 3000;
    let client = Client::connect(cfg).unwrap();
    let layout = small_region_layout(&client);
    let pages = SMALL_REGION_BYTES / PAGE;
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..pages).map(|i| (key(i), chunk(i, 64))).collect();
    for batch in items.chunks(256) {
        layout.batch_put(batch).unwrap();
    }
    assert_eq!(layout.free_pages(), 0, "the first region is full");

    // The next put needs a second region; the directory grants it, and no
    // answer reaches the client.
    armed.store(true, Ordering::Relaxed);
    let extra = (key(pages), chunk(pages, 64));
    let err = layout
        .put(&extra.0, &extra.1)
        .expect_err("no answer to the region request");
    assert!(err.to_string().contains("request_region"), "{err}");
    assert_eq!(client.unresolved_region_requests(), 1);
    assert_eq!(
        server.directory_stats().unwrap().regions,
        2,
        "it was granted"
    );
    assert_eq!(
        layout.region_bytes(),
        SMALL_REGION_BYTES,
        "the client does not know it"
    );
    let acquired = client.stats().regions_acquired;

    // Answers get through again: the kept request is sent again with its
    // number and the grant adopted.
    armed.store(false, Ordering::Relaxed);
    assert!(
        wait_until(Duration::from_secs(10), || layout.region_bytes()
            == 2 * SMALL_REGION_BYTES),
        "adopted in the background"
    );
    assert_eq!(client.unresolved_region_requests(), 0);
    assert_eq!(client.stats().regions_acquired, acquired + 1);
    assert_eq!(
        server.directory_stats().unwrap().regions,
        2,
        "no third region"
    );
    layout.put(&extra.0, &extra.1).unwrap();
    assert_eq!(
        client.stats().regions_acquired,
        acquired + 1,
        "the put used the adopted region"
    );

    // Emptied, the adopted region is returned like any idle region.
    let keys: Vec<&[u8]> = items.iter().map(|(k, _)| k.as_slice()).collect();
    for batch in keys.chunks(256) {
        layout.batch_delete(batch).unwrap();
    }
    layout.batch_delete(&[extra.0.as_slice()]).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || server
            .directory_stats()
            .unwrap()
            .regions
            == 1),
        "{:?}",
        client.stats()
    );
    assert_eq!(layout.region_bytes(), SMALL_REGION_BYTES);
}

/// An idle region's return that ran at the directory but whose answer was
/// lost must not be put back in use: the directory freed the region, and
/// the pool manager may grant it to another instance. The client retires
/// it (never written again) and takes a new region when it needs one.
#[test]
fn an_idle_region_whose_return_had_no_answer_is_retired_not_reused() {
    let server = Server::start_with_faults(
        server_config("faults-lost-return"),
        // Every `ReturnRegion` reply dropped: the directory frees the
        // region, the client never learns it.
        Box::new(DropRepliesOf::always(Kind::ReturnRegion)),
    )
    .unwrap();
    let mut cfg = client_config(&server);
    cfg.idle_region_return_ms = 50;
    cfg.request_timeout_ms = 300;
    cfg.max_retries = 1;
    let client = Client::connect(cfg).unwrap();
    let layout = small_region_layout(&client);
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..100).map(|i| (key(i), chunk(i, 64))).collect();
    layout.batch_put(&items).unwrap();
    assert_eq!(layout.region_bytes(), 8 << 20);
    let keys: Vec<&[u8]> = items.iter().map(|(k, _)| k.as_slice()).collect();
    layout.batch_delete(&keys).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || client.stats().regions_retired
            == 1),
        "{:?}",
        client.stats()
    );
    let stats = client.stats();
    assert_eq!(stats.regions_returned, 0, "{stats:?}");
    assert_eq!(server.directory_stats().unwrap().regions, 1, "it was freed");
    assert_eq!(layout.region_bytes(), 4 << 20, "not put back");
    // Needing the room again takes a new region from the directory.
    layout.batch_put(&items).unwrap();
    assert_eq!(client.stats().regions_acquired, stats.regions_acquired + 1);
    assert_eq!(server.directory_stats().unwrap().regions, 2);
}

/// Parks a registration (its replies dropped), then cuts the client off
/// (every request, reattach included, reset) while armed.
struct ParkThenPartition {
    drop_register: Arc<std::sync::atomic::AtomicBool>,
    partition: Arc<std::sync::atomic::AtomicBool>,
}

impl FaultPlan for ParkThenPartition {
    fn on_request(&mut self, _req: &RequestInfo) -> RequestFault {
        if self.partition.load(Ordering::Relaxed) {
            RequestFault::Reset
        } else {
            RequestFault::Deliver
        }
    }
    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        if reply.request_kind == Some(Kind::Register.as_u16())
            && self.drop_register.load(Ordering::Relaxed)
        {
            ReplyFault::Drop
        } else {
            ReplyFault::Deliver
        }
    }
}

/// A registration whose outcome is unknown is parked with its pages
/// reserved: it may have registered its keys. Its retries in the background
/// can fail for reasons that say nothing about that first attempt — here
/// the server cannot be reached at all — and must leave the pages
/// reserved; freed, they would be handed to the next write while the
/// directory still names them for the parked keys.
#[test]
fn a_parked_registration_keeps_its_pages_through_a_partition() {
    let drop_register = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let partition = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan = ParkThenPartition {
        drop_register: Arc::clone(&drop_register),
        partition: Arc::clone(&partition),
    };
    let mut server_cfg = server_config("faults-park-partition");
    server_cfg.directory.session_lease = Duration::from_secs(30);
    server_cfg.directory.instance_grace = Duration::from_secs(30);
    let server = Server::start_with_faults(server_cfg, Box::new(plan)).unwrap();
    let mut cfg = client_config(&server);
    cfg.request_timeout_ms = 250;
    cfg.max_retries = 2;
    cfg.reconnect_timeout_ms = 1000;
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let parked = chunk(9, 3000);

    drop_register.store(true, Ordering::Relaxed);
    assert!(layout.put(b"parked", &parked).is_err(), "no answer: parked");
    assert!(client.stats().registers_unresolved >= 1);
    // The registration ran at the directory; its answer never arrives.
    assert!(layout.exists(b"parked").unwrap());

    partition.store(true, Ordering::Relaxed);
    drop_register.store(false, Ordering::Relaxed);
    // Long enough for several background retries (a tick is 100 ms), each
    // finding no server within its second to reconnect.
    std::thread::sleep(Duration::from_millis(4000));
    partition.store(false, Ordering::Relaxed);

    // New writes after the partition must not land on the parked page.
    for i in 0..16 {
        layout.put(key(i), &chunk(100 + i, 3000)).unwrap();
    }
    let read = layout.get(b"parked").unwrap().unwrap();
    assert!(
        read[..] == parked[..],
        "the parked key's page was handed to another write"
    );
}

/// Ends `session_id` as an operator would (`EndSession` on the server's
/// Unix socket, as its own user).
fn end_session_as_operator(
    server: &cxlkv::server::ServerHandle,
    session_id: u64,
) -> cxlkv_controlplane::proto::SessionEnded {
    let mut admin = common::Raw::connect_unix(server.socket_path());
    admin.hello("admin").0.unwrap();
    let meta = admin.rw();
    admin
        .call(&cxlkv_controlplane::proto::EndSession { meta, session_id })
        .unwrap()
}

/// A registration whose reply was lost, and whose session an operator ends
/// while the client waits for that reply: the server closes the session's
/// connection, the client reattaches and sends the registration again
/// under the same number, and the instance's reply cache answers it with
/// the first attempt's outcome. The put succeeds, and its page is the
/// key's for good: never handed to a later write.
#[test]
fn a_registration_whose_reply_was_lost_and_session_ended_is_answered_from_the_reply_cache() {
    let script =
        FaultScript::new().drop_reply(ReplyMatch::request_kind(Kind::Register.as_u16()).nth(2));
    let server = Server::start_with_faults(
        server_config("faults-ended-retry"),
        Box::new(script.clone()),
    )
    .unwrap();
    let mut cfg = client_config(&server);
    cfg.request_timeout_ms = 1_000;
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    layout.put(b"first", &chunk(1, 3000)).unwrap();

    let value = chunk(2, 3000);
    let outcome = std::thread::scope(|s| {
        let put = s.spawn(|| layout.put(b"lost", &value));
        assert!(
            wait_until(Duration::from_secs(10), || script.fired(0) == 1),
            "the registration ran and its reply was dropped"
        );
        // While the client waits for that reply, an operator ends its
        // session (the server closes its connection).
        end_session_as_operator(&server, client.session_id().unwrap());
        put.join().unwrap()
    });
    assert_eq!(outcome.unwrap(), RegisterOutcome::Inserted);
    let stats = client.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(stats.registers_unresolved, 0, "{stats:?}");
    // The key is the first attempt's; its page is never handed out again.
    for i in 0..16 {
        layout.put(key(i), &chunk(100 + i, 3000)).unwrap();
    }
    assert_eq!(&layout.get(b"lost").unwrap().unwrap()[..], &value[..]);
}

/// A view whose session ended keeps reading its page; the reattach takes
/// its pin again only if the key still lives there. Here, before the
/// reattach, another client deletes the key (its pin died with the
/// session) and writes it again in a page of its own: the view reads a
/// page that is no longer the key's, so it is counted invalidated, and the
/// pin the reattach took on the key's new page is given back.
#[test]
fn a_reattach_does_not_pin_a_key_that_moved_for_a_view_of_its_old_page() {
    let server = start_server("faults-moved");
    let a = Client::connect(client_config(&server)).unwrap();
    let b = Client::connect(client_config(&server)).unwrap();
    let al = a.layout(PAGE, FINGERPRINT).unwrap();
    let bl = b.layout(PAGE, FINGERPRINT).unwrap();
    al.put(b"k", &chunk(1, 100)).unwrap();
    let guard = al.get(b"k").unwrap().unwrap();

    // An operator ends A's session: its pin goes, A does not know yet.
    let ended = end_session_as_operator(&server, a.session_id().unwrap());
    assert_eq!(ended.pins_released, 1);
    assert_eq!(bl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    assert_eq!(
        bl.put(b"k", &chunk(2, 100)).unwrap(),
        RegisterOutcome::Inserted
    );

    // A's next call reattaches and re-pins its live views.
    assert!(al.exists(b"k").unwrap());
    assert!(a.stats().reconnects >= 1);
    assert_eq!(a.stats().views_invalidated, 1, "{:?}", a.stats());
    a.flush_unpins().unwrap();
    assert_eq!(
        server.directory_stats().unwrap().pins,
        0,
        "no pin is held on the key's new page for a view of the old one"
    );
    drop(guard);
    a.flush_unpins().unwrap();
    assert_eq!(server.directory_stats().unwrap().pins, 0);
    assert_eq!(&bl.get(b"k").unwrap().unwrap()[..], &chunk(2, 100)[..]);
}

/// A call made from a thread-local destructor (a thread exiting) while the
/// server is away cannot set up a new session there — its thread-locals
/// are gone — and is refused at once, saying why, instead of taking the
/// reconnect lock and failing its set-up until `reconnect_timeout_ms`; a
/// live thread's call reconnects once the server is back.
#[test]
fn a_reconnect_from_an_exiting_thread_is_refused_at_once_and_a_live_thread_reconnects() {
    use std::sync::mpsc;

    let (mut cfg, _cleanup, server, client) = restartable("faults-exiting-thread");
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    layout.put(b"owned", &chunk(4, 100)).unwrap();

    let (ready_tx, ready_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let outcome = Arc::new(parking_lot::Mutex::new(None));
    let exiting = {
        let (layout, outcome) = (layout.clone(), Arc::clone(&outcome));
        std::thread::spawn(move || {
            at_exit::register_first();
            assert!(layout.exists(b"owned").unwrap());
            ready_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            at_exit::set(move || {
                let start = std::time::Instant::now();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    layout.exists(b"owned")
                }));
                *outcome.lock() = Some((r.map_err(|_| "panicked"), start.elapsed()));
            });
        })
    };
    ready_rx.recv().unwrap();
    server.shutdown().unwrap();
    go_tx.send(()).unwrap();
    exiting.join().unwrap();
    let (result, took) = outcome.lock().take().expect("the destructor ran");
    let err = result.expect("no panic").expect_err("no server to answer");
    let text = err.to_string();
    assert!(
        matches!(err, cxlkv::client::ClientError::ReconnectFailed { .. })
            && text.contains("this thread is exiting"),
        "{text}"
    );
    assert!(
        took < Duration::from_secs(10),
        "refused at once, not after the 20 s reconnect timeout: {took:?}"
    );

    let restarted = Server::start(cfg.clone()).unwrap();
    assert!(layout.exists(b"owned").unwrap(), "a live thread reconnects");
    drop(layout);
    drop(client);
    restarted.shutdown().unwrap();
    cfg.remove_pool_on_shutdown = true;
    Server::start(cfg).unwrap().shutdown().unwrap();
}
