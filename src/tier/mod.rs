//! The L1 tier: the engine-facing staged protocol on the shared pool
//! (spec: `l1-tier.md`, behavioural reference: `l1-tier-reference.md`).
//!
//! Engines with an L1/L2 tiering controller (LMCache's multi-process mode
//! is the model) do not just put and get: they reserve pages and fill them
//! asynchronously, hold readers across a request, promote L2 data into L1
//! as a private temporary or as a retained shared key, and drive eviction
//! from listener events. [`L1Tier`] provides that contract over one layout
//! of a [`Client`](crate::Client), so such an engine can use cxlkv as its
//! L1 without changing its controllers.
//!
//! # State
//!
//! Membership and cross-process protection live in the directory; the tier
//! keeps only this instance's in-flight state (`staging.rs`): the write
//! map `W` (pages reserved, being filled, not registered) and the read map
//! `R` (pages served to readers, with their local holds and the directory
//! pins behind them, or a private temporary page). Per key (this tier's
//! view): *Untracked*, *WriteStaged*, *DirRead(n holds, n pins)*,
//! *TempHeld(n)*, *TempIdle* — mutually exclusive (I1).
//!
//! # Operations
//!
//! The reference's 17 (the layout binding is the constructor):
//! [`register_listener`](L1Tier::register_listener),
//! [`reserve_read`](L1Tier::reserve_read), [`unsafe_read`](L1Tier::unsafe_read),
//! [`finish_read`](L1Tier::finish_read), [`reserve_write`](L1Tier::reserve_write),
//! [`finish_write`](L1Tier::finish_write),
//! [`finish_write_and_reserve_read`](L1Tier::finish_write_and_reserve_read),
//! [`delete`](L1Tier::delete), [`touch_keys`](L1Tier::touch_keys),
//! [`clear`](L1Tier::clear), [`is_key_evictable`](L1Tier::is_key_evictable),
//! [`get_memory_usage`](L1Tier::get_memory_usage),
//! [`get_l1_memory_desc`](L1Tier::get_l1_memory_desc), [`close`](L1Tier::close),
//! [`report_status`](L1Tier::report_status),
//! [`get_object_state`](L1Tier::get_object_state), [`memcheck`](L1Tier::memcheck).
//! Per-key outcomes are [`TierCode`]s; a call is refused as a whole (and
//! changes nothing) only for bad arguments — a key repeated within the
//! call, `keys`/`is_temporary` of different lengths, an unsupported write
//! mode, a key or batch over the limits — or when called re-entrantly,
//! after `close`, or after the client's close (`ClientClosed`: its session
//! is gone, so no per-key answer would be true). A `reserve_read`,
//! `reserve_write` or `delete` whose round trip fails because the client
//! was closed (or found unresumable) under it is refused the same way; its
//! round trip comes before its local changes, so it has changed nothing
//! locally — though a `delete` whose reply was lost may have deleted keys
//! at the directory: its outcome there is unknown.
//!
//! # Where cxlkv does better than the reference
//!
//! - `reserve_read` is **one** `Lookup` that pins and resolves atomically
//!   (the reference pins, then retrieves, then rolls back); `finish_read`
//!   is one synchronous, counted `Unpin`, done before it returns — unless
//!   it cannot be delivered, or its connection broke: the session is then
//!   ended, and its pins go when the server sees the connection close.
//! - Pins belong to the client's session and are recorded in its ledger:
//!   they die with the session and are taken again on reattach; a pin whose
//!   reply was lost cannot leak (the client ends the session instead).
//! - `delete` is one batched round trip answering `Deleted` / `Pinned` /
//!   `Missing` per key, never conflated.
//! - Registration is exactly-once: a lost reply is answered by retrying the
//!   same sequence number; a registration whose outcome stays unknown keeps
//!   its page (the client resolves it later), so no page is ever freed
//!   while registered (I7) and none is leaked. A key it resolves as
//!   registered is never announced (`write_finished` comes only from the
//!   `finish_write` the directory confirmed it in: I5); it is a stored key
//!   like another instance's, its page freed by its `delete`.
//! - `get_memory_usage` makes no round trip (usage rides on every reply).
//!
//! # Invariants
//!
//! The reference's I1–I7, checked in debug builds whenever the tier's lock
//! is released — after every locked operation, whatever path it returns by
//! — and after `touch_keys`: I1–I4 on the maps (`staging.rs`), I5–I7 on a
//! per-call record of what the call did and said (`audit.rs`).
//!
//! # Concurrency
//!
//! One lock per tier, held for the whole of every locked operation,
//! including its round trips and its listener calls (per-call atomicity, as
//! the reference). Different tiers never share a lock. Not locked:
//! `touch_keys`, `is_key_evictable` (a mirror of the staged keys),
//! `get_memory_usage`, `get_l1_memory_desc`, `get_object_state`,
//! `memcheck`. A listener calling a locked operation of its own tier gets
//! [`TierError::Reentrant`]. `touch_keys` calls the `accessed` listeners
//! under a gate it holds shared and `close` takes exclusively, so when
//! `close` returns no listener is running and none will (a listener
//! calling `close` of its own tier gets `Reentrant` too). The TTL sweeper
//! (`sweeper.rs`) is a thread per tier that takes the lock once per sweep.

