//! The archived key list of the key-batch requests, checked in one pass.
//!
//! [`Exists`], [`Lookup`], [`Delete`] and [`Unpin`] carry their keys as a
//! `Vec<Vec<u8>>`, archived as rkyv archives one: the keys' bytes back to
//! back, then an array of (relative pointer, length) pairs. The wire format
//! is exactly that; what this module changes is only how a receiver checks
//! it. rkyv's checked access checks such a vector key by key: each pair's
//! bytes, then a claim of the key's bytes in the validator's subtree range
//! (in range, not overlapping anything claimed before, the range pushed
//! and popped). [`ArchivedKeyList`] wraps the same bytes with a check of
//! its own ([`CheckBytes`] below) that walks the pairs once with plain
//! arithmetic and then claims all the keys' bytes together, with one call
//! into the validator. The whole checked access of a 512-key `Exists`
//! (rkyv's structure and the protocol's rules) took 0.72–0.80 µs with
//! rkyv's per-key check and 0.52–0.54 µs with this one, four alternated
//! runs of each (`cargo bench -p cxlkv-controlplane --bench proto --
//! access_request_exists`; `docs/benchmarks.md`, session 26): ~0.2 µs of
//! the server's ~12 µs for such a request.
//!
//! **It accepts exactly what rkyv's check accepts.** rkyv claims key `i`'s
//! bytes `[s_i, e_i)` inside the current subtree range `[S, P)` (`P`: the
//! pair array's first byte, `S`: wherever the previous claim left it, not
//! visible to us), after which the range is `[e_i, P)`. So a list passes
//! iff no key's range wraps the address space, `s_0 ≥ S`, `s_i ≥ e_{i-1}`
//! for every later key, and `e_i ≤ P` for every key; afterwards the range
//! is `[e_last, P)`. Here: the walk checks that no range wraps and that
//! `s_i ≥ e_{i-1}` (so the ends never decrease), then one claim of
//! `[s_0, e_last)` checks `s_0 ≥ S` and `e_last ≤ P` (hence `e_i ≤ P` for
//! every key) and leaves the range at `[e_last, P)`, at the same subtree
//! depth rkyv's per-key claims use. Same conditions, same state after.
//! A test in `proto::tests` compares the two checks' verdicts on lists
//! whose pairs were shifted, resized, swapped, duplicated and bit-flipped
//! (both verdicts thousands of times), and the `payload_decode` fuzz target
//! compares them on every key-batch payload it tries.

use std::alloc::Layout;
use std::fmt;
use std::ops::Deref;

use rkyv::bytecheck::CheckBytes;
use rkyv::rancor::{Fallible, Source};
use rkyv::ser::{Allocator, Writer};
use rkyv::validation::{ArchiveContext, ArchiveContextExt};
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::with::{ArchiveWith, DeserializeWith, SerializeWith};
use rkyv::{Place, Portable, Serialize};

#[cfg(doc)]
use super::directory::{Delete, Exists, Lookup, Unpin};

/// An archived `Vec<u8>`: a 32-bit relative pointer (counted from its own
/// first byte) and a 32-bit length, little-endian (the workspace pins
/// rkyv's `pointer_width_32` and `little_endian` features; `keys_from.rs`
/// writes the same pairs).
pub(super) const PAIR_BYTES: usize = size_of::<ArchivedVec<u8>>();
const _: () = assert!(PAIR_BYTES == 8 && align_of::<ArchivedVec<u8>>() == 4);

/// The `with` wrapper of a key-batch request's `keys` field
/// (`#[rkyv(with = KeyList)]`): archives a `Vec<Vec<u8>>` byte for byte as
/// rkyv does, as an [`ArchivedKeyList`].
#[derive(Debug)]
pub struct KeyList;

/// The keys of a key-batch request as received: an archived
/// `Vec<Vec<u8>>` with the one-pass check of the module docs.
#[derive(Portable)]
#[rkyv(crate = rkyv)]
#[repr(transparent)]
pub struct ArchivedKeyList(ArchivedVec<ArchivedVec<u8>>);

