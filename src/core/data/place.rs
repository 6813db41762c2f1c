//! Path-aware placement: what the sender knows of each lane's path, and where it puts work.
//!
//! Each lane keeps its outstanding bytes and the chunks in flight, oldest first (a QP
//! completes its work in order), and a rate: each completed chunk's bytes over the time the
//! lane spent on it (from its post, or from the lane's previous completion if that came
//! later), smoothed. A lane whose path is slow (delay, losses and their retransmissions, a
//! congested spine) takes longer per byte; a lane stalled by a lost tail packet completes
//! nothing until its retry timer fires, and while its oldest chunk waits longer than the rate
//! explains, the wait is what counts. The clock is a precise one, read once per post and per
//! batch of completions (and only with several lanes); chunks are summed into samples of at
//! least [`MIN_SAMPLE`].
//!
//! Whole messages go on the cheaper of two lanes, the rotation's and one drawn at random (the
//! power of two choices): by rate where one is under a quarter of the other's, else by outstanding
//! bytes. Both modes give a lane under a quarter of the fastest's rate no new work
//! ([`AVOID`]), until its rate is forgotten (a second after its last sample) and it is tried
//! again. In split mode every lane has a chunk of each message and one NIC serves them in its
//! own order, so a lane's time on a chunk starts no earlier than the NIC's last finished chunk
//! of any lane: timed from their posts, the lanes served last measured half the first's rate
//! or less on a busy host (one lane then carried every 4 MiB message of a sweep, the other
//! avoided for 10 s at a time). Split mode still cuts no finer than avoiding a lane, so that
//! the NIC's order is never read as path speed. It also times a lane's wait from the NIC's
//! last finished chunk, and starts to avoid a slow lane only while it holds up the oldest
//! message ([`lags`]): a busy host's absence, charged to the one completion polled after it
//! (or to the chunks still waiting), once left a healthy lane 8% of a sweep's 4 MiB messages.
//! Both modes leave the rotation and equal chunks alone unless a lane is clearly worse
//! ([`CHEAPER`], [`AVOID`]), so a clean fabric's noise changes nothing.

use super::ring::Ring;
use std::time::Duration;

/// Completed chunks are summed into one rate sample until the lane spent this long on them.
const MIN_SAMPLE: Duration = Duration::from_millis(10);
/// A lane not yet measured counts as stalled once its oldest chunk waited this long.
const STALLED: Duration = Duration::from_millis(50);
/// An idle lane's rate is forgotten this long after its last sample, so that a lane avoided
/// for a slow path is tried again (one message) once in a while: the path may have healed,
/// or a healthy lane measured slow by chance.
const FORGET: Duration = Duration::from_secs(1);
/// Whole-message mode leaves the rotation's lane only for one this much cheaper.
const CHEAPER: f64 = 0.75;
/// A lane below this share of the fastest live lane's rate gets no new work at all (until
/// its rate is forgotten): a path that slow is usually lossy, and its mean rate hides the
/// tail: a lost last packet stalls the message for a whole ACK timeout.
const AVOID: f64 = 0.25;
/// The post time of a chunk not timed (too small to be worth a clock read): it gives no
/// sample.
pub const UNTIMED: Duration = Duration::MAX;

/// What placement knows of one lane.
#[derive(Clone, Debug, Default)]
pub struct Lane {
    /// Bytes posted whose final completion has not arrived.
    pub out: u64,
    /// The chunks in flight: when each was posted ([`UNTIMED`] if not timed), and its bytes;
    /// how many of them are timed.
    queue: Ring<(Duration, u64)>,
    timed: usize,
    /// When the lane's last chunk, and its last timed chunk, completed (as far as the clock
    /// knows), and when it last gave a rate sample.
    last: Duration,
    last_timed: Duration,
    sampled: Duration,
    /// Bytes and time of the chunks completed since the last sample.
    acc: (u64, Duration),
    /// Bytes per second, smoothed; `None` until the first sample.
    pub rate: Option<f64>,
}

