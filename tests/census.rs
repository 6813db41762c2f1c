//! Leak census on Soft-RoCE: thousands of connect/transfer/close cycles in ONE process, with
//! failed setups mixed in, after which the process holds exactly what it held before.
//!
//! The census process is both peers: it listens on rxe1 and connects from rxe0, driving both
//! ends from one loop (connect and accept never block). Every cycle ends with the rightful peer
//! connected, one transfer of a varied size (0 B to 1 MiB) whose every byte and size is
//! checked, and both comms and the listener closed. Mixed in, by cycle number:
//! - **half hello**: a stranger sends part of a hello and then half-closes; the listener must
//!   close that connection and keep waiting (accept returns nothing, never an error);
//! - **cut hello**: a stranger sends part of a hello and vanishes with a TCP reset;
//! - **wrong nonce**: the plugin's own connector, given the handle with its nonce flipped,
//!   must fail `connect`, while the listener keeps waiting;
//! - **silent**: a stranger connects and says nothing while the rightful peer connects; the
//!   stranger's connection is closed by the time the listener is;
//! - **proven**: a stranger sends a whole hello with the right nonce (so it is the peer, as far
//!   as the listener can tell) and vanishes: `accept` fails naming the peer, or (a listener
//!   that drops only that connection) keeps waiting and the rightful peer connects;
//! - **killed** (every 200th cycle): a child process running the plugin's connector is killed
//!   with SIGKILL after sending its hello; the same two outcomes are allowed.
//!
//! Once, after the baseline, a silent stranger is left alone with the listener until the
//! listener closes its connection (its deadline), with no error, and the rightful peer then
//! connects.
//!
//! After a warm-up, the baseline is taken; after all cycles, this process's fds
//! (`/proc/self/fd`), threads (`/proc/self/task`) and QPs/CQs/MRs/PDs (`rdma resource show`)
//! must equal it, and its anonymous RSS (`RssAnon`, after `malloc_trim`) may have grown by less
//! than 2 MiB.
//!
//! Then two more communicators: A abandons a listener, a connect and a pair while B runs
//! traffic; A's `finalize` ends exactly A's (its WARN, its queue pairs, errors on its objects)
//! and B's traffic goes on; B then finalizes, and the device resources are as before.
//!
//! Then what `ncclCommAbort` during setup leaves behind: connects and accepts started and never
//! finished (their listeners closed, or one left open), registrations never deregistered, a
//! pair never closed with a receive posted. The last `finalize` must end all of it: it WARNs
//! how many registrations it deregistered and how many listeners and comms it closed; right
//! after it the threads are those from before the plugin was loaded and no device resource is
//! left; every later call on what it ended (`connect` on an abandoned handle, `test`, `isend`,
//! `accept`, `deregMr`, the closes) is an error, not a crash. `init` then starts cleanly on the
//! same load (one cycle, `finalize`), and after `dlclose` the fds and threads are those from
//! before the plugin was loaded, with no device resources at all; a reload, `init`, one cycle,
//! `finalize` and `dlclose` end the same way.
//!
//! `census [--cycles N] [--warmup W]` (default 1000, what CI runs, and 16). It sets
//! `FERROCE_SETUP_TIMEOUT_MS=10000` (the one silent stranger is dropped at the listener's 5 s
//! hello deadline, and the wait for the rightful peer outlasts it) and, unless set, `NCCL_IB_QPS_PER_CONNECTION=2`. Built with
//! its own `main` (`harness = false`) and run by `ci/vm-tests.sh` in the VM.

mod common;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpStream};
use std::process::Stdio;
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{fds_threads, open_plugin, require_vm, rss_bytes, settle};
use ferroce_core::setup::wire::{Handle, Kind as MsgKind, MAX_QPS, MSG_LEN, Msg};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};
use ferroce_tools::proc::Proc;
use ferroce_tools::rng::Rng;
use ferroce_tools::sys::{RdmaCounts, rdma_counts};
use ferroce_tools::wait::until;

const SETUP_TIMEOUT_MS: &str = "10000";
const QPS: &str = "2";
/// The largest transfer; the buffers are allocated once so RSS measures the plugin.
const BUF: usize = 1 << 20;
const GUARD: usize = 64;
const POISON: u8 = 0x5a;
/// Any one expected event (an error, a closed connection) must come within this.
const BOUND: Duration = Duration::from_secs(30);
/// A silent stranger alone with the listener must be dropped within this.
const SILENT_BOUND: Duration = Duration::from_secs(45);
const RSS_GROWTH: u64 = 2 << 20;
const CHILD_EVERY: usize = 200;
/// rxe0's listener and connector (device order as the plugin reports it) and rxe1's.
const SEND_DEV: i32 = 0;
const RECV_DEV: i32 = 1;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("child-connect") => child_connect(args.get(1)),
        _ => census(&args),
    };
    common::exit_on_error("census", r);
}

