//! The data path's I/O: each comm owns its verbs objects (queue pairs, completion queue, the
//! registered control buffers) and a protocol core from [`ferroce_core::data`], which decides
//! everything. This layer only posts what the core asks for ([`Qps`]), shows the core the
//! buffers the NICs read and write ([`Words`] over [`RegisteredBuf`]), and feeds the CQ's
//! completions back through one progress loop ([`progress`]) shared by both ends.
//!
//! Each comm names its requests by ([`ReqKind`], slot) through `requests`, in the order of
//! the ids its calls return; `ffi` turns them into NCCL's request pointers (no allocation per
//! request).
//!
//! Least privilege: each queue pair grants the peer only what its role needs ([`qp_access`],
//! from the core's [`Grant`]s), and each control buffer is registered with only the access its
//! role needs ([`CONTROL_IN`], [`STAGE`], [`FLUSH_TARGET`]). Nothing here grants remote read
//! except the flush QP, which only its own RDMA read reaches.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::device::{Counters, NetDevice, Queue, Watch};
use super::mr_cache::MemKind;
use super::net::Net;
use super::profile::{Events, Profiler};
use super::reg::MrHandle;
use crate::error::{Error, Result};
use crate::verbs::{self, Cq, Mr, Qp, RegisteredBuf, RtrAttr, RtsAttr};
use crate::wr::{Completion, SendWr};
use ferroce_core::data::Traffic;
use ferroce_core::data::{
    FIFO_AREA, Fault, Grant, IDLE_EVERY, Keys, Line, Post, Posted, RECV_SEND_QUEUE, RecvCore,
    Remote, SIZE_AREA, SendCore, Words, recv_grant, send_grant,
};

pub use ferroce_core::data::{
    Buf, FLUSH_BASE, FLUSH_QUEUE, MAX_RECVS, Params, Path, SLOTS, send_queue,
};

/// The `qp_access_flags` of a QP that grants `g`. `IBV_ACCESS_LOCAL_WRITE` is never asked:
/// on a QP it means nothing (the local NIC's own operations are checked against the memory
/// regions' access, not the QP's).
pub fn qp_access(g: Grant) -> u32 {
    match g {
        Grant::Nothing => 0,
        Grant::Write => verbs::ACCESS_REMOTE_WRITE,
        Grant::Read => verbs::ACCESS_REMOTE_READ,
    }
}

/// A control buffer the peer's NIC writes: the sender's CTS FIFO, the receiver's size records.
/// Verbs requires local write with remote write. No remote read: the peer never reads them.
/// Never relaxed ordering: readers take an entry as valid once its last word has landed, which
/// is only sound if the peer's write lands in order.
pub const CONTROL_IN: u32 = verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE;
/// A staging buffer the local NIC only reads (the source of CTS and size-record writes): no
/// access flag at all, local read being always allowed.
pub const STAGE: u32 = 0;
/// The flush's scratch word, which the flush QP's RDMA read writes into: local write only.
pub const FLUSH_TARGET: u32 = verbs::ACCESS_LOCAL_WRITE;

/// Inline payload asked of a receive comm's first lane, where its CTS rows go until it first
/// fails: one CTS row (64 bytes), the common batch; larger batches go from the stage. The
/// provider sizes every send-queue entry for it: Soft-RoCE's entry is 256 bytes with up to 48
/// inline, 512 with 64, 1,024 with 512. Its other lanes ask for [`SEND_INLINE`]: they carry
/// probes, and rows only once the first lane failed, from the stage as batches go.
const INLINE: u32 = 64;

/// Inline payload asked of a send comm's QPs: one size record and small sends from host
/// memory; 48 bytes keep Soft-RoCE's entry at 256 bytes. NCCL sends from GPU
/// memory, which never go inline. A receive comm's lanes but its first ask for it too.
const SEND_INLINE: u32 = 48;

/// A send comm's queue pairs: room for the core's send queue; the one receive WQE verbs wants.
fn send_caps(nqps: usize) -> verbs::QpCaps {
    verbs::QpCaps { max_send_wr: send_queue(nqps) as u32, max_recv_wr: 1, max_inline: SEND_INLINE }
}

