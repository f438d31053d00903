//! How a poller passes the time between two polls.

use std::time::{Duration, Instant};

/// A yield that returns within this did not run another thread: alone, a
/// `sched_yield` costs ~350 ns here; handing the CPU to another thread and
/// back costs two context switches plus that thread's work.
const SOLO_YIELD: Duration = Duration::from_nanos(1_500);
/// After a yield found this CPU otherwise idle, poll this long without
/// yielding before asking again.
const SOLO_SPIN: Duration = Duration::from_micros(10);

/// Yields the CPU between polls — the peer we wait for may share this vCPU
/// on a loaded host — unless the last yield showed nobody else wants it.
#[derive(Debug, Default)]
pub(crate) struct Spinner {
    /// Until then, poll without yielding (the last yield ran nobody else).
    solo_until: Option<Instant>,
}

impl Spinner {
    /// One pause between polls; `now` is the caller's latest clock reading.
    pub(crate) fn pause(&mut self, now: Instant) {
        if let Some(t) = self.solo_until
            && now < t
        {
            std::hint::spin_loop();
            return;
        }
        std::thread::yield_now();
        let after = Instant::now();
        self.solo_until = (after.duration_since(now) < SOLO_YIELD).then_some(after + SOLO_SPIN);
    }
}
