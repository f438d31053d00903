//! The operator's tools against a live in-process server after a known
//! series of operations: `cxlkv stats --json` (the real binary) reports
//! exactly those operations field by field, and the `/metrics` endpoint
//! serves a valid Prometheus exposition whose counters, gauges and
//! histograms match them (every metric the Grafana dashboard queries is
//! served, every one served is charted or deliberately not, and the
//! metrics table of docs/operations.md lists exactly those served);
//! its HTTP edge answers bad requests with the right status; `cxlkv stats
//! --tcp` reaches a server by host name. Last, `cxlkv serve --metrics-addr`
//! as a process announces its endpoint, which answers, next to `cxlkv
//! stats`; `cxlkv top` refuses to draw into a pipe.

mod client_support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use client_support::*;
use cxlkv::client::{Client, ClientConfig, DeleteOutcome, RegisterOutcome};
use cxlkv::server::{Server, ServerHandle};
use serde_json::Value;

const ENGINE: &str = "engine-a";

/// A server with metrics on a free local port.
fn start() -> ServerHandle {
    let mut cfg = server_config("ops-tools");
    // Long enough that no session or instance ends during the test.
    cfg.directory.session_lease = Duration::from_secs(30);
    cfg.directory.instance_grace = Duration::from_secs(30);
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    Server::start(cfg).expect("server starts")
}

/// What [`workload`] did, as the directory must count it.
struct Done {
    inserted: u64,
    duplicate: u64,
    lookup_hits: u64,
    lookup_misses: u64,
    exists_hits: u64,
    exists_misses: u64,
    deleted: u64,
    delete_missing: u64,
    keys_left: u64,
    register_requests: u64,
    register_items: u64,
}

/// 10 puts, one duplicate put, a lookup of 10 present and 2 absent keys
/// (pins released), an exists of 3 + 1, a delete of 4 + 1 absent.
fn workload(client: &Client) -> Done {
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..10).map(|i| (key(i), chunk(i, 3000))).collect();
    let outcomes = layout.batch_put(&items).unwrap();
    assert!(outcomes.iter().all(|o| *o == RegisterOutcome::Inserted));
    assert!(matches!(
        layout.put(key(0), &chunk(99, 100)).unwrap(),
        RegisterOutcome::Duplicate(_)
    ));
    let mut wanted: Vec<Vec<u8>> = (0..10).map(key).collect();
    wanted.push(b"absent-1".to_vec());
    wanted.push(b"absent-2".to_vec());
    let guards = layout.batch_get(&wanted).unwrap();
    assert_eq!(guards.iter().filter(|g| g.is_some()).count(), 10);
    drop(guards);
    client.flush_unpins().unwrap();
    let present = layout
        .batch_exists(&[key(0), key(1), key(2), b"absent-3".to_vec()])
        .unwrap();
    assert_eq!(present, vec![true, true, true, false]);
    let deleted = layout
        .batch_delete(&[key(6), key(7), key(8), key(9), b"absent-4".to_vec()])
        .unwrap();
    assert_eq!(
        deleted,
        [
            vec![DeleteOutcome::Deleted; 4],
            vec![DeleteOutcome::Missing]
        ]
        .concat()
    );
    Done {
        inserted: 10,
        duplicate: 1,
        lookup_hits: 10,
        lookup_misses: 2,
        exists_hits: 3,
        exists_misses: 1,
        deleted: 4,
        delete_missing: 1,
        keys_left: 6,
        register_requests: 2,
        register_items: 11,
    }
}

fn engine(server: &ServerHandle) -> Client {
    let mut cfg: ClientConfig = client_config(server);
    cfg.instance_id = ENGINE.into();
    Client::connect(cfg).unwrap()
}

