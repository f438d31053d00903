//! Fault injection on the server's reply path (cargo feature
//! `fault-injection`).
//!
//! The hook sits in the server because that is where a lost, late,
//! duplicated or reordered reply or a reset connection originates in real
//! life, and because every client above it — the Rust client, the C ABI,
//! the L1 tier — is then tested through its real socket code, unchanged.
//!
//! A [`FaultPlan`] is consulted for every request frame received
//! ([`FaultPlan::on_request`]: deliver it, or reset the connection instead)
//! and for every reply the handler produces ([`FaultPlan::on_reply`]:
//! deliver, drop, delay, duplicate, hold back behind the next reply, or reset
//! the connection). Requests count as answered when the handler replies, so
//! a dropped reply frees its in-flight slot as a lost packet would.
//!
//! [`FaultScript`] is a ready-made plan built from rules, shared between the
//! test and the server so the test can add rules and read how often each
//! fired:
//!
//! ```
//! # use cxlkv_controlplane::transport::fault::{FaultScript, ReplyMatch};
//! # use std::time::Duration;
//! const LOOKUP: u16 = 7;
//! let script = FaultScript::new()
//!     .drop_reply(ReplyMatch::request_kind(LOOKUP).nth(3))   // 3rd Lookup's reply is lost
//!     .delay_replies(ReplyMatch::any(), Duration::from_millis(50))
//!     .reset_connection_at_frame(10);                        // 10th frame of a connection
//! ```
//!
//! Rules are tried in order and the first that matches fires; a rule with
//! `nth` fires once, the others on every match.
//!
//! **Shutdown discards held replies.** A reply held back by `Delay` or
//! `Reorder` when the server stops is dropped, like every reply not yet
//! written: shutdown closes connections without flushing them (see
//! `ServerHandle::shutdown`). A test that needs such a reply must wait for
//! it before stopping the server.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::server::ConnId;
use crate::frame::FrameHeader;

/// A request frame as the fault plan sees it.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo {
    pub conn: ConnId,
    pub header: FrameHeader,
    /// 1 for the first frame received on this connection.
    pub nth_on_conn: u64,
}

/// A reply as the fault plan sees it.
#[derive(Debug, Clone, Copy)]
pub struct ReplyInfo {
    pub conn: ConnId,
    /// Kind of the reply frame.
    pub kind: u16,
    pub request_id: u64,
    /// Kind of the request this answers (None: it answers no request in
    /// flight, e.g. an error reply to a rejected frame or a notice).
    pub request_kind: Option<u16>,
    /// 1 if it answers the first request of that kind the server received
    /// (counted server-wide).
    pub nth_of_request_kind: Option<u64>,
    /// 1 for the first reply the server produced (server-wide).
    pub nth_reply: u64,
}

/// What to do with a request frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestFault {
    Deliver,
    /// Do not deliver it; reset the connection (RST on TCP).
    Reset,
}

/// What to do with a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplyFault {
    Deliver,
    Drop,
    /// Send it after this long (discarded if the server stops first).
    Delay(Duration),
    /// Send it twice.
    Duplicate,
    /// Hold it back and send it right after the next reply to the same
    /// connection (or after 200 ms if none comes; discarded if the
    /// connection closes or the server stops first).
    Reorder,
    /// Do not send it; reset the connection.
    Reset,
}

/// A fault plan, consulted on the server's loop thread.
pub trait FaultPlan: Send + 'static {
    fn on_request(&mut self, req: &RequestInfo) -> RequestFault {
        let _ = req;
        RequestFault::Deliver
    }
    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        let _ = reply;
        ReplyFault::Deliver
    }
}

/// Which replies a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplyMatch {
    request_kind: Option<u16>,
    nth: Option<u64>,
    conn: Option<ConnId>,
}

impl ReplyMatch {
    /// Every reply.
    pub fn any() -> Self {
        Self::default()
    }
    /// Replies to requests of `kind`.
    pub fn request_kind(kind: u16) -> Self {
        Self {
            request_kind: Some(kind),
            ..Self::default()
        }
    }
    /// Only the reply to the `n`-th (1-based) request of the kind, or with
    /// `any()` the `n`-th reply; the rule then fires once.
    pub fn nth(mut self, n: u64) -> Self {
        self.nth = Some(n);
        self
    }
    /// Only replies to one connection.
    pub fn on_conn(mut self, conn: ConnId) -> Self {
        self.conn = Some(conn);
        self
    }

    fn matches(&self, r: &ReplyInfo) -> bool {
        if self.conn.is_some_and(|c| c != r.conn) {
            return false;
        }
        match (self.request_kind, self.nth) {
            (Some(k), n) => {
                r.request_kind == Some(k) && n.is_none_or(|n| r.nth_of_request_kind == Some(n))
            }
            (None, Some(n)) => r.nth_reply == n,
            (None, None) => true,
        }
    }
}

