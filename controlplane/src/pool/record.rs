//! Journal records: what a mutation of the ledger looks like on disk, and
//! its byte codec (sans-IO; the file handling is in [`super::journal`]).
//!
//! Every record is self-delimiting and self-checking:
//!
//! ```text
//! offset size field
//!  0      4   body_len   bytes of the body that follows the 8-byte prefix
//!  4      4   crc32c     CRC32C over bytes [0, 4) ‖ body (length included)
//!  8      1   version    record format version (RECORD_VERSION)
//!  9      1   kind       1 PoolAdded, 2 PoolEpoch, 3 Allocated, 4 Freed, 5 Reclaimed
//! 10      2   reserved   0
//! 12      4   reserved   0
//! 16      8   seq        sequence number: consecutive, never reused
//! 24      …   payload    fixed size per kind (see `Record`)
//! ```
//!
//! Decoding tells apart two kinds of bad bytes, because recovery treats them
//! differently:
//! - *torn or corrupt*: an incomplete record, an impossible length, a CRC
//!   mismatch. This is what a crash during an append leaves behind (or media
//!   damage); recovery stops there and truncates.
//! - *not understood*: the CRC matches, so these bytes were written on
//!   purpose, but by a newer format (unknown version or kind) or with a
//!   length its kind does not have. Truncating would destroy data this build
//!   cannot read, so recovery refuses to start instead.

use super::types::{
    AllocTag, DirectoryId, InstanceId, OwnerLabel, PoolId, PoolUuid, RegionId, RegionRecord,
};

/// Version written in every record.
pub const RECORD_VERSION: u8 = 1;
/// Length and CRC, before the body.
pub const RECORD_PREFIX_BYTES: usize = 8;
/// Version, kind, reserved and sequence number, at the start of the body.
pub const RECORD_BODY_HEADER_BYTES: usize = 16;
/// Largest body length considered plausible. Larger lengths are treated as a
/// torn length field. Generous, so that a future record kind up to this size
/// is recognised by its CRC (and refused) rather than truncated.
pub const MAX_RECORD_BODY_BYTES: usize = 4096;
/// Largest record this build writes (an `Allocated`).
pub const MAX_RECORD_BYTES: usize = RECORD_PREFIX_BYTES + RECORD_BODY_HEADER_BYTES + 56;

/// One mutation of the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// A pool became known (payload 40 bytes: pool u32, reserved u32, uuid 16,
    /// size u64, alignment u64).
    PoolAdded {
        pool: PoolId,
        uuid: PoolUuid,
        size_bytes: u64,
        alignment_bytes: u64,
    },
    /// A manager took the pool with this epoch (payload 16 bytes: pool u32,
    /// reserved u32, epoch u64).
    PoolEpoch { pool: PoolId, epoch: u64 },
    /// A region was allocated (payload 56 bytes: region u64, pool u32,
    /// reserved u32, offset u64, len u64, directory u64, instance u64,
    /// tag u64).
    Allocated(RegionRecord),
    /// A region was freed by its directory (payload 8 bytes: region u64).
    Freed { region: RegionId },
    /// A region of a dead directory was reclaimed by the reaper (payload 8
    /// bytes: region u64).
    Reclaimed { region: RegionId },
}

const KIND_POOL_ADDED: u8 = 1;
const KIND_POOL_EPOCH: u8 = 2;
const KIND_ALLOCATED: u8 = 3;
const KIND_FREED: u8 = 4;
const KIND_RECLAIMED: u8 = 5;

fn payload_len(kind: u8) -> Option<usize> {
    match kind {
        KIND_POOL_ADDED => Some(40),
        KIND_POOL_EPOCH => Some(16),
        KIND_ALLOCATED => Some(56),
        KIND_FREED | KIND_RECLAIMED => Some(8),
        _ => None,
    }
}

const _: () = assert!(MAX_RECORD_BYTES == 80, "Allocated is the largest record");
const _: () = assert!(MAX_RECORD_BYTES <= RECORD_PREFIX_BYTES + MAX_RECORD_BODY_BYTES);

impl Record {
    fn kind(&self) -> u8 {
        match self {
            Self::PoolAdded { .. } => KIND_POOL_ADDED,
            Self::PoolEpoch { .. } => KIND_POOL_EPOCH,
            Self::Allocated(_) => KIND_ALLOCATED,
            Self::Freed { .. } => KIND_FREED,
            Self::Reclaimed { .. } => KIND_RECLAIMED,
        }
    }

