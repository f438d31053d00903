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
//! # The guarantees
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
//! **No false exhaustion.** `alloc` returns `None` only after it has looked
//! at every place a free page can be: its own magazine, the shared stack, and
//! every other thread's magazine (see *Stealing*). When every other thread's
//! last alloc, free or flush happens-before this `alloc` — they parked on a
//! barrier or a channel, or were joined — `None` therefore means every page
//! is allocated. Under concurrent traffic it is a best effort: a page can be
//! missed while it moves during the look — spilled from a magazine already
//! passed onto the stack already checked, or shifted down within a magazine
//! by the spill's compaction between two reads of the scan (the loom model
//! `loom_a_spill_racing_a_steal_moves_every_page_exactly_once` finds such an
//! interleaving) — or while a concurrent free is not yet visible. The look is
//! repeated once ([`EXHAUSTION_ROUNDS`]); a caller that must not fail
//! spuriously retries after synchronising with the other threads, or treats
//! `None` as "expand the region", which is what the client does.
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
//! - **Page states**, one `AtomicU64` per page: the generation, and where the
//!   page is — allocated (with asymmetric fences: by thread slot `s`, or by a
//!   thread without one), on the shared stack, or cached in the magazine of
//!   slot `s`. This word is the ground truth. Every transition that two
//!   threads could attempt at once is decided on it: `free` moves
//!   `(g, allocated by s)` to `(g, free)`, so two racing frees of one
//!   allocation cannot both win; taking a page out of a magazine — by its
//!   owner or by a thief — moves `(g, cached by s)` to `(g + 1, allocated)`, so the owner
//!   and a thief cannot both win either. These moves are compare-and-swaps —
//!   except, in the opt-in mode of *The owner's fast path*, the slot's own
//!   thread's, which are plain loads and stores made sound by a handshake. A
//!   page popped off the shared stack is held exclusively by the popper and
//!   changes state with a plain store.
//! - **A shared free list**: an index-linked Treiber stack (`next[page]`
//!   links) with a 64-bit head of 24 bits of top index and a 40-bit ABA tag
//!   bumped by every push and pop. Pops and pushes move whole chains, so a
//!   magazine refill or spill costs one CAS. The tag makes ABA need 2^40 head
//!   changes during one preempted CAS window (hours of continuous
//!   allocation), hence the 24-bit index limit, [`MAX_PAGES`]. A page is on
//!   the stack at most once: it gets there only from the allocated state (a
//!   free without a magazine) or from a cached state (a spill, by CAS), and
//!   leaves only by a pop.
//! - **Per-thread magazines**: a thread that allocates or frees gets a slot
//!   (one of [`MAX_THREAD_SLOTS`], process-wide); each allocator holds one
//!   magazine (a small array of `(page, generation)` entries) per slot, whose
//!   array and length only the slot's owner writes, with plain loads and
//!   stores (the length stores Release, for thieves). An entry is a claim to
//!   check, not a page owned: the page state decides (see *Stealing*). In
//!   steady state an alloc+free pair is a thread-local load (the slot index),
//!   the magazine accesses and two uncontended CAS on a page-state word the
//!   thread has in its cache (alloc's and free's; plain loads and stores
//!   instead with asymmetric fences), against four locked instructions for a
//!   `Mutex<Vec<u32>>` free list (lock and unlock around each of alloc and
//!   free) and three for the Treiber stack alone (pop, state CAS, push), all
//!   on lines every thread writes. An empty magazine refills half its
//!   capacity from the shared stack in one CAS; a full one spills its older
//!   half in one CAS (plus one CAS per spilled page state). The fast paths of
//!   `alloc` and `free` inline into the caller; everything else is out of
//!   line and marked cold.
//!
//! Measured cost: see `docs/architecture.md` (allocator paragraph), which has
//! the numbers, the command and the instruction-level floor.
//!
//! A bitmap allocator was not chosen: finding a free bit needs a scan and a
//! RMW per alloc and per free, and it cannot hand out pages in LIFO order
//! (the most recently freed, cache-warm page first).
//!
//! # The owner's fast path: asymmetric fences (opt-in)
//!
//! A locked instruction costs ~11 ns on the machine this was measured on
//! (≈ 25 cycles, a full barrier that drains the store buffer), more than
//! everything else in an alloc+free pair together. Two of them per pair
//! (alloc's take and free's release, both racing other threads) put a pair at
//! ~23 ns. They are there for rare events — a thief emptying a magazine when
//! the region looks exhausted, a free of a page another thread allocated (a
//! freed-page notice applied on another thread, or a duplicate of one). With
//! [`AllocatorOptions::asymmetric_fences`] the cost moves onto those events,
//! with the pattern of `membarrier(2)` (liburcu's `urcu-memb`, folly's
//! asymmetric barriers; see `sync::asymmetric` in this crate's source). It is off
//! by default because the rare events then make a system call, and the
//! default promises that `alloc` and `free` never do:
//!
//! - The **owner** of slot `s` changes a page state that names `s` with a
//!   plain load, compare and store, bracketed like this: a take first removes
//!   the entry from the magazine (a store of the length); a free first stores
//!   its intent, `free_intent(page, g)`, in the magazine's `busy` word. Then
//!   a compiler fence (`light`), then a load of the magazine's `remote`
//!   count. If it is zero, the plain load and store; otherwise a CAS, as
//!   before. A free then stores `busy = IDLE`.
//! - A **remote** — a thief scanning `s`'s magazine, or a free of a page
//!   allocated by `s` on another thread — first adds one to `s`'s `remote`,
//!   then runs the heavy barrier (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`),
//!   then reads the owner's side: a thief reads the magazine length and
//!   entries, a remote free reads `busy`. It changes the page state by CAS
//!   only, and takes its one off `remote` (Release) afterwards.
//!
//! The heavy barrier turns every `light` into a full fence with respect to
//! it, so the store-then-load pairs cannot both miss: for any owner
//! operation, either the owner sees `remote > 0` and uses a CAS — CAS
//! against CAS is safe — or the remote sees the owner's store (or a later
//! one). A thief that sees the shorter length never considers the page being
//! taken. A thief that sees a later length — a free that reused the index
//! after the take finished — sees the take's state store too, because the
//! owner stores lengths with Release and the thief loads them with Acquire;
//! its CAS on a stale entry for the taken page then fails. A remote
//! free that sees `busy == free_intent(page, g)` for its own grant knows the
//! owner is freeing the same grant right now and refuses its own free as the
//! double free; a `busy` naming anything else means the owner's in-flight
//! free touches another page, and the owner's later operations see the
//! announcement. A stale intent read after the owner finished is harmless:
//! the grant it names is then free already, so refusing is right. Once a
//! remote has taken its one back, an owner that reads the lower count
//! (Acquire, against the Release decrement) also sees the remote's CAS, so
//! its plain load cannot miss it. The loom models check the handshake, with
//! both fences modelled as `fence(SeqCst)` — which is the ordering
//! `membarrier` provides — and fail when any one of the four fences, the
//! announcement or the intent check is removed; the stress test
//! `an_owners_lock_free_frees_racing_remote_frees_of_the_same_grants_succeed_once_each`
//! fails on real hardware when the remote free's barrier is removed.
//!
//! Measured (`cxlkv bench alloc`, `asymmetric_*` fields against `ours` in the
//! same run): ~6–10 ns per pair against ~21–24 ns; see
//! `docs/architecture.md`. Costs and limits of the trade:
//! - A free of a page another thread allocated costs a `membarrier` call:
//!   ~0.2 µs when no other thread of the process is running, ~3 µs when one
//!   is (an inter-processor interrupt to every CPU running one — which also
//!   disturbs those threads for a moment; measured on a 2-vCPU VM). So does
//!   a steal scan, once per scan. [`AllocatorStats::remote_frees`] counts the
//!   former. The mode suits an embedder whose threads mostly free what they
//!   allocated; the client does not turn it on (its frees of noticed pages
//!   run on whichever thread reads the notice, and its allocations are far
//!   from dominated by the allocator).
//! - Where `membarrier` is missing or forbidden (old kernels, seccomp
//!   profiles), [`PageAllocator::with_options`] finds out once per process
//!   and builds the default, locked allocator instead;
//!   [`PageAllocator::has_asymmetric_fences`] says which one it built.
//! - A child forked after the parent registered for membarrier is
//!   registered again on its first heavy barrier; a transient ENOMEM is
//!   retried. If the call keeps failing after it had worked (a seccomp
//!   filter installed later), the process aborts with a message: going on
//!   could hand one page to two holders.
//! - `busy` and `remote` share the magazine's cache line, which only the
//!   owner writes in steady state; remotes write `remote`, rarely.
//!
//! # Stealing: how a magazine's pages stay reachable
//!
//! A page is always in exactly one place, which its state word names:
//! allocated (its holder has it), the shared stack, or the magazine of one
//! slot. A cached page is free in every sense that matters for validation —
//! a stale or double free naming it is rejected exactly as for a page on the
//! stack — and [`PageAllocator::free_pages`] counts it. When `alloc` finds
//! neither its own magazine nor the shared stack holding a page, it scans the
//! other slots' magazines (bounded: [`MAX_THREAD_SLOTS`] magazines of at most
//! [`MAX_MAGAZINE_PAGES`] entries) and takes a page directly:
//!
//! 1. with asymmetric fences only: announce itself to every slot whose
//!    magazine is not empty and run one heavy barrier (see *The owner's fast
//!    path*);
//! 2. read the victim magazine's length (Acquire) and entries (Relaxed) —
//!    they may be changing under the owner's hands, and may be stale;
//! 3. for an entry `(p, g)` of slot `s`, CAS `p`'s state from
//!    `(g, cached by s)` to `(g + 1, allocated)`. Success means the page was
//!    cached in exactly that magazine at exactly that generation, and is now
//!    the thief's, with no other thread able to take it: the owner's own
//!    alloc — a CAS from the same value, or a plain take of an entry the
//!    thief no longer counts — and its spill CAS fail;
//! 4. count the theft in the victim magazine's `stolen` counter, and take
//!    back any announcements.
//!
//! The owner does not learn of the theft until it reaches the entry: its CAS
//! fails, it drops the entry and takes one off `stolen`. So a magazine holds
//! `len - stolen` live entries (exact whenever no operation on it is in
//! flight), which is what `free_pages` adds up. The thief never writes the
//! owner's array — that would need a locked instruction on every owner
//! operation to arbitrate — it only ever races the owner on the page-state
//! word, which alloc already takes by CAS.
//!
//! Why an entry can be trusted that far: entries are created only by their
//! slot's owner, for a page it has just cached at that generation (after
//! `free`'s CAS, or after popping the page off the stack and storing its
//! cached state), and are removed only by the owner. Once a page leaves the
//! state `(g, cached by s)` — stolen or allocated (its generation moves on),
//! or spilled — it can come back to exactly that state only by being spilled
//! and popped off the stack by `s` again: the spill removed the old entry and
//! the refill writes a fresh one. So a magazine never holds two entries that
//! can both succeed, a successful thief CAS always corresponds to one entry,
//! and the owner finds that entry stale exactly once.
//!
//! Orderings. `free`'s change (plain store or CAS) is Release and a refill's
//! cached-state store is Release; the thief's CAS and the owner's magazine
//! CAS are Acquire. Each of the two takes a value written by one of those two
//! stores (nothing else writes a cached state), so the previous holder's
//! writes to the page — before its free, or before the stack push that the
//! refill's Acquire pop saw — happen-before the new holder's. The owner's
//! plain take needs no Acquire: every writer of "cached by s" is the slot's
//! own thread (or its previous owner, see *Thread slots*). The spill's CAS to the stack state
//! is Relaxed: the stack push's Release CAS publishes it and the links
//! together, as for every page pushed. Entries and `stolen` are read Relaxed
//! by thieves: they only nominate candidates and count; the CAS decides. The
//! length a thief scans by is read Acquire, against the owner's Release
//! length stores: with asymmetric fences a length written after a plain take
//! must bring that take's state store with it (see `steal`).
//!
//! # Thread slots, and thread exit
//!
//! A thread claims a slot on its first alloc or free on any allocator with
//! magazines: one lock-free `fetch_or` on a process-wide 64-bit mask (bounded
//! to [`MAX_SLOT_CLAIM_ATTEMPTS`] lost races, then the thread goes without a
//! magazine). A thread-local destructor releases the slot when the thread
//! exits (`fetch_and`, Release; the next claimer's `fetch_or` is Acquire, so
//! it sees the magazines as the previous owner left them). Magazines are not
//! flushed on exit: their pages stay cached under the slot, reachable by any
//! thread through stealing, and the slot's next owner adopts them as its own
//! (the states say "cached by this slot", which is now the new thread). No
//! page is lost, and no registry of live allocators — and no lock — is
//! needed. A thread that goes idle can still hand its pages to the fast
//! shared stack with [`PageAllocator::flush_local`]. Dropping an allocator
//! drops its magazines with it: the region's pages are gone with the
//! allocator. Threads beyond [`MAX_THREAD_SLOTS`], and code running after the
//! thread's destructors, use the shared stack directly (correct, slower) and
//! steal like everyone else.
//!
//! # Costs and limits
//!
//! alloc and free never block, never take a lock and never allocate memory;
//! they make no system call. (With asymmetric fences, a steal scan and a free
//! of a page another thread allocated make one `membarrier` call, which Linux
//! 6.8 and later (and stable backports) serialise system-wide, so it can wait
//! briefly in the kernel for other processes' calls.) Page arrays (12 bytes
//! per page) and magazines (24 KiB per allocator when on: 64 slots × 384
//! bytes) are allocated once, in
//! [`PageAllocator::with_options`]. The one exception is a thread's first
//! touch of its slot: the thread-local that releases the slot at exit is
//! registered with std's thread-local destructor list, which may allocate
//! once per thread. An alloc that finds the region exhausted costs a scan of
//! every slot's magazine length (64 loads) per round, and a relaxed load per
//! entry of a non-empty one: microseconds, on the path that ends in asking
//! the server for a region.

