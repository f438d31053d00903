//! Error codes on the wire ([`ErrorCode`], [`ErrorReply`]) and the typed
//! errors of encoding and checked decoding ([`ProtoError`]).
//!
//! Every [`ProtoError`] maps to exactly one [`ErrorCode`] and, where a limit
//! was exceeded, to that limit's value; [`ProtoError::to_reply`] builds the
//! reply a server sends for it. Error codes travel as plain `u16` numbers so
//! that a peer can show a code it does not know (its number and message)
//! instead of failing to decode the reply.

use rkyv::{Archive, Deserialize, Serialize};

use super::{Kind, MAX_MESSAGE_BYTES};
use crate::frame::FrameError;

/// Stable error numbers. Never renumbered, never reused; new codes get new
/// numbers. 0 is not a code (a zeroed field is detectably wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The payload failed validation (rkyv checked access), or a frame
    /// header was corrupt.
    Malformed = 1,
    /// The frame's protocol version is not spoken here, or `Hello` ranges do
    /// not overlap. `limit`: the newest version this side speaks.
    UnsupportedVersion = 2,
    /// The frame exceeds the maximum size. `limit`: max payload bytes.
    FrameTooLarge = 3,
    /// A key exceeds `MAX_KEY_BYTES`. `limit`: that maximum.
    KeyTooLong = 4,
    /// A batch exceeds its maximum length. `limit`: that maximum.
    BatchTooLarge = 5,
    /// The message kind is unknown, or not a request where one is expected
    /// (or not the expected reply).
    UnknownKind = 6,
    /// The region does not exist (never did, or was freed).
    UnknownRegion = 7,
    /// The region is owned by another instance (or directory).
    NotOwner = 8,
    /// The region token does not match.
    BadToken = 9,
    /// The region or key belongs to another layout.
    WrongLayout = 10,
    /// The instance's quota is used up. `limit`: the quota in bytes.
    QuotaExceeded = 11,
    /// No pool has a free extent large enough. `limit`: the largest free
    /// extent in bytes.
    OutOfSpace = 12,
    /// This listener requires a client secret and none was given.
    AuthenticationRequired = 13,
    /// The client secret or instance secret is wrong.
    AuthenticationFailed = 14,
    /// The session was ended (by an operator, or its lease expired).
    SessionEnded = 15,
    /// Backpressure: too many requests in flight on the connection, or too
    /// many connections. Retry later with the same `seq`. `limit`: the limit
    /// that was hit.
    Busy = 16,
    /// A deadline passed before the request completed. `limit`: the
    /// deadline in milliseconds.
    Timeout = 17,
    /// A retried `seq` fell out of the reply cache: whether it was applied
    /// cannot be told. `limit`: the oldest `seq` still cached.
    SequenceTooOld = 18,
    /// A field has a value outside its documented range. `limit`: the bound,
    /// where there is one.
    InvalidArgument = 19,
    /// A bug or an unexpected failure on the answering side.
    Internal = 20,
    /// The connection has not opened a session yet (`Hello`/`Reattach`, or
    /// `PoolHello`, must come first).
    HelloRequired = 21,
    /// `Hello` named an instance that is live, or within its grace period
    /// and not one this caller may take over (a `Hello` from the same Unix
    /// user takes over an instance none of whose processes still runs;
    /// `docs/protocol.md`): use `Reattach` with its secret.
    InstanceInUse = 22,
    /// A `RequestRegion` whose instance was declared gone (grace expired,
    /// or taken over) before the pool manager answered. (A `Reattach` of an
    /// expired instance is not refused: it starts the instance afresh,
    /// `resumed: false`.)
    InstanceGone = 23,
    /// The retried `seq` was executed, but its cached reply was dropped (the
    /// instance's reply cache overflowed its byte limit, or the client said
    /// it had received it): it will not run again, and its answer is lost.
    ReplyEvicted = 24,
    /// A retried pinning `Lookup` ran on another session, which holds its
    /// pins: look up again with a new `seq`.
    PinsHeldByOtherSession = 25,
    /// `ReturnRegion` of a region that still has registered keys. `limit`:
    /// the number of keys.
    RegionNotEmpty = 26,
    /// `Reattach` of an instance the directory recovered from the pool
    /// manager after a restart, presenting none of its recovered regions'
    /// tokens. Nothing was claimed. A client that presented no token at all
    /// owns nothing there (a region grant whose reply was lost): it retries
    /// until the instance's grace period frees those regions, and the
    /// reattach then starts the instance afresh. Distinct from
    /// `AuthenticationFailed` (a wrong secret), which no retry can fix.
    OwnershipNotProven = 27,
}

