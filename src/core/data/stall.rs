//! Stall detection: a lane with signaled work outstanding that completes nothing for its
//! stall bound, while another lane of the comm completes, is taken as dead and fenced at
//! once. The transport's retry bound (about 34 s at NCCL's defaults on a ConnectX, unbounded
//! on Soft-RoCE with a retry count of 7) stays the last resort, for a comm whose lanes are
//! all silent: then the peer, not one path, is what stopped answering.
//!
//! The bound is the floor (`FERROCE_LANE_STALL_MS`), or four times the longest wait for a
//! completion the lane has shown lately (it decays by an eighth per completion), whichever is
//! larger, plus what the lane's oldest chunk needs at its measured rate (the caller's
//! allowance); but never more than the ceiling (half the progress timeout), unless the floor
//! is: a lane that is the only one busy must be found stalled before the watchdog ends the comm
//! for want of any completion, however slow the lane once measured (a rate sampled during a
//! stall can ask for minutes). A floor at or above the ceiling keeps that promise only as far
//! as it is below the timeout. Fencing a lane that was only slow costs its chunks' resend, a
//! fence's round trip, a repair and a WARN, nothing more. A wait counts only while the lane
//! has signaled work outstanding. Another lane must have completed something after the wait
//! began: with no such witness a probe goes out on the other lanes, and a process that was not
//! scheduled, or a peer whose every lane is slow, fences nothing. The clock is the coarse one
//! `idle` is given.

use std::time::Duration;

pub struct Stall {
    /// The floor of every lane's bound; `None`: detection is off.
    floor: Option<Duration>,
    /// The most any lane's bound grows to: the ceiling `new` is given, or the floor if that is
    /// more.
    cap: Duration,
    /// One record per lane (one allocation per comm).
    lanes: Vec<Wait>,
}

/// One lane's waits.
#[derive(Clone, Default)]
struct Wait {
    /// Successful completions taken in, and the count at the last check.
    done: u64,
    seen: u64,
    /// When its count was last seen to move.
    moved: Duration,
    /// Since when it has waited with signaled work outstanding and no completion.
    since: Option<Duration>,
    /// Its longest recent wait that a completion ended.
    typical: Duration,
}

/// A lane found stalled: how long it waited, its bound, and the lane that completed meanwhile.
pub struct Stalled {
    pub lane: usize,
    pub waited: Duration,
    pub bound: Duration,
    pub witness: usize,
}

/// What a check found.
pub enum Verdict {
    Clear,
    /// A lane is past its bound with no witness yet: the other lanes should be probed.
    Witness,
    Stalled(Stalled),
}

impl Stall {
    pub fn new(nqps: usize, floor: Option<Duration>, ceiling: Duration) -> Stall {
        let cap = floor.map_or(ceiling, |f| f.max(ceiling));
        Stall { floor, cap, lanes: vec![Wait::default(); nqps] }
    }

    /// Whether a bound of `bound` is the cap rather than the floor: the ceiling set it.
    pub fn capped(&self, bound: Duration) -> bool {
        bound == self.cap && self.floor.is_some_and(|f| f < self.cap)
    }

    /// The floor of every lane's bound (`None`: detection is off).
    pub fn floor(&self) -> Option<Duration> {
        self.floor
    }

    /// Whether no lane's wait is being timed.
    #[inline(always)]
    pub fn untimed(&self) -> bool {
        self.lanes.iter().all(|w| w.since.is_none())
    }

    /// A request on lane `lane` completed successfully.
    pub fn completed(&mut self, lane: usize) {
        if let Some(w) = self.lanes.get_mut(lane) {
            w.done += 1;
        }
    }

    /// Lane `lane` is out: its wait ends with it.
    pub fn reset(&mut self, lane: usize) {
        self.lanes[lane].since = None;
    }

    /// The bound of lane `lane` before the allowance for its oldest work is added.
    fn base(&self, floor: Duration, lane: usize) -> Duration {
        floor.max(self.lanes[lane].typical * 4).min(self.cap)
    }

