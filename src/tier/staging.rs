//! The tier's local state: the write-staging map `W`, the read-staging map
//! `R`, and the key mirror that answers `is_key_evictable` without the
//! tier's lock — with the invariants that tie them together.
//!
//! Every change to `W` or `R` goes through the methods here, which keep the
//! mirror equal to `keys(W) ∪ keys(R)`. [`Staging::check`] verifies, after
//! every operation in debug builds and on demand in tests:
//!
//! - **I1**: a key is in at most one of `W` and `R`;
//! - **I2**: `pinned ≤ holds`; a private temporary holds no pin; a
//!   directory read holds exactly one pin per hold (`pinned == holds ≥ 1`);
//! - **I3**: the holds staged in `R` are exactly those the operations
//!   reported taking (`T` per successful key of a `reserve_read` or a
//!   promote) minus those `finish_read` reported releasing and those that
//!   left with a reclaimed entry (sweeper, `clear(force)`, `close`) — see
//!   [`HoldLedger`];
//! - **I4**: a temporary's page is its own private allocation, still
//!   allocated under the same generation (never registered, never freed
//!   while staged) — and so is every write-staged page;
//! - no page is staged twice (two entries never share a page);
//! - the mirror equals the maps' keys.
//!
//! I5 and I6 (what the listeners were told) and I7 (pages of unknown
//! registration outcome) are checked from the per-call record in
//! `audit.rs`, which the maps feed: every key that leaves them is noted
//! there.

use std::sync::Arc;
use std::time::Duration;

use std::hash::BuildHasher;

use foldhash::{HashMap, HashSet};
use parking_lot::RwLock;

use super::audit::{CallAudit, UnknownOutcome};
use super::types::{InvariantViolation, KeyStage, TierPage};
use crate::client::PageLease;

/// A write reservation: the page the engine fills.
#[derive(Debug)]
pub(crate) struct PendingWrite {
    pub lease: PageLease,
    pub page: TierPage,
    pub is_temporary: bool,
    pub deadline: Duration,
}

/// A read staging: the page served to readers, its local holds and the
/// directory pins behind them.
#[derive(Debug)]
pub(crate) struct PendingRead {
    pub page: TierPage,
    pub holds: u64,
    pub pinned: u64,
    /// The private page of a temporary (never registered); `None` for a
    /// directory read.
    pub private: Option<PageLease>,
    pub deadline: Duration,
}

impl PendingRead {
    pub fn is_temporary(&self) -> bool {
        self.private.is_some()
    }

    /// An idle completed temporary (`TempIdle`): private, nobody holds it.
    pub fn is_idle_temporary(&self) -> bool {
        self.is_temporary() && self.holds == 0
    }
}

/// Which keys are staged in either map, readable without the tier's lock
/// (`is_key_evictable`). It counts keys by a 64-bit hash (seeded per
/// tier), so it allocates nothing: a staged key is always seen; an
/// unstaged key whose hash equals a staged key's is reported not evictable
/// until that key leaves — the conservative answer, and only for a 2⁻⁶⁴
/// coincidence.
#[derive(Debug, Default)]
pub(crate) struct KeyMirror {
    hasher: foldhash::fast::RandomState,
    counts: RwLock<HashMap<u64, u32>>,
}

impl KeyMirror {
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.counts.read().contains_key(&self.hash(key))
    }

    fn add(&self, key: &[u8]) {
        *self.counts.write().entry(self.hash(key)).or_insert(0) += 1;
    }

    fn remove(&self, key: &[u8]) {
        let h = self.hash(key);
        let mut counts = self.counts.write();
        match counts.get_mut(&h) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                counts.remove(&h);
            }
            None => debug_assert!(false, "removing a key the mirror does not hold"),
        }
    }

    fn clear(&self) {
        self.counts.write().clear();
    }

    /// The keys counted, with a multiplicity per hash.
    fn snapshot(&self) -> HashMap<u64, u32> {
        self.counts.read().clone()
    }
}

