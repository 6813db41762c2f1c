//! Both ends of the protocol against a simulated network, with no verbs: random interleavings
//! of irecv, isend, test and the delivery of each queue pair's work requests, with 1–8 QPs in
//! split and round-robin modes, multi-receives of 1–8 tagged buffers, sizes from 0 up, inline
//! and not, FIFO wrap-around over 10⁵ messages (CTS batches that wrap included), and error
//! completions. Every CTS row must land in the sender's FIFO exactly once and in order, and
//! a staged receive must never leave the sender without a row. Every request must
//! complete exactly once, with its size and its bytes, in NCCL's order rules (receives match
//! sends in posting order; tags pick the buffer inside a multi-receive). Every operation must
//! meet what its target queue pair grants ([`Grant`]); a sender that lies about sizes must fail
//! the receiver.
//!
//! Mutants of the core (when it was `transport/proto.rs`) these tests kill (each applied by
//! hand, seen failing, reverted):
//! - no check of the reported sizes against the posted ones:
//!   `a_size_beyond_the_posted_one_fails_the_receiver`;
//! - the check with `>=` for `>` (a send truncated to exactly the receive's size fails):
//!   `random_interleavings_complete_every_request_once_with_its_bytes`;
//! - the sender's QPs granting nothing (QP 0 too): every test that moves data;
//! - the sender's QPs 1 and up granting remote write, or a receive QP remote read:
//!   `each_queue_pair_grants_only_what_its_role_needs`;
//! - no write of a partial CTS batch (rows staged until 8): every random program, and
//!   `cts_rows_go_out_in_batches_before_the_sender_runs_out`;
//! - the batch bound off by one (`staged + 1 < BATCH`), or the low-water mark off by one
//!   (`>= low`): `cts_rows_go_out_in_batches_before_the_sender_runs_out`;
//! - no CTS write ever signaled, or no room check on the CTS send queue:
//!   `optional_receives_flow_as_single_writes_with_a_bounded_cts_queue`;
//! - no poll asked for when the CTS queue is half used (found by the VM's gpudirect test):
//!   `one_message_at_a_time_never_stalls_the_cts_rows`;
//! - a sender lane that never fails over, a receiver lane that never fails over, or rows not
//!   written again after the receiver's lane failed: `a_failed_lane_moves_its_chunks_to_the_live_lanes`
//!   and `every_lane_dead_fails_the_comm`.
//! - a chunk known by the lane it arrived on instead of its immediate:
//!   `a_chunk_delivered_twice_is_counted_once`;
//! - no check of the slot's use in the immediate:
//!   `an_immediate_of_another_use_of_the_slot_is_not_counted`;
//! - a queue pair's async error taken without dropping its lane:
//!   `a_queue_pair_error_fails_over_like_a_dead_path`;
//! - a write the peer's queue pair refused as invalid failing the comm, not its lane:
//!   `a_write_the_peer_refuses_fails_over_like_a_dead_path`;
//! - path-aware placement off (strict rotation, equal chunks): `a_slow_lane_gets_less_of_the_work`;
//! - a rebuilt lane not marked short by the rebuild itself:
//!   `a_rebuilt_lane_gets_its_receives_whatever_its_pool_counted`.

use std::cell::RefCell;
use std::collections::VecDeque;

use super::*;

/// The errno the simulated verbs fail with (Linux's ENOMEM; the core has no libc).
const ENOMEM: i32 = 12;

// --- the simulated hosts and network -----------------------------------------------------------

/// A region's key on member port `m`: its own plus `m` times this.
const MEMBER_KEY: u32 = 100;

/// Region key `k` on every member port.
fn keys(k: u32) -> Keys {
    std::array::from_fn(|m| k + MEMBER_KEY * m as u32)
}

/// The peer's region at `addr` with key `k` on every member port.
fn remote(addr: u64, k: u32) -> Remote {
    Remote { addr, rkeys: keys(k) }
}

/// Registered memory of both hosts: regions by base address, each with its key.
struct Mem {
    regions: RefCell<Vec<(u64, u32, Vec<u8>)>>,
    /// Regions that stand for GPU memory: a CPU read of them (inline data) is a crash.
    gpu: RefCell<Vec<u64>>,
    /// Receive buffers `[start, end)` whose receive completed and that NCCL has not posted
    /// again: a NIC write into one is silent corruption (the invariant at the top of the core).
    closed: RefCell<Vec<(u64, u64)>>,
}

impl Mem {
    fn new() -> Mem {
        Mem {
            regions: RefCell::new(Vec::new()),
            gpu: RefCell::new(Vec::new()),
            closed: RefCell::new(Vec::new()),
        }
    }

    /// The receive of `[addr, addr + len)` completed: the buffer is NCCL's again.
    fn close(&self, addr: u64, len: u64) {
        self.closed.borrow_mut().push((addr, addr + len));
    }

    /// NCCL posted `[addr, addr + len)` again.
    fn reopen(&self, addr: u64, len: u64) {
        self.closed.borrow_mut().retain(|&(a, b)| b <= addr || addr + len <= a);
    }

    /// A NIC write lands in `[addr, addr + len)`: never in a completed receive's buffer.
    fn nic_write(&self, addr: u64, len: u64) {
        let closed = self.closed.borrow();
        let hit = closed.iter().find(|&&(a, b)| addr < b && a < addr + len);
        assert!(
            hit.is_none(),
            "{len} bytes written at {addr:#x}, into the buffer {hit:x?} of a receive that \
             completed and was not posted again: silent corruption"
        );
    }

    /// Every region of both ends: data areas of `data_len` bytes, FIFO, staging, size records
    /// and the flush's scratch byte.
    fn both_ends(data_len: usize) -> Mem {
        let mem = Mem::new();
        mem.add(SEND_DATA, 11, data_len);
        mem.add(RECV_DATA, 12, data_len);
        mem.add(FIFO, 13, FIFO_AREA * 8);
        mem.add(SEND_STAGE, 14, SIZE_AREA * 8);
        mem.add(RECV_STAGE, 15, FIFO_AREA * 8);
        mem.add(RECV_SIZES, 16, SIZE_AREA * 8);
        mem.add(SCRATCH, 17, 8);
        mem
    }

    /// What the provider's CPU copy of inline data reads: never GPU memory.
    fn cpu_read(&self, addr: u64, len: usize) -> Vec<u8> {
        let regions = self.regions.borrow();
        let gpu = self.gpu.borrow();
        let hit = regions.iter().find(|(b, _, v)| *b <= addr && addr < *b + v.len() as u64);
        assert!(
            !hit.is_some_and(|(b, _, _)| gpu.contains(b)),
            "the CPU read {len} bytes of GPU memory at {addr:#x} (inline data)"
        );
        drop(regions);
        self.read(addr, len)
    }

    fn add(&self, base: u64, key: u32, len: usize) {
        self.regions.borrow_mut().push((base, key, vec![0; len]));
    }

    /// Runs `f` on `[addr, addr + len)`, which must lie in one region (with `key`, if given:
    /// `(offset, key)`, the region's key plus the offset of the member port used).
    fn with<T>(
        &self,
        addr: u64,
        len: usize,
        key: Option<(u32, u32)>,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> T {
        let mut regions = self.regions.borrow_mut();
        let (base, k, bytes) = regions
            .iter_mut()
            .find(|(b, _, v)| *b <= addr && addr + len as u64 <= *b + v.len() as u64)
            .unwrap_or_else(|| panic!("{len} bytes at {addr:#x} are in no registered region"));
        if let Some((offset, key)) = key {
            assert_eq!(*k + offset, key, "wrong key for {addr:#x}");
        }
        let off = (addr - *base) as usize;
        f(&mut bytes[off..off + len])
    }

    fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        self.with(addr, len, None, |b| b.to_vec())
    }
}

/// A region seen as words, as the core sees registered buffers.
struct Area<'a> {
    mem: &'a Mem,
    base: u64,
    key: u32,
}

impl Words for Area<'_> {
    fn load(&self, w: usize) -> u64 {
        self.mem
            .with(self.base + 8 * w as u64, 8, None, |b| u64::from_le_bytes(b.try_into().unwrap()))
    }
    fn store(&self, w: usize, v: u64) {
        self.mem.with(self.base + 8 * w as u64, 8, None, |b| b.copy_from_slice(&v.to_le_bytes()))
    }
    fn addr(&self, w: usize) -> u64 {
        self.base + 8 * w as u64
    }
    fn lkey(&self, member: usize) -> u32 {
        self.key + MEMBER_KEY * member as u32
    }
}

/// A posted work request; inline ones carry their bytes from the time of posting.
#[derive(Clone)]
struct Queued {
    wr: SendWr,
    inline: Option<Vec<u8>>,
    /// A CTS write from the receiver's stage: the rows it reads, as they were when posted.
    stage: Option<Vec<u8>>,
}

/// The queue pairs of both ends (`[side][qp]`, side 0 sends, 1 receives; QP `q` of one side
/// is connected to QP `q` of the other) and their completion queues.
struct Wire {
    sq: [Vec<VecDeque<Queued>>; 2],
    rq: [Vec<VecDeque<u64>>; 2],
    cq: [VecDeque<Completion>; 2],
    /// Per side and QP: send-queue entries not yet reclaimed (a provider such as mlx5 frees
    /// them only when the completion of a later signaled work request is polled), and entries
    /// executed since the last signaled one.
    held: [Vec<(usize, usize)>; 2],
    /// Per side, in completion order: what polling each signaled send's completion frees
    /// (`wr_id`, QP, entries, the QP's life then).
    frees: [VecDeque<(u64, usize, usize, u32)>; 2],
    /// Per side and QP: how often it was replaced (lane repair).
    life: [Vec<u32>; 2],
    /// Per side and lane: its QP's number, and the peer QP it is connected to (0: none yet).
    /// A lane whose two QPs are not connected to each other fails its work as a dead path.
    qpn: [Vec<u32>; 2],
    dest: [Vec<u32>; 2],
    /// Replacements per side.
    renewed: [u64; 2],
    /// Per side and QP, the inline payload the QP takes (none listed: whatever is marked): a
    /// request marked inline but longer goes from its memory, as `Qp::post_send` sends it.
    caps: [Vec<u32>; 2],
    broken: bool,
    /// Every post fails (as `ibv_post_send` does with ENOMEM or a QP in a bad state).
    posts_fail: bool,
    /// The sender's side lies: every size it reports from now on (in an immediate or a size
    /// record) exceeds any posted size, as a broken or hostile peer's could.
    lying: bool,
    /// CTS rows whose head entry has landed in the sender's FIFO: each must land once, in
    /// order.
    rows_landed: u64,
    /// Posts of CTS batches, and those whose head entries wrapped the FIFO (two writes).
    batches: u64,
    wrapped: u64,
    /// The sender's work requests of its chunks (`WR_SEND`), and those of them that were
    /// plain writes (no immediate).
    sends: u64,
    plain: u64,
    /// Calls that posted receive WQEs.
    recv_posts: u64,
    /// Deliver every write-with-immediate a second time on another lane; how many were.
    duplicates: bool,
    dups: u64,
    /// Per lane: its path drops everything from now on, both ways (`Some(landed)`: the
    /// sender's next work request still lands, but its ACK is lost), and per side and QP
    /// whether the QP has failed (retries exhausted: it flushes everything after, its posted
    /// receives included).
    black_hole: Vec<Option<bool>>,
    failed: [Vec<bool>; 2],
    /// Per side and QP: failed by a fence (no WARN is owed for it).
    fenced: [Vec<bool>; 2],
    /// Per lane: the receiver-to-sender direction of its path drops everything (the sender's
    /// writes all land, their ACKs vanish): the sender's signaled requests that executed
    /// without an ACK, and how many more of its requests execute before its retries run out.
    one_way: Vec<Option<(Vec<u64>, u32)>>,
    /// Per lane: the receiver's queue pair refused a write as invalid ([`Run::refusals`]): the
    /// sender's head fails with `IBV_WC_REM_INV_REQ_ERR`, not with its retries run out.
    refused: Vec<bool>,
    /// The simulated clock, as the cores' precise one.
    now: Duration,
    /// Per lane, the sender's and the receiver's member ports (empty: all on the first).
    members: Vec<(usize, usize)>,
    /// The ends fail over (else a dead lane fails the comm).
    failover: bool,
    /// Retries never run out on a one-way black hole, and a request into a fenced or replaced
    /// queue pair is never answered ([`Run::forever`]).
    forever: bool,
    /// Stragglers ([`Run::late`]): per write caught on a dead path or on a lane the sender
    /// fenced, its lane, the life of the receiver's QP it was sent to, and the write; how many
    /// landed and how many were dropped.
    late: Option<Vec<(usize, u32, Queued)>>,
    late_landed: u64,
    late_dropped: u64,
}

impl Wire {
    fn new(nqps: usize) -> Wire {
        let sq = || (0..=nqps).map(|_| VecDeque::new()).collect::<Vec<_>>();
        let rq = || (0..=nqps).map(|_| VecDeque::new()).collect::<Vec<_>>();
        Wire {
            sq: [sq(), sq()],
            rq: [rq(), rq()],
            cq: [VecDeque::new(), VecDeque::new()],
            held: [vec![(0, 0); nqps + 1], vec![(0, 0); nqps + 1]],
            frees: [VecDeque::new(), VecDeque::new()],
            life: [vec![0; nqps + 1], vec![0; nqps + 1]],
            qpn: [(0..=nqps as u32).map(|q| 100 + q).collect(), (0..=nqps as u32).collect()],
            dest: [(0..=nqps as u32).collect(), (0..=nqps as u32).map(|q| 100 + q).collect()],
            renewed: [0, 0],
            caps: [Vec::new(), Vec::new()],
            broken: false,
            posts_fail: false,
            lying: false,
            rows_landed: 0,
            batches: 0,
            wrapped: 0,
            sends: 0,
            plain: 0,
            recv_posts: 0,
            duplicates: false,
            dups: 0,
            black_hole: vec![None; nqps + 1],
            failed: [vec![false; nqps + 1], vec![false; nqps + 1]],
            fenced: [vec![false; nqps + 1], vec![false; nqps + 1]],
            one_way: vec![None; nqps + 1],
            refused: vec![false; nqps + 1],
            now: Duration::ZERO,
            members: Vec::new(),
            failover: true,
            forever: false,
            late: None,
            late_landed: 0,
            late_dropped: 0,
        }
    }

    /// The member port lane `q` of `side` is on (the flush QP: the receiver's first).
    fn member(&self, side: usize, q: usize) -> usize {
        self.members.get(q).map_or(0, |m| if side == 0 { m.0 } else { m.1 })
    }

    /// The sender's lane `q` black-holes: its next work request fails with retries exhausted
    /// (after landing, if `landed`), and everything after it is flushed.
    fn kill_lane(&mut self, q: usize, landed: bool) {
        self.black_hole[q] = Some(landed);
    }

    /// Lane `q`'s path answers again (its QPs stay failed until rebuilt).
    fn heal_lane(&mut self, q: usize) {
        self.black_hole[q] = None;
        // Healed before the retries ran out: the retransmissions are acknowledged.
        let unacked = self.one_way[q].take().map(|o| o.0).unwrap_or_default();
        let n = unacked.len();
        for (k, wr_id) in unacked.into_iter().enumerate() {
            let entries = if k + 1 == n { std::mem::take(&mut self.held[0][q].1) } else { 0 };
            self.frees[0].push_back((wr_id, q, entries, self.life[0][q]));
            self.cq[0].push_back(Completion { wr_id, ..Default::default() });
        }
    }

    /// Lane `q`'s two QPs are connected to each other.
    fn connected(&self, q: usize) -> bool {
        self.dest[0][q] == self.qpn[1][q] && self.dest[1][q] == self.qpn[0][q]
    }

    /// No lane is left, and the comm may fail: every lane's path is dead, or its queue pair
    /// failed or was fenced at one end or both, or its two queue pairs are not connected to
    /// each other (a repair under way: both ends rebuilt, the sender's not yet joined to the
    /// receiver's new one). A lane out comes back only through a repair, and the repair's
    /// request and answer travel through a live lane (`mend`): with none, nothing can bring
    /// one back, and the comm may fail. So it goes when the sender fences a slow but live lane
    /// for a stall (a false alarm the stall bound allows) and the last other path dies before
    /// that lane is repaired; an attempt made then still rebuilds both ends, and only its
    /// answer is lost.
    fn no_lane_left(&self) -> bool {
        let n = self.black_hole.len() - 1;
        let out = |q: usize| self.failed[0][q] || self.failed[1][q] || !self.connected(q);
        (0..n).all(|q| self.black_hole[q].is_some() || self.one_way[q].is_some() || out(q))
    }

    /// How many of `side`'s lanes failed: at least (not fenced: a fence may take a lane out
    /// before its end saw it fail), and at most.
    fn lanes_failed(&self, side: usize) -> (usize, usize) {
        let n = self.failed[side].len() - 1;
        let failed = (0..n).filter(|&q| self.failed[side][q]);
        let unfenced = failed.clone().filter(|&q| !self.fenced[side][q]).count();
        (unfenced, failed.count())
    }

    /// Checks the CTS entries `bytes` that land at `addr` in the sender's FIFO: every head
    /// entry is the next row, in its slot; the other entries of a multi-receive land before
    /// their row's head.
    fn cts_landed(&mut self, addr: u64, bytes: &[u8]) {
        for (e, entry) in bytes.chunks_exact(ENTRY).enumerate() {
            let word = (addr - FIFO) as usize / 8 + e * ENTRY_WORDS;
            let w: [u64; ENTRY_WORDS] = std::array::from_fn(|i| {
                u64::from_le_bytes(entry[i * 8..i * 8 + 8].try_into().unwrap())
            });
            let cts = Cts::decode(w);
            // Once the receiver lost a lane it writes the rows the sender may not have seen
            // again, on the next: the same rows, in their slots.
            let moved = self.failed[1].contains(&true) || self.renewed[1] > 0;
            let again = moved && cts.idx <= self.rows_landed;
            // A NIC reads what it writes when it executes the write, but no row written again
            // finds its slot restaged: a slot waits for the writes that read it.
            if word < SLOTS * ENTRY_WORDS {
                assert_eq!(word, entry_word((cts.idx as usize - 1) % SLOTS, 0), "row's slot");
                if !again {
                    assert_eq!(cts.idx, self.rows_landed + 1, "rows land once, in order");
                    self.rows_landed += 1;
                }
            } else {
                assert!(again || cts.idx > self.rows_landed, "an entry lands before its head");
            }
        }
    }

    /// Executes the head work request of `side`'s QP `q`.
    fn step(&mut self, mem: &Mem, side: usize, q: usize) {
        let nqps = self.sq[side].len() - 1;
        let peer_failed = q < nqps && self.failed[1 - side][q];
        let strangers = q < nqps && !self.connected(q);
        let unacked = self.one_way[q].as_ref().is_some_and(|o| !o.0.is_empty());
        if side == 0 && unacked {
            return self.step_one_way(mem, side, q); // its retries run out first
        }
        // The peer's QP fenced or replaced drops the request unanswered: retries that never
        // run out keep it at the head until the lane is connected again, or fenced here.
        let unanswered = peer_failed || strangers;
        if self.forever && unanswered && !self.failed[side][q] && self.black_hole[q].is_none() {
            return;
        }
        if self.failed[side][q] || self.black_hole[q].is_some() || unanswered {
            return self.fail_head(mem, side, q);
        }
        if self.one_way[q].is_some() {
            return self.step_one_way(mem, side, q);
        }
        self.step_ok(mem, side, q)
    }

    /// `side`'s QP `q` on a path that drops the receiver-to-sender direction: the receiver's
    /// own requests find nobody (retries exhausted); the sender's land, but no ACK comes back,
    /// until its retries run out on the first one not acknowledged.
    fn step_one_way(&mut self, mem: &Mem, side: usize, q: usize) {
        if side == 1 {
            if self.forever && !self.failed[1][q] {
                return; // retried forever, never acknowledged
            }
            return self.fail_head(mem, side, q);
        }
        if self.forever && self.failed[0][q] {
            // Fenced: what landed unacknowledged is flushed with the rest.
            let unacked = self.one_way[q].as_mut().map(|o| std::mem::take(&mut o.0));
            for wr_id in unacked.unwrap_or_default() {
                self.cq[0].push_back(Completion { wr_id, status: 5, ..Default::default() });
            }
            return self.fail_head(mem, 0, q);
        }
        let dead = self.failed[0][q] || self.failed[1][q] || !self.connected(q);
        let forever = self.forever;
        let (ref mut unacked, ref mut left) = *self.one_way[q].as_mut().expect("one-way");
        if forever && (dead || self.sq[0][q].is_empty()) {
            return; // retried forever: the peer's fenced queue pair drops them unanswered
        }
        if (*left > 0 || forever) && !self.sq[0][q].is_empty() && !dead {
            *left = left.saturating_sub(1);
            let head = &mut self.sq[0][q].front_mut().expect("checked").wr;
            if head.signaled {
                unacked.push(head.wr_id);
            }
            head.signaled = false;
            return self.step_ok(mem, 0, q);
        }
        // The retry bound (or the peer's QP is gone): the first request not acknowledged
        // fails, everything after it is flushed.
        let unacked = std::mem::take(unacked);
        let failed = !unacked.is_empty() || self.sq[0][q].is_empty();
        for (k, wr_id) in unacked.into_iter().enumerate() {
            let status = if k == 0 && !self.failed[0][q] { 12 } else { 5 };
            self.cq[0].push_back(Completion { wr_id, status, ..Default::default() });
        }
        self.failed[0][q] |= failed;
        self.fail_head(mem, 0, q)
    }

    /// Executes the head work request of `side`'s QP `q` on a path that answers.
    fn step_ok(&mut self, mem: &Mem, side: usize, q: usize) {
        let Some(Queued { wr, inline, stage }) = self.sq[side][q].pop_front() else { return };
        if let (Some(posted), Some((addr, len, _))) = (stage, wr.local) {
            // The verbs rule: a request's local memory stays as it was until it completes. A
            // NIC reads it when it executes the write (again, when it retransmits it), so a
            // row restaged under a write in flight could reach the sender torn.
            assert!(
                mem.read(addr, len as usize) == posted,
                "a staged row changed under the CTS write that reads it"
            );
        }
        let landed = self.land(mem, side, q, &wr, inline);
        assert!(landed, "receiver not ready: a write-with-immediate found no receive posted");
        let held = &mut self.held[side][q];
        held.1 += 1;
        if wr.signaled {
            self.frees[side].push_back((wr.wr_id, q, held.1, self.life[side][q]));
            held.1 = 0;
            self.cq[side].push_back(Completion { wr_id: wr.wr_id, ..Default::default() });
        }
    }

    /// A straggler arrives ([`Run::late`]): the receiver's QP it was sent to drops it if it
    /// failed or was replaced since (an RC QP in the error state, or a new QP number), and so
    /// does a QP with no receive posted for its immediate; else it lands, however long after
    /// its chunk was counted, sent again or completed.
    fn arrive_late(&mut self, mem: &Mem, k: usize) {
        let Some((q, life, Queued { wr, inline, .. })) = self.late.as_mut().map(|l| l.remove(k))
        else {
            return;
        };
        let open = !self.failed[1][q] && self.life[1][q] == life && self.connected(q);
        if open && self.land(mem, 0, q, &wr, inline) {
            self.late_landed += 1;
        } else {
            self.late_dropped += 1;
        }
    }

