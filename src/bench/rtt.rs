//! `cxlkv bench rtt`: control-plane round trip of a one-key request
//! through the real directory server and the transport's pipelining client,
//! against a raw busy-polling socket ping-pong of the same byte counts,
//! measured in the same run.
//!
//! **Ours.** The directory server ([`crate::server::Server`], embedded pool
//! manager) runs in a **forked child process**, as a real server does: on 2
//! vCPUs, a server thread inside the bench process would share the process's
//! scheduler accounting and allocator with the client and be easier to
//! co-schedule than a real deployment allows. The bench opens a session
//! (`Hello`), registers one 100-byte key, and times `Exists` of that key:
//! encoded once beforehand (encoding is the client library's cost), sent with
//! `RpcClient::call`, until the reply frame is in hand; the reply is checked
//! (the key present) after the clock stops. The server decodes and validates
//! the frame, looks the key up in the directory and encodes the reply: the
//! whole server path of a read-only one-key request.
//!
//! **Baseline.** A forked child that busy-polls a socket of the same kind and
//! answers every request of our request's wire size with our reply's wire
//! size; the bench busy-polls too. It is the transport floor: no framing, no
//! decode, no directory. `ratio` = raw p50 ÷ our p50 (1 would be the floor).
//! The raw child spins without pause, so it is started for its own
//! measurement and killed after; ours sleeps after `spin_us` idle and stays
//! up for the case. Reps alternate raw and ours; each rep's p50 is taken.
//! `ours` and `baseline` are the medians over reps of our p50 and the raw
//! p50, and `ratio` = median raw p50 ÷ median our p50 (a ratio of medians:
//! the two medians may come from different reps). `ratio_paired_median` is
//! the median of the reps' own ratios (each rep's raw p50 ÷ its p50), and
//! `ratio_min`/`ratio_max` their extremes; where `ratio` and
//! `ratio_paired_median` differ, the host drifted between reps.
//!
//! **Backends.** Every record names the transport backends that actually
//! ran (`server_backend`, `client_backend`): `backend=default` resolves
//! `CXLKV_IO` or the measured default, and falls back to epoll where
//! io_uring cannot be set up. A case that asks for io_uring on an end
//! (`backend=uring`, the `sqpoll`/`taskrun`/`client=uring` variants) is
//! probed first (`probe_uring`, with that end's flags); where io_uring is
//! unavailable it is not run but reported with `skipped: true`, the reason
//! (`skip_reason`), zeros for `ours`, `baseline` and `ratio`, and a note on
//! standard error, and the scenario goes on.
//!
//! The server's pool is `--pool` when given (`pool`, `dest`); a one-key
//! `Exists` does not touch the pool's memory, so it is named, not measured.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::frame::{Frame, frame_len};
use cxlkv_controlplane::proto::{self, Kind as MsgKind, RequestMeta};
use cxlkv_controlplane::transport::{
    BackendChoice, ClientConfig, Endpoint, IoConfig, Reply, RpcClient, TaskRun, probe_uring, sys,
};

use super::forked_server::{ForkedServer, bench_config};
use super::pool_target::BenchPool;
use super::server::{Client as SessionClient, LAYOUT, key, payload, populate};
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;

const SCENARIO: &str = "rtt";
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on every raw-socket wait (the raw peers spin, so this is a hang guard).
const RAW_TIMEOUT: Duration = Duration::from_secs(10);
/// The pool of the forked server: room for the one region the bench takes.
const POOL_BYTES: u64 = 256 << 20;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Unix,
    Tcp,
}

/// A change to both ends' transport configuration for one case.
type Tweak = fn(&mut IoConfig, &mut ClientConfig);

struct Case {
    name: &'static str,
    kind: Kind,
    /// Backend of the server and of the client.
    server: BackendChoice,
    client: BackendChoice,
    tweak: Tweak,
    idle_gap: Option<Duration>,
    /// Round trips per rep when the default count would take too long.
    round_trips: Option<usize>,
}

