//! The state every handle of one client shares: the connection, the pools,
//! the layouts and their regions, the peer-region cache, the key index, the
//! notice and sequence state, the unpin queue, and the counters.
//!
//! Nothing here is held across a round trip on the hot paths: the
//! connection is an `Arc` cloned out of a short lock, regions are read from
//! epoch-published tables, and the locks that exist (key index shards, the
//! unpin queue, live pins, the sequence window) guard in-memory work only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::proto::{
    ArchivedReplyMeta, FreedPage, InstanceSecret, Limits, RegionDesc, Usage,
};
use cxlkv_controlplane::transport::RpcClient;
use cxlkv_dataplane::ids::RegionId;
use cxlkv_dataplane::map::{MapObservers, MappedRegion};
use cxlkv_dataplane::table::RegionTable;
use cxlkv_dataplane::visibility::Visibility;
use parking_lot::{Condvar, Mutex, RwLock};

use super::config::ClientConfig;
use super::error::ClientError;
use super::fork::Owner;
use super::index::KeyIndex;
use super::layout::{LayoutState, UnresolvedRegion};
use super::pools::Pool;
use super::read::{LivePins, UnpinQueue};
use super::regions::{self, OwnedRegion, PeerRegion, Retired};
use super::seq::SeqWindow;
use super::stats::Counters;
use super::write::Unresolved;

/// One connection (= one directory session) of the instance.
#[derive(Debug)]
pub(crate) struct Conn {
    pub rpc: RpcClient,
    /// Bumped by every reconnect; a failure on generation `g` triggers a
    /// reconnect only if `g` is still current.
    pub conn_no: u64,
    pub session_id: u64,
    pub lease_ms: u32,
    pub limits: Limits,
    pub directory_epoch: u64,
    /// The session was ended by the directory (`SessionEnded`): the next
    /// request reattaches.
    pub dead: AtomicBool,
}

impl Conn {
    pub fn usable(&self) -> bool {
        // Relaxed: a hint; a request on a dead connection fails and retries.
        !self.dead.load(Ordering::Relaxed) && !self.rpc.is_closed()
    }
}

/// The instance's identity, presented by `Reattach`.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub instance_id: String,
    pub secret: InstanceSecret,
}

/// Shared state of one client (see the module docs).
#[derive(Debug)]
pub(crate) struct Shared {
    /// The process that connected (see `fork.rs`): in a forked child every
    /// call is refused before it locks or sends anything.
    pub owner: Owner,
    pub cfg: ClientConfig,
    pub pools: Vec<Pool>,
    pub observers: MapObservers,
    /// The current connection; `None` once the client is closed.
    pub conn: Mutex<Option<Arc<Conn>>>,
    /// Serialises reconnects (held across the reattach round trips: failure
    /// path only).
    pub reconnect_lock: Mutex<()>,
    /// Why the latest reattach attempt failed (cleared when one succeeds):
    /// what a caller that gave up waiting for another thread's reconnect
    /// reports.
    pub reconnect_failure: Mutex<Option<String>>,
    pub identity: Identity,
    pub seqs: SeqWindow,
    /// Highest freed-page notice applied (sent as `notice_ack`).
    pub notice_applied: AtomicU64,
    /// Serialises notice application, so `notice_applied` only grows and
    /// each notice is applied once.
    pub notice_lock: Mutex<()>,
    /// Layouts by index (small; hot paths hold their `LayoutState` directly).
    pub layouts: RwLock<Vec<Arc<LayoutState>>>,
    pub peers: RegionTable<Arc<PeerRegion>>,
    /// Serialises mapping a new peer region (rare), so two lookups do not map
    /// the same region twice.
    pub peer_lock: Mutex<()>,
    pub retired: Retired,
    pub index: KeyIndex,
    pub unpins: UnpinQueue,
    pub live_pins: LivePins,
    /// Registrations whose outcome is unknown, retried in the background.
    pub unresolved: Mutex<Vec<Unresolved>>,
    /// Region requests whose outcome is unknown, retried in the background.
    pub unresolved_regions: Mutex<Vec<UnresolvedRegion>>,
    /// A directory restart happened and the key index has not been fully
    /// registered again yet.
    pub reregister_pending: AtomicBool,
    /// The `directory_epoch` of the last reattach's answer (also of one
    /// whose setup then failed): a restart is counted once.
    pub epoch_seen: AtomicU64,
    /// Test fail point: run by the reattaching thread once the new session
    /// is set up, before its live views are pinned again.
    #[cfg(test)]
    pub before_repin: TestHook,
    /// Test fail point: run by the maintenance thread once an idle region
    /// out of its table is about to be given back (before `ReturnRegion`).
    #[cfg(test)]
    pub before_return: TestHook,
    /// Test fail point: run by the maintenance thread once a region out of
    /// its table for return was found touched, before it is put back.
    #[cfg(test)]
    pub before_put_back: TestHook,
    /// Test fail point: unpins are not sent (as when the connection's
    /// in-flight bound refuses them).
    #[cfg(test)]
    pub unpins_not_sent: AtomicBool,
    /// Set when the instance can no longer be resumed (its grace expired, or
    /// the server refused it): every later call fails with this message.
    pub fatal: Mutex<Option<String>>,
    /// `fatal` is set (read without the lock on every call: allocation must
    /// stay lock-free).
    pub has_fatal: AtomicBool,
    pub owned_bytes: AtomicU64,
    pub usage: UsageCell,
    pub stats: Counters,
    pub closing: AtomicBool,
    /// Wakes the maintenance thread (an unpin was queued, or close).
    pub wake: (Mutex<bool>, Condvar),
    /// The maintenance thread has been told about queued unpins and will
    /// flush them within `unpin_delay_us`: later pushes need not wake it
    /// (a wake-up is a system call and a context switch on every `get`
    /// otherwise).
    pub unpin_timer_armed: AtomicBool,
    /// Client-clock milliseconds of the last request sent (heartbeats fill
    /// gaps).
    pub last_sent_ms: AtomicU64,
    pub clock: Instant,
    /// Monotone stamp for the peer cache's LRU.
    pub stamp: AtomicU64,
}

