//! The write path: register written pages under keys, and `put` (allocate,
//! copy, publish, register) on top.
//!
//! A batch is one `Register` round trip whatever its size (up to the
//! server's `max_batch`). Per key the directory answers `Inserted` (the
//! page now belongs to the key; it is recorded in the key index for
//! re-registration after a directory restart), `Duplicate(winner)` (someone
//! registered the key first — or the same key appeared earlier in the
//! batch; our page goes back to the allocator) or `Rejected(reason)` (our
//! page goes back too). A `Duplicate` naming *our own* location is a
//! registration that already took effect (a retry whose first reply was
//! lost) and counts as `Inserted`.
//!
//! **Bytes before keys.** Registration takes the leases by value, so no
//! write can follow it; each lease is published first (skipped when a
//! non-temporal copy already published it).
//!
//! **Unknown outcomes.** When a batch's attempts all go unanswered, it may
//! have been registered. Freeing its pages could hand a registered page to
//! a new writer, so they are kept: the batch is parked (with its sequence
//! number) and the maintenance thread sends it again until it gets an
//! answer. Parked, its leases stop keeping the client alive (the client
//! keeps them itself: `lease.rs`). A page freed meanwhile by a notice
//! (registered, then deleted by someone) is dropped from the batch before
//! each resend. If the directory answers that the number is too old or its
//! reply was dropped, the batch is sent under a fresh number: the directory
//! then answers `Duplicate` with our own location for keys that did
//! register, and refuses a page whose registration was already deleted
//! (`StaleGeneration`), so nothing is registered twice.
//!
//! **Directory restarts.** A batch in flight when the directory restarted
//! carries a number the new directory refuses (it went to the previous
//! incarnation). That number stops holding the sequence window back at the
//! restart (`seq.rs`), so a parked batch never keeps the reattach that
//! would resolve it from completing. The batch is sent again under a fresh
//! number — but first, pages that a freed-page notice released meanwhile
//! are taken out (their key was registered and deleted under the old
//! directory; the page may already be another writer's): they count as
//! `Inserted`. The new directory has no history that could refuse them, so
//! this check is what keeps a reused page from being registered under the
//! old key.

use std::sync::Arc;

use cxlkv_controlplane::proto::{
    self, ErrorCode, Location, Register, RegisterEntry, RegisterOutcome, RegisterReply,
};

use super::error::ClientError;
use super::layout::{LayoutHandle, LayoutState};
use super::lease::PageLease;
use super::rpc::{Fail, Mode};
use super::seq::SeqTicket;
use super::shared::Shared;

/// Most parked batches; beyond it the pages of a further unresolved batch
/// are kept allocated for the client's lifetime (never freed: safe) and
/// counted.
const MAX_UNRESOLVED: usize = 64;
/// Most times one batch is re-sent because a directory restart voided its
/// sequence number (each restart voids it once).
const MAX_VOID_RESENDS: usize = 8;

/// One entry of a registration in flight: its index in the caller's batch.
#[derive(Debug)]
struct Entry {
    index: usize,
    key: Vec<u8>,
    lease: PageLease,
}

/// A registration whose outcome is unknown (see the module docs).
#[derive(Debug)]
pub(crate) struct Unresolved {
    ticket: SeqTicket,
    layout: Arc<LayoutState>,
    entries: Vec<Entry>,
    /// The batch is (to be) sent under another number than the attempt
    /// whose answer was lost: from then on a refusal says nothing about
    /// whether that attempt registered its keys.
    renewed: bool,
}

impl LayoutHandle {
    /// Registers one written page under `key`.
    pub fn register(
        &self,
        key: impl AsRef<[u8]>,
        lease: PageLease,
    ) -> Result<RegisterOutcome, ClientError> {
        let mut out = self.batch_register(vec![(key, lease)])?;
        Ok(out.pop().expect("invariant: one outcome per entry"))
    }

