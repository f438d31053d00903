//! Many threads allocate and free on one region, reached through the region
//! table, while another thread adds and removes regions.
//!
//! Proves, under real concurrency:
//! - exclusivity: every page a thread holds carries that thread's ownership
//!   marker, set by compare-and-swap from "nobody", so a page handed out twice
//!   is caught the moment the second holder claims it;
//! - nothing is lost: worker threads exit in waves while others still run
//!   (their cached pages must stay reachable), and at the end every page of the region
//!   can be allocated again by one thread;
//! - stale and double frees are rejected and counted exactly;
//! - on an oversubscribed region, where allocations succeed by stealing from
//!   other threads' magazines while their owners use them, the same holds;
//! - two frees of one grant on two threads — the owner's lock-free fast path
//!   against a remote free behind a heavy barrier — succeed exactly once
//!   (this test fails at once if the remote side's barrier is removed);
//! - the table hands a removed region back only when no reader can see it:
//!   readers check, inside the read, that the region they hold has not been
//!   dropped, and each removed region is dropped exactly once.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use cxlkv_dataplane::alloc::{AllocatorOptions, FreeError, PageAllocator};
use cxlkv_dataplane::ids::{Generation, PageIndex, RegionId};
use cxlkv_dataplane::table::RegionTable;

const MAIN: RegionId = RegionId(0);
const MAIN_PAGES: u32 = 512;
const OPS_PER_WORKER: usize = 20_000;
/// Workers per wave: 2 to 8 threads on the main region at once.
const WAVES: &[usize] = &[2, 8, 3, 5, 4, 7, 6];
const CHURN_REGIONS: u64 = 4_000;
const NOBODY: u32 = 0;

/// Life state of every region that ever existed, by id.
struct Lives {
    /// 0 = never created, 1 = live, 2 = dropped.
    state: Vec<AtomicU32>,
    drops: AtomicUsize,
}

impl Lives {
    /// Room for regions `0..regions`, none created yet.
    fn new(regions: usize) -> Arc<Self> {
        Arc::new(Self {
            state: (0..regions).map(|_| AtomicU32::new(0)).collect(),
            drops: AtomicUsize::new(0),
        })
    }
}

struct Region {
    id: RegionId,
    allocator: PageAllocator,
    /// Per page: the id of the thread that holds it, or `NOBODY`.
    owner: Vec<AtomicU32>,
    lives: Arc<Lives>,
}

impl Region {
    fn new(id: RegionId, pages: u32, lives: &Arc<Lives>) -> Self {
        Self::with_fences(id, pages, lives, false)
    }

    /// `asymmetric`: the allocator's owners change page states without
    /// locked instructions (see `AllocatorOptions::asymmetric_fences`).
    fn with_fences(id: RegionId, pages: u32, lives: &Arc<Lives>, asymmetric: bool) -> Self {
        let options = AllocatorOptions::default()
            .magazine_pages(8)
            .asymmetric_fences(asymmetric);
        let previous = lives.state[id.0 as usize].swap(1, SeqCst);
        assert_eq!(previous, 0, "region {id} created twice");
        Self {
            id,
            allocator: PageAllocator::with_options(pages, options).unwrap(),
            owner: (0..pages).map(|_| AtomicU32::new(NOBODY)).collect(),
            lives: Arc::clone(lives),
        }
    }

    fn assert_live(&self) {
        assert_eq!(
            self.lives.state[self.id.0 as usize].load(SeqCst),
            1,
            "a reader saw region {} after it was dropped",
            self.id
        );
    }

    fn claim(&self, page: PageIndex, me: u32) {
        let claimed = self.owner[page.0 as usize].compare_exchange(NOBODY, me, SeqCst, SeqCst);
        assert_eq!(claimed, Ok(NOBODY), "{page} handed out while held");
    }

    fn unclaim(&self, page: PageIndex, me: u32) {
        let released = self.owner[page.0 as usize].compare_exchange(me, NOBODY, SeqCst, SeqCst);
        assert_eq!(released, Ok(me), "{page} changed owner while held");
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let previous = self.lives.state[self.id.0 as usize].swap(2, SeqCst);
        assert_eq!(previous, 1, "region {} dropped twice", self.id);
        self.lives.drops.fetch_add(1, SeqCst);
    }
}

