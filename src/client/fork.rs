//! Clients do not cross `fork`.
//!
//! A child process made by `fork` (without `exec`) inherits a copy of every
//! [`Client`](super::Client) of its parent: the same connection, the same
//! session, copies of the page allocators and of the pin ledger — but none
//! of the client's threads. A request from the child would travel on the
//! parent's connection and act in the parent's session (a dropped view's
//! unpin would release a pin one of the parent's views relies on, so a
//! peer's delete could free the page the parent is reading); dropping the
//! last handle would wait for ever for the maintenance thread, which does
//! not exist in the child, and then shut the parent's socket down.
//!
//! So a client records the process *incarnation* it was connected in — a
//! counter that a `pthread_atfork` child handler bumps — and in any other
//! incarnation it refuses every request — every call that returns a
//! `Result`, writing an inherited lease included: the parent's copy names
//! the same page — with [`ClientError::Forked`] before it takes a lock or
//! sends a byte (a thread of the parent may have held any of the client's
//! locks at the fork, and would never release it here); a view dropped
//! there releases nothing, and its last handle dropped there leaves the
//! copy alone (its memory and descriptors go with the child). Accessors
//! that only read the copy's own state (`session_id`, `max_batch`,
//! `usage`, ...) still answer from it. The parent's session is untouched; a
//! child connects a client of its own. An L1 tier over such a client
//! refuses its calls the same way (`tier/mod.rs`), and the C ABI's handles
//! follow the same rule through the same counter.
//!
//! [`ClientError::Forked`]: super::ClientError::Forked

use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};

/// The process incarnation: 0 in the process that loaded cxlkv, bumped in
/// the child by every `fork` once the handler is registered.
static INCARNATION: AtomicU32 = AtomicU32::new(0);
static ATFORK: Once = Once::new();

/// The `pthread_atfork` child handler: runs in the child, on its only
/// thread, before `fork` returns there (an atomic add is async-signal-safe).
extern "C" fn forked_child() {
    // Relaxed: the child's only thread loads it afterwards (program order),
    // and every thread it starts later is started after it.
    INCARNATION.fetch_add(1, Ordering::Relaxed);
}

/// This process's incarnation: it differs from a value read before a `fork`
/// in the child of that `fork` (and equals it in the parent). Registers the
/// fork handler on first use, so read it before making anything a fork must
/// not copy unseen.
pub fn process_incarnation() -> u32 {
    ATFORK.call_once(|| {
        // SAFETY: `forked_child` is an `extern "C" fn()` that only does an
        // atomic add, which is safe in a forked child; this code is never
        // unloaded while the process runs (it is linked in, or part of the
        // C ABI library, whose registration glibc drops if it is unloaded).
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        // Only ENOMEM is possible; without the handler a forked child's
        // copies would go unnoticed, as before the handler existed.
        debug_assert_eq!(rc, 0, "pthread_atfork failed");
    });
    // Relaxed: see `forked_child`.
    INCARNATION.load(Ordering::Relaxed)
}

/// The process a client belongs to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pub pid: u32,
    incarnation: u32,
}

impl Owner {
    /// This process (registers the fork handler first).
    pub fn current() -> Self {
        let incarnation = process_incarnation();
        Self {
            pid: std::process::id(),
            incarnation,
        }
    }

    /// This code runs in a child forked after the owner recorded itself.
    pub fn forked(&self) -> bool {
        // Relaxed: see `forked_child`.
        INCARNATION.load(Ordering::Relaxed) != self.incarnation
    }
}
