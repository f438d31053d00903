//! Bad input is refused with its own error and changes nothing: not the
//! ledger, not the directories' state, not the journal (in memory or on
//! disk).

mod pool_support;

use std::fs;

use cxlkv_controlplane::pool::journal::JOURNAL_FILE;
use cxlkv_controlplane::pool::manager::{MAX_ATTACH_HANDLES, MAX_REGION_BYTES};
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, DirectoryStatus, Handle, InstanceId, MonotonicMs, OwnerLabel,
    PoolError, PoolId, PoolTarget, Recovered, RegionId, Reply, Request, Snapshot, StatsReport,
    StoreConfig, Token,
};
use pool_support::{MIB, call, fresh_header, online_durable, open_store, shm_dir};

const A: Caller = Caller::Remote { connection: 1 };
const B: Caller = Caller::Remote { connection: 2 };
const STRANGER: Caller = Caller::Remote { connection: 3 };

struct World {
    _dir: tempfile::TempDir,
    r: Recovered,
    a: Vec<Handle>,
    b: Vec<Handle>,
    freed: Handle,
}

fn alloc(r: &mut Recovered, c: &Caller, len: u64, tag: u64) -> Handle {
    let req = Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: len,
        instance: InstanceId(tag % 2),
        tag: AllocTag(tag),
    };
    match call(r, c, req, 0).unwrap() {
        Reply::Allocated(h) => h,
        other => panic!("{other:?}"),
    }
}

fn world() -> World {
    let dir = shm_dir("security");
    let mut r = open_store(dir.path(), StoreConfig::default(), 1_000, 0);
    online_durable(&mut r, &fresh_header(1, 64 * MIB, 2 * MIB));
    call(
        &mut r,
        &A,
        Request::Attach {
            directory: DirectoryId(10),
            handles: &[],
        },
        0,
    )
    .unwrap();
    call(
        &mut r,
        &B,
        Request::Attach {
            directory: DirectoryId(20),
            handles: &[],
        },
        0,
    )
    .unwrap();
    let a = vec![alloc(&mut r, &A, 2 * MIB, 1), alloc(&mut r, &A, 4 * MIB, 2)];
    let b = vec![alloc(&mut r, &B, 2 * MIB, 1)];
    let freed = alloc(&mut r, &A, 2 * MIB, 3);
    call(&mut r, &A, Request::Free { handle: freed }, 0).unwrap();
    World {
        _dir: dir,
        r,
        a,
        b,
        freed,
    }
}

#[derive(Debug, PartialEq)]
struct Observed {
    snapshot: Snapshot,
    stats: StatsReport,
    directories: Vec<DirectoryStatus>,
    journal: Vec<u8>,
    pending: usize,
}

fn observe(w: &World) -> Observed {
    Observed {
        snapshot: w.r.manager.snapshot(),
        stats: w.r.manager.stats(),
        directories: w.r.manager.directories(MonotonicMs(0)),
        journal: fs::read(w.r.store.dir().join(JOURNAL_FILE)).unwrap(),
        pending: w.r.store.journal_ref().pending_records(),
    }
}

/// Runs `request` and checks it fails with `expected` and changes nothing.
fn refused(w: &mut World, caller: &Caller, request: Request<'_>, expected: PoolError) {
    let before = observe(w);
    let got =
        w.r.manager
            .handle(caller, request, MonotonicMs(0), w.r.store.journal());
    assert_eq!(got, Err(expected.clone()), "request {request:?}");
    assert_eq!(
        w.r.store.journal_ref().pending_records(),
        0,
        "{expected}: a record was pushed"
    );
    w.r.store.commit().unwrap();
    assert_eq!(observe(w), before, "{expected}: state changed");
}

fn with_token(h: &Handle, t: Token) -> Handle {
    Handle { token: t, ..*h }
}

