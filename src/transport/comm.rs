//! The data path: receiver-driven RDMA writes over the RC queue pairs of a connection.
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
//! With several QPs (`NCCL_IB_QPS_PER_CONNECTION`), split mode cuts every buffer into
//! 128-byte-aligned chunks, one per QP, each QP ending with its own write-with-immediate; the
//! receive completes when every QP's immediate has arrived. Round-robin mode sends whole
//! messages on QP `slot % nqps`. CTS writes always use QP 0.
//!
//! Work posted without a completion for `FERROCE_PROGRESS_TIMEOUT_MS` is an error: a peer whose
//! device vanished may never produce the retry-exceeded completion that normally ends the wait.
//!
//! Invariants:
//! - Requests live in fixed arrays (no allocation per request); NCCL's request pointer is the
//!   address of a [`ReqHeader`] whose `owner` is the address of the boxed comm.
//! - A slot is reused only after NCCL has seen every request of its previous use complete.
//! - The receive WQE is posted before the CTS that allows the matching write, so the sender
//!   never meets receiver-not-ready.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::NetDevice;
use super::mr_cache::MemKind;
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
            "protection/access error: the peer's registration is gone (its process or device \
             may have died), or a buffer was not registered"
        }
        5 => "flushed: an earlier error moved the queue pair to the error state",
        _ => "see `rdma resource show qp` and dmesg",
    }
}

/// Records the first failed completion of a comm; every later call reports it.
fn check_completion(c: &Completion, fatal: &mut Option<String>, path: &Path) {
    if c.status != 0 && fatal.is_none() {
        *fatal = Some(format!(
            "completion error with {}: {} (status {}, vendor_err {:#x}, wr {:#x}) on {}: {}",
            path.peer,
            verbs::status_str(c.status),
            c.status,
            c.vendor_err,
            c.wr_id,
            path.describe,
            hint(c.status)
        ));
    }
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
}

/// Turns "work posted, nothing completes" into an error after `timeout`.
struct Watchdog {
    outstanding: usize,
    since: Instant,
    timeout: Duration,
}

impl Watchdog {
    fn new(timeout: Duration) -> Watchdog {
        Watchdog { outstanding: 0, since: Instant::now(), timeout }
    }

    fn posted(&mut self) {
        if self.outstanding == 0 {
            self.since = Instant::now();
        }
        self.outstanding += 1;
    }

    fn completed(&mut self, all_done: bool) {
        self.since = Instant::now();
        if all_done {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }

    fn check(&self, fatal: &mut Option<String>, path: &Path) {
        if self.outstanding > 0 && fatal.is_none() && self.since.elapsed() > self.timeout {
            *fatal = Some(format!(
                "no completion from {} for {} ms with {} operations outstanding \
                 (FERROCE_PROGRESS_TIMEOUT_MS): the peer or its device is gone, or the path \
                 drops everything; check the GID, MTU, PFC/ECN and NCCL_IB_TIMEOUT on {}",
                path.peer,
                self.timeout.as_millis(),
                self.outstanding,
                path.describe
            ));
        }
    }
}

/// The first failure of a comm, as every later call reports it.
fn reported(fatal: &Option<String>) -> Result<()> {
    fatal.as_ref().map_or(Ok(()), |e| Err(Error::Remote(e.clone())))
}

/// `nqps` RC queue pairs on device `d`, sharing `cq`, moved to INIT with `access`.
fn create_qps(
    d: &NetDevice,
    cq: &Arc<Cq>,
    nqps: usize,
    caps: verbs::QpCaps,
    access: u32,
) -> Result<Vec<Qp>> {
    (0..nqps)
        .map(|_| {
            let qp = Qp::create_rc(&d.pd, cq, caps)?;
            qp.to_init(d.port, access)?;
            Ok(qp)
        })
        .collect()
}

/// The lanes (QP indices) a slot's message uses.
fn lanes(split: bool, nqps: usize, slot: usize) -> std::ops::Range<usize> {
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
    /// Lanes whose final completion has not arrived yet.
    cqes: u16,
}

/// A growing chain of work requests for one QP, posted in batches of `MAX_CHAIN`.
struct Chain<'a> {
    qp: &'a Qp,
    wrs: [SendWr; MAX_CHAIN],
    len: usize,
    posted: usize,
}

