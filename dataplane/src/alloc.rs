//! Lock-free page allocator: one per owned region, index-based, with page
//! generations.
//!
//! # What it is
//!
//! A [`PageAllocator`] hands out the pages `0..page_count` of one region. It
//! knows nothing about memory: the client composes it with a mapped region,
//! and a page index becomes an address there. [`PageAllocator::alloc`] returns
//! a page together with its new [`Generation`]; [`PageAllocator::free`] takes
//! both back and rejects, with a [`FreeError`] and never with a panic or UB, a
//! free that names a stale generation, a page that is already free (double
//! free), or a page outside the region (foreign). Stale and double frees are
//! expected in normal operation — freed-page notices are re-sent until
//! acknowledged, so a notice can arrive twice — and are counted.
//!
//! # The guarantee a mutable page view rests on
//!
//! **Exclusive hand-out.** Once `alloc` (or `alloc_many`) has returned
//! `(p, g)`, no call on this allocator returns page `p` again until a call
//! `free(p, g)` has returned `Ok`. `free(p, g)` returns `Ok` at most once per
//! allocation, and only while `g` is `p`'s current generation and `p` is
//! allocated. The allocator cannot tell *who* calls `free`: the exclusivity a
//! `PageViewMut` relies on therefore holds as long as only the holder of a
//! grant (or code it handed the grant to) frees it — a caller that forges or
//! misroutes a `(page, generation)` pair that happens to be current breaks it.
//! Generations make that unlikely by accident: every allocation bumps the
//! page's generation, so a free naming any earlier allocation is rejected, and
//! each allocator starts its generations at its own pseudo-random offset, so a
//! free routed to the wrong region's allocator is rejected as stale unless two
//! 32-bit generations happen to coincide.
//!
//! Memory ordering: whatever the previous holder of a page did to the page's
//! bytes before its `free` happens-before whatever the next holder does after
//! the `alloc` that returns it, whichever threads the two run on.
//!
//! # Generations
//!
//! A page's generation is a `u32` bumped by every allocation. Generation 0 is
//! never issued (it is free for callers to use as "no generation"): after
//! `u32::MAX` the next generation is 1. Wrapping is therefore the one case in
//! which a stale free is not recognised: the page must have been allocated
//! exactly a multiple of `u32::MAX` times between the allocation the free
//! names and the free itself — 4.3 billion allocations of one page while the
//! stale notice is in flight.
//!
//! # Structure, and why
//!
//! Three layers, each with one job:
//!
//! - **Page states**, one `AtomicU64` per page: `generation | allocated`. This
//!   is the ground truth for free validation. `free` is a single
//!   compare-and-swap from `(g, allocated)` to `(g, free)`, so two racing frees
//!   of one allocation cannot both win. `alloc` needs no read-modify-write on
//!   it: a free page's state changes only through the thread that has just
//!   taken the page exclusively out of a free list, so a plain store suffices.
//! - **A shared free list**: an index-linked Treiber stack (`next[page]`
//!   links) with a 64-bit head of 24 bits of top index and a 40-bit ABA tag
//!   bumped by every push and pop. Pops and pushes move whole chains, so a
//!   magazine refill or spill costs one CAS. The tag makes ABA need 2^40 head
//!   changes during one preempted CAS window (hours of continuous
//!   allocation), hence the 24-bit index limit, [`MAX_PAGES`].
//! - **Per-thread magazines**: a thread that allocates or frees gets a slot
//!   (one of [`MAX_THREAD_SLOTS`], process-wide); each allocator holds one
//!   magazine (a small array of free pages) per slot, touched only by the slot's
//!   owner with plain relaxed loads and stores. In steady state an alloc+free
//!   pair is a thread-local load (the slot index), the magazine accesses and
//!   the one CAS of `free`: one locked instruction per pair, against three for
//!   the Treiber stack alone (pop, state CAS, push) and four for a
//!   `Mutex<Vec<u32>>` free list (lock and unlock around each of alloc and
//!   free). An empty magazine refills half its capacity from the shared stack
//!   in one CAS; a full one spills its older half in one CAS. The fast paths
//!   of `alloc` and `free` inline into the caller (about 50 plain instructions
//!   and the CAS); everything else is out of line and marked cold.
//!
//! Measured with `cxlkv bench alloc` (4096 pages; each run measures all
//! three in turn, medians of 5; three runs) on a busy 2-vCPU VM (load ~7)
//! where an uncontended `lock cmpxchg` alone costs ~10 ns: one thread's CPU
//! time per pair was 18–22 ns for this design, 40–43 ns with magazines off
//! (the Treiber stack alone) and 43–44 ns for the mutex free list; wall-time
//! throughput ratios against the mutex were 1.9–2.8 with one thread and
//! 2.0–2.6 with two threads on one region (the mutex's contended lock costs
//! it far more than its CPU time shows). The
//! one CAS of `free` is the floor — it is what makes concurrent double frees
//! safe. Here the rest of the pair (with the CAS replaced by a load and a
//! store, as an experiment) cost about as much as the CAS again, so the
//! 10 ns-per-pair target needs a machine where each half is about 5 ns.
//!
//! A bitmap allocator was not chosen: finding a free bit needs a scan and a
//! RMW per alloc and per free, and it cannot hand out pages in LIFO order
//! (the most recently freed, cache-warm page first).
//!
//! # Magazines: where pages can sit, and the cost
//!
//! A page is always in exactly one of: allocated (its holder has it), the
//! shared stack, or one magazine. A page in a magazine is free in every sense
//! that matters for validation — its state says `free`, so a stale or double
//! free naming it is rejected exactly as for a page on the shared stack — and
//! [`PageAllocator::free_pages`] counts it. What a magazine costs is
//! visibility: another thread's `alloc` cannot take pages cached in this
//! thread's magazine, so `alloc` may return `None` while up to
//! `magazine_pages` free pages per other active thread sit in magazines. The
//! default magazine size is therefore at most 1/128 of the region (and
//! magazines are off below 512 pages, where pages are large and allocation
//! speed does not matter). A thread that goes idle can hand its pages back
//! with [`PageAllocator::flush_local`]; a thread that exits hands them back
//! automatically (a thread-local destructor spills its magazine of every live
//! allocator onto that allocator's shared stack and only then releases its
//! slot, so no page is lost and no two threads ever share a magazine). The
//! destructor runs as the thread exits, after its main function returned: a
//! `JoinHandle::join` waits for it, the implicit join at the end of
//! `std::thread::scope` does not. Dropping an allocator drops its magazines
//! with it: the region's pages are gone with the allocator, so there is
//! nothing to hand back to. Threads beyond [`MAX_THREAD_SLOTS`], and code
//! running after the thread's destructors, use the shared stack directly
//! (correct, slower).
//!
//! # Costs and limits
//!
//! alloc and free never block, never make a system call and never allocate
//! memory: page arrays (12 bytes per page) and magazines (16 KiB per
//! allocator when on) are allocated once, in
//! [`PageAllocator::with_options`]; a thread's first allocation or free on
//! any allocator with magazines takes a process-wide mutex once to claim its
//! slot, and its exit takes it once to hand the slot back.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crossbeam_utils::CachePadded;

