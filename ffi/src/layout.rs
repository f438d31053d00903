//! Layouts and the write path: open/close a layout, allocate leases, write
//! them in place, register them (or `put` bytes in one call).
//!
//! A `cxlkv_lease *` is one [`PageLease`]: a writable page no key names
//! yet. `cxlkv_lease_data` hands out the page's address; the caller writes
//! the chunk there (or through `cxlkv_lease_write`), sets its length, and
//! registers it. Registration **consumes** the lease handle whatever the
//! status (a refused or failed registration gives the page back, an
//! indeterminate one keeps it until the client resolves it), so C code has
//! no error path that leaks a page; `cxlkv_lease_abort` gives an unused
//! lease back.

use std::mem::size_of;
use std::sync::Arc;

use cxlkv::client::{LayoutHandle, Location, PageLease, RegisterOutcome, RejectReason};
use cxlkv_controlplane::proto::MAX_BATCH;
use parking_lot::Mutex;

use crate::args::{self, Entries, Out, OutSlice, Versioned, cxlkv_bytes};
use crate::boundary::call;
use crate::client::{self, cxlkv_client};
use crate::config::{self, cxlkv_layout_options};
use crate::handle::{MAX_HANDLES, Registry, Tag, to_ptr};
use crate::status::{FfiError, cxlkv_status};

/// A layout (page size + fingerprint) of a client (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_layout {
    _opaque: [u8; 0],
}

/// A writable page not registered yet (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_lease {
    _opaque: [u8; 0],
}

pub(crate) static LAYOUTS: Registry<LayoutHandle> = Registry::new(Tag::Layout);
/// `None` once registration or abort took the lease (a call that got the
/// entry just before that finds it empty).
static LEASES: Registry<Mutex<Option<PageLease>>> = Registry::new(Tag::Lease);

pub(crate) fn layout(handle: *const cxlkv_layout) -> Result<Arc<LayoutHandle>, FfiError> {
    LAYOUTS.get(handle.addr(), "layout")
}

fn consumed() -> FfiError {
    FfiError::new(
        cxlkv_status::CXLKV_STATUS_BAD_HANDLE,
        "`lease` was registered or aborted meanwhile",
    )
}

/// Where a chunk lives in the pool.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct cxlkv_location {
    pub region_id: u64,
    pub page: u32,
    /// The page's generation when the chunk was written.
    pub generation: u32,
    pub len_bytes: u32,
    /// Always 0.
    pub reserved: u32,
}

impl From<Location> for cxlkv_location {
    fn from(l: Location) -> Self {
        Self {
            region_id: l.region,
            page: l.page,
            generation: l.generation,
            len_bytes: l.len_bytes,
            reserved: 0,
        }
    }
}

/// What happened to one registration.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_register_outcome {
    /// No outcome: the call failed (its status says what is known) and
    /// wrote no result (header, "Outputs of a failed call").
    CXLKV_REGISTER_NONE = 0,
    /// The key now names the caller's chunk.
    CXLKV_REGISTER_INSERTED = 1,
    /// The key already existed: `winner` is where its chunk lives; the
    /// caller's page went back to its allocator.
    CXLKV_REGISTER_DUPLICATE = 2,
    /// Refused (`reject_reason` says why); the page went back.
    CXLKV_REGISTER_REJECTED = 3,
}

/// Why a registration was refused (the wire's stable numbers).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_reject_reason {
    /// Not rejected.
    CXLKV_REJECT_NONE = 0,
    CXLKV_REJECT_UNKNOWN_REGION = 1,
    CXLKV_REJECT_NOT_OWNER = 2,
    CXLKV_REJECT_WRONG_LAYOUT = 3,
    CXLKV_REJECT_PAGE_OUT_OF_RANGE = 4,
    CXLKV_REJECT_BAD_LENGTH = 5,
    CXLKV_REJECT_QUOTA_EXCEEDED = 6,
    CXLKV_REJECT_PAGE_IN_USE = 7,
    CXLKV_REJECT_STALE_GENERATION = 8,
}

/// One registration's result.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct cxlkv_register_result {
    pub outcome: cxlkv_register_outcome,
    pub reject_reason: cxlkv_reject_reason,
    /// With `CXLKV_REGISTER_DUPLICATE`: the winner's chunk; else zero.
    pub winner: cxlkv_location,
}

