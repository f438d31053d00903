//! One message payload, already framed: the first input byte picks the kind
//! (an index into `Kind::ALL`), the rest is the payload, placed 8-aligned
//! behind a valid header. `frame_decode` spends most of its mutations on
//! headers and framing; this target spends them all on payloads, seeded with
//! a valid payload of every kind (`fuzz/seeds/payload_decode/`), so the
//! fuzzer works from real messages inward: rkyv's structural checks, then
//! every protocol limit and field rule of `proto::validate`, then the
//! round trip (deserialize, re-encode, validate again, compare).

#![no_main]

mod common;

use common::{Aligned, decode_as};
use cxlkv_controlplane::frame::{Frame, FrameHeader};
use cxlkv_controlplane::proto::Kind;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    let kind = Kind::ALL[usize::from(selector) % Kind::ALL.len()];
    let Ok(header) = FrameHeader::new(kind.as_u16(), 1, payload.len()) else {
        return;
    };
    let aligned = Aligned::new(payload);
    decode_as(Frame {
        header,
        payload: aligned.bytes(),
    });
});
