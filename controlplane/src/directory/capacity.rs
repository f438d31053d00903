//! Regions and capacity: region requests (deferred on the pool manager),
//! returns, the pool manager's answers and fill reports, and eviction.
//!
//! Quotas count the bytes of regions an instance owns plus those it has
//! requested and not yet received. Eviction runs from `tick` with a bounded
//! budget per call: orphaned regions first (oldest orphan first, all keys of
//! a region together, so that the region can be freed; a region with a
//! pinned key is passed over until it has none, since its bytes could not
//! be freed anyway — the first in line keeping its place, the others going
//! to the back, at most `max_evictions_per_tick` of them a call), then — if
//! enabled — the least recently used unpinned keys anywhere, under the same
//! pool watermarks (`evict_lru`). Orphan eviction also starts below the
//! high watermark when the pool manager refused a region for want of space
//! (`region_refused_for_space`, which the server calls).

use cxlkv_dataplane::ids::{PoolId, RegionId};

use super::error::DirectoryError;
use super::keys::NIL;
use super::lru::Lru;
use super::regions::Owner;
use super::sequence::CachedBody;
use super::types::{
    Caller, Completion, DeferredId, Effect, Layout, OpKind, PoolRequestId, RegionGrant,
    RegionHandle, RegionReply, Reply, Sequence, Time,
};
use super::{
    Directory, EvictionConfig, Fingerprint, MAX_REGION_WAITERS, PendingRegion, PoolReportMark,
};

/// What the reply cache held for a region request.
enum PriorRegion {
    Granted(RegionGrant),
    Pending(PoolRequestId),
}

impl Directory {
    /// Asks for a region of at least `len_bytes` for `layout`, owned by the
    /// caller's instance. Always answered `Deferred` (the pool manager is
    /// asked through [`Effect::AllocateRegion`]) unless it is a retry of a
    /// request already granted; `region_allocated` completes it.
    pub fn request_region(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        len_bytes: u64,
        now: Time,
    ) -> Result<Reply<RegionReply>, DirectoryError> {
        let r = self.request_region_inner(caller, seq, layout, len_bytes, now);
        self.count_call(OpKind::RequestRegion, 0, r.is_err());
        r
    }

    fn request_region_inner(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        len_bytes: u64,
        now: Time,
    ) -> Result<Reply<RegionReply>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        Self::check_layout(&layout)?;
        if len_bytes < layout.page_size_bytes || len_bytes > self.config.max_region_bytes {
            return Err(DirectoryError::InvalidRegionLength {
                len_bytes,
                page_size_bytes: layout.page_size_bytes,
                max_bytes: self.config.max_region_bytes,
            });
        }
        let mut fp = Fingerprint::new(OpKind::RequestRegion, Some(&layout));
        fp.add(len_bytes);
        // Counted in `retries_answered` below, once answered: a retry that
        // would join a request with all its waiters taken is refused.
        let prior = self.replay_uncounted(slot, caller, seq, fp, |body| match body {
            CachedBody::RegionGranted(g) => Some(PriorRegion::Granted(*g)),
            CachedBody::RegionPending(p) => Some(PriorRegion::Pending(*p)),
            _ => None,
        })?;
        if let Some(Reply {
            body,
            notices,
            usage,
        }) = prior
        {
            let body = match body {
                PriorRegion::Granted(grant) => RegionReply::Granted(grant),
                PriorRegion::Pending(request) => {
                    let deferred = DeferredId(self.next_deferred);
                    let pending = self
                        .pending
                        .get_mut(&request)
                        .expect("invariant: a cached pending reply names a pending request");
                    // Waiters of sessions ended since they joined would get
                    // a completion no one can receive: they give their
                    // places up, or a client whose every reattach retries
                    // the request is refused after `MAX_REGION_WAITERS`
                    // sessions (reliability defect 140).
                    let sessions = &self.sessions;
                    pending.waiters.retain(|(_, s)| sessions.contains_key(s));
                    if pending.waiters.len() >= MAX_REGION_WAITERS {
                        return Err(DirectoryError::TooManyPendingRegionRequests {
                            max: MAX_REGION_WAITERS,
                        });
                    }
                    pending.waiters.push((deferred, caller.session));
                    self.next_deferred += 1;
                    RegionReply::Deferred(deferred)
                }
            };
            self.counters.outcomes.retries_answered += 1;
            return Ok(Reply {
                body,
                notices,
                usage,
            });
        }

