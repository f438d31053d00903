//! Layouts: a page size plus a fingerprint, each with its own regions and
//! its own key space (DESIGN §3).
//!
//! A [`LayoutHandle`] is what an engine holds per model: it allocates pages
//! from the layout's regions, registers, looks up, tests and deletes keys
//! of that layout only — a key of another layout is another key, so a
//! reader of model B is never handed model A's page. A client may use
//! several layouts; asking again for a layout it already has returns a
//! handle to the same one.
//!
//! **Memory.** Creating a layout takes its `initial_reservation_bytes` in
//! regions of `region_size_bytes` (default max(64 MiB, one page), rounded up
//! to the pool alignment), mapped eagerly. Allocation is lock-free: the
//! regions are read from an epoch-published table and each has a lock-free
//! page allocator; regions are tried lowest id first, which keeps later
//! regions empty so that idle ones can be returned. When every region is
//! full, `auto_expand` takes one more region (one thread at a time; the
//! others retry their allocation once it is in); without it the allocation
//! fails with `OutOfMemory`. The client-side `quota_bytes` bounds the
//! regions taken, across layouts.
//!
//! **A grant whose answer was lost.** A region request whose attempts all
//! go unanswered may have been granted: the directory then holds a region
//! for this instance that the client knows nothing of, and that would stay
//! the instance's, unused, for as long as the instance lives. So the
//! request is kept with its sequence number (`UnresolvedRegion`) and the
//! maintenance thread sends it again until it is answered; the directory
//! answers a retried number from its reply cache, and a grant is then
//! adopted as if its first answer had arrived (mapped, allocatable, and
//! returned later like any idle region). A request refused on a retry
//! never ran; one whose number the directory no longer remembers
//! (`SequenceTooOld`, `ReplyEvicted`) cannot be resolved and is dropped
//! with a warning. (Since reliability entry 142 the directory keeps a
//! granted region's reply whatever its cache's byte limit until the client
//! says it has it, and the client holds the number back in its window
//! meanwhile, so this takes a directory older than that fix.) A directory restart voids the number, and the request
//! is sent again as a new one (a grant the old directory made is the
//! reattach's business: `session.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cxlkv_controlplane::proto::{
    self, ErrorCode, Layout, RegionGranted, RequestRegion, ReturnRegion,
};
use cxlkv_dataplane::backing::check_page_size;
use cxlkv_dataplane::ids::RegionId;
use cxlkv_dataplane::table::RegionTable;
use parking_lot::Mutex;

use super::Client;
use super::config::{DEFAULT_REGION_SIZE_BYTES, LayoutOptions, MAX_LAYOUTS, round_up};
use super::error::ClientError;
use super::lease::PageLease;
use super::regions::{self, OwnedRegion};
use super::rpc::{Fail, Mode};
use super::seq::SeqTicket;
use super::shared::Shared;

/// Most regions one allocation call may add to its layout.
const MAX_EXPANSIONS_PER_CALL: usize = 64;

/// Why an allocation is `OutOfMemory` in a layout created without
/// `auto_expand`, and what to do.
const OUT_OF_MEMORY_NO_EXPAND: &str = "the layout's regions are full and its auto_expand is off; \
     delete chunks (or drop unregistered leases), or create the layout with auto_expand \
     or a larger initial_reservation_bytes";
/// Why an allocation is `OutOfMemory` after it added
/// [`MAX_EXPANSIONS_PER_CALL`] regions (other threads took their pages, or
/// the batch needs more regions than that), and what to do.
const OUT_OF_MEMORY_EXPANDED: &str = "this call added as many regions as one call may \
     (other allocations took their pages, or the batch needs more regions than that); \
     ask for fewer pages per call, use a larger region_size_bytes, or retry";

/// Most region requests kept for resending while their outcome is unknown:
/// each holds its sequence number, and with it the window of numbers the
/// client may use. Beyond it the number is released, and a grant that may
/// have happened stays with the instance until it goes (logged).
const MAX_UNRESOLVED_REGIONS: usize = 8;

