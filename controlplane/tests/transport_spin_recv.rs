//! The connection a spinning server loop reads with plain `recv`s
//! (`IoConfig::spin_recv`): it is used, it can be turned off, it gives its
//! connection back to the backend's own waiting when it goes quiet, it
//! sees a stream end, and a connection that never stops sending does not
//! keep the loop from the others. Every server backend (an io_uring server
//! in both receive modes).

mod transport_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cxlkv_controlplane::frame::{FrameDecoder, encode_frame};
use cxlkv_controlplane::transport::{BackendChoice, Endpoint, RecvMode};
use transport_common::*;

/// Whether this backend polls at all: an io_uring server with provided
/// buffers keeps every receive in the ring (the bytes land in a buffer of
/// the ring's, not in the connection's decoder).
fn polls(b: Backends) -> bool {
    !(b.server == BackendChoice::Uring && b.recv == RecvMode::Provided)
}

fn unix_path(f: &Fixture) -> &std::path::Path {
    let Endpoint::Unix(path) = &f.unix else {
        unreachable!("the fixture's first endpoint is its Unix socket")
    };
    path
}

/// Back-to-back one-key-sized requests on one connection: with
/// `spin_recv` on (the default), the loop reads some of them itself (how
/// many depends on how fast this host's client answers); off, none — nor
/// with `spin_us = 0`, where the loop never spins (a polled `recv` would
/// only find nothing before the loop sleeps). Every reply is right.
#[test]
fn back_to_back_requests_are_read_by_the_spinning_loop_unless_turned_off() {
    for b in server_backends() {
        for (on, spin_us) in [(true, None), (false, None), (true, Some(0))] {
            let mut cfg = server_config(b);
            cfg.io.spin_recv = on;
            if let Some(us) = spin_us {
                cfg.io.spin_us = us;
            }
            let on = on && spin_us != Some(0);
            let f = start(b, cfg);
            let c = f.client(&f.unix);
            for i in 0..200u32 {
                let payload = i.to_le_bytes();
                let r = c.call(ECHO, &payload, LONG).unwrap();
                assert_eq!(r.payload(), payload, "{b:?} spin_recv={on}");
            }
            let polled = f.server.stats().polled_reads;
            if on && polls(b) {
                assert!(
                    polled > 0,
                    "{b:?}: no request was read by the spinning loop"
                );
            } else {
                assert_eq!(polled, 0, "{b:?} spin_recv={on}");
            }
        }
    }
}

/// Requests in bursts of five, with `pause` between bursts, on a server
/// whose loop spins `spin_us`: every one answered; returns the polled
/// reads.
fn bursts_with_pauses(b: Backends, spin_us: u32, pause: Duration) -> u64 {
    let mut cfg = server_config(b);
    cfg.io.spin_us = spin_us;
    let f = start(b, cfg);
    let c = f.client(&f.unix);
    for burst in 0..20u32 {
        for i in 0..5u32 {
            let payload = [burst.to_le_bytes(), i.to_le_bytes()].concat();
            let r = c
                .call(ECHO, &payload, LONG)
                .unwrap_or_else(|e| panic!("{b:?}: burst {burst}, request {i}: {e}"));
            assert_eq!(r.payload(), payload, "{b:?}");
        }
        std::thread::sleep(pause);
    }
    f.server.stats().polled_reads
}

/// A connection the loop polled, then quiet for longer than the loop
/// spins (so the loop sleeps): its next request still wakes the loop and
/// is answered — its receive went back to the backend's own waiting.
#[test]
fn a_polled_connection_that_goes_quiet_still_wakes_the_sleeping_loop() {
    for b in server_backends() {
        let polled = bursts_with_pauses(b, 20, Duration::from_millis(3));
        if polls(b) {
            assert!(polled > 0, "{b:?}: never polled");
        }
    }
}

/// A polled connection that pauses for longer than it may stay polled
/// (50 µs) but not long enough for the loop to sleep: its connection is
/// given back to the backend's waiting by the idle path (not the sleep
/// path), and the request after each pause is answered.
#[test]
fn a_polled_connection_that_pauses_while_the_loop_spins_is_still_answered() {
    for b in server_backends() {
        bursts_with_pauses(b, 50_000, Duration::from_micros(300));
    }
}

