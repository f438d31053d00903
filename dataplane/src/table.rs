//! The region table: a client's regions by [`RegionId`], read lock-free on
//! every operation, changed rarely.
//!
//! # What it is
//!
//! A [`RegionTable<V>`] maps region ids to values `V` — for the client, its
//! owned regions (mapping + [`PageAllocator`](crate::alloc::PageAllocator))
//! and its cache of mapped peer regions. Every allocation and every lookup
//! reads it; regions are added or removed a handful of times per minute.
//!
//! # How it is read
//!
//! The table is one pointer to an immutable, sorted *version*. A reader pins
//! the thread's epoch (crossbeam-epoch), loads the pointer and searches the
//! version; [`RegionTable::read`] returns that pinned view as a [`Snapshot`]
//! (several lookups under one pin), [`RegionTable::with`] and
//! [`RegionTable::find_map_from`] wrap one read around a closure. A read
//! writes no shared cache line: no reference count is touched (values are
//! lent as `&V` for the snapshot's lifetime, never cloned out), and pinning
//! writes only the thread's own epoch record (one locked instruction on
//! x86-64; every 128th pin also tries to advance the global epoch and may run
//! deferred functions — from this table only "unreachable" flag stores, never
//! a value's `Drop`). A batch should look up all its regions under one
//! snapshot. [`Snapshot::find_map_from`] is
//! the allocation path's loop: try the regions in order from a rotating start
//! until one yields a page.
//!
//! # How it is changed
//!
//! Writers ([`insert`](RegionTable::insert), [`remove`](RegionTable::remove))
//! serialise on a mutex that readers never touch, copy the current version
//! with the change, publish the copy with one pointer swap, and *retire* the
//! old version: they defer (through the epoch) a flag that says "no reader can
//! reach it any more", and free it on a later write once the flag is set. A
//! reader therefore never waits for a writer, and a writer never waits for a
//! reader.
//!
//! # When a removed value is dropped
//!
//! Never while a reader might still see it, and never on a reader's thread:
//! values sit behind `Arc`s shared by the versions that contain them (the
//! count changes only under the writer lock), and a removed value is handed
//! back by [`RegionTable::take_unreachable`] once every version that contained
//! it has been freed. The caller then drops it — a mapping's `Drop` unmaps and
//! runs before-unmap callbacks, which belong on the caller's maintenance
//! thread, not inside some reader's pin — or re-inserts it (for example when
//! a region chosen for return turned out to have a page allocated in the
//! meantime). Values never taken are dropped with the table.
//!
//! # Invariants
//!
//! - `current` always points to a live version; versions are sorted by id with
//!   no duplicates and hold at most [`MAX_TABLE_REGIONS`] entries.
//! - A version is freed only after it was unlinked and its deferred flag ran,
//!   i.e. after every guard pinned before the unlink was dropped — or when the
//!   table itself is dropped (no reader can exist then: snapshots borrow it).
//!
//! The publish/retire protocol is model-checked with loom; the crate-private
//! `sync` module says what the model's reclamation stand-in proves and what
//! it does not.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Arc, PoisonError};

use crate::ids::RegionId;
use crate::sync::{AtomicBool, AtomicPtr, Mutex, MutexGuard, epoch};

/// Most regions one table holds (each change copies the version, so this also
/// bounds the cost of a write).
pub const MAX_TABLE_REGIONS: usize = 1 << 16;

/// Why a table change was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    #[error("region {id} is already in the table")]
    AlreadyPresent { id: RegionId },
    #[error("region {id} is not in the table")]
    NotFound { id: RegionId },
    #[error("the table is full ({max} regions); cannot add region {id}")]
    Full { id: RegionId, max: usize },
}

/// A refused insert: the reason and the value, handed back unharmed.
pub struct Rejected<V> {
    pub error: TableError,
    pub value: V,
}

impl<V> fmt::Debug for Rejected<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<V> fmt::Display for Rejected<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<V> std::error::Error for Rejected<V> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// An immutable set of regions, sorted by id.
struct Version<V> {
    entries: Vec<(RegionId, Arc<V>)>,
    /// Under loom, a tracked cell that readers read and freeing writes, so the
    /// model checks that a version outlives every reader that found it (loom
    /// cannot see a use-after-free of plain memory).
    #[cfg(loom)]
    liveness: loom::cell::UnsafeCell<()>,
}

