//! Round trips, pipelining, deferred completion, deadlines, credentials
//! and descriptor passing — on every backend and both socket kinds.

mod transport_common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use cxlkv_controlplane::frame::MAX_PAYLOAD_BYTES;
use cxlkv_controlplane::transport::{BackendChoice, ClientError, Endpoint, RecvMode};
use transport_common::*;

#[test]
fn frames_of_several_kinds_and_sizes_round_trip() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let c = f.client(ep);
            for len in [0usize, 1, 7, 8, 150, 4096, 65_537, 1 << 20] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
                let r = c.call(ECHO, &payload, LONG).unwrap();
                assert_eq!(r.kind(), ECHO + REPLY_OFFSET, "{backend:?} {ep}");
                assert_eq!(
                    r.payload(),
                    payload.as_slice(),
                    "{backend:?} {ep} len {len}"
                );
                assert_eq!(r.payload().as_ptr() as usize % 8, 0, "payload is 8-aligned");
            }
            let big = c
                .call(SIZED, &(MAX_PAYLOAD_BYTES as u32).to_le_bytes(), LONG)
                .unwrap();
            assert_eq!(big.payload().len(), MAX_PAYLOAD_BYTES);
            assert!(
                big.payload()
                    .iter()
                    .enumerate()
                    .all(|(i, b)| *b == (i % 251) as u8)
            );
            let max_req = vec![0xA5u8; MAX_PAYLOAD_BYTES];
            assert_eq!(
                c.call(ECHO, &max_req, LONG).unwrap().payload(),
                max_req.as_slice()
            );
        }
    }
}

/// A reply the handler encoded itself and handed over whole (no copy in
/// the transport) arrives exactly as the copied kind does.
#[test]
fn a_frame_handed_over_whole_arrives_like_a_copied_one() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let c = f.client(ep);
            for len in [0usize, 5, 8, 4096, 16_464, 65_537] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 13 % 256) as u8).collect();
                let r = c.call(WHOLE_FRAME, &payload, LONG).unwrap();
                assert_eq!(r.kind(), WHOLE_FRAME + REPLY_OFFSET, "{backend:?} {ep}");
                assert_eq!(r.payload(), payload.as_slice(), "{backend:?} {ep} {len}");
            }
        }
    }
}

#[test]
fn pipelined_requests_complete_out_of_order_through_the_completer() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let completer = f.server.completer();
        for ep in f.endpoints() {
            let c = f.client(ep);
            let before = f.seen.deferred.lock().len();
            let calls: Vec<_> = (0..16u8)
                .map(|i| c.start(DEFER, &[i], LONG).unwrap())
                .collect();
            f.wait_until("16 deferred requests", |s| {
                s.deferred.lock().len() == before + 16
            });
            // Complete them in reverse order from this (non-loop) thread,
            // half directly and half through a wake of the handler.
            let mut items: Vec<_> = f.seen.deferred.lock().drain(..).collect();
            items.reverse();
            for (n, (conn, rid, payload)) in items.into_iter().enumerate() {
                if n % 2 == 0 {
                    completer
                        .complete(conn, DEFER + REPLY_OFFSET, rid, &payload)
                        .unwrap();
                } else {
                    f.seen.to_complete_on_wake.lock().push((conn, rid, payload));
                    completer.wake().unwrap();
                }
            }
            for (i, call) in calls.into_iter().enumerate() {
                let r = call.wait().unwrap();
                assert_eq!(r.payload(), &[i as u8], "{backend:?} {ep}");
            }
        }
    }
}

#[test]
fn many_threads_share_one_client() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let c = f.client(ep);
            std::thread::scope(|s| {
                for t in 0..8u32 {
                    let c = c.clone();
                    s.spawn(move || {
                        for i in 0..300u32 {
                            let p = [t.to_le_bytes(), i.to_le_bytes()].concat();
                            assert_eq!(c.call(ECHO, &p, LONG).unwrap().payload(), p.as_slice());
                        }
                    });
                }
            });
        }
    }
}

#[test]
fn an_expired_deadline_times_out_and_the_late_reply_is_dropped() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let completer = f.server.completer();
        for ep in f.endpoints() {
            let c = f.client(ep);
            let err = c
                .call(DEFER, b"late", Duration::from_millis(50))
                .unwrap_err();
            assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
            // The deadline is the client's: on a loaded host the server
            // may read the request only after it has passed.
            f.wait_until("the request reached the handler", |s| {
                !s.deferred.lock().is_empty()
            });
            let (conn, rid, payload) = f
                .seen
                .deferred
                .lock()
                .pop()
                .expect("the request reached the handler");
            completer
                .complete(conn, DEFER + REPLY_OFFSET, rid, &payload)
                .unwrap();
            // The next call reads the late reply first, drops it, and gets its own.
            assert_eq!(c.call(ECHO, b"next", LONG).unwrap().payload(), b"next");
            assert_eq!(
                c.stats()
                    .late_replies
                    .load(std::sync::atomic::Ordering::Relaxed),
                1
            );
            assert_eq!(
                c.stats()
                    .timeouts
                    .load(std::sync::atomic::Ordering::Relaxed),
                1
            );
        }
    }
}