#[test]
fn a_forged_token_is_refused() {
    let mut w = world();
    let h = w.a[0];
    for byte in [0, 13, 31] {
        let mut t = h.token.0;
        t[byte] ^= 0x01;
        refused(
            &mut w,
            &A,
            Request::Free {
                handle: with_token(&h, Token(t)),
            },
            PoolError::BadToken { region: h.region },
        );
    }
    let zero = with_token(&h, Token([0; 32]));
    refused(
        &mut w,
        &A,
        Request::Free { handle: zero },
        PoolError::BadToken { region: h.region },
    );
}

#[test]
fn another_regions_token_is_refused() {
    let mut w = world();
    let (h, other) = (w.a[0], w.a[1]);
    refused(
        &mut w,
        &A,
        Request::Free {
            handle: with_token(&h, other.token),
        },
        PoolError::BadToken { region: h.region },
    );
    // Moving a valid token to other fields (a bigger extent, another region
    // id, another owner) does not verify either.
    let bigger = Handle {
        len_bytes: h.len_bytes * 2,
        ..h
    };
    refused(
        &mut w,
        &A,
        Request::Free { handle: bigger },
        PoolError::BadToken { region: h.region },
    );
    let renamed = Handle {
        region: other.region,
        ..h
    };
    refused(
        &mut w,
        &A,
        Request::Free { handle: renamed },
        PoolError::BadToken {
            region: other.region,
        },
    );
    let b = w.b[0];
    let stolen = Handle {
        owner: OwnerLabel {
            directory: DirectoryId(10),
            ..b.owner
        },
        ..b
    };
    refused(
        &mut w,
        &A,
        Request::Free { handle: stolen },
        PoolError::BadToken { region: b.region },
    );
}

#[test]
fn the_wrong_owner_freeing_is_refused() {
    let mut w = world();
    let h = w.a[0];
    refused(
        &mut w,
        &B,
        Request::Free { handle: h },
        PoolError::WrongOwner {
            region: h.region,
            owner: DirectoryId(10),
            caller: DirectoryId(20),
        },
    );
    refused(
        &mut w,
        &STRANGER,
        Request::Free { handle: h },
        PoolError::NotAttached { caller: STRANGER },
    );
}

#[test]
fn a_stale_or_never_issued_region_is_refused() {
    let mut w = world();
    let freed = w.freed;
    refused(
        &mut w,
        &A,
        Request::Free { handle: freed },
        PoolError::RegionAlreadyFreed {
            region: freed.region,
        },
    );
    let never = Handle {
        region: RegionId(1_000_000),
        ..w.a[0]
    };
    refused(
        &mut w,
        &A,
        Request::Free { handle: never },
        PoolError::BadToken {
            region: never.region,
        },
    );
}

#[test]
fn bad_and_oversized_allocations_are_refused() {
    let mut w = world();
    let alloc = |len_bytes, target| Request::Alloc {
        target,
        len_bytes,
        instance: InstanceId(0),
        tag: AllocTag::NONE,
    };
    refused(&mut w, &A, alloc(0, PoolTarget::Any), PoolError::ZeroLength);
    refused(
        &mut w,
        &A,
        alloc(MAX_REGION_BYTES + 2 * MIB, PoolTarget::Any),
        PoolError::RegionTooLarge {
            len_bytes: MAX_REGION_BYTES + 2 * MIB,
            max_bytes: MAX_REGION_BYTES,
        },
    );
    refused(
        &mut w,
        &A,
        alloc(u64::MAX, PoolTarget::Any),
        PoolError::RegionTooLarge {
            len_bytes: u64::MAX,
            max_bytes: MAX_REGION_BYTES,
        },
    );
    refused(
        &mut w,
        &A,
        alloc(3 * MIB, PoolTarget::Pool(PoolId(0))),
        PoolError::LengthNotAligned {
            len_bytes: 3 * MIB,
            alignment_bytes: 2 * MIB,
            pool: Some(PoolId(0)),
        },
    );
    refused(
        &mut w,
        &A,
        alloc(3 * MIB, PoolTarget::Any),
        PoolError::LengthNotAligned {
            len_bytes: 3 * MIB,
            alignment_bytes: 2 * MIB,
            pool: None,
        },
    );
    refused(
        &mut w,
        &A,
        alloc(2 * MIB, PoolTarget::Pool(PoolId(9))),
        PoolError::UnknownPool { pool: PoolId(9) },
    );
    let largest = w.r.manager.stats().pools[0].largest_free_bytes;
    refused(
        &mut w,
        &A,
        alloc(64 * MIB, PoolTarget::Any),
        PoolError::NoSpace {
            len_bytes: 64 * MIB,
            pool: None,
            largest_free_bytes: largest,
        },
    );
    refused(
        &mut w,
        &STRANGER,
        alloc(2 * MIB, PoolTarget::Any),
        PoolError::NotAttached { caller: STRANGER },
    );
    let a0 = w.a[0];
    let reuse = Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: 8 * MIB,
        instance: InstanceId(1),
        tag: AllocTag(1),
    };
    refused(
        &mut w,
        &A,
        reuse,
        PoolError::TagReused {
            tag: AllocTag(1),
            region: a0.region,
        },
    );
}

