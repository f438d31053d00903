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
//! ([`SeqWindow::renew`]) — never under its own number.
//!
//! Void tickets leave the window at once ([`SeqWindow::new_incarnation`]):
//! only live tickets hold it back. The window exists so that every retry of
//! a live number lands in the directory's reply window. A void ticket's
//! request is not retried under its number (the exchange renews the ticket
//! before any attempt), and numbers are never reused, so no other request's
//! reply can be cached under a void number: one that reaches the new
//! directory anyway is at worst refused as too old. Were void tickets
//! counted, they would hold the window back for as long as their holders
//! keep them — the request that triggered the reattach, another waiting on
//! it, or a parked registration that only a completed reattach can resolve
//! — while the reattach registers every key again, one fresh number per
//! batch: one needing more than `W - 2` numbers could never complete.
//!
//! `replies_received_below` (sent with every mutating request) is the
//! oldest live number still unanswered: every reply below it has arrived,
//! or belongs to a void number whose reply is never asked for, so the
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
    /// Live tickets (of the current incarnation) not yet released.
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
    /// A void ticket left the window when it became void: nothing to do.
    pub fn release(&self, ticket: SeqTicket) {
        let mut s = self.state.lock();
        if ticket.incarnation != s.incarnation {
            debug_assert!(
                !s.outstanding.contains(&ticket.seq),
                "a void ticket is outstanding"
            );
            return;
        }
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

    /// Every live number below the result has had its reply received (a
    /// void one's reply is never asked for).
    pub fn received_below(&self) -> u64 {
        let s = self.state.lock();
        s.outstanding.first().copied().unwrap_or(s.next)
    }

    /// The next number to be issued (presented by `Reattach`).
    pub fn next(&self) -> u64 {
        self.state.lock().next
    }

    /// A `Recovered` reattach: tickets issued so far are void, and leave
    /// the window (see the module docs), so the reattach's own requests
    /// have all of it. The floor the directory set is the `next` presented,
    /// so nothing changes for new numbers.
    pub fn new_incarnation(&self) {
        let mut s = self.state.lock();
        s.incarnation += 1;
        s.outstanding.clear();
        self.room.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::client::{Client, ClientConfig, DeleteOutcome, LayoutHandle, LayoutOptions};
    use crate::server::{Server, ServerConfig, ServerError, ServerHandle};

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

    /// Found by a review of the client: void tickets stayed outstanding and
    /// held the window back, so a reattach that needed more than `W - 2`
    /// fresh numbers (registering the index again, one per batch) stalled
    /// behind the void ticket of the request that triggered it, or of a
    /// parked registration, and never completed.
    #[test]
    fn void_tickets_do_not_hold_the_window_back() {
        let w = SeqWindow::new(4);
        let deadline = Instant::now() + Duration::from_millis(20);
        let void = [w.acquire(deadline).unwrap(), w.acquire(deadline).unwrap()];
        w.new_incarnation();
        assert_eq!(
            w.received_below(),
            w.next(),
            "no live ticket is outstanding"
        );
        for _ in 0..10 {
            let t = w.acquire(deadline).expect("a void ticket holds no room");
            w.release(t);
        }
        let live = w.acquire(deadline).unwrap();
        // Releasing (or renewing) a void ticket does not touch the live ones.
        let [a, b] = void;
        w.release(a);
        let renewed = w.renew(b, deadline).unwrap();
        assert_eq!(w.received_below(), live.seq);
        w.release(live);
        assert_eq!(w.received_below(), renewed.seq);
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

    /// A server kept on its pool across restarts — a reply window of 64
    /// and one key per batch, so that registering 70 keys again takes more
    /// numbers than the window — and a client (short timeouts) whose 4 KiB
    /// layout holds those 70 keys. Dropping it stops the server and removes
    /// the pool and its state.
    struct RestartedDirectory {
        cfg: ServerConfig,
        server: Option<ServerHandle>,
        client: Option<(Client, LayoutHandle)>,
    }

    impl RestartedDirectory {
        /// The first start runs `start` (a restart is a plain one); `tune`
        /// adjusts the client's configuration.
        fn start(
            tag: &str,
            start: impl FnOnce(ServerConfig) -> Result<ServerHandle, ServerError>,
            tune: impl FnOnce(&mut ClientConfig),
        ) -> Self {
            let mut cfg = ServerConfig::ephemeral(tag);
            cfg.pool_size_bytes = 64 << 20;
            cfg.default_region_bytes = 4 << 20;
            cfg.remove_pool_on_shutdown = false;
            cfg.directory.reply_window = 64;
            cfg.directory.max_batch = 1;
            cfg.directory.session_lease = Duration::from_secs(30);
            cfg.directory.instance_grace = Duration::from_secs(60);
            let mut this = Self {
                server: Some(start(cfg.clone()).expect("the server starts")),
                cfg,
                client: None,
            };
            let mut ccfg = ClientConfig::unix(this.server().socket_path());
            ccfg.request_timeout_ms = 200;
            tune(&mut ccfg);
            let client = Client::connect(ccfg).expect("connect");
            let opts = LayoutOptions {
                initial_reservation_bytes: 0,
                region_size_bytes: 4 << 20,
                auto_expand: true,
            };
            let layout = client.layout_with(4096, 7, opts).expect("a layout");
            for i in 0..70u32 {
                layout.put(format!("k{i}"), b"bytes").unwrap();
            }
            this.client = Some((client, layout));
            this
        }

        fn server(&self) -> &ServerHandle {
            self.server.as_ref().expect("the server runs")
        }

        fn client(&self) -> &Client {
            &self.client.as_ref().expect("connected").0
        }

        fn layout(&self) -> &LayoutHandle {
            &self.client.as_ref().expect("connected").1
        }

        /// Stops the directory and starts it again on the same pool.
        fn restart(&mut self) {
            if let Some(s) = self.server.take() {
                s.shutdown().expect("the server stops");
            }
            self.server = Some(Server::start(self.cfg.clone()).expect("the server restarts"));
        }
    }

    impl Drop for RestartedDirectory {
        fn drop(&mut self) {
            drop(self.client.take());
            if let Some(s) = self.server.take() {
                let _ = s.shutdown();
            }
            self.cfg.remove_pool_on_shutdown = true;
            if let Ok(s) = Server::start(self.cfg.clone()) {
                let _ = s.shutdown();
            }
        }
    }

    /// Found by a review of the client: after a directory restart, the
    /// reattach registers the index again under a fresh number per batch,
    /// while the request that reconnects still holds its own, void, number:
    /// it held the window back, so once the index took `W - 2` batches the
    /// reattach stalled waiting for room and failed, however healthy the
    /// server.
    #[test]
    fn a_reattach_after_a_restart_reregisters_more_batches_than_the_window() {
        let mut d = RestartedDirectory::start("window-reregister", Server::start, |cfg| {
            cfg.reconnect_timeout_ms = 3_000;
        });
        d.restart();
        // A mutating request reconnects, holding a sequence number.
        let outcome = d.layout().delete(b"k0");
        assert!(
            matches!(outcome, Ok(DeleteOutcome::Deleted)),
            "{outcome:?} ({} keys registered again)",
            d.client().stats().keys_reregistered
        );
        assert!(d.layout().exists(b"k69").unwrap(), "registered again");
    }

    /// Found by a review of the client (the permanent form of the above): a
    /// registration in flight when the directory went away is parked with
    /// its number. That number, void after the restart, stayed outstanding
    /// until the batch was resolved — which takes a connection — and held
    /// the window back, so no reattach could ever complete.
    #[cfg(feature = "fault-injection")]
    #[test]
    fn a_parked_registration_does_not_keep_the_client_from_ever_reattaching() {
        use cxlkv_controlplane::proto::Kind;
        use cxlkv_controlplane::transport::fault::{FaultScript, ReplyMatch};
        let script = FaultScript::new();
        let faulty = |cfg| Server::start_with_faults(cfg, Box::new(script.clone()));
        let mut d = RestartedDirectory::start("window-parked", faulty, |cfg| {
            cfg.max_retries = 1;
            cfg.reconnect_timeout_ms = 2_000;
        });
        // One more registration whose every answer is lost: parked.
        let _ = script.drop_reply(ReplyMatch::request_kind(Kind::Register.as_u16()));
        assert!(d.layout().put(b"lost", b"bytes").is_err());
        assert_eq!(d.client().unresolved_registrations(), 1);
        d.restart();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = d.layout().exists(b"k0");
        while !matches!(last, Ok(true)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            last = d.layout().exists(b"k0");
        }
        assert!(
            matches!(last, Ok(true)),
            "still not reattached after 20 s: {last:?}; parked {}; {:?}",
            d.client().unresolved_registrations(),
            d.client().stats()
        );
    }
}
