//! `cxlkv stats`: one `Stats` request to a running server, printed as a
//! human report or, with `--json`, as one JSON object on one line (a JSON
//! Lines record, as `cxlkv demo --json` and `cxlkv chaos --json` print).
//!
//! The tool is an ordinary client ([`Client::connect`] with no layout: it
//! takes no region and registers nothing): it opens a session under the
//! instance id `cxlkv-stats-<pid>`, asks for every table
//! ([`Client::directory_stats`]), and closes. Its own instance therefore
//! appears in what it prints (`observer_instance` names it), and stays in
//! the directory as absent for the server's grace period.
//!
//! [`Report`] is the JSON shape (field names are stable; documented in
//! `docs/operations.md`): the wire `StatsReply` with operations keyed by
//! name, pools with their paths and fill, and the instance that asked.
//! `cxlkv top` polls the same report. [`render_text`] is the human form, a
//! pure function of a report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use cxlkv_controlplane::proto::{self, StatsReply};
use serde::Serialize;

use crate::client::{Client, ClientConfig};
use crate::config;

/// How the tools find the server: `serve`'s own configuration (`--config`,
/// `$CXLKV_CONFIG`, `CXLKV_SERVER_SOCKET`) unless told otherwise.
#[derive(Debug, Args)]
pub struct ConnectArgs {
    /// Configuration file whose `[server] socket` to use (default:
    /// `$CXLKV_CONFIG`, else none).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The server's Unix socket (default: `[server] socket`, else the
    /// socket `cxlkv serve` listens on by default).
    #[arg(long, conflicts_with = "tcp")]
    pub socket: Option<PathBuf>,
    /// Connect over TCP instead, `host:port`: an IP address, or a host name
    /// resolved when connecting to its first address, as `serve --tcp`
    /// (the pools must be reachable at the paths the server announces).
    #[arg(long, value_name = "HOST:PORT")]
    pub tcp: Option<String>,
    /// File with the TCP listener's secret (mode 0600 or stricter).
    #[arg(long, requires = "tcp")]
    pub tcp_secret_file: Option<PathBuf>,
}

impl ConnectArgs {
    /// A client configuration for the tool `tool` (part of its instance id).
    pub fn client_config(&self, tool: &str) -> anyhow::Result<ClientConfig> {
        let mut cfg = match (&self.tcp, &self.socket) {
            (Some(addr), _) => ClientConfig::tcp(
                config::host_port(addr).map_err(|e| anyhow::anyhow!("--tcp: {e}"))?,
            ),
            (None, Some(path)) => ClientConfig::unix(path.clone()),
            (None, None) => {
                let file = config::load_from_process(self.config.as_deref(), &[])?;
                ClientConfig::unix(
                    file.server
                        .socket
                        .unwrap_or_else(crate::server::default_socket_path),
                )
            }
        };
        if let Some(path) = &self.tcp_secret_file {
            let secret =
                config::read_secret(path).map_err(|e| anyhow::anyhow!("--tcp-secret-file: {e}"))?;
            cfg.client_secret = Some(secret);
        }
        cfg.instance_id = format!("cxlkv-{tool}-{}", std::process::id());
        cfg.client_name = format!("cxlkv {tool}");
        Ok(cfg)
    }

    /// Connects, naming the endpoint on failure.
    pub fn connect(&self, tool: &str) -> anyhow::Result<Client> {
        let cfg = self.client_config(tool)?;
        // The client's message names the endpoint; its causes are added
        // where it does not state them (a pool that cannot be opened), and
        // not again where it does (a refused connection).
        Client::connect(cfg).map_err(|e| anyhow::anyhow!("{}", e.with_causes()))
    }
}

/// Flags of `cxlkv stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Print one JSON object (every row the server returned) on one line
    /// and nothing else.
    #[arg(long)]
    pub json: bool,
    /// Rows printed per table in the human report.
    #[arg(long, default_value_t = 20)]
    pub rows: usize,
}