/// Found by a review of the client's reader hand-off (session 22): a
/// leader that left because its own deadline passed handed the reader role
/// to the first parked waiter in the table — which could be itself (still
/// registered, still unanswered) — so the other waiters stayed parked with
/// nobody reading, and timed out with their replies in the socket. Here:
/// A (never answered) leads when C parks behind it; C's reply comes after
/// A's deadline.
#[test]
fn a_leader_that_times_out_passes_the_reader_role_to_another_waiter() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    use cxlkv_controlplane::frame::{Decoded, FrameDecoder, encode_frame};
    use cxlkv_controlplane::transport::{ClientConfig, IoConfig, RpcClient};

    const LEADS_FIRST: u16 = 1; // answered after 100 ms
    const NEVER: u16 = 2; // never answered
    const LATE: u16 = 3; // answered 1.5 s after the start
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
            let mut d = FrameDecoder::new();
            let mut due: Vec<(Instant, u16, u64)> = Vec::new();
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        return;
                    }
                    d.push(&buf[..n]);
                }
                while let Ok(Some(Decoded::Frame(f))) = d.decode() {
                    let (kind, id) = (f.header.kind, f.header.request_id);
                    match kind {
                        LEADS_FIRST => {
                            due.push((Instant::now() + Duration::from_millis(100), kind, id))
                        }
                        LATE => due.push((t0 + Duration::from_millis(1500), kind, id)),
                        _ => {}
                    }
                }
                let now = Instant::now();
                due.retain(|&(at, kind, id)| {
                    if now < at {
                        return true;
                    }
                    let mut out = Vec::new();
                    encode_frame(&mut out, kind + 100, id, b"reply").unwrap();
                    s.write_all(&out).unwrap();
                    false
                });
            }
        })
    };
    let cfg = ClientConfig {
        io: IoConfig {
            spin_us: 0,
            ..IoConfig::default()
        },
        ..ClientConfig::default()
    };
    let c = RpcClient::connect(&Endpoint::Unix(path), cfg).unwrap();
    let never = c.start(NEVER, b"a", Duration::from_secs(1)).unwrap();
    let first = c.start(LEADS_FIRST, b"l", Duration::from_secs(10)).unwrap();
    let first = std::thread::spawn(move || first.wait().map(|_| ()));
    let never = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30)); // parks behind the first leader
        never.wait().map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(250)); // the never-answered one leads now
    let late = c.start(LATE, b"c", Duration::from_secs(10)).unwrap();
    let started = Instant::now();
    let got = late.wait();
    let took = started.elapsed();
    assert!(first.join().unwrap().is_ok());
    assert!(never.join().unwrap().is_err(), "never answered");
    stop.store(true, Ordering::Relaxed);
    drop(c);
    let _ = server.join();
    assert!(
        got.is_ok() && took < Duration::from_secs(5),
        "the late reply came 1.5 s after the start, but the call got {:?} after {took:?}",
        got.map(|_| ())
    );
}

#[test]
fn unix_peers_are_identified_by_kernel_credentials() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let c = f.client(&f.unix);
        let text =
            String::from_utf8(c.call(WHO_AM_I, b"", LONG).unwrap().payload().to_vec()).unwrap();
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        assert_eq!(text, format!("unix {} {uid} {gid}", std::process::id()));
        let t = f.client(&f.tcp);
        let text =
            String::from_utf8(t.call(WHO_AM_I, b"", LONG).unwrap().payload().to_vec()).unwrap();
        assert!(text.starts_with("tcp 127.0.0.1:"), "{text}");
    }
}

#[test]
fn a_descriptor_sent_with_a_reply_reaches_the_client() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let c = f.client(&f.unix);
        for round in 0..3 {
            // Surround the descriptor-carrying reply with pipelined ones so
            // that the descriptor must be tied to the right frame.
            let a = c.start(ECHO, b"before", LONG).unwrap();
            let secret = format!("pool device stand-in {round}");
            let b = c.start(SEND_FD, secret.as_bytes(), LONG).unwrap();
            let d = c.start(ECHO, b"after", LONG).unwrap();
            assert!(a.wait().unwrap().fds.is_empty());
            let mut r = b.wait().unwrap();
            assert!(d.wait().unwrap().fds.is_empty());
            assert_eq!(r.fds.len(), 1, "{backend:?}");
            let file = std::fs::File::from(r.fds.pop().unwrap());
            let mut got = vec![0u8; secret.len()];
            file.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, secret.as_bytes());
        }
    }
}