use crate::ids::{Generation, PageIndex};
use crate::sync::{AtomicI64, AtomicU32, AtomicU64};

/// Bits of the stack head that hold the top page index; the rest is the tag.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// "No page": the empty stack's head index and the last page's link.
const NIL: u32 = INDEX_MASK as u32;

/// Most pages one allocator manages (16 Mi pages: 64 GiB of 4 KiB pages).
pub const MAX_PAGES: u32 = NIL;
/// Largest magazine, in pages.
pub const MAX_MAGAZINE_PAGES: u32 = 32;
/// Threads that get a magazine; later threads use the shared stack directly.
pub const MAX_THREAD_SLOTS: usize = 64;

/// Page state word: the generation in the low 32 bits, "allocated" above.
const ALLOCATED: u64 = 1 << 32;

const fn state(generation: u32, allocated: bool) -> u64 {
    generation as u64 | if allocated { ALLOCATED } else { 0 }
}

const fn state_generation(word: u64) -> u32 {
    word as u32
}

/// The generation after `g`; 0 is never issued.
const fn next_generation(g: u32) -> u32 {
    match g.checked_add(1) {
        Some(next) => next,
        None => 1,
    }
}

const fn head_index(head: u64) -> u32 {
    (head & INDEX_MASK) as u32
}

/// `head` with a bumped tag and `index` on top. The tag occupies the bits
/// above the index and wraps at 2^40.
const fn bumped_head(head: u64, index: u32) -> u64 {
    ((head & !INDEX_MASK).wrapping_add(1 << INDEX_BITS)) | index as u64
}

/// Why an allocator could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocatorError {
    #[error("a page allocator needs at least one page")]
    NoPages,
    #[error("{page_count} pages exceed the allocator's limit of {max} pages")]
    TooManyPages { page_count: u32, max: u32 },
    #[error("a magazine of {magazine_pages} pages exceeds the limit of {max} pages")]
    MagazineTooLarge { magazine_pages: u32, max: u32 },
}

/// Why a free was rejected. The allocator's state is unchanged by a rejected
/// free (apart from its counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FreeError {
    /// The page index lies outside this region: the free was meant for
    /// another allocator, or the index is corrupt.
    #[error("{page} is not a page of this region ({page_count} pages)")]
    ForeignPage { page: PageIndex, page_count: u32 },
    /// `given` is not the page's current generation: the allocation it names
    /// ended already (the page has been reallocated since), or was never made.
    #[error("stale free of {page} at {given}: the page is at {current}")]
    StaleGeneration {
        page: PageIndex,
        given: Generation,
        current: Generation,
    },
    /// The page is free at this generation: this allocation was freed already
    /// (or, for the generation a page holds before its first allocation, was
    /// never made).
    #[error("double free of {page} at {generation}: the page is already free")]
    DoubleFree {
        page: PageIndex,
        generation: Generation,
    },
}

/// Why [`PageAllocator::alloc_many`] allocated nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocManyError {
    /// Fewer than `requested` pages could be taken; the `obtained` pages that
    /// were taken have been freed again (see [`PageAllocator::alloc_many`]).
    #[error("batch of {requested} pages failed after {obtained}: region exhausted")]
    Exhausted { requested: usize, obtained: usize },
    /// The batch is larger than the whole region.
    #[error("batch of {requested} pages exceeds the region's {page_count} pages")]
    LargerThanRegion { requested: usize, page_count: u32 },
}

/// How to build an allocator; `Default` is what [`PageAllocator::new`] uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorOptions {
    magazine_pages: Option<u32>,
    initial_generation: Option<Generation>,
}

impl AllocatorOptions {
    /// Magazine capacity per thread, `0..=MAX_MAGAZINE_PAGES`; 0 turns
    /// magazines off. Default: `page_count / 128` capped at 32, off below 4.
    pub fn magazine_pages(mut self, magazine_pages: u32) -> Self {
        self.magazine_pages = Some(magazine_pages);
        self
    }

    /// The generation every page holds before its first allocation (which
    /// issues the next one). Default: a per-allocator pseudo-random value.
    pub fn initial_generation(mut self, generation: Generation) -> Self {
        self.initial_generation = Some(generation);
        self
    }
}

/// Counters of one allocator; see [`PageAllocator::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocatorStats {
    pub page_count: u32,
    /// Pages not allocated, including those cached in magazines. Exact when
    /// no alloc or free is in flight; a snapshot otherwise.
    pub free_pages: u32,
    /// Frees rejected with [`FreeError::StaleGeneration`].
    pub stale_frees: u64,
    /// Frees rejected with [`FreeError::DoubleFree`].
    pub double_frees: u64,
    /// Frees rejected with [`FreeError::ForeignPage`].
    pub foreign_frees: u64,
}

/// The lock-free page allocator of one region. See the module docs for the
/// exclusivity guarantee and the structure.
pub struct PageAllocator {
    shared: Arc<Shared>,
}

impl fmt::Debug for PageAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageAllocator")
            .field("page_count", &self.shared.page_count)
            .field("magazine_pages", &self.shared.magazine_pages)
            .field("free_pages", &self.free_pages())
            .finish()
    }
}

