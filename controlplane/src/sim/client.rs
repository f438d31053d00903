//! A simulated client instance: what the real client library does with the
//! directory's replies, reduced to its bookkeeping.
//!
//! It owns regions and, per region, a page allocator with generations (every
//! allocation of a page bumps its generation); it remembers which of its
//! pages hold which registered key; it holds pins on its current session; it
//! numbers its mutating requests and retries them exactly as the directory's
//! window rule demands (same request, same `seq`, after a timeout or a
//! reconnect); it applies freed-page notices in order, each once; after a
//! directory restart it reattaches with its region tokens and registers its
//! keys again.
//!
//! The rules it follows, which the real client must follow too:
//! - a page is written only while the last reply from the directory is
//!   younger than half the session lease (after that the directory may have
//!   declared the instance gone and the pool may reuse the region);
//! - a reply whose notices skip a number is a protocol violation;
//! - a notice whose generation matches a page whose `register` reply has not
//!   arrived frees it when the reply arrives (`FreedInFlight`);
//! - a recovery (a directory restart, or the instance declared gone) shows
//!   as a `Recovered` reattach — repeated until a session of the instance
//!   makes a request, so a lost answer is told again — and a restart also
//!   as a new `directory_epoch`: the client then registers again the keys in
//!   the regions still its own;
//! - after a restart or a `Recovered` reattach, outstanding requests may be
//!   rebuilt (the previous incarnation's window is void): register entries
//!   whose page a notice already freed are dropped, never registered again;
//! - after a `Resumed` reattach, an outstanding request is resent unchanged
//!   (changing it under the same `seq` is `SequenceReused`).

use std::collections::{BTreeMap, BTreeSet};

use cxlkv_dataplane::ids::{Generation, PageIndex, RegionId};

use crate::directory::{
    DirectoryError, FreedPageNotice, InstanceSecret, Location, PresentedRegion, ReattachKind,
    RegionGrant, RegionHandle, RegionStatus, RegisterOutcome, Sequence,
};

use super::msg::{ClientReply, ClientRequest, ConnId, Message};
use super::net::Ctx;
use super::params::{BLOCK_BYTES, LAYOUTS, MS, Params, SESSION_LEASE_NS};

/// A request without a reply for this long is sent again.
pub(crate) const REQUEST_TIMEOUT_NS: u64 = 50 * MS;
/// Timeouts in a row on one connection before the client gives up on it.
const TIMEOUTS_BEFORE_RECONNECT: u32 = 4;
const HEARTBEAT_EVERY_NS: u64 = SESSION_LEASE_NS / 4;
/// The write rule (see the module docs).
const WRITE_LEASE_NS: u64 = SESSION_LEASE_NS / 2;
/// The span of sequence numbers in flight is kept well inside the window.
const MAX_SEQ_SPAN: u64 = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Worker,
    /// The clean-up at the end of a run: deletes every key name, then leaves.
    Janitor,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PageState {
    Free,
    /// Written; `register` sent, reply not received.
    Allocated(Vec<u8>),
    /// As `Allocated`, and a notice already freed it (the registration
    /// succeeded and the key was deleted before the reply arrived).
    FreedInFlight(Vec<u8>),
    Registered(Vec<u8>),
}

#[derive(Debug, Clone)]
pub(crate) struct Page {
    pub generation: u32,
    pub state: PageState,
}

