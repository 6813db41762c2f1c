//! The wire encoding of the data path: the layout of the control areas the peers write into
//! each other (the FIFO of clear-to-send rows, the size records, the mailboxes), the
//! work-request ids and immediates the completions come back with, and the access each queue
//! pair grants. Everything here is a pure function of its arguments; both ends must agree on
//! it bit for bit, so it changes only with the handshake's version.

use super::*;

/// Messages of this many bytes and more are timed for path-aware placement (a comm's
/// [`Params::timed_from`]).
pub const TIMED_FROM: u64 = 64 << 10;

/// Outstanding (multi-)receives per comm: NCCL's `NCCL_NET_MAX_REQUESTS`.
pub const SLOTS: usize = 32;

/// Buffers one `irecv` may group (`maxRecvs`).
pub const MAX_RECVS: usize = 8;

/// Most member ports one comm spans (a fused device's): NCCL's `NCCL_NET_MAX_DEVS_PER_NIC`
/// of v12.
pub const MAX_MEMBERS: usize = 8;

/// A registration's key on each member port of its comm (entry `m`: member `m`'s).
pub type Keys = [u32; MAX_MEMBERS];

/// One CTS entry in bytes, and in u64 words.
pub const ENTRY: usize = 64;

pub(super) const ENTRY_WORDS: usize = ENTRY / 8;

/// The FIFO (and the receiver's staging area, which mirrors it) in u64 words: first the head
/// entries (entry 0 of every slot, dense, so that a batch of consecutive rows is one small
/// write), then the other entries of multi-receives, `MAX_RECVS - 1` per slot.
pub const FIFO_WORDS: usize = SLOTS * MAX_RECVS * ENTRY_WORDS;

/// After the FIFO, the sender's mailbox: the receiver's answers about lane repair and fences.
pub(super) const FIFO_MAIL: usize = FIFO_WORDS;

/// After the mailbox, the receipts of the last fence ([`RecvCore::receipts`]).
pub(super) const FIFO_RECEIPTS: usize = FIFO_MAIL + mend::MAIL_WORDS;

/// The receipts in u64 words: per slot its receive's `idx << 1 | open` and the chunks counted
/// (two words).
pub(super) const RECEIPT_WORDS: usize = 3 * SLOTS;

/// The FIFO, its mailbox and the receipts (and the receiver's staging area, which mirrors
/// them).
pub const FIFO_AREA: usize = FIFO_RECEIPTS + RECEIPT_WORDS;

/// Most rows one CTS batch carries: their head entries are one write of at most 512 bytes.
pub const BATCH: u64 = 8;

/// The size records in u64 words: one per buffer of every slot.
pub const SIZE_WORDS: usize = SLOTS * MAX_RECVS;

/// After the size records, the receiver's mailbox: the sender's lane repair requests.
pub(super) const SIZE_MAIL: usize = SIZE_WORDS;

/// The size records and the mailbox (and the sender's staging area, which mirrors them).
pub const SIZE_AREA: usize = SIZE_WORDS + mend::MAIL_WORDS;

/// Flag in a CTS entry's `nreqs` word: an optional receive (NCCL's LL), sent whole, never
/// split.
pub(super) const CTS_OPTIONAL: u64 = 1 << 8;

/// The sender's send-queue depth per QP of a comm with `nqps` lanes; a slot whose chain does
/// not fit waits ([`SendCore::fits`]). It holds the worst a slot can put on one lane: every
/// chunk of a multi-receive of [`MAX_RECVS`] buffers, each in up to 2 pieces (a buffer larger
/// than the port's largest message, 1 GiB or more), with its size record and immediate, once
/// every other lane failed (up to 56 lanes). One less than a power of two, because providers
/// size the ring for one entry more and round it up: Soft-RoCE's ring of 256 entries held 512
/// of 512 bytes each (256 KiB per QP), where 63 hold 64 of 256 bytes (16 KiB). The comm's CQ
/// is sized from it too.
pub fn send_queue(nqps: usize) -> usize {
    ((2 * MAX_RECVS + 2) * nqps + 1).clamp(64, 1024).next_power_of_two() - 1
}

