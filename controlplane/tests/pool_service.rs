//! The pool service in process: sessions in process and over a socket,
//! exactly-once retries (reply cache, and allocation tags across restarts),
//! names across restarts, the reaper for a closed session, reconnect and
//! reattach of a [`RemotePool`] across a service restart, descriptor
//! passing, TCP authentication, and lease renewal and self-fencing.
//!
//! The real-process checks (SIGKILL of a `cxlkv pool` daemon, directory
//! processes, a second daemon) are in the root package's `tests/`.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::Frame;
use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::service::{
    PoolCore, PoolReply, PoolRequest, PoolService, PoolServiceError, PoolSpec, RemoteConfig,
    RemotePool, ServiceConfig, TcpAuth,
};
use cxlkv_controlplane::pool::{ManagerId, ManagerLease, StoreConfig, SyncPolicy};
use cxlkv_controlplane::proto::{
    self, AllocRegion, ErrorCode, Message, OwnerLabel, PoolHello, PoolStats, PoolStatsReply,
    PoolWelcome, RegionAllocated, RegionHandle, RequestMeta,
};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient, ServerConfig};

const TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on every wait for something the service does on a timer.
const EVENTUALLY: Duration = Duration::from_secs(60);
const POOL_BYTES: u64 = 16 << 20;
const ALIGN: u64 = 4096;

struct Dir(tempfile::TempDir);

impl Dir {
    fn new(name: &str) -> Self {
        Self(
            tempfile::Builder::new()
                .prefix(&format!("cxlkv-svc-{name}-"))
                .tempdir_in("/dev/shm")
                .expect("a temporary directory under /dev/shm"),
        )
    }
    fn path(&self) -> &Path {
        self.0.path()
    }
    fn socket(&self) -> PathBuf {
        self.path().join("pool.sock")
    }
}

fn config(dir: &Dir, sync: SyncPolicy, grace_ms: u64) -> ServiceConfig {
    ServiceConfig {
        pools: vec![PoolSpec {
            path: dir.path().join("pool"),
            create_size_bytes: Some(POOL_BYTES),
            align_bytes: Some(ALIGN),
            visibility: None,
        }],
        state_dir: dir.path().join("state"),
        store: StoreConfig {
            sync,
            checkpoint_every_records: 64,
        },
        grace_ms,
        lease_ms: 10_000,
        pass_fds: true,
        tcp_auth: TcpAuth::Disabled,
        io_faults: Default::default(),
    }
}

fn alloc(instance: &str) -> PoolRequest {
    PoolRequest::Alloc {
        pool: None,
        len_bytes: 1,
        instance_id: instance.into(),
    }
}

fn allocated(r: Result<PoolReply, PoolServiceError>) -> RegionHandle {
    match r {
        Ok(PoolReply::Allocated(h)) => h,
        other => panic!("expected an allocation, got {other:?}"),
    }
}

fn list_all(s: &dyn PoolService) -> Vec<RegionHandle> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        match s.call(
            PoolRequest::List {
                after_region: after,
                max_handles: 3,
            },
            TIMEOUT,
        ) {
            Ok(PoolReply::Regions(l)) => {
                after = l.handles.last().map_or(after, |h| h.region);
                out.extend(l.handles);
                if !l.more {
                    return out;
                }
            }
            other => panic!("expected a region list, got {other:?}"),
        }
    }
}

fn stats(s: &dyn PoolService) -> PoolStatsReply {
    match s.call(PoolRequest::Stats, TIMEOUT) {
        Ok(PoolReply::Stats(r)) => r,
        other => panic!("expected stats, got {other:?}"),
    }
}

fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < EVENTUALLY, "gave up waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw protocol client: typed calls over an `RpcClient`.
struct Wire {
    client: RpcClient,
}

impl Wire {
    fn connect(path: &Path) -> Self {
        Self::connect_to(&Endpoint::Unix(path.to_owned()))
    }

    fn connect_to(endpoint: &Endpoint) -> Self {
        Self {
            client: RpcClient::connect(endpoint, ClientConfig::default())
                .expect("connect to the pool service"),
        }
    }

