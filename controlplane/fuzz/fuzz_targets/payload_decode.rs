//! One message payload, already framed: the first input byte picks the kind
//! (an index into `Kind::ALL`), the rest is the payload, placed 8-aligned
//! behind a valid header. `frame_decode` spends most of its mutations on
//! headers and framing; this target spends them all on payloads, seeded with
//! a valid payload of every kind (`fuzz/seeds/payload_decode/`), so the
//! fuzzer works from real messages inward: rkyv's structural checks, then
//! every protocol limit and field rule of `proto::validate`, then the
//! round trip (deserialize, re-encode, validate again, compare). A key-batch
//! request's structure must also get the same verdict from the one-pass key
//! list check as from rkyv's own per-key check (`proto::key_list`).

#![no_main]

mod common;

use common::{Aligned, decode_as};
use cxlkv_controlplane::frame::{Frame, FrameHeader};
use cxlkv_controlplane::proto::{Kind, key_list_reference};
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
    // A key list must get the verdict rkyv's own per-key check gives it
    // (`proto::key_list`'s one-pass check).
    if let Some((rkyv, ours)) = key_list_reference::verdicts(kind, aligned.bytes()) {
        assert_eq!(ours, rkyv, "{kind:?}: the key list check disagrees with rkyv's");
    }
    decode_as(Frame {
        header,
        payload: aligned.bytes(),
    });
});
