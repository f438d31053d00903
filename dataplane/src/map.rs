//! Region mappings and page views: the only place raw pointers into the pool
//! exist.
//!
//! A [`MappedRegion`] is a `MAP_SHARED` mapping of one region (an aligned
//! [`Extent`] of a [`Backing`]), unmapped on drop. Safe code never sees its
//! address; it gets bounds-checked page views whose lifetimes borrow the
//! mapping, so no view outlives the `munmap`:
//!
//! - [`MappedRegion::page`] → [`PageView`], a `&[u8]` of a published page.
//! - [`MappedRegion::page_mut`] → [`PageViewMut`], a `&mut [u8]`. Writers of
//!   distinct pages of one region run concurrently on different threads, so a
//!   mutable view cannot be derived from `&mut MappedRegion`; it comes from
//!   `&self` and is `unsafe`: the caller promises the exclusive right to the
//!   page, which the page allocator's hand-out provides (the client wraps it).
//!
//! Why [`MappedRegion::map`] is `unsafe` too: the bytes are shared with other
//! mappings and other processes, which Rust's aliasing rules cannot see. As
//! with any shared file mapping, soundness rests on a protocol the caller
//! upholds — cxlkv's: a page is written only by its allocator's owner before it
//! is published, read only after publication under a pin, and rewritten only
//! after the last pin is gone.
//!
//! **Population.** [`Populate::Eager`] is for owned regions, which will be
//! written soon: every page is faulted in at map time with
//! `MADV_POPULATE_WRITE` (Linux 5.14+), which also reports failure (tmpfs or
//! the huge page pool exhausted) as an error now instead of a `SIGBUS` on a
//! later write. Where the kernel or mapping type refuses it (`EINVAL`), the
//! range is mapped again with `MAP_POPULATE` and the first mapping dropped —
//! without that report: `mmap` does not fail when it cannot populate, so on
//! such a kernel a full tmpfs or huge page pool is still met as a `SIGBUS`
//! at the first write.
//! `MADV_POPULATE_WRITE` is also the fastest: mapping a fresh 64 MiB
//! `/dev/shm` region and writing every page took a median 89 ms with it,
//! 138 ms with `MAP_POPULATE` (which prefaults shared
//! mappings for reading only, so every first write faults again) and 102 ms
//! faulting lazily (`cargo bench --bench map`, busy shared machine; see
//! `docs/architecture.md`). [`Populate::Lazy`] is for peer regions, read a
//! few pages at a time: pages fault in on first access. On tmpfs
//! `MADV_HUGEPAGE` is requested: effective where the mount's `huge=` option
//! is `advise` (`never`, the default, ignores it; `always` and `within_size`
//! need no request), unless `/sys/kernel/mm/transparent_hugepage/shmem_enabled`
//! overrides every mount with `deny` or `force` (its other values concern
//! only the kernel's internal shmem mount). hugetlbfs and device DAX map huge
//! pages by themselves.
//!
//! **Observers.** Engines that register host memory with a GPU must hear of
//! every mapping and of every unmapping before it happens. A [`MapObservers`]
//! list (shared by a client's regions) holds [`MapObserver`]s; a region calls
//! `on_map` on each observer registered at map time, after `mmap`, and
//! `before_unmap` on exactly those observers, before `munmap` — so the calls
//! pair up exactly once per observer and region, even if an observer is
//! registered or unregistered while the region lives.
//!
//! **The one deliberate leak of the address.** The rule is that raw pointers
//! into the pool live only in [`MappedRegion`] and the page views. Two exits
//! break it on purpose, because their consumers cannot work with a borrowed
//! slice: [`MapInfo::base_addr`] (observers register the whole range with a
//! GPU driver, `cudaHostRegister`, which takes an address and a length) and
//! [`MappedRegion::ffi_base_ptr`] (the C ABI hands engines a pointer they
//! compute page addresses from). Both give a plain address — a `usize` and a
//! `*const u8` — that Rust cannot tie to the mapping's lifetime, so the
//! contract is the caller's:
//!
//! - the address is valid from `on_map` until `before_unmap` returns (the
//!   observer), or while the `MappedRegion` lives (the FFI caller); a device
//!   registration made in `on_map` must be undone in `before_unmap`, because
//!   the range is unmapped right after;
//! - bytes reached through it obey the same rules as views:
//!   [`MappedRegion::map`]'s contract for reads, [`MappedRegion::page_mut`]'s
//!   (the exclusive right to the page, from the allocator) for writes —
//!   and only a writable mapping can be written at all: a peer's region is
//!   mapped read-only ([`Access::ReadOnly`], [`MapInfo::writable`] false),
//!   where a stray write faults;
//! - only bytes inside `base .. base + len_bytes` may be touched, and no Rust
//!   reference may be made from it that outlives the mapping or overlaps a
//!   live [`PageViewMut`].
//!
//! No other code in the workspace turns the address into a reference; safe
//! Rust code reaches pool bytes only through views.

use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError, RwLock};

use crate::backing::{Backing, BackingKind, Extent, LayoutError, check_page_size};
use crate::ids::{PageIndex, RegionId};

/// How a region's pages come into memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Populate {
    /// Fault every page in at map time (owned regions).
    Eager,
    /// Fault pages in on first access (peer regions).
    Lazy,
}