    fn call<M: Message, R: Message>(&self, msg: &M) -> Result<R, (ErrorCode, String)> {
        let mut buf = Vec::new();
        proto::encode(0, msg, &mut buf).unwrap();
        let reply = self
            .client
            .call(M::KIND.as_u16(), &buf[24..], TIMEOUT)
            .expect("a reply");
        let frame = Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        match proto::access_reply::<R>(frame).expect("a valid reply") {
            Ok(a) => Ok(proto::deserialize::<R>(a).unwrap()),
            Err(e) => Err((
                e.error_code().expect("a known code"),
                e.message().to_owned(),
            )),
        }
    }

    fn hello(&self, directory: &str) -> PoolWelcome {
        self.call(&PoolHello {
            meta: RequestMeta::default(),
            protocol_min: 1,
            protocol_max: 1,
            directory_id: directory.into(),
            secret: None,
        })
        .expect("welcome")
    }

    fn alloc(&self, directory: &str, seq: u64) -> Result<RegionHandle, (ErrorCode, String)> {
        self.call::<_, RegionAllocated>(&AllocRegion {
            meta: RequestMeta {
                seq,
                notice_ack: 0,
                replies_received_below: 0,
            },
            pool: None,
            len_bytes: ALIGN,
            owner: OwnerLabel {
                directory_id: directory.into(),
                instance_id: "inst".into(),
            },
        })
        .map(|r| r.handle)
    }
}

#[test]
fn in_process_sessions_allocate_list_free_and_report_stats() {
    let dir = Dir::new("local");
    let core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    let (pool, session) = core.attach_local("dir-a", TIMEOUT).unwrap();
    assert_eq!(session.welcome.pools.len(), 1);
    assert_eq!(
        session.fds.len(),
        1,
        "in-process sessions get the descriptors too"
    );
    assert_eq!(session.welcome.last_seq, 0);
    let a = allocated(pool.call(alloc("inst-1"), TIMEOUT));
    let b = allocated(pool.call(alloc("inst-2"), TIMEOUT));
    assert_eq!(a.len_bytes, ALIGN, "rounded up to the pool alignment");
    assert_eq!(b.owner.instance_id, "inst-2");
    assert_eq!(list_all(&pool), vec![a.clone(), b.clone()]);
    let s = stats(&pool);
    assert_eq!(s.pools[0].regions, 2);
    assert_eq!(s.pools[0].owners[0].directory_id, "dir-a");
    assert_eq!(s.pools[0].owners[0].bytes, 2 * ALIGN);
    let freed = pool.call(
        PoolRequest::Free {
            region: a.region,
            token: a.token,
        },
        TIMEOUT,
    );
    assert!(matches!(freed, Ok(PoolReply::Freed { region }) if region == a.region));
    let again = pool
        .call(
            PoolRequest::Free {
                region: a.region,
                token: a.token,
            },
            TIMEOUT,
        )
        .unwrap_err();
    assert_eq!(again.error_code(), Some(ErrorCode::UnknownRegion));
    assert_eq!(list_all(&pool), vec![b]);
    drop(pool);
    core.shutdown().unwrap();
}

#[test]
fn regions_and_owner_names_survive_a_restart_and_seqs_continue() {
    let dir = Dir::new("restart");
    let core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    let (pool, _) = core.attach_local("dir-a", TIMEOUT).unwrap();
    let before: Vec<_> = (0..100)
        .map(|i| allocated(pool.call(alloc(&format!("inst-{}", i % 7)), TIMEOUT)))
        .collect();
    drop(pool);
    // 100 allocations with a checkpoint every 64 records: the restart loads
    // a checkpoint and replays a journal, and the names file was compacted.
    core.shutdown().unwrap();
    let core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    let (pool, session) = core.attach_local("dir-a", TIMEOUT).unwrap();
    assert_eq!(session.welcome.regions_held, 100);
    assert!(
        session.welcome.last_seq >= 100,
        "{}",
        session.welcome.last_seq
    );
    assert_eq!(list_all(&pool), before, "same handles, tokens and names");
    // Presenting them keeps them (a restarted manager gives everything a
    // grace period).
    match pool.call(PoolRequest::Reattach { handles: before }, TIMEOUT) {
        Ok(PoolReply::Reattached(r)) => {
            assert_eq!(r.accepted.len(), 100);
            assert!(r.refused.is_empty());
        }
        other => panic!("expected a reattach, got {other:?}"),
    }
    drop(pool);
    core.shutdown().unwrap();
}

