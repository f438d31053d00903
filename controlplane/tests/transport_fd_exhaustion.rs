//! A server that runs out of descriptors while connections wait to be
//! accepted pauses accepting (a bounded, timer-driven backoff) instead of
//! retrying at once: its loop does not spin and its log is not flooded;
//! once descriptors are free again the waiting connections are served.
//!
//! Its own test binary: it lowers `RLIMIT_NOFILE`, which applies to the
//! whole process, so no other test may run beside it.

mod transport_common;

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::{Decoded, FrameDecoder, encode_frame};
use cxlkv_controlplane::transport::Endpoint;
use transport_common::*;

fn nofile() -> libc::rlimit {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r
}

fn set_nofile(r: &libc::rlimit) {
    // SAFETY: `r` is a valid rlimit.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, r) };
    assert_eq!(rc, 0, "setrlimit: {}", io::Error::last_os_error());
}

/// The highest descriptor open in this process.
fn highest_open_fd() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap()
}

/// Leaves the process without a free descriptor (within the soft limit):
/// fills every free one. Returns the fillers.
fn use_up_descriptors() -> Vec<std::fs::File> {
    let mut fillers = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => fillers.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => return fillers,
            Err(e) => panic!("open /dev/null: {e}"),
        }
    }
}

/// A Unix stream socket, not connected yet (made while descriptors last).
fn unix_socket() -> OwnedFd {
    // SAFETY: plain syscall; a non-negative result is a new descriptor.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(raw >= 0, "socket: {}", io::Error::last_os_error());
    // SAFETY: `raw` was just returned by socket and is owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

/// Connects `fd` to `path` (needs no new descriptor in this process).
fn connect(fd: OwnedFd, path: &Path) -> UnixStream {
    // SAFETY: an all-zero sockaddr_un is valid; the path is copied in below.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    assert!(bytes.len() < sa.sun_path.len(), "socket path too long");
    for (d, s) in sa.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let s = UnixStream::from(fd);
    // SAFETY: `sa` is a valid sockaddr_un of the stated size.
    let rc = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            (&raw const sa).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "connect: {}", io::Error::last_os_error());
    s
}

fn echo_over(s: &mut UnixStream, id: u64) {
    let mut f = Vec::new();
    encode_frame(&mut f, ECHO, id, b"served at last").unwrap();
    s.write_all(&f).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    let mut d = FrameDecoder::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(Decoded::Frame(fr)) = d.decode().unwrap() {
            assert_eq!(fr.header.request_id, id);
            assert_eq!(fr.payload, b"served at last");
            return;
        }
        let n = s.read(&mut buf).expect("a reply once descriptors are back");
        assert!(n > 0, "the waiting connection was closed instead of served");
        d.push(&buf[..n]);
    }
}

#[test]
fn accepting_without_descriptors_pauses_instead_of_spinning_then_resumes() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .init();
    const WAITING: usize = 3;
    let saved = nofile();
    for backend in server_backends() {
        // A low limit before the server starts: io_uring's accept takes the
        // limit in force when it is armed.
        set_nofile(&libc::rlimit {
            rlim_cur: highest_open_fd() + 64,
            rlim_max: saved.rlim_max,
        });
        let f = start(backend, server_config(backend));
        let Endpoint::Unix(path) = f.unix.clone() else {
            unreachable!()
        };
        let c = f.client(&f.unix);
        assert_eq!(c.call(ECHO, b"up", LONG).unwrap().payload(), b"up");
        let sockets: Vec<OwnedFd> = (0..WAITING).map(|_| unix_socket()).collect();
        let warned_before = logs.lines_with("accept");
        let fillers = use_up_descriptors();
        // They wait in the listener's backlog; every accept fails (EMFILE).
        let mut waiting: Vec<UnixStream> = sockets.into_iter().map(|s| connect(s, &path)).collect();
        let window = Duration::from_millis(600);
        let before = f.seen.loop_cpu_time();
        let t0 = Instant::now();
        std::thread::sleep(window);
        let cpu = f.seen.loop_cpu_time() - before;
        let wall = t0.elapsed();
        let warned = logs.lines_with("accept") - warned_before;
        drop(fillers);
        assert!(
            cpu < Duration::from_millis(60),
            "{backend:?}: the loop used {cpu:?} of CPU in {wall:?} waiting for descriptors"
        );
        assert!(
            (1..=2).contains(&warned),
            "{backend:?}: {warned} log lines about failed accepts in {wall:?}"
        );
        for (i, s) in waiting.iter_mut().enumerate() {
            echo_over(s, i as u64 + 1);
        }
        assert_eq!(c.call(ECHO, b"still", LONG).unwrap().payload(), b"still");
        f.server.shutdown().unwrap();
        set_nofile(&saved);
    }
}