// --- what a cycle does ------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Normal,
    HalfHello,
    CutHello,
    WrongNonce,
    Silent,
    Proven,
    Killed,
}

fn kind_of(i: usize) -> Kind {
    if i % CHILD_EVERY == 9 {
        return Kind::Killed;
    }
    match i % 8 {
        1 if (i / 8).is_multiple_of(2) => Kind::HalfHello,
        1 => Kind::CutHello,
        3 => Kind::WrongNonce,
        5 => Kind::Silent,
        7 => Kind::Proven,
        _ => Kind::Normal,
    }
}

struct Census<'a, 'l> {
    drv: &'a Driver<'l>,
    ctx: Ptr,
    src: Vec<u8>,
    dst: Vec<u8>,
    rng: Rng,
    /// (what happened) -> how often.
    outcomes: BTreeMap<String, usize>,
    /// Kinds seen so far, for the checks done on a first occurrence only.
    seen: Vec<Kind>,
    bytes: u64,
    /// Per kind: cycles and seconds spent.
    time: BTreeMap<Kind, (usize, f64)>,
}

fn fill(seed: usize, buf: &mut [u8]) {
    Rng(0x00dd_ba11 ^ ((seed as u64) << 16) | 1).fill(buf);
}

/// Whether the other end closed `s` (EOF or reset), looking without blocking.
fn closed(s: &TcpStream) -> Result<bool, String> {
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut b = [0u8; 1024];
    loop {
        match (&*s).read(&mut b) {
            Ok(0) => return Ok(true),
            Ok(_) => {} // a reply to a proven stranger: read past it
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Ok(true), // reset
        }
    }
}

/// Closes `s` with a reset (as a killed peer with unread data does), not a FIN.
fn reset(s: TcpStream) {
    common::reset_on_close(&s);
    drop(s);
}

impl<'a, 'l> Census<'a, 'l> {
    fn new(drv: &'a Driver<'l>, ctx: Ptr) -> Census<'a, 'l> {
        Census {
            drv,
            ctx,
            // Written once, so their pages are resident before the baseline.
            src: vec![0x11u8; BUF],
            dst: vec![0x22u8; BUF + GUARD],
            rng: Rng(0x00c3_7505),
            outcomes: BTreeMap::new(),
            seen: Vec::new(),
            bytes: 0,
            time: BTreeMap::new(),
        }
    }

    fn count(&mut self, what: impl Into<String>) {
        *self.outcomes.entry(what.into()).or_default() += 1;
    }

    fn listen(&self) -> Result<([u8; 128], Ptr), String> {
        self.drv.listen(self.ctx, RECV_DEV)
    }

    /// A hello as a peer would send it (right format, plausible endpoint), with `nonce`.
    fn hello(&mut self, nonce: u64) -> [u8; MSG_LEN] {
        let nqps = 1 + self.rng.below(2) as u8;
        let mut qpns = [0u32; MAX_QPS];
        let mut sports = [0u16; MAX_QPS];
        for i in 0..usize::from(nqps) {
            qpns[i] = 1 + self.rng.below(0xff_fffe) as u32;
            sports[i] = 0xc000 + self.rng.below(0x3fff) as u16;
        }
        let ip: Ipv4Addr = std::env::var("FERROCE_VM_IPS")
            .ok()
            .and_then(|v| v.split_whitespace().next().and_then(|a| a.parse().ok()))
            .unwrap_or(Ipv4Addr::new(198, 18, 0, 1));
        Msg {
            kind: MsgKind::Hello,
            nonce,
            nqps,
            qpns,
            sports,
            split: false,
            sl: 0,
            mtu: 3,
            port: 1,
            traffic_class: 0,
            gid: ip.to_ipv6_mapped().octets(),
            buf_addr: 0x10_0000,
            buf_rkey: 0x1234,
            max_msg: 8 << 20,
            members: 1,
            more: Default::default(),
        }
        .encode()
    }

    fn stranger(&self, handle: &[u8; 128]) -> Result<(TcpStream, u64), String> {
        let h = Handle::decode(handle).map_err(|e| format!("our own handle: {e}"))?;
        let s = TcpStream::connect_timeout(&h.addr, BOUND)
            .map_err(|e| format!("stranger connect to {}: {e}", h.addr))?;
        Ok((s, h.nonce))
    }