/// The shared free stack: head word and the number of pages on it.
struct Stack {
    /// `tag << INDEX_BITS | top page`, `NIL` when empty.
    head: AtomicU64,
    /// Pages on the stack, updated after each successful push or pop (so it
    /// can be transiently off by one batch, even below zero). Kept only when
    /// magazines are on, where transfers are batched and the counter costs one
    /// RMW per batch; without magazines every pop and push would pay for it,
    /// so `free_pages` counts page states instead (such allocators are small
    /// by default).
    len: AtomicI64,
}

/// A thread's cache of free pages. Only the owning slot's thread writes it.
struct Magazine {
    len: AtomicU32,
    pages: [AtomicU32; MAX_MAGAZINE_PAGES as usize],
}

impl Magazine {
    fn new() -> Self {
        Self {
            len: AtomicU32::new(0),
            pages: std::array::from_fn(|_| AtomicU32::new(NIL)),
        }
    }
}

struct Counters {
    stale_frees: AtomicU64,
    double_frees: AtomicU64,
    foreign_frees: AtomicU64,
}

struct Shared {
    page_count: u32,
    /// Magazine capacity; 0 means magazines are off and `magazines` is empty.
    magazine_pages: u32,
    stack: CachePadded<Stack>,
    /// Per page: `state(generation, allocated)`.
    states: Box<[AtomicU64]>,
    /// Per page: the next page on the shared stack (meaningful only while the
    /// page is on it). Always a page index or `NIL`.
    next: Box<[AtomicU32]>,
    /// One per thread slot, or none.
    magazines: Box<[CachePadded<Magazine>]>,
    counters: CachePadded<Counters>,
}

impl PageAllocator {
    /// An allocator for `page_count` pages, all free, with default options.
    pub fn new(page_count: u32) -> Result<Self, AllocatorError> {
        Self::with_options(page_count, AllocatorOptions::default())
    }

    /// An allocator for `page_count` pages, all free.
    pub fn with_options(
        page_count: u32,
        options: AllocatorOptions,
    ) -> Result<Self, AllocatorError> {
        if page_count == 0 {
            return Err(AllocatorError::NoPages);
        }
        if page_count > MAX_PAGES {
            return Err(AllocatorError::TooManyPages {
                page_count,
                max: MAX_PAGES,
            });
        }
        let magazine_pages = options
            .magazine_pages
            .unwrap_or_else(|| default_magazine_pages(page_count));
        if magazine_pages > MAX_MAGAZINE_PAGES {
            return Err(AllocatorError::MagazineTooLarge {
                magazine_pages,
                max: MAX_MAGAZINE_PAGES,
            });
        }
        let initial = options
            .initial_generation
            .unwrap_or_else(seeded_initial_generation);
        let states = (0..page_count)
            .map(|_| AtomicU64::new(state(initial.0, false)))
            .collect();
        // Initially the stack holds 0, 1, 2, ... in order, so fresh pages are
        // handed out from the start of the region.
        let next = (0..page_count)
            .map(|page| AtomicU32::new(if page + 1 < page_count { page + 1 } else { NIL }))
            .collect();
        let magazines = if magazine_pages == 0 {
            Box::default()
        } else {
            (0..MAX_THREAD_SLOTS)
                .map(|_| CachePadded::new(Magazine::new()))
                .collect()
        };
        let shared = Arc::new(Shared {
            page_count,
            magazine_pages,
            stack: CachePadded::new(Stack {
                // Tag 0, page 0 on top.
                head: AtomicU64::new(0),
                len: AtomicI64::new(i64::from(page_count)),
            }),
            states,
            next,
            magazines,
            counters: CachePadded::new(Counters {
                stale_frees: AtomicU64::new(0),
                double_frees: AtomicU64::new(0),
                foreign_frees: AtomicU64::new(0),
            }),
        });
        if magazine_pages > 0 {
            slots::register(&shared);
        }
        Ok(Self { shared })
    }

    /// Pages in the region.
    pub fn page_count(&self) -> u32 {
        self.shared.page_count
    }

    /// Magazine capacity per thread (0: magazines off).
    pub fn magazine_pages(&self) -> u32 {
        self.shared.magazine_pages
    }

    /// Takes a free page and bumps its generation; `None` when no free page is
    /// reachable from this thread (see the module docs on magazines).
    #[inline]
    pub fn alloc(&self) -> Option<(PageIndex, Generation)> {
        let shared = &*self.shared;
        // Fast path, inlined into the caller: a non-empty magazine.
        if let Some(magazine) = shared.my_magazine() {
            // Relaxed: only this thread writes its magazine (see `Magazine`).
            let len = magazine.len.load(Relaxed);
            if len > 0 {
                let page = magazine.pages[len as usize - 1].load(Relaxed);
                magazine.len.store(len - 1, Relaxed);
                return Some(shared.hand_out(page));
            }
        }
        shared.alloc_slow()
    }

    /// Fills `out` with freshly allocated pages, all or none. On
    /// [`AllocManyError::Exhausted`] every page taken was freed again before
    /// the error returns; `out[..obtained]` still names those grants (now
    /// stale: each page's generation was bumped by the attempt) and the rest
    /// of `out` is untouched. While a failing batch holds its pages, other
    /// threads may see the region as fuller than it is.
    pub fn alloc_many(&self, out: &mut [(PageIndex, Generation)]) -> Result<(), AllocManyError> {
        let requested = out.len();
        if requested > self.shared.page_count as usize {
            return Err(AllocManyError::LargerThanRegion {
                requested,
                page_count: self.shared.page_count,
            });
        }
        for obtained in 0..requested {
            match self.alloc() {
                Some(grant) => out[obtained] = grant,
                None => {
                    for &(page, generation) in &out[..obtained] {
                        // Cannot fail: these grants were just issued to us and
                        // not handed to anyone (a free that forged one of them
                        // would already have put the page back).
                        let _ = self.free(page, generation);
                    }
                    return Err(AllocManyError::Exhausted {
                        requested,
                        obtained,
                    });
                }
            }
        }
        Ok(())
    }

