//! Key-batch requests serialized straight from the caller's keys.
//!
//! [`Exists`], [`Lookup`], [`Delete`] and [`Unpin`] own their keys
//! (`Vec<Vec<u8>>`), so a client holding `&[K]` had to copy every key into
//! an allocation of its own before encoding, then free them all: 13.6 µs
//! for 512 keys of 100 bytes on the development VM, on the order of the
//! server's whole share of the same `Exists`. [`ExistsFrom`],
//! [`LookupFrom`], [`DeleteFrom`] and [`UnpinFrom`] borrow the keys instead
//! and archive exactly as the owned messages do (their `Archived` types
//! are the owned ones'), so they encode with [`encode_as`](super::encode_as)
//! into valid frames of the owned message, byte for byte the ones
//! [`encode`](super::encode) writes (tests in `proto::tests` compare them).

use rkyv::rancor::{Fallible, Source};
use rkyv::ser::{Allocator, Writer, WriterExt};
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Place, Serialize};

use super::common::{Layout, RequestMeta};
use super::directory::{ArchivedDelete, ArchivedExists, ArchivedLookup, ArchivedUnpin};
#[cfg(doc)]
use super::directory::{Delete, Exists, Lookup, Unpin};
use super::key_list::{PAIR_BYTES, resolve_keys};

/// Pairs per `write` of [`serialize_keys`] (a 1 KiB chunk on the stack).
const PAIRS_PER_WRITE: usize = 128;

/// An offset or length that does not fit the archive's 32 bits.
#[derive(Debug)]
struct TooLarge;

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("key batch too large for 32-bit archive offsets")
    }
}

impl std::error::Error for TooLarge {}

/// Writes `keys` as rkyv writes a `Vec<Vec<u8>>`: every key's bytes back
/// to back (byte alignment: no padding between them), then, aligned, the
/// vector of (relative pointer, length) pairs, each pointer counted from
/// its own position to its key's first byte. rkyv's own path
/// (`ArchivedVec::serialize_from_iter`) makes two calls per key and keeps
/// a resolver each; this writes the bytes in one pass and the pairs a
/// chunk at a time: 7.3 → 4.2 µs to encode a 512-key `ExistsFrom` of
/// 100-byte keys (`cargo bench -p cxlkv-controlplane --bench proto --
/// client_exists`, whose baseline, the owned message built from copies of
/// the keys, took 20.7–26.2 µs in the same runs).
fn serialize_keys<K, S>(keys: &[K], serializer: &mut S) -> Result<VecResolver, S::Error>
where
    K: AsRef<[u8]>,
    S: Fallible + Allocator + Writer + ?Sized,
    S::Error: Source,
{
    let mut key_pos = serializer.pos();
    for k in keys {
        serializer.write(k.as_ref())?;
    }
    let pos = serializer.align_for::<ArchivedVec<u8>>()?;
    let mut pair_pos = pos;
    let mut chunk = [0u8; PAIRS_PER_WRITE * PAIR_BYTES];
    for batch in keys.chunks(PAIRS_PER_WRITE) {
        for (dst, k) in chunk.chunks_exact_mut(PAIR_BYTES).zip(batch) {
            let len = k.as_ref().len();
            let offset = i32::try_from(key_pos as i64 - pair_pos as i64)
                .map_err(|_| S::Error::new(TooLarge))?;
            let len32 = u32::try_from(len).map_err(|_| S::Error::new(TooLarge))?;
            dst[..4].copy_from_slice(&offset.to_le_bytes());
            dst[4..].copy_from_slice(&len32.to_le_bytes());
            key_pos += len;
            pair_pos += PAIR_BYTES;
        }
        serializer.write(&chunk[..batch.len() * PAIR_BYTES])?;
    }
    Ok(VecResolver::from_pos(pos))
}

