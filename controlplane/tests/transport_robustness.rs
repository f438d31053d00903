//! Bad input and misbehaving peers affect only themselves; limits are
//! enforced with a clear answer. On every backend.

mod transport_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use cxlkv_controlplane::frame::{
    Decoded, FrameDecoder, FrameError, FrameHeader, MAX_PAYLOAD_BYTES, encode_frame,
};
use cxlkv_controlplane::transport::{
    ClientError, DisconnectReason, Endpoint, LoopWatch, Rejection,
};
use transport_common::*;

/// A raw socket to the server, for sending bytes no client would, with
/// the decoder of what it received (replies may arrive several per read).
struct Raw {
    sock: RawSock,
    received: FrameDecoder,
}

enum RawSock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Raw {
    fn connect(ep: &Endpoint) -> Raw {
        let sock = match ep {
            Endpoint::Unix(p) => RawSock::Unix(UnixStream::connect(p).unwrap()),
            Endpoint::Tcp(a) => RawSock::Tcp(TcpStream::connect(a).unwrap()),
            other => panic!("unexpected endpoint {other}"),
        };
        let r = Raw {
            sock,
            received: FrameDecoder::new(),
        };
        r.stream().set_read_timeout(Some(LONG)).unwrap();
        r
    }
    fn stream(&self) -> &dyn RawIo {
        match &self.sock {
            RawSock::Unix(s) => s,
            RawSock::Tcp(s) => s,
        }
    }
    fn write_all(&mut self, b: &[u8]) {
        self.try_write_all(b).unwrap();
    }
    fn try_write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match &mut self.sock {
            RawSock::Unix(s) => s.write_all(b),
            RawSock::Tcp(s) => s.write_all(b),
        }
    }
    /// Ends our half of the stream (`shutdown(SHUT_WR)`); replies can
    /// still arrive.
    fn end_writes(&self) {
        match &self.sock {
            RawSock::Unix(s) => s.shutdown(std::net::Shutdown::Write).unwrap(),
            RawSock::Tcp(s) => s.shutdown(std::net::Shutdown::Write).unwrap(),
        }
    }
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.sock {
            RawSock::Unix(s) => s.read(buf),
            RawSock::Tcp(s) => s.read(buf),
        }
    }
    /// Reads one whole frame (header and payload), bounded by LONG; `None`
    /// at end of stream (or on an error).
    fn read_frame(&mut self) -> Option<(FrameHeader, Vec<u8>)> {
        loop {
            if let Some(Decoded::Frame(f)) = self.received.decode().unwrap() {
                return Some((f.header, f.payload.to_vec()));
            }
            let mut buf = [0u8; 4096];
            // EINTR: this thread led an io_uring client whose ring was torn
            // down (see the client's module essay); read again.
            let n = match self.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => r.ok()?,
            };
            if n == 0 {
                return None;
            }
            self.received.push(&buf[..n]);
        }
    }
    /// True once the server closed the connection (EOF or reset).
    fn closed_by_server(&mut self) -> bool {
        let mut buf = [0u8; 64];
        loop {
            match self.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("read while waiting for the server to close: {e}");
                    return false;
                }
            }
        }
    }
}

trait RawIo {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()>;
}
impl RawIo for UnixStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, d)
    }
}
impl RawIo for TcpStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, d)
    }
}

fn frame(kind: u16, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_frame(&mut v, kind, id, payload).unwrap();
    v
}

fn still_served(f: &Fixture, good: &cxlkv_controlplane::transport::RpcClient) {
    assert_eq!(
        good.call(ECHO, b"alive", LONG).unwrap().payload(),
        b"alive",
        "{:?}",
        f.backend
    );
}