#[test]
fn stats_json_reports_exactly_the_operations_done() {
    let server = start();
    let client = engine(&server);
    let done = workload(&client);
    let socket = server.socket_path().to_str().unwrap().to_owned();

    let out = cxlkv(&["stats", "--json", "--socket", &socket]);
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let observer = r["observer_instance"].as_str().unwrap().to_owned();
    assert!(observer.starts_with("cxlkv-stats-"), "{observer}");

    let t = &r["totals"];
    assert_eq!(t["keys"], done.keys_left);
    assert_eq!(t["used_bytes"], done.keys_left * PAGE);
    assert_eq!(t["value_bytes"], done.keys_left * 3000);
    assert_eq!(t["pins"], 0, "every guard was dropped and its unpin sent");
    assert_eq!(t["pinned_keys"], 0);
    assert_eq!(t["sessions"], 2, "the engine and the tool itself");
    assert_eq!(t["instances_live"], 2);
    assert_eq!(t["instances_absent"], 0);
    assert_eq!(t["layouts"], 1);
    assert_eq!(t["long_held_pins"], 0);
    assert_eq!(t["evictions_orphan"], 0);
    assert_eq!(t["evictions_lru"], 0);
    assert_eq!(t["regions"], 1, "10 chunks of 64 KiB fit one 4 MiB region");
    assert_eq!(t["owned_bytes"], 4 << 20);
    assert_eq!(t["regions_granted"], 1);

    let o = &r["outcomes"];
    assert_eq!(o["inserted"], done.inserted);
    assert_eq!(o["duplicate"], done.duplicate);
    assert_eq!(o["rejected"], 0);
    assert_eq!(o["lookup_hits"], done.lookup_hits);
    assert_eq!(o["lookup_misses"], done.lookup_misses);
    assert_eq!(o["pins_taken"], done.lookup_hits);
    assert_eq!(o["unpinned"], done.lookup_hits);
    assert_eq!(o["not_pinned"], 0);
    assert_eq!(o["exists_hits"], done.exists_hits);
    assert_eq!(o["exists_misses"], done.exists_misses);
    assert_eq!(o["deleted"], done.deleted);
    assert_eq!(o["delete_missing"], done.delete_missing);
    assert_eq!(o["delete_pinned"], 0);

    let ops = &r["ops"];
    assert_eq!(ops["register"]["requests"], done.register_requests);
    assert_eq!(ops["register"]["items"], done.register_items);
    assert_eq!(ops["lookup"]["requests"], 1);
    assert_eq!(ops["lookup"]["items"], 12);
    assert_eq!(ops["exists"]["requests"], 1);
    assert_eq!(ops["exists"]["items"], 4);
    assert_eq!(ops["delete"]["requests"], 1);
    assert_eq!(ops["delete"]["items"], 5);
    assert_eq!(ops["hello"]["requests"], 2);
    assert_eq!(ops["request_region"]["requests"], 1);
    assert_eq!(ops["lookup"]["errors"], 0);
    assert_eq!(ops["lookup"]["latency"]["count"], 1);
    assert!(ops["lookup"]["latency"]["p99_ns"].as_u64().unwrap() > 0);

    let pools = r["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 1);
    let p = &pools[0];
    assert_eq!(p["pool"], 0);
    assert_eq!(
        p["path"].as_str().unwrap(),
        server.pool_paths()[0].to_str().unwrap()
    );
    let size = p["size_bytes"].as_u64().unwrap();
    assert!(size > 0 && size <= 256 << 20, "{size}");
    assert!(p["free_bytes"].as_u64().unwrap() <= size - (4 << 20));
    let fill = p["fill"].as_f64().unwrap();
    assert!(fill > 0.0 && fill <= 1.0, "{fill}");
    assert_eq!(p["regions"], 1);
    assert_eq!(p["keys"], done.keys_left);
    assert_eq!(p["used_bytes"], done.keys_left * PAGE);

    let instances = r["instances"].as_array().unwrap();
    let by_id: HashMap<&str, &Value> = instances
        .iter()
        .map(|i| (i["instance_id"].as_str().unwrap(), i))
        .collect();
    assert_eq!(by_id.len(), 2, "{instances:?}");
    let e = by_id[ENGINE];
    assert_eq!(e["keys"], done.keys_left);
    assert_eq!(e["used_bytes"], done.keys_left * PAGE);
    assert_eq!(e["owned_bytes"], 4 << 20);
    assert_eq!(e["regions"], 1);
    assert_eq!(e["sessions"], 1);
    assert_eq!(e["pins"], 0);
    let me = by_id[observer.as_str()];
    assert_eq!(me["keys"], 0, "the tool registers nothing");
    assert_eq!(me["owned_bytes"], 0, "the tool takes no region");

    let sessions = r["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 2);
    let s = sessions
        .iter()
        .find(|s| s["instance_id"] == ENGINE)
        .expect("the engine's session is listed");
    assert_eq!(s["transport"], "unix");
    assert_eq!(s["pid"], std::process::id(), "SO_PEERCRED of this process");
    assert_eq!(r["regions"].as_array().unwrap().len(), 1);
    assert_eq!(r["regions"][0]["owner_instance"], ENGINE);
    assert_eq!(r["regions"][0]["keys"], done.keys_left);
    assert_eq!(r["truncated"], false);

    // The human report names the same things.
    let out = cxlkv(&["stats", "--socket", &socket]);
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [ENGINE, "(this tool)", "lookup", "keys 6", "inserted 10"] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
    drop(client);
}

/// `cxlkv stats --tcp HOST:PORT` takes a host name, as `serve --tcp` does
/// (it used to refuse one: "invalid socket address syntax").
#[test]
fn stats_over_tcp_reaches_a_server_named_by_its_host() {
    // Listen where `localhost` resolves first: "localhost:<port>" reaches it.
    let local = ("localhost", 0)
        .to_socket_addrs()
        .expect("localhost resolves")
        .next()
        .expect("to an address");
    let mut cfg = server_config("ops-tools-tcp");
    cfg.tcp_listen = Some(SocketAddr::new(local.ip(), 0));
    cfg.tcp_insecure_no_secret = true;
    let server = Server::start(cfg).expect("server starts");
    let port = server.tcp_addr().expect("a TCP listener").port();

    let out = cxlkv(&["stats", "--json", "--tcp", &format!("localhost:{port}")]);
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let observer = r["observer_instance"].as_str().unwrap();
    let sessions = r["sessions"].as_array().unwrap();
    let mine = sessions
        .iter()
        .find(|s| s["instance_id"] == observer)
        .unwrap_or_else(|| panic!("the tool's session is listed: {sessions:?}"));
    assert_eq!(mine["transport"], "tcp");
}

/// One HTTP exchange; the status and the body.
fn http(addr: SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a complete answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    (status, head.to_owned(), body.to_owned())
}

/// A parsed exposition: families by name with their type, samples by
/// `name{sorted labels}`.
struct Exposition {
    types: HashMap<String, String>,
    samples: BTreeMap<String, f64>,
    /// Histogram buckets: (family, labels without le) → [(le, count)].
    buckets: BTreeMap<(String, String), Vec<(f64, f64)>>,
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// Parses `{k="v",...}` at the start of `s`; the labels and the rest.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    let mut rest = s.strip_prefix('{').ok_or("no {")?;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let name = &rest[..eq];
        if !valid_name(name) || name.starts_with("__") {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..].strip_prefix('"').ok_or("unquoted value")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((name.to_owned(), value));
        rest = &rest[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Parses and checks the text format: HELP and TYPE once per family and
/// before its samples, samples of a family contiguous, every line well
/// formed, counters named `_total`, histograms with `_bucket` (with `le`),
/// `_sum`, `_count`.
fn parse_exposition(text: &str) -> Result<Exposition, String> {
    let mut e = Exposition {
        types: HashMap::new(),
        samples: BTreeMap::new(),
        buckets: BTreeMap::new(),
    };
    let mut helped = HashSet::new();
    let mut closed = HashSet::new();
    let mut current: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        let err = |m: String| format!("line {}: {m}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest
                .split_once(' ')
                .ok_or_else(|| err("no help text".into()))?;
            if !valid_name(name) || !helped.insert(name.to_owned()) {
                return Err(err("bad or repeated HELP".into()));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| err("no type".into()))?;
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(err(format!("unknown type {kind}")));
            }
            if e.types.insert(name.to_owned(), kind.to_owned()).is_some() {
                return Err(err("repeated TYPE".into()));
            }
            if kind == "counter" && !name.ends_with("_total") {
                return Err(err("a counter not named _total".into()));
            }
            if let Some(prev) = current.replace(name.to_owned()) {
                closed.insert(prev);
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            return Err(err("unexpected comment or empty line".into()));
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| err("no value".into()))?;
        let name = &line[..name_end];
        if !valid_name(name) {
            return Err(err("bad metric name".into()));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(err)?
        } else {
            (Vec::new(), &line[name_end..])
        };
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("no space before the value".into()))?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().map_err(|_| err(format!("bad value {v:?}")))?,
        };
        let family = current
            .clone()
            .ok_or_else(|| err("sample before any TYPE".into()))?;
        let kind = &e.types[&family];
        let suffix = name.strip_prefix(family.as_str());
        let belongs = match kind.as_str() {
            "histogram" => matches!(suffix, Some("_bucket" | "_sum" | "_count")),
            _ => suffix == Some(""),
        };
        if !belongs || closed.contains(name) {
            return Err(err(format!("sample outside its family {family}")));
        }
        if !helped.contains(&family) {
            return Err(err("family without HELP".into()));
        }
        let mut sorted = labels.clone();
        sorted.sort();
        let key = format!("{name}{sorted:?}");
        if e.samples.insert(key, value).is_some() {
            return Err(err("repeated sample".into()));
        }
        if suffix == Some("_bucket") {
            let le = labels
                .iter()
                .find(|(k, _)| k == "le")
                .ok_or_else(|| err("bucket without le".into()))?;
            let le = match le.1.as_str() {
                "+Inf" => f64::INFINITY,
                v => v.parse().map_err(|_| err("bad le".into()))?,
            };
            let mut rest: Vec<_> = sorted.into_iter().filter(|(k, _)| k != "le").collect();
            rest.sort();
            e.buckets
                .entry((family.clone(), format!("{rest:?}")))
                .or_default()
                .push((le, value));
        }
    }
    Ok(e)
}

impl Exposition {
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut sorted: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        sorted.sort();
        let key = format!("{name}{sorted:?}");
        *self
            .samples
            .get(&key)
            .unwrap_or_else(|| panic!("no sample {key}"))
    }
}

