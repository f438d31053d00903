//! io_uring pieces both ends share: building a ring with the configured
//! waiting flags, letting the kernel run pending receive work without
//! waiting, and blocking for a completion with a timeout.
//!
//! Which flags a ring gets (see the transport essay for the measurements):
//! - `TaskRun::Coop` → `COOP_TASKRUN | TASKRUN_FLAG`: the kernel queues
//!   receive work for the submitting thread without interrupting it and
//!   raises a flag in the shared ring; a spinning thread checks the flag and
//!   enters the kernel only then.
//! - `TaskRun::Defer` → `SINGLE_ISSUER | DEFER_TASKRUN | TASKRUN_FLAG` on the
//!   server (one loop thread). The client's reading role moves between
//!   threads, which a single-issuer ring forbids, so a client ring built
//!   from a `Defer` config gets `Coop` flags.
//! - `TaskRun::Interrupt` → no flag: task work interrupts the thread.
//! - `sqpoll` → `SQPOLL` alone: a kernel thread submits and runs the
//!   receive work, so user threads never enter the kernel while busy. The
//!   kernel refuses SQPOLL together with any of the task-run flags above
//!   (`EINVAL`, checked on 6.18), so with `sqpoll` the `taskrun` setting
//!   does not apply.

use std::io;
use std::time::Duration;

use io_uring::{IoUring, types};

use super::config::{IoConfig, TaskRun};

/// `IORING_ENTER_GETEVENTS` from the kernel ABI (not exported by `libc`).
const IORING_ENTER_GETEVENTS: u32 = 1;

/// Which end a ring is for (the client cannot use a single-issuer ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Server,
    Client,
}

/// The task-run mode a ring of `role` actually gets from `cfg`.
pub(crate) fn effective_taskrun(cfg: &IoConfig, role: Role) -> TaskRun {
    match (cfg.taskrun, role) {
        (TaskRun::Defer, Role::Client) => TaskRun::Coop,
        (t, _) => t,
    }
}

/// Builds a ring with the configured waiting flags; completion queue twice
/// the submission queue.
pub(crate) fn build_ring(cfg: &IoConfig, role: Role, entries: u32) -> io::Result<IoUring> {
    let mut b = IoUring::builder();
    b.setup_cqsize(entries * 2);
    if cfg.sqpoll {
        warn_if_sqpoll_starved();
        b.setup_sqpoll(cfg.sqpoll_idle_ms);
    } else {
        match effective_taskrun(cfg, role) {
            TaskRun::Coop => {
                b.setup_coop_taskrun().setup_taskrun_flag();
            }
            TaskRun::Defer => {
                b.setup_single_issuer()
                    .setup_defer_taskrun()
                    .setup_taskrun_flag();
            }
            TaskRun::Interrupt => {}
        }
    }
    b.build(entries)
}

/// Below this many CPUs an SQPOLL ring's kernel thread has no core of its
/// own: it spins on one that the loop, the client and the peer need.
/// `cxlkv bench rtt` on 2 vCPUs: a one-key round trip took 8.5 µs with the
/// server's SQPOLL against 6.5 without, and milliseconds with both ends'
/// (`docs/benchmarks.md`).
const SQPOLL_MIN_CPUS: usize = 4;

/// Whether `cpus` CPUs are too few for SQPOLL to pay (see
/// [`SQPOLL_MIN_CPUS`]).
fn sqpoll_starved(cpus: usize) -> bool {
    cpus < SQPOLL_MIN_CPUS
}

/// Warns once per process when SQPOLL is asked for on a machine too small
/// for it: it still works, only slower, so it is not refused.
fn warn_if_sqpoll_starved() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if sqpoll_starved(cpus) {
        WARNED.call_once(|| {
            tracing::warn!(
                cpus,
                min_cpus = SQPOLL_MIN_CPUS,
                "io_uring SQPOLL is on with fewer CPUs than it needs: its kernel thread \
                 spins on a CPU the loop and its peers need, and round trips get slower \
                 (milliseconds on 2 vCPUs with both ends polling); set sqpoll = false here"
            );
        });
    }
}

/// True when completions wait for this thread to run kernel work (the
/// kernel raised `IORING_SQ_TASKRUN`; only rings built with `TASKRUN_FLAG`
/// ever see it).
pub(crate) fn needs_task_run(ring: &mut IoUring) -> bool {
    ring.submission().taskrun()
}

/// Lets the kernel run pending receive work and post its completions,
/// without waiting.
pub(crate) fn run_task_work(ring: &IoUring) -> io::Result<()> {
    // SAFETY: io_uring_enter with GETEVENTS, nothing to submit, nothing to
    // wait for, no argument pointer: it touches no user memory but the ring.
    let r = unsafe {
        ring.submitter()
            .enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None)
    };
    match r {
        Ok(_) => Ok(()),
        Err(e) if transient(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Submits what is queued and blocks until a completion arrives or
/// `timeout` passes (`None`: no timeout). Timeouts and signals return `Ok`:
/// callers re-check their state and deadlines.
pub(crate) fn submit_and_wait(ring: &IoUring, timeout: Option<Duration>) -> io::Result<()> {
    let r = match timeout {
        Some(t) => {
            let ts = types::Timespec::from(t);
            let args = types::SubmitArgs::new().timespec(&ts);
            ring.submitter().submit_with_args(1, &args)
        }
        None => ring.submitter().submit_and_wait(1),
    };
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ETIME) || transient(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Submits what is queued without waiting.
pub(crate) fn submit(ring: &IoUring) -> io::Result<()> {
    match ring.submit() {
        Ok(_) => Ok(()),
        Err(e) if transient(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Errors of `io_uring_enter` after which a retry is the right answer:
/// a signal, or the completion queue momentarily full (`EBUSY`, `EAGAIN`).
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqpoll_is_flagged_on_machines_without_a_spare_core() {
        // The CI and development VMs have 2 vCPUs: the case measured.
        assert!(sqpoll_starved(1));
        assert!(sqpoll_starved(2));
        assert!(sqpoll_starved(3));
        assert!(!sqpoll_starved(4));
        assert!(!sqpoll_starved(128));
    }
}