    /// What `side`'s work request `wr` on QP `q` does at the responder: its data lands and its
    /// immediate consumes a posted receive. False, doing nothing, if the immediate finds no
    /// receive.
    fn land(
        &mut self,
        mem: &Mem,
        side: usize,
        q: usize,
        wr: &SendWr,
        inline: Option<Vec<u8>>,
    ) -> bool {
        let peer = 1 - side;
        if matches!(wr.op, Op::WriteImm(_)) && self.rq[peer][q].is_empty() {
            return false;
        }
        // The responding QP must grant the operation: the peer's QP `q`, or for the loopback
        // flush QP (the receiver's QP `nqps`) itself.
        let nqps = self.sq[side].len() - 1;
        let (rside, rq) = if side == 1 && q >= nqps { (1, q) } else { (peer, q) };
        let grant = if rside == 0 { send_grant(rq) } else { recv_grant(rq, nqps) };
        let needed = if wr.op == Op::Read { Grant::Read } else { Grant::Write };
        assert_eq!(grant, needed, "side {side} QP {q}: {:?} on a QP that grants {grant:?}", wr.op);
        if let Some((addr, len, lkey)) = wr.local {
            // Each end uses the keys of the member ports the lane runs between.
            let key = |m: usize, k: u32| Some((m as u32 * MEMBER_KEY, k));
            let ours = key(self.member(side, q), lkey);
            let mut bytes =
                inline.unwrap_or_else(|| mem.with(addr, len as usize, ours, |b| b.to_vec()));
            let records = RECV_SIZES..RECV_SIZES + 8 * SIZE_WORDS as u64;
            if self.lying && side == 0 && records.contains(&wr.remote_addr) {
                for w in bytes.chunks_exact_mut(8) {
                    let v = u64::from_le_bytes((&*w).try_into().unwrap()) + CAP + 1;
                    w.copy_from_slice(&v.to_le_bytes());
                }
            }
            if side == 0 && wr_kind(wr.wr_id) == WR_SEND {
                self.sends += 1;
                self.plain += u64::from(wr.op == Op::Write);
            }
            if side == 1 && (FIFO..FIFO + 8 * FIFO_WORDS as u64).contains(&wr.remote_addr) {
                self.cts_landed(wr.remote_addr, &bytes);
            }
            if wr.op != Op::Read {
                mem.nic_write(wr.remote_addr, u64::from(len));
            }
            match wr.op {
                Op::Read => {}
                _ => mem.with(
                    wr.remote_addr,
                    len as usize,
                    key(self.member(peer, q), wr.rkey),
                    |b| b.copy_from_slice(&bytes),
                ),
            }
        }
        if let Op::WriteImm(mut imm) = wr.op {
            if self.lying && side == 0 && imm & IMM_SIZES == 0 {
                imm += (CAP as u32 + 1) << IMM_SIZE_SHIFT;
            }
            let r = self.rq[peer][q].pop_front().expect("checked");
            self.cq[peer].push_back(Completion { wr_id: r, imm: Some(imm), ..Default::default() });
            // The same chunk again, on the next lane, as a sender does that resends a chunk whose
            // first copy landed but whose ACK was lost: the receiver must count it once.
            let q2 = (q + 1) % nqps;
            if self.duplicates && side == 0 && self.rq[peer][q2].len() > 1 {
                let r = self.rq[peer][q2].pop_front().expect("checked");
                let c = Completion { wr_id: r, imm: Some(imm), ..Default::default() };
                self.cq[peer].push_back(c);
                self.dups += 1;
            }
        }
        true
    }

    /// `side`'s QP `q` on a black-holed path: its head fails with retries exhausted (having
    /// landed, for the sender, if so asked), then it flushes everything, its posted receives
    /// included.
    fn fail_head(&mut self, mem: &Mem, side: usize, q: usize) {
        if self.failed[side][q] {
            let flushed = self.sq[side][q].drain(..).map(|Queued { wr, .. }| wr.wr_id);
            let flushed: Vec<u64> = flushed.chain(self.rq[side][q].drain(..)).collect();
            for wr_id in flushed {
                self.cq[side].push_back(Completion { wr_id, status: 5, ..Default::default() });
            }
            return;
        }
        let Some(&Queued { wr, .. }) = self.sq[side][q].front() else { return };
        let met = self.connected(q) && !self.failed[1][q];
        if side == 0 && self.black_hole[q] == Some(true) && met {
            // It lands (data, immediate), but its ACK is lost: the sender's retries run out.
            self.sq[0][q].front_mut().expect("checked").wr.signaled = false;
            self.step_ok(mem, 0, q);
        } else {
            let head = self.sq[side][q].pop_front().expect("checked");
            // The write on the wire when the path died may still arrive, late.
            let life = self.life[1][q];
            if let Some(late) = self.late.as_mut().filter(|_| side == 0 && wr.op != Op::Read) {
                late.push((q, life, head));
            }
        }
        let status = if side == 0 && self.refused[q] { REMOTE_INVALID } else { 12 };
        self.cq[side].push_back(Completion { wr_id: wr.wr_id, status, ..Default::default() });
        self.failed[side][q] = true;
        self.fail_head(mem, side, q);
    }

    /// The link dies: the head of every send queue fails (retry exceeded), everything behind it
    /// and every posted receive is flushed.
    fn break_all(&mut self) {
        self.broken = true;
        for side in 0..2 {
            for q in 0..self.sq[side].len() {
                let mut first = true;
                while let Some(Queued { wr, .. }) = self.sq[side][q].pop_front() {
                    let status = if first { 12 } else { 5 };
                    first = false;
                    self.cq[side].push_back(Completion {
                        wr_id: wr.wr_id,
                        status,
                        ..Default::default()
                    });
                }
                while let Some(r) = self.rq[side][q].pop_front() {
                    self.cq[side].push_back(Completion {
                        wr_id: r,
                        status: 5,
                        ..Default::default()
                    });
                }
            }
        }
    }

    /// Without failover, a path dead or silent one way fails the comm.
    fn one_lane(&self) -> bool {
        !self.failover
            && (self.black_hole.iter().any(Option::is_some)
                || self.one_way.iter().any(Option::is_some))
    }

    /// The link is broken, nothing can be posted, the sender lies, or a path failed a comm
    /// without failover.
    fn faulty(&self) -> bool {
        self.broken || self.posts_fail || self.lying || self.one_lane()
    }

    /// The link is faulty ([`Self::faulty`]) or the comm lost every lane: requests may fail.
    fn failing(&self) -> bool {
        self.faulty() || self.no_lane_left()
    }

    /// Checks error `e` of a request or a step on a failing link: where only
    /// [`Self::no_lane_left`] lets requests fail, every path is gone, so it must be the path's
    /// or the peer's (`Error::Remote`), never the comm's own (an internal error, a failed post,
    /// a bad argument).
    fn failed_with(&self, e: &Error) {
        if !self.faulty() {
            assert!(matches!(e, Error::Remote(_)), "with no lane left, not the path's: {e}");
        }
    }

    fn busy(&self) -> Vec<(usize, usize)> {
        (0..2)
            .flat_map(|s| (0..self.sq[s].len()).map(move |q| (s, q)))
            .filter(|&(s, q)| {
                let unacked = s == 0 && self.one_way.get(q).is_some_and(|o| o.is_some());
                !self.sq[s][q].is_empty() || unacked && !self.failed[0][q]
            })
            .collect()
    }
}

/// One end's view of the wire, as the core's [`Post`].
struct Io<'a> {
    wire: &'a RefCell<Wire>,
    mem: &'a Mem,
    side: usize,
    /// The send-queue depth each QP was created with.
    depth: usize,
}

impl Post for Io<'_> {
    fn send(&mut self, qp: usize, wrs: &[SendWr]) -> Result<()> {
        let mut w = self.wire.borrow_mut();
        assert!(wrs.len() <= MAX_CHAIN);
        // A CTS batch is one post of at most BATCH rows: their head entries in one write, or
        // two where the batch wraps the FIFO.
        let heads = FIFO..FIFO + (8 * SLOTS * ENTRY_WORDS) as u64;
        let head_writes: Vec<u32> = wrs
            .iter()
            .filter(|wr| self.side == 1 && heads.contains(&wr.remote_addr))
            .filter_map(|wr| wr.local.map(|l| l.1))
            .collect();
        if !head_writes.is_empty() {
            let rows = head_writes.iter().sum::<u32>() as u64 / ENTRY as u64;
            assert!(rows <= BATCH && head_writes.len() <= 2, "a batch of {rows} rows");
            w.batches += 1;
            w.wrapped += u64::from(head_writes.len() == 2);
        }
        if w.posts_fail {
            // Part of a chain may have gone out before the failure.
            let n = wrs.len() / 2;
            drop(w);
            self.send_ok(qp, &wrs[..n]);
            return Err(Error::verbs("ibv_post_send", ENOMEM, "sim"));
        }
        drop(w);
        self.send_ok(qp, wrs);
        Ok(())
    }
    fn now(&self) -> Duration {
        self.wire.borrow().now
    }
    fn fresh(&mut self, qp: usize) -> Result<u32> {
        let mut w = self.wire.borrow_mut();
        let side = self.side;
        assert!(qp < w.sq[side].len() - 1, "only a lane's QP is replaced");
        if w.posts_fail {
            return Err(Error::verbs("ibv_create_qp", ENOMEM, "sim"));
        }
        // The old QP goes with its queued work, uncompleted; what already completed stays in
        // the CQ.
        w.sq[side][qp].clear();
        w.rq[side][qp].clear();
        w.held[side][qp] = (0, 0);
        w.failed[side][qp] = false;
        w.fenced[side][qp] = false;
        w.refused[qp] = false;
        w.life[side][qp] += 1;
        w.renewed[side] += 1;
        let qpn = 1000 + (w.renewed[0] + w.renewed[1]) as u32; // unique
        w.qpn[side][qp] = qpn;
        w.dest[side][qp] = 0;
        Ok(qpn)
    }
    fn join(&mut self, qp: usize, peer: u32, _psns: (u32, u32)) -> Result<()> {
        let mut w = self.wire.borrow_mut();
        assert_eq!(w.dest[self.side][qp], 0, "a new QP is connected once");
        w.dest[self.side][qp] = peer;
        Ok(())
    }
    fn fence(&mut self, qp: usize) -> Result<()> {
        let mut w = self.wire.borrow_mut();
        let side = self.side;
        assert!(qp < w.sq[side].len() - 1, "only a lane is fenced");
        w.failed[side][qp] = true;
        w.fenced[side][qp] = true;
        // Its queued requests and posted receives complete as flushed.
        let w = &mut *w;
        // The sender's request on the wire when it fenced may still land, late.
        if let (0, Some(late), Some(head)) = (side, w.late.as_mut(), w.sq[side][qp].front())
            && head.wr.op != Op::Read
        {
            late.push((qp, w.life[1][qp], head.clone()));
        }
        let flushed: Vec<u64> = (w.sq[side][qp].drain(..).map(|q| q.wr.wr_id))
            .chain(w.rq[side][qp].drain(..))
            .collect();
        for wr_id in flushed {
            w.cq[side].push_back(Completion { wr_id, status: 5, ..Default::default() });
        }
        Ok(())
    }
    fn recv(&mut self, qp: usize, wr_id: u64, n: usize) -> Result<()> {
        let mut w = self.wire.borrow_mut();
        if w.posts_fail {
            return Err(Error::verbs("ibv_post_recv", ENOMEM, "sim"));
        }
        w.recv_posts += 1;
        for _ in 0..n {
            if w.broken || w.failed[self.side][qp] {
                w.cq[self.side].push_back(Completion { wr_id, status: 5, ..Default::default() });
            } else {
                w.rq[self.side][qp].push_back(wr_id);
            }
        }
        Ok(())
    }
}

impl Io<'_> {
    fn send_ok(&mut self, qp: usize, wrs: &[SendWr]) {
        let mut w = self.wire.borrow_mut();
        for wr in wrs {
            if w.broken || w.failed[self.side][qp] {
                // A QP in the error state flushes whatever is posted to it.
                let c = Completion { wr_id: wr.wr_id, status: 5, ..Default::default() };
                w.cq[self.side].push_back(c);
                continue;
            }
            let cap = w.caps[self.side].get(qp).copied().unwrap_or(u32::MAX);
            let inline = wr.local.filter(|l| wr.inline && l.1 <= cap);
            let inline = inline.map(|(a, l, _)| self.mem.cpu_read(a, l as usize));
            let fifo = FIFO..FIFO + 8 * FIFO_WORDS as u64;
            let staged = self.side == 1 && inline.is_none() && fifo.contains(&wr.remote_addr);
            let stage = wr.local.filter(|_| staged).map(|(a, l, _)| self.mem.read(a, l as usize));
            w.sq[self.side][qp].push_back(Queued { wr: *wr, inline, stage });
            w.held[self.side][qp].0 += 1;
            // The receiver's last QP is its flush QP, with a queue of its own.
            let flush = self.side == 1 && qp + 1 == w.failed[1].len();
            let depth = if flush { FLUSH_QUEUE } else { self.depth };
            assert!(w.held[self.side][qp].0 <= depth, "send queue {qp} overflows");
        }
    }
}

// --- the NCCL side: a random program, driven like NCCL's proxy -----------------------------------

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One buffer of a multi-receive: what the receiver posts and what the sender sends.
#[derive(Clone, Copy, Debug)]
struct Item {
    capacity: u64,
    size: u64,
    tag: i32,
}

impl Item {
    /// What arrives: a send larger than its receive is truncated to the receive's size.
    fn sent(&self) -> u64 {
        self.size.min(self.capacity)
    }
}

const CAP: u64 = 8192;
const SEND_DATA: u64 = 0x1000_0000;
const RECV_DATA: u64 = 0x2000_0000;
const FIFO: u64 = 0x3000_0000;
const SEND_STAGE: u64 = 0x4000_0000;
const RECV_STAGE: u64 = 0x5000_0000;
const RECV_SIZES: u64 = 0x6000_0000;
const SCRATCH: u64 = 0x7000_0000;

/// Twice as many buffer areas as slots: NCCL may try to post group `g` while group
/// `g - SLOTS` is not yet tested, and the core must then say "not yet".
const AREAS: usize = 2 * SLOTS;

fn buf_addr(base: u64, g: usize, r: usize) -> u64 {
    base + ((g % AREAS) * MAX_RECVS + r) as u64 * CAP
}

fn pattern(g: usize, r: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (g.wrapping_mul(31) ^ r.wrapping_mul(7) ^ i) as u8).collect()
}

struct Run {
    /// Groups (single-buffer ones only) posted as optional receives.
    optional: Vec<bool>,
    nqps: usize,
    split: bool,
    max_msg: u64,
    /// The inline payload of the sender's lanes and of the receiver's first, and of the
    /// receiver's other lanes (as a receive comm's lanes take less than its first).
    max_inline: u32,
    rest_inline: u32,
    /// The sender's buffers are GPU memory (never inline), else host memory.
    gpu: bool,
    /// Bytes between a lane's signaled writes.
    mark: u64,
    /// A row whose sizes sum to this many bytes and up is timed for placement, when path-aware
    /// with several lanes (`Params::timed_from`): 0 times every one. The shell times from
    /// [`TIMED_FROM`] (a clock read costs small messages more than they gain); the simulator's
    /// rows stay under that, so a run that mixes timed and untimed rows as the shell does uses
    /// [`MIXED_FROM`].
    timed_from: u64,
    groups: Vec<Vec<Item>>,
    /// Break the link after this many scheduler steps.
    break_at: Option<u64>,
    /// Make every post fail after this many scheduler steps.
    posts_fail_at: Option<u64>,
    /// The sender starts lying about sizes after this many scheduler steps.
    lie_at: Option<u64>,
    /// Every chunk's final write is delivered twice (see [`Wire::duplicates`]).
    duplicates: bool,
    /// Sender lanes whose path dies: after this many scheduler steps, lane, and whether the
    /// next work request still lands (its ACK lost).
    kills: Vec<(u64, usize, bool)>,
    /// Lanes whose path drops the receiver-to-sender direction only: after this many scheduler
    /// steps, lane, and how many more of the sender's requests land before its retries run out.
    one_way: Vec<(u64, usize, u32)>,
    /// Place work by the lanes' measured cost.
    path_aware: bool,
    /// A sender lane whose path is slow: its work moves one step in 8 of those it is offered.
    slow: Option<usize>,
    /// Queue pairs that fail on their own (an async error event): after this many scheduler
    /// steps, lane, and side.
    qp_errors: Vec<(u64, usize, usize)>,
    /// Lanes whose receiving queue pair refuses the sender's next write as invalid, as rxe's
    /// does now and then on a path that reorders: after this many scheduler steps, lane. Both
    /// ends' queue pairs break, with no async event: the receiver's flushes, the sender's head
    /// fails with `IBV_WC_REM_INV_REQ_ERR`.
    refusals: Vec<(u64, usize)>,
    /// Steps from a queue pair's failure to its async event: its flushed work may be polled
    /// first.
    event_lag: u64,
    /// Killed paths that answer again: after this many scheduler steps, lane.
    heals: Vec<(u64, usize)>,
    /// Lane repair attempts (0: off), with the sim clock's 1 ms per empty poll.
    repairs: u32,
    /// How many member ports each end spans (sender, receiver); each lane's are
    /// [`place_members`]'s.
    ports: (usize, usize),
    /// `NCCL_IB_RESILIENCY_PORT_FAILOVER`.
    failover: bool,
    /// The floor of the lanes' stall bound, in the sim clock's 1 ms per empty poll (`None`:
    /// off, so a silent path fails over only once its retries run out).
    stall: Option<Duration>,
    /// Retries never run out (`NCCL_IB_RETRY_CNT=7` on Soft-RoCE): a one-way black hole
    /// completes nothing on its lane, at either end, until that end fences its queue pair,
    /// and a request into a queue pair the other end fenced or replaced is never answered.
    forever: bool,
    /// Long spells in which one side's process makes no call (NCCL leaves the comm alone):
    /// from this step, side, for this many steps.
    naps: Vec<(u64, usize, u64)>,
    /// Call the cores as NCCL's proxy does: operations of 1 to 8 groups (most of them fewer
    /// than NCCL_STEPS), at most 8 receives and 8 sends posted ahead, each side testing its
    /// oldest request only, and between one operation and the next a side makes no call at
    /// all for a while (an idle receive comm).
    proxy: bool,
    /// A killed lane's write that was on the wire when its path died, or a fenced lane's, arrives
    /// late: at a random later step, or after the run (every receive completed, its buffer
    /// NCCL's), into whatever the receiver's QP of that lane is then ([`Wire::arrive_late`]).
    late: bool,
}

/// Each lane's member ports over `ports` (the sender's and the receiver's counts): lane `q` on
/// `q % n` of each end's `n` members (no more than there are lanes), as NCCL places a fused
/// device's QPs.
fn place_members(nqps: usize, (ours, theirs): (usize, usize)) -> Vec<(usize, usize)> {
    (0..nqps).map(|q| (q % ours.min(nqps), q % theirs.min(nqps))).collect()
}

/// Where a third of the random runs start timing rows: the simulator's rows (at most
/// [`MAX_RECVS`] buffers of [`CAP`] bytes) fall on both sides of it.
const MIXED_FROM: u64 = 4096;

fn random_run(rng: &mut Rng, ngroups: usize, max_size: u64) -> Run {
    let max_size = miri_or(max_size, max_size.min(300));
    let nqps = 1 + rng.below(8) as usize;
    let groups: Vec<Vec<Item>> = (0..ngroups)
        .map(|_| {
            let n = 1 + rng.below(MAX_RECVS as u64) as usize;
            let mut tags: Vec<i32> = (0..n as i32).map(|t| t * 3 + 1).collect();
            // Distinct tags (as NCCL's are within a multi-receive), in a random order.
            for i in (1..n).rev() {
                tags.swap(i, rng.below(i as u64 + 1) as usize);
            }
            (0..n)
                .map(|r| {
                    let size = match rng.below(4) {
                        0 => 0,
                        1 => rng.below(65).min(max_size),
                        _ => rng.below(max_size + 1),
                    };
                    // One in ten sends is larger than its receive (truncated, as NCCL does).
                    let capacity = match rng.below(10) {
                        0 => size / 2,
                        _ => (size + rng.below(64)).min(CAP),
                    };
                    Item { capacity, size, tag: tags[r] }
                })
                .collect()
        })
        .collect();
    let optional = groups.iter().map(|g: &Vec<Item>| g.len() == 1 && rng.below(3) == 0).collect();
    // Each end spans 1 to 8 member ports (fewer with fewer lanes), the two counts independent.
    let m = MAX_MEMBERS as u64;
    let ports = (1 + rng.below(m) as usize, 1 + rng.below(m) as usize);
    let run = Run {
        optional,
        nqps,
        split: rng.below(2) == 1,
        max_msg: [4096, 5000, 1 << 20][rng.below(3) as usize],
        max_inline: [0, 64, 512][rng.below(3) as usize],
        rest_inline: 0,
        gpu: rng.below(2) == 1,
        mark: [4096, 8192, MARK_BYTES][rng.below(3) as usize],
        timed_from: 0,
        groups,
        break_at: None,
        posts_fail_at: None,
        lie_at: None,
        duplicates: rng.below(3) == 0,
        kills: Vec::new(),
        one_way: Vec::new(),
        path_aware: rng.below(4) != 0,
        slow: (rng.below(3) == 0).then(|| rng.below(nqps as u64) as usize),
        qp_errors: Vec::new(),
        refusals: Vec::new(),
        event_lag: 0,
        heals: Vec::new(),
        repairs: 0,
        ports,
        failover: true,
        stall: None,
        forever: false,
        naps: Vec::new(),
        proxy: false,
        late: false,
    };
    // The receiver's other lanes take what its first does (lanes_run draws them apart). A third
    // of the runs (those of the middle mark, so that no draw moves) leave their small rows
    // untimed, as the shell does.
    let timed_from = if run.mark == 8192 { MIXED_FROM } else { 0 };
    Run { rest_inline: run.max_inline, timed_from, ..run }
}

/// What happened to the requests: counts of completed ones and of errors seen.
#[derive(Debug, Default)]
struct Outcome {
    /// Lanes fenced for a stall, by the sender and by the receiver.
    stalls: [u64; 2],
    recvs_done: usize,
    sends_done: usize,
    errors: [usize; 2],
    /// CTS batches posted, and those that wrapped the FIFO.
    batches: u64,
    wrapped: u64,
    /// Chunks delivered twice.
    dups: u64,
    /// Stragglers ([`Run::late`]) that landed, and those the receiver's QP dropped.
    late: (u64, u64),
    /// The run ended with no lane left ([`Wire::no_lane_left`]): its comm may have failed.
    stranded: bool,
    /// The sender's bytes posted per lane.
    sent: Vec<u64>,
    /// Lanes repaired, and lanes the sender gave up on.
    repaired: usize,
    kept_out: usize,
    /// The sender's bytes per lane when the first repair was logged.
    sent_at_repair: Option<Vec<u64>>,
    /// Fences, and the held chunks they found landed and sent again.
    fences: usize,
    landed: usize,
    again: usize,
}

