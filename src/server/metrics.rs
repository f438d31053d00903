//! Prometheus metrics: per-operation latency histograms with fixed buckets,
//! and the text exposition of a statistics snapshot.
//!
//! The directory keeps its own log-linear latency histograms, but reports
//! them only as quantiles (`Stats`), which cannot be aggregated across
//! scrapes or servers. The handler therefore also records every request's
//! time in the server into an [`OpLatencies`]: one [`LatencyHistogram`] per
//! operation, [`LATENCY_BUCKETS_NS`] fixed upper bounds plus `+Inf`, a count
//! and a sum — a few additions per request, no allocation.
//!
//! [`render`] turns a [`MetricsSnapshot`] (the same `StatsReply` that
//! `cxlkv stats` prints, the latency histograms, the pools' paths and the
//! count of region replies the server holds for the pool manager) into
//! the Prometheus text format, version 0.0.4: every family opens with its
//! `# HELP` and `# TYPE` lines and its samples follow contiguously; names
//! carry the `cxlkv_` prefix, counters end in `_total`, sizes in `_bytes`,
//! latencies are `_seconds` histograms (`_bucket{le=...}` cumulative and
//! ending with `+Inf`, `_sum`, `_count`). Label values are escaped (`\`,
//! `"`, newline); the per-instance families carry at most
//! `MAX_STATS_ROWS` instances. Rendering is pure: the HTTP endpoint
//! (`metrics_http.rs`) is its only driver.

use std::fmt::Write as _;
use std::time::Duration;

use cxlkv_controlplane::directory::OpKind;
use cxlkv_controlplane::proto::{self, Kind};

/// Upper bounds of the latency buckets, nanoseconds (1 µs … 1 s; `+Inf`
/// follows). The control plane answers in microseconds on shared memory;
/// the upper buckets catch stalls (a region request waiting for the pool
/// manager's journal sync).
pub const LATENCY_BUCKETS_NS: [u64; 18] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
];

/// One operation's latency distribution: counts per bucket (not
/// cumulative; the last one is `+Inf`), their sum and total.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    buckets: [u64; LATENCY_BUCKETS_NS.len() + 1],
    sum_ns: u64,
    count: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            buckets: [0; LATENCY_BUCKETS_NS.len() + 1],
            sum_ns: 0,
            count: 0,
        }
    }
}

impl LatencyHistogram {
    pub fn record(&mut self, ns: u64) {
        // Bounds are sorted: the first bound at or above `ns`, else `+Inf`.
        let i = LATENCY_BUCKETS_NS.partition_point(|&b| b < ns);
        self.buckets[i] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// `(upper bound in ns, None for +Inf; observations at or below it)`,
    /// as Prometheus' cumulative `_bucket` series.
    pub fn cumulative(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        let bounds = LATENCY_BUCKETS_NS.iter().copied().map(Some).chain([None]);
        bounds
            .zip(self.buckets.iter())
            .scan(0u64, |seen, (bound, &n)| {
                *seen += n;
                Some((bound, *seen))
            })
    }
}

/// A [`LatencyHistogram`] per directory operation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpLatencies {
    ops: [LatencyHistogram; OpKind::ALL.len()],
}

impl OpLatencies {
    pub fn record(&mut self, op: OpKind, elapsed: Duration) {
        let ns = elapsed.as_nanos().min(u128::from(u64::MAX)) as u64;
        if let Some(i) = OpKind::ALL.iter().position(|&o| o == op) {
            self.ops[i].record(ns);
        }
    }

    /// Every operation with its histogram, in [`OpKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (OpKind, &LatencyHistogram)> + '_ {
        OpKind::ALL.iter().copied().zip(self.ops.iter())
    }
}

