//! What the chaos workload writes: keys that name their writer and their
//! length, and payloads that are a pure function of the key, so that any
//! reader — an instance, or the checker long after the writer died — can
//! tell an intact chunk from a torn or foreign one without asking anyone.
//!
//! A key is `k<slot>.<incarnation>.<n>.<len>`: the instance slot, the
//! incarnation of the process in that slot that wrote it (so the checker
//! knows whether the writer is alive), a counter unique within the
//! incarnation, and the chunk length in bytes. The payload is the output of
//! a SplitMix64 stream seeded with the first eight bytes of the key's
//! BLAKE3 hash. Keys are never reused, so a key is registered at most once.

/// A parsed chaos key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyName {
    pub slot: u32,
    pub incarnation: u32,
    pub n: u64,
    pub len_bytes: usize,
}

impl KeyName {
    /// The key's text.
    pub fn render(&self) -> String {
        format!(
            "k{}.{}.{}.{}",
            self.slot, self.incarnation, self.n, self.len_bytes
        )
    }

    /// Parses `k<slot>.<incarnation>.<n>.<len>`; `None` for anything else.
    pub fn parse(key: &[u8]) -> Option<KeyName> {
        let text = std::str::from_utf8(key).ok()?.strip_prefix('k')?;
        let mut parts = text.split('.');
        let name = KeyName {
            slot: parts.next()?.parse().ok()?,
            incarnation: parts.next()?.parse().ok()?,
            n: parts.next()?.parse().ok()?,
            len_bytes: parts.next()?.parse().ok()?,
        };
        (parts.next().is_none() && name.len_bytes > 0).then_some(name)
    }
}

/// A small deterministic generator (SplitMix64): the workload's choices
/// and the payload bytes. Not for anything secret.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` (`bound` > 0; the modulo bias is irrelevant
    /// for a workload generator).
    pub fn below(&mut self, bound: u64) -> u64 {
        debug_assert!(bound > 0, "an empty range");
        self.next_u64() % bound.max(1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn stream_for(key: &[u8]) -> SplitMix64 {
    let hash = blake3::hash(key);
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&hash.as_bytes()[..8]);
    SplitMix64::new(u64::from_le_bytes(seed))
}

/// Fills `out` with the payload of `key` (its first `out.len()` bytes).
pub fn fill(key: &[u8], out: &mut [u8]) {
    let mut stream = stream_for(key);
    for chunk in out.chunks_mut(8) {
        let word = stream.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// The payload of `key`, of the length the key names.
pub fn payload(name: &KeyName) -> Vec<u8> {
    let mut out = vec![0u8; name.len_bytes];
    fill(name.render().as_bytes(), &mut out);
    out
}

/// The checksum recorded in the ledger: BLAKE3 of the bytes, first 8 bytes.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&blake3::hash(bytes).as_bytes()[..8]);
    u64::from_le_bytes(word)
}

/// True when `bytes` are exactly the payload `key` names: its length and
/// every byte of its pattern. Compared word by word without allocating.
pub fn is_intact(key: &[u8], bytes: &[u8]) -> bool {
    let Some(name) = KeyName::parse(key) else {
        return false;
    };
    if bytes.len() != name.len_bytes {
        return false;
    }
    let mut stream = stream_for(key);
    bytes.chunks(8).all(|chunk| {
        let word = stream.next_u64().to_le_bytes();
        chunk == &word[..chunk.len()]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_reject_foreign_text() {
        let k = KeyName {
            slot: 3,
            incarnation: 7,
            n: 152,
            len_bytes: 9000,
        };
        assert_eq!(k.render(), "k3.7.152.9000");
        assert_eq!(KeyName::parse(b"k3.7.152.9000"), Some(k));
        for bad in [
            &b"k3.7.152"[..],
            b"x3.7.1.2",
            b"k3.7.1.0",
            b"k3.7.1.2.5",
            b"k\xff",
        ] {
            assert_eq!(KeyName::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_payload_is_intact_and_any_changed_byte_or_length_is_detected() {
        let name = KeyName {
            slot: 0,
            incarnation: 1,
            n: 2,
            len_bytes: 1001,
        };
        let key = name.render();
        let bytes = payload(&name);
        assert!(is_intact(key.as_bytes(), &bytes));
        for i in [0, 7, 8, 500, 1000] {
            let mut torn = bytes.clone();
            torn[i] ^= 0x40;
            assert!(!is_intact(key.as_bytes(), &torn), "byte {i}");
        }
        assert!(!is_intact(key.as_bytes(), &bytes[..1000]));
        // Another key's payload of the same length is foreign.
        let other = KeyName { n: 3, ..name };
        assert!(!is_intact(key.as_bytes(), &payload(&other)));
        assert_ne!(checksum(&bytes), checksum(&payload(&other)));
    }
}
