//! The client's side of the exactly-once contract: per-instance sequence
//! numbers, and the window they must stay in.
//!
//! Every mutating request takes a [`SeqTicket`]: a number from 1 upwards,
//! never reused by the instance (across reconnects too), kept unchanged by
//! every retry of that request. The directory remembers the replies of the
//! last `W` numbers (its reply window); a retry below that is refused
//! because it cannot tell whether it ran. So the client never lets its
//! newest number run `W - 1` or more ahead of its oldest unanswered one: a
//! request that would has to wait (bounded) for the oldest to finish.
//!
//! **Directory restarts.** After a `Recovered` reattach the directory
//! refuses every number below the `next_seq` the client presented — those
//! requests went to the previous incarnation, whose state is gone. The
//! window's *incarnation* counts such reattaches; a ticket from an older
//! incarnation is void and its request is re-sent under a fresh ticket
//! ([`SeqWindow::renew`]).
//!
//! `replies_received_below` (sent with every mutating request) is the
//! oldest number still unanswered: every reply below it has arrived, so the
//! directory may drop those cached replies early.

use std::collections::BTreeSet;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// A sequence number held by one request until its answer arrives.
#[derive(Debug)]
pub(crate) struct SeqTicket {
    pub seq: u64,
    pub incarnation: u64,
}

#[derive(Debug)]
struct State {
    next: u64,
    outstanding: BTreeSet<u64>,
    window: u64,
    incarnation: u64,
}

#[derive(Debug)]
pub(crate) struct SeqWindow {
    state: Mutex<State>,
    room: Condvar,
}

/// Why a ticket could not be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowFull {
    pub window: u64,
}

impl SeqWindow {
    /// Numbers start at 1; `window` is the directory's reply window.
    pub fn new(window: u64) -> Self {
        Self {
            state: Mutex::new(State {
                next: 1,
                outstanding: BTreeSet::new(),
                window: window.max(2),
                incarnation: 0,
            }),
            room: Condvar::new(),
        }
    }

    /// The window announced by a (new) session.
    pub fn set_window(&self, window: u64) {
        self.state.lock().window = window.max(2);
        self.room.notify_all();
    }

    /// A fresh number, waiting until `deadline` for room in the window.
    pub fn acquire(&self, deadline: Instant) -> Result<SeqTicket, WindowFull> {
        let mut s = self.state.lock();
        loop {
            let oldest = s.outstanding.first().copied().unwrap_or(s.next);
            if s.next - oldest < s.window - 1 {
                let seq = s.next;
                s.next += 1;
                s.outstanding.insert(seq);
                return Ok(SeqTicket {
                    seq,
                    incarnation: s.incarnation,
                });
            }
            if self.room.wait_until(&mut s, deadline).timed_out() {
                return Err(WindowFull { window: s.window });
            }
        }
    }

    /// The request holding `ticket` got its final answer (or was abandoned).
    pub fn release(&self, ticket: SeqTicket) {
        let mut s = self.state.lock();
        let was_oldest = s.outstanding.first() == Some(&ticket.seq);
        s.outstanding.remove(&ticket.seq);
        if was_oldest {
            self.room.notify_all();
        }
    }

    /// Replaces a ticket of a previous incarnation with a fresh number.
    pub fn renew(&self, ticket: SeqTicket, deadline: Instant) -> Result<SeqTicket, WindowFull> {
        self.release(ticket);
        self.acquire(deadline)
    }

    /// True when `ticket` was issued before the last directory restart.
    pub fn is_void(&self, ticket: &SeqTicket) -> bool {
        self.state.lock().incarnation != ticket.incarnation
    }

    /// Every number below the result has had its reply received.
    pub fn received_below(&self) -> u64 {
        let s = self.state.lock();
        s.outstanding.first().copied().unwrap_or(s.next)
    }

    /// The next number to be issued (presented by `Reattach`).
    pub fn next(&self) -> u64 {
        self.state.lock().next
    }

    /// A `Recovered` reattach: tickets issued so far are void. The floor the
    /// directory set is the `next` presented, so nothing changes for new
    /// numbers.
    pub fn new_incarnation(&self) {
        let mut s = self.state.lock();
        s.incarnation += 1;
        self.room.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn numbers_start_at_one_and_never_repeat() {
        let w = SeqWindow::new(1024);
        let deadline = Instant::now() + Duration::from_secs(1);
        let a = w.acquire(deadline).unwrap();
        let b = w.acquire(deadline).unwrap();
        assert_eq!((a.seq, b.seq), (1, 2));
        assert_eq!(w.received_below(), 1);
        w.release(a);
        assert_eq!(w.received_below(), 2);
        w.release(b);
        assert_eq!(w.received_below(), 3);
        assert_eq!(w.acquire(deadline).unwrap().seq, 3);
    }

    #[test]
    fn the_newest_number_stays_within_the_window_of_the_oldest_unanswered() {
        let w = SeqWindow::new(4);
        let deadline = Instant::now() + Duration::from_millis(20);
        let t1 = w.acquire(deadline).unwrap();
        let _t2 = w.acquire(deadline).unwrap();
        let _t3 = w.acquire(deadline).unwrap();
        assert_eq!(
            w.acquire(deadline).unwrap_err(),
            WindowFull { window: 4 },
            "4 - 1 = 3 numbers may be outstanding"
        );
        w.release(t1);
        assert_eq!(w.acquire(deadline).unwrap().seq, 4);
    }

    #[test]
    fn a_waiting_acquire_proceeds_when_the_oldest_is_released() {
        let w = std::sync::Arc::new(SeqWindow::new(2));
        let t1 = w.acquire(Instant::now()).unwrap();
        let w2 = w.clone();
        let waiter = std::thread::spawn(move || {
            w2.acquire(Instant::now() + Duration::from_secs(10))
                .map(|t| t.seq)
        });
        std::thread::sleep(Duration::from_millis(20));
        w.release(t1);
        assert_eq!(waiter.join().unwrap(), Ok(2));
    }

    #[test]
    fn tickets_of_a_previous_incarnation_are_void_and_renewed_with_fresh_numbers() {
        let w = SeqWindow::new(1024);
        let deadline = Instant::now() + Duration::from_secs(1);
        let t = w.acquire(deadline).unwrap();
        assert!(!w.is_void(&t));
        w.new_incarnation();
        assert!(w.is_void(&t));
        let t = w.renew(t, deadline).unwrap();
        assert_eq!(t.seq, 2);
        assert!(!w.is_void(&t));
    }
}
