//! Shared fixtures of the transport tests: a scripted handler, server
//! start-up on a unique Unix path and a loopback TCP port, and the list of
//! backends every test runs on.
#![allow(dead_code)] // each test file uses a subset

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::{Frame, FrameHeader, encode_frame};
use cxlkv_controlplane::transport::{
    Admit, Backend, BackendChoice, ClientConfig, ConnId, DisconnectReason, Endpoint, Handler,
    IoConfig, PeerInfo, RecvMode, Refusal, RefuseReason, Rejection, Replies, RpcClient, Server,
    ServerConfig, ServerHandle, probe_uring,
};
use parking_lot::{Condvar, Mutex};

pub const ECHO: u16 = 1;
pub const DEFER: u16 = 2;
pub const SEND_FD: u16 = 3;
pub const CLOSE_ME: u16 = 4;
pub const SIZED: u16 = 5;
pub const WHO_AM_I: u16 = 6;
/// Echoes through [`Replies::send_frame`]: the handler encodes the frame.
pub const WHOLE_FRAME: u16 = 7;
/// Holds the loop thread inside the handler until the test opens the gate
/// ([`Seen::open_gate`], bounded by [`LONG`]), then replies: lets a test
/// line bytes up in a socket while the loop cannot receive them.
pub const GATE: u16 = 8;
/// Panics on the loop thread (a handler bug), ending the event loop.
pub const PANIC: u16 = 9;
pub const REPLY_OFFSET: u16 = 100;
pub const ERROR_REPLY: u16 = 999;
pub const REFUSED: u16 = 998;

/// Generous bound on every wait in the tests (never a timing assertion).
pub const LONG: Duration = Duration::from_secs(20);

/// What the handler saw, for the test to inspect.
#[derive(Default)]
pub struct Seen {
    pub deferred: Mutex<Vec<(ConnId, u64, Vec<u8>)>>,
    pub to_complete_on_wake: Mutex<Vec<(ConnId, u64, Vec<u8>)>>,
    pub rejections: Mutex<Vec<(ConnId, u64, Rejection)>>,
    pub disconnects: Mutex<Vec<(ConnId, DisconnectReason)>>,
    /// Every frame delivered (connection, request id), in the order the
    /// handler saw them.
    pub delivered: Mutex<Vec<(ConnId, u64)>>,
    pub peers: Mutex<Vec<(ConnId, PeerInfo)>>,
    /// Kernel thread id of the event loop (recorded at each connect).
    pub loop_tid: AtomicI32,
    /// A `GATE` request is holding the loop.
    pub gate_entered: AtomicBool,
    gate_open: Mutex<bool>,
    gate_changed: Condvar,
}

impl Seen {
    /// Lets a `GATE` request (now or later) return.
    pub fn open_gate(&self) {
        *self.gate_open.lock() = true;
        self.gate_changed.notify_all();
    }

    /// Called on the loop thread by `GATE`: waits for the gate, bounded.
    fn wait_for_gate(&self) {
        self.gate_entered.store(true, Ordering::SeqCst);
        let until = Instant::now() + LONG;
        let mut open = self.gate_open.lock();
        while !*open && Instant::now() < until {
            // One wake-up, when the gate opens (a timed wait only as the
            // bound): an io_uring loop that woke early would run its
            // deferred receives before the test lined its bytes up.
            let _ = self.gate_changed.wait_until(&mut open, until);
        }
    }

    /// CPU time the event loop's thread has used so far.
    pub fn loop_cpu_time(&self) -> Duration {
        let tid = self.loop_tid.load(Ordering::SeqCst);
        assert!(tid > 0, "no connection has told the loop's thread id yet");
        thread_cpu_time(tid)
    }
}

