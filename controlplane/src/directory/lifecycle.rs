//! Instances and sessions: `hello`, `reattach`, `heartbeat`, the end of a
//! session (connection closed, lease expired, admin), and the end of an
//! instance (grace expired, or taken over).

use std::collections::{HashMap, HashSet};

use cxlkv_dataplane::ids::RegionId;
use foldhash::fast::FixedState;

use super::error::DirectoryError;
use super::notices::NoticeQueue;
use super::regions::{Owner, Region};
use super::sequence::{CachedBody, ReplyWindow};
use super::sessions::{Instance, Session};
use super::types::{
    Caller, Effect, EndedSession, InstanceId, InstanceSecret, OpKind, Peer, ReattachKind,
    Reattached, RegionHandle, RegionStatus, Reply, Sequence, SessionEndReason, SessionId, Time,
    Welcome,
};
use super::{Directory, Fingerprint, Hello, MAX_SEQUENCE, Reattach};

/// Most processes an instance remembers as holders
/// (`Instance::holder_pids`); beyond them it cannot be taken over early.
const MAX_HOLDER_PIDS: usize = 16;

impl Directory {
    /// First contact of an instance: creates it (or takes over an instance of
    /// the same name that has no session, from the same principal, once
    /// every other process that held it has exited: `set_holder_probe`)
    /// with a fresh secret, and opens its first session.
    pub fn hello(
        &mut self,
        req: Hello<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Welcome, DirectoryError> {
        let r = self.hello_inner(req, peer, now);
        self.count_call(OpKind::Hello, 0, r.is_err());
        r
    }

    fn hello_inner(
        &mut self,
        req: Hello<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Welcome, DirectoryError> {
        self.check_peer(&peer)?;
        let id = InstanceId::new(req.instance)?;
        self.check_session_room()?;
        let takeover = match self.instance_ix.get(&id) {
            Some(&slot) => {
                let inst = self.instance(slot);
                if inst.is_present()
                    || inst.secret.is_none()
                    || inst.principal != Some(peer.principal())
                    || self.holder_may_live(inst, &peer)
                {
                    return Err(DirectoryError::InstanceIdInUse { instance: id });
                }
                Some(slot)
            }
            None => {
                self.check_instance_room()?;
                None
            }
        };
        if let Some(slot) = takeover {
            tracing::info!(instance = %id, "hello takes over an instance without sessions");
            self.instance_gone(slot, now);
        }
        let secret = InstanceSecret(self.rng.bytes32());
        let quota_bytes = self.effective_quota(req.quota_bytes);
        let window = self.config.reply_window;
        let slot = self.add_instance(Instance::new(
            id,
            Some(secret),
            Some(peer.principal()),
            quota_bytes,
            1,
            1,
            window,
            now,
        ));
        self.note_holder(slot, &peer);
        let session = self.open_session(slot, now);
        Ok(Welcome {
            session,
            secret,
            directory_epoch: self.epoch,
            quota_bytes,
            limits: self.limits(),
            usage: self.usage(slot),
        })
    }

    /// A new session of an existing instance. `Resumed` when the directory
    /// still has the instance (secret must match); `Recovered` when it does
    /// not (restart, or the instance was declared gone) — then regions
    /// recovered from the pool manager are claimed by presenting their tokens.
    pub fn reattach(
        &mut self,
        req: Reattach<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Reattached, DirectoryError> {
        let r = self.reattach_inner(req, peer, now);
        self.count_call(OpKind::Reattach, req.regions.len(), r.is_err());
        r
    }

    fn reattach_inner(
        &mut self,
        req: Reattach<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Reattached, DirectoryError> {
        self.check_peer(&peer)?;
        let id = InstanceId::new(req.instance)?;
        let max = self.config.max_regions_per_instance;
        if req.regions.len() > max {
            return Err(DirectoryError::TooManyReattachRegions {
                count: req.regions.len(),
                max,
            });
        }
        let mut ids = HashSet::with_capacity_and_hasher(req.regions.len(), FixedState::default());
        for p in req.regions {
            Self::check_layout(&p.layout)?;
            if !ids.insert(p.handle.region) {
                return Err(DirectoryError::DuplicateReattachRegion {
                    region: p.handle.region,
                });
            }
        }
        if req.next_seq == 0 {
            return Err(DirectoryError::InvalidNextSeq);
        }
        for (field, value) in [("next_seq", req.next_seq), ("notice_ack", req.notice_ack)] {
            if value > MAX_SEQUENCE {
                return Err(DirectoryError::SequenceOutOfRange {
                    field,
                    value,
                    max: MAX_SEQUENCE,
                });
            }
        }
        self.check_session_room()?;
        match self.instance_ix.get(&id).copied() {
            Some(slot) if self.instance(slot).secret.is_some() => self.resume(slot, req, peer, now),
            Some(slot) => self.claim_recovered(slot, req, peer, now),
            None => {
                self.check_instance_room()?;
                let quota = self.effective_quota(req.quota_bytes);
                let window = self.config.reply_window;
                let slot = self.add_instance(Instance::new(
                    id,
                    Some(req.secret),
                    Some(peer.principal()),
                    quota,
                    req.next_seq,
                    req.notice_ack.saturating_add(1),
                    window,
                    now,
                ));
                self.instance_mut(slot).recovery_unseen = true;
                let verdicts = vec![RegionStatus::NotOwned; req.regions.len()];
                Ok(self.reattached(slot, &peer, ReattachKind::Recovered, verdicts, now))
            }
        }
    }

    fn resume(
        &mut self,
        slot: u32,
        req: Reattach<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Reattached, DirectoryError> {
        let inst = self.instance(slot);
        let secret_ok = inst
            .secret
            .as_ref()
            .is_some_and(|s| s.constant_time_eq(&req.secret));
        if !secret_ok {
            return Err(DirectoryError::SecretMismatch {
                instance: inst.id.clone(),
            });
        }
        if inst.sessions.len() >= self.config.max_sessions_per_instance {
            return Err(DirectoryError::TooManyInstanceSessions {
                instance: inst.id.clone(),
                max: self.config.max_sessions_per_instance,
            });
        }
        if req.notice_ack > inst.notices.highest_issued() {
            return Err(DirectoryError::NoticeAckAhead {
                ack: req.notice_ack,
                highest_issued: inst.notices.highest_issued(),
            });
        }
        let verdicts = req
            .regions
            .iter()
            .map(|p| {
                let owned = self.regions.slot_of(p.handle.region).is_some_and(|rs| {
                    let r = self.regions.get(rs);
                    r.owner == Owner::Present(slot)
                        && r.handle.matches(&p.handle)
                        && self.layouts.layout(r.layout) == p.layout
                });
                if owned {
                    RegionStatus::Confirmed
                } else {
                    RegionStatus::NotOwned
                }
            })
            .collect();
        let inst = self.instance_mut(slot);
        inst.notices
            .ack(req.notice_ack)
            .expect("invariant: the acknowledgement was checked above");
        inst.principal = Some(peer.principal());
        // A recovery no session has acted on yet is answered as one again:
        // the answer that told of it may have been lost.
        let kind = if inst.recovery_unseen {
            ReattachKind::Recovered
        } else {
            ReattachKind::Resumed
        };
        Ok(self.reattached(slot, &peer, kind, verdicts, now))
    }

    fn claim_recovered(
        &mut self,
        slot: u32,
        req: Reattach<'_>,
        peer: Peer,
        now: Time,
    ) -> Result<Reattached, DirectoryError> {
        let inst = self.instance(slot);
        let unclaimed: HashMap<_, _, FixedState> =
            inst.unclaimed.iter().map(|h| (h.region, h)).collect();
        let verdicts: Vec<RegionStatus> = req
            .regions
            .iter()
            .map(|p| {
                let claimed = unclaimed
                    .get(&p.handle.region)
                    .is_some_and(|h| h.matches(&p.handle))
                    && p.handle.len_bytes >= p.layout.page_size_bytes;
                if claimed {
                    RegionStatus::Confirmed
                } else {
                    RegionStatus::NotOwned
                }
            })
            .collect();
        let confirmed = || {
            req.regions
                .iter()
                .zip(&verdicts)
                .filter(|(_, v)| **v == RegionStatus::Confirmed)
                .map(|(p, _)| p)
        };
        if !inst.unclaimed.is_empty() && confirmed().next().is_none() {
            return Err(DirectoryError::OwnershipNotProven {
                instance: inst.id.clone(),
            });
        }
        let mut new_layouts: Vec<_> = confirmed()
            .map(|p| p.layout)
            .filter(|l| self.layouts.get(l).is_none())
            .collect();
        new_layouts.sort_by_key(|l| (l.page_size_bytes, l.fingerprint));
        new_layouts.dedup();
        self.check_layout_room(new_layouts.len())?;

        // Checks done: from here on, the reattach succeeds.
        let quota = self.effective_quota(req.quota_bytes);
        let window = self.config.reply_window;
        let unclaimed = std::mem::take(&mut self.instance_mut(slot).unclaimed);
        for h in &unclaimed {
            self.unclaimed.remove(h);
        }
        let inst = self.instance_mut(slot);
        inst.secret = Some(req.secret);
        inst.principal = Some(peer.principal());
        inst.quota_bytes = quota;
        inst.replies = ReplyWindow::new(req.next_seq, window);
        inst.notices = NoticeQueue::new(req.notice_ack.saturating_add(1));
        inst.recovery_unseen = true;
        let owner_id = inst.id.clone();
        let claimed: Vec<_> = confirmed().copied().collect();
        for p in &claimed {
            let layout_ix = self.layouts.acquire(p.layout);
            self.add_region(p.handle, layout_ix, p.layout.page_size_bytes, slot);
        }
        let kept: HashSet<_, FixedState> = claimed.iter().map(|p| p.handle.region).collect();
        for handle in unclaimed {
            if !kept.contains(&handle.region) {
                self.free_handle(handle, owner_id.clone());
            }
        }
        tracing::info!(instance = %owner_id, regions = claimed.len(), "instance recovered");
        Ok(self.reattached(slot, &peer, ReattachKind::Recovered, verdicts, now))
    }

    fn reattached(
        &mut self,
        slot: u32,
        peer: &Peer,
        kind: ReattachKind,
        regions: Vec<RegionStatus>,
        now: Time,
    ) -> Reattached {
        self.note_holder(slot, peer);
        let session = self.open_session(slot, now);
        let Reply { notices, usage, .. } = self.reply(slot, ());
        let inst = self.instance(slot);
        Reattached {
            session,
            kind,
            directory_epoch: self.epoch,
            regions,
            oldest_accepted_seq: inst.replies.oldest_accepted(),
            quota_bytes: inst.quota_bytes,
            limits: self.limits(),
            notices,
            usage,
        }
    }

    /// Renews the session's lease; the reply carries notices and usage.
    /// Counted as a heartbeat (`ops.heartbeat`).
    pub fn heartbeat(&mut self, caller: &Caller, now: Time) -> Result<Reply<()>, DirectoryError> {
        let r = self.renew(caller, now);
        self.count_call(OpKind::Heartbeat, 0, r.is_err());
        r
    }

    /// What [`heartbeat`](Self::heartbeat) does, for a request counted as
    /// an operation of its own (`Stats`, `EndSession`) that renews its
    /// session and carries its notices and usage too: not counted again.
    pub fn renew(&mut self, caller: &Caller, now: Time) -> Result<Reply<()>, DirectoryError> {
        self.enter(caller, now).map(|slot| self.reply(slot, ()))
    }

    /// The transport saw the session's connection close: its pins are
    /// released at once. Unknown sessions are ignored.
    pub fn session_closed(&mut self, session: SessionId, now: Time) {
        if self.sessions.contains_key(&session) {
            self.kill_session(session, SessionEndReason::ConnectionClosed, now);
        }
    }

    /// Admin, from within the process: ends session `target`, releasing its
    /// pins; its next call fails with `SessionEnded`. A target that is not
    /// live is `NoSuchTarget`.
    pub fn end_session(
        &mut self,
        target: SessionId,
        now: Time,
    ) -> Result<EndedSession, DirectoryError> {
        let r = self.end_live(target, now);
        self.count_call(OpKind::EndSession, 0, r.is_err());
        r
    }

    /// Ends `target` if it is live.
    fn end_live(&mut self, target: SessionId, now: Time) -> Result<EndedSession, DirectoryError> {
        if !self.sessions.contains_key(&target) {
            return Err(DirectoryError::NoSuchTarget { session: target });
        }
        Ok(self.kill_session(target, SessionEndReason::EndedByAdmin, now))
    }

    /// The `EndSession` request: `caller`'s session ends session `target`
    /// as [`end_session`](Self::end_session) does, exactly-once under `seq`
    /// as every mutating request (a retry gets the first answer; the
    /// caller's own session is unaffected by a `NoSuchTarget`).
    pub fn end_session_request(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        target: SessionId,
        now: Time,
    ) -> Result<EndedSession, DirectoryError> {
        let r = self.end_session_inner(caller, seq, target, now);
        self.count_call(OpKind::EndSession, 0, r.is_err());
        r
    }

    fn end_session_inner(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        target: SessionId,
        now: Time,
    ) -> Result<EndedSession, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let mut fp = Fingerprint::new(OpKind::EndSession, None);
        fp.add(target.0);
        let retried = self.replay(slot, caller, seq, fp, |body| match body {
            CachedBody::EndSession(e) => Some(*e),
            _ => None,
        })?;
        if let Some(reply) = retried {
            return Ok(reply.body);
        }
        let ended = self.end_live(target, now)?;
        // The caller's instance (`slot`) outlives its session ending here
        // (an instance without sessions waits out its grace period).
        self.record(slot, caller, seq, fp, CachedBody::EndSession(ended));
        Ok(ended)
    }

    /// Expires sessions past their lease and instances past their grace
    /// period, then runs eviction. Call it periodically (every 100 ms is
    /// plenty: leases and grace periods are seconds).
    pub fn tick(&mut self, now: Time) {
        let lease = self.config.session_lease;
        let mut expired: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_since(s.last_seen) >= lease)
            .map(|(&id, _)| id)
            .collect();
        expired.sort_unstable();
        for id in expired {
            tracing::info!(session = %id, "session lease expired");
            self.kill_session(id, SessionEndReason::LeaseExpired, now);
        }
        let grace = self.config.instance_grace;
        let gone: Vec<u32> = self
            .instances
            .iter()
            .enumerate()
            .filter_map(|(slot, inst)| {
                let since = inst.as_ref()?.absent_since?;
                (now.saturating_since(since) >= grace).then_some(slot as u32)
            })
            .collect();
        for slot in gone {
            tracing::info!(instance = %self.instance(slot).id, "instance gone (grace expired)");
            self.instance_gone(slot, now);
        }
        self.evict();
    }

    // --- internals --------------------------------------------------------

    /// Validates the caller's session, renews its lease and applies its notice
    /// acknowledgement. Returns the instance slot.
    pub(super) fn enter(&mut self, caller: &Caller, now: Time) -> Result<u32, DirectoryError> {
        let Some(session) = self.sessions.get_mut(&caller.session) else {
            return Err(self.missing_session(caller.session));
        };
        session.last_seen = now;
        let slot = session.instance;
        let inst = self.instance_mut(slot);
        // A request on a session opened after the recovery: its client has
        // the `Recovered` answer that opened it.
        inst.recovery_unseen = false;
        inst.notices.ack(caller.notice_ack)?;
        Ok(slot)
    }

    fn missing_session(&self, session: SessionId) -> DirectoryError {
        if self.ended.contains(&session) {
            DirectoryError::SessionEnded { session }
        } else {
            DirectoryError::UnknownSession { session }
        }
    }

    /// Whether a process that held `inst`, other than `requester`'s own,
    /// may still run, so that a `Hello` must not take the instance over
    /// before its grace period ends (DESIGN §4: an instance is gone when it
    /// did not reattach within it). A live holder whose connection merely
    /// broke still has the instance's regions mapped and may write their
    /// pages; were they freed and granted to someone else, it would write
    /// into another instance's data. (The requester itself may start over:
    /// its mappings are its own to drop.) With no probe installed
    /// (`set_holder_probe`) takeover needs only the same principal; with
    /// one, every other Unix holder must be known to have exited, and a TCP
    /// holder (no process to check) is never taken over early.
    fn holder_may_live(&self, inst: &super::sessions::Instance, requester: &Peer) -> bool {
        let Some(probe) = self.holder_probe else {
            return false;
        };
        // Pid 0 is no process (`SO_PEERCRED` of a peer in a pid namespace
        // the server cannot see): never "the requester itself".
        let own = requester.pid().filter(|&p| p != 0);
        inst.holder_unchecked
            || inst
                .holder_pids
                .iter()
                .any(|&pid| Some(pid) != own && probe(pid))
    }

    /// Records the process behind a session of instance `slot`.
    fn note_holder(&mut self, slot: u32, peer: &Peer) {
        let probe = self.holder_probe;
        let inst = self.instance_mut(slot);
        // A TCP peer, or a pid the server cannot see: nothing to check.
        let Some(pid) = peer.pid().filter(|&p| p != 0) else {
            inst.holder_unchecked = true;
            return;
        };
        if inst.holder_pids.contains(&pid) {
            return;
        }
        if inst.holder_pids.len() >= MAX_HOLDER_PIDS
            && let Some(probe) = probe
        {
            inst.holder_pids.retain(|&p| probe(p));
        }
        if inst.holder_pids.len() >= MAX_HOLDER_PIDS {
            inst.holder_unchecked = true;
        } else {
            inst.holder_pids.push(pid);
        }
    }

    fn check_peer(&self, peer: &Peer) -> Result<(), DirectoryError> {
        match peer {
            Peer::Tcp {
                secret_matched: false,
            } if self.config.tcp_requires_secret => Err(DirectoryError::TcpSecretRequired),
            _ => Ok(()),
        }
    }

    fn check_session_room(&self) -> Result<(), DirectoryError> {
        if self.sessions.len() >= self.config.max_sessions {
            return Err(DirectoryError::TooManySessions {
                max: self.config.max_sessions,
            });
        }
        Ok(())
    }

    fn check_instance_room(&self) -> Result<(), DirectoryError> {
        if self.instance_ix.len() >= self.config.max_instances {
            return Err(DirectoryError::TooManyInstances {
                max: self.config.max_instances,
            });
        }
        Ok(())
    }

    fn effective_quota(&self, requested: Option<u64>) -> Option<u64> {
        match (requested, self.config.max_instance_quota_bytes) {
            (Some(r), Some(m)) => Some(r.min(m)),
            (Some(r), None) => Some(r),
            (None, m) => m,
        }
    }

    fn open_session(&mut self, slot: u32, now: Time) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        self.sessions
            .insert(id, Session::new(slot, now, self.map_seed));
        let inst = self.instance_mut(slot);
        inst.sessions.push(id);
        inst.absent_since = None;
        id
    }

    /// Ends a live session: releases its pins; if it was its instance's last,
    /// the instance's grace period starts.
    pub(super) fn kill_session(
        &mut self,
        id: SessionId,
        reason: SessionEndReason,
        now: Time,
    ) -> EndedSession {
        let session = self
            .sessions
            .remove(&id)
            .expect("invariant: kill_session is called for live sessions");
        for (slot, held) in session.pins.iter() {
            self.release_pins(slot, held.count);
        }
        self.totals.pin_entries -= session.pins.len() as u64;
        self.totals.ledger_buckets -= session.pins.buckets() as u64;
        let inst = self.instance_mut(session.instance);
        inst.sessions.retain(|s| *s != id);
        let empty = inst.sessions.is_empty();
        if empty {
            inst.absent_since = Some(now);
        }
        let o = &mut self.counters.outcomes;
        match reason {
            SessionEndReason::ConnectionClosed => o.sessions_closed += 1,
            SessionEndReason::LeaseExpired => o.sessions_expired += 1,
            SessionEndReason::EndedByAdmin => o.sessions_ended_by_admin += 1,
        }
        if reason != SessionEndReason::ConnectionClosed {
            self.remember_ended(id);
            self.effects.push(Effect::SessionEnded {
                session: id,
                reason,
            });
        }
        EndedSession {
            instance_left_without_sessions: empty,
            pins_released: session.pin_total,
        }
    }

    fn remember_ended(&mut self, id: SessionId) {
        if self.ended.insert(id) {
            self.ended_order.push_back(id);
        }
        while self.ended_order.len() > self.config.ended_sessions_remembered {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    /// The instance in `slot` (no sessions) is gone: each of its regions is
    /// freed if it has no keys, or orphaned until its last key is deleted.
    pub(super) fn instance_gone(&mut self, slot: u32, now: Time) {
        let inst = self.instances[slot as usize]
            .take()
            .expect("invariant: instance_gone is called for live instances");
        debug_assert!(inst.sessions.is_empty(), "a gone instance has no sessions");
        self.free_instance_slots.push(slot);
        self.instance_ix.remove(&inst.id);
        for rs in inst.regions {
            let region = self.regions.get_mut(rs);
            if region.keys == 0 {
                self.free_region(rs);
            } else {
                region.owner = Owner::Gone { since: now };
                let id = region.handle.region;
                self.queue_orphan(rs, id, false);
                self.counters.outcomes.regions_deferred += 1;
            }
        }
        for handle in inst.unclaimed {
            self.unclaimed.remove(&handle);
            self.free_handle(handle, inst.id.clone());
        }
        for p in self.pending.values_mut() {
            if p.instance == Some(slot) {
                p.instance = None;
            }
        }
        self.counters.outcomes.instances_gone += 1;
    }

    /// Registers a region record owned by the instance in `owner`. The
    /// record holds `layout_ix`: the caller acquired it for this region.
    pub(super) fn add_region(
        &mut self,
        handle: RegionHandle,
        layout_ix: u32,
        page_size_bytes: u64,
        owner: u32,
    ) -> u32 {
        let owner_id = self.instance(owner).id.clone();
        let rs = self.regions.insert(Region::new(
            handle,
            layout_ix,
            page_size_bytes,
            owner,
            owner_id,
        ));
        let inst = self.instance_mut(owner);
        inst.regions.push(rs);
        inst.owned_bytes += handle.len_bytes;
        self.totals.region_bytes += handle.len_bytes;
        let r = self.regions.get(rs);
        self.totals.region_page_bytes += u64::from(r.pages) * r.page_size_bytes;
        rs
    }

    /// Puts an orphaned region in the orphan queue, at the back (its turn
    /// comes after every region orphaned before) or at the front (eviction
    /// started it and finishes it first).
    pub(super) fn queue_orphan(&mut self, rs: u32, id: RegionId, front: bool) {
        let region = self.regions.get_mut(rs);
        debug_assert!(!region.orphan_queued && matches!(region.owner, Owner::Gone { .. }));
        region.orphan_queued = true;
        if front {
            self.orphans.push_front((rs, id));
        } else {
            self.orphans.push_back((rs, id));
        }
    }

    /// Removes a region with no keys and gives it back to the pool manager.
    pub(super) fn free_region(&mut self, rs: u32) {
        let region = self.regions.remove(rs);
        debug_assert_eq!(region.keys, 0, "a region is only freed without keys");
        self.layouts.release(region.layout);
        self.totals.region_bytes -= region.handle.len_bytes;
        self.totals.region_page_bytes -= u64::from(region.pages) * region.page_size_bytes;
        self.pools
            .entry(region.handle.pool)
            .or_default()
            .freed(region.handle.len_bytes);
        self.effects.push(Effect::FreeRegion {
            handle: region.handle,
            owner: region.owner_id,
        });
        self.counters.outcomes.regions_freed += 1;
    }

    /// Why a pool manager's grant of `h` conflicts with what this directory
    /// holds — a region assigned to an instance (or orphaned) or held
    /// unclaimed since a restart, with `h`'s id or bytes overlapping `h`'s
    /// — or `None`. Such a grant is refused, never recorded (two owners of
    /// one id or of one byte), nor freed (the id or the bytes are someone's).
    pub(super) fn grant_conflict(&self, h: &RegionHandle) -> Option<String> {
        if self.regions.slot_of(h.region).is_some() || self.unclaimed.contains(h.region) {
            return Some(format!("region {} is already assigned", h.region));
        }
        let other = self
            .regions
            .overlapping(h)
            .or_else(|| self.unclaimed.overlapping(h))?;
        Some(format!(
            "region {} overlaps region {other}, already assigned",
            h.region
        ))
    }

    /// Gives back a region that has no record (unclaimed after a restart, or
    /// granted after its requester left).
    pub(super) fn free_handle(&mut self, handle: RegionHandle, owner: InstanceId) {
        self.pools
            .entry(handle.pool)
            .or_default()
            .freed(handle.len_bytes);
        self.effects.push(Effect::FreeRegion { handle, owner });
        self.counters.outcomes.regions_freed += 1;
    }
}
