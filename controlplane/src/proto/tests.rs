use std::fmt::Debug;

use proptest::prelude::*;

use super::samples;
use super::*;
use crate::frame::{self, Decoded, Frame, FrameDecoder, FrameError, FrameHeader, HEADER_BYTES};

/// Runs `f` on the single frame in `bytes`, decoded by a `FrameDecoder` as
/// the transport would.
fn with_frame<R>(bytes: &[u8], f: impl FnOnce(Frame<'_>) -> R) -> R {
    let mut decoder = FrameDecoder::new();
    decoder.push(bytes);
    match decoder.decode() {
        Ok(Some(Decoded::Frame(frame))) => f(frame),
        other => panic!("expected one whole frame, got {other:?}"),
    }
}

/// An 8-aligned copy of arbitrary bytes, as a receive buffer would hold them.
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn new(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (i, b) in bytes.iter().enumerate() {
            words[i / 8] |= u64::from(*b) << (8 * (i % 8));
        }
        Self {
            words,
            len: bytes.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `u64` has no padding and every byte of it is initialised;
        // `len <= words.len() * 8` by construction; the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    /// A frame of `kind` carrying these bytes as its payload.
    fn frame(&self, kind: u16) -> Frame<'_> {
        let header = FrameHeader {
            version: frame::PROTOCOL_VERSION,
            kind,
            request_id: 1,
            payload_len: self.len as u32,
        };
        Frame {
            header,
            payload: self.bytes(),
        }
    }
}

fn encoded<M: Message>(msg: &M) -> Vec<u8> {
    let mut out = Vec::new();
    encode(9, msg, &mut out).expect("test messages encode");
    out
}

fn payload_of(frame_bytes: &[u8]) -> &[u8] {
    let header = FrameHeader::decode(frame_bytes[..HEADER_BYTES].try_into().unwrap()).unwrap();
    &frame_bytes[HEADER_BYTES..HEADER_BYTES + header.payload_len as usize]
}

/// Encodes `msg`, decodes it through the frame decoder and checked access,
/// and returns the validation error it must produce.
fn rejection<M: Message>(msg: &M) -> ProtoError {
    let bytes = encoded(msg);
    with_frame(&bytes, |frame| match access::<M>(frame) {
        Ok(archived) => panic!("{:?} was accepted: {archived:?}", M::KIND),
        Err(e) => e,
    })
}

fn accepts<M: Message>(msg: &M) {
    let bytes = encoded(msg);
    with_frame(&bytes, |frame| {
        if let Err(e) = access::<M>(frame) {
            panic!("{:?} was refused: {e}", M::KIND);
        }
    });
}

/// The error maps to `code`, its reply carries `limit`, and the message
/// names the limit (`limit_name`).
fn assert_reply(e: &ProtoError, code: ErrorCode, limit: u64, limit_name: &str) {
    let reply = e.to_reply();
    assert_eq!(reply.error_code(), Some(code), "{e}");
    assert_eq!(reply.limit, limit, "{e}");
    assert!(
        reply.message.contains(limit_name),
        "message {:?} should name {limit_name}",
        reply.message
    );
}

fn round_trip<M>(msg: M)
where
    M: Message + PartialEq + Debug,
{
    let mut out = vec![0xEE; 16]; // frames are appended after whatever is queued
    let len = encode(0xABCD, &msg, &mut out).unwrap();
    assert_eq!(
        &out[..16],
        &[0xEE; 16],
        "encode must not touch queued bytes"
    );
    assert_eq!(len, out.len() - 16);
    assert_eq!(len % frame::FRAME_ALIGN, 0);
    with_frame(&out[16..], |frame| {
        assert_eq!(frame.header.kind, M::KIND.as_u16());
        assert_eq!(frame.header.request_id, 0xABCD);
        let archived = access::<M>(frame).unwrap();
        assert_eq!(deserialize::<M>(archived).unwrap(), msg);
        if M::KIND.is_request() {
            assert_eq!(decode_request(frame).unwrap().kind(), M::KIND);
            assert!(decode_reply(frame).is_err());
        } else {
            assert_eq!(decode_reply(frame).unwrap().kind(), M::KIND);
            assert!(decode_request(frame).is_err());
        }
    });
}

/// Calls generic function `$f` on the sample message of every kind.
macro_rules! each_sample {
    ($f:ident) => {
        $f(samples::hello());
        $f(samples::reattach());
        $f(samples::heartbeat());
        $f(samples::request_region());
        $f(samples::return_region());
        $f(samples::map_region());
        $f(samples::register());
        $f(samples::lookup());
        $f(samples::exists());
        $f(samples::unpin());
        $f(samples::delete());
        $f(samples::stats());
        $f(samples::end_session());
        $f(samples::pool_hello());
        $f(samples::alloc_region());
        $f(samples::free_region());
        $f(samples::reattach_regions());
        $f(samples::list_regions());
        $f(samples::pool_stats());
        $f(samples::welcome());
        $f(samples::reattached());
        $f(samples::heartbeat_reply());
        $f(samples::region_granted());
        $f(samples::region_returned());
        $f(samples::region_map());
        $f(samples::register_reply());
        $f(samples::lookup_reply());
        $f(samples::exists_reply());
        $f(samples::unpin_reply());
        $f(samples::delete_reply());
        $f(samples::stats_reply());
        $f(samples::session_ended());
        $f(samples::pool_welcome());
        $f(samples::region_allocated());
        $f(samples::region_freed());
        $f(samples::regions_reattached());
        $f(samples::region_list());
        $f(samples::pool_stats_reply());
        $f(samples::error_reply());
    };
}

#[test]
fn every_message_kind_round_trips_through_the_frame_decoder() {
    each_sample!(round_trip);
}

#[test]
fn samples_cover_every_kind_and_decode_back_to_back_in_one_stream() {
    let frames = samples::frames();
    let kinds: Vec<Kind> = frames.iter().map(|(k, _)| *k).collect();
    assert_eq!(kinds, Kind::ALL.to_vec());
    let stream: Vec<u8> = frames
        .iter()
        .flat_map(|(_, bytes)| bytes.iter().copied())
        .collect();
    let mut decoder = FrameDecoder::new();
    decoder.push(&stream);
    let mut seen = Vec::new();
    while let Some(Decoded::Frame(frame)) = decoder.decode().unwrap() {
        let kind = Kind::from_u16(frame.header.kind).unwrap();
        if kind.is_request() {
            decode_request(frame).unwrap();
        } else {
            decode_reply(frame).unwrap();
        }
        seen.push(kind);
    }
    assert_eq!(seen, Kind::ALL.to_vec());
}

#[test]
fn keys_are_slices_into_the_receive_buffer() {
    let bytes = encoded(&samples::lookup());
    with_frame(&bytes, |frame| {
        let lookup = access::<Lookup>(frame).unwrap();
        let range = frame.payload.as_ptr_range();
        let keys: Vec<&[u8]> = lookup.keys().collect();
        assert_eq!(
            keys,
            samples::lookup()
                .keys
                .iter()
                .map(Vec::as_slice)
                .collect::<Vec<_>>()
        );
        for key in keys {
            assert!(
                range.contains(&key.as_ptr()),
                "key must borrow the payload, not a copy"
            );
        }
        assert_eq!(lookup.layout(), samples::lookup().layout);
        assert_eq!(lookup.meta(), samples::lookup().meta);
    });
}

#[test]
fn archived_accessors_give_plain_values() {
    let register = samples::register();
    let bytes = encoded(&register);
    with_frame(&bytes, |frame| {
        let archived = access::<Register>(frame).unwrap();
        let entries: Vec<(Vec<u8>, Location)> =
            archived.entries().map(|(k, l)| (k.to_vec(), l)).collect();
        let expected: Vec<(Vec<u8>, Location)> = register
            .entries
            .iter()
            .map(|e| (e.key.clone(), e.location))
            .collect();
        assert_eq!(entries, expected);
    });
    let unpin = samples::unpin();
    let bytes = encoded(&unpin);
    with_frame(&bytes, |frame| {
        let archived = access::<Unpin>(frame).unwrap();
        let pairs: Vec<(Vec<u8>, u32)> = archived.pairs().map(|(k, c)| (k.to_vec(), c)).collect();
        let expected: Vec<(Vec<u8>, u32)> = unpin
            .keys
            .iter()
            .cloned()
            .zip(unpin.counts.iter().copied())
            .collect();
        assert_eq!(pairs, expected);
    });
    let reply = samples::lookup_reply();
    let bytes = encoded(&reply);
    with_frame(&bytes, |frame| {
        let archived = access::<LookupReply>(frame).unwrap();
        assert_eq!(archived.locations().collect::<Vec<_>>(), reply.locations);
        assert_eq!(archived.regions().collect::<Vec<_>>(), reply.regions);
        assert_eq!(
            archived.reply_meta().notices().collect::<Vec<_>>(),
            reply.meta.notices
        );
    });
    let reply = samples::exists_reply();
    let bytes = encoded(&reply);
    with_frame(&bytes, |frame| {
        let archived = access::<ExistsReply>(frame).unwrap();
        assert_eq!(
            archived.present.iter().collect::<Vec<_>>(),
            vec![true, false, true]
        );
        assert_eq!(archived.present.get(3), None);
    });
}

#[test]
fn access_reply_returns_the_expected_reply_or_the_error_reply() {
    let ok = encoded(&samples::region_freed());
    with_frame(&ok, |frame| {
        let reply = access_reply::<RegionFreed>(frame).unwrap().unwrap();
        assert_eq!(reply.region.to_native(), 7);
    });
    let err = encoded(&samples::error_reply());
    with_frame(&err, |frame| {
        let reply = access_reply::<RegionFreed>(frame).unwrap().unwrap_err();
        assert_eq!(reply.error_code(), Some(ErrorCode::KeyTooLong));
        assert_eq!(reply.limit(), 512);
    });
    let other = encoded(&samples::heartbeat_reply());
    with_frame(&other, |frame| {
        let e = access_reply::<RegionFreed>(frame).unwrap_err();
        assert!(matches!(
            e,
            ProtoError::UnexpectedKind {
                expected: Kind::RegionFreed,
                ..
            }
        ));
        assert_eq!(e.code(), ErrorCode::UnknownKind);
    });
}

#[test]
fn lookup_is_mutating_only_when_it_takes_pins() {
    let pinning = encoded(&samples::lookup());
    with_frame(&pinning, |frame| {
        assert!(decode_request(frame).unwrap().is_mutating())
    });
    let plain = Lookup {
        meta: RequestMeta::default(),
        pins: 0,
        ..samples::lookup()
    };
    let plain = encoded(&plain);
    with_frame(&plain, |frame| {
        assert!(!decode_request(frame).unwrap().is_mutating())
    });
}

#[test]
fn kind_numbers_are_stable_and_paired() {
    let table: [(Kind, u16); 39] = [
        (Kind::Hello, 0x0101),
        (Kind::Reattach, 0x0102),
        (Kind::Heartbeat, 0x0103),
        (Kind::RequestRegion, 0x0111),
        (Kind::ReturnRegion, 0x0112),
        (Kind::MapRegion, 0x0113),
        (Kind::Register, 0x0121),
        (Kind::Lookup, 0x0122),
        (Kind::Exists, 0x0123),
        (Kind::Unpin, 0x0124),
        (Kind::Delete, 0x0125),
        (Kind::Stats, 0x0131),
        (Kind::EndSession, 0x0132),
        (Kind::PoolHello, 0x0201),
        (Kind::AllocRegion, 0x0211),
        (Kind::FreeRegion, 0x0212),
        (Kind::ReattachRegions, 0x0213),
        (Kind::ListRegions, 0x0214),
        (Kind::PoolStats, 0x0221),
        (Kind::Welcome, 0x8101),
        (Kind::Reattached, 0x8102),
        (Kind::HeartbeatReply, 0x8103),
        (Kind::RegionGranted, 0x8111),
        (Kind::RegionReturned, 0x8112),
        (Kind::RegionMap, 0x8113),
        (Kind::RegisterReply, 0x8121),
        (Kind::LookupReply, 0x8122),
        (Kind::ExistsReply, 0x8123),
        (Kind::UnpinReply, 0x8124),
        (Kind::DeleteReply, 0x8125),
        (Kind::StatsReply, 0x8131),
        (Kind::SessionEnded, 0x8132),
        (Kind::PoolWelcome, 0x8201),
        (Kind::RegionAllocated, 0x8211),
        (Kind::RegionFreed, 0x8212),
        (Kind::RegionsReattached, 0x8213),
        (Kind::RegionList, 0x8214),
        (Kind::PoolStatsReply, 0x8221),
        (Kind::ErrorReply, 0xFFFF),
    ];
    assert_eq!(table.map(|(k, _)| k), Kind::ALL);
    for (kind, number) in table {
        assert_eq!(kind.as_u16(), number, "{kind:?}");
        assert_eq!(Kind::from_u16(number), Some(kind));
        if kind.is_request() {
            let reply = kind
                .reply()
                .unwrap_or_else(|| panic!("{kind:?} has no reply kind"));
            assert_eq!(reply.request(), Some(kind));
            assert_eq!(reply.service(), kind.service());
            assert!(kind.service().is_some());
        } else if kind != Kind::ErrorReply {
            assert!(kind.request().is_some(), "{kind:?} answers no request");
        }
    }
    assert_eq!(Kind::from_u16(0), None);
    assert_eq!(Kind::from_u16(0x0104), None);
}

#[test]
fn error_codes_are_stable_numbered_and_named() {
    let numbers: Vec<u16> = ErrorCode::ALL.iter().map(|c| c.as_u16()).collect();
    assert_eq!(
        numbers,
        (1..=27).collect::<Vec<u16>>(),
        "codes are 1.. in order, never renumbered"
    );
    let pinned = [
        (ErrorCode::Malformed, 1),
        (ErrorCode::UnsupportedVersion, 2),
        (ErrorCode::FrameTooLarge, 3),
        (ErrorCode::KeyTooLong, 4),
        (ErrorCode::BatchTooLarge, 5),
        (ErrorCode::UnknownKind, 6),
        (ErrorCode::UnknownRegion, 7),
        (ErrorCode::NotOwner, 8),
        (ErrorCode::BadToken, 9),
        (ErrorCode::WrongLayout, 10),
        (ErrorCode::QuotaExceeded, 11),
        (ErrorCode::OutOfSpace, 12),
        (ErrorCode::AuthenticationRequired, 13),
        (ErrorCode::AuthenticationFailed, 14),
        (ErrorCode::SessionEnded, 15),
        (ErrorCode::Busy, 16),
        (ErrorCode::Timeout, 17),
        (ErrorCode::SequenceTooOld, 18),
        (ErrorCode::InvalidArgument, 19),
        (ErrorCode::Internal, 20),
        (ErrorCode::HelloRequired, 21),
        (ErrorCode::InstanceInUse, 22),
        (ErrorCode::InstanceGone, 23),
        (ErrorCode::ReplyEvicted, 24),
        (ErrorCode::PinsHeldByOtherSession, 25),
        (ErrorCode::RegionNotEmpty, 26),
        (ErrorCode::OwnershipNotProven, 27),
    ];
    for (code, number) in pinned {
        assert_eq!(code.as_u16(), number);
        assert_eq!(ErrorCode::from_u16(number), Some(code));
        assert!(!code.message().is_empty());
    }
    let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), ErrorCode::ALL.len(), "names are unique");
    assert_eq!(ErrorCode::from_u16(0), None);
    assert_eq!(ErrorCode::from_u16(999), None);
}

