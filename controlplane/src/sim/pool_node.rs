//! The pool manager as a simulated process: the real [`PoolManager`] plus a
//! disk of bytes — the checkpoint image and the journal file, in the real
//! formats — and the group commit around them.
//!
//! Records pushed by a request are *pending* until a commit appends their
//! bytes to the journal; the request's reply is held until then (the release
//! rule of `docs/pool-manager.md` §2). A crash keeps the committed journal
//! plus an arbitrary byte prefix of the pending bytes (a torn tail: the last
//! record may be cut anywhere). A restart recovers exactly as
//! `PoolStore::open` does — checkpoint, then `journal::scan` of the file
//! bytes, cut at the tear — and must arrive at the *durable* state: the
//! ledger obtained by applying, as plain values, every record whose bytes
//! reached the disk whole.

use crate::pool::header::{self, BlockState};
use crate::pool::journal::{self, JOURNAL_HEADER_BYTES, file_header};
use crate::pool::ledger::Ledger;
use crate::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, OwnerLabel,
    PoolId, PoolIdentity, PoolManager, PoolTarget, PoolUuid, ProcessIdentity, Record, RecordSink,
    Reply, Request, Secret, checkpoint,
};

use std::collections::BTreeMap;
use std::convert::Infallible;

use crate::pool::PoolError;
use crate::pool::service::REPLY_CACHE_LEN;
use crate::pool::service::cache::{SeqCache, exactly_once};

use super::msg::{Message, PoolReply, PoolReplyBody, PoolRequest};
use super::net::{Ctx, Event};
use super::params::{BLOCK_BYTES, MS, POOL_GRACE_MS};

/// The directory id every simulated directory incarnation attaches as.
pub(crate) const DIRECTORY: DirectoryId = DirectoryId(1);
const LEASE_MS: u64 = 10_000;
/// Wall-clock origin for pool-header leases (the sim clock starts at 0).
const WALL_ORIGIN_MS: u64 = 1_700_000_000_000;

/// The caller identity of a directory incarnation's process.
pub(crate) fn directory_process(incarnation: u32) -> Caller {
    Caller::Local(ProcessIdentity {
        pid: 1000 + incarnation,
        start_time_ticks: u64::from(incarnation),
    })
}

/// Who the pool manager sees on a directory's connection: over TCP, the
/// connection itself (its close is the caller's end); on the local socket,
/// the directory's process (ended by the liveness probe).
pub(crate) fn pool_caller(over_tcp: bool, directory_incarnation: u32, pool_conn: u64) -> Caller {
    if over_tcp {
        Caller::Remote {
            connection: pool_conn,
        }
    } else {
        directory_process(directory_incarnation)
    }
}

/// The pool service's reply cache, with the simulation's answers.
type ReplyCache = SeqCache<Result<PoolReplyBody, PoolError>>;

/// Records pushed and not yet committed, encoded as the journal encodes them.
#[derive(Debug, Default)]
struct MemJournal {
    next_seq: u64,
    pending: Vec<u8>,
    /// (record, end offset of its bytes in `pending`).
    pending_records: Vec<(Record, usize)>,
}

impl RecordSink for MemJournal {
    fn push(&mut self, record: &Record) {
        record.encode(self.next_seq, &mut self.pending);
        self.pending_records.push((*record, self.pending.len()));
        self.next_seq += 1;
    }
}

/// What reached the disk.
#[derive(Debug, Clone)]
pub(crate) struct Disk {
    checkpoint: Option<Vec<u8>>,
    journal: Vec<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    pub commits: u64,
    pub records: u64,
    pub checkpoints: u64,
    pub restarts: u64,
    pub torn_tail_bytes: u64,
    pub records_lost_uncommitted: u64,
    pub reclaimed: u64,
    /// Commits whose sync stalled (100 ms to 2 s).
    pub stalls: u64,
}

