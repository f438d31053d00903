//! The directory's pin bookkeeping is visible where an operator looks: the
//! (session, key) pairs pinned against `max_pinned_entries` (whose refusal
//! is `busy`) and the bytes of the pin ledgers appear in the in-process
//! `DirectoryStats`, in `/metrics` (each family with its `# HELP` and
//! `# TYPE`), and in `cxlkv stats` (human and `--json`); they follow the
//! pins taken, fall back to 0 pairs when the pins are released, and to 0
//! ledger bytes when the session ends. And `cxlkv stats --json` prints one
//! compact JSON object on one line (JSON Lines), as log shippers and
//! `jq -c` pipelines expect.

mod client_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use client_support::*;
use cxlkv::client::{Client, ClientConfig};
use cxlkv::server::{Server, ServerHandle};
use serde_json::Value;

/// Pairs allowed directory-wide: small enough that the ratio is readable.
const MAX_PINNED_ENTRIES: usize = 1000;
/// Keys the engine pins (one session: one pair each).
const PINNED: u64 = 7;

fn start() -> ServerHandle {
    let mut cfg = server_config("ops-pin-stats");
    // Long enough that no session ends by itself during the test.
    cfg.directory.session_lease = Duration::from_secs(30);
    cfg.directory.instance_grace = Duration::from_secs(30);
    cfg.directory.max_pinned_entries = MAX_PINNED_ENTRIES;
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    Server::start(cfg).expect("server starts")
}

fn engine(server: &ServerHandle) -> Client {
    let mut cfg: ClientConfig = client_config(server);
    cfg.instance_id = "engine-pins".into();
    Client::connect(cfg).unwrap()
}

/// `cxlkv stats --json`, parsed.
fn stats_json(socket: &str) -> Value {
    let out = cxlkv(&["stats", "--json", "--socket", socket]);
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

/// The value of the unlabelled gauge `name` in `/metrics`, after checking
/// that its family has `# HELP` and `# TYPE name gauge` lines.
fn gauge(addr: SocketAddr, name: &str) -> u64 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a complete answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let lines: Vec<&str> = body.lines().collect();
    let help = format!("# HELP {name} ");
    let at = lines
        .iter()
        .position(|l| l.starts_with(&help))
        .unwrap_or_else(|| panic!("no HELP line for {name} in\n{body}"));
    assert_eq!(lines[at + 1], format!("# TYPE {name} gauge"));
    let (sample, value) = lines[at + 2].split_once(' ').expect("a sample line");
    assert_eq!(sample, name);
    value.parse().expect("an integer gauge")
}

#[test]
fn pinned_pairs_their_limit_and_ledger_bytes_are_reported_and_fall_back_to_zero() {
    let server = start();
    let addr = server.metrics_addr().expect("metrics are configured");
    let socket = server.socket_path().to_str().unwrap().to_owned();
    let client = engine(&server);
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..PINNED).map(|i| (key(i), chunk(i, 1000))).collect();
    layout.batch_put(&items).unwrap();
    let keys: Vec<Vec<u8>> = (0..PINNED).map(key).collect();
    let guards = layout.batch_get(&keys).unwrap();
    assert!(guards.iter().all(Option::is_some));

    // Pinned: every view reports the pairs, the limit and the ledgers.
    let st = server.directory_stats().unwrap();
    assert_eq!(st.pinned_entries, PINNED);
    assert_eq!(st.max_pinned_entries, MAX_PINNED_ENTRIES as u64);
    let ledger_bytes = st.pin_ledger_bytes;
    assert!(ledger_bytes >= PINNED * 16, "{ledger_bytes}");
    assert_eq!(gauge(addr, "cxlkv_pinned_entries"), PINNED);
    assert_eq!(
        gauge(addr, "cxlkv_max_pinned_entries"),
        MAX_PINNED_ENTRIES as u64
    );
    assert_eq!(gauge(addr, "cxlkv_pin_ledger_bytes"), ledger_bytes);
    let t = &stats_json(&socket)["totals"];
    assert_eq!(t["pinned_entries"], PINNED);
    assert_eq!(t["max_pinned_entries"], MAX_PINNED_ENTRIES as u64);
    assert_eq!(t["pin_ledger_bytes"], ledger_bytes);
    let text = String::from_utf8(cxlkv(&["stats", "--socket", &socket]).stdout).unwrap();
    let line = format!("pinned (session, key) pairs {PINNED} of {MAX_PINNED_ENTRIES} (0.7%)");
    assert!(text.contains(&line), "{line:?} missing from\n{text}");
    assert!(text.contains("pin ledgers "), "{text}");

    // Unpinned: no pair left; the ledger keeps its size while the session
    // lives (it is rebuilt only under the ledger budget).
    drop(guards);
    client.flush_unpins().unwrap();
    let st = server.directory_stats().unwrap();
    assert_eq!(st.pins, 0);
    assert_eq!(st.pinned_entries, 0);
    assert_eq!(st.pin_ledger_bytes, ledger_bytes);
    // The loop snapshots at most once per interval; a scrape sooner gets
    // the last text.
    std::thread::sleep(cxlkv::server::METRICS_MIN_INTERVAL);
    assert_eq!(gauge(addr, "cxlkv_pinned_entries"), 0);
    assert_eq!(stats_json(&socket)["totals"]["pinned_entries"], 0);

    // Pinned again, then the session ends with its pins held: the pairs
    // and the ledger go with it.
    let guards = layout.batch_get(&keys).unwrap();
    std::thread::sleep(cxlkv::server::METRICS_MIN_INTERVAL);
    assert_eq!(gauge(addr, "cxlkv_pinned_entries"), PINNED);
    drop(layout);
    client.close().unwrap();
    drop(guards);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let st = server.directory_stats().unwrap();
            st.sessions == 0 && st.pinned_entries == 0 && st.pin_ledger_bytes == 0
        }),
        "{:?}",
        server.directory_stats().unwrap()
    );
    std::thread::sleep(cxlkv::server::METRICS_MIN_INTERVAL);
    assert_eq!(gauge(addr, "cxlkv_pinned_entries"), 0);
    assert_eq!(gauge(addr, "cxlkv_pin_ledger_bytes"), 0);
    let t = &stats_json(&socket)["totals"];
    assert_eq!(t["pinned_entries"], 0);
    assert_eq!(
        t["pin_ledger_bytes"], 0,
        "the stats tool's own session pins nothing"
    );
}

/// `cxlkv stats --json` is one JSON Lines record: the whole object on one
/// line ending in a newline (it was pretty-printed over hundreds of lines,
/// which `jq -c`-style line pipelines and log shippers split apart).
#[test]
fn stats_json_prints_one_compact_object_on_one_line() {
    let server = start();
    let socket = server.socket_path().to_str().unwrap().to_owned();
    let out = cxlkv(&["stats", "--json", "--socket", &socket]);
    let text = String::from_utf8(out.stdout).expect("UTF-8 on stdout");
    let line = text
        .strip_suffix('\n')
        .unwrap_or_else(|| panic!("the output ends with a newline: {text:?}"));
    assert!(
        !line.contains('\n'),
        "stats --json printed {} lines, not one JSON Lines record:\n{text}",
        text.lines().count()
    );
    let v: Value = serde_json::from_str(line).expect("the line is one JSON value");
    assert!(v["totals"].is_object(), "{line}");
    assert!(
        v["observer_instance"]
            .as_str()
            .is_some_and(|o| o.starts_with("cxlkv-stats-")),
        "{line}"
    );
}
