//! Which pool this state directory last served from which path
//! (`<state>/pool-paths`), so that a pool file that lost its header is
//! refused rather than initialised as a new, empty pool.
//!
//! The journal knows a pool by the UUID in the pool's own header block.
//! When that block is gone — the file truncated (a client holds a writable
//! descriptor), wiped, or deleted and created again — nothing else ties the
//! path to the pool: the opening sequence would see an all-zero block,
//! write a new identity and add a second pool to the ledger, while the
//! ledger still holds the old pool's regions (owners that reattach, grace
//! periods, tokens) for bytes that are gone. This file is that tie: when a
//! path's all-zero header belongs, by this file, to a pool the ledger knows,
//! the open is refused (`pools.rs`).
//!
//! It is advisory in one direction only: an entry is written before the
//! pool can serve its first allocation (after `open_pool` is committed,
//! before the lease is written), so every pool with regions has one — except
//! pools last opened by a build without this file, which get theirs at their
//! next open. A lost or removed file loses no state; it is written again as
//! the pools open.
//!
//! **File**, little-endian, CRC = CRC32C, rewritten whole (temporary file,
//! fsync, rename, directory fsync) when an entry changes:
//!
//! ```text
//!  0  8 magic "CXLKVPTH"        entry (count times)
//!  8  4 format version (1)       0 16 pool UUID
//! 12  4 count (≤ MAX_POOLS)     16  2 path length (1..=4096)
//! 16 16 reserved 0              18  … path bytes (canonical, absolute)
//! … entries, then 4 bytes: CRC of everything before
//! ```
//!
//! Entries are kept only for pools the ledger knows (at most
//! [`MAX_POOLS`]), one per path and one per pool.

use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::pool::ledger::MAX_POOLS;
use crate::pool::record::le_u32;
use crate::pool::sys::fsync_dir;
use crate::pool::types::PoolUuid;

/// File name inside the state directory.
pub const POOL_PATHS_FILE: &str = "pool-paths";
const POOL_PATHS_TMP_FILE: &str = "pool-paths.tmp";
/// `b"CXLKVPTH"`.
pub const POOL_PATHS_MAGIC: [u8; 8] = *b"CXLKVPTH";
pub const POOL_PATHS_FORMAT_VERSION: u32 = 1;
const HEADER_BYTES: usize = 32;
const ENTRY_FIXED_BYTES: usize = 18;
const CRC_BYTES: usize = 4;
/// Longest path recorded (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// Largest file that can hold [`MAX_POOLS`] entries.
const MAX_FILE_BYTES: usize =
    HEADER_BYTES + MAX_POOLS * (ENTRY_FIXED_BYTES + MAX_PATH_BYTES) + CRC_BYTES;

/// One pool and the path it was served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathEntry {
    pub uuid: PoolUuid,
    pub path: PathBuf,
}

/// Why the pool paths file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PathsError {
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "pool paths file {} is unusable ({reason}); it only records which pool was served from which \
         path: if every pool file is intact, remove it (it is written again as the pools open)",
        path.display()
    )]
    Corrupt { path: PathBuf, reason: String },
}

