//! The pool-manager state machine (sans-IO).
//!
//! [`PoolManager`] owns the [`Ledger`] (durable state) and the volatile state
//! around it: which caller speaks for which directory, which directories are
//! gone, and which of their regions wait for reclamation. Its inputs are a
//! [`Request`] with the [`Caller`] the driver established and `now`
//! ([`MonotonicMs`], supplied by the driver), plus the driver's events
//! ([`PoolManager::caller_gone`], [`PoolManager::tick`], pool opening). It
//! never reads a clock, a file or a socket.
//!
//! Outputs: a reply (or a typed [`PoolError`]), and the journal records of the
//! mutation, pushed into a [`RecordSink`]. **The driver must make those
//! records durable before it sends the reply** — that is the deferred reply:
//! the manager has already applied the change in memory, and the reply is
//! held until the journal commit that covers it. A request that fails pushes
//! no record and changes nothing durable; the one volatile trace a failure
//! leaves is the answer of a tagged allocation (see *Retried allocations*).
//!
//! The release rule, for group commit: **a reply — any reply, with records or
//! without, success or error — is released only once every record pushed
//! before it is durable.** Replies that push nothing can still depend on
//! pending records: a retried `Alloc` answered from its tag, a "region
//! already freed" for a free whose record is in the same batch. Releasing
//! replies in order, each after the commit that covers everything pushed
//! before it, satisfies the rule; in per-record mode nothing is ever pending
//! when a request arrives, so replies without records go out at once. If a
//! commit fails the driver must stop serving (fail-stop): memory is then
//! ahead of the disk, and only a restart (replay) brings them back together.
//!
//! Directories and ownership. Clients are directories. A caller first
//! attaches as a [`DirectoryId`]; allocation labels regions with that
//! directory and an instance the directory names, and returns a [`Handle`]
//! whose token proves the ownership. Only the owning directory frees a region
//! (it must present the token). When a directory's caller is gone (a remote
//! connection closed; a local process exited, or its pid now belongs to
//! another process), all its regions become *unconfirmed* with a deadline of
//! `now + grace_ms`. A caller that attaches as that directory keeps a region
//! by presenting its handle (token verified) before the deadline; the reaper
//! ([`PoolManager::tick`]) reclaims every region still unconfirmed at its
//! deadline. Presenting handles can only *keep* regions: an impostor
//! attaching under a dead directory's id gains nothing, and cannot make the
//! real directory's regions go away sooner. After a restart every directory is
//! gone (no caller survives a restart) and every region gets a fresh grace.
//!
//! Pools. A pool known from the journal starts offline; the driver opens it
//! ([`PoolManager::open_pool`], which journals a higher manager epoch),
//! writes the lease into the pool header, then [`PoolManager::mark_online`].
//! Only online pools serve allocations; frees work on any pool.
//!
//! Retried allocations. An `Alloc` may carry an [`AllocTag`] chosen by the
//! directory: one tag per logical allocation, reused only by its retries.
//! The tag is journaled with the region, so a retry after a lost reply —
//! even across a manager crash — returns the region already allocated
//! instead of leaking a second one, and keeps it (a retry after a restart
//! confirms it as an attach would). That alone covers a copy only while the
//! region lives: a copy arriving after the first one failed, or after its
//! region was freed, would allocate again. So the answers of each
//! directory's last [`TAG_ANSWERS_PER_DIRECTORY`] tagged allocations are
//! kept in memory and replayed (`tag_answers` explains the bound and why
//! they need no journal). A retried `Free` is answered
//! [`PoolError::RegionAlreadyFreed`]: region ids are never reused, so a
//! valid token for a missing region proves it is gone.
//!
//! Complexity, n live regions: alloc O(p + log n + W) for p pools (first
//! fit in each pool's extent tree is O(log n)) and W =
//! [`TAG_ANSWERS_PER_DIRECTORY`] (a tagged allocation scans the directory's
//! answers); free O(log n); attach
//! O(h log n + r) for h handles and the directory's r regions; reaping
//! O(log n) per region; a directory going away O(r log n).

use std::collections::{BTreeMap, BTreeSet};

use super::header::Header;
use super::ledger::{
    GeometryError, InvariantError, Ledger, LedgerError, MAX_POOLS, MAX_REGIONS, PoolInfo, Snapshot,
    check_geometry,
};
use super::record::Record;
pub use super::tag_answers::TAG_ANSWERS_PER_DIRECTORY;
use super::tag_answers::{TagAnswer, TagAnswers};
use super::token::Secret;
use super::types::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerId, MonotonicMs, OwnerLabel, PoolId,
    PoolUuid, ProcessIdentity, RegionId, RegionRecord,
};

/// Most handles one attach request may present.
pub const MAX_ATTACH_HANDLES: usize = 4096;
/// Most directories (attached, or gone with regions) tracked at once.
pub const MAX_DIRECTORIES: usize = 4096;
/// Most regions one [`PoolManager::tick`] reclaims (bounds the journal batch
/// and the time of one tick; the rest waits for the next tick).
pub const MAX_REAP_PER_TICK: usize = 1024;
/// Largest region one request may ask for (16 TiB).
pub const MAX_REGION_BYTES: u64 = 1 << 44;

/// Tunables of the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManagerConfig {
    /// How long a gone directory's regions wait for a reattach.
    pub grace_ms: u64,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self { grace_ms: 30_000 }
    }
}