/// Runs `cxlkv stats`.
pub fn run(args: &StatsArgs) -> anyhow::Result<()> {
    let client = args.connect.connect("stats")?;
    let report = fetch(&client);
    let closed = client.close();
    let report = report?;
    if let Err(e) = closed {
        tracing::debug!(error = %e, "closing the stats session");
    }
    if args.json {
        // Compact: one line per snapshot, for line-oriented consumers
        // (`jq -c`, log shippers); `jq .` pretty-prints it.
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render_text(&report, args.rows));
    }
    Ok(())
}

/// One `Stats` round trip with every table, as a [`Report`].
pub fn fetch(client: &Client) -> anyhow::Result<Report> {
    let reply = client
        .directory_stats(proto::sections::ALL)
        .context("the Stats request failed")?;
    let paths = client
        .pools()
        .into_iter()
        .map(|p| (p.pool, p.path))
        .collect::<Vec<_>>();
    Ok(Report::new(&reply, &paths, client.instance_id()))
}

/// Mirrors a wire struct of `u64` counters as a serialisable one.
macro_rules! mirror {
    ($(#[$doc:meta])* $name:ident from $wire:path { $($field:ident),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
        pub struct $name {
            $(pub $field: u64,)*
        }

        impl From<&$wire> for $name {
            fn from(w: &$wire) -> Self {
                Self { $($field: w.$field,)* }
            }
        }
    };
}

mirror!(
    /// Directory-wide gauges and counters (`StatsReply.totals`).
    Totals from proto::DirectoryTotals {
        keys, used_bytes, value_bytes, key_bytes, owned_bytes, regions, deferred_regions,
        pending_region_requests, pins, pinned_keys, instances_live, instances_absent, sessions,
        notices_pending, layouts, long_held_pins, evictions_orphan, evictions_lru,
        evictions_lru_skipped, sessions_expired, sessions_closed, sessions_ended, instances_gone,
        regions_granted, regions_returned, regions_freed, regions_deferred, notices_issued,
        pinned_entries, max_pinned_entries, pin_ledger_bytes,
    }
);

mirror!(
    /// What the key operations answered (`StatsReply.outcomes`, counters).
    Outcomes from proto::OutcomeTotals {
        inserted, duplicate, rejected, stale_generation, lookup_hits, lookup_misses,
        exists_hits, exists_misses, pins_taken, unpinned, not_pinned, deleted, delete_pinned,
        delete_missing, retries_answered, sequence_too_old, replies_evicted,
    }
);

mirror!(
    /// Latency since start, nanoseconds (upper bucket edges).
    Latency from proto::LatencySummary { count, p50_ns, p99_ns, max_ns }
);

/// One operation's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OpRow {
    pub requests: u64,
    pub items: u64,
    pub errors: u64,
    pub latency: Latency,
}