impl crate::args::Unset for cxlkv_register_result {
    const UNSET: Self = Self {
        outcome: cxlkv_register_outcome::CXLKV_REGISTER_NONE,
        reject_reason: cxlkv_reject_reason::CXLKV_REJECT_NONE,
        winner: cxlkv_location {
            region_id: 0,
            page: 0,
            generation: 0,
            len_bytes: 0,
            reserved: 0,
        },
    };
}

fn register_result(o: &RegisterOutcome) -> cxlkv_register_result {
    use cxlkv_register_outcome as O;
    use cxlkv_reject_reason as R;
    let (outcome, reject_reason, winner) = match o {
        RegisterOutcome::Inserted => (
            O::CXLKV_REGISTER_INSERTED,
            R::CXLKV_REJECT_NONE,
            Default::default(),
        ),
        RegisterOutcome::Duplicate(w) => (
            O::CXLKV_REGISTER_DUPLICATE,
            R::CXLKV_REJECT_NONE,
            (*w).into(),
        ),
        RegisterOutcome::Rejected(r) => {
            let reason = match r {
                RejectReason::UnknownRegion => R::CXLKV_REJECT_UNKNOWN_REGION,
                RejectReason::NotOwner => R::CXLKV_REJECT_NOT_OWNER,
                RejectReason::WrongLayout => R::CXLKV_REJECT_WRONG_LAYOUT,
                RejectReason::PageOutOfRange => R::CXLKV_REJECT_PAGE_OUT_OF_RANGE,
                RejectReason::BadLength => R::CXLKV_REJECT_BAD_LENGTH,
                RejectReason::QuotaExceeded => R::CXLKV_REJECT_QUOTA_EXCEEDED,
                RejectReason::PageInUse => R::CXLKV_REJECT_PAGE_IN_USE,
                RejectReason::StaleGeneration => R::CXLKV_REJECT_STALE_GENERATION,
            };
            (O::CXLKV_REGISTER_REJECTED, reason, Default::default())
        }
    };
    cxlkv_register_result {
        outcome,
        reject_reason,
        winner,
    }
}

/// Opens the layout `(page_size_bytes, fingerprint)` of `client` (created
/// with its initial reservation if the client does not use it yet; opening
/// it again gives another handle to the same layout). `options` NULL: the
/// defaults of the client's configuration. Free with `cxlkv_layout_close`.
///
/// # Safety
///
/// `options` NULL or valid for reads of `options->size` bytes;
/// `out_layout` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_layout_open(
    client: *const cxlkv_client,
    page_size_bytes: u64,
    fingerprint: u64,
    options: *const cxlkv_layout_options,
    out_layout: *mut *mut cxlkv_layout,
) -> cxlkv_status {
    call("cxlkv_layout_open", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_layout, "out_layout") }?;
        let c = client::client(client)?;
        let handle = if options.is_null() {
            c.layout(page_size_bytes, fingerprint)?
        } else {
            // SAFETY: passed on to the caller.
            let opts = unsafe { config::layout_options(options) }?;
            c.layout_with(page_size_bytes, fingerprint, opts)?
        };
        out.write(to_ptr(LAYOUTS.insert(handle)?));
        Ok(())
    })
}

/// Frees a layout handle (NULL: nothing to do). The layout itself, its
/// regions and keys stay with the client.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_layout_close(layout: *mut cxlkv_layout) -> cxlkv_status {
    call("cxlkv_layout_close", || {
        if !layout.is_null() {
            LAYOUTS.remove(layout.addr(), "layout")?;
        }
        Ok(())
    })
}

/// A layout's parameters and occupancy. Set `out->size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_layout_info {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    pub page_size_bytes: u64,
    pub fingerprint: u64,
    /// Bytes of the regions the layout holds now.
    pub region_bytes: u64,
    /// Free pages in those regions (a snapshot).
    pub free_pages: u64,
    /// Frees the allocators refused (stale, double or foreign): each a
    /// wrong free caught.
    pub refused_frees: u64,
}

const _: () = assert!(size_of::<cxlkv_layout_info>() == 48);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_layout_info {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_layout_info>()];
}

