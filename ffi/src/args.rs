//! Checked access to what C passes in: pointers, byte strings, strings,
//! caller-owned output slots, and versioned structs.
//!
//! Everything here checks what can be checked — NULL, alignment, lengths
//! against the protocol's limits *before* a slice is formed (so a garbage
//! length never becomes an oversized slice), UTF-8 — and states as a
//! `# Safety` contract what cannot: that a non-NULL pointer really points
//! at that many readable (or writable) elements for the duration of the
//! call. The entry points pass that contract on to C in their docs.
//!
//! **Versioned structs.** Structs that may grow (`cxlkv_config`, the stats
//! structs, …) start with `uint32_t size`, which the caller sets to
//! `sizeof` as *its* header declares it. Reading one ([`read_versioned`]):
//! a size this library knows (any earlier version's, or its own) is read
//! as far as it goes, later fields keeping their defaults; a larger size
//! (a newer header) is accepted only if every byte beyond the fields this
//! library knows is zero — a field it cannot honour is refused, never
//! ignored. Writing one ([`write_versioned`]): as many bytes as both sides
//! know are written, and `size` is set to that count so the caller can
//! tell which fields were filled. Either way, a size no header declared
//! (below the first version's, or between two) is refused.

use std::ffi::{CStr, c_char};
use std::mem::size_of;
use std::ptr::NonNull;

use cxlkv::client::ClientError;
use cxlkv_controlplane::proto::{MAX_BATCH, MAX_KEY_BYTES, MAX_PAGE_BYTES};

use crate::status::{FfiError, cxlkv_status};

/// A byte string passed by C: `data` may be NULL only when `len` is 0.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_bytes {
    pub data: *const u8,
    pub len: usize,
}

/// Most bytes a versioned struct may claim (a larger `size` is a garbage
/// value, refused before anything past the known fields is read).
pub(crate) const MAX_VERSIONED_BYTES: usize = 4096;

fn check_ptr<T>(ptr: *const T, arg: &str) -> Result<(), FfiError> {
    if ptr.is_null() {
        return Err(FfiError::null(arg));
    }
    if !ptr.is_aligned() {
        return Err(FfiError::invalid(format!(
            "`{arg}` ({ptr:p}) is not aligned to {} bytes",
            align_of::<T>()
        )));
    }
    Ok(())
}

/// `len` elements at `ptr`; `len` 0 gives an empty slice whatever `ptr`.
///
/// # Safety
///
/// If `len > 0` and `ptr` is not NULL, `ptr` must be valid for reads of
/// `len` elements of `T`, not written by anyone during `'a`.
pub(crate) unsafe fn slice<'a, T>(
    ptr: *const T,
    len: usize,
    arg: &str,
) -> Result<&'a [T], FfiError> {
    if len == 0 {
        return Ok(&[]);
    }
    check_ptr(ptr, arg)?;
    if len
        .checked_mul(size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(FfiError::invalid(format!(
            "`{arg}`: length {len} is too large"
        )));
    }
    // SAFETY: non-NULL, aligned and of a representable size (checked);
    // valid for `len` reads by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Checks a batch length against the protocol's limit.
pub(crate) fn batch_len(n: usize) -> Result<(), FfiError> {
    if n > MAX_BATCH {
        return Err(ClientError::BatchTooLarge {
            len: n,
            max: MAX_BATCH,
        }
        .into());
    }
    Ok(())
}

/// How the entries of a call are named in messages: a single-entry call
/// (`cxlkv_get`, `cxlkv_put`, `cxlkv_register`) by its own parameters
/// (`key`, `data`, `lease`), a batch by the elements of its arrays
/// (`keys[3].data`, `values[3].data`, `leases[3]`) — so that the message
/// says which input of a batch went wrong. Names are built only for a
/// message, never on the way to a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entries {
    One,
    Batch,
}

impl Entries {
    /// The name of entry `index`: `single` for a single-entry call, else
    /// `array[index]` followed by `.field` when `field` is not empty.
    pub fn name(self, single: &str, array: &str, index: usize, field: &str) -> String {
        match self {
            Entries::One => single.to_owned(),
            Entries::Batch if field.is_empty() => format!("{array}[{index}]"),
            Entries::Batch => format!("{array}[{index}].{field}"),
        }
    }
}

