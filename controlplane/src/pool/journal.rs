//! The write-ahead journal: every ledger mutation, appended and made durable
//! before its reply leaves.
//!
//! File layout (format 2): a 4096-byte header block holding two copies
//! ("slots") of the file header, at offsets 0 and 512 — each in a sector of
//! its own, and none in a sector or page that holds records — then records
//! back to back from offset 4096 (record layout in [`super::record`]).
//!
//! ```text
//! slot (at 0 and at 512)
//! offset size field
//!  0      8   magic "CXLKVJNL"
//!  8      4   format version (2)
//! 12      8   acknowledged seq: every record up to it was committed
//! 20      8   reserved 0
//! 28      4   CRC32C of [0, 28)
//! ```
//!
//! The acknowledged seq is written by every commit that raises it, with the
//! last seq of the commits before it: those were synced, so their replies
//! may have left. Commits write the two slots in turn, so a slot write torn
//! by a power loss damages that slot only (its checksum fails) and the
//! other still holds the claim of an earlier commit; recovery takes the
//! highest claim of the slots whose checksum holds. No slot write can
//! damage a record: a device that does not write a sector atomically tears
//! only the sector written.
//!
//! A commit's records' write can, though. It starts at the end of the
//! commit before, usually inside the sector — and the page, which
//! write-back rewrites whole — that holds that commit's last records,
//! acknowledged; a power loss during its sync can tear that sector. So the
//! claim is written and synced *before* the records, in a sync of its own:
//! were it in theirs, it could be lost while the tear landed (one sync does
//! not order its pages), and recovery would find the damage above the
//! older claim, take it for the torn tail of the last commit and cut an
//! acknowledged one, its byte ranges handed out again. With the claim
//! durable first, damage any commit's write does to the records before it
//! is at or below the claim, and recovery refuses. A commit is thus two
//! syncs, one when the claim already covers every committed record (the
//! first commit after recovery, which wrote that claim). The claim's sync
//! is not skipped when the records start on a 4096-byte boundary: that
//! would save it for about one commit in 512, and whether such a write
//! shares no page with acknowledged bytes depends on the kernel's page and
//! the file system's block size, which the journal does not know.
//!
//! Format 1 (before December 2026) had one slot at offset 0 and records
//! from offset 32, so every header write rewrote the sector of the first
//! records too, and a torn one left no claim at all. Recovery reads it and
//! writes the journal again in format 2 (under a temporary name, synced,
//! renamed over it).
//!
//! Appending. [`Journal::push`] (the [`RecordSink`] the state machine
//! writes into) encodes a record into an in-memory pending buffer with the
//! next sequence number — no I/O, no allocation once the buffer has grown to
//! its working size. [`Journal::commit`] writes the whole pending buffer
//! with one positioned write at the end of the committed data and one
//! `fdatasync` (after the claim's write and sync, above). Calling it after
//! every request gives per-record durability;
//! calling it once for the records of several requests is group commit (one
//! commit, then all their replies released). Only after `commit` returns are
//! the records *committed*. A failed write or sync poisons the journal: every
//! later commit fails, and the driver must stop (after a failed `fsync` the
//! kernel may have dropped the dirty pages, so retrying proves nothing).
//!
//! Recovery (`Journal::recover`, run by the store). The journal is read whole and scanned from the
//! header — at most [`MAX_JOURNAL_BYTES`] of it, a regular file only,
//! opened without blocking (`read_bounded`: a FIFO or device there, or a
//! file growing while read, is refused rather than read for ever).
//! The limit is the largest journal any valid configuration writes
//! (`MAX_CHECKPOINT_EVERY_RECORDS` is derived from it), not one derived
//! from the configuration of this start: a journal written under a larger
//! `checkpoint_every_records` must still be read after the setting is
//! lowered. Records are then decoded in place (a record's length field is
//! checked against `MAX_RECORD_BYTES` before it is used; nothing is
//! allocated from it): records whose sequence number is ≤ the checkpoint's are already in
//! the checkpoint and skipped (the crash window between installing a
//! checkpoint and restarting the journal); the following ones must continue
//! the sequence exactly and are applied to the ledger. The scan stops at the
//! first torn or corrupt record (incomplete, impossible length, CRC
//! mismatch): the bytes from there to the end are copied to
//! `journal.dropped.<offset>` for inspection, logged, and cut off, so that new
//! records follow the last good one; the records kept are written again and
//! synced (they may have reached only the page cache), and only then, in a
//! second sync, does a header slot claim them (one sync does not order its
//! pages: a claim on disk without its records would refuse the next start).
//! That is a torn tail only if the records lost were never acknowledged: if
//! the good records end before the header's acknowledged seq, the damage is in records whose replies may have left
//! (a bit flipped at rest, a lost write), and cutting there would hand their
//! byte ranges out again — recovery refuses instead. Only damage inside the
//! last commit is taken for a torn tail: a power loss mid-commit may persist
//! any part of it, and nothing tells a record of the last commit that was
//! lost to a crash from one that rotted later. Anything else refuses to
//! start and changes nothing: a CRC-valid record this build does not
//! understand, a gap in the sequence, a record that does not apply to the
//! ledger, a bad file header.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::io_faults::{IoFaults, IoSite};
use super::ledger::LedgerError;
use super::manager::RecordSink;
use super::record::{MAX_RECORD_BYTES, Record, RecordFault, le_u32};
use super::sys::fsync_dir;

/// Name of the journal inside a state directory.
pub const JOURNAL_FILE: &str = "journal";
const JOURNAL_TMP_FILE: &str = "journal.tmp";
/// Prefix of the files that keep a dropped journal tail.
pub const DROPPED_PREFIX: &str = "journal.dropped.";
/// `b"CXLKVJNL"`.
pub const JOURNAL_MAGIC: [u8; 8] = *b"CXLKVJNL";
/// The format this build writes (module essay); it also reads format 1.
pub const JOURNAL_FORMAT_VERSION: u32 = 2;
/// The header block: where records start.
pub const JOURNAL_HEADER_BYTES: usize = 4096;
/// One copy of the file header.
pub const JOURNAL_SLOT_BYTES: usize = 32;
/// Where the two slots sit: in different sectors, before any record.
pub const JOURNAL_SLOT_OFFSETS: [usize; 2] = [0, 512];
/// Format 1's header: one slot, records right after it.
const V1_HEADER_BYTES: usize = JOURNAL_SLOT_BYTES;
/// Largest journal recovery reads (checkpoints keep it far smaller).
pub const MAX_JOURNAL_BYTES: u64 = 1 << 30;
/// Pending-buffer capacity reserved up front: a group of this many records
/// commits without growing it.
const PENDING_RESERVE_RECORDS: usize = 1024;
/// Most `journal.dropped.<offset>.<n>` names tried before giving up.
const MAX_DROPPED_NAMES: usize = 100;