impl<'a> Chain<'a> {
    fn new(qp: &'a Qp) -> Chain<'a> {
        let empty = SendWr {
            wr_id: 0,
            op: Op::Write,
            signaled: false,
            local: None,
            remote_addr: 0,
            rkey: 0,
        };
        Chain { qp, wrs: [empty; MAX_CHAIN], len: 0, posted: 0 }
    }

    fn push(&mut self, wr: SendWr) -> Result<()> {
        if self.len == MAX_CHAIN {
            self.flush()?;
        }
        self.wrs[self.len] = wr;
        self.len += 1;
        Ok(())
    }

    fn last(&mut self) -> Option<&mut SendWr> {
        self.len.checked_sub(1).map(|i| &mut self.wrs[i])
    }

    fn flush(&mut self) -> Result<()> {
        self.qp.post_send(&self.wrs[..self.len])?;
        self.posted += self.len;
        self.len = 0;
        Ok(())
    }
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
    split: bool,
    /// Per QP: send-queue entries in use, and bytes carried (the statistics).
    sq_used: Vec<usize>,
    bytes: Vec<u64>,
    /// Per slot and QP: work requests posted for the slot's current use.
    slot_wrs: Vec<usize>,
    watchdog: Watchdog,
    fatal: Option<String>,
    pub path: Path,
    qps: Vec<Qp>,
    cq: Arc<Cq>,
    pub net: Arc<Net>,
    pub dev: usize,
}

/// Everything `setup` builds for a send comm before the peer answers.
pub struct SendParts {
    pub qps: Vec<Qp>,
    pub cq: Arc<Cq>,
    pub fifo: RegisteredBuf,
    pub sizes_stage: RegisteredBuf,
}

impl SendParts {
    pub fn new(net: &Arc<Net>, dev: usize, nqps: usize) -> Result<SendParts> {
        let d = &net.devices[dev];
        let cq = Cq::new(&d.ctx, (nqps * SEND_QUEUE + 64).min(32767) as i32)?;
        let caps = verbs::QpCaps { max_send_wr: SEND_QUEUE as u32, max_recv_wr: 1 };
        let qps =
            create_qps(d, &cq, nqps, caps, verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE)?;
        // The CTS FIFO is registered without IBV_ACCESS_RELAXED_ORDERING, always: isend reads an
        // entry as valid once its last word (idx) has landed, which is only sound if the
        // receiver's RDMA write lands in order. Relaxed ordering is for NCCL's buffers only.
        let fifo = RegisteredBuf::new(
            &d.pd,
            SLOTS * MAX_RECVS * ENTRY,
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE,
        )?;
        let sizes_stage =
            RegisteredBuf::new(&d.pd, SLOTS * MAX_RECVS * 8, verbs::ACCESS_LOCAL_WRITE)?;
        Ok(SendParts { qps, cq, fifo, sizes_stage })
    }
}

impl SendComm {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        parts: SendParts,
        net: Arc<Net>,
        dev: usize,
        path: Path,
        split: bool,
        remote_sizes: (u64, u32),
        max_msg: u64,
    ) -> Box<SendComm> {
        let mut headers = [ReqHeader::default(); SLOTS * MAX_RECVS];
        for (i, h) in headers.iter_mut().enumerate() {
            *h = ReqHeader { owner: 0, kind: ReqKind::Send, index: i as u16 };
        }
        let nqps = parts.qps.len();
        let timeout = net.config.progress_timeout;
        let mut c = Box::new(SendComm {
            headers,
            reqs: [SendReq::default(); SLOTS * MAX_RECVS],
            slots: [SendSlot::default(); SLOTS],
            head: 0,
            fifo: parts.fifo,
            sizes_stage: parts.sizes_stage,
            remote_sizes,
            max_msg: max_msg.max(4096),
            split: split && nqps > 1,
            sq_used: vec![0; nqps],
            bytes: vec![0; nqps],
            slot_wrs: vec![0; SLOTS * nqps],
            watchdog: Watchdog::new(timeout),
            fatal: None,
            path,
            qps: parts.qps,
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
        reported(&self.fatal)
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
            return Err(Error::Remote(format!(
                "{} sent a CTS with {nreqs} buffers",
                self.path.peer
            )));
        }
        if (0..nreqs).any(|r| self.entry(slot, r, 4) != want) {
            return Ok(None); // the rest of the row is still landing
        }
        // A fresh slot must not still hold requests NCCL has not yet seen complete.
        let fresh = self.slots[slot].matched == 0;
        let range = slot * MAX_RECVS..(slot + 1) * MAX_RECVS;
        if fresh && self.reqs[range].iter().any(|r| r.state != State::Free) {
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
                buf.size, self.path.peer
            )));
        }
        let last = s.matched.count_ones() as usize + 1 == nreqs;
        let mut bufs = s.bufs;
        bufs[r] = Some(buf);
        if last && !self.fits(slot, &bufs[..nreqs]) {
            self.progress()?;
            return Ok(None);
        }
        let id = slot * MAX_RECVS + r;
        self.reqs[id] = SendReq { state: State::Pending, size: buf.size };
        let s = &mut self.slots[slot];
        s.matched |= 1 << r;
        s.bufs = bufs;
        if last {
            self.post(slot, nreqs)?;
            self.head += 1;
        }
        Ok(Some(id))
    }

    /// Work requests lane `q` needs for `bufs` (data pieces, size record, immediate).
    fn wrs_for(&self, bufs: &[Option<Buf>], q: usize) -> usize {
        let nqps = self.qps.len();
        let data: u64 = bufs
            .iter()
            .map(|b| {
                lane_part(b.map_or(0, |b| b.size), self.split, nqps, q).1.div_ceil(self.max_msg)
            })
            .sum();
        data as usize + 2
    }

    fn fits(&self, slot: usize, bufs: &[Option<Buf>]) -> bool {
        lanes(self.split, self.qps.len(), slot)
            .all(|q| self.sq_used[q] + self.wrs_for(bufs, q) <= SEND_QUEUE)
    }

    /// Posts the slot's chains: on each lane, the data writes, the size record (lane 0 of the
    /// slot, when needed), and the lane's final write-with-immediate.
    fn post(&mut self, slot: usize, nreqs: usize) -> Result<()> {
        let bufs = self.slots[slot].bufs;
        let sizes: [u64; MAX_RECVS] = std::array::from_fn(|r| bufs[r].map_or(0, |b| b.size));
        let single = nreqs == 1 && sizes[0] < u64::from(IMM_SIZES);
        let imm = if single {
            sizes[0] as u32
        } else {
            for (r, &sz) in sizes.iter().enumerate().take(nreqs) {
                self.sizes_stage.store_u64((slot * MAX_RECVS + r) * 8, sz);
            }
            IMM_SIZES | slot as u32
        };
        let nqps = self.qps.len();
        let lanes = lanes(self.split, nqps, slot);
        let first = lanes.start;
        for q in lanes.clone() {
            let wr_id = WR_SEND | (q as u64) << 8 | slot as u64;
            let mut chain = Chain::new(&self.qps[q]);
            let mut data = 0;
            for (r, b) in bufs.iter().enumerate().take(nreqs) {
                let Some(b) = b else { continue };
                let (raddr, rkey) = (self.entry(slot, r, 0), self.entry(slot, r, 2) as u32);
                let (off, len) = lane_part(b.size, self.split, nqps, q);
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(self.max_msg);
                    let at = off + done;
                    chain.push(SendWr {
                        wr_id,
                        op: Op::Write,
                        signaled: false,
                        local: Some((b.addr + at, n as u32, b.lkey)),
                        remote_addr: raddr + at,
                        rkey,
                    })?;
                    done += n;
                }
                data += len;
            }
            if !single && q == first {
                chain.push(SendWr {
                    wr_id,
                    op: Op::Write,
                    signaled: false,
                    local: Some((
                        self.sizes_stage.addr(slot * MAX_RECVS * 8),
                        (nreqs * 8) as u32,
                        self.sizes_stage.lkey(),
                    )),
                    remote_addr: self.remote_sizes.0 + (slot * MAX_RECVS * 8) as u64,
                    rkey: self.remote_sizes.1,
                })?;
            }
            // The last data write carries the immediate when it can; otherwise a 0-byte one.
            match chain.last() {
                Some(w) if single && data > 0 && w.op == Op::Write => {
                    w.op = Op::WriteImm(imm);
                    w.signaled = true;
                }
                _ => chain.push(SendWr {
                    wr_id,
                    op: Op::WriteImm(imm),
                    signaled: true,
                    local: None,
                    remote_addr: 0,
                    rkey: 0,
                })?,
            }
            chain.flush()?;
            self.slot_wrs[slot * nqps + q] = chain.posted;
            self.sq_used[q] += chain.posted;
            self.bytes[q] += data;
        }
        let s = &mut self.slots[slot];
        s.cqes = lanes.len() as u16;
        s.matched = 0;
        s.bufs = [None; MAX_RECVS];
        self.watchdog.posted();
        Ok(())
    }

    /// Drains the CQ.
    pub fn progress(&mut self) -> Result<()> {
        let mut wcs = [Completion::default(); 16];
        let nqps = self.qps.len();
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for c in &wcs[..n] {
                check_completion(c, &mut self.fatal, &self.path);
                if c.wr_id & !0xffff_ffff != WR_SEND {
                    continue;
                }
                let slot = (c.wr_id & 0xff) as usize % SLOTS;
                let q = ((c.wr_id >> 8) & 0xff) as usize % nqps;
                self.sq_used[q] = self.sq_used[q].saturating_sub(self.slot_wrs[slot * nqps + q]);
                self.slot_wrs[slot * nqps + q] = 0;
                let s = &mut self.slots[slot];
                s.cqes = s.cqes.saturating_sub(1);
                self.watchdog.completed(s.cqes == 0);
                if s.cqes == 0 {
                    for req in &mut self.reqs[slot * MAX_RECVS..(slot + 1) * MAX_RECVS] {
                        if req.state == State::Pending {
                            req.state = State::Done;
                        }
                    }
                }
            }
            if n < wcs.len() {
                self.watchdog.check(&mut self.fatal, &self.path);
                if let (None, Err(e)) = (&self.fatal, self.net.devices[self.dev].check_alive()) {
                    self.fatal = Some(e.to_string());
                }
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
        if req.state == State::Free {
            return Err(Error::Internal(format!("test of a free send request {id}")));
        }
        if req.state == State::Pending {
            self.progress()?;
        }
        if self.reqs[id].state == State::Done {
            self.reqs[id].state = State::Free;
            return Ok(Some(req.size));
        }
        Ok(None)
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        // Flush outstanding work before the buffers go; a failure is logged, teardown goes on.
        for qp in &self.qps {
            if let Err(e) = qp.to_error() {
                log::warn!("closing the send comm to {}: {e}", self.path.peer);
            }
        }
        let stats: Vec<String> = (0..self.qps.len())
            .map(|q| {
                let port = self.path.sports.get(q).copied().unwrap_or(0);
                format!(
                    "QP {q} (qpn {:#x}, sport {port}) {} bytes",
                    self.qps[q].qpn(),
                    self.bytes[q]
                )
            })
            .collect();
        log::info!("send comm to {} closed: {}", self.path.peer, stats.join(", "));
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct RecvSlot {
    state: State,
    n: usize,
    /// Immediates still expected (one per lane).
    imms: u16,
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
    split: bool,
    watchdog: Watchdog,
    fatal: Option<String>,
    pub path: Path,
    flusher: Option<Flusher>,
    qps: Vec<Qp>,
    cq: Arc<Cq>,
    pub net: Arc<Net>,
    pub dev: usize,
}

/// Everything `setup` builds for a receive comm.
pub struct RecvParts {
    pub qps: Vec<Qp>,
    pub cq: Arc<Cq>,
    pub cts_stage: RegisteredBuf,
    pub sizes: RegisteredBuf,
}

impl RecvParts {
    pub fn new(net: &Arc<Net>, dev: usize, nqps: usize) -> Result<RecvParts> {
        let d = &net.devices[dev];
        let cq = Cq::new(&d.ctx, ((nqps + 4) * 2 * SLOTS).min(32767) as i32)?;
        let caps =
            verbs::QpCaps { max_send_wr: (2 * SLOTS) as u32, max_recv_wr: (2 * SLOTS) as u32 };
        let access =
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE | verbs::ACCESS_REMOTE_READ;
        let qps = create_qps(d, &cq, nqps, caps, access)?;
        let cts_stage =
            RegisteredBuf::new(&d.pd, SLOTS * MAX_RECVS * ENTRY, verbs::ACCESS_LOCAL_WRITE)?;
        let sizes = RegisteredBuf::new(
            &d.pd,
            SLOTS * MAX_RECVS * 8,
            verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE,
        )?;
        Ok(RecvParts { qps, cq, cts_stage, sizes })
    }
}

impl RecvComm {
    pub fn new(
        parts: RecvParts,
        flusher: Option<Flusher>,
        net: Arc<Net>,
        dev: usize,
        path: Path,
        split: bool,
        remote_fifo: (u64, u32),
    ) -> Box<RecvComm> {
        let mut headers = [ReqHeader::default(); 2 * SLOTS];
        for (i, h) in headers.iter_mut().enumerate() {
            let kind = if i < SLOTS { ReqKind::Recv } else { ReqKind::Flush };
            *h = ReqHeader { owner: 0, kind, index: (i % SLOTS) as u16 };
        }
        let timeout = net.config.progress_timeout;
        let split = split && parts.qps.len() > 1;
        let mut c = Box::new(RecvComm {
            headers,
            slots: [RecvSlot::default(); SLOTS],
            flushes: [State::Free; SLOTS],
            flush_head: 0,
            head: 0,
            cts_stage: parts.cts_stage,
            sizes: parts.sizes,
            remote_fifo,
            split,
            watchdog: Watchdog::new(timeout),
            fatal: None,
            path,
            flusher,
            qps: parts.qps,
            cq: parts.cq,
            net,
            dev,
        });
        let owner = &*c as *const RecvComm as usize;
        c.headers.iter_mut().for_each(|h| h.owner = owner);
        c
    }

    fn fatal(&self) -> Result<()> {
        reported(&self.fatal)
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
        let lanes = lanes(self.split, self.qps.len(), slot);
        for q in lanes.clone() {
            self.qps[q].post_recv(WR_RECV | slot as u64)?;
        }
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
        self.qps[0].post_send(&[SendWr {
            wr_id: WR_CTS | slot as u64,
            op: Op::Write,
            signaled: true,
            local: Some((self.cts_stage.addr(off), (n * ENTRY) as u32, self.cts_stage.lkey())),
            remote_addr: self.remote_fifo.0 + off as u64,
            rkey: self.remote_fifo.1,
        }])?;
        self.watchdog.posted();
        self.slots[slot] =
            RecvSlot { state: State::Pending, n, imms: lanes.len() as u16, sizes: [0; MAX_RECVS] };
        self.head += 1;
        Ok(Some(slot))
    }

    /// Issues the flush read for a completed receive whose non-empty buffers are `bufs`: one
    /// RDMA read of the last one in GPU memory (of the last one, with `FERROCE_FORCE_FLUSH=1`).
    /// `Ok(None)`: nothing to flush (host memory, or no flush QP on this device).
    pub fn iflush(&mut self, bufs: &[(Buf, MemKind)]) -> Result<Option<usize>> {
        self.fatal()?;
        let force = self.net.config.force_flush;
        let target = bufs.iter().rev().find(|(b, k)| b.size > 0 && (force || k.is_gpu()));
        let (Some(f), Some(&(b, _))) = (&self.flusher, target) else { return Ok(None) };
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
        self.watchdog.posted();
        self.flushes[k] = State::Pending;
        self.flush_head += 1;
        Ok(Some(SLOTS + k))
    }

    pub fn progress(&mut self) -> Result<()> {
        let mut wcs = [Completion::default(); 16];
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for c in &wcs[..n] {
                check_completion(c, &mut self.fatal, &self.path);
                if c.status != 0 {
                    continue;
                }
                let i = (c.wr_id & 0xff) as usize % SLOTS;
                match c.wr_id & !0xffff_ffff {
                    WR_RECV => {
                        let imm = c.imm.unwrap_or(0);
                        let s = &mut self.slots[i];
                        s.imms = s.imms.saturating_sub(1);
                        if s.imms > 0 {
                            continue;
                        }
                        if imm & IMM_SIZES == 0 {
                            s.sizes[0] = u64::from(imm);
                        } else {
                            for r in 0..s.n {
                                s.sizes[r] = self.sizes.load_u64((i * MAX_RECVS + r) * 8);
                            }
                        }
                        s.state = State::Done;
                    }
                    WR_FLUSH => {
                        self.flushes[i] = State::Done;
                        self.watchdog.completed(true);
                    }
                    _ => self.watchdog.completed(true), // a CTS write
                }
            }
            if n < wcs.len() {
                self.watchdog.check(&mut self.fatal, &self.path);
                if let (None, Err(e)) = (&self.fatal, self.net.devices[self.dev].check_alive()) {
                    self.fatal = Some(e.to_string());
                }
                return self.fatal();
            }
        }
    }

    /// Receive request `id` (`< SLOTS`) or flush request (`SLOTS..`): `Some(n)` once done,
    /// with the `n` received sizes in `sizes`.
    pub fn test(&mut self, id: usize, sizes: &mut [u64; MAX_RECVS]) -> Result<Option<usize>> {
        let state = |c: &Self| match id {
            i if i < SLOTS => Some(c.slots[i].state),
            i => c.flushes.get(i - SLOTS).copied(),
        };
        match state(self) {
            None | Some(State::Free) => {
                return Err(Error::Internal(format!(
                    "test of an unknown or free receive request {id}"
                )));
            }
            Some(State::Pending) => self.progress()?,
            Some(State::Done) => {}
        }
        if state(self) != Some(State::Done) {
            return Ok(None);
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
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        let flush_qp = self.flusher.as_ref().map(|f| &f.qp);
        for qp in self.qps.iter().chain(flush_qp) {
            if let Err(e) = qp.to_error() {
                log::warn!("closing the receive comm from {}: {e}", self.path.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Equal shares within one chunk alignment.
        let parts: Vec<u64> = (0..4).map(|q| lane_part(1 << 20, true, 4, q).1).collect();
        assert_eq!(parts, [262144; 4]);
        assert_eq!(lane_part(1000, false, 4, 2), (0, 1000));
    }

    #[test]
    fn lanes_by_mode() {
        assert_eq!(lanes(true, 4, 9), 0..4);
        assert_eq!(lanes(false, 4, 9), 1..2);
        assert_eq!(lanes(false, 1, 31), 0..1);
    }

    #[test]
    fn the_watchdog_fires_only_with_work_outstanding() {
        let path = Path { peer: "p".into(), ..Default::default() };
        let mut w = Watchdog::new(Duration::from_millis(20));
        let mut fatal = None;
        std::thread::sleep(Duration::from_millis(30));
        w.check(&mut fatal, &path);
        assert!(fatal.is_none(), "idle is not a failure");
        w.posted();
        w.completed(true);
        std::thread::sleep(Duration::from_millis(30));
        w.check(&mut fatal, &path);
        assert!(fatal.is_none(), "everything completed");
        w.posted();
        std::thread::sleep(Duration::from_millis(30));
        w.check(&mut fatal, &path);
        assert!(fatal.unwrap().contains("FERROCE_PROGRESS_TIMEOUT_MS"));
    }

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
        let path =
            Path { peer: "198.18.0.2:4000".into(), describe: "GID a -> b".into(), sports: vec![] };
        check_completion(&c, &mut fatal, &path);
        let msg = fatal.clone().unwrap();
        assert!(
            msg.contains("198.18.0.2")
                && msg.contains("NCCL_IB_TIMEOUT")
                && msg.contains("GID a -> b"),
            "{msg}"
        );
        // The first error is kept.
        check_completion(&Completion { status: 5, ..Default::default() }, &mut fatal, &path);
        assert_eq!(fatal.unwrap(), msg);
    }
}
