//! The data-path protocol with no I/O inside (in the style of quinn-proto): the send and
//! receive slot tables, the CTS FIFO, tag matching, the multi-QP split and round-robin, the
//! `wr_id`/immediate encoding and the completion accounting. The shell, `ferroce::transport::data`, owns the verbs objects,
//! feeds completions in and posts what the core asks for through [`Post`]; the tests below
//! drive both ends against a simulated network, with no verbs at all. Of its crate it imports only
//! `wr` (the work requests it asks for, the completions it is fed) and `error`: no verbs, no FFI.
//!
//! The protocol, receiver-driven:
//! 1. `irecv` tops up each lane's pool of buffer-less receive WQEs (they absorb the sender's
//!    writes-with-immediate, whichever slot they are for), then writes the `n` buffer
//!    descriptors ([`Cts`] entries) of row `head % SLOTS` into the sender's FIFO, at once: one
//!    RDMA write of its head entry (plus one for a multi-receive's other entries), one
//!    doorbell. No row waits for a later call: once `irecv` returned, the sender can match the
//!    receive however long the receiving side stays away. Rows wait only while the CTS send
//!    queue is full (the comm then polls before `irecv` returns, a bounded while), or after
//!    they moved to another lane; then they go out in batches of up to 8.
//! 2. `isend` finds the row in its FIFO, matches by tag, and once all `n` sends of the row are
//!    matched, posts one chain per lane: RDMA writes of the data, then (for `n > 1`, or sizes
//!    that do not fit the immediate) a write of the sizes into the receiver's size records,
//!    and a final signaled write-with-immediate.
//! 3. A send completion finds its slot through `wr_id`; a receive completion through its
//!    immediate, which names the slot, the chunk (the lane's part of a split message) and the
//!    parity of the slot's use ([`Imm`]). The receive is done when every chunk has arrived; a
//!    chunk that arrives twice (sent again on another lane after its first copy landed) sets
//!    its bit twice and counts once, and a chunk of another use of the slot is not counted. So
//!    no chunk needs a particular lane: the ground for moving chunks between lanes.
//!
//! The first invariant, above every other: **a receive completes exactly once, and once it
//! has completed, no NIC writes its buffer again (no data, no size record) until NCCL posts
//! that buffer again.** NCCL hands a completed buffer on at once: to the next step, to another
//! peer's p2p transfer, back to the application. The simulated wire in the tests checks every
//! write against it. (Optional receives have no completion the plugin sees: see below.)
//!
//! Lanes: a lane whose path dies (retries exhausted) or whose QP fails on its own (an async
//! error) is dropped while another lives. Its chunks in flight may have landed with only their
//! ACKs lost (a path can fail one way), so they are not simply sent again: **fence, confirm,
//! then re-send.** The sender holds them and writes a [`mend::Msg::Fence`] into the receiver's
//! mailbox through a live lane. The receiver fences its end of the lane (its queue pair to the
//! error state, so nothing more of it lands), waits until every receive it had posted on the
//! lane has come back (landed or flushed), so that every chunk that landed is counted, and
//! answers with its receipts ([`RecvCore::receipts`]): per slot, which receive it holds, whether
//! it is still open and which chunks it counted, and the ack word's high-water mark. Only the
//! chunks it did not count go again ([`SendCore::settle`]), on live lanes, in row order; a
//! receive that completed is never written again. The sender posts nothing new until they
//! have. The receiver's CTS rows move to its next live lane if they rode on the fenced one.
//! Where messages go is path-aware ([`place`]): a lane's measured rate and queue steer whole
//! messages, and a lane under a quarter of the best rate gets no new work.
//!
//! Optional receive completions: NCCL marks LL/LL128 receives (one buffer) whose arrival it
//! detects itself through flags in the data. Their CTS says so; the sender then sends a plain
//! RDMA write (no immediate, so the receiver posts no WQE and polls no completion), followed
//! on the same lane by a small write of the row's `idx` into the receiver's ack word. The
//! receive is a valid request that tests complete once the ack word reached its row (its data
//! landed): not sooner, because NCCL stops testing a request once it is done, and a receiving
//! comm whose LL data waits behind a fence must still be called to answer it. The ack word (or
//! a later receive that completed) is also what lets the receiver reuse the slot only after
//! the sender has consumed its previous row.
//! Optional rows go on one lane, in row order, so the ack word is also the last row whose data
//! landed; the receiver keeps its high-water mark, and a fence's receipts report it: rows up to
//! it are not sent again, later ones are, in row order. The one exception to the first
//! invariant lives here: a row re-sent after a fence may rewrite, with the same bytes, a buffer
//! whose data had landed without its ack (at most one row per fence: the last whose data
//! landed) and that NCCL has already read. NCCL's LL flags make that harmless: it
//! rewrites identical bytes, and a buffer NCCL posted again gets its new data after it, on the
//! same lane.
//!
//! Liveness: a comm that waits (requests pending, or a send waiting for its CTS) and has seen no
//! completion for the probe interval posts a zero-length RDMA write to its peer. A live peer's
//! NIC acknowledges it even when the process is stopped or busy, so a slow peer is never an
//! error; a dead one (process, node or link gone) fails it after the retry bound, which fails
//! every pending request. The watchdog covers a probe that never completes at all.
//!
//! Invariants:
//! - A slot is reused only after NCCL has seen every request of its previous use complete.
//! - The receive WQE is posted before the CTS that allows the matching write, so the sender
//!   never meets receiver-not-ready.
//! - The CTS of slot `k` is only rewritten after slot `k`'s receive completed, which proves the
//!   sender consumed it: so CTS writes can go unsignaled and the staging row can be reused.
//! - The CTS queue pair's send queue is counted as a provider that frees entries only when a
//!   signaled completion is polled sees it ([`SqCount`]): one request in 32 is signaled, a
//!   batch that does not fit waits, and one entry is kept for a probe.
//! - A posted receive never waits on its own end's next call: its row is written by `irecv`
//!   (or, with the CTS send queue full, by the polls `irecv` makes before it returns).

use std::collections::VecDeque;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::wr::{Completion, MAX_CHAIN, Op, SendWr, status_name};

mod mend;
mod place;
mod stall;

pub use mend::Policy as Repair;

/// Messages of this many bytes and more are timed for path-aware placement (a comm's
/// [`Params::timed_from`]).
pub const TIMED_FROM: u64 = 64 << 10;

/// Outstanding (multi-)receives per comm: NCCL's `NCCL_NET_MAX_REQUESTS`.
pub const SLOTS: usize = 32;
/// Buffers one `irecv` may group (`maxRecvs`).
pub const MAX_RECVS: usize = 8;
/// Most member ports one comm spans (a fused device's), as NCCL's IB transport allows.
pub const MAX_MEMBERS: usize = 4;
/// A registration's key on each member port of its comm (entry `m`: member `m`'s).
pub type Keys = [u32; MAX_MEMBERS];
/// One CTS entry in bytes, and in u64 words.
pub const ENTRY: usize = 64;
const ENTRY_WORDS: usize = ENTRY / 8;
/// The FIFO (and the receiver's staging area, which mirrors it) in u64 words: first the head
/// entries (entry 0 of every slot, dense, so that a batch of consecutive rows is one small
/// write), then the other entries of multi-receives, `MAX_RECVS - 1` per slot.
pub const FIFO_WORDS: usize = SLOTS * MAX_RECVS * ENTRY_WORDS;
/// After the FIFO, the sender's mailbox: the receiver's answers about lane repair and fences.
const FIFO_MAIL: usize = FIFO_WORDS;
/// After the mailbox, the receipts of the last fence ([`RecvCore::receipts`]).
const FIFO_RECEIPTS: usize = FIFO_MAIL + mend::MAIL_WORDS;
/// The receipts in u64 words: the ack word's high-water mark, then per slot its receive's
/// `idx << 1 | open` and the chunks counted (two words).
const RECEIPT_WORDS: usize = 1 + 3 * SLOTS;
/// The FIFO, its mailbox and the receipts (and the receiver's staging area, which mirrors
/// them).
pub const FIFO_AREA: usize = FIFO_RECEIPTS + RECEIPT_WORDS;
/// Most rows one CTS batch carries: their head entries are one write of 512 bytes, inline.
pub const BATCH: u64 = 8;
/// The size records in u64 words: one per buffer of every slot, then the ack word.
pub const SIZE_WORDS: usize = SLOTS * MAX_RECVS + 1;
/// The word of the size records that holds the last optional row the sender consumed.
const ACK_WORD: usize = SLOTS * MAX_RECVS;
/// After the size records, the receiver's mailbox: the sender's lane repair requests.
const SIZE_MAIL: usize = SIZE_WORDS;
/// The size records and the mailbox (and the sender's staging area, which mirrors them).
pub const SIZE_AREA: usize = SIZE_WORDS + mend::MAIL_WORDS;
/// Flag in a CTS entry's `nreqs` word: the receiver wants no completion.
const CTS_OPTIONAL: u64 = 1 << 8;
/// The sender's send-queue depth per QP; a slot whose chain does not fit waits.
pub const SEND_QUEUE: usize = 1024;
/// The receiver's send-queue depth per QP: CTS batches and probes, on QP 0 only.
pub const RECV_SEND_QUEUE: usize = 2 * SLOTS;
/// The receiver signals a CTS write once this many work requests went unsignaled: a provider
/// that frees send-queue entries only when a later signaled request completes (mlx5) then
/// always has one on the way while the queue is more than half full.
const CTS_SIGNAL_EVERY: u64 = RECV_SEND_QUEUE as u64 / 2;

/// The immediate of a chunk's final write names what it completes, so that the receiver needs
/// no particular lane for it: bits 0-4 the slot, 5-11 the chunk (the lane's part in a split
/// message, 0 otherwise), 12 the parity of the slot's use (`(idx - 1) / SLOTS`); then either
/// the size in bits 13-30 (below 256 KiB), or bit 31 set: the sizes are in the slot's size
/// records.
const IMM_SIZES: u32 = 0x8000_0000;
const IMM_SIZE_SHIFT: u32 = 13;
/// The most chunks (lanes) one message is split into: `NCCL_IB_QPS_PER_CONNECTION`'s bound.
pub const MAX_CHUNKS: usize = 128;
/// The largest size an immediate carries itself.
const IMM_MAX_SIZE: u64 = (IMM_SIZES >> IMM_SIZE_SHIFT) as u64 - 1;
/// Receive WQEs each of `nqps` lanes keeps posted, so that every chunk in flight finds one on
/// whichever lane carries it. Without failures a slot's message puts at most one chunk on a
/// lane; once lanes fail, the live ones carry the chunks of the dead ones (spread evenly), and a
/// chunk that landed before its ACK was lost lands twice. Twice a slot's chunks on each lane
/// covers every lane but one failing, for up to 4 lanes; beyond 4, as long as a quarter of the
/// lanes live. The receiver tops the pools up before every CTS and after every poll.
pub fn recv_pool(nqps: usize) -> usize {
    2 * SLOTS * nqps.clamp(1, 4)
}

