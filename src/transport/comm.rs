//! The data path: receiver-driven RDMA writes over one RC queue pair per connection.
//!
//! 1. `irecv` posts a buffer-less receive (it will absorb the sender's write-with-immediate),
//!    then RDMA-writes the `n` buffer descriptors ("CTS" entries) into slot `head % SLOTS` of
//!    the sender's FIFO.
//! 2. `isend` finds the slot's entries in its FIFO (the receiver wrote them), matches by tag,
//!    and once all `n` sends of the slot are matched, posts one chain: RDMA writes of each
//!    buffer, then (for `n > 1`, or sizes that do not fit the immediate) a write of the sizes
//!    into the receiver's size records, and a final signaled write-with-immediate.
//! 3. `test` polls the comm's CQ; completions find their slot through `wr_id`.
//!
//! Invariants:
//! - Requests live in fixed arrays (no allocation per request); NCCL's request pointer is the
//!   address of a [`ReqHeader`] whose `owner` is the address of the boxed comm.
//! - A slot is reused only after NCCL has seen every request of its previous use complete.
//! - The receive WQE is posted before the CTS that allows the matching write, so the sender
//!   never meets receiver-not-ready.

use std::sync::Arc;

use super::net::Net;
use crate::error::{Error, Result};
use crate::verbs::{self, Completion, Cq, MAX_CHAIN, Mr, Op, Qp, RegisteredBuf, SendWr};

/// Outstanding (multi-)receives per comm: NCCL's `NCCL_NET_MAX_REQUESTS`.
pub const SLOTS: usize = 32;
/// Buffers one `irecv` may group (`maxRecvs`).
pub const MAX_RECVS: usize = 8;
/// One CTS entry: addr, size, rkey | tag << 32, nreqs, idx (u64 words), padded to 64 bytes.
pub const ENTRY: usize = 64;
/// The sender's send-queue depth; a slot whose chain does not fit waits for completions.
pub const SEND_QUEUE: usize = 1024;
/// Immediate values with this bit set mean "sizes are in the size record of slot `imm & 0xff`".
const IMM_SIZES: u32 = 0x8000_0000;

const WR_SEND: u64 = 1 << 32;
const WR_CTS: u64 = 2 << 32;
const WR_RECV: u64 = 3 << 32;
const WR_FLUSH: u64 = 4 << 32;

/// What NCCL's request pointer points at.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ReqHeader {
    /// Address of the boxed comm that owns this request (set by `ffi` once the comm is boxed).
    pub owner: usize,
    pub kind: ReqKind,
    pub index: u16,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum ReqKind {
    #[default]
    Send,
    Recv,
    Flush,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum State {
    #[default]
    Free,
    Pending,
    Done,
}

/// The hint attached to a failed completion.
fn hint(status: u32) -> &'static str {
    match status {
        12 => {
            "retry exceeded: the peer stopped answering; check the GID, MTU, PFC/ECN and NCCL_IB_TIMEOUT"
        }
        13 => "RNR retry exceeded: the peer had no receive posted",
        10 | 11 | 4 => {
            "protection/access error: a buffer was not registered or was deregistered too early"
        }
        5 => "flushed: an earlier error moved the queue pair to the error state",
        _ => "see `rdma resource show qp` and dmesg",
    }
}

/// Records the first failed completion of a comm; every later call reports it.
fn check_completion(c: &Completion, fatal: &mut Option<String>, peer: &str) {
    if c.status != 0 && fatal.is_none() {
        *fatal = Some(format!(
            "completion error with {peer}: {} (status {}, vendor_err {:#x}, wr {:#x}): {}",
            verbs::status_str(c.status),
            c.status,
            c.vendor_err,
            c.wr_id,
            hint(c.status)
        ));
    }
}

/// A local buffer registered for a transfer: its address range and keys.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub size: u64,
    pub lkey: u32,
    pub rkey: u32,
}

