//! Value types that appear inside several messages: locations, layouts,
//! region descriptions and capabilities, request and reply metadata, limits,
//! pool descriptions, and the per-key bitmap.
//!
//! Ids are plain integers on the wire (the protocol is described in integers
//! in `docs/protocol.md`); typed accessors convert to the data plane's
//! newtypes where a mix-up would be a bug ([`Location::region_id`], …).

use std::fmt;

use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};
use rkyv::{Archive, Deserialize, Serialize};

/// Where one KV chunk lives: a page of a region, at a page generation.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct Location {
    /// Region id (issued by the pool manager, globally unique, never reused).
    pub region: u64,
    /// Page index within the region: the page starts at
    /// `page * page_size_bytes` from the region's start.
    pub page: u32,
    /// The page's generation when the chunk was written. Every allocation of
    /// a page bumps it, so a freed-page notice naming an older generation is
    /// recognised as stale by the owner.
    pub generation: u32,
    /// Bytes of the chunk, stored from the start of the page; at most the
    /// layout's page size (a partial last chunk is shorter).
    pub len_bytes: u32,
}

impl Location {
    pub fn region_id(&self) -> RegionId {
        RegionId(self.region)
    }

    pub fn page_index(&self) -> PageIndex {
        PageIndex(self.page)
    }

    pub fn page_generation(&self) -> Generation {
        Generation(self.generation)
    }
}

impl From<&ArchivedLocation> for Location {
    fn from(a: &ArchivedLocation) -> Self {
        Self {
            region: a.region.to_native(),
            page: a.page.to_native(),
            generation: a.generation.to_native(),
            len_bytes: a.len_bytes.to_native(),
        }
    }
}

/// A page size plus a fingerprint of everything else that makes two chunks
/// interchangeable (model, dtype, shape, chunk tokens, TP rank layout). The
/// directory's key space is `(layout, key)`: a reader of one layout is never
/// handed a page of another.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct Layout {
    /// Bytes per page: a multiple of [`PAGE_QUANTUM_BYTES`](super::PAGE_QUANTUM_BYTES),
    /// at most [`MAX_PAGE_BYTES`](super::MAX_PAGE_BYTES) (checked at the edge).
    pub page_size_bytes: u64,
    /// Opaque 64-bit fingerprint chosen by the engine.
    pub fingerprint: u64,
}

impl From<&ArchivedLayout> for Layout {
    fn from(a: &ArchivedLayout) -> Self {
        Self {
            page_size_bytes: a.page_size_bytes.to_native(),
            fingerprint: a.fingerprint.to_native(),
        }
    }
}

/// Everything a client needs to map a region (its own or a peer's).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct RegionDesc {
    /// Region id.
    pub region: u64,
    /// Pool (index into the pools announced by `Welcome`).
    pub pool: u32,
    /// Offset of the region in the pool, a multiple of the pool alignment.
    pub offset_bytes: u64,
    /// Region length, a multiple of the pool alignment.
    pub len_bytes: u64,
    /// Page size of the layout the region is assigned to.
    pub page_size_bytes: u64,
}

impl RegionDesc {
    pub fn region_id(&self) -> RegionId {
        RegionId(self.region)
    }

    pub fn pool_id(&self) -> PoolId {
        PoolId(self.pool)
    }
}

impl From<&ArchivedRegionDesc> for RegionDesc {
    fn from(a: &ArchivedRegionDesc) -> Self {
        Self {
            region: a.region.to_native(),
            pool: a.pool.to_native(),
            offset_bytes: a.offset_bytes.to_native(),
            len_bytes: a.len_bytes.to_native(),
            page_size_bytes: a.page_size_bytes.to_native(),
        }
    }
}

/// Compares two secrets in time independent of where they differ, so a
/// forger cannot learn a token byte by byte from response times.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // `black_box` keeps the optimiser from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

/// Gives a 32-byte secret newtype a constant-time `==` and a `Debug` that
/// never prints the bytes (they would end up in logs).
macro_rules! secret32 {
    ($name:ident, $archived:ident) => {
        impl $name {
            /// Constant-time comparison with raw bytes.
            pub fn ct_eq(&self, other: &[u8; 32]) -> bool {
                ct_eq(&self.0, other)
            }
        }

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                ct_eq(&self.0, &other.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($name), "(<redacted>)"))
            }
        }

        impl $archived {
            /// The bytes, for a constant-time comparison.
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            pub fn to_native(&self) -> $name {
                $name(self.0)
            }
        }

        impl fmt::Debug for $archived {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($archived), "(<redacted>)"))
            }
        }
    };
}

