//! What a bench killed outright left behind.
//!
//! Every file and directory a bench creates in `/dev/shm` or the temporary
//! directory (its servers' pools, their state directories and sockets, its
//! temporary pools and journals) is named `cxlkv-<prefix>-<pid>…`, with a
//! prefix of [`PREFIXES`] and the bench's pid, and removed when the bench
//! ends — unless it ends by `SIGKILL` (or a crash, or a signal it does not
//! handle), which runs no destructor: a 256 MiB pool per server then stays
//! in `/dev/shm`, in RAM, until someone removes it. So a bench, before it
//! runs its scenario, removes the entries of its own naming whose pid is no
//! longer a live process, and says so on standard error ([`sweep`]).
//!
//! An entry stays when the pid in its name is a live process — it answers
//! `kill(pid, 0)` and is not a zombie (a pid reused since by another
//! process counts as alive, so the entry stays, which is safe) — and when
//! a process still uses it whatever its name says ([`in_use`]: a pool file
//! or state directory a pool manager holds locked, a socket something
//! listens on): a `cxlkv serve` the killed bench started may still be
//! stopping, and a bench in another pid namespace sharing the directory
//! (a container with `--ipc=host`) has pids this namespace cannot see.
//! (`copy`'s pool is locked for that reason; a file nobody locks, of a bench
//! in another pid namespace, would lose its name, while the file itself
//! lives on for the process that has it open or mapped.) Only this user's
//! entries are looked at (a root bench leaves other users' files alone), a
//! symbolic link is removed as a link, never followed, and nothing outside
//! the two directories' first level is looked at (but a directory's lock
//! files, one level down).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The name prefixes of the bench's entries (after `cxlkv-`, before the
/// pid): `ServerConfig::ephemeral`'s tags of the scenarios' servers
/// (`bench`, `bench-store`, …), `rtt`'s sockets, `load`'s `cxlkv serve`,
/// `copy`'s pool, `pool`'s and `pool_target`'s temporary directories.
pub(crate) const PREFIXES: &[&str] = &[
    "bench",
    "bench-store",
    "bench-tier",
    "bench-rtt",
    "bench-rtt-get",
    "bench-share",
    "bench-copy",
    "bench-pool",
    "bench-state",
    "rtt",
    "load",
];

/// The pid in the name of a bench's entry: `cxlkv-<prefix>-<pid>` followed
/// by nothing, `-` or `.`, with a prefix of [`PREFIXES`]; `None` for any
/// other name.
pub(crate) fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("cxlkv-")?;
    PREFIXES.iter().find_map(|prefix| {
        let tail = rest.strip_prefix(prefix)?.strip_prefix('-')?;
        let digits = tail.len() - tail.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let after = tail[digits..].chars().next();
        if digits == 0 || !matches!(after, None | Some('-' | '.')) {
            return None;
        }
        tail[..digits].parse().ok()
    })
}

/// Whether process `pid` exists and is not a zombie (`kill(pid, 0)`:
/// `EPERM` is a live process of another user; a zombie, not yet reaped by
/// its parent, uses no file any more).
pub(crate) fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        // 0 and negative pids name process groups: never a bench's pid.
        return true;
    }
    // SAFETY: kill() with signal 0 sends nothing; it takes no pointers.
    let rc = unsafe { libc::kill(pid, 0) };
    let exists = rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !zombie(pid)
}

/// Whether `/proc` shows process `pid` as a zombie (`false` if it cannot
/// be read: then the process counts as alive).
fn zombie(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // "pid (comm) state …": comm may hold spaces and parentheses.
            let (_, rest) = stat.rsplit_once(") ")?;
            Some(rest.starts_with('Z'))
        })
        .unwrap_or(false)
}

