//! Owner names: the directory and instance names (strings on the wire)
//! behind the pool manager's 64-bit [`DirectoryId`]s and [`InstanceId`]s,
//! kept durably so that a directory listing its regions after a restart gets
//! its instances' names back.
//!
//! **Ids.** [`label_id`] derives an id from a name with BLAKE3 in key
//! derivation mode (context [`LABEL_CONTEXT`], the kind byte, the name). The
//! derivation is fixed forever: tokens are computed over ids, so a name must
//! map to the same id across restarts and versions. Two names with the same
//! id would be one owner to the manager; the chance is 2⁻⁶⁴ per pair, and
//! the service refuses an allocation whose name collides with a known one
//! ([`NamesFile::check`]). A name the service does not know (after a lost
//! names file) is shown in the *escape form* `#` + 16 lowercase hex digits,
//! which maps back to the same id.
//!
//! **File** (`<state>/names`), little-endian, CRC = CRC32C:
//!
//! ```text
//! header (32 B)                      record
//!  0 8 magic "CXLKVNAM"               0 4 body_len (16 + name bytes, ≤ 144)
//!  8 4 format version (1)             4 4 CRC of [0,4) ‖ body
//! 12 16 reserved 0                    8 1 kind (1 directory, 2 instance)
//! 28 4 CRC of [0, 28)                 9 7 reserved 0
//!                                    16 8 id
//!                                    24 … name (UTF-8, 1..=128 bytes)
//! ```
//!
//! Records are appended by [`NamesFile::commit`] (one `pwrite`, one
//! `fdatasync`), which the core calls *before* the journal commit whose
//! records first use the name — so every name a committed region needs is
//! durable. Recovery keeps the records up to the first torn or corrupt one
//! and cuts the rest (an unsynced append only ever holds names no committed
//! record uses yet); a record with a valid CRC that this build cannot read,
//! or that gives a known id another name, refuses the start. At each
//! checkpoint [`NamesFile::compact`] rewrites the file (temporary file,
//! fsync, rename, directory fsync) with only the names still in use.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::pool::io_faults::{IoFaults, IoSite};
use crate::pool::journal::{BoundedReadError, read_bounded};
use crate::pool::sys::fsync_dir;
use crate::pool::{DirectoryId, InstanceId};
use crate::proto::MAX_NAME_BYTES;

/// File name inside the state directory.
pub const NAMES_FILE: &str = "names";
const NAMES_TMP_FILE: &str = "names.tmp";
/// `b"CXLKVNAM"`.
pub const NAMES_MAGIC: [u8; 8] = *b"CXLKVNAM";
pub const NAMES_FORMAT_VERSION: u32 = 1;
const HEADER_BYTES: usize = 32;
const PREFIX_BYTES: usize = 8;
const BODY_FIXED_BYTES: usize = 16;
/// Largest names file recovery reads (compaction keeps it far smaller).
pub const MAX_NAMES_FILE_BYTES: u64 = 256 << 20;
/// The BLAKE3 key-derivation context of [`label_id`]. Never change it.
pub const LABEL_CONTEXT: &str = "cxlkv pool owner label v1";

/// Which kind of name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    Directory = 1,
    Instance = 2,
}

impl NameKind {
    fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Directory),
            2 => Some(Self::Instance),
            _ => None,
        }
    }
}

/// The id of `name`: its escape form parsed, or the BLAKE3 derivation.
pub fn label_id(kind: NameKind, name: &str) -> u64 {
    if let Some(id) = parse_escape(name) {
        return id;
    }
    let mut h = blake3::Hasher::new_derive_key(LABEL_CONTEXT);
    h.update(&[kind as u8]);
    h.update(name.as_bytes());
    let mut id = [0u8; 8];
    id.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(id)
}

pub fn directory_id(name: &str) -> DirectoryId {
    DirectoryId(label_id(NameKind::Directory, name))
}

pub fn instance_id(name: &str) -> InstanceId {
    InstanceId(label_id(NameKind::Instance, name))
}

/// The escape form of an id whose name is unknown.
pub fn escape(id: u64) -> String {
    format!("#{id:016x}")
}