/// A receive comm's queue pair for lane `q`: CTS writes and probes, and every receive WQE of
/// the lane (`split`: the sender splits messages across the lanes).
fn recv_caps(q: usize, nqps: usize, split: bool) -> verbs::QpCaps {
    verbs::QpCaps {
        max_send_wr: RECV_SEND_QUEUE as u32,
        max_recv_wr: ferroce_core::data::recv_queue(nqps, split) as u32,
        max_inline: if q == 0 { INLINE } else { SEND_INLINE },
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum ReqKind {
    #[default]
    Send,
    Recv,
    Flush,
}

/// `[addr, addr + size)` of the registration `h`, with its keys on each of a comm's member
/// ports `members` (device indices): it must lie inside the registration on every one.
#[inline(always)]
pub fn buf_within(h: &MrHandle, members: &[usize], addr: u64, size: u64) -> Result<Buf> {
    let end = addr.checked_add(size).ok_or_else(|| Error::Internal("buffer wraps".into()))?;
    let host = h.kind == MemKind::Host;
    // The common case, a comm over the devices it was registered on: the keys made then.
    let same =
        h.parts.len() == members.len() && h.parts.iter().zip(members).all(|(p, d)| p.dev == *d);
    if same && (size == 0 || (addr >= h.common.0 && end <= h.common.1)) {
        let (lkeys, rkeys) = h.keys;
        return Ok(Buf { addr, size, lkeys, rkeys, host });
    }
    let mut b = Buf { addr, size, host, ..Buf::default() };
    for (m, dev) in members.iter().enumerate() {
        let Some(part) = h.parts.iter().find(|p| p.dev == *dev) else {
            return Err(Error::InvalidUsage(format!(
                "a buffer registered on device(s) {:?} used on a comm over devices \
                 {members:?}: register it on this comm",
                h.parts.iter().map(|p| p.dev).collect::<Vec<_>>()
            )));
        };
        let mr: &Mr = &part.mr;
        if size > 0 && (addr < mr.addr || end > mr.addr + mr.len as u64) {
            return Err(Error::Internal(format!(
                "buffer {addr:#x}+{size} is outside its registration {:#x}+{}",
                mr.addr, mr.len
            )));
        }
        (b.lkeys[m], b.rkeys[m]) = (mr.lkey, mr.rkey);
    }
    Ok(b)
}

impl Words for RegisteredBuf {
    fn load(&self, word: usize) -> u64 {
        self.load_u64(word * 8)
    }
    fn store(&self, word: usize, v: u64) {
        self.store_u64(word * 8, v)
    }
    fn load_n<const N: usize>(&self, word: usize) -> [u64; N] {
        RegisteredBuf::load_n(self, word * 8)
    }
    fn store_n<const N: usize>(&self, word: usize, v: [u64; N]) {
        RegisteredBuf::store_n(self, word * 8, v)
    }
    fn addr(&self, word: usize) -> u64 {
        RegisteredBuf::addr(self, word * 8)
    }
    fn lkey(&self, member: usize) -> u32 {
        self.lkey_on(member)
    }
}

/// The peer's area at `addr`, with its key on each of the peer's member ports.
fn remote(addr: u64, rkeys: &[u32]) -> Remote {
    let mut r = Remote { addr, rkeys: Keys::default() };
    for (k, &key) in r.rkeys.iter_mut().zip(rkeys) {
        *k = key;
    }
    r
}

/// One member port of a comm: its device, the CQ of the queue pairs on it, and the watch of
/// its queues (async errors arrive per device).
struct Port {
    dev: usize,
    cq: Arc<Cq>,
    watch: Watch,
    /// The device's count of returns to ACTIVE last seen (port recovery).
    seen_up: u64,
    /// Its link was down at the last look.
    seen_down: bool,
    /// The device's count of news (a port down or back, a queue's error) last seen.
    seen_news: u64,
}

/// Whether any of `ports`' devices has news since the last look ([`DeviceFlags::news`]): only
/// then are their port states and the comm's alarms read, so that a poll that finds nothing
/// touches only its CQs, the clock and one word per port.
///
/// [`DeviceFlags::news`]: crate::transport::device::DeviceFlags::news
fn news(ports: &mut [Port]) -> bool {
    let seen = |p: &mut Port| {
        let n = p.watch.news();
        std::mem::replace(&mut p.seen_news, n) != n
    };
    // Most comms have one port: straight code for it (the loop is unrolled for many).
    match ports {
        [p] => seen(p),
        ports => ports.iter_mut().fold(false, |any, p| seen(p) | any),
    }
}

/// Tells `set` which of `ports`' links are down (by name, and as bits by member index), when
/// that changed since the last look.
fn links_down(net: &Net, ports: &mut [Port], set: impl FnOnce(Option<String>, u64)) {
    let mut changed = false;
    for p in ports.iter_mut() {
        let down = net.devices[p.dev].flags.port_down.load(Ordering::Acquire);
        changed |= down != p.seen_down;
        p.seen_down = down;
    }
    if changed {
        let down = ports.iter().filter(|p| p.seen_down);
        let names: Vec<String> = down.map(|p| net.devices[p.dev].name.clone()).collect();
        let bits = ports.iter().enumerate().filter(|(_, p)| p.seen_down);
        let bits = bits.fold(0u64, |b, (m, _)| b | 1 << m);
        set((!names.is_empty()).then(|| names.join(", ")), bits);
    }
}

/// The member port lane `q` of a comm over `n` ports is on: `q % n`, as NCCL places the queue
/// pairs of a fused device.
pub fn port_of(q: usize, n: usize) -> usize {
    q % n.max(1)
}

/// How a lane's queue pair was brought up, so that lane repair can bring a new one up alike:
/// its capabilities, the access it grants, and its RTR and RTS attributes (the repair gives
/// another peer QP and new PSNs).
#[derive(Clone, Copy, Debug)]
struct Link {
    caps: verbs::QpCaps,
    access: u32,
    rtr: RtrAttr,
    rts: RtsAttr,
}

/// The links of a comm's lanes: setup's attributes, with the access `grant` gives each.
fn links(
    caps: impl Fn(usize) -> verbs::QpCaps,
    attrs: &[(RtrAttr, RtsAttr)],
    grant: impl Fn(usize) -> Grant,
) -> Vec<Link> {
    let link = |(q, &(rtr, rts)): (usize, &(RtrAttr, RtsAttr))| Link {
        caps: caps(q),
        access: qp_access(grant(q)),
        rtr,
        rts,
    };
    attrs.iter().enumerate().map(link).collect()
}

/// A comm's queue pairs as the core's [`Post`]; indices from `qps.len()` are the flush QPs,
/// one per member port. Lane repair replaces a lane's QP with a new one on the same port and
/// CQ, watched like the old.
struct Qps<'a> {
    qps: &'a mut [Qp],
    flush: &'a [Flusher],
    links: &'a [Link],
    net: &'a Net,
    ports: &'a [Port],
}

impl Qps<'_> {
    #[inline(always)]
    fn qp(&self, i: usize) -> Result<&Qp> {
        // A lane first: the flush QPs only when it is not one.
        if let Some(q) = self.qps.get(i) {
            return Ok(q);
        }
        let flush = i.checked_sub(self.qps.len()).and_then(|f| self.flush.get(f));
        flush.map(|f| &f.qp).ok_or_else(|| Error::Internal(format!("no queue pair {i}")))
    }
}

