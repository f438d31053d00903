//! Framing: how messages are delimited on a byte stream.
//!
//! Every message travels as one *frame*: a fixed 24-byte little-endian
//! header followed by the payload (an rkyv archive), padded with zero bytes so
//! that the whole frame is a multiple of [`FRAME_ALIGN`] bytes. Because every
//! frame starts at a multiple of `FRAME_ALIGN` within the stream, a receiver
//! that reads the stream into an 8-aligned buffer finds every payload 8-aligned
//! in place — exactly what rkyv's checked access needs for archived types of
//! alignment ≤ 8 — without copying.
//!
//! ```text
//! offset size field
//!  0      4   magic        b"CXKV"
//!  4      2   version      protocol version of this frame (PROTOCOL_VERSION)
//!  6      2   kind         message kind (see `proto`)
//!  8      8   request_id   chosen by the requester, echoed by the reply
//! 16      4   payload_len  exact payload bytes, padding excluded
//! 20      4   reserved     must be zero
//! 24      …   payload, then 0..7 zero bytes of padding
//! ```
//!
//! [`FrameDecoder`] is a sans-IO reassembler: the transport feeds it whatever
//! bytes arrived and takes out whole frames. It tells apart the two kinds of
//! bad input DESIGN §6 distinguishes:
//! - a header that is *intact* (right magic, zero reserved field) but names a
//!   wrong version or an oversized payload: the frame is reported as
//!   [`Decoded::Rejected`] so the caller can send an error reply for its
//!   request id, and its payload is skipped — the connection survives;
//! - a header that is *not* intact (wrong magic, non-zero reserved field): the
//!   stream can no longer be trusted to be frame-aligned, so
//!   [`FrameDecoder::decode`] returns an error and the caller closes that one
//!   connection.

use std::fmt;

/// `b"CXKV"` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"CXKV");
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Size of the fixed frame header.
pub const HEADER_BYTES: usize = 24;
/// Frames (and therefore payloads) start at multiples of this in the stream.
pub const FRAME_ALIGN: usize = 8;
/// Largest payload accepted, in bytes. Large enough for a batch of
/// `MAX_BATCH` keys of `MAX_KEY_BYTES` each with their locations.
pub const MAX_PAYLOAD_BYTES: usize = 8 << 20;
/// Largest frame on the wire (header, payload and padding).
pub const MAX_FRAME_BYTES: usize = HEADER_BYTES + MAX_PAYLOAD_BYTES;

const _: () = assert!(
    HEADER_BYTES.is_multiple_of(FRAME_ALIGN),
    "payloads must start aligned"
);
const _: () = assert!(MAX_FRAME_BYTES.is_multiple_of(FRAME_ALIGN));
// magic + version + kind + request_id + payload_len + reserved
const _: () = assert!(
    HEADER_BYTES == 4 + 2 + 2 + 8 + 4 + 4,
    "header layout and HEADER_BYTES disagree"
);

/// Bytes of padding after a payload of `payload_len` bytes.
pub const fn padding(payload_len: usize) -> usize {
    (FRAME_ALIGN - payload_len % FRAME_ALIGN) % FRAME_ALIGN
}

/// Total bytes on the wire of a frame carrying `payload_len` payload bytes.
/// For a length within [`MAX_PAYLOAD_BYTES`]; a length read from a header
/// that may announce more (up to `u32::MAX`, which overflows a 32-bit
/// `usize` here) goes through [`wire_len`].
pub const fn frame_len(payload_len: usize) -> usize {
    HEADER_BYTES + payload_len + padding(payload_len)
}

/// Total bytes on the wire of the frame a header announces, whatever its
/// `payload_len` (exact on every target: at most `u32::MAX` + 32).
pub const fn wire_len(payload_len: u32) -> u64 {
    let len = payload_len as u64;
    HEADER_BYTES as u64 + len + (FRAME_ALIGN as u64 - len % FRAME_ALIGN as u64) % FRAME_ALIGN as u64
}

/// The decoded fixed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    pub kind: u16,
    pub request_id: u64,
    pub payload_len: u32,
}

impl FrameHeader {
    /// A header of the current protocol version.
    pub fn new(kind: u16, request_id: u64, payload_len: usize) -> Result<Self, FrameError> {
        if payload_len > MAX_PAYLOAD_BYTES {
            return Err(FrameError::Oversized {
                payload_len,
                max: MAX_PAYLOAD_BYTES,
            });
        }
        Ok(Self {
            version: PROTOCOL_VERSION,
            kind,
            request_id,
            // Fits: bounded by MAX_PAYLOAD_BYTES above.
            payload_len: payload_len as u32,
        })
    }

