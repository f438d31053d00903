//! The state directory: where the pool manager's durable state lives, and
//! the recovery that turns it back into a [`PoolManager`] (I/O).
//!
//! ```text
//! <state dir>/lock             flock: one manager per state directory (fence)
//! <state dir>/secret           32 random bytes, mode 0600: the token key
//! <state dir>/checkpoint       the ledger as of some sequence number
//! <state dir>/checkpoint.tmp   a checkpoint being written (removed at start)
//! <state dir>/journal          records after the checkpoint
//! <state dir>/journal.dropped.<offset>.<n>  torn tails cut off by recovery
//! ```
//!
//! [`PoolStore::open`]: lock the directory; remove a leftover
//! `checkpoint.tmp`; load the checkpoint (if any); recover the journal on top
//! of it (skip what the checkpoint covers, replay the rest, cut a torn tail);
//! verify every ledger invariant; load the secret — or create it if there is
//! none and no region exists (`O_EXCL`, 0600, synced), or refuse if regions
//! exist without it (their tokens could not be checked, and a new secret
//! would invalidate every handle out there); then build the manager, every
//! directory gone and every region under a fresh grace period.
//!
//! Checkpoint ([`PoolStore::checkpoint`], every `checkpoint_every_records`
//! committed records), in three steps that are also public so that tests can
//! crash between them:
//! 1. [`PoolStore::stage_checkpoint`]: the ledger as of the last committed
//!    sequence number is written to `checkpoint.tmp` and synced.
//! 2. [`PoolStore::install_checkpoint`]: renamed over `checkpoint`; the
//!    directory is synced.
//! 3. [`PoolStore::restart_journal`]: the journal is truncated to its header
//!    and synced — only if it holds nothing beyond the installed checkpoint.
//!
//! A crash anywhere leaves a recoverable directory: before step 2 completes,
//! the old checkpoint and the full journal are there (the temporary file is
//! ignored and removed); after step 2, the new checkpoint and a journal whose
//! records up to its sequence number are skipped by seq; after step 3, the new
//! checkpoint and an empty journal. No record is ever applied twice and none
//! is lost. Every I/O failure is fail-stop: the store poisons itself and the
//! driver must exit; the next start recovers.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::checkpoint::{self, CheckpointError};
use super::fence::{FenceError, StateDirLock};
use super::io_faults::{IoFaults, IoSite};
use super::journal::{
    BoundedReadError, CommitReport, Journal, JournalError, ScanReport, Stop, read_bounded,
};
use super::ledger::{InvariantError, Ledger, LedgerError};
use super::manager::{ManagerConfig, PoolManager};
use super::sys::{check_state_dir, fsync_dir, random_bytes};
use super::token::{SECRET_BYTES, Secret};
use super::types::MonotonicMs;

pub const SECRET_FILE: &str = "secret";
pub const CHECKPOINT_FILE: &str = "checkpoint";
pub const CHECKPOINT_TMP_FILE: &str = "checkpoint.tmp";
/// Largest group a driver may accumulate before it must commit.
pub const MAX_GROUP_RECORDS: usize = 4096;
/// Largest `checkpoint_every_records`: the journal between two checkpoints
/// (plus the group and reaping a commit may add past the interval) stays
/// within what recovery reads (`MAX_JOURNAL_BYTES`), so a start never
/// refuses a journal the running manager wrote.
pub const MAX_CHECKPOINT_EVERY_RECORDS: u64 =
    (super::journal::MAX_JOURNAL_BYTES / super::record::MAX_RECORD_BYTES as u64) / 2;

// The refusals in `StoreConfig::validate` spell the bounds out (an operator
// reads them, not the constants' names).
const _: () = assert!(
    MAX_CHECKPOINT_EVERY_RECORDS == 6_710_886 && MAX_GROUP_RECORDS == 4096,
    "update the bounds in StoreConfig::validate's messages"
);

/// When the driver commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Commit (`fdatasync`) after every request that pushed records.
    PerRecord,
    /// Let records of several requests accumulate and commit them with one
    /// sync: when `max_batch_records` are pending (≤ [`MAX_GROUP_RECORDS`]),
    /// or when the driver has no more requests ready.
    Group { max_batch_records: usize },
}

