//! Stop signals of the long-running commands (`cxlkv serve`, `cxlkv pool`,
//! `cxlkv chaos`), and a graceful stop that cannot hang the process.
//!
//! The main thread blocks SIGTERM, SIGINT and SIGHUP before it starts any
//! other thread, so every thread inherits the mask and the signals wait for
//! the main thread's `sigtimedwait`. SIGINT and SIGHUP are left alone when
//! the process started with them ignored, as a Unix program conventionally
//! does: `nohup cxlkv serve &` ignores SIGHUP (the terminal hanging up), a
//! shell script's `cxlkv serve &` ignores SIGINT, and a supervisor may ignore
//! either; blocking such a signal would queue it for `sigtimedwait` (Linux
//! keeps a blocked signal pending even when its action is to ignore it)
//! and stop the process after all. SIGTERM, a service manager's stop,
//! always stops it, even if ignored on entry (blocked, it is kept pending
//! for `sigtimedwait` all the same). The first stop signal starts a
//! graceful stop ([`stop_within`]): connections closed, the journal
//! committed. That stop runs on a thread of its own while the main thread
//! keeps watching, and it is cut short by a **second** stop signal or by its
//! deadline ([`STOP_DEADLINE`]); the command then exits non-zero at once,
//! without finishing it. Nothing is lost that a crash would not lose: the
//! pool manager's journal is written ahead of every answer it gives, and the
//! next start recovers exactly as after a `kill -9` (DESIGN §8). An
//! operator's second Ctrl-C, or a service manager's stop timeout, thus never
//! meets a process stuck in its shutdown.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long a graceful stop may take before the command exits without
/// finishing it. It waits for region frees in flight (at most 2 s) and for
/// the journal's commit and checkpoint; 30 s leaves a slow device ample
/// room and stays inside the service manager's stop timeout (systemd's
/// default 90 s; the units in `deploy/systemd` set `TimeoutStopSec=45s`, so
/// that this deadline, not a SIGKILL, ends a stuck stop).
pub(crate) const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// How often a stop in progress is checked for a second signal.
const STOP_POLL: Duration = Duration::from_millis(20);

/// The signals that stop a long-running command: SIGTERM always; SIGINT and
/// SIGHUP unless the process started with them ignored (see the module
/// essay).
const STOP_SIGNALS: [(libc::c_int, bool); 3] = [
    (libc::SIGTERM, true),
    (libc::SIGINT, false),
    // A closed terminal: stop as gracefully as when asked to.
    (libc::SIGHUP, false),
];

/// Whether `sig`'s disposition is "ignore". Called before this process
/// changes any disposition, it tells whether the signal was ignored on
/// entry: `exec` keeps an ignored signal ignored and resets a handled one.
fn ignored(sig: libc::c_int) -> bool {
    // SAFETY: sigaction is plain data; zeroed is a valid value the call
    // overwrites.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a null new action only reads the disposition into `old`, a
    // valid sigaction.
    let rc = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    rc == 0 && old.sa_sigaction == libc::SIG_IGN
}

/// Blocks the stop signals ([`STOP_SIGNALS`]) in the calling thread (and so
/// in every thread it starts afterwards), to be taken with `sigtimedwait`.
/// A signal that may stay ignored and was ignored on entry is neither
/// blocked nor waited for, so that it stays ignored; the log says so.
pub(crate) fn block_stop_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; the call only writes to it.
    unsafe { libc::sigemptyset(&mut set) };
    let mut left_ignored = Vec::new();
    for (sig, always) in STOP_SIGNALS {
        if !always && ignored(sig) {
            left_ignored.push(signal_name(sig));
            continue;
        }
        // SAFETY: `set` is a valid, initialised sigset_t and `sig` a valid
        // signal number.
        unsafe { libc::sigaddset(&mut set, sig) };
    }
    // SAFETY: `set` is valid; the call only changes this thread's mask.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    anyhow::ensure!(rc == 0, "pthread_sigmask failed with {rc}");
    if !left_ignored.is_empty() {
        tracing::info!(
            signals = %left_ignored.join(" "),
            "ignored when started (nohup, a background job): left ignored, they do not stop it"
        );
    }
    Ok(set)
}

