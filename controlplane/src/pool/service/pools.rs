//! Opening a pool for the service: backing, file lock, header block,
//! identity, takeover check, `open_pool`, lease — and renewing the lease.
//!
//! The order is `docs/pool-manager.md` §5's:
//!
//! 1. [`PoolFileLock::acquire`] on the path (an existing file is locked
//!    before it is opened for use; a missing one is created by
//!    [`backing::open`] first, then locked). What is already there is
//!    checked before anything is created or sized ("Sizing", "A lost
//!    header");
//! 2. read the first aligned block and [`header::decode`] it; a fresh
//!    (all-zero) block gets an identity with a new UUID, written and, for
//!    files, made durable (`fdatasync`);
//! 3. [`header::verify`] against the backing's size and alignment;
//! 4. [`header::check_takeover`] at the wall clock;
//! 5. [`PoolManager::open_pool`], committed; the path recorded in
//!    `<state>/pool-paths` ([`super::paths`]);
//! 6. the first lease written;
//! 7. [`PoolManager::mark_online`].
//!
//! **Sizing.** A pool's size and alignment are written into its header when
//! it is initialised and never change (the ledger's regions are laid out in
//! them). So an existing file is read first, without changing it: one whose
//! header is initialised is opened as it is — never grown — and refused if
//! the configuration asks for more bytes or another alignment than the
//! header holds, naming both; a first block that is not zero and not a pool
//! is refused as before. Only a missing file, or one whose first block is
//! all zero, is created or grown to `size_bytes` (and [`backing::open`]
//! refuses sizes its tmpfs or hugetlbfs cannot hold). A file larger than its
//! header says (grown by hand, or by an older build) is refused with the
//! `truncate` that puts it back.
//!
//! **Header I/O, and why not a mapping.** Clients receive the pool
//! descriptor read-write, so any of them can `ftruncate` the file. A mapped
//! header block would then raise `SIGBUS` in the manager at the next renewal
//! — the whole service down over one pool. So a file's header is read and
//! written with `pread`/`pwrite` on the pool descriptor: a truncated file is
//! a short read, an I/O error that takes the pool offline as a lost lease
//! does, and a file shorter than its header block is never written (which
//! would grow it again). hugetlbfs refuses `write(2)`: there the header is
//! written into a mapping of the block, but copied by the kernel (through a
//! pipe, `KernelCopy`), so a truncated file gives `EFAULT`, never a
//! signal; reads are `pread`s. A device-DAX device has no `read`/`write` and
//! cannot be truncated: its block is mapped and accessed only by
//! `MappedRegion::read_shared` and `write_shared` — no reference is formed
//! over bytes other hosts' managers write — reads made current first
//! (`acquire`) and writes made visible after (`publish`) under the pool's
//! [`Visibility`]. For a file
//! of visibility `flush`, each header write is followed by `fdatasync`,
//! which on a DAX file system writes the CPU caches back.
//!
//! **A lost header.** The ledger knows pools by the UUID in their header;
//! `<state>/pool-paths` ties each path to the pool last served from it. A
//! path whose file is missing, or whose first block is all zero, while that
//! file names a pool the ledger knows, is refused and left as it is:
//! initialising it would add a second, empty pool while the ledger still
//! holds the regions of the first, whose bytes are gone.
//!
//! **The header block's sharing contract.** The block at offset 0 is never
//! a region (the manager allocates from `alignment` up), so no client writes
//! it for data; in this process only the core touches it, one access at a
//! time. Managers on other hosts write its lease slots — that is the lease
//! protocol itself, whose limits (no cross-host compare-and-swap) are stated
//! in [`header`]; so a renewal writes back only its own slot
//! ([`header::lease_slot_range`]). A client that writes or truncates the
//! block anyway (it has the descriptor) can take the pool offline, not stop
//! the manager.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use cxlkv_dataplane::backing::{
    self, Backing, BackingError, BackingKind, DEFAULT_ALIGN_BYTES, Extent,
};
use cxlkv_dataplane::ids::{PageIndex, RegionId};
use cxlkv_dataplane::map::{MapError, MapObservers, MappedRegion, Populate};
use cxlkv_dataplane::visibility::{self, Visibility};

