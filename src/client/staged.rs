//! Client operations for the L1 tier ([`crate::tier`]): pins that outlive
//! any guard, released synchronously with counts; raw views of pages the
//! tier holds across calls; the usage figures the tier reports.
//!
//! The plain API ties a pin to a [`ReadGuard`](super::ReadGuard) and defers
//! its release. The tier's protocol is different: `reserve_read` takes `T`
//! pins per key in one lookup, the engine releases them in any split across
//! later `finish_read` calls, and `finish_read` must have released them
//! *before it returns*, so that a `delete` that follows — from this process
//! or any other — sees them gone (but for an unpin that cannot be
//! delivered, or whose connection broke: its session is ended, and the pins
//! go when the server sees that connection close). Hence:
//!
//! - [`LayoutHandle::lookup_pinned`]: one `Lookup` taking `pins` pins per
//!   found key, resolved to in-place views (peer regions mapped on the way).
//!   The pins go into the client's ledger of live pins (so a reconnect takes
//!   them again on the new session, as it does for guards) and nothing
//!   releases them on drop. A key whose page cannot be mapped has its pins
//!   released within the call.
//! - [`LayoutHandle::release_pins`]: the synchronous, counted release. The
//!   counts are taken out of the ledger and the `Unpin`s are started on the
//!   current connection under the ledger's lock — so a concurrent reconnect
//!   either sees the pins (and takes them again before this runs) or does
//!   not (and they are released here) — then awaited. A release whose
//!   connection broke is dropped: the pins died with that session, and
//!   sending it on the next session could release a pin taken again for
//!   someone else.
//!
//! **Reconnects racing a lookup.** The pins of a lookup enter the ledger
//! after its reply; a reconnect in between would re-pin the ledger without
//! them while ending the session that holds them. So a lookup whose reply
//! came on a connection that is no longer current when its pins enter the
//! ledger ends the session once more, and the reattach takes every ledger
//! pin again, its own included. Between the first session's end and those
//! new pins nothing protected the keys: one may have been deleted (and
//! written again elsewhere). Such a key — the reattach did not find it
//! where the lookup did, or no reattach completed — is answered
//! [`PinnedLookup::PinsLost`], never served: its page may already be
//! another key's. The window is the few microseconds between a reply and
//! the ledger; a lookup sent after a reconnect is served by the new
//! connection and never triggers this.
//!
//! **Unknown outcomes end the session.** A pinning lookup or an unpin whose
//! every attempt went unanswered may or may not have taken effect: pins may
//! be held that nobody will release. Both answer it by ending the session
//! (the connection is marked dead and replaced by a reattach): the
//! directory drops every pin of the old session, and the reattach takes
//! again exactly the pins the ledger says are live. No pin leaks, whatever
//! the network lost. An unpin that cannot be sent at all — no sequence
//! number came free within the request timeout, or the connection has no
//! room in flight — is answered the same way, its pins taken out of the
//! ledger first: otherwise the session, which lives on, would hold them
//! for good (the rule of `Shared::give_up_unpins` on the plain path).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cxlkv_controlplane::frame::Frame;
use cxlkv_controlplane::proto::{
    self, ArchivedDirectoryReply, ErrorCode, Location, LookupReply, Message, RegionDesc,
    RequestMeta, Unpin, UnpinReply,
};
use cxlkv_controlplane::transport::{ClientError as TransportError, PendingCall};
use cxlkv_dataplane::map::MappedRegion;
use cxlkv_dataplane::visibility;

use super::error::ClientError;
use super::layout::LayoutHandle;
use super::lease::PageLease;
use super::rpc::{Encoded, Fail, Mode, StartedUnpin, max_pins_per_key, not_held_pins};
use super::shared::{Conn, Shared};

