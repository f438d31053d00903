//! Scenarios that inject a directory failure, injected at the transport
//! (the server's reply path: dropped reply, reply past its deadline,
//! duplicated or reordered reply, reset connection). Each test states the
//! outcome the reference demands and, where cxlkv does better, that one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cxlkv_controlplane::proto::Kind;
use cxlkv_controlplane::transport::fault::{FaultPlan, ReplyFault, ReplyInfo};
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
    eventually("the registration is resolved", || {
        h.client.unresolved_registrations() == 0
    });
    assert!(h.in_directory(&k2));
    assert_eq!(h.free_pages(), free, "the page belongs to its key");
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
