//! Concurrency on Soft-RoCE: the calls NCCL makes from different threads at once, under load.
//!
//! NCCL drives each comm's data path (`isend`, `irecv`, `test`) from its proxy thread, while its
//! service thread registers buffers (`regMr`/`deregMr`) on the same comms at the same time. Here
//! two processes (a sender on rxe0, a receiver on rxe1) each run:
//! - 4 data threads, each connecting (or accepting) and then driving its own 4 comms of 4 QPs
//!   (`NCCL_IB_QPS_PER_CONNECTION=4`), with several requests in flight per comm and varied
//!   sizes (0 bytes to 256 KiB); the receiver checks every size and every byte, and that
//!   nothing was written past the end of a message;
//! - a fifth thread that registers and deregisters buffers on those same 16 comms for the whole
//!   run: its own buffers, sub-ranges of the comms' data buffers (so it shares the registration
//!   the data path is using at that very moment), several held at once, and one range on two
//!   comms.
//!
//! The whole run is done twice: messages round-robin over the QPs, then split across them
//! (`NCCL_IB_SPLIT_DATA_ON_QPS=0` and `1`). At the end every comm closes, and each process's
//! fds and threads, and the devices' QP/CQ/MR/PD counts, return to their baseline. The
//! receiver closes only once the sender's sends all completed.
//!
//! `concurrency [--msgs N]` (messages per comm, default 12). Built with its own `main`
//! (`harness = false`) and run by `ci/vm-tests.sh` in the VM; outside the VM it fails.

mod common;

use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::{BufRead, Write};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Shared, fds_threads, open_plugin, rdma_resources, require_vm, settle};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};
use ferroce_tools::proc::Proc;
use ferroce_tools::rng::Rng;
use ferroce_tools::sys::{RdmaCounts, rdma_counts};

const THREADS: usize = 4;
const COMMS: usize = 4; // per data thread
const NCOMMS: usize = THREADS * COMMS;
const QPS: &str = "4";
/// Requests in flight per comm.
const WINDOW: usize = 4;
/// The largest message; each in-flight request has a slot this big, plus a guard.
const SLOT: usize = 256 << 10;
/// Bytes after each slot's capacity that must stay untouched.
const GUARD: usize = 64;
const POISON: u8 = 0xa5;
/// No comm may go this long without a completion.
const STALL: Duration = Duration::from_secs(60);
/// The registration thread must manage at least this many cycles in each process, spread over
/// the run: message `m` of a comm is posted only once it has done `(m + 1) / msgs` of them, so
/// registrations interleave with the data path however the threads are scheduled.
const MIN_REG_CYCLES: u64 = 100;
/// The whole of one run (both processes), in the emulated VM.
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let msgs = match args.iter().position(|a| a == "--msgs") {
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(0),
        None => 12,
    };
    let r = if msgs == 0 {
        Err("--msgs needs a positive number".to_string())
    } else {
        match args.first().map(String::as_str) {
            None | Some("--msgs") => orchestrate(msgs),
            Some("recv") => role(false, msgs),
            Some("send") => role(true, msgs),
            Some(other) => Err(format!("unknown mode {other:?}")),
        }
    };
    if let Err(e) = r {
        for w in common::warnings() {
            eprintln!("concurrency: plugin WARN: {w}");
        }
        eprintln!("concurrency: FAILED: {e}");
        std::process::exit(1);
    }
}

// --- the schedule ---------------------------------------------------------------------------

/// The size of message `m` of comm `k` (both sides compute the same).
fn size_of(k: usize, m: usize) -> usize {
    let mut r = Rng(0x5eed_0000 ^ ((k as u64) << 32) ^ (m as u64) | 1);
    r.next();
    match r.below(6) {
        0 => r.below(2) as usize, // 0 or 1 byte
        1 => r.below(64) as usize,
        2 => r.below(4097) as usize,
        3 => 4096 * (1 + r.below(16) as usize),
        _ => r.below(SLOT as u64 + 1) as usize,
    }
}

/// The capacity the receiver posts for message `m`: its size, or a little more.
fn capacity_of(k: usize, m: usize) -> usize {
    (size_of(k, m) + (m % 3) * 1000).min(SLOT)
}

/// The byte pattern of message `m` of comm `k`.
fn fill(k: usize, m: usize, buf: &mut [u8]) {
    Rng(0xc0ff_ee00 ^ ((k as u64) << 40) ^ ((m as u64) << 8) | 1).fill(buf);
}

