//! The pools a client maps regions from, opened once at connect.
//!
//! A local client (Unix socket) receives one descriptor per pool with the
//! `Welcome` (`SCM_RIGHTS`) and builds each backing from it — it needs no
//! permission on the device itself. A remote client (TCP) opens its own path
//! to the same device: the one configured for the pool's UUID, else the path
//! the server announced, and in both cases refuses a pool whose identity
//! header does not carry the announced UUID (a wrong path would otherwise
//! map someone else's bytes). The visibility mode is the server's per pool
//! unless the configuration forces one.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cxlkv_controlplane::pool::header::{self, BlockState, HEADER_BYTES};
use cxlkv_controlplane::proto::{self, PoolInfo, VisibilityMode};
use cxlkv_dataplane::backing::{self, Backing, BackingKind, Extent, OpenOptions};
use cxlkv_dataplane::ids::RegionId;
use cxlkv_dataplane::map::{MapObservers, MappedRegion};
use cxlkv_dataplane::visibility::{self, Visibility};

use super::error::{ClientError, ErrorChain};

/// One opened pool.
#[derive(Debug)]
pub(crate) struct Pool {
    pub info: PoolInfo,
    pub backing: Arc<dyn Backing>,
    pub visibility: Visibility,
}

/// The pool's mode (or the forced one), if this machine can carry it out.
fn visibility_of(info: &PoolInfo, forced: Option<Visibility>) -> Result<Visibility, ClientError> {
    let mode = forced.unwrap_or(match info.visibility {
        VisibilityMode::Coherent => Visibility::Coherent,
        VisibilityMode::Flush => Visibility::Flush,
    });
    visibility::check_mode(mode).map_err(|e| ClientError::Pool {
        pool: info.pool,
        reason: e.to_string(),
    })?;
    Ok(mode)
}

/// Builds the pools from the descriptors that came with `Welcome`, in
/// announcement order.
pub(crate) fn from_fds(
    infos: &[PoolInfo],
    fds: Vec<OwnedFd>,
    forced: Option<Visibility>,
) -> Result<Vec<Pool>, ClientError> {
    if fds.len() != infos.len() {
        return Err(ClientError::PoolDescriptors {
            announced: infos.len(),
            passed: fds.len(),
        });
    }
    infos
        .iter()
        .zip(fds)
        .map(|(info, fd)| {
            let kind = match info.kind {
                proto::BackingKind::DevDax => BackingKind::DevDax,
                proto::BackingKind::File => file_kind(&fd),
            };
            let backing = backing::from_fd(fd, kind, info.size_bytes, info.align_bytes)?;
            Ok(Pool {
                info: info.clone(),
                backing,
                visibility: visibility_of(info, forced)?,
            })
        })
        .collect()
}

/// Opens each announced pool by a local path and checks its identity.
pub(crate) fn open_by_path(
    infos: &[PoolInfo],
    paths: &[([u8; 16], PathBuf)],
    forced: Option<Visibility>,
) -> Result<Vec<Pool>, ClientError> {
    for (uuid, path) in unannounced(infos, paths) {
        // Likely a mistyped UUID, or a pool this server does not serve:
        // not an error (a configuration may list several servers' pools),
        // but the path is not used.
        tracing::warn!(
            uuid = %cxlkv_controlplane::pool::PoolUuid(*uuid),
            path = %path.display(),
            announced = %infos
                .iter()
                .map(|i| cxlkv_controlplane::pool::PoolUuid(i.uuid).to_string())
                .collect::<Vec<_>>()
                .join(", "),
            "pool_paths names a pool the server does not announce: that path is not used"
        );
    }
    infos
        .iter()
        .map(|info| {
            let path = paths
                .iter()
                .find(|(uuid, _)| *uuid == info.uuid)
                .map_or_else(|| PathBuf::from(&info.path), |(_, p)| p.clone());
            let visibility = visibility_of(info, forced)?;
            let backing = open_checked(&path, info, visibility)?;
            Ok(Pool {
                info: info.clone(),
                backing,
                visibility,
            })
        })
        .collect()
}

/// The `pool_paths` entries whose UUID names none of the announced pools.
fn unannounced<'a>(
    infos: &[PoolInfo],
    paths: &'a [([u8; 16], PathBuf)],
) -> impl Iterator<Item = &'a ([u8; 16], PathBuf)> {
    let announced: Vec<[u8; 16]> = infos.iter().map(|i| i.uuid).collect();
    paths
        .iter()
        .filter(move |(uuid, _)| !announced.contains(uuid))
}