impl Post for Qps<'_> {
    fn send(&mut self, qp: usize, wrs: &[SendWr]) -> Result<()> {
        self.qp(qp)?.post_send(wrs)
    }
    fn recv(&mut self, qp: usize, wr_id: u64, n: usize) -> Result<()> {
        self.qp(qp)?.post_recv(wr_id, n)
    }
    fn now(&self) -> Duration {
        crate::os::precise_now()
    }
    fn fresh(&mut self, qp: usize) -> Result<u32> {
        let l = self.links.get(qp).ok_or_else(|| Error::Internal(format!("no lane {qp}")))?;
        let port = &self.ports[port_of(qp, self.ports.len())];
        let new = new_qp(&self.net.devices[port.dev], &port.cq, l.caps, l.access)?;
        // The core marks a request inline by the lane's room when the comm was made: a queue
        // pair granted less would send such a request from memory, which the core must know
        // (it keeps that memory as it was until the write completes).
        let (had, got) = (self.qps[qp].max_inline(), new.max_inline());
        if got < had {
            return Err(Error::Internal(format!(
                "the new queue pair takes {got} bytes inline, the lane's took {had}"
            )));
        }
        let old = std::mem::replace(&mut self.qps[qp], new);
        port.watch.swap(Queue::Qp(old.qpn()), Queue::Qp(self.qps[qp].qpn()));
        // ERR first, as at close: the old QP's work flushes before it is destroyed (dropped).
        if let Err(e) = old.to_error() {
            log::debug!("lane {qp}'s old queue pair: {e}");
        }
        Ok(self.qps[qp].qpn())
    }
    fn fence(&mut self, qp: usize) -> Result<()> {
        self.qp(qp)?.to_error()
    }
    fn join(&mut self, qp: usize, peer: u32, (sq_psn, rq_psn): (u32, u32)) -> Result<()> {
        let l = self.links.get(qp).ok_or_else(|| Error::Internal(format!("no lane {qp}")))?;
        let q = self.qp(qp)?;
        q.to_rtr(&RtrAttr { dest_qpn: peer, rq_psn, ..l.rtr })?;
        q.to_rts(&RtsAttr { sq_psn, ..l.rts })
    }
}

/// How long `irecv` polls for room to write a row it had to stage (the CTS send queue full).
const STAGED_WAIT: Duration = Duration::from_millis(100);

/// One end's core, as the progress loop feeds it.
trait Drain {
    /// `got` completions were polled: the time, for placement, where it wants one.
    fn polled(&mut self, _got: usize) {}
    /// Lane `lane`'s queue pair failed on its own: `false` if no lane is left.
    fn lane_error(&mut self, lane: usize, why: &str) -> bool;
    fn take(&mut self, c: &Completion);
    fn idle(&mut self, now: Duration, elsewhere: Option<Fault>, io: &mut Qps) -> Result<()>;
    /// A poll that found completions, between two [`IDLE_EVERY`]s: what they make possible.
    fn after_poll(&mut self, now: Duration, io: &mut Qps) -> Result<()>;
}

/// The sender's core with the staging area of its size records (a chunk sent again
/// on another lane writes them again).
struct SendDrain<'a> {
    core: &'a mut SendCore,
    stage: &'a RegisteredBuf,
    fifo: &'a RegisteredBuf,
}

impl Drain for SendDrain<'_> {
    fn polled(&mut self, got: usize) {
        if self.core.needs_clock() {
            self.core.stamp(crate::os::precise_now(), got);
        }
    }
    #[inline(always)]
    fn take(&mut self, c: &Completion) {
        self.core.complete(c)
    }
    fn lane_error(&mut self, lane: usize, why: &str) -> bool {
        self.core.lane_error(lane, why)
    }
    #[inline(always)]
    fn idle(&mut self, now: Duration, elsewhere: Option<Fault>, io: &mut Qps) -> Result<()> {
        self.core.idle(now, elsewhere, io, (self.fifo, self.stage))
    }
    fn after_poll(&mut self, _now: Duration, io: &mut Qps) -> Result<()> {
        self.core.after_poll(self.stage, io)
    }
}

/// The receiver's core with the size records the sender's NIC writes, and the staging area
/// of its CTS rows.
struct RecvDrain<'a> {
    core: &'a mut RecvCore,
    stage: &'a RegisteredBuf,
    sizes: &'a RegisteredBuf,
}

impl Drain for RecvDrain<'_> {
    #[inline(always)]
    fn take(&mut self, c: &Completion) {
        self.core.complete(c, self.sizes)
    }
    fn lane_error(&mut self, lane: usize, why: &str) -> bool {
        self.core.lane_error(lane, why)
    }
    #[inline(always)]
    fn idle(&mut self, now: Duration, elsewhere: Option<Fault>, io: &mut Qps) -> Result<()> {
        self.core.idle(now, elsewhere, io, self.stage, self.sizes)
    }
    fn after_poll(&mut self, now: Duration, io: &mut Qps) -> Result<()> {
        self.core.after_poll(now, io, self.stage, self.sizes)
    }
}

/// The one progress loop: takes the lane errors the async-event thread queued (only when the
/// devices have `news`), drains each member port's CQ in batches into the core, then lets it
/// check its watchdog (against the coarse clock: a precise read costs microseconds under
/// emulation), the devices' health and the comm's whole-comm alarm once per [`IDLE_EVERY`]
/// (`lanes.idle_at`: when next), or at once on `news` or a failed poll; in between, a poll
/// that found completions runs what they make possible. The view of the comm's queue pairs
/// (`flush`: its flush QPs) is made only for what runs then, not for a poll that found
/// nothing. Every failure here is local and fails the comm for good. `Ok(false)`: the poll
/// found nothing, and nothing ran (so nothing is left to report or log).
fn progress(
    side: &mut impl Drain,
    lanes: &mut Lanes,
    flush: &[Flusher],
    news: bool,
) -> Result<bool> {
    // Queue pairs the async-event thread saw fail: a lane's failure each, while another
    // lives (taken before the poll, ahead of most of their flushed work). A queue pair number
    // is only unique on its device: the lanes of that port are searched. The thread bumps the
    // news count after it queues one, so without news there is none to take.
    let mut lost = None;
    if news {
        let n = lanes.ports.len();
        for (m, port) in lanes.ports.iter().enumerate() {
            while let Some((qpn, why)) = port.watch.alarm.lanes.pop() {
                let mine = |l: &usize| port_of(*l, n) == m && lanes.qps[*l].qpn() == qpn;
                let lane = (0..lanes.qps.len()).find(mine);
                if !lane.is_some_and(|l| side.lane_error(l, &why)) {
                    lost.get_or_insert(Fault::Local(why));
                }
            }
        }
    }
    let mut polled = None;
    // As in `news`: one port, most comms', without the loop.
    let any = match &lanes.ports[..] {
        [port] => drain(side, port, &mut polled),
        ports => ports.iter().fold(false, |any, p| drain(side, p, &mut polled) | any),
    };
    let now = crate::os::coarse_now();
    if polled.is_none() && !news && now < lanes.idle_at {
        if any {
            side.after_poll(now, &mut lanes.io(flush))?;
        }
        return Ok(any);
    }
    lanes.idle_at = now + IDLE_EVERY;
    let (net, ports) = (&lanes.net, &lanes.ports);
    let dead = |p: &Port| net.devices[p.dev].check_alive().err();
    let elsewhere = polled
        .or(lost)
        .or_else(|| ports.iter().find_map(dead).map(|e| Fault::Local(e.to_string())))
        .or_else(|| {
            let raised = ports.iter().find_map(|p| p.watch.alarm.raised.get());
            raised.map(|w| Fault::Local(w.clone()))
        });
    side.idle(now, elsewhere, &mut lanes.io(flush)).map(|()| true)
}

