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
//! capacity; and an oracle kept independently of the directory: it holds
//! exactly the acknowledged, undeleted keys of its incarnation at their
//! locations (a key may vanish only if its owner's instance is gone and
//! orphan eviction is on); a key's pins are the sum of what live sessions
//! took; every region the directory holds is committed at the pool manager
//! with the same extent and owner, and counts the keys in it; no page a live
//! owner believes free holds a key, and a client writes only into a region
//! the pool manager holds for it and the directory grants it, on a page no
//! key occupies; every freed-page notice a client applies answers exactly
//! one deletion of its page, with no number skipped; every reply to a
//! retried request equals the first, and a late copy's answer to a pool
//! allocation names the region the request was resolved with; a
//! pool-manager restart recovers exactly the records that reached the disk
//! whole.
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
pub use world::{Failure, Report};

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
