//! The per-call audit behind the invariants that are about what a call
//! *did* rather than what the maps hold: I5 and I6 (what the listeners and
//! the event sink were told) and I7 (pages whose registration outcome is
//! unknown). Debug builds only: in release builds nothing is recorded and
//! the checks see an empty record.
//!
//! A locked call starts with an empty [`CallAudit`] (reset when the lock is
//! taken) and is checked when the lock is released, whatever path the call
//! returns by. The record is fed at the points of truth, not from the
//! call's own output flags: the maps note every key that leaves them
//! (`staging.rs`), registration notes the keys the directory confirmed,
//! `delete` the keys the directory reported deleted, and the dispatch of
//! callbacks and events notes what was said. The checks:
//!
//! - **I5**: `write_finished` (callback or `WriteFinished` event) comes only
//!   from `finish_write`, and only for keys the directory confirmed in this
//!   call — never from a promote, never for a key left staged as a private
//!   temporary (a temporary completion is not a write-through).
//! - **I6**: every key reported `deleted` / `KeysEvicted` left this tier's
//!   maps in this call or was deleted by the directory in this call, and is
//!   not staged any more.
//! - The sweeper and `close` notify nobody.
//! - **I7**: see [`UnknownOutcome`].

use cxlkv_controlplane::proto::Location;

use super::TierEvent;
use super::events::Callback;
use super::staging::Staging;
use super::types::{InvariantViolation, KeyStage};

/// Whether the audit records (debug builds).
const ON: bool = cfg!(debug_assertions);

/// What was said: a listener callback or a sink event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Said {
    Callback(Callback),
    Event(TierEvent),
}

impl Said {
    fn is_write_finished(self) -> bool {
        matches!(
            self,
            Said::Callback(Callback::WriteFinished) | Said::Event(TierEvent::WriteFinished)
        )
    }

    fn is_deleted(self) -> bool {
        matches!(
            self,
            Said::Callback(Callback::Deleted) | Said::Event(TierEvent::KeysEvicted)
        )
    }
}

/// What one locked call did and said.
#[derive(Debug, Default)]
pub(crate) struct CallAudit {
    /// Keys the directory confirmed registered (retained writes).
    registered: Vec<Box<[u8]>>,
    /// Keys that left `W` or `R`.
    unstaged: Vec<Box<[u8]>>,
    /// Keys the directory answered `Deleted`.
    dir_deleted: Vec<Box<[u8]>>,
    /// Every notification, in order.
    said: Vec<(Said, Vec<Box<[u8]>>)>,
}

impl CallAudit {
    pub fn reset(&mut self) {
        self.registered.clear();
        self.unstaged.clear();
        self.dir_deleted.clear();
        self.said.clear();
    }

    pub fn registered(&mut self, key: &[u8]) {
        if ON {
            self.registered.push(key.into());
        }
    }

    pub fn unstaged(&mut self, key: &[u8]) {
        if ON {
            self.unstaged.push(key.into());
        }
    }

    pub fn dir_deleted(&mut self, key: &[u8]) {
        if ON {
            self.dir_deleted.push(key.into());
        }
    }

    pub fn said(&mut self, what: Said, keys: &[&[u8]]) {
        if ON {
            self.said
                .push((what, keys.iter().map(|&k| Box::from(k)).collect()));
        }
    }

    /// Checks I5, I6 and the silence of the sweeper and `close` for the
    /// call `op`, against the maps as the call leaves them.
    pub fn check(&self, op: &str, st: &Staging) -> Result<(), InvariantViolation> {
        let broken = |invariant, key: &[u8], detail: String| InvariantViolation {
            invariant,
            key: key.to_vec(),
            detail,
        };
        for (what, keys) in &self.said {
            if matches!(op, "sweep" | "close") {
                return Err(broken(
                    "silent reclaim",
                    keys.first().map_or(&[][..], |k| &k[..]),
                    format!("{op} notified {what:?}"),
                ));
            }
            if what.is_write_finished() {
                if op != "finish_write" {
                    return Err(broken(
                        "I5",
                        keys.first().map_or(&[][..], |k| &k[..]),
                        format!("{op} emitted {what:?} (only finish_write may)"),
                    ));
                }
                for key in keys {
                    if !self.registered.contains(key) || st.is_temporary_read(key) {
                        return Err(broken(
                            "I5",
                            key,
                            format!(
                                "{what:?} for a key the directory did not confirm in this call \
                                 (or a private temporary)"
                            ),
                        ));
                    }
                }
            }
            if what.is_deleted() {
                for key in keys {
                    let removed = self.unstaged.contains(key) || self.dir_deleted.contains(key);
                    if !removed || st.stage_of(key) != KeyStage::Untracked {
                        return Err(broken(
                            "I6",
                            key,
                            format!(
                                "{what:?} for a key this call did not remove (now {:?})",
                                st.stage_of(key)
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// A page this tier handed to a registration whose outcome came back
/// unknown (I7: it must not return to the free list while unknown). The
/// client keeps such pages parked and resends the registration; until it
/// learns the outcome the page must stay allocated under its generation.
///
/// The tier cannot see when the client learns the outcome, but it can see
/// that the client cannot have learned it yet: every way a parked page is
/// legitimately freed — a resend answered `Rejected` or `Duplicate`, a
/// whole-batch refusal, a freed-page notice for a key registered and then
/// deleted — follows a request of the client (counted when sent) or a
/// notice (counted under the notice lock). `activity` is the sum of those
/// two counters when the outcome came back unknown; while it has not moved,
/// a page that is no longer allocated was freed by nobody entitled to —
/// an I7 violation. Once it moves the entry is retired (the check would
/// prove nothing more), so the ledger holds at most the pages of the
/// latest unknown registration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnknownOutcome {
    pub location: Location,
    pub activity: u64,
}
