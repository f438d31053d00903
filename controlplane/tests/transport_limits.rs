//! Bounds that must hold against a peer that stalls: a client's connect to a
//! listener that never accepts, and a server's patience with a rejected
//! frame whose payload never finishes arriving.

mod transport_common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::{FrameHeader, PROTOCOL_VERSION};
use cxlkv_controlplane::transport::{
    ClientConfig, ClientError, DisconnectReason, Endpoint, RpcClient,
};
use transport_common::*;

/// A non-blocking connect to `path`: `Some` socket when it went through
/// (into the backlog), `None` on `EAGAIN` (the backlog is full).
fn connect_nonblocking(path: &std::path::Path) -> Option<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: socket has no memory preconditions.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < addr.sun_path.len());
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is a live sockaddr_un of `len` bytes; `fd` is open.
    let rc = unsafe { libc::connect(fd, (&raw const addr).cast(), len) };
    if rc == 0 {
        return Some(owned);
    }
    let e = std::io::Error::last_os_error();
    assert_eq!(e.raw_os_error(), Some(libc::EAGAIN), "connect: {e}");
    None
}

/// A Unix listener that never accepts, its backlog full: the state of a
/// wedged server with `SOMAXCONN` clients queued. A blocking connect to it
/// sleeps until room appears, which is never; `RpcClient::connect` must
/// give up after `connect_timeout_ms` with a timeout.
#[test]
fn a_unix_connect_to_a_listener_whose_backlog_is_full_fails_within_connect_timeout() {
    let path = unique_socket_path();
    let listener = UnixListener::bind(&path).unwrap();
    // Shrink the backlog to its minimum so that it fills quickly.
    // SAFETY: listen on a live, bound socket descriptor.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let mut queued = Vec::new();
    loop {
        match connect_nonblocking(&path) {
            Some(fd) => queued.push(fd),
            None => break,
        }
        assert!(queued.len() < 4096, "the backlog never filled");
    }
    let (tx, rx) = mpsc::channel();
    let ep = Endpoint::Unix(path.clone());
    let started = Instant::now();
    std::thread::spawn(move || {
        let cfg = ClientConfig {
            connect_timeout_ms: 200,
            ..ClientConfig::default()
        };
        let _ = tx.send(RpcClient::connect(&ep, cfg).map(|_| ()));
    });
    // The test itself must not hang on a connect that never returns.
    let result = rx
        .recv_timeout(Duration::from_secs(2))
        .expect("RpcClient::connect to a full backlog still blocked after 2 s");
    let elapsed = started.elapsed();
    match result {
        Err(ClientError::Connect { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}");
            assert!(source.to_string().contains("200 ms"), "{source}");
        }
        other => panic!("expected a connect timeout, got {other:?}"),
    }
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
    drop(queued);
    drop(listener);
    let _ = std::fs::remove_file(&path);
}

/// A connect that finds room before its timeout succeeds: the listener
/// starts accepting (its backlog drains) while the client retries.
#[test]
fn a_unix_connect_retried_on_a_full_backlog_succeeds_once_room_appears() {
    let path = unique_socket_path();
    let listener = UnixListener::bind(&path).unwrap();
    // SAFETY: listen on a live, bound socket descriptor.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let mut queued = Vec::new();
    while let Some(fd) = connect_nonblocking(&path) {
        queued.push(fd);
        assert!(queued.len() < 4096, "the backlog never filled");
    }
    let (tx, rx) = mpsc::channel();
    let ep = Endpoint::Unix(path.clone());
    std::thread::spawn(move || {
        let cfg = ClientConfig {
            connect_timeout_ms: 10_000,
            ..ClientConfig::default()
        };
        let _ = tx.send(RpcClient::connect(&ep, cfg).map(|_| ()));
    });
    std::thread::sleep(Duration::from_millis(100));
    // Make room: accept what is queued.
    let mut accepted = Vec::new();
    for _ in 0..queued.len() {
        accepted.push(listener.accept().unwrap());
    }
    rx.recv_timeout(LONG)
        .expect("connect still blocked")
        .expect("connect once the backlog had room");
    let _ = std::fs::remove_file(&path);
}

/// A frame the server rejects (another protocol version) announcing 1 MiB
/// of payload, of which 100 bytes arrive and then nothing: the payload is
/// being skipped, no byte of it is buffered, but the peer is mid-frame and
/// must be closed after `partial_frame_timeout_ms` like any partial frame
/// (it was never timed out: a peer announcing up to 4 GiB kept its slot
/// forever).
#[test]
fn a_rejected_frame_whose_payload_stalls_is_closed_after_the_partial_frame_timeout() {
    for backend in server_backends() {
        let mut cfg = server_config(backend);
        cfg.partial_frame_timeout_ms = 200;
        let f = start(backend, cfg);
        let Endpoint::Unix(path) = &f.unix else {
            unreachable!()
        };
        let mut sock = UnixStream::connect(path).unwrap();
        sock.set_read_timeout(Some(LONG)).unwrap();
        let header = FrameHeader {
            version: PROTOCOL_VERSION + 1,
            kind: ECHO,
            request_id: 42,
            payload_len: 1 << 20,
        };
        sock.write_all(&header.encode()).unwrap();
        sock.write_all(&[0u8; 100]).unwrap();
        let sent = Instant::now();
        let mut reason = None;
        while reason.is_none() && sent.elapsed() < Duration::from_secs(3) {
            reason = f
                .seen
                .disconnects
                .lock()
                .first()
                .map(|(_, why)| why.clone());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            reason,
            Some(DisconnectReason::PartialFrameTimeout),
            "{backend:?}: a stalled rejected payload was not timed out within 3 s"
        );
        assert_eq!(f.seen.rejections.lock().len(), 1, "{backend:?}");
        // The peer got the rejection's error reply, then end of stream.
        let mut rest = Vec::new();
        let _ = sock.read_to_end(&mut rest);
        assert!(!rest.is_empty(), "{backend:?}: no error reply");
    }
}