fn open_checked(
    path: &Path,
    info: &PoolInfo,
    visibility: Visibility,
) -> Result<Arc<dyn Backing>, ClientError> {
    let pool_err = |reason: String| ClientError::Pool {
        pool: info.pool,
        reason,
    };
    let backing = backing::open(path, &OpenOptions::new().align_bytes(info.align_bytes))?;
    if backing.size_bytes() < info.size_bytes || backing.align_bytes() != info.align_bytes {
        return Err(pool_err(format!(
            "{} has {} bytes aligned to {}; the server announced {} bytes aligned to {}",
            path.display(),
            backing.size_bytes(),
            backing.align_bytes(),
            info.size_bytes,
            info.align_bytes
        )));
    }
    let block = read_header_block(backing.as_ref(), visibility).map_err(|e| {
        pool_err(format!(
            "cannot read the identity header of {}: {}",
            path.display(),
            ErrorChain(&e)
        ))
    })?;
    match header::decode(&block) {
        Ok(BlockState::Initialised(h)) if h.identity.uuid.0 == info.uuid => Ok(backing),
        Ok(BlockState::Initialised(h)) => Err(pool_err(format!(
            "{} is pool {}, not the announced pool {}",
            path.display(),
            h.identity.uuid,
            cxlkv_controlplane::pool::PoolUuid(info.uuid)
        ))),
        Ok(BlockState::Fresh) => Err(pool_err(format!(
            "{} has no identity header (not initialised by a pool manager)",
            path.display()
        ))),
        Err(e) => Err(pool_err(format!(
            "{}: identity header refused: {e}",
            path.display()
        ))),
    }
}

/// The first [`HEADER_BYTES`] of the pool: read with `pread` from a file;
/// a device-DAX device does not support `read`, so its first block is mapped
/// and copied out.
pub(crate) fn read_header_block(
    backing: &dyn Backing,
    visibility: Visibility,
) -> std::io::Result<Vec<u8>> {
    let mut block = vec![0u8; HEADER_BYTES];
    if backing.kind() != BackingKind::DevDax {
        let file = File::from(backing.fd().try_clone_to_owned()?);
        file.read_exact_at(&mut block, 0)?;
        return Ok(block);
    }
    let extent = Extent::new(0, backing.align_bytes());
    // SAFETY: the first block is the pool manager's header, never part of a
    // region, so no client writes it through a data mapping; this mapping
    // forms no view of it (`read_shared` copies with volatile loads: the
    // manager may be rewriting a lease slot, and `decode` checksums the
    // copy, refusing a torn one) and is dropped before returning.
    let map =
        unsafe { MappedRegion::map_read_only(backing, RegionId(0), extent, &MapObservers::new()) }
            .map_err(std::io::Error::other)?;
    // The manager may be on another host: the header's lines are made
    // current first (on a device, `Flush` unless forced otherwise).
    map.read_shared(0, &mut block, visibility)
        .map_err(std::io::Error::other)?;
    Ok(block)
}

