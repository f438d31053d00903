//! One manager per state directory and per pool: a second manager is
//! refused — in the same process (a second open file description), in
//! another process (a real second `flock`), and, across hosts, by the pool
//! header's lease and epoch.

mod pool_support;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use cxlkv_controlplane::pool::fence::{FenceError, PoolFileLock};
use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::sys::new_pool_uuid;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Header, InstanceId, LeaseError, ManagerConfig, MonotonicMs,
    PoolError, PoolIdentity, PoolManager, PoolStore, PoolTarget, RecordSink, Request, Secret,
    StoreConfig, StoreError,
};
use pool_support::{MIB, fresh_header, online, open_store, shm_dir};

const HOLDER_ENV: &str = "CXLKV_TEST_LOCK_HOLDER_DIR";
const READY_MARKER: &str = "cxlkv-lock-holder-ready";
/// Bound on waiting for the lock-holder child to report in.
const CHILD_READY_TIMEOUT: Duration = Duration::from_secs(120);

/// Serializes spawning a child with dropping and retaking a lock in this
/// process. `flock` belongs to the open file description: a child forked by
/// another test thread shares every descriptor until it execs (`O_CLOEXEC`
/// only closes them at exec), so a lock dropped inside that window is still
/// held by the child for a moment and the retake is refused.
static FORK_WINDOW: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn refused_state_dir(e: StoreError) -> Option<u32> {
    match e {
        StoreError::Fence(FenceError::StateDirLocked { holder_pid, .. }) => holder_pid,
        other => panic!("expected a state-directory refusal, got {other}"),
    }
}

#[test]
fn a_second_manager_on_the_same_state_dir_in_this_process_is_refused() {
    let dir = shm_dir("fence-same");
    let _no_fork = FORK_WINDOW.lock().unwrap_or_else(|p| p.into_inner());
    let first = open_store(dir.path(), StoreConfig::default(), 1_000, 0);
    let e = PoolStore::open(
        dir.path(),
        StoreConfig::default(),
        ManagerConfig::default(),
        MonotonicMs(0),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("refusing to start a second one"),
        "{e}"
    );
    assert_eq!(refused_state_dir(e), Some(std::process::id()));
    drop(first);
    open_store(dir.path(), StoreConfig::default(), 1_000, 0);
}

/// Not a test on its own: the child process of
/// `a_second_manager_in_another_process_is_refused_until_that_process_dies`.
/// It takes the state directory and the pool file locks, says so, and holds
/// them until killed.
#[test]
#[ignore = "run as a child process by the fencing test"]
fn lock_holder_child() {
    let Some(dir) = std::env::var_os(HOLDER_ENV) else {
        eprintln!("{HOLDER_ENV} not set: nothing to hold");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let _store = open_store(&dir.join("state"), StoreConfig::default(), 1_000, 0);
    let _pool = PoolFileLock::acquire(&dir.join("pool")).expect("lock the pool file");
    // libtest prints the test name without a newline first, so the marker
    // is found anywhere in a line.
    println!("{READY_MARKER}");
    // Hold until the parent kills this process (or closes stdin).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

#[test]
fn a_second_manager_in_another_process_is_refused_until_that_process_dies() {
    let dir = shm_dir("fence-proc");
    let pool = dir.path().join("pool");
    std::fs::write(&pool, vec![0u8; 4096]).unwrap();
    let spawning = FORK_WINDOW.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "lock_holder_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLDER_ENV, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    drop(spawning);
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(READY_MARKER) {
                let _ = tx.send(());
                break;
            }
        }
    });
    if rx.recv_timeout(CHILD_READY_TIMEOUT).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the lock-holder child did not take the locks");
    }
    let e = PoolStore::open(
        &dir.path().join("state"),
        StoreConfig::default(),
        ManagerConfig::default(),
        MonotonicMs(0),
    )
    .unwrap_err();
    assert_eq!(
        refused_state_dir(e),
        Some(child.id()),
        "the refusal names the other manager's pid"
    );
    assert!(matches!(
        PoolFileLock::acquire(&pool),
        Err(FenceError::PoolFileLocked { .. })
    ));
    child.kill().unwrap();
    child.wait().unwrap();
    // The kernel dropped the locks with the process.
    open_store(&dir.path().join("state"), StoreConfig::default(), 1_000, 0);
    PoolFileLock::acquire(&pool).unwrap();
}

