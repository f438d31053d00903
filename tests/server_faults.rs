//! The directory's exactly-once and notice guarantees through the real
//! transport, with replies lost by the transport's fault hook.

#![cfg(feature = "fault-injection")]

mod common;

use std::time::Duration;

use common::*;
use cxlkv::server::{Server, ServerConfig};
use cxlkv_controlplane::proto::{self, DeleteOutcome, Kind, RegisterOutcome};
use cxlkv_controlplane::transport::fault::{FaultScript, ReplyMatch};

/// Long enough for any reply on a loaded machine to arrive; a dropped one
/// never does.
const LOST: Duration = Duration::from_millis(500);

#[test]
fn a_retried_register_whose_reply_was_dropped_gets_its_original_reply() {
    let script =
        FaultScript::new().drop_reply(ReplyMatch::request_kind(Kind::Register.as_u16()).nth(1));
    let server =
        Server::start_with_faults(ServerConfig::ephemeral("retry"), Box::new(script.clone()))
            .unwrap();
    let (mut c, region) = session_with_region(&server, "writer");
    let msg = proto::Register {
        meta: c.rw(),
        layout: LAYOUT,
        entries: vec![proto::RegisterEntry {
            key: b"k".to_vec(),
            location: loc(region, 0),
        }],
    };
    assert!(
        c.try_call::<_, proto::RegisterReply>(&msg, LOST).is_none(),
        "the first reply is lost"
    );
    assert_eq!(script.fired(0), 1);
    // The same request, same seq: the original answer, not a second run
    // (which would say Duplicate).
    let retry: proto::RegisterReply = c.call(&msg).unwrap();
    assert_eq!(retry.outcomes, vec![RegisterOutcome::Inserted]);
    let fresh = c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    assert_eq!(
        fresh.outcomes,
        vec![RegisterOutcome::Duplicate(loc(region, 0))]
    );
    let stats = server.directory_stats().unwrap();
    assert_eq!(stats.keys, 1);
    assert_eq!(stats.outcomes.retries_answered, 1);
    assert_eq!(stats.outcomes.inserted, 1, "registered once");
}

#[test]
fn a_retried_pinning_lookup_whose_reply_was_dropped_pins_once() {
    let script = FaultScript::new();
    let server = Server::start_with_faults(
        ServerConfig::ephemeral("pinretry"),
        Box::new(script.clone()),
    )
    .unwrap();
    let (mut c, region) = session_with_region(&server, "reader");
    c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    let _ = script
        .clone()
        .drop_reply(ReplyMatch::request_kind(Kind::Lookup.as_u16()).nth(1));
    let msg = proto::Lookup {
        meta: c.rw(),
        layout: LAYOUT,
        keys: vec![b"k".to_vec()],
        pins: 1,
    };
    assert!(c.try_call::<_, proto::LookupReply>(&msg, LOST).is_none());
    let retry: proto::LookupReply = c.call(&msg).unwrap();
    assert_eq!(retry.locations, vec![Some(loc(region, 0))]);
    let deleted = c.delete(&[b"k"]).unwrap();
    assert_eq!(deleted.outcomes, vec![DeleteOutcome::Pinned { pins: 1 }]);
    assert_eq!(server.directory_stats().unwrap().pins, 1);
}

#[test]
fn freed_page_notices_survive_a_dropped_reply() {
    let script = FaultScript::new();
    let server =
        Server::start_with_faults(ServerConfig::ephemeral("notice"), Box::new(script.clone()))
            .unwrap();
    let (mut owner, region) = session_with_region(&server, "owner");
    owner
        .register(vec![(b"k".to_vec(), loc(region, 3))])
        .unwrap();
    let mut other = Raw::connect_unix(server.socket_path());
    other.hello("deleter").0.unwrap();
    assert_eq!(
        other.delete(&[b"k"]).unwrap().outcomes,
        vec![DeleteOutcome::Deleted]
    );
    // The owner's next reply, which carries the notice, is lost.
    let _ = script
        .clone()
        .drop_reply(ReplyMatch::request_kind(Kind::Heartbeat.as_u16()).nth(1));
    let hb = proto::Heartbeat { meta: owner.ro() };
    assert!(
        owner
            .try_call::<_, proto::HeartbeatReply>(&hb, LOST)
            .is_none()
    );
    let again = owner.heartbeat().unwrap();
    assert_eq!(
        again.meta.notices,
        vec![proto::FreedPage {
            seq: 1,
            region,
            page: 3,
            generation: 1
        }],
        "the notice is sent again"
    );
    owner.notice_ack = 1;
    assert!(
        owner.heartbeat().unwrap().meta.notices.is_empty(),
        "acknowledged: not sent again"
    );
}

#[test]
fn a_reset_connection_ends_its_session_and_a_reattach_gets_the_cached_reply() {
    let script = FaultScript::new();
    let server = Server::start_with_faults(
        ServerConfig::ephemeral("reattach"),
        Box::new(script.clone()),
    )
    .unwrap();
    let mut c = Raw::connect_unix(server.socket_path());
    let welcome = c.hello("resumer").0.unwrap();
    let granted = c.request_region(0).unwrap();
    let region = granted.desc.region;
    let _ = script
        .clone()
        .reset_on_reply(ReplyMatch::request_kind(Kind::Register.as_u16()).nth(1));
    let msg = proto::Register {
        meta: c.rw(),
        layout: LAYOUT,
        entries: vec![proto::RegisterEntry {
            key: b"k".to_vec(),
            location: loc(region, 0),
        }],
    };
    assert!(c.try_call::<_, proto::RegisterReply>(&msg, LOST).is_none());
    assert!(wait_until(Duration::from_secs(5), || server
        .directory_stats()
        .unwrap()
        .sessions
        == 0));
    // A new connection of the same instance, then the same request again.
    let c2 = Raw::connect_unix(server.socket_path());
    let reattached: proto::Reattached = c2
        .call(&reattach_msg(
            "resumer",
            welcome.instance_secret,
            vec![owned(&granted)],
            c.next_seq,
        ))
        .unwrap();
    assert!(reattached.resumed);
    assert_eq!(reattached.accepted, vec![region]);
    let retry: proto::RegisterReply = c2.call(&msg).unwrap();
    assert_eq!(retry.outcomes, vec![RegisterOutcome::Inserted]);
    assert_eq!(server.directory_stats().unwrap().outcomes.inserted, 1);
}