/// The log lines of both ends, by what they say.
#[derive(Debug, Default)]
struct Lines {
    truncations: usize,
    /// The sender's lanes that failed in use, the attempts that failed, the lanes repaired and
    /// those given up on.
    lanes: usize,
    attempts: usize,
    repaired: usize,
    kept_out: usize,
    /// Lanes fenced at both ends, and of their chunks in flight those the receiver counted and
    /// those sent again.
    fences: usize,
    landed: usize,
    again: usize,
    /// The receiver's lanes that failed.
    recv_lanes: usize,
}

fn take_lines(sender: &mut SendCore, receiver: &mut RecvCore, l: &mut Lines) {
    while let Some(line) = sender.take_line() {
        match line {
            Line::Warn(w) if w.starts_with("lane ") && w.contains(" stays out: ") => {
                l.kept_out += 1
            }
            Line::Warn(w) if w.starts_with("lane ") => {
                l.lanes += 1;
                l.kept_out += usize::from(w.contains("it stays out as a flapping path"));
            }
            Line::Warn(_) => l.truncations += 1,
            Line::Info(i) if i.starts_with("lane ") && i.contains(" is repaired") => {
                l.repaired += 1
            }
            Line::Info(i) if i.starts_with("lane ") && i.contains(" is fenced at both ends") => {
                l.fences += 1;
                let n = |after: &str| -> usize {
                    let rest = &i[i.find(after).expect(after) + after.len()..];
                    rest.split(' ').next().unwrap().parse().unwrap()
                };
                l.landed += n("the receiver counted ");
                l.again += n("in flight, ");
            }
            Line::Info(i) => {
                assert!(i.starts_with("repair attempt "), "{i}");
                l.attempts += 1;
            }
        }
    }
    while let Some(line) = receiver.take_line() {
        match line {
            Line::Warn(w) => assert!(w.starts_with("lane ") && w.contains("CTS rows"), "{w}"),
            Line::Info(i) => panic!("the receiver logs no repair: {i}"),
        }
        l.recv_lanes += 1;
    }
}

/// What each end journaled for profiler events, by request key, since the request was handed
/// out: checked when the request completes.
struct Journaled {
    send: Vec<Vec<Posted>>,
    recv: Vec<Vec<Posted>>,
    /// Lanes fail in this run: chunks and rows may go twice, and rows of finished receives
    /// again (the comm's events drop those: their request no longer has a handle).
    faults: bool,
}

impl Journaled {
    fn new(run: &Run) -> Journaled {
        let n = SLOTS * MAX_RECVS;
        let faults = !run.kills.is_empty()
            || !run.qp_errors.is_empty()
            || !run.refusals.is_empty()
            || !run.one_way.is_empty()
            || run.stall.is_some();
        Journaled { send: vec![Vec::new(); n], recv: vec![Vec::new(); n], faults }
    }

    /// Takes both journals: each entry belongs to a request still outstanding.
    fn take(&mut self, s: &mut SendCore, r: &mut RecvCore, sends: &[usize], recvs: &[usize]) {
        for p in s.journal().drain(..) {
            assert!(sends.contains(&p.key) || self.faults, "a send journaled after it ended");
            self.send[p.key].push(p);
        }
        for p in r.journal().drain(..) {
            let outstanding = recvs.contains(&(p.key / MAX_RECVS));
            assert!(outstanding || self.faults, "a receive journaled after it ended");
            self.recv[p.key].push(p);
        }
    }

    /// Send request `id` of `size` bytes completed, its row of `nreqs` buffers: its entries
    /// cover its bytes, one per chunk, each marked as its last write is.
    fn send_done(&mut self, id: usize, size: u64, nreqs: usize, optional: bool, split: usize) {
        let got = std::mem::take(&mut self.send[id]);
        let bytes: u64 = got.iter().map(|p| p.len).sum();
        let chunks = if optional { 1 } else { split };
        if self.faults {
            assert!(bytes >= size && got.len() >= chunks, "send {id}: {got:?}");
        } else {
            assert_eq!((bytes, got.len()), (size, chunks), "send {id}: {got:?}");
        }
        let single = nreqs == 1 && size_in_imm(&[size], split > 1).is_some();
        for p in &got {
            assert_eq!(wr_kind(p.wr_id), WR_SEND, "send {id}: {p:?}");
            assert_eq!(p.imm, single || p.len == 0, "send {id}: {p:?}");
        }
    }

    /// Receive `id` of `n` buffers completed: one entry per buffer's CTS write (or more, where
    /// rows went again).
    fn recv_done(&mut self, id: usize, n: usize) {
        for r in 0..MAX_RECVS {
            let got = std::mem::take(&mut self.recv[id * MAX_RECVS + r]);
            let want = usize::from(r < n);
            assert!(got.len() == want || self.faults && r < n && got.len() > 1, "{got:?}");
            for p in &got {
                assert_eq!((wr_kind(p.wr_id), p.len, p.imm), (WR_CTS, ENTRY as u64, false));
            }
        }
    }
}

/// Optional group `o`'s data landed whole (its receive tested done and its send completed):
/// checked, and the buffer closed.
fn optional_data(run: &Run, mem: &Mem, o: usize) {
    let it = run.groups[o][0];
    let got = mem.read(buf_addr(RECV_DATA, o, 0), it.sent() as usize);
    assert!(got == pattern(o, 0, it.sent() as usize), "optional group {o}: data");
    mem.close(buf_addr(RECV_DATA, o, 0), it.capacity);
}

/// NCCL driving a send core and a receive core over the simulated wire, one random action a
/// step, as [`drive`] runs it: the cores and their areas in `mem`, both ends' views of `wire`,
/// and what NCCL knows of its requests.
struct Harness<'a> {
    run: &'a Run,
    seed: u64,
    mem: &'a Mem,
    wire: &'a RefCell<Wire>,
    rng: Rng,
    fifo: Area<'a>,
    sstage: Area<'a>,
    rstage: Area<'a>,
    rsizes: Area<'a>,
    sender: SendCore,
    receiver: RecvCore,
    sio: Io<'a>,
    rio: Io<'a>,
    /// The groups of the run.
    n: usize,
    next_recv: usize,
    next_send: usize,
    /// Sends of the current group still to post, in a random order of its buffers.
    send_order: Vec<usize>,
    recv_out: Vec<(usize, usize)>,        // (group, request)
    send_out: Vec<(usize, usize, usize)>, // (group, buffer, request)
    recv_done: Vec<bool>,
    sent: Vec<bool>,
    /// Groups whose data was checked: checked again at the end, in case a late write changed
    /// them (the invariant checker should have caught it first).
    checked: Vec<usize>,
    /// The group whose receive last filled each buffer area.
    filled: [usize; AREAS],
    sends_left: Vec<usize>,
    out: Outcome,
    steps: u64,
    idle: u64,
    lines: Lines,
    journaled: Journaled,
    /// Per side: the step until which its process makes no call.
    asleep: [u64; 2],
    /// A fake clock for the cores' idle checks (and so their liveness probes).
    now: Duration,
    /// Per side: when its idle work runs next, as the shell runs it ([`IDLE_EVERY`]).
    idle_at: [Duration; 2],
    /// The proxy's operations: where each ends (a group index), and each side's current one.
    ops: Vec<usize>,
    op: [usize; 2],
    /// The groups whose data landed, as NCCL's GPU sees it: all those before this one.
    landed: usize,
}

/// Runs `run` with random interleavings picked by `seed`: NCCL posting and testing requests
/// on both ends while the NICs move the wire, with the checks of [`Harness`] at every step
/// and at the end.
fn drive(run: &Run, seed: u64) -> Outcome {
    let mem = Mem::both_ends(AREAS * MAX_RECVS * CAP as usize);
    if run.gpu {
        mem.gpu.borrow_mut().push(SEND_DATA);
    }
    let wire = RefCell::new(Wire::new(run.nqps));
    let mut h = Harness::new(run, seed, &mem, &wire);
    while !h.done() {
        h.tick();
        h.check_step();
        h.inject_faults();
        h.read_lines();
        if h.ended() {
            break;
        }
        h.sleep();
        let pick = h.rng.below(8);
        if h.asleep_for(pick) {
            continue;
        }
        match pick {
            // An empty poll: the cores may probe their quiet peer.
            7 => {
                h.check_tables();
                h.empty_poll();
            }
            0 if h.may_irecv() => h.irecv(),
            // After a break, only the multi-receive already being matched is finished (its
            // row has landed), as NCCL would go on posting its sends.
            1 if h.may_isend() => h.isend(),
            2 if !h.recv_out.is_empty() => h.test_recv(),
            3 if !h.send_out.is_empty() => h.test_send(),
            _ => h.nic_step(),
        }
    }
    h.finish()
}

/// The parameters both cores of `run` start from (the receiver's with the member pairs
/// swapped).
fn params(run: &Run) -> Params {
    Params {
        nqps: run.nqps,
        split: run.split,
        max_msg: run.max_msg,
        inline: vec![run.max_inline; run.nqps],
        // The watchdog is the only end of a run left with no lane whose retries never run out
        // ([`Run::forever`], [`Wire::no_lane_left`]): its deadline must fall well inside the
        // livelock bound of [`Harness::check_step`] (4M steps, some 500 s of the sim clock's
        // 1 ms per empty poll), as the shell's default (twice the retry bound and 10 s, about
        // 79 s) falls inside a job's patience.
        progress_timeout: Duration::from_secs(60),
        probe_interval: Duration::from_millis(3),
        mark: run.mark,
        path_aware: run.path_aware,
        timed_from: run.timed_from,
        journal: true,
        failover: run.failover,
        stall: run.stall,
        members: place_members(run.nqps, run.ports),
        repair: Repair {
            attempts: run.repairs,
            delay: Duration::from_millis(5),
            timeout: Duration::from_millis(60),
        },
        path: Path { peer: "sim".into(), ..Default::default() }.into(),
    }
}

/// The proxy's operations over `n` groups: where each ends (a group index), the last at `n`;
/// one operation of them all where `proxy` is off.
fn proxy_ops(rng: &mut Rng, proxy: bool, n: usize) -> Vec<usize> {
    let mut ops = Vec::new();
    while proxy && ops.last().is_none_or(|&e| e < n) {
        let len = if rng.below(4) == 0 { 8 } else { 1 + rng.below(7) as usize };
        ops.push((ops.last().copied().unwrap_or(0) + len).min(n));
    }
    ops.push(n);
    ops
}

/// The run's set-up and the bookkeeping of each step.
impl<'a> Harness<'a> {
    /// Both cores of `run`, their areas in `mem` and `wire` set up for the run; nothing posted.
    fn new(run: &'a Run, seed: u64, mem: &'a Mem, wire: &'a RefCell<Wire>) -> Harness<'a> {
        let mut rng = Rng(seed | 1);
        let params = params(run);
        let sender = SendCore::new(params.clone(), remote(RECV_SIZES, 16));
        wire.borrow_mut().members = params.members.clone();
        let swapped = params.members.iter().map(|&(s, r)| (r, s)).collect();
        let inline = (0..run.nqps).map(|q| if q == 0 { run.max_inline } else { run.rest_inline });
        let inline: Vec<u32> = inline.collect();
        wire.borrow_mut().caps = [params.inline.clone(), inline.clone()];
        let receiver = Params { members: swapped, inline, ..params };
        let receiver = RecvCore::new(receiver, remote(FIFO, 13));
        wire.borrow_mut().failover = run.failover;
        wire.borrow_mut().duplicates = run.duplicates;
        wire.borrow_mut().forever = run.forever;
        wire.borrow_mut().late = run.late.then(Vec::new);
        let n = run.groups.len();
        let ops = proxy_ops(&mut rng, run.proxy, n);
        Harness {
            run,
            seed,
            mem,
            wire,
            rng,
            fifo: Area { mem, base: FIFO, key: 13 },
            sstage: Area { mem, base: SEND_STAGE, key: 14 },
            rstage: Area { mem, base: RECV_STAGE, key: 15 },
            rsizes: Area { mem, base: RECV_SIZES, key: 16 },
            sender,
            receiver,
            sio: Io { wire, mem, side: 0, depth: send_queue(run.nqps) },
            rio: Io { wire, mem, side: 1, depth: RECV_SEND_QUEUE },
            n,
            next_recv: 0,
            next_send: 0,
            send_order: Vec::new(),
            recv_out: Vec::new(),
            send_out: Vec::new(),
            recv_done: vec![false; n],
            sent: vec![false; n],
            checked: Vec::new(),
            filled: [usize::MAX; AREAS],
            sends_left: vec![0; n],
            out: Outcome::default(),
            steps: 0,
            idle: 0,
            lines: Lines::default(),
            journaled: Journaled::new(run),
            asleep: [0; 2],
            now: Duration::ZERO,
            idle_at: [Duration::ZERO; 2],
            ops,
            op: [0; 2],
            landed: 0,
        }
    }

    /// Every request completed.
    fn done(&self) -> bool {
        self.out.recvs_done == self.n && self.out.sends_done == self.n
    }

    /// A step begins: one more, and one more without progress until an action makes some.
    fn tick(&mut self) {
        self.steps += 1;
        self.idle += 1;
    }

    /// The breaks, kills, one-way paths, heals and queue-pair errors the run schedules at this
    /// step, and the async events of those errors that are due.
    fn inject_faults(&mut self) {
        let (run, wire, steps) = (self.run, self.wire, self.steps);
        if run.break_at == Some(steps) {
            wire.borrow_mut().break_all();
        }
        if run.posts_fail_at == Some(steps) {
            wire.borrow_mut().posts_fail = true;
        }
        if run.lie_at == Some(steps) {
            wire.borrow_mut().lying = true;
        }
        for &(_, lane, landed) in run.kills.iter().filter(|k| k.0 == steps) {
            wire.borrow_mut().kill_lane(lane, landed);
        }
        for &(_, lane, lands) in run.one_way.iter().filter(|k| k.0 == steps) {
            wire.borrow_mut().one_way[lane] = Some((Vec::new(), lands));
        }
        for &(_, lane) in run.heals.iter().filter(|k| k.0 == steps) {
            wire.borrow_mut().heal_lane(lane);
        }
        for &(_, lane, side) in run.qp_errors.iter().filter(|k| k.0 == steps) {
            // The queue pair fails on its own: it flushes, and its peer's work on the lane
            // finds nobody.
            wire.borrow_mut().failed[side][lane] = true;
        }
        for &(_, lane) in run.refusals.iter().filter(|k| k.0 == steps) {
            let mut w = wire.borrow_mut();
            w.refused[lane] = true;
            w.failed[1][lane] = true;
        }
        // The async event of each, `event_lag` steps later: the core hears of it.
        let events = run.qp_errors.iter().filter(|k| k.0 + run.event_lag == steps);
        for &(_, lane, side) in events {
            let ok = if side == 0 {
                self.sender.lane_error(lane, "QP_FATAL")
            } else {
                self.receiver.lane_error(lane, "QP_FATAL")
            };
            assert!(ok, "a lane error with another lane alive is taken");
        }
    }

    /// Both ends' log lines, counted; the sender's bytes per lane kept at the first repair.
    fn read_lines(&mut self) {
        take_lines(&mut self.sender, &mut self.receiver, &mut self.lines);
        if self.lines.repaired > 0 && self.out.sent_at_repair.is_none() {
            self.out.sent_at_repair = Some(self.sender.traffic().each(|l| l.bytes));
        }
    }

    /// Whether NCCL is done with a failed connection: the run ends.
    fn ended(&self) -> bool {
        let wire = self.wire;
        // A lie fails the receiving comm: once NCCL has seen every receive fail or complete,
        // it gives up on the connection (the sender, still healthy, is closed with it).
        if wire.borrow().lying && self.receiver.check().is_err() && self.recv_out.is_empty() {
            return true;
        }
        if wire.borrow().failing()
            && self.recv_out.is_empty()
            && self.send_out.is_empty()
            && self.send_order.is_empty()
        {
            return true; // what was outstanding has resolved
        }
        false
    }

    /// The sides' processes busy elsewhere: at random, at the run's naps, and between a
    /// proxy's operations.
    fn sleep(&mut self) {
        let (run, steps) = (self.run, self.steps);
        // Now and then one side's process is busy elsewhere, as a proxy serving other comms
        // is: for up to 3000 steps only the other side (and both NICs) runs.
        if self.rng.below(20_000) == 0 {
            self.asleep[self.rng.below(2) as usize] = steps + self.rng.below(3000);
        }
        for &(_, side, len) in run.naps.iter().filter(|n| n.0 == steps) {
            self.asleep[side] = self.asleep[side].max(steps + len);
        }
        // A side whose operation is done makes no call for a while, then starts the next. The
        // receiver's is done once every buffer's data landed, as NCCL's GPU sees it.
        while self.landed < self.n && self.recv_done[self.landed] {
            self.landed += 1;
        }
        let finished = [self.out.sends_done, self.landed];
        for (side, &finished) in finished.iter().enumerate() {
            if run.proxy
                && finished >= self.ops[self.op[side]]
                && self.op[side] + 1 < self.ops.len()
            {
                self.op[side] += 1;
                self.asleep[side] = self.asleep[side].max(steps + self.rng.below(2000));
            }
        }
    }

    /// Whether action `pick` is a call of a side whose process is asleep: it is not made.
    fn asleep_for(&self, pick: u64) -> bool {
        let side_of = match pick {
            0 | 2 => Some(1),
            1 | 3 => Some(0),
            _ => None,
        };
        side_of.is_some_and(|s| self.asleep[s] > self.steps)
    }

    /// Whether NCCL posts more with `out` requests outstanding (a proxy: fewer than 8).
    fn ahead(&self, out: usize) -> bool {
        !self.run.proxy || out < 8
    }

    /// Whether NCCL posts a receive now: one is left in its operation and the link is whole.
    fn may_irecv(&self) -> bool {
        self.next_recv < self.ops[self.op[1]]
            && self.ahead(self.recv_out.len())
            && !self.wire.borrow().broken
    }

    /// Whether NCCL posts a send now: one is left in its operation, and the group under way
    /// is finished even when the link is broken.
    fn may_isend(&self) -> bool {
        self.next_send < self.ops[self.op[0]]
            && (self.ahead(self.send_out.len()) || !self.send_order.is_empty())
            && (!self.wire.borrow().broken || !self.send_order.is_empty())
    }
}

/// NCCL's actions, one a step, each with the checks of its result.
impl Harness<'_> {
    /// NCCL's irecv of the next group (pick 0), once its buffer area is free again.
    fn irecv(&mut self) {
        let (run, mem, wire, n) = (self.run, self.mem, self.wire, self.n);
        let g = self.next_recv;
        if g >= AREAS && !self.recv_done[g - AREAS] {
            return; // that buffer area is still in use
        }
        let items = &run.groups[g];
        self.filled[g % AREAS] = g;
        let bufs: Vec<(Buf, i32)> = items
            .iter()
            .enumerate()
            .map(|(r, it)| {
                let addr = buf_addr(RECV_DATA, g, r);
                mem.with(addr, CAP as usize, None, |b| b.fill(0xee));
                (
                    Buf { addr, size: it.capacity, lkeys: keys(12), rkeys: keys(12), host: true },
                    it.tag,
                )
            })
            .collect();
        let optional = run.optional[g];
        let posted = self.receiver.irecv(&self.rstage, &mut self.rio, &bufs, optional);
        let posted = match posted {
            Err(e) if wire.borrow().posts_fail => {
                assert!(matches!(e, Error::Local(_)), "a failed post is local: {e}");
                self.next_recv = n; // NCCL stops posting on a failed comm
                return;
            }
            Err(e) if wire.borrow().lying || wire.borrow().failing() => {
                assert!(matches!(e, Error::Remote(_)), "the peer's or the path's: {e}");
                self.next_recv = n;
                return;
            }
            other => other.unwrap(),
        };
        let Some(id) = posted else {
            // No slot yet: the shell's irecv polls before it returns, as here.
            let got = self.poll_receiver();
            match self.recv_step(got) {
                Err(e) if wire.borrow().failing() => wire.borrow().failed_with(&e),
                r => r.expect("a poll on a healthy link"),
            }
            return;
        };
        for (r, it) in items.iter().enumerate() {
            mem.reopen(buf_addr(RECV_DATA, g, r), it.capacity);
        }
        self.recv_out.push((g, id));
        self.next_recv += 1;
        self.idle = 0;
    }

    /// NCCL's isend of the next buffer of the group under way (pick 1), the group's sends in
    /// a random order; a new group once the sends from its buffer area completed.
    fn isend(&mut self) {
        let (run, mem, wire, n) = (self.run, self.mem, self.wire, self.n);
        let g = self.next_send;
        if g >= AREAS && self.sends_left[g - AREAS] > 0 {
            return; // the previous sends from that area are not complete
        }
        if self.send_order.is_empty() {
            let k = run.groups[g].len();
            self.send_order = (0..k).collect();
            for i in (1..k).rev() {
                self.send_order.swap(i, self.rng.below(i as u64 + 1) as usize);
            }
            for (r, it) in run.groups[g].iter().enumerate() {
                let p = pattern(g, r, it.size as usize);
                mem.with(buf_addr(SEND_DATA, g, r), p.len(), None, |b| b.copy_from_slice(&p));
            }
            self.sends_left[g] = k;
        }
        let r = *self.send_order.last().expect("non-empty");
        let it = run.groups[g][r];
        let addr = buf_addr(SEND_DATA, g, r);
        let b = Buf { addr, size: it.size, lkeys: keys(11), rkeys: keys(11), host: !run.gpu };
        let posted = self.sender.isend(&self.fifo, &self.sstage, &mut self.sio, b, it.tag);
        let posted = match posted {
            Err(e) if wire.borrow().failing() => {
                if wire.borrow().posts_fail && !wire.borrow().broken {
                    assert!(matches!(e, Error::Local(_)), "a failed post is local: {e}");
                }
                wire.borrow().failed_with(&e);
                self.send_order.clear();
                self.next_send = n;
                self.out.errors[0] += 1;
                return;
            }
            other => other.unwrap(),
        };
        if let Some(id) = posted {
            self.send_out.push((g, r, id));
            self.send_order.pop();
            self.idle = 0;
            if self.send_order.is_empty() {
                self.next_send += 1;
            }
        }
    }