mod audit;
mod clock;
mod events;
mod ops;
mod staging;
mod sweeper;
mod types;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard, RwLock};

pub use clock::{Clock, ManualClock, SystemClock};
pub use events::{EventSink, Listener, TierEvent};
pub use types::{
    Holds, InvariantViolation, KeyPage, KeyStage, L1MemoryDesc, ObjectState, SweepReport, TierCode,
    TierError, TierPage, TierStats, TierStatus, WriteMode,
};

use crate::client::{ClientError, LayoutHandle};
use audit::{Said, UnknownOutcome};
use cxlkv_controlplane::proto::Location;
use events::Callback;
use staging::{KeyMirror, Staging};
use sweeper::Sweeper;

/// The name `report_status` gives the backend.
pub const BACKEND: &str = "cxlkv";
/// Shortest sweep interval.
pub const MIN_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Longest TTL accepted (a year: "never" in practice, still a bound).
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// How a tier is set up. `TierConfig::default()`: write TTL 600 s, read TTL
/// 300 s (the reference's test values), the system clock, no event sink.
#[derive(Clone)]
pub struct TierConfig {
    /// How long a write reservation may stay unfinished before the sweeper
    /// reclaims its page.
    pub write_ttl: Duration,
    /// How long a read staging may stay after its last reserve before the
    /// sweeper releases its pins (and reclaims a private page).
    pub read_ttl: Duration,
    /// The time deadlines are measured in (tests inject a [`ManualClock`]).
    pub clock: Arc<dyn Clock>,
    /// Where observability events go.
    pub events: Option<Arc<dyn EventSink>>,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            write_ttl: Duration::from_secs(600),
            read_ttl: Duration::from_secs(300),
            clock: Arc::new(SystemClock::new()),
            events: None,
        }
    }
}

impl std::fmt::Debug for TierConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierConfig")
            .field("write_ttl", &self.write_ttl)
            .field("read_ttl", &self.read_ttl)
            .field("clock", &self.clock)
            .field("events", &self.events.is_some())
            .finish()
    }
}

impl TierConfig {
    /// The sweep interval: `max(1 s, min(write_ttl, read_ttl) / 4)`.
    pub fn sweep_interval(&self) -> Duration {
        (self.write_ttl.min(self.read_ttl) / 4).max(MIN_SWEEP_INTERVAL)
    }

    fn validate(&self) -> Result<(), TierError> {
        for (field, ttl) in [("write_ttl", self.write_ttl), ("read_ttl", self.read_ttl)] {
            if ttl < Duration::from_millis(1) || ttl > MAX_TTL {
                return Err(TierError::Config {
                    field,
                    reason: format!("{ttl:?} is not in 1 ms..={} s", MAX_TTL.as_secs()),
                });
            }
        }
        Ok(())
    }
}

/// This thread's identity for the tier's re-entrancy checks (`Inner::holder`,
/// `Inner::accessing`). Not a thread-local: a C engine's
/// `pthread_key_create` destructor, or a Rust thread-local's `Drop`, may
/// call the tier as the thread exits, after the thread-locals registered
/// before its own are destroyed (`std`'s refuse access then, with a panic);
/// the thread's pthread handle stays valid until it has ended.
fn this_thread() -> usize {
    // SAFETY: `pthread_self` has no preconditions and cannot fail.
    unsafe { libc::pthread_self() as usize }
}

