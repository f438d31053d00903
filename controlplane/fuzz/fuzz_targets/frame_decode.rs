//! Arbitrary bytes, as a peer could send them, through everything a receiver
//! runs before its handler: the frame decoder (fed in chunks, to exercise
//! reassembly), then checked access of each payload as the kind its header
//! names and as one other kind.
//!
//! Beyond "no panic", it checks two properties:
//! - a fatal decode error is only ever a corrupt header, and a rejected
//!   frame always maps to an error reply;
//! - anything accepted is a real message: it deserializes, re-encodes, and
//!   the re-encoded frame is accepted again with equal contents.

#![no_main]

use cxlkv_controlplane::frame::{Decoded, Frame, FrameDecoder, FrameHeader, HEADER_BYTES};
use cxlkv_controlplane::proto::{self, AnyReply, AnyRequest, Kind, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The stream arrives in pieces of a size derived from (not taken out
    // of) the input, so that a seed that is a valid frame stays one.
    let hash = data.iter().fold(0usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(*b))
    });
    let piece = 1 + hash % 256;
    let mut decoder = FrameDecoder::new();
    for chunk in data.chunks(piece) {
        decoder.push(chunk);
        loop {
            match decoder.decode() {
                Ok(Some(Decoded::Frame(frame))) => check_frame(frame, hash),
                Ok(Some(Decoded::Rejected { error, .. })) => {
                    assert!(!error.is_fatal(), "a rejected frame keeps the connection");
                    let reply = proto::ProtoError::from(error).to_reply();
                    assert!(reply.error_code().is_some());
                }
                Ok(None) => break,
                Err(error) => {
                    assert!(error.is_fatal(), "decode errors close the connection");
                    return;
                }
            }
        }
    }
});

/// The payload under its own kind, then under one other kind picked by the
/// input's hash: every archived type's checked access sees payloads built
/// for other types, without paying for all kinds on every input (the
/// fuzzer also mutates the header's kind field itself).
fn check_frame(frame: Frame<'_>, hash: usize) {
    decode_as(frame);
    let other = Kind::ALL[hash / 256 % Kind::ALL.len()];
    if other.as_u16() != frame.header.kind {
        decode_as(Frame {
            header: FrameHeader {
                kind: other.as_u16(),
                ..frame.header
            },
            ..frame
        });
    }
}

fn decode_as(frame: Frame<'_>) {
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
    // An 8-aligned copy, as a receive buffer holds it (cheaper than a new
    // 64 KiB frame decoder per accepted message).
    let mut words = vec![0u64; out.len().div_ceil(8)];
    // SAFETY: `u64` has no padding and any byte written leaves a valid
    // `u64`; `out.len() <= words.len() * 8` by construction; the slice
    // borrows `words` uniquely.
    let aligned: &mut [u8] =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), out.len()) };
    aligned.copy_from_slice(&out);
    let header = FrameHeader::decode(aligned[..HEADER_BYTES].try_into().expect("24 bytes"))
        .expect("a re-encoded header is intact");
    assert_eq!(header.kind, M::KIND.as_u16());
    let payload = &aligned[HEADER_BYTES..HEADER_BYTES + header.payload_len as usize];
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
