//! Helpers for the tests that run real `cxlkv pool` daemons: start, kill and
//! restart a daemon on a temporary directory under `/dev/shm`, and speak the
//! pool protocol to it (typed calls over the transport client, and raw
//! frames for malformed input). Included with `mod pool_support;`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::{Decoded, Frame, FrameDecoder};
use cxlkv_controlplane::proto::{
    self, AllocRegion, ErrorCode, Message, OwnerLabel, PoolHello, PoolStats, PoolStatsReply,
    PoolWelcome, RegionAllocated, RegionHandle, RegionList, RequestMeta,
};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient};

pub const TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on waiting for a daemon to come up or for a timer to act.
pub const EVENTUALLY: Duration = Duration::from_secs(120);
pub const POOL_BYTES: u64 = 64 << 20;
pub const ALIGN: u64 = 4096;

/// A temporary directory under `/dev/shm`, removed on drop.
pub fn shm_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cxlkv-{name}-"))
        .tempdir_in("/dev/shm")
        .expect("a temporary directory under /dev/shm")
}

pub fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < EVENTUALLY, "gave up waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How to start a daemon.
#[derive(Debug, Clone)]
pub struct DaemonSpec {
    pub dir: PathBuf,
    pub sync: &'static str,
    pub grace_ms: u64,
    /// `CXLKV_IO` for the daemon (`None`: its default).
    pub io: Option<&'static str>,
    pub tcp: bool,
    /// Where its standard error goes, logging at `info` (`None`: inherited,
    /// at `warn`).
    pub log: Option<PathBuf>,
}

impl DaemonSpec {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            sync: "per-record",
            grace_ms: 60_000,
            io: None,
            tcp: false,
            log: None,
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("pool.sock")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn pool(&self) -> PathBuf {
        self.dir.join("pool")
    }

    /// The `cxlkv pool` command line, with `state`/`pool`/`socket` overridable.
    pub fn command(&self, state: &Path, pool: &Path, socket: &Path) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
        c.arg("pool")
            .arg("--pool")
            .arg(format!(
                "{},size={POOL_BYTES},align={ALIGN}",
                pool.display()
            ))
            .arg("--state-dir")
            .arg(state)
            .arg("--socket")
            .arg(socket)
            .arg("--sync")
            .arg(self.sync)
            .arg("--grace-ms")
            .arg(self.grace_ms.to_string())
            .env(
                "CXLKV_LOG",
                if self.log.is_some() { "info" } else { "warn" },
            );
        if self.tcp {
            c.arg("--tcp").arg("127.0.0.1:0").arg("--tcp-insecure");
        }
        match self.io {
            Some(io) => c.env("CXLKV_IO", io),
            None => c.env_remove("CXLKV_IO"),
        };
        c
    }
}

/// A running `cxlkv pool`; killed and reaped on drop.
pub struct Daemon {
    pub spec: DaemonSpec,
    child: Option<Child>,
    /// The endpoints from its `listening …` line.
    pub endpoints: Vec<String>,
}

