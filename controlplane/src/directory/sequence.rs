//! Exactly-once: the per-instance sequence window and reply cache.
//!
//! ## The window rule
//!
//! Every mutating request (`register`, `lookup` with pins, `unpin`, `delete`,
//! `request_region`, `return_region`) carries a sequence number `seq` that is
//! unique per *instance* (not per session, so a retry after a reconnect, on a
//! new session of the same instance, is still recognised). Requests may arrive
//! in any order (many client threads pipeline them). With `high` the highest
//! sequence number executed so far and `W` the window width:
//!
//! - `seq > high`: new; executed, and `high` becomes `seq`;
//! - `high - W < seq ≤ high` (and `seq ≥ floor`): inside the window. If it was
//!   executed, the cached reply is returned and nothing runs again; if not (it
//!   was overtaken by higher numbers), it is executed now;
//! - `seq ≤ high - W`, or `seq < floor`: refused with `SequenceTooOld` — the
//!   directory can no longer tell whether it ran;
//! - `seq > MAX_SEQUENCE`: refused with `SequenceOutOfRange` (so `high + 1`
//!   never overflows).
//!
//! The client's side of the contract: never let its newest sequence number
//! run `W` or more ahead of its oldest request still awaiting a reply. Then
//! every retry lands inside the window. `floor` is 1 for a new instance and
//! the client's `next_seq` after a `Recovered` reattach (requests sent to a
//! previous directory incarnation are void, not replayed).
//!
//! Only successful replies are cached; a request answered with an error
//! changed nothing and does not consume its number, so its retry is evaluated
//! afresh. A retry is matched against a fingerprint of the original (kind,
//! layout, per-key hashes and arguments); a different request under a used
//! number gets `SequenceReused`.
//!
//! Cached bodies are dropped when they leave the window, when the client says
//! it received them (`replies_received_below`), or, oldest first, when the
//! instance's cache exceeds its byte limit — a region request still waiting
//! for the pool manager excepted: its body is what hands the grant to a
//! retry whose first reply was lost, so only the window (which a client
//! keeping the contract above never moves past a request awaiting its
//! reply) or a failed allocation (`forget`) removes it. Whether a number
//! *ran* is kept in a bitmap for the whole window regardless, so a retry of
//! a number whose body was dropped gets `ReplyEvicted` — never a second
//! execution.

use std::collections::VecDeque;

use super::MAX_SEQUENCE;
use super::error::DirectoryError;
use super::types::{
    DeleteOutcome, EndedSession, LookupReply, PoolRequestId, RegionGrant, RegisterOutcome,
    SessionId, UnpinOutcome,
};

/// A reply kept for retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CachedReply {
    pub fingerprint: u64,
    /// The session that ran the request (pins taken by a lookup belong to it).
    pub session: SessionId,
    pub body: CachedBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CachedBody {
    Register(Vec<RegisterOutcome>),
    /// Only lookups that took pins are sequenced and cached.
    PinnedLookup(LookupReply),
    Unpin(Vec<UnpinOutcome>),
    Delete(Vec<DeleteOutcome>),
    /// The pool manager has not answered yet.
    RegionPending(PoolRequestId),
    RegionGranted(RegionGrant),
    RegionReturned,
    EndSession(EndedSession),
}

impl CachedReply {
    fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let heap = match &self.body {
            CachedBody::Register(v) => v.len() * size_of::<RegisterOutcome>(),
            CachedBody::PinnedLookup(r) => {
                r.locations.len() * size_of::<Option<super::types::Location>>()
                    + r.regions.len() * size_of::<super::types::RegionDescriptor>()
            }
            CachedBody::Unpin(v) => v.len() * size_of::<UnpinOutcome>(),
            CachedBody::Delete(v) => v.len() * size_of::<DeleteOutcome>(),
            CachedBody::RegionPending(_)
            | CachedBody::RegionGranted(_)
            | CachedBody::RegionReturned
            | CachedBody::EndSession(_) => 0,
        };
        size_of::<Self>() + heap
    }
}

/// What the window says about an incoming sequence number.
#[derive(Debug)]
pub(crate) enum SeqCheck<'a> {
    /// Not executed yet: run it.
    Fresh,
    /// Executed; here is its reply.
    Executed(&'a CachedReply),
    /// Executed, but the reply body was dropped.
    Evicted,
}

