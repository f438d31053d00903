//! The regions a client maps: its own (mapped eagerly, with a page
//! allocator) and its peers' (mapped lazily on first lookup, cached).
//!
//! Both live in epoch-published [`RegionTable`]s (one per layout for owned
//! regions, one for peers), read without locks on every allocation and
//! lookup. A mapping is shared by `Arc` between its table entry and the
//! views that read it (read guards, page leases); the table never clones it
//! for a reader, so its count moves only when a view is created or dropped.
//!
//! **Who unmaps.** A region leaves its table (returned, refused at
//! reattach, evicted from the peer cache); the table hands the entry back
//! once no reader can reach it, and its mapping joins the [`Retired`] list.
//! The maintenance thread drops a retired mapping once it holds the last
//! reference — when the last view of it is gone — so `munmap` and the
//! engines' `before_unmap` callbacks run there, never under a reader and
//! never while a view exists.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cxlkv_controlplane::proto::{Layout, RegionDesc, RegionToken};
use cxlkv_dataplane::alloc::PageAllocator;
use cxlkv_dataplane::backing::Extent;
use cxlkv_dataplane::map::{MapObservers, MappedRegion, Populate};
use cxlkv_dataplane::visibility::Visibility;
use parking_lot::Mutex;

use super::error::ClientError;
use super::pools::Pool;

/// A region this client owns: its mapping, its page allocator, and what
/// proves it is ours on reattach.
#[derive(Debug)]
pub(crate) struct OwnedRegion {
    pub desc: RegionDesc,
    pub layout: Layout,
    pub token: RegionToken,
    pub mapping: Arc<MappedRegion>,
    pub alloc: PageAllocator,
    pub page_size_bytes: usize,
    pub visibility: Visibility,
    /// Part of the layout's initial reservation: never returned while the
    /// client lives.
    pub initial: bool,
    /// Milliseconds (client clock) since which every page has been free;
    /// 0 while some page is in use. Maintenance-thread only.
    pub idle_since_ms: AtomicU64,
    /// The directory no longer confirms this region as ours (refused at a
    /// reattach, e.g. after the instance expired): leases still holding a
    /// page of it must not write any more.
    pub revoked: AtomicBool,
}

impl OwnedRegion {
    /// Writes page `index`'s cache lines back to the pool when readers may
    /// sit on hosts without coherence (`Visibility::Flush`); nothing on a
    /// coherent pool. For bytes written and never published (an aborted
    /// lease): left dirty in this host's cache, they could be written back
    /// whenever the line is evicted — after the page, or the whole region,
    /// has gone to another writer — over its published data.
    pub fn write_back_page(&self, index: cxlkv_dataplane::ids::PageIndex) {
        if self.visibility != Visibility::Flush {
            return;
        }
        if let Ok(page) = self
            .mapping
            .page(self.page_size_bytes, index, self.page_size_bytes)
        {
            write_back(self.visibility, page.as_bytes());
        }
    }

    /// [`write_back_page`](Self::write_back_page) for every page: before the
    /// region goes back to the pool, which may grant it to another host.
    pub fn write_back_all(&self) {
        if self.visibility != Visibility::Flush {
            return;
        }
        for index in 0..self.alloc.page_count() {
            self.write_back_page(cxlkv_dataplane::ids::PageIndex(index));
        }
    }
}

/// Publishes (writes back, under `Visibility::Flush`) `bytes` of an owned
/// page: every publication and write-back of the client's own pages goes
/// through here.
pub(crate) fn write_back(visibility: Visibility, bytes: &[u8]) {
    #[cfg(test)]
    test_recorder::record(bytes);
    cxlkv_dataplane::visibility::publish(visibility, bytes);
}

/// Test-only: the address ranges this thread published or wrote back.
#[cfg(test)]
pub(crate) mod test_recorder {
    use std::cell::RefCell;
    use std::ops::Range;

