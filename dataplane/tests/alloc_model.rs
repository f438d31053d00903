//! Random alloc/free sequences against a reference model of the allocator:
//! no page is ever handed out twice, the page count is conserved, and every
//! stale, double or foreign free is rejected with the right error and counted.
//!
//! Two actors take turns: the test thread and a helper thread, driven one
//! operation at a time over channels, each with its own magazine. Pages the
//! helper frees stay cached in its magazine while the test thread allocates,
//! so the test thread must steal them — and because the actors never run at
//! the same time, every free page is reachable from whichever one allocates:
//! `alloc` must fail exactly when the model has no free page, on either side
//! (no false exhaustion), and `free_pages` must be exact after every step.

use cxlkv_dataplane::alloc::{
    AllocManyError, AllocatorOptions, FreeError, MAX_MAGAZINE_PAGES, PageAllocator,
};
use cxlkv_dataplane::ids::{Generation, PageIndex};
use proptest::prelude::*;
use std::sync::Arc;
use std::sync::mpsc;

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    AllocMany(usize),
    /// Free the held grant at this position (modulo the number held).
    FreeHeld(usize),
    /// Free a grant issued earlier that is no longer live (stale or double).
    FreeRetired(usize),
    /// Free an arbitrary (page, generation) pair, possibly foreign.
    FreeArbitrary(u32, u32),
    FlushLocal,
    /// Run on the helper thread: allocate.
    HelperAlloc,
    /// Run on the helper thread: free the held grant at this position.
    HelperFreeHeld(usize),
    /// Run on the helper thread: flush its magazine.
    HelperFlush,
}

fn op(page_count: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Alloc),
        1 => (0..=page_count as usize + 2).prop_map(Op::AllocMany),
        4 => any::<usize>().prop_map(Op::FreeHeld),
        2 => any::<usize>().prop_map(Op::FreeRetired),
        1 => (0..page_count + 3, any::<u32>()).prop_map(|(p, g)| Op::FreeArbitrary(p, g)),
        1 => Just(Op::FlushLocal),
        3 => Just(Op::HelperAlloc),
        3 => any::<usize>().prop_map(Op::HelperFreeHeld),
        1 => Just(Op::HelperFlush),
    ]
}

/// What the allocator should look like.
struct Model {
    /// Per page: current generation and whether it is allocated.
    pages: Vec<(u32, bool)>,
    held: Vec<(PageIndex, Generation)>,
    retired: Vec<(PageIndex, Generation)>,
    stale_frees: u64,
    double_frees: u64,
    foreign_frees: u64,
}

fn next_generation(g: u32) -> u32 {
    if g == u32::MAX { 1 } else { g + 1 }
}

impl Model {
    fn free_pages(&self) -> usize {
        self.pages
            .iter()
            .filter(|(_, allocated)| !allocated)
            .count()
    }

    /// Checks a grant the allocator just issued and records it.
    fn issued(&mut self, (page, generation): (PageIndex, Generation)) -> Result<(), TestCaseError> {
        let slot = &mut self.pages[page.0 as usize];
        prop_assert!(!slot.1, "{page} handed out twice");
        prop_assert_eq!(generation.0, next_generation(slot.0), "{} generation", page);
        *slot = (generation.0, true);
        self.held.push((page, generation));
        Ok(())
    }

    /// The outcome the allocator must give for `free(page, generation)`;
    /// applies it to the model.
    fn free(&mut self, page: PageIndex, generation: Generation) -> Result<(), FreeError> {
        let page_count = self.pages.len() as u32;
        let Some(slot) = self.pages.get_mut(page.0 as usize) else {
            self.foreign_frees += 1;
            return Err(FreeError::ForeignPage { page, page_count });
        };
        if slot.0 != generation.0 {
            self.stale_frees += 1;
            return Err(FreeError::StaleGeneration {
                page,
                given: generation,
                current: Generation(slot.0),
            });
        }
        if !slot.1 {
            self.double_frees += 1;
            return Err(FreeError::DoubleFree { page, generation });
        }
        slot.1 = false;
        self.held.retain(|&grant| grant != (page, generation));
        self.retired.push((page, generation));
        Ok(())
    }
}

/// What the helper thread is asked to do, and what it answers.
enum Job {
    Alloc,
    Free(PageIndex, Generation),
    Flush,
}

enum Answer {
    Alloc(Option<(PageIndex, Generation)>),
    Free(Result<(), FreeError>),
    Flushed,
}

