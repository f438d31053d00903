//! Sessions follow connections: a closed connection or an expired lease
//! releases the session's pins; an owner that stays away past its grace
//! period leaves its keys readable, and its region goes back to the pool with
//! the last of them. On both transport backends.

mod common;

use std::time::Duration;

use common::*;
use cxlkv::server::Server;
use cxlkv_controlplane::proto::{self, DeleteOutcome, ErrorCode};

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn a_closed_connection_releases_its_pins() {
    for backend in backends() {
        let server = Server::start(config_on("closepins", backend)).unwrap();
        let (mut owner, reader) = owner_and_reader(&server, 2);
        assert_eq!(
            owner.delete(&[b"k"]).unwrap().outcomes,
            vec![DeleteOutcome::Pinned { pins: 2 }]
        );
        drop(reader);
        assert!(
            wait_until(WAIT, || server.directory_stats().unwrap().pins == 0),
            "{backend:?}: pins released when the connection closed"
        );
        assert_eq!(
            owner.delete(&[b"k"]).unwrap().outcomes,
            vec![DeleteOutcome::Deleted],
            "{backend:?}"
        );
        server.shutdown().unwrap();
    }
}

#[test]
fn an_expired_lease_releases_pins_and_closes_the_connection() {
    for backend in backends() {
        let mut cfg = config_on("lease", backend);
        cfg.directory.session_lease = Duration::from_millis(300);
        cfg.tick_ms = 20;
        let server = Server::start(cfg).unwrap();
        let (mut owner, region) = session_with_region(&server, "owner");
        owner
            .register(vec![(b"k".to_vec(), loc(region, 0))])
            .unwrap();
        let mut reader = Raw::connect_unix(server.socket_path());
        reader.hello("silent").0.unwrap();
        reader.lookup(&[b"k"], 1).unwrap();
        // The owner keeps its lease; the reader goes quiet.
        assert!(
            wait_until(WAIT, || {
                owner.heartbeat().unwrap();
                server.directory_stats().unwrap().pins == 0
            }),
            "{backend:?}"
        );
        assert!(
            wait_until(WAIT, || gone(&reader)),
            "{backend:?}: the expired session's connection is closed"
        );
        let stats = server.directory_stats().unwrap();
        assert_eq!(stats.outcomes.sessions_expired, 1, "{backend:?}");
        server.shutdown().unwrap();
    }
}

#[test]
fn keys_of_a_gone_owner_stay_readable_and_its_region_is_freed_with_the_last() {
    for backend in backends() {
        let mut cfg = config_on("gone", backend);
        cfg.directory.instance_grace = Duration::from_millis(200);
        cfg.tick_ms = 20;
        let server = Server::start(cfg).unwrap();
        let (mut owner, region) = session_with_region(&server, "owner");
        owner
            .register(vec![
                (b"a".to_vec(), loc(region, 0)),
                (b"b".to_vec(), loc(region, 1)),
            ])
            .unwrap();
        drop(owner);
        assert!(
            wait_until(WAIT, || server.directory_stats().unwrap().orphaned_regions
                == 1),
            "{backend:?}: the owner's region waits for its keys"
        );
        let mut reader = Raw::connect_unix(server.socket_path());
        reader.hello("reader").0.unwrap();
        let found = reader.lookup(&[b"a", b"b"], 0).unwrap();
        assert_eq!(
            found.locations,
            vec![Some(loc(region, 0)), Some(loc(region, 1))],
            "{backend:?}"
        );
        reader.delete(&[b"a"]).unwrap();
        assert_eq!(server.directory_stats().unwrap().regions, 1, "{backend:?}");
        reader.delete(&[b"b"]).unwrap();
        let stats = server.directory_stats().unwrap();
        assert_eq!(stats.regions, 0, "{backend:?}: freed with its last key");
        assert_eq!(stats.outcomes.regions_freed, 1, "{backend:?}");
        // The pool manager has the region back: a new one fits where it was.
        let (_c, again) = session_with_region(&server, "next");
        assert!(again > region, "{backend:?}: region ids are never reused");
        let report = server.shutdown().unwrap();
        assert_eq!(report.frees_unconfirmed, 0, "{backend:?}");
    }
}