impl ErrorCode {
    /// Every code, in number order.
    pub const ALL: [ErrorCode; 27] = [
        Self::Malformed,
        Self::UnsupportedVersion,
        Self::FrameTooLarge,
        Self::KeyTooLong,
        Self::BatchTooLarge,
        Self::UnknownKind,
        Self::UnknownRegion,
        Self::NotOwner,
        Self::BadToken,
        Self::WrongLayout,
        Self::QuotaExceeded,
        Self::OutOfSpace,
        Self::AuthenticationRequired,
        Self::AuthenticationFailed,
        Self::SessionEnded,
        Self::Busy,
        Self::Timeout,
        Self::SequenceTooOld,
        Self::InvalidArgument,
        Self::Internal,
        Self::HelloRequired,
        Self::InstanceInUse,
        Self::InstanceGone,
        Self::ReplyEvicted,
        Self::PinsHeldByOtherSession,
        Self::RegionNotEmpty,
        Self::OwnershipNotProven,
    ];

    pub const fn as_u16(self) -> u16 {
        self as u16
    }

    /// The code with number `n`; `None` for a number this build does not
    /// know (a newer peer's code: show the number and the reply's message).
    pub fn from_u16(n: u16) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.as_u16() == n)
    }

    /// A stable name (`snake_case`), for logs, metrics labels and the C ABI.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::UnsupportedVersion => "unsupported_version",
            Self::FrameTooLarge => "frame_too_large",
            Self::KeyTooLong => "key_too_long",
            Self::BatchTooLarge => "batch_too_large",
            Self::UnknownKind => "unknown_kind",
            Self::UnknownRegion => "unknown_region",
            Self::NotOwner => "not_owner",
            Self::BadToken => "bad_token",
            Self::WrongLayout => "wrong_layout",
            Self::QuotaExceeded => "quota_exceeded",
            Self::OutOfSpace => "out_of_space",
            Self::AuthenticationRequired => "authentication_required",
            Self::AuthenticationFailed => "authentication_failed",
            Self::SessionEnded => "session_ended",
            Self::Busy => "busy",
            Self::Timeout => "timeout",
            Self::SequenceTooOld => "sequence_too_old",
            Self::InvalidArgument => "invalid_argument",
            Self::Internal => "internal",
            Self::HelloRequired => "hello_required",
            Self::InstanceInUse => "instance_in_use",
            Self::InstanceGone => "instance_gone",
            Self::ReplyEvicted => "reply_evicted",
            Self::PinsHeldByOtherSession => "pins_held_by_other_session",
            Self::RegionNotEmpty => "region_not_empty",
            Self::OwnershipNotProven => "ownership_not_proven",
        }
    }

    /// A one-line human description of the condition.
    pub const fn message(self) -> &'static str {
        match self {
            Self::Malformed => "malformed message",
            Self::UnsupportedVersion => "unsupported protocol version",
            Self::FrameTooLarge => "frame too large",
            Self::KeyTooLong => "key too long",
            Self::BatchTooLarge => "batch too large",
            Self::UnknownKind => "unknown or unexpected message kind",
            Self::UnknownRegion => "unknown region",
            Self::NotOwner => "region not owned by the caller",
            Self::BadToken => "region token does not match",
            Self::WrongLayout => "wrong layout",
            Self::QuotaExceeded => "quota exceeded",
            Self::OutOfSpace => "out of space in the pools",
            Self::AuthenticationRequired => "authentication required",
            Self::AuthenticationFailed => "authentication failed",
            Self::SessionEnded => "session ended",
            Self::Busy => "busy: too many requests in flight or too many connections",
            Self::Timeout => "deadline expired",
            Self::SequenceTooOld => "sequence number older than the reply cache",
            Self::InvalidArgument => "invalid argument",
            Self::Internal => "internal error",
            Self::HelloRequired => "no session: send Hello or Reattach first",
            Self::InstanceInUse => "instance id in use: reattach with its secret",
            Self::InstanceGone => "instance expired: start a new one with Hello",
            Self::ReplyEvicted => "request already executed; its cached reply was dropped",
            Self::PinsHeldByOtherSession => {
                "the retried lookup's pins belong to another session: look up again"
            }
            Self::RegionNotEmpty => "region still has registered keys",
            Self::OwnershipNotProven => {
                "no token of the recovered instance's regions presented: present one, or reattach after its grace period"
            }
        }
    }

    /// True when the same request, with the same `seq`, may succeed if sent
    /// again later: the error was raised before the request was applied and
    /// it was not recorded in the reply cache.
    pub const fn is_transient(self) -> bool {
        matches!(self, Self::Busy | Self::Timeout)
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_u16())
    }
}

