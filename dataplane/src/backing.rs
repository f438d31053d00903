//! Pool backings: the device or file a pool lives in, behind one trait.
//!
//! A pool is one contiguous byte range that every participant can map with
//! `MAP_SHARED`. Three kinds of object provide it, and after [`open`] the rest
//! of cxlkv sees only the [`Backing`] trait (kind, path, size, alignment, fd):
//!
//! - **Device DAX** (`/dev/daxX.Y`, a character device): CXL Type-3 memory or
//!   persistent memory exposed without a filesystem. Its size and alignment are
//!   not in `fstat`; the kernel publishes them in sysfs, under the device's
//!   `<sysfs>/dev/char/<major>:<minor>/` directory (a symlink to the device,
//!   the same directory as `/sys/bus/dax/devices/daxX.Y/`):
//!   - `size`: bytes, decimal (every kernel with device DAX);
//!   - `align`: bytes, decimal; per device since Linux 5.10. Older kernels only
//!     have the region-wide `../dax_region/align` beside the device, which is
//!     read when `align` is missing.
//!
//!   The kernel refuses a device-DAX mapping whose address, offset or length
//!   is not a multiple of `align`, so the pool alignment is never smaller.
//!   The sysfs root is an [`OpenOptions`] field, and
//!   [`OpenOptions::assume_devdax`] lets a regular file stand in for the
//!   character device: tests then run this very code path (sysfs parsing,
//!   sizing, alignment, mapping) on a fake device.
//! - **File on tmpfs** (`/dev/shm`): the embedded default. Created and sized
//!   on demand ([`OpenOptions::create_size_bytes`]); RAM-backed and sparse, so
//!   memory is used only where regions are populated — which is why sizing
//!   checks the filesystem's size first ([`check_room`]): `ftruncate` there
//!   succeeds far beyond it, and the shortfall would surface only when
//!   regions are populated.
//! - **File on hugetlbfs** (2 MiB or 1 GiB pages) or on any other filesystem
//!   (e.g. ext4/xfs mounted with `-o dax` over persistent or CXL memory).
//!   Recognised by the filesystem magic from `fstatfs`.
//!
//! A client that receives the pool descriptor from the server over a Unix
//! socket (`SCM_RIGHTS`) builds its backing with [`from_fd`] and the kind,
//! size and alignment the server reported: it needs no permission on the path.
//!
//! ## Alignment rules (invariants every other module relies on)
//!
//! - The pool alignment ([`Backing::align_bytes`]) is a power of two, at least
//!   4 KiB, at least the device's or hugetlbfs's own page size, and
//!   [`DEFAULT_ALIGN_BYTES`] (2 MiB) unless configured.
//! - [`Backing::size_bytes`] is a non-zero multiple of the alignment (a
//!   trailing partial unit is not usable and is not counted).
//! - Every region offset and length is a multiple of the alignment and lies
//!   inside the pool ([`check_extent`]); page sizes are non-zero multiples of
//!   4 KiB ([`check_page_size`]).
//!
//! Violations are typed errors ([`BackingError`] when opening, [`LayoutError`]
//! for extents and page sizes) naming the offending path or numbers.

use std::fmt;
use std::fs::{File, OpenOptions as FsOpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Default pool alignment: one x86-64 huge page, so regions can be mapped with
/// PMD-sized (2 MiB) page-table entries on hugetlbfs, device DAX and THP tmpfs.
pub const DEFAULT_ALIGN_BYTES: u64 = 2 << 20;

/// Page sizes are multiples of this (the base page size on x86-64 and arm64
/// with 4 KiB pages), so a page never shares a base page with its neighbour.
pub const PAGE_GRANULE_BYTES: u64 = 4096;

/// Size of the embedded default pool file under `/dev/shm`: 2 GiB. The file
/// is RAM, so the default stays a small fraction of a typical host.
pub const DEFAULT_POOL_SIZE_BYTES: u64 = 2 << 30;

/// Directory of the embedded default pool file.
pub const DEFAULT_POOL_DIR: &str = "/dev/shm";

/// What object a pool lives in.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackingKind {
    /// A device-DAX character device (`/dev/daxX.Y`).
    DevDax,
    /// A file on tmpfs (`/dev/shm`, or a memfd).
    Tmpfs,
    /// A file on hugetlbfs (or a `MFD_HUGETLB` memfd).
    Hugetlbfs,
    /// A regular file on any other filesystem (e.g. a DAX filesystem).
    OtherFile,
}

impl BackingKind {
    /// A short lowercase name for logs and bench output.
    pub fn as_str(self) -> &'static str {
        match self {
            BackingKind::DevDax => "devdax",
            BackingKind::Tmpfs => "tmpfs",
            BackingKind::Hugetlbfs => "hugetlbfs",
            BackingKind::OtherFile => "file",
        }
    }
}