/// Regions large beside their pool: seven of 16 MiB fill a 128 MiB pool
/// to 88.9 %, below the 90 % mark, and the eighth does not fit. The
/// refusal starts orphan eviction (down to the low mark), so the next
/// request finds room where a gone owner's keys were — it used to be
/// refused for as long as they stayed (reliability 196).
#[test]
fn a_region_refused_for_want_of_space_evicts_orphaned_keys_so_the_next_one_fits() {
    const REGION: u64 = 16 << 20;
    for backend in backends() {
        let mut cfg = config_on("no-space", backend);
        cfg.pool_size_bytes = 128 << 20;
        cfg.directory.instance_grace = Duration::from_millis(200);
        cfg.tick_ms = 20;
        let server = Server::start(cfg).unwrap();
        let mut owner = Raw::connect_unix(server.socket_path());
        owner.hello("owner").0.unwrap();
        let mut held = 0u8;
        while let Ok(granted) = owner.request_region(REGION) {
            owner
                .register(vec![(vec![b'k', held], loc(granted.desc.region, 0))])
                .unwrap();
            held += 1;
        }
        assert!(held >= 2, "{backend:?}: {held} regions fit");
        drop(owner);
        assert!(
            wait_until(WAIT, || server.directory_stats().unwrap().orphaned_regions
                == u64::from(held)),
            "{backend:?}: the owner's regions are orphaned"
        );
        std::thread::sleep(Duration::from_millis(200));
        let stats = server.directory_stats().unwrap();
        assert_eq!(
            (stats.keys, stats.evictions.orphan_keys),
            (u64::from(held), 0),
            "{backend:?}: below the watermark, nothing is evicted on its own"
        );
        let mut next = Raw::connect_unix(server.socket_path());
        next.hello("next").0.unwrap();
        expect_code(next.request_region(REGION), ErrorCode::OutOfSpace);
        assert!(
            wait_until(WAIT, || server
                .directory_stats()
                .unwrap()
                .outcomes
                .regions_freed
                >= 1),
            "{backend:?}: the refusal evicts the oldest orphaned region"
        );
        next.request_region(REGION)
            .expect("room where the orphaned keys were");
        let report = server.shutdown().unwrap();
        assert_eq!(report.frees_unconfirmed, 0, "{backend:?}");
    }
}

#[test]
fn an_admin_can_end_a_session_which_releases_its_pins() {
    let server = Server::start(config_on("admin", backends()[0])).unwrap();
    let (mut owner, region) = session_with_region(&server, "owner");
    owner
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let mut reader = Raw::connect_unix(server.socket_path());
    let welcome = reader.hello("reader").0.unwrap();
    reader.lookup(&[b"k"], 1).unwrap();
    let meta = owner.rw();
    let ended: proto::SessionEnded = owner
        .call(&proto::EndSession {
            meta,
            session_id: welcome.session_id,
        })
        .unwrap();
    assert_eq!(ended.pins_released, 1);
    assert_eq!(server.directory_stats().unwrap().pins, 0);
    assert!(
        wait_until(WAIT, || gone(&reader)),
        "the ended session's connection is closed"
    );
}

/// Found by a review of the protocol (session 23): `EndSession` skipped
/// the reply window, so a retry of the same `seq` (its reply lost) got
/// `SessionEnded` — which a client takes for the end of its own session —
/// and so did an admin naming a session that was not live.
#[test]
fn a_retried_end_session_gets_its_first_answer_and_an_unknown_target_is_invalid() {
    let server = Server::start(config_on("end-retry", backends()[0])).unwrap();
    let (mut admin, region) = session_with_region(&server, "admin");
    admin
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let mut victim = Raw::connect_unix(server.socket_path());
    let session_id = victim.hello("victim").0.unwrap().session_id;
    victim.lookup(&[b"k"], 2).unwrap();
    let msg = proto::EndSession {
        meta: admin.rw(),
        session_id,
    };
    let first: proto::SessionEnded = admin.call(&msg).unwrap();
    assert_eq!(first.pins_released, 2);
    let again: proto::SessionEnded = admin.call(&msg).expect("the cached answer");
    assert_eq!(again.pins_released, 2, "the first answer, not a second run");
    let unknown = proto::EndSession {
        meta: admin.rw(),
        session_id: session_id + 1000,
    };
    expect_code(
        admin.call::<_, proto::SessionEnded>(&unknown),
        ErrorCode::InvalidArgument,
    );
    assert_eq!(
        admin.delete(&[b"k"]).unwrap().outcomes,
        vec![DeleteOutcome::Deleted],
        "the admin's own session lives on"
    );
}

