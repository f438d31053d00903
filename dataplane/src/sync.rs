//! Synchronisation primitives of the lock-free parts, swapped for loom's
//! model-checked ones under `--cfg loom` (the way crossbeam does it).
//!
//! [`alloc`](crate::alloc) and [`table`](crate::table) take every atomic,
//! mutex and epoch guard that their correctness argument rests on from here,
//! so the loom models run exactly the production code paths. State that is
//! deliberately *outside* the models (the process-wide magazine registry and
//! its thread-local slot, statistics seeds) uses `std` directly and says so.
//!
//! Epoch reclamation: crossbeam-epoch is loom-aware only when it is itself
//! built with `--cfg crossbeam_loom`, which our loom run does not set (and its
//! global collector would make the models far too large). Under `cfg(loom)`,
//! [`epoch`] is therefore a small stand-in with the same contract — a function
//! passed to [`epoch::Guard::defer`] runs only after every guard that was alive
//! when it was deferred has been dropped — built on loom atomics and a loom
//! mutex, so that the table's publish/retire protocol is checked against that
//! contract. What the stand-in does *not* prove is that crossbeam-epoch meets
//! the contract; crossbeam checks that with its own loom suite.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU32, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU32, AtomicU64};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Epoch-based reclamation: crossbeam-epoch's global collector, or the loom
/// stand-in (see the module docs).
pub(crate) mod epoch {
    #[cfg(not(loom))]
    pub(crate) use crossbeam_epoch::{Guard, pin};

    #[cfg(loom)]
    pub(crate) use standin::{Guard, pin};

    /// A loom-checkable reclamation scheme with crossbeam-epoch's contract:
    /// one shared count of live guards; deferred functions run when the count
    /// drops to zero. Correct but deliberately naive (every pin bounces one
    /// counter), so it exists only under `cfg(loom)`.
    #[cfg(loom)]
    mod standin {
        use std::marker::PhantomData;
        use std::sync::PoisonError;

        use loom::sync::Mutex;
        use loom::sync::atomic::{AtomicUsize, Ordering};

        type Deferred = Box<dyn FnOnce() + Send>;

        struct Domain {
            pinned: AtomicUsize,
            deferred: Mutex<Vec<Deferred>>,
        }

        loom::lazy_static! {
            static ref DOMAIN: Domain = Domain {
                pinned: AtomicUsize::new(0),
                deferred: Mutex::new(Vec::new()),
            };
        }

        /// A pinned participant. Not `Send`, like crossbeam's guard.
        pub(crate) struct Guard {
            _not_send: PhantomData<*mut ()>,
        }

        /// Pins the current thread.
        pub(crate) fn pin() -> Guard {
            // SeqCst: a reader's increment must be ordered before its load of
            // the published pointer, against the decrement that lets a
            // collector free what the writer unlinked (see `Drop`).
            DOMAIN.pinned.fetch_add(1, Ordering::SeqCst);
            Guard {
                _not_send: PhantomData,
            }
        }

        impl Guard {
            /// Runs `f` once no guard that is alive now remains.
            pub(crate) fn defer<F, R>(&self, f: F)
            where
                F: FnOnce() -> R + Send + 'static,
            {
                let mut deferred = DOMAIN
                    .deferred
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                deferred.push(Box::new(move || {
                    f();
                }));
            }

            /// crossbeam's `flush` only hurries collection; here collection
            /// happens when the last guard drops, so there is nothing to do.
            pub(crate) fn flush(&self) {}
        }

        impl Drop for Guard {
            fn drop(&mut self) {
                let ready = {
                    let mut deferred = DOMAIN
                        .deferred
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    // Decrementing under the lock makes "the count reached
                    // zero" and "these are the functions deferred so far" one
                    // step: a function deferred later is not taken, and every
                    // function taken was deferred while the guards alive at
                    // that time were counted.
                    if DOMAIN.pinned.fetch_sub(1, Ordering::SeqCst) == 1 {
                        std::mem::take(&mut *deferred)
                    } else {
                        Vec::new()
                    }
                };
                for f in ready {
                    f();
                }
            }
        }
    }
}