/// `wr_id` = kind << 32 | lane << 8 | slot.
pub const WR_SEND: u64 = 1 << 32;
pub const WR_CTS: u64 = 2 << 32;
pub const WR_RECV: u64 = 3 << 32;
pub const WR_FLUSH: u64 = 4 << 32;
pub const WR_PROBE: u64 = 5 << 32;
/// A signaled data write in the middle of a long chain: progress the watchdog and the prober
/// can see while a large message is still on the wire.
pub const WR_MARK: u64 = 6 << 32;
/// A write into the peer's mailbox word (lane repair), and the probe of a rebuilt lane.
pub const WR_MAIL: u64 = 7 << 32;
pub const WR_MEND: u64 = 8 << 32;
/// The most bytes of one message a lane sends without a signaled write: the data write that
/// reaches this many unsignaled bytes is signaled (a [`WR_MARK`]), and no single write is
/// larger.
pub const MARK_BYTES: u64 = 8 << 20;

fn wr_id(kind: u64, lane: usize, slot: usize) -> u64 {
    kind | (lane as u64 & 0xff) << 8 | slot as u64 & 0xff
}

/// A sender's data work request: also the chunk it carries (bits 16-23).
fn data_wr_id(kind: u64, lane: usize, slot: usize, chunk: usize) -> u64 {
    wr_id(kind, lane, slot) | (chunk as u64 & 0xff) << 16
}

/// A work request of the `life`-th life of its lane: each repair of a lane starts a new one,
/// and the completions of an earlier one are ignored (bits 24-31).
fn tagged(id: u64, life: u8) -> u64 {
    id | u64::from(life) << 24
}

fn wr_life(id: u64) -> u8 {
    (id >> 24) as u8
}

fn wr_chunk(id: u64) -> usize {
    ((id >> 16) & 0xff) as usize
}

fn wr_kind(id: u64) -> u64 {
    id & !0xffff_ffff
}

fn wr_lane(id: u64) -> usize {
    ((id >> 8) & 0xff) as usize
}

fn wr_slot(id: u64) -> usize {
    (id & 0xff) as usize % SLOTS
}

/// The parity of the use of its slot that the row with `idx` is.
fn epoch(idx: u64) -> u32 {
    (((idx - 1) / SLOTS as u64) & 1) as u32
}

/// What a chunk's immediate names (see [`IMM_SIZES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Imm {
    slot: usize,
    chunk: usize,
    epoch: u32,
    /// The size, or `None`: in the slot's size records.
    size: Option<u64>,
}

impl Imm {
    fn encode(&self) -> u32 {
        let ids = self.slot as u32 | (self.chunk as u32) << 5 | self.epoch << 12;
        match self.size {
            Some(s) => ids | (s as u32) << IMM_SIZE_SHIFT,
            None => ids | IMM_SIZES,
        }
    }

    fn decode(imm: u32) -> Imm {
        Imm {
            slot: (imm & 0x1f) as usize,
            chunk: ((imm >> 5) & 0x7f) as usize,
            epoch: (imm >> 12) & 1,
            size: (imm & IMM_SIZES == 0).then_some(u64::from(imm >> IMM_SIZE_SHIFT)),
        }
    }
}

/// Whether a slot's sizes fit the immediate (one buffer, at most [`IMM_MAX_SIZE`] bytes).
fn size_in_imm(sizes: &[u64]) -> Option<u64> {
    match sizes {
        [s] if *s <= IMM_MAX_SIZE => Some(*s),
        _ => None,
    }
}

/// What the peer may do through one of a comm's queue pairs: its `qp_access_flags`, which gate
/// only the remote side's operations (the local NIC's own writes, reads and receives need no
/// flag). Each QP grants what its role needs and nothing more; the tests' simulated network
/// refuses any operation its target QP does not grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    Nothing,
    /// RDMA writes, zero-length ones (probes) included: a zero-length write checks no memory
    /// key, but the responder's QP must still allow remote writes.
    Write,
    /// RDMA reads.
    Read,
}

/// What the sender's QP `q` grants: the receiver writes its CTS rows into the FIFO and probes
/// on its first live lane, which is QP 0 until that lane's path fails: every QP grants
/// remote write (and nothing else).
pub fn send_grant(_q: usize) -> Grant {
    Grant::Write
}

/// What the receiver's QP `q` of `nqps` grants: each takes the sender's data, size records,
/// ack word and probes. Index `nqps` is the loopback flush QP, the responder of its own RDMA
/// read of NCCL's receive buffer: read only. No QP a peer reaches grants remote reads.
pub fn recv_grant(q: usize, nqps: usize) -> Grant {
    if q >= nqps { Grant::Read } else { Grant::Write }
}

/// Registered memory the core reads or writes by u64 word: the FIFO and size records the peer's
/// NIC writes, the staging areas the local NIC reads.
pub trait Words {
    fn load(&self, word: usize) -> u64;
    fn store(&self, word: usize, v: u64);
    /// The address of `word`, for a work request.
    fn addr(&self, word: usize) -> u64;
    /// Its local key on member port `member` of the comm.
    fn lkey(&self, member: usize) -> u32;
}

/// Where the core's work requests go: QP `qp` of the comm (index `nqps` is the flush QP).
pub trait Post {
    fn send(&mut self, qp: usize, wrs: &[SendWr]) -> Result<()>;
    fn recv(&mut self, qp: usize, wr_id: u64) -> Result<()>;
    /// A precise monotonic clock, read only where placement needs it (see
    /// [`SendCore::stamp`]); without one, placement sees no time pass.
    fn now(&self) -> Duration {
        Duration::ZERO
    }
    /// Lane repair: replaces lane `qp`'s queue pair with a new one, in INIT. The old one is
    /// gone, and its posted work with it (completions of that work may still be polled). The
    /// new QP's number, for the peer.
    fn fresh(&mut self, qp: usize) -> Result<u32>;
    /// Lane repair: connects lane `qp`'s new queue pair to the peer's QP `peer` (RTR, then
    /// RTS), sending from PSN `psns.0` and expecting `psns.1`.
    fn join(&mut self, qp: usize, peer: u32, psns: (u32, u32)) -> Result<()>;
    /// A fence: moves lane `qp`'s queue pair to the error state, so that nothing more of it
    /// lands here or at the peer; its posted work, receives included, completes as flushed.
    fn fence(&mut self, qp: usize) -> Result<()>;
}

/// A local buffer registered for a transfer: its address range, keys, and whether the CPU may
/// touch it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Buf {
    pub addr: u64,
    pub size: u64,
    /// Its keys on each member port of the comm.
    pub lkeys: Keys,
    pub rkeys: Keys,
    /// Registered as host memory. Only then may its bytes go inline (the provider copies
    /// inline data with the CPU at post time): GPU memory, registered through peer memory or
    /// dma-buf, faults when the CPU reads it, so only the NIC ever touches it.
    pub host: bool,
}

/// One buffer descriptor the receiver writes into the sender's FIFO.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cts {
    pub addr: u64,
    pub size: u64,
    /// The buffer's key on each of the receiver's member ports: a lane writes with the key of
    /// the member its far end is on.
    pub rkeys: Keys,
    pub tag: i32,
    /// Buffers in this (multi-)receive; the same in every entry of the row.
    pub nreqs: u8,
    /// The receiver asks for no completion (an optional receive, always alone in its row).
    pub optional: bool,
    /// `head + 1` of the receive: tells a fresh entry from last wrap's.
    pub idx: u64,
}

/// Where entry `r` of `slot`'s row starts in the FIFO and the staging area, in words.
pub fn entry_word(slot: usize, r: usize) -> usize {
    match r {
        0 => slot * ENTRY_WORDS,
        r => (SLOTS + slot * (MAX_RECVS - 1) + r - 1) * ENTRY_WORDS,
    }
}

impl Cts {
    /// The entry's words: address, size, the keys two to a word, the tag, two spare words,
    /// and last `idx` (48 bits, enough for 10^14 receives) with the buffer count and the
    /// optional flag, which lands last, as the sender checks it to see a landed entry.
    pub fn encode(&self) -> [u64; ENTRY_WORDS] {
        let k = |i: usize| u64::from(self.rkeys[i]) | u64::from(self.rkeys[i + 1]) << 32;
        [
            self.addr,
            self.size,
            k(0),
            k(2),
            u64::from(self.tag as u32),
            0,
            0,
            u64::from(self.nreqs) | if self.optional { CTS_OPTIONAL } else { 0 } | self.idx << 16,
        ]
    }

    pub fn decode(w: [u64; ENTRY_WORDS]) -> Cts {
        Cts {
            addr: w[0],
            size: w[1],
            rkeys: [w[2] as u32, (w[2] >> 32) as u32, w[3] as u32, (w[3] >> 32) as u32],
            tag: w[4] as u32 as i32,
            nreqs: w[7] as u8,
            optional: w[7] & CTS_OPTIONAL != 0,
            idx: w[7] >> 16,
        }
    }

    /// Reads entry `r` of `slot`: the word with `idx` first, then the rest, so that an entry
    /// whose `idx` is current is never paired with last wrap's fields (the peer's write lands
    /// in order, and each load is an acquire).
    fn read(fifo: &impl Words, slot: usize, r: usize) -> Cts {
        let base = entry_word(slot, r);
        let last = fifo.load(base + ENTRY_WORDS - 1);
        Cts::decode(std::array::from_fn(|i| {
            if i + 1 < ENTRY_WORDS { fifo.load(base + i) } else { last }
        }))
    }
}

/// A registered area of the peer's: its address and its key on each of the peer's member
/// ports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkeys: Keys,
}

impl Remote {
    /// `(address, key)` of word `word` of it, as reached through the peer's member `member`.
    fn at(&self, word: usize, member: usize) -> (u64, u32) {
        (self.addr + (word * 8) as u64, self.rkeys[member])
    }
}

/// The lanes (QP indices) a slot's message uses.
pub fn lanes(split: bool, nqps: usize, slot: usize) -> std::ops::Range<usize> {
    if split { 0..nqps } else { slot % nqps..slot % nqps + 1 }
}

/// The byte range `(offset, len)` of a `size`-byte buffer that lane `q` of `nqps` carries:
/// 128-byte-aligned equal chunks in split mode, everything otherwise.
pub fn lane_part(size: u64, split: bool, nqps: usize, q: usize) -> (u64, u64) {
    if !split || nqps == 1 {
        return (0, size);
    }
    let chunk = size.div_ceil(nqps as u64).next_multiple_of(128);
    let off = (q as u64 * chunk).min(size);
    (off, (off + chunk).min(size) - off)
}

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
fn remote_status(status: u32) -> bool {
    matches!(status, 7 | 9 | 10 | 11 | 12 | 13 | 15 | 16 | 20)
}

/// The hint attached to a failed completion.
fn hint(status: u32) -> &'static str {
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

/// The bits of `n` lanes (or chunks): the first `n`.
fn lanes_mask(n: usize) -> u128 {
    u128::MAX >> (MAX_CHUNKS - n)
}