/// Drains `port`'s CQ into `side`, in batches: whether it found anything. A failed poll
/// fails the comm (`polled`). Inline: it runs on every poll.
#[inline(always)]
fn drain(side: &mut impl Drain, port: &Port, polled: &mut Option<Fault>) -> bool {
    let mut any = false;
    loop {
        let got = port.cq.poll_with(|i, n, c| {
            if i == 0 {
                side.polled(n);
            }
            side.take(c)
        });
        let got = got.unwrap_or_else(|e| {
            polled.get_or_insert(Fault::Local(format!("{e}; the connection is unusable")));
            0
        });
        any |= got > 0;
        if got < verbs::POLL_BATCH {
            return any;
        }
    }
}

/// The queue pairs `setup` builds for a comm before the peer answers: its lanes over the
/// member ports `devs`, lane `q` on `port_of(q)`, with one CQ per port.
pub struct Queues {
    pub devs: Vec<usize>,
    pub qps: Vec<Qp>,
    pub cqs: Vec<Arc<Cq>>,
}

impl Queues {
    /// `nqps` lanes with the `caps` and access `grant` gives each; CQs as in [`port_cqs`].
    fn new(
        net: &Net,
        (devs, nqps): (&[usize], usize),
        (per_lane, extra): (usize, usize),
        caps: impl Fn(usize) -> verbs::QpCaps,
        grant: impl Fn(usize) -> Grant,
    ) -> Result<Queues> {
        let cqs = port_cqs(net, devs, nqps, per_lane, extra)?;
        let one = |q: usize| {
            let m = port_of(q, devs.len());
            new_qp(&net.devices[devs[m]], &cqs[m], caps(q), qp_access(grant(q)))
        };
        let qps = (0..nqps).map(one).collect::<Result<_>>()?;
        Ok(Queues { devs: devs.to_vec(), qps, cqs })
    }
}

/// Whether a receive comm over `devs` flushes: only where a device can write GPU memory (or
/// `FERROCE_FORCE_FLUSH=1`), with one flush QP on every member port, as each port's NIC writes
/// into the buffers.
pub fn needs_flush(net: &Net, devs: &[usize]) -> bool {
    devs.iter().any(|&d| net.devices[d].gdr.flush)
}

/// One CQ per member port, each with room for `per_lane` entries of each lane on it (and, where
/// the comm has several lanes, one lane more, for a repair's flush: a single lane is never
/// repaired, its failure fails the comm) plus `extra`: every work request that can be
/// outstanding on it, so that it never overflows. Soft-RoCE rounds `n + 1` up to a power of
/// two.
fn port_cqs(
    net: &Net,
    devs: &[usize],
    nqps: usize,
    per_lane: usize,
    extra: usize,
) -> Result<Vec<Arc<Cq>>> {
    let n = devs.len();
    let cq = |(m, &dev): (usize, &usize)| {
        let lanes = (0..nqps).filter(|&q| port_of(q, n) == m).count() + usize::from(nqps > 1);
        Cq::new(&net.devices[dev].ctx, (lanes * per_lane + extra).min(32767) as i32)
    };
    devs.iter().enumerate().map(cq).collect()
}

/// A comm's two control areas, on every member port: the FIFO's (the sender's FIFO, the
/// receiver's stage of its rows) and the size records' (the sender's stage, the receiver's
/// records), with the access each end gives them.
fn areas(
    net: &Net,
    devs: &[usize],
    (fifo, sizes): (u32, u32),
) -> Result<(RegisteredBuf, RegisteredBuf)> {
    let pds = pds(net, devs);
    Ok((
        RegisteredBuf::on(&pds, FIFO_AREA * 8, fifo)?,
        RegisteredBuf::on(&pds, SIZE_AREA * 8, sizes)?,
    ))
}

/// The protection domains of `devs`, for control buffers every member port reaches.
fn pds<'a>(net: &'a Net, devs: &[usize]) -> Vec<&'a Arc<verbs::Pd>> {
    devs.iter().map(|&d| &net.devices[d].pd).collect()
}

/// One RC queue pair on device `d`, sharing `cq`, moved to INIT granting `access`.
fn new_qp(d: &NetDevice, cq: &Arc<Cq>, caps: verbs::QpCaps, access: u32) -> Result<Qp> {
    let qp = Qp::create_rc(&d.pd, cq, caps)?;
    qp.to_init(d.port, access)?;
    Ok(qp)
}

/// A comm's member ports: each registers the queue pairs on it (lanes, then its flush QP) and
/// its CQ with its device, so an async error on them reaches the comm.
fn ports(
    net: &Net,
    (devs, cqs): (&[usize], Vec<Arc<Cq>>),
    comm: &str,
    qps: &[Qp],
    flush: &[Flusher],
) -> Vec<Port> {
    let n = devs.len();
    let port = |(m, cq): (usize, Arc<Cq>)| {
        let lanes = qps.iter().enumerate().filter(|(q, _)| port_of(*q, n) == m).map(|(_, qp)| qp);
        let queues = lanes
            .chain(flush.get(m).map(|f| &f.qp))
            .map(|q| Queue::Qp(q.qpn()))
            .chain([Queue::Cq(cq.id())])
            .collect();
        let flags = &net.devices[devs[m]].flags;
        let watch = flags.watch(comm.to_string(), queues);
        let seen_up = flags.port_up.load(Ordering::Acquire);
        Port { dev: devs[m], cq, watch, seen_up, seen_down: false, seen_news: 0 }
    };
    cqs.into_iter().enumerate().map(port).collect()
}