/// Writes the layout's parameters and occupancy into `*out` (no round
/// trip).
///
/// # Safety
///
/// `out` valid for reads of its size field and writes of `out->size` bytes.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_query_layout(
    layout: *const cxlkv_layout,
    out: *mut cxlkv_layout_info,
) -> cxlkv_status {
    call("cxlkv_query_layout", || {
        let l = self::layout(layout)?;
        let v = cxlkv_layout_info {
            size: size_of::<cxlkv_layout_info>() as u32,
            reserved: 0,
            page_size_bytes: l.page_size_bytes(),
            fingerprint: l.fingerprint(),
            region_bytes: l.region_bytes(),
            free_pages: l.free_pages(),
            refused_frees: l.refused_frees(),
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// One writable page of the layout (lock-free; takes a region from the
/// server only when the layout is full). Register it with `cxlkv_register`
/// or give it back with `cxlkv_lease_abort`.
///
/// # Safety
///
/// `out_lease` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_alloc(
    layout: *const cxlkv_layout,
    out_lease: *mut *mut cxlkv_lease,
) -> cxlkv_status {
    // SAFETY: one slot, passed on to the caller.
    unsafe { batch_alloc("cxlkv_alloc", layout, 1, out_lease) }
}

/// `n` writable pages, all or none: on failure no lease was taken and every
/// `out_leases[i]` is NULL.
///
/// # Safety
///
/// `out_leases` valid for writes of `n` pointers.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_alloc(
    layout: *const cxlkv_layout,
    n: usize,
    out_leases: *mut *mut cxlkv_lease,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe { batch_alloc("cxlkv_batch_alloc", layout, n, out_leases) }
}

/// # Safety
///
/// As `cxlkv_batch_alloc`.
unsafe fn batch_alloc(
    name: &str,
    layout: *const cxlkv_layout,
    n: usize,
    out_leases: *mut *mut cxlkv_lease,
) -> cxlkv_status {
    call(name, || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_leases, n, "out_leases") }?;
        let l = self::layout(layout)?;
        if n == 0 {
            // A batch of 0 is a no-op, whatever the client's state.
            return Ok(());
        }
        let leases = l.batch_alloc(n)?;
        let tokens =
            LEASES.insert_all(leases.into_iter().map(|l| Mutex::new(Some(l))).collect())?;
        for (i, t) in tokens.into_iter().enumerate() {
            out.write(i, to_ptr(t));
        }
        Ok(())
    })
}

/// The lease's page: `*out_data` is its first byte, `*out_capacity_bytes`
/// the layout's page size. Write the chunk there, then set its length with
/// `cxlkv_lease_set_len`. The address is valid until the lease is
/// registered or aborted; writing through it after that is a bug that no
/// check can catch.
///
/// # Safety
///
/// `out_data` and `out_capacity_bytes` valid for a write.
///
/// Thread safety: one thread at a time per lease (the page has one writer).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_lease_data(
    lease: *const cxlkv_lease,
    out_data: *mut *mut u8,
    out_capacity_bytes: *mut u64,
) -> cxlkv_status {
    call("cxlkv_lease_data", || {
        // SAFETY: passed on to the caller.
        let mut data = unsafe { Out::unset(out_data, "out_data") }?;
        // SAFETY: passed on to the caller.
        let mut cap = unsafe { Out::unset(out_capacity_bytes, "out_capacity_bytes") }?;
        let entry = LEASES.get(lease.addr(), "lease")?;
        let mut slot = entry.lock();
        let lease = slot.as_mut().ok_or_else(consumed)?;
        let mut page = lease.bytes_mut()?;
        cap.write(page.len() as u64);
        data.write(page.as_mut_ptr());
        Ok(())
    })
}

/// Sets the chunk's length (at most the page size) after writing through
/// `cxlkv_lease_data`.
///
/// Thread safety: one thread at a time per lease.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_lease_set_len(lease: *const cxlkv_lease, len_bytes: u64) -> cxlkv_status {
    call("cxlkv_lease_set_len", || {
        let entry = LEASES.get(lease.addr(), "lease")?;
        let mut slot = entry.lock();
        let lease = slot.as_mut().ok_or_else(consumed)?;
        let len = usize::try_from(len_bytes).unwrap_or(usize::MAX);
        Ok(lease.set_len(len)?)
    })
}

