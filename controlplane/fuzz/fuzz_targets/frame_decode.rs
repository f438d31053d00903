//! Arbitrary bytes, as a peer could send them, through everything a receiver
//! runs before its handler: the frame decoder (fed in chunks, to exercise
//! reassembly; copied in, or written into a pending receive while earlier
//! frames are decoded, as the io_uring server does), then checked access of each payload as the kind its header
//! names and as one other kind.
//!
//! Beyond "no panic", it checks three properties:
//! - a fatal decode error is only ever a corrupt header, and a rejected
//!   frame always maps to an error reply;
//! - anything accepted is a real message: it deserializes, re-encodes, and
//!   the re-encoded frame is accepted again with equal contents;
//! - how the stream was cut does not matter: the frames, rejections and
//!   fatal error seen are exactly those of the whole input pushed at once
//!   and decoded after (a reassembly that dropped, repeated or mis-skipped
//!   a frame under some chunking differs).

#![no_main]

mod common;

use common::decode_as;
use cxlkv_controlplane::frame::{Decoded, Frame, FrameDecoder, FrameError, FrameHeader};
use cxlkv_controlplane::proto::{self, Kind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The stream arrives in pieces of a size derived from (not taken out
    // of) the input, so that a seed that is a valid frame stays one.
    let hash = data.iter().fold(0usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(*b))
    });
    let piece = 1 + hash % 256;
    // Half the inputs are delivered as the io_uring server receives: into
    // a pending receive, while what arrived before is decoded.
    let pending_receives = hash & 0x200 != 0;
    let mut decoder = FrameDecoder::new();
    let mut seen = Vec::new();
    'stream: for chunk in data.chunks(piece) {
        if pending_receives {
            let mut rest = chunk;
            while !rest.is_empty() {
                let (at, len) = decoder.begin_receive(rest.len());
                if !drain(&mut decoder, hash, &mut seen) {
                    break 'stream;
                }
                let n = len.min(rest.len());
                // SAFETY: `at..at + len` is the decoder's spare capacity,
                // reserved for this receive until `end_receive`.
                unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), at, n) };
                decoder.end_receive(n);
                rest = &rest[n..];
            }
        } else {
            decoder.push(chunk);
        }
        if !drain(&mut decoder, hash, &mut seen) {
            break;
        }
    }

    // The reference: the whole input at once.
    let mut whole = FrameDecoder::new();
    whole.push(data);
    let mut expected = Vec::new();
    loop {
        match whole.decode() {
            Ok(Some(decoded)) => expected.push(Event::of(decoded)),
            Ok(None) => break,
            Err(error) => {
                expected.push(Event::Fatal(error));
                break;
            }
        }
    }
    assert!(
        seen == expected,
        "the stream cut in pieces of {piece} (pending receives: {pending_receives}) decoded to {} events, the whole input to {}",
        seen.len(),
        expected.len()
    );
});

/// What the decoder handed out, owned, to compare two decodings.
#[derive(PartialEq)]
enum Event {
    Frame(FrameHeader, Vec<u8>),
    Rejected(FrameHeader, FrameError),
    Fatal(FrameError),
}

impl Event {
    fn of(decoded: Decoded<'_>) -> Self {
        match decoded {
            Decoded::Frame(f) => Self::Frame(f.header, f.payload.to_vec()),
            Decoded::Rejected { header, error } => Self::Rejected(header, error),
        }
    }
}

/// Decodes every whole frame buffered, noting each in `seen`; false once
/// the stream is corrupt.
fn drain(decoder: &mut FrameDecoder, hash: usize, seen: &mut Vec<Event>) -> bool {
    loop {
        match decoder.decode() {
            Ok(Some(Decoded::Frame(frame))) => {
                check_frame(frame, hash);
                seen.push(Event::of(Decoded::Frame(frame)));
            }
            Ok(Some(Decoded::Rejected { header, error })) => {
                assert!(!error.is_fatal(), "a rejected frame keeps the connection");
                let reply = proto::ProtoError::from(error.clone()).to_reply();
                assert!(reply.error_code().is_some());
                seen.push(Event::Rejected(header, error));
            }
            Ok(None) => return true,
            Err(error) => {
                assert!(error.is_fatal(), "decode errors close the connection");
                seen.push(Event::Fatal(error));
                return false;
            }
        }
    }
}

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