impl<V> Version<V> {
    fn new(entries: Vec<(RegionId, Arc<V>)>) -> Self {
        Self {
            entries,
            #[cfg(loom)]
            liveness: loom::cell::UnsafeCell::new(()),
        }
    }

    fn find(&self, id: RegionId) -> Result<usize, usize> {
        self.entries
            .binary_search_by_key(&id, |(entry_id, _)| *entry_id)
    }

    /// Frees a version made by `Box::into_raw`.
    ///
    /// # Safety
    /// `version` came from `Box::into_raw(Box<Version<V>>)`, is freed only
    /// once, and no reader can reach it any more.
    unsafe fn free(version: *mut Self) {
        // SAFETY: the caller's contract.
        let version = unsafe { Box::from_raw(version) };
        #[cfg(loom)]
        version.liveness.with_mut(|_| ());
        drop(version);
    }
}

/// An unlinked version waiting for its readers to leave.
struct RetiredVersion<V> {
    version: *mut Version<V>,
    /// Set by a function deferred through the epoch when the version was
    /// unlinked: once true, no reader can reach it.
    unreachable: Arc<AtomicBool>,
}

// SAFETY: a `RetiredVersion` owns its version (unlinked, freed only through
// `free`), so sending it is sending a `Box<Version<V>>`, which is `Send` when
// `Arc<V>` is, i.e. when `V: Send + Sync`.
unsafe impl<V: Send + Sync> Send for RetiredVersion<V> {}

impl<V> RetiredVersion<V> {
    /// # Safety
    /// No reader can reach the version any more: `unreachable` is set, or the
    /// table is being dropped. Called at most once (it consumes `self`).
    unsafe fn free(self) {
        // SAFETY: `version` came from `Box::into_raw` in `publish` and is
        // freed only here, once; the caller guarantees no reader holds it.
        unsafe { Version::free(self.version) };
    }
}

/// Writer-side state, behind the writer mutex.
struct Writer<V> {
    retired: Vec<RetiredVersion<V>>,
    /// Removed values not yet handed back; a value can be handed back once
    /// this is its only `Arc` (every version containing it has been freed).
    removed: Vec<(RegionId, Arc<V>)>,
}

/// Regions by id: lock-free reads, epoch-published copy-on-write changes.
pub struct RegionTable<V> {
    /// Never null: the live version, from `Box::into_raw`.
    current: AtomicPtr<Version<V>>,
    writer: Mutex<Writer<V>>,
    /// For drop check: the table owns its versions and, through them, `V`s
    /// (the raw pointers above do not say so).
    _owns: PhantomData<Box<Version<V>>>,
}

// SAFETY: shared access hands `&V` to many threads (needs `V: Sync`) and a
// removed `V` may be handed back on another thread than the one that
// inserted it (needs `V: Send`); the raw pointers in `current` and in retired
// versions are owned boxes whose lifetime the epoch protocol manages.
unsafe impl<V: Send + Sync> Sync for RegionTable<V> {}
// SAFETY: as for `Sync`: the table owns boxes of `Arc<V>`.
unsafe impl<V: Send + Sync> Send for RegionTable<V> {}

impl<V> fmt::Debug for RegionTable<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionTable")
            .field("len", &self.read().len())
            .finish_non_exhaustive()
    }
}

impl<V> Default for RegionTable<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> RegionTable<V> {
    /// An empty table.
    pub fn new() -> Self {
        let empty = Box::new(Version::new(Vec::new()));
        Self {
            current: AtomicPtr::new(Box::into_raw(empty)),
            writer: Mutex::new(Writer {
                retired: Vec::new(),
                removed: Vec::new(),
            }),
            _owns: PhantomData,
        }
    }

