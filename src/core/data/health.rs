//! The health of a comm's lanes: which are live, what a failed completion means and whose fault
//! it was, the watchdog that turns a silent peer into an error within a bound, and the prober
//! that tells a dead path from a slow one. The send and receive cores each own one [`Health`].

use std::time::Duration;

use super::*;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum State {
    #[default]
    Free,
    Pending,
    Done,
}

/// Why a comm failed, and on whose side: what decides `ncclSystemError` or `ncclRemoteError`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Our device, NIC or a verb failed (a post, a local protection error, a fatal device).
    Local(String),
    /// The peer or the network: retries exhausted, a remote access error, silence.
    Remote(String),
}

impl Fault {
    #[cold]
    pub fn error(&self) -> Error {
        match self {
            Fault::Local(m) => Error::Local(m.clone()),
            Fault::Remote(m) => Error::Remote(m.clone()),
        }
    }
}

/// Whether a failed completion's status (`ibv_wc_status`) is the peer's or the network's doing:
/// a bad response, the remote's invalid-request, access, operation or abort errors, retries or
/// RNR retries exhausted, a response timeout. Every other status (local length, QP, protection
/// or access errors, a flush, a fatal or general error) is our own side's.
pub(super) fn remote_status(status: u32) -> bool {
    matches!(status, 7 | 9 | 10 | 11 | 12 | 13 | 15 | 16 | 20)
}

/// The hint attached to a failed completion.
pub(super) fn hint(status: u32) -> &'static str {
    match status {
        12 => {
            "retry exceeded: the peer stopped answering; check the GID, MTU, PFC/ECN and NCCL_IB_TIMEOUT"
        }
        13 => "RNR retry exceeded: the peer had no receive posted",
        10 | 11 | 4 => {
            "protection/access error: the peer's registration is gone (its process or device \
             may have died), or a buffer was not registered"
        }
        5 => "flushed: an earlier error moved the queue pair to the error state",
        1 | 2 | 8 => {
            "local error: a work request this NIC could not execute (a buffer outside its \
             registration, or the queue pair in a bad state); see dmesg"
        }
        _ => "see `rdma resource show qp` and dmesg",
    }
}

/// The bits of `n` lanes (or chunks): the first `n`. Below 64, one 64-bit shift: a `u128`
/// shift by a variable is about ten instructions, and this runs a few times per message.
#[inline]
pub(super) fn lanes_mask(n: usize) -> u128 {
    if n < 64 { u128::from((1u64 << n) - 1) } else { u128::MAX >> (MAX_CHUNKS - n) }
}

/// The first lane set in `alive`, of `n`. A comm never takes out its last lane (it fails
/// instead), so one is set; were none, the answer would still be a lane (the last), in range.
pub(super) fn first_live(alive: u128, n: usize) -> usize {
    (alive.trailing_zeros() as usize).min(n - 1)
}

/// The WARN for lane `lane` of `what` (the send comm to ..., the receive comm from ...), whose
/// path failed with completion `c`; `then` says what moves where.
pub(super) fn lane_warning(path: &Path, what: &str, lane: usize, why: &str, then: &str) -> String {
    let sport = path.sports.get(lane).map_or(String::new(), |p| format!(" (UDP source port {p})"));
    let port = path.ports.get(lane).map_or(String::new(), |p| format!(" on {p}"));
    format!(
        "lane {lane}{port}{sport} of {what} failed: {why} on {}; {then}, and the comm goes on. \
         Check the link or ECMP member on that path: the port's link, a switch port, cable or \
         hash bucket that drops this source port",
        path.describe
    )
}

/// `IBV_WC_WR_FLUSH_ERR`.
pub(super) const FLUSHED: u32 = 5;

/// `IBV_WC_LOC_QP_OP_ERR`: the queue pair could not execute a request (on Soft-RoCE, what
/// every request of a port whose link is down gets).
pub(super) const LOCAL_QP_ERROR: u32 = 2;

/// `IBV_WC_REM_INV_REQ_ERR`: the peer's queue pair refused a request as malformed, and both
/// ends of the lane are in the error state.
pub(super) const REMOTE_INVALID: u32 = 9;

/// A failed completion that is its lane's failure, not the comm's: retries exhausted
/// (`IBV_WC_RETRY_EXC_ERR`: the path stopped answering), a local queue-pair error (its port
/// went down, or the QP broke on its own), flushed (the first failed completion of a lane
/// that is flushed: its QP failed on its own, see `lane_failed`), or the peer's queue pair
/// refusing a request as invalid. The last is what rxe (6.1) answers, now and then, when the
/// path reorders a queue pair's packets: its responder loses track of a write's packets. It
/// breaks that queue pair alone, at both ends, and nothing of the refused request after the
/// refused packet lands, so the lane's chunks are fenced and settled like a dead path's.
pub(super) fn lane_status(status: u32) -> bool {
    matches!(status, 12 | LOCAL_QP_ERROR | FLUSHED | REMOTE_INVALID)
}