#[test]
fn bad_attaches_are_refused() {
    let mut w = world();
    let many = vec![w.a[0]; MAX_ATTACH_HANDLES + 1];
    refused(
        &mut w,
        &A,
        Request::Attach {
            directory: DirectoryId(10),
            handles: &many,
        },
        PoolError::TooManyHandles {
            count: MAX_ATTACH_HANDLES + 1,
            max: MAX_ATTACH_HANDLES,
        },
    );
    refused(
        &mut w,
        &A,
        Request::Attach {
            directory: DirectoryId(20),
            handles: &[],
        },
        PoolError::CallerBoundElsewhere {
            caller: A,
            bound: DirectoryId(10),
            requested: DirectoryId(20),
        },
    );
    refused(
        &mut w,
        &STRANGER,
        Request::Attach {
            directory: DirectoryId(10),
            handles: &[],
        },
        PoolError::DirectoryAttachedElsewhere {
            directory: DirectoryId(10),
        },
    );
}

#[test]
fn bad_handles_presented_on_attach_are_rejected_one_by_one_and_keep_nothing() {
    let mut w = world();
    let (a0, b0, freed) = (w.a[0], w.b[0], w.freed);
    let mut forged = a0;
    forged.token.0[5] ^= 0x80;
    let before = observe(&w);
    let handles = [forged, b0, freed, a0];
    let req = Request::Attach {
        directory: DirectoryId(10),
        handles: &handles,
    };
    let Ok(Reply::Attached(report)) =
        w.r.manager
            .handle(&A, req, MonotonicMs(0), w.r.store.journal())
    else {
        panic!("a re-attach by the bound caller succeeds");
    };
    assert_eq!(
        report.verdicts,
        vec![
            Err(PoolError::BadToken { region: a0.region }),
            Err(PoolError::WrongOwner {
                region: b0.region,
                owner: DirectoryId(20),
                caller: DirectoryId(10)
            }),
            Err(PoolError::RegionAlreadyFreed {
                region: freed.region
            }),
            Ok(()),
        ]
    );
    let codes: Vec<u16> = report
        .verdicts
        .iter()
        .filter_map(|v| v.as_ref().err().map(PoolError::code))
        .collect();
    assert_eq!(codes, vec![14, 18, 16]);
    assert_eq!(
        observe(&w),
        before,
        "a live directory re-presenting handles changes nothing"
    );
}

#[test]
fn after_all_refusals_the_valid_owner_still_frees() {
    let mut w = world();
    let h = w.a[1];
    let mut bad = h;
    bad.token.0[0] ^= 1;
    refused(
        &mut w,
        &A,
        Request::Free { handle: bad },
        PoolError::BadToken { region: h.region },
    );
    let reply = call(&mut w.r, &A, Request::Free { handle: h }, 0).unwrap();
    assert_eq!(
        reply,
        Reply::Freed {
            region: h.region,
            len_bytes: h.len_bytes
        }
    );
    // A retry of the same free is told the region is already gone.
    refused(
        &mut w,
        &A,
        Request::Free { handle: h },
        PoolError::RegionAlreadyFreed { region: h.region },
    );
}
