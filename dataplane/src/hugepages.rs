//! Reserving 2 MiB huge pages in the kernel's global pool, and giving them
//! back.
//!
//! hugetlbfs pools (and `MFD_HUGETLB` memfds) draw from
//! `/proc/sys/vm/nr_hugepages`, which is global to the host. Tests and benches
//! that need huge pages grow that pool by exactly what they need and shrink it
//! again when done, so a machine without huge pages configured can still run
//! them and is left as it was. Every user of this module on the host
//! serialises on one lock file ([`HUGEPAGES_LOCK_PATH`]) so that two test
//! processes never undo each other's reservation.
//!
//! [`HugePageReservation::reserve`] fails with a typed error, never panics,
//! when pages cannot be had (not root, memory too fragmented, lock held too
//! long): callers print a note and skip.
//!
//! The lock lives in world-writable `/tmp`, where another local user can
//! create its name first. It is opened without following a symlink, without
//! blocking (a FIFO planted there would block a plain open forever) and
//! close-on-exec, and it must be a regular file owned by this user or root:
//! anything else is refused ([`HugePageError::LockUnsafe`]), naming the
//! path and the owner. A lock another user merely holds is waited for at
//! most `lock_timeout` ([`HugePageError::LockTimeout`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The lock every cxlkv test and bench holds while it changes the pool.
pub const HUGEPAGES_LOCK_PATH: &str = "/tmp/cxlkv-hugepages.lock";

/// The huge page size this module reserves.
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;

const NR_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
const FREE_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
const RESV_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/resv_hugepages";

/// How often a waiter retries the lock, and how long it waits in total.
const LOCK_POLL: Duration = Duration::from_millis(20);

/// Why huge pages could not be reserved.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum HugePageError {
    #[error("cannot open the huge page lock {}", path.display())]
    Lock { path: PathBuf, source: io::Error },
    #[error("huge page lock {} still held by another process after {waited_ms} ms", path.display())]
    LockTimeout { path: PathBuf, waited_ms: u128 },
    /// The lock's name is taken by something this process must not trust:
    /// a symlink, a FIFO, a directory, a device, or a file of another
    /// user (root's is accepted).
    #[error(
        "huge page lock {} is {what} of uid {owner}, not a regular file of uid {expected_uid} or root: refusing to use it (remove it if it is stale)",
        path.display()
    )]
    LockUnsafe {
        path: PathBuf,
        what: &'static str,
        owner: u32,
        expected_uid: u32,
    },
    #[error("cannot access {}", path.display())]
    Sysfs { path: PathBuf, source: io::Error },
    #[error("{} holds {content:?}, expected a page count", path.display())]
    BadValue { path: PathBuf, content: String },
    #[error("wanted {wanted} free 2 MiB huge pages, the kernel could provide only {available}")]
    Insufficient { wanted: u64, available: u64 },
}

/// `pages` free 2 MiB huge pages, held until drop; the lock file is held as
/// long, so no other cxlkv test or bench changes the pool meanwhile.
#[derive(Debug)]
pub struct HugePageReservation {
    /// Held only for its `flock`, which closing the file on drop releases.
    _lock: File,
    added_pages: u64,
    pages: u64,
}

impl HugePageReservation {
    /// Makes sure `pages` huge pages are free, growing the kernel pool by the
    /// shortfall; waits at most `lock_timeout` for other holders of the lock.
    pub fn reserve(pages: u64, lock_timeout: Duration) -> Result<Self, HugePageError> {
        let lock = lock_file(Path::new(HUGEPAGES_LOCK_PATH), lock_timeout)?;
        let free = usable()?;
        let mut reservation = Self {
            _lock: lock,
            added_pages: 0,
            pages,
        };
        if free >= pages {
            return Ok(reservation);
        }
        let before = read_count(NR_HUGEPAGES)?;
        let target = before.saturating_add(pages - free);
        write_count(NR_HUGEPAGES, target)?;
        // The kernel grants what it can find contiguous memory for; read back
        // what it really did so that drop gives back exactly that (or, if
        // the read fails, what was asked for: pages added and never given
        // back would stay out of the machine's memory for good).
        let after = read_count(NR_HUGEPAGES);
        reservation.added_pages = after.as_ref().map_or(target, |&a| a).saturating_sub(before);
        after?;
        let available = usable()?;
        if available < pages {
            // Dropping `reservation` returns the pages just added.
            return Err(HugePageError::Insufficient {
                wanted: pages,
                available,
            });
        }
        Ok(reservation)
    }