/// Durability tunables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    pub sync: SyncPolicy,
    /// Committed records between checkpoints (≥ 1).
    pub checkpoint_every_records: u64,
}

impl StoreConfig {
    /// The checks [`PoolStore::open`] makes before it touches anything.
    pub fn validate(&self) -> Result<(), StoreError> {
        if !(1..=MAX_CHECKPOINT_EVERY_RECORDS).contains(&self.checkpoint_every_records) {
            return Err(StoreError::Config(
                "checkpoint_every_records must be in 1..=6710886 (the journal between two \
                 checkpoints stays within what recovery reads)",
            ));
        }
        if let SyncPolicy::Group { max_batch_records } = self.sync
            && !(1..=MAX_GROUP_RECORDS).contains(&max_batch_records)
        {
            return Err(StoreError::Config("max_batch_records must be in 1..=4096"));
        }
        Ok(())
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            sync: SyncPolicy::PerRecord,
            checkpoint_every_records: 4096,
        }
    }
}

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("checkpoint {} is unusable ({source}); refusing to start", path.display())]
    CorruptCheckpoint {
        path: PathBuf,
        source: CheckpointError,
    },
    #[error(
        "checkpoint {} is a {file_type}, not a regular file (a device or FIFO there would be read forever, or block the start); refusing to start",
        path.display()
    )]
    CheckpointNotRegularFile {
        path: PathBuf,
        file_type: &'static str,
    },
    #[error("checkpoint {} is inconsistent ({source}); refusing to start", path.display())]
    InconsistentCheckpoint { path: PathBuf, source: LedgerError },
    #[error("recovered state of {} is inconsistent; refusing to start: {source}", dir.display())]
    Invariant {
        dir: PathBuf,
        source: InvariantError,
    },
    #[error(
        "secret file {} is missing but {regions} regions exist: their tokens cannot be verified. Restore the secret file (mode 0600) from a backup; refusing to start",
        path.display()
    )]
    SecretMissing { path: PathBuf, regions: usize },
    #[error("secret file {} is unusable ({reason}); refusing to start", path.display())]
    SecretInvalid { path: PathBuf, reason: String },
    #[error(
        "secret file {} has mode {mode:o}: readable or writable by group or others; run `chmod 600` on it. Refusing to start",
        path.display()
    )]
    SecretPermissions { path: PathBuf, mode: u32 },
    #[error("{source}; refusing to start")]
    StateDirUnsafe { dir: PathBuf, source: io::Error },
    #[error("invalid store configuration: {0}")]
    Config(&'static str),
    #[error("{pending} journal records are not committed; commit before checkpointing")]
    Uncommitted { pending: usize },
    #[error(
        "the journal (seq {journal_seq}) is ahead of the installed checkpoint (seq {checkpoint_seq}); not restarting it"
    )]
    JournalAhead {
        checkpoint_seq: u64,
        journal_seq: u64,
    },
    #[error("the store failed an earlier write or sync; the pool manager must restart to recover")]
    Poisoned,
    #[error(
        "cannot {op} {}: the file system holding it is full ({source}); the pool manager writes this before it serves anything, so it stops or refuses to start. Free space on that file system (the pools and their regions are untouched) and start it again",
        path.display()
    )]
    NoSpace {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

io_errors!(StoreError);

/// A torn tail recovery cut off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedTail {
    pub stop: Stop,
    /// Where the tail was kept; `None` when every name for its offset was
    /// taken (it was only logged).
    pub saved_to: Option<PathBuf>,
}

/// What recovery found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    pub checkpoint_loaded: bool,
    pub scan: ScanReport,
    pub dropped: Option<DroppedTail>,
    pub stale_checkpoint_tmp_removed: bool,
    pub secret_created: bool,
    pub pools: usize,
    pub regions: usize,
}

/// A checkpoint written to the temporary file, not yet installed.
#[derive(Debug)]
#[must_use = "a staged checkpoint does nothing until it is installed"]
pub struct StagedCheckpoint {
    seq: u64,
    len_bytes: usize,
}

impl StagedCheckpoint {
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// What a checkpoint did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointReport {
    pub seq: u64,
    pub len_bytes: usize,
}

/// A freshly opened store and the manager recovered from it.
#[derive(Debug)]
pub struct Recovered {
    pub store: PoolStore,
    pub manager: PoolManager,
    pub report: RecoveryReport,
}

