//! The few operating-system calls the pool manager's drivers need: random
//! bytes, directory fsync, and non-blocking `flock`. Kept here so that the
//! `unsafe` FFI sits in one small place.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::types::PoolUuid;

/// Most `EINTR` retries of one `getrandom` call before giving up.
const MAX_GETRANDOM_RETRIES: usize = 64;

/// Fills `buf` (at most 256 bytes, for which the kernel never returns a short
/// read once its pool is initialised) with cryptographically secure random
/// bytes, blocking until the kernel's pool is initialised.
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    assert!(
        buf.len() <= 256,
        "getrandom returns at most 256 bytes without short reads"
    );
    let mut filled = 0;
    let mut retries = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes for
        // the duration of the call; getrandom writes at most that many.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted && retries < MAX_GETRANDOM_RETRIES {
                retries += 1;
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

/// A random (version 4) UUID for a new pool.
pub fn new_pool_uuid() -> io::Result<PoolUuid> {
    let mut b = [0u8; 16];
    random_bytes(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Ok(PoolUuid(b))
}

/// Makes a directory's entries (created, renamed, removed files) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Tries to take an exclusive `flock` on `file` without blocking. `Ok(false)`
/// means another open file description holds it.
///
/// `flock` locks belong to the open file description: they conflict with
/// every other `open()` of the same file, in this process or another, and are
/// released when the last descriptor of that description closes (so when the
/// holder dies). A descriptor passed to another process (`SCM_RIGHTS`, fork)
/// keeps the lock alive, which is why the lock files are opened separately
/// and close-on-exec.
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: the descriptor is valid while `file` is borrowed; flock has
        // no memory effects.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            // A non-blocking flock returns EINTR only if a signal lands during
            // the call; retrying is immediate and cannot wait on the holder.
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// Refuses a state directory another user could tamper with: the journal,
/// checkpoint, secret and lock files inside it are opened by name, so
/// whoever can create entries there (a planted `lock` symlink, which the
/// manager would truncate) or owns it can make the manager write where it
/// should not. `dir` must exist.
///
/// The rules: the path itself, if a symlink, belongs to this user or root
/// (another user's symlink in a shared directory like `/dev/shm` could point
/// anywhere); the directory it resolves to, and every directory above it,
/// belongs to this user or root and is writable by nobody else — except by
/// a group this process is in, and, above the state directory, by anyone
/// if sticky (`/dev/shm`, `/tmp`: others may create names there but not
/// replace ours).
pub fn check_state_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let trusted = |uid: u32| uid == euid || uid == 0;
    let refuse = |what: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, what));
    let link = std::fs::symlink_metadata(dir)?;
    if link.file_type().is_symlink() && !trusted(link.uid()) {
        return refuse(format!(
            "{} is a symlink of uid {}, not of this user (uid {euid}) or root: \
             another user could point it anywhere",
            dir.display(),
            link.uid()
        ));
    }
    let real = std::fs::canonicalize(dir)?;
    for d in real.ancestors() {
        let meta = std::fs::metadata(d)?;
        let whose = if d == real {
            format!("state directory {}", dir.display())
        } else {
            format!(
                "{} (above the state directory {})",
                d.display(),
                dir.display()
            )
        };
        if !trusted(meta.uid()) {
            return refuse(format!(
                "{whose} belongs to uid {}, not to this user (uid {euid}) or root: \
                 its owner could replace the pool manager's files (chown it, or use another)",
                meta.uid()
            ));
        }
        let mode = meta.mode();
        // Group write is trusted when the group is one of this process's
        // (a deployment's choice: Kubernetes `fsGroup` volumes, OpenShift's
        // group 0); anyone else's write is not, except in a sticky
        // directory above the state directory (`/dev/shm`, `/tmp`).
        let group_writes = mode & 0o020 != 0 && !in_our_groups(meta.gid());
        let others_write = mode & 0o002 != 0 && (d == real || mode & 0o1000 == 0);
        if group_writes || others_write {
            return refuse(format!(
                "{whose} is writable by others or by a group this process is not in \
                 (mode {:o}, gid {}): they could plant files the pool manager opens \
                 (chmod 700 it)",
                mode & 0o7777,
                meta.gid()
            ));
        }
    }
    Ok(())
}

/// Whether `gid` is this process's effective group or one of its
/// supplementary groups.
fn in_our_groups(gid: u32) -> bool {
    // SAFETY: getegid has no preconditions and cannot fail.
    if gid == unsafe { libc::getegid() } {
        return true;
    }
    let mut groups = [0 as libc::gid_t; 256];
    // SAFETY: `groups` is writable for the 256 entries passed; the kernel
    // writes at most that many (or fails with EINVAL if there are more).
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    n > 0 && groups[..n as usize].contains(&gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_random_version_4() {
        let a = new_pool_uuid().unwrap();
        let b = new_pool_uuid().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.0[6] >> 4, 4);
        assert_eq!(a.0[8] >> 6, 0b10);
    }

    #[test]
    fn a_state_directory_writable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_state_dir(&dir).unwrap();
        for mode in [0o777, 0o1777, 0o702] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = check_state_dir(&dir).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{mode:o}");
            assert!(e.to_string().contains("writable by others"), "{e}");
        }
        // Writable by its group, which is this process's: trusted.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        check_state_dir(&dir).unwrap();
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            // A group this process is not in (root may chown to any).
            std::os::unix::fs::chown(&dir, None, Some(54321)).unwrap();
            assert!(!in_our_groups(54321));
            let e = check_state_dir(&dir).unwrap_err();
            assert!(e.to_string().contains("gid 54321"), "{e}");
            std::os::unix::fs::chown(&dir, None, Some(0)).unwrap();
        }
        // A sticky shared directory above is fine (as /dev/shm or /tmp).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_state_dir(&dir).unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check_state_dir(&dir).is_err(), "not sticky: refused");
    }
}
