//! The staged protocol: reads, writes, promotes, deletes, clears, and the
//! sweep and drain that reclaim staging.
//!
//! Every operation follows the same shape: check the arguments (a refusal
//! changes nothing), take the lock, classify each key against the local
//! maps, make at most the round trips the operation needs — each one batch
//! for all its keys — apply the answers, notify the listeners and the event
//! sink with the successful keys in input order. Releasing the lock asserts
//! the invariants (debug builds; `Locked` in `mod.rs`).

use super::events::Callback;
use super::staging::{PendingRead, PendingWrite, Staging};
use super::types::{Holds, KeyPage, SweepReport, TierCode, TierError, TierPage, WriteMode};
use super::{Counters, Inner, L1Tier, TierEvent};
use crate::client::staged::{PinRelease, PinnedLookup, PinnedLookups};
use crate::client::{ClientError, DeleteOutcome, PageLease, RegisterOutcome};
use cxlkv_controlplane::proto::Location;

/// The keys at `indices` (in that order).
fn pick<'k, K: AsRef<[u8]>>(keys: &'k [K], indices: &[usize]) -> Vec<&'k [u8]> {
    indices.iter().map(|&i| keys[i].as_ref()).collect()
}

/// The keys whose flag is set, in input order.
fn flagged<'k, K: AsRef<[u8]>>(keys: &'k [K], flags: &[bool]) -> Vec<&'k [u8]> {
    keys.iter()
        .zip(flags)
        .filter(|(_, f)| **f)
        .map(|(k, _)| k.as_ref())
        .collect()
}