    /// NCCL's test of an outstanding receive (pick 2; a proxy tests the oldest): a completed
    /// one has its sizes and its data, an error is one the link's faults explain.
    fn test_recv(&mut self) {
        let (run, mem, wire) = (self.run, self.mem, self.wire);
        // As a comm's progress: drain the CQ, then the step after the poll.
        let got = self.poll_receiver();
        let r = self.recv_step(got);
        match &r {
            Err(e) if wire.borrow().failing() => wire.borrow().failed_with(e),
            _ => r.expect("progress on a healthy link"),
        }
        let i = if run.proxy { 0 } else { self.rng.below(self.recv_out.len() as u64) as usize };
        let (g, id) = self.recv_out[i];
        let mut sizes = [0u64; MAX_RECVS];
        match self.receiver.test(id, &mut sizes) {
            Ok(None) => {}
            Ok(Some(k)) => {
                let items = &run.groups[g];
                assert_eq!(k, items.len(), "group {g}: buffer count");
                let recvs: Vec<usize> = self.recv_out.iter().map(|r| r.1).collect();
                self.journaled.take(&mut self.sender, &mut self.receiver, &[], &recvs);
                self.journaled.recv_done(id, k);
                if run.optional[g] {
                    // Done once its data landed (its write with immediate), as any
                    // receive: the data is whole now, whether or not its send has
                    // completed (NCCL's GPU would see it through its flags).
                    assert_eq!(sizes[0], items[0].sent(), "group {g}: optional size");
                    optional_data(run, mem, g);
                    self.recv_done[g] = true;
                    self.checked.push(g);
                } else {
                    for (r, it) in items.iter().enumerate() {
                        assert_eq!(sizes[r], it.sent(), "group {g} buffer {r}: size");
                        let got = mem.read(buf_addr(RECV_DATA, g, r), it.sent() as usize);
                        let want = pattern(g, r, it.sent() as usize);
                        assert!(got == want, "group {g} buffer {r}: data");
                        // The buffer is NCCL's again: no NIC may write it from now on.
                        mem.close(buf_addr(RECV_DATA, g, r), it.capacity);
                    }
                    self.recv_done[g] = true;
                    self.checked.push(g);
                }
                self.recv_out.remove(i);
                self.out.recvs_done += 1;
                self.idle = 0;
            }
            Err(e) => {
                assert!(wire.borrow().failing(), "receive error on a healthy link");
                wire.borrow().failed_with(&e);
                if wire.borrow().lying && !wire.borrow().broken {
                    let m = e.to_string();
                    assert!(matches!(e, Error::Remote(_)), "a lie is the peer's: {m}");
                    assert!(m.contains("posted with") && m.contains("hostile"), "{m}");
                }
                self.recv_out.remove(i);
                self.out.errors[1] += 1;
                self.idle = 0;
            }
        }
    }

    /// The sender's CQ drained: not at all while the core says it has nothing posted (as the
    /// transport's `isend` that finds no CTS does; here every poll does it, so that a
    /// completion the core still waits for then would never be taken). The completions taken.
    fn poll_sender(&mut self) -> usize {
        let wire = self.wire;
        if self.sender.nothing_posted() {
            return 0;
        }
        // As the shell's poll: the clock only for completions that a timed chunk waits on.
        let n = wire.borrow().cq[0].len();
        if n > 0 && self.sender.needs_clock() {
            self.sender.stamp(self.now, n);
        }
        poll(wire, 0, |c| self.sender.complete(c))
    }

    /// The receiver's poll, as [`Self::poll_sender`]: its CQ drained into its core.
    fn poll_receiver(&mut self) -> usize {
        poll(self.wire, 1, |c| self.receiver.complete(c, &self.rsizes))
    }

    /// NCCL's test of an outstanding send (pick 3; a proxy tests the oldest): a completed one
    /// has its size and its journal, an error is one the link's faults explain.
    fn test_send(&mut self) {
        let (run, wire) = (self.run, self.wire);
        let got = self.poll_sender();
        let r = self.send_step(got);
        match &r {
            Err(e) if wire.borrow().failing() => wire.borrow().failed_with(e),
            _ => r.expect("progress on a healthy link"),
        }
        let i = if run.proxy { 0 } else { self.rng.below(self.send_out.len() as u64) as usize };
        let (g, r, id) = self.send_out[i];
        match self.sender.test(id) {
            Ok(None) => {}
            Ok(Some(size)) => {
                assert_eq!(size, run.groups[g][r].sent(), "group {g} send {r}: size");
                let sends: Vec<usize> = self.send_out.iter().map(|s| s.2).collect();
                self.journaled.take(&mut self.sender, &mut self.receiver, &sends, &[]);
                let nreqs = run.groups[g].len();
                let split = lanes(run.split && run.nqps > 1, run.nqps, id / MAX_RECVS);
                self.journaled.send_done(id, size, nreqs, run.optional[g], split.len());
                self.send_out.remove(i);
                self.sends_left[g] -= 1;
                if self.sends_left[g] == 0 {
                    self.out.sends_done += 1;
                    self.sent[g] = true;
                }
                self.idle = 0;
            }
            Err(e) => {
                assert!(wire.borrow().failing(), "send error on a healthy link");
                wire.borrow().failed_with(&e);
                self.send_out.remove(i);
                self.out.errors[0] += 1;
                self.idle = 0;
            }
        }
    }

    /// An empty poll (pick 7): the clock moves, and each side NCCL calls drains its CQ and
    /// makes its progress step, which may probe the quiet peer.
    fn empty_poll(&mut self) {
        let (run, wire, steps, n) = (self.run, self.wire, self.steps, self.n);
        self.now += Duration::from_millis(1);
        let now = self.now;
        wire.borrow_mut().now = now;
        // As a comm's progress: the CQ drained first, then the step after the poll.
        // NCCL's proxy calls a comm only while it has requests outstanding (or a send
        // to post: the comm's isend polls when it cannot post yet).
        let called = |out: bool| !run.proxy || out;
        let sending = !self.send_out.is_empty() || !self.send_order.is_empty();
        let s = if self.asleep[0] > steps || !called(sending) {
            Ok(())
        } else {
            let got = self.poll_sender();
            self.send_step(got)
        };
        // A receiving rank whose last operation on the connection is done while its
        // peer still sends comes back to the comm with its next operation (a later
        // collective, the final barrier): once in a while, here. A fence needs the
        // receiver's call (`ferroce_core::data`, "What waits for the other side's next call").
        let later = self.landed == n && self.out.sends_done < n && steps % 2000 < 8;
        let r = if self.asleep[1] > steps || !called(!self.recv_out.is_empty() || later) {
            Ok(())
        } else {
            let got = self.poll_receiver();
            self.recv_step(got)
        };
        for r in [s, r] {
            match r {
                Err(e) if wire.borrow().failing() => wire.borrow().failed_with(&e),
                r => r.expect("idle on a healthy link"),
            }
        }
    }

    /// The sender's step after a poll that took `got` completions, as the shell's progress
    /// makes it: the idle work once per [`IDLE_EVERY`], else what completions make possible.
    fn send_step(&mut self, got: usize) -> Result<()> {
        if self.now >= self.idle_at[0] {
            self.idle_at[0] = self.now + IDLE_EVERY;
            self.sender.idle(self.now, None, &mut self.sio, (&self.fifo, &self.sstage))
        } else if got > 0 {
            self.sender.after_poll(&self.sstage, &mut self.sio)
        } else {
            Ok(())
        }
    }

    /// The receiver's step after a poll, as [`Self::send_step`].
    fn recv_step(&mut self, got: usize) -> Result<()> {
        if self.now >= self.idle_at[1] {
            self.idle_at[1] = self.now + IDLE_EVERY;
            self.receiver.idle(self.now, None, &mut self.rio, &self.rstage, &self.rsizes)
        } else if got > 0 {
            self.receiver.after_poll(self.now, &mut self.rio, &self.rstage, &self.rsizes)
        } else {
            Ok(())
        }
    }

    /// The NICs (any other pick, or a pick whose call NCCL cannot make now): now and then a
    /// straggler arrives, and a queue pair with work executes its next request (a slow lane's
    /// one time in 8).
    fn nic_step(&mut self) {
        let (run, mem, wire) = (self.run, self.mem, self.wire);
        let stragglers = wire.borrow().late.as_ref().map_or(0, Vec::len);
        if stragglers > 0 && self.rng.below(64) == 0 {
            let k = self.rng.below(stragglers as u64) as usize;
            wire.borrow_mut().arrive_late(mem, k);
        }
        let busy = wire.borrow().busy();
        if !busy.is_empty() {
            let (s, q) = busy[self.rng.below(busy.len() as u64) as usize];
            if s == 1 || run.slow != Some(q) || self.rng.below(8) == 0 {
                wire.borrow_mut().step(mem, s, q);
                self.idle = 0;
            }
        }
    }

    /// The run is over: the last stragglers arrive, the end is checked, and the outcome
    /// gathered.
    fn finish(mut self) -> Outcome {
        let (mem, wire) = (self.mem, self.wire);
        // The stragglers still on the wire arrive after the run, when every receive completed
        // and its buffer is NCCL's.
        while wire.borrow().late.as_ref().is_some_and(|l| !l.is_empty()) {
            wire.borrow_mut().arrive_late(mem, 0);
        }
        self.out.late = (wire.borrow().late_landed, wire.borrow().late_dropped);
        self.out.stranded = wire.borrow().no_lane_left();
        take_lines(&mut self.sender, &mut self.receiver, &mut self.lines);
        self.check_end();
        let (out, lines) = (&mut self.out, &self.lines);
        (out.fences, out.landed, out.again) = (lines.fences, lines.landed, lines.again);
        out.repaired = lines.repaired;
        out.kept_out = lines.kept_out;
        (out.batches, out.wrapped) = (wire.borrow().batches, wire.borrow().wrapped);
        out.sent = self.sender.traffic().each(|l| l.bytes);
        out.stalls = [self.sender.traffic(), self.receiver.traffic()].map(|t| t.sum(|l| l.stalled));
        out.dups = wire.borrow().dups;
        self.out
    }
}

/// The invariant checker: what holds at every step, and at the end of the run.
impl Harness<'_> {
    /// At every step: the journals hold entries of outstanding requests only, the run makes
    /// progress and ends, and the CTS send queue is not overcounted.
    fn check_step(&mut self) {
        let sends: Vec<usize> = self.send_out.iter().map(|s| s.2).collect();
        let recvs: Vec<usize> = self.recv_out.iter().map(|r| r.1).collect();
        self.journaled.take(&mut self.sender, &mut self.receiver, &sends, &recvs);
        let (sender, receiver, out) = (&self.sender, &self.receiver, &self.out);
        let (idle, steps, seed, n) = (self.idle, self.steps, self.seed, self.n);
        assert!(
            idle < 200_000,
            "no progress: {out:?} after {steps} steps, seed {seed}; receiver head {} advertised \
             {} consumed {}; sender head {}",
            receiver.head,
            receiver.advertised,
            receiver.consumed,
            sender.head
        );
        assert!(
            steps < 4_000_000 + 200 * n as u64,
            "livelock: {out:?} after {steps} steps, seed {seed}: sender unfenced {:#x} fence \
             {:?} resend {} alive {:#x}; receiver serving {:?} alive {:#x} ctl {} pool {:?} \
             sq {:?} proving {:#x}; sender stages {:?} sq {:?}",
            sender.unfenced,
            sender.fence,
            sender.resend.len(),
            sender.alive,
            receiver.serving,
            receiver.alive,
            receiver.ctl,
            receiver.pool,
            receiver.sq.iter().map(|q| (q.used(), q.signaled.len())).collect::<Vec<_>>(),
            receiver.proving,
            sender.mend.stage,
            sender.sq.iter().map(|q| (q.used(), q.signaled.len())).collect::<Vec<_>>(),
        );

        let sq = receiver.sq.iter().map(SqCount::used).max().unwrap_or(0);
        assert!(sq <= RECV_SEND_QUEUE as u64, "CTS send queue overcounted");
    }

    /// Before each empty poll: the counters the idle check reads agree with the tables they
    /// summarise.
    fn check_tables(&self) {
        let (sender, receiver) = (&self.sender, &self.receiver);
        let pending = receiver.slots.iter().filter(|s| s.state == State::Pending).count();
        assert_eq!(receiver.waiting, pending, "receives waiting");
        let posted = sender.slots.iter().filter(|s| s.pending != 0).count();
        assert_eq!(sender.in_flight, posted, "slots in flight");
    }

    /// At the end of the run.
    fn check_end(&mut self) {
        let (run, mem) = (self.run, self.mem);
        // Every request was seen complete exactly once (the counters would have gone past n
        // otherwise, and tests of freed requests are errors), and nothing is left queued.
        if !self.wire.borrow().failing() {
            self.check_stats();
            self.check_drained();
        }
        // Every checked buffer not posted again since still holds its message.
        for &g in self.checked.iter().filter(|&&g| self.filled[g % AREAS] == g) {
            for (r, it) in run.groups[g].iter().enumerate() {
                let got = mem.read(buf_addr(RECV_DATA, g, r), it.sent() as usize);
                assert!(got == pattern(g, r, it.sent() as usize), "group {g} buffer {r}: changed");
            }
        }
    }

    /// At the end of a run on a healthy link: both ends' statistics and log lines count what
    /// was sent, received and failed.
    fn check_stats(&self) {
        let (run, wire, lines) = (self.run, self.wire, &self.lines);
        // The statistics count every message and byte once, at both ends.
        let items = run.groups.iter().map(Vec::len).sum::<usize>() as u64;
        let size = |g: &Vec<Item>| g.iter().map(Item::sent).sum::<u64>();
        let sent: u64 = run.groups.iter().map(size).sum();
        let (st, rt) = (self.sender.traffic(), self.receiver.traffic());
        let failures = lines.lanes;
        if run.repairs == 0 {
            let killed = wire.borrow().lanes_failed(0).1;
            assert_eq!(failures, killed, "one warning per failed lane");
            let (least, most) = wire.borrow().lanes_failed(1);
            let warned = lines.recv_lanes;
            assert!((least..=most).contains(&warned), "one receiver warning per failed lane");
        }
        let sent_bytes = st.sum(|l| l.bytes);
        // Chunks of a failed lane are sent again: the sender counts them twice.
        assert!(sent_bytes == sent || failures > 0 && sent_bytes >= sent, "sender bytes");
        assert_eq!(st.messages, items, "sender stats");
        assert_eq!((rt.messages, rt.delivered), (items, sent), "receiver stats");
        assert_eq!(st.sum(|l| l.errors), failures as u64, "sender errors: failures");
        // Each failure ends repaired, or the lane is out still (for good, or until its repair).
        let down = st.lanes.iter().filter(|l| l.down).count();
        assert_eq!(down + lines.repaired, failures, "the line marks the lanes out");
        assert_eq!(st.sum(|l| l.repaired), lines.repaired as u64, "repairs counted");
        assert_eq!(st.sum(|l| l.fenced), lines.fences as u64, "fences counted");
        let kept = st.lanes.iter().filter(|l| l.kept_out && l.down).count();
        assert_eq!(kept, lines.kept_out + usize::from(run.repairs == 0) * failures, "kept out");
        assert_eq!(rt.sum(|l| l.errors), lines.recv_lanes as u64, "receiver errors");
        if failures == 0 {
            assert_eq!(
                st.each(|l| l.chunks),
                rt.each(|l| l.chunks),
                "both ends count the same chunks per QP"
            );
        }
    }

    /// At the end of a run on a healthy link: nothing left on the wire or counted by the
    /// receiver's watchdog but what may be, no request left, every row landed.
    fn check_drained(&mut self) {
        let (run, wire, seed, n) = (self.run, self.wire, self.seed, self.n);
        // Only a liveness probe may still be in flight (it was due when the last request
        // completed), and a repair under way.
        let w = wire.borrow();
        let left: Vec<u64> = (w.sq.iter().flatten().flatten())
            .map(|q| q.wr.wr_id)
            .filter(|&id| !matches!(wr_kind(id), WR_PROBE | WR_MAIL | WR_MEND))
            .collect();
        assert!(left.is_empty(), "work left on the wire: {left:x?}");
        drop(w);
        // The receiver's watchdog counts exactly its signaled work still out on its live
        // lanes: a lane it rebuilt or lost leaves nothing counted (a count left over would
        // fail an idle comm after the progress timeout).
        poll(wire, 1, |c| self.receiver.complete(c, &self.rsizes));
        let counted = |id: u64| matches!(wr_kind(id), WR_CTS | WR_PROBE | WR_MAIL);
        let out = (wire.borrow().sq[1].iter().enumerate())
            .filter(|&(q, _)| self.receiver.alive & (1 << q) != 0)
            .flat_map(|(_, queue)| queue.iter())
            .filter(|queued| queued.wr.signaled && counted(queued.wr.wr_id))
            .count();
        assert_eq!(
            self.receiver.health.watchdog.outstanding, out,
            "the receiver's watchdog, seed {seed}"
        );
        assert!(
            self.sender.test(0).is_err() && self.receiver.test(0, &mut [0; MAX_RECVS]).is_err()
        );
        assert_eq!(wire.borrow().rows_landed, n as u64, "every row reached the sender");
        let truncating = run.groups.iter().flatten().any(|i| i.size > i.capacity);
        let truncations = self.lines.truncations;
        assert_eq!(truncations, usize::from(truncating), "one truncation warning per comm");
    }
}

/// Feeds one side's completions to its core, as the comm's progress loop does; polling a
/// signaled send's completion frees its send-queue entries and those before it. The
/// completions taken.
fn poll(wire: &RefCell<Wire>, side: usize, mut f: impl FnMut(&Completion)) -> usize {
    let mut got = 0;
    loop {
        let c = {
            let mut w = wire.borrow_mut();
            let c = w.cq[side].pop_front();
            if let Some(c) = c.filter(|c| c.status == 0 && wr_kind(c.wr_id) != WR_RECV) {
                let (id, q, n, life) = w.frees[side].pop_front().expect("a signaled send");
                assert_eq!(id, c.wr_id, "send completions arrive in order");
                if life == w.life[side][q] {
                    w.held[side][q].0 -= n; // a rebuilt QP's entries were freed with it
                }
            }
            c
        };
        match c {
            Some(c) => f(&c),
            None => return got,
        }
        got += 1;
    }
}

/// `full`, or `miri` under Miri, which runs these tests some hundred times slower: fewer and
/// shorter programs of messages of at most 300 bytes (so one data write per lane: the chains
/// of many writes are left to the native run), each still longer than the slot ring.
fn miri_or<T>(full: T, miri: T) -> T {
    if cfg!(miri) { miri } else { full }
}

