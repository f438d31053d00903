//! Writes the seed corpora of the fuzz targets other than `frame_decode`
//! (whose seeds `fuzz_seeds` writes) into `controlplane/fuzz/seeds/<target>/`:
//!
//! - `payload_decode`: a valid payload of every message kind, behind its
//!   kind selector byte;
//! - `journal_scan`: journals of a real pool manager's records (empty,
//!   allocations, allocations and frees, a torn tail, records partly covered
//!   by a checkpoint, a whole file with its header, in format 2 and 1, and
//!   with headers that acknowledge every record), and inputs for its damage
//!   mode (one per kind of fault);
//! - `checkpoint_decode`: checkpoint images (empty and populated) for the
//!   raw mode, and inputs for the structured mode;
//! - `directory_ops`: a few operation streams from a fixed pseudo-random
//!   sequence (the target reads them as structured choices).
//!
//! ```text
//! cargo run -p cxlkv-controlplane --features samples --example fuzz_corpus
//! ```

use std::path::{Path, PathBuf};

use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::journal::{
    JOURNAL_FORMAT_VERSION, JOURNAL_SLOT_BYTES, file_header, header_slot,
};
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, InstanceId, ManagerConfig, MonotonicMs, PoolIdentity,
    PoolManager, PoolTarget, PoolUuid, Record, Reply, Request, Secret, checkpoint,
};
use cxlkv_controlplane::proto::{Kind, samples};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)
}

/// A manager with one online 16-block pool, attached as directory 1, after
/// `steps` allocations (and a free after every third), with its records.
fn manager_run(steps: u64) -> (PoolManager, Vec<Record>) {
    let mut block = vec![0u8; 4096];
    let identity = PoolIdentity {
        uuid: PoolUuid([5; 16]),
        size_bytes: 16 << 16,
        alignment_bytes: 1 << 16,
    };
    header::encode_identity(&mut block, &identity).expect("a valid identity encodes");
    let BlockState::Initialised(h) = header::decode(&block).expect("it decodes") else {
        unreachable!("an identity was written");
    };
    let mut manager = PoolManager::new(Secret::from_bytes([3; 32]), ManagerConfig::default());
    let mut records = Vec::new();
    let opened = manager
        .open_pool(&h, &mut records)
        .expect("a fresh pool opens");
    manager
        .mark_online(opened.pool, opened.epoch)
        .expect("the epoch it was opened with");
    let caller = Caller::Remote { connection: 1 };
    let now = MonotonicMs(0);
    let attach = Request::Attach {
        directory: DirectoryId(1),
        handles: &[],
    };
    manager
        .handle(&caller, attach, now, &mut records)
        .expect("attach");
    let mut handles = Vec::new();
    for step in 1..=steps {
        let alloc = Request::Alloc {
            target: PoolTarget::Any,
            len_bytes: (1 + step % 2) << 16,
            instance: InstanceId(step % 3),
            tag: AllocTag(step),
        };
        if let Ok(Reply::Allocated(h)) = manager.handle(&caller, alloc, now, &mut records) {
            handles.push(h);
        }
        if step % 3 == 0
            && let Some(h) = handles.pop()
        {
            manager
                .handle(&caller, Request::Free { handle: h }, now, &mut records)
                .expect("free a live region");
        }
    }
    (manager, records)
}

