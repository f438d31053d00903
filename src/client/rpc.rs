//! One request, start to finish: sequence number, unpins first, encode,
//! send, retry, reconnect, decode, notices.
//!
//! [`Shared::exchange`] is the only way a request leaves the client after
//! connect. Per attempt it (1) sends the queued unpins ahead of the request
//! (pipelined on the same connection, so the directory applies them first),
//! (2) stamps the request with its sequence number, the notice
//! acknowledgement and `replies_received_below`, (3) sends it with a
//! deadline, and (4) on a reply applies the piggybacked notices before
//! handing the reply to the caller.
//!
//! **Retries** keep the sequence number (DESIGN §4): a deadline that passed,
//! a transient refusal (`Busy`, `Timeout`) or a broken connection (after a
//! reconnect and reattach) sends the same request again, at most
//! `max_retries` times. Two cases change the number instead: a ticket
//! from before a directory restart is void (`SequenceTooOld` after a
//! `Recovered` reattach), and a pinning lookup's pins belong to the session
//! that ran it, so after a reconnect (a new session) it looks up afresh
//! under a new number rather than spend an attempt on the refusal
//! (`PinsHeldByOtherSession`) its old number would get.
//!
//! **Outcomes.** A request that got an answer — or an error reply, which
//! by the protocol changed nothing — is *definite*, and so is one that
//! never left the client (every attempt refused by the transport before
//! its frame was written whole: no room in flight, a closed connection).
//! A mutating request written at least once whose attempts all went
//! unanswered, or whose cached reply the directory dropped, is
//! *indeterminate*: it may have taken effect. The register path
//! parks such batches and resolves them later; other callers report it.

use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::{Frame, HEADER_BYTES};
use cxlkv_controlplane::proto::{
    self, Archived, ArchivedDirectoryReply, Delete, EncodesAs, ErrorCode, Exists, Heartbeat, Kind,
    Lookup, MapRegion, Message, Register, RequestMeta, RequestRegion, ReturnRegion, Stats, Unpin,
    UnpinOutcome, UnpinReply,
};
use cxlkv_controlplane::transport::{ClientError as TransportError, PendingCall};

use super::error::ClientError;
use super::read::group_unpins;
use super::seq::SeqTicket;
use super::shared::{Conn, Shared};

/// How a request failed.
#[derive(Debug)]
pub(crate) enum Fail {
    /// It did not take effect (or was read-only).
    Definite(ClientError),
    /// It may have taken effect; the answer is lost.
    Indeterminate(ClientError),
    /// Its sequence number was issued before a directory restart (only with
    /// `Mode::renew_void` off): the new directory never saw it, the old one
    /// may have applied it, and the caller decides what to send instead.
    Void,
}

impl Fail {
    pub fn into_error(self) -> ClientError {
        match self {
            Fail::Definite(e) => e,
            Fail::Indeterminate(e) => e,
            Fail::Void => ClientError::Indeterminate {
                op: "request",
                reason: "its sequence number predates a directory restart".into(),
            },
        }
    }
}

/// What an exchange may do besides the request itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mode {
    /// Send queued unpins ahead of the request.
    pub flush_unpins: bool,
    /// Reconnect (and reattach) when the connection broke. Off inside the
    /// reattach procedure itself, which holds the reconnect lock.
    pub reconnect: bool,
    /// Send a request whose number predates a directory restart again under
    /// a fresh number. Off for `Register`, whose pages must be checked first
    /// (see `write.rs`): the exchange then fails with [`Fail::Void`].
    pub renew_void: bool,
}

impl Mode {
    pub const NORMAL: Mode = Mode {
        flush_unpins: true,
        reconnect: true,
        renew_void: true,
    };
    /// Registrations (see `renew_void`).
    pub const REGISTER: Mode = Mode {
        flush_unpins: true,
        reconnect: true,
        renew_void: false,
    };
    /// Requests made by the reattach procedure on its new connection.
    pub const REATTACH: Mode = Mode {
        flush_unpins: false,
        reconnect: false,
        renew_void: true,
    };
}

/// A request whose metadata the exchange fills in per attempt (sequence
/// number, notice acknowledgement, `replies_received_below`): a message, or
/// a borrowed form that encodes as one ([`proto::EncodesAs`]).
pub(crate) trait WithMeta {
    /// The message this request's frames are.
    type Msg: Message;
    fn set_meta(&mut self, meta: RequestMeta);
    /// This request's frame, as of its current metadata.
    fn encode(&self) -> Result<Encoded, ClientError>;
}

