//! `cxlkv bench alloc`: alloc+free pairs per second of the page allocator
//! against a `parking_lot::Mutex<Vec<u32>>` free list of the same pages.
//!
//! Cases `threads=1` and `threads=2` (both threads on one region). Each
//! repetition times both subjects back to back, alternating which goes first,
//! on freshly spawned threads that start together behind a barrier after a
//! warm-up; the figures are the medians over `--reps`. `ours` and `baseline`
//! are in millions of pairs per second over all threads (higher is better);
//! `ns_per_pair` is the mean time one thread spends on one pair
//! (`threads × 1000 / ours`), `baseline_ns_per_pair` the same for the mutex.
//!
//! The baseline does less work than ours: it tracks no generations and
//! detects no double free. Targets (issue 2): `threads=1` at most 10 ns per
//! pair and ratio ≥ 0.9; `threads=2` ratio ≥ 1.5.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_dataplane::alloc::PageAllocator;
use cxlkv_dataplane::ids::PageIndex;
use parking_lot::Mutex;

use crate::bench::{Better, Record, Reporter, median};
use crate::cli::BenchArgs;

/// Pages in the measured region (a 64 MiB region of 16 KiB pages).
pub const PAGE_COUNT: u32 = 4096;
const PAIRS_PER_THREAD: u64 = 5_000_000;
const QUICK_PAIRS_PER_THREAD: u64 = 200_000;
/// Warm-up pairs per thread before the clock starts (claims the thread's
/// magazine slot, fills caches).
const WARMUP_PAIRS: u64 = 10_000;
const CASES_THREADS: [usize; 2] = [1, 2];

/// What is measured: our allocator or the baseline free list.
#[derive(Debug)]
pub enum Subject {
    Ours(PageAllocator),
    Mutex(Mutex<Vec<u32>>),
}

impl Subject {
    /// Our allocator over `page_count` pages, default options.
    pub fn ours(page_count: u32) -> anyhow::Result<Self> {
        let allocator = PageAllocator::new(page_count)
            .with_context(|| format!("allocator of {page_count} pages"))?;
        Ok(Self::Ours(allocator))
    }

    /// The baseline: a mutex around a vector of the free page indices.
    pub fn mutex(page_count: u32) -> Self {
        Self::Mutex(Mutex::new((0..page_count).rev().collect()))
    }

    /// Runs `pairs` alloc+free pairs on the calling thread.
    pub fn pairs(&self, pairs: u64) -> anyhow::Result<()> {
        match self {
            Self::Ours(allocator) => {
                for _ in 0..pairs {
                    let (page, generation) = allocator
                        .alloc()
                        .context("allocator exhausted during the bench")?;
                    black_box(page);
                    allocator.free(page, generation)?;
                }
            }
            Self::Mutex(free) => {
                for _ in 0..pairs {
                    let page = free
                        .lock()
                        .pop()
                        .context("mutex free list exhausted during the bench")?;
                    black_box(PageIndex(page));
                    free.lock().push(page);
                }
            }
        }
        Ok(())
    }
}

/// Runs `pairs` pairs on each of `threads` threads sharing `subject`, all
/// started together after a warm-up; returns the wall time from the start to
/// the last thread's finish.
pub fn timed_pairs(subject: &Subject, threads: usize, pairs: u64) -> anyhow::Result<Duration> {
    let start = Barrier::new(threads + 1);
    let finish = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let warmed = subject.pairs(WARMUP_PAIRS);
                    start.wait();
                    let measured = warmed.and_then(|()| subject.pairs(pairs));
                    finish.wait();
                    measured
                })
            })
            .collect();
        start.wait();
        let started = Instant::now();
        finish.wait();
        let elapsed = started.elapsed();
        for worker in workers {
            match worker.join() {
                Ok(result) => result?,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(elapsed)
    })
}

/// Millions of pairs per second.
fn mpairs_per_s(threads: usize, pairs: u64, elapsed: Duration) -> f64 {
    (threads as f64 * pairs as f64) / elapsed.as_secs_f64() / 1e6
}

/// Entry point of `cxlkv bench alloc`.
pub fn run(args: &BenchArgs, reporter: &mut Reporter) -> anyhow::Result<()> {
    let pairs = if args.quick {
        QUICK_PAIRS_PER_THREAD
    } else {
        PAIRS_PER_THREAD
    };
    for threads in CASES_THREADS {
        let ours = Subject::ours(PAGE_COUNT)?;
        let baseline = Subject::mutex(PAGE_COUNT);
        let magazine_pages = match &ours {
            Subject::Ours(allocator) => allocator.magazine_pages(),
            Subject::Mutex(_) => 0,
        };
        let mut ours_samples = Vec::with_capacity(args.reps);
        let mut baseline_samples = Vec::with_capacity(args.reps);
        for rep in 0..args.reps {
            // Alternate the order so that neither side always runs on the
            // warmer (or more disturbed) half of the repetition.
            let order: [(&Subject, &mut Vec<f64>); 2] = if rep % 2 == 0 {
                [(&ours, &mut ours_samples), (&baseline, &mut baseline_samples)]
            } else {
                [(&baseline, &mut baseline_samples), (&ours, &mut ours_samples)]
            };
            for (subject, samples) in order {
                let elapsed = timed_pairs(subject, threads, pairs)?;
                samples.push(mpairs_per_s(threads, pairs, elapsed));
            }
        }
        let spread = |samples: &[f64]| {
            let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
            let max = samples.iter().copied().fold(0.0, f64::max);
            format!("{min:.1}..{max:.1}")
        };
        reporter.note(&format!(
            "alloc threads={threads}: Mpairs/s over {} reps: ours {}, mutex {}",
            args.reps,
            spread(&ours_samples),
            spread(&baseline_samples)
        ));
        let ours_median = median(&mut ours_samples);
        let baseline_median = median(&mut baseline_samples);
        let ns_per_pair = |mpairs: f64| threads as f64 * 1e3 / mpairs;
        let record = Record::new(
            "alloc",
            format!("threads={threads}"),
            ours_median,
            baseline_median,
            "Mpairs/s",
            Better::Higher,
        )
        .with("ns_per_pair", ns_per_pair(ours_median))
        .with("baseline_ns_per_pair", ns_per_pair(baseline_median))
        .with("page_count", PAGE_COUNT)
        .with("magazine_pages", magazine_pages)
        .with("pairs_per_thread", pairs)
        .with("reps", args.reps as u64);
        reporter.emit(&record)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_subjects_complete_pairs_on_two_threads_and_keep_every_page() {
        for subject in [Subject::ours(64).unwrap(), Subject::mutex(64)] {
            timed_pairs(&subject, 2, 1_000).unwrap();
            match &subject {
                Subject::Ours(allocator) => assert_eq!(allocator.free_pages(), 64),
                Subject::Mutex(free) => assert_eq!(free.lock().len(), 64),
            }
        }
    }

    #[test]
    fn throughput_counts_pairs_of_every_thread() {
        let rate = mpairs_per_s(2, 1_000_000, Duration::from_secs(1));
        assert!((rate - 2.0).abs() < 1e-9);
    }
}
