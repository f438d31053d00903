//! The ledger each chaos instance keeps: what the directory acknowledged to
//! it, so that the checker knows what must still be there after any kill.
//!
//! One file per instance slot, shared by the successive incarnations of the
//! slot (each appends; a record names its incarnation). One text line per
//! record, tab-separated: `t_ms  incarnation  op  fields…`, where `t_ms` is
//! wall-clock milliseconds since the Unix epoch (the driver and the
//! instances share the host's clock):
//!
//! | op | fields | written |
//! |---|---|---|
//! | `I` | key | before the key's `Register` is sent (intent) |
//! | `A` | key, len, checksum | after the directory answered `Inserted` |
//! | `X` | key | before its `Delete` is sent (intent) |
//! | `D` / `M` | key | after the directory answered `Deleted` / `Missing` |
//! | `T` | key, detail | a read returned bytes that are not the key's payload |
//! | `E` | kind | a call failed (kind: a short classification) |
//! | `V` | count | reads whose bytes were checked intact |
//! | `S` | count | held reads not checked: the key's pin was lost and it is no longer where the view reads |
//!
//! Every append is one `write` of whole lines followed by `fdatasync`, so a
//! record is durable before the instance acts on what it says. A process
//! killed in the middle of an append leaves at most one partial last line:
//! the next incarnation terminates it before appending, and readers skip
//! lines that do not parse (counted), which is sound because a record is
//! only relied upon once its append returned.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One ledger record (see the module table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Intent(String),
    Ack {
        key: String,
        len_bytes: usize,
        checksum: u64,
    },
    DeleteIntent(String),
    Deleted(String),
    Missing(String),
    Torn {
        key: String,
        detail: String,
    },
    Error(String),
    Verified(u64),
    /// Held views that could not be checked (`instance`'s `read_step`).
    HeldSkipped(u64),
}

/// A record with when and by which incarnation it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub t_ms: u64,
    pub incarnation: u32,
    pub record: Record,
}

/// Tabs and newlines would break the line format; free text loses them.
fn clean(text: &str) -> String {
    text.replace(['\t', '\n', '\r'], " ")
}

impl Record {
    fn render(&self, t_ms: u64, incarnation: u32, out: &mut String) {
        use std::fmt::Write as _;
        let _ = write!(out, "{t_ms}\t{incarnation}\t");
        let _ = match self {
            Record::Intent(k) => write!(out, "I\t{k}"),
            Record::Ack {
                key,
                len_bytes,
                checksum,
            } => write!(out, "A\t{key}\t{len_bytes}\t{checksum:016x}"),
            Record::DeleteIntent(k) => write!(out, "X\t{k}"),
            Record::Deleted(k) => write!(out, "D\t{k}"),
            Record::Missing(k) => write!(out, "M\t{k}"),
            Record::Torn { key, detail } => write!(out, "T\t{key}\t{}", clean(detail)),
            Record::Error(kind) => write!(out, "E\t{}", clean(kind)),
            Record::Verified(n) => write!(out, "V\t{n}"),
            Record::HeldSkipped(n) => write!(out, "S\t{n}"),
        };
        out.push('\n');
    }

    fn parse_line(line: &str) -> Option<Entry> {
        let mut f = line.split('\t');
        let t_ms = f.next()?.parse().ok()?;
        let incarnation = f.next()?.parse().ok()?;
        let op = f.next()?;
        let mut text = || f.next().map(str::to_owned);
        let record = match op {
            "I" => Record::Intent(text()?),
            "A" => Record::Ack {
                key: text()?,
                len_bytes: text()?.parse().ok()?,
                checksum: u64::from_str_radix(&text()?, 16).ok()?,
            },
            "X" => Record::DeleteIntent(text()?),
            "D" => Record::Deleted(text()?),
            "M" => Record::Missing(text()?),
            "T" => Record::Torn {
                key: text()?,
                detail: text().unwrap_or_default(),
            },
            "E" => Record::Error(text()?),
            "V" => Record::Verified(text()?.parse().ok()?),
            "S" => Record::HeldSkipped(text()?.parse().ok()?),
            _ => return None,
        };
        Some(Entry {
            t_ms,
            incarnation,
            record,
        })
    }
}

/// The path of slot `slot`'s ledger under the run directory.
pub fn path_of(run_dir: &Path, slot: u32) -> PathBuf {
    run_dir.join(format!("ledger-{slot}"))
}

/// The appending side, owned by one incarnation.
#[derive(Debug)]
pub struct Ledger {
    file: File,
    incarnation: u32,
    line: String,
}