use super::PoolSpec;
use super::paths::{self, PathsError, PoolPaths};
use crate::pool::fence::{FenceError, PoolFileLock};
use crate::pool::header::{
    self, BlockState, HEADER_BYTES, Header, HeaderError, LeaseError, ManagerLease,
};
use crate::pool::store::StoreError;
use crate::pool::sys::new_pool_uuid;
use crate::pool::{PoolError, PoolId, PoolIdentity, PoolManager, PoolStore, PoolUuid};
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
    #[error(
        "pool {} was initialised for {initialised_bytes} bytes and the configuration asks for \
         {requested_bytes}: a pool's size cannot change once initialised, and the file was left as \
         it is. Serve it at its size (size_bytes = {initialised_bytes}, or no size), or create the \
         larger pool at another path",
        path.display()
    )]
    SizeChanged {
        path: PathBuf,
        initialised_bytes: u64,
        requested_bytes: u64,
    },
    #[error(
        "pool {} was initialised with alignment {initialised_bytes} and the configuration asks for \
         {requested_bytes} (align_bytes; 2 MiB by default, raised to a device's or hugetlbfs's page \
         size): a pool's alignment cannot change once initialised, and the file was left as it is. \
         Set align_bytes = {initialised_bytes}",
        path.display()
    )]
    AlignmentChanged {
        path: PathBuf,
        initialised_bytes: u64,
        requested_bytes: u64,
    },
    #[error(
        "pool {} was initialised for {initialised_bytes} bytes but the file has {file_bytes}: it \
         was grown after initialisation (by hand, or by an older cxlkv given a larger size). \
         `truncate -s {initialised_bytes} {}` puts it back (no region lies past byte \
         {initialised_bytes})",
        path.display(),
        path.display()
    )]
    FileGrown {
        path: PathBuf,
        initialised_bytes: u64,
        file_bytes: u64,
    },
    #[error(
        "pool {}: {what}, but this state directory served pool {pool} (uuid {uuid}) from this path \
         and may still hold regions of it: refusing to initialise a new pool in its place (nothing \
         was written). Restore the pool file if you can; if its contents are gone, stop every \
         client of it and start afresh with a new state directory (docs/operations.md)",
        path.display()
    )]
    KnownPoolLost {
        path: PathBuf,
        what: &'static str,
        pool: PoolId,
        uuid: PoolUuid,
    },
    #[error(transparent)]
    Paths(#[from] PathsError),
}

