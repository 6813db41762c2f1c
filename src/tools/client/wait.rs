//! Bounded waits for the non-blocking ncclNet calls: every "call again" loop of the tools and
//! tests goes through [`until`] or, where one pass polls several requests, [`Stall`].
//!
//! The clock is read once every 1024 idle passes: in the Soft-RoCE VM the clocksource is HPET
//! (TCG leaves the TSC unstable), so a read is a syscall plus an emulated device access, about
//! 4 us, which would slow the spin and be measured as the plugin's latency.
//!
//! When a loop gives the CPU away: by default after every pass that moved nothing, which suits
//! the tests (on Soft-RoCE the NIC is kernel threads on the same few cores). [`Stall::nccl`]
//! adds the cadence of NCCL's proxy thread, for `ferroce perf`. That thread spins over its
//! operations. After a pass in which nothing progressed it looks for new operations and, finding
//! none, yields. While passes do progress it looks (and yields when there is nothing new) only
//! on every [`NCCL_APPENDOP_FREQ`]th pass, so a busy stream of completions is not slowed by a
//! lookup and a yield each time.

use std::time::{Duration, Instant};

/// Passes that moved between two yields of NCCL's proxy thread: the default of
/// `NCCL_PROGRESS_APPENDOP_FREQ`.
pub const NCCL_APPENDOP_FREQ: u32 = 8;

/// How long a polling loop has made no progress, for loops that poll several requests per pass;
/// and when the loop yields the CPU (see the module docs).
#[derive(Default)]
pub struct Stall {
    spins: u32,
    since: Option<Instant>,
    /// Also yield after every this many passes in a row that moved (NCCL's proxy); never when
    /// `None`.
    busy_every: Option<u32>,
    /// Passes that moved since the last yield.
    busy: u32,
}

impl Stall {
    /// A stall that yields as NCCL's proxy thread does: after every idle pass, and after every
    /// [`NCCL_APPENDOP_FREQ`]th pass in a row that moved.
    pub fn nccl() -> Stall {
        Stall { busy_every: Some(NCCL_APPENDOP_FREQ), ..Stall::default() }
    }

    /// Something moved: the bound starts again (and, with [`Stall::nccl`], every so many such
    /// passes yield).
    pub fn moved(&mut self) {
        self.spins = 0;
        self.since = None;
        if self.count_busy() {
            std::thread::yield_now();
        }
    }

    /// Counts one pass that moved; true when this one should yield.
    fn count_busy(&mut self) -> bool {
        let Some(every) = self.busy_every else { return false };
        self.busy += 1;
        if self.busy < every {
            return false;
        }
        self.busy = 0;
        true
    }

    /// Counts one pass that moved nothing and yields the CPU; true once nothing moved for
    /// `limit`.
    pub fn idle(&mut self, limit: Duration) -> bool {
        std::thread::yield_now();
        // A yield restarts the count of busy passes, as NCCL's look for new operations does.
        self.busy = 0;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_never_yields_on_progress() {
        let mut s = Stall::default();
        assert!((0..100).all(|_| !s.count_busy()));
    }

    #[test]
    fn nccl_yields_on_every_eighth_busy_pass_counted_from_the_last_yield() {
        let mut s = Stall::nccl();
        let yields: Vec<bool> = (0..16).map(|_| s.count_busy()).collect();
        let at: Vec<usize> = (0..16).filter(|&i| yields[i]).collect();
        assert_eq!(at, [7, 15]);
        // An idle pass yields, so the count starts again from it.
        (0..5).for_each(|_| assert!(!s.count_busy()));
        assert!(!s.idle(Duration::from_secs(60)));
        assert!((0..7).all(|_| !s.count_busy()));
        assert!(s.count_busy());
    }

    #[test]
    fn moved_keeps_the_cadence_and_restarts_the_bound() {
        let mut s = Stall::nccl();
        s.since = Some(Instant::now());
        s.spins = 5;
        s.moved();
        assert_eq!((s.spins, s.since, s.busy_every, s.busy), (0, None, Some(8), 1));
    }
}