/// What the process may do with a mapping's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read and write (owned regions, the pool manager's header block).
    ReadWrite,
    /// Read only (`PROT_READ`): a peer's region, or a header a client only
    /// reads. A stray write through any pointer into it — a bug in an
    /// engine holding a C address, say — faults (`SIGSEGV`) instead of
    /// corrupting another instance's published pages; [`MappedRegion::page_mut`]
    /// and [`MappedRegion::write_shared`] refuse it with [`MapError::ReadOnly`].
    /// Reading under `Visibility::Flush` still works: `clflushopt` is checked
    /// as a load.
    ReadOnly,
}

/// At most this many observers per list: each one runs on every map and unmap.
pub const MAX_MAP_OBSERVERS: usize = 64;

/// What an observer is told about a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapInfo {
    pub region: RegionId,
    /// The region's extent in the pool.
    pub extent: Extent,
    /// Address of the first mapped byte, for registering the range with a
    /// device (e.g. `cudaHostRegister`). Valid from `on_map` until
    /// `before_unmap` returns; a deliberate exception to "raw pointers stay in
    /// the map types", with the contract in the module docs.
    pub base_addr: usize,
    pub len_bytes: usize,
    /// False for a read-only mapping ([`Access::ReadOnly`], a peer's
    /// region): a device registration of it must say so (e.g.
    /// `cudaHostRegisterReadOnly`), since the pages cannot be written.
    pub writable: bool,
}

/// Told when a region is mapped and before it is unmapped.
///
/// Callbacks run on the thread that maps or drops the region, must not block
/// for long, and must not panic (a panic in `on_map` propagates out of
/// [`MappedRegion::map`] after the observers already told are given
/// `before_unmap` and the range is unmapped).
pub trait MapObserver: Send + Sync {
    /// The region is mapped at `info.base_addr`; no view of it exists yet.
    fn on_map(&self, info: &MapInfo);
    /// The region is about to be unmapped; no view of it exists any more.
    fn before_unmap(&self, info: &MapInfo);
}

/// A shared, bounded list of observers consulted by every [`MappedRegion::map`].
#[derive(Default)]
pub struct MapObservers {
    list: RwLock<Vec<Arc<dyn MapObserver>>>,
}

impl fmt::Debug for MapObservers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapObservers")
            .field("len", &self.read().len())
            .finish()
    }
}

impl MapObservers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an observer for regions mapped from now on.
    pub fn register(&self, observer: Arc<dyn MapObserver>) -> Result<(), MapError> {
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        if list.len() >= MAX_MAP_OBSERVERS {
            return Err(MapError::TooManyObservers {
                limit: MAX_MAP_OBSERVERS,
            });
        }
        list.push(observer);
        Ok(())
    }

    /// Removes an observer (compared by identity); true if it was present.
    /// Regions it was told about still call its `before_unmap`.
    pub fn unregister(&self, observer: &Arc<dyn MapObserver>) -> bool {
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        let before = list.len();
        list.retain(|o| !Arc::ptr_eq(o, observer));
        list.len() != before
    }

    /// The observers at this instant. Callbacks run on this copy, outside the
    /// lock, so an observer may itself (un)register without deadlocking.
    fn snapshot(&self) -> Vec<Arc<dyn MapObserver>> {
        self.read().clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<dyn MapObserver>>> {
        // The lock only guards a Vec push/retain/clone, which cannot leave it
        // half-updated, so a poisoned lock's contents are still sound.
        self.list.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Errors mapping a region or taking a view of it.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("region {region} {extent} does not fit this address space")]
    TooLarge { region: RegionId, extent: Extent },
    #[error("mmap of region {region} {extent} of {} failed", path.display())]
    Mmap {
        region: RegionId,
        extent: Extent,
        path: std::path::PathBuf,
        source: io::Error,
    },
    #[error("populating region {region} {extent} failed (pool memory exhausted?)")]
    Populate {
        region: RegionId,
        extent: Extent,
        source: io::Error,
    },
    #[error(
        "page {index} of {page_size_bytes} bytes lies beyond region {region} of {region_len_bytes} bytes"
    )]
    PageOutOfRange {
        region: RegionId,
        index: PageIndex,
        page_size_bytes: usize,
        region_len_bytes: usize,
    },
    #[error("view of {len_bytes} bytes exceeds the page size {page_size_bytes}")]
    LenExceedsPage {
        len_bytes: usize,
        page_size_bytes: usize,
    },
    #[error("region {region} of {region_len_bytes} bytes holds no page of {page_size_bytes} bytes")]
    RegionSmallerThanPage {
        region: RegionId,
        page_size_bytes: usize,
        region_len_bytes: usize,
    },
    #[error("at most {limit} map observers can be registered")]
    TooManyObservers { limit: usize },
    #[error("region {region} is mapped read-only (a peer's region): it cannot be written")]
    ReadOnly { region: RegionId },
    #[error("a read-only mapping of region {region} cannot be populated for writing")]
    PopulateReadOnly { region: RegionId },
}

/// A `MAP_SHARED` mapping of one region of a pool; unmapped on drop.
pub struct MappedRegion {
    base: NonNull<u8>,
    len_bytes: usize,
    region: RegionId,
    extent: Extent,
    kind: BackingKind,
    /// Mapped `PROT_READ | PROT_WRITE` (else `PROT_READ` only).
    writable: bool,
    /// The observers whose `on_map` ran, in order; exactly these get
    /// `before_unmap`.
    notified: Vec<Arc<dyn MapObserver>>,
}

// SAFETY: a MappedRegion owns its mapping like a Box owns its allocation; the
// address is valid from any thread, and the methods that hand out access to
// the bytes (`page`, `page_mut`) are bounded by the contracts of `map` and
// `page_mut`, which are about pages, not threads.
unsafe impl Send for MappedRegion {}
// SAFETY: `&MappedRegion` only allows shared views (`page`) and, under
// `page_mut`'s exclusive-right contract, disjoint mutable ones; no method
// mutates the struct through `&self`.
unsafe impl Sync for MappedRegion {}

