//! The pool identity header: the first aligned block of every pool says
//! "this is cxlkv pool U, of this size and alignment", and carries the lease
//! of the manager that serves it.
//!
//! Sans-IO: every function here works on a byte block (`&[u8]` /
//! `&mut [u8]`). The glue that maps the first block of a backing, calls these
//! functions and makes the writes visible (the dataplane's `publish` on a
//! non-coherent device) lives with the driver; the order it must follow is in
//! `docs/pool-manager.md` ("Opening a pool").
//!
//! Layout (little-endian), 192 bytes at offset 0 of the block; the rest of
//! the block is reserved and never written:
//!
//! ```text
//! identity section, written once                 lease slot (×2: at 64 and 128)
//!  0  8  magic "CXLKVPOL"                           0  8  seq (≥ 1; slot = seq % 2)
//!  8  4  format version (1)                         8  8  manager epoch
//! 12  4  reserved 0                                16  8  lease expiry (Unix ms,
//! 16 16  pool UUID                                        the holder's wall clock)
//! 32  8  size_bytes                                24 16  holder (manager id)
//! 40  8  alignment_bytes                           40 20  reserved 0
//! 48 12  reserved 0                                60  4  CRC32C of [0, 60)
//! 60  4  CRC32C of [0, 60)
//! ```
//!
//! The identity is written once, into a block that must be entirely zero
//! (a fresh pool file, a zeroed device). Every open decodes and verifies it:
//! a non-zero block without the magic is "not a cxlkv pool or corrupt" and is
//! refused, never overwritten; a size or alignment that differs from the
//! backing is refused.
//!
//! The lease is rewritten on every renewal, so it has two slots written
//! alternately, each with its own CRC: a crash in the middle of a renewal
//! tears at most the slot being written, and the other still holds the
//! previous lease. The valid slot with the higher `seq` is the current lease.
//!
//! What the epoch and lease guarantee — and what they do not. On one host,
//! mutual exclusion comes from `flock` on the state directory and the pool
//! file ([`super::fence`]); the header adds a best-effort guard for managers
//! on *other* hosts sharing the device, which cannot see those locks:
//! - a manager starting on a pool whose lease is held by another manager and
//!   not yet expired *by the starter's clock* refuses to start
//!   ([`check_takeover`]); after expiry it takes over with a higher epoch;
//! - a manager that renews its lease first re-reads the header and, if a
//!   different holder or epoch is there, learns it was superseded
//!   ([`renew`]) and must stop allocating from that pool at once;
//! - epochs only grow: a new epoch is above both the header's and the
//!   journal's, so a stale manager can always be told apart.
//!
//! It does **not** give mutual exclusion without a bound on clock skew and on
//! pauses: a holder paused longer than its lease (or a starter whose clock
//! runs ahead by more than the lease) lets two managers believe they serve the
//! pool until the stale one's next renewal. Two managers starting at the same
//! moment can both see an expired lease and both write (there is no
//! cross-host compare-and-swap on memory that is not coherent across hosts).
//! Run one manager per device across hosts by configuration; the lease turns
//! a mistake into a refusal or a prompt self-fencing in the common cases.

use super::ledger::{GeometryError, check_geometry};
use super::record::{Reader, Writer, le_u32};
use super::types::{ManagerId, PoolUuid};

/// `b"CXLKVPOL"`.
pub const HEADER_MAGIC: [u8; 8] = *b"CXLKVPOL";
/// The header format this build writes and reads.
pub const HEADER_FORMAT_VERSION: u32 = 1;
/// Bytes of the block the header uses (identity and two lease slots).
pub const HEADER_BYTES: usize = 192;

const IDENTITY_AT: usize = 0;
const SLOT_AT: [usize; 2] = [64, 128];
const SECTION_BYTES: usize = 64;
const CRC_AT: usize = 60;

const _: () = assert!(SLOT_AT[1] + SECTION_BYTES == HEADER_BYTES);
const _: () = assert!(
    (HEADER_BYTES as u64) <= super::ledger::MIN_ALIGNMENT_BYTES,
    "the header must fit in the smallest first block"
);