/// Same review: the name given to an anonymous instance was
/// `anon-<epoch>-<counter>`, both in every client's own welcome, so a
/// client could take the next one first and make the next anonymous hello
/// fail with `InstanceInUse`.
#[test]
fn an_anonymous_instance_name_cannot_be_taken_first() {
    let server = Server::start(config_on("anon", backends()[0])).unwrap();
    let p = server.socket_path();
    let first = Raw::connect_unix(p).hello("").0.unwrap();
    assert!(
        first.instance_id.starts_with("anon-"),
        "{}",
        first.instance_id
    );
    let squatter = Raw::connect_unix(p);
    let guess = format!("anon-{:x}-2", first.directory_epoch);
    squatter.hello(&guess).0.unwrap();
    let next = Raw::connect_unix(p)
        .hello("")
        .0
        .expect("an anonymous hello never collides");
    assert_ne!(next.instance_id, guess);
    assert_ne!(next.instance_id, first.instance_id);
}

/// Same review: `MapRegion` took up to the protocol's 4096 ids whatever
/// batch limit the directory announced.
#[test]
fn map_region_keeps_to_the_announced_batch_limit() {
    let mut cfg = config_on("map-batch", backends()[0]);
    cfg.directory.max_batch = 64;
    let server = Server::start(cfg).unwrap();
    let (c, region) = session_with_region(&server, "m");
    let over = c.call::<_, proto::RegionMap>(&proto::MapRegion {
        meta: c.ro(),
        regions: (0..65).collect(),
    });
    expect_code(over, ErrorCode::BatchTooLarge);
    let at: proto::RegionMap = c
        .call(&proto::MapRegion {
            meta: c.ro(),
            regions: (region..region + 64).collect(),
        })
        .unwrap();
    assert_eq!(at.descs.len(), 64);
}

#[test]
fn shutdown_closes_every_live_session_and_counts_them() {
    for backend in backends() {
        let server = Server::start(config_on("shutdown", backend)).unwrap();
        let (owner, reader) = owner_and_reader(&server, 1);
        // A connection without a session is closed too, but is no session.
        let _anonymous = Raw::connect_unix(server.socket_path());
        assert!(wait_until(WAIT, || server
            .transport_stats()
            .is_some_and(|s| s.accepted - s.disconnected == 3)));
        let report = server.shutdown().unwrap();
        assert_eq!(report.sessions_closed, 2, "{backend:?}");
        assert_eq!(report.frees_unconfirmed, 0, "{backend:?}");
        assert!(
            wait_until(WAIT, || gone(&owner) && gone(&reader)),
            "{backend:?}: the clients see their connections closed"
        );
    }
}

/// Two sessions: `owner` registered key `k`, `reader` holds `pins` on it.
fn owner_and_reader(server: &cxlkv::server::ServerHandle, pins: u32) -> (Raw, Raw) {
    let (mut owner, region) = session_with_region(server, "owner");
    owner
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let mut reader = Raw::connect_unix(server.socket_path());
    reader.hello("reader").0.unwrap();
    reader.lookup(&[b"k"], pins).unwrap();
    (owner, reader)
}

/// The server closed the connection, or refuses the session.
fn gone(c: &Raw) -> bool {
    if c.rpc.is_closed() {
        return true;
    }
    match c.try_call::<_, proto::HeartbeatReply>(
        &proto::Heartbeat { meta: c.ro() },
        Duration::from_secs(1),
    ) {
        None => true,
        Some(Err(e)) => {
            assert_eq!(e.error_code(), Some(ErrorCode::SessionEnded), "{e:?}");
            true
        }
        Some(Ok(_)) => false,
    }
}