fn decoded(block: &[u8]) -> Header {
    match header::decode(block).unwrap() {
        BlockState::Initialised(h) => h,
        BlockState::Fresh => panic!("fresh"),
    }
}

/// The driver's opening sequence over a pool's first block (what the
/// service glue will do over the mapped block): initialise if fresh, check
/// the lease, take the epoch, write the lease, go online.
fn open_on_block(
    m: &mut PoolManager,
    sink: &mut impl RecordSink,
    block: &mut [u8],
    size: u64,
    align: u64,
    wall_ms: u64,
    lease_ms: u64,
) -> Result<(header::ManagerLease, cxlkv_controlplane::pool::PoolId), String> {
    if header::decode(block).map_err(|e| e.to_string())? == BlockState::Fresh {
        let uuid = new_pool_uuid().unwrap();
        header::encode_identity(
            block,
            &PoolIdentity {
                uuid,
                size_bytes: size,
                alignment_bytes: align,
            },
        )
        .map_err(|e| e.to_string())?;
    }
    let h = decoded(block);
    header::verify(&h, size, align).map_err(|e| e.to_string())?;
    header::check_takeover(&h, m.manager_id(), wall_ms).map_err(|e| e.to_string())?;
    let opened = m.open_pool(&h, sink).map_err(|e| e.to_string())?;
    let lease = header::new_lease(&h, m.manager_id(), opened.epoch, wall_ms, lease_ms);
    header::write_lease(block, &lease).map_err(|e| e.to_string())?;
    m.mark_online(opened.pool, opened.epoch)
        .map_err(|e| e.to_string())?;
    Ok((lease, opened.pool))
}

fn alloc(m: &mut PoolManager) -> Result<(), PoolError> {
    let c = Caller::Remote { connection: 1 };
    let attach = Request::Attach {
        directory: DirectoryId(1),
        handles: &[],
    };
    m.handle(&c, attach, MonotonicMs(0), &mut Vec::new())?;
    let req = Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: 2 * MIB,
        instance: InstanceId(0),
        tag: AllocTag::NONE,
    };
    m.handle(&c, req, MonotonicMs(0), &mut Vec::new())
        .map(|_| ())
}

#[test]
fn a_manager_on_another_host_is_refused_while_the_lease_runs_and_the_old_one_learns_it_was_superseded()
 {
    const LEASE_MS: u64 = 10_000;
    let (size, align) = (64 * MIB, 2 * MIB);
    let mut block = vec![0u8; 4096];
    let mut a = PoolManager::new(Secret::from_bytes([1; 32]), ManagerConfig::default());
    let (lease_a, pool) = open_on_block(
        &mut a,
        &mut Vec::new(),
        &mut block,
        size,
        align,
        1_000_000,
        LEASE_MS,
    )
    .unwrap();
    assert_eq!((lease_a.epoch, lease_a.holder), (1, a.manager_id()));
    alloc(&mut a).unwrap();

    // Manager B on another host: a copy of A's state (it knows the pool),
    // its own secret. While A's lease runs, B refuses to start.
    let mut b = PoolManager::restore(
        &a.snapshot(),
        Secret::from_bytes([2; 32]),
        ManagerConfig::default(),
        MonotonicMs(0),
    )
    .unwrap();
    let e = open_on_block(
        &mut b,
        &mut Vec::new(),
        &mut block,
        size,
        align,
        1_000_000 + LEASE_MS - 1,
        LEASE_MS,
    )
    .unwrap_err();
    assert!(
        e.contains("Another pool manager already serves this pool"),
        "{e}"
    );

    // A stops renewing (paused, partitioned); after expiry B takes over with
    // a higher epoch.
    let (lease_b, _) = open_on_block(
        &mut b,
        &mut Vec::new(),
        &mut block,
        size,
        align,
        1_000_000 + LEASE_MS,
        LEASE_MS,
    )
    .unwrap();
    assert_eq!(lease_b.epoch, 2);
    // A wakes up and renews: it finds B's lease, fences itself off the pool.
    match header::renew(
        &decoded(&block),
        &lease_a,
        1_000_000 + LEASE_MS + 1,
        LEASE_MS,
    ) {
        Err(LeaseError::Superseded {
            epoch: 2, mine: 1, ..
        }) => a.mark_offline(pool).unwrap(),
        other => panic!("A must learn it was superseded, got {other:?}"),
    }
    assert_eq!(alloc(&mut a), Err(PoolError::NoOnlinePool));
    alloc(&mut b).unwrap();
}