/// One pool: the pool manager's fill and this directory's use of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolRow {
    pub pool: u32,
    /// Path on the server's host (empty if the client was not told).
    pub path: String,
    pub size_bytes: u64,
    pub free_bytes: u64,
    /// `(size - free) / size`, 0 when the size is not known yet.
    pub fill: f64,
    pub regions: u64,
    pub region_bytes: u64,
    pub orphaned_regions: u64,
    pub keys: u64,
    pub used_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InstanceRow {
    pub instance_id: String,
    pub sessions: u32,
    pub awaiting_reattach: bool,
    pub regions: u32,
    pub owned_bytes: u64,
    pub pending_region_bytes: u64,
    pub used_bytes: u64,
    pub quota_bytes: u64,
    pub keys: u64,
    pub pins: u64,
    pub notices_pending: u32,
    pub cached_replies: u32,
    pub cached_reply_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SessionRow {
    pub session_id: u64,
    pub instance_id: String,
    /// `unix`, `tcp` or `in_process`.
    pub transport: &'static str,
    pub pid: u32,
    pub uid: u32,
    pub age_ms: u64,
    pub idle_ms: u64,
    pub requests: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionRow {
    pub region: u64,
    pub pool: u32,
    pub page_size_bytes: u64,
    pub layout_fingerprint: u64,
    pub len_bytes: u64,
    pub owner_instance: String,
    pub owner_present: bool,
    pub keys: u64,
    pub used_bytes: u64,
    pub deferred: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LongPinRow {
    pub session_id: u64,
    pub instance_id: String,
    pub pins: u32,
    pub held_ms: u64,
}

/// What `cxlkv stats --json` prints (see the module essay).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub directory_id: String,
    pub directory_epoch: u64,
    pub uptime_ms: u64,
    /// The instance id this tool's own session used.
    pub observer_instance: String,
    pub totals: Totals,
    pub outcomes: Outcomes,
    /// By operation name (`hello`, `lookup`, `request_region`, …).
    pub ops: BTreeMap<&'static str, OpRow>,
    pub pools: Vec<PoolRow>,
    pub instances: Vec<InstanceRow>,
    pub sessions: Vec<SessionRow>,
    pub regions: Vec<RegionRow>,
    pub long_pins: Vec<LongPinRow>,
    pub long_pin_threshold_ms: u64,
    /// A table had more rows than the server sends (`MAX_STATS_ROWS`).
    pub truncated: bool,
}

impl Report {
    /// `paths`: `(pool index, path)` as the server announced them.
    pub fn new(r: &StatsReply, paths: &[(u32, String)], observer: &str) -> Self {
        let ops = r
            .ops
            .iter()
            .filter_map(|op| {
                let name = crate::server::metrics::op_name(op.kind)?;
                Some((
                    name,
                    OpRow {
                        requests: op.requests,
                        items: op.items,
                        errors: op.errors,
                        latency: Latency::from(&op.latency),
                    },
                ))
            })
            .collect();
        let pools = r
            .pools
            .iter()
            .map(|p| PoolRow {
                pool: p.pool,
                path: paths
                    .iter()
                    .find(|(i, _)| *i == p.pool)
                    .map(|(_, path)| path.clone())
                    .unwrap_or_default(),
                size_bytes: p.size_bytes,
                free_bytes: p.free_bytes,
                fill: fill(p.size_bytes, p.free_bytes),
                regions: p.regions,
                region_bytes: p.region_bytes,
                orphaned_regions: p.orphaned_regions,
                keys: p.keys,
                used_bytes: p.used_bytes,
            })
            .collect();
        let instances = r
            .instances
            .iter()
            .map(|i| InstanceRow {
                instance_id: i.instance_id.clone(),
                sessions: i.sessions,
                awaiting_reattach: i.awaiting_reattach,
                regions: i.regions,
                owned_bytes: i.owned_bytes,
                pending_region_bytes: i.pending_region_bytes,
                used_bytes: i.used_bytes,
                quota_bytes: i.quota_bytes,
                keys: i.keys,
                pins: i.pins,
                notices_pending: i.notices_pending,
                cached_replies: i.cached_replies,
                cached_reply_bytes: i.cached_reply_bytes,
            })
            .collect();
        let sessions = r
            .sessions
            .iter()
            .map(|s| SessionRow {
                session_id: s.session_id,
                instance_id: s.instance_id.clone(),
                transport: match s.transport {
                    proto::Transport::Unix => "unix",
                    proto::Transport::Tcp => "tcp",
                    proto::Transport::InProcess => "in_process",
                },
                pid: s.pid,
                uid: s.uid,
                age_ms: s.age_ms,
                idle_ms: s.idle_ms,
                requests: s.requests,
            })
            .collect();
        let regions = r
            .regions
            .iter()
            .map(|g| RegionRow {
                region: g.region,
                pool: g.pool,
                page_size_bytes: g.layout.page_size_bytes,
                layout_fingerprint: g.layout.fingerprint,
                len_bytes: g.len_bytes,
                owner_instance: g.owner_instance.clone(),
                owner_present: g.owner_present,
                keys: g.keys,
                used_bytes: g.used_bytes,
                deferred: g.deferred,
            })
            .collect();
        let long_pins = r
            .long_pins
            .iter()
            .map(|p| LongPinRow {
                session_id: p.session_id,
                instance_id: p.instance_id.clone(),
                pins: p.pins,
                held_ms: p.held_ms,
            })
            .collect();
        Self {
            directory_id: r.directory_id.clone(),
            directory_epoch: r.directory_epoch,
            uptime_ms: r.uptime_ms,
            observer_instance: observer.to_owned(),
            totals: Totals::from(&r.totals),
            outcomes: Outcomes::from(&r.outcomes),
            ops,
            pools,
            instances,
            sessions,
            regions,
            long_pins,
            long_pin_threshold_ms: r.long_pin_threshold_ms,
            truncated: r.truncated,
        }
    }
}

/// Allocated fraction of a pool, 0 when its size is unknown.
pub fn fill(size_bytes: u64, free_bytes: u64) -> f64 {
    if size_bytes == 0 {
        return 0.0;
    }
    (size_bytes.saturating_sub(free_bytes) as f64 / size_bytes as f64).clamp(0.0, 1.0)
}

/// `part` of `whole` as `12.5%`; `-` when `whole` is 0 (not reported).
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".to_owned();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

/// `1.5 GiB`, `512 B`: binary units, one decimal.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// `850ns`, `12.5µs`, `3.2ms`, `1.0s`.
/// A latency percentile of `count` samples: `-` when there are none (a row
/// of requests the server times under another name, or not at all).
pub fn human_latency(count: u64, ns: u64) -> String {
    if count == 0 {
        "-".to_owned()
    } else {
        human_ns(ns)
    }
}

pub fn human_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns}ns"),
        1_000..1_000_000 => format!("{:.1}µs", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}ms", ns as f64 / 1e6),
        _ => format!("{:.1}s", ns as f64 / 1e9),
    }
}