/// Why a completion failed a lane, for its WARN.
pub(super) fn completion_why(c: &Completion) -> String {
    format!("{} (status {})", status_name(c.status), c.status)
}

/// A line for the log: what failed (WARN), or what came back (INFO).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Line {
    Warn(String),
    Info(String),
}

/// Where a comm's traffic goes, for error messages and statistics.
#[derive(Clone, Debug, Default)]
pub struct Path {
    /// The peer's setup address.
    pub peer: String,
    /// GIDs, MTU, traffic class, timeout and retry: what to check when it fails.
    pub describe: String,
    /// The UDP source port of each QP.
    pub sports: Vec<u16>,
    /// The local port each QP is on (`rxe1 port 1`), named when its lane fails.
    pub ports: Vec<String>,
}

/// Turns "work posted, nothing completes" into an error after `timeout`. It never reads a
/// clock: the caller passes `now` when the CQ was found empty (a coarse clock is enough for a
/// timeout of seconds, and a precise one costs microseconds per read in some VMs).
pub(super) struct Watchdog {
    pub(super) outstanding: usize,
    /// Completions taken in so far, and how many there were when `since` was set.
    pub(super) completions: u64,
    pub(super) seen: u64,
    /// When the watchdog last saw progress (or work start) while work was outstanding.
    pub(super) since: Option<Duration>,
    pub(super) timeout: Duration,
}

impl Watchdog {
    pub(super) fn new(timeout: Duration) -> Watchdog {
        Watchdog { outstanding: 0, completions: 0, seen: 0, since: None, timeout }
    }

    pub(super) fn posted(&mut self) {
        self.outstanding += 1;
    }

    pub(super) fn completed(&mut self, all_done: bool) {
        self.completions += 1;
        if all_done {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }

    /// What the watchdog finds at `now`: nothing with nothing outstanding (the common case,
    /// inline), else [`Self::waiting`].
    #[inline]
    pub(super) fn check(&mut self, now: Duration, path: &Path) -> Option<String> {
        if self.outstanding == 0 {
            self.since = None;
            return None;
        }
        self.waiting(now, path)
    }

    /// With work outstanding: an error once no completion came for the timeout.
    fn waiting(&mut self, now: Duration, path: &Path) -> Option<String> {
        match self.since {
            Some(since) if self.completions == self.seen => {
                (now.saturating_sub(since) > self.timeout).then(|| {
                    format!(
                        "no completion from {} for {} ms with {} operations outstanding \
                         (FERROCE_PROGRESS_TIMEOUT_MS): the peer or its device is gone, or the \
                         path drops everything; check the GID, MTU, PFC/ECN and NCCL_IB_TIMEOUT \
                         on {}",
                        path.peer,
                        self.timeout.as_millis(),
                        self.outstanding,
                        path.describe
                    )
                })
            }
            _ => {
                self.seen = self.completions;
                self.since = Some(now);
                None
            }
        }
    }
}

/// When to probe a quiet peer: after `interval` of waiting with no completion at all.
pub(super) struct Prober {
    pub(super) interval: Duration,
    /// Completions seen so far, and when (and at which count) the current quiet spell began.
    pub(super) activity: u64,
    pub(super) quiet: Option<(Duration, u64)>,
    /// The lanes with a probe in flight (one round at a time).
    pub(super) out: u128,
}

impl Prober {
    /// Whether to post a probe now: waiting, quiet for `interval`, none in flight.
    pub(super) fn due(&mut self, now: Duration, waiting: bool, interval: Duration) -> bool {
        if !waiting || self.out != 0 {
            self.quiet = None;
            return false;
        }
        match self.quiet {
            Some((since, seen)) if seen == self.activity => now.saturating_sub(since) >= interval,
            _ => {
                self.quiet = Some((now, self.activity));
                false
            }
        }
    }
}

/// What both ends share: the first failure (every later call reports it), the watchdog and
/// the liveness prober.
pub(super) struct Health {
    pub(super) fatal: Option<Fault>,
    /// Per lane: its life, tagged into every work request posted on it ([`tagged`]).
    pub(super) life: Vec<u8>,
    pub(super) watchdog: Watchdog,
    pub(super) prober: Prober,
    pub(super) stall: stall::Stall,
    /// A stall wants a witness: the next probe goes out at once, on each live lane with none
    /// in flight, whatever else is in flight.
    pub(super) witness: bool,
    /// Our member ports whose link is down (bit `m` for member `m`): their lanes are fenced.
    pub(super) ports_down: u64,
    pub(super) path: std::sync::Arc<Path>,
    pub(super) traffic: Traffic,
    /// Our member ports whose link is down, named (`rxe1 port 1`): a local queue-pair error
    /// is then the network's failure, not ours.
    pub(super) links_down: Option<String>,
}

impl Health {
    pub(super) fn new(p: &Params) -> Health {
        Health {
            traffic: Traffic::new(p.nqps),
            links_down: None,
            fatal: None,
            life: vec![0; p.nqps],
            watchdog: Watchdog::new(p.progress_timeout),
            prober: Prober { interval: p.probe_interval, activity: 0, quiet: None, out: 0 },
            // A lane fenced for a stall may have been slow, not dead: only repair brings it
            // back, so without repair only the retry bound takes a lane out. No lane's bound
            // outgrows half the watchdog's (unless the floor is more): a lane alone busy is
            // found before it fires.
            stall: stall::Stall::new(
                p.nqps,
                p.stall.filter(|_| p.repair.attempts > 0),
                p.progress_timeout / 2,
            ),
            witness: false,
            ports_down: 0,
            path: p.path.clone(),
        }
    }
}

impl Health {
    #[inline]
    pub(super) fn check(&self) -> Result<()> {
        self.fatal.as_ref().map_or(Ok(()), |f| Err(f.error()))
    }