/// Where journal records go. The store's journal encodes them into its
/// pending buffer; tests collect them in a `Vec`.
pub trait RecordSink {
    fn push(&mut self, record: &Record);
}

impl RecordSink for Vec<Record> {
    fn push(&mut self, record: &Record) {
        Vec::push(self, *record);
    }
}

/// Which pool an allocation may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolTarget {
    /// First fit across online pools, in pool-id order.
    Any,
    Pool(PoolId),
}

/// A decoded client request (what the wire carries; see
/// `docs/pool-manager.md` for the message list).
#[derive(Debug, Clone, Copy)]
pub enum Request<'a> {
    /// Speak for `directory` from now on; keep the regions whose handles are
    /// presented. With no handles: a first attach, or a reattach that keeps
    /// nothing yet (more handles may follow in later attaches).
    Attach {
        directory: DirectoryId,
        handles: &'a [Handle],
    },
    /// Allocate one region of `len_bytes` (a multiple of the pool alignment)
    /// for `instance` of the attached directory. A retry with the same
    /// non-zero `tag` returns the region already allocated under it while
    /// that region lives; within the directory's last
    /// [`TAG_ANSWERS_PER_DIRECTORY`] tagged allocations, a retry of one that
    /// failed gets the same error, and of one whose region is gone
    /// [`PoolError::RegionAlreadyFreed`] — never a second region.
    Alloc {
        target: PoolTarget,
        len_bytes: u64,
        instance: InstanceId,
        tag: AllocTag,
    },
    /// Free a region of the attached directory.
    Free { handle: Handle },
    /// Statistics; answered to any caller, attached or not.
    Stats,
}

/// The answer to a successful request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Attached(AttachReport),
    Allocated(Handle),
    Freed { region: RegionId, len_bytes: u64 },
    Stats(StatsReport),
}

/// The outcome of an attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachReport {
    pub directory: DirectoryId,
    /// One verdict per presented handle, in order: `Ok` = the region is kept.
    pub verdicts: Vec<Result<(), PoolError>>,
    /// Regions of this directory still waiting to be presented.
    pub unconfirmed_regions: u64,
    /// Time left before the first of those is reclaimed.
    pub reclaim_in_ms: Option<u64>,
}

/// Statistics of one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub pool: PoolId,
    pub uuid: PoolUuid,
    pub online: bool,
    pub epoch: u64,
    pub size_bytes: u64,
    pub alignment_bytes: u64,
    /// Allocatable bytes (size less the header block and a partial tail).
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub free_extents: u64,
    pub regions: u64,
    /// Distinct owner labels (directory, instance) with regions here.
    pub owners: u64,
}

/// Statistics of the manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsReport {
    pub pools: Vec<PoolStats>,
    pub next_region: RegionId,
    pub live_regions: u64,
    pub directories_attached: u64,
    pub directories_gone: u64,
    pub regions_pending_reclaim: u64,
}

/// A directory as the manager sees it (operator view, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectoryStatus {
    pub directory: DirectoryId,
    /// The caller speaking for it, or `None` when it is gone.
    pub attached_by: Option<Caller>,
    pub regions: u64,
    pub unconfirmed_regions: u64,
    pub reclaim_in_ms: Option<u64>,
}

/// A pool taken by [`PoolManager::open_pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenedPool {
    pub pool: PoolId,
    /// The new manager epoch, to write into the header lease.
    pub epoch: u64,
    /// True when the pool was new to this manager.
    pub added: bool,
}

/// What one reaper tick did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReapReport {
    pub reclaimed: Vec<RegionRecord>,
    /// More regions are already due (the per-tick limit was reached).
    pub more_due: bool,
}

/// The pool an error names: "pool3", or "any pool" when the request left
/// the choice to the manager.
fn which_pool(pool: &Option<PoolId>) -> String {
    match pool {
        Some(p) => p.to_string(),
        None => "any pool".to_owned(),
    }
}