/// A region request whose answer was lost (module docs).
#[derive(Debug)]
pub(crate) struct UnresolvedRegion {
    ticket: SeqTicket,
    layout: Arc<LayoutState>,
}

/// Why a region taken out for return could not be put back.
#[derive(Debug)]
pub(crate) enum PutBackRefused {
    /// Revoked while away: no longer this instance's to use.
    Revoked(Arc<OwnedRegion>),
    /// The table refused it.
    Table(cxlkv_dataplane::table::TableError, Arc<OwnedRegion>),
}

/// What a `RegionGranted` says.
struct Grant {
    desc: proto::RegionDesc,
    layout: Layout,
    token: proto::RegionToken,
}

/// A `ReturnRegion` that did not succeed.
#[derive(Debug)]
pub(crate) struct ReturnFailed {
    pub error: ClientError,
    /// Whether the region certainly remains this instance's (the request
    /// was refused or never sent), so that its pages may be used again.
    pub still_ours: bool,
}

/// One layout's state, shared by its handles.
#[derive(Debug)]
pub(crate) struct LayoutState {
    pub ix: u32,
    pub layout: Layout,
    pub page_size_bytes: usize,
    /// Bytes of each region the layout takes (the creating call's option).
    region_size_bytes: AtomicU64,
    /// Whether a full layout takes one more region (the creating call's).
    auto_expand: AtomicBool,
    /// Held by the call creating the layout across its initial reservation;
    /// true once one succeeded. Until then the layout is not the client's:
    /// no handle to it exists, and the next call for it creates it (with
    /// its own options, keeping the regions a failed call took).
    created: Mutex<bool>,
    pub regions: RegionTable<Arc<OwnedRegion>>,
    /// Regions the maintenance thread took out of `regions` to return (see
    /// [`Away`]).
    pub away: Away,
    /// One expansion at a time (held across the region request: expansion
    /// is the slow path by design).
    pub expand_lock: Mutex<()>,
}

/// A layout of a [`Client`]: allocate, write, register, look up, delete.
/// Cheap to clone; keeps the client alive.
#[derive(Debug, Clone)]
pub struct LayoutHandle {
    pub(crate) client: Client,
    pub(crate) state: Arc<LayoutState>,
}

impl LayoutHandle {
    pub fn page_size_bytes(&self) -> u64 {
        self.state.layout.page_size_bytes
    }

    pub fn fingerprint(&self) -> u64 {
        self.state.layout.fingerprint
    }

    /// Bytes of the regions this layout holds now.
    pub fn region_bytes(&self) -> u64 {
        self.state
            .regions
            .read()
            .iter()
            .map(|(_, r)| r.desc.len_bytes)
            .sum()
    }

    /// Free pages in this layout's regions (a snapshot).
    pub fn free_pages(&self) -> u64 {
        self.state
            .regions
            .read()
            .iter()
            .map(|(_, r)| u64::from(r.alloc.free_pages()))
            .sum()
    }

    /// Frees the layout's allocators refused (stale generation, double or
    /// foreign): each one a free that would have been wrong, caught.
    pub fn refused_frees(&self) -> u64 {
        self.state
            .regions
            .read()
            .iter()
            .map(|(_, r)| {
                let s = r.alloc.stats();
                s.stale_frees + s.double_frees + s.foreign_frees
            })
            .sum()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.client.inner.shared
    }

    /// One writable page (see [`PageLease`]).
    pub fn alloc(&self) -> Result<PageLease, ClientError> {
        let mut leases = self.batch_alloc(1)?;
        Ok(leases
            .pop()
            .expect("invariant: batch_alloc(1) returns one lease"))
    }