use std::fmt;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crossbeam_utils::CachePadded;

use crate::ids::{Generation, PageIndex};
use crate::sync::{AtomicI64, AtomicU32, AtomicU64, asymmetric};

/// Bits of the stack head that hold the top page index; the rest is the tag.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// "No page": the empty stack's head index and the last page's link.
const NIL: u32 = INDEX_MASK as u32;

/// Most pages one allocator manages (16 Mi pages: 64 GiB of 4 KiB pages).
pub const MAX_PAGES: u32 = NIL;
/// Largest magazine, in pages (smaller under the loom models, to keep them
/// small).
pub const MAX_MAGAZINE_PAGES: u32 = if cfg!(loom) { 4 } else { 32 };
/// Threads that get a magazine; later threads use the shared stack directly.
/// (4 under the loom models.)
pub const MAX_THREAD_SLOTS: usize = if cfg!(loom) { 4 } else { 64 };
/// How often an exhausted `alloc` looks at the shared stack and every
/// magazine before it returns `None` (see the module docs).
pub const EXHAUSTION_ROUNDS: usize = 2;
/// Lost races after which a thread gives up claiming a slot and goes without
/// a magazine.
pub const MAX_SLOT_CLAIM_ATTEMPTS: usize = 2 * MAX_THREAD_SLOTS;

// The slot mask is one u64; the cached-state field holds slot + 1 in 8 bits.
const _: () = assert!(MAX_THREAD_SLOTS <= 64);

/// Page state word: the generation in the low 32 bits; bit 32 "allocated";
/// bits 40.. a thread slot + 1 (0: none). For a free page the slot is the
/// one whose magazine caches it; a free page with no slot is on the shared
/// stack. For an allocated page, with asymmetric fences, it is the slot of
/// the thread that allocated it, which may free it without a locked
/// instruction (see *The owner's fast path*); 0 when a thread without a slot
/// allocated it, and always 0 without asymmetric fences (`Shared::holder`).
const ALLOCATED: u64 = 1 << 32;
const SLOT_SHIFT: u32 = 40;

const fn slot_field(slot: Option<usize>) -> u64 {
    match slot {
        Some(slot) => (slot as u64 + 1) << SLOT_SHIFT,
        None => 0,
    }
}

const fn allocated(generation: u32, by: Option<usize>) -> u64 {
    generation as u64 | ALLOCATED | slot_field(by)
}

const fn on_stack(generation: u32) -> u64 {
    generation as u64
}

const fn cached(generation: u32, slot: usize) -> u64 {
    generation as u64 | slot_field(Some(slot))
}

const fn state_generation(word: u64) -> u32 {
    word as u32
}