#[test]
fn random_interleavings_complete_every_request_once_with_its_bytes() {
    let mut rng = Rng(0x0f0f_1234_5678_9abc);
    let groups = miri_or(200, 40);
    for seed in 0..miri_or(150u64, 4) {
        let run = random_run(&mut rng, groups, [0, 100, 4096, CAP][seed as usize % 4]);
        let o = drive(&run, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        assert_eq!((o.recvs_done, o.sends_done), (groups, groups), "seed {seed}");
    }
}

#[test]
fn every_mode_and_qp_count_is_covered() {
    let mut rng = Rng(77);
    for nqps in 1..=8 {
        for split in [false, true] {
            let mut run = random_run(&mut rng, miri_or(120, 12), CAP);
            run.nqps = nqps;
            run.split = split;
            run.max_msg = 5000; // large buffers need several work requests per lane
            let o = drive(&run, (nqps as u64) << 8 | split as u64);
            assert_eq!(o.recvs_done, run.groups.len(), "nqps {nqps} split {split}");
        }
    }
}

#[test]
fn the_fifo_and_every_sequence_wrap_over_a_hundred_thousand_messages() {
    let mut rng = Rng(5);
    let n = miri_or(100_000, 300);
    let mut run = random_run(&mut rng, n, 16);
    run.nqps = 2;
    (run.max_inline, run.rest_inline) = (64, 48);
    let o = drive(&run, 99);
    assert_eq!(o.recvs_done, n);
    assert_eq!(o.batches, n as u64, "every row is written by its own irecv");
}

/// A random program over 2 to 8 lanes, its largest size by `seed`: for the lane-failure tests.
fn lanes_run(rng: &mut Rng, seed: u64) -> Run {
    let mut run = random_run(rng, miri_or(150, 40), [0, 100, 4096, CAP][seed as usize % 4]);
    run.nqps = 2 + rng.below(7) as usize;
    if seed % 2 == 1 {
        // A receive comm's lanes as the shell makes them: the first takes a CTS row inline,
        // the others less, so rows that move off it are read from the stage.
        (run.max_inline, run.rest_inline) = (64, 48);
    }
    run
}

/// A lane whose path dies (1 to all but one of its lanes, lane 0 too, whose path also carries
/// the receiver's CTS rows; at random points, the sender's failing request landed or not) no
/// longer fails the comm: the sender's chunks in flight go again on the live lanes, the
/// receiver's rows go again on its next live lane, every request completes once with its
/// bytes, chunks that landed twice count once, and each failed lane gives one warning and one
/// error in the statistics.
#[test]
fn a_failed_lane_moves_its_chunks_to_the_live_lanes() {
    let mut rng = Rng(0x1a7e_f0e5);
    completing_runs(&mut rng, (miri_or(80, 2), 11), |run, rng, _| {
        some_lanes(run, rng, false, |run, rng, lane| {
            run.kills.push((50 + rng.below(miri_or(4000, 300)), lane, rng.below(2) == 0));
        });
    });
}

/// A dead path's last write arrives late: at any later step, or after the run, when every
/// receive completed and its buffer is NCCL's again. Fence, confirm, re-send: a straggler
/// that comes before the receiver fenced its lane is counted there and not sent again, one
/// that comes after finds the lane's QP in the error state or replaced and is dropped. No NIC
/// writes a completed receive, and every request completes once with its bytes. Half the
/// runs repair their lanes after the path comes back.
#[test]
fn a_dead_paths_late_write_never_lands_in_a_completed_receive() {
    let mut rng = Rng(0x1a7e_57a9);
    let outcomes = lane_runs(&mut rng, miri_or(60, 2), |run, rng, seed| {
        run.late = true;
        let repair = seed % 4 < 2;
        if repair {
            run.stall = Some(Duration::from_millis(20));
        } else {
            run.repairs = 0;
        }
        for lane in 0..1 + rng.below(run.nqps as u64 - 1) as usize {
            let at = 50 + rng.below(miri_or(4000, 300));
            run.kills.push((at, lane, false));
            if repair {
                run.heals.push((at + 200 + rng.below(2000), lane));
            }
        }
    });
    let (landed, dropped) = outcomes.iter().fold((0, 0), |(l, d), o| (l + o.late.0, d + o.late.1));
    eprintln!("stragglers: {landed} landed, {dropped} dropped");
    assert!(cfg!(miri) || landed > 0 && dropped > 0, "{landed} landed, {dropped} dropped");
}

/// A lane's path drops the receiver-to-sender direction only, for longer than the retry
/// bound: the sender's writes all land, and the receiver counts them and completes the
/// receives, which the harness hands back to NCCL and posts again; but no ACK comes back, and
/// the sender's retries run out. Its chunks in flight are held until the receiver has fenced
/// the lane and said which it counted; only the others go again. No NIC ever writes a receive
/// buffer that completed and was not posted again (the invariant checker in [`Mem`]), and every
/// checked buffer still holds its message at the end. 2 to 8 lanes, lane 0 (the control lane)
/// among those that die, both split modes, optional (LL) rows included, repair on or off.
#[test]
fn a_one_way_black_hole_never_writes_a_completed_receive() {
    let mut rng = Rng(0x000e_a7c5_1057);
    let outcomes = lane_runs(&mut rng, miri_or(120, 2), |run, rng, seed| {
        run.repairs = [0, 3][seed as usize / 2 % 2];
        one_way_lanes(run, rng, seed, |rng| rng.below(40) as u32);
    });
    let (landed, again, fences) =
        outcomes.iter().fold((0, 0, 0), |(l, a, f), o| (l + o.landed, a + o.again, f + o.fences));
    eprintln!("{fences} fences: {landed} held chunks had landed, {again} went again");
    assert!(cfg!(miri) || landed > 50 && again > 50, "{landed} landed, {again} again");
}

/// Runs `seeds` runs of [`lanes_run`], each set up further by `setup` and driven with seed
/// `seed + salt`; every request must complete once with its bytes, unless the run ended with
/// no lane left ([`Wire::no_lane_left`]). Their outcomes.
fn completing_runs(
    rng: &mut Rng,
    (seeds, salt): (u64, u64),
    mut setup: impl FnMut(&mut Run, &mut Rng, u64),
) -> Vec<Outcome> {
    let outcomes: Vec<Outcome> = (0..seeds)
        .map(|seed| {
            let mut run = lanes_run(rng, seed);
            setup(&mut run, rng, seed);
            let o = drive(&run, seed + salt);
            let n = run.groups.len();
            let what = format!(
                "seed {seed}: kills {:?} one-way {:?} heals {:?} queue pair errors {:?} \
                 refusals {:?}",
                run.kills, run.one_way, run.heals, run.qp_errors, run.refusals
            );
            // A run left with no lane may fail its comm: cleanly, as the run ended (what was
            // outstanding resolved) and no completed receive was written.
            if !o.stranded {
                assert_eq!((o.recvs_done, o.sends_done), (n, n), "{what}");
            }
            o
        })
        .collect();
    // Rare (a false alarm racing the death of the last other path), or the cores take out
    // lanes they should not.
    let stranded = outcomes.iter().filter(|o| o.stranded).count() as u64;
    assert!(stranded <= 1 + seeds / 400, "{stranded} of {seeds} runs were left with no lane");
    outcomes
}

/// [`completing_runs`] with split mode by the seed's parity and repair on.
fn lane_runs(
    rng: &mut Rng,
    seeds: u64,
    mut setup: impl FnMut(&mut Run, &mut Rng, u64),
) -> Vec<Outcome> {
    completing_runs(rng, (seeds, 31), |run, rng, seed| {
        run.split = seed % 2 == 1;
        run.repairs = 3;
        setup(run, rng, seed);
    })
}

/// Picks 1 to all but one of `run`'s lanes at random (the first is lane 0 where `zero_first`)
/// and hands each to `kill` as it is picked.
fn some_lanes(
    run: &mut Run,
    rng: &mut Rng,
    zero_first: bool,
    mut kill: impl FnMut(&mut Run, &mut Rng, usize),
) {
    let mut lanes: Vec<usize> = (0..run.nqps).collect();
    let dead = 1 + rng.below(lanes.len() as u64 - 1) as usize;
    for k in 0..dead {
        let pick = if k == 0 && zero_first { 0 } else { rng.below(lanes.len() as u64) };
        let lane = lanes.swap_remove(pick as usize);
        kill(run, rng, lane);
    }
}

/// Black-holes 1 to all but one of `run`'s lanes one way (lane 0 among them in a third of the
/// seeds) at random points, each letting `left(rng)` more requests land before its retries run
/// out; with repair on, half of them come back later.
fn one_way_lanes(run: &mut Run, rng: &mut Rng, seed: u64, left: impl Fn(&mut Rng) -> u32) {
    some_lanes(run, rng, seed.is_multiple_of(3), |run, rng, lane| {
        let at = 50 + rng.below(miri_or(3000, 300));
        run.one_way.push((at, lane, left(rng)));
        if run.repairs > 0 && rng.below(2) == 0 {
            run.heals.push((at + rng.below(miri_or(1500, 150)), lane));
        }
    });
}

/// The stalls fenced over `outcomes`: by the senders, by the receivers.
fn stalls(outcomes: &[Outcome]) -> [u64; 2] {
    outcomes.iter().fold([0, 0], |s, o| [s[0] + o.stalls[0], s[1] + o.stalls[1]])
}

/// A lane's path goes silent one way and its retries never run out (`NCCL_IB_RETRY_CNT=7` on
/// Soft-RoCE; about 34 s per request at NCCL's defaults on a ConnectX): the sender's writes
/// land unacknowledged, the receiver's own requests on the lane are never answered, and
/// nothing on it ever completes or fails, at either end. The sender's stall bound fences it
/// while the other lanes complete (its data, its mail or its probes stall there; only the
/// sender fences for a stall, as it owns lane repair), the receiver fences its end on the
/// sender's request, and every request completes once with its bytes; the
/// invariant checker sees no write into a completed receive. With the bound off, these runs
/// hang (the harness's no-progress assertion).
#[test]
fn a_silent_path_fails_over_by_its_stall_bound() {
    let mut rng = Rng(0x005a_11ed);
    // Repair on (lane_runs): a stall fences only where repair can bring a live lane back.
    let stalls = stalls(&lane_runs(&mut rng, miri_or(80, 2), |run, rng, seed| {
        (run.forever, run.stall) = (true, Some(Duration::from_millis(20)));
        one_way_lanes(run, rng, seed, |_| 0);
    }));
    eprintln!("stalls fenced: {} by senders, {} by receivers", stalls[0], stalls[1]);
    assert!(cfg!(miri) || stalls[0] > 40 && stalls[1] == 0, "{stalls:?}");
}

/// Fencing a slow but live lane is harmless: with a stall bound far too tight (1 to 4 ms of
/// the sim clock, where one side may sleep for hundreds) live lanes are fenced again and
/// again, and repaired; every request still completes once with its bytes and
/// no completed receive is written again. A write into a queue pair the other end fenced is
/// never answered (retries without end, as `NCCL_IB_RETRY_CNT=7` on Soft-RoCE): the ends
/// must agree on the lanes they use, or the comm hangs.
#[test]
fn fencing_a_live_lane_is_harmless() {
    let mut rng = Rng(0x0f15_e5a1);
    let stalls = stalls(&lane_runs(&mut rng, miri_or(80, 2), |run, rng, _| {
        run.stall = Some(Duration::from_millis(1 + rng.below(4)));
        (run.forever, run.late) = (true, true);
    }));
    eprintln!("live lanes fenced: {} by senders, {} by receivers", stalls[0], stalls[1]);
    assert!(cfg!(miri) || stalls[0] > 20 && stalls[1] == 0, "{stalls:?}");
}

/// The cores called as NCCL's proxy calls them (operations of 1 to 8 steps, 8 requests ahead,
/// the oldest tested, each side idle between operations: a receiving comm not called at all
/// for up to 2000 steps), while lanes fail in each way: one-way black holes whose retries run
/// out, silent paths whose retries never do (the stall bound moves them), dead paths, paths
/// that come back. Every request completes once with its bytes, and no completed receive is
/// written again.
#[test]
fn a_proxy_like_caller_gets_every_message_through_failing_lanes() {
    let mut rng = Rng(0x0970_c5ee);
    let outcomes = lane_runs(&mut rng, miri_or(120, 2), |run, rng, seed| {
        run.proxy = true;
        run.stall = Some(Duration::from_millis(20));
        match seed % 3 {
            0 => one_way_lanes(run, rng, seed, |rng| rng.below(40) as u32),
            1 => {
                run.forever = true;
                one_way_lanes(run, rng, seed, |_| 0);
            }
            _ => {
                let lane = rng.below(run.nqps as u64) as usize;
                let at = 50 + rng.below(miri_or(3000, 300));
                run.kills.push((at, lane, rng.below(2) == 0));
                run.heals.push((at + rng.below(miri_or(1500, 150)), lane));
            }
        }
    });
    let fences: usize = outcomes.iter().map(|o| o.fences).sum();
    eprintln!(
        "{} proxy-like runs, {fences} fences, stalls {:?}",
        outcomes.len(),
        stalls(&outcomes)
    );
    assert!(cfg!(miri) || fences > 50, "{fences} fences");
}

/// LL (optional) rows only, and a lane black-holes one way, at any point: its writes land
/// (for a while) but are never acknowledged. After the fence, only the rows the receiver did
/// not count go again, on a live lane, and no buffer that NCCL already got back is written.
#[test]
fn ll_rows_lost_one_way_go_again_exactly_once() {
    let mut rng = Rng(0x110a_c4ed);
    let mut again = 0;
    for seed in 0..miri_or(150u64, 2) {
        let mut run =
            random_run(&mut rng, miri_or(300, 60), [0, 100, 4096, CAP][seed as usize % 4]);
        run.nqps = 2 + rng.below(3) as usize;
        for g in &mut run.groups {
            g.truncate(1);
        }
        run.optional = vec![true; run.groups.len()];
        run.one_way.push((20 + rng.below(miri_or(2000, 200)), 0, rng.below(40) as u32));
        let o = drive(&run, seed + 41);
        let n = run.groups.len();
        assert_eq!((o.recvs_done, o.sends_done), (n, n), "seed {seed}: {:?}", run.one_way);
        again += o.again;
    }
    assert!(cfg!(miri) || again > 100, "{again} rows went again");
}

/// Lanes die and come back while messages flow: the repairs (a request through a live lane,
/// both ends rebuilt, the answer, the probe) race new messages, resent chunks, CTS rows and
/// probes, and a path may come back at any point of an attempt, or never. Every request
/// still completes once with its bytes; each lane failure ends repaired, given up, or still
/// out at the end; work of a lane's earlier life is never taken for the new one's.
#[test]
fn repairs_race_new_messages() {
    let mut rng = Rng(0x4e9a_14ed);
    let outcomes = completing_runs(&mut rng, (miri_or(100, 2), 23), |run, rng, _| {
        run.repairs = 1 + rng.below(4) as u32;
        some_lanes(run, rng, false, |run, rng, lane| {
            let at = 50 + rng.below(miri_or(3000, 300));
            run.kills.push((at, lane, rng.below(2) == 0));
            if rng.below(4) != 0 {
                run.heals.push((at + rng.below(miri_or(1500, 150)), lane));
            }
        });
    });
    let repaired: usize = outcomes.iter().map(|o| o.repaired).sum();
    let kept_out: usize = outcomes.iter().map(|o| o.kept_out).sum();
    eprintln!("{repaired} lanes repaired, {kept_out} given up on");
    assert!(cfg!(miri) || repaired > 20 && kept_out > 0, "{repaired} repaired, {kept_out} out");
}

/// A lane whose path died comes back: the sender's attempts fail while the path is dead,
/// then the lane is rebuilt at both ends, rejoins, and carries traffic again, in both modes.
#[test]
fn a_lane_whose_path_comes_back_is_repaired_and_carries_traffic_again() {
    for split in [false, true] {
        let mut rng = Rng(0x2e9a_12ed);
        let mut run = random_run(&mut rng, miri_or(600, 100), CAP);
        (run.nqps, run.split, run.repairs, run.path_aware) = (4, split, 5, false);
        run.kills.push((200, 1, false));
        run.heals.push((600, 1));
        let o = drive(&run, 5);
        assert_eq!((o.repaired, o.kept_out), (1, 0), "split {split}");
        let before = o.sent_at_repair.expect("a repair");
        assert!(o.sent[1] > before[1], "split {split}: lane 1 carries nothing after its repair");
    }
}

/// Repair does not depend on NCCL's calls: the receiving comm is left alone (no call at all)
/// for spells of 1000 steps (about 125 ms of the sim clock, twice the repair timeout), again
/// and again, while a lane dies and comes back. A repair request it could not answer is asked
/// again, not counted as failed: with one attempt allowed, the lane is still repaired, never
/// kept out.
#[test]
fn a_receiver_left_alone_does_not_use_up_repair_attempts() {
    for split in [false, true] {
        let mut rng = Rng(0x1d1e_c0bb);
        let mut run = random_run(&mut rng, miri_or(600, 100), CAP);
        (run.nqps, run.split, run.repairs, run.path_aware) = (4, split, 1, false);
        run.kills.push((200, 1, false));
        run.heals.push((260, 1));
        run.naps = (0..40).map(|k| (250 + k * 1500, 1, 1000)).collect();
        let o = drive(&run, 7);
        assert_eq!((o.repaired, o.kept_out), (1, 0), "split {split}");
    }
}

/// A path that dies again soon after each repair (a flapping one) is not repaired forever:
/// each failure within the timeout of a repair is a failed attempt, and the lane stays out
/// once they run out. Every request still completes once with its bytes.
#[test]
fn a_flapping_lane_stays_out_once_its_attempts_run_out() {
    for split in [false, true] {
        let mut rng = Rng(0xf1a9_9111);
        let mut run = random_run(&mut rng, miri_or(2400, 400), CAP);
        (run.nqps, run.split, run.repairs, run.path_aware) = (4, split, 2, false);
        // Dead for a quarter of each cycle, then alive long enough to be repaired, and dead
        // again well within the timeout (60 ms, about 480 steps) of that repair.
        let cycle = miri_or(400, 80);
        for k in 0..5 {
            run.kills.push((200 + k * cycle, 1, false));
            run.heals.push((200 + k * cycle + cycle / 4, 1));
        }
        let o = drive(&run, 5);
        eprintln!("split {split}: repaired {}, kept out {}", o.repaired, o.kept_out);
        assert_eq!(o.kept_out, 1, "split {split}: the flapping lane stays out");
        assert!(o.repaired >= 1, "split {split}: it was repaired before it flapped out");
    }
}

/// A slow lane (its work moves at an eighth of the others' pace): path-aware, whole messages
/// go on the cheaper of two lanes and split chunks shrink on it, so it carries well under its
/// share of the bytes; with `FERROCE_PATH_AWARE=0` it keeps its share. Every request still
/// completes once with its bytes.
#[test]
fn a_slow_lane_gets_less_of_the_work() {
    let mut rng = Rng(0x5107_1a4e);
    for split in [false, true] {
        let share = |aware: bool, rng: &mut Rng| {
            let mut run = random_run(rng, miri_or(600, 60), CAP);
            run.optional = vec![false; run.groups.len()];
            (run.nqps, run.split, run.path_aware, run.slow) = (4, split, aware, Some(1));
            (run.max_msg, run.duplicates, run.mark) = (1 << 20, false, MARK_BYTES);
            run.timed_from = 0; // placement learns from every row's rate
            let o = drive(&run, 7);
            o.sent[1] as f64 / o.sent.iter().sum::<u64>() as f64
        };
        let (rotation, aware) = (share(false, &mut rng), share(true, &mut rng));
        eprintln!("split {split}: the slow lane's share {rotation:.3} rotating, {aware:.3} aware");
        assert!(rotation > 0.2, "split {split}: rotation gives the slow lane {rotation:.3}");
        if !cfg!(miri) {
            assert!(aware < 0.1, "split {split}: path-aware gives the slow lane {aware:.3}");
        }
    }
}

/// The lanes to avoid are kept between idle runs and worked out again only when something
/// can have changed them: a timed chunk retired (a new rate), or a lane avoided whose rate is
/// forgotten with time, also on a comm at rest between messages.
#[test]
fn avoided_lanes_follow_new_rates_and_forgetting_at_rest() {
    let params = Params { nqps: 2, members: vec![(0, 0); 2], ..one_qp(Path::default()) };
    let mut sender = SendCore::new(params, remote(RECV_SIZES, 16));
    assert_eq!(sender.avoid, 0);
    // Lane 1 measured at a hundredth of lane 0's rate, both sampled at 0.
    (sender.lanes[0].rate, sender.lanes[1].rate) = (Some(1e8), Some(1e6));
    sender.retimed = true;
    sender.clock = Some(Duration::from_millis(500));
    sender.avoid_lanes();
    assert_eq!(sender.avoid, 0b10, "a new rate under a quarter of the best's is avoided");
    // A second later both rates are forgotten: lane 1 is tried again, with nothing in flight.
    sender.clock = Some(Duration::from_millis(1500));
    sender.avoid_lanes();
    assert_eq!(sender.avoid, 0, "a forgotten rate avoids nothing");
}

/// A sender with nothing outstanding skips the idle run's timed checks only while they have
/// nothing to find: a port that went down, a lane with a signaled request outstanding, a
/// wait still being timed and a wanted witness are each acted on at rest too.
#[test]
fn a_sender_at_rest_still_sees_what_its_idle_checks_must() {
    let pair = Pair { mem: Mem::both_ends(4096), wire: RefCell::new(Wire::new(2)) };
    let (fifo, stage) = (pair.area(FIFO, 13), pair.area(SEND_STAGE, 14));
    let fresh = || {
        let params = Params {
            nqps: 2,
            members: vec![(0, 0), (1, 1)],
            stall: Some(Duration::from_millis(100)),
            ..one_qp(Path::default())
        };
        SendCore::new(params, remote(RECV_SIZES, 16))
    };
    let mut sio = pair.io(0);
    let ms = Duration::from_millis;
    // A witness wanted: every live lane is probed.
    let mut s = fresh();
    s.health.witness = true;
    s.idle(ms(10), None, &mut sio, (&fifo, &stage)).unwrap();
    let probes = |q: usize| pair.wire.borrow().sq[0][q].len();
    assert_eq!((probes(0), probes(1)), (1, 1), "both lanes probed");
    // A port down: its lane is fenced at once.
    let mut s = fresh();
    s.links_down(Some("port 1".into()), 0b10);
    s.idle(ms(10), None, &mut sio, (&fifo, &stage)).unwrap();
    assert_eq!(s.alive, 0b01, "the lane on the port that is down is out");
    // A signaled request outstanding on lane 1: its wait is timed from now ...
    let mut s = fresh();
    s.sq[1].posted(1, true);
    s.idle(ms(10), None, &mut sio, (&fifo, &stage)).unwrap();
    assert!(!s.health.stall.untimed(), "a busy lane's wait is timed");
    // ... and once it completed, the next run takes the wait in as a sample.
    s.sq[1].completed();
    s.health.stall.completed(1);
    s.idle(ms(30), None, &mut sio, (&fifo, &stage)).unwrap();
    assert!(s.health.stall.untimed(), "the ended wait is taken in");
}

/// A lane's queue pair fails on its own (an async `QP_FATAL`, either end): the core takes it
/// as that lane's failure while another lives, the lane's flushed work is ignored, the peer's
/// work on it runs out of retries, and every request completes once with its bytes.
#[test]
fn a_queue_pair_error_fails_over_like_a_dead_path() {
    let mut rng = Rng(0x0a5c_e11e);
    completing_runs(&mut rng, (miri_or(60, 2), 5), |run, rng, seed| {
        // Half the runs hear of each failure only after its flushed work may have been
        // polled: a flush on a live lane is the lane's failure, not the comm's.
        run.event_lag = if seed % 2 == 1 { 40 } else { 0 };
        // Every lane but one, at random points, on either end.
        let spared = rng.below(run.nqps as u64) as usize;
        for lane in (0..run.nqps).filter(|&l| l != spared) {
            if rng.below(2) == 0 {
                let at = 50 + rng.below(miri_or(4000, 300));
                run.qp_errors.push((at, lane, rng.below(2) as usize));
            }
        }
    });
}

/// The receiving queue pair of a lane refuses a write as invalid (rxe on a reordering path):
/// both ends of the lane break with no async event, the sender hears
/// `IBV_WC_REM_INV_REQ_ERR`, and the lane fails over like a dead path, with every request
/// completing once with its bytes. Some runs refuse on every lane but one, some repair.
#[test]
fn a_write_the_peer_refuses_fails_over_like_a_dead_path() {
    let mut rng = Rng(0x0bad_0e09);
    let mut refused = 0;
    let outcomes = completing_runs(&mut rng, (miri_or(60, 2), 7), |run, rng, seed| {
        run.repairs = if seed % 3 == 0 { 3 } else { 0 };
        some_lanes(run, rng, false, |run, rng, lane| {
            run.refusals.push((50 + rng.below(miri_or(4000, 300)), lane));
        });
        refused += run.refusals.len();
    });
    assert!(refused > 0);
    let fences: usize = outcomes.iter().map(|o| o.fences).sum();
    assert!(fences > 0, "no refused lane was fenced and settled");
}

/// Every lane's path dies: the comm fails with a remote error, on both ends, and nothing hangs
/// (the random programs end only once every request completed or failed).
#[test]
fn every_lane_dead_fails_the_comm() {
    let mut rng = Rng(0x0a11_dead);
    let mut failed = 0;
    for seed in 0..miri_or(40u64, 2) {
        let mut run = random_run(&mut rng, miri_or(150, 40), 4096);
        run.nqps = 1 + rng.below(4) as usize;
        for lane in 0..run.nqps {
            run.kills.push((50 + rng.below(miri_or(2000, 300)), lane, rng.below(2) == 0));
        }
        let o = drive(&run, seed + 3);
        failed += o.errors[0] + o.errors[1];
    }
    assert!(failed > 0, "no run had work outstanding when its last lane died");
}

/// With `NCCL_IB_RESILIENCY_PORT_FAILOVER=0` one dead lane fails the comm, as NCCL's
/// transport does without resiliency: what was outstanding fails, and no lane is taken out.
#[test]
fn without_failover_one_dead_lane_fails_the_comm() {
    let mut rng = Rng(0x0fa1_10fe);
    let mut failed = 0;
    for seed in 0..miri_or(20u64, 2) {
        let mut run = lanes_run(&mut rng, seed);
        run.failover = false;
        let lane = rng.below(run.nqps as u64) as usize;
        run.kills.push((50 + rng.below(miri_or(2000, 300)), lane, rng.below(2) == 0));
        let o = drive(&run, seed + 11);
        failed += o.errors[0] + o.errors[1];
        assert_eq!(o.repaired, 0, "seed {seed}: nothing is repaired");
    }
    assert!(failed > 0, "no run had work outstanding when its lane died");
}

/// When the CTS rows go out: each at its own `irecv`, so that the sender can match every
/// posted receive with no further call on the receiving comm, an optional one as any other
/// (which completes once its data landed). Exact counts, so that a row held back fails.
#[test]
fn every_row_goes_out_at_its_irecv() {
    let pair = Pair::new(64 << 10);
    let params = one_qp(Path::default());
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(params);
    let buf = |k: usize| Buf {
        addr: RECV_DATA + 64 * k as u64,
        size: 64,
        lkeys: keys(12),
        rkeys: keys(12),
        host: true,
    };
    let batches = |p: &Pair| p.wire.borrow().batches;
    let mut ids = Vec::new();
    for k in 0..20 {
        // Receive 6 is optional: it completes once its data landed.
        let id = receiver.irecv(&rstage, &mut rio, &[(buf(k), 0)], k == 5).unwrap();
        ids.push(id.unwrap());
        assert_eq!(batches(&pair), k as u64 + 1, "row {} written by its irecv", k + 1);
        assert_eq!(receiver.staged(), 0);
        pair.drain(1, 0);
    }
    assert_eq!(pair.wire.borrow().rows_landed, 20);
    assert_eq!(receiver.test(ids[5], &mut [0; MAX_RECVS]).unwrap(), None, "no data yet");
    // The sender consumes all 20 rows with no further call on the receiving comm.
    let sbuf = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
    for k in 0..20 {
        assert!(sender.isend(&fifo, &sstage, &mut sio, sbuf, 0).unwrap().is_some(), "row {k}");
        pair.drain(0, 0);
        poll(&pair.wire, 0, |c| sender.complete(c));
    }
    assert_eq!(batches(&pair), 20);
    poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
    receiver.idle(Duration::ZERO, None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(receiver.test(ids[5], &mut [0; MAX_RECVS]).unwrap(), Some(1), "data landed");
}

/// A send looks its buffer up only once a receive matches it: with no row landed the lookup
/// never runs (NCCL repeats such an `isend` until one has); a lookup that fails is the
/// caller's error and leaves the comm as it was, so the same send then goes through.
#[test]
fn a_send_looks_its_buffer_up_only_once_a_receive_matches() {
    let pair = Pair::new(64 << 10);
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(one_qp(Path::default()));
    let sbuf = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
    let never = || -> Result<Buf> { panic!("a buffer looked up with no receive posted") };
    assert_eq!(sender.isend_with(&fifo, &sstage, &mut sio, never, 0).unwrap(), None);
    let rbuf = Buf { addr: RECV_DATA, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
    let id = receiver.irecv(&rstage, &mut rio, &[(rbuf, 0)], false).unwrap().unwrap();
    pair.drain(1, 0);
    let bad = || -> Result<Buf> { Err(Error::InvalidUsage("not registered here".into())) };
    let err = sender.isend_with(&fifo, &sstage, &mut sio, bad, 0).unwrap_err();
    assert!(matches!(err, Error::InvalidUsage(_)), "{err:?}");
    let sent = sender.isend_with(&fifo, &sstage, &mut sio, || Ok(sbuf), 0).unwrap();
    assert!(sent.is_some(), "the comm is as it was before the failed lookup");
    pair.drain(0, 0);
    poll(&pair.wire, 0, |c| sender.complete(c));
    poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
    assert_eq!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap(), Some(1));
}

/// The property behind [`every_row_goes_out_at_its_irecv`], over random programs: after the
/// receiver's last call, the sender, driven alone (its NIC and the receiver's NIC still run,
/// the receiving process does not), consumes every row posted. 1 to 8 lanes, both split
/// modes, multi-receives, optional rows.
#[test]
fn after_the_receivers_last_call_the_sender_consumes_every_posted_row() {
    let mut rng = Rng(0x00ca_11ed);
    for seed in 0..miri_or(200u64, 4) {
        let run = random_run(&mut rng, 1, CAP);
        let mem = Mem::both_ends(AREAS * MAX_RECVS * CAP as usize);
        let pair = Pair { mem, wire: RefCell::new(Wire::new(run.nqps)) };
        let params = Params { nqps: run.nqps, split: run.split, ..one_qp(Path::default()) };
        let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, .. } =
            pair.ends(params);
        // The receiving rank posts up to 32 (multi-)receives, then stops calling.
        let posts = 1 + rng.below(SLOTS as u64) as usize;
        let mut groups = Vec::new();
        for g in 0..posts {
            let n = 1 + rng.below(MAX_RECVS as u64) as usize;
            let optional = n == 1 && rng.below(3) == 0;
            let bufs: Vec<(Buf, i32)> = (0..n)
                .map(|r| {
                    let addr = buf_addr(RECV_DATA, g, r);
                    let b = Buf { addr, size: CAP, lkeys: keys(12), rkeys: keys(12), host: true };
                    (b, r as i32)
                })
                .collect();
            let id = receiver.irecv(&rstage, &mut rio, &bufs, optional).unwrap();
            assert!(id.is_some(), "seed {seed}: receive {g} posted");
            groups.push(n);
        }
        // The sender sends them all, alone: each isend must be matched within a bounded number
        // of steps of the NICs.
        for (g, &n) in groups.iter().enumerate() {
            for r in 0..n {
                let b = Buf {
                    addr: buf_addr(SEND_DATA, g, r),
                    size: rng.below(CAP),
                    lkeys: keys(11),
                    rkeys: keys(11),
                    host: true,
                };
                let mut tries = 0;
                while sender.isend(&fifo, &sstage, &mut sio, b, r as i32).unwrap().is_none() {
                    tries += 1;
                    assert!(tries < 10_000, "seed {seed}: send {g}.{r} found no row");
                    for q in 0..run.nqps {
                        pair.drain(0, q);
                        pair.drain(1, q);
                    }
                    poll(&pair.wire, 0, |c| sender.complete(c));
                    sender.idle(Duration::ZERO, None, &mut sio, (&fifo, &sstage)).unwrap();
                }
            }
        }
    }
}

/// Runs 100 random programs (4 under Miri) with a fault injected by `fault` at a random step; returns how
/// many requests failed. Whatever completed before the fault was checked byte for byte; whatever
/// was outstanding failed instead of hanging (the loop ends only when nothing is left).
fn with_fault(seed: u64, fault: impl Fn(&mut Run, u64)) -> usize {
    let mut rng = Rng(seed);
    let mut failed = 0;
    for s in 0..miri_or(100u64, 4) {
        let mut run = random_run(&mut rng, miri_or(150, 40), 4096);
        fault(&mut run, 100 + rng.below(miri_or(3000, 300)));
        let o = drive(&run, s + 1);
        failed += o.errors[0] + o.errors[1];
    }
    failed
}

#[test]
fn a_broken_link_fails_every_outstanding_request_and_nothing_else() {
    let failed = with_fault(0xdead_beef, |run, at| run.break_at = Some(at));
    assert!(failed > 0, "no run had work outstanding at the break");
}

/// A failed post fails the comm for good, as a local error: every request still pending fails
/// with it, later calls fail, and nothing completes twice or with wrong bytes.
#[test]
fn a_failed_post_fails_the_comm_and_every_pending_request() {
    let failed = with_fault(0x005e_ed0f_fa11, |run, at| run.posts_fail_at = Some(at));
    assert!(failed > 0, "no run had work outstanding when posts began to fail");
}

/// A size the peer reports beyond what the buffer was posted with never reaches NCCL: it fails
/// the receiving comm with a remote error naming both sizes, and every receive still pending
/// fails with it. Sizes up to the posted one (truncated sends) stay fine: the random programs
/// above send one in ten larger than its receive.
#[test]
fn a_size_beyond_the_posted_one_fails_the_receiver() {
    let failed = with_fault(0x0b16_5123, |run, at| run.lie_at = Some(at));
    assert!(failed > 0, "no run had a receive outstanding when the sender began to lie");
}

/// Least privilege, by role: every QP takes the peer's writes (the sender's take the
/// receiver's CTS rows and probes, on whichever lane lives), and only the loopback flush QP
/// allows a read. The simulated network checks that each operation meets its grant; this checks that
/// no QP grants more.
#[test]
fn each_queue_pair_grants_only_what_its_role_needs() {
    for nqps in 1..=8 {
        let send: Vec<Grant> = (0..nqps).map(send_grant).collect();
        let recv: Vec<Grant> = (0..=nqps).map(|q| recv_grant(q, nqps)).collect();
        let want_send = vec![Grant::Write; nqps];
        let mut want_recv = vec![Grant::Write; nqps];
        want_recv.push(Grant::Read);
        assert_eq!((send, recv), (want_send, want_recv), "{nqps} QPs");
    }
}

#[test]
fn cts_entries_round_trip() {
    let c = Cts {
        addr: 0xdead_beef_0000,
        size: 1 << 40,
        rkeys: [0x1234, 0xffff_ffff, 0, 7, 0x8000_0001, 5, 0xffff_fffe, 1],
        tag: -7,
        nreqs: 8,
        optional: true,
        idx: (1 << 48) - 1,
    };
    assert_eq!(Cts::decode(c.encode()), c);
    assert_eq!(ENTRY_WORDS, 8);
    assert!(BATCH as usize * ENTRY <= 512, "a batch's head entries are one write of 512 bytes");
    // Head entries are dense; every entry has its own place, inside the FIFO.
    let mut seen = std::collections::HashSet::new();
    for slot in 0..SLOTS {
        for r in 0..MAX_RECVS {
            let w = entry_word(slot, r);
            assert!(w + ENTRY_WORDS <= FIFO_WORDS && seen.insert(w), "slot {slot} entry {r}");
        }
        assert_eq!(entry_word(slot, 0), slot * ENTRY_WORDS);
    }
}

#[test]
fn wr_ids_and_immediates_encode_what_they_carry() {
    for (kind, lane, slot) in [(WR_SEND, 0, 0), (WR_CTS, 7, 31), (WR_RECV, 3, 17), (WR_FLUSH, 0, 5)]
    {
        let id = wr_id(kind, lane, slot);
        assert_eq!((wr_kind(id), wr_lane(id), wr_slot(id)), (kind, lane, slot));
    }
    for slot in [0, 17, SLOTS - 1] {
        for epoch in 0..2 {
            for chunk in [0, 1, 7, MAX_CHUNKS - 1] {
                for size in [None, Some(0), Some(100), Some(IMM_MAX_SIZE)] {
                    let imm = Imm { slot, chunk, epoch, size };
                    assert_eq!(Imm::decode(imm.encode(true), true), imm);
                }
            }
            // A whole message is chunk 0: the chunk's bits carry the size's high bits.
            let sizes = [0, 100, IMM_MAX_SIZE, IMM_MAX_SIZE + 1, 512 << 10, 8 << 20, IMM_MAX_WHOLE];
            for size in sizes.map(Some).into_iter().chain([None]) {
                let imm = Imm { slot, chunk: 0, epoch, size };
                assert_eq!(Imm::decode(imm.encode(false), false), imm);
            }
        }
    }
    // The layout, pinned: slot 3, epoch 1; split, chunk 2 and 100 bytes; whole, 1 MiB (its bit
    // 20 in the chunk's bits).
    assert_eq!(Imm { slot: 3, chunk: 2, epoch: 1, size: Some(100) }.encode(true), 823_363);
    assert_eq!(Imm { slot: 3, chunk: 0, epoch: 1, size: Some(1 << 20) }.encode(false), 4_227);
    assert_eq!(size_in_imm(&[IMM_MAX_SIZE], true), Some((256 << 10) - 1));
    assert_eq!(
        size_in_imm(&[IMM_MAX_SIZE + 1], true),
        None,
        "split: a larger size goes in the records"
    );
    assert_eq!(size_in_imm(&[IMM_MAX_SIZE + 1], false), Some(256 << 10), "whole: in the immediate");
    assert_eq!(size_in_imm(&[IMM_MAX_WHOLE], false), Some((32 << 20) - 1));
    assert_eq!(size_in_imm(&[IMM_MAX_WHOLE + 1], false), None, "whole: larger in the records");
    assert_eq!(size_in_imm(&[1, 2], false), None, "several buffers' sizes go in the records");
    assert_eq!((epoch(1), epoch(SLOTS as u64), epoch(SLOTS as u64 + 1)), (0, 0, 1));
    const { assert!(SLOTS <= 32, "a slot must fit the immediate's 5 bits") };
    const { assert!(MAX_CHUNKS <= 128, "a chunk must fit the immediate's 7 bits") };
}

/// Chunks delivered twice (a chunk sent again on another lane after its first copy landed, as
/// a sender that lost a lane does) complete every receive once, with its bytes: every random
/// program again, each chunk's final write delivered a second time.
#[test]
fn a_chunk_delivered_twice_is_counted_once() {
    let mut rng = Rng(0x00d0_0b1e);
    let mut dups = 0;
    for seed in 0..miri_or(40u64, 2) {
        let mut run =
            random_run(&mut rng, miri_or(150, 40), [0, 100, 4096, CAP][seed as usize % 4]);
        run.duplicates = true;
        let o = drive(&run, seed + 7);
        assert_eq!(o.recvs_done, run.groups.len(), "seed {seed}");
        dups += o.dups;
    }
    assert!(dups > 1000, "only {dups} chunks were delivered twice");
}

/// A chunk's immediate from another use of its slot (the previous one, or one not yet posted)
/// is not counted for the slot's current receive.
#[test]
fn an_immediate_of_another_use_of_the_slot_is_not_counted() {
    let pair = Pair::new(4096);
    let mut receiver = RecvCore::new(one_qp(Path::default()), remote(FIFO, 13));
    let mut rio = pair.io(1);
    let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
    let buf = Buf { addr: RECV_DATA, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
    let id = receiver.irecv(&rstage, &mut rio, &[(buf, 0)], false).unwrap().unwrap();
    let arrive = |r: &mut RecvCore, imm: Imm| {
        let imm = Some(imm.encode(false));
        r.complete(&Completion { wr_id: wr_id(WR_RECV, 0, 0), imm, ..Default::default() }, &rsizes);
    };
    let stale = Imm { slot: id, chunk: 0, epoch: 1, size: Some(10) };
    arrive(&mut receiver, stale);
    assert_eq!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap(), None, "another use's chunk");
    arrive(&mut receiver, Imm { epoch: 0, ..stale });
    let mut sizes = [0; MAX_RECVS];
    assert_eq!(receiver.test(id, &mut sizes).unwrap(), Some(1));
    assert_eq!(sizes[0], 10);
    // Split over 2 lanes, a chunk the slot does not expect (chunk 2) is not counted either.
    let params = Params { nqps: 2, split: true, ..one_qp(Path::default()) };
    let mut receiver = RecvCore::new(params, remote(FIFO, 13));
    let id = receiver.irecv(&rstage, &mut rio, &[(buf, 0)], false).unwrap().unwrap();
    let arrive = |r: &mut RecvCore, imm: Imm| {
        let imm = Some(imm.encode(true));
        r.complete(&Completion { wr_id: wr_id(WR_RECV, 0, 0), imm, ..Default::default() }, &rsizes);
    };
    let chunk = |chunk| Imm { slot: id, chunk, epoch: 0, size: Some(10) };
    arrive(&mut receiver, chunk(2));
    arrive(&mut receiver, chunk(0));
    assert_eq!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap(), None, "a chunk not expected");
    arrive(&mut receiver, chunk(1));
    assert_eq!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap(), Some(1));
}