/// The reply to any request that failed as a whole.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ErrorReply {
    /// An [`ErrorCode`] number.
    pub code: u16,
    /// What went wrong, with which input; at most [`MAX_MESSAGE_BYTES`].
    pub message: String,
    /// The limit involved (see each [`ErrorCode`]); 0 when none.
    pub limit: u64,
}

impl ErrorReply {
    /// A reply for `code`. A message longer than [`MAX_MESSAGE_BYTES`] is
    /// cut (at a character boundary) so that the reply always encodes.
    pub fn new(code: ErrorCode, message: impl Into<String>, limit: u64) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE_BYTES {
            let mut cut = MAX_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self {
            code: code.as_u16(),
            message,
            limit,
        }
    }

    /// The code; `None` when this build does not know the number.
    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_u16(self.code)
    }
}

impl ArchivedErrorReply {
    pub fn code(&self) -> u16 {
        self.code.to_native()
    }

    /// The code; `None` when this build does not know the number.
    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_u16(self.code())
    }

    pub fn message(&self) -> &str {
        self.message.as_str()
    }

    pub fn limit(&self) -> u64 {
        self.limit.to_native()
    }
}

/// What went wrong while encoding or decoding a message. Each variant names
/// the message kind and the field or limit involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The frame itself was refused (see [`FrameError`]).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The header's kind number is not a known kind, or not one of the
    /// family expected here (a reply where a request is expected, …).
    #[error("message kind {kind:#06x} is unknown or not {expected}")]
    UnknownKind { kind: u16, expected: &'static str },
    /// The header names another kind than the one asked for.
    #[error("expected a {expected:?} message, found kind {found:#06x}")]
    UnexpectedKind { expected: Kind, found: u16 },
    /// The payload does not start 8-aligned in memory (a receiver bug: the
    /// frame decoder guarantees alignment).
    #[error("{kind:?} payload at address {addr:#x} is not 8-aligned")]
    Unaligned { kind: Kind, addr: usize },
    /// rkyv's checked access refused the payload.
    #[error("malformed {kind:?} payload ({len_bytes} bytes): {detail}")]
    Malformed {
        kind: Kind,
        len_bytes: usize,
        detail: String,
    },
    /// A key exceeds [`MAX_KEY_BYTES`](super::MAX_KEY_BYTES).
    #[error("{kind:?}: key {index} is {len_bytes} bytes, over MAX_KEY_BYTES = {max}")]
    KeyTooLong {
        kind: Kind,
        index: usize,
        len_bytes: usize,
        max: usize,
    },
    /// A list exceeds its limit (`limit` names the constant).
    #[error("{kind:?}: {field} has {len} items, over {limit} = {max}")]
    BatchTooLarge {
        kind: Kind,
        field: &'static str,
        len: usize,
        limit: &'static str,
        max: usize,
    },
    /// A string or byte field exceeds its limit (`limit` names the constant).
    #[error("{kind:?}: {field} is {len_bytes} bytes, over {limit} = {max}")]
    FieldTooLong {
        kind: Kind,
        field: &'static str,
        len_bytes: usize,
        limit: &'static str,
        max: usize,
    },
    /// Two lists that must be parallel have different lengths.
    #[error("{kind:?}: {field} has {len} items, must have {expected} (one per key)")]
    LengthMismatch {
        kind: Kind,
        field: &'static str,
        len: usize,
        expected: usize,
    },
    /// A mutating request carries `seq` 0.
    #[error("{kind:?} is mutating and needs a non-zero seq")]
    SeqRequired { kind: Kind },
    /// A read-only request carries a non-zero `seq`.
    #[error("{kind:?} is read-only and must carry seq 0, found {seq}")]
    SeqNotAllowed { kind: Kind, seq: u64 },
    /// A numeric field is out of its documented range.
    #[error("{kind:?}: {field} = {value} is invalid: {reason}")]
    InvalidValue {
        kind: Kind,
        field: &'static str,
        value: u64,
        reason: &'static str,
        limit: u64,
    },
    /// `Hello`'s version range does not overlap ours.
    #[error(
        "no common protocol version: peer speaks {peer_min}..={peer_max}, \
         this side {ours_min}..={ours_max}"
    )]
    NoCommonVersion {
        peer_min: u16,
        peer_max: u16,
        ours_min: u16,
        ours_max: u16,
    },
    /// Encoding produced a payload over the frame limit.
    #[error("{kind:?} payload is {len_bytes} bytes, over MAX_PAYLOAD_BYTES = {max}")]
    PayloadTooLarge {
        kind: Kind,
        len_bytes: usize,
        max: usize,
    },
    /// rkyv failed to serialize (only on an internal size overflow).
    #[error("encoding {kind:?} failed: {detail}")]
    Encode { kind: Kind, detail: String },
}

