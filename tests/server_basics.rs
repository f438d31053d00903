//! The in-process server answers the whole key lifecycle over its Unix
//! socket: hello (with the pool descriptor), a region, register, lookup
//! with a pin, exists, unpin, delete, heartbeat; and what it does with a
//! socket file already where it is to listen.

mod common;

use common::*;
use cxlkv::server::{Server, ServerConfig, ServerError};
use cxlkv_controlplane::proto::{self, DeleteOutcome, ErrorCode, RegisterOutcome, UnpinOutcome};

#[test]
fn a_client_runs_the_key_lifecycle_over_the_unix_socket() {
    let server = Server::start(ServerConfig::ephemeral("basics")).unwrap();
    let mut c = Raw::connect_unix(server.socket_path());
    let (welcome, fds) = c.hello("inst-a");
    let welcome = welcome.unwrap();
    assert_eq!(welcome.instance_id, "inst-a");
    assert_eq!(welcome.pools.len(), 1);
    assert_eq!(welcome.fds_passed, 1);
    assert_eq!(fds.len(), 1, "the pool descriptor comes with Welcome");
    assert_eq!(
        std::path::Path::new(&welcome.pools[0].path),
        server.pool_paths()[0]
    );

    let granted = c.request_region(0).unwrap();
    assert_eq!(granted.layout, LAYOUT);
    let region = granted.desc.region;

    let reply = c
        .register(vec![
            (b"k1".to_vec(), loc(region, 0)),
            (b"k2".to_vec(), loc(region, 1)),
        ])
        .unwrap();
    assert_eq!(
        reply.outcomes,
        vec![RegisterOutcome::Inserted, RegisterOutcome::Inserted]
    );
    let found = c.lookup(&[b"k1", b"nope"], 1).unwrap();
    assert_eq!(found.locations, vec![Some(loc(region, 0)), None]);
    assert_eq!(found.regions.len(), 1);
    let present = c.exists(&[b"k1", b"k2", b"nope"]).unwrap();
    assert_eq!(
        (0..3).map(|i| present.present.get(i)).collect::<Vec<_>>(),
        vec![Some(true), Some(true), Some(false)]
    );

    let deleted = c.delete(&[b"k1", b"k2", b"nope"]).unwrap();
    assert_eq!(
        deleted.outcomes,
        vec![
            DeleteOutcome::Pinned { pins: 1 },
            DeleteOutcome::Deleted,
            DeleteOutcome::Missing
        ]
    );
    // The owner hears of its freed page.
    assert_eq!(deleted.meta.notices.len(), 1);
    assert_eq!(deleted.meta.notices[0].page, 1);
    let unpinned = c.unpin(&[b"k1", b"k1"]).unwrap();
    assert_eq!(
        unpinned.outcomes,
        vec![UnpinOutcome::Unpinned, UnpinOutcome::NotPinned]
    );
    c.heartbeat().unwrap();

    let stats: proto::StatsReply = c
        .call(&proto::Stats {
            meta: c.ro(),
            sections: proto::sections::ALL,
            max_rows: 16,
        })
        .unwrap();
    assert_eq!(stats.totals.keys, 1, "k1 is left");
    assert_eq!(stats.totals.sessions, 1);
    assert_eq!(stats.totals.regions, 1);
    assert_eq!(stats.outcomes.inserted, 2);
    assert_eq!(stats.outcomes.delete_pinned, 1);
    assert_eq!(stats.instances.len(), 1);
    assert_eq!(stats.instances[0].instance_id, "inst-a");
    assert_eq!(stats.sessions.len(), 1);
    assert_eq!(stats.sessions[0].pid, std::process::id());
    assert_eq!(stats.regions.len(), 1);
    assert_eq!(stats.regions[0].region, region);
    assert_eq!(stats.regions[0].keys, 1);
    let lookups = stats
        .ops
        .iter()
        .find(|o| o.kind == proto::Kind::Lookup.as_u16())
        .unwrap();
    assert_eq!((lookups.requests, lookups.items), (1, 2));
    assert_eq!(
        lookups.latency.count, 1,
        "the server records each call's latency"
    );
    // A `Stats` request renews the session but counts as a stats request
    // only: the heartbeat row holds the one heartbeat, with its latency.
    let op = |kind: proto::Kind| {
        let o = stats.ops.iter().find(|o| o.kind == kind.as_u16()).unwrap();
        (o.requests, o.latency.count)
    };
    assert_eq!(op(proto::Kind::Heartbeat), (1, 1));
    assert_eq!(op(proto::Kind::Stats).0, 1);

    let other = Raw::connect_unix(server.socket_path());
    expect_code(other.heartbeat(), ErrorCode::HelloRequired);
    drop(c);
    drop(other);
    let socket = server.socket_path().to_owned();
    let pool = server.pool_paths()[0].clone();
    let report = server.shutdown().unwrap();
    assert_eq!(report.frees_unconfirmed, 0);
    assert!(!socket.exists(), "the socket file is removed");
    assert!(!pool.exists(), "an ephemeral pool is removed");
}

/// A socket file where the server is to listen: replaced if nobody listens
/// on it (left by a server that died), refused if a server answers on it,
/// and left alone if a listener accepts but does not answer (a stalled
/// server, or another program's socket given by mistake) — removing it
/// would cut that listener's clients off.
#[test]
fn an_existing_socket_is_replaced_only_when_nobody_listens_on_it() {
    let cfg = ServerConfig::ephemeral("sock-reuse");
    let path = cfg.socket_path.clone();
    // Stale: bound, then the listener gone; the file stays.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let first = Server::start(cfg.clone()).expect("a stale socket is replaced");
    // Answering: a second server on the same socket is refused — before it
    // creates its pool (a server review, session 23: a refused start left
    // a pool file and state directory of its own behind).
    let mut second = ServerConfig::ephemeral("sock-reuse-2");
    second.socket_path = path.clone();
    second.remove_pool_on_shutdown = false;
    let second_pool = second.pool_path.clone();
    let e = Server::start(second).map(|_| ()).unwrap_err();
    assert!(matches!(e, ServerError::AlreadyRunning { .. }), "{e}");
    assert!(!second_pool.exists(), "the refused server created its pool");
    let mut state = second_pool.into_os_string();
    state.push(".state");
    assert!(
        !std::path::Path::new(&state).exists(),
        "the refused server created its pool manager's state directory"
    );
    drop(first);

    // Silent: a listener that never accepts (connecting still succeeds).
    let silent = ServerConfig::ephemeral("sock-reuse-3");
    let listener = std::os::unix::net::UnixListener::bind(&silent.socket_path).unwrap();
    let e = Server::start(silent.clone())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not answer"), "{e}");
    assert!(
        std::os::unix::net::UnixStream::connect(&silent.socket_path).is_ok(),
        "the other listener's socket is still there"
    );
    drop(listener);
    let _ = std::fs::remove_file(&silent.socket_path);
}