fn tag_of(m: usize) -> c_int {
    (m % 1000) as c_int
}

// --- one process -----------------------------------------------------------------------------

/// One comm of a data thread: its buffer (WINDOW slots) and what is in flight.
struct Lane {
    k: usize,
    comm: Ptr,
    buf: Vec<u8>,
    mh: Ptr,
    next: usize,
    done: usize,
    /// The message whose bytes are in its slot but which the plugin has not taken yet.
    filled: Option<usize>,
    inflight: VecDeque<(usize, Ptr)>,
    last: Instant,
}

fn slot(m: usize) -> usize {
    (m % WINDOW) * (SLOT + GUARD)
}

/// One round of one comm: post what the window allows, complete what is done.
fn step(
    drv: &Driver,
    sender: bool,
    l: &mut Lane,
    msgs: usize,
    bytes: &AtomicU64,
    registered: u64,
) -> Result<(), String> {
    let paced = |next: usize| registered * msgs as u64 >= (next as u64 + 1) * MIN_REG_CYCLES;
    while l.inflight.len() < WINDOW && l.next < msgs && paced(l.next) {
        let m = l.next;
        let (off, size) = (slot(m), size_of(l.k, m));
        let req = if sender {
            if l.filled != Some(m) {
                fill(l.k, m, &mut l.buf[off..off + size]);
                l.filled = Some(m);
            }
            drv.isend(l.comm, l.buf[off..].as_mut_ptr(), size, tag_of(m), l.mh)?
        } else {
            if l.filled != Some(m) {
                l.buf[off..off + SLOT + GUARD].fill(POISON);
                l.filled = Some(m);
            }
            let p = l.buf[off..].as_mut_ptr();
            drv.irecv(l.comm, &[p], &[capacity_of(l.k, m)], &[tag_of(m)], &[l.mh], false)?
        };
        match req {
            Some(r) => {
                l.inflight.push_back((m, r));
                l.next += 1;
            }
            None => break,
        }
    }
    if let Some(&(m, r)) = l.inflight.front()
        && let Some(sizes) = drv.test(r)?
    {
        l.inflight.pop_front();
        let (off, size) = (slot(m), size_of(l.k, m));
        if sizes[0] as usize != size {
            return Err(format!(
                "comm {} message {m}: test reported {} bytes, sent {size}",
                l.k, sizes[0]
            ));
        }
        if !sender {
            let mut want = vec![0u8; size];
            fill(l.k, m, &mut want);
            let got = &l.buf[off..off + size];
            if let Some(bad) = got.iter().zip(&want).position(|(a, b)| a != b) {
                return Err(format!(
                    "comm {} message {m} ({size} bytes): first wrong byte at {bad}",
                    l.k
                ));
            }
            let tail = &l.buf[off + size..off + SLOT + GUARD];
            if let Some(bad) = tail.iter().position(|&b| b != POISON) {
                return Err(format!(
                    "comm {} message {m} ({size} bytes): byte {} past its end was written",
                    l.k,
                    size + bad
                ));
            }
        }
        bytes.fetch_add(size as u64, Ordering::Relaxed);
        l.done += 1;
        l.last = Instant::now();
    }
    Ok(())
}

/// The data path of one thread: its comms round-robin until every message is done.
fn drive(
    drv: &Driver,
    sender: bool,
    lanes: &mut [Lane],
    msgs: usize,
    bytes: &AtomicU64,
    registered: &AtomicU64,
) -> Result<(), String> {
    for round in 0u64.. {
        if lanes.iter().all(|l| l.done == msgs) {
            return Ok(());
        }
        let registered = registered.load(Ordering::Acquire);
        for l in lanes.iter_mut() {
            step(drv, sender, l, msgs, bytes, registered)?;
        }
        // The clock is slow in an emulated VM: look at it now and then.
        if round % 256 == 255
            && let Some(l) = lanes.iter().find(|l| l.done < msgs && l.last.elapsed() > STALL)
        {
            return Err(format!(
                "comm {}: no completion for {STALL:?} ({} of {msgs} done)",
                l.k, l.done
            ));
        }
    }
    unreachable!("the loop only ends by returning")
}