/// An open, locked state directory. See the module essay.
#[derive(Debug)]
pub struct PoolStore {
    dir: PathBuf,
    _lock: StateDirLock,
    journal: Journal,
    config: StoreConfig,
    /// Sequence number covered by the installed checkpoint.
    checkpoint_seq: u64,
    poisoned: bool,
    faults: IoFaults,
}

impl PoolStore {
    /// Opens (creating if needed, mode 0700) and recovers the state directory
    /// `dir` at `now`. See the module essay.
    pub fn open(
        dir: &Path,
        config: StoreConfig,
        manager_config: ManagerConfig,
        now: MonotonicMs,
    ) -> Result<Recovered, StoreError> {
        Self::open_with_io_faults(dir, config, manager_config, now, IoFaults::default())
    }

    /// [`PoolStore::open`], with storage failures injected into recovery's
    /// writes that are sites ([`super::io_faults`]) and into everything the
    /// store writes after (as [`PoolStore::set_io_faults`]).
    pub fn open_with_io_faults(
        dir: &Path,
        config: StoreConfig,
        manager_config: ManagerConfig,
        now: MonotonicMs,
        faults: IoFaults,
    ) -> Result<Recovered, StoreError> {
        config.validate()?;
        create_dir(dir)?;
        check_state_dir(dir).map_err(|source| StoreError::StateDirUnsafe {
            dir: dir.to_path_buf(),
            source,
        })?;
        let lock = StateDirLock::acquire(dir)?;

        let tmp = dir.join(CHECKPOINT_TMP_FILE);
        let stale_checkpoint_tmp_removed = match fs::remove_file(&tmp) {
            Ok(()) => {
                tracing::info!(path = %tmp.display(), "removed an unfinished checkpoint");
                fsync_dir(dir).map_err(io_err("fsync", dir))?;
                true
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_err("remove", &tmp)(e)),
        };

        let ckpt_path = dir.join(CHECKPOINT_FILE);
        let (checkpoint_loaded, checkpoint_seq, mut ledger) = match read_checkpoint(&ckpt_path)? {
            Some(image) => {
                let (seq, snapshot) =
                    checkpoint::decode(&image).map_err(|source| StoreError::CorruptCheckpoint {
                        path: ckpt_path.clone(),
                        source,
                    })?;
                let ledger = Ledger::from_snapshot(&snapshot).map_err(|source| {
                    StoreError::InconsistentCheckpoint {
                        path: ckpt_path.clone(),
                        source,
                    }
                })?;
                // A rename a crash left unsynced must be durable before the
                // journal is cut to what this checkpoint covers: after a
                // power loss the old checkpoint could otherwise come back
                // next to a journal that no longer holds its records.
                fsync_dir(dir).map_err(io_err("fsync", dir))?;
                (true, seq, ledger)
            }
            None => (false, 0, Ledger::new()),
        };

        let (journal, scan, saved) =
            Journal::recover(dir, checkpoint_seq, checkpoint_loaded, &faults, |r| {
                ledger.apply(r)
            })?;
        ledger.verify().map_err(|source| StoreError::Invariant {
            dir: dir.to_path_buf(),
            source,
        })?;

        let (secret, secret_created) = load_or_create_secret(dir, ledger.region_count())?;
        let report = RecoveryReport {
            checkpoint_loaded,
            scan,
            dropped: scan.stop.map(|stop| DroppedTail {
                stop,
                saved_to: saved,
            }),
            stale_checkpoint_tmp_removed,
            secret_created,
            pools: ledger.pools().count(),
            regions: ledger.region_count(),
        };
        let manager = PoolManager::from_ledger(ledger, secret, manager_config, now);
        manager
            .check_invariants()
            .map_err(|source| StoreError::Invariant {
                dir: dir.to_path_buf(),
                source,
            })?;
        tracing::info!(
            dir = %dir.display(),
            checkpoint_seq,
            replayed = scan.replayed,
            skipped = scan.skipped,
            dropped_bytes = scan.stop.map_or(0, |s| s.dropped_bytes),
            pools = report.pools,
            regions = report.regions,
            "pool manager state recovered"
        );
        let store = Self {
            dir: dir.to_path_buf(),
            _lock: lock,
            journal,
            config,
            checkpoint_seq,
            poisoned: false,
            faults,
        };
        Ok(Recovered {
            store,
            manager,
            report,
        })
    }

