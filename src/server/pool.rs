//! The server's side of the pool manager: the small interface the directory
//! driver needs ("allocate a region for an instance", "free a region", "list
//! this directory's regions", "how full are the pools"), and the embedded
//! implementation `cxlkv serve` uses by default.
//!
//! The interface has the shape of the pool service's `PoolService` (requests
//! submitted with a callback that runs exactly once, on any thread, and must
//! not block), so the driver is written once for an in-process pool manager
//! and for a remote `cxlkv pool` daemon.
//!
//! [`EmbeddedPool`] runs the pool-manager state machine
//! ([`cxlkv_controlplane::pool::PoolManager`]) in this process over one pool
//! file. It is the interim implementation until the pool service (journal
//! writer, pool identity headers, leases) is merged: its allocation map lives
//! in memory only, so regions do not survive a server restart (the pool file
//! does, and a restarted server starts with every region free). Requests are
//! answered inline, under a lock held for microseconds: the state machine
//! does no I/O.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use cxlkv_controlplane::pool::{
    self, AllocTag, Caller, DirectoryId, Handle, ManagerConfig, MonotonicMs, PoolError,
    PoolIdentity, PoolManager, PoolTarget, Record, Secret, Token,
};
use cxlkv_controlplane::proto::{
    self, BackingKind, ErrorCode, ErrorReply, OwnerLabel, PoolInfo, PoolStatsReply, PoolUsage,
    PoolWelcome, RegionHandle, RegionList, RegionToken, VisibilityMode,
};
use cxlkv_dataplane::backing::{self, Backing, OpenOptions};
use cxlkv_dataplane::ids::{PoolId, RegionId};
use parking_lot::Mutex;

/// A request from the directory to its pool manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolRequest {
    /// A region of at least `len_bytes` (a multiple of the pool alignment)
    /// from `pool` (or any pool), labelled for `instance_id`.
    Alloc {
        pool: Option<u32>,
        len_bytes: u64,
        instance_id: String,
    },
    /// Return a region of this directory (its token proves ownership).
    Free { region: u64, token: RegionToken },
    /// This directory's regions with ids above `after_region`, at most
    /// `max_handles`.
    List { after_region: u64, max_handles: u32 },
    /// Pool occupancy.
    Stats,
}

/// The answer to a [`PoolRequest`].
#[derive(Debug)]
pub enum PoolReply {
    Allocated(RegionHandle),
    Freed { region: u64 },
    Regions(RegionList),
    Stats(PoolStatsReply),
}

/// A request that failed as a whole: an [`ErrorCode`] number, what went
/// wrong, and the limit involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool manager: {message} (code {code}, limit {limit})")]
pub struct PoolServiceError {
    pub code: u16,
    pub message: String,
    pub limit: u64,
}

impl PoolServiceError {
    pub fn new(code: ErrorCode, message: impl Into<String>, limit: u64) -> Self {
        let e = ErrorReply::new(code, message, limit);
        Self {
            code: e.code,
            message: e.message,
            limit: e.limit,
        }
    }

    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_u16(self.code)
    }

    /// True when the same request may succeed later (`Busy`, `Timeout`, or
    /// an unexpected failure of the pool manager's side).
    pub fn is_transient(&self) -> bool {
        self.error_code()
            .is_none_or(|c| c.is_transient() || c == ErrorCode::Internal)
    }
}

/// Receives the answer to one submitted request, exactly once, on any
/// thread; it must not block.
pub type PoolCallback = Box<dyn FnOnce(Result<PoolReply, PoolServiceError>) + Send + 'static>;

/// What the directory driver calls to reach its pool manager.
pub trait PoolService: Send + Sync + fmt::Debug {
    /// Submits `request`; `done` gets the answer exactly once.
    fn submit(&self, request: PoolRequest, done: PoolCallback);
}

/// A session's opening: the pools and their descriptors (one per pool, in
/// `welcome.pools` order; empty when they cannot be passed).
#[derive(Debug)]
pub struct PoolSession {
    pub welcome: PoolWelcome,
    pub fds: Vec<OwnedFd>,
}

/// The embedded pool: one file, created if missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedPoolSpec {
    pub path: PathBuf,
    /// Size to create (or grow) the file to.
    pub size_bytes: u64,
    /// How long a gone directory's regions wait (the state machine's grace).
    pub grace_ms: u64,
}