/// What went wrong with the journal file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "journal {} failed an earlier write or sync; the pool manager must restart to recover",
        path.display()
    )]
    Poisoned { path: PathBuf },
    #[error("journal {} has a bad file header ({reason})", path.display())]
    BadHeader { path: PathBuf, reason: &'static str },
    #[error(
        "journal {} holds more than the {max_bytes} bytes recovery reads ({len_bytes} bytes seen; nothing past offset {max_bytes} is read); refusing to start",
        path.display()
    )]
    TooLarge {
        path: PathBuf,
        /// The size `stat` gave, or the bytes read before the limit stopped
        /// the read (the file grew after the `stat`).
        len_bytes: u64,
        max_bytes: u64,
    },
    #[error(
        "journal {} is a {file_type}, not a regular file (a device or FIFO there would be read forever, or block the start); refusing to start",
        path.display()
    )]
    NotRegularFile {
        path: PathBuf,
        file_type: &'static str,
    },
    #[error(
        "journal {} holds a record at offset {offset_bytes} that this build cannot apply ({fault}); refusing to start rather than truncate it",
        path.display()
    )]
    NotUnderstood {
        path: PathBuf,
        offset_bytes: u64,
        fault: RecordFault,
    },
    #[error(
        "journal {}: record at offset {offset_bytes} has seq {found}, expected {expected}: records are missing (a journal or checkpoint from another time?); refusing to start",
        path.display()
    )]
    SequenceGap {
        path: PathBuf,
        offset_bytes: u64,
        expected: u64,
        found: u64,
    },
    #[error(
        "journal {}: record seq {seq} at offset {offset_bytes} does not apply to the state ({source}); refusing to start",
        path.display()
    )]
    Inconsistent {
        path: PathBuf,
        offset_bytes: u64,
        seq: u64,
        source: LedgerError,
    },
    #[error(
        "journal {}: its header says records up to seq {acknowledged_seq} were committed, but the readable ones end at seq {last_seq} (offset {offset_bytes}): a committed record is damaged or missing, and cutting there would hand its byte ranges out again; refusing to start (the files are unchanged: restore the journal from a copy, or inspect it at that offset)",
        path.display()
    )]
    AcknowledgedLost {
        path: PathBuf,
        offset_bytes: u64,
        acknowledged_seq: u64,
        last_seq: u64,
    },
    #[error(
        "journal {} is missing but a checkpoint exists: committed records may be lost; refusing to start (restore the journal; an empty one accepts the checkpoint's state, and pools opened since are then refused as stale)",
        path.display()
    )]
    Missing { path: PathBuf },
    #[error(
        "cannot {op} {}: the file system holding it is full ({source}); the pool manager writes this before it serves anything (a commit, or recovery making the records it keeps durable), so it stops or refuses to start. Free space on that file system (the pools and their regions are untouched) and start it again",
        path.display()
    )]
    NoSpace {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// True for the errnos of a full file system (`ENOSPC`) or an exhausted
/// quota (`EDQUOT`).
pub fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

io_errors!(JournalError);

/// The header block every journal starts with (the in-memory journals of
/// the deterministic simulation and the fuzzers build images with it),
/// claiming no acknowledged record.
pub fn file_header() -> [u8; JOURNAL_HEADER_BYTES] {
    file_header_acknowledging(0)
}

/// The header block whose two slots say that every record up to
/// `acknowledged_seq` was committed (see the module essay).
pub fn file_header_acknowledging(acknowledged_seq: u64) -> [u8; JOURNAL_HEADER_BYTES] {
    let mut h = [0u8; JOURNAL_HEADER_BYTES];
    let slot = header_slot(JOURNAL_FORMAT_VERSION, acknowledged_seq);
    for at in JOURNAL_SLOT_OFFSETS {
        h[at..at + JOURNAL_SLOT_BYTES].copy_from_slice(&slot);
    }
    h
}

/// One slot of the file header (module essay) in format `version`.
pub fn header_slot(version: u32, acknowledged_seq: u64) -> [u8; JOURNAL_SLOT_BYTES] {
    let mut h = [0u8; JOURNAL_SLOT_BYTES];
    h[0..8].copy_from_slice(&JOURNAL_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..20].copy_from_slice(&acknowledged_seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// What a journal's file header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileHeader {
    version: u32,
    /// Where records start.
    records_start: usize,
    /// The highest claim of the slots whose checksum holds; `None` when no
    /// slot's does.
    acknowledged: Option<u64>,
    /// The slot the next claim is written to: the one not holding the
    /// highest claim.
    next_slot: usize,
}

/// The claim of one slot of format `version`: `None` unless its magic,
/// version and checksum all hold.
fn slot_claim(slot: &[u8], version: u32) -> Option<u64> {
    let ok = slot[0..8] == JOURNAL_MAGIC
        && le_u32(&slot[8..12]) == version
        && le_u32(&slot[28..32]) == crc32c::crc32c(&slot[..28]);
    ok.then(|| u64::from_le_bytes(slot[12..20].try_into().expect("8 bytes")))
}

/// Checks a journal's file header. Every commit rewrites a slot, so a power
/// loss on a device that does not write a sector atomically can tear it:
/// the journal is still ours while a slot shows our magic and a version we
/// read, and recovery goes on with the claim of the slot left whole — or,
/// if none is (format 1 has one slot), without a claim (the records are
/// checked by their own CRCs) — and writes a good slot again.
///
/// The format decides where records start, so it is never taken from a
/// damaged field alone: a slot whole in format 2 makes the file format 2,
/// a whole format-1 slot format 1; with no slot whole, format 2 needs slot
/// 1 to show our magic too (a format-1 file holds records there) — slot 0
/// claiming format 2 without it is refused, since a format-1 file whose
/// version was damaged looks the same and reading it from offset 4096
/// would cut its records. The converse double fault — a format-2 file whose
/// slot 0 reads version 1 and whose slot 1 no longer shows format 2 — is
/// told apart by where a whole record starts: a torn format-1 slot is read
/// as format 1 unless no record starts at offset 32 and one does at 4096,
/// which is refused (read from offset 32, the file would look empty and
/// recovery would drop every record after the checkpoint).
fn check_file_header(b: &[u8]) -> Result<FileHeader, &'static str> {
    if b.len() < V1_HEADER_BYTES {
        return Err("shorter than the file header");
    }
    let ours = |s: &[u8]| s[0..8] == JOURNAL_MAGIC;
    let version = |s: &[u8]| le_u32(&s[8..12]);
    let slots: Vec<&[u8]> = JOURNAL_SLOT_OFFSETS
        .iter()
        .filter_map(|&at| b.get(at..at + JOURNAL_SLOT_BYTES))
        .collect();
    let claims: Vec<Option<u64>> = slots
        .iter()
        .map(|s| slot_claim(s, JOURNAL_FORMAT_VERSION))
        .collect();
    let first = slots[0];
    if claims.iter().all(Option::is_none) {
        let v1 = slot_claim(first, 1);
        let second_says_v2 = slots
            .get(1)
            .is_some_and(|s| ours(s) && version(s) == JOURNAL_FORMAT_VERSION);
        if v1.is_some() || (ours(first) && version(first) == 1 && !second_says_v2) {
            let starts_record = |at: usize| b.get(at..).is_some_and(|r| Record::decode(r).is_ok());
            if v1.is_none()
                && !starts_record(V1_HEADER_BYTES)
                && starts_record(JOURNAL_HEADER_BYTES)
            {
                return Err(
                    "damaged: no slot passes its checksum; slot 0 reads format 1, but records start where format 2 puts them",
                );
            }
            return Ok(FileHeader {
                version: 1,
                records_start: V1_HEADER_BYTES,
                acknowledged: v1,
                next_slot: 0,
            });
        }
        if !slots.iter().any(|s| ours(s)) {
            return Err("wrong magic");
        }
        if !slots
            .iter()
            .any(|s| ours(s) && version(s) == JOURNAL_FORMAT_VERSION)
        {
            return Err("unsupported format version");
        }
        if !slots.get(1).is_some_and(|s| ours(s)) {
            return Err(
                "damaged: no slot passes its checksum, and slot 1 does not tell format 2 from a format-1 file with a damaged version",
            );
        }
    }
    if b.len() < JOURNAL_HEADER_BYTES {
        return Err("shorter than the file header");
    }
    let acknowledged = claims.iter().flatten().copied().max();
    let newest = claims
        .iter()
        .position(|&c| c.is_some() && c == acknowledged)
        .unwrap_or(1);
    Ok(FileHeader {
        version: JOURNAL_FORMAT_VERSION,
        records_start: JOURNAL_HEADER_BYTES,
        acknowledged,
        next_slot: 1 - newest,
    })
}

/// Where and why a scan stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    pub offset_bytes: u64,
    pub dropped_bytes: u64,
    pub fault: RecordFault,
}