    /// Pins the thread and returns a consistent view of the table. Lookups
    /// through it are lock-free; hold it briefly (a held snapshot delays the
    /// freeing of retired versions, though it never blocks anyone).
    pub fn read(&self) -> Snapshot<'_, V> {
        let guard = epoch::pin();
        // Acquire: pairs with the Release swap in `publish`, so the version's
        // entries, and the values they point to, are visible.
        let version = self.current.load(Acquire);
        Snapshot {
            version,
            _guard: guard,
            _table: PhantomData,
        }
    }

    /// Runs `f` on region `id`'s value, if present.
    pub fn with<R>(&self, id: RegionId, f: impl FnOnce(&V) -> R) -> Option<R> {
        self.read().get(id).map(f)
    }

    /// See [`Snapshot::find_map_from`].
    pub fn find_map_from<R>(
        &self,
        start: usize,
        f: impl FnMut(RegionId, &V) -> Option<R>,
    ) -> Option<R> {
        self.read().find_map_from(start, f)
    }

    /// Regions in the table.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// True if the table holds no region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds region `id`. Concurrent readers see the table without or with it,
    /// never a partial state; they never wait.
    pub fn insert(&self, id: RegionId, value: V) -> Result<(), Rejected<V>> {
        let mut writer = self.lock_writer();
        let current = self.current_locked(&writer);
        let at = match current.find(id) {
            Ok(_) => {
                let error = TableError::AlreadyPresent { id };
                return Err(Rejected { error, value });
            }
            Err(_) if current.entries.len() >= MAX_TABLE_REGIONS => {
                let error = TableError::Full {
                    id,
                    max: MAX_TABLE_REGIONS,
                };
                return Err(Rejected { error, value });
            }
            Err(at) => at,
        };
        let mut entries = Vec::with_capacity(current.entries.len() + 1);
        entries.extend_from_slice(&current.entries[..at]);
        entries.push((id, Arc::new(value)));
        entries.extend_from_slice(&current.entries[at..]);
        self.publish(&mut writer, entries);
        Ok(())
    }

    /// Removes region `id` from the table. Readers that already found it keep
    /// using it safely; the value comes back through
    /// [`take_unreachable`](Self::take_unreachable) once none can.
    pub fn remove(&self, id: RegionId) -> Result<(), TableError> {
        let mut writer = self.lock_writer();
        let current = self.current_locked(&writer);
        let at = current.find(id).map_err(|_| TableError::NotFound { id })?;
        let mut entries = current.entries.clone();
        let (_, value) = entries.remove(at);
        writer.removed.push((id, value));
        self.publish(&mut writer, entries);
        Ok(())
    }

    /// Hands back the removed values that no reader can reach any more, for
    /// the caller to drop (or re-insert) on its own thread. Never blocks on
    /// readers: what is not yet unreachable stays for a later call.
    pub fn take_unreachable(&self) -> Vec<(RegionId, V)> {
        let mut writer = self.lock_writer();
        // Hurry the epoch along (moves this thread's deferred functions to
        // the global queue and tries to collect); a hint, not a wait.
        epoch::pin().flush();
        Self::free_unreachable_versions(&mut writer);
        let mut unreachable = Vec::new();
        for (id, value) in std::mem::take(&mut writer.removed) {
            match Arc::try_unwrap(value) {
                Ok(value) => unreachable.push((id, value)),
                Err(still_shared) => writer.removed.push((id, still_shared)),
            }
        }
        unreachable
    }

    /// Applies `f` to the removed value of region `id` not yet handed back
    /// by [`take_unreachable`](Self::take_unreachable), if there is one.
    /// Readers that found the region before its removal may still use it
    /// (allocate from it, say); this lets a caller reach it too meanwhile
    /// (to free a page it is told of). Takes the writer lock: for rare paths.
    pub fn with_removed<R>(&self, id: RegionId, f: impl FnOnce(&V) -> R) -> Option<R> {
        let writer = self.lock_writer();
        writer
            .removed
            .iter()
            .find(|(rid, _)| *rid == id)
            .map(|(_, v)| f(v))
    }

    /// Removed values not yet handed back by `take_unreachable`.
    pub fn removed_pending(&self) -> usize {
        self.lock_writer().removed.len()
    }

    fn lock_writer(&self) -> MutexGuard<'_, Writer<V>> {
        // A panic under the lock cannot leave `Writer` inconsistent: every
        // change to it is a single push or a take-and-rebuild that completes
        // before anything that can panic.
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current version, for a writer. The borrow of `writer` ends before
    /// `publish` can retire it (which needs `&mut Writer`).
    fn current_locked<'w>(&'w self, _writer: &'w Writer<V>) -> &'w Version<V> {
        // Acquire: pairs with the Release swap of the previous writer (the
        // writer lock orders it too; this keeps the argument local).
        let current = self.current.load(Acquire);
        // SAFETY: `current` is never null and points to a live version; only
        // a writer can unlink it, and we are the writer for as long as the
        // returned borrow (tied to the writer lock's contents) lives.
        unsafe { &*current }
    }

    /// Publishes `entries` as the new version and retires the old one.
    fn publish(&self, writer: &mut Writer<V>, entries: Vec<(RegionId, Arc<V>)>) {
        let new = Box::into_raw(Box::new(Version::new(entries)));
        let guard = epoch::pin();
        // Release: the new version's contents are written before any reader
        // can load the pointer. The old pointer needs no Acquire: it was
        // published by an earlier writer, ordered before us by the writer
        // lock, and we only hand it to reclamation.
        let old = self.current.swap(new, Release);
        let unreachable = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&unreachable);
        // The epoch runs this only after every guard pinned now — every
        // reader that could have loaded `old` — has been dropped. Release:
        // those readers' accesses, ordered before this by the epoch, are then
        // ordered before the Acquire load in `free_unreachable_versions`.
        guard.defer(move || flag.store(true, Release));
        guard.flush();
        drop(guard);
        writer.retired.push(RetiredVersion {
            version: old,
            unreachable,
        });
        Self::free_unreachable_versions(writer);
    }

    fn free_unreachable_versions(writer: &mut Writer<V>) {
        // Acquire: pairs with the deferred Release store (see `publish`).
        let done = writer
            .retired
            .extract_if(.., |retired| retired.unreachable.load(Acquire));
        for retired in done {
            // SAFETY: its flag is set: every reader that could reach it has
            // unpinned.
            unsafe { retired.free() };
        }
    }
}