/// CPU time of thread `tid` of this process, from its per-thread CPU clock
/// (no descriptor needed: works when the process has none left).
pub fn thread_cpu_time(tid: i32) -> Duration {
    // MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED) of the kernel's
    // posix-timers.h: (~tid << 3) | CPUCLOCK_PERTHREAD_MASK | CPUCLOCK_SCHED.
    let clock = (!tid << 3) | 4 | 2;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(
        rc,
        0,
        "clock_gettime of thread {tid}: {}",
        std::io::Error::last_os_error()
    );
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

pub struct TestHandler {
    pub seen: Arc<Seen>,
}

impl Handler for TestHandler {
    fn on_connect(&mut self, conn: ConnId, peer: &PeerInfo) -> Admit {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        self.seen.loop_tid.store(tid, Ordering::SeqCst);
        self.seen.peers.lock().push((conn, peer.clone()));
        Admit::Accept
    }

    fn on_refused(&mut self, _peer: &PeerInfo, why: RefuseReason) -> Option<Refusal> {
        Some(Refusal {
            kind: REFUSED,
            payload: format!("{why:?}").into_bytes(),
        })
    }

    fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies) {
        let h = frame.header;
        self.seen.delivered.lock().push((conn, h.request_id));
        let reply = h.kind + REPLY_OFFSET;
        match h.kind {
            ECHO => out.send(conn, reply, h.request_id, frame.payload).unwrap(),
            DEFER => self
                .seen
                .deferred
                .lock()
                .push((conn, h.request_id, frame.payload.to_vec())),
            SEND_FD => {
                let fd = memfd_with(frame.payload);
                out.send_with_fds(conn, reply, h.request_id, b"fd attached", vec![fd])
                    .unwrap();
            }
            CLOSE_ME => {
                out.send(conn, reply, h.request_id, b"bye").unwrap();
                out.close(conn);
            }
            SIZED => {
                let len = u32::from_le_bytes(frame.payload[..4].try_into().unwrap()) as usize;
                let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                out.send(conn, reply, h.request_id, &body).unwrap();
            }
            WHOLE_FRAME => {
                let mut whole = Vec::new();
                encode_frame(&mut whole, reply, h.request_id, frame.payload).unwrap();
                out.send_frame(conn, whole, Vec::new()).unwrap();
            }
            GATE => {
                self.seen.wait_for_gate();
                out.send(conn, reply, h.request_id, b"released").unwrap();
            }
            PANIC => panic!("the test handler was asked to panic"),
            WHO_AM_I => {
                let text = match self.seen.peers.lock().iter().find(|(c, _)| *c == conn) {
                    Some((_, PeerInfo::Unix(c))) => format!("unix {} {} {}", c.pid, c.uid, c.gid),
                    Some((_, PeerInfo::Tcp(a))) => format!("tcp {a}"),
                    other => format!("{other:?}"),
                };
                out.send(conn, reply, h.request_id, text.as_bytes())
                    .unwrap();
            }
            _ => out
                .send(conn, ERROR_REPLY, h.request_id, b"unknown kind")
                .unwrap(),
        }
    }

    fn on_rejected(
        &mut self,
        conn: ConnId,
        header: FrameHeader,
        why: Rejection,
        out: &mut Replies,
    ) {
        let text = format!("{why:?}");
        self.seen
            .rejections
            .lock()
            .push((conn, header.request_id, why));
        out.send(conn, ERROR_REPLY, header.request_id, text.as_bytes())
            .unwrap();
    }

    fn on_disconnect(&mut self, conn: ConnId, why: &DisconnectReason) {
        self.seen.disconnects.lock().push((conn, why.clone()));
    }

    fn on_wake(&mut self, out: &mut Replies) {
        for (conn, rid, payload) in self.seen.to_complete_on_wake.lock().drain(..) {
            out.send(conn, DEFER + REPLY_OFFSET, rid, &payload).unwrap();
        }
    }
}

/// A memfd holding `bytes`.
pub fn memfd_with(bytes: &[u8]) -> OwnedFd {
    // SAFETY: a NUL-terminated name; a non-negative result is a new fd.
    let raw = unsafe { libc::memfd_create(c"cxlkv-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create failed");
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes).unwrap();
    f.into()
}

/// The backends of one run of a test: the server's (and, for an io_uring
/// server, how it receives) and the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backends {
    pub server: BackendChoice,
    pub client: BackendChoice,
    pub recv: RecvMode,
}

impl Backends {
    /// `server` and `client` with the default receive mode.
    pub fn of(server: BackendChoice, client: BackendChoice) -> Self {
        Self {
            server,
            client,
            recv: RecvMode::default(),
        }
    }
}