#[test]
fn an_intact_header_with_a_wrong_version_gets_an_error_reply_and_the_connection_lives() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let good = f.client(ep);
            let mut raw = Raw::connect(ep);
            let mut bad = frame(ECHO, 41, b"old client");
            bad[4] = 7; // version 7
            raw.write_all(&bad);
            let (h, p) = raw.read_frame().expect("an error reply");
            assert_eq!((h.kind, h.request_id), (ERROR_REPLY, 41));
            assert!(String::from_utf8_lossy(&p).contains("UnsupportedVersion"));
            raw.write_all(&frame(ECHO, 42, b"still here"));
            let (h, p) = raw.read_frame().expect("the next frame is served");
            assert_eq!((h.request_id, p.as_slice()), (42, &b"still here"[..]));
            still_served(&f, &good);
        }
    }
}

#[test]
fn an_oversized_frame_gets_an_error_reply_and_its_payload_is_skipped() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let good = f.client(ep);
            let mut raw = Raw::connect(ep);
            let mut h = FrameHeader::new(ECHO, 7, 0).unwrap();
            h.payload_len = (MAX_PAYLOAD_BYTES + 8) as u32;
            raw.write_all(&h.encode());
            let (rh, p) = raw.read_frame().expect("an error reply");
            assert_eq!((rh.kind, rh.request_id), (ERROR_REPLY, 7));
            assert!(String::from_utf8_lossy(&p).contains("Oversized"));
            // The announced payload is skipped, then framing resumes.
            raw.write_all(&vec![0u8; MAX_PAYLOAD_BYTES + 8]);
            raw.write_all(&frame(ECHO, 8, b"after"));
            let (rh, p) = raw.read_frame().unwrap();
            assert_eq!((rh.request_id, p.as_slice()), (8, &b"after"[..]));
            still_served(&f, &good);
        }
    }
}

#[test]
fn bad_magic_or_reserved_bits_close_only_that_connection() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let good = f.client(ep);
            for corrupt in [0usize, 21] {
                let mut raw = Raw::connect(ep);
                let mut bad = frame(ECHO, 1, b"x");
                bad[corrupt] ^= 0xFF;
                raw.write_all(&bad);
                assert!(raw.closed_by_server(), "{backend:?} {ep} byte {corrupt}");
                still_served(&f, &good);
            }
        }
        f.wait_until("two protocol drops per endpoint", |s| {
            s.disconnects
                .lock()
                .iter()
                .filter(|(_, r)| matches!(r, DisconnectReason::Protocol(_)))
                .count()
                == 4
        });
        let drops: Vec<_> = f
            .seen
            .disconnects
            .lock()
            .iter()
            .map(|(_, r)| r.clone())
            .collect();
        assert!(
            drops.contains(&DisconnectReason::Protocol(FrameError::BadMagic {
                found: u32::from_le_bytes(*b"CXKV") ^ 0xFF
            }))
        );
    }
}

#[test]
fn a_peer_that_disconnects_mid_frame_or_trickles_bytes_affects_only_itself() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let good = f.client(ep);
            // Truncated, then gone.
            let mut raw = Raw::connect(ep);
            raw.write_all(&frame(ECHO, 1, &[1u8; 100])[..50]);
            drop(raw);
            // Trickled one byte at a time, with the good client served in between.
            let mut slow = Raw::connect(ep);
            let bytes = frame(ECHO, 9, b"trickle");
            for b in &bytes {
                slow.write_all(std::slice::from_ref(b));
                still_served(&f, &good);
            }
            let (h, p) = slow.read_frame().unwrap();
            assert_eq!((h.request_id, p.as_slice()), (9, &b"trickle"[..]));
        }
        f.wait_until("both truncated peers seen closing", |s| {
            s.disconnects
                .lock()
                .iter()
                .filter(|(_, r)| *r == DisconnectReason::PeerClosed)
                .count()
                >= 2
        });
    }
}