/// The request kind an operation is counted under in `StatsReply.ops`.
pub(crate) fn kind_of(op: OpKind) -> Kind {
    match op {
        OpKind::Hello => Kind::Hello,
        OpKind::Reattach => Kind::Reattach,
        OpKind::Heartbeat => Kind::Heartbeat,
        OpKind::Register => Kind::Register,
        OpKind::Lookup => Kind::Lookup,
        OpKind::Exists => Kind::Exists,
        OpKind::Unpin => Kind::Unpin,
        OpKind::Delete => Kind::Delete,
        OpKind::RequestRegion => Kind::RequestRegion,
        OpKind::ReturnRegion => Kind::ReturnRegion,
        OpKind::Stats => Kind::Stats,
        OpKind::EndSession => Kind::EndSession,
    }
}

/// The operation name (`lookup`, `request_region`, …) of a
/// `StatsReply.ops[].kind` number; `None` for a number this build does not
/// count.
pub fn op_name(kind: u16) -> Option<&'static str> {
    OpKind::ALL
        .iter()
        .find(|&&op| kind_of(op).as_u16() == kind)
        .map(|op| op.name())
}

/// What one scrape reports.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// With the instances table (up to `MAX_STATS_ROWS` rows).
    pub stats: proto::StatsReply,
    pub latencies: OpLatencies,
    /// `(pool index, path on the server's host)`.
    pub pool_paths: Vec<(u32, String)>,
    /// `RequestRegion` replies the server holds for open connections until
    /// the pool manager answers (a request and each retry that joined it
    /// count one; those of closed connections are dropped).
    pub deferred_region_replies: u64,
}