impl Lane {
    pub fn new() -> Lane {
        Lane { queue: Ring::with_capacity(64), ..Lane::default() }
    }

    #[inline(always)]
    pub fn posted(&mut self, now: Duration, bytes: u64) {
        self.out += bytes;
        self.queue.push_back((now, bytes));
        self.timed += usize::from(now != UNTIMED);
    }

    /// What the lane's oldest chunk in flight needs, four times over, at the lane's measured
    /// rate (at 4 MB/s where unmeasured): a stall bound's allowance for a big chunk on a slow
    /// path.
    pub fn allowance(&self) -> Duration {
        let Some(&(_, bytes)) = self.queue.front() else { return Duration::ZERO };
        let rate = self.rate.filter(|r| *r > 0.0).unwrap_or(4e6);
        Duration::from_secs_f64((4.0 * bytes as f64 / rate).min(3600.0))
    }

    /// Whether a timed chunk is in flight (its completion wants the clock).
    pub fn timing(&self) -> bool {
        self.timed > 0
    }

    /// The lane's oldest chunk completed at `now`; `shared`: when the NIC last finished a
    /// chunk of another lane that this one waited behind (split mode: every lane has a chunk
    /// of each message, and one NIC serves them in its own order), else zero. Whether the
    /// chunk was timed: its time went into the lane's sample, which made a new rate only once
    /// it held [`MIN_SAMPLE`] with bytes in it (one of empty chunks alone is dropped).
    #[inline(always)]
    pub fn retired(&mut self, now: Duration, shared: Duration) -> bool {
        let Some((at, bytes)) = self.queue.pop_front() else { return false };
        self.out = self.out.saturating_sub(bytes);
        self.last = self.last.max(now);
        if at == UNTIMED {
            return false;
        }
        self.timed -= 1;
        let spent = now.saturating_sub(at.max(self.last_timed).max(shared));
        self.last_timed = now;
        self.acc = (self.acc.0 + bytes, self.acc.1 + spent);
        // Time spent on empty chunks alone measures no rate: read as the floor of 1 B/s, it
        // would stretch the lane's stall allowance (its oldest chunk at this rate, four times
        // over) to the hour's cap, and a silent path under it would not be fenced.
        if self.acc.1 >= MIN_SAMPLE && self.acc.0 == 0 {
            self.acc = (0, Duration::ZERO);
        } else if self.acc.1 >= MIN_SAMPLE {
            let sample = (self.acc.0 as f64 / self.acc.1.as_secs_f64()).max(1.0);
            self.acc = (0, Duration::ZERO);
            // Down fast, up slowly: a stall (a lost tail packet waits out an ACK timeout) is
            // the signal of a lossy path, and its mean rate hides it.
            let keep = |r: f64| if sample < r { 0.5 } else { 0.75 };
            self.rate = Some(self.rate.map_or(sample, |r| keep(r) * r + (1.0 - keep(r)) * sample));
            self.sampled = now;
        }
        true
    }

    /// Whether a chunk is in flight: its wait makes the lane's effective rate change with time.
    pub fn busy(&self) -> bool {
        !self.queue.is_empty()
    }

    /// The lane failed: nothing of it is in flight any more.
    pub fn failed(&mut self) {
        self.out = 0;
        self.queue.clear();
        self.timed = 0;
        self.acc = (0, Duration::ZERO);
    }

    /// The rate to count on at `now`: the measured one, or less while the oldest chunk has
    /// waited longer than it explains (a stall); `None` if neither is known. `shared`: as in
    /// [`Self::retired`], the wait starts no earlier.
    pub fn effective(&self, now: Duration, shared: Duration) -> Option<f64> {
        if self.queue.is_empty() && now.saturating_sub(self.sampled) > FORGET {
            return None;
        }
        let since = |at: Duration| at.max(self.last).max(shared);
        let waited = self.queue.front().map(|&(at, _)| now.saturating_sub(since(at)));
        let stall = waited.filter(|w| !w.is_zero()).map(|w| self.out as f64 / w.as_secs_f64());
        // Not yet a full sample: what completed so far bounds the rate from below (chunks
        // that complete within a tick of the coarse clock take no time on it).
        let partial =
            (self.acc.0 > 0).then(|| self.acc.0 as f64 / self.acc.1.max(MIN_SAMPLE).as_secs_f64());
        match (self.rate.or(partial), stall) {
            (Some(r), Some(s)) => Some(r.min(s)),
            (None, Some(s)) if waited >= Some(STALLED) => Some(s),
            (r, _) => r,
        }
    }
}