#[test]
fn after_declining_descriptors_replies_arrive_intact_and_descriptors_are_not_delivered() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let c = f.client(&f.unix);
        // Accepted before the client declines them (the opening reply).
        let mut first = c.call(SEND_FD, b"opening", LONG).unwrap();
        assert_eq!(first.fds.len(), 1, "{backend:?}");
        drop(first.fds.pop());
        c.decline_fds();
        for round in 0..3 {
            let a = c.start(ECHO, b"before", LONG).unwrap();
            let b = c
                .start(SEND_FD, format!("late {round}").as_bytes(), LONG)
                .unwrap();
            let d = c.start(ECHO, b"after", LONG).unwrap();
            assert_eq!(a.wait().unwrap().payload(), b"before", "{backend:?}");
            let r = b.wait().unwrap();
            assert_eq!(r.payload(), b"fd attached", "{backend:?}");
            assert!(
                r.fds.is_empty(),
                "{backend:?}: a declined descriptor was delivered"
            );
            assert_eq!(d.wait().unwrap().payload(), b"after", "{backend:?}");
        }
    }
}

#[test]
fn the_handler_can_close_a_connection_after_its_reply() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let c = f.client(ep);
            assert_eq!(c.call(CLOSE_ME, b"", LONG).unwrap().payload(), b"bye");
            let err = c.call(ECHO, b"x", LONG).unwrap_err();
            assert!(matches!(err, ClientError::Closed { .. }), "{err:?}");
        }
    }
}

#[test]
fn a_server_that_shuts_down_fails_pending_calls() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        let c = f.client(&f.unix);
        let pending = c.start(DEFER, b"never", LONG).unwrap();
        f.wait_until("the deferred request", |s| !s.deferred.lock().is_empty());
        let handler = f.server.shutdown().unwrap();
        assert!(!handler.seen.disconnects.lock().is_empty());
        assert!(matches!(
            pending.wait().unwrap_err(),
            ClientError::Closed { .. }
        ));
        let Endpoint::Unix(path) = &f.unix else {
            unreachable!()
        };
        assert!(!path.exists(), "the socket file is removed on shutdown");
    }
}

/// Large frames from several connections at once arrive whole and in
/// order on every backend. With provided buffers, the io_uring server
/// starts with a small live set (16) and grows it when a receive finds them
/// all in use, which these frames force and the statistics show; direct
/// receives grow each connection's decoder instead and use no such buffers.
#[test]
fn concurrent_large_frames_outgrow_the_live_receive_buffers_without_losing_a_byte() {
    const CONNECTIONS: usize = 6;
    const CALLS: usize = 8;
    const LEN: usize = 600 << 10;
    for backend in backends() {
        let mut cfg = server_config(backend);
        // 16 live buffers of 4 KiB (64 KiB) against 600 KiB frames.
        cfg.io.recv_buffer_bytes = 4096;
        cfg.io.recv_buffer_count = 1024;
        let f = start(backend, cfg);
        std::thread::scope(|s| {
            for t in 0..CONNECTIONS {
                let c = f.client(&f.unix);
                s.spawn(move || {
                    for call in 0..CALLS {
                        let seed = t * CALLS + call;
                        let payload: Vec<u8> =
                            (0..LEN).map(|i| ((i * 31 + seed) % 251) as u8).collect();
                        let r = c.call(ECHO, &payload, LONG).unwrap();
                        assert!(
                            r.payload() == payload.as_slice(),
                            "{backend:?}: connection {t} call {call} came back altered"
                        );
                    }
                });
            }
        });
        let exhausted = f.server.stats().recv_buffers_exhausted;
        match (backend.server, backend.recv) {
            (BackendChoice::Uring, RecvMode::Provided) => assert!(
                exhausted > 0,
                "{backend:?}: 600 KiB frames never exhausted 64 KiB of live buffers"
            ),
            _ => assert_eq!(
                exhausted, 0,
                "{backend:?}: only io_uring's provided-buffer receives use them"
            ),
        }
    }
}