impl<V> Drop for RegionTable<V> {
    fn drop(&mut self) {
        // `&mut self`: no snapshot exists (snapshots borrow the table), so no
        // reader can reach any version, retired or current.
        let writer = self
            .writer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for retired in writer.retired.drain(..) {
            // SAFETY: no reader exists (above).
            unsafe { retired.free() };
        }
        // Relaxed: exclusive access; the pointer was written by this thread or
        // published to it with the table itself.
        let current = self.current.load(Relaxed);
        // SAFETY: `current` came from `Box::into_raw`, is freed only here, and
        // no reader exists (above).
        unsafe { Version::free(current) };
    }
}

/// A pinned, consistent view of a [`RegionTable`]: lookups are lock-free and
/// values are lent for the snapshot's lifetime. Not `Send`: the pin belongs
/// to the thread.
pub struct Snapshot<'t, V> {
    version: *const Version<V>,
    _guard: epoch::Guard,
    _table: PhantomData<&'t RegionTable<V>>,
}

impl<V> fmt::Debug for Snapshot<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl<V> Snapshot<'_, V> {
    fn version(&self) -> &Version<V> {
        // SAFETY: the version was current when loaded after `_guard` was
        // pinned; a version is freed only after every guard pinned before it
        // was unlinked is dropped (and the table outlives `'t`), so it lives
        // at least as long as this snapshot's guard, i.e. this borrow.
        let version = unsafe { &*self.version };
        #[cfg(loom)]
        version.liveness.with(|_| ());
        version
    }

    /// Region `id`'s value, if present.
    pub fn get(&self, id: RegionId) -> Option<&V> {
        let version = self.version();
        version.find(id).ok().map(|at| &*version.entries[at].1)
    }

    /// Regions in this view.
    pub fn len(&self) -> usize {
        self.version().entries.len()
    }

    /// True if this view holds no region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All regions, in increasing id order.
    pub fn iter(&self) -> impl Iterator<Item = (RegionId, &V)> {
        self.version()
            .entries
            .iter()
            .map(|(id, value)| (*id, &**value))
    }

    /// Calls `f` on the regions in id order, starting at position
    /// `start % len` and wrapping around, until it returns `Some`. Callers
    /// rotate `start` (per thread, or after each success) to spread
    /// allocations over regions.
    pub fn find_map_from<R>(
        &self,
        start: usize,
        mut f: impl FnMut(RegionId, &V) -> Option<R>,
    ) -> Option<R> {
        let entries = &self.version().entries;
        if entries.is_empty() {
            return None;
        }
        let (before, after) = entries.split_at(start % entries.len());
        after
            .iter()
            .chain(before)
            .find_map(|(id, value)| f(*id, value))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;

    /// Counts its drops.
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    /// `take_unreachable` until `want` values came back; no reader is pinned,
    /// so only the epoch's advance is awaited (bounded, not timed).
    fn take_eventually<V>(table: &RegionTable<V>, want: usize) -> Vec<(RegionId, V)> {
        let mut taken = Vec::new();
        for _ in 0..100_000 {
            taken.extend(table.take_unreachable());
            if taken.len() >= want {
                return taken;
            }
            std::thread::yield_now();
        }
        panic!(
            "only {} of {want} removed values became unreachable",
            taken.len()
        );
    }

    #[test]
    fn inserted_regions_are_found_by_id_and_iterated_in_id_order() {
        let table = RegionTable::new();
        for id in [5, 1, 3] {
            assert!(table.insert(RegionId(id), id * 10).is_ok());
        }
        let snapshot = table.read();
        assert_eq!(snapshot.get(RegionId(3)), Some(&30));
        assert_eq!(snapshot.get(RegionId(4)), None);
        let ids: Vec<u64> = snapshot.iter().map(|(id, _)| id.0).collect();
        assert_eq!(ids, [1, 3, 5]);
        assert_eq!(table.with(RegionId(5), |v| v + 1), Some(51));
        assert_eq!(table.len(), 3);
    }

    #[test]
    fn a_duplicate_insert_is_refused_and_returns_the_value() {
        let table = RegionTable::new();
        assert!(table.insert(RegionId(1), "first").is_ok());
        let rejected = table.insert(RegionId(1), "second").unwrap_err();
        assert_eq!(
            rejected.error,
            TableError::AlreadyPresent { id: RegionId(1) }
        );
        assert_eq!(rejected.value, "second");
        assert_eq!(table.with(RegionId(1), |v| *v), Some("first"));
        assert_eq!(
            table.remove(RegionId(2)),
            Err(TableError::NotFound { id: RegionId(2) })
        );
    }

    #[test]
    fn find_map_from_starts_at_the_given_position_and_wraps() {
        let table = RegionTable::new();
        for id in 0..4 {
            assert!(table.insert(RegionId(id), id).is_ok());
        }
        let order = |start| {
            let mut seen = Vec::new();
            let found = table.find_map_from(start, |id, _| {
                seen.push(id.0);
                None::<()>
            });
            assert_eq!(found, None);
            seen
        };
        assert_eq!(order(0), [0, 1, 2, 3]);
        assert_eq!(order(6), [2, 3, 0, 1]);
        assert_eq!(
            table.find_map_from(1, |id, v| (*v >= 3).then_some(id)),
            Some(RegionId(3))
        );
        assert_eq!(
            RegionTable::<u8>::new().find_map_from(7, |_, _| Some(())),
            None
        );
    }

    #[test]
    fn a_removed_value_stays_readable_until_the_last_snapshot_that_saw_it_ends() {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = RegionTable::new();
        assert!(
            table
                .insert(RegionId(1), Counted(Arc::clone(&drops)))
                .is_ok()
        );
        let snapshot = table.read();
        table.remove(RegionId(1)).unwrap();
        assert!(
            table.read().get(RegionId(1)).is_none(),
            "new readers miss it"
        );
        // This thread is pinned by `snapshot`: the epoch cannot advance past
        // it, so no number of attempts may hand the value back.
        for _ in 0..1_000 {
            assert!(table.take_unreachable().is_empty());
        }
        assert!(
            snapshot.get(RegionId(1)).is_some(),
            "the old view still has it"
        );
        assert_eq!(drops.load(SeqCst), 0);
        drop(snapshot);
        let taken = take_eventually(&table, 1);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].0, RegionId(1));
        assert_eq!(
            drops.load(SeqCst),
            0,
            "handed back, not dropped by the table"
        );
        drop(taken);
        assert_eq!(drops.load(SeqCst), 1);
        assert_eq!(table.removed_pending(), 0);
    }

    #[test]
    fn a_removed_value_is_reachable_by_id_until_it_is_handed_back() {
        let table = RegionTable::new();
        assert!(table.insert(RegionId(4), String::from("four")).is_ok());
        assert_eq!(
            table.with_removed(RegionId(4), String::len),
            None,
            "in the table"
        );
        let snapshot = table.read();
        table.remove(RegionId(4)).unwrap();
        assert_eq!(table.with(RegionId(4), String::len), None);
        assert_eq!(table.with_removed(RegionId(4), String::len), Some(4));
        assert_eq!(table.with_removed(RegionId(5), String::len), None);
        drop(snapshot);
        assert_eq!(take_eventually(&table, 1).len(), 1);
        assert_eq!(
            table.with_removed(RegionId(4), String::len),
            None,
            "handed back"
        );
    }

    #[test]
    fn a_removed_value_can_be_reinserted_after_it_comes_back() {
        let table = RegionTable::new();
        assert!(table.insert(RegionId(9), String::from("region")).is_ok());
        table.remove(RegionId(9)).unwrap();
        let (id, value) = take_eventually(&table, 1).pop().unwrap();
        assert!(table.insert(id, value).is_ok());
        assert_eq!(table.with(RegionId(9), String::len), Some(6));
    }

    #[test]
    fn dropping_the_table_drops_every_value_exactly_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = RegionTable::new();
        for id in 0..5 {
            assert!(
                table
                    .insert(RegionId(id), Counted(Arc::clone(&drops)))
                    .is_ok()
            );
        }
        table.remove(RegionId(0)).unwrap();
        table.remove(RegionId(1)).unwrap();
        drop(table);
        assert_eq!(drops.load(SeqCst), 5);
    }
}