#[test]
fn split_parts_cover_the_buffer_in_aligned_chunks() {
    for size in [0u64, 1, 127, 128, 129, 4095, 65536, 1 << 20, 16 << 20, 12_345_677] {
        for nqps in [1usize, 2, 3, 4, 7, 8, 128] {
            let mut next = 0;
            for q in 0..nqps {
                let (off, len) = lane_part(size, true, nqps, q);
                assert_eq!(off, next, "size {size} nqps {nqps} lane {q}");
                if len > 0 && off + len < size {
                    assert_eq!(len % 128, 0, "a middle chunk is 128-byte aligned");
                }
                next = off + len;
            }
            assert_eq!(next, size, "size {size} nqps {nqps}: every byte on some lane");
        }
    }
    let parts: Vec<u64> = (0..4).map(|q| lane_part(1 << 20, true, 4, q).1).collect();
    assert_eq!(parts, [262144; 4]);
    assert_eq!(lane_part(1000, false, 4, 2), (0, 1000));
    assert_eq!(lanes(true, 4, 9), 0..4);
    assert_eq!(lanes(false, 4, 9), 1..2);
}

#[test]
fn the_watchdog_fires_only_after_a_timeout_without_progress() {
    let path = Path { peer: "p".into(), ..Default::default() };
    let ms = Duration::from_millis;
    let mut w = Watchdog::new(ms(20));
    assert!(w.check(ms(0), &path).is_none());
    assert!(w.check(ms(100), &path).is_none(), "idle is not a failure");
    w.posted();
    assert!(w.check(ms(100), &path).is_none(), "work starts the clock");
    assert!(w.check(ms(115), &path).is_none());
    w.completed(false); // progress on a multi-lane slot restarts the clock
    assert!(w.check(ms(130), &path).is_none());
    assert!(w.check(ms(140), &path).is_none());
    w.completed(true);
    assert!(w.check(ms(500), &path).is_none(), "everything completed");
    w.posted();
    assert!(w.check(ms(600), &path).is_none());
    let msg = w.check(ms(621), &path).expect("20 ms without a completion");
    assert!(msg.contains("FERROCE_PROGRESS_TIMEOUT_MS"), "{msg}");
}

/// One QP, no inline data, 1 s timeouts: the parameters of the health checks' tests.
fn one_qp(path: Path) -> Params {
    Params {
        nqps: 1,
        split: false,
        max_msg: 4096,
        inline: vec![0],
        progress_timeout: Duration::from_secs(1),
        probe_interval: Duration::from_secs(1),
        mark: MARK_BYTES,
        path_aware: true,
        timed_from: TIMED_FROM,
        journal: false,
        failover: true,
        stall: None,
        members: Vec::new(),
        repair: NO_REPAIR,
        path: path.into(),
    }
}

/// Lane repair off.
const NO_REPAIR: Repair =
    Repair { attempts: 0, delay: Duration::from_secs(1), timeout: Duration::from_secs(1) };

#[test]
fn failed_completions_carry_a_hint_and_the_first_is_kept() {
    let path =
        Path { peer: "198.18.0.2:4000".into(), describe: "GID a -> b".into(), ..Path::default() };
    let params = one_qp(path);
    let mut h = Health::new(&params);
    assert!(!h.completion(&Completion { status: 12, wr_id: WR_SEND | 3, ..Default::default() }));
    let Some(Fault::Remote(msg)) = h.fatal.clone() else { panic!("{:?}", h.fatal) };
    assert!(
        msg.contains("198.18.0.2") && msg.contains("NCCL_IB_TIMEOUT") && msg.contains("GID a -> b"),
        "{msg}"
    );
    h.completion(&Completion { status: 5, ..Default::default() });
    assert_eq!(h.fatal, Some(Fault::Remote(msg)));
}

/// Failed completions are `ncclRemoteError` only where the peer or the network caused them
/// (so is silence past the progress timeout); our own NIC's errors are local
/// (`ncclSystemError`).
#[test]
fn completion_errors_are_classed_by_who_caused_them() {
    let params = one_qp(Path::default());
    let class = |status| {
        let mut h = Health::new(&params);
        h.completion(&Completion { status, ..Default::default() });
        h.check().unwrap_err()
    };
    for remote in [7, 9, 10, 11, 12, 13, 15, 16, 20] {
        assert!(matches!(class(remote), Error::Remote(_)), "status {remote}");
    }
    for local in [1, 2, 4, 5, 6, 8, 19, 21, 99] {
        assert!(matches!(class(local), Error::Local(_)), "status {local}");
    }
    // A peer that stays silent past the progress timeout is the peer's (or the path's) fault.
    let mut h = Health::new(&params);
    h.watchdog.posted();
    let s = Duration::from_secs;
    assert!(h.idle(s(0), None).is_ok() && h.idle(s(5), None).is_err());
    assert!(matches!(h.check(), Err(Error::Remote(_))));
    // A device failure reported from elsewhere keeps its class.
    let mut h = Health::new(&params);
    h.idle(s(0), Some(Fault::Local("rxe0 failed".into()))).unwrap_err();
    assert!(matches!(h.check(), Err(Error::Local(m)) if m == "rxe0 failed"));
}

/// A receiver that waits quietly probes its peer once per interval: a live peer answers and
/// nothing fails however long the wait; a dead one fails the probe, and the pending receive
/// fails with it, naming the probe.
#[test]
fn a_quiet_wait_probes_the_peer_and_only_a_dead_peer_fails() {
    let mem = Mem::new();
    mem.add(FIFO, 13, FIFO_AREA * 8);
    mem.add(RECV_STAGE, 15, FIFO_AREA * 8);
    mem.add(RECV_SIZES, 16, SIZE_AREA * 8);
    mem.add(RECV_DATA, 12, 4096);
    let rstage = Area { mem: &mem, base: RECV_STAGE, key: 15 };
    let rsizes = Area { mem: &mem, base: RECV_SIZES, key: 16 };
    let ms = Duration::from_millis;
    let params = Params {
        nqps: 1,
        split: false,
        max_msg: 4096,
        inline: vec![0],
        progress_timeout: Duration::from_secs(3600),
        probe_interval: ms(100),
        mark: MARK_BYTES,
        path_aware: true,
        timed_from: TIMED_FROM,
        journal: false,
        failover: true,
        stall: None,
        members: Vec::new(),
        repair: NO_REPAIR,
        path: Path { peer: "peer".into(), ..Default::default() }.into(),
    };
    let mut receiver = RecvCore::new(params, remote(FIFO, 13));
    let wire = RefCell::new(Wire::new(1));
    let mut rio = Io { wire: &wire, mem: &mem, side: 1, depth: RECV_SEND_QUEUE };
    let buf = Buf { addr: RECV_DATA, size: 4096, lkeys: keys(12), rkeys: keys(12), host: true };
    let id = receiver.irecv(&rstage, &mut rio, &[(buf, 0)], false).unwrap().unwrap();
    let probes = |w: &RefCell<Wire>| {
        w.borrow().sq[1][0].iter().filter(|q| wr_kind(q.wr.wr_id) == WR_PROBE).count()
    };
    // A live peer: every probe is acknowledged, for as long as the sender stays silent.
    let mut acked = 0;
    for t in 0..50 {
        receiver.idle(ms(t * 40), None, &mut rio, &rstage, &rsizes).unwrap();
        if probes(&wire) > 0 {
            while !wire.borrow().sq[1][0].is_empty() {
                wire.borrow_mut().step(&mem, 1, 0);
            }
            acked += 1;
        }
        poll(&wire, 1, |c| receiver.complete(c, &rsizes));
        assert_eq!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap(), None, "still waiting");
    }
    assert!((6..=20).contains(&acked), "one probe per quiet interval, not per poll: {acked}");
    // A dead peer: the next probe fails, and so does the receive.
    receiver.idle(ms(10_000), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(probes(&wire), 1);
    wire.borrow_mut().break_all();
    poll(&wire, 1, |c| receiver.complete(c, &rsizes));
    let e = receiver.test(id, &mut [0; MAX_RECVS]).unwrap_err().to_string();
    assert!(e.contains("liveness probe") && e.contains("peer"), "{e}");
}

/// A sender that waits for a CTS with nothing in flight skips the poll of its CQ (the
/// transport asks [`SendCore::nothing_posted`] first), yet takes its probes' completions: a live
/// peer is probed once per quiet interval for as long as the wait lasts, not once and never
/// again.
#[test]
fn a_sender_waiting_for_a_cts_takes_its_probes_completions() {
    let pair = Pair { mem: Mem::both_ends(4096), wire: RefCell::new(Wire::new(1)) };
    let (fifo, stage) = (pair.area(FIFO, 13), pair.area(SEND_STAGE, 14));
    let ms = Duration::from_millis;
    let params = Params { probe_interval: ms(100), ..one_qp(Path::default()) };
    let mut s = SendCore::new(params, remote(RECV_SIZES, 16));
    let mut sio = pair.io(0);
    let buf = || Ok(Buf { addr: SEND_DATA, size: 8, lkeys: keys(11), rkeys: keys(11), host: true });
    let mut acked = 0;
    for t in 0..50 {
        assert_eq!(s.isend_with(&fifo, &stage, &mut sio, buf, 1).unwrap(), None, "no CTS");
        s.idle(ms(t * 40), None, &mut sio, (&fifo, &stage)).unwrap();
        if !pair.wire.borrow().sq[0][0].is_empty() {
            assert!(!s.nothing_posted(), "a probe in flight");
            while !pair.wire.borrow().sq[0][0].is_empty() {
                pair.wire.borrow_mut().step(&pair.mem, 0, 0);
            }
            acked += 1;
        }
        if !s.nothing_posted() {
            poll(&pair.wire, 0, |c| s.complete(c));
        }
        assert!(s.nothing_posted(), "the probe's completion taken");
    }
    assert!((6..=20).contains(&acked), "one probe per quiet interval, not per poll: {acked}");
}