/// Tmpfs, hugetlbfs or another filesystem, from `fstatfs` (decides whether
/// huge pages are requested when mapping).
fn file_kind(fd: &OwnedFd) -> BackingKind {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `fd` is an open descriptor borrowed for the call; `st` is a
    // writable statfs the kernel fills.
    let rc = unsafe {
        libc::fstatfs(
            std::os::fd::AsRawFd::as_raw_fd(&fd.as_fd()),
            st.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return BackingKind::OtherFile;
    }
    // `f_type`'s integer type differs between architectures; masked to the
    // 32 bits a magic has (where it is a signed 32-bit integer,
    // HUGETLBFS_MAGIC, bit 31 set, comes back sign-extended).
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: fstatfs returned 0, so it initialised `st`.
    let magic = (unsafe { st.assume_init() }.f_type as i64) & 0xffff_ffff;
    match magic {
        TMPFS_MAGIC => BackingKind::Tmpfs,
        HUGETLBFS_MAGIC => BackingKind::Hugetlbfs,
        _ => BackingKind::OtherFile,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cxlkv_controlplane::pool::{PoolIdentity, PoolUuid};

    fn temp_pool(tag: &str, uuid: Option<[u8; 16]>) -> (PathBuf, PoolInfo) {
        let path = PathBuf::from(format!(
            "/dev/shm/cxlkv-client-pools-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let size = 8u64 << 20;
        let b = backing::open(&path, &OpenOptions::new().create_size_bytes(size)).unwrap();
        if let Some(uuid) = uuid {
            let mut block = vec![0u8; HEADER_BYTES];
            header::encode_identity(
                &mut block,
                &PoolIdentity {
                    uuid: PoolUuid(uuid),
                    size_bytes: size,
                    alignment_bytes: 2 << 20,
                },
            )
            .unwrap();
            let f = File::from(b.fd().try_clone_to_owned().unwrap());
            f.write_all_at(&block, 0).unwrap();
        }
        let info = PoolInfo {
            pool: 0,
            uuid: [7; 16],
            size_bytes: size,
            align_bytes: 2 << 20,
            path: path.display().to_string(),
            kind: proto::BackingKind::File,
            visibility: VisibilityMode::Coherent,
        };
        (path, info)
    }

    /// A `pool_paths` entry for a pool the server does not announce (a
    /// mistyped UUID, say) is named — and warned about — not silently
    /// ignored; the entries that match are not.
    #[test]
    fn pool_paths_for_pools_not_announced_are_named() {
        let (path, info) = temp_pool("announced", Some([7; 16]));
        let paths = vec![
            ([7; 16], path.clone()),
            ([8; 16], PathBuf::from("/dev/shm/typo")),
        ];
        let left: Vec<_> = unannounced(std::slice::from_ref(&info), &paths).collect();
        assert_eq!(left, [&([8u8; 16], PathBuf::from("/dev/shm/typo"))]);
        // Opening still works (the announced pool by its listed path), and
        // says which entry it did not use.
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = {
            let logs = std::sync::Arc::clone(&logs);
            move || LogWriter(std::sync::Arc::clone(&logs))
        };
        let subscriber = tracing_subscriber::fmt()
            .with_writer(writer)
            .with_ansi(false)
            .finish();
        let pools = tracing::subscriber::with_default(subscriber, || {
            open_by_path(std::slice::from_ref(&info), &paths, None).unwrap()
        });
        assert_eq!(pools.len(), 1);
        let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
        let warned: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("does not announce"))
            .collect();
        assert_eq!(warned.len(), 1, "{text}");
        assert!(
            warned[0].contains("/dev/shm/typo")
                && warned[0].contains(&PoolUuid([8; 16]).to_string()),
            "{text}"
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A `tracing` writer into a shared buffer.
    struct LogWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for LogWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_pool_opened_by_path_must_carry_the_announced_uuid() {
        let (good, info) = temp_pool("good", Some([7; 16]));
        let pools = open_by_path(std::slice::from_ref(&info), &[], None).unwrap();
        assert_eq!(pools[0].visibility, Visibility::Coherent);

        let (wrong, info_wrong) = temp_pool("wrong", Some([9; 16]));
        let err = open_by_path(&[info_wrong], &[], None).unwrap_err();
        assert!(err.to_string().contains("not the announced pool"), "{err}");

        let (fresh, info_fresh) = temp_pool("fresh", None);
        let err = open_by_path(&[info_fresh], &[], None).unwrap_err();
        assert!(err.to_string().contains("no identity header"), "{err}");

        // A configured path for the UUID wins over the announced one, and a
        // forced mode over the announced mode.
        let mut moved = info.clone();
        moved.path = "/nonexistent/pool".into();
        let pools = open_by_path(
            &[moved],
            &[([7; 16], good.clone())],
            Some(Visibility::Flush),
        )
        .unwrap();
        assert_eq!(pools[0].visibility, Visibility::Flush);
        for p in [good, wrong, fresh] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn descriptors_must_match_the_announced_pools() {
        let (path, info) = temp_pool("fds", Some([7; 16]));
        let fd: OwnedFd = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
            .into();
        let err = from_fds(std::slice::from_ref(&info), Vec::new(), None).unwrap_err();
        assert!(matches!(
            err,
            ClientError::PoolDescriptors {
                announced: 1,
                passed: 0
            }
        ));
        let pools = from_fds(&[info], vec![fd], None).unwrap();
        assert_eq!(pools[0].backing.kind(), BackingKind::Tmpfs);
        std::fs::remove_file(path).unwrap();
    }
}