fn parse_escape(name: &str) -> Option<u64> {
    let hex = name.strip_prefix('#')?;
    if hex.len() != 16 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Why the names file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NamesError {
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("names file {} is unusable ({reason}); refusing to start", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "names file {} is a {file_type}, not a regular file (a device or FIFO there would be read forever, or block the start); refusing to start",
        path.display()
    )]
    NotRegularFile {
        path: PathBuf,
        file_type: &'static str,
    },
    #[error("names file {} failed an earlier write; the pool manager must restart", path.display())]
    Poisoned { path: PathBuf },
    #[error(
        "cannot {op} {}: the file system holding it is full ({source}); the pool manager writes this before it serves anything (a new name, or the names kept made durable at start), so it stops or refuses to start. Free space on that file system (the pools and their regions are untouched) and start it again",
        path.display()
    )]
    NoSpace {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// A name whose id is already taken by another name (see the module essay).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} name {name:?} maps to id {id:#018x}, which already names {existing:?}")]
pub struct NameCollision {
    pub kind: NameKind,
    pub name: String,
    pub id: u64,
    pub existing: String,
}

/// The open names file and the names it holds.
#[derive(Debug)]
pub struct NamesFile {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    end_bytes: u64,
    pending: Vec<u8>,
    names: HashMap<(NameKind, u64), Arc<str>>,
    poisoned: bool,
    faults: IoFaults,
}

io_errors!(NamesError);

fn header() -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&NAMES_MAGIC);
    h[8..12].copy_from_slice(&NAMES_FORMAT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..28]);
    h[28..].copy_from_slice(&crc.to_le_bytes());
    h
}