#[derive(Debug)]
pub(crate) struct PoolNode {
    pub incarnation: u32,
    pub manager: Option<PoolManager>,
    /// The service's per-directory reply caches (volatile: a restart loses
    /// them, as the service's do).
    caches: BTreeMap<DirectoryId, ReplyCache>,
    secret: [u8; 32],
    disk: Disk,
    sink: MemJournal,
    held: Vec<Message>,
    commit_scheduled: bool,
    crash_armed: bool,
    records_since_checkpoint: u64,
    header_block: Vec<u8>,
    pub pool: PoolId,
    pub capacity_bytes: u64,
    /// The oracle: every record that reached the disk whole, applied as a
    /// value. Recovery must arrive exactly here.
    pub durable: Ledger,
    commit_delay_max_ns: u64,
    /// Chance that a commit's sync stalls.
    stall_p: f64,
    checkpoint_every_records: u64,
    pub counters: PoolCounters,
}

impl PoolNode {
    pub fn new(
        ctx: &mut Ctx,
        blocks: u64,
        commit_delay_max_ns: u64,
        stall_p: f64,
        checkpoint_every_records: u64,
    ) -> Result<Self, String> {
        let mut header_block = vec![0u8; 4096];
        let identity = PoolIdentity {
            uuid: PoolUuid([7; 16]),
            size_bytes: (blocks + 1) * BLOCK_BYTES,
            alignment_bytes: BLOCK_BYTES,
        };
        header::encode_identity(&mut header_block, &identity)
            .map_err(|e| format!("pool header: {e}"))?;
        let secret = ctx.rng.bytes32();
        let mut node = Self {
            incarnation: 0,
            manager: Some(PoolManager::new(
                Secret::from_bytes(secret),
                ManagerConfig {
                    grace_ms: POOL_GRACE_MS,
                },
            )),
            caches: BTreeMap::new(),
            secret,
            disk: Disk {
                checkpoint: None,
                journal: file_header().to_vec(),
            },
            sink: MemJournal {
                next_seq: 1,
                ..MemJournal::default()
            },
            held: Vec::new(),
            commit_scheduled: false,
            crash_armed: false,
            records_since_checkpoint: 0,
            header_block,
            pool: PoolId(0),
            capacity_bytes: blocks * BLOCK_BYTES,
            durable: Ledger::new(),
            commit_delay_max_ns,
            stall_p,
            checkpoint_every_records,
            counters: PoolCounters::default(),
        };
        node.open_pool(ctx)?;
        Ok(node)
    }

    pub fn is_up(&self) -> bool {
        self.manager.is_some()
    }

    /// Opens the pool as the driver does (`docs/pool-manager.md` §5): the
    /// epoch is journaled and committed before the lease is written and the
    /// pool goes online.
    fn open_pool(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        let BlockState::Initialised(h) =
            header::decode(&self.header_block).map_err(|e| format!("pool header: {e}"))?
        else {
            return Err(String::from("pool header vanished"));
        };
        let manager = self.manager.as_mut().ok_or("open_pool while down")?;
        let opened = manager
            .open_pool(&h, &mut self.sink)
            .map_err(|e| format!("open_pool: {e}"))?;
        self.pool = opened.pool;
        self.commit(ctx);
        let wall_ms = WALL_ORIGIN_MS + ctx.now / MS;
        let lease = header::new_lease(
            &h,
            manager_id(&self.secret),
            opened.epoch,
            wall_ms,
            LEASE_MS,
        );
        header::write_lease(&mut self.header_block, &lease).map_err(|e| format!("lease: {e}"))?;
        self.manager
            .as_mut()
            .ok_or("open_pool while down")?
            .mark_online(opened.pool, opened.epoch)
            .map_err(|e| format!("mark_online: {e}"))
    }

    fn handle_for(&self, r: &crate::pool::RegionRecord) -> Handle {
        Handle {
            region: r.id,
            pool: r.pool,
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes,
            owner: r.owner,
            token: Secret::from_bytes(self.secret).token(
                r.id,
                r.pool,
                r.offset_bytes,
                r.len_bytes,
                r.owner,
            ),
        }
    }