/// Registers and deregisters on the comms until `stop`; returns the number of regMr/deregMr
/// pairs. `data` are the comms' data buffers (address, length), which the data path uses.
fn registrar(
    drv: &Driver,
    comms: &[Ptr],
    data: &[(usize, usize)],
    stop: &AtomicBool,
    count: &AtomicU64,
) -> Result<u64, String> {
    let mut scratch: Vec<Vec<u8>> =
        [4096, 8192, 65536, 100_000, 1 << 20, 3 << 20].iter().map(|&n| vec![1u8; n]).collect();
    let mut rng = Rng(0x00de_c0de);
    let mut cycles = 0u64;
    let range = |rng: &mut Rng, base: *mut u8, len: usize| {
        let off = rng.below(len as u64) as usize;
        let n = 1 + rng.below((len - off) as u64) as usize;
        // SAFETY: off < len, so the pointer stays inside the buffer.
        (unsafe { base.add(off) }, n)
    };
    while !stop.load(Ordering::Acquire) {
        count.store(cycles, Ordering::Release);
        let c = cycles as usize % comms.len();
        let comm = comms[c];
        match rng.below(4) {
            0 => {
                // A buffer of its own.
                let b = &mut scratch[rng.below(6) as usize];
                let (p, n) = range(&mut rng, b.as_mut_ptr(), b.len());
                let mh = drv.reg_mr(comm, p, n)?;
                drv.dereg_mr(comm, mh)?;
                cycles += 1;
            }
            1 => {
                // Part of the buffer this comm's data path is using right now.
                let (p, n) = range(&mut rng, data[c].0 as *mut u8, data[c].1);
                let mh = drv.reg_mr(comm, p, n)?;
                drv.dereg_mr(comm, mh)?;
                cycles += 1;
            }
            2 => {
                // Several at once, released in another order.
                let mut held = Vec::new();
                for _ in 0..3 {
                    let b = &mut scratch[rng.below(6) as usize];
                    let (p, n) = range(&mut rng, b.as_mut_ptr(), b.len());
                    held.push(drv.reg_mr(comm, p, n)?);
                }
                for i in [1, 0, 2] {
                    drv.dereg_mr(comm, held[i])?;
                }
                cycles += 3;
            }
            _ => {
                // One range on two comms of this process (same device: one shared region).
                let other =
                    comms[(c + 1 + rng.below(comms.len() as u64 - 1) as usize) % comms.len()];
                let b = &mut scratch[rng.below(6) as usize];
                let (p, n) = range(&mut rng, b.as_mut_ptr(), b.len());
                let a = drv.reg_mr(comm, p, n)?;
                let o = drv.reg_mr(other, p, n)?;
                drv.dereg_mr(comm, a)?;
                drv.dereg_mr(other, o)?;
                cycles += 2;
            }
        }
    }
    Ok(cycles)
}

