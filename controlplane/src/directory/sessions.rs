//! Instances, sessions and the per-session pin ledger.
//!
//! An *instance* outlives connections: it owns regions, a freed-page notice
//! queue and the exactly-once reply window. A *session* is one connection of
//! an instance and owns pins. Each session keeps a ledger `entry slot →
//! (count, since)` of the pins it holds ([`PinLedger`]), and each entry keeps
//! only the total, so pins cost memory per pinned key per session, never per
//! registered key.
//!
//! Invariants: an entry's pin total equals the sum of its counts over all
//! live sessions' ledgers; a pinned entry is never removed, so ledger slots
//! always name live entries; an instance has `absent_since` set iff it has no
//! sessions.

use super::notices::NoticeQueue;
use super::pin_ledger::PinLedger;
use super::sequence::ReplyWindow;
use super::types::{InstanceId, InstanceSecret, Principal, RegionHandle, SessionId, Time};

#[derive(Debug)]
pub(crate) struct Session {
    pub instance: u32,
    pub last_seen: Time,
    pub pins: PinLedger,
    /// Sum of `pins[..].count`.
    pub pin_total: u64,
}

impl Session {
    pub fn new(instance: u32, now: Time, seed: u64) -> Self {
        Self {
            instance,
            last_seen: now,
            pins: PinLedger::new(seed),
            pin_total: 0,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Instance {
    pub id: InstanceId,
    /// `None` for an instance recovered after a directory restart that has
    /// not reattached yet: its first reattach proves itself with region tokens
    /// and sets the secret it presents.
    pub secret: Option<InstanceSecret>,
    pub principal: Option<Principal>,
    /// Every process that has held a session of it (`SO_PEERCRED`'s pids,
    /// at most `MAX_HOLDER_PIDS`, exited ones dropped when it fills): any of
    /// them may have its regions mapped. A `Hello` may take the instance
    /// over only once all are known to have exited
    /// (`Directory::set_holder_probe`).
    pub holder_pids: Vec<u32>,
    /// A holder that cannot be checked: a TCP peer, or more processes than
    /// `holder_pids` keeps.
    pub holder_unchecked: bool,
    pub sessions: Vec<SessionId>,
    /// When the last session ended (`None` while it has sessions).
    pub absent_since: Option<Time>,
    pub quota_bytes: Option<u64>,
    /// Slots of the regions it owns.
    pub regions: Vec<u32>,
    /// Regions a restarted directory learnt from the pool manager, waiting
    /// for this instance's reattach to claim them.
    pub unclaimed: Vec<RegionHandle>,
    pub owned_bytes: u64,
    pub pending_bytes: u64,
    pub pending_requests: usize,
    pub keys: u64,
    pub used_bytes: u64,
    pub notices: NoticeQueue,
    pub replies: ReplyWindow,
    /// Recovered (a reattach found it gone, or a restarted directory's first
    /// reattach claimed it) and no session of it has made a request since.
    /// Until one does, every reattach answers `Recovered` again: the client
    /// may have lost the first answer, and a `Resumed` would tell it that
    /// the state it held survived (docs/protocol.md, `Reattached`).
    pub recovery_unseen: bool,
}

impl Instance {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: InstanceId,
        secret: Option<InstanceSecret>,
        principal: Option<Principal>,
        quota_bytes: Option<u64>,
        first_seq: u64,
        first_notice: u64,
        reply_window: u64,
        now: Time,
    ) -> Self {
        Self {
            id,
            secret,
            principal,
            holder_pids: Vec::new(),
            holder_unchecked: false,
            sessions: Vec::new(),
            absent_since: Some(now),
            quota_bytes,
            regions: Vec::new(),
            unclaimed: Vec::new(),
            owned_bytes: 0,
            pending_bytes: 0,
            pending_requests: 0,
            keys: 0,
            used_bytes: 0,
            notices: NoticeQueue::new(first_notice),
            replies: ReplyWindow::new(first_seq, reply_window),
            recovery_unseen: false,
        }
    }

    pub fn is_present(&self) -> bool {
        !self.sessions.is_empty()
    }
}
