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
use cxlkv_controlplane::transport::{ClientError, DisconnectReason, Endpoint, Rejection};
use transport_common::*;

/// A raw socket to the server, for sending bytes no client would.
enum Raw {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Raw {
    fn connect(ep: &Endpoint) -> Raw {
        let r = match ep {
            Endpoint::Unix(p) => Raw::Unix(UnixStream::connect(p).unwrap()),
            Endpoint::Tcp(a) => Raw::Tcp(TcpStream::connect(a).unwrap()),
            other => panic!("unexpected endpoint {other}"),
        };
        r.stream().set_read_timeout(Some(LONG)).unwrap();
        r
    }
    fn stream(&self) -> &dyn RawIo {
        match self {
            Raw::Unix(s) => s,
            Raw::Tcp(s) => s,
        }
    }
    fn write_all(&mut self, b: &[u8]) {
        match self {
            Raw::Unix(s) => s.write_all(b).unwrap(),
            Raw::Tcp(s) => s.write_all(b).unwrap(),
        }
    }
    /// Reads one whole frame (header and payload), bounded by LONG.
    fn read_frame(&mut self) -> Option<(FrameHeader, Vec<u8>)> {
        let mut d = FrameDecoder::new();
        loop {
            if let Some(Decoded::Frame(f)) = d.decode().unwrap() {
                return Some((f.header, f.payload.to_vec()));
            }
            let mut buf = [0u8; 4096];
            let r = match self {
                Raw::Unix(s) => s.read(&mut buf),
                Raw::Tcp(s) => s.read(&mut buf),
            };
            // EINTR: this thread led an io_uring client whose ring was torn
            // down (see the client's module essay); read again.
            let n = match r {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => r.ok()?,
            };
            if n == 0 {
                return None;
            }
            d.push(&buf[..n]);
        }
    }
    /// True once the server closed the connection (EOF or reset).
    fn closed_by_server(&mut self) -> bool {
        let mut buf = [0u8; 64];
        loop {
            let r = match self {
                Raw::Unix(s) => s.read(&mut buf),
                Raw::Tcp(s) => s.read(&mut buf),
            };
            match r {
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
                if let Raw::Unix(s) = &mut raw {
                    let _ = s.write_all(&a);
                } else if let Raw::Tcp(s) = &mut raw {
                    let _ = s.write_all(&a);
                }
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