/// The latest `Usage` any reply carried.
#[derive(Debug, Default)]
pub(crate) struct UsageCell {
    used: AtomicU64,
    owned: AtomicU64,
    quota: AtomicU64,
    pool_free: AtomicU64,
}

impl UsageCell {
    pub fn store(&self, u: Usage) {
        // Relaxed: independent gauges, read for reporting.
        self.used.store(u.instance_used_bytes, Ordering::Relaxed);
        self.owned.store(u.instance_owned_bytes, Ordering::Relaxed);
        self.quota.store(u.instance_quota_bytes, Ordering::Relaxed);
        self.pool_free.store(u.pool_free_bytes, Ordering::Relaxed);
    }

    pub fn load(&self) -> Usage {
        Usage {
            instance_used_bytes: self.used.load(Ordering::Relaxed),
            instance_owned_bytes: self.owned.load(Ordering::Relaxed),
            instance_quota_bytes: self.quota.load(Ordering::Relaxed),
            pool_free_bytes: self.pool_free.load(Ordering::Relaxed),
        }
    }
}

impl Shared {
    pub fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.request_timeout_ms)
    }

    /// The current connection (it may have broken; requests find out). On
    /// a thread setting up a reattached session, that session's connection
    /// (see [`SettingUp`]).
    pub fn conn(&self) -> Result<Arc<Conn>, ClientError> {
        self.check_process()?;
        if let Some(c) = SettingUp::conn_for(self) {
            return Ok(c);
        }
        self.conn
            .lock()
            .as_ref()
            .map(Arc::clone)
            .ok_or(ClientError::Closed)
    }

    /// The limits of the current session (the protocol's own once closed).
    pub fn limits(&self) -> Limits {
        if let Some(c) = SettingUp::conn_for(self) {
            return c.limits;
        }
        self.conn
            .lock()
            .as_ref()
            .map_or_else(|| Limits::protocol(1, 1), |c| c.limits)
    }

    /// Refuses a call in a process forked from the one that connected.
    pub fn check_process(&self) -> Result<(), ClientError> {
        if self.owner.forked() {
            return Err(ClientError::Forked {
                pid: self.owner.pid,
            });
        }
        Ok(())
    }

    pub fn check_open(&self) -> Result<(), ClientError> {
        self.check_process()?;
        // Relaxed: a request racing close fails later on the closed socket.
        if self.closing.load(Ordering::Relaxed) {
            return Err(ClientError::Closed);
        }
        // Acquire: pairs with the Release in `set_fatal`, so the reason is
        // there when the flag is.
        if self.has_fatal.load(Ordering::Acquire)
            && let Some(reason) = self.fatal.lock().as_ref()
        {
            return Err(ClientError::ReconnectFailed {
                elapsed_ms: 0,
                last: reason.clone(),
                resumable: false,
            });
        }
        Ok(())
    }

    /// Records why the instance can no longer be resumed.
    pub fn set_fatal(&self, reason: String) {
        *self.fatal.lock() = Some(reason);
        self.has_fatal.store(true, Ordering::Release);
    }

    /// Wakes the maintenance thread.
    pub fn wake_maintenance(&self) {
        let (flag, cv) = &self.wake;
        *flag.lock() = true;
        cv.notify_one();
    }

    pub fn pool(&self, pool: u32, region: RegionId) -> Result<&Pool, ClientError> {
        self.pools
            .get(pool as usize)
            .ok_or(ClientError::UnknownPool { region, pool })
    }

    /// The owned region `region`, whichever layout it belongs to — also one
    /// out of its table for return (away, see [`super::layout::Away`], or
    /// removed and not yet handed back): a thread that found it before may
    /// have allocated, registered and lost to a delete one of its pages
    /// since, and that page's notice must free it (unapplied, the page and
    /// so the region would never be free again; the return then sees the
    /// region touched and puts it back).
    pub fn find_owned(&self, region: u64) -> Option<Arc<OwnedRegion>> {
        let id = RegionId(region);
        let layouts = self.layouts.read();
        if let Some(found) = layouts.iter().find_map(|l| l.regions.with(id, Arc::clone)) {
            return Some(found);
        }
        // Rare: looked for again under each layout's away lock, under which
        // a region moves between the table and the away list, so one in
        // transit is found on one side or the other.
        layouts.iter().find_map(|l| {
            let away = l.away.lock();
            l.regions
                .with(id, Arc::clone)
                .or_else(|| {
                    away.iter()
                        .find(|(a, _)| *a == id)
                        .map(|(_, r)| Arc::clone(r))
                })
                .or_else(|| l.regions.with_removed(id, Arc::clone))
        })
    }

    /// What rides on every reply: freed-page notices and usage figures.
    pub fn absorb(&self, meta: &ArchivedReplyMeta) {
        self.usage.store((&meta.usage).into());
        if !meta.notices.is_empty() {
            self.apply_notices(meta.notices());
        }
    }

    /// Applies freed-page notices in order, each once (see the protocol's
    /// notice rules): a notice at or below the highest applied is a resend
    /// and skipped.
    pub fn apply_notices(&self, notices: impl Iterator<Item = FreedPage>) {
        let _serial = self.notice_lock.lock();
        // Relaxed: written only under `notice_lock`, which we hold.
        let mut applied = self.notice_applied.load(Ordering::Relaxed);
        for n in notices {
            if n.seq <= applied {
                continue;
            }
            if n.seq != applied + 1 {
                self.stats.bump(&self.stats.notice_gaps);
            }
            self.free_noticed_page(n);
            applied = n.seq;
        }
        // Release: a request that reads the new acknowledgement is sent after
        // the frees it acknowledges.
        self.notice_applied.store(applied, Ordering::Release);
    }

    fn free_noticed_page(&self, n: FreedPage) {
        let region = self.find_owned(n.region);
        self.index
            .forget_freed(n.region, n.page, n.generation, || match &region {
                Some(r) => match r.alloc.free(n.page_index(), n.page_generation()) {
                    Ok(()) => self.stats.bump(&self.stats.pages_freed_by_notice),
                    Err(_) => self.stats.bump(&self.stats.stale_notices),
                },
                None => self.stats.bump(&self.stats.notices_unknown_region),
            });
    }

    pub fn notice_ack(&self) -> u64 {
        // Acquire: pairs with the Release in `apply_notices`.
        self.notice_applied.load(Ordering::Acquire)
    }

    /// The mapping (and visibility mode) that holds `region` for a reader of
    /// `layout`: one of the layout's own regions, a cached peer region, or a
    /// peer region mapped now from `desc`.
    pub fn resolve_region(
        &self,
        layout: &LayoutState,
        region: u64,
        desc: Option<&RegionDesc>,
    ) -> Result<(Arc<MappedRegion>, Visibility), ClientError> {
        let id = RegionId(region);
        if let Some(found) = layout
            .regions
            .with(id, |r| (Arc::clone(&r.mapping), r.visibility))
        {
            return Ok(found);
        }
        // Relaxed: an LRU stamp, see `PeerRegion::touch`.
        let stamp = self.stamp.fetch_add(1, Ordering::Relaxed);
        let cached = |peers: &RegionTable<Arc<PeerRegion>>| {
            peers.with(id, |p| {
                p.touch(stamp);
                (Arc::clone(&p.mapping), p.visibility)
            })
        };
        if let Some(found) = cached(&self.peers) {
            return Ok(found);
        }
        let Some(desc) = desc else {
            return Err(ClientError::BadReply {
                op: "lookup",
                source: cxlkv_controlplane::proto::ProtoError::Malformed {
                    kind: cxlkv_controlplane::proto::Kind::LookupReply,
                    len_bytes: 0,
                    detail: format!(
                        "location names region {region} but the reply does not describe it"
                    ),
                },
            });
        };
        if desc.page_size_bytes != layout.layout.page_size_bytes {
            return Err(ClientError::PageSizeMismatch {
                region: id,
                region_page_bytes: desc.page_size_bytes,
                layout_page_bytes: layout.layout.page_size_bytes,
            });
        }
        let _serial = self.peer_lock.lock();
        if let Some(found) = cached(&self.peers) {
            return Ok(found);
        }
        let peer = self.map_peer(*desc, stamp)?;
        let found = (Arc::clone(&peer.mapping), peer.visibility);
        self.insert_peer(peer)?;
        Ok(found)
    }

    /// Maps a peer region (the caller holds `peer_lock`).
    pub fn map_peer(&self, desc: RegionDesc, stamp: u64) -> Result<Arc<PeerRegion>, ClientError> {
        let pool = self.pool(desc.pool, desc.region_id())?;
        let peer = regions::map_peer(pool, desc, &self.observers, stamp)?;
        self.stats.bump(&self.stats.peer_regions_mapped);
        Ok(Arc::new(peer))
    }

    /// Adds a mapped peer region, evicting the least recently used one when
    /// the cache is full (the caller holds `peer_lock`).
    pub fn insert_peer(&self, peer: Arc<PeerRegion>) -> Result<(), ClientError> {
        if self.peers.len() >= self.cfg.max_peer_mappings {
            let victim = self
                .peers
                .read()
                .iter()
                // Relaxed: an eviction hint.
                .min_by_key(|(_, p)| p.last_used.load(Ordering::Relaxed))
                .map(|(id, _)| id);
            if let Some(victim) = victim {
                // The value comes back through `take_unreachable` and is
                // retired by the maintenance thread.
                let _ = self.peers.remove(victim);
                self.stats.bump(&self.stats.peer_regions_evicted);
            }
        }
        let id = peer.desc.region_id();
        self.peers
            .insert(id, peer)
            .map_err(|_| ClientError::RegionTableFull { region: id })
    }

    /// Queues the release of one pin held by a dropped guard.
    pub fn release_pin(&self, layout_ix: u32, key: Box<[u8]>) {
        let mut pins = self.live_pins.lock();
        if !LivePins::remove(&mut pins, layout_ix, &key) {
            // The pin died with a session and could not be taken again.
            return;
        }
        let first = self.unpins.push(layout_ix, key);
        drop(pins);
        // AcqRel: pairs with the maintenance thread's disarm, after which it
        // looks at the queue again (so a push it did not flush is seen
        // either by that look or by this wake-up).
        if first && !self.unpin_timer_armed.swap(true, Ordering::AcqRel) {
            self.wake_maintenance();
        }
    }

    /// Takes every owned region of every layout out of the tables whose id
    /// is in `ids` (refused at reattach), forgetting their keys. A region
    /// away for return is revoked where it is: the maintenance thread then
    /// retires it whatever its return's outcome, and lets go of its bytes.
    pub fn drop_owned_regions(&self, ids: &[u64]) {
        for &id in ids {
            let region = RegionId(id);
            for layout in self.layouts.read().iter() {
                let away = layout.away.lock();
                // Release: a lease that sees the flag sees it before
                // writing (see `PageLease::bytes_mut`); the maintenance
                // thread reads it under the away lock before putting a
                // region back.
                let revoke = |r: &OwnedRegion| {
                    r.revoked.store(true, Ordering::Release);
                    r.desc.len_bytes
                };
                let len = layout.regions.with(region, |r| revoke(r));
                if let Some(len) = len
                    && layout.regions.remove(region).is_ok()
                {
                    // Relaxed: a gauge, changed under the table's writer lock.
                    self.owned_bytes.fetch_sub(len, Ordering::Relaxed);
                } else if let Some((_, r)) = away.iter().find(|(a, _)| *a == region) {
                    revoke(r);
                }
            }
            let forgotten = self.index.forget_region(id);
            self.stats
                .add(&self.stats.keys_lost_with_regions, forgotten as u64);
            self.stats.bump(&self.stats.regions_refused);
        }
    }
}

