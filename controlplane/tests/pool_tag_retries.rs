//! Every copy of a tagged `Alloc` gets the answer the first copy got — also
//! when the first one failed, or when the region it allocated is gone —
//! within the directory's window of remembered answers. Without this, a late
//! copy allocates a region that no answer the directory waits for names (the
//! leak the simulation found on seeds 23,819, 55,862 and 1,184,000).

mod pool_support;

use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, PoolError,
    PoolManager, PoolTarget, Record, Reply, Request, Secret, TAG_ANSWERS_PER_DIRECTORY,
};
use pool_support::{MIB, fresh_header, online};

const DIR: DirectoryId = DirectoryId(1);
const C: Caller = Caller::Remote { connection: 1 };
/// 64 MiB pool, 2 MiB alignment: 31 allocatable 2 MiB blocks.
const BLOCK: u64 = 2 * MIB;
const BLOCKS: u64 = 31;

const CONFIG: ManagerConfig = ManagerConfig { grace_ms: 5_000 };

fn secret() -> Secret {
    Secret::from_bytes([3; 32])
}

fn manager() -> (PoolManager, Vec<Record>) {
    let mut m = PoolManager::new(secret(), CONFIG);
    let mut records = Vec::new();
    online(&mut m, &mut records, &fresh_header(1, 64 * MIB, BLOCK));
    attach(&mut m, &mut records, &C, 0);
    (m, records)
}

/// The manager restarted from its state at `now_ms`, its pool online again.
fn restarted(m: &PoolManager, records: &mut Vec<Record>, now_ms: u64) -> PoolManager {
    let mut m = PoolManager::restore(&m.snapshot(), secret(), CONFIG, MonotonicMs(now_ms))
        .expect("restore");
    online(&mut m, records, &fresh_header(1, 64 * MIB, BLOCK));
    m
}

fn attach(m: &mut PoolManager, records: &mut Vec<Record>, caller: &Caller, now_ms: u64) {
    let attach = Request::Attach {
        directory: DIR,
        handles: &[],
    };
    m.handle(caller, attach, MonotonicMs(now_ms), records)
        .expect("attach");
}

fn alloc_req(len_bytes: u64, tag: u64) -> Request<'static> {
    Request::Alloc {
        target: PoolTarget::Any,
        len_bytes,
        instance: InstanceId(2),
        tag: AllocTag(tag),
    }
}

fn alloc(m: &mut PoolManager, records: &mut Vec<Record>, len_bytes: u64, tag: u64) -> Handle {
    match m.handle(&C, alloc_req(len_bytes, tag), MonotonicMs(0), records) {
        Ok(Reply::Allocated(h)) => h,
        other => panic!("allocation of {len_bytes} bytes, tag {tag}: {other:?}"),
    }
}

fn free(m: &mut PoolManager, records: &mut Vec<Record>, handle: Handle) {
    let got = m.handle(&C, Request::Free { handle }, MonotonicMs(0), records);
    assert!(matches!(got, Ok(Reply::Freed { .. })), "{got:?}");
}

#[test]
fn a_tagged_alloc_refused_for_space_is_refused_again_after_space_is_freed() {
    let (mut m, mut records) = manager();
    let fillers: Vec<Handle> = (0..BLOCKS)
        .map(|_| alloc(&mut m, &mut records, BLOCK, 0))
        .collect();
    let first = m.handle(&C, alloc_req(2 * BLOCK, 77), MonotonicMs(0), &mut records);
    let Err(refusal @ PoolError::NoSpace { .. }) = first.clone() else {
        panic!("a full pool refuses: {first:?}");
    };
    // Two adjacent blocks come free: a fresh run of the request would fit.
    free(&mut m, &mut records, fillers[3]);
    free(&mut m, &mut records, fillers[4]);
    let (regions, free_bytes, n) = (
        m.snapshot().regions.len(),
        m.stats().pools[0].free_bytes,
        records.len(),
    );

    let again = m.handle(&C, alloc_req(2 * BLOCK, 77), MonotonicMs(1), &mut records);
    assert_eq!(again, Err(refusal), "the copy gets the first answer");
    assert_eq!(records.len(), n, "nothing journaled");
    assert_eq!(m.snapshot().regions.len(), regions, "nothing allocated");
    assert_eq!(m.stats().pools[0].free_bytes, free_bytes);
    m.check_invariants().unwrap();

    // The space is really there: another allocation (another tag) gets it.
    alloc(&mut m, &mut records, 2 * BLOCK, 78);
}

#[test]
fn a_tagged_alloc_whose_region_was_freed_is_not_allocated_again() {
    let (mut m, mut records) = manager();
    let h = alloc(&mut m, &mut records, 2 * BLOCK, 5);
    assert_eq!(
        alloc(&mut m, &mut records, 2 * BLOCK, 5),
        h,
        "a copy while the region lives gets the region"
    );
    free(&mut m, &mut records, h);
    let n = records.len();

    let late = m.handle(&C, alloc_req(2 * BLOCK, 5), MonotonicMs(1), &mut records);
    assert_eq!(
        late,
        Err(PoolError::RegionAlreadyFreed { region: h.region })
    );
    assert_eq!(records.len(), n, "nothing journaled");
    assert!(m.snapshot().regions.is_empty(), "nothing allocated");
    m.check_invariants().unwrap();
}