/// A pool this service serves: its backing, lock, header access and lease.
#[derive(Debug)]
pub struct OpenPool {
    pub id: PoolId,
    pub backing: Arc<dyn Backing>,
    pub visibility: Visibility,
    pub uuid: [u8; 16],
    /// False once a renewal failed (another holder, or the header could not
    /// be read or written): allocations stopped.
    pub online: bool,
    lease: ManagerLease,
    header_io: HeaderIo,
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

/// What an existing path holds, read before anything may size it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// Not a regular file (a device): nothing to read, nothing to size.
    NotAFile,
    /// A file whose first block (as far as it goes) is all zero.
    ZeroBlock,
    /// A file with an initialised header.
    Initialised(PoolIdentity),
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
        let key = paths::key_of(path);
        let mut registry = PoolPaths::load(store.dir())?;
        let known = registry
            .uuid_at(&key)
            .and_then(|uuid| manager.pool_by_uuid(uuid).map(|pool| (pool, uuid)));
        let lost = |what| match known {
            Some((pool, uuid)) => Err(OpenError::KnownPoolLost {
                path: path.to_path_buf(),
                what,
                pool,
                uuid,
            }),
            None => Ok(()),
        };
        let exists = path.try_exists().map_err(|source| OpenError::Io {
            path: path.to_path_buf(),
            op: "stat",
            source,
        })?;
        if !exists {
            lost("the pool file is missing")?;
        }
        let lock = exists.then(|| PoolFileLock::acquire(path)).transpose()?;
        let found = if exists {
            Some(read_existing(
                path,
                spec.align_bytes.unwrap_or(DEFAULT_ALIGN_BYTES),
                spec.create_size_bytes.is_some(),
            )?)
        } else {
            None
        };
        let mut options = backing::OpenOptions::new();
        if let Some(align) = spec.align_bytes {
            options = options.align_bytes(align);
        }
        let initialised = match found {
            Some(Found::Initialised(identity)) => {
                check_request(path, spec, &identity)?;
                true
            }
            Some(Found::ZeroBlock) => {
                lost("its header block is all zero (the file was truncated or wiped)")?;
                false
            }
            Some(Found::NotAFile) | None => false,
        };
        // An initialised pool is never sized: its request was checked
        // against the header instead.
        if let Some(size) = spec.create_size_bytes
            && !initialised
        {
            options = options.create_size_bytes(size);
        }
        let backing = backing::open(path, &options).map_err(|source| OpenError::Backing {
            path: path.to_path_buf(),
            source,
        })?;
        let lock = match lock {
            Some(lock) => lock,
            None => PoolFileLock::acquire(path)?,
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
        let header_io = HeaderIo::open(&*backing)?;
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
            header_io,
            _lock: lock,
        };
        let h = match pool.read_block()? {
            BlockState::Initialised(h) => h,
            BlockState::Fresh => {
                // A device is not read before it is opened; a file may have
                // been wiped since.
                lost("its header block is all zero (it was wiped)")?;
                pool.init_header()?
            }
        };
        pool.verify(&h)?;
        let align = pool.backing.align_bytes();
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
        // Before the first allocation can happen: from here on the ledger
        // may hold regions of this pool, so its path must be known.
        registry.record(&key, h.identity.uuid, |uuid| {
            manager.pool_by_uuid(uuid).is_some()
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

    fn io_error(&self, op: &'static str) -> impl FnOnce(io::Error) -> OpenError + '_ {
        move |source| OpenError::Io {
            path: self.path().to_path_buf(),
            op,
            source,
        }
    }

    fn map_error(&self) -> impl FnOnce(MapError) -> OpenError + '_ {
        move |source| OpenError::Map {
            path: self.path().to_path_buf(),
            source,
        }
    }

    /// Reads and decodes the header block. An all-zero header with data
    /// further in the block is "not a pool", as [`header::decode`] says of
    /// a whole block.
    fn read_block(&self) -> Result<BlockState, OpenError> {
        let bytes = self.read_header_bytes()?;
        let state = header::decode(&bytes).map_err(|source| OpenError::Header {
            path: self.path().to_path_buf(),
            source,
        })?;
        if state == BlockState::Fresh && !self.rest_of_block_is_zero()? {
            return Err(OpenError::Header {
                path: self.path().to_path_buf(),
                source: HeaderError::NotAPool { found: [0; 8] },
            });
        }
        Ok(state)
    }

    /// The header's bytes, `[0, HEADER_BYTES)` of the block.
    fn read_header_bytes(&self) -> Result<[u8; HEADER_BYTES], OpenError> {
        let mut bytes = [0u8; HEADER_BYTES];
        match &self.header_io {
            HeaderIo::File(file) | HeaderIo::Hugetlbfs { file, .. } => {
                read_at(file, &mut bytes, 0).map_err(self.io_error("read the header block"))?;
            }
            HeaderIo::Device(block) => {
                // Other hosts' managers may be writing their lease slots:
                // copied without forming a reference, checked by checksum.
                block
                    .read_shared(0, &mut bytes, self.visibility)
                    .map_err(self.map_error())?;
            }
        }
        Ok(bytes)
    }

    /// Whether the block past the header, `[HEADER_BYTES, align)`, is zero.
    fn rest_of_block_is_zero(&self) -> Result<bool, OpenError> {
        let align = self.backing.align_bytes();
        match &self.header_io {
            HeaderIo::File(file) | HeaderIo::Hugetlbfs { file, .. } => {
                zero_between(file, HEADER_BYTES as u64, align)
                    .map_err(self.io_error("read the header block"))
            }
            HeaderIo::Device(block) => {
                device_zero_between(block, HEADER_BYTES, align as usize, self.visibility)
                    .map_err(self.map_error())
            }
        }
    }

    /// Writes `bytes` at `offset` of the block (within the header) and makes
    /// them visible: published on a device; on a file of visibility `flush`,
    /// synced (see the module essay).
    fn write_header_bytes(&self, offset: usize, bytes: &[u8]) -> Result<(), OpenError> {
        assert!(
            offset + bytes.len() <= HEADER_BYTES,
            "only the header's bytes are ever written"
        );
        let op = "write the header block";
        match &self.header_io {
            HeaderIo::File(file) => {
                check_holds_block(file, self.backing.align_bytes()).map_err(self.io_error(op))?;
                file.write_all_at(bytes, offset as u64)
                    .map_err(self.io_error(op))?;
                if self.visibility == Visibility::Flush {
                    self.sync_backing()?;
                }
            }
            HeaderIo::Hugetlbfs { file, block, copy } => {
                check_holds_block(file, self.backing.align_bytes()).map_err(self.io_error(op))?;
                let align = self.backing.align_bytes() as usize;
                // SAFETY: the view is only handed to the kernel as the
                // destination of `read(2)` (no load or store of this process
                // touches it, so a truncated file cannot fault here), and the
                // core takes one view of the block at a time.
                let mut view = unsafe { block.page_mut(align, PageIndex(0), HEADER_BYTES) }
                    .map_err(self.map_error())?;
                let dst = &mut view.as_mut_bytes()[offset..offset + bytes.len()];
                copy.copy(bytes, dst).map_err(self.io_error(op))?;
            }
            HeaderIo::Device(block) => {
                // SAFETY: the header block's sharing contract (module
                // essay): on a device no view of the block is ever taken in
                // this process — every access is `read_shared` or
                // `write_shared` — and a device cannot be truncated, so the
                // mapping stays backed.
                unsafe { block.write_shared(offset, bytes, self.visibility) }
                    .map_err(self.map_error())?;
            }
        }
        Ok(())
    }

    /// Writes the identity of a fresh pool and reads it back.
    fn init_header(&self) -> Result<Header, OpenError> {
        let at = |source| OpenError::Header {
            path: self.path().to_path_buf(),
            source,
        };
        let uuid = new_pool_uuid().map_err(self.io_error("get random bytes for a pool UUID"))?;
        let identity = PoolIdentity {
            uuid,
            size_bytes: self.backing.size_bytes(),
            alignment_bytes: self.backing.align_bytes(),
        };
        let mut bytes = [0u8; HEADER_BYTES];
        header::encode_identity(&mut bytes, &identity).map_err(at)?;
        self.write_header_bytes(header::IDENTITY_RANGE.start, &bytes[header::IDENTITY_RANGE])?;
        self.sync_backing()?;
        match self.read_block()? {
            BlockState::Initialised(h) if h.identity == identity => {
                tracing::info!(path = %self.path().display(), %uuid, "initialised a fresh pool header");
                Ok(h)
            }
            _ => Err(OpenError::Io {
                path: self.path().to_path_buf(),
                op: "initialise the header",
                source: io::Error::other("the identity just written does not read back"),
            }),
        }
    }

    /// Checks the header against the backing, naming what to do when a
    /// file's size or the alignment asked for differ from the header's.
    fn verify(&self, h: &Header) -> Result<(), OpenError> {
        let path = self.path().to_path_buf();
        match header::verify(h, self.backing.size_bytes(), self.backing.align_bytes()) {
            Ok(()) => Ok(()),
            Err(HeaderError::SizeMismatch {
                header_bytes,
                backing_bytes,
            }) if self.backing.kind() != BackingKind::DevDax && backing_bytes > header_bytes => {
                Err(OpenError::FileGrown {
                    path,
                    initialised_bytes: header_bytes,
                    file_bytes: backing_bytes,
                })
            }
            Err(HeaderError::AlignmentMismatch {
                header_bytes,
                backing_bytes,
            }) => Err(OpenError::AlignmentChanged {
                path,
                initialised_bytes: header_bytes,
                requested_bytes: backing_bytes,
            }),
            Err(source) => Err(OpenError::Header { path, source }),
        }
    }

    /// Makes header writes durable where the pool is a file on a disk
    /// (`fdatasync`; on tmpfs it returns at once, on a DAX file system it
    /// also writes the CPU caches back).
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

    /// Writes `lease` into its slot, and only that slot.
    fn write_lease(&self, lease: &ManagerLease) -> Result<(), OpenError> {
        let mut bytes = [0u8; HEADER_BYTES];
        header::write_lease(&mut bytes, lease).map_err(|source| OpenError::Header {
            path: self.path().to_path_buf(),
            source,
        })?;
        let slot = header::lease_slot_range(lease);
        self.write_header_bytes(slot.start, &bytes[slot])
    }

    /// Renews the lease (re-reading the header first). On any failure —
    /// `Superseded` or `Lost`, a header that no longer decodes, or one that
    /// cannot be read or written (a truncated file) — the pool is taken
    /// offline in `manager` at once and the error returned for the log; a
    /// renewal of an offline pool does nothing.
    pub fn renew(&mut self, manager: &mut PoolManager, lease_ms: u64) -> Result<(), OpenError> {
        if !self.online {
            return Ok(());
        }
        match self.next_lease(lease_ms) {
            Ok(lease) => {
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

    /// Reads the header, computes the renewed lease and writes it.
    fn next_lease(&self, lease_ms: u64) -> Result<ManagerLease, OpenError> {
        let bytes = self.read_header_bytes()?;
        let lease = match header::decode(&bytes) {
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
        }?;
        self.write_lease(&lease)?;
        Ok(lease)
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

/// How this process reads and writes a pool's header block (module essay).
#[derive(Debug)]
enum HeaderIo {
    /// A regular file on tmpfs or any other file system: `pread`/`pwrite`
    /// on a duplicate of the pool descriptor.
    File(File),
    /// A file on hugetlbfs: `pread`, and writes into a mapping of the
    /// block copied by the kernel.
    Hugetlbfs {
        file: File,
        block: MappedRegion,
        copy: KernelCopy,
    },
    /// A device-DAX device: the block, mapped.
    Device(MappedRegion),
}

impl HeaderIo {
    fn open(backing: &dyn Backing) -> Result<Self, OpenError> {
        let path = backing.path();
        let io_error = |op| {
            move |source| OpenError::Io {
                path: path.to_path_buf(),
                op,
                source,
            }
        };
        let map_block = || {
            // SAFETY: the block at offset 0 is the pool's header block, never
            // allocated as a region, so no client writes it through a data
            // mapping; in this process only this `OpenPool` maps it and every
            // access goes through one view at a time from the core thread
            // (the module essay's sharing contract). A file's mapping is
            // touched by the kernel only (`KernelCopy`): if a client
            // truncates the file, that copy fails instead of this process
            // faulting; a device cannot be truncated.
            unsafe {
                MappedRegion::map(
                    backing,
                    HEADER_BLOCK_REGION,
                    Extent::new(0, backing.align_bytes()),
                    Populate::Eager,
                    &MapObservers::new(),
                )
            }
            .map_err(|source| OpenError::Map {
                path: path.to_path_buf(),
                source,
            })
        };
        let dup = || {
            backing
                .fd()
                .try_clone_to_owned()
                .map(File::from)
                .map_err(io_error("duplicate the pool descriptor"))
        };
        Ok(match backing.kind() {
            BackingKind::DevDax => HeaderIo::Device(map_block()?),
            BackingKind::Hugetlbfs => HeaderIo::Hugetlbfs {
                file: dup()?,
                block: map_block()?,
                copy: KernelCopy::new().map_err(io_error("create a pipe"))?,
            },
            _ => HeaderIo::File(dup()?),
        })
    }
}

/// Whether the mapped device block is zero in `[from, to)`, read as
/// [`MappedRegion::read_shared`] reads (no reference formed over bytes
/// other hosts may be writing), a chunk at a time.
fn device_zero_between(
    block: &MappedRegion,
    from: usize,
    to: usize,
    mode: Visibility,
) -> Result<bool, MapError> {
    let mut chunk = vec![0u8; 64 << 10];
    let mut at = from;
    while at < to {
        let n = chunk.len().min(to - at);
        block.read_shared(at, &mut chunk[..n], mode)?;
        if chunk[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n;
    }
    Ok(true)
}

/// `pread` of exactly `buf.len()` bytes at `offset`; a file that ends
/// before is an error saying so (a truncated pool), not a short read.
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            let len = file.metadata().map_or(0, |m| m.len());
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the pool file is {len} bytes, shorter than its header block: truncated"),
            )
        } else {
            e
        }
    })
}

/// Whether `file`'s bytes `[from, end)` are all zero (read in 64 KiB
/// chunks: `end - from` is at most one block, so the reads are bounded).
fn zero_between(file: &File, from: u64, end: u64) -> io::Result<bool> {
    const CHUNK_BYTES: u64 = 64 << 10;
    let mut chunk = vec![0u8; CHUNK_BYTES.min(end.saturating_sub(from)) as usize];
    let mut at = from;
    while at < end {
        let n = (end - at).min(CHUNK_BYTES) as usize;
        read_at(file, &mut chunk[..n], at)?;
        if chunk[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Refuses to write into a file shorter than its header block: `pwrite`
/// would grow a truncated file again, hiding what happened to it.
fn check_holds_block(file: &File, align_bytes: u64) -> io::Result<()> {
    let len = file.metadata()?.len();
    if len < align_bytes {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the pool file is {len} bytes, shorter than its header block: truncated"),
        ));
    }
    Ok(())
}

/// Reads what an existing path holds without changing it (module essay,
/// "Sizing"): only a regular file is read — its first `min(len, HEADER_BYTES)`
/// bytes, and the rest of its first block up to `align_bytes` when those
/// are zero. A header that does not decode is refused here, untouched.
fn read_existing(path: &Path, align_bytes: u64, creating: bool) -> Result<Found, OpenError> {
    use std::os::unix::fs::MetadataExt;
    let io_error = |op| {
        move |source| OpenError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    // The ownership rule `backing::open` applies to a pool it may create,
    // applied before this read: a file or symlink another user planted in
    // its place (in the shared /dev/shm, say) is not read through either.
    if creating {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let link = std::fs::symlink_metadata(path).map_err(io_error("stat"))?;
        if link.uid() != euid && link.uid() != 0 {
            let what = if link.file_type().is_symlink() {
                "is a symlink of"
            } else {
                "is a file of"
            };
            return Err(OpenError::Backing {
                path: path.to_path_buf(),
                source: BackingError::NotOwned {
                    path: path.to_path_buf(),
                    what,
                    uid: link.uid(),
                    euid,
                },
            });
        }
    }
    let meta = std::fs::metadata(path).map_err(io_error("stat"))?;
    if !meta.is_file() {
        return Ok(Found::NotAFile);
    }
    // O_NONBLOCK: should the path be swapped for a FIFO meanwhile, the open
    // does not wait for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(io_error("open"))?;
    let len = file.metadata().map_err(io_error("stat"))?.len();
    let mut bytes = [0u8; HEADER_BYTES];
    let n = len.min(HEADER_BYTES as u64) as usize;
    file.read_exact_at(&mut bytes[..n], 0)
        .map_err(io_error("read the header block"))?;
    let not_a_pool = |found: [u8; 8]| OpenError::Header {
        path: path.to_path_buf(),
        source: HeaderError::NotAPool { found },
    };
    match header::decode(&bytes) {
        Ok(BlockState::Initialised(h)) => Ok(Found::Initialised(h.identity)),
        Ok(BlockState::Fresh) => {
            if zero_between(&file, HEADER_BYTES as u64, len.min(align_bytes))
                .map_err(io_error("read the header block"))?
            {
                Ok(Found::ZeroBlock)
            } else {
                Err(not_a_pool([0; 8]))
            }
        }
        Err(source) => Err(OpenError::Header {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Refuses a configuration that would change an initialised pool: more
/// bytes than its header holds (rounded up to its alignment, as sizing
/// would), or a larger alignment. Fewer bytes are not a change: files are
/// never shrunk, and a device's size is a minimum.
fn check_request(path: &Path, spec: &PoolSpec, identity: &PoolIdentity) -> Result<(), OpenError> {
    if let Some(align) = spec.align_bytes
        && align > identity.alignment_bytes
    {
        return Err(OpenError::AlignmentChanged {
            path: path.to_path_buf(),
            initialised_bytes: identity.alignment_bytes,
            requested_bytes: align,
        });
    }
    if let Some(size) = spec.create_size_bytes {
        let rounded = size
            .div_ceil(identity.alignment_bytes)
            .saturating_mul(identity.alignment_bytes);
        if rounded > identity.size_bytes {
            return Err(OpenError::SizeChanged {
                path: path.to_path_buf(),
                initialised_bytes: identity.size_bytes,
                requested_bytes: size,
            });
        }
    }
    Ok(())
}

/// Copies bytes into memory that may have lost its backing — a mapping of a
/// file someone truncated — through a pipe: the kernel's copy into such
/// memory fails with `EFAULT`, where a store from this process would raise
/// `SIGBUS`.
#[derive(Debug)]
struct KernelCopy {
    read_end: OwnedFd,
    write_end: OwnedFd,
}

impl KernelCopy {
    fn new() -> io::Result<Self> {
        let mut fds: [libc::c_int; 2] = [-1; 2];
        // SAFETY: `fds` is a writable array of two descriptors, which is
        // what pipe2 fills.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are new descriptors that nothing
        // else owns.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Self {
            read_end,
            write_end,
        })
    }

    /// Copies `src` into `dst` (equal lengths, at most `PIPE_BUF` bytes, so
    /// that the pipe takes it in one atomic write). On failure the pipe is
    /// drained, so the next copy starts from an empty pipe.
    fn copy(&self, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        assert_eq!(src.len(), dst.len(), "a copy has one length");
        assert!(src.len() <= libc::PIPE_BUF, "one atomic pipe write");
        // SAFETY: `src` is valid for reads of its length during the call.
        let written =
            unsafe { libc::write(self.write_end.as_raw_fd(), src.as_ptr().cast(), src.len()) };
        if written != src.len() as isize {
            return Err(if written < 0 {
                io::Error::last_os_error()
            } else {
                io::Error::other("short write into an empty pipe")
            });
        }
        // SAFETY: `dst` is valid for writes of its length during the call;
        // if its pages lost their backing, the kernel's copy stops with
        // EFAULT (or short) instead of writing.
        let read = unsafe {
            libc::read(
                self.read_end.as_raw_fd(),
                dst.as_mut_ptr().cast(),
                dst.len(),
            )
        };
        if read == dst.len() as isize {
            return Ok(());
        }
        let err = if read < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::other("the header block lost its backing during the copy")
        };
        let mut scratch = [0u8; HEADER_BYTES];
        // At most `src.len()` bytes are left: bounded by src.len() / HEADER_BYTES + 1 reads.
        for _ in 0..=src.len() / HEADER_BYTES {
            // SAFETY: `scratch` is valid for writes of its length.
            let n = unsafe {
                libc::read(
                    self.read_end.as_raw_fd(),
                    scratch.as_mut_ptr().cast(),
                    scratch.len(),
                )
            };
            if n <= 0 {
                break;
            }
        }
        Err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALIGN: u64 = 2 << 20;

    /// A one-block pool file under `/dev/shm` and its header block mapped
    /// as a device's is: (its directory, its path, the mapping).
    fn tmpfs_header_block(prefix: &str) -> (tempfile::TempDir, PathBuf, MappedRegion) {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/dev/shm")
            .unwrap();
        let path = dir.path().join("pool");
        let backing =
            backing::open(&path, &backing::OpenOptions::new().create_size_bytes(ALIGN)).unwrap();
        // SAFETY: each test is the only user of its file and mapping, and
        // says how it touches the block.
        let block = unsafe {
            MappedRegion::map(
                &*backing,
                HEADER_BLOCK_REGION,
                Extent::new(0, ALIGN),
                Populate::Eager,
                &MapObservers::new(),
            )
        }
        .unwrap();
        (dir, path, block)
    }

    /// The device header path's zero scan (on a tmpfs mapping, as a device
    /// is mapped): a byte anywhere in the range, also past the first chunk,
    /// makes it non-zero; bytes outside do not.
    #[test]
    fn a_device_blocks_zero_scan_sees_every_byte_of_its_range_and_no_other() {
        // The test is the only user of the mapping, accessed by
        // `read_shared`/`write_shared` only.
        let (_dir, _path, block) = tmpfs_header_block("cxlkv-devzero-");
        let len = ALIGN as usize;
        for mode in [Visibility::Coherent, Visibility::Flush] {
            assert!(device_zero_between(&block, HEADER_BYTES, len, mode).unwrap());
            let at = HEADER_BYTES + (200 << 10) + 3;
            // SAFETY: no view of the block exists.
            unsafe { block.write_shared(at, &[1], mode) }.unwrap();
            assert!(!device_zero_between(&block, HEADER_BYTES, len, mode).unwrap());
            assert!(!device_zero_between(&block, at, at + 1, mode).unwrap());
            assert!(device_zero_between(&block, HEADER_BYTES, at, mode).unwrap());
            assert!(device_zero_between(&block, at + 1, len, mode).unwrap());
            assert!(device_zero_between(&block, at + 1, len + 1, mode).is_err());
            // SAFETY: as above.
            unsafe { block.write_shared(at, &[0], mode) }.unwrap();
        }
    }

    /// The hugetlbfs write path in miniature, on tmpfs: a copy into a
    /// mapping whose file was truncated is an error (a store from this
    /// process would be `SIGBUS`), and the pipe is left empty for the next.
    #[test]
    fn a_kernel_copy_into_a_truncated_mapping_is_an_error_not_a_signal() {
        // After the truncation below the mapping is touched by the kernel
        // only (`KernelCopy`), never by this process.
        let (_dir, path, block) = tmpfs_header_block("cxlkv-kcopy-");
        let align = ALIGN;
        let copy = KernelCopy::new().unwrap();
        let file = File::open(&path).unwrap();
        let write = |src: &[u8]| {
            // SAFETY: the only view of the block in this test; it goes to
            // the kernel only.
            let mut view =
                unsafe { block.page_mut(align as usize, PageIndex(0), HEADER_BYTES) }.unwrap();
            copy.copy(src, &mut view.as_mut_bytes()[..src.len()])
        };
        write(&[0x11; HEADER_BYTES]).unwrap();
        let mut back = [0u8; HEADER_BYTES];
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, [0x11; HEADER_BYTES]);

        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        let e = write(&[0x22; HEADER_BYTES]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
        assert!(write(&[0x33; 64]).is_err(), "still gone");

        // Backed again: the next copy lands whole, so nothing stale was left
        // in the pipe.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(align)
            .unwrap();
        write(&[0x44; 100]).unwrap();
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(&back[..100], &[0x44; 100][..]);
        assert!(back[100..].iter().all(|&b| b == 0));
    }
}