        let inst = self.instance(slot);
        let max_pending = self.config.max_pending_region_requests_per_instance;
        if inst.pending_requests >= max_pending {
            return Err(DirectoryError::TooManyPendingRegionRequests { max: max_pending });
        }
        if inst.regions.len() + inst.pending_requests >= self.config.max_regions_per_instance {
            return Err(DirectoryError::TooManyRegions {
                max: self.config.max_regions_per_instance,
            });
        }
        if let Some(quota_bytes) = inst.quota_bytes {
            let owned_bytes = inst.owned_bytes.saturating_add(inst.pending_bytes);
            if owned_bytes.saturating_add(len_bytes) > quota_bytes {
                return Err(DirectoryError::QuotaExceeded {
                    quota_bytes,
                    owned_bytes,
                    requested_bytes: len_bytes,
                });
            }
        }
        if self.layouts.get(&layout).is_none() {
            self.check_layout_room(1)?;
        }

        let layout_ix = self.layouts.acquire(layout);
        let request = PoolRequestId(self.next_pool_request);
        self.next_pool_request += 1;
        let deferred = DeferredId(self.next_deferred);
        self.next_deferred += 1;
        self.pending.insert(
            request,
            PendingRegion {
                instance: Some(slot),
                owner: self.instance(slot).id.clone(),
                layout,
                layout_ix,
                len_bytes,
                seq: seq.seq,
                waiters: vec![(deferred, caller.session)],
            },
        );
        let inst = self.instance_mut(slot);
        // At most MAX_PENDING_REGION_REQUESTS_CEILING requests of at most
        // MAX_REGION_BYTES_CEILING bytes each are pending (`validate`, and
        // the checks above): below 2^60.
        inst.pending_bytes = inst
            .pending_bytes
            .checked_add(len_bytes)
            .expect("invariant: pending region bytes are bounded by the configuration's ceilings");
        inst.pending_requests += 1;
        let owner = inst.id.clone();
        self.effects.push(Effect::AllocateRegion {
            request,
            owner,
            layout,
            len_bytes,
        });
        self.record(slot, caller, seq, fp, CachedBody::RegionPending(request));
        Ok(self.reply(slot, RegionReply::Deferred(deferred)))
    }

    /// The pool manager answered allocation `request`: `Ok(handle)` or the
    /// reason it failed. Returns the completed replies (the original request
    /// and any retries that joined it). An answer for an unknown request is
    /// ignored. If the instance went away meanwhile, the region is freed.
    pub fn region_allocated(
        &mut self,
        request: PoolRequestId,
        result: Result<RegionHandle, String>,
    ) -> Vec<Completion> {
        let Some(p) = self.pending.remove(&request) else {
            tracing::warn!(
                request = request.0,
                "answer for an unknown region request ignored"
            );
            return Vec::new();
        };
        if let Ok(handle) = &result {
            let p = self.pools.entry(handle.pool).or_default();
            p.allocated_since = p.allocated_since.saturating_add(handle.len_bytes);
        }
        let outcome = match (p.instance, result) {
            (_, Err(reason)) => Err(DirectoryError::RegionAllocationFailed { reason }),
            (None, Ok(handle)) => {
                if self.grant_conflict(&handle).is_none() {
                    self.free_handle(handle, p.owner.clone());
                }
                Err(DirectoryError::InstanceGone)
            }
            (Some(slot), Ok(handle)) => {
                if let Some(reason) = self.grant_conflict(&handle) {
                    tracing::error!(region = %handle.region, %reason, "pool manager granted a region already assigned");
                    Err(DirectoryError::RegionAllocationFailed { reason })
                } else if handle.len_bytes < p.len_bytes {
                    self.free_handle(handle, p.owner.clone());
                    Err(DirectoryError::RegionAllocationFailed {
                        reason: format!(
                            "granted {} bytes, fewer than the {} requested",
                            handle.len_bytes, p.len_bytes
                        ),
                    })
                } else if let Some(e) = self.grant_over_quota(slot, handle.len_bytes) {
                    // The pool rounds a request up to its alignment: the
                    // quota counts what is granted, so a grant that would
                    // cross it goes back (the request was checked at the
                    // size asked for).
                    self.free_handle(handle, p.owner.clone());
                    Err(e)
                } else {
                    self.add_region(handle, p.layout_ix, p.layout.page_size_bytes, slot);
                    self.counters.outcomes.regions_granted += 1;
                    Ok(RegionGrant {
                        handle,
                        layout: p.layout,
                    })
                }
            }
        };
        if outcome.is_err() {
            // No region record took over the request's hold on its layout.
            self.layouts.release(p.layout_ix);
        }
        let Some(slot) = p.instance else {
            return p
                .waiters
                .into_iter()
                .map(|(deferred, session)| Completion {
                    deferred,
                    session,
                    result: Err(DirectoryError::InstanceGone),
                })
                .collect();
        };
        let inst = self.instance_mut(slot);
        inst.pending_bytes -= p.len_bytes;
        inst.pending_requests -= 1;
        match &outcome {
            Ok(grant) => inst
                .replies
                .replace_body(p.seq, CachedBody::RegionGranted(*grant)),
            Err(_) => inst.replies.forget(p.seq),
        }
        let result = outcome.map(|grant| self.reply(slot, grant));
        p.waiters
            .into_iter()
            .map(|(deferred, session)| Completion {
                deferred,
                session,
                result: result.clone(),
            })
            .collect()
    }

    /// The refusal of a grant of `granted_bytes` that would take instance
    /// `slot` over its quota (its other pending requests still count what
    /// they asked for: each is checked again when granted).
    fn grant_over_quota(&self, slot: u32, granted_bytes: u64) -> Option<DirectoryError> {
        let inst = self.instance(slot);
        let quota_bytes = inst.quota_bytes?;
        (inst.owned_bytes.saturating_add(granted_bytes) > quota_bytes).then_some(
            DirectoryError::QuotaExceeded {
                quota_bytes,
                owned_bytes: inst.owned_bytes,
                requested_bytes: granted_bytes,
            },
        )
    }

    /// Gives back a region with no keys that the caller's instance owns.
    pub fn return_region(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        region: RegionId,
        now: Time,
    ) -> Result<Reply<()>, DirectoryError> {
        let r = self.return_region_inner(caller, seq, region, now);
        self.count_call(OpKind::ReturnRegion, 0, r.is_err());
        r
    }

    fn return_region_inner(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        region: RegionId,
        now: Time,
    ) -> Result<Reply<()>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let mut fp = Fingerprint::new(OpKind::ReturnRegion, None);
        fp.add(region.0);
        let retried = self.replay(slot, caller, seq, fp, |body| {
            matches!(body, CachedBody::RegionReturned).then_some(())
        })?;
        if let Some(reply) = retried {
            return Ok(reply);
        }
        let rs = self
            .regions
            .slot_of(region)
            .ok_or(DirectoryError::UnknownRegion { region })?;
        let r = self.regions.get(rs);
        if r.owner != Owner::Present(slot) {
            return Err(DirectoryError::NotRegionOwner { region });
        }
        if r.keys > 0 {
            return Err(DirectoryError::RegionNotEmpty {
                region,
                keys: r.keys,
            });
        }
        let len_bytes = r.handle.len_bytes;
        let inst = self.instance_mut(slot);
        inst.regions.retain(|&s| s != rs);
        inst.owned_bytes -= len_bytes;
        self.free_region(rs);
        self.counters.outcomes.regions_returned += 1;
        self.record(slot, caller, seq, fp, CachedBody::RegionReturned);
        Ok(self.reply(slot, ()))
    }

    /// The pool manager's fill level of `pool`, counting every allocation
    /// and free of this directory so far (as at start-up). Drives eviction
    /// and the usage piggyback.
    pub fn pool_usage(&mut self, pool: PoolId, total_bytes: u64, free_bytes: u64) {
        let mark = self.pool_report_mark();
        self.pool_usage_as_of(&mark, pool, total_bytes, free_bytes);
    }

    /// Marks the moment a pool report is asked for: the frees sent to the
    /// pool manager so far (call it once they are all submitted, right
    /// before the report's request).
    pub fn pool_report_mark(&self) -> PoolReportMark {
        PoolReportMark {
            freed_total: self
                .pools
                .iter()
                .map(|(&pool, u)| (pool, u.freed_total))
                .collect(),
        }
    }

    /// The pool manager's fill level of `pool`, as of `mark` (periodic
    /// reports). The pool manager answers in the order it was asked, so the
    /// report counts every allocation whose answer came before it — all
    /// those counted here — and every free sent before the mark; frees sent
    /// after it are still to come off its free bytes, and stay counted.
    /// (Resetting them too let orphan eviction go on below the watermark
    /// until the next report.)
    pub fn pool_usage_as_of(
        &mut self,
        mark: &PoolReportMark,
        pool: PoolId,
        total_bytes: u64,
        free_bytes: u64,
    ) {
        let freed_at_mark = mark
            .freed_total
            .iter()
            .find(|(p, _)| *p == pool)
            .map_or(0, |&(_, b)| b);
        let p = self.pools.entry(pool).or_default();
        p.reported_total_bytes = total_bytes;
        p.reported_free_bytes = free_bytes.min(total_bytes);
        p.allocated_since = 0;
        p.freed_since = p.freed_total.saturating_sub(freed_at_mark);
    }

    /// Fraction of all reported pool bytes allocated (0 before any report).
    pub(super) fn pool_fill(&self) -> f64 {
        let (mut total, mut free) = (0u64, 0u64);
        for p in self.pools.values() {
            total += p.reported_total_bytes;
            free += p.estimated_free();
        }
        if total == 0 {
            0.0
        } else {
            (total - free) as f64 / total as f64
        }
    }

    /// Fraction of the pages the held regions can hold that are registered
    /// (by bytes). Over their whole pages, not their lengths: a region's
    /// tail past its last whole page never holds a key (the client rounds a
    /// region up to 2 MiB, so 14 MiB pages fill a 64 MiB region to 56 MiB),
    /// and counting it kept full regions below `lru_high_fill`.
    fn region_fill(&self) -> f64 {
        if self.totals.region_page_bytes == 0 {
            0.0
        } else {
            self.totals.page_bytes as f64 / self.totals.region_page_bytes as f64
        }
    }

    /// The pool manager refused a region for want of space: orphaned keys
    /// are evicted from the next tick on as when the pools cross
    /// `pool_high_watermark` (down to `pool_low_watermark`, oldest orphan
    /// first), if orphan eviction is on. Without it, a pool whose regions
    /// are large beside it refused every new region below the mark while
    /// orphaned keys held the space (a 16 MiB region does not fit a
    /// 128 MiB pool at 88.9 %).
    pub fn region_refused_for_space(&mut self) {
        if self.config.eviction.orphans {
            self.orphan_evicting = true;
        }
    }

    /// One bounded round of eviction (see the module docs).
    pub(super) fn evict(&mut self) {
        let cfg = self.config.eviction.clone();
        let mut budget = cfg.max_evictions_per_tick;
        if cfg.orphans {
            if self.pool_fill() > cfg.pool_high_watermark {
                self.orphan_evicting = true;
            }
            if self.orphan_evicting {
                // Entries of regions freed since they were queued are
                // dropped as they come up (`Directory::orphans`).
                let mut visits = self.orphans.len() - self.orphans_stale;
                // Regions with a pinned key passed over this tick, besides
                // the first in line (`held`).
                let mut passes_left = cfg.max_evictions_per_tick;
                let mut held = None;
                let mut first = true;
                while budget > 0
                    && visits > 0
                    && passes_left > 0
                    && self.pool_fill() > cfg.pool_low_watermark
                {
                    let Some((rs, id)) = self.orphans.pop_front() else {
                        break;
                    };
                    if self.regions.get_if(rs, id).is_none() {
                        self.orphans_stale -= 1;
                        continue;
                    }
                    visits -= 1;
                    let first_in_line = std::mem::take(&mut first);
                    self.regions.get_mut(rs).orphan_queued = false;
                    // A region with a pinned key is passed over: its bytes
                    // cannot come back before the pin does
                    // (`Region::pinned_keys`). The first in line keeps its
                    // place, so that it is next once the pin goes: it may
                    // be the region a previous tick's budget ran out in,
                    // whose evicted keys would otherwise be lost for
                    // nothing while the regions behind it are evicted in
                    // its stead. The others wait at the back, at most
                    // `max_evictions_per_tick` of them a tick (the next
                    // tick goes on past them). Otherwise every key in it is
                    // unpinned, and each one walked is one evicted: the work
                    // of a tick is its budget, however many keys and
                    // regions are pinned elsewhere.
                    if self.regions.get(rs).pinned_keys > 0 {
                        if first_in_line {
                            held = Some((rs, id));
                        } else {
                            self.queue_orphan(rs, id, false);
                            passes_left -= 1;
                        }
                        continue;
                    }
                    let mut cur = self.regions.get(rs).key_head;
                    let mut freed = false;
                    while cur != NIL && budget > 0 {
                        let next = self.keys.get(cur).region_next;
                        debug_assert_eq!(self.keys.get(cur).pins, 0, "region counts no pin");
                        let last = self.regions.get(rs).keys == 1;
                        self.remove_entry(cur, self.keys.hash_of(cur));
                        budget -= 1;
                        self.counters.evictions.orphan_keys += 1;
                        if last {
                            freed = true;
                            break;
                        }
                        cur = next;
                    }
                    if !freed {
                        // The budget ran out inside it: it stays first, so
                        // the next tick finishes it before starting another
                        // (a bite out of every orphaned region would lose
                        // readable keys and free nothing).
                        self.queue_orphan(rs, id, true);
                    }
                }
                if let Some((rs, id)) = held {
                    // First in line again, ahead of a region this tick's
                    // budget ran out in (it was ahead of that one).
                    self.queue_orphan(rs, id, true);
                }
                self.compact_orphans_if_due();
                let no_orphans = self.orphans.len() == self.orphans_stale;
                if self.pool_fill() <= cfg.pool_low_watermark || no_orphans {
                    self.orphan_evicting = false;
                }
            }
        }
        if cfg.lru && self.lru.is_some() {
            if self.pool_fill() > cfg.pool_high_watermark && self.region_fill() >= cfg.lru_high_fill
            {
                self.lru_evicting = true;
            }
            if self.lru_evicting {
                self.evict_lru(&cfg, budget);
            }
        }
    }

    /// The LRU's part of a round (`evict`), at most `budget` keys: the least
    /// recently used unpinned keys, until the pools are down to the low
    /// watermark or the held regions to `lru_low_fill` (as orphan eviction
    /// stops at the low watermark: evicting a live owner's key frees no pool
    /// bytes, so without this a round started under pool pressure went on
    /// until the regions emptied to `lru_low_fill`, however empty the pools
    /// had become meanwhile).
    ///
    /// A key whose owner's notice queue is full is passed over where it
    /// lies (`Lru`'s resume point), at most `max_evictions_per_tick` such
    /// keys a tick besides the budget — a tick visits at most twice that
    /// many keys — and later ticks of the round go on past the keys passed
    /// over rather than walking over them again.
    fn evict_lru(&mut self, cfg: &EvictionConfig, mut budget: usize) {
        let limit = self.config.notice_queue_limit;
        let mut passes_left = cfg.max_evictions_per_tick;
        let mut cur = self.lru.as_ref().and_then(Lru::scan_start);
        while budget > 0
            && self.pool_fill() > cfg.pool_low_watermark
            && self.region_fill() > cfg.lru_low_fill
        {
            let Some(es) = cur else {
                break;
            };
            // Still linked after `es` is removed: a removal unlinks no other
            // key.
            cur = self.lru.as_ref().and_then(|l| l.more_recent(es));
            let owner = self.regions.get(self.keys.get(es).region).owner;
            if let Owner::Present(o) = owner
                && self.instance(o).notices.pending() >= limit
            {
                self.counters.evictions.lru_skipped += 1;
                passes_left -= 1;
                if passes_left == 0 {
                    break;
                }
                continue;
            }
            self.remove_entry(es, self.keys.hash_of(es));
            budget -= 1;
            self.counters.evictions.lru_keys += 1;
        }
        let done = self.pool_fill() <= cfg.pool_low_watermark
            || self.region_fill() <= cfg.lru_low_fill
            || self.lru.as_ref().is_none_or(|l| l.len() == 0);
        if done {
            self.lru_evicting = false;
        }
        if let Some(lru) = &mut self.lru {
            // A new round starts from the least recent key: owners passed
            // over may have caught up since.
            lru.set_resume(if done { None } else { cur });
        }
    }
}