#[derive(Debug, Clone)]
pub(crate) struct OwnedRegion {
    pub handle: RegionHandle,
    pub layout: usize,
    pub pages: Vec<Page>,
    /// A `return_region` is outstanding: nothing is allocated from it.
    pub returning: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Op {
    Register {
        layout: usize,
        entries: Vec<(Vec<u8>, Location)>,
    },
    Lookup {
        layout: usize,
        keys: Vec<Vec<u8>>,
        pins: u32,
    },
    Exists {
        layout: usize,
        keys: Vec<Vec<u8>>,
    },
    Unpin {
        layout: usize,
        entries: Vec<(Vec<u8>, u32)>,
    },
    Delete {
        layout: usize,
        keys: Vec<Vec<u8>>,
    },
    RequestRegion {
        layout: usize,
        len_bytes: u64,
    },
    ReturnRegion {
        region: RegionId,
    },
    Heartbeat,
}

impl Op {
    fn mutating(&self) -> bool {
        match self {
            Op::Lookup { pins, .. } => *pins > 0,
            Op::Exists { .. } | Op::Heartbeat => false,
            _ => true,
        }
    }
}

#[derive(Debug, Clone)]
struct Pending {
    op: Op,
    seq: Option<u64>,
    /// When it was last sent on the current connection (`None`: not yet).
    last_sent_ns: Option<u64>,
}

#[derive(Debug, Clone)]
enum Handshake {
    Hello,
    Reattach { presented: Vec<RegionId> },
}

#[derive(Debug, Clone)]
struct Conn {
    id: ConnId,
    ready: bool,
    timeouts: u32,
    handshake: Handshake,
    handshake_req: u64,
    handshake_sent_ns: u64,
}

/// What the world checks about a client after each event.
#[derive(Debug, Clone)]
pub(crate) enum Observation {
    Violation(String),
    NoticeApplied(FreedPageNotice),
    /// A page was allocated (and written) in this region.
    Wrote {
        region: RegionId,
        page: u32,
    },
    /// The client closed this connection (the directory's transport sees the
    /// close).
    Closed(ConnId),
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ClientCounters {
    pub requests: u64,
    pub retries: u64,
    pub reconnects: u64,
    pub notices_applied: u64,
    pub stale_notices: u64,
    pub reregistered: u64,
    /// Requests answered `ReplyEvicted`: they ran, their reply was lost
    /// and its body since dropped from the directory's cache.
    pub replies_evicted: u64,
}

#[derive(Debug)]
pub(crate) struct Client {
    pub ix: usize,
    pub name: String,
    pub role: Role,
    pub alive: bool,
    /// Process incarnation: bumped by every restart after a crash.
    pub process: u32,
    conn: Option<Conn>,
    reconnect_at_ns: u64,
    secret: Option<InstanceSecret>,
    epoch: Option<u64>,
    next_seq: u64,
    notice_applied: u64,
    pub regions: BTreeMap<RegionId, OwnedRegion>,
    outstanding: BTreeMap<u64, Pending>,
    attempts: BTreeMap<u64, u64>,
    next_lid: u64,
    next_req: u64,
    pins: BTreeMap<(usize, Vec<u8>), u32>,
    last_reply_ns: u64,
    last_sent_ns: u64,
    /// No new work (heal and close phases); outstanding work completes.
    pub quiet: bool,
    /// Closed for good (end of run, or the janitor's work is done).
    pub done: bool,
    janitor_todo: Vec<(usize, Vec<u8>)>,
    pub observations: Vec<Observation>,
    pub counters: ClientCounters,
}

pub(crate) fn key_name(k: u8) -> Vec<u8> {
    format!("k{k}").into_bytes()
}

impl Client {
    pub fn new(ix: usize, name: String, role: Role) -> Self {
        Self {
            ix,
            name,
            role,
            alive: true,
            process: 0,
            conn: None,
            reconnect_at_ns: 0,
            secret: None,
            epoch: None,
            next_seq: 1,
            notice_applied: 0,
            regions: BTreeMap::new(),
            outstanding: BTreeMap::new(),
            attempts: BTreeMap::new(),
            next_lid: 1,
            next_req: 0,
            pins: BTreeMap::new(),
            last_reply_ns: 0,
            last_sent_ns: 0,
            quiet: false,
            done: false,
            janitor_todo: Vec::new(),
            observations: Vec::new(),
            counters: ClientCounters::default(),
        }
    }

    fn violation(&mut self, what: String) {
        self.observations.push(Observation::Violation(format!(
            "client {}: {what}",
            self.name
        )));
    }

    pub fn conn_id(&self) -> Option<ConnId> {
        self.conn.as_ref().map(|c| c.id)
    }

    pub fn session_ready(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.ready)
    }

    /// Nothing outstanding and connected (or finished): the settled state.
    pub fn settled(&self) -> bool {
        !self.alive || self.done || (self.session_ready() && self.outstanding.is_empty())
    }

    pub fn may_write(&self, now: u64) -> bool {
        self.session_ready() && now.saturating_sub(self.last_reply_ns) < WRITE_LEASE_NS
    }

    /// The process died: everything in memory is gone.
    pub fn crash(&mut self) {
        let (ix, name, role, process) = (self.ix, self.name.clone(), self.role, self.process);
        *self = Self::new(ix, name, role);
        self.alive = false;
        self.process = process;
    }

    pub fn restart(&mut self, now: u64) {
        self.alive = true;
        self.process += 1;
        self.reconnect_at_ns = now;
    }

    pub fn start_janitor(&mut self, params: &Params) {
        for layout in 0..params.layouts {
            for k in 0..params.keys_per_layout {
                self.janitor_todo.push((layout, key_name(k)));
            }
        }
    }

    /// Whether the client wants a new connection now.
    pub fn wants_connection(&self, now: u64) -> bool {
        self.alive && !self.done && self.conn.is_none() && now >= self.reconnect_at_ns
    }

    /// A connection was opened (or will be refused): send the handshake.
    pub fn connected(&mut self, ctx: &mut Ctx, conn: ConnId) {
        self.counters.reconnects += 1;
        let req_id = self.fresh_req();
        let (handshake, request) = match self.secret {
            None => (Handshake::Hello, ClientRequest::Hello),
            Some(secret) => {
                let presented: Vec<RegionId> = self.regions.keys().copied().collect();
                let regions = self
                    .regions
                    .values()
                    .map(|r| PresentedRegion {
                        handle: r.handle,
                        layout: LAYOUTS[r.layout],
                    })
                    .collect();
                (
                    Handshake::Reattach { presented },
                    ClientRequest::Reattach {
                        secret,
                        regions,
                        next_seq: self.lowest_seq(),
                        notice_ack: self.notice_applied,
                    },
                )
            }
        };
        self.conn = Some(Conn {
            id: conn,
            ready: false,
            timeouts: 0,
            handshake,
            handshake_req: req_id,
            handshake_sent_ns: ctx.now,
        });
        self.send(ctx, conn, req_id, request);
    }

