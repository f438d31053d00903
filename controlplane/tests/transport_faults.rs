//! Every fault-injection mode, on every backend (feature `fault-injection`).
#![cfg(feature = "fault-injection")]

mod transport_common;

use std::time::Duration;

use cxlkv_controlplane::transport::ClientError;
use cxlkv_controlplane::transport::fault::{FaultScript, ReplyMatch};
use transport_common::*;

fn start_faulty(backend: Backends, script: &FaultScript) -> Fixture {
    let plan = script.clone();
    start_with(backend, server_config(backend), move |s| {
        s.set_fault_plan(Box::new(plan))
    })
}

#[test]
fn a_dropped_reply_times_out_only_that_request() {
    for backend in backends() {
        let script = FaultScript::new().drop_reply(ReplyMatch::request_kind(ECHO).nth(3));
        let f = start_faulty(backend, &script);
        let c = f.client(&f.unix);
        for i in 1..=5u8 {
            let r = c.call(
                ECHO,
                &[i],
                Duration::from_millis(if i == 3 { 100 } else { 20_000 }),
            );
            if i == 3 {
                assert!(matches!(r, Err(ClientError::Timeout { .. })), "{r:?}");
            } else {
                assert_eq!(r.unwrap().payload(), &[i]);
            }
        }
        assert_eq!(script.fired(0), 1);
    }
}

#[test]
fn delayed_replies_arrive_late_but_intact() {
    for backend in backends() {
        let script = FaultScript::new().delay_replies(ReplyMatch::any(), Duration::from_millis(30));
        let f = start_faulty(backend, &script);
        let c = f.client(&f.tcp);
        // A deadline shorter than the delay expires; a longer one succeeds.
        assert!(matches!(
            c.call(ECHO, b"short", Duration::from_millis(1)),
            Err(ClientError::Timeout { .. })
        ));
        assert_eq!(c.call(ECHO, b"long", LONG).unwrap().payload(), b"long");
        assert!(script.fired(0) >= 2);
    }
}

#[test]
fn a_duplicated_reply_is_delivered_once_and_the_copy_counted_late() {
    for backend in backends() {
        let script = FaultScript::new().duplicate_reply(ReplyMatch::request_kind(ECHO).nth(1));
        let f = start_faulty(backend, &script);
        let c = f.client(&f.unix);
        assert_eq!(c.call(ECHO, b"once", LONG).unwrap().payload(), b"once");
        assert_eq!(c.call(ECHO, b"twice?", LONG).unwrap().payload(), b"twice?");
        assert_eq!(
            c.stats()
                .late_replies
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }
}

#[test]
fn a_reordered_reply_arrives_after_its_successor_and_both_match() {
    for backend in backends() {
        let script = FaultScript::new().reorder_reply(ReplyMatch::request_kind(ECHO).nth(1));
        let f = start_faulty(backend, &script);
        let c = f.client(&f.unix);
        let first = c.start(ECHO, b"first", LONG).unwrap();
        f.wait_until("the first request", |_| script.fired(0) == 1);
        let second = c.start(ECHO, b"second", LONG).unwrap();
        assert_eq!(second.wait().unwrap().payload(), b"second");
        assert_eq!(first.wait().unwrap().payload(), b"first");
        assert_eq!(c.call(ECHO, b"normal", LONG).unwrap().payload(), b"normal");
    }
}

#[test]
fn a_held_reply_with_no_successor_is_released_after_a_bound() {
    for backend in backends() {
        let script = FaultScript::new().reorder_reply(ReplyMatch::any().nth(1));
        let f = start_faulty(backend, &script);
        let c = f.client(&f.tcp);
        assert_eq!(c.call(ECHO, b"alone", LONG).unwrap().payload(), b"alone");
        assert_eq!(script.fired(0), 1);
    }
}

#[test]
fn a_reset_on_reply_fails_pending_calls_and_the_next_connection_works() {
    for backend in backends() {
        for tcp in [false, true] {
            let script = FaultScript::new().reset_on_reply(ReplyMatch::request_kind(ECHO).nth(2));
            let f = start_faulty(backend, &script);
            let ep = if tcp { &f.tcp } else { &f.unix };
            let c = f.client(ep);
            c.call(ECHO, b"ok", LONG).unwrap();
            let err = c.call(ECHO, b"boom", LONG).unwrap_err();
            assert!(matches!(err, ClientError::Closed { .. }), "{err:?}");
            assert!(c.is_closed());
            assert_eq!(script.fired(0), 1);
            let c = f.client(ep);
            assert_eq!(c.call(ECHO, b"fresh", LONG).unwrap().payload(), b"fresh");
        }
    }
}

#[test]
fn reset_after_n_frames_serves_n_then_closes() {
    for backend in backends() {
        let script = FaultScript::new().reset_connection_at_frame(4);
        let f = start_faulty(backend, &script);
        for ep in f.endpoints() {
            let c = f.client(ep);
            for i in 0..3u8 {
                assert_eq!(c.call(ECHO, &[i], LONG).unwrap().payload(), &[i]);
            }
            assert!(matches!(
                c.call(ECHO, b"4th", LONG),
                Err(ClientError::Closed { .. })
            ));
        }
        assert_eq!(script.fired(0), 2);
        assert!(f.server.stats().faults_applied >= 2);
    }
}
