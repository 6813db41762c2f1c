//! ferroce-tools: the client side of the plugin's ncclNet ABI, for the `ferroce` tool and the
//! integration tests. It is a crate of its own so that it is compiled once and never reaches the
//! shipped `.so`: the plugin does not depend on it, only its dev-dependencies do.
//!
//! - [`loader`] opens the plugin the way NCCL does and captures what it logs;
//! - [`driver`] calls it through any ABI version (v6–v12) the way NCCL's proxy thread does;
//! - [`handle`] carries the 128-byte connection handle between processes as hex;
//! - [`proc`] runs the other ranks of a test or benchmark and reads their lines;
//! - [`profiler`] records the net profiler events the plugin reports;
//! - [`wait`] bounds every "call again" loop;
//! - [`out`] writes the tools' tables and JSON;
//! - [`Rng`] gives both sides of a test the same schedule.

pub mod driver;
pub mod handle;
pub mod loader;
pub mod out;
pub mod proc;
pub mod profiler;
pub mod wait;

/// A small deterministic generator (xorshift64) for test schedules: the same seed gives the
/// same sizes and orders on both sides of a test.
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
}