    fn send(&mut self, ctx: &mut Ctx, conn: ConnId, req_id: u64, request: ClientRequest) {
        self.counters.requests += 1;
        self.last_sent_ns = ctx.now;
        ctx.send_client_link(
            self.ix,
            Message::ToDirectory {
                conn,
                req_id,
                request,
            },
        );
    }

    /// The lowest sequence number still awaiting a reply, or the next one.
    fn lowest_seq(&self) -> u64 {
        self.outstanding
            .values()
            .filter_map(|p| p.seq)
            .min()
            .unwrap_or(self.next_seq)
            .min(self.next_seq)
    }

    /// Drops the connection (the client closed it, or learnt it is gone).
    /// Pins die with its session; outstanding requests wait for the next.
    pub fn drop_conn(&mut self, ctx: &mut Ctx) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        self.pins.clear();
        for p in self.outstanding.values_mut() {
            p.last_sent_ns = None;
        }
        self.attempts.clear();
        self.reconnect_at_ns = ctx.now + ctx.rng.range(2, 100) * MS;
        self.observations.push(Observation::Closed(conn.id));
    }

    /// The timer: retries, new work, heartbeats. Returns when to wake next.
    pub fn wake(&mut self, ctx: &mut Ctx, params: &Params) -> u64 {
        let now = ctx.now;
        let mut next = now
            + ctx
                .rng
                .range(
                    params.client_op_interval_ns / 2,
                    params.client_op_interval_ns * 3 / 2,
                )
                .max(MS);
        let Some(conn) = self.conn.as_mut() else {
            if self.alive && !self.done {
                next = next.min(self.reconnect_at_ns.max(now + MS));
            }
            return next;
        };
        if !conn.ready {
            if now >= conn.handshake_sent_ns + 2 * REQUEST_TIMEOUT_NS {
                self.drop_conn(ctx);
                return next.min(self.reconnect_at_ns);
            }
            return next.min(conn.handshake_sent_ns + 2 * REQUEST_TIMEOUT_NS);
        }
        let conn_id = conn.id;
        // Retries, oldest first.
        let lids: Vec<u64> = self.outstanding.keys().copied().collect();
        for lid in lids {
            let due = match self.outstanding[&lid].last_sent_ns {
                None => true,
                Some(t) => now >= t + REQUEST_TIMEOUT_NS,
            };
            if !due {
                let t = self.outstanding[&lid].last_sent_ns.unwrap_or(now);
                next = next.min(t + REQUEST_TIMEOUT_NS);
                continue;
            }
            if self.outstanding[&lid].last_sent_ns.is_some() {
                self.counters.retries += 1;
                let conn = self.conn.as_mut().expect("connected above");
                conn.timeouts += 1;
                if conn.timeouts >= TIMEOUTS_BEFORE_RECONNECT {
                    self.drop_conn(ctx);
                    return next.min(self.reconnect_at_ns);
                }
            }
            let req_id = self.fresh_req();
            self.transmit(ctx, conn_id, lid, req_id);
            next = next.min(now + REQUEST_TIMEOUT_NS);
        }
        if !self.quiet {
            self.new_work(ctx, params, conn_id);
        }
        if now >= self.last_sent_ns + HEARTBEAT_EVERY_NS
            && !self.outstanding.values().any(|p| p.op == Op::Heartbeat)
        {
            let lid = self.push(Op::Heartbeat);
            let req_id = self.fresh_req();
            self.transmit(ctx, conn_id, lid, req_id);
        }
        if !self.outstanding.is_empty() {
            next = next.min(now + REQUEST_TIMEOUT_NS);
        }
        next = next.min(self.last_sent_ns + HEARTBEAT_EVERY_NS);
        next.max(now + 1)
    }

    fn fresh_req(&mut self) -> u64 {
        self.next_req += 1;
        self.next_req
    }

    fn push(&mut self, op: Op) -> u64 {
        let seq = op.mutating().then(|| {
            self.next_seq += 1;
            self.next_seq - 1
        });
        let lid = self.next_lid;
        self.next_lid += 1;
        self.outstanding.insert(
            lid,
            Pending {
                op,
                seq,
                last_sent_ns: None,
            },
        );
        lid
    }

