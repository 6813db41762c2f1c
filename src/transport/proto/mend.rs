//! Lane repair, with no I/O: when a failed lane is tried again, the two words the ends
//! exchange about it, and when it gives up.
//!
//! The sender drives it. After a lane failed it waits (the start delay, doubled by each failed
//! attempt), then rebuilds its end of the lane (its queue pair through RESET back to RTS, with
//! fresh PSNs: [`psns`]) and writes an [`Msg::Ask`] into the receiver's mailbox word through a
//! live lane. The receiver rebuilds its end likewise, posts the lane's receives again, and
//! answers with [`Msg::Done`] in the sender's mailbox word. The sender then probes the rebuilt
//! lane (a zero-length write): once that completes, the lane rejoins. No answer, or no probe
//! completion, within the timeout, or a failed probe, is a failed attempt; after the last one
//! the lane stays out. One lane is repaired at a time, so one word each way is enough.

use std::time::Duration;

/// The repair knobs (`NCCL_IB_RESILIENCY_PORT_RECOVERY_*`).
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// Attempts per failure before the lane stays out (0: no repair).
    pub attempts: u32,
    /// The wait before the first attempt; each failed one doubles it.
    pub delay: Duration,
    /// How long an attempt waits for the peer's answer, and then for the probe.
    pub timeout: Duration,
}

/// Where one lane's repair stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The lane lives (or never failed).
    Live,
    /// Failed: the next attempt is due at `at` (`None`: from the next look at the clock).
    Wait { at: Option<Duration> },
    /// Our end is rebuilt and the peer was asked (message `seq`) at `since`.
    Asked { seq: u16, since: Duration },
    /// Both ends are rebuilt; the lane's probe has been in flight since `since`.
    Proving { since: Duration },
    /// Every attempt failed: the lane stays out.
    Out,
}

/// What the two ends write into each other's mailbox word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Sender to receiver: rebuild your end of `lane` (request `seq`).
    Ask { lane: usize, seq: u16 },
    /// Receiver to sender: done, your end of `lane` may probe it.
    Done { lane: usize, seq: u16 },
}

const ASK: u64 = 0xa5;
const DONE: u64 = 0x5a;

/// The low 32 bits of a mailbox word: a check of the high 32, so that a word never written
/// (0), or one torn by a write still landing, reads as no message.
fn check(high: u64) -> u64 {
    u64::from((high as u32).wrapping_mul(0x9e37_79b1) ^ 0x5eed_f00d)
}

impl Msg {
    pub fn encode(self) -> u64 {
        let (kind, lane, seq) = match self {
            Msg::Ask { lane, seq } => (ASK, lane, seq),
            Msg::Done { lane, seq } => (DONE, lane, seq),
        };
        let high = kind << 24 | (lane as u64 & 0xff) << 16 | u64::from(seq);
        high << 32 | check(high)
    }

    pub fn decode(word: u64) -> Option<Msg> {
        let high = word >> 32;
        if word & 0xffff_ffff != check(high) {
            return None;
        }
        let (lane, seq) = (((high >> 16) & 0xff) as usize, high as u16);
        match high >> 24 {
            ASK => Some(Msg::Ask { lane, seq }),
            DONE => Some(Msg::Done { lane, seq }),
            _ => None,
        }
    }
}

/// The PSNs of request `seq`'s rebuilt lane: (the sender's first, the receiver's first). Each
/// request has its own, so a packet of an earlier life of the lane falls outside the new
/// window.
pub fn psns(seq: u16) -> (u32, u32) {
    let a = (u32::from(seq) + 1).wrapping_mul(0x9e37_79b1) & 0xff_ffff;
    (a, a ^ 0x80_0000)
}

/// The wait before the attempt that follows `tries` failed ones: the delay, doubled by each.
fn wait(policy: Policy, tries: u32) -> Duration {
    policy.delay * (1 << tries.min(16))
}

/// The sender's repair state of every lane.
pub struct Mend {
    pub stage: Vec<Stage>,
    /// Failed attempts since the lane last lived.
    tries: Vec<u32>,
    /// The last request's number.
    seq: u16,
    policy: Policy,
}

impl Mend {
    pub fn new(nqps: usize, policy: Policy) -> Mend {
        Mend { stage: vec![Stage::Live; nqps], tries: vec![0; nqps], seq: 0, policy }
    }

    /// Lane `lane` failed (in use, or in an attempt): `false` if it stays out for good.
    pub fn failed(&mut self, lane: usize) -> bool {
        if self.stage[lane] != Stage::Live {
            self.tries[lane] += 1;
        }
        let out = self.tries[lane] >= self.policy.attempts;
        self.stage[lane] = if out { Stage::Out } else { Stage::Wait { at: None } };
        !out
    }

    /// How long lane `lane` waits for its next attempt.
    pub fn wait(&self, lane: usize) -> Duration {
        wait(self.policy, self.tries[lane])
    }

    /// The failed attempts so far on `lane`.
    pub fn tries(&self, lane: usize) -> u32 {
        self.tries[lane]
    }

    /// Lane `lane`'s probe completed: it lives again.
    pub fn proven(&mut self, lane: usize) {
        self.stage[lane] = Stage::Live;
        self.tries[lane] = 0;
    }

