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

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cxlkv_controlplane::proto::{Heartbeat, HeartbeatReply};
use cxlkv_dataplane::ids::RegionId;

use super::layout::LayoutState;
use super::regions::OwnedRegion;
use super::shared::Shared;

/// Housekeeping period.
const TICK: Duration = Duration::from_millis(100);

/// Runs until the client closes.
pub(crate) fn run(shared: Arc<Shared>) {
    let mut returning: HashSet<u64> = HashSet::new();
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
        if heartbeat_due(&shared) {
            heartbeat(&shared);
        }
        let now = shared.now_ms();
        if now.saturating_sub(last_tick_ms) >= TICK.as_millis() as u64 {
            last_tick_ms = now;
            housekeeping(&shared, &mut returning, now);
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

fn heartbeat_due(shared: &Shared) -> bool {
    // Relaxed: a scheduling hint.
    let idle = shared
        .now_ms()
        .saturating_sub(shared.last_sent_ms.load(Ordering::Relaxed));
    idle >= lease_ms(shared) / 3
}

fn next_wait(shared: &Shared) -> Duration {
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

fn housekeeping(shared: &Shared, returning: &mut HashSet<u64>, now_ms: u64) {
    let layouts: Vec<Arc<LayoutState>> = shared.layouts.read().clone();
    for layout in &layouts {
        pick_idle_regions(shared, layout, returning, now_ms);
    }
    for (_, peer) in shared.peers.take_unreachable() {
        shared.retired.push(Arc::clone(&peer.mapping));
    }
    for layout in &layouts {
        // Regions handed back together are out of every table until they
        // are returned or put back, where `find_owned` cannot see them:
        // those a thread touched meanwhile (a page allocated, perhaps
        // registered and already deleted, its notice on its way) go back
        // first, before any return's round trip delays them.
        let mut to_return = Vec::new();
        for (id, region) in layout.regions.take_unreachable() {
            if !returning.remove(&id.0) {
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
/// takes those idle long enough out of the allocation table.
fn pick_idle_regions(
    shared: &Shared,
    layout: &LayoutState,
    returning: &mut HashSet<u64>,
    now_ms: u64,
) {
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
        if layout.regions.remove(id).is_ok() {
            returning.insert(id.0);
        }
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
        shared.retired.push(Arc::clone(&region.mapping));
        return None;
    }
    let untouched =
        Arc::strong_count(&region) == 1 && region.alloc.free_pages() == region.alloc.page_count();
    if untouched {
        Some(region)
    } else {
        put_back(shared, layout, id, region);
        None
    }
}

fn put_back(shared: &Shared, layout: &LayoutState, id: RegionId, region: Arc<OwnedRegion>) {
    region.idle_since_ms.store(0, Ordering::Relaxed);
    if let Err(rejected) = layout.regions.insert(id, region) {
        tracing::error!(region = %id, error = %rejected, "cannot put a region back; retiring it");
        shared.retired.push(Arc::clone(&rejected.value.mapping));
    }
}

/// Gives back a region [`put_back_if_touched`] found untouched (no thread
/// can reach it any more, so nothing can touch it now). A return that may
/// have run (its answer lost) or that the directory refused as not ours
/// retires the region instead: the directory may have freed it and the pool
/// manager granted it to another instance, whose pages we must never write.
/// One the directory refused as still in use goes back into the table.
fn finish_return(shared: &Shared, layout: &LayoutState, id: RegionId, region: Arc<OwnedRegion>) {
    // No longer this client's to use: its mapping retires.
    let give_up = |counter| {
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
