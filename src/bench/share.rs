//! `cxlkv bench share`: a second process reading 4 MiB chunks written by a
//! first one — in place through the pool (ours) against transferring the
//! same chunks over loopback TCP between the same two processes into a
//! buffer the reader owns (the transfer-based design cxlkv replaces).
//!
//! Three processes: the server (forked), the writer (forked: it stores 16
//! chunks with `batch_put`, then serves the same bytes from its own memory
//! over TCP, 64 MiB per request), and this process, the reader. Per
//! repetition, interleaved:
//!
//! - **ours**: `batch_get` of the 16 keys returning pinned views (one
//!   `Lookup` round trip), then a checksum over every byte of the views;
//! - **baseline**: a one-byte request, then `read_exact` of the 64 MiB into a
//!   reader-owned, prefaulted buffer (the transfer completing), then the
//!   same checksum over the buffer.
//!
//! `ours`, `baseline` and `ratio` compare the like-for-like total: request
//! to every byte read once (`ours_consumed_ms`, `baseline_consumed_ms`;
//! `ratio_consumed` is the same ratio, kept for the documented target), and
//! `chunks_per_s` is chunks over that time. The split is kept as extra
//! fields, not as the headline, because its two halves do different work:
//! `ours_views_ms` is until the reader holds pinned views (no byte of the
//! chunks read yet), `baseline_received_ms` until the transfer has landed
//! every byte in the reader's buffer; `ratio_views` and
//! `chunks_per_s_views` are from those.
//!
//! Both checksums must equal the writer's. Cases: `warm` — one reader
//! client for the whole case, its mapping of the writer's region made (and
//! its page tables filled) by a warm-up read; `cold` — a new reader client
//! per repetition, so the timed `batch_get` maps the writer's region and
//! the checksum takes the page faults of a fresh mapping.
//!
//! The server's pool is `--pool` when given (`pool`, `dest`): the reader's
//! checksum then reads the device.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::forked_server::{ForkedServer, PEER_TIMEOUT, bench_config, checksum};
use super::pool_target::BenchPool;
use super::rtt::fork_child;
use super::{Better, Record, Reporter, median};
use crate::cli::BenchArgs;
use crate::client::{Client, ClientConfig, LayoutOptions, RegisterOutcome};

const SCENARIO: &str = "share";
const MIB: usize = 1 << 20;
const CHUNK_BYTES: usize = 4 * MIB;
const CHUNKS: usize = 16;
const FINGERPRINT: u64 = 0x5_4A2E;

fn keys() -> Vec<Vec<u8>> {
    (0..CHUNKS)
        .map(|i| format!("share-{i}").into_bytes())
        .collect()
}

/// Entry point (registered in `cli::SCENARIOS`). Forks before any thread of
/// this process exists.
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let target = BenchPool::from_args(args)?;
    let server = ForkedServer::start(bench_config("bench-share", 512 << 20), &target)?;
    let (ready_rx, ready_tx) = UnixStream::pair().context("socket pair")?;
    let socket = server.socket().to_owned();
    let _writer = fork_child(move || {
        if let Err(e) = writer_main(&socket, ready_tx) {
            eprintln!("share writer: {e:#}");
        }
    })?;
    ready_rx.set_read_timeout(Some(PEER_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(&ready_rx)
        .read_line(&mut line)
        .context("waiting for the writer")?;
    let mut words = line.split_whitespace();
    anyhow::ensure!(words.next() == Some("ready"), "writer said {line:?}");
    let port: u16 = words.next().context("port")?.parse()?;
    let expected: u64 = words.next().context("checksum")?.parse()?;

    let mut tcp = TcpStream::connect(("127.0.0.1", port)).context("connecting to the writer")?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(PEER_TIMEOUT))?;
    let mut buf = vec![1u8; CHUNK_BYTES * CHUNKS];
    let baseline = |tcp: &mut TcpStream, buf: &mut [u8]| -> anyhow::Result<(f64, f64)> {
        let t = Instant::now();
        tcp.write_all(&[1])?;
        tcp.read_exact(buf)?;
        let ready = t.elapsed();
        let sum = checksum(buf);
        let consumed = t.elapsed();
        anyhow::ensure!(sum == expected, "the transferred bytes differ");
        Ok((ms(ready), ms(consumed)))
    };
    baseline(&mut tcp, &mut buf)?;

    for cold in [false, true] {
        let mut ours = Samples::default();
        let mut theirs = Samples::default();
        let mut warm_client = None;
        if !cold {
            let c = reader(&server)?;
            read_once(&c, expected)?;
            warm_client = Some(c);
        }
        for _ in 0..args.reps {
            let (ready, consumed) = match &warm_client {
                Some(c) => read_once(c, expected)?,
                None => {
                    let c = reader(&server)?;
                    let t = read_once(&c, expected)?;
                    c.close()?;
                    t
                }
            };
            ours.push(ready, consumed);
            let (ready, consumed) = baseline(&mut tcp, &mut buf)?;
            theirs.push(ready, consumed);
        }
        if let Some(c) = warm_client {
            c.close()?;
        }
        let (views, received) = (median(&mut ours.ready), median(&mut theirs.ready));
        let (oc, bc) = (median(&mut ours.consumed), median(&mut theirs.consumed));
        let name = if cold { "cold" } else { "warm" };
        let rec = Record::new(SCENARIO, name, oc, bc, "ms", Better::Lower);
        let ratio = rec.ratio;
        let rec = rec
            .with("ratio_consumed", ratio)
            .with("ours_consumed_ms", oc)
            .with("baseline_consumed_ms", bc)
            .with("chunks_per_s", per_s(oc))
            .with(
                "ratio_views",
                if views > 0.0 { received / views } else { 0.0 },
            )
            .with("ours_views_ms", views)
            .with("baseline_received_ms", received)
            .with("chunks_per_s_views", per_s(views))
            .with("chunks", CHUNKS as u64)
            .with("chunk_bytes", CHUNK_BYTES as u64)
            .with("baseline_kind", "loopback TCP into a reader-owned buffer")
            .with("reps", args.reps as u64);
        let rec = target.tag(rec);
        r.emit(&rec)?;
    }
    Ok(())
}