/// The largest message NCCL is told to hand one `isend` (`maxP2pBytes`): 16 writes of
/// [`MARK_BYTES`], which [`send_queue`] holds on one lane even once every other lane failed.
/// NCCL's steps are far smaller; only a registered user buffer comes near it, and NCCL cuts
/// those to this size.
pub const MAX_MESSAGE: u64 = 16 * MARK_BYTES;

/// The receiver's send-queue depth per QP: CTS batches, probes and repair answers, on the
/// control lane (probes on the others). It holds a row of every slot written one by one, so
/// that `irecv` always writes its own row, with room to spare for a probe and an answer. One
/// less than a power of two, as [`send_queue`].
pub const RECV_SEND_QUEUE: usize = 2 * SLOTS - 1;

/// A flush QP's send-queue depth: one RDMA read per flush, at most [`SLOTS`] outstanding.
pub const FLUSH_QUEUE: usize = SLOTS;

/// The receiver signals a CTS write once this many work requests went unsignaled: a provider
/// that frees send-queue entries only when a later signaled request completes (mlx5) then
/// always has one on the way while the queue is more than half full.
pub(super) const CTS_SIGNAL_EVERY: u64 = RECV_SEND_QUEUE as u64 / 2;

/// The immediate of a chunk's final write names what it completes, so that the receiver needs
/// no particular lane for it: bits 0-4 the slot, 5-11 the chunk (the lane's part in a split
/// message), 12 the parity of the slot's use (`(idx - 1) / SLOTS`); then either the size in
/// bits 13-30 (below 256 KiB), or bit 31 set: the sizes are in the slot's size records. A
/// whole message (not split: its chunk is always 0) has bits 5-11 for the size's bits 18-24,
/// so that one below 32 MiB, NCCL's usual step of 512 KiB included, needs no size record.
pub(super) const IMM_SIZES: u32 = 0x8000_0000;

pub(super) const IMM_SIZE_SHIFT: u32 = 13;
/// The size's bits in bits 13-30.
const IMM_SIZE_BITS: u32 = 31 - IMM_SIZE_SHIFT;
/// The chunk's bits, 5-11.
const IMM_CHUNK_SHIFT: u32 = 5;
const IMM_CHUNK_MASK: u32 = 0x7f;

/// The most chunks (lanes) one message is split into: `NCCL_IB_QPS_PER_CONNECTION`'s bound.
pub const MAX_CHUNKS: usize = 128;

/// The largest size an immediate carries itself in split mode.
pub(super) const IMM_MAX_SIZE: u64 = (IMM_SIZES >> IMM_SIZE_SHIFT) as u64 - 1;

/// The largest size a whole message's immediate carries (the chunk's bits above the size's).
pub(super) const IMM_MAX_WHOLE: u64 = (1 << (IMM_SIZE_BITS + IMM_CHUNK_MASK.count_ones())) - 1;

/// The largest size an immediate carries in split mode (`split`) or whole.
const fn imm_max(split: bool) -> u64 {
    if split { IMM_MAX_SIZE } else { IMM_MAX_WHOLE }
}

/// Receive WQEs each of `nqps` lanes keeps posted, so that every chunk in flight finds one on
/// whichever lane carries it: twice the chunks every slot can put on one lane. Without failures
/// a slot's message puts at most one chunk on a lane; once lanes fail, the live ones carry the
/// chunks of the dead ones (spread evenly). A whole message is one chunk, so one lane may get
/// every slot's, however many lanes there are; a split one (`split`) has a chunk per lane, and
/// twice its chunks on each lane covers every lane but one failing, for up to 4 lanes; beyond
/// 4, as long as a quarter of the lanes live (one lane: the same either way). The second half
/// is margin for a chunk delivered twice, which the receiver counts once and the simulator
/// injects, though a chunk goes again only once its lane is fenced and the receipts say it did
/// not land. The receiver tops the pools up before every CTS and after every poll.
#[inline]
pub fn recv_pool(nqps: usize, split: bool) -> usize {
    2 * SLOTS * if split { nqps.clamp(1, 4) } else { 1 }
}

