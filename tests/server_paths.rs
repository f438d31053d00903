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

/// Found by the same review: the server admitted every connection and
/// never closed one that opened no session, with one `max_connections`
/// for all listeners — so `max_connections` silent TCP peers, without the
/// secret, had every later client, Unix ones included, refused `Busy`.
/// Now TCP connections without a session take at most half the slots, and
/// any connection without a session is closed at the hello deadline.
#[test]
fn silent_tcp_peers_cannot_take_the_unix_clients_slots_and_are_closed_at_the_hello_deadline() {
    use common::*;
    use cxlkv_controlplane::proto::ErrorCode;
    use cxlkv_controlplane::transport::Endpoint;
    use std::io::Read;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    for backend in backends() {
        let mut cfg = config_on("hello-deadline", backend);
        cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.tcp_secret = Some(b"sesame".to_vec());
        cfg.max_connections = 4;
        cfg.hello_timeout_ms = 1000;
        cfg.tick_ms = 20;
        let server = cxlkv::server::Server::start(cfg).unwrap();
        let addr = server.tcp_addr().unwrap();
        let opened = Instant::now();
        let silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let seen = |s: &cxlkv::server::ServerHandle| {
            let t = s.transport_stats().unwrap();
            t.accepted + t.refused
        };
        assert!(wait_until(TIMEOUT, || seen(&server) >= 4), "{backend:?}");
        let t = server.transport_stats().unwrap();
        assert_eq!(
            (t.accepted, t.refused),
            (2, 2),
            "{backend:?}: half the slots"
        );

        // Before the deadline, with the silent peers still connected: a
        // Unix client gets a session.
        let unix = Raw::connect_unix(server.socket_path());
        unix.hello("inst-unix")
            .0
            .expect("welcome while silent TCP peers wait");
        assert!(
            opened.elapsed() < Duration::from_millis(1000),
            "{backend:?}: too slow to tell"
        );

        // Every silent connection ends: refused ones after their `busy`,
        // admitted ones at the deadline.
        for mut s in silent {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut sink = Vec::new();
            match s.read_to_end(&mut sink) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                Err(e) => panic!("{backend:?}: a silent connection stayed open: {e}"),
            }
        }
        // A TCP peer that talks but never opens a session is closed too.
        let talker = Raw::connect(&Endpoint::Tcp(addr));
        let heartbeat = |r: &Raw, within: Duration| {
            r.try_call::<_, cxlkv_controlplane::proto::HeartbeatReply>(
                &cxlkv_controlplane::proto::Heartbeat { meta: r.ro() },
                within,
            )
        };
        expect_code(
            heartbeat(&talker, TIMEOUT).expect("an answer"),
            ErrorCode::HelloRequired,
        );
        assert!(
            wait_until(TIMEOUT, || heartbeat(&talker, Duration::from_secs(1))
                .is_none()),
            "{backend:?}: a connection answered HelloRequired forever stayed open"
        );

        // After the deadline: a TCP client with the secret opens a session
        // and keeps it past the deadline; the Unix session is untouched.
        let tcp = Raw::connect(&Endpoint::Tcp(addr));
        tcp.hello_with_secret("inst-tcp", Some(b"sesame"))
            .0
            .expect("welcome over TCP");
        std::thread::sleep(Duration::from_millis(1200));
        tcp.heartbeat()
            .expect("a session outlives the hello deadline");
        unix.heartbeat().expect("the Unix session is intact");
        server.shutdown().unwrap();
    }
}