thread_local! {
    /// The reattached session this thread is setting up: the client it
    /// belongs to (by address) and its connection.
    static SETTING_UP: std::cell::RefCell<Option<(usize, Arc<Conn>)>> =
        const { std::cell::RefCell::new(None) };
}

/// A reattached session being set up before it is published: while this
/// guard lives, [`Shared::conn`] answers its connection to this thread, and
/// to this thread only. The reattach re-registers keys and re-pins live
/// views through it; every other thread still sees the old, broken
/// connection and waits on the reconnect lock, so none of them can take a
/// pin on the new session before the re-pin has counted the live ones (it
/// would be pinned twice) or send an unpin queued for the old session on
/// the new one (it would release a newer view's pin).
pub(crate) struct SettingUp {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl SettingUp {
    /// `None` on a thread whose thread-locals are already destroyed (a
    /// call from a thread-local destructor, or a C engine's
    /// `pthread_key_create` one, as the thread exits): it cannot set up a
    /// session, and must not try — its requests would go to the old
    /// connection ([`SettingUp::possible`] lets a reconnect refuse first).
    pub fn enter(shared: &Shared, conn: Arc<Conn>) -> Option<Self> {
        SETTING_UP
            .try_with(|s| *s.borrow_mut() = Some((shared as *const Shared as usize, conn)))
            .ok()?;
        Some(Self {
            _not_send: std::marker::PhantomData,
        })
    }