/// An [`Exists`] over borrowed keys (module docs).
#[derive(Debug)]
pub struct ExistsFrom<'a, K> {
    pub meta: RequestMeta,
    pub layout: Layout,
    pub keys: &'a [K],
}

/// A [`Delete`] over borrowed keys (module docs).
#[derive(Debug)]
pub struct DeleteFrom<'a, K> {
    pub meta: RequestMeta,
    pub layout: Layout,
    pub keys: &'a [K],
}

/// A [`Lookup`] over borrowed keys (module docs).
#[derive(Debug)]
pub struct LookupFrom<'a, K> {
    pub meta: RequestMeta,
    pub layout: Layout,
    pub keys: &'a [K],
    pub pins: u32,
}

/// `Archive` and `Serialize` for a borrowed form whose owned message has
/// the fields `meta`, `layout`, `keys` and, optionally, one plain field
/// after them, serialized in that order as rkyv's derive does.
macro_rules! keys_from {
    ($from:ident => $archived:ident $(, $extra:ident: $ty:ty)?) => {
        impl<K: AsRef<[u8]>> Archive for $from<'_, K> {
            type Archived = $archived;
            type Resolver = (
                rkyv::Resolver<RequestMeta>,
                rkyv::Resolver<Layout>,
                VecResolver,
                $(rkyv::Resolver<$ty>,)?
            );

            fn resolve(&self, resolver: Self::Resolver, out: Place<Self::Archived>) {
                rkyv::munge::munge!(let $archived { meta, layout, keys, $($extra,)? } = out);
                self.meta.resolve(resolver.0, meta);
                self.layout.resolve(resolver.1, layout);
                resolve_keys(self.keys.len(), resolver.2, keys);
                $(self.$extra.resolve(resolver.3, $extra);)?
            }
        }

        impl<K, S> Serialize<S> for $from<'_, K>
        where
            K: AsRef<[u8]>,
            S: Fallible + Allocator + Writer + ?Sized,
            S::Error: Source,
        {
            fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
                Ok((
                    self.meta.serialize(serializer)?,
                    self.layout.serialize(serializer)?,
                    serialize_keys(self.keys, serializer)?,
                    $(self.$extra.serialize(serializer)?,)?
                ))
            }
        }
    };
}

keys_from!(ExistsFrom => ArchivedExists);
keys_from!(DeleteFrom => ArchivedDelete);
keys_from!(LookupFrom => ArchivedLookup, pins: u32);

/// An [`Unpin`] over borrowed keys and counts (module docs).
#[derive(Debug)]
pub struct UnpinFrom<'a, K> {
    pub meta: RequestMeta,
    pub layout: Layout,
    pub keys: &'a [K],
    /// Same length as `keys` (as [`Unpin::counts`]).
    pub counts: &'a [u32],
}

impl<K: AsRef<[u8]>> Archive for UnpinFrom<'_, K> {
    type Archived = ArchivedUnpin;
    type Resolver = (
        rkyv::Resolver<RequestMeta>,
        rkyv::Resolver<Layout>,
        VecResolver,
        VecResolver,
    );

    fn resolve(&self, resolver: Self::Resolver, out: Place<Self::Archived>) {
        rkyv::munge::munge!(let ArchivedUnpin { meta, layout, keys, counts } = out);
        self.meta.resolve(resolver.0, meta);
        self.layout.resolve(resolver.1, layout);
        resolve_keys(self.keys.len(), resolver.2, keys);
        ArchivedVec::resolve_from_len(self.counts.len(), resolver.3, counts);
    }
}

impl<K, S> Serialize<S> for UnpinFrom<'_, K>
where
    K: AsRef<[u8]>,
    S: Fallible + Allocator + Writer + ?Sized,
    S::Error: Source,
{
    fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        Ok((
            self.meta.serialize(serializer)?,
            self.layout.serialize(serializer)?,
            serialize_keys(self.keys, serializer)?,
            ArchivedVec::serialize_from_slice(self.counts, serializer)?,
        ))
    }
}