    /// Records `f` unless the comm already failed; returns the comm's (first) error.
    pub(super) fn fail(&mut self, f: Fault) -> Error {
        self.fatal.get_or_insert(f).error()
    }

    /// A post that failed leaves the queue pairs in an unknown state: the comm is unusable
    /// from now on, and every request still pending fails with this error.
    pub(super) fn post_failed(&mut self, e: Error) -> Error {
        let f = Fault::Local(format!(
            "{e} (posting work to {}); the connection is unusable from now on",
            self.path.peer
        ));
        self.fail(f)
    }

    /// Records the first failed completion; `true` if `c` succeeded. A probe's completion is
    /// taken here too.
    #[inline(always)]
    pub(super) fn completion(&mut self, c: &Completion) -> bool {
        self.prober.activity += 1;
        let (kind, lane) = (wr_kind(c.wr_id), wr_lane(c.wr_id));
        if c.status != 0 {
            self.failed(c, kind == WR_PROBE, lane);
            return false;
        }
        if kind != WR_FLUSH {
            self.stall.completed(lane);
        }
        if kind == WR_PROBE {
            self.probe_done(lane);
            return false;
        }
        true
    }

    fn probe_done(&mut self, lane: usize) {
        self.prober.out &= !(1u128 << (lane % MAX_CHUNKS));
        self.watchdog.completed(true);
    }

    /// A failed completion: counted on its lane, and the comm's first failure.
    #[cold]
    fn failed(&mut self, c: &Completion, probe: bool, lane: usize) {
        if let Some(l) = self.traffic.lanes.get_mut(lane) {
            l.errors += 1;
        }
        if probe {
            self.probe_done(lane);
        }
        if self.fatal.is_none() {
            let down = self.links_down.as_ref().filter(|_| c.status == LOCAL_QP_ERROR);
            let class = if remote_status(c.status) || down.is_some() {
                Fault::Remote
            } else {
                Fault::Local
            };
            let hint = match down {
                Some(ports) => format!("the link of {ports} is down: a network failure"),
                None => hint(c.status).to_string(),
            };
            self.fatal = Some(class(format!(
                "completion error with {}{}: {} (status {}, vendor_err {:#x}, wr {:#x}) on {}: {}",
                self.path.peer,
                if probe { " (liveness probe of a quiet peer)" } else { "" },
                status_name(c.status),
                c.status,
                c.vendor_err,
                c.wr_id,
                self.path.describe,
                hint
            )));
        }
    }

    /// Posts a zero-length RDMA write to the peer on each of `lanes` (the live ones with room)
    /// when one is due: every path is checked at once, so a dead peer fails the comm within one
    /// retry bound however many lanes it has, and a dead path is found even while its lane is
    /// idle. `lanes` gives them, asked only once a probe is due; `target` is a region of the
    /// peer's this comm may write (a zero-length write checks no key anyway). A stall's
    /// witness is probed for at once ([`Self::stalled`]). The lanes probed.
    pub(super) fn probe(
        &mut self,
        now: Duration,
        (waiting, soon): (bool, bool),
        io: &mut impl Post,
        (lanes, target): (impl FnOnce() -> u128, impl Fn(usize) -> (u64, u32)),
    ) -> Result<u128> {
        let witness = std::mem::take(&mut self.witness);
        if !(witness || waiting) {
            self.prober.quiet = None; // as `due` finds it: nothing waited for, nothing due
            return Ok(0);
        }
        // Soon: a sender that waits for a CTS probes after the stall bound's floor, so that a
        // silent path under the receiver's CTS rows is found by its probe stalling.
        let interval = match self.stall.floor() {
            Some(floor) if soon => floor.min(self.prober.interval),
            _ => self.prober.interval,
        };
        if self.fatal.is_some() || !(witness || self.prober.due(now, waiting, interval)) {
            return Ok(0);
        }
        // The lanes are looked at only once a probe is due.
        let lanes = lanes() & !self.prober.out;
        if lanes == 0 {
            return Ok(0);
        }
        for lane in (0..MAX_CHUNKS).filter(|&q| lanes & (1 << q) != 0) {
            let probe = zero_write(WR_PROBE, (lane, self.life[lane]), target(lane));
            io.send(lane, &[probe]).map_err(|e| self.post_failed(e))?;
            self.prober.out |= 1 << lane;
            self.watchdog.posted();
        }
        self.prober.quiet = None;
        Ok(lanes)
    }

