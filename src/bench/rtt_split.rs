//! `cxlkv bench rtt`'s split cases: where a one-key round trip's time goes.
//!
//! The default case times our client against our server; these time each
//! of them against a raw peer, in the same reps as the raw exchange:
//!
//! - `transport=unix,split=client`: our `RpcClient` against a raw *frame*
//!   server — a forked child that busy-polls its socket, reads each
//!   request frame whole and answers with our reply frame's bytes, its
//!   request id patched in. No decode, no handler: what is left above the
//!   raw exchange is the client library.
//! - `transport=unix,split=server`: a raw client — busy-polling, one
//!   pre-encoded request frame with a fresh request id each time, reading
//!   exactly the reply's bytes — against our forked server (its own
//!   session, opened with a raw `Hello`). What is left above the raw
//!   exchange is the server: its loop, transport and handler.
//!
//! `ratio` = raw p50 ÷ that p50, as for the other cases; `share_us` = that
//! p50 − raw p50 (medians over reps): the part's cost above the raw
//! exchange. The two shares add up to about the default case's gap (the
//! parts overlap a little: each end's polling meets the other's writes).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::frame::{FrameHeader, HEADER_BYTES, encode_frame, frame_len};
use cxlkv_controlplane::proto::{self, Kind as MsgKind, RequestMeta};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient};

use super::forked_server::ForkedServer;
use super::pool_target::BenchPool;
use super::rtt::{
    Child, Kind, fork_child, paired_ratios, raw_latencies, raw_recv, raw_send, start_default_unix,
    with_paired,
};
use super::server::payload;
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;

const SCENARIO: &str = "rtt";
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on every raw wait (the peers spin; this is a hang guard).
const RAW_TIMEOUT: Duration = Duration::from_secs(10);
/// Request ids of the raw client: far from the session client's.
const RAW_FIRST_ID: u64 = 1 << 40;