    /// Appends the encoded record (prefix, body) to `out`. Does not allocate
    /// when `out` has `MAX_RECORD_BYTES` of spare capacity.
    pub fn encode(&self, seq: u64, out: &mut Vec<u8>) {
        let mut buf = [0u8; MAX_RECORD_BYTES];
        let mut w = Writer {
            buf: &mut buf,
            at: RECORD_PREFIX_BYTES,
        };
        w.u8(RECORD_VERSION);
        w.u8(self.kind());
        w.u16(0);
        w.u32(0);
        w.u64(seq);
        match *self {
            Self::PoolAdded {
                pool,
                uuid,
                size_bytes,
                alignment_bytes,
            } => {
                w.u32(pool.0);
                w.u32(0);
                w.bytes(&uuid.0);
                w.u64(size_bytes);
                w.u64(alignment_bytes);
            }
            Self::PoolEpoch { pool, epoch } => {
                w.u32(pool.0);
                w.u32(0);
                w.u64(epoch);
            }
            Self::Allocated(r) => {
                w.u64(r.id.0);
                w.u32(r.pool.0);
                w.u32(0);
                w.u64(r.offset_bytes);
                w.u64(r.len_bytes);
                w.u64(r.owner.directory.0);
                w.u64(r.owner.instance.0);
                w.u64(r.tag.0);
            }
            Self::Freed { region } | Self::Reclaimed { region } => w.u64(region.0),
        }
        let end = w.at;
        let body_len = (end - RECORD_PREFIX_BYTES) as u32;
        debug_assert_eq!(
            end - RECORD_PREFIX_BYTES - RECORD_BODY_HEADER_BYTES,
            payload_len(self.kind()).unwrap_or(usize::MAX)
        );
        buf[0..4].copy_from_slice(&body_len.to_le_bytes());
        let crc = record_crc(&buf[0..4], &buf[RECORD_PREFIX_BYTES..end]);
        buf[4..8].copy_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&buf[..end]);
    }

    /// Decodes the record at the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Decoded, RecordFault> {
        if buf.len() < RECORD_PREFIX_BYTES {
            return Err(RecordFault::Incomplete {
                needed: RECORD_PREFIX_BYTES,
                available: buf.len(),
            });
        }
        let body_len = le_u32(&buf[0..4]);
        let stored = le_u32(&buf[4..8]);
        let body_len_usize = body_len as usize;
        if !(RECORD_BODY_HEADER_BYTES..=MAX_RECORD_BODY_BYTES).contains(&body_len_usize) {
            return Err(RecordFault::ImpossibleLength { body_len });
        }
        let total = RECORD_PREFIX_BYTES + body_len_usize;
        if buf.len() < total {
            return Err(RecordFault::Incomplete {
                needed: total,
                available: buf.len(),
            });
        }
        let body = &buf[RECORD_PREFIX_BYTES..total];
        let computed = record_crc(&buf[0..4], body);
        if computed != stored {
            return Err(RecordFault::BadChecksum { stored, computed });
        }
        let mut r = Reader { buf: body, at: 0 };
        let version = r.u8();
        let kind = r.u8();
        let reserved = u64::from(r.u16()) | u64::from(r.u32());
        let seq = r.u64();
        if version != RECORD_VERSION {
            return Err(RecordFault::UnsupportedVersion { version });
        }
        let Some(expected) = payload_len(kind) else {
            return Err(RecordFault::UnknownKind { kind });
        };
        if body_len_usize != RECORD_BODY_HEADER_BYTES + expected {
            return Err(RecordFault::WrongPayloadLength { kind, body_len });
        }
        if reserved != 0 {
            return Err(RecordFault::ReservedNonZero { seq });
        }
        let record = match kind {
            KIND_POOL_ADDED => {
                let pool = PoolId(r.u32());
                let pad = r.u32();
                let uuid = PoolUuid(r.array());
                let size_bytes = r.u64();
                let alignment_bytes = r.u64();
                if pad != 0 {
                    return Err(RecordFault::ReservedNonZero { seq });
                }
                Record::PoolAdded {
                    pool,
                    uuid,
                    size_bytes,
                    alignment_bytes,
                }
            }
            KIND_POOL_EPOCH => {
                let pool = PoolId(r.u32());
                let pad = r.u32();
                if pad != 0 {
                    return Err(RecordFault::ReservedNonZero { seq });
                }
                Record::PoolEpoch {
                    pool,
                    epoch: r.u64(),
                }
            }
            KIND_ALLOCATED => {
                let id = RegionId(r.u64());
                let pool = PoolId(r.u32());
                let pad = r.u32();
                if pad != 0 {
                    return Err(RecordFault::ReservedNonZero { seq });
                }
                Record::Allocated(RegionRecord {
                    id,
                    pool,
                    offset_bytes: r.u64(),
                    len_bytes: r.u64(),
                    owner: OwnerLabel {
                        directory: DirectoryId(r.u64()),
                        instance: InstanceId(r.u64()),
                    },
                    tag: AllocTag(r.u64()),
                })
            }
            KIND_FREED => Record::Freed {
                region: RegionId(r.u64()),
            },
            KIND_RECLAIMED => Record::Reclaimed {
                region: RegionId(r.u64()),
            },
            _ => unreachable!("payload_len accepted only the kinds matched above"),
        };
        debug_assert_eq!(r.at, body.len());
        Ok(Decoded {
            seq,
            record,
            len_bytes: total,
        })
    }
}