    /// One request from `caller`, of directory incarnation `from` on its
    /// connection `pool_conn`. The reply goes out now if nothing is
    /// pending, else with the next commit.
    pub fn handle(
        &mut self,
        ctx: &mut Ctx,
        caller: Caller,
        from: u32,
        pool_conn: u64,
        id: u64,
        request: PoolRequest,
    ) -> Result<(), String> {
        let Some(manager) = self.manager.as_mut() else {
            return Ok(());
        };
        let now = MonotonicMs(ctx.now / MS);
        let result = match request {
            PoolRequest::Rejoin => manager
                .handle(
                    &caller,
                    Request::Attach {
                        directory: DIRECTORY,
                        handles: &[],
                    },
                    now,
                    &mut self.sink,
                )
                .map(|_| ()),
            _ => Ok(()),
        };
        let result = match (result, request) {
            (Err(e), _) => Err(e),
            (Ok(()), PoolRequest::Rejoin) => {
                let regions: Vec<_> = manager
                    .ledger()
                    .regions()
                    .filter(|r| r.owner.directory == DIRECTORY)
                    .copied()
                    .collect();
                let handles: Vec<Handle> = regions.iter().map(|r| self.handle_for(r)).collect();
                let manager = self.manager.as_mut().expect("up: checked above");
                manager
                    .handle(
                        &caller,
                        Request::Attach {
                            directory: DIRECTORY,
                            handles: &handles,
                        },
                        now,
                        &mut self.sink,
                    )
                    .map(|_| PoolReplyBody::Rejoined(handles))
            }
            (Ok(()), PoolRequest::Attach { handles }) => manager
                .handle(
                    &caller,
                    Request::Attach {
                        directory: DIRECTORY,
                        handles: &handles,
                    },
                    now,
                    &mut self.sink,
                )
                .map(|r| match r {
                    Reply::Attached(report) => PoolReplyBody::Attached(report),
                    other => unreachable!("attach answered {other:?}"),
                }),
            (
                Ok(()),
                PoolRequest::Alloc {
                    instance,
                    len_bytes,
                    seq,
                },
            ) => self.mutating(
                &caller,
                seq,
                Request::Alloc {
                    target: PoolTarget::Any,
                    len_bytes,
                    instance: InstanceId(instance),
                    tag: AllocTag(seq),
                },
                now,
            )?,
            (Ok(()), PoolRequest::Free { handle, seq }) => {
                self.mutating(&caller, seq, Request::Free { handle }, now)?
            }
        };
        let free_bytes = self.free_bytes();
        let reply = Message::FromPool {
            pool_incarnation: self.incarnation,
            directory_incarnation: from,
            pool_conn,
            id,
            reply: PoolReply {
                result,
                capacity_bytes: self.capacity_bytes,
                free_bytes,
            },
        };
        self.release_or_hold(ctx, reply);
        Ok(())
    }

    /// A mutating request through the pool service's exactly-once front,
    /// as `pool::service::core` runs it: refused uncached from a caller
    /// that has not attached (the service's `HelloRequired`); answered from
    /// the reply cache when its `seq` is there, else run by the manager and
    /// cached; an allocation's answer, run now or replayed, kept at the
    /// manager. `Err`: the `seq` fell out of the cache, which the
    /// simulation's directory never lets happen.
    fn mutating(
        &mut self,
        caller: &Caller,
        seq: u64,
        request: Request<'_>,
        now: MonotonicMs,
    ) -> Result<Result<PoolReplyBody, PoolError>, String> {
        let manager = self.manager.as_mut().expect("handle() runs only while up");
        let attached = manager
            .directory(DIRECTORY, now)
            .is_some_and(|d| d.attached_by == Some(*caller));
        if !attached {
            return Ok(Err(PoolError::NotAttached { caller: *caller }));
        }
        let cache = self
            .caches
            .entry(DIRECTORY)
            .or_insert_with(|| SeqCache::new(REPLY_CACHE_LEN));
        let sink = &mut self.sink;
        let Ok(answer) = exactly_once(cache, seq, || {
            Ok::<_, Infallible>(manager.handle(caller, request, now, sink).map(|r| match r {
                Reply::Allocated(h) => PoolReplyBody::Allocated(h),
                Reply::Freed { .. } => PoolReplyBody::Freed,
                other => unreachable!("a mutating request answered {other:?}"),
            }))
        })
        .map_err(|t| {
            format!(
                "pool request seq {} fell out of the reply cache (oldest cached {}): whether it ran cannot be told",
                t.seq, t.oldest
            )
        })?;
        if let Ok(PoolReplyBody::Allocated(h)) = &answer
            && let Err(e) = manager.keep_retried(caller, h.region)
        {
            return Ok(Err(e));
        }
        Ok(answer)
    }