    /// One transfer over a fresh pair, every byte checked; registers and deregisters on it.
    fn transfer(&mut self, send: Ptr, recv: Ptr, cycle: usize) -> Result<(), String> {
        let drv = self.drv;
        let size = match cycle % 5 {
            0 => [0, 1, 4095, 4096, 65536][(cycle / 5) % 5],
            1 => self.rng.below(4097) as usize,
            2 => 4096 * (1 + self.rng.below(16) as usize),
            3 => self.rng.below(65537) as usize,
            _ => self.rng.below(BUF as u64 + 1) as usize,
        };
        let tag = (cycle % 100) as i32;
        fill(cycle, &mut self.src[..size]);
        self.dst[..size + GUARD].fill(POISON);
        let smh = drv.reg_mr(send, self.src.as_mut_ptr(), BUF)?;
        let rmh = drv.reg_mr(recv, self.dst.as_mut_ptr(), BUF)?;
        let d = self.dst.as_mut_ptr();
        let rreq = until("irecv", BOUND, || drv.irecv(recv, &[d], &[BUF], &[tag], &[rmh], false))?;
        let s = self.src.as_mut_ptr();
        if cycle.is_multiple_of(100) {
            outside(drv, send, tag, (s, smh))?;
        }
        let sreq = until("isend", BOUND, || drv.isend(send, s, size, tag, smh))?;
        let ss = until("test send", BOUND, || drv.test(sreq))?;
        let rs = until("test recv", BOUND, || drv.test(rreq))?;
        drv.dereg_mr(send, smh)?;
        drv.dereg_mr(recv, rmh)?;
        if ss[0] as usize != size || rs[0] as usize != size {
            return Err(format!("sizes: sent {} received {}, expected {size}", ss[0], rs[0]));
        }
        if let Some(bad) = self.dst[..size].iter().zip(&self.src[..size]).position(|(a, b)| a != b)
        {
            return Err(format!("{size} bytes: first wrong byte at {bad}"));
        }
        if let Some(bad) = self.dst[size..size + GUARD].iter().position(|&b| b != POISON) {
            return Err(format!("{size} bytes: byte {} past the end was written", size + bad));
        }
        self.bytes += size as u64;
        Ok(())
    }

    /// The rightful peer connects to `listen`, one transfer, both comms closed (the listener
    /// stays open).
    fn rightful(&mut self, handle: &[u8; 128], listen: Ptr, cycle: usize) -> Result<(), String> {
        let mut h = *handle;
        let (mut send, mut recv) = (None, None);
        let drv = self.drv;
        let (send, recv) = until("connect and accept", BOUND, || {
            if send.is_none() {
                send = drv.connect(self.ctx, SEND_DEV, &mut h)?;
            }
            if recv.is_none() {
                recv = drv.accept(listen)?;
            }
            Ok(send.zip(recv))
        })?;
        let r = self.transfer(send, recv, cycle);
        self.drv.close(Close::Send, send)?;
        self.drv.close(Close::Recv, recv)?;
        r
    }

    /// Drives `accept` alone until `done` says so; it must never fail or yield a comm (only
    /// strangers are connecting).
    fn accept_only(
        &self,
        listen: Ptr,
        what: &str,
        limit: Duration,
        mut done: impl FnMut() -> Result<bool, String>,
    ) -> Result<(), String> {
        until(what, limit, || {
            match self.drv.accept(listen) {
                Err(e) => return Err(format!("{what}: the listener failed: {e}")),
                Ok(Some(_)) => return Err(format!("{what}: accept yielded a comm for a stranger")),
                Ok(None) => {}
            }
            Ok(done()?.then_some(()))
        })
    }

    /// After a peer with the right nonce vanished mid-setup: `accept` fails naming the peer,
    /// or keeps waiting and the rightful peer connects. Returns the listener to close (a new
    /// one if the old one failed), with the cycle done.
    fn after_vanished(
        &mut self,
        what: &str,
        mut handle: [u8; 128],
        mut listen: Ptr,
        cycle: usize,
    ) -> Result<Ptr, String> {
        let drv = self.drv;
        let mut h = handle;
        let (mut send, mut recv) = (None, None);
        let failed = until(what, BOUND, || {
            if recv.is_none() {
                match drv.accept(listen) {
                    Err(_) => return Ok(Some(true)),
                    Ok(r) => recv = r,
                }
            }
            if send.is_none() {
                send = drv.connect(self.ctx, SEND_DEV, &mut h)?;
            }
            Ok((send.is_some() && recv.is_some()).then_some(false))
        })?;
        if failed {
            let warns = common::warnings();
            if !warns.iter().any(|w| w.contains("198.18.0.")) {
                return Err(format!("{what}: accept failed without naming the peer: {warns:?}"));
            }
            if let Some(s) = send {
                drv.close(Close::Send, s)?;
                return Err(format!("{what}: the rightful peer connected but accept failed"));
            }
            drv.close(Close::Listen, listen)?;
            // A connector already under way towards the failed listener must fail too.
            if h != handle {
                let r = until("the stale connector", BOUND, || {
                    match drv.connect(self.ctx, SEND_DEV, &mut h) {
                        Err(_) => Ok(Some(Ok(()))),
                        Ok(Some(_)) => Ok(Some(Err("connected to a closed listener"))),
                        Ok(None) => Ok(None),
                    }
                })?;
                r.map_err(|e| format!("{what}: {e}"))?;
            }
            self.count(format!("{what}: accept failed naming the peer"));
            (handle, listen) = self.listen()?;
            self.rightful(&handle, listen, cycle)?;
        } else {
            self.count(format!("{what}: listener kept waiting, rightful peer connected"));
            let (s, r) = (send.expect("connected"), recv.expect("accepted"));
            let t = self.transfer(s, r, cycle);
            drv.close(Close::Send, s)?;
            drv.close(Close::Recv, r)?;
            t?;
        }
        Ok(listen)
    }