thread_local! {
    /// The connection (`Conn::conn_no`) whose reply the exchange on this
    /// thread handed to its caller last: a pinning lookup's pins belong to
    /// that connection's session.
    pub(crate) static SERVED_BY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// Test fail point (the reference's `resolve_none`): this many next
    /// placements on this thread fail as if the page's region could not be
    /// mapped.
    pub(crate) static FAIL_PLACEMENTS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Test fail point (the reference's short reply): the next pinning
    /// lookup's reply on this thread is read as one location short.
    pub(crate) static SHORT_LOOKUP_REPLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Test fail point: this many next placements of a write lease on this
    /// thread fail as if its region had been taken from the layout (refused
    /// at a reattach).
    pub(crate) static FAIL_LEASE_PLACEMENTS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Test fail point: runs once in the next pinning lookup on this thread,
    /// after its reply came and before its pins are counted (where another
    /// thread's reconnect can fall).
    pub(crate) static BEFORE_COUNTING_PINS: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

/// The error of a pinning lookup that failed, after making sure no pin it
/// may have taken outlives it: pins the directory may hold that no reply
/// told us about would last as long as the session, so the session is ended
/// and they go with it (the reattach takes the live views' pins again).
/// That is the case when the reply was lost, and when it came well formed
/// but could not be read (a `BadReply` from the caller's check of it).
///
/// A lookup that went unanswered has already spent its attempts on a
/// server that may be hung: its session is ended, but the reattach is left
/// to the maintenance thread (or the next request), so that the call fails
/// after its own attempts — not after a whole `reconnect_timeout_ms` more
/// of reattaching to the same silent server.
pub(crate) fn pinning_lookup_failed(shared: &Shared, fail: Fail) -> ClientError {
    match fail {
        Fail::Indeterminate(e) => {
            shared.end_session_in_background("a pinning lookup went unanswered");
            e
        }
        Fail::Definite(e @ ClientError::BadReply { op: "lookup", .. }) => {
            shared.end_session("a pinning lookup's reply could not be read");
            e
        }
        // A refusal took no pin. `Void` only without `renew_void`: the
        // directory that may have taken pins restarted, and its pins went
        // with it.
        f => f.into_error(),
    }
}

/// A chunk in place in the pool: the mapping that holds it (kept mapped
/// while this lives), where it is, and the layout's page size.
#[derive(Debug, Clone)]
pub(crate) struct PlacedPage {
    pub mapping: Arc<MappedRegion>,
    pub location: Location,
    pub page_size_bytes: usize,
}

/// What a pinning lookup found for one key.
#[derive(Debug)]
pub(crate) enum PinnedLookup {
    /// Found, `pins` pins taken (recorded in the ledger), view resolved.
    Found(PlacedPage),
    /// Not registered: no pin taken.
    Missing,
    /// Registered, but its page could not be mapped here: the pins were
    /// released again within the call.
    Unresolvable(ClientError),
    /// Found, but a reconnect raced the lookup and its pins could not be
    /// shown to be held again — the reattach found the key deleted or
    /// moved, or none completed (see the module docs): nothing protects the
    /// page, so it is not served. The pins are out of the ledger; none is
    /// left to release.
    PinsLost,
}

/// A pinning lookup's answer: one result per key, in order, and the
/// release of the pins it took on keys it could not place (`None` when
/// there were none).
#[derive(Debug)]
pub(crate) struct PinnedLookups {
    pub found: Vec<PinnedLookup>,
    pub rollback: Option<Result<PinRelease, ClientError>>,
}

/// What a counted release did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PinRelease {
    /// Pins released by the directory.
    pub released: u64,
    /// Pins the directory did not hold for this session (it reported the
    /// key `NotPinned`).
    pub not_held: u64,
    /// Pins that died with a session before they could be released (not
    /// in the ledger any more, or the connection broke).
    pub lost_with_session: u64,
    /// `Unpin` round trips made.
    pub round_trips: u64,
}

impl LayoutHandle {
    /// One `Lookup` round trip taking `pins` pins on every key found (see the
    /// module docs); one result per key, in order, with the rollback's
    /// release for the caller to count. The caller owns the pins of the
    /// keys found and releases them with [`LayoutHandle::release_pins`].
    pub(crate) fn lookup_pinned<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        pins: u32,
    ) -> Result<PinnedLookups, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        // The directory's limit (at most the protocol's), checked here so
        // that an over-limit count is refused before it reaches the wire.
        let max_pins = max_pins_per_key(&shared.limits());
        if pins == 0 || pins > max_pins {
            return Err(ClientError::Config {
                field: "pins",
                reason: format!("{pins} is not in 1..={max_pins} (the directory's limit)"),
            });
        }
        let mut msg = proto::LookupFrom {
            meta: Default::default(),
            layout: self.state.layout,
            keys,
            pins,
        };
        let n = keys.len();
        let reply =
            shared.mutating_call::<_, LookupReply, _>("lookup", Mode::NORMAL, &mut msg, |reply| {
                #[allow(unused_mut)]
                let mut locations: Vec<Option<Location>> = reply.locations().collect();
                #[cfg(test)]
                if SHORT_LOOKUP_REPLY.take() {
                    locations.pop();
                }
                if locations.len() != n {
                    return Err(ClientError::BadReply {
                        op: "lookup",
                        source: proto::ProtoError::Malformed {
                            kind: proto::Kind::LookupReply,
                            len_bytes: 0,
                            detail: format!("{} locations for {n} keys", locations.len()),
                        },
                    });
                }
                Ok((locations, reply.regions().collect::<Vec<RegionDesc>>()))
            });
        let (locations, regions) = match reply {
            Ok(found) => found,
            Err(f) => return Err(pinning_lookup_failed(shared, f)),
        };
        #[cfg(test)]
        if let Some(hook) = BEFORE_COUNTING_PINS.take() {
            hook();
        }
        let served_by = SERVED_BY.get();
        let (raced, counted_on) = {
            let mut ledger = shared.live_pins.lock();
            for (key, location) in keys.iter().zip(&locations) {
                if let Some(location) = location {
                    ledger.count(self.state.ix, key.as_ref(), pins, *location);
                }
            }
            // Under the ledger lock: a reattach that replaces the
            // connection from now on re-pins these too.
            let current = shared.conn().map(|c| c.conn_no).ok();
            (current != Some(served_by), current)
        };
        let mut lost = vec![false; n];
        if raced {
            // The session that took these pins was replaced after the reply
            // came, and its reattach may have re-pinned the ledger before
            // they were in it. End the session once more: the reattach takes
            // every ledger pin again, these included — or finds the key
            // gone or moved, and then these views are not served.
            shared.end_session("a reconnect raced a pinning lookup");
            lost = self.forget_raced_pins(keys, &locations, pins, counted_on);
        }
        let mut out = Vec::with_capacity(n);
        let mut rollback: Vec<(&[u8], u64)> = Vec::new();
        for ((key, location), lost) in keys.iter().zip(locations).zip(lost) {
            let Some(location) = location else {
                out.push(PinnedLookup::Missing);
                continue;
            };
            if lost {
                out.push(PinnedLookup::PinsLost);
                continue;
            }
            match self.place(location, &regions) {
                Ok(page) => out.push(PinnedLookup::Found(page)),
                Err(e) => {
                    rollback.push((key.as_ref(), u64::from(pins)));
                    out.push(PinnedLookup::Unresolvable(e));
                }
            }
        }
        // Best effort, like every release: the caller counts or logs it.
        let rollback = (!rollback.is_empty()).then(|| self.release_pins(&rollback));
        Ok(PinnedLookups {
            found: out,
            rollback,
        })
    }

    /// After a raced lookup ended its session once more (see the module
    /// docs): for each key, whether its pins are lost — true unless a
    /// reattach completed after the pins were counted (connection newer
    /// than `counted_on`, published under the ledger lock after its re-pin)
    /// and still has the key's pinned views at the location this lookup
    /// found (a re-pin that finds a key deleted or moved takes its count
    /// out of the ledger and forgets where it was). The pins of a lost key
    /// are taken out of the ledger, since no view will release them:
    /// first from the orphans (the re-pin moved them there), then from the
    /// held count (no re-pin ran yet: they must not be taken again). One
    /// session's pins on a key are interchangeable, so taking the count
    /// from either keeps the ledger's total equal to the live views'.
    fn forget_raced_pins<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        locations: &[Option<Location>],
        pins: u32,
        counted_on: Option<u64>,
    ) -> Vec<bool> {
        let shared = self.shared();
        let mut ledger = shared.live_pins.lock();
        let repinned = shared
            .conn()
            .is_ok_and(|c| c.usable() && counted_on.is_none_or(|no| c.conn_no > no));
        keys.iter()
            .zip(locations)
            .map(|(key, location)| {
                let Some(location) = location else {
                    return false;
                };
                let k = (self.state.ix, Box::<[u8]>::from(key.as_ref()));
                if repinned && ledger.at.get(&k) == Some(location) {
                    return false;
                }
                let n = u64::from(pins);
                let orphaned = super::read::take_count(&mut ledger.orphans, &k, n);
                ledger.take_held(&k, n - orphaned);
                tracing::warn!(
                    key_len_bytes = k.1.len(),
                    "a reconnect raced a pinning lookup and its pins were not taken again; \
                     the key is not served"
                );
                true
            })
            .collect()
    }

    /// The view of a found location: the layout's own region, a cached peer
    /// region, or a peer region mapped now; its bytes acquired (a fence, or
    /// an invalidation on a `Flush` pool) so they are the writer's.
    fn place(&self, location: Location, regions: &[RegionDesc]) -> Result<PlacedPage, ClientError> {
        #[cfg(test)]
        if FAIL_PLACEMENTS.with(|n| n.replace(n.get().saturating_sub(1)) > 0) {
            return Err(ClientError::Pool {
                pool: 0,
                reason: format!("fail point: region {} cannot be mapped", location.region),
            });
        }
        let shared = self.shared();
        let desc = regions.iter().find(|d| d.region == location.region);
        let (mapping, mode) = shared.resolve_region(&self.state, location.region, desc)?;
        let page_size_bytes = self.state.page_size_bytes;
        let view = mapping.page(
            page_size_bytes,
            location.page_index(),
            location.len_bytes as usize,
        )?;
        visibility::acquire(mode, view.as_bytes());
        Ok(PlacedPage {
            mapping,
            location,
            page_size_bytes,
        })
    }

    /// Releases `count` pins of each `(key, count)` now and waits for the
    /// directory's answers (see the module docs). A key may appear more than
    /// once; counts above the session's per-entry limit are split, and
    /// messages carry at most its `max_batch` entries.
    pub(crate) fn release_pins(&self, items: &[(&[u8], u64)]) -> Result<PinRelease, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        let mut report = PinRelease::default();
        let limits = shared.limits();
        let per_entry = u64::from(max_pins_per_key(&limits));
        let max_batch = (limits.max_batch as usize).clamp(1, proto::MAX_BATCH);
        // Upper bound of the messages needed, so that every ticket is taken
        // before the ledger is locked (a reconnect needs that lock and the
        // tickets of in-flight requests).
        let entries_bound: u64 = items
            .iter()
            .map(|(_, n)| n.div_ceil(per_entry).max(1))
            .sum();
        let messages = (entries_bound as usize).div_ceil(max_batch);
        let mut tickets = Vec::with_capacity(messages);
        let mut no_room = None;
        for _ in 0..messages {
            match shared.ticket() {
                Ok(t) => tickets.push(t),
                Err(f) => {
                    for t in tickets.drain(..) {
                        shared.seqs.release(t);
                    }
                    no_room = Some(f.into_error());
                    break;
                }
            }
        }
        let (conn, started) = {
            let mut ledger = shared.live_pins.lock();
            // One `(keys, counts)` per message, at most `max_batch` entries.
            let mut batches: Vec<(Vec<Vec<u8>>, Vec<u32>)> = Vec::new();
            for (key, wanted) in items {
                let k = (self.state.ix, Box::<[u8]>::from(*key));
                // Holds whose pins were lost release nothing (see
                // `PinLedger::orphans`); the rest release pins held.
                let orphaned = super::read::take_count(&mut ledger.orphans, &k, *wanted);
                let take = ledger.take_held(&k, wanted - orphaned);
                report.lost_with_session += wanted - take;
                if take == 0 {
                    continue;
                }
                let mut left = take;
                while left > 0 {
                    let c = left.min(per_entry);
                    if batches
                        .last()
                        .is_none_or(|(keys, _)| keys.len() >= max_batch)
                    {
                        batches.push((Vec::new(), Vec::new()));
                    }
                    let (keys, counts) = batches
                        .last_mut()
                        .expect("invariant: a batch with room was just ensured");
                    keys.push(key.to_vec());
                    counts.push(c as u32);
                    left -= c;
                }
            }
            let taken: u64 = batches
                .iter()
                .flat_map(|(_, counts)| counts)
                .map(|&c| u64::from(c))
                .sum();
            if let Some(e) = no_room {
                // No sequence number came free in time: the unpins cannot
                // be sent, and the session would hold the pins as long as
                // it lives (and every reattach would take them again, were
                // they still in the ledger). Out of the ledger now, they
                // die with the session, ended here — as a plain unpin given
                // up (`Shared::give_up_unpins`).
                drop(ledger);
                report.lost_with_session += taken;
                shared.stats.add(&shared.stats.unpins_dropped, taken);
                if taken > 0 {
                    tracing::warn!(error = %e.with_causes(), pins = taken, "unpins could not be numbered");
                    shared.end_session("unpins could not be numbered");
                }
                return Ok(report);
            }
            let conn = match shared.conn() {
                Ok(c) if c.usable() => c,
                _ => {
                    // Out of the ledger and the session is gone (or going):
                    // the pins die with it and are never taken again.
                    report.lost_with_session += taken;
                    shared.stats.add(&shared.stats.unpins_dropped, taken);
                    drop(ledger);
                    for t in tickets {
                        shared.seqs.release(t);
                    }
                    return Ok(report);
                }
            };
            let mut started = Vec::new();
            let mut tickets = tickets.into_iter();
            for (keys, counts) in batches {
                let ticket = tickets
                    .next()
                    .expect("invariant: one ticket per message was taken above");
                let msg = Unpin {
                    meta: RequestMeta {
                        seq: ticket.seq,
                        notice_ack: shared.notice_ack(),
                        replies_received_below: shared.seqs.received_below(),
                    },
                    layout: self.state.layout,
                    keys,
                    counts,
                };
                let encoded = match Encoded::new(&msg) {
                    Ok(e) => e,
                    Err(e) => {
                        shared.seqs.release(ticket);
                        for t in tickets {
                            shared.seqs.release(t);
                        }
                        drop(ledger);
                        shared.end_session("an unpin could not be encoded");
                        return Err(e);
                    }
                };
                shared.stats.bump(&shared.stats.requests);
                shared.stats.bump(&shared.stats.unpin_batches);
                // Relaxed: a heartbeat-scheduling hint.
                shared
                    .last_sent_ms
                    .store(shared.now_ms(), Ordering::Relaxed);
                let call = conn.rpc.start(
                    <Unpin as Message>::KIND.as_u16(),
                    encoded.payload(),
                    shared.request_timeout(),
                );
                started.push(StartedUnpin {
                    ticket,
                    call,
                    encoded,
                    counts: msg.counts,
                });
            }
            for t in tickets {
                shared.seqs.release(t);
            }
            (conn, started)
        };
        let mut undelivered = false;
        for s in started {
            report.round_trips += 1;
            let pins: u64 = s.counts.iter().map(|&c| u64::from(c)).sum();
            match shared.await_unpin(&conn, s.call, &s.encoded, &s.counts) {
                UnpinAnswer::Answered { not_held_pins } => {
                    report.not_held += not_held_pins;
                    report.released += pins - not_held_pins;
                }
                UnpinAnswer::SessionGone => {
                    report.lost_with_session += pins;
                    shared.stats.add(&shared.stats.unpins_dropped, pins);
                }
                UnpinAnswer::Undelivered => {
                    undelivered = true;
                    report.lost_with_session += pins;
                    shared.stats.add(&shared.stats.unpins_dropped, pins);
                }
            }
            shared.seqs.release(s.ticket);
        }
        if undelivered {
            shared.end_session("an unpin was not delivered");
        }
        Ok(report)
    }

    /// A writable lease's page as a placed page (the tier hands out its
    /// pointer for the engine to fill in place). Marks the lease as written,
    /// so registration publishes it.
    pub(crate) fn place_lease(&self, lease: &mut PageLease) -> Result<PlacedPage, ClientError> {
        #[cfg(test)]
        if FAIL_LEASE_PLACEMENTS.with(|n| n.replace(n.get().saturating_sub(1)) > 0) {
            return Err(ClientError::RegionRevoked {
                region: cxlkv_dataplane::ids::RegionId(lease.location().region),
            });
        }
        // The engine writes through the pointer, which the lease cannot see:
        // taking the view is what marks it as needing publication. It fails
        // if the region was revoked (refused at a reattach).
        lease.bytes_mut()?;
        let location = lease.location();
        let region = cxlkv_dataplane::ids::RegionId(location.region);
        let mapping = self
            .state
            .regions
            .with(region, |r| Arc::clone(&r.mapping))
            .ok_or(ClientError::RegionRevoked { region })?;
        Ok(PlacedPage {
            mapping,
            location,
            page_size_bytes: self.state.page_size_bytes,
        })
    }

    /// The pages of this layout's owned regions — the only ones it
    /// allocates from, so what its tier reports as used and usable — and
    /// the bytes of every region the client owns, whatever its layout (what
    /// the quotas count).
    pub(crate) fn layout_pages(&self) -> LayoutPages {
        let mut pages = LayoutPages::default();
        for layout in self.shared().layouts.read().iter() {
            let own = layout.ix == self.state.ix;
            for (_, r) in layout.regions.read().iter() {
                pages.client_region_bytes += r.desc.len_bytes;
                if !own {
                    continue;
                }
                let total = u64::from(r.alloc.page_count());
                let free = u64::from(r.alloc.free_pages()).min(total);
                let page_size_bytes = r.page_size_bytes as u64;
                pages.used_bytes += (total - free) * page_size_bytes;
                pages.usable_bytes += total * page_size_bytes;
            }
        }
        pages
    }

    /// Why every request of this client fails from now on, if one does:
    /// [`ClientError::Closed`] after its close, or
    /// [`ClientError::ReconnectFailed`] once its instance cannot be resumed
    /// (a fatal refusal at reattach; the reason kept), or
    /// [`ClientError::Forked`] in a child forked from its process.
    pub(crate) fn client_unusable(&self) -> Option<ClientError> {
        self.shared().check_open().err()
    }

    /// This is a forked child's copy of the layout (`fork.rs`): nothing of
    /// it may be sent, released or joined here.
    pub(crate) fn in_forked_child(&self) -> bool {
        self.shared().owner.forked()
    }

    /// Bytes of each region this layout takes when it grows.
    pub(crate) fn region_size_bytes(&self) -> u64 {
        self.state.region_size_bytes()
    }

    /// Whether this layout takes a new region when it is full.
    pub(crate) fn auto_expands(&self) -> bool {
        self.state.auto_expand()
    }

    /// The client's configured cap on region bytes, if any.
    pub(crate) fn quota_bytes(&self) -> Option<u64> {
        self.shared().cfg.quota_bytes
    }
}