impl fmt::Debug for MappedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedRegion")
            .field("region", &self.region)
            .field("extent", &self.extent)
            .field("kind", &self.kind)
            .field("writable", &self.writable)
            .field("observers", &self.notified.len())
            .finish_non_exhaustive()
    }
}

impl MappedRegion {
    /// Maps `extent` of `backing` as region `region`, read-write and shared,
    /// then tells every observer in `observers` (see the module docs).
    ///
    /// # Safety
    ///
    /// The bytes are shared with every other mapping of the pool, in this
    /// process and in others, where Rust's aliasing rules cannot see them. For
    /// as long as the returned region lives, the caller guarantees that no
    /// byte of the extent is written while a [`PageView`] of it exists, and
    /// that bytes are written only through [`PageViewMut`]s obtained under
    /// [`MappedRegion::page_mut`]'s contract (or, in another process or
    /// mapping, under the same rule) — the cxlkv protocol: write an owned page
    /// before publishing it, read pages only after publication under a pin,
    /// rewrite a page only after its last pin is gone. The pool is also not
    /// truncated below the extent while mapped (an access would `SIGBUS`).
    pub unsafe fn map(
        backing: &dyn Backing,
        region: RegionId,
        extent: Extent,
        populate: Populate,
        observers: &MapObservers,
    ) -> Result<Self, MapError> {
        // SAFETY: the caller's contract is `map_with`'s.
        unsafe {
            Self::map_with(
                backing,
                region,
                extent,
                populate,
                Access::ReadWrite,
                observers,
            )
        }
    }

    /// Maps `extent` of `backing` as region `region` for reading only
    /// ([`Access::ReadOnly`], pages faulted in on first read), then tells
    /// every observer (with `writable: false`).
    ///
    /// # Safety
    ///
    /// As for [`MappedRegion::map`]: no byte of the extent is written (by
    /// any process) while a [`PageView`] of it exists.
    pub unsafe fn map_read_only(
        backing: &dyn Backing,
        region: RegionId,
        extent: Extent,
        observers: &MapObservers,
    ) -> Result<Self, MapError> {
        // SAFETY: the caller's contract is `map_with`'s.
        unsafe {
            Self::map_with(
                backing,
                region,
                extent,
                Populate::Lazy,
                Access::ReadOnly,
                observers,
            )
        }
    }