#[derive(Debug)]
pub(crate) struct ReplyWindow {
    floor: u64,
    /// Highest executed sequence number (`floor - 1` before the first).
    high: u64,
    width: u64,
    /// Ring bitmap over `seq % width`: set iff `seq` (within the window) ran.
    executed: Box<[u64]>,
    cache: ReplyCache,
    cache_bytes: usize,
}

/// Cached replies by ascending sequence number. A ring rather than a
/// `BTreeMap`: a client that acknowledges its replies as it goes keeps one
/// or two bodies cached, so every mutating request would otherwise allocate
/// a tree node on insert and free it when the previous reply is dropped.
/// Numbers mostly arrive in order (an append); a pipelined client's
/// overtaken numbers are inserted in place, within a window of bounded width.
/// A ring's capacity that is never given back (entries).
const SHRINK_ABOVE: usize = 64;

#[derive(Debug, Default)]
struct ReplyCache(VecDeque<(u64, CachedReply)>);

impl ReplyCache {
    fn position(&self, seq: u64) -> Result<usize, usize> {
        self.0.binary_search_by_key(&seq, |(s, _)| *s)
    }

    fn get(&self, seq: u64) -> Option<&CachedReply> {
        self.position(seq).ok().map(|i| &self.0[i].1)
    }

    fn get_mut(&mut self, seq: u64) -> Option<&mut CachedReply> {
        self.position(seq).ok().map(|i| &mut self.0[i].1)
    }

    /// Inserts or replaces; returns the replaced reply.
    fn insert(&mut self, seq: u64, reply: CachedReply) -> Option<CachedReply> {
        if self.0.back().is_none_or(|(last, _)| *last < seq) {
            self.0.push_back((seq, reply));
            return None;
        }
        match self.position(seq) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, reply)),
            Err(i) => {
                self.0.insert(i, (seq, reply));
                None
            }
        }
    }

    fn remove(&mut self, seq: u64) -> Option<CachedReply> {
        let i = self.position(seq).ok()?;
        self.0.remove(i).map(|(_, r)| r)
    }

    /// Removes the oldest reply for which `may_go(seq, reply)` holds.
    fn remove_oldest_where(
        &mut self,
        may_go: impl Fn(u64, &CachedReply) -> bool,
    ) -> Option<CachedReply> {
        let i = self.0.iter().position(|(s, r)| may_go(*s, r))?;
        if i == 0 {
            return self.pop_first();
        }
        self.0.remove(i).map(|(_, r)| r)
    }

    fn first(&self) -> Option<(u64, &CachedReply)> {
        self.0.front().map(|(s, r)| (*s, r))
    }

    fn pop_first(&mut self) -> Option<CachedReply> {
        let first = self.0.pop_front().map(|(_, r)| r);
        // Keep the ring's memory near what the instance uses: a burst of
        // pipelined requests may have grown it to the window's width.
        if self.0.capacity() > SHRINK_ABOVE && self.0.len() < self.0.capacity() / 8 {
            self.0.shrink_to(self.0.len() * 2);
        }
        first
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().map(|(s, _)| *s)
    }
}

impl ReplyWindow {
    /// A window accepting sequence numbers from `floor` (1..=MAX_SEQUENCE)
    /// on.
    pub fn new(floor: u64, width: u64) -> Self {
        debug_assert!((1..=MAX_SEQUENCE).contains(&floor));
        debug_assert!(width >= 64 && width.is_multiple_of(64));
        Self {
            floor,
            high: floor - 1,
            width,
            executed: vec![0u64; (width / 64) as usize].into_boxed_slice(),
            cache: ReplyCache::default(),
            cache_bytes: 0,
        }
    }

    /// The lowest sequence number still accepted.
    pub fn oldest_accepted(&self) -> u64 {
        self.floor.max((self.high + 1).saturating_sub(self.width))
    }

    fn bit(&self, seq: u64) -> (usize, u64) {
        let pos = seq % self.width;
        ((pos / 64) as usize, 1u64 << (pos % 64))
    }

    fn ran(&self, seq: u64) -> bool {
        let (word, mask) = self.bit(seq);
        self.executed[word] & mask != 0
    }