/// Requests of 16 KiB and more leave the client as three parts (header,
/// the caller's payload, padding) in one vectored `sendmsg`, smaller ones
/// copied into one buffer. Lengths on both sides of the switch, with and
/// without padding, and large enough that the kernel takes a frame in
/// several writes cut inside any part, all arrive intact and in order.
#[test]
fn requests_on_both_sides_of_the_vectored_send_threshold_arrive_intact() {
    for backend in backends() {
        let f = start(backend, server_config(backend));
        for ep in f.endpoints() {
            let c = f.client(ep);
            for len in [16_383usize, 16_384, 16_385, 16_391, 262_147, (3 << 20) + 5] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 13 % 253) as u8).collect();
                let r = c.call(ECHO, &payload, LONG).unwrap();
                assert!(
                    r.payload() == payload.as_slice(),
                    "{backend:?} {ep}: a {len}-byte request came back altered"
                );
                // The stream stays framed: a small call right after.
                assert_eq!(c.call(ECHO, b"next", LONG).unwrap().payload(), b"next");
            }
        }
    }
}

/// Unread bytes in `s`'s send queue (`SIOCOUTQ`): for a Unix stream
/// socket, what its peer has not received yet.
fn unreceived_bytes(s: &std::os::unix::net::UnixStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one int through the pointer.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    assert_eq!(rc, 0, "SIOCOUTQ: {}", std::io::Error::last_os_error());
    n as usize
}

/// With provided receive buffers, one completion can carry more bytes than
/// the frame decoder has room for: the decoder holds all but the last bytes
/// of a maximum frame (it grows to one maximum frame plus 64 KiB, no
/// more), and a 1 MiB buffer brings that frame's end with ~100 KiB of
/// pipelined requests after it. The server takes such a completion in
/// pieces, decoding between them: every request is answered, in order, and
/// the loop stays up. Deterministic: a `GATE` request holds the loop while
/// the tail and the small frames are lined up in the socket, so that one
/// receive takes them all.
#[test]
fn a_completion_larger_than_the_decoders_room_after_a_maximum_frame_is_taken_in_pieces() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use cxlkv_controlplane::frame::{Decoded, FrameDecoder, encode_frame};
    use cxlkv_controlplane::transport::IoConfig;

    let uring = IoConfig {
        backend: BackendChoice::Uring,
        ..Default::default()
    };
    if let Err(e) = cxlkv_controlplane::transport::probe_uring(&uring) {
        eprintln!("io_uring unavailable, nothing to test: {e}");
        return;
    }
    let backend = Backends {
        recv: RecvMode::Provided,
        ..Backends::of(BackendChoice::Uring, BackendChoice::Fallback)
    };
    let mut cfg = server_config(backend);
    cfg.io.recv_buffer_bytes = 1 << 20;
    cfg.io.recv_buffer_count = 16;
    let f = start(backend, cfg);
    let gate = f.client(&f.unix);
    let Endpoint::Unix(path) = &f.unix else {
        unreachable!()
    };
    let mut raw = UnixStream::connect(path).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();

    let mut big = Vec::new();
    encode_frame(&mut big, ECHO, 1, &vec![0x5A; MAX_PAYLOAD_BYTES]).unwrap();
    let (head, tail) = big.split_at(big.len() - 8);
    raw.write_all(head).unwrap();
    let until = std::time::Instant::now() + LONG;
    while unreceived_bytes(&raw) > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the server never took the head"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Hold the loop, line up the frame's end and ~100 KiB of requests
    // (within the socket's buffer: the write does not block), release.
    const SMALL: u64 = 100;
    let held = gate.start(GATE, b"", LONG).unwrap();
    f.wait_until("the gate holds the loop", |s| {
        s.gate_entered.load(std::sync::atomic::Ordering::SeqCst)
    });
    let mut rest = tail.to_vec();
    for id in 2..2 + SMALL {
        encode_frame(&mut rest, ECHO, id, &[id as u8; 1000]).unwrap();
    }
    assert!(
        rest.len() > 96 << 10,
        "more than the decoder's spare 64 KiB"
    );
    raw.write_all(&rest).unwrap();
    f.seen.open_gate();
    assert_eq!(held.wait().unwrap().payload(), b"released");

    let mut d = FrameDecoder::new();
    let mut answered = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    while answered.len() < 1 + SMALL as usize {
        match d.decode().unwrap() {
            Some(Decoded::Frame(fr)) => {
                let id = fr.header.request_id;
                let expect_len = if id == 1 { MAX_PAYLOAD_BYTES } else { 1000 };
                assert_eq!(fr.payload.len(), expect_len, "reply {id}");
                answered.push(id);
                continue;
            }
            Some(other) => panic!("unexpected {other:?}"),
            None => {}
        }
        let n = raw.read(&mut buf).expect("replies keep coming");
        assert!(n > 0, "the server closed after {} replies", answered.len());
        d.push(&buf[..n]);
    }
    assert_eq!(answered, (1..2 + SMALL).collect::<Vec<_>>());
    assert_eq!(
        gate.call(ECHO, b"still up", LONG).unwrap().payload(),
        b"still up"
    );
    f.server.shutdown().expect("the loop ran to its stop");
}