    /// `n` writable pages, all or none: on failure every page taken is
    /// back in the allocator.
    pub fn batch_alloc(&self, n: usize) -> Result<Vec<PageLease>, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        if n > proto::MAX_BATCH {
            return Err(ClientError::BatchTooLarge {
                len: n,
                max: proto::MAX_BATCH,
            });
        }
        let mut leases = Vec::with_capacity(n);
        let mut expansions = 0;
        loop {
            self.state.take_pages(n, &mut leases, &self.client);
            if leases.len() == n {
                return Ok(leases);
            }
            let auto_expand = self.state.auto_expand();
            if !auto_expand || expansions >= MAX_EXPANSIONS_PER_CALL {
                // All or none: the pages taken go back before the count.
                drop(leases);
                return Err(ClientError::OutOfMemory {
                    page_size_bytes: self.state.layout.page_size_bytes,
                    requested: n,
                    free_pages: self.state.free_pages(),
                    reason: if auto_expand {
                        OUT_OF_MEMORY_EXPANDED
                    } else {
                        OUT_OF_MEMORY_NO_EXPAND
                    },
                });
            }
            shared.expand(&self.state, (n - leases.len()) as u64)?;
            expansions += 1;
        }
    }
}

/// The regions of a layout taken out of its table for return, from the
/// moment the maintenance thread picks one until it is given back, retired
/// or put back. Out of the table they are still this instance's, and a
/// thread that found one before it left may still hold a page of it, so
/// every path that must see all of the instance's regions sees these too:
/// `Reattach` presents them (a restarted directory frees every recovered
/// region nobody presents, and one put back later would then be written
/// though the pool manager may have granted it to someone else); a
/// refusal at reattach and `close` revoke them; a freed-page notice finds
/// them (`Shared::find_owned`). A region moves between the table and here
/// only under this lock, and those paths look under it, so none of them
/// can miss a region in transit.
#[derive(Debug, Default)]
pub(crate) struct Away(Mutex<Vec<(RegionId, Arc<OwnedRegion>)>>);

impl Away {
    pub fn lock(&self) -> parking_lot::MutexGuard<'_, Vec<(RegionId, Arc<OwnedRegion>)>> {
        self.0.lock()
    }
}

impl LayoutState {
    /// Bytes of each region the layout takes.
    pub fn region_size_bytes(&self) -> u64 {
        // Relaxed: set under `created` before any handle to the layout
        // exists; the lock (and the handle's hand-over) orders it.
        self.region_size_bytes.load(Ordering::Relaxed)
    }

    /// Whether a full layout takes one more region.
    pub fn auto_expand(&self) -> bool {
        // Relaxed: as `region_size_bytes`.
        self.auto_expand.load(Ordering::Relaxed)
    }

    /// Takes region `id` out of the table into [`Away`], to be returned.
    pub fn take_away(&self, id: RegionId) -> bool {
        let mut away = self.away.lock();
        let Some(region) = self.regions.with(id, Arc::clone) else {
            return false;
        };
        if self.regions.remove(id).is_err() {
            return false;
        }
        away.push((id, region));
        true
    }

    /// Whether region `id` is away (taken out for return).
    pub fn is_away(&self, id: RegionId) -> bool {
        self.away.lock().iter().any(|(a, _)| *a == id)
    }

    /// Region `id` is no longer away: returned or retired.
    pub fn forget_away(&self, id: RegionId) {
        self.away.lock().retain(|(a, _)| *a != id);
    }

    /// Puts away region `id` back into the table, in one step under the
    /// [`Away`] lock — unless it was revoked while away: then it is handed
    /// back (`Err`) to be retired, never to be used again.
    pub fn put_back(&self, id: RegionId, region: Arc<OwnedRegion>) -> Result<(), PutBackRefused> {
        let mut away = self.away.lock();
        away.retain(|(a, _)| *a != id);
        // Acquire: pairs with the Release that revokes it (under this lock
        // too, for an away region).
        if region.revoked.load(Ordering::Acquire) {
            return Err(PutBackRefused::Revoked(region));
        }
        self.regions
            .insert(id, region)
            .map_err(|rejected| PutBackRefused::Table(rejected.error, rejected.value))
    }