    /// Times the waits that start now, and fails the attempts whose wait ran out. The lanes
    /// whose attempt failed, with why; the caller takes each as [`Self::failed`].
    pub fn tick(&mut self, now: Duration) -> Option<(usize, &'static str)> {
        for (lane, s) in self.stage.iter_mut().enumerate() {
            match *s {
                Stage::Wait { at: None } => {
                    *s = Stage::Wait { at: Some(now + wait(self.policy, self.tries[lane])) };
                }
                Stage::Asked { since, .. } if now.saturating_sub(since) > self.policy.timeout => {
                    return Some((lane, "the peer did not answer the repair request"));
                }
                Stage::Proving { since } if now.saturating_sub(since) > self.policy.timeout => {
                    return Some((lane, "the probe of the rebuilt lane did not complete"));
                }
                _ => {}
            }
        }
        None
    }

    /// The lane whose attempt may start now: none while another is asked (one mailbox word).
    pub fn due(&self, now: Duration) -> Option<usize> {
        if self.stage.iter().any(|s| matches!(s, Stage::Asked { .. })) {
            return None;
        }
        self.stage.iter().position(|s| matches!(s, Stage::Wait { at: Some(at) } if *at <= now))
    }

    /// Lane `lane`'s attempt starts: its request number.
    pub fn ask(&mut self, lane: usize, now: Duration) -> u16 {
        self.seq = self.seq.wrapping_add(1);
        self.stage[lane] = Stage::Asked { seq: self.seq, since: now };
        self.seq
    }

    /// The lane asked, if `word` is the peer's answer to it.
    pub fn answered(&self, word: u64) -> Option<usize> {
        let Some(Msg::Done { lane, seq }) = Msg::decode(word) else { return None };
        let asked = matches!(self.stage.get(lane), Some(Stage::Asked { seq: s, .. }) if *s == seq);
        asked.then_some(lane)
    }

    /// Lane `lane`'s probe is posted.
    pub fn proving(&mut self, lane: usize, now: Duration) {
        self.stage[lane] = Stage::Proving { since: now };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn policy() -> Policy {
        Policy { attempts: 3, delay: ms(100), timeout: ms(1000) }
    }

    #[test]
    fn messages_round_trip_and_garbage_is_no_message() {
        for m in [Msg::Ask { lane: 3, seq: 7 }, Msg::Done { lane: 127, seq: 65535 }] {
            assert_eq!(Msg::decode(m.encode()), Some(m));
            // Any single flipped bit (a torn or corrupt word) is no message.
            for b in 0..64 {
                assert_eq!(Msg::decode(m.encode() ^ 1 << b), None, "bit {b}");
            }
        }
        assert_eq!(Msg::decode(0), None);
        assert_ne!(psns(1), psns(2));
        assert_eq!(psns(9).0 ^ psns(9).1, 0x80_0000);
    }

    #[test]
    fn attempts_back_off_and_end() {
        let mut m = Mend::new(2, policy());
        assert!(m.failed(1));
        assert_eq!(m.tick(ms(0)), None);
        assert_eq!(m.due(ms(99)), None);
        assert_eq!(m.due(ms(100)), Some(1));
        let seq = m.ask(1, ms(100));
        // No answer within the timeout: the attempt fails, and the next waits twice as long.
        assert_eq!(m.answered(Msg::Done { lane: 1, seq: seq + 1 }.encode()), None);
        assert_eq!(m.tick(ms(1100)), None);
        assert_eq!(m.tick(ms(1101)), Some((1, "the peer did not answer the repair request")));
        assert!(m.failed(1));
        assert_eq!(m.tick(ms(1101)), None);
        assert_eq!(m.due(ms(1300)), None);
        assert_eq!(m.due(ms(1301)), Some(1));
        let seq = m.ask(1, ms(1301));
        assert_eq!(m.answered(Msg::Done { lane: 1, seq }.encode()), Some(1));
        m.proving(1, ms(1302));
        assert_eq!(m.tick(ms(2303)), Some((1, "the probe of the rebuilt lane did not complete")));
        assert!(m.failed(1));
        m.tick(ms(2303));
        assert_eq!(m.due(ms(2703)), Some(1));
        m.ask(1, ms(2703));
        assert!(m.tick(ms(3704)).is_some());
        // The third failed attempt is the last: the lane stays out.
        assert!(!m.failed(1));
        assert_eq!(m.stage[1], Stage::Out);
        assert_eq!(m.due(ms(100_000)), None);
    }

    #[test]
    fn a_proven_lane_starts_afresh_and_one_lane_is_asked_at_a_time() {
        let mut m = Mend::new(3, policy());
        assert!(m.failed(0) && m.failed(2));
        m.tick(ms(0));
        assert_eq!(m.due(ms(100)), Some(0));
        m.ask(0, ms(100));
        assert_eq!(m.due(ms(100)), None, "lane 2 waits while lane 0 is asked");
        m.proving(0, ms(101));
        assert_eq!(m.due(ms(101)), Some(2));
        m.proven(0);
        assert_eq!((m.stage[0], m.tries(0)), (Stage::Live, 0));
        // Failing again in use starts the count from zero.
        assert!(m.failed(0));
        assert_eq!(m.tries(0), 0);
        let none = Policy { attempts: 0, ..policy() };
        assert!(!Mend::new(1, none).failed(0), "no attempts: the lane stays out");
    }
}