    /// Returns `page` if `generation` is its current, allocated generation;
    /// otherwise rejects the free (and counts it) without changing anything.
    #[inline]
    pub fn free(&self, page: PageIndex, generation: Generation) -> Result<(), FreeError> {
        let shared = &*self.shared;
        let Some(word) = shared.states.get(page.0 as usize) else {
            return Err(shared.reject_foreign(page));
        };
        // Relaxed: the CAS only arbitrates between frees (its atomicity alone
        // decides which one wins). Ordering the page's bytes before its next
        // holder is the free lists' job: the page goes to this thread's
        // magazine (program order) or onto the shared stack with a Release
        // CAS, and leaves it only through an Acquire load of the head.
        if let Err(actual) = word.compare_exchange(
            state(generation.0, true),
            state(generation.0, false),
            Relaxed,
            Relaxed,
        ) {
            return Err(shared.reject(page, generation, actual));
        }
        // Fast path, inlined into the caller: room in the magazine.
        if let Some(magazine) = shared.my_magazine() {
            // Relaxed: only this thread writes its magazine (see `Magazine`).
            let len = magazine.len.load(Relaxed);
            if len < shared.magazine_pages {
                magazine.pages[len as usize].store(page.0, Relaxed);
                magazine.len.store(len + 1, Relaxed);
                return Ok(());
            }
        }
        shared.release_slow(page.0);
        Ok(())
    }

    /// True if `(page, generation)` names a live allocation right now. A
    /// snapshot: another thread may free it the next moment.
    pub fn is_allocated(&self, page: PageIndex, generation: Generation) -> bool {
        self.shared
            .states
            .get(page.0 as usize)
            // Relaxed: advisory; callers that need an ordering get it from
            // however they learned of the grant.
            .is_some_and(|word| word.load(Relaxed) == state(generation.0, true))
    }

    /// Moves the calling thread's magazine of this allocator onto the shared
    /// stack, so other threads can allocate those pages.
    pub fn flush_local(&self) {
        if let Some(magazine) = self.shared.my_magazine() {
            self.shared.magazine_flush(magazine);
        }
    }

    /// Free pages, counting those cached in magazines. Exact when no alloc or
    /// free is in flight (e.g. after the threads that used the allocator were
    /// joined); a snapshot otherwise.
    ///
    /// Cost: a read of one counter per thread slot, or, with magazines off, a
    /// scan of the page states (O(page_count)).
    pub fn free_pages(&self) -> u32 {
        let shared = &*self.shared;
        // Relaxed throughout: a statistic assembled from independent words.
        if shared.magazines.is_empty() {
            let free = shared
                .states
                .iter()
                .filter(|word| word.load(Relaxed) & ALLOCATED == 0)
                .count();
            return free as u32;
        }
        let cached: i64 = shared
            .magazines
            .iter()
            .map(|magazine| i64::from(magazine.len.load(Relaxed)))
            .sum();
        let total = shared.stack.len.load(Relaxed) + cached;
        total.clamp(0, i64::from(shared.page_count)) as u32
    }

    /// Counters and free pages (see [`AllocatorStats`]).
    pub fn stats(&self) -> AllocatorStats {
        let counters = &self.shared.counters;
        // Relaxed: statistics.
        AllocatorStats {
            page_count: self.shared.page_count,
            free_pages: self.free_pages(),
            stale_frees: counters.stale_frees.load(Relaxed),
            double_frees: counters.double_frees.load(Relaxed),
            foreign_frees: counters.foreign_frees.load(Relaxed),
        }
    }
}

/// Default magazine size: at most 1/128 of the region per thread, so cached
/// pages stay a small share of it; off when that would be under 4 pages.
fn default_magazine_pages(page_count: u32) -> u32 {
    let pages = (page_count / 128).min(MAX_MAGAZINE_PAGES);
    if pages < 4 { 0 } else { pages }
}

/// A pseudo-random starting generation per allocator (splitmix64 of a
/// process-wide counter), so that generations of different regions rarely
/// coincide and a misrouted free fails the generation check.
fn seeded_initial_generation() -> Generation {
    // Outside the loom models on purpose: a plain counter with no ordering
    // role (loom models pass an explicit initial generation).
    static NEXT_SEED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut z = NEXT_SEED
        .fetch_add(1, Relaxed)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Generation((z ^ (z >> 31)) as u32)
}

impl Shared {
    /// This thread's magazine, if magazines are on and the thread has a slot.
    #[inline]
    fn my_magazine(&self) -> Option<&Magazine> {
        if self.magazines.is_empty() {
            return None;
        }
        slots::current().map(|slot| &*self.magazines[slot])
    }

    /// `alloc` when the magazine is empty or absent.
    #[cold]
    #[inline(never)]
    fn alloc_slow(&self) -> Option<(PageIndex, Generation)> {
        let page = match self.my_magazine() {
            Some(magazine) => self.magazine_pop(magazine)?,
            None => self.stack_pop_one()?,
        };
        Some(self.hand_out(page))
    }

    /// `free`'s last step when the magazine is full or absent.
    #[cold]
    #[inline(never)]
    fn release_slow(&self, page: u32) {
        match self.my_magazine() {
            Some(magazine) => self.magazine_push(magazine, page),
            None => self.stack_push_chain(page, page, 1),
        }
    }

    #[cold]
    #[inline(never)]
    fn reject_foreign(&self, page: PageIndex) -> FreeError {
        // Relaxed: a statistic; nothing is ordered by it.
        self.counters.foreign_frees.fetch_add(1, Relaxed);
        FreeError::ForeignPage {
            page,
            page_count: self.page_count,
        }
    }

    /// Classifies a free whose CAS found `actual` instead of `(generation,
    /// allocated)`, and counts it.
    #[cold]
    #[inline(never)]
    fn reject(&self, page: PageIndex, generation: Generation, actual: u64) -> FreeError {
        // Relaxed: statistics; nothing is ordered by them.
        if state_generation(actual) == generation.0 {
            // Same generation and not allocated (else the CAS had won).
            self.counters.double_frees.fetch_add(1, Relaxed);
            FreeError::DoubleFree { page, generation }
        } else {
            self.counters.stale_frees.fetch_add(1, Relaxed);
            FreeError::StaleGeneration {
                page,
                given: generation,
                current: Generation(state_generation(actual)),
            }
        }
    }

