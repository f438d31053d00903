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
}