/// Receive WQEs a lane's pool is topped up by at once: it holds between [`recv_pool`] and this
/// many more, and a refill posts them as one chain (one call into the provider per this many
/// messages on the lane, not one per message).
pub const RECV_BATCH: usize = crate::wr::MAX_CHAIN;

/// The receive queue a lane needs: its pool, topped up by up to [`RECV_BATCH`].
pub fn recv_queue(nqps: usize, split: bool) -> usize {
    recv_pool(nqps, split) + RECV_BATCH
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

pub(super) fn wr_id(kind: u64, lane: usize, slot: usize) -> u64 {
    kind | (lane as u64 & 0xff) << 8 | slot as u64 & 0xff
}

/// A sender's data work request: also the chunk it carries (bits 16-23).
pub(super) fn data_wr_id(kind: u64, lane: usize, slot: usize, chunk: usize) -> u64 {
    wr_id(kind, lane, slot) | (chunk as u64 & 0xff) << 16
}

/// A work request of the `life`-th life of its lane: each repair of a lane starts a new one,
/// and the completions of an earlier one are ignored (bits 24-31).
pub(super) fn tagged(id: u64, life: u8) -> u64 {
    id | u64::from(life) << 24
}

pub(super) fn wr_life(id: u64) -> u8 {
    (id >> 24) as u8
}

pub(super) fn wr_chunk(id: u64) -> usize {
    ((id >> 16) & 0xff) as usize
}

pub(super) fn wr_kind(id: u64) -> u64 {
    id & !0xffff_ffff
}

pub(super) fn wr_lane(id: u64) -> usize {
    ((id >> 8) & 0xff) as usize
}

pub(super) fn wr_slot(id: u64) -> usize {
    (id & 0xff) as usize % SLOTS
}

/// The parity of the use of its slot that the row with `idx` is.
pub(super) fn epoch(idx: u64) -> u32 {
    (((idx - 1) / SLOTS as u64) & 1) as u32
}

/// What a chunk's immediate names (see [`IMM_SIZES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Imm {
    pub(super) slot: usize,
    pub(super) chunk: usize,
    pub(super) epoch: u32,
    /// The size, or `None`: in the slot's size records.
    pub(super) size: Option<u64>,
}

impl Imm {
    /// Its immediate, in split mode (`split`) or for a whole message (chunk 0).
    pub(super) fn encode(&self, split: bool) -> u32 {
        debug_assert!(split || self.chunk == 0, "a whole message is chunk 0");
        debug_assert!(self.size.is_none_or(|s| s <= imm_max(split)), "the size fits its bits");
        let ids = self.slot as u32 | (self.chunk as u32) << IMM_CHUNK_SHIFT | self.epoch << 12;
        match self.size {
            Some(s) if split => ids | (s as u32) << IMM_SIZE_SHIFT,
            Some(s) => {
                let (low, high) = ((s & IMM_MAX_SIZE) as u32, (s >> IMM_SIZE_BITS) as u32);
                ids | low << IMM_SIZE_SHIFT | high << IMM_CHUNK_SHIFT
            }
            None => ids | IMM_SIZES,
        }
    }

    pub(super) fn decode(imm: u32, split: bool) -> Imm {
        // Bits 5-11: the chunk, or a whole message's high size bits.
        let bits = (imm >> IMM_CHUNK_SHIFT) & IMM_CHUNK_MASK;
        let (chunk, high) = if split { (bits, 0) } else { (0, bits) };
        let size = u64::from(imm >> IMM_SIZE_SHIFT) | u64::from(high) << IMM_SIZE_BITS;
        Imm {
            slot: (imm & 0x1f) as usize,
            chunk: chunk as usize,
            epoch: (imm >> 12) & 1,
            size: (imm & IMM_SIZES == 0).then_some(size),
        }
    }
}

