//! The checkpoint format, two ways (the first input byte picks one):
//!
//! - *raw* (even): arbitrary bytes as a checkpoint image. Decoding never
//!   panics; an accepted image is canonical (encoding the decoded snapshot
//!   gives back exactly the input), and loading it into a ledger either is
//!   refused with a typed error or yields a ledger that passes its invariant
//!   check and snapshots back to the same state.
//! - *structured* (odd): a real manager state built from the input (one to
//!   three pools of input-chosen geometry; two directories allocating,
//!   freeing, going away and attaching again with what they held; pools
//!   reopened at new epochs; the reaper reclaiming what outlived its
//!   grace), the manager's invariants checked after every step. Then: the
//!   state's checkpoint image decodes to the same snapshot and loads to the
//!   same ledger; the journal's records replayed on an empty ledger give the
//!   same state, and so does a checkpoint taken part way (through its
//!   image) with the records after it; a manager restored on the state
//!   passes its invariant check.

#![no_main]

use cxlkv_controlplane::pool::checkpoint;
use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::ledger::Ledger;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, PoolIdentity,
    PoolManager, PoolTarget, PoolUuid, Record, Reply, Request, Secret,
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

/// The input's bytes, then zeros.
struct Bytes<'a>(std::slice::Iter<'a, u8>);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        self.0.next().copied().unwrap_or(0)
    }
}

/// A header of input-chosen geometry for pool `index` (its uuid names it).
fn pool_header(bytes: &mut Bytes, index: u8) -> header::Header {
    let alignment_bytes = 4096u64 << (bytes.next() % 10);
    let blocks = 2 + u64::from(bytes.next() % 64);
    let mut uuid = [bytes.next(); 16];
    uuid[0] = index;
    let identity = PoolIdentity {
        uuid: PoolUuid(uuid),
        size_bytes: alignment_bytes * blocks + u64::from(bytes.next()) * 512,
        alignment_bytes,
    };
    let mut block = vec![0u8; 4096];
    header::encode_identity(&mut block, &identity).expect("a valid geometry encodes");
    let Ok(BlockState::Initialised(h)) = header::decode(&block) else {
        panic!("an encoded identity decodes");
    };
    h
}

/// Two directories, each on its own connection while attached.
const DIRECTORIES: u64 = 2;

