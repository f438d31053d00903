//! # cxlkv-dataplane
//!
//! Everything that touches KV bytes. cxlkv's inference processes write each
//! KV chunk once into a shared memory pool and read each other's chunks in
//! place; this crate is the part of that which runs next to the bytes: it
//! opens the pool, maps regions of it, hands out pages, moves bytes in and
//! out at memory speed, and makes them visible across hosts. It never does
//! I/O other than opening and mapping the pool, and it knows nothing of keys,
//! servers or the network — those live in `cxlkv-controlplane` and the
//! `cxlkv` client.
//!
//! ## The memory model: pool → region → page
//!
//! - A **pool** is a device-DAX device (CXL memory) or a file on tmpfs,
//!   hugetlbfs or a DAX filesystem, opened as a [`backing::Backing`] by
//!   [`backing::open`] (or from a descriptor the server passed, with
//!   [`backing::from_fd`]). Its alignment (2 MiB by default, more if the
//!   device demands it) governs everything below.
//! - A **region** is an aligned extent of the pool, owned by one client
//!   instance for allocation. [`map::MappedRegion`] maps one with `MAP_SHARED`
//!   — eagerly populated for owned regions, lazily for peers' — and tells
//!   registered [`map::MapObserver`]s (GPU host-memory registration) after it
//!   maps and before it unmaps.
//! - A **page** holds one KV chunk; its size is fixed per layout (a multiple
//!   of 4 KiB). [`map::PageView`] and [`map::PageViewMut`] are the only ways
//!   safe code reaches pool bytes: `&[u8]` / `&mut [u8]` whose lifetimes
//!   borrow the mapping.
//!
//! ## Moving bytes and making them visible
//!
//! [`copy::copy_in`] / [`copy::copy_out`] choose between `memcpy` and
//! non-temporal AVX2/AVX-512 stores by size and CPU; [`visibility::publish`]
//! and [`visibility::acquire`] write back or invalidate cache lines where the
//! pool is shared by hosts without cache coherence
//! ([`visibility::Visibility::Flush`]), and are plain fences otherwise. A
//! non-temporal `copy_in` already satisfies `publish`, and says so.
//!
//! ## Page allocator and region table
//!
//! Each owned region has a lock-free page allocator (`alloc`): alloc and free
//! never block and never make a syscall; every allocation bumps the page's
//! generation, so a stale or double free is recognised and rejected. A
//! client's owned regions and its cache of mapped peer regions sit in a region
//! table (`table`) keyed by region id, read without locks on every operation
//! and republished through epoch-based reclamation when a region is added or
//! dropped. Their module docs give the details.
//!
//! ## Invariants
//!
//! - Raw pointers into the pool exist only inside [`map::MappedRegion`] (and
//!   transiently in the copy and flush routines, derived from slices). A view
//!   never outlives its mapping; a mapping is unmapped only after its
//!   observers were told. The one deliberate exception: the base address
//!   leaves as [`map::MapInfo::base_addr`] (for GPU registration by
//!   observers) and [`map::MappedRegion::ffi_base_ptr`] (for the C ABI),
//!   under the contract in [`map`]'s docs.
//! - Region extents are multiples of the pool alignment and lie inside the
//!   pool; page sizes are multiples of 4 KiB; violations are typed errors
//!   ([`backing::LayoutError`]).
//! - A page is written only by whoever the allocator handed it to, before it
//!   is published; it is read only after publication. This is the contract
//!   of [`map::MappedRegion::map`] and [`map::MappedRegion::page_mut`], which
//!   are `unsafe` because the pool is shared with other processes that
//!   Rust's aliasing rules cannot see; the client upholds it.
//! - Bytes are published (written back and fenced, or copied with
//!   non-temporal stores) before their key is registered.

pub mod alloc;
pub mod backing;
pub mod copy;
pub mod hugepages;
pub mod ids;
pub mod map;
mod sync;
pub mod table;
pub mod visibility;