#[test]
fn an_unknown_error_code_from_a_newer_peer_still_decodes() {
    let reply = ErrorReply {
        code: 999,
        message: "something new".into(),
        limit: 0,
    };
    let bytes = encoded(&reply);
    with_frame(&bytes, |frame| {
        let archived = access::<ErrorReply>(frame).unwrap();
        assert_eq!(archived.code(), 999);
        assert_eq!(archived.error_code(), None);
        assert_eq!(archived.message(), "something new");
    });
}

fn long_key() -> Vec<u8> {
    vec![7u8; MAX_KEY_BYTES + 1]
}

#[test]
fn a_key_over_max_key_bytes_is_refused_with_its_limit() {
    let mut lookup = samples::lookup();
    lookup.keys[1] = vec![1u8; MAX_KEY_BYTES];
    accepts(&lookup);
    lookup.keys[1] = long_key();
    let e = rejection(&lookup);
    assert!(
        matches!(
            e,
            ProtoError::KeyTooLong {
                index: 1,
                len_bytes: 513,
                max: 512,
                ..
            }
        ),
        "{e}"
    );
    assert_reply(
        &e,
        ErrorCode::KeyTooLong,
        MAX_KEY_BYTES as u64,
        "MAX_KEY_BYTES",
    );

    let mut register = samples::register();
    register.entries[2].key = long_key();
    assert_reply(
        &rejection(&register),
        ErrorCode::KeyTooLong,
        512,
        "MAX_KEY_BYTES",
    );
    let mut exists = samples::exists();
    exists.keys[0] = long_key();
    assert_reply(
        &rejection(&exists),
        ErrorCode::KeyTooLong,
        512,
        "MAX_KEY_BYTES",
    );
    let mut unpin = samples::unpin();
    unpin.keys[0] = long_key();
    assert_reply(
        &rejection(&unpin),
        ErrorCode::KeyTooLong,
        512,
        "MAX_KEY_BYTES",
    );
    let mut delete = samples::delete();
    delete.keys[0] = long_key();
    assert_reply(
        &rejection(&delete),
        ErrorCode::KeyTooLong,
        512,
        "MAX_KEY_BYTES",
    );
}

