//! The server's request paths, as a review of `src/server/` (session 25)
//! found them wanting: configurations the server accepted and then did not
//! honour, connections that held a slot without ever opening a session,
//! retried replies that differed from the first, a shutdown that expired
//! instances, and answers missing from the latency counts.

mod common;
mod pool_support;

use cxlkv::server::{ServerConfig, ServerError};

/// A configuration `validate` must refuse, with a message containing each
/// of `needles`.
#[track_caller]
fn refused(cfg: &ServerConfig, needles: &[&str]) {
    let err = cfg.validate().expect_err("refused");
    let m = err.to_string();
    for n in needles {
        assert!(m.contains(n), "{n:?} not in {m:?}");
    }
}

/// A TCP secret with `tcp_insecure_no_secret` was accepted by the Rust
/// API, and the directory then asked TCP peers for no secret at all (the
/// configuration file already refused the pair).
#[test]
fn a_tcp_secret_with_insecure_no_secret_is_refused_not_silently_unenforced() {
    let mut cfg = ServerConfig::ephemeral("secret-and-insecure");
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.tcp_secret = Some(b"sesame".to_vec());
    cfg.tcp_insecure_no_secret = true;
    refused(
        &cfg,
        &["tcp_secret", "tcp_insecure_no_secret", "not be enforced"],
    );
    let err = cxlkv::server::Server::start(cfg.clone())
        .map(drop)
        .unwrap_err();
    assert!(matches!(err, ServerError::Config(_)), "{err}");
    cfg.tcp_insecure_no_secret = false;
    cfg.validate().unwrap();
    cfg.tcp_secret = None;
    cfg.tcp_insecure_no_secret = true;
    cfg.validate().unwrap();
}

/// More notices per response than the protocol's maximum made every reply
/// to an owner with that long a backlog one its client refuses.
#[test]
fn notices_per_response_over_the_protocols_maximum_is_refused() {
    let max = cxlkv_controlplane::proto::MAX_NOTICES_PER_REPLY;
    let mut cfg = ServerConfig::ephemeral("notices-per-response");
    cfg.directory.notices_per_response = max + 1;
    refused(
        &cfg,
        &["notices_per_response = 1025", "MAX_NOTICES_PER_REPLY"],
    );
    assert!(cfg.directory.validate().is_err());
    cfg.directory.notices_per_response = max;
    cfg.validate().unwrap();
}

/// The `RequestRegion` row of the directory's statistics: (calls, latency
/// samples).
fn region_requests(server: &cxlkv::server::ServerHandle) -> (u64, u64) {
    let st = server.directory_stats().unwrap();
    let row = st
        .ops
        .iter()
        .find(|o| o.op == cxlkv_controlplane::directory::OpKind::RequestRegion)
        .expect("a request_region row");
    (row.counters.calls, row.latency.count)
}

/// `RequestRegion`s answered at once — a retry answered from the reply
/// cache, a refusal — never reached the latency histograms (only answers
/// that waited for the pool manager did), though their counts are per
/// request received.
#[test]
fn region_requests_answered_at_once_are_counted_in_the_latency_histograms() {
    use common::*;
    use cxlkv_controlplane::proto::{self, ErrorCode};
    let server = cxlkv::server::Server::start(ServerConfig::ephemeral("region-latency")).unwrap();
    let mut c = Raw::connect_unix(server.socket_path());
    c.hello("inst-a").0.unwrap();
    let meta = c.rw();
    let ask = proto::RequestRegion {
        meta,
        layout: LAYOUT,
        len_bytes: 0,
    };
    let first: proto::RegionGranted = c.call(&ask).unwrap();
    assert_eq!(
        region_requests(&server),
        (1, 1),
        "granted by the pool manager"
    );
    // The reply was "lost": the same request again, answered from the
    // directory's reply cache.
    let again: proto::RegionGranted = c.call(&ask).unwrap();
    assert_eq!(again.desc, first.desc);
    // Refused at once: over the largest region a request may take.
    let meta = c.rw();
    expect_code(
        c.call::<_, proto::RegionGranted>(&proto::RequestRegion {
            meta,
            layout: LAYOUT,
            len_bytes: 1 << 50,
        }),
        ErrorCode::InvalidArgument,
    );
    let (calls, samples) = region_requests(&server);
    assert_eq!(calls, 3);
    assert_eq!(samples, calls, "one latency sample per request received");
    // The `/metrics` histograms are recorded alongside the directory's.
    server.shutdown().unwrap();
}

/// The shutdown's wait for frees in flight ran the directory's timers: with
/// a short grace, an instance whose session the shutdown had just closed
/// expired during the wait and its region was freed, so its client — which
/// still maps it — was refused that region when it reattached to the
/// restarted server.
#[test]
fn the_shutdown_wait_for_frees_does_not_expire_the_instances_it_disconnected() {
    use common::*;
    use cxlkv::server::{PoolManagerConfig, Server};
    use cxlkv_controlplane::pool::service::RemoteConfig;
    use cxlkv_controlplane::proto;
    use cxlkv_controlplane::transport::Endpoint;
    use std::time::{Duration, Instant};

    let dir = pool_support::shm_dir("shutdown-wait");
    let mut daemon = pool_support::Daemon::start(&pool_support::DaemonSpec::new(dir.path()));
    let config = |grace: Duration| {
        let mut cfg = ServerConfig::ephemeral("shutdown-wait");
        cfg.directory_id = "shutdown-wait".into();
        cfg.pool_manager = Some(PoolManagerConfig::Remote(RemoteConfig::new(
            Endpoint::Unix(daemon.spec.socket()),
            "shutdown-wait",
        )));
        cfg.directory.instance_grace = grace;
        cfg.tick_ms = 10;
        cfg
    };
    let server = Server::start(config(cxlkv::server::MIN_INSTANCE_GRACE)).unwrap();
    let (a, region_a) = {
        let mut a = Raw::connect_unix(server.socket_path());
        let welcome = a.hello("inst-a").0.unwrap();
        let granted = a.request_region(0).unwrap();
        ((a, welcome), granted)
    };
    let (mut b, region_b) = session_with_region(&server, "inst-b");

    // The pool manager stops answering: B's returned region is a free in
    // flight when the server shuts down.
    let pid = daemon.pid() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let meta = b.rw();
    let _: proto::RegionReturned = b
        .call(&proto::ReturnRegion {
            meta,
            region: region_b,
        })
        .unwrap();
    // It answers again well after the grace has run out, while the
    // shutdown still waits for that free.
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(800));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    });
    let started = Instant::now();
    let report = server.shutdown().unwrap();
    resume.join().unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "waited for the free"
    );
    assert_eq!(report.frees_unconfirmed, 0, "{report:?}");
    drop(b);

    // A's client still maps its region: the restarted server accepts it.
    let server = Server::start(config(Duration::from_secs(30))).unwrap();
    let (a, welcome) = a;
    drop(a);
    let again = Raw::connect_unix(server.socket_path());
    let reattached: proto::Reattached = again
        .call(&reattach_msg(
            "inst-a",
            welcome.instance_secret,
            vec![owned(&region_a)],
            1,
        ))
        .unwrap();
    assert_eq!(
        reattached.accepted,
        vec![region_a.desc.region],
        "{reattached:?}"
    );
    assert!(reattached.refused.is_empty(), "{reattached:?}");
    server.shutdown().unwrap();
    daemon.kill();
}
