//! `cxlkv bench rtt`: control-plane round trip through the real transport
//! (server event loop + pipelining client) against a raw busy-polling
//! socket ping-pong of the same byte counts, measured in the same run.
//!
//! Byte counts are those of a one-key request: a 24-byte header plus a
//! 150-byte payload (176 bytes on the wire) and a 100-byte reply payload
//! (128 bytes on the wire). Until the directory exists the server's handler
//! answers every request with a reply of that size (`handler=echo`).
//!
//! Both servers run in a **forked child process**, as a real server does:
//! on 2 vCPUs, a server thread inside the bench process would share the
//! process's scheduler accounting and allocator with the client and be
//! easier to co-schedule than a real deployment allows. The raw echo child
//! busy-polls without pause, so it is started for its own measurement and
//! killed after; ours sleeps after `spin_us` idle and stays up for the case.
//! Reps alternate raw and ours; each rep's p50 is taken and the median over
//! reps is reported.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::frame::{Frame, FrameHeader};
use cxlkv_controlplane::transport::{
    BackendChoice, ClientConfig, ConnId, Endpoint, Handler, Rejection, Replies, RpcClient, Server,
    ServerConfig, TaskRun, sys,
};

use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;

const SCENARIO: &str = "rtt";
const REQUEST_PAYLOAD_BYTES: usize = 150;
const REPLY_PAYLOAD_BYTES: usize = 100;
const REQUEST_WIRE_BYTES: usize = cxlkv_controlplane::frame::frame_len(REQUEST_PAYLOAD_BYTES);
const REPLY_WIRE_BYTES: usize = cxlkv_controlplane::frame::frame_len(REPLY_PAYLOAD_BYTES);
const KIND: u16 = 1;
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on every raw-socket wait (the raw peers spin, so this is a hang guard).
const RAW_TIMEOUT: Duration = Duration::from_secs(10);

/// Answers every request with a reply of the one-key size.
struct EchoHandler {
    reply: Vec<u8>,
}

impl Handler for EchoHandler {
    fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies) {
        if let Err(e) = out.send(
            conn,
            frame.header.kind + 100,
            frame.header.request_id,
            &self.reply,
        ) {
            tracing::warn!(error = %e, "echo reply failed");
        }
    }
    fn on_rejected(
        &mut self,
        conn: ConnId,
        header: FrameHeader,
        _why: Rejection,
        out: &mut Replies,
    ) {
        let _ = out.send(conn, 999, header.request_id, b"rejected");
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Unix,
    Tcp,
}

struct Case {
    name: String,
    kind: Kind,
    backend: BackendChoice,
    tweak: fn(&mut ServerConfig),
    idle_gap: Option<Duration>,
}

/// A forked child process, killed and reaped on drop.
pub(super) struct Child(libc::pid_t);

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a child we forked and have not reaped yet.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

/// Runs `body` in a forked child that never returns into the bench.
pub(super) fn fork_child(body: impl FnOnce()) -> anyhow::Result<Child> {
    // SAFETY: the bench is single-threaded here (client threads are joined
    // before every fork), so the child's only thread is a copy of this one
    // and no lock can be held by a thread that does not exist in it.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()).context("fork"),
        0 => {
            body();
            // SAFETY: leave without running the parent's destructors or atexit.
            unsafe { libc::_exit(0) }
        }
        pid => Ok(Child(pid)),
    }
}

fn temp_socket_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cxlkv-rtt-{}-{tag}.sock", std::process::id()))
}

/// Starts our server in a child process; returns it and its endpoint.
fn start_ours(case: &Case) -> anyhow::Result<(Child, Endpoint)> {
    let mut cfg = ServerConfig::default();
    cfg.io.backend = case.backend;
    (case.tweak)(&mut cfg);
    let ep = match case.kind {
        Kind::Unix => {
            let p = temp_socket_path("ours");
            let _ = std::fs::remove_file(&p);
            Endpoint::Unix(p)
        }
        Kind::Tcp => Endpoint::Tcp("127.0.0.1:0".parse()?),
    };
    let server = Server::bind(cfg, &[ep])?;
    let ep = server.endpoints()[0].clone();
    let reply = vec![0x5Au8; REPLY_PAYLOAD_BYTES];
    let child = fork_child(move || {
        if let Err(e) = server.run(EchoHandler { reply }) {
            eprintln!("rtt server: {e}");
        }
    })?;
    Ok((child, ep))
}

/// A connected raw socket.
enum RawSock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl RawSock {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            RawSock::Unix(s) => s.as_fd(),
            RawSock::Tcp(s) => s.as_fd(),
        }
    }
}

/// Busy-polling: sends all of `buf`.
fn raw_send(fd: BorrowedFd<'_>, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match sys::send(fd, &buf[off..]) {
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if Instant::now() > deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
    }
    Ok(())
}

/// Busy-polling: receives exactly `buf.len()` bytes.
fn raw_recv(fd: BorrowedFd<'_>, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match sys::recv(fd, &mut buf[off..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if Instant::now() > deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
    }
    Ok(())
}