    fn cycle(&mut self, i: usize) -> Result<(), String> {
        let t = Instant::now();
        let r = self.cycle_kind(i);
        let e = self.time.entry(kind_of(i)).or_default();
        e.0 += 1;
        e.1 += t.elapsed().as_secs_f64();
        r
    }

    fn cycle_kind(&mut self, i: usize) -> Result<(), String> {
        let kind = kind_of(i);
        let first = !self.seen.contains(&kind);
        if first {
            self.seen.push(kind);
        }
        let drv = self.drv;
        let (handle, mut listen) = self.listen()?;
        match kind {
            Kind::Normal => self.rightful(&handle, listen, i)?,
            Kind::HalfHello => {
                let (s, nonce) = self.stranger(&handle)?;
                let k = 1 + self.rng.below(MSG_LEN as u64 - 1) as usize;
                (&s).write_all(&self.hello(nonce)[..k]).map_err(|e| e.to_string())?;
                s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
                self.accept_only(listen, "a half hello", BOUND, || closed(&s))?;
                self.count("half hello: stranger dropped, listener waited");
                self.rightful(&handle, listen, i)?;
            }
            Kind::CutHello => {
                let (s, nonce) = self.stranger(&handle)?;
                let k = 1 + self.rng.below(MSG_LEN as u64 - 1) as usize;
                (&s).write_all(&self.hello(nonce)[..k]).map_err(|e| e.to_string())?;
                reset(s);
                if first {
                    // Nothing left to watch but the listener's word.
                    common::warnings();
                    self.accept_only(listen, "a cut hello", BOUND, || {
                        Ok(!common::warnings().is_empty())
                    })?;
                }
                self.count("cut hello: listener waited");
                self.rightful(&handle, listen, i)?;
            }
            Kind::WrongNonce => {
                let mut h = Handle::decode(&handle).map_err(|e| e.to_string())?;
                h.nonce ^= 1 << (self.rng.below(64));
                let mut bad = [0u8; 128];
                h.encode(&mut bad);
                let mut connect_failed = false;
                self.accept_only(listen, "a wrong nonce", BOUND, || {
                    match drv.connect(self.ctx, SEND_DEV, &mut bad) {
                        Err(_) => connect_failed = true,
                        Ok(Some(_)) => return Err("connected with a wrong nonce".into()),
                        Ok(None) => {}
                    }
                    Ok(connect_failed)
                })?;
                self.count("wrong nonce: connect failed, listener waited");
                self.rightful(&handle, listen, i)?;
            }
            Kind::Silent => {
                let (s, _) = self.stranger(&handle)?;
                self.rightful(&handle, listen, i)?;
                drv.close(Close::Listen, listen)?;
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(BOUND)).map_err(|e| e.to_string())?;
                match (&s).read(&mut [0u8; 16]) {
                    Ok(0) => {}
                    Ok(n) => return Err(format!("silent stranger: got {n} bytes")),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        return Err("silent stranger: its connection outlived the listener".into());
                    }
                    Err(_) => {} // reset
                }
                self.count("silent: rightful peer connected, stranger closed");
                return Ok(());
            }
            Kind::Proven => {
                let (s, nonce) = self.stranger(&handle)?;
                (&s).write_all(&self.hello(nonce)).map_err(|e| e.to_string())?;
                s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
                drop(s);
                listen = self.after_vanished("proven stranger vanished", handle, listen, i)?;
            }
            Kind::Killed => {
                let mut cmd = Proc::me(&["child-connect", &to_hex(&handle)]);
                cmd.stdin(Stdio::null());
                let mut child = Proc::spawn("child connector", cmd)?;
                let said = child.next(Duration::from_secs(60));
                let st = child.kill()?;
                match said.as_deref() {
                    Ok("SENT") => {}
                    other => {
                        return Err(format!("child connector: said {other:?}, exited with {st}"));
                    }
                }
                listen = self.after_vanished("connector killed mid-setup", handle, listen, i)?;
            }
        }
        drv.close(Close::Listen, listen)?;
        Ok(())
    }
}

