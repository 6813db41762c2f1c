//! Lane repair, with no I/O: when a failed lane is tried again, the two words the ends
//! exchange about it, and when it gives up.
//!
//! The sender drives it. After a lane failed it waits (the start delay, doubled by each failed
//! attempt), then replaces its end of the lane with a new queue pair and writes an
//! [`Msg::Ask`], with the new QP's number, into the receiver's mailbox through a live lane. The
//! receiver replaces its end likewise, connects it to the sender's new QP (fresh PSNs:
//! [`psns`]), posts the lane's receives again, and answers with [`Msg::Done`] and its own new
//! QP's number in the sender's mailbox. The sender connects its new QP to that one and probes
//! the lane (a zero-length write): once that completes, the lane rejoins. No answer, or no
//! probe completion, within the timeout, or a failed probe, is a failed attempt; after the last
//! one the lane stays out. One lane is repaired at a time, so one mailbox each way is enough.
//!
//! Before any of that, a failed lane is fenced: the same mailboxes carry [`Msg::Fence`] and its
//! answer [`Msg::Fenced`] (see `SendCore::fenced` in the core), and no repair request is asked
//! while a fence is. A failed attempt is fenced again before the next.

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
    /// Our end is rebuilt and the peer was asked (message `seq`) through lane `via`; the wait
    /// runs since `since`. Once a wait ran out unanswered, `rows` is the newest CTS row that
    /// had landed then, and a second wait runs.
    Asked { seq: u16, since: Duration, via: usize, rows: Option<u64> },
    /// Both ends are rebuilt; the lane's probe has been in flight since `since`.
    Proving { since: Duration },
    /// Every attempt failed: the lane stays out.
    Out,
}

/// What the two ends write into each other's mailbox (two words, one write).
///
/// A request names the lane it went through (`via`: live at the sender when it asked), and
/// its answer goes back through that lane. A lane the sender took out may still look live to
/// the receiver (a stall is the sender's finding alone), and the sender's end of it drops
/// what arrives: an answer sent there would be retried without end, unanswered. Requests are
/// numbered in order (`seq`): one older than the last served may still land late, and is not
/// served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Sender to receiver: replace your end of `lane` and connect it to my new QP `qpn`
    /// (request `seq`).
    Ask { lane: usize, seq: u16, qpn: u32, via: usize },
    /// Receiver to sender: done, my end of `lane` is QP `qpn`; connect yours and probe.
    Done { lane: usize, seq: u16, qpn: u32 },
    /// Sender to receiver: `lane` failed; fence your end of it (nothing more of it may land)
    /// and tell me which of its chunks you counted.
    Fence { lane: usize, seq: u16, via: usize },
    /// Receiver to sender: `lane` is fenced; what I counted is in the receipts, which landed
    /// before this word.
    Fenced { lane: usize, seq: u16 },
}

const ASK: u64 = 0xa5;
const DONE: u64 = 0x5a;
const FENCE: u64 = 0xf5;
const FENCED: u64 = 0x5f;

/// A mailbox's words: 0 and 1.
pub const MAIL_WORDS: usize = 2;

/// The low 32 bits of the first word: a check of everything else, so that a mailbox never
/// written (zeros), or one torn by a write still landing, reads as no message.
fn check(high: u64, low: u64) -> u64 {
    let h = (high as u32).wrapping_mul(0x9e37_79b1) ^ (low as u32).wrapping_mul(0x85eb_ca6b);
    u64::from(h ^ 0x5eed_f00d)
}

impl Msg {
    /// Word 0: the kind, the lane and the request number, then the check; word 1: the QP
    /// number (24 bits) and the lane the request went through (8 bits).
    pub fn encode(self) -> [u64; MAIL_WORDS] {
        let (kind, lane, seq, qpn, via) = match self {
            Msg::Ask { lane, seq, qpn, via } => (ASK, lane, seq, qpn, via),
            Msg::Done { lane, seq, qpn } => (DONE, lane, seq, qpn, 0),
            Msg::Fence { lane, seq, via } => (FENCE, lane, seq, 0, via),
            Msg::Fenced { lane, seq } => (FENCED, lane, seq, 0, 0),
        };
        let high = kind << 24 | (lane as u64 & 0xff) << 16 | u64::from(seq);
        let low = u64::from(qpn & 0xff_ffff) | (via as u64 & 0xff) << 24;
        [high << 32 | check(high, low), low]
    }