impl Daemon {
    pub fn start(spec: &DaemonSpec) -> Self {
        let stderr = match &spec.log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("the daemon's log file")),
            None => Stdio::inherit(),
        };
        let mut child = spec
            .command(&spec.state_dir(), &spec.pool(), &spec.socket())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn cxlkv pool");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("listening ") {
                    let _ = tx.send(rest.split(' ').map(str::to_owned).collect::<Vec<_>>());
                }
            }
        });
        let endpoints = match rx.recv_timeout(EVENTUALLY) {
            Ok(e) => e,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait();
                panic!("cxlkv pool did not start (exit: {status:?})");
            }
        };
        Self {
            spec: spec.clone(),
            child: Some(child),
            endpoints,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn tcp_endpoint(&self) -> Endpoint {
        let addr = self
            .endpoints
            .iter()
            .find_map(|e| e.strip_prefix("tcp:"))
            .expect("the daemon listens on TCP");
        Endpoint::Tcp(addr.parse().expect("a socket address"))
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        c.wait().expect("wait for cxlkv pool")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Typed calls over the transport client.
pub struct Wire {
    pub client: RpcClient,
}

pub type WireResult<R> = Result<R, (ErrorCode, String)>;

pub fn payload_of<M: Message>(msg: &M) -> Vec<u8> {
    let mut buf = Vec::new();
    proto::encode(0, msg, &mut buf).expect("encode");
    buf.split_off(24)
}

pub fn decode_reply<R: Message>(
    header: cxlkv_controlplane::frame::FrameHeader,
    payload: &[u8],
) -> WireResult<R> {
    let frame = Frame { header, payload };
    match proto::access_reply::<R>(frame).expect("a valid reply frame") {
        Ok(a) => Ok(proto::deserialize::<R>(a).expect("deserialize")),
        Err(e) => Err((
            e.error_code().expect("a known error code"),
            e.message().to_owned(),
        )),
    }
}

impl Wire {
    pub fn connect(endpoint: &Endpoint) -> Self {
        Self {
            client: RpcClient::connect(endpoint, ClientConfig::default()).expect("connect"),
        }
    }

    pub fn unix(path: &Path) -> Self {
        Self::connect(&Endpoint::Unix(path.to_owned()))
    }

    pub fn call<M: Message, R: Message>(&self, msg: &M) -> WireResult<R> {
        let reply = self
            .client
            .call(M::KIND.as_u16(), &payload_of(msg), TIMEOUT)
            .expect("a reply from the daemon");
        decode_reply(reply.header, reply.payload())
    }

    pub fn hello(&self, directory: &str) -> PoolWelcome {
        self.call(&PoolHello {
            meta: RequestMeta::default(),
            protocol_min: 1,
            protocol_max: 1,
            directory_id: directory.into(),
            secret: None,
        })
        .expect("welcome")
    }

    pub fn alloc(&self, directory: &str, seq: u64) -> WireResult<RegionHandle> {
        self.call::<_, RegionAllocated>(&alloc_msg(directory, seq))
            .map(|r| r.handle)
    }

    pub fn stats(&self) -> PoolStatsReply {
        self.call(&PoolStats {
            meta: RequestMeta::default(),
        })
        .expect("stats")
    }

    /// Every region of the connection's directory, by id.
    pub fn list(&self) -> Vec<RegionHandle> {
        let mut out = Vec::new();
        let mut after = 0;
        loop {
            let l: RegionList = self
                .call(&proto::ListRegions {
                    meta: RequestMeta::default(),
                    after_region: after,
                    max_handles: 4096,
                })
                .expect("a region list");
            after = l.handles.last().map_or(after, |h| h.region);
            out.extend(l.handles);
            if !l.more {
                return out;
            }
        }
    }
}

pub fn alloc_msg(directory: &str, seq: u64) -> AllocRegion {
    AllocRegion {
        meta: RequestMeta {
            seq,
            ..RequestMeta::default()
        },
        pool: None,
        len_bytes: ALIGN,
        owner: OwnerLabel {
            directory_id: directory.into(),
            instance_id: "inst".into(),
        },
    }
}

/// Raw bytes on a Unix socket, for frames the typed client cannot send.
pub struct Raw {
    sock: UnixStream,
    decoder: FrameDecoder,
}

impl Raw {
    pub fn connect(path: &Path) -> Self {
        let sock = UnixStream::connect(path).expect("connect");
        sock.set_read_timeout(Some(TIMEOUT)).unwrap();
        Self {
            sock,
            decoder: FrameDecoder::new(),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("write to the daemon");
    }

    /// A frame header with any payload length (even an illegal one).
    pub fn header(kind: u16, request_id: u64, payload_len: u32) -> [u8; 24] {
        let mut h = [0u8; 24];
        h[0..4].copy_from_slice(b"CXKV");
        h[4..6].copy_from_slice(&1u16.to_le_bytes());
        h[6..8].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&request_id.to_le_bytes());
        h[16..20].copy_from_slice(&payload_len.to_le_bytes());
        h
    }

    /// A whole frame for `msg`.
    pub fn frame<M: Message>(request_id: u64, msg: &M) -> Vec<u8> {
        let mut buf = Vec::new();
        proto::encode(request_id, msg, &mut buf).expect("encode");
        buf
    }

    /// Reads the next reply frame: (request id, decoded reply).
    pub fn recv<R: Message>(&mut self) -> (u64, WireResult<R>) {
        loop {
            match self.decoder.decode().expect("a well-framed reply stream") {
                Some(Decoded::Frame(f)) => {
                    return (f.header.request_id, decode_reply(f.header, f.payload));
                }
                Some(Decoded::Rejected { header, error }) => {
                    panic!("the daemon sent a refused frame {header:?}: {error}")
                }
                None => {}
            }
            let mut buf = [0u8; 64 << 10];
            let n = self.sock.read(&mut buf).expect("read from the daemon");
            assert!(n > 0, "the daemon closed the connection");
            self.decoder.push(&buf[..n]);
        }
    }

    /// True when the daemon closed this connection (reads EOF).
    pub fn closed_by_peer(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match self.sock.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
    }
}