/// A comm's life, for its statistics: when it opened, its devices' counters then, and when
/// the next periodic report is due (`FERROCE_STATS_INTERVAL_S`). `None` where NCCL shows no
/// INFO lines (`NCCL_DEBUG` below `INFO`): no line is made, and no counter read.
struct Life {
    opened: Duration,
    /// Each member port's counters at the start.
    counters: Vec<Arc<Counters>>,
    every: Option<Duration>,
    next: Duration,
}

/// The hardware counters of each of `devs` ([`NetDevice::hw_counters`]: shared with the
/// other comms that read them about now); with several ports, each name says its port
/// (`rxe1:sent_pkts`).
fn counters(net: &Net, devs: &[usize]) -> Vec<Arc<Counters>> {
    let one = |&dev: &usize| {
        let d = &net.devices[dev];
        let c = d.hw_counters();
        if devs.len() == 1 {
            return c;
        }
        Arc::new(c.iter().map(|(k, v)| (format!("{}:{k}", d.name), *v)).collect())
    };
    devs.iter().map(one).collect()
}

impl Life {
    fn start(net: &Net, devs: &[usize]) -> Option<Life> {
        if !net.config.stats {
            return None;
        }
        let opened = crate::os::coarse_now();
        let every = net.config.stats_interval;
        let counters = counters(net, devs);
        Some(Life { opened, counters, every, next: opened + every.unwrap_or_default() })
    }

    /// The statistics line of `what` now.
    fn line(&self, what: &str, t: &Traffic, path: &Path, net: &Net, devs: &[usize]) -> String {
        let life = crate::os::coarse_now().saturating_sub(self.opened);
        let now = counters(net, devs);
        let grown = self.counters.iter().zip(&now).flat_map(|(a, b)| super::stats::grown(a, b));
        let grown: Vec<(String, u64)> = grown.collect();
        let names: Vec<&str> = devs.iter().map(|&d| net.devices[d].name.as_str()).collect();
        super::stats::line(what, t, &path.sports, life, &names.join("+"), &grown)
    }

    /// Logs the line of `role` (e.g. "send comm to") when a periodic report is due (only with
    /// `FERROCE_STATS_INTERVAL_S`; nothing is allocated otherwise).
    fn tick(&mut self, role: &str, t: &Traffic, path: &Path, net: &Net, devs: &[usize]) {
        let Some(every) = self.every else { return };
        let now = crate::os::coarse_now();
        if now >= self.next {
            self.next = now + every;
            log::info!("{}", self.line(&format!("{role} {}", path.peer), t, path, net, devs));
        }
    }
}

/// Logs the lines the core left.
fn log_lines(mut take: impl FnMut() -> Option<Line>) {
    while let Some(l) = take() {
        match l {
            Line::Warn(w) => log::warn!("{w}"),
            Line::Info(i) => log::info!("{i}"),
        }
    }
}

/// How each end names itself in its log lines, before the peer.
const SEND: &str = "send comm to";
const RECV: &str = "receive comm from";

/// What each end of a connection drives beside its core: its queue pairs and how each was
/// brought up, its member ports, its statistics and its profiler events.
pub struct Lanes {
    pub net: Arc<Net>,
    /// The comm's member ports (device indices): one, or a fused device's.
    pub devs: Vec<usize>,
    path: Arc<Path>,
    qps: Vec<Qp>,
    links: Vec<Link>,
    ports: Vec<Port>,
    life: Option<Life>,
    /// Profiler events, with a profiler (`None`: the core journals nothing).
    events: Option<Events>,
    /// When the idle work runs next if polls keep finding nothing (see [`progress`]).
    idle_at: Duration,
}

impl Lanes {
    /// The lanes of `role` (e.g. "send comm to") of `qps` over the member ports `devs` (their
    /// CQs `cqs`), brought up as `links` say; `flush`: the receiver's flush QPs, watched with
    /// the lanes.
    fn new(
        role: &str,
        net: Arc<Net>,
        Queues { devs, qps, cqs }: Queues,
        links: Vec<Link>,
        path: Arc<Path>,
        profiler: Option<Arc<dyn Profiler>>,
        flush: &[Flusher],
    ) -> Lanes {
        let name = format!("{role} {}", path.peer);
        let ports = ports(&net, (&devs, cqs), &name, &qps, flush);
        let life = Life::start(&net, &devs);
        let events = profiler.map(Events::new);
        Lanes { net, devs, path, qps, links, ports, life, events, idle_at: Duration::ZERO }
    }

    /// The comm's queue pairs as the core's [`Post`], with flush QPs `flush`.
    #[inline]
    fn io<'a>(&'a mut self, flush: &'a [Flusher]) -> Qps<'a> {
        let (qps, links, net, ports) = (&mut self.qps, &self.links, &self.net, &self.ports);
        Qps { qps, flush, links, net, ports }
    }

    /// Turns what the core journaled into profiler events (the core journals nothing without
    /// a profiler, so then this is one branch); `ports`: how many member ports the comm spans.
    #[inline]
    fn report(&mut self, journal: &mut Vec<Posted>) {
        if self.events.is_some() {
            self.report_to_profiler(journal);
        }
    }

    fn report_to_profiler(&mut self, journal: &mut Vec<Posted>) {
        let ports = self.devs.len();
        let Some(ev) = &mut self.events else { return };
        for p in journal.drain(..) {
            ev.posted(&p, self.qps.get(p.lane).map_or(0, Qp::qpn), port_of(p.lane, ports));
        }
    }