    /// Takes free pages, lowest region first, until `out` holds `n`; each
    /// lease keeps `client` alive.
    fn take_pages(&self, n: usize, out: &mut Vec<PageLease>, client: &Client) {
        let snapshot = self.regions.read();
        for (_, region) in snapshot.iter() {
            while out.len() < n {
                match region.alloc.alloc() {
                    Some((page, generation)) => {
                        out.push(PageLease::new(
                            client.clone(),
                            Arc::clone(region),
                            self.ix,
                            page,
                            generation,
                        ));
                    }
                    None => break,
                }
            }
            if out.len() == n {
                return;
            }
        }
    }

    fn free_pages(&self) -> u64 {
        self.regions
            .read()
            .iter()
            .map(|(_, r)| u64::from(r.alloc.free_pages()))
            .sum()
    }
}

impl Shared {
    /// The layout `(page_size_bytes, fingerprint)`, created (with its initial
    /// reservation) if this client does not have it yet.
    pub fn layout(
        &self,
        page_size_bytes: u64,
        fingerprint: u64,
        opts: LayoutOptions,
    ) -> Result<Arc<LayoutState>, ClientError> {
        self.check_open()?;
        if check_page_size(page_size_bytes).is_err() || page_size_bytes > proto::MAX_PAGE_BYTES {
            return Err(ClientError::InvalidPageSize {
                page_size_bytes,
                max_bytes: proto::MAX_PAGE_BYTES,
            });
        }
        let layout = Layout {
            page_size_bytes,
            fingerprint,
        };
        let align = self
            .pools
            .iter()
            .map(|p| p.info.align_bytes)
            .max()
            .unwrap_or(cxlkv_dataplane::backing::DEFAULT_ALIGN_BYTES);
        let wanted = if opts.region_size_bytes == 0 {
            DEFAULT_REGION_SIZE_BYTES
        } else {
            opts.region_size_bytes
        };
        let region_size_bytes =
            round_up(wanted.max(page_size_bytes), align).ok_or(ClientError::Config {
                field: "region_size_bytes",
                reason: format!("{wanted} cannot be rounded up to the alignment {align}"),
            })?;
        let state = {
            let mut layouts = self.layouts.write();
            match layouts.iter().find(|l| l.layout == layout) {
                Some(existing) => Arc::clone(existing),
                None => {
                    if layouts.len() >= MAX_LAYOUTS {
                        return Err(ClientError::TooManyLayouts { max: MAX_LAYOUTS });
                    }
                    let state = Arc::new(LayoutState {
                        ix: layouts.len() as u32,
                        layout,
                        page_size_bytes: page_size_bytes as usize,
                        region_size_bytes: AtomicU64::new(region_size_bytes),
                        auto_expand: AtomicBool::new(opts.auto_expand),
                        created: Mutex::new(false),
                        regions: RegionTable::new(),
                        away: Away::default(),
                        expand_lock: Mutex::new(()),
                    });
                    layouts.push(Arc::clone(&state));
                    state
                }
            }
        };
        // A layout being created by another call: wait for it. A layout
        // whose creation failed (its initial reservation refused) is not
        // the client's yet: this call creates it, with its own options —
        // the failed call's regions count towards its reservation.
        let mut created = state.created.lock();
        if *created {
            drop(created);
            return Ok(state);
        }
        // Relaxed: see `LayoutState::region_size_bytes`.
        state
            .region_size_bytes
            .store(region_size_bytes, Ordering::Relaxed);
        state.auto_expand.store(opts.auto_expand, Ordering::Relaxed);
        let initial = opts.initial_reservation_bytes.div_ceil(region_size_bytes);
        let have = state.regions.len() as u64;
        for _ in have..initial {
            self.acquire_region(&state, true)?;
        }
        *created = true;
        drop(created);
        Ok(state)
    }

    /// Adds a region to `layout` unless another thread already made room for
    /// `needed_pages`.
    pub fn expand(&self, layout: &Arc<LayoutState>, needed_pages: u64) -> Result<(), ClientError> {
        let _one_at_a_time = layout.expand_lock.lock();
        if layout.free_pages() >= needed_pages {
            return Ok(());
        }
        self.acquire_region(layout, false)
    }