    fn transmit(&mut self, ctx: &mut Ctx, conn: ConnId, lid: u64, req_id: u64) {
        let below = self.lowest_seq();
        let ack = self.notice_applied;
        let p = self
            .outstanding
            .get_mut(&lid)
            .expect("transmitting an outstanding request");
        p.last_sent_ns = Some(ctx.now);
        let sequence = |seq: Option<u64>| Sequence {
            seq: seq.expect("mutating requests carry a seq"),
            replies_received_below: below,
        };
        let request = match &p.op {
            Op::Register { layout, entries } => ClientRequest::Register {
                ack,
                seq: sequence(p.seq),
                layout: LAYOUTS[*layout],
                entries: entries.clone(),
            },
            Op::Lookup { layout, keys, pins } => ClientRequest::Lookup {
                ack,
                seq: p.seq.map(|s| Sequence {
                    seq: s,
                    replies_received_below: below,
                }),
                layout: LAYOUTS[*layout],
                keys: keys.clone(),
                pins: *pins,
            },
            Op::Exists { layout, keys } => ClientRequest::Exists {
                ack,
                layout: LAYOUTS[*layout],
                keys: keys.clone(),
            },
            Op::Unpin { layout, entries } => ClientRequest::Unpin {
                ack,
                seq: sequence(p.seq),
                layout: LAYOUTS[*layout],
                entries: entries.clone(),
            },
            Op::Delete { layout, keys } => ClientRequest::Delete {
                ack,
                seq: sequence(p.seq),
                layout: LAYOUTS[*layout],
                keys: keys.clone(),
            },
            Op::RequestRegion { layout, len_bytes } => ClientRequest::RequestRegion {
                ack,
                seq: sequence(p.seq),
                layout: LAYOUTS[*layout],
                len_bytes: *len_bytes,
            },
            Op::ReturnRegion { region } => ClientRequest::ReturnRegion {
                ack,
                seq: sequence(p.seq),
                region: *region,
            },
            Op::Heartbeat => ClientRequest::Heartbeat { ack },
        };
        self.attempts.insert(req_id, lid);
        self.send(ctx, conn, req_id, request);
    }

    fn new_work(&mut self, ctx: &mut Ctx, params: &Params, conn: ConnId) {
        if self.outstanding.len() >= params.max_outstanding {
            return;
        }
        if self.next_seq - self.lowest_seq() >= MAX_SEQ_SPAN {
            return;
        }
        let op = match self.role {
            Role::Janitor => self.janitor_op(params),
            Role::Worker => self.worker_op(ctx, params),
        };
        if let Some(op) = op {
            let lid = self.push(op);
            let req_id = self.fresh_req();
            self.transmit(ctx, conn, lid, req_id);
        }
    }

    fn janitor_op(&mut self, params: &Params) -> Option<Op> {
        if self
            .outstanding
            .values()
            .any(|p| matches!(p.op, Op::Delete { .. }))
        {
            return None;
        }
        let (layout, _) = self.janitor_todo.first()?.clone();
        let mut keys = Vec::new();
        let max = params.directory.max_batch;
        self.janitor_todo.retain(|(l, k)| {
            if *l == layout && keys.len() < max {
                keys.push(k.clone());
                false
            } else {
                true
            }
        });
        Some(Op::Delete { layout, keys })
    }

    /// Whether the janitor has deleted every key name.
    pub fn janitor_finished(&self) -> bool {
        self.role == Role::Janitor
            && self.session_ready()
            && self.janitor_todo.is_empty()
            && self.outstanding.is_empty()
    }

    fn held_keys(&self, layout: usize) -> Vec<Vec<u8>> {
        let mut held = Vec::new();
        for r in self.regions.values().filter(|r| r.layout == layout) {
            for p in &r.pages {
                match &p.state {
                    PageState::Free => {}
                    PageState::Allocated(k)
                    | PageState::FreedInFlight(k)
                    | PageState::Registered(k) => held.push(k.clone()),
                }
            }
        }
        held
    }