    /// Logs the statistics line of `role` (e.g. "send comm to") when one is due.
    #[inline(always)]
    fn tick(&mut self, role: &str, t: &Traffic) {
        if let Some(life) = &mut self.life {
            life.tick(role, t, &self.path, &self.net, &self.devs);
        }
    }

    /// At close: outstanding work flushes before the buffers go (a failure is logged, teardown
    /// goes on), then the comm's statistics line (where NCCL shows it).
    fn close(&self, role: &str, flush: &[Flusher], t: &Traffic) {
        for qp in self.qps.iter().chain(flush.iter().map(|f| &f.qp)) {
            if let Err(e) = qp.to_error() {
                log::warn!("closing the {role} {}: {e}", self.path.peer);
            }
        }
        if let Some(life) = &self.life {
            let what = format!("{role} {} closed", self.path.peer);
            log::info!("{}", life.line(&what, t, &self.path, &self.net, &self.devs));
        }
    }
}

/// The core's parameters for a comm with these QPs over `ours` member ports to the peer's
/// `theirs`; `journal` with a profiler.
fn params(
    net: &Net,
    qps: &[Qp],
    (ours, theirs): (usize, usize),
    (split, max_msg): (bool, u64),
    path: &Arc<Path>,
    journal: bool,
) -> Params {
    Params {
        nqps: qps.len(),
        split,
        max_msg,
        inline: qps.iter().map(Qp::max_inline).collect(),
        progress_timeout: net.config.progress_timeout,
        probe_interval: net.config.probe_interval,
        mark: ferroce_core::data::MARK_BYTES,
        path_aware: net.config.path_aware,
        timed_from: ferroce_core::data::TIMED_FROM,
        repair: ferroce_core::data::Repair {
            attempts: net.config.repair_attempts,
            delay: net.config.repair_delay,
            timeout: net.config.repair_timeout,
        },
        path: path.clone(),
        journal,
        failover: net.config.failover,
        stall: net.config.lane_stall,
        members: (0..qps.len()).map(|q| (port_of(q, ours), port_of(q, theirs))).collect(),
    }
}

/// What both ends learn of the other at setup: the peer's registered area (its FIFO, or its
/// size records) with its key on each of its member ports, how many member ports it spans, and
/// (for the sender) its largest message.
pub struct Peer {
    pub addr: u64,
    pub rkeys: Vec<u32>,
    pub max_msg: u64,
}

// --- the sending end ----------------------------------------------------------------------------

/// The sending end of a connection.
pub struct SendComm {
    core: SendCore,
    /// Written by the receiver's NIC: the CTS entries.
    fifo: RegisteredBuf,
    /// Source of the size-record writes.
    sizes_stage: RegisteredBuf,
    pub lanes: Lanes,
}

/// Everything `setup` builds for a send comm before the peer answers.
pub struct SendParts {
    pub q: Queues,
    pub fifo: RegisteredBuf,
    pub sizes_stage: RegisteredBuf,
}

impl SendParts {
    /// `nqps` lanes over the member ports `devs` (lane `q` on `port_of(q)`).
    pub fn new(net: &Arc<Net>, devs: &[usize], nqps: usize) -> Result<SendParts> {
        let depth = send_queue(nqps);
        let q = Queues::new(net, (devs, nqps), (depth, 0), |_| send_caps(nqps), send_grant)?;
        // The CTS FIFO is registered without IBV_ACCESS_RELAXED_ORDERING, always: isend reads an
        // entry as valid once its last word (idx) has landed, which is only sound if the
        // receiver's RDMA write lands in order. Relaxed ordering is for NCCL's buffers only.
        let (fifo, sizes_stage) = areas(net, devs, (CONTROL_IN, STAGE))?;
        Ok(SendParts { q, fifo, sizes_stage })
    }
}

impl SendComm {
    /// `theirs`: the receiver's member ports; `peer`: its size records.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        parts: SendParts,
        attrs: &[(RtrAttr, RtsAttr)],
        net: Arc<Net>,
        path: Path,
        split: bool,
        (theirs, peer): (usize, Peer),
        profiler: Option<Arc<dyn Profiler>>,
    ) -> Box<SendComm> {
        let (journal, path) = (profiler.is_some(), Arc::new(path));
        let ours = parts.q.devs.len();
        let p = params(&net, &parts.q.qps, (ours, theirs), (split, peer.max_msg), &path, journal);
        let links = links(|_| send_caps(p.nqps), attrs, send_grant);
        let core = SendCore::new(p, remote(peer.addr, &peer.rkeys));
        let lanes = Lanes::new(SEND, net, parts.q, links, path, profiler, &[]);
        Box::new(SendComm { core, fifo: parts.fifo, sizes_stage: parts.sizes_stage, lanes })
    }

    /// Its requests, in the order of the ids `isend` returns: one per (slot, buffer).
    pub fn requests() -> impl Iterator<Item = (ReqKind, u16)> {
        (0..SLOTS * MAX_RECVS).map(|i| (ReqKind::Send, i as u16))
    }

    /// Matches a send against the receiver's posted buffers. `Ok(None)`: not yet. `buf`: the
    /// lookup of the buffer's registration, run only once a receive matches it. `phandle`:
    /// NCCL's profiler handle of the request (0: none). Inline into the FFI's `isend`, its one
    /// caller.
    #[inline]
    pub fn isend(
        &mut self,
        buf: impl FnOnce() -> Result<Buf>,
        tag: i32,
        phandle: usize,
    ) -> Result<Option<usize>> {
        let mut io = self.lanes.io(&[]);
        let r = self.core.isend_with(&self.fifo, &self.sizes_stage, &mut io, buf, tag);
        if let (Ok(Some(id)), Some(ev)) = (&r, &mut self.lanes.events) {
            ev.handed(*id, phandle);
        }
        self.lanes.report(self.core.journal());
        let r = r?;
        log_lines(|| self.core.take_line());
        // What frees a slot or the send queue is a completion. With nothing in flight
        // (waiting for the peer's CTS) there is none to poll for, and progress runs only for
        // its idle checks, when they are due.
        let not_due = || crate::os::coarse_now() < self.lanes.idle_at;
        if r.is_none() && !(self.core.nothing_posted() && not_due()) {
            self.progress()?;
        }
        Ok(r)
    }

    pub fn progress(&mut self) -> Result<()> {
        self.step().map(drop)
    }

    /// One progress step; `Ok(false)` where its poll found nothing and nothing ran.
    fn step(&mut self) -> Result<bool> {
        let news = news(&mut self.lanes.ports);
        if news {
            // A port that came back: its lanes are repaired now (port recovery).
            for (m, p) in self.lanes.ports.iter_mut().enumerate() {
                let up = self.lanes.net.devices[p.dev].flags.port_up.load(Ordering::Acquire);
                if up != p.seen_up {
                    p.seen_up = up;
                    self.core.port_up(m);
                }
            }
            let ports = &mut self.lanes.ports;
            links_down(&self.lanes.net, ports, |down, bits| self.core.links_down(down, bits));
        }
        let mut side =
            SendDrain { core: &mut self.core, stage: &self.sizes_stage, fifo: &self.fifo };
        let r = progress(&mut side, &mut self.lanes, &[], news);
        if let Ok(false) = r {
            return Ok(false);
        }
        self.lanes.report(self.core.journal());
        log_lines(|| self.core.take_line());
        self.lanes.tick(SEND, self.core.traffic());
        r
    }

    /// `Some(size)` once request `id` completed (the request is then free again). Inline into
    /// the FFI's `test`, its one caller: NCCL's most frequent call pays no second entry.
    #[inline]
    pub fn test(&mut self, id: usize) -> Result<Option<u64>> {
        // A pending request whose poll found nothing, with nothing run, is still pending.
        if self.core.pending(id) && !self.step()? {
            return self.core.check().map(|()| None);
        }
        let r = self.core.test(id)?;
        if let (Some(_), Some(ev)) = (r, &mut self.lanes.events) {
            ev.done(id);
        }
        Ok(r)
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        self.lanes.close(SEND, &[], self.core.traffic());
    }
}

