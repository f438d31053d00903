//! Deterministic simulation of the control plane (issue 10, item 2).
//!
//! One `u64` seed drives a whole world: the real [`Directory`] and
//! [`PoolManager`] state machines, several simulated client instances, a
//! simulated network between clients and the directory and between the
//! directory and the pool manager, a simulated clock, and faults — dropped,
//! delayed, duplicated and reordered messages, partitions, client crashes,
//! directory restarts (rebuilt with `Directory::recover` from the pool
//! manager's list), pool-manager restarts (rebuilt from its checkpoint and
//! journal bytes, with a torn tail where a crash cut an uncommitted record).
//! There are no threads, no wall clock and no hash-order dependence in the
//! simulated world, so a seed replays exactly: a failing seed is a
//! reproducer.
//!
//! Links are connections, as the real transports' stream sockets are:
//! messages on one may be lost, delayed, duplicated and reordered, but a
//! message sent to one incarnation of a process never reaches the next. A
//! client's requests name their connection; the directory's requests to the
//! pool manager name both ends' incarnations and the connection, are dropped
//! when either has died or the directory has left that connection, and the
//! directory ignores answers from an incarnation it has left. (The pool
//! manager's exactly-once answers to tagged allocations rely on this; see
//! `pool::tag_answers`.)
//!
//! The directory reaches the pool manager over TCP in half the seeds — the
//! pool manager's caller is then the connection, whose close ends it, and
//! the connection also breaks with both processes alive — and over the
//! local socket in the others (the caller is the directory's process, ended
//! by the liveness probe). Its mutating requests carry a `seq`, resent
//! unchanged on a new connection, and pass through the pool service's
//! exactly-once front (`pool::service::cache::exactly_once`: the reply
//! cache, then `PoolManager::keep_retried` for an allocation's answer), as
//! the service runs them.
//!
//! ## A run
//!
//! 1. *Run*: the clients work (write and register, look up with and
//!    without pins, unpin, delete, request and return regions, heartbeat)
//!    while faults are injected, for a seed-chosen simulated time.
//! 2. *Heal*: faults stop; crashed processes come back; the clients finish
//!    what they started. Every key a live client registered must then be in
//!    the directory, also across directory restarts (re-registered).
//! 3. *Clean*: the clients leave; a janitor deletes every key name.
//! 4. *Drain*: sessions, instances and regions go away; the run passes when
//!    everything is back to the baseline — no keys, no pins, no sessions, no
//!    regions, the pool entirely free.
//!
//! ## Checked after every event
//!
//! Both machines' own `check_invariants`; the pool's free + allocated =
//! capacity, and the committed regions lie inside the pool without
//! overlapping; and an oracle kept independently of the directory: it holds
//! exactly the acknowledged, undeleted keys of its incarnation at their
//! locations (a key may vanish only if it is unpinned and its owner's
//! instance is gone with orphan eviction on, or LRU eviction is on — an
//! eviction from a live owner's region then owes that owner a freed-page
//! notice, as a delete does); a key's pins are the sum of what live
//! sessions took; every region the directory holds is committed at the
//! pool manager with the same extent and owner, and counts the keys in it,
//! and every key's region is one of them; no page a live owner believes
//! free holds a key, and a client writes only into a region the pool
//! manager holds for it and the directory grants it, on a page no key
//! occupies; every freed-page notice a client applies answers exactly one
//! deletion or eviction of its page, with no number skipped; every reply
//! to a retried request equals the first, and one answered `ReplyEvicted`
//! ran before; a late copy's answer to a pool allocation names the region
//! the request was resolved with; a pool-manager restart recovers exactly
//! the records that reached the disk whole.
//!
//! Reads are compared with the oracle when the directory answers them:
//! every `lookup` (pinned or not; a retried pinned one got the first
//! answer, compared when it ran) finds each key exactly where the oracle
//! holds it, or nowhere, and describes each region it names once, with the
//! extent the pool manager committed; every `exists` is true exactly for
//! the keys the oracle holds.
//!
//! Sessions and instances end by the oracle's own clock, not by what the
//! directory reports: it keeps when each session was last heard from (its
//! handshake or its last request), so a session the directory expires
//! before its lease ran out, or keeps past it, fails the seed; and a life
//! without sessions ends when a directory tick finds `instance_grace`
//! passed since its last session ended (or when a restarted directory is
//! given none of its regions). After every handshake and tick the
//! directory must hold an instance for exactly the lives the oracle holds.
//!
//! A fifth of the seeds turn LRU eviction on, three tenths lower the notice
//! queue limit to 2–8 (so owners' queues fill: deletes refused `busy`, the
//! LRU passing keys over), a quarter shrink the reply cache to a few
//! hundred bytes (so retries meet `ReplyEvicted`); `Report::rare` counts
//! how often these and the other rare paths ran, and the long form
//! (`examples/sim.rs`) fails a campaign of 1,000 seeds or more in which one
//! never ran.
//!
//! ## Running it
//!
//! ```text
//! cargo test -p cxlkv-controlplane --features sim --test sim          # CI form
//! CXLKV_SIM_SEEDS=100000 cargo test --release -p cxlkv-controlplane --features sim --test sim
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seeds 1000000 --threads 2 [--long] [--first <seed>]
//! cargo run --release -p cxlkv-controlplane --features sim --example sim -- \
//!     --seed <seed> --trace                                            # replay one
//! CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
//!     cargo run --release --target-dir target/sim-debug-assert -p cxlkv-controlplane \
//!     --features sim --example sim -- --seeds 300 --threads 2          # debug_assert!s on
//! ```
//!
//! [`Directory`]: crate::directory::Directory
//! [`PoolManager`]: crate::pool::PoolManager

mod client;
mod msg;
mod net;
mod params;
mod pool_node;
mod rng;
mod world;

pub use client::ClientCounters;
pub use net::NetCounters;
pub use params::Scale;
pub use pool_node::PoolCounters;
pub use rng::SimRng;
pub use world::{Failure, RarePaths, Report};

/// Runs one seed. `trace` prints every event to standard output.
pub fn run_seed(seed: u64, scale: Scale, trace: bool) -> Result<Report, Failure> {
    world::World::new(seed, scale, trace)?.run()
}

/// The command that replays `seed` with its event log.
pub fn replay_command(seed: u64, scale: Scale) -> String {
    let long = match scale {
        Scale::Short => "",
        Scale::Long => " --long",
    };
    format!(
        "cargo run --release -p cxlkv-controlplane --features sim --example sim -- --seed {seed}{long} --trace"
    )
}