macro_rules! with_meta {
    ($($t:ty),* $(,)?) => {
        $(impl WithMeta for $t {
            type Msg = $t;
            fn set_meta(&mut self, meta: RequestMeta) {
                self.meta = meta;
            }
            fn encode(&self) -> Result<Encoded, ClientError> {
                Encoded::new(self)
            }
        })*
    };
}

/// The key-batch requests over the caller's own keys (no copy of them,
/// `proto::ExistsFrom` and its kin), their frames sized up front: every
/// key's bytes, its 8-byte (pointer, length) pair and an unpin's 4-byte
/// count, plus room for the fixed fields and the alignment padding.
macro_rules! with_meta_borrowed {
    ($($from:ident => $msg:ty),* $(,)?) => {
        $(impl<K: AsRef<[u8]>> WithMeta for proto::$from<'_, K> {
            type Msg = $msg;
            fn set_meta(&mut self, meta: RequestMeta) {
                self.meta = meta;
            }
            fn encode(&self) -> Result<Encoded, ClientError> {
                let key_bytes: usize = self.keys.iter().map(|k| k.as_ref().len()).sum();
                Encoded::encode_as::<$msg, _>(self, key_bytes + 12 * self.keys.len() + 128)
            }
        })*
    };
}

with_meta_borrowed!(
    ExistsFrom => Exists,
    LookupFrom => Lookup,
    DeleteFrom => Delete,
    UnpinFrom => Unpin,
);

with_meta!(
    Heartbeat,
    RequestRegion,
    ReturnRegion,
    MapRegion,
    Register,
    Lookup,
    Exists,
    Unpin,
    Delete,
    Stats
);

/// A frame encoded for sending; the payload is the part after the header.
pub(crate) struct Encoded {
    buf: Vec<u8>,
    payload_len: usize,
}

impl Encoded {
    pub fn new<M: Message>(msg: &M) -> Result<Self, ClientError> {
        Self::encode_as::<M, M>(msg, 0)
    }

    /// The frame of `value`, which encodes as message `M`, in a buffer
    /// that starts with room for `payload_hint` payload bytes (a buffer
    /// grown by doubling copies a 55 KB request about twice over).
    pub fn encode_as<M: Message, T: EncodesAs<M>>(
        value: &T,
        payload_hint: usize,
    ) -> Result<Self, ClientError> {
        let mut buf = Vec::with_capacity(HEADER_BYTES + payload_hint);
        let frame_len = proto::encode_as::<M, T>(0, value, &mut buf).map_err(|source| {
            ClientError::BadReply {
                op: "encode",
                source,
            }
        })?;
        debug_assert_eq!(frame_len, buf.len());
        let mut len = [0u8; 4];
        len.copy_from_slice(&buf[16..20]);
        Ok(Self {
            buf,
            payload_len: u32::from_le_bytes(len) as usize,
        })
    }

    /// The payload: position-independent (rkyv offsets are relative) and at
    /// an 8-aligned offset, so the transport can frame it anew.
    pub fn payload(&self) -> &[u8] {
        &self.buf[HEADER_BYTES..HEADER_BYTES + self.payload_len]
    }
}

/// One started `Unpin`: its ticket, the call, its payload (for resends) and
/// the pins each of its entries releases.
pub(crate) struct StartedUnpin {
    pub ticket: SeqTicket,
    pub call: Result<PendingCall, TransportError>,
    pub encoded: Encoded,
    pub counts: Vec<u32>,
}

/// Unpins sent ahead of a request, awaiting their replies.
pub(crate) struct InflightUnpins {
    conn_no: u64,
    calls: Vec<StartedUnpin>,
}

/// Most pins one `Unpin` entry (or pinning `Lookup`) may carry per key on a
/// session with `limits`: its announced limit, never above the protocol's.
pub(crate) fn max_pins_per_key(limits: &proto::Limits) -> u32 {
    limits
        .max_pins_per_key
        .clamp(1, proto::MAX_PINS_PER_KEY as u32)
}

