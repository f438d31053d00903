//! Criterion bench of the page allocator: alloc+free pairs against a
//! `parking_lot::Mutex<Vec<u32>>` free list of the same pages, in one group,
//! on one thread and on two threads sharing the region; `ours_asymmetric` is
//! the allocator with `AllocatorOptions::asymmetric_fences`. Runs the same
//! code as `cxlkv bench alloc` (`cxlkv::bench::alloc`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cxlkv::bench::alloc::{PAGE_COUNT, Subject, timed_pairs};

fn pairs(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_pairs");
    // One element = one alloc+free pair on each thread.
    group.throughput(Throughput::Elements(1));
    for threads in [1, 2] {
        let subjects = [
            (
                "ours",
                Subject::ours(PAGE_COUNT).expect("a valid page count"),
            ),
            (
                "ours_asymmetric",
                Subject::ours_asymmetric(PAGE_COUNT).expect("a valid page count"),
            ),
            ("mutex_vec", Subject::mutex(PAGE_COUNT)),
        ];
        for (name, subject) in &subjects {
            group.bench_function(format!("{name}/threads={threads}"), |b| {
                if threads == 1 {
                    b.iter(|| subject.pairs(black_box(1)).expect("pairs run"));
                } else {
                    b.iter_custom(|iters| {
                        timed_pairs(subject, threads, iters)
                            .expect("pairs run")
                            .wall
                    });
                }
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = pairs
}
criterion_main!(benches);