    fn worker_op(&mut self, ctx: &mut Ctx, params: &Params) -> Option<Op> {
        let layout = ctx.rng.index(params.layouts);
        let rng = &mut ctx.rng;
        // No batch beyond the directory's limit (small where the notice
        // queue limit is: `Params::with_edges`).
        let batch = params.directory.max_batch as u64;
        let random_keys = |rng: &mut super::rng::SimRng, max: u64| -> Vec<Vec<u8>> {
            (0..rng.range(1, max.min(batch)))
                .map(|_| key_name(rng.below(u64::from(params.keys_per_layout)) as u8))
                .collect()
        };
        let region_requested = self
            .outstanding
            .values()
            .any(|p| matches!(p.op, Op::RequestRegion { .. }));
        let mut want_region = false;
        match rng.below(100) {
            0..=34 => {
                if !self.may_write(ctx.now) {
                    return None;
                }
                let held = self.held_keys(layout);
                let mut entries = Vec::new();
                let n = rng.range(1, 3.min(batch));
                let candidates: Vec<RegionId> = self
                    .regions
                    .iter()
                    .filter(|(_, r)| r.layout == layout && !r.returning)
                    .map(|(id, _)| *id)
                    .collect();
                for _ in 0..n {
                    let key = key_name(rng.below(u64::from(params.keys_per_layout)) as u8);
                    if held.contains(&key) || entries.iter().any(|(k, _)| *k == key) {
                        continue;
                    }
                    let free: Vec<(RegionId, usize)> = candidates
                        .iter()
                        .flat_map(|id| {
                            self.regions[id]
                                .pages
                                .iter()
                                .enumerate()
                                .filter(|(_, p)| p.state == PageState::Free)
                                .map(move |(i, _)| (*id, i))
                        })
                        .collect();
                    if free.is_empty() {
                        want_region = true;
                        break;
                    }
                    let (region, page) = free[rng.index(free.len())];
                    let page_size = LAYOUTS[layout].page_size_bytes;
                    let slot = &mut self.regions.get_mut(&region).expect("listed").pages[page];
                    slot.generation += 1;
                    slot.state = PageState::Allocated(key.clone());
                    self.observations.push(Observation::Wrote {
                        region,
                        page: page as u32,
                    });
                    let location = Location {
                        region,
                        page: PageIndex(page as u32),
                        generation: Generation(slot.generation),
                        len_bytes: rng.range(1, page_size) as u32,
                    };
                    entries.push((key, location));
                }
                if !entries.is_empty() {
                    return Some(Op::Register { layout, entries });
                }
            }
            35..=49 => {
                let pins = if rng.chance(0.5) {
                    0
                } else {
                    rng.range(1, 2) as u32
                };
                return Some(Op::Lookup {
                    layout,
                    keys: random_keys(rng, 4),
                    pins,
                });
            }
            50..=54 => {
                return Some(Op::Exists {
                    layout,
                    keys: random_keys(rng, 4),
                });
            }
            55..=64 => {
                let held: Vec<((usize, Vec<u8>), u32)> = self
                    .pins
                    .iter()
                    .filter(|((l, _), _)| *l == layout)
                    .map(|(k, v)| (k.clone(), *v))
                    .collect();
                if held.is_empty() {
                    return None;
                }
                let mut entries = Vec::new();
                for _ in 0..rng.range(1, 3.min(batch)) {
                    let ((_, key), count) = held[rng.index(held.len())].clone();
                    if entries.iter().any(|(k, _)| *k == key) {
                        continue;
                    }
                    let n = rng.range(1, u64::from(count)) as u32;
                    let left = self.pins.get_mut(&(layout, key.clone())).expect("held");
                    *left -= n;
                    if *left == 0 {
                        self.pins.remove(&(layout, key.clone()));
                    }
                    entries.push((key, n));
                }
                return Some(Op::Unpin { layout, entries });
            }
            65..=77 => {
                return Some(Op::Delete {
                    layout,
                    keys: random_keys(rng, 3),
                });
            }
            78..=84 => want_region = true,
            85..=88 => {
                let owned = self.regions.values().filter(|r| r.layout == layout).count();
                let empty: Vec<RegionId> = self
                    .regions
                    .iter()
                    .filter(|(_, r)| {
                        r.layout == layout
                            && !r.returning
                            && r.pages.iter().all(|p| p.state == PageState::Free)
                    })
                    .map(|(id, _)| *id)
                    .collect();
                if owned > 1 && !empty.is_empty() {
                    let region = empty[rng.index(empty.len())];
                    self.regions.get_mut(&region).expect("listed").returning = true;
                    return Some(Op::ReturnRegion { region });
                }
            }
            _ => {}
        }
        let owned = self.regions.values().filter(|r| r.layout == layout).count();
        if want_region && !region_requested && owned < 3 {
            let len_bytes = BLOCK_BYTES * ctx.rng.range(1, 2);
            return Some(Op::RequestRegion { layout, len_bytes });
        }
        None
    }

    /// A reply arrived on connection `conn`.
    pub fn on_reply(
        &mut self,
        ctx: &mut Ctx,
        params: &Params,
        conn: ConnId,
        req_id: u64,
        reply: ClientReply,
    ) {
        let Some(c) = self.conn.as_ref() else {
            return;
        };
        if c.id != conn || !self.alive {
            return;
        }
        if !c.ready {
            if req_id == c.handshake_req {
                self.on_handshake(ctx, params, reply);
            }
            return;
        }
        let Some(lid) = self.attempts.remove(&req_id) else {
            return;
        };
        if !self.outstanding.contains_key(&lid) {
            return;
        }
        if let Some(c) = self.conn.as_mut() {
            c.timeouts = 0;
        }
        match reply {
            ClientReply::Error(e) => self.on_error(ctx, lid, e),
            ClientReply::AlreadyAttached | ClientReply::Welcome(_) | ClientReply::Reattached(_) => {
                self.violation(format!("handshake reply to request {req_id}"));
            }
            ClientReply::Heartbeat(r) => {
                self.complete(lid, ctx.now);
                self.apply_notices(&r.notices);
            }
            ClientReply::Exists(r) => {
                self.complete(lid, ctx.now);
                self.apply_notices(&r.notices);
            }
            ClientReply::Delete(r) => {
                let op = self.complete(lid, ctx.now);
                self.apply_notices(&r.notices);
                if self.role == Role::Janitor
                    && let Op::Delete { layout, keys } = op
                {
                    for (k, o) in keys.into_iter().zip(&r.body) {
                        if matches!(o, crate::directory::DeleteOutcome::Pinned { .. }) {
                            self.janitor_todo.push((layout, k));
                        }
                    }
                }
            }
            ClientReply::Unpin(r) => {
                self.complete(lid, ctx.now);
                self.apply_notices(&r.notices);
            }
            ClientReply::Lookup(r) => {
                let op = self.complete(lid, ctx.now);
                if let Op::Lookup { layout, keys, pins } = op
                    && pins > 0
                {
                    for (k, loc) in keys.into_iter().zip(&r.body.locations) {
                        if loc.is_some() {
                            *self.pins.entry((layout, k)).or_default() += pins;
                        }
                    }
                }
                self.apply_notices(&r.notices);
            }
            ClientReply::Register(r) => {
                let op = self.complete(lid, ctx.now);
                if let Op::Register { entries, .. } = op {
                    if entries.len() != r.body.len() {
                        self.violation(format!(
                            "{} register outcomes for {} entries",
                            r.body.len(),
                            entries.len()
                        ));
                    }
                    for ((_, loc), outcome) in entries.iter().zip(&r.body) {
                        self.on_register_outcome(loc, outcome);
                    }
                }
                self.apply_notices(&r.notices);
            }
            ClientReply::Region(r) => {
                let op = self.complete(lid, ctx.now);
                if let Op::RequestRegion { layout, .. } = op {
                    self.add_region(r.body, layout);
                }
                self.apply_notices(&r.notices);
            }
            ClientReply::Returned(r) => {
                if let Op::ReturnRegion { region } = self.complete(lid, ctx.now) {
                    self.regions.remove(&region);
                }
                self.apply_notices(&r.notices);
            }
        }
    }