    /// Storage failures to inject into this store's journal and checkpoint
    /// writes (feature `fault-injection`; [`super::io_faults`]).
    pub fn set_io_faults(&mut self, faults: IoFaults) {
        self.journal.set_io_faults(faults.clone());
        self.faults = faults;
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// The journal: the [`super::RecordSink`] to pass to the manager.
    pub fn journal(&mut self) -> &mut Journal {
        &mut self.journal
    }

    pub fn journal_ref(&self) -> &Journal {
        &self.journal
    }

    /// True when the sync policy asks for a commit now (the driver also
    /// commits whenever it runs out of ready requests).
    pub fn commit_due(&self) -> bool {
        let pending = self.journal.pending_records();
        match self.config.sync {
            SyncPolicy::PerRecord => pending > 0,
            SyncPolicy::Group { max_batch_records } => pending >= max_batch_records,
        }
    }

    /// Makes every pushed record durable; replies held for them may go.
    pub fn commit(&mut self) -> Result<CommitReport, StoreError> {
        if self.poisoned {
            return Err(StoreError::Poisoned);
        }
        self.journal.commit().map_err(|e| {
            self.poisoned = true;
            StoreError::from(e)
        })
    }

    /// True when enough records were committed since the last checkpoint.
    pub fn checkpoint_due(&self) -> bool {
        self.journal.records_since_checkpoint() >= self.config.checkpoint_every_records
    }

    /// Stages, installs and restarts the journal (the three steps of the
    /// module essay). Every pushed record must be committed first.
    pub fn checkpoint(&mut self, manager: &PoolManager) -> Result<CheckpointReport, StoreError> {
        let staged = self.stage_checkpoint(manager)?;
        let report = CheckpointReport {
            seq: staged.seq,
            len_bytes: staged.len_bytes,
        };
        self.install_checkpoint(staged)?;
        self.restart_journal()?;
        Ok(report)
    }

    /// Step 1: writes and syncs `checkpoint.tmp` with the manager's ledger
    /// as of the last committed record.
    pub fn stage_checkpoint(
        &mut self,
        manager: &PoolManager,
    ) -> Result<StagedCheckpoint, StoreError> {
        self.usable()?;
        let pending = self.journal.pending_records();
        if pending > 0 {
            return Err(StoreError::Uncommitted { pending });
        }
        let seq = self.journal.committed_seq();
        let image = checkpoint::encode(seq, &manager.ledger().snapshot());
        let tmp = self.dir.join(CHECKPOINT_TMP_FILE);
        let written = (|| {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(&tmp)?;
            self.faults
                .write_all_at(IoSite::CheckpointWrite, &f, &image, 0)?;
            self.faults.op(IoSite::CheckpointSync, || f.sync_all())
        })();
        self.fail_stop(written, "write", &tmp)?;
        Ok(StagedCheckpoint {
            seq,
            len_bytes: image.len(),
        })
    }

    /// Step 2: atomically replaces the checkpoint and syncs the directory.
    pub fn install_checkpoint(&mut self, staged: StagedCheckpoint) -> Result<(), StoreError> {
        self.usable()?;
        let tmp = self.dir.join(CHECKPOINT_TMP_FILE);
        let path = self.dir.join(CHECKPOINT_FILE);
        let renamed = self
            .faults
            .op(IoSite::CheckpointRename, || fs::rename(&tmp, &path));
        self.fail_stop(renamed, "rename", &tmp)?;
        let synced = self
            .faults
            .op(IoSite::StateDirSync, || fsync_dir(&self.dir));
        let dir = self.dir.clone();
        self.fail_stop(synced, "fsync", &dir)?;
        self.checkpoint_seq = staged.seq;
        Ok(())
    }

    /// Step 3: empties the journal, if the installed checkpoint covers all of
    /// it.
    pub fn restart_journal(&mut self) -> Result<(), StoreError> {
        self.usable()?;
        let journal_seq = self.journal.committed_seq();
        if self.journal.pending_records() > 0 || journal_seq != self.checkpoint_seq {
            return Err(StoreError::JournalAhead {
                checkpoint_seq: self.checkpoint_seq,
                journal_seq,
            });
        }
        self.journal.restart().map_err(|e| {
            self.poisoned = true;
            StoreError::from(e)
        })
    }

    fn usable(&self) -> Result<(), StoreError> {
        if self.poisoned || self.journal.is_poisoned() {
            Err(StoreError::Poisoned)
        } else {
            Ok(())
        }
    }

    fn fail_stop<T>(
        &mut self,
        r: io::Result<T>,
        op: &'static str,
        path: &Path,
    ) -> Result<T, StoreError> {
        r.map_err(|source| {
            self.poisoned = true;
            self.journal.poison();
            StoreError::io(op, path, source)
        })
    }
}

/// The checkpoint's bytes, `None` if there is none. A file larger than any
/// ledger encodes to is refused before it is read (a garbage file of any
/// size would otherwise be read whole into memory).
/// (Read as the journal is: opened without blocking, a regular file only,
/// the read itself bounded — `journal::read_bounded`.)
fn read_checkpoint(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    match read_bounded(path, checkpoint::MAX_CHECKPOINT_BYTES) {
        Ok(image) => Ok(Some(image)),
        Err(BoundedReadError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(BoundedReadError::Io { op, source }) => Err(io_err(op, path)(source)),
        Err(BoundedReadError::NotRegularFile { file_type }) => {
            Err(StoreError::CheckpointNotRegularFile {
                path: path.to_path_buf(),
                file_type,
            })
        }
        Err(BoundedReadError::TooLarge {
            len_bytes,
            max_bytes,
        }) => Err(StoreError::CorruptCheckpoint {
            path: path.to_path_buf(),
            source: checkpoint::CheckpointError::TooLarge {
                len_bytes,
                max_bytes,
            },
        }),
    }
}

fn create_dir(dir: &Path) -> Result<(), StoreError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(StoreError::Io {
            op: "use as a state directory",
            path: dir.to_path_buf(),
            source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io_err("create", dir))?;
            if let Some(parent) = dir.parent() {
                fsync_dir(parent).map_err(io_err("fsync", parent))?;
            }
            Ok(())
        }
        Err(e) => Err(io_err("stat", dir)(e)),
    }
}

