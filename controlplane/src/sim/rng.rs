//! The simulation's only source of randomness: xoshiro256** seeded through
//! splitmix64 from the run's `u64` seed. Self-contained so that a seed means
//! the same run on every build (a crate's generator may change between
//! versions; this one never does).

/// A small, fast, seedable generator (not for secrets).
#[derive(Debug, Clone)]
pub struct SimRng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimRng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Self {
            s: [
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift (bias below 2^-32 for
    /// the small ranges used here).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi);
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// An index into a non-empty collection of `len` items.
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    pub fn bytes32(&mut self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for chunk in out.chunks_mut(8) {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_sequence_forever() {
        let mut a = SimRng::new(42);
        let first: Vec<u64> = (0..3).map(|_| a.next_u64()).collect();
        let mut b = SimRng::new(42);
        assert_eq!(first, (0..3).map(|_| b.next_u64()).collect::<Vec<_>>());
        // Pinned values: a change to the generator would silently change
        // what every recorded seed means.
        assert_eq!(SimRng::new(0).next_u64(), 0x99EC_5F36_CB75_F2B4);
    }

    #[test]
    fn ranges_stay_in_bounds() {
        let mut r = SimRng::new(7);
        for _ in 0..10_000 {
            assert!(r.below(3) < 3);
            let x = r.range(5, 9);
            assert!((5..=9).contains(&x));
        }
    }
}