    /// Lane `lane` failed: a probe in flight on it will not complete, and the next probe is
    /// due at once (on the lanes left, while the comm waits): a dead peer takes one retry
    /// bound per lane, not one probe interval too.
    pub(super) fn lane_lost(&mut self, lane: usize) {
        self.stall.reset(lane);
        self.traffic.lanes[lane].errors += 1;
        self.traffic.lanes[lane].down = true;
        self.prober.activity += 1;
        self.prober.quiet = Some((Duration::ZERO, self.prober.activity));
        if self.prober.out & (1 << lane) != 0 {
            self.prober.out &= !(1 << lane);
            self.watchdog.completed(true);
        }
    }

    /// A live lane to fence now, and why: one on a member port whose link went down, or one
    /// that stalled ([`stall`]); with no witness to a stall yet, the next probe is due at once
    /// (on every live lane). `busy`: the live lanes with signaled work outstanding; `on_down`:
    /// the live lanes on a port whose link is down. Never the last live lane: that one keeps
    /// the transport's retry bound.
    pub(super) fn stalled(
        &mut self,
        now: Duration,
        (busy, live, on_down): (u128, u128, u128),
        allowance: impl Fn(usize) -> Duration,
    ) -> Option<(usize, String)> {
        // No lane busy, none on a down port, no wait being timed: nothing to find.
        if busy == 0 && on_down == 0 && self.stall.untimed() {
            return None;
        }
        let verdict = self.stall.check(now, (busy, live), allowance);
        if live.count_ones() < 2 || self.fatal.is_some() {
            return None;
        }
        let (lane, why) = if on_down != 0 && live & !on_down != 0 {
            let lane = on_down.trailing_zeros() as usize;
            let port = self.path.ports.get(lane).map_or("its port", String::as_str);
            (lane, format!("the link of {port} went down (IBV_EVENT_PORT_ERR)"))
        } else {
            match verdict {
                stall::Verdict::Clear => return None,
                stall::Verdict::Witness => {
                    self.witness = true;
                    return None;
                }
                stall::Verdict::Stalled(s) => (
                    s.lane,
                    format!(
                        "it completed nothing for {} ms with work outstanding while lane {} \
                         completed (its stall bound: {} ms, {})",
                        s.waited.as_millis(),
                        s.witness,
                        s.bound.as_millis(),
                        if self.stall.capped(s.bound) {
                            "half the progress deadline, FERROCE_PROGRESS_TIMEOUT_MS"
                        } else {
                            "FERROCE_LANE_STALL_MS"
                        }
                    ),
                ),
            }
        };
        self.traffic.lanes[lane].stalled += 1;
        Some((lane, why))
    }

    /// For a comm with nothing outstanding and no lane busy: whether the timed checks have
    /// nothing to find (no witness wanted, no port down, no wait being timed). Then the
    /// prober's quiet time restarts, as a probe check that is not due restarts it.
    #[inline]
    pub(super) fn at_rest(&mut self) -> bool {
        let rest = !self.witness && self.ports_down == 0 && self.stall.untimed();
        if rest {
            self.prober.quiet = None;
        }
        rest
    }

    /// The live lanes whose member port's link is down.
    pub(super) fn on_down(&self, alive: u128, members: &[(usize, usize)]) -> u128 {
        if self.ports_down == 0 {
            return 0;
        }
        let down = members.iter().enumerate().filter(|(_, m)| self.ports_down & (1 << m.0) != 0);
        down.fold(0u128, |m, (q, _)| m | 1 << q) & alive
    }

    /// After a poll found the CQ empty at `now`: the watchdog, and a failure from elsewhere
    /// (the device, or an async error on one of the comm's queues).
    #[inline(always)]
    pub(super) fn idle(&mut self, now: Duration, elsewhere: Option<Fault>) -> Result<()> {
        if self.fatal.is_none() {
            self.fatal = self.watchdog.check(now, &self.path).map(Fault::Remote).or(elsewhere);
        }
        self.check()
    }
}