/// The sender reads `HANDLE k <hex>` lines on stdin; the receiver prints them on stdout. Both
/// print `DONE ...` at the end.
fn role(sender: bool, msgs: usize) -> Result<(), String> {
    ferroce_tools::loader::ECHO.store(false, Ordering::Relaxed);
    let who = if sender { "sender" } else { "receiver" };
    let dev = if sender { 0 } else { 1 };
    let (fds0, threads0) = fds_threads();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(if sender { 1 } else { 2 })?;
    let pid = std::process::id();
    let res0 = rdma_counts(pid)?;

    // The receiver makes its 16 listeners here; the sender reads their handles.
    let mut listeners: Vec<Ptr> = Vec::new();
    let mut handles: Vec<[u8; 128]> = Vec::new();
    if sender {
        for line in std::io::stdin().lock().lines().take(NCOMMS) {
            let line = line.map_err(|e| e.to_string())?;
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["HANDLE", k, h] if k.parse() == Ok(handles.len()) => handles.push(from_hex(h)?),
                _ => return Err(format!("bad handle line {line:?}")),
            }
        }
        if handles.len() != NCOMMS {
            return Err(format!("got {} of {NCOMMS} handles", handles.len()));
        }
    } else {
        for k in 0..NCOMMS {
            let (h, listen) = drv.listen(ctx, dev)?;
            println!("HANDLE {k} {}", to_hex(&h));
            listeners.push(listen);
        }
        std::io::stdout().flush().map_err(|e| e.to_string())?;
    }

    // Setup: each data thread connects (or accepts) its 4 comms, all progressing together and
    // concurrently with the other threads, and registers their data buffers.
    let shared = Shared((&drv, ctx, &listeners, &handles));
    let t_setup = Instant::now();
    let lanes: Vec<Vec<Lane>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || -> Result<Shared<Vec<Lane>>, String> {
                    let (drv, ctx, listeners, handles) = shared.get();
                    let ks = t * COMMS..(t + 1) * COMMS;
                    let mut hs: Vec<[u8; 128]> =
                        ks.clone().map(|k| handles.get(k).copied().unwrap_or([0; 128])).collect();
                    let mut comms: Vec<Option<Ptr>> = vec![None; COMMS];
                    common::until("connect/accept of 4 comms", || {
                        for (i, k) in ks.clone().enumerate() {
                            if comms[i].is_none() {
                                comms[i] = if sender {
                                    drv.connect(ctx, dev, &mut hs[i])?
                                } else {
                                    drv.accept(listeners[k])?
                                };
                            }
                        }
                        Ok(comms.iter().all(Option::is_some).then_some(()))
                    })?;
                    let mut lanes = Vec::new();
                    for (i, k) in ks.enumerate() {
                        let comm = comms[i].expect("connected");
                        let mut buf = vec![0u8; WINDOW * (SLOT + GUARD)];
                        let mh = drv.reg_mr(comm, buf.as_mut_ptr(), buf.len())?;
                        lanes.push(Lane {
                            k,
                            comm,
                            buf,
                            mh,
                            next: 0,
                            done: 0,
                            filled: None,
                            inflight: VecDeque::new(),
                            last: Instant::now(),
                        });
                    }
                    Ok(Shared(lanes))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|h| h.join().map_err(|_| "a setup thread panicked".to_string())?.map(|l| l.0))
            .collect::<Result<Vec<_>, String>>()
    })?;
    for l in listeners.drain(..) {
        drv.close(Close::Listen, l)?;
    }
    let setup_s = t_setup.elapsed().as_secs_f64();

    // The run: 4 data threads, and the registration thread on the same comms.
    let comms: Vec<Ptr> = lanes.iter().flatten().map(|l| l.comm).collect();
    let data: Vec<(usize, usize)> =
        lanes.iter().flatten().map(|l| (l.buf.as_ptr() as usize, l.buf.len())).collect();
    let stop = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let registered = AtomicU64::new(0);
    let t_run = Instant::now();
    let (mut lanes, reg) = std::thread::scope(|s| {
        let reg = {
            let shared = Shared((&drv, &comms));
            let (data, stop, registered) = (&data, &stop, &registered);
            s.spawn(move || {
                let (drv, comms) = shared.get();
                let r = registrar(drv, comms, data, stop, registered);
                // A failed registration ends the data path too, rather than leaving it alone.
                stop.store(true, Ordering::Release);
                r
            })
        };
        let threads: Vec<_> = lanes
            .into_iter()
            .map(|lanes| {
                let shared = Shared((&drv, lanes));
                let (bytes, registered) = (&bytes, &registered);
                s.spawn(move || {
                    let (drv, mut lanes) = shared.get();
                    let r = drive(drv, sender, &mut lanes, msgs, bytes, registered);
                    Shared((lanes, r))
                })
            })
            .collect();
        let mut out = Vec::new();
        let mut first_err = None;
        for h in threads {
            match h.join() {
                Ok(Shared((lanes, r))) => {
                    out.push(lanes);
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                }
                Err(_) => {
                    first_err.get_or_insert("a data thread panicked".into());
                }
            }
        }
        stop.store(true, Ordering::Release);
        let reg = reg.join().map_err(|_| "the registration thread panicked".to_string());
        match first_err {
            Some(e) => Err(e),
            None => Ok((out, reg??)),
        }
    })?;
    let run_s = t_run.elapsed().as_secs_f64();

    // The receiver closes once every send completed (the orchestrator passes the sender's
    // word on, or hangs up), as NCCL's ranks destroy their comms after the collective: a
    // queue pair destroyed while the sender waits for a lost ACK's retransmission would fail
    // its last sends. Meanwhile each comm has a receive posted that no send matches (the next
    // operation's, as NCCL's proxy would have it), and tests it: a fence the sender still
    // waits for is answered during those calls.
    if sender {
        println!("SENT");
    } else {
        let told = ferroce_tools::proc::lines_of(std::io::stdin());
        let mut next = Vec::new();
        for l in lanes.iter_mut().flatten() {
            let p = l.buf[slot(msgs)..].as_mut_ptr();
            match drv.irecv(l.comm, &[p], &[SLOT], &[tag_of(msgs)], &[l.mh], false)? {
                Some(r) => next.push(r),
                None => return Err(format!("comm {}: no receive posted after the run", l.k)),
            }
        }
        while matches!(told.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)) {
            for &r in &next {
                if drv.test(r)?.is_some() {
                    return Err("a receive that no send matches completed".into());
                }
            }
        }
    }

    // Close everything; the process must be back where it started.
    for l in lanes.iter().flatten() {
        drv.dereg_mr(l.comm, l.mh)?;
        drv.close(if sender { Close::Send } else { Close::Recv }, l.comm)?;
    }
    drop(lanes);
    // What the comms held is gone (the devices' own PDs stay until finalize)...
    let res1 = settle(&Ok(res0), Duration::from_secs(5), || rdma_counts(pid))?;
    drv.finalize(ctx)?;
    drop(lib);
    // ...and after finalize nothing at all is left.
    let res2 = settle(&Ok(RdmaCounts::default()), Duration::from_secs(5), || rdma_counts(pid))?;
    let (fds1, threads1) = settle(&(fds0, threads0), Duration::from_secs(5), fds_threads);
    let mib = bytes.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
    println!(
        "DONE {who}: {NCOMMS} comms x {QPS} QPs set up in {setup_s:.1} s; {} messages, {mib:.1} \
         MiB {} in {run_s:.1} s; {reg} regMr/deregMr pairs meanwhile ({:.0}/s); own device \
         resources after init {res0}, after close {res1}, after finalize {res2}; fds \
         {fds0}->{fds1}, threads {threads0}->{threads1}",
        NCOMMS * msgs,
        if sender { "sent" } else { "received and verified" },
        reg as f64 / run_s
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    if res1 != res0 || res2 != RdmaCounts::default() {
        return Err(format!(
            "{who}: device resources after init {res0}, after close {res1}, after finalize {res2}"
        ));
    }
    if (fds0, threads0) != (fds1, threads1) {
        return Err(format!("{who}: fds {fds0}->{fds1}, threads {threads0}->{threads1}"));
    }
    if reg < MIN_REG_CYCLES {
        return Err(format!(
            "{who}: only {reg} registration cycles during the run (want >= {MIN_REG_CYCLES})"
        ));
    }
    Ok(())
}