impl Deref for ArchivedKeyList {
    type Target = ArchivedVec<ArchivedVec<u8>>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl fmt::Debug for ArchivedKeyList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl ArchiveWith<Vec<Vec<u8>>> for KeyList {
    type Archived = ArchivedKeyList;
    type Resolver = VecResolver;

    fn resolve_with(field: &Vec<Vec<u8>>, resolver: VecResolver, out: Place<ArchivedKeyList>) {
        resolve_keys(field.len(), resolver, out);
    }
}

/// Writes the list's (pointer, length) header into `out`, as
/// `ArchivedVec::resolve_from_len` does for the vector it wraps.
pub(super) fn resolve_keys(len: usize, resolver: VecResolver, out: Place<ArchivedKeyList>) {
    // SAFETY: `ArchivedKeyList` is `repr(transparent)` over the vector, so
    // a place of the one is a place of the other: same address, size and
    // alignment, inside the same output buffer.
    let inner = unsafe { out.cast_unchecked::<ArchivedVec<ArchivedVec<u8>>>() };
    ArchivedVec::resolve_from_len(len, resolver, inner);
}

impl<S> SerializeWith<Vec<Vec<u8>>, S> for KeyList
where
    S: Fallible + Allocator + Writer + ?Sized,
    S::Error: Source,
{
    fn serialize_with(field: &Vec<Vec<u8>>, serializer: &mut S) -> Result<VecResolver, S::Error> {
        field.serialize(serializer)
    }
}

impl<D: Fallible + ?Sized> DeserializeWith<ArchivedKeyList, Vec<Vec<u8>>, D> for KeyList {
    fn deserialize_with(field: &ArchivedKeyList, _: &mut D) -> Result<Vec<Vec<u8>>, D::Error> {
        Ok(field.iter().map(|k| k.as_slice().to_vec()).collect())
    }
}

/// Why a key list failed the walk (the claim's failures are the
/// validator's own errors).
#[derive(Debug)]
enum BadKeyList {
    /// Key `index`'s range wraps the address space.
    Wraps { index: usize },
    /// Key `index` starts before the previous key's end: the keys overlap
    /// or are out of order (rkyv's check: a claim outside the subtree
    /// range).
    Overlaps { index: usize },
}

impl fmt::Display for BadKeyList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Wraps { index } => write!(f, "key {index}'s bytes wrap the address space"),
            Self::Overlaps { index } => {
                write!(f, "key {index} starts before the previous key's end")
            }
        }
    }
}

impl std::error::Error for BadKeyList {}

/// A pair at `at`: where its little-endian 32-bit relative pointer points
/// (computed wrapping, as rkyv's own check computes it, from `at` so that
/// the result keeps the buffer's provenance) and its length.
///
/// # Safety
/// `at` points to 8 readable bytes.
#[inline(always)]
unsafe fn pair(at: *const u8) -> (*const u8, usize) {
    // SAFETY: the caller's contract; unaligned reads need no alignment.
    let (offset, len) = unsafe {
        (
            i32::from_le_bytes(at.cast::<[u8; 4]>().read_unaligned()),
            u32::from_le_bytes(at.add(4).cast::<[u8; 4]>().read_unaligned()),
        )
    };
    (at.wrapping_offset(offset as isize), len as usize)
}

// SAFETY: `check_bytes` returns `Ok` only if the value is a valid
// `ArchivedVec<ArchivedVec<u8>>` inside the buffer the context validates,
// with every range it points to claimed exactly as rkyv's own check would
// claim them (module docs): its own bytes are two little-endian integers,
// any bit pattern valid (`ArchivedVec`'s derived check checks nothing else
// of them); the pair array is claimed by `in_subtree` (in range, aligned,
// not overlapping earlier claims); every pair is two integers again; and
// every key's bytes lie in the one range claimed for all of them.
unsafe impl<C> CheckBytes<C> for ArchivedKeyList
where
    C: Fallible + ArchiveContext + ?Sized,
    C::Error: Source,
{
    unsafe fn check_bytes(value: *const Self, context: &mut C) -> Result<(), C::Error> {
        // SAFETY: the caller guarantees `value` points to a readable,
        // aligned `Self`: 8 bytes, the pointer first, then the length.
        let (pairs, len) = unsafe { pair(value.cast::<u8>()) };
        let array = std::ptr::slice_from_raw_parts(pairs.cast::<ArchivedVec<u8>>(), len);
        context.in_subtree(array, |context| {
            // SAFETY: `in_subtree` checked that the `len` pairs from
            // `pairs` lie inside the buffer, aligned: each is 8 readable
            // bytes.
            unsafe { check_keys(pairs, len, context) }
        })
    }
}