/// Takes a pending signal of `set`, waiting up to `timeout` for one (zero:
/// only looks).
pub(crate) fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` and `timeout` are valid for the call; a null info
    // pointer is allowed.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &timeout) };
    (sig > 0).then_some(sig)
}

/// How the logs name a stop signal.
pub(crate) fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => format!("signal {other}"),
    }
}

/// Why a graceful stop did not finish.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum StopCut {
    /// Another stop signal arrived meanwhile.
    Signal(i32),
    /// It ran past its deadline.
    Deadline(Duration),
    /// It panicked.
    Panicked,
    /// No thread could be started to run it.
    NoThread(String),
}

impl std::fmt::Display for StopCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopCut::Signal(sig) => write!(f, "a second {} arrived", signal_name(*sig)),
            StopCut::Deadline(d) => write!(f, "it took longer than {d:?}"),
            StopCut::Panicked => write!(f, "it panicked"),
            StopCut::NoThread(e) => write!(f, "no thread could run it: {e}"),
        }
    }
}

impl std::error::Error for StopCut {}

/// The error a command exits with when its graceful stop was cut short.
pub(crate) fn cut_short(cut: StopCut) -> anyhow::Error {
    anyhow::anyhow!(
        "graceful shutdown cut short ({cut}): exiting without finishing it; \
         the next start recovers as after a crash"
    )
}

/// Runs `stop` on a thread of its own and waits for its result: at most
/// `deadline`, and only until another signal of `set` (blocked in the
/// calling thread) arrives. On `Err` the stop may still be running; the
/// caller is expected to exit.
pub(crate) fn stop_within<T: Send + 'static>(
    set: &libc::sigset_t,
    deadline: Duration,
    stop: impl FnOnce() -> T + Send + 'static,
) -> Result<T, StopCut> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("cxlkv-stop".into())
        .spawn(move || {
            // The receiver is gone only if the stop was cut short.
            let _ = tx.send(stop());
        })
        .map_err(|e| StopCut::NoThread(e.to_string()))?;
    let started = Instant::now();
    loop {
        match rx.recv_timeout(STOP_POLL) {
            Ok(done) => return Ok(done),
            Err(RecvTimeoutError::Disconnected) => return Err(StopCut::Panicked),
            Err(RecvTimeoutError::Timeout) => {}
        }
        if let Some(sig) = wait_signal(set, Duration::ZERO) {
            return Err(StopCut::Signal(sig));
        }
        if started.elapsed() >= deadline {
            return Err(StopCut::Deadline(deadline));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop that waits until `release` is dropped or sent to.
    fn stuck(release: mpsc::Receiver<()>) -> impl FnOnce() -> u32 + Send + 'static {
        move || {
            let _ = release.recv();
            7
        }
    }

    #[test]
    fn a_stop_that_finishes_gives_its_result() {
        let set = block_stop_signals().unwrap();
        assert_eq!(stop_within(&set, STOP_DEADLINE, || 7), Ok(7));
    }

    #[test]
    fn a_stop_past_its_deadline_is_cut_short() {
        let set = block_stop_signals().unwrap();
        let (release, rx) = mpsc::channel();
        let t = Instant::now();
        let cut = stop_within(&set, Duration::from_millis(100), stuck(rx));
        assert_eq!(cut, Err(StopCut::Deadline(Duration::from_millis(100))));
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "bounded by the deadline"
        );
        drop(release);
    }

    #[test]
    fn a_second_stop_signal_cuts_a_stop_short() {
        let set = block_stop_signals().unwrap();
        let (release, rx) = mpsc::channel();
        // SAFETY: sends SIGTERM to this thread only, where it is blocked: it
        // stays pending until `stop_within` takes it (no handler runs).
        let rc = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGTERM) };
        assert_eq!(rc, 0);
        let cut = stop_within(&set, STOP_DEADLINE, stuck(rx));
        assert_eq!(cut, Err(StopCut::Signal(libc::SIGTERM)));
        drop(release);
    }

    #[test]
    fn a_stop_that_panics_is_reported() {
        let set = block_stop_signals().unwrap();
        let cut = stop_within(&set, STOP_DEADLINE, || -> u32 { panic!("stop failed") });
        assert_eq!(cut, Err(StopCut::Panicked));
    }
}
