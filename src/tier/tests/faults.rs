//! Scenarios that inject a directory failure, injected at the transport
//! (the server's reply path: dropped reply, reply past its deadline,
//! duplicated or reordered reply, reset connection). Each test states the
//! outcome the reference demands and, where cxlkv does better, that one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::proto::Kind;
use cxlkv_controlplane::transport::fault::{
    FaultPlan, ReplyFault, ReplyInfo, RequestFault, RequestInfo,
};
use parking_lot::Mutex;

use super::*;

const ONE: Holds = Holds::ONE;
/// Attempts of one request: the first and `MAX_RETRIES` more.
const MAX_RETRIES: u32 = 2;
const ATTEMPTS: u64 = MAX_RETRIES as u64 + 1;
const TIMEOUT_MS: u64 = 200;

/// A fault plan the test arms: the next `remaining` replies to requests of
/// `kind` get `fault`.
#[derive(Clone, Default)]
struct Switch {
    armed: Arc<Mutex<Option<(u16, ReplyFault, u64)>>>,
    fired: Arc<Mutex<u64>>,
}

impl Switch {
    fn arm(&self, kind: Kind, fault: ReplyFault, times: u64) {
        *self.armed.lock() = Some((kind.as_u16(), fault, times));
    }

    fn disarm(&self) {
        *self.armed.lock() = None;
    }

    fn fired(&self) -> u64 {
        *self.fired.lock()
    }
}

impl FaultPlan for Switch {
    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        let mut armed = self.armed.lock();
        if let Some((kind, fault, left)) = armed.as_mut()
            && reply.request_kind == Some(*kind)
            && *left > 0
        {
            *left -= 1;
            *self.fired.lock() += 1;
            return *fault;
        }
        ReplyFault::Deliver
    }
}