/// This thread calls the `accessed` listeners of a tier while it lives
/// (see `Inner::accessing`); unwinding included.
struct Accessing<'a> {
    inner: &'a Inner,
    thread: usize,
}

impl<'a> Accessing<'a> {
    fn enter(inner: &'a Inner) -> Accessing<'a> {
        let thread = this_thread();
        inner.accessing.lock().push(thread);
        Accessing { inner, thread }
    }
}

impl Drop for Accessing<'_> {
    fn drop(&mut self) {
        let mut a = self.inner.accessing.lock();
        if let Some(pos) = a.iter().rposition(|&t| t == self.thread) {
            a.swap_remove(pos);
        }
    }
}

/// Tier ids, unique in the process.
static NEXT_TIER_ID: AtomicU64 = AtomicU64::new(1);

/// Counters behind [`TierStats`].
#[derive(Debug, Default)]
struct Counters {
    lookups: AtomicU64,
    unpin_round_trips: AtomicU64,
    pins_released: AtomicU64,
    pins_lost: AtomicU64,
    registers: AtomicU64,
    registers_unresolved: AtomicU64,
    exists: AtomicU64,
    deletes: AtomicU64,
    temporaries_reclaimed: AtomicU64,
    swept: AtomicU64,
}

impl Counters {
    fn add(c: &AtomicU64, n: u64) {
        // Relaxed: independent tallies, read for reporting.
        c.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> TierStats {
        // Relaxed: independent tallies.
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TierStats {
            lookups: l(&self.lookups),
            unpin_round_trips: l(&self.unpin_round_trips),
            pins_released: l(&self.pins_released),
            pins_lost: l(&self.pins_lost),
            registers: l(&self.registers),
            registers_unresolved: l(&self.registers_unresolved),
            exists: l(&self.exists),
            deletes: l(&self.deletes),
            temporaries_reclaimed: l(&self.temporaries_reclaimed),
            swept: l(&self.swept),
        }
    }
}

/// What the tier and its sweeper share.
struct Inner {
    id: u64,
    layout: LayoutHandle,
    cfg: TierConfig,
    state: Mutex<Staging>,
    mirror: Arc<KeyMirror>,
    /// Replaced wholesale on registration so dispatch can clone the `Arc`
    /// and call listeners without holding this lock.
    listeners: RwLock<Arc<Vec<Arc<dyn Listener>>>>,
    /// Held shared by `touch_keys` while it calls the `accessed` listeners
    /// (which it does without the tier's lock), and exclusively by `close`
    /// while it sets `closed`: once `close` returns, no listener runs and
    /// none starts — the C ABI lets the callbacks go then.
    dispatch: RwLock<()>,
    /// Set by `close` (the unlocked operations read it).
    closed: AtomicBool,
    /// The thread holding `state`'s lock (`this_thread`), 0 when none: a
    /// listener calling a locked operation of its own tier is answered
    /// `Reentrant` instead of deadlocking. Written only under the lock
    /// (set after taking it, cleared before releasing it), so a thread
    /// reads its own id here only while it holds the lock: any other
    /// value it may read (another holder's, 0) differs from its id.
    holder: AtomicUsize,
    /// The threads calling this tier's `accessed` listeners (`touch_keys`,
    /// outside the lock; a thread once per call under way): `close` from
    /// one of them would wait for its own dispatch to end.
    accessing: Mutex<Vec<usize>>,
    counters: Counters,
    /// Tests that inject a state the operations cannot reach turn the
    /// after-operation invariant assertion off.
    #[cfg(test)]
    skip_invariant_assert: AtomicBool,
    /// Test hook: runs once just before the next round trip of a locked
    /// operation (where another thread's `Client::close` can fall).
    #[cfg(test)]
    before_round_trip: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// The tier's lock, held by this thread (see `Inner::holder`) for the locked
/// operation `op`. Releasing it asserts the invariants (debug builds), so
/// they are checked after every locked operation whatever path it returns
/// by.
struct Locked<'a> {
    guard: MutexGuard<'a, Staging>,
    inner: &'a Inner,
    op: &'static str,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Staging;
    fn deref(&self) -> &Staging {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Staging {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Before the guard (a field) unlocks; Relaxed: see `Inner::holder`.
        self.inner.holder.store(0, Ordering::Relaxed);
        // Not while unwinding: a second panic would abort, and the first
        // one already says what went wrong.
        if !std::thread::panicking() {
            self.inner.assert_invariants(&mut self.guard, self.op);
        }
    }
}

/// The L1 tier over one layout (see the module docs). Thread-safe; share it
/// with an `Arc`. Dropping it closes it.
pub struct L1Tier {
    inner: Arc<Inner>,
    sweeper: Mutex<Option<Sweeper>>,
}

impl std::fmt::Debug for L1Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1Tier")
            .field("id", &self.inner.id)
            .field("page_size_bytes", &self.inner.layout.page_size_bytes())
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl L1Tier {
    /// A tier over `layout` (the reference's `register_kv_layout`: the
    /// layout fixes the page size and the key space), with its sweeper
    /// thread started.
    pub fn new(layout: LayoutHandle, cfg: TierConfig) -> Result<L1Tier, TierError> {
        if layout.in_forked_child() {
            // A layout inherited across `fork` (`client/fork.rs`): a tier
            // over it could do nothing but start a sweeper thread here.
            return Err(forked_child_refusal("new", &layout));
        }
        cfg.validate()?;
        let interval = cfg.sweep_interval();
        let mirror = Arc::new(KeyMirror::default());
        let inner = Arc::new(Inner {
            // Relaxed: only uniqueness matters.
            id: NEXT_TIER_ID.fetch_add(1, Ordering::Relaxed),
            layout,
            cfg,
            state: Mutex::new(Staging::new(Arc::clone(&mirror))),
            mirror,
            listeners: RwLock::new(Arc::new(Vec::new())),
            dispatch: RwLock::new(()),
            closed: AtomicBool::new(false),
            holder: AtomicUsize::new(0),
            accessing: Mutex::new(Vec::new()),
            counters: Counters::default(),
            #[cfg(test)]
            skip_invariant_assert: AtomicBool::new(false),
            #[cfg(test)]
            before_round_trip: Mutex::new(None),
        });
        let sweeper = Sweeper::spawn(Arc::clone(&inner), interval).map_err(TierError::Thread)?;
        Ok(L1Tier {
            inner,
            sweeper: Mutex::new(Some(sweeper)),
        })
    }

    /// The layout this tier serves.
    pub fn layout(&self) -> &LayoutHandle {
        &self.inner.layout
    }

    /// Appends a listener (no de-duplication, no notification). Locked: a
    /// listener registered during another call sees none of it.
    pub fn register_listener(&self, listener: Arc<dyn Listener>) -> Result<(), TierError> {
        let _st = self.inner.lock("register_listener")?;
        let mut list = self.inner.listeners.write();
        let mut next: Vec<Arc<dyn Listener>> = list.as_ref().clone();
        next.push(listener);
        *list = Arc::new(next);
        Ok(())
    }

    /// Fires `accessed(keys)` on every listener with the keys unchanged. No
    /// lock, no round trip, no state change, no event. A `close` from
    /// another thread waits for the listeners to return.
    pub fn touch_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<(), TierError> {
        const OP: &str = "touch_keys";
        self.inner.check_open(OP)?;
        self.inner.check_keys(OP, keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(AsRef::as_ref).collect();
        {
            // Recursive: a listener (of this call, or of a locked call) may
            // touch keys while a `close` waits for the gate.
            let _dispatch = self.inner.dispatch.read_recursive();
            // Again under the gate: a `close` that took it first is done.
            self.inner.check_open(OP)?;
            let _accessing = Accessing::enter(&self.inner);
            let listeners = Arc::clone(&self.inner.listeners.read());
            for l in listeners.iter() {
                Callback::Accessed.call(l.as_ref(), &keys);
            }
        }
        self.inner.assert_invariants_unlocked(OP);
        Ok(())
    }

    /// True iff the key is staged in neither map (lock-free). An unknown key
    /// is evictable: `delete` answers authoritatively (`KeyNotExist` for a
    /// stale candidate, `KeyIsLocked` for someone else's pin).
    pub fn is_key_evictable(&self, key: impl AsRef<[u8]>) -> bool {
        !self.inner.mirror.contains(key.as_ref())
    }

    /// `(used, total)` bytes, with no round trip: `used` = pages allocated
    /// in the regions this client owns for the tier's layout (the only ones
    /// the tier allocates from; a layout of another page size has regions
    /// of its own) × their page size; `total` = the pages those regions
    /// hold × their page size plus, when this layout
    /// auto-expands, the pages of the whole regions of this layout that
    /// still fit in the pool's free bytes and under the client's quota, as
    /// of the latest reply. Only bytes that can be in use count: when an
    /// allocation fails for want of room, `total - used` is less than a
    /// page.
    pub fn get_memory_usage(&self) -> (u64, u64) {
        self.inner.memory_usage()
    }

    /// Always `None`: see [`L1MemoryDesc`].
    pub fn get_l1_memory_desc(&self) -> Option<L1MemoryDesc> {
        None
    }

    /// Always `None`: see [`ObjectState`].
    pub fn get_object_state(&self, key: impl AsRef<[u8]>) -> Option<ObjectState> {
        let _ = key;
        None
    }

    /// The allocator's health: true unless one of this layout's allocators
    /// ever refused a free (a page freed twice, with a stale generation, or
    /// into the wrong region — each a bug caught). Lock-free.
    pub fn memcheck(&self) -> bool {
        self.inner.layout.refused_frees() == 0
    }

    /// The stock status keys plus `backend` (locked).
    pub fn report_status(&self) -> Result<TierStatus, TierError> {
        let st = self.inner.lock("report_status")?;
        let (reads, writes, held, temporary) = st.counts();
        drop(st);
        let (used, total) = self.inner.memory_usage();
        Ok(TierStatus {
            is_healthy: self.memcheck(),
            backend: BACKEND,
            total_object_count: reads + writes,
            write_locked_count: writes,
            read_locked_count: held,
            temporary_count: temporary,
            memory_used_bytes: used,
            memory_total_bytes: total,
            memory_usage_ratio: if total == 0 {
                0.0
            } else {
                used as f64 / total as f64
            },
            write_ttl_seconds: self.inner.cfg.write_ttl.as_secs_f64(),
            read_ttl_seconds: self.inner.cfg.read_ttl.as_secs_f64(),
        })
    }

    /// Stops and joins the sweeper, waits for the `accessed` listeners
    /// `touch_keys` is calling, then drains the staging without notifying:
    /// every read pin released (batched: one `Unpin` per `max_batch`
    /// entries), every private temporary and every write page reclaimed —
    /// each exactly once. Shared pages are not touched. Once it returns, no
    /// listener is running or will run.
    /// Idempotent; later calls fail with `Closed`. The client stays open;
    /// after the client's close this is the one operation that still works
    /// (the read pins died with the client's session).
    pub fn close(&self) -> Result<(), TierError> {
        const OP: &str = "close";
        // A forked child's copy: the sweeper thread and the pins are the
        // parent's (`Drop` leaves the copy alone).
        self.inner.refuse_in_forked_child(OP)?;
        if self.inner.held_by_this_thread() || self.inner.accessing_on_this_thread() {
            return Err(TierError::Reentrant { op: OP });
        }
        // Taken out first, so that the sweeper's lock is not held while the
        // thread is joined: a listener may ask `sweeper_running` (under the
        // tier's lock, which the sweep being joined may be waiting for).
        let sweeper = self.sweeper.lock().take();
        if let Some(s) = sweeper {
            s.stop();
        }
        // Closed first (Release: pairs with the Acquire in `check_open`), so
        // that a `touch_keys` arriving now leaves at its check under the
        // gate: a steady stream of them cannot keep the gate held. Then the
        // gate, exclusively: every `accessed` dispatch under way has ended.
        // Not under the tier's lock, which an `accessed` listener may be
        // waiting for.
        self.inner.closed.store(true, Ordering::Release);
        drop(self.inner.dispatch.write());
        let mut st = self.inner.lock_even_closed(OP)?;
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        self.inner.drain(&mut st);
        Ok(())
    }

    /// Where `key` stands on this tier (diagnostics; locked).
    pub fn inspect(&self, key: impl AsRef<[u8]>) -> Result<KeyStage, TierError> {
        let st = self.inner.lock("inspect")?;
        Ok(st.stage_of(key.as_ref()))
    }

    /// Checks the invariants I1–I4 and the tier's mirrors (`staging.rs`)
    /// and, in debug builds, I7 (`audit.rs`); debug builds assert these and
    /// I5/I6 (what the call told its listeners) after every operation.
    pub fn check_invariants(&self) -> Result<(), TierError> {
        const OP: &str = "check_invariants";
        let mut st = self.inner.lock(OP)?;
        self.inner.check(&mut st, OP).map_err(TierError::from)
    }

    /// Runs one TTL sweep now (the sweeper thread does this every
    /// [`TierConfig::sweep_interval`]).
    pub fn sweep_now(&self) -> Result<SweepReport, TierError> {
        self.inner.sweep()
    }

    /// The sweeper's period.
    pub fn sweep_interval(&self) -> Duration {
        self.inner.cfg.sweep_interval()
    }

    /// True while the sweeper thread runs (until `close`; never in a child
    /// forked from the tier's process, which has no such thread).
    pub fn sweeper_running(&self) -> bool {
        if self.inner.layout.in_forked_child() {
            return false;
        }
        self.sweeper
            .lock()
            .as_ref()
            .is_some_and(Sweeper::is_running)
    }

    /// The tier's counters.
    pub fn stats(&self) -> TierStats {
        self.inner.counters.snapshot()
    }
}

impl Drop for L1Tier {
    fn drop(&mut self) {
        if self.inner.layout.in_forked_child() {
            // A forked child's copy (`client/fork.rs`): the sweeper thread
            // does not exist here (joining it would fail), and the staged
            // reads' pins are the parent's. Leave the copy alone; the
            // thread's own reference keeps `inner` from being dropped.
            if let Some(sweeper) = self.sweeper.get_mut().take() {
                std::mem::forget(sweeper);
            }
            return;
        }
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing the L1 tier on drop failed");
        }
    }
}

/// The error of a tier call in a forked child (the client's own refusal,
/// which names the fork).
fn forked_child_refusal(op: &'static str, layout: &LayoutHandle) -> TierError {
    TierError::ClientFailed {
        op,
        reason: layout
            .client_unusable()
            .map_or_else(|| "forked".into(), |e| e.with_causes().to_string()),
    }
}

impl Inner {
    fn held_by_this_thread(&self) -> bool {
        // Relaxed: see the field.
        self.holder.load(Ordering::Relaxed) == this_thread()
    }