/// Every pairing of server and client backend each test runs on: io_uring
/// when this kernel allows it (the test says so when it does not), and the
/// fallback always; an io_uring server in both receive modes.
pub fn backends() -> Vec<Backends> {
    let mut ends = vec![BackendChoice::Fallback];
    let uring = IoConfig {
        backend: BackendChoice::Uring,
        ..Default::default()
    };
    match probe_uring(&uring) {
        Ok(()) => ends.insert(0, BackendChoice::Uring),
        Err(e) => eprintln!("io_uring unavailable, testing the fallback only: {e}"),
    }
    let mut pairs = Vec::new();
    for &server in &ends {
        for &client in &ends {
            pairs.push(Backends::of(server, client));
            if server == BackendChoice::Uring {
                pairs.push(Backends {
                    recv: RecvMode::Provided,
                    ..Backends::of(server, client)
                });
            }
        }
    }
    pairs
}

/// One run per server backend (an io_uring server in both receive modes),
/// for tests whose client is a raw socket.
pub fn server_backends() -> Vec<Backends> {
    backends()
        .into_iter()
        .filter(|b| b.client == BackendChoice::Fallback)
        .collect()
}

/// The backend a client configured with `choice` must report.
fn expected_backend(choice: BackendChoice) -> Backend {
    match choice {
        BackendChoice::Fallback => Backend::Fallback,
        _ => Backend::Uring,
    }
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A socket path of this test process's own. A file already there was left
/// by a dead process that had this pid (a test killed or failed before it
/// removed its socket): it is removed, or binding would fail `AddrInUse`.
pub fn unique_socket_path() -> PathBuf {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("cxlkv-t-{}-{n}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

pub struct Fixture {
    pub server: ServerHandle<TestHandler>,
    pub seen: Arc<Seen>,
    pub unix: Endpoint,
    pub tcp: Endpoint,
    pub backend: Backends,
}

pub fn server_config(backend: Backends) -> ServerConfig {
    let mut cfg = ServerConfig::default();
    cfg.io.backend = backend.server;
    cfg.io.recv = backend.recv;
    cfg
}

pub fn client_config(backend: Backends) -> ClientConfig {
    let mut cfg = ClientConfig::default();
    cfg.io.backend = backend.client;
    cfg
}

pub fn start(backend: Backends, cfg: ServerConfig) -> Fixture {
    start_with(backend, cfg, |_| {})
}

pub fn start_with(
    backend: Backends,
    cfg: ServerConfig,
    prepare: impl FnOnce(&mut Server),
) -> Fixture {
    let path = unique_socket_path();
    let mut server = Server::bind(
        cfg,
        &[
            Endpoint::Unix(path),
            Endpoint::Tcp("127.0.0.1:0".parse().unwrap()),
        ],
    )
    .expect("bind test server");
    prepare(&mut server);
    let eps = server.endpoints().to_vec();
    let seen = Arc::new(Seen::default());
    let server = server
        .spawn(TestHandler {
            seen: Arc::clone(&seen),
        })
        .expect("spawn test server");
    Fixture {
        server,
        seen,
        unix: eps[0].clone(),
        tcp: eps[1].clone(),
        backend,
    }
}

impl Fixture {
    pub fn endpoints(&self) -> [&Endpoint; 2] {
        [&self.unix, &self.tcp]
    }

    /// A client of the backend under test (checked: it must not fall back).
    pub fn client(&self, ep: &Endpoint) -> RpcClient {
        let c = RpcClient::connect(ep, client_config(self.backend)).expect("connect");
        assert_eq!(c.backend(), expected_backend(self.backend.client));
        c
    }

    /// Waits (bounded) until `pred` holds on what the handler saw.
    pub fn wait_until(&self, what: &str, pred: impl Fn(&Seen) -> bool) {
        let until = std::time::Instant::now() + LONG;
        while !pred(&self.seen) {
            assert!(
                std::time::Instant::now() < until,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Formatted log output of every thread (a `tracing` writer).
#[derive(Clone, Default)]
pub struct Captured(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    /// Lines holding `needle`.
    pub fn lines_with(&self, needle: &str) -> usize {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
