//! The TTL sweeper: a thread per tier that reclaims abandoned staging.
//!
//! A reserve → finish flow that stalls (a crashed request, a lost control
//! message) leaves an entry that the maps cannot tell from an in-flight one;
//! time is the only abandonment signal. Every `max(1 s, min(write_ttl,
//! read_ttl) / 4)` the thread runs one sweep (`Inner::sweep`): expired
//! writes give their pages back, expired reads release their pins
//! (batched unpins) and private temporaries their pages. It never calls a
//! listener or publishes an event (a late `finish_*` then answers
//! `KeyNotExist` and the engine recomputes). It stops when its channel's
//! sender is dropped: `close` does that and joins it, which waits at most
//! for the sweep in progress (its round trips are bounded by the client's
//! deadlines).

use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Inner;

/// A running sweeper thread.
pub(crate) struct Sweeper {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Sweeper {
    pub fn spawn(inner: Arc<Inner>, interval: Duration) -> std::io::Result<Sweeper> {
        let (stop, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("cxlkv-l1-sweeper".into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {
                            if let Err(e) = inner.sweep() {
                                tracing::debug!(error = %e, "L1 sweep skipped");
                            }
                        }
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })?;
        Ok(Sweeper { stop, thread })
    }

    pub fn is_running(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Stops the thread and waits for it.
    pub fn stop(self) {
        drop(self.stop);
        if self.thread.join().is_err() {
            tracing::error!("the L1 sweeper thread panicked");
        }
    }
}