/// Split mode's one NIC, which serves the lanes' chunks one after another: a lane's time on a
/// chunk starts no earlier than the NIC's last finished chunk of any lane. A batch of
/// completions has one clock reading for all of them, so they are given times spread evenly
/// from the last look before (a post or a poll) to that reading, in the order they are taken
/// in. Charged the whole wait at once, the first chunk of a batch bore every descheduled wait
/// of a busy host and the rest nothing: the NIC's first lane, lane 0, measured slow and lost
/// its work.
#[derive(Clone, Copy, Debug, Default)]
pub struct Nic {
    /// When the NIC last finished a chunk.
    last: Duration,
    /// The batch being taken in: from when, to when, its completions, and those taken so far.
    batch: (Duration, Duration, u32, u32),
}

impl Nic {
    /// `completions` were polled at `now`; the process last looked at `looked`.
    pub fn polled(&mut self, looked: Duration, now: Duration, completions: usize) {
        let from = self.last.max(looked).min(now);
        self.batch = (from, now, completions.clamp(1, 1 << 20) as u32, 0);
    }

    /// The next completion of the batch is taken in; its time.
    pub fn taken(&mut self) -> Duration {
        let (from, to, n, k) = &mut self.batch;
        *k = (*k + 1).min(*n);
        *from + (*to - *from) * *k / (*n).max(1)
    }

    /// `lane`'s oldest chunk finished at `at` (from [`Self::taken`]).
    pub fn retired(&mut self, lane: &mut Lane, at: Duration) -> bool {
        let timed = lane.retired(at, self.last);
        self.last = self.last.max(at);
        timed
    }
}

/// Whole-message mode: never a lane to avoid (in `avoid`, from [`avoided`]) while the other
/// is not; else lane `rotation` unless lane `other` holds, with the message, under [`CHEAPER`]
/// of its outstanding bytes (the shorter queue: rates that differ by less than half are noise).
pub fn choose(lanes: &[Lane], avoid: u128, (rotation, other): (usize, usize), bytes: u64) -> usize {
    match (avoid & 1 << rotation != 0, avoid & 1 << other != 0) {
        (true, false) => return other,
        (false, true) => return rotation,
        _ => {}
    }
    let load = |q: usize| (lanes[q].out + bytes) as f64;
    if load(other) < CHEAPER * load(rotation) { other } else { rotation }
}

/// Whether lane `rotation` is [`choose`]'s pick whatever the other lane: it is not avoided
/// and has nothing outstanding (no other lane holds a message in under its own bytes).
pub fn idle(lanes: &[Lane], avoid: u128, rotation: usize) -> bool {
    avoid & 1 << rotation == 0 && lanes[rotation].out == 0
}

/// Split mode: whether lane `q` lags: its oldest chunk in flight is older than every other
/// live lane's (the others are done with that message, or idle).
fn lags(lanes: &[Lane], alive: u128, q: usize) -> bool {
    let Some(&(at, _)) = lanes[q].queue.front() else { return false };
    let mut others = (0..lanes.len()).filter(|&k| k != q && alive >> k & 1 != 0);
    others.all(|k| lanes[k].queue.front().is_none_or(|&(t, _)| t > at))
}