/// Peers connecting and closing in a loop, each before its hello deadline,
/// leave no trail: the deadline queue is compacted once it outgrows twice
/// the connections (the handler asserts the bound in debug builds, on
/// every accept — the first version kept an entry per accept for the
/// whole timeout), and the count of sessionless TCP connections the
/// admission limit reads comes back down as they go (checked against a
/// walk of the connections at every accept, in debug builds): the limit
/// still admits new peers afterwards.
#[test]
fn connection_churn_before_the_hello_deadline_leaves_no_trail() {
    use common::*;
    use cxlkv_controlplane::transport::Endpoint;
    use std::net::TcpStream;
    use std::os::unix::net::UnixStream;

    let mut cfg = config_on("hello-churn", backends()[0]);
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.tcp_secret = Some(b"sesame".to_vec());
    cfg.max_connections = 8;
    cfg.hello_timeout_ms = 600_000;
    let server = cxlkv::server::Server::start(cfg).unwrap();
    let addr = server.tcp_addr().unwrap();
    let seen = |s: &cxlkv::server::ServerHandle| s.transport_stats().unwrap().accepted;
    for round in 0..100u64 {
        drop(UnixStream::connect(server.socket_path()).unwrap());
        drop(TcpStream::connect(addr).unwrap());
        // Closed before the next: at most one of each is live at a time.
        assert!(
            wait_until(TIMEOUT, || {
                let t = server.transport_stats().unwrap();
                t.accepted == 2 * (round + 1) && t.disconnected == t.accepted
            }),
            "round {round}: {:?}",
            server.transport_stats().unwrap()
        );
    }
    assert_eq!(seen(&server), 200);
    // The sessionless TCP count went back to 0: a full half of the slots
    // is still there for new peers, and one of them opens a session.
    let peers: Vec<Raw> = (0..4).map(|_| Raw::connect(&Endpoint::Tcp(addr))).collect();
    let (welcome, _) = peers[3].hello_with_secret("inst-after-churn", Some(b"sesame"));
    welcome.expect("the fourth sessionless TCP peer is still admitted");
    server.shutdown().unwrap();
}

/// A retried `Delete` (its reply lost) was answered with the pins held at
/// the retry, not those the delete found: after the pins were released,
/// `Pinned { pins: 0 }` — the reply cache kept only the outcome.
#[test]
fn a_retried_delete_reports_the_pins_the_delete_found() {
    use common::*;
    use cxlkv_controlplane::proto::{self, DeleteOutcome};
    let server = cxlkv::server::Server::start(ServerConfig::ephemeral("delete-retry")).unwrap();
    let (mut owner, region) = session_with_region(&server, "owner");
    owner
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let mut reader = Raw::connect_unix(server.socket_path());
    reader.hello("reader").0.unwrap();
    reader.lookup(&[b"k"], 2).unwrap();

    let meta = owner.rw();
    let delete = proto::Delete {
        meta,
        layout: LAYOUT,
        keys: vec![b"k".to_vec()],
    };
    let first: proto::DeleteReply = owner.call(&delete).unwrap();
    assert_eq!(first.outcomes, vec![DeleteOutcome::Pinned { pins: 2 }]);
    // The reader lets go; the owner, which never saw the reply, retries.
    let meta = reader.rw();
    let _: proto::UnpinReply = reader
        .call(&proto::Unpin {
            meta,
            layout: LAYOUT,
            keys: vec![b"k".to_vec()],
            counts: vec![2],
        })
        .unwrap();
    let retried: proto::DeleteReply = owner.call(&delete).unwrap();
    assert_eq!(
        retried.outcomes, first.outcomes,
        "the retry gets the first reply"
    );
    let st = server.directory_stats().unwrap();
    assert_eq!(st.outcomes.retries_answered, 1);
    assert_eq!(st.keys, 1, "the retry deleted nothing");
    server.shutdown().unwrap();
}

/// The value of the unlabelled gauge `name` in the server's `/metrics`.
fn metrics_gauge(addr: std::net::SocketAddr, name: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a complete answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        body.contains(&format!("# TYPE {name} gauge\n")),
        "no gauge {name} in\n{body}"
    );
    let prefix = format!("{name} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no sample of {name} in\n{body}"))
        .parse()
        .expect("an integer gauge")
}