/// What makes a pool the pool it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolIdentity {
    pub uuid: PoolUuid,
    pub size_bytes: u64,
    pub alignment_bytes: u64,
}

/// A manager's claim on a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManagerLease {
    /// Which slot-write this is; alternate slots, the higher one is current.
    pub seq: u64,
    pub epoch: u64,
    /// Wall-clock (Unix ms) expiry by the holder's clock.
    pub expires_unix_ms: u64,
    pub holder: ManagerId,
}

/// A decoded, checksum-verified header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub identity: PoolIdentity,
    /// The current lease, if any slot holds a valid one.
    pub lease: Option<ManagerLease>,
    /// Lease slots that are non-zero but invalid (a torn renewal). Evidence
    /// that a manager has served this pool even when no lease survived.
    pub torn_lease_slots: u8,
}

impl Header {
    /// The highest epoch recorded in the header (0 if none).
    pub fn epoch(&self) -> u64 {
        self.lease.map_or(0, |l| l.epoch)
    }

    /// True when some manager has ever written a lease here: a pool with such
    /// a header may have live regions, even if this manager does not know it.
    pub fn has_served(&self) -> bool {
        self.lease.is_some() || self.torn_lease_slots > 0
    }
}

/// What the first block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Entirely zero: a fresh pool, ready for [`encode_identity`].
    Fresh,
    Initialised(Header),
}

/// Why a header cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    #[error("the header block is {len_bytes} bytes, at least {HEADER_BYTES} are needed")]
    BlockTooSmall { len_bytes: usize },
    #[error(
        "not a cxlkv pool or corrupt: the first block is not zero and does not start with the cxlkv pool magic (found {found:02x?})"
    )]
    NotAPool { found: [u8; 8] },
    #[error("the pool header's identity section is corrupt (checksum or reserved bytes)")]
    IdentityCorrupt,
    #[error(
        "pool header format version {found} is not supported (this build reads {HEADER_FORMAT_VERSION})"
    )]
    UnsupportedVersion { found: u32 },
    #[error("pool header geometry is invalid: {0}")]
    Geometry(GeometryError),
    #[error("both lease slots of the pool header are corrupt")]
    LeaseSlotsCorrupt,
    #[error(
        "the pool was initialised for {header_bytes} bytes but the backing has {backing_bytes}"
    )]
    SizeMismatch {
        header_bytes: u64,
        backing_bytes: u64,
    },
    #[error(
        "the pool was initialised with alignment {header_bytes} but the backing has alignment {backing_bytes}"
    )]
    AlignmentMismatch {
        header_bytes: u64,
        backing_bytes: u64,
    },
    #[error("refusing to initialise a pool header over a block that is not entirely zero")]
    NotFresh,
}

/// Why a manager may not take or keep a pool's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    #[error(
        "pool is served by manager {holder} (epoch {epoch}) whose lease runs until {expires_unix_ms} (Unix ms); it is now {now_unix_ms} here. Another pool manager already serves this pool; stop it first, or wait for its lease to expire"
    )]
    HeldByAnother {
        holder: ManagerId,
        epoch: u64,
        expires_unix_ms: u64,
        now_unix_ms: u64,
    },
    #[error(
        "this manager (epoch {mine}) was superseded by manager {holder} at epoch {epoch}; stop serving the pool"
    )]
    Superseded {
        holder: ManagerId,
        epoch: u64,
        mine: u64,
    },
    #[error("this manager's lease is no longer in the pool header; stop serving the pool")]
    Lost,
}

fn section_crc(section: &[u8]) -> u32 {
    crc32c::crc32c(&section[..CRC_AT])
}

fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Decodes and verifies the header in `block` (the pool's first aligned
/// block, or at least its first [`HEADER_BYTES`]). A fully zero block is
/// [`BlockState::Fresh`].
pub fn decode(block: &[u8]) -> Result<BlockState, HeaderError> {
    if block.len() < HEADER_BYTES {
        return Err(HeaderError::BlockTooSmall {
            len_bytes: block.len(),
        });
    }
    let id = &block[IDENTITY_AT..IDENTITY_AT + SECTION_BYTES];
    let mut r = Reader { buf: id, at: 0 };
    let magic: [u8; 8] = r.array();
    if magic != HEADER_MAGIC {
        if is_zero(block) {
            return Ok(BlockState::Fresh);
        }
        return Err(HeaderError::NotAPool { found: magic });
    }
    if le_u32(&id[CRC_AT..]) != section_crc(id) {
        return Err(HeaderError::IdentityCorrupt);
    }
    let version = r.u32();
    let reserved_a = r.u32();
    let uuid = PoolUuid(r.array());
    let size_bytes = r.u64();
    let alignment_bytes = r.u64();
    let reserved_b: [u8; 12] = r.array();
    if version != HEADER_FORMAT_VERSION {
        return Err(HeaderError::UnsupportedVersion { found: version });
    }
    if reserved_a != 0 || !is_zero(&reserved_b) {
        return Err(HeaderError::IdentityCorrupt);
    }
    check_geometry(size_bytes, alignment_bytes).map_err(HeaderError::Geometry)?;
    let mut lease: Option<ManagerLease> = None;
    let mut torn = 0u8;
    for (index, at) in SLOT_AT.iter().enumerate() {
        let slot = &block[*at..*at + SECTION_BYTES];
        if is_zero(slot) {
            continue;
        }
        match decode_slot(slot, index) {
            Some(l) => {
                if lease.is_none_or(|cur| l.seq > cur.seq) {
                    lease = Some(l);
                }
            }
            None => torn += 1,
        }
    }
    if torn == 2 {
        return Err(HeaderError::LeaseSlotsCorrupt);
    }
    Ok(BlockState::Initialised(Header {
        identity: PoolIdentity {
            uuid,
            size_bytes,
            alignment_bytes,
        },
        lease,
        torn_lease_slots: torn,
    }))
}

/// Largest lease seq or epoch a header may hold (2^62).
const MAX_COUNTER: u64 = 1 << 62;

fn decode_slot(slot: &[u8], index: usize) -> Option<ManagerLease> {
    if le_u32(&slot[CRC_AT..]) != section_crc(slot) {
        return None;
    }
    let mut r = Reader { buf: slot, at: 0 };
    let seq = r.u64();
    let epoch = r.u64();
    let expires_unix_ms = r.u64();
    let holder = ManagerId(r.array());
    let reserved: [u8; 20] = r.array();
    // A counter this close to wrapping was not written by a manager (one
    // renewal a second for 10^11 years): corrupt, and `seq + 1` must not wrap.
    let valid = (1..=MAX_COUNTER).contains(&seq)
        && epoch <= MAX_COUNTER
        && seq % 2 == index as u64
        && is_zero(&reserved);
    valid.then_some(ManagerLease {
        seq,
        epoch,
        expires_unix_ms,
        holder,
    })
}

/// Writes the identity section of a fresh pool. The block must be entirely
/// zero; the lease slots stay empty until [`write_lease`].
pub fn encode_identity(block: &mut [u8], identity: &PoolIdentity) -> Result<(), HeaderError> {
    if block.len() < HEADER_BYTES {
        return Err(HeaderError::BlockTooSmall {
            len_bytes: block.len(),
        });
    }
    check_geometry(identity.size_bytes, identity.alignment_bytes).map_err(HeaderError::Geometry)?;
    if !is_zero(block) {
        return Err(HeaderError::NotFresh);
    }
    let mut section = [0u8; SECTION_BYTES];
    let mut w = Writer {
        buf: &mut section,
        at: 0,
    };
    w.bytes(&HEADER_MAGIC);
    w.u32(HEADER_FORMAT_VERSION);
    w.u32(0);
    w.bytes(&identity.uuid.0);
    w.u64(identity.size_bytes);
    w.u64(identity.alignment_bytes);
    let crc = section_crc(&section);
    section[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
    block[IDENTITY_AT..IDENTITY_AT + SECTION_BYTES].copy_from_slice(&section);
    Ok(())
}

/// Checks that a decoded header belongs to a backing of this geometry.
pub fn verify(header: &Header, size_bytes: u64, alignment_bytes: u64) -> Result<(), HeaderError> {
    if header.identity.size_bytes != size_bytes {
        return Err(HeaderError::SizeMismatch {
            header_bytes: header.identity.size_bytes,
            backing_bytes: size_bytes,
        });
    }
    if header.identity.alignment_bytes != alignment_bytes {
        return Err(HeaderError::AlignmentMismatch {
            header_bytes: header.identity.alignment_bytes,
            backing_bytes: alignment_bytes,
        });
    }
    Ok(())
}

/// The bytes of the block [`encode_identity`] writes.
pub const IDENTITY_RANGE: std::ops::Range<usize> = IDENTITY_AT..IDENTITY_AT + SECTION_BYTES;

/// The bytes of the block [`write_lease`] writes for `lease`: its slot. A
/// driver that keeps a copy of the header writes back only these, so that
/// the other slot — which another host's manager may be writing, that is
/// the lease protocol — is never rewritten from a stale copy.
pub fn lease_slot_range(lease: &ManagerLease) -> std::ops::Range<usize> {
    let at = SLOT_AT[(lease.seq % 2) as usize];
    at..at + SECTION_BYTES
}

/// Writes `lease` into its slot (`seq % 2`), leaving the other slot — the
/// previous lease — intact.
pub fn write_lease(block: &mut [u8], lease: &ManagerLease) -> Result<(), HeaderError> {
    if block.len() < HEADER_BYTES {
        return Err(HeaderError::BlockTooSmall {
            len_bytes: block.len(),
        });
    }
    debug_assert!(lease.seq >= 1);
    let mut slot = [0u8; SECTION_BYTES];
    let mut w = Writer {
        buf: &mut slot,
        at: 0,
    };
    w.u64(lease.seq);
    w.u64(lease.epoch);
    w.u64(lease.expires_unix_ms);
    w.bytes(&lease.holder.0);
    let crc = section_crc(&slot);
    slot[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
    block[lease_slot_range(lease)].copy_from_slice(&slot);
    Ok(())
}

/// May manager `me` take this pool now? Refuses while another manager's
/// lease has not expired by `now_unix_ms`. A lease held by `me` (a restart of
/// the same state directory, which the local file locks already made
/// exclusive) may be taken over at once.
pub fn check_takeover(header: &Header, me: ManagerId, now_unix_ms: u64) -> Result<(), LeaseError> {
    match header.lease {
        Some(l) if l.holder != me && now_unix_ms < l.expires_unix_ms => {
            Err(LeaseError::HeldByAnother {
                holder: l.holder,
                epoch: l.epoch,
                expires_unix_ms: l.expires_unix_ms,
                now_unix_ms,
            })
        }
        _ => Ok(()),
    }
}

/// The first lease of a manager that took the pool with `epoch` (from
/// `PoolManager::open_pool`, which made it exceed [`Header::epoch`]).
pub fn new_lease(
    header: &Header,
    me: ManagerId,
    epoch: u64,
    now_unix_ms: u64,
    lease_ms: u64,
) -> ManagerLease {
    debug_assert!(epoch > header.epoch(), "a takeover must raise the epoch");
    ManagerLease {
        seq: header.lease.map_or(1, |l| l.seq + 1),
        epoch,
        expires_unix_ms: now_unix_ms.saturating_add(lease_ms),
        holder: me,
    }
}

/// The next lease of a manager whose last write was `mine`, given the header
/// as re-read now. Fails when someone else has written since.
pub fn renew(
    header: &Header,
    mine: &ManagerLease,
    now_unix_ms: u64,
    lease_ms: u64,
) -> Result<ManagerLease, LeaseError> {
    match header.lease {
        Some(cur) if cur == *mine => Ok(ManagerLease {
            seq: mine.seq + 1,
            expires_unix_ms: now_unix_ms.saturating_add(lease_ms),
            ..*mine
        }),
        Some(cur) if cur.holder != mine.holder || cur.epoch != mine.epoch => {
            Err(LeaseError::Superseded {
                holder: cur.holder,
                epoch: cur.epoch,
                mine: mine.epoch,
            })
        }
        _ => Err(LeaseError::Lost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: usize = 4096;
    const ME: ManagerId = ManagerId([1; 16]);
    const OTHER: ManagerId = ManagerId([2; 16]);

    fn identity() -> PoolIdentity {
        PoolIdentity {
            uuid: PoolUuid([0x5a; 16]),
            size_bytes: 1 << 30,
            alignment_bytes: 2 << 20,
        }
    }

    fn initialised() -> Vec<u8> {
        let mut b = vec![0u8; BLOCK];
        encode_identity(&mut b, &identity()).unwrap();
        b
    }

    fn header(b: &[u8]) -> Header {
        match decode(b).unwrap() {
            BlockState::Initialised(h) => h,
            BlockState::Fresh => panic!("expected an initialised header"),
        }
    }

    #[test]
    fn a_zero_block_is_fresh_and_round_trips_once_initialised() {
        let mut b = vec![0u8; BLOCK];
        assert_eq!(decode(&b).unwrap(), BlockState::Fresh);
        encode_identity(&mut b, &identity()).unwrap();
        let h = header(&b);
        assert_eq!(h.identity, identity());
        assert_eq!(
            (h.lease, h.torn_lease_slots, h.has_served()),
            (None, 0, false)
        );
        verify(&h, 1 << 30, 2 << 20).unwrap();
        assert_eq!(&b[..8], b"CXLKVPOL");
        assert!(
            b[HEADER_BYTES..].iter().all(|&x| x == 0),
            "the rest of the block is untouched"
        );
    }

    /// A lease slot whose counters could wrap on the next renewal (CRC
    /// valid, so written on purpose by something else) reads as torn, not
    /// as a lease.
    #[test]
    fn a_lease_with_counters_near_u64_max_is_not_a_lease() {
        for (seq, epoch) in [(u64::MAX - 1, 3), (2, u64::MAX)] {
            let mut b = initialised();
            let lease = ManagerLease {
                seq,
                epoch,
                expires_unix_ms: 1,
                holder: ME,
            };
            write_lease(&mut b, &lease).unwrap();
            let h = header(&b);
            assert_eq!((h.lease, h.torn_lease_slots), (None, 1), "{seq} {epoch}");
        }
    }

    #[test]
    fn initialising_twice_or_over_foreign_data_is_refused() {
        let mut b = initialised();
        assert_eq!(
            encode_identity(&mut b, &identity()),
            Err(HeaderError::NotFresh)
        );
        let mut foreign = vec![0u8; BLOCK];
        foreign[BLOCK - 1] = 1;
        assert_eq!(
            encode_identity(&mut foreign, &identity()),
            Err(HeaderError::NotFresh)
        );
    }

    #[test]
    fn a_non_zero_block_without_magic_is_not_a_pool() {
        let mut b = vec![0u8; BLOCK];
        b[..8].copy_from_slice(b"\x7fELF\x02\x01\x01\x00");
        let e = decode(&b).unwrap_err();
        assert!(matches!(e, HeaderError::NotAPool { .. }));
        assert!(e.to_string().contains("not a cxlkv pool or corrupt"), "{e}");
        // Zero identity but data further in the block: not fresh either.
        let mut b = vec![0u8; BLOCK];
        b[1000] = 9;
        assert!(matches!(decode(&b), Err(HeaderError::NotAPool { .. })));
    }

    #[test]
    fn any_bit_flip_in_the_identity_is_refused() {
        let b = initialised();
        for bit in 0..SECTION_BYTES * 8 {
            let mut c = b.clone();
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&c).is_err(), "bit {bit} went unnoticed");
        }
    }

    #[test]
    fn size_or_alignment_mismatch_is_refused() {
        let h = header(&initialised());
        assert_eq!(
            verify(&h, 2 << 30, 2 << 20),
            Err(HeaderError::SizeMismatch {
                header_bytes: 1 << 30,
                backing_bytes: 2 << 30
            })
        );
        assert_eq!(
            verify(&h, 1 << 30, 1 << 30),
            Err(HeaderError::AlignmentMismatch {
                header_bytes: 2 << 20,
                backing_bytes: 1 << 30
            })
        );
    }

    #[test]
    fn leases_alternate_slots_and_a_torn_renewal_keeps_the_previous_lease() {
        let mut b = initialised();
        let first = new_lease(&header(&b), ME, 1, 1_000, 500);
        assert_eq!((first.seq, first.expires_unix_ms), (1, 1_500));
        write_lease(&mut b, &first).unwrap();
        assert_eq!(header(&b).lease, Some(first));
        let second = renew(&header(&b), &first, 1_200, 500).unwrap();
        assert_eq!(
            (second.seq, second.epoch, second.expires_unix_ms),
            (2, 1, 1_700)
        );
        // Tear the write of the second lease: only part of its slot lands.
        let mut torn = b.clone();
        let mut full = b.clone();
        write_lease(&mut full, &second).unwrap();
        torn[SLOT_AT[0]..SLOT_AT[0] + 20].copy_from_slice(&full[SLOT_AT[0]..SLOT_AT[0] + 20]);
        let h = header(&torn);
        assert_eq!((h.lease, h.torn_lease_slots), (Some(first), 1));
        assert!(h.has_served());
        assert_eq!(header(&full).lease, Some(second));
    }

    #[test]
    fn identity_and_lease_writes_touch_only_their_ranges() {
        let mut b = vec![0u8; BLOCK];
        encode_identity(&mut b, &identity()).unwrap();
        assert!(b[IDENTITY_RANGE.end..].iter().all(|&x| x == 0));
        for seq in [1, 2] {
            let before = b.clone();
            let lease = ManagerLease {
                seq,
                epoch: 1,
                expires_unix_ms: 9,
                holder: ME,
            };
            write_lease(&mut b, &lease).unwrap();
            let range = lease_slot_range(&lease);
            assert!(range.end <= HEADER_BYTES && range.start >= IDENTITY_RANGE.end);
            for (i, (x, y)) in before.iter().zip(&b).enumerate() {
                assert!(x == y || range.contains(&i), "byte {i} outside {range:?}");
            }
        }
    }

    #[test]
    fn a_torn_first_lease_still_counts_as_served() {
        let mut b = initialised();
        b[SLOT_AT[1] + 3] = 0x77; // garbage where the first lease was being written
        let h = header(&b);
        assert_eq!(
            (h.lease, h.torn_lease_slots, h.has_served()),
            (None, 1, true)
        );
        b[SLOT_AT[0] + 9] = 0x77;
        assert_eq!(decode(&b), Err(HeaderError::LeaseSlotsCorrupt));
    }

    #[test]
    fn another_managers_unexpired_lease_refuses_takeover_until_it_expires() {
        let mut b = initialised();
        let theirs = new_lease(&header(&b), OTHER, 4, 10_000, 5_000);
        write_lease(&mut b, &theirs).unwrap();
        let h = header(&b);
        let e = check_takeover(&h, ME, 14_999).unwrap_err();
        assert!(matches!(e, LeaseError::HeldByAnother { epoch: 4, .. }));
        assert!(
            e.to_string()
                .contains("Another pool manager already serves this pool"),
            "{e}"
        );
        check_takeover(&h, ME, 15_000).unwrap();
        // The same manager (restarted) may take its own lease back at once.
        check_takeover(&h, OTHER, 10_001).unwrap();
        let mine = new_lease(&h, ME, 5, 15_000, 5_000);
        assert_eq!(mine.seq, 2);
        write_lease(&mut b, &mine).unwrap();
        // The old holder, renewing, learns it was superseded.
        assert_eq!(
            renew(&header(&b), &theirs, 15_001, 5_000),
            Err(LeaseError::Superseded {
                holder: ME,
                epoch: 5,
                mine: 4
            })
        );
    }
}