    thread_local! {
        static WRITTEN_BACK: RefCell<Vec<Range<usize>>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn record(bytes: &[u8]) {
        let start = bytes.as_ptr() as usize;
        WRITTEN_BACK.with_borrow_mut(|w| w.push(start..start + bytes.len()));
    }

    /// The ranges recorded on this thread since the last call.
    pub(crate) fn take() -> Vec<Range<usize>> {
        WRITTEN_BACK.with_borrow_mut(std::mem::take)
    }
}

/// A peer's region, mapped for reading.
#[derive(Debug)]
pub(crate) struct PeerRegion {
    pub desc: RegionDesc,
    pub mapping: Arc<MappedRegion>,
    pub visibility: Visibility,
    /// Stamp of the last lookup that resolved into it (for the cache's
    /// least-recently-used eviction).
    pub last_used: AtomicU64,
}

impl PeerRegion {
    pub fn touch(&self, stamp: u64) {
        // Relaxed: an eviction hint; a stale stamp only picks a worse victim.
        if self.last_used.load(Ordering::Relaxed) != stamp {
            self.last_used.store(stamp, Ordering::Relaxed);
        }
    }
}

fn extent_of(desc: &RegionDesc) -> Extent {
    Extent::new(desc.offset_bytes, desc.len_bytes)
}

/// Maps a region granted to this client, populated for writing.
pub(crate) fn map_owned(
    pool: &Pool,
    desc: RegionDesc,
    layout: Layout,
    token: RegionToken,
    observers: &MapObservers,
    initial: bool,
) -> Result<OwnedRegion, ClientError> {
    let page_size_bytes = page_size(&desc, &layout)?;
    // SAFETY: the client upholds the cxlkv page protocol for every mapping
    // it makes: bytes of a page are written only through a `PageLease`,
    // which exists only for a page this client's allocator handed out and
    // that is not registered yet (so no reader anywhere knows it); pages are
    // read only through read guards on a registered, published key whose pin
    // (held by the guard) keeps the directory from deleting it, so its
    // owner cannot reallocate and rewrite it while the view exists.
    let mapping = unsafe {
        MappedRegion::map(
            pool.backing.as_ref(),
            desc.region_id(),
            extent_of(&desc),
            Populate::Eager,
            observers,
        )
    }?;
    let pages = mapping.page_count(page_size_bytes)?;
    let alloc = PageAllocator::new(pages)?;
    Ok(OwnedRegion {
        desc,
        layout,
        token,
        mapping: Arc::new(mapping),
        alloc,
        page_size_bytes,
        visibility: pool.visibility,
        initial,
        idle_since_ms: AtomicU64::new(0),
        revoked: AtomicBool::new(false),
    })
}

/// Maps a peer's region read-only and lazily (pages fault in as they are
/// read).
pub(crate) fn map_peer(
    pool: &Pool,
    desc: RegionDesc,
    observers: &MapObservers,
    stamp: u64,
) -> Result<PeerRegion, ClientError> {
    // SAFETY: as in `map_owned`: this client only reads peer pages through
    // read guards holding a pin on a registered, published key. Read-only:
    // a stray write into a peer's pages (an engine's bug through a C
    // address) faults instead of corrupting what the peer published.
    let mapping = unsafe {
        MappedRegion::map_read_only(
            pool.backing.as_ref(),
            desc.region_id(),
            extent_of(&desc),
            observers,
        )
    }?;
    Ok(PeerRegion {
        desc,
        mapping: Arc::new(mapping),
        visibility: pool.visibility,
        last_used: AtomicU64::new(stamp),
    })
}

fn page_size(desc: &RegionDesc, layout: &Layout) -> Result<usize, ClientError> {
    if desc.page_size_bytes != layout.page_size_bytes {
        return Err(ClientError::PageSizeMismatch {
            region: desc.region_id(),
            region_page_bytes: desc.page_size_bytes,
            layout_page_bytes: layout.page_size_bytes,
        });
    }
    usize::try_from(desc.page_size_bytes).map_err(|_| ClientError::InvalidPageSize {
        page_size_bytes: desc.page_size_bytes,
        max_bytes: cxlkv_controlplane::proto::MAX_PAGE_BYTES,
    })
}

/// Mappings out of every table, waiting for their last view to go.
#[derive(Debug, Default)]
pub(crate) struct Retired {
    list: Mutex<Vec<Arc<MappedRegion>>>,
}

impl Retired {
    pub fn push(&self, mapping: Arc<MappedRegion>) {
        self.list.lock().push(mapping);
    }

    /// Drops (unmaps) every retired mapping nobody else holds; returns how
    /// many are still waiting. The drops run outside the lock.
    pub fn sweep(&self) -> usize {
        let unmapped: Vec<Arc<MappedRegion>> = {
            let mut list = self.list.lock();
            // Only this list holds a mapping whose strong count is 1, and
            // there are no weak references: nobody can take a new one.
            let (last, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut *list)
                .into_iter()
                .partition(|m| Arc::strong_count(m) == 1);
            *list = waiting;
            last
        };
        drop(unmapped);
        self.list.lock().len()
    }
}
