//! The receive side: the slot table of `irecv`s, the clear-to-send rows written into the
//! sender's FIFO, the receive WQE pools, completion of receives and flushes, and the
//! receiver's part of failover and repair.

use std::collections::VecDeque;
use std::time::Duration;

use super::*;

// --- the receiver -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RecvSlot {
    pub(super) state: State,
    pub(super) n: usize,
    /// The sizes the buffers were posted with: a size the peer reports must not exceed them.
    /// Only the first `n` are the receive's (here and in `sizes`); the rest are left from earlier
    /// receives and never used.
    pub(super) posted: [u64; MAX_RECVS],
    /// The receive's `idx` (`head + 1` when posted).
    pub(super) idx: u64,
    /// The chunks the receive expects (one per lane of the message), and those that arrived.
    pub(super) want: u128,
    pub(super) got: u128,
    pub(super) sizes: [u64; MAX_RECVS],
    /// The last CTS write that reads this slot's row from the stage rather than inline: its
    /// lane, and that lane's count of posted requests with it (0: none in flight). A NIC reads
    /// the row when it executes the write, and again if it retransmits it (an ACK lost, or a
    /// row written again after a lane failed, whose first copy the sender may already have
    /// consumed), so the slot is not staged again (see [`RecvCore::irecv`]) until that write
    /// has completed (it is signaled; a send queue completes in order) or its lane has failed
    /// (its queue pair sends nothing more).
    pub(super) read_by: (usize, u64),
}

/// The receiving end's protocol state.
pub struct RecvCore {
    pub(super) slots: [RecvSlot; SLOTS],
    pub(super) flushes: [State; SLOTS],
    /// Per flush: its reads still in flight (one per member port).
    pub(super) flush_left: [u8; SLOTS],
    pub(super) flush_head: usize,
    pub(super) head: u64,
    pub(super) p: Params,
    /// Where the sender's FIFO is.
    pub(super) remote_fifo: Remote,
    /// Receives waiting for their data (kept, not scanned for, because every empty poll asks).
    pub(super) waiting: usize,
    /// Rows written to the sender's FIFO (`idx` up to this); rows after it up to `head` are
    /// staged, and go out in batches (see [`RecvCore::advertise`]).
    pub(super) advertised: u64,
    /// The highest `idx` the sender is known to have consumed: its receive completed.
    pub(super) consumed: u64,
    /// Each lane's send queue, counted exactly (only the control lane, the first live one,
    /// carries CTS rows and probes).
    pub(super) sq: Vec<SqCount>,
    /// The lanes whose path still answers our CTS writes and probes.
    pub(super) alive: u128,
    /// Rebuilt lanes not yet proven: they take the sender's writes (their receives are
    /// posted), but carry none of our own (no probe, no CTS row) until a receive lands on the
    /// new queue pair, or a request comes through it. Our probe of a lane whose other end is
    /// not yet joined would fail it.
    pub(super) proving: u128,
    /// The lane that carries CTS rows and probes: a live one, moved only when it fails or is
    /// rebuilt (rows that moved must not overtake each other).
    pub(super) ctl: usize,
    /// The last repair or fence request taken.
    pub(super) served: Option<u16>,
    /// The mailbox's words as last decoded: only a change is decoded again (a torn write
    /// decodes as nothing, and its last word changes the words again).
    mail_seen: [u64; mend::MAIL_WORDS],
    /// The request being served, since when: its lane is fenced, and the answer waits until
    /// every receive posted on the lane has come back (landed or flushed), so that the
    /// receipts hold every chunk that landed.
    pub(super) serving: Option<(mend::Msg, Duration)>,
    /// The last fence's answer: its lane, and that lane's count of posted requests with it.
    pub(super) answered: Option<(usize, u64)>,
    /// Where batches are built before posting.
    pub(super) chain: Box<[SendWr; MAX_CHAIN]>,
    /// Receive WQEs posted on each lane and not yet used.
    pub(super) pool: Vec<usize>,
    /// The lanes whose pool is under [`recv_pool`]: what [`Self::refill`] tops up (a bit per
    /// lane, so that the refill before each CTS and after each poll costs one test).
    pub(super) short: u128,
    /// Warnings for the log not yet taken: each lane that failed.
    pub(super) warnings: VecDeque<Line>,
    pub(super) health: Health,
    /// What was posted, for profiler events (only with [`Params::journal`]).
    pub(super) journal: Vec<Posted>,
}

/// Request ids: receives are `0..SLOTS`, flushes `SLOTS..2 * SLOTS`.
pub const FLUSH_BASE: usize = SLOTS;