/// A thread that runs one allocator operation per request, so the test
/// thread and it never run at the same time.
struct Helper {
    jobs: Option<mpsc::Sender<Job>>,
    answers: mpsc::Receiver<Answer>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Helper {
    fn new(allocator: Arc<PageAllocator>) -> Self {
        let (jobs, inbox) = mpsc::channel();
        let (outbox, answers) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            for job in inbox {
                let answer = match job {
                    Job::Alloc => Answer::Alloc(allocator.alloc()),
                    Job::Free(page, generation) => Answer::Free(allocator.free(page, generation)),
                    Job::Flush => {
                        allocator.flush_local();
                        Answer::Flushed
                    }
                };
                if outbox.send(answer).is_err() {
                    break;
                }
            }
        });
        Self {
            jobs: Some(jobs),
            answers,
            thread: Some(thread),
        }
    }

    fn run(&self, job: Job) -> Answer {
        self.jobs
            .as_ref()
            .expect("helper running")
            .send(job)
            .expect("helper alive");
        self.answers.recv().expect("helper answers")
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // Closing the channel ends the helper's loop; joining waits for its
        // exit (its magazine stays cached under its released slot).
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    page_count: u32,
    magazine_pages: u32,
    initial: u32,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let options = AllocatorOptions::default()
        .magazine_pages(magazine_pages)
        .initial_generation(Generation(initial));
    let allocator = Arc::new(PageAllocator::with_options(page_count, options).unwrap());
    let helper = Helper::new(Arc::clone(&allocator));
    let mut model = Model {
        pages: vec![(initial, false); page_count as usize],
        held: Vec::new(),
        retired: Vec::new(),
        stale_frees: 0,
        double_frees: 0,
        foreign_frees: 0,
    };
    for op in ops {
        match op {
            Op::Alloc => match allocator.alloc() {
                Some(grant) => model.issued(grant)?,
                None => prop_assert_eq!(model.free_pages(), 0, "alloc failed with pages free"),
            },
            Op::AllocMany(n) => {
                let mut out = vec![(PageIndex(u32::MAX), Generation(0)); n];
                let free = model.free_pages();
                match allocator.alloc_many(&mut out) {
                    Ok(()) => {
                        prop_assert!(n <= free);
                        for grant in out {
                            model.issued(grant)?;
                        }
                    }
                    Err(AllocManyError::LargerThanRegion { requested, .. }) => {
                        prop_assert_eq!(requested, n);
                        prop_assert!(n > page_count as usize);
                    }
                    Err(AllocManyError::Exhausted {
                        requested,
                        obtained,
                    }) => {
                        prop_assert_eq!(requested, n);
                        prop_assert!(n > free);
                        prop_assert_eq!(obtained, free, "a batch takes every reachable page");
                        // The batch took these pages and gave them back: their
                        // generations moved on and the grants are retired.
                        for &grant in &out[..obtained] {
                            model.issued(grant)?;
                            prop_assert_eq!(model.free(grant.0, grant.1), Ok(()));
                        }
                        prop_assert!(out[obtained..].iter().all(|g| g.0 == PageIndex(u32::MAX)));
                    }
                    Err(other) => prop_assert!(false, "unexpected {other:?}"),
                }
            }
            Op::FreeHeld(i) if !model.held.is_empty() => {
                let (page, generation) = model.held[i % model.held.len()];
                prop_assert_eq!(model.free(page, generation), Ok(()));
                prop_assert_eq!(allocator.free(page, generation), Ok(()));
            }
            Op::FreeRetired(i) if !model.retired.is_empty() => {
                let (page, generation) = model.retired[i % model.retired.len()];
                let expected = model.free(page, generation);
                prop_assert!(expected.is_err(), "a retired grant is never live");
                prop_assert_eq!(allocator.free(page, generation), expected);
            }
            Op::FreeArbitrary(page, generation) => {
                let (page, generation) = (PageIndex(page), Generation(generation));
                let expected = model.free(page, generation);
                prop_assert_eq!(allocator.free(page, generation), expected);
            }
            Op::FlushLocal => allocator.flush_local(),
            Op::HelperAlloc => match helper.run(Job::Alloc) {
                Answer::Alloc(Some(grant)) => model.issued(grant)?,
                Answer::Alloc(None) => prop_assert_eq!(
                    model.free_pages(),
                    0,
                    "helper's alloc failed with pages free"
                ),
                _ => prop_assert!(false, "helper answered another job"),
            },
            Op::HelperFreeHeld(i) if !model.held.is_empty() => {
                let (page, generation) = model.held[i % model.held.len()];
                prop_assert_eq!(model.free(page, generation), Ok(()));
                match helper.run(Job::Free(page, generation)) {
                    Answer::Free(result) => prop_assert_eq!(result, Ok(())),
                    _ => prop_assert!(false, "helper answered another job"),
                }
            }
            Op::HelperFlush => {
                prop_assert!(matches!(helper.run(Job::Flush), Answer::Flushed));
            }
            Op::FreeHeld(_) | Op::FreeRetired(_) | Op::HelperFreeHeld(_) => {}
        }
        let stats = allocator.stats();
        prop_assert_eq!(
            stats.free_pages as usize,
            model.free_pages(),
            "page count conserved"
        );
        prop_assert_eq!(stats.stale_frees, model.stale_frees);
        prop_assert_eq!(stats.double_frees, model.double_frees);
        prop_assert_eq!(stats.foreign_frees, model.foreign_frees);
        for &(page, generation) in &model.held {
            prop_assert!(allocator.is_allocated(page, generation));
        }
    }
    // The helper exits with whatever it has cached. Everything not held can
    // still be allocated, each page once: nothing was lost or duplicated.
    drop(helper);
    prop_assert_eq!(allocator.free_pages() as usize, model.free_pages());
    while let Some(grant) = allocator.alloc() {
        model.issued(grant)?;
    }
    prop_assert_eq!(model.free_pages(), 0);
    prop_assert_eq!(model.held.len(), page_count as usize);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_alloc_free_sequences_match_the_reference_model(
        (page_count, ops) in (1u32..=40).prop_flat_map(|n| (Just(n), prop::collection::vec(op(n), 0..200))),
        magazine_pages in 0..=MAX_MAGAZINE_PAGES,
        initial in prop_oneof![Just(0u32), Just(u32::MAX - 3), any::<u32>()],
    ) {
        run(page_count, magazine_pages, initial, ops)?;
    }
}