#[test]
fn metrics_are_valid_exposition_and_count_the_operations_done() {
    let server = start();
    let addr = server.metrics_addr().expect("metrics are configured");
    let client = engine(&server);
    let done = workload(&client);

    let (status, head, body) = http(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    assert_eq!(status, 200, "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let m = parse_exposition(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));

    assert_eq!(m.types["cxlkv_requests_total"], "counter");
    assert_eq!(m.types["cxlkv_request_duration_seconds"], "histogram");
    assert_eq!(m.types["cxlkv_pool_size_bytes"], "gauge");
    assert_eq!(m.get("cxlkv_keys", &[]), done.keys_left as f64);
    assert_eq!(m.get("cxlkv_pins", &[]), 0.0);
    assert_eq!(m.get("cxlkv_sessions", &[]), 1.0, "only the engine");
    assert_eq!(
        m.get("cxlkv_register_outcomes_total", &[("outcome", "inserted")]),
        done.inserted as f64
    );
    assert_eq!(
        m.get("cxlkv_register_outcomes_total", &[("outcome", "duplicate")]),
        done.duplicate as f64
    );
    assert_eq!(
        m.get("cxlkv_lookups_total", &[("result", "hit")]),
        done.lookup_hits as f64
    );
    assert_eq!(
        m.get("cxlkv_lookups_total", &[("result", "miss")]),
        done.lookup_misses as f64
    );
    assert_eq!(
        m.get("cxlkv_exists_total", &[("result", "hit")]),
        done.exists_hits as f64
    );
    assert_eq!(
        m.get("cxlkv_deletes_total", &[("outcome", "deleted")]),
        done.deleted as f64
    );
    assert_eq!(
        m.get("cxlkv_deletes_total", &[("outcome", "missing")]),
        done.delete_missing as f64
    );
    assert_eq!(
        m.get("cxlkv_unpins_total", &[("outcome", "unpinned")]),
        done.lookup_hits as f64
    );
    assert_eq!(
        m.get("cxlkv_requests_total", &[("op", "register")]),
        done.register_requests as f64
    );
    assert_eq!(
        m.get("cxlkv_request_items_total", &[("op", "lookup")]),
        12.0
    );
    assert_eq!(
        m.get("cxlkv_request_errors_total", &[("op", "lookup")]),
        0.0
    );
    assert_eq!(
        m.get("cxlkv_instance_keys", &[("instance_id", ENGINE)]),
        done.keys_left as f64
    );
    assert_eq!(
        m.get("cxlkv_instance_used_bytes", &[("instance_id", ENGINE)]),
        (done.keys_left * PAGE) as f64
    );
    assert_eq!(m.get("cxlkv_pool_regions", &[("pool", "0")]), 1.0);
    let path = server.pool_paths()[0].to_str().unwrap();
    assert_eq!(
        m.get("cxlkv_pool_info", &[("pool", "0"), ("path", path)]),
        1.0
    );
    assert!(m.get("cxlkv_pool_size_bytes", &[("pool", "0")]) > 0.0);

    // Histograms: cumulative buckets ending in +Inf = _count, one
    // observation per request.
    for (op, requests) in [
        ("register", done.register_requests),
        ("lookup", 1),
        ("exists", 1),
        ("delete", 1),
        ("hello", 1),
    ] {
        let buckets = &m.buckets[&(
            "cxlkv_request_duration_seconds".to_owned(),
            format!("{:?}", vec![("op".to_owned(), op.to_owned())]),
        )];
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1)
        );
        let (le, total) = *buckets.last().unwrap();
        assert_eq!(le, f64::INFINITY);
        assert_eq!(total, requests as f64, "{op}");
        assert_eq!(
            m.get("cxlkv_request_duration_seconds_count", &[("op", op)]),
            requests as f64
        );
        assert!(m.get("cxlkv_request_duration_seconds_sum", &[("op", op)]) > 0.0);
    }

    // Every metric the Grafana dashboard queries is served.
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/grafana-dashboard.json"
    ))
    .unwrap();
    let dashboard: Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut queried = 0;
    let mut charted = HashSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            for (at, _) in expr.match_indices("cxlkv_") {
                let name: String = expr[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .filter(|f| m.types.get(*f).is_some_and(|t| t == "histogram"))
                    .unwrap_or(&name);
                assert!(
                    m.types.contains_key(family),
                    "the dashboard queries {name}, which is not served"
                );
                charted.insert(family.to_owned());
                queried += 1;
            }
        }
    }
    assert!(queried > 20, "{queried} metric references in the dashboard");
    // ... and every family served is charted, or left out of the dashboard
    // on purpose: a new metric gets a panel or a place on this list.
    const NOT_CHARTED: &[&str] = &[
        "cxlkv_directory_info",
        "cxlkv_uptime_seconds",
        "cxlkv_used_bytes",
        "cxlkv_value_bytes",
        "cxlkv_key_bytes",
        "cxlkv_owned_bytes",
        "cxlkv_layouts",
        "cxlkv_pin_ledger_bytes",
        "cxlkv_long_pin_threshold_seconds",
        "cxlkv_evictions_lru_skipped_total",
        "cxlkv_instances_gone_total",
        "cxlkv_notices_issued_total",
        "cxlkv_pins_taken_total",
        "cxlkv_register_stale_generation_total",
        "cxlkv_unpins_total",
        "cxlkv_pool_regions",
        "cxlkv_pool_orphaned_regions",
        "cxlkv_pool_keys",
    ];
    let mut uncharted: Vec<&String> = m
        .types
        .keys()
        .filter(|f| !charted.contains(*f) && !NOT_CHARTED.contains(&f.as_str()))
        .collect();
    uncharted.sort();
    assert!(
        uncharted.is_empty(),
        "served but neither in docs/grafana-dashboard.json nor in NOT_CHARTED: {uncharted:?}"
    );

    // The metrics table of docs/operations.md lists exactly the families
    // served, each with its type.
    let operations =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
            .unwrap();
    let table = operations
        .split("| metric | type | labels | meaning |")
        .nth(1)
        .expect("docs/operations.md has the metrics table");
    let mut documented = HashMap::new();
    for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (names, kind) = (cells[1], cells[2]);
        for name in names.split('`').filter(|n| n.starts_with("cxlkv_")) {
            documented.insert(name.to_owned(), kind.to_owned());
        }
    }
    for (family, kind) in &m.types {
        assert_eq!(
            documented.get(family),
            Some(kind),
            "{family} ({kind}) in docs/operations.md's metrics table"
        );
    }
    for family in documented.keys() {
        assert!(
            m.types.contains_key(family),
            "docs/operations.md documents {family}, which is not served"
        );
    }

    // A scrape is a statistics snapshot: the directory counts it as one
    // `stats` call, and nothing else changes — once the last snapshot is
    // older than the interval; a scrape sooner gets the last text again.
    let (_, _, cached) = http(addr, b"GET /metrics HTTP/1.0\r\n\r\n");
    assert_eq!(
        parse_exposition(&cached)
            .unwrap()
            .get("cxlkv_requests_total", &[("op", "stats")]),
        m.get("cxlkv_requests_total", &[("op", "stats")]),
        "a scrape within the interval takes no snapshot"
    );
    std::thread::sleep(cxlkv::server::METRICS_MIN_INTERVAL);
    let (_, _, again) = http(addr, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n");
    let again = parse_exposition(&again).unwrap();
    assert_eq!(
        again.get("cxlkv_requests_total", &[("op", "stats")]),
        m.get("cxlkv_requests_total", &[("op", "stats")]) + 1.0
    );
    for op in ["hello", "register", "lookup", "exists", "delete", "unpin"] {
        assert_eq!(
            again.get("cxlkv_requests_total", &[("op", op)]),
            m.get("cxlkv_requests_total", &[("op", op)]),
            "{op}"
        );
    }
    drop(client);
}