/// The raw echo peer: for every 176 bytes received, 128 bytes back; spins.
fn raw_echo_server(kind: Kind) -> anyhow::Result<(Child, RawSock)> {
    let (child, sock) = match kind {
        Kind::Unix => {
            let p = temp_socket_path("raw");
            let _ = std::fs::remove_file(&p);
            let l = UnixListener::bind(&p)?;
            let child = fork_child(move || {
                if let Ok((s, _)) = l.accept() {
                    let _ = s.set_nonblocking(true);
                    raw_echo_loop(s.as_fd());
                }
            })?;
            let s = UnixStream::connect(&p)?;
            let _ = std::fs::remove_file(&p);
            (child, RawSock::Unix(s))
        }
        Kind::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            let addr = l.local_addr()?;
            let child = fork_child(move || {
                if let Ok((s, _)) = l.accept() {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_nonblocking(true);
                    raw_echo_loop(s.as_fd());
                }
            })?;
            let s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            (child, RawSock::Tcp(s))
        }
    };
    match &sock {
        RawSock::Unix(s) => s.set_nonblocking(true)?,
        RawSock::Tcp(s) => s.set_nonblocking(true)?,
    }
    Ok((child, sock))
}

fn raw_echo_loop(fd: BorrowedFd<'_>) {
    let reply = vec![0x5Au8; REPLY_WIRE_BYTES];
    let mut buf = vec![0u8; 64 << 10];
    let mut pending = 0usize;
    loop {
        match sys::recv(fd, &mut buf) {
            Ok(0) => return,
            Ok(n) => {
                pending += n;
                while pending >= REQUEST_WIRE_BYTES {
                    pending -= REQUEST_WIRE_BYTES;
                    if raw_send(fd, &reply, Instant::now() + RAW_TIMEOUT).is_err() {
                        return;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(_) => return,
        }
    }
}

pub(super) fn raw_latencies(
    kind: Kind,
    n: usize,
    gap: Option<Duration>,
) -> anyhow::Result<Vec<f64>> {
    let (_child, sock) = raw_echo_server(kind)?;
    let req = vec![0xA5u8; REQUEST_WIRE_BYTES];
    let mut rep = vec![0u8; REPLY_WIRE_BYTES];
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        if let Some(g) = gap {
            std::thread::sleep(g);
        }
        let t = Instant::now();
        raw_send(sock.fd(), &req, t + RAW_TIMEOUT)?;
        raw_recv(sock.fd(), &mut rep, t + RAW_TIMEOUT)?;
        if i >= n / 10 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

fn our_latencies(client: &RpcClient, n: usize, gap: Option<Duration>) -> anyhow::Result<Vec<f64>> {
    let req = vec![0xA5u8; REQUEST_PAYLOAD_BYTES];
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        if let Some(g) = gap {
            std::thread::sleep(g);
        }
        let t = Instant::now();
        let r = client.call(KIND, &req, CALL_TIMEOUT)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        anyhow::ensure!(r.payload().len() == REPLY_PAYLOAD_BYTES, "wrong reply size");
        if i >= n / 10 {
            out.push(us);
        }
    }
    Ok(out)
}

fn connect(ep: &Endpoint, backend: BackendChoice) -> anyhow::Result<RpcClient> {
    let mut cfg = ClientConfig::default();
    cfg.io.backend = backend;
    // The server child may still be starting its loop; connect is accepted
    // by the kernel backlog either way.
    Ok(RpcClient::connect(ep, cfg)?)
}

fn latency_case(args: &BenchArgs, r: &mut Reporter, case: &Case) -> anyhow::Result<()> {
    let n = match (args.quick, case.idle_gap.is_some()) {
        (true, true) => 100,
        (true, false) => 2_000,
        (false, true) => 500,
        (false, false) => 20_000,
    };
    let (_server, ep) = start_ours(case)?;
    let client = connect(&ep, case.backend)?;
    let backend = client_backend_name(case.backend);
    let (mut ours_p50, mut raw_p50, mut all_ours) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let mut raw = raw_latencies(case.kind, n, case.idle_gap)?;
        raw_p50.push(percentile(&mut raw, 50.0));
        let mut ours = our_latencies(&client, n, case.idle_gap)?;
        ours_p50.push(percentile(&mut ours, 50.0));
        all_ours.extend(ours);
    }
    let (ours, base) = (median(&mut ours_p50), median(&mut raw_p50));
    let rec = Record::new(SCENARIO, &case.name, ours, base, "us", Better::Lower)
        .with("p50_us", ours)
        .with("p99_us", percentile(&mut all_ours, 99.0))
        .with("raw_p50_us", base)
        .with("handler", "echo")
        .with("server", "forked process")
        .with("server_backend", backend)
        .with("round_trips_per_rep", n as u64)
        .with("reps", args.reps as u64)
        .with("request_wire_bytes", REQUEST_WIRE_BYTES as u64)
        .with("reply_wire_bytes", REPLY_WIRE_BYTES as u64);
    r.emit(&rec)?;
    Ok(())
}

fn client_backend_name(b: BackendChoice) -> &'static str {
    match b {
        BackendChoice::Fallback => "fallback",
        BackendChoice::Uring => "uring",
        _ => "default",
    }
}

const INFLIGHT: usize = 64;

fn throughput_case(args: &BenchArgs, r: &mut Reporter, case: &Case) -> anyhow::Result<()> {
    let rounds = if args.quick { 200 } else { 2_000 };
    let (_server, ep) = start_ours(case)?;
    let client = connect(&ep, case.backend)?;
    let req = vec![0xA5u8; REQUEST_PAYLOAD_BYTES];
    let (mut ours_rate, mut raw_rate) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        // Raw: 64 requests written back to back, then 64 replies read.
        let (_child, sock) = raw_echo_server(case.kind)?;
        let reqs = vec![0xA5u8; REQUEST_WIRE_BYTES * INFLIGHT];
        let mut reps = vec![0u8; REPLY_WIRE_BYTES * INFLIGHT];
        let t = Instant::now();
        for _ in 0..rounds {
            let dl = Instant::now() + RAW_TIMEOUT;
            raw_send(sock.fd(), &reqs, dl)?;
            raw_recv(sock.fd(), &mut reps, dl)?;
        }
        raw_rate.push((rounds * INFLIGHT) as f64 / t.elapsed().as_secs_f64());
        drop(_child);
        // Ours: 64 started, then 64 waited for, from one thread.
        let t = Instant::now();
        for _ in 0..rounds {
            let calls = (0..INFLIGHT)
                .map(|_| client.start(KIND, &req, CALL_TIMEOUT))
                .collect::<Result<Vec<_>, _>>()?;
            for c in calls {
                c.wait()?;
            }
        }
        ours_rate.push((rounds * INFLIGHT) as f64 / t.elapsed().as_secs_f64());
    }
    let (ours, base) = (median(&mut ours_rate), median(&mut raw_rate));
    let rec = Record::new(SCENARIO, &case.name, ours, base, "req/s", Better::Higher)
        .with("handler", "echo")
        .with("server", "forked process")
        .with("inflight", INFLIGHT as u64)
        .with("reps", args.reps as u64);
    r.emit(&rec)?;
    Ok(())
}

