//! The registry operations: `register`, `lookup`, `exists`, `unpin`,
//! `delete` — batch-native, one hash probe per key, no allocation per key.
//!
//! Each operation validates the whole request first (session, batch length,
//! key lengths, layout, sequence number, capacity limits) and only then
//! changes state, so a refused request changes nothing. Mutating operations
//! run through the reply window (`sequence`): a retry is answered from the
//! cache.

use cxlkv_dataplane::ids::{Generation, PageIndex};

use super::error::DirectoryError;
use super::keys::{Entry, KeyIndex, NIL, Then};
use super::lru::Lru;
use super::regions::{Owner, RegionTable};
use super::sequence::{CachedBody, CachedReply, SeqCheck};
use super::types::{
    Caller, DeleteOutcome, Layout, Location, LookupReply, OpKind, RegisterEntry, RegisterOutcome,
    Reply, Sequence, Time, UnpinEntry, UnpinOutcome,
};
use super::{Directory, Fingerprint, MAX_KEY_BYTES, MAX_PINS_PER_KEY, Totals};

impl Directory {
    /// Registers keys at locations in the caller's regions. Per entry:
    /// `Inserted`, `Duplicate(winner)` or `Rejected(reason)`. A location must
    /// lie in a region the caller's instance owns that serves `layout`, on a
    /// page inside it, with `1 ≤ len ≤ page size`, on a page not registered
    /// under another key and with a generation newer than any registered there
    /// before. An entry naming an unknown region refuses the whole request.
    pub fn register<'k, I>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        entries: I,
        now: Time,
    ) -> Result<Reply<Vec<RegisterOutcome>>, DirectoryError>
    where
        I: IntoIterator<Item = RegisterEntry<'k>>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        let entries = entries.into_iter();
        let n = entries.len();
        let r = self.register_inner(caller, seq, layout, entries, now);
        self.count_call(OpKind::Register, n, r.is_err());
        r
    }

    fn register_inner<'k>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        entries: impl ExactSizeIterator<Item = RegisterEntry<'k>> + Clone,
        now: Time,
    ) -> Result<Reply<Vec<RegisterOutcome>>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let n = entries.len();
        self.check_batch(n)?;
        Self::check_layout(&layout)?;
        Self::check_keys(entries.clone().map(|e| e.key))?;
        let lix = self.layouts.get(&layout);
        let mut fp = Fingerprint::new(OpKind::Register, Some(&layout));
        self.scratch_hashes.clear();
        for e in entries.clone() {
            let kh = self.keys.key_hash(e.key);
            self.scratch_hashes
                .push(lix.map_or(0, |l| KeyIndex::entry_hash(kh, l)));
            let l = e.location;
            fp.add(kh);
            fp.add(l.region.0);
            fp.add(u64::from(l.page.0) << 32 | u64::from(l.generation.0));
            fp.add(u64::from(l.len_bytes));
        }
        let retried = self.replay(slot, caller, seq, fp, |body| match body {
            CachedBody::Register(v) => Some(v.clone()),
            _ => None,
        })?;
        if let Some(reply) = retried {
            return Ok(reply);
        }
        // State-dependent checks come after the reply cache: a retry is
        // answered even if, say, the region has been freed since.
        self.scratch_slots.clear();
        for e in entries.clone() {
            let Some(rs) = self.regions.slot_of(e.location.region) else {
                return Err(DirectoryError::UnknownRegion {
                    region: e.location.region,
                });
            };
            self.scratch_slots.push(rs);
        }
        if self.keys.len() + n > self.config.max_keys {
            return Err(DirectoryError::KeyLimit {
                max: self.config.max_keys,
            });
        }

        let mut outcomes = Vec::with_capacity(n);
        for (i, e) in entries.enumerate() {
            let outcome =
                self.register_one(slot, lix, self.scratch_slots[i], self.scratch_hashes[i], e);
            let o = &mut self.counters.outcomes;
            match outcome {
                RegisterOutcome::Inserted => o.inserted += 1,
                RegisterOutcome::Duplicate(_) => o.duplicate += 1,
                RegisterOutcome::Rejected(r) => {
                    o.rejected += 1;
                    if matches!(r, super::RejectReason::StaleGeneration { .. }) {
                        o.stale_generation += 1;
                    }
                }
            }
            outcomes.push(outcome);
        }
        self.record(
            slot,
            caller,
            seq,
            fp,
            CachedBody::Register(outcomes.clone()),
        );
        Ok(self.reply(slot, outcomes))
    }

    fn register_one(
        &mut self,
        owner: u32,
        lix: Option<u32>,
        rs: u32,
        hash: u32,
        e: RegisterEntry<'_>,
    ) -> RegisterOutcome {
        use super::RejectReason as R;
        let loc = e.location;
        let region = self.regions.get(rs);
        if region.owner != Owner::Present(owner) {
            return RegisterOutcome::Rejected(R::NotOwner { region: loc.region });
        }
        let Some(lix) = lix.filter(|&l| l == region.layout) else {
            return RegisterOutcome::Rejected(R::WrongLayout { region: loc.region });
        };
        if loc.page.0 >= region.pages {
            return RegisterOutcome::Rejected(R::PageOutOfRange {
                page: loc.page,
                pages: region.pages,
            });
        }
        let page_size_bytes = region.page_size_bytes;
        if loc.len_bytes == 0 || u64::from(loc.len_bytes) > page_size_bytes {
            return RegisterOutcome::Rejected(R::BadLength {
                len_bytes: loc.len_bytes,
                page_size_bytes,
            });
        }
        if let Some(winner) = self.keys.find(lix, e.key, hash) {
            return RegisterOutcome::Duplicate(self.location_of(winner));
        }
        if let Err(reason) = region.page_states.check(loc.page.0, loc.generation.0) {
            return RegisterOutcome::Rejected(reason);
        }
        let es = self.keys.insert(
            lix,
            e.key,
            Entry {
                region: rs,
                page: loc.page.0,
                generation: loc.generation.0,
                len_bytes: loc.len_bytes,
                pins: 0,
                region_prev: NIL,
                region_next: NIL,
            },
            hash,
        );
        let region = self.regions.get_mut(rs);
        self.keys.region_list_push(&mut region.key_head, es);
        region.keys += 1;
        region.page_states.register(loc.page.0, loc.generation.0);
        if let Some(lru) = &mut self.lru {
            lru.link_front(es);
        }
        let inst = self.instance_mut(owner);
        inst.keys += 1;
        inst.used_bytes += page_size_bytes;
        let t = &mut self.totals;
        t.page_bytes += page_size_bytes;
        t.value_bytes += u64::from(loc.len_bytes);
        t.key_bytes += e.key.len() as u64;
        RegisterOutcome::Inserted
    }

    /// Looks keys up; with `pins > 0` also takes `pins` pins on every key
    /// found, for the calling session, atomically with the lookup (then `seq`
    /// is required: a pinning lookup is a mutation). The reply lists each
    /// region named by a location once.
    pub fn lookup<'k, I>(
        &mut self,
        caller: &Caller,
        seq: Option<Sequence>,
        layout: Layout,
        keys: I,
        pins: u32,
        now: Time,
    ) -> Result<Reply<LookupReply>, DirectoryError>
    where
        I: IntoIterator<Item = &'k [u8]>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        let keys = keys.into_iter();
        let n = keys.len();
        let r = self.lookup_inner(caller, seq, layout, keys, pins, now);
        self.count_call(OpKind::Lookup, n, r.is_err());
        r
    }

    fn lookup_inner<'k>(
        &mut self,
        caller: &Caller,
        seq: Option<Sequence>,
        layout: Layout,
        keys: impl ExactSizeIterator<Item = &'k [u8]> + Clone,
        pins: u32,
        now: Time,
    ) -> Result<Reply<LookupReply>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let n = keys.len();
        self.check_batch(n)?;
        Self::check_layout(&layout)?;
        if pins > self.config.max_pins_per_call {
            return Err(DirectoryError::InvalidPinCount {
                pins,
                max: self.config.max_pins_per_call,
            });
        }
        let lix = self.layouts.get(&layout);
        if pins == 0 {
            let reply = self.lookup_unpinned(lix, keys)?;
            return Ok(self.reply(slot, reply));
        }
        let seq = seq.ok_or(DirectoryError::MissingSequence { op: OpKind::Lookup })?;

        let mut fp = Fingerprint::new(OpKind::Lookup, Some(&layout));
        fp.add(u64::from(pins));
        self.probe_all(lix, keys, &mut fp)?;
        let session_id = caller.session;
        let retried = self.replay(slot, caller, seq, fp, |body| match body {
            CachedBody::PinnedLookup(r) => Some(r.clone()),
            _ => None,
        })?;
        if let Some(reply) = retried {
            return Ok(reply);
        }
        let session = self
            .sessions
            .get(&session_id)
            .expect("invariant: enter() checked the session");
        if session.pins.len() + n > self.config.max_pinned_keys_per_session {
            return Err(DirectoryError::SessionPinLimit {
                max: self.config.max_pinned_keys_per_session,
            });
        }
        // Like the session's own limit, every key named counts as a new
        // (session, key) pair: no second pass over the ledger to tell.
        let max_entries = self.config.max_pinned_entries;
        if self.totals.pin_entries + n as u64 > max_entries as u64 {
            return Err(DirectoryError::PinnedEntryLimit { max: max_entries });
        }
        let most = u64::from(pins) * n as u64;
        // No key holds more pins than all keys together: when even the
        // total leaves room, the per-key pass (one more read of every
        // entry found) is skipped.
        let room = |held: u64| held + most <= u64::from(MAX_PINS_PER_KEY);
        if !room(self.totals.pins) {
            for (index, &es) in self.scratch_slots.iter().enumerate() {
                if es != NIL && !room(u64::from(self.keys.get(es).pins)) {
                    return Err(DirectoryError::PinLimit {
                        index,
                        max: MAX_PINS_PER_KEY,
                    });
                }
            }
        }

        self.lookup_stamp += 1;
        let stamp = self.lookup_stamp;
        let session = self
            .sessions
            .get_mut(&session_id)
            .expect("invariant: enter() checked the session");
        let ledger_before = (session.pins.len(), session.pins.buckets());
        let mut reply = LookupReply {
            locations: Vec::with_capacity(n),
            regions: Vec::new(),
        };
        let (mut hits, mut misses) = (0u64, 0u64);
        for &es in &self.scratch_slots {
            if es == NIL {
                misses += 1;
                reply.locations.push(None);
                continue;
            }
            hits += 1;
            let entry = self.keys.get_mut(es);
            let first_pin = entry.pins == 0;
            if first_pin {
                self.totals.pinned_keys += 1;
                if let Some(lru) = &mut self.lru {
                    lru.unlink(es);
                }
            }
            entry.pins += pins;
            session.pins.take(es, pins, now);
            session.pin_total += u64::from(pins);
            let region = self.regions.get_mut(entry.region);
            region.pinned_keys += u32::from(first_pin);
            if region.stamp != stamp {
                region.stamp = stamp;
                reply
                    .regions
                    .push(region.handle.descriptor(region.page_size_bytes));
            }
            reply.locations.push(Some(Location {
                region: region.handle.region,
                page: PageIndex(entry.page),
                generation: Generation(entry.generation),
                len_bytes: entry.len_bytes,
            }));
        }
        self.totals.pins += u64::from(pins) * hits;
        // A ledger only grows here.
        self.totals.pin_entries += (session.pins.len() - ledger_before.0) as u64;
        self.totals.ledger_buckets += (session.pins.buckets() - ledger_before.1) as u64;
        let o = &mut self.counters.outcomes;
        o.lookup_hits += hits;
        o.lookup_misses += misses;
        o.pins_taken += u64::from(pins) * hits;
        self.record(
            slot,
            caller,
            seq,
            fp,
            CachedBody::PinnedLookup(reply.clone()),
        );
        Ok(self.reply(slot, reply))
    }

    /// The hot path of a lookup without pins: one probe per key, nothing
    /// allocated but the reply.
    fn lookup_unpinned<'k>(
        &mut self,
        lix: Option<u32>,
        keys: impl ExactSizeIterator<Item = &'k [u8]> + Clone,
    ) -> Result<LookupReply, DirectoryError> {
        let n = keys.len();
        let mut reply = LookupReply {
            locations: Vec::with_capacity(n),
            regions: Vec::new(),
        };
        let Some(lix) = lix else {
            Self::check_keys(keys)?;
            reply.locations.resize(n, None);
            self.counters.outcomes.lookup_misses += n as u64;
            return Ok(reply);
        };
        self.hash_keys(lix, keys.clone())?;
        self.keys.find_batch(
            lix,
            keys,
            &self.scratch_hashes,
            Then::ReadEntries,
            &mut self.scratch_slots,
        );
        self.lookup_stamp += 1;
        let stamp = self.lookup_stamp;
        let mut hits = 0u64;
        for &es in &self.scratch_slots {
            if es == NIL {
                reply.locations.push(None);
                continue;
            }
            hits += 1;
            let entry = self.keys.get(es);
            if entry.pins == 0
                && let Some(lru) = &mut self.lru
            {
                lru.touch(es);
            }
            let region = self.regions.get_mut(entry.region);
            if region.stamp != stamp {
                region.stamp = stamp;
                reply
                    .regions
                    .push(region.handle.descriptor(region.page_size_bytes));
            }
            reply.locations.push(Some(Location {
                region: region.handle.region,
                page: PageIndex(entry.page),
                generation: Generation(entry.generation),
                len_bytes: entry.len_bytes,
            }));
        }
        let o = &mut self.counters.outcomes;
        o.lookup_hits += hits;
        o.lookup_misses += n as u64 - hits;
        Ok(reply)
    }

    /// Whether each key is registered under `layout` (no pins, no LRU touch).
    pub fn exists<'k, I>(
        &mut self,
        caller: &Caller,
        layout: Layout,
        keys: I,
        now: Time,
    ) -> Result<Reply<Vec<bool>>, DirectoryError>
    where
        I: IntoIterator<Item = &'k [u8]>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        let keys = keys.into_iter();
        let n = keys.len();
        let r = self.exists_inner(caller, layout, keys, now);
        self.count_call(OpKind::Exists, n, r.is_err());
        r
    }

    fn exists_inner<'k>(
        &mut self,
        caller: &Caller,
        layout: Layout,
        keys: impl ExactSizeIterator<Item = &'k [u8]> + Clone,
        now: Time,
    ) -> Result<Reply<Vec<bool>>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let n = keys.len();
        self.check_batch(n)?;
        Self::check_layout(&layout)?;
        let mut found = Vec::with_capacity(n);
        match self.layouts.get(&layout) {
            None => {
                Self::check_keys(keys)?;
                found.resize(n, false);
            }
            Some(lix) => {
                self.hash_keys(lix, keys.clone())?;
                self.keys.find_batch(
                    lix,
                    keys,
                    &self.scratch_hashes,
                    Then::Done,
                    &mut self.scratch_slots,
                );
                found.extend(self.scratch_slots.iter().map(|&es| es != NIL));
            }
        }
        let hits = found.iter().filter(|&&f| f).count() as u64;
        let o = &mut self.counters.outcomes;
        o.exists_hits += hits;
        o.exists_misses += n as u64 - hits;
        Ok(self.reply(slot, found))
    }

    /// Releases pins the calling session holds. Per entry `Unpinned`, or
    /// `NotPinned` if the session holds fewer than `count` pins on the key
    /// (then nothing changes for that entry: a count never underflows).
    pub fn unpin<'k, I>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        entries: I,
        now: Time,
    ) -> Result<Reply<Vec<UnpinOutcome>>, DirectoryError>
    where
        I: IntoIterator<Item = UnpinEntry<'k>>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        let entries = entries.into_iter();
        let n = entries.len();
        let r = self.unpin_inner(caller, seq, layout, entries, now);
        self.count_call(OpKind::Unpin, n, r.is_err());
        r
    }

    fn unpin_inner<'k>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        entries: impl ExactSizeIterator<Item = UnpinEntry<'k>> + Clone,
        now: Time,
    ) -> Result<Reply<Vec<UnpinOutcome>>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let n = entries.len();
        self.check_batch(n)?;
        Self::check_layout(&layout)?;
        if let Some(index) = entries.clone().position(|e| e.count == 0) {
            return Err(DirectoryError::InvalidUnpinCount { index });
        }
        let lix = self.layouts.get(&layout);
        let mut fp = Fingerprint::new(OpKind::Unpin, Some(&layout));
        self.probe_all(lix, entries.clone().map(|e| e.key), &mut fp)?;
        for e in entries.clone() {
            fp.add(u64::from(e.count));
        }
        let retried = self.replay(slot, caller, seq, fp, |body| match body {
            CachedBody::Unpin(v) => Some(v.clone()),
            _ => None,
        })?;
        if let Some(reply) = retried {
            return Ok(reply);
        }

        let mut outcomes = Vec::with_capacity(n);
        // Looked up once for the batch, not once per key.
        let session = self
            .sessions
            .get_mut(&caller.session)
            .expect("invariant: enter() checked the session");
        let ledger_before = (session.pins.len(), session.pins.buckets());
        let (mut unpinned, mut not_pinned) = (0u64, 0u64);
        for (&es, e) in self.scratch_slots.iter().zip(entries) {
            if es == NIL || !session.pins.release(es, e.count) {
                not_pinned += 1;
                outcomes.push(UnpinOutcome::NotPinned);
                continue;
            }
            session.pin_total -= u64::from(e.count);
            drop_pins(
                self.keys.get_mut(es),
                es,
                e.count,
                &mut self.totals,
                &mut self.lru,
                &mut self.regions,
            );
            unpinned += 1;
            outcomes.push(UnpinOutcome::Unpinned);
        }
        // A ledger left thin is rebuilt to fit while the ledgers together
        // are over their budget. Only an unpin thins a ledger, so every
        // ledger still thin was left so while all of them were within the
        // budget: together they stay within it plus what their pins need
        // (`DirectoryConfig::max_pinned_entries`).
        let budget = 2 * self.config.max_pinned_entries as u64;
        if self.totals.ledger_buckets > budget && session.pins.is_thin() {
            session.pins.shrink_to_fit();
        }
        // A ledger only shrinks here.
        self.totals.pin_entries -= (ledger_before.0 - session.pins.len()) as u64;
        self.totals.ledger_buckets -= (ledger_before.1 - session.pins.buckets()) as u64;
        self.counters.outcomes.unpinned += unpinned;
        self.counters.outcomes.not_pinned += not_pinned;
        self.record(slot, caller, seq, fp, CachedBody::Unpin(outcomes.clone()));
        Ok(self.reply(slot, outcomes))
    }

    /// Deletes keys (anyone may). Per key `Deleted`, `Pinned` (some session
    /// holds a pin; nothing changed) or `Missing`. Each deleted key's page is
    /// handed back to its region's owner with a freed-page notice, if the
    /// owner is present; a region whose owner is gone is freed with its last
    /// key. Refused as a whole if a notice queue would overflow.
    pub fn delete<'k, I>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        keys: I,
        now: Time,
    ) -> Result<Reply<Vec<DeleteOutcome>>, DirectoryError>
    where
        I: IntoIterator<Item = &'k [u8]>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        let keys = keys.into_iter();
        let n = keys.len();
        let r = self.delete_inner(caller, seq, layout, keys, now);
        self.count_call(OpKind::Delete, n, r.is_err());
        r
    }

    fn delete_inner<'k>(
        &mut self,
        caller: &Caller,
        seq: Sequence,
        layout: Layout,
        keys: impl ExactSizeIterator<Item = &'k [u8]> + Clone,
        now: Time,
    ) -> Result<Reply<Vec<DeleteOutcome>>, DirectoryError> {
        let slot = self.enter(caller, now)?;
        let n = keys.len();
        self.check_batch(n)?;
        Self::check_layout(&layout)?;
        let lix = self.layouts.get(&layout);
        let mut fp = Fingerprint::new(OpKind::Delete, Some(&layout));
        self.probe_all(lix, keys, &mut fp)?;
        let retried = self.replay(slot, caller, seq, fp, |body| match body {
            CachedBody::Delete(v) => Some(v.clone()),
            _ => None,
        })?;
        if let Some(reply) = retried {
            return Ok(reply);
        }
        self.check_notice_room()?;

        let mut outcomes = Vec::with_capacity(n);
        for i in 0..n {
            let es = self.scratch_slots[i];
            let outcome = if es == NIL || !self.keys.is_live(es) {
                self.counters.outcomes.delete_missing += 1;
                DeleteOutcome::Missing
            } else if self.keys.get(es).pins > 0 {
                self.counters.outcomes.delete_pinned += 1;
                DeleteOutcome::Pinned {
                    pins: self.keys.get(es).pins,
                }
            } else {
                // Found under the layout in use, so `probe_all` hashed it.
                self.remove_entry(es, self.scratch_hashes[i]);
                self.counters.outcomes.deleted += 1;
                DeleteOutcome::Deleted
            };
            outcomes.push(outcome);
        }
        self.record(slot, caller, seq, fp, CachedBody::Delete(outcomes.clone()));
        Ok(self.reply(slot, outcomes))
    }

    /// Refuses a delete whose notices would overflow an owner's queue. The
    /// slots to delete are in `scratch_slots`; a key repeated in the batch is
    /// counted twice, which only errs on the safe side.
    fn check_notice_room(&mut self) -> Result<(), DirectoryError> {
        // `scratch_counts` is all zeros between calls (set back below), so
        // the work is the batch's, not the number of instance slots.
        if self.scratch_counts.len() < self.instances.len() {
            self.scratch_counts.resize(self.instances.len(), 0);
        }
        let limit = self.config.notice_queue_limit;
        let mut result = Ok(());
        for &es in &self.scratch_slots {
            if let Some(owner) = self.notice_owner(es) {
                self.scratch_counts[owner as usize] += 1;
                let count = self.scratch_counts[owner as usize] as usize;
                let inst = self.instance(owner);
                let pending = inst.notices.pending();
                if result.is_ok() && pending + count > limit {
                    result = Err(DirectoryError::NoticeBacklog {
                        instance: inst.id.clone(),
                        pending,
                        max: limit,
                    });
                }
            }
        }
        for &es in &self.scratch_slots {
            if let Some(owner) = self.notice_owner(es) {
                self.scratch_counts[owner as usize] = 0;
            }
        }
        result
    }

    /// The instance a delete of entry `es` would send a freed-page notice
    /// to: its region's owner, if present and the key unpinned.
    fn notice_owner(&self, es: u32) -> Option<u32> {
        if es == NIL {
            return None;
        }
        let entry = self.keys.get(es);
        match self.regions.get(entry.region).owner {
            Owner::Present(owner) if entry.pins == 0 => Some(owner),
            _ => None,
        }
    }

    // --- shared internals -------------------------------------------------

    /// Checks every key's length (`KeyLength` for the first bad one) and
    /// hashes every key under the interned layout `lix` into
    /// `scratch_hashes`. The check rides the hashing pass rather than a pass
    /// of its own; nothing has changed when a key is refused.
    fn hash_keys<'k>(
        &mut self,
        lix: u32,
        keys: impl Iterator<Item = &'k [u8]>,
    ) -> Result<(), DirectoryError> {
        self.scratch_hashes.clear();
        for (index, key) in keys.enumerate() {
            Self::check_key(index, key)?;
            self.scratch_hashes.push(self.keys.hash(lix, key));
        }
        Ok(())
    }

    /// Checks every key's length (`KeyLength` for the first bad one, with
    /// nothing changed) and probes every key under the interned layout
    /// `lix` (a layout never interned has no keys) into `scratch_slots`
    /// (`NIL`: absent), folding the keys into the request fingerprint. The
    /// check rides the hashing pass rather than a pass of its own. All keys
    /// are hashed first and probed after: with a short probe loop the CPU
    /// overlaps the table, entry and key-byte cache misses of consecutive
    /// keys (measured ~30 % faster on a 100 k-key table than hashing and
    /// probing in one loop).
    fn probe_all<'k>(
        &mut self,
        lix: Option<u32>,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        fp: &mut Fingerprint,
    ) -> Result<(), DirectoryError> {
        self.scratch_key_hashes.clear();
        for (index, key) in keys.clone().enumerate() {
            Self::check_key(index, key)?;
            let kh = self.keys.key_hash(key);
            fp.add(kh);
            self.scratch_key_hashes.push(kh);
        }
        self.scratch_slots.clear();
        match lix {
            None => self
                .scratch_slots
                .resize(self.scratch_key_hashes.len(), NIL),
            Some(l) => {
                self.scratch_hashes.clear();
                self.scratch_hashes.extend(
                    self.scratch_key_hashes
                        .iter()
                        .map(|&kh| KeyIndex::entry_hash(kh, l)),
                );
                self.keys.find_batch(
                    l,
                    keys,
                    &self.scratch_hashes,
                    Then::ReadEntries,
                    &mut self.scratch_slots,
                );
            }
        }
        Ok(())
    }

    /// Removes an unpinned entry, stored under `hash` (its key's entry
    /// hash): its page is released, its owner (if present) gets a freed-page
    /// notice, and an orphaned region losing its last key is freed.
    pub(super) fn remove_entry(&mut self, es: u32, hash: u32) {
        let rs = self.keys.get(es).region;
        debug_assert_eq!(self.keys.get(es).pins, 0, "a pinned key is never removed");
        let region = self.regions.get_mut(rs);
        self.keys.region_list_unlink(&mut region.key_head, es);
        if let Some(lru) = &mut self.lru {
            lru.unlink(es);
        }
        let key_len = self.keys.key(es).len();
        let entry = self.keys.remove(es, hash);
        region.keys -= 1;
        region.page_states.release(entry.page);
        let page_size_bytes = region.page_size_bytes;
        let t = &mut self.totals;
        t.page_bytes -= page_size_bytes;
        t.value_bytes -= u64::from(entry.len_bytes);
        t.key_bytes -= key_len as u64;
        match region.owner {
            Owner::Present(owner) => {
                let id = region.handle.region;
                let inst = self.instance_mut(owner);
                inst.keys -= 1;
                inst.used_bytes -= page_size_bytes;
                inst.notices
                    .push(id, PageIndex(entry.page), Generation(entry.generation));
                self.counters.outcomes.notices_issued += 1;
            }
            Owner::Gone { .. } => {
                if region.keys == 0 {
                    let queued = region.orphan_queued;
                    self.free_region(rs);
                    if queued {
                        // Its queue entry is left behind (`Directory::orphans`).
                        self.orphans_stale += 1;
                        self.compact_orphans_if_due();
                    }
                }
            }
        }
    }

    /// Drops the orphan queue's stale entries once they outnumber the live
    /// ones (`Directory::orphans`): after a stale entry is added, and after
    /// eviction took live ones off the queue.
    pub(super) fn compact_orphans_if_due(&mut self) {
        if self.orphans_stale > self.orphans.len() / 2 {
            let regions = &self.regions;
            self.orphans
                .retain(|&(s, i)| regions.get_if(s, i).is_some());
            self.orphans_stale = 0;
        }
    }

    /// Drops `count` pins from an entry's total (the caller already took them
    /// out of a session's ledger).
    pub(super) fn release_pins(&mut self, es: u32, count: u32) {
        drop_pins(
            self.keys.get_mut(es),
            es,
            count,
            &mut self.totals,
            &mut self.lru,
            &mut self.regions,
        );
    }

    pub(super) fn location_of(&self, es: u32) -> Location {
        let entry = self.keys.get(es);
        Location {
            region: self.regions.get(entry.region).handle.region,
            page: PageIndex(entry.page),
            generation: Generation(entry.generation),
            len_bytes: entry.len_bytes,
        }
    }

    pub(super) fn check_batch(&self, len: usize) -> Result<(), DirectoryError> {
        if len > self.config.max_batch {
            return Err(DirectoryError::BatchTooLarge {
                len,
                max: self.config.max_batch,
            });
        }
        Ok(())
    }

    fn check_keys<'k>(keys: impl Iterator<Item = &'k [u8]>) -> Result<(), DirectoryError> {
        for (index, key) in keys.enumerate() {
            Self::check_key(index, key)?;
        }
        Ok(())
    }

    /// Key `index` of a request is 1 to `MAX_KEY_BYTES` bytes long.
    #[inline]
    fn check_key(index: usize, key: &[u8]) -> Result<(), DirectoryError> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(DirectoryError::KeyLength {
                index,
                len_bytes: key.len(),
                max_bytes: MAX_KEY_BYTES,
            });
        }
        Ok(())
    }

    /// Consults the reply window for a mutating request. `Ok(Some(reply))`:
    /// a retry, answered from the cache (counted in `retries_answered`);
    /// `Ok(None)`: run it.
    pub(super) fn replay<T>(
        &mut self,
        slot: u32,
        caller: &Caller,
        seq: Sequence,
        fp: Fingerprint,
        extract: impl FnOnce(&CachedBody) -> Option<T>,
    ) -> Result<Option<Reply<T>>, DirectoryError> {
        let retried = self.replay_uncounted(slot, caller, seq, fp, extract)?;
        if retried.is_some() {
            self.counters.outcomes.retries_answered += 1;
        }
        Ok(retried)
    }

    /// [`replay`](Self::replay) for a caller that may still refuse the
    /// retry it found (a region request whose waiters are full): it counts
    /// the retry in `retries_answered` itself once it answers it.
    pub(super) fn replay_uncounted<T>(
        &mut self,
        slot: u32,
        caller: &Caller,
        seq: Sequence,
        fp: Fingerprint,
        extract: impl FnOnce(&CachedBody) -> Option<T>,
    ) -> Result<Option<Reply<T>>, DirectoryError> {
        let replies = &mut self.instances[slot as usize]
            .as_mut()
            .expect("invariant: slot names a live instance")
            .replies;
        replies.replies_received_below(seq.replies_received_below);
        let body = match replies.check(seq.seq) {
            Ok(SeqCheck::Fresh) => return Ok(None),
            Ok(SeqCheck::Executed(cached)) => {
                if cached.fingerprint != fp.value() {
                    Err(DirectoryError::SequenceReused { seq: seq.seq })
                } else if matches!(cached.body, CachedBody::PinnedLookup(_))
                    && cached.session != caller.session
                {
                    Err(DirectoryError::PinsHeldByOtherSession {
                        seq: seq.seq,
                        original: cached.session,
                    })
                } else {
                    extract(&cached.body).ok_or(DirectoryError::SequenceReused { seq: seq.seq })
                }
            }
            Ok(SeqCheck::Evicted) => Err(DirectoryError::ReplyEvicted { seq: seq.seq }),
            Err(e) => Err(e),
        };
        let o = &mut self.counters.outcomes;
        match &body {
            Err(DirectoryError::ReplyEvicted { .. }) => o.replies_evicted += 1,
            Err(DirectoryError::SequenceTooOld { .. }) => o.sequence_too_old += 1,
            _ => {}
        }
        let body = body?;
        Ok(Some(self.reply(slot, body)))
    }

    /// Records a fresh request's reply in the window.
    pub(super) fn record(
        &mut self,
        slot: u32,
        caller: &Caller,
        seq: Sequence,
        fp: Fingerprint,
        body: CachedBody,
    ) {
        let limit = self.config.reply_cache_bytes_per_instance;
        self.instance_mut(slot).replies.record(
            seq.seq,
            CachedReply {
                fingerprint: fp.value(),
                session: caller.session,
                body,
            },
            limit,
        );
    }
}

/// Takes `count` pins off entry `es`'s total, which a session just gave up;
/// an entry left with none can be evicted again. (A function of the fields
/// it touches, so that a caller can hold a session's ledger meanwhile.)
#[inline]
fn drop_pins(
    entry: &mut Entry,
    es: u32,
    count: u32,
    totals: &mut Totals,
    lru: &mut Option<Lru>,
    regions: &mut RegionTable,
) {
    debug_assert!(entry.pins >= count, "pin total below a session's share");
    entry.pins -= count;
    totals.pins -= u64::from(count);
    if entry.pins == 0 {
        totals.pinned_keys -= 1;
        regions.get_mut(entry.region).pinned_keys -= 1;
        if let Some(lru) = lru {
            lru.link_front(es);
        }
    }
}