    pub fn decode([word, low]: [u64; MAIL_WORDS]) -> Option<Msg> {
        let high = word >> 32;
        if word & 0xffff_ffff != check(high, low) || low > 0xffff_ffff {
            return None;
        }
        let (lane, seq) = (((high >> 16) & 0xff) as usize, high as u16);
        let (qpn, via) = ((low & 0xff_ffff) as u32, (low >> 24) as usize);
        match high >> 24 {
            ASK => Some(Msg::Ask { lane, seq, qpn, via }),
            DONE if via == 0 => Some(Msg::Done { lane, seq, qpn }),
            FENCE if qpn == 0 => Some(Msg::Fence { lane, seq, via }),
            FENCED if low == 0 => Some(Msg::Fenced { lane, seq }),
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
    /// Failed attempts since the lane last lived for a while: a lane that fails again within
    /// the timeout of its repair (a flapping path) counts that as one more.
    tries: Vec<u32>,
    /// When each lane was last repaired.
    repaired: Vec<Option<Duration>>,
    /// The last request's number.
    seq: u16,
    /// The clock at the last [`Self::tick`].
    now: Duration,
    policy: Policy,
}

impl Mend {
    pub fn new(nqps: usize, policy: Policy) -> Mend {
        Mend {
            stage: vec![Stage::Live; nqps],
            tries: vec![0; nqps],
            repaired: vec![None; nqps],
            seq: 0,
            now: Duration::ZERO,
            policy,
        }
    }

    /// Lane `lane` failed (in use, or in an attempt): `false` if it stays out for good.
    pub fn failed(&mut self, lane: usize) -> bool {
        let flapped = |t: Duration| self.now.saturating_sub(t) <= self.policy.timeout;
        if self.stage[lane] != Stage::Live || self.repaired[lane].is_some_and(flapped) {
            self.tries[lane] += 1;
        } else {
            self.tries[lane] = 0;
        }
        let out = self.tries[lane] >= self.policy.attempts;
        self.stage[lane] = if out { Stage::Out } else { Stage::Wait { at: None } };
        !out
    }

    /// Lane `lane`'s port is up again: if it waits or stays out, it is tried afresh, now.
    /// `true` if it was out.
    pub fn rearm(&mut self, lane: usize) -> bool {
        let out = self.stage[lane] == Stage::Out;
        if out || matches!(self.stage[lane], Stage::Wait { .. }) {
            self.tries[lane] = 0;
            self.stage[lane] = Stage::Wait { at: Some(self.now) };
        }
        out
    }

    /// How long lane `lane` waits for its next attempt.
    pub fn wait(&self, lane: usize) -> Duration {
        wait(self.policy, self.tries[lane])
    }

    /// The failed attempts so far on `lane`.
    pub fn tries(&self, lane: usize) -> u32 {
        self.tries[lane]
    }

    /// Lane `lane`'s probe completed: it lives again. Its count of attempts starts afresh
    /// once it lives longer than the timeout.
    pub fn proven(&mut self, lane: usize) {
        self.stage[lane] = Stage::Live;
        self.repaired[lane] = Some(self.now);
    }

    /// Times the waits that start now, and fails the attempts whose wait ran out. The lanes
    /// whose attempt failed, with why; the caller takes each as [`Self::failed`]. `rows`: the
    /// newest CTS row that has landed. A request is answered during the receiving comm's
    /// calls, so its timeout runs twice: the newest row is noted when the first ends (rows
    /// written before the request have landed by then), and the attempt counts as failed only
    /// if a row landed during the second, which shows the receiver was called. Else the
    /// request is asked again, at once, and no attempt is counted, however long NCCL leaves
    /// that comm alone (an answer may also have been lost with the lane it went on).
    pub fn tick(&mut self, now: Duration, rows: u64) -> Option<(usize, &'static str)> {
        self.saw(now);
        for (lane, s) in self.stage.iter_mut().enumerate() {
            match *s {
                Stage::Wait { at: None } => {
                    *s = Stage::Wait { at: Some(now + wait(self.policy, self.tries[lane])) };
                }
                Stage::Asked { seq, since, via, rows: then }
                    if now.saturating_sub(since) > self.policy.timeout =>
                {
                    match then {
                        None => *s = Stage::Asked { seq, since: now, via, rows: Some(rows) },
                        Some(then) if rows > then => {
                            return Some((lane, "the peer did not answer the repair request"));
                        }
                        Some(_) => *s = Stage::Wait { at: Some(now) },
                    }
                }
                Stage::Proving { since } if now.saturating_sub(since) > self.policy.timeout => {
                    return Some((lane, "the probe of the rebuilt lane did not complete"));
                }
                _ => {}
            }
        }
        None
    }

    /// The time is `now` (a lane that fails is timed from it), with every lane live.
    pub fn saw(&mut self, now: Duration) {
        self.now = now;
    }

    /// The lane whose attempt may start now: none while another is asked (one mailbox word).
    pub fn due(&self, now: Duration) -> Option<usize> {
        if self.asking() {
            return None;
        }
        self.stage.iter().position(|s| matches!(s, Stage::Wait { at: Some(at) } if *at <= now))
    }

    /// Lane `lane`'s attempt starts, asked through lane `via`: its request number.
    pub fn ask(&mut self, lane: usize, now: Duration, via: usize) -> u16 {
        let seq = self.next_seq();
        self.stage[lane] = Stage::Asked { seq, since: now, via, rows: None };
        seq
    }

    /// Lane `via` failed: a request asked through it may never have landed, so it is void
    /// (not a failed attempt) and asked again after the lane's wait.
    pub fn lost_via(&mut self, via: usize) {
        for s in &mut self.stage {
            if matches!(*s, Stage::Asked { via: v, .. } if v == via) {
                *s = Stage::Wait { at: None };
            }
        }
    }

    /// A new request number (repair requests and fences share one sequence and one mailbox).
    pub fn next_seq(&mut self) -> u16 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Whether a repair request waits for its answer (the mailbox is in use).
    pub fn asking(&self) -> bool {
        self.stage.iter().any(|s| matches!(s, Stage::Asked { .. }))
    }

    /// The lane asked, its request and the peer's new QP on it, if `mail` is the peer's
    /// answer to it.
    pub fn answered(&self, mail: [u64; MAIL_WORDS]) -> Option<(usize, u16, u32)> {
        let Some(Msg::Done { lane, seq, qpn }) = Msg::decode(mail) else { return None };
        let asked = matches!(self.stage.get(lane), Some(Stage::Asked { seq: s, .. }) if *s == seq);
        asked.then_some((lane, seq, qpn))
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
        let msgs = [
            Msg::Ask { lane: 3, seq: 7, qpn: 17, via: 2 },
            Msg::Done { lane: 127, seq: 65535, qpn: 0xff_ffff },
            Msg::Fence { lane: 5, seq: 300, via: 127 },
            Msg::Fenced { lane: 0, seq: 1 },
        ];
        for m in msgs {
            assert_eq!(Msg::decode(m.encode()), Some(m));
            // Any single flipped bit (a torn or corrupt word) is no message.
            for b in 0..128 {
                let mut w = m.encode();
                w[b / 64] ^= 1 << (b % 64);
                assert_eq!(Msg::decode(w), None, "bit {b}");
            }
            // Half of a newer message landed: no message either.
            let newer = Msg::Ask { lane: 3, seq: 8, qpn: 18, via: 0 }.encode();
            assert_eq!(Msg::decode([m.encode()[0], newer[1]]), None);
        }
        assert_eq!(Msg::decode([0, 0]), None);
        assert_ne!(psns(1), psns(2));
        assert_eq!(psns(9).0 ^ psns(9).1, 0x80_0000);
    }

    #[test]
    fn attempts_back_off_and_end() {
        let mut m = Mend::new(2, policy());
        assert!(m.failed(1));
        assert_eq!(m.tick(ms(0), 1), None);
        assert_eq!(m.due(ms(99)), None);
        assert_eq!(m.due(ms(100)), Some(1));
        let seq = m.ask(1, ms(100), 0);
        // No answer within the timeout, twice, and a CTS row landed during the second (the
        // receiving comm was called): the attempt fails, and the next waits twice as long.
        assert_eq!(m.answered(Msg::Done { lane: 1, seq: seq + 1, qpn: 9 }.encode()), None);
        assert_eq!(m.tick(ms(1100), 1), None);
        assert_eq!(m.tick(ms(1101), 1), None);
        assert_eq!(m.tick(ms(2102), 2), Some((1, "the peer did not answer the repair request")));
        assert!(m.failed(1));
        assert_eq!(m.tick(ms(1101), 2), None);
        assert_eq!(m.due(ms(1300)), None);
        assert_eq!(m.due(ms(1301)), Some(1));
        let seq = m.ask(1, ms(1301), 0);
        assert_eq!(m.answered(Msg::Done { lane: 1, seq, qpn: 9 }.encode()), Some((1, seq, 9)));
        m.proving(1, ms(1302));
        assert_eq!(
            m.tick(ms(2303), 1),
            Some((1, "the probe of the rebuilt lane did not complete"))
        );
        assert!(m.failed(1));
        m.tick(ms(2303), 1);
        assert_eq!(m.due(ms(2703)), Some(1));
        m.ask(1, ms(2703), 0);
        m.tick(ms(3704), 2);
        assert!(m.tick(ms(4705), 3).is_some());
        // The third failed attempt is the last: the lane stays out.
        assert!(!m.failed(1));
        assert_eq!(m.stage[1], Stage::Out);
        assert_eq!(m.due(ms(100_000)), None);
    }

    #[test]
    fn a_proven_lane_starts_afresh_and_one_lane_is_asked_at_a_time() {
        let mut m = Mend::new(3, policy());
        assert!(m.failed(0) && m.failed(2));
        m.tick(ms(0), 1);
        assert_eq!(m.due(ms(100)), Some(0));
        m.ask(0, ms(100), 0);
        assert_eq!(m.due(ms(100)), None, "lane 2 waits while lane 0 is asked");
        m.proving(0, ms(101));
        assert_eq!(m.due(ms(101)), Some(2));
        m.proven(0);
        assert_eq!(m.stage[0], Stage::Live);
        // Failing again in use, once the lane lived longer than the timeout, starts the count
        // from zero.
        m.tick(ms(1102), 1);
        assert!(m.failed(0));
        assert_eq!(m.tries(0), 0);
        let none = Policy { attempts: 0, ..policy() };
        assert!(!Mend::new(1, none).failed(0), "no attempts: the lane stays out");
    }

    /// A request past its timeout with no CTS row landed since: the receiving comm was not
    /// called (NCCL left it alone), so it goes again at once and no attempt is counted.
    #[test]
    fn a_request_the_receiver_had_no_call_to_answer_is_asked_again_uncounted() {
        let mut m = Mend::new(2, policy());
        assert!(m.failed(1));
        m.tick(ms(0), 0);
        m.ask(1, ms(100), 0);
        // Rows written before the request land during the first wait; none during the second.
        assert_eq!(m.tick(ms(1101), 7), None);
        assert_eq!(m.tick(ms(2102), 7), None);
        assert_eq!((m.stage[1], m.tries(1)), (Stage::Wait { at: Some(ms(2102)) }, 0));
        assert_eq!(m.due(ms(2102)), Some(1));
    }

    /// A request asked through a lane that failed is void: the lane waits for its next
    /// attempt with no failed one counted.
    #[test]
    fn a_request_whose_lane_failed_is_asked_again_uncounted() {
        let mut m = Mend::new(3, policy());
        assert!(m.failed(2));
        m.tick(ms(0), 0);
        m.ask(2, ms(100), 1);
        m.lost_via(0);
        assert!(matches!(m.stage[2], Stage::Asked { .. }), "asked through lane 1, not 0");
        m.lost_via(1);
        assert_eq!((m.stage[2], m.tries(2)), (Stage::Wait { at: None }, 0));
    }

    /// A path that comes back and dies again within the timeout, over and over, is not
    /// repaired forever: each such failure is one more failed attempt.
    #[test]
    fn a_flapping_lane_runs_out_of_attempts() {
        let mut m = Mend::new(2, policy());
        let mut t = 0;
        // The first failure is not an attempt's; each quick failure after a repair is.
        for round in 1..=4 {
            let stays = m.failed(1);
            assert_eq!(stays, round < 4, "round {round}");
            if !stays {
                break;
            }
            assert_eq!(m.tries(1) > 0, round > 1, "a failure soon after a repair counts");
            m.tick(ms(t), 1);
            t += 5000;
            let lane = m.due(ms(t)).expect("due");
            m.ask(lane, ms(t), 0);
            m.proving(lane, ms(t));
            m.tick(ms(t + 10), 1);
            m.proven(lane);
            m.tick(ms(t + 500), 1); // fails again half a second later
        }
        assert_eq!(m.stage[1], Stage::Out);
    }

    /// A port that comes back re-arms its lanes that wait or stay out: their count of attempts
    /// starts afresh and the next is due at once; a live lane is left alone.
    #[test]
    fn a_port_back_up_rearms_its_waiting_and_kept_out_lanes() {
        let policy = Policy { attempts: 1, delay: ms(100), timeout: ms(1000) };
        let mut m = Mend::new(3, policy);
        m.tick(ms(5), 1);
        assert!(m.failed(1) && !m.failed(1), "the second failure in a row keeps lane 1 out");
        assert_eq!(m.stage[1], Stage::Out);
        assert!(m.failed(2));
        assert!(m.rearm(1), "lane 1 was out");
        assert!(!m.rearm(2) && !m.rearm(0), "lane 2 waited, lane 0 lives");
        assert_eq!((m.stage[0], m.tries(1), m.tries(2)), (Stage::Live, 0, 0));
        assert_eq!(m.due(ms(5)), Some(1), "due at once");
    }
}