/// A change to the server configuration for one case.
type Tweak = fn(&mut ServerConfig);

fn no_tweak(_: &mut ServerConfig) {}

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let case = |name: &str, kind, backend, tweak: fn(&mut ServerConfig), idle_gap| Case {
        name: name.to_owned(),
        kind,
        backend,
        tweak,
        idle_gap,
    };
    let latency = [
        case(
            "transport=unix,backend=default",
            Kind::Unix,
            BackendChoice::Auto,
            no_tweak,
            None,
        ),
        case(
            "transport=tcp,backend=default",
            Kind::Tcp,
            BackendChoice::Auto,
            no_tweak,
            None,
        ),
        case(
            "transport=unix,backend=fallback",
            Kind::Unix,
            BackendChoice::Fallback,
            no_tweak,
            None,
        ),
        case(
            "transport=tcp,backend=fallback",
            Kind::Tcp,
            BackendChoice::Fallback,
            no_tweak,
            None,
        ),
        case(
            "transport=unix,backend=default,idle_gap_ms=1",
            Kind::Unix,
            BackendChoice::Auto,
            no_tweak,
            Some(Duration::from_millis(1)),
        ),
    ];
    for c in &latency {
        latency_case(args, r, c)?;
    }
    super::rtt_get::run(args, r)?;
    throughput_case(
        args,
        r,
        &case(
            "transport=unix,backend=default,inflight=64",
            Kind::Unix,
            BackendChoice::Auto,
            no_tweak,
            None,
        ),
    )?;
    if !args.quick {
        // The measurements behind the defaults (module essay of `transport`).
        let variants: [(&str, Tweak); 5] = [
            ("transport=unix,backend=uring,sqpoll=on", |c| {
                c.io.sqpoll = true
            }),
            ("transport=unix,backend=uring,taskrun=defer", |c| {
                c.io.taskrun = TaskRun::Defer
            }),
            ("transport=unix,backend=uring,taskrun=interrupt", |c| {
                c.io.taskrun = TaskRun::Interrupt
            }),
            ("transport=unix,backend=uring,spin_us=0", |c| {
                c.io.spin_us = 0
            }),
            (
                "transport=unix,backend=default,spin_us=2000,idle_gap_ms=1",
                |c| c.io.spin_us = 2000,
            ),
        ];
        for (name, tweak) in variants {
            let gap = name
                .contains("idle_gap")
                .then_some(Duration::from_millis(1));
            let backend = if name.contains("uring") {
                BackendChoice::Uring
            } else {
                BackendChoice::Auto
            };
            if let Err(e) = latency_case(args, r, &case(name, Kind::Unix, backend, tweak, gap)) {
                r.note(&format!("{name}: skipped: {e:#}"));
            }
        }
    }
    let _ = std::fs::remove_file(temp_socket_path("ours"));
    Ok(())
}