#[test]
fn the_metrics_endpoint_refuses_what_is_not_a_scrape() {
    let server = start();
    let addr = server.metrics_addr().unwrap();
    assert_eq!(http(addr, b"GET /other HTTP/1.1\r\n\r\n").0, 404);
    assert_eq!(http(addr, b"POST /metrics HTTP/1.1\r\n\r\n").0, 405);
    assert_eq!(http(addr, b"nonsense\r\n\r\n").0, 400);
    let (status, head, body) = http(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(status, 200);
    assert!(body.is_empty(), "HEAD has no body");
    assert!(!head.contains("Content-Length: 0\r\n"), "{head}");
    // A head as long as the limit, not finished (exactly the limit: the
    // server reads all of it, so its close is not a reset).
    let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
    huge.resize(8 << 10, b'a');
    assert_eq!(http(addr, &huge).0, 431);
    // A request never finished is cut off at the deadline.
    assert_eq!(http(addr, b"GET /metrics HTTP/1.1\r\n").0, 408);
    // The endpoint still serves after all that.
    assert_eq!(http(addr, b"GET /metrics HTTP/1.1\r\n\r\n").0, 200);
}

/// Kills the child if the test fails before it stopped it, and removes its
/// files.
struct ServeGuard {
    child: Option<Child>,
    paths: Vec<std::path::PathBuf>,
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for p in &self.paths {
            let _ = std::fs::remove_dir_all(p);
            let _ = std::fs::remove_file(p);
        }
    }
}