#[test]
fn a_batch_over_max_batch_is_refused_with_its_limit() {
    let keys = |n: usize| {
        (0..n)
            .map(|i| (i as u32).to_le_bytes().to_vec())
            .collect::<Vec<_>>()
    };
    let max = MAX_BATCH as u64;

    accepts(&Lookup {
        keys: keys(MAX_BATCH),
        ..samples::lookup()
    });
    let e = rejection(&Lookup {
        keys: keys(MAX_BATCH + 1),
        ..samples::lookup()
    });
    assert!(
        matches!(
            e,
            ProtoError::BatchTooLarge {
                field: "keys",
                len: 4097,
                ..
            }
        ),
        "{e}"
    );
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");

    let e = rejection(&Exists {
        keys: keys(MAX_BATCH + 1),
        ..samples::exists()
    });
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");
    let e = rejection(&Delete {
        keys: keys(MAX_BATCH + 1),
        ..samples::delete()
    });
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");
    let e = rejection(&Unpin {
        keys: keys(MAX_BATCH + 1),
        counts: vec![1; MAX_BATCH + 1],
        ..samples::unpin()
    });
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");
    let entries = keys(MAX_BATCH + 1)
        .into_iter()
        .map(|key| RegisterEntry {
            key,
            location: samples::lookup_reply().locations[0].unwrap(),
        })
        .collect();
    let e = rejection(&Register {
        entries,
        ..samples::register()
    });
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");
    let e = rejection(&MapRegion {
        regions: vec![1; MAX_BATCH + 1],
        ..samples::map_region()
    });
    assert_reply(&e, ErrorCode::BatchTooLarge, max, "MAX_BATCH");

    let regions = vec![samples::reattach().regions[0].clone(); MAX_REATTACH_REGIONS + 1];
    let e = rejection(&Reattach {
        regions,
        ..samples::reattach()
    });
    assert_reply(
        &e,
        ErrorCode::BatchTooLarge,
        MAX_REATTACH_REGIONS as u64,
        "MAX_REATTACH_REGIONS",
    );
    let handles = vec![samples::region_list().handles[0].clone(); MAX_REATTACH_REGIONS + 1];
    let e = rejection(&ReattachRegions {
        handles,
        ..samples::reattach_regions()
    });
    assert_reply(
        &e,
        ErrorCode::BatchTooLarge,
        MAX_REATTACH_REGIONS as u64,
        "MAX_REATTACH_REGIONS",
    );
}

#[test]
fn reply_lists_over_their_limits_are_refused() {
    let mut reply = samples::heartbeat_reply();
    reply.meta.notices = vec![reply.meta.notices[0]; MAX_NOTICES_PER_REPLY + 1];
    let e = rejection(&reply);
    assert_reply(
        &e,
        ErrorCode::BatchTooLarge,
        MAX_NOTICES_PER_REPLY as u64,
        "MAX_NOTICES_PER_REPLY",
    );

    let reply = LookupReply {
        locations: vec![None; MAX_BATCH + 1],
        ..samples::lookup_reply()
    };
    assert_reply(
        &rejection(&reply),
        ErrorCode::BatchTooLarge,
        MAX_BATCH as u64,
        "MAX_BATCH",
    );

    let mut reply = samples::stats_reply();
    reply.sessions = vec![reply.sessions[0].clone(); MAX_STATS_ROWS + 1];
    assert_reply(
        &rejection(&reply),
        ErrorCode::BatchTooLarge,
        MAX_STATS_ROWS as u64,
        "MAX_STATS_ROWS",
    );

    let mut reply = samples::pool_stats_reply();
    reply.pools[0].owners = vec![reply.pools[0].owners[0].clone(); MAX_POOL_OWNERS + 1];
    assert_reply(
        &rejection(&reply),
        ErrorCode::BatchTooLarge,
        MAX_POOL_OWNERS as u64,
        "MAX_POOL_OWNERS",
    );
}

#[test]
fn pins_and_unpin_counts_are_bounded_and_consistent() {
    let limit = MAX_PINS_PER_KEY as u64;
    accepts(&Lookup {
        pins: MAX_PINS_PER_KEY as u32,
        ..samples::lookup()
    });
    let e = rejection(&Lookup {
        pins: MAX_PINS_PER_KEY as u32 + 1,
        ..samples::lookup()
    });
    assert!(
        matches!(e, ProtoError::InvalidValue { field: "pins", .. }),
        "{e}"
    );
    assert_reply(&e, ErrorCode::InvalidArgument, limit, "MAX_PINS_PER_KEY");

    let e = rejection(&Unpin {
        counts: vec![1, 0, 1],
        ..samples::unpin()
    });
    assert_reply(&e, ErrorCode::InvalidArgument, limit, "MAX_PINS_PER_KEY");
    let e = rejection(&Unpin {
        counts: vec![1, MAX_PINS_PER_KEY as u32 + 1, 1],
        ..samples::unpin()
    });
    assert_reply(&e, ErrorCode::InvalidArgument, limit, "MAX_PINS_PER_KEY");

    let e = rejection(&Unpin {
        counts: vec![1, 1],
        ..samples::unpin()
    });
    assert!(
        matches!(
            e,
            ProtoError::LengthMismatch {
                field: "counts",
                len: 2,
                expected: 3,
                ..
            }
        ),
        "{e}"
    );
    assert_reply(&e, ErrorCode::InvalidArgument, 3, "counts");
}

