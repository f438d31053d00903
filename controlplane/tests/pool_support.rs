//! Helpers shared by the `pool_*` integration tests (included with `mod
//! pool_support;`). Built on its own as well, where it holds no tests.
#![allow(dead_code)]

use std::path::Path;

use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Header, InstanceId, ManagerConfig, MonotonicMs, PoolId,
    PoolIdentity, PoolManager, PoolStore, PoolTarget, PoolUuid, RecordSink, Recovered, Reply,
    Request, Snapshot, StoreConfig,
};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// A unique temporary directory under `/dev/shm`, removed on drop.
pub fn shm_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cxlkv-{name}-"))
        .tempdir_in("/dev/shm")
        .expect("create a temporary directory under /dev/shm")
}

/// The header a fresh pool gets once its identity is written.
pub fn fresh_header(uuid: u8, size_bytes: u64, alignment_bytes: u64) -> Header {
    let mut block = vec![0u8; 4096];
    let identity = PoolIdentity {
        uuid: PoolUuid([uuid; 16]),
        size_bytes,
        alignment_bytes,
    };
    header::encode_identity(&mut block, &identity).expect("encode a fresh header");
    match header::decode(&block).expect("decode what was just encoded") {
        BlockState::Initialised(h) => h,
        BlockState::Fresh => unreachable!("an identity was written"),
    }
}

/// Opens and brings online a pool in a manager without a store (records are
/// collected in `sink`).
pub fn online(manager: &mut PoolManager, sink: &mut impl RecordSink, h: &Header) -> PoolId {
    let opened = manager.open_pool(h, sink).expect("open pool");
    manager
        .mark_online(opened.pool, opened.epoch)
        .expect("mark online");
    opened.pool
}

pub fn open_store(dir: &Path, config: StoreConfig, grace_ms: u64, now: u64) -> Recovered {
    PoolStore::open(dir, config, ManagerConfig { grace_ms }, MonotonicMs(now))
        .expect("open the state directory")
}

/// Opens a pool through a store and commits its records.
pub fn online_durable(r: &mut Recovered, h: &Header) -> PoolId {
    let opened = r
        .manager
        .open_pool(h, r.store.journal())
        .expect("open pool");
    r.store.commit().expect("commit pool records");
    r.manager
        .mark_online(opened.pool, opened.epoch)
        .expect("mark online");
    opened.pool
}

/// One request through the manager, committed before the reply is returned
/// (per-record durability), checkpointing when due.
pub fn call(
    r: &mut Recovered,
    caller: &Caller,
    request: Request<'_>,
    now: u64,
) -> Result<Reply, cxlkv_controlplane::pool::PoolError> {
    let reply = r
        .manager
        .handle(caller, request, MonotonicMs(now), r.store.journal());
    r.store.commit().expect("commit");
    if r.store.checkpoint_due() {
        r.store.checkpoint(&r.manager).expect("checkpoint");
    }
    reply
}

/// A store (a checkpoint only when asked for) with a pool online, one
/// directory attached and `n` allocations of 2 MiB committed one by one,
/// and its state.
pub fn store_with_regions(dir: &Path, n: u64) -> (Recovered, Snapshot) {
    let mut r = open_store(
        dir,
        StoreConfig {
            checkpoint_every_records: 1 << 20,
            ..Default::default()
        },
        1_000,
        0,
    );
    online_durable(&mut r, &fresh_header(3, 64 * MIB, 2 * MIB));
    let c = Caller::Remote { connection: 1 };
    call(
        &mut r,
        &c,
        Request::Attach {
            directory: DirectoryId(1),
            handles: &[],
        },
        0,
    )
    .unwrap();
    for i in 0..n {
        call(&mut r, &c, alloc_request(i), 0).unwrap();
    }
    let snap = r.manager.snapshot();
    assert_eq!(snap.regions.len() as u64, n);
    (r, snap)
}

/// An untagged 2 MiB allocation for instance `i`, from any pool.
pub fn alloc_request(i: u64) -> Request<'static> {
    Request::Alloc {
        target: PoolTarget::Any,
        len_bytes: 2 * MIB,
        instance: InstanceId(i),
        tag: AllocTag::NONE,
    }
}