    /// Marks `page`, just taken exclusively from a free list, allocated at its
    /// next generation.
    #[inline]
    fn hand_out(&self, page: u32) -> (PageIndex, Generation) {
        let word = &self.states[page as usize];
        // Relaxed load and store, no RMW: while a page is free its state is
        // only ever changed by the thread that took it off a free list — us
        // (`free`'s CAS expects `allocated` and fails on a free page). The last
        // write, the freeing CAS, happens-before this through the free list
        // (same thread via a magazine, or the stack's Release/Acquire). Others
        // learn the new generation only from our return value, through their
        // own synchronisation, so they see this store.
        let current = word.load(Relaxed);
        debug_assert_eq!(
            current & ALLOCATED,
            0,
            "free list held allocated page {page}"
        );
        let generation = next_generation(state_generation(current));
        word.store(state(generation, true), Relaxed);
        (PageIndex(page), Generation(generation))
    }

    /// Pops one page from this thread's magazine, refilling it from the
    /// shared stack when empty.
    fn magazine_pop(&self, magazine: &Magazine) -> Option<u32> {
        // Relaxed on the magazine: only this thread writes it; other threads
        // read `len` for statistics only.
        let mut len = magazine.len.load(Relaxed);
        if len == 0 {
            let refill = (self.magazine_pages / 2).max(1);
            len = self.stack_pop_chain(refill, |i, page| magazine.pages[i].store(page, Relaxed));
            if len == 0 {
                return None;
            }
        }
        len -= 1;
        let page = magazine.pages[len as usize].load(Relaxed);
        magazine.len.store(len, Relaxed);
        Some(page)
    }

    /// Pushes a freed page onto this thread's magazine, spilling the older
    /// half onto the shared stack when it is full.
    fn magazine_push(&self, magazine: &Magazine, page: u32) {
        // Relaxed on the magazine: see `magazine_pop`.
        let mut len = magazine.len.load(Relaxed);
        if len == self.magazine_pages {
            let spill = (self.magazine_pages / 2).max(1);
            self.push_magazine_prefix(magazine, spill);
            for i in spill..len {
                let kept = magazine.pages[i as usize].load(Relaxed);
                magazine.pages[(i - spill) as usize].store(kept, Relaxed);
            }
            len -= spill;
        }
        magazine.pages[len as usize].store(page, Relaxed);
        magazine.len.store(len + 1, Relaxed);
    }

    /// Moves the whole magazine onto the shared stack. Called by the owning
    /// thread, or by its exit destructor (then the slot is not yet released,
    /// so no other thread can own it).
    fn magazine_flush(&self, magazine: &Magazine) {
        // Relaxed: owner-only data, as in `magazine_pop`.
        let len = magazine.len.load(Relaxed);
        if len > 0 {
            self.push_magazine_prefix(magazine, len);
            magazine.len.store(0, Relaxed);
        }
    }

    /// Links `magazine.pages[..count]` into a chain and pushes it.
    fn push_magazine_prefix(&self, magazine: &Magazine, count: u32) {
        debug_assert!(count >= 1);
        // Relaxed loads of our own magazine; Relaxed stores of the links: the
        // pages are ours until the push, whose Release CAS publishes them.
        let first = magazine.pages[0].load(Relaxed);
        let mut last = first;
        for i in 1..count {
            let page = magazine.pages[i as usize].load(Relaxed);
            self.next[last as usize].store(page, Relaxed);
            last = page;
        }
        self.stack_push_chain(first, last, count);
    }

    fn stack_pop_one(&self) -> Option<u32> {
        let mut taken = NIL;
        (self.stack_pop_chain(1, |_, page| taken = page) == 1).then_some(taken)
    }

    /// Pops up to `max` pages in one CAS, reporting each as `(i, page)` to
    /// `record`; returns how many were popped. `record` may also see pages of
    /// failed attempts: only the first `returned` reports of the last attempt
    /// (which overwrite earlier ones at the same `i`) count.
    fn stack_pop_chain(&self, max: u32, mut record: impl FnMut(usize, u32)) -> u32 {
        debug_assert!(max >= 1);
        // Acquire: pairs with the Release CAS of every push (all head updates
        // are RMWs, so they continue each push's release sequence), making the
        // links and page states written before those pushes visible.
        let mut head = self.stack.head.load(Acquire);
        loop {
            let first = head_index(head);
            if first == NIL {
                return 0;
            }
            // The walk may read links that a concurrent pop-and-push is
            // rewriting; every value ever stored in `next` is a page index or
            // NIL, so the walk stays in bounds, and it is bounded by `max`.
            // If anything moved, the head's tag changed and the CAS fails.
            // Relaxed link loads: visible through the Acquire on `head`.
            record(0, first);
            let mut count = 1;
            let mut rest = self.next[first as usize].load(Relaxed);
            while count < max && rest != NIL {
                record(count as usize, rest);
                count += 1;
                rest = self.next[rest as usize].load(Relaxed);
            }
            // Acquire on success, for the same reason as the load above; on
            // failure the retry uses the returned head, which must be Acquire
            // too because the loop reads links through it.
            match self.stack.head.compare_exchange_weak(
                head,
                bumped_head(head, rest),
                Acquire,
                Acquire,
            ) {
                Ok(_) => {
                    if !self.magazines.is_empty() {
                        // Relaxed: a statistic (see `Stack::len`).
                        self.stack.len.fetch_sub(i64::from(count), Relaxed);
                    }
                    return count;
                }
                Err(actual) => head = actual,
            }
        }
    }

    /// Pushes the chain `first ..= last` (already linked through `next`, `count`
    /// pages) in one CAS.
    fn stack_push_chain(&self, first: u32, last: u32, count: u32) {
        // Relaxed: we only need a guess of the top to link to; a stale guess
        // fails the CAS.
        let mut head = self.stack.head.load(Relaxed);
        loop {
            // Relaxed: published by the Release CAS below.
            self.next[last as usize].store(head_index(head), Relaxed);
            // Release: the links, the pages' free states and the previous
            // holders' writes to the pages happen-before any pop that sees
            // this head. Relaxed on failure: nothing is read through it.
            match self.stack.head.compare_exchange_weak(
                head,
                bumped_head(head, first),
                Release,
                Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => head = actual,
            }
        }
        if !self.magazines.is_empty() {
            // Relaxed: a statistic (see `Stack::len`).
            self.stack.len.fetch_add(i64::from(count), Relaxed);
        }
    }
}