impl RecvCore {
    pub fn new(mut p: Params, remote_fifo: Remote) -> RecvCore {
        p.split = p.split && p.nqps > 1;
        p.members.resize(p.nqps, (0, 0));
        let health = Health::new(&p);
        RecvCore {
            slots: [RecvSlot::default(); SLOTS],
            flushes: [State::Free; SLOTS],
            flush_left: [0; SLOTS],
            flush_head: 0,
            head: 0,
            remote_fifo,
            waiting: 0,
            advertised: 0,
            consumed: 0,
            sq: (0..p.nqps).map(|_| SqCount::new(RECV_SEND_QUEUE)).collect(),
            alive: lanes_mask(p.nqps),
            proving: 0,
            ctl: 0,
            served: None,
            mail_seen: [0; mend::MAIL_WORDS],
            answered: None,
            serving: None,
            chain: Box::new([SendWr::default(); MAX_CHAIN]),
            pool: vec![0; p.nqps],
            short: lanes_mask(p.nqps),
            warnings: VecDeque::new(),
            journal: Vec::new(),
            health,
            p,
        }
    }

    /// Our member ports whose link is down, named (`None`: none), and as bits (`members`,
    /// bit `m` for member port `m`): a local queue-pair error that fails the comm is then a
    /// network failure (`ncclRemoteError`), and the lanes on those ports are fenced while a
    /// lane on another port lives.
    pub fn links_down(&mut self, ports: Option<String>, members: u64) {
        self.health.links_down = ports;
        self.health.ports_down = members;
    }

    /// Whether the comm should poll before its next call: the CTS queue is half used (its
    /// entries are freed only when a poll takes a signaled completion; a caller that only
    /// posts receives, testing none, would otherwise see its next rows wait for room that
    /// never comes).
    pub fn needs_poll(&self) -> bool {
        self.sq[self.control_lane()].used() >= CTS_SIGNAL_EVERY
    }

    #[inline]
    pub fn check(&self) -> Result<()> {
        self.health.check()
    }

    /// What this end has received: messages, and per QP the bytes and failed completions.
    pub fn traffic(&self) -> &Traffic {
        &self.health.traffic
    }

    /// Posts `bufs` (with their tags) as one multi-receive, staging the CTS row in `stage`.
    /// `optional`: NCCL's LL, which watches the data's flags (honoured for a single buffer):
    /// the row asks to be sent whole, never split; it completes as any receive, when its write
    /// with immediate lands. `Ok(None)`: all slots busy, or the next slot's last row still
    /// read by a CTS write in flight (poll, test, call again).
    pub fn irecv(
        &mut self,
        stage: &impl Words,
        io: &mut impl Post,
        bufs: &[(Buf, i32)],
        optional: bool,
    ) -> Result<Option<usize>> {
        self.check()?;
        let n = bufs.len();
        if !(1..=MAX_RECVS).contains(&n) {
            return Err(Error::Internal(format!("irecv of {n} buffers (1..={MAX_RECVS})")));
        }
        let slot = (self.head % SLOTS as u64) as usize;
        let prev = &self.slots[slot];
        if prev.state != State::Free {
            return Ok(None);
        }
        let (lane, seq) = prev.read_by;
        if seq != 0 && self.sq[lane].freed < seq {
            return Ok(None); // a write in flight may still read the slot's last row
        }
        let optional = optional && n == 1;
        // Every lane keeps its pool full, so that the sender's write-with-immediate finds a
        // receive WQE on whichever lane it comes (posted before the CTS that allows it).
        self.refill(io)?;
        let idx = self.head + 1;
        for (r, (b, tag)) in bufs.iter().enumerate() {
            let nreqs = n as u8;
            let rkeys = b.rkeys;
            let cts = Cts { addr: b.addr, size: b.size, rkeys, tag: *tag, nreqs, optional, idx };
            stage.store_n(entry_word(slot, r), cts.encode());
        }
        // Field by field, and only the receive's `n` buffers (a slot is about 200 bytes): the
        // sizes past `n` are never used, and a receive's own are written when it lands.
        // The chunks it waits for: one per lane split, else the one whole message.
        let want = if self.p.split && !optional { lanes_mask(self.p.nqps) } else { 1 };
        let s = &mut self.slots[slot];
        (s.state, s.n, s.idx, s.want, s.got) = (State::Pending, n, idx, want, 0);
        for (p, (b, _)) in s.posted.iter_mut().zip(bufs) {
            *p = b.size;
        }
        self.waiting += 1;
        self.head += 1;
        self.advertise(stage, io)?;
        Ok(Some(slot))
    }

    /// The lane for CTS rows and probes.
    pub(super) fn control_lane(&self) -> usize {
        self.ctl
    }

    /// Rows posted but not yet written to the sender: only while the control lane's send
    /// queue is full (see [`Self::advertise`]).
    pub fn staged(&self) -> u64 {
        self.head - self.advertised
    }