    /// At `now`, with `busy` the live lanes that have signaled work outstanding and `live`
    /// the live lanes: the first lane past its bound that another live lane outlived.
    pub fn check(
        &mut self,
        now: Duration,
        (busy, live): (u128, u128),
        allowance: impl Fn(usize) -> Duration,
    ) -> Verdict {
        // No lane busy and none timed: nothing to sample or find. The counts are taken in
        // at the next check that has a busy lane, which starts its waits then, so a
        // completion seen late witnesses none of them (a witness must move after a wait began).
        if busy == 0 && self.untimed() {
            return Verdict::Clear;
        }
        for (q, w) in self.lanes.iter_mut().enumerate() {
            let waiting = busy & (1 << q) != 0;
            if w.done != w.seen {
                if let Some(t) = w.since {
                    let sample = now.saturating_sub(t);
                    w.typical = sample.max(w.typical.saturating_sub(w.typical / 8));
                }
                (w.seen, w.moved) = (w.done, now);
                w.since = waiting.then_some(now);
            } else if waiting {
                w.since.get_or_insert(now);
            } else {
                w.since = None;
            }
        }
        let Some(floor) = self.floor else { return Verdict::Clear };
        let mut verdict = Verdict::Clear;
        let n = self.lanes.len();
        for q in (0..n).filter(|&q| busy & (1 << q) != 0) {
            let Some(t) = self.lanes[q].since else { continue };
            let (waited, base) = (now.saturating_sub(t), self.base(floor, q));
            // The allowance (a float division) only for a wait past the rest of the bound.
            if waited <= base {
                continue;
            }
            let bound = base.saturating_add(allowance(q)).min(self.cap);
            if waited <= bound {
                continue;
            }
            let others = (0..n).filter(|&r| r != q && live & (1 << r) != 0);
            match others.clone().find(|&r| self.lanes[r].moved > t) {
                Some(witness) => {
                    return Verdict::Stalled(Stalled { lane: q, waited, bound, witness });
                }
                None if others.count() > 0 => verdict = Verdict::Witness,
                None => {}
            }
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn stalled(v: Verdict) -> Option<usize> {
        match v {
            Verdict::Stalled(s) => Some(s.lane),
            _ => None,
        }
    }

    #[test]
    fn a_lane_that_waits_past_its_bound_while_another_completes_is_stalled() {
        let mut s = Stall::new(2, Some(ms(100)), ms(60_000));
        assert!(stalled(s.check(ms(0), (0b11, 0b11), |_| ms(0))).is_none());
        s.completed(1);
        assert!(stalled(s.check(ms(50), (0b11, 0b11), |_| ms(0))).is_none());
        assert_eq!(stalled(s.check(ms(101), (0b11, 0b11), |_| ms(0))), Some(0));
    }

    #[test]
    fn without_a_witness_nothing_is_stalled_and_a_probe_is_wanted() {
        // Both lanes silent (the process was not scheduled, or the peer is slow everywhere).
        let mut s = Stall::new(2, Some(ms(100)), ms(60_000));
        s.check(ms(0), (0b11, 0b11), |_| ms(0));
        assert!(matches!(s.check(ms(500), (0b11, 0b11), |_| ms(0)), Verdict::Witness));
        // One lane alone has nobody to outlive it: the retry bound is its last resort.
        let mut one = Stall::new(1, Some(ms(100)), ms(60_000));
        one.check(ms(0), (1, 1), |_| ms(0));
        assert!(matches!(one.check(ms(500), (1, 1), |_| ms(0)), Verdict::Clear));
    }

    #[test]
    fn the_bound_grows_with_the_lanes_own_waits_and_its_allowance() {
        let mut s = Stall::new(2, Some(ms(100)), ms(60_000));
        s.check(ms(0), (0b01, 0b11), |_| ms(0));
        // Lane 0 took 300 ms for one completion: its bound is now 1.2 s.
        s.completed(0);
        s.check(ms(300), (0b01, 0b11), |_| ms(0));
        s.completed(1);
        assert!(stalled(s.check(ms(1000), (0b01, 0b11), |_| ms(0))).is_none());
        assert_eq!(stalled(s.check(ms(1501), (0b01, 0b11), |_| ms(0))), Some(0));
        // An allowance for a big oldest chunk moves the bound likewise.
        let mut a = Stall::new(2, Some(ms(100)), ms(60_000));
        a.check(ms(0), (0b01, 0b11), |_| ms(0));
        a.completed(1);
        assert!(stalled(a.check(ms(200), (0b01, 0b11), |_| ms(500))).is_none());
        assert_eq!(stalled(a.check(ms(601), (0b01, 0b11), |_| ms(500))), Some(0));
    }

    /// A lane whose bound would outgrow the ceiling (a tiny measured rate asks for minutes for
    /// its oldest chunk, or it once waited long) is stalled at the ceiling; a floor above the
    /// ceiling is kept.
    #[test]
    fn no_bound_outgrows_the_ceiling_but_the_floor_stands() {
        let mut s = Stall::new(2, Some(ms(100)), ms(1000));
        s.check(ms(0), (0b01, 0b11), |_| ms(200_000));
        s.completed(1);
        assert!(stalled(s.check(ms(1000), (0b01, 0b11), |_| ms(200_000))).is_none());
        assert_eq!(stalled(s.check(ms(1001), (0b01, 0b11), |_| ms(200_000))), Some(0));
        // Lane 0 once waited 10 s for a completion: four times that is over the ceiling too.
        let mut t = Stall::new(2, Some(ms(100)), ms(1000));
        t.check(ms(0), (0b01, 0b11), |_| ms(0));
        t.completed(0);
        t.check(ms(10_000), (0b01, 0b11), |_| ms(0));
        t.completed(1);
        assert!(stalled(t.check(ms(11_000), (0b01, 0b11), |_| ms(0))).is_none());
        assert_eq!(stalled(t.check(ms(11_001), (0b01, 0b11), |_| ms(0))), Some(0));
        // The user's floor above the ceiling is the bound, whatever the allowance.
        let mut f = Stall::new(2, Some(ms(5000)), ms(1000));
        f.check(ms(0), (0b01, 0b11), |_| ms(200_000));
        f.completed(1);
        assert!(stalled(f.check(ms(5000), (0b01, 0b11), |_| ms(200_000))).is_none());
        assert_eq!(stalled(f.check(ms(5001), (0b01, 0b11), |_| ms(200_000))), Some(0));
        assert!(s.capped(ms(1000)) && !f.capped(ms(5000)) && !s.capped(ms(100)));
    }

    #[test]
    fn an_idle_lane_never_stalls_and_off_means_off() {
        let mut s = Stall::new(2, Some(ms(100)), ms(60_000));
        s.check(ms(0), (0b10, 0b11), |_| ms(0));
        s.completed(1);
        assert!(stalled(s.check(ms(5000), (0b10, 0b11), |_| ms(0))).is_none());
        let mut off = Stall::new(2, None, ms(60_000));
        off.check(ms(0), (0b11, 0b11), |_| ms(0));
        off.completed(1);
        assert!(matches!(off.check(ms(60_000), (0b11, 0b11), |_| ms(0)), Verdict::Clear));
    }
}
