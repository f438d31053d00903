//! The pool protocol on a socket: a transport [`Handler`] that validates each
//! frame at the edge and hands the request to the core, and the encoding of
//! the core's answers into reply frames.
//!
//! Runs on the transport's event-loop thread and never blocks: a connection
//! becomes a core session at `on_connect` (its caller identified there — a
//! Unix peer by [`liveness::identify`] of its `SO_PEERCRED` pid, a TCP peer
//! by its session), every valid pool request is queued for the core (or
//! answered `Busy` when [`MAX_QUEUED_REQUESTS`] are queued), and
//! `on_disconnect` closes the session. Frames that fail validation, frames
//! the transport rejected, and kinds that are not pool-manager requests are
//! answered here with their error code and change nothing.
//!
//! Requests are deserialized to owned values before they cross to the core
//! thread: one small allocation per request, on a path that runs once per
//! region (tens of MiB), not per key.
//!
//! [`MAX_QUEUED_REQUESTS`]: super::MAX_QUEUED_REQUESTS

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::core::{CoreLink, Op, ReplyTo, SessionTransport};
use super::{PoolReply, PoolServiceError, ServiceError};
use crate::frame::{Frame, FrameHeader, HEADER_BYTES};
use crate::pool::Caller;
use crate::pool::liveness;
use crate::proto::{
    self, AnyRequest, ErrorCode, ErrorReply, Message, ProtoError, RegionAllocated, RegionFreed,
};
use crate::transport::{
    Admit, Completer, ConnId, DisconnectReason, Handler, PeerInfo, Rejection, Replies,
    prepare_socket_dir,
};

/// The transport handler of the pool service (see the module essay).
#[derive(Debug)]
pub struct PoolWireHandler {
    link: CoreLink,
    completer: Completer,
    /// Connection → core session.
    sessions: HashMap<ConnId, u64>,
    scratch: Vec<u8>,
}

impl PoolWireHandler {
    pub(crate) fn new(link: CoreLink, completer: Completer) -> Self {
        Self {
            link,
            completer,
            sessions: HashMap::new(),
            scratch: Vec::new(),
        }
    }

    fn error(&mut self, out: &mut Replies, conn: ConnId, request_id: u64, e: &ErrorReply) {
        match encode_payload(e, &mut self.scratch) {
            Ok(payload) => {
                if let Err(err) = out.send(conn, ErrorReply::KIND.as_u16(), request_id, payload) {
                    tracing::warn!(%conn, error = %err, "cannot queue an error reply");
                }
            }
            Err(err) => tracing::error!(%conn, error = %err, "cannot encode an error reply"),
        }
    }
}

impl Handler for PoolWireHandler {
    fn on_connect(&mut self, conn: ConnId, peer: &PeerInfo) -> Admit {
        let session = self.link.new_session();
        let (caller, transport) = match peer {
            PeerInfo::Unix(cred) => {
                let identity = u32::try_from(cred.pid)
                    .ok()
                    .map(liveness::identify)
                    .transpose();
                match identity {
                    Ok(Some(Some(p))) => (
                        Caller::Local(p),
                        SessionTransport::Unix {
                            completer: self.completer.clone(),
                            conn,
                        },
                    ),
                    Ok(_) => {
                        tracing::info!(%conn, pid = cred.pid, "refusing a Unix peer whose process is already gone");
                        return Admit::Refuse(None);
                    }
                    Err(e) => {
                        tracing::warn!(%conn, pid = cred.pid, error = %e, "cannot identify a Unix peer; refusing it");
                        return Admit::Refuse(None);
                    }
                }
            }
            PeerInfo::Tcp(_) => (
                Caller::Remote {
                    connection: session,
                },
                SessionTransport::Tcp {
                    completer: self.completer.clone(),
                    conn,
                },
            ),
        };
        if !self.link.open(session, caller, transport) {
            return Admit::Refuse(None);
        }
        tracing::debug!(%conn, session, %caller, "pool connection opened");
        self.sessions.insert(conn, session);
        Admit::Accept
    }

    fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies) {
        let request_id = frame.header.request_id;
        let Some(&session) = self.sessions.get(&conn) else {
            return;
        };
        let op = match proto::decode_request(frame).and_then(to_op) {
            Ok(op) => op,
            Err(e) => {
                tracing::debug!(%conn, error = %e, "refused a pool request at the edge");
                self.error(out, conn, request_id, &e.to_reply());
                return;
            }
        };
        if let Err((_, e)) = self.link.request(session, op, ReplyTo::Wire { request_id }) {
            self.error(out, conn, request_id, &e.to_reply());
        }
    }

    fn on_rejected(
        &mut self,
        conn: ConnId,
        header: FrameHeader,
        why: Rejection,
        out: &mut Replies,
    ) {
        let reply = match why {
            Rejection::Frame(e) => ProtoError::Frame(e).to_reply(),
            Rejection::TooManyInFlight { limit } => ErrorReply::new(
                ErrorCode::Busy,
                format!("{limit} requests already in flight on this connection"),
                limit as u64,
            ),
            Rejection::DuplicateRequestId => ErrorReply::new(
                ErrorCode::InvalidArgument,
                format!(
                    "request id {} is already in flight on this connection",
                    header.request_id
                ),
                0,
            ),
        };
        self.error(out, conn, header.request_id, &reply);
    }

    fn on_disconnect(&mut self, conn: ConnId, why: &DisconnectReason) {
        if let Some(session) = self.sessions.remove(&conn) {
            tracing::debug!(%conn, session, reason = ?why, "pool connection closed");
            self.link.closed(session);
        }
    }
}

/// Converts a validated request into the core's form.
fn to_op(request: AnyRequest<'_>) -> Result<Op, ProtoError> {
    Ok(match request {
        AnyRequest::PoolHello(a) => {
            let h = proto::deserialize::<proto::PoolHello>(a)?;
            Op::Hello {
                protocol_min: h.protocol_min,
                protocol_max: h.protocol_max,
                directory_id: h.directory_id,
                secret: h.secret,
            }
        }
        AnyRequest::AllocRegion(a) => {
            let r = proto::deserialize::<proto::AllocRegion>(a)?;
            Op::Alloc {
                seq: r.meta.seq,
                pool: r.pool,
                len_bytes: r.len_bytes,
                directory_id: Some(r.owner.directory_id),
                instance_id: r.owner.instance_id,
            }
        }
        AnyRequest::FreeRegion(a) => {
            let r = proto::deserialize::<proto::FreeRegion>(a)?;
            Op::Free {
                seq: r.meta.seq,
                region: r.region,
                token: r.token,
            }
        }
        AnyRequest::ReattachRegions(a) => {
            let r = proto::deserialize::<proto::ReattachRegions>(a)?;
            Op::Reattach { handles: r.handles }
        }
        AnyRequest::ListRegions(a) => {
            let r = proto::deserialize::<proto::ListRegions>(a)?;
            Op::List {
                after_region: r.after_region,
                max_handles: r.max_handles,
            }
        }
        AnyRequest::PoolStats(_) => Op::Stats,
        other => {
            return Err(ProtoError::UnknownKind {
                kind: other.kind().as_u16(),
                expected: "a pool-manager request",
            });
        }
    })
}

/// Encodes `msg` and returns its payload (the frame is built again by the
/// transport around it).
pub(crate) fn encode_payload<'a, M: Message>(
    msg: &M,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], ProtoError> {
    scratch.clear();
    proto::encode(0, msg, scratch)?;
    let len = u32::from_le_bytes(
        scratch[16..20]
            .try_into()
            .expect("a frame header holds its payload length at 16..20"),
    ) as usize;
    Ok(&scratch[HEADER_BYTES..HEADER_BYTES + len])
}