    /// The number of free huge pages this reservation guaranteed.
    pub fn pages(&self) -> u64 {
        self.pages
    }
}

impl Drop for HugePageReservation {
    fn drop(&mut self) {
        if self.added_pages > 0 {
            // Shrink by what we added, relative to the current value: pages
            // still mapped by someone are kept by the kernel as surplus and
            // freed when unmapped.
            let result = read_count(NR_HUGEPAGES)
                .and_then(|now| write_count(NR_HUGEPAGES, now.saturating_sub(self.added_pages)));
            if let Err(err) = result {
                tracing::warn!(%err, added = self.added_pages, "could not give back huge pages");
            }
        }
    }
}

/// Free huge pages nobody has a claim on: `free_hugepages` counts those
/// already promised to existing hugetlbfs mappings (`resv_hugepages`) too.
fn usable() -> Result<u64, HugePageError> {
    Ok(read_count(FREE_HUGEPAGES)?.saturating_sub(read_count(RESV_HUGEPAGES)?))
}

/// Opens (creating it if missing) and `flock`s the lock file at `path`,
/// waiting at most `timeout` for another holder. The file is opened
/// read-only (`flock` needs no write access, so a lock root created stays
/// usable by other users), `O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`, and
/// checked on the open descriptor ([`check_lock_file`]).
fn lock_file(path: &Path, timeout: Duration) -> Result<File, HugePageError> {
    let lock_err = |source| HugePageError::Lock {
        path: path.to_owned(),
        source,
    };
    let opened = File::options()
        .read(true)
        .write(false)
        .create(false)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // O_CREAT on a read-only open (std wants write access for
            // `create`): set through the raw flags; 0644 so that users
            // other than the creator can open it too.
            File::options()
                .read(true)
                .custom_flags(libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .mode(0o644)
                .open(path)
                .map_err(|e| refused_or(path, e, lock_err))?
        }
        Err(e) => return Err(refused_or(path, e, lock_err)),
    };
    check_lock_file(path, &file)?;
    let start = Instant::now();
    loop {
        // SAFETY: `file` owns an open descriptor for the whole call; flock
        // takes no pointers.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(file);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::WouldBlock && err.raw_os_error() != Some(libc::EINTR) {
            return Err(HugePageError::Lock {
                path: path.to_owned(),
                source: err,
            });
        }
        if start.elapsed() >= timeout {
            return Err(HugePageError::LockTimeout {
                path: path.to_owned(),
                waited_ms: start.elapsed().as_millis(),
            });
        }
        std::thread::sleep(LOCK_POLL);
    }
}

/// An open that failed because of what is at `path` (`ELOOP`: a symlink
/// under `O_NOFOLLOW`; `ENXIO`: a FIFO without reader) is reported as the
/// unsafe lock it is, with its owner; any other failure through `other`.
fn refused_or(
    path: &Path,
    e: io::Error,
    other: impl FnOnce(io::Error) -> HugePageError,
) -> HugePageError {
    if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENXIO))
        && let Ok(meta) = std::fs::symlink_metadata(path)
    {
        return unsafe_lock(path, &meta);
    }
    other(e)
}

