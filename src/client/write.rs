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
//! answer. A page freed meanwhile by a notice (registered, then deleted by
//! someone) is dropped from the batch before each resend. If the directory
//! answers that the number is too old or its reply was dropped, the batch is
//! sent under a fresh number: the directory then answers `Duplicate` with
//! our own location for keys that did register, and refuses a page whose
//! registration was already deleted (`StaleGeneration`), so nothing is
//! registered twice.

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

/// A registration whose outcome is unknown (see the module docs).
#[derive(Debug)]
pub(crate) struct Unresolved {
    ticket: SeqTicket,
    layout: Arc<LayoutState>,
    entries: Vec<(Vec<u8>, PageLease)>,
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
        let limits = shared.limits();
        let max_batch = (limits.max_batch as usize).min(proto::MAX_BATCH);
        if entries.len() > max_batch {
            return Err(ClientError::BatchTooLarge {
                len: entries.len(),
                max: max_batch,
            });
        }
        let max_key = (limits.max_key_bytes as usize).min(proto::MAX_KEY_BYTES);
        let mut owned = Vec::with_capacity(entries.len());
        for (index, (key, mut lease)) in entries.into_iter().enumerate() {
            let key = key.as_ref();
            if key.is_empty() || key.len() > max_key {
                return Err(ClientError::KeyLength {
                    index,
                    len_bytes: key.len(),
                    max_bytes: max_key,
                });
            }
            if lease.layout_ix() != self.state.ix {
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
            owned.push((key.to_vec(), lease));
        }
        let mut ticket = shared.ticket().map_err(Fail::into_error)?;
        match shared.send_register(&self.state, &mut ticket, &owned) {
            Ok(outcomes) => {
                shared.seqs.release(ticket);
                Ok(shared.settle(&self.state, owned, outcomes))
            }
            Err(Fail::Definite(e)) => {
                // Nothing was registered: the leases drop, freeing the pages.
                shared.seqs.release(ticket);
                Err(e)
            }
            Err(Fail::Indeterminate(e)) => {
                let reason = e.to_string();
                shared.park(Unresolved {
                    ticket,
                    layout: Arc::clone(&self.state),
                    entries: owned,
                });
                Err(ClientError::Indeterminate {
                    op: "register",
                    reason,
                })
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
    /// One `Register` exchange for `entries` under `ticket`; the outcomes in
    /// order.
    fn send_register(
        &self,
        layout: &LayoutState,
        ticket: &mut SeqTicket,
        entries: &[(Vec<u8>, PageLease)],
    ) -> Result<Vec<RegisterOutcome>, Fail> {
        let mut msg = Register {
            meta: Default::default(),
            layout: layout.layout,
            entries: entries
                .iter()
                .map(|(key, lease)| RegisterEntry {
                    key: key.clone(),
                    location: lease.location(),
                })
                .collect(),
        };
        let n = entries.len();
        self.exchange::<_, RegisterReply, _>(
            "register",
            Mode::NORMAL,
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

    /// Applies a batch's outcomes: inserted pages are recorded in the key
    /// index and kept; the others go back to the allocator.
    fn settle(
        &self,
        layout: &LayoutState,
        entries: Vec<(Vec<u8>, PageLease)>,
        outcomes: Vec<RegisterOutcome>,
    ) -> Vec<RegisterOutcome> {
        entries
            .into_iter()
            .zip(outcomes)
            .map(|((key, lease), outcome)| {
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
            })
            .collect()
    }

    /// The key owns the page now: record it unless a notice already freed
    /// the page (the key was deleted before this reply arrived).
    fn keep(&self, layout: &LayoutState, key: &[u8], lease: PageLease) {
        self.index
            .record_inserted(layout.ix, key, lease.location(), || lease.still_allocated());
        lease.consume();
    }

    fn park(&self, batch: Unresolved) {
        self.stats.bump(&self.stats.registers_unresolved);
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
        for (_, lease) in entries {
            lease.consume();
        }
    }

    /// Sends every parked batch again (maintenance thread). Batches that get
    /// an answer are settled; the rest stay parked.
    pub fn resolve_unresolved(&self) {
        let parked = std::mem::take(&mut *self.unresolved.lock());
        for mut batch in parked {
            // A page freed by a notice was registered and deleted already:
            // it must not be registered again, and it is free.
            batch.entries.retain(|(_, lease)| lease.still_allocated());
            if batch.entries.is_empty() {
                self.seqs.release(batch.ticket);
                continue;
            }
            let mut result = self.send_register(&batch.layout, &mut batch.ticket, &batch.entries);
            if let Err(Fail::Indeterminate(ClientError::Server { code, .. })) = &result
                && matches!(
                    ErrorCode::from_u16(*code),
                    Some(ErrorCode::SequenceTooOld | ErrorCode::ReplyEvicted)
                )
            {
                // The number is spent; send the batch as a new request.
                match self.ticket() {
                    Ok(fresh) => {
                        let old = std::mem::replace(&mut batch.ticket, fresh);
                        self.seqs.release(old);
                        result =
                            self.send_register(&batch.layout, &mut batch.ticket, &batch.entries);
                    }
                    Err(_) => {
                        self.unresolved.lock().push(batch);
                        continue;
                    }
                }
            }
            match result {
                Ok(outcomes) => {
                    let Unresolved {
                        ticket,
                        layout,
                        entries,
                    } = batch;
                    self.seqs.release(ticket);
                    self.settle(&layout, entries, outcomes);
                }
                Err(Fail::Definite(_)) => {
                    // Refused as a whole: nothing registered, pages free.
                    self.seqs.release(batch.ticket);
                }
                Err(Fail::Indeterminate(_)) => self.unresolved.lock().push(batch),
            }
        }
    }

    /// Parked batches (for tests and stats).
    pub fn unresolved_batches(&self) -> usize {
        self.unresolved.lock().len()
    }
}

fn same_page(a: &Location, b: &Location) -> bool {
    a.region == b.region && a.page == b.page && a.generation == b.generation
}