    /// Requests one region for `layout`, maps it and makes it allocatable.
    /// If no attempt is answered, the request is kept and sent again in the
    /// background (module docs); this call fails either way.
    pub fn acquire_region(
        &self,
        layout: &Arc<LayoutState>,
        initial: bool,
    ) -> Result<(), ClientError> {
        let len = layout.region_size_bytes();
        if let Some(quota) = self.cfg.quota_bytes {
            // Relaxed: a gauge; racing expansions of two layouts may both
            // pass (the directory's own quota is the hard limit).
            let owned = self.owned_bytes.load(Ordering::Relaxed);
            if owned.saturating_add(len) > quota {
                return Err(ClientError::QuotaExceeded {
                    quota_bytes: quota,
                    owned_bytes: owned,
                    requested_bytes: len,
                });
            }
        }
        let mut ticket = self.ticket().map_err(Fail::into_error)?;
        match self.request_region(layout, &mut ticket) {
            Ok(grant) => {
                self.seqs.release(ticket);
                self.adopt_region(layout, grant, initial)
            }
            Err(Fail::Indeterminate(e)) => {
                self.park_region_request(UnresolvedRegion {
                    ticket,
                    layout: Arc::clone(layout),
                });
                Err(e)
            }
            Err(fail) => {
                self.seqs.release(ticket);
                Err(fail.into_error())
            }
        }
    }

    /// One `RequestRegion` for `layout` under `ticket`, with its retries.
    fn request_region(&self, layout: &LayoutState, ticket: &mut SeqTicket) -> Result<Grant, Fail> {
        let mut req = RequestRegion {
            meta: Default::default(),
            layout: layout.layout,
            len_bytes: layout.region_size_bytes(),
        };
        self.exchange::<_, RegionGranted, _>(
            "request_region",
            Mode::NORMAL,
            Some(ticket),
            &mut req,
            |g| {
                Ok(Grant {
                    desc: proto::RegionDesc::from(&g.desc),
                    layout: Layout::from(&g.layout),
                    token: g.token.to_native(),
                })
            },
        )
    }

    /// Maps a granted region into `layout` and makes it allocatable; a
    /// region that cannot be used is given back.
    fn adopt_region(
        &self,
        layout: &LayoutState,
        grant: Grant,
        initial: bool,
    ) -> Result<(), ClientError> {
        let Grant {
            desc,
            layout: granted_layout,
            token,
        } = grant;
        let mapped = if granted_layout == layout.layout {
            self.pool(desc.pool, desc.region_id()).and_then(|pool| {
                regions::map_owned(pool, desc, layout.layout, token, &self.observers, initial)
            })
        } else {
            Err(ClientError::PageSizeMismatch {
                region: desc.region_id(),
                region_page_bytes: granted_layout.page_size_bytes,
                layout_page_bytes: layout.layout.page_size_bytes,
            })
        };
        let region = match mapped {
            Ok(region) => Arc::new(region),
            Err(e) => {
                // We own a region we cannot use: give it back (best effort;
                // otherwise it is freed when the instance goes).
                let _ = self.return_region(desc.region);
                return Err(e);
            }
        };
        // Relaxed: a gauge.
        self.owned_bytes
            .fetch_add(desc.len_bytes, Ordering::Relaxed);
        self.stats.bump(&self.stats.regions_acquired);
        layout
            .regions
            .insert(desc.region_id(), region)
            .map_err(|_| ClientError::RegionTableFull {
                region: desc.region_id(),
            })
    }

    fn park_region_request(&self, request: UnresolvedRegion) {
        let mut parked = self.unresolved_regions.lock();
        if parked.len() < MAX_UNRESOLVED_REGIONS {
            parked.push(request);
            return;
        }
        drop(parked);
        tracing::warn!(
            "a region request went unanswered with {MAX_UNRESOLVED_REGIONS} others already \
             unresolved: a region it may have been granted stays this instance's until it goes"
        );
        self.seqs.release(request.ticket);
    }

