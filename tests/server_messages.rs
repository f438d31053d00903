//! Every client ↔ directory message kind makes a round trip through the real
//! server on both transport backends, with the reply kind and content the
//! protocol specifies; and a payload that fails checked access is answered
//! with `Malformed` on its connection, which stays usable, while another
//! client keeps being served and nothing changes.
//!
//! (The pool-manager kinds make theirs through the `cxlkv pool` daemon in
//! `controlplane`'s pool tests and `tests/pool_daemon.rs`.)

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use cxlkv::server::Server;
use cxlkv_controlplane::frame::{FrameHeader, HEADER_BYTES, encode_frame, frame_len};
use cxlkv_controlplane::proto::{self, ErrorCode, Kind, RegisterOutcome};

#[test]
fn every_directory_message_kind_round_trips_through_the_server_on_both_backends() {
    for backend in backends() {
        let server = Server::start(config_on("kinds", backend)).unwrap();
        let mut seen = Vec::new();

        // Hello → Welcome (with the pool's descriptor on a Unix socket).
        let mut c = Raw::connect_unix(server.socket_path());
        let (welcome, fds) = c.hello("every-kind");
        let welcome = welcome.expect("welcome");
        assert!(!welcome.pools.is_empty(), "{backend:?}: pools in Welcome");
        assert_eq!(
            fds.len(),
            welcome.pools.len(),
            "{backend:?}: one fd per pool"
        );
        seen.push(Kind::Hello);

        // Heartbeat → HeartbeatReply.
        let hb = c.heartbeat().expect("heartbeat");
        assert!(hb.lease_ms > 0);
        seen.push(Kind::Heartbeat);

        // RequestRegion → RegionGranted.
        let granted = c.request_region(0).expect("region");
        let region = granted.desc.region;
        seen.push(Kind::RequestRegion);

        // MapRegion → RegionMap: ours is described, an unknown one is not.
        let map: proto::RegionMap = c
            .call(&proto::MapRegion {
                meta: c.ro(),
                regions: vec![region, 999_999],
            })
            .expect("region map");
        assert_eq!(map.descs.len(), 2);
        assert_eq!(map.descs[0].as_ref().map(|d| d.region), Some(region));
        assert!(
            map.descs[1].is_none(),
            "{backend:?}: unknown region described"
        );
        seen.push(Kind::MapRegion);

        // Register → RegisterReply.
        let reg = c
            .register(vec![(b"k".to_vec(), loc(region, 0))])
            .expect("register");
        assert_eq!(reg.outcomes, vec![RegisterOutcome::Inserted]);
        seen.push(Kind::Register);

        // Exists → ExistsReply.
        let ex = c.exists(&[b"k", b"missing"]).expect("exists");
        assert_eq!(
            (ex.present.get(0), ex.present.get(1)),
            (Some(true), Some(false))
        );
        seen.push(Kind::Exists);

        // Lookup → LookupReply (with a pin), Unpin → UnpinReply.
        let lk = c.lookup(&[b"k"], 1).expect("lookup");
        assert_eq!(lk.locations.iter().flatten().count(), 1);
        assert_eq!(server.directory_stats().unwrap().pins, 1);
        seen.push(Kind::Lookup);
        c.unpin(&[b"k"]).expect("unpin");
        assert_eq!(server.directory_stats().unwrap().pins, 0);
        seen.push(Kind::Unpin);

        // Stats → StatsReply.
        let stats: proto::StatsReply = c
            .call(&proto::Stats {
                meta: c.ro(),
                sections: proto::sections::ALL,
                max_rows: 16,
            })
            .expect("stats");
        assert!(
            stats.ops.iter().any(|o| o.kind == Kind::Lookup.as_u16()),
            "{backend:?}: lookups counted"
        );
        seen.push(Kind::Stats);

        // Delete → DeleteReply.
        let del = c.delete(&[b"k"]).expect("delete");
        assert_eq!(del.outcomes, vec![proto::DeleteOutcome::Deleted]);
        seen.push(Kind::Delete);

        // ReturnRegion → RegionReturned (the region is empty now).
        let meta = c.rw();
        let returned: proto::RegionReturned = c
            .call(&proto::ReturnRegion { meta, region })
            .expect("return region");
        assert_eq!(returned.region, region);
        seen.push(Kind::ReturnRegion);

        // Reattach → Reattached, on a second connection of the instance.
        let c2 = Raw::connect_unix(server.socket_path());
        let reattached: proto::Reattached = c2
            .call(&reattach_msg(
                "every-kind",
                welcome.instance_secret,
                vec![],
                c.next_seq,
            ))
            .expect("reattach");
        assert!(reattached.resumed, "{backend:?}: the instance resumed");
        seen.push(Kind::Reattach);

        // EndSession → SessionEnded (an admin ends the first session).
        let meta = c.rw();
        let ended: proto::SessionEnded = c2
            .call(&proto::EndSession {
                meta,
                session_id: welcome.session_id,
            })
            .expect("end session");
        assert_eq!(ended.session_id, welcome.session_id);
        seen.push(Kind::EndSession);

        let mut directory_kinds: Vec<Kind> = Kind::ALL
            .into_iter()
            .filter(|k| k.is_request() && k.service() == Some(proto::Service::Directory))
            .collect();
        directory_kinds.sort();
        seen.sort();
        assert_eq!(seen, directory_kinds, "{backend:?}: every directory kind");
        server.shutdown().unwrap();
    }
}