    fn complete(&mut self, lid: u64, now: u64) -> Op {
        self.last_reply_ns = now;
        self.attempts.retain(|_, l| *l != lid);
        self.outstanding
            .remove(&lid)
            .expect("completing an outstanding request")
            .op
    }

    fn add_region(&mut self, grant: RegionGrant, layout: usize) {
        if self.regions.contains_key(&grant.handle.region) {
            return;
        }
        if grant.layout != LAYOUTS[layout] {
            self.violation(format!(
                "grant for layout {:?}, asked {layout}",
                grant.layout
            ));
            return;
        }
        let pages = grant.handle.len_bytes / LAYOUTS[layout].page_size_bytes;
        self.regions.insert(
            grant.handle.region,
            OwnedRegion {
                handle: grant.handle,
                layout,
                pages: vec![
                    Page {
                        generation: 0,
                        state: PageState::Free,
                    };
                    pages as usize
                ],
                returning: false,
            },
        );
    }

    fn page_mut(&mut self, loc: &Location) -> Option<&mut Page> {
        let region = self.regions.get_mut(&loc.region)?;
        let page = region.pages.get_mut(loc.page.0 as usize)?;
        (page.generation == loc.generation.0).then_some(page)
    }

    fn on_register_outcome(&mut self, loc: &Location, outcome: &RegisterOutcome) {
        let ours = match outcome {
            RegisterOutcome::Inserted => true,
            RegisterOutcome::Duplicate(winner) => winner == loc,
            RegisterOutcome::Rejected(_) => false,
        };
        let Some(page) = self.page_mut(loc) else {
            return;
        };
        page.state = match std::mem::replace(&mut page.state, PageState::Free) {
            PageState::Allocated(k) | PageState::Registered(k) if ours => PageState::Registered(k),
            _ => PageState::Free,
        };
    }

    fn on_error(&mut self, ctx: &mut Ctx, lid: u64, e: DirectoryError) {
        use DirectoryError as E;
        match e {
            E::UnknownSession { .. } | E::SessionEnded { .. } => {
                self.drop_conn(ctx);
            }
            E::PinsHeldByOtherSession { .. }
            | E::NoticeBacklog { .. }
            | E::QuotaExceeded { .. }
            | E::TooManyRegions { .. }
            | E::TooManyPendingRegionRequests { .. }
            | E::RegionAllocationFailed { .. }
            | E::InstanceGone
            | E::SessionPinLimit { .. }
            | E::PinnedEntryLimit { .. }
            | E::PinLimit { .. }
            | E::KeyLimit { .. } => {
                let op = self.complete(lid, ctx.now);
                self.undo(op);
            }
            E::UnknownRegion { region } | E::NotRegionOwner { region } => {
                let op = self.complete(lid, ctx.now);
                self.undo(op);
                self.drop_region(region);
            }
            E::RegionNotEmpty { .. } => {
                let op = self.complete(lid, ctx.now);
                self.undo(op);
            }
            E::ReplyEvicted { .. } => {
                // It ran (the world checks that it did); what it answered
                // is lost.
                self.counters.replies_evicted += 1;
                let op = self.complete(lid, ctx.now);
                self.ran_unanswered(op);
            }
            other => {
                let op = self.complete(lid, ctx.now);
                self.violation(format!("unexpected error {other:?} for {op:?}"));
                self.undo(op);
            }
        }
    }