/// `len` bytes at `data`, named in an error as `name()` says (built only
/// then); `len` 0 gives an empty slice whatever `data`.
///
/// # Safety
///
/// As [`slice`].
unsafe fn named_bytes<'a>(
    data: *const u8,
    len: usize,
    name: impl FnOnce() -> String,
) -> Result<&'a [u8], FfiError> {
    if len > 0 && data.is_null() {
        return Err(FfiError::null(&name()));
    }
    // SAFETY: passed on to the caller (`data` is not NULL when `len > 0`,
    // and bytes have no alignment to check).
    unsafe { slice(data, len, "bytes") }
}

/// A key: at most `MAX_KEY_BYTES` (checked before the slice is formed);
/// an empty key is left for the client to refuse with its own message. A
/// NULL `data` is named `key`, or `keys[index].data` in a batch.
///
/// # Safety
///
/// As [`slice`].
pub(crate) unsafe fn key<'a>(
    data: *const u8,
    len: usize,
    index: usize,
    entries: Entries,
) -> Result<&'a [u8], FfiError> {
    if len > MAX_KEY_BYTES {
        return Err(ClientError::KeyLength {
            index,
            len_bytes: len,
            max_bytes: MAX_KEY_BYTES,
        }
        .into());
    }
    // SAFETY: passed on to the caller.
    unsafe { named_bytes(data, len, || entries.name("key", "keys", index, "data")) }
}

/// A key that must not be empty (for calls that check keys themselves
/// rather than leaving it to the client).
///
/// # Safety
///
/// As [`slice`].
pub(crate) unsafe fn nonempty_key<'a>(data: *const u8, len: usize) -> Result<&'a [u8], FfiError> {
    if len == 0 {
        return Err(ClientError::KeyLength {
            index: 0,
            len_bytes: 0,
            max_bytes: MAX_KEY_BYTES,
        }
        .into());
    }
    // SAFETY: passed on to the caller.
    unsafe { key(data, len, 0, Entries::One) }
}

/// A chunk: at most `MAX_PAGE_BYTES` (no page is larger). A NULL `data`
/// is named `single` (the parameter of a single-entry call), or
/// `values[index].data` in a batch.
///
/// # Safety
///
/// As [`slice`].
pub(crate) unsafe fn chunk<'a>(
    data: *const u8,
    len: usize,
    index: usize,
    entries: Entries,
    single: &str,
) -> Result<&'a [u8], FfiError> {
    if len as u64 > MAX_PAGE_BYTES {
        return Err(ClientError::ChunkLength {
            index,
            len_bytes: len,
            page_size_bytes: MAX_PAGE_BYTES,
        }
        .into());
    }
    // SAFETY: passed on to the caller.
    unsafe { named_bytes(data, len, || entries.name(single, "values", index, "data")) }
}

/// The keys of a call, each checked as [`key`] (and named as `entries`
/// says).
///
/// # Safety
///
/// `keys` as [`slice`] for `n` elements; each element's `data` as [`slice`]
/// for its `len`.
pub(crate) unsafe fn keys<'a>(
    keys: *const cxlkv_bytes,
    n: usize,
    entries: Entries,
) -> Result<Vec<&'a [u8]>, FfiError> {
    batch_len(n)?;
    // SAFETY: passed on to the caller.
    let descs = unsafe { slice(keys, n, "keys") }?;
    descs
        .iter()
        .enumerate()
        // SAFETY: passed on to the caller.
        .map(|(i, k)| unsafe { key(k.data, k.len, i, entries) })
        .collect()
}

/// An optional NUL-terminated UTF-8 string (NULL: `None`).
///
/// # Safety
///
/// If not NULL, `ptr` must point at a NUL-terminated string readable for
/// the call.
pub(crate) unsafe fn opt_str<'a>(
    ptr: *const c_char,
    arg: &str,
) -> Result<Option<&'a str>, FfiError> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str()
        .map(Some)
        .map_err(|e| FfiError::invalid(format!("`{arg}` is not UTF-8: {e}")))
}

/// The value an output holds after a call that failed (header, "Outputs
/// of a failed call"): NULL handles, zero counts, `false`, results that
/// name no outcome. Each function sets its outputs to it before anything
/// else can fail, so that no failure leaves a stale value (or a zeroed
/// array's `SUCCESS`) behind for a caller that reads them anyway.
pub(crate) trait Unset: Sized {
    const UNSET: Self;
}

impl Unset for bool {
    const UNSET: Self = false;
}

impl Unset for usize {
    const UNSET: Self = 0;
}

impl Unset for u64 {
    const UNSET: Self = 0;
}

impl<T> Unset for *mut T {
    const UNSET: Self = std::ptr::null_mut();
}