/// What [`remove_stale`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Entries removed, with the dead pid their name carries.
    pub removed: Vec<(PathBuf, u32)>,
    /// Entries of dead pids that could not be removed, and why.
    pub failed: Vec<(PathBuf, String)>,
    /// Entries of dead pids that a process still uses ([`in_use`]): kept.
    pub in_use: Vec<(PathBuf, u32)>,
}

/// Removes the entries of `dirs` (first level only) that are a bench's
/// ([`owner_pid`]), belong to user `uid`, and whose pid is neither `me`
/// nor `alive`. At most `limit` entries per directory are looked at.
pub(crate) fn remove_stale(
    dirs: &[PathBuf],
    uid: u32,
    me: u32,
    alive: impl Fn(u32) -> bool,
    limit: usize,
) -> Swept {
    let mut swept = Swept::default();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.take(limit).flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(owner_pid) else {
                continue;
            };
            if pid == me || alive(pid) {
                continue;
            }
            let path = entry.path();
            // Not followed: a link is removed as a link.
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.uid() != uid {
                continue;
            }
            if in_use(&path, &meta) {
                swept.in_use.push((path, pid));
                continue;
            }
            let result = if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Ok(()) => swept.removed.push((path, pid)),
                // Removed meanwhile by someone else: nothing left to say.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => swept.failed.push((path, e.to_string())),
            }
        }
    }
    swept
}

/// Whether a process still uses the entry at `path`, whatever the pid in its
/// name says: a pool file or a state directory a pool manager holds locked
/// (`flock`, `controlplane/src/pool/fence.rs`: the lock lives exactly as
/// long as the manager), or a socket something listens on. This covers the
/// two ways a dead-looking pid can still have users: a `cxlkv serve` that
/// the killed bench started and that is still stopping (it holds its
/// pool's locks until it exits), and a bench in another pid namespace
/// sharing the directory (whose pid this namespace cannot see); `copy`'s
/// temporary pool holds a shared lock for the same reason. A file nobody
/// locks is not seen; unlinking it leaves an open or mapped file working,
/// only its name goes.
fn in_use(path: &Path, meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_socket() {
        // Only a refused connection says nobody listens; anything else
        // (accepted, or a permission error) keeps it.
        return match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => true,
            Err(e) => e.raw_os_error() != Some(libc::ECONNREFUSED),
        };
    }
    if kind.is_file() {
        return locked(path);
    }
    if kind.is_dir() {
        // A state directory's lock file, here or one level down (`bench
        // pool`'s temporary directory holds its daemon's state directory).
        let Ok(entries) = std::fs::read_dir(path) else {
            return true;
        };
        return locked(&path.join(LOCK_FILE))
            || entries
                .flatten()
                .take(MAX_SUBDIRS)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .any(|e| locked(&e.path().join(LOCK_FILE)));
    }
    false
}

/// The state directory's lock file (`fence::LOCK_FILE`).
const LOCK_FILE: &str = cxlkv_controlplane::pool::fence::LOCK_FILE;
/// Subdirectories of one entry looked at for a lock file.
const MAX_SUBDIRS: usize = 64;

/// Whether another open of the file at `path` holds an `flock` on it (a
/// missing or unreadable file holds none). Links are not followed.
pub(crate) fn locked(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is an open descriptor for the call's duration; the
    // lock, if taken, is released when `file` is closed below.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

/// Bound on the entries looked at per directory: a `/tmp` with millions of
/// files must not hold a bench up.
const MAX_ENTRIES: usize = 100_000;

/// The directories a bench names its entries in: `/dev/shm` and the
/// temporary directory.
fn bench_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from(crate::dataplane::backing::DEFAULT_POOL_DIR)];
    let tmp = std::env::temp_dir();
    if !dirs.iter().any(|d| Path::new(d) == tmp) {
        dirs.push(tmp);
    }
    dirs
}

