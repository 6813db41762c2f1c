//! The client side of the ncclNet ABI, for the tools in `src/bin` and the tests: open the
//! plugin the way NCCL does (`loader`) and drive it through any ABI version the way NCCL's
//! proxy does (`driver`). Not part of the plugin: the library never declares this module;
//! the `ferroce` binary and the tests include it by path.

pub mod driver;
pub mod loader;

/// A small deterministic generator (xorshift64) for test schedules: the same seed gives the
/// same sizes and orders on both sides of a test.
pub struct Rng(pub u64);

impl Rng {
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
}
