//! Fault soak on Soft-RoCE: two processes (a receiver on rxe1, a sender on rxe0) drive the
//! plugin through its C ABI for `--seconds N` (default 120) while `tc netem` impairs the veth
//! pair in both directions, and every byte and every request is accounted for.
//!
//! Two modes × four phases, each on its own connection of 4 QPs
//! (`NCCL_IB_QPS_PER_CONNECTION=4`) for an eighth of the time: whole messages round-robin over
//! the QPs (`NCCL_IB_SPLIT_DATA_ON_QPS=0`) and every message split across them (`=1`), under
//! 1% loss, 5% loss, reordering (2 ms delay, 25% sent at once) and 2 ms ± 1 ms jitter (see
//! [`PHASES`] for why the lossy phases keep to small messages on rxe). A phase ends by the
//! receiver ceasing to post, the sender sending exactly what was posted, and both draining
//! under the same impairment.
//!
//! The traffic, from one seeded schedule both sides compute (the seed is printed; `--seed S`
//! replays the schedules, though not their timing): groups of 1..=8 buffers, each with a
//! distinct random tag and a random size (0 B up to the phase's maximum, 300 KiB at most)
//! posted into a slightly larger buffer. The receiver keeps up to 16 multi-receives posted; the
//! sender sends each group's buffers in a random order of tags. Checks, any of which fails the
//! soak:
//! - the content of every buffer derives from (seed, group, tag), so a message delivered to the
//!   wrong group or tag is caught, and the bytes past it up to the buffer's end must keep their
//!   poison (no overrun);
//! - every request reports the size sent with its tag, and completes once: a request handle the
//!   plugin hands out while the same handle is still in flight is a duplicate, and a request that
//!   does not complete within [`STALL`] is lost;
//! - any error from any call (a failed completion, the progress timeout, a probe) fails it;
//! - the receiver's verified totals equal the sender's, and every posted group completed.
//!
//! Knobs: `NCCL_IB_TIMEOUT=16` (268 ms per attempt: shorter ones fire spuriously on a loaded
//! TCG host), `NCCL_IB_RETRY_CNT=7` (unbounded transport retries on rxe: a loss must cost time,
//! never the request; with 6, 5% loss in split mode exhausted the retries of an 8 KiB write in
//! about one CI run in three), and a progress timeout of 60 s, the plugin's own bound on every
//! wait, so only a real stall trips it. The peers' neighbour entries are pinned while the soak
//! runs (see [`Netem::load`]). Before and after, the rxe hw_counters are read and their
//! changes reported (never asserted: retransmissions are the point).
//!
//! Built with its own `main` (`harness = false`) and run by `ci/vm-tests.sh` in the VM (120 s);
//! `ci/soak.sh [SECONDS]` runs it for longer.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::ffi::c_int;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::ECHO;
use ferroce_tools::proc::{Proc, lines_of};
use ferroce_tools::rank::one_comm;
use ferroce_tools::rng::{Rng, mix};