impl fmt::Display for BackingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A character device number (`major:minor`), as in `/sys/dev/char/M:m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevNumber {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for DevNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// A byte range of a pool: where a region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

impl Extent {
    pub fn new(offset_bytes: u64, len_bytes: u64) -> Self {
        Self {
            offset_bytes,
            len_bytes,
        }
    }
}

impl fmt::Display for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, +{:#x})", self.offset_bytes, self.len_bytes)
    }
}

/// An opened pool: the same interface whatever the pool lives in.
pub trait Backing: Send + Sync + fmt::Debug {
    /// What the pool lives in.
    fn kind(&self) -> BackingKind;
    /// The path it was opened from (`/proc/self/fd/N` for [`from_fd`]).
    fn path(&self) -> &Path;
    /// Usable size: a non-zero multiple of [`Backing::align_bytes`].
    fn size_bytes(&self) -> u64;
    /// Region alignment: a power of two, at least 4 KiB.
    fn align_bytes(&self) -> u64;
    /// The descriptor to map (and to pass to clients with `SCM_RIGHTS`).
    fn fd(&self) -> BorrowedFd<'_>;

    /// Checks that `extent` is a valid region of this pool.
    fn check_extent(&self, extent: Extent) -> Result<(), LayoutError> {
        check_extent(self.size_bytes(), self.align_bytes(), extent)
    }
}

/// How to open a pool; a builder, `OpenOptions::new()` gives the defaults.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    sysfs_root: PathBuf,
    create_size_bytes: Option<u64>,
    align_bytes: Option<u64>,
    assume_devdax: Option<DevNumber>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl OpenOptions {
    /// Defaults: sysfs at `/sys`, open existing objects only, 2 MiB alignment.
    pub fn new() -> Self {
        Self {
            sysfs_root: PathBuf::from("/sys"),
            create_size_bytes: None,
            align_bytes: None,
            assume_devdax: None,
        }
    }

    /// Where sysfs is mounted (tests point this at a fake tree).
    pub fn sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs_root = root.into();
        self
    }

    /// Require at least this many bytes (rounded up to the alignment). A file
    /// is created (mode 0600) if missing and grown if shorter, never shrunk; a
    /// device, which cannot grow, must already be this large. On tmpfs and on
    /// hugetlbfs mounted with a size, a file is not sized beyond what the file
    /// system holds in all ([`BackingError::ExceedsFilesystem`]); beyond what
    /// is free now, it is sized with a warning. This layer knows nothing of
    /// what the file holds: the pool manager does not ask an initialised pool
    /// to grow (its header records its size).
    pub fn create_size_bytes(mut self, size_bytes: u64) -> Self {
        self.create_size_bytes = Some(size_bytes);
        self
    }

    /// Region alignment, a power of two ≥ 4 KiB (default 2 MiB). It is raised
    /// to the device's or hugetlbfs's page size when that is larger.
    pub fn align_bytes(mut self, align_bytes: u64) -> Self {
        self.align_bytes = Some(align_bytes);
        self
    }

    /// Treat the path as the device-DAX device with this number even when it
    /// is not a character device. The devdax code path (sysfs lookup, sizing,
    /// alignment) then runs unchanged on, for example, a regular file plus a
    /// fake sysfs tree; only the "is it a character device" test is skipped.
    pub fn assume_devdax(mut self, dev: DevNumber) -> Self {
        self.assume_devdax = Some(dev);
        self
    }
}

/// Errors opening or describing a pool.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    #[error("cannot open pool {}", path.display())]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot stat pool {}", path.display())]
    Stat { path: PathBuf, source: io::Error },
    #[error("pool {} is a {file_type}; expected a device-DAX character device or a regular file", path.display())]
    UnsupportedFileType {
        path: PathBuf,
        file_type: &'static str,
    },
    #[error("pool {} (device {dev}) is not a device-DAX device: cannot read {}", path.display(), attr.display())]
    NotDevDax {
        path: PathBuf,
        dev: DevNumber,
        attr: PathBuf,
        source: io::Error,
    },
    #[error("sysfs attribute {} holds {content:?}, expected a decimal byte count", attr.display())]
    BadSysfsValue { attr: PathBuf, content: String },
    #[error("pool {} has {size_bytes} usable bytes; at least {min_bytes} are needed", path.display())]
    TooSmall {
        path: PathBuf,
        size_bytes: u64,
        min_bytes: u64,
    },
    #[error(
        "pool {} would be {size_bytes} bytes ({}), more than the {fs} mounted at {} holds in all: \
         {total_bytes} bytes ({}). Ask for a smaller pool (a size of at most {total_bytes} bytes, less what \
         other files there use), or {advice}",
        path.display(), human_bytes(*size_bytes), mount.display(), human_bytes(*total_bytes)
    )]
    ExceedsFilesystem {
        path: PathBuf,
        size_bytes: u64,
        fs: BackingKind,
        mount: PathBuf,
        total_bytes: u64,
        advice: &'static str,
    },
    #[error("cannot size pool file {} to {size_bytes} bytes", path.display())]
    Resize {
        path: PathBuf,
        size_bytes: u64,
        source: io::Error,
    },
    #[error("pool {}: size {size_bytes} is not a multiple of the alignment {align_bytes}", path.display())]
    MisalignedSize {
        path: PathBuf,
        size_bytes: u64,
        align_bytes: u64,
    },
    #[error("pool {}: alignment {align_bytes} is {reason}", path.display())]
    BadAlignment {
        path: PathBuf,
        align_bytes: u64,
        reason: &'static str,
    },
    #[error(
        "pool {} does not exist, and a pool file is not created under /dev outside /dev/shm: a path \
         there names a device (is the DAX device configured? `daxctl list`, `cxl list`), and a file \
         in its place would be served from memory under the device's name",
        path.display()
    )]
    NoDevice { path: PathBuf },
    #[error(
        "pool {} {what} uid {uid}, not this user (uid {euid}) or root: another user may have planted it \
         (it could read every chunk, or point at a file of ours); remove it or choose another path",
        path.display()
    )]
    NotOwned {
        path: PathBuf,
        what: &'static str,
        uid: u32,
        euid: u32,
    },
}

/// A region extent or page size that breaks the alignment rules.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("region {extent} is empty")]
    EmptyRegion { extent: Extent },
    #[error("region {extent} is not aligned to the pool alignment {align_bytes:#x}")]
    MisalignedRegion { extent: Extent, align_bytes: u64 },
    #[error("region {extent} ends beyond the pool's {pool_size_bytes:#x} bytes")]
    RegionOutOfBounds {
        extent: Extent,
        pool_size_bytes: u64,
    },
    #[error("page size {page_size_bytes} is not a non-zero multiple of {PAGE_GRANULE_BYTES}")]
    MisalignedPageSize { page_size_bytes: u64 },
}

/// Checks a region extent against a pool of `pool_size_bytes` aligned to
/// `align_bytes`: non-empty, both ends aligned, inside the pool.
pub fn check_extent(
    pool_size_bytes: u64,
    align_bytes: u64,
    extent: Extent,
) -> Result<(), LayoutError> {
    debug_assert!(
        align_bytes.is_power_of_two(),
        "pool alignment is a power of two"
    );
    if extent.len_bytes == 0 {
        return Err(LayoutError::EmptyRegion { extent });
    }
    if !extent.offset_bytes.is_multiple_of(align_bytes)
        || !extent.len_bytes.is_multiple_of(align_bytes)
    {
        return Err(LayoutError::MisalignedRegion {
            extent,
            align_bytes,
        });
    }
    match extent.offset_bytes.checked_add(extent.len_bytes) {
        Some(end) if end <= pool_size_bytes => Ok(()),
        _ => Err(LayoutError::RegionOutOfBounds {
            extent,
            pool_size_bytes,
        }),
    }
}

/// Checks a page size: a non-zero multiple of [`PAGE_GRANULE_BYTES`].
pub fn check_page_size(page_size_bytes: u64) -> Result<(), LayoutError> {
    if page_size_bytes == 0 || !page_size_bytes.is_multiple_of(PAGE_GRANULE_BYTES) {
        return Err(LayoutError::MisalignedPageSize { page_size_bytes });
    }
    Ok(())
}

/// Whether a missing `path` would be created under `/dev` outside
/// `/dev/shm` — where a path names a device, such as `/dev/dax0.0` before
/// the region is configured. (devtmpfs is tmpfs to `fstatfs`, so the file
/// system cannot tell; a hugetlbfs mount there, such as `/dev/hugepages`,
/// is a place for pool files.)
fn names_a_device(path: &Path) -> bool {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(dir) = parent.canonicalize() else {
        return false;
    };
    if !dir.starts_with("/dev") || dir.starts_with("/dev/shm") {
        return false;
    }
    let hugetlbfs = File::open(&dir)
        .ok()
        .and_then(|d| stat_filesystem(&dir, &d).ok())
        .is_some_and(|fs| fs.kind == BackingKind::Hugetlbfs);
    !hugetlbfs
}

/// Opens a pool, detecting what it lives in: a character device (or a path
/// given [`OpenOptions::assume_devdax`]) is device DAX; a regular file is
/// classified by its filesystem (tmpfs, hugetlbfs, other).
pub fn open(
    path: impl AsRef<Path>,
    options: &OpenOptions,
) -> Result<Arc<dyn Backing>, BackingError> {
    let path = path.as_ref();
    let mut fs_options = FsOpenOptions::new();
    fs_options.read(true).write(true);
    let creating = options.create_size_bytes.is_some() && options.assume_devdax.is_none();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let not_owned = |what, uid| BackingError::NotOwned {
        path: path.to_owned(),
        what,
        uid,
        euid,
    };
    if creating {
        fs_options.mode(0o600);
        // The creator sizes and serves the file: one another user put in
        // its place (typically in the shared /dev/shm) must not be used.
        // (Checked before the open too, which the kernel may refuse first
        // with a bare EACCES: `fs.protected_regular`.) A device node is
        // not such a file: its owner is whoever udev made it, and opening
        // it is the kernel's permission check.
        match std::fs::symlink_metadata(path) {
            Err(err) if err.kind() == io::ErrorKind::NotFound && names_a_device(path) => {
                return Err(BackingError::NoDevice {
                    path: path.to_owned(),
                });
            }
            Ok(m)
                if (m.file_type().is_file() || m.file_type().is_symlink())
                    && m.uid() != euid
                    && m.uid() != 0 =>
            {
                let what = if m.file_type().is_symlink() {
                    "is a symlink of"
                } else {
                    "is a file of"
                };
                return Err(not_owned(what, m.uid()));
            }
            _ => {}
        }
    }
    let open_error = |source| BackingError::Open {
        path: path.to_owned(),
        source,
    };
    // Exclusive creation first, so that a file refused below is removed only
    // if this call created it.
    let (file, created) = if creating {
        match fs_options.clone().create_new(true).open(path) {
            Ok(file) => (file, true),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => (
                // `create` still: a symlink of ours to a missing file is
                // followed and its target created, as it always was.
                fs_options.create(true).open(path).map_err(open_error)?,
                false,
            ),
            Err(err) => return Err(open_error(err)),
        }
    } else {
        (fs_options.open(path).map_err(open_error)?, false)
    };
    let meta = file.metadata().map_err(|source| BackingError::Stat {
        path: path.to_owned(),
        source,
    })?;
    if creating && meta.file_type().is_file() && meta.uid() != euid && meta.uid() != 0 {
        return Err(not_owned("is a file of", meta.uid()));
    }
    let file_type = meta.file_type();
    if let Some(dev) = options.assume_devdax {
        return Ok(Arc::new(DevDax::open_file(path, file, dev, options)?));
    }
    if file_type.is_char_device() {
        let dev = DevNumber {
            major: libc::major(meta.rdev()),
            minor: libc::minor(meta.rdev()),
        };
        return Ok(Arc::new(DevDax::open_file(path, file, dev, options)?));
    }
    if file_type.is_file() {
        return match FileBacking::open_file(path, file, &meta, options) {
            Ok(backing) => Ok(Arc::new(backing)),
            Err(err) => {
                if created {
                    // Best effort: an empty file this call created is not
                    // left behind by a refusal.
                    let _ = std::fs::remove_file(path);
                }
                Err(err)
            }
        };
    }
    let file_type = if file_type.is_dir() {
        "directory"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_fifo() {
        "fifo"
    } else if file_type.is_socket() {
        "socket"
    } else {
        "special file"
    };
    Err(BackingError::UnsupportedFileType {
        path: path.to_owned(),
        file_type,
    })
}

/// Builds a backing from a descriptor received from the server (`SCM_RIGHTS`)
/// with the kind, size and alignment the server reported. The server is
/// trusted for those; what is cheap to check is checked: the alignment rules,
/// and for a regular file that it really holds `size_bytes`.
pub fn from_fd(
    fd: OwnedFd,
    kind: BackingKind,
    size_bytes: u64,
    align_bytes: u64,
) -> Result<Arc<dyn Backing>, BackingError> {
    let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    check_align(&path, align_bytes)?;
    if size_bytes < align_bytes {
        return Err(BackingError::TooSmall {
            path,
            size_bytes,
            min_bytes: align_bytes,
        });
    }
    if !size_bytes.is_multiple_of(align_bytes) {
        return Err(BackingError::MisalignedSize {
            path,
            size_bytes,
            align_bytes,
        });
    }
    let file = File::from(fd);
    let meta = file.metadata().map_err(|source| BackingError::Stat {
        path: path.clone(),
        source,
    })?;
    if meta.file_type().is_file() && meta.len() < size_bytes {
        return Err(BackingError::TooSmall {
            path,
            size_bytes: meta.len(),
            min_bytes: size_bytes,
        });
    }
    let pool = Pool {
        file,
        path,
        kind,
        size_bytes,
        align_bytes,
    };
    Ok(match kind {
        BackingKind::DevDax => Arc::new(DevDax { pool }),
        _ => Arc::new(FileBacking { pool }),
    })
}

/// What both backings hold once opened.
#[derive(Debug)]
struct Pool {
    file: File,
    path: PathBuf,
    kind: BackingKind,
    size_bytes: u64,
    align_bytes: u64,
}

/// A device-DAX pool (`/dev/daxX.Y`).
#[derive(Debug)]
pub struct DevDax {
    pool: Pool,
}

impl DevDax {
    /// Opens a device-DAX pool; see [`open`] for detection.
    fn open_file(
        path: &Path,
        file: File,
        dev: DevNumber,
        options: &OpenOptions,
    ) -> Result<Self, BackingError> {
        let dev_dir = options.sysfs_root.join(format!("dev/char/{dev}"));
        let size_attr = dev_dir.join("size");
        let raw_size =
            std::fs::read_to_string(&size_attr).map_err(|source| BackingError::NotDevDax {
                path: path.to_owned(),
                dev,
                attr: size_attr.clone(),
                source,
            })?;
        let device_size_bytes = parse_sysfs_bytes(&size_attr, &raw_size)?;
        let device_align_bytes = read_devdax_align(path, dev, &dev_dir)?;
        check_align(path, device_align_bytes)?;
        let align_bytes = options
            .align_bytes
            .unwrap_or(DEFAULT_ALIGN_BYTES)
            .max(device_align_bytes);
        check_align(path, align_bytes)?;
        let size_bytes = round_down(device_size_bytes, align_bytes);
        let min_bytes = options.create_size_bytes.map_or(align_bytes, |want| {
            round_up(want, align_bytes).max(align_bytes)
        });
        if size_bytes < min_bytes {
            return Err(BackingError::TooSmall {
                path: path.to_owned(),
                size_bytes,
                min_bytes,
            });
        }
        Ok(Self {
            pool: Pool {
                file,
                path: path.to_owned(),
                kind: BackingKind::DevDax,
                size_bytes,
                align_bytes,
            },
        })
    }
}

/// Reads the device's `align`, or the region-wide `../dax_region/align` on
/// kernels before 5.10 that have no per-device attribute.
fn read_devdax_align(path: &Path, dev: DevNumber, dev_dir: &Path) -> Result<u64, BackingError> {
    let device_attr = dev_dir.join("align");
    let region_attr = dev_dir.join("../dax_region/align");
    match std::fs::read_to_string(&device_attr) {
        Ok(raw) => parse_sysfs_bytes(&device_attr, &raw),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            let raw = std::fs::read_to_string(&region_attr).map_err(|source| {
                BackingError::NotDevDax {
                    path: path.to_owned(),
                    dev,
                    attr: region_attr.clone(),
                    source,
                }
            })?;
            parse_sysfs_bytes(&region_attr, &raw)
        }
        Err(source) => Err(BackingError::NotDevDax {
            path: path.to_owned(),
            dev,
            attr: device_attr,
            source,
        }),
    }
}

fn parse_sysfs_bytes(attr: &Path, raw: &str) -> Result<u64, BackingError> {
    raw.trim()
        .parse::<u64>()
        .map_err(|_| BackingError::BadSysfsValue {
            attr: attr.to_owned(),
            content: raw.chars().take(64).collect(),
        })
}

/// A file pool: tmpfs, hugetlbfs or any other filesystem.
#[derive(Debug)]
pub struct FileBacking {
    pool: Pool,
}

impl FileBacking {
    fn open_file(
        path: &Path,
        file: File,
        meta: &std::fs::Metadata,
        options: &OpenOptions,
    ) -> Result<Self, BackingError> {
        let fs = stat_filesystem(path, &file)?;
        let (kind, fs_block_bytes) = (fs.kind, fs.block_bytes);
        let requested_align = options.align_bytes.unwrap_or(DEFAULT_ALIGN_BYTES);
        check_align(path, requested_align)?;
        // On hugetlbfs the file can only be sized and mapped in whole huge
        // pages (the filesystem block size); elsewhere the block size says
        // nothing about mapping granularity.
        let align_bytes = if kind == BackingKind::Hugetlbfs {
            requested_align.max(fs_block_bytes)
        } else {
            requested_align
        };
        check_align(path, align_bytes)?;
        let mut file_len_bytes = meta.len();
        if let Some(want) = options.create_size_bytes {
            let want = round_up(want, align_bytes).max(align_bytes);
            if file_len_bytes < want {
                check_filesystem_room(path, want, meta, &fs)?;
                file.set_len(want).map_err(|source| BackingError::Resize {
                    path: path.to_owned(),
                    size_bytes: want,
                    source,
                })?;
                file_len_bytes = want;
            }
        }
        let size_bytes = round_down(file_len_bytes, align_bytes);
        if size_bytes < align_bytes {
            return Err(BackingError::TooSmall {
                path: path.to_owned(),
                size_bytes: file_len_bytes,
                min_bytes: align_bytes,
            });
        }
        Ok(Self {
            pool: Pool {
                file,
                path: path.to_owned(),
                kind,
                size_bytes,
                align_bytes,
            },
        })
    }
}

/// What `fstatfs` says about the filesystem a pool file lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FsStat {
    kind: BackingKind,
    /// The block size (the huge page size on hugetlbfs).
    block_bytes: u64,
    /// Blocks in all, and blocks free to this user: the space numbers.
    space: FsSpace,
}

/// A filesystem's size in `statfs` terms (`f_bsize`, `f_blocks`,
/// `f_bavail`). tmpfs reports its `size=` limit here and hugetlbfs the huge
/// pages of its `size=`; both report 0 blocks when mounted without a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    pub block_bytes: u64,
    pub total_blocks: u64,
    pub avail_blocks: u64,
}

/// Whether a file of some size fits on a filesystem ([`check_room`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// It fits in the space free now.
    Fits,
    /// The filesystem reports no limit (0 blocks): nothing to check.
    Unlimited,
    /// It fits in the filesystem but needs more than is free now: other
    /// files must go before all of it can be populated.
    ExceedsFree { needed_bytes: u64, free_bytes: u64 },
    /// It is larger than the whole filesystem: it can never be populated.
    ExceedsTotal { total_bytes: u64 },
}

/// Whether a file of `size_bytes`, of which `allocated_bytes` already hold
/// blocks, fits on a filesystem with `space`. Pure, for the sizing check of
/// tmpfs and hugetlbfs files: `ftruncate` there succeeds far beyond the
/// filesystem's size (files are sparse), and the shortfall would show only
/// when regions are populated (an error, or `SIGBUS` on old kernels).
pub fn check_room(size_bytes: u64, allocated_bytes: u64, space: FsSpace) -> Room {
    // hugetlbfs without `size=` but with `min_size=` reports u64::MAX
    // blocks: saturating arithmetic reads that as "no limit" as well.
    if space.total_blocks == 0 {
        return Room::Unlimited;
    }
    let total_bytes = space.total_blocks.saturating_mul(space.block_bytes);
    if size_bytes > total_bytes {
        return Room::ExceedsTotal { total_bytes };
    }
    let needed_bytes = size_bytes.saturating_sub(allocated_bytes);
    let free_bytes = space.avail_blocks.saturating_mul(space.block_bytes);
    if needed_bytes > free_bytes {
        return Room::ExceedsFree {
            needed_bytes,
            free_bytes,
        };
    }
    Room::Fits
}

/// Refuses to size a tmpfs or hugetlbfs pool file to more than its
/// filesystem holds, and warns when it needs more than is free now. Other
/// filesystems allocate on write and report their own errors; devices are
/// sized by sysfs.
fn check_filesystem_room(
    path: &Path,
    size_bytes: u64,
    meta: &std::fs::Metadata,
    fs: &FsStat,
) -> Result<(), BackingError> {
    let advice = match fs.kind {
        BackingKind::Tmpfs => {
            "enlarge the file system (`mount -o remount,size=...`; in Docker `--shm-size`, in \
             Kubernetes a memory-backed emptyDir with a larger sizeLimit)"
        }
        BackingKind::Hugetlbfs => {
            "mount hugetlbfs with a larger `size=` (and reserve that many huge pages, see \
             docs/operations.md)"
        }
        _ => return Ok(()),
    };
    // `st_blocks` counts 512-byte units whatever the filesystem's block size.
    let allocated_bytes = meta.blocks().saturating_mul(512);
    match check_room(size_bytes, allocated_bytes, fs.space) {
        Room::Fits | Room::Unlimited => Ok(()),
        Room::ExceedsFree {
            needed_bytes,
            free_bytes,
        } => {
            tracing::warn!(
                path = %path.display(),
                size_bytes,
                needed_bytes,
                free_bytes,
                mount = %mount_point(path).display(),
                fs = %fs.kind,
                "the pool is larger than the space free on its file system now: regions past it \
                 will fail to populate (\"pool memory exhausted\") until other files there are removed"
            );
            Ok(())
        }
        Room::ExceedsTotal { total_bytes } => Err(BackingError::ExceedsFilesystem {
            path: path.to_owned(),
            size_bytes,
            fs: fs.kind,
            mount: mount_point(path),
            total_bytes,
            advice,
        }),
    }
}

/// The mount point of the filesystem holding the existing file `path`: the
/// highest directory above it on the same device (for error messages; the
/// path itself if that cannot be told).
fn mount_point(path: &Path) -> PathBuf {
    let Ok(dev) = std::fs::metadata(path).map(|m| m.dev()) else {
        return path.to_owned();
    };
    let Some(mut dir) = std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
    else {
        return path.to_owned();
    };
    // Bounded by the number of components of `dir`.
    while let Some(parent) = dir.parent() {
        match std::fs::metadata(parent) {
            Ok(m) if m.dev() == dev => dir = parent.to_path_buf(),
            _ => break,
        }
    }
    dir
}

/// `bytes` for people: the largest binary unit that keeps one decimal.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut unit = "bytes";
    let mut value = bytes as f64;
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "bytes" {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// The filesystem a file lives on: kind, block size and space.
fn stat_filesystem(path: &Path, file: &File) -> Result<FsStat, BackingError> {
    // Widen the magic constants and `f_type` alike: their C types differ
    // between libcs (`long`, `unsigned int`), the values do not.
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `file` owns an open descriptor for the whole call and `st` is a
    // writable buffer of the size `fstatfs` fills.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(BackingError::Stat {
            path: path.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fstatfs` returned 0, so it initialised the whole struct.
    let st = unsafe { st.assume_init() };
    // `f_type` is a signed word holding an unsigned 32-bit magic; the low 32
    // bits are the magic whatever the sign extension.
    let magic = (st.f_type as u64) & 0xffff_ffff;
    let block_bytes = u64::try_from(st.f_bsize).unwrap_or(PAGE_GRANULE_BYTES);
    let kind = match magic {
        TMPFS_MAGIC => BackingKind::Tmpfs,
        HUGETLBFS_MAGIC => BackingKind::Hugetlbfs,
        _ => BackingKind::OtherFile,
    };
    // The block counts' C types differ between libcs too; all are unsigned
    // or hold non-negative values, and a negative one (hugetlbfs's -1 for
    // "no limit") widens to u64::MAX, read as no limit.
    #[allow(clippy::unnecessary_cast)]
    let space = FsSpace {
        block_bytes,
        total_blocks: st.f_blocks as u64,
        avail_blocks: st.f_bavail as u64,
    };
    Ok(FsStat {
        kind,
        block_bytes,
        space,
    })
}

