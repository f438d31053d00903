//! The checkpoint format, two ways (the first input byte picks one):
//!
//! - *raw* (even): arbitrary bytes as a checkpoint image. Decoding never
//!   panics; an accepted image is canonical (encoding the decoded snapshot
//!   gives back exactly the input), and loading it into a ledger either is
//!   refused with a typed error or yields a ledger that passes its invariant
//!   check and snapshots back to the same state.
//! - *structured* (odd): a real manager state built from the input (a pool
//!   of input-chosen geometry, then allocations and frees), checkpointed:
//!   the image decodes to the same snapshot and loads to the same ledger.

#![no_main]

use cxlkv_controlplane::pool::checkpoint;
use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::ledger::Ledger;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, InstanceId, ManagerConfig, PoolIdentity, PoolManager,
    PoolTarget, PoolUuid, Record, Reply, Request, Secret,
};
use libfuzzer_sys::fuzz_target;

fn raw(image: &[u8]) {
    let Ok((seq, snapshot)) = checkpoint::decode(image) else {
        return;
    };
    assert_eq!(
        checkpoint::encode(seq, &snapshot),
        image,
        "accepted images are canonical"
    );
    if let Ok(ledger) = Ledger::from_snapshot(&snapshot) {
        ledger
            .verify()
            .expect("a loaded checkpoint keeps the ledger invariants");
        let again =
            Ledger::from_snapshot(&ledger.snapshot()).expect("a ledger's own snapshot loads");
        assert_eq!(again.snapshot(), ledger.snapshot());
    }
}

fn structured(input: &[u8]) {
    let mut bytes = input.iter().copied();
    let mut next = || bytes.next().unwrap_or(0);
    let alignment_bytes = 4096u64 << (next() % 10);
    let blocks = 2 + u64::from(next() % 64);
    let identity = PoolIdentity {
        uuid: PoolUuid([next(); 16]),
        size_bytes: alignment_bytes * blocks + u64::from(next()) * 512,
        alignment_bytes,
    };
    let mut block = vec![0u8; 4096];
    header::encode_identity(&mut block, &identity).expect("a valid geometry encodes");
    let Ok(BlockState::Initialised(h)) = header::decode(&block) else {
        panic!("an encoded identity decodes");
    };
    let mut manager = PoolManager::new(Secret::from_bytes([9; 32]), ManagerConfig::default());
    let mut records: Vec<Record> = Vec::new();
    let opened = manager
        .open_pool(&h, &mut records)
        .expect("a fresh pool opens");
    manager
        .mark_online(opened.pool, opened.epoch)
        .expect("online");
    let caller = Caller::Remote { connection: 1 };
    let t = cxlkv_controlplane::pool::MonotonicMs(0);
    manager
        .handle(
            &caller,
            Request::Attach {
                directory: DirectoryId(1),
                handles: &[],
            },
            t,
            &mut records,
        )
        .expect("attach");
    let mut handles = Vec::new();
    for step in input.iter().skip(4).take(64) {
        if step & 1 == 0 || handles.is_empty() {
            let len_bytes = alignment_bytes * (1 + u64::from(step >> 1) % 4);
            let request = Request::Alloc {
                target: PoolTarget::Any,
                len_bytes,
                instance: InstanceId(u64::from(step % 3)),
                tag: AllocTag(u64::from(*step)),
            };
            // A tag already naming a live region answers that region again
            // (a retry): keep each handle once.
            if let Ok(Reply::Allocated(h)) = manager.handle(&caller, request, t, &mut records)
                && !handles.contains(&h)
            {
                handles.push(h);
            }
        } else {
            let h = handles.swap_remove(usize::from(step >> 1) % handles.len());
            manager
                .handle(&caller, Request::Free { handle: h }, t, &mut records)
                .expect("freeing a live region of the caller");
        }
    }
    let snapshot = manager.snapshot();
    let seq = records.len() as u64;
    let image = checkpoint::encode(seq, &snapshot);
    assert_eq!(
        checkpoint::decode(&image).expect("own image decodes"),
        (seq, snapshot.clone())
    );
    let ledger = Ledger::from_snapshot(&snapshot).expect("own snapshot loads");
    ledger.verify().expect("invariants");
    assert_eq!(ledger.snapshot(), snapshot);
}

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((&mode, rest)) if mode & 1 == 1 => structured(rest),
        Some((_, rest)) => raw(rest),
        None => {}
    }
});