/// Copies `len` bytes from `src` to the start of the lease's page with the
/// fastest routine for the size (non-temporal stores for large chunks) and
/// sets the chunk's length to `len`. `src` must not overlap the lease's own
/// page (`CXLKV_STATUS_INVALID_ARGUMENT`: bytes already in the page are
/// written in place through `cxlkv_lease_data`, then
/// `cxlkv_lease_set_len`).
///
/// # Safety
///
/// `src` valid for reads of `len` bytes.
///
/// Thread safety: one thread at a time per lease.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_lease_write(
    lease: *const cxlkv_lease,
    src: *const u8,
    len: usize,
) -> cxlkv_status {
    call("cxlkv_lease_write", || {
        let entry = LEASES.get(lease.addr(), "lease")?;
        let mut slot = entry.lock();
        let lease = slot.as_mut().ok_or_else(consumed)?;
        // Before any slice of `src` exists: one overlapping the page would
        // alias the page's writable view (and the copy routines assume
        // disjoint buffers).
        let page = lease.page_addresses();
        let from = src.addr();
        if len > 0 && from < page.end && page.start < from.saturating_add(len) {
            return Err(FfiError::invalid(
                "`src` overlaps the lease's own page: write in place through \
                 `cxlkv_lease_data`, then call `cxlkv_lease_set_len`",
            ));
        }
        // SAFETY: passed on to the caller.
        let bytes = unsafe { args::chunk(src, len, 0, Entries::One, "src") }?;
        lease.write(bytes)?;
        Ok(())
    })
}

/// Gives an unregistered lease's page back and frees the handle (NULL:
/// nothing to do).
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_lease_abort(lease: *mut cxlkv_lease) -> cxlkv_status {
    call("cxlkv_lease_abort", || {
        if lease.is_null() {
            return Ok(());
        }
        let entry = LEASES.remove(lease.addr(), "lease")?;
        if let Some(l) = entry.lock().take() {
            l.abort();
        }
        Ok(())
    })
}

/// Takes every lease of `handles` out of the registry (freeing the
/// handles); the first bad one is the error, after all were tried.
fn take_leases(handles: &[*mut cxlkv_lease], entries: Entries) -> Result<Vec<PageLease>, FfiError> {
    let mut leases = Vec::with_capacity(handles.len());
    let mut first_error = None;
    for (i, h) in handles.iter().enumerate() {
        let taken = LEASES
            .remove(h.addr(), &entries.name("lease", "leases", i, ""))
            .and_then(|entry| entry.lock().take().ok_or_else(consumed));
        match taken {
            Ok(l) => leases.push(l),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        // The leases taken so far drop here: their pages go back.
        Some(e) => Err(e),
        None => Ok(leases),
    }
}

/// Registers one written lease under `key` and frees the lease handle,
/// whatever the status (see `cxlkv_batch_register`).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_result` for a write.
///
/// Thread safety: any thread (the lease must not be written meanwhile).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_register(
    layout: *const cxlkv_layout,
    key: *const u8,
    key_len: usize,
    lease: *mut cxlkv_lease,
    out_result: *mut cxlkv_register_result,
) -> cxlkv_status {
    let k = cxlkv_bytes {
        data: key,
        len: key_len,
    };
    // SAFETY: one key, one lease, one result slot; passed on to the caller.
    unsafe {
        batch_register(
            "cxlkv_register",
            Entries::One,
            layout,
            &k,
            &lease,
            1,
            out_result,
        )
    }
}

/// Publishes and registers `n` written leases under `keys`, in one round
/// trip; `out_results[i]` says what happened to entry `i`.
///
/// Every lease handle passed is consumed, **whatever the status**: its page
/// now belongs to its key (`INSERTED`), went back to the allocator
/// (`DUPLICATE`, `REJECTED`, or a call that failed), or — with
/// `CXLKV_STATUS_INDETERMINATE` — stays reserved until the client learns
/// the outcome in the background. A handle that is not a live lease makes
/// the call fail with `CXLKV_STATUS_BAD_HANDLE` (the valid ones are still
/// consumed); so does a batch over the limit (`CXLKV_STATUS_BATCH_TOO_LARGE`).
/// Only an array the library cannot read consumes nothing: `leases` NULL
/// (with `n > 0`) or misaligned (`CXLKV_STATUS_INVALID_ARGUMENT` naming
/// `leases`), or `n` above the most handles a process can hold (2^24 − 1).
///
/// # Safety
///
/// `keys` valid for reads of `n` entries, each `keys[i].data` of
/// `keys[i].len` bytes; `leases` of `n` handles; `out_results` valid for
/// writes of `n` results.
///
/// Thread safety: any thread (the leases must not be written meanwhile).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_register(
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    leases: *const *mut cxlkv_lease,
    n: usize,
    out_results: *mut cxlkv_register_result,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe {
        batch_register(
            "cxlkv_batch_register",
            Entries::Batch,
            layout,
            keys,
            leases,
            n,
            out_results,
        )
    }
}