/// Capability for one region: a keyed hash (the pool manager's secret) over
/// the region handle and its owner label. Proves ownership on control-plane
/// operations (return, free, reattach); it does not gate mapping.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Eq)]
pub struct RegionToken(pub [u8; 32]);

secret32!(RegionToken, ArchivedRegionToken);

/// Issued by the directory on an instance's first `Hello`; presented by
/// `Reattach` to resume the instance on a new connection.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Eq)]
pub struct InstanceSecret(pub [u8; 32]);

secret32!(InstanceSecret, ArchivedInstanceSecret);

/// Carried by every request.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct RequestMeta {
    /// Per-instance sequence number of a mutating request (non-zero, never
    /// reused within the instance); 0 on read-only requests. See the
    /// exactly-once rules in the module documentation.
    pub seq: u64,
    /// Highest freed-page notice sequence number this region owner has
    /// applied (0: none yet). Always 0 on pool-manager requests.
    pub notice_ack: u64,
    /// On a mutating request: the client has received the reply of every
    /// request of its instance with a `seq` below this one (0 or 1: no
    /// claim), so the directory may drop those cached replies early. At most
    /// `seq`; 0 on read-only and pool-manager requests. Never needed for
    /// correctness: the reply window bounds the cache anyway.
    pub replies_received_below: u64,
}

impl From<&ArchivedRequestMeta> for RequestMeta {
    fn from(a: &ArchivedRequestMeta) -> Self {
        Self {
            seq: a.seq.to_native(),
            notice_ack: a.notice_ack.to_native(),
            replies_received_below: a.replies_received_below.to_native(),
        }
    }
}

/// Tells a region owner that one of its pages is free again (its key was
/// deleted, by any client). Re-sent until acknowledged by `notice_ack`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct FreedPage {
    /// Per-instance notice sequence number: 1, 2, 3, … without gaps.
    pub seq: u64,
    pub region: u64,
    pub page: u32,
    /// The generation the page had when its key was registered; the owner
    /// frees the page only if it still has this generation.
    pub generation: u32,
}

impl FreedPage {
    pub fn region_id(&self) -> RegionId {
        RegionId(self.region)
    }

    pub fn page_index(&self) -> PageIndex {
        PageIndex(self.page)
    }

    pub fn page_generation(&self) -> Generation {
        Generation(self.generation)
    }
}

impl From<&ArchivedFreedPage> for FreedPage {
    fn from(a: &ArchivedFreedPage) -> Self {
        Self {
            seq: a.seq.to_native(),
            region: a.region.to_native(),
            page: a.page.to_native(),
            generation: a.generation.to_native(),
        }
    }
}

/// Memory accounting of the calling instance, piggybacked on every directory
/// reply so that a client's memory-usage query needs no round trip.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct Usage {
    /// Page bytes of the keys this instance registered and that still exist
    /// (whole pages: a page is used whatever the chunk length).
    pub instance_used_bytes: u64,
    /// Bytes of the regions assigned to this instance.
    pub instance_owned_bytes: u64,
    /// The instance's quota; 0 when it has none.
    pub instance_quota_bytes: u64,
    /// Free bytes left in all pools (not yet carved into regions).
    pub pool_free_bytes: u64,
}

impl From<&ArchivedUsage> for Usage {
    fn from(a: &ArchivedUsage) -> Self {
        Self {
            instance_used_bytes: a.instance_used_bytes.to_native(),
            instance_owned_bytes: a.instance_owned_bytes.to_native(),
            instance_quota_bytes: a.instance_quota_bytes.to_native(),
            pool_free_bytes: a.pool_free_bytes.to_native(),
        }
    }
}

/// Carried by every directory reply (except `ErrorReply`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct ReplyMeta {
    /// Unacknowledged freed-page notices for the calling instance, in
    /// sequence order, at most [`MAX_NOTICES_PER_REPLY`](super::MAX_NOTICES_PER_REPLY).
    pub notices: Vec<FreedPage>,
    /// The calling instance's memory accounting after this request.
    pub usage: Usage,
}

impl ArchivedReplyMeta {
    /// Pending freed-page notices, oldest first.
    pub fn notices(&self) -> impl ExactSizeIterator<Item = FreedPage> + '_ {
        self.notices.iter().map(FreedPage::from)
    }
}

/// The limits a server enforces on this connection (announced by `Welcome`).
/// Never larger than the protocol constants; a server may configure smaller.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct Limits {
    /// Largest frame on the wire, header and padding included.
    pub max_frame_bytes: u32,
    pub max_key_bytes: u32,
    /// Most keys (entries, regions) in one request.
    pub max_batch: u32,
    /// Most requests in flight per connection; more get `Busy`.
    pub max_inflight: u32,
    /// Most pins taken (or released) per key by one request.
    pub max_pins_per_key: u32,
    /// Width of the exactly-once window, in sequence numbers: a client keeps
    /// its newest `seq` less than this ahead of its oldest unanswered one.
    pub reply_cache_len: u32,
}