/// Why the embedded pool could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddedPoolError {
    #[error(transparent)]
    Backing(#[from] backing::BackingError),
    #[error("cannot draw random bytes for the pool's identity: {0}")]
    Random(std::io::Error),
    #[error("pool {}: {source}", path.display())]
    Manager { path: PathBuf, source: PoolError },
    #[error("cannot duplicate the descriptor of pool {}: {source}", path.display())]
    Dup {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The pool manager state machine over one pool file, in memory (see the
/// module essay).
pub struct EmbeddedPool {
    state: Mutex<EmbeddedState>,
}

struct EmbeddedState {
    manager: PoolManager,
    /// The manager's token key (a copy, to list regions with their tokens).
    secret: Secret,
    caller: Caller,
    directory_id: String,
    directory: DirectoryId,
    /// Instance names behind the manager's 64-bit instance ids.
    names: HashMap<u64, String>,
    pool_path: String,
    /// Allocation tags: one per allocation, so the ledger's tag index stays
    /// unique (the in-process path never retries).
    next_tag: u64,
    /// Kept open for the whole life of the pool (the descriptor clients map).
    _backing: Arc<dyn Backing>,
}

impl fmt::Debug for EmbeddedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedPool").finish_non_exhaustive()
    }
}

/// The manager's 64-bit id for a name: the first 8 bytes of its BLAKE3 hash
/// (tokens are computed over ids, names travel on the wire).
fn name_id(kind: u8, name: &str) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"cxlkv embedded pool label");
    h.update(&[kind]);
    h.update(name.as_bytes());
    let mut id = [0u8; 8];
    id.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(id)
}

fn manager_error(e: &PoolError) -> PoolServiceError {
    let (code, limit) = match e {
        PoolError::NoSpace {
            largest_free_bytes, ..
        } => (ErrorCode::OutOfSpace, *largest_free_bytes),
        PoolError::PoolOffline { .. } | PoolError::NoOnlinePool => (ErrorCode::OutOfSpace, 0),
        PoolError::TooManyRegions { max } => (ErrorCode::OutOfSpace, *max as u64),
        PoolError::BadToken { .. } | PoolError::HandleMismatch { .. } => (ErrorCode::BadToken, 0),
        PoolError::UnknownRegion { .. } | PoolError::RegionAlreadyFreed { .. } => {
            (ErrorCode::UnknownRegion, 0)
        }
        PoolError::WrongOwner { .. } => (ErrorCode::NotOwner, 0),
        PoolError::ZeroLength
        | PoolError::RegionTooLarge { .. }
        | PoolError::LengthNotAligned { .. }
        | PoolError::UnknownPool { .. } => (ErrorCode::InvalidArgument, 0),
        _ => (ErrorCode::Internal, 0),
    };
    PoolServiceError::new(code, e.to_string(), limit)
}

impl EmbeddedPool {
    /// Opens (creating or growing) the pool file and starts a pool manager
    /// over it, attached as `directory_id`.
    pub fn open(
        spec: &EmbeddedPoolSpec,
        directory_id: &str,
    ) -> Result<(Arc<EmbeddedPool>, PoolSession), EmbeddedPoolError> {
        let backing = backing::open(
            &spec.path,
            &OpenOptions::new().create_size_bytes(spec.size_bytes),
        )?;
        let mut secret = [0u8; 32];
        pool::sys::random_bytes(&mut secret).map_err(EmbeddedPoolError::Random)?;
        let uuid = pool::sys::new_pool_uuid().map_err(EmbeddedPoolError::Random)?;
        let mut manager = PoolManager::new(
            Secret::from_bytes(secret),
            ManagerConfig {
                grace_ms: spec.grace_ms,
            },
        );
        let manager_err = |source| EmbeddedPoolError::Manager {
            path: spec.path.clone(),
            source,
        };
        // No journal: the records describe changes already applied in
        // memory, and nothing outlives the process (module essay).
        let mut records: Vec<Record> = Vec::new();
        let header = pool::Header {
            identity: PoolIdentity {
                uuid,
                size_bytes: backing.size_bytes(),
                alignment_bytes: backing.align_bytes(),
            },
            lease: None,
            torn_lease_slots: 0,
        };
        let opened = manager
            .open_pool(&header, &mut records)
            .map_err(manager_err)?;
        manager
            .mark_online(opened.pool, opened.epoch)
            .map_err(manager_err)?;
        let caller = Caller::Remote { connection: 0 };
        let directory = DirectoryId(name_id(1, directory_id));
        manager
            .handle(
                &caller,
                pool::Request::Attach {
                    directory,
                    handles: &[],
                },
                MonotonicMs(0),
                &mut records,
            )
            .map_err(manager_err)?;
        let fd = backing
            .fd()
            .try_clone_to_owned()
            .map_err(|source| EmbeddedPoolError::Dup {
                path: spec.path.clone(),
                source,
            })?;
        let pool_path = spec.path.to_string_lossy().into_owned();
        let info = PoolInfo {
            pool: opened.pool.0,
            uuid: uuid.0,
            size_bytes: backing.size_bytes(),
            align_bytes: backing.align_bytes(),
            path: pool_path.clone(),
            kind: match backing.kind() {
                cxlkv_dataplane::backing::BackingKind::DevDax => BackingKind::DevDax,
                _ => BackingKind::File,
            },
            visibility: VisibilityMode::Coherent,
        };
        let welcome = PoolWelcome {
            protocol_version: proto::PROTOCOL_MAX,
            manager_epoch: opened.epoch,
            pools: vec![info],
            fds_passed: 1,
            regions_held: 0,
            last_seq: 0,
        };
        let state = EmbeddedState {
            manager,
            secret: Secret::from_bytes(secret),
            caller,
            directory_id: directory_id.to_owned(),
            directory,
            names: HashMap::new(),
            pool_path,
            next_tag: 1,
            _backing: backing,
        };
        Ok((
            Arc::new(EmbeddedPool {
                state: Mutex::new(state),
            }),
            PoolSession {
                welcome,
                fds: vec![fd],
            },
        ))
    }