    fn accessing_on_this_thread(&self) -> bool {
        self.accessing.lock().contains(&this_thread())
    }

    /// Refuses a closed tier, and a tier whose client is closed.
    fn check_open(&self, op: &'static str) -> Result<(), TierError> {
        // Acquire: pairs with the Release in `close`.
        if self.closed.load(Ordering::Acquire) {
            return Err(TierError::Closed { op });
        }
        self.check_client_open(op)
    }

    /// A closed client fails every request with `Closed`, which each
    /// operation would otherwise read as its own per-key answer — a miss, a
    /// lack of memory, a key to retry later — none of them true: the call
    /// is refused as a whole instead.
    fn check_client_open(&self, op: &'static str) -> Result<(), TierError> {
        match self.layout.client_unusable() {
            None => Ok(()),
            Some(ClientError::Closed) => Err(TierError::ClientClosed { op }),
            // Fatal: the instance cannot be resumed (a passing reconnect
            // failure is not kept, and is answered per key as before).
            Some(e) => Err(TierError::ClientFailed {
                op,
                reason: e.with_causes().to_string(),
            }),
        }
    }

    /// Runs the test hook set for the next round trip (nothing outside
    /// tests).
    fn before_round_trip(&self) {
        #[cfg(test)]
        if let Some(hook) = self.before_round_trip.lock().take() {
            hook();
        }
    }