/// Multi-receives in flight (the plugin allows 32).
const WINDOW: usize = 16;
const MAX_ITEMS: usize = 8;
/// The largest message, and the room of one buffer (a little more, for the poison check).
const MAX_SIZE: usize = 300 << 10;
const ITEM_ROOM: usize = MAX_SIZE + 4096;
const AREA: usize = MAX_ITEMS * ITEM_ROOM;
const POISON: u8 = 0xee;
/// A request that has not completed for this long is lost.
const STALL: Duration = Duration::from_secs(90);
const KNOBS: [(&str, &str); 5] = [
    ("NCCL_IB_QPS_PER_CONNECTION", "4"),
    ("NCCL_IB_TIMEOUT", "16"),
    ("NCCL_IB_RETRY_CNT", "7"),
    ("FERROCE_PROGRESS_TIMEOUT_MS", "60000"),
    ("FERROCE_PROBE_INTERVAL_MS", "5000"),
];
/// The phases: a name, the impairment (netem's arguments, for the packets arriving at either
/// veth; see [`Netem`]), and the largest message.
///
/// Lossy and reordering phases keep messages to 8 KiB. rxe (6.1) requests an ACK only every 64
/// packets or at the end of a work request, and resets a QP's retry counter only on a positive
/// ACK; after a loss it goes back N, and each further loss or reordered packet before the next
/// ACK costs another retry. With `NCCL_IB_RETRY_CNT=6` (the largest bounded value), one work
/// request of tens of KiB or more at 1 KiB MTU then ends in RETRY_EXC_ERR within seconds under
/// 1% loss, 25% reordering or reordering jitter (measured); with unbounded retries each attempt
/// resends so many packets that one almost never gets through. Messages of up to 8 KiB (8
/// packets, one work request each) get through all of them. The jitter phase keeps packet order
/// (netem's `rate` serialises its queue) and so carries the full range of sizes. Under
/// reordering rxe's responder now and then loses track of a write and refuses it as invalid
/// (`IBV_WC_REM_INV_REQ_ERR`: once in a CI soak of 120 s, and in one of three reordering-only
/// soaks of 400 to 600 s): that lane fails over, with a WARN, and the soak goes on.
const PHASES: [(&str, &str, usize); 4] = [
    ("loss 1%", "loss 1%", 8 << 10),
    ("loss 5%", "loss 5%", 8 << 10),
    ("reorder", "delay 2ms reorder 25% 50%", 8 << 10),
    ("jitter", "delay 2ms 1ms rate 1gbit", MAX_SIZE),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("recv") => role(false, &args[1..]),
        Some("send") => role(true, &args[1..]),
        _ => orchestrate(&args),
    };
    common::exit_on_error("soak", r);
}

fn arg(args: &[String], name: &str) -> Result<Option<String>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => args.get(i + 1).cloned().map(Some).ok_or(format!("{name} needs a value")),
    }
}

fn num(args: &[String], name: &str) -> Result<Option<u64>, String> {
    arg(args, name)?
        .map(|v| v.parse().map_err(|_| format!("{name} {v:?} is not a number")))
        .transpose()
}

// --- the schedule ------------------------------------------------------------------------------

/// One buffer of a multi-receive: its tag, the size sent, the size posted.
#[derive(Clone, Copy, Debug)]
struct Item {
    tag: c_int,
    size: usize,
    capacity: usize,
}

/// Group `g` of the schedule: its buffers, and the order (indices) in which the sender sends
/// them.
fn group(seed: u64, g: u64, max_size: usize) -> (Vec<Item>, Vec<usize>) {
    let mut rng = Rng(mix(seed ^ mix(g)));
    let n = 1 + rng.below(MAX_ITEMS as u64) as usize;
    let mut items: Vec<Item> = Vec::with_capacity(n);
    while items.len() < n {
        let tag = (rng.next() >> 33) as c_int;
        if items.iter().any(|it| it.tag == tag) {
            continue;
        }
        let size = match rng.below(100) {
            0..10 => 0,
            10..35 => rng.below(257),
            35..65 => rng.below(16 << 10),
            65..88 => rng.below(128 << 10),
            _ => rng.below(MAX_SIZE as u64 + 1),
        } as usize;
        let size = size.min(max_size);
        let capacity = (size + rng.below(4097) as usize).min(ITEM_ROOM);
        items.push(Item { tag, size, capacity });
    }
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    (items, order)
}

/// The content of the buffer with `tag` in group `g`.
fn pattern(seed: u64, g: u64, tag: c_int, buf: &mut [u8]) {
    Rng(mix(seed ^ mix(g ^ (u64::from(tag as u32) << 32)))).fill(buf);
}

// --- one side (a child process) ----------------------------------------------------------------

/// Completed and checked so far: groups, messages, bytes.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Totals {
    groups: u64,
    msgs: u64,
    bytes: u64,
}

impl Totals {
    fn line(&self, what: &str) -> String {
        format!("{what} {} {} {}", self.groups, self.msgs, self.bytes)
    }

