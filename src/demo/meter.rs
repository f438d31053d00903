//! Per-operation measurements of the demo: a latency histogram, the bytes
//! moved and the time spent inside the operation.
//!
//! An instance keeps one [`Meter`] per [`Op`] and sends the coordinator an
//! [`OpRecord`] (the histogram as its recorded `(value, count)` pairs, so
//! that percentiles are computed over every sample of every instance, not
//! averaged); the coordinator merges the records with [`Meter::absorb`].

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Longest latency recorded exactly; longer ones saturate (a minute).
const MAX_LATENCY_NS: u64 = 60_000_000_000;
/// Most `(value, count)` pairs accepted from one record: far more than a
/// 3-digit histogram up to a minute has buckets, so a longer list is a
/// malformed record, not a measurement.
const MAX_RECORD_PAIRS: usize = 1 << 16;

/// The operations the demo measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `batch_put` of the chunks a request missed (or of a document's
    /// prefix, in the prefill): copy into the pool, publish, register.
    Store,
    /// `batch_get` of a request's keys: one round trip, pinned views.
    Lookup,
    /// Lookup plus reading every byte of every hit in place (checksummed).
    Read,
    /// The same shared hits fetched from their writers over loopback TCP
    /// into a reader-owned buffer, then checksummed: the transfer baseline.
    TcpRead,
}

impl Op {
    pub const ALL: [Op; 4] = [Op::Store, Op::Lookup, Op::Read, Op::TcpRead];

    /// The name in reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Op::Store => "store",
            Op::Lookup => "lookup",
            Op::Read => "read",
            Op::TcpRead => "tcp_read",
        }
    }
}

/// Measurements of one operation.
#[derive(Debug, Clone)]
pub struct Meter {
    latency_ns: Histogram<u64>,
    bytes: u64,
    busy_ns: u64,
}

impl Default for Meter {
    fn default() -> Self {
        Self {
            latency_ns: Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3)
                .expect("invariant: constant, valid histogram bounds"),
            bytes: 0,
            busy_ns: 0,
        }
    }
}

/// A meter as it travels from an instance to the coordinator.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct OpRecord {
    pub bytes: u64,
    pub busy_ns: u64,
    /// `(latency_ns, count)` of every recorded bucket.
    pub latency_ns: Vec<(u64, u64)>,
}

/// Percentiles of one operation, as reported.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p99: f64,
}

impl Meter {
    /// One operation that moved `bytes` and took `took`.
    pub fn record(&mut self, bytes: u64, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.latency_ns.saturating_record(ns.max(1));
        self.bytes += bytes;
        self.busy_ns = self.busy_ns.saturating_add(ns);
    }

    pub fn count(&self) -> u64 {
        self.latency_ns.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes per second of time spent inside the operation, in GB/s (10⁹).
    pub fn gbps(&self) -> f64 {
        if self.busy_ns == 0 {
            0.0
        } else {
            self.bytes as f64 / self.busy_ns as f64
        }
    }

    /// p50 and p99 in microseconds (zeros when nothing was recorded).
    pub fn percentiles_us(&self) -> Percentiles {
        if self.count() == 0 {
            return Percentiles::default();
        }
        let us = |q: f64| self.latency_ns.value_at_quantile(q) as f64 / 1e3;
        Percentiles {
            count: self.count(),
            p50: us(0.50),
            p99: us(0.99),
        }
    }

    pub fn to_record(&self) -> OpRecord {
        OpRecord {
            bytes: self.bytes,
            busy_ns: self.busy_ns,
            latency_ns: self
                .latency_ns
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        }
    }

    /// Adds an instance's record to this meter.
    pub fn absorb(&mut self, record: &OpRecord) -> anyhow::Result<()> {
        anyhow::ensure!(
            record.latency_ns.len() <= MAX_RECORD_PAIRS,
            "a latency record with {} buckets (at most {MAX_RECORD_PAIRS})",
            record.latency_ns.len()
        );
        for &(value, count) in &record.latency_ns {
            self.latency_ns
                .saturating_record_n(value.clamp(1, MAX_LATENCY_NS), count);
        }
        self.bytes = self.bytes.saturating_add(record.bytes);
        self.busy_ns = self.busy_ns.saturating_add(record.busy_ns);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_records_keep_every_sample_and_byte() {
        let mut a = Meter::default();
        let mut b = Meter::default();
        for us in 1..=99 {
            a.record(10, Duration::from_micros(us));
        }
        b.record(1000, Duration::from_millis(50));
        let mut merged = Meter::default();
        merged.absorb(&a.to_record()).unwrap();
        merged.absorb(&b.to_record()).unwrap();
        assert_eq!(merged.count(), 100);
        assert_eq!(merged.bytes(), 99 * 10 + 1000);
        let p = merged.percentiles_us();
        assert!((49.0..=51.0).contains(&p.p50), "{p:?}");
        assert!(p.p99 >= 99.0 && p.p99 < 50_000.0 * 1.01, "{p:?}");
    }

    #[test]
    fn throughput_is_bytes_over_time_inside_the_operation() {
        let mut m = Meter::default();
        m.record(2_000_000_000, Duration::from_secs(1));
        m.record(0, Duration::from_secs(1));
        assert!((m.gbps() - 1.0).abs() < 1e-9);
        assert_eq!(Meter::default().gbps(), 0.0);
    }
}
