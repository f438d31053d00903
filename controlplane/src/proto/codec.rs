//! Encoding into frames and checked decoding out of them.
//!
//! [`encode`] serializes a message straight into the caller's output buffer
//! behind a placeholder header, then fills the header in: no intermediate
//! copy, and rkyv's scratch space is a reused thread-local arena. [`access`]
//! is the only way to read a received payload: kind check, rkyv checked
//! access (bytecheck: every relative pointer in range and aligned, every enum
//! tag and `bool` valid, every string UTF-8; a request's key list in one
//! pass that accepts exactly what rkyv's per-key check accepts, see
//! [`ArchivedKeyList`](super::ArchivedKeyList)), then this protocol's own
//! limits ([`Validate`]). Nothing in this crate uses unchecked access.

use std::cell::Cell;

use rkyv::api::low::{LowDeserializer, LowValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor::{self, Strategy};
use rkyv::ser::Serializer;
use rkyv::ser::allocator::{Arena, ArenaHandle};
use rkyv::{Archive, Deserialize, Portable, Serialize};

use super::common::{ArchivedReplyMeta, RequestMeta};
use super::directory::*;
use super::error::{ArchivedErrorReply, ErrorReply, ProtoError};
use super::pool::*;
use super::stats::{ArchivedStats, ArchivedStatsReply, Stats, StatsReply};
use super::validate::Validate;
use super::{Kind, PROTOCOL_MAX, PROTOCOL_MIN};
use crate::frame::{FRAME_ALIGN, Frame, FrameHeader, HEADER_BYTES, MAX_PAYLOAD_BYTES, padding};

/// The serializer [`encode`] drives: writes into the caller's `Vec<u8>`,
/// scratch space from the thread's arena, no pointer sharing.
pub type Encoder<'a, 'b> =
    Strategy<Serializer<&'b mut Vec<u8>, ArenaHandle<'a>, ()>, rancor::Error>;

/// The deserializer [`deserialize`] drives (no shared pointers to pool).
pub type Deserializer = LowDeserializer<rancor::Error>;

/// A message type: its header kind, how it is serialized, and the checks its
/// archived form passes on receipt.
pub trait Message:
    Sized
    + Archive<
        Archived: Portable
                      + for<'a> CheckBytes<LowValidator<'a, rancor::Error>>
                      + Validate
                      + Deserialize<Self, Deserializer>
                      + std::fmt::Debug,
    > + for<'a, 'b> Serialize<Encoder<'a, 'b>>
{
    const KIND: Kind;
}

/// The archived (wire) form of message `M`.
pub type Archived<M> = <M as Archive>::Archived;

/// Appends one whole frame carrying `msg` to `out`: header, payload, zero
/// padding to [`FRAME_ALIGN`]. Returns the frame's length in bytes. On error
/// `out` is left as it was.
///
/// # Panics
/// If `out.len()` is not a multiple of [`FRAME_ALIGN`]: frames are laid end
/// to end, and rkyv aligns relative to the buffer start, so a misaligned
/// start would misalign the payload's contents (a caller bug).
pub fn encode<M: Message>(
    request_id: u64,
    msg: &M,
    out: &mut Vec<u8>,
) -> Result<usize, ProtoError> {
    encode_kind(M::KIND, request_id, msg, out)
}

/// [`encode`] for a value that is not `M` but archives exactly as `M` does
/// (`T::Archived` is `M`'s archived type, so the frame is a valid `M`
/// frame): a reply serialized straight from the server's own data, such as
/// [`LookupReplyFrom`], with no `M` built first.
pub fn encode_as<M, T>(request_id: u64, value: &T, out: &mut Vec<u8>) -> Result<usize, ProtoError>
where
    M: Message,
    T: EncodesAs<M>,
{
    encode_kind(M::KIND, request_id, value, out)
}

/// A value whose frame is a valid frame of message `M`: it archives as `M`
/// does and serializes with [`encode`]'s serializer ([`encode_as`]).
pub trait EncodesAs<M: Message>:
    Archive<Archived = Archived<M>> + for<'a, 'b> Serialize<Encoder<'a, 'b>>
{
}

impl<M, T> EncodesAs<M> for T
where
    M: Message,
    T: Archive<Archived = Archived<M>> + for<'a, 'b> Serialize<Encoder<'a, 'b>>,
{
}

thread_local! {
    /// The serializer's scratch arena, kept between encodes on this thread.
    static ARENA: Cell<Option<Arena>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's scratch arena, as `rkyv::util::with_arena`
/// does (the arena taken out for the call, shrunk and put back after), but
/// with a fresh arena instead of a panic once the thread's thread-locals
/// are destroyed: a client call made from a thread-local destructor (a C
/// engine's `pthread_key_create` one, as the thread exits) encodes its
/// request like any other.
fn with_arena<R>(f: impl FnOnce(&mut Arena) -> R) -> R {
    let mut arena = ARENA
        .try_with(Cell::take)
        .ok()
        .flatten()
        .unwrap_or_default();
    let result = f(&mut arena);
    let capacity = arena.shrink();
    // A nested call may have put an arena back meanwhile: keep the larger.
    let _ = ARENA.try_with(|slot| match slot.take() {
        Some(other) if other.capacity() > capacity => slot.set(Some(other)),
        _ => slot.set(Some(arena)),
    });
    result
}

fn encode_kind<T>(
    kind: Kind,
    request_id: u64,
    msg: &T,
    out: &mut Vec<u8>,
) -> Result<usize, ProtoError>
where
    T: for<'a, 'b> Serialize<Encoder<'a, 'b>>,
{
    let frame_start = out.len();
    assert_eq!(
        frame_start % FRAME_ALIGN,
        0,
        "frames must start at a multiple of FRAME_ALIGN"
    );
    let payload_start = frame_start + HEADER_BYTES;
    out.resize(payload_start, 0);
    let serialized = with_arena(|arena| {
        rkyv::api::low::to_bytes_in_with_alloc::<_, _, rancor::Error>(
            msg,
            &mut *out,
            arena.acquire(),
        )
        .map(|_| ())
    });
    if let Err(e) = serialized {
        out.truncate(frame_start);
        return Err(ProtoError::Encode {
            kind,
            detail: e.to_string(),
        });
    }
    let payload_len = out.len() - payload_start;
    let header = match FrameHeader::new(kind.as_u16(), request_id, payload_len) {
        Ok(header) => header,
        Err(_) => {
            out.truncate(frame_start);
            return Err(ProtoError::PayloadTooLarge {
                kind,
                len_bytes: payload_len,
                max: MAX_PAYLOAD_BYTES,
            });
        }
    };
    out[frame_start..payload_start].copy_from_slice(&header.encode());
    out.resize(out.len() + padding(payload_len), 0);
    Ok(out.len() - frame_start)
}

/// Validates a received frame as message `M` and returns its archived form,
/// borrowed from the receive buffer.
///
/// Checks, in order: the header's kind is `M::KIND`; the payload is
/// 8-aligned in memory; rkyv's checked access accepts it; the protocol limits
/// and field rules of `M` hold ([`Validate`]).
pub fn access<M: Message>(frame: Frame<'_>) -> Result<&Archived<M>, ProtoError> {
    if frame.header.kind != M::KIND.as_u16() {
        return Err(ProtoError::UnexpectedKind {
            expected: M::KIND,
            found: frame.header.kind,
        });
    }
    access_payload::<M>(frame.payload)
}

fn access_payload<M: Message>(payload: &[u8]) -> Result<&Archived<M>, ProtoError> {
    let addr = payload.as_ptr() as usize;
    if !addr.is_multiple_of(FRAME_ALIGN) {
        return Err(ProtoError::Unaligned {
            kind: M::KIND,
            addr,
        });
    }
    let archived = rkyv::api::low::access::<Archived<M>, rancor::Error>(payload).map_err(|e| {
        ProtoError::Malformed {
            kind: M::KIND,
            len_bytes: payload.len(),
            detail: e.to_string(),
        }
    })?;
    archived.validate(M::KIND)?;
    Ok(archived)
}

/// A reply frame read by a requester: the expected reply `M`, or an
/// `ErrorReply`. `Err` when the frame is neither, or fails validation.
pub fn access_reply<M: Message>(
    frame: Frame<'_>,
) -> Result<Result<&Archived<M>, &ArchivedErrorReply>, ProtoError> {
    if frame.header.kind == Kind::ErrorReply.as_u16() {
        return access::<ErrorReply>(frame).map(Err);
    }
    access::<M>(frame).map(Ok)
}

/// Converts a validated archived message into its owned form (allocates:
/// for clients keeping a reply, and for tests; never on the server's hot
/// path).
pub fn deserialize<M: Message>(archived: &Archived<M>) -> Result<M, ProtoError> {
    rkyv::api::low::deserialize::<M, rancor::Error>(archived).map_err(|e| ProtoError::Malformed {
        kind: M::KIND,
        len_bytes: 0,
        detail: e.to_string(),
    })
}

/// Picks the protocol version for a `Hello`/`Reattach`/`PoolHello` that
/// offers `peer_min..=peer_max`: the highest version both sides speak.
pub fn negotiate(peer_min: u16, peer_max: u16) -> Result<u16, ProtoError> {
    let version = peer_max.min(PROTOCOL_MAX);
    if peer_min > peer_max || version < peer_min.max(PROTOCOL_MIN) {
        return Err(ProtoError::NoCommonVersion {
            peer_min,
            peer_max,
            ours_min: PROTOCOL_MIN,
            ours_max: PROTOCOL_MAX,
        });
    }
    Ok(version)
}

/// What every archived request offers, whatever its kind.
pub trait ArchivedRequest {
    /// The request's sequence number and notice acknowledgement.
    fn meta(&self) -> RequestMeta;
    /// True when the request changes state: it carries a non-zero `seq` and
    /// its reply goes into the reply cache.
    fn is_mutating(&self) -> bool;
}

/// What every archived directory reply offers (all but `ErrorReply` and the
/// pool manager's replies).
pub trait ArchivedDirectoryReply {
    fn reply_meta(&self) -> &ArchivedReplyMeta;
}

macro_rules! requests {
    ($($name:ident),* $(,)?) => {
        $(
            impl Message for $name {
                const KIND: Kind = Kind::$name;
            }
        )*

        /// A validated request of any kind, borrowed from the receive buffer.
        #[derive(Debug, Clone, Copy)]
        pub enum AnyRequest<'a> {
            $($name(&'a Archived<$name>),)*
        }

        impl AnyRequest<'_> {
            pub fn kind(&self) -> Kind {
                match self {
                    $(Self::$name(_) => Kind::$name,)*
                }
            }

            pub fn meta(&self) -> RequestMeta {
                match self {
                    $(Self::$name(r) => r.meta(),)*
                }
            }

            pub fn is_mutating(&self) -> bool {
                match self {
                    $(Self::$name(r) => r.is_mutating(),)*
                }
            }
        }

        /// Validates a frame as whichever request its header names.
        /// A reply kind (or an unknown number) gives `UnknownKind`.
        pub fn decode_request(frame: Frame<'_>) -> Result<AnyRequest<'_>, ProtoError> {
            let unknown =
                ProtoError::UnknownKind { kind: frame.header.kind, expected: "a request" };
            match Kind::from_u16(frame.header.kind).ok_or_else(|| unknown.clone())? {
                $(Kind::$name => access::<$name>(frame).map(AnyRequest::$name),)*
                _ => Err(unknown),
            }
        }
    };
}

macro_rules! replies {
    ($($name:ident),* $(,)?) => {
        $(
            impl Message for $name {
                const KIND: Kind = Kind::$name;
            }
        )*

        /// A validated reply of any kind, borrowed from the receive buffer.
        #[derive(Debug, Clone, Copy)]
        pub enum AnyReply<'a> {
            $($name(&'a Archived<$name>),)*
        }

        impl AnyReply<'_> {
            pub fn kind(&self) -> Kind {
                match self {
                    $(Self::$name(_) => Kind::$name,)*
                }
            }
        }

        /// Validates a frame as whichever reply its header names.
        /// A request kind (or an unknown number) gives `UnknownKind`.
        pub fn decode_reply(frame: Frame<'_>) -> Result<AnyReply<'_>, ProtoError> {
            let unknown = ProtoError::UnknownKind { kind: frame.header.kind, expected: "a reply" };
            match Kind::from_u16(frame.header.kind).ok_or_else(|| unknown.clone())? {
                $(Kind::$name => access::<$name>(frame).map(AnyReply::$name),)*
                _ => Err(unknown),
            }
        }
    };
}

requests!(
    Hello,
    Reattach,
    Heartbeat,
    RequestRegion,
    ReturnRegion,
    MapRegion,
    Register,
    Lookup,
    Exists,
    Unpin,
    Delete,
    Stats,
    EndSession,
    PoolHello,
    AllocRegion,
    FreeRegion,
    ReattachRegions,
    ListRegions,
    PoolStats,
);

replies!(
    Welcome,
    Reattached,
    HeartbeatReply,
    RegionGranted,
    RegionReturned,
    RegionMap,
    RegisterReply,
    LookupReply,
    ExistsReply,
    UnpinReply,
    DeleteReply,
    StatsReply,
    SessionEnded,
    PoolWelcome,
    RegionAllocated,
    RegionFreed,
    RegionsReattached,
    RegionList,
    PoolStatsReply,
    ErrorReply,
);

/// `ArchivedRequest` for kinds whose mutability is fixed by the kind.
macro_rules! fixed_mutability {
    ($($name:ident => $archived:ident),* $(,)?) => {
        $(
            impl ArchivedRequest for $archived {
                fn meta(&self) -> RequestMeta {
                    (&self.meta).into()
                }

                fn is_mutating(&self) -> bool {
                    Kind::$name.always_mutating()
                }
            }
        )*
    };
}

fixed_mutability!(
    Hello => ArchivedHello,
    Reattach => ArchivedReattach,
    Heartbeat => ArchivedHeartbeat,
    RequestRegion => ArchivedRequestRegion,
    ReturnRegion => ArchivedReturnRegion,
    MapRegion => ArchivedMapRegion,
    Register => ArchivedRegister,
    Exists => ArchivedExists,
    Unpin => ArchivedUnpin,
    Delete => ArchivedDelete,
    Stats => ArchivedStats,
    EndSession => ArchivedEndSession,
    PoolHello => ArchivedPoolHello,
    AllocRegion => ArchivedAllocRegion,
    FreeRegion => ArchivedFreeRegion,
    ReattachRegions => ArchivedReattachRegions,
    ListRegions => ArchivedListRegions,
    PoolStats => ArchivedPoolStats,
);

impl ArchivedRequest for ArchivedLookup {
    fn meta(&self) -> RequestMeta {
        (&self.meta).into()
    }

    /// A lookup that takes pins changes state (the pins) and must not take
    /// them twice when retried.
    fn is_mutating(&self) -> bool {
        self.pins() > 0
    }
}

macro_rules! directory_replies {
    ($($archived:ident),* $(,)?) => {
        $(
            impl ArchivedDirectoryReply for $archived {
                fn reply_meta(&self) -> &ArchivedReplyMeta {
                    &self.meta
                }
            }
        )*
    };
}

directory_replies!(
    ArchivedWelcome,
    ArchivedHeartbeatReply,
    ArchivedRegionGranted,
    ArchivedRegionReturned,
    ArchivedRegionMap,
    ArchivedRegisterReply,
    ArchivedLookupReply,
    ArchivedExistsReply,
    ArchivedUnpinReply,
    ArchivedDeleteReply,
    ArchivedStatsReply,
    ArchivedSessionEnded,
);

impl ArchivedDirectoryReply for ArchivedReattached {
    fn reply_meta(&self) -> &ArchivedReplyMeta {
        &self.welcome.meta
    }
}