/// The outcome of scanning a journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanReport {
    pub checkpoint_seq: u64,
    /// Records applied to the ledger.
    pub replayed: u64,
    /// Records already covered by the checkpoint.
    pub skipped: u64,
    /// End of the last good record.
    pub valid_end_bytes: u64,
    /// Sequence number the next record gets.
    pub next_seq: u64,
    pub stop: Option<Stop>,
    /// No slot of the file header passed its checksum (magic and version
    /// intact): no acknowledged seq was used (see `check_file_header`).
    pub header_checksum_mismatch: bool,
    /// The newest claim a whole header slot holds: records up to this seq
    /// were acknowledged, so a scan whose good records end before it
    /// refuses ([`ScanError::AcknowledgedLost`]). `None` with
    /// `header_checksum_mismatch`.
    pub acknowledged_seq: Option<u64>,
    /// The file's format (1 is written again as the current one by
    /// recovery).
    pub format_version: u32,
    /// Where the records start (the end of the file header).
    pub records_start_bytes: u64,
    /// The header slot the next claim goes to (format 2).
    pub next_header_slot: usize,
}

/// Why a scan refused (mapped to [`JournalError`] with the path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanError {
    BadHeader(&'static str),
    NotUnderstood {
        offset_bytes: u64,
        fault: RecordFault,
    },
    SequenceGap {
        offset_bytes: u64,
        expected: u64,
        found: u64,
    },
    Inconsistent {
        offset_bytes: u64,
        seq: u64,
        source: LedgerError,
    },
    /// The good records end at `last_seq` (at `offset_bytes`), before the
    /// header's `acknowledged_seq`.
    AcknowledgedLost {
        offset_bytes: u64,
        acknowledged_seq: u64,
        last_seq: u64,
    },
}

/// Scans a whole journal file image (sans-IO): see the module essay.
/// `apply` is called for every record after the checkpoint, in order.
pub fn scan(
    file: &[u8],
    checkpoint_seq: u64,
    mut apply: impl FnMut(&Record) -> Result<(), LedgerError>,
) -> Result<ScanReport, ScanError> {
    let header = check_file_header(file).map_err(ScanError::BadHeader)?;
    let acknowledged = header.acknowledged;
    let mut at = header.records_start;
    let mut prev_seq: Option<u64> = None;
    let mut report = ScanReport {
        checkpoint_seq,
        replayed: 0,
        skipped: 0,
        valid_end_bytes: at as u64,
        next_seq: checkpoint_seq + 1,
        stop: None,
        header_checksum_mismatch: acknowledged.is_none(),
        acknowledged_seq: acknowledged,
        format_version: header.version,
        records_start_bytes: at as u64,
        next_header_slot: header.next_slot,
    };
    while at < file.len() {
        let d = match Record::decode(&file[at..]) {
            Ok(d) => d,
            Err(fault) if fault.is_torn_or_corrupt() => {
                report.stop = Some(Stop {
                    offset_bytes: at as u64,
                    dropped_bytes: (file.len() - at) as u64,
                    fault,
                });
                break;
            }
            Err(fault) => {
                return Err(ScanError::NotUnderstood {
                    offset_bytes: at as u64,
                    fault,
                });
            }
        };
        // Sequence numbers are consecutive across the whole file; the first
        // record may be older than the checkpoint (skipped) but never newer
        // than the one right after it.
        let expected = prev_seq.map_or(d.seq.min(checkpoint_seq + 1), |p| p + 1);
        if d.seq != expected || (prev_seq.is_none() && d.seq == 0) {
            return Err(ScanError::SequenceGap {
                offset_bytes: at as u64,
                expected: prev_seq.map_or(checkpoint_seq + 1, |p| p + 1),
                found: d.seq,
            });
        }
        if d.seq <= checkpoint_seq {
            report.skipped += 1;
        } else {
            apply(&d.record).map_err(|source| ScanError::Inconsistent {
                offset_bytes: at as u64,
                seq: d.seq,
                source,
            })?;
            report.replayed += 1;
        }
        prev_seq = Some(d.seq);
        at += d.len_bytes;
        report.valid_end_bytes = at as u64;
        report.next_seq = d.seq.max(checkpoint_seq) + 1;
    }
    // Records the checkpoint holds count as present.
    let last_seq = prev_seq.unwrap_or(0).max(checkpoint_seq);
    let acknowledged = acknowledged.unwrap_or(0);
    if acknowledged > last_seq {
        return Err(ScanError::AcknowledgedLost {
            offset_bytes: report.valid_end_bytes,
            acknowledged_seq: acknowledged,
            last_seq,
        });
    }
    Ok(report)
}

/// A committed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitReport {
    /// Records made durable by this commit (0: nothing was pending).
    pub records: usize,
    pub bytes: usize,
    /// Sequence number of the last committed record.
    pub committed_seq: u64,
}