/// # Safety
///
/// As `cxlkv_batch_register`.
unsafe fn batch_register(
    name: &str,
    entries: Entries,
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    leases: *const *mut cxlkv_lease,
    n: usize,
    out_results: *mut cxlkv_register_result,
) -> cxlkv_status {
    call(name, || {
        // The leases first: they are consumed whatever fails later, a batch
        // over the limit included. Only an `n` above the live leases a
        // process can hold is refused before the array is read.
        if n > MAX_HANDLES {
            args::batch_len(n)?;
        }
        // The results are unset before anything can fail (header, "Outputs
        // of a failed call"), an unreadable `leases` array included; a NULL
        // `out_results` is reported only once the leases are consumed.
        let out = (n <= MAX_BATCH).then(|| {
            // SAFETY: passed on to the caller.
            unsafe { OutSlice::unset(out_results, n, "out_results") }
        });
        // SAFETY: passed on to the caller.
        let handles = unsafe { args::slice(leases, n, "leases") }?;
        let taken = take_leases(handles, entries);
        args::batch_len(n)?;
        let mut out = out.expect("invariant: `n` is within the batch limit here")?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { args::keys(keys, n, entries) }?;
        let l = self::layout(layout)?;
        let leases = taken?;
        if leases.is_empty() {
            return Ok(());
        }
        let outcomes = l.batch_register(keys.into_iter().zip(leases).collect())?;
        for (i, o) in outcomes.iter().enumerate() {
            out.write(i, register_result(o));
        }
        Ok(())
    })
}

/// Allocates a page, copies `len` bytes of `data` into it, publishes and
/// registers it under `key` (one round trip).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes, `data` of `len`; `out_result`
/// for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_put(
    layout: *const cxlkv_layout,
    key: *const u8,
    key_len: usize,
    data: *const u8,
    len: usize,
    out_result: *mut cxlkv_register_result,
) -> cxlkv_status {
    let k = cxlkv_bytes {
        data: key,
        len: key_len,
    };
    let v = cxlkv_bytes { data, len };
    // SAFETY: one entry; passed on to the caller.
    unsafe { batch_put("cxlkv_put", Entries::One, layout, &k, &v, 1, out_result) }
}

/// `cxlkv_put` for `n` entries: one allocation pass, the copies, one round
/// trip. Nothing is allocated when an input is invalid.
///
/// # Safety
///
/// `keys` and `values` valid for reads of `n` entries each, every entry's
/// `data` of its `len` bytes; `out_results` for writes of `n` results.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_put(
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    values: *const cxlkv_bytes,
    n: usize,
    out_results: *mut cxlkv_register_result,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe {
        batch_put(
            "cxlkv_batch_put",
            Entries::Batch,
            layout,
            keys,
            values,
            n,
            out_results,
        )
    }
}

/// # Safety
///
/// As `cxlkv_batch_put`.
unsafe fn batch_put(
    name: &str,
    entries: Entries,
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    values: *const cxlkv_bytes,
    n: usize,
    out_results: *mut cxlkv_register_result,
) -> cxlkv_status {
    call(name, || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_results, n, "out_results") }?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { args::keys(keys, n, entries) }?;
        // SAFETY: passed on to the caller.
        let descs = unsafe { args::slice(values, n, "values") }?;
        let values = descs
            .iter()
            .enumerate()
            // SAFETY: passed on to the caller.
            .map(|(i, v)| unsafe { args::chunk(v.data, v.len, i, entries, "data") })
            .collect::<Result<Vec<_>, _>>()?;
        let l = self::layout(layout)?;
        if keys.is_empty() {
            return Ok(());
        }
        let items: Vec<(&[u8], &[u8])> = keys.into_iter().zip(values).collect();
        let outcomes = l.batch_put(&items)?;
        for (i, o) in outcomes.iter().enumerate() {
            out.write(i, register_result(o));
        }
        Ok(())
    })
}

#[cfg(test)]
pub(crate) fn live_leases() -> usize {
    LEASES.live()
}
