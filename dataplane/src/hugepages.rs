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

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
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

fn lock_file(path: &Path, timeout: Duration) -> Result<File, HugePageError> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|source| HugePageError::Lock {
            path: path.to_owned(),
            source,
        })?;
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
