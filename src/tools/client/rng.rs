//! The deterministic generators of the tests' schedules and data: the same seed gives the same
//! sizes, orders and bytes on both sides of a test, in any process. Not for anything that must
//! be unpredictable.

/// xorshift64: small and fast. Its seed must not be 0 (it would stay 0): [`mix`] a seed first
/// where it may be.
pub struct Rng(pub u64);

impl Rng {
    /// The next word. Not `Iterator::next`: the sequence never ends, and an `Option` would only
    /// be unwrapped at every call.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform-ish in `0..n` (`0` for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Fills `buf` with the next words, little-endian, the last one cut short.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let w = self.next().to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }
}

/// SplitMix64's finaliser, made odd: spreads nearby seeds (a counter, a seed with a group
/// number xored in) apart into a valid [`Rng`] seed.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_bytes() {
        let (mut a, mut b) = ([0u8; 13], [0u8; 13]);
        Rng(mix(5)).fill(&mut a);
        Rng(mix(5)).fill(&mut b);
        assert_eq!(a, b);
        let mut r = Rng(mix(5));
        assert_eq!(a[..8], r.next().to_le_bytes());
        assert_eq!(a[8..], r.next().to_le_bytes()[..5]);
        assert_ne!(mix(5), mix(6));
        assert_eq!(mix(0) & 1, 1);
        assert_eq!(Rng(3).below(0), 0);
    }
}
