//! Criterion bench of the copy engine, with `ptr::copy_nonoverlapping`
//! (`copy_from_slice`, libc `memcpy`) as the baseline in every group;
//! throughput in bytes. `cargo bench --bench copy`.
//!
//! - `copy_in`: into a `/dev/shm` pool mapping, destination and source both
//!   walking a span of twice the last-level cache (cold caches, as for a
//!   fresh KV page); also the forced non-temporal routine.
//! - `copy_in_hot`: the same page rewritten every time (destination in cache:
//!   the worst case for non-temporal stores, e.g. a just-recycled page).
//! - `copy_out`: out of the pool (walking source) into one reused engine
//!   buffer.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

use cxlkv::bench::copy::llc_bytes;
use cxlkv::dataplane::backing::{self, Backing, Extent, OpenOptions};
use cxlkv::dataplane::copy::{self, CopyPath};
use cxlkv::dataplane::ids::{PageIndex, RegionId};
use cxlkv::dataplane::map::{MapObservers, MappedRegion, Populate};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SIZES: &[usize] = &[
    4 * KIB,
    16 * KIB,
    64 * KIB,
    256 * KIB,
    MIB,
    4 * MIB,
    16 * MIB,
];

struct Fixture {
    _path: TempFile,
    _backing: std::sync::Arc<dyn Backing>,
    region: MappedRegion,
    source: Vec<u8>,
}

struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn fixture() -> Fixture {
    let span = (2 * llc_bytes().unwrap_or(64 * MIB)).next_multiple_of(2 * MIB);
    let path = TempFile(std::path::PathBuf::from(format!(
        "/dev/shm/cxlkv-criterion-copy-{}",
        std::process::id()
    )));
    let backing = backing::open(&path.0, &OpenOptions::new().create_size_bytes(span as u64))
        .expect("create the bench pool under /dev/shm");
    // SAFETY: this bench is the only user of its private pool, and writes go
    // through one page view at a time.
    let region = unsafe {
        MappedRegion::map(
            &*backing,
            RegionId(0),
            Extent::new(0, span as u64),
            Populate::Eager,
            &MapObservers::new(),
        )
    }
    .expect("map the bench pool");
    let source = (0..span).map(|i| i as u8).collect();
    Fixture {
        _path: path,
        _backing: backing,
        region,
        source,
    }
}

fn bench_copy(c: &mut Criterion) {
    let fx = fixture();
    let nt = [CopyPath::NonTemporalAvx512, CopyPath::NonTemporalAvx2]
        .into_iter()
        .find(|p| p.is_available());

    let mut group = c.benchmark_group("copy_in");
    for &size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let pages = fx.region.page_count(size).expect("size fits the span");
        let mut contestants: Vec<(&str, Option<CopyPath>)> = vec![
            ("copy_in", None),
            ("copy_nonoverlapping", Some(CopyPath::Plain)),
        ];
        if let Some(nt) = nt {
            contestants.push((nt.as_str(), Some(nt)));
        }
        for (name, forced) in contestants {
            let mut page = 0u32;
            let mut src_off = 0usize;
            group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
                b.iter(|| {
                    // SAFETY: one view at a time in a private region.
                    let mut dst =
                        unsafe { fx.region.page_mut(size, PageIndex(page % pages), size) }
                            .expect("page in range");
                    page = page.wrapping_add(1);
                    if src_off + size > fx.source.len() {
                        src_off = 0;
                    }
                    let src = &fx.source[src_off..src_off + size];
                    src_off += size;
                    match forced {
                        None => {
                            black_box(copy::copy_in(&mut dst, src));
                        }
                        Some(path) => copy::copy_with(path, &mut dst, src).expect("available"),
                    }
                });
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("copy_in_hot");
    for &size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        for (name, forced) in [
            ("copy_in", None),
            ("copy_nonoverlapping", Some(CopyPath::Plain)),
        ] {
            group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
                let src = &fx.source[..size];
                b.iter(|| {
                    // SAFETY: one view at a time in a private region.
                    let mut dst =
                        unsafe { fx.region.page_mut(size, PageIndex(0), size) }.expect("page 0");
                    match forced {
                        None => {
                            black_box(copy::copy_in(&mut dst, src));
                        }
                        Some(path) => copy::copy_with(path, &mut dst, src).expect("available"),
                    }
                });
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("copy_out");
    for &size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let pages = fx.region.page_count(size).expect("size fits the span");
        let mut buffer = vec![0u8; size];
        for (name, forced) in [
            ("copy_out", None),
            ("copy_nonoverlapping", Some(CopyPath::Plain)),
        ] {
            let mut page = 0u32;
            group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
                b.iter(|| {
                    let src = fx
                        .region
                        .page(size, PageIndex(page % pages), size)
                        .expect("page in range");
                    page = page.wrapping_add(1);
                    match forced {
                        None => {
                            black_box(copy::copy_out(&mut buffer, &src));
                        }
                        Some(path) => copy::copy_with(path, &mut buffer, &src).expect("available"),
                    }
                });
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench_copy
}
criterion_main!(benches);