    /// Encodes the header into its 24 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        // b[20..24]: reserved, zero.
        b
    }

    /// Decodes 24 header bytes. Only the *integrity* of the header is checked
    /// here (magic, reserved field); version and size are policy, checked by
    /// [`FrameDecoder`].
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Self, FrameError> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let reserved = u32_at(20);
        if reserved != 0 {
            return Err(FrameError::ReservedNonZero { found: reserved });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Ok(Self {
            version: u16_at(4),
            kind: u16_at(6),
            request_id: u64::from_le_bytes(id),
            payload_len: u32_at(16),
        })
    }
}

/// Appends one whole frame (header, payload, padding) to `out`.
pub fn encode_frame(
    out: &mut Vec<u8>,
    kind: u16,
    request_id: u64,
    payload: &[u8],
) -> Result<(), FrameError> {
    let header = FrameHeader::new(kind, request_id, payload.len())?;
    out.reserve(frame_len(payload.len()));
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(payload);
    out.resize(out.len() + padding(payload.len()), 0);
    Ok(())
}

/// What went wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not `b"CXKV"`: not our protocol, or the stream
    /// lost its alignment. Fatal for the connection.
    #[error("bad frame magic {found:#010x} (expected {MAGIC:#010x})")]
    BadMagic { found: u32 },
    /// The reserved header field is not zero. Fatal for the connection.
    #[error("reserved header field is {found:#x}, must be 0")]
    ReservedNonZero { found: u32 },
    /// The header is intact but speaks another protocol version.
    #[error("unsupported protocol version {found} (this side speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion { found: u16 },
    /// The header is intact but announces a payload over the limit.
    #[error("payload of {payload_len} bytes exceeds the limit of {max} bytes")]
    Oversized { payload_len: usize, max: usize },
}

impl FrameError {
    /// True when the connection can no longer be trusted to be frame-aligned.
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::BadMagic { .. } | Self::ReservedNonZero { .. })
    }
}

/// One complete frame, borrowed from the decoder's buffer.
#[derive(Clone, Copy)]
pub struct Frame<'a> {
    pub header: FrameHeader,
    /// Exactly `header.payload_len` bytes, starting 8-aligned in memory.
    pub payload: &'a [u8],
}

impl fmt::Debug for Frame<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("header", &self.header)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Output of [`FrameDecoder::decode`].
#[derive(Debug)]
pub enum Decoded<'a> {
    /// A well-formed frame of our version within the size limit.
    Frame(Frame<'a>),
    /// An intact header the receiver refuses (wrong version, oversized). The
    /// payload is skipped by the decoder; the caller should answer
    /// `header.request_id` with an error reply carrying `error`.
    Rejected {
        header: FrameHeader,
        error: FrameError,
    },
}

/// Reassembles frames from a byte stream (sans-IO).
///
/// Usage: write received bytes into [`FrameDecoder::spare`], report how many
/// with [`FrameDecoder::filled`] (or use [`FrameDecoder::push`] to copy them
/// in), then call [`FrameDecoder::decode`] until it returns `Ok(None)`.
///
/// The buffer is 8-aligned and frames are consumed whole, so every payload
/// handed out is 8-aligned in memory. Memory is bounded by one maximum frame
/// plus one read's worth of spare capacity, and only while a frame that
/// large is being received: a decoder left empty with more than
/// [`SHRINK_ABOVE_BYTES`] of buffer goes back to its initial 64 KiB, so an
/// idle connection does not keep the memory of the largest frame it ever
/// received. Each receive gets at most `max(min_bytes, 64 KiB)`
/// ([`FrameDecoder::spare`]), however large the buffer grew, so a
/// receiver's per-turn read budget keeps its meaning.
pub struct FrameDecoder {
    /// Backing storage as `u64` words so the byte view is 8-aligned.
    buf: Vec<u64>,
    /// Bytes `start..end` of the byte view hold received, undecoded data.
    start: usize,
    end: usize,
    /// Payload bytes (with padding) of a rejected frame still to be dropped
    /// (`u64`: a header may announce up to 4 GiB, more than a 32-bit
    /// `usize`).
    skip: u64,
    /// Bytes received since the decoder was created (stream offset of `end`).
    received_total: u64,
    /// A receive is writing into the spare bytes (between
    /// [`FrameDecoder::begin_receive`] and [`FrameDecoder::end_receive`]):
    /// nothing may move them or reference them meanwhile.
    receiving: bool,
}

impl fmt::Debug for FrameDecoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameDecoder")
            .field("capacity", &(self.buf.len() * 8))
            .field("buffered", &(self.end - self.start))
            .field("skip", &self.skip)
            .field("received_total", &self.received_total)
            .finish()
    }
}