fn structured(input: &[u8]) {
    const GRACE_MS: u64 = 1_000;
    let mut bytes = Bytes(input.iter());
    let mut manager = PoolManager::new(
        Secret::from_bytes([9; 32]),
        ManagerConfig { grace_ms: GRACE_MS },
    );
    let mut records: Vec<Record> = Vec::new();
    let pools = 1 + bytes.next() % 3;
    let mut headers = Vec::new();
    for index in 0..pools {
        let h = pool_header(&mut bytes, index);
        let opened = manager
            .open_pool(&h, &mut records)
            .expect("a fresh pool opens");
        manager
            .mark_online(opened.pool, opened.epoch)
            .expect("online");
        headers.push((h, opened.pool));
    }
    let mut now = MonotonicMs(0);
    // Per directory: its connection while attached, and the handles it holds.
    let mut connection = [None::<u64>; DIRECTORIES as usize];
    let mut held: [Vec<Handle>; DIRECTORIES as usize] = Default::default();
    // The checkpoint taken before step `cut` (at the end if the input has
    // fewer steps): (records before it, its snapshot).
    let cut = usize::from(bytes.next() % 97);
    let mut checkpoint_at = None;
    for (step, &op) in bytes.0.as_slice().iter().take(96).enumerate() {
        if step == cut {
            checkpoint_at = Some((records.len(), manager.snapshot()));
        }
        let d = usize::from(op >> 7);
        let directory = DirectoryId(d as u64 + 1);
        let arg = op >> 3 & 0xf;
        let Some(c) = connection[d] else {
            // A directory away (at the start, or gone): it attaches again,
            // presenting what it held (kept while within its grace), on a
            // new connection (the step's number names it).
            let caller = Caller::Remote {
                connection: step as u64 + 1,
            };
            let presented = std::mem::take(&mut held[d]);
            let Ok(Reply::Attached(report)) = manager.handle(
                &caller,
                Request::Attach {
                    directory,
                    handles: &presented,
                },
                now,
                &mut records,
            ) else {
                panic!("an attach of a directory that is not attached succeeds");
            };
            held[d] = presented
                .into_iter()
                .zip(&report.verdicts)
                .filter(|(_, v)| v.is_ok())
                .map(|(h, _)| h)
                .collect();
            connection[d] = Some(step as u64 + 1);
            continue;
        };
        let caller = Caller::Remote { connection: c };
        match op & 7 {
            0..=2 => {
                let target = match arg % 4 {
                    0 => PoolTarget::Pool(headers[usize::from(arg) % headers.len()].1),
                    _ => PoolTarget::Any,
                };
                let request = Request::Alloc {
                    target,
                    len_bytes: 4096 << (arg % 10),
                    instance: InstanceId(u64::from(arg % 3)),
                    tag: AllocTag(u64::from(op)),
                };
                // A tag already naming a live region answers that region
                // again (a retry): keep each handle once.
                if let Ok(Reply::Allocated(h)) = manager.handle(&caller, request, now, &mut records)
                    && !held[d].contains(&h)
                {
                    held[d].push(h);
                }
            }
            3 if !held[d].is_empty() => {
                let h = held[d].swap_remove(usize::from(arg) % held[d].len());
                manager
                    .handle(&caller, Request::Free { handle: h }, now, &mut records)
                    .expect("freeing a live region of the caller");
            }
            4 => {
                // The pool's backing goes and comes back: a new epoch.
                let (h, pool) = &headers[usize::from(arg) % headers.len()];
                manager.mark_offline(*pool).expect("a known pool");
                let opened = manager
                    .open_pool(h, &mut records)
                    .expect("a known pool reopens");
                assert!(!opened.added, "a known pool is not added again");
                manager
                    .mark_online(opened.pool, opened.epoch)
                    .expect("online");
            }
            5 => {
                // The directory's connection closes; its regions wait out
                // the grace period.
                assert_eq!(manager.caller_gone(&caller, now), Some(directory));
                connection[d] = None;
            }
            _ => {
                now = now.plus_ms(u64::from(arg) * GRACE_MS / 4);
                let report = manager.tick(now, &mut records);
                for r in &report.reclaimed {
                    for h in &mut held {
                        h.retain(|h| h.region != r.id);
                    }
                }
            }
        }
        manager.check_invariants().expect("manager invariants");
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

    // Recovery from the journal alone: every record replayed on an empty
    // ledger gives the manager's state.
    let mut replayed = Ledger::new();
    for r in &records {
        replayed.apply(r).expect("a journaled record replays");
    }
    assert_eq!(
        replayed.snapshot(),
        snapshot,
        "the journal replays to the state"
    );

    // Recovery from a checkpoint taken part way, through its image, and the
    // records after it.
    let (before, mid) = checkpoint_at.unwrap_or_else(|| (records.len(), snapshot.clone()));
    let (mid_seq, mid_decoded) =
        checkpoint::decode(&checkpoint::encode(before as u64, &mid)).expect("own image decodes");
    assert_eq!(mid_seq, before as u64);
    let mut resumed = Ledger::from_snapshot(&mid_decoded).expect("own snapshot loads");
    for r in &records[before..] {
        resumed
            .apply(r)
            .expect("a record after the checkpoint replays on it");
    }
    assert_eq!(
        resumed.snapshot(),
        snapshot,
        "a checkpoint and the records after it give the state"
    );

    // A manager restarted on the state keeps every region, each waiting for
    // its directory within the grace period.
    let restarted = PoolManager::restore(
        &snapshot,
        Secret::from_bytes([9; 32]),
        ManagerConfig { grace_ms: GRACE_MS },
        now,
    )
    .expect("own snapshot restores");
    restarted.check_invariants().expect("restored invariants");
    assert_eq!(restarted.snapshot(), snapshot);
}

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((&mode, rest)) if mode & 1 == 1 => structured(rest),
        Some((_, rest)) => raw(rest),
        None => {}
    }
});