/// Encodes `entries` as the whole file. Entries must be within the limits
/// ([`decode`] would refuse them otherwise); checked by assertion.
pub fn encode(entries: &[PathEntry]) -> Vec<u8> {
    assert!(entries.len() <= MAX_POOLS, "at most one entry per pool");
    let mut out = Vec::with_capacity(HEADER_BYTES + entries.len() * 64 + CRC_BYTES);
    out.extend_from_slice(&POOL_PATHS_MAGIC);
    out.extend_from_slice(&POOL_PATHS_FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 16]);
    for e in entries {
        let path = e.path.as_os_str().as_bytes();
        assert!(
            (1..=MAX_PATH_BYTES).contains(&path.len()),
            "a recorded path is 1..=MAX_PATH_BYTES bytes"
        );
        out.extend_from_slice(&e.uuid.0);
        out.extend_from_slice(&(path.len() as u16).to_le_bytes());
        out.extend_from_slice(path);
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes a whole file, checking magic, version, reserved bytes, limits,
/// exact length and CRC. The error is the reason, for [`PathsError::Corrupt`].
pub fn decode(bytes: &[u8]) -> Result<Vec<PathEntry>, String> {
    if bytes.len() < HEADER_BYTES + CRC_BYTES {
        return Err(format!("{} bytes, shorter than a header", bytes.len()));
    }
    let (body, crc) = bytes.split_at(bytes.len() - CRC_BYTES);
    if le_u32(crc) != crc32c::crc32c(body) {
        return Err("checksum mismatch".into());
    }
    if body[..8] != POOL_PATHS_MAGIC {
        return Err("not a pool paths file (bad magic)".into());
    }
    let version = le_u32(&body[8..]);
    if version != POOL_PATHS_FORMAT_VERSION {
        return Err(format!(
            "format version {version}, this build reads {POOL_PATHS_FORMAT_VERSION}"
        ));
    }
    let count = le_u32(&body[12..]) as usize;
    if count > MAX_POOLS {
        return Err(format!("{count} entries, at most {MAX_POOLS}"));
    }
    if body[16..HEADER_BYTES].iter().any(|&b| b != 0) {
        return Err("reserved bytes are not zero".into());
    }
    let mut entries = Vec::with_capacity(count);
    let mut at = HEADER_BYTES;
    for i in 0..count {
        let fixed = body
            .get(at..at + ENTRY_FIXED_BYTES)
            .ok_or_else(|| format!("entry {i} is cut short"))?;
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&fixed[..16]);
        let len = u16::from_le_bytes([fixed[16], fixed[17]]) as usize;
        if !(1..=MAX_PATH_BYTES).contains(&len) {
            return Err(format!("entry {i} has a path of {len} bytes"));
        }
        at += ENTRY_FIXED_BYTES;
        let path = body
            .get(at..at + len)
            .ok_or_else(|| format!("entry {i} is cut short"))?;
        at += len;
        entries.push(PathEntry {
            uuid: PoolUuid(uuid),
            path: PathBuf::from(OsStr::from_bytes(path)),
        });
    }
    if at != body.len() {
        return Err(format!("{} bytes after the last entry", body.len() - at));
    }
    Ok(entries)
}

/// The path under which a pool is recorded: canonical (symlinks and `..`
/// resolved) where it exists, else its canonical directory joined with its
/// name, else absolute as given.
pub fn key_of(path: &Path) -> PathBuf {
    if let Ok(p) = fs::canonicalize(path) {
        return p;
    }
    if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(dir) = fs::canonicalize(dir) {
            return dir.join(name);
        }
    }
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The pool paths of one state directory, as loaded.
#[derive(Debug)]
pub struct PoolPaths {
    file: PathBuf,
    entries: Vec<PathEntry>,
}