#[test]
fn a_retried_seq_is_answered_once_and_a_seq_older_than_the_cache_is_refused() {
    let dir = Dir::new("seq");
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let w = Wire::connect(&dir.socket());
    assert_eq!(w.hello("dir-a").last_seq, 0);
    let first = w.alloc("dir-a", 1).unwrap();
    assert_eq!(
        w.alloc("dir-a", 1).unwrap(),
        first,
        "answered from the cache"
    );
    for seq in 2..=300 {
        w.alloc("dir-a", seq).unwrap();
    }
    let (code, _) = w.alloc("dir-a", 1).unwrap_err();
    assert_eq!(code, ErrorCode::SequenceTooOld);
    let st: PoolStatsReply = w
        .call(&PoolStats {
            meta: RequestMeta::default(),
        })
        .unwrap();
    assert_eq!(st.pools[0].regions, 300, "no retry allocated twice");
    // A second connection of the same process is the same caller: its hello
    // is welcome at once, with the number to continue from.
    let w2 = Wire::connect(&dir.socket());
    assert_eq!(w2.hello("dir-a").last_seq, 300);
    core.shutdown().unwrap();
}

/// Found by a review of the pool service (session 23): a seq of `u64::MAX`
/// was taken (and journaled as a tag), and every later welcome's
/// `last_seq + 1` overflowed.
#[test]
fn a_seq_near_overflow_is_refused_and_changes_nothing() {
    let dir = Dir::new("seq-max");
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let w = Wire::connect(&dir.socket());
    w.hello("dir-a");
    let (code, _) = w.alloc("dir-a", u64::MAX).unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert_eq!(regions(&w), 0);
    let w2 = Wire::connect(&dir.socket());
    assert_eq!(w2.hello("dir-a").last_seq, 0);
    core.shutdown().unwrap();
}

#[test]
fn a_retried_allocation_after_a_restart_returns_the_committed_region() {
    let dir = Dir::new("tag");
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let w = Wire::connect(&dir.socket());
    w.hello("dir-a");
    let h = w.alloc("dir-a", 7).unwrap();
    drop(w);
    core.shutdown().unwrap();
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 60_000)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let w = Wire::connect(&dir.socket());
    assert_eq!(w.hello("dir-a").last_seq, 7, "from the journaled tag");
    assert_eq!(w.alloc("dir-a", 7).unwrap(), h, "the tag found the region");
    let other = w.alloc("dir-a", 8).unwrap();
    assert_ne!(other.region, h.region);
    core.shutdown().unwrap();
}