/// One caller-provided output slot, checked for NULL and alignment.
#[derive(Debug)]
pub(crate) struct Out<T> {
    ptr: NonNull<T>,
}

impl<T> Out<T> {
    /// # Safety
    ///
    /// If not NULL, `ptr` must be valid for writes of one `T` for as long
    /// as the returned value is used (within the call).
    pub unsafe fn new(ptr: *mut T, arg: &str) -> Result<Self, FfiError> {
        check_ptr(ptr, arg)?;
        Ok(Self {
            ptr: NonNull::new(ptr).expect("invariant: checked non-NULL above"),
        })
    }

    pub fn write(&mut self, value: T) {
        // SAFETY: valid and aligned for a write by `new`'s contract and
        // checks; `write` does not read (or drop) the old contents.
        unsafe { self.ptr.as_ptr().write(value) }
    }
}

impl<T: Unset> Out<T> {
    /// [`Out::new`], the slot set to [`Unset::UNSET`] until the call writes
    /// its result.
    ///
    /// # Safety
    ///
    /// As [`Out::new`].
    pub unsafe fn unset(ptr: *mut T, arg: &str) -> Result<Self, FfiError> {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Self::new(ptr, arg) }?;
        out.write(T::UNSET);
        Ok(out)
    }
}

/// `len` caller-provided output slots.
#[derive(Debug)]
pub(crate) struct OutSlice<T> {
    ptr: NonNull<T>,
    len: usize,
}

impl<T> OutSlice<T> {
    /// A `len` of 0 needs no pointer.
    ///
    /// # Safety
    ///
    /// If `len > 0`, `ptr` must be valid for writes of `len` elements of `T`
    /// for as long as the returned value is used (within the call).
    pub unsafe fn new(ptr: *mut T, len: usize, arg: &str) -> Result<Self, FfiError> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        check_ptr(ptr, arg)?;
        if len
            .checked_mul(size_of::<T>())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(FfiError::invalid(format!(
                "`{arg}`: length {len} is too large"
            )));
        }
        Ok(Self {
            ptr: NonNull::new(ptr).expect("invariant: checked non-NULL above"),
            len,
        })
    }

    pub fn write(&mut self, index: usize, value: T) {
        assert!(index < self.len, "output index {index} past {}", self.len);
        // SAFETY: `index < len`, and the slots are valid for writes by
        // `new`'s contract; `write` does not read the old contents.
        unsafe { self.ptr.as_ptr().add(index).write(value) }
    }
}

impl<T: Unset> OutSlice<T> {
    /// [`OutSlice::new`], every slot set to [`Unset::UNSET`] until the call
    /// writes its results.
    ///
    /// # Safety
    ///
    /// As [`OutSlice::new`].
    pub unsafe fn unset(ptr: *mut T, len: usize, arg: &str) -> Result<Self, FfiError> {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Self::new(ptr, len, arg) }?;
        for i in 0..len {
            out.write(i, T::UNSET);
        }
        Ok(out)
    }
}

/// A `#[repr(C)]` struct whose first field is `size: u32` (see the module
/// docs).
///
/// # Safety
///
/// Implementors are `#[repr(C)]`, start with a `u32` size field, have no
/// padding, and every bit pattern of their bytes is a valid value (integers,
/// raw pointers, optional function pointers, arrays and structs of those).
pub(crate) unsafe trait Versioned: Copy {
    /// Every size a released header declared, oldest first; the last is
    /// `size_of::<Self>()`.
    const SIZES: &'static [usize];
}

fn size_error(name: &str, size: usize, known: &[usize]) -> FfiError {
    FfiError::invalid(format!(
        "`{name}.size` is {size}; this library reads sizes {known:?} (set it to sizeof as your header declares it) or larger ones whose unknown fields are zero"
    ))
}