#[test]
fn a_partial_frame_held_too_long_closes_that_connection() {
    for backend in backends() {
        let mut cfg = server_config(backend);
        cfg.partial_frame_timeout_ms = 100;
        let f = start(backend, cfg);
        let mut raw = Raw::connect(&f.unix);
        raw.write_all(&frame(ECHO, 1, b"half")[..10]);
        assert!(raw.closed_by_server());
        f.wait_until("partial-frame timeout", |s| {
            s.disconnects
                .lock()
                .iter()
                .any(|(_, r)| *r == DisconnectReason::PartialFrameTimeout)
        });
    }
}

/// `idle_timeout_ms`: a connection that sends nothing is closed; one that
/// keeps sending is not (the pool service's way of noticing a directory
/// host gone without closing).
#[test]
fn a_connection_silent_for_the_idle_timeout_is_closed_and_a_talking_one_is_not() {
    for backend in backends() {
        let mut cfg = server_config(backend);
        cfg.idle_timeout_ms = Some(300);
        let f = start(backend, cfg);
        let talking = f.client(&f.unix);
        let mut silent = Raw::connect(&f.unix);
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(900) {
            talking
                .call(ECHO, b"ping", Duration::from_secs(5))
                .expect("a talking connection is served");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(silent.closed_by_server(), "{backend:?}");
        f.wait_until("idle timeout", |s| {
            s.disconnects
                .lock()
                .iter()
                .any(|(_, r)| *r == DisconnectReason::IdleTimeout)
        });
        talking
            .call(ECHO, b"still", Duration::from_secs(5))
            .expect("never idle, never closed");
    }
}

#[test]
fn a_peer_that_stops_reading_is_dropped_when_its_queue_overflows() {
    for backend in backends() {
        let mut cfg = server_config(backend);
        cfg.max_send_queue_bytes = cxlkv_controlplane::frame::MAX_FRAME_BYTES;
        let f = start(backend, cfg);
        for ep in f.endpoints() {
            let good = f.client(ep);
            let mut raw = Raw::connect(ep);
            // Ask for 1 MiB replies and never read them: socket buffers fill,
            // then the server's queue, then the server gives up on it.
            let ask = frame(SIZED, 0, &(1u32 << 20).to_le_bytes());
            let mut sent = 0;
            while sent < 256 && !matches_drop(&f) {
                let mut a = ask.clone();
                a[8..16].copy_from_slice(&(sent as u64 + 1).to_le_bytes());
                let _ = raw.try_write_all(&a);
                sent += 1;
                still_served(&f, &good);
            }
            assert!(
                matches_drop(&f),
                "{backend:?} {ep}: never dropped after {sent} requests"
            );
            still_served(&f, &good);
            f.seen.disconnects.lock().clear();
        }
        assert!(f.server.stats().slow_reader_drops >= 2);
    }
}

fn matches_drop(f: &Fixture) -> bool {
    f.seen
        .disconnects
        .lock()
        .iter()
        .any(|(_, r)| matches!(r, DisconnectReason::SendQueueFull { .. }))
}

#[test]
fn connections_beyond_the_limit_are_refused_with_the_handlers_frame() {
    for backend in backends() {
        let mut cfg = server_config(backend);
        cfg.max_connections = 4;
        let f = start(backend, cfg);
        let clients: Vec<_> = (0..4).map(|_| f.client(&f.unix)).collect();
        for c in &clients {
            c.call(ECHO, b"in", LONG).unwrap();
        }
        let extra = f.client(&f.unix);
        let err = extra.call(ECHO, b"out", LONG).unwrap_err();
        match err {
            ClientError::Closed {
                notice: Some(n), ..
            } => {
                assert_eq!(n.kind(), REFUSED);
                assert!(String::from_utf8_lossy(n.payload()).contains("TooManyConnections"));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        drop(clients);
        // Room again once the others left.
        let until = std::time::Instant::now() + LONG;
        loop {
            let c = f.client(&f.unix);
            if c.call(ECHO, b"back", LONG).is_ok() {
                break;
            }
            assert!(std::time::Instant::now() < until, "never admitted again");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(f.server.stats().refused >= 1);
    }
}

#[test]
fn requests_beyond_the_in_flight_limit_are_rejected_with_the_reason() {
    for backend in backends() {
        let mut cfg = server_config(backend);
        cfg.max_inflight_per_conn = 3;
        let f = start(backend, cfg);
        let completer = f.server.completer();
        let c = f.client(&f.unix);
        let held: Vec<_> = (0..3u8)
            .map(|i| c.start(DEFER, &[i], LONG).unwrap())
            .collect();
        f.wait_until("three deferred", |s| s.deferred.lock().len() == 3);
        let r = c.call(ECHO, b"one too many", LONG).unwrap();
        assert_eq!(r.kind(), ERROR_REPLY);
        assert!(
            f.seen
                .rejections
                .lock()
                .iter()
                .any(|(_, _, w)| *w == Rejection::TooManyInFlight { limit: 3 })
        );
        for (conn, rid, p) in f.seen.deferred.lock().drain(..) {
            completer
                .complete(conn, DEFER + REPLY_OFFSET, rid, &p)
                .unwrap();
        }
        for h in held {
            h.wait().unwrap();
        }
        assert_eq!(
            c.call(ECHO, b"room again", LONG).unwrap().payload(),
            b"room again"
        );
    }
}

#[test]
fn the_client_refuses_more_than_its_in_flight_bound() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let mut cfg = client_config(backend);
        cfg.max_inflight = 2;
        let c = cxlkv_controlplane::transport::RpcClient::connect(&f.unix, cfg).unwrap();
        let a = c.start(DEFER, b"a", LONG).unwrap();
        let b = c.start(DEFER, b"b", LONG).unwrap();
        assert!(matches!(
            c.start(ECHO, b"c", LONG),
            Err(ClientError::TooManyInFlight { limit: 2 })
        ));
        drop((a, b));
        assert!(c.start(ECHO, b"d", LONG).is_ok());
    }
}

#[test]
fn two_hundred_fifty_six_connections_are_served_concurrently() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let clients: Vec<_> = (0..256).map(|i| f.client(f.endpoints()[i % 2])).collect();
        std::thread::scope(|s| {
            for chunk in clients.chunks(32) {
                s.spawn(move || {
                    for round in 0..5u32 {
                        let calls: Vec<_> = chunk
                            .iter()
                            .map(|c| c.start(ECHO, &round.to_le_bytes(), LONG).unwrap())
                            .collect();
                        for call in calls {
                            assert_eq!(call.wait().unwrap().payload(), round.to_le_bytes());
                        }
                    }
                });
            }
        });
        assert_eq!(f.server.stats().accepted, 256);
    }
}