/// Process-wide magazine bookkeeping: which thread owns which slot, and which
/// allocators have magazines to flush when a thread exits.
///
/// Deliberately outside the loom models (plain `std`): loom models run with
/// magazines off. Slot exclusivity rests on this mutex alone: a slot index is
/// handed to one thread at a time and released only after that thread has
/// spilled its magazine of every live allocator.
mod slots {
    use std::cell::Cell;
    use std::sync::{Arc, Mutex, PoisonError, Weak};

    use super::{MAX_THREAD_SLOTS, Shared};

    /// `SLOT` before the thread's first use.
    const UNCLAIMED: usize = usize::MAX;
    /// `SLOT` of a thread without a magazine: all slots were taken, or its
    /// destructors are running.
    const NO_SLOT: usize = usize::MAX - 1;

    struct Registry {
        /// Allocators with magazines; dead entries are pruned on registration.
        allocators: Vec<Weak<Shared>>,
        /// Slots released by exited threads.
        released: Vec<usize>,
        /// Slots `next_unused..MAX_THREAD_SLOTS` were never handed out.
        next_unused: usize,
    }

    static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
        allocators: Vec::new(),
        released: Vec::new(),
        next_unused: 0,
    });

    fn registry() -> std::sync::MutexGuard<'static, Registry> {
        // Nothing panics while holding the lock except allocation failure,
        // which aborts; the data stays consistent either way.
        REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A thread's claim on a slot; released (after spilling) when the thread
    /// exits.
    struct Claim {
        index: Option<usize>,
    }

    impl Drop for Claim {
        fn drop(&mut self) {
            // From here on this thread allocates from the shared stacks only
            // (other destructors may still call alloc or free).
            SLOT.set(NO_SLOT);
            let Some(index) = self.index else { return };
            let mut registry = registry();
            for allocator in &registry.allocators {
                if let Some(shared) = allocator.upgrade() {
                    shared.magazine_flush(&shared.magazines[index]);
                }
            }
            registry.released.push(index);
        }
    }

    thread_local! {
        /// The slot index, cached without a destructor so that reading it is
        /// a plain thread-local load on the hot path.
        static SLOT: Cell<usize> = const { Cell::new(UNCLAIMED) };
        /// Owns the claim; its destructor flushes and releases the slot.
        static CLAIM: Claim = Claim::new();
    }

    impl Claim {
        fn new() -> Self {
            let mut registry = registry();
            let index = registry.released.pop().or_else(|| {
                (registry.next_unused < MAX_THREAD_SLOTS).then(|| {
                    registry.next_unused += 1;
                    registry.next_unused - 1
                })
            });
            Self { index }
        }
    }

    /// The calling thread's slot; `None` beyond `MAX_THREAD_SLOTS` threads
    /// or once the thread's destructors run.
    #[inline]
    pub(super) fn current() -> Option<usize> {
        match SLOT.get() {
            index if index < MAX_THREAD_SLOTS => Some(index),
            UNCLAIMED => claim(),
            _ => None,
        }
    }

    #[cold]
    #[inline(never)]
    fn claim() -> Option<usize> {
        // `try_with` fails once the thread's destructors have started; the
        // thread then never gets a slot.
        let index = CLAIM.try_with(|claim| claim.index).ok().flatten();
        SLOT.set(index.unwrap_or(NO_SLOT));
        index
    }

    /// Makes exiting threads flush their magazines of `shared`.
    pub(super) fn register(shared: &Arc<Shared>) {
        let mut registry = registry();
        registry
            .allocators
            .retain(|allocator| allocator.strong_count() > 0);
        registry.allocators.push(Arc::downgrade(shared));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashSet;
    use std::sync::Barrier;

    use super::*;

    fn options(magazine_pages: u32) -> AllocatorOptions {
        AllocatorOptions::default()
            .magazine_pages(magazine_pages)
            .initial_generation(Generation(0))
    }

    #[test]
    fn every_page_is_handed_out_once_then_alloc_reports_exhaustion() {
        for magazine_pages in [0, 1, 4, MAX_MAGAZINE_PAGES] {
            let allocator = PageAllocator::with_options(10, options(magazine_pages)).unwrap();
            let pages: HashSet<u32> = (0..10)
                .map(|_| allocator.alloc().expect("a free page").0.0)
                .collect();
            assert_eq!(pages, (0..10).collect(), "magazine {magazine_pages}");
            assert_eq!(allocator.alloc(), None);
            assert_eq!(allocator.free_pages(), 0);
        }
    }

    #[test]
    fn every_allocation_bumps_the_page_generation() {
        let allocator = PageAllocator::with_options(1, options(0)).unwrap();
        for expected in 1..=5 {
            let (page, generation) = allocator.alloc().unwrap();
            assert_eq!((page, generation), (PageIndex(0), Generation(expected)));
            allocator.free(page, generation).unwrap();
        }
    }

    #[test]
    fn generation_wraps_from_u32_max_to_one_and_old_frees_stay_stale() {
        let options = options(0).initial_generation(Generation(u32::MAX - 1));
        let allocator = PageAllocator::with_options(1, options).unwrap();
        let (page, last) = allocator.alloc().unwrap();
        assert_eq!(last, Generation(u32::MAX));
        allocator.free(page, last).unwrap();
        let (_, wrapped) = allocator.alloc().unwrap();
        assert_eq!(wrapped, Generation(1), "0 is never issued");
        assert_eq!(
            allocator.free(page, last),
            Err(FreeError::StaleGeneration {
                page,
                given: last,
                current: wrapped
            })
        );
        allocator.free(page, wrapped).unwrap();
    }

    #[test]
    fn generation_zero_is_skipped_when_the_initial_generation_is_u32_max() {
        let options = options(0).initial_generation(Generation(u32::MAX));
        let allocator = PageAllocator::with_options(1, options).unwrap();
        assert_eq!(allocator.alloc().unwrap().1, Generation(1));
    }

    #[test]
    fn rejected_frees_are_classified_counted_and_change_nothing() {
        for magazine_pages in [0, 4] {
            let allocator = PageAllocator::with_options(4, options(magazine_pages)).unwrap();
            let (page, first) = allocator.alloc().unwrap();
            allocator.free(page, first).unwrap();
            // The page is free at `first`: freeing it again is a double free.
            assert_eq!(
                allocator.free(page, first),
                Err(FreeError::DoubleFree {
                    page,
                    generation: first
                })
            );
            let (again, second) = allocator.alloc().unwrap();
            assert_eq!(again, page, "LIFO: the page just freed comes back first");
            // Now `first` is stale: the page was reallocated at `second`.
            assert_eq!(
                allocator.free(page, first),
                Err(FreeError::StaleGeneration {
                    page,
                    given: first,
                    current: second
                })
            );
            assert_eq!(
                allocator.free(PageIndex(4), second),
                Err(FreeError::ForeignPage {
                    page: PageIndex(4),
                    page_count: 4
                })
            );
            assert_eq!(
                allocator.free(PageIndex(u32::MAX), second),
                Err(FreeError::ForeignPage {
                    page: PageIndex(u32::MAX),
                    page_count: 4
                })
            );
            assert!(
                allocator.is_allocated(page, second),
                "rejections left it allocated"
            );
            let stats = allocator.stats();
            assert_eq!(
                (stats.double_frees, stats.stale_frees, stats.foreign_frees),
                (1, 1, 2)
            );
            assert_eq!(stats.free_pages, 3);
            allocator.free(page, second).unwrap();
            assert!(!allocator.is_allocated(page, second));
            assert_eq!(allocator.free_pages(), 4);
        }
    }

    #[test]
    fn alloc_many_is_all_or_nothing_and_names_what_it_gave_back() {
        let allocator = PageAllocator::with_options(8, options(4)).unwrap();
        let held: Vec<_> = (0..3).map(|_| allocator.alloc().unwrap()).collect();
        let mut batch = [(PageIndex(0), Generation(0)); 6];
        assert_eq!(
            allocator.alloc_many(&mut batch),
            Err(AllocManyError::Exhausted {
                requested: 6,
                obtained: 5
            })
        );
        assert_eq!(
            allocator.free_pages(),
            5,
            "the failed batch gave its pages back"
        );
        for &(page, generation) in &batch[..5] {
            assert!(matches!(
                allocator.free(page, generation),
                Err(FreeError::DoubleFree { .. })
            ));
        }
        let mut batch = [(PageIndex(0), Generation(0)); 5];
        allocator.alloc_many(&mut batch).unwrap();
        let pages: HashSet<_> = batch.iter().chain(&held).map(|(page, _)| page.0).collect();
        assert_eq!(pages.len(), 8, "no page handed out twice");
        assert_eq!(allocator.alloc(), None);
        assert_eq!(
            allocator.alloc_many(&mut [(PageIndex(0), Generation(0)); 9]),
            Err(AllocManyError::LargerThanRegion {
                requested: 9,
                page_count: 8
            })
        );
        assert_eq!(allocator.alloc_many(&mut []), Ok(()));
    }

    #[test]
    fn construction_rejects_empty_oversized_and_bad_magazines() {
        assert_eq!(PageAllocator::new(0).unwrap_err(), AllocatorError::NoPages);
        assert_eq!(
            PageAllocator::new(MAX_PAGES + 1).unwrap_err(),
            AllocatorError::TooManyPages {
                page_count: MAX_PAGES + 1,
                max: MAX_PAGES
            }
        );
        assert_eq!(
            PageAllocator::with_options(8, options(MAX_MAGAZINE_PAGES + 1)).unwrap_err(),
            AllocatorError::MagazineTooLarge {
                magazine_pages: MAX_MAGAZINE_PAGES + 1,
                max: MAX_MAGAZINE_PAGES
            }
        );
    }

    #[test]
    fn default_magazine_is_at_most_a_128th_of_the_region() {
        assert_eq!(PageAllocator::new(511).unwrap().magazine_pages(), 0);
        assert_eq!(PageAllocator::new(512).unwrap().magazine_pages(), 4);
        assert_eq!(PageAllocator::new(4096).unwrap().magazine_pages(), 32);
        assert_eq!(PageAllocator::new(1 << 20).unwrap().magazine_pages(), 32);
    }

    #[test]
    fn allocators_start_at_different_generations() {
        let first: HashSet<u32> = (0..16)
            .map(|_| PageAllocator::new(1).unwrap().alloc().unwrap().1.0)
            .collect();
        assert!(first.len() > 1, "seeded starts coincide: {first:?}");
    }

    /// A worker that allocated and freed leaves pages in its magazine; they
    /// are invisible to other threads until the worker exits.
    #[test]
    fn an_exiting_thread_hands_its_magazine_back() {
        let allocator = PageAllocator::with_options(64, options(8)).unwrap();
        let cached = Barrier::new(2);
        let checked = Barrier::new(2);
        std::thread::scope(|scope| {
            let worker = scope.spawn(|| {
                let (page, generation) = allocator.alloc().unwrap();
                allocator.free(page, generation).unwrap();
                cached.wait();
                checked.wait();
            });
            cached.wait();
            let reachable = drain(&allocator);
            assert!(reachable < 64, "the worker's magazine holds pages");
            assert_eq!(allocator.free_pages(), 64, "cached pages count as free");
            checked.wait();
            // An explicit join waits for the thread's exit, destructors
            // included (the scope's implicit join only waits for the closure).
            worker.join().unwrap();
        });
        assert_eq!(
            drain(&allocator),
            64,
            "every page is reachable after the exit"
        );
    }

    #[test]
    fn flush_local_makes_cached_pages_available_to_other_threads() {
        let allocator = PageAllocator::with_options(64, options(8)).unwrap();
        let (page, generation) = allocator.alloc().unwrap();
        allocator.free(page, generation).unwrap();
        let elsewhere = |allocator: &PageAllocator| {
            std::thread::scope(|scope| scope.spawn(|| drain(allocator)).join().unwrap())
        };
        assert!(elsewhere(&allocator) < 64);
        allocator.flush_local();
        assert_eq!(elsewhere(&allocator), 64);
    }

    /// More live threads than slots: the late ones use the shared stack.
    #[test]
    fn threads_beyond_the_slot_limit_allocate_correctly() {
        let threads = MAX_THREAD_SLOTS + 4;
        let allocator = PageAllocator::with_options(4096, options(8)).unwrap();
        let all_holding = Barrier::new(threads);
        let grants: Vec<_> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let grant = allocator.alloc().unwrap();
                        all_holding.wait();
                        grant
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let pages: HashSet<_> = grants.iter().map(|(page, _)| page.0).collect();
        assert_eq!(pages.len(), threads, "no page handed out twice");
        for (page, generation) in grants {
            allocator.free(page, generation).unwrap();
        }
        assert_eq!(drain(&allocator), 4096);
    }

    /// Allocates until exhaustion, frees everything, returns the count.
    fn drain(allocator: &PageAllocator) -> u32 {
        let mut held = Vec::new();
        while let Some(grant) = allocator.alloc() {
            held.push(grant);
        }
        for &(page, generation) in &held {
            allocator.free(page, generation).unwrap();
        }
        held.len() as u32
    }
}

