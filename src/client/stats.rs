//! Client counters: monotonic tallies of what the client did and of the
//! unusual events it absorbed (stale notices, reconnects, lost views), read
//! as a [`ClientStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// The live counters (relaxed atomics: independent tallies).
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub $name: AtomicU64,)*
        }

        /// A snapshot of the client's counters (monotonic since connect).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct ClientStats {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Counters {
            pub fn snapshot(&self) -> ClientStats {
                ClientStats {
                    // Relaxed: independent tallies read for reporting.
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters!(
    /// Requests sent (every attempt counts).
    requests,
    /// Attempts after the first, of any request.
    retries,
    /// Connections re-established.
    reconnects,
    /// Reattaches that found the instance recovered: the directory
    /// restarted, or the instance expired while it could not reach it (its
    /// keys are registered again; those in refused regions are dropped). A
    /// recovery is counted again when the connection broke before the
    /// session made any request (the directory repeats `resumed: false`).
    directory_restarts,
    /// Keys registered again after a directory restart.
    keys_reregistered,
    /// Keys dropped from the index because re-registration found them taken
    /// or refused, or their region was refused.
    keys_lost_with_regions,
    /// Regions the directory refused at reattach.
    regions_refused,
    /// Reattaches refused because the restarted directory holds regions of
    /// this instance the client never received (a grant whose reply was
    /// lost); retried until the instance's grace period frees them.
    reattaches_awaiting_grace,
    /// Regions taken from the directory.
    regions_acquired,
    /// Idle regions given back.
    regions_returned,
    /// Idle regions whose return had no certain outcome (or that the
    /// directory no longer knew as ours): retired, never written again,
    /// rather than put back in use — the directory may have freed them for
    /// another instance.
    regions_retired,
    /// Peer regions mapped.
    peer_regions_mapped,
    /// Peer regions unmapped to keep the cache bounded.
    peer_regions_evicted,
    /// Pages freed by freed-page notices.
    pages_freed_by_notice,
    /// Notices naming a generation the page no longer has (resent or
    /// overtaken): ignored.
    stale_notices,
    /// Notices for a region this client no longer owns: ignored.
    notices_unknown_region,
    /// Notices whose number skipped one (should not happen).
    notice_gaps,
    /// Pages whose registration lost to an earlier one (`Duplicate`).
    duplicates,
    /// Pages whose registration was refused (`Rejected`).
    rejections,
    /// Unpin requests sent.
    unpin_batches,
    /// Pins whose release the directory reported as not held (double
    /// release), counted in pins, as every unpin counter is: a dropped
    /// guard's release is one pin, a staged release of `n` pins is `n`,
    /// whether or not they went out in one entry.
    unpins_not_held,
    /// Pins whose release was given up (in pins, as `unpins_not_held`):
    /// their session ended before the unpin was sent or answered (its pins
    /// went with it), or it could not be delivered (the session is then
    /// ended, so that its pins go too).
    unpins_dropped,
    /// Views whose pins could not be taken again after a reconnect (the key
    /// was deleted or not yet re-registered meanwhile).
    views_invalidated,
    /// Registrations parked because their outcome was unknown.
    registers_unresolved,
    /// Heartbeats sent.
    heartbeats,
);

impl Counters {
    pub fn bump(&self, c: &AtomicU64) {
        // Relaxed: independent tallies.
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(&self, c: &AtomicU64, n: u64) {
        // Relaxed: independent tallies.
        c.fetch_add(n, Ordering::Relaxed);
    }
}