/// The first lane set in `alive`, of `n` (the last, if none is).
fn first_live(alive: u128, n: usize) -> usize {
    (alive.trailing_zeros() as usize).min(n - 1)
}

/// The WARN for lane `lane` of `what` (the send comm to ..., the receive comm from ...), whose
/// path failed with completion `c`; `then` says what moves where.
fn lane_warning(path: &Path, what: &str, lane: usize, why: &str, then: &str) -> String {
    let sport = path.sports.get(lane).map_or(String::new(), |p| format!(" (UDP source port {p})"));
    let port = path.ports.get(lane).map_or(String::new(), |p| format!(" on {p}"));
    format!(
        "lane {lane}{port}{sport} of {what} failed: {why} on {}; {then}, and the comm goes on. \
         Check the link or ECMP member on that path: the port's link, a switch port, cable or \
         hash bucket that drops this source port",
        path.describe
    )
}

/// A signaled zero-length RDMA write on lane `lane` (a liveness probe, or the probe of a
/// rebuilt lane): `target` is a region of the peer's this comm may write; no key is checked.
fn zero_write(kind: u64, (lane, life): (usize, u8), target: (u64, u32)) -> SendWr {
    SendWr {
        wr_id: tagged(wr_id(kind, lane, 0), life),
        signaled: true,
        remote_addr: target.0,
        rkey: target.1,
        ..SendWr::default()
    }
}

/// Stores `m` in the mailbox at word `word` of `stage`, and returns the signaled write of it
/// into the same words of the peer's `target` area, on lane `lane` (lane repair's requests
/// and answers).
fn mail_wr(
    m: mend::Msg,
    stage: &impl Words,
    word: usize,
    (lane, life, (local, remote)): (usize, u8, (usize, usize)),
    target: &Remote,
    max_inline: u32,
) -> SendWr {
    for (i, w) in m.encode().into_iter().enumerate() {
        stage.store(word + i, w);
    }
    let len = (mend::MAIL_WORDS * 8) as u32;
    let (remote_addr, rkey) = target.at(word, remote);
    SendWr {
        wr_id: tagged(wr_id(WR_MAIL, lane, 0), life),
        op: Op::Write,
        signaled: true,
        local: Some((stage.addr(word), len, stage.lkey(local))),
        remote_addr,
        rkey,
        inline: len <= max_inline,
    }
}

/// The message in the mailbox at word `word` of `area`, if one is whole there.
fn mail(area: &impl Words, word: usize) -> Option<mend::Msg> {
    mend::Msg::decode(std::array::from_fn(|i| area.load(word + i)))
}

/// `IBV_WC_WR_FLUSH_ERR`.
const FLUSHED: u32 = 5;

/// `IBV_WC_LOC_QP_OP_ERR`: the queue pair could not execute a request (on Soft-RoCE, what
/// every request of a port whose link is down gets).
const LOCAL_QP_ERROR: u32 = 2;

/// A failed completion that is its lane's failure, not the comm's: retries exhausted
/// (`IBV_WC_RETRY_EXC_ERR`: the path stopped answering), a local queue-pair error (its port
/// went down, or the QP broke on its own), or flushed (the first failed completion of a lane
/// that is flushed: its QP failed on its own, see `lane_failed`).
fn lane_status(status: u32) -> bool {
    status == 12 || status == LOCAL_QP_ERROR || status == FLUSHED
}