#[test]
fn a_tagged_answer_is_kept_for_the_directorys_last_window_of_tagged_allocations() {
    let (mut m, mut records) = manager();
    let first = m.handle(&C, alloc_req(0, 1), MonotonicMs(0), &mut records);
    assert_eq!(first, Err(PoolError::ZeroLength));
    let too_big = 64 * MIB;
    // Untagged allocations take no place in the window.
    for _ in 0..3 {
        alloc(&mut m, &mut records, BLOCK, 0);
    }
    for tag in 2..=TAG_ANSWERS_PER_DIRECTORY as u64 {
        let got = m.handle(&C, alloc_req(too_big, tag), MonotonicMs(0), &mut records);
        assert!(matches!(got, Err(PoolError::NoSpace { .. })), "{got:?}");
    }
    // Tag 1 is the oldest of the window, still in it: same answer, although
    // the copy now asks for an allocatable length.
    let copy = m.handle(&C, alloc_req(BLOCK, 1), MonotonicMs(0), &mut records);
    assert_eq!(copy, Err(PoolError::ZeroLength));
    // One more tagged allocation pushes it out: the tag runs again.
    let got = m.handle(&C, alloc_req(too_big, 1_000), MonotonicMs(0), &mut records);
    assert!(matches!(got, Err(PoolError::NoSpace { .. })), "{got:?}");
    alloc(&mut m, &mut records, BLOCK, 1);
    m.check_invariants().unwrap();
}

#[test]
fn a_directory_forgotten_when_its_caller_left_forgets_its_answers() {
    let (mut m, mut records) = manager();
    let got = m.handle(&C, alloc_req(0, 9), MonotonicMs(0), &mut records);
    assert_eq!(got, Err(PoolError::ZeroLength));
    // The connection closes; the directory has no regions: it is forgotten,
    // and a copy sent on that connection can no longer arrive.
    assert_eq!(m.caller_gone(&C, MonotonicMs(1)), Some(DIR));
    let c2 = Caller::Remote { connection: 2 };
    attach(&mut m, &mut records, &c2, 2);
    let got = m.handle(&c2, alloc_req(BLOCK, 9), MonotonicMs(3), &mut records);
    assert!(matches!(got, Ok(Reply::Allocated(_))), "{got:?}");
}

#[test]
fn a_retry_answered_from_the_journal_after_a_restart_is_remembered_once_its_region_is_freed() {
    // Simulation seed 1,184,000: the first answer was lost in a restart, the
    // retry found the region through the journal's tag index, the directory
    // freed it, and a late copy then allocated a second region.
    let (mut m, mut records) = manager();
    let h = alloc(&mut m, &mut records, 2 * BLOCK, 7);

    let mut m = restarted(&m, &mut records, 1_000);
    let c2 = Caller::Remote { connection: 2 };
    attach(&mut m, &mut records, &c2, 1_000);
    let retry = m.handle(
        &c2,
        alloc_req(2 * BLOCK, 7),
        MonotonicMs(1_001),
        &mut records,
    );
    assert_eq!(retry, Ok(Reply::Allocated(h)), "the retry gets the region");
    let freed = m.handle(
        &c2,
        Request::Free { handle: h },
        MonotonicMs(1_002),
        &mut records,
    );
    assert!(matches!(freed, Ok(Reply::Freed { .. })), "{freed:?}");
    let n = records.len();

    let late = m.handle(
        &c2,
        alloc_req(2 * BLOCK, 7),
        MonotonicMs(1_003),
        &mut records,
    );
    assert_eq!(
        late,
        Err(PoolError::RegionAlreadyFreed { region: h.region }),
        "a late copy gets the freed region's answer, not a new region"
    );
    assert_eq!(records.len(), n, "nothing journaled");
    assert!(m.snapshot().regions.is_empty(), "nothing allocated");
    m.check_invariants().unwrap();
}

#[test]
fn copies_of_a_live_tagged_alloc_take_one_place_in_the_window() {
    let (mut m, mut records) = manager();
    let h = alloc(&mut m, &mut records, BLOCK, 1);
    // Copies while the region lives must not push other answers out.
    for _ in 0..2 * TAG_ANSWERS_PER_DIRECTORY {
        assert_eq!(alloc(&mut m, &mut records, BLOCK, 1), h);
    }
    let refused = m.handle(&C, alloc_req(0, 2), MonotonicMs(0), &mut records);
    assert_eq!(refused, Err(PoolError::ZeroLength));
    for tag in 3..=TAG_ANSWERS_PER_DIRECTORY as u64 {
        let got = m.handle(&C, alloc_req(64 * MIB, tag), MonotonicMs(0), &mut records);
        assert!(matches!(got, Err(PoolError::NoSpace { .. })), "{got:?}");
    }
    // Tags 1..=N fill the window exactly once each: tag 2 is still in it.
    let copy = m.handle(&C, alloc_req(BLOCK, 2), MonotonicMs(0), &mut records);
    assert_eq!(copy, Err(PoolError::ZeroLength));
    free(&mut m, &mut records, h);
    let late = m.handle(&C, alloc_req(BLOCK, 1), MonotonicMs(0), &mut records);
    assert_eq!(
        late,
        Err(PoolError::RegionAlreadyFreed { region: h.region })
    );
    m.check_invariants().unwrap();
}