/// A TCP connection is a caller of its own: closing it starts its
/// directory's grace period (a Unix connection's caller is its process).
fn tcp_core(dir: &Dir, grace_ms: u64) -> (PoolCore, Endpoint) {
    let mut core = PoolCore::start(config(dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    let eps = core
        .listen(
            &[Endpoint::Tcp("127.0.0.1:0".parse().unwrap())],
            ServerConfig::default(),
        )
        .unwrap();
    (core, eps[0].clone())
}

fn regions(w: &Wire) -> u64 {
    let st: PoolStatsReply = w
        .call(&PoolStats {
            meta: RequestMeta::default(),
        })
        .unwrap();
    st.pools[0].regions
}

#[test]
fn an_allocation_retried_on_a_new_connection_and_answered_from_the_cache_is_kept() {
    let dir = Dir::new("replay-kept");
    let grace_ms = 200;
    let (core, ep) = tcp_core(&dir, grace_ms);
    let w = Wire::connect_to(&ep);
    w.hello("dir-a");
    let h = w.alloc("dir-a", 1).unwrap();
    // Its reply lost with the connection: the region waits for a reattach
    // that the directory, not knowing it, will not present.
    drop(w);
    let w = Wire::connect_to(&ep);
    w.hello("dir-a");
    assert_eq!(w.alloc("dir-a", 1).unwrap(), h, "answered from the cache");
    std::thread::sleep(Duration::from_millis(4 * grace_ms));
    assert_eq!(
        regions(&w),
        1,
        "the retry's answer keeps the region, as presenting its handle would"
    );
    assert_eq!(core.stats().reclaimed, 0);
    core.shutdown().unwrap();
}

#[test]
fn an_allocation_retried_after_its_region_was_reclaimed_is_not_answered_with_it() {
    let dir = Dir::new("replay-gone");
    let grace_ms = 100;
    let (core, ep) = tcp_core(&dir, grace_ms);
    let w = Wire::connect_to(&ep);
    w.hello("dir-a");
    let h = w.alloc("dir-a", 1).unwrap();
    drop(w);
    eventually("the region to be reclaimed", || core.stats().reclaimed == 1);
    let w = Wire::connect_to(&ep);
    w.hello("dir-a");
    let (code, msg) = w.alloc("dir-a", 1).unwrap_err();
    assert_eq!(
        code,
        ErrorCode::UnknownRegion,
        "region {} is gone: {msg}",
        h.region
    );
    assert_eq!(regions(&w), 0);
    core.shutdown().unwrap();
}

/// A TCP proxy in front of the pool service. While `cut` is set it closes
/// a connection as soon as the service sends anything on it (requests are
/// carried out, their replies lost with the connection); while `mute` is
/// set it drops what the service sends and keeps the connection open (a
/// silent daemon; the stream is unframed once it does, so a test does not
/// unmute); once `freeze` is set it forwards nothing either way and never
/// closes either side (a directory host gone without a FIN).
struct Proxy {
    addr: std::net::SocketAddr,
    faults: Arc<Faults>,
    stop: Arc<AtomicBool>,
}

#[derive(Default)]
struct Faults {
    cut: AtomicBool,
    mute: AtomicBool,
    freeze: AtomicBool,
}

impl Proxy {
    fn start(upstream: &Endpoint) -> Self {
        let Endpoint::Tcp(up) = upstream.clone() else {
            panic!("a TCP upstream")
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let faults = Arc::new(Faults::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (f, st) = (Arc::clone(&faults), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((down, _)) => {
                        down.set_nonblocking(false).unwrap();
                        let up = TcpStream::connect(up).unwrap();
                        let to_service = (down.try_clone().unwrap(), up.try_clone().unwrap());
                        Self::pipe(to_service, false, Arc::clone(&f), Arc::clone(&st));
                        Self::pipe((up, down), true, Arc::clone(&f), Arc::clone(&st));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            }
        });
        Self { addr, faults, stop }
    }

    /// Copies `from` to `to` until either ends (`from_service`: the
    /// service's side, where `cut` and `mute` apply).
    fn pipe(
        (mut from, mut to): (TcpStream, TcpStream),
        from_service: bool,
        faults: Arc<Faults>,
        stop: Arc<AtomicBool>,
    ) {
        std::thread::spawn(move || {
            from.set_read_timeout(Some(Duration::from_millis(10)))
                .unwrap();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let read = from.read(&mut buf);
                // Checked after the read too: a close that arrives once
                // frozen is not passed on either.
                if faults.freeze.load(Ordering::SeqCst) {
                    // Both sockets stay open, silent, until the test ends.
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    return;
                }
                let n = match read {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        continue;
                    }
                    Err(_) => break,
                };
                if from_service && faults.cut.load(Ordering::SeqCst) {
                    break;
                }
                if from_service && faults.mute.load(Ordering::SeqCst) {
                    continue;
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Submits `request`; its answer (the error code, if any) comes on `tx`.
fn submit_to(
    remote: &RemotePool,
    request: PoolRequest,
    label: &'static str,
    tx: &std::sync::mpsc::Sender<(&'static str, Option<ErrorCode>)>,
) {
    let tx = tx.clone();
    remote.submit(
        request,
        Box::new(move |r| {
            let _ = tx.send((label, r.err().and_then(|e| e.error_code())));
        }),
    );
}

#[test]
fn an_allocation_that_timed_out_after_it_ran_is_freed_once_the_manager_answers() {
    let dir = Dir::new("abandoned");
    // Longer than every wait below: the region is not reclaimed meanwhile.
    let (core, ep) = tcp_core(&dir, 120_000);
    let observer = Wire::connect_to(&ep);
    let proxy = Proxy::start(&ep);
    let mut rc = RemoteConfig::new(Endpoint::Tcp(proxy.addr), "dir-abandoned");
    rc.reconnect_backoff_ms = 20;
    rc.request_timeout_ms = 200;
    rc.retry_window_ms = 500;
    let (remote, _) = RemotePool::connect(rc).unwrap();
    proxy.faults.cut.store(true, Ordering::SeqCst);
    let (tx, rx) = std::sync::mpsc::channel();
    submit_to(&remote, alloc("i"), "alloc", &tx);
    let answer = rx.recv_timeout(TIMEOUT).expect("an answer");
    assert_eq!(
        answer,
        ("alloc", Some(ErrorCode::Timeout)),
        "every reply was lost"
    );
    assert_eq!(
        regions(&observer),
        1,
        "the allocation ran; its directory was told it timed out"
    );
    proxy.faults.cut.store(false, Ordering::SeqCst);
    eventually("the abandoned allocation's region to be freed", || {
        regions(&observer) == 0
    });
    let h = allocated(remote.call(alloc("i"), TIMEOUT));
    assert_eq!(list_all(&remote), vec![h], "the session goes on");
    drop(remote);
    drop(proxy);
    core.shutdown().unwrap();
}

/// Found by a review of the pool service (session 23): with the front
/// flight an abandoned allocation (resent until answered), the requests on
/// the wire behind it were never waited for, so never timed out.
#[test]
fn requests_behind_an_abandoned_allocation_still_time_out_when_the_daemon_is_silent() {
    let dir = Dir::new("muted");
    let (core, ep) = tcp_core(&dir, 120_000);
    let proxy = Proxy::start(&ep);
    let mut rc = RemoteConfig::new(Endpoint::Tcp(proxy.addr), "dir-muted");
    rc.reconnect_backoff_ms = 20;
    rc.request_timeout_ms = 200;
    rc.retry_window_ms = 500;
    let (remote, _) = RemotePool::connect(rc).unwrap();
    proxy.faults.mute.store(true, Ordering::SeqCst);
    let (tx, rx) = std::sync::mpsc::channel();
    submit_to(&remote, alloc("i"), "alloc", &tx);
    submit_to(&remote, PoolRequest::Stats, "stats", &tx);
    let mut answers = Vec::new();
    while answers.len() < 2 {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(a) => answers.push(a),
            Err(_) => break,
        }
    }
    answers.sort_by_key(|(label, _)| *label);
    assert_eq!(
        answers,
        vec![
            ("alloc", Some(ErrorCode::Timeout)),
            ("stats", Some(ErrorCode::Timeout))
        ],
        "a retry window of 0.5 s, and 10 s more"
    );
    drop(remote);
    drop(proxy);
    core.shutdown().unwrap();
}

/// Found by a review of the pool service (session 23): a directory whose
/// host vanished (no FIN, no RST) kept its connection, so its regions were
/// never reclaimed and its id stayed taken until the daemon restarted.
#[test]
fn a_directory_whose_host_vanished_loses_its_regions_and_its_id_is_free_again() {
    let dir = Dir::new("vanished");
    let grace_ms = 200;
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    let eps = core
        .listen(
            &[Endpoint::Tcp("127.0.0.1:0".parse().unwrap())],
            ServerConfig {
                idle_timeout_ms: Some(500),
                ..ServerConfig::default()
            },
        )
        .unwrap();
    let ep = eps[0].clone();
    // A connection of its own per look: an idle one would be closed.
    let regions_now = || regions(&Wire::connect_to(&ep));
    let proxy = Proxy::start(&ep);
    let mut rc = RemoteConfig::new(Endpoint::Tcp(proxy.addr), "dir-v");
    rc.ping_ms = 100;
    let (remote, _) = RemotePool::connect(rc).unwrap();
    allocated(remote.call(alloc("i"), TIMEOUT));
    // Pings keep an idle directory's connection open past the timeout.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(core.stats().reclaimed, 0, "a live, idle directory");
    proxy.faults.freeze.store(true, Ordering::SeqCst);
    drop(remote);
    let mut cfg = RemoteConfig::new(ep.clone(), "dir-v");
    cfg.ping_ms = 100;
    let start = Instant::now();
    let replacement = loop {
        match RemotePool::connect(cfg.clone()) {
            Ok((r, _)) => break r,
            Err(e) => assert!(
                start.elapsed() < EVENTUALLY,
                "the replacement is still refused: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eventually("the vanished directory's region to be reclaimed", || {
        regions_now() == 0
    });
    drop(replacement);
    drop(proxy);
    core.shutdown().unwrap();
}

#[test]
fn a_closed_sessions_regions_are_reclaimed_after_the_grace_period_and_a_live_ones_are_not() {
    let dir = Dir::new("reap");
    let core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, 200)).unwrap();
    let (gone, _) = core.attach_local("dir-gone", TIMEOUT).unwrap();
    let (live, _) = core.attach_local("dir-live", TIMEOUT).unwrap();
    for _ in 0..5 {
        allocated(gone.call(alloc("i"), TIMEOUT));
    }
    let kept = allocated(live.call(alloc("i"), TIMEOUT));
    drop(gone);
    eventually("the gone directory's regions to be reclaimed", || {
        stats(&live).pools[0].regions == 1
    });
    assert_eq!(core.stats().reclaimed, 5);
    assert_eq!(list_all(&live), vec![kept]);
    drop(live);
    core.shutdown().unwrap();
}

#[test]
fn a_remote_pool_reconnects_and_reattaches_after_the_service_restarts() {
    let dir = Dir::new("remote");
    let grace_ms = 300;
    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let mut rc = RemoteConfig::new(Endpoint::Unix(dir.socket()), "dir-remote");
    rc.reconnect_backoff_ms = 20;
    let (remote, session) = RemotePool::connect(rc).unwrap();
    assert_eq!(session.fds.len(), 1, "descriptors over the Unix socket");
    assert_eq!(session.welcome.fds_passed, 1);
    let pool_file = std::fs::File::from(session.fds.into_iter().next().unwrap());
    assert_eq!(pool_file.metadata().unwrap().len(), POOL_BYTES);
    let mine: Vec<_> = (0..3)
        .map(|_| allocated(remote.call(alloc("r"), TIMEOUT)))
        .collect();
    // Another directory that will not come back after the restart.
    let (orphan, _) = core.attach_local("dir-orphan", TIMEOUT).unwrap();
    allocated(orphan.call(alloc("o"), TIMEOUT));
    drop(orphan);
    core.shutdown().unwrap();

    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    // The first call after the restart finds the connection broken,
    // reconnects (hello + reattach) and is resent.
    let fourth = allocated(remote.call(alloc("r"), TIMEOUT));
    eventually("the orphan's region to be reclaimed", || {
        stats(&remote).pools[0].regions == 4
    });
    std::thread::sleep(Duration::from_millis(2 * grace_ms));
    let mut expected = mine;
    expected.push(fourth);
    assert_eq!(list_all(&remote), expected, "reattached regions are kept");
    drop(remote);
    core.shutdown().unwrap();
}

/// A daemon on `dir`'s socket and a directory's remote session to it
/// (reconnecting every 20 ms once the connection breaks).
fn serving_a_remote_session(dir: &Dir, grace_ms: u64, directory: &str) -> (PoolCore, RemotePool) {
    let mut core = PoolCore::start(config(dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    let mut rc = RemoteConfig::new(Endpoint::Unix(dir.socket()), directory);
    rc.reconnect_backoff_ms = 20;
    let (remote, _session) = RemotePool::connect(rc).unwrap();
    (core, remote)
}

/// A daemon restarted with the same state, which starts listening only
/// after its grace period has passed: the regions of a directory that was
/// away meanwhile are reclaimed before it can reattach them.
fn restart_listening_after_the_grace(dir: &Dir, grace_ms: u64) -> PoolCore {
    let mut core = PoolCore::start(config(dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    std::thread::sleep(Duration::from_millis(5 * grace_ms));
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    core
}

/// Found by a review of the region lifecycle (session 31): a directory
/// away from its daemon for longer than the daemon's grace period (a
/// partition, a stalled host, or a daemon restart it came back to late) has
/// its regions reclaimed; the reattach after the reconnect was refused
/// them, and the session forgot them with a warning — the directory kept
/// its records and its clients' keys in them, and the daemon granted the
/// same bytes again to the next allocation (two owners of one extent). Now
/// the session ends: every request is refused `SessionEnded` and
/// `failure()` names the regions, so the directory server exits and its
/// restart drops the keys.
#[test]
fn regions_reclaimed_while_the_directory_was_away_end_the_session() {
    let dir = Dir::new("reclaimed");
    let grace_ms = 200;
    let (core, remote) = serving_a_remote_session(&dir, grace_ms, "dir-away");
    let held = allocated(remote.call(alloc("a"), TIMEOUT));
    core.shutdown().unwrap();

    let core = restart_listening_after_the_grace(&dir, grace_ms);
    // The next request reconnects, and the reattach is refused `held`.
    let next = remote.call(alloc("b"), TIMEOUT);
    assert_eq!(
        next.as_ref().err().and_then(|e| e.error_code()),
        Some(ErrorCode::SessionEnded),
        "{next:?}"
    );
    let why = remote.failure().expect("the session says why it ended");
    assert!(
        why.contains(&format!("{} (unknown_region)", held.region)) && why.contains("must restart"),
        "{why}"
    );
    let later = remote.call(alloc("b"), TIMEOUT).unwrap_err();
    assert_eq!(later.error_code(), Some(ErrorCode::SessionEnded));
    drop(remote);
    core.shutdown().unwrap();
}

/// The refusal that is not a loss: a region whose free was in flight when
/// the daemon went away, and that the daemon reclaimed meanwhile, is gone
/// either way — the session goes on, and the free is answered
/// `UnknownRegion` (which the directory takes as done).
#[test]
fn a_region_being_freed_that_was_reclaimed_meanwhile_does_not_end_the_session() {
    let dir = Dir::new("freeing");
    let grace_ms = 200;
    let (core, remote) = serving_a_remote_session(&dir, grace_ms, "dir-freeing");
    let held = allocated(remote.call(alloc("a"), TIMEOUT));
    core.shutdown().unwrap();

    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    remote.submit(
        PoolRequest::Free {
            region: held.region,
            token: held.token,
        },
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    let core = restart_listening_after_the_grace(&dir, grace_ms);
    let freed = rx.recv_timeout(TIMEOUT).expect("the free is answered");
    assert_eq!(
        freed.as_ref().err().and_then(|e| e.error_code()),
        Some(ErrorCode::UnknownRegion),
        "{freed:?}"
    );
    assert_eq!(remote.failure(), None);
    allocated(remote.call(alloc("a"), TIMEOUT));
    drop(remote);
    core.shutdown().unwrap();
}

/// Found with the review of entry 172 (session 31): a region whose free
/// the daemon refused for good stayed in the session's list, so every
/// reconnect's reattach presented it again (with its real token) and the
/// daemon kept it for a directory that had dropped it — a leak until the
/// directory restarted. Now an answered free drops it from the list: the
/// next reattach leaves it out and the daemon reclaims it after its grace,
/// while the regions still held are kept.
#[test]
fn a_region_whose_free_was_refused_for_good_is_reclaimed_after_a_reconnect() {
    let dir = Dir::new("refused-free");
    let grace_ms = 200;
    let (core, remote) = serving_a_remote_session(&dir, grace_ms, "dir-refused-free");
    let kept = allocated(remote.call(alloc("a"), TIMEOUT));
    let dropped = allocated(remote.call(alloc("a"), TIMEOUT));
    let refused = remote
        .call(
            PoolRequest::Free {
                region: dropped.region,
                token: proto::RegionToken([0xee; 32]),
            },
            TIMEOUT,
        )
        .unwrap_err();
    assert!(!refused.is_transient(), "{refused:?}");
    core.shutdown().unwrap();

    let mut core = PoolCore::start(config(&dir, SyncPolicy::PerRecord, grace_ms)).unwrap();
    core.listen(&[Endpoint::Unix(dir.socket())], ServerConfig::default())
        .unwrap();
    // Reconnects and reattaches what the session holds.
    let third = allocated(remote.call(alloc("a"), TIMEOUT));
    eventually("the dropped region to be reclaimed", || {
        list_all(&remote) == vec![kept.clone(), third.clone()]
    });
    assert_eq!(remote.failure(), None);
    drop(remote);
    core.shutdown().unwrap();
}

#[test]
fn tcp_directories_must_present_the_secret_and_get_no_descriptors() {
    let dir = Dir::new("tcp");
    let mut cfg = config(&dir, SyncPolicy::PerRecord, 60_000);
    cfg.tcp_auth = TcpAuth::Secret(b"open sesame".to_vec());
    let mut core = PoolCore::start(cfg).unwrap();
    let bound = core
        .listen(
            &[Endpoint::Tcp("127.0.0.1:0".parse().unwrap())],
            ServerConfig::default(),
        )
        .unwrap();
    let ep = bound[0].clone();
    let attempt = |secret: Option<&[u8]>| {
        let mut rc = RemoteConfig::new(ep.clone(), "dir-tcp");
        rc.secret = secret.map(<[u8]>::to_vec);
        RemotePool::connect(rc)
    };
    let code = |r: Result<_, PoolServiceError>| r.map(|_| ()).unwrap_err().error_code();
    assert_eq!(code(attempt(None)), Some(ErrorCode::AuthenticationRequired));
    assert_eq!(
        code(attempt(Some(b"open sesame!"))),
        Some(ErrorCode::AuthenticationFailed)
    );
    let (remote, session) = attempt(Some(b"open sesame")).unwrap();
    assert_eq!(session.welcome.fds_passed, 0);
    assert!(session.fds.is_empty());
    allocated(remote.call(alloc("t"), TIMEOUT));
    drop(remote);
    core.shutdown().unwrap();
}

fn read_header(pool: &Path) -> cxlkv_controlplane::pool::Header {
    let f = std::fs::File::open(pool).unwrap();
    let mut block = vec![0u8; ALIGN as usize];
    f.read_exact_at(&mut block, 0).unwrap();
    match header::decode(&block).unwrap() {
        BlockState::Initialised(h) => h,
        BlockState::Fresh => panic!("the service initialised the header"),
    }
}

#[test]
fn the_lease_is_renewed_and_a_takeover_stops_allocations_from_the_pool() {
    let dir = Dir::new("lease");
    let mut cfg = config(&dir, SyncPolicy::PerRecord, 60_000);
    cfg.lease_ms = 300;
    let pool_path = cfg.pools[0].path.clone();
    let core = PoolCore::start(cfg).unwrap();
    let (pool, _) = core.attach_local("dir-a", TIMEOUT).unwrap();
    let first = read_header(&pool_path)
        .lease
        .expect("a lease after the start");
    eventually("a lease renewal", || {
        read_header(&pool_path)
            .lease
            .is_some_and(|l| l.seq > first.seq + 1)
    });
    allocated(pool.call(alloc("i"), TIMEOUT));
    // Another manager (on another host) takes the pool over with a higher
    // epoch: the next renewal sees it and the pool goes offline.
    let current = read_header(&pool_path).lease.unwrap();
    let usurper = ManagerLease {
        seq: current.seq + 1,
        epoch: current.epoch + 1,
        expires_unix_ms: u64::MAX,
        holder: ManagerId([0xee; 16]),
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pool_path)
        .unwrap();
    let mut block = vec![0u8; ALIGN as usize];
    f.read_exact_at(&mut block, 0).unwrap();
    header::write_lease(&mut block, &usurper).unwrap();
    f.write_all_at(&block[..header::HEADER_BYTES], 0).unwrap();
    eventually("the pool to go offline", || {
        pool.call(alloc("i"), TIMEOUT)
            .is_err_and(|e| e.error_code() == Some(ErrorCode::OutOfSpace))
    });
    assert_eq!(
        read_header(&pool_path).lease.unwrap().holder,
        ManagerId([0xee; 16]),
        "the superseded manager does not write its lease back"
    );
    drop(pool);
    core.shutdown().unwrap();
}
