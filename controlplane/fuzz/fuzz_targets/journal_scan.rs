//! The journal reader: arbitrary bytes as a journal file, scanned the way
//! recovery scans it (`pool::journal::scan`, the sans-IO core of
//! `Journal::recover`), replaying into an empty ledger.
//!
//! Input: one flag byte, then the file. Flag bit 0 set: a valid file header
//! (format 2) is put in front (so mutations go to the records, not the
//! magic); without it the input may spell out either format; bits 1..
//! give the checkpoint's sequence number (records at or below it are
//! skipped).
//!
//! Properties, beyond "never panics":
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

#![no_main]

use cxlkv_controlplane::pool::journal::{
    JOURNAL_HEADER_BYTES, ScanError, ScanReport, file_header, scan,
};
use cxlkv_controlplane::pool::ledger::Ledger;
use cxlkv_controlplane::pool::record::Record;
use libfuzzer_sys::fuzz_target;

fn replay(file: &[u8], checkpoint_seq: u64) -> Result<(ScanReport, Ledger), ScanError> {
    let mut ledger = Ledger::new();
    let report = scan(file, checkpoint_seq, |r| ledger.apply(r))?;
    Ok((report, ledger))
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
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
    assert_eq!(report.header_checksum_mismatch, report.acknowledged_seq.is_none());
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
});