/// Chunks per second for a read of all of them in `ms` milliseconds.
fn per_s(ms: f64) -> f64 {
    if ms > 0.0 {
        CHUNKS as f64 / (ms / 1e3)
    } else {
        0.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[derive(Default)]
struct Samples {
    ready: Vec<f64>,
    consumed: Vec<f64>,
}

impl Samples {
    fn push(&mut self, ready: f64, consumed: f64) {
        self.ready.push(ready);
        self.consumed.push(consumed);
    }
}

fn reader(server: &ForkedServer) -> anyhow::Result<Client> {
    Client::connect(ClientConfig::unix(server.socket())).context("connecting the reader")
}

/// One timed read of the 16 chunks: (ms until pinned views are held, ms
/// until every byte was read once).
fn read_once(client: &Client, expected: u64) -> anyhow::Result<(f64, f64)> {
    let layout = client.layout(CHUNK_BYTES as u64, FINGERPRINT)?;
    let keys = keys();
    let t = Instant::now();
    let guards = layout.batch_get(&keys)?;
    let ready = t.elapsed();
    let mut sum = 0u64;
    for g in &guards {
        let g = g.as_ref().context("a written chunk is missing")?;
        sum = sum.wrapping_add(checksum(g));
    }
    let consumed = t.elapsed();
    anyhow::ensure!(sum == expected, "the shared bytes differ");
    drop(guards);
    client.flush_unpins()?;
    Ok((ms(ready), ms(consumed)))
}

/// The forked writer: stores the chunks, then serves them over TCP from its
/// own memory until the reader disconnects.
fn writer_main(socket: &Path, ready: UnixStream) -> anyhow::Result<()> {
    let client = Client::connect(ClientConfig::unix(socket))?;
    let layout = client.layout_with(
        CHUNK_BYTES as u64,
        FINGERPRINT,
        LayoutOptions {
            initial_reservation_bytes: (CHUNK_BYTES * CHUNKS) as u64,
            region_size_bytes: (CHUNK_BYTES * CHUNKS) as u64,
            auto_expand: true,
        },
    )?;
    let sources: Vec<Vec<u8>> = (0..CHUNKS)
        .map(|i| {
            (0..CHUNK_BYTES)
                .map(|j| (j as u8) ^ ((j >> 11) as u8) ^ (i as u8).wrapping_mul(97))
                .collect()
        })
        .collect();
    let keys = keys();
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .map(Vec::as_slice)
        .zip(sources.iter().map(Vec::as_slice))
        .collect();
    let outcomes = layout.batch_put(&items)?;
    anyhow::ensure!(
        outcomes.iter().all(|o| *o == RegisterOutcome::Inserted),
        "writer: {outcomes:?}"
    );
    let sum = sources
        .iter()
        .fold(0u64, |acc, s| acc.wrapping_add(checksum(s)));
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    writeln!(&ready, "ready {port} {sum}")?;
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut req = [0u8; 1];
    while s.read(&mut req)? == 1 {
        for src in &sources {
            s.write_all(src)?;
        }
    }
    drop(client);
    Ok(())
}