    /// A request refused as a whole changed nothing: take back what the
    /// client did in anticipation.
    fn undo(&mut self, op: Op) {
        match op {
            Op::Register { entries, .. } => {
                for (_, loc) in entries {
                    if let Some(page) = self.page_mut(&loc)
                        && matches!(
                            page.state,
                            PageState::Allocated(_) | PageState::FreedInFlight(_)
                        )
                    {
                        page.state = PageState::Free;
                    }
                }
            }
            Op::ReturnRegion { region } => {
                if let Some(r) = self.regions.get_mut(&region) {
                    r.returning = false;
                }
            }
            Op::Delete { layout, keys } if self.role == Role::Janitor => {
                self.janitor_todo
                    .extend(keys.into_iter().map(|k| (layout, k)));
            }
            _ => {}
        }
    }

    /// A request ran but its answer is lost (`ReplyEvicted`): take the
    /// side that is safe whatever it answered. A registered page is held
    /// as registered (if its key went in, reusing the page would overwrite
    /// it; if not, the page stays unused until the region goes); a
    /// returned region is gone; pins a lookup may have taken stay with the
    /// session, unknown (they go when it ends); a janitor deletes its keys
    /// again.
    fn ran_unanswered(&mut self, op: Op) {
        match op {
            Op::Register { entries, .. } => {
                for (_, loc) in entries {
                    if let Some(page) = self.page_mut(&loc) {
                        page.state = match std::mem::replace(&mut page.state, PageState::Free) {
                            PageState::Allocated(k) | PageState::Registered(k) => {
                                PageState::Registered(k)
                            }
                            PageState::FreedInFlight(_) | PageState::Free => PageState::Free,
                        };
                    }
                }
            }
            Op::ReturnRegion { region } => {
                self.regions.remove(&region);
            }
            Op::Delete { layout, keys } if self.role == Role::Janitor => {
                self.janitor_todo
                    .extend(keys.into_iter().map(|k| (layout, k)));
            }
            _ => {}
        }
    }

    /// The region is not (or no longer) this client's. Outstanding requests
    /// naming it stay as they are (their `seq` may have run); they are only
    /// rebuilt after a `Recovered` reattach.
    fn drop_region(&mut self, region: RegionId) {
        self.regions.remove(&region);
    }

    fn rebuild_without(&mut self, keep: impl Fn(&Location) -> bool) {
        let lids: Vec<u64> = self.outstanding.keys().copied().collect();
        for lid in lids {
            let p = self.outstanding.get_mut(&lid).expect("listed");
            match &mut p.op {
                Op::Register { entries, .. } => {
                    entries.retain(|(_, loc)| keep(loc));
                    if entries.is_empty() {
                        self.outstanding.remove(&lid);
                    }
                }
                Op::ReturnRegion { region } => {
                    let gone = !keep(&Location {
                        region: *region,
                        page: PageIndex(0),
                        generation: Generation(0),
                        len_bytes: 0,
                    });
                    if gone {
                        self.outstanding.remove(&lid);
                    }
                }
                _ => {}
            }
        }
    }

    fn on_handshake(&mut self, ctx: &mut Ctx, params: &Params, reply: ClientReply) {
        match reply {
            ClientReply::Welcome(w) => {
                self.secret = Some(w.secret);
                self.epoch = Some(w.directory_epoch);
                self.notice_applied = 0;
                self.last_reply_ns = ctx.now;
                self.regions.clear();
                self.outstanding.clear();
                self.attempts.clear();
                if let Some(c) = self.conn.as_mut() {
                    c.ready = true;
                }
            }
            ClientReply::Reattached(r) => {
                let presented = match &self.conn.as_ref().expect("handshaking").handshake {
                    Handshake::Reattach { presented } => presented.clone(),
                    Handshake::Hello => {
                        self.violation(String::from("Reattached answers a hello"));
                        return;
                    }
                };
                let restarted = self.epoch != Some(r.directory_epoch);
                self.epoch = Some(r.directory_epoch);
                self.last_reply_ns = ctx.now;
                if r.regions.len() != presented.len() {
                    self.violation(format!(
                        "{} verdicts for {} regions",
                        r.regions.len(),
                        presented.len()
                    ));
                }
                for (id, verdict) in presented.iter().zip(&r.regions) {
                    if *verdict == RegionStatus::NotOwned {
                        self.drop_region(*id);
                    }
                }
                // A recovery shows in the kind: the directory answers
                // `Recovered` to every reattach until a session of the
                // recovered instance makes a request, so a lost answer is
                // told again. A new epoch is taken for a restart too, as the
                // real client does. After a restart the confirmed regions
                // are kept; after the instance was declared gone none is.
                if r.kind == ReattachKind::Recovered || restarted {
                    self.regions.retain(|id, _| presented.contains(id));
                    // The previous window is void: rebuild outstanding
                    // requests. Entries in regions no longer ours go, and so
                    // do the re-registrations of an earlier recovery whose
                    // session ended before they were answered (queued again
                    // below); a page a notice freed before its reply came is
                    // not registered again.
                    let owned: Vec<RegionId> = self.regions.keys().copied().collect();
                    let registered: BTreeSet<(RegionId, u32, u32)> = self
                        .regions
                        .iter()
                        .flat_map(|(&id, r)| {
                            r.pages.iter().enumerate().filter_map(move |(i, p)| {
                                matches!(p.state, PageState::Registered(_)).then_some((
                                    id,
                                    i as u32,
                                    p.generation,
                                ))
                            })
                        })
                        .collect();
                    self.rebuild_without(|loc| {
                        owned.contains(&loc.region)
                            && !registered.contains(&(loc.region, loc.page.0, loc.generation.0))
                    });
                    self.drop_freed_in_flight_entries();
                    for region in self.regions.values_mut() {
                        for page in &mut region.pages {
                            if let PageState::FreedInFlight(_) = page.state {
                                page.state = PageState::Free;
                            }
                        }
                    }
                    self.queue_reregistration(params);
                }
                if let Some(c) = self.conn.as_mut() {
                    c.ready = true;
                }
                for p in self.outstanding.values_mut() {
                    p.last_sent_ns = None;
                }
                self.attempts.clear();
                self.apply_notices(&r.notices);
            }
            ClientReply::AlreadyAttached => {}
            ClientReply::Error(e) => {
                use DirectoryError as E;
                match e {
                    E::InstanceIdInUse { .. }
                    | E::OwnershipNotProven { .. }
                    | E::TooManySessions { .. }
                    | E::TooManyInstanceSessions { .. }
                    | E::TooManyInstances { .. } => {}
                    other => self.violation(format!("handshake refused: {other:?}")),
                }
                self.drop_conn(ctx);
                self.reconnect_at_ns = ctx.now + ctx.rng.range(50, 300) * MS;
            }
            other => self.violation(format!("handshake answered {other:?}")),
        }
    }