/// A polled connection closed later in the turn of its polled read (its
/// peer is gone, so the reply's `send` fails) frees its slot at once; the
/// next connection accepted takes that slot and gets its own receive. The
/// loop must not take the newcomer for the polled connection (a debug
/// build checked that the polled connection has no ring receive and died
/// here). Not deterministic in one attempt — the request must reach the
/// server while its connection is still polled — so thirty.
#[test]
fn a_closed_polled_connections_slot_reused_by_a_new_connection_serves_it() {
    for b in server_backends() {
        for attempt in 0..30 {
            let f = start(b, server_config(b));
            let path = unix_path(&f);
            let mut first = UnixStream::connect(path).unwrap();
            first.set_read_timeout(Some(LONG)).unwrap();
            let mut echo = Vec::new();
            encode_frame(&mut echo, ECHO, 1, b"ping").unwrap();
            first.write_all(&echo).unwrap();
            let mut reply = vec![0u8; echo.len()];
            first.read_exact(&mut reply).unwrap();
            // Read by the polled `recv` if it comes within 50 µs.
            let mut gate = Vec::new();
            encode_frame(&mut gate, GATE, 2, b"").unwrap();
            first.write_all(&gate).unwrap();
            f.wait_until("the gate holds the loop", |s| {
                s.gate_entered.load(Ordering::SeqCst)
            });
            drop(first); // the gate's reply will fail: EPIPE
            let mut second = UnixStream::connect(path).unwrap();
            second.set_read_timeout(Some(LONG)).unwrap();
            f.seen.open_gate();
            let mut echo = Vec::new();
            encode_frame(&mut echo, ECHO, 3, b"pong").unwrap();
            second.write_all(&echo).unwrap();
            let mut reply = vec![0u8; echo.len()];
            second.read_exact(&mut reply).unwrap_or_else(|e| {
                panic!(
                    "{b:?}, attempt {attempt}: the new connection unanswered ({e}); \
                     the loop: {:?}",
                    f.server.failure()
                )
            });
            assert!(
                f.server.failure().is_none(),
                "{b:?}: {:?}",
                f.server.failure()
            );
        }
    }
}

/// A peer that ends its stream right after its reply — while its
/// connection is likely still the polled one, though the end may be read
/// through either path — still gets every reply and is seen to go.
#[test]
fn a_polled_connection_whose_peer_ends_its_stream_is_closed() {
    for b in server_backends() {
        let f = start(b, server_config(b));
        for n in 0..20u64 {
            let before = f.seen.disconnects.lock().len();
            let mut s = UnixStream::connect(unix_path(&f)).unwrap();
            s.set_read_timeout(Some(LONG)).unwrap();
            let mut frames = Vec::new();
            encode_frame(&mut frames, ECHO, n, b"ping").unwrap();
            let mut reply = vec![0u8; frames.len()];
            for _ in 0..3 {
                s.write_all(&frames).unwrap();
                s.read_exact(&mut reply).unwrap();
            }
            s.shutdown(std::net::Shutdown::Write).unwrap();
            // The server ends the stream once its replies are out.
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).unwrap();
            assert!(rest.is_empty(), "{b:?}: bytes after the last reply");
            f.wait_until("the server to drop the ended connection", |seen| {
                seen.disconnects.lock().len() > before
            });
        }
    }
}

/// Requests lined up behind a request that holds the loop, each exactly
/// two of the loop's 64 KiB receives: so a turn completes at most one
/// request, and its one small reply goes out at once with a `send` (a
/// batch of replies would go through the ring, and the submission would
/// run the ring's pending receive work too). Twelve: more than an epoll
/// loop reads of one connection before it asks epoll again
/// (`POLLED_WAIT_EVERY` polled reads) plus what it then reads for that
/// connection's event (a 256 KiB budget), so the other request must come
/// before the end.
const LINED_UP: u64 = 12;
const LINED_UP_FRAME_BYTES: usize = 128 << 10;

