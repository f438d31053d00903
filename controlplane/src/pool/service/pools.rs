//! Opening a pool for the service: backing, file lock, mapped header block,
//! identity, takeover check, `open_pool`, lease — and renewing the lease.
//!
//! The order is `docs/pool-manager.md` §5's:
//!
//! 1. [`PoolFileLock::acquire`] on the path (an existing file is locked
//!    before it is opened for use; a missing one is created by
//!    [`backing::open`] first, then locked);
//! 2. map the first aligned block ([`MappedRegion::map`], `Populate::Eager`)
//!    and [`header::decode`] it; a fresh (all-zero) block gets an identity
//!    with a new UUID, made visible (`publish`) and, for files, durable
//!    (`fdatasync` of the pool file, which writes back dirty shared pages);
//! 3. [`header::verify`] against the backing's size and alignment;
//! 4. [`header::check_takeover`] at the wall clock;
//! 5. [`PoolManager::open_pool`], committed;
//! 6. the first lease written and published;
//! 7. [`PoolManager::mark_online`].
//!
//! **The header block's sharing contract.** The block at offset 0 is never
//! a region (the manager allocates from `alignment` up), so no client maps
//! it for data; in this process only the core touches it, through one
//! mapping, one view at a time. Managers on other hosts write its lease
//! slots — that is the lease protocol itself, whose limits (no cross-host
//! compare-and-swap) are stated in [`header`]. Reads are preceded by
//! `acquire` and writes followed by `publish` under the pool's
//! [`Visibility`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use std::os::fd::AsRawFd;

use cxlkv_dataplane::backing::{self, Backing, BackingError, BackingKind, Extent};
use cxlkv_dataplane::ids::{PageIndex, RegionId};
use cxlkv_dataplane::map::{MapError, MapObservers, MappedRegion, PageViewMut, Populate};
use cxlkv_dataplane::visibility::{self, Visibility};

use super::PoolSpec;
use crate::pool::fence::{FenceError, PoolFileLock};
use crate::pool::header::{self, BlockState, Header, HeaderError, LeaseError, ManagerLease};
use crate::pool::store::StoreError;
use crate::pool::sys::new_pool_uuid;
use crate::pool::{PoolError, PoolId, PoolIdentity, PoolManager, PoolStore};
use crate::proto;

/// Why a pool could not be opened. Every variant names the pool's path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    #[error("pool {}: {source}", path.display())]
    Backing { path: PathBuf, source: BackingError },
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error("pool {}: cannot map its header block: {source}", path.display())]
    Map { path: PathBuf, source: MapError },
    #[error("pool {}: {source}", path.display())]
    Header { path: PathBuf, source: HeaderError },
    #[error("pool {}: {source}", path.display())]
    Lease { path: PathBuf, source: LeaseError },
    #[error("pool {}: {source}", path.display())]
    Manager { path: PathBuf, source: PoolError },
    #[error("pool {}: {source}", path.display())]
    Store { path: PathBuf, source: StoreError },
    #[error("pool {}: cannot {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
}

/// A pool this service serves: its backing, lock, header mapping and lease.
#[derive(Debug)]
pub struct OpenPool {
    pub id: PoolId,
    pub backing: Arc<dyn Backing>,
    pub visibility: Visibility,
    pub uuid: [u8; 16],
    /// False once a renewal found another holder (allocations stopped).
    pub online: bool,
    lease: ManagerLease,
    block: MappedRegion,
    /// Held for as long as this value lives: a second manager on this host
    /// is refused (see `fence`).
    _lock: PoolFileLock,
}