/// Initial receive buffer: enough for many small frames per read.
const INITIAL_BUFFER_BYTES: usize = 64 << 10;
/// The least [`FrameDecoder::spare`] gives (for a larger ask) once the
/// decoder holds no whole frame: what is left of the last 64 KiB beyond a
/// maximum frame, less up to `FRAME_ALIGN - 1` bytes of alignment phase.
pub const MIN_SPARE_AFTER_DECODE: usize = INITIAL_BUFFER_BYTES - (FRAME_ALIGN - 1);
/// Most [`FrameDecoder::spare`] hands out when asked for less: one
/// receive's worth, as before the buffer ever grew.
pub const MAX_SPARE_BYTES: usize = INITIAL_BUFFER_BYTES;
/// A decoder left empty with a larger buffer than this (it received a
/// large frame) goes back to the initial size. Below it the buffer is kept:
/// the buffer grows to a frame's end plus 64 KiB, so a client whose frames
/// stay under ~960 KiB — a maximum batch (4096) of 100-byte keys is about
/// half a MiB — does not reallocate per frame; one sending larger frames
/// back to back pays a reallocation per frame (a copy of the frame's size,
/// small beside handling it). An idle connection keeps at most this much.
pub const SHRINK_ABOVE_BYTES: usize = 1 << 20;

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self {
            buf: vec![0u64; INITIAL_BUFFER_BYTES / 8],
            start: 0,
            end: 0,
            skip: 0,
            received_total: 0,
            receiving: false,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let words: &mut [u64] = &mut self.buf;
        // SAFETY: `u64` has no padding and every bit pattern is a valid
        // `u8`; the byte slice covers exactly the words' memory; any byte
        // written leaves a valid `u64`, and the unique borrow of `self` rules
        // out aliasing (callers assert that no receive is pending).
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) }
    }

    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The stream is inside a frame: bytes of one are buffered, or a
    /// rejected frame's payload is still to arrive (and be dropped). A
    /// receiver times out a peer that stays mid-frame
    /// (`partial_frame_timeout_ms`); [`FrameDecoder::buffered`] alone
    /// reads 0 while a rejected payload is being skipped.
    pub fn mid_frame(&self) -> bool {
        self.end != self.start || self.skip > 0
    }

    /// Free space to receive into: at least `min_bytes`, unless the
    /// buffered bytes and `min_bytes` together exceed the decoder's limit
    /// (one maximum frame plus 64 KiB); then everything up to that limit,
    /// which is at least [`MIN_SPARE_AFTER_DECODE`] bytes whenever no whole
    /// frame is buffered undecoded (as after [`FrameDecoder::decode`]
    /// returned `None`). A caller holding more bytes than it gets copies
    /// what fits, decodes the frames that completes (making room), and
    /// asks again. Never more than `max(min_bytes, MAX_SPARE_BYTES)`: a
    /// buffer grown by one large frame does not let every later receive
    /// take megabytes at once (past a server's per-connection read budget,
    /// starving the other connections).
    ///
    /// # Panics
    /// While a receive is pending ([`FrameDecoder::begin_receive`]): making
    /// room may move the bytes it is writing into.
    pub fn spare(&mut self, min_bytes: usize) -> &mut [u8] {
        assert!(!self.receiving, "spare() while a receive is pending");
        let cap = self.buf.len() * 8;
        if cap - self.end < min_bytes {
            // Compact: move the undecoded bytes to the front, keeping each
            // byte at a buffer position congruent to its stream offset modulo
            // FRAME_ALIGN. Frames start at stream offsets that are multiples of
            // FRAME_ALIGN, so they stay aligned in memory — including after a
            // rejected frame's payload was skipped only partly.
            let (start, end) = (self.start, self.end);
            let phase = start % FRAME_ALIGN;
            self.bytes_mut().copy_within(start..end, phase);
            self.end -= start - phase;
            self.start = phase;
            let want = (self.end + min_bytes).min(MAX_FRAME_BYTES + INITIAL_BUFFER_BYTES);
            if cap < want {
                self.buf.resize(want.div_ceil(8), 0);
            }
        }
        let end = self.end;
        let len = (self.buf.len() * 8 - end).min(min_bytes.max(MAX_SPARE_BYTES));
        &mut self.bytes_mut()[end..end + len]
    }

    /// Bytes of buffer the decoder holds (its memory, not its contents).
    pub fn capacity(&self) -> usize {
        self.buf.len() * 8
    }

    /// Records that `n` bytes were written at the start of the last
    /// [`FrameDecoder::spare`] slice.
    ///
    /// # Panics
    /// If `n` exceeds the spare capacity (a caller bug).
    pub fn filled(&mut self, n: usize) {
        assert!(
            self.end + n <= self.buf.len() * 8,
            "filled past the spare capacity"
        );
        self.end += n;
        self.received_total += n as u64;
    }

    /// Starts a receive that another party — the kernel, for an io_uring
    /// receive — writes straight into the decoder: returns where to write
    /// and how many bytes at most (the [`FrameDecoder::spare`] bytes for
    /// `min_bytes`). Until [`FrameDecoder::end_receive`], those bytes stay
    /// where they are (a decoder left empty by [`FrameDecoder::decode`] does
    /// not rewind onto them, [`FrameDecoder::spare`] and
    /// [`FrameDecoder::push`] panic) and the decoder creates no reference to
    /// them, so the writer may fill them while the decoder keeps decoding
    /// what was received before.
    ///
    /// # Panics
    /// If a receive is already pending.
    pub fn begin_receive(&mut self, min_bytes: usize) -> (*mut u8, usize) {
        assert!(!self.receiving, "one receive at a time");
        let spare = self.spare(min_bytes);
        let (at, len) = (spare.as_mut_ptr(), spare.len());
        self.receiving = true;
        (at, len)
    }

    /// Ends the pending receive: its first `n` bytes were written (`0` for a
    /// receive that failed or was cancelled).
    ///
    /// # Panics
    /// If no receive is pending, or `n` exceeds what it was given.
    pub fn end_receive(&mut self, n: usize) {
        assert!(self.receiving, "end_receive() without a pending receive");
        self.receiving = false;
        self.filled(n);
    }

    /// Received, undecoded bytes `a..b` (`b <= end`), without forming a
    /// reference to the rest of the buffer, which a pending receive may be
    /// writing.
    fn received(&self, a: usize, b: usize) -> &[u8] {
        assert!(a <= b && b <= self.end, "beyond the received bytes");
        // SAFETY: `a..b` lies within the buffer (`end` never exceeds its
        // length in bytes); those bytes were written before `filled` counted
        // them and nothing writes below `end` (a pending receive writes at
        // `end` and beyond); `u64` words have no padding, so every byte is
        // initialised; the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast::<u8>().add(a), b - a) }
    }

    /// Stream offset (bytes since the start of the stream) at which the next
    /// frame [`FrameDecoder::decode`] returns begins. Lets a receiver tie
    /// out-of-band data (descriptors passed with `SCM_RIGHTS`) to the frame
    /// whose bytes they arrived with.
    pub fn next_frame_offset(&self) -> u64 {
        self.received_total - (self.end - self.start) as u64 + self.skip
    }

    /// Copies all of `data` in (convenience for tests and tools; a receiver
    /// reading an untrusted peer uses [`FrameDecoder::spare`], which keeps
    /// the decoder within its limit). Nothing is decoded meanwhile, so when
    /// the decoder is full of whole frames up to its limit it grows past it:
    /// the caller holds those bytes anyway.
    ///
    /// # Panics
    /// While a receive is pending ([`FrameDecoder::begin_receive`]).
    pub fn push(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let chunk = data.len().min(INITIAL_BUFFER_BYTES);
            if self.spare(chunk).is_empty() {
                // At the limit with no room (whole frames undecoded).
                self.buf.resize((self.end + chunk).div_ceil(8), 0);
            }
            let end = self.end;
            let spare = &mut self.bytes_mut()[end..];
            let n = spare.len().min(data.len());
            spare[..n].copy_from_slice(&data[..n]);
            self.filled(n);
            data = &data[n..];
        }
    }

    /// Takes out the next frame, if a whole one is buffered.
    ///
    /// `Err` means the stream is corrupt (see [`FrameError::is_fatal`]); the
    /// caller must close the connection and drop the decoder.
    pub fn decode(&mut self) -> Result<Option<Decoded<'_>>, FrameError> {
        // Drop what is left of a rejected frame's payload first.
        if self.skip > 0 {
            self.drop_skipped();
            if self.skip > 0 {
                return Ok(None);
            }
        }
        if self.end - self.start < HEADER_BYTES {
            self.reset_if_empty();
            return Ok(None);
        }
        let mut raw = [0u8; HEADER_BYTES];
        raw.copy_from_slice(self.received(self.start, self.start + HEADER_BYTES));
        let header = FrameHeader::decode(&raw)?;
        // The size check comes before any `usize` arithmetic on the length:
        // `frame_len(u32::MAX)` overflows a 32-bit `usize`.
        let reject = if header.version != PROTOCOL_VERSION {
            Some(FrameError::UnsupportedVersion {
                found: header.version,
            })
        } else if u64::from(header.payload_len) > MAX_PAYLOAD_BYTES as u64 {
            Some(FrameError::Oversized {
                // Fits: `usize` has at least 32 bits here (Linux targets).
                payload_len: header.payload_len as usize,
                max: MAX_PAYLOAD_BYTES,
            })
        } else {
            None
        };
        if let Some(error) = reject {
            self.start += HEADER_BYTES;
            self.skip = wire_len(header.payload_len) - HEADER_BYTES as u64;
            self.drop_skipped();
            return Ok(Some(Decoded::Rejected { header, error }));
        }
        // Within MAX_PAYLOAD_BYTES (checked above): no overflow.
        let payload_len = header.payload_len as usize;
        let on_wire = frame_len(payload_len);
        if self.end - self.start < on_wire {
            return Ok(None);
        }
        let payload_at = self.start + HEADER_BYTES;
        self.start += on_wire;
        let payload = self.received(payload_at, payload_at + payload_len);
        debug_assert_eq!(
            payload.as_ptr() as usize % FRAME_ALIGN,
            0,
            "payload must be aligned"
        );
        Ok(Some(Decoded::Frame(Frame { header, payload })))
    }

    /// Drops as much of a rejected frame's payload as is buffered.
    fn drop_skipped(&mut self) {
        // Fits in usize: at most the buffered byte count.
        let n = self.skip.min((self.end - self.start) as u64) as usize;
        self.start += n;
        self.skip -= n as u64;
    }

    fn reset_if_empty(&mut self) {
        // Not under a pending receive: its bytes land at `end`.
        if self.start == self.end && !self.receiving {
            // The next byte to arrive has stream offset `received_total`;
            // keep position ≡ offset (mod FRAME_ALIGN), see `spare`.
            let phase = (self.received_total % FRAME_ALIGN as u64) as usize;
            self.start = phase;
            self.end = phase;
            // Empty and nothing writing into it: give back what a large
            // frame made it grow to.
            if self.buf.len() * 8 > SHRINK_ABOVE_BYTES {
                self.buf = vec![0u64; INITIAL_BUFFER_BYTES / 8];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u16, id: u64, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        encode_frame(&mut v, kind, id, payload).unwrap();
        v
    }

    fn expect_frame(d: &mut FrameDecoder) -> (FrameHeader, Vec<u8>) {
        match d.decode().unwrap() {
            Some(Decoded::Frame(f)) => {
                assert_eq!(f.payload.as_ptr() as usize % FRAME_ALIGN, 0);
                (f.header, f.payload.to_vec())
            }
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    #[test]
    fn header_round_trips_and_is_24_bytes() {
        let h = FrameHeader::new(7, 0xdead_beef_0123, 1234).unwrap();
        let raw = h.encode();
        assert_eq!(raw.len(), HEADER_BYTES);
        assert_eq!(&raw[0..4], b"CXKV");
        assert_eq!(FrameHeader::decode(&raw).unwrap(), h);
    }

    #[test]
    fn frames_are_padded_to_the_alignment() {
        for len in 0..40 {
            let f = frame(1, 1, &vec![0xAB; len]);
            assert_eq!(f.len() % FRAME_ALIGN, 0);
            assert_eq!(f.len(), frame_len(len));
        }
    }

    #[test]
    fn decodes_frames_split_at_every_byte_boundary() {
        let mut stream = frame(1, 10, b"hello");
        stream.extend(frame(2, 11, b""));
        stream.extend(frame(3, 12, &[9u8; 100]));
        for split in 0..=stream.len() {
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            for chunk in [&stream[..split], &stream[split..]] {
                d.push(chunk);
                while let Some(Decoded::Frame(f)) = d.decode().unwrap() {
                    got.push((f.header.request_id, f.payload.to_vec()));
                }
            }
            assert_eq!(
                got,
                vec![(10, b"hello".to_vec()), (11, vec![]), (12, vec![9u8; 100])],
                "split at {split}"
            );
        }
    }

    #[test]
    fn bad_magic_is_fatal() {
        let mut f = frame(1, 1, b"x");
        f[0] = b'X';
        let mut d = FrameDecoder::new();
        d.push(&f);
        let err = d.decode().unwrap_err();
        assert!(matches!(err, FrameError::BadMagic { .. }));
        assert!(err.is_fatal());
    }

    #[test]
    fn non_zero_reserved_field_is_fatal() {
        let mut f = frame(1, 1, b"x");
        f[22] = 1;
        let mut d = FrameDecoder::new();
        d.push(&f);
        assert!(d.decode().unwrap_err().is_fatal());
    }

    #[test]
    fn wrong_version_is_rejected_and_the_stream_continues() {
        let mut bad = frame(1, 77, b"payload!");
        bad[4] = 9;
        let mut d = FrameDecoder::new();
        d.push(&bad);
        d.push(&frame(1, 78, b"ok"));
        match d.decode().unwrap() {
            Some(Decoded::Rejected { header, error }) => {
                assert_eq!(header.request_id, 77);
                assert_eq!(error, FrameError::UnsupportedVersion { found: 9 });
                assert!(!error.is_fatal());
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
        let (h, p) = expect_frame(&mut d);
        assert_eq!((h.request_id, p.as_slice()), (78, &b"ok"[..]));
    }

    #[test]
    fn oversized_payload_is_rejected_skipped_and_the_stream_continues() {
        let len = MAX_PAYLOAD_BYTES + 8;
        let mut header = FrameHeader::new(1, 5, 0).unwrap();
        header.payload_len = len as u32;
        let mut d = FrameDecoder::new();
        d.push(&header.encode());
        match d.decode().unwrap() {
            Some(Decoded::Rejected { header, error }) => {
                assert_eq!(header.request_id, 5);
                assert!(matches!(error, FrameError::Oversized { .. }));
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
        // The announced payload trickles in and is dropped without buffering it.
        let chunk = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            d.push(&chunk[..n]);
            assert!(d.decode().unwrap().is_none());
            assert!(d.buffered() <= chunk.len());
            left -= n;
        }
        d.push(&frame(1, 6, b"next"));
        let (h, p) = expect_frame(&mut d);
        assert_eq!((h.request_id, p.as_slice()), (6, &b"next"[..]));
    }

    #[test]
    fn frames_after_a_partly_skipped_rejection_stay_aligned() {
        let mut header = FrameHeader::new(1, 5, 0).unwrap();
        header.payload_len = (MAX_PAYLOAD_BYTES + 8) as u32;
        let mut d = FrameDecoder::new();
        d.push(&header.encode());
        assert!(matches!(
            d.decode().unwrap(),
            Some(Decoded::Rejected { .. })
        ));
        // Skipped payload arrives in odd-sized pieces, then a real frame.
        let mut left = MAX_PAYLOAD_BYTES + 8;
        let piece = vec![0u8; 99_999];
        while left > 0 {
            let n = left.min(piece.len());
            d.push(&piece[..n]);
            assert!(d.decode().unwrap().is_none());
            left -= n;
        }
        d.push(&frame(1, 6, b"aligned?"));
        let (h, p) = expect_frame(&mut d);
        assert_eq!((h.request_id, p.as_slice()), (6, &b"aligned?"[..]));
    }

    #[test]
    fn a_maximum_size_frame_is_accepted() {
        let payload = vec![0x5A; MAX_PAYLOAD_BYTES];
        let f = frame(4, 99, &payload);
        let mut d = FrameDecoder::new();
        for chunk in f.chunks(1 << 16) {
            d.push(chunk);
        }
        let (h, p) = expect_frame(&mut d);
        assert_eq!(h.request_id, 99);
        assert_eq!(p.len(), MAX_PAYLOAD_BYTES);
    }

    #[test]
    fn next_frame_offset_tracks_frame_starts_across_rejections() {
        let mut stream = frame(1, 1, b"abc");
        let second_at = stream.len() as u64;
        let mut bad = frame(1, 2, &[7u8; 20]);
        bad[4] = 9;
        stream.extend_from_slice(&bad);
        let third_at = stream.len() as u64;
        stream.extend(frame(1, 3, b""));
        let mut d = FrameDecoder::new();
        let mut starts = Vec::new();
        for b in &stream {
            d.push(std::slice::from_ref(b));
            loop {
                let at = d.next_frame_offset();
                match d.decode().unwrap() {
                    Some(_) => starts.push(at),
                    None => break,
                }
            }
        }
        assert_eq!(starts, vec![0, second_at, third_at]);
    }

    /// The size check comes before any arithmetic on the announced length:
    /// `frame_len(u32::MAX as usize)` overflows a 32-bit `usize` (a panic in
    /// a debug build, a wrong skip in a release one). On 64 bits the
    /// overflow cannot happen; this pins the answer and the exact skip.
    #[test]
    fn a_header_announcing_u32_max_payload_bytes_is_refused_as_oversized_and_skipped_exactly() {
        let header = FrameHeader {
            version: PROTOCOL_VERSION,
            kind: 1,
            request_id: 7,
            payload_len: u32::MAX,
        };
        let mut d = FrameDecoder::new();
        d.push(&header.encode());
        d.push(&[0u8; 100]);
        match d.decode().unwrap() {
            Some(Decoded::Rejected { header: h, error }) => {
                assert_eq!(h, header);
                assert_eq!(
                    error,
                    FrameError::Oversized {
                        payload_len: u32::MAX as usize,
                        max: MAX_PAYLOAD_BYTES,
                    }
                );
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
        // The next frame starts after the whole announced payload and its
        // one byte of padding: 24 + 2^32 bytes into the stream.
        assert_eq!(wire_len(u32::MAX), HEADER_BYTES as u64 + (1u64 << 32));
        assert_eq!(d.next_frame_offset(), HEADER_BYTES as u64 + (1u64 << 32));
        assert!(d.mid_frame(), "the rest of the payload is still to come");
        for len in [0u32, 1, 5, 8, MAX_PAYLOAD_BYTES as u32] {
            assert_eq!(wire_len(len), frame_len(len as usize) as u64);
        }
    }

    #[test]
    fn encoder_refuses_oversized_payloads() {
        let mut out = Vec::new();
        let err = encode_frame(&mut out, 1, 1, &vec![0; MAX_PAYLOAD_BYTES + 1]).unwrap_err();
        assert!(matches!(err, FrameError::Oversized { .. }));
        assert!(out.is_empty());
    }

    /// Writes `data` where a pending receive was told to, as the kernel does.
    fn receive_into(d: &mut FrameDecoder, data: &[u8]) {
        let (at, len) = d.begin_receive(data.len());
        assert!(len >= data.len());
        // SAFETY: `at..at + len` is the decoder's spare capacity, reserved
        // for this receive until `end_receive`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        d.end_receive(data.len());
    }

    #[test]
    fn a_pending_receive_keeps_its_place_while_earlier_frames_are_decoded() {
        let (a, b) = (frame(1, 1, b"first"), frame(2, 2, &[7u8; 300]));
        let mut d = FrameDecoder::new();
        d.push(&a[..a.len() - 3]);
        // The receive that brings the rest of `a` and all of `b` starts...
        let (at, len) = d.begin_receive(1);
        let rest: Vec<u8> = a[a.len() - 3..].iter().chain(&b).copied().collect();
        assert!(len >= rest.len());
        // ... and decoding meanwhile (only part of `a` is in) finds nothing
        // and leaves the receive's bytes alone.
        assert!(d.decode().unwrap().is_none());
        // SAFETY: the pending receive's spare bytes, as the kernel would.
        unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), at, rest.len()) };
        d.end_receive(rest.len());
        assert_eq!(
            expect_frame(&mut d),
            (FrameHeader::new(1, 1, 5).unwrap(), b"first".to_vec())
        );
        assert_eq!(expect_frame(&mut d).1, vec![7u8; 300]);
        assert!(d.decode().unwrap().is_none());
    }

    #[test]
    fn a_receive_pending_on_an_emptied_decoder_lands_where_it_was_told() {
        let mut d = FrameDecoder::new();
        d.push(&frame(1, 1, b"whole"));
        let (at, _) = d.begin_receive(64);
        // Decoding the whole frame empties the decoder while the receive is
        // pending: `reset_if_empty` must leave `end` where the receive writes.
        assert_eq!(expect_frame(&mut d).1, b"whole".to_vec());
        assert!(d.decode().unwrap().is_none());
        let next = frame(3, 9, b"next");
        // SAFETY: the pending receive's spare bytes.
        unsafe { std::ptr::copy_nonoverlapping(next.as_ptr(), at, next.len()) };
        d.end_receive(next.len());
        assert_eq!(
            expect_frame(&mut d),
            (FrameHeader::new(3, 9, 4).unwrap(), b"next".to_vec())
        );
        // And after it, the decoder rewinds and reuses its buffer as before.
        receive_into(&mut d, &frame(4, 10, b"again"));
        assert_eq!(expect_frame(&mut d).1, b"again".to_vec());
    }

    #[test]
    fn a_failed_receive_adds_nothing() {
        let mut d = FrameDecoder::new();
        d.push(&frame(1, 1, b"x")[..10]);
        let _ = d.begin_receive(1);
        d.end_receive(0);
        assert_eq!(d.buffered(), 10);
        assert!(d.decode().unwrap().is_none());
    }

    #[test]
    #[should_panic(expected = "spare() while a receive is pending")]
    fn making_room_while_a_receive_is_pending_panics() {
        let mut d = FrameDecoder::new();
        let _ = d.begin_receive(1);
        d.push(b"would move the receive's bytes");
    }

    #[test]
    #[should_panic(expected = "one receive at a time")]
    fn a_second_pending_receive_panics() {
        let mut d = FrameDecoder::new();
        let _ = d.begin_receive(1);
        let _ = d.begin_receive(1);
    }

    /// The guarantee a receiver with more bytes than the decoder takes
    /// relies on (the io_uring server's provided buffers hold up to 16
    /// MiB): after most of a maximum frame, `spare` is capped — but, with
    /// no whole frame buffered, never below `MIN_SPARE_AFTER_DECODE`, so
    /// copying what fits and decoding in between always makes progress and
    /// loses nothing.
    #[test]
    fn spare_is_capped_after_a_large_partial_frame_but_always_leaves_room_once_decoded() {
        let big = frame(1, 1, &vec![0x5A; MAX_PAYLOAD_BYTES]);
        let (head, tail) = big.split_at(big.len() - 8);
        let mut d = FrameDecoder::new();
        for chunk in head.chunks(1 << 20) {
            d.push(chunk);
            assert!(d.decode().unwrap().is_none());
        }
        let asked = 1 << 20;
        let room = d.spare(asked).len();
        assert!(
            (MIN_SPARE_AFTER_DECODE..asked).contains(&room),
            "{room} bytes of room"
        );
        // The tail and 200 KiB of small frames, copied in as they fit.
        let mut rest = tail.to_vec();
        for id in 2..202u64 {
            encode_frame(&mut rest, 2, id, &[id as u8; 1000]).unwrap();
        }
        let mut data = rest.as_slice();
        let mut got = Vec::new();
        while !data.is_empty() {
            let spare = d.spare(data.len());
            let n = spare.len().min(data.len());
            assert!(n >= MIN_SPARE_AFTER_DECODE.min(data.len()), "{n}");
            spare[..n].copy_from_slice(&data[..n]);
            d.filled(n);
            data = &data[n..];
            while let Some(Decoded::Frame(f)) = d.decode().unwrap() {
                assert_eq!(f.payload.as_ptr() as usize % FRAME_ALIGN, 0);
                got.push(f.header.request_id);
            }
        }
        assert_eq!(got, (1..202).collect::<Vec<_>>());
    }

    /// One maximum frame must not change what later receives get: each
    /// `spare` / `begin_receive` for 64 KiB gets at most `MAX_SPARE_BYTES`
    /// (it used to get everything up to the grown capacity, ~8 MiB, which
    /// let one receive overrun a server's per-turn read budget), and the
    /// decoder gives its memory back once it is empty.
    #[test]
    fn after_a_maximum_frame_receives_stay_bounded_and_the_idle_decoder_shrinks() {
        let asked = 64 << 10;
        let mut d = FrameDecoder::new();
        d.push(&frame(1, 1, &vec![0x5A; MAX_PAYLOAD_BYTES]));
        // A few bytes of the next frame: the decoder is not empty.
        let next = frame(2, 2, b"next");
        d.push(&next[..10]);
        assert_eq!(expect_frame(&mut d).0.request_id, 1);
        assert!(d.decode().unwrap().is_none());
        assert!(d.capacity() >= MAX_FRAME_BYTES, "{}", d.capacity());
        let room = d.spare(asked).len();
        assert!(
            (asked..=MAX_SPARE_BYTES.max(asked)).contains(&room),
            "{room}"
        );
        let (_, len) = d.begin_receive(asked);
        assert!(len <= MAX_SPARE_BYTES.max(asked), "{len}");
        d.end_receive(0);
        // A larger ask still gets what it asks for.
        assert!(d.spare(1 << 20).len() >= 1 << 20);
        // The rest of the frame: decoded, the decoder empty, its buffer
        // back to the initial size.
        d.push(&next[10..]);
        assert_eq!(expect_frame(&mut d).0.request_id, 2);
        assert!(d.decode().unwrap().is_none());
        assert!(d.capacity() <= SHRINK_ABOVE_BYTES, "{}", d.capacity());
        // And it still works, aligned, at the stream's phase.
        receive_into(&mut d, &frame(3, 3, &[1u8; 13]));
        assert_eq!(expect_frame(&mut d).1, vec![1u8; 13]);
    }

    /// A decoder is not shrunk under a pending receive (its bytes land in
    /// the buffer it was given).
    #[test]
    fn a_decoder_is_not_shrunk_while_a_receive_is_pending() {
        let mut d = FrameDecoder::new();
        d.push(&frame(1, 1, &vec![0x5A; 1 << 20]));
        let (at, _) = d.begin_receive(64);
        assert_eq!(expect_frame(&mut d).0.request_id, 1);
        assert!(d.decode().unwrap().is_none());
        let cap = d.capacity();
        assert!(cap > SHRINK_ABOVE_BYTES);
        let next = frame(2, 2, b"late");
        // SAFETY: the pending receive's spare bytes, as the kernel would.
        unsafe { std::ptr::copy_nonoverlapping(next.as_ptr(), at, next.len()) };
        d.end_receive(next.len());
        assert_eq!(expect_frame(&mut d).1, b"late".to_vec());
        assert!(d.decode().unwrap().is_none());
        assert!(d.capacity() <= SHRINK_ABOVE_BYTES);
    }

    /// `push` copies everything it is given, even past the decoder's limit
    /// when the frames before are not decoded yet (it used to loop forever
    /// once `spare` had no room left: a maximum frame and more pushed in one
    /// call). Run on a thread with a bound, so that a regression fails
    /// instead of hanging.
    #[test]
    fn push_takes_a_maximum_frame_and_more_in_one_call() {
        let mut stream = frame(1, 1, &vec![0x5A; MAX_PAYLOAD_BYTES]);
        for id in 2..202u64 {
            encode_frame(&mut stream, 2, id, &[id as u8; 1000]).unwrap();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut d = FrameDecoder::new();
            d.push(&stream);
            let mut got = Vec::new();
            while let Some(Decoded::Frame(f)) = d.decode().unwrap() {
                got.push(f.header.request_id);
            }
            let _ = tx.send(got);
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("push returned");
        assert_eq!(got, (1..202).collect::<Vec<_>>());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_chunking_yields_the_same_frames(
            payloads in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..300), 1..8),
            cuts in proptest::collection::vec(1usize..64, 1..50),
        ) {
            let mut stream = Vec::new();
            for (i, p) in payloads.iter().enumerate() {
                encode_frame(&mut stream, 1, i as u64, p).unwrap();
            }
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            let mut rest = stream.as_slice();
            let mut cut = cuts.iter().cycle();
            while !rest.is_empty() {
                let n = (*cut.next().unwrap()).min(rest.len());
                d.push(&rest[..n]);
                rest = &rest[n..];
                while let Some(Decoded::Frame(f)) = d.decode().unwrap() {
                    proptest::prop_assert_eq!(f.payload.as_ptr() as usize % FRAME_ALIGN, 0);
                    got.push(f.payload.to_vec());
                }
            }
            proptest::prop_assert_eq!(got, payloads);
        }
    }
}