/// Loom models of the shared free stack and the page-state CAS (magazines
/// off: loom threads are coroutines on one OS thread, so the std thread-local
/// slot would be shared between them; the magazine path is owner-only code
/// plus the same stack operations checked here).
///
/// Each page carries a loom-tracked cell that its holder writes: loom reports
/// a causality violation if two threads ever hold one page at once, or if a
/// holder's writes are not ordered before the next holder's (the allocator's
/// memory-ordering promise).
#[cfg(all(test, loom))]
mod loom_models {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::thread;

    use super::*;

    struct Pool {
        allocator: PageAllocator,
        bytes: Vec<UnsafeCell<usize>>,
    }

    impl Pool {
        fn new(page_count: u32) -> Arc<Self> {
            let options = AllocatorOptions::default()
                .magazine_pages(0)
                .initial_generation(Generation(0));
            Arc::new(Self {
                allocator: PageAllocator::with_options(page_count, options).unwrap(),
                bytes: (0..page_count).map(|_| UnsafeCell::new(0)).collect(),
            })
        }

        /// Allocates, writes `me` into the page and checks it reads back.
        fn take(&self, me: usize) -> Option<(PageIndex, Generation)> {
            let grant = self.allocator.alloc()?;
            let cell = &self.bytes[grant.0.0 as usize];
            // SAFETY: loom's tracked cell; loom itself reports overlapping
            // access, which is what this model checks for.
            cell.with_mut(|bytes| unsafe { *bytes = me });
            // SAFETY: as above.
            assert_eq!(cell.with(|bytes| unsafe { *bytes }), me);
            Some(grant)
        }