impl L1Tier {
    /// Takes `holds` read holds on each key and returns a zero-copy view of
    /// its page (one pinning `Lookup` for the keys not staged here).
    ///
    /// Per key: write-staged here → `KeyNotReadable` (never pinned, even if
    /// a peer registered it); a private temporary → a local hold on the
    /// private page (no round trip; a peer's copy is never pinned); else
    /// the lookup: found → `Success` with `holds` pins taken and the page
    /// they protect (an overlapping reserve adds to the staged entry, and
    /// moves it to that page if the key moved after the staged pins were
    /// lost with a session — see `Staging::add_directory_read`); absent,
    /// unresolvable, or found by a lookup a reconnect raced and not pinned
    /// again where it was found (deleted or moved in between: see
    /// `client::staged`) → `KeyNotExist`. A failed lookup is `KeyNotExist`
    /// for each of its keys — or, if the client was closed or found
    /// unresumable under it, the call refused (`ClientClosed` /
    /// `ClientFailed`) with nothing changed. Each key is independent. Fires
    /// `reserved_read` and publishes `ReadReserved` with the hits (always).
    pub fn reserve_read<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        holds: Holds,
    ) -> Result<Vec<KeyPage>, TierError> {
        const OP: &str = "reserve_read";
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let t = u64::from(holds.get());
        let now = inner.cfg.clock.now();
        let deadline = now + inner.cfg.read_ttl;
        let mut out = vec![KeyPage::failed(TierCode::KeyNotExist); keys.len()];
        let mut ok = vec![false; keys.len()];
        let mut to_pin = Vec::new();
        let mut local = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ref();
            if st.has_write(key) {
                out[i].code = TierCode::KeyNotReadable;
                continue;
            }
            match st.read(key) {
                Some(r) if r.is_temporary() => local.push(i),
                _ => to_pin.push(i),
            }
        }
        // The round trip first: a client closed under it refuses the call
        // before anything changes here.
        let found = if to_pin.is_empty() {
            Vec::new()
        } else {
            inner.before_round_trip();
            match inner.lookup(&pick(keys, &to_pin), holds) {
                Ok(found) => found,
                Err(_) => {
                    inner.check_client_open(OP)?;
                    to_pin.iter().map(|_| PinnedLookup::Missing).collect()
                }
            }
        };
        for i in local {
            let r = st
                .read_mut(keys[i].as_ref())
                .expect("invariant: the temporary was found above under the same lock");
            r.holds += t;
            r.deadline = deadline;
            out[i] = KeyPage::success(r.page.clone());
            ok[i] = true;
        }
        for (i, found) in to_pin.iter().zip(found) {
            if let Some(page) = inner.stage_found(&mut st, keys[*i].as_ref(), found, t, deadline) {
                out[*i] = KeyPage::success(page);
                ok[*i] = true;
            }
        }
        let hits = flagged(keys, &ok);
        st.note_holds_taken(t, hits.len());
        inner.fire(&mut st, Callback::ReservedRead, &hits);
        inner.publish(&mut st, TierEvent::ReadReserved, &hits);
        Ok(out)
    }

    /// The staged page of each key, with no new hold, no round trip and no
    /// notification — only between `reserve_read` and its `finish_read`.
    /// Held in `R` → `Success`; an idle private temporary or a write-staged
    /// key → `KeyNotReadable`; otherwise `KeyNotExist`.
    pub fn unsafe_read<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<KeyPage>, TierError> {
        const OP: &str = "unsafe_read";
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let st = inner.lock(OP)?;
        let out = keys
            .iter()
            .map(|key| {
                let key = key.as_ref();
                match st.read(key) {
                    Some(r) if r.holds > 0 => KeyPage::success(r.page.clone()),
                    Some(_) => KeyPage::failed(TierCode::KeyNotReadable),
                    None if st.has_write(key) => KeyPage::failed(TierCode::KeyNotReadable),
                    None => KeyPage::failed(TierCode::KeyNotExist),
                }
            })
            .collect();
        Ok(out)
    }

    /// Releases up to `holds` holds of each key — never more than it has —
    /// and, inside this call, the directory pins behind them (one batched
    /// `Unpin`, answered before this returns; one that cannot be delivered
    /// ends the session instead, and the pins go when the server sees its
    /// connection close). Holds are a count per key, not per reservation:
    /// a late finish after the sweeper reclaimed its reservation releases
    /// holds of a newer one of the key, if any (as the reference's: its §4
    /// note holds only while the key stays unreserved). A key reaching zero
    /// holds leaves `R`; a private temporary's page is then reclaimed and
    /// the key reported deleted. Not staged → `KeyNotExist`; an idle private
    /// temporary → `KeyInWrongState` (nothing freed). For each listener
    /// `read_finished(released)` then `deleted(reclaimed)`; publishes
    /// `ReadFinished` then `KeysEvicted` (always).
    pub fn finish_read<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        holds: Holds,
    ) -> Result<Vec<TierCode>, TierError> {
        const OP: &str = "finish_read";
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let t = u64::from(holds.get());
        let mut out = vec![TierCode::KeyNotExist; keys.len()];
        let mut ok = vec![false; keys.len()];
        let mut freed = vec![false; keys.len()];
        let mut unpins: Vec<(&[u8], u64)> = Vec::new();
        let mut reclaimed: Vec<PageLease> = Vec::new();
        let mut released_total = 0u64;
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ref();
            let Some(r) = st.read_mut(key) else {
                tracing::debug!(?key, "finish_read of a key not read-staged");
                continue;
            };
            if r.holds == 0 {
                out[i] = TierCode::KeyInWrongState;
                continue;
            }
            let released = t.min(r.holds);
            if released < t {
                tracing::warn!(
                    ?key,
                    asked = t,
                    held = r.holds,
                    "finish_read releases only what is held"
                );
            }
            r.holds -= released;
            released_total += released;
            let unpin_now = released.min(r.pinned);
            r.pinned -= unpin_now;
            if unpin_now > 0 {
                unpins.push((key, unpin_now));
            }
            if r.holds == 0 {
                let r = st
                    .take_read(key)
                    .expect("invariant: the entry was found above under the same lock");
                if let Some(lease) = r.private {
                    reclaimed.push(lease);
                    freed[i] = true;
                }
            }
            out[i] = TierCode::Success;
            ok[i] = true;
        }
        st.note_holds_released(released_total);
        inner.release(&unpins);
        Counters::add(
            &inner.counters.temporaries_reclaimed,
            reclaimed.len() as u64,
        );
        drop(reclaimed);
        let (finished, deleted) = (flagged(keys, &ok), flagged(keys, &freed));
        inner.fire_pair(
            &mut st,
            (Callback::ReadFinished, &finished),
            (Callback::Deleted, &deleted),
        );
        inner.publish(&mut st, TierEvent::ReadFinished, &finished);
        inner.publish(&mut st, TierEvent::KeysEvicted, &deleted);
        Ok(out)
    }

    /// Reserves a page per key for the engine to fill in place (chunks of
    /// `len_bytes`, at most the page size), private to this tier until
    /// `finish_write`. Only [`WriteMode::New`]; `is_temporary` pairs with
    /// `keys` by position (a temporary is a promote/prefetch buffer that is
    /// never shared).
    ///
    /// Per key: staged here (either map) or already registered (one
    /// `Exists` round trip; if it fails, every candidate is treated as
    /// absent and `finish_write` deduplicates; if the client was closed or
    /// found unresumable under it, the call is refused with nothing
    /// changed) → `KeyNotWritable`. The rest is allocated all or nothing:
    /// if the allocator cannot fit it, or a page it gave cannot be placed
    /// (its region taken from the layout at a reattach), each of those keys
    /// is `OutOfMemory`, every page goes back and nothing is staged. Fires
    /// `reserved_write` and publishes `WriteReserved` with the reserved
    /// keys — except when nothing was allocated (no candidate, all existing,
    /// or out of memory), which returns without notifying.
    pub fn reserve_write<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        is_temporary: &[bool],
        len_bytes: usize,
        mode: WriteMode,
    ) -> Result<Vec<KeyPage>, TierError> {
        const OP: &str = "reserve_write";
        let inner = &self.inner;
        if mode != WriteMode::New {
            return Err(TierError::UnsupportedMode { mode });
        }
        if is_temporary.len() != keys.len() {
            return Err(TierError::LengthMismatch {
                op: OP,
                keys: keys.len(),
                flags: is_temporary.len(),
            });
        }
        let page_size_bytes = inner.layout.page_size_bytes() as usize;
        if len_bytes == 0 || len_bytes > page_size_bytes {
            return Err(TierError::ChunkLength {
                len_bytes,
                page_size_bytes,
            });
        }
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let mut out = vec![KeyPage::failed(TierCode::KeyNotWritable); keys.len()];
        let candidates: Vec<usize> = (0..keys.len())
            .filter(|&i| {
                let k = keys[i].as_ref();
                !st.has_write(k) && !st.has_read(k)
            })
            .collect();
        if candidates.is_empty() {
            return Ok(out);
        }
        Counters::add(&inner.counters.exists, 1);
        inner.before_round_trip();
        let present = match inner.layout.batch_exists(&pick(keys, &candidates)) {
            Ok(p) => p,
            Err(e) => {
                inner.check_client_open(OP)?;
                tracing::warn!(error = %e, "reserve_write: exists failed; registration will deduplicate");
                vec![false; candidates.len()]
            }
        };
        let needed: Vec<usize> = candidates
            .iter()
            .zip(&present)
            .filter(|(_, p)| !**p)
            .map(|(&i, _)| i)
            .collect();
        if needed.is_empty() {
            return Ok(out);
        }
        let leases = match inner.layout.batch_alloc(needed.len()) {
            Ok(l) => l,
            Err(e) => {
                inner.check_client_open(OP)?;
                tracing::debug!(error = %e, keys = needed.len(), "reserve_write: out of memory");
                for &i in &needed {
                    out[i].code = TierCode::OutOfMemory;
                }
                return Ok(out);
            }
        };
        // Every page placed before any is staged: all or nothing.
        let mut placed = Vec::with_capacity(leases.len());
        for mut lease in leases {
            let view = lease
                .set_len(len_bytes)
                .and_then(|()| inner.layout.place_lease(&mut lease));
            match view {
                Ok(p) => placed.push((lease, TierPage::from_placed(p))),
                Err(e) => {
                    // The region was taken from the layout under us (refused
                    // at a reattach): this page cannot be served. As when
                    // the allocator cannot fit the batch, nothing is staged
                    // and nobody is told; the leases drop here, every page
                    // back once (a retry allocates elsewhere).
                    tracing::warn!(error = %e, keys = needed.len(), "reserve_write: an allocated page has no mapping; out of memory for the batch");
                    for &i in &needed {
                        out[i].code = TierCode::OutOfMemory;
                    }
                    return Ok(out);
                }
            }
        }
        let deadline = inner.cfg.clock.now() + inner.cfg.write_ttl;
        let mut ok = vec![false; keys.len()];
        for (&i, (lease, page)) in needed.iter().zip(placed) {
            st.insert_write(
                keys[i].as_ref(),
                PendingWrite {
                    lease,
                    page: page.clone(),
                    is_temporary: is_temporary[i],
                    deadline,
                },
            );
            out[i] = KeyPage::success(page);
            ok[i] = true;
        }
        let reserved = flagged(keys, &ok);
        inner.fire(&mut st, Callback::ReservedWrite, &reserved);
        inner.publish(&mut st, TierEvent::WriteReserved, &reserved);
        Ok(out)
    }

    /// Completes writes. A temporary completes **privately**: its page
    /// moves to `R` with no hold (idle, reclaimed by `delete`, `clear`,
    /// `close` or the sweeper), is never registered and never reported as
    /// written. Retained keys are registered in one round trip: `Inserted`
    /// or `Duplicate` (someone registered it first; the client returned our
    /// page to its allocator, exactly once) → `Success`; refused →
    /// `KeyInWrongState` (page reclaimed); outcome unknown after every retry
    /// → `KeyInWrongState` with the page kept by the client until it learns
    /// the outcome (never freed while possibly registered; a key it learns
    /// was registered is never announced — see docs/l1-tier.md, *A
    /// registration of unknown outcome*). Not
    /// write-staged → `KeyNotExist`. Fires `write_finished(registered)`
    /// always; publishes `WriteFinished` only when something registered.
    pub fn finish_write<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<TierCode>, TierError> {
        const OP: &str = "finish_write";
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let deadline = inner.cfg.clock.now() + inner.cfg.read_ttl;
        let mut out = vec![TierCode::KeyNotExist; keys.len()];
        let mut retained = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ref();
            let Some(w) = st.take_write(key) else {
                tracing::debug!(?key, "finish_write of a key not write-staged");
                continue;
            };
            if w.is_temporary {
                st.insert_read(
                    key,
                    PendingRead {
                        page: w.page,
                        holds: 0,
                        pinned: 0,
                        private: Some(w.lease),
                        deadline,
                    },
                );
                out[i] = TierCode::Success;
            } else {
                retained.push((i, w));
            }
        }
        let mut registered = vec![false; keys.len()];
        for (i, code) in inner.register(&mut st, keys, retained) {
            out[i] = code;
            registered[i] = code == TierCode::Success;
        }
        let written = flagged(keys, &registered);
        inner.fire(&mut st, Callback::WriteFinished, &written);
        if !written.is_empty() {
            inner.publish(&mut st, TierEvent::WriteFinished, &written);
        }
        Ok(out)
    }

    /// Promote (L2 → L1): completes write-staged keys and takes `holds`
    /// read holds on each in the same call. A temporary becomes a private
    /// held page (no round trip; the last `finish_read` reclaims it) and the
    /// result is the page the caller wrote. A retained key is registered,
    /// then pinned and resolved (two round trips for all such keys): the
    /// result is the directory's page — the winner's, if someone registered
    /// the key first. A key that registered but could not be pinned, or
    /// did not register, is `KeyInWrongState`; not write-staged →
    /// `KeyNotExist`; also read-staged (impossible under I1, checked
    /// anyway) → `KeyInWrongState` with its write staging left intact.
    /// Fires `finish_write_and_reserve_read` and publishes
    /// `WriteFinishedAndReadReserved` with the successful keys (always) —
    /// never `write_finished`, so the key is not copied back to L2.
    pub fn finish_write_and_reserve_read<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        holds: Holds,
    ) -> Result<Vec<KeyPage>, TierError> {
        const OP: &str = "finish_write_and_reserve_read";
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let t = u64::from(holds.get());
        let deadline = inner.cfg.clock.now() + inner.cfg.read_ttl;
        let mut out = vec![KeyPage::failed(TierCode::KeyNotExist); keys.len()];
        let mut ok = vec![false; keys.len()];
        let mut retained = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ref();
            if !st.has_write(key) {
                tracing::debug!(?key, "promote of a key not write-staged");
                continue;
            }
            if st.has_read(key) {
                out[i].code = TierCode::KeyInWrongState;
                continue;
            }
            let w = st
                .take_write(key)
                .expect("invariant: the key was found in W above under the same lock");
            if w.is_temporary {
                st.insert_read(
                    key,
                    PendingRead {
                        page: w.page.clone(),
                        holds: t,
                        pinned: 0,
                        private: Some(w.lease),
                        deadline,
                    },
                );
                out[i] = KeyPage::success(w.page);
                ok[i] = true;
            } else {
                retained.push((i, w));
            }
        }
        let mut registered = Vec::new();
        for (i, code) in inner.register(&mut st, keys, retained) {
            out[i].code = TierCode::KeyInWrongState;
            if code == TierCode::Success {
                registered.push(i);
            }
        }
        if !registered.is_empty() {
            let reg_keys = pick(keys, &registered);
            // A failure leaves these keys registered but not held:
            // `KeyInWrongState` (the reference's answer), whatever the cause.
            let found = inner
                .lookup(&reg_keys, holds)
                .unwrap_or_else(|_| registered.iter().map(|_| PinnedLookup::Missing).collect());
            for (i, found) in registered.iter().zip(found) {
                if let Some(page) =
                    inner.stage_found(&mut st, keys[*i].as_ref(), found, t, deadline)
                {
                    out[*i] = KeyPage::success(page);
                    ok[*i] = true;
                }
            }
        }
        let promoted = flagged(keys, &ok);
        st.note_holds_taken(t, promoted.len());
        inner.fire(&mut st, Callback::FinishWriteAndReserveRead, &promoted);
        inner.publish(&mut st, TierEvent::WriteFinishedAndReadReserved, &promoted);
        Ok(out)
    }

    /// Deletes keys. `force` is accepted for interface parity and ignored:
    /// a held key may be another process's read, so it is always refused.
    ///
    /// Per key: an idle private temporary → its page reclaimed locally
    /// (the directory is not contacted, so a peer's same-key copy is
    /// untouched) → `Success`; any other staging here → `KeyIsLocked`;
    /// otherwise one batched `Delete` for all such keys: `Deleted` →
    /// `Success`, `Pinned` → `KeyIsLocked` (retry later), `Missing` →
    /// `KeyNotExist`, no answer → `KeyIsLocked` — or, if the client was
    /// closed or found unresumable under it, the call refused with nothing
    /// changed (the round trip comes before the local reclaims). Fires
    /// `deleted` and publishes `KeysEvicted` with the removed keys only
    /// (always).
    pub fn delete<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        force: bool,
    ) -> Result<Vec<TierCode>, TierError> {
        const OP: &str = "delete";
        let _ = force;
        let inner = &self.inner;
        inner.check_keys(OP, keys)?;
        let mut st = inner.lock(OP)?;
        let mut out = vec![TierCode::KeyIsLocked; keys.len()];
        let mut removed = vec![false; keys.len()];
        let mut remote = Vec::new();
        let mut local = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ref();
            match st.read(key) {
                Some(r) if r.is_idle_temporary() => local.push(i),
                Some(_) => {}
                None if st.has_write(key) => {}
                None => remote.push(i),
            }
        }
        // The round trip first: a client closed under it refuses the call
        // before the idle temporaries are reclaimed.
        if !remote.is_empty() {
            Counters::add(&inner.counters.deletes, 1);
            inner.before_round_trip();
            match inner.layout.batch_delete(&pick(keys, &remote)) {
                Ok(outcomes) => {
                    for (&i, outcome) in remote.iter().zip(outcomes) {
                        out[i] = match outcome {
                            DeleteOutcome::Deleted => {
                                st.audit.dir_deleted(keys[i].as_ref());
                                removed[i] = true;
                                TierCode::Success
                            }
                            DeleteOutcome::Pinned { .. } => TierCode::KeyIsLocked,
                            DeleteOutcome::Missing => TierCode::KeyNotExist,
                        };
                    }
                }
                Err(e) => {
                    inner.check_client_open(OP)?;
                    tracing::warn!(error = %e, keys = remote.len(), "delete failed; keys reported locked (retryable)");
                }
            }
        }
        let mut reclaimed = Vec::with_capacity(local.len());
        for i in local {
            let r = st
                .take_read(keys[i].as_ref())
                .expect("invariant: the entry was found above under the same lock");
            reclaimed.extend(r.private);
            out[i] = TierCode::Success;
            removed[i] = true;
        }
        Counters::add(
            &inner.counters.temporaries_reclaimed,
            reclaimed.len() as u64,
        );
        drop(reclaimed);
        let deleted = flagged(keys, &removed);
        inner.fire(&mut st, Callback::Deleted, &deleted);
        inner.publish(&mut st, TierEvent::KeysEvicted, &deleted);
        Ok(out)
    }

    /// Drops local staging; shared directory data is never deleted (other
    /// instances may be using it). Non-force: reclaims every idle private
    /// temporary and keeps every held read and staged write; notifies
    /// `deleted` / `KeysEvicted` only when something was reclaimed.
    /// `force`: drains everything — every pin released (batched: one
    /// `Unpin` per `max_batch` entries), every private and write page
    /// reclaimed — and notifies with the dropped keys (reads, then writes),
    /// always. Force is unsafe for operations in flight, as in the
    /// reference.
    pub fn clear(&self, force: bool) -> Result<(), TierError> {
        const OP: &str = "clear";
        let inner = &self.inner;
        let mut st = inner.lock(OP)?;
        if force {
            let dropped = inner.drain(&mut st);
            if !dropped.is_empty() {
                tracing::warn!(keys = dropped.len(), "clear(force) dropped live staging");
            }
            let dropped: Vec<&[u8]> = dropped.iter().map(AsRef::as_ref).collect();
            inner.fire(&mut st, Callback::Deleted, &dropped);
            inner.publish(&mut st, TierEvent::KeysEvicted, &dropped);
        } else {
            let idle = st.idle_temporaries();
            let mut reclaimed = Vec::with_capacity(idle.len());
            for key in &idle {
                if let Some(r) = st.take_read(key) {
                    reclaimed.extend(r.private);
                }
            }
            Counters::add(
                &inner.counters.temporaries_reclaimed,
                reclaimed.len() as u64,
            );
            drop(reclaimed);
            if !idle.is_empty() {
                let idle: Vec<&[u8]> = idle.iter().map(AsRef::as_ref).collect();
                inner.fire(&mut st, Callback::Deleted, &idle);
                inner.publish(&mut st, TierEvent::KeysEvicted, &idle);
            }
        }
        Ok(())
    }
}

