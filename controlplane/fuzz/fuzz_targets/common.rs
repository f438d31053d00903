//! Helpers shared by the protocol fuzz targets (`mod common;` in each): the
//! re-encode check every accepted message goes through, and an 8-aligned
//! buffer to hold payloads as a receive buffer would.

use cxlkv_controlplane::frame::{Frame, FrameHeader, HEADER_BYTES};
use cxlkv_controlplane::proto::{self, AnyReply, AnyRequest, Message};

/// Bytes in 8-aligned storage, as the frame decoder's receive buffer holds
/// them (rkyv's checked access refuses a misaligned payload outright, which
/// would hide everything behind it from the fuzzer).
pub struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    pub fn new(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `u64` has no padding and every byte pattern is a valid
        // `u64`; the view covers `bytes.len() <= words.len() * 8` bytes of
        // `words`, which it borrows uniquely for the copy.
        let view: &mut [u8] =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), bytes.len()) };
        view.copy_from_slice(bytes);
        Self {
            words,
            len: bytes.len(),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: as in `new`: `len <= words.len() * 8`, and the shared view
        // borrows `self.words` for its lifetime.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Both decoders on one frame. Anything accepted must be a real message:
/// mutating requests carry a `seq`, and the message deserializes, re-encodes
/// and is accepted again with equal contents. Refusals must map to an error
/// reply.
pub fn decode_as(frame: Frame<'_>) {
    match proto::decode_request(frame) {
        Ok(request) => {
            let meta = request.meta();
            if request.is_mutating() {
                assert_ne!(meta.seq, 0, "validated mutating requests carry a seq");
            }
            reencode_request(request);
        }
        Err(e) => drop(e.to_reply()),
    }
    match proto::decode_reply(frame) {
        Ok(reply) => reencode_reply(reply),
        Err(e) => drop(e.to_reply()),
    }
}

fn reencode<M: Message + PartialEq + std::fmt::Debug>(archived: &proto::Archived<M>) {
    let owned = proto::deserialize::<M>(archived).expect("a validated archive deserializes");
    let mut out = Vec::new();
    proto::encode(7, &owned, &mut out).expect("a validated message re-encodes");
    let aligned = Aligned::new(&out);
    let bytes = aligned.bytes();
    let header = FrameHeader::decode(bytes[..HEADER_BYTES].try_into().expect("24 bytes"))
        .expect("a re-encoded header is intact");
    assert_eq!(header.kind, M::KIND.as_u16());
    let payload = &bytes[HEADER_BYTES..HEADER_BYTES + header.payload_len as usize];
    let again =
        proto::access::<M>(Frame { header, payload }).expect("a re-encoded message validates");
    let again = proto::deserialize::<M>(again).expect("and deserializes");
    assert_eq!(again, owned);
}

macro_rules! reencode_any {
    ($fn_name:ident, $any:ident, [$($name:ident),* $(,)?]) => {
        fn $fn_name(any: $any<'_>) {
            match any {
                $($any::$name(archived) => reencode::<proto::$name>(archived),)*
            }
        }
    };
}

reencode_any!(
    reencode_request,
    AnyRequest,
    [
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
    ]
);

reencode_any!(
    reencode_reply,
    AnyReply,
    [
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
    ]
);