impl Buf {
    /// Checks that `[addr, addr + size)` lies inside `mr`.
    pub fn within(mr: &Mr, addr: u64, size: u64) -> Result<Buf> {
        let end = addr.checked_add(size).ok_or_else(|| Error::Internal("buffer wraps".into()))?;
        if size > 0 && (addr < mr.addr || end > mr.addr + mr.len as u64) {
            return Err(Error::Internal(format!(
                "buffer {addr:#x}+{size} is outside its registration {:#x}+{}",
                mr.addr, mr.len
            )));
        }
        Ok(Buf { addr, size, lkey: mr.lkey, rkey: mr.rkey })
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct SendReq {
    state: State,
    size: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct SendSlot {
    /// Bitmask of the entries matched by an `isend`.
    matched: u8,
    /// The sends matched so far, by entry.
    bufs: [Option<Buf>; MAX_RECVS],
    /// Work requests posted for this slot and not yet retired by its completion.
    wrs: usize,
}

/// The sending end of a connection.
pub struct SendComm {
    pub headers: [ReqHeader; SLOTS * MAX_RECVS],
    reqs: [SendReq; SLOTS * MAX_RECVS],
    slots: [SendSlot; SLOTS],
    /// Slots fully posted so far; the next slot is `head % SLOTS`.
    head: u64,
    /// Written by the receiver's NIC: `SLOTS × MAX_RECVS` CTS entries.
    fifo: RegisteredBuf,
    /// Source of the size-record writes: `SLOTS × MAX_RECVS` u64 sizes.
    sizes_stage: RegisteredBuf,
    remote_sizes: (u64, u32),
    max_msg: u64,
    sq_used: usize,
    fatal: Option<String>,
    pub peer: String,
    qp: Qp,
    cq: Arc<Cq>,
    pub net: Arc<Net>,
    pub dev: usize,
}

/// Everything `setup` builds for a send comm before the peer answers.
pub struct SendParts {
    pub qp: Qp,
    pub cq: Arc<Cq>,
    pub fifo: RegisteredBuf,
    pub sizes_stage: RegisteredBuf,
}

impl SendParts {
    pub fn new(net: &Arc<Net>, dev: usize) -> Result<SendParts> {
        let d = &net.devices[dev];
        let cq = Cq::new(&d.ctx, (SEND_QUEUE + 64) as i32)?;
        let caps = verbs::QpCaps { max_send_wr: SEND_QUEUE as u32, max_recv_wr: 1 };
        let qp = Qp::create_rc(&d.pd, &cq, caps)?;
        qp.to_init(d.port, verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE)?;
        let fifo = RegisteredBuf::new(
            &d.pd,
            SLOTS * MAX_RECVS * ENTRY,
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE,
        )?;
        let sizes_stage =
            RegisteredBuf::new(&d.pd, SLOTS * MAX_RECVS * 8, verbs::ACCESS_LOCAL_WRITE)?;
        Ok(SendParts { qp, cq, fifo, sizes_stage })
    }
}

impl SendComm {
    pub fn new(
        parts: SendParts,
        net: Arc<Net>,
        dev: usize,
        peer: String,
        remote_sizes: (u64, u32),
        max_msg: u64,
    ) -> Box<SendComm> {
        let mut headers = [ReqHeader::default(); SLOTS * MAX_RECVS];
        for (i, h) in headers.iter_mut().enumerate() {
            *h = ReqHeader { owner: 0, kind: ReqKind::Send, index: i as u16 };
        }
        let mut c = Box::new(SendComm {
            headers,
            reqs: [SendReq::default(); SLOTS * MAX_RECVS],
            slots: [SendSlot::default(); SLOTS],
            head: 0,
            fifo: parts.fifo,
            sizes_stage: parts.sizes_stage,
            remote_sizes,
            max_msg: max_msg.max(4096),
            sq_used: 0,
            fatal: None,
            peer,
            qp: parts.qp,
            cq: parts.cq,
            net,
            dev,
        });
        let owner = &*c as *const SendComm as usize;
        c.headers.iter_mut().for_each(|h| h.owner = owner);
        c
    }

    fn entry(&self, slot: usize, r: usize, word: usize) -> u64 {
        self.fifo.load_u64((slot * MAX_RECVS + r) * ENTRY + word * 8)
    }

    fn fatal(&self) -> Result<()> {
        match &self.fatal {
            Some(e) => Err(Error::Remote(e.clone())),
            None => Ok(()),
        }
    }

    /// Matches a send against the receiver's posted buffers. `Ok(None)`: not yet (the receive
    /// is not posted, or this slot's previous requests are still outstanding).
    pub fn isend(&mut self, buf: Buf, tag: i32) -> Result<Option<usize>> {
        self.fatal()?;
        let slot = (self.head % SLOTS as u64) as usize;
        let want = self.head + 1;
        if self.entry(slot, 0, 4) != want {
            return Ok(None);
        }
        let nreqs = self.entry(slot, 0, 3) as usize;
        if !(1..=MAX_RECVS).contains(&nreqs) {
            return Err(Error::Remote(format!("{} sent a CTS with {nreqs} buffers", self.peer)));
        }
        if (0..nreqs).any(|r| self.entry(slot, r, 4) != want) {
            return Ok(None); // the rest of the row is still landing
        }
        // A fresh slot must not still hold requests NCCL has not yet seen complete.
        let fresh = self.slots[slot].matched == 0;
        if fresh
            && self.reqs[slot * MAX_RECVS..(slot + 1) * MAX_RECVS]
                .iter()
                .any(|r| r.state != State::Free)
        {
            self.progress()?;
            return Ok(None);
        }
        let s = &self.slots[slot];
        let Some(r) = (0..nreqs).find(|&r| {
            s.matched & (1 << r) == 0 && (self.entry(slot, r, 2) >> 32) as u32 as i32 == tag
        }) else {
            return Ok(None);
        };
        let posted = self.entry(slot, r, 1);
        if buf.size > posted {
            return Err(Error::Internal(format!(
                "send of {} bytes (tag {tag}) to {} is larger than the posted receive of {posted} \
                 bytes",
                buf.size, self.peer
            )));
        }
        let last = s.matched.count_ones() as usize + 1 == nreqs;
        if last && !self.fits(slot, nreqs, r, buf.size) {
            self.progress()?;
            return Ok(None);
        }
        let id = slot * MAX_RECVS + r;
        self.reqs[id] = SendReq { state: State::Pending, size: buf.size };
        let s = &mut self.slots[slot];
        s.matched |= 1 << r;
        s.bufs[r] = Some(buf);
        if last {
            self.post(slot, nreqs)?;
            self.head += 1;
        }
        Ok(Some(id))
    }

    fn wrs_for(&self, size: u64) -> usize {
        size.div_ceil(self.max_msg).max(1) as usize
    }

    fn fits(&self, slot: usize, nreqs: usize, r_new: usize, size_new: u64) -> bool {
        let s = &self.slots[slot];
        let data: usize = (0..nreqs)
            .map(|r| if r == r_new { size_new } else { s.bufs[r].map_or(0, |b| b.size) })
            .map(|sz| self.wrs_for(sz))
            .sum();
        self.sq_used + data + 2 <= SEND_QUEUE
    }

    /// Posts the slot's chain: data writes, the size record if needed, the final immediate.
    fn post(&mut self, slot: usize, nreqs: usize) -> Result<()> {
        let mut chain = [SendWr {
            wr_id: 0,
            op: Op::Write,
            signaled: false,
            local: None,
            remote_addr: 0,
            rkey: 0,
        }; MAX_CHAIN];
        let mut len = 0;
        let mut posted = 0;
        let sizes: [u64; MAX_RECVS] =
            std::array::from_fn(|r| self.slots[slot].bufs[r].map_or(0, |b| b.size));
        let single = nreqs == 1 && sizes[0] < u64::from(IMM_SIZES);
        for r in 0..nreqs {
            let Some(b) = self.slots[slot].bufs[r] else { continue };
            let (raddr, rkey) = (self.entry(slot, r, 0), self.entry(slot, r, 2) as u32);
            let mut off = 0;
            while off < b.size {
                let n = (b.size - off).min(self.max_msg);
                chain[len] = SendWr {
                    wr_id: WR_SEND | slot as u64,
                    op: Op::Write,
                    signaled: false,
                    local: Some((b.addr + off, n as u32, b.lkey)),
                    remote_addr: raddr + off,
                    rkey,
                };
                len += 1;
                off += n;
                if len == MAX_CHAIN {
                    self.qp.post_send(&chain[..len])?;
                    posted += len;
                    len = 0;
                }
            }
        }
        let imm = if single {
            sizes[0] as u32
        } else {
            for (r, &sz) in sizes.iter().enumerate().take(nreqs) {
                self.sizes_stage.store_u64((slot * MAX_RECVS + r) * 8, sz);
            }
            if len + 2 > MAX_CHAIN {
                self.qp.post_send(&chain[..len])?;
                posted += len;
                len = 0;
            }
            chain[len] = SendWr {
                wr_id: WR_SEND | slot as u64,
                op: Op::Write,
                signaled: false,
                local: Some((
                    self.sizes_stage.addr(slot * MAX_RECVS * 8),
                    (nreqs * 8) as u32,
                    self.sizes_stage.lkey(),
                )),
                remote_addr: self.remote_sizes.0 + (slot * MAX_RECVS * 8) as u64,
                rkey: self.remote_sizes.1,
            };
            len += 1;
            IMM_SIZES | slot as u32
        };
        // The last data write carries the immediate when it can; otherwise a 0-byte one does.
        if single && len > 0 && chain[len - 1].op == Op::Write && sizes[0] > 0 {
            chain[len - 1].op = Op::WriteImm(imm);
            chain[len - 1].signaled = true;
        } else {
            if len == MAX_CHAIN {
                self.qp.post_send(&chain[..len])?;
                posted += len;
                len = 0;
            }
            chain[len] = SendWr {
                wr_id: WR_SEND | slot as u64,
                op: Op::WriteImm(imm),
                signaled: true,
                local: None,
                remote_addr: 0,
                rkey: 0,
            };
            len += 1;
        }
        self.qp.post_send(&chain[..len])?;
        posted += len;
        self.sq_used += posted;
        let s = &mut self.slots[slot];
        s.wrs = posted;
        s.matched = 0;
        s.bufs = [None; MAX_RECVS];
        Ok(())
    }

    /// Drains the CQ.
    pub fn progress(&mut self) -> Result<()> {
        let mut wcs = [Completion::default(); 16];
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for c in &wcs[..n] {
                check_completion(c, &mut self.fatal, &self.peer);
                if c.wr_id & !0xffff_ffff == WR_SEND {
                    let slot = (c.wr_id & 0xff) as usize % SLOTS;
                    self.sq_used = self.sq_used.saturating_sub(self.slots[slot].wrs);
                    self.slots[slot].wrs = 0;
                    for req in &mut self.reqs[slot * MAX_RECVS..(slot + 1) * MAX_RECVS] {
                        if req.state == State::Pending {
                            req.state = State::Done;
                        }
                    }
                }
            }
            if n < wcs.len() {
                return self.fatal();
            }
        }
    }

    /// `Some(size)` once request `id` completed (the request is then free again).
    pub fn test(&mut self, id: usize) -> Result<Option<u64>> {
        let req = self
            .reqs
            .get(id)
            .copied()
            .ok_or_else(|| Error::Internal(format!("bad send request {id}")))?;
        match req.state {
            State::Free => Err(Error::Internal(format!("test of a free send request {id}"))),
            State::Done => {
                self.reqs[id].state = State::Free;
                Ok(Some(req.size))
            }
            State::Pending => {
                self.progress()?;
                if self.reqs[id].state == State::Done {
                    self.reqs[id].state = State::Free;
                    return Ok(Some(req.size));
                }
                Ok(None)
            }
        }
    }

    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        // Flush outstanding work before the buffers go; a failure is logged, teardown goes on.
        if let Err(e) = self.qp.to_error() {
            log::warn!("closing the send comm to {}: {e}", self.peer);
        }
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct RecvSlot {
    state: State,
    n: usize,
    sizes: [u64; MAX_RECVS],
}

/// A loopback queue pair for the GPUDirect flush: an RDMA read of the last received buffer
/// completes only after the NIC's earlier writes into that memory are visible.
pub struct Flusher {
    pub qp: Qp,
    pub target: RegisteredBuf,
}

/// The receiving end of a connection.
pub struct RecvComm {
    /// `SLOTS` receive requests, then `SLOTS` flush requests.
    pub headers: [ReqHeader; 2 * SLOTS],
    slots: [RecvSlot; SLOTS],
    flushes: [State; SLOTS],
    flush_head: usize,
    head: u64,
    /// Source of the CTS writes: `SLOTS × MAX_RECVS` entries.
    cts_stage: RegisteredBuf,
    /// Written by the sender's NIC: `SLOTS × MAX_RECVS` u64 sizes.
    sizes: RegisteredBuf,
    remote_fifo: (u64, u32),
    fatal: Option<String>,
    pub peer: String,
    flusher: Option<Flusher>,
    qp: Qp,
    cq: Arc<Cq>,
    pub net: Arc<Net>,
    pub dev: usize,
}

/// Everything `setup` builds for a receive comm.
pub struct RecvParts {
    pub qp: Qp,
    pub cq: Arc<Cq>,
    pub cts_stage: RegisteredBuf,
    pub sizes: RegisteredBuf,
}

impl RecvParts {
    pub fn new(net: &Arc<Net>, dev: usize) -> Result<RecvParts> {
        let d = &net.devices[dev];
        let cq = Cq::new(&d.ctx, (6 * SLOTS) as i32)?;
        let caps =
            verbs::QpCaps { max_send_wr: (2 * SLOTS) as u32, max_recv_wr: (2 * SLOTS) as u32 };
        let qp = Qp::create_rc(&d.pd, &cq, caps)?;
        qp.to_init(
            d.port,
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE | verbs::ACCESS_REMOTE_READ,
        )?;
        let cts_stage =
            RegisteredBuf::new(&d.pd, SLOTS * MAX_RECVS * ENTRY, verbs::ACCESS_LOCAL_WRITE)?;
        let sizes = RegisteredBuf::new(
            &d.pd,
            SLOTS * MAX_RECVS * 8,
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE,
        )?;
        Ok(RecvParts { qp, cq, cts_stage, sizes })
    }
}

impl RecvComm {
    pub fn new(
        parts: RecvParts,
        flusher: Option<Flusher>,
        net: Arc<Net>,
        dev: usize,
        peer: String,
        remote_fifo: (u64, u32),
    ) -> Box<RecvComm> {
        let mut headers = [ReqHeader::default(); 2 * SLOTS];
        for (i, h) in headers.iter_mut().enumerate() {
            let kind = if i < SLOTS { ReqKind::Recv } else { ReqKind::Flush };
            *h = ReqHeader { owner: 0, kind, index: (i % SLOTS) as u16 };
        }
        let mut c = Box::new(RecvComm {
            headers,
            slots: [RecvSlot::default(); SLOTS],
            flushes: [State::Free; SLOTS],
            flush_head: 0,
            head: 0,
            cts_stage: parts.cts_stage,
            sizes: parts.sizes,
            remote_fifo,
            fatal: None,
            peer,
            flusher,
            qp: parts.qp,
            cq: parts.cq,
            net,
            dev,
        });
        let owner = &*c as *const RecvComm as usize;
        c.headers.iter_mut().for_each(|h| h.owner = owner);
        c
    }

    fn fatal(&self) -> Result<()> {
        match &self.fatal {
            Some(e) => Err(Error::Remote(e.clone())),
            None => Ok(()),
        }
    }

    /// Posts `bufs` (with their tags) as one multi-receive. `Ok(None)`: all slots busy.
    pub fn irecv(&mut self, bufs: &[(Buf, i32)]) -> Result<Option<usize>> {
        self.fatal()?;
        let n = bufs.len();
        if !(1..=MAX_RECVS).contains(&n) {
            return Err(Error::Internal(format!("irecv of {n} buffers (1..={MAX_RECVS})")));
        }
        let slot = (self.head % SLOTS as u64) as usize;
        if self.slots[slot].state != State::Free {
            self.progress()?;
            return Ok(None);
        }
        self.qp.post_recv(WR_RECV | slot as u64)?;
        let idx = self.head + 1;
        for (r, (b, tag)) in bufs.iter().enumerate() {
            let off = (slot * MAX_RECVS + r) * ENTRY;
            self.cts_stage.store_u64(off, b.addr);
            self.cts_stage.store_u64(off + 8, b.size);
            self.cts_stage.store_u64(off + 16, u64::from(b.rkey) | (u64::from(*tag as u32) << 32));
            self.cts_stage.store_u64(off + 24, n as u64);
            self.cts_stage.store_u64(off + 32, idx);
        }
        let off = slot * MAX_RECVS * ENTRY;
        self.qp.post_send(&[SendWr {
            wr_id: WR_CTS | slot as u64,
            op: Op::Write,
            signaled: true,
            local: Some((self.cts_stage.addr(off), (n * ENTRY) as u32, self.cts_stage.lkey())),
            remote_addr: self.remote_fifo.0 + off as u64,
            rkey: self.remote_fifo.1,
        }])?;
        self.slots[slot] = RecvSlot { state: State::Pending, n, sizes: [0; MAX_RECVS] };
        self.head += 1;
        Ok(Some(slot))
    }

    /// Issues the flush read for a receive into `buf` (the last non-empty buffer).
    pub fn iflush(&mut self, buf: Option<Buf>) -> Result<Option<usize>> {
        self.fatal()?;
        let (Some(f), Some(b)) = (&self.flusher, buf) else { return Ok(None) };
        let k = self.flush_head % SLOTS;
        if self.flushes[k] != State::Free {
            return Err(Error::Internal(format!("more than {SLOTS} flushes outstanding")));
        }
        f.qp.post_send(&[SendWr {
            wr_id: WR_FLUSH | k as u64,
            op: Op::Read,
            signaled: true,
            local: Some((f.target.addr(0), 1, f.target.lkey())),
            remote_addr: b.addr,
            rkey: b.rkey,
        }])?;
        self.flushes[k] = State::Pending;
        self.flush_head += 1;
        Ok(Some(SLOTS + k))
    }

    pub fn progress(&mut self) -> Result<()> {
        let mut wcs = [Completion::default(); 16];
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for c in &wcs[..n] {
                check_completion(c, &mut self.fatal, &self.peer);
                if c.status != 0 {
                    continue;
                }
                let i = (c.wr_id & 0xff) as usize % SLOTS;
                match c.wr_id & !0xffff_ffff {
                    WR_RECV => {
                        let imm = c.imm.unwrap_or(0);
                        let s = &mut self.slots[i];
                        if imm & IMM_SIZES == 0 {
                            s.sizes[0] = u64::from(imm);
                        } else {
                            for r in 0..s.n {
                                s.sizes[r] = self.sizes.load_u64((i * MAX_RECVS + r) * 8);
                            }
                        }
                        s.state = State::Done;
                    }
                    WR_FLUSH => self.flushes[i] = State::Done,
                    _ => {} // CTS writes: nothing to do
                }
            }
            if n < wcs.len() {
                return self.fatal();
            }
        }
    }

    /// Receive request `id` (`< SLOTS`) or flush request (`SLOTS..`): `Some(sizes)` once done.
    pub fn test(&mut self, id: usize, sizes: &mut [u64; MAX_RECVS]) -> Result<Option<usize>> {
        let done = |c: &Self| {
            if id < SLOTS {
                c.slots[id].state == State::Done
            } else {
                c.flushes[id - SLOTS] == State::Done
            }
        };
        let free = if id < SLOTS {
            self.slots[id].state == State::Free
        } else {
            self.flushes.get(id - SLOTS).is_none_or(|s| *s == State::Free)
        };
        if id >= 2 * SLOTS || free {
            return Err(Error::Internal(format!(
                "test of an unknown or free receive request {id}"
            )));
        }
        if !done(self) {
            self.progress()?;
            if !done(self) {
                return Ok(None);
            }
        }
        if id < SLOTS {
            let s = &mut self.slots[id];
            *sizes = s.sizes;
            s.state = State::Free;
            Ok(Some(s.n))
        } else {
            self.flushes[id - SLOTS] = State::Free;
            Ok(Some(0))
        }
    }

    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        if let Err(e) = self.qp.to_error() {
            log::warn!("closing the receive comm from {}: {e}", self.peer);
        }
        if let Some(Err(e)) = self.flusher.as_ref().map(|f| f.qp.to_error()) {
            log::warn!("closing the flush QP: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_carry_kind_and_slot() {
        for (kind, slot) in [(WR_SEND, 0u64), (WR_CTS, 31), (WR_RECV, 17), (WR_FLUSH, 5)] {
            let id = kind | slot;
            assert_eq!(id & !0xffff_ffff, kind);
            assert_eq!(id & 0xff, slot);
        }
        assert_eq!(SLOTS * MAX_RECVS * ENTRY, 16384);
        const { assert!(SLOTS <= 0x100, "slot must fit the immediate's low byte") };
    }

    #[test]
    fn failed_completions_carry_a_hint() {
        let mut fatal = None;
        let c = Completion { status: 12, wr_id: WR_SEND | 3, ..Default::default() };
        check_completion(&c, &mut fatal, "peer 198.18.0.2");
        let msg = fatal.clone().unwrap();
        assert!(msg.contains("198.18.0.2") && msg.contains("NCCL_IB_TIMEOUT"), "{msg}");
        // The first error is kept.
        check_completion(&Completion { status: 5, ..Default::default() }, &mut fatal, "x");
        assert_eq!(fatal.unwrap(), msg);
    }
}