#[test]
fn mutating_requests_need_a_seq_and_read_only_ones_refuse_one() {
    let none = RequestMeta::default();
    let some = RequestMeta {
        seq: 5,
        ..RequestMeta::default()
    };
    let seq_required = |e: ProtoError| {
        assert!(matches!(e, ProtoError::SeqRequired { .. }), "{e}");
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
    };
    seq_required(rejection(&Register {
        meta: none,
        ..samples::register()
    }));
    seq_required(rejection(&Lookup {
        meta: none,
        ..samples::lookup()
    }));
    seq_required(rejection(&Unpin {
        meta: none,
        ..samples::unpin()
    }));
    seq_required(rejection(&Delete {
        meta: none,
        ..samples::delete()
    }));
    seq_required(rejection(&RequestRegion {
        meta: none,
        ..samples::request_region()
    }));
    seq_required(rejection(&ReturnRegion {
        meta: none,
        ..samples::return_region()
    }));
    seq_required(rejection(&EndSession {
        meta: none,
        ..samples::end_session()
    }));
    seq_required(rejection(&AllocRegion {
        meta: none,
        ..samples::alloc_region()
    }));
    seq_required(rejection(&FreeRegion {
        meta: none,
        ..samples::free_region()
    }));

    let seq_refused = |e: ProtoError| {
        assert!(matches!(e, ProtoError::SeqNotAllowed { seq: 5, .. }), "{e}");
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
    };
    seq_refused(rejection(&Lookup {
        meta: some,
        pins: 0,
        ..samples::lookup()
    }));
    seq_refused(rejection(&Exists {
        meta: some,
        ..samples::exists()
    }));
    seq_refused(rejection(&Hello {
        meta: some,
        ..samples::hello()
    }));
    seq_refused(rejection(&Reattach {
        meta: some,
        ..samples::reattach()
    }));
    seq_refused(rejection(&Heartbeat { meta: some }));
    seq_refused(rejection(&MapRegion {
        meta: some,
        ..samples::map_region()
    }));
    seq_refused(rejection(&Stats {
        meta: some,
        ..samples::stats()
    }));
    seq_refused(rejection(&PoolHello {
        meta: some,
        ..samples::pool_hello()
    }));
    seq_refused(rejection(&ReattachRegions {
        meta: some,
        ..samples::reattach_regions()
    }));
    seq_refused(rejection(&ListRegions {
        meta: some,
        ..samples::list_regions()
    }));
    seq_refused(rejection(&PoolStats { meta: some }));

    let acked = RequestMeta {
        seq: 8,
        notice_ack: 3,
        replies_received_below: 0,
    };
    let e = rejection(&AllocRegion {
        meta: acked,
        ..samples::alloc_region()
    });
    assert!(
        matches!(
            e,
            ProtoError::InvalidValue {
                field: "meta.notice_ack",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_receipt_claim_past_its_own_seq_or_on_a_read_only_request_is_refused() {
    let claim = |seq, below| RequestMeta {
        seq,
        notice_ack: 0,
        replies_received_below: below,
    };
    accepts(&Delete {
        meta: claim(9, 9),
        ..samples::delete()
    });
    let e = rejection(&Delete {
        meta: claim(9, 10),
        ..samples::delete()
    });
    assert!(
        matches!(
            e,
            ProtoError::InvalidValue {
                field: "meta.replies_received_below",
                value: 10,
                limit: 9,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let e = rejection(&Exists {
        meta: claim(0, 3),
        ..samples::exists()
    });
    assert!(
        matches!(
            e,
            ProtoError::InvalidValue {
                field: "meta.replies_received_below",
                ..
            }
        ),
        "{e}"
    );
    // The pool manager keeps its own cache: no claims there.
    let e = rejection(&FreeRegion {
        meta: claim(9, 2),
        ..samples::free_region()
    });
    assert!(
        matches!(
            e,
            ProtoError::InvalidValue {
                field: "meta.replies_received_below",
                limit: 0,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_reattach_without_a_next_seq_is_refused() {
    let e = rejection(&Reattach {
        next_seq: 0,
        ..samples::reattach()
    });
    assert!(
        matches!(
            e,
            ProtoError::InvalidValue {
                field: "next_seq",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
}

#[test]
fn strings_and_secrets_over_their_limits_are_refused() {
    let long = |n: usize| "x".repeat(n);
    accepts(&Hello {
        instance_id: long(MAX_NAME_BYTES),
        ..samples::hello()
    });
    let e = rejection(&Hello {
        instance_id: long(MAX_NAME_BYTES + 1),
        ..samples::hello()
    });
    assert!(
        matches!(
            e,
            ProtoError::FieldTooLong {
                field: "instance_id",
                ..
            }
        ),
        "{e}"
    );
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_NAME_BYTES as u64,
        "MAX_NAME_BYTES",
    );
    let e = rejection(&Hello {
        client_name: long(MAX_NAME_BYTES + 1),
        ..samples::hello()
    });
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_NAME_BYTES as u64,
        "MAX_NAME_BYTES",
    );
    let e = rejection(&Hello {
        client_secret: Some(vec![0; MAX_SECRET_BYTES + 1]),
        ..samples::hello()
    });
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_SECRET_BYTES as u64,
        "MAX_SECRET_BYTES",
    );
    let e = rejection(&PoolHello {
        directory_id: long(MAX_NAME_BYTES + 1),
        ..samples::pool_hello()
    });
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_NAME_BYTES as u64,
        "MAX_NAME_BYTES",
    );
    let e = rejection(&PoolHello {
        directory_id: String::new(),
        ..samples::pool_hello()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let mut alloc = samples::alloc_region();
    alloc.owner.instance_id = long(MAX_NAME_BYTES + 1);
    assert_reply(
        &rejection(&alloc),
        ErrorCode::InvalidArgument,
        MAX_NAME_BYTES as u64,
        "MAX_NAME_BYTES",
    );
    let mut welcome = samples::welcome();
    welcome.pools[0].path = long(MAX_PATH_BYTES + 1);
    assert_reply(
        &rejection(&welcome),
        ErrorCode::InvalidArgument,
        MAX_PATH_BYTES as u64,
        "MAX_PATH_BYTES",
    );
    let e = rejection(&ErrorReply {
        code: 1,
        message: long(MAX_MESSAGE_BYTES + 1),
        limit: 0,
    });
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_MESSAGE_BYTES as u64,
        "MAX_MESSAGE_BYTES",
    );
}

#[test]
fn field_values_out_of_range_are_refused() {
    for page_size_bytes in [0, 4095, 4096 + 512, MAX_PAGE_BYTES + PAGE_QUANTUM_BYTES] {
        let layout = Layout {
            page_size_bytes,
            fingerprint: 1,
        };
        let e = rejection(&RequestRegion {
            layout,
            ..samples::request_region()
        });
        assert!(
            matches!(
                e,
                ProtoError::InvalidValue {
                    field: "layout.page_size_bytes",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
        let e = rejection(&Lookup {
            layout,
            ..samples::lookup()
        });
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
    }
    accepts(&RequestRegion {
        layout: Layout {
            page_size_bytes: MAX_PAGE_BYTES,
            fingerprint: 1,
        },
        ..samples::request_region()
    });
    let e = rejection(&Hello {
        protocol_min: 2,
        protocol_max: 1,
        ..samples::hello()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let e = rejection(&Stats {
        sections: 1 << 20,
        ..samples::stats()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let e = rejection(&Stats {
        max_rows: MAX_STATS_ROWS as u32 + 1,
        ..samples::stats()
    });
    assert_reply(
        &e,
        ErrorCode::InvalidArgument,
        MAX_STATS_ROWS as u64,
        "MAX_STATS_ROWS",
    );
    for max_handles in [0, MAX_LIST_REGIONS as u32 + 1] {
        let e = rejection(&ListRegions {
            max_handles,
            ..samples::list_regions()
        });
        assert_reply(
            &e,
            ErrorCode::InvalidArgument,
            MAX_LIST_REGIONS as u64,
            "MAX_LIST_REGIONS",
        );
    }
    let e = rejection(&AllocRegion {
        len_bytes: 0,
        ..samples::alloc_region()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let e = rejection(&Welcome {
        fds_passed: 2,
        ..samples::welcome()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let e = rejection(&PoolWelcome {
        fds_passed: 3,
        ..samples::pool_welcome()
    });
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
}

#[test]
fn exists_bitmaps_must_be_canonical() {
    let mut reply = samples::exists_reply();
    reply.present.words.push(0);
    let e = rejection(&reply);
    assert!(matches!(
        e,
        ProtoError::LengthMismatch {
            field: "present.words",
            len: 2,
            expected: 1,
            ..
        }
    ));
    let mut reply = samples::exists_reply();
    reply.present.words[0] |= 1 << 40;
    assert_eq!(rejection(&reply).code(), ErrorCode::InvalidArgument);
    let full: KeyBitmap = std::iter::repeat_n(true, 128).collect();
    accepts(&ExistsReply {
        present: full,
        ..samples::exists_reply()
    });
}

#[test]
fn key_bitmap_sets_and_gets_bits() {
    let mut bitmap = KeyBitmap::new(130);
    assert_eq!(bitmap.words.len(), 3);
    bitmap.set(0, true);
    bitmap.set(129, true);
    bitmap.set(64, true);
    bitmap.set(64, false);
    assert_eq!(bitmap.get(0), Some(true));
    assert_eq!(bitmap.get(64), Some(false));
    assert_eq!(bitmap.get(129), Some(true));
    assert_eq!(bitmap.get(130), None);
    let collected: KeyBitmap = (0..130).map(|i| i == 0 || i == 129).collect();
    assert_eq!(collected, bitmap);
}

#[test]
fn frame_errors_map_to_their_codes_and_limits() {
    let e = ProtoError::from(FrameError::UnsupportedVersion { found: 9 });
    assert_eq!(e.code(), ErrorCode::UnsupportedVersion);
    assert_eq!(e.limit(), u64::from(PROTOCOL_MAX));
    let e = ProtoError::from(FrameError::Oversized {
        payload_len: 1 << 30,
        max: frame::MAX_PAYLOAD_BYTES,
    });
    assert_reply(
        &e,
        ErrorCode::FrameTooLarge,
        frame::MAX_PAYLOAD_BYTES as u64,
        "limit",
    );
}

#[test]
fn version_negotiation_picks_the_highest_common_version() {
    assert_eq!(negotiate(1, 1).unwrap(), 1);
    assert_eq!(negotiate(1, 7).unwrap(), PROTOCOL_MAX);
    for (min, max) in [(2, 5), (3, 2)] {
        let e = negotiate(min, max).unwrap_err();
        assert!(matches!(e, ProtoError::NoCommonVersion { .. }), "{e}");
        assert_eq!(e.code(), ErrorCode::UnsupportedVersion);
        assert_eq!(e.limit(), u64::from(PROTOCOL_MAX));
    }
}

#[test]
fn error_reply_messages_are_cut_at_a_character_boundary() {
    let message = "é".repeat(MAX_MESSAGE_BYTES); // two bytes each
    let reply = ErrorReply::new(ErrorCode::Internal, message, 0);
    assert!(reply.message.len() <= MAX_MESSAGE_BYTES);
    assert!(reply.message.len() >= MAX_MESSAGE_BYTES - 1);
    accepts(&reply);
}

#[test]
fn secrets_compare_by_value_and_never_print() {
    let a = RegionToken([1; 32]);
    let mut other = [1; 32];
    assert_eq!(a, RegionToken(other));
    other[31] = 2;
    assert_ne!(a, RegionToken(other));
    assert!(!a.ct_eq(&other));
    assert_eq!(format!("{a:?}"), "RegionToken(<redacted>)");
    assert_eq!(
        format!("{:?}", InstanceSecret([9; 32])),
        "InstanceSecret(<redacted>)"
    );
    assert!(!format!("{:?}", samples::welcome()).contains("17, 17"));
}

#[test]
fn an_oversized_message_is_refused_by_the_encoder_and_leaves_the_buffer_intact() {
    // 20 000 keys of 512 bytes: ~10 MiB, over MAX_PAYLOAD_BYTES (8 MiB).
    let keys = vec![vec![0u8; MAX_KEY_BYTES]; 20_000];
    let msg = Exists {
        keys,
        ..samples::exists()
    };
    let mut out = encoded(&samples::heartbeat());
    let before = out.clone();
    let e = encode(1, &msg, &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            ProtoError::PayloadTooLarge {
                kind: Kind::Exists,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.code(), ErrorCode::FrameTooLarge);
    assert_eq!(out, before);
}

#[test]
#[should_panic(expected = "FRAME_ALIGN")]
fn encoding_after_a_misaligned_prefix_is_a_caller_bug() {
    let mut out = vec![0u8; 3];
    let _ = encode(1, &samples::heartbeat(), &mut out);
}

// --- The largest legal messages fit in one frame -------------------------

fn max_key(i: usize) -> Vec<u8> {
    let mut key = vec![b'k'; MAX_KEY_BYTES];
    key[..8].copy_from_slice(&(i as u64).to_le_bytes());
    key
}

fn max_name() -> String {
    "n".repeat(MAX_NAME_BYTES)
}

fn max_reply_meta() -> ReplyMeta {
    ReplyMeta {
        notices: vec![
            FreedPage {
                seq: u64::MAX,
                region: u64::MAX,
                page: u32::MAX,
                generation: u32::MAX
            };
            MAX_NOTICES_PER_REPLY
        ],
        usage: Usage::default(),
    }
}

fn max_handle() -> RegionHandle {
    RegionHandle {
        owner: OwnerLabel {
            directory_id: max_name(),
            instance_id: max_name(),
        },
        ..samples::region_list().handles[0].clone()
    }
}

/// Encodes `msg`, checks it decodes, and returns its payload size.
fn fits<M: Message>(msg: &M) -> usize {
    let mut out = Vec::new();
    let len = encode(1, msg, &mut out)
        .unwrap_or_else(|e| panic!("largest {:?} must encode: {e}", M::KIND));
    with_frame(&out, |frame| {
        access::<M>(frame).unwrap_or_else(|e| panic!("largest {:?} must validate: {e}", M::KIND));
    });
    let payload = len - HEADER_BYTES;
    assert!(payload <= frame::MAX_PAYLOAD_BYTES);
    println!("largest {:?}: {payload} payload bytes", M::KIND);
    payload
}

#[test]
fn the_largest_legal_batch_of_every_kind_fits_in_one_frame() {
    let keys: Vec<Vec<u8>> = (0..MAX_BATCH).map(max_key).collect();
    let location = Location {
        region: u64::MAX,
        page: u32::MAX,
        generation: u32::MAX,
        len_bytes: u32::MAX,
    };
    let desc = RegionDesc {
        region: u64::MAX,
        ..samples::region_granted().desc
    };
    let entries = keys
        .iter()
        .map(|key| RegisterEntry {
            key: key.clone(),
            location,
        })
        .collect();
    let register = fits(&Register {
        entries,
        ..samples::register()
    });
    // The claim `MAX_PAYLOAD_BYTES` was sized for: a full batch of full keys.
    assert!(register > MAX_BATCH * MAX_KEY_BYTES);
    fits(&Lookup {
        keys: keys.clone(),
        pins: MAX_PINS_PER_KEY as u32,
        ..samples::lookup()
    });
    fits(&Exists {
        keys: keys.clone(),
        ..samples::exists()
    });
    fits(&Delete {
        keys: keys.clone(),
        ..samples::delete()
    });
    fits(&Unpin {
        keys,
        counts: vec![MAX_PINS_PER_KEY as u32; MAX_BATCH],
        ..samples::unpin()
    });
    fits(&MapRegion {
        regions: vec![u64::MAX; MAX_BATCH],
        ..samples::map_region()
    });

    fits(&LookupReply {
        meta: max_reply_meta(),
        locations: vec![Some(location); MAX_BATCH],
        regions: vec![desc; MAX_BATCH],
    });
    fits(&RegisterReply {
        meta: max_reply_meta(),
        outcomes: vec![RegisterOutcome::Duplicate(location); MAX_BATCH],
    });
    fits(&RegionMap {
        meta: max_reply_meta(),
        descs: vec![Some(desc); MAX_BATCH],
    });
    fits(&ExistsReply {
        meta: max_reply_meta(),
        present: std::iter::repeat_n(true, MAX_BATCH).collect(),
    });
    fits(&UnpinReply {
        meta: max_reply_meta(),
        outcomes: vec![UnpinOutcome::NotPinned; MAX_BATCH],
    });
    fits(&DeleteReply {
        meta: max_reply_meta(),
        outcomes: vec![DeleteOutcome::Pinned { pins: 1 }; MAX_BATCH],
    });

    let max_pool = PoolInfo {
        path: "p".repeat(MAX_PATH_BYTES),
        ..samples::welcome().pools[0].clone()
    };
    let welcome = Welcome {
        meta: max_reply_meta(),
        instance_id: max_name(),
        directory_id: max_name(),
        pools: vec![max_pool.clone(); MAX_POOLS],
        fds_passed: MAX_POOLS as u32,
        ..samples::welcome()
    };
    fits(&welcome);
    fits(&Reattached {
        welcome,
        accepted: Vec::new(),
        refused: vec![
            RefusedRegion {
                region: u64::MAX,
                code: 9
            };
            MAX_REATTACH_REGIONS
        ],
        resumed: false,
        oldest_accepted_seq: u64::MAX,
    });
    fits(&Reattach {
        instance_id: max_name(),
        client_name: max_name(),
        client_secret: Some(vec![0; MAX_SECRET_BYTES]),
        regions: vec![samples::reattach().regions[0].clone(); MAX_REATTACH_REGIONS],
        ..samples::reattach()
    });
    fits(&ReattachRegions {
        handles: vec![max_handle(); MAX_REATTACH_REGIONS],
        ..samples::reattach_regions()
    });
    fits(&RegionList {
        handles: vec![max_handle(); MAX_LIST_REGIONS],
        more: true,
    });
    fits(&PoolWelcome {
        pools: vec![max_pool; MAX_POOLS],
        fds_passed: MAX_POOLS as u32,
        ..samples::pool_welcome()
    });
    let owner = OwnerUsage {
        directory_id: max_name(),
        regions: 1,
        bytes: 1,
    };
    let usage = PoolUsage {
        owners: vec![owner; MAX_POOL_OWNERS],
        ..samples::pool_stats_reply().pools[0].clone()
    };
    fits(&PoolStatsReply {
        manager_epoch: 1,
        pools: vec![usage; MAX_POOLS],
    });
    fits(&ErrorReply::new(
        ErrorCode::Internal,
        "m".repeat(MAX_MESSAGE_BYTES),
        0,
    ));

    let sample = samples::stats_reply();
    let instance = InstanceRow {
        instance_id: max_name(),
        ..sample.instances[0].clone()
    };
    let session = SessionRow {
        instance_id: max_name(),
        ..sample.sessions[0].clone()
    };
    let region = RegionRow {
        owner_instance: max_name(),
        ..sample.regions[0].clone()
    };
    let long_pin = LongPinRow {
        instance_id: max_name(),
        ..sample.long_pins[0].clone()
    };
    fits(&StatsReply {
        meta: max_reply_meta(),
        directory_id: max_name(),
        ops: vec![sample.ops[0]; Kind::ALL.len()],
        pools: vec![sample.pools[0]; MAX_POOLS],
        instances: vec![instance; MAX_STATS_ROWS],
        sessions: vec![session; MAX_STATS_ROWS],
        regions: vec![region; MAX_STATS_ROWS],
        long_pins: vec![long_pin; MAX_STATS_ROWS],
        truncated: true,
        ..sample
    });
}

// --- Malformed input is refused, never a panic ----------------------------

/// Runs every decoder on `payload` under header kind `kind`.
fn decode_everything(payload: &[u8], kind: u16) -> bool {
    let aligned = Aligned::new(payload);
    let frame = aligned.frame(kind);
    let request = decode_request(frame).is_ok();
    let reply = decode_reply(frame).is_ok();
    request || reply
}

/// Cuts `msg`'s payload at every length. A cut that leaves no room for the
/// root, or puts it at a misaligned position, must be refused as malformed.
/// Other cuts read the root from the middle of the data: rkyv has no length
/// or checksum, so such a payload may be another structurally valid message
/// (a framed stream never truncates on its own; only a broken sender can
/// produce one). Those must be decoded or refused without panicking.
fn check_truncations<M: Message>(msg: M) {
    let bytes = encoded(&msg);
    let payload = payload_of(&bytes);
    let (root_bytes, root_align) = (
        std::mem::size_of::<Archived<M>>(),
        std::mem::align_of::<Archived<M>>(),
    );
    for len in 0..payload.len() {
        let aligned = Aligned::new(&payload[..len]);
        let result = access::<M>(aligned.frame(M::KIND.as_u16()));
        if len < root_bytes || (len - root_bytes) % root_align != 0 {
            let e = result.expect_err("a cut root must be refused");
            assert_eq!(
                e.code(),
                ErrorCode::Malformed,
                "{:?} cut to {len}: {e}",
                M::KIND
            );
        }
    }
}

#[test]
fn truncated_payloads_are_refused_or_harmless() {
    each_sample!(check_truncations);
}

#[test]
fn every_single_bit_flip_is_decoded_or_refused_without_panicking() {
    let mut refused = 0usize;
    let mut total = 0usize;
    for (kind, bytes) in samples::frames() {
        let payload = payload_of(&bytes).to_vec();
        for bit in 0..payload.len() * 8 {
            let mut flipped = payload.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            total += 1;
            if !decode_everything(&flipped, kind.as_u16()) {
                refused += 1;
            }
        }
    }
    // Flips in integer fields give other valid messages; flips in pointers,
    // lengths, tags and booleans must be caught.
    println!("bit flips: {refused} of {total} refused");
    assert!(refused > 0);
}

#[test]
fn a_flipped_enum_tag_or_bool_is_refused() {
    let reply = Reattached {
        resumed: true,
        ..samples::reattached()
    };
    let bytes = encoded(&reply);
    let mut payload = payload_of(&bytes).to_vec();
    // The root is at the end of the payload.
    let root_at = payload.len() - std::mem::size_of::<Archived<Reattached>>();
    let offset = std::mem::offset_of!(Archived<Reattached>, resumed);
    assert_eq!(payload[root_at + offset], 1);
    payload[root_at + offset] = 2;
    let aligned = Aligned::new(&payload);
    let e = access::<Reattached>(aligned.frame(Kind::Reattached.as_u16())).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Malformed, "{e}");
}

#[test]
fn a_frame_of_another_kind_is_refused() {
    let bytes = encoded(&samples::lookup());
    with_frame(&bytes, |frame| {
        let e = access::<Register>(frame).unwrap_err();
        assert!(
            matches!(
                e,
                ProtoError::UnexpectedKind {
                    expected: Kind::Register,
                    found: 0x0122
                }
            ),
            "{e}"
        );
        assert_eq!(e.code(), ErrorCode::UnknownKind);
    });
    let reply = encoded(&samples::welcome());
    with_frame(&reply, |frame| {
        let e = decode_request(frame).unwrap_err();
        assert!(
            matches!(e, ProtoError::UnknownKind { kind: 0x8101, .. }),
            "{e}"
        );
    });
    let aligned = Aligned::new(payload_of(&bytes));
    let e = decode_request(aligned.frame(0x7777)).unwrap_err();
    assert_eq!(e.code(), ErrorCode::UnknownKind);
}

#[test]
fn a_payload_of_another_type_is_refused_or_harmless() {
    // Relabel every sample payload as every other kind. Some relabellings are
    // valid by accident (an 8-byte tail is a valid `RegionFreed`); none may
    // panic, and the structurally different ones below must be refused.
    let frames = samples::frames();
    for (from, bytes) in &frames {
        for to in Kind::ALL {
            if to != *from {
                decode_everything(payload_of(bytes), to.as_u16());
            }
        }
    }
    let register = encoded(&samples::register());
    let aligned = Aligned::new(payload_of(&register));
    assert_eq!(
        access::<Lookup>(aligned.frame(Kind::Lookup.as_u16()))
            .unwrap_err()
            .code(),
        ErrorCode::Malformed
    );
    assert_eq!(
        access::<Welcome>(aligned.frame(Kind::Welcome.as_u16()))
            .unwrap_err()
            .code(),
        ErrorCode::Malformed
    );
}

#[test]
fn an_unaligned_payload_is_refused() {
    let bytes = encoded(&samples::heartbeat());
    let payload = payload_of(&bytes);
    let shifted = Aligned::new(&[&[0u8][..], payload].concat());
    let frame = Frame {
        payload: &shifted.bytes()[1..],
        ..shifted.frame(Kind::Heartbeat.as_u16())
    };
    let e = access::<Heartbeat>(frame).unwrap_err();
    assert!(matches!(e, ProtoError::Unaligned { .. }), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_any_decoder(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        kind in 0..Kind::ALL.len(),
    ) {
        decode_everything(&bytes, Kind::ALL[kind].as_u16());
    }

    #[test]
    fn randomly_corrupted_valid_frames_never_panic_any_decoder(
        sample in 0..Kind::ALL.len(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
    ) {
        let frames = samples::frames();
        let (kind, bytes) = &frames[sample];
        let mut payload = payload_of(bytes).to_vec();
        for (at, value) in edits {
            let i = at % payload.len();
            payload[i] = value;
        }
        decode_everything(&payload, kind.as_u16());
    }
}

#[test]
fn committed_fuzz_seeds_are_the_current_sample_frames() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/frame_decode");
    let frames = samples::frames();
    let all: Vec<u8> = frames
        .iter()
        .flat_map(|(_, bytes)| bytes.iter().copied())
        .collect();
    let named = frames
        .into_iter()
        .map(|(kind, bytes)| (format!("{kind:?}.bin"), bytes));
    for (name, bytes) in named.chain([("all.bin".to_string(), all)]) {
        let path = dir.join(name);
        let committed = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; regenerate with `cargo run -p cxlkv-controlplane --features samples \
                 --example fuzz_seeds`",
                path.display()
            )
        });
        assert_eq!(
            committed,
            bytes,
            "{} is stale; regenerate it (see above)",
            path.display()
        );
    }
}

/// `LookupReplyFrom` (locations from an iterator, what the server sends) is
/// the same frame, byte for byte, as the `LookupReply` it stands for, so a
/// client cannot tell which one the server encoded.
#[test]
fn a_lookup_reply_from_an_iterator_encodes_byte_for_byte_as_the_owned_reply() {
    let sample = samples::lookup_reply();
    let many = LookupReply {
        locations: (0..MAX_BATCH as u32)
            .map(|i| {
                (i % 3 != 1).then_some(Location {
                    region: u64::from(i / 7),
                    page: i,
                    generation: i.wrapping_mul(2_654_435_761),
                    len_bytes: 4096 - i,
                })
            })
            .collect(),
        ..samples::lookup_reply()
    };
    let empty = LookupReply {
        locations: Vec::new(),
        regions: Vec::new(),
        ..samples::lookup_reply()
    };
    for reply in [sample, many, empty] {
        let from = LookupReplyFrom {
            meta: reply.meta.clone(),
            locations: reply.locations.iter().copied(),
            regions: reply.regions.clone(),
        };
        let mut ours = Vec::new();
        encode_as::<LookupReply, _>(9, &from, &mut ours).unwrap();
        assert_eq!(ours, encoded(&reply), "{} locations", reply.locations.len());
        with_frame(&ours, |frame| {
            let archived = access::<LookupReply>(frame).unwrap();
            assert_eq!(archived.locations().collect::<Vec<_>>(), reply.locations);
        });
    }
}

/// `ExistsFrom`, `LookupFrom`, `DeleteFrom` and `UnpinFrom` (keys borrowed
/// from the caller, what the client sends) encode byte for byte as the
/// owned messages they stand for, whatever the keys' lengths (odd ones
/// leave the key vector's alignment padding to the serializer); with
/// `read_back` (keys and pins within the protocol's limits) the frames
/// also pass checked access and give back the same keys and counts.
fn check_keys_from_encodings(keys: &[Vec<u8>], pins: u32, read_back: bool) {
    let read_only = RequestMeta {
        seq: 0,
        notice_ack: 5,
        replies_received_below: 0,
    };
    let mutating = RequestMeta {
        seq: 11,
        notice_ack: 5,
        replies_received_below: 10,
    };
    let layout = samples::lookup().layout;
    let mut ours = Vec::new();

    let exists = Exists {
        meta: read_only,
        layout,
        keys: keys.to_vec(),
    };
    let from = ExistsFrom {
        meta: read_only,
        layout,
        keys,
    };
    encode_as::<Exists, _>(9, &from, &mut ours).unwrap();
    assert_eq!(ours, encoded(&exists), "exists, {} keys", keys.len());
    if read_back {
        with_frame(&ours, |frame| {
            let archived = access::<Exists>(frame).unwrap();
            assert!(archived.keys().eq(keys.iter().map(Vec::as_slice)));
        });
    }

    ours.clear();
    let delete = Delete {
        meta: mutating,
        layout,
        keys: keys.to_vec(),
    };
    // Borrowed as `&[&[u8]]` this time: any `AsRef<[u8]>` key type.
    let slices: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let from = DeleteFrom {
        meta: mutating,
        layout,
        keys: &slices[..],
    };
    encode_as::<Delete, _>(9, &from, &mut ours).unwrap();
    assert_eq!(ours, encoded(&delete), "delete, {} keys", keys.len());
    if read_back {
        with_frame(&ours, |frame| {
            let archived = access::<Delete>(frame).unwrap();
            assert!(archived.keys().eq(keys.iter().map(Vec::as_slice)));
        });
    }

    ours.clear();
    let counts: Vec<u32> = (0..keys.len() as u32)
        .map(|i| 1 + i % MAX_PINS_PER_KEY as u32)
        .collect();
    let unpin = Unpin {
        meta: mutating,
        layout,
        keys: keys.to_vec(),
        counts: counts.clone(),
    };
    let from = UnpinFrom {
        meta: mutating,
        layout,
        keys,
        counts: &counts,
    };
    encode_as::<Unpin, _>(9, &from, &mut ours).unwrap();
    assert_eq!(ours, encoded(&unpin), "unpin, {} keys", keys.len());
    if read_back {
        with_frame(&ours, |frame| {
            let archived = access::<Unpin>(frame).unwrap();
            assert!(archived.keys().eq(keys.iter().map(Vec::as_slice)));
            assert!(
                archived
                    .counts
                    .iter()
                    .map(|c| c.to_native())
                    .eq(counts.iter().copied())
            );
        });
    }

    ours.clear();
    // A lookup is mutating when it takes pins.
    let meta = if pins == 0 { read_only } else { mutating };
    let lookup = Lookup {
        meta,
        layout,
        keys: keys.to_vec(),
        pins,
    };
    let from = LookupFrom {
        meta,
        layout,
        keys,
        pins,
    };
    encode_as::<Lookup, _>(9, &from, &mut ours).unwrap();
    assert_eq!(ours, encoded(&lookup), "lookup, {} keys", keys.len());
    if read_back {
        with_frame(&ours, |frame| {
            let archived = access::<Lookup>(frame).unwrap();
            assert_eq!(archived.pins, pins);
            assert!(archived.keys().eq(keys.iter().map(Vec::as_slice)));
        });
    }
}

#[test]
fn key_requests_from_borrowed_keys_encode_byte_for_byte_as_the_owned_ones() {
    check_keys_from_encodings(&samples::lookup().keys, 1, true);
    check_keys_from_encodings(&[], 0, true);
    let full: Vec<Vec<u8>> = (0..MAX_BATCH)
        .map(|i| vec![(i % 251) as u8; 1 + i % MAX_KEY_BYTES])
        .collect();
    check_keys_from_encodings(&full, 3, true);
    // Outside the limits the encoding is still the owned one's (the
    // server refuses both alike).
    check_keys_from_encodings(&[Vec::new(), vec![7; MAX_KEY_BYTES + 1]], 0, false);
}

proptest! {
    #[test]
    fn key_requests_from_borrowed_keys_match_for_any_key_lengths(
        keys in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 1..=MAX_KEY_BYTES),
            0..40,
        ),
        pins in 0..=MAX_PINS_PER_KEY as u32,
    ) {
        check_keys_from_encodings(&keys, pins, true);
    }
}

// --- The key list's one-pass check accepts exactly what rkyv's does -------

/// Where the pair array of the key list starts in `payload` (of an
/// accepted key-batch request of `kind`).
fn pairs_offset(kind: Kind, payload: &[u8]) -> usize {
    let aligned = Aligned::new(payload);
    let frame = aligned.frame(kind.as_u16());
    let ptr = match decode_request(frame).expect("the unmutated request is valid") {
        AnyRequest::Exists(m) => m.keys.as_ptr(),
        AnyRequest::Delete(m) => m.keys.as_ptr(),
        AnyRequest::Lookup(m) => m.keys.as_ptr(),
        AnyRequest::Unpin(m) => m.keys.as_ptr(),
        other => panic!("not a key-batch request: {other:?}"),
    };
    ptr as usize - aligned.bytes().as_ptr() as usize
}

/// A small deterministic generator (the test must not depend on a seed
/// source).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Rewrites one pair (or two) of a key list in place: its pointer moved by
/// a small or large amount, its length changed, two pairs swapped or one
/// copied over another — keys made to overlap, go out of order, reach into
/// the pair array, the root or past the payload, or wrap around.
fn mutate_pairs(payload: &mut [u8], pairs: usize, n: usize, rng: &mut SplitMix) {
    let pair = |i: usize| pairs + 8 * i;
    let read = |p: &[u8], at: usize| u32::from_le_bytes(p[at..at + 4].try_into().unwrap());
    let i = rng.below(n as u64) as usize;
    let j = rng.below(n as u64) as usize;
    match rng.below(7) {
        0 => {
            let delta = rng.below(129) as i64 - 64;
            let v = (read(payload, pair(i)) as i32 as i64 + delta) as i32;
            payload[pair(i)..pair(i) + 4].copy_from_slice(&v.to_le_bytes());
        }
        1 => {
            let v = rng.next() as u32;
            payload[pair(i)..pair(i) + 4].copy_from_slice(&v.to_le_bytes());
        }
        2 => {
            let len = read(payload, pair(i) + 4);
            let v = match rng.below(3) {
                0 => len.wrapping_add(rng.below(65) as u32).wrapping_sub(32),
                1 => rng.below(payload.len() as u64 + 16) as u32,
                _ => u32::MAX - rng.below(4) as u32,
            };
            payload[pair(i) + 4..pair(i) + 8].copy_from_slice(&v.to_le_bytes());
        }
        3 => {
            // Swap two whole pairs, each pointer re-aimed at the other's key.
            let (a, b) = (pair(i), pair(j));
            let (pa, pb) = (read(payload, a) as i32, read(payload, b) as i32);
            let (la, lb) = (read(payload, a + 4), read(payload, b + 4));
            let shift = b as i32 - a as i32;
            payload[a..a + 4].copy_from_slice(&(pb + shift).to_le_bytes());
            payload[a + 4..a + 8].copy_from_slice(&lb.to_le_bytes());
            payload[b..b + 4].copy_from_slice(&(pa - shift).to_le_bytes());
            payload[b + 4..b + 8].copy_from_slice(&la.to_le_bytes());
        }
        4 => {
            // Pair `i` aimed at pair `j`'s key (a duplicate).
            let (a, b) = (pair(i), pair(j));
            let target = b as i64 + read(payload, b) as i32 as i64;
            let v = (target - a as i64) as i32;
            payload[a..a + 4].copy_from_slice(&v.to_le_bytes());
            let lb = read(payload, b + 4);
            payload[a + 4..a + 8].copy_from_slice(&lb.to_le_bytes());
        }
        5 => {
            // The list's own length or pointer (in the root).
            let root = payload.len() - 8 * rng.below(6) as usize - 8;
            let at = root + 4 * rng.below(2) as usize;
            let v = read(payload, at) ^ (1 << rng.below(12));
            payload[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        _ => {
            // Any byte of the pair array.
            let at = pairs + rng.below(8 * n as u64) as usize;
            payload[at] ^= 1 << rng.below(8);
        }
    }
}

#[test]
fn the_one_pass_key_list_check_gives_rkyvs_verdict_on_every_mutated_list() {
    use super::key_list::reference::verdicts;
    let mut rng = SplitMix(0x6b65_795f_6c69_7374);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for round in 0..400 {
        let n = 1 + rng.below(12) as usize;
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|k| vec![k as u8; rng.below(if round % 4 == 0 { 3 } else { 40 }) as usize])
            .collect();
        let meta = RequestMeta {
            seq: 3,
            notice_ack: 0,
            replies_received_below: 0,
        };
        let layout = samples::lookup().layout;
        let frames = [
            (
                Kind::Exists,
                encoded(&Exists {
                    meta: RequestMeta { seq: 0, ..meta },
                    layout,
                    keys: keys.clone(),
                }),
            ),
            (
                Kind::Delete,
                encoded(&Delete {
                    meta,
                    layout,
                    keys: keys.clone(),
                }),
            ),
            (
                Kind::Lookup,
                encoded(&Lookup {
                    meta,
                    layout,
                    keys: keys.clone(),
                    pins: 1,
                }),
            ),
            (
                Kind::Unpin,
                encoded(&Unpin {
                    meta,
                    layout,
                    keys: keys.clone(),
                    counts: vec![1; n],
                }),
            ),
        ];
        for (kind, bytes) in frames {
            let clean = payload_of(&bytes).to_vec();
            let pairs = pairs_offset(kind, &clean);
            assert_eq!(
                verdicts(kind, &clean),
                Some((true, true)),
                "{kind:?} unmutated"
            );
            for _ in 0..25 {
                let mut payload = clean.clone();
                for _ in 0..1 + rng.below(3) {
                    mutate_pairs(&mut payload, pairs, n, &mut rng);
                }
                let aligned = Aligned::new(&payload);
                let (rkyv, ours) = verdicts(kind, aligned.bytes()).unwrap();
                assert_eq!(
                    ours, rkyv,
                    "{kind:?}, {n} keys: rkyv's per-key check says {rkyv}, ours {ours}, on {payload:?}"
                );
                if rkyv {
                    accepted += 1;
                } else {
                    refused += 1;
                }
            }
        }
    }
    // Both verdicts must be common, or the comparison proves little.
    assert!(
        accepted > 2_000 && refused > 2_000,
        "accepted {accepted}, refused {refused}"
    );
}