/// Whether a slot's sizes fit the immediate (one buffer, at most [`IMM_MAX_SIZE`] bytes in
/// split mode, [`IMM_MAX_WHOLE`] whole).
pub(super) fn size_in_imm(sizes: &[u64], split: bool) -> Option<u64> {
    match sizes {
        [s] if *s <= imm_max(split) => Some(*s),
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

/// What the receiver's QP `q` of `nqps` grants: each takes the sender's data, size records
/// and probes. Index `nqps` is the loopback flush QP, the responder of its own RDMA
/// read of NCCL's receive buffer: read only. No QP a peer reaches grants remote reads.
pub fn recv_grant(q: usize, nqps: usize) -> Grant {
    if q >= nqps { Grant::Read } else { Grant::Write }
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
    /// An optional receive (NCCL's LL: NCCL watches the data's flags), always alone in its
    /// row: sent whole, never split, whatever the comm's mode.
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
    /// The entry's words: address, size, keys 0-3 two to a word, the tag, keys 4-7 two to a
    /// word, and last `idx` (48 bits, enough for 10^14 receives) with the buffer count and the
    /// optional flag, which lands last, as the sender checks it to see a landed entry.
    pub fn encode(&self) -> [u64; ENTRY_WORDS] {
        let k = |i: usize| u64::from(self.rkeys[i]) | u64::from(self.rkeys[i + 1]) << 32;
        [
            self.addr,
            self.size,
            k(0),
            k(2),
            u64::from(self.tag as u32),
            k(4),
            k(6),
            u64::from(self.nreqs) | if self.optional { CTS_OPTIONAL } else { 0 } | self.idx << 16,
        ]
    }

    #[inline(always)]
    pub fn decode(w: [u64; ENTRY_WORDS]) -> Cts {
        Cts {
            addr: w[0],
            size: w[1],
            rkeys: std::array::from_fn(|i| (w[[2, 3, 5, 6][i / 2]] >> (32 * (i % 2))) as u32),
            tag: w[4] as u32 as i32,
            nreqs: w[7] as u8,
            optional: w[7] & CTS_OPTIONAL != 0,
            idx: w[7] >> 16,
        }
    }

    /// Reads entry `r` of `slot`: the word with `idx` first, then the rest, so that an entry
    /// whose `idx` is current is never paired with last wrap's fields (the peer's write lands
    /// in order, and each load is an acquire).
    pub(super) fn read(fifo: &impl Words, slot: usize, r: usize) -> Cts {
        let base = entry_word(slot, r);
        Cts::read_after(fifo, base, fifo.load(base + ENTRY_WORDS - 1))
    }

    /// The entry at `base` whose last word, read first, was `last`.
    fn read_after(fifo: &impl Words, base: usize, last: u64) -> Cts {
        let rest: [u64; ENTRY_WORDS - 1] = fifo.load_n(base);
        Cts::decode(std::array::from_fn(|i| if i + 1 < ENTRY_WORDS { rest[i] } else { last }))
    }

    /// Entry `r` of `slot` once its `idx` is `want` (it has landed), as [`Self::read`] reads
    /// it; `None`, having read only the `idx` word, while it is not.
    #[inline]
    pub(super) fn landed(fifo: &impl Words, slot: usize, r: usize, want: u64) -> Option<Cts> {
        let base = entry_word(slot, r);
        let last = fifo.load(base + ENTRY_WORDS - 1);
        (last >> 16 == want).then(|| Cts::read_after(fifo, base, last))
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
    pub(super) fn at(&self, word: usize, member: usize) -> (u64, u32) {
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

/// A signaled zero-length RDMA write on lane `lane` (a liveness probe, or the probe of a
/// rebuilt lane): `target` is a region of the peer's this comm may write; no key is checked.
pub(super) fn zero_write(kind: u64, (lane, life): (usize, u8), target: (u64, u32)) -> SendWr {
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
pub(super) fn mail_wr(
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
pub(super) fn mail(area: &impl Words, word: usize) -> Option<mend::Msg> {
    mend::Msg::decode(mail_words(area, word))
}

/// The words of the mailbox at `word` of `area`, undecoded.
pub(super) fn mail_words(area: &impl Words, word: usize) -> [u64; mend::MAIL_WORDS] {
    std::array::from_fn(|i| area.load(word + i))
}

/// The newest CTS row that has landed in `fifo`: it moves only while the receiving comm is
/// called (its `irecv` writes the rows).
pub(super) fn newest_row(fifo: &impl Words) -> u64 {
    (0..SLOTS).map(|k| Cts::read(fifo, k, 0).idx).max().unwrap_or(0)
}