fn check_align(path: &Path, align_bytes: u64) -> Result<(), BackingError> {
    let reason = if !align_bytes.is_power_of_two() {
        "not a power of two"
    } else if align_bytes < PAGE_GRANULE_BYTES {
        "below the 4 KiB page granule"
    } else {
        return Ok(());
    };
    Err(BackingError::BadAlignment {
        path: path.to_owned(),
        align_bytes,
        reason,
    })
}

fn round_down(value: u64, align: u64) -> u64 {
    value - value % align
}

fn round_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align).saturating_mul(align)
}

macro_rules! impl_backing {
    ($ty:ty) => {
        impl Backing for $ty {
            fn kind(&self) -> BackingKind {
                self.pool.kind
            }
            fn path(&self) -> &Path {
                &self.pool.path
            }
            fn size_bytes(&self) -> u64 {
                self.pool.size_bytes
            }
            fn align_bytes(&self) -> u64 {
                self.pool.align_bytes
            }
            fn fd(&self) -> BorrowedFd<'_> {
                self.pool.file.as_fd()
            }
        }
    };
}

impl_backing!(DevDax);
impl_backing!(FileBacking);

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const MIB: u64 = 1 << 20;

    /// A file under `/dev/shm` with a unique name, removed on drop.
    pub(crate) struct ShmPath(pub PathBuf);

    impl ShmPath {
        pub(crate) fn new(tag: &str) -> Self {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            // Relaxed: the counter only needs to be unique, not ordered.
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            Self(PathBuf::from(format!(
                "/dev/shm/cxlkv-test-{tag}-{}-{n}",
                std::process::id()
            )))
        }
    }

    impl Drop for ShmPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_missing_path_under_dev_is_refused_as_an_unconfigured_device_not_created() {
        let path = PathBuf::from(format!("/dev/cxlkv-test-missing-{}", std::process::id()));
        // Removes what a regression would create there.
        let _created = ShmPath(path.clone());
        let Err(err) = open(&path, &OpenOptions::new().create_size_bytes(2 * MIB)) else {
            panic!("no pool file is created in /dev");
        };
        assert!(
            matches!(&err, BackingError::NoDevice { path: p } if *p == path),
            "{err}"
        );
        assert!(err.to_string().contains("daxctl"), "{err}");
        assert!(
            std::fs::symlink_metadata(&path).is_err(),
            "nothing was created at {}",
            path.display()
        );
        // /dev/shm stays the place for pool files.
        let shm = ShmPath::new("dev-rule");
        let pool = open(&shm.0, &OpenOptions::new().create_size_bytes(2 * MIB))
            .expect("a pool file is created under /dev/shm");
        assert_eq!(pool.kind(), BackingKind::Tmpfs);
    }

    #[test]
    fn a_device_node_of_another_user_is_opened_as_a_device_not_refused_as_planted() {
        let dir = tempfile::tempdir().expect("temp dir");
        let node = dir.path().join("dax-like");
        let c_node = std::ffi::CString::new(node.as_os_str().as_encoded_bytes())
            .expect("no NUL in a temp path");
        // /dev/null's numbers: a character device that is not device DAX.
        // SAFETY: `c_node` is a NUL-terminated path that outlives the call.
        let rc =
            unsafe { libc::mknod(c_node.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        if rc != 0 {
            eprintln!(
                "skipped: cannot make a device node here ({}); needs root",
                io::Error::last_os_error()
            );
            return;
        }
        std::os::unix::fs::chown(&node, Some(65_534), Some(65_534)).expect("chown the node");
        let Err(err) = open(&node, &OpenOptions::new().create_size_bytes(2 * MIB)) else {
            panic!("/dev/null's numbers are not device DAX");
        };
        assert!(
            matches!(err, BackingError::NotDevDax { .. }),
            "a device node is judged as a device, not as a planted file: {err}"
        );
    }

    /// A fake device-DAX device: a regular file plus a sysfs tree with the
    /// attributes the kernel exposes, under a temporary root.
    struct FakeDevDax {
        sysfs: tempfile::TempDir,
        device: ShmPath,
        dev: DevNumber,
    }

    impl FakeDevDax {
        fn new(size_bytes: u64, align: Option<&str>, region_align: Option<&str>) -> Self {
            let sysfs = tempfile::tempdir().expect("temp dir for fake sysfs");
            let dev = DevNumber {
                major: 252,
                minor: 3,
            };
            let dev_dir = sysfs.path().join(format!("dev/char/{dev}"));
            std::fs::create_dir_all(&dev_dir).expect("fake sysfs device dir");
            std::fs::write(dev_dir.join("size"), format!("{size_bytes}\n")).expect("size");
            if let Some(align) = align {
                std::fs::write(dev_dir.join("align"), align).expect("align");
            }
            if let Some(align) = region_align {
                let region_dir = sysfs.path().join("dev/char/dax_region");
                std::fs::create_dir_all(&region_dir).expect("fake dax_region dir");
                std::fs::write(region_dir.join("align"), align).expect("region align");
            }
            let device = ShmPath::new("fakedax");
            let file = File::create(&device.0).expect("fake device file");
            file.set_len(size_bytes).expect("size fake device");
            Self { sysfs, device, dev }
        }

        fn options(&self) -> OpenOptions {
            OpenOptions::new()
                .sysfs_root(self.sysfs.path())
                .assume_devdax(self.dev)
        }
    }

    #[test]
    fn devdax_size_and_align_come_from_sysfs() {
        let fake = FakeDevDax::new(64 * MIB + 4096, Some("2097152\n"), None);
        let backing = open(&fake.device.0, &fake.options()).expect("open fake devdax");
        assert_eq!(backing.kind(), BackingKind::DevDax);
        assert_eq!(backing.align_bytes(), 2 * MIB);
        // The trailing partial 2 MiB unit is not usable.
        assert_eq!(backing.size_bytes(), 64 * MIB);
        assert_eq!(backing.path(), fake.device.0.as_path());
    }

    /// The devdax path does not end at `open`: a region of the fake device
    /// maps (eagerly, as an owned region, and lazily, as a peer's), takes a
    /// write through a mutable page view, and the bytes read back through the
    /// other mapping.
    #[test]
    fn a_fake_devdax_region_maps_eagerly_and_lazily_and_shares_bytes() {
        use crate::ids::{PageIndex, RegionId};
        use crate::map::{MapObservers, MappedRegion, Populate};

        let fake = FakeDevDax::new(8 * MIB, Some("2097152\n"), None);
        let backing = open(&fake.device.0, &fake.options()).expect("open fake devdax");
        assert_eq!(backing.kind(), BackingKind::DevDax);
        let observers = MapObservers::new();
        let extent = Extent::new(2 * MIB, 4 * MIB);
        let page_size = 64 * 1024;
        // SAFETY: each page is written through one view at a time and read
        // only after that view is gone; the fake device is not truncated
        // while mapped.
        let (owned, peer) = unsafe {
            (
                MappedRegion::map(&*backing, RegionId(7), extent, Populate::Eager, &observers)
                    .expect("eager map of the fake device"),
                MappedRegion::map(&*backing, RegionId(7), extent, Populate::Lazy, &observers)
                    .expect("lazy map of the fake device"),
            )
        };
        for region in [&owned, &peer] {
            assert_eq!(region.kind(), BackingKind::DevDax);
            assert_eq!(region.len_bytes(), 4 * MIB as usize);
        }
        assert_eq!(
            owned.resident_pages().expect("mincore"),
            (4 * MIB / 4096) as usize,
            "the eager mapping is populated"
        );
        let last = PageIndex(owned.page_count(page_size).expect("pages") - 1);
        for (writer, reader, index, value) in [
            (&owned, &peer, PageIndex(0), 0x5a),
            (&peer, &owned, last, 0xa5),
        ] {
            {
                // SAFETY: this page is viewed by nothing else until the view
                // is dropped at the end of the block.
                let mut page =
                    unsafe { writer.page_mut(page_size, index, page_size) }.expect("page");
                page.fill(value);
            }
            let view = reader.page(page_size, index, page_size).expect("view");
            assert!(view.iter().all(|&b| b == value), "{index}");
        }
        // And the bytes are in the device at the region's offset.
        drop((owned, peer));
        let raw = std::fs::read(&fake.device.0).expect("read fake device");
        let start = (2 * MIB) as usize;
        assert!(raw[start..start + page_size].iter().all(|&b| b == 0x5a));
        let end = (6 * MIB) as usize;
        assert!(raw[end - page_size..end].iter().all(|&b| b == 0xa5));
        assert!(raw[..start].iter().all(|&b| b == 0), "outside the region");
    }

    #[test]
    fn devdax_alignment_is_raised_to_the_device_align() {
        let gib = 1 << 30;
        let fake = FakeDevDax::new(2 * gib, Some(&gib.to_string()), None);
        let backing = open(&fake.device.0, &fake.options()).expect("open fake devdax");
        assert_eq!(backing.align_bytes(), gib);
        assert_eq!(backing.size_bytes(), 2 * gib);
    }

    #[test]
    fn devdax_falls_back_to_region_align_on_old_kernels() {
        let fake = FakeDevDax::new(8 * MIB, None, Some("4194304"));
        let backing = open(&fake.device.0, &fake.options()).expect("open fake devdax");
        assert_eq!(backing.align_bytes(), 4 * MIB);
    }

    #[test]
    fn devdax_without_sysfs_attributes_is_rejected() {
        let fake = FakeDevDax::new(8 * MIB, Some("2097152"), None);
        let empty = tempfile::tempdir().expect("empty sysfs");
        let options = fake.options().sysfs_root(empty.path());
        let err = open(&fake.device.0, &options).expect_err("no sysfs device");
        assert!(matches!(err, BackingError::NotDevDax { .. }), "{err}");
    }

    #[test]
    fn devdax_garbage_in_sysfs_is_a_clear_error() {
        let fake = FakeDevDax::new(8 * MIB, Some("2M\n"), None);
        let err = open(&fake.device.0, &fake.options()).expect_err("bad align value");
        match err {
            BackingError::BadSysfsValue { attr, content } => {
                assert!(attr.ends_with("align"));
                assert_eq!(content, "2M\n");
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn devdax_smaller_than_requested_is_too_small() {
        let fake = FakeDevDax::new(4 * MIB, Some("2097152"), None);
        let err = open(&fake.device.0, &fake.options().create_size_bytes(8 * MIB))
            .expect_err("device too small");
        assert!(
            matches!(err, BackingError::TooSmall { size_bytes, min_bytes, .. }
                if size_bytes == 4 * MIB && min_bytes == 8 * MIB),
            "{err}"
        );
    }

    #[test]
    fn a_char_device_that_is_not_devdax_is_rejected() {
        let err = open("/dev/null", &OpenOptions::new()).expect_err("/dev/null is no pool");
        assert!(matches!(err, BackingError::NotDevDax { .. }), "{err}");
    }

    #[test]
    fn a_missing_path_is_an_open_error_naming_it() {
        let path = ShmPath::new("missing");
        let err = open(&path.0, &OpenOptions::new()).expect_err("missing file");
        match &err {
            BackingError::Open { path: p, source } => {
                assert_eq!(p, &path.0);
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("unexpected {other}"),
        }
        assert!(
            err.to_string()
                .contains(path.0.to_str().expect("utf-8 path"))
        );
    }

    #[test]
    fn a_directory_is_not_a_pool() {
        let dir = tempfile::tempdir().expect("temp dir");
        // A directory cannot be opened for writing at all: the error is Open.
        let err = open(dir.path(), &OpenOptions::new()).expect_err("directory");
        assert!(matches!(err, BackingError::Open { .. }), "{err}");
    }

    #[test]
    fn a_fifo_is_not_a_pool() {
        let path = ShmPath::new("fifo");
        let c_path = std::ffi::CString::new(path.0.to_str().expect("utf-8 path")).expect("no NUL");
        // SAFETY: `c_path` is a valid NUL-terminated string for the call.
        let rc = unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "mkfifo: {}", io::Error::last_os_error());
        let err = open(&path.0, &OpenOptions::new()).expect_err("fifo");
        assert!(
            matches!(
                err,
                BackingError::UnsupportedFileType {
                    file_type: "fifo",
                    ..
                }
            ),
            "{err}"
        );
    }

    /// A filesystem mounted on a fresh temporary directory, unmounted on drop.
    struct TestMount {
        dir: tempfile::TempDir,
    }

    impl TestMount {
        fn new(fstype: &std::ffi::CStr, data: &std::ffi::CStr) -> io::Result<Self> {
            let dir = tempfile::tempdir()?;
            let target = std::ffi::CString::new(
                dir.path()
                    .to_str()
                    .ok_or_else(|| io::Error::other("temp dir path is not UTF-8"))?,
            )?;
            // SAFETY: all arguments are valid NUL-terminated strings for the
            // duration of the call.
            let rc = unsafe {
                libc::mount(
                    c"none".as_ptr(),
                    target.as_ptr(),
                    fstype.as_ptr(),
                    0,
                    data.as_ptr().cast(),
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(Self { dir })
        }
    }

    impl Drop for TestMount {
        fn drop(&mut self) {
            if let Ok(target) =
                std::ffi::CString::new(self.dir.path().as_os_str().as_encoded_bytes())
            {
                // SAFETY: `target` is a valid NUL-terminated string; a lazy
                // unmount of our own mount point affects nothing else.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }

    #[test]
    fn hugetlbfs_files_are_recognised_and_mapped_with_huge_pages() {
        use crate::hugepages::HugePageReservation;
        use crate::ids::{PageIndex, RegionId};
        use crate::map::{MapObservers, MappedRegion, Populate};

        // Declared first, dropped last: pages go back after the unmount.
        let reservation = match HugePageReservation::reserve(2, std::time::Duration::from_secs(60))
        {
            Ok(r) => r,
            Err(err) => {
                eprintln!("skipping hugetlbfs test: no huge pages can be reserved: {err:?}");
                return;
            }
        };
        let mount = match TestMount::new(c"hugetlbfs", c"pagesize=2M") {
            Ok(m) => m,
            Err(err) => {
                eprintln!("skipping hugetlbfs test: cannot mount hugetlbfs: {err}");
                return;
            }
        };
        let path = mount.dir.path().join("pool");
        let backing = open(&path, &OpenOptions::new().create_size_bytes(3 * MIB))
            .expect("create hugetlbfs pool");
        assert_eq!(backing.kind(), BackingKind::Hugetlbfs);
        assert_eq!(backing.align_bytes(), 2 * MIB);
        assert_eq!(
            backing.size_bytes(),
            4 * MIB,
            "rounded up to whole huge pages"
        );
        {
            let observers = MapObservers::new();
            // SAFETY: the single page view below is the only access.
            let region = unsafe {
                MappedRegion::map(
                    &*backing,
                    RegionId(1),
                    Extent::new(0, 4 * MIB),
                    Populate::Eager,
                    &observers,
                )
            }
            .expect("map hugetlbfs region");
            // SAFETY: no other view of page 1 exists.
            let mut page = unsafe { region.page_mut(2 << 20, PageIndex(1), 8) }.expect("page");
            page.copy_from_slice(b"hugepage");
            assert_eq!(page.as_bytes(), b"hugepage");
        }
        drop(backing);
        std::fs::remove_file(&path).expect("free the pool's huge pages");
        drop(mount);
        assert_eq!(reservation.pages(), 2);
    }

    #[test]
    fn tmpfs_file_is_created_and_sized_on_demand() {
        let path = ShmPath::new("create");
        let backing = open(&path.0, &OpenOptions::new().create_size_bytes(5 * MIB))
            .expect("create pool file");
        assert_eq!(backing.kind(), BackingKind::Tmpfs);
        assert_eq!(backing.align_bytes(), DEFAULT_ALIGN_BYTES);
        // Rounded up to the alignment.
        assert_eq!(backing.size_bytes(), 6 * MIB);
        assert_eq!(std::fs::metadata(&path.0).expect("stat").len(), 6 * MIB);
    }

    #[test]
    fn room_is_refused_above_the_filesystem_and_warned_above_the_free_space() {
        let space = FsSpace {
            block_bytes: 4096,
            total_blocks: 16 * MIB / 4096,
            avail_blocks: 4 * MIB / 4096,
        };
        assert_eq!(check_room(4 * MIB, 0, space), Room::Fits);
        assert_eq!(
            check_room(8 * MIB, 0, space),
            Room::ExceedsFree {
                needed_bytes: 8 * MIB,
                free_bytes: 4 * MIB
            }
        );
        // Blocks the file already holds are not needed again.
        assert_eq!(check_room(8 * MIB, 4 * MIB, space), Room::Fits);
        assert_eq!(
            check_room(16 * MIB, 0, space),
            Room::ExceedsFree {
                needed_bytes: 16 * MIB,
                free_bytes: 4 * MIB
            },
            "exactly the filesystem's size fits it"
        );
        assert_eq!(
            check_room(16 * MIB + 4096, 16 * MIB, space),
            Room::ExceedsTotal {
                total_bytes: 16 * MIB
            },
            "never larger than the whole filesystem, whatever is allocated"
        );
        // The default 2 GiB pool on Docker's 64 MiB /dev/shm.
        let docker_shm = FsSpace {
            block_bytes: 4096,
            total_blocks: 64 * MIB / 4096,
            avail_blocks: 64 * MIB / 4096,
        };
        assert_eq!(
            check_room(DEFAULT_POOL_SIZE_BYTES, 0, docker_shm),
            Room::ExceedsTotal {
                total_bytes: 64 * MIB
            }
        );
        // tmpfs `size=0` and hugetlbfs without `size=` report no blocks.
        let unlimited = FsSpace {
            block_bytes: 2 * MIB,
            total_blocks: 0,
            avail_blocks: 0,
        };
        assert_eq!(check_room(u64::MAX, 0, unlimited), Room::Unlimited);
        // hugetlbfs: huge pages are the blocks; -1 ("no maximum") is no limit.
        let huge = FsSpace {
            block_bytes: 2 * MIB,
            total_blocks: 4,
            avail_blocks: 1,
        };
        assert_eq!(
            check_room(10 * MIB, 0, huge),
            Room::ExceedsTotal {
                total_bytes: 8 * MIB
            }
        );
        let no_max = FsSpace {
            block_bytes: 2 * MIB,
            total_blocks: u64::MAX,
            avail_blocks: u64::MAX - 3,
        };
        assert_eq!(check_room(1 << 40, 0, no_max), Room::Fits);
    }

    /// `ftruncate` on tmpfs succeeds far beyond the filesystem's size (the
    /// file is sparse), so without the check this open would succeed.
    /// Nothing is written: the refusal comes before any sizing, and the
    /// file this open created is removed again.
    #[test]
    fn a_tmpfs_pool_larger_than_dev_shm_is_refused_and_not_left_behind() {
        let path = ShmPath::new("toolarge");
        let dev_shm = std::fs::File::open(DEFAULT_POOL_DIR).expect("open /dev/shm");
        let fs = stat_filesystem(Path::new(DEFAULT_POOL_DIR), &dev_shm).expect("statfs");
        if fs.kind != BackingKind::Tmpfs || fs.space.total_blocks == 0 {
            eprintln!("skipping: /dev/shm is not a tmpfs with a size ({fs:?})");
            return;
        }
        let total = fs.space.total_blocks * fs.space.block_bytes;
        let want = round_up(total + 1, DEFAULT_ALIGN_BYTES);
        let err = open(&path.0, &OpenOptions::new().create_size_bytes(want))
            .expect_err("larger than /dev/shm");
        match &err {
            BackingError::ExceedsFilesystem {
                size_bytes,
                fs,
                mount,
                total_bytes,
                ..
            } => {
                assert_eq!(*size_bytes, want);
                assert_eq!(*fs, BackingKind::Tmpfs);
                assert_eq!(mount, Path::new(DEFAULT_POOL_DIR));
                assert_eq!(*total_bytes, total);
            }
            other => panic!("unexpected {other}"),
        }
        let msg = err.to_string();
        for needle in ["/dev/shm", &total.to_string(), "smaller pool", "--shm-size"] {
            assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
        }
        assert!(!path.0.exists(), "the refused file is not left behind");
    }

    /// The same on a tmpfs of 8 MiB (Docker's /dev/shm in miniature): a pool
    /// of 16 MiB is refused, naming the mount; an existing file is left as
    /// it was; 6 MiB fits.
    #[test]
    fn a_pool_larger_than_a_small_tmpfs_is_refused_naming_the_mount() {
        let mount = match TestMount::new(c"tmpfs", c"size=8m") {
            Ok(m) => m,
            Err(err) => {
                eprintln!("skipping small-tmpfs test: cannot mount a tmpfs: {err}");
                return;
            }
        };
        let path = mount.dir.path().join("pool");
        std::fs::write(&path, b"").expect("an empty existing file");
        let err = open(&path, &OpenOptions::new().create_size_bytes(16 * MIB))
            .expect_err("16 MiB on an 8 MiB tmpfs");
        assert!(
            matches!(&err, BackingError::ExceedsFilesystem { mount: m, total_bytes, .. }
                if m == mount.dir.path() && *total_bytes == 8 * MIB),
            "{err}"
        );
        assert!(err.to_string().contains("8.0 MiB"), "{err}");
        assert_eq!(
            std::fs::metadata(&path).expect("kept").len(),
            0,
            "an existing file is left as it was"
        );
        let backing = open(&path, &OpenOptions::new().create_size_bytes(6 * MIB))
            .expect("6 MiB fits in 8 MiB");
        assert_eq!(backing.size_bytes(), 6 * MIB);
    }

    #[test]
    fn an_existing_larger_file_is_never_shrunk() {
        let path = ShmPath::new("noshrink");
        File::create(&path.0)
            .and_then(|f| f.set_len(16 * MIB))
            .expect("make 16 MiB file");
        let backing =
            open(&path.0, &OpenOptions::new().create_size_bytes(4 * MIB)).expect("open existing");
        assert_eq!(backing.size_bytes(), 16 * MIB);
    }

    #[test]
    fn a_too_small_file_is_rejected() {
        let path = ShmPath::new("small");
        File::create(&path.0)
            .and_then(|f| f.set_len(MIB))
            .expect("make 1 MiB file");
        let err = open(&path.0, &OpenOptions::new()).expect_err("smaller than alignment");
        assert!(
            matches!(err, BackingError::TooSmall { size_bytes, min_bytes, .. }
                if size_bytes == MIB && min_bytes == 2 * MIB),
            "{err}"
        );
    }

    #[test]
    fn a_bad_alignment_option_is_rejected() {
        let path = ShmPath::new("badalign");
        for (align, reason) in [(3 * MIB, "power of two"), (1024, "4 KiB")] {
            let err = open(
                &path.0,
                &OpenOptions::new()
                    .create_size_bytes(8 * MIB)
                    .align_bytes(align),
            )
            .expect_err("bad alignment");
            match err {
                BackingError::BadAlignment {
                    align_bytes,
                    reason: r,
                    ..
                } => {
                    assert_eq!(align_bytes, align);
                    assert!(r.contains(reason), "{r}");
                }
                other => panic!("unexpected {other}"),
            }
        }
    }

    #[test]
    fn extents_must_be_aligned_non_empty_and_inside_the_pool() {
        let size = 64 * MIB;
        let align = 2 * MIB;
        assert_eq!(
            check_extent(size, align, Extent::new(2 * MIB, 4 * MIB)),
            Ok(())
        );
        assert_eq!(check_extent(size, align, Extent::new(0, size)), Ok(()));
        assert!(matches!(
            check_extent(size, align, Extent::new(4096, 2 * MIB)),
            Err(LayoutError::MisalignedRegion { .. })
        ));
        assert!(matches!(
            check_extent(size, align, Extent::new(0, 3 * MIB)),
            Err(LayoutError::MisalignedRegion { .. })
        ));
        assert!(matches!(
            check_extent(size, align, Extent::new(0, 0)),
            Err(LayoutError::EmptyRegion { .. })
        ));
        assert!(matches!(
            check_extent(size, align, Extent::new(62 * MIB, 4 * MIB)),
            Err(LayoutError::RegionOutOfBounds { .. })
        ));
        // Offset + length overflowing u64 is out of bounds, not a wrap.
        assert!(matches!(
            check_extent(size, align, Extent::new(u64::MAX - (2 * MIB - 1), 2 * MIB)),
            Err(LayoutError::RegionOutOfBounds { .. })
        ));
    }

    #[test]
    fn page_sizes_must_be_multiples_of_4k() {
        assert_eq!(check_page_size(4096), Ok(()));
        assert_eq!(check_page_size(2 * MIB), Ok(()));
        for bad in [0, 100, 4097, 6144] {
            assert_eq!(
                check_page_size(bad),
                Err(LayoutError::MisalignedPageSize {
                    page_size_bytes: bad
                })
            );
        }
    }

    #[test]
    fn from_fd_keeps_the_servers_description_and_checks_the_file() {
        let path = ShmPath::new("fromfd");
        let file = File::create(&path.0).expect("create");
        file.set_len(8 * MIB).expect("size");
        let fd = OwnedFd::from(file.try_clone().expect("dup"));
        let backing =
            from_fd(fd, BackingKind::Tmpfs, 8 * MIB, 2 * MIB).expect("from server description");
        assert_eq!(backing.kind(), BackingKind::Tmpfs);
        assert_eq!(backing.size_bytes(), 8 * MIB);
        assert!(backing.path().starts_with("/proc/self/fd"));

        let fd = OwnedFd::from(file.try_clone().expect("dup"));
        let err = from_fd(fd, BackingKind::Tmpfs, 16 * MIB, 2 * MIB).expect_err("file too short");
        assert!(matches!(err, BackingError::TooSmall { .. }), "{err}");

        let fd = OwnedFd::from(file);
        let err = from_fd(fd, BackingKind::Tmpfs, 8 * MIB, 3 * MIB).expect_err("bad alignment");
        assert!(matches!(err, BackingError::BadAlignment { .. }), "{err}");
    }
}
