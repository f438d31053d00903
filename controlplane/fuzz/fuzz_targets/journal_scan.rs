//! The journal reader, scanned the way recovery scans it
//! (`pool::journal::scan`, the sans-IO core of `Journal::recover`). The
//! first input byte picks one of two modes (bit 7).
//!
//! *Raw* (bit 7 clear): the rest of the input is the file. Flag bit 0 set:
//! a valid file header (format 2) is put in front (so mutations go to the
//! records, not the magic); without it the input may spell out either
//! format; bits 1..=3 give the checkpoint's sequence number (records at or
//! below it are skipped). Replayed into an empty ledger. Properties, beyond
//! "never panics":
//! - every record in the accepted prefix has a valid CRC and is canonical:
//!   decoding it and encoding it again gives back exactly its bytes;
//! - sequence numbers in the accepted prefix are consecutive;
//! - the accepted prefix replays on its own to the same ledger, with no
//!   torn tail, and that ledger passes its invariant check;
//! - a tear anywhere (the file cut at an input-chosen byte) keeps exactly
//!   the whole records before the cut — unless the cut drops a record the
//!   file header acknowledges: then the scan refuses (`AcknowledgedLost`,
//!   naming where the good records end), since cutting would hand a
//!   committed record's byte ranges out again.
//!
//! *Damage* (bit 7 set): the input builds a history of records that apply
//! one after another (pools added, epochs raised, regions allocated, freed
//! and reclaimed), a checkpoint after some of them, and a format-2 journal
//! holding the records from some point at or before the checkpoint on, its
//! two header slots claiming input-chosen acknowledged seqs. Then up to
//! four faults, each picked by the input, damage the journal image: bytes
//! overwritten with input bytes or zeros (a torn sector write, garbage in
//! the last record), a zeroed sector or page, flipped bits (rot at rest), a
//! record duplicated, a middle record dropped, two records swapped (a bad
//! copy), the file cut, garbage or zeros appended. The damaged image is
//! scanned from the checkpoint's state and compared with what was written
//! — not with a second scanner. Let `k` be the number of leading written
//! records still byte-identical at their offsets, and `at` the offset after
//! them:
//! - the scan applies exactly those `k` records (those after the
//!   checkpoint), in order, and never a record after `at`: nothing damaged
//!   is returned, and no damaged record is skipped to reach later ones;
//! - if what is at `at` is torn or corrupt (by the harness's own CRC) or
//!   the file ends there, and the header's claim (the highest of the slots
//!   left whole) is above the last record kept (or the checkpoint), the
//!   scan refuses with `AcknowledgedLost` naming `at`; otherwise it
//!   recovers exactly: the good records end at `at`, the stop (if bytes
//!   follow) is at `at` and drops the rest, and the ledger is the history's
//!   state at the last record kept;
//! - if what is at `at` is a written record out of place (duplicated,
//!   reordered, or after a dropped one), the scan refuses with
//!   `SequenceGap` at `at`;
//! - the header: with a slot left whole, its claim is used (the higher
//!   one if both are), and a file cut inside the header block is refused;
//!   with no slot showing the magic it is refused; with both slots damaged
//!   but slot 1 still showing the magic and format 2, the file is read as
//!   format 2 with no claim.
//!
//!   With both slots damaged and slot 1 no longer showing format 2, the
//!   file may be read as format 1 (from offset 32, by design: see
//!   `check_file_header`), but not while a whole record starts at 4096 and
//!   none at 32 — read that way the journal would look empty.
//!
//! Outside the fault model, and not judged: damage that spells a CRC-valid
//! record or header slot that was never written (a forgery, which any
//! checksum believes); and beyond the rules above, how a header with both
//! slots damaged is read.

#![no_main]