/// A request the manager refused. Nothing changed. `code()` is the stable
/// number carried on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("{caller} has not attached as a directory")]
    NotAttached { caller: Caller },
    #[error("{caller} speaks for directory {bound}, not {requested}")]
    CallerBoundElsewhere {
        caller: Caller,
        bound: DirectoryId,
        requested: DirectoryId,
    },
    #[error(
        "directory {directory} is attached through another live caller; retry once that caller is gone"
    )]
    DirectoryAttachedElsewhere { directory: DirectoryId },
    #[error("{count} handles presented, at most {max} per attach")]
    TooManyHandles { count: usize, max: usize },
    #[error("too many directories (limit {max})")]
    TooManyDirectories { max: usize },
    #[error("a region of zero bytes was requested")]
    ZeroLength,
    #[error("a region of {len_bytes} bytes was requested, the limit is {max_bytes}")]
    RegionTooLarge { len_bytes: u64, max_bytes: u64 },
    #[error(
        "{len_bytes} bytes is not a multiple of the alignment {alignment_bytes} ({})",
        which_pool(.pool)
    )]
    LengthNotAligned {
        len_bytes: u64,
        alignment_bytes: u64,
        pool: Option<PoolId>,
    },
    #[error("unknown pool {pool}")]
    UnknownPool { pool: PoolId },
    #[error("pool {pool} is offline")]
    PoolOffline { pool: PoolId },
    #[error("no pool is online")]
    NoOnlinePool,
    #[error(
        "no free extent of {len_bytes} bytes ({}; largest free extent {largest_free_bytes} bytes)",
        which_pool(.pool)
    )]
    NoSpace {
        len_bytes: u64,
        pool: Option<PoolId>,
        largest_free_bytes: u64,
    },
    #[error("too many live regions (limit {max})")]
    TooManyRegions { max: usize },
    #[error("the token presented for region {region} is not valid for the handle's fields")]
    BadToken { region: RegionId },
    #[error("region {region} was never issued")]
    UnknownRegion { region: RegionId },
    #[error("region {region} was already freed or reclaimed")]
    RegionAlreadyFreed { region: RegionId },
    #[error("the handle for region {region} does not match the region")]
    HandleMismatch { region: RegionId },
    #[error("region {region} belongs to directory {owner}, not to {caller}")]
    WrongOwner {
        region: RegionId,
        owner: DirectoryId,
        caller: DirectoryId,
    },
    #[error(
        "pool {pool} ({uuid}) is recorded as {ledger_size_bytes} bytes / alignment {ledger_alignment_bytes}, its header says {header_size_bytes} / {header_alignment_bytes}"
    )]
    PoolMismatch {
        pool: PoolId,
        uuid: PoolUuid,
        ledger_size_bytes: u64,
        ledger_alignment_bytes: u64,
        header_size_bytes: u64,
        header_alignment_bytes: u64,
    },
    #[error(
        "pool {uuid} has been served by another pool manager (header epoch {epoch}) and is unknown to this state directory; it may hold live regions. Refusing to allocate from it. Wipe its first block only if no client uses it"
    )]
    ForeignPool { uuid: PoolUuid, epoch: u64 },
    #[error("too many pools (limit {max})")]
    TooManyPools { max: usize },
    #[error("pool {pool} is already online")]
    PoolAlreadyOnline { pool: PoolId },
    #[error("pool {pool} was opened with epoch {expected}, not {given}")]
    EpochMismatch {
        pool: PoolId,
        expected: u64,
        given: u64,
    },
    #[error("pool {pool}'s manager epoch cannot grow any more")]
    EpochExhausted { pool: PoolId },
    #[error(
        "pool {pool}'s header shows manager epoch {header_epoch}, above the {ledger_epoch} this state directory journaled: a manager served it after this state's last record of it (this state restored from an older copy, or another manager took the pool over), so regions may exist that this ledger does not know. Refusing to allocate from it; restore the state directory that served it last"
    )]
    StaleLedger {
        pool: PoolId,
        ledger_epoch: u64,
        header_epoch: u64,
    },
    #[error("pool {uuid}: {source}")]
    BadGeometry {
        uuid: PoolUuid,
        source: GeometryError,
    },
    #[error("tag {tag:?} already names live region {region}, allocated with other parameters")]
    TagReused { tag: AllocTag, region: RegionId },
}

