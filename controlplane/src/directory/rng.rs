//! The directory's source of randomness: a BLAKE3 extendable output stream
//! keyed by a 32-byte seed the driver provides (from the OS in production, a
//! constant in tests and simulation, so runs are reproducible). It yields the
//! instance secrets, the hash seeds and the directory epoch.

#[derive(Debug)]
pub(crate) struct Rng {
    stream: blake3::OutputReader,
}

impl Rng {
    pub fn new(seed: [u8; 32]) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key("cxlkv directory 2025 random stream v1");
        hasher.update(&seed);
        Self {
            stream: hasher.finalize_xof(),
        }
    }

    pub fn bytes32(&mut self) -> [u8; 32] {
        let mut out = [0u8; 32];
        self.stream.fill(&mut out);
        out
    }

    pub fn u64(&mut self) -> u64 {
        let mut out = [0u8; 8];
        self.stream.fill(&mut out);
        u64::from_le_bytes(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_determined_by_the_seed() {
        let (mut a, mut b, mut c) = (Rng::new([1; 32]), Rng::new([1; 32]), Rng::new([2; 32]));
        let (x, y, z) = (a.bytes32(), b.bytes32(), c.bytes32());
        assert_eq!(x, y);
        assert_ne!(x, z);
        assert_ne!(a.bytes32(), x, "the stream advances");
    }
}
