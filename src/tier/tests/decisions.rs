//! The decisions of `l1-tier.md` on the reference's open points, and the
//! promises that do not need a fault to show.

use std::sync::{Arc, Weak};

use super::*;
use crate::tier::TierError;

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

#[test]
fn the_unlocked_queries_answer_none_as_the_spec_says() {
    let h = harness("none");
    assert!(h.tier.get_l1_memory_desc().is_none());
    assert!(h.tier.get_object_state(key(1)).is_none());
    assert!(h.tier.memcheck());
}