/// Pins of the entries an `UnpinReply` reports as not held (each such entry
/// released nothing): the unit of `unpins_not_held`.
pub(crate) fn not_held_pins(counts: &[u32], reply: &Archived<UnpinReply>) -> u64 {
    counts
        .iter()
        .zip(reply.outcomes.iter())
        .filter(|(_, o)| matches!(UnpinOutcome::from(*o), UnpinOutcome::NotPinned))
        .map(|(&c, _)| u64::from(c))
        .sum()
}

/// The pause before resending a request the directory refused as busy.
pub(super) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((1u64 << attempt.min(6)).min(50))
}

impl Shared {
    /// Sends one request and returns what `handle` makes of its reply (see
    /// the module docs). `ticket` is the request's sequence number (`None`:
    /// read-only); it may be renewed on the way.
    pub fn exchange<Q, R, T>(
        &self,
        op: &'static str,
        mode: Mode,
        mut ticket: Option<&mut SeqTicket>,
        msg: &mut Q,
        mut handle: impl FnMut(&Archived<R>) -> Result<T, ClientError>,
    ) -> Result<T, Fail>
    where
        Q: WithMeta,
        R: Message,
        Archived<R>: ArchivedDirectoryReply,
    {
        let kind = <Q::Msg as Message>::KIND;
        let timeout = self.request_timeout();
        let mutating = ticket.is_some();
        let mut attempts = 0u32;
        let mut sent = false;
        let mut last = String::from("no attempt");
        let give_up = |sent: bool, err: ClientError| {
            if mutating && sent {
                Fail::Indeterminate(err)
            } else {
                Fail::Definite(err)
            }
        };
        while attempts <= self.cfg.max_retries {
            self.check_open().map_err(Fail::Definite)?;
            let conn = self.conn().map_err(Fail::Definite)?;
            if !conn.usable() {
                if !mode.reconnect {
                    return Err(Fail::Definite(ClientError::Unanswered {
                        op,
                        attempts,
                        last: "the connection broke".into(),
                    }));
                }
                attempts += 1;
                last = String::from("the connection broke");
                self.stats.bump(&self.stats.retries);
                if let Err(e) = self.reconnect(conn.conn_no) {
                    return Err(give_up(sent, e));
                }
                self.renew_if_session_bound(kind, ticket.as_deref_mut(), timeout)?;
                continue;
            }
            if let Some(t) = ticket.as_deref_mut()
                && self.seqs.is_void(t)
            {
                if !mode.renew_void {
                    return Err(Fail::Void);
                }
                self.renew(t, timeout).map_err(Fail::Definite)?;
            }
            msg.set_meta(RequestMeta {
                seq: ticket.as_deref().map_or(0, |t| t.seq),
                notice_ack: self.notice_ack(),
                replies_received_below: if mutating {
                    self.seqs.received_below()
                } else {
                    0
                },
            });
            let encoded = msg.encode().map_err(Fail::Definite)?;
            // Sent only now that nothing can fail before `finish_unpins`
            // (an early return would leave their replies unawaited and
            // their numbers outstanding).
            let unpins = if mode.flush_unpins {
                self.start_unpins(&conn)
            } else {
                None
            };
            self.note_sent();
            if attempts > 0 {
                self.stats.bump(&self.stats.retries);
            }
            // Whether an attempt before this one may have run.
            let sent_before = sent;
            // A request `start` refuses never reached the server whole (no
            // room in flight, a closed connection, or a frame cut short,
            // which the server discards with the stream): only one it
            // wrote may have run.
            let result = match conn.rpc.start(kind.as_u16(), encoded.payload(), timeout) {
                Ok(call) => {
                    sent = true;
                    call.wait()
                }
                Err(e) => Err(e),
            };
            if let Some(unpins) = unpins {
                self.finish_unpins(&conn, unpins);
            }
            attempts += 1;
            let reply = match result {
                Ok(reply) => reply,
                Err(TransportError::Timeout { .. }) => {
                    last = format!("no reply within {} ms", timeout.as_millis());
                    continue;
                }
                Err(TransportError::TooManyInFlight { limit }) => {
                    last = format!("{limit} requests in flight");
                    std::thread::sleep(backoff(attempts));
                    continue;
                }
                Err(e @ (TransportError::Closed { .. } | TransportError::Connect { .. })) => {
                    last = e.to_string();
                    if !mode.reconnect {
                        return Err(give_up(
                            sent,
                            ClientError::Unanswered { op, attempts, last },
                        ));
                    }
                    if let Err(e) = self.reconnect(conn.conn_no) {
                        return Err(give_up(sent, e));
                    }
                    self.renew_if_session_bound(kind, ticket.as_deref_mut(), timeout)?;
                    continue;
                }
                Err(e) => {
                    return Err(give_up(
                        sent,
                        ClientError::Unanswered {
                            op,
                            attempts,
                            last: e.to_string(),
                        },
                    ));
                }
            };
            let frame = Frame {
                header: reply.header,
                payload: reply.payload(),
            };
            match proto::access_reply::<R>(frame) {
                Ok(Ok(archived)) => {
                    self.absorb(archived.reply_meta());
                    super::staged::SERVED_BY.set(conn.conn_no);
                    return handle(archived).map_err(Fail::Definite);
                }
                Ok(Err(refusal)) => {
                    let code = refusal.code.to_native();
                    let err = ClientError::server(
                        op,
                        code,
                        refusal.message.as_str(),
                        refusal.limit.to_native(),
                    );
                    match ErrorCode::from_u16(code) {
                        Some(c) if c.is_transient() => {
                            last = err.to_string();
                            std::thread::sleep(backoff(attempts));
                        }
                        Some(ErrorCode::SequenceTooOld)
                            if ticket.as_deref().is_some_and(|t| self.seqs.is_void(t)) =>
                        {
                            // Renewed at the top of the loop.
                            last = err.to_string();
                        }
                        Some(ErrorCode::PinsHeldByOtherSession) => {
                            last = err.to_string();
                            if let Some(t) = ticket.as_deref_mut() {
                                self.renew(t, timeout).map_err(Fail::Definite)?;
                            }
                        }
                        Some(ErrorCode::SessionEnded | ErrorCode::HelloRequired) => {
                            // The next request reattaches on a new session.
                            conn.dead.store(true, std::sync::atomic::Ordering::Relaxed);
                            // Refused before the directory looked at its
                            // number: this attempt did not run, but an
                            // earlier one that went unanswered may have.
                            return Err(give_up(sent_before, err));
                        }
                        Some(ErrorCode::SequenceTooOld | ErrorCode::ReplyEvicted) => {
                            return Err(Fail::Indeterminate(err));
                        }
                        _ => return Err(Fail::Definite(err)),
                    }
                }
                Err(source) => {
                    return Err(give_up(sent, ClientError::BadReply { op, source }));
                }
            }
        }
        Err(give_up(
            sent,
            ClientError::Unanswered { op, attempts, last },
        ))
    }