/// The tier's lifetime tally of read holds (I3). `taken` counts what the
/// operations *reported* — `T` for every key they answered `Success` with
/// a hold — while the entries' `holds` are changed where the holds are
/// staged; the check compares the two, so a hold staged without being
/// reported (or reported without being staged, or released twice) shows.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HoldLedger {
    /// Holds the operations reported taking.
    pub taken: u64,
    /// Holds `finish_read` reported releasing.
    pub released: u64,
    /// Holds that left `R` with their entry (sweeper, `clear(force)`,
    /// `close`): nobody will finish them.
    pub dropped: u64,
}

#[derive(Debug)]
pub(crate) struct Staging {
    writes: HashMap<Box<[u8]>, PendingWrite>,
    reads: HashMap<Box<[u8]>, PendingRead>,
    mirror: Arc<KeyMirror>,
    holds: HoldLedger,
    /// What the current call did and said (debug builds; reset when the
    /// lock is taken, checked when it is released).
    pub audit: CallAudit,
    /// Pages this tier handed to a registration whose outcome came back
    /// unknown (debug builds; I7).
    pub unknown: Vec<UnknownOutcome>,
    /// Set by `close`; every later locked call fails with `Closed`.
    pub closed: bool,
}

impl Staging {
    pub fn new(mirror: Arc<KeyMirror>) -> Self {
        Self {
            writes: HashMap::default(),
            reads: HashMap::default(),
            mirror,
            holds: HoldLedger::default(),
            audit: CallAudit::default(),
            unknown: Vec::new(),
            closed: false,
        }
    }

    /// An operation answered `Success` with `t` holds for `keys` keys.
    pub fn note_holds_taken(&mut self, t: u64, keys: usize) {
        self.holds.taken += t * keys as u64;
    }

    /// `finish_read` released `n` holds.
    pub fn note_holds_released(&mut self, n: u64) {
        self.holds.released += n;
    }

    pub fn has_write(&self, key: &[u8]) -> bool {
        self.writes.contains_key(key)
    }

    pub fn has_read(&self, key: &[u8]) -> bool {
        self.reads.contains_key(key)
    }

    pub fn read(&self, key: &[u8]) -> Option<&PendingRead> {
        self.reads.get(key)
    }

    pub fn read_mut(&mut self, key: &[u8]) -> Option<&mut PendingRead> {
        self.reads.get_mut(key)
    }

    pub fn insert_write(&mut self, key: &[u8], w: PendingWrite) {
        debug_assert!(
            !self.reads.contains_key(key),
            "I1: inserting a read-staged key into W"
        );
        self.mirror.add(key);
        self.writes.insert(Box::from(key), w);
    }

    pub fn insert_read(&mut self, key: &[u8], r: PendingRead) {
        debug_assert!(
            !self.writes.contains_key(key),
            "I1: inserting a write-staged key into R"
        );
        self.mirror.add(key);
        self.reads.insert(Box::from(key), r);
    }