/// Sends the core's answer to request `request_id` of `conn`.
pub(crate) fn send_answer(
    completer: &Completer,
    conn: ConnId,
    request_id: u64,
    answer: Result<PoolReply, PoolServiceError>,
    scratch: &mut Vec<u8>,
) {
    fn payload<M: Message>(msg: &M, scratch: &mut Vec<u8>) -> Result<(u16, Vec<u8>), ProtoError> {
        Ok((M::KIND.as_u16(), encode_payload(msg, scratch)?.to_vec()))
    }
    let mut fds = Vec::new();
    let encoded = match answer {
        Ok(PoolReply::Welcome { welcome, fds: f }) => {
            fds = f;
            payload(&welcome, scratch)
        }
        Ok(PoolReply::Allocated(handle)) => payload(&RegionAllocated { handle }, scratch),
        Ok(PoolReply::Freed { region }) => payload(&RegionFreed { region }, scratch),
        Ok(PoolReply::Reattached(r)) => payload(&r, scratch),
        Ok(PoolReply::Regions(r)) => payload(&r, scratch),
        Ok(PoolReply::Stats(r)) => payload(&r, scratch),
        Err(e) => payload(&e.to_reply(), scratch),
    };
    let (kind, bytes) = match encoded {
        Ok(x) => x,
        Err(e) => {
            tracing::error!(%conn, error = %e, "cannot encode a pool reply");
            match payload(&e.to_reply(), scratch) {
                Ok(x) => x,
                Err(_) => return,
            }
        }
    };
    let sent = if fds.is_empty() {
        completer.complete(conn, kind, request_id, &bytes)
    } else {
        completer.complete_with_fds(conn, kind, request_id, &bytes, fds)
    };
    match sent {
        Ok(()) => {}
        // The transport stopped first (a graceful shutdown): nobody to tell.
        Err(crate::transport::ReplyError::Stopped) => {}
        // The peer times out and resends with the same seq.
        Err(e) => tracing::warn!(%conn, request_id, error = %e, "cannot queue a pool reply"),
    }
}

/// How long [`prepare_socket_path`] waits for an answer from whatever
/// accepts on an existing socket.
const SOCKET_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// True when something on `stream` answers a `PoolStats` request within
/// [`SOCKET_PROBE_TIMEOUT`] with a well-framed reply.
fn answers_pool_stats(stream: &UnixStream) -> bool {
    use std::io::{Read, Write};
    // `Read`/`Write` are implemented for `&UnixStream`.
    let mut stream = stream;
    let mut probe = || -> io::Result<bool> {
        stream.set_read_timeout(Some(SOCKET_PROBE_TIMEOUT))?;
        stream.set_write_timeout(Some(SOCKET_PROBE_TIMEOUT))?;
        let mut frame = Vec::new();
        proto::encode(
            1,
            &proto::PoolStats {
                meta: proto::RequestMeta::default(),
            },
            &mut frame,
        )
        .map_err(io::Error::other)?;
        stream.write_all(&frame)?;
        let mut header = [0u8; HEADER_BYTES];
        stream.read_exact(&mut header)?;
        Ok(FrameHeader::decode(&header).is_ok_and(|h| h.request_id == 1))
    };
    probe().unwrap_or(false)
}

/// Makes `path` bindable: creates its directory and checks that no other
/// user can replace a socket in it ([`prepare_socket_dir`]), and removes a stale
/// socket file that nobody answers on (left by a killed daemon). A socket on
/// which a pool manager answers, or a file that is not a socket, is refused.
pub(crate) fn prepare_socket_path(path: &Path) -> Result<(), ServiceError> {
    prepare_socket_dir(path).map_err(|e| ServiceError::Config(e.to_string()))?;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(ServiceError::Config(format!(
                "cannot stat {}: {e}",
                path.display()
            )));
        }
    };
    if !meta.file_type().is_socket() {
        return Err(ServiceError::Config(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        )));
    }
    let state = crate::transport::classify_existing_socket(
        path,
        answers_pool_stats,
        // As the server's: a killed listener goes away well within it.
        std::time::Duration::from_secs(5),
    )
    .map_err(|e| {
        ServiceError::Config(format!(
            "socket {} exists and cannot be probed ({e}); remove it if no pool manager uses it",
            path.display()
        ))
    })?;
    match state {
        crate::transport::ExistingSocket::Answering => Err(ServiceError::Config(format!(
            "socket {} is in use by another process (a pool manager answers on it); refusing to start a second one",
            path.display()
        ))),
        crate::transport::ExistingSocket::SilentListener => Err(ServiceError::Config(format!(
            "socket {}: a listener accepts on it but does not answer as a pool manager \
             (a stalled one, or another program's socket); not replacing it",
            path.display()
        ))),
        crate::transport::ExistingSocket::Stale => {
            tracing::info!(path = %path.display(), "removing a stale socket file");
            std::fs::remove_file(path).map_err(|e| {
                ServiceError::Config(format!(
                    "cannot remove stale socket {}: {e}",
                    path.display()
                ))
            })
        }
    }
}