/// Wall-clock milliseconds since the Unix epoch (for leases only; every
/// other time is monotonic).
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl OpenPool {
    /// Opens `spec` and brings it online in `manager` (steps 1–7 of the
    /// module essay).
    pub fn open(
        spec: &PoolSpec,
        manager: &mut PoolManager,
        store: &mut PoolStore,
        lease_ms: u64,
    ) -> Result<Self, OpenError> {
        let path = spec.path.as_path();
        let mut options = backing::OpenOptions::new();
        if let Some(size) = spec.create_size_bytes {
            options = options.create_size_bytes(size);
        }
        if let Some(align) = spec.align_bytes {
            options = options.align_bytes(align);
        }
        let open_backing = || {
            backing::open(path, &options).map_err(|source| OpenError::Backing {
                path: path.to_path_buf(),
                source,
            })
        };
        let exists = path.try_exists().map_err(|source| OpenError::Io {
            path: path.to_path_buf(),
            op: "stat",
            source,
        })?;
        let (lock, backing) = if exists {
            let lock = PoolFileLock::acquire(path)?;
            (lock, open_backing()?)
        } else {
            let backing = open_backing()?;
            (PoolFileLock::acquire(path)?, backing)
        };
        let visibility = spec.visibility.unwrap_or(match backing.kind() {
            BackingKind::DevDax => Visibility::Flush,
            _ => Visibility::Coherent,
        });
        visibility::check_mode(visibility).map_err(|e| OpenError::Io {
            path: path.to_path_buf(),
            op: "serve with this visibility",
            source: io::Error::new(io::ErrorKind::Unsupported, e),
        })?;
        let align = backing.align_bytes();
        // SAFETY: the block at offset 0 is the pool's header block, which is
        // never allocated as a region, so no client writes it through a data
        // mapping; in this process only this `OpenPool` maps it, and every
        // access goes through one view at a time from the core thread (see
        // the module essay's sharing contract). The pool file is never
        // truncated by the service.
        let block = unsafe {
            MappedRegion::map(
                &*backing,
                HEADER_BLOCK_REGION,
                Extent::new(0, align),
                Populate::Eager,
                &MapObservers::new(),
            )
        }
        .map_err(|source| OpenError::Map {
            path: path.to_path_buf(),
            source,
        })?;
        let mut pool = OpenPool {
            id: PoolId(u32::MAX),
            backing,
            visibility,
            uuid: [0; 16],
            online: false,
            lease: ManagerLease {
                seq: 0,
                epoch: 0,
                expires_unix_ms: 0,
                holder: manager.manager_id(),
            },
            block,
            _lock: lock,
        };
        let h = pool.read_or_init_header()?;
        let at = |source| OpenError::Header {
            path: path.to_path_buf(),
            source,
        };
        header::verify(&h, pool.backing.size_bytes(), align).map_err(at)?;
        let now = wall_ms();
        header::check_takeover(&h, manager.manager_id(), now).map_err(|source| {
            OpenError::Lease {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let opened =
            manager
                .open_pool(&h, store.journal())
                .map_err(|source| OpenError::Manager {
                    path: path.to_path_buf(),
                    source,
                })?;
        store.commit().map_err(|source| OpenError::Store {
            path: path.to_path_buf(),
            source,
        })?;
        let lease = header::new_lease(&h, manager.manager_id(), opened.epoch, now, lease_ms);
        pool.write_lease(&lease)?;
        manager
            .mark_online(opened.pool, opened.epoch)
            .map_err(|source| OpenError::Manager {
                path: path.to_path_buf(),
                source,
            })?;
        pool.id = opened.pool;
        pool.uuid = h.identity.uuid.0;
        pool.lease = lease;
        pool.online = true;
        tracing::info!(
            pool = %opened.pool,
            path = %path.display(),
            uuid = %h.identity.uuid,
            size_bytes = h.identity.size_bytes,
            align_bytes = align,
            epoch = opened.epoch,
            added = opened.added,
            "pool online"
        );
        Ok(pool)
    }

    fn path(&self) -> &Path {
        self.backing.path()
    }

    /// The whole header block, for reading or writing from the core.
    fn block_mut(&self) -> Result<PageViewMut<'_>, OpenError> {
        let align = self.backing.align_bytes() as usize;
        // SAFETY: the header block's sharing contract (module essay): only
        // this value maps it in this process and the core takes one view at
        // a time (`&self` methods are called from the core thread only, and
        // each view is dropped before the next is taken).
        unsafe { self.block.page_mut(align, PageIndex(0), align) }.map_err(|source| {
            OpenError::Map {
                path: self.path().to_path_buf(),
                source,
            }
        })
    }

    fn read_or_init_header(&self) -> Result<Header, OpenError> {
        let at = |source| OpenError::Header {
            path: self.path().to_path_buf(),
            source,
        };
        let mut view = self.block_mut()?;
        let block = view.as_mut_bytes();
        visibility::acquire(self.visibility, block);
        match header::decode(block).map_err(at)? {
            BlockState::Initialised(h) => Ok(h),
            BlockState::Fresh => {
                let uuid = new_pool_uuid().map_err(|source| OpenError::Io {
                    path: self.path().to_path_buf(),
                    op: "get random bytes for a pool UUID",
                    source,
                })?;
                let identity = PoolIdentity {
                    uuid,
                    size_bytes: self.backing.size_bytes(),
                    alignment_bytes: self.backing.align_bytes(),
                };
                header::encode_identity(block, &identity).map_err(at)?;
                visibility::publish(self.visibility, &block[..header::HEADER_BYTES]);
                self.sync_backing()?;
                match header::decode(block).map_err(at)? {
                    BlockState::Initialised(h) => {
                        tracing::info!(path = %self.path().display(), %uuid, "initialised a fresh pool header");
                        Ok(h)
                    }
                    BlockState::Fresh => unreachable!("an identity was just written"),
                }
            }
        }
    }

    /// Makes header writes durable where the pool is a file on a disk
    /// (`fdatasync` writes back dirty shared-mapping pages; on tmpfs and
    /// devices it returns at once).
    fn sync_backing(&self) -> Result<(), OpenError> {
        // SAFETY: the descriptor is valid while `self.backing` lives;
        // fdatasync has no memory effects.
        let rc = unsafe { libc::fdatasync(self.backing.fd().as_raw_fd()) };
        if rc != 0 {
            let source = io::Error::last_os_error();
            // Character devices (devdax) do not support it: nothing to sync.
            if source.raw_os_error() != Some(libc::EINVAL) {
                return Err(OpenError::Io {
                    path: self.path().to_path_buf(),
                    op: "fdatasync",
                    source,
                });
            }
        }
        Ok(())
    }

    fn write_lease(&self, lease: &ManagerLease) -> Result<(), OpenError> {
        let mut view = self.block_mut()?;
        let block = view.as_mut_bytes();
        header::write_lease(block, lease).map_err(|source| OpenError::Header {
            path: self.path().to_path_buf(),
            source,
        })?;
        visibility::publish(self.visibility, &block[..header::HEADER_BYTES]);
        Ok(())
    }

    /// Renews the lease (re-reading the header first). On `Superseded` or
    /// `Lost` the pool is taken offline in `manager` at once and the error
    /// returned for the log; a renewal of an offline pool does nothing.
    pub fn renew(&mut self, manager: &mut PoolManager, lease_ms: u64) -> Result<(), OpenError> {
        if !self.online {
            return Ok(());
        }
        let current = {
            let mut view = self.block_mut()?;
            let block = view.as_mut_bytes();
            visibility::acquire(self.visibility, block);
            header::decode(block)
        };
        let next = match current {
            Ok(BlockState::Initialised(h)) => header::renew(&h, &self.lease, wall_ms(), lease_ms)
                .map_err(|source| OpenError::Lease {
                    path: self.path().to_path_buf(),
                    source,
                }),
            Ok(BlockState::Fresh) => Err(OpenError::Lease {
                path: self.path().to_path_buf(),
                source: LeaseError::Lost,
            }),
            Err(source) => Err(OpenError::Header {
                path: self.path().to_path_buf(),
                source,
            }),
        };
        match next {
            Ok(lease) => {
                self.write_lease(&lease)?;
                self.lease = lease;
                Ok(())
            }
            Err(e) => {
                self.online = false;
                // Only fails for an unknown pool id; this one was opened.
                let _ = manager.mark_offline(self.id);
                Err(e)
            }
        }
    }

    /// The pool as the wire announces it.
    pub fn info(&self) -> proto::PoolInfo {
        proto::PoolInfo {
            pool: self.id.0,
            uuid: self.uuid,
            size_bytes: self.backing.size_bytes(),
            align_bytes: self.backing.align_bytes(),
            path: self.path().to_string_lossy().into_owned(),
            kind: match self.backing.kind() {
                BackingKind::DevDax => proto::BackingKind::DevDax,
                _ => proto::BackingKind::File,
            },
            visibility: match self.visibility {
                Visibility::Coherent => proto::VisibilityMode::Coherent,
                Visibility::Flush => proto::VisibilityMode::Flush,
            },
        }
    }

    /// The manager epoch this service holds the pool with.
    pub fn epoch(&self) -> u64 {
        self.lease.epoch
    }
}

/// The header block is mapped under a region id no region has (ids start at
/// 1), so logs never confuse it with a data region.
const HEADER_BLOCK_REGION: RegionId = RegionId(0);