impl Inner {
    /// One pinning lookup of `keys` (`holds` pins each). A failure of the
    /// round trip is logged and returned — the client has already made sure
    /// no pin of unknown state survives it; the callers answer it as a miss
    /// for every key (`reserve_read` refuses the call instead when the
    /// client is closed or unresumable). The release of the pins it rolled
    /// back (keys found but not placeable) is counted as any other.
    fn lookup(&self, keys: &[&[u8]], holds: Holds) -> Result<Vec<PinnedLookup>, ClientError> {
        Counters::add(&self.counters.lookups, 1);
        match self.layout.lookup_pinned(keys, holds.get()) {
            Ok(PinnedLookups { found, rollback }) => {
                if let Some(released) = rollback {
                    self.count_release(released);
                }
                Ok(found)
            }
            Err(e) => {
                tracing::warn!(error = %e, keys = keys.len(), "pinning lookup failed; no key served");
                Err(e)
            }
        }
    }

    /// Stages what a pinning lookup found for `key` (`t` pins taken): a new
    /// directory read, or `t` more holds on the existing one. Returns the
    /// page served — always the one the pins protect — or `None` for a
    /// miss.
    fn stage_found(
        &self,
        st: &mut Staging,
        key: &[u8],
        found: PinnedLookup,
        t: u64,
        deadline: std::time::Duration,
    ) -> Option<TierPage> {
        match found {
            PinnedLookup::Found(placed) => {
                Some(st.add_directory_read(key, TierPage::from_placed(placed), t, deadline))
            }
            PinnedLookup::Missing => None,
            PinnedLookup::PinsLost => {
                // The client took them out of its ledger; none is held.
                Counters::add(&self.counters.pins_lost, t);
                None
            }
            PinnedLookup::Unresolvable(e) => {
                tracing::warn!(error = %e, ?key, "a found key's page cannot be mapped; reported missing");
                None
            }
        }
    }

