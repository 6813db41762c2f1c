//! Liveness on Soft-RoCE: a peer that dies becomes an error within the bound, a peer that is
//! merely stopped never does. Two processes (a receiver on rxe1, a sender on rxe0) drive the
//! plugin through its C ABI; this orchestrator kills or stops them with signals and watches
//! what the survivor reports.
//!
//! The knobs make the bound short: `NCCL_IB_TIMEOUT=14`, `NCCL_IB_RETRY_CNT=3` (retries end
//! after 4.096 µs × 2^14 × 4 = 268 ms) and `FERROCE_PROBE_INTERVAL_MS=1000`.
//!
//! Scenarios:
//! - the sender is killed while the receiver has a receive pending;
//! - the sender is killed while the receiver has only optional (LL/LL128) receives outstanding,
//!   each complete once its data lands, and keeps calling `irecv` and `test` as NCCL's proxy
//!   does;
//! - the receiver is killed while the sender waits for a CTS, and while its writes are in flight;
//! - the receiver is stopped (SIGSTOP) for 60 s while the sender waits for a CTS, and the sender
//!   while the receiver waits for data: no error, and the data completes after SIGCONT.
//!
//! After each, the survivor closes its comms and finalizes: its fds and threads, and the
//! devices' QP/CQ/MR/PD counts, return to their baseline. Built with its own `main`
//! (`harness = false`) and run by `ci/vm-tests.sh` in the VM.

mod common;

use std::collections::VecDeque;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use common::{fds_threads, open_plugin, rdma_resources, require_vm, settle};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::proc::{Proc, lines_of};
use ferroce_tools::rank::one_comm;

const SIZE: usize = 1 << 20;
const BIG: usize = 8 << 20;
/// Probe interval + retry bound (1.27 s), with room for TCG's slowness.
const BOUND: Duration = Duration::from_secs(8);
const STOP: Duration = Duration::from_secs(60);
const KNOBS: [(&str, &str); 3] =
    [("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "3"), ("FERROCE_PROBE_INTERVAL_MS", "1000")];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        None => orchestrate(),
        Some("recv") => role(false, args.get(1)),
        Some("send") => role(true, args.get(1)),
        Some(other) => Err(format!("unknown mode {other:?}")),
    };
    if let Err(e) = r {
        eprintln!("liveness: FAILED: {e}");
        std::process::exit(1);
    }
}

// --- one side (a child process) ----------------------------------------------------------------

/// The byte at `i` of message `m`.
fn byte(m: usize, i: usize) -> u8 {
    (m.wrapping_mul(131) ^ i.wrapping_mul(7) ^ (i >> 9)) as u8
}