    /// A failed completion on lane `lane`: `true` if it is the lane's failure (our CTS write or
    /// probe found the path dead while another lane lives), or work of a lane that already
    /// failed (its flushed receive WQEs). Then nothing fails: the rows the sender may not have
    /// seen go again, on the next live lane.
    pub(super) fn lane_failed(&mut self, lane: usize, c: &Completion) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            self.proving &= !bit; // a rebuilt lane that failed before it was proven
            return true;
        }
        // Retries run out (or the peer refuses one as invalid) on our own writes; a flush (a
        // receive's too) is the lane's queue pair failing on its own, or refusing a write of
        // the sender's, its async event (if any) still to come.
        let ours = matches!(wr_kind(c.wr_id), WR_CTS | WR_PROBE | WR_MAIL) || c.status == FLUSHED;
        ours && lane_status(c.status) && self.lane_error(lane, &completion_why(c))
    }

    /// Lane `lane`'s queue pair failed on its own (an asynchronous error event: `why`): `true`
    /// if another lane lives or is being proven (the lane's flushed work is ignored from now
    /// on), else `false` and the caller fails the comm.
    pub fn lane_error(&mut self, lane: usize, why: &str) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            self.proving &= !bit; // a rebuilt lane that failed before it was proven
            return true;
        }
        let last = (self.alive | self.proving) & !bit == 0;
        if last || !self.p.failover || self.health.fatal.is_some() {
            return false;
        }
        self.drop_lane(lane, why);
        true
    }

    /// Takes lane `lane` out; where it carried the CTS rows, they go again on the next.
    pub(super) fn drop_lane(&mut self, lane: usize, why: &str) {
        let control = lane == self.ctl;
        self.forget(lane);
        self.health.lane_lost(lane);
        let what = format!("the receive comm from {}", self.p.path.peer);
        let then = if control {
            format!("its CTS rows move to lane {}", self.ctl)
        } else {
            format!("it carried no CTS rows; they stay on lane {}", self.ctl)
        };
        self.warnings.push_back(Line::Warn(lane_warning(&self.p.path, &what, lane, why, &then)));
    }

    /// Lane `lane`'s queue pair reads the stage no more (it failed, or was replaced): the slots
    /// whose rows its writes read may be staged again.
    fn unread(&mut self, lane: usize) {
        for s in self.slots.iter_mut().filter(|s| s.read_by.0 == lane) {
            s.read_by = (0, 0);
        }
    }

    /// Lane `lane` is out (failed, or about to be rebuilt): its signaled work in flight will
    /// not complete, and where it carried the CTS rows, they go again on the next live lane.
    pub(super) fn forget(&mut self, lane: usize) {
        let bit = 1u128 << lane;
        self.alive &= !bit;
        self.proving &= !bit;
        if self.alive == 0 {
            // Only lanes still to be proven are left: they carry everything now.
            (self.alive, self.proving) = (self.proving, 0);
        }
        // The signaled requests in flight on the lane (CTS writes, a probe, a repair answer)
        // will not complete now: the watchdog stops counting them.
        for _ in 0..self.sq[lane].signaled.len() {
            self.health.watchdog.completed(true);
        }
        self.sq[lane].signaled.clear();
        // Nor does a fence's answer on it: it is owed no longer (the sender asks again, and a
        // rebuilt lane's new count must not be read against the old queue pair's).
        if self.answered.is_some_and(|(q, _)| q == lane) {
            self.answered = None;
        }
        self.unread(lane);
        self.health.prober.out &= !bit;
        if lane == self.ctl {
            // Every row the sender may not have consumed is written again (the same bytes:
            // the sender takes a row by its idx, once).
            self.advertised = self.advertised.min(self.consumed);
            self.ctl = first_live(self.alive, self.p.nqps);
        }
    }

    /// Serves the sender's request in the mailbox word of `sizes`, once: a fence or a repair.
    /// Either fences our end of its lane first (the queue pair to the error state: nothing
    /// more of it lands; the CTS rows move off it where another lane lives) and waits until
    /// the lane's receives have all come back, so that every chunk that landed on it is
    /// counted. Then a repair rebuilds our end (a new queue pair, connected to the sender's,
    /// its receives posted again). The answer goes back through the lane the request came
    /// through (else the control lane), after the receipts: what this end counted
    /// ([`Self::receipts`]).
    #[inline(always)]
    pub(super) fn serve(
        &mut self,
        now: Duration,
        stage: &impl Words,
        sizes: &impl Words,
        io: &mut impl Post,
    ) -> Result<()> {
        // A newer request replaces the one being served: the sender asked again (its lane
        // failed, or the answer took too long), and only the newest is awaited.
        self.take_request(now, sizes, io)?;
        let Some((msg, since)) = self.serving else { return Ok(()) };
        let (mend::Msg::Ask { lane, via, .. } | mend::Msg::Fence { lane, via, .. }) = msg else {
            return Ok(());
        };
        if self.pool[lane] > 0 {
            if now.saturating_sub(since) > self.p.repair.timeout {
                let msg = format!(
                    "lane {lane} of the receive comm from {} was fenced, but {} of its posted \
                     receives did not come back within {} ms: what landed on it cannot be \
                     known, so nothing of it may be sent again; the connection is unusable",
                    self.p.path.peer,
                    self.pool[lane],
                    self.p.repair.timeout.as_millis()
                );
                return Err(self.health.fail(Fault::Local(msg)));
            }
            return Ok(());
        }
        // Back through the lane the request came through, while it lives here.
        let back = if self.alive & (1 << via) != 0 { via } else { self.ctl };
        if back != lane && !self.sq[back].fits(2) {
            return Ok(()); // no room for the answer yet
        }
        self.serving = None;
        let answer = match msg {
            mend::Msg::Ask { seq, qpn: peer, .. } => {
                let Some(qpn) = self.rebuild(lane, seq, peer, io)? else { return Ok(()) };
                mend::Msg::Done { lane, seq, qpn }
            }
            mend::Msg::Fence { seq, .. } => mend::Msg::Fenced { lane, seq },
            _ => return Ok(()),
        };
        self.answer(answer, back, stage, io)
    }

    /// Takes a new fence or repair request from the sender's mailbox, if one is there: the
    /// lane is fenced at once, and answered once its posted receives have all come back.
    fn take_request(
        &mut self,
        now: Duration,
        sizes: &impl Words,
        io: &mut impl Post,
    ) -> Result<()> {
        let mail = mail_words(sizes, SIZE_MAIL);
        if mail == self.mail_seen {
            return Ok(());
        }
        self.mail_seen = mail;
        let Some(msg) = mend::Msg::decode(mail) else { return Ok(()) };
        let (mend::Msg::Ask { lane, seq, via, .. } | mend::Msg::Fence { lane, seq, via }) = msg
        else {
            return Ok(());
        };
        // Only a newer request than the last: an older one can still land late, through a
        // lane the sender has taken out but we have not fenced yet. A lane the comm does not
        // have, or a request through the lane it is about, is a corrupt word.
        if !self.unserved(seq) || lane >= self.p.nqps || via >= self.p.nqps || via == lane {
            return Ok(());
        }
        self.served = Some(seq);
        self.crossed(via);
        if (self.alive | self.proving) & !(1 << lane) == 0 {
            // The lane the request came through failed here since, and the sender takes out
            // the last one this end has: nothing can land or go back any more. Said now, not
            // at the progress deadline (and the control lane is never a lane that is out).
            let msg = format!(
                "the sender, {}, took out lane {lane}, the last lane of this receive comm (lane \
                 {via}, which it asked through, had failed here since): no path is left between \
                 the two ends; the connection is unusable",
                self.p.path.peer
            );
            return Err(self.health.fail(Fault::Remote(msg)));
        }
        // (The control lane lives: were it this one, the lane would be live.)
        debug_assert_ne!(self.alive & (1 << self.ctl), 0);
        if (self.alive | self.proving) & (1 << lane) != 0 {
            self.forget(lane);
        }
        io.fence(lane).map_err(|e| self.health.post_failed(e))?;
        self.serving = Some((msg, now));
        Ok(())
    }

    /// Whether request `seq` is newer than the last one served.
    fn unserved(&self, seq: u16) -> bool {
        self.served.is_none_or(|s| seq.wrapping_sub(s) as i16 > 0)
    }

    /// Whether the sender waits on this end for a fence's answer: one taken and not answered
    /// yet, one in the mailbox not yet looked at (a look takes it, or finds it stale or
    /// corrupt), or the answer still on its way. A comm that closes answers it first: the
    /// sender's last sends may wait for it, and NCCL no longer calls a receiving comm that has
    /// nothing outstanding.
    pub fn owes_answer(&self, sizes: &impl Words) -> bool {
        let fence = |m: Option<mend::Msg>| matches!(m, Some(mend::Msg::Fence { .. }));
        let mail = mail_words(sizes, SIZE_MAIL);
        fence(self.serving.map(|s| s.0))
            || mail != self.mail_seen && fence(mend::Msg::decode(mail))
            || self
                .answered
                .is_some_and(|(q, n)| self.alive & (1 << q) != 0 && self.sq[q].freed < n)
    }

    /// A write from the sender crossed lane `lane`: where that lane was rebuilt and waits to
    /// be proven here, both ends are joined, and it lives. Forced inline: every landed
    /// receive passes here.
    #[inline(always)]
    pub(super) fn crossed(&mut self, lane: usize) {
        if self.proving & (1 << lane) != 0 {
            self.proving &= !(1 << lane);
            self.alive |= 1 << lane;
            self.health.traffic.lanes[lane].down = false;
        }
    }

    /// Writes `answer` with this end's receipts through lane `ctl`.
    fn answer(
        &mut self,
        answer: mend::Msg,
        ctl: usize,
        stage: &impl Words,
        io: &mut impl Post,
    ) -> Result<()> {
        if self.alive & (1 << ctl) == 0 {
            return Ok(()); // no lane to answer through: the sender asks again
        }
        let (ours, theirs) = self.p.members[ctl];
        self.receipts(stage);
        let (remote_addr, rkey) = self.remote_fifo.at(FIFO_RECEIPTS, theirs);
        let len = (RECEIPT_WORDS * 8) as u32;
        let receipts = SendWr {
            wr_id: tagged(wr_id(WR_MAIL, ctl, 0), self.health.life[ctl]),
            op: Op::Write,
            local: Some((stage.addr(FIFO_RECEIPTS), len, stage.lkey(ours))),
            remote_addr,
            rkey,
            inline: len <= self.p.inline_on(ctl),
            ..SendWr::default()
        };
        let fence = matches!(answer, mend::Msg::Fenced { .. });
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let answer =
            mail_wr(answer, stage, FIFO_MAIL, life, &self.remote_fifo, self.p.inline_on(ctl));
        io.send(ctl, &[receipts, answer]).map_err(|e| self.health.post_failed(e))?;
        self.sq[ctl].posted(1, false);
        self.sq[ctl].posted(1, true);
        if fence {
            self.answered = Some((ctl, self.sq[ctl].posted));
        }
        self.health.watchdog.posted();
        Ok(())
    }

    /// Stages what this end counted, for a fence's answer: per slot its receive's
    /// `idx << 1 | open` (still counting chunks) and the chunks counted.
    pub(super) fn receipts(&self, stage: &impl Words) {
        for (slot, s) in self.slots.iter().enumerate() {
            let open = s.state == State::Pending;
            let w = FIFO_RECEIPTS + 3 * slot;
            stage.store(w, s.idx << 1 | u64::from(open));
            stage.store(w + 1, s.got as u64);
            stage.store(w + 2, (s.got >> 64) as u64);
        }
    }

    /// Repair: replaces our end of lane `lane` with a new queue pair connected to the sender's
    /// `peer` (request `seq`), posts its receives and makes it live. Its number; `None` where
    /// it could not be built (one WARN: the sender's attempt fails).
    pub(super) fn rebuild(
        &mut self,
        lane: usize,
        seq: u16,
        peer: u32,
        io: &mut impl Post,
    ) -> Result<Option<u32>> {
        let (send, recv) = mend::psns(seq);
        let qpn = match io.fresh(lane).and_then(|q| io.join(lane, peer, (recv, send)).map(|()| q)) {
            Ok(qpn) => qpn,
            Err(e) => {
                let what = format!("the receive comm from {}", self.p.path.peer);
                let why = format!("a new queue pair failed: {e}");
                let then = "the sender's repair attempt fails".to_string();
                let w = lane_warning(&self.p.path, &what, lane, &why, &then);
                self.warnings.push_back(Line::Warn(w));
                return Ok(None);
            }
        };
        let bit = 1u128 << lane;
        self.health.life[lane] = self.health.life[lane].wrapping_add(1);
        self.sq[lane] = SqCount::new(RECV_SEND_QUEUE);
        self.unread(lane);
        self.pool[lane] = 0;
        self.short |= bit;
        // The control lane lives (neither end takes out its last lane): it carries the rows
        // until this one is proven.
        debug_assert_ne!(self.alive & (1 << self.ctl), 0);
        self.proving |= bit;
        self.health.traffic.lanes[lane].repaired += 1;
        self.refill(io)?;
        Ok(Some(qpn))
    }

    /// A line for the log: each lane whose path failed our CTS rows or probes, or that the
    /// sender had rebuilt.
    #[inline]
    pub fn take_line(&mut self) -> Option<Line> {
        self.warnings.pop_front()
    }

    /// What was posted since the last look (empty unless [`Params::journal`]); the caller
    /// drains it.
    pub fn journal(&mut self) -> &mut Vec<Posted> {
        &mut self.journal
    }

    /// Tops up every live lane whose pool fell under [`recv_pool`] to [`RECV_BATCH`] - 1 more
    /// than that: a lane holds at least its pool whenever a CTS goes out (this runs first),
    /// and posts once per [`RECV_BATCH`] messages it carries (one chain of 16; a first fill,
    /// or a rebuilt lane's, goes in several).
    #[inline(always)]
    pub(super) fn refill(&mut self, io: &mut impl Post) -> Result<()> {
        let low = |(q, &n): (usize, &usize)| {
            n < recv_pool(self.p.nqps, self.p.split) && self.short & 1 << q == 0
        };
        debug_assert!(
            !self.pool.iter().enumerate().any(low),
            "a lane's pool ran low without its bit in `short`: {:?} {:#x}",
            self.pool,
            self.short
        );
        let todo = self.short & (self.alive | self.proving);
        if todo == 0 {
            return Ok(());
        }
        let want = recv_pool(self.p.nqps, self.p.split);
        for (q, n) in self.pool.iter_mut().enumerate().filter(|(q, _)| todo & (1 << q) != 0) {
            if *n < want {
                let id = tagged(wr_id(WR_RECV, q, 0), self.health.life[q]);
                let more = want + RECV_BATCH - 1 - *n;
                io.recv(q, id, more).map_err(|e| self.health.post_failed(e))?;
                *n += more;
            }
            self.short &= !(1 << q);
        }
        Ok(())
    }

    /// Writes the staged rows to the sender's FIFO at once, in batches of at most [`BATCH`]
    /// rows, each one post of one doorbell: the other entries of its multi-receives, then its
    /// head entries (one write, two where the batch wraps the FIFO). `irecv` writes its own row
    /// so: the sender can match a posted receive with no further call on this comm (two ranks
    /// that each post, then send, must not wait on each other's next call). Rows stay staged
    /// only while the control lane's send queue is full, or after the rows moved to another
    /// lane; `idle` writes them then. A batch that does not fit the send queue waits for a
    /// signaled completion, which [`SqCount`] guarantees is on the way.
    #[inline]
    pub(super) fn advertise(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        // Inline up to here: the idle run and most polls find no row staged.
        if self.head == self.advertised {
            return Ok(());
        }
        self.write_rows(stage, io)
    }

    /// [`Self::advertise`] with rows staged.
    fn write_rows(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        loop {
            let staged = self.head - self.advertised;
            if staged == 0 {
                return Ok(());
            }
            let rows = staged.min(BATCH) as usize;
            let lane = self.control_lane();
            let first = (self.advertised % SLOTS as u64) as usize;
            let (ours, theirs) = self.p.members[lane];
            let write = |w: usize, entries: usize| SendWr {
                wr_id: tagged(wr_id(WR_CTS, lane, 0), self.health.life[lane]),
                op: Op::Write,
                signaled: false,
                local: Some((stage.addr(w), (entries * ENTRY) as u32, stage.lkey(ours))),
                remote_addr: self.remote_fifo.at(w, theirs).0,
                rkey: self.remote_fifo.rkeys[theirs],
                inline: entries * ENTRY <= self.p.inline_on(lane) as usize,
            };
            // Whether a write reads its rows from the stage, not inline.
            let mut from_stage = false;
            let mut len = 0;
            let wrs = &mut self.chain;
            for k in 0..rows {
                let slot = (first + k) % SLOTS;
                let n = self.slots[slot].n;
                if n > 1 {
                    wrs[len] = write(entry_word(slot, 1), n - 1);
                    from_stage |= !wrs[len].inline;
                    len += 1;
                }
            }
            let end = first + rows;
            for (lo, hi) in [(first, end.min(SLOTS)), (0, end.saturating_sub(SLOTS))] {
                if hi > lo {
                    wrs[len] = write(entry_word(lo, 0), hi - lo);
                    from_stage |= !wrs[len].inline;
                    len += 1;
                }
            }
            let n = len as u64;
            if !self.sq[lane].fits(n) {
                return Ok(());
            }
            // A batch that reads rows from the stage is signaled, so that its rows can be
            // restaged once it completed.
            let signaled = from_stage || self.sq[lane].signal_due(n);
            wrs[len - 1].signaled = signaled;
            io.send(lane, &wrs[..len]).map_err(|e| self.health.post_failed(e))?;
            self.sq[lane].posted(n, signaled);
            if from_stage {
                let seq = self.sq[lane].posted;
                for k in 0..rows {
                    self.slots[(first + k) % SLOTS].read_by = (lane, seq);
                }
            }
            if self.p.journal {
                let wr_id = wrs[0].wr_id;
                for k in 0..rows {
                    let slot = (first + k) % SLOTS;
                    for r in 0..self.slots[slot].n {
                        let key = slot * MAX_RECVS + r;
                        let e = Posted { key, wr_id, imm: false, lane, len: ENTRY as u64 };
                        self.journal.push(e);
                    }
                }
            }
            if signaled {
                self.health.watchdog.posted();
            }
            self.advertised += rows as u64;
        }
    }

    /// Issues the flush reads of `target`: one per member port `m`, through QP `nqps + m`
    /// (that port's loopback flush QP), into the port's `scratch[m]` buffer `(addr, lkey)`, as
    /// each port's NIC wrote into the buffer. Done once every read is.
    pub fn iflush(
        &mut self,
        io: &mut impl Post,
        target: Buf,
        scratch: &[(u64, u32)],
    ) -> Result<usize> {
        self.check()?;
        // The next free slot from the head: a flush NCCL has not tested yet holds only its own.
        let k = (0..SLOTS)
            .map(|i| (self.flush_head + i) % SLOTS)
            .find(|&k| self.flushes[k] == State::Free)
            .ok_or_else(|| Error::Internal(format!("more than {SLOTS} flushes outstanding")))?;
        for (m, &(addr, lkey)) in scratch.iter().enumerate() {
            let read = SendWr {
                wr_id: wr_id(WR_FLUSH, m, k),
                op: Op::Read,
                signaled: true,
                local: Some((addr, 1, lkey)),
                remote_addr: target.addr,
                rkey: target.rkeys[m],
                inline: false,
            };
            io.send(self.p.nqps + m, &[read]).map_err(|e| self.health.post_failed(e))?;
            self.health.watchdog.posted();
        }
        self.flushes[k] = State::Pending;
        self.flush_left[k] = scratch.len() as u8;
        self.flush_head = k + 1;
        Ok(FLUSH_BASE + k)
    }

    /// Takes in one completion; `sizes` are the size records the sender writes.
    #[inline(always)]
    pub fn complete(&mut self, c: &Completion, sizes: &impl Words) {
        let kind = wr_kind(c.wr_id);
        let lane = wr_lane(c.wr_id) % self.p.nqps.max(1);
        // Work of an earlier life of a rebuilt lane is dropped: only a chunk that landed counts
        // (counting is idempotent), and not against the lane's new pool.
        let stale = kind != WR_FLUSH && wr_life(c.wr_id) != self.health.life[lane];
        if stale && !(c.status == 0 && kind == WR_RECV) {
            return;
        }
        if kind == WR_RECV && !stale {
            // A WQE of the lane's pool came back, landed or flushed: a fenced lane is drained
            // once none is left.
            self.pool[lane] = self.pool[lane].saturating_sub(1);
            if self.pool[lane] < recv_pool(self.p.nqps, self.p.split) {
                self.short |= 1 << lane;
            }
        }
        if c.status != 0 && kind != WR_FLUSH && self.lane_failed(lane, c) {
            return;
        }
        if c.status == 0 && matches!(kind, WR_CTS | WR_PROBE | WR_MAIL) {
            self.sq[lane].completed();
        }
        if c.status == 0 && kind == WR_RECV && !stale {
            self.crossed(lane); // the sender's write landed on it
        }
        if !self.health.completion(c) {
            return;
        }
        let i = wr_slot(c.wr_id);
        match kind {
            WR_RECV => self.chunk_landed(c, sizes),
            WR_FLUSH => {
                self.flush_left[i] = self.flush_left[i].saturating_sub(1);
                if self.flush_left[i] == 0 {
                    self.flushes[i] = State::Done;
                }
                self.health.watchdog.completed(true);
            }
            _ => self.health.watchdog.completed(true), // a signaled CTS write, or an answer
        }
    }

    /// A chunk's write-with-immediate landed: the immediate names the slot and chunk. The
    /// receive is done once every chunk it expects has landed and its sizes are sane.
    fn chunk_landed(&mut self, c: &Completion, sizes: &impl Words) {
        // The immediate names the slot and chunk.
        let q = wr_lane(c.wr_id);
        let imm = Imm::decode(c.imm.unwrap_or(0), self.p.split);
        let i = imm.slot;
        let s = &mut self.slots[i];
        let bit = 1u128 << imm.chunk;
        // A chunk of another use of the slot, or one the slot does not expect, is not
        // counted; one sent again after its first copy landed sets its bit again.
        if s.state != State::Pending || epoch(s.idx) != imm.epoch || s.want & bit == 0 {
            return;
        }
        if s.got & bit == 0
            && let Some(l) = self.health.traffic.lanes.get_mut(q)
        {
            l.chunks += 1;
        }
        s.got |= bit;
        if s.got != s.want {
            return;
        }
        if let Some(size) = imm.size {
            s.sizes[0] = size;
            // An honest sender puts the size in the immediate only for one buffer; for more,
            // the others are 0, never a size left from an earlier receive.
            if s.n > 1 {
                s.sizes[1..s.n].fill(0);
            }
        } else {
            for r in 0..s.n {
                s.sizes[r] = sizes.load(i * MAX_RECVS + r);
            }
        }
        // The sizes come from the peer: an honest sender truncates a send to the
        // receive's size, so a larger one is a broken or hostile peer, and NCCL must
        // never see it (it would read past its buffer). The receive stays pending and
        // fails with the comm.
        if let Some(r) = (0..s.n).find(|&r| s.sizes[r] > s.posted[r]) {
            let msg = format!(
                "{} reported {} bytes for buffer {r} of a receive posted with {} bytes: \
                 the sender is broken or hostile",
                self.health.path.peer, s.sizes[r], s.posted[r]
            );
            self.health.fail(Fault::Remote(msg));
            return;
        }
        self.waiting -= 1;
        s.state = State::Done;
        self.consumed = self.consumed.max(s.idx);
        let t = &mut self.health.traffic;
        t.messages += s.n as u64;
        t.delivered += s.sizes[..s.n].iter().sum::<u64>();
    }

    /// A poll that found completions, between the idle work's runs: what they make possible
    /// ([`Self::idle`] less its timed checks): a repair request served, receives posted again,
    /// staged rows sent.
    pub fn after_poll(
        &mut self,
        now: Duration,
        io: &mut impl Post,
        stage: &impl Words,
        sizes: &impl Words,
    ) -> Result<()> {
        if self.landed(now, io, stage, sizes)? {
            self.advertise(stage, io)?;
        }
        self.health.check()
    }

    /// The first of what both [`Self::after_poll`] and [`Self::idle`] do: unless the comm
    /// failed, a repair request is served and receives are posted again. Whether the comm is
    /// still alive.
    #[inline(always)]
    fn landed(
        &mut self,
        now: Duration,
        io: &mut impl Post,
        stage: &impl Words,
        sizes: &impl Words,
    ) -> Result<bool> {
        if self.health.fatal.is_some() {
            return Ok(false);
        }
        self.serve(now, stage, sizes, io)?;
        if self.waiting > 0 {
            self.refill(io)?;
        }
        Ok(true)
    }

    /// After a poll found no more completions: the staged rows go out if the sender runs low
    /// ([`Self::advertise`]), then as [`SendCore::idle`], waiting meaning a receive whose data
    /// has not arrived.
    pub fn idle(
        &mut self,
        now: Duration,
        elsewhere: Option<Fault>,
        io: &mut impl Post,
        stage: &impl Words,
        sizes: &impl Words,
    ) -> Result<()> {
        if self.landed(now, io, stage, sizes)? {
            if self.p.failover {
                // Only a lane on a port whose link went down: a stall is the sender's to find
                // (it owns lane repair; two ends fencing on their own could keep disjoint
                // lanes). A silent path under our CTS rows stalls the sender's work or probes
                // on the lane, and its fence moves the rows. (With no lane busy here, the stall
                // check itself finds nothing: it is not even called unless a link went down,
                // which saves the call, about 80 instructions an idle run.)
                let on_down = self.health.on_down(self.alive, &self.p.members);
                let found = (on_down != 0).then(|| {
                    self.health.stalled(now, (0, self.alive, on_down), |_| Duration::ZERO)
                });
                if let Some((lane, why)) = found.flatten() {
                    io.fence(lane).map_err(|e| self.health.post_failed(e))?;
                    self.drop_lane(lane, &why);
                }
            }
            self.advertise(stage, io)?;
        }
        let waiting = self.waiting > 0;
        // Every live lane with room, as the sender does: a dead sender fails the comm within
        // one retry bound however many lanes it has (one lane at a time took one bound each).
        let (alive, queues) = (self.alive, &self.sq);
        let lanes = || sq::room(alive, queues);
        let (target, members) = (self.remote_fifo, &self.p.members);
        let at = |q: usize| target.at(0, members[q].1);
        let probed = self.health.probe(now, (waiting, false), io, (lanes, at))?;
        sq::probes_posted(&mut self.sq, probed);
        self.health.idle(now, elsewhere)
    }

    pub(super) fn state(&self, id: usize) -> Option<State> {
        match id {
            i if i < SLOTS => Some(self.slots[i].state),
            i => self.flushes.get(i - FLUSH_BASE).copied(),
        }
    }

    /// Whether request `id` still waits for completions.
    pub fn pending(&self, id: usize) -> bool {
        self.state(id) == Some(State::Pending)
    }

    /// Receive request `id` (`< SLOTS`) or flush request (`FLUSH_BASE..`): `Some(n)` once done,
    /// with the `n` received sizes first in `sizes` (the entries after them are unspecified; 0
    /// for a flush).
    #[inline(always)]
    pub fn test(&mut self, id: usize, sizes: &mut [u64; MAX_RECVS]) -> Result<Option<usize>> {
        match self.state(id) {
            None | Some(State::Free) => {
                Err(Error::Internal(format!("test of an unknown or free receive request {id}")))
            }
            Some(State::Pending) => self.health.check().map(|_| None),
            Some(State::Done) if id < SLOTS => {
                let s = &mut self.slots[id];
                *sizes = s.sizes;
                s.state = State::Free;
                Ok(Some(s.n))
            }
            Some(State::Done) => {
                self.flushes[id - FLUSH_BASE] = State::Free;
                Ok(Some(0))
            }
        }
    }
}