    /// Registers retained write stagings in one round trip; the code of
    /// each (by input index): `Success` when the key is now registered (by
    /// us, or by someone first), `KeyInWrongState` otherwise.
    fn register<K: AsRef<[u8]>>(
        &self,
        st: &mut Staging,
        keys: &[K],
        retained: Vec<(usize, PendingWrite)>,
    ) -> Vec<(usize, TierCode)> {
        if retained.is_empty() {
            return Vec::new();
        }
        Counters::add(&self.counters.registers, 1);
        let indices: Vec<usize> = retained.iter().map(|(i, _)| *i).collect();
        let locations: Vec<Location> = retained.iter().map(|(_, w)| w.lease.location()).collect();
        let entries: Vec<(&[u8], PageLease)> = retained
            .into_iter()
            .map(|(i, w)| (keys[i].as_ref(), w.lease))
            .collect();
        let codes: Vec<TierCode> = match self.layout.batch_register(entries) {
            Ok(outcomes) => outcomes
                .into_iter()
                .zip(&indices)
                .map(|(o, &i)| match o {
                    RegisterOutcome::Inserted | RegisterOutcome::Duplicate(_) => {
                        st.audit.registered(keys[i].as_ref());
                        TierCode::Success
                    }
                    RegisterOutcome::Rejected(reason) => {
                        tracing::warn!(?reason, "registration refused; page reclaimed");
                        TierCode::KeyInWrongState
                    }
                })
                .collect(),
            Err(e) => {
                if matches!(e, ClientError::Indeterminate { .. }) {
                    Counters::add(&self.counters.registers_unresolved, 1);
                    self.note_unknown_outcomes(st, &locations);
                }
                tracing::warn!(error = %e, keys = indices.len(), "registration failed");
                vec![TierCode::KeyInWrongState; indices.len()]
            }
        };
        indices.into_iter().zip(codes).collect()
    }