fn faulty(tag: &str) -> (Harness, Switch) {
    let switch = Switch::default();
    let mut s = Setup::new(tag);
    let plan = switch.clone();
    s.start = Box::new(move |c| {
        Server::start_with_faults(c, Box::new(plan.clone())).expect("server starts")
    });
    s.client = Box::new(|server| {
        let mut c = client_config(server);
        c.request_timeout_ms = TIMEOUT_MS;
        c.max_retries = MAX_RETRIES;
        c
    });
    (s.build(), switch)
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn scenario_9_a_lost_pin_reply_is_retried_once_and_a_lost_answer_leaks_no_pin() {
    let (h, sw) = faulty("s9");
    let k = key(9);
    h.seed(&k);
    // Reference: a failed pin RPC is a miss with no pins. cxlkv: one lost
    // reply is answered by the retry of the same sequence number — a hit,
    // pinned exactly once.
    sw.arm(Kind::Lookup, ReplyFault::Drop, 1);
    let r = h.reserve_read(&[&k], ONE);
    assert_eq!(r[0].code, TierCode::Success);
    assert_eq!(sw.fired(), 1);
    assert_eq!(h.pins(), 1, "exactly once");
    h.finish_read(&[&k], ONE);
    assert_eq!(h.pins(), 0);
    // Every attempt lost: the spec's outcome (a miss, nothing staged), and
    // the pins the directory did take die with the session the client ends.
    sw.arm(Kind::Lookup, ReplyFault::Drop, ATTEMPTS);
    let r = h.reserve_read(&[&k], ONE);
    assert_eq!(r[0].code, TierCode::KeyNotExist);
    assert_eq!(h.stage(&k), KeyStage::Untracked);
    eventually("the lost pins are released", || h.pins() == 0);
    assert!(h.client.stats().reconnects >= 1);
    assert_eq!(
        h.reserve_read(&[&k], ONE)[0].code,
        TierCode::Success,
        "usable again"
    );
    h.healthy();
}

#[test]
fn scenario_10_lookup_replies_past_their_deadline_roll_every_pin_back() {
    let (h, sw) = faulty("s10");
    let k = key(10);
    h.seed(&k);
    // The reference's retrieve failure after a successful pin: with one
    // lookup there is no second step, so the failure is the reply itself.
    sw.arm(
        Kind::Lookup,
        ReplyFault::Delay(Duration::from_millis(3 * TIMEOUT_MS)),
        ATTEMPTS,
    );
    let r = h.reserve_read(&[&k], Holds::from_extra_count(1));
    assert_eq!(r[0].code, TierCode::KeyNotExist);
    eventually("both pins are released", || h.pins() == 0);
    assert_eq!(h.stage(&k), KeyStage::Untracked);
    sw.disarm();
    assert_eq!(h.reserve_read(&[&k], ONE)[0].code, TierCode::Success);
    assert_eq!(h.pins(), 1);
}

#[test]
fn scenario_12_duplicated_and_reordered_lookup_replies_take_exactly_t_pins() {
    // The reference's short or partial pin replies cannot happen: one
    // lookup takes all `T` pins of a key or none, and a reply of the wrong
    // length is refused by the client. What the network can do is repeat or
    // reorder a reply; neither changes the pins taken.
    let (h, sw) = faulty("s12");
    let (k1, k2) = (key(121), key(122));
    h.seed(&k1);
    h.seed(&k2);
    sw.arm(Kind::Lookup, ReplyFault::Duplicate, 1);
    assert!(h.reserve_read(&[&k1], Holds::from_extra_count(1))[0].is_success());
    assert_eq!(h.pins(), 2);
    sw.arm(Kind::Lookup, ReplyFault::Reorder, 1);
    assert!(h.reserve_read(&[&k2], Holds::from_extra_count(1))[0].is_success());
    assert_eq!(h.pins(), 4);
    h.finish_read(&[&k1, &k2], Holds::total(2));
    assert_eq!(h.pins(), 0);
    h.healthy();
}

#[test]
fn scenario_19_a_failed_exists_check_proceeds() {
    let (h, sw) = faulty("s19");
    let k = key(19);
    sw.arm(Kind::Exists, ReplyFault::Drop, ATTEMPTS);
    let r = h.reserve(&[&k], false);
    assert_eq!(
        r[0].code,
        TierCode::Success,
        "dedup deferred to registration"
    );
    assert_eq!(sw.fired(), ATTEMPTS);
    assert_eq!(h.tier.finish_write(&[&k]).unwrap(), vec![TierCode::Success]);
}

#[test]
fn scenario_21_a_lost_store_reply_never_recycles_the_page() {
    let (h, sw) = faulty("s21");
    // One lost reply: the retry is answered exactly once — Success.
    let k1 = key(211);
    h.reserve(&[&k1], false);
    sw.arm(Kind::Register, ReplyFault::Drop, 1);
    assert_eq!(
        h.tier.finish_write(&[&k1]).unwrap(),
        vec![TierCode::Success]
    );
    assert_eq!(h.dir().outcomes.inserted, 1, "registered once");
    // Every attempt lost: the spec's KeyInWrongState, out of W, and the page
    // is not freed while its registration is unknown (I7)…
    let k2 = key(212);
    h.reserve(&[&k2], false);
    let free = h.free_pages();
    sw.arm(Kind::Register, ReplyFault::Drop, ATTEMPTS);
    assert_eq!(
        h.tier.finish_write(&[&k2]).unwrap(),
        vec![TierCode::KeyInWrongState]
    );
    assert_eq!(h.stage(&k2), KeyStage::Untracked);
    assert_eq!(h.free_pages(), free, "never recycled while unknown");
    assert_eq!(h.tier.stats().registers_unresolved, 1);
    // …and, better than the reference's deliberate leak, the client learns
    // the outcome later (same sequence number) and nothing is lost.
    sw.disarm();
    h.listen();
    eventually("the registration is resolved", || {
        h.client.unresolved_registrations() == 0
    });
    assert!(h.in_directory(&k2));
    assert_eq!(h.free_pages(), free, "the page belongs to its key");
    // The key resolved as registered is a stored key like any other (no
    // `write_finished` for it, then or later: I5): `reserve_write` finds it
    // stored, and a read reports it `reserved_read` — where an eviction
    // policy learns of it — and `delete` frees its page.
    let again = h.reserve(&[&k2], false);
    assert_eq!(codes(&again), vec![TierCode::KeyNotWritable]);
    assert!(h.reserve_read(&[&k2], ONE)[0].is_success());
    assert_eq!(h.finish_read(&[&k2], ONE), vec![TierCode::Success]);
    assert_eq!(h.rec.kinds("reserved_read"), vec![vec![k2.clone()]]);
    assert!(h.rec.kinds("write_finished").is_empty());
    assert_eq!(h.delete(&[&k2]), vec![TierCode::Success]);
    assert_eq!(
        h.free_pages(),
        free + 1,
        "freed exactly once, after the delete"
    );
    h.healthy();
}

#[test]
fn scenario_32_a_lost_delete_reply_is_answered_once() {
    let (h, sw) = faulty("s32c");
    let (k1, k2) = (key(321), key(322));
    h.write(&[&k1, &k2]);
    // Reference: a delete RPC failure is KeyIsLocked. One lost reply: the
    // retry gets the original answer.
    sw.arm(Kind::Delete, ReplyFault::Drop, 1);
    assert_eq!(h.delete(&[&k1]), vec![TierCode::Success]);
    assert!(!h.in_directory(&k1));
    // Every attempt lost: KeyIsLocked (retryable). The retry says what the
    // first attempt did — deleted once, never twice.
    sw.arm(Kind::Delete, ReplyFault::Drop, ATTEMPTS);
    assert_eq!(h.delete(&[&k2]), vec![TierCode::KeyIsLocked]);
    sw.disarm();
    assert_eq!(h.delete(&[&k2]), vec![TierCode::KeyNotExist]);
    assert_eq!(h.dir().outcomes.deleted, 2);
    h.healthy();
}

#[test]
fn scenario_53_mixed_finish_with_a_lost_store_reply() {
    let (h, sw) = faulty("s53");
    let (t, r) = (key(531), key(532));
    let free = h.free_pages();
    let pt = page(&h.reserve(&[&t], true)[0]);
    h.reserve(&[&r], false);
    sw.arm(Kind::Register, ReplyFault::Drop, ATTEMPTS);
    assert_eq!(
        h.tier.finish_write(&[&t, &r]).unwrap(),
        vec![TierCode::Success, TierCode::KeyInWrongState]
    );
    sw.disarm();
    assert!(!h.in_directory(&t), "the temporary stays private");
    let got = h.reserve_read(&[&t], ONE);
    assert!(page(&got[0]).same_page(&pt));
    assert_eq!(read_bytes(&pt), bytes_for(&t, CHUNK));
    h.finish_read(&[&t], ONE);
    assert_eq!(h.free_pages(), free - 1, "exactly T's page freed; R's kept");
    eventually("R's registration is resolved", || {
        h.client.unresolved_registrations() == 0
    });
    assert!(h.in_directory(&r), "not leaked: registered, once");
    h.healthy();
}

#[test]
fn held_reads_survive_a_connection_reset_and_still_protect_the_key() {
    // Pins belong to the session: the reset ends it (the directory drops
    // its pins) and the reattach takes them again before anyone can delete.
    let (h, sw) = faulty("reset");
    let k = key(1);
    h.seed(&k);
    h.reserve_read(&[&k], Holds::total(2));
    sw.arm(Kind::Exists, ReplyFault::Reset, 1);
    let _ = h.layout.exists(&k);
    assert!(h.client.stats().reconnects >= 1);
    assert_eq!(h.pins(), 2, "taken again on the new session");
    assert_eq!(
        h.peer.delete(&k).unwrap(),
        crate::client::DeleteOutcome::Pinned { pins: 2 }
    );
    assert_eq!(
        h.finish_read(&[&k], Holds::total(2)),
        vec![TierCode::Success]
    );
    assert_eq!(
        h.pins(),
        0,
        "released on the new session, inside finish_read"
    );
    assert_eq!(
        h.peer.delete(&k).unwrap(),
        crate::client::DeleteOutcome::Deleted
    );
}

#[test]
fn an_unpin_whose_every_reply_is_lost_still_releases_the_pins() {
    let (h, sw) = faulty("unpin");
    let k = key(1);
    h.seed(&k);
    h.reserve_read(&[&k], ONE);
    sw.arm(Kind::Unpin, ReplyFault::Drop, ATTEMPTS);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    eventually("the session's pins are gone", || h.pins() == 0);
    assert!(
        h.client.stats().reconnects >= 1,
        "the session of unknown pins was ended"
    );
    assert_eq!(h.stage(&k), KeyStage::Untracked);
    assert_eq!(
        h.peer.delete(&k).unwrap(),
        crate::client::DeleteOutcome::Deleted
    );
}

/// The peer's delete of `key` answers `Deleted` (polled: a replaced
/// session's pins go when the server sees its connection close).
fn peer_deletes(h: &Harness, key: &[u8]) {
    eventually("the peer's delete answers Deleted", || {
        h.peer.delete(key).unwrap() == crate::client::DeleteOutcome::Deleted
    });
}

/// Found by an audit of the L1 tier: `finish_read` whose unpin could get
/// no sequence number (every number of the window held by requests in
/// flight, past the request timeout) returned with the pins still in the
/// client's ledger and on the server — a session that lives on kept them
/// for good, and every reattach took them again. The client now takes them
/// out of the ledger and ends the session, as for an unpin given up.
#[test]
fn pins_whose_unpin_gets_no_sequence_number_die_with_the_session() {
    let mut s = Setup::new("unpin-no-seq");
    s.server.directory.reply_window = 64;
    s.client = Box::new(|server| {
        let mut c = client_config(server);
        c.request_timeout_ms = 100;
        c
    });
    let h = s.build();
    let k = key(1);
    h.seed(&k);
    assert!(h.reserve_read(&[&k], ONE)[0].is_success());
    // Every number of the window taken, as by requests awaiting replies.
    let shared = h.layout.shared();
    let mut held = Vec::new();
    while let Ok(t) = shared.ticket() {
        held.push(t);
    }
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    for t in held {
        shared.seqs.release(t);
    }
    peer_deletes(&h, &k);
    assert!(
        h.client.stats().reconnects >= 1,
        "the session holding the pin was ended"
    );
    assert_eq!(h.tier.stats().pins_lost, 1);
    assert_eq!(h.stage(&k), KeyStage::Untracked);
    h.healthy();
}

/// Found by an audit of the L1 tier: `finish_read` whose unpin the
/// connection refused (its in-flight bound taken by another request) took
/// the refusal for a broken connection — pins out of the ledger, "gone
/// with the session" — while the session lived on and kept them for good.
/// The client now ends the session.
#[test]
fn pins_whose_unpin_finds_no_room_in_flight_die_with_the_session() {
    let switch = Switch::default();
    let mut s = Setup::new("unpin-no-room");
    let plan = switch.clone();
    s.start = Box::new(move |c| {
        Server::start_with_faults(c, Box::new(plan.clone())).expect("server starts")
    });
    s.client = Box::new(|server| {
        let mut c = client_config(server);
        c.transport.max_inflight = 1;
        c
    });
    let h = s.build();
    let k = key(1);
    h.seed(&k);
    assert!(h.reserve_read(&[&k], ONE)[0].is_success());
    // Another request of this client in flight, its reply held back: the
    // connection's one slot is taken while `finish_read` runs.
    switch.arm(Kind::Exists, ReplyFault::Delay(Duration::from_secs(2)), 1);
    let (layout, other) = (h.layout.clone(), key(2));
    let busy = std::thread::spawn(move || layout.exists(&other));
    eventually("the other request holds the slot", || switch.fired() == 1);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    assert!(!busy.join().unwrap().unwrap());
    peer_deletes(&h, &k);
    assert!(
        h.client.stats().reconnects >= 1,
        "the session holding the pin was ended"
    );
    assert_eq!(h.tier.stats().pins_lost, 1);
    h.healthy();
}

/// Found by a review of the L1 tier: a reconnect falling between a pinning
/// lookup's reply and the counting of its pins ends the session that took
/// them, and the reattach that follows (the lookup ends the session once
/// more) takes the ledger's pins again. A key deleted and written again
/// elsewhere in between is found moved: the reattach takes no pin for this
/// lookup — yet the lookup answered the key found at its old location, and
/// the tier staged a held read (`pinned == holds`) of a page nobody
/// protected, maybe another key's by then. Such a key is now a miss; a key
/// the reattach found where the lookup did is served, protected.
#[test]
fn a_read_raced_by_a_reconnect_never_serves_a_page_its_pins_no_longer_protect() {
    use crate::client::DeleteOutcome;
    use crate::client::staged::BEFORE_COUNTING_PINS;
    let h = harness("lookup-race-moved");
    let (moved, kept) = (key(1), key(2));
    h.seed(&moved);
    h.seed(&kept);
    let old = h.peer_location(&moved);
    let (layout, peer, k) = (h.layout.clone(), h.peer.clone(), moved.clone());
    BEFORE_COUNTING_PINS.set(Some(Box::new(move || {
        // Another thread's reconnect: the session that took the pins ends,
        // and the reattach re-pins a ledger that does not hold them yet.
        layout
            .shared()
            .end_session("test: another thread reconnects");
        // Nothing protects the key now (the old session's pins go when the
        // server sees its connection close): the peer deletes it and
        // writes it again, on another page.
        eventually("the peer's delete answers Deleted", || {
            peer.delete(&k).unwrap() == DeleteOutcome::Deleted
        });
        peer.put(b"filler", &bytes_for(b"filler", CHUNK)).unwrap();
        peer.put(&k, &bytes_for(b"new bytes", CHUNK)).unwrap();
    })));
    let r = h.reserve_read(&[&moved, &kept], Holds::total(2));
    let now = h.peer_location(&moved);
    assert_ne!(now, old, "the key moved");
    assert!(
        r[0].page.is_none(),
        "{:?}: served the page the key left ({:?}; the key is at {now:?}), which no pin protects",
        r[0].code,
        r[0].page.as_ref().map(TierPage::location),
    );
    assert_eq!(r[0].code, TierCode::KeyNotExist);
    assert_eq!(h.stage(&moved), KeyStage::Untracked);
    assert_eq!(h.tier.stats().pins_lost, 2);
    // The key the reattach found in place is served, and protected.
    assert_eq!(r[1].code, TierCode::Success);
    assert_eq!(read_bytes(&page(&r[1])), bytes_for(&kept, CHUNK));
    assert_eq!(
        h.peer.delete(&kept).unwrap(),
        DeleteOutcome::Pinned { pins: 2 }
    );
    // Nothing of the lost pins is left in the ledger: the key's next read
    // is served its new page, and its release unpins it.
    let again = h.reserve_read(&[&moved], ONE);
    assert_eq!(page(&again[0]).location(), now);
    assert_eq!(read_bytes(&page(&again[0])), bytes_for(b"new bytes", CHUNK));
    assert_eq!(
        h.finish_read(&[&moved, &kept], Holds::total(2)),
        vec![TierCode::Success; 2]
    );
    peer_deletes(&h, &moved);
    peer_deletes(&h, &kept);
    eventually("no pin is left", || h.pins() == 0);
    h.healthy();
}

/// Resets the connection of every request while set (reattaches included):
/// the client is cut off from the directory.
#[derive(Clone, Default)]
struct Partition(Arc<AtomicBool>);

impl FaultPlan for Partition {
    fn on_request(&mut self, _req: &RequestInfo) -> RequestFault {
        // Relaxed: a switch the test flips; the loop reads it per request.
        if self.0.load(Ordering::Relaxed) {
            RequestFault::Reset
        } else {
            RequestFault::Deliver
        }
    }
}

/// The per-key refusal of scenarios 22 and 30 (`RegisterOutcome::Rejected`
/// for one entry of an answered batch), which their whole-batch refusal
/// (the directory's key limit) never reaches: a write staged in a region
/// the instance no longer owns. The client is cut off past its instance's
/// grace period; the directory forgets the instance, and keeps its region
/// (a registered key is in it) with no owner. The reattach creates the
/// instance afresh and the region is refused (revoked). The staged page's
/// registration is then refused `NotOwner` for that entry: the spec's
/// `KeyInWrongState`, its page reclaimed by the client (once), and
/// `write_finished([])` once; a retained promote's the same, with no hold
/// taken and nothing promoted.
#[test]
fn a_write_staged_in_a_region_revoked_at_a_reattach_is_refused_per_key() {
    let cut = Partition::default();
    let server = Server::start_with_faults(server_config("revoked-write"), Box::new(cut.clone()))
        .expect("server starts");
    let client = Client::connect(client_config(&server)).expect("client connects");
    let layout = client.layout(PAGE, FINGERPRINT).expect("layout");
    let tier = L1Tier::new(layout.clone(), TierConfig::default()).expect("tier");
    let rec = Arc::new(Recorder::default());
    tier.register_listener(Arc::clone(&rec) as Arc<dyn Listener>)
        .unwrap();
    let (kept, staged, promoted) = (key(1), key(2), key(3));
    let reserve = |k: &[u8]| {
        let r = tier
            .reserve_write(&[k], &[false], CHUNK, WriteMode::New)
            .unwrap();
        assert_eq!(r[0].code, TierCode::Success);
        fill(&page(&r[0]), k);
    };
    reserve(&kept);
    assert_eq!(
        tier.finish_write(&[&kept]).unwrap(),
        vec![TierCode::Success]
    );
    reserve(&staged);
    reserve(&promoted);
    let rejected_before = server.directory_stats().unwrap().outcomes.rejected;

    // Cut off for 1.5 s, three times the instance's grace: the request
    // below finds its connection reset, and every reattach too until the
    // instance is gone, its region (holding `kept`) orphaned.
    cut.0.store(true, Ordering::Relaxed);
    let heal = {
        let cut = cut.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            cut.0.store(false, Ordering::Relaxed);
        })
    };
    assert!(layout.exists(&kept).unwrap(), "answered after the reattach");
    heal.join().unwrap();
    let stats = client.stats();
    assert_eq!(
        stats.regions_refused, 1,
        "the region was revoked: {stats:?}"
    );

    rec.clear();
    assert_eq!(
        tier.finish_write(&[&staged]).unwrap(),
        vec![TierCode::KeyInWrongState]
    );
    assert_eq!(
        server.directory_stats().unwrap().outcomes.rejected,
        rejected_before + 1,
        "refused per key, in an answered batch"
    );
    assert_eq!(
        client.stats().rejections,
        1,
        "the client settled it Rejected"
    );
    assert_eq!(rec.kinds("write_finished"), vec![Vec::<Vec<u8>>::new()]);
    assert_eq!(tier.inspect(&staged).unwrap(), KeyStage::Untracked);
    assert!(!layout.exists(&staged).unwrap(), "never registered");
    // The retained promote takes the same path (scenario 30).
    rec.clear();
    let r = tier
        .finish_write_and_reserve_read(&[&promoted], Holds::ONE)
        .unwrap();
    assert_eq!(
        (r[0].code, r[0].page.is_none()),
        (TierCode::KeyInWrongState, true)
    );
    assert_eq!(
        server.directory_stats().unwrap().outcomes.rejected,
        rejected_before + 2
    );
    assert_eq!(client.stats().rejections, 2);
    assert_eq!(
        rec.kinds("finish_write_and_reserve_read"),
        vec![Vec::<Vec<u8>>::new()]
    );
    assert!(rec.kinds("write_finished").is_empty());
    assert_eq!(tier.inspect(&promoted).unwrap(), KeyStage::Untracked);
    tier.check_invariants().unwrap();
    assert!(tier.memcheck(), "no page was freed twice");
}
