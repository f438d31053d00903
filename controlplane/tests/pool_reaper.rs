//! The reaper: a directory that goes away loses its regions after the grace
//! period — not before — unless it comes back and presents their handles.

mod pool_support;

use cxlkv_controlplane::pool::liveness::{self, Liveness};
use cxlkv_controlplane::pool::manager::MAX_REAP_PER_TICK;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, PoolError,
    PoolManager, PoolTarget, ProcessIdentity, Record, Reply, Request, Secret, StoreConfig,
};
use pool_support::{KIB, MIB, call, fresh_header, online, online_durable, open_store, shm_dir};

const GRACE_MS: u64 = 5_000;
const DIR: DirectoryId = DirectoryId(1);

fn manager() -> (PoolManager, Vec<Record>) {
    let mut m = PoolManager::new(
        Secret::from_bytes([7; 32]),
        ManagerConfig { grace_ms: GRACE_MS },
    );
    let mut records = Vec::new();
    online(&mut m, &mut records, &fresh_header(1, 64 * MIB, 2 * MIB));
    (m, records)
}

fn attach(
    m: &mut PoolManager,
    c: &Caller,
    d: DirectoryId,
    handles: &[Handle],
    now: u64,
) -> Vec<Result<(), PoolError>> {
    let req = Request::Attach {
        directory: d,
        handles,
    };
    match m.handle(c, req, MonotonicMs(now), &mut Vec::new()) {
        Ok(Reply::Attached(r)) => r.verdicts,
        other => panic!("{other:?}"),
    }
}

fn alloc(m: &mut PoolManager, c: &Caller, records: &mut Vec<Record>) -> Handle {
    let req = Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: 2 * MIB,
        instance: InstanceId(0),
        tag: AllocTag::NONE,
    };
    match m.handle(c, req, MonotonicMs(0), records) {
        Ok(Reply::Allocated(h)) => h,
        other => panic!("{other:?}"),
    }
}

fn live(m: &PoolManager) -> usize {
    m.snapshot().regions.len()
}

#[test]
fn regions_of_a_gone_directory_are_reclaimed_after_the_grace_not_before() {
    let (mut m, mut records) = manager();
    let c = Caller::Remote { connection: 5 };
    attach(&mut m, &c, DIR, &[], 0);
    let hs: Vec<Handle> = (0..3).map(|_| alloc(&mut m, &c, &mut records)).collect();
    let free_before = m.stats().pools[0].free_bytes;
    assert_eq!(m.caller_gone(&c, MonotonicMs(100)), Some(DIR));
    assert_eq!(m.next_deadline(), Some(MonotonicMs(100 + GRACE_MS)));
    let n = records.len();
    assert!(
        m.tick(MonotonicMs(100 + GRACE_MS - 1), &mut records)
            .reclaimed
            .is_empty()
    );
    assert_eq!(
        (live(&m), records.len()),
        (3, n),
        "nothing is reclaimed before the grace ends"
    );
    let report = m.tick(MonotonicMs(100 + GRACE_MS), &mut records);
    let ids: Vec<_> = report.reclaimed.iter().map(|r| r.id).collect();
    assert_eq!(ids, hs.iter().map(|h| h.region).collect::<Vec<_>>());
    assert_eq!(live(&m), 0);
    assert_eq!(m.stats().pools[0].free_bytes, free_before + 6 * MIB);
    assert!(
        records[n..]
            .iter()
            .all(|r| matches!(r, Record::Reclaimed { .. }))
    );
    assert_eq!(
        m.directory(DIR, MonotonicMs(0)),
        None,
        "a gone directory without regions is forgotten"
    );
    m.check_invariants().unwrap();
}