/// The server half of reliability defect 140. A client re-sends its
/// unanswered region request after every reconnect; while the pool manager
/// does not answer, each copy waits on the one pool request, and the
/// directory drops the waiters of the sessions that ended since (so that
/// the tenth reconnect's retry is still taken, not refused
/// `TooManyPendingRegionRequests`). A dropped waiter is never completed:
/// the server, which kept each deferred reply until its completion, kept
/// those of the closed connections for ever. Now a closed connection's
/// deferred replies go with it: `cxlkv_deferred_region_replies` counts
/// only the live connection's while the pool manager is stalled, and
/// falls to 0 once it answers — and that connection gets the region.
#[test]
fn a_closed_connections_deferred_region_replies_go_with_it_though_a_retry_dropped_its_waiter() {
    use common::*;
    use cxlkv::server::{PoolManagerConfig, Server};
    use cxlkv_controlplane::pool::service::RemoteConfig;
    use cxlkv_controlplane::proto::{self, RequestMeta};
    use cxlkv_controlplane::transport::Endpoint;
    use std::time::Duration;

    /// More reconnects than the directory's waiters per request (8).
    const RECONNECTS: usize = 10;
    let dir = pool_support::shm_dir("deferred-replies");
    let mut daemon = pool_support::Daemon::start(&pool_support::DaemonSpec::new(dir.path()));
    let mut cfg = ServerConfig::ephemeral("deferred-replies");
    cfg.directory_id = "deferred-replies".into();
    cfg.pool_manager = Some(PoolManagerConfig::Remote(RemoteConfig::new(
        Endpoint::Unix(daemon.spec.socket()),
        "deferred-replies",
    )));
    cfg.directory.instance_grace = Duration::from_secs(60);
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::start(cfg).unwrap();
    let metrics = server.metrics_addr().unwrap();
    let deferred = || metrics_gauge(metrics, "cxlkv_deferred_region_replies");
    let sessions = || server.directory_stats().unwrap().sessions;

    // The same request every time: sequence number 1.
    let ask = proto::RequestRegion {
        meta: RequestMeta {
            seq: 1,
            notice_ack: 0,
            replies_received_below: 0,
        },
        layout: LAYOUT,
        len_bytes: 0,
    };
    let first = Raw::connect_unix(server.socket_path());
    let secret = first.hello("retrier").0.unwrap().instance_secret;
    let pid = daemon.pid() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let mut conn = first;
    for round in 0..RECONNECTS {
        // No answer: the pool manager is stopped.
        let answer = conn.try_call::<_, proto::RegionGranted>(&ask, Duration::from_millis(200));
        assert!(answer.is_none(), "round {round}: {answer:?}");
        drop(conn);
        assert!(
            wait_until(TIMEOUT, || sessions() == 0),
            "round {round}: the closed connection's session ended"
        );
        conn = Raw::connect_unix(server.socket_path());
        let _: proto::Reattached = conn
            .call(&reattach_msg("retrier", secret, Vec::new(), 2))
            .unwrap();
    }
    let last = std::thread::spawn(move || {
        let granted: proto::RegionGranted = conn.call(&ask).unwrap();
        (conn, granted)
    });
    assert!(
        wait_until(TIMEOUT, || deferred() == 1),
        "only the open connection's reply is held: {} held",
        deferred()
    );
    assert_eq!(server.directory_stats().unwrap().pending_region_requests, 1);

    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let (_conn, granted) = last.join().unwrap();
    assert_eq!(granted.layout, LAYOUT);
    assert!(
        wait_until(TIMEOUT, || deferred() == 0),
        "no reply held once the pool manager answered: {} held",
        deferred()
    );
    server.shutdown().unwrap();
    daemon.kill();
}

/// An embedded pool that cannot be opened stops the start with a message
/// that says why: the operating system's own reason, not only "cannot open
/// pool P" (the server kept its pool service's error as text, and dropped
/// the causes below the first).
#[test]
fn a_pool_that_cannot_be_opened_is_refused_with_the_reason() {
    use cxlkv::server::Server;
    let mut cfg = ServerConfig::ephemeral("unopenable-pool");
    cfg.pool_path = "/nonexistent-cxlkv-dir/p.pool".into();
    let err = match Server::start(cfg) {
        Ok(_) => panic!("a pool in a missing directory was opened"),
        Err(e) => e,
    };
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    assert!(text.contains("/nonexistent-cxlkv-dir/p.pool"), "{text}");
    assert!(
        text.contains(&std::io::Error::from_raw_os_error(libc::ENOENT).to_string()),
        "the reason is given: {text}"
    );
}

/// A directory setting out of range names where the operator sets it —
/// the file's key and the environment's variable — whichever they used
/// (the message used to say "in a configuration file" for a value the
/// environment had set).
#[test]
fn a_directory_setting_out_of_range_names_its_key_and_its_variable() {
    use cxlkv::server::Server;
    let mut cfg = ServerConfig::ephemeral("watermark-range");
    cfg.directory.eviction.pool_high_watermark = 1.5;
    let err = match Server::start(cfg) {
        Ok(_) => panic!("a high watermark of 1.5 was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("[directory] high_watermark in a configuration file")
            && err.contains("CXLKV_DIRECTORY_HIGH_WATERMARK in the environment"),
        "{err}"
    );
}