    fn free_bytes(&self) -> u64 {
        self.manager
            .as_ref()
            .and_then(|m| m.stats().pools.first().map(|p| p.free_bytes))
            .unwrap_or(0)
    }

    fn release_or_hold(&mut self, ctx: &mut Ctx, reply: Message) {
        if self.sink.pending_records.is_empty() && self.held.is_empty() {
            ctx.send_pool_link(reply);
            return;
        }
        self.held.push(reply);
        self.schedule_commit(ctx);
    }

    /// The next commit never happens: the process dies with records
    /// pending (the world crashes it as soon as [`Self::crash_due`]).
    pub fn arm_crash(&mut self) {
        self.crash_armed = true;
    }

    pub fn crash_armed(&self) -> bool {
        self.crash_armed
    }

    pub fn crash_due(&self) -> bool {
        self.crash_armed && !self.sink.pending_records.is_empty()
    }

    fn schedule_commit(&mut self, ctx: &mut Ctx) {
        if self.crash_armed {
            return;
        }
        if self.commit_scheduled {
            return;
        }
        let stall = ctx.rng.chance(self.stall_p);
        if self.commit_delay_max_ns == 0 && !stall {
            self.commit(ctx);
        } else {
            self.commit_scheduled = true;
            // A slow sync now and then holds every reply for up to seconds.
            let d = if stall {
                self.counters.stalls += 1;
                ctx.rng.range(100 * MS, 2_000 * MS)
            } else {
                ctx.rng.range(0, self.commit_delay_max_ns)
            };
            ctx.after(
                d,
                Event::PoolCommit {
                    incarnation: self.incarnation,
                },
            );
        }
    }

    /// The reaper.
    pub fn tick(&mut self, ctx: &mut Ctx) {
        let Some(manager) = self.manager.as_mut() else {
            return;
        };
        let now = MonotonicMs(ctx.now / MS);
        let report = manager.tick(now, &mut self.sink);
        self.counters.reclaimed += report.reclaimed.len() as u64;
        // The service drops the reply caches of directories the manager
        // forgot (every minute there; every tick here).
        self.caches
            .retain(|d, _| manager.directory(*d, now).is_some());
        if !self.sink.pending_records.is_empty() {
            self.schedule_commit(ctx);
        }
    }

    pub fn caller_gone(&mut self, ctx: &Ctx, caller: &Caller) {
        if let Some(manager) = self.manager.as_mut() {
            manager.caller_gone(caller, MonotonicMs(ctx.now / MS));
        }
    }

    /// Makes every pending record durable and releases the held replies.
    pub fn commit(&mut self, ctx: &mut Ctx) {
        self.commit_scheduled = false;
        if self.manager.is_none() || self.crash_armed {
            return;
        }
        let records = std::mem::take(&mut self.sink.pending_records);
        self.disk.journal.append(&mut self.sink.pending);
        for (record, _) in &records {
            self.durable
                .apply(record)
                .expect("a record the manager applied applies to the durable ledger");
        }
        if !records.is_empty() {
            self.counters.commits += 1;
            self.counters.records += records.len() as u64;
            self.records_since_checkpoint += records.len() as u64;
        }
        for reply in std::mem::take(&mut self.held) {
            ctx.send_pool_link(reply);
        }
        if self.records_since_checkpoint >= self.checkpoint_every_records {
            self.checkpoint(ctx);
        }
    }