    /// The pool file's path.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(&self.state.lock().pool_path)
    }
}

impl EmbeddedState {
    fn to_wire(&self, h: &Handle) -> RegionHandle {
        RegionHandle {
            region: h.region.0,
            pool: h.pool.0,
            offset_bytes: h.offset_bytes,
            len_bytes: h.len_bytes,
            owner: OwnerLabel {
                directory_id: self.directory_id.clone(),
                instance_id: self
                    .names
                    .get(&h.owner.instance.0)
                    .cloned()
                    .unwrap_or_else(|| format!("#{:016x}", h.owner.instance.0)),
            },
            token: RegionToken(h.token.0),
        }
    }

    fn handle(&mut self, request: PoolRequest) -> Result<PoolReply, PoolServiceError> {
        let mut records: Vec<Record> = Vec::new();
        let now = MonotonicMs(0);
        match request {
            PoolRequest::Alloc {
                pool,
                len_bytes,
                instance_id,
            } => {
                let instance = pool::InstanceId(name_id(2, &instance_id));
                self.names.insert(instance.0, instance_id);
                let tag = AllocTag(self.next_tag);
                self.next_tag += 1;
                let target = pool.map_or(PoolTarget::Any, |p| PoolTarget::Pool(PoolId(p)));
                match self.manager.handle(
                    &self.caller,
                    pool::Request::Alloc {
                        target,
                        len_bytes,
                        instance,
                        tag,
                    },
                    now,
                    &mut records,
                ) {
                    Ok(pool::Reply::Allocated(h)) => Ok(PoolReply::Allocated(self.to_wire(&h))),
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(manager_error(&e)),
                }
            }
            PoolRequest::Free { region, token } => {
                let Some(record) = self
                    .manager
                    .snapshot()
                    .regions
                    .into_iter()
                    .find(|r| r.id == RegionId(region))
                else {
                    return Err(PoolServiceError::new(
                        ErrorCode::UnknownRegion,
                        format!("region {region} is not allocated"),
                        0,
                    ));
                };
                let handle = Handle {
                    region: record.id,
                    pool: record.pool,
                    offset_bytes: record.offset_bytes,
                    len_bytes: record.len_bytes,
                    owner: record.owner,
                    token: Token(token.0),
                };
                match self.manager.handle(
                    &self.caller,
                    pool::Request::Free { handle },
                    now,
                    &mut records,
                ) {
                    Ok(pool::Reply::Freed { region, .. }) => {
                        Ok(PoolReply::Freed { region: region.0 })
                    }
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(manager_error(&e)),
                }
            }
            PoolRequest::List {
                after_region,
                max_handles,
            } => {
                let max = (max_handles as usize).clamp(1, proto::MAX_LIST_REGIONS);
                let mine: Vec<_> = self
                    .manager
                    .snapshot()
                    .regions
                    .into_iter()
                    .filter(|r| r.owner.directory == self.directory && r.id.0 > after_region)
                    .collect();
                let secret_handles = mine
                    .iter()
                    .take(max)
                    .map(|r| self.manager_handle(r))
                    .collect::<Vec<_>>();
                Ok(PoolReply::Regions(RegionList {
                    more: mine.len() > max,
                    handles: secret_handles,
                }))
            }
            PoolRequest::Stats => {
                let stats = self.manager.stats();
                Ok(PoolReply::Stats(PoolStatsReply {
                    manager_epoch: stats.pools.first().map_or(0, |p| p.epoch),
                    pools: stats
                        .pools
                        .iter()
                        .map(|p| PoolUsage {
                            pool: p.pool.0,
                            total_bytes: p.capacity_bytes,
                            free_bytes: p.free_bytes,
                            largest_free_bytes: p.largest_free_bytes,
                            regions: p.regions,
                            owners: Vec::new(),
                        })
                        .collect(),
                }))
            }
        }
    }

    /// The handle of a region of this directory, with its token.
    fn manager_handle(&self, r: &pool::RegionRecord) -> RegionHandle {
        let token = self
            .secret
            .token(r.id, r.pool, r.offset_bytes, r.len_bytes, r.owner);
        self.to_wire(&Handle {
            region: r.id,
            pool: r.pool,
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes,
            owner: r.owner,
            token,
        })
    }
}

fn unexpected(reply: &pool::Reply) -> PoolServiceError {
    PoolServiceError::new(
        ErrorCode::Internal,
        format!("pool manager answered with an unexpected {reply:?}"),
        0,
    )
}

impl PoolService for EmbeddedPool {
    fn submit(&self, request: PoolRequest, done: PoolCallback) {
        let result = self.state.lock().handle(request);
        done(result);
    }
}

/// `fds` duplicated (each client gets its own copies, which the transport
/// closes once sent).
pub(crate) fn dup_fds(fds: &[OwnedFd]) -> std::io::Result<Vec<OwnedFd>> {
    fds.iter()
        .map(|fd| fd.as_fd().try_clone_to_owned())
        .collect()
}
