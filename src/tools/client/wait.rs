//! Bounded waits for the non-blocking ncclNet calls: every "call again" loop of the tools and
//! tests goes through [`until`] or, where one pass polls several requests, [`Stall`].
//!
//! The clock is read once every 1024 idle passes: in the Soft-RoCE VM the clocksource is HPET
//! (TCG leaves the TSC unstable), so a read is a syscall plus an emulated device access, about
//! 4 us, which would slow the spin and be measured as the plugin's latency. An idle pass yields
//! the CPU, as NCCL's proxy thread does after a pass that made no progress: on Soft-RoCE the
//! NIC is kernel threads on the same few cores.

use std::time::{Duration, Instant};

/// How long a polling loop has made no progress, for loops that poll several requests per pass.
#[derive(Default)]
pub struct Stall {
    spins: u32,
    since: Option<Instant>,
}

impl Stall {
    /// Something moved: the bound starts again.
    pub fn moved(&mut self) {
        *self = Stall::default();
    }

    /// Counts one pass that moved nothing and yields the CPU; true once nothing moved for
    /// `limit`.
    pub fn idle(&mut self, limit: Duration) -> bool {
        std::thread::yield_now();
        self.spins = self.spins.wrapping_add(1);
        if !self.spins.is_multiple_of(1024) {
            return false;
        }
        let now = Instant::now();
        now - *self.since.get_or_insert(now) > limit
    }
}

/// Calls `f` until it yields a value, for at most `limit`: the bounded "call again" loop every
/// caller of a non-blocking ncclNet call needs. The error names `what`.
pub fn until<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let mut stall = Stall::default();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if stall.idle(limit) {
            return Err(format!("{what}: no progress within {limit:?}"));
        }
    }
}