/// An open journal, positioned after its last good record.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
    /// End of the committed records (where the next commit writes).
    end_bytes: u64,
    /// Sequence number of the next pushed record.
    next_seq: u64,
    pending: Vec<u8>,
    pending_records: usize,
    records_since_checkpoint: u64,
    /// The acknowledged seq the file header holds (its newest slot).
    header_acknowledged_seq: u64,
    /// The slot the next claim is written to (the slots take turns).
    next_header_slot: usize,
    poisoned: bool,
    faults: IoFaults,
}

impl Journal {
    /// Recovers the journal of `dir` (see the module essay), creating an
    /// empty one if there is none and no checkpoint either.
    pub(crate) fn recover(
        dir: &Path,
        checkpoint_seq: u64,
        checkpoint_exists: bool,
        faults: &IoFaults,
        apply: impl FnMut(&Record) -> Result<(), LedgerError>,
    ) -> Result<(Self, ScanReport, Option<PathBuf>), JournalError> {
        let path = dir.join(JOURNAL_FILE);
        if !path.try_exists().map_err(io_err("stat", &path))? {
            if checkpoint_exists {
                return Err(JournalError::Missing { path });
            }
            create_empty(dir)?;
        }
        let image = read_bounded(&path, MAX_JOURNAL_BYTES).map_err(|e| match e {
            BoundedReadError::Io { op, source } => JournalError::io(op, &path, source),
            BoundedReadError::NotRegularFile { file_type } => JournalError::NotRegularFile {
                path: path.clone(),
                file_type,
            },
            BoundedReadError::TooLarge {
                len_bytes,
                max_bytes,
            } => JournalError::TooLarge {
                path: path.clone(),
                len_bytes,
                max_bytes,
            },
        })?;
        let len_bytes = image.len() as u64;
        let report = scan(&image, checkpoint_seq, apply).map_err(|e| match e {
            ScanError::BadHeader(reason) => JournalError::BadHeader {
                path: path.clone(),
                reason,
            },
            ScanError::NotUnderstood {
                offset_bytes,
                fault,
            } => JournalError::NotUnderstood {
                path: path.clone(),
                offset_bytes,
                fault,
            },
            ScanError::SequenceGap {
                offset_bytes,
                expected,
                found,
            } => JournalError::SequenceGap {
                path: path.clone(),
                offset_bytes,
                expected,
                found,
            },
            ScanError::Inconsistent {
                offset_bytes,
                seq,
                source,
            } => JournalError::Inconsistent {
                path: path.clone(),
                offset_bytes,
                seq,
                source,
            },
            ScanError::AcknowledgedLost {
                offset_bytes,
                acknowledged_seq,
                last_seq,
            } => JournalError::AcknowledgedLost {
                path: path.clone(),
                offset_bytes,
                acknowledged_seq,
                last_seq,
            },
        })?;
        let mut saved = None;
        let records_start = report.records_start_bytes;
        let mut end_bytes = report.valid_end_bytes;
        if let Some(stop) = report.stop {
            let tail = &image[stop.offset_bytes as usize..];
            saved = save_dropped(dir, stop.offset_bytes, tail, faults)?;
            tracing::warn!(
                journal = %path.display(),
                offset_bytes = stop.offset_bytes,
                dropped_bytes = stop.dropped_bytes,
                fault = %stop.fault,
                saved_to = %saved.as_deref().map_or("nowhere (see above)".into(), |p| p.display().to_string()),
                "journal ends with a torn or corrupt record; dropping it and everything after it"
            );
        }
        if report.skipped > 0 && report.replayed == 0 {
            // A crash after installing a checkpoint and before restarting the
            // journal: every record is in the checkpoint.
            end_bytes = records_start;
        }
        if report.header_checksum_mismatch {
            tracing::warn!(
                journal = %path.display(),
                "no slot of the journal's file header passes its checksum (a write torn by a power loss?); recovering without an acknowledged seq and writing it again"
            );
        }
        // The records kept may exist only in the page cache (a process
        // killed before its sync; a sync that failed with the pages then
        // marked clean, and a restart in the same boot): written again and
        // synced before anything is answered on their strength — and before
        // a header claims them, since one sync does not order the pages it
        // writes (a header on disk claiming records that are not would
        // refuse the next start).
        let kept = &image[records_start as usize..end_bytes as usize];
        let acknowledged = report.next_seq - 1;
        let (file, next_slot) = if report.format_version == JOURNAL_FORMAT_VERSION {
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(io_err("open", &path))?;
            write_step(WriteStep::Records);
            faults
                .write_all_at(IoSite::RecoveryRewrite, &file, kept, records_start)
                .map_err(io_err("rewrite the records kept in", &path))?;
            if end_bytes != len_bytes {
                write_step(WriteStep::Truncate);
                file.set_len(end_bytes).map_err(io_err("truncate", &path))?;
            }
            write_step(WriteStep::Sync);
            file.sync_all().map_err(io_err("fsync", &path))?;
            let slot = report.next_header_slot;
            write_step(WriteStep::Header);
            file.write_all_at(
                &header_slot(JOURNAL_FORMAT_VERSION, acknowledged),
                JOURNAL_SLOT_OFFSETS[slot] as u64,
            )
            .map_err(io_err("rewrite the header of", &path))?;
            write_step(WriteStep::Sync);
            file.sync_data().map_err(io_err("fsync", &path))?;
            (file, 1 - slot)
        } else {
            // Format 1: written again whole in the current format, under a
            // temporary name and renamed over it — a crash leaves the old
            // file or the new one, each complete.
            tracing::info!(
                journal = %path.display(),
                from = report.format_version,
                to = JOURNAL_FORMAT_VERSION,
                "writing the journal again in the current format"
            );
            let mut whole = Vec::with_capacity(JOURNAL_HEADER_BYTES + kept.len());
            whole.extend_from_slice(&file_header_acknowledging(acknowledged));
            whole.extend_from_slice(kept);
            write_step(WriteStep::Records);
            replace_atomically(dir, &whole)?;
            end_bytes = whole.len() as u64;
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(io_err("open", &path))?;
            (file, 0)
        };
        let journal = Self {
            file,
            path,
            end_bytes,
            next_seq: report.next_seq,
            pending: Vec::with_capacity(PENDING_RESERVE_RECORDS * MAX_RECORD_BYTES),
            pending_records: 0,
            records_since_checkpoint: report.replayed,
            header_acknowledged_seq: acknowledged,
            next_header_slot: next_slot,
            poisoned: false,
            faults: faults.clone(),
        };
        Ok((journal, report, saved))
    }

    /// Encodes `record` into the pending buffer and returns its sequence
    /// number. Not durable until [`Journal::commit`]. The buffer is bounded
    /// by the driver: it commits when `PoolStore::commit_due` says so (at most
    /// `MAX_GROUP_RECORDS` requests), and one request pushes at most
    /// `MAX_REAP_PER_TICK` records.
    pub fn push_record(&mut self, record: &Record) -> u64 {
        let seq = self.next_seq;
        record.encode(seq, &mut self.pending);
        self.next_seq += 1;
        self.pending_records += 1;
        seq
    }