    /// Checkpoint: the image is installed; the journal is restarted — or,
    /// sometimes, not yet (the crash window between installing a checkpoint
    /// and restarting the journal: recovery skips what it covers).
    fn checkpoint(&mut self, ctx: &mut Ctx) {
        let manager = self.manager.as_ref().expect("checkpointing while up");
        let seq = self.sink.next_seq - 1;
        self.disk.checkpoint = Some(checkpoint::encode(seq, &manager.snapshot()));
        self.counters.checkpoints += 1;
        self.records_since_checkpoint = 0;
        if ctx.rng.chance(0.7) {
            self.disk.journal.truncate(JOURNAL_HEADER_BYTES);
        }
    }

    /// The process dies. Of the pending bytes, an arbitrary prefix reached
    /// the disk.
    pub fn crash(&mut self, ctx: &mut Ctx) {
        if self.manager.take().is_none() {
            return;
        }
        let pending = std::mem::take(&mut self.sink.pending);
        let keep = ctx.rng.range(0, pending.len() as u64) as usize;
        self.disk.journal.extend_from_slice(&pending[..keep]);
        let records = std::mem::take(&mut self.sink.pending_records);
        for (record, end) in &records {
            if *end <= keep {
                self.durable
                    .apply(record)
                    .expect("a pending record applies to the durable ledger");
            } else {
                self.counters.records_lost_uncommitted += 1;
            }
        }
        if records.last().is_some_and(|(_, end)| *end > keep) {
            let whole = records
                .iter()
                .map(|(_, end)| *end)
                .filter(|&e| e <= keep)
                .max()
                .unwrap_or(0);
            self.counters.torn_tail_bytes += (keep - whole) as u64;
        }
        self.held.clear();
        self.caches.clear();
        self.commit_scheduled = false;
        self.crash_armed = false;
        self.incarnation += 1;
    }

    /// Restart: recovery from the disk, as `PoolStore::open` does it.
    pub fn start(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        if self.manager.is_some() {
            return Ok(());
        }
        self.counters.restarts += 1;
        let (checkpoint_seq, mut ledger) = match &self.disk.checkpoint {
            Some(image) => {
                let (seq, snapshot) =
                    checkpoint::decode(image).map_err(|e| format!("checkpoint: {e}"))?;
                let ledger = Ledger::from_snapshot(&snapshot)
                    .map_err(|e| format!("checkpoint does not load: {e}"))?;
                (seq, ledger)
            }
            None => (0, Ledger::new()),
        };
        let report = journal::scan(&self.disk.journal, checkpoint_seq, |r| ledger.apply(r))
            .map_err(|e| format!("journal recovery refused: {e:?}"))?;
        let mut end = report.valid_end_bytes as usize;
        if report.skipped > 0 && report.replayed == 0 {
            end = JOURNAL_HEADER_BYTES;
        }
        self.disk.journal.truncate(end);
        ledger
            .verify()
            .map_err(|e| format!("recovered ledger: {e}"))?;
        if ledger.snapshot() != self.durable.snapshot() {
            return Err(format!(
                "recovery is not the durable state: recovered {:?}, durable {:?}",
                ledger.snapshot(),
                self.durable.snapshot()
            ));
        }
        self.sink = MemJournal {
            next_seq: report.next_seq,
            ..MemJournal::default()
        };
        self.records_since_checkpoint = report.replayed;
        self.manager = Some(
            PoolManager::restore(
                &ledger.snapshot(),
                Secret::from_bytes(self.secret),
                ManagerConfig {
                    grace_ms: POOL_GRACE_MS,
                },
                MonotonicMs(ctx.now / MS),
            )
            .map_err(|e| format!("restore: {e}"))?,
        );
        self.open_pool(ctx)
    }
}

fn manager_id(secret: &[u8; 32]) -> crate::pool::ManagerId {
    Secret::from_bytes(*secret).manager_id()
}

/// The pool-side owner label of a client instance.
pub(crate) fn owner_label(instance: u64) -> OwnerLabel {
    OwnerLabel {
        directory: DIRECTORY,
        instance: InstanceId(instance),
    }
}