/// A decoded record and how many bytes it took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub seq: u64,
    pub record: Record,
    pub len_bytes: usize,
}

/// Why the bytes at some offset are not a record this build can apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordFault {
    #[error("incomplete record: {available} bytes present, {needed} needed")]
    Incomplete { needed: usize, available: usize },
    #[error("impossible record body length {body_len}")]
    ImpossibleLength { body_len: u32 },
    #[error("record checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadChecksum { stored: u32, computed: u32 },
    #[error(
        "record format version {version} is not supported (this build writes {RECORD_VERSION})"
    )]
    UnsupportedVersion { version: u8 },
    #[error("unknown record kind {kind}")]
    UnknownKind { kind: u8 },
    #[error("record kind {kind} with body length {body_len} does not match its layout")]
    WrongPayloadLength { kind: u8, body_len: u32 },
    #[error("record seq {seq} has non-zero reserved bytes")]
    ReservedNonZero { seq: u64 },
}

impl RecordFault {
    /// True for what a crash (or media damage) leaves behind: recovery may
    /// truncate here. False when the CRC matched: the bytes were written on
    /// purpose and must not be destroyed.
    pub fn is_torn_or_corrupt(&self) -> bool {
        matches!(
            self,
            Self::Incomplete { .. } | Self::ImpossibleLength { .. } | Self::BadChecksum { .. }
        )
    }
}

fn record_crc(len_field: &[u8], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(len_field), body)
}

pub(crate) fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

pub(crate) fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Little-endian writer into a fixed buffer sized by the caller (panics on
/// overflow, which would be a layout bug caught by the tests).
pub(crate) struct Writer<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) at: usize,
}

impl Writer<'_> {
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
}

/// Little-endian reader over a buffer whose length the caller has already
/// checked against the layout (panics on overrun, which would be a layout
/// bug).
pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) at: usize,
}

impl Reader<'_> {
    pub(crate) fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&self.buf[self.at..self.at + N]);
        self.at += N;
        a
    }
    pub(crate) fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Record> {
        vec![
            Record::PoolAdded {
                pool: PoolId(3),
                uuid: PoolUuid([7; 16]),
                size_bytes: 1 << 30,
                alignment_bytes: 2 << 20,
            },
            Record::PoolEpoch {
                pool: PoolId(3),
                epoch: 42,
            },
            Record::Allocated(RegionRecord {
                id: RegionId(99),
                pool: PoolId(3),
                offset_bytes: 4 << 20,
                len_bytes: 64 << 20,
                owner: OwnerLabel {
                    directory: DirectoryId(5),
                    instance: InstanceId(6),
                },
                tag: AllocTag(77),
            }),
            Record::Freed {
                region: RegionId(99),
            },
            Record::Reclaimed {
                region: RegionId(100),
            },
        ]
    }

    #[test]
    fn every_kind_round_trips() {
        for (i, rec) in samples().into_iter().enumerate() {
            let mut out = Vec::new();
            rec.encode(1000 + i as u64, &mut out);
            let d = Record::decode(&out).unwrap();
            assert_eq!(
                d,
                Decoded {
                    seq: 1000 + i as u64,
                    record: rec,
                    len_bytes: out.len()
                }
            );
        }
    }

    #[test]
    fn every_truncation_is_incomplete() {
        let mut out = Vec::new();
        samples()[2].encode(1, &mut out);
        for cut in 0..out.len() {
            let e = Record::decode(&out[..cut]).unwrap_err();
            assert!(
                matches!(e, RecordFault::Incomplete { .. }),
                "cut {cut}: {e:?}"
            );
            assert!(e.is_torn_or_corrupt());
        }
    }

    #[test]
    fn every_single_bit_flip_is_caught() {
        let mut out = Vec::new();
        samples()[2].encode(1, &mut out);
        for bit in 0..out.len() * 8 {
            let mut b = out.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            let e = Record::decode(&b).unwrap_err();
            assert!(e.is_torn_or_corrupt(), "bit {bit}: {e:?}");
        }
    }

    #[test]
    fn an_unknown_kind_with_a_valid_crc_is_refused_not_treated_as_torn() {
        let mut out = Vec::new();
        samples()[3].encode(1, &mut out);
        out[9] = 200;
        let crc = record_crc(&out[0..4], &out[8..]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        let e = Record::decode(&out).unwrap_err();
        assert_eq!(e, RecordFault::UnknownKind { kind: 200 });
        assert!(!e.is_torn_or_corrupt());
    }

    #[test]
    fn a_zero_filled_tail_is_not_a_record() {
        let e = Record::decode(&[0u8; 64]).unwrap_err();
        assert!(e.is_torn_or_corrupt(), "{e:?}");
    }
}
