//! The decisions of `l1-tier.md` on the reference's open points, and the
//! promises that do not need a fault to show.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak, mpsc};
use std::time::{Duration, Instant};

use super::*;
use crate::tier::{Clock, TierError};

const ONE: Holds = Holds::ONE;

#[test]
fn a_key_repeated_within_a_call_is_an_argument_error_that_changes_nothing() {
    let h = harness("dup");
    let (a, b) = (key(1), key(2));
    h.seed(&a);
    let requests = h.client.stats().requests;
    let dup: [&[u8]; 3] = [&a, &b, &a];
    let errs = [
        h.tier.reserve_read(&dup, ONE).unwrap_err(),
        h.tier
            .reserve_write(&dup, &[false; 3], CHUNK, WriteMode::New)
            .unwrap_err(),
        h.tier.finish_read(&dup, ONE).unwrap_err(),
        h.tier.finish_write(&dup).unwrap_err(),
        h.tier.finish_write_and_reserve_read(&dup, ONE).unwrap_err(),
        h.tier.delete(&dup, false).unwrap_err(),
        h.tier.unsafe_read(&dup).unwrap_err(),
        h.tier.touch_keys(&dup).unwrap_err(),
    ];
    for e in &errs {
        assert!(
            matches!(
                e,
                TierError::DuplicateKey {
                    index: 2,
                    first_index: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.is_argument_error());
    }
    assert_eq!(h.client.stats().requests, requests, "no round trip");
    assert_eq!(h.stage(&a), KeyStage::Untracked);
    assert_eq!(h.pins(), 0);
}

#[test]
fn keys_and_flags_of_different_lengths_are_an_argument_error() {
    let h = harness("len");
    let (a, b) = (key(1), key(2));
    let e = h
        .tier
        .reserve_write(&[&a, &b], &[true], CHUNK, WriteMode::New)
        .unwrap_err();
    assert!(
        matches!(
            e,
            TierError::LengthMismatch {
                keys: 2,
                flags: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(h.stage(&a), KeyStage::Untracked);
}

#[test]
fn empty_and_oversized_keys_and_chunks_are_argument_errors() {
    let h = harness("arg");
    let long = vec![b'x'; 513];
    assert!(matches!(
        h.tier.reserve_read(&[b"".as_slice()], ONE).unwrap_err(),
        TierError::KeyLength { index: 0, .. }
    ));
    assert!(matches!(
        h.tier.delete(&[long.as_slice()], false).unwrap_err(),
        TierError::KeyLength { len_bytes: 513, .. }
    ));
    for len in [0, PAGE as usize + 1] {
        assert!(matches!(
            h.tier
                .reserve_write(&[key(1)], &[false], len, WriteMode::New)
                .unwrap_err(),
            TierError::ChunkLength { .. }
        ));
    }
}

/// A listener that calls back into its own tier (and into another one).
struct Reentrant {
    own: Weak<L1Tier>,
    other: Weak<L1Tier>,
    seen: parking_lot::Mutex<Vec<String>>,
}

impl Listener for Reentrant {
    fn reserved_write(&self, keys: &[&[u8]]) {
        let (Some(own), Some(other)) = (self.own.upgrade(), self.other.upgrade()) else {
            return;
        };
        let mut seen = self.seen.lock();
        seen.push(match own.reserve_read(keys, ONE) {
            Err(TierError::Reentrant { op }) => format!("reentrant {op}"),
            other => format!("unexpected {other:?}"),
        });
        seen.push(match own.close() {
            Err(TierError::Reentrant { op }) => format!("reentrant {op}"),
            other => format!("unexpected {other:?}"),
        });
        seen.push(format!("touch {}", own.touch_keys(keys).is_ok()));
        seen.push(format!("evictable {}", own.is_key_evictable(keys[0])));
        seen.push(format!(
            "other tier {}",
            other.reserve_read(keys, ONE).is_ok()
        ));
    }
}

#[test]
fn a_listener_calling_back_into_its_tier_gets_an_error_never_a_deadlock() {
    let h = harness("reent");
    let other_layout = h.client.layout(PAGE, FINGERPRINT + 1).unwrap();
    let own = Arc::new(L1Tier::new(h.layout.clone(), TierConfig::default()).unwrap());
    let other = Arc::new(L1Tier::new(other_layout, TierConfig::default()).unwrap());
    let l = Arc::new(Reentrant {
        own: Arc::downgrade(&own),
        other: Arc::downgrade(&other),
        seen: Default::default(),
    });
    own.register_listener(Arc::clone(&l) as Arc<dyn Listener>)
        .unwrap();
    let k = key(7);
    let r = own
        .reserve_write(&[&k], &[false], CHUNK, WriteMode::New)
        .unwrap();
    assert!(r[0].is_success());
    assert_eq!(
        *l.seen.lock(),
        vec![
            "reentrant reserve_read".to_owned(),
            "reentrant close".to_owned(),
            "touch true".to_owned(),
            "evictable false".to_owned(),
            "other tier true".to_owned(),
        ]
    );
    own.check_invariants().unwrap();
    drop(l);
}

#[test]
fn listener_key_lists_follow_the_input_order_across_local_and_pinned_keys() {
    let h = harness("order");
    let (a, t, b) = (key(1), key(2), key(3));
    h.seed(&a);
    h.seed(&b);
    h.reserve(&[&t], true);
    h.promote(&[&t], ONE);
    h.listen();
    h.reserve_read(&[&b, &t, &a], ONE);
    assert_eq!(
        h.rec.kinds("reserved_read"),
        vec![vec![b.clone(), t.clone(), a.clone()]]
    );
    h.finish_read(&[&a, &t, &b], Holds::total(2));
    assert_eq!(h.rec.kinds("read_finished"), vec![vec![a, t.clone(), b]]);
    assert_eq!(
        h.rec.kinds("deleted"),
        vec![vec![t]],
        "the temporary reached zero"
    );
    h.healthy();
}

#[test]
fn finish_read_releases_its_pins_before_returning_so_a_peer_delete_succeeds() {
    let h = harness("sync");
    let k = key(1);
    h.write(&[&k]);
    h.reserve_read(&[&k], Holds::total(3));
    assert_eq!(
        h.peer.delete(&k).unwrap(),
        crate::client::DeleteOutcome::Pinned { pins: 3 }
    );
    h.finish_read(&[&k], Holds::total(3));
    assert_eq!(
        h.peer.delete(&k).unwrap(),
        crate::client::DeleteOutcome::Deleted,
        "no wait: the unpin was answered inside finish_read"
    );
    assert_eq!(h.tier.stats().unpin_round_trips, 1);
}

#[test]
fn written_pages_are_read_in_place_by_a_peer() {
    let h = harness("zc");
    let k = key(1);
    let w = page(&h.reserve(&[&k], false)[0]);
    h.tier.finish_write(&[&k]).unwrap();
    let g = h.peer.get(&k).unwrap().expect("registered");
    assert_eq!(&g[..], bytes_for(&k, CHUNK).as_slice());
    assert_eq!(
        g.location(),
        w.location(),
        "the peer reads the page the engine wrote"
    );
}

#[test]
fn close_is_idempotent_and_locked_calls_fail_afterwards() {
    let h = harness("close");
    let k = key(1);
    h.seed(&k);
    h.reserve_read(&[&k], ONE);
    h.reserve(&[&key(2)], false);
    let free = h.free_pages();
    h.listen();
    h.tier.close().unwrap();
    assert_eq!(h.pins(), 0, "close released every pin");
    assert_eq!(h.free_pages(), free + 1, "and every write page");
    assert!(h.rec.all().is_empty(), "close never notifies");
    h.tier.close().unwrap();
    assert!(matches!(
        h.tier.reserve_read(&[&k], ONE).unwrap_err(),
        TierError::Closed { .. }
    ));
    assert!(matches!(
        h.tier.touch_keys(&[&k]).unwrap_err(),
        TierError::Closed { .. }
    ));
    assert!(h.tier.is_key_evictable(&k));
}

/// Every operation of a tier whose client can no longer be used is
/// refused as a whole, as `refused` says, and nothing is notified or
/// published; the tier's own `close` still works.
fn every_call_is_refused(
    h: &Harness,
    keys: [&[u8]; 4],
    refused: fn(&TierError) -> bool,
    why: &str,
) {
    fn check<T: std::fmt::Debug>(
        op: &str,
        r: Result<T, TierError>,
        refused: fn(&TierError) -> bool,
        why: &str,
    ) {
        match r {
            Err(e) if refused(&e) => {}
            other => panic!("{op} {why}: {other:?}"),
        }
    }
    let [held, staged, other, new] = keys;
    let t = &h.tier;
    check(
        "reserve_read",
        t.reserve_read(&[held, other], ONE),
        refused,
        why,
    );
    check("unsafe_read", t.unsafe_read(&[held]), refused, why);
    check("finish_read", t.finish_read(&[held], ONE), refused, why);
    let r = t.reserve_write(&[new], &[false], CHUNK, WriteMode::New);
    check("reserve_write", r, refused, why);
    check("finish_write", t.finish_write(&[staged]), refused, why);
    let r = t.finish_write_and_reserve_read(&[staged], ONE);
    check("finish_write_and_reserve_read", r, refused, why);
    check("delete", t.delete(&[other], false), refused, why);
    check("touch_keys", t.touch_keys(&[held]), refused, why);
    check("clear", t.clear(false), refused, why);
    check("clear(force)", t.clear(true), refused, why);
    let r = t.register_listener(Arc::clone(&h.rec) as Arc<dyn Listener>);
    check("register_listener", r, refused, why);
    check("report_status", t.report_status(), refused, why);
    check("inspect", t.inspect(held), refused, why);
    check("check_invariants", t.check_invariants(), refused, why);
    check("sweep_now", t.sweep_now(), refused, why);
    assert!(h.rec.all().is_empty(), "nothing was notified");
    assert!(h.bus.all().is_empty(), "nothing was published");
    t.close().expect("the tier's close still works");
    assert!(matches!(
        t.reserve_read(&[held], ONE).unwrap_err(),
        TierError::Closed { .. }
    ));
}

/// A tier with a key held by a read, one staged by a write, one stored, and
/// listeners registered: what `every_call_is_refused` runs on.
fn busy_tier(name: &str) -> (Harness, [Vec<u8>; 4]) {
    let h = harness(name);
    let (held, staged, other, new) = (key(1), key(2), key(3), key(4));
    h.seed(&held);
    h.seed(&other);
    h.reserve_read(&[&held], ONE);
    h.reserve(&[&staged], false);
    h.listen();
    h.bus.clear();
    (h, [held, staged, other, new])
}

/// Found by a review: after the client's close (the tier still open) each
/// operation read the client's `Closed` as a per-key answer —
/// `reserve_write` `OutOfMemory` for every key, `reserve_read`
/// `KeyNotExist`, `delete` `KeyIsLocked` (which a controller retries),
/// `finish_write` `KeyInWrongState` — where Python raised `ClosedError` and
/// C layouts answered `CLOSED`.
#[test]
fn after_the_clients_close_every_tier_call_is_refused_as_closed() {
    let (h, [a, b, c, d]) = busy_tier("client-closed");
    h.client.clone().close().unwrap();
    every_call_is_refused(
        &h,
        [&a, &b, &c, &d],
        |e| matches!(e, TierError::ClientClosed { .. }),
        "after the client's close",
    );
}

/// The same for a client whose instance cannot be resumed (a fatal refusal
/// at reattach: every request of it fails from then on, as after a close).
#[test]
fn once_the_client_cannot_be_resumed_every_tier_call_is_refused_as_failed() {
    let (h, [a, b, c, d]) = busy_tier("client-failed");
    h.tier
        .inner
        .layout
        .shared()
        .set_fatal(String::from("ownership not proven (test)"));
    every_call_is_refused(
        &h,
        [&a, &b, &c, &d],
        |e| matches!(e, TierError::ClientFailed { reason, .. } if reason.contains("ownership not proven")),
        "once the client cannot be resumed",
    );
}

/// Found by a review: a client closed while a tier call was under way —
/// after the call's own check, before its round trip — made the call read
/// the client's `Closed` as a per-key answer (`delete` `KeyIsLocked`,
/// `reserve_read` `KeyNotExist`, `reserve_write` `OutOfMemory`), having
/// already changed its staging (an idle temporary reclaimed, a hold taken).
/// The call is now refused as after the close, with nothing changed: the
/// round trip comes before the local changes. The same for a client whose
/// instance is found unresumable then.
#[test]
fn a_client_closed_during_a_call_refuses_the_call_with_nothing_changed() {
    type Call = fn(&L1Tier, &[u8], &[u8]) -> Result<(), TierError>;
    let calls: [(&str, Call); 3] = [
        ("delete", |t, temp, other| {
            t.delete(&[temp, other], false)
                .map(|r| panic!("delete answered {r:?}"))
        }),
        ("reserve_read", |t, temp, other| {
            t.reserve_read(&[temp, other], ONE)
                .map(|r| panic!("reserve_read answered {:?}", codes(&r)))
        }),
        ("reserve_write", |t, _, other| {
            t.reserve_write(&[other], &[false], CHUNK, WriteMode::New)
                .map(|r| panic!("reserve_write answered {:?}", codes(&r)))
        }),
    ];
    for (i, (op, call)) in calls.into_iter().enumerate() {
        for fatal in [false, true] {
            let h = harness(&format!("closed-during-{i}-{fatal}"));
            let (temp, other) = (key(1), key(2));
            if op != "reserve_write" {
                h.seed(&other);
            }
            // An idle private temporary: `delete` reclaims it locally,
            // `reserve_read` takes a hold on it locally.
            h.reserve(&[&temp], true);
            assert_eq!(
                h.tier.finish_write(&[&temp]).unwrap(),
                vec![TierCode::Success]
            );
            h.listen();
            h.bus.clear();
            let idle = h.stage(&temp);
            let client = h.client.clone();
            let shared = Arc::clone(h.tier.inner.layout.shared());
            *h.tier.inner.before_round_trip.lock() = Some(Box::new(move || {
                if fatal {
                    shared.set_fatal(String::from("ownership not proven (test)"));
                } else {
                    client.close().unwrap();
                }
            }));
            let err = call(&h.tier, &temp, &other).unwrap_err();
            let want = if fatal {
                matches!(err, TierError::ClientFailed { op: o, .. } if o == op)
            } else {
                matches!(err, TierError::ClientClosed { op: o } if o == op)
            };
            assert!(want, "{op} (fatal: {fatal}): {err:?}");
            let st = h.tier.inner.state.lock();
            assert_eq!(st.stage_of(&temp), idle, "{op}: the temporary unchanged");
            assert_eq!(st.stage_of(&other), KeyStage::Untracked, "{op}");
            drop(st);
            assert!(h.rec.all().is_empty(), "{op}: nothing was notified");
            assert!(h.bus.all().is_empty(), "{op}: nothing was published");
            h.tier.close().expect("the tier's close still works");
        }
    }
}

#[test]
fn the_unlocked_queries_answer_none_as_the_spec_says() {
    let h = harness("none");
    assert!(h.tier.get_l1_memory_desc().is_none());
    assert!(h.tier.get_object_state(key(1)).is_none());
    assert!(h.tier.memcheck());
}

/// Decision 3 on an idle completed temporary (`finish_write` of a
/// temporary, no hold yet): `unsafe_read` answers `KeyNotReadable`, it is
/// not evictable (it is in `R`), and `report_status` counts it as staged and
/// temporary but not read-locked (holds 0); once held, it is read-locked.
#[test]
fn decision_3_an_idle_completed_temporary_is_not_readable_evictable_or_read_locked() {
    let h = harness("d3");
    let temp = key(31);
    h.reserve(&[&temp], true);
    assert_eq!(
        h.tier.finish_write(&[&temp]).unwrap(),
        vec![TierCode::Success]
    );
    assert_eq!(h.unsafe_read(&[&temp])[0].code, TierCode::KeyNotReadable);
    assert!(!h.tier.is_key_evictable(&temp));
    let s = h.tier.report_status().unwrap();
    assert_eq!(
        (s.total_object_count, s.read_locked_count, s.temporary_count),
        (1, 0, 1)
    );
    assert_eq!(
        codes(&h.reserve_read(&[&temp], ONE)),
        vec![TierCode::Success]
    );
    assert_eq!(h.unsafe_read(&[&temp])[0].code, TierCode::Success);
    assert_eq!(h.tier.report_status().unwrap().read_locked_count, 1);
    h.healthy();
}

/// A listener whose `accessed` runs until the test releases it.
struct SlowAccess {
    entered: Mutex<mpsc::Sender<()>>,
    release: Mutex<mpsc::Receiver<()>>,
    returned: AtomicBool,
}

impl Listener for SlowAccess {
    fn accessed(&self, _keys: &[&[u8]]) {
        self.entered.lock().send(()).expect("the test waits for it");
        self.release
            .lock()
            .recv_timeout(Duration::from_secs(30))
            .expect("the test releases the listener");
        self.returned.store(true, Ordering::SeqCst);
    }
}

/// Found by an audit of the C ABI: `touch_keys` checked that the tier was
/// open, then called the `accessed` listeners without any lock, so a
/// `close` on another thread returned while one was still running — after
/// which a C caller may free the callback's `user_data` (docs/c-api.md:
/// tier callbacks need stay valid only until `cxlkv_tier_close` returns).
#[test]
fn close_waits_for_the_accessed_listeners_that_touch_keys_is_calling() {
    let h = harness("close-touch");
    let (entered, entered_rx) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let l = Arc::new(SlowAccess {
        entered: Mutex::new(entered),
        release: Mutex::new(release_rx),
        returned: AtomicBool::new(false),
    });
    let tier = Arc::new(L1Tier::new(h.layout.clone(), TierConfig::default()).unwrap());
    tier.register_listener(Arc::clone(&l) as Arc<dyn Listener>)
        .unwrap();
    let touching = {
        let tier = Arc::clone(&tier);
        std::thread::spawn(move || tier.touch_keys(&[key(1)]))
    };
    entered_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("accessed is called");
    let (closed, closed_rx) = mpsc::channel();
    let closing = {
        let (tier, l) = (Arc::clone(&tier), Arc::clone(&l));
        std::thread::spawn(move || {
            let r = tier.close();
            closed
                .send(l.returned.load(Ordering::SeqCst))
                .expect("the test waits for close");
            r
        })
    };
    // A close that did not wait returns within this (it has nothing to
    // wait for: the sweeper stops at once, the staging is empty).
    assert_eq!(
        closed_rx.recv_timeout(Duration::from_millis(500)),
        Err(mpsc::RecvTimeoutError::Timeout),
        "close returned while a listener was running"
    );
    release.send(()).unwrap();
    let listener_had_returned = closed_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("close returns once the listener has");
    assert!(listener_had_returned);
    touching.join().unwrap().unwrap();
    closing.join().unwrap().unwrap();
    assert!(matches!(
        tier.touch_keys(&[key(1)]).unwrap_err(),
        TierError::Closed { .. }
    ));
}

/// An `accessed` listener that closes its own tier.
struct ClosesOnAccess {
    own: OnceLock<Weak<L1Tier>>,
    seen: Mutex<Vec<String>>,
}

impl Listener for ClosesOnAccess {
    fn accessed(&self, _keys: &[&[u8]]) {
        let Some(own) = self.own.get().and_then(Weak::upgrade) else {
            return;
        };
        self.seen.lock().push(match own.close() {
            Err(TierError::Reentrant { op }) => format!("reentrant {op}"),
            other => format!("unexpected {other:?}"),
        });
    }
}

#[test]
fn an_accessed_listener_closing_its_own_tier_gets_an_error_never_a_deadlock() {
    let h = harness("close-in-accessed");
    let tier = Arc::new(L1Tier::new(h.layout.clone(), TierConfig::default()).unwrap());
    let l = Arc::new(ClosesOnAccess {
        own: OnceLock::new(),
        seen: Mutex::new(Vec::new()),
    });
    l.own.set(Arc::downgrade(&tier)).unwrap();
    tier.register_listener(Arc::clone(&l) as Arc<dyn Listener>)
        .unwrap();
    tier.touch_keys(&[key(1)]).unwrap();
    assert_eq!(*l.seen.lock(), vec!["reentrant close".to_owned()]);
    tier.close().unwrap();
}

/// A clock that tells, once armed, when the sweeper thread reads it: the
/// sweeper is then inside a sweep, about to take the tier's lock.
#[derive(Debug, Default)]
struct SweepSignal {
    time: ManualClock,
    armed: Mutex<Option<mpsc::Sender<()>>>,
}

impl Clock for SweepSignal {
    fn now(&self) -> Duration {
        if std::thread::current().name() == Some("cxlkv-l1-sweeper")
            && let Some(tx) = self.armed.lock().take()
        {
            let _ = tx.send(());
        }
        self.time.now()
    }
}

/// A listener that, under the tier's lock, lets the sweeper block on that
/// lock, has another thread close the tier (which joins the sweeper), and
/// then asks `sweeper_running`.
struct AsksSweeperWhileClosing {
    tier: OnceLock<Weak<L1Tier>>,
    clock: Arc<SweepSignal>,
    /// What `sweeper_running` answered, or `None` if it did not answer in
    /// time.
    answer: Mutex<Option<Option<bool>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Listener for AsksSweeperWhileClosing {
    fn reserved_write(&self, _keys: &[&[u8]]) {
        let Some(tier) = self.tier.get().and_then(Weak::upgrade) else {
            return;
        };
        let (tx, sweeping) = mpsc::channel();
        *self.clock.armed.lock() = Some(tx);
        sweeping
            .recv_timeout(Duration::from_secs(10))
            .expect("the sweeper sweeps within its interval");
        let closer = Arc::clone(&tier);
        self.threads.lock().push(std::thread::spawn(move || {
            closer.close().expect("close");
        }));
        // Until close has the sweeper: it holds the sweeper's lock, or has
        // taken the sweeper out of it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(tier.sweeper.is_locked() || tier.sweeper.try_lock().is_some_and(|s| s.is_none())) {
            assert!(Instant::now() < deadline, "close never took the sweeper");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Asked from a helper, so that a deadlock shows as no answer.
        let (tx, answer) = mpsc::channel();
        let asker = Arc::clone(&tier);
        self.threads.lock().push(std::thread::spawn(move || {
            let _ = tx.send(asker.sweeper_running());
        }));
        *self.answer.lock() = Some(answer.recv_timeout(Duration::from_secs(3)).ok());
    }
}

/// Found by an audit: `close` held the sweeper's lock while it joined the
/// sweeper thread. A listener asking `sweeper_running` (under the tier's
/// lock) then waited for `close`, `close` for the sweeper, and the sweeper
/// for the tier's lock: three threads deadlocked.
#[test]
fn sweeper_running_from_a_listener_does_not_deadlock_a_concurrent_close() {
    let h = harness("close-sweeper");
    let clock = Arc::new(SweepSignal::default());
    let cfg = TierConfig {
        // The shortest sweep interval (1 s).
        write_ttl: Duration::from_secs(4),
        read_ttl: Duration::from_secs(4),
        clock: Arc::clone(&clock) as Arc<dyn Clock>,
        events: None,
    };
    assert_eq!(cfg.sweep_interval(), crate::tier::MIN_SWEEP_INTERVAL);
    let tier = Arc::new(L1Tier::new(h.layout.clone(), cfg).unwrap());
    let l = Arc::new(AsksSweeperWhileClosing {
        tier: OnceLock::new(),
        clock,
        answer: Mutex::new(None),
        threads: Mutex::new(Vec::new()),
    });
    l.tier.set(Arc::downgrade(&tier)).unwrap();
    tier.register_listener(Arc::clone(&l) as Arc<dyn Listener>)
        .unwrap();
    let r = tier
        .reserve_write(&[key(1)], &[false], CHUNK, WriteMode::New)
        .unwrap();
    assert!(r[0].is_success());
    for t in std::mem::take(&mut *l.threads.lock()) {
        t.join().unwrap();
    }
    assert_eq!(
        *l.answer.lock(),
        Some(Some(false)),
        "sweeper_running answered (no sweeper: close took it)"
    );
}