/// The lanes to avoid: the dead ones and those under [`AVOID`] of the fastest. `split`: in
/// split mode, the lanes avoided before, and the NIC (a lane's wait starts no earlier than
/// its last finished chunk). A lane not avoided before joins them only while it also lags
/// ([`lags`]): every lane has a chunk of each message, so a slow path holds up the oldest
/// message, while a healthy lane that a busy host's absence was charged to (the one
/// completion polled after it) measures slow but is ahead of the others, not behind.
pub fn avoided(lanes: &[Lane], alive: u128, now: Duration, split: Option<(u128, &Nic)>) -> u128 {
    let dead = !alive & super::lanes_mask(lanes.len());
    let shared = split.map_or(Duration::ZERO, |(_, nic)| nic.last);
    let rate = |q: usize| lanes[q].effective(now, shared);
    // One pass for the best and the worst known rate of the live lanes: none is slow unless
    // the worst is, and then a second pass finds which. With no rate known, none is.
    let (mut best, mut worst) = (f64::MIN, f64::MAX);
    for q in 0..lanes.len() {
        if alive >> q & 1 != 0
            && let Some(r) = rate(q)
        {
            (best, worst) = (best.max(r), worst.min(r));
        }
    }
    if worst >= AVOID * best {
        return dead;
    }
    let slow = |q: usize| rate(q).is_some_and(|r| r < AVOID * best);
    let joins = |q| split.is_none_or(|(before, _)| before >> q & 1 != 0 || lags(lanes, alive, q));
    (0..lanes.len()).filter(|&q| slow(q) && joins(q)).fold(dead, |m, q| m | 1 << q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn lane(out: u64, rate: Option<f64>) -> Lane {
        Lane { out, rate, ..Lane::new() }
    }

    #[test]
    fn a_lane_that_takes_longer_per_chunk_measures_slower() {
        let (mut fast, mut slow) = (Lane::new(), Lane::new());
        for i in 0..40 {
            // Four chunks of 1 MB queued on the fast lane retire one per 10 ms; one on the
            // slow lane takes 40 ms.
            for k in 1..=4 {
                fast.posted(ms(40 * i), 1_000_000);
                fast.retired(ms(40 * i + 10 * k), ms(0));
            }
            slow.posted(ms(40 * i), 1_000_000);
            slow.retired(ms(40 * i + 40), ms(0));
        }
        let (f, s) = (fast.rate.unwrap(), slow.rate.unwrap());
        assert!((f - 1e8).abs() < 1e7 && (s - 2.5e7).abs() < 2.5e6, "fast {f}, slow {s}");
        // Chunks shorter than MIN_SAMPLE (a coarse clock's tick) are summed until it is full.
        let mut quick = Lane::new();
        for i in 0..10 {
            quick.posted(ms(4 * i), 4000);
            quick.retired(ms(4 * i + 4), ms(0));
            if i == 2 {
                assert_eq!(quick.rate, Some(1e6));
                break;
            }
            assert_eq!(quick.rate, None);
        }
    }

    /// Time spent on empty chunks alone measures no rate, and leaves the lane's rate and its
    /// stall allowance as they were: read as the floor of 1 B/s, the allowance of a later
    /// 250-byte chunk would have been 1,000 s, and a silent path under it would never be fenced.
    #[test]
    fn empty_chunks_alone_measure_no_rate() {
        let mut l = lane(0, Some(1e6));
        for i in 0..5 {
            l.posted(ms(20 * i), 0);
            assert!(l.retired(ms(20 * i + 15), ms(0)), "timed");
        }
        assert_eq!(l.rate, Some(1e6));
        l.posted(ms(100), 250);
        assert_eq!(l.allowance(), Duration::from_micros(1000));
        // Bytes with them still measure: the empty time counts in their sample.
        let mut m = Lane::new();
        m.posted(ms(0), 0);
        m.posted(ms(0), 10_000);
        m.retired(ms(5), ms(0));
        m.retired(ms(10), ms(0));
        assert_eq!(m.rate, Some(1e6));
    }

    #[test]
    fn a_stalled_lane_counts_as_slow_while_it_waits() {
        let mut l = lane(0, Some(1e8));
        l.posted(ms(1000), 1_000_000);
        assert_eq!(l.effective(ms(1005), ms(0)), Some(1e8), "5 ms for 1 MB is within its rate");
        let e = l.effective(ms(1500), ms(0)).unwrap();
        assert!((e - 2e6).abs() < 1.0, "half a second for 1 MB: {e}");
        // An idle lane's rate is forgotten after FORGET: it gets tried again.
        let mut idle = lane(0, Some(1e6));
        idle.sampled = ms(1000);
        assert_eq!(idle.effective(ms(1000) + FORGET, ms(0)), Some(1e6));
        assert_eq!(idle.effective(ms(1001) + FORGET, ms(0)), None);
        let mut new = Lane::new();
        new.posted(ms(0), 1_000_000);
        assert_eq!(new.effective(ms(10), ms(0)), None, "not measured, not yet stalled");
        new.posted(ms(0), 1_000_000);
        new.retired(ms(2), ms(0));
        assert_eq!(new.effective(ms(2), ms(0)), Some(1e8), "a partial sample bounds it from below");
        assert_eq!(new.effective(ms(100), ms(0)), Some(1e6 / 0.098));
        new.failed();
        assert_eq!((new.out, new.effective(ms(200), ms(0))), (0, None));
    }

    #[test]
    fn a_batch_of_completions_after_a_long_wait_charges_every_lane_alike() {
        // 4 lanes of one NIC, 16 KiB chunks; each round the NIC finishes them in turn 1 ms
        // apart, and every fourth round the process was away for 20 ms and polls them all
        // in one batch, lane 0 first.
        let (mut lanes, mut nic) = (vec![Lane::new(); 4], Nic::default());
        let mut t = ms(0);
        for round in 0..200 {
            for l in &mut lanes {
                l.posted(t, 16 << 10);
            }
            let posted = t;
            if round % 4 == 3 {
                t += ms(20);
                nic.polled(posted, t, 4);
                for l in &mut lanes {
                    let at = nic.taken();
                    nic.retired(l, at);
                }
            } else {
                for l in &mut lanes {
                    let looked = t;
                    t += ms(1);
                    nic.polled(looked, t, 1);
                    let at = nic.taken();
                    assert_eq!(at, t, "one completion: its time is the poll's");
                    nic.retired(l, at);
                }
            }
        }
        let rates: Vec<f64> = lanes.iter().map(|l| l.rate.unwrap()).collect();
        assert_eq!(avoided(&lanes, 0b1111, t, Some((0, &nic))), 0, "rates {rates:?}");
        let (lo, hi) = rates.iter().fold((f64::MAX, 0f64), |(a, b), &r| (a.min(r), b.max(r)));
        assert!(lo > 0.5 * hi, "rates {rates:?}");
    }

    #[test]
    fn a_busy_hosts_absence_charged_to_one_lane_avoids_none_in_split_mode() {
        // 4 lanes of one NIC, a 256 KiB chunk each per message, finished in turn 1 ms apart.
        // Two rounds in three, the process is away for 100 ms right before it polls lane 1's
        // completion, alone: lane 1 is charged the absence and measures slow.
        let (mut lanes, mut nic) = (vec![Lane::new(); 4], Nic::default());
        let (mut t, mut split, mut whole) = (ms(0), 0u128, 0u128);
        for round in 0..60 {
            for l in &mut lanes {
                l.posted(t, 256 << 10);
            }
            for q in 0..4 {
                let looked = t;
                t += ms(1) + if q == 1 && round % 3 != 0 { ms(100) } else { ms(0) };
                nic.polled(looked, t, 1);
                let at = nic.taken();
                nic.retired(&mut lanes[q], at);
                split = avoided(&lanes, 0b1111, t, Some((split, &nic)));
                whole |= avoided(&lanes, 0b1111, t, None);
                assert_eq!(split, 0, "round {round}, lane {q}: {lanes:?}");
            }
        }
        let rates: Vec<f64> = lanes.iter().map(|l| l.rate.unwrap()).collect();
        assert!(rates[1] < AVOID * rates[0], "lane 1 measures slow: {rates:?}");
        // Without the NIC's view and the lag (whole-message mode's rule, split mode's before),
        // lane 1 is avoided for its rate, and lanes 2 and 3 for their wait behind the absence.
        assert_eq!(whole, 0b1110);
    }

    #[test]
    fn the_rotation_keeps_its_lane_unless_the_other_is_clearly_cheaper() {
        let now = Duration::ZERO;
        let even = [lane(2 << 20, Some(1e8)), lane(2 << 20, Some(1.9e8))];
        assert_eq!(
            choose(&even, avoided(&even, 0b11, now, None), (0, 1), 1 << 20),
            0,
            "rates within 2x: noise"
        );
        let slow = [lane(0, Some(1e7)), lane(2 << 20, Some(1e8))];
        assert_eq!(choose(&slow, avoided(&slow, 0b11, now, None), (0, 1), 1 << 20), 1);
        // Under a quarter of the fastest: avoided however loaded the other lane is.
        let loaded = [lane(0, Some(2e7)), lane(64 << 20, Some(1e8))];
        assert_eq!(choose(&loaded, avoided(&loaded, 0b11, now, None), (0, 1), 1 << 20), 1);
        assert_eq!(choose(&loaded, avoided(&loaded, 0b11, now, None), (1, 0), 1 << 20), 1);
        // Nothing measured yet: outstanding bytes decide.
        let queued = [lane(8 << 20, None), lane(0, None)];
        assert_eq!(choose(&queued, avoided(&queued, 0b11, now, None), (0, 1), 1 << 20), 1);
    }

    #[test]
    fn an_idle_rotation_lane_is_chosen_whatever_the_other() {
        // Every load of the other lane, every avoid mask, and messages of 0 bytes up: where
        // `idle` says so, `choose` picks the rotation's lane; and it says so exactly for an
        // idle lane that is not avoided.
        for other in [0, 1, 4096, 64 << 20] {
            for avoid in [0b00, 0b01, 0b10, 0b11] {
                for bytes in [0, 8, 1 << 20] {
                    for mine in [0, 8] {
                        let lanes = [lane(mine, Some(1e8)), lane(other, None)];
                        let idle = idle(&lanes, avoid, 0);
                        assert_eq!(idle, mine == 0 && avoid & 1 == 0);
                        if idle {
                            let got = choose(&lanes, avoid, (0, 1), bytes);
                            assert_eq!(got, 0, "other {other}, avoid {avoid:#b}, {bytes} B");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_lane_under_a_quarter_of_the_fastest_gets_no_chunk_nor_does_a_dead_one() {
        let now = Duration::ZERO;
        // Healthy lanes of one NIC measure up to 2x apart (the NIC's order, a busy host).
        let clean = [lane(0, Some(1e8)), lane(0, Some(0.4e8)), lane(0, None), lane(0, Some(1e8))];
        assert_eq!(avoided(&clean, 0b1111, now, None), 0);
        let slower = [lane(0, Some(1e8)), lane(0, Some(2e7)), lane(0, Some(1e8)), lane(0, None)];
        assert_eq!(avoided(&slower, 0b1111, now, None), 0b0010);
        assert_eq!(avoided(&clean, 0b1011, now, None), 0b0100);
        // Split mode: a slow lane starts to be avoided only while it holds up the oldest
        // message, and stays avoided once it is.
        let (mut split, nic) = (slower.clone(), Nic::default());
        for (q, lane) in split.iter_mut().enumerate() {
            lane.posted(ms(10), 1 << 20);
            if q != 1 {
                lane.retired(ms(12), ms(0));
            }
        }
        assert_eq!(avoided(&split, 0b1111, ms(12), Some((0, &nic))), 0b0010, "lane 1 holds it up");
        split[1].retired(ms(13), ms(0));
        assert_eq!(avoided(&split, 0b1111, ms(13), Some((0, &nic))), 0, "lane 1 is not behind");
        assert_eq!(avoided(&split, 0b1111, ms(13), Some((0b0010, &nic))), 0b0010, "still avoided");
    }
}