/// A receiver alone on a wire of `nqps` lanes, with repair on and one receive posted.
fn lone_receiver(nqps: usize, probe_interval: Duration) -> (Pair, RecvCore) {
    let pair = Pair { mem: Mem::both_ends(4096), wire: RefCell::new(Wire::new(nqps)) };
    let repair = Repair { attempts: 3, ..NO_REPAIR };
    let params = Params { nqps, probe_interval, repair, ..one_qp(Path::default()) };
    let mut receiver = RecvCore::new(params, remote(FIFO, 13));
    let rstage = pair.area(RECV_STAGE, 15);
    let buf = Buf { addr: RECV_DATA, size: 4096, lkeys: keys(12), rkeys: keys(12), host: true };
    receiver.irecv(&rstage, &mut pair.io(1), &[(buf, 0)], false).unwrap().unwrap();
    (pair, receiver)
}

/// The sender's request `msg`, landed in the receiver's mailbox.
fn mail_in(sizes: &Area, msg: mend::Msg) {
    for (i, w) in msg.encode().into_iter().enumerate() {
        sizes.store(SIZE_MAIL + i, w);
    }
}

/// The receiver serves repair requests as they come: a request naming a lane the comm does
/// not have is a corrupt word and changes nothing; one for the lane that carries its CTS rows
/// and its probe moves them to another lane, rebuilds the lane with its receive WQEs, and
/// answers; the probe the rebuild dropped is no longer counted, so once the answer completes
/// the watchdog has nothing outstanding (a count left over would fail the idle comm later).
#[test]
fn the_receiver_serves_a_repair_request_and_counts_nothing_it_dropped() {
    let ms = Duration::from_millis;
    let (pair, mut receiver) = lone_receiver(2, ms(100));
    let (wire, mem) = (&pair.wire, &pair.mem);
    let (rstage, rsizes, fifo) =
        (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16), pair.area(FIFO, 13));
    let mut rio = pair.io(1);
    receiver.idle(ms(0), None, &mut rio, &rstage, &rsizes).unwrap();
    receiver.idle(ms(200), None, &mut rio, &rstage, &rsizes).unwrap();
    let kinds = |w: &RefCell<Wire>, q: usize| -> Vec<u64> {
        w.borrow().sq[1][q].iter().map(|x| wr_kind(x.wr.wr_id)).collect()
    };
    assert!(kinds(wire, 0).contains(&WR_PROBE), "a probe on the control lane");
    let ask = |lane, seq| mail_in(&rsizes, mend::Msg::Ask { lane, seq, qpn: 77, via: 1 });
    ask(200, 1);
    receiver.idle(ms(201), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(wire.borrow().renewed[1], 0, "a lane the comm does not have");
    ask(0, 2);
    receiver.idle(ms(202), None, &mut rio, &rstage, &rsizes).unwrap();
    // Fenced first: no answer, no new queue pair, until the lane's receives came back.
    assert!(wire.borrow().failed[1][0], "the lane is fenced");
    assert_eq!(wire.borrow().renewed[1], 0, "not rebuilt before the lane is drained");
    assert!(!kinds(wire, 1).contains(&WR_MAIL), "no answer before the lane is drained");
    receiver.idle(ms(202), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(wire.borrow().renewed[1], 0, "the flushed receives are not polled yet");
    poll(wire, 1, |c| receiver.complete(c, &rsizes));
    receiver.idle(ms(202), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(wire.borrow().renewed[1], 1);
    assert_eq!(receiver.ctl, 1, "the CTS rows move off the rebuilt lane");
    assert!(kinds(wire, 0).is_empty(), "the fence flushed the probe");
    let full = recv_pool(2, receiver.p.split) + RECV_BATCH - 1;
    assert_eq!(wire.borrow().rq[1][0].len(), full, "the lane's receives again");
    assert!(kinds(wire, 1).contains(&WR_MAIL), "the answer, on lane 1");
    // Served once: the same word read again changes nothing.
    receiver.idle(ms(203), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(wire.borrow().renewed[1], 1);
    while !wire.borrow().sq[1][1].is_empty() {
        wire.borrow_mut().step(mem, 1, 1);
    }
    let qpn = wire.borrow().qpn[1][0];
    assert_eq!(wire.borrow().dest[1][0], 77, "the new QP is connected to the sender's");
    assert_eq!(mail(&fifo, FIFO_MAIL), Some(mend::Msg::Done { lane: 0, seq: 2, qpn }));
    poll(wire, 1, |c| receiver.complete(c, &rsizes));
    assert_eq!(receiver.health.watchdog.outstanding, 0, "nothing is out");
}

/// A fence's answer goes back through the lane its request came through. Lanes the sender
/// took out may still look live to the receiver (a stall is the sender's finding alone), and
/// writes into them are never answered (`NCCL_IB_RETRY_CNT=7` on Soft-RoCE): here lane 2
/// lives again after a repair that no data has crossed yet (the receiver still waits to see
/// it proven), then the sender takes out lanes 0 and 1 (which carries the receiver's CTS rows
/// once lane 0 is fenced). The fence of lane 0, asked through lane 2, proves lane 2 at the
/// receiver and is answered through it; lane 1, though it held nothing, is fenced next, which
/// moves the CTS rows onto lane 2; a message goes through; and a repair attempt of lane 0 that
/// fails is fenced again before anything else, as the receiver may have rebuilt its end.
#[test]
fn fences_are_answered_through_the_lane_they_came_through() {
    let pair = Pair { mem: Mem::both_ends(4096), wire: RefCell::new(Wire::new(3)) };
    pair.wire.borrow_mut().forever = true;
    let ms = Duration::from_millis;
    let repair = Repair { attempts: 3, delay: ms(10), timeout: ms(1000) };
    let params = Params { nqps: 3, repair, ..one_qp(Path::default()) };
    let Ends { mut sender, mut receiver, fifo, sstage, rstage, rsizes, .. } = pair.ends(params);
    // Both ends' progress at `now`, a few rounds (a bounded number of steps per queue: a
    // write into a fenced queue pair stays at its queue's head).
    let run = |sender: &mut SendCore, receiver: &mut RecvCore, now: Duration| {
        for _ in 0..8 {
            for (side, q) in (0..2).flat_map(|side| (0..=3).map(move |q| (side, q))) {
                for _ in 0..64 {
                    pair.wire.borrow_mut().step(&pair.mem, side, q);
                }
            }
            poll(&pair.wire, 0, |c| sender.complete(c));
            poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
            sender.idle(now, None, &mut pair.io(0), (&fifo, &sstage)).unwrap();
            receiver.idle(now, None, &mut pair.io(1), &rstage, &rsizes).unwrap();
        }
    };
    let take_out = |sender: &mut SendCore, lane: usize| {
        pair.io(0).fence(lane).unwrap();
        assert!(sender.lane_error(lane, "taken out"));
    };
    // Lane 2 fails and is repaired; no data crosses it afterwards.
    take_out(&mut sender, 2);
    for t in [1, 100, 101, 102] {
        run(&mut sender, &mut receiver, ms(t));
    }
    assert_eq!(sender.alive, 0b111, "lane 2 repaired at the sender");
    assert_eq!((receiver.alive, receiver.proving), (0b011, 0b100), "not yet seen at the receiver");
    // Lanes 0 and 1 are taken out; their repairs are not due yet.
    take_out(&mut sender, 0);
    take_out(&mut sender, 1);
    run(&mut sender, &mut receiver, ms(200));
    assert_eq!((sender.unfenced, sender.fence), (0, None), "both fenced at both ends");
    assert_eq!((receiver.alive, receiver.ctl), (0b100, 2), "the CTS rows on the lane that lives");
    // A message goes through, on lane 2.
    let b = Buf { addr: RECV_DATA, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
    let r = receiver.irecv(&rstage, &mut pair.io(1), &[(b, 0)], false).unwrap().unwrap();
    run(&mut sender, &mut receiver, ms(200));
    let b = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
    let s =
        sender.isend(&fifo, &sstage, &mut pair.io(0), b, 0).unwrap().expect("the CTS row landed");
    run(&mut sender, &mut receiver, ms(200));
    assert_eq!(sender.test(s).unwrap(), Some(64));
    assert!(receiver.test(r, &mut [0; MAX_RECVS]).unwrap().is_some());
    // Lane 0's repair: its probe fails (the path is still dead), and it is fenced again.
    pair.wire.borrow_mut().kill_lane(0, false);
    for t in [300, 301, 302] {
        run(&mut sender, &mut receiver, ms(t));
    }
    assert_eq!(sender.health.traffic.lanes[0].fenced, 2, "fenced again after a failed attempt");
}

/// A newer request replaces the one the receiver is serving: here the answer to a fence
/// asked through lane 1 waits for room on lane 1's send queue (writes stuck there, into a
/// lane the sender has since taken out), and the sender asks again through lane 2. The
/// receiver answers the newer request, through lane 2, and ignores an older one that lands
/// after it. Meanwhile it owes the sender an answer (what a closing comm waits for).
#[test]
fn a_newer_request_replaces_an_older_one() {
    let ms = Duration::from_millis;
    let (pair, mut receiver) = lone_receiver(3, ms(1000));
    let (wire, mem) = (&pair.wire, &pair.mem);
    let (rstage, rsizes, fifo) =
        (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16), pair.area(FIFO, 13));
    let mut rio = pair.io(1);
    let ask = |msg| mail_in(&rsizes, msg);
    let full = RECV_SEND_QUEUE as u64 - receiver.sq[1].used();
    receiver.sq[1].posted(full, false);
    assert!(!receiver.owes_answer(&rsizes));
    ask(mend::Msg::Fence { lane: 0, seq: 1, via: 1 });
    assert!(receiver.owes_answer(&rsizes), "a fence in the mailbox");
    receiver.idle(ms(1), None, &mut rio, &rstage, &rsizes).unwrap();
    poll(wire, 1, |c| receiver.complete(c, &rsizes)); // lane 0's receives, flushed
    receiver.idle(ms(2), None, &mut rio, &rstage, &rsizes).unwrap();
    assert!(receiver.serving.is_some(), "no room for the answer on lane 1");
    assert!(receiver.owes_answer(&rsizes), "a fence being served");
    ask(mend::Msg::Fence { lane: 0, seq: 2, via: 2 });
    receiver.idle(ms(3), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(receiver.serving, None);
    assert!(receiver.owes_answer(&rsizes), "the answer on its way");
    while !wire.borrow().sq[1][2].is_empty() {
        wire.borrow_mut().step(mem, 1, 2);
    }
    assert_eq!(mail(&fifo, FIFO_MAIL), Some(mend::Msg::Fenced { lane: 0, seq: 2 }));
    poll(wire, 1, |c| receiver.complete(c, &rsizes));
    assert!(!receiver.owes_answer(&rsizes), "the answer landed");
    // An older request landing late (through a lane the sender took out, which this end has
    // not fenced yet) changes nothing: lane 1 is not fenced for it.
    ask(mend::Msg::Ask { lane: 1, seq: 1, qpn: 77, via: 2 });
    receiver.idle(ms(4), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!((receiver.serving, wire.borrow().failed[1][1]), (None, false));
    assert!(!receiver.owes_answer(&rsizes));
    // A corrupt fence (a lane the comm does not have) is owed nothing once looked at: a
    // closing comm does not wait out the repair timeout for it.
    ask(mend::Msg::Fence { lane: 7, seq: 9, via: 1 });
    assert!(receiver.owes_answer(&rsizes), "not looked at yet");
    receiver.idle(ms(5), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(receiver.serving, None);
    assert!(!receiver.owes_answer(&rsizes), "looked at, and not a request");
}

/// Request numbers are 16 bits and wrap: after the wrap a request is newer than the last one
/// served (taken), while one from before it is older (left alone), as before the wrap.
#[test]
fn request_numbers_wrap() {
    let ms = Duration::from_millis;
    let (pair, mut receiver) = lone_receiver(3, ms(1000));
    let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
    let mut rio = pair.io(1);
    receiver.served = Some(u16::MAX - 1);
    mail_in(&rsizes, mend::Msg::Fence { lane: 0, seq: u16::MAX - 2, via: 1 });
    receiver.idle(ms(1), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!((receiver.served, receiver.serving), (Some(u16::MAX - 1), None), "an older one");
    assert!(!pair.wire.borrow().failed[1][0], "lane 0 not fenced for it");
    mail_in(&rsizes, mend::Msg::Fence { lane: 0, seq: 1, via: 1 });
    receiver.idle(ms(2), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(receiver.served, Some(1), "a newer one, across the wrap");
    assert!(pair.wire.borrow().failed[1][0], "lane 0 fenced for it");
    // Half the number space back (32,768 requests missed) reads as older, not newer.
    mail_in(&rsizes, mend::Msg::Fence { lane: 1, seq: 1u16.wrapping_sub(1 << 15), via: 2 });
    receiver.idle(ms(3), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(receiver.served, Some(1));
    assert!(!pair.wire.borrow().failed[1][1], "lane 1 not fenced");
}

/// A fence's answer whose lane goes before its completion came is owed no longer: once the
/// lane is rebuilt and proven, its new queue pair's count is not read against the old one's
/// (a closing comm would wait out the repair timeout for an answer that cannot complete).
#[test]
fn an_answer_whose_lane_goes_is_owed_no_longer() {
    let (pair, mut receiver) = lone_receiver(3, Duration::from_millis(1000));
    let rsizes = pair.area(RECV_SIZES, 16);
    // The answer posted on lane 2, its completion still to come.
    receiver.answered = Some((2, receiver.sq[2].posted + 1));
    assert!(receiver.owes_answer(&rsizes), "an answer on its way");
    receiver.forget(2);
    receiver.rebuild(2, 1, 77, &mut pair.io(1)).unwrap().expect("a new queue pair");
    receiver.crossed(2); // the sender's first write through the new queue pair
    assert_ne!(receiver.alive & 1 << 2, 0, "proven");
    assert!(!receiver.owes_answer(&rsizes), "its lane went");
}

/// A request that takes out the receiver's last lane (the lane it came through failed here
/// after it landed) fails the comm at once, naming both lanes: nothing can land or go back any
/// more, and the control lane would otherwise be a lane that is out.
#[test]
fn a_request_for_the_last_lane_fails_the_receiver_at_once() {
    let ms = Duration::from_millis;
    for msg in [
        mend::Msg::Fence { lane: 0, seq: 1, via: 1 },
        mend::Msg::Ask { lane: 0, seq: 1, qpn: 77, via: 1 },
    ] {
        let (pair, mut receiver) = lone_receiver(2, ms(1000));
        let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
        let mut rio = pair.io(1);
        assert!(receiver.lane_error(1, "a test"), "lane 0 lives on");
        mail_in(&rsizes, msg);
        let e = receiver.idle(ms(1), None, &mut rio, &rstage, &rsizes).unwrap_err();
        assert!(matches!(e, Error::Remote(_)), "a network failure (ncclRemoteError): {e:?}");
        let e = e.to_string();
        assert!(e.contains("took out lane 0, the last lane") && e.contains("lane 1"), "{e}");
        assert!(receiver.check().is_err(), "{msg:?}: the comm stays failed");
    }
    // A lane still being proven is a lane: the request takes out lane 0, and lane 2, rebuilt
    // and not yet proven, carries the comm on.
    let (pair, mut receiver) = lone_receiver(3, ms(1000));
    let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
    let mut rio = pair.io(1);
    assert!(receiver.lane_error(1, "a test"));
    receiver.forget(2);
    receiver.rebuild(2, 1, 77, &mut rio).unwrap().expect("a new queue pair");
    assert_eq!((receiver.alive, receiver.proving), (0b001, 0b100), "lane 2 being proven");
    mail_in(&rsizes, mend::Msg::Fence { lane: 0, seq: 2, via: 1 });
    receiver.idle(ms(1), None, &mut rio, &rstage, &rsizes).unwrap();
    assert!(receiver.check().is_ok());
    assert_eq!((receiver.alive, receiver.ctl), (0b100, 2), "lane 2 carries the CTS rows");
}

/// A queue pair's own failure (an async event) on the receiver's last live lane, with a
/// rebuilt lane still being proven: that lane carries the comm on, as it would after a failed
/// completion; with none left, the caller fails the comm.
#[test]
fn a_lane_error_on_the_last_live_lane_leaves_the_lane_being_proven() {
    let (pair, mut receiver) = lone_receiver(3, Duration::from_millis(1000));
    let mut rio = pair.io(1);
    assert!(receiver.lane_error(1, "a test"));
    receiver.forget(2);
    receiver.rebuild(2, 1, 77, &mut rio).unwrap().expect("a new queue pair");
    assert_eq!((receiver.alive, receiver.proving), (0b001, 0b100), "lane 2 being proven");
    assert!(receiver.lane_error(0, "QP_FATAL"), "lane 2 carries on");
    assert_eq!((receiver.alive, receiver.proving, receiver.ctl), (0b100, 0, 2));
    assert!(!receiver.lane_error(2, "QP_FATAL"), "the last lane: the comm fails");
}

/// A [`Pair`]'s two cores, their posts and their areas.
struct Ends<'a> {
    sender: SendCore,
    receiver: RecvCore,
    sio: Io<'a>,
    rio: Io<'a>,
    fifo: Area<'a>,
    sstage: Area<'a>,
    rstage: Area<'a>,
    rsizes: Area<'a>,
}

/// Both ends of a one-QP connection over the simulated wire, with their registered memory.
struct Pair {
    mem: Mem,
    wire: RefCell<Wire>,
}

impl Pair {
    fn new(data_len: usize) -> Pair {
        Pair { mem: Mem::both_ends(data_len), wire: RefCell::new(Wire::new(1)) }
    }

    fn area(&self, base: u64, key: u32) -> Area<'_> {
        Area { mem: &self.mem, base, key }
    }

    fn io(&self, side: usize) -> Io<'_> {
        let nqps = self.wire.borrow().failed[0].len() - 1;
        let depth = if side == 0 { send_queue(nqps) } else { RECV_SEND_QUEUE };
        Io { wire: &self.wire, mem: &self.mem, side, depth }
    }

    /// Both ends' cores over this pair's wire, with the areas each reads and writes.
    fn ends(&self, params: Params) -> Ends<'_> {
        Ends {
            sender: SendCore::new(params.clone(), remote(RECV_SIZES, 16)),
            receiver: RecvCore::new(params, remote(FIFO, 13)),
            sio: self.io(0),
            rio: self.io(1),
            fifo: self.area(FIFO, 13),
            sstage: self.area(SEND_STAGE, 14),
            rstage: self.area(RECV_STAGE, 15),
            rsizes: self.area(RECV_SIZES, 16),
        }
    }

    /// Executes everything queued on `side`'s QP `q`.
    fn drain(&self, side: usize, q: usize) {
        while !self.wire.borrow().sq[side][q].is_empty() {
            self.wire.borrow_mut().step(&self.mem, side, q);
        }
    }
}

/// A stream of optional receives (LL), 8 posted ahead, from a receiver that polls its CQ only
/// once every 50 passes: it never overfills its CTS send queue though the provider frees
/// entries only at poll time. Every message arrives, each as one work request, a write with
/// immediate (what a fence's receipts count), as a whole message goes.
#[test]
fn optional_receives_flow_as_single_writes_with_a_bounded_cts_queue() {
    let pair = Pair::new(64 << 10);
    let params = Params { inline: vec![512], ..one_qp(Path::default()) };
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(params);
    let n = 600;
    let (mut posted, mut sent, mut got) = (VecDeque::new(), VecDeque::new(), 0);
    let (mut next_recv, mut next_send) = (0usize, 0usize);
    let mut pass = 0;
    while got < n || next_send < n || !sent.is_empty() {
        pass += 1;
        assert!(pass < 100_000, "stuck: {got} received, {next_send} sent");
        if posted.len() < 8 && next_recv < n {
            let addr = RECV_DATA + 1024 * (next_recv % 64) as u64;
            let b = Buf { addr, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
            if let Some(id) = receiver.irecv(&rstage, &mut rio, &[(b, 0)], true).unwrap() {
                posted.push_back(id);
                next_recv += 1;
            }
        }
        if let Some(&id) = posted.front()
            && receiver.test(id, &mut [0; MAX_RECVS]).unwrap().is_some()
        {
            posted.pop_front();
            got += 1;
        }
        if next_send < n {
            let b = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
            if let Some(id) = sender.isend(&fifo, &sstage, &mut sio, b, 0).unwrap() {
                sent.push_back(id);
                next_send += 1;
            }
        }
        pair.drain(0, 0);
        poll(&pair.wire, 0, |c| sender.complete(c));
        if let Some(&id) = sent.front()
            && sender.test(id).unwrap().is_some()
        {
            sent.pop_front();
        }
        pair.drain(1, 0);
        if pass % 50 == 0 {
            poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
            receiver.idle(Duration::ZERO, None, &mut rio, &rstage, &rsizes).unwrap();
        }
    }
    let w = pair.wire.borrow();
    assert_eq!((w.sends, w.plain), (n as u64, 0), "one write with immediate per message");
}

/// Receives are topped up in batches: the lane holds at least its pool every time a CTS row
/// goes out (an `irecv` refills first), and the receiver calls into the provider once per
/// [`RECV_BATCH`] messages, not once per message.
#[test]
fn receive_wqes_are_posted_in_batches_and_the_pool_never_runs_short() {
    let pair = Pair::new(64 << 10);
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(one_qp(Path::default()));
    let n = 20 * RECV_BATCH;
    for i in 0..n {
        let addr = RECV_DATA + 1024 * (i % 64) as u64;
        let b = Buf { addr, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
        let id = receiver.irecv(&rstage, &mut rio, &[(b, 0)], false).unwrap().unwrap();
        let held = pair.wire.borrow().rq[1][0].len();
        assert!(held >= recv_pool(1, false), "message {i}: {held} receives behind its CTS");
        assert!(held < recv_pool(1, false) + RECV_BATCH, "message {i}: {held} receives posted");
        pair.drain(1, 0);
        let b = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
        let sid = sender.isend(&fifo, &sstage, &mut sio, b, 0).unwrap().unwrap();
        pair.drain(0, 0);
        poll(&pair.wire, 0, |c| sender.complete(c));
        assert_eq!(sender.test(sid).unwrap(), Some(64));
        poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
        receiver.after_poll(Duration::ZERO, &mut rio, &rstage, &rsizes).unwrap();
        assert!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap().is_some(), "message {i}");
    }
    // The first fill, then one post per batch consumed (the last batch's waits for the next
    // receive: nothing is waited for meanwhile).
    let posts = pair.wire.borrow().recv_posts;
    assert_eq!(posts, (n / RECV_BATCH) as u64, "posts of receives for {n} messages");
}

/// A large message on a slow link completes no work request for longer than the progress
/// deadline; marks (a signaled write every `mark` bytes) show the watchdog that the wire
/// moves, so a slow live peer is never an error. Without them the same link fails the comm.
#[test]
fn a_long_message_on_a_slow_link_is_not_a_dead_peer() {
    let run = |mark: u64| -> Result<()> {
        let pair = Pair::new(128 << 10);
        let params = Params { max_msg: 4096, mark, ..one_qp(Path::default()) };
        let mut sender = SendCore::new(params.clone(), remote(RECV_SIZES, 16));
        let mut receiver = RecvCore::new(params, remote(FIFO, 13));
        let (mut sio, mut rio) = (pair.io(0), pair.io(1));
        let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
        let rbuf =
            Buf { addr: RECV_DATA, size: 128 << 10, lkeys: keys(12), rkeys: keys(12), host: true };
        let rid = receiver.irecv(&rstage, &mut rio, &[(rbuf, 1)], false)?.unwrap();
        pair.drain(1, 0);
        let sbuf = Buf { addr: SEND_DATA, rkeys: keys(11), lkeys: keys(11), ..rbuf };
        let fifo = pair.area(FIFO, 13);
        let sid = sender.isend(&fifo, &pair.area(SEND_STAGE, 14), &mut sio, sbuf, 1)?.unwrap();
        // 32 writes of 4 KiB, one every 300 ms: 9.6 s for the message, 1 s deadline.
        let mut now = Duration::ZERO;
        while !pair.wire.borrow().sq[0][0].is_empty() {
            pair.wire.borrow_mut().step(&pair.mem, 0, 0);
            now += Duration::from_millis(300);
            poll(&pair.wire, 0, |c| sender.complete(c));
            sender.idle(now, None, &mut sio, (&fifo, &pair.area(SEND_STAGE, 14)))?;
        }
        poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
        assert_eq!(sender.test(sid)?, Some(128 << 10));
        assert_eq!(receiver.test(rid, &mut [0; MAX_RECVS])?, Some(1));
        Ok(())
    };
    run(4096).expect("a slow live link with marks");
    let e = run(u64::MAX).expect_err("the same link without marks").to_string();
    assert!(e.contains("no completion"), "{e}");
}

/// A message that needs more work requests on one lane than its send queue holds, even
/// empty, is an error that says so: waiting for room would never end. One that fits goes.
#[test]
fn a_message_the_send_queue_can_never_hold_is_an_error_not_a_wait() {
    let send = |size: u64| -> Result<Option<usize>> {
        let pair = Pair::new(1 << 20);
        let params = Params { max_msg: 4096, mark: 4096, ..one_qp(Path::default()) };
        let mut sender = SendCore::new(params.clone(), remote(RECV_SIZES, 16));
        let mut receiver = RecvCore::new(params, remote(FIFO, 13));
        let (mut sio, mut rio) = (pair.io(0), pair.io(1));
        let rstage = pair.area(RECV_STAGE, 15);
        let rbuf = Buf { addr: RECV_DATA, size, lkeys: keys(12), rkeys: keys(12), host: true };
        receiver.irecv(&rstage, &mut rio, &[(rbuf, 1)], false)?.unwrap();
        pair.drain(1, 0);
        let sbuf = Buf { addr: SEND_DATA, rkeys: keys(11), lkeys: keys(11), ..rbuf };
        sender.isend(&pair.area(FIFO, 13), &pair.area(SEND_STAGE, 14), &mut sio, sbuf, 1)
    };
    // 4 KiB pieces: 60 and the size record and immediate fit one lane's 63 entries, 256 never.
    assert!(send(240 << 10).expect("60 pieces fit").is_some());
    let e = send(1 << 20).expect_err("256 pieces never fit").to_string();
    assert!(e.contains("needs 258 work requests") && e.contains("(63)"), "{e}");
}

/// A CTS entry whose buffer wraps the address space (a corrupt or hostile peer) fails the
/// comm when `isend` reads it, with an error that says so; no write is posted.
#[test]
fn a_cts_for_a_buffer_that_wraps_the_address_space_fails_the_comm() {
    let pair = Pair::new(4096);
    let mut sender = SendCore::new(one_qp(Path::default()), remote(RECV_SIZES, 16));
    let mut sio = pair.io(0);
    let fifo = pair.area(FIFO, 13);
    let row = Cts { addr: u64::MAX - 8, size: 64, nreqs: 1, idx: 1, ..Cts::default() };
    for (i, w) in row.encode().into_iter().enumerate() {
        fifo.store(entry_word(0, 0) + i, w);
    }
    let b = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
    let e = sender.isend(&fifo, &pair.area(SEND_STAGE, 14), &mut sio, b, 0);
    let e = e.expect_err("a wrapping buffer").to_string();
    assert!(e.contains("wraps the address space"), "{e}");
    assert!(pair.wire.borrow().sq[0][0].is_empty(), "nothing posted");
}

/// Optional receives complete when their data lands (its write with immediate), and until
/// then the receiver waits on the sender: it probes a quiet sender, and a dead one fails the
/// next irecv and test NCCL makes.
#[test]
fn a_dead_sender_of_optional_receives_fails_the_next_call() {
    let pair = Pair::new(4096);
    let params = Params { probe_interval: Duration::from_millis(100), ..one_qp(Path::default()) };
    let mut receiver = RecvCore::new(params, remote(FIFO, 13));
    let mut rio = pair.io(1);
    let (rstage, rsizes) = (pair.area(RECV_STAGE, 15), pair.area(RECV_SIZES, 16));
    let buf = Buf { addr: RECV_DATA, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
    let mut ids = Vec::new();
    for tag in 0..4 {
        ids.push(receiver.irecv(&rstage, &mut rio, &[(buf, tag)], true).unwrap().unwrap());
    }
    pair.drain(1, 0);
    let first = ids.remove(0);
    assert_eq!(receiver.test(first, &mut [0; MAX_RECVS]).unwrap(), None, "no data yet");
    let probes = |w: &RefCell<Wire>| {
        w.borrow().sq[1][0].iter().filter(|q| wr_kind(q.wr.wr_id) == WR_PROBE).count()
    };
    let ms = Duration::from_millis;
    receiver.idle(ms(0), None, &mut rio, &rstage, &rsizes).unwrap();
    receiver.idle(ms(200), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!(probes(&pair.wire), 1, "a quiet sender of optional receives is probed");
    pair.wire.borrow_mut().break_all();
    poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
    let e = receiver.irecv(&rstage, &mut rio, &[(buf, 9)], true).unwrap_err();
    assert!(e.to_string().contains("liveness probe"), "{e}");
    let e = receiver.test(ids[0], &mut [0; MAX_RECVS]).unwrap_err();
    assert!(e.to_string().contains("liveness probe"), "{e}");
}

/// A flush takes any free slot: an untested flush at the head of the ring holds only its own.
#[test]
fn flushes_take_any_free_slot() {
    let pair = Pair::new(4096);
    let mut receiver = RecvCore::new(one_qp(Path::default()), remote(FIFO, 13));
    let mut rio = pair.io(1);
    let target = Buf { addr: RECV_DATA, size: 1, lkeys: keys(12), rkeys: keys(12), host: false };
    let ids: Vec<usize> =
        (0..SLOTS).map(|_| receiver.iflush(&mut rio, target, &[(SCRATCH, 17)]).unwrap()).collect();
    let e = receiver.iflush(&mut rio, target, &[(SCRATCH, 17)]).unwrap_err();
    assert!(e.to_string().contains("flushes outstanding"), "{e}");
    pair.drain(1, 1);
    let rsizes = pair.area(RECV_SIZES, 16);
    poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
    // NCCL tests the sixth flush only; the head (the first) stays done but untested.
    assert_eq!(receiver.test(ids[5], &mut [0; MAX_RECVS]).unwrap(), Some(0));
    let again = receiver.iflush(&mut rio, target, &[(SCRATCH, 17)]).unwrap();
    assert_eq!(again, ids[5], "the freed slot is taken");
    receiver.iflush(&mut rio, target, &[(SCRATCH, 17)]).unwrap_err();
}

/// One message at a time, each side driven as `transport::data` drives it (a receiver that
/// polls only when a call of its own needs it): normal receives, then optional ones, each
/// tested once it is pending no more, so that no test polls. The CTS queue's entries are freed
/// only by polls, so the receiver's `irecv` must poll before the queue runs out
/// (`needs_poll`), or its next row waits for room, its receives never complete, and its slots
/// run out.
#[test]
fn one_message_at_a_time_never_stalls_the_cts_rows() {
    let pair = Pair::new(64 << 10);
    let params = Params { inline: vec![512], ..one_qp(Path::default()) };
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(params);
    let progress = |r: &mut RecvCore, rio: &mut Io| {
        poll(&pair.wire, 1, |c| r.complete(c, &rsizes));
        r.idle(Duration::ZERO, None, rio, &rstage, &rsizes).unwrap();
    };
    let mut untested = VecDeque::new();
    for k in 0..300usize {
        let optional = k >= 100;
        let size = (k % 70) as u64;
        let b = Buf { addr: RECV_DATA, size, lkeys: keys(12), rkeys: keys(12), host: true };
        if receiver.needs_poll() {
            progress(&mut receiver, &mut rio);
        }
        let rid = receiver.irecv(&rstage, &mut rio, &[(b, 5)], optional).unwrap();
        let rid = rid.unwrap_or_else(|| panic!("irecv {k}"));
        pair.drain(1, 0);
        let sb = Buf { addr: SEND_DATA, size, lkeys: keys(11), rkeys: keys(11), host: true };
        let sid = sender.isend(&fifo, &sstage, &mut sio, sb, 5).unwrap();
        assert!(sid.is_some(), "message {k}: the sender found no row");
        pair.drain(0, 0);
        poll(&pair.wire, 0, |c| sender.complete(c));
        assert!(sender.test(sid.unwrap()).unwrap().is_some(), "send {k}");
        untested.push_back(rid);
        while let Some(&r) = untested.front()
            && (!receiver.pending(r) || k < 100)
        {
            if receiver.pending(r) || receiver.needs_poll() {
                progress(&mut receiver, &mut rio);
            }
            assert!(receiver.test(r, &mut [0; MAX_RECVS]).unwrap().is_some(), "recv {k}");
            untested.pop_front();
        }
    }
    assert!(untested.len() < SLOTS, "{} receives never completed", untested.len());
}

/// `lanes_mask` on both sides of its 64-bit shortcut: exactly the first `n` bits.
#[test]
fn a_lane_mask_has_exactly_its_first_n_bits() {
    for n in 1..=MAX_CHUNKS {
        let m = lanes_mask(n);
        assert_eq!(m.count_ones() as usize, n, "{n}");
        assert_eq!(m.trailing_ones() as usize, n, "{n}");
    }
}

/// A rebuilt lane gets a full pool on its new queue pair whatever its old pool counted: the
/// rebuild marks it short itself (refill's rule: a pool under its size has its bit). `serve`
/// rebuilds only a lane whose old receives all came back, which marked it already; this calls
/// the rebuild on a full pool, as another caller might.
#[test]
fn a_rebuilt_lane_gets_its_receives_whatever_its_pool_counted() {
    let mem = Mem::both_ends(4096);
    let wire = RefCell::new(Wire::new(2));
    let params = Params { nqps: 2, members: vec![(0, 0); 2], ..one_qp(Path::default()) };
    let mut receiver = RecvCore::new(params, remote(FIFO, 13));
    let mut rio = Io { wire: &wire, mem: &mem, side: 1, depth: RECV_SEND_QUEUE };
    let rstage = Area { mem: &mem, base: RECV_STAGE, key: 15 };
    let buf = Buf { addr: RECV_DATA, size: 64, lkeys: keys(12), rkeys: keys(12), host: true };
    receiver.irecv(&rstage, &mut rio, &[(buf, 0)], false).unwrap().unwrap();
    let full = recv_pool(2, receiver.p.split);
    assert!(receiver.pool.iter().all(|&n| n >= full), "first fill: {:?}", receiver.pool);
    assert_eq!(receiver.short, 0);
    let qpn = receiver.rebuild(1, 1, 77, &mut rio).unwrap().expect("a new queue pair");
    assert_eq!(wire.borrow().qpn[1][1], qpn);
    assert!(receiver.pool[1] >= full, "the new queue pair's pool: {:?}", receiver.pool);
    assert!(wire.borrow().rq[1][1].len() >= full, "receives posted on the new queue pair");
}

/// The whole message's one write (`ChunkWrs::whole`) is the one the general builders make
/// (`data`, then `imm` on its last write), field for field, at the sizes where inline data,
/// the largest message and a signaled mark begin, from host and from GPU memory, on a lane
/// whose ends are on different member ports.
#[test]
fn a_whole_messages_one_write_is_the_general_paths() {
    let (max_msg, mark, inline) = (4096, 4096, 64);
    let mem = Mem::both_ends(4096);
    for size in [1, 8, 64, 65, 4095, 4096] {
        for host in [true, false] {
            let mut s = SendSlot { nreqs: 1, ..SendSlot::default() };
            let (lkeys, rkeys) = (keys(11), keys(12));
            s.bufs[0] = Some(SendBuf { addr: SEND_DATA, size, lkeys, host });
            s.row[0] = Cts { addr: RECV_DATA, size, rkeys, nreqs: 1, idx: 5, ..Cts::default() };
            let k = ChunkWrs { slot: 3, chunk: 0, lane: 1, life: 2, members: (0, 1), inline };
            let imm = Imm { slot: 3, chunk: 0, epoch: epoch(5), size: Some(size) }.encode(false);
            let (whole, len) = k.whole(&s, imm, max_msg).expect("one write holds it");
            let (mut wrs, mut sq) = ([SendWr::default(); MAX_CHAIN], SqCount::new(64));
            let wire = RefCell::new(Wire::new(2));
            let mut io = Io { wire: &wire, mem: &mem, side: 0, depth: 64 };
            let mut chain = Chain::new(1, &mut wrs, &mut sq);
            let parts = [(0, size); MAX_RECVS];
            let data = k.data(&mut chain, &mut io, &s, &parts, (max_msg, mark)).unwrap();
            k.imm(&mut chain, &mut io, imm, true).unwrap();
            chain.flush(&mut io).unwrap();
            assert_eq!((len, data), (size, size));
            let general: Vec<String> =
                wire.borrow().sq[0][1].iter().map(|q| format!("{:?}", q.wr)).collect();
            assert_eq!(general, [format!("{whole:?}")], "{size} bytes, host {host}");
        }
    }
    // None where one write does not hold it: an empty message, or one of pieces.
    let mut s = SendSlot { nreqs: 1, ..SendSlot::default() };
    let k = ChunkWrs { slot: 0, chunk: 0, lane: 0, life: 0, members: (0, 0), inline };
    for size in [0, max_msg + 1] {
        s.bufs[0] = Some(SendBuf { size, ..SendBuf::default() });
        assert!(k.whole(&s, 0, max_msg).is_none(), "{size} bytes");
    }
}

/// A whole message's size rides in its immediate below 32 MiB: from 256 KiB (the split
/// layout's bound) up, in one write with immediate where one write holds it, else in pieces
/// whose last carries the immediate; no size record is written. At 32 MiB the size goes in the
/// record. Every size and byte arrives.
#[test]
fn whole_messages_carry_their_size_in_the_immediate_below_32_mib() {
    let sizes = miri_or(
        vec![IMM_MAX_SIZE + 1, (1 << 20) + 1, IMM_MAX_WHOLE, IMM_MAX_WHOLE + 1],
        vec![IMM_MAX_SIZE + 1],
    );
    let pair = Pair::new(*sizes.last().unwrap() as usize);
    let params = Params { max_msg: MARK_BYTES, ..one_qp(Path::default()) };
    let mut e = pair.ends(params);
    for (i, &size) in sizes.iter().enumerate() {
        deliver(&pair, &mut e, (size, i as u8, false), |wrs| {
            // The data in writes of up to `max_msg`, the last with the immediate where it
            // carries the size; else the size record, then a write with immediate of its own.
            let pieces = size.div_ceil(MARK_BYTES) as usize;
            let want = if size <= IMM_MAX_WHOLE { pieces } else { pieces + 2 };
            assert_eq!(wrs[0], want, "{size} bytes: work requests");
        });
    }
}

/// An optional receive (NCCL's LL) in split mode goes whole, one chunk on one lane: its size
/// in the split layout's immediate, or, above that layout's bound (256 KiB), in the size
/// record. Every size and byte arrives.
#[test]
fn optional_rows_in_split_mode_go_whole() {
    for size in miri_or(vec![8, IMM_MAX_SIZE, IMM_MAX_SIZE + 1], vec![8, IMM_MAX_SIZE + 1]) {
        let pair = Pair { mem: Mem::both_ends(size as usize), wire: RefCell::new(Wire::new(2)) };
        let params = Params {
            nqps: 2,
            split: true,
            members: vec![(0, 0); 2],
            max_msg: MARK_BYTES,
            ..one_qp(Path::default())
        };
        deliver(&pair, &mut pair.ends(params), (size, 0, true), |wrs| {
            assert_eq!(wrs.iter().filter(|&&n| n > 0).count(), 1, "{size} bytes on one lane");
        });
    }
}

/// One message of `size` bytes (pattern `i`) from `e`'s sender to its receiver, `optional` as
/// NCCL's LL: `posted` sees how many work requests each of the sender's QPs holds before they
/// run; the send completes, and the receive with its size and bytes.
fn deliver(
    pair: &Pair,
    e: &mut Ends,
    (size, i, optional): (u64, u8, bool),
    posted: impl Fn(&[usize]),
) {
    let pattern: Vec<u8> = (0..size).map(|b| (b % 251) as u8 ^ i).collect();
    pair.mem.with(SEND_DATA, size as usize, None, |b| b.copy_from_slice(&pattern));
    let rbuf = Buf { addr: RECV_DATA, size, lkeys: keys(12), rkeys: keys(12), host: true };
    let id = e.receiver.irecv(&e.rstage, &mut e.rio, &[(rbuf, 0)], optional).unwrap().unwrap();
    pair.drain(1, 0);
    let sbuf = Buf { addr: SEND_DATA, size, lkeys: keys(11), rkeys: keys(11), host: true };
    let sid = e.sender.isend(&e.fifo, &e.sstage, &mut e.sio, sbuf, 0).unwrap().expect("posted");
    let nqps = e.sender.p.nqps;
    posted(&(0..nqps).map(|q| pair.wire.borrow().sq[0][q].len()).collect::<Vec<_>>());
    (0..nqps).for_each(|q| pair.drain(0, q));
    poll(&pair.wire, 0, |c| e.sender.complete(c));
    assert_eq!(e.sender.test(sid).unwrap(), Some(size));
    poll(&pair.wire, 1, |c| e.receiver.complete(c, &e.rsizes));
    let mut got = [0; MAX_RECVS];
    assert_eq!(e.receiver.test(id, &mut got).unwrap(), Some(1), "{size} bytes");
    assert_eq!(got[0], size, "the size the receiver reports");
    assert!(pair.mem.read(RECV_DATA, size as usize) == pattern, "{size} bytes: the data");
}

/// A row written again from the stage (its control lane failed, and the next takes less
/// inline) may still be read by the NIC after the sender consumed its first copy, which had
/// landed: its slot is not restaged until that write completed. Otherwise the write could carry
/// the newer row, or a torn mix of both: the wire checks that no write's stage bytes change
/// under it. Slots whose rows no such write reads are restaged at once.
#[test]
fn a_row_written_again_holds_its_slot_until_the_write_completed() {
    let pair = Pair { mem: Mem::both_ends(64 << 10), wire: RefCell::new(Wire::new(2)) };
    pair.wire.borrow_mut().caps = [vec![64, 48], vec![64, 48]];
    let params = Params { nqps: 2, inline: vec![64, 48], ..one_qp(Path::default()) };
    let Ends { mut sender, mut receiver, mut sio, mut rio, fifo, sstage, rstage, rsizes } =
        pair.ends(params);
    let buf = |k: usize| {
        let addr = RECV_DATA + 64 * (k % SLOTS) as u64;
        Buf { addr, size: 64, lkeys: keys(12), rkeys: keys(12), host: true }
    };
    let sbuf = Buf { addr: SEND_DATA, size: 64, lkeys: keys(11), rkeys: keys(11), host: true };
    let irecv = |receiver: &mut RecvCore, rio: &mut Io, k: usize| {
        receiver.irecv(&rstage, rio, &[(buf(k), 0)], false).unwrap()
    };
    // The sender consumes the row of the last posted receive, which then completes.
    let deliver = |sender: &mut SendCore, receiver: &mut RecvCore, sio: &mut Io, id: usize| {
        let s = sender.isend(&fifo, &sstage, sio, sbuf, 0).unwrap().expect("the row landed");
        (0..2).for_each(|q| pair.drain(0, q));
        poll(&pair.wire, 0, |c| sender.complete(c));
        assert_eq!(sender.test(s).unwrap(), Some(64));
        poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
        assert!(receiver.test(id, &mut [0; MAX_RECVS]).unwrap().is_some());
    };
    // Rows 1 to 31 go through on lane 0, inline; row 32 lands.
    for k in 0..SLOTS - 1 {
        let id = irecv(&mut receiver, &mut rio, k).expect("a free slot");
        pair.drain(1, 0);
        deliver(&mut sender, &mut receiver, &mut sio, id);
    }
    let last = irecv(&mut receiver, &mut rio, SLOTS - 1).expect("a free slot");
    pair.drain(1, 0);
    // Lane 0 fails at both ends: row 32, the one the sender may not have consumed, goes again
    // on lane 1, from the stage (a row is more than lane 1 takes inline), and that write has
    // not executed yet when the sender consumes the row's first copy.
    pair.wire.borrow_mut().failed[1][0] = true;
    assert!(receiver.lane_error(0, "QP_FATAL"));
    pair.io(0).fence(0).unwrap();
    assert!(sender.lane_error(0, "taken out"));
    receiver.idle(Duration::from_millis(1), None, &mut rio, &rstage, &rsizes).unwrap();
    assert_eq!((receiver.ctl, receiver.staged()), (1, 0), "row 32 went out on lane 1");
    assert!(!pair.wire.borrow().sq[1][1].is_empty());
    deliver(&mut sender, &mut receiver, &mut sio, last);
    // Rows 33 to 63 take the slots of rows 1 to 31 at once; row 64 waits for the writes that
    // read row 32.
    for k in SLOTS..2 * SLOTS - 1 {
        assert!(irecv(&mut receiver, &mut rio, k).is_some(), "row {} posted", k + 1);
    }
    let k = 2 * SLOTS - 1;
    assert_eq!(irecv(&mut receiver, &mut rio, k), None, "restaged under a write in flight");
    pair.drain(1, 1);
    poll(&pair.wire, 1, |c| receiver.complete(c, &rsizes));
    assert!(irecv(&mut receiver, &mut rio, k).is_some(), "free once the writes completed");
    pair.drain(1, 1);
}