/// Writes families to the exposition text. A family's samples must follow
/// its header without another family in between.
struct Exposition {
    out: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        // Writing to a String cannot fail.
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_label(v, &mut self.out);
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: u64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

fn escape_label(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Seconds with nanosecond precision and no trailing zeros (`0.0000025`,
/// `1`): the shortest form, so that a bucket's `le` label is the text a
/// query names it by (Prometheus 2 matches label values literally).
fn seconds(ns: u64) -> String {
    let whole = ns / 1_000_000_000;
    let frac = ns % 1_000_000_000;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:09}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// The Prometheus text exposition of `snap` (see the module essay).
pub fn render(snap: &MetricsSnapshot) -> String {
    let s = &snap.stats;
    let t = &s.totals;
    let o = &s.outcomes;
    let mut e = Exposition {
        out: String::with_capacity(32 << 10),
    };
    e.family(
        "cxlkv_directory_info",
        "gauge",
        "The directory's identity and incarnation (always 1).",
    );
    let epoch = s.directory_epoch.to_string();
    e.sample(
        "cxlkv_directory_info",
        &[("directory_id", &s.directory_id), ("epoch", &epoch)],
        1,
    );
    e.family(
        "cxlkv_uptime_seconds",
        "gauge",
        "Time since the directory started.",
    );
    e.sample(
        "cxlkv_uptime_seconds",
        &[],
        seconds(s.uptime_ms.saturating_mul(1_000_000)),
    );

    for (name, help, v) in [
        ("cxlkv_keys", "Registered keys.", t.keys),
        (
            "cxlkv_used_bytes",
            "Registered keys times their layout's page size.",
            t.used_bytes,
        ),
        (
            "cxlkv_value_bytes",
            "Sum of registered chunk lengths.",
            t.value_bytes,
        ),
        ("cxlkv_key_bytes", "Sum of key lengths.", t.key_bytes),
        (
            "cxlkv_owned_bytes",
            "Bytes of the regions the directory holds.",
            t.owned_bytes,
        ),
        ("cxlkv_regions", "Regions the directory holds.", t.regions),
        (
            "cxlkv_deferred_regions",
            "Regions whose owner is gone, kept alive by their keys.",
            t.deferred_regions,
        ),
        (
            "cxlkv_pending_region_requests",
            "Region requests waiting for the pool manager.",
            t.pending_region_requests,
        ),
        (
            "cxlkv_deferred_region_replies",
            "Region request replies the server holds for open connections until the pool manager answers.",
            snap.deferred_region_replies,
        ),
        ("cxlkv_pins", "Pins held by all sessions.", t.pins),
        (
            "cxlkv_pinned_keys",
            "Keys holding at least one pin.",
            t.pinned_keys,
        ),
        ("cxlkv_sessions", "Open sessions.", t.sessions),
        (
            "cxlkv_notices_pending",
            "Freed-page notices not yet acknowledged.",
            t.notices_pending,
        ),
        ("cxlkv_layouts", "Distinct layouts in use.", t.layouts),
        (
            "cxlkv_long_held_pins",
            "(session, key) pairs pinned longer than the long-pin threshold.",
            t.long_held_pins,
        ),
        (
            "cxlkv_pinned_entries",
            "(session, key) pairs with pins held, all sessions (bounded by cxlkv_max_pinned_entries).",
            t.pinned_entries,
        ),
        (
            "cxlkv_max_pinned_entries",
            "The directory's max_pinned_entries: a pinning lookup that could cross it is refused busy.",
            t.max_pinned_entries,
        ),
        (
            "cxlkv_pin_ledger_bytes",
            "Bytes the sessions' pin ledgers hold.",
            t.pin_ledger_bytes,
        ),
    ] {
        e.single(name, "gauge", help, v);
    }
    e.family(
        "cxlkv_long_pin_threshold_seconds",
        "gauge",
        "Pins held longer than this are long-held.",
    );
    e.sample(
        "cxlkv_long_pin_threshold_seconds",
        &[],
        seconds(s.long_pin_threshold_ms.saturating_mul(1_000_000)),
    );
    e.family(
        "cxlkv_instances",
        "gauge",
        "Instances with a session (live) and within their grace period (absent).",
    );
    e.sample("cxlkv_instances", &[("state", "live")], t.instances_live);
    e.sample(
        "cxlkv_instances",
        &[("state", "absent")],
        t.instances_absent,
    );

    e.family(
        "cxlkv_evictions_total",
        "counter",
        "Keys evicted by the directory: orphaned keys at the watermark, or the optional LRU.",
    );
    e.sample(
        "cxlkv_evictions_total",
        &[("reason", "orphan")],
        t.evictions_orphan,
    );
    e.sample(
        "cxlkv_evictions_total",
        &[("reason", "lru")],
        t.evictions_lru,
    );
    e.family(
        "cxlkv_sessions_ended_total",
        "counter",
        "Sessions ended, by cause.",
    );
    for (reason, v) in [
        ("expired", t.sessions_expired),
        ("closed", t.sessions_closed),
        ("admin", t.sessions_ended),
    ] {
        e.sample("cxlkv_sessions_ended_total", &[("reason", reason)], v);
    }
    e.family(
        "cxlkv_region_events_total",
        "counter",
        "Regions granted, returned by their owner, freed to the pool manager, and whose free waited for their last key.",
    );
    for (event, v) in [
        ("granted", t.regions_granted),
        ("returned", t.regions_returned),
        ("freed", t.regions_freed),
        ("deferred", t.regions_deferred),
    ] {
        e.sample("cxlkv_region_events_total", &[("event", event)], v);
    }
    for (name, help, v) in [
        (
            "cxlkv_evictions_lru_skipped_total",
            "LRU candidates passed over (their owner's notice queue was full).",
            t.evictions_lru_skipped,
        ),
        (
            "cxlkv_instances_gone_total",
            "Instances declared gone (grace expired, or taken over).",
            t.instances_gone,
        ),
        (
            "cxlkv_notices_issued_total",
            "Freed-page notices issued.",
            t.notices_issued,
        ),
        (
            "cxlkv_pins_taken_total",
            "Pins taken by lookups.",
            o.pins_taken,
        ),
        (
            "cxlkv_register_stale_generation_total",
            "Registrations rejected for a stale page generation (among the rejected).",
            o.stale_generation,
        ),
        (
            "cxlkv_retries_answered_total",
            "Retried requests answered from the reply cache.",
            o.retries_answered,
        ),
        (
            "cxlkv_sequence_too_old_total",
            "Retries older than the reply window.",
            o.sequence_too_old,
        ),
        (
            "cxlkv_replies_evicted_total",
            "Retries whose cached reply was dropped.",
            o.replies_evicted,
        ),
    ] {
        e.single(name, "counter", help, v);
    }
    for (name, help, label, values) in [
        (
            "cxlkv_register_outcomes_total",
            "Register entries by outcome.",
            "outcome",
            [
                ("inserted", o.inserted),
                ("duplicate", o.duplicate),
                ("rejected", o.rejected),
            ]
            .as_slice(),
        ),
        (
            "cxlkv_lookups_total",
            "Lookup keys by result.",
            "result",
            &[("hit", o.lookup_hits), ("miss", o.lookup_misses)],
        ),
        (
            "cxlkv_exists_total",
            "Exists keys by result.",
            "result",
            &[("hit", o.exists_hits), ("miss", o.exists_misses)],
        ),
        (
            "cxlkv_unpins_total",
            "Unpin entries by outcome (not_pinned: a pin the session did not hold).",
            "outcome",
            &[("unpinned", o.unpinned), ("not_pinned", o.not_pinned)],
        ),
        (
            "cxlkv_deletes_total",
            "Delete keys by outcome.",
            "outcome",
            &[
                ("deleted", o.deleted),
                ("pinned", o.delete_pinned),
                ("missing", o.delete_missing),
            ],
        ),
    ] {
        e.family(name, "counter", help);
        for &(value, v) in values {
            e.sample(name, &[(label, value)], v);
        }
    }

    let ops: Vec<(&str, &proto::OpStats)> = s
        .ops
        .iter()
        .filter_map(|op| op_name(op.kind).map(|n| (n, op)))
        .collect();
    for (name, help, field) in [
        (
            "cxlkv_requests_total",
            "Requests by operation.",
            (|op: &proto::OpStats| op.requests) as fn(&proto::OpStats) -> u64,
        ),
        (
            "cxlkv_request_items_total",
            "Keys or entries processed, by operation.",
            |op| op.items,
        ),
        (
            "cxlkv_request_errors_total",
            "Requests refused with an error, by operation.",
            |op| op.errors,
        ),
    ] {
        e.family(name, "counter", help);
        for (op, row) in &ops {
            e.sample(name, &[("op", op)], field(row));
        }
    }

    let hist = "cxlkv_request_duration_seconds";
    e.family(
        hist,
        "histogram",
        "Time in the server from the received frame to the queued reply, by operation.",
    );
    let bucket = format!("{hist}_bucket");
    let sum = format!("{hist}_sum");
    let count = format!("{hist}_count");
    for (op, h) in snap.latencies.iter() {
        let op = op.name();
        for (bound, n) in h.cumulative() {
            let le = bound.map_or_else(|| "+Inf".to_owned(), seconds);
            e.sample(&bucket, &[("op", op), ("le", &le)], n);
        }
        e.sample(&sum, &[("op", op)], seconds(h.sum_ns()));
        e.sample(&count, &[("op", op)], h.count());
    }

    e.family(
        "cxlkv_pool_info",
        "gauge",
        "A pool of the server and its path (always 1).",
    );
    for (pool, path) in &snap.pool_paths {
        e.sample(
            "cxlkv_pool_info",
            &[("pool", &pool.to_string()), ("path", path)],
            1,
        );
    }
    for (name, help, field) in [
        (
            "cxlkv_pool_size_bytes",
            "Allocatable bytes of the pool, as last reported by the pool manager.",
            (|p: &proto::PoolRow| p.size_bytes) as fn(&proto::PoolRow) -> u64,
        ),
        (
            "cxlkv_pool_free_bytes",
            "Free bytes of the pool (last report, adjusted by this directory since).",
            |p| p.free_bytes,
        ),
        (
            "cxlkv_pool_regions",
            "Regions of this directory in the pool.",
            |p| p.regions,
        ),
        (
            "cxlkv_pool_region_bytes",
            "Bytes of this directory's regions in the pool.",
            |p| p.region_bytes,
        ),
        (
            "cxlkv_pool_orphaned_regions",
            "Regions in the pool whose owner is gone.",
            |p| p.orphaned_regions,
        ),
        ("cxlkv_pool_keys", "Registered keys in the pool.", |p| {
            p.keys
        }),
        (
            "cxlkv_pool_used_bytes",
            "Registered keys times their page size, in the pool.",
            |p| p.used_bytes,
        ),
    ] {
        e.family(name, "gauge", help);
        for p in &s.pools {
            e.sample(name, &[("pool", &p.pool.to_string())], field(p));
        }
    }

    for (name, help, field) in [
        (
            "cxlkv_instance_sessions",
            "Sessions open per instance (0: within its grace period).",
            (|i: &proto::InstanceRow| u64::from(i.sessions)) as fn(&proto::InstanceRow) -> u64,
        ),
        (
            "cxlkv_instance_owned_bytes",
            "Bytes of regions an instance owns.",
            |i| i.owned_bytes,
        ),
        (
            "cxlkv_instance_used_bytes",
            "Registered keys times their page size, per instance.",
            |i| i.used_bytes,
        ),
        (
            "cxlkv_instance_quota_bytes",
            "Per-instance quota (0: none).",
            |i| i.quota_bytes,
        ),
        (
            "cxlkv_instance_keys",
            "Registered keys per instance.",
            |i| i.keys,
        ),
        (
            "cxlkv_instance_pins",
            "Pins held by an instance's sessions.",
            |i| i.pins,
        ),
        (
            "cxlkv_instance_notices_pending",
            "Freed-page notices an instance has not acknowledged.",
            |i| u64::from(i.notices_pending),
        ),
    ] {
        e.family(name, "gauge", help);
        for i in &s.instances {
            e.sample(name, &[("instance_id", &i.instance_id)], field(i));
        }
    }
    e.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_falls_in_the_first_bucket_whose_bound_is_at_or_above_it() {
        let mut h = LatencyHistogram::default();
        for ns in [0, 1_000, 1_001, 2_000_000_000] {
            h.record(ns);
        }
        let c: Vec<(Option<u64>, u64)> = h.cumulative().collect();
        assert_eq!(c[0], (Some(1_000), 2), "0 and the bound itself");
        assert_eq!(c[1], (Some(2_500), 3));
        assert_eq!(c[c.len() - 2], (Some(1_000_000_000), 3));
        assert_eq!(c[c.len() - 1], (None, 4), "+Inf counts everything");
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum_ns(), 2_000_002_001);
    }

    #[test]
    fn every_counted_kind_has_an_operation_name() {
        for op in OpKind::ALL {
            assert_eq!(op_name(kind_of(op).as_u16()), Some(op.name()));
        }
        assert_eq!(op_name(Kind::MapRegion.as_u16()), None);
    }

    #[test]
    fn label_values_and_seconds_are_written_in_exposition_form() {
        let mut s = String::new();
        escape_label("a\"b\\c\nd", &mut s);
        assert_eq!(s, r#"a\"b\\c\nd"#);
        assert_eq!(seconds(1_500_000_000), "1.5");
        assert_eq!(seconds(2_500), "0.0000025");
        assert_eq!(seconds(1_000), "0.000001");
        assert_eq!(seconds(1_000_000_000), "1");
        assert_eq!(seconds(0), "0");
        assert_eq!(seconds(1), "0.000000001");
    }
}