/// A polled connection with a run of requests waiting does not keep the
/// loop from another connection's request until that run is over: the
/// other request is delivered before the run's last frame. Each request of
/// the run fills two receives and is answered with one small reply, sent
/// at once — so an io_uring loop enters the kernel for nothing else and
/// must run the ring's receive work between polled reads itself; an epoll
/// loop must still ask epoll every few turns. Deterministic: a `GATE` request
/// on the polled connection holds the loop while both are lined up in the
/// sockets.
#[test]
fn a_polled_connection_with_requests_lined_up_does_not_hold_up_another() {
    use cxlkv_controlplane::frame::HEADER_BYTES;
    for b in server_backends() {
        if !polls(b) {
            continue;
        }
        let f = start(b, server_config(b));
        // The other connection, connected first (so that only the gated
        // one can become the polled connection).
        let other = f.client(&f.unix);
        let mut polled = UnixStream::connect(unix_path(&f)).unwrap();
        let room = set_send_buffer(&polled, 2 * LINED_UP as usize * LINED_UP_FRAME_BYTES);
        // With some slack for the kernel's bookkeeping of the bytes.
        if room < (LINED_UP as usize + 2) * LINED_UP_FRAME_BYTES {
            eprintln!(
                "{b:?}: skipped: a socket's send buffer holds {room} bytes here \
                 (net.core.wmem_max; SO_SNDBUFFORCE refused), too few to line up \
                 {LINED_UP} requests of {LINED_UP_FRAME_BYTES} bytes"
            );
            continue;
        }
        polled.set_read_timeout(Some(LONG)).unwrap();
        let mut gate = Vec::new();
        encode_frame(&mut gate, GATE, 1, b"").unwrap();
        polled.write_all(&gate).unwrap();
        f.wait_until("the gate holds the loop", |s| {
            s.gate_entered.load(Ordering::SeqCst)
        });
        // `SIZED` requests of two receives each, answered with 8 bytes.
        let mut payload = vec![7u8; LINED_UP_FRAME_BYTES - HEADER_BYTES];
        payload[..4].copy_from_slice(&8u32.to_le_bytes());
        let mut run = Vec::new();
        for id in 0..LINED_UP {
            encode_frame(&mut run, SIZED, 1_000_000 + id, &payload).unwrap();
        }
        assert_eq!(run.len(), LINED_UP as usize * LINED_UP_FRAME_BYTES);
        polled.set_nonblocking(true).unwrap();
        let mut off = 0;
        while off < run.len() {
            match polled.write(&run[off..]) {
                Ok(k) => off += k,
                Err(e) => panic!(
                    "lining up {} bytes: {e} after {off} (the socket's send buffer \
                     is too small: net.core.wmem_max)",
                    run.len()
                ),
            }
        }
        polled.set_nonblocking(false).unwrap();
        let pending = other.start(ECHO, b"other", LONG).unwrap();
        f.seen.open_gate();
        assert_eq!(pending.wait().unwrap().payload(), b"other", "{b:?}");
        // Every reply of the run comes back.
        let mut d = FrameDecoder::new();
        let mut buf = vec![0u8; 64 << 10];
        let mut replies = 0;
        while replies < LINED_UP + 1 {
            let k = polled.read(&mut buf).unwrap();
            assert!(k > 0, "{b:?}: the server ended the stream");
            d.push(&buf[..k]);
            while let Some(_frame) = d.decode().unwrap() {
                replies += 1;
            }
        }
        let delivered = f.seen.delivered.lock();
        let run_ids = 1_000_000..1_000_000 + LINED_UP;
        let run_conn = delivered
            .iter()
            .find(|(_, id)| run_ids.contains(id))
            .map(|(c, _)| *c)
            .unwrap();
        let other_at = delivered.iter().position(|(c, _)| *c != run_conn).unwrap();
        let run_end = delivered.iter().rposition(|(c, _)| *c == run_conn).unwrap();
        eprintln!(
            "{b:?} other_at {other_at} run_end {run_end} polled_reads {} {:?}",
            f.server.stats().polled_reads,
            &delivered[..]
        );
        assert!(
            other_at < run_end,
            "{b:?}: the other request was delivered after the whole run of \
             {LINED_UP} (at {other_at}, the run ended at {run_end})"
        );
    }
}

/// Asks for a send buffer of `bytes` (past `net.core.wmem_max` where
/// allowed: `SO_SNDBUFFORCE` needs `CAP_NET_ADMIN`); returns what the
/// socket got.
fn set_send_buffer(s: &UnixStream, bytes: usize) -> usize {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let v = libc::c_int::try_from(bytes).unwrap();
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let set = |option| {
        // SAFETY: both options read one int through the pointer, which
        // outlives the call.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, option, (&raw const v).cast(), len) }
    };
    if set(libc::SO_SNDBUFFORCE) != 0 {
        let rc = set(libc::SO_SNDBUF);
        assert_eq!(rc, 0, "SO_SNDBUF: {}", std::io::Error::last_os_error());
    }
    let mut got: libc::c_int = 0;
    let mut got_len = len;
    // SAFETY: SO_SNDBUF writes one int and its length through the pointers.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&raw mut got).cast(),
            &mut got_len,
        )
    };
    assert_eq!(rc, 0, "SO_SNDBUF: {}", std::io::Error::last_os_error());
    usize::try_from(got).unwrap()
}