impl PoolPaths {
    /// Reads `<dir>/pool-paths`; a missing file is empty.
    pub fn load(dir: &Path) -> Result<Self, PathsError> {
        let file = dir.join(POOL_PATHS_FILE);
        let io_err = |op, source| PathsError::Io {
            op,
            path: file.clone(),
            source,
        };
        let mut image = Vec::new();
        match fs::File::open(&file) {
            Ok(f) => {
                f.take(MAX_FILE_BYTES as u64 + 1)
                    .read_to_end(&mut image)
                    .map_err(|e| io_err("read", e))?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Self {
                    file,
                    entries: Vec::new(),
                });
            }
            Err(e) => return Err(io_err("open", e)),
        }
        if image.len() > MAX_FILE_BYTES {
            return Err(PathsError::Corrupt {
                path: file,
                reason: format!("larger than {MAX_FILE_BYTES} bytes"),
            });
        }
        match decode(&image) {
            Ok(entries) => Ok(Self { file, entries }),
            Err(reason) => Err(PathsError::Corrupt { path: file, reason }),
        }
    }

    /// The pool last served from `key` (a [`key_of`] path), if any.
    pub fn uuid_at(&self, key: &Path) -> Option<PoolUuid> {
        self.entries.iter().find(|e| e.path == key).map(|e| e.uuid)
    }

    /// Records that pool `uuid` is served from `key`, dropping any other
    /// entry for that path or that pool and every entry of a pool `known`
    /// says the ledger no longer has. Writes the file only if that changes
    /// it. A path longer than [`MAX_PATH_BYTES`] is not recorded.
    pub fn record(
        &mut self,
        key: &Path,
        uuid: PoolUuid,
        known: impl Fn(PoolUuid) -> bool,
    ) -> Result<(), PathsError> {
        let len = key.as_os_str().len();
        if !(1..=MAX_PATH_BYTES).contains(&len) {
            return Ok(());
        }
        let mut next: Vec<PathEntry> = self
            .entries
            .iter()
            .filter(|e| e.path != key && e.uuid != uuid && known(e.uuid))
            .cloned()
            .collect();
        next.push(PathEntry {
            uuid,
            path: key.to_path_buf(),
        });
        // One entry per ledger pool: the oldest go first if the ledger
        // somehow holds more pools than fit (it cannot: MAX_POOLS bounds it).
        let excess = next.len().saturating_sub(MAX_POOLS);
        next.drain(..excess);
        if next == self.entries {
            return Ok(());
        }
        self.write(&encode(&next))?;
        self.entries = next;
        Ok(())
    }

    /// Writes `image` through a synced temporary file and a rename.
    fn write(&self, image: &[u8]) -> Result<(), PathsError> {
        let dir = self.file.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(POOL_PATHS_TMP_FILE);
        let io_err = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| PathsError::Io { op, path, source }
        };
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        f.write_all(image).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        fs::rename(&tmp, &self.file).map_err(io_err("rename", &tmp))?;
        fsync_dir(dir).map_err(io_err("fsync", dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: u8, path: &str) -> PathEntry {
        PathEntry {
            uuid: PoolUuid([n; 16]),
            path: PathBuf::from(path),
        }
    }

    #[test]
    fn entries_round_trip_and_any_damage_is_refused() {
        let entries = vec![entry(1, "/dev/shm/cxlkv.pool"), entry(2, "/dev/dax0.0")];
        let image = encode(&entries);
        assert_eq!(decode(&image).unwrap(), entries);
        assert_eq!(decode(&encode(&[])).unwrap(), vec![]);
        for at in 0..image.len() {
            let mut bad = image.clone();
            bad[at] ^= 0x10;
            assert!(decode(&bad).is_err(), "a flip at byte {at} went unnoticed");
        }
        for cut in 0..image.len() {
            assert!(decode(&image[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn recording_keeps_one_entry_per_path_and_per_pool_and_only_known_pools() {
        let dir = tempfile::tempdir().unwrap();
        let mut paths = PoolPaths::load(dir.path()).unwrap();
        assert_eq!(paths.uuid_at(Path::new("/a")), None);
        let u = |n| PoolUuid([n; 16]);
        paths.record(Path::new("/a"), u(1), |_| true).unwrap();
        paths.record(Path::new("/b"), u(2), |_| true).unwrap();
        // Pool 1 moved to /c; a new pool 3 is served from /b.
        paths.record(Path::new("/c"), u(1), |_| true).unwrap();
        paths.record(Path::new("/b"), u(3), |_| true).unwrap();
        let again = PoolPaths::load(dir.path()).unwrap();
        assert_eq!(again.uuid_at(Path::new("/a")), None);
        assert_eq!(again.uuid_at(Path::new("/b")), Some(u(3)));
        assert_eq!(again.uuid_at(Path::new("/c")), Some(u(1)));
        // Pools the ledger does not know are dropped at the next write.
        let mut again = again;
        again.record(Path::new("/d"), u(4), |x| x != u(1)).unwrap();
        let last = PoolPaths::load(dir.path()).unwrap();
        assert_eq!(last.uuid_at(Path::new("/c")), None);
        assert_eq!(last.entries.len(), 2);
    }

    #[test]
    fn a_corrupt_file_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(POOL_PATHS_FILE), b"garbage").unwrap();
        let e = PoolPaths::load(dir.path()).unwrap_err();
        assert!(matches!(e, PathsError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("remove it"), "{e}");
    }

    #[test]
    fn a_missing_file_gets_a_key_in_its_canonical_directory() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = fs::canonicalize(dir.path()).unwrap();
        let via_dots = dir.path().join("sub/../pool");
        fs::create_dir(dir.path().join("sub")).unwrap();
        assert_eq!(key_of(&via_dots), canonical.join("pool"));
        fs::write(dir.path().join("pool"), b"").unwrap();
        assert_eq!(key_of(&via_dots), canonical.join("pool"));
    }
}
