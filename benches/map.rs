//! Criterion bench of eager region population: what it costs to map a fresh
//! 64 MiB region of a `/dev/shm` pool and then write every page, which is
//! what an owned region goes through. `cargo bench --bench map`.
//!
//! - `populate_eager`: `MappedRegion::map` with `Populate::Eager`
//!   (`MADV_POPULATE_WRITE`), then one write per 4 KiB page;
//! - `map_populate` (baseline): a raw `mmap(MAP_SHARED | MAP_POPULATE)` of the
//!   same range, then the same writes;
//! - `lazy_touch`: `Populate::Lazy`, every page faulted by its first write.
//!
//! Every iteration starts from a fresh, empty file, so page allocation is
//! included; creating and deleting the file is not timed.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

use cxlkv::dataplane::backing::{self, Backing, Extent, OpenOptions};
use cxlkv::dataplane::ids::{PageIndex, RegionId};
use cxlkv::dataplane::map::{MapObservers, MappedRegion, Populate};

const LEN: usize = 64 << 20;
const PAGE: usize = 4096;

struct FreshPool {
    path: std::path::PathBuf,
    backing: std::sync::Arc<dyn Backing>,
}

impl FreshPool {
    fn new() -> Self {
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/cxlkv-criterion-map-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let backing = backing::open(&path, &OpenOptions::new().create_size_bytes(LEN as u64))
            .expect("create the bench pool under /dev/shm");
        Self { path, backing }
    }
}

impl Drop for FreshPool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn touch_region(region: &MappedRegion) {
    for i in 0..(LEN / PAGE) as u32 {
        // SAFETY: one view at a time in a private region.
        let mut page = unsafe { region.page_mut(PAGE, PageIndex(i), 1) }.expect("page in range");
        page[0] = 1;
    }
}

fn ours(populate: Populate) -> Duration {
    let pool = FreshPool::new();
    let start = Instant::now();
    // SAFETY: a private pool, written through one view at a time.
    let region = unsafe {
        MappedRegion::map(
            &*pool.backing,
            RegionId(0),
            Extent::new(0, LEN as u64),
            populate,
            &MapObservers::new(),
        )
    }
    .expect("map");
    touch_region(&region);
    let elapsed = start.elapsed();
    drop(region);
    elapsed
}

fn map_populate() -> Duration {
    let pool = FreshPool::new();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&pool.backing.fd());
    let start = Instant::now();
    // SAFETY: a fresh mapping (no MAP_FIXED) of a private pool file.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "mmap");
    for offset in (0..LEN).step_by(PAGE) {
        // SAFETY: `offset < LEN`, inside the mapping just created.
        unsafe { addr.cast::<u8>().add(offset).write_volatile(1) };
    }
    let elapsed = start.elapsed();
    // SAFETY: unmapping exactly the mapping created above.
    unsafe { libc::munmap(addr, LEN) };
    elapsed
}

fn bench_populate(c: &mut Criterion) {
    let mut group = c.benchmark_group("populate_64MiB");
    group.throughput(Throughput::Bytes(LEN as u64));
    group.bench_function("populate_eager", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| ours(Populate::Eager)).sum())
    });
    group.bench_function("map_populate", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| map_populate()).sum())
    });
    group.bench_function("lazy_touch", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| ours(Populate::Lazy)).sum())
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = bench_populate
}
criterion_main!(benches);