    /// [`MappedRegion::map`] with the access chosen; `Populate::Eager`
    /// faults pages in for writing, so it needs `Access::ReadWrite`.
    ///
    /// # Safety
    ///
    /// As for [`MappedRegion::map`].
    pub unsafe fn map_with(
        backing: &dyn Backing,
        region: RegionId,
        extent: Extent,
        populate: Populate,
        access: Access,
        observers: &MapObservers,
    ) -> Result<Self, MapError> {
        if populate == Populate::Eager && access == Access::ReadOnly {
            return Err(MapError::PopulateReadOnly { region });
        }
        backing.check_extent(extent)?;
        let too_large = || MapError::TooLarge { region, extent };
        let len_bytes = usize::try_from(extent.len_bytes).map_err(|_| too_large())?;
        let offset = libc::off_t::try_from(extent.offset_bytes).map_err(|_| too_large())?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&backing.fd());
        let writable = access == Access::ReadWrite;
        let base =
            mmap_shared(len_bytes, writable, 0, fd, offset).map_err(|source| MapError::Mmap {
                region,
                extent,
                path: backing.path().to_owned(),
                source,
            })?;
        // From here on, `mapped`'s drop unmaps on every error path.
        let mut mapped = Self {
            base,
            len_bytes,
            region,
            extent,
            kind: backing.kind(),
            writable,
            notified: Vec::new(),
        };
        if mapped.kind == BackingKind::Tmpfs {
            mapped.advise_hugepage();
        }
        if populate == Populate::Eager {
            mapped.populate(fd, offset)?;
        }
        let info = mapped.info();
        for observer in observers.snapshot() {
            observer.on_map(&info);
            mapped.notified.push(observer);
        }
        Ok(mapped)
    }

    /// Asks for transparent huge pages; advisory, so a refusal (no THP in
    /// this kernel) is logged, not returned.
    fn advise_hugepage(&self) {
        // SAFETY: the range is exactly our own live mapping; MADV_HUGEPAGE
        // changes no contents.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().cast(),
                self.len_bytes,
                libc::MADV_HUGEPAGE,
            )
        };
        if rc != 0 {
            tracing::debug!(
                region = %self.region,
                err = %io::Error::last_os_error(),
                "MADV_HUGEPAGE refused"
            );
        }
    }

    /// Faults every page in for writing (see the module docs for why this
    /// method and this fallback).
    fn populate(&mut self, fd: libc::c_int, offset: libc::off_t) -> Result<(), MapError> {
        // SAFETY: the range is exactly our own live mapping, not yet visible
        // to anyone; MADV_POPULATE_WRITE faults pages in without changing
        // their contents.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().cast(),
                self.len_bytes,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(MapError::Populate {
                region: self.region,
                extent: self.extent,
                source: err,
            });
        }
        // Fallback: a second, populated mapping of the same range replaces
        // the first, which nothing refers to yet. (Not MAP_FIXED over the old
        // range: a failed MAP_FIXED may leave a hole that another thread's
        // mmap could fill before our drop unmapped it.)
        let fresh = mmap_shared(self.len_bytes, true, libc::MAP_POPULATE, fd, offset).map_err(
            |source| MapError::Populate {
                region: self.region,
                extent: self.extent,
                source,
            },
        )?;
        let old = std::mem::replace(&mut self.base, fresh);
        // SAFETY: `old` is our previous mapping of `len_bytes`; no view or
        // observer knows its address, and `self` now owns `fresh` instead.
        unsafe { libc::munmap(old.as_ptr().cast(), self.len_bytes) };
        if self.kind == BackingKind::Tmpfs {
            // Late for the pages just populated, but still governs the
            // mapping (this path only runs on kernels before 5.14).
            self.advise_hugepage();
        }
        Ok(())
    }

    pub fn region(&self) -> RegionId {
        self.region
    }

    pub fn extent(&self) -> Extent {
        self.extent
    }

    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// What observers are told: id, extent, base address, length.
    pub fn info(&self) -> MapInfo {
        MapInfo {
            region: self.region,
            extent: self.extent,
            base_addr: self.base.as_ptr() as usize,
            len_bytes: self.len_bytes,
            writable: self.writable,
        }
    }

    /// False for a read-only mapping ([`Access::ReadOnly`]).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Refuses a write to a read-only mapping.
    fn check_writable(&self) -> Result<(), MapError> {
        if self.writable {
            Ok(())
        } else {
            Err(MapError::ReadOnly {
                region: self.region,
            })
        }
    }

    /// The first mapped byte, for the C ABI and device registration only —
    /// the deliberate exception to "raw pointers stay in the map types" (see
    /// the module docs). Valid while `self` lives, for the `len_bytes` bytes
    /// from it; reading or writing through it is bound by the same contracts
    /// as [`MappedRegion::map`] and [`MappedRegion::page_mut`].
    pub fn ffi_base_ptr(&self) -> *const u8 {
        self.base.as_ptr()
    }

    /// Copies the bytes at `offset` into `dst` for bytes another process
    /// may be writing meanwhile (a pool's header, whose lease slots its
    /// manager rewrites), which no [`PageView`] may cover: the lines are
    /// first made current under `mode` ([`crate::visibility::acquire`]'s
    /// instructions, by address), then read with volatile loads — the copy
    /// may be torn, so the caller must check it (a checksum).
    pub fn read_shared(
        &self,
        offset: usize,
        dst: &mut [u8],
        mode: crate::visibility::Visibility,
    ) -> Result<(), MapError> {
        let start = self.shared_range(offset, dst.len())?;
        crate::visibility::acquire_addresses(mode, start, dst.len());
        for (i, b) in dst.iter_mut().enumerate() {
            // SAFETY: `offset + i < offset + dst.len() <= len_bytes`
            // (`shared_range`), so the byte lies in this live mapping; a
            // volatile load of a `u8` has no alignment requirement, and
            // forms no reference another process's concurrent writes could
            // invalidate.
            *b = unsafe { std::ptr::read_volatile(self.base.as_ptr().add(offset + i)) };
        }
        Ok(())
    }

    /// Writes `src` at `offset`, for bytes other hosts may be reading or
    /// writing nearby meanwhile (a pool's header on a device, whose other
    /// lease slots their managers rewrite), which no [`PageViewMut`] may
    /// cover: volatile stores, then the written lines made visible under
    /// `mode` ([`crate::visibility::publish`]'s instructions, by address).
    ///
    /// # Safety
    ///
    /// No reference to these bytes may exist in this process while it runs
    /// (no [`PageView`] or [`PageViewMut`] over them); other processes'
    /// accesses form none.
    pub unsafe fn write_shared(
        &self,
        offset: usize,
        src: &[u8],
        mode: crate::visibility::Visibility,
    ) -> Result<(), MapError> {
        self.check_writable()?;
        let start = self.shared_range(offset, src.len())?;
        for (i, &b) in src.iter().enumerate() {
            // SAFETY: `offset + i < offset + src.len() <= len_bytes`
            // (`shared_range`), so the byte lies in this live mapping; a
            // volatile store of a `u8` has no alignment requirement, and
            // the caller guarantees no reference of this process covers it.
            unsafe { std::ptr::write_volatile(self.base.as_ptr().add(offset + i), b) };
        }
        crate::visibility::publish_addresses(mode, start, src.len());
        Ok(())
    }

    /// The address of the `len` bytes at `offset`, after checking they lie
    /// in the mapping ([`read_shared`](Self::read_shared),
    /// [`write_shared`](Self::write_shared)).
    fn shared_range(&self, offset: usize, len: usize) -> Result<usize, MapError> {
        offset
            .checked_add(len)
            .filter(|&end| end <= self.len_bytes)
            .ok_or(MapError::LenExceedsPage {
                len_bytes: offset.saturating_add(len),
                page_size_bytes: self.len_bytes,
            })?;
        Ok(self.base.as_ptr() as usize + offset)
    }

    /// How many whole pages of `page_size_bytes` the region holds (≥ 1).
    pub fn page_count(&self, page_size_bytes: usize) -> Result<u32, MapError> {
        check_page_size(page_size_bytes as u64)?;
        let pages = self.len_bytes / page_size_bytes;
        if pages == 0 {
            return Err(MapError::RegionSmallerThanPage {
                region: self.region,
                page_size_bytes,
                region_len_bytes: self.len_bytes,
            });
        }
        // Page indices are u32 on the wire: a count beyond that reads as
        // u32::MAX, which the page allocator refuses like any region of more
        // than its `MAX_PAGES` (`TooManyPages`), so such a region is not
        // used at all.
        Ok(u32::try_from(pages).unwrap_or(u32::MAX))
    }

    /// A read view of the first `len_bytes` of page `index`.
    pub fn page(
        &self,
        page_size_bytes: usize,
        index: PageIndex,
        len_bytes: usize,
    ) -> Result<PageView<'_>, MapError> {
        let start = self.page_start(page_size_bytes, index, len_bytes)?;
        // SAFETY: `page_start` proved `start + len_bytes <= self.len_bytes`,
        // so the range lies in our live mapping, which the returned lifetime
        // borrows; `map`'s contract rules out writes while this view exists.
        let bytes = unsafe {
            std::slice::from_raw_parts(self.base.as_ptr().add(start).cast_const(), len_bytes)
        };
        Ok(PageView { bytes, index })
    }

    /// A write view of the first `len_bytes` of page `index`.
    ///
    /// # Safety
    ///
    /// The caller holds the exclusive right to this page for the lifetime of
    /// the returned view: no other view ([`PageView`] or [`PageViewMut`], of
    /// any page size) of any of its bytes exists or is created meanwhile, and
    /// no other process touches them — e.g. the page allocator handed the page
    /// out and it has not been published (registered) yet, so no reader can
    /// know it.
    pub unsafe fn page_mut(
        &self,
        page_size_bytes: usize,
        index: PageIndex,
        len_bytes: usize,
    ) -> Result<PageViewMut<'_>, MapError> {
        self.check_writable()?;
        let start = self.page_start(page_size_bytes, index, len_bytes)?;
        // SAFETY: `page_start` proved the range lies in our live mapping,
        // which the returned lifetime borrows; the caller guarantees that no
        // other reference to these bytes exists while the view lives.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(start), len_bytes) };
        Ok(PageViewMut { bytes, index })
    }

    /// Byte offset of page `index`, after checking the page and view fit.
    fn page_start(
        &self,
        page_size_bytes: usize,
        index: PageIndex,
        len_bytes: usize,
    ) -> Result<usize, MapError> {
        check_page_size(page_size_bytes as u64)?;
        if len_bytes > page_size_bytes {
            return Err(MapError::LenExceedsPage {
                len_bytes,
                page_size_bytes,
            });
        }
        let out_of_range = || MapError::PageOutOfRange {
            region: self.region,
            index,
            page_size_bytes,
            region_len_bytes: self.len_bytes,
        };
        let start = (index.0 as usize)
            .checked_mul(page_size_bytes)
            .ok_or_else(out_of_range)?;
        match start.checked_add(page_size_bytes) {
            Some(end) if end <= self.len_bytes => Ok(start),
            _ => Err(out_of_range()),
        }
    }

    /// How many base pages of the mapping are resident (`mincore`): for a
    /// shared mapping, pages present in the pool file, by any process.
    pub fn resident_pages(&self) -> io::Result<usize> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let base_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let base_page = usize::try_from(base_page)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| io::Error::other("sysconf(_SC_PAGESIZE) failed"))?;
        let mut vec = vec![0u8; self.len_bytes.div_ceil(base_page)];
        // SAFETY: the range is our live mapping (page-aligned base), and `vec`
        // has one byte per base page of it, as mincore writes.
        let rc =
            unsafe { libc::mincore(self.base.as_ptr().cast(), self.len_bytes, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(vec.iter().filter(|&&b| b & 1 != 0).count())
    }
}