/// The slot a state names (the caching or the allocating thread's).
const fn state_slot(word: u64) -> Option<usize> {
    match word >> SLOT_SHIFT {
        0 => None,
        field => Some(field as usize - 1),
    }
}

/// True if `word` says "allocated at `generation`", by whichever thread.
const fn is_allocated_at(word: u64, generation: u32) -> bool {
    word & (ALLOCATED | u32::MAX as u64) == allocated(generation, None)
}

/// `Magazine::busy` values: the free the slot's owner is making without a
/// locked instruction, if any — the page (low 24 bits) and the generation
/// (the 32 bits above), with a flag bit so that no intent is `IDLE`.
const IDLE: u64 = 0;
const INTENT_FREE: u64 = 1 << 63;

const fn free_intent(page: u32, generation: u32) -> u64 {
    INTENT_FREE | (generation as u64) << INDEX_BITS | page as u64
}

/// The generation after `g`; 0 is never issued.
const fn next_generation(g: u32) -> u32 {
    match g.checked_add(1) {
        Some(next) => next,
        None => 1,
    }
}

/// A magazine entry: the page in the low 32 bits, the generation it was
/// cached at above.
const fn entry(page: u32, generation: u32) -> u64 {
    (generation as u64) << 32 | page as u64
}

const fn entry_page(entry: u64) -> u32 {
    entry as u32
}