// --- two communicators -------------------------------------------------------------------------

impl Census<'_, '_> {
    /// Two more communicators beside the census's own: A abandons a listener with an accept
    /// under way, a connect parked on it and a pair never closed, while B runs traffic. A's
    /// `finalize` ends A's (one WARN with the counts, A's queue pairs gone, calls on them
    /// errors) and nothing of B's, whose traffic goes on; then B closes and finalizes, and the
    /// device resources are what they were before. What went wrong, if anything.
    fn two_communicators(&mut self, pid: u32) -> Result<Vec<String>, String> {
        let drv = self.drv;
        let mut bad = Vec::new();
        let before = rdma_counts(pid)?;
        let (a, b) = (drv.init(5)?, drv.init(6)?);
        let (bs, br) = common::pair(drv, b, RECV_DEV, SEND_DEV)?;
        self.transfer(bs, br, 1)?;
        let with_b = rdma_counts(pid)?;
        let (mut h, la) = drv.listen(a, RECV_DEV)?;
        if drv.connect(a, SEND_DEV, &mut h)?.is_some() || drv.accept(la)?.is_some() {
            return Err("two communicators: A connected in one call".into());
        }
        let (as_, ar) = common::pair(drv, a, RECV_DEV, SEND_DEV)?;
        common::warnings();
        drv.finalize(a)?;
        let warns = common::warnings();
        let want = "closed 1 listener(s) and 2 comm(s) and ended 1 connect(s) in progress";
        if !warns.iter().any(|w| w.contains(want)) {
            bad.push(format!("A's finalize did not WARN {want:?}; it said {warns:?}"));
        }
        let after_a = settle(&Ok(with_b), Duration::from_secs(10), || rdma_counts(pid))?;
        if after_a != with_b {
            bad.push(format!("after A's finalize: device resources {after_a}, B's alone {with_b}"));
        }
        self.transfer(bs, br, 4).map_err(|e| format!("B's traffic after A's finalize: {e}"))?;
        let stale = [
            ("accept", drv.accept(la).map(drop)),
            ("closeSend", drv.close(Close::Send, as_)),
            ("closeRecv", drv.close(Close::Recv, ar)),
            ("closeListen", drv.close(Close::Listen, la)),
        ];
        for (what, r) in stale {
            if r.is_ok() {
                bad.push(format!("after A's finalize, {what} on A's succeeded"));
            }
        }
        common::warnings();
        drv.close(Close::Send, bs)?;
        drv.close(Close::Recv, br)?;
        drv.finalize(b)?;
        let after = settle(&Ok(before), Duration::from_secs(10), || rdma_counts(pid))?;
        if after != before {
            bad.push(format!("after both finalized: device resources {before} -> {after}"));
        }
        if bad.is_empty() {
            eprintln!(
                "census: two communicators: A's finalize ended its listener, connect and pair \
                 ({with_b} with B's pair alone), B's traffic went on, then B finalized"
            );
        }
        Ok(bad)
    }
}

// --- abandoned setups and the last finalize ----------------------------------------------------

/// How many setups of each kind the abandon phase leaves behind.
const ABANDONED: usize = 4;

/// What the abandon phase left open, for the calls after `finalize`.
struct Left {
    /// Handle buffers of connects left in progress (their state bytes name the parked connect).
    connects: Vec<[u8; 128]>,
    /// A listener never closed, with an accept in progress.
    listen: Ptr,
    /// A pair never closed, an MR on each end, and a receive still posted.
    send: Ptr,
    recv: Ptr,
    mrs: Vec<(Ptr, Ptr)>,
    request: Ptr,
}