/// A new `MAP_SHARED` mapping of `len_bytes` of `fd` at `offset`, placed by
/// the kernel, read-write or read-only, with `extra_flags` (e.g.
/// `MAP_POPULATE`).
fn mmap_shared(
    len_bytes: usize,
    writable: bool,
    extra_flags: libc::c_int,
    fd: libc::c_int,
    offset: libc::off_t,
) -> io::Result<NonNull<u8>> {
    // SAFETY: without MAP_FIXED the kernel places the mapping in free address
    // space, so it aliases nothing; `fd` is open for the call (the caller
    // borrows it); the kernel checks offset and length against the object.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            if writable {
                libc::PROT_READ | libc::PROT_WRITE
            } else {
                libc::PROT_READ
            },
            libc::MAP_SHARED | extra_flags,
            fd,
            offset,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(addr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned address 0"))
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        let info = self.info();
        for observer in self.notified.iter().rev() {
            observer.before_unmap(&info);
        }
        // SAFETY: `base..base+len` is our own mapping; every view borrows
        // `self`, so none outlives this point, and observers were told.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes) };
        if rc != 0 {
            tracing::error!(
                region = %self.region,
                err = %io::Error::last_os_error(),
                "munmap failed; the mapping leaks"
            );
        }
    }
}

/// A read view of (the first bytes of) one page of a mapped region.
pub struct PageView<'a> {
    bytes: &'a [u8],
    index: PageIndex,
}

impl<'a> PageView<'a> {
    pub fn index(&self) -> PageIndex {
        self.index
    }

    /// The bytes, for as long as the mapping is borrowed.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl std::ops::Deref for PageView<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl fmt::Debug for PageView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageView")
            .field("index", &self.index)
            .field("len_bytes", &self.bytes.len())
            .finish()
    }
}

/// A write view of (the first bytes of) one page of a mapped region.
pub struct PageViewMut<'a> {
    bytes: &'a mut [u8],
    index: PageIndex,
}

