//! How a poller passes the time between two polls: [`Spinner`].
//!
//! Both ends poll for a while before they sleep (`IoConfig::spin_us`). On
//! a loaded host the peer we wait for often shares our vCPU, and then every
//! moment we keep the CPU is added to the round trip: so a poller yields
//! between polls. On a quiet host a yield finds nobody to run and only
//! stretches the polling period (a `sched_yield` costs ~350 ns here): so a
//! yield that comes back at once buys the next `SOLO_SPIN` of polling
//! without yields. The numbers are in the transport essay. Any thread that
//! becomes runnable on this CPU meanwhile waits at most `SOLO_SPIN` (or
//! less, if the scheduler preempts us for it).

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