/// Loom model of the publish/retire protocol, with the epoch stand-in of
/// [`sync::epoch`](crate::sync) (see there for what that does and does not
/// prove). Each value carries a loom-tracked cell that readers read and
/// `Drop` writes: loom reports a causality violation if a value is dropped
/// while a reader that found it can still read it, or if a reader can see a
/// newly inserted value before its construction.
#[cfg(all(test, loom))]
mod loom_models {
    use loom::cell::UnsafeCell;
    use loom::thread;

    use super::*;

    struct Probe {
        id: u64,
        cell: UnsafeCell<u64>,
    }

    // SAFETY: the cell is loom's: every access is checked by the model, which
    // is the point of the probe (a real race fails the model instead of
    // being UB).
    unsafe impl Sync for Probe {}

    impl Probe {
        fn new(id: u64) -> Self {
            Self {
                id,
                cell: UnsafeCell::new(id),
            }
        }

        fn read(&self) -> u64 {
            // SAFETY: loom's tracked cell; loom reports a racing write.
            self.cell.with(|value| unsafe { *value })
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            // SAFETY: as in `read`.
            self.cell.with_mut(|value| unsafe { *value = u64::MAX });
        }
    }

    #[test]
    fn loom_a_reader_racing_replace_and_retire_never_sees_a_dropped_value() {
        loom::model(|| {
            let table = Arc::new(RegionTable::new());
            assert!(table.insert(RegionId(1), Probe::new(1)).is_ok());
            let reader = {
                let table = Arc::clone(&table);
                thread::spawn(move || {
                    let snapshot = table.read();
                    for id in [1, 2] {
                        if let Some(probe) = snapshot.get(RegionId(id)) {
                            assert_eq!((probe.id, probe.read()), (id, id));
                        }
                    }
                })
            };
            let writer = {
                let table = Arc::clone(&table);
                thread::spawn(move || {
                    assert!(table.insert(RegionId(2), Probe::new(2)).is_ok());
                    table.remove(RegionId(1)).unwrap();
                    table.take_unreachable().len()
                })
            };
            reader.join().unwrap();
            let early = writer.join().unwrap();
            // Every guard is gone now, so the stand-in has run every deferred
            // flag: the removed value must come back, exactly once.
            let late = table.take_unreachable().len();
            assert_eq!(early + late, 1);
            assert_eq!(table.removed_pending(), 0);
            assert_eq!(table.with(RegionId(2), Probe::read), Some(2));
        });
    }

    #[test]
    fn loom_two_writers_and_a_reader_agree_on_the_final_table() {
        loom::model(|| {
            let table = Arc::new(RegionTable::new());
            assert!(table.insert(RegionId(1), Probe::new(1)).is_ok());
            let spawn = |f: fn(&RegionTable<Probe>)| {
                let table = Arc::clone(&table);
                thread::spawn(move || f(&table))
            };
            let threads = [
                spawn(|table| assert!(table.insert(RegionId(3), Probe::new(3)).is_ok())),
                spawn(|table| table.remove(RegionId(1)).unwrap()),
                spawn(|table| {
                    let seen = table.find_map_from(0, |id, probe| {
                        assert_eq!(probe.read(), id.0);
                        None::<()>
                    });
                    assert!(seen.is_none());
                }),
            ];
            for thread in threads {
                thread.join().unwrap();
            }
            let ids: Vec<u64> = table.read().iter().map(|(id, _)| id.0).collect();
            assert_eq!(ids, [3]);
            assert_eq!(table.take_unreachable().len(), 1);
        });
    }
}