#[test]
fn reattach_within_the_grace_keeps_the_presented_regions() {
    let (mut m, mut records) = manager();
    let c = Caller::Remote { connection: 5 };
    attach(&mut m, &c, DIR, &[], 0);
    let hs: Vec<Handle> = (0..3).map(|_| alloc(&mut m, &c, &mut records)).collect();
    m.caller_gone(&c, MonotonicMs(0));
    let back = Caller::Remote { connection: 6 };
    let verdicts = attach(&mut m, &back, DIR, &hs[..2], GRACE_MS / 2);
    assert_eq!(verdicts, vec![Ok(()), Ok(())]);
    let status = m.directory(DIR, MonotonicMs(GRACE_MS / 2)).unwrap();
    assert_eq!(
        (
            status.attached_by,
            status.regions,
            status.unconfirmed_regions
        ),
        (Some(back), 3, 1)
    );
    assert_eq!(status.reclaim_in_ms, Some(GRACE_MS / 2));
    let report = m.tick(MonotonicMs(GRACE_MS), &mut records);
    assert_eq!(
        report.reclaimed.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![hs[2].region]
    );
    assert!(
        m.tick(MonotonicMs(100 * GRACE_MS), &mut records)
            .reclaimed
            .is_empty()
    );
    assert_eq!(live(&m), 2, "presented regions are kept for good");
    m.check_invariants().unwrap();
}

#[test]
fn an_impostor_attaching_under_a_dead_directorys_id_neither_keeps_nor_frees_its_regions() {
    let (mut m, mut records) = manager();
    let c = Caller::Remote { connection: 5 };
    attach(&mut m, &c, DIR, &[], 0);
    let h = alloc(&mut m, &c, &mut records);
    m.caller_gone(&c, MonotonicMs(0));
    let impostor = Caller::Remote { connection: 66 };
    let mut forged = h;
    forged.token.0[1] ^= 4;
    assert_eq!(
        attach(&mut m, &impostor, DIR, &[forged], 10),
        vec![Err(PoolError::BadToken { region: h.region })]
    );
    assert_eq!(
        m.handle(
            &impostor,
            Request::Free { handle: forged },
            MonotonicMs(10),
            &mut records
        ),
        Err(PoolError::BadToken { region: h.region })
    );
    assert!(
        m.tick(MonotonicMs(GRACE_MS - 1), &mut records)
            .reclaimed
            .is_empty(),
        "not freed early"
    );
    assert_eq!(
        m.tick(MonotonicMs(GRACE_MS), &mut records).reclaimed.len(),
        1,
        "not kept either"
    );
}

#[test]
fn a_second_death_keeps_the_first_deadline() {
    let (mut m, mut records) = manager();
    let c = Caller::Remote { connection: 5 };
    attach(&mut m, &c, DIR, &[], 0);
    alloc(&mut m, &c, &mut records);
    m.caller_gone(&c, MonotonicMs(0));
    // Reattaching without presenting, then dying again, does not extend it.
    let again = Caller::Remote { connection: 6 };
    attach(&mut m, &again, DIR, &[], GRACE_MS - 10);
    m.caller_gone(&again, MonotonicMs(GRACE_MS - 5));
    assert_eq!(
        m.tick(MonotonicMs(GRACE_MS), &mut records).reclaimed.len(),
        1
    );
}