    /// Writes and syncs every pending record (one `pwrite`, one
    /// `fdatasync`), after writing and syncing the header's claim on the
    /// commits before when it advances. See the module essay for why that
    /// order, and for the failure rule.
    pub fn commit(&mut self) -> Result<CommitReport, JournalError> {
        if self.poisoned {
            return Err(JournalError::Poisoned {
                path: self.path.clone(),
            });
        }
        let report = CommitReport {
            records: self.pending_records,
            bytes: self.pending.len(),
            committed_seq: self.next_seq - 1,
        };
        if self.pending_records == 0 {
            return Ok(report);
        }
        // Every record before this commit was synced by an earlier one: say
        // so in the header, durably, before the records' write — which
        // rewrites the sector holding the last of them — can tear it
        // (module essay).
        let acknowledged = self.committed_seq();
        if acknowledged != self.header_acknowledged_seq {
            let slot = header_slot(JOURNAL_FORMAT_VERSION, acknowledged);
            let slot_at = JOURNAL_SLOT_OFFSETS[self.next_header_slot] as u64;
            write_step(WriteStep::Header);
            let claimed = self
                .faults
                .write_all_at(IoSite::JournalHeader, &self.file, &slot, slot_at)
                .and_then(|()| {
                    write_step(WriteStep::Sync);
                    self.faults
                        .op(IoSite::JournalHeaderSync, || self.file.sync_data())
                });
            self.fail_stop("write the header of", claimed)?;
            self.header_acknowledged_seq = acknowledged;
            self.next_header_slot = 1 - self.next_header_slot;
        }
        write_step(WriteStep::Records);
        let written = self
            .faults
            .write_all_at(
                IoSite::JournalRecords,
                &self.file,
                &self.pending,
                self.end_bytes,
            )
            .and_then(|()| {
                write_step(WriteStep::Sync);
                self.faults
                    .op(IoSite::JournalSync, || self.file.sync_data())
            });
        self.fail_stop("append to", written)?;
        self.end_bytes += self.pending.len() as u64;
        self.records_since_checkpoint += self.pending_records as u64;
        self.pending.clear();
        self.pending_records = 0;
        Ok(report)
    }

    /// Poisons the journal if `done` failed (fail-stop: module essay).
    fn fail_stop(&mut self, op: &'static str, done: io::Result<()>) -> Result<(), JournalError> {
        done.map_err(|source| {
            self.poisoned = true;
            JournalError::io(op, &self.path, source)
        })
    }

    /// Records pushed and not yet committed.
    pub fn pending_records(&self) -> usize {
        self.pending_records
    }

    /// Sequence number of the last committed record (the checkpoint's when
    /// none was written since).
    pub fn committed_seq(&self) -> u64 {
        self.next_seq - 1 - self.pending_records as u64
    }

    /// Committed records since the journal was last restarted.
    pub fn records_since_checkpoint(&self) -> u64 {
        self.records_since_checkpoint
    }

    /// Bytes of committed data (file header included).
    pub fn len_bytes(&self) -> u64 {
        self.end_bytes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Empties the journal after a checkpoint that covers every committed
    /// record (the caller checks that). Keeps the sequence numbers going.
    pub(crate) fn restart(&mut self) -> Result<(), JournalError> {
        if self.poisoned {
            return Err(JournalError::Poisoned {
                path: self.path.clone(),
            });
        }
        debug_assert_eq!(self.pending_records, 0);
        let done = self.faults.op(IoSite::JournalRestart, || {
            self.file
                .set_len(JOURNAL_HEADER_BYTES as u64)
                .and_then(|()| self.file.sync_all())
        });
        if let Err(source) = done {
            self.poisoned = true;
            return Err(JournalError::io("restart", &self.path, source));
        }
        self.end_bytes = JOURNAL_HEADER_BYTES as u64;
        self.records_since_checkpoint = 0;
        Ok(())
    }

    pub(crate) fn poison(&mut self) {
        self.poisoned = true;
    }

    /// Storage failures to inject (feature `fault-injection`).
    pub(crate) fn set_io_faults(&mut self, faults: IoFaults) {
        self.faults = faults;
    }
}

impl RecordSink for Journal {
    fn push(&mut self, record: &Record) {
        self.push_record(record);
    }
}

/// Why [`read_bounded`] read nothing.
#[derive(Debug)]
pub(crate) enum BoundedReadError {
    Io {
        op: &'static str,
        source: io::Error,
    },
    NotRegularFile {
        file_type: &'static str,
    },
    /// `len_bytes`: what `fstat` gave, or the bytes read before the limit
    /// stopped the read.
    TooLarge {
        len_bytes: u64,
        max_bytes: u64,
    },
}

/// Reads the state file at `path` whole, at most `max_bytes` of it — the
/// journal, the checkpoint and the names file are read this way at start.
/// The file is opened without blocking (`O_NONBLOCK`: opening a FIFO for
/// reading would wait for a writer for ever) and must be a regular file by
/// `fstat` of the open descriptor (a device reads forever: `/dev/zero`
/// behind a symlink would grow the buffer until the process dies). Its
/// size is checked before anything is read, and the read itself stops one
/// byte past `max_bytes` whatever that size said (a file growing after the
/// `fstat`), so no more than `max_bytes + 1` bytes are ever held.
pub(crate) fn read_bounded(path: &Path, max_bytes: u64) -> Result<Vec<u8>, BoundedReadError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |op| move |source| BoundedReadError::Io { op, source };
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(io("open"))?;
    let meta = f.metadata().map_err(io("stat"))?;
    let t = meta.file_type();
    if !t.is_file() {
        let file_type = if t.is_fifo() {
            "FIFO"
        } else if t.is_char_device() {
            "character device"
        } else if t.is_block_device() {
            "block device"
        } else if t.is_socket() {
            "socket"
        } else if t.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(BoundedReadError::NotRegularFile { file_type });
    }
    if meta.len() > max_bytes {
        return Err(BoundedReadError::TooLarge {
            len_bytes: meta.len(),
            max_bytes,
        });
    }
    read_at_most(f, meta.len(), max_bytes)
}

/// Reads `from` to its end, `len_hint` bytes reserved, refusing once more
/// than `max_bytes` were read (the part of [`read_bounded`] that does not
/// trust the size it was told).
fn read_at_most(
    from: impl io::Read,
    len_hint: u64,
    max_bytes: u64,
) -> Result<Vec<u8>, BoundedReadError> {
    let mut image = Vec::with_capacity(len_hint.min(max_bytes) as usize);
    io::Read::read_to_end(
        &mut io::Read::take(from, max_bytes.saturating_add(1)),
        &mut image,
    )
    .map_err(|source| BoundedReadError::Io { op: "read", source })?;
    if image.len() as u64 > max_bytes {
        return Err(BoundedReadError::TooLarge {
            len_bytes: image.len() as u64,
            max_bytes,
        });
    }
    Ok(image)
}