/// Refuses a lock file that is not a regular file owned by this process's
/// effective user or root; checked on the opened descriptor, so what is
/// checked is what is locked.
fn check_lock_file(path: &Path, file: &File) -> Result<(), HugePageError> {
    let meta = file.metadata().map_err(|source| HugePageError::Lock {
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.file_type().is_file() && (meta.uid() == euid || meta.uid() == 0) {
        return Ok(());
    }
    Err(unsafe_lock(path, &meta))
}

fn unsafe_lock(path: &Path, meta: &std::fs::Metadata) -> HugePageError {
    let t = meta.file_type();
    let what = if t.is_symlink() {
        "a symlink"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "a file"
    };
    HugePageError::LockUnsafe {
        path: path.to_owned(),
        what,
        owner: meta.uid(),
        // SAFETY: geteuid has no preconditions and cannot fail.
        expected_uid: unsafe { libc::geteuid() },
    }
}

fn read_count(path: &str) -> Result<u64, HugePageError> {
    let raw = std::fs::read_to_string(path).map_err(|source| HugePageError::Sysfs {
        path: PathBuf::from(path),
        source,
    })?;
    raw.trim().parse().map_err(|_| HugePageError::BadValue {
        path: PathBuf::from(path),
        content: raw.chars().take(32).collect(),
    })
}

fn write_count(path: &str, count: u64) -> Result<(), HugePageError> {
    std::fs::write(path, count.to_string()).map_err(|source| HugePageError::Sysfs {
        path: PathBuf::from(path),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    const SHORT: Duration = Duration::from_millis(50);

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn a_missing_lock_is_created_and_a_held_one_is_waited_for_boundedly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hugepages.lock");
        let held = lock_file(&path, SHORT).expect("a fresh lock is created and taken");
        assert!(path.metadata().unwrap().is_file());
        match lock_file(&path, SHORT) {
            Err(HugePageError::LockTimeout { .. }) => {}
            other => panic!("a held lock must time out, got {other:?}"),
        }
        drop(held);
        lock_file(&path, SHORT).expect("released: taken again");
    }

    /// A symlink planted at the lock's name used to be followed: the open
    /// created (or opened for writing) whatever file it named, as the user
    /// running the tests (root, to resize the huge page pool).
    #[test]
    fn a_symlink_at_the_lock_path_is_refused_and_its_target_never_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hugepages.lock");
        let target = dir.path().join("victim");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let err = lock_file(&path, SHORT).expect_err("a symlink must be refused");
        assert!(
            matches!(
                err,
                HugePageError::LockUnsafe {
                    what: "a symlink",
                    ..
                }
            ),
            "{err:?}"
        );
        let said = err.to_string();
        assert!(said.contains(&path.display().to_string()), "{said}");
        assert!(!target.exists(), "the symlink's target was created");

        std::fs::write(&target, "precious").unwrap();
        assert!(lock_file(&path, SHORT).is_err(), "existing target: refused");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
    }

    /// A lock file of another user is one that user can `flock` forever
    /// (or replace): refused with its owner named. Needs root to `chown`.
    #[test]
    fn a_lock_file_of_another_user_is_refused_naming_the_owner() {
        if !is_root() {
            eprintln!("not root: cannot chown a file to another user; skipped");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hugepages.lock");
        std::fs::write(&path, b"").unwrap();
        std::os::unix::fs::chown(&path, Some(4242), None).unwrap();
        let err = lock_file(&path, SHORT).expect_err("another user's file must be refused");
        assert!(
            matches!(
                err,
                HugePageError::LockUnsafe {
                    what: "a file",
                    owner: 4242,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("uid 4242"), "{err}");
        // Root's own file is accepted (root creates the real one).
        std::os::unix::fs::chown(&path, Some(0), None).unwrap();
        lock_file(&path, SHORT).expect("root's lock file is accepted");
    }

    /// A FIFO planted at the lock's name used to block the open forever
    /// (an open for writing waits for a reader), past any lock timeout.
    #[test]
    fn a_fifo_at_the_lock_path_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hugepages.lock");
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c_path` is a valid NUL-terminated path for the call.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let (tx, rx) = mpsc::channel();
        let p = path.clone();
        // Detached: if the open blocks, the test fails below instead of
        // hanging (the thread stays blocked until the process exits).
        std::thread::spawn(move || {
            let _ = tx.send(lock_file(&p, SHORT).map(drop));
        });
        let result = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("opening the lock blocked on a FIFO for 5 s");
        assert!(
            matches!(
                result,
                Err(HugePageError::LockUnsafe { what: "a FIFO", .. })
            ),
            "{result:?}"
        );
    }

    #[test]
    fn a_directory_at_the_lock_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hugepages.lock");
        std::fs::create_dir(&path).unwrap();
        let err = lock_file(&path, SHORT).expect_err("a directory must be refused");
        assert!(
            matches!(
                err,
                HugePageError::LockUnsafe {
                    what: "a directory",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