fn encode_record(kind: NameKind, id: u64, name: &str, out: &mut Vec<u8>) {
    let body_len = (BODY_FIXED_BYTES + name.len()) as u32;
    let start = out.len();
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(kind as u8);
    out.extend_from_slice(&[0u8; 7]);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    let mut crc = crc32c::crc32c(&out[start..start + 4]);
    crc = crc32c::crc32c_append(crc, &out[start + PREFIX_BYTES..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// A record as recovery sees it.
enum Scanned<'a> {
    Record {
        kind: NameKind,
        id: u64,
        name: &'a str,
        len_bytes: usize,
    },
    /// Incomplete, impossible length, or CRC mismatch: cut here.
    Torn(&'static str),
    /// CRC-valid but not readable by this build: refuse.
    Foreign(String),
}

fn scan_record(buf: &[u8]) -> Scanned<'_> {
    if buf.len() < PREFIX_BYTES {
        return Scanned::Torn("incomplete record prefix");
    }
    let body_len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if !(BODY_FIXED_BYTES + 1..=BODY_FIXED_BYTES + MAX_NAME_BYTES).contains(&body_len) {
        return Scanned::Torn("impossible record length");
    }
    let Some(body) = buf.get(PREFIX_BYTES..PREFIX_BYTES + body_len) else {
        return Scanned::Torn("incomplete record");
    };
    let stored = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    let crc = crc32c::crc32c_append(crc32c::crc32c(&buf[..4]), body);
    if crc != stored {
        return Scanned::Torn("checksum mismatch");
    }
    let Some(kind) = NameKind::from_u8(body[0]) else {
        return Scanned::Foreign(format!("unknown name kind {}", body[0]));
    };
    if body[1..8].iter().any(|&b| b != 0) {
        return Scanned::Foreign("reserved bytes are not zero".into());
    }
    let id = u64::from_le_bytes(body[8..16].try_into().expect("8 bytes"));
    let Ok(name) = std::str::from_utf8(&body[BODY_FIXED_BYTES..]) else {
        return Scanned::Foreign("name is not UTF-8".into());
    };
    Scanned::Record {
        kind,
        id,
        name,
        len_bytes: PREFIX_BYTES + body_len,
    }
}

impl NamesFile {
    /// Opens (creating if missing) and recovers `<dir>/names`. The caller
    /// holds the state directory's lock.
    pub fn open(dir: &Path) -> Result<Self, NamesError> {
        let path = dir.join(NAMES_FILE);
        let tmp = dir.join(NAMES_TMP_FILE);
        match fs::remove_file(&tmp) {
            Ok(()) => fsync_dir(dir).map_err(io_err("fsync", dir))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &tmp)(e)),
        }
        if !path.try_exists().map_err(io_err("stat", &path))? {
            write_atomically(dir, &path, &header())?;
        }
        // Opened without blocking, a regular file only, the read bounded
        // whatever the size said (`journal::read_bounded`).
        let image = read_bounded(&path, MAX_NAMES_FILE_BYTES).map_err(|e| match e {
            BoundedReadError::Io { op, source } => io_err(op, &path)(source),
            BoundedReadError::NotRegularFile { file_type } => NamesError::NotRegularFile {
                path: path.clone(),
                file_type,
            },
            BoundedReadError::TooLarge {
                len_bytes,
                max_bytes,
            } => NamesError::Corrupt {
                path: path.clone(),
                reason: format!(
                    "{len_bytes} bytes or more, more than the {max_bytes} recovery reads (nothing past offset {max_bytes} is read)"
                ),
            },
        })?;
        let len = image.len() as u64;
        let corrupt = |reason: String| NamesError::Corrupt {
            path: path.clone(),
            reason,
        };
        if image.len() < HEADER_BYTES || image[..HEADER_BYTES] != header() {
            return Err(corrupt("bad header (magic, version or checksum)".into()));
        }
        let mut names: HashMap<(NameKind, u64), Arc<str>> = HashMap::new();
        let mut at = HEADER_BYTES;
        while at < image.len() {
            match scan_record(&image[at..]) {
                Scanned::Record {
                    kind,
                    id,
                    name,
                    len_bytes,
                } => {
                    match names.get(&(kind, id)) {
                        Some(existing) if **existing != *name => {
                            return Err(corrupt(format!(
                                "id {id:#018x} is named both {existing:?} and {name:?}"
                            )));
                        }
                        Some(_) => {}
                        None => {
                            names.insert((kind, id), Arc::from(name));
                        }
                    }
                    at += len_bytes;
                }
                Scanned::Torn(why) => {
                    tracing::warn!(
                        path = %path.display(),
                        offset_bytes = at,
                        dropped_bytes = image.len() - at,
                        reason = why,
                        "names file ends with a torn record; cutting it"
                    );
                    break;
                }
                Scanned::Foreign(reason) => {
                    return Err(corrupt(format!("record at offset {at}: {reason}")));
                }
            }
        }
        let file = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err("open", &path))?;
        // The records kept may exist only in the page cache (a names sync
        // that failed with its pages then marked clean, and a restart in the
        // same boot): written again and synced before any is relied on —
        // `note` appends nothing for a name already known, so a name read
        // here would otherwise never reach the disk, while the journal
        // commits regions that use it. (The journal's recovery does the
        // same, `Journal::recover`.)
        let rewrite = at > HEADER_BYTES;
        if rewrite {
            open_step(OpenStep::Rewrite);
            file.write_all_at(&image[HEADER_BYTES..at], HEADER_BYTES as u64)
                .map_err(io_err("rewrite", &path))?;
        }
        if at as u64 != len {
            open_step(OpenStep::Truncate);
            file.set_len(at as u64).map_err(io_err("truncate", &path))?;
        }
        if rewrite || at as u64 != len {
            open_step(OpenStep::Sync);
            file.sync_all().map_err(io_err("fsync", &path))?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            path,
            file,
            end_bytes: at as u64,
            pending: Vec::new(),
            names,
            poisoned: false,
            faults: IoFaults::default(),
        })
    }

    /// The name of `id`, if known.
    pub fn name(&self, kind: NameKind, id: u64) -> Option<&Arc<str>> {
        self.names.get(&(kind, id))
    }

    /// The name to show for `id`: the known name, else the escape form.
    pub fn display(&self, kind: NameKind, id: u64) -> String {
        self.name(kind, id)
            .map_or_else(|| escape(id), |n| n.to_string())
    }

    /// Refuses `name` if its id already names another name.
    pub fn check(&self, kind: NameKind, name: &str) -> Result<u64, NameCollision> {
        let id = label_id(kind, name);
        match self.names.get(&(kind, id)) {
            Some(existing) if **existing != *name && parse_escape(name).is_none() => {
                Err(NameCollision {
                    kind,
                    name: name.to_owned(),
                    id,
                    existing: existing.to_string(),
                })
            }
            _ => Ok(id),
        }
    }

    /// Remembers `name` (already [`check`](Self::check)ed); a new one is
    /// appended at the next [`commit`](Self::commit). Escape forms are not
    /// names and are not kept.
    pub fn note(&mut self, kind: NameKind, name: &str) {
        if parse_escape(name).is_some() {
            return;
        }
        let id = label_id(kind, name);
        if self.names.contains_key(&(kind, id)) {
            return;
        }
        encode_record(kind, id, name, &mut self.pending);
        self.names.insert((kind, id), Arc::from(name));
    }

    /// Storage failures to inject into appends (feature `fault-injection`).
    pub(crate) fn set_io_faults(&mut self, faults: IoFaults) {
        self.faults = faults;
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Makes every noted name durable (one `pwrite`, one `fdatasync`). A
    /// failure poisons the file (fail-stop, as for the journal).
    pub fn commit(&mut self) -> Result<(), NamesError> {
        if self.poisoned {
            return Err(NamesError::Poisoned {
                path: self.path.clone(),
            });
        }
        if self.pending.is_empty() {
            return Ok(());
        }
        let written = self.faults.op(IoSite::NamesAppend, || {
            self.file
                .write_all_at(&self.pending, self.end_bytes)
                .and_then(|()| self.file.sync_data())
        });
        if let Err(source) = written {
            self.poisoned = true;
            return Err(NamesError::io("append to", &self.path, source));
        }
        self.end_bytes += self.pending.len() as u64;
        self.pending.clear();
        Ok(())
    }

    /// Rewrites the file with only the names `keep` says are in use. Every
    /// noted name must be committed first.
    pub fn compact(&mut self, keep: impl Fn(NameKind, u64) -> bool) -> Result<(), NamesError> {
        if self.poisoned {
            return Err(NamesError::Poisoned {
                path: self.path.clone(),
            });
        }
        debug_assert!(self.pending.is_empty(), "commit before compacting");
        self.names.retain(|&(kind, id), _| keep(kind, id));
        let mut image = header().to_vec();
        for (&(kind, id), name) in &self.names {
            encode_record(kind, id, name, &mut image);
        }
        let rewritten = write_atomically(&self.dir, &self.path, &image).and_then(|()| {
            OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&self.path)
                .map_err(io_err("open", &self.path))
        });
        match rewritten {
            Ok(file) => {
                self.file = file;
                self.end_bytes = image.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    /// Names kept (for tests and statistics).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// Writes `image` to `path` through a synced temporary file and a rename.
fn write_atomically(dir: &Path, path: &Path, image: &[u8]) -> Result<(), NamesError> {
    let tmp = dir.join(NAMES_TMP_FILE);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    f.write_all(image).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    fs::rename(&tmp, path).map_err(io_err("rename", &tmp))?;
    fsync_dir(dir).map_err(io_err("fsync", dir))
}

/// What `NamesFile::open` did to the file, in order, on this thread
/// (tests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenStep {
    Rewrite,
    Truncate,
    Sync,
}

#[cfg(test)]
thread_local! {
    static OPEN_STEPS: std::cell::RefCell<Vec<OpenStep>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn open_step(_step: OpenStep) {
    #[cfg(test)]
    OPEN_STEPS.with(|s| s.borrow_mut().push(_step));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_steps(dir: &Path) -> Vec<OpenStep> {
        OPEN_STEPS.with(|s| s.borrow_mut().clear());
        NamesFile::open(dir).unwrap();
        OPEN_STEPS.with(|s| s.borrow().clone())
    }

    /// Found by a review: a name read at open might exist only in the page
    /// cache (its sync failed, the pages were marked clean, the manager
    /// restarted in the same boot); `note` never appends a known name
    /// again, so the journal could commit a region whose instance name was
    /// never durable. Open now writes the kept records again and syncs
    /// them — and does nothing to a file of no records.
    #[test]
    fn open_writes_the_kept_names_again_and_syncs_them_before_relying_on_them() {
        let dir = shm_dir();
        assert_eq!(open_steps(dir.path()), [], "a new file: nothing to keep");
        let mut f = NamesFile::open(dir.path()).unwrap();
        f.note(NameKind::Instance, "inst-1");
        f.commit().unwrap();
        drop(f);
        assert_eq!(open_steps(dir.path()), [OpenStep::Rewrite, OpenStep::Sync]);
        // A torn tail is cut too, before the one sync.
        let path = dir.path().join(NAMES_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0xAB; 5]);
        fs::write(&path, &bytes).unwrap();
        assert_eq!(
            open_steps(dir.path()),
            [OpenStep::Rewrite, OpenStep::Truncate, OpenStep::Sync]
        );
        let f = NamesFile::open(dir.path()).unwrap();
        let id = label_id(NameKind::Instance, "inst-1");
        assert_eq!(f.display(NameKind::Instance, id), "inst-1");
    }

    fn shm_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("cxlkv-names-")
            .tempdir_in("/dev/shm")
            .unwrap()
    }

    #[test]
    fn ids_are_stable_distinct_per_kind_and_escapes_map_back() {
        let d = label_id(NameKind::Directory, "dir-a");
        assert_eq!(d, label_id(NameKind::Directory, "dir-a"));
        assert_ne!(d, label_id(NameKind::Instance, "dir-a"));
        assert_ne!(d, label_id(NameKind::Directory, "dir-b"));
        assert_eq!(label_id(NameKind::Instance, &escape(d)), d);
        assert_eq!(parse_escape("#00000000000000ZZ"), None);
        assert_eq!(parse_escape("#0000000000000001"), Some(1));
        assert_eq!(parse_escape("#00000000000000001"), None);
    }

    #[test]
    fn noted_names_survive_a_reopen_only_once_committed() {
        let dir = shm_dir();
        let mut f = NamesFile::open(dir.path()).unwrap();
        f.note(NameKind::Directory, "dir-a");
        f.note(NameKind::Instance, "inst-1");
        f.commit().unwrap();
        f.note(NameKind::Instance, "inst-2");
        drop(f);
        let f = NamesFile::open(dir.path()).unwrap();
        let a = label_id(NameKind::Directory, "dir-a");
        assert_eq!(f.display(NameKind::Directory, a), "dir-a");
        assert_eq!(
            f.display(NameKind::Instance, label_id(NameKind::Instance, "inst-1")),
            "inst-1"
        );
        let two = label_id(NameKind::Instance, "inst-2");
        assert_eq!(f.display(NameKind::Instance, two), escape(two));
    }

    #[test]
    fn a_torn_tail_is_cut_at_every_byte_and_earlier_names_are_kept() {
        let dir = shm_dir();
        let mut f = NamesFile::open(dir.path()).unwrap();
        f.note(NameKind::Directory, "kept");
        f.commit().unwrap();
        let kept_len = f.end_bytes;
        f.note(NameKind::Directory, "torn-away");
        f.commit().unwrap();
        let full = fs::read(dir.path().join(NAMES_FILE)).unwrap();
        drop(f);
        for cut in kept_len as usize..full.len() {
            fs::write(dir.path().join(NAMES_FILE), &full[..cut]).unwrap();
            let f = NamesFile::open(dir.path()).unwrap();
            assert_eq!(f.len(), 1, "cut at {cut}");
            assert_eq!(f.end_bytes, kept_len);
            assert_eq!(
                fs::metadata(dir.path().join(NAMES_FILE)).unwrap().len(),
                kept_len
            );
        }
    }

    #[test]
    fn a_bit_flip_in_the_last_record_cuts_it_and_a_conflict_refuses_the_start() {
        let dir = shm_dir();
        let mut f = NamesFile::open(dir.path()).unwrap();
        f.note(NameKind::Directory, "one");
        f.commit().unwrap();
        drop(f);
        let path = dir.path().join(NAMES_FILE);
        let good = fs::read(&path).unwrap();
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        fs::write(&path, &flipped).unwrap();
        assert!(NamesFile::open(dir.path()).unwrap().is_empty());
        // Two CRC-valid records giving one id two names: not ours to guess.
        let mut conflict = good.clone();
        let id = label_id(NameKind::Directory, "one");
        let mut rec = Vec::new();
        encode_record(NameKind::Directory, id, "two", &mut rec);
        conflict.extend_from_slice(&rec);
        fs::write(&path, &conflict).unwrap();
        let e = NamesFile::open(dir.path()).unwrap_err();
        assert!(e.to_string().contains("refusing to start"), "{e}");
    }

    #[test]
    fn collisions_are_refused_and_compaction_keeps_only_names_in_use() {
        let dir = shm_dir();
        let mut f = NamesFile::open(dir.path()).unwrap();
        f.note(NameKind::Instance, "a");
        f.note(NameKind::Instance, "b");
        f.commit().unwrap();
        let a = label_id(NameKind::Instance, "a");
        // Forge a collision by planting another name under a's id.
        f.names.insert((NameKind::Instance, a), Arc::from("not-a"));
        assert!(f.check(NameKind::Instance, "a").is_err());
        assert!(f.check(NameKind::Instance, &escape(a)).is_ok());
        f.names.insert((NameKind::Instance, a), Arc::from("a"));
        f.compact(|_, id| id == a).unwrap();
        drop(f);
        let f = NamesFile::open(dir.path()).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f.display(NameKind::Instance, a), "a");
    }

    /// Reliability entry 105: the names file was read to its end by path
    /// after a `stat`: a FIFO there blocked the start for ever (a device
    /// read forever). It is refused now, without blocking.
    #[test]
    fn a_names_file_that_is_not_a_regular_file_is_refused_without_blocking() {
        let dir = shm_dir();
        let path = dir.path().join(NAMES_FILE);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(NamesFile::open(&d).map(drop));
        });
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("open answered within 5 s")
            .unwrap_err();
        assert!(
            matches!(
                &e,
                NamesError::NotRegularFile {
                    file_type: "FIFO",
                    ..
                }
            ),
            "{e}"
        );
    }
}
