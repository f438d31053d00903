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

/// Asymmetric fences: a free one for the frequent side of a store-then-load
/// handshake and an expensive one for the rare side, which together order
/// the handshake as two full fences would (the pattern of Linux's
/// `membarrier(2)`, folly's `asymmetricLightBarrier`/`asymmetricHeavyBarrier`
/// and liburcu's `urcu-memb` flavour).
///
/// The guarantee, for a light side `W(x); light(); R(y)` on one thread and a
/// heavy side `W(y); heavy(); R(x)` on another: at least one of the two
/// loads sees the other thread's store. `heavy` is
/// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, which executes a full
/// memory barrier on every CPU running a thread of this process (and relies
/// on the scheduler's barriers for the threads not running), so every
/// `light()` — a compiler fence, free at run time — is upgraded to a full
/// fence with respect to it. Under `cfg(loom)` both are `fence(SeqCst)`,
/// which is exactly the ordering the upgrade provides, so the models check
/// the protocol built on them.
///
/// [`available`] registers the process for expedited membarriers once;
/// where the kernel lacks the command or a seccomp policy forbids the call
/// it returns false and callers must not rely on `light` (the allocator then
/// takes its locked path on every operation).
pub(crate) mod asymmetric {
    /// The frequent side: orders this thread's earlier accesses before its
    /// later ones against a concurrent [`heavy`] (and nothing else).
    #[inline(always)]
    pub(crate) fn light() {
        #[cfg(not(loom))]
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
        #[cfg(loom)]
        loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
    }

    /// The rare side: a full fence on this thread and, in effect, on every
    /// thread of the process at the point where it happens to be.
    ///
    /// Costs a system call: ~0.2 µs when no other thread of the process is
    /// running, a few µs when some are (an inter-processor interrupt each).
    /// Linux 6.8 and later (and stable backports) serialise expedited
    /// membarriers system-wide, so a call can wait briefly for another
    /// process's. Call only after [`available`] returned true.
    #[cfg(not(loom))]
    pub(crate) fn heavy() {
        // Bounded: ENOMEM (the kernel could not allocate the CPU mask) is
        // transient and retried; EPERM means this process is not registered
        // — a child forked after the parent registered (registration is per
        // address space) — and is fixed by registering. Anything else, or a
        // failure that persists, cannot be worked around.
        let mut last = None;
        for _ in 0..HEAVY_ATTEMPTS {
            if membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0 {
                return;
            }
            let error = std::io::Error::last_os_error();
            let code = error.raw_os_error();
            last = Some(error);
            match code {
                Some(libc::ENOMEM) => std::thread::yield_now(),
                Some(libc::EPERM) => {
                    membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED);
                }
                _ => break,
            }
        }
        // `available` succeeded earlier, so only a seccomp filter installed
        // since (or a kernel that keeps running out of memory) gets here.
        // Going on would let a plain store race a CAS on a page state, which
        // can hand one page to two holders; stopping is the only safe choice
        // left.
        eprintln!(
            "cxlkv: membarrier(PRIVATE_EXPEDITED) failed after it had worked ({}); \
             the page allocator cannot order its lock-free fast path any more, aborting",
            last.map_or_else(|| "no error".to_owned(), |e| e.to_string())
        );
        std::process::abort();
    }

    /// How often [`heavy`] tries before it gives up.
    #[cfg(not(loom))]
    const HEAVY_ATTEMPTS: usize = 16;

    #[cfg(loom)]
    pub(crate) fn heavy() {
        loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`heavy`] can be used: the kernel supports expedited private
    /// membarriers and this process registered for them. Decided once per
    /// process (the first call registers).
    #[cfg(not(loom))]
    pub(crate) fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            let supported = membarrier(MEMBARRIER_CMD_QUERY);
            supported >= 0
                && supported & libc::c_long::from(MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0
                && membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0
                && membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0
        })
    }

    #[cfg(loom)]
    pub(crate) fn available() -> bool {
        true
    }

    // From `linux/membarrier.h` (the libc crate has them only in its
    // unstable `new` module).
    #[cfg(not(loom))]
    const MEMBARRIER_CMD_QUERY: libc::c_int = 0;
    #[cfg(not(loom))]
    const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    #[cfg(not(loom))]
    const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    #[cfg(not(loom))]
    fn membarrier(cmd: libc::c_int) -> libc::c_long {
        // SAFETY: membarrier(cmd, flags = 0, cpu_id = 0) reads and writes no
        // memory of ours; an unsupported command fails with EINVAL.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                cmd,
                0 as libc::c_uint,
                0 as libc::c_int,
            )
        }
    }
}
