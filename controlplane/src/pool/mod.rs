//! The pool manager: hands out regions of shared-memory pools to
//! directories, and never loses or duplicates one across crashes.
//!
//! A *pool* is a device or file (the dataplane's backing) carved into
//! *regions*: contiguous extents aligned to the pool's alignment, allocated
//! first-fit, identified by ids that are never reused. Each region is owned by
//! a directory (and labelled with one of that directory's client instances);
//! the [`Handle`] the directory receives carries a [`Token`], a keyed hash
//! that proves ownership when the region is freed or reclaimed after a
//! restart. A directory that dies and does not come back within a grace period
//! loses its regions to the reaper.
//!
//! The code is cut the way DESIGN §2 asks — logic without I/O, drivers
//! around it:
//!
//! | module | what | I/O |
//! |---|---|---|
//! | [`manager`] | [`PoolManager`]: requests, directories, reaper, pools | none |
//! | [`ledger`] | the durable state and [`Record`] application; invariants | none |
//! | `tag_answers` | answers of each directory's recent tagged allocations (exactly-once retries) | none |
//! | [`extents`] | free extents with O(log n) first fit | none |
//! | [`record`], [`checkpoint`], [`header`] | byte codecs: journal records, checkpoint images, pool identity header | none |
//! | [`token`] | keyed-BLAKE3 region tokens | none |
//! | [`journal`] | the write-ahead journal file and its recovery | files |
//! | [`store`] | the state directory: secret, checkpoints, recovery | files |
//! | [`io_faults`] | injected storage failures for tests (feature `fault-injection`) | none |
//! | [`fence`] | `flock` on the state directory and the pool file | files |
//! | [`liveness`] | local directory processes via `/proc/<pid>/stat` | `/proc` |
//! | [`sys`] | `getrandom`, directory `fsync`, `flock` | syscalls |
//! | [`service`] | the driver: core thread (commit, release, timers), pools and leases, wire handler, in-process and remote sessions ([`service::PoolService`]) | files, sockets, mappings |
//!
//! A driver (the service, or a test) runs the loop:
//!
//! ```text
//! let Recovered { mut store, mut manager, .. } = PoolStore::open(dir, cfg, mcfg, now)?;
//! // per request, from `caller` (SO_PEERCRED + liveness::identify, or a connection id):
//! let result = manager.handle(&caller, request, now, store.journal());
//! if store.commit_due() { store.commit()?; }   // per-record, or when a group is full
//! // ... when no request is ready: store.commit()?; then release held replies in order
//! if store.checkpoint_due() { store.checkpoint(&manager)?; }
//! // on a timer: manager.tick(now, store.journal()); probe manager.local_callers();
//! // on a closed connection or a dead process: manager.caller_gone(&caller, now);
//! ```
//!
//! Invariants the whole module keeps: a reply is released only after every
//! record pushed before it is durable; a failed request changes nothing
//! durable (a tagged allocation's answer is remembered, in memory, so that
//! its retries get the same one); the
//! ledger only changes through [`Record`]s, identically live and in replay;
//! recovery yields exactly the committed prefix of the journal on top of the
//! last installed checkpoint, or refuses to start with a message naming the
//! file and the reason.

/// For a state file's error type with `Io` and `NoSpace` variants of the
/// same fields (`op`, `path`, `source`): `fn io` (`NoSpace` when the file
/// system is full, [`journal::is_out_of_space`]) and, in the calling
/// module, `fn io_err(op, path)` making one from an `io::Error` (for
/// `map_err`). Shared by the journal, the store and the names file.
macro_rules! io_errors {
    ($error:ident) => {
        impl $error {
            /// `Io`, or `NoSpace` when `source` says the file system is full.
            fn io(op: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
                let path = path.to_path_buf();
                if $crate::pool::journal::is_out_of_space(&source) {
                    Self::NoSpace { op, path, source }
                } else {
                    Self::Io { op, path, source }
                }
            }
        }

        fn io_err<'a>(
            op: &'static str,
            path: &'a std::path::Path,
        ) -> impl FnOnce(std::io::Error) -> $error + 'a {
            move |source| $error::io(op, path, source)
        }
    };
}

pub mod checkpoint;
pub mod extents;
pub mod fence;
pub mod header;
pub mod io_faults;
pub mod journal;
pub mod ledger;
pub mod liveness;
pub mod manager;
pub mod record;
pub mod service;
pub mod store;
pub mod sys;
mod tag_answers;
pub mod token;
pub mod types;

pub use header::{BlockState, Header, HeaderError, LeaseError, ManagerLease, PoolIdentity};
pub use journal::{CommitReport, Journal, JournalError};
pub use ledger::{InvariantError, LedgerError, PoolInfo, Snapshot};
pub use manager::{
    AttachReport, DirectoryStatus, ManagerConfig, OpenedPool, PoolError, PoolManager, PoolStats,
    PoolTarget, ReapReport, RecordSink, Reply, Request, StatsReport, TAG_ANSWERS_PER_DIRECTORY,
};
pub use record::Record;
pub use store::{PoolStore, Recovered, RecoveryReport, StoreConfig, StoreError, SyncPolicy};
pub use token::Secret;
pub use types::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerId, MonotonicMs, OwnerLabel, PoolId,
    PoolUuid, ProcessIdentity, RegionId, RegionRecord, Token,
};
