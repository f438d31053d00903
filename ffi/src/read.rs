//! The read path and the other key operations: get (zero-copy views),
//! release, exists, delete.
//!
//! A found key becomes a `cxlkv_view`: the chunk's address and length in
//! the shared pool (no copy) plus a `cxlkv_guard *` — a [`ReadGuard`]
//! holding the pin that keeps the key from being deleted, and the mapping
//! that keeps the address valid. The view is valid until `cxlkv_release`;
//! `cxlkv_release` zeroes the struct it is given, so a released view reads
//! as "absent" rather than dangling (copies of it are the caller's to
//! forget). Releasing a guard twice is refused with `BAD_HANDLE`.

use std::sync::Arc;

use cxlkv::client::{DeleteOutcome, ReadGuard};

use crate::args::{self, Entries, Out, OutSlice, cxlkv_bytes};
use crate::boundary::call;
use crate::handle::{Registry, Tag, to_ptr};
use crate::layout::{cxlkv_layout, cxlkv_location, layout};
use crate::status::{FfiError, cxlkv_status};

/// The pin behind a view (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_guard {
    _opaque: [u8; 0],
}

static GUARDS: Registry<ReadGuard> = Registry::new(Tag::Guard);

/// A chunk, in place in the shared pool. `guard == NULL` means the key was
/// absent (then `data` is NULL and `len_bytes` 0). Valid until released.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_view {
    pub guard: *mut cxlkv_guard,
    /// The chunk's first byte (read-only: other processes read it too).
    pub data: *const u8,
    pub len_bytes: u64,
    pub location: cxlkv_location,
}

const ABSENT: cxlkv_view = cxlkv_view {
    guard: std::ptr::null_mut(),
    data: std::ptr::null(),
    len_bytes: 0,
    location: cxlkv_location {
        region_id: 0,
        page: 0,
        generation: 0,
        len_bytes: 0,
        reserved: 0,
    },
};

impl crate::args::Unset for cxlkv_view {
    const UNSET: Self = ABSENT;
}

/// The chunk under `key`, pinned, in place. Absent key: `CXLKV_STATUS_OK`
/// with `out_view->guard == NULL`. On failure `*out_view` is zeroed.
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_view` for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_get(
    layout: *const cxlkv_layout,
    key: *const u8,
    key_len: usize,
    out_view: *mut cxlkv_view,
) -> cxlkv_status {
    let k = cxlkv_bytes {
        data: key,
        len: key_len,
    };
    // SAFETY: one key, one view; passed on to the caller.
    unsafe { batch_get("cxlkv_get", Entries::One, layout, &k, 1, out_view) }
}

/// The chunks under `keys` in one round trip, each pinned until its view is
/// released; absent keys give views with `guard == NULL`. On failure no pin
/// is held and every `out_views[i]` is zeroed.
///
/// # Safety
///
/// `keys` valid for reads of `n` entries, each `keys[i].data` of
/// `keys[i].len` bytes; `out_views` for writes of `n` views.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_get(
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_views: *mut cxlkv_view,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe {
        batch_get(
            "cxlkv_batch_get",
            Entries::Batch,
            layout,
            keys,
            n,
            out_views,
        )
    }
}

/// # Safety
///
/// As `cxlkv_batch_get`.
unsafe fn batch_get(
    name: &str,
    entries: Entries,
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_views: *mut cxlkv_view,
) -> cxlkv_status {
    call(name, || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_views, n, "out_views") }?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { args::keys(keys, n, entries) }?;
        let l = self::layout(layout)?;
        if keys.is_empty() {
            return Ok(());
        }
        let found = l.batch_get(&keys)?;
        let shapes: Vec<Option<(*const u8, u64, cxlkv_location)>> = found
            .iter()
            .map(|g| {
                g.as_ref().map(|g| {
                    (
                        g.bytes().as_ptr(),
                        g.bytes().len() as u64,
                        g.location().into(),
                    )
                })
            })
            .collect();
        // All or none: on a full registry every guard drops (unpinned).
        let tokens = GUARDS.insert_all(found.into_iter().flatten().collect())?;
        let mut tokens = tokens.into_iter();
        for (i, shape) in shapes.into_iter().enumerate() {
            if let Some((data, len_bytes, location)) = shape {
                let token = tokens.next().expect("invariant: one token per found key");
                out.write(
                    i,
                    cxlkv_view {
                        guard: to_ptr(token),
                        data,
                        len_bytes,
                        location,
                    },
                );
            }
        }
        Ok(())
    })
}

fn release_one(view: &mut cxlkv_view, arg: &str) -> Result<(), FfiError> {
    if view.guard.is_null() {
        *view = ABSENT;
        return Ok(());
    }
    let guard: Arc<ReadGuard> = GUARDS.remove(view.guard.addr(), arg)?;
    *view = ABSENT;
    // The pin goes when the last holder (this, or a call in progress on
    // another thread) drops the guard.
    drop(guard);
    Ok(())
}

/// Releases a view's pin and zeroes `*view` (a view with `guard == NULL`
/// holds no pin: it is only zeroed). The chunk's address must not be read afterwards. The
/// unpin is sent within the client's `unpin_delay_us`, or before its next
/// request.
///
/// # Safety
///
/// `view` valid for a read and a write.
///
/// Thread safety: any thread; not concurrently with reads of the chunk.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_release(view: *mut cxlkv_view) -> cxlkv_status {
    call("cxlkv_release", || {
        // SAFETY: passed on to the caller (one view, read and written).
        let v = unsafe { args::slice(view, 1, "view") }?[0];
        let mut v = v;
        let result = release_one(&mut v, "view->guard");
        // SAFETY: as above.
        let mut out = unsafe { Out::new(view, "view") }?;
        out.write(v);
        result
    })
}

/// `cxlkv_release` for `n` views: every one is released (or only zeroed,
/// if absent); the status is the first failure. Unlike other batches, `n`
/// is not capped at 4096: the views may come from many calls, so every one
/// of the `n` is read and written.
///
/// # Safety
///
/// `views` valid for reads and writes of `n` views.
///
/// Thread safety: as `cxlkv_release`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_release(views: *mut cxlkv_view, n: usize) -> cxlkv_status {
    call("cxlkv_batch_release", || {
        // SAFETY: passed on to the caller.
        let snapshot = unsafe { args::slice(views, n, "views") }?.to_vec();
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::new(views, n, "views") }?;
        let mut first_error = None;
        for (i, mut v) in snapshot.into_iter().enumerate() {
            if let Err(e) = release_one(&mut v, &format!("views[{i}].guard")) {
                first_error.get_or_insert(e);
            }
            out.write(i, v);
        }
        first_error.map_or(Ok(()), Err)
    })
}

/// Whether `key` exists (no pin taken).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_present` for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_exists(
    layout: *const cxlkv_layout,
    key: *const u8,
    key_len: usize,
    out_present: *mut bool,
) -> cxlkv_status {
    let k = cxlkv_bytes {
        data: key,
        len: key_len,
    };
    // SAFETY: one key, one slot; passed on to the caller.
    unsafe { batch_exists("cxlkv_exists", Entries::One, layout, &k, 1, out_present) }
}