    /// Registers written pages in one round trip; one outcome per entry, in
    /// order. Pages whose key was not inserted are back in the allocator.
    pub fn batch_register<K: AsRef<[u8]>>(
        &self,
        entries: Vec<(K, PageLease)>,
    ) -> Result<Vec<RegisterOutcome>, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        self.check_keys(entries.iter().map(|(k, _)| k.as_ref()))?;
        let n = entries.len();
        let mut pending = Vec::with_capacity(n);
        for (index, (key, mut lease)) in entries.into_iter().enumerate() {
            let key = key.as_ref();
            if !lease.is_of(shared, self.state.ix) {
                return Err(ClientError::ForeignLease { index });
            }
            if lease.len_bytes() == 0 {
                return Err(ClientError::ChunkLength {
                    index,
                    len_bytes: 0,
                    page_size_bytes: self.page_size_bytes(),
                });
            }
            lease.publish();
            pending.push(Entry {
                index,
                key: key.to_vec(),
                lease,
            });
        }
        let mut ticket = shared.ticket().map_err(Fail::into_error)?;
        let mut out = vec![None; n];
        match shared.register_until_answered(&self.state, &mut ticket, &mut pending, &mut out) {
            Ok(()) => {
                shared.seqs.release(ticket);
                Ok(out
                    .into_iter()
                    .map(|o| o.expect("invariant: every entry is settled"))
                    .collect())
            }
            Err(Fail::Indeterminate(e)) => {
                let reason = e.with_causes().to_string();
                shared.park(Unresolved {
                    ticket,
                    layout: Arc::clone(&self.state),
                    entries: pending,
                    renewed: false,
                });
                Err(ClientError::Indeterminate {
                    op: "register",
                    reason,
                })
            }
            Err(other) => {
                // Refused as a whole: nothing was registered; the leases
                // drop, freeing their pages.
                shared.seqs.release(ticket);
                Err(other.into_error())
            }
        }
    }

    /// Allocates a page, copies `bytes` into it, publishes and registers it.
    pub fn put(&self, key: impl AsRef<[u8]>, bytes: &[u8]) -> Result<RegisterOutcome, ClientError> {
        let mut out = self.batch_put(&[(key.as_ref(), bytes)])?;
        Ok(out.pop().expect("invariant: one outcome per entry"))
    }

    /// [`put`](Self::put) for a batch: one allocation pass, the copies, one
    /// `Register` round trip. Nothing is allocated when an input is invalid.
    pub fn batch_put<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        items: &[(K, V)],
    ) -> Result<Vec<RegisterOutcome>, ClientError> {
        self.shared().check_open()?;
        self.check_keys(items.iter().map(|(k, _)| k.as_ref()))?;
        let page_size = self.page_size_bytes();
        for (index, (_, v)) in items.iter().enumerate() {
            let len = v.as_ref().len();
            if len == 0 || len as u64 > page_size {
                return Err(ClientError::ChunkLength {
                    index,
                    len_bytes: len,
                    page_size_bytes: page_size,
                });
            }
        }
        let mut leases = self.batch_alloc(items.len())?;
        for (lease, (_, v)) in leases.iter_mut().zip(items) {
            lease.write(v.as_ref())?;
        }
        self.batch_register(items.iter().map(|(k, _)| k.as_ref()).zip(leases).collect())
    }
}

impl Shared {
    /// Sends `entries` until the directory answers, settling each entry's
    /// outcome into `out[entry.index]` and draining `entries`. A number voided
    /// by a directory restart is replaced after dropping the entries whose
    /// page a notice freed meanwhile: they were registered (and deleted)
    /// under the old directory, so they count as `Inserted`, and their page
    /// may already belong to another writer.
    fn register_until_answered(
        &self,
        layout: &LayoutState,
        ticket: &mut SeqTicket,
        entries: &mut Vec<Entry>,
        out: &mut [Option<RegisterOutcome>],
    ) -> Result<(), Fail> {
        for _ in 0..MAX_VOID_RESENDS {
            match self.send_register(layout, ticket, entries) {
                Ok(outcomes) => {
                    for (entry, outcome) in std::mem::take(entries).into_iter().zip(outcomes) {
                        let index = entry.index;
                        out[index] = Some(self.settle(layout, entry, outcome));
                    }
                    return Ok(());
                }
                Err(Fail::Void) => {
                    self.drop_freed(entries, out);
                    self.renew(ticket, self.request_timeout())
                        .map_err(Fail::Definite)?;
                    if entries.is_empty() {
                        return Ok(());
                    }
                }
                Err(other) => return Err(other),
            }
        }
        Err(Fail::Indeterminate(ClientError::Indeterminate {
            op: "register",
            reason: format!("its number was voided by {MAX_VOID_RESENDS} directory restarts"),
        }))
    }