use cxlkv_controlplane::pool::journal::{
    JOURNAL_FORMAT_VERSION, JOURNAL_HEADER_BYTES, JOURNAL_MAGIC, JOURNAL_SLOT_BYTES,
    JOURNAL_SLOT_OFFSETS, ScanError, ScanReport, file_header, header_slot, scan,
};
use cxlkv_controlplane::pool::ledger::Ledger;
use cxlkv_controlplane::pool::record::{
    MAX_RECORD_BODY_BYTES, RECORD_BODY_HEADER_BYTES, RECORD_PREFIX_BYTES,
};
use cxlkv_controlplane::pool::{
    AllocTag, DirectoryId, InstanceId, OwnerLabel, PoolId, PoolUuid, Record, RegionRecord, Snapshot,
};
use libfuzzer_sys::fuzz_target;

/// Flag bit that selects the damage mode.
const DAMAGE_MODE: u8 = 0x80;
/// Most history steps the damage mode tries (each may be refused by the
/// ledger and dropped).
const MAX_HISTORY_STEPS: u8 = 64;
/// Most faults applied to one journal.
const MAX_FAULTS: u8 = 4;
/// Longest run of input bytes one overwrite or append writes.
const MAX_GARBAGE_BYTES: u8 = 64;

fn replay(file: &[u8], checkpoint_seq: u64) -> Result<(ScanReport, Ledger), ScanError> {
    let mut ledger = Ledger::new();
    let report = scan(file, checkpoint_seq, |r| ledger.apply(r))?;
    Ok((report, ledger))
}

fn raw(flags: u8, rest: &[u8]) {
    let mut file = Vec::with_capacity(rest.len() + JOURNAL_HEADER_BYTES);
    if flags & 1 == 1 {
        file.extend_from_slice(&file_header());
    }
    file.extend_from_slice(rest);
    let checkpoint_seq = u64::from(flags >> 1) % 8;

    let Ok((report, ledger)) = replay(&file, checkpoint_seq) else {
        return;
    };
    let end = report.valid_end_bytes as usize;
    // Where records start: 4096 (format 2), or 32 for a format-1 file the
    // input spelled out itself.
    let start = report.records_start_bytes as usize;
    assert!(start == JOURNAL_HEADER_BYTES || (report.format_version == 1 && start == 32));
    assert!(end >= start && end <= file.len());
    assert_eq!(report.stop.is_none(), end == file.len());

    // Every accepted record: valid CRC, canonical, consecutive.
    let mut at = start;
    let mut boundaries = vec![at];
    let mut seqs = Vec::new();
    let mut prev: Option<u64> = None;
    let mut applied = 0u64;
    while at < end {
        let d = Record::decode(&file[at..end]).expect("an accepted record decodes");
        let mut again = Vec::new();
        d.record.encode(d.seq, &mut again);
        assert_eq!(
            again,
            &file[at..at + d.len_bytes],
            "accepted record is canonical"
        );
        if let Some(p) = prev {
            assert_eq!(d.seq, p + 1, "accepted sequence numbers are consecutive");
        }
        if d.seq > checkpoint_seq {
            applied += 1;
        }
        prev = Some(d.seq);
        seqs.push(d.seq);
        at += d.len_bytes;
        boundaries.push(at);
    }
    assert_eq!(at, end);
    assert_eq!(applied, report.replayed);
    let acknowledged = report.acknowledged_seq.unwrap_or(0);
    assert_eq!(
        report.header_checksum_mismatch,
        report.acknowledged_seq.is_none()
    );
    assert!(
        acknowledged <= prev.unwrap_or(0).max(checkpoint_seq),
        "an accepted journal holds every record its header acknowledges"
    );

    // The accepted prefix replays alone, to the same state.
    let (again, ledger_again) =
        replay(&file[..end], checkpoint_seq).expect("the accepted prefix replays");
    assert!(again.stop.is_none());
    assert_eq!(again.replayed, report.replayed);
    assert_eq!(ledger_again.snapshot(), ledger.snapshot());
    ledger
        .verify()
        .expect("a replayed ledger keeps its invariants");

    // A tear inside the accepted prefix keeps the whole records before it.
    let span = end - start;
    if span > 0 {
        let hash = rest.iter().fold(0usize, |h, b| {
            h.wrapping_mul(131).wrapping_add(usize::from(*b))
        });
        let cut = start + hash % span;
        // Whole records before the cut (boundaries[0] is `start`).
        let whole = boundaries.iter().filter(|&&b| b <= cut).count() - 1;
        let kept = boundaries[whole];
        let kept_seq = whole
            .checked_sub(1)
            .map_or(0, |i| seqs[i])
            .max(checkpoint_seq);
        match replay(&file[..cut], checkpoint_seq) {
            Ok((torn, _)) => {
                assert!(
                    acknowledged <= kept_seq,
                    "a tear that drops an acknowledged record is refused"
                );
                assert_eq!(
                    torn.valid_end_bytes as usize, kept,
                    "a tear keeps the whole records before it"
                );
                assert_eq!(torn.stop.is_some(), kept != cut);
            }
            Err(ScanError::AcknowledgedLost {
                offset_bytes,
                acknowledged_seq,
                last_seq,
            }) => {
                assert!(
                    acknowledged > kept_seq,
                    "a tear that keeps every acknowledged record recovers"
                );
                assert_eq!(
                    (offset_bytes as usize, acknowledged_seq, last_seq),
                    (kept, acknowledged, kept_seq),
                    "the refusal names where the good records end"
                );
            }
            Err(e) => panic!("a torn journal recovers or refuses as AcknowledgedLost: {e:?}"),
        }
    }
}