impl Ledger {
    /// Opens (creating) the slot's ledger for appending, terminating a
    /// partial last line a killed predecessor may have left.
    pub fn open(path: &Path, incarnation: u32) -> io::Result<Ledger> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        let len = file.metadata()?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))?;
            file.read_exact(&mut last)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
                file.sync_data()?;
            }
        }
        Ok(Ledger {
            file,
            incarnation,
            line: String::new(),
        })
    }

    /// Appends `records` with one write and makes them durable.
    pub fn append(&mut self, records: &[Record]) -> io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        self.line.clear();
        let t_ms = now_ms();
        for r in records {
            r.render(t_ms, self.incarnation, &mut self.line);
        }
        self.file.write_all(self.line.as_bytes())?;
        self.file.sync_data()
    }
}

/// Most bytes one [`LedgerTail::poll`] reads (the rest waits for the next).
const MAX_POLL_BYTES: usize = 64 << 20;

/// The reading side: follows a ledger as it grows.
#[derive(Debug)]
pub struct LedgerTail {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    /// Complete lines that did not parse (a predecessor's torn append).
    pub malformed_lines: u64,
}

impl LedgerTail {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: Vec::new(),
            malformed_lines: 0,
        }
    }

    /// The entries appended since the last poll (complete lines only). A
    /// ledger that does not exist yet has none.
    pub fn poll(&mut self) -> io::Result<Vec<Entry>> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        let read = file.take(MAX_POLL_BYTES as u64).read_to_end(&mut bytes)?;
        self.offset += read as u64;
        self.partial.extend_from_slice(&bytes);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Ok(Vec::new());
        };
        let complete: Vec<u8> = self.partial.drain(..=end).collect();
        let mut out = Vec::new();
        for line in complete.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match std::str::from_utf8(line).ok().and_then(Record::parse_line) {
                Some(e) => out.push(e),
                None => self.malformed_lines += 1,
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("cxlkv-ledger-{name}-"))
            .tempdir_in("/dev/shm")
            .expect("a temporary directory under /dev/shm");
        let path = dir.path().join("ledger");
        (dir, path)
    }

    #[test]
    fn every_record_round_trips_through_the_file() {
        let (_dir, path) = temp_path("round");
        let records = vec![
            Record::Intent("k0.1.2.3".into()),
            Record::Ack {
                key: "k0.1.2.3".into(),
                len_bytes: 3,
                checksum: 0xdead_beef_0123_4567,
            },
            Record::DeleteIntent("k0.1.2.3".into()),
            Record::Deleted("k0.1.2.3".into()),
            Record::Missing("k0.1.9.3".into()),
            Record::Torn {
                key: "k1.1.1.1".into(),
                detail: "len\t5\nbad".into(),
            },
            Record::Error("reconnect_failed".into()),
            Record::Verified(17),
            Record::HeldSkipped(2),
        ];
        let mut ledger = Ledger::open(&path, 4).unwrap();
        ledger.append(&records).unwrap();
        let mut tail = LedgerTail::new(path);
        let got = tail.poll().unwrap();
        assert_eq!(got.len(), records.len());
        for (e, r) in got.iter().zip(&records) {
            assert_eq!(e.incarnation, 4);
            match (r, &e.record) {
                (Record::Torn { key, .. }, Record::Torn { key: k2, detail }) => {
                    assert_eq!(key, k2);
                    assert_eq!(detail, "len 5 bad");
                }
                _ => assert_eq!(&e.record, r),
            }
        }
        assert!(tail.poll().unwrap().is_empty(), "nothing new");
    }

    #[test]
    fn a_torn_last_line_is_terminated_by_the_next_incarnation_and_skipped() {
        let (_dir, path) = temp_path("torn");
        let mut first = Ledger::open(&path, 1).unwrap();
        first.append(&[Record::Intent("k0.1.1.1".into())]).unwrap();
        drop(first);
        // A kill in the middle of an append: half a line, no newline.
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"123\t1\tA\tk0.1.1")
            .unwrap();
        let mut tail = LedgerTail::new(path.clone());
        assert_eq!(tail.poll().unwrap().len(), 1, "the partial line waits");
        let mut second = Ledger::open(&path, 2).unwrap();
        second
            .append(&[Record::Deleted("k0.1.1.1".into())])
            .unwrap();
        let got = tail.poll().unwrap();
        assert_eq!(tail.malformed_lines, 1);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].incarnation, 2);
        assert_eq!(got[0].record, Record::Deleted("k0.1.1.1".into()));
    }
}