/// The raw frame server (module docs) in a forked child, and its socket's
/// path; the child serves one connection and spins, so it is started for
/// its measurement and killed after (dropping the `Child`).
fn raw_frame_server(request_bytes: usize, reply: Vec<u8>) -> anyhow::Result<(Child, Endpoint)> {
    let path = std::env::temp_dir().join(format!("cxlkv-rtt-{}-split.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).context("bind the raw frame server")?;
    let child = fork_child(move || {
        let Ok((s, _)) = listener.accept() else {
            return;
        };
        if s.set_nonblocking(true).is_err() {
            return;
        }
        let mut request = vec![0u8; request_bytes];
        let mut reply = reply;
        loop {
            // No deadline of its own: it dies with the bench (`fork_child`).
            let far = Instant::now() + Duration::from_secs(3600);
            if raw_recv(s.as_fd(), &mut request, far).is_err() {
                return;
            }
            reply[8..16].copy_from_slice(&request[8..16]);
            if raw_send(s.as_fd(), &reply, far).is_err() {
                return;
            }
        }
    })?;
    Ok((child, Endpoint::Unix(path)))
}

/// A raw client with a session on our server: a connection that sent a
/// `Hello` and read its welcome (its descriptors, if any, are dropped by
/// the kernel: a plain `read` takes none).
fn raw_session(server: &ForkedServer) -> anyhow::Result<UnixStream> {
    let mut s = UnixStream::connect(server.socket()).context("connect a raw client")?;
    s.set_read_timeout(Some(RAW_TIMEOUT))?;
    let hello = payload(
        &mut Vec::new(),
        &proto::Hello {
            meta: RequestMeta::default(),
            protocol_min: proto::PROTOCOL_MIN,
            protocol_max: proto::PROTOCOL_MAX,
            instance_id: "bench-split".into(),
            client_name: "cxlkv bench rtt (raw client)".into(),
            client_secret: None,
        },
    )?;
    let mut frame = Vec::new();
    encode_frame(&mut frame, MsgKind::Hello.as_u16(), 1, &hello)?;
    s.write_all(&frame)?;
    let mut header = [0u8; HEADER_BYTES];
    s.read_exact(&mut header)?;
    let header = FrameHeader::decode(&header)?;
    anyhow::ensure!(
        header.kind == MsgKind::Welcome.as_u16(),
        "the raw client's Hello was answered with kind {}",
        header.kind
    );
    let mut rest = vec![0u8; frame_len(header.payload_len as usize) - HEADER_BYTES];
    s.read_exact(&mut rest)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// Round trips of our client against the raw frame server (µs each).
fn client_share(frame: (usize, &[u8]), request: &[u8], n: usize) -> anyhow::Result<Vec<f64>> {
    let (request_bytes, reply) = frame;
    let (_child, ep) = raw_frame_server(request_bytes, reply.to_vec())?;
    let client = RpcClient::connect(&ep, ClientConfig::default());
    if let Endpoint::Unix(path) = &ep {
        let _ = std::fs::remove_file(path);
    }
    let client = client?;
    // As after a session's opening reply: replies are read with `recv`.
    client.decline_fds();
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        let reply = client.call(MsgKind::Exists.as_u16(), request, CALL_TIMEOUT)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        anyhow::ensure!(
            reply.kind() == MsgKind::ExistsReply.as_u16(),
            "the raw frame server's reply is not the ExistsReply it was given"
        );
        if i >= n / 10 {
            out.push(us);
        }
    }
    Ok(out)
}

/// Round trips of the raw client against our server (µs each); `next_id`
/// carries the request ids on from rep to rep.
fn server_share(
    sock: &UnixStream,
    request_frame: &[u8],
    reply_bytes: usize,
    n: usize,
    next_id: &mut u64,
) -> anyhow::Result<Vec<f64>> {
    let mut frame = request_frame.to_vec();
    let mut reply = vec![0u8; reply_bytes];
    let mut out = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        frame[8..16].copy_from_slice(&next_id.to_le_bytes());
        *next_id += 1;
        let t = Instant::now();
        raw_send(sock.as_fd(), &frame, t + RAW_TIMEOUT)?;
        raw_recv(sock.as_fd(), &mut reply, t + RAW_TIMEOUT)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        anyhow::ensure!(
            reply[8..16] == frame[8..16]
                && reply[6..8] == MsgKind::ExistsReply.as_u16().to_le_bytes(),
            "our server's reply to the raw client is not its ExistsReply"
        );
        if i >= n / 10 {
            out.push(us);
        }
    }
    Ok(out)
}

/// Emits the two split cases (module docs).
pub(super) fn run(args: &BenchArgs, r: &mut Reporter, target: &BenchPool) -> anyhow::Result<()> {
    let n = if args.quick { 2_000 } else { 20_000 };
    let ours = start_default_unix(target)?;
    let (request, server) = (&ours.request, &ours.server);
    let mut request_frame = Vec::new();
    encode_frame(&mut request_frame, MsgKind::Exists.as_u16(), 0, request)?;
    let mut reply_frame = Vec::new();
    encode_frame(&mut reply_frame, ours.reply.0, 0, &ours.reply.1)?;
    let sizes = (request_frame.len(), reply_frame.len());
    let raw_client = raw_session(server)?;
    let mut next_id = RAW_FIRST_ID;
    let (mut raw_p50, mut client_p50, mut server_p50) = (Vec::new(), Vec::new(), Vec::new());
    let (mut client_all, mut server_all) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let mut raw = raw_latencies(Kind::Unix, sizes, n, None)?;
        raw_p50.push(percentile(&mut raw, 50.0));
        let mut c = client_share((sizes.0, &reply_frame), request, n)?;
        client_p50.push(percentile(&mut c, 50.0));
        client_all.extend(c);
        let mut s = server_share(&raw_client, &request_frame, sizes.1, n, &mut next_id)?;
        server_p50.push(percentile(&mut s, 50.0));
        server_all.extend(s);
    }
    let base = median(&mut raw_p50.clone());
    for (case, p50s, all, server_backend, client_backend, part) in [
        (
            "transport=unix,split=client",
            &mut client_p50,
            &mut client_all,
            "raw".to_owned(),
            ours.client.backend().to_string(),
            "our client against a raw frame server",
        ),
        (
            "transport=unix,split=server",
            &mut server_p50,
            &mut server_all,
            server.backend().to_owned(),
            "raw".to_owned(),
            "a raw client against our server",
        ),
    ] {
        let ratios = paired_ratios(&raw_p50, p50s, false);
        let p50 = median(p50s);
        let rec = Record::new(SCENARIO, case, p50, base, "us", Better::Lower)
            .with("p50_us", p50)
            .with("p99_us", percentile(all, 99.0))
            .with("raw_p50_us", base)
            .with("share_us", p50 - base)
            .with("measures", part)
            .with("request", "exists, one 100-byte key (present)")
            .with("server_backend", server_backend)
            .with("client_backend", client_backend)
            .with("round_trips_per_rep", n as u64)
            .with("reps", args.reps as u64)
            .with("request_wire_bytes", sizes.0 as u64)
            .with("reply_wire_bytes", sizes.1 as u64);
        r.emit(&target.tag(with_paired(rec, ratios)))?;
    }
    Ok(())
}