    /// Register entries whose page is no longer `Allocated` under the
    /// entry's generation are dropped from outstanding requests.
    fn drop_freed_in_flight_entries(&mut self) {
        let regions = &self.regions;
        let live = |loc: &Location| {
            regions
                .get(&loc.region)
                .and_then(|r| r.pages.get(loc.page.0 as usize))
                .is_some_and(|p| {
                    p.generation == loc.generation.0 && matches!(p.state, PageState::Allocated(_))
                })
        };
        let lids: Vec<u64> = self.outstanding.keys().copied().collect();
        for lid in lids {
            if let Some(Pending {
                op: Op::Register { entries, .. },
                ..
            }) = self.outstanding.get_mut(&lid)
            {
                entries.retain(|(_, loc)| live(loc));
                if entries.is_empty() {
                    self.outstanding.remove(&lid);
                }
            }
        }
    }

    /// After a directory restart: register every key this client holds
    /// again, in batches.
    fn queue_reregistration(&mut self, params: &Params) {
        let mut batches: BTreeMap<usize, Vec<(Vec<u8>, Location)>> = BTreeMap::new();
        for (&id, r) in &self.regions {
            for (i, p) in r.pages.iter().enumerate() {
                if let PageState::Registered(k) = &p.state {
                    let page_size = LAYOUTS[r.layout].page_size_bytes;
                    batches.entry(r.layout).or_default().push((
                        k.clone(),
                        Location {
                            region: id,
                            page: PageIndex(i as u32),
                            generation: Generation(p.generation),
                            len_bytes: page_size as u32,
                        },
                    ));
                }
            }
        }
        for (layout, entries) in batches {
            for chunk in entries.chunks(params.directory.max_batch) {
                self.counters.reregistered += chunk.len() as u64;
                self.push(Op::Register {
                    layout,
                    entries: chunk.to_vec(),
                });
            }
        }
    }

    fn apply_notices(&mut self, notices: &[FreedPageNotice]) {
        for n in notices {
            if n.seq <= self.notice_applied {
                continue;
            }
            if n.seq != self.notice_applied + 1 {
                self.violation(format!(
                    "notice {} after {}: a notice was skipped",
                    n.seq, self.notice_applied
                ));
            }
            self.notice_applied = n.seq;
            self.counters.notices_applied += 1;
            self.observations.push(Observation::NoticeApplied(*n));
            let Some(region) = self.regions.get_mut(&n.region) else {
                continue;
            };
            let Some(page) = region.pages.get_mut(n.page.0 as usize) else {
                self.violation(format!("notice for page {} beyond the region", n.page.0));
                continue;
            };
            if page.generation != n.generation.0 {
                self.counters.stale_notices += 1;
                continue;
            }
            let mut twice = None;
            page.state = match std::mem::replace(&mut page.state, PageState::Free) {
                PageState::Registered(_) => PageState::Free,
                PageState::Allocated(k) => PageState::FreedInFlight(k),
                other => {
                    twice = Some(format!(
                        "notice {} frees page {} of {} in state {other:?}: freed twice",
                        n.seq, n.page.0, n.region
                    ));
                    other
                }
            };
            if let Some(what) = twice {
                self.violation(what);
            }
        }
    }
}