    /// Refuses `op` in a child forked from the tier's process
    /// (`client/fork.rs`) before any lock is taken: a thread of the parent
    /// may have held the tier's lock, or the client's, at the fork, and
    /// would never release it here.
    fn refuse_in_forked_child(&self, op: &'static str) -> Result<(), TierError> {
        if self.layout.in_forked_child() {
            return Err(forked_child_refusal(op, &self.layout));
        }
        Ok(())
    }

    /// Takes the tier's lock for `op`, refusing a re-entrant call, a
    /// closed tier and a closed client.
    fn lock(&self, op: &'static str) -> Result<Locked<'_>, TierError> {
        let st = self.lock_even_closed(op)?;
        if st.closed {
            return Err(TierError::Closed { op });
        }
        self.check_client_open(op)?;
        Ok(st)
    }

    fn lock_even_closed(&self, op: &'static str) -> Result<Locked<'_>, TierError> {
        self.refuse_in_forked_child(op)?;
        if self.held_by_this_thread() {
            return Err(TierError::Reentrant { op });
        }
        let mut guard = self.state.lock();
        guard.audit.reset();
        // Relaxed: see the field.
        self.holder.store(this_thread(), Ordering::Relaxed);
        Ok(Locked {
            guard,
            inner: self,
            op,
        })
    }

    /// Argument checks shared by every call that takes keys: batch and key
    /// lengths within the session's limits, no key repeated.
    fn check_keys<K: AsRef<[u8]>>(&self, op: &'static str, keys: &[K]) -> Result<(), TierError> {
        // Before the limits are read (under the client's connection lock).
        self.refuse_in_forked_child(op)?;
        let max = self.layout.max_batch();
        if keys.len() > max {
            return Err(TierError::BatchTooLarge {
                op,
                len: keys.len(),
                max,
            });
        }
        let max_bytes = self.layout.max_key_bytes();
        for (index, key) in keys.iter().enumerate() {
            let len_bytes = key.as_ref().len();
            if len_bytes == 0 || len_bytes > max_bytes {
                return Err(TierError::KeyLength {
                    op,
                    index,
                    len_bytes,
                    max_bytes,
                });
            }
        }
        if keys.len() > 1 {
            let mut seen: foldhash::HashMap<&[u8], usize> =
                foldhash::HashMap::with_capacity_and_hasher(keys.len(), Default::default());
            for (index, key) in keys.iter().enumerate() {
                if let Some(&first_index) = seen.get(key.as_ref()) {
                    return Err(TierError::DuplicateKey {
                        op,
                        index,
                        first_index,
                    });
                }
                seen.insert(key.as_ref(), index);
            }
        }
        Ok(())
    }

    /// Calls `cb` on every listener, in registration order (the tier's lock
    /// held: `st` records what was said).
    fn fire(&self, st: &mut Staging, cb: Callback, keys: &[&[u8]]) {
        st.audit.said(Said::Callback(cb), keys);
        let listeners = Arc::clone(&self.listeners.read());
        for l in listeners.iter() {
            cb.call(l.as_ref(), keys);
        }
    }

    /// Calls `first(a)` then `second(b)` on each listener in turn.
    fn fire_pair(
        &self,
        st: &mut Staging,
        first: (Callback, &[&[u8]]),
        second: (Callback, &[&[u8]]),
    ) {
        st.audit.said(Said::Callback(first.0), first.1);
        st.audit.said(Said::Callback(second.0), second.1);
        let listeners = Arc::clone(&self.listeners.read());
        for l in listeners.iter() {
            first.0.call(l.as_ref(), first.1);
            second.0.call(l.as_ref(), second.1);
        }
    }

    fn publish(&self, st: &mut Staging, event: TierEvent, keys: &[&[u8]]) {
        st.audit.said(Said::Event(event), keys);
        if let Some(sink) = &self.cfg.events {
            sink.publish(event, keys);
        }
    }

    /// Every invariant check: the maps (I1–I4, `staging.rs`), what the
    /// current call said (I5, I6, `audit.rs`) and the pages of unknown
    /// registration outcome (I7).
    fn check(&self, st: &mut Staging, op: &str) -> Result<(), InvariantViolation> {
        st.check()?;
        st.audit.check(op, st)?;
        self.check_unknown_outcomes(st)
    }

    /// Asserts the invariants after an operation (debug builds).
    fn assert_invariants(&self, st: &mut Staging, op: &'static str) {
        #[cfg(test)]
        // Relaxed: set by the test thread before the operation it guards.
        if self.skip_invariant_assert.load(Ordering::Relaxed) {
            return;
        }
        if cfg!(debug_assertions)
            && let Err(v) = self.check(st, op)
        {
            panic!("L1 tier invariant broken after {op}: {v}");
        }
    }

    /// The assertion after an unlocked operation: only if the lock is free
    /// (a thread holding it — a listener's own call included — asserts
    /// when it releases it; waiting here could deadlock that listener).
    fn assert_invariants_unlocked(&self, op: &'static str) {
        if cfg!(debug_assertions)
            && let Some(mut st) = self.state.try_lock()
        {
            st.audit.reset();
            self.assert_invariants(&mut st, op);
        }
    }

    /// The client's activity count for I7 (see [`UnknownOutcome`]):
    /// requests sent plus pages freed by notices, read under the notice
    /// lock, so that no notice is half applied (its page freed, not yet
    /// counted) while it is read.
    fn client_activity(&self) -> u64 {
        let shared = self.layout.shared();
        let _applying = shared.notice_lock.lock();
        // Relaxed: monotonic tallies. A request is counted before it is
        // sent, a round trip (two system calls) before any free its answer
        // leads to; the notice count is read under the lock its frees
        // happen under.
        shared.stats.requests.load(Ordering::Relaxed)
            + shared.stats.pages_freed_by_notice.load(Ordering::Relaxed)
    }

    /// Notes pages whose registration outcome came back unknown (debug
    /// builds; I7).
    fn note_unknown_outcomes(&self, st: &mut Staging, locations: &[Location]) {
        if !cfg!(debug_assertions) {
            return;
        }
        let activity = self.client_activity();
        st.unknown.clear();
        st.unknown.extend(
            locations
                .iter()
                .map(|&location| UnknownOutcome { location, activity }),
        );
    }

    /// I7: no page of unknown registration outcome is free while the client
    /// cannot have learned the outcome (see [`UnknownOutcome`]); entries
    /// the client may have settled since are retired.
    fn check_unknown_outcomes(&self, st: &mut Staging) -> Result<(), InvariantViolation> {
        if st.unknown.is_empty() {
            return Ok(());
        }
        let shared = self.layout.shared();
        for u in &st.unknown {
            let l = u.location;
            let allocated = shared
                .find_owned(l.region)
                .is_some_and(|r| r.alloc.is_allocated(l.page_index(), l.page_generation()));
            if !allocated && self.client_activity() == u.activity {
                return Err(InvariantViolation {
                    invariant: "I7",
                    key: Vec::new(),
                    detail: format!(
                        "page {l:?} of a registration of unknown outcome is free, \
                         and the client has not talked to the directory since"
                    ),
                });
            }
        }
        let now = self.client_activity();
        st.unknown.retain(|u| u.activity == now);
        Ok(())
    }

    /// `(used, total)` of this tier's layout: `total` counts only bytes
    /// that can be in use — the pages of the layout's own regions (a
    /// region's tail past its last whole page never is; another layout's
    /// regions never are: a layout allocates only in its own) and the pages
    /// of the whole regions this layout can still take — so that `used`
    /// reaches `total` (within a page) when the next allocation fails, and a
    /// watermark on `used / total` fires before.
    fn memory_usage(&self) -> (u64, u64) {
        let pages = self.layout.layout_pages();
        let total = pages
            .usable_bytes
            .saturating_add(self.growable_bytes(pages.client_region_bytes));
        (pages.used_bytes, total)
    }

    /// Page bytes of the regions this layout may still take, as of the
    /// latest reply: none without auto-expansion; else as many whole
    /// regions as fit in the pool's free bytes and under the quotas
    /// (growth is by whole regions, refused when one does not fit), each
    /// worth its whole pages. `client_region_bytes` are the client's
    /// regions of every layout (the quotas count them all).
    fn growable_bytes(&self, client_region_bytes: u64) -> u64 {
        if !self.layout.auto_expands() {
            return 0;
        }
        let usage = self.layout.cached_usage();
        let mut room = usage.pool_free_bytes;
        let quotas = [
            self.layout.quota_bytes(),
            (usage.instance_quota_bytes > 0).then_some(usage.instance_quota_bytes),
        ];
        for quota in quotas.into_iter().flatten() {
            room = room.min(quota.saturating_sub(client_region_bytes));
        }
        let region_bytes = self.layout.region_size_bytes();
        let page_size_bytes = self.layout.page_size_bytes();
        debug_assert!(
            region_bytes >= page_size_bytes && page_size_bytes > 0,
            "a layout's regions hold at least one page"
        );
        let page_bytes_per_region = region_bytes / page_size_bytes * page_size_bytes;
        (room / region_bytes).saturating_mul(page_bytes_per_region)
    }
}

#[cfg(all(test, debug_assertions))]
impl Inner {
    /// Test hook: runs `corrupt` under the lock as if it were the operation
    /// `op`; releasing the lock asserts the invariants, as after `op`.
    fn corrupt_as(&self, op: &'static str, corrupt: impl FnOnce(&Inner, &mut Staging)) {
        let mut st = self.lock(op).expect("the tier is open");
        corrupt(self, &mut st);
    }
}