/// Creates an empty journal atomically (see [`replace_atomically`]).
fn create_empty(dir: &Path) -> Result<(), JournalError> {
    replace_atomically(dir, &file_header())
}

/// Makes `contents` the journal of `dir` atomically: written and synced
/// under a temporary name, renamed, directory synced. A crash leaves the
/// journal that was there (or none) or the new one, complete.
fn replace_atomically(dir: &Path, contents: &[u8]) -> Result<(), JournalError> {
    let tmp = dir.join(JOURNAL_TMP_FILE);
    let path = dir.join(JOURNAL_FILE);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    f.write_all(contents).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err("rename", &tmp))?;
    fsync_dir(dir).map_err(io_err("fsync", dir))
}

/// The writes and syncs of a recovery's rewrite or a commit, in the order
/// they ran on this thread (tests only: the order is what keeps a header
/// from claiming records that are not on disk, and a commit's write from
/// tearing records no durable claim covers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteStep {
    Records,
    Truncate,
    Sync,
    Header,
}

#[cfg(test)]
thread_local! {
    static WRITE_STEPS: std::cell::RefCell<Vec<WriteStep>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn write_step(_step: WriteStep) {
    #[cfg(test)]
    WRITE_STEPS.with(|s| s.borrow_mut().push(_step));
}

/// Keeps a dropped tail next to the journal, under a name no other file
/// has; `None` when every name for its offset is taken, or when the file
/// system is full. Those tails are an operator's to look at, never read
/// again: a manager crashing in a loop at the same offset must not end up
/// refusing to start because the names ran out (the tail itself was never
/// acknowledged), so the tail is then only logged as dropped — and neither
/// must a full disk, which is what usually tears the tail in the first
/// place (a commit's write cut short by `ENOSPC`): the copy is removed and
/// the start goes on (reliability entry 106). Any other failure refuses.
fn save_dropped(
    dir: &Path,
    offset_bytes: u64,
    tail: &[u8],
    faults: &IoFaults,
) -> Result<Option<PathBuf>, JournalError> {
    for n in 0..MAX_DROPPED_NAMES {
        let path = dir.join(format!("{DROPPED_PREFIX}{offset_bytes}.{n}"));
        let f = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) if is_out_of_space(&e) => return Ok(tail_not_kept(dir, &path, offset_bytes, e)),
            Err(e) => return Err(io_err("create", &path)(e)),
        };
        let kept = faults
            .write_all_at(IoSite::RecoveryDroppedTail, &f, tail, 0)
            .and_then(|()| f.sync_all());
        match kept {
            Ok(()) => {}
            Err(e) if is_out_of_space(&e) => {
                drop(f);
                // The part written is no use and takes the space the
                // start needs: removed (its removal need not be durable).
                if let Err(removed) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), error = %removed, "cannot remove a partial copy of a dropped tail");
                }
                return Ok(tail_not_kept(dir, &path, offset_bytes, e));
            }
            Err(e) => return Err(io_err("write", &path)(e)),
        }
        fsync_dir(dir).map_err(io_err("fsync", dir))?;
        return Ok(Some(path));
    }
    tracing::warn!(
        dir = %dir.display(),
        offset_bytes,
        kept = MAX_DROPPED_NAMES,
        "the dropped tail is not kept: {MAX_DROPPED_NAMES} tails cut at this offset are kept already (remove {DROPPED_PREFIX}{offset_bytes}.* once inspected)"
    );
    Ok(None)
}