/// Commands on stdin (`POST n`, `SEND n size`, `LL`, `CLOSE`), events on stdout (`HANDLE`,
/// `POSTED`, `COMPLETED k`, `ERROR ms text`, `CLEAN ...`). After `LL` the receiver posts
/// optional receives whenever the plugin takes one, as NCCL's proxy does for LL steps.
fn role(sender: bool, handle: Option<&String>) -> Result<(), String> {
    let say = |s: String| {
        println!("{s}");
        std::io::stdout().flush().map_err(|e| e.to_string())
    };
    let lines = lines_of(std::io::stdin());
    // The baseline includes the stdin reader; everything the plugin opens must go again.
    let (fds0, threads0) = fds_threads();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(7)?;
    if sender && handle.is_none() {
        return Err("send needs the receiver's handle".into());
    }
    let (dev, peer) = if sender { (0, handle.map(String::as_str)) } else { (1, None) };
    let comm = one_comm(&drv, ctx, dev, peer, Duration::from_secs(30))?;
    let mut buf = vec![0u8; 4 * BIG];
    let mh = drv.reg_mr(comm, buf.as_mut_ptr(), buf.len())?;
    say("READY".into())?;
    // (message number, size, request) in flight; sends not yet taken by the plugin.
    let mut pending: VecDeque<(usize, usize, Ptr)> = VecDeque::new();
    let mut to_send: VecDeque<(usize, usize)> = VecDeque::new();
    let (mut next, mut done) = (0usize, 0usize);
    let mut ll = false;
    let mut since = Instant::now();
    let slot = |m: usize| (m % 4) * BIG;
    loop {
        match lines.try_recv() {
            Ok(l) => {
                since = Instant::now();
                let w: Vec<&str> = l.split_whitespace().collect();
                match w.as_slice() {
                    ["POST", n] => {
                        for _ in 0..n.parse::<usize>().map_err(|e| e.to_string())? {
                            let p = buf[slot(next)..].as_mut_ptr();
                            let r = common::until("irecv", || {
                                drv.irecv(comm, &[p], &[BIG], &[0], &[mh], false)
                            })?;
                            pending.push_back((next, BIG, r));
                            next += 1;
                        }
                        say("POSTED".into())?;
                    }
                    ["SEND", n, size] => {
                        let size: usize = size.parse().map_err(|_| "bad size")?;
                        for _ in 0..n.parse::<usize>().map_err(|_| "bad count")? {
                            let m = next;
                            buf[slot(m)..slot(m) + size]
                                .iter_mut()
                                .enumerate()
                                .for_each(|(i, b)| *b = byte(m, i));
                            to_send.push_back((m, size));
                            next += 1;
                        }
                    }
                    ["LL"] => ll = true,
                    ["CLOSE"] => break,
                    _ => return Err(format!("bad command {l:?}")),
                }
            }
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => return Err("the orchestrator went away".into()),
        }
        let step = (|| -> Result<(), String> {
            if ll {
                let p = buf[slot(next)..].as_mut_ptr();
                if let Some(r) = drv.irecv(comm, &[p], &[SIZE], &[0], &[mh], true)? {
                    pending.push_back((next, SIZE, r));
                    next += 1;
                }
            }
            if let Some(&(m, size)) = to_send.front() {
                let p = buf[slot(m)..].as_mut_ptr();
                if let Some(r) = drv.isend(comm, p, size, 0, mh)? {
                    to_send.pop_front();
                    pending.push_back((m, size, r));
                    say("POSTED".into())?;
                }
            }
            if let Some(&(m, _, r)) = pending.front()
                && let Some(sizes) = drv.test(r)?
            {
                pending.pop_front();
                // An optional receive's bytes are NCCL's to watch (its flags); normal ones are
                // checked here.
                if !sender && !ll {
                    let got = sizes[0] as usize;
                    let bad = (0..got).position(|i| buf[slot(m) + i] != byte(m, i));
                    if got != SIZE && got != BIG || bad.is_some() {
                        return Err(format!("message {m}: {got} bytes, first bad byte {bad:?}"));
                    }
                }
                done += 1;
                say(format!("COMPLETED {done}"))?;
            }
            Ok(())
        })();
        if let Err(e) = step {
            // The plugin's WARN says who and what; the call itself only returns a code.
            let warn = common::warnings().pop().unwrap_or_default();
            say(format!("ERROR {} {e}: {warn}", since.elapsed().as_millis()))?;
            // Wait for the orchestrator's CLOSE; every later call fails the same way.
            loop {
                match lines.recv_timeout(Duration::from_secs(120)) {
                    Ok(l) if l == "CLOSE" => break,
                    Ok(_) => {}
                    Err(_) => return Err("no CLOSE after the error".into()),
                }
            }
            break;
        }
        std::thread::yield_now();
    }
    // Close with whatever is pending: the comm must still come apart cleanly.
    drv.dereg_mr(comm, mh)?;
    drv.close(if sender { Close::Send } else { Close::Recv }, comm)?;
    drv.finalize(ctx)?;
    drop(lib);
    // A joined thread leaves /proc/self/task a moment after pthread_join returns, and that
    // moment grows on a busy machine: the counts must come back within a deadline.
    let (fds1, threads1) = settle(&(fds0, threads0), Duration::from_secs(10), fds_threads);
    say(format!("CLEAN fds {fds0}->{fds1} threads {threads0}->{threads1}"))?;
    if (fds0, threads0) != (fds1, threads1) {
        return Err(format!("fds {fds0}->{fds1}, threads {threads0}->{threads1}"));
    }
    Ok(())
}

// --- the orchestrator -------------------------------------------------------------------------