/// A handler that panics on the loop thread ends the loop: the handle (and
/// a watch handed in through the configuration, as `cxlkv pool` does, whose
/// handle lives inside the pool core) says the loop no longer runs and
/// why, completers are told it stopped, and `shutdown` reports the panic.
#[test]
fn a_loop_that_dies_is_reported_by_its_handle_and_its_watch() {
    for backend in server_backends() {
        let watch = LoopWatch::new();
        assert!(!watch.is_running(), "not started yet");
        let mut cfg = server_config(backend);
        cfg.loop_watch = Some(watch.clone());
        let f = start(backend, cfg);
        assert!(f.server.is_running() && watch.is_running(), "{backend:?}");
        assert_eq!(f.server.failure(), None);
        let c = f.client(&f.unix);
        assert_eq!(c.call(ECHO, b"up", LONG).unwrap().payload(), b"up");
        assert!(c.call(PANIC, b"", LONG).is_err(), "{backend:?}");
        let until = std::time::Instant::now() + LONG;
        while f.server.is_running() {
            assert!(
                std::time::Instant::now() < until,
                "{backend:?}: still running"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let failure = f.server.failure().expect("the loop's end is a failure");
        let Endpoint::Unix(path) = &f.unix else {
            unreachable!("a Unix endpoint")
        };
        assert!(
            !path.exists(),
            "{backend:?}: the dead loop's socket {} is left behind",
            path.display()
        );
        assert!(
            failure.contains("panicked") && failure.contains("asked to panic"),
            "{backend:?}: {failure}"
        );
        assert!(!watch.is_running());
        assert_eq!(watch.failure(), Some(failure));
        let completer = f.server.completer();
        assert!(matches!(
            completer.wake(),
            Err(cxlkv_controlplane::transport::ReplyError::Stopped)
        ));
        assert!(matches!(
            f.server.shutdown(),
            Err(cxlkv_controlplane::transport::TransportError::LoopPanicked)
        ));
    }
}

/// A loop stopped on request is not a failure.
#[test]
fn a_loop_stopped_on_request_is_not_a_failure() {
    for backend in server_backends() {
        let watch = LoopWatch::new();
        let mut cfg = server_config(backend);
        cfg.loop_watch = Some(watch.clone());
        let f = start(backend, cfg);
        assert!(watch.is_running());
        f.server.shutdown().unwrap();
        assert!(!watch.is_running());
        assert_eq!(watch.failure(), None, "{backend:?}");
    }
}

/// A peer that pipelines requests and then ends its half of the stream
/// (`shutdown(SHUT_WR)`) still gets a reply to every request — those
/// answered at once and those answered later from another thread — and
/// then end of stream; the handler hears `PeerClosed` once all are sent.
#[test]
fn a_peer_that_half_closes_after_pipelining_gets_every_reply_then_end_of_stream() {
    const REQUESTS: u64 = 12;
    for backend in server_backends() {
        let f = start(backend, server_config(backend));
        let good = f.client(&f.unix);
        let completer = f.server.completer();
        for ep in f.endpoints() {
            let mut raw = Raw::connect(ep);
            let mut bytes = Vec::new();
            for id in 1..=REQUESTS {
                let kind = if id % 3 == 0 { DEFER } else { ECHO };
                bytes.extend(frame(kind, id, format!("request {id}").as_bytes()));
            }
            raw.write_all(&bytes);
            raw.end_writes();
            f.wait_until("the deferred requests", |s| s.deferred.lock().len() == 4);
            // A round trip on another connection: the loop has taken the
            // end of stream by now (it was in the socket before this
            // request), so the deferred replies below come after it.
            still_served(&f, &good);
            for (conn, rid, p) in f.seen.deferred.lock().drain(..) {
                completer
                    .complete(conn, DEFER + REPLY_OFFSET, rid, &p)
                    .unwrap();
            }
            let mut got = Vec::new();
            while let Some((h, p)) = raw.read_frame() {
                assert_eq!(p, format!("request {}", h.request_id).as_bytes());
                got.push(h.request_id);
            }
            got.sort_unstable();
            assert_eq!(
                got,
                (1..=REQUESTS).collect::<Vec<_>>(),
                "{backend:?} {ep}: one reply per request, then end of stream"
            );
        }
        f.wait_until("both half-closed peers closed", |s| {
            s.disconnects
                .lock()
                .iter()
                .filter(|(_, r)| *r == DisconnectReason::PeerClosed)
                .count()
                == 2
        });
    }
}

/// A connection the server closes while its peer does not read its replies
/// (its writes blocked) and keeps sending costs the loop no CPU (the epoll
/// backend stops watching its input as soon as it leaves `Open`), and is
/// closed once it held its last replies for `partial_frame_timeout_ms`.
#[test]
fn a_closing_connection_whose_peer_never_reads_costs_no_cpu_and_is_closed_in_bounded_time() {
    for backend in server_backends() {
        let mut cfg = server_config(backend);
        cfg.partial_frame_timeout_ms = 3_000;
        let f = start(backend, cfg);
        let good = f.client(&f.unix);
        let completer = f.server.completer();
        let mut raw = Raw::connect(&f.unix);
        // 4 MiB of replies it never reads: the socket takes a few hundred
        // KiB, the rest waits in the server with its writes blocked.
        for id in 1..=4u64 {
            raw.write_all(&frame(SIZED, id, &(1u32 << 20).to_le_bytes()));
        }
        let until = std::time::Instant::now() + LONG;
        while f.server.stats().replies_queued < 4 {
            assert!(std::time::Instant::now() < until, "replies never queued");
            std::thread::sleep(Duration::from_millis(1));
        }
        still_served(&f, &good); // the turn that queued them has flushed
        let conn = f.seen.peers.lock().last().unwrap().0;
        completer.close(conn).unwrap();
        still_served(&f, &good); // the close was applied (no flush ran)
        raw.write_all(&frame(ECHO, 99, b"unread input for a closing connection"));
        let before = f.seen.loop_cpu_time();
        let t0 = std::time::Instant::now();
        std::thread::sleep(Duration::from_secs(1));
        let cpu = f.seen.loop_cpu_time() - before;
        let wall = t0.elapsed();
        assert!(
            cpu < Duration::from_millis(100),
            "{backend:?}: the loop used {cpu:?} of CPU in {wall:?} with nothing to do"
        );
        f.wait_until("the closing connection's bound", |s| {
            s.disconnects
                .lock()
                .iter()
                .any(|(c, r)| *c == conn && *r == DisconnectReason::DrainTimeout)
        });
        still_served(&f, &good);
    }
}

/// A request id already in flight on the connection is rejected as a
/// duplicate without touching the original: a third frame with that id is
/// rejected too (the original is still in flight), and the original's own
/// reply reaches the peer after the two rejections.
#[test]
fn a_duplicate_request_id_is_rejected_without_touching_the_original() {
    for backend in server_backends() {
        let f = start(backend, server_config(backend));
        let completer = f.server.completer();
        for ep in f.endpoints() {
            let mut raw = Raw::connect(ep);
            raw.write_all(&frame(DEFER, 7, b"original"));
            raw.write_all(&frame(DEFER, 7, b"first duplicate"));
            raw.write_all(&frame(DEFER, 7, b"second duplicate"));
            for n in 0..2 {
                let (h, p) = raw.read_frame().expect("a rejection");
                assert_eq!(
                    (h.kind, h.request_id),
                    (ERROR_REPLY, 7),
                    "{backend:?} {ep} #{n}"
                );
                assert!(String::from_utf8_lossy(&p).contains("DuplicateRequestId"));
            }
            let deferred: Vec<_> = f.seen.deferred.lock().drain(..).collect();
            assert_eq!(deferred.len(), 1, "{backend:?} {ep}: exactly one delivered");
            let (conn, rid, payload) = deferred.into_iter().next().unwrap();
            assert_eq!((rid, payload.as_slice()), (7, &b"original"[..]));
            assert_eq!(
                f.seen
                    .rejections
                    .lock()
                    .drain(..)
                    .filter(|(_, id, w)| *id == 7 && *w == Rejection::DuplicateRequestId)
                    .count(),
                2
            );
            completer
                .complete(conn, DEFER + REPLY_OFFSET, rid, &payload)
                .unwrap();
            let (h, p) = raw.read_frame().expect("the original's reply");
            assert_eq!(
                (h.kind, h.request_id, p.as_slice()),
                (DEFER + REPLY_OFFSET, 7, &b"original"[..]),
                "{backend:?} {ep}"
            );
            // The id is free again once answered.
            raw.write_all(&frame(ECHO, 7, b"reused"));
            let (h, p) = raw.read_frame().unwrap();
            assert_eq!((h.request_id, p.as_slice()), (7, &b"reused"[..]));
        }
    }
}