/// Walks `len` pairs from `pairs` and claims their keys' bytes together
/// (module docs).
///
/// # Safety
/// `len × PAIR_BYTES` bytes from `pairs` are readable.
#[inline]
unsafe fn check_keys<C>(pairs: *const u8, len: usize, context: &mut C) -> Result<(), C::Error>
where
    C: Fallible + ArchiveContext + ?Sized,
    C::Error: Source,
{
    if len == 0 {
        return Ok(());
    }
    // SAFETY: pair 0 is inside the `len > 0` pairs (caller).
    let (first, _) = unsafe { pair(pairs) };
    let mut end = first.addr();
    for index in 0..len {
        // SAFETY: pair `index` is inside the `len` pairs (caller).
        let (key, key_len) = unsafe { pair(pairs.add(index * PAIR_BYTES)) };
        let start = key.addr();
        let Some(key_end) = start.checked_add(key_len) else {
            return Err(C::Error::new(BadKeyList::Wraps { index }));
        };
        // Key 0 passes: `end` starts at its own start.
        if start < end {
            return Err(C::Error::new(BadKeyList::Overlaps { index }));
        }
        end = key_end;
    }
    // `end ≥ first`: the ends never decrease and the first key's end is at
    // least its start.
    let layout = Layout::from_size_align(end - first.addr(), 1).map_err(C::Error::new)?;
    context.in_subtree_raw(first, layout, |_| Ok(()))
}

/// rkyv's own per-key check, for differential tests and the fuzzer: the
/// key-batch requests' layouts with plain `Vec<Vec<u8>>` keys, archived
/// byte for byte as the real messages are (`proto::tests` and the
/// `payload_decode` fuzz target compare the two checks' verdicts).
#[cfg(any(test, fuzzing))]
pub mod reference {
    use rkyv::Archive;
    use rkyv::rancor;

    use super::super::common::{Layout, RequestMeta};
    use super::super::directory::{ArchivedDelete, ArchivedExists, ArchivedLookup, ArchivedUnpin};
    use super::super::kind::Kind;

    // `allow`, not `expect`: only the archived forms are used, so a test
    // build finds the structs never constructed, while in a fuzzing build
    // they are public and nothing fires.
    #[allow(dead_code)]
    #[derive(Archive, Debug)]
    pub struct RkyvExists {
        pub meta: RequestMeta,
        pub layout: Layout,
        pub keys: Vec<Vec<u8>>,
    }

    #[allow(dead_code)]
    #[derive(Archive, Debug)]
    pub struct RkyvDelete {
        pub meta: RequestMeta,
        pub layout: Layout,
        pub keys: Vec<Vec<u8>>,
    }

    #[allow(dead_code)]
    #[derive(Archive, Debug)]
    pub struct RkyvLookup {
        pub meta: RequestMeta,
        pub layout: Layout,
        pub keys: Vec<Vec<u8>>,
        pub pins: u32,
    }

    #[allow(dead_code)]
    #[derive(Archive, Debug)]
    pub struct RkyvUnpin {
        pub meta: RequestMeta,
        pub layout: Layout,
        pub keys: Vec<Vec<u8>>,
        pub counts: Vec<u32>,
    }

    /// rkyv's structural check of `payload` (8-aligned) as a `kind`
    /// message: `(with rkyv's per-key check, with ours)`, `None` for a kind
    /// that carries no key list. The protocol's own rules (`Validate`) are
    /// not applied: only the archive's structure is compared.
    pub fn verdicts(kind: Kind, payload: &[u8]) -> Option<(bool, bool)> {
        use rkyv::api::low::access;
        Some(match kind {
            Kind::Exists => (
                access::<ArchivedRkyvExists, rancor::Error>(payload).is_ok(),
                access::<ArchivedExists, rancor::Error>(payload).is_ok(),
            ),
            Kind::Delete => (
                access::<ArchivedRkyvDelete, rancor::Error>(payload).is_ok(),
                access::<ArchivedDelete, rancor::Error>(payload).is_ok(),
            ),
            Kind::Lookup => (
                access::<ArchivedRkyvLookup, rancor::Error>(payload).is_ok(),
                access::<ArchivedLookup, rancor::Error>(payload).is_ok(),
            ),
            Kind::Unpin => (
                access::<ArchivedRkyvUnpin, rancor::Error>(payload).is_ok(),
                access::<ArchivedUnpin, rancor::Error>(payload).is_ok(),
            ),
            _ => return None,
        })
    }
}
