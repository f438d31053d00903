//! The client's one background thread: heartbeats, deferred unpins, idle
//! regions, unmapping, parked registrations and region requests.
//!
//! It sleeps on a condition variable and wakes (a) when a guard queues the
//! first unpin — it then waits `unpin_delay_us` (≤ 1 ms) for more and sends
//! them as one batch per layout; (b) when no request has been sent for a
//! third of the session's lease — it sends a heartbeat, whose reply also
//! carries pending notices (and a broken connection is noticed and
//! reattached here even when the engine is idle); (c) every
//! [`TICK`] for housekeeping: retired mappings whose last view is gone are
//! unmapped (so `munmap` and the engines' unmap callbacks run here), idle
//! regions beyond a layout's initial reservation are returned, and parked
//! registrations and unanswered region requests are sent again. Close wakes
//! it and joins it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cxlkv_controlplane::proto::{Heartbeat, HeartbeatReply};
use cxlkv_dataplane::ids::RegionId;

use super::layout::{LayoutState, PutBackRefused};
use super::regions::OwnedRegion;
use super::shared::Shared;

/// Housekeeping period.
const TICK: Duration = Duration::from_millis(100);

/// Runs until the client closes.
pub(crate) fn run(shared: Arc<Shared>) {
    let mut last_tick_ms = 0u64;
    loop {
        let wait = next_wait(&shared);
        {
            let (flag, cv) = &shared.wake;
            let mut woken = flag.lock();
            if !*woken {
                cv.wait_for(&mut woken, wait);
            }
            *woken = false;
        }
        if shared.closing.load(Ordering::Acquire) {
            return;
        }
        flush_deferred_unpins(&shared);
        // A connection ended on purpose (`end_session_in_background`) is
        // replaced now, idle engine or not: the heartbeat reattaches.
        if heartbeat_due(&shared) || connection_dead(&shared) {
            heartbeat(&shared);
        }
        let now = shared.now_ms();
        if now.saturating_sub(last_tick_ms) >= TICK.as_millis() as u64 {
            last_tick_ms = now;
            housekeeping(&shared, now);
        }
    }
}

/// Sends the queued unpins `unpin_delay_us` after the first was queued (any
/// request of the client may have sent them meanwhile), then disarms the
/// timer; pushes that raced the disarm are flushed by another round.
fn flush_deferred_unpins(shared: &Shared) {
    // Bounded: each round waits the delay; a client dropping guards faster
    // than that keeps this thread flushing, as it should.
    for _ in 0..1000 {
        if !shared.unpins.has_pending() {
            // AcqRel: see `Shared::release_pin`.
            shared.unpin_timer_armed.swap(false, Ordering::AcqRel);
            if !shared.unpins.has_pending() {
                return;
            }
        }
        std::thread::sleep(Duration::from_micros(u64::from(shared.cfg.unpin_delay_us)));
        if !shared.conn().is_ok_and(|c| c.usable()) {
            // Nothing can be sent until a reattach, which drops what was
            // queued for the old session; the next push re-arms the timer.
            shared.unpin_timer_armed.store(false, Ordering::Release);
            return;
        }
        if let Err(e) = shared.flush_unpins() {
            tracing::debug!(error = %e.with_causes(), "deferred unpin flush failed");
            shared.unpin_timer_armed.store(false, Ordering::Release);
            return;
        }
    }
}

fn lease_ms(shared: &Shared) -> u64 {
    shared
        .conn
        .lock()
        .as_ref()
        .map_or(10_000, |c| u64::from(c.lease_ms).max(30))
}

/// Whether the session was ended on purpose (its connection marked dead)
/// and not replaced yet. A connection the server closed is left to the
/// next request or heartbeat, as before.
fn connection_dead(shared: &Shared) -> bool {
    // Relaxed: a scheduling hint; the reconnect itself is serialised.
    shared
        .conn
        .lock()
        .as_ref()
        .is_some_and(|c| c.dead.load(Ordering::Relaxed))
        && !instance_lost(shared)
}

/// Whether the instance cannot be resumed: every request fails at once, so
/// there is no session to keep alive or replace (heartbeats would only spin).
fn instance_lost(shared: &Shared) -> bool {
    // Acquire: pairs with the Release in `set_fatal`.
    shared.has_fatal.load(Ordering::Acquire)
}