#[test]
fn serve_with_a_metrics_address_announces_and_serves_it() {
    let unique = format!("ops-serve-{}", std::process::id());
    let socket = std::env::temp_dir().join(format!("cxlkv-{unique}.sock"));
    let pool = std::path::PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    let state = std::path::PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
    let child = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["serve", "--metrics-addr", "127.0.0.1:0"])
        .env("CXLKV_SERVER_SOCKET", &socket)
        .env(
            "CXLKV_POOL_POOLS",
            format!(
                "[{{path = \"{}\", size_bytes = \"96MiB\"}}]",
                pool.display()
            ),
        )
        .env("CXLKV_LOG", "warn")
        .env_remove("CXLKV_CONFIG")
        .stdout(Stdio::piped())
        .spawn()
        .expect("cxlkv serve starts");
    let mut guard = ServeGuard {
        child: Some(child),
        paths: vec![socket.clone(), pool, state],
    };
    let stdout = guard.child.as_mut().unwrap().stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a line on stdout")
        .unwrap();
    let prefix = format!("listening unix:{} metrics:http://", socket.display());
    let addr: SocketAddr = line
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{line:?} does not announce the metrics endpoint"))
        .parse()
        .unwrap();

    let out = cxlkv(&["stats", "--json", "--socket", socket.to_str().unwrap()]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["totals"]["sessions"], 1, "the tool's own");
    assert_eq!(r["ops"]["hello"]["requests"], 1);

    // The tool has exited; the server may not have seen its connection
    // close yet when the first scrape arrives.
    let closed = |m: &Exposition| m.get("cxlkv_sessions_ended_total", &[("reason", "closed")]);
    let mut m = None;
    assert!(
        wait_until(Duration::from_secs(30), || {
            let (status, _, body) = http(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
            assert_eq!(status, 200);
            let scraped = parse_exposition(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
            let done = closed(&scraped) == 1.0;
            m = Some(scraped);
            done
        }),
        "the tool's session is counted as closed"
    );
    let m = m.unwrap();
    assert_eq!(m.get("cxlkv_requests_total", &[("op", "hello")]), 1.0);
    assert_eq!(m.get("cxlkv_sessions", &[]), 0.0);

    let pid = guard.child.as_ref().unwrap().id() as libc::pid_t;
    // SAFETY: `pid` is our child, not yet reaped (the guard owns it).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = guard.child.as_mut().unwrap().try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    guard.child = None;
    assert!(status.success(), "exit status {status}");
    assert!(
        TcpStream::connect(addr).is_err(),
        "the metrics endpoint stops with the server"
    );
}

/// `cxlkv top` is a terminal view: with standard output a pipe it refuses,
/// pointing at `cxlkv stats`, before it connects (it used to open a
/// session, then fail with "cannot set up the terminal: No such device or
/// address", or draw escape codes into the pipe when a terminal was at
/// hand).
#[test]
fn top_refuses_to_draw_into_a_pipe_and_names_stats() {
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["top", "--socket", "/nonexistent/cxlkv.sock"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("cxlkv top runs");
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "nothing drawn");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs a terminal") && err.contains("cxlkv stats"),
        "{err}"
    );
    assert!(
        !err.contains("cannot connect"),
        "checked before connecting: {err}"
    );
}
