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
//! write against it.
//!
//! Lanes: a lane whose path dies (retries exhausted), whose QP fails on its own (an async
//! error) or whose peer's QP refuses a write as invalid (rxe, now and then, on a path that
//! reorders) is dropped while another lives. Its chunks in flight may have landed with only their
//! ACKs lost (a path can fail one way), so they are not simply sent again: **fence, confirm,
//! then re-send.** The sender holds them and writes a [`mend::Msg::Fence`] into the receiver's
//! mailbox through a live lane. The receiver fences its end of the lane (its queue pair to the
//! error state, so nothing more of it lands), waits until every receive it had posted on the
//! lane has come back (landed or flushed), so that every chunk that landed is counted, and
//! answers with its receipts ([`RecvCore::receipts`]): per slot, which receive it holds, whether
//! it is still open and which chunks it counted. Only the
//! chunks it did not count go again ([`SendCore::settle`]), on live lanes, in row order; a
//! receive that completed is never written again. The sender posts nothing new until they
//! have. The receiver's CTS rows move to its next live lane if they rode on the fenced one.
//! Every lane the sender takes out is fenced, with chunks held or not, and the answer goes
//! back through the lane the request came through: the ends never disagree for long on the
//! lanes they write into (a write into a fenced queue pair is retried without end on
//! Soft-RoCE). Neither end takes out its last lane: where the sender's last lane fails, the
//! comm fails, and a request that would take out the receiver's last one (the lane it came
//! through failed there since) fails the receiving comm at once: no path is left.
//! Where messages go is path-aware ([`place`]): a lane's measured rate and queue steer whole
//! messages, and a lane under a quarter of the best rate gets no new work (in split mode, once
//! it also holds up the oldest message).
//!
//! Optional receive completions: NCCL marks LL/LL128 receives (one buffer) whose arrival it
//! detects itself through flags in the data. Their CTS says so, and the sender sends them
//! whole, never split, as whole-message mode does: one write with immediate where one write
//! holds it. The receive completes as any other, when that write lands, and is counted in a
//! fence's receipts as any other: exactly once holds for LL too. The plugin may skip or hurry
//! such a completion; ferroce does neither, because a second write to carry the news costs
//! more than the completion it saves (a packet, and on Soft-RoCE a doorbell's worth of work
//! in the sender's `isend`), and NCCL keeps testing the request until it is done, so a
//! receiving comm whose LL data waits behind a fence is called to answer it.
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
//!   A write that reads its rows from the stage, being longer than its lane takes inline (a
//!   batch, a multi-receive's other entries, any row on a lane that takes less than one), is
//!   the exception: the NIC reads the stage when it executes the write, and again when it
//!   retransmits it, which can be after the sender consumed the row (its ACK was lost; or the
//!   row was written again after a lane failed, and its first copy had landed). Such a write is
//!   signaled, and none of its rows' slots is staged again until it completed or its lane
//!   failed ([`recv::RecvSlot::read_by`]).
//!   (The receipts and mail a fence's answer writes are read from the stage too; a newer answer
//!   restages them only once the sender asked again, and the mail's decoding rejects a torn
//!   one.)
//! - The CTS queue pair's send queue is counted as a provider that frees entries only when a
//!   signaled completion is polled sees it ([`SqCount`]): one request in 32 is signaled (and
//!   every write that reads the stage), a batch that does not fit waits, and one entry is kept
//!   for a probe.
//! - A posted receive never waits on its own end's next call: its row is written by `irecv`
//!   (or, with the CTS send queue full, by the polls `irecv` makes before it returns).
//!
//! Cost: the functions a message or a poll runs through, small or called from one place, are
//! `#[inline(always)]`. Under fat LTO the compiler kept about thirty of them as calls; forced
//! inline, an 8 B message costs about 590 fewer instructions (both ends) and an empty `test`
//! about 30 fewer (`ferroce instructions`).
#![doc = include_str!("doc/data.md")]

use std::time::Duration;

use crate::error::{Error, Result};
use crate::wr::{Completion, MAX_CHAIN, Op, SendWr, status_name};

mod failover;
mod health;
mod mend;
mod place;
mod recv;
mod ring;
mod send;
mod sq;
mod stall;
mod traffic;
mod wire;

/// How often a comm runs its idle work (the watchdog, health, probes, lane repair) while its
/// polls find nothing or only completions: the shell runs [`RecvCore::idle`] and
/// [`SendCore::idle`] once per this, and otherwise only [`RecvCore::after_poll`] and
/// [`SendCore::after_poll`] (after completions; nothing after an empty poll). Every deadline
/// is coarser by at most this, far below any of them.
pub const IDLE_EVERY: Duration = Duration::from_millis(1);

pub use health::*;
pub use mend::Policy as Repair;
pub use recv::*;
pub use send::*;
use sq::*;
pub use traffic::*;
pub use wire::*;

/// Registered memory the core reads or writes by u64 word: the FIFO and size records the peer's
/// NIC writes, the staging areas the local NIC reads.
pub trait Words {
    fn load(&self, word: usize) -> u64;
    fn store(&self, word: usize, v: u64);
    /// Words `word..word + N`, each loaded as [`Self::load`] does, in order. An implementation
    /// may check the bounds once for all of them (a CTS entry is eight words).
    fn load_n<const N: usize>(&self, word: usize) -> [u64; N] {
        std::array::from_fn(|i| self.load(word + i))
    }
    /// Stores `v` at words `word..word + N`, each as [`Self::store`] does, in order.
    fn store_n<const N: usize>(&self, word: usize, v: [u64; N]) {
        for (i, w) in v.into_iter().enumerate() {
            self.store(word + i, w);
        }
    }
    /// The address of `word`, for a work request.
    fn addr(&self, word: usize) -> u64;
    /// Its local key on member port `member` of the comm.
    fn lkey(&self, member: usize) -> u32;
}

/// Where the core's work requests go: QP `qp` of the comm (index `nqps` is the flush QP).
pub trait Post {
    fn send(&mut self, qp: usize, wrs: &[SendWr]) -> Result<()>;
    /// Posts `n` receive WQEs of id `wr_id` on QP `qp`, in chains of up to
    /// [`MAX_CHAIN`].
    fn recv(&mut self, qp: usize, wr_id: u64, n: usize) -> Result<()>;
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

/// The fixed parameters of one end of a connection.
#[derive(Clone, Debug)]
pub struct Params {
    pub nqps: usize,
    pub split: bool,
    /// Largest single work request (the port's `max_msg_sz`).
    pub max_msg: u64,
    /// Per lane, the largest inline payload its QP accepts (`max_inline_data`; a receive
    /// comm's first lane takes a CTS row, its others less). A request is marked inline only
    /// where its lane takes it: the core must know which writes read their memory when the
    /// NIC executes them (and again when it retransmits them).
    pub inline: Vec<u32>,
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
    /// Shared with the comm's other owners (the transport's lanes): one copy of its strings.
    pub path: std::sync::Arc<Path>,
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

impl Params {
    /// The inline payload lane `q`'s QP takes: none for a lane not listed.
    #[inline(always)]
    pub fn inline_on(&self, q: usize) -> u32 {
        self.inline.get(q).copied().unwrap_or(0)
    }
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

#[cfg(test)]
mod tests;
