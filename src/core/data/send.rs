//! The send side: the slot table of `isend`s, the chain of work requests each message becomes,
//! and its failover: a chunk whose lane fails is sent again on a live lane only once the
//! receiver proves it did not land (see the module docs of [`super`]).

use std::collections::VecDeque;
use std::time::Duration;

use super::*;

/// A growing chain of work requests for one QP, posted in batches of `MAX_CHAIN` and counted
/// in the QP's send queue.
pub(super) struct Chain<'a> {
    pub(super) qp: usize,
    /// The comm's own buffer, reused by every post: nothing is initialised per post.
    pub(super) wrs: &'a mut [SendWr; MAX_CHAIN],
    pub(super) sq: &'a mut SqCount,
    pub(super) len: usize,
}

impl<'a> Chain<'a> {
    pub(super) fn new(
        qp: usize,
        wrs: &'a mut [SendWr; MAX_CHAIN],
        sq: &'a mut SqCount,
    ) -> Chain<'a> {
        Chain { qp, wrs, sq, len: 0 }
    }

    pub(super) fn push(&mut self, io: &mut impl Post, wr: SendWr) -> Result<()> {
        if self.len == MAX_CHAIN {
            self.flush(io)?;
        }
        self.wrs[self.len] = wr;
        self.len += 1;
        Ok(())
    }

    pub(super) fn last(&mut self) -> Option<&mut SendWr> {
        self.len.checked_sub(1).map(|i| &mut self.wrs[i])
    }

    pub(super) fn flush(&mut self, io: &mut impl Post) -> Result<()> {
        io.send(self.qp, &self.wrs[..self.len])?;
        for w in &self.wrs[..self.len] {
            self.sq.posted(1, w.signaled);
        }
        self.len = 0;
        Ok(())
    }
}

/// The work requests of one chunk on one lane, built into its [`Chain`]: what each builder
/// needs to name the chunk, its lane and the peer's keys.
pub(super) struct ChunkWrs {
    pub(super) slot: usize,
    pub(super) chunk: usize,
    pub(super) lane: usize,
    pub(super) life: u8,
    /// The lane's (ours, theirs) member ports, which pick the keys.
    pub(super) members: (usize, usize),
    pub(super) inline: u32,
}

impl ChunkWrs {
    /// The id of a work request of the chunk, of `kind` (`WR_SEND`: the chunk's own, whose
    /// completion is its last; `WR_MARK`: a signaled data write), tagged with the lane's life.
    pub(super) fn id(&self, kind: u64) -> u64 {
        tagged(data_wr_id(kind, self.lane, self.slot, self.chunk), self.life)
    }

    /// The data writes of the chunk's part of each request, cut at `max_msg`; every `mark`
    /// bytes one is signaled, so the sender learns of progress within a long chunk. The bytes
    /// written.
    pub(super) fn data(
        &self,
        chain: &mut Chain,
        io: &mut impl Post,
        s: &SendSlot,
        parts: &[(u64, u64); MAX_RECVS],
        (max_msg, mark): (u64, u64),
    ) -> Result<u64> {
        let (ours, theirs) = self.members;
        let (id, marked) = (self.id(WR_SEND), self.id(WR_MARK));
        let (mut data, mut unmarked) = (0, 0);
        let row = &s.row[..usize::from(s.nreqs)];
        for ((b, cts), &(off, len)) in s.bufs.iter().zip(row).zip(parts) {
            let Some(b) = b else { continue };
            let mut done = 0;
            while done < len {
                let n = (len - done).min(max_msg);
                let at = off + done;
                unmarked += n;
                let signaled = unmarked >= mark;
                if signaled {
                    unmarked = 0;
                }
                chain.push(
                    io,
                    SendWr {
                        wr_id: if signaled { marked } else { id },
                        op: Op::Write,
                        signaled,
                        local: Some((b.addr + at, n as u32, b.lkeys[ours])),
                        remote_addr: cts.addr + at,
                        rkey: cts.rkeys[theirs],
                        inline: b.host && n <= u64::from(self.inline),
                    },
                )?;
                done += n;
            }
            data += len;
        }
        Ok(data)
    }

    /// The one work request of a whole message of one buffer (the slot's only one) that one
    /// write holds (1 to `max_msg` bytes), whose size is in the immediate `imm`: its write
    /// with immediate, signaled, as [`Self::data`] and [`Self::imm`] build it, and its bytes.
    /// `None`: the general path's (an empty buffer or message, or one in pieces).
    #[inline(always)]
    pub(super) fn whole(&self, s: &SendSlot, imm: u32, max_msg: u64) -> Option<(SendWr, u64)> {
        debug_assert_eq!(s.nreqs, 1, "a whole message of one buffer");
        let b = s.bufs[0].filter(|b| (1..=max_msg).contains(&b.size))?;
        let (ours, theirs) = self.members;
        let len = b.size;
        let wr = SendWr {
            wr_id: self.id(WR_SEND),
            op: Op::WriteImm(imm),
            signaled: true,
            local: Some((b.addr, len as u32, b.lkeys[ours])),
            remote_addr: s.row[0].addr,
            rkey: s.row[0].rkeys[theirs],
            inline: b.host && len <= u64::from(self.inline),
        };
        Some((wr, len))
    }