/// One worker's life: allocate up to a few pages, claim them, verify and
/// release; now and then replay a freed grant (stale or double free).
fn worker(table: &RegionTable<Region>, me: u32, rejected: &AtomicU64) {
    let mut held: Vec<(PageIndex, Generation)> = Vec::new();
    let mut freed: Vec<(PageIndex, Generation)> = Vec::new();
    let mut rng = me.wrapping_mul(0x9E37_79B9) | 1;
    for i in 0..OPS_PER_WORKER {
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        table
            .with(MAIN, |region| {
                region.assert_live();
                if held.len() < 6 && !rng.is_multiple_of(3) {
                    if let Some(grant) = region.allocator.alloc() {
                        region.claim(grant.0, me);
                        held.push(grant);
                    }
                } else if let Some(grant) = held.pop() {
                    region.unclaim(grant.0, me);
                    region.allocator.free(grant.0, grant.1).unwrap();
                    freed.push(grant);
                }
                if i % 97 == 0
                    && let Some(&(page, generation)) = freed.first()
                {
                    // Freed by us: the page is free at that generation or
                    // has moved on. Either way the replay must be refused.
                    let replay = region.allocator.free(page, generation);
                    assert!(
                        matches!(
                            replay,
                            Err(FreeError::DoubleFree { .. } | FreeError::StaleGeneration { .. })
                        ),
                        "replayed free of {page} at {generation} accepted: {replay:?}"
                    );
                    rejected.fetch_add(1, SeqCst);
                }
            })
            .expect("the main region is never removed");
        // Touch the churning regions too: whatever a reader finds must be live.
        table.find_map_from(i, |id, region| {
            region.assert_live();
            (id != MAIN).then(|| {
                if let Some((page, generation)) = region.allocator.alloc() {
                    region.allocator.free(page, generation).unwrap();
                }
            })
        });
    }
    table
        .with(MAIN, |region| {
            for (page, generation) in held.drain(..) {
                region.unclaim(page, me);
                region.allocator.free(page, generation).unwrap();
            }
        })
        .expect("the main region is never removed");
}

#[test]
fn threads_on_one_region_never_share_a_page_and_lose_none_while_regions_churn() {
    let lives = Lives::new(CHURN_REGIONS as usize + 1);
    let table = RegionTable::new();
    assert!(
        table
            .insert(MAIN, Region::new(MAIN, MAIN_PAGES, &lives))
            .is_ok()
    );
    let rejected = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let mut removed = 0;
    let mut dropped_by_churn = 0;

    std::thread::scope(|scope| {
        let churn = scope.spawn(|| {
            let mut live = std::collections::VecDeque::new();
            for id in 1..=CHURN_REGIONS {
                if done.load(SeqCst) {
                    break;
                }
                let region = Region::new(RegionId(id), 4, &lives);
                assert!(table.insert(RegionId(id), region).is_ok());
                live.push_back(RegionId(id));
                if live.len() > 3 {
                    let oldest = live.pop_front().expect("more than three live");
                    table.remove(oldest).unwrap();
                    removed += 1;
                }
                dropped_by_churn += table.take_unreachable().len();
                std::thread::yield_now();
            }
            for id in live {
                table.remove(id).unwrap();
                removed += 1;
            }
        });

        // Waves overlap: the next wave starts while the previous one runs,
        // then the previous one is joined (its threads have fully exited,
        // magazine destructors included).
        let mut next_id = 1;
        let mut running: Vec<std::thread::ScopedJoinHandle<'_, ()>> = Vec::new();
        for &size in WAVES {
            let wave: Vec<_> = (0..size)
                .map(|_| {
                    let me = next_id;
                    next_id += 1;
                    let (table, rejected) = (&table, &rejected);
                    scope.spawn(move || worker(table, me, rejected))
                })
                .collect();
            for handle in running.drain(..) {
                handle.join().unwrap();
            }
            running = wave;
        }
        for handle in running {
            handle.join().unwrap();
        }
        done.store(true, SeqCst);
        churn.join().unwrap();
    });

    // Every removed region comes back exactly once, once unreachable. No
    // reader is left, so this only waits for the epoch to advance.
    let mut attempts = 0;
    while dropped_by_churn < removed {
        dropped_by_churn += table.take_unreachable().len();
        attempts += 1;
        assert!(
            attempts < 100_000,
            "removed regions never became unreachable"
        );
        std::thread::yield_now();
    }
    assert_eq!(dropped_by_churn, removed);
    assert_eq!(lives.drops.load(SeqCst), removed);
    assert_eq!(table.removed_pending(), 0);
    assert_eq!(table.len(), 1);

    table
        .with(MAIN, |region| {
            let stats = region.allocator.stats();
            assert_eq!(stats.free_pages, MAIN_PAGES, "page count conserved");
            assert_eq!(
                stats.stale_frees + stats.double_frees,
                rejected.load(SeqCst),
                "every replayed free, and nothing else, was rejected"
            );
            // Every page is reachable from here: no magazine kept any.
            let mut pages = HashSet::new();
            while let Some((page, _)) = region.allocator.alloc() {
                assert!(pages.insert(page), "{page} handed out twice");
            }
            assert_eq!(pages.len(), MAIN_PAGES as usize, "pages lost");
        })
        .expect("the main region is never removed");
}

