//! One pool manager per state directory and per pool file, on this host.
//!
//! Both locks are `flock(LOCK_EX | LOCK_NB)` on a file descriptor opened only
//! for the lock, close-on-exec and never passed to anyone, so the lock lives
//! exactly as long as the manager process (the kernel drops it when the
//! process dies, however it dies). A second manager — another process, or a
//! second open in the same process — gets a clear refusal instead of
//! corrupting the journal or double-allocating the pool.
//!
//! - [`StateDirLock`]: `<state dir>/lock`; the holder writes its pid there so
//!   that the refusal can name it (diagnostic only: the lock, not the file
//!   content, is the truth).
//! - [`PoolFileLock`]: the pool file or device itself, opened read-only a
//!   second time. Not the descriptor that is mapped or sent to clients: a
//!   client holding a copy of a locked description would keep the lock alive
//!   after the manager died.
//!
//! Managers on other hosts cannot see these locks; the pool header's epoch and
//! lease cover that case (see [`super::header`]).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::sys::try_lock_exclusive;

/// Name of the lock file inside a state directory.
pub const LOCK_FILE: &str = "lock";

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    #[error(
        "state directory {} is in use by another pool manager{}; refusing to start a second one",
        dir.display(),
        holder_pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    StateDirLocked {
        dir: PathBuf,
        holder_pid: Option<u32>,
    },
    #[error(
        "pool {} is served by another pool manager on this host (it holds the file lock); refusing to start a second one",
        path.display()
    )]
    PoolFileLocked { path: PathBuf },
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> FenceError + 'a {
    move |source| FenceError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Exclusive use of a state directory. Released on drop (or process death).
#[derive(Debug)]
pub struct StateDirLock {
    _file: File,
    path: PathBuf,
}

impl StateDirLock {
    pub fn acquire(dir: &Path) -> Result<Self, FenceError> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // Not through a symlink: the file is truncated below.
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err("open lock file", &path))?;
        if !file
            .metadata()
            .map_err(io_err("stat lock file", &path))?
            .is_file()
        {
            return Err(io_err("use as a lock file", &path)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        if !try_lock_exclusive(&file).map_err(io_err("flock", &path))? {
            let mut s = String::new();
            let holder_pid = file
                .read_to_string(&mut s)
                .ok()
                .and_then(|_| s.trim().parse().ok());
            return Err(FenceError::StateDirLocked {
                dir: dir.to_path_buf(),
                holder_pid,
            });
        }
        // Diagnostic only, so not synced: a stale pid after a crash is
        // harmless because the next holder rewrites it.
        let stamp = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
            writeln!(f, "{}", std::process::id())
        };
        stamp(&mut file).map_err(io_err("write lock file", &path))?;
        Ok(Self { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Exclusive management of one pool file or device on this host.
#[derive(Debug)]
pub struct PoolFileLock {
    _file: File,
    path: PathBuf,
}

impl PoolFileLock {
    pub fn acquire(path: &Path) -> Result<Self, FenceError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_err("open pool file for locking", path))?;
        if !try_lock_exclusive(&file).map_err(io_err("flock", path))? {
            return Err(FenceError::PoolFileLocked {
                path: path.to_path_buf(),
            });
        }
        Ok(Self {
            _file: file,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("cxlkv-fence-")
            .tempdir_in("/dev/shm")
            .unwrap()
    }

    #[test]
    fn a_second_state_dir_lock_is_refused_and_names_the_holder() {
        let d = shm_dir();
        let held = StateDirLock::acquire(d.path()).unwrap();
        // A second open file description: flock conflicts even in-process.
        match StateDirLock::acquire(d.path()) {
            Err(FenceError::StateDirLocked { holder_pid, .. }) => {
                assert_eq!(holder_pid, Some(std::process::id()));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        drop(held);
        StateDirLock::acquire(d.path()).unwrap();
    }

    #[test]
    fn a_second_pool_file_lock_is_refused_until_the_first_is_dropped() {
        let d = shm_dir();
        let pool = d.path().join("pool");
        std::fs::write(&pool, [0u8; 4096]).unwrap();
        let held = PoolFileLock::acquire(&pool).unwrap();
        let e = PoolFileLock::acquire(&pool).unwrap_err();
        assert!(matches!(e, FenceError::PoolFileLocked { .. }));
        assert!(
            e.to_string().contains("refusing to start a second one"),
            "{e}"
        );
        drop(held);
        PoolFileLock::acquire(&pool).unwrap();
    }
}
