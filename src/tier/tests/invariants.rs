//! The debug-build assertions of I3, I5, I6 and I7 are not vacuous: each
//! test puts the tier into the state a bug would leave (through the
//! `corrupt_as` hook, under the tier's lock, as if it were the named
//! operation) and sees the assertion fire when the lock is released — and
//! after `touch_keys` and `close`, which assert too. Debug builds only (the
//! assertions are compiled out of release builds).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use super::*;
use crate::tier::events::Callback;

const ONE: Holds = Holds::ONE;

/// Runs `f`, which must panic, and returns the panic's message.
fn tripped(f: impl FnOnce()) -> String {
    let payload = catch_unwind(AssertUnwindSafe(f)).expect_err("the invariant assertion fires");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

impl Harness {
    /// The state is corrupt from here on: the teardown must not assert.
    fn stop_asserting(&self) {
        // Relaxed: read by this thread only.
        self.tier
            .inner
            .skip_invariant_assert
            .store(true, Ordering::Relaxed);
    }

    fn resume_asserting(&self) {
        // Relaxed: read by this thread only.
        self.tier
            .inner
            .skip_invariant_assert
            .store(false, Ordering::Relaxed);
    }

    /// A private temporary promoted with one hold (`TempHeld(1)`: no pin,
    /// so only the hold accounting can catch a wrong hold count).
    fn held_temporary(&self, key: &[u8]) {
        self.reserve(&[key], true);
        assert!(self.promote(&[key], ONE)[0].is_success());
    }
}

#[test]
fn i3_a_hold_no_operation_reported_trips_the_assertion() {
    let h = harness("inv-i3");
    let key = key(3);
    h.held_temporary(&key);
    h.healthy();
    let msg = tripped(|| {
        h.tier
            .inner
            .corrupt_as("reserve_read", |_, st| st.add_unreported_holds(&key, 1))
    });
    assert!(
        msg.contains("I3") && msg.contains("after reserve_read"),
        "{msg}"
    );
    h.stop_asserting();
}

#[test]
fn i3_is_asserted_after_touch_keys_and_after_close() {
    let h = harness("inv-i3-unlocked");
    let key = key(33);
    h.held_temporary(&key);
    h.stop_asserting();
    h.tier
        .inner
        .corrupt_as("reserve_read", |_, st| st.add_unreported_holds(&key, 2));
    h.resume_asserting();
    let msg = tripped(|| {
        let _ = h.tier.touch_keys(&[&key]);
    });
    assert!(
        msg.contains("I3") && msg.contains("after touch_keys"),
        "{msg}"
    );
    // `close` drains the staging: the unreported holds leave with their
    // entry, and the tally still does not add up.
    let msg = tripped(|| {
        let _ = h.tier.close();
    });
    assert!(msg.contains("I3") && msg.contains("after close"), "{msg}");
    h.stop_asserting();
}

#[test]
fn i5_write_finished_from_a_promote_trips_the_assertion() {
    let h = harness("inv-i5-promote");
    let key = key(5);
    h.reserve(&[&key], false);
    let msg = tripped(|| {
        h.tier
            .inner
            .corrupt_as("finish_write_and_reserve_read", |inner, st| {
                inner.fire(st, Callback::WriteFinished, &[&key]);
            })
    });
    assert!(msg.contains("I5"), "{msg}");
    // The event alone (no callback) is caught too, even with no keys.
    let msg = tripped(|| {
        h.tier
            .inner
            .corrupt_as("finish_write_and_reserve_read", |inner, st| {
                inner.publish(st, TierEvent::WriteFinished, &[]);
            })
    });
    assert!(msg.contains("I5"), "{msg}");
    h.stop_asserting();
}

#[test]
fn i5_write_finished_for_a_temporary_or_an_unconfirmed_key_trips_the_assertion() {
    let h = harness("inv-i5-temp");
    let (temp, other) = (key(51), key(52));
    h.reserve(&[&temp], true);
    assert_eq!(
        h.tier.finish_write(&[&temp]).unwrap(),
        vec![TierCode::Success]
    );
    assert_eq!(
        h.stage(&temp),
        KeyStage::ReadStaged {
            holds: 0,
            pinned: 0,
            temporary: true
        }
    );
    // A temporary completion reported as a write-through, even if the
    // record claims the directory confirmed it.
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("finish_write", |inner, st| {
            st.audit.registered(&temp);
            inner.fire(st, Callback::WriteFinished, &[&temp]);
        })
    });
    assert!(msg.contains("I5"), "{msg}");
    // A key this call never registered.
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("finish_write", |inner, st| {
            inner.publish(st, TierEvent::WriteFinished, &[&other]);
        })
    });
    assert!(msg.contains("I5"), "{msg}");
    h.stop_asserting();
}

#[test]
fn i6_deleted_for_a_key_still_held_or_kept_by_the_directory_trips_the_assertion() {
    let h = harness("inv-i6");
    let (held, kept) = (key(6), key(61));
    h.seed(&held);
    h.seed(&kept);
    assert!(h.reserve_read(&[&held], ONE)[0].is_success());
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("delete", |inner, st| {
            inner.fire(st, Callback::Deleted, &[&held]);
        })
    });
    assert!(msg.contains("I6"), "{msg}");
    // Untracked here, but the directory did not delete it in this call.
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("delete", |inner, st| {
            inner.publish(st, TierEvent::KeysEvicted, &[&kept]);
        })
    });
    assert!(msg.contains("I6"), "{msg}");
    h.stop_asserting();
}

#[test]
fn the_sweeper_notifying_anyone_trips_the_assertion() {
    let h = harness("inv-sweep");
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("sweep", |inner, st| {
            inner.fire(st, Callback::Deleted, &[]);
        })
    });
    assert!(msg.contains("silent reclaim"), "{msg}");
    h.stop_asserting();
}

#[test]
fn i7_a_free_page_of_unknown_registration_outcome_trips_the_assertion() {
    let h = harness("inv-i7");
    // A page the tier handed to a registration of unknown outcome, still
    // allocated (kept by the client): the check passes.
    let kept = h.layout.alloc().expect("alloc");
    let location = kept.location();
    h.tier.inner.corrupt_as("finish_write", |inner, st| {
        inner.note_unknown_outcomes(st, &[location]);
    });
    h.healthy();
    // The same page back in the allocator before the client could have
    // learned the outcome: what I7 forbids.
    drop(kept);
    let msg = tripped(|| {
        h.tier.inner.corrupt_as("finish_write", |inner, st| {
            inner.note_unknown_outcomes(st, &[location]);
        })
    });
    assert!(msg.contains("I7"), "{msg}");
    h.stop_asserting();
}