fn heartbeat_due(shared: &Shared) -> bool {
    if instance_lost(shared) {
        return false;
    }
    // Relaxed: a scheduling hint.
    let idle = shared
        .now_ms()
        .saturating_sub(shared.last_sent_ms.load(Ordering::Relaxed));
    idle >= lease_ms(shared) / 3
}

fn next_wait(shared: &Shared) -> Duration {
    if instance_lost(shared) {
        return TICK;
    }
    // Relaxed: a scheduling hint.
    let idle = shared
        .now_ms()
        .saturating_sub(shared.last_sent_ms.load(Ordering::Relaxed));
    let to_heartbeat = (lease_ms(shared) / 3).saturating_sub(idle);
    TICK.min(Duration::from_millis(to_heartbeat.max(1)))
}

fn heartbeat(shared: &Shared) {
    shared.stats.bump(&shared.stats.heartbeats);
    let mut msg = Heartbeat {
        meta: Default::default(),
    };
    if let Err(e) = shared.read_call::<_, HeartbeatReply, _>("heartbeat", &mut msg, |_| Ok(())) {
        tracing::warn!(error = %e.with_causes(), "heartbeat failed");
    }
}

fn housekeeping(shared: &Shared, now_ms: u64) {
    let layouts: Vec<Arc<LayoutState>> = shared.layouts.read().clone();
    for layout in &layouts {
        pick_idle_regions(shared, layout, now_ms);
    }
    for (_, peer) in shared.peers.take_unreachable() {
        shared.retired.push(Arc::clone(&peer.mapping));
    }
    for layout in &layouts {
        // Regions handed back together are out of the table until they are
        // returned or put back (still found by `find_owned` and presented
        // by a reattach: they are away): those a thread touched meanwhile
        // (a page allocated, perhaps registered and already deleted, its
        // notice on its way) go back first, before any return's round trip
        // delays them.
        let mut to_return = Vec::new();
        for (id, region) in layout.regions.take_unreachable() {
            if !layout.is_away(id) {
                shared.retired.push(Arc::clone(&region.mapping));
            } else if let Some(region) = put_back_if_touched(shared, layout, id, region) {
                to_return.push((id, region));
            }
        }
        for (id, region) in to_return {
            finish_return(shared, layout, id, region);
        }
    }
    shared.retired.sweep();
    if shared.unresolved_batches() > 0 {
        shared.resolve_unresolved();
    }
    if shared.unresolved_region_requests() > 0 {
        shared.resolve_region_requests();
    }
}

/// Marks regions beyond the initial reservation whose pages are all free;
/// takes those idle long enough out of the allocation table (they are away,
/// see [`super::layout::Away`]).
fn pick_idle_regions(shared: &Shared, layout: &LayoutState, now_ms: u64) {
    let idle_ms = shared.cfg.idle_region_return_ms;
    let mut due = Vec::new();
    for (id, r) in layout.regions.read().iter() {
        if r.initial {
            continue;
        }
        // Relaxed: maintenance-thread-only bookkeeping.
        if r.alloc.free_pages() == r.alloc.page_count() {
            let since = r.idle_since_ms.load(Ordering::Relaxed);
            if since == 0 {
                r.idle_since_ms.store(now_ms.max(1), Ordering::Relaxed);
            } else if now_ms.saturating_sub(since) >= idle_ms {
                due.push(id);
            }
        } else {
            r.idle_since_ms.store(0, Ordering::Relaxed);
        }
    }
    for id in due {
        layout.take_away(id);
    }
}

/// A region taken out for return is unreachable now. Retires it if it was
/// revoked, puts it back if a thread touched it since it was picked (a
/// lease, a page in use); returns it for [`finish_return`] if it is still
/// entirely free and held by no one else.
fn put_back_if_touched(
    shared: &Shared,
    layout: &LayoutState,
    id: RegionId,
    region: Arc<OwnedRegion>,
) -> Option<Arc<OwnedRegion>> {
    // Acquire: pairs with the Release that revokes a refused region (it is
    // no longer ours to return or to put back).
    if region.revoked.load(Ordering::Acquire) {
        layout.forget_away(id);
        give_up_revoked(shared, &region);
        return None;
    }
    // Ours, and the away list's: any other reference is a thread's.
    let untouched =
        Arc::strong_count(&region) == 2 && region.alloc.free_pages() == region.alloc.page_count();
    if untouched {
        Some(region)
    } else {
        #[cfg(test)]
        if let Some(hook) = shared.before_put_back.take() {
            hook();
        }
        put_back(shared, layout, id, region);
        None
    }
}