fn load_or_create_secret(dir: &Path, regions: usize) -> Result<(Secret, bool), StoreError> {
    let path = dir.join(SECRET_FILE);
    let invalid = |reason: String| StoreError::SecretInvalid {
        path: path.clone(),
        reason,
    };
    match fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if regions > 0 {
                return Err(StoreError::SecretMissing { path, regions });
            }
            return create_secret(dir, &path).map(|s| (s, true));
        }
        Err(e) => return Err(io_err("stat", &path)(e)),
        Ok(m) if !m.file_type().is_file() => {
            return Err(invalid(String::from("not a regular file")));
        }
        Ok(m) if m.permissions().mode() & 0o077 != 0 => {
            return Err(StoreError::SecretPermissions {
                path,
                mode: m.permissions().mode() & 0o7777,
            });
        }
        Ok(m) if m.len() != SECRET_BYTES as u64 => {
            if regions > 0 {
                return Err(invalid(format!(
                    "{} bytes, expected {SECRET_BYTES}",
                    m.len()
                )));
            }
            // Only a crash while creating it leaves a short secret, and no
            // region can exist before it was complete: safe to make anew.
            tracing::warn!(path = %path.display(), len_bytes = m.len(), "replacing an incomplete secret file");
            fs::remove_file(&path).map_err(io_err("remove", &path))?;
            return create_secret(dir, &path).map(|s| (s, true));
        }
        Ok(_) => {}
    }
    let mut bytes = [0u8; SECRET_BYTES];
    File::open(&path)
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(io_err("read", &path))?;
    Ok((Secret::from_bytes(bytes), false))
}

fn create_secret(dir: &Path, path: &Path) -> Result<Secret, StoreError> {
    let mut bytes = [0u8; SECRET_BYTES];
    random_bytes(&mut bytes).map_err(io_err("get random bytes for", path))?;
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err("create", path))?;
    f.write_all(&bytes).map_err(io_err("write", path))?;
    f.sync_all().map_err(io_err("fsync", path))?;
    fsync_dir(dir).map_err(io_err("fsync", dir))?;
    tracing::info!(path = %path.display(), "created a new pool-manager secret");
    Ok(Secret::from_bytes(bytes))
}