// --- the receiving end --------------------------------------------------------------------------

/// A loopback queue pair for the GPUDirect flush, one per member port: an RDMA read of the last
/// received buffer completes only after that port's NIC's earlier writes into that memory are
/// visible.
///
/// It keeps remote read ([`Flusher::ACCESS`]) because it is the responder of its own read: the
/// read arrives on the flush QP, so the flush QP, not the data QPs, must allow it (and so must
/// the MR of NCCL's buffer, see `reg`). It grants nothing else, and only this comm's own QP
/// reaches it: it is connected to itself.
pub struct Flusher {
    pub qp: Qp,
    pub target: RegisteredBuf,
}

/// The receiving end of a connection.
pub struct RecvComm {
    core: RecvCore,
    /// Source of the CTS writes.
    cts_stage: RegisteredBuf,
    /// Written by the sender's NIC: the size records.
    sizes: RegisteredBuf,
    /// One per member port, or none (no device that flushes).
    flushers: Vec<Flusher>,
    pub lanes: Lanes,
}

/// Everything `setup` builds for a receive comm.
pub struct RecvParts {
    pub q: Queues,
    pub cts_stage: RegisteredBuf,
    pub sizes: RegisteredBuf,
    /// Whether the sender splits messages across the lanes: what the queues were sized for.
    pub split: bool,
}

impl Flusher {
    /// The flush QP's `qp_access_flags` (a flush QP is index `nqps` or more of [`recv_grant`]).
    pub const ACCESS: u32 = verbs::ACCESS_REMOTE_READ;
}

impl RecvParts {
    /// `nqps` lanes over the member ports `devs` (lane `q` on `port_of(q)`), for a sender
    /// that splits messages across them (`split`) or not.
    pub fn new(net: &Arc<Net>, devs: &[usize], (nqps, split): (usize, bool)) -> Result<RecvParts> {
        // Room for every work request of every lane, receive and send (all flushed at once
        // when the comm closes or fails), and the flushes.
        let per_lane = ferroce_core::data::recv_queue(nqps, split) + RECV_SEND_QUEUE;
        let flushes = if needs_flush(net, devs) { FLUSH_QUEUE } else { 0 };
        let grant = |q| recv_grant(q, nqps);
        let caps = |q| recv_caps(q, nqps, split);
        let q = Queues::new(net, (devs, nqps), (per_lane, flushes), caps, grant)?;
        let (cts_stage, sizes) = areas(net, devs, (STAGE, CONTROL_IN))?;
        Ok(RecvParts { q, cts_stage, sizes, split })
    }
}

impl RecvComm {
    /// `theirs`: the sender's member ports; `peer`: its FIFO.
    pub fn new(
        parts: RecvParts,
        flushers: Vec<Flusher>,
        attrs: &[(RtrAttr, RtsAttr)],
        net: Arc<Net>,
        path: Path,
        (theirs, peer): (usize, Peer),
        profiler: Option<Arc<dyn Profiler>>,
    ) -> Box<RecvComm> {
        // The receiver only sends CTS rows (on its control lane) and probes; its lanes differ
        // only in their inline room (`recv_caps`).
        let (nqps, split) = (parts.q.qps.len(), parts.split);
        let (journal, path) = (profiler.is_some(), Arc::new(path));
        let ours = parts.q.devs.len();
        let p = params(&net, &parts.q.qps, (ours, theirs), (split, 0), &path, journal);
        let core = RecvCore::new(p, remote(peer.addr, &peer.rkeys));
        let links = links(|q| recv_caps(q, nqps, split), attrs, |q| recv_grant(q, nqps));
        let lanes = Lanes::new(RECV, net, parts.q, links, path, profiler, &flushers);
        let (cts_stage, sizes) = (parts.cts_stage, parts.sizes);
        Box::new(RecvComm { core, cts_stage, sizes, flushers, lanes })
    }

    /// Its requests, in the order of the ids `irecv` and `iflush` return: `SLOTS` receives,
    /// then `SLOTS` flushes.
    pub fn requests() -> impl Iterator<Item = (ReqKind, u16)> {
        let kind = |i| if i < SLOTS { ReqKind::Recv } else { ReqKind::Flush };
        (0..2 * SLOTS).map(move |i| (kind(i), (i % SLOTS) as u16))
    }