impl Census<'_, '_> {
    /// Leaves what `ncclCommAbort` during setup leaves: connects and accepts started and never
    /// finished (the listener closed, the connector still parked), a listener never closed with
    /// an accept under way, registrations never deregistered (on closed comms and on a pair
    /// never closed), and a receive never completed.
    fn abandon(&mut self) -> Result<Left, String> {
        let drv = self.drv;
        let mut connects = Vec::new();
        for i in 0..ABANDONED {
            let (mut h, listen) = self.listen()?;
            // One call each, in either order: neither end can finish (the acceptor waits for
            // the connector's ready, the connector for the reply it has not read).
            if i % 2 == 0 {
                self.one_step(listen, &mut h)?;
            } else {
                if drv.accept(listen)?.is_some() {
                    return Err("abandon: accepted before any connect".into());
                }
                if drv.connect(self.ctx, SEND_DEV, &mut h)?.is_some() {
                    return Err("abandon: connected in one call".into());
                }
            }
            drv.close(Close::Listen, listen)?;
            connects.push(h);
        }
        let (mut h, listen) = self.listen()?;
        self.one_step(listen, &mut h)?;
        connects.push(h);
        // Registrations on a pair that is then closed.
        let (s, r) = common::pair(drv, self.ctx, RECV_DEV, SEND_DEV)?;
        drv.reg_mr(s, self.src.as_mut_ptr(), BUF)?;
        drv.reg_mr(r, self.dst.as_mut_ptr(), BUF)?;
        drv.close(Close::Send, s)?;
        drv.close(Close::Recv, r)?;
        // A pair never closed, with registrations and a receive posted.
        let (send, recv) = common::pair(drv, self.ctx, RECV_DEV, SEND_DEV)?;
        let smh = drv.reg_mr(send, self.src.as_mut_ptr(), BUF)?;
        let rmh = drv.reg_mr(recv, self.dst.as_mut_ptr(), BUF)?;
        let d = self.dst.as_mut_ptr();
        let request = until("irecv", BOUND, || drv.irecv(recv, &[d], &[BUF], &[7], &[rmh], false))?;
        let mrs = vec![(send, smh), (recv, rmh)];
        eprintln!(
            "census: abandoned {} connects, {ABANDONED} accepts, a listener, a pair with a \
             posted receive, and 4 registrations; finalize",
            connects.len()
        );
        Ok(Left { connects, listen, send, recv, mrs, request })
    }

    /// One `connect` call and one `accept` call, neither of which can finish.
    fn one_step(&self, listen: Ptr, h: &mut [u8; 128]) -> Result<(), String> {
        if self.drv.connect(self.ctx, SEND_DEV, h)?.is_some() {
            return Err("abandon: connected in one call".into());
        }
        if self.drv.accept(listen)?.is_some() {
            return Err("abandon: accepted in one call".into());
        }
        Ok(())
    }
}

/// Sends that start below the registration `smh`, start above it, and start at its start `s`
/// but run past its end, with a receive posted: each is refused with a WARN naming the
/// registration, and the comm stays usable. (The first two, should a lookup pass them, would
/// go out inline from unmapped addresses and crash the process; the third then goes out
/// truncated to the receive, and this says so.) The registration's keys are looked up only
/// once a receive matches, so `Ok(None)` (its CTS not yet here) is asked again.
fn outside(drv: &Driver, send: Ptr, tag: i32, (s, smh): (*mut u8, Ptr)) -> Result<(), String> {
    let cases = [(8, 8, "below"), (usize::MAX - 16, 8, "above"), (s as usize, 1 << 40, "across")];
    for (addr, size, what) in cases {
        common::warnings();
        until("an isend outside its registration", BOUND, || {
            match drv.isend(send, addr as *mut u8, size, tag, smh) {
                Err(_) => Ok(Some(())),
                Ok(None) => Ok(None),
                Ok(Some(_)) => Err(format!("an isend {what} its registration was posted")),
            }
        })?;
        let warns = common::warnings();
        if !warns.iter().any(|w| w.contains("is outside its registration")) {
            return Err(format!("an isend {what} its registration: no WARN names it: {warns:?}"));
        }
    }
    Ok(())
}

/// The last finalize names what it ended: the 4 registrations, the listener and the 2 comms.
fn finalize_warnings(left: &Left) -> Vec<String> {
    let warns = common::warnings();
    let want = [
        format!("deregistered {} memory registration(s)", 2 + left.mrs.len()),
        "closed 1 listener(s) and 2 comm(s)".to_string(),
    ];
    let missing: Vec<&String> =
        want.iter().filter(|w| !warns.iter().any(|l| l.contains(*w))).collect();
    if missing.is_empty() {
        eprintln!("census: finalize said: {warns:?}");
        return Vec::new();
    }
    vec![format!("finalize did not WARN {missing:?}; it said {warns:?}")]
}

/// This process's threads (and, once the plugin is unloaded, its fds) are back to `base`
/// (from before the plugin was loaded), and it holds no device resources. While the plugin is
/// loaded, the libraries it pulled in may keep an fd of their own, so fds are only reported.
fn back_to(
    pid: u32,
    base: (usize, usize),
    when: &str,
    unloaded: bool,
) -> Result<Vec<String>, String> {
    let (fds, threads) = settle(&base, Duration::from_secs(5), fds_threads);
    let res = settle(&Ok(RdmaCounts::default()), Duration::from_secs(10), || rdma_counts(pid))?;
    let now = format!(
        "{when}: fds {} -> {fds}, threads {} -> {threads}, device resources {res}",
        base.0, base.1
    );
    eprintln!("census: {now}");
    let fds_ok = !unloaded || fds == base.0;
    Ok(if fds_ok && threads == base.1 && res == RdmaCounts::default() {
        Vec::new()
    } else {
        vec![now]
    })
}