    /// Takes out the entries whose page a freed-page notice released: their
    /// key was registered and deleted already. The page is not ours to free
    /// again (the lease is consumed, not dropped).
    fn drop_freed(&self, entries: &mut Vec<Entry>, out: &mut [Option<RegisterOutcome>]) {
        let (kept, freed): (Vec<Entry>, Vec<Entry>) = std::mem::take(entries)
            .into_iter()
            .partition(|e| e.lease.still_allocated());
        for e in freed {
            out[e.index] = Some(RegisterOutcome::Inserted);
            e.lease.consume();
        }
        *entries = kept;
    }

    /// One `Register` exchange for `entries` under `ticket`; the outcomes in
    /// order.
    fn send_register(
        &self,
        layout: &LayoutState,
        ticket: &mut SeqTicket,
        entries: &[Entry],
    ) -> Result<Vec<RegisterOutcome>, Fail> {
        let mut msg = Register {
            meta: Default::default(),
            layout: layout.layout,
            entries: entries
                .iter()
                .map(|e| RegisterEntry {
                    key: e.key.clone(),
                    location: e.lease.location(),
                })
                .collect(),
        };
        let n = entries.len();
        self.exchange::<_, RegisterReply, _>(
            "register",
            Mode::REGISTER,
            Some(ticket),
            &mut msg,
            |reply| {
                if reply.outcomes.len() != n {
                    return Err(ClientError::BadReply {
                        op: "register",
                        source: proto::ProtoError::Malformed {
                            kind: proto::Kind::RegisterReply,
                            len_bytes: 0,
                            detail: format!("{} outcomes for {n} entries", reply.outcomes.len()),
                        },
                    });
                }
                Ok(reply.outcomes.iter().map(RegisterOutcome::from).collect())
            },
        )
        .map_err(|f| match f {
            // The request ran (its reply was well formed) but cannot be
            // interpreted: its outcome is unknown.
            Fail::Definite(e @ ClientError::BadReply { .. }) => Fail::Indeterminate(e),
            other => other,
        })
    }

    /// Applies one entry's outcome: an inserted page is recorded in the key
    /// index and kept; any other goes back to the allocator.
    fn settle(
        &self,
        layout: &LayoutState,
        entry: Entry,
        outcome: RegisterOutcome,
    ) -> RegisterOutcome {
        let Entry { key, lease, .. } = entry;
        let own = lease.location();
        match outcome {
            RegisterOutcome::Inserted => {
                self.keep(layout, &key, lease);
                RegisterOutcome::Inserted
            }
            RegisterOutcome::Duplicate(winner) if same_page(&winner, &own) => {
                self.keep(layout, &key, lease);
                RegisterOutcome::Inserted
            }
            RegisterOutcome::Duplicate(winner) => {
                self.stats.bump(&self.stats.duplicates);
                drop(lease);
                RegisterOutcome::Duplicate(winner)
            }
            RegisterOutcome::Rejected(reason) => {
                self.stats.bump(&self.stats.rejections);
                drop(lease);
                RegisterOutcome::Rejected(reason)
            }
        }
    }

    /// The key owns the page now: record it unless a notice already freed
    /// the page (the key was deleted before this reply arrived).
    fn keep(&self, layout: &LayoutState, key: &[u8], lease: PageLease) {
        self.index
            .record_inserted(layout.ix, key, lease.location(), || lease.still_allocated());
        lease.consume();
    }

    fn park(&self, mut batch: Unresolved) {
        self.stats.bump(&self.stats.registers_unresolved);
        // Kept by the client from now on: its leases must not keep it alive
        // (see `PageLease::detach`).
        for e in &mut batch.entries {
            e.lease.detach();
        }
        let mut parked = self.unresolved.lock();
        if parked.len() < MAX_UNRESOLVED {
            parked.push(batch);
            return;
        }
        drop(parked);
        // Over the bound: keep the pages allocated forever (never freed, so
        // never reused under a key that may exist) and release the number.
        let Unresolved {
            ticket, entries, ..
        } = batch;
        self.seqs.release(ticket);
        for e in entries {
            e.lease.consume();
        }
    }