    fn parse(l: &str) -> Result<Totals, String> {
        let w: Vec<u64> = l.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        match w.as_slice() {
            [groups, msgs, bytes] => Ok(Totals { groups: *groups, msgs: *msgs, bytes: *bytes }),
            _ => Err(format!("bad totals line {l:?}")),
        }
    }
}

/// A posted multi-receive.
struct RecvReq {
    g: u64,
    req: Ptr,
    items: Vec<Item>,
    area: usize,
    since: Instant,
}

/// A posted send.
struct SendReq {
    g: u64,
    tag: c_int,
    size: usize,
    req: Ptr,
    area: usize,
    since: Instant,
}

/// The group the sender is posting: its buffers, their order, how many are posted.
struct Posting {
    g: u64,
    items: Vec<Item>,
    order: Vec<usize>,
    next: usize,
    area: usize,
}

/// Commands on stdin (the receiver's `STOP`, the sender's `END n`), events on stdout (`HANDLE`,
/// `READY`, `POSTED n`, `DONE g m b`; both then wait for `CLOSE` before closing their comm).
fn role(sender: bool, args: &[String]) -> Result<(), String> {
    ECHO.store(std::env::var_os("SOAK_VERBOSE").is_some(), std::sync::atomic::Ordering::Relaxed);
    let seed = num(args, "--seed")?.ok_or("missing --seed")?;
    let say = |s: String| {
        println!("{s}");
        std::io::stdout().flush().map_err(|e| e.to_string())
    };
    let lines = lines_of(std::io::stdin());
    let lib = common::open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(9)?;
    let peer =
        if sender { Some(arg(args, "--handle")?.ok_or("send needs --handle")?) } else { None };
    let dev = if sender { 0 } else { 1 };
    let comm = one_comm(&drv, ctx, dev, peer.as_deref(), Duration::from_secs(30))?;
    let mut arena = vec![POISON; WINDOW * AREA];
    let mh = drv.reg_mr(comm, arena.as_mut_ptr(), arena.len())?;
    say("READY".into())?;
    let max_size = num(args, "--max-size")?.ok_or("missing --max-size")? as usize;
    if max_size > MAX_SIZE {
        return Err(format!("--max-size {max_size} is above {MAX_SIZE}"));
    }
    let side = Side { drv: &drv, comm, mh, seed, max_size, lines: &lines, say: &say };
    let totals = if sender { side.send(&mut arena) } else { side.recv(&mut arena) };
    let totals = totals.inspect_err(|_| queue_pairs(sender))?;
    say(totals.line("DONE"))?;
    // Both ends keep their comm until both are done. A receiver that closed as soon as its
    // last receive completed would leave the sender retransmitting its last write into a
    // destroyed QP whenever that write's ACK was lost (RETRY_CNT 7 retries for ever), and the
    // sender's progress timeout would fail a soak in which nothing went wrong.
    match lines.recv_timeout(STALL + Duration::from_secs(60)) {
        Ok(l) if l == "CLOSE" => {}
        Ok(l) => return Err(format!("expected CLOSE, got {l:?}")),
        Err(e) => return Err(format!("no CLOSE from the orchestrator: {e}")),
    }
    drv.dereg_mr(comm, mh)?;
    drv.close(if sender { Close::Send } else { Close::Recv }, comm)?;
    drv.finalize(ctx)?;
    let warns = common::warnings();
    for w in &warns {
        eprintln!("soak: plugin WARN ({}): {w}", if sender { "sender" } else { "receiver" });
    }
    Ok(())
}