/// The pages of one layout's owned regions, in bytes, and the region bytes
/// of its client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LayoutPages {
    /// The layout's pages allocated × their page size.
    pub used_bytes: u64,
    /// The pages the layout's regions hold × their page size: what can ever
    /// be in use in them. Less than their bytes when a page size does not
    /// divide its region (the tail is never allocated).
    pub usable_bytes: u64,
    /// Bytes of every region the client owns, any layout (what the quota
    /// and the pool count).
    pub client_region_bytes: u64,
}

/// How one unpin ended.
enum UnpinAnswer {
    /// The directory answered; this many pins were not held.
    Answered { not_held_pins: u64 },
    /// The connection broke: the session's pins are gone with it.
    SessionGone,
    /// Not delivered on a connection that lives on — every attempt went
    /// unanswered, it was refused, or it could not be sent — so the
    /// session may still hold the pins: only its end releases them.
    Undelivered,
}

impl Shared {
    /// Waits for one started unpin, resending the same request (same
    /// sequence number: answered once) on the same connection after a
    /// timeout or a transient refusal, at most `max_retries` times.
    fn await_unpin(
        &self,
        conn: &Conn,
        call: Result<PendingCall, TransportError>,
        encoded: &Encoded,
        counts: &[u32],
    ) -> UnpinAnswer {
        let mut call = call;
        let mut attempts = 0;
        loop {
            let mut busy = false;
            let retry = match call.and_then(PendingCall::wait) {
                Ok(reply) => {
                    let frame = Frame {
                        header: reply.header,
                        payload: reply.payload(),
                    };
                    match proto::access_reply::<UnpinReply>(frame) {
                        Ok(Ok(r)) => {
                            self.absorb(r.reply_meta());
                            // Each `NotPinned` entry released nothing; count
                            // its pins from the request's counts.
                            let not_held_pins = not_held_pins(counts, r);
                            self.stats.add(&self.stats.unpins_not_held, not_held_pins);
                            return UnpinAnswer::Answered { not_held_pins };
                        }
                        Ok(Err(refusal)) => {
                            match ErrorCode::from_u16(refusal.code.to_native()) {
                                Some(c) if c.is_transient() => {
                                    busy = true;
                                    true
                                }
                                Some(ErrorCode::SessionEnded | ErrorCode::HelloRequired) => {
                                    // Relaxed: a hint for the next request,
                                    // which reattaches.
                                    conn.dead.store(true, Ordering::Relaxed);
                                    return UnpinAnswer::SessionGone;
                                }
                                // A refusal changed nothing; the session
                                // still holds the pins, which only its end
                                // can release now.
                                _ => return UnpinAnswer::Undelivered,
                            }
                        }
                        Err(_) => return UnpinAnswer::Undelivered,
                    }
                }
                Err(TransportError::Timeout { .. }) => true,
                // The connection broke: the pins went with its session.
                Err(TransportError::Closed { .. }) => return UnpinAnswer::SessionGone,
                Err(_) if !conn.usable() => return UnpinAnswer::SessionGone,
                // Not sent (no room in flight on the connection) or not
                // understood, on a connection that lives on: its session
                // still holds the pins.
                Err(_) => return UnpinAnswer::Undelivered,
            };
            attempts += 1;
            if !conn.usable() {
                return UnpinAnswer::SessionGone;
            }
            if !retry || attempts > self.cfg.max_retries {
                return UnpinAnswer::Undelivered;
            }
            self.stats.bump(&self.stats.retries);
            if busy {
                // As `Shared::finish_unpins`: a directory that said it is
                // busy is given a moment before the same request comes back.
                std::thread::sleep(super::rpc::backoff(attempts));
            }
            self.stats.bump(&self.stats.requests);
            call = conn.rpc.start(
                <Unpin as Message>::KIND.as_u16(),
                encoded.payload(),
                self.request_timeout(),
            );
        }
    }