/// Every call on what outlived the last finalize is an error (and none crashes); the closes
/// free what is left of them.
fn stale_calls(drv: &Driver, left: &Left) -> Vec<String> {
    let mut bad = Vec::new();
    let mut expect_err = |what: &str, r: Result<(), String>| {
        if r.is_ok() {
            bad.push(format!("after finalize, {what} succeeded"));
        }
    };
    for h in &left.connects {
        let mut h = *h;
        expect_err(
            "connect on an abandoned connect",
            drv.connect(null_mut(), SEND_DEV, &mut h).map(drop),
        );
    }
    expect_err("test of a receive", drv.test(left.request).map(drop));
    let mut b = [0u8; 8];
    expect_err("isend", drv.isend(left.send, b.as_mut_ptr(), 8, 0, left.mrs[0].1).map(drop));
    expect_err("accept", drv.accept(left.listen).map(drop));
    for &(comm, mh) in &left.mrs {
        expect_err("deregMr", drv.dereg_mr(comm, mh));
    }
    expect_err("closeSend", drv.close(Close::Send, left.send));
    expect_err("closeRecv", drv.close(Close::Recv, left.recv));
    expect_err("closeListen", drv.close(Close::Listen, left.listen));
    common::warnings();
    if bad.is_empty() {
        eprintln!("census: every call on what outlived finalize was an error");
    }
    bad
}

/// `init` after the last finalize starts cleanly: a fresh context, one cycle, finalize.
fn again(drv: &Driver, comm_id: u64) -> Result<(), String> {
    let ctx = drv.init(comm_id)?;
    let mut c = Census::new(drv, ctx);
    c.cycle(0).map_err(|e| format!("a cycle after init again: {e}"))?;
    drop(c);
    drv.finalize(ctx)?;
    common::warnings();
    Ok(())
}

/// The child of a `killed` cycle: starts connecting, says `SENT` once its hello is out, and
/// waits to be killed.
fn child_connect(hexh: Option<&String>) -> Result<(), String> {
    ferroce_tools::loader::ECHO.store(false, Ordering::Relaxed);
    let mut h = from_hex(hexh.ok_or("child-connect needs a handle")?)?;
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(99)?;
    // The listener's kernel completes the TCP handshake while nobody calls accept, so the
    // hello goes out within a few calls; give it a while, then report.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        if drv.connect(ctx, SEND_DEV, &mut h)?.is_some() {
            return Err("connected although nobody accepted".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("SENT");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_secs(120));
    Err("was not killed".into())
}

/// What is measured: fds, threads, RSS, and this process's device resources.
struct Snapshot {
    fds: usize,
    threads: usize,
    rss: u64,
    res: RdmaCounts,
}

fn snapshot(pid: u32) -> Result<Snapshot, String> {
    let (fds, threads) = fds_threads();
    Ok(Snapshot { fds, threads, rss: rss_bytes(), res: rdma_counts(pid)? })
}