    /// Adds `t` holds backed by `t` pins to the directory read of `key`
    /// (refreshing its deadline), or stages it with `page`; returns the page
    /// served: `page`, the one the lookup just pinned.
    ///
    /// An overlapping reserve normally finds the key where it was staged.
    /// It finds it elsewhere only when the staged pins were lost with a
    /// session whose reattach could not take them again (the client counted
    /// them as orphans): the key was then free to be deleted, and written
    /// again at another page, under the earlier readers. Serving the new
    /// reader the staged page would hand it bytes nobody protects — maybe
    /// another key's. So the entry moves to `page`, which the new pins
    /// protect; the earlier readers keep their holds (they read their own
    /// view, lost already). The counts stay `pinned == holds`: a later
    /// `finish_read` of an earlier reader releases its pins as usual, and
    /// the client spends the orphans first, sending no unpin for them
    /// (`client::staged`), so the new pins stay held until the last
    /// `finish_read` of the key.
    pub fn add_directory_read(
        &mut self,
        key: &[u8],
        page: TierPage,
        t: u64,
        deadline: Duration,
    ) -> TierPage {
        debug_assert!(
            !self.writes.contains_key(key),
            "I1: read-staging a write-staged key"
        );
        match self.reads.entry(Box::from(key)) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let r = e.get_mut();
                debug_assert!(!r.is_temporary(), "temporaries are never pinned");
                if !same_page(&page.location(), &r.page) {
                    tracing::warn!(
                        ?key,
                        staged = ?r.page.location(),
                        now = ?page.location(),
                        "a read-staged key moved after its pins were lost with a session; \
                         serving its new page"
                    );
                    r.page = page;
                }
                r.holds += t;
                r.pinned += t;
                r.deadline = deadline;
                r.page.clone()
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                self.mirror.add(key);
                e.insert(PendingRead {
                    page: page.clone(),
                    holds: t,
                    pinned: t,
                    private: None,
                    deadline,
                });
                page
            }
        }
    }

    pub fn take_write(&mut self, key: &[u8]) -> Option<PendingWrite> {
        let w = self.writes.remove(key)?;
        self.forget(key);
        Some(w)
    }

    /// Takes `key`'s read staging out; holds it still has are dropped (no
    /// `finish_read` will release them).
    pub fn take_read(&mut self, key: &[u8]) -> Option<PendingRead> {
        let r = self.reads.remove(key)?;
        self.holds.dropped += r.holds;
        self.forget(key);
        Some(r)
    }

    /// The key left one map; by I1 it is in neither now.
    fn forget(&mut self, key: &[u8]) {
        debug_assert!(!self.writes.contains_key(key) && !self.reads.contains_key(key));
        self.mirror.remove(key);
        self.audit.unstaged(key);
    }

    /// Keys of the writes whose deadline is at or before `now`.
    pub fn expired_writes(&self, now: Duration) -> Vec<Box<[u8]>> {
        self.writes
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Keys of the reads whose deadline is at or before `now`.
    pub fn expired_reads(&self, now: Duration) -> Vec<Box<[u8]>> {
        self.reads
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Keys of the idle completed temporaries.
    pub fn idle_temporaries(&self) -> Vec<Box<[u8]>> {
        self.reads
            .iter()
            .filter(|(_, r)| r.is_idle_temporary())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Empties both maps: the reads (in map order), then the writes.
    #[allow(clippy::type_complexity)]
    pub fn take_all(
        &mut self,
    ) -> (
        Vec<(Box<[u8]>, PendingRead)>,
        Vec<(Box<[u8]>, PendingWrite)>,
    ) {
        let reads: Vec<_> = self.reads.drain().collect();
        let writes: Vec<_> = self.writes.drain().collect();
        self.mirror.clear();
        for (key, r) in &reads {
            self.holds.dropped += r.holds;
            self.audit.unstaged(key);
        }
        for (key, _) in &writes {
            self.audit.unstaged(key);
        }
        (reads, writes)
    }

    pub fn stage_of(&self, key: &[u8]) -> KeyStage {
        if let Some(w) = self.writes.get(key) {
            return KeyStage::WriteStaged {
                temporary: w.is_temporary,
            };
        }
        match self.reads.get(key) {
            Some(r) => KeyStage::ReadStaged {
                holds: r.holds,
                pinned: r.pinned,
                temporary: r.is_temporary(),
            },
            None => KeyStage::Untracked,
        }
    }

    /// `(|R|, |W|, reads with holds > 0, temporaries in either map)`.
    pub fn counts(&self) -> (u64, u64, u64, u64) {
        let held = self.reads.values().filter(|r| r.holds > 0).count();
        let temporary = self.reads.values().filter(|r| r.is_temporary()).count()
            + self.writes.values().filter(|w| w.is_temporary).count();
        (
            self.reads.len() as u64,
            self.writes.len() as u64,
            held as u64,
            temporary as u64,
        )
    }

    /// Checks the invariants listed in the module docs.
    pub fn check(&self) -> Result<(), InvariantViolation> {
        let broken = |invariant, key: &[u8], detail: String| InvariantViolation {
            invariant,
            key: key.to_vec(),
            detail,
        };
        let mut pages = HashSet::default();
        for (key, w) in &self.writes {
            if self.reads.contains_key(key) {
                return Err(broken("I1", key, "staged in both W and R".into()));
            }
            let own = w.lease.location();
            if !same_page(&own, &w.page) || !w.lease.still_allocated() {
                return Err(broken(
                    "I4",
                    key,
                    format!("write page {own:?} is not this tier's live allocation"),
                ));
            }
            if !pages.insert((own.region, own.page)) {
                return Err(broken(
                    "distinct pages",
                    key,
                    format!("{own:?} staged twice"),
                ));
            }
        }
        for (key, r) in &self.reads {
            if r.pinned > r.holds {
                return Err(broken(
                    "I2",
                    key,
                    format!("pinned {} > holds {}", r.pinned, r.holds),
                ));
            }
            match &r.private {
                Some(lease) => {
                    if r.pinned != 0 {
                        return Err(broken(
                            "I2",
                            key,
                            format!("a private temporary holds {} pins", r.pinned),
                        ));
                    }
                    let own = lease.location();
                    if !same_page(&own, &r.page) || !lease.still_allocated() {
                        return Err(broken(
                            "I4",
                            key,
                            format!("temporary page {own:?} is not this tier's live allocation"),
                        ));
                    }
                    if !pages.insert((own.region, own.page)) {
                        return Err(broken(
                            "distinct pages",
                            key,
                            format!("{own:?} staged twice"),
                        ));
                    }
                }
                None => {
                    if r.holds == 0 || r.pinned != r.holds {
                        return Err(broken(
                            "I2",
                            key,
                            format!(
                                "a directory read with holds {} and pins {}",
                                r.holds, r.pinned
                            ),
                        ));
                    }
                }
            }
        }
        let staged: u64 = self.reads.values().map(|r| r.holds).sum();
        let HoldLedger {
            taken,
            released,
            dropped,
        } = self.holds;
        if released
            .checked_add(dropped)
            .and_then(|gone| taken.checked_sub(gone))
            != Some(staged)
        {
            return Err(broken(
                "I3",
                &[],
                format!(
                    "{staged} holds staged, but the operations reported {taken} taken, \
                     {released} released by finish_read and {dropped} dropped with their entries"
                ),
            ));
        }
        let mut expected: HashMap<u64, u32> = HashMap::default();
        for key in self.writes.keys().chain(self.reads.keys()) {
            *expected.entry(self.mirror.hash(key)).or_insert(0) += 1;
        }
        if expected != self.mirror.snapshot() {
            return Err(broken(
                "mirror",
                &[],
                format!(
                    "the mirror counts {} keys, the maps hold {}",
                    self.mirror.snapshot().values().sum::<u32>(),
                    self.writes.len() + self.reads.len()
                ),
            ));
        }
        Ok(())
    }

    #[cfg(test)]
    pub fn insert_read_unchecked(&mut self, key: &[u8], r: PendingRead) {
        self.mirror.add(key);
        self.reads.insert(Box::from(key), r);
    }

    /// Test hook: `extra` holds on `key`'s read staging that no operation
    /// reported (what an I3 bug looks like).
    #[cfg(all(test, debug_assertions))]
    pub fn add_unreported_holds(&mut self, key: &[u8], extra: u64) {
        if let Some(r) = self.reads.get_mut(key) {
            r.holds += extra;
        }
    }

    /// Whether `key` is read-staged as a private temporary.
    pub fn is_temporary_read(&self, key: &[u8]) -> bool {
        self.reads.get(key).is_some_and(PendingRead::is_temporary)
    }
}

fn same_page(own: &cxlkv_controlplane::proto::Location, page: &TierPage) -> bool {
    let p = page.location();
    own.region == p.region && own.page == p.page && own.generation == p.generation
}