    /// Whether this thread can set up a session (see [`SettingUp::enter`]).
    pub fn possible() -> bool {
        SETTING_UP.try_with(|_| ()).is_ok()
    }

    /// The connection this thread is setting up for `shared`, if any. A
    /// thread whose thread-locals are gone sets nothing up: `None`, so that
    /// every other call works there as on a live thread.
    fn conn_for(shared: &Shared) -> Option<Arc<Conn>> {
        SETTING_UP
            .try_with(|s| {
                s.borrow()
                    .as_ref()
                    .filter(|(owner, _)| *owner == shared as *const Shared as usize)
                    .map(|(_, c)| Arc::clone(c))
            })
            .ok()
            .flatten()
    }
}

impl Drop for SettingUp {
    fn drop(&mut self) {
        // Set by `enter`, so still there: its value outlives this guard,
        // which lives on the stack of a call.
        let _ = SETTING_UP.try_with(|s| *s.borrow_mut() = None);
    }
}

/// A test fail point's action (see `Shared::before_repin`).
#[cfg(test)]
#[derive(Default)]
pub(crate) struct TestHook(Mutex<Option<Box<dyn FnOnce() + Send>>>);

#[cfg(test)]
impl TestHook {
    pub fn set(&self, f: impl FnOnce() + Send + 'static) {
        *self.0.lock() = Some(Box::new(f));
    }

    pub fn take(&self) -> Option<Box<dyn FnOnce() + Send>> {
        self.0.lock().take()
    }
}

#[cfg(test)]
impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestHook")
    }
}