#[test]
fn a_local_directory_process_that_exits_loses_its_regions_after_the_grace() {
    let (mut m, mut records) = manager();
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let who = liveness::identify(child.id())
        .unwrap()
        .expect("the child runs");
    let c = Caller::Local(who);
    attach(&mut m, &c, DIR, &[], 0);
    alloc(&mut m, &c, &mut records);
    // The driver's liveness loop, as the service will run it.
    let probe_all = |m: &mut PoolManager, now: u64| {
        let callers: Vec<ProcessIdentity> = m.local_callers().collect();
        for p in callers {
            if liveness::probe(&p).unwrap() != Liveness::Alive {
                m.caller_gone(&Caller::Local(p), MonotonicMs(now));
            }
        }
    };
    probe_all(&mut m, 10);
    assert_eq!(
        m.directory(DIR, MonotonicMs(10)).unwrap().attached_by,
        Some(c),
        "alive: still attached"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    probe_all(&mut m, 20);
    assert_eq!(
        m.directory(DIR, MonotonicMs(20)).unwrap().attached_by,
        None,
        "exited: gone"
    );
    assert!(
        m.tick(MonotonicMs(20 + GRACE_MS - 1), &mut records)
            .reclaimed
            .is_empty()
    );
    assert_eq!(
        m.tick(MonotonicMs(20 + GRACE_MS), &mut records)
            .reclaimed
            .len(),
        1
    );
}

#[test]
fn a_reused_pid_is_another_caller_and_does_not_keep_the_dead_one_alive() {
    let (mut m, mut records) = manager();
    let dead = ProcessIdentity {
        pid: 4242,
        start_time_ticks: 1_000,
    };
    let reuser = ProcessIdentity {
        pid: 4242,
        start_time_ticks: 9_000,
    };
    attach(&mut m, &Caller::Local(dead), DIR, &[], 0);
    let h = alloc(&mut m, &Caller::Local(dead), &mut records);
    // The new process with the same pid is a different caller: it cannot
    // speak for the directory while the old identity is bound…
    let req = Request::Attach {
        directory: DIR,
        handles: &[],
    };
    assert_eq!(
        m.handle(&Caller::Local(reuser), req, MonotonicMs(1), &mut records),
        Err(PoolError::DirectoryAttachedElsewhere { directory: DIR })
    );
    // …and the probe of the old identity sees the changed start time.
    let stat = format!(
        "4242 (dir) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 20 0 1 0 {} 1 2",
        reuser.start_time_ticks
    );
    let seen = liveness::parse_stat(stat.as_bytes()).unwrap();
    assert_eq!(
        liveness::judge(&dead, Some(seen)),
        Liveness::Replaced {
            start_time_ticks: 9_000
        }
    );
    m.caller_gone(&Caller::Local(dead), MonotonicMs(2));
    // Now a restarted directory (whatever its pid) can reattach and keep it.
    assert_eq!(
        attach(&mut m, &Caller::Local(reuser), DIR, &[h], 3),
        vec![Ok(())]
    );
    assert!(
        m.tick(MonotonicMs(10 * GRACE_MS), &mut records)
            .reclaimed
            .is_empty()
    );
}

#[test]
fn after_a_restart_every_region_gets_a_fresh_grace_and_unpresented_ones_are_reclaimed_durably() {
    let dir = shm_dir("reaper-restart");
    let mut r = open_store(dir.path(), StoreConfig::default(), GRACE_MS, 0);
    online_durable(&mut r, &fresh_header(2, 64 * MIB, 2 * MIB));
    let c = Caller::Remote { connection: 1 };
    call(
        &mut r,
        &c,
        Request::Attach {
            directory: DIR,
            handles: &[],
        },
        0,
    )
    .unwrap();
    let mut hs = Vec::new();
    for i in 0..4 {
        let req = Request::Alloc {
            target: PoolTarget::Any,
            len_bytes: 2 * MIB,
            instance: InstanceId(i),
            tag: AllocTag::NONE,
        };
        match call(&mut r, &c, req, 0).unwrap() {
            Reply::Allocated(h) => hs.push(h),
            other => panic!("{other:?}"),
        }
    }
    drop(r); // the manager dies; the directory lives on
    let mut r = open_store(dir.path(), StoreConfig::default(), GRACE_MS, 1_000);
    let s = r.manager.directory(DIR, MonotonicMs(1_000)).unwrap();
    assert_eq!(
        (s.attached_by, s.unconfirmed_regions, s.reclaim_in_ms),
        (None, 4, Some(GRACE_MS))
    );
    let c2 = Caller::Remote { connection: 1 }; // connection ids restart with the process
    let req = Request::Attach {
        directory: DIR,
        handles: &hs[1..3],
    };
    let Ok(Reply::Attached(rep)) = call(&mut r, &c2, req, 2_000) else {
        panic!()
    };
    assert_eq!((rep.verdicts.len(), rep.unconfirmed_regions), (2, 2));
    let reaped = r
        .manager
        .tick(MonotonicMs(1_000 + GRACE_MS), r.store.journal());
    r.store.commit().unwrap();
    assert_eq!(
        reaped.reclaimed.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![hs[0].region, hs[3].region]
    );
    let after = r.manager.snapshot();
    drop(r);
    let r = open_store(dir.path(), StoreConfig::default(), GRACE_MS, 0);
    assert_eq!(r.manager.snapshot(), after, "reclaims are journaled");
    assert_eq!(r.manager.snapshot().regions.len(), 2);
}

#[test]
fn the_reaper_reclaims_at_most_its_limit_per_tick() {
    let mut m = PoolManager::new(
        Secret::from_bytes([7; 32]),
        ManagerConfig { grace_ms: GRACE_MS },
    );
    let mut records = Vec::new();
    let blocks = MAX_REAP_PER_TICK as u64 + 101;
    online(
        &mut m,
        &mut records,
        &fresh_header(3, (blocks + 1) * 4 * KIB, 4 * KIB),
    );
    let c = Caller::Remote { connection: 5 };
    attach(&mut m, &c, DIR, &[], 0);
    for _ in 0..MAX_REAP_PER_TICK + 100 {
        let req = Request::Alloc {
            target: PoolTarget::Any,
            len_bytes: 4 * KIB,
            instance: InstanceId(0),
            tag: AllocTag::NONE,
        };
        m.handle(&c, req, MonotonicMs(0), &mut records).unwrap();
    }
    m.caller_gone(&c, MonotonicMs(0));
    let first = m.tick(MonotonicMs(GRACE_MS), &mut records);
    assert_eq!(
        (first.reclaimed.len(), first.more_due),
        (MAX_REAP_PER_TICK, true)
    );
    let second = m.tick(MonotonicMs(GRACE_MS), &mut records);
    assert_eq!((second.reclaimed.len(), second.more_due), (100, false));
    m.check_invariants().unwrap();
    assert_eq!(
        m.stats().pools[0].free_extents,
        1,
        "everything coalesced back"
    );
}

/// Found by the deterministic simulation: after a restart every region waits
/// for its deadline; a directory whose allocation reply was lost retries it
/// with its tag and gets the region back — which the reaper then reclaimed
/// under it, since only an attach confirmed regions. A tag retry now keeps
/// the region it returns.
#[test]
fn a_tag_retry_after_a_restart_keeps_the_region_it_returns() {
    let (mut m, mut records) = manager();
    let c = Caller::Remote { connection: 1 };
    attach(&mut m, &c, DIR, &[], 0);
    let tagged = Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: 2 * MIB,
        instance: InstanceId(3),
        tag: AllocTag(42),
    };
    let Ok(Reply::Allocated(h)) = m.handle(&c, tagged, MonotonicMs(0), &mut records) else {
        panic!("allocate");
    };
    let other = alloc(&mut m, &c, &mut records);

    // The manager restarts before the reply got out; every region waits.
    let mut m = PoolManager::restore(
        &m.snapshot(),
        Secret::from_bytes([7; 32]),
        ManagerConfig { grace_ms: GRACE_MS },
        MonotonicMs(1_000),
    )
    .unwrap();
    online(&mut m, &mut records, &fresh_header(1, 64 * MIB, 2 * MIB));
    let c = Caller::Remote { connection: 2 };
    attach(&mut m, &c, DIR, &[], 1_000);
    let again = m.handle(&c, tagged, MonotonicMs(1_100), &mut records);
    assert_eq!(
        again,
        Ok(Reply::Allocated(h)),
        "the retry gets the same region"
    );
    assert_eq!(
        m.stats().regions_pending_reclaim,
        1,
        "only the other one waits"
    );

    let reaped = m.tick(MonotonicMs(1_000 + GRACE_MS), &mut records);
    let ids: Vec<_> = reaped.reclaimed.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![other.region], "the retried region is kept");
    assert_eq!(m.snapshot().regions.len(), 1);
    m.check_invariants().unwrap();
}