    pub fn check(&self, seq: u64) -> Result<SeqCheck<'_>, DirectoryError> {
        if seq > MAX_SEQUENCE {
            return Err(DirectoryError::SequenceOutOfRange {
                field: "seq",
                value: seq,
                max: MAX_SEQUENCE,
            });
        }
        let oldest = self.oldest_accepted();
        if seq < oldest {
            return Err(DirectoryError::SequenceTooOld {
                seq,
                oldest_accepted: oldest,
            });
        }
        if seq > self.high || !self.ran(seq) {
            return Ok(SeqCheck::Fresh);
        }
        Ok(match self.cache.get(seq) {
            Some(reply) => SeqCheck::Executed(reply),
            None => SeqCheck::Evicted,
        })
    }

    /// Records that `seq` (checked `Fresh`) ran and answered `reply`.
    pub fn record(&mut self, seq: u64, reply: CachedReply, byte_limit: usize) {
        debug_assert!(seq >= self.oldest_accepted());
        if seq > self.high {
            if seq - self.high >= self.width {
                self.executed.iter_mut().for_each(|w| *w = 0);
            } else {
                for s in self.high + 1..=seq {
                    let (word, mask) = self.bit(s);
                    self.executed[word] &= !mask;
                }
            }
            self.high = seq;
            let oldest = self.oldest_accepted();
            while let Some((first, _)) = self.cache.first() {
                if first >= oldest {
                    break;
                }
                if let Some(old) = self.cache.pop_first() {
                    self.cache_bytes -= old.approx_bytes();
                }
            }
        }
        let (word, mask) = self.bit(seq);
        self.executed[word] |= mask;
        self.cache_bytes += reply.approx_bytes();
        if let Some(old) = self.cache.insert(seq, reply) {
            self.cache_bytes -= old.approx_bytes();
        }
        // Over the limit: the oldest bodies go first, except the one just
        // recorded and region requests pending or granted but not yet
        // acknowledged (`replies_received_below` drops a grant the client
        // has). Such a body is the only record of a grant: were it dropped,
        // a retry after a lost completion would get `ReplyEvicted` and the
        // granted region would stay assigned with no client knowing its id
        // until the instance is gone (reliability entry 142). A client
        // holds the request's number back as its oldest unanswered one
        // meanwhile, so its other replies pile up behind it; the grant must
        // not be the first of them to go. These bodies are few (a pending
        // or granted region per request, within the instance's region and
        // pending-request limits) and small.
        while self.cache_bytes > byte_limit {
            let Some(old) = self.cache.remove_oldest_where(|s, r| {
                s != seq
                    && !matches!(
                        r.body,
                        CachedBody::RegionPending(_) | CachedBody::RegionGranted(_)
                    )
            }) else {
                break;
            };
            self.cache_bytes -= old.approx_bytes();
        }
    }

    /// Undoes `record` for a request that finally failed (a deferred region
    /// request the pool manager refused): its number may be retried.
    pub fn forget(&mut self, seq: u64) {
        if seq < self.oldest_accepted() || seq > self.high {
            return;
        }
        let (word, mask) = self.bit(seq);
        self.executed[word] &= !mask;
        if let Some(old) = self.cache.remove(seq) {
            self.cache_bytes -= old.approx_bytes();
        }
    }

    /// Replaces the cached body of `seq`, if still cached.
    pub fn replace_body(&mut self, seq: u64, body: CachedBody) {
        if let Some(reply) = self.cache.get_mut(seq) {
            let before = reply.approx_bytes();
            reply.body = body;
            self.cache_bytes = self.cache_bytes - before + reply.approx_bytes();
        }
    }

    /// The client received every reply below `below`: drop those bodies
    /// (pending ones stay: they have not been sent).
    pub fn replies_received_below(&mut self, below: u64) {
        while let Some((first, reply)) = self.cache.first() {
            if first >= below || matches!(reply.body, CachedBody::RegionPending(_)) {
                break;
            }
            if let Some(old) = self.cache.pop_first() {
                self.cache_bytes -= old.approx_bytes();
            }
        }
    }

    /// Cached reply count and bytes (stats).
    pub fn cached(&self) -> (usize, usize) {
        (self.cache.len(), self.cache_bytes)
    }

    /// Executed sequence numbers in the window, ascending (digest, checks).
    pub fn executed_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        (self.oldest_accepted()..=self.high).filter(|&s| self.ran(s))
    }

    pub fn cached_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.cache.seqs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(n: usize) -> CachedReply {
        CachedReply {
            fingerprint: n as u64,
            session: SessionId(1),
            body: CachedBody::Delete(vec![DeleteOutcome::Deleted; n]),
        }
    }

    fn grant() -> super::super::types::RegionGrant {
        use super::super::types::{Layout, RegionGrant, RegionHandle, RegionToken};
        use cxlkv_dataplane::ids::{PoolId, RegionId};
        RegionGrant {
            handle: RegionHandle {
                region: RegionId(3),
                pool: PoolId(0),
                offset_bytes: 0,
                len_bytes: 2 << 20,
                token: RegionToken([0; 32]),
            },
            layout: Layout {
                page_size_bytes: 4096,
                fingerprint: 1,
            },
        }
    }

    #[test]
    fn the_reply_ring_answers_as_an_ordered_map_would() {
        use std::collections::BTreeMap;
        let mut ring = ReplyCache::default();
        let mut model: BTreeMap<u64, CachedReply> = BTreeMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut base = 0u64;
        let (mut grew, mut shrunk) = (false, false);
        for step in 0..20_000 {
            // Mostly in-order appends, some overtaken numbers, bursts that
            // grow the ring and drains that shrink it.
            let burst = step % 2_000 < 300;
            let op = next(10);
            match if burst { 0 } else { op } {
                0..=1 => {
                    base += 1;
                    let seq = if next(4) == 0 {
                        base.saturating_sub(next(40))
                    } else {
                        base
                    };
                    let r = reply(next(3) as usize);
                    assert_eq!(
                        ring.insert(seq, r.clone()).map(|o| o.fingerprint),
                        model.insert(seq, r).map(|o| o.fingerprint)
                    );
                }
                2..=5 => {
                    let before = ring.0.capacity();
                    assert_eq!(
                        ring.pop_first().map(|r| r.fingerprint),
                        model.pop_first().map(|(_, r)| r.fingerprint)
                    );
                    let cap = ring.0.capacity();
                    assert!(
                        cap <= SHRINK_ABOVE || ring.len() >= cap / 8,
                        "a drained ring keeps {cap} entries for {}",
                        ring.len()
                    );
                    shrunk |= cap < before;
                }
                6 => {
                    let seq = base.saturating_sub(next(50));
                    assert_eq!(
                        ring.remove(seq).map(|r| r.fingerprint),
                        model.remove(&seq).map(|r| r.fingerprint)
                    );
                }
                _ => {
                    let seq = base.saturating_sub(next(50));
                    assert_eq!(ring.get(seq), model.get(&seq));
                }
            }
            assert_eq!(ring.len(), model.len());
            assert_eq!(ring.first().map(|(s, _)| s), model.keys().next().copied());
            grew |= ring.0.capacity() > SHRINK_ABOVE;
        }
        assert!(ring.seqs().eq(model.keys().copied()));
        assert!(
            grew && shrunk,
            "the bursts grew the ring and the drains shrank it"
        );
    }

    #[test]
    fn out_of_order_numbers_inside_the_window_run_once() {
        let mut w = ReplyWindow::new(1, 64);
        for seq in [5, 3, 4, 1] {
            assert!(matches!(w.check(seq), Ok(SeqCheck::Fresh)));
            w.record(seq, reply(seq as usize), usize::MAX);
        }
        for seq in [1, 3, 4, 5] {
            match w.check(seq) {
                Ok(SeqCheck::Executed(r)) => assert_eq!(r.fingerprint, seq),
                other => panic!("seq {seq}: {other:?}"),
            }
        }
        assert!(matches!(w.check(2), Ok(SeqCheck::Fresh)));
        assert!(matches!(
            w.check(0),
            Err(DirectoryError::SequenceTooOld { .. })
        ));
    }

    #[test]
    fn numbers_that_left_the_window_are_too_old() {
        let mut w = ReplyWindow::new(1, 64);
        w.record(1, reply(1), usize::MAX);
        w.record(100, reply(1), usize::MAX);
        assert_eq!(w.oldest_accepted(), 37);
        assert!(matches!(
            w.check(36),
            Err(DirectoryError::SequenceTooOld {
                seq: 36,
                oldest_accepted: 37
            })
        ));
        assert!(matches!(w.check(37), Ok(SeqCheck::Fresh)));
        // The bit of seq 1 shared its ring position with 65 and must not make
        // 65 look executed.
        assert!(matches!(w.check(65), Ok(SeqCheck::Fresh)));
        assert_eq!(w.executed_seqs().collect::<Vec<_>>(), vec![100]);
    }

    #[test]
    fn a_dropped_body_is_reported_never_rerun() {
        let mut w = ReplyWindow::new(1, 64);
        let limit = reply(10).approx_bytes() + 1;
        w.record(1, reply(10), limit);
        w.record(2, reply(10), limit);
        assert!(matches!(w.check(1), Ok(SeqCheck::Evicted)));
        assert!(matches!(w.check(2), Ok(SeqCheck::Executed(_))));
        w.replies_received_below(3);
        assert!(matches!(w.check(2), Ok(SeqCheck::Evicted)));
        assert_eq!(w.cached(), (0, 0));
    }

    #[test]
    fn the_byte_limit_keeps_a_pending_region_request_and_the_reply_just_recorded() {
        let mut w = ReplyWindow::new(1, 64);
        let pending = CachedReply {
            fingerprint: 1,
            session: SessionId(1),
            body: CachedBody::RegionPending(PoolRequestId(9)),
        };
        // Room for the pending body and one other.
        let limit = pending.approx_bytes() + reply(10).approx_bytes();
        w.record(1, pending, limit);
        w.record(2, reply(10), limit);
        w.record(3, reply(10), limit);
        // 2 went (the oldest that may); the pending 1 stayed, and so did 3.
        assert!(matches!(w.check(2), Ok(SeqCheck::Evicted)));
        match w.check(1) {
            Ok(SeqCheck::Executed(r)) => {
                assert_eq!(r.body, CachedBody::RegionPending(PoolRequestId(9)));
            }
            other => panic!("the pending body was dropped: {other:?}"),
        }
        assert!(matches!(w.check(3), Ok(SeqCheck::Executed(_))));
        // A reply larger than the limit by itself is kept until the next.
        w.record(4, reply(1000), limit);
        assert!(matches!(w.check(4), Ok(SeqCheck::Executed(_))));
        assert!(matches!(w.check(3), Ok(SeqCheck::Evicted)));
        assert!(matches!(w.check(1), Ok(SeqCheck::Executed(_))));
        // Granted, the body stays until the client says it has it.
        w.replace_body(1, CachedBody::RegionGranted(grant()));
        w.record(5, reply(10), limit);
        assert!(matches!(w.check(1), Ok(SeqCheck::Executed(_))));
        assert!(matches!(w.check(4), Ok(SeqCheck::Evicted)));
        w.replies_received_below(2);
        assert!(matches!(w.check(1), Ok(SeqCheck::Evicted)));
        // Any other body is an ordinary reply, and goes oldest first.
        w.record(6, reply(10), limit);
        w.replace_body(6, CachedBody::RegionReturned);
        w.record(7, reply(10), limit);
        w.record(8, reply(10), limit);
        assert!(matches!(w.check(6), Ok(SeqCheck::Evicted)));
    }

    #[test]
    fn a_floor_refuses_numbers_of_a_previous_incarnation() {
        let w = ReplyWindow::new(500, 64);
        assert!(matches!(
            w.check(499),
            Err(DirectoryError::SequenceTooOld {
                oldest_accepted: 500,
                ..
            })
        ));
        assert!(matches!(w.check(500), Ok(SeqCheck::Fresh)));
    }

    #[test]
    fn a_number_beyond_the_sequence_range_is_refused_and_the_top_one_works() {
        let mut w = ReplyWindow::new(1, 64);
        assert!(matches!(
            w.check(u64::MAX),
            Err(DirectoryError::SequenceOutOfRange {
                value: u64::MAX,
                ..
            })
        ));
        assert!(matches!(w.check(MAX_SEQUENCE), Ok(SeqCheck::Fresh)));
        w.record(MAX_SEQUENCE, reply(1), usize::MAX);
        assert!(matches!(w.check(MAX_SEQUENCE), Ok(SeqCheck::Executed(_))));
        assert_eq!(w.oldest_accepted(), MAX_SEQUENCE - 63);
        assert_eq!(w.executed_seqs().collect::<Vec<_>>(), vec![MAX_SEQUENCE]);
    }

    #[test]
    fn forget_makes_a_number_fresh_again() {
        let mut w = ReplyWindow::new(1, 64);
        w.record(7, reply(1), usize::MAX);
        w.forget(7);
        assert!(matches!(w.check(7), Ok(SeqCheck::Fresh)));
        assert_eq!(w.cached(), (0, 0));
    }
}
