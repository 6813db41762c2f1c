//! Send-queue accounting: how many work requests each queue pair's send queue holds, counted as
//! a provider that frees entries only when a later signaled request completes sees them.

use super::ring::Ring;
use super::*;

/// The work requests on one send queue, counted as a provider that frees entries only when a
/// later signaled request completes sees them: every request is held until a signaled one at
/// or after it completes. Completions of one send queue arrive in order.
pub(super) struct SqCount {
    pub(super) posted: u64,
    /// Requests freed so far: everything up to the last signaled one that completed.
    pub(super) freed: u64,
    /// The sequence numbers (`posted` after them) of the signaled requests not yet completed.
    pub(super) signaled: Ring<u64>,
    pub(super) depth: u64,
}

/// The live lanes with room for one more work request.
pub(super) fn room(alive: u128, sq: &[SqCount]) -> u128 {
    let room = sq.iter().enumerate().filter(|(q, c)| alive & (1 << q) != 0 && c.fits(0));
    room.fold(0, |m, (q, _)| m | 1 << q)
}

/// The live lanes with a signaled request outstanding: those that expect a completion.
pub(super) fn busy_lanes(alive: u128, sq: &[SqCount]) -> u128 {
    let mut busy = 0;
    for (q, c) in sq.iter().enumerate() {
        if !c.signaled.is_empty() {
            busy |= 1 << q;
        }
    }
    busy & alive
}

/// The probes [`Health::probe`] posted, one signaled request on each lane of `lanes`.
///
/// [`Health::probe`]: super::health::Health::probe
#[inline(always)]
pub(super) fn probes_posted(sq: &mut [SqCount], mut lanes: u128) {
    while lanes != 0 {
        sq[lanes.trailing_zeros() as usize].posted(1, true);
        lanes &= lanes - 1;
    }
}

impl SqCount {
    pub(super) fn new(depth: usize) -> SqCount {
        SqCount { posted: 0, freed: 0, signaled: Ring::with_capacity(depth), depth: depth as u64 }
    }

    pub(super) fn used(&self) -> u64 {
        self.posted - self.freed
    }

    /// Whether `n` more requests fit, one entry always kept for a liveness probe.
    pub(super) fn fits(&self, n: u64) -> bool {
        self.used() + n < self.depth
    }

    /// Whether the last of `n` requests about to be posted must be signaled.
    pub(super) fn signal_due(&self, n: u64) -> bool {
        let last = self.signaled.back().copied().unwrap_or(self.freed);
        self.posted + n - last >= CTS_SIGNAL_EVERY
    }

    #[inline(always)]
    pub(super) fn posted(&mut self, n: u64, signaled: bool) {
        self.posted += n;
        if signaled {
            self.signaled.push_back(self.posted);
        }
    }

    /// A signaled request completed: it and everything before it are free.
    #[inline(always)]
    pub(super) fn completed(&mut self) {
        if let Some(seq) = self.signaled.pop_front() {
            self.freed = seq;
        }
    }
}