#[test]
fn a_pool_served_by_a_manager_this_state_does_not_know_is_refused() {
    let mut block = vec![0u8; 4096];
    let mut other = PoolManager::new(Secret::from_bytes([3; 32]), ManagerConfig::default());
    open_on_block(
        &mut other,
        &mut Vec::new(),
        &mut block,
        64 * MIB,
        2 * MIB,
        0,
        1,
    )
    .unwrap();
    let mut fresh = PoolManager::new(Secret::from_bytes([4; 32]), ManagerConfig::default());
    let h = decoded(&block);
    let e = fresh.open_pool(&h, &mut Vec::new()).unwrap_err();
    assert!(matches!(e, PoolError::ForeignPool { epoch: 1, .. }), "{e}");
    // A header initialised but never leased (a crash before the first
    // journal commit) is safe to adopt.
    let unleased = fresh_header(9, 64 * MIB, 2 * MIB);
    assert_eq!(
        fresh.open_pool(&unleased, &mut Vec::new()).unwrap().epoch,
        1
    );
}

#[test]
fn reopening_raises_the_epoch_and_a_header_ahead_of_the_ledger_is_refused() {
    let dir = shm_dir("epoch");
    // Reopens its state directory: no fork may share the lock meanwhile.
    let _no_fork = FORK_WINDOW.lock().unwrap_or_else(|p| p.into_inner());
    let mut block = vec![0u8; 4096];
    let mut r = open_store(dir.path(), StoreConfig::default(), 1_000, 0);
    let (l1, pool) = open_on_block(
        &mut r.manager,
        r.store.journal(),
        &mut block,
        64 * MIB,
        2 * MIB,
        0,
        1,
    )
    .unwrap();
    r.store.commit().unwrap();
    assert_eq!(l1.epoch, 1);
    drop(r);
    // Restarted: the same state directory takes its own pool back at once
    // (its own lease, even unexpired) with the next epoch.
    let mut r = open_store(dir.path(), StoreConfig::default(), 1_000, 0);
    let (l2, same) = open_on_block(
        &mut r.manager,
        r.store.journal(),
        &mut block,
        64 * MIB,
        2 * MIB,
        0,
        1_000_000,
    )
    .unwrap();
    r.store.commit().unwrap();
    assert_eq!((l2.epoch, l2.seq, same), (2, 2, pool));
    drop(r);
    let mut r = open_store(dir.path(), StoreConfig::default(), 1_000, 0);
    assert_eq!(
        r.manager.pool(pool).unwrap().epoch,
        2,
        "the epoch is durable"
    );
    // A header that went further (another host's manager served the pool
    // since, or this state directory is an older copy) is refused: regions
    // may exist that this ledger does not know.
    let mut h = decoded(&block);
    let current = h.lease.unwrap();
    for holder in [current.holder, cxlkv_controlplane::pool::ManagerId([9; 16])] {
        h.lease = Some(header::ManagerLease {
            epoch: 7,
            holder,
            ..current
        });
        assert_eq!(
            r.manager.open_pool(&h, r.store.journal()).unwrap_err(),
            PoolError::StaleLedger {
                pool,
                ledger_epoch: 2,
                header_epoch: 7
            }
        );
    }
    h.lease = Some(current);
    assert_eq!(r.manager.open_pool(&h, r.store.journal()).unwrap().epoch, 3);
    assert_eq!(
        r.manager.mark_online(pool, 2),
        Err(PoolError::EpochMismatch {
            pool,
            expected: 3,
            given: 2
        })
    );
    r.manager.mark_online(pool, 3).unwrap();
    assert_eq!(
        r.manager.open_pool(&h, r.store.journal()),
        Err(PoolError::PoolAlreadyOnline { pool })
    );
}

#[test]
fn a_pool_whose_geometry_changed_is_refused() {
    let mut m = PoolManager::new(Secret::from_bytes([5; 32]), ManagerConfig::default());
    let mut records = Vec::new();
    let pool = online(&mut m, &mut records, &fresh_header(1, 64 * MIB, 2 * MIB));
    m.mark_offline(pool).unwrap();
    let grown = fresh_header(1, 128 * MIB, 2 * MIB);
    assert!(matches!(
        m.open_pool(&grown, &mut records),
        Err(PoolError::PoolMismatch { .. })
    ));
    // And at the header level, before the manager is asked.
    let h = fresh_header(1, 64 * MIB, 2 * MIB);
    assert!(header::verify(&h, 128 * MIB, 2 * MIB).is_err());
}