fn put_back(shared: &Shared, layout: &LayoutState, id: RegionId, region: Arc<OwnedRegion>) {
    region.idle_since_ms.store(0, Ordering::Relaxed);
    match layout.put_back(id, region) {
        Ok(()) => {}
        Err(PutBackRefused::Revoked(region)) => {
            tracing::warn!(
                region = %id,
                "a region being returned was refused at a reattach; retiring it"
            );
            give_up_revoked(shared, &region);
        }
        Err(PutBackRefused::Table(error, region)) => {
            tracing::error!(region = %id, %error, "cannot put a region back; retiring it");
            shared.retired.push(Arc::clone(&region.mapping));
        }
    }
}

/// A region revoked while away (`Shared::drop_owned_regions` leaves its
/// bytes to the maintenance thread, which lets go of it here, once).
fn give_up_revoked(shared: &Shared, region: &OwnedRegion) {
    // Relaxed: a gauge.
    shared
        .owned_bytes
        .fetch_sub(region.desc.len_bytes, Ordering::Relaxed);
    shared.retired.push(Arc::clone(&region.mapping));
}

/// Gives back a region [`put_back_if_touched`] found untouched (no thread
/// can reach it any more, so nothing can touch it now). It stays away
/// meanwhile: a reattach during the round trip presents it, so a restarted
/// directory keeps it for us, and revokes it if refused. A return that may
/// have run (its answer lost) or that the directory refused as not ours
/// retires the region: the directory may have freed it and the pool
/// manager granted it to another instance, whose pages we must never
/// write. One whose return failed with the region still ours (refused as
/// in use, or never sent) goes back into the table — unless a reattach
/// revoked it meanwhile.
fn finish_return(shared: &Shared, layout: &LayoutState, id: RegionId, region: Arc<OwnedRegion>) {
    // No longer this client's to use: its mapping retires.
    let give_up = |counter| {
        layout.forget_away(id);
        // Relaxed: a gauge.
        shared
            .owned_bytes
            .fetch_sub(region.desc.len_bytes, Ordering::Relaxed);
        shared.stats.bump(counter);
        shared.retired.push(Arc::clone(&region.mapping));
    };
    // Nothing of ours may stay dirty in this host's cache once the region
    // can be another host's (non-coherent pools only).
    region.write_back_all();
    #[cfg(test)]
    if let Some(hook) = shared.before_return.take() {
        hook();
    }
    match shared.return_region(id.0) {
        Ok(()) => give_up(&shared.stats.regions_returned),
        Err(f) if f.still_ours => {
            tracing::debug!(region = %id, error = %f.error, "returning an idle region failed");
            put_back(shared, layout, id, region);
        }
        Err(f) => {
            tracing::warn!(
                region = %id,
                error = %f.error,
                "returning an idle region had no certain outcome: retiring it (never written again)"
            );
            give_up(&shared.stats.regions_retired);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cxlkv_dataplane::ids::RegionId;
    use parking_lot::Mutex;

    use crate::client::{
        Client, ClientConfig, LayoutHandle, LayoutOptions, PageLease, RegisterOutcome,
    };
    use crate::server::{Server, ServerConfig, ServerHandle};

    /// A server on a pool that outlives it (so that it can be restarted on
    /// it), a client returning idle regions after 50 ms, and a 4 KiB layout
    /// with one initial region (never returned).
    /// Dropping it stops the server and removes the pool and its state.
    struct Returning {
        cfg: ServerConfig,
        server: Arc<Mutex<Option<ServerHandle>>>,
        client: Option<(Client, LayoutHandle)>,
    }

    impl Returning {
        fn start(tag: &str, tune: impl FnOnce(&mut ClientConfig)) -> Self {
            let mut cfg = ServerConfig::ephemeral(tag);
            cfg.pool_size_bytes = 64 << 20;
            cfg.default_region_bytes = 4 << 20;
            cfg.remove_pool_on_shutdown = false;
            cfg.directory.session_lease = Duration::from_secs(30);
            cfg.directory.instance_grace = Duration::from_secs(60);
            let server = Server::start(cfg.clone()).expect("the server starts");
            let mut ccfg = ClientConfig::unix(server.socket_path());
            ccfg.idle_region_return_ms = 50;
            ccfg.request_timeout_ms = 300;
            tune(&mut ccfg);
            let client = Client::connect(ccfg).expect("connect");
            let opts = LayoutOptions {
                initial_reservation_bytes: 4 << 20,
                region_size_bytes: 4 << 20,
                auto_expand: true,
            };
            let layout = client.layout_with(4096, 7, opts).expect("a layout");
            Self {
                cfg,
                server: Arc::new(Mutex::new(Some(server))),
                client: Some((client, layout)),
            }
        }

        fn client(&self) -> &Client {
            &self.client.as_ref().expect("connected").0
        }

        fn layout(&self) -> &LayoutHandle {
            &self.client.as_ref().expect("connected").1
        }

        /// Regions the directory holds (for every instance).
        fn directory_regions(&self) -> u64 {
            let server = self.server.lock();
            let server = server.as_ref().expect("the server runs");
            server.directory_stats().expect("stats").regions
        }

        /// A second region of the layout (returnable), taken by allocating
        /// one page more than the initial region holds; that page is freed
        /// again, the initial region's stay allocated (returned: drop them
        /// before `self`).
        fn second_region(&self) -> (RegionId, Vec<PageLease>) {
            let mut leases: Vec<_> = (0..=1024)
                .map(|_| self.layout().alloc().expect("a page"))
                .collect();
            assert_eq!(self.layout().region_bytes(), 8 << 20);
            let last = leases.pop().expect("allocated");
            let second = last.location().region;
            assert!(leases.iter().all(|l| l.location().region != second));
            (RegionId(second), leases)
        }
    }

    impl Drop for Returning {
        fn drop(&mut self) {
            drop(self.client.take());
            if let Some(s) = self.server.lock().take() {
                let _ = s.shutdown();
            }
            self.cfg.remove_pool_on_shutdown = true;
            if let Ok(s) = Server::start(self.cfg.clone()) {
                let _ = s.shutdown();
            }
        }
    }

    fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while !done() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Found by a review of the client (session 25): a region out of its
    /// table for return was left out of `Reattach`, so a restarted directory
    /// freed it (it frees every recovered region nobody presents). The
    /// return then failed before it was sent — another thread held the
    /// reconnect lock past `reconnect_timeout_ms` — which counts as
    /// "still ours", and the region went back into use: a page of it was
    /// leased, written and registered in a region the pool manager had
    /// taken back (and may grant to another instance). Regions being
    /// returned are presented now, so the reattach keeps them.
    #[test]
    fn a_region_being_returned_is_presented_at_a_reattach_and_stays_the_instances() {
        let t = Returning::start("return-reattach", |cfg| {
            cfg.reconnect_timeout_ms = 500;
        });
        let (region, _initial_full) = t.second_region();
        assert_eq!(t.directory_regions(), 2);
        let shared = Arc::clone(t.layout().shared());
        let reattacher = Arc::new(Mutex::new(None));
        let (slot, cfg, done) = (
            Arc::clone(&t.server),
            t.cfg.clone(),
            Arc::clone(&reattacher),
        );
        let hook_shared = Arc::clone(&shared);
        // Run by the maintenance thread with the idle region out of its
        // table, before its `ReturnRegion`: the directory restarts, and
        // another thread reattaches — holding the reconnect lock for longer
        // than this thread will wait for it.
        shared.before_return.set(move || {
            let old = slot.lock().take().expect("the server runs");
            old.shutdown().expect("the server stops");
            *slot.lock() = Some(Server::start(cfg).expect("the server restarts"));
            let (answered, reattached) = std::sync::mpsc::channel();
            hook_shared.before_repin.set(move || {
                let _ = answered.send(());
                std::thread::sleep(Duration::from_millis(1500));
            });
            let conn_no = hook_shared.conn().expect("open").conn_no;
            let s = Arc::clone(&hook_shared);
            *done.lock() = Some(std::thread::spawn(move || s.reconnect(conn_no)));
            reattached
                .recv_timeout(Duration::from_secs(20))
                .expect("the reattach was answered");
        });
        assert!(
            wait_until(Duration::from_secs(20), || reattacher.lock().is_some()),
            "the fail point ran"
        );
        // The return failed unsent: the region is back in the table. A page
        // of it keeps it from being picked again (the initial region is
        // full).
        assert!(
            wait_until(Duration::from_secs(20), || t.layout().region_bytes()
                == 8 << 20),
            "the region was put back: {:?}",
            t.client().stats()
        );
        let mut lease = t.layout().alloc().expect("a page of the region put back");
        assert_eq!(lease.location().region, region.0);
        let joined = reattacher.lock().take().expect("spawned").join();
        joined.expect("no panic").expect("the reattach succeeded");
        assert_eq!(
            t.directory_regions(),
            2,
            "the restarted directory freed the region the client still uses"
        );
        lease.write(b"bytes").unwrap();
        let outcome = t.layout().register(b"k", lease);
        assert!(
            matches!(outcome, Ok(RegisterOutcome::Inserted)),
            "{outcome:?}"
        );
        drop(shared);
    }

    /// Found with the above: a region refused at a reattach while away
    /// for return was not revoked (only the table's were), and a return
    /// that then failed unsent put it back into use. It is revoked where it
    /// is now, and a revoked region is never put back.
    #[test]
    fn a_region_refused_at_a_reattach_while_away_is_never_put_back() {
        let t = Returning::start("return-refused", |cfg| {
            cfg.reconnect_timeout_ms = 300;
        });
        let (region, _initial_full) = t.second_region();
        let shared = Arc::clone(t.layout().shared());
        let blocker = Arc::new(Mutex::new(None));
        let (hook_shared, hook_blocker) = (Arc::clone(&shared), Arc::clone(&blocker));
        // Run by the maintenance thread before the return: the region is
        // refused (as by a reattach), and the return cannot be sent (the
        // connection is dead and another thread holds the reconnect lock
        // past `reconnect_timeout_ms`).
        shared.before_return.set(move || {
            hook_shared.drop_owned_regions(&[region.0]);
            let (locked, held) = std::sync::mpsc::channel();
            let s = Arc::clone(&hook_shared);
            *hook_blocker.lock() = Some(std::thread::spawn(move || {
                let _serial = s.reconnect_lock.lock();
                let _ = locked.send(());
                std::thread::sleep(Duration::from_millis(1000));
            }));
            held.recv_timeout(Duration::from_secs(10)).expect("locked");
            let conn = hook_shared.conn().expect("open");
            conn.dead.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let bytes_before = shared
            .owned_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            wait_until(Duration::from_secs(20), || blocker.lock().is_some()),
            "the fail point ran"
        );
        blocker.lock().take().expect("spawned").join().unwrap();
        assert!(
            wait_until(Duration::from_secs(5), || t
                .layout()
                .state
                .away
                .lock()
                .is_empty()),
            "the maintenance thread let go of the region"
        );
        assert_eq!(t.layout().region_bytes(), 4 << 20, "not put back");
        assert_eq!(
            shared
                .owned_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            bytes_before - (4 << 20),
            "its bytes counted off once"
        );
        assert_eq!(
            t.client().stats().regions_returned,
            0,
            "the refused region was put back (and returned by a later tick)"
        );
        drop(shared);
    }

    /// Found by a review of the client (session 25): between the table
    /// handing back a region taken out for return and the maintenance
    /// thread putting it back (a thread had touched it), `find_owned` saw it
    /// nowhere — so a freed-page notice for one of its pages arriving then
    /// was counted as `notices_unknown_region` and the page never freed.
    #[test]
    fn a_region_on_its_way_back_into_the_table_is_found_for_a_notice() {
        let t = Returning::start("return-put-back", |_| {});
        let (region, _initial_full) = t.second_region();
        // Holding the region makes it "touched": it goes back into the table.
        let held = t
            .layout()
            .state
            .regions
            .with(region, Arc::clone)
            .expect("in the table");
        let shared = Arc::clone(t.layout().shared());
        let seen = Arc::new(Mutex::new(None));
        let (hook_shared, hook_seen) = (Arc::clone(&shared), Arc::clone(&seen));
        shared.before_put_back.set(move || {
            *hook_seen.lock() = Some(hook_shared.find_owned(region.0).is_some());
        });
        assert!(
            wait_until(Duration::from_secs(20), || seen.lock().is_some()),
            "the fail point ran"
        );
        assert_eq!(*seen.lock(), Some(true), "the region was found nowhere");
        drop(held);
        drop(shared);
    }
}