impl PageViewMut<'_> {
    pub fn index(&self) -> PageIndex {
        self.index
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.bytes
    }

    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl std::ops::Deref for PageViewMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl std::ops::DerefMut for PageViewMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl fmt::Debug for PageViewMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageViewMut")
            .field("index", &self.index)
            .field("len_bytes", &self.bytes.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::tests::ShmPath;
    use crate::backing::{OpenOptions, open};
    use std::sync::Mutex;

    const MIB: u64 = 1 << 20;

    fn pool(tag: &str, size_bytes: u64) -> (ShmPath, Arc<dyn Backing>) {
        let path = ShmPath::new(tag);
        let backing = open(&path.0, &OpenOptions::new().create_size_bytes(size_bytes))
            .expect("create test pool");
        (path, backing)
    }

    /// Maps for a test. Tests honour `map`'s contract: they write only pages
    /// they do not read concurrently.
    fn map(
        backing: &dyn Backing,
        region: u64,
        extent: Extent,
        populate: Populate,
        observers: &MapObservers,
    ) -> Result<MappedRegion, MapError> {
        // SAFETY: each test writes a page only through one view at a time and
        // never truncates its pool file while mapped.
        unsafe { MappedRegion::map(backing, RegionId(region), extent, populate, observers) }
    }

    /// Region 1 (the pool's first 2 MiB) mapped writable, `bytes` written
    /// at the start of its 4 KiB page `page`, then mapped again read-only.
    fn published_then_read_only(
        backing: &dyn Backing,
        observers: &MapObservers,
        page: u32,
        bytes: &[u8],
    ) -> (MappedRegion, MappedRegion) {
        let extent = Extent::new(0, 2 * MIB);
        let writer = map(backing, 1, extent, Populate::Eager, observers).expect("writer");
        {
            // SAFETY: no other view of the page exists while this one lives.
            let mut view =
                unsafe { writer.page_mut(4096, PageIndex(page), bytes.len()) }.expect("page");
            view.as_mut_bytes().copy_from_slice(bytes);
        }
        // SAFETY: nothing writes the page once the reader exists.
        let reader =
            unsafe { MappedRegion::map_read_only(backing, RegionId(1), extent, observers) }
                .expect("reader");
        (writer, reader)
    }

    #[test]
    fn a_read_only_mapping_reads_what_a_writer_published_and_refuses_every_write() {
        let (_path, backing) = pool("read-only", 4 * MIB);
        let observers = MapObservers::new();
        let recorder = Arc::new(Recorder::default());
        observers.register(recorder.clone()).expect("register");
        let (writer, reader) = published_then_read_only(&*backing, &observers, 1, b"peer");
        assert!(writer.is_writable() && !reader.is_writable());
        let told: Vec<bool> = recorder.take().iter().map(|(_, i)| i.writable).collect();
        assert_eq!(
            told,
            vec![true, false],
            "observers learn which mapping is read-only"
        );
        assert_eq!(
            reader.page(4096, PageIndex(1), 4).expect("view").as_bytes(),
            b"peer"
        );
        let mut shared = [0u8; 4];
        reader
            .read_shared(4096, &mut shared, crate::visibility::Visibility::Flush)
            .expect("a read (clflushopt is checked as a load) works read-only");
        assert_eq!(&shared, b"peer");

        // SAFETY: refused before any byte is touched.
        let err = unsafe { reader.page_mut(4096, PageIndex(1), 4) }.expect_err("read-only");
        assert!(
            matches!(
                err,
                MapError::ReadOnly {
                    region: RegionId(1)
                }
            ),
            "{err}"
        );
        // SAFETY: as above.
        let err =
            unsafe { reader.write_shared(4096, b"junk", crate::visibility::Visibility::Coherent) }
                .expect_err("read-only");
        assert!(matches!(err, MapError::ReadOnly { .. }), "{err}");
        // SAFETY: refused before mapping.
        let err = unsafe {
            MappedRegion::map_with(
                &*backing,
                RegionId(2),
                Extent::new(2 * MIB, 2 * MIB),
                Populate::Eager,
                Access::ReadOnly,
                &observers,
            )
        }
        .expect_err("eager population writes");
        assert!(matches!(err, MapError::PopulateReadOnly { .. }), "{err}");
        assert_eq!(
            reader.page(4096, PageIndex(1), 4).expect("view").as_bytes(),
            b"peer",
            "nothing was written"
        );
    }

    #[test]
    fn a_stray_write_through_a_read_only_mappings_address_faults_instead_of_corrupting() {
        let (_path, backing) = pool("read-only-fault", 2 * MIB);
        let (_writer, reader) =
            published_then_read_only(&*backing, &MapObservers::new(), 0, b"mine");
        let addr = reader.ffi_base_ptr().cast_mut();
        // SAFETY: the child only does async-signal-safe work (one store,
        // then `_exit`); the parent waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // The engine's bug this guards against: a write through a
            // peer's address. It must fault (SIGSEGV) before the exit.
            // SAFETY: deliberately unsound in the child only, which dies.
            unsafe {
                // No core file for the expected fault.
                let none = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &none);
                std::ptr::write_volatile(addr, b'X');
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a live out slot.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
            "the stray write must fault, status {status:#x}"
        );
        assert_eq!(
            reader.page(4096, PageIndex(0), 4).expect("view").as_bytes(),
            b"mine",
            "the published bytes are intact"
        );
    }

    #[test]
    fn eager_mapping_is_resident_and_lazy_mapping_is_not() {
        let (_path, backing) = pool("populate", 8 * MIB);
        let observers = MapObservers::new();
        let lazy = map(
            &*backing,
            1,
            Extent::new(0, 4 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect("lazy map");
        assert_eq!(lazy.resident_pages().expect("mincore"), 0);
        let eager = map(
            &*backing,
            2,
            Extent::new(4 * MIB, 4 * MIB),
            Populate::Eager,
            &observers,
        )
        .expect("eager map");
        assert_eq!(
            eager.resident_pages().expect("mincore"),
            (4 * MIB / 4096) as usize
        );
        // Touching one page of the lazy region makes exactly it resident.
        {
            // SAFETY: page 0 of region 1 is viewed by nothing else in this test.
            let mut page = unsafe { lazy.page_mut(4096, PageIndex(0), 4096) }.expect("page 0");
            page[0] = 1;
        }
        assert_eq!(lazy.resident_pages().expect("mincore"), 1);
    }

    #[test]
    fn writes_through_one_mapping_are_seen_through_another() {
        let (_path, backing) = pool("shared", 4 * MIB);
        let observers = MapObservers::new();
        let extent = Extent::new(2 * MIB, 2 * MIB);
        let writer = map(&*backing, 1, extent, Populate::Eager, &observers).expect("map writer");
        let reader = map(&*backing, 1, extent, Populate::Lazy, &observers).expect("map reader");
        {
            // SAFETY: page 3 is written here and read only after the view is gone.
            let mut page = unsafe { writer.page_mut(64 * 1024, PageIndex(3), 100) }.expect("page");
            page.copy_from_slice(&[7u8; 100]);
        }
        let view = reader
            .page(64 * 1024, PageIndex(3), 100)
            .expect("read view");
        assert_eq!(view.as_bytes(), &[7u8; 100][..]);
        assert_eq!(view.index(), PageIndex(3));
    }

    #[test]
    fn distinct_pages_of_one_region_are_written_from_several_threads() {
        let (_path, backing) = pool("threads", 2 * MIB);
        let observers = MapObservers::new();
        let region = map(
            &*backing,
            1,
            Extent::new(0, 2 * MIB),
            Populate::Eager,
            &observers,
        )
        .expect("map");
        let page_size = 64 * 1024;
        let pages = region.page_count(page_size).expect("page count");
        assert_eq!(pages, 32);
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let region = &region;
                s.spawn(move || {
                    for i in (t..pages).step_by(4) {
                        // SAFETY: thread t alone writes pages i ≡ t (mod 4).
                        let mut page =
                            unsafe { region.page_mut(page_size, PageIndex(i), page_size) }
                                .expect("page in range");
                        page.fill(i as u8);
                    }
                });
            }
        });
        for i in 0..pages {
            let view = region
                .page(page_size, PageIndex(i), page_size)
                .expect("page");
            assert!(view.iter().all(|&b| b == i as u8), "page {i}");
        }
    }

    #[test]
    fn views_are_bounds_checked() {
        let (_path, backing) = pool("bounds", 2 * MIB);
        let observers = MapObservers::new();
        let region = map(
            &*backing,
            9,
            Extent::new(0, 2 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect("map");
        let page = 512 * 1024;
        assert!(region.page(page, PageIndex(3), page).is_ok());
        assert!(matches!(
            region.page(page, PageIndex(4), 1),
            Err(MapError::PageOutOfRange {
                index: PageIndex(4),
                ..
            })
        ));
        assert!(matches!(
            region.page(page, PageIndex(u32::MAX), 1),
            Err(MapError::PageOutOfRange { .. })
        ));
        assert!(matches!(
            region.page(page, PageIndex(0), page + 1),
            Err(MapError::LenExceedsPage { .. })
        ));
        assert!(matches!(
            region.page(1000, PageIndex(0), 10),
            Err(MapError::Layout(LayoutError::MisalignedPageSize {
                page_size_bytes: 1000
            }))
        ));
        assert!(matches!(
            region.page_count(4 * MIB as usize),
            Err(MapError::RegionSmallerThanPage { .. })
        ));
    }

    #[test]
    fn shared_reads_copy_the_current_bytes_within_the_mapping_only() {
        use crate::visibility::Visibility;
        let (_path, backing) = pool("shared-read", 2 * MIB);
        let observers = MapObservers::new();
        let region = map(
            &*backing,
            9,
            Extent::new(0, 2 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect("map");
        {
            // SAFETY: this test is the region's only user; the page is in it.
            let mut page = unsafe { region.page_mut(4096, PageIndex(1), 4096) }.expect("page");
            for (i, b) in page.iter_mut().enumerate() {
                *b = i as u8;
            }
        }
        for mode in [Visibility::Coherent, Visibility::Flush] {
            let mut out = [0u8; 100];
            region.read_shared(4096 + 30, &mut out, mode).unwrap();
            assert!(out.iter().enumerate().all(|(i, &b)| b == (30 + i) as u8));
            let mut tail = [0u8; 8];
            region
                .read_shared(2 * MIB as usize - 8, &mut tail, mode)
                .unwrap();
            assert!(matches!(
                region.read_shared(2 * MIB as usize - 7, &mut tail, mode),
                Err(MapError::LenExceedsPage { .. })
            ));
            assert!(region.read_shared(usize::MAX, &mut tail, mode).is_err());
        }
    }

    #[test]
    fn shared_writes_land_within_the_mapping_only_and_are_seen_by_another_mapping() {
        use crate::visibility::Visibility;
        let (_path, backing) = pool("shared-write", 2 * MIB);
        let observers = MapObservers::new();
        let map_it = |id| {
            map(
                &*backing,
                id,
                Extent::new(0, 2 * MIB),
                Populate::Lazy,
                &observers,
            )
            .expect("map")
        };
        let (writer, reader) = (map_it(10), map_it(11));
        for (k, mode) in [Visibility::Coherent, Visibility::Flush]
            .into_iter()
            .enumerate()
        {
            let src: Vec<u8> = (0..100).map(|i| (i + k) as u8).collect();
            // SAFETY: no view of these bytes exists in this test.
            unsafe { writer.write_shared(4096 + 30, &src, mode) }.expect("in range");
            let mut out = [0u8; 100];
            reader.read_shared(4096 + 30, &mut out, mode).unwrap();
            assert_eq!(out[..], src[..]);
            // The bytes around are untouched.
            let mut edge = [0xffu8; 2];
            reader.read_shared(4096 + 29, &mut edge[..1], mode).unwrap();
            reader
                .read_shared(4096 + 130, &mut edge[1..], mode)
                .unwrap();
            assert_eq!(edge, [0, 0]);
            let end = 2 * MIB as usize;
            // SAFETY: as above.
            unsafe { writer.write_shared(end - 8, &[7; 8], mode) }.expect("the last bytes");
            // SAFETY: as above.
            let over = unsafe { writer.write_shared(end - 7, &[7; 8], mode) };
            assert!(matches!(over, Err(MapError::LenExceedsPage { .. })));
            // SAFETY: as above.
            assert!(unsafe { writer.write_shared(usize::MAX, &[1], mode) }.is_err());
        }
    }

    #[test]
    fn misaligned_or_out_of_pool_regions_are_refused() {
        let (_path, backing) = pool("badregion", 4 * MIB);
        let observers = MapObservers::new();
        let err = map(
            &*backing,
            1,
            Extent::new(4096, 2 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect_err("misaligned offset");
        assert!(
            matches!(err, MapError::Layout(LayoutError::MisalignedRegion { .. })),
            "{err}"
        );
        let err = map(
            &*backing,
            1,
            Extent::new(2 * MIB, 4 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect_err("beyond the pool");
        assert!(
            matches!(err, MapError::Layout(LayoutError::RegionOutOfBounds { .. })),
            "{err}"
        );
    }

    #[derive(Default)]
    struct Recorder {
        events: Mutex<Vec<(&'static str, MapInfo)>>,
    }

    impl MapObserver for Recorder {
        fn on_map(&self, info: &MapInfo) {
            self.events
                .lock()
                .expect("recorder lock")
                .push(("map", *info));
        }
        fn before_unmap(&self, info: &MapInfo) {
            // The mapping must still be there: read its first byte.
            // SAFETY: before_unmap runs before munmap, so the address is
            // mapped; a volatile read of one byte changes nothing.
            let _ = unsafe { std::ptr::read_volatile(info.base_addr as *const u8) };
            self.events
                .lock()
                .expect("recorder lock")
                .push(("unmap", *info));
        }
    }

    impl Recorder {
        fn take(&self) -> Vec<(&'static str, MapInfo)> {
            std::mem::take(&mut *self.events.lock().expect("recorder lock"))
        }
    }

    fn is_mapped(path: &std::path::Path) -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
        let needle = path.to_str().expect("utf-8 path");
        maps.lines().any(|l| l.ends_with(needle))
    }

    #[test]
    fn observers_are_told_once_on_map_and_once_before_unmap() {
        let (path, backing) = pool("observers", 4 * MIB);
        let observers = MapObservers::new();
        let first = Arc::new(Recorder::default());
        let first_dyn: Arc<dyn MapObserver> = first.clone();
        observers.register(first_dyn.clone()).expect("register");

        let region = map(
            &*backing,
            5,
            Extent::new(2 * MIB, 2 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect("map");
        let info = region.info();
        assert_eq!(info.base_addr, region.ffi_base_ptr() as usize);
        assert_eq!(info.len_bytes, 2 * MIB as usize);
        assert_eq!(first.take(), vec![("map", info)]);

        // Registered after the map: never told about this region.
        let late = Arc::new(Recorder::default());
        observers.register(late.clone()).expect("register late");
        // Unregistered after the map: still told before the unmap.
        assert!(observers.unregister(&first_dyn));
        assert!(!observers.unregister(&first_dyn));

        assert!(is_mapped(&path.0));
        drop(region);
        assert!(!is_mapped(&path.0), "region is unmapped on drop");
        assert_eq!(first.take(), vec![("unmap", info)]);
        assert!(late.take().is_empty());
    }

    #[test]
    fn observer_list_is_bounded() {
        let observers = MapObservers::new();
        for _ in 0..MAX_MAP_OBSERVERS {
            observers
                .register(Arc::new(Recorder::default()))
                .expect("within limit");
        }
        assert!(matches!(
            observers.register(Arc::new(Recorder::default())),
            Err(MapError::TooManyObservers {
                limit: MAX_MAP_OBSERVERS
            })
        ));
    }

    #[test]
    fn tmpfs_regions_ask_for_transparent_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("skipping: this kernel has no transparent huge pages");
            return;
        }
        let (path, backing) = pool("thp", 2 * MIB);
        let observers = MapObservers::new();
        let region = map(
            &*backing,
            1,
            Extent::new(0, 2 * MIB),
            Populate::Lazy,
            &observers,
        )
        .expect("map");
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read smaps");
        let needle = path.0.to_str().expect("utf-8 path");
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|l| !l.trim_end().ends_with(needle))
            .skip(1)
            .find(|l| l.starts_with("VmFlags:"))
            .expect("VmFlags of the mapping");
        assert!(entry.split_whitespace().any(|f| f == "hg"), "{entry}");
        drop(region);
    }
}