impl PoolError {
    /// Stable wire code (documented in `docs/pool-manager.md`).
    pub fn code(&self) -> u16 {
        match self {
            Self::NotAttached { .. } => 1,
            Self::CallerBoundElsewhere { .. } => 2,
            Self::DirectoryAttachedElsewhere { .. } => 3,
            Self::TooManyHandles { .. } => 4,
            Self::TooManyDirectories { .. } => 5,
            Self::ZeroLength => 6,
            Self::RegionTooLarge { .. } => 7,
            Self::LengthNotAligned { .. } => 8,
            Self::UnknownPool { .. } => 9,
            Self::PoolOffline { .. } => 10,
            Self::NoOnlinePool => 11,
            Self::NoSpace { .. } => 12,
            Self::TooManyRegions { .. } => 13,
            Self::BadToken { .. } => 14,
            Self::UnknownRegion { .. } => 15,
            Self::RegionAlreadyFreed { .. } => 16,
            Self::HandleMismatch { .. } => 17,
            Self::WrongOwner { .. } => 18,
            Self::PoolMismatch { .. } => 19,
            Self::ForeignPool { .. } => 20,
            Self::TooManyPools { .. } => 21,
            Self::PoolAlreadyOnline { .. } => 22,
            Self::EpochMismatch { .. } => 23,
            Self::EpochExhausted { .. } => 24,
            Self::BadGeometry { .. } => 25,
            Self::TagReused { .. } => 26,
            Self::StaleLedger { .. } => 27,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolMode {
    Offline,
    Online,
}

#[derive(Debug, Clone)]
struct DirectoryEntry {
    /// The caller speaking for the directory; `None` = gone.
    caller: Option<Caller>,
    regions: BTreeSet<RegionId>,
    /// Answers of its last tagged allocations (volatile; see `tag_answers`).
    tag_answers: TagAnswers,
}

/// The pool-manager state machine. See the module essay.
#[derive(Debug)]
pub struct PoolManager {
    ledger: Ledger,
    secret: Secret,
    config: ManagerConfig,
    /// Per pool (index = pool id); volatile: every pool starts offline.
    modes: Vec<PoolMode>,
    directories: BTreeMap<DirectoryId, DirectoryEntry>,
    callers: BTreeMap<Caller, DirectoryId>,
    /// Unconfirmed regions and their reclaim deadline.
    pending: BTreeMap<RegionId, MonotonicMs>,
    /// The same entries ordered by deadline, for the reaper.
    reap_queue: BTreeSet<(MonotonicMs, RegionId)>,
}

impl PoolManager {
    /// A manager with no state (a fresh state directory).
    pub fn new(secret: Secret, config: ManagerConfig) -> Self {
        Self::from_ledger(Ledger::new(), secret, config, MonotonicMs(0))
    }

    /// A manager restarted on `snapshot` at `now`: every directory is gone and
    /// every region gets a grace period from `now`; every pool is offline.
    pub fn restore(
        snapshot: &Snapshot,
        secret: Secret,
        config: ManagerConfig,
        now: MonotonicMs,
    ) -> Result<Self, LedgerError> {
        Ok(Self::from_ledger(
            Ledger::from_snapshot(snapshot)?,
            secret,
            config,
            now,
        ))
    }

    pub(crate) fn from_ledger(
        ledger: Ledger,
        secret: Secret,
        config: ManagerConfig,
        now: MonotonicMs,
    ) -> Self {
        let deadline = now.plus_ms(config.grace_ms);
        let mut directories: BTreeMap<DirectoryId, DirectoryEntry> = BTreeMap::new();
        let mut pending = BTreeMap::new();
        let mut reap_queue = BTreeSet::new();
        for r in ledger.regions() {
            directories
                .entry(r.owner.directory)
                .or_insert_with(|| DirectoryEntry {
                    caller: None,
                    regions: BTreeSet::new(),
                    tag_answers: TagAnswers::default(),
                })
                .regions
                .insert(r.id);
            pending.insert(r.id, deadline);
            reap_queue.insert((deadline, r.id));
        }
        let modes = vec![PoolMode::Offline; ledger.pools().count()];
        Self {
            ledger,
            secret,
            config,
            modes,
            directories,
            callers: BTreeMap::new(),
            pending,
            reap_queue,
        }
    }

    pub(crate) fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The durable state (what a checkpoint stores).
    pub fn snapshot(&self) -> Snapshot {
        self.ledger.snapshot()
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// This manager's name in pool-header leases.
    pub fn manager_id(&self) -> ManagerId {
        self.secret.manager_id()
    }

    /// Handles one client request from `caller` at `now`. On `Ok`, records
    /// pushed into `sink` must be durable before the reply is sent; on `Err`
    /// nothing was pushed and nothing durable changed (a tagged allocation's
    /// refusal is remembered, for its copies).
    pub fn handle(
        &mut self,
        caller: &Caller,
        request: Request<'_>,
        now: MonotonicMs,
        sink: &mut impl RecordSink,
    ) -> Result<Reply, PoolError> {
        match request {
            Request::Attach { directory, handles } => self
                .attach(caller, directory, handles, now)
                .map(Reply::Attached),
            Request::Alloc {
                target,
                len_bytes,
                instance,
                tag,
            } => self
                .alloc(caller, target, len_bytes, instance, tag, sink)
                .map(Reply::Allocated),
            Request::Free { handle } => self.free(caller, &handle, sink),
            Request::Stats => Ok(Reply::Stats(self.stats())),
        }
    }

    fn attach(
        &mut self,
        caller: &Caller,
        directory: DirectoryId,
        handles: &[Handle],
        now: MonotonicMs,
    ) -> Result<AttachReport, PoolError> {
        if handles.len() > MAX_ATTACH_HANDLES {
            return Err(PoolError::TooManyHandles {
                count: handles.len(),
                max: MAX_ATTACH_HANDLES,
            });
        }
        if let Some(&bound) = self.callers.get(caller)
            && bound != directory
        {
            return Err(PoolError::CallerBoundElsewhere {
                caller: *caller,
                bound,
                requested: directory,
            });
        }
        match self.directories.get(&directory) {
            Some(DirectoryEntry {
                caller: Some(c), ..
            }) if c != caller => {
                return Err(PoolError::DirectoryAttachedElsewhere { directory });
            }
            None if self.directories.len() >= MAX_DIRECTORIES => {
                return Err(PoolError::TooManyDirectories {
                    max: MAX_DIRECTORIES,
                });
            }
            _ => {}
        }
        let entry = self
            .directories
            .entry(directory)
            .or_insert_with(|| DirectoryEntry {
                caller: None,
                regions: BTreeSet::new(),
                tag_answers: TagAnswers::default(),
            });
        entry.caller = Some(*caller);
        self.callers.insert(*caller, directory);
        let verdicts = handles.iter().map(|h| self.confirm(directory, h)).collect();
        let (unconfirmed_regions, first_deadline) = self.unconfirmed(directory);
        Ok(AttachReport {
            directory,
            verdicts,
            unconfirmed_regions,
            reclaim_in_ms: first_deadline.map(|d| now.ms_until(d)),
        })
    }

    /// Verifies a presented handle against the ledger.
    fn check_handle(&self, h: &Handle) -> Result<RegionRecord, PoolError> {
        if !self.secret.verify(h) {
            return Err(PoolError::BadToken { region: h.region });
        }
        match self.ledger.region(h.region) {
            None if h.region < self.ledger.next_region() => {
                Err(PoolError::RegionAlreadyFreed { region: h.region })
            }
            None => Err(PoolError::UnknownRegion { region: h.region }),
            Some(r) if !r.matches(h) => Err(PoolError::HandleMismatch { region: h.region }),
            Some(r) => Ok(*r),
        }
    }

    fn confirm(&mut self, directory: DirectoryId, h: &Handle) -> Result<(), PoolError> {
        let r = self.check_handle(h)?;
        if r.owner.directory != directory {
            return Err(PoolError::WrongOwner {
                region: r.id,
                owner: r.owner.directory,
                caller: directory,
            });
        }
        if let Some(deadline) = self.pending.remove(&r.id) {
            self.reap_queue.remove(&(deadline, r.id));
        }
        Ok(())
    }

    fn unconfirmed(&self, directory: DirectoryId) -> (u64, Option<MonotonicMs>) {
        let Some(entry) = self.directories.get(&directory) else {
            return (0, None);
        };
        let mut n = 0;
        let mut first: Option<MonotonicMs> = None;
        for id in &entry.regions {
            if let Some(&d) = self.pending.get(id) {
                n += 1;
                first = Some(first.map_or(d, |f| f.min(d)));
            }
        }
        (n, first)
    }

    /// A retried allocation that the service's reply cache answers with
    /// `region` (the manager never saw the retry): keeps the region as a
    /// retry reaching [`Request::Alloc`] with its tag would — taken off the
    /// reaper's queue, since the directory will use it — or, when it is no
    /// longer live (reclaimed or freed since), says so: the answer must not
    /// hand out a region whose bytes may be granted again. Volatile state
    /// only; nothing to journal.
    pub fn keep_retried(&mut self, caller: &Caller, region: RegionId) -> Result<(), PoolError> {
        let directory = self.bound(caller)?;
        match self.ledger.region(region) {
            Some(r) if r.owner.directory == directory => {
                if let Some(deadline) = self.pending.remove(&region) {
                    self.reap_queue.remove(&(deadline, region));
                }
                Ok(())
            }
            Some(r) => Err(PoolError::WrongOwner {
                region,
                owner: r.owner.directory,
                caller: directory,
            }),
            None => Err(PoolError::RegionAlreadyFreed { region }),
        }
    }

    fn bound(&self, caller: &Caller) -> Result<DirectoryId, PoolError> {
        self.callers
            .get(caller)
            .copied()
            .ok_or(PoolError::NotAttached { caller: *caller })
    }

    fn alloc(
        &mut self,
        caller: &Caller,
        target: PoolTarget,
        len_bytes: u64,
        instance: InstanceId,
        tag: AllocTag,
        sink: &mut impl RecordSink,
    ) -> Result<Handle, PoolError> {
        let directory = self.bound(caller)?;
        if let Some(&r) = self.ledger.region_by_tag(directory, tag) {
            let same = r.len_bytes == len_bytes
                && r.owner.instance == instance
                && (target == PoolTarget::Any || target == PoolTarget::Pool(r.pool));
            if !same {
                return Err(PoolError::TagReused { tag, region: r.id });
            }
            // The owner asked for it again and will use it: it is kept, as if
            // its handle had been presented (a region waiting for its
            // deadline — after a restart, say — must not be handed out and
            // then reclaimed under its user).
            if let Some(deadline) = self.pending.remove(&r.id) {
                self.reap_queue.remove(&(deadline, r.id));
            }
            // Remembered as if allocated now, unless it already is: after a
            // restart the answer comes from the journal's tag index alone,
            // and once the region is freed a late copy must get
            // `RegionAlreadyFreed`, not a new region (simulation seed
            // 1,184,000).
            let answers = &mut self
                .directories
                .get_mut(&directory)
                .expect("a bound caller's directory has an entry")
                .tag_answers;
            if answers.get(tag).is_none() {
                answers.remember(tag, TagAnswer::Allocated(r.id));
            }
            return Ok(self.handle_for(&r));
        }
        if tag != AllocTag::NONE {
            let entry = self
                .directories
                .get(&directory)
                .expect("a bound caller's directory has an entry");
            match entry.tag_answers.get(tag) {
                Some(TagAnswer::Refused(e)) => return Err(e.clone()),
                // Not live (the ledger was asked first): freed or reclaimed.
                Some(&TagAnswer::Allocated(region)) => {
                    return Err(PoolError::RegionAlreadyFreed { region });
                }
                None => {}
            }
        }
        let result = self.alloc_new(directory, target, len_bytes, instance, tag, sink);
        if tag != AllocTag::NONE {
            let answer = match &result {
                Ok(h) => TagAnswer::Allocated(h.region),
                Err(e) => TagAnswer::Refused(e.clone()),
            };
            self.directories
                .get_mut(&directory)
                .expect("a bound caller's directory has an entry")
                .tag_answers
                .remember(tag, answer);
        }
        result
    }

    /// Allocates a fresh region (no live region or remembered answer for the
    /// tag).
    fn alloc_new(
        &mut self,
        directory: DirectoryId,
        target: PoolTarget,
        len_bytes: u64,
        instance: InstanceId,
        tag: AllocTag,
        sink: &mut impl RecordSink,
    ) -> Result<Handle, PoolError> {
        if len_bytes == 0 {
            return Err(PoolError::ZeroLength);
        }
        if len_bytes > MAX_REGION_BYTES {
            return Err(PoolError::RegionTooLarge {
                len_bytes,
                max_bytes: MAX_REGION_BYTES,
            });
        }
        if self.ledger.region_count() >= MAX_REGIONS {
            return Err(PoolError::TooManyRegions { max: MAX_REGIONS });
        }
        let (pool, offset_bytes) = self.place(target, len_bytes)?;
        let region = RegionRecord {
            id: self.ledger.next_region(),
            pool,
            offset_bytes,
            len_bytes,
            owner: OwnerLabel {
                directory,
                instance,
            },
            tag,
        };
        let record = Record::Allocated(region);
        self.ledger.apply(&record).expect(
            "place() found a free aligned extent in an existing pool; the id is the next one",
        );
        sink.push(&record);
        self.directories
            .get_mut(&directory)
            .expect("a bound caller's directory has an entry")
            .regions
            .insert(region.id);
        Ok(self.handle_for(&region))
    }

    fn handle_for(&self, r: &RegionRecord) -> Handle {
        Handle {
            region: r.id,
            pool: r.pool,
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes,
            owner: r.owner,
            token: self
                .secret
                .token(r.id, r.pool, r.offset_bytes, r.len_bytes, r.owner),
        }
    }

    fn place(&self, target: PoolTarget, len_bytes: u64) -> Result<(PoolId, u64), PoolError> {
        let largest = |p: PoolId| self.ledger.usage(p).map_or(0, |u| u.largest_free_bytes);
        match target {
            PoolTarget::Pool(pool) => {
                let info = self
                    .ledger
                    .pool(pool)
                    .ok_or(PoolError::UnknownPool { pool })?;
                if self.modes[pool.0 as usize] != PoolMode::Online {
                    return Err(PoolError::PoolOffline { pool });
                }
                if !len_bytes.is_multiple_of(info.alignment_bytes) {
                    return Err(PoolError::LengthNotAligned {
                        len_bytes,
                        alignment_bytes: info.alignment_bytes,
                        pool: Some(pool),
                    });
                }
                match self.ledger.first_fit(pool, len_bytes) {
                    Some(offset) => Ok((pool, offset)),
                    None => Err(PoolError::NoSpace {
                        len_bytes,
                        pool: Some(pool),
                        largest_free_bytes: largest(pool),
                    }),
                }
            }
            PoolTarget::Any => {
                let mut min_alignment: Option<u64> = None;
                let mut largest_eligible: Option<u64> = None;
                for info in self.ledger.pools() {
                    if self.modes[info.id.0 as usize] != PoolMode::Online {
                        continue;
                    }
                    min_alignment = Some(
                        min_alignment.map_or(info.alignment_bytes, |m| m.min(info.alignment_bytes)),
                    );
                    if !len_bytes.is_multiple_of(info.alignment_bytes) {
                        continue;
                    }
                    if let Some(offset) = self.ledger.first_fit(info.id, len_bytes) {
                        return Ok((info.id, offset));
                    }
                    largest_eligible = Some(largest_eligible.unwrap_or(0).max(largest(info.id)));
                }
                match (min_alignment, largest_eligible) {
                    (None, _) => Err(PoolError::NoOnlinePool),
                    (Some(alignment_bytes), None) => Err(PoolError::LengthNotAligned {
                        len_bytes,
                        alignment_bytes,
                        pool: None,
                    }),
                    (Some(_), Some(largest_free_bytes)) => Err(PoolError::NoSpace {
                        len_bytes,
                        pool: None,
                        largest_free_bytes,
                    }),
                }
            }
        }
    }

    fn free(
        &mut self,
        caller: &Caller,
        h: &Handle,
        sink: &mut impl RecordSink,
    ) -> Result<Reply, PoolError> {
        let directory = self.bound(caller)?;
        let r = self.check_handle(h)?;
        if r.owner.directory != directory {
            return Err(PoolError::WrongOwner {
                region: r.id,
                owner: r.owner.directory,
                caller: directory,
            });
        }
        let record = Record::Freed { region: r.id };
        self.ledger
            .apply(&record)
            .expect("check_handle() found the region live");
        sink.push(&record);
        self.forget(&r);
        Ok(Reply::Freed {
            region: r.id,
            len_bytes: r.len_bytes,
        })
    }

    /// Drops a region that left the ledger from the volatile state.
    fn forget(&mut self, r: &RegionRecord) {
        if let Some(deadline) = self.pending.remove(&r.id) {
            self.reap_queue.remove(&(deadline, r.id));
        }
        let dir = r.owner.directory;
        if let Some(entry) = self.directories.get_mut(&dir) {
            entry.regions.remove(&r.id);
            if entry.regions.is_empty() && entry.caller.is_none() {
                self.directories.remove(&dir);
            }
        }
    }

    /// The driver's report that `caller` is gone (remote: its connection
    /// closed; local: its process exited or its pid was reused — see
    /// `liveness`). The directory it spoke for, if any, is gone from `now`:
    /// its regions that are not already waiting get a deadline of
    /// `now + grace_ms` (a region already waiting keeps its earlier deadline).
    /// Returns that directory. No journal record: nothing durable changed.
    pub fn caller_gone(&mut self, caller: &Caller, now: MonotonicMs) -> Option<DirectoryId> {
        let directory = self.callers.remove(caller)?;
        let deadline = now.plus_ms(self.config.grace_ms);
        let entry = self
            .directories
            .get_mut(&directory)
            .expect("every bound caller's directory has an entry");
        entry.caller = None;
        for id in &entry.regions {
            if !self.pending.contains_key(id) {
                self.pending.insert(*id, deadline);
                self.reap_queue.insert((deadline, *id));
            }
        }
        if entry.regions.is_empty() {
            self.directories.remove(&directory);
        }
        Some(directory)
    }

    /// The reaper: reclaims regions whose deadline is ≤ `now` (at most
    /// [`MAX_REAP_PER_TICK`]), pushing one `Reclaimed` record each.
    pub fn tick(&mut self, now: MonotonicMs, sink: &mut impl RecordSink) -> ReapReport {
        let mut report = ReapReport::default();
        while report.reclaimed.len() < MAX_REAP_PER_TICK {
            match self.reap_queue.first() {
                Some(&(deadline, _)) if deadline <= now => {}
                _ => break,
            }
            let Some((_, id)) = self.reap_queue.pop_first() else {
                break;
            };
            self.pending.remove(&id);
            let r = *self
                .ledger
                .region(id)
                .expect("queued regions are live: free and reclaim take them off the queue");
            let record = Record::Reclaimed { region: id };
            self.ledger.apply(&record).expect("the region is live");
            sink.push(&record);
            self.forget(&r);
            report.reclaimed.push(r);
        }
        report.more_due = self.reap_queue.first().is_some_and(|&(d, _)| d <= now);
        report
    }

    /// When the reaper next has work (for the driver's timer).
    pub fn next_deadline(&self) -> Option<MonotonicMs> {
        self.reap_queue.first().map(|&(d, _)| d)
    }

    /// Local callers the driver should probe for liveness (see `liveness`).
    pub fn local_callers(&self) -> impl Iterator<Item = ProcessIdentity> + '_ {
        self.callers.keys().filter_map(|c| match c {
            Caller::Local(p) => Some(*p),
            Caller::Remote { .. } => None,
        })
    }

    /// Takes a pool whose header the driver has decoded and verified against
    /// its backing (and, for a fresh pool, initialised). Journals the pool
    /// (if new) and a manager epoch above the ledger's; a header whose epoch
    /// is above the ledger's is refused ([`PoolError::StaleLedger`]).
    /// The pool stays offline until [`PoolManager::mark_online`], which the
    /// driver calls once the lease with the returned epoch is in the header.
    ///
    /// A pool unknown to the ledger whose header shows that a manager has
    /// served it is refused ([`PoolError::ForeignPool`]): it may hold regions
    /// this state knows nothing about. One whose header shows no lease is safe
    /// to adopt: no manager allocates before writing its lease.
    pub fn open_pool(
        &mut self,
        header: &Header,
        sink: &mut impl RecordSink,
    ) -> Result<OpenedPool, PoolError> {
        let id = header.identity;
        if let Some(pool) = self.ledger.pool_by_uuid(id.uuid) {
            let info = *self
                .ledger
                .pool(pool)
                .expect("pool_by_uuid returned an existing pool");
            if self.modes[pool.0 as usize] == PoolMode::Online {
                return Err(PoolError::PoolAlreadyOnline { pool });
            }
            if info.size_bytes != id.size_bytes || info.alignment_bytes != id.alignment_bytes {
                return Err(PoolError::PoolMismatch {
                    pool,
                    uuid: id.uuid,
                    ledger_size_bytes: info.size_bytes,
                    ledger_alignment_bytes: info.alignment_bytes,
                    header_size_bytes: id.size_bytes,
                    header_alignment_bytes: id.alignment_bytes,
                });
            }
            // A manager writes a lease's epoch only after journaling it, so
            // a header ahead of the ledger means this ledger lacks records of
            // the pool (an older copy of the state directory) or another
            // manager has served it since: either way regions may exist that
            // it does not know, and allocating could hand their bytes out.
            if header.epoch() > info.epoch {
                return Err(PoolError::StaleLedger {
                    pool,
                    ledger_epoch: info.epoch,
                    header_epoch: header.epoch(),
                });
            }
            let epoch = info
                .epoch
                .checked_add(1)
                .ok_or(PoolError::EpochExhausted { pool })?;
            let record = Record::PoolEpoch { pool, epoch };
            self.ledger
                .apply(&record)
                .expect("the epoch grows and the pool exists");
            sink.push(&record);
            return Ok(OpenedPool {
                pool,
                epoch,
                added: false,
            });
        }
        if header.has_served() {
            return Err(PoolError::ForeignPool {
                uuid: id.uuid,
                epoch: header.epoch(),
            });
        }
        let count = self.ledger.pools().count();
        if count >= MAX_POOLS {
            return Err(PoolError::TooManyPools { max: MAX_POOLS });
        }
        check_geometry(id.size_bytes, id.alignment_bytes).map_err(|source| {
            PoolError::BadGeometry {
                uuid: id.uuid,
                source,
            }
        })?;
        let pool = PoolId(count as u32);
        let added = Record::PoolAdded {
            pool,
            uuid: id.uuid,
            size_bytes: id.size_bytes,
            alignment_bytes: id.alignment_bytes,
        };
        self.ledger
            .apply(&added)
            .expect("next id, unknown uuid, geometry checked, below MAX_POOLS");
        let epoch = Record::PoolEpoch { pool, epoch: 1 };
        self.ledger.apply(&epoch).expect("a new pool has epoch 0");
        sink.push(&added);
        sink.push(&epoch);
        self.modes.push(PoolMode::Offline);
        Ok(OpenedPool {
            pool,
            epoch: 1,
            added: true,
        })
    }

    /// Starts serving allocations from `pool`, opened with `epoch`.
    pub fn mark_online(&mut self, pool: PoolId, epoch: u64) -> Result<(), PoolError> {
        let info = self
            .ledger
            .pool(pool)
            .ok_or(PoolError::UnknownPool { pool })?;
        if info.epoch != epoch {
            return Err(PoolError::EpochMismatch {
                pool,
                expected: info.epoch,
                given: epoch,
            });
        }
        self.modes[pool.0 as usize] = PoolMode::Online;
        Ok(())
    }

    /// Stops allocating from `pool` (its backing went away, or this manager
    /// was superseded in the pool's lease).
    pub fn mark_offline(&mut self, pool: PoolId) -> Result<(), PoolError> {
        let mode = self
            .modes
            .get_mut(pool.0 as usize)
            .ok_or(PoolError::UnknownPool { pool })?;
        *mode = PoolMode::Offline;
        Ok(())
    }

    pub fn pool_by_uuid(&self, uuid: PoolUuid) -> Option<PoolId> {
        self.ledger.pool_by_uuid(uuid)
    }

    /// A live region, if `id` names one.
    pub fn region(&self, id: RegionId) -> Option<RegionRecord> {
        self.ledger.region(id).copied()
    }

    /// The live regions of `directory` with ids above `after`, by increasing
    /// id (for listing a directory's regions one page at a time).
    pub fn regions_of(
        &self,
        directory: DirectoryId,
        after: RegionId,
    ) -> impl Iterator<Item = RegionRecord> + '_ {
        let from = RegionId(after.0.saturating_add(1));
        self.directories
            .get(&directory)
            .into_iter()
            .flat_map(move |entry| entry.regions.range(from..))
            .map(|id| {
                *self
                    .ledger
                    .region(*id)
                    .expect("a directory lists only live regions")
            })
    }

    /// The handle (with its token) that was issued for a live region.
    pub fn handle_of(&self, region: &RegionRecord) -> Handle {
        self.handle_for(region)
    }

    /// Every live region, by increasing id (statistics by owner).
    pub fn regions(&self) -> impl Iterator<Item = &RegionRecord> + '_ {
        self.ledger.regions()
    }

    pub fn pool(&self, pool: PoolId) -> Option<PoolInfo> {
        self.ledger.pool(pool).copied()
    }

    pub fn stats(&self) -> StatsReport {
        let pools = self
            .ledger
            .pools()
            .map(|info| {
                let u = self.ledger.usage(info.id).expect("listed pools exist");
                PoolStats {
                    pool: info.id,
                    uuid: info.uuid,
                    online: self.modes[info.id.0 as usize] == PoolMode::Online,
                    epoch: info.epoch,
                    size_bytes: info.size_bytes,
                    alignment_bytes: info.alignment_bytes,
                    capacity_bytes: u.capacity_bytes,
                    free_bytes: u.free_bytes,
                    largest_free_bytes: u.largest_free_bytes,
                    free_extents: u.free_extents,
                    regions: u.regions,
                    owners: u.owners,
                }
            })
            .collect();
        let attached = self
            .directories
            .values()
            .filter(|d| d.caller.is_some())
            .count() as u64;
        StatsReport {
            pools,
            next_region: self.ledger.next_region(),
            live_regions: self.ledger.region_count() as u64,
            directories_attached: attached,
            directories_gone: self.directories.len() as u64 - attached,
            regions_pending_reclaim: self.pending.len() as u64,
        }
    }

    pub fn directory(&self, directory: DirectoryId, now: MonotonicMs) -> Option<DirectoryStatus> {
        let entry = self.directories.get(&directory)?;
        let (unconfirmed_regions, first) = self.unconfirmed(directory);
        Some(DirectoryStatus {
            directory,
            attached_by: entry.caller,
            regions: entry.regions.len() as u64,
            unconfirmed_regions,
            reclaim_in_ms: first.map(|d| now.ms_until(d)),
        })
    }

    pub fn directories(&self, now: MonotonicMs) -> Vec<DirectoryStatus> {
        self.directories
            .keys()
            .filter_map(|&d| self.directory(d, now))
            .collect()
    }

    /// Checks the ledger invariants and the consistency of the volatile
    /// state with it. O(n log n); for recovery and tests.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        self.ledger.verify()?;
        self.check_bookkeeping()
    }