/// Pages on a region where demand exceeds supply: each thread wants more
/// pages than its share, so the shared stack runs dry all the time and
/// allocations succeed only by stealing from the other threads' magazines
/// (while their owners allocate and spill from them). Ownership markers
/// catch any page handed out twice; at the end every page comes back.
#[test]
fn threads_on_an_oversubscribed_region_steal_from_each_other_and_never_share_a_page() {
    oversubscribed(false);
}

/// The same with asymmetric fences: owners take and free with plain stores,
/// thieves announce themselves and run the heavy barrier.
#[test]
fn threads_on_an_oversubscribed_region_steal_without_locks_and_never_share_a_page() {
    oversubscribed(true);
}

fn oversubscribed(asymmetric: bool) {
    const PAGES: u32 = 64;
    const THREADS: u32 = 6;
    const OPS: usize = 40_000;
    /// Each thread holds up to this many: 6 × 16 = 96 wanted of 64.
    const WANT: usize = 16;
    /// Most repetitions of the whole round (see below).
    const ROUNDS: usize = 20;
    let lives = Lives::new(1);
    let region = Region::with_fences(MAIN, PAGES, &lives, asymmetric);
    let misses = AtomicU64::new(0);
    // The threads fill up to their share behind a barrier, so the region is
    // exhausted (and pages freed into one magazine are wanted by another)
    // however the scheduler interleaves them. Whether a steal happens in a
    // round still depends on the interleaving of the mixed phase, so the
    // whole round is repeated (bounded) until the steal path has run; every
    // round checks the same invariants and ends with every page freed.
    let barrier = std::sync::Barrier::new(THREADS as usize);
    for _round in 0..ROUNDS {
        std::thread::scope(|scope| {
            for me in 1..=THREADS {
                let (region, misses, barrier) = (&region, &misses, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    // Every thread takes its share before any starts the
                    // mixed phase: with 6 × 16 wanted of 64, the region is
                    // exhausted from the start, whether or not the
                    // scheduler runs the threads side by side.
                    let mut held: Vec<(PageIndex, Generation)> = Vec::new();
                    while held.len() < WANT {
                        let Some(grant) = region.allocator.alloc() else {
                            misses.fetch_add(1, SeqCst);
                            break;
                        };
                        region.claim(grant.0, me);
                        held.push(grant);
                    }
                    barrier.wait();
                    let mut rng = me.wrapping_mul(0x9E37_79B9) | 1;
                    for _ in 0..OPS {
                        rng ^= rng << 13;
                        rng ^= rng >> 17;
                        rng ^= rng << 5;
                        // Mostly allocate until WANT, then mostly free: the
                        // threads' combined demand keeps the region exhausted.
                        let grow = held.len() < WANT && rng % 4 != 0;
                        if grow {
                            match region.allocator.alloc() {
                                Some(grant) => {
                                    region.claim(grant.0, me);
                                    held.push(grant);
                                }
                                None => {
                                    misses.fetch_add(1, SeqCst);
                                }
                            }
                        } else if !held.is_empty() {
                            let grant = held.swap_remove(rng as usize % held.len());
                            region.unclaim(grant.0, me);
                            region.allocator.free(grant.0, grant.1).unwrap();
                        }
                    }
                    for (page, generation) in held {
                        region.unclaim(page, me);
                        region.allocator.free(page, generation).unwrap();
                    }
                });
            }
        });
        if region.allocator.stats().steals > 0 && misses.load(SeqCst) > 0 {
            break;
        }
    }
    let stats = region.allocator.stats();
    assert!(
        stats.steals > 0,
        "the steal path never ran ({} misses)",
        misses.load(SeqCst)
    );
    assert!(
        misses.load(SeqCst) > 0,
        "the region was never exhausted: {stats:?}"
    );
    assert_eq!(stats.free_pages, PAGES, "page count conserved");
    assert_eq!(stats.stale_frees + stats.double_frees, 0);
    let mut pages = HashSet::new();
    while let Some((page, _)) = region.allocator.alloc() {
        assert!(pages.insert(page), "{page} handed out twice");
    }
    assert_eq!(pages.len(), PAGES as usize, "pages lost");
}

/// Two threads free every grant twice at once: each thread allocates,
/// releases its claim, hands the grant to the other thread and frees it
/// itself, while the other frees what it was handed (a duplicated notice, on
/// another thread). The owner's free runs its lock-free fast path, the other
/// a remote free with a heavy barrier. Exactly one of each pair succeeds,
/// the loser is refused as a double or stale free, and ownership markers
/// catch any page handed out twice after a lost update.
#[test]
fn an_owners_lock_free_frees_racing_remote_frees_of_the_same_grants_succeed_once_each() {
    racing_double_frees(true);
}