    /// A read-only request.
    pub fn read_call<Q, R, T>(
        &self,
        op: &'static str,
        msg: &mut Q,
        handle: impl FnMut(&Archived<R>) -> Result<T, ClientError>,
    ) -> Result<T, ClientError>
    where
        Q: WithMeta,
        R: Message,
        Archived<R>: ArchivedDirectoryReply,
    {
        self.exchange::<Q, R, T>(op, Mode::NORMAL, None, msg, handle)
            .map_err(Fail::into_error)
    }

    /// A mutating request under a fresh sequence number, released when it
    /// ends whatever the outcome.
    pub fn mutating_call<Q, R, T>(
        &self,
        op: &'static str,
        mode: Mode,
        msg: &mut Q,
        handle: impl FnMut(&Archived<R>) -> Result<T, ClientError>,
    ) -> Result<T, Fail>
    where
        Q: WithMeta,
        R: Message,
        Archived<R>: ArchivedDirectoryReply,
    {
        let mut ticket = self.ticket()?;
        let r = self.exchange::<Q, R, T>(op, mode, Some(&mut ticket), msg, handle);
        self.seqs.release(ticket);
        r
    }

    /// A fresh sequence number, waiting (bounded) for room in the window.
    pub fn ticket(&self) -> Result<SeqTicket, Fail> {
        self.seqs
            .acquire(Instant::now() + self.request_timeout())
            .map_err(|full| {
                Fail::Definite(ClientError::TooManyInFlight {
                    window: full.window,
                })
            })
    }

    pub fn renew(&self, ticket: &mut SeqTicket, timeout: Duration) -> Result<(), ClientError> {
        let old = std::mem::replace(
            ticket,
            SeqTicket {
                seq: 0,
                incarnation: 0,
            },
        );
        *ticket = self
            .seqs
            .renew(old, Instant::now() + timeout)
            .map_err(|full| ClientError::TooManyInFlight {
                window: full.window,
            })?;
        Ok(())
    }