fn census(args: &[String]) -> Result<(), String> {
    require_vm();
    let cycles = common::num_arg(args, "--cycles", 1000)?;
    let warmup = common::num_arg(args, "--warmup", 16)?;
    // SAFETY: no other thread exists yet.
    unsafe {
        std::env::set_var("FERROCE_SETUP_TIMEOUT_MS", SETUP_TIMEOUT_MS);
        if std::env::var_os("NCCL_IB_QPS_PER_CONNECTION").is_none() {
            std::env::set_var("NCCL_IB_QPS_PER_CONNECTION", QPS);
        }
    }
    ferroce_tools::loader::ECHO.store(false, Ordering::Relaxed);
    // The RSS bound is about this process's own pages. With transparent huge pages on (the
    // VM's kernel: "always"), khugepaged may fold part of the heap into one 2 MiB page at any
    // time, and resident memory then jumps by up to 2 MiB with nothing leaked (seen once in
    // CI: +2,056 KiB where runs around it grew 100 to 170 KiB).
    // SAFETY: prctl(PR_SET_THP_DISABLE) takes integer arguments only.
    let thp_off = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } == 0;
    if !thp_off {
        return Err(format!("prctl(PR_SET_THP_DISABLE): {}", std::io::Error::last_os_error()));
    }
    let pid = std::process::id();
    let (fds0, threads0) = fds_threads();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let mut c = Census::new(&drv, ctx);
    let t = Instant::now();
    for i in 0..warmup {
        c.cycle(i).map_err(|e| format!("warm-up cycle {i} ({:?}): {e}", kind_of(i)))?;
        common::warnings();
    }
    eprintln!("census: {warmup} warm-up cycles in {:.1} s", t.elapsed().as_secs_f64());
    let base = snapshot(pid)?;
    eprintln!(
        "census: baseline: fds {}, threads {}, RSS {} KiB, device resources {}",
        base.fds,
        base.threads,
        base.rss >> 10,
        base.res
    );

    // The silent stranger alone with the listener, until the listener drops it.
    {
        let t = Instant::now();
        let (handle, listen) = c.listen()?;
        let (s, _) = c.stranger(&handle)?;
        c.accept_only(listen, "a silent stranger alone", SILENT_BOUND, || closed(&s))?;
        let dropped = t.elapsed();
        c.rightful(&handle, listen, 0)?;
        drv.close(Close::Listen, listen)?;
        common::warnings();
        eprintln!(
            "census: a silent stranger alone with the listener was dropped after {:.1} s, then \
             the rightful peer connected",
            dropped.as_secs_f64()
        );
    }

    let t = Instant::now();
    let mut last = Instant::now();
    for i in warmup..warmup + cycles {
        c.cycle(i).map_err(|e| format!("cycle {i} ({:?}): {e}", kind_of(i)))?;
        // The capture of the plugin's log would grow without bound.
        common::warnings();
        if last.elapsed() > Duration::from_secs(15) {
            last = Instant::now();
            let n = i + 1 - warmup;
            let (fds, threads) = fds_threads();
            eprintln!(
                "census: {n} cycles, {:.1}/s; fds {fds}, threads {threads}, RSS {} KiB",
                n as f64 / t.elapsed().as_secs_f64(),
                rss_bytes() >> 10
            );
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let (fds, threads) = settle(&(base.fds, base.threads), Duration::from_secs(5), fds_threads);
    let res = settle(&Ok(base.res), Duration::from_secs(10), || rdma_counts(pid))?;
    let rss = rss_bytes();
    eprintln!(
        "census: {cycles} cycles in {secs:.1} s ({:.1} cycles/s), {:.1} MiB verified",
        cycles as f64 / secs,
        c.bytes as f64 / (1 << 20) as f64
    );
    for (what, n) in &c.outcomes {
        eprintln!("census:   {n:5} x {what}");
    }
    let per_kind: Vec<String> = c
        .time
        .iter()
        .map(|(k, (n, s))| format!("{k:?} {:.0} ms", 1000.0 * s / *n as f64))
        .collect();
    eprintln!("census: mean time per cycle (warm-up included): {}", per_kind.join(", "));
    eprintln!(
        "census: after: fds {} -> {fds}, threads {} -> {threads}, RSS {} -> {} KiB ({:+} KiB, \
         bound {} KiB), device resources {} -> {res}",
        base.fds,
        base.threads,
        base.rss >> 10,
        rss >> 10,
        (rss as i64 - base.rss as i64) / 1024,
        RSS_GROWTH >> 10,
        base.res
    );
    let mut bad = Vec::new();
    if (fds, threads) != (base.fds, base.threads) {
        bad.push(format!("fds {} -> {fds}, threads {} -> {threads}", base.fds, base.threads));
    }
    if res != base.res {
        bad.push(format!("device resources {} -> {res}", base.res));
    }
    if rss > base.rss + RSS_GROWTH {
        bad.push(format!("RSS grew by {} KiB", (rss - base.rss) >> 10));
    }

    bad.extend(c.two_communicators(pid)?);

    // What ncclCommAbort leaves, then the last finalize: nothing may survive it.
    let left = c.abandon()?;
    drop(c);
    common::warnings();
    drv.finalize(ctx)?;
    bad.extend(finalize_warnings(&left));
    bad.extend(back_to(pid, (fds0, threads0), "after the last finalize (before dlclose)", false)?);
    bad.extend(stale_calls(&drv, &left));
    if !bad.is_empty() {
        // Unloading now, with the event thread perhaps still running, could crash the report.
        return Err(bad.join("; "));
    }
    // init afterwards starts cleanly, on the same load and after a reload.
    again(&drv, 3)?;
    drop(lib);
    bad.extend(back_to(pid, (fds0, threads0), "after finalize and dlclose", true)?);
    let lib = open_plugin();
    again(&Driver::new(&lib, 12)?, 4)?;
    drop(lib);
    bad.extend(back_to(
        pid,
        (fds0, threads0),
        "after dlopen, a cycle, finalize and dlclose",
        true,
    )?);
    if !bad.is_empty() {
        return Err(bad.join("; "));
    }
    println!("census: passed: {cycles} cycles, {:.1} cycles/s", cycles as f64 / secs);
    Ok(())
}