/// The same with both frees deciding by CAS (the default).
#[test]
fn racing_frees_of_the_same_grants_on_two_threads_succeed_once_each() {
    racing_double_frees(false);
}

fn racing_double_frees(asymmetric: bool) {
    const PAGES: u32 = 128;
    const GRANTS_PER_THREAD: u64 = 20_000;
    let lives = Lives::new(1);
    let region = Region::with_fences(MAIN, PAGES, &lives, asymmetric);
    if asymmetric && !region.allocator.has_asymmetric_fences() {
        eprintln!("skipped: membarrier(2) is unavailable here, so are asymmetric fences");
        return;
    }
    let successes = AtomicU64::new(0);
    let (to_b, from_a) = channel::<((PageIndex, Generation), u64)>();
    let (to_a, from_b) = channel::<((PageIndex, Generation), u64)>();
    let done = AtomicUsize::new(0);
    // `handled[t % 2]`: the last sequence number of thread `t`'s grants that
    // the other thread has freed.
    let handled = [AtomicU64::new(0), AtomicU64::new(0)];
    std::thread::scope(|scope| {
        for (me, to_other, from_other) in [(1u32, to_b, from_b), (2, to_a, from_a)] {
            let (region, successes, done, handled) = (&region, &successes, &done, &handled);
            scope.spawn(move || {
                let free = |grant: (PageIndex, Generation)| match region
                    .allocator
                    .free(grant.0, grant.1)
                {
                    Ok(()) => {
                        successes.fetch_add(1, SeqCst);
                    }
                    Err(FreeError::DoubleFree { .. } | FreeError::StaleGeneration { .. }) => {}
                    Err(other) => panic!("unexpected {other:?}"),
                };
                // Frees what the other thread handed over, and tells it
                // how far we got (its `handled` counter).
                let drain = |from_other: &Receiver<((PageIndex, Generation), u64)>| {
                    while let Ok((theirs, seq)) = from_other.try_recv() {
                        free(theirs);
                        handled[(me as usize + 1) % 2].store(seq, SeqCst);
                    }
                };
                let mut rng = me.wrapping_mul(0x9E37_79B9) | 1;
                for seq in 1..=GRANTS_PER_THREAD {
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    let grant = region.allocator.alloc().expect("pages are never all held");
                    region.claim(grant.0, me);
                    region.unclaim(grant.0, me);
                    to_other.send((grant, seq)).unwrap();
                    if rng % 8 == 0 {
                        // Let the other thread's remote free go first (and
                        // win), serving our own mailbox meanwhile so that
                        // two waiting threads cannot deadlock.
                        // Bounded: a peer that died (panicked) stops
                        // serving, and this test must fail, not hang.
                        let deadline = Instant::now() + Duration::from_secs(60);
                        let mut spins = 0u32;
                        while handled[me as usize % 2].load(SeqCst) < seq {
                            assert!(
                                Instant::now() < deadline,
                                "the other thread stopped freeing what it was handed"
                            );
                            drain(&from_other);
                            spins = spins.wrapping_add(1);
                            if spins.is_multiple_of(64) {
                                // Lets the other thread run if it shares our
                                // CPU.
                                std::thread::yield_now();
                            } else {
                                std::hint::spin_loop();
                            }
                        }
                    } else {
                        // Race it: free after a short random pause.
                        for _ in 0..rng % 256 {
                            std::hint::spin_loop();
                        }
                    }
                    free(grant);
                    drain(&from_other);
                }
                done.fetch_add(1, SeqCst);
                drop(to_other);
                // Drain what the other thread still sends, until it hangs up.
                for (theirs, seq) in from_other {
                    free(theirs);
                    handled[(me as usize + 1) % 2].store(seq, SeqCst);
                }
            });
        }
    });
    assert_eq!(done.load(SeqCst), 2);
    let stats = region.allocator.stats();
    assert_eq!(
        successes.load(SeqCst),
        2 * GRANTS_PER_THREAD,
        "one success per grant"
    );
    assert_eq!(
        stats.double_frees + stats.stale_frees,
        2 * GRANTS_PER_THREAD,
        "one refusal per grant"
    );
    if asymmetric {
        assert!(stats.remote_frees > 0, "no remote free ever won: {stats:?}");
    }
    assert_eq!(stats.free_pages, PAGES, "page count conserved");
    let mut pages = HashSet::new();
    while let Some((page, _)) = region.allocator.alloc() {
        assert!(pages.insert(page), "{page} handed out twice");
    }
    assert_eq!(pages.len(), PAGES as usize, "pages lost");
}
