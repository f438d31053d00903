//! The simulated clock, the event queue and the network.
//!
//! Time is a `u64` of nanoseconds that only the event loop advances: it jumps
//! to the next event. Events at the same instant run in the order they were
//! scheduled (a tie-breaking counter), so the queue's order, and with it the
//! whole run, is a function of the seed.
//!
//! A link delivers each message after its own random delay, so messages
//! overtake each other; it may drop a message, deliver it twice, or, while
//! partitioned, drop everything sent on it. Connections are not links: a
//! message for a connection that has closed in the meantime is dropped at
//! delivery by the receiver.

use std::collections::BTreeMap;

use super::msg::{ConnId, Message};
use super::params::LinkFaults;
use super::rng::SimRng;

/// Everything that can happen.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    Deliver(Message),
    /// A client's timer: next operation, retries, heartbeat, reconnect.
    ClientWake(usize),
    /// Some client's process dies.
    ClientCrash,
    ClientRestart(usize),
    /// The client side of a connection learns that it is gone (reset by the
    /// peer, refused, or the server closed it).
    ConnReset {
        client: usize,
        conn: ConnId,
    },
    /// The directory's transport learns that a connection closed.
    ConnClosedAtDirectory {
        incarnation: u32,
        conn: ConnId,
    },
    DirectoryTick,
    DirectoryCrash,
    DirectoryStart,
    /// The directory's driver notices that its pool-manager connection broke.
    PoolLinkReset {
        directory_incarnation: u32,
    },
    PoolTick,
    PoolCommit {
        incarnation: u32,
    },
    PoolCrash,
    PoolStart,
    /// The pool manager learns that a directory's caller is gone: its
    /// liveness probe finds the process dead, or its TCP connection closed.
    PoolCallerGone {
        caller: crate::pool::Caller,
    },
    /// The directory's pool-manager connection breaks, both processes alive.
    BreakPoolLink,
    /// Some client's link partitions for a while.
    PartitionClient,
    PartitionPoolLink,
    AdminEndSession,
    /// The run's workload time is over: faults heal.
    Heal,
}

/// What the network did (reported per run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub sent: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub partitioned: u64,
}

#[derive(Debug)]
pub(crate) struct Ctx {
    pub now: u64,
    pub rng: SimRng,
    queue: BTreeMap<(u64, u64), Event>,
    next_event: u64,
    pub trace: bool,
    pub client_link: LinkFaults,
    pub pool_link: LinkFaults,
    pub client_partitioned_until: Vec<u64>,
    pub pool_partitioned_until: u64,
    pub net: NetCounters,
}

impl Ctx {
    pub fn new(
        rng: SimRng,
        clients: usize,
        client_link: LinkFaults,
        pool_link: LinkFaults,
    ) -> Self {
        Self {
            now: 0,
            rng,
            queue: BTreeMap::new(),
            next_event: 0,
            trace: false,
            client_link,
            pool_link,
            client_partitioned_until: vec![0; clients],
            pool_partitioned_until: 0,
            net: NetCounters::default(),
        }
    }

    pub fn at(&mut self, at_ns: u64, event: Event) {
        let at_ns = at_ns.max(self.now);
        self.queue.insert((at_ns, self.next_event), event);
        self.next_event += 1;
    }

    pub fn after(&mut self, delay_ns: u64, event: Event) {
        self.at(self.now.saturating_add(delay_ns), event);
    }

    pub fn pop(&mut self) -> Option<Event> {
        let ((at, _), event) = self.queue.pop_first()?;
        debug_assert!(at >= self.now, "time never runs backwards");
        self.now = at;
        Some(event)
    }

    fn delay(rng: &mut SimRng, faults: &LinkFaults) -> u64 {
        let mut d = faults.base_ns + rng.range(0, faults.jitter_ns);
        if rng.chance(faults.slow_p) {
            d += rng.range(0, faults.slow_max_ns);
        }
        d
    }

    fn send(&mut self, faults: LinkFaults, partitioned: bool, msg: Message) {
        self.net.sent += 1;
        if partitioned {
            self.net.partitioned += 1;
            return;
        }
        if self.rng.chance(faults.drop_p) {
            self.net.dropped += 1;
            return;
        }
        if self.rng.chance(faults.dup_p) {
            self.net.duplicated += 1;
            let d = Self::delay(&mut self.rng, &faults);
            self.after(d, Event::Deliver(msg.clone()));
        }
        let d = Self::delay(&mut self.rng, &faults);
        self.after(d, Event::Deliver(msg));
    }

    /// A message on client `client`'s link to the directory (either way).
    pub fn send_client_link(&mut self, client: usize, msg: Message) {
        let partitioned = self
            .client_partitioned_until
            .get(client)
            .is_some_and(|&until| until > self.now);
        self.send(self.client_link, partitioned, msg);
    }

    /// A message on the directory ↔ pool-manager link (either way).
    pub fn send_pool_link(&mut self, msg: Message) {
        let partitioned = self.pool_partitioned_until > self.now;
        self.send(self.pool_link, partitioned, msg);
    }

    /// A delay of the order of one message, for notifications that travel
    /// as a connection event rather than a message (a reset, a close).
    pub fn notify_delay(&mut self) -> u64 {
        Self::delay(&mut self.rng, &self.client_link.clone())
    }
}