/// This program as `recv` or `send`, with the liveness knobs.
fn start(mode: &str, handle: Option<&str>) -> Result<Proc, String> {
    let mut c = Proc::me(&[mode]);
    c.args(handle).envs(KNOBS).stdin(Stdio::piped());
    Proc::spawn(mode, c)
}

/// What the orchestrator does with a side beyond [`Proc`]'s lines.
trait Side {
    fn quiet_for(&self, d: Duration) -> Result<(), String>;
    fn signal(&self, sig: &str) -> Result<(), String>;
    fn close(self) -> Result<(), String>;
}

impl Side for Proc {
    /// Nothing reported for `d` (a stopped peer must cause no error).
    fn quiet_for(&self, d: Duration) -> Result<(), String> {
        match self.lines.recv_timeout(d) {
            Ok(l) => Err(format!("{}: reported {l:?} while its peer was stopped", self.name)),
            Err(_) => Ok(()),
        }
    }

    fn signal(&self, sig: &str) -> Result<(), String> {
        let st = Command::new("kill")
            .args([sig, &self.pid().unwrap_or_default().to_string()])
            .status()
            .map_err(|e| e.to_string())?;
        if st.success() { Ok(()) } else { Err(format!("kill {sig} {}", self.name)) }
    }

    /// CLOSE, then the clean-up report and exit 0.
    fn close(mut self) -> Result<(), String> {
        self.tell("CLOSE")?;
        let clean = self.expect("CLEAN", Duration::from_secs(60))?;
        eprintln!("liveness: {} {clean}", self.name);
        self.exits_ok(Duration::from_secs(60))
    }
}

/// A connected receiver and sender, both ready.
fn pair() -> Result<(Proc, Proc), String> {
    let recv = start("recv", None)?;
    let handle = recv.handle(Duration::from_secs(60))?;
    let send = start("send", Some(&handle))?;
    recv.expect("READY", Duration::from_secs(60))?;
    send.expect("READY", Duration::from_secs(60))?;
    Ok((recv, send))
}

/// Waits for the survivor's ERROR (past the posts and completions of what went before the
/// death) and checks it came within the bound and names the peer.
fn expect_error(side: &Proc, after: Instant, what: &str) -> Result<(), String> {
    let l = loop {
        let l = side
            .lines
            .recv_timeout(BOUND + Duration::from_secs(20))
            .map_err(|_| format!("{what}: {} reported no error after its peer died", side.name))?;
        if !l.starts_with("COMPLETED") && !l.starts_with("POSTED") {
            break l;
        }
    };
    if !l.starts_with("ERROR") {
        return Err(format!("{what}: {} reported {l:?}, expected an error", side.name));
    }
    let took = after.elapsed();
    eprintln!("liveness: {what}: {} failed after {:.2} s: {l}", side.name, took.as_secs_f64());
    if took > BOUND {
        return Err(format!("{what}: the error took {took:?}, bound {BOUND:?}"));
    }
    if !l.contains("198.18.0.") {
        return Err(format!("{what}: the error does not name the peer: {l}"));
    }
    // The peer's death is the peer's fault: ncclRemoteError (6), not a local error.
    if !l.contains("ncclResult 6") {
        return Err(format!("{what}: expected ncclRemoteError (6): {l}"));
    }
    Ok(())
}