    /// The size records of a message the immediate cannot carry (several requests, or one too
    /// large), staged by `isend`, written ahead of chunk 0's immediate.
    pub(super) fn size_record(
        &self,
        chain: &mut Chain,
        io: &mut impl Post,
        stage: &impl Words,
        sizes: &Remote,
        nreqs: usize,
    ) -> Result<()> {
        let word = self.slot * MAX_RECVS;
        let target = sizes.at(word, self.members.1);
        chain.push(io, self.staged_write(stage, (word, (nreqs * 8) as u32), target))
    }

    /// An unsignaled write of `len` bytes from word `word` of `stage` to `(addr, rkey)`.
    fn staged_write(
        &self,
        stage: &impl Words,
        (word, len): (usize, u32),
        (addr, rkey): (u64, u32),
    ) -> SendWr {
        SendWr {
            wr_id: self.id(WR_SEND),
            op: Op::Write,
            local: Some((stage.addr(word), len, stage.lkey(self.members.0))),
            remote_addr: addr,
            rkey,
            inline: len <= self.inline,
            ..SendWr::default()
        }
    }

    /// The chunk's immediate: on its last data write where that write ends a single message
    /// (`on_data`), otherwise a 0-byte write-with-immediate of its own.
    pub(super) fn imm(
        &self,
        chain: &mut Chain,
        io: &mut impl Post,
        imm: u32,
        on_data: bool,
    ) -> Result<()> {
        match chain.last() {
            Some(w) if on_data && w.op == Op::Write => {
                w.op = Op::WriteImm(imm);
                w.wr_id = self.id(WR_SEND);
                w.signaled = true;
                Ok(())
            }
            _ => {
                let wr = SendWr {
                    wr_id: self.id(WR_SEND),
                    op: Op::WriteImm(imm),
                    signaled: true,
                    ..SendWr::default()
                };
                chain.push(io, wr)
            }
        }
    }
}

// --- the sender ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SendReq {
    pub(super) state: State,
    pub(super) size: u64,
}

/// A send's buffer as its slot keeps it until the slot completes (a chunk may go again): a
/// [`Buf`] less its remote keys, which only a receive's buffer needs (a fifth of a slot's
/// size, 8 KiB of every send comm).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SendBuf {
    pub(super) addr: u64,
    pub(super) size: u64,
    pub(super) lkeys: Keys,
    pub(super) host: bool,
}

