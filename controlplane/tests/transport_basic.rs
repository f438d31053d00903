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