fn encode_records(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, r) in records.iter().enumerate() {
        r.encode(i as u64 + 1, &mut out);
    }
    out
}

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");

    let dir = root.join("payload_decode");
    for (kind, frame) in samples::frames() {
        let index = Kind::ALL
            .iter()
            .position(|k| *k == kind)
            .expect("every sample kind is listed");
        let len = u32::from_le_bytes(frame[20..24].try_into().expect("4 bytes")) as usize;
        let mut seed = vec![index as u8];
        seed.extend_from_slice(&frame[24..24 + len]);
        write(&dir, &format!("{kind:?}.bin"), &seed)?;
    }

    let dir = root.join("journal_scan");
    let (_, records) = manager_run(12);
    let body = encode_records(&records);
    let with_header = |flags: u8, bytes: &[u8]| {
        let mut v = vec![flags];
        v.extend_from_slice(bytes);
        v
    };
    write(&dir, "empty.bin", &[1])?;
    let allocs = encode_records(&records[..records.len().min(6)]);
    write(&dir, "allocations.bin", &with_header(1, &allocs))?;
    write(&dir, "allocations_and_frees.bin", &with_header(1, &body))?;
    write(
        &dir,
        "torn_tail.bin",
        &with_header(1, &body[..body.len() - 11]),
    )?;
    write(
        &dir,
        "checkpoint_covers_3.bin",
        &with_header(1 | 3 << 1, &body),
    )?;
    let mut file = file_header().to_vec();
    file.extend_from_slice(&body);
    write(&dir, "whole_file.bin", &with_header(0, &file))?;
    // A journal of format 1 (one header slot, records from offset 32),
    // which recovery still reads.
    let mut file = header_slot(1, 0).to_vec();
    file.extend_from_slice(&body);
    write(&dir, "whole_file_format_1.bin", &with_header(0, &file))?;
    // Headers that acknowledge every record, in both formats: a tear
    // inside them must be refused (`AcknowledgedLost`), never cut.
    let last = records.len() as u64;
    let mut file = file_header().to_vec();
    file[..JOURNAL_SLOT_BYTES].copy_from_slice(&header_slot(JOURNAL_FORMAT_VERSION, last));
    file.extend_from_slice(&body);
    write(&dir, "whole_file_acknowledged.bin", &with_header(0, &file))?;
    let mut file = header_slot(1, last).to_vec();
    file.extend_from_slice(&body);
    write(
        &dir,
        "whole_file_format_1_acknowledged.bin",
        &with_header(0, &file),
    )?;
    // The damage mode (flag 0x80): a history of ten records, then the
    // checkpoint, the first record kept, the two slots' claims, and the
    // faults (see the target's `Image::damage` for their bytes).
    let history: &[u8] = &[
        10, // steps
        0, 4, 14, // a pool: 64 KiB alignment, 16 blocks
        1, 0, 0, // its epoch raised
        2, 0, 0, 0, 1, // region 1 allocated (64 KiB, directory 1, tag 1)
        2, 0, 1, 1, 2, // region 2 (128 KiB, directory 2, tag 2)
        2, 0, 0, 2, 3, // region 3
        4, 0, // region 1 freed
        3, 0, 3, 3, 0, // region 4 (256 KiB, no tag)
        5, 1, // region 3 reclaimed
        2, 0, 1, 0, 4, // region 5
        1, 0, 2, // the epoch raised again
    ];
    let damaged = |tail: &[u8]| {
        let mut v = vec![0x80];
        v.extend_from_slice(history);
        v.extend_from_slice(tail);
        v
    };
    let damage_seeds: [(&str, &[u8]); 16] = [
        // No fault; slot 1 holds the higher claim.
        ("damage_none", &[0, 0, 9, 10, 0]),
        // Input bytes over the last record, which no claim covers.
        (
            "damage_torn_last_record",
            &[0, 0, 9, 9, 1, 0, 3, 20, 7, 1, 2, 3, 4, 5, 6, 7, 8],
        ),
        // A bit flipped in an acknowledged record: refused.
        (
            "damage_rot_acknowledged",
            &[0, 0, 10, 10, 1, 3, 2, 3, 30, 16],
        ),
        // The sector holding the last two records zeroed, after the claim.
        ("damage_zeroed_sector", &[0, 0, 7, 8, 1, 2, 3, 0, 0]),
        // The header page zeroed: no magic left.
        ("damage_zeroed_header", &[0, 0, 10, 10, 1, 2, 1, 0, 0, 1]),
        // Slot 0 (the higher claim) damaged: slot 1's lower claim is used,
        // and record 9's damage is above it.
        (
            "damage_one_slot",
            &[0, 0, 10, 6, 2, 3, 0, 14, 255, 3, 2, 8, 10, 1],
        ),
        // Record 4 copied after itself.
        ("damage_duplicated", &[0, 0, 10, 10, 1, 4, 3, 3]),
        // Record 5 lost.
        ("damage_dropped", &[0, 0, 10, 10, 1, 5, 3]),
        // Records 6 and 7 swapped.
        ("damage_swapped", &[0, 0, 10, 10, 1, 6, 4]),
        // The file cut inside the last record.
        ("damage_cut", &[0, 0, 8, 9, 1, 7, 3, 17]),
        // Input bytes after the last record.
        (
            "damage_garbage_appended",
            &[0, 0, 10, 10, 1, 8, 15, 1, 9, 9, 9, 9, 9, 9, 9, 9],
        ),
        // Zeros after the last record (a file extended, not written).
        ("damage_zeros_appended", &[0, 0, 10, 10, 1, 8, 63, 0]),
        // Checkpoint at 4, journal from 1: a record the checkpoint holds is
        // damaged, and every claim is at or below the checkpoint.
        ("damage_checkpointed", &[4, 0, 4, 4, 1, 3, 2, 1, 12, 1]),
        // The file cut at offset 2000, inside the header block.
        ("damage_cut_header", &[0, 0, 10, 10, 1, 7, 1, 0xD0, 0x07]),
        // Slot 0's version overwritten with 1 and a bit of slot 1's
        // checksum flipped: no slot whole, slot 1 still says format 2.
        (
            "damage_both_slots",
            &[0, 0, 10, 10, 2, 0, 0, 8, 3, 1, 0, 0, 0, 3, 4, 30, 1],
        ),
        // Slot 0's version overwritten with 1 and slot 1's sector zeroed:
        // no slot whole, slot 1 no longer says format 2, and the records
        // start at 4096 — refused, not read as an empty format-1 file.
        (
            "damage_both_slots_slot_1_zeroed",
            &[0, 0, 10, 10, 2, 0, 0, 8, 3, 1, 0, 0, 0, 2, 4, 0, 0],
        ),
    ];
    for (name, tail) in damage_seeds {
        write(&dir, &format!("{name}.bin"), &damaged(tail))?;
    }

    let dir = root.join("checkpoint_decode");
    let (manager, records) = manager_run(20);
    let image = checkpoint::encode(records.len() as u64, &manager.snapshot());
    write(&dir, "populated.bin", &with_header(0, &image))?;
    let empty = checkpoint::encode(0, &Default::default());
    write(&dir, "empty.bin", &with_header(0, &empty))?;
    write(
        &dir,
        "structured.bin",
        &[1, 4, 20, 7, 0, 2, 4, 1, 6, 3, 8, 5, 10, 7, 12, 9],
    )?;

    let dir = root.join("directory_ops");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for n in 0..8 {
        let len = 256 << (n % 3);
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        write(&dir, &format!("stream{n}.bin"), &bytes)?;
    }
    println!("wrote seeds under {}", root.display());
    Ok(())
}
