//! Injected storage failures (cargo feature `fault-injection`): a write,
//! sync, rename or truncation of the state directory that fails with an
//! errno of the test's choosing, optionally after writing part of its bytes
//! (what a disk that fills up mid-write does).
//!
//! Every storage operation the running pool manager makes goes through
//! `IoFaults::write_all_at` or `IoFaults::op` with the [`IoSite`] it is.
//! Without the feature [`IoFaults`] is empty and both compile to the
//! operation itself. With it, a test builds an [`IoFaults`], adds rules, and
//! hands a clone to [`PoolStore::set_io_faults`](super::PoolStore::set_io_faults)
//! or [`ServiceConfig::io_faults`](super::service::ServiceConfig::io_faults);
//! the clones share the rules and the counts.
//!
//! ```
//! # #[cfg(feature = "fault-injection")] {
//! use cxlkv_controlplane::pool::io_faults::{IoFaults, IoSite};
//! let faults = IoFaults::new();
//! // The next journal sync fails with EIO; the one after with ENOSPC after
//! // the first 10 bytes of its records are written.
//! faults.fail(IoSite::JournalSync, 1, libc::EIO);
//! faults.fail_after_bytes(IoSite::JournalRecords, 2, 10, libc::ENOSPC);
//! # }
//! ```
//!
//! Two of recovery's own writes are sites too, reached through
//! [`PoolStore::open_with_io_faults`](super::PoolStore::open_with_io_faults):
//! the rewrite of the journal records kept ([`IoSite::RecoveryRewrite`]) and
//! the copy of a dropped tail ([`IoSite::RecoveryDroppedTail`]). The others
//! (the removal of a stale checkpoint, the header rewrite) are not: a
//! failure there refuses the start, and the next start does the same work
//! again.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Where a storage operation happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IoSite {
    /// The journal's file header, rewritten by a commit (acknowledged seq).
    JournalHeader,
    /// The `fdatasync` that makes a commit's header write durable before
    /// its records are written.
    JournalHeaderSync,
    /// A commit's records, appended to the journal.
    JournalRecords,
    /// The `fdatasync` of a commit's records.
    JournalSync,
    /// Emptying the journal after a checkpoint (truncate and sync).
    JournalRestart,
    /// Writing `checkpoint.tmp`.
    CheckpointWrite,
    /// Syncing `checkpoint.tmp`.
    CheckpointSync,
    /// Renaming `checkpoint.tmp` over `checkpoint`.
    CheckpointRename,
    /// Syncing the state directory after the rename.
    StateDirSync,
    /// Appending to the names file (write and sync).
    NamesAppend,
    /// Recovery writing the journal records it keeps again (before their
    /// sync; a failure refuses the start).
    RecoveryRewrite,
    /// Recovery keeping a copy of a dropped tail in
    /// `journal.dropped.<offset>.<n>` (a full file system skips the copy).
    RecoveryDroppedTail,
}

/// Injected storage failures; see the module essay. Clones share rules.
#[derive(Debug, Clone, Default)]
pub struct IoFaults {
    #[cfg(feature = "fault-injection")]
    plan: Option<std::sync::Arc<parking_lot::Mutex<Plan>>>,
}

#[cfg(feature = "fault-injection")]
#[derive(Debug, Default)]
struct Plan {
    rules: Vec<Rule>,
    calls: std::collections::HashMap<IoSite, u64>,
    fired: u64,
}

#[cfg(feature = "fault-injection")]
#[derive(Debug)]
struct Rule {
    site: IoSite,
    /// Fires on this call of `site` (1 = the next one after the rule was added).
    at_call: u64,
    errno: i32,
    /// Bytes written before failing (writes only; 0 for other operations).
    written: usize,
    done: bool,
}

/// What a rule makes an operation do.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
struct Injected {
    errno: i32,
    written: usize,
}

#[cfg(feature = "fault-injection")]
impl IoFaults {
    pub fn new() -> Self {
        Self {
            plan: Some(Default::default()),
        }
    }