/// Reads a versioned input struct over `defaults` (see the module docs).
///
/// # Safety
///
/// If not NULL, `ptr` must be valid for reads of `(*ptr).size` bytes.
pub(crate) unsafe fn read_versioned<T: Versioned>(
    ptr: *const T,
    defaults: T,
    arg: &str,
) -> Result<T, FfiError> {
    check_ptr(ptr, arg)?;
    let ours = size_of::<T>();
    debug_assert_eq!(T::SIZES.last(), Some(&ours));
    // SAFETY: aligned and non-NULL; every Versioned starts with a u32.
    let size = unsafe { ptr.cast::<u32>().read() } as usize;
    if size > MAX_VERSIONED_BYTES || (size <= ours && !T::SIZES.contains(&size)) {
        return Err(size_error(arg, size, T::SIZES));
    }
    if size > ours {
        // SAFETY: the caller's struct is `size` bytes long by contract.
        let tail = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>().add(ours), size - ours) };
        if let Some(at) = tail.iter().position(|b| *b != 0) {
            return Err(FfiError::invalid(format!(
                "`{arg}` sets a field at byte offset {} that this library (which knows {ours} bytes) does not know; upgrade libcxlkv or leave it zero",
                ours + at
            )));
        }
    }
    let mut value = defaults;
    // SAFETY: `min(size, ours)` bytes are readable at `ptr` (contract) and
    // writable in `value`; every bit pattern is a valid `T` (trait
    // contract), so overwriting a prefix leaves a valid value.
    unsafe {
        std::ptr::copy_nonoverlapping(
            ptr.cast::<u8>(),
            (&raw mut value).cast::<u8>(),
            size.min(ours),
        );
    }
    Ok(value)
}

/// Writes a versioned output struct: as many bytes as both sides know;
/// `size` is set to that count. A size no header declared is refused as
/// [`read_versioned`] refuses it, with nothing written.
///
/// # Safety
///
/// If not NULL, `ptr` must be valid for reads of its `u32` size field and
/// for writes of that many bytes.
pub(crate) unsafe fn write_versioned<T: Versioned>(
    ptr: *mut T,
    value: &T,
    arg: &str,
) -> Result<(), FfiError> {
    check_ptr(ptr, arg)?;
    // SAFETY: aligned and non-NULL; every Versioned starts with a u32.
    let size = unsafe { ptr.cast::<u32>().read() } as usize;
    let ours = size_of::<T>();
    debug_assert_eq!(T::SIZES.last(), Some(&ours));
    // As on input: a size no header declared (between two versions', or
    // below the first) is refused, not filled up to a part of a field.
    if size > MAX_VERSIONED_BYTES || (size <= ours && !T::SIZES.contains(&size)) {
        return Err(size_error(arg, size, T::SIZES));
    }
    let n = size.min(ours);
    // SAFETY: `n` bytes are writable at `ptr` (contract) and readable from
    // `value`; the struct has no padding (trait contract).
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), ptr.cast::<u8>(), n);
        ptr.cast::<u32>().write(n as u32);
    }
    Ok(())
}