const fn entry_generation(entry: u64) -> u32 {
    (entry >> 32) as u32
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
    asymmetric_fences: bool,
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

    /// Lets each thread change the states of its own pages with plain loads
    /// and stores instead of a locked compare-and-swap, paid for by a
    /// `membarrier(2)` system call on two rare paths: a free of a page
    /// another thread allocated, and a steal scan (see *The owner's fast
    /// path* in the module docs). An alloc+free pair then has no locked
    /// instruction. This gives up the default guarantee that `alloc` and
    /// `free` never make a system call, so it is off by default. Ignored
    /// (the allocator stays locked) without magazines or where the kernel
    /// or a seccomp policy refuses `membarrier`; see
    /// [`PageAllocator::has_asymmetric_fences`].
    pub fn asymmetric_fences(mut self, on: bool) -> Self {
        self.asymmetric_fences = on;
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
    /// Pages an `alloc` took out of another thread's magazine (the region
    /// looked exhausted from the allocating thread).
    pub steals: u64,
    /// Successful frees of a page that another thread allocated while
    /// asymmetric fences are on: each paid for a heavy barrier (a
    /// `membarrier` system call).
    pub remote_frees: u64,
}

/// The lock-free page allocator of one region. See the module docs for the
/// guarantees and the structure.
pub struct PageAllocator {
    shared: Box<Shared>,
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

/// A thread slot's cache of free pages, and the slot's side of the
/// asymmetric handshake. Only the slot's owner writes `len`, `pages` and
/// `busy`; other threads read them to steal or to free a page the owner
/// allocated, and announce themselves in `remote` (see the module docs).
struct Magazine {
    /// Live entries, `pages[..len]`. Stored by the owner with Release and
    /// read by thieves with Acquire, so that a thief that sees a length also
    /// sees the page-state changes the owner made before writing it (see
    /// `steal`).
    len: AtomicU32,
    /// Entries in `pages[..len]` whose page a thief took: thieves add one
    /// per theft, the owner subtracts one per stale entry it drops.
    stolen: AtomicI64,
    /// The free the owner is making right now, `free_intent(page,
    /// generation)`, or `IDLE`.
    busy: AtomicU64,
    /// With asymmetric fences: other threads about to change a page state
    /// this slot names (a thief, or a free of a page the owner allocated).
    /// Each adds one before its heavy barrier and takes it back after its
    /// CAS; while it is non-zero the owner uses CAS too. Unused otherwise.
    remote: AtomicU32,
    /// `entry(page, generation)`; only `pages[..len]` are live, and those may
    /// be stale.
    pages: [AtomicU64; MAX_MAGAZINE_PAGES as usize],
}

impl Magazine {
    fn new() -> Self {
        Self {
            len: AtomicU32::new(0),
            stolen: AtomicI64::new(0),
            busy: AtomicU64::new(IDLE),
            remote: AtomicU32::new(0),
            pages: std::array::from_fn(|_| AtomicU64::new(entry(NIL, 0))),
        }
    }
}

struct Counters {
    stale_frees: AtomicU64,
    double_frees: AtomicU64,
    foreign_frees: AtomicU64,
    steals: AtomicU64,
    remote_frees: AtomicU64,
}

struct Shared {
    page_count: u32,
    /// Magazine capacity; 0 means magazines are off and `magazines` is empty.
    magazine_pages: u32,
    /// Owners change page states with plain stores, paid for by a heavy
    /// barrier on the other side (see *The owner's fast path*): asked for
    /// in the options, magazines on and `membarrier` available.
    asymmetric: bool,
    stack: CachePadded<Stack>,
    /// Per page: `allocated(g, by)`, `on_stack(g)` or `cached(g, slot)`.
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
            .map(|_| AtomicU64::new(on_stack(initial.0)))
            .collect();
        // Initially the stack holds 0, 1, 2, ... in order, so fresh pages are
        // handed out from the start of the region.
        let next = (0..page_count)
            .map(|page| AtomicU32::new(if page + 1 < page_count { page + 1 } else { NIL }))
            .collect();
        let asymmetric = magazine_pages > 0 && options.asymmetric_fences && asymmetric::available();
        let magazines = if magazine_pages == 0 {
            Box::default()
        } else {
            (0..MAX_THREAD_SLOTS)
                .map(|_| CachePadded::new(Magazine::new()))
                .collect()
        };
        let shared = Box::new(Shared {
            page_count,
            magazine_pages,
            asymmetric,
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
                steals: AtomicU64::new(0),
                remote_frees: AtomicU64::new(0),
            }),
        });
        Ok(Self { shared })
    }

    /// True if owners change page states without locked instructions:
    /// [`AllocatorOptions::asymmetric_fences`] was asked for, magazines are
    /// on and this process can use `membarrier`.
    pub fn has_asymmetric_fences(&self) -> bool {
        self.shared.asymmetric
    }

    /// Pages in the region.
    pub fn page_count(&self) -> u32 {
        self.shared.page_count
    }

    /// Magazine capacity per thread (0: magazines off).
    pub fn magazine_pages(&self) -> u32 {
        self.shared.magazine_pages
    }

    /// Takes a free page and bumps its generation; `None` when every page is
    /// allocated (see the module docs for what that means under concurrent
    /// traffic).
    #[inline]
    pub fn alloc(&self) -> Option<(PageIndex, Generation)> {
        let shared = &*self.shared;
        // Fast path, inlined into the caller: a non-empty magazine whose top
        // entry was not stolen.
        if let Some((slot, magazine)) = shared.my_magazine() {
            // Relaxed loads: only this thread writes its magazine (see
            // `Magazine`; the length store is Release for thieves).
            let len = magazine.len.load(Relaxed);
            if len > 0 {
                let top = magazine.pages[len as usize - 1].load(Relaxed);
                magazine.len.store(len - 1, Release);
                if let Some(grant) = shared.take_own(slot, magazine, top) {
                    return Some(grant);
                }
                shared.forget_stolen(magazine);
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
    ///
    /// One uncontended CAS by default; with asymmetric fences no locked
    /// instruction at all when the calling thread allocated the page, while
    /// a page another thread allocated costs a heavy barrier instead (a
    /// `membarrier` system call of ~0.2–3 µs; see *The owner's fast path*).
    #[inline(always)]
    pub fn free(&self, page: PageIndex, generation: Generation) -> Result<(), FreeError> {
        let shared = &*self.shared;
        let Some(word) = shared.states.get(page.0 as usize) else {
            return Err(shared.reject_foreign(page));
        };
        let Some((slot, magazine)) = shared.my_magazine() else {
            return shared.free_slow(page, generation, None);
        };
        // Fast path, inlined into the caller: a page this slot allocated,
        // back into its magazine.
        let done = shared.owner_free(
            magazine,
            word,
            page.0,
            generation.0,
            allocated(generation.0, shared.holder(Some(slot))),
            cached(generation.0, slot),
        );
        if !done {
            return shared.free_slow(page, generation, Some((slot, magazine)));
        }
        shared.magazine_push(slot, magazine, page.0, generation.0);
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
            .is_some_and(|word| is_allocated_at(word.load(Relaxed), generation.0))
    }

    /// Moves the calling thread's magazine of this allocator onto the shared
    /// stack, so other threads allocate those pages on their fast path
    /// rather than by stealing.
    pub fn flush_local(&self) {
        if let Some((slot, magazine)) = self.shared.my_magazine() {
            self.shared.magazine_flush(slot, magazine);
        }
    }

    /// Free pages, counting those cached in magazines. Exact when no alloc or
    /// free is in flight (e.g. after the threads that used the allocator were
    /// joined, or while they are parked); a snapshot otherwise.
    ///
    /// Cost: a read of two counters per thread slot, or, with magazines off,
    /// a scan of the page states (O(page_count)).
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
            .map(|magazine| i64::from(magazine.len.load(Relaxed)) - magazine.stolen.load(Relaxed))
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
            steals: counters.steals.load(Relaxed),
            remote_frees: counters.remote_frees.load(Relaxed),
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
    /// The slot an allocated state records for a page allocated by `slot`:
    /// with asymmetric fences that slot, which may then free the page
    /// without a locked instruction; otherwise none, so that every free,
    /// from whichever thread, is one CAS from the same value.
    #[inline(always)]
    fn holder(&self, slot: Option<usize>) -> Option<usize> {
        if self.asymmetric { slot } else { None }
    }

    /// This thread's slot and magazine, if magazines are on and the thread
    /// has a slot.
    #[inline]
    fn my_magazine(&self) -> Option<(usize, &Magazine)> {
        if self.magazines.is_empty() {
            return None;
        }
        slots::current().map(|slot| (slot, &*self.magazines[slot]))
    }

    /// The owner of `magazine` moves `word` from `expected` (allocated by
    /// its slot at `generation`) to `freed` (cached by its slot); false if
    /// the page was not in that state. Release on success: a thief may take
    /// the page out of the magazine with an Acquire CAS that reads this value,
    /// and must see what the holder wrote to the page before this free.
    #[inline(always)]
    fn owner_free(
        &self,
        magazine: &Magazine,
        word: &AtomicU64,
        page: u32,
        generation: u32,
        expected: u64,
        freed: u64,
    ) -> bool {
        if !self.asymmetric {
            // Relaxed on failure: nothing is read through a rejected free.
            // The CAS's atomicity alone decides between racing frees.
            return word
                .compare_exchange(expected, freed, Release, Relaxed)
                .is_ok();
        }
        // Release: a remote free that reads this intent (or a later value)
        // with Acquire also sees our earlier page-state changes.
        magazine.busy.store(free_intent(page, generation), Release);
        // Store-then-load: the light half of the handshake whose heavy half a
        // remote free runs between announcing itself and reading `busy`.
        asymmetric::light();
        // Acquire: a remote that finished took its announcement back with a
        // Release decrement after its CAS; seeing that decrement means seeing
        // the CAS.
        let done = if magazine.remote.load(Acquire) == 0 {
            // Relaxed load: every writer of `expected` is this slot (our
            // alloc, or the slot's previous owner, whose exit happens-before
            // our claim), and no other thread changes it while no remote free
            // is announced (see *The owner's fast path*).
            let ours = word.load(Relaxed) == expected;
            if ours {
                word.store(freed, Release);
            }
            ours
        } else {
            word.compare_exchange(expected, freed, Release, Relaxed)
                .is_ok()
        };
        // Release: as for the intent; an operation that happens-before a
        // remote free is never mistaken for one in flight.
        magazine.busy.store(IDLE, Release);
        done
    }

    /// The owner of `slot` takes the page of its own magazine entry `entry`
    /// if it is still cached there at the entry's generation, marking it
    /// allocated by `slot` at the next generation. The caller has just
    /// removed the entry (stored the magazine's length without it); with
    /// asymmetric fences that store is this take's half of the handshake
    /// with thieves (see *The owner's fast path*).
    #[inline(always)]
    fn take_own(
        &self,
        slot: usize,
        magazine: &Magazine,
        entry: u64,
    ) -> Option<(PageIndex, Generation)> {
        let page = entry_page(entry);
        let word = self.states.get(page as usize)?;
        let generation = entry_generation(entry);
        let next = next_generation(generation);
        let expected = cached(generation, slot);
        let taken = allocated(next, self.holder(Some(slot)));
        let done = if self.asymmetric {
            self.owner_take(magazine, word, expected, taken)
        } else {
            // Acquire on success: as in `take_cached`.
            word.compare_exchange(expected, taken, Acquire, Relaxed)
                .is_ok()
        };
        done.then_some((PageIndex(page), Generation(next)))
    }

    /// `take_own` with asymmetric fences.
    #[inline(always)]
    fn owner_take(&self, magazine: &Magazine, word: &AtomicU64, expected: u64, taken: u64) -> bool {
        // Store-then-load: a thief announces itself, runs the heavy barrier
        // and then reads the length. Either it sees the entry gone, or we
        // see its announcement here and race it with a CAS.
        asymmetric::light();
        // Acquire: a thief that finished took its announcement back with a
        // Release decrement after its CAS; seeing that decrement means
        // seeing the CAS.
        if magazine.remote.load(Acquire) == 0 {
            // Relaxed: every writer of `expected` is this slot — our own
            // free, our refill after its Acquire pop, or the slot's previous
            // owner, whose exit happens-before our claim — so the previous
            // holder's writes to the page already happen-before ours.
            let ours = word.load(Relaxed) == expected;
            if ours {
                word.store(taken, Relaxed);
            }
            ours
        } else {
            // Acquire on success: as in `take_cached`.
            word.compare_exchange(expected, taken, Acquire, Relaxed)
                .is_ok()
        }
    }

    /// A thief (`me`, if it has a slot) takes the page of `entry` out of
    /// `slot`'s magazine if it is still cached there at the entry's
    /// generation, marking it allocated by `me` at the next generation. The
    /// caller has announced itself to `slot` (see `steal`).
    fn take_cached(
        &self,
        slot: usize,
        entry: u64,
        me: Option<usize>,
    ) -> Option<(PageIndex, Generation)> {
        let page = entry_page(entry);
        // Out of range only for the initial `NIL` entries a thief may read.
        let word = self.states.get(page as usize)?;
        let generation = entry_generation(entry);
        let next = next_generation(generation);
        // Acquire on success: the value read was written by the Release
        // change of the free that cached the page, or by the Release store
        // of the refill that did; either way the previous holder's writes to
        // the page happen-before ours. Relaxed on failure: a failed take
        // reads nothing through the page.
        word.compare_exchange(
            cached(generation, slot),
            allocated(next, self.holder(me)),
            Acquire,
            Relaxed,
        )
        .ok()
        .map(|_| (PageIndex(page), Generation(next)))
    }

    /// The owner met an entry whose page was stolen: one stolen entry fewer.
    #[cold]
    #[inline(never)]
    fn forget_stolen(&self, magazine: &Magazine) {
        // Relaxed: a statistic (`free_pages`); nothing is ordered by it.
        magazine.stolen.fetch_sub(1, Relaxed);
    }

    /// `alloc` when the magazine is empty, absent or its top entry was
    /// stolen: the rest of the magazine (refilled once from the shared
    /// stack), then other threads' magazines, `EXHAUSTION_ROUNDS` times.
    #[cold]
    #[inline(never)]
    fn alloc_slow(&self) -> Option<(PageIndex, Generation)> {
        let mine = self.my_magazine();
        for _ in 0..EXHAUSTION_ROUNDS {
            let taken = match mine {
                Some((slot, magazine)) => self.magazine_pop(slot, magazine),
                None => self.stack_pop_one().map(|page| self.hand_out(page, None)),
            };
            if taken.is_some() {
                return taken;
            }
            if self.magazines.is_empty() {
                // No magazines: the stack was the only place to look.
                return None;
            }
            if let Some(grant) = self.steal(mine.map(|(slot, _)| slot)) {
                return Some(grant);
            }
        }
        None
    }

    /// `free` when the fast path did not apply: the caller has no slot, or
    /// the page is not allocated by its slot at `generation` — allocated by
    /// another thread (a remote free), or not allocated at that generation
    /// at all (rejected).
    #[cold]
    #[inline(never)]
    fn free_slow(
        &self,
        page: PageIndex,
        generation: Generation,
        mine: Option<(usize, &Magazine)>,
    ) -> Result<(), FreeError> {
        let word = &self.states[page.0 as usize];
        let g = generation.0;
        // Relaxed: which path to take; the CAS below decides.
        let seen = word.load(Relaxed);
        if !is_allocated_at(seen, g) {
            return Err(self.reject(page, generation, seen));
        }
        let by = state_slot(seen);
        let freed = match mine {
            Some((slot, _)) => cached(g, slot),
            None => on_stack(g),
        };
        // Release on success, as in `free`; Relaxed on failure: nothing is
        // read through a rejected free. The CAS's atomicity decides between
        // racing remote frees.
        let result = match by {
            // A page another slot allocated, with asymmetric fences: its
            // owner may be freeing it with a plain store, so announce
            // ourselves first.
            Some(owner) if self.asymmetric => {
                let victim = &*self.magazines[owner];
                // Relaxed: ordered before the `busy` load by the heavy barrier.
                victim.remote.fetch_add(1, Relaxed);
                asymmetric::heavy();
                // Acquire: pairs with the owner's Release stores of `busy`, so
                // an operation we see as finished happened-before our CAS.
                let result = if victim.busy.load(Acquire) == free_intent(page.0, g) {
                    // The owner is freeing this very grant without a lock
                    // (or did, a moment ago): its free wins, ours is the
                    // double free.
                    Err(allocated(g, by))
                } else {
                    word.compare_exchange(allocated(g, by), freed, Release, Relaxed)
                };
                // Release: a later owner operation that sees the count drop
                // sees our CAS.
                victim.remote.fetch_sub(1, Release);
                if result.is_ok() {
                    // Relaxed: a statistic.
                    self.counters.remote_frees.fetch_add(1, Relaxed);
                }
                result
            }
            // Without asymmetric fences, or allocated by a thread without a
            // slot: nobody changes it without a CAS.
            _ => word.compare_exchange(allocated(g, by), freed, Release, Relaxed),
        };
        if let Err(actual) = result {
            return Err(self.reject(page, generation, actual));
        }
        match mine {
            Some((slot, magazine)) => self.magazine_push(slot, magazine, page.0, g),
            None => self.stack_push_chain(page.0, page.0, 1),
        }
        Ok(())
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

    /// Classifies a free that found `actual` instead of `(generation,
    /// allocated)` — or lost to the owner's free of the same grant, in which
    /// case `actual` says allocated at `generation` — and counts it.
    #[cold]
    #[inline(never)]
    fn reject(&self, page: PageIndex, generation: Generation, actual: u64) -> FreeError {
        // Relaxed: statistics; nothing is ordered by them.
        if state_generation(actual) == generation.0 {
            // Same generation: free already, or being freed by its owner.
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

    /// Marks `page`, just popped off the shared stack (so held exclusively),
    /// allocated by `by` at its next generation.
    fn hand_out(&self, page: u32, by: Option<usize>) -> (PageIndex, Generation) {
        let word = &self.states[page as usize];
        // Relaxed load and store, no RMW: while a page is on the stack its
        // state is only ever changed by the thread that popped it — us (`free`
        // expects `allocated`, a take expects `cached`; both fail on it). The
        // last write, the free's or spill's CAS, happens-before this through
        // the stack's Release push and Acquire pop. Others learn the new
        // generation only from our return value, through their own
        // synchronisation, so they see this store.
        let current = word.load(Relaxed);
        debug_assert_eq!(
            current,
            on_stack(state_generation(current)),
            "page {page} popped off the stack is not in the stack state"
        );
        let generation = next_generation(state_generation(current));
        word.store(allocated(generation, by), Relaxed);
        (PageIndex(page), Generation(generation))
    }

    /// Takes a page from this thread's magazine, dropping stolen entries and
    /// refilling from the shared stack at most once.
    fn magazine_pop(&self, slot: usize, magazine: &Magazine) -> Option<(PageIndex, Generation)> {
        let mut refilled = false;
        // Bounded: each turn consumes an entry or refills, and at most
        // `magazine_pages` entries exist before and after the one refill.
        loop {
            // Relaxed loads of the magazine: only this thread writes it
            // (length stores are Release for thieves).
            let len = magazine.len.load(Relaxed);
            if len == 0 {
                if refilled || self.refill(slot, magazine) == 0 {
                    return None;
                }
                refilled = true;
                continue;
            }
            let top = magazine.pages[len as usize - 1].load(Relaxed);
            magazine.len.store(len - 1, Release);
            if let Some(grant) = self.take_own(slot, magazine, top) {
                return Some(grant);
            }
            self.forget_stolen(magazine);
        }
    }

    /// Fills the empty magazine of `slot` with up to half its capacity from
    /// the shared stack, in one CAS; returns how many pages came.
    fn refill(&self, slot: usize, magazine: &Magazine) -> u32 {
        debug_assert_eq!(magazine.len.load(Relaxed), 0);
        let want = (self.magazine_pages / 2).max(1);
        // The entries are written twice: as bare pages by the pop (which may
        // record pages of failed attempts, see `stack_pop_chain`), then with
        // their generations once the pages are ours. A thief reading either
        // form fails its CAS until the state says "cached" (below).
        let count = self.stack_pop_chain(want, |i, page| {
            magazine.pages[i].store(entry(page, 0), Relaxed);
        });
        for i in 0..count as usize {
            let page = entry_page(magazine.pages[i].load(Relaxed));
            let word = &self.states[page as usize];
            // Relaxed load: the page is ours since the pop (see `hand_out`).
            let generation = state_generation(word.load(Relaxed));
            // Release: from here a thief can take the page with an Acquire
            // CAS reading this value; it must see the previous holder's
            // writes, which happen-before our Acquire pop.
            word.store(cached(generation, slot), Release);
            magazine.pages[i].store(entry(page, generation), Relaxed);
        }
        magazine.len.store(count, Release);
        count
    }

    /// Records a page just cached under `slot` (its state already says so)
    /// in the slot's magazine, spilling the older half first when it is full.
    #[inline(always)]
    fn magazine_push(&self, slot: usize, magazine: &Magazine, page: u32, generation: u32) {
        // Relaxed loads: only this thread writes its magazine (the length
        // store is Release for thieves, see `Magazine::len`).
        let len = magazine.len.load(Relaxed);
        if len < self.magazine_pages {
            magazine.pages[len as usize].store(entry(page, generation), Relaxed);
            magazine.len.store(len + 1, Release);
        } else {
            self.magazine_push_full(slot, magazine, page, generation);
        }
    }

    /// `free` of a page already cached under `slot` when the magazine is
    /// full: spills the older half onto the shared stack, then records it.
    #[cold]
    #[inline(never)]
    fn magazine_push_full(&self, slot: usize, magazine: &Magazine, page: u32, generation: u32) {
        // Relaxed loads of the magazine: owner-only data, as in
        // `magazine_pop`.
        let len = magazine.len.load(Relaxed);
        debug_assert_eq!(len, self.magazine_pages);
        let spill = (self.magazine_pages / 2).max(1);
        self.spill_prefix(slot, magazine, spill);
        for i in spill..len {
            let kept = magazine.pages[i as usize].load(Relaxed);
            magazine.pages[(i - spill) as usize].store(kept, Relaxed);
        }
        let len = len - spill;
        magazine.pages[len as usize].store(entry(page, generation), Relaxed);
        magazine.len.store(len + 1, Release);
    }

    /// Moves the whole magazine of `slot` onto the shared stack. Called by
    /// the slot's owner only.
    fn magazine_flush(&self, slot: usize, magazine: &Magazine) {
        // Relaxed load: owner-only data, as in `magazine_pop`.
        let len = magazine.len.load(Relaxed);
        if len > 0 {
            self.spill_prefix(slot, magazine, len);
            magazine.len.store(0, Release);
        }
    }

    /// Moves the pages of `magazine.pages[..count]` that are still cached
    /// there onto the shared stack as one chain (one CAS per page state, one
    /// for the push); drops the stolen ones. The caller then removes the
    /// entries.
    fn spill_prefix(&self, slot: usize, magazine: &Magazine, count: u32) {
        let (mut first, mut last, mut pushed) = (NIL, NIL, 0);
        for i in 0..count as usize {
            // Relaxed loads of our own magazine.
            let spilled = magazine.pages[i].load(Relaxed);
            let page = entry_page(spilled);
            let generation = entry_generation(spilled);
            // A CAS, not a store: a thief may be taking the page right now.
            // Relaxed: the push's Release CAS below publishes this state with
            // the links, as for every page pushed.
            if self.states[page as usize]
                .compare_exchange(
                    cached(generation, slot),
                    on_stack(generation),
                    Relaxed,
                    Relaxed,
                )
                .is_err()
            {
                self.forget_stolen(magazine);
                continue;
            }
            if first == NIL {
                first = page;
            } else {
                // Relaxed: the page is ours until the push publishes it.
                self.next[last as usize].store(page, Relaxed);
            }
            last = page;
            pushed += 1;
        }
        if pushed > 0 {
            self.stack_push_chain(first, last, pushed);
        }
    }

    /// Takes a page cached in another slot's magazine (`me` is skipped).
    /// Bounded: one pass over every slot's live entries, after one heavy
    /// barrier for all of them.
    #[cold]
    #[inline(never)]
    fn steal(&self, me: Option<usize>) -> Option<(PageIndex, Generation)> {
        // Look at every slot with entries (a slot that gets some only later
        // is missed this round, like any page that moves during the look).
        // With asymmetric fences, announce ourselves to each first; then one
        // heavy barrier covers them all.
        let mut announced = 0u64;
        for (slot, magazine) in self.magazines.iter().enumerate() {
            // Relaxed: the length only nominates slots; the CAS decides.
            if Some(slot) != me && magazine.len.load(Relaxed) > 0 {
                if self.asymmetric {
                    // Relaxed: ordered before the length loads below by the
                    // heavy barrier.
                    magazine.remote.fetch_add(1, Relaxed);
                }
                announced |= 1 << slot;
            }
        }
        if announced == 0 {
            return None;
        }
        if self.asymmetric {
            asymmetric::heavy();
        }
        let mut taken = None;
        let mut remaining = announced;
        while remaining != 0 && taken.is_none() {
            let slot = remaining.trailing_zeros() as usize;
            remaining &= remaining - 1;
            let magazine = &*self.magazines[slot];
            // The length and entries only nominate candidates; the CAS in
            // `take_cached` decides (see the module docs). With asymmetric
            // fences the owner may be taking a page with a plain load and
            // store right now: it removed the page's entry before its light
            // fence, so after our heavy barrier either this load no longer
            // counts that entry or the owner saw our announcement and takes
            // by CAS. Acquire, against the owner's Release length stores: a
            // length written after a finished plain take (by a later free
            // that reuses the index) brings that take's state store with it,
            // so a stale entry for the taken page fails our CAS.
            let len = magazine.len.load(Acquire).min(self.magazine_pages);
            for i in (0..len as usize).rev() {
                let candidate = magazine.pages[i].load(Relaxed);
                let still_cached = self
                    .states
                    .get(entry_page(candidate) as usize)
                    // Relaxed: a pre-check, so that a scan does not take the
                    // lines of pages that moved on for writing.
                    .is_some_and(|word| {
                        word.load(Relaxed) == cached(entry_generation(candidate), slot)
                    });
                if !still_cached {
                    continue;
                }
                if let Some(grant) = self.take_cached(slot, candidate, me) {
                    // Relaxed: statistics (see `Magazine::stolen`).
                    magazine.stolen.fetch_add(1, Relaxed);
                    self.counters.steals.fetch_add(1, Relaxed);
                    taken = Some(grant);
                    break;
                }
            }
        }
        let mut remaining = if self.asymmetric { announced } else { 0 };
        while remaining != 0 {
            let slot = remaining.trailing_zeros() as usize;
            remaining &= remaining - 1;
            // Release: a later owner operation that sees the count drop sees
            // our CAS.
            self.magazines[slot].remote.fetch_sub(1, Release);
        }
        taken
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

/// Which thread owns which magazine slot: a process-wide bit mask, claimed
/// and released lock-free (see the module docs).
///
/// Plain `std` outside the loom models: slot exclusivity rests on the mask's
/// RMWs alone — a bit is set by one `fetch_or` that found it clear, and
/// cleared only by its owner's exit, after which that thread never touches a
/// magazine again.
#[cfg(not(loom))]
mod slots {
    use std::cell::Cell;
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

    use super::{MAX_SLOT_CLAIM_ATTEMPTS, MAX_THREAD_SLOTS};

    /// `SLOT` before the thread's first use.
    const UNCLAIMED: usize = usize::MAX;
    /// `SLOT` of a thread without a magazine: all slots were taken, or its
    /// destructors are running.
    const NO_SLOT: usize = usize::MAX - 1;

    /// Bit `i` set: slot `i` is owned by a live thread.
    static CLAIMED: AtomicU64 = AtomicU64::new(0);

    /// A thread's claim on a slot; released when the thread exits.
    struct Claim {
        index: Option<usize>,
    }

    impl Claim {
        fn new() -> Self {
            let usable = if MAX_THREAD_SLOTS == 64 {
                u64::MAX
            } else {
                (1u64 << MAX_THREAD_SLOTS) - 1
            };
            // Relaxed: only a guess of a free bit; the fetch_or decides.
            let mut claimed = CLAIMED.load(Relaxed);
            for _ in 0..MAX_SLOT_CLAIM_ATTEMPTS {
                let free = !claimed & usable;
                if free == 0 {
                    break;
                }
                let bit = 1u64 << free.trailing_zeros();
                // Acquire: pairs with the Release `fetch_and` of the slot's
                // previous owner, so its last writes to the slot's magazines
                // happen-before ours (we adopt what it left).
                claimed = CLAIMED.fetch_or(bit, Acquire);
                if claimed & bit == 0 {
                    return Self {
                        index: Some(free.trailing_zeros() as usize),
                    };
                }
            }
            Self { index: None }
        }
    }

    impl Drop for Claim {
        fn drop(&mut self) {
            // From here on this thread allocates from the shared stacks only
            // (other destructors may still call alloc or free).
            SLOT.set(NO_SLOT);
            if let Some(index) = self.index {
                // Release: our writes to the slot's magazines happen-before
                // the next owner's (see `Claim::new`).
                CLAIMED.fetch_and(!(1u64 << index), Release);
            }
        }
    }

    thread_local! {
        /// The slot index, cached without a destructor so that reading it is
        /// a plain thread-local load on the hot path.
        static SLOT: Cell<usize> = const { Cell::new(UNCLAIMED) };
        /// Owns the claim; its destructor releases the slot.
        static CLAIM: Claim = Claim::new();
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
}

/// Slots under the loom models: each loom thread takes the next index on
/// first use and keeps it (models are short; nothing is released). Loom
/// threads are coroutines on one OS thread, so std thread-locals would be
/// shared between them; loom's are per modelled thread.
#[cfg(loom)]
mod slots {
    use std::cell::Cell;

    use loom::sync::atomic::AtomicUsize;
    use loom::sync::atomic::Ordering::Relaxed;

    use super::MAX_THREAD_SLOTS;

    const UNCLAIMED: usize = usize::MAX;

    loom::lazy_static! {
        static ref NEXT: AtomicUsize = AtomicUsize::new(0);
    }

    loom::thread_local! {
        static SLOT: Cell<usize> = Cell::new(UNCLAIMED);
    }

    pub(super) fn current() -> Option<usize> {
        SLOT.with(|slot| {
            if slot.get() == UNCLAIMED {
                // Relaxed: only uniqueness matters; a fresh slot's magazines
                // hold their initial values.
                slot.set(NEXT.fetch_add(1, Relaxed));
            }
            Some(slot.get()).filter(|&index| index < MAX_THREAD_SLOTS)
        })
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
    fn a_page_another_thread_allocated_is_freed_remotely_once_and_then_refused_to_its_owner() {
        for asymmetric in [false, true] {
            let allocator =
                PageAllocator::with_options(64, options(4).asymmetric_fences(asymmetric)).unwrap();
            assert_eq!(
                allocator.has_asymmetric_fences(),
                asymmetric && asymmetric::available()
            );
            let (page, generation) = allocator.alloc().unwrap();
            let remote = std::thread::scope(|scope| {
                scope
                    .spawn(|| {
                        let first = allocator.free(page, generation);
                        let second = allocator.free(page, generation);
                        (first, second)
                    })
                    .join()
                    .unwrap()
            });
            assert_eq!(remote.0, Ok(()), "asymmetric {asymmetric}");
            assert_eq!(
                remote.1,
                Err(FreeError::DoubleFree { page, generation }),
                "asymmetric {asymmetric}"
            );
            // The owner's own free of the same grant takes its fast path's
            // check and falls to the slow path, which refuses it.
            assert_eq!(
                allocator.free(page, generation),
                Err(FreeError::DoubleFree { page, generation }),
                "asymmetric {asymmetric}"
            );
            let stats = allocator.stats();
            let remote = u64::from(allocator.has_asymmetric_fences());
            assert_eq!((stats.remote_frees, stats.double_frees), (remote, 2));
            assert_eq!(stats.free_pages, 64);
            // The page sits in the (exited) remote thread's magazine and is
            // reachable: every page can be allocated once more.
            let pages: HashSet<u32> = (0..64).map(|_| allocator.alloc().unwrap().0.0).collect();
            assert_eq!(pages.len(), 64);
        }
    }

    #[test]
    fn the_asymmetric_fast_path_hands_out_and_refuses_exactly_what_the_locked_one_does() {
        // One thread, a fixed mix of allocs, frees, double and stale frees:
        // both fast paths must produce the same grants and the same errors.
        let run = |asymmetric: bool| {
            let allocator =
                PageAllocator::with_options(16, options(4).asymmetric_fences(asymmetric)).unwrap();
            let mut held = Vec::new();
            let mut freed = Vec::new();
            let mut log = Vec::new();
            for step in 0u32..400 {
                match step % 7 {
                    0 | 1 | 3 | 5 => match allocator.alloc() {
                        Some(grant) => {
                            log.push(format!("alloc {grant:?}"));
                            held.push(grant);
                        }
                        None => log.push("exhausted".to_owned()),
                    },
                    4 if !freed.is_empty() => {
                        let (page, generation) = freed[step as usize % freed.len()];
                        log.push(format!("again {:?}", allocator.free(page, generation)));
                    }
                    _ if !held.is_empty() => {
                        let (page, generation) = held.remove(step as usize % held.len());
                        log.push(format!("free {:?}", allocator.free(page, generation)));
                        freed.push((page, generation));
                    }
                    _ => {}
                }
            }
            (log, allocator.stats())
        };
        let (asymmetric_log, asymmetric_stats) = run(true);
        let (locked_log, locked_stats) = run(false);
        assert_eq!(asymmetric_log, locked_log);
        assert_eq!(asymmetric_stats, locked_stats);
        assert!(asymmetric_stats.double_frees + asymmetric_stats.stale_frees > 0);
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
    fn magazines_cost_24_kib_per_allocator() {
        let bytes = std::mem::size_of::<CachePadded<Magazine>>() * MAX_THREAD_SLOTS;
        assert_eq!(bytes, 24 * 1024, "update the module docs' figure");
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

    /// A thread that cached pages in its magazine and then parked does not
    /// make the region look exhausted to another thread: with `N` pages and
    /// `k` of them cached by the parked thread, the other still allocates all
    /// `N` (the `k` by stealing).
    #[test]
    fn pages_cached_by_a_parked_thread_are_stolen_so_another_thread_gets_all_of_them() {
        const N: u32 = 64;
        for k in [1, 4, 8] {
            let allocator = PageAllocator::with_options(N, options(8)).unwrap();
            let cached = Barrier::new(2);
            let resume = Barrier::new(2);
            std::thread::scope(|scope| {
                let parked = scope.spawn(|| {
                    let held: Vec<_> = (0..k).map(|_| allocator.alloc().unwrap()).collect();
                    for &(page, generation) in &held {
                        allocator.free(page, generation).unwrap();
                    }
                    cached.wait();
                    // Parked: no alloc, free or flush until resumed.
                    resume.wait();
                });
                cached.wait();
                let before = allocator.stats();
                assert_eq!(before.free_pages, N, "cached pages count as free");
                let mut held = Vec::new();
                while let Some(grant) = allocator.alloc() {
                    held.push(grant);
                }
                let pages: HashSet<_> = held.iter().map(|(page, _)| page.0).collect();
                assert_eq!(pages.len(), held.len(), "no page handed out twice");
                assert_eq!(
                    held.len() as u32,
                    N,
                    "k = {k}: every page, none left behind"
                );
                let after = allocator.stats();
                assert_eq!(after.free_pages, 0);
                assert!(
                    after.steals >= 1,
                    "k = {k}: the parked thread's pages came by stealing"
                );
                for (page, generation) in held {
                    allocator.free(page, generation).unwrap();
                }
                resume.wait();
                parked.join().unwrap();
            });
            assert_eq!(allocator.free_pages(), N);
        }
    }

    /// The owner of a robbed magazine finds the stolen entries stale: it never
    /// hands out a page a thief holds, and the free-page count stays exact.
    #[test]
    fn an_owner_never_hands_out_a_page_stolen_from_its_magazine() {
        const N: u32 = 32;
        let allocator = PageAllocator::with_options(N, options(8)).unwrap();
        let (cached, robbed) = (Barrier::new(2), Barrier::new(2));
        let (checked, released) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|scope| {
            let owner = scope.spawn(|| {
                let held: Vec<_> = (0..8).map(|_| allocator.alloc().unwrap()).collect();
                for &(page, generation) in &held {
                    allocator.free(page, generation).unwrap();
                }
                cached.wait();
                robbed.wait();
                // Every page is held by the thief now, including those whose
                // entries are still in our magazine.
                assert_eq!(allocator.alloc(), None);
                assert_eq!(allocator.free_pages(), 0, "stale entries are not counted");
                checked.wait();
                released.wait();
                // After the thief freed everything, we get every page again.
                assert_eq!(drain(&allocator), N);
            });
            cached.wait();
            let mut held = Vec::new();
            while let Some(grant) = allocator.alloc() {
                held.push(grant);
            }
            assert_eq!(held.len() as u32, N);
            robbed.wait();
            checked.wait();
            for (page, generation) in held {
                allocator.free(page, generation).unwrap();
            }
            released.wait();
            owner.join().unwrap();
        });
        assert_eq!(allocator.free_pages(), N);
    }

    /// A thread exits with pages in its magazine: none is lost. Another thread
    /// reaches them by stealing, and the slot's next owner adopts them.
    #[test]
    fn an_exited_threads_cached_pages_are_stolen_or_adopted_never_lost() {
        let allocator = PageAllocator::with_options(64, options(8)).unwrap();
        let cache_some = |allocator: &PageAllocator| {
            let held: Vec<_> = (0..6).map(|_| allocator.alloc().unwrap()).collect();
            for &(page, generation) in &held {
                allocator.free(page, generation).unwrap();
            }
        };
        std::thread::scope(|scope| {
            // An explicit join waits for the thread's exit, destructors
            // included (the scope's implicit join only waits for the closure).
            scope.spawn(|| cache_some(&allocator)).join().unwrap();
            assert_eq!(allocator.free_pages(), 64);
            assert_eq!(drain(&allocator), 64, "stolen from the exited thread");
            // Threads that come and go inherit the slots (and caches) of those
            // before them; nothing leaks either way.
            for _ in 0..4 {
                scope.spawn(|| cache_some(&allocator)).join().unwrap();
            }
            assert_eq!(allocator.free_pages(), 64);
            assert_eq!(scope.spawn(|| drain(&allocator)).join().unwrap(), 64);
        });
        assert_eq!(drain(&allocator), 64);
    }

    #[test]
    fn flush_local_hands_cached_pages_to_the_shared_stack_so_nobody_steals() {
        for flush in [false, true] {
            let allocator = PageAllocator::with_options(64, options(8)).unwrap();
            let (page, generation) = allocator.alloc().unwrap();
            allocator.free(page, generation).unwrap();
            if flush {
                allocator.flush_local();
            }
            let elsewhere =
                std::thread::scope(|scope| scope.spawn(|| drain(&allocator)).join().unwrap());
            assert_eq!(elsewhere, 64, "reachable either way");
            let steals = allocator.stats().steals;
            assert_eq!(steals == 0, flush, "flush {flush}: {steals} steals");
        }
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

/// Loom models of the shared free stack, the page-state CAS and the steal
/// protocol. The first three run with magazines off (the stack alone); the
/// others turn magazines on (loom threads get their slots from loom's own
/// thread-locals, see `slots`) and race an owner's magazine operations —
/// take, spill — against a thief's steal, and racing allocators against one
/// another over pages cached by a finished thread.
///
/// Each page carries a loom-tracked cell that its holder writes: loom reports
/// a causality violation if two threads ever hold one page at once, or if a
/// holder's writes are not ordered before the next holder's (the allocator's
/// memory-ordering promise, here also across a steal).
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
            Self::with_magazines(page_count, 0, false)
        }

        /// `asymmetric`: the owner's fast path uses plain loads and stores
        /// and the asymmetric handshake instead of CAS.
        fn with_magazines(page_count: u32, magazine_pages: u32, asymmetric: bool) -> Arc<Self> {
            let options = AllocatorOptions::default()
                .magazine_pages(magazine_pages)
                .initial_generation(Generation(0))
                .asymmetric_fences(asymmetric);
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

    fn free_all(pool: &Pool, grants: impl IntoIterator<Item = Option<(PageIndex, Generation)>>) {
        for (page, generation) in grants.into_iter().flatten() {
            pool.allocator.free(page, generation).unwrap();
        }
    }

    /// The owner takes the top of its magazine while a thief, finding the
    /// stack empty, steals from that magazine: exactly one gets the page, and
    /// between them they get both pages (no false exhaustion).
    #[test]
    fn loom_an_owner_and_a_thief_racing_for_a_cached_page_never_share_it() {
        owner_and_thief_race(false);
    }

    /// The same race where the owner takes with a plain load and store and
    /// the thief runs the asymmetric handshake.
    #[test]
    fn loom_an_owners_unlocked_take_and_a_thief_never_share_a_page() {
        owner_and_thief_race(true);
    }

    fn owner_and_thief_race(asymmetric: bool) {
        loom::model(move || {
            // Magazines of 2 refill 1 page at a time: after the take and free
            // below, page 0 is cached by this thread and page 1 is on the stack.
            let pool = Pool::with_magazines(2, 2, asymmetric);
            let (page, generation) = pool.take(0).unwrap();
            pool.allocator.free(page, generation).unwrap();
            let thief = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || [pool.take(1), pool.take(1)])
            };
            let mine = pool.take(0);
            let theirs = thief.join().unwrap();
            let got = theirs.iter().chain([&mine]).flatten().count();
            assert_eq!(got, 2, "{mine:?} {theirs:?}");
            free_all(&pool, theirs.into_iter().chain([mine]));
            pool.assert_all_free();
        });
    }

    /// The owner frees a grant it allocated — with plain loads and stores —
    /// while another thread frees the same grant (a duplicated notice): the
    /// remote free announces itself and runs the heavy barrier, and exactly
    /// one of the two succeeds. The winner's page is then allocated again by
    /// the owner, so a lost update would show up as a page handed out twice
    /// or lost.
    #[test]
    fn loom_an_owners_unlocked_free_racing_a_remote_free_of_the_grant_succeeds_once() {
        owner_and_remote_free_race(true);
    }

    #[test]
    fn loom_an_owners_locked_free_racing_a_remote_free_of_the_grant_succeeds_once() {
        owner_and_remote_free_race(false);
    }

    fn owner_and_remote_free_race(asymmetric: bool) {
        loom::model(move || {
            let pool = Pool::with_magazines(2, 2, asymmetric);
            let (page, generation) = pool.take(0).unwrap();
            let remote = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || pool.allocator.free(page, generation))
            };
            let mine = pool.allocator.free(page, generation);
            // The owner keeps working on its magazine while the remote runs.
            let again = pool.take(0);
            let theirs = remote.join().unwrap();
            assert_eq!(
                usize::from(mine.is_ok()) + usize::from(theirs.is_ok()),
                1,
                "{mine:?} {theirs:?}"
            );
            // Stale when the owner already took the page again.
            let loser = mine.err().or(theirs.err()).unwrap();
            assert!(
                matches!(
                    loser,
                    FreeError::DoubleFree { .. } | FreeError::StaleGeneration { .. }
                ),
                "{loser:?}"
            );
            free_all(&pool, [again]);
            pool.assert_all_free();
        });
    }

    /// The owner takes the only entry of its magazine with a plain store and
    /// at once frees another page into the same index, while a thief scans
    /// the magazine: whichever length the thief reads, it never gets the
    /// page the owner just took (it may get that page before the owner
    /// does, or the one just freed). Loom cannot catch the ordering this
    /// relies on being too weak (Relaxed lengths pass here too: its
    /// read-modify-writes always read the newest value); the argument for
    /// the Release/Acquire lengths is in `steal`. The model checks the
    /// sequence itself.
    #[test]
    fn loom_a_thief_reading_a_regrown_length_never_takes_the_page_just_taken() {
        loom::model(|| {
            let pool = Pool::with_magazines(3, 2, true);
            let [a, b, c] = [pool.take(0), pool.take(0), pool.take(0)].map(Option::unwrap);
            // The magazine holds [a]; b and c are held; the stack is empty.
            pool.allocator.free(a.0, a.1).unwrap();
            let thief = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || pool.take(1))
            };
            // `None` if the thief stole `a` first.
            let again = pool.take(0);
            pool.allocator.free(b.0, b.1).unwrap();
            let stolen = thief.join().unwrap();
            if let Some((page, _)) = again {
                assert_eq!(page, a.0);
                assert_ne!(stolen.map(|grant| grant.0), Some(a.0));
            }
            free_all(&pool, [again, stolen, Some(c)]);
            pool.assert_all_free();
        });
    }

    /// A remote free of one page the owner allocated, while the owner
    /// allocates and frees other pages on its fast path: the remote's CAS
    /// and the owner's plain stores touch different pages, the handshake
    /// orders them, and every page ends in exactly one place.
    #[test]
    fn loom_a_remote_free_beside_the_owners_unlocked_traffic_keeps_every_page() {
        loom::model(|| {
            let pool = Pool::with_magazines(3, 2, true);
            let (page, generation) = pool.take(0).unwrap();
            let remote = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    pool.allocator.free(page, generation).unwrap();
                    // The remote's own slot now caches the page: take it
                    // back and return it.
                    free_all(&pool, [pool.take(1)]);
                })
            };
            let held = pool.take(0);
            free_all(&pool, [held]);
            remote.join().unwrap();
            assert_eq!(pool.allocator.stats().remote_frees, 1);
            pool.assert_all_free();
        });
    }

    /// The owner frees into a full magazine, which spills its older entry onto
    /// the stack (a CAS per page state), while a thief steals from the same
    /// magazine: each page ends up in exactly one place.
    #[test]
    fn loom_a_spill_racing_a_steal_moves_every_page_exactly_once() {
        spill_and_steal_race(false);
    }

    #[test]
    fn loom_a_spill_racing_an_announced_steal_moves_every_page_exactly_once() {
        spill_and_steal_race(true);
    }

    fn spill_and_steal_race(asymmetric: bool) {
        loom::model(move || {
            let pool = Pool::with_magazines(3, 2, asymmetric);
            let held = [pool.take(0), pool.take(0), pool.take(0)];
            let [first, second, third] = held.map(|grant| grant.unwrap());
            // The magazine is now full: [first, second].
            pool.allocator.free(first.0, first.1).unwrap();
            pool.allocator.free(second.0, second.1).unwrap();
            let thief = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    // May come back empty-handed: the spill shifts the entry
                    // it keeps while the scan reads the array (see the module
                    // docs). What must hold is that every page ends up in
                    // exactly one place, whoever got what.
                    let stolen = pool.take(1);
                    free_all(&pool, [stolen]);
                })
            };
            pool.allocator.free(third.0, third.1).unwrap();
            thief.join().unwrap();
            pool.assert_all_free();
        });
    }

    /// A thread caches every page and finishes without flushing; two threads
    /// then allocate until exhaustion at the same time. Between them they get
    /// every page, each once: a steal never misses a page nobody holds.
    #[test]
    fn loom_pages_cached_by_a_finished_thread_are_all_reachable_by_racing_allocators() {
        finished_thread_pages_race(false);
    }

    #[test]
    fn loom_pages_cached_by_a_finished_thread_are_all_reachable_by_announced_thieves() {
        finished_thread_pages_race(true);
    }

    fn finished_thread_pages_race(asymmetric: bool) {
        loom::model(move || {
            let pool = Pool::with_magazines(2, 2, asymmetric);
            {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let grants = [pool.take(1), pool.take(1)];
                    assert!(grants.iter().all(Option::is_some));
                    free_all(&pool, grants);
                })
                .join()
                .unwrap();
            }
            let other = {
                let pool = Arc::clone(&pool);
                thread::spawn(move || [pool.take(2), pool.take(2)])
            };
            let mine = [pool.take(3), pool.take(3)];
            let theirs = other.join().unwrap();
            let got = mine.iter().chain(&theirs).flatten().count();
            assert_eq!(got, 2, "{mine:?} {theirs:?}");
            free_all(&pool, mine.into_iter().chain(theirs));
            pool.assert_all_free();
        });
    }
}