    /// The `nth` call of `site` from now (1 = the next) fails with `errno`,
    /// having done nothing.
    pub fn fail(&self, site: IoSite, nth: u64, errno: i32) -> &Self {
        self.fail_after_bytes(site, nth, 0, errno)
    }

    /// As [`IoFaults::fail`], but a write first writes its first `bytes`
    /// bytes (all of them if it has fewer).
    pub fn fail_after_bytes(&self, site: IoSite, nth: u64, bytes: usize, errno: i32) -> &Self {
        assert!(nth >= 1, "calls are counted from 1");
        let plan = self.plan.as_ref().expect("IoFaults::new builds a plan");
        let mut p = plan.lock();
        let at_call = p.calls.get(&site).copied().unwrap_or(0) + nth;
        p.rules.push(Rule {
            site,
            at_call,
            errno,
            written: bytes,
            done: false,
        });
        self
    }

    /// How many rules have fired.
    pub fn fired(&self) -> u64 {
        self.plan.as_ref().map_or(0, |p| p.lock().fired)
    }

    /// How many operations of `site` were made.
    pub fn calls(&self, site: IoSite) -> u64 {
        self.plan
            .as_ref()
            .map_or(0, |p| p.lock().calls.get(&site).copied().unwrap_or(0))
    }

    fn next(&self, site: IoSite) -> Option<Injected> {
        let mut p = self.plan.as_ref()?.lock();
        let call = {
            let c = p.calls.entry(site).or_insert(0);
            *c += 1;
            *c
        };
        let rule = p
            .rules
            .iter_mut()
            .find(|r| !r.done && r.site == site && r.at_call == call)?;
        rule.done = true;
        let injected = Injected {
            errno: rule.errno,
            written: rule.written,
        };
        p.fired += 1;
        Some(injected)
    }
}

#[cfg(not(feature = "fault-injection"))]
impl IoFaults {
    #[inline(always)]
    fn next(&self, _site: IoSite) -> Option<Injected> {
        None
    }
}

impl IoFaults {
    /// `file.write_all_at(buf, offset)`, unless a rule fails it.
    #[inline]
    pub(crate) fn write_all_at(
        &self,
        site: IoSite,
        file: &File,
        buf: &[u8],
        offset: u64,
    ) -> io::Result<()> {
        match self.next(site) {
            None => file.write_all_at(buf, offset),
            Some(i) => {
                file.write_all_at(&buf[..i.written.min(buf.len())], offset)?;
                Err(io::Error::from_raw_os_error(i.errno))
            }
        }
    }

    /// `f()`, unless a rule fails it first.
    #[inline]
    pub(crate) fn op<T>(&self, site: IoSite, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        match self.next(site) {
            None => f(),
            Some(i) => Err(io::Error::from_raw_os_error(i.errno)),
        }
    }
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use super::*;

    #[test]
    fn a_rule_fires_once_on_the_nth_call_counted_from_when_it_was_added() {
        let f = IoFaults::new();
        let ok = || Ok(());
        f.op(IoSite::JournalSync, ok).unwrap();
        f.fail(IoSite::JournalSync, 2, libc::EIO);
        f.op(IoSite::JournalSync, ok).unwrap();
        f.op(IoSite::JournalRestart, ok).unwrap();
        let e = f.op(IoSite::JournalSync, ok).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        f.op(IoSite::JournalSync, ok).unwrap();
        assert_eq!((f.fired(), f.calls(IoSite::JournalSync)), (1, 4));
    }

    #[test]
    fn a_partial_write_writes_the_prefix_then_fails() {
        let dir = tempfile::tempdir().unwrap();
        let file = File::create(dir.path().join("f")).unwrap();
        let f = IoFaults::new();
        f.fail_after_bytes(IoSite::JournalRecords, 1, 3, libc::ENOSPC);
        let e = f
            .write_all_at(IoSite::JournalRecords, &file, b"abcdef", 0)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"abc");
    }
}