    /// [`PoolManager::check_invariants`] without verifying the ledger
    /// itself: for a caller that already verified a ledger of the same
    /// [`Ledger::stamp`].
    pub fn check_bookkeeping(&self) -> Result<(), InvariantError> {
        let broken = |what: String| Err(InvariantError { what });
        if self.modes.len() != self.ledger.pools().count() {
            return broken(format!(
                "{} pool modes for {} pools",
                self.modes.len(),
                self.ledger.pools().count()
            ));
        }
        let mut seen = 0usize;
        for (dir, entry) in &self.directories {
            if entry.caller.is_none() && entry.regions.is_empty() {
                return broken(format!(
                    "gone directory {dir} without regions is still tracked"
                ));
            }
            if let Some(c) = entry.caller
                && self.callers.get(&c) != Some(dir)
            {
                return broken(format!(
                    "directory {dir} names caller {c}, which is not bound to it"
                ));
            }
            for id in &entry.regions {
                match self.ledger.region(*id) {
                    Some(r) if r.owner.directory == *dir => seen += 1,
                    _ => {
                        return broken(format!(
                            "directory {dir} lists region {id}, not a live region of it"
                        ));
                    }
                }
            }
        }
        if seen != self.ledger.region_count() {
            return broken(format!(
                "{seen} regions listed by directories, {} live",
                self.ledger.region_count()
            ));
        }
        for (c, dir) in &self.callers {
            if self.directories.get(dir).and_then(|e| e.caller) != Some(*c) {
                return broken(format!(
                    "caller {c} is bound to {dir}, which does not name it"
                ));
            }
        }
        if self.pending.len() != self.reap_queue.len() {
            return broken(format!(
                "{} pending regions, {} queued",
                self.pending.len(),
                self.reap_queue.len()
            ));
        }
        for (id, d) in &self.pending {
            if !self.reap_queue.contains(&(*d, *id)) || self.ledger.region(*id).is_none() {
                return broken(format!("pending region {id} is not queued or not live"));
            }
        }
        Ok(())
    }
}