// --- the orchestrator -------------------------------------------------------------------------

/// This program as `recv` or `send`.
fn start(mode: &str, split: &str, msgs: usize, stdin: Stdio) -> Result<Proc, String> {
    let mut c = Proc::me(&[mode, "--msgs", &msgs.to_string()]);
    c.env("NCCL_IB_QPS_PER_CONNECTION", QPS).env("NCCL_IB_SPLIT_DATA_ON_QPS", split).stdin(stdin);
    Proc::spawn(mode, c)
}

/// Its `DONE` line and exit status 0, by `until`.
fn finish(mut p: Proc, until: Instant) -> Result<String, String> {
    let done = p.next(until.saturating_duration_since(Instant::now()));
    p.exits_ok(until.saturating_duration_since(Instant::now()))?;
    done
}

fn run_pair(split: &str, msgs: usize) -> Result<(), String> {
    let until = Instant::now() + RUN_LIMIT;
    let mut recv = start("recv", split, msgs, Stdio::piped())?;
    let mut handles = Vec::new();
    for _ in 0..NCOMMS {
        handles.push(recv.next(until.saturating_duration_since(Instant::now()))?);
    }
    let mut send = start("send", split, msgs, Stdio::piped())?;
    for h in &handles {
        send.tell(h)?;
    }
    send.hang_up();
    let sent = send.expect("SENT", until.saturating_duration_since(Instant::now()));
    let _ = recv.tell("SENT");
    recv.hang_up();
    let r1 = sent.and_then(|_| finish(send, until));
    let r2 = finish(recv, until);
    let (s, r) = (r1?, r2?);
    eprintln!("concurrency: {s}");
    eprintln!("concurrency: {r}");
    Ok(())
}

fn orchestrate(msgs: usize) -> Result<(), String> {
    require_vm();
    let t0 = Instant::now();
    for (split, mode) in
        [("0", "messages round-robin over QPs"), ("1", "messages split across QPs")]
    {
        eprintln!(
            "concurrency: --- {mode}: {THREADS} threads x {COMMS} comms x {QPS} QPs per \
             process, {msgs} messages per comm, plus a registration thread"
        );
        let base = rdma_resources()?;
        let t = Instant::now();
        run_pair(split, msgs)?;
        let now = settle(&base, Duration::from_secs(10), || rdma_resources().unwrap_or_default());
        if now != base {
            return Err(format!("device resources {base} -> {now}"));
        }
        eprintln!(
            "concurrency: passed ({mode}) in {:.1} s; resources back to {base}",
            t.elapsed().as_secs_f64()
        );
    }
    println!("concurrency: passed in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