    /// [`end_session`](Self::end_session) without waiting for the reattach:
    /// the connection is marked dead (no request is sent on it again) and
    /// the maintenance thread is woken to reattach, which drops the old
    /// connection and with it the session's pins; a request made before
    /// that reattaches itself.
    pub(crate) fn end_session_in_background(&self, why: &'static str) {
        if self.mark_session_dead(why).is_some() {
            self.wake_maintenance();
        }
    }

    /// Ends the current session so the directory drops every pin it holds,
    /// and reattaches now (the reattach takes the ledger's pins again). If
    /// the reattach fails, the next request retries it.
    pub(crate) fn end_session(&self, why: &'static str) {
        let Some(conn_no) = self.mark_session_dead(why) else {
            return;
        };
        if let Err(e) = self.reconnect(conn_no) {
            tracing::warn!(error = %e.with_causes(), "reattach after ending the session failed; the next request retries");
        }
    }

    /// Marks the current connection dead (no request is sent on it again),
    /// saying why; returns its number, or `None` if there is none.
    fn mark_session_dead(&self, why: &'static str) -> Option<u64> {
        let conn = self.conn().ok()?;
        tracing::warn!(
            reason = why,
            "ending the session to release pins of unknown state"
        );
        // Relaxed: a hint read by the maintenance thread and the next
        // request, which reconnect under the reconnect lock.
        conn.dead.store(true, Ordering::Relaxed);
        Some(conn.conn_no)
    }
}

impl LayoutHandle {
    /// Most keys one request of this session may carry.
    pub(crate) fn max_batch(&self) -> usize {
        (self.shared().limits().max_batch as usize).clamp(1, proto::MAX_BATCH)
    }

    /// Longest key this session accepts.
    pub(crate) fn max_key_bytes(&self) -> usize {
        (self.shared().limits().max_key_bytes as usize).min(proto::MAX_KEY_BYTES)
    }

    /// The client's latest piggybacked usage (no round trip).
    pub(crate) fn cached_usage(&self) -> proto::Usage {
        self.shared().usage.load()
    }
}