    /// After a reconnect, which always opens a new session: a pinning
    /// lookup's pins belong to the session that ran it, so its old number
    /// could only be refused (`PinsHeldByOtherSession`, had it run — its
    /// pins die with the old session) or run fresh (had it not). A new
    /// number now runs it on the new session either way, without spending
    /// an attempt on the refusal. Other requests keep their number: their
    /// retries must be answered from the directory's reply cache.
    fn renew_if_session_bound(
        &self,
        kind: Kind,
        ticket: Option<&mut SeqTicket>,
        timeout: Duration,
    ) -> Result<(), Fail> {
        if kind == Kind::Lookup
            && let Some(t) = ticket
        {
            self.renew(t, timeout).map_err(Fail::Definite)?;
        }
        Ok(())
    }

    fn note_sent(&self) {
        self.stats.bump(&self.stats.requests);
        // Relaxed: a heartbeat-scheduling hint.
        self.last_sent_ms
            .store(self.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Sends every queued unpin on `conn`, one `Unpin` per layout and batch,
    /// without waiting for the replies (see `read.rs` for the ordering).
    pub fn start_unpins(&self, conn: &Conn) -> Option<InflightUnpins> {
        // Not on a broken connection: the queue may hold unpins for the
        // session a reattach is setting up (a view released after its
        // re-pin, a pin it gave back), which only the new connection can
        // deliver; the reattach clears what belonged to the old session.
        if !self.unpins.has_pending() {
            return None;
        }
        let mut queue = self.unpins.lock();
        // Checked under the queue lock: a reattach queues the new session's
        // unpins only after it has found this connection broken.
        if queue.is_empty() || !conn.usable() {
            return None;
        }
        let taken = std::mem::take(&mut *queue);
        let n = taken.len();
        // The limits of the session these unpins go to: the directory
        // refuses a longer batch, or an entry releasing more pins.
        let max_batch = (conn.limits.max_batch as usize).clamp(1, proto::MAX_BATCH);
        let max_pins = max_pins_per_key(&conn.limits);
        let layouts = self.layouts.read();
        let mut calls = Vec::new();
        for (layout_ix, keys, counts) in group_unpins(taken, max_pins) {
            let Some(layout) = layouts.get(layout_ix as usize).map(|l| l.layout) else {
                continue;
            };
            for (keys, counts) in keys.chunks(max_batch).zip(counts.chunks(max_batch)) {
                let Ok(ticket) = self.ticket() else {
                    self.give_up_unpins(conn, counts);
                    continue;
                };
                let msg = proto::UnpinFrom {
                    meta: RequestMeta {
                        seq: ticket.seq,
                        notice_ack: self.notice_ack(),
                        replies_received_below: self.seqs.received_below(),
                    },
                    layout,
                    keys,
                    counts,
                };
                let Ok(encoded) = msg.encode() else {
                    self.seqs.release(ticket);
                    self.give_up_unpins(conn, counts);
                    continue;
                };
                self.note_sent();
                // Test fail point: not sent, as when the connection's
                // in-flight bound refuses it.
                #[cfg(test)]
                let refused = self
                    .unpins_not_sent
                    .load(std::sync::atomic::Ordering::Relaxed);
                #[cfg(not(test))]
                let refused = false;
                let call = if refused {
                    Err(TransportError::TooManyInFlight { limit: 0 })
                } else {
                    conn.rpc.start(
                        <Unpin as Message>::KIND.as_u16(),
                        encoded.payload(),
                        self.request_timeout(),
                    )
                };
                self.stats.bump(&self.stats.unpin_batches);
                calls.push(StartedUnpin {
                    ticket,
                    call,
                    encoded,
                    counts: counts.to_vec(),
                });
            }
        }
        drop(layouts);
        self.unpins.sent(n, calls.iter().map(|c| c.ticket.seq));
        drop(queue);
        Some(InflightUnpins {
            conn_no: conn.conn_no,
            calls,
        })
    }

    /// Waits for unpins sent by [`Shared::start_unpins`]. A lost reply is
    /// retried with the same number on the same connection; if the
    /// connection broke, the pins died with its session and the unpin is
    /// dropped (sending it on a new session could release a pin taken
    /// again for a live guard).
    pub fn finish_unpins(&self, conn: &Conn, inflight: InflightUnpins) {
        debug_assert_eq!(conn.conn_no, inflight.conn_no);
        for StartedUnpin {
            ticket,
            call,
            encoded,
            counts,
        } in inflight.calls
        {
            let mut attempts = 0;
            let mut call = call;
            loop {
                let outcome = call.and_then(PendingCall::wait);
                let mut answered = false;
                let mut busy = false;
                let retry = match outcome {
                    Ok(reply) => {
                        let frame = Frame {
                            header: reply.header,
                            payload: reply.payload(),
                        };
                        match proto::access_reply::<UnpinReply>(frame) {
                            Ok(Ok(r)) => {
                                self.absorb(r.reply_meta());
                                let not_held = not_held_pins(&counts, r);
                                self.stats.add(&self.stats.unpins_not_held, not_held);
                                answered = true;
                                false
                            }
                            Ok(Err(refusal)) => {
                                busy = ErrorCode::from_u16(refusal.code.to_native())
                                    .is_some_and(ErrorCode::is_transient);
                                busy
                            }
                            Err(_) => false,
                        }
                    }
                    Err(TransportError::Timeout { .. }) => true,
                    Err(_) => false,
                };
                attempts += 1;
                if !retry || attempts > self.cfg.max_retries || !conn.usable() {
                    if !answered {
                        self.give_up_unpins(conn, &counts);
                    }
                    break;
                }
                self.stats.bump(&self.stats.retries);
                if busy {
                    std::thread::sleep(backoff(attempts));
                }
                call = conn.rpc.start(
                    <Unpin as Message>::KIND.as_u16(),
                    encoded.payload(),
                    self.request_timeout(),
                );
            }
            self.unpins.answered(ticket.seq);
            self.seqs.release(ticket);
        }
    }

    /// Unpin entries releasing `counts` pins for `conn`'s session that will
    /// not be answered (never sent, refused, or unanswered after every
    /// retry). Their pins may still be held, and nothing else would release
    /// them while the session lives — the key could not be deleted until it
    /// ends. So the session is ended (the connection marked dead): the next
    /// request reattaches, the old session's pins go when the server sees
    /// its connection close, and the live views are pinned again on the new
    /// one (the rule of a pinning lookup whose answer was lost).
    fn give_up_unpins(&self, conn: &Conn, counts: &[u32]) {
        let pins: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        self.stats.add(&self.stats.unpins_dropped, pins);
        if conn.usable() {
            tracing::warn!(
                pins,
                "unpins could not be delivered; ending the session to release their pins"
            );
            // Relaxed: a hint read by the next request, which reconnects
            // under the reconnect lock.
            conn.dead.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Sends the queued unpins now and waits for their replies.
    pub fn flush_unpins(&self) -> Result<(), ClientError> {
        self.check_open()?;
        let conn = self.conn()?;
        if let Some(unpins) = self.start_unpins(&conn) {
            self.finish_unpins(&conn, unpins);
        }
        Ok(())
    }

    /// [`flush_unpins`](Self::flush_unpins), then waits for the replies of
    /// unpins another thread has on the wire too (a request's, or the
    /// maintenance thread's deferred flush): when it returns, every guard
    /// dropped before the call is released at the directory, or its unpin
    /// was given up (counted in `unpins_dropped`). The wait is bounded by
    /// their own retries. For the API (`Client::flush_unpins`, `close`), not
    /// the maintenance thread, whose heartbeats must not wait on others.
    pub fn flush_unpins_and_wait(&self) -> Result<(), ClientError> {
        // This flush's own are answered when `flush_unpins` returns; a
        // flush another thread had under way finished its send before ours
        // could take the queue, so its unpins are on the wire now. Those
        // sent after this point are not waited for.
        self.flush_unpins()?;
        let Some(newest) = self.unpins.newest_unanswered() else {
            return Ok(());
        };
        let patience = self.request_timeout() * (self.cfg.max_retries + 1);
        let deadline = Instant::now() + patience;
        while self.unpins.unanswered_up_to(newest) {
            if Instant::now() >= deadline {
                return Err(ClientError::Unanswered {
                    op: "unpin",
                    attempts: self.cfg.max_retries + 1,
                    last: format!(
                        "unpins sent by another thread still unanswered after {} ms",
                        patience.as_millis()
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}