/// Removes what benches killed before left (module docs), saying so on
/// standard error, one note per entry.
pub(crate) fn sweep(reporter: &super::Reporter) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let swept = remove_stale(&bench_dirs(), uid, std::process::id(), alive, MAX_ENTRIES);
    for (path, pid) in &swept.removed {
        reporter.note(&format!(
            "removed {}, left by bench process {pid}, which is gone (killed before it could remove it)",
            path.display()
        ));
    }
    for (path, why) in &swept.failed {
        reporter.note(&format!(
            "cannot remove {}, left by a bench process that is gone: {why}; remove it by hand",
            path.display()
        ));
    }
    for (path, pid) in &swept.in_use {
        reporter.note(&format!(
            "kept {}: named after bench process {pid}, which is gone here, but a process still \
             uses it (a server still stopping, or a bench in another pid namespace)",
            path.display()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pid_is_read_from_the_benchs_names_only() {
        for (name, pid) in [
            ("cxlkv-bench-123-0-1f.pool", Some(123)),
            ("cxlkv-bench-123-0-1f.pool.state", Some(123)),
            ("cxlkv-bench-rtt-get-77-3-ab.sock", Some(77)),
            ("cxlkv-rtt-9-ours.sock", Some(9)),
            ("cxlkv-load-4242-5f3a.pool", Some(4242)),
            ("cxlkv-bench-copy-31", Some(31)),
            ("cxlkv-bench-pool-8-run-AbC123", Some(8)),
            ("cxlkv-bench-state-8-xYz", Some(8)),
            // Not the bench's: a server's, a test's, an operator's.
            ("cxlkv.pool", None),
            ("cxlkv.pool.state", None),
            ("cxlkv-t-123-0.sock", None),
            ("cxlkv-serve-auto-per-record-15-123.pool", None),
            ("cxlkv-benchmark-123", None),
            ("cxlkv-bench-12a", None),
            ("cxlkv-bench-", None),
            ("cxlkv-bench-copy-", None),
            ("cxlkv-bench-99999999999999999999", None),
            ("bench-123", None),
        ] {
            assert_eq!(owner_pid(name), pid, "{name}");
        }
    }

    /// A child that exited: its pid, dead, or (`reap` false) its zombie.
    fn exited_child(reap: bool) -> (u32, Option<std::process::Child>) {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        if reap {
            child.wait().unwrap();
            return (pid, None);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !zombie(pid as libc::pid_t) {
            assert!(std::time::Instant::now() < deadline, "no zombie");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        (pid, Some(child))
    }

    #[test]
    fn a_process_is_alive_until_it_exits_even_unreaped() {
        assert!(alive(std::process::id()));
        let (zombie_pid, mut zombie) = exited_child(false);
        assert!(!alive(zombie_pid), "a zombie uses no file");
        zombie.take().unwrap().wait().unwrap();
        let (dead, _) = exited_child(true);
        assert!(!alive(dead));
    }

    #[test]
    fn only_this_users_entries_of_dead_benches_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (me, dead, live) = (1_000_001, 1_000_002, 1_000_003);
        let entries = [
            (format!("cxlkv-bench-{dead}-0-1f.pool"), false, true),
            (format!("cxlkv-bench-state-{dead}-AbC"), true, true),
            (format!("cxlkv-rtt-{dead}-ours.sock"), false, true),
            (format!("cxlkv-bench-{live}-0-1f.pool"), false, false),
            (format!("cxlkv-load-{me}-1.pool"), false, false),
            (format!("cxlkv-t-{dead}-0.sock"), false, false),
            ("cxlkv.pool".to_owned(), false, false),
        ];
        for (name, is_dir, _) in &entries {
            let path = dir.path().join(name);
            if *is_dir {
                std::fs::create_dir(&path).unwrap();
                std::fs::write(path.join("journal"), b"x").unwrap();
            } else {
                std::fs::write(&path, b"x").unwrap();
            }
        }
        // A link to a dead bench's name elsewhere: the link goes, the
        // target stays.
        let target = tempfile::NamedTempFile::new().unwrap();
        let link = dir.path().join(format!("cxlkv-bench-copy-{dead}"));
        std::os::unix::fs::symlink(target.path(), &link).unwrap();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let dirs = [dir.path().to_owned()];

        // Another user's entries are left alone.
        let none = remove_stale(&dirs, uid + 1, me, |p| p == live, 100);
        assert_eq!(none, Swept::default());

        let swept = remove_stale(&dirs, uid, me, |p| p == live, 100);
        assert!(swept.failed.is_empty(), "{:?}", swept.failed);
        let mut removed: Vec<_> = swept
            .removed
            .iter()
            .map(|(p, pid)| (p.clone(), *pid))
            .collect();
        removed.sort();
        let mut expected: Vec<_> = entries
            .iter()
            .filter(|(_, _, stale)| *stale)
            .map(|(name, _, _)| (dir.path().join(name), dead))
            .chain([(link.clone(), dead)])
            .collect();
        expected.sort();
        assert_eq!(removed, expected);
        for (name, _, stale) in &entries {
            assert_eq!(dir.path().join(name).exists(), !stale, "{name}");
        }
        assert!(target.path().exists(), "a link is not followed");
    }

    /// Entries named after a dead pid that a process still uses are kept
    /// (a pool or state directory a pool manager locks, one level down
    /// too; a socket something listens on); the same entries unused go.
    #[test]
    fn entries_a_process_still_uses_are_kept_whatever_their_pid() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let (me, dead) = (1_000_001, 1_000_002);
        let d = |name: String| dir.path().join(name);
        // Held as a pool manager holds them: another open file description
        // with an exclusive flock.
        let lock = |path: &Path| {
            let f = std::fs::File::open(path).unwrap();
            // SAFETY: `f` is open; the lock lives as long as `f`.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            assert_eq!(rc, 0, "flock {}", path.display());
            f
        };
        let pool = d(format!("cxlkv-bench-{dead}-0-1f.pool"));
        std::fs::write(&pool, b"x").unwrap();
        let state = d(format!("cxlkv-bench-{dead}-0-1f.pool.state"));
        std::fs::create_dir(&state).unwrap();
        std::fs::write(state.join(LOCK_FILE), b"1").unwrap();
        let nested = d(format!("cxlkv-bench-pool-{dead}-run"));
        std::fs::create_dir_all(nested.join("state")).unwrap();
        std::fs::write(nested.join("state").join(LOCK_FILE), b"1").unwrap();
        let listening = d(format!("cxlkv-rtt-{dead}-ours.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&listening).unwrap();
        let closed = d(format!("cxlkv-rtt-{dead}-raw.sock"));
        drop(std::os::unix::net::UnixListener::bind(&closed).unwrap());
        let held = [
            lock(&pool),
            lock(&state.join(LOCK_FILE)),
            lock(&nested.join("state").join(LOCK_FILE)),
        ];
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let dirs = [dir.path().to_owned()];

        let swept = remove_stale(&dirs, uid, me, |_| false, 100);
        assert_eq!(
            swept.removed,
            vec![(closed.clone(), dead)],
            "only the socket nobody listens on"
        );
        let mut kept: Vec<_> = swept.in_use.iter().map(|(p, _)| p.clone()).collect();
        kept.sort();
        let mut expected = vec![
            pool.clone(),
            state.clone(),
            nested.clone(),
            listening.clone(),
        ];
        expected.sort();
        assert_eq!(kept, expected);
        assert!(pool.exists() && state.join(LOCK_FILE).exists() && listening.exists());

        // Once nobody holds them, they go.
        drop(held);
        drop(listener);
        let swept = remove_stale(&dirs, uid, me, |_| false, 100);
        assert!(swept.in_use.is_empty(), "{:?}", swept.in_use);
        assert_eq!(swept.removed.len(), 4, "{:?}", swept.removed);
        assert!(!pool.exists() && !state.exists() && !nested.exists() && !listening.exists());
    }
}