    /// Sends every unresolved region request again (maintenance thread):
    /// a grant is adopted, a refusal ends it, no answer keeps it.
    pub fn resolve_region_requests(&self) {
        let parked = std::mem::take(&mut *self.unresolved_regions.lock());
        for mut request in parked {
            match self.request_region(&request.layout, &mut request.ticket) {
                Ok(grant) => {
                    self.seqs.release(request.ticket);
                    let _one_at_a_time = request.layout.expand_lock.lock();
                    if let Err(e) = self.adopt_region(&request.layout, grant, false) {
                        tracing::warn!(error = %e.with_causes(), "a region granted late could not be used");
                    }
                }
                Err(Fail::Indeterminate(ClientError::Server { code, .. }))
                    if matches!(
                        ErrorCode::from_u16(code),
                        Some(ErrorCode::SequenceTooOld | ErrorCode::ReplyEvicted)
                    ) =>
                {
                    tracing::warn!(
                        "a region request whose answer was lost can no longer be resolved: \
                         a region it may have been granted stays this instance's until it goes"
                    );
                    self.seqs.release(request.ticket);
                }
                // Still no answer.
                Err(Fail::Indeterminate(_)) => self.unresolved_regions.lock().push(request),
                // Refused: under the number whose answer was lost, the
                // directory would have answered from its reply cache had
                // that attempt run (a refusal does not consume a number).
                Err(Fail::Definite(ClientError::Server { .. })) => {
                    self.seqs.release(request.ticket)
                }
                // Failed here before this attempt was sent: says nothing
                // about the one whose answer was lost.
                Err(_) => self.unresolved_regions.lock().push(request),
            }
        }
    }

    /// Region requests whose outcome is still unknown.
    pub fn unresolved_region_requests(&self) -> usize {
        self.unresolved_regions.lock().len()
    }

    /// Gives region `region` back (it must hold no key).
    pub fn return_region(&self, region: u64) -> Result<(), ReturnFailed> {
        let mut req = ReturnRegion {
            meta: Default::default(),
            region,
        };
        self.mutating_call::<_, proto::RegionReturned, _>(
            "return_region",
            Mode::NORMAL,
            &mut req,
            |_| Ok(()),
        )
        .map_err(|fail| {
            let still_ours = match &fail {
                // Refused or never sent: nothing changed, unless the refusal
                // says the region is not (or no longer) this instance's.
                Fail::Definite(e) => !matches!(
                    e.code(),
                    Some(ErrorCode::UnknownRegion | ErrorCode::NotOwner)
                ),
                // It may have run: the directory may have freed the region
                // and the pool manager granted it to someone else.
                Fail::Indeterminate(_) | Fail::Void => false,
            };
            ReturnFailed {
                error: fail.into_error(),
                still_ours,
            }
        })
    }
}

impl Client {
    /// The layout `(page_size_bytes, fingerprint)` with the configured
    /// defaults ([`ClientConfig::layout`](super::ClientConfig::layout)).
    pub fn layout(
        &self,
        page_size_bytes: u64,
        fingerprint: u64,
    ) -> Result<LayoutHandle, ClientError> {
        let opts = self.inner.shared.cfg.layout;
        self.layout_with(page_size_bytes, fingerprint, opts)
    }

    /// The layout with explicit options (used when the layout is created;
    /// a layout the client already has keeps its options). A call that
    /// fails to create the layout — its initial reservation refused — does
    /// not give the client a half-made one: the next call for the same page
    /// size and fingerprint creates it with that call's options, counting
    /// the regions the failed call took towards its reservation.
    pub fn layout_with(
        &self,
        page_size_bytes: u64,
        fingerprint: u64,
        opts: LayoutOptions,
    ) -> Result<LayoutHandle, ClientError> {
        let state = self
            .inner
            .shared
            .layout(page_size_bytes, fingerprint, opts)?;
        Ok(LayoutHandle {
            client: self.clone(),
            state,
        })
    }
}