        /// Every page can be allocated once more and nothing is held.
        fn assert_all_free(&self) {
            let page_count = self.allocator.page_count();
            assert_eq!(self.allocator.free_pages(), page_count);
            let mut seen = vec![false; page_count as usize];
            while let Some((page, _)) = self.allocator.alloc() {
                assert!(!std::mem::replace(&mut seen[page.0 as usize], true));
            }
            assert!(seen.iter().all(|&s| s), "a page was lost");
        }
    }

    #[test]
    fn loom_concurrent_alloc_and_free_never_share_a_page() {
        loom::model(|| {
            let pool = Pool::new(2);
            let threads: Vec<_> = (1..=2)
                .map(|me| {
                    let pool = Arc::clone(&pool);
                    thread::spawn(move || {
                        for _ in 0..2 {
                            if let Some((page, generation)) = pool.take(me) {
                                pool.allocator.free(page, generation).unwrap();
                            }
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
            pool.assert_all_free();
        });
    }

    /// The ABA case of an untagged Treiber stack: A reads top 0 and its link
    /// 1, is preempted; B pops 0, pops 1, pushes 0 back. The top is 0 again,
    /// but its link is now 2; without the tag A's CAS would succeed and set
    /// the top to page 1, which B holds. With the tag it fails and retries.
    #[test]
    fn loom_aba_on_the_stack_head_is_defeated_by_the_tag() {
        loom::model(|| {
            let pool = Pool::new(3);
            let a = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || pool.take(1))
            };
            let b = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let x = pool.take(2);
                    let y = pool.take(2);
                    if let Some((page, generation)) = x {
                        pool.allocator.free(page, generation).unwrap();
                    }
                    y
                })
            };
            let held = [a.join().unwrap(), b.join().unwrap()];
            for (page, generation) in held.into_iter().flatten() {
                pool.allocator.free(page, generation).unwrap();
            }
            pool.assert_all_free();
        });
    }

    /// Two frees of one grant race (a re-sent freed-page notice), while the
    /// winner may already reallocate the page: exactly one free succeeds, the
    /// other is refused as a double or stale free, and counted.
    #[test]
    fn loom_racing_frees_of_one_grant_succeed_exactly_once() {
        loom::model(|| {
            let pool = Pool::new(1);
            let (page, first) = pool.take(0).unwrap();
            let racers: Vec<_> = (1..=2)
                .map(|me| {
                    let pool = Arc::clone(&pool);
                    thread::spawn(move || {
                        let freed = pool.allocator.free(page, first);
                        if freed.is_ok()
                            && let Some((again, second)) = pool.take(me)
                        {
                            assert_eq!((again, second), (page, Generation(2)));
                            pool.allocator.free(again, second).unwrap();
                        }
                        freed
                    })
                })
                .collect();
            let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
            assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
            for result in results.into_iter().filter_map(Result::err) {
                assert!(
                    matches!(
                        result,
                        FreeError::DoubleFree { .. } | FreeError::StaleGeneration { .. }
                    ),
                    "{result:?}"
                );
            }
            let stats = pool.allocator.stats();
            assert_eq!(stats.double_frees + stats.stale_frees, 1);
            pool.assert_all_free();
        });
    }
}