impl From<Buf> for SendBuf {
    #[inline(always)]
    fn from(b: Buf) -> SendBuf {
        SendBuf { addr: b.addr, size: b.size, lkeys: b.lkeys, host: b.host }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SendSlot {
    /// Bitmask of the entries matched by an `isend`.
    pub(super) matched: u8,
    /// The sends matched so far, by entry; kept until the slot completes, so that a chunk can
    /// be sent again.
    pub(super) bufs: [Option<SendBuf>; MAX_RECVS],
    /// The row they answer, likewise kept.
    pub(super) row: [Cts; MAX_RECVS],
    pub(super) nreqs: u8,
    /// Chunks posted whose final completion has not arrived yet.
    pub(super) pending: u128,
    /// Chunks left empty (their lane is dead or avoided): the others share the bytes.
    pub(super) empty: u128,
}

/// The sending end's protocol state.
pub struct SendCore {
    pub(super) reqs: [SendReq; SLOTS * MAX_RECVS],
    /// On the heap: with its buffers and rows it is about 32 KB, which each move of the core
    /// (into its comm, into a box) would otherwise copy.
    pub(super) slots: Box<[SendSlot; SLOTS]>,
    /// Slots fully posted so far; the next slot is `head % SLOTS`.
    pub(super) head: u64,
    pub(super) p: Params,
    /// Where the receiver's size records are.
    pub(super) remote_sizes: Remote,
    /// Per lane: its send queue, counted.
    pub(super) sq: Vec<SqCount>,
    /// Per slot and chunk: the lane that carries it now.
    pub(super) chunk_lane: Vec<u8>,
    /// The lanes whose path still answers (bit `q` for lane `q`).
    pub(super) alive: u128,
    /// Every lane, as bits (`alive` when none failed).
    pub(super) all: u128,
    /// Chunks to send again on a live lane: their lane failed before they completed, and the
    /// receiver's receipts say it did not count them. In row order.
    pub(super) resend: VecDeque<(usize, usize)>,
    /// Lanes that failed and wait for their fence: their chunks in flight are held (left
    /// pending on the lane) until the receiver says which of them it counted ([`Self::settle`]).
    pub(super) unfenced: u128,
    /// The fence asked and not yet answered: its request number, its lane, the lane it was
    /// asked through, and when.
    pub(super) fence: Option<(u16, usize, usize, Duration)>,
    /// Where [`Self::live_lane`] looks for the next live lane.
    pub(super) spread: usize,
    /// Per lane: its chunks in flight and measured rate.
    pub(super) lanes: Vec<place::Lane>,
    /// The repair of failed lanes.
    pub(super) mend: mend::Mend,
    /// The precise time of the last timed post or batch of completions (path-aware with
    /// several lanes only; else never read), and the state of the lane draw.
    pub(super) clock: Option<Duration>,
    pub(super) draw: u64,
    /// The lanes placement avoids ([`place::avoided`]: slow, or dead), as of the last idle
    /// run: a message reads this mask, not every lane's rate (path-aware only).
    pub(super) avoid: u128,
    /// A timed chunk retired since `avoid` was computed: a lane's rate may have changed.
    pub(super) retimed: bool,
    /// The row [`Self::next_row`] read last (its first `nreqs` entries).
    pub(super) next: [Cts; MAX_RECVS],
    /// The last isend found no CTS for its slot: the sender waits on the receiver.
    pub(super) wants_cts: bool,
    /// Split mode's NIC, as placement times it.
    pub(super) nic: place::Nic,
    /// Posted slots whose completions have not all arrived (kept, not scanned for, because
    /// every empty poll asks).
    pub(super) in_flight: usize,
    /// Where chains are built before posting.
    pub(super) chain: Box<[SendWr; MAX_CHAIN]>,
    pub(super) health: Health,
    /// A send of this comm was truncated (reported once).
    pub(super) truncated: bool,
    /// Warnings for the log not yet taken: the first truncation, each lane that failed.
    pub(super) warnings: VecDeque<Line>,
    /// What was posted, for profiler events (only with [`Params::journal`]).
    pub(super) journal: Vec<Posted>,
}

impl SendCore {
    pub fn new(mut p: Params, remote_sizes: Remote) -> SendCore {
        p.split = p.split && p.nqps > 1;
        p.members.resize(p.nqps, (0, 0));
        p.mark = p.mark.max(4096);
        p.max_msg = p.max_msg.max(4096).min(p.mark);
        let health = Health::new(&p);
        SendCore {
            reqs: [SendReq::default(); SLOTS * MAX_RECVS],
            slots: Box::new([SendSlot::default(); SLOTS]),
            head: 0,
            remote_sizes,
            sq: (0..p.nqps).map(|_| SqCount::new(send_queue(p.nqps))).collect(),
            chunk_lane: vec![0; SLOTS * p.nqps],
            alive: lanes_mask(p.nqps),
            all: lanes_mask(p.nqps),
            resend: VecDeque::new(),
            unfenced: 0,
            fence: None,
            spread: 0,
            lanes: (0..p.nqps).map(|_| place::Lane::new()).collect(),
            mend: mend::Mend::new(p.nqps, p.repair),
            clock: None,
            draw: 0x9e37_79b9_7f4a_7c15,
            avoid: 0,
            retimed: false,
            next: [Cts::default(); MAX_RECVS],
            wants_cts: false,
            nic: place::Nic::default(),
            in_flight: 0,
            chain: Box::new([SendWr::default(); MAX_CHAIN]),
            health,
            truncated: false,
            warnings: VecDeque::new(),
            journal: Vec::new(),
            p,
        }
    }

    /// A line for the log: the first truncated send, each lane that failed or came back.
    #[inline]
    pub fn take_line(&mut self) -> Option<Line> {
        self.warnings.pop_front()
    }

    /// What was posted since the last look (empty unless [`Params::journal`]); the caller
    /// drains it.
    pub fn journal(&mut self) -> &mut Vec<Posted> {
        &mut self.journal
    }

    /// The first live lane: the one for probes and mailbox requests.
    pub(super) fn control_lane(&self) -> usize {
        first_live(self.alive, self.p.nqps)
    }

    /// Lane `q` if it lives; else a live lane, taken in turn, so that the chunks of dead
    /// lanes spread evenly over the live ones.
    #[inline(always)]
    pub(super) fn live_lane(&mut self, q: usize) -> usize {
        if self.alive & (1 << q) != 0 {
            return q;
        }
        let n = self.p.nqps;
        let next = (0..n).map(|k| (self.spread + k) % n).find(|&l| self.alive & (1 << l) != 0);
        let l = next.unwrap_or(q);
        self.spread = l + 1;
        l
    }

    /// Whether placement reads the clock: path-aware, with lanes to choose from.
    pub(super) fn places(&self) -> bool {
        self.p.path_aware && self.p.nqps > 1
    }

    /// Whether a poll of the comm's CQs can find nothing: no signaled request outstanding on
    /// any lane (probes, fences and repair requests included). Every request whose completion
    /// the comm waits for is signaled (an unsignaled one that fails is followed by a signaled
    /// one that flushes), so an `isend` that waits for the peer's CTS with nothing in flight
    /// skips the poll.
    #[inline]
    pub fn nothing_posted(&self) -> bool {
        self.sq.iter().all(|c| c.signaled.is_empty())
    }

    /// Whether completions about to be polled want the clock: a timed chunk is in flight.
    #[inline(always)]
    pub fn needs_clock(&self) -> bool {
        self.places() && self.lanes.iter().any(place::Lane::timing)
    }

    /// The post time of chunks about to be posted: the clock, read now, if they are `worth`
    /// timing and placement measures; else [`place::UNTIMED`].
    pub(super) fn timestamp(&mut self, io: &impl Post, worth: bool) -> Duration {
        if !(worth && self.places()) {
            return place::UNTIMED;
        }
        let now = io.now();
        self.clock = Some(now);
        now
    }

    /// The precise time at which the `completions` about to be taken in were polled.
    pub fn stamp(&mut self, now: Duration, completions: usize) {
        self.nic.polled(self.clock.unwrap_or(now), now, completions);
        self.clock = Some(now);
    }

    /// The lane for a whole message of `bytes` in slot `slot`: the rotation's (or the next
    /// live one); path-aware, the cheaper of it and a live lane drawn at random.
    #[inline(always)]
    pub(super) fn whole_lane(&mut self, slot: usize, bytes: u64) -> usize {
        let rotation = self.live_lane(slot % self.p.nqps);
        // The live lanes other than the rotation's, as bits (a live lane is one of the comm's).
        debug_assert_eq!(self.alive & !self.all, 0);
        let mut others = self.alive & !(1 << rotation);
        if !self.p.path_aware || others == 0 || place::idle(&self.lanes, self.avoid, rotation) {
            return rotation;
        }
        let n = others.count_ones();
        if n > 1 {
            // xorshift64: the k-th of them (the lowest k bits cleared). With one, it is that.
            self.draw ^= self.draw << 13;
            self.draw ^= self.draw >> 7;
            self.draw ^= self.draw << 17;
            for _ in 0..self.draw % u64::from(n) {
                others &= others - 1;
            }
        }
        let other = others.trailing_zeros() as usize;
        place::choose(&self.lanes, self.avoid, (rotation, other), bytes)
    }

    /// The lane for chunk `c` of a split message: its own, unless that lane is dead or its
    /// chunk empty; then a lane whose chunk is not, taken in turn.
    pub(super) fn split_lane(&mut self, slot: usize, c: usize) -> usize {
        let (n, empty) = (self.p.nqps, self.slots[slot].empty);
        if empty & (1 << c) == 0 {
            return self.live_lane(c);
        }
        let next = (0..n).map(|k| (self.spread + k) % n).find(|&l| empty & (1 << l) == 0);
        let l = next.unwrap_or(c);
        self.spread = l + 1;
        self.live_lane(l)
    }

    /// Decides which of slot `slot`'s chunks stay empty: path-aware in split mode, those of
    /// dead and avoided lanes; else none (a dead lane's chunk rides on a live lane).
    #[inline(always)]
    pub(super) fn plan(&mut self, slot: usize, optional: bool) {
        let split = self.p.split && !optional;
        let all = self.all;
        // The mask is as of the last idle run: where every lane is avoided by now (the one it
        // did not avoid died since), none is, and dead lanes' chunks ride on live ones.
        let avoided = (self.avoid | !self.alive) & all;
        self.slots[slot].empty =
            if split && self.p.path_aware && avoided != all { avoided } else { 0 };
    }

    /// The byte range `(offset, len)` of a `size`-byte buffer that chunk `c` of slot `slot`
    /// carries: the equal split over the chunks that are not empty.
    /// A whole message is all of its buffer: answered inline, without the split arithmetic.
    #[inline]
    pub(super) fn part(&self, slot: usize, size: u64, split: bool, c: usize) -> (u64, u64) {
        if !split { (0, size) } else { self.split_part(slot, size, c) }
    }

    fn split_part(&self, slot: usize, size: u64, c: usize) -> (u64, u64) {
        let (n, empty) = (self.p.nqps, self.slots[slot].empty);
        if empty == 0 {
            return lane_part(size, true, n, c);
        }
        if empty & (1 << c) != 0 {
            return (0, 0);
        }
        let full = lanes_mask(n) & !empty;
        let before = (full & ((1u128 << c) - 1)).count_ones() as usize;
        lane_part(size, true, full.count_ones() as usize, before)
    }

    #[inline]
    pub fn check(&self) -> Result<()> {
        self.health.check()
    }

    /// What this end has sent: messages, and per QP the bytes and failed completions.
    pub fn traffic(&self) -> &Traffic {
        &self.health.traffic
    }

    /// Matches a send against the receiver's posted buffers in `fifo`; posts the row once it
    /// is complete. `Ok(None)`: not yet (the receive is not posted, or this slot's previous
    /// requests are still outstanding, or the send queue is full: poll and call again).
    pub fn isend(
        &mut self,
        fifo: &impl Words,
        stage: &impl Words,
        io: &mut impl Post,
        buf: Buf,
        tag: i32,
    ) -> Result<Option<usize>> {
        self.isend_with(fifo, stage, io, || Ok(buf), tag)
    }

    /// [`Self::isend`] with the buffer found only once a receive matches it (`buf`: the lookup
    /// of its registration, whose error is the caller's and leaves the comm as it was): a send
    /// that finds no receive posted, which NCCL repeats until one is, costs no lookup.
    pub fn isend_with(
        &mut self,
        fifo: &impl Words,
        stage: &impl Words,
        io: &mut impl Post,
        buf: impl FnOnce() -> Result<Buf>,
        tag: i32,
    ) -> Result<Option<usize>> {
        self.check()?;
        self.resend(stage, io)?;
        if self.unfenced != 0 && self.holding() || !self.resend.is_empty() {
            // Held and re-sent chunks go first, in row order. (A lane fenced with nothing held
            // holds up nothing.)
            return Ok(None);
        }
        let Some((slot, nreqs)) = self.next_row(fifo)? else {
            return Ok(None);
        };
        let row = &self.next;
        // A fresh slot must not still hold requests NCCL has not yet seen complete.
        let s = &self.slots[slot];
        let range = slot * MAX_RECVS..(slot + 1) * MAX_RECVS;
        if s.matched == 0 && self.reqs[range].iter().any(|r| r.state != State::Free) {
            return Ok(None);
        }
        let Some(r) = (0..nreqs).find(|&r| s.matched & (1 << r) == 0 && row[r].tag == tag) else {
            return Ok(None);
        };
        // With this one, every entry of the row is matched (a mask: the CPU may lack popcnt).
        let last = u16::from(s.matched) | 1 << r == (1 << nreqs) - 1;
        let (size, optional) = (row[r].size, nreqs == 1 && row[0].optional);
        let buf = self.fit_to(buf()?, tag, size);
        // In place (a slot's buffers are 448 bytes), and taken back if it cannot go:
        // an unmatched entry's buffer is empty (a slot's are emptied when it completes).
        debug_assert!(self.slots[slot].bufs[r].is_none());
        self.slots[slot].bufs[r] = Some(buf.into());
        if last {
            self.plan(slot, optional);
            match self.fits(slot, &self.slots[slot].bufs[..nreqs], optional) {
                Ok(true) => {}
                no => {
                    self.slots[slot].bufs[r] = None;
                    return no.map(|_| None);
                }
            }
        }
        let id = slot * MAX_RECVS + r;
        self.reqs[id] = SendReq { state: State::Pending, size: buf.size };
        self.health.traffic.messages += 1;
        self.slots[slot].matched |= 1 << r;
        if last {
            if let Err(e) = self.post(stage, io, slot, nreqs) {
                // Never handed out; the row's earlier requests fail with the comm.
                self.reqs[id] = SendReq::default();
                return Err(self.health.post_failed(e));
            }
            self.head += 1;
        }
        Ok(Some(id))
    }

    /// The row of clear-to-send entries for the next slot, once all of it has landed:
    /// `(slot, nreqs)`, the row in [`Self::next`]. A row that cannot be one of a ferroce
    /// peer's fails the comm.
    fn next_row(&mut self, fifo: &impl Words) -> Result<Option<(usize, usize)>> {
        let slot = (self.head % SLOTS as u64) as usize;
        let want = self.head + 1;
        let first = Cts::landed(fifo, slot, 0, want);
        self.wants_cts = first.is_none();
        let Some(first) = first else { return Ok(None) };
        let nreqs = usize::from(first.nreqs);
        if !(1..=MAX_RECVS).contains(&nreqs) {
            let peer = &self.p.path.peer;
            return Err(self.health.fail(Fault::Remote(format!(
                "{peer} sent a CTS with {nreqs} buffers: its memory is corrupt or it is not \
                 a ferroce peer; the connection is unusable from now on"
            ))));
        }
        self.next[0] = first;
        for r in 1..nreqs {
            let Some(e) = Cts::landed(fifo, slot, r, want) else {
                return Ok(None); // the rest of the row is still landing
            };
            self.next[r] = e;
        }
        // Every address a write derives from an entry (`addr + at`, `at` within `size`) must
        // not wrap: a peer's garbage fails the comm here, never a sum later.
        if let Some(e) = self.next[..nreqs].iter().find(|e| e.addr.checked_add(e.size).is_none()) {
            let peer = &self.p.path.peer;
            return Err(self.health.fail(Fault::Remote(format!(
                "{peer} sent a CTS for a buffer at {:#x} of {} bytes, which wraps the address \
                 space: its memory is corrupt or it is not a ferroce peer; the connection is \
                 unusable from now on",
                e.addr, e.size
            ))));
        }
        Ok(Some((slot, nreqs)))
    }

    /// `buf`, cut to the receive's `size` if it is larger.
    #[inline]
    fn fit_to(&mut self, mut buf: Buf, tag: i32, size: u64) -> Buf {
        if buf.size > size {
            self.truncated(buf.size, tag, size);
            buf.size = size;
        }
        buf
    }

    /// A send of `sent` bytes larger than its receive of `size` is cut to the receive's size,
    /// as NCCL's transport does; the first of a comm is reported (once: a mismatch repeats
    /// every step).
    #[cold]
    fn truncated(&mut self, sent: u64, tag: i32, size: u64) {
        if !self.truncated {
            self.truncated = true;
            self.warnings.push_back(Line::Warn(format!(
                "send of {sent} bytes (tag {tag}) to {} is larger than the posted receive of \
                 {size} bytes: truncated to {size} bytes, as NCCL's own transport does (a size \
                 mismatch between the ranks' calls; later truncations on this comm are not \
                 reported)",
                self.p.path.peer
            )));
        }
    }

    /// Work requests chunk `c` of slot `slot` needs for `bufs` (data pieces, then the size
    /// record and the immediate).
    pub(super) fn wrs_for(
        &self,
        slot: usize,
        bufs: &[Option<SendBuf>],
        split: bool,
        c: usize,
    ) -> u64 {
        let data: u64 = bufs
            .iter()
            .map(|b| {
                let size = b.map_or(0, |b| b.size);
                self.part(slot, size, split, c).1.div_ceil(self.p.max_msg)
            })
            .sum();
        data + 2
    }

    /// Whether every chunk of the slot fits the send queue of its lane, and of every live lane
    /// (which may carry it instead). An error where it never can, even with the queues empty
    /// ([`send_queue`] holds every multi-receive whose buffers need at most 2 work requests
    /// each, on all lanes but one failing): waiting would never end.
    pub(super) fn fits(
        &self,
        slot: usize,
        bufs: &[Option<SendBuf>],
        optional: bool,
    ) -> Result<bool> {
        let per_lane = if optional || !self.p.split {
            // One chunk, the whole message, on whichever live lane.
            self.wrs_for(slot, bufs, false, 0)
        } else {
            let n = lanes(true, self.p.nqps, slot).len();
            let most = (0..n).map(|c| self.wrs_for(slot, bufs, true, c)).max().unwrap_or(0);
            // The empty chunks of avoided lanes ride on the others (`split_lane`): one lane
            // may take its own chunk and every one of them.
            let empty = self.slots[slot].empty;
            let riders: u64 = (0..n)
                .filter(|&c| empty & (1 << c) != 0)
                .map(|c| self.wrs_for(slot, bufs, true, c))
                .sum();
            // Once lanes failed a live lane may take several chunks of the slot: all of them.
            if self.alive.count_ones() as usize == self.p.nqps {
                most + riders
            } else {
                most * n as u64
            }
        };
        let depth = self.sq[0].depth; // every lane's: `send_queue`
        if per_lane >= depth {
            return Err(Error::InvalidUsage(format!(
                "a message of {} buffer(s) needs {per_lane} work requests on one lane (buffers \
                 larger than the port's largest message, {} bytes, go in pieces), more than its \
                 send queue holds ({depth})",
                bufs.len(),
                self.p.max_msg
            )));
        }
        if self.alive == self.all {
            return Ok(self.sq.iter().all(|c| c.fits(per_lane)));
        }
        let live = self.sq.iter().enumerate().filter(|&(q, _)| self.alive >> q & 1 != 0);
        Ok(live.into_iter().all(|(_, c)| c.fits(per_lane)))
    }

    /// Posts the slot's chunks: chunk `c` of a split message (or the whole message, chunk 0)
    /// on its lane, or on the next live one where that lane failed.
    #[inline(always)]
    pub(super) fn post(
        &mut self,
        stage: &impl Words,
        io: &mut impl Post,
        slot: usize,
        nreqs: usize,
    ) -> Result<()> {
        let s = &mut self.slots[slot];
        s.row[..nreqs].copy_from_slice(&self.next[..nreqs]);
        s.nreqs = nreqs as u8;
        s.matched = 0;
        let mut sizes = [0; MAX_RECVS];
        for (size, b) in sizes.iter_mut().zip(&s.bufs[..nreqs]) {
            *size = b.map_or(0, |b| b.size);
        }
        let optional = nreqs == 1 && s.row[0].optional;
        if size_in_imm(&sizes[..nreqs], self.p.split).is_none() {
            for (r, &sz) in sizes.iter().enumerate().take(nreqs) {
                stage.store(slot * MAX_RECVS + r, sz);
            }
        }
        // Only messages of `timed_from` bytes and up are timed: a clock read may cost microseconds
        // (in a VM), which small messages would feel and their rates would not repay.
        let at = self.timestamp(io, sizes.iter().sum::<u64>() >= self.p.timed_from);
        if optional || !self.p.split {
            // One chunk, the whole message (no loop, no division: most messages, and every
            // optional one, which is never split).
            let q = self.whole_lane(slot, sizes.iter().sum());
            self.post_chunk(stage, io, (slot, 0, q), at)?;
            self.slots[slot].pending = 1;
        } else {
            // A split message's chunks go out starting at a different one each time: the NIC
            // serves a post's lanes in order, and each lane should wait behind the others as
            // often as the next, or placement would read the order as path speed.
            let n = self.p.nqps;
            for c in (0..n).map(|k| (k + slot) % n) {
                let q = self.split_lane(slot, c);
                self.post_chunk(stage, io, (slot, c, q), at)?;
            }
            self.slots[slot].pending = self.all;
        }
        self.in_flight += 1;
        self.health.watchdog.posted();
        Ok(())
    }

    /// Posts chunk `c` of the slot on lane `q`, as of `at` (for placement): the data writes of
    /// its part, the size record (chunk 0, when needed), and its final write-with-immediate.
    /// An optional receive's row (NCCL's LL) is one chunk, the whole message, as in
    /// whole-message mode: its write with immediate is also what a fence's receipts count.
    #[inline(always)]
    pub(super) fn post_chunk(
        &mut self,
        stage: &impl Words,
        io: &mut impl Post,
        (slot, c, q): (usize, usize, usize),
        at: Duration,
    ) -> Result<()> {
        // Borrowed, not copied: a slot is most of a kilobyte.
        let s = &self.slots[slot];
        let nreqs = usize::from(s.nreqs);
        let split = self.p.split && !(nreqs == 1 && s.row[0].optional);
        let k = ChunkWrs {
            slot,
            chunk: c,
            lane: q,
            life: self.health.life[q],
            members: self.p.members[q],
            inline: self.p.inline_on(q),
        };
        let epoch = epoch(s.row[0].idx);
        // Most of NCCL's messages: one buffer, whole, its size in the immediate. Taken before
        // the general path's per-buffer arrays are built (split mode's immediate is laid out
        // otherwise: its unsplit optional rows take the general path).
        if nreqs == 1 && !self.p.split {
            let size = s.bufs[0].map_or(0, |b| b.size);
            if size_in_imm(&[size], false).is_some() {
                let imm = Imm { slot, chunk: c, epoch, size: Some(size) }.encode(false);
                if let Some((wr, data)) = k.whole(s, imm, self.p.max_msg) {
                    io.send(q, std::slice::from_ref(&wr))?;
                    self.sq[q].posted(1, true);
                    self.chunk_posted((slot, c, q), &[(0, data)], true, wr.wr_id);
                    self.chunk_sent(q, at, data, size);
                    return Ok(());
                }
            }
        }
        // The row's buffers only (a slot's others are empty).
        let (mut sizes, mut parts) = ([0; MAX_RECVS], [(0, 0); MAX_RECVS]);
        for (r, b) in s.bufs[..nreqs].iter().enumerate() {
            if let Some(b) = b {
                (sizes[r], parts[r]) = (b.size, self.part(slot, b.size, split, c));
            }
        }
        let size = size_in_imm(&sizes[..nreqs], self.p.split);
        let imm = Imm { slot, chunk: c, epoch, size }.encode(self.p.split);
        let mut chain = Chain::new(q, &mut self.chain, &mut self.sq[q]);
        let data = k.data(&mut chain, io, s, &parts, (self.p.max_msg, self.p.mark))?;
        if size.is_none() && c == 0 {
            k.size_record(&mut chain, io, stage, &self.remote_sizes, nreqs)?;
        }
        k.imm(&mut chain, io, imm, size.is_some() && data > 0)?;
        chain.flush(io)?;
        self.chunk_posted((slot, c, q), &parts[..nreqs], size.is_some(), k.id(WR_SEND));
        self.chunk_sent(q, at, data, sizes[..nreqs].iter().sum());
        Ok(())
    }

    /// Chunk bytes `data` of a message of `total` bytes went on lane `q` at `at`: for
    /// placement and the statistics.
    #[inline(always)]
    fn chunk_sent(&mut self, q: usize, at: Duration, data: u64, total: u64) {
        self.lanes[q].posted(at, data);
        let t = &mut self.health.traffic.lanes[q];
        t.bytes += data;
        t.by_size[size_class(total)] += data;
        t.chunks += 1;
    }

    /// Records where chunk `c` went, and its work requests for the profiler's journal.
    #[inline(always)]
    fn chunk_posted(
        &mut self,
        (slot, c, q): (usize, usize, usize),
        parts: &[(u64, u64)],
        single: bool,
        wr_id: u64,
    ) {
        if self.p.journal {
            for (r, &(_, len)) in parts.iter().enumerate() {
                // The immediate ends a single message's data, or is all a request without
                // bytes in this chunk gets.
                let imm = single || len == 0;
                let key = slot * MAX_RECVS + r;
                self.journal.push(Posted { key, wr_id, imm, lane: q, len });
            }
        }
        self.chunk_lane[slot * self.p.nqps + c] = q as u8;
    }

    /// Takes in one completion of the comm's CQ.
    #[inline(always)]
    pub fn complete(&mut self, c: &Completion) {
        // Split mode's NIC times every completion of a batch in turn (whole messages: unused).
        let at = if self.p.split { self.nic.taken() } else { Duration::ZERO };
        let lane = wr_lane(c.wr_id) % self.p.nqps;
        if wr_life(c.wr_id) != self.health.life[lane] {
            return; // work of an earlier life of a rebuilt lane: dropped, or sent again
        }
        let kind = wr_kind(c.wr_id);
        if kind == WR_MEND {
            return self.proven(lane, c);
        }
        if c.status != 0 && self.lane_failed(lane, c) {
            return;
        }
        if c.status == 0 && matches!(kind, WR_SEND | WR_MARK | WR_PROBE | WR_MAIL) {
            self.sq[lane].completed();
        }
        if !self.health.completion(c) {
            return;
        }
        match kind {
            WR_SEND => {}
            WR_MARK => return self.health.watchdog.completed(false),
            _ => return,
        }
        // Each chunk ends in one such completion, and a QP completes in order. In split mode a
        // lane's time on a chunk starts no earlier than the NIC's last finished chunk of
        // another lane: healthy lanes that the NIC serves one after the other then measure
        // alike (timed from their posts, the last served measured half the first's rate).
        let timed = if self.p.split {
            self.nic.retired(&mut self.lanes[lane], at)
        } else {
            self.lanes[lane].retired(self.clock.unwrap_or_default(), Duration::ZERO)
        };
        if timed {
            self.retimed = true;
            self.health.traffic.lanes[lane].rate = self.lanes[lane].rate;
        }
        self.chunk_done(wr_slot(c.wr_id), wr_chunk(c.wr_id));
    }

    /// Chunk `chunk` of slot `slot` is delivered: its completion arrived, or the receipts of a
    /// fence say it landed.
    #[inline(always)]
    pub(super) fn chunk_done(&mut self, slot: usize, chunk: usize) {
        let s = &mut self.slots[slot];
        let bit = 1u128 << chunk;
        if s.pending & bit == 0 {
            return; // not this slot's: nothing of it is in flight
        }
        s.pending &= !bit;
        self.health.watchdog.completed(s.pending == 0);
        if s.pending == 0 {
            self.in_flight -= 1;
            // The row's buffers only: the others are empty already.
            s.bufs[..usize::from(s.nreqs)].fill(None);
            for req in &mut self.reqs[slot * MAX_RECVS..(slot + 1) * MAX_RECVS] {
                if req.state == State::Pending {
                    req.state = State::Done;
                }
            }
        }
    }

    /// After a poll found no more completions at `now` (any monotonic clock): chunks of a
    /// failed lane go again on live ones, failed lanes are repaired ([`mend`]), then the
    /// watchdog, the device, and a liveness probe (on every live lane) if the sender has been
    /// waiting quietly. `fifo` holds the receiver's answers, `stage` the sender's requests.
    pub fn idle(
        &mut self,
        now: Duration,
        elsewhere: Option<Fault>,
        io: &mut impl Post,
        (fifo, stage): (&impl Words, &impl Words),
    ) -> Result<()> {
        // Waiting on the peer: for a CTS, for completions, or with a row half matched.
        let half = self.slots[(self.head % SLOTS as u64) as usize].matched != 0;
        let waiting = self.wants_cts || self.in_flight > 0 || half || self.unfenced != 0;
        // At rest: nothing outstanding or waited for, no lane busy, no port down, no wait
        // being timed, no witness wanted. Then nothing is left to send again, the stall check
        // and the probe have nothing to find, and only the repair, the lanes to avoid and the
        // watchdog are looked at (each returns at once with nothing to do).
        if !waiting && self.sq.iter().all(|c| c.signaled.is_empty()) && self.health.at_rest() {
            if self.health.fatal.is_none() {
                self.repair(now, fifo, stage, io);
            }
            self.avoid_lanes();
            return self.health.idle(now, elsewhere);
        }
        if self.health.fatal.is_none() {
            self.resend(stage, io)?;
            self.repair(now, fifo, stage, io);
            if self.p.failover {
                let busy = busy_lanes(self.alive, &self.sq);
                let on_down = self.health.on_down(self.alive, &self.p.members);
                let lanes = &self.lanes;
                let allowance = |q: usize| lanes[q].allowance();
                let found = self.health.stalled(now, (busy, self.alive, on_down), allowance);
                if let Some((lane, why)) = found {
                    io.fence(lane).map_err(|e| self.health.post_failed(e))?;
                    self.drop_lane(lane, &why);
                }
            }
        }
        self.avoid_lanes();
        let (alive, queues) = (self.alive, &self.sq);
        let lanes = || sq::room(alive, queues);
        let (target, members) = (self.remote_sizes, &self.p.members);
        let at = |q: usize| target.at(0, members[q].1);
        let probed = self.health.probe(now, (waiting, self.wants_cts), io, (lanes, at))?;
        sq::probes_posted(&mut self.sq, probed);
        self.health.idle(now, elsewhere)
    }

    /// The lanes to avoid, as of now ([`Self::avoid`]). Only a chunk in flight (its wait),
    /// a timed chunk retired (a rate), or a lane avoided (its rate is forgotten in time) can
    /// change them: forgetting a rate never adds a lane to avoid.
    #[inline(always)]
    pub(super) fn avoid_lanes(&mut self) {
        if !self.p.path_aware {
            return;
        }
        let dead = !self.alive & self.all;
        // A lane holds chunks only of messages in flight, while the comm lives (a post that
        // failed part-way leaves its first chunks on their lanes, and fails the comm).
        debug_assert!(
            self.health.fatal.is_some()
                || self.in_flight > 0
                || !self.lanes.iter().any(place::Lane::busy)
        );
        if self.in_flight > 0 || std::mem::take(&mut self.retimed) || self.avoid != dead {
            let now = self.clock.unwrap_or_default();
            let split = self.p.split.then_some((self.avoid, &self.nic));
            self.avoid = place::avoided(&self.lanes, self.alive, now, split);
        }
    }

    /// A poll that found completions, between the idle work's runs ([`IDLE_EVERY`]): chunks
    /// a failover left to send again go out ([`Self::idle`] less its timed checks).
    pub fn after_poll(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        if self.health.fatal.is_none() {
            self.resend(stage, io)?;
        }
        self.health.check()
    }

    /// Whether request `id` still waits for completions (the caller polls before [`Self::test`]).
    pub fn pending(&self, id: usize) -> bool {
        self.reqs.get(id).is_some_and(|r| r.state == State::Pending)
    }

    /// `Some(size)` once request `id` completed (the request is then free again).
    #[inline(always)]
    pub fn test(&mut self, id: usize) -> Result<Option<u64>> {
        let req = self
            .reqs
            .get_mut(id)
            .ok_or_else(|| Error::Internal(format!("bad send request {id}")))?;
        match req.state {
            State::Free => Err(Error::Internal(format!("test of a free send request {id}"))),
            State::Pending => self.health.check().map(|_| None),
            State::Done => {
                req.state = State::Free;
                Ok(Some(req.size))
            }
        }
    }
}