    /// Releases pins now (synchronous, batched: one `Unpin` per
    /// `max_batch` entries, a count above the per-entry limit taking
    /// several; see `client::staged`). Like the reference's "safe unpin",
    /// a failure is logged, never raised: the pins then die with the
    /// session.
    fn release(&self, items: &[(&[u8], u64)]) {
        if items.is_empty() {
            return;
        }
        self.count_release(self.layout.release_pins(items));
    }

    /// Counts what a release did (and logs what it could not do).
    fn count_release(&self, released: Result<PinRelease, ClientError>) {
        match released {
            Ok(r) => {
                Counters::add(&self.counters.unpin_round_trips, r.round_trips);
                Counters::add(&self.counters.pins_released, r.released);
                Counters::add(&self.counters.pins_lost, r.lost_with_session + r.not_held);
                if r.not_held > 0 || r.lost_with_session > 0 {
                    tracing::warn!(
                        not_held = r.not_held,
                        lost = r.lost_with_session,
                        "some pins were already gone"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "unpin failed; the pins die with the session"),
        }
    }

    /// Empties the staging: batched unpins of every read's pins, every
    /// private and write page reclaimed. Returns the dropped keys (reads,
    /// then writes). Notifies nobody.
    pub(super) fn drain(&self, st: &mut Staging) -> Vec<Box<[u8]>> {
        let (reads, writes) = st.take_all();
        let unpins: Vec<(&[u8], u64)> = reads
            .iter()
            .filter(|(_, r)| r.pinned > 0)
            .map(|(k, r)| (k.as_ref(), r.pinned))
            .collect();
        self.release(&unpins);
        let mut dropped = Vec::with_capacity(reads.len() + writes.len());
        let mut temporaries = 0u64;
        for (key, r) in reads {
            temporaries += u64::from(r.is_temporary());
            dropped.push(key);
        }
        Counters::add(&self.counters.temporaries_reclaimed, temporaries);
        dropped.extend(writes.into_iter().map(|(key, _)| key));
        dropped
    }

    /// One TTL sweep (see `sweeper.rs`): `now` is read before the lock.
    pub(super) fn sweep(&self) -> Result<SweepReport, TierError> {
        const OP: &str = "sweep";
        let now = self.cfg.clock.now();
        let mut st = self.lock(OP)?;
        let expired_writes = st.expired_writes(now);
        let expired_reads = st.expired_reads(now);
        if expired_writes.is_empty() && expired_reads.is_empty() {
            return Ok(SweepReport::default());
        }
        let writes: Vec<PendingWrite> = expired_writes
            .iter()
            .filter_map(|k| st.take_write(k))
            .collect();
        let reads: Vec<(&[u8], PendingRead)> = expired_reads
            .iter()
            .filter_map(|k| st.take_read(k).map(|r| (k.as_ref(), r)))
            .collect();
        let unpins: Vec<(&[u8], u64)> = reads
            .iter()
            .filter(|(_, r)| r.pinned > 0)
            .map(|(k, r)| (*k, r.pinned))
            .collect();
        self.release(&unpins);
        let temporaries = reads.iter().filter(|(_, r)| r.is_temporary()).count() as u64;
        let report = SweepReport {
            writes: writes.len() as u64,
            reads: reads.len() as u64,
        };
        drop(writes);
        drop(reads);
        Counters::add(&self.counters.temporaries_reclaimed, temporaries);
        Counters::add(&self.counters.swept, report.writes + report.reads);
        tracing::warn!(
            writes = report.writes,
            reads = report.reads,
            "L1 sweeper reclaimed expired staging"
        );
        Ok(report)
    }
}