/// Writes `text` NUL-terminated into `buf` (capacity `cap` bytes) and its
/// length (without the NUL) into `out_len`; `BUFFER_TOO_SMALL` (with the
/// length written) when it does not fit.
///
/// # Safety
///
/// `buf` valid for writes of `cap` bytes (if `cap > 0`); `out_len` as
/// [`Out::new`].
pub(crate) unsafe fn write_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> Result<(), FfiError> {
    // SAFETY: passed on to the caller.
    let mut len_out = unsafe { Out::unset(out_len, "out_len") }?;
    if cap > text.len() {
        check_ptr(buf, "buf")?;
    }
    len_out.write(text.len());
    if cap <= text.len() {
        return Err(FfiError::new(
            cxlkv_status::CXLKV_STATUS_BUFFER_TOO_SMALL,
            format!("{} bytes and a NUL do not fit in {cap}", text.len()),
        ));
    }
    // SAFETY: passed on to the caller (`cap > 0` here).
    let mut dst = unsafe { OutSlice::new(buf.cast::<u8>(), cap, "buf") }?;
    for (i, b) in text.bytes().enumerate() {
        dst.write(i, b);
    }
    dst.write(text.len(), 0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct V {
        size: u32,
        a: u32,
        b: u64,
    }
    // SAFETY: repr(C), u32 size first, no padding, integers only.
    unsafe impl Versioned for V {
        const SIZES: &'static [usize] = &[8, 16];
    }

    const D: V = V {
        size: 16,
        a: 7,
        b: 9,
    };

    #[test]
    fn an_older_struct_keeps_defaults_for_the_fields_it_lacks() {
        let old = V {
            size: 8,
            a: 1,
            b: 0xDEAD,
        };
        // SAFETY: `old` is a live V.
        let v = unsafe { read_versioned(&old, D, "v") }.unwrap();
        assert_eq!((v.a, v.b), (1, 9));
    }

    #[test]
    fn a_newer_struct_is_read_only_when_its_unknown_fields_are_zero() {
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Newer {
            v: V,
            c: u64,
        }
        let mut n = Newer {
            v: V {
                size: 24,
                a: 2,
                b: 3,
            },
            c: 0,
        };
        // SAFETY: `n` is 24 readable bytes starting with a V.
        let v = unsafe { read_versioned((&raw const n).cast::<V>(), D, "v") }.unwrap();
        assert_eq!((v.a, v.b), (2, 3));
        n.c = 1;
        // SAFETY: as above.
        let e = unsafe { read_versioned((&raw const n).cast::<V>(), D, "v") }.unwrap_err();
        assert!(e.message.contains("byte offset 16"), "{e}");
    }

    #[test]
    fn unknown_and_absurd_sizes_are_refused() {
        for size in [0u32, 4, 12, 1 << 20] {
            let bad = V { size, a: 0, b: 0 };
            // SAFETY: the size check refuses before reading past `bad`.
            let e = unsafe { read_versioned(&bad, D, "v") }.unwrap_err();
            assert_eq!(
                e.status,
                cxlkv_status::CXLKV_STATUS_INVALID_ARGUMENT,
                "{size}"
            );
        }
    }

    #[test]
    fn writing_fills_what_both_sides_know_and_reports_it() {
        let mut out = V {
            size: 8,
            a: 0,
            b: 0,
        };
        // SAFETY: `out` is a live V, at least 8 bytes.
        unsafe { write_versioned(&mut out, &D, "out") }.unwrap();
        assert_eq!(
            out,
            V {
                size: 8,
                a: 7,
                b: 0
            },
            "only the first 8 bytes"
        );
        let mut out = V {
            size: 16,
            a: 0,
            b: 0,
        };
        // SAFETY: as above.
        unsafe { write_versioned(&mut out, &D, "out") }.unwrap();
        assert_eq!(out, D);
    }

    /// An output struct's `size` is refused as on input when no header
    /// declared it (between two versions' sizes): nothing is written, not
    /// a part of a field.
    #[test]
    fn writing_refuses_a_size_no_header_declared() {
        let mut out = V {
            size: 12,
            a: 0,
            b: 0,
        };
        // SAFETY: `out` is a live V of 16 bytes, more than the 12 claimed.
        let err = unsafe { write_versioned(&mut out, &D, "out") }.unwrap_err();
        assert_eq!(err.status, cxlkv_status::CXLKV_STATUS_INVALID_ARGUMENT);
        assert_eq!(
            out,
            V {
                size: 12,
                a: 0,
                b: 0
            },
            "nothing written"
        );
    }

    #[test]
    fn oversized_lengths_are_refused_before_a_slice_is_formed() {
        let p = std::ptr::dangling::<u8>();
        // SAFETY: the length checks refuse before `p` is read.
        unsafe {
            assert_eq!(
                key(p, 513, 0, Entries::Batch).unwrap_err().status,
                cxlkv_status::CXLKV_STATUS_KEY_LENGTH
            );
            assert_eq!(
                chunk(p, usize::MAX, 0, Entries::Batch, "data")
                    .unwrap_err()
                    .status,
                cxlkv_status::CXLKV_STATUS_CHUNK_LENGTH
            );
            assert_eq!(
                keys(
                    std::ptr::dangling::<cxlkv_bytes>(),
                    MAX_BATCH + 1,
                    Entries::Batch
                )
                .unwrap_err()
                .status,
                cxlkv_status::CXLKV_STATUS_BATCH_TOO_LARGE
            );
            assert_eq!(
                slice(std::ptr::null::<u8>(), 3, "x").unwrap_err().status,
                cxlkv_status::CXLKV_STATUS_INVALID_ARGUMENT
            );
            assert!(slice(std::ptr::null::<u8>(), 0, "x").unwrap().is_empty());
        }
    }

    #[test]
    fn text_that_does_not_fit_reports_its_length() {
        let mut buf = [0 as c_char; 4];
        let mut len = 0usize;
        // SAFETY: `buf` has 4 writable bytes, `len` is live.
        let e = unsafe { write_text("hello", buf.as_mut_ptr(), 4, &mut len) }.unwrap_err();
        assert_eq!(e.status, cxlkv_status::CXLKV_STATUS_BUFFER_TOO_SMALL);
        assert_eq!(len, 5);
        let mut buf = [0 as c_char; 6];
        // SAFETY: as above, 6 bytes.
        unsafe { write_text("hello", buf.as_mut_ptr(), 6, &mut len) }.unwrap();
        // SAFETY: NUL-terminated by write_text.
        assert_eq!(
            // SAFETY: passed on to the caller.
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(),
            "hello"
        );
    }
}