    /// Sends every parked batch again (maintenance thread). Batches that get
    /// an answer are settled; the rest stay parked.
    pub fn resolve_unresolved(&self) {
        let parked = std::mem::take(&mut *self.unresolved.lock());
        for mut batch in parked {
            // Nobody waits for these outcomes: only the pages matter.
            let mut out: Vec<Option<RegisterOutcome>> =
                vec![None; batch.entries.iter().map(|e| e.index + 1).max().unwrap_or(0)];
            // A page freed by a notice was registered and deleted already.
            let before = batch.entries.len();
            self.drop_freed(&mut batch.entries, &mut out);
            if batch.entries.is_empty() {
                self.seqs.release(batch.ticket);
                continue;
            }
            // A smaller batch is another request: under the old number the
            // directory would answer with the old request's cached reply, or
            // refuse the reuse (`SequenceReused`). A ticket left without a
            // number by a renewal that failed (`seq` 0) needs one too. As
            // after a lost answer (below), a new number it is; the directory
            // answers `Duplicate` with our own location for keys that did
            // register.
            if (batch.entries.len() != before || batch.ticket.seq == 0)
                && !self.renew_parked(&mut batch)
            {
                self.unresolved.lock().push(batch);
                continue;
            }
            let mut result = self.register_until_answered(
                &batch.layout,
                &mut batch.ticket,
                &mut batch.entries,
                &mut out,
            );
            if let Err(Fail::Indeterminate(ClientError::Server { code, .. })) = &result
                && matches!(
                    ErrorCode::from_u16(*code),
                    Some(ErrorCode::SequenceTooOld | ErrorCode::ReplyEvicted)
                )
            {
                // The number ran, but its answer is gone: send the batch as a
                // new request. The directory answers `Duplicate` with our own
                // location for keys that did register, and refuses pages
                // registered and deleted since (`StaleGeneration`).
                if !self.renew_parked(&mut batch) {
                    self.unresolved.lock().push(batch);
                    continue;
                }
                result = self.register_until_answered(
                    &batch.layout,
                    &mut batch.ticket,
                    &mut batch.entries,
                    &mut out,
                );
            }
            match result {
                Ok(()) => self.seqs.release(batch.ticket),
                Err(Fail::Definite(ClientError::Server { code, .. }))
                    if refusal_of_the_request(code) && !batch.renewed =>
                {
                    // The directory evaluated the parked number afresh and
                    // refused the batch: it never ran (a refusal does not
                    // consume a number), so nothing registered; the leases
                    // drop, freeing their pages.
                    self.seqs.release(batch.ticket);
                }
                Err(Fail::Definite(ClientError::Server { code, .. }))
                    if refusal_of_the_request(code) =>
                {
                    // Refused under a new number, while the lost attempt may
                    // have registered these keys: their pages stay reserved
                    // for the client's lifetime (never freed, so never
                    // reused under a key that may exist), as for a batch
                    // beyond the parking bound.
                    tracing::warn!(
                        pages = batch.entries.len(),
                        "a parked registration was refused under a new number; keeping its pages reserved"
                    );
                    self.seqs.release(batch.ticket);
                    for e in batch.entries {
                        e.lease.consume();
                    }
                }
                // Anything else — a local failure before this retry was
                // sent, a session or transient refusal — says nothing about
                // the attempt that parked the batch, which may have
                // registered its keys: the pages stay reserved, the batch
                // parked.
                Err(_) => self.unresolved.lock().push(batch),
            }
        }
    }

    /// Gives a parked batch a new number, marking it renewed (its refusals
    /// then say nothing about the lost attempt); `false` if no number could
    /// be had (the ticket is then left without one, for the next round).
    fn renew_parked(&self, batch: &mut Unresolved) -> bool {
        batch.renewed = true;
        self.renew(&mut batch.ticket, self.request_timeout())
            .is_ok()
    }

    /// Parked batches (for tests and stats).
    pub fn unresolved_batches(&self) -> usize {
        self.unresolved.lock().len()
    }
}

/// Whether a refusal with `code` answers the request itself (the same
/// request would have been refused the same way whenever it ran), rather
/// than the session, the connection or the moment.
fn refusal_of_the_request(code: u16) -> bool {
    ErrorCode::from_u16(code).is_some_and(|c| {
        !c.is_transient()
            && !matches!(
                c,
                ErrorCode::SessionEnded
                    | ErrorCode::HelloRequired
                    | ErrorCode::Internal
                    | ErrorCode::SequenceTooOld
                    | ErrorCode::ReplyEvicted
                    | ErrorCode::AuthenticationRequired
                    | ErrorCode::AuthenticationFailed
            )
    })
}

fn same_page(a: &Location, b: &Location) -> bool {
    a.region == b.region && a.page == b.page && a.generation == b.generation
}
