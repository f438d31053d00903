//! The demo's workload: which chunks exist, what bytes they hold, and which
//! chunks a request touches.
//!
//! A *document* stands for a long shared context (a system prompt, a RAG
//! document): its first [`PREFIX_CHUNKS`] chunks are written once by the
//! prefill instance. A *request* is a question about a document: it needs
//! the document's prefix chunks and [`SUFFIX_CHUNKS`] chunks of its own,
//! one of [`QUESTIONS_PER_DOCUMENT`] per document, written by whichever
//! instance first misses them. So most of a request is a cross-instance hit
//! and the rest becomes one after its first miss — the prefix-heavy shape
//! of real serving traffic.
//!
//! Every chunk's bytes are a function of its id: 64-bit words `a + b·i`
//! (wrapping), with `a`, `b` mixed from the id. Their wrapping word sum
//! (the same `checksum` the benches use, which reads every byte) has a
//! closed form, so a reader verifies a chunk against the bytes its writer
//! wrote without keeping a copy: a torn, stale or foreign page sums to
//! something else.

pub(crate) use crate::bench::forked_server::checksum;

/// Chunks of a document's shared prefix (written by the prefill instance).
pub const PREFIX_CHUNKS: u32 = 8;
/// Chunks of a request's own suffix (written by the first instance to miss).
pub const SUFFIX_CHUNKS: u32 = 2;
/// Distinct requests (suffixes) per document.
pub const QUESTIONS_PER_DOCUMENT: u32 = 4;
/// Keys one request looks up.
pub const CHUNKS_PER_REQUEST: usize = (PREFIX_CHUNKS + SUFFIX_CHUNKS) as usize;
/// Distinct chunks per document, prefix and every suffix.
const CHUNKS_PER_DOCUMENT: u64 = (PREFIX_CHUNKS + QUESTIONS_PER_DOCUMENT * SUFFIX_CHUNKS) as u64;

/// One chunk of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkId {
    pub document: u32,
    /// `None`: the document's prefix; `Some(q)`: question `q`'s suffix.
    pub question: Option<u32>,
    /// Position within the prefix or the suffix.
    pub index: u32,
}

impl ChunkId {
    /// The key the chunk is stored under (what an engine would derive from
    /// the token prefix).
    pub fn key(&self) -> Vec<u8> {
        match self.question {
            None => format!("doc{:05}/prefix{:03}", self.document, self.index),
            Some(q) => format!("doc{:05}/q{q:02}/suffix{:03}", self.document, self.index),
        }
        .into_bytes()
    }

    /// A number unique to the chunk, the seed of its bytes.
    fn ordinal(&self) -> u64 {
        let within = match self.question {
            None => u64::from(self.index),
            Some(q) => u64::from(PREFIX_CHUNKS + q * SUFFIX_CHUNKS + self.index),
        };
        u64::from(self.document) * CHUNKS_PER_DOCUMENT + within
    }

    /// The chunk's word pattern `(a, b)`.
    fn pattern(&self) -> (u64, u64) {
        let seed = self.ordinal();
        (
            splitmix64(seed),
            splitmix64(seed ^ 0x9E37_79B9_7F4A_7C15) | 1,
        )
    }

    /// Writes the chunk's bytes into `out` (whose length must be a multiple
    /// of 8: chunk sizes are multiples of 4 KiB).
    pub fn fill(&self, out: &mut [u8]) {
        debug_assert!(
            out.len().is_multiple_of(8),
            "chunk sizes are multiples of 8"
        );
        let (a, b) = self.pattern();
        for (i, word) in out.chunks_exact_mut(8).enumerate() {
            let w = a.wrapping_add(b.wrapping_mul(i as u64));
            word.copy_from_slice(&w.to_le_bytes());
        }
    }

    /// `checksum` of the chunk's `len_bytes` bytes, without producing them:
    /// `n·a + b·n(n−1)/2` over `n` words, wrapping.
    pub fn expected_checksum(&self, len_bytes: usize) -> u64 {
        debug_assert!(
            len_bytes.is_multiple_of(8),
            "chunk sizes are multiples of 8"
        );
        let (a, b) = self.pattern();
        let n = (len_bytes / 8) as u128;
        let triangle = (n * n.saturating_sub(1) / 2) as u64;
        (n as u64)
            .wrapping_mul(a)
            .wrapping_add(b.wrapping_mul(triangle))
    }
}

/// The prefix chunks of `document`.
pub fn prefix(document: u32) -> impl Iterator<Item = ChunkId> {
    (0..PREFIX_CHUNKS).map(move |index| ChunkId {
        document,
        question: None,
        index,
    })
}

/// The chunks a request for `question` about `document` looks up, in token
/// order: the prefix, then the suffix.
pub fn request(document: u32, question: u32) -> Vec<ChunkId> {
    prefix(document)
        .chain((0..SUFFIX_CHUNKS).map(|index| ChunkId {
            document,
            question: Some(question),
            index,
        }))
        .collect()
}

/// Distinct chunks the workload can write for `documents` documents.
pub fn total_chunks(documents: u32) -> u64 {
    u64::from(documents) * CHUNKS_PER_DOCUMENT
}

/// A small deterministic generator (splitmix64) choosing requests; each
/// instance seeds its own, so instances ask for different documents at a
/// time.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A value in `0..bound` (`bound` > 0; the modulo bias is irrelevant
    /// for picking documents).
    pub fn below(&mut self, bound: u32) -> u32 {
        debug_assert!(bound > 0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        (splitmix64(self.0) % u64::from(bound)) as u32
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closed_form_checksum_matches_the_written_bytes() {
        let mut buf = vec![0u8; 64 << 10];
        for id in request(3, 1).into_iter().chain(prefix(0)) {
            id.fill(&mut buf);
            assert_eq!(checksum(&buf), id.expected_checksum(buf.len()), "{id:?}");
        }
    }

    #[test]
    fn a_torn_or_foreign_chunk_fails_verification() {
        let len = 16 << 10;
        let id = ChunkId {
            document: 7,
            question: Some(2),
            index: 1,
        };
        let mut buf = vec![0u8; len];
        id.fill(&mut buf);
        let expected = id.expected_checksum(len);
        let mut torn = buf.clone();
        torn[len / 2..].fill(0);
        assert_ne!(checksum(&torn), expected, "half the page never written");
        let other = ChunkId { index: 0, ..id };
        other.fill(&mut buf);
        assert_ne!(checksum(&buf), expected, "another chunk's bytes");
    }

    #[test]
    fn every_chunk_of_the_workload_has_its_own_key_and_seed() {
        let docs = 5;
        let mut keys = std::collections::HashSet::new();
        let mut ordinals = std::collections::HashSet::new();
        for d in 0..docs {
            for q in 0..QUESTIONS_PER_DOCUMENT {
                for id in request(d, q) {
                    keys.insert(id.key());
                    ordinals.insert(id.ordinal());
                }
            }
        }
        assert_eq!(keys.len() as u64, total_chunks(docs));
        assert_eq!(ordinals.len() as u64, total_chunks(docs));
        assert!(ordinals.iter().all(|&o| o < total_chunks(docs)));
    }

    #[test]
    fn requests_start_with_the_documents_prefix() {
        let r = request(4, 3);
        assert_eq!(r.len(), CHUNKS_PER_REQUEST);
        assert!(
            r[..PREFIX_CHUNKS as usize]
                .iter()
                .eq(prefix(4).collect::<Vec<_>>().iter())
        );
        assert!(
            r[PREFIX_CHUNKS as usize..]
                .iter()
                .all(|c| c.question == Some(3))
        );
    }
}
