//! The send side's failover and repair: a lane that fails gives up its chunks, which go out
//! again on a live lane only once the receiver's receipts prove they did not land (a fence),
//! and a repaired lane comes back only once a probe has crossed it. Exactly once is the rule:
//! a write that may still land in a receive NCCL has got back is never sent a second time.

use super::*;

impl SendCore {
    /// Sends again, on live lanes, the chunks whose lane failed; those that do not fit wait.
    /// Inlined: most calls find nothing to send again (a call costs about 20 instructions).
    #[inline]
    pub(super) fn resend(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        if self.resend.is_empty() {
            return Ok(());
        }
        self.resend_queued(stage, io)
    }

    fn resend_queued(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        let at = self.timestamp(io, true);
        while let Some(&(slot, c)) = self.resend.front() {
            if self.slots[slot].pending & (1 << c) == 0 {
                self.resend.pop_front();
                continue;
            }
            let optional = self.slots[slot].nreqs == 1 && self.slots[slot].row[0].optional;
            let q = self.live_lane(usize::from(self.chunk_lane[slot * self.p.nqps + c]));
            let split = self.p.split && !optional;
            // Borrowed, not copied: a slot is most of a kilobyte.
            let s = &self.slots[slot];
            if !self.sq[q].fits(self.wrs_for(slot, &s.bufs[..usize::from(s.nreqs)], split, c)) {
                return Ok(());
            }
            let posted = self.post_chunk(stage, io, (slot, c, q), at);
            posted.map_err(|e| self.health.post_failed(e))?;
            self.resend.pop_front();
        }
        Ok(())
    }

    /// A failed completion on lane `lane`: `true` if it is the lane's failure (retries
    /// exhausted on its path while another lane lives), or work of a lane that already failed;
    /// then nothing fails, and the lane's chunks in flight are sent again on live lanes.
    pub(super) fn lane_failed(&mut self, lane: usize, c: &Completion) -> bool {
        if self.alive & (1u128 << lane) == 0 {
            return true;
        }
        // IBV_WC_RETRY_EXC_ERR: the path stopped answering; IBV_WC_WR_FLUSH_ERR with no
        // failed work before it on the lane: its queue pair failed on its own, and the async
        // event saying so comes later; IBV_WC_REM_INV_REQ_ERR: the peer's queue pair broke on
        // a request it lost track of (see `lane_status`). Anything else (the peer refused an
        // access, our own NIC failed) is not the lane's, and fails the comm as before.
        lane_status(c.status) && self.lane_error(lane, &completion_why(c))
    }