/// The input's bytes, then zeros.
struct Bytes<'a>(std::slice::Iter<'a, u8>);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        self.0.next().copied().unwrap_or(0)
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.next(), self.next()])
    }
}

/// CRC-32C (Castagnoli, reflected), bit by bit over `parts` in turn. The
/// harness's own, so that a scanner that stops checking checksums is caught
/// rather than agreed with.
fn crc32c(parts: &[&[u8]]) -> u32 {
    let mut crc = !0u32;
    for &b in parts.iter().flat_map(|p| p.iter()) {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

/// The length of the record at the start of `b` if its length field is
/// possible and its CRC (over the length field and the body) holds: bytes
/// that a writer produced, as opposed to torn or corrupt ones.
fn crc_valid_record(b: &[u8]) -> Option<usize> {
    let body_len = le_u32(b.get(..4)?) as usize;
    if !(RECORD_BODY_HEADER_BYTES..=MAX_RECORD_BODY_BYTES).contains(&body_len) {
        return None;
    }
    let total = RECORD_PREFIX_BYTES + body_len;
    let record = b.get(..total)?;
    let crc = crc32c(&[&record[..4], &record[RECORD_PREFIX_BYTES..]]);
    (crc == le_u32(&record[4..8])).then_some(total)
}

/// True if `slot` is a header slot of a format this build reads (magic,
/// version 1 or 2) whose checksum holds.
fn slot_whole(slot: &[u8]) -> bool {
    let version = le_u32(&slot[8..12]);
    slot[..8] == JOURNAL_MAGIC
        && (version == 1 || version == JOURNAL_FORMAT_VERSION)
        && crc32c(&[&slot[..28]]) == le_u32(&slot[28..32])
}

/// One step of the history: a record chosen by the input that may or may
/// not apply to `ledger` (the caller keeps it only if it does).
fn candidate(bytes: &mut Bytes, ledger: &Ledger) -> Option<Record> {
    let pools = ledger.pools().count() as u32;
    let regions = ledger.region_count();
    match bytes.next() % 6 {
        0 => {
            let alignment_bytes = 4096u64 << (bytes.next() % 5);
            let blocks = 2 + u64::from(bytes.next() % 30);
            let mut uuid = [0xA5; 16];
            uuid[..4].copy_from_slice(&pools.to_le_bytes());
            Some(Record::PoolAdded {
                pool: PoolId(pools),
                uuid: PoolUuid(uuid),
                size_bytes: alignment_bytes * blocks,
                alignment_bytes,
            })
        }
        1 => {
            let (p, e) = (bytes.next(), bytes.next());
            let pool = PoolId(u32::from(p) % pools.max(1));
            let epoch = ledger.pool(pool)?.epoch + 1 + u64::from(e % 4);
            Some(Record::PoolEpoch { pool, epoch })
        }
        2 | 3 => {
            let (p, l, o, t) = (bytes.next(), bytes.next(), bytes.next(), bytes.next());
            let pool = PoolId(u32::from(p) % pools.max(1));
            let len_bytes = ledger.pool(pool)?.alignment_bytes * (1 + u64::from(l % 4));
            Some(Record::Allocated(RegionRecord {
                id: ledger.next_region(),
                pool,
                offset_bytes: ledger.first_fit(pool, len_bytes)?,
                len_bytes,
                owner: OwnerLabel {
                    directory: DirectoryId(1 + u64::from(o % 2)),
                    instance: InstanceId(u64::from(o >> 1) % 3),
                },
                tag: AllocTag(u64::from(t % 8)),
            }))
        }
        kind => {
            let r = usize::from(bytes.next());
            let region = ledger.regions().nth(r % regions.max(1))?.id;
            Some(if kind == 4 {
                Record::Freed { region }
            } else {
                Record::Reclaimed { region }
            })
        }
    }
}

/// The records of an input-chosen history that apply one after another to
/// an empty ledger, and the ledger's state after each (`states[s]` after
/// seq `s`; `states[0]` is empty).
fn history(bytes: &mut Bytes) -> (Vec<Record>, Vec<Snapshot>) {
    let mut ledger = Ledger::new();
    let mut records = Vec::new();
    let mut states = vec![ledger.snapshot()];
    for _ in 0..bytes.next() % MAX_HISTORY_STEPS {
        if let Some(r) = candidate(bytes, &ledger)
            && ledger.apply(&r).is_ok()
        {
            records.push(r);
            states.push(ledger.snapshot());
        }
    }
    (records, states)
}

/// A record as written: its seq, value and bytes.
struct Written {
    seq: u64,
    record: Record,
    bytes: Vec<u8>,
}

/// The damaged image and where its records are: back to back from the end
/// of the header block, `lens[i]` bytes each (faults that move records keep
/// this up to date; the others damage bytes in place).
struct Image {
    bytes: Vec<u8>,
    lens: Vec<usize>,
}

impl Image {
    fn start(&self, i: usize) -> usize {
        JOURNAL_HEADER_BYTES + self.lens[..i].iter().sum::<usize>()
    }

    /// Where a byte fault lands: in or just after a header slot, anywhere
    /// in the header block, in a record, or in the last record (a torn
    /// append).
    fn position(&self, input: &mut Bytes) -> usize {
        let sel = input.next();
        let n = self.lens.len();
        let at = match sel % 4 {
            0 => JOURNAL_SLOT_OFFSETS[usize::from(sel >> 2) & 1] + usize::from(input.next() % 40),
            1 => usize::from(input.u16()) % JOURNAL_HEADER_BYTES,
            _ if n == 0 => self.bytes.len(),
            2 => {
                let i = usize::from(input.next()) % n;
                self.start(i) + usize::from(input.next()) % self.lens[i]
            }
            _ => self.start(n - 1) + usize::from(input.next()) % self.lens[n - 1],
        };
        at.min(self.bytes.len())
    }

    /// Applies one input-chosen fault.
    fn damage(&mut self, input: &mut Bytes) {
        let n = self.lens.len();
        match input.next() % 9 {
            // A torn write that left input bytes (garbage, or old bytes).
            0 => {
                let at = self.position(input);
                let end =
                    (at + 1 + usize::from(input.next() % MAX_GARBAGE_BYTES)).min(self.bytes.len());
                for b in &mut self.bytes[at..end] {
                    *b = input.next();
                }
            }
            // Zeros over any range up to a page.
            1 => {
                let at = self.position(input);
                let end = (at + 1 + usize::from(input.u16()) % JOURNAL_HEADER_BYTES)
                    .min(self.bytes.len());
                self.bytes[at..end].fill(0);
            }
            // A zeroed sector or page, aligned as the device or the page
            // cache would lose it.
            2 => {
                let at = self.position(input);
                let size = if input.next() & 1 == 0 { 512 } else { 4096 };
                let start = (at / size * size).min(self.bytes.len());
                let end = (start + size).min(self.bytes.len());
                self.bytes[start..end].fill(0);
            }
            // Bits flipped at rest.
            3 => {
                let at = self.position(input);
                let mask = input.next().max(1);
                if let Some(b) = self.bytes.get_mut(at) {
                    *b ^= mask;
                }
            }
            // A record copied again before record `p` (or after the last):
            // never in front of the first, which a checkpoint can make
            // legitimate.
            4 if n > 0 => {
                let i = usize::from(input.next()) % n;
                let p = 1 + usize::from(input.next()) % n;
                let from = self.start(i);
                let copy = self.bytes[from..from + self.lens[i]].to_vec();
                let to = self.start(p);
                self.bytes.splice(to..to, copy);
                self.lens.insert(p, self.lens[i]);
            }
            // A middle record lost (not the first, as above).
            5 if n > 1 => {
                let i = 1 + usize::from(input.next()) % (n - 1);
                let from = self.start(i);
                self.bytes.drain(from..from + self.lens[i]);
                self.lens.remove(i);
            }
            // Two neighbours swapped (not the first).
            6 if n > 2 => {
                let i = 1 + usize::from(input.next()) % (n - 2);
                let from = self.start(i);
                let both = self.lens[i] + self.lens[i + 1];
                self.bytes[from..from + both].rotate_left(self.lens[i]);
                self.lens.swap(i, i + 1);
            }
            // The file cut.
            7 => {
                let at = self.position(input);
                self.bytes.truncate(at);
                while let Some(&last) = self.lens.last() {
                    let start = self.start(self.lens.len() - 1);
                    if start >= at {
                        self.lens.pop();
                    } else {
                        *self.lens.last_mut().expect("not empty") = last.min(at - start);
                        break;
                    }
                }
            }
            // Input bytes or zeros after the end (a torn append; a file
            // extended but not written).
            8 => {
                let len = 1 + usize::from(input.next() % MAX_GARBAGE_BYTES);
                let zeros = input.next() & 1 == 0;
                for _ in 0..len {
                    let b = if zeros { 0 } else { input.next() };
                    self.bytes.push(b);
                }
            }
            _ => {}
        }
    }
}

/// A scan from the checkpoint's state: its outcome, the ledger after it,
/// and every record the scan handed to the ledger, in order.
struct Scanned {
    result: Result<ScanReport, ScanError>,
    ledger: Ledger,
    applied: Vec<Record>,
}

fn replay_from(file: &[u8], checkpoint_seq: u64, states: &[Snapshot]) -> Scanned {
    let mut ledger = Ledger::from_snapshot(&states[checkpoint_seq as usize])
        .expect("a ledger's own snapshot loads");
    let mut applied = Vec::new();
    let result = scan(file, checkpoint_seq, |r| {
        applied.push(*r);
        ledger.apply(r)
    });
    Scanned {
        result,
        ledger,
        applied,
    }
}

fn damaged(input: &[u8]) {
    let mut input = Bytes(input.iter());
    let (records, states) = history(&mut input);
    let last_written = records.len() as u64;
    let checkpoint_seq = u64::from(input.next()) % (last_written + 1);
    let first_seq = 1 + u64::from(input.next()) % (checkpoint_seq + 1);
    let claims = [
        u64::from(input.next()) % (last_written + 1),
        u64::from(input.next()) % (last_written + 1),
    ];

    let mut original = file_header().to_vec();
    for (at, claim) in JOURNAL_SLOT_OFFSETS.into_iter().zip(claims) {
        original[at..at + JOURNAL_SLOT_BYTES]
            .copy_from_slice(&header_slot(JOURNAL_FORMAT_VERSION, claim));
    }
    let mut written = Vec::new();
    for (seq, record) in (first_seq..).zip(&records[first_seq as usize - 1..]) {
        let mut bytes = Vec::new();
        record.encode(seq, &mut bytes);
        assert_eq!(
            crc_valid_record(&bytes),
            Some(bytes.len()),
            "the harness's CRC agrees with the encoder's"
        );
        original.extend_from_slice(&bytes);
        written.push(Written {
            seq,
            record: *record,
            bytes,
        });
    }
    let undamaged = replay_from(&original, checkpoint_seq, &states);
    let report = undamaged.result.expect("the undamaged journal recovers");
    assert_eq!(report.valid_end_bytes as usize, original.len());
    assert_eq!(undamaged.ledger.snapshot(), states[records.len()]);

    let mut image = Image {
        bytes: original.clone(),
        lens: written.iter().map(|w| w.bytes.len()).collect(),
    };
    for _ in 0..input.next() % (MAX_FAULTS + 1) {
        image.damage(&mut input);
    }
    check(
        &original,
        &image.bytes,
        &written,
        claims,
        checkpoint_seq,
        &states,
    );
}

/// Judges the scan of the damaged `image` against what was written (see
/// the header of this file).
fn check(
    original: &[u8],
    image: &[u8],
    written: &[Written],
    claims: [u64; 2],
    checkpoint_seq: u64,
    states: &[Snapshot],
) {
    let scanned = replay_from(image, checkpoint_seq, states);
    let result = &scanned.result;

    // The claim of the slots left whole (the first of the highest), and
    // whether any slot still shows the magic.
    let mut claim: Option<(u64, usize)> = None;
    let mut magic = false;
    for (i, at) in JOURNAL_SLOT_OFFSETS.into_iter().enumerate() {
        let now = image.get(at..at + JOURNAL_SLOT_BYTES);
        if now == Some(&original[at..at + JOURNAL_SLOT_BYTES]) {
            if claim.is_none_or(|(c, _)| claims[i] > c) {
                claim = Some((claims[i], i));
            }
            magic = true;
        } else if let Some(slot) = now {
            if slot_whole(slot) {
                // A slot with a valid checksum that was never written: a
                // forgery, outside the fault model.
                return;
            }
            magic |= slot[..8] == JOURNAL_MAGIC;
        }
    }
    let Some((claim, newest)) = claim else {
        // Both slots damaged (two faults on the header).
        let slot1_v2 = image
            .get(JOURNAL_SLOT_OFFSETS[1]..JOURNAL_SLOT_OFFSETS[1] + 12)
            .is_some_and(|s| s[..8] == JOURNAL_MAGIC && le_u32(&s[8..]) == JOURNAL_FORMAT_VERSION);
        if !magic {
            assert!(
                matches!(result, Err(ScanError::BadHeader(_))),
                "a header with no slot showing the magic is refused: {result:?}"
            );
        } else if slot1_v2 && image.len() >= JOURNAL_HEADER_BYTES {
            if let Ok(report) = result {
                assert_eq!(
                    (report.format_version, report.acknowledged_seq),
                    (JOURNAL_FORMAT_VERSION, None),
                    "with no slot whole and slot 1 showing format 2, the file is format 2 with no claim"
                );
                assert!(report.header_checksum_mismatch);
            }
            judge_records(image, written, 0, checkpoint_seq, states, &scanned);
        } else if let Ok(report) = result
            && report.format_version == 1
        {
            // Read from offset 32, a format-2 file looks empty: recovery
            // would drop every record after the checkpoint.
            let whole_at = |at: usize| image.get(at..).is_some_and(|r| Record::decode(r).is_ok());
            assert!(
                whole_at(32) || !whole_at(JOURNAL_HEADER_BYTES),
                "a journal whose records start at 4096 is not read as format 1: {report:?}"
            );
        }
        return;
    };
    if image.len() < JOURNAL_HEADER_BYTES {
        assert!(
            matches!(result, Err(ScanError::BadHeader(_))),
            "a journal cut inside its header block is refused: {result:?}"
        );
        return;
    }
    if let Ok(report) = result {
        assert_eq!(
            report.acknowledged_seq,
            Some(claim),
            "the claim is the highest of the slots left whole"
        );
        assert!(!report.header_checksum_mismatch);
        assert_eq!(report.format_version, JOURNAL_FORMAT_VERSION);
        assert_eq!(report.records_start_bytes as usize, JOURNAL_HEADER_BYTES);
        assert_eq!(
            report.next_header_slot,
            1 - newest,
            "the next claim goes to the slot not holding the one used"
        );
    }
    judge_records(image, written, claim, checkpoint_seq, states, &scanned);
}

/// Judges the records part of the scan of `image` (format 2), its header
/// claiming `claim`.
fn judge_records(
    image: &[u8],
    written: &[Written],
    claim: u64,
    checkpoint_seq: u64,
    states: &[Snapshot],
    scanned: &Scanned,
) {
    let Scanned {
        result,
        ledger,
        applied,
    } = scanned;
    // The leading written records still intact at their offsets.
    let mut at = JOURNAL_HEADER_BYTES;
    let mut k = 0;
    while let Some(w) = written.get(k)
        && image.get(at..at + w.bytes.len()) == Some(&w.bytes[..])
    {
        at += w.bytes.len();
        k += 1;
    }
    let kept = &written[..k];
    let last_seq = kept.last().map_or(0, |w| w.seq).max(checkpoint_seq);
    let rest = &image[at..];
    if let Some(len) = crc_valid_record(rest) {
        let copy = written.iter().find(|w| w.bytes == rest[..len]);
        let (Some(copy), Some(prev)) = (copy, kept.last()) else {
            // CRC-valid bytes no writer produced (a forgery), or a written
            // record at the front (faults do not put one there).
            return;
        };
        assert_eq!(
            result,
            &Err(ScanError::SequenceGap {
                offset_bytes: at as u64,
                expected: prev.seq + 1,
                found: copy.seq,
            }),
            "a written record out of place (duplicated, reordered, after a dropped one) is refused where it sits"
        );
    } else if claim > last_seq {
        assert_eq!(
            result,
            &Err(ScanError::AcknowledgedLost {
                offset_bytes: at as u64,
                acknowledged_seq: claim,
                last_seq,
            }),
            "damage to a record the header acknowledges is refused, naming where the good records end"
        );
    } else {
        let report = match result {
            Ok(report) => report,
            Err(e) => panic!(
                "damage after every acknowledged record recovers the whole records before it (they end at {at}): {e:?}"
            ),
        };
        assert_eq!(
            report.valid_end_bytes as usize, at,
            "the good records end where the first damaged one starts"
        );
        match report.stop {
            None => assert_eq!(at, image.len(), "bytes after the good records are a stop"),
            Some(stop) => {
                assert_eq!(
                    (stop.offset_bytes as usize, stop.dropped_bytes as usize),
                    (at, image.len() - at),
                    "the stop is at the first damaged record and drops the rest"
                );
                assert!(stop.fault.is_torn_or_corrupt());
            }
        }
        let replayed = kept.iter().filter(|w| w.seq > checkpoint_seq).count() as u64;
        assert_eq!(
            (report.replayed, report.skipped),
            (replayed, k as u64 - replayed)
        );
        assert_eq!(report.next_seq, last_seq + 1);
        assert_eq!(
            ledger.snapshot(),
            states[last_seq as usize],
            "the recovered state is the history's at the last record kept"
        );
    }
    let expected: Vec<Record> = kept
        .iter()
        .filter(|w| w.seq > checkpoint_seq)
        .map(|w| w.record)
        .collect();
    assert_eq!(
        applied, &expected,
        "the scan applies the intact written records before the first damaged one, and nothing else"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    if flags & DAMAGE_MODE == 0 {
        raw(flags, rest);
    } else {
        damaged(rest);
    }
});