/// Why a completion failed a lane, for its WARN.
fn completion_why(c: &Completion) -> String {
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
struct Watchdog {
    outstanding: usize,
    /// Completions taken in so far, and how many there were when `since` was set.
    completions: u64,
    seen: u64,
    /// When the watchdog last saw progress (or work start) while work was outstanding.
    since: Option<Duration>,
    timeout: Duration,
}

impl Watchdog {
    fn new(timeout: Duration) -> Watchdog {
        Watchdog { outstanding: 0, completions: 0, seen: 0, since: None, timeout }
    }

    fn posted(&mut self) {
        self.outstanding += 1;
    }

    fn completed(&mut self, all_done: bool) {
        self.completions += 1;
        if all_done {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }

    fn check(&mut self, now: Duration, path: &Path) -> Option<String> {
        if self.outstanding == 0 {
            self.since = None;
            return None;
        }
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

/// What a comm moved, for its statistics: messages, bytes, and per QP the chunks, the failed
/// completions, and (the sender's) bytes posted and the path's measured rate.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    pub messages: u64,
    /// The sender's bytes posted on each QP (chunks sent again count again); the receiver's
    /// stay 0: it cannot tell how the sender cut a message.
    pub bytes: Vec<u64>,
    /// The receiver's bytes delivered (the sender's stay 0).
    pub delivered: u64,
    /// Chunks posted on (sender) or arrived on (receiver, counted once) each QP.
    pub chunks: Vec<u64>,
    pub errors: Vec<u64>,
    /// The sender's estimate of each QP's path: bytes per second retired while busy.
    pub rate: Vec<Option<f64>>,
    /// The lanes out now (their path or queue pair failed), those that stay out (every repair
    /// attempt failed, or repair is off), and how often each was repaired.
    pub down: Vec<bool>,
    pub kept_out: Vec<bool>,
    pub repaired: Vec<u64>,
    /// The sender's fences of each lane: failures after which the receiver said which of the
    /// lane's chunks in flight it had counted.
    pub fenced: Vec<u64>,
    /// Each lane's stalls: it completed nothing for its stall bound while another lane did,
    /// or its port went down, and it was fenced ([`stall`]).
    pub stalled: Vec<u64>,
    /// The sender's bytes posted on each lane by the size of their message: under 64 KiB,
    /// under 1 MiB, and larger ([`size_class`]).
    pub by_size: Vec<[u64; 3]>,
}

/// The size class of a message of `bytes` for [`Traffic::by_size`].
pub fn size_class(bytes: u64) -> usize {
    match bytes {
        0..0x1_0000 => 0,
        0x1_0000..0x10_0000 => 1,
        _ => 2,
    }
}

impl Traffic {
    fn new(nqps: usize) -> Traffic {
        Traffic {
            messages: 0,
            bytes: vec![0; nqps],
            delivered: 0,
            chunks: vec![0; nqps],
            errors: vec![0; nqps],
            rate: vec![None; nqps],
            down: vec![false; nqps],
            kept_out: vec![false; nqps],
            repaired: vec![0; nqps],
            fenced: vec![0; nqps],
            stalled: vec![0; nqps],
            by_size: vec![[0; 3]; nqps],
        }
    }

    /// Bytes moved: the sender's posted, or the receiver's delivered.
    pub fn total(&self) -> u64 {
        self.bytes.iter().sum::<u64>() + self.delivered
    }
}

/// When to probe a quiet peer: after `interval` of waiting with no completion at all.
struct Prober {
    interval: Duration,
    /// Completions seen so far, and when (and at which count) the current quiet spell began.
    activity: u64,
    quiet: Option<(Duration, u64)>,
    /// The lanes with a probe in flight (one round at a time).
    out: u128,
}

impl Prober {
    /// Whether to post a probe now: waiting, quiet for `interval`, none in flight.
    fn due(&mut self, now: Duration, waiting: bool, interval: Duration) -> bool {
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
struct Health {
    fatal: Option<Fault>,
    /// Per lane: its life, tagged into every work request posted on it ([`tagged`]).
    life: Vec<u8>,
    watchdog: Watchdog,
    prober: Prober,
    stall: stall::Stall,
    /// A stall wants a witness: the next probe goes out at once, on each live lane with none
    /// in flight, whatever else is in flight.
    witness: bool,
    /// Our member ports whose link is down (bit `m` for member `m`): their lanes are fenced.
    ports_down: u64,
    path: Path,
    traffic: Traffic,
    /// Our member ports whose link is down, named (`rxe1 port 1`): a local queue-pair error
    /// is then the network's failure, not ours.
    links_down: Option<String>,
}

impl Health {
    fn new(p: &Params) -> Health {
        Health {
            traffic: Traffic::new(p.nqps),
            links_down: None,
            fatal: None,
            life: vec![0; p.nqps],
            watchdog: Watchdog::new(p.progress_timeout),
            prober: Prober { interval: p.probe_interval, activity: 0, quiet: None, out: 0 },
            // A lane fenced for a stall may have been slow, not dead: only repair brings it
            // back, so without repair only the retry bound takes a lane out.
            stall: stall::Stall::new(p.nqps, p.stall.filter(|_| p.repair.attempts > 0)),
            witness: false,
            ports_down: 0,
            path: p.path.clone(),
        }
    }
}

impl Health {
    fn check(&self) -> Result<()> {
        self.fatal.as_ref().map_or(Ok(()), |f| Err(f.error()))
    }

    /// Records `f` unless the comm already failed; returns the comm's (first) error.
    fn fail(&mut self, f: Fault) -> Error {
        self.fatal.get_or_insert(f).error()
    }

    /// A post that failed leaves the queue pairs in an unknown state: the comm is unusable
    /// from now on, and every request still pending fails with this error.
    fn post_failed(&mut self, e: Error) -> Error {
        let f = Fault::Local(format!(
            "{e} (posting work to {}); the connection is unusable from now on",
            self.path.peer
        ));
        self.fail(f)
    }

    /// Records the first failed completion; `true` if `c` succeeded. A probe's completion is
    /// taken here too.
    fn completion(&mut self, c: &Completion) -> bool {
        self.prober.activity += 1;
        let probe = wr_kind(c.wr_id) == WR_PROBE;
        if c.status == 0 && wr_kind(c.wr_id) != WR_FLUSH {
            self.stall.completed(wr_lane(c.wr_id));
        }
        if c.status != 0
            && let Some(e) = self.traffic.errors.get_mut(wr_lane(c.wr_id))
        {
            *e += 1;
        }
        if probe {
            self.prober.out &= !(1u128 << (wr_lane(c.wr_id) % MAX_CHUNKS));
            self.watchdog.completed(true);
        }
        if c.status != 0 && self.fatal.is_none() {
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
        c.status == 0 && !probe
    }

    /// Posts a zero-length RDMA write to the peer on each of `lanes` (the live ones with room)
    /// when one is due: every path is checked at once, so a dead peer fails the comm within one
    /// retry bound however many lanes it has, and a dead path is found even while its lane is
    /// idle. `target` is a region of the peer's this comm may write (a zero-length write
    /// checks no key anyway). A stall's witness is probed for at once ([`Self::stalled`]). The
    /// lanes probed.
    fn probe(
        &mut self,
        now: Duration,
        (waiting, soon): (bool, bool),
        io: &mut impl Post,
        (lanes, target): (u128, impl Fn(usize) -> (u64, u32)),
    ) -> Result<u128> {
        let witness = std::mem::take(&mut self.witness);
        let lanes = lanes & !self.prober.out;
        // Soon: a sender that waits for a CTS probes after the stall bound's floor, so that a
        // silent path under the receiver's CTS rows is found by its probe stalling.
        let interval = match self.stall.floor() {
            Some(floor) if soon => floor.min(self.prober.interval),
            _ => self.prober.interval,
        };
        if self.fatal.is_some()
            || lanes == 0
            || !(witness || self.prober.due(now, waiting, interval))
        {
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
    fn lane_lost(&mut self, lane: usize) {
        self.stall.reset(lane);
        self.traffic.errors[lane] += 1;
        self.traffic.down[lane] = true;
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
    fn stalled(
        &mut self,
        now: Duration,
        (busy, live, on_down): (u128, u128, u128),
        allowance: impl Fn(usize) -> Duration,
    ) -> Option<(usize, String)> {
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
                         completed (its stall bound: {} ms, FERROCE_LANE_STALL_MS)",
                        s.waited.as_millis(),
                        s.witness,
                        s.bound.as_millis()
                    ),
                ),
            }
        };
        self.traffic.stalled[lane] += 1;
        Some((lane, why))
    }

    /// The live lanes whose member port's link is down.
    fn on_down(&self, alive: u128, members: &[(usize, usize)]) -> u128 {
        let down = members.iter().enumerate().filter(|(_, m)| self.ports_down & (1 << m.0) != 0);
        down.fold(0u128, |m, (q, _)| m | 1 << q) & alive
    }

    /// After a poll found the CQ empty at `now`: the watchdog, and a failure from elsewhere
    /// (the device, or an async error on one of the comm's queues).
    fn idle(&mut self, now: Duration, elsewhere: Option<Fault>) -> Result<()> {
        if self.fatal.is_none() {
            self.fatal = self.watchdog.check(now, &self.path).map(Fault::Remote).or(elsewhere);
        }
        self.check()
    }
}

/// The newest CTS row that has landed in `fifo`: it moves only while the receiving comm is
/// called (its `irecv` writes the rows).
fn newest_row(fifo: &impl Words) -> u64 {
    (0..SLOTS).map(|k| Cts::read(fifo, k, 0).idx).max().unwrap_or(0)
}

/// The live lanes with a signaled request outstanding: those that expect a completion.
fn busy_lanes(alive: u128, sq: &[SqCount]) -> u128 {
    let busy = sq.iter().enumerate().filter(|(_, c)| !c.signaled.is_empty());
    busy.fold(0, |m, (q, _)| m | 1 << q) & alive
}

/// A growing chain of work requests for one QP, posted in batches of `MAX_CHAIN` and counted
/// in the QP's send queue.
struct Chain<'a> {
    qp: usize,
    /// The comm's own buffer, reused by every post: nothing is initialised per post.
    wrs: &'a mut [SendWr; MAX_CHAIN],
    sq: &'a mut SqCount,
    len: usize,
}

impl<'a> Chain<'a> {
    fn new(qp: usize, wrs: &'a mut [SendWr; MAX_CHAIN], sq: &'a mut SqCount) -> Chain<'a> {
        Chain { qp, wrs, sq, len: 0 }
    }

    fn push(&mut self, io: &mut impl Post, wr: SendWr) -> Result<()> {
        if self.len == MAX_CHAIN {
            self.flush(io)?;
        }
        self.wrs[self.len] = wr;
        self.len += 1;
        Ok(())
    }

    fn last(&mut self) -> Option<&mut SendWr> {
        self.len.checked_sub(1).map(|i| &mut self.wrs[i])
    }

    fn flush(&mut self, io: &mut impl Post) -> Result<()> {
        io.send(self.qp, &self.wrs[..self.len])?;
        for w in &self.wrs[..self.len] {
            self.sq.posted(1, w.signaled);
        }
        self.len = 0;
        Ok(())
    }
}

/// The fixed parameters of one end of a connection.
#[derive(Clone, Debug)]
pub struct Params {
    pub nqps: usize,
    pub split: bool,
    /// Largest single work request (the port's `max_msg_sz`).
    pub max_msg: u64,
    /// Largest inline payload the QPs accept (`max_inline_data`).
    pub max_inline: u32,
    pub progress_timeout: Duration,
    /// Probe a quiet peer after this long (`FERROCE_PROBE_INTERVAL_MS`).
    pub probe_interval: Duration,
    /// The most unsignaled data bytes in a row on a lane ([`MARK_BYTES`]), so that a long
    /// message on a slow link shows progress instead of looking like a dead peer.
    pub mark: u64,
    /// Place work by the lanes' measured cost (`FERROCE_PATH_AWARE`), else strict rotation
    /// and equal chunks.
    pub path_aware: bool,
    /// Messages of this many bytes and up are timed for placement ([`TIMED_FROM`]).
    pub timed_from: u64,
    /// Lane repair (`NCCL_IB_RESILIENCY_PORT_RECOVERY_*`).
    pub repair: Repair,
    pub path: Path,
    /// Per lane, the member ports it runs between: `(ours, the peer's)`, indices into the
    /// keys of [`Buf`], [`Cts`], [`Remote`] and [`Words::lkey`].
    pub members: Vec<(usize, usize)>,
    /// Journal what is posted for each request ([`Posted`]), for profiler events.
    pub journal: bool,
    /// A failed lane hands its work to the others (`NCCL_IB_RESILIENCY_PORT_FAILOVER`); else
    /// its failure fails the comm.
    pub failover: bool,
    /// The floor of a lane's stall bound (`FERROCE_LANE_STALL_MS`; `None`: off).
    pub stall: Option<Duration>,
}

/// One request's work in one post, journaled for profiler events (only with
/// [`Params::journal`]): the request's key (`slot * MAX_RECVS + buffer`), the post's work
/// request id, whether its last write carries the immediate, its lane, and the request's bytes
/// in it. The sender journals each chunk of each send; the receiver each CTS write of each
/// buffer's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Posted {
    pub key: usize,
    pub wr_id: u64,
    pub imm: bool,
    pub lane: usize,
    pub len: u64,
}

// --- the sender ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct SendReq {
    state: State,
    size: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct SendSlot {
    /// Bitmask of the entries matched by an `isend`.
    matched: u8,
    /// The sends matched so far, by entry; kept until the slot completes, so that a chunk can
    /// be sent again.
    bufs: [Option<Buf>; MAX_RECVS],
    /// The row they answer, likewise kept.
    row: [Cts; MAX_RECVS],
    nreqs: u8,
    /// Chunks posted whose final completion has not arrived yet.
    pending: u128,
    /// Chunks left empty (their lane is dead or avoided): the others share the bytes.
    empty: u128,
}

/// The sending end's protocol state.
pub struct SendCore {
    reqs: [SendReq; SLOTS * MAX_RECVS],
    slots: [SendSlot; SLOTS],
    /// Slots fully posted so far; the next slot is `head % SLOTS`.
    head: u64,
    p: Params,
    /// Where the receiver's size records are.
    remote_sizes: Remote,
    /// Per lane: its send queue, counted.
    sq: Vec<SqCount>,
    /// Per slot and chunk: the lane that carries it now.
    chunk_lane: Vec<u8>,
    /// The lanes whose path still answers (bit `q` for lane `q`).
    alive: u128,
    /// Chunks to send again on a live lane: their lane failed before they completed, and the
    /// receiver's receipts say it did not count them. In row order.
    resend: VecDeque<(usize, usize)>,
    /// Lanes that failed and wait for their fence: their chunks in flight are held (left
    /// pending on the lane) until the receiver says which of them it counted ([`Self::settle`]).
    unfenced: u128,
    /// The fence asked and not yet answered: its request number, its lane, the lane it was
    /// asked through, and when.
    fence: Option<(u16, usize, usize, Duration)>,
    /// Where [`Self::live_lane`] looks for the next live lane.
    spread: usize,
    /// The lane of the optional rows in flight, and how many there are ([`Self::ll_lane`]).
    ll: (usize, usize),
    /// Per lane: its chunks in flight and measured rate.
    lanes: Vec<place::Lane>,
    /// The repair of failed lanes.
    mend: mend::Mend,
    /// The precise time of the last timed post or batch of completions (path-aware with
    /// several lanes only; else never read), and the state of the lane draw.
    clock: Option<Duration>,
    draw: u64,
    /// The last isend found no CTS for its slot: the sender waits on the receiver.
    wants_cts: bool,
    /// Split mode's NIC, as placement times it.
    nic: place::Nic,
    /// Posted slots whose completions have not all arrived (kept, not scanned for, because
    /// every empty poll asks).
    in_flight: usize,
    /// Where chains are built before posting.
    chain: Box<[SendWr; MAX_CHAIN]>,
    health: Health,
    /// A send of this comm was truncated (reported once).
    truncated: bool,
    /// Warnings for the log not yet taken: the first truncation, each lane that failed.
    warnings: VecDeque<Line>,
    /// What was posted, for profiler events (only with [`Params::journal`]).
    journal: Vec<Posted>,
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
            slots: [SendSlot::default(); SLOTS],
            head: 0,
            remote_sizes,
            sq: (0..p.nqps).map(|_| SqCount::new(SEND_QUEUE)).collect(),
            chunk_lane: vec![0; SLOTS * p.nqps],
            alive: lanes_mask(p.nqps),
            resend: VecDeque::new(),
            unfenced: 0,
            fence: None,
            spread: 0,
            ll: (0, 0),
            lanes: (0..p.nqps).map(|_| place::Lane::new()).collect(),
            mend: mend::Mend::new(p.nqps, p.repair),
            clock: None,
            draw: 0x9e37_79b9_7f4a_7c15,
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
    pub fn take_line(&mut self) -> Option<Line> {
        self.warnings.pop_front()
    }

    /// What was posted since the last look (empty unless [`Params::journal`]); the caller
    /// drains it.
    pub fn journal(&mut self) -> &mut Vec<Posted> {
        &mut self.journal
    }

    /// The first live lane: the one for probes and mailbox requests.
    fn control_lane(&self) -> usize {
        first_live(self.alive, self.p.nqps)
    }

    /// The lane for optional rows: the one their rows in flight are on while it lives, else the
    /// control lane. All of them ride one lane, in row order, so that the ack word's high-water
    /// mark is the last row whose data landed (a rejoining lane 0 must not take new rows while
    /// older ones are still in flight on another).
    fn ll_lane(&mut self) -> usize {
        if self.ll.1 == 0 || self.alive & (1 << self.ll.0) == 0 {
            self.ll.0 = self.control_lane();
        }
        self.ll.0
    }

    /// Lane `q` if it lives; else a live lane, taken in turn, so that the chunks of dead
    /// lanes spread evenly over the live ones.
    fn live_lane(&mut self, q: usize) -> usize {
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
    fn places(&self) -> bool {
        self.p.path_aware && self.p.nqps > 1
    }

    /// Whether completions about to be polled want the clock: a timed chunk is in flight.
    pub fn needs_clock(&self) -> bool {
        self.places() && self.lanes.iter().any(place::Lane::timing)
    }

    /// The post time of chunks about to be posted: the clock, read now, if they are `worth`
    /// timing and placement measures; else [`place::UNTIMED`].
    fn timestamp(&mut self, io: &impl Post, worth: bool) -> Duration {
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
    fn whole_lane(&mut self, slot: usize, bytes: u64) -> usize {
        let rotation = self.live_lane(slot % self.p.nqps);
        let live = self.alive.count_ones() as u64;
        if !self.p.path_aware || live < 2 {
            return rotation;
        }
        // xorshift64: the k-th live lane other than the rotation's.
        self.draw ^= self.draw << 13;
        self.draw ^= self.draw >> 7;
        self.draw ^= self.draw << 17;
        let k = (self.draw % (live - 1)) as usize;
        let other = (0..self.p.nqps)
            .filter(|&q| q != rotation && self.alive & (1 << q) != 0)
            .nth(k)
            .unwrap_or(rotation);
        let now = self.clock.unwrap_or_default();
        place::choose(&self.lanes, self.alive, now, (rotation, other), bytes)
    }

    /// The lane for chunk `c` of a split message: its own, unless that lane is dead or its
    /// chunk empty; then a lane whose chunk is not, taken in turn.
    fn split_lane(&mut self, slot: usize, c: usize) -> usize {
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
    fn plan(&mut self, slot: usize, optional: bool) {
        let split = self.p.split && !optional;
        let now = self.clock.unwrap_or_default();
        self.slots[slot].empty = if split && self.p.path_aware {
            place::avoided(&self.lanes, self.alive, now) & lanes_mask(self.p.nqps)
        } else {
            0
        };
    }

    /// The byte range `(offset, len)` of a `size`-byte buffer that chunk `c` of slot `slot`
    /// carries: the equal split over the chunks that are not empty.
    fn part(&self, slot: usize, size: u64, split: bool, c: usize) -> (u64, u64) {
        let (n, empty) = (self.p.nqps, self.slots[slot].empty);
        if !split || empty == 0 {
            return lane_part(size, split, n, c);
        }
        if empty & (1 << c) != 0 {
            return (0, 0);
        }
        let full = lanes_mask(n) & !empty;
        let before = (full & ((1u128 << c) - 1)).count_ones() as usize;
        lane_part(size, true, full.count_ones() as usize, before)
    }

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
        self.check()?;
        self.resend(stage, io)?;
        if self.unfenced != 0 || !self.resend.is_empty() {
            // Held and re-sent chunks go first: an optional row's data and ack must follow
            // those of every earlier row.
            return Ok(None);
        }
        let slot = (self.head % SLOTS as u64) as usize;
        let want = self.head + 1;
        let first = Cts::read(fifo, slot, 0);
        self.wants_cts = first.idx != want;
        if self.wants_cts {
            return Ok(None);
        }
        let nreqs = usize::from(first.nreqs);
        if !(1..=MAX_RECVS).contains(&nreqs) {
            let peer = &self.p.path.peer;
            return Err(self.health.fail(Fault::Remote(format!(
                "{peer} sent a CTS with {nreqs} buffers: its memory is corrupt or it is not \
                 a ferroce peer; the connection is unusable from now on"
            ))));
        }
        let mut row = [first; MAX_RECVS];
        for (r, e) in row.iter_mut().enumerate().take(nreqs).skip(1) {
            *e = Cts::read(fifo, slot, r);
            if e.idx != want {
                return Ok(None); // the rest of the row is still landing
            }
        }
        // A fresh slot must not still hold requests NCCL has not yet seen complete.
        let s = &self.slots[slot];
        let range = slot * MAX_RECVS..(slot + 1) * MAX_RECVS;
        if s.matched == 0 && self.reqs[range].iter().any(|r| r.state != State::Free) {
            return Ok(None);
        }
        let Some(r) = (0..nreqs).find(|&r| s.matched & (1 << r) == 0 && row[r].tag == tag) else {
            return Ok(None);
        };
        // A send larger than its receive is cut to the receive's size, as NCCL's transport
        // does; the first of a comm is reported (once: a mismatch repeats every step).
        let mut buf = buf;
        if buf.size > row[r].size {
            if !self.truncated {
                self.truncated = true;
                self.warnings.push_back(Line::Warn(format!(
                    "send of {} bytes (tag {tag}) to {} is larger than the posted receive of {} \
                     bytes: truncated to {} bytes, as NCCL's own transport does (a size mismatch \
                     between the ranks' calls; later truncations on this comm are not reported)",
                    buf.size, self.p.path.peer, row[r].size, row[r].size
                )));
            }
            buf.size = row[r].size;
        }
        let last = s.matched.count_ones() as usize + 1 == nreqs;
        let mut bufs = s.bufs;
        bufs[r] = Some(buf);
        let optional = nreqs == 1 && row[0].optional;
        if last {
            self.plan(slot, optional);
            if !self.fits(slot, &bufs[..nreqs], optional) {
                return Ok(None);
            }
        }
        let id = slot * MAX_RECVS + r;
        self.reqs[id] = SendReq { state: State::Pending, size: buf.size };
        self.health.traffic.messages += 1;
        let s = &mut self.slots[slot];
        s.matched |= 1 << r;
        s.bufs = bufs;
        if last {
            if let Err(e) = self.post(stage, io, slot, &row[..nreqs]) {
                // Never handed out; the row's earlier requests fail with the comm.
                self.reqs[id] = SendReq::default();
                return Err(self.health.post_failed(e));
            }
            self.head += 1;
        }
        Ok(Some(id))
    }

    /// Work requests chunk `c` of slot `slot` needs for `bufs` (data pieces, then the size
    /// record and the immediate, or the ack).
    fn wrs_for(&self, slot: usize, bufs: &[Option<Buf>], split: bool, c: usize) -> u64 {
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
    /// (which may carry it instead).
    fn fits(&self, slot: usize, bufs: &[Option<Buf>], optional: bool) -> bool {
        let (split, n) = if optional {
            (false, 1)
        } else {
            (self.p.split, lanes(self.p.split, self.p.nqps, slot).len())
        };
        let most = (0..n).map(|c| self.wrs_for(slot, bufs, split, c)).max().unwrap_or(0);
        let live = (0..self.p.nqps).filter(|&q| self.alive & (1 << q) != 0);
        // Once lanes failed a live lane may take several chunks of the slot: all of them.
        let per_lane =
            if self.alive.count_ones() as usize == self.p.nqps { most } else { most * n as u64 };
        live.into_iter().all(|q| self.sq[q].fits(per_lane))
    }

    /// Posts the slot's chunks: chunk `c` of a split message (or the whole message, chunk 0)
    /// on its lane, or on the next live one where that lane failed.
    fn post(
        &mut self,
        stage: &impl Words,
        io: &mut impl Post,
        slot: usize,
        row: &[Cts],
    ) -> Result<()> {
        let nreqs = row.len();
        let s = &mut self.slots[slot];
        s.row[..nreqs].copy_from_slice(row);
        s.nreqs = nreqs as u8;
        s.matched = 0;
        let bufs = s.bufs;
        let sizes: [u64; MAX_RECVS] = std::array::from_fn(|r| bufs[r].map_or(0, |b| b.size));
        let optional = nreqs == 1 && row[0].optional;
        if !optional && size_in_imm(&sizes[..nreqs]).is_none() {
            for (r, &sz) in sizes.iter().enumerate().take(nreqs) {
                stage.store(slot * MAX_RECVS + r, sz);
            }
        }
        // Only messages of `timed_from` bytes and up are timed: a clock read may cost microseconds
        // (in a VM), which small messages would feel and their rates would not repay.
        let at = self.timestamp(io, sizes.iter().sum::<u64>() >= self.p.timed_from);
        let lanes = if optional { 0..1 } else { lanes(self.p.split, self.p.nqps, slot) };
        // A split message's chunks go out starting at a different one each time: the NIC
        // serves a post's lanes in order, and each lane should wait behind the others as
        // often as the next, or placement would read the order as path speed.
        let n = lanes.len();
        for c in (0..n).map(|k| (k + slot) % n) {
            let q = if optional {
                self.ll_lane()
            } else if self.p.split {
                self.split_lane(slot, c)
            } else {
                self.whole_lane(slot, sizes.iter().sum())
            };
            self.post_chunk(stage, io, (slot, c, q), at)?;
        }
        self.slots[slot].pending = lanes_mask(lanes.len());
        self.ll.1 += usize::from(optional);
        self.in_flight += 1;
        self.health.watchdog.posted();
        Ok(())
    }

    /// Posts chunk `c` of the slot on lane `q`, as of `at` (for placement): the data writes of
    /// its part, the size record (chunk 0, when needed), and its final write-with-immediate;
    /// or, for an optional receive, the data and the ack.
    fn post_chunk(
        &mut self,
        stage: &impl Words,
        io: &mut impl Post,
        (slot, c, q): (usize, usize, usize),
        at: Duration,
    ) -> Result<()> {
        let (nqps, max_msg, inline) = (self.p.nqps, self.p.max_msg, self.p.max_inline);
        let s = self.slots[slot];
        let nreqs = usize::from(s.nreqs);
        let row = &s.row[..nreqs];
        let optional = nreqs == 1 && row[0].optional;
        let split = self.p.split && !optional;
        let sizes: [u64; MAX_RECVS] = std::array::from_fn(|r| s.bufs[r].map_or(0, |b| b.size));
        let size = if optional { None } else { size_in_imm(&sizes[..nreqs]) };
        let single = size.is_some();
        let life = self.health.life[q];
        let (ours, theirs) = self.p.members[q];
        let id = tagged(data_wr_id(WR_SEND, q, slot, c), life);
        let parts: [(u64, u64); MAX_RECVS] = std::array::from_fn(|r| {
            s.bufs[r].map_or((0, 0), |b| self.part(slot, b.size, split, c))
        });
        let mut chain = Chain::new(q, &mut self.chain, &mut self.sq[q]);
        let mut data = 0;
        let mut unmarked = 0;
        for ((b, cts), &(off, len)) in s.bufs.iter().zip(row).zip(&parts) {
            let Some(b) = b else { continue };
            let mut done = 0;
            while done < len {
                let n = (len - done).min(max_msg);
                let at = off + done;
                unmarked += n;
                let mark = !optional && unmarked >= self.p.mark;
                if mark {
                    unmarked = 0;
                }
                chain.push(
                    io,
                    SendWr {
                        wr_id: if mark {
                            tagged(data_wr_id(WR_MARK, q, slot, c), life)
                        } else {
                            id
                        },
                        op: Op::Write,
                        signaled: mark,
                        local: Some((b.addr + at, n as u32, b.lkeys[ours])),
                        remote_addr: cts.addr + at,
                        rkey: cts.rkeys[theirs],
                        inline: b.host && n <= u64::from(inline),
                    },
                )?;
                done += n;
            }
            data += len;
        }
        if optional {
            // Every optional row's data is followed, on its lane, by the ack: its `idx` in the
            // receiver's ack word. Optional rows go on one lane in row order, so the ack's
            // high-water mark is the last row whose data landed: what a fence's receipts tell
            // the sender (NCCL's flags tell nothing to the plugin). Inline where the QP takes
            // inline data; else staged in the slot's own first size record (an optional row
            // has none), which stays as it is until the slot is reused, after this write
            // completed: a NIC that reads it late still writes this row's `idx`, not a later
            // row's, which would claim data that has not landed.
            let word = slot * MAX_RECVS;
            stage.store(word, row[0].idx);
            let (remote_addr, rkey) = self.remote_sizes.at(ACK_WORD, theirs);
            chain.push(
                io,
                SendWr {
                    wr_id: id,
                    signaled: true,
                    local: Some((stage.addr(word), 8, stage.lkey(ours))),
                    remote_addr,
                    rkey,
                    inline: 8 <= inline,
                    ..SendWr::default()
                },
            )?;
        } else {
            if !single && c == 0 {
                let len = (nreqs * 8) as u32;
                let (remote_addr, rkey) = self.remote_sizes.at(slot * MAX_RECVS, theirs);
                chain.push(
                    io,
                    SendWr {
                        wr_id: id,
                        op: Op::Write,
                        local: Some((stage.addr(slot * MAX_RECVS), len, stage.lkey(ours))),
                        remote_addr,
                        rkey,
                        inline: len <= inline,
                        ..SendWr::default()
                    },
                )?;
            }
            let imm = Imm { slot, chunk: c, epoch: epoch(row[0].idx), size }.encode();
            // The last data write carries the immediate when it can; otherwise a 0-byte one.
            match chain.last() {
                Some(w) if single && data > 0 && w.op == Op::Write => {
                    w.op = Op::WriteImm(imm);
                    w.wr_id = id;
                    w.signaled = true;
                }
                _ => chain.push(
                    io,
                    SendWr {
                        wr_id: id,
                        op: Op::WriteImm(imm),
                        signaled: true,
                        ..SendWr::default()
                    },
                )?,
            }
        }
        chain.flush(io)?;
        if self.p.journal {
            for (r, &(_, len)) in parts.iter().enumerate().take(nreqs) {
                // The immediate ends a single message's data, or is all a request without
                // bytes in this chunk gets.
                let imm = !optional && (single || len == 0);
                let key = slot * MAX_RECVS + r;
                self.journal.push(Posted { key, wr_id: id, imm, lane: q, len });
            }
        }
        self.chunk_lane[slot * nqps + c] = q as u8;
        self.lanes[q].posted(at, data);
        let t = &mut self.health.traffic;
        t.bytes[q] += data;
        t.by_size[q][size_class(sizes[..nreqs].iter().sum())] += data;
        t.chunks[q] += 1;
        Ok(())
    }

    /// Sends again, on live lanes, the chunks whose lane failed; those that do not fit wait.
    fn resend(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
        let at = self.timestamp(io, !self.resend.is_empty());
        while let Some(&(slot, c)) = self.resend.front() {
            if self.slots[slot].pending & (1 << c) == 0 {
                self.resend.pop_front();
                continue;
            }
            let s = self.slots[slot];
            let optional = s.nreqs == 1 && s.row[0].optional;
            let q = if optional {
                self.ll_lane()
            } else {
                self.live_lane(usize::from(self.chunk_lane[slot * self.p.nqps + c]))
            };
            let split = self.p.split && !optional;
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
    fn lane_failed(&mut self, lane: usize, c: &Completion) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            return true;
        }
        // IBV_WC_RETRY_EXC_ERR: the path stopped answering; IBV_WC_WR_FLUSH_ERR with no
        // failed work before it on the lane: its queue pair failed on its own, and the async
        // event saying so comes later. Anything else (the peer refused an access, our own NIC
        // failed) is not the lane's, and fails the comm as before.
        let last = self.alive & !bit == 0 || !self.p.failover;
        if !lane_status(c.status) || last || self.health.fatal.is_some() {
            return false;
        }
        self.drop_lane(lane, &completion_why(c));
        true
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
    fn drop_lane(&mut self, lane: usize, why: &str) {
        self.alive &= !(1u128 << lane);
        if self.fence.is_some_and(|f| f.2 == lane) {
            self.fence = None; // asked through this lane: asked again through a live one
        }
        self.mend.lost_via(lane); // likewise a repair request

        self.health.lane_lost(lane);
        self.lanes[lane].failed();
        let chunks = self.held(lane).count();
        if chunks > 0 {
            self.unfenced |= 1 << lane; // nothing held, nothing to settle
        }
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
                self.health.traffic.kept_out[lane] = true;
                "; it stays out (lane repair is off)".to_string()
            }
            (false, _) => {
                self.health.traffic.kept_out[lane] = true;
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

    /// The chunks in flight on lane `lane`: `(slot, chunk)`.
    fn held(&self, lane: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
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
    fn fenced(
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
        let msg = mend::Msg::Fence { lane, seq };
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let wr = mail_wr(msg, stage, SIZE_MAIL, life, &self.remote_sizes, self.p.max_inline);
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
    /// lane counts as delivered where the receiver counted it (or the receive completed, or,
    /// for an optional row, the ack word's high-water mark reached it), and goes again, in row
    /// order, otherwise. A receive that completed is never written again.
    fn settle(&mut self, lane: usize, fifo: &impl Words) {
        let acked = fifo.load(FIFO_RECEIPTS);
        let held: Vec<(usize, usize)> = self.held(lane).collect();
        let (mut landed, mut again) = (0, 0);
        for (slot, c) in held {
            let s = &self.slots[slot];
            let idx = s.row[0].idx;
            let w = FIFO_RECEIPTS + 1 + 3 * slot;
            let head = fifo.load(w);
            let got = u128::from(fifo.load(w + 1)) | u128::from(fifo.load(w + 2)) << 64;
            let (theirs, open) = (head >> 1, head & 1 == 1);
            let counted = if s.nreqs == 1 && s.row[0].optional {
                idx <= acked
            } else {
                theirs > idx || theirs == idx && (!open || got & (1 << c) != 0)
            };
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
        self.health.traffic.fenced[lane] += 1;
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
                self.health.traffic.kept_out[lane] = false;
                let again = if was_out { "out after its attempts" } else { "waiting" };
                self.warnings.push_back(Line::Info(format!(
                    "lane {lane} of the send comm to {peer} ({again}): its port is up again, it \
                     is rebuilt now"
                )));
            }
        }
    }

    /// Lane `lane`'s repair attempt failed (`why`): the next follows, or the lane stays out.
    fn attempt_failed(&mut self, lane: usize, why: &str) {
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
        self.health.traffic.kept_out[lane] = true;
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
    fn repair(&mut self, now: Duration, fifo: &impl Words, stage: &impl Words, io: &mut impl Post) {
        let rows = if self.mend.asking() { newest_row(fifo) } else { 0 };
        while let Some((lane, why)) = self.mend.tick(now, rows) {
            self.attempt_failed(lane, why);
        }
        if self.fenced(now, fifo, stage, io) {
            return;
        }
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
        self.sq[lane] = SqCount::new(SEND_QUEUE);
        let ask = mend::Msg::Ask { lane, seq, qpn };
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let ask = mail_wr(ask, stage, SIZE_MAIL, life, &target, self.p.max_inline);
        match io.send(ctl, &[ask]) {
            Ok(()) => self.sq[ctl].posted(1, true),
            Err(e) => self.attempt_failed(lane, &format!("the request was refused: {e}")),
        }
    }

    /// The probe of rebuilt lane `lane` completed (`c`): the lane rejoins, or the attempt
    /// failed.
    fn proven(&mut self, lane: usize, c: &Completion) {
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
        let t = &mut self.health.traffic;
        t.down[lane] = false;
        t.repaired[lane] += 1;
        let sport = self.p.path.sports.get(lane).copied().unwrap_or(0);
        self.warnings.push_back(Line::Info(format!(
            "lane {lane} (UDP source port {sport}) of the send comm to {} is repaired: a new \
             queue pair at both ends, proven by a probe; it carries traffic again",
            self.p.path.peer
        )));
    }

    /// Takes in one completion of the comm's CQ.
    pub fn complete(&mut self, c: &Completion) {
        let at = self.nic.taken();
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
        if self.p.split {
            self.nic.retired(&mut self.lanes[lane], at);
        } else {
            self.lanes[lane].retired(self.clock.unwrap_or_default(), Duration::ZERO);
        }
        self.chunk_done(wr_slot(c.wr_id), wr_chunk(c.wr_id));
    }

    /// Chunk `chunk` of slot `slot` is delivered: its completion arrived, or the receipts of a
    /// fence say it landed.
    fn chunk_done(&mut self, slot: usize, chunk: usize) {
        let s = &mut self.slots[slot];
        let bit = 1u128 << chunk;
        if s.pending & bit == 0 {
            return; // not this slot's: nothing of it is in flight
        }
        s.pending &= !bit;
        self.health.watchdog.completed(s.pending == 0);
        if s.pending == 0 {
            self.in_flight -= 1;
            self.ll.1 -= usize::from(s.nreqs == 1 && s.row[0].optional);
            s.bufs = [None; MAX_RECVS];
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
        for (q, l) in self.lanes.iter().enumerate() {
            self.health.traffic.rate[q] = l.rate;
        }
        // Waiting on the peer: for a CTS, for completions, or with a row half matched.
        let half = self.slots[(self.head % SLOTS as u64) as usize].matched != 0;
        let waiting = self.wants_cts || self.in_flight > 0 || half || self.unfenced != 0;
        let room = (0..self.p.nqps).filter(|&q| self.alive & (1 << q) != 0 && self.sq[q].fits(0));
        let lanes = room.fold(0u128, |m, q| m | 1 << q);
        let (target, members) = (self.remote_sizes, &self.p.members);
        let at = |q: usize| target.at(0, members[q].1);
        let probed = self.health.probe(now, (waiting, self.wants_cts), io, (lanes, at))?;
        for q in (0..self.p.nqps).filter(|&q| probed & (1 << q) != 0) {
            self.sq[q].posted(1, true);
        }
        self.health.idle(now, elsewhere)
    }

    /// Whether request `id` still waits for completions (the caller polls before [`Self::test`]).
    pub fn pending(&self, id: usize) -> bool {
        self.reqs.get(id).is_some_and(|r| r.state == State::Pending)
    }

    /// `Some(size)` once request `id` completed (the request is then free again).
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

// --- the receiver -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct RecvSlot {
    state: State,
    n: usize,
    /// The sizes the buffers were posted with: a size the peer reports must not exceed them.
    posted: [u64; MAX_RECVS],
    /// The `idx` of an optional receive: the slot is reused once the ack word reaches it.
    ack_for: u64,
    /// The receive's `idx` (`head + 1` when posted).
    idx: u64,
    /// The chunks the receive expects (one per lane of the message), and those that arrived.
    want: u128,
    got: u128,
    sizes: [u64; MAX_RECVS],
}

/// The receiving end's protocol state.
pub struct RecvCore {
    slots: [RecvSlot; SLOTS],
    flushes: [State; SLOTS],
    /// Per flush: its reads still in flight (one per member port).
    flush_left: [u8; SLOTS],
    flush_head: usize,
    head: u64,
    p: Params,
    /// Where the sender's FIFO is.
    remote_fifo: Remote,
    /// Receives waiting for their data (kept, not scanned for, because every empty poll asks).
    waiting: usize,
    /// The `idx` of the last optional receive posted: until the sender's ack word reaches it,
    /// an optional receive's data may still be missing, and the receiver waits on its peer.
    optional_idx: u64,
    /// Optional receives up to this `idx` are done (their data landed: the ack word reached
    /// them).
    optional_done: u64,
    /// Rows written to the sender's FIFO (`idx` up to this); rows after it up to `head` are
    /// staged, and go out in batches (see [`RecvCore::advertise`]).
    advertised: u64,
    /// The highest `idx` the sender is known to have consumed: its receive completed (the
    /// ack word tells the same of optional rows).
    consumed: u64,
    /// Each lane's send queue, counted exactly (only the control lane, the first live one,
    /// carries CTS rows and probes).
    sq: Vec<SqCount>,
    /// The lanes whose path still answers our CTS writes and probes.
    alive: u128,
    /// Rebuilt lanes not yet proven: they take the sender's writes (their receives are
    /// posted), but carry none of our own (no probe, no CTS row) until a receive lands on the
    /// new queue pair. Our probe of a lane whose other end is not yet joined would fail it.
    proving: u128,
    /// The lane that carries CTS rows, probes and repair answers: a live one, moved only when
    /// it fails or is rebuilt (rows that moved must not overtake each other).
    ctl: usize,
    /// The last repair or fence request taken.
    served: Option<u16>,
    /// The request being served, since when: its lane is fenced, and the answer waits until
    /// every receive posted on the lane has come back (landed or flushed), so that the
    /// receipts hold every chunk that landed.
    serving: Option<(mend::Msg, Duration)>,
    /// The ack word's high-water mark: the sender writes it in row order, but a row sent again
    /// after a fence must never move it back.
    acked: std::cell::Cell<u64>,
    /// Where batches are built before posting.
    chain: Box<[SendWr; MAX_CHAIN]>,
    /// Receive WQEs posted on each lane and not yet used.
    pool: Vec<usize>,
    /// Warnings for the log not yet taken: each lane that failed.
    warnings: VecDeque<Line>,
    health: Health,
    /// What was posted, for profiler events (only with [`Params::journal`]).
    journal: Vec<Posted>,
}

/// The work requests on one send queue, counted as a provider that frees entries only when a
/// later signaled request completes sees them: every request is held until a signaled one at
/// or after it completes. Completions of one send queue arrive in order.
struct SqCount {
    posted: u64,
    /// Requests freed so far: everything up to the last signaled one that completed.
    freed: u64,
    /// The sequence numbers (`posted` after them) of the signaled requests not yet completed.
    signaled: VecDeque<u64>,
    depth: u64,
}

impl SqCount {
    fn new(depth: usize) -> SqCount {
        SqCount {
            posted: 0,
            freed: 0,
            signaled: VecDeque::with_capacity(depth),
            depth: depth as u64,
        }
    }

    fn used(&self) -> u64 {
        self.posted - self.freed
    }

    /// Whether `n` more requests fit, one entry always kept for a liveness probe.
    fn fits(&self, n: u64) -> bool {
        self.used() + n < self.depth
    }

    /// Whether the last of `n` requests about to be posted must be signaled.
    fn signal_due(&self, n: u64) -> bool {
        let last = self.signaled.back().copied().unwrap_or(self.freed);
        self.posted + n - last >= CTS_SIGNAL_EVERY
    }

    fn posted(&mut self, n: u64, signaled: bool) {
        self.posted += n;
        if signaled {
            self.signaled.push_back(self.posted);
        }
    }

    /// A signaled request completed: it and everything before it are free.
    fn completed(&mut self) {
        if let Some(seq) = self.signaled.pop_front() {
            self.freed = seq;
        }
    }
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
            optional_idx: 0,
            optional_done: 0,
            advertised: 0,
            consumed: 0,
            sq: (0..p.nqps).map(|_| SqCount::new(RECV_SEND_QUEUE)).collect(),
            alive: lanes_mask(p.nqps),
            proving: 0,
            ctl: 0,
            served: None,
            serving: None,
            acked: std::cell::Cell::new(0),
            chain: Box::new([SendWr::default(); MAX_CHAIN]),
            pool: vec![0; p.nqps],
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

    /// Whether an optional receive (or a slot its ack word holds) still waits for the sender:
    /// NCCL watches the data itself, but the comm must still notice a sender that died.
    pub fn awaits_acks(&self, sizes: &impl Words) -> bool {
        self.known_consumed(sizes) < self.optional_idx
    }

    /// Whether the comm should poll before its next call: optional receives wait on the
    /// sender's acks, or the CTS queue is half used (its entries are freed only when a poll
    /// takes a signaled completion; a caller whose receives are all optional may never poll
    /// otherwise, and its next rows would wait for room that never comes).
    pub fn needs_poll(&self, sizes: &impl Words) -> bool {
        self.awaits_acks(sizes) || self.sq[self.control_lane()].used() >= CTS_SIGNAL_EVERY
    }

    /// The highest row the sender is known to have consumed: the ack word (the sender writes
    /// it for some optional rows only), or a later receive that completed (the sender consumes
    /// rows in order).
    fn known_consumed(&self, sizes: &impl Words) -> u64 {
        let acked = self.acked.get().max(sizes.load(ACK_WORD));
        self.acked.set(acked);
        self.consumed.max(acked)
    }

    pub fn check(&self) -> Result<()> {
        self.health.check()
    }

    /// What this end has received: messages (an optional receive counts when posted, with
    /// no bytes: its size is never reported), and per QP the bytes and failed completions.
    pub fn traffic(&self) -> &Traffic {
        &self.health.traffic
    }

    /// Posts `bufs` (with their tags) as one multi-receive, staging the CTS row in `stage`.
    /// `optional`: NCCL needs no completion (honoured for a single buffer); `sizes` holds the
    /// ack word. `Ok(None)`: all slots busy (poll, test, call again).
    pub fn irecv(
        &mut self,
        stage: &impl Words,
        sizes: &impl Words,
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
        let prev = self.slots[slot];
        if prev.state != State::Free || self.known_consumed(sizes) < prev.ack_for {
            return Ok(None);
        }
        let optional = optional && n == 1;
        // Every lane keeps its pool full, so that the sender's write-with-immediate finds a
        // receive WQE on whichever lane it comes (posted before the CTS that allows it).
        if !optional {
            self.refill(io)?;
        }
        let idx = self.head + 1;
        for (r, (b, tag)) in bufs.iter().enumerate() {
            let nreqs = n as u8;
            let rkeys = b.rkeys;
            let cts = Cts { addr: b.addr, size: b.size, rkeys, tag: *tag, nreqs, optional, idx };
            let base = entry_word(slot, r);
            for (i, w) in cts.encode().into_iter().enumerate() {
                stage.store(base + i, w);
            }
        }
        let posted = std::array::from_fn(|r| bufs.get(r).map_or(0, |b| b.0.size));
        self.slots[slot] = if optional {
            // Done once its row is written to the sender: NCCL watches the data itself. The
            // size reported is the posted one.
            self.health.traffic.messages += 1;
            self.optional_idx = idx;
            let (ack_for, sizes) = (idx, posted);
            RecvSlot { state: State::Pending, n, posted, ack_for, idx, want: 0, got: 0, sizes }
        } else {
            let want = lanes_mask(lanes(self.p.split, self.p.nqps, slot).len());
            self.waiting += 1;
            let sizes = [0; MAX_RECVS];
            RecvSlot { state: State::Pending, n, posted, ack_for: 0, idx, want, got: 0, sizes }
        };
        self.head += 1;
        self.advertise(stage, io)?;
        Ok(Some(slot))
    }

    /// The lane for CTS rows, probes and repair answers.
    fn control_lane(&self) -> usize {
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
    fn lane_failed(&mut self, lane: usize, c: &Completion, sizes: &impl Words) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            self.proving &= !bit; // a rebuilt lane that failed before it was proven
            return true;
        }
        // Retries run out on our own writes; a flush (a receive's too) is the lane's queue
        // pair failing on its own, its async event still to come.
        let ours = matches!(wr_kind(c.wr_id), WR_CTS | WR_PROBE | WR_MAIL) || c.status == FLUSHED;
        let last = (self.alive | self.proving) & !bit == 0 || !self.p.failover;
        if !ours || !lane_status(c.status) || last || self.health.fatal.is_some() {
            return false;
        }
        self.drop_lane(lane, &completion_why(c), sizes);
        true
    }

    /// Lane `lane`'s queue pair failed on its own (an asynchronous error event: `why`): `true`
    /// if another lane lives (the lane's flushed work is ignored from now on), else `false`
    /// and the caller fails the comm.
    pub fn lane_error(&mut self, lane: usize, why: &str, sizes: &impl Words) -> bool {
        let bit = 1u128 << lane;
        if self.alive & bit == 0 {
            self.proving &= !bit;
            return true;
        }
        if self.alive & !bit == 0 || !self.p.failover || self.health.fatal.is_some() {
            return false;
        }
        self.drop_lane(lane, why, sizes);
        true
    }

    /// Takes lane `lane` out; where it carried the CTS rows, they go again on the next.
    fn drop_lane(&mut self, lane: usize, why: &str, sizes: &impl Words) {
        let control = lane == self.ctl;
        self.forget(lane, sizes);
        self.health.lane_lost(lane);
        let what = format!("the receive comm from {}", self.p.path.peer);
        let then = if control {
            format!("its CTS rows move to lane {}", self.ctl)
        } else {
            format!("it carried no CTS rows; they stay on lane {}", self.ctl)
        };
        self.warnings.push_back(Line::Warn(lane_warning(&self.p.path, &what, lane, why, &then)));
    }

    /// Lane `lane` is out (failed, or about to be rebuilt): its signaled work in flight will
    /// not complete, and where it carried the CTS rows, they go again on the next live lane.
    fn forget(&mut self, lane: usize, sizes: &impl Words) {
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
        self.health.prober.out &= !bit;
        if lane == self.ctl {
            // Every row the sender may not have consumed is written again (the same bytes:
            // the sender takes a row by its idx, once).
            self.advertised = self.advertised.min(self.known_consumed(sizes));
            self.ctl = first_live(self.alive, self.p.nqps);
        }
    }

    /// Serves the sender's request in the mailbox word of `sizes`, once: a fence or a repair.
    /// Either fences our end of its lane first (the queue pair to the error state: nothing
    /// more of it lands; the CTS rows move off it where another lane lives) and waits until
    /// the lane's receives have all come back, so that every chunk that landed on it is
    /// counted. Then a repair rebuilds our end (a new queue pair, connected to the sender's,
    /// its receives posted again). The answer goes through the control lane, after the
    /// receipts: what this end counted ([`Self::receipts`]).
    fn serve(
        &mut self,
        now: Duration,
        stage: &impl Words,
        sizes: &impl Words,
        io: &mut impl Post,
    ) -> Result<()> {
        if self.serving.is_none() {
            let Some(msg) = mail(sizes, SIZE_MAIL) else { return Ok(()) };
            let (mend::Msg::Ask { lane, seq, .. } | mend::Msg::Fence { lane, seq }) = msg else {
                return Ok(());
            };
            // A lane the comm does not have is a corrupt word, not a request.
            if self.served == Some(seq) || lane >= self.p.nqps {
                return Ok(());
            }
            self.served = Some(seq);
            if (self.alive | self.proving) & (1 << lane) != 0 || self.ctl == lane {
                self.forget(lane, sizes);
            }
            io.fence(lane).map_err(|e| self.health.post_failed(e))?;
            self.serving = Some((msg, now));
        }
        let Some((msg, since)) = self.serving else { return Ok(()) };
        let (mend::Msg::Ask { lane, .. } | mend::Msg::Fence { lane, .. }) = msg else {
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
        let bit = 1u128 << lane;
        let ctl =
            if self.ctl == lane { first_live(self.alive & !bit, self.p.nqps) } else { self.ctl };
        if ctl != lane && !self.sq[ctl].fits(2) {
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
        let ctl = self.ctl;
        if self.alive & (1 << ctl) == 0 {
            return Ok(()); // no lane to answer through: the sender asks again
        }
        let (ours, theirs) = self.p.members[ctl];
        self.receipts(stage, sizes);
        let (remote_addr, rkey) = self.remote_fifo.at(FIFO_RECEIPTS, theirs);
        let len = (RECEIPT_WORDS * 8) as u32;
        let receipts = SendWr {
            wr_id: tagged(wr_id(WR_MAIL, ctl, 0), self.health.life[ctl]),
            op: Op::Write,
            local: Some((stage.addr(FIFO_RECEIPTS), len, stage.lkey(ours))),
            remote_addr,
            rkey,
            inline: len <= self.p.max_inline,
            ..SendWr::default()
        };
        let life = (ctl, self.health.life[ctl], self.p.members[ctl]);
        let answer = mail_wr(answer, stage, FIFO_MAIL, life, &self.remote_fifo, self.p.max_inline);
        io.send(ctl, &[receipts, answer]).map_err(|e| self.health.post_failed(e))?;
        self.sq[ctl].posted(1, false);
        self.sq[ctl].posted(1, true);
        self.health.watchdog.posted();
        Ok(())
    }

    /// Stages what this end counted, for a fence's answer: the ack word's high-water mark,
    /// then per slot its receive's `idx << 1 | open` (still counting chunks) and the chunks
    /// counted.
    fn receipts(&self, stage: &impl Words, sizes: &impl Words) {
        self.known_consumed(sizes);
        stage.store(FIFO_RECEIPTS, self.acked.get());
        for (slot, s) in self.slots.iter().enumerate() {
            let open = s.state == State::Pending && s.ack_for == 0;
            let w = FIFO_RECEIPTS + 1 + 3 * slot;
            stage.store(w, s.idx << 1 | u64::from(open));
            stage.store(w + 1, s.got as u64);
            stage.store(w + 2, (s.got >> 64) as u64);
        }
    }

    /// Repair: replaces our end of lane `lane` with a new queue pair connected to the sender's
    /// `peer` (request `seq`), posts its receives and makes it live. Its number; `None` where
    /// it could not be built (one WARN: the sender's attempt fails).
    fn rebuild(
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
        self.pool[lane] = 0;
        if self.alive & (1 << self.ctl) == 0 {
            self.alive |= bit; // no other lane to carry the rows
            self.ctl = lane;
        } else {
            self.proving |= bit;
        }
        self.health.traffic.repaired[lane] += 1;
        self.refill(io)?;
        Ok(Some(qpn))
    }

    /// A line for the log: each lane whose path failed our CTS rows or probes, or that the
    /// sender had rebuilt.
    pub fn take_line(&mut self) -> Option<Line> {
        self.warnings.pop_front()
    }

    /// What was posted since the last look (empty unless [`Params::journal`]); the caller
    /// drains it.
    pub fn journal(&mut self) -> &mut Vec<Posted> {
        &mut self.journal
    }

    /// Posts receive WQEs until every live lane holds [`recv_pool`].
    fn refill(&mut self, io: &mut impl Post) -> Result<()> {
        let want = recv_pool(self.p.nqps);
        let open = self.alive | self.proving;
        for (q, n) in self.pool.iter_mut().enumerate() {
            while open & (1 << q) != 0 && *n < want {
                let id = tagged(wr_id(WR_RECV, q, 0), self.health.life[q]);
                io.recv(q, id).map_err(|e| self.health.post_failed(e))?;
                *n += 1;
            }
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
    fn advertise(&mut self, stage: &impl Words, io: &mut impl Post) -> Result<()> {
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
                inline: entries * ENTRY <= self.p.max_inline as usize,
            };
            let mut len = 0;
            let wrs = &mut self.chain;
            for k in 0..rows {
                let slot = (first + k) % SLOTS;
                let n = self.slots[slot].n;
                if n > 1 {
                    wrs[len] = write(entry_word(slot, 1), n - 1);
                    len += 1;
                }
            }
            let end = first + rows;
            for (lo, hi) in [(first, end.min(SLOTS)), (0, end.saturating_sub(SLOTS))] {
                if hi > lo {
                    wrs[len] = write(entry_word(lo, 0), hi - lo);
                    len += 1;
                }
            }
            let n = len as u64;
            if !self.sq[lane].fits(n) {
                return Ok(());
            }
            let signaled = self.sq[lane].signal_due(n);
            wrs[len - 1].signaled = signaled;
            io.send(lane, &wrs[..len]).map_err(|e| self.health.post_failed(e))?;
            self.sq[lane].posted(n, signaled);
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
        }
        if c.status != 0 && kind != WR_FLUSH && self.lane_failed(lane, c, sizes) {
            return;
        }
        if c.status == 0 && matches!(kind, WR_CTS | WR_PROBE | WR_MAIL) {
            self.sq[lane].completed();
        }
        if c.status == 0 && kind == WR_RECV && !stale && self.proving & (1 << lane) != 0 {
            // The sender's write landed on the rebuilt queue pair: both ends are joined.
            self.proving &= !(1 << lane);
            self.alive |= 1 << lane;
            self.health.traffic.down[lane] = false;
        }
        if !self.health.completion(c) {
            return;
        }
        let mut i = wr_slot(c.wr_id);
        match wr_kind(c.wr_id) {
            WR_RECV => {
                // The immediate names the slot and chunk.
                let q = wr_lane(c.wr_id);
                let imm = Imm::decode(c.imm.unwrap_or(0));
                i = imm.slot;
                let s = &mut self.slots[i];
                let bit = 1u128 << imm.chunk;
                // A chunk of another use of the slot, or one the slot does not expect, is not
                // counted; one sent again after its first copy landed sets its bit again.
                if s.state != State::Pending
                    || s.ack_for != 0
                    || epoch(s.idx) != imm.epoch
                    || s.want & bit == 0
                {
                    return;
                }
                if s.got & bit == 0
                    && let Some(n) = self.health.traffic.chunks.get_mut(q)
                {
                    *n += 1;
                }
                s.got |= bit;
                if s.got != s.want {
                    return;
                }
                if let Some(size) = imm.size {
                    s.sizes[0] = size;
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

    /// Optional receives whose data landed (the ack word, written after the data on the same
    /// lane, reached their row) are done. Done no earlier: NCCL stops testing a request once
    /// it is done, and a receiving comm whose LL data waits behind a fence must be called to
    /// answer it; until the data lands, NCCL's proxy keeps testing the receive.
    fn optional_landed(&mut self, sizes: &impl Words) {
        let acked = self.acked.get().max(sizes.load(ACK_WORD));
        self.acked.set(acked);
        if acked <= self.optional_done {
            return;
        }
        self.optional_done = acked;
        for s in &mut self.slots {
            if s.ack_for != 0 && s.state == State::Pending && s.idx <= acked {
                s.state = State::Done;
            }
        }
    }

    /// After a poll found no more completions: the staged rows go out if the sender runs low
    /// ([`Self::advertise`]), then as [`SendCore::idle`], waiting meaning a receive whose data
    /// has not arrived, optional ones included (`sizes` holds their acks).
    pub fn idle(
        &mut self,
        now: Duration,
        elsewhere: Option<Fault>,
        io: &mut impl Post,
        stage: &impl Words,
        sizes: &impl Words,
    ) -> Result<()> {
        self.optional_landed(sizes);
        if self.health.fatal.is_none() {
            self.serve(now, stage, sizes, io)?;
            if self.waiting > 0 {
                self.refill(io)?;
            }
            if self.p.failover {
                // Only a lane on a port whose link went down: a stall is the sender's to find
                // (it owns lane repair; two ends fencing on their own could keep disjoint
                // lanes). A silent path under our CTS rows stalls the sender's work or probes
                // on the lane, and its fence moves the rows.
                let on_down = self.health.on_down(self.alive, &self.p.members);
                let found = self.health.stalled(now, (0, self.alive, on_down), |_| Duration::ZERO);
                if let Some((lane, why)) = found {
                    io.fence(lane).map_err(|e| self.health.post_failed(e))?;
                    self.drop_lane(lane, &why, sizes);
                }
            }
            self.advertise(stage, io)?;
        }
        let waiting = self.waiting > 0 || self.awaits_acks(sizes);
        // Every live lane with room, as the sender does: a dead sender fails the comm within
        // one retry bound however many lanes it has (one lane at a time took one bound each).
        let room = (0..self.p.nqps).filter(|&q| self.alive & (1 << q) != 0 && self.sq[q].fits(0));
        let lanes = room.fold(0u128, |m, q| m | 1 << q);
        let (target, members) = (self.remote_fifo, &self.p.members);
        let at = |q: usize| target.at(0, members[q].1);
        let probed = self.health.probe(now, (waiting, false), io, (lanes, at))?;
        for q in (0..self.p.nqps).filter(|&q| probed & (1 << q) != 0) {
            self.sq[q].posted(1, true);
        }
        self.health.idle(now, elsewhere)
    }

    fn state(&self, id: usize) -> Option<State> {
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
    /// with the `n` received sizes in `sizes` (0 for a flush).
    pub fn test(&mut self, id: usize, sizes: &mut [u64; MAX_RECVS]) -> Result<Option<usize>> {
        match self.state(id) {
            None | Some(State::Free) => {
                Err(Error::Internal(format!("test of an unknown or free receive request {id}")))
            }
            Some(State::Pending) => self.health.check().map(|_| None),
            Some(State::Done) if id < SLOTS => {
                // An optional receive is "done" without its data: once the comm failed, its
                // data may never come, and NCCL must hear so on its next call.
                if self.slots[id].ack_for != 0 {
                    self.health.check()?;
                }
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

#[cfg(test)]
mod tests;