    /// Lane `lane`'s queue pair failed on its own (an asynchronous error event: `why`): as a
    /// lane whose retries ran out, `true` if another lane lives (its work flushed from now on
    /// is ignored), else `false` and the caller fails the comm.
    pub fn lane_error(&mut self, lane: usize, why: &str) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            return true;
        }
        if self.alive & !bit == 0 || !self.p.failover || self.health.fatal.is_some() {
            return false;
        }
        self.drop_lane(lane, why);
        true
    }

    /// Takes lane `lane` out, one WARN: its chunks in flight are held until the receiver has
    /// fenced the lane and said which of them it counted ([`Self::fenced`]).
    pub(super) fn drop_lane(&mut self, lane: usize, why: &str) {
        self.alive &= !(1u128 << lane);
        if self.fence.is_some_and(|f| f.2 == lane) {
            self.fence = None; // asked through this lane: asked again through a live one
        }
        self.mend.lost_via(lane); // likewise a repair request

        self.health.lane_lost(lane);
        self.lanes[lane].failed();
        let chunks = self.held(lane).count();
        // Fenced even with nothing held: the receiver must stop using the lane too (our end
        // now drops what arrives on it, and its writes there would wait for an answer).
        self.unfenced |= 1 << lane;
        let live = self.alive.count_ones();
        let what = format!("the send comm to {}", self.p.path.peer);
        // A live lane's failure counts as an attempt only within the timeout of its last
        // repair (a flapping path).
        let repair = match (self.mend.failed(lane), self.mend.tries(lane) > 0) {
            (true, false) => format!("; it is rebuilt in {} ms", self.mend.wait(lane).as_millis()),
            (true, true) => format!(
                "; it failed within {} ms of its last repair (a flapping path: attempt {} of \
                 NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX), and is rebuilt in {} ms",
                self.p.repair.timeout.as_millis(),
                self.mend.tries(lane),
                self.mend.wait(lane).as_millis()
            ),
            (false, _) if self.p.repair.attempts == 0 => {
                self.health.traffic.lanes[lane].kept_out = true;
                "; it stays out (lane repair is off)".to_string()
            }
            (false, _) => {
                self.health.traffic.lanes[lane].kept_out = true;
                format!(
                    "; it stays out as a flapping path: {} failed repair attempts in a row, a \
                     failure within {} ms of a repair counting as one \
                     (NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX)",
                    self.mend.tries(lane),
                    self.p.repair.timeout.as_millis()
                )
            }
        };
        let then = format!(
            "its {chunks} chunk(s) in flight are held until the receiver has fenced the lane \
             and said which of them it counted; the others go again on the {live} lane(s) \
             left{repair}"
        );
        self.warnings.push_back(Line::Warn(lane_warning(&self.p.path, &what, lane, why, &then)));
    }

    /// Whether a lane that waits to be fenced holds chunks in flight.
    pub(super) fn holding(&self) -> bool {
        (0..self.p.nqps).any(|l| self.unfenced & (1 << l) != 0 && self.held(l).next().is_some())
    }

    /// The chunks in flight on lane `lane`: `(slot, chunk)`.
    pub(super) fn held(&self, lane: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let nqps = self.p.nqps;
        (0..SLOTS).flat_map(move |slot| {
            let pending = self.slots[slot].pending;
            (0..nqps)
                .filter(move |&c| {
                    pending & (1 << c) != 0 && usize::from(self.chunk_lane[slot * nqps + c]) == lane
                })
                .map(move |c| (slot, c))
        })
    }

    /// The fences of failed lanes, one at a time through the mailbox: the answer to the one
    /// asked is settled; then the next is asked through the control lane (or the same again,
    /// as a new request, once the repair timeout passed without an answer: the lane it was
    /// asked through may have lost it). `true` while a fence is under way or waits for the
    /// mailbox: no repair request starts meanwhile.
    pub(super) fn fenced(
        &mut self,
        now: Duration,
        fifo: &impl Words,
        stage: &impl Words,
        io: &mut impl Post,
    ) -> bool {
        if let Some((seq, lane, _, since)) = self.fence {
            if mail(fifo, FIFO_MAIL) == Some(mend::Msg::Fenced { lane, seq }) {
                self.fence = None;
                self.settle(lane, fifo);
            } else if now.saturating_sub(since) > self.p.repair.timeout {
                self.fence = None;
            } else {
                return true;
            }
        }
        if self.unfenced == 0 {
            return false;
        }
        let ctl = self.control_lane();
        if self.mend.asking() || self.alive & (1 << ctl) == 0 || !self.sq[ctl].fits(1) {
            return true; // a repair request's answer or timeout first, or no room yet
        }
        let lane = self.unfenced.trailing_zeros() as usize;
        let seq = self.mend.next_seq();
        let msg = mend::Msg::Fence { lane, seq, via: ctl };
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let wr = mail_wr(msg, stage, SIZE_MAIL, life, &self.remote_sizes, self.p.inline_on(ctl));
        match io.send(ctl, &[wr]) {
            Ok(()) => {
                self.sq[ctl].posted(1, true);
                self.fence = Some((seq, lane, ctl, now));
            }
            Err(e) => {
                self.health.post_failed(e);
            }
        }
        true
    }

    /// The receiver fenced lane `lane` and its receipts are in `fifo`: each chunk held on the
    /// lane counts as delivered where the receiver counted it (or the receive completed), and
    /// goes again, in row order, otherwise. A receive that completed is never written again.
    pub(super) fn settle(&mut self, lane: usize, fifo: &impl Words) {
        let held: Vec<(usize, usize)> = self.held(lane).collect();
        let (mut landed, mut again) = (0, 0);
        for (slot, c) in held {
            let s = &self.slots[slot];
            let idx = s.row[0].idx;
            let w = FIFO_RECEIPTS + 3 * slot;
            let head = fifo.load(w);
            let got = u128::from(fifo.load(w + 1)) | u128::from(fifo.load(w + 2)) << 64;
            let (theirs, open) = (head >> 1, head & 1 == 1);
            let counted = theirs > idx || theirs == idx && (!open || got & (1 << c) != 0);
            if counted {
                self.chunk_done(slot, c);
                landed += 1;
            } else {
                self.resend.push_back((slot, c));
                again += 1;
            }
        }
        let slots = &self.slots;
        self.resend.make_contiguous().sort_by_key(|&(slot, c)| (slots[slot].row[0].idx, c));
        self.unfenced &= !(1 << lane);
        self.health.traffic.lanes[lane].fenced += 1;
        let sport = self.p.path.sports.get(lane).copied().unwrap_or(0);
        self.warnings.push_back(Line::Info(format!(
            "lane {lane} (UDP source port {sport}) of the send comm to {} is fenced at both \
             ends: the receiver counted {landed} of its chunks in flight, {again} go again on \
             the live lanes",
            self.p.path.peer
        )));
    }

    /// Our member ports whose link is down, named (`None`: none), and as bits (`members`,
    /// bit `m` for member port `m`): a local queue-pair error that fails the comm is then a
    /// network failure (`ncclRemoteError`), and the lanes on those ports are fenced while a
    /// lane on another port lives.
    pub fn links_down(&mut self, ports: Option<String>, members: u64) {
        self.health.links_down = ports;
        self.health.ports_down = members;
    }

    /// Our member port `port`'s link is up again: its lanes that wait for a repair attempt, or
    /// stay out after their last, are tried again now (with repair on).
    pub fn port_up(&mut self, port: usize) {
        if self.p.repair.attempts == 0 {
            return;
        }
        let peer = &self.p.path.peer;
        for lane in (0..self.p.nqps).filter(|&q| self.p.members[q].0 == port) {
            let was_out = self.mend.rearm(lane);
            if self.alive & (1 << lane) == 0 {
                self.health.traffic.lanes[lane].kept_out = false;
                let again = if was_out { "out after its attempts" } else { "waiting" };
                self.warnings.push_back(Line::Info(format!(
                    "lane {lane} of the send comm to {peer} ({again}): its port is up again, it \
                     is rebuilt now"
                )));
            }
        }
    }

    /// Lane `lane`'s repair attempt failed (`why`): the next follows, or the lane stays out.
    pub(super) fn attempt_failed(&mut self, lane: usize, why: &str) {
        // The receiver may have rebuilt its end, and may use it: it is fenced again first.
        self.unfenced |= 1 << lane;
        let tries = self.mend.tries(lane) + 1;
        let sport = self.p.path.sports.get(lane).copied().unwrap_or(0);
        let peer = &self.p.path.peer;
        if self.mend.failed(lane) {
            self.warnings.push_back(Line::Info(format!(
                "repair attempt {tries} of lane {lane} (UDP source port {sport}) of the send \
                 comm to {peer} failed: {why}; the next in {} ms",
                self.mend.wait(lane).as_millis()
            )));
            return;
        }
        self.health.traffic.lanes[lane].kept_out = true;
        self.warnings.push_back(Line::Warn(format!(
            "lane {lane} (UDP source port {sport}) of the send comm to {peer} stays out: {tries} \
             repair attempt(s) failed (NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX), the last \
             as {why}. Its path still fails: check the link or ECMP member that carries this \
             source port on {}",
            self.p.path.describe
        )));
    }

    /// Lane repair after an idle poll: attempts whose wait ran out fail; a lane whose peer end
    /// is rebuilt gets its probe; the next due attempt rebuilds our end and asks the peer,
    /// through a live lane, to rebuild its own.
    ///
    /// Inline, for its common case: every lane lives (so none waits, is asked or proves) and
    /// none waits to be fenced, with nothing to do but keep the repair's clock.
    #[inline]
    pub(super) fn repair(
        &mut self,
        now: Duration,
        fifo: &impl Words,
        stage: &impl Words,
        io: &mut impl Post,
    ) {
        if self.alive == self.all && self.fence.is_none() && self.unfenced == 0 {
            return self.mend.saw(now);
        }
        self.mend_lanes(now, fifo, stage, io)
    }

    /// [`Self::repair`] with a lane down or a fence pending.
    fn mend_lanes(
        &mut self,
        now: Duration,
        fifo: &impl Words,
        stage: &impl Words,
        io: &mut impl Post,
    ) {
        let rows = if self.mend.asking() { newest_row(fifo) } else { 0 };
        while let Some((lane, why)) = self.mend.tick(now, rows) {
            self.attempt_failed(lane, why);
        }
        // The answer to the request in flight is taken even while a fence waits for it.
        let target = self.remote_sizes;
        let answer = std::array::from_fn(|i| fifo.load(FIFO_MAIL + i));
        if let Some((lane, seq, qpn)) = self.mend.answered(answer) {
            let at = target.at(0, self.p.members[lane].1);
            let probe = zero_write(WR_MEND, (lane, self.health.life[lane]), at);
            let joined = io.join(lane, qpn, mend::psns(seq));
            match joined.and_then(|()| io.send(lane, &[probe])) {
                Ok(()) => {
                    self.sq[lane].posted(1, true);
                    self.mend.proving(lane, now);
                }
                Err(e) => self.attempt_failed(lane, &format!("its probe was refused: {e}")),
            }
        }
        if self.fenced(now, fifo, stage, io) {
            return;
        }
        let Some(lane) = self.mend.due(now) else { return };
        let ctl = self.control_lane();
        if self.alive & (1 << ctl) == 0 || !self.sq[ctl].fits(1) {
            return; // no live lane to ask through, or no room on it yet
        }
        let seq = self.mend.ask(lane, now, ctl);
        let qpn = match io.fresh(lane) {
            Ok(qpn) => qpn,
            Err(e) => {
                return self.attempt_failed(lane, &format!("a new queue pair failed: {e}"));
            }
        };
        self.health.life[lane] = self.health.life[lane].wrapping_add(1);
        self.sq[lane] = SqCount::new(send_queue(self.p.nqps));
        let ask = mend::Msg::Ask { lane, seq, qpn, via: ctl };
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let ask = mail_wr(ask, stage, SIZE_MAIL, life, &target, self.p.inline_on(ctl));
        match io.send(ctl, &[ask]) {
            Ok(()) => self.sq[ctl].posted(1, true),
            Err(e) => self.attempt_failed(lane, &format!("the request was refused: {e}")),
        }
    }

    /// The probe of rebuilt lane `lane` completed (`c`): the lane rejoins, or the attempt
    /// failed.
    pub(super) fn proven(&mut self, lane: usize, c: &Completion) {
        if !matches!(self.mend.stage[lane], mend::Stage::Proving { .. }) {
            return;
        }
        if c.status != 0 {
            return self.attempt_failed(lane, &format!("its probe failed: {}", completion_why(c)));
        }
        self.sq[lane].completed();
        self.mend.proven(lane);
        self.alive |= 1 << lane;
        self.lanes[lane] = place::Lane::new();
        let t = &mut self.health.traffic.lanes[lane];
        (t.rate, t.down) = (None, false);
        t.repaired += 1;
        let sport = self.p.path.sports.get(lane).copied().unwrap_or(0);
        self.warnings.push_back(Line::Info(format!(
            "lane {lane} (UDP source port {sport}) of the send comm to {} is repaired: a new \
             queue pair at both ends, proven by a probe; it carries traffic again",
            self.p.path.peer
        )));
    }
}