/// On a failure, while this side's queue pairs (and the peer's) still exist: what rxe says of
/// every QP in the VM (state, send and receive PSNs), so a stall shows whether the sender still
/// had unacknowledged packets or the receiver had never seen them.
fn queue_pairs(sender: bool) {
    let who = if sender { "sender" } else { "receiver" };
    match Command::new("rdma").args(["-d", "res", "show", "qp"]).output() {
        Ok(o) => eprintln!(
            "soak: {who} failed; rdma res show qp:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => eprintln!("soak: {who} failed; rdma res show qp: {e}"),
    }
    for (k, v) in counters() {
        eprintln!("soak: {who} failed; {k} = {v}");
    }
}

/// Backs off when nothing moves: the two processes share the VM's 2 vCPUs with rxe's
/// softirq work (run by ksoftirqd under load), and spinning flat out starves it into spurious
/// retransmission timeouts.
struct Idle(u32);

impl Idle {
    fn wait(&mut self, busy: bool) {
        if busy {
            self.0 = 0;
        } else {
            self.0 += 1;
            if self.0 > 64 {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

struct Side<'a, S: Fn(String) -> Result<(), String>> {
    drv: &'a Driver<'a>,
    comm: Ptr,
    mh: Ptr,
    seed: u64,
    max_size: usize,
    lines: &'a Receiver<String>,
    say: &'a S,
}

impl<S: Fn(String) -> Result<(), String>> Side<'_, S> {
    /// The next command, if any.
    fn command(&self) -> Result<Option<String>, String> {
        match self.lines.try_recv() {
            Ok(l) => Ok(Some(l)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err("the orchestrator went away".into()),
        }
    }

    fn recv(&self, arena: &mut [u8]) -> Result<Totals, String> {
        let base = arena.as_mut_ptr();
        let mut free: Vec<usize> = (0..WINDOW).rev().collect();
        let mut inflight: Vec<RecvReq> = Vec::new();
        let mut live: HashSet<usize> = HashSet::new();
        let mut ready: Option<(u64, Vec<Item>, usize)> = None; // poisoned, not yet taken
        let (mut next, mut stopped, mut t) = (0u64, false, Totals::default());
        let mut expect = vec![0u8; MAX_SIZE];
        let mut idle = Idle(0);
        loop {
            match self.command()?.as_deref() {
                None => {}
                Some("STOP") => {
                    stopped = true;
                    if let Some((_, _, area)) = ready.take() {
                        free.push(area);
                    }
                    (self.say)(format!("POSTED {next}"))?;
                }
                Some(other) => return Err(format!("bad command {other:?}")),
            }
            let mut busy = false;
            if !stopped {
                if ready.is_none()
                    && let Some(area) = free.pop()
                {
                    let (items, _) = group(self.seed, next, self.max_size);
                    for (r, it) in items.iter().enumerate() {
                        let at = area * AREA + r * ITEM_ROOM;
                        arena[at..at + it.capacity].fill(POISON);
                    }
                    ready = Some((next, items, area));
                }
                let posted = match &ready {
                    Some((_, items, area)) => {
                        let data: Vec<*mut u8> = (0..items.len())
                            .map(|r| base.wrapping_add(area * AREA + r * ITEM_ROOM))
                            .collect();
                        let caps: Vec<usize> = items.iter().map(|it| it.capacity).collect();
                        let tags: Vec<c_int> = items.iter().map(|it| it.tag).collect();
                        let mhs = vec![self.mh; items.len()];
                        self.drv.irecv(self.comm, &data, &caps, &tags, &mhs, false)?
                    }
                    None => None,
                };
                if let Some(req) = posted {
                    let (g, items, area) = ready.take().expect("posted from it");
                    if !live.insert(req as usize) {
                        return Err(format!("irecv of group {g} returned a request in flight"));
                    }
                    inflight.push(RecvReq { g, req, items, area, since: Instant::now() });
                    next += 1;
                    busy = true;
                }
            }
            let mut i = 0;
            while i < inflight.len() {
                let q = &inflight[i];
                let tested = self
                    .drv
                    .test(q.req)
                    .map_err(|e| format!("the receive of group {} {:?}: {e}", q.g, q.items))?;
                let Some(sizes) = tested else {
                    if q.since.elapsed() > STALL {
                        return Err(format!(
                            "the receive of group {} ({} buffers) did not complete in {STALL:?}",
                            q.g,
                            q.items.len()
                        ));
                    }
                    i += 1;
                    continue;
                };
                let q = inflight.swap_remove(i);
                live.remove(&(q.req as usize));
                busy = true;
                for (r, it) in q.items.iter().enumerate() {
                    let at = q.area * AREA + r * ITEM_ROOM;
                    let what = || format!("group {} buffer {r} (tag {})", q.g, it.tag);
                    if sizes[r] as usize != it.size {
                        return Err(format!(
                            "{}: reported {} bytes, {} were sent",
                            what(),
                            sizes[r],
                            it.size
                        ));
                    }
                    let want = &mut expect[..it.size];
                    pattern(self.seed, q.g, it.tag, want);
                    let got = &arena[at..at + it.size];
                    if got != &want[..] {
                        let bad = got.iter().zip(want.iter()).position(|(a, b)| a != b);
                        return Err(format!(
                            "{}: {} bytes, first wrong byte at {bad:?}",
                            what(),
                            it.size
                        ));
                    }
                    if let Some(p) =
                        arena[at + it.size..at + it.capacity].iter().position(|&b| b != POISON)
                    {
                        return Err(format!(
                            "{}: written past its {} bytes, at {}",
                            what(),
                            it.size,
                            it.size + p
                        ));
                    }
                    t.msgs += 1;
                    t.bytes += it.size as u64;
                }
                t.groups += 1;
                free.push(q.area);
            }
            if stopped && inflight.is_empty() {
                if t.groups != next {
                    return Err(format!("posted {next} groups, completed {}", t.groups));
                }
                return Ok(t);
            }
            idle.wait(busy);
        }
    }

    fn send(&self, arena: &mut [u8]) -> Result<Totals, String> {
        let base = arena.as_mut_ptr();
        let mut free: Vec<usize> = (0..WINDOW).rev().collect();
        let mut users = [0usize; WINDOW]; // sends in flight per area
        let mut inflight: Vec<SendReq> = Vec::new();
        let mut live: HashSet<usize> = HashSet::new();
        let mut posting: Option<Posting> = None;
        let (mut next, mut end, mut t) = (0u64, None::<u64>, Totals::default());
        let mut idle = Idle(0);
        loop {
            match self.command()?.as_deref() {
                None => {}
                Some(l) if l.starts_with("END ") => {
                    let n: u64 = l[4..].trim().parse().map_err(|_| format!("bad {l:?}"))?;
                    if next > n || posting.as_ref().is_some_and(|p| p.g >= n && p.next > 0) {
                        return Err(format!("sent into group {next} but the receiver posted {n}"));
                    }
                    if let Some(p) = posting.take_if(|p| p.g >= n) {
                        free.push(p.area);
                    }
                    end = Some(n);
                }
                Some(other) => return Err(format!("bad command {other:?}")),
            }
            let mut busy = false;
            if posting.is_none()
                && end.is_none_or(|e| next < e)
                && let Some(area) = free.pop()
            {
                let (items, order) = group(self.seed, next, self.max_size);
                for (r, it) in items.iter().enumerate() {
                    let at = area * AREA + r * ITEM_ROOM;
                    pattern(self.seed, next, it.tag, &mut arena[at..at + it.size]);
                }
                posting = Some(Posting { g: next, items, order, next: 0, area });
            }
            while let Some(p) = &mut posting {
                let r = p.order[p.next];
                let it = p.items[r];
                let data = base.wrapping_add(p.area * AREA + r * ITEM_ROOM);
                let Some(req) = self.drv.isend(self.comm, data, it.size, it.tag, self.mh)? else {
                    break;
                };
                if !live.insert(req as usize) {
                    return Err(format!("isend of group {} returned a request in flight", p.g));
                }
                inflight.push(SendReq {
                    g: p.g,
                    tag: it.tag,
                    size: it.size,
                    req,
                    area: p.area,
                    since: Instant::now(),
                });
                users[p.area] += 1;
                p.next += 1;
                busy = true;
                if p.next == p.items.len() {
                    posting = None;
                    next += 1;
                }
            }
            let mut i = 0;
            while i < inflight.len() {
                let q = &inflight[i];
                let tested = self.drv.test(q.req).map_err(|e| {
                    format!("the send of group {} tag {} ({} bytes): {e}", q.g, q.tag, q.size)
                })?;
                let Some(sizes) = tested else {
                    if q.since.elapsed() > STALL {
                        return Err(format!(
                            "the send of group {} tag {} ({} bytes) did not complete in {STALL:?}",
                            q.g, q.tag, q.size
                        ));
                    }
                    i += 1;
                    continue;
                };
                let q = inflight.swap_remove(i);
                live.remove(&(q.req as usize));
                busy = true;
                if sizes[0] as usize != q.size {
                    return Err(format!(
                        "the send of group {} tag {} reported {} bytes, sent {}",
                        q.g, q.tag, sizes[0], q.size
                    ));
                }
                t.msgs += 1;
                t.bytes += q.size as u64;
                users[q.area] -= 1;
                if users[q.area] == 0 && posting.as_ref().is_none_or(|p| p.area != q.area) {
                    free.push(q.area);
                    t.groups += 1;
                }
            }
            if end.is_some_and(|e| next >= e) && posting.is_none() && inflight.is_empty() {
                return Ok(t);
            }
            idle.wait(busy);
        }
    }
}

// --- the orchestrator -------------------------------------------------------------------------

/// This program as `recv` or `send` of one phase.
fn start(
    mode: &str,
    seed: u64,
    split: u8,
    max_size: usize,
    handle: Option<&str>,
) -> Result<Proc, String> {
    let mut c = Proc::me(&[mode, "--seed", &seed.to_string(), "--max-size", &max_size.to_string()]);
    if let Some(h) = handle {
        c.args(["--handle", h]);
    }
    c.envs(KNOBS).env("NCCL_IB_SPLIT_DATA_ON_QPS", split.to_string()).stdin(Stdio::piped());
    Proc::spawn(mode, c)
}

/// Fails if the process has said anything or exited (each only speaks when asked).
fn still_fine(p: &mut Proc) -> Result<(), String> {
    if let Ok(l) = p.lines.try_recv() {
        return Err(format!("{}: unexpected {l:?}", p.name));
    }
    match p.try_wait()? {
        Some(st) => Err(format!("{} exited with {st} mid-soak", p.name)),
        None => Ok(()),
    }
}

/// Both sides' `DONE` totals (receiver, sender); then both close and must exit with status 0.
fn finish(mut recv: Proc, mut send: Proc) -> Result<(Totals, Totals), String> {
    let got = Totals::parse(&recv.expect("DONE", STALL + Duration::from_secs(60))?)?;
    let sent = Totals::parse(&send.expect("DONE", STALL + Duration::from_secs(60))?)?;
    for p in [&mut recv, &mut send] {
        p.tell("CLOSE")?;
    }
    for mut p in [recv, send] {
        p.exits_ok(Duration::from_secs(60))?;
    }
    Ok((got, sent))
}

/// The impairment and the pinned neighbours; removed again however the soak ends, so later
/// tests in the same VM run on a clean link.
///
/// The IP packets arriving at each veth are redirected to an ifb device, and netem impairs them
/// there. netem as a veth's root qdisc would reorder on its own: a veth with a queue hands each
/// packet to the backlog of whichever CPU dequeued it, so one QP's packets could arrive out of
/// order (rxe's responder answers some such orders with an invalid-request NAK, which ended a
/// jitter phase once in about a dozen soaks). An ifb delivers its queue in order.
struct Netem;

/// Each veth, and the ifb that impairs what arrives at it.
const IFBS: [(&str, &str); 2] = [("vethA", "ifbA"), ("vethB", "ifbB")];

/// Runs a system command; its failure, with what it printed, is the error.
fn sh(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{cmd} {}: {}", args.join(" "), err.trim()));
    }
    Ok(())
}

impl Netem {
    fn load() -> Result<Netem, String> {
        sh("modprobe", &["sch_netem"])
            .map_err(|e| format!("{e}: the soak needs tc netem in the VM kernel"))?;
        Netem.remove();
        let netem = Netem;
        for (veth, ifb) in IFBS {
            sh("ip", &["link", "add", ifb, "type", "ifb"])?;
            sh("ip", &["link", "set", ifb, "up"])?;
            sh("tc", &["qdisc", "add", "dev", veth, "clsact"])?;
            sh(
                "tc",
                &[
                    "filter", "add", "dev", veth, "ingress", "protocol", "ip", "prio", "1", "u32",
                    "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", ifb,
                ],
            )?;
        }
        // netem drops ARP as well as RoCE. Once the kernel's neighbour entry for the peer
        // lapses under loss, rxe (Linux 6.1) can stop a QP's retransmissions for good: 3 of 3
        // 480 s soaks stalled in a 5% loss phase (in either split mode) until the progress
        // deadline, none with permanent entries. Only IP goes through the ifbs now, but a
        // fabric's loss is the packets', so the neighbours stay pinned while the soak runs.
        for (dev, peer_ip, peer_dev) in
            [("vethA", "198.18.0.2", "vethB"), ("vethB", "198.18.0.1", "vethA")]
        {
            let mac = std::fs::read_to_string(format!("/sys/class/net/{peer_dev}/address"))
                .map_err(|e| format!("{peer_dev}'s address: {e}"))?;
            sh(
                "ip",
                &[
                    "neigh",
                    "replace",
                    peer_ip,
                    "lladdr",
                    mac.trim(),
                    "dev",
                    dev,
                    "nud",
                    "permanent",
                ],
            )?;
        }
        Ok(netem)
    }

    fn apply(&self, spec: &str) -> Result<(), String> {
        for (_, ifb) in IFBS {
            let args: Vec<&str> = ["qdisc", "replace", "dev", ifb, "root", "netem"]
                .into_iter()
                .chain(spec.split(' '))
                .collect();
            sh("tc", &args)?;
        }
        Ok(())
    }

    fn clear(&self) {
        for (_, ifb) in IFBS {
            let _ = sh("tc", &["qdisc", "del", "dev", ifb, "root"]);
        }
    }

    /// The redirects and the ifbs, whatever is left of them.
    fn remove(&self) {
        for (veth, ifb) in IFBS {
            let _ = sh("tc", &["qdisc", "del", "dev", veth, "clsact"]);
            let _ = sh("ip", &["link", "del", ifb]);
        }
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        self.remove();
        for (dev, peer_ip) in [("vethA", "198.18.0.2"), ("vethB", "198.18.0.1")] {
            let _ = sh("ip", &["neigh", "del", peer_ip, "dev", dev]);
        }
    }
}

/// Every hw counter of both rxe devices.
fn counters() -> BTreeMap<String, u64> {
    ["rxe0", "rxe1"]
        .into_iter()
        .flat_map(|dev| {
            let all = ferroce::verbs::sysfs::hw_counters(dev, 1);
            all.into_iter().map(move |(k, v)| (format!("{dev}.{k}"), v))
        })
        .collect()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// One phase on a fresh connection: impair, run for `time`, stop the receiver posting, let the
/// sender send exactly what was posted, drain (still impaired), compare both sides' totals.
/// Returns the verified totals and the seconds they took.
fn run_phase(
    netem: &Netem,
    seed: u64,
    split: u8,
    spec: &str,
    max_size: usize,
    time: Duration,
) -> Result<(Totals, f64), String> {
    netem.clear();
    let mut recv = start("recv", seed, split, max_size, None)?;
    let handle = recv.handle(Duration::from_secs(60))?;
    let mut send = start("send", seed, split, max_size, Some(&handle))?;
    recv.expect("READY", Duration::from_secs(60))?;
    send.expect("READY", Duration::from_secs(60))?;
    netem.apply(spec)?;
    let t = Instant::now();
    while t.elapsed() < time {
        std::thread::sleep(Duration::from_millis(200));
        still_fine(&mut recv)?;
        still_fine(&mut send)?;
    }
    recv.tell("STOP")?;
    let posted: u64 = recv
        .expect("POSTED", Duration::from_secs(30))?
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .ok_or("bad POSTED line")?;
    send.tell(&format!("END {posted}"))?;
    let (got, sent) = finish(recv, send)?;
    let secs = t.elapsed().as_secs_f64();
    netem.clear();
    if got != sent || got.groups != posted {
        return Err(format!(
            "the receiver verified {got:?} of {posted} groups posted, the sender completed {sent:?}"
        ));
    }
    if got.groups == 0 {
        return Err("no group completed".into());
    }
    Ok((got, secs))
}

fn orchestrate(args: &[String]) -> Result<(), String> {
    common::require_vm();
    if args
        .iter()
        .any(|a| a.starts_with("--") && !["--seconds", "--seed", "--only"].contains(&a.as_str()))
    {
        return Err(format!("usage: soak [--seconds N] [--seed S] [--only PHASE]; got {args:?}"));
    }
    // `--only "loss 5%"`: just the phases whose name contains it (to chase one impairment).
    let only = arg(args, "--only")?.unwrap_or_default();
    let phases: Vec<_> = PHASES.into_iter().filter(|p| p.0.contains(&only)).collect();
    if phases.is_empty() {
        return Err(format!("--only {only:?} matches no phase of {PHASES:?}"));
    }
    let seconds = num(args, "--seconds")?.unwrap_or(120);
    let seed = match num(args, "--seed")? {
        Some(s) => s,
        None => mix(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)),
    };
    let runs = 2 * phases.len() as u64;
    let phase = Duration::from_millis((seconds * 1000 / runs).max(1000));
    println!(
        "soak: seed {seed}, {seconds} s: 2 modes x {} phases of {:.1} s, knobs {KNOBS:?}",
        phases.len(),
        phase.as_secs_f64()
    );
    let netem = Netem::load()?;
    let before = counters();
    if before.is_empty() {
        return Err("no rxe hw_counters found".into());
    }
    let mut grand = Totals::default();
    let mut busy_secs = 0.0;
    for split in [0u8, 1] {
        for &(name, spec, max_size) in &phases {
            let i = PHASES.iter().position(|p| p.0 == name).unwrap_or(0);
            // Each phase and mode on its own connection, so each has its own size range and
            // exact totals; a different seed per phase, derived from the printed one.
            let pseed = mix(seed ^ (u64::from(split) << 8 | i as u64));
            let what = format!("split {split} {name:8}");
            let t = run_phase(&netem, pseed, split, spec, max_size, phase)
                .map_err(|e| format!("{what} (netem {spec}, phase seed {pseed}): {e}"))?;
            println!(
                "soak: {what}: {:6} groups {:7} msgs {:8.1} MiB verified in {:5.1} s: {:5.2} MiB/s, {:6.0} msgs/s (sizes 0..={max_size})",
                t.0.groups,
                t.0.msgs,
                mib(t.0.bytes),
                t.1,
                mib(t.0.bytes) / t.1,
                t.0.msgs as f64 / t.1
            );
            grand.groups += t.0.groups;
            grand.msgs += t.0.msgs;
            grand.bytes += t.0.bytes;
            busy_secs += t.1;
        }
    }
    drop(netem);
    let after = counters();
    let secs = busy_secs;
    println!("soak: rxe hw_counters that changed (reported, not asserted):");
    for (k, v) in &after {
        let d = v - before.get(k).copied().unwrap_or(0);
        if d != 0 {
            println!("soak:   {k} +{d}");
        }
    }
    println!(
        "soak: passed: seed {seed}: {} groups, {} messages, {:.1} MiB sent and verified in {secs:.0} s ({:.2} MiB/s); no request lost, duplicated or mismatched",
        grand.groups,
        grand.msgs,
        mib(grand.bytes),
        mib(grand.bytes) / secs
    );
    Ok(())
}