fn orchestrate() -> Result<(), String> {
    require_vm();
    let base = rdma_resources()?;
    type Scenario = fn() -> Result<(), String>;
    let scenarios: [(&str, Scenario); 6] = [
        ("sender killed while a receive is pending", sender_killed),
        ("sender killed while only optional receives are outstanding", sender_killed_ll),
        ("receiver killed while the sender waits for a CTS", receiver_killed_before_cts),
        ("receiver killed while writes are in flight", receiver_killed_in_flight),
        ("receiver stopped 60 s while the sender waits", receiver_stopped),
        ("sender stopped 60 s while the receiver waits", sender_stopped),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (what, run) in scenarios {
        eprintln!("liveness: --- {what}");
        let r = run().and_then(|_| {
            let now = rdma_resources()?;
            if now == base { Ok(()) } else { Err(format!("resources {base} -> {now}")) }
        });
        match r {
            Ok(()) => {
                passed += 1;
                eprintln!("liveness: passed: {what}");
            }
            Err(e) => {
                failed += 1;
                eprintln!("liveness: FAILED: {what}: {e}");
            }
        }
    }
    println!("liveness: {passed} passed, {failed} failed");
    if failed > 0 { Err(format!("{failed} scenario(s) failed")) } else { Ok(()) }
}

fn sender_killed() -> Result<(), String> {
    let (mut recv, mut send) = pair()?;
    recv.tell("POST 2")?;
    recv.expect("POSTED", BOUND)?;
    send.tell(&format!("SEND 1 {SIZE}"))?;
    send.expect("POSTED", BOUND)?;
    recv.expect("COMPLETED 1", Duration::from_secs(60))?;
    send.signal("-KILL")?;
    let t = Instant::now();
    expect_error(&recv, t, "sender killed")?;
    drop(send);
    recv.close()
}

/// The receiver has only optional receives outstanding (each completes once its data lands,
/// and none comes) and keeps calling irecv and test; the sender dies: the next of those calls
/// fails within the bound.
fn sender_killed_ll() -> Result<(), String> {
    let (mut recv, send) = pair()?;
    recv.tell("LL")?;
    std::thread::sleep(Duration::from_millis(500)); // the receives are posted and tested
    send.signal("-KILL")?;
    let t = Instant::now();
    expect_error(&recv, t, "sender of optional receives killed")?;
    drop(send);
    recv.close()
}

fn receiver_killed_before_cts() -> Result<(), String> {
    let (recv, mut send) = pair()?;
    send.tell(&format!("SEND 1 {SIZE}"))?;
    std::thread::sleep(Duration::from_millis(500)); // the send is waiting for a CTS
    recv.signal("-KILL")?;
    let t = Instant::now();
    expect_error(&send, t, "receiver killed before its CTS")?;
    drop(recv);
    send.close()
}

fn receiver_killed_in_flight() -> Result<(), String> {
    let (mut recv, mut send) = pair()?;
    recv.tell("POST 3")?;
    recv.expect("POSTED", BOUND)?;
    send.tell(&format!("SEND 3 {BIG}"))?;
    send.expect("POSTED", Duration::from_secs(60))?;
    recv.signal("-KILL")?;
    let t = Instant::now();
    // The first 8 MiB may still land; the rest cannot.
    expect_error(&send, t, "writes in flight")?;
    drop(recv);
    send.close()
}

fn receiver_stopped() -> Result<(), String> {
    let (mut recv, mut send) = pair()?;
    recv.tell("POST 1")?;
    recv.expect("POSTED", BOUND)?;
    send.tell(&format!("SEND 2 {SIZE}"))?;
    recv.expect("COMPLETED 1", Duration::from_secs(60))?;
    recv.signal("-STOP")?;
    // The second send waits for a CTS and probes the stopped receiver's NIC all along.
    send.expect("POSTED", BOUND)?;
    send.expect("COMPLETED 1", BOUND)?;
    send.quiet_for(STOP)?;
    recv.signal("-CONT")?;
    recv.tell("POST 1")?;
    recv.expect("POSTED", BOUND)?;
    send.expect("POSTED", Duration::from_secs(30))?;
    recv.expect("COMPLETED 2", Duration::from_secs(30))?;
    send.expect("COMPLETED 2", Duration::from_secs(30))?;
    send.close()?;
    recv.close()
}

fn sender_stopped() -> Result<(), String> {
    let (mut recv, mut send) = pair()?;
    recv.tell("POST 1")?;
    recv.expect("POSTED", BOUND)?;
    send.signal("-STOP")?;
    // The receive waits for data and probes the stopped sender's NIC all along.
    recv.quiet_for(STOP)?;
    send.signal("-CONT")?;
    send.tell(&format!("SEND 1 {SIZE}"))?;
    send.expect("POSTED", Duration::from_secs(30))?;
    recv.expect("COMPLETED 1", Duration::from_secs(30))?;
    send.expect("COMPLETED 1", Duration::from_secs(30))?;
    send.close()?;
    recv.close()
}