impl Case {
    /// Both ends' configuration.
    fn configs(&self) -> (IoConfig, ClientConfig) {
        let (mut s, mut c) = (IoConfig::default(), ClientConfig::default());
        s.backend = self.server;
        c.io.backend = self.client;
        (self.tweak)(&mut s, &mut c);
        (s, c)
    }
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

/// Runs `body` in a forked child that never returns into the bench, and
/// dies with it (`SIGKILL` when the forking thread — the bench's main
/// thread — ends): a bench stopped by a signal runs no destructors, and a
/// forked server, which outlives `SIGINT` and `SIGTERM`, would otherwise
/// run on.
pub(super) fn fork_child(body: impl FnOnce()) -> anyhow::Result<Child> {
    // SAFETY: getpid() takes no arguments.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the bench is single-threaded here (client threads are joined
    // before every fork), so the child's only thread is a copy of this one
    // and no lock can be held by a thread that does not exist in it.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()).context("fork"),
        0 => {
            if super::die_with_parent(libc::SIGKILL, parent).is_err() {
                // SAFETY: as below; the bench is gone or prctl failed.
                unsafe { libc::_exit(1) }
            }
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

/// Our server (in a child process) and a client with a session on it.
pub(super) struct Ours {
    pub(super) server: ForkedServer,
    pub(super) client: RpcClient,
    server_backend: String,
    /// `Exists` of the one registered key, encoded once.
    pub(super) request: Vec<u8>,
    /// Its reply (kind, payload), as the server sent it.
    pub(super) reply: (u16, Vec<u8>),
    request_wire_bytes: usize,
    reply_wire_bytes: usize,
}

/// Starts the directory server in a child process, opens a session,
/// registers one key, and measures the wire size of the timed exchange.
fn start_ours(case: &Case, target: &BenchPool) -> anyhow::Result<Ours> {
    let (io, client_cfg) = case.configs();
    let mut cfg = bench_config("bench-rtt", POOL_BYTES);
    cfg.io = io;
    cfg.default_region_bytes = 64 << 20;
    // The session is idle while the raw baseline runs, which on a loaded
    // host can take longer than the default lease.
    cfg.directory.session_lease = Duration::from_secs(3600);
    if case.kind == Kind::Tcp {
        cfg.tcp_listen = Some("127.0.0.1:0".parse()?);
        // The bench's loopback client has no secret; the secret check is a
        // comparison at Hello, outside the timed requests.
        cfg.tcp_insecure_no_secret = true;
    }
    let server = ForkedServer::start(cfg, target)?;
    let ep = match case.kind {
        Kind::Unix => Endpoint::Unix(server.socket().to_owned()),
        Kind::Tcp => Endpoint::Tcp(
            server
                .tcp_addr()
                .context("the server has no TCP listener")?,
        ),
    };
    let mut session = SessionClient::connect(&ep, client_cfg)?;
    populate(&mut session, 1)?;
    let request = payload(
        &mut Vec::new(),
        &proto::Exists {
            meta: RequestMeta::default(),
            layout: LAYOUT,
            keys: vec![key(0)],
        },
    )?;
    let reply = session
        .rpc
        .call(MsgKind::Exists.as_u16(), &request, CALL_TIMEOUT)?;
    check_present(&reply)?;
    Ok(Ours {
        server_backend: server.backend().to_owned(),
        server,
        client: session.rpc,
        request_wire_bytes: frame_len(request.len()),
        reply_wire_bytes: frame_len(reply.payload().len()),
        reply: (reply.header.kind, reply.payload().to_vec()),
        request,
    })
}

/// [`start_ours`] for `transport=unix,backend=default`.
pub(super) fn start_default_unix(target: &BenchPool) -> anyhow::Result<Ours> {
    let case = Case {
        name: "transport=unix,backend=default",
        kind: Kind::Unix,
        server: BackendChoice::Auto,
        client: BackendChoice::Auto,
        tweak: no_tweak,
        idle_gap: None,
        round_trips: None,
    };
    start_ours(&case, target)
}

/// The reply says the one key is present.
fn check_present(reply: &Reply) -> anyhow::Result<()> {
    let frame = Frame {
        header: reply.header,
        payload: reply.payload(),
    };
    match proto::access_reply::<proto::ExistsReply>(frame)? {
        Ok(r) => anyhow::ensure!(
            r.present.iter().filter(|&p| p).count() == 1,
            "the registered key is missing"
        ),
        Err(e) => anyhow::bail!("exists: {} (code {})", e.message(), e.code()),
    }
    Ok(())
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
pub(super) fn raw_send(fd: BorrowedFd<'_>, buf: &[u8], deadline: Instant) -> io::Result<()> {
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
pub(super) fn raw_recv(fd: BorrowedFd<'_>, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
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

/// The raw echo peer: for every `req` bytes received, `rep` bytes back;
/// spins. See [`raw_echo_server_of`].
fn raw_echo_server(kind: Kind, req: usize, rep: usize) -> anyhow::Result<(Child, RawSock)> {
    raw_echo_server_of(kind, vec![(req, rep)])
}

/// The raw echo peer of a cycle of messages: the `i`-th request received is
/// `msgs[i % len].0` bytes and answered with `msgs[i % len].1`; spins. The
/// replies to every request a receive completed go out in one `send` — a
/// transport ceiling, as our server answers a turn's requests with one
/// write.
fn raw_echo_server_of(kind: Kind, msgs: Vec<(usize, usize)>) -> anyhow::Result<(Child, RawSock)> {
    anyhow::ensure!(
        !msgs.is_empty() && msgs.iter().all(|&(req, _)| req > 0),
        "a raw exchange needs messages of at least one byte"
    );
    let (child, sock) = match kind {
        Kind::Unix => {
            let p = temp_socket_path("raw");
            let _ = std::fs::remove_file(&p);
            let l = UnixListener::bind(&p)?;
            let child = fork_child(move || {
                if let Ok((s, _)) = l.accept() {
                    let _ = s.set_nonblocking(true);
                    raw_echo_loop(s.as_fd(), &msgs);
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
                    raw_echo_loop(s.as_fd(), &msgs);
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

fn raw_echo_loop(fd: BorrowedFd<'_>, msgs: &[(usize, usize)]) {
    let mut buf = vec![0u8; 64 << 10];
    let mut out: Vec<u8> = Vec::new();
    // Bytes of the current request received so far, and which it is.
    let (mut pending, mut next) = (0usize, 0usize);
    loop {
        match sys::recv(fd, &mut buf) {
            Ok(0) => return,
            Ok(n) => {
                pending += n;
                out.clear();
                while pending >= msgs[next].0 {
                    pending -= msgs[next].0;
                    out.resize(out.len() + msgs[next].1, 0x5A);
                    next = (next + 1) % msgs.len();
                }
                if !out.is_empty() && raw_send(fd, &out, Instant::now() + RAW_TIMEOUT).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(_) => return,
        }
    }
}

/// Raw round trips of `(request, reply)` wire bytes (µs each).
pub(super) fn raw_latencies(
    kind: Kind,
    (req_bytes, rep_bytes): (usize, usize),
    n: usize,
    gap: Option<Duration>,
) -> anyhow::Result<Vec<f64>> {
    raw_exchanges(kind, &[(req_bytes, rep_bytes)], n, gap)
}

/// Raw exchanges of several messages (µs each): every request of `msgs`
/// sent with a `send` of its own, back to back, then every reply read — as
/// a client with requests queued ahead of its call sends them.
pub(super) fn raw_exchanges(
    kind: Kind,
    msgs: &[(usize, usize)],
    n: usize,
    gap: Option<Duration>,
) -> anyhow::Result<Vec<f64>> {
    let (_child, sock) = raw_echo_server_of(kind, msgs.to_vec())?;
    let reqs: Vec<Vec<u8>> = msgs.iter().map(|&(req, _)| vec![0xA5u8; req]).collect();
    let mut rep = vec![0u8; msgs.iter().map(|&(_, rep)| rep).sum()];
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        if let Some(g) = gap {
            std::thread::sleep(g);
        }
        let t = Instant::now();
        for req in &reqs {
            raw_send(sock.fd(), req, t + RAW_TIMEOUT)?;
        }
        raw_recv(sock.fd(), &mut rep, t + RAW_TIMEOUT)?;
        if i >= n / 10 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

fn our_latencies(ours: &Ours, n: usize, gap: Option<Duration>) -> anyhow::Result<Vec<f64>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        if let Some(g) = gap {
            std::thread::sleep(g);
        }
        let t = Instant::now();
        let r = ours
            .client
            .call(MsgKind::Exists.as_u16(), &ours.request, CALL_TIMEOUT)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        check_present(&r)?;
        if i >= n / 10 {
            out.push(us);
        }
    }
    Ok(out)
}

/// The reps' own ratios, `raw[i] / ours[i]` for latencies (or `ours[i] /
/// raw[i]` for rates, with `rates`), before any median reorders them.
pub(super) fn paired_ratios(raw: &[f64], ours: &[f64], rates: bool) -> Vec<f64> {
    raw.iter()
        .zip(ours)
        .map(|(&r, &o)| match (rates, r > 0.0 && o > 0.0) {
            (_, false) => 0.0,
            (false, true) => r / o,
            (true, true) => o / r,
        })
        .collect()
}

/// Adds `ratio_paired_median`, `ratio_min` and `ratio_max` from the reps'
/// own ratios (module docs).
pub(super) fn with_paired(record: Record, mut ratios: Vec<f64>) -> Record {
    record
        .with("ratio_paired_median", median(&mut ratios))
        .with("ratio_min", percentile(&mut ratios, 0.0))
        .with("ratio_max", percentile(&mut ratios, 100.0))
}

fn latency_case(
    args: &BenchArgs,
    r: &mut Reporter,
    case: &Case,
    target: &BenchPool,
) -> anyhow::Result<()> {
    if let Some(why) = uring_unavailable(case) {
        return skip(r, case, "us", &why, target);
    }
    let n = case
        .round_trips
        .unwrap_or(match (args.quick, case.idle_gap.is_some()) {
            (true, true) => 100,
            (true, false) => 2_000,
            (false, true) => 500,
            (false, false) => 20_000,
        });
    let ours = start_ours(case, target)?;
    let (mut ours_p50, mut raw_p50, mut all_ours) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let sizes = (ours.request_wire_bytes, ours.reply_wire_bytes);
        let mut raw = raw_latencies(case.kind, sizes, n, case.idle_gap)?;
        raw_p50.push(percentile(&mut raw, 50.0));
        let mut ours = our_latencies(&ours, n, case.idle_gap)?;
        ours_p50.push(percentile(&mut ours, 50.0));
        all_ours.extend(ours);
    }
    let ratios = paired_ratios(&raw_p50, &ours_p50, false);
    let (p50, base) = (median(&mut ours_p50), median(&mut raw_p50));
    let rec = Record::new(SCENARIO, case.name, p50, base, "us", Better::Lower)
        .with("p50_us", p50)
        .with("p99_us", percentile(&mut all_ours, 99.0))
        .with("raw_p50_us", base)
        .with("handler", "directory")
        .with("request", "exists, one 100-byte key (present)")
        .with("server", "forked process")
        .with("server_backend", ours.server_backend.as_str())
        .with("client_backend", ours.client.backend().to_string())
        .with("round_trips_per_rep", n as u64)
        .with("reps", args.reps as u64)
        .with("request_wire_bytes", ours.request_wire_bytes as u64)
        .with("reply_wire_bytes", ours.reply_wire_bytes as u64);
    r.emit(&target.tag(with_paired(rec, ratios)))?;
    Ok(())
}

/// Why `case` cannot run on this host: an end that asks for io_uring
/// (explicitly, or through `CXLKV_IO`) where io_uring with that end's flags
/// cannot be set up.
fn uring_unavailable(case: &Case) -> Option<String> {
    let (server, client) = case.configs();
    [("server", &server), ("client", &client.io)]
        .into_iter()
        .filter(|(_, io)| matches!(io.backend.resolve_env(), Ok(BackendChoice::Uring)))
        .find_map(|(end, io)| probe_uring(io).err().map(|e| format!("{end}: {e}")))
}

/// Reports `case` as not run (module docs).
fn skip(
    r: &mut Reporter,
    case: &Case,
    unit: &str,
    why: &str,
    target: &BenchPool,
) -> anyhow::Result<()> {
    r.note(&format!("rtt {}: skipped: {why}", case.name));
    let rec = Record::new(SCENARIO, case.name, 0.0, 0.0, unit, Better::Lower)
        .with("skipped", true)
        .with("skip_reason", why)
        .with("server_backend", "none")
        .with("client_backend", "none")
        .with("server_backend_requested", choice_name(case.server))
        .with("client_backend_requested", choice_name(case.client));
    r.emit(&target.tag(rec))?;
    Ok(())
}

fn choice_name(choice: BackendChoice) -> &'static str {
    match choice {
        BackendChoice::Auto => "default",
        BackendChoice::Uring => "uring",
        BackendChoice::Fallback => "fallback",
        _ => "other",
    }
}

const INFLIGHT: usize = 64;

fn throughput_case(
    args: &BenchArgs,
    r: &mut Reporter,
    case: &Case,
    target: &BenchPool,
) -> anyhow::Result<()> {
    if let Some(why) = uring_unavailable(case) {
        return skip(r, case, "req/s", &why, target);
    }
    let rounds = if args.quick { 200 } else { 2_000 };
    let ours = start_ours(case, target)?;
    let client = &ours.client;
    let (req_bytes, rep_bytes) = (ours.request_wire_bytes, ours.reply_wire_bytes);
    let (mut ours_rate, mut raw_rate) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        // Raw: 64 requests written back to back, each with a `send` of its
        // own (as our client starts each call), then 64 replies read; the
        // peer answers what each receive completed with one `send`.
        let (_child, sock) = raw_echo_server(case.kind, req_bytes, rep_bytes)?;
        let req = vec![0xA5u8; req_bytes];
        let mut reps = vec![0u8; rep_bytes * INFLIGHT];
        let t = Instant::now();
        for _ in 0..rounds {
            let dl = Instant::now() + RAW_TIMEOUT;
            for _ in 0..INFLIGHT {
                raw_send(sock.fd(), &req, dl)?;
            }
            raw_recv(sock.fd(), &mut reps, dl)?;
        }
        raw_rate.push((rounds * INFLIGHT) as f64 / t.elapsed().as_secs_f64());
        drop(_child);
        // Ours: 64 started, then 64 waited for, from one thread.
        let t = Instant::now();
        for _ in 0..rounds {
            let calls = (0..INFLIGHT)
                .map(|_| client.start(MsgKind::Exists.as_u16(), &ours.request, CALL_TIMEOUT))
                .collect::<Result<Vec<_>, _>>()?;
            for c in calls {
                check_present(&c.wait()?)?;
            }
        }
        ours_rate.push((rounds * INFLIGHT) as f64 / t.elapsed().as_secs_f64());
    }
    let ratios = paired_ratios(&raw_rate, &ours_rate, true);
    let (rate, base) = (median(&mut ours_rate), median(&mut raw_rate));
    let rec = Record::new(SCENARIO, case.name, rate, base, "req/s", Better::Higher)
        .with("handler", "directory")
        .with("request", "exists, one 100-byte key (present)")
        .with("server", "forked process")
        .with("server_backend", ours.server_backend.as_str())
        .with("client_backend", client.backend().to_string())
        .with("inflight", INFLIGHT as u64)
        .with("reps", args.reps as u64)
        .with("request_wire_bytes", req_bytes as u64)
        .with("reply_wire_bytes", rep_bytes as u64);
    r.emit(&target.tag(with_paired(rec, ratios)))?;
    Ok(())
}

fn no_tweak(_: &mut IoConfig, _: &mut ClientConfig) {}

const GAP: Option<Duration> = Some(Duration::from_millis(1));
/// Round trips per rep of the SQPOLL cases.
const SQPOLL_ROUND_TRIPS: usize = 200;

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    use BackendChoice::{Auto, Fallback, Uring};
    let target = BenchPool::from_args(args)?;
    let case = |name, kind, (server, client), tweak: Tweak, idle_gap| Case {
        name,
        kind,
        server,
        client,
        tweak,
        idle_gap,
        round_trips: None,
    };
    let latency = [
        case(
            "transport=unix,backend=default",
            Kind::Unix,
            (Auto, Auto),
            no_tweak,
            None,
        ),
        case(
            "transport=tcp,backend=default",
            Kind::Tcp,
            (Auto, Auto),
            no_tweak,
            None,
        ),
        // The fallback on both ends.
        case(
            "transport=unix,backend=fallback",
            Kind::Unix,
            (Fallback, Fallback),
            no_tweak,
            None,
        ),
        case(
            "transport=tcp,backend=fallback",
            Kind::Tcp,
            (Fallback, Fallback),
            no_tweak,
            None,
        ),
        // io_uring on both ends (the client's io_uring wire).
        case(
            "transport=unix,backend=uring",
            Kind::Unix,
            (Uring, Uring),
            no_tweak,
            None,
        ),
        case(
            "transport=unix,backend=default,idle_gap_ms=1",
            Kind::Unix,
            (Auto, Auto),
            no_tweak,
            GAP,
        ),
    ];
    for c in &latency {
        latency_case(args, r, c, &target)?;
    }
    // Where the default case's time goes: each end against a raw peer.
    super::rtt_split::run(args, r, &target)?;
    super::rtt_get::run(args, r, &target)?;
    throughput_case(
        args,
        r,
        &case(
            "transport=unix,backend=default,inflight=64",
            Kind::Unix,
            (Auto, Auto),
            no_tweak,
            None,
        ),
        &target,
    )?;
    if !args.quick {
        // The measurements behind the defaults (module essay of `transport`).
        let variants: [(&'static str, (BackendChoice, BackendChoice), Tweak); 8] = [
            // The server waits for every request through its backend, as
            // before `spin_recv` (transport essay).
            (
                "transport=unix,backend=default,spin_recv=off",
                (Auto, Auto),
                |s, _| s.spin_recv = false,
            ),
            // SQPOLL: a kernel thread submits and runs receive work (the
            // task-run flags do not apply; the kernel refuses them with it).
            (
                "transport=unix,backend=uring,sqpoll=on",
                (Uring, Auto),
                |s, _| s.sqpoll = true,
            ),
            (
                "transport=unix,backend=uring,sqpoll=on,client=uring_sqpoll",
                (Uring, Uring),
                |s, c| {
                    s.sqpoll = true;
                    c.io.sqpoll = true;
                },
            ),
            (
                "transport=unix,backend=uring,taskrun=coop",
                (Uring, Auto),
                |s, _| s.taskrun = TaskRun::Coop,
            ),
            (
                "transport=unix,backend=uring,taskrun=interrupt",
                (Uring, Auto),
                |s, _| s.taskrun = TaskRun::Interrupt,
            ),
            (
                "transport=unix,backend=uring,spin_us=0",
                (Uring, Auto),
                |s, c| {
                    s.spin_us = 0;
                    c.io.spin_us = 0;
                },
            ),
            (
                "transport=unix,backend=default,client=uring",
                (Auto, Uring),
                no_tweak,
            ),
            (
                "transport=unix,backend=default,spin_us=2000,idle_gap_ms=1",
                (Auto, Auto),
                |s, c| {
                    s.spin_us = 2000;
                    c.io.spin_us = 2000;
                },
            ),
        ];
        for (name, ends, tweak) in variants {
            let gap = name
                .contains("idle_gap")
                .then_some(Duration::from_millis(1));
            let mut c = case(name, Kind::Unix, ends, tweak, gap);
            if name.contains("sqpoll") {
                // Measured at ~10-30 ms per round trip on a loaded 2-vCPU
                // host (see the transport essay): keep the case short.
                c.round_trips = Some(SQPOLL_ROUND_TRIPS);
            }
            latency_case(args, r, &c, &target)?;
        }
    }
    let _ = std::fs::remove_file(temp_socket_path("ours"));
    Ok(())
}