impl ProtoError {
    /// The wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Frame(FrameError::UnsupportedVersion { .. }) => ErrorCode::UnsupportedVersion,
            Self::Frame(FrameError::Oversized { .. }) => ErrorCode::FrameTooLarge,
            Self::Frame(_) => ErrorCode::Malformed,
            Self::UnknownKind { .. } | Self::UnexpectedKind { .. } => ErrorCode::UnknownKind,
            Self::Unaligned { .. } | Self::Encode { .. } => ErrorCode::Internal,
            Self::Malformed { .. } => ErrorCode::Malformed,
            Self::KeyTooLong { .. } => ErrorCode::KeyTooLong,
            Self::BatchTooLarge { .. } => ErrorCode::BatchTooLarge,
            Self::FieldTooLong { .. }
            | Self::LengthMismatch { .. }
            | Self::SeqRequired { .. }
            | Self::SeqNotAllowed { .. }
            | Self::InvalidValue { .. } => ErrorCode::InvalidArgument,
            Self::NoCommonVersion { .. } => ErrorCode::UnsupportedVersion,
            Self::PayloadTooLarge { .. } => ErrorCode::FrameTooLarge,
        }
    }

    /// The limit that was exceeded (the value an [`ErrorReply`] carries);
    /// 0 when no limit is involved.
    pub fn limit(&self) -> u64 {
        let limit = match self {
            Self::Frame(FrameError::UnsupportedVersion { .. }) => {
                return u64::from(super::PROTOCOL_MAX);
            }
            Self::Frame(FrameError::Oversized { max, .. }) => *max,
            Self::KeyTooLong { max, .. }
            | Self::BatchTooLarge { max, .. }
            | Self::FieldTooLong { max, .. }
            | Self::PayloadTooLarge { max, .. } => *max,
            Self::LengthMismatch { expected, .. } => *expected,
            Self::InvalidValue { limit, .. } => return *limit,
            Self::NoCommonVersion { ours_max, .. } => return u64::from(*ours_max),
            _ => 0,
        };
        limit as u64
    }

    /// The reply a server sends for this error.
    pub fn to_reply(&self) -> ErrorReply {
        ErrorReply::new(self.code(), self.to_string(), self.limit())
    }
}

impl From<&ProtoError> for ErrorReply {
    fn from(e: &ProtoError) -> Self {
        e.to_reply()
    }
}