/// How a pool is backed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum BackingKind {
    /// A device-DAX character device (`/dev/daxX.Y`).
    DevDax = 0,
    /// A file: on tmpfs (`/dev/shm`), hugetlbfs, or a DAX filesystem.
    File = 1,
}

/// How writes become visible to readers of a pool (DESIGN §3).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum VisibilityMode {
    /// Hardware-coherent (one host): publish and acquire are fences.
    Coherent = 0,
    /// Not coherent across hosts: writers write back, readers invalidate.
    Flush = 1,
}

/// One pool, as announced to clients (by the directory) and to directories
/// (by the pool manager).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PoolInfo {
    /// The pool's index within its pool manager.
    pub pool: u32,
    /// The UUID in the pool's identity header: a remote host finds its own
    /// path to the same device by it.
    pub uuid: [u8; 16],
    pub size_bytes: u64,
    /// Region offsets and lengths are multiples of this (e.g. 2 MiB).
    pub align_bytes: u64,
    /// The server's path for the pool (informative for remote hosts).
    pub path: String,
    pub kind: BackingKind,
    pub visibility: VisibilityMode,
}

/// Who a region is allocated for: the directory that asked and the client
/// instance it assigns the region to. Part of the token's hashed input.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug))]
pub struct OwnerLabel {
    pub directory_id: String,
    pub instance_id: String,
}

/// A pool manager's capability for one region.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionHandle {
    pub region: u64,
    pub pool: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub owner: OwnerLabel,
    pub token: RegionToken,
}

/// A region a reattach (or a region operation) did not accept, and why.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RefusedRegion {
    pub region: u64,
    /// An [`ErrorCode`](super::ErrorCode) number (`BadToken`,
    /// `UnknownRegion`, `NotOwner`, …).
    pub code: u16,
}

/// One bit per key of a request, in key order (answer to `Exists`).
///
/// Invariant (checked at the edge): `words.len() == len.div_ceil(64)` and the
/// bits past `len` are zero, so two equal bitmaps are equal bytes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct KeyBitmap {
    /// Number of keys described.
    pub len: u32,
    /// Bit `i % 64` of word `i / 64` is key `i`.
    pub words: Vec<u64>,
}

impl KeyBitmap {
    /// `len` keys, all absent.
    pub fn new(len: u32) -> Self {
        Self {
            len,
            words: vec![0; (len as usize).div_ceil(64)],
        }
    }

    /// Sets key `i`'s bit.
    ///
    /// # Panics
    /// If `i >= len` (a caller bug: the bitmap describes exactly the keys of
    /// one request).
    pub fn set(&mut self, i: u32, present: bool) {
        assert!(i < self.len, "key {i} out of a bitmap of {} keys", self.len);
        let (word, bit) = ((i / 64) as usize, i % 64);
        if present {
            self.words[word] |= 1 << bit;
        } else {
            self.words[word] &= !(1 << bit);
        }
    }

    /// Key `i`'s bit; `None` past the end.
    pub fn get(&self, i: u32) -> Option<bool> {
        (i < self.len).then(|| self.words[(i / 64) as usize] >> (i % 64) & 1 == 1)
    }
}

impl FromIterator<bool> for KeyBitmap {
    /// Word by word (the server builds one per `Exists` reply, up to a
    /// batch of keys: a bounds-checked `set` per key showed in its profile).
    fn from_iter<I: IntoIterator<Item = bool>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut words = Vec::with_capacity(iter.size_hint().0.div_ceil(64));
        let (mut len, mut word) = (0u32, 0u64);
        for present in iter {
            word |= u64::from(present) << (len % 64);
            len += 1;
            if len % 64 == 0 {
                words.push(word);
                word = 0;
            }
        }
        if len % 64 != 0 {
            words.push(word);
        }
        Self { len, words }
    }
}

impl ArchivedKeyBitmap {
    pub fn len(&self) -> u32 {
        self.len.to_native()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Key `i`'s bit; `None` past the end.
    pub fn get(&self, i: u32) -> Option<bool> {
        if i >= self.len() {
            return None;
        }
        // In range: validation checked `words.len() == len.div_ceil(64)`.
        let word = self.words.get((i / 64) as usize)?;
        Some(word.to_native() >> (i % 64) & 1 == 1)
    }

    /// The bits in key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = bool> + '_ {
        (0..self.len()).map(|i| self.get(i) == Some(true))
    }
}