/// A plain-text table: columns padded to their widest cell, numbers right
/// aligned (every column but the first).
fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            let pad = w.saturating_sub(cell.chars().count());
            if i == 0 {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            } else {
                text.push_str("  ");
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
            }
        }
        let _ = writeln!(out, "  {}", text.trim_end());
    };
    line(out, &mut header.iter().copied());
    for row in rows {
        line(out, &mut row.iter().map(String::as_str));
    }
}

/// Appends `… N more` when a table was cut at `max_rows`.
fn more(out: &mut String, total: usize, shown: usize) {
    if total > shown {
        let _ = writeln!(out, "  … {} more", total - shown);
    }
}

/// The human report (see the module essay); at most `max_rows` rows per
/// table.
pub fn render_text(r: &Report, max_rows: usize) -> String {
    let t = &r.totals;
    let o = &r.outcomes;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "directory {} (epoch {:#x}), up {}s; observed by {}",
        r.directory_id,
        r.directory_epoch,
        r.uptime_ms / 1000,
        r.observer_instance
    );
    let _ = writeln!(out, "\npools");
    let rows: Vec<Vec<String>> = r
        .pools
        .iter()
        .map(|p| {
            vec![
                format!("{} {}", p.pool, p.path),
                human_bytes(p.size_bytes),
                human_bytes(p.size_bytes.saturating_sub(p.free_bytes)),
                format!("{:.1}%", p.fill * 100.0),
                p.regions.to_string(),
                human_bytes(p.region_bytes),
                p.keys.to_string(),
                human_bytes(p.used_bytes),
            ]
        })
        .collect();
    table(
        &mut out,
        &[
            "pool",
            "size",
            "allocated",
            "fill",
            "regions",
            "held",
            "keys",
            "used",
        ],
        &rows,
    );
    let _ = writeln!(out, "\ndirectory");
    let _ = writeln!(
        out,
        "  keys {}  used {}  values {}  key bytes {}  layouts {}",
        t.keys,
        human_bytes(t.used_bytes),
        human_bytes(t.value_bytes),
        human_bytes(t.key_bytes),
        t.layouts
    );
    let _ = writeln!(
        out,
        "  regions {} ({}), deferred {}, pending requests {}",
        t.regions,
        human_bytes(t.owned_bytes),
        t.deferred_regions,
        t.pending_region_requests
    );
    let _ = writeln!(
        out,
        "  instances {} live, {} absent; sessions {}",
        t.instances_live, t.instances_absent, t.sessions
    );
    let _ = writeln!(
        out,
        "  pins {} on {} keys; long-held (> {} ms) {}",
        t.pins, t.pinned_keys, r.long_pin_threshold_ms, t.long_held_pins
    );
    let _ = writeln!(
        out,
        "  pinned (session, key) pairs {} of {} ({}); pin ledgers {}",
        t.pinned_entries,
        t.max_pinned_entries,
        percent(t.pinned_entries, t.max_pinned_entries),
        human_bytes(t.pin_ledger_bytes)
    );
    let _ = writeln!(
        out,
        "  notices pending {}, issued {}",
        t.notices_pending, t.notices_issued
    );
    let _ = writeln!(
        out,
        "  evictions: orphan {}, lru {} (skipped {})",
        t.evictions_orphan, t.evictions_lru, t.evictions_lru_skipped
    );
    let _ = writeln!(
        out,
        "  deletes: deleted {}, pinned {}, missing {}",
        o.deleted, o.delete_pinned, o.delete_missing
    );
    let _ = writeln!(
        out,
        "  register: inserted {}, duplicate {}, rejected {} (stale generation {})",
        o.inserted, o.duplicate, o.rejected, o.stale_generation
    );
    let _ = writeln!(
        out,
        "  lookup: {} hits, {} misses, {} pins taken; exists: {} hits, {} misses",
        o.lookup_hits, o.lookup_misses, o.pins_taken, o.exists_hits, o.exists_misses
    );
    let _ = writeln!(
        out,
        "  unpins {} (not pinned {}); retries answered {}, too old {}, replies evicted {}",
        o.unpinned, o.not_pinned, o.retries_answered, o.sequence_too_old, o.replies_evicted
    );
    let _ = writeln!(
        out,
        "  sessions ended: expired {}, closed {}, admin {}; instances gone {}",
        t.sessions_expired, t.sessions_closed, t.sessions_ended, t.instances_gone
    );
    let _ = writeln!(
        out,
        "  regions: granted {}, returned {}, freed {}, deferred {}",
        t.regions_granted, t.regions_returned, t.regions_freed, t.regions_deferred
    );

    let _ = writeln!(out, "\noperations (latency since start)");
    let rows: Vec<Vec<String>> = r
        .ops
        .iter()
        .filter(|(_, op)| op.requests > 0 || op.latency.count > 0)
        .map(|(name, op)| {
            vec![
                (*name).to_owned(),
                op.requests.to_string(),
                op.items.to_string(),
                op.errors.to_string(),
                human_latency(op.latency.count, op.latency.p50_ns),
                human_latency(op.latency.count, op.latency.p99_ns),
                human_latency(op.latency.count, op.latency.max_ns),
            ]
        })
        .collect();
    table(
        &mut out,
        &["op", "requests", "items", "errors", "p50", "p99", "max"],
        &rows,
    );

    let _ = writeln!(out, "\ninstances");
    let rows: Vec<Vec<String>> = r
        .instances
        .iter()
        .take(max_rows)
        .map(|i| {
            let mut name = i.instance_id.clone();
            if i.instance_id == r.observer_instance {
                name.push_str(" (this tool)");
            }
            vec![
                name,
                i.sessions.to_string(),
                i.keys.to_string(),
                human_bytes(i.used_bytes),
                human_bytes(i.owned_bytes),
                if i.quota_bytes == 0 {
                    "-".to_owned()
                } else {
                    human_bytes(i.quota_bytes)
                },
                i.pins.to_string(),
                i.notices_pending.to_string(),
            ]
        })
        .collect();
    table(
        &mut out,
        &[
            "instance", "sessions", "keys", "used", "owned", "quota", "pins", "notices",
        ],
        &rows,
    );
    more(&mut out, r.instances.len(), rows.len());

    let _ = writeln!(out, "\nsessions");
    let rows: Vec<Vec<String>> = r
        .sessions
        .iter()
        .take(max_rows)
        .map(|s| {
            vec![
                s.session_id.to_string(),
                s.instance_id.clone(),
                s.transport.to_owned(),
                s.pid.to_string(),
                s.uid.to_string(),
                format!("{}s", s.age_ms / 1000),
                format!("{}s", s.idle_ms / 1000),
                s.requests.to_string(),
            ]
        })
        .collect();
    table(
        &mut out,
        &[
            "session",
            "instance",
            "transport",
            "pid",
            "uid",
            "age",
            "idle",
            "requests",
        ],
        &rows,
    );
    more(&mut out, r.sessions.len(), rows.len());

    if !r.long_pins.is_empty() {
        let _ = writeln!(out, "\nlong-held pins (oldest first)");
        let rows: Vec<Vec<String>> = r
            .long_pins
            .iter()
            .take(max_rows)
            .map(|p| {
                vec![
                    p.session_id.to_string(),
                    p.instance_id.clone(),
                    p.pins.to_string(),
                    format!("{}s", p.held_ms / 1000),
                ]
            })
            .collect();
        table(&mut out, &["session", "instance", "pins", "held"], &rows);
        more(&mut out, r.long_pins.len(), rows.len());
    }
    let _ = writeln!(out, "\nregions");
    let rows: Vec<Vec<String>> = r
        .regions
        .iter()
        .take(max_rows)
        .map(|g| {
            let mut owner = g.owner_instance.clone();
            if !g.owner_present {
                owner.push_str(" (gone)");
            }
            vec![
                g.region.to_string(),
                g.pool.to_string(),
                human_bytes(g.page_size_bytes),
                human_bytes(g.len_bytes),
                owner,
                g.keys.to_string(),
                human_bytes(g.used_bytes),
                if g.deferred { "yes" } else { "no" }.to_owned(),
            ]
        })
        .collect();
    table(
        &mut out,
        &[
            "region", "pool", "page", "length", "owner", "keys", "used", "deferred",
        ],
        &rows,
    );
    more(&mut out, r.regions.len(), rows.len());
    if r.truncated {
        let _ = writeln!(out, "(tables truncated by the server)");
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A reply with one pool, two instances and a few operations.
    pub(crate) fn sample_reply(uptime_ms: u64, lookups: u64) -> StatsReply {
        let mut r = StatsReply {
            meta: proto::ReplyMeta::default(),
            directory_id: "dir-a".into(),
            directory_epoch: 3,
            uptime_ms,
            totals: proto::DirectoryTotals::default(),
            outcomes: proto::OutcomeTotals::default(),
            ops: Vec::new(),
            pools: Vec::new(),
            instances: Vec::new(),
            sessions: Vec::new(),
            regions: Vec::new(),
            long_pins: Vec::new(),
            long_pin_threshold_ms: 60_000,
            truncated: false,
        };
        r.pools = vec![proto::PoolRow {
            pool: 0,
            size_bytes: 1 << 30,
            free_bytes: 3 << 28,
            regions: 4,
            region_bytes: 256 << 20,
            orphaned_regions: 0,
            keys: 100,
            used_bytes: 100 << 20,
        }];
        r.ops = vec![proto::OpStats {
            kind: proto::Kind::Lookup.as_u16(),
            requests: lookups,
            items: lookups * 4,
            errors: 0,
            latency: proto::LatencySummary {
                count: lookups,
                p50_ns: 9_000,
                p99_ns: 40_000,
                max_ns: 90_000,
            },
        }];
        r.instances = ["engine-a", "cxlkv-stats-1"]
            .iter()
            .map(|id| proto::InstanceRow {
                instance_id: (*id).to_owned(),
                sessions: 1,
                awaiting_reattach: false,
                regions: 2,
                owned_bytes: 128 << 20,
                pending_region_bytes: 0,
                used_bytes: 50 << 20,
                quota_bytes: 0,
                keys: 50,
                pins: 3,
                notices_pending: 0,
                cached_replies: 0,
                cached_reply_bytes: 0,
            })
            .collect();
        r.regions = vec![proto::RegionRow {
            region: 42,
            pool: 0,
            layout: proto::Layout {
                page_size_bytes: 64 << 10,
                fingerprint: 1,
            },
            len_bytes: 64 << 20,
            owner_instance: "engine-b".into(),
            owner_present: false,
            keys: 9,
            used_bytes: 9 << 16,
            deferred: true,
        }];
        r.totals.pins = 6;
        r.totals.evictions_orphan = 7;
        r.totals.pinned_entries = 3;
        r.totals.max_pinned_entries = 1000;
        r.totals.pin_ledger_bytes = 16 << 10;
        r
    }

    #[test]
    fn the_report_names_operations_and_computes_pool_fill() {
        let r = Report::new(
            &sample_reply(5_000, 10),
            &[(0, "/dev/shm/p".into())],
            "cxlkv-stats-1",
        );
        assert_eq!(r.ops["lookup"].requests, 10);
        assert_eq!(r.ops["lookup"].latency.p99_ns, 40_000);
        assert_eq!(r.pools[0].path, "/dev/shm/p");
        assert!((r.pools[0].fill - 0.25).abs() < 1e-9, "{}", r.pools[0].fill);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["totals"]["evictions_orphan"], 7);
        assert_eq!(json["totals"]["pinned_entries"], 3);
        assert_eq!(json["totals"]["max_pinned_entries"], 1000);
        assert_eq!(json["totals"]["pin_ledger_bytes"], 16 << 10);
        assert_eq!(json["instances"][0]["instance_id"], "engine-a");
    }

    #[test]
    fn the_text_report_shows_every_section_and_marks_the_observer() {
        let r = Report::new(
            &sample_reply(5_000, 10),
            &[(0, "/dev/shm/p".into())],
            "cxlkv-stats-1",
        );
        let text = render_text(&r, 1);
        for needle in [
            "directory dir-a",
            "0 /dev/shm/p",
            "25.0%",
            "lookup",
            "40.0µs",
            "engine-a",
            "… 1 more",
            "evictions: orphan 7",
            "pins 6",
            "pinned (session, key) pairs 3 of 1000 (0.3%); pin ledgers 16.0 KiB",
            "engine-b (gone)",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
        let full = render_text(&r, 10);
        assert!(full.contains("cxlkv-stats-1 (this tool)"), "{full}");
    }

    #[test]
    fn sizes_and_durations_read_in_binary_units_and_si_time() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_ns(850), "850ns");
        assert_eq!(human_ns(12_500), "12.5µs");
        assert_eq!(human_ns(3_200_000), "3.2ms");
        assert_eq!(human_latency(3, 12_500), "12.5µs");
        assert_eq!(human_latency(0, 0), "-", "no request timed: no latency");
        assert_eq!(percent(7, 1000), "0.7%");
        assert_eq!(percent(0, 0), "-", "a limit not reported");
    }
}