    /// Posts `bufs` (with their tags) as one multi-receive; `optional`: NCCL's LL, sent whole
    /// and completed as any receive; `phandles`: NCCL's profiler handles of the buffers (empty
    /// or 0: none).
    /// `Ok(None)`: all slots busy (or the next one's row still read by a CTS write in flight).
    /// Inline into the FFI's `irecv`, its one caller.
    #[inline]
    pub fn irecv(
        &mut self,
        bufs: &[(Buf, i32)],
        optional: bool,
        phandles: &[usize],
    ) -> Result<Option<usize>> {
        // With the CTS queue half used, a caller that posts receives without testing any
        // would see its rows wait for room: it polls first.
        let polled = self.core.needs_poll();
        if polled {
            self.progress()?;
        }
        let mut io = self.lanes.io(&[]);
        let r = self.core.irecv(&self.cts_stage, &mut io, bufs, optional);
        if let (Ok(Some(slot)), Some(ev)) = (&r, &mut self.lanes.events) {
            for i in 0..MAX_RECVS {
                ev.handed(slot * MAX_RECVS + i, phandles.get(i).copied().unwrap_or(0));
            }
        }
        self.lanes.report(self.core.journal());
        let r = r?;
        if r.is_none() && !polled {
            self.progress()?;
        }
        // A row left staged (the CTS send queue was full) must not wait for NCCL's next call:
        // the signaled write that frees the queue is on its way, a round trip; poll for it, for
        // a bounded while (then the row goes out at the next call, as `ferroce_core::data` says).
        if r.is_some() && self.core.staged() > 0 {
            let since = crate::os::precise_now();
            while self.core.staged() > 0
                && crate::os::precise_now().saturating_sub(since) < STAGED_WAIT
            {
                self.progress()?;
            }
        }
        Ok(r)
    }

    /// Issues the flush reads for a completed receive whose non-empty buffers are `bufs`: an
    /// RDMA read of the last one in GPU memory (of the last one, with `FERROCE_FORCE_FLUSH=1`)
    /// through each member port. `Ok(None)`: nothing to flush (host memory, or no flush QP on
    /// this device).
    pub fn iflush(&mut self, bufs: &[Buf]) -> Result<Option<usize>> {
        self.core.check()?;
        let force = self.lanes.net.config.force_flush;
        let target = bufs.iter().rev().find(|b| b.size > 0 && (force || !b.host));
        let Some(&b) = target.filter(|_| !self.flushers.is_empty()) else { return Ok(None) };
        let mut scratch = [(0, 0); ferroce_core::data::MAX_MEMBERS];
        for (s, f) in scratch.iter_mut().zip(&self.flushers) {
            *s = (f.target.addr(0), f.target.lkey());
        }
        let n = self.flushers.len();
        let mut io = self.lanes.io(&self.flushers);
        self.core.iflush(&mut io, b, &scratch[..n]).map(Some)
    }

    pub fn progress(&mut self) -> Result<()> {
        self.step().map(drop)
    }

    /// One progress step; `Ok(false)` where its poll found nothing and only the memory the
    /// peer's NIC writes was looked at.
    fn step(&mut self) -> Result<bool> {
        let news = news(&mut self.lanes.ports);
        if news {
            let ports = &mut self.lanes.ports;
            links_down(&self.lanes.net, ports, |down, bits| self.core.links_down(down, bits));
        }
        let mut side =
            RecvDrain { core: &mut self.core, stage: &self.cts_stage, sizes: &self.sizes };
        let r = progress(&mut side, &mut self.lanes, &self.flushers, news);
        if let Ok(false) = r {
            return Ok(false);
        }
        self.lanes.report(self.core.journal());
        log_lines(|| self.core.take_line());
        self.lanes.tick(RECV, self.core.traffic());
        r
    }

    /// Receive request `id` (`< SLOTS`) or flush request (`FLUSH_BASE..`): `Some(n)` once
    /// done, with the `n` received sizes first in `sizes` (the entries after them are
    /// unspecified). Inline, as the sender's.
    #[inline]
    pub fn test(&mut self, id: usize, sizes: &mut [u64; MAX_RECVS]) -> Result<Option<usize>> {
        if (self.core.pending(id) || self.core.needs_poll())
            && !self.step()?
            && self.core.pending(id)
        {
            // Still pending after a poll that found nothing.
            return self.core.check().map(|()| None);
        }
        let r = self.core.test(id, sizes)?;
        if let (Some(_), Some(ev)) = (r, &mut self.lanes.events)
            && id < FLUSH_BASE
        {
            for i in 0..MAX_RECVS {
                ev.done(id * MAX_RECVS + i);
            }
        }
        Ok(r)
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        // A fence the sender waits for is answered before the queue pairs go (see
        // `RecvCore::owes_answer`), within the repair timeout; a failed step ends the wait
        // (the sender's own bounds apply then).
        let end = crate::os::coarse_now() + self.lanes.net.config.repair_timeout;
        while self.core.owes_answer(&self.sizes) && crate::os::coarse_now() < end {
            if self.step().is_err() {
                break;
            }
            std::thread::yield_now();
        }
        self.lanes.close(RECV, &self.flushers, self.core.traffic());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verbs flags of each role: QPs never ask for local write (meaningless there), only
    /// the flush QP allows remote read, and no buffer of ours allows it at all.
    #[test]
    fn access_flags_by_role() {
        assert_eq!(qp_access(Grant::Nothing), 0);
        assert_eq!(qp_access(Grant::Write), verbs::ACCESS_REMOTE_WRITE);
        assert_eq!(qp_access(recv_grant(4, 4)), Flusher::ACCESS);
        assert_eq!(Flusher::ACCESS, verbs::ACCESS_REMOTE_READ);
        for flags in [CONTROL_IN, STAGE, FLUSH_TARGET] {
            assert_eq!(flags & (verbs::ACCESS_REMOTE_READ | verbs::ACCESS_RELAXED_ORDERING), 0);
        }
        assert_eq!(STAGE, 0, "a staging buffer is only read by the local NIC");
    }
}