/// Whether each key exists, in one read-only round trip.
///
/// # Safety
///
/// `keys` as for `cxlkv_batch_get`; `out_present` valid for writes of `n`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_exists(
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_present: *mut bool,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe {
        batch_exists(
            "cxlkv_batch_exists",
            Entries::Batch,
            layout,
            keys,
            n,
            out_present,
        )
    }
}

/// # Safety
///
/// As `cxlkv_batch_exists`.
unsafe fn batch_exists(
    name: &str,
    entries: Entries,
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_present: *mut bool,
) -> cxlkv_status {
    call(name, || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_present, n, "out_present") }?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { args::keys(keys, n, entries) }?;
        let l = self::layout(layout)?;
        if keys.is_empty() {
            return Ok(());
        }
        let present = l.batch_exists(&keys)?;
        for (i, p) in present.into_iter().enumerate() {
            out.write(i, p);
        }
        Ok(())
    })
}

/// What happened to one deletion.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_delete_outcome {
    /// No outcome: the call failed (its status says what is known) and
    /// wrote no result (header, "Outputs of a failed call").
    CXLKV_DELETE_NONE = 0,
    /// Gone; its page goes back to its owner.
    CXLKV_DELETE_DELETED = 1,
    /// Not deleted: `pins` pins (all sessions) are held on it.
    CXLKV_DELETE_PINNED = 2,
    /// No such key.
    CXLKV_DELETE_MISSING = 3,
}

/// One deletion's result.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct cxlkv_delete_result {
    pub outcome: cxlkv_delete_outcome,
    /// With `CXLKV_DELETE_PINNED`: pins held; else 0.
    pub pins: u32,
}

impl crate::args::Unset for cxlkv_delete_result {
    const UNSET: Self = Self {
        outcome: cxlkv_delete_outcome::CXLKV_DELETE_NONE,
        pins: 0,
    };
}

fn delete_result(o: &DeleteOutcome) -> cxlkv_delete_result {
    use cxlkv_delete_outcome as D;
    let (outcome, pins) = match o {
        DeleteOutcome::Deleted => (D::CXLKV_DELETE_DELETED, 0),
        DeleteOutcome::Pinned { pins } => (D::CXLKV_DELETE_PINNED, *pins),
        DeleteOutcome::Missing => (D::CXLKV_DELETE_MISSING, 0),
    };
    cxlkv_delete_result { outcome, pins }
}

/// Deletes `key`: deleted, pinned (nothing changed) or missing.
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_result` for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_delete(
    layout: *const cxlkv_layout,
    key: *const u8,
    key_len: usize,
    out_result: *mut cxlkv_delete_result,
) -> cxlkv_status {
    let k = cxlkv_bytes {
        data: key,
        len: key_len,
    };
    // SAFETY: one key, one slot; passed on to the caller.
    unsafe { batch_delete("cxlkv_delete", Entries::One, layout, &k, 1, out_result) }
}

/// Deletes keys in one round trip; one result per key, never conflated.
/// Pages go back to their owners (this client or others).
///
/// # Safety
///
/// `keys` as for `cxlkv_batch_get`; `out_results` valid for writes of `n`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_batch_delete(
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_results: *mut cxlkv_delete_result,
) -> cxlkv_status {
    // SAFETY: passed on to the caller.
    unsafe {
        batch_delete(
            "cxlkv_batch_delete",
            Entries::Batch,
            layout,
            keys,
            n,
            out_results,
        )
    }
}

/// # Safety
///
/// As `cxlkv_batch_delete`.
unsafe fn batch_delete(
    name: &str,
    entries: Entries,
    layout: *const cxlkv_layout,
    keys: *const cxlkv_bytes,
    n: usize,
    out_results: *mut cxlkv_delete_result,
) -> cxlkv_status {
    call(name, || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_results, n, "out_results") }?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { args::keys(keys, n, entries) }?;
        let l = self::layout(layout)?;
        if keys.is_empty() {
            return Ok(());
        }
        let outcomes = l.batch_delete(&keys)?;
        for (i, o) in outcomes.iter().enumerate() {
            out.write(i, delete_result(o));
        }
        Ok(())
    })
}

#[cfg(test)]
pub(crate) fn live_guards() -> usize {
    GUARDS.live()
}