/// Logs that the dropped tail at `offset_bytes` could not be kept at
/// `path` because the file system is full.
fn tail_not_kept(dir: &Path, path: &Path, offset_bytes: u64, e: io::Error) -> Option<PathBuf> {
    tracing::warn!(
        dir = %dir.display(),
        path = %path.display(),
        offset_bytes,
        error = %e,
        "the dropped tail is not kept: the file system is full (it was never acknowledged; recovery goes on without the copy)"
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::types::RegionId;

    fn image(seqs: &[u64]) -> Vec<u8> {
        let mut v = file_header().to_vec();
        for &s in seqs {
            Record::Freed {
                region: RegionId(s),
            }
            .encode(s, &mut v);
        }
        v
    }

    fn applied(img: &[u8], ckpt: u64) -> Result<(ScanReport, Vec<Record>), ScanError> {
        let mut got = Vec::new();
        let r = scan(img, ckpt, |rec| {
            got.push(*rec);
            Ok(())
        })?;
        Ok((r, got))
    }

    #[test]
    fn records_covered_by_the_checkpoint_are_skipped_and_the_rest_applied() {
        let (r, got) = applied(&image(&[5, 6, 7, 8]), 6).unwrap();
        assert_eq!((r.skipped, r.replayed, r.next_seq), (2, 2, 9));
        assert_eq!(
            got,
            vec![
                Record::Freed {
                    region: RegionId(7)
                },
                Record::Freed {
                    region: RegionId(8)
                }
            ]
        );
        let (r, got) = applied(&image(&[5, 6]), 10).unwrap();
        assert_eq!(
            (r.skipped, r.replayed, r.next_seq, got.len()),
            (2, 0, 11, 0)
        );
        let (r, _) = applied(&image(&[]), 3).unwrap();
        assert_eq!(
            (r.next_seq, r.valid_end_bytes),
            (4, JOURNAL_HEADER_BYTES as u64)
        );
    }

    #[test]
    fn a_gap_in_the_sequence_refuses() {
        assert!(matches!(
            applied(&image(&[1, 2, 4]), 0),
            Err(ScanError::SequenceGap {
                expected: 3,
                found: 4,
                ..
            })
        ));
        assert!(matches!(
            applied(&image(&[9, 10]), 5),
            Err(ScanError::SequenceGap {
                expected: 6,
                found: 9,
                ..
            })
        ));
    }

    #[test]
    fn a_torn_tail_stops_the_scan_at_the_last_good_record() {
        let full = image(&[1, 2, 3]);
        let good_end = image(&[1, 2]).len();
        let (r, got) = applied(&full[..full.len() - 3], 0).unwrap();
        assert_eq!(
            (r.replayed, r.valid_end_bytes as usize, got.len()),
            (2, good_end, 2)
        );
        let stop = r.stop.unwrap();
        assert_eq!(stop.offset_bytes as usize, good_end);
        assert!(matches!(stop.fault, RecordFault::Incomplete { .. }));
    }

    /// Sets slot `slot` of `img`'s header to claim `acknowledged_seq`,
    /// with its checksum broken when `torn`.
    fn set_slot(img: &mut [u8], slot: usize, acknowledged_seq: u64, torn: bool) {
        let at = JOURNAL_SLOT_OFFSETS[slot];
        let mut h = header_slot(JOURNAL_FORMAT_VERSION, acknowledged_seq);
        if torn {
            h[13] ^= 1;
        }
        img[at..at + JOURNAL_SLOT_BYTES].copy_from_slice(&h);
    }

    /// A header neither of whose slots passes its checksum, magic and
    /// version intact (torn rewrites), does not refuse: no acknowledged seq
    /// is used.
    #[test]
    fn a_header_failing_only_its_checksums_recovers_without_a_claim() {
        let mut img = image(&[1, 2]);
        set_slot(&mut img, 0, 9, true);
        set_slot(&mut img, 1, 9, true);
        let report = scan(&img, 0, |_| Ok(())).unwrap();
        assert!(report.header_checksum_mismatch);
        assert_eq!(report.acknowledged_seq, None);
        assert_eq!(report.replayed, 2);
        set_slot(&mut img, 1, 9, false);
        assert!(matches!(
            scan(&img, 0, |_| Ok(())).unwrap_err(),
            ScanError::AcknowledgedLost {
                acknowledged_seq: 9,
                last_seq: 2,
                ..
            }
        ));
    }

    /// Found by a review of the journal (session 22): format 1 kept its one
    /// header slot in the sector of the first records, so a torn header
    /// write could damage both — and with the header's checksum failing,
    /// recovery took the damaged record for a torn tail and silently cut
    /// every acknowledged record after it (their byte ranges handed out
    /// again). Now the claim survives a torn slot in the other one, and no
    /// header write touches a record.
    #[test]
    fn a_torn_header_slot_leaves_the_other_slots_claim_and_early_damage_refuses() {
        let seqs: Vec<u64> = (1..=8).collect();
        let mut img = image(&seqs);
        // Commits took turns: slot 0 claims 7 (its write torn), slot 1 the
        // claim of the commit before, 6.
        set_slot(&mut img, 0, 7, true);
        set_slot(&mut img, 1, 6, false);
        let report = scan(&img, 0, |_| Ok(())).unwrap();
        assert!(!report.header_checksum_mismatch);
        assert_eq!(report.acknowledged_seq, Some(6), "the whole slot's claim");
        assert_eq!(report.next_header_slot, 0, "the torn slot is written next");
        // An acknowledged record damaged (the third): refused, not cut.
        let third = JOURNAL_HEADER_BYTES + 2 * (image(&[1]).len() - JOURNAL_HEADER_BYTES);
        img[third + 20] ^= 0x10;
        assert!(matches!(
            scan(&img, 0, |_| Ok(())).unwrap_err(),
            ScanError::AcknowledgedLost {
                acknowledged_seq: 6,
                last_seq: 2,
                ..
            }
        ));
    }

    /// Slot 0 torn down to its magic: the journal is still recognised by
    /// slot 1.
    #[test]
    fn a_journal_is_recognised_by_either_slot() {
        let mut img = image(&[1]);
        img[..JOURNAL_SLOT_BYTES].fill(0);
        let report = scan(&img, 0, |_| Ok(())).unwrap();
        assert_eq!((report.replayed, report.format_version), (1, 2));
        assert_eq!(report.next_header_slot, 0);
    }

    /// The format is never read from one damaged field: a format-2 file
    /// whose slot 0 reads version 1 is still format 2 by slot 1, and a
    /// format-1 file whose version reads 2 is refused rather than read from
    /// offset 4096 (which would cut its records).
    #[test]
    fn a_damaged_version_does_not_change_where_records_are_read() {
        let mut img = image(&[1, 2]);
        img[8..12].copy_from_slice(&1u32.to_le_bytes());
        let report = scan(&img, 0, |_| Ok(())).unwrap();
        assert_eq!((report.format_version, report.replayed), (2, 2));
        set_slot(&mut img, 1, 0, true);
        let report = scan(&img, 0, |_| Ok(())).unwrap();
        assert_eq!(
            (report.format_version, report.replayed),
            (2, 2),
            "slot 1 torn too"
        );
        let mut v1 = v1_image(0, &(1..=40).collect::<Vec<_>>());
        v1[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            scan(&v1, 0, |_| Ok(())).unwrap_err(),
            ScanError::BadHeader(why) if why.starts_with("damaged")
        ));
    }

    /// Found by the `journal_scan` fuzz target's damage mode (session 32):
    /// a format-2 file whose slot 0 reads version 1 (checksum failing) and
    /// whose slot 1 is damaged too was read as an empty format-1 journal —
    /// from offset 32, where format 2 has zeros — so recovery would have
    /// dropped every record after the checkpoint and handed their regions'
    /// bytes out again. Now it is refused; a format-1 file with the same
    /// torn slot is still read from offset 32.
    #[test]
    fn a_format_2_file_with_both_slots_damaged_is_not_read_as_an_empty_format_1_file() {
        for damage_slot_1 in [
            |img: &mut Vec<u8>| {
                let at = JOURNAL_SLOT_OFFSETS[1];
                img[at..at + JOURNAL_SLOT_BYTES].fill(0);
            },
            |img: &mut Vec<u8>| img[JOURNAL_SLOT_OFFSETS[1] + 8] ^= 1,
        ] {
            let mut img = image(&[1, 2, 3]);
            img[8..12].copy_from_slice(&1u32.to_le_bytes());
            damage_slot_1(&mut img);
            assert!(
                matches!(
                    scan(&img, 0, |_| Ok(())).unwrap_err(),
                    ScanError::BadHeader(why) if why.starts_with("damaged")
                ),
                "read as {:?}",
                scan(&img, 0, |_| Ok(()))
            );
        }
        let mut v1 = v1_image(3, &[1, 2, 3]);
        v1[13] ^= 1;
        let report = scan(&v1, 0, |_| Ok(())).unwrap();
        assert_eq!((report.format_version, report.replayed), (1, 3));
        let mut empty_v1 = v1_image(0, &[]);
        empty_v1[13] ^= 1;
        assert_eq!(scan(&empty_v1, 0, |_| Ok(())).unwrap().format_version, 1);
    }

    /// A format-1 journal (one slot, records from offset 32).
    fn v1_image(acknowledged_seq: u64, seqs: &[u64]) -> Vec<u8> {
        let mut v = header_slot(1, acknowledged_seq).to_vec();
        for &s in seqs {
            Record::Freed {
                region: RegionId(s),
            }
            .encode(s, &mut v);
        }
        v
    }

    #[test]
    fn a_format_1_journal_is_read_from_offset_32() {
        let report = scan(&v1_image(2, &[1, 2, 3]), 0, |_| Ok(())).unwrap();
        assert_eq!((report.format_version, report.records_start_bytes), (1, 32));
        assert_eq!((report.replayed, report.next_seq), (3, 4));
        assert!(matches!(
            scan(&v1_image(5, &[1, 2, 3]), 0, |_| Ok(())).unwrap_err(),
            ScanError::AcknowledgedLost {
                acknowledged_seq: 5,
                ..
            }
        ));
    }

    fn recover_dir(dir: &Path) -> (Journal, ScanReport, Vec<Record>) {
        let mut got = Vec::new();
        let (j, report, _) = Journal::recover(dir, 0, false, &IoFaults::default(), |r| {
            got.push(*r);
            Ok(())
        })
        .unwrap();
        (j, report, got)
    }

    /// A format-1 journal is written again in format 2 by recovery, every
    /// record kept, and later commits append to the new file.
    #[test]
    fn recovery_writes_a_format_1_journal_again_in_format_2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        std::fs::write(&path, v1_image(2, &[1, 2, 3])).unwrap();
        let (mut j, report, got) = recover_dir(dir.path());
        assert_eq!((report.format_version, got.len()), (1, 3));
        let rewritten = std::fs::read(&path).unwrap();
        assert_eq!(rewritten.len(), image(&[1, 2, 3]).len());
        assert_eq!(
            rewritten[JOURNAL_HEADER_BYTES..],
            image(&[1, 2, 3])[JOURNAL_HEADER_BYTES..]
        );
        j.push_record(&Record::Freed {
            region: RegionId(4),
        });
        j.commit().unwrap();
        drop(j);
        let (_, report, got) = recover_dir(dir.path());
        assert_eq!((report.format_version, got.len()), (2, 4));
        assert!(!dir.path().join(JOURNAL_TMP_FILE).exists());
    }

    /// Found by a review of the journal (session 22): recovery wrote a
    /// header claiming every record it kept, then the records, then synced
    /// once — and one sync does not order its pages: a power loss during it
    /// could leave the claim on disk without the records (never
    /// acknowledged: the last commit of a process killed before its sync),
    /// and the next start refused. The records are synced first now.
    #[test]
    fn recovery_syncs_the_records_it_keeps_before_a_header_claims_them() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(JOURNAL_FILE), image(&[1, 2, 3])).unwrap();
        WRITE_STEPS.with(|s| s.borrow_mut().clear());
        let (_, report, _) = recover_dir(dir.path());
        assert_eq!(report.next_seq, 4);
        let steps = WRITE_STEPS.with(|s| s.take());
        let header = steps
            .iter()
            .position(|&s| s == WriteStep::Header)
            .expect("the header is written");
        let records = steps.iter().position(|&s| s == WriteStep::Records);
        let sync = steps.iter().position(|&s| s == WriteStep::Sync);
        assert!(
            records < sync && sync < Some(header),
            "records written and synced before the header: {steps:?}"
        );
        assert_eq!(steps.last(), Some(&WriteStep::Sync), "{steps:?}");
        // The claim is on disk now, in the slot the scan chose.
        let img = std::fs::read(dir.path().join(JOURNAL_FILE)).unwrap();
        let claims: Vec<_> = JOURNAL_SLOT_OFFSETS
            .iter()
            .map(|&at| slot_claim(&img[at..at + JOURNAL_SLOT_BYTES], 2))
            .collect();
        assert_eq!(claims, vec![Some(0), Some(3)]);
    }

    /// Found by a review of the commit path (reliability entry 97): a
    /// commit wrote the claim on the commits before it and its own records
    /// in one sync, and the records' write rewrites the sector holding the
    /// last acknowledged records — a power loss could tear that sector while
    /// the claim did not land, and recovery cut the acknowledged commit as a
    /// torn tail. The claim is synced before the records are written now; a
    /// commit whose claim is on disk already (the first after recovery)
    /// writes only its records.
    #[test]
    fn a_commit_syncs_its_claim_before_writing_its_records() {
        use WriteStep::{Header, Records, Sync};
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = recover_dir(dir.path());
        let mut steps_of_commit = |region| {
            WRITE_STEPS.with(|s| s.borrow_mut().clear());
            j.push_record(&Record::Freed {
                region: RegionId(region),
            });
            j.commit().unwrap();
            WRITE_STEPS.with(|s| s.take())
        };
        assert_eq!(
            steps_of_commit(1),
            vec![Records, Sync],
            "recovery's claim covers every committed record"
        );
        for region in 2..=4 {
            assert_eq!(
                steps_of_commit(region),
                vec![Header, Sync, Records, Sync],
                "commit {region}: the claim synced before the records are written"
            );
        }
    }

    /// Commits write the two slots in turn, so a torn write of one leaves
    /// the other's (one commit older) claim.
    #[test]
    fn commits_write_the_header_slots_in_turn() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = recover_dir(dir.path());
        let claims = |dir: &Path| {
            let img = std::fs::read(dir.join(JOURNAL_FILE)).unwrap();
            JOURNAL_SLOT_OFFSETS
                .iter()
                .map(|&at| slot_claim(&img[at..at + JOURNAL_SLOT_BYTES], 2).unwrap())
                .collect::<Vec<_>>()
        };
        let mut seen = Vec::new();
        for region in 1..=4 {
            j.push_record(&Record::Freed {
                region: RegionId(region),
            });
            j.commit().unwrap();
            seen.push(claims(dir.path()));
        }
        // Each commit claims the seqs of the commits before it.
        assert_eq!(
            seen,
            vec![vec![0, 0], vec![1, 0], vec![1, 2], vec![3, 2]],
            "slots 0 and 1 take turns"
        );
    }

    /// Entry 105: the read stops one byte past the limit whatever size it
    /// was told (a file growing after its `fstat`) — here an endless
    /// reader.
    #[test]
    fn a_read_is_cut_one_byte_past_the_limit_whatever_the_size_said() {
        let endless = io::repeat(0xA5);
        match read_at_most(endless, 0, 4096) {
            Err(BoundedReadError::TooLarge {
                len_bytes: 4097,
                max_bytes: 4096,
            }) => {}
            other => panic!("{:?}", other.map(|image| image.len())),
        }
        let image = read_at_most(&[7u8; 4096][..], 4096, 4096).unwrap();
        assert_eq!(image.len(), 4096, "exactly the limit is read");
    }

    #[test]
    fn a_bad_file_header_refuses() {
        let mut img = image(&[1]);
        for at in JOURNAL_SLOT_OFFSETS {
            img[at + 3] ^= 1;
        }
        assert_eq!(
            applied(&img, 0).unwrap_err(),
            ScanError::BadHeader("wrong magic")
        );
        assert_eq!(
            applied(&img[..10], 0).unwrap_err(),
            ScanError::BadHeader("shorter than the file header")
        );
        let img = image(&[1]);
        assert_eq!(
            applied(&img[..JOURNAL_HEADER_BYTES - 1], 0).unwrap_err(),
            ScanError::BadHeader("shorter than the file header"),
            "a format-2 header block cut short"
        );
        let mut img = image(&[1]);
        for at in JOURNAL_SLOT_OFFSETS {
            img[at + 8..at + 12].copy_from_slice(&3u32.to_le_bytes());
        }
        assert_eq!(
            applied(&img, 0).unwrap_err(),
            ScanError::BadHeader("unsupported format version")
        );
    }
}