#[derive(Debug, Clone)]
enum Rule {
    Reply { m: ReplyMatch, fault: ReplyFault },
    ResetAtFrame { n: u64 },
}

#[derive(Debug, Default)]
struct ScriptInner {
    rules: Vec<(Rule, u64)>,
}

/// A scripted [`FaultPlan`]; clones share the rules and the counters.
#[derive(Clone, Default)]
pub struct FaultScript {
    inner: Arc<Mutex<ScriptInner>>,
}

impl fmt::Debug for FaultScript {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultScript")
            .field("rules", &self.inner.lock().rules)
            .finish()
    }
}

impl FaultScript {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(self, rule: Rule) -> Self {
        self.inner.lock().rules.push((rule, 0));
        self
    }

    /// Adds a rule: replies matching `m` get `fault`.
    pub fn rule(self, m: ReplyMatch, fault: ReplyFault) -> Self {
        self.push(Rule::Reply { m, fault })
    }
    pub fn drop_reply(self, m: ReplyMatch) -> Self {
        self.rule(m, ReplyFault::Drop)
    }
    pub fn delay_replies(self, m: ReplyMatch, by: Duration) -> Self {
        self.rule(m, ReplyFault::Delay(by))
    }
    pub fn duplicate_reply(self, m: ReplyMatch) -> Self {
        self.rule(m, ReplyFault::Duplicate)
    }
    pub fn reorder_reply(self, m: ReplyMatch) -> Self {
        self.rule(m, ReplyFault::Reorder)
    }
    pub fn reset_on_reply(self, m: ReplyMatch) -> Self {
        self.rule(m, ReplyFault::Reset)
    }
    /// The `n`-th (1-based) frame received on any connection is not
    /// delivered; that connection is reset instead. "Reset after N frames"
    /// is `reset_connection_at_frame(N + 1)`.
    pub fn reset_connection_at_frame(self, n: u64) -> Self {
        self.push(Rule::ResetAtFrame { n })
    }

    /// How often rule `index` (in the order added) fired.
    pub fn fired(&self, index: usize) -> u64 {
        self.inner.lock().rules.get(index).map_or(0, |(_, n)| *n)
    }

    /// Removes every rule (the plan then delivers everything).
    pub fn clear(&self) {
        self.inner.lock().rules.clear();
    }
}

impl FaultPlan for FaultScript {
    fn on_request(&mut self, req: &RequestInfo) -> RequestFault {
        let mut inner = self.inner.lock();
        for (rule, fired) in inner.rules.iter_mut() {
            if let Rule::ResetAtFrame { n } = rule
                && req.nth_on_conn == *n
            {
                *fired += 1;
                return RequestFault::Reset;
            }
        }
        RequestFault::Deliver
    }

    fn on_reply(&mut self, reply: &ReplyInfo) -> ReplyFault {
        let mut inner = self.inner.lock();
        for (rule, fired) in inner.rules.iter_mut() {
            if let Rule::Reply { m, fault } = rule
                && m.matches(reply)
                && (m.nth.is_none() || *fired == 0)
            {
                *fired += 1;
                return *fault;
            }
        }
        ReplyFault::Deliver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(kind: Option<u16>, nth_kind: Option<u64>, nth: u64) -> ReplyInfo {
        ReplyInfo {
            conn: ConnId::for_tests(1),
            kind: 100,
            request_id: nth,
            request_kind: kind,
            nth_of_request_kind: nth_kind,
            nth_reply: nth,
        }
    }

    #[test]
    fn nth_of_kind_fires_once_on_that_request_only() {
        let mut s = FaultScript::new().drop_reply(ReplyMatch::request_kind(7).nth(3));
        assert_eq!(s.on_reply(&reply(Some(7), Some(2), 1)), ReplyFault::Deliver);
        assert_eq!(s.on_reply(&reply(Some(8), Some(3), 2)), ReplyFault::Deliver);
        assert_eq!(s.on_reply(&reply(Some(7), Some(3), 3)), ReplyFault::Drop);
        assert_eq!(s.on_reply(&reply(Some(7), Some(3), 4)), ReplyFault::Deliver);
        assert_eq!(s.fired(0), 1);
    }

    #[test]
    fn first_matching_rule_wins_and_unbounded_rules_repeat() {
        let mut s = FaultScript::new()
            .duplicate_reply(ReplyMatch::any().nth(2))
            .delay_replies(ReplyMatch::any(), Duration::from_millis(5));
        assert_eq!(
            s.on_reply(&reply(None, None, 1)),
            ReplyFault::Delay(Duration::from_millis(5))
        );
        assert_eq!(s.on_reply(&reply(None, None, 2)), ReplyFault::Duplicate);
        assert_eq!(
            s.on_reply(&reply(None, None, 3)),
            ReplyFault::Delay(Duration::from_millis(5))
        );
        assert_eq!((s.fired(0), s.fired(1)), (1, 2));
    }
}