#[test]
fn a_payload_failing_checked_access_is_malformed_and_the_connection_and_others_go_on() {
    for backend in backends() {
        let server = Server::start(config_on("malformed", backend)).unwrap();
        let (mut other, region) = session_with_region(&server, "bystander");
        other
            .register(vec![(b"k".to_vec(), loc(region, 0))])
            .unwrap();
        let before = state_of(&server.directory_stats().unwrap());

        let mut s = UnixStream::connect(server.socket_path()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // A Lookup whose payload is not an archived Lookup: bytes that claim
        // a relative pointer far outside the buffer.
        let garbage = [0xFFu8; 64];
        let mut frame = Vec::new();
        encode_frame(&mut frame, Kind::Lookup.as_u16(), 5, &garbage).unwrap();
        s.write_all(&frame).unwrap();
        let (kind, code) = read_reply(&mut s, 5);
        assert_eq!(kind, Kind::ErrorReply.as_u16(), "{backend:?}");
        assert_eq!(code, Some(ErrorCode::Malformed), "{backend:?}");
        // Meanwhile, and after, the other client is served.
        assert_eq!(other.exists(&[b"k"]).unwrap().present.get(0), Some(true));
        // The connection that sent it goes on: a valid Heartbeat on it is
        // answered (HelloRequired: it never said Hello), not dropped.
        let hb = encode_payload(&proto::Heartbeat {
            meta: proto::RequestMeta::default(),
        });
        let mut frame = Vec::new();
        encode_frame(&mut frame, Kind::Heartbeat.as_u16(), 6, &hb).unwrap();
        s.write_all(&frame).unwrap();
        let (_, code) = read_reply(&mut s, 6);
        assert_eq!(code, Some(ErrorCode::HelloRequired), "{backend:?}");
        assert_eq!(
            state_of(&server.directory_stats().unwrap()),
            before,
            "{backend:?}: a malformed payload changed the directory"
        );
        server.shutdown().unwrap();
    }
}

/// Reads frames until the reply to `request_id`: its kind and, for an
/// error reply, its code.
fn read_reply(s: &mut UnixStream, request_id: u64) -> (u16, Option<ErrorCode>) {
    loop {
        let mut h = [0u8; HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let header = FrameHeader::decode(&h).unwrap();
        let len = header.payload_len as usize;
        let mut rest = vec![0u8; frame_len(len) - HEADER_BYTES];
        s.read_exact(&mut rest).unwrap();
        if header.request_id != request_id {
            continue;
        }
        if header.kind != Kind::ErrorReply.as_u16() {
            return (header.kind, None);
        }
        // An 8-aligned copy for checked access.
        let mut words = vec![0u64; len.div_ceil(8)];
        // SAFETY: `words` has room for `len` bytes; u64 accepts any bytes.
        let aligned = unsafe {
            std::ptr::copy_nonoverlapping(rest.as_ptr(), words.as_mut_ptr().cast::<u8>(), len);
            std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len)
        };
        let frame = cxlkv_controlplane::frame::Frame {
            header,
            payload: aligned,
        };
        let e = proto::access::<proto::ErrorReply>(frame).unwrap();
        let e = proto::deserialize::<proto::ErrorReply>(e).unwrap();
        return (header.kind, e.error_code());
    }
}
