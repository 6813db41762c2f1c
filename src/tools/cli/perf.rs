//! `ferroce perf`: the plugin measured the way NCCL drives it, next to perftest on the same
//! devices in the same boot.
//!
//! Two ranks are two processes, as in NCCL: this orchestrator runs `ferroce perf-rank send|recv`
//! twice and talks to each over its stdin/stdout, one line per message. Each rank loads the
//! plugin with `dlopen`, drives its v12 ABI through [`Driver`], listens on its device and
//! connects to the other's handle (which the orchestrator relays), so each rank has a send comm
//! and a receive comm. Buffers are registered once; then the ranks run the commands they get:
//!
//! - `BW`: rank 0 sends, rank 1 receives, `--seconds` per size. The receiver keeps up to
//!   [`WINDOW`] receives posted ahead and the sender up to [`WINDOW`] sends in flight (at most
//!   [`WINDOW_BYTES`], never fewer than 2), so a CTS is never what a send waits for. The
//!   receiver's clock decides: after a warm-up it times whole messages from one completion to
//!   the first completion `--seconds` later, then stops posting and names the number of receives
//!   it posted (`POSTED n`); the orchestrator relays that to the sender (`STOP n`), which sends
//!   exactly that many. Nothing stays posted, and the drain is not timed. An optional fifth
//!   word to the receiver, `BW size window seconds warm-up MESSAGES`, ends the timing after that
//!   many messages if the time has not ended it first (`ferroce doctor --peer --selftest`).
//! - `LAT`: ping-pong; each side keeps [`LAT_DEPTH`] receives posted and re-posts while its own
//!   message is in flight. Rank 0 stamps each ping; a sample is half the time between two pings
//!   (perftest's method), so everything the application does in a round trip counts.
//!
//! Before `PEER`, a rank also answers `PORT` with its port's facts (`doctor::port_facts`,
//! handed in by `main`), so `ferroce doctor --peer` can compare the two ends through the same
//! connection; [`Pair`] is the orchestrator's side that both use.
//!
//! Every round runs the whole ferroce set and then perftest (`ib_write_bw -D`, `ib_write_lat`,
//! `ib_send_lat`), so drift in the VM hits both alike. The table shows the median of the rounds,
//! the spread (min-max) and ferroce / perftest; `--json` gives every round's raw numbers.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};
use ferroce_tools::loader::{ECHO, Library, flush_log};
use ferroce_tools::out::{self, Table, fixed};
use ferroce_tools::proc::{Proc, lines_of};
use ferroce_tools::wait::{Stall, until};
use serde_json::json;

const BW_SIZES: [usize; 6] = [8, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20];
const LAT_SIZES: [usize; 2] = [8, 4 << 10];
/// Latency iterations by default (`--iters`); the warm-up is a tenth as many.
const LAT_ITERS: usize = 1000;
/// Receives posted ahead in ping-pong: one is consumed per round trip and re-posted while the
/// next message flies, so at least two are always posted when the peer sends.
const LAT_DEPTH: usize = 3;
/// Requests in flight per direction: NCCL's `NCCL_NET_MAX_REQUESTS`.
const WINDOW: usize = 32;
/// Bytes in flight at most: with 32 x 8 MiB the untimed drain at Soft-RoCE speed would take
/// longer than the measurement; 32 MiB is far above any link's bandwidth-delay product.
const WINDOW_BYTES: usize = 32 << 20;
const MAX: usize = 8 << 20;
/// How long one plugin step may make no progress before the rank gives up.
const STEP: Duration = Duration::from_secs(120);
/// How long a rank waits for its next command (perftest runs in between).
const IDLE: Duration = Duration::from_secs(1800);
/// Any shared value: NCCL passes the same communicator id to every rank's `init`.
const COMM_ID: u64 = 0xfe77_0ce0;

fn window(size: usize) -> usize {
    (WINDOW_BYTES / size).clamp(2, WINDOW)
}

fn warmup(seconds: f64) -> f64 {
    (seconds * 0.1).min(1.0)
}

fn num<T: std::str::FromStr>(what: &str, s: Option<&str>) -> Result<T, String> {
    let s = s.ok_or_else(|| format!("{what}: missing"))?;
    s.parse().map_err(|_| format!("{what}: not a number: {s:?}"))
}

/// Where a rank reads its commands and writes its replies: the orchestrator's pipes
/// (single-host mode) or the connector's TCP stream (`--listen`).
struct Io {
    cmds: Receiver<String>,
    out: RefCell<Box<dyn Write>>,
    /// Errors also go to the peer: nobody sees this process's stderr from there.
    remote: bool,
}

impl Io {
    fn say(&self, line: &str) -> Result<(), String> {
        let mut o = self.out.borrow_mut();
        writeln!(o, "{line}").and_then(|_| o.flush()).map_err(|e| format!("writing {line:?}: {e}"))
    }

    fn next(&self, limit: Duration) -> Result<String, String> {
        match self.cmds.recv_timeout(limit) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => Err(format!("no command within {limit:?}")),
            Err(RecvTimeoutError::Disconnected) => Err("the orchestrator went away".to_string()),
        }
    }
}

/// The byte at offset `i` of every message: a receive is checked against it.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

// ---------------------------------------------------------------------------------------------
// One rank (a child process).

/// One rank's comms and registered buffers.
struct Rank<'a> {
    io: Io,
    drv: Driver<'a>,
    send: Ptr,
    recv: Ptr,
    sbuf: *mut u8,
    rbuf: *mut u8,
    smh: Ptr,
    rmh: Ptr,
}

/// How a rank describes its port when asked (`PORT`): `doctor::port_facts`, which `main` hands
/// in, so that perf does not depend on doctor (doctor builds on perf).
pub type Facts = fn(&str) -> Result<String, String>;

/// `ferroce perf-rank send|recv PLUGIN DEV`: one rank, driven by the orchestrator over its
/// stdin and stdout.
#[derive(clap::Args)]
pub struct RankArgs {
    role: Role,
    plugin: String,
    dev: String,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Role {
    Send,
    Recv,
}

pub fn rank(a: &RankArgs, facts: Facts) -> Result<(), String> {
    run_rank(matches!(a.role, Role::Send), &a.plugin, &a.dev, facts, |_, _| {
        let out: Box<dyn Write> = Box::new(std::io::stdout());
        Ok(Io { cmds: lines_of(std::io::stdin()), out: RefCell::new(out), remote: false })
    })
}

/// One rank: loads the plugin, listens on `dev`, then gets its [`Io`] from `io` (given the
/// device's name and the address the plugin listens on) and serves the orchestrator's commands.
fn run_rank(
    sender: bool,
    plugin: &str,
    dev: &str,
    facts: Facts,
    io: impl FnOnce(&str, std::net::SocketAddr) -> Result<Io, String>,
) -> Result<(), String> {
    let role = if sender { "send" } else { "recv" };
    ECHO.store(false, Ordering::Relaxed);
    let mut chan = None;
    let r = (|| {
        let lib = Library::open_like_nccl(plugin)?;
        let drv = Driver::new(&lib, 12)?;
        let ctx = drv.init(COMM_ID)?;
        let (dev, name) = drv.resolve(dev)?;
        let (handle, listen) = drv.listen(ctx, dev)?;
        let addr = ferroce::transport::handshake::Handle::decode(&handle)
            .map_err(|e| format!("the plugin's own handle: {e}"))?
            .addr;
        let io = &*chan.insert(io(&name, addr)?);
        io.say(&format!("HANDLE {} {name} {dev}", to_hex(&handle)))?;
        // `PORT` (from `ferroce doctor --peer`) may come first: this port's facts, asked before
        // the connection so they arrive even where connecting fails.
        let line = loop {
            match io.next(STEP)? {
                l if l == "PORT" => io.say(&format!("PORT {}", facts(&name)?))?,
                l => break l,
            }
        };
        let peer = line.strip_prefix("PEER ").ok_or(format!("expected PEER: {line}"))?;
        let mut peer = from_hex(peer)?;
        let (send, recv) = drv.connect_both(ctx, dev, &mut peer, listen, STEP)?;
        drv.close(Close::Listen, listen)?;
        // Two separate buffers: a rank sends and receives at once in ping-pong.
        let mut sb: Vec<u8> = (0..MAX).map(pattern).collect();
        let mut rb = vec![0u8; MAX];
        let (sbuf, rbuf) = (sb.as_mut_ptr(), rb.as_mut_ptr());
        let smh = drv.reg_mr(send, sbuf, MAX)?;
        let rmh = drv.reg_mr(recv, rbuf, MAX)?;
        let io = chan.take().ok_or("no channel")?;
        let r = Rank { io, drv, send, recv, sbuf, rbuf, smh, rmh };
        r.io.say("READY")?;
        flush_log();
        let mut result = r.serve(sender);
        // Teardown runs to the end whatever failed; the first error is the one returned.
        for e in [
            r.drv.dereg_mr(send, smh),
            r.drv.dereg_mr(recv, rmh),
            r.drv.close(Close::Send, send),
            r.drv.close(Close::Recv, recv),
            r.drv.finalize(ctx),
        ] {
            match (e, &result) {
                (Err(e), Ok(())) => result = Err(format!("teardown: {e}")),
                (Err(e), Err(_)) => eprintln!("perf-rank {role}: teardown: {e}"),
                _ => {}
            }
        }
        drop((sb, rb));
        chan = Some(r.io);
        result
    })();
    flush_log();
    let r = r.map_err(|e| format!("perf-rank {role} (dev {dev}): {e}"));
    if let (Err(e), Some(io)) = (&r, &chan)
        && io.remote
    {
        let _ = io.say(&format!("ERROR {e}"));
    }
    r
}

impl Rank<'_> {
    fn serve(&self, sender: bool) -> Result<(), String> {
        loop {
            let line = self.io.next(IDLE)?;
            let mut w = line.split_whitespace();
            let reply = match w.next() {
                Some("BW") if sender => {
                    self.bw_send(num("BW size", w.next())?, num("BW window", w.next())?)?
                }
                Some("BW") => self.bw_recv(
                    num("BW size", w.next())?,
                    num("BW window", w.next())?,
                    num("BW seconds", w.next())?,
                    num("BW warm-up", w.next())?,
                    w.next().map(|m| num("BW messages", Some(m))).transpose()?,
                )?,
                Some("LAT") => self.lat(
                    num("LAT size", w.next())?,
                    num("LAT iterations", w.next())?,
                    num("LAT warm-up", w.next())?,
                    sender,
                )?,
                Some("QUIT") => {
                    self.io.say("BYE")?;
                    return Ok(());
                }
                _ => return Err(format!("unknown command {line:?}")),
            };
            self.io.say(&reply)?;
            flush_log();
        }
    }

    fn irecv(&self, size: usize) -> Result<Option<Ptr>, String> {
        self.drv.irecv(self.recv, &[self.rbuf], &[size], &[0], &[self.rmh], false)
    }

    fn isend(&self, size: usize) -> Result<Option<Ptr>, String> {
        self.drv.isend(self.send, self.sbuf, size, 0, self.smh)
    }

    /// Zeroes the receive buffer's first `size` bytes; only while no receive is posted.
    fn clear(&self, size: usize) {
        // SAFETY: rbuf is MAX bytes long and lives as long as self; the callers hold no receive
        // posted, so the NIC does not write it meanwhile.
        unsafe { std::ptr::write_bytes(self.rbuf, 0, size.min(MAX)) }
    }

    /// The last message received must be the sender's pattern, byte for byte (the buffer was
    /// zeroed before the first receive was posted, so a message that never landed fails too).
    /// Only while no receive is posted.
    fn verify(&self, size: usize) -> Result<(), String> {
        // SAFETY: as in `clear`: in bounds, and nothing writes the buffer meanwhile.
        let got = unsafe { std::slice::from_raw_parts(self.rbuf, size.min(MAX)) };
        match got.iter().enumerate().position(|(i, &b)| b != pattern(i)) {
            None => Ok(()),
            Some(i) => Err(format!("a {size}-byte message arrived corrupted at byte {i}")),
        }
    }

    /// A completed receive must carry the whole message.
    fn check(size: usize, got: [c_int; 8]) -> Result<(), String> {
        if got[0] as usize == size {
            Ok(())
        } else {
            Err(format!("a {size}-byte receive completed with {} bytes", got[0]))
        }
    }

    /// Keeps `window` receives posted; times completions on this side (see the module docs),
    /// for `secs` or, when given, `msgs` messages, whichever ends first. Replies `BW bytes
    /// seconds` for the timed part.
    fn bw_recv(
        &self,
        size: usize,
        window: usize,
        secs: f64,
        warm: f64,
        msgs: Option<u64>,
    ) -> Result<String, String> {
        let dur = |s: f64| Duration::try_from_secs_f64(s).map_err(|e| format!("BW {s} s: {e}"));
        let (secs, warm) = (dur(secs)?, dur(warm)?);
        self.clear(size);
        let mut q = VecDeque::with_capacity(window);
        let (mut posted, mut done) = (0u64, 0u64);
        let (mut first, mut start, mut end) = (None, None::<(Instant, u64)>, None);
        let mut stall = Stall::default();
        loop {
            let mut moved = false;
            if end.is_none()
                && q.len() < window
                && let Some(r) = self.irecv(size)?
            {
                q.push_back(r);
                posted += 1;
                moved = true;
            }
            if let Some(&r) = q.front()
                && let Some(got) = self.drv.test(r)?
            {
                Self::check(size, got)?;
                q.pop_front();
                done += 1;
                moved = true;
                let now = Instant::now();
                let t = *first.get_or_insert(now);
                match start {
                    None if now - t >= warm => start = Some((now, done)),
                    Some((t0, d0))
                        if end.is_none()
                            && (now - t0 >= secs || msgs.is_some_and(|m| done - d0 >= m)) =>
                    {
                        end = Some((now, done));
                        // The sender stops at exactly this many; it is told out of band.
                        self.io.say(&format!("POSTED {posted}"))?;
                    }
                    _ => {}
                }
            }
            if end.is_some() && q.is_empty() {
                break;
            }
            if moved {
                stall.moved();
            } else if stall.idle(STEP) {
                return Err(format!(
                    "bandwidth at {size} B: no receive completed for {STEP:?} ({done} of {posted})"
                ));
            }
        }
        self.verify(size)?;
        let ((t0, d0), (t1, d1)) = start.zip(end).ok_or("bandwidth: not timed")?;
        Ok(format!("BW {} {:.9}", (d1 - d0) * size as u64, (t1 - t0).as_secs_f64()))
    }

    /// Keeps `window` sends in flight until told how many the receiver posted.
    fn bw_send(&self, size: usize, window: usize) -> Result<String, String> {
        let mut q = VecDeque::with_capacity(window);
        let (mut sent, mut stop) = (0u64, None);
        let mut stall = Stall::default();
        loop {
            let mut moved = false;
            if let Some(&r) = q.front()
                && self.drv.test(r)?.is_some()
            {
                q.pop_front();
                moved = true;
            }
            if q.len() < window
                && stop.is_none_or(|n| sent < n)
                && let Some(r) = self.isend(size)?
            {
                q.push_back(r);
                sent += 1;
                moved = true;
            }
            if stop.is_none() {
                match self.io.cmds.try_recv() {
                    Ok(line) => {
                        let n = num("STOP", line.strip_prefix("STOP "))?;
                        if sent > n {
                            return Err(format!(
                                "the plugin took {sent} sends for {n} posted receives"
                            ));
                        }
                        stop = Some(n);
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => {
                        return Err("the orchestrator went away".into());
                    }
                }
            }
            if stop == Some(sent) && q.is_empty() {
                return Ok(format!("SENT {sent}"));
            }
            if moved {
                stall.moved();
            } else if stall.idle(STEP) {
                return Err(format!(
                    "bandwidth at {size} B: no send progressed for {STEP:?} ({sent} sent)"
                ));
            }
        }
    }

    /// Polls the two requests of one ping-pong step until both are done.
    fn wait_both(&self, send: Ptr, recv: Ptr, size: usize) -> Result<(), String> {
        let (mut s, mut r) = (Some(send), Some(recv));
        until("ping-pong", STEP, || {
            if let Some(q) = s {
                s = self.drv.test(q)?.is_none().then_some(q);
            }
            if let Some(q) = r
                && let Some(got) = self.drv.test(q)?
            {
                Self::check(size, got)?;
                r = None;
            }
            Ok((s.is_none() && r.is_none()).then_some(()))
        })
    }

    /// Ping-pong; the leader replies `LAT median_us min_us`, the other side `LAT`.
    fn lat(&self, size: usize, iters: usize, warm: usize, leader: bool) -> Result<String, String> {
        // One message more than samples: a sample is the time between two pings.
        let total = warm + iters + 1;
        self.clear(size);
        let mut q = VecDeque::with_capacity(LAT_DEPTH);
        while q.len() < LAT_DEPTH.min(total) {
            q.push_back(until("irecv", STEP, || self.irecv(size))?);
        }
        let mut posted = q.len();
        let mut stamps = Vec::with_capacity(if leader { total } else { 0 });
        for _ in 0..total {
            if leader {
                stamps.push(Instant::now());
            } else {
                let r = q.pop_front().ok_or("no receive posted")?;
                let got = until("ping", STEP, || self.drv.test(r))?;
                Self::check(size, got)?;
            }
            let s = until("isend", STEP, || self.isend(size))?;
            // Re-posting while our message flies keeps irecv off the round trip.
            if posted < total {
                q.push_back(until("irecv", STEP, || self.irecv(size))?);
                posted += 1;
            }
            if leader {
                let r = q.pop_front().ok_or("no receive posted")?;
                self.wait_both(s, r, size)?;
            } else {
                until("pong send", STEP, || self.drv.test(s))?;
            }
        }
        self.verify(size)?;
        if !leader {
            return Ok("LAT".into());
        }
        let mut half: Vec<f64> =
            stamps.windows(2).skip(warm).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / 2.0).collect();
        half.sort_by(f64::total_cmp);
        Ok(format!("LAT {:.3} {:.3}", median(&half), half.first().copied().unwrap_or(f64::NAN)))
    }
}

// ---------------------------------------------------------------------------------------------
// The orchestrator.

/// A rank of this host: `ferroce perf-rank` as a child (killed when its [`Proc`] drops, so no
/// error path leaves one behind).
fn spawn_rank(role: &str, plugin: &str, dev: &str) -> Result<Proc, String> {
    let mut cmd = Proc::me(&["perf-rank", role, plugin, dev]);
    cmd.stdin(Stdio::piped());
    Proc::spawn(&format!("rank {role} ({dev})"), cmd)
}

/// The receiving rank on another host: the `ferroce perf --listen` at `addr` (`HOST:PORT`).
fn remote_rank(addr: &str) -> Result<Proc, String> {
    Proc::connect(&format!("rank recv at {addr}"), addr)
}

/// One rank as its `HANDLE` line describes it.
pub struct RankInfo {
    /// The plugin's handle, in hex, for the other rank's `PEER`.
    handle: String,
    /// The device as the plugin names it (`rxe0`, `mlx5_0:1`).
    pub name: String,
    /// Its index among the devices the plugin offers on that rank's host.
    pub index: String,
}

/// The orchestrator's side of the two ranks, past their `HANDLE` lines: what `ferroce perf`
/// and `ferroce doctor --peer` share. Dropping it kills a child rank that is still running.
pub struct Pair {
    recv: Proc,
    send: Proc,
    pub tx: RankInfo,
    pub rx: RankInfo,
}

/// How long the orchestrator waits for one reply; a rank gives up on a step after [`STEP`].
const LIMIT: Duration = Duration::from_secs(STEP.as_secs() + 60);

impl Pair {
    fn open(mut recv: Proc, mut send: Proc) -> Result<Pair, String> {
        let handle = |p: &mut Proc, other: &mut Proc| match &p.answer("HANDLE", LIMIT, other)?[..] {
            [handle, name, index] => {
                Ok(RankInfo { handle: handle.clone(), name: name.clone(), index: index.clone() })
            }
            w => Err(format!("{}: bad HANDLE line {w:?}", p.name)),
        };
        let rx = handle(&mut recv, &mut send)?;
        let tx = handle(&mut send, &mut recv)?;
        Ok(Pair { recv, send, tx, rx })
    }

    /// `ferroce doctor --peer`: a sending rank on this host's `dev`, and the `ferroce perf
    /// --listen` at `addr` as the receiving one.
    pub fn to_peer(addr: &str, plugin: &str, dev: &str) -> Result<Pair, String> {
        Pair::open(remote_rank(addr)?, spawn_rank("send", plugin, dev)?)
    }

    /// The receiving rank's port facts (`doctor::port_facts`); only before [`Pair::connect`].
    pub fn port(&mut self) -> Result<String, String> {
        self.recv.tell("PORT")?;
        Ok(self.recv.answer("PORT", LIMIT, &mut self.send)?.join(" "))
    }

    /// Connects each rank to the other through the plugin.
    pub fn connect(&mut self) -> Result<(), String> {
        self.recv.tell(&format!("PEER {}", self.tx.handle))?;
        self.send.tell(&format!("PEER {}", self.rx.handle))?;
        self.recv.answer("READY", LIMIT, &mut self.send)?;
        self.send.answer("READY", LIMIT, &mut self.recv)?;
        Ok(())
    }

    /// One bandwidth run of `size`-byte messages, `window` in flight, for `secs` after `warm`
    /// or (given) `msgs` timed messages: the bytes and seconds the receiver timed.
    pub fn bw(
        &mut self,
        size: usize,
        window: usize,
        secs: f64,
        warm: f64,
        msgs: Option<u64>,
    ) -> Result<(f64, f64), String> {
        let cap = msgs.map_or(String::new(), |m| format!(" {m}"));
        self.recv.tell(&format!("BW {size} {window} {secs} {warm}{cap}"))?;
        self.send.tell(&format!("BW {size} {window}"))?;
        let posted =
            self.recv.answer("POSTED", LIMIT + Duration::from_secs_f64(secs), &mut self.send)?;
        self.send.tell(&format!("STOP {}", posted.first().ok_or("POSTED without a count")?))?;
        self.send.answer("SENT", LIMIT, &mut self.recv)?;
        let r = self.recv.answer("BW", LIMIT, &mut self.send)?;
        let bytes = num("BW bytes", r.first().map(String::as_str))?;
        Ok((bytes, num("BW seconds", r.get(1).map(String::as_str))?))
    }

    /// One ping-pong run: the median and the minimum half round trip, in us.
    fn lat(&mut self, size: usize, iters: usize, warm: usize) -> Result<(f64, f64), String> {
        let cmd = format!("LAT {size} {iters} {warm}");
        self.recv.tell(&cmd)?;
        self.send.tell(&cmd)?;
        let r = self.send.answer("LAT", LIMIT, &mut self.recv)?;
        self.recv.answer("LAT", LIMIT, &mut self.send)?;
        let med = num("LAT median", r.first().map(String::as_str))?;
        Ok((med, num("LAT min", r.get(1).map(String::as_str))?))
    }

    /// Ends both ranks, each saying `BYE`.
    pub fn quit(&mut self) -> Result<(), String> {
        self.recv.tell("QUIT")?;
        self.send.tell("QUIT")?;
        self.recv.answer("BYE", LIMIT, &mut self.send)?;
        self.send.answer("BYE", LIMIT, &mut self.recv)?;
        Ok(())
    }
}

/// Which side of the benchmark this process is.
#[derive(Debug, PartialEq)]
enum Mode {
    /// Both ranks on this host (children of this process), perftest beside them.
    Local,
    /// The receiving rank, serving a `--connect` orchestrator over TCP.
    Listen,
    /// The orchestrator and sending rank, with the receiving rank at this address.
    Connect(String),
}

/// The benchmark: two ranks through the plugin, next to perftest, on one host or between two
///
/// Bandwidth per message size (up to 32 messages in flight) and ping-pong latency, each size
/// measured in rounds with perftest's ib_write_bw, ib_write_lat and ib_send_lat between the
/// same two devices (one host only); the table shows the median, the spread and the ratio.
#[derive(clap::Args)]
#[command(
    override_usage = "ferroce perf [OPTIONS]                                 one host: two rank processes
       ferroce perf --listen [--dev D] [--port P]             two hosts: the receiving side; prints its address
       ferroce perf --connect HOST:PORT [--dev D] [OPTIONS]   the sending side; prints the tables",
    after_help = "A device is a name as the plugin reports it (rxe0, mlx5_0:1) or an index into the \
devices it offers; NCCL_IB_HCA filters those as it does for NCCL."
)]
pub struct Args {
    /// The plugin as NCCL_NET_PLUGIN names it, or a path [default: libnccl-net-ferroce.so next
    /// to this program, else `ferroce`]
    #[arg(long, value_name = "NAME_OR_PATH")]
    plugin: Option<String>,
    /// Rounds of the whole set [default: 3]
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
    /// Bandwidth time per size per round [default: 2.0]
    #[arg(long, value_name = "S")]
    seconds: Option<f64>,
    /// Leave out the sizes above this many bytes [default: all, up to 8 MiB]
    #[arg(long, value_name = "BYTES")]
    max_size: Option<usize>,
    /// Latency iterations per size, after a tenth as many for warm-up [default: 1000]
    #[arg(long, value_name = "N")]
    iters: Option<usize>,
    /// One JSON object with every round's numbers instead of the table
    #[arg(long)]
    json: bool,
    /// ferroce only (two hosts: always; perftest needs both devices on this host)
    #[arg(long)]
    no_perftest: bool,
    /// One host: device of rank 0, the sender [default: the first device the plugin offers]
    #[arg(long, value_name = "D")]
    dev_send: Option<String>,
    /// One host: device of rank 1, the receiver [default: the second device]
    #[arg(long, value_name = "D")]
    dev_recv: Option<String>,
    /// Two hosts: this side's device [default: the first device the plugin offers]
    #[arg(long, value_name = "D")]
    dev: Option<String>,
    /// --listen: the TCP port for the connector [default: any free port]
    #[arg(long, value_name = "P")]
    port: Option<u16>,
    /// Two hosts: be the receiving side, and print the address to --connect to
    #[arg(long, conflicts_with = "connect")]
    listen: bool,
    /// Two hosts: be the sending side, with the receiving side at HOST:PORT
    #[arg(long, value_name = "HOST:PORT")]
    connect: Option<String>,
}

/// [`Args`] checked, with every default filled in.
pub struct Opts {
    mode: Mode,
    plugin: String,
    rounds: usize,
    seconds: f64,
    json: bool,
    perftest: bool,
    /// The sender's and the receiver's device (names or indices; see `Driver::resolve`).
    devs: (String, String),
    port: u16,
    max_size: usize,
    iters: usize,
}

impl Args {
    /// The rules that tie options to a mode, and the ranges clap does not check.
    pub fn opts(&self) -> Result<Opts, String> {
        let mode = match (&self.connect, self.listen) {
            (Some(addr), _) => Mode::Connect(addr.clone()),
            (None, true) => Mode::Listen,
            (None, false) => Mode::Local,
        };
        let one_host_dev = self.dev_send.is_some() || self.dev_recv.is_some();
        // The options that shape the measurement, which only the driving side takes.
        let driving = [
            ("--json", self.json),
            ("--no-perftest", self.no_perftest),
            ("--rounds", self.rounds.is_some()),
            ("--seconds", self.seconds.is_some()),
            ("--max-size", self.max_size.is_some()),
            ("--iters", self.iters.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag));
        match &mode {
            Mode::Local if self.dev.is_some() => {
                return Err(
                    "--dev is for --listen/--connect; one host: --dev-send, --dev-recv".into()
                );
            }
            Mode::Local if self.port.is_some() => return Err("--port is for --listen".into()),
            Mode::Local => {}
            _ if one_host_dev => {
                return Err("--dev-send/--dev-recv are for one host; with two: --dev".into());
            }
            Mode::Listen if driving.is_some() => {
                let flag = driving.unwrap_or_default();
                return Err(format!("{flag}: the --connect side runs the benchmark"));
            }
            Mode::Connect(_) if self.port.is_some() => return Err("--port is for --listen".into()),
            Mode::Listen | Mode::Connect(_) => {}
        }
        let or = |d: &Option<String>, default: &str| d.clone().unwrap_or_else(|| default.into());
        let devs = match &mode {
            Mode::Local => (or(&self.dev_send, "0"), or(&self.dev_recv, "1")),
            Mode::Listen => ("0".into(), or(&self.dev, "0")),
            Mode::Connect(_) => (or(&self.dev, "0"), "1".into()),
        };
        let o = Opts {
            perftest: mode == Mode::Local && !self.no_perftest,
            mode,
            plugin: self.plugin.clone().unwrap_or_else(crate::default_plugin),
            rounds: self.rounds.unwrap_or(3),
            seconds: self.seconds.unwrap_or(2.0),
            json: self.json,
            devs,
            port: self.port.unwrap_or(0),
            max_size: self.max_size.unwrap_or(MAX),
            iters: self.iters.unwrap_or(LAT_ITERS),
        };
        if o.rounds == 0 {
            return Err("--rounds must be at least 1".into());
        }
        if o.max_size < BW_SIZES[0] {
            return Err(format!("--max-size must be at least {} (the smallest size)", BW_SIZES[0]));
        }
        if !(10..=1_000_000).contains(&o.iters) {
            return Err("--iters must be from 10 to 1000000".into());
        }
        if !(0.1..=3600.0).contains(&o.seconds) {
            return Err("--seconds must be from 0.1 to 3600".into());
        }
        if [&o.devs.0, &o.devs.1].iter().any(|d| d.is_empty()) {
            return Err("a device is a name or an index".into());
        }
        Ok(o)
    }
}

/// `ferroce perf --listen`: the receiving rank of a two-host run. It listens through the
/// plugin, offers a TCP control connection on the same address (printed as `HANDLE
/// HOST:PORT DEVICE`), and serves one `--connect` orchestrator as a `perf-rank recv` child
/// serves the single-host one.
fn listen(o: &Opts, facts: Facts) -> Result<(), String> {
    run_rank(false, &o.plugin, &o.devs.1, facts, |name, plugin_addr| {
        let bind = SocketAddr::new(plugin_addr.ip(), o.port);
        let l = TcpListener::bind(bind).map_err(|e| format!("listening on {bind}: {e}"))?;
        let at = l.local_addr().map_err(|e| e.to_string())?;
        println!("HANDLE {at} {name}");
        println!(
            "# ferroce perf: receiving on {name}; on the other host: ferroce perf --connect {at}"
        );
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        l.set_nonblocking(true).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + IDLE;
        let (s, peer) = loop {
            match l.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(format!("nobody connected within {IDLE:?}"));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(format!("accept on {at}: {e}")),
            }
        };
        println!("# connected from {peer}");
        let _ = s.set_nodelay(true);
        s.set_nonblocking(false).map_err(|e| e.to_string())?;
        let r = s.try_clone().map_err(|e| e.to_string())?;
        let out: Box<dyn Write> = Box::new(s);
        Ok(Io { cmds: lines_of(r), out: RefCell::new(out), remote: true })
    })?;
    println!("# done");
    Ok(())
}

/// Where perftest finds a plugin device: its verbs name, RoCE v2 GID index and IP address, from
/// what ci/vm.sh exports (with its usual values as defaults).
struct Port {
    name: String,
    gid: String,
    ip: String,
}

fn port(name: &str) -> Result<Port, String> {
    let list = |k: &str, d: &str| -> Vec<String> {
        std::env::var(k).unwrap_or(d.into()).split_whitespace().map(str::to_string).collect()
    };
    let devs = list("FERROCE_VM_DEVS", "rxe0 rxe1");
    let i = devs.iter().position(|d| d == name).ok_or(format!(
        "perftest: device {name} is not in FERROCE_VM_DEVS ({devs:?}); use --no-perftest"
    ))?;
    let pick = |v: Vec<String>, what: &str| {
        v.get(i).cloned().ok_or(format!("perftest: no {what} for {name} (index {i})"))
    };
    Ok(Port {
        name: name.into(),
        gid: pick(list("FERROCE_VM_GIDX", "1 1"), "FERROCE_VM_GIDX")?,
        ip: pick(list("FERROCE_VM_IPS", "198.18.0.1 198.18.0.2"), "FERROCE_VM_IPS")?,
    })
}

/// Ends a `timeout`-wrapped process: TERM, which timeout forwards to the tool.
fn stop(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: kill(2) on our own child's pid, which is not yet reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let _ = child.wait();
}

/// One perftest pair: server on the receiving device, client on the sending one, each under
/// `timeout` (perftest's retry count 7 means "forever" on rxe). `label` names the column read.
struct Perftest<'a> {
    tx: &'a Port,
    rx: &'a Port,
    limit: u64,
    label: &'a str,
}

impl Perftest<'_> {
    /// Column `col` of the result row. A zero (nothing completed while perftest sampled: rxe
    /// stalls now and then) gets one more try, then counts as no result.
    fn run(&self, tool: &str, extra: &[&str], col: usize) -> Result<f64, String> {
        for _ in 0..2 {
            let v = self.once(tool, extra)?.get(col).copied().unwrap_or(0.0);
            if v > 0.0 {
                return Ok(v);
            }
            eprintln!(
                "# {tool} {}: 0 measured (nothing completed while it sampled)",
                extra.join(" ")
            );
        }
        eprintln!("# {tool} {}: no result; left out of the median", extra.join(" "));
        Ok(f64::NAN)
    }

    fn once(&self, tool: &str, extra: &[&str]) -> Result<Vec<f64>, String> {
        let (limit, rx, tx) = (self.limit.to_string(), self.rx, self.tx);
        let cmd = |p: &Port| {
            let mut c = Command::new("timeout");
            c.args(["-k", "5", &limit, tool, "-d", &p.name, "-x", &p.gid, "-F"]).args(extra);
            c
        };
        let mut server = cmd(rx)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{tool}: {e}"))?;
        // The client must not connect before the server listens on perftest's TCP port.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Command::new("ss").args(["-Hltn", "sport = :18515"]).output() {
                Ok(o) if !o.stdout.is_empty() => break,
                Ok(_) if Instant::now() < deadline && matches!(server.try_wait(), Ok(None)) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(_) => {
                    stop(&mut server);
                    return Err(format!("{tool} server on {} did not listen on :18515", rx.name));
                }
                Err(e) => {
                    stop(&mut server);
                    return Err(format!("ss: {e}"));
                }
            }
        }
        let out = cmd(tx).arg(&rx.ip).output();
        stop(&mut server);
        let out = out.map_err(|e| format!("{tool}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let (t, r) = (&tx.name, &rx.name);
            return Err(format!("{tool} {t} -> {r} failed ({}): {text}{err}", out.status));
        }
        // A different layout is an error, not a wrong number.
        if !text.contains(self.label) {
            return Err(format!("{tool}: no {:?} column in its output: {text}", self.label));
        }
        text.lines()
            .rev()
            .map(|l| l.split_whitespace().map_while(|w| w.parse::<f64>().ok()).collect::<Vec<_>>())
            .find(|v| v.len() >= 5)
            .ok_or_else(|| format!("no result row from {tool}: {text}"))
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn spread(v: &[f64]) -> (f64, f64) {
    let f = v.iter().copied().filter(|x| x.is_finite());
    (f.clone().fold(f64::INFINITY, f64::min), f.fold(f64::NEG_INFINITY, f64::max))
}

/// Every round's numbers of one size.
#[derive(Default)]
struct Row {
    size: usize,
    /// ferroce: Gb/s (bandwidth) or median half round trip in us (latency), per round.
    ours: Vec<f64>,
    /// Bandwidth: bytes and seconds timed; latency: the minimum half round trip.
    bytes: Vec<f64>,
    secs: Vec<f64>,
    min: Vec<f64>,
    /// ib_write_bw Gb/s, or ib_write_lat t_typical us, per round.
    write: Vec<f64>,
    /// ib_send_lat t_typical us (latency only).
    send: Vec<f64>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// `perf-rank` and perftest drive a plugin and a VM that may stall; every wait is bounded.
pub fn perf(o: &Opts, facts: Facts) -> Result<(), String> {
    let recv = match &o.mode {
        Mode::Listen => return listen(o, facts),
        Mode::Local => spawn_rank("recv", &o.plugin, &o.devs.1)?,
        Mode::Connect(addr) => remote_rank(addr)?,
    };
    let mut pair = Pair::open(recv, spawn_rank("send", &o.plugin, &o.devs.0)?)?;
    let (tx_name, rx_name) = (pair.tx.name.clone(), pair.rx.name.clone());
    if let Mode::Connect(addr) = &o.mode {
        eprintln!("# two hosts: sending on {tx_name} here, receiving on {rx_name} at {addr}");
        eprintln!("# perftest: skipped with two hosts (it needs both devices on one host)");
    }
    pair.connect()?;
    let ports = if o.perftest { Some((port(&tx_name)?, port(&rx_name)?)) } else { None };

    let pt_secs = o.seconds.round().max(1.0) as u64;
    let warm = warmup(o.seconds);
    let rows = |sizes: &[usize]| -> Vec<Row> {
        let sizes = sizes.iter().filter(|&&size| size <= o.max_size);
        sizes.map(|&size| Row { size, ..Row::default() }).collect()
    };
    let (mut bw, mut lat) = (rows(&BW_SIZES), rows(&LAT_SIZES));
    for round in 1..=o.rounds {
        let tag = format!("# round {round}/{}", o.rounds);
        ferroce_round(&mut pair, o, warm, &tag, &mut bw, &mut lat)?;
        if let Some((tx, rx)) = &ports {
            perftest_round((tx, rx), o, pt_secs, &tag, &mut bw, &mut lat)?;
        }
    }
    pair.quit()?;

    let tx = Dev { name: &tx_name, index: &pair.tx.index, host: "here" };
    let rx = Dev {
        name: &rx_name,
        index: &pair.rx.index,
        host: match &o.mode {
            Mode::Connect(addr) => addr,
            _ => "here",
        },
    };
    let header = Header { o, tx, rx, warm, pt_secs };
    if o.json {
        print_json(&header, &bw, &lat)
    } else {
        print_table(&header, &bw, &lat)
    }
    Ok(())
}

/// One round of ferroce's own measurements: every bandwidth size, then every latency size.
fn ferroce_round(
    pair: &mut Pair,
    o: &Opts,
    warm: f64,
    tag: &str,
    bw: &mut [Row],
    lat: &mut [Row],
) -> Result<(), String> {
    for row in bw {
        let size = row.size;
        let (bytes, secs) = pair.bw(size, window(size), o.seconds, warm, None)?;
        let gbps = bytes * 8.0 / secs / 1e9;
        eprintln!(
            "{tag}: ferroce bandwidth {size:>8} B: {gbps:.4} Gb/s ({bytes} B in {secs:.2} s)"
        );
        row.ours.push(gbps);
        row.bytes.push(bytes);
        row.secs.push(secs);
    }
    for row in lat {
        let (med, min) = pair.lat(row.size, o.iters, o.iters / 10)?;
        eprintln!("{tag}: ferroce latency   {:>8} B: {med:.1} us (min {min:.1})", row.size);
        row.ours.push(med);
        row.min.push(min);
    }
    Ok(())
}

/// One round of perftest from port `tx` to port `rx`: every bandwidth size, then every latency
/// size.
fn perftest_round(
    (tx, rx): (&Port, &Port),
    o: &Opts,
    pt_secs: u64,
    tag: &str,
    bw: &mut [Row],
    lat: &mut [Row],
) -> Result<(), String> {
    for row in bw {
        let (size, d) = (row.size.to_string(), pt_secs.to_string());
        let args = ["-s", &size, "-D", &d, "--report_gbits"];
        // Row: bytes, iterations, peak, average Gb/s, message rate.
        let pt = Perftest { tx, rx, limit: 60 + 4 * pt_secs, label: "BW average[Gb/sec]" };
        let v = pt.run("ib_write_bw", &args, 3)?;
        eprintln!("{tag}: ib_write_bw       {size:>8} B: {v:.4} Gb/s");
        row.write.push(v);
    }
    for row in lat {
        let (size, n) = (row.size.to_string(), o.iters.to_string());
        // Row: bytes, iterations, t_min, t_max, t_typical, ...
        let pt = Perftest { tx, rx, limit: 120, label: "t_typical" };
        let w = pt.run("ib_write_lat", &["-s", &size, "-n", &n], 4)?;
        let s = pt.run("ib_send_lat", &["-s", &size, "-n", &n], 4)?;
        eprintln!("{tag}: ib_write_lat / ib_send_lat {size:>8} B: {w:.1} / {s:.1} us");
        row.write.push(w);
        row.send.push(s);
    }
    Ok(())
}

/// A rank's device: its name, index among the plugin's devices, and host.
struct Dev<'a> {
    name: &'a str,
    index: &'a str,
    host: &'a str,
}

struct Header<'a> {
    o: &'a Opts,
    tx: Dev<'a>,
    rx: Dev<'a>,
    warm: f64,
    pt_secs: u64,
}

fn range(v: &[f64], prec: usize) -> String {
    let (a, b) = spread(v);
    if a.is_finite() { format!("{}-{}", fixed(a, prec), fixed(b, prec)) } else { "-".into() }
}

fn print_table(h: &Header, bw: &[Row], lat: &[Row]) {
    let o = h.o;
    let hosts = if o.mode == Mode::Local { "one host" } else { "two hosts" };
    println!("# ferroce perf: plugin {} through ncclNet v12, two processes, {hosts}", o.plugin);
    println!(
        "#   rank 0 sends on {} (dev {}, {}), rank 1 receives on {} (dev {}, {})",
        h.tx.name, h.tx.index, h.tx.host, h.rx.name, h.rx.index, h.rx.host
    );
    println!("#   every receive checked for its length, the last of each run byte for byte");
    if o.mode != Mode::Local {
        println!("#   perftest: skipped with two hosts (it needs both devices on one host)");
    }
    println!(
        "#   median of {} round(s); spread: min-max over the rounds; ratio: ferroce / perftest",
        o.rounds
    );
    println!(
        "#   bandwidth: algbw on the receiver's clock, {} s per size after {:.2} s warm-up, up to \
         {WINDOW} receives posted ahead and {WINDOW} sends in flight (at most {} MiB); \
         ib_write_bw -D {} --report_gbits, BW average",
        o.seconds,
        h.warm,
        WINDOW_BYTES >> 20,
        h.pt_secs
    );
    let t = Table { widths: &[12, 12, 17, 12, 17, 6], gap: 2 };
    println!("{}", t.line('#', &["size", "ferroce", "spread", "ib_write_bw", "spread", "ratio"]));
    println!("{}", t.line('#', &["(B)", "(Gb/s)", "(Gb/s)", "(Gb/s)", "(Gb/s)", ""]));
    for r in bw {
        let (m, p) = (median(&r.ours), median(&r.write));
        let (ours, theirs) = (range(&r.ours, 4), range(&r.write, 4));
        let cells =
            [r.size.to_string(), fixed(m, 4), ours, fixed(p, 4), theirs, fixed(ratio(m, p), 2)];
        println!("{}", t.line(' ', &cells));
    }
    println!();
    println!(
        "#   latency: ping-pong, half the round trip, {} iterations after {} \
         warm-up, {LAT_DEPTH} receives posted ahead; min: the fastest sample of all rounds; \
         ib_write_lat / ib_send_lat -n {}, t_typical; ratio vs ib_write_lat",
        o.iters,
        o.iters / 10,
        o.iters
    );
    let t = Table { widths: &[12, 9, 13, 8, 12, 13, 11, 13, 6], gap: 2 };
    let head = [
        "size",
        "ferroce",
        "spread",
        "min",
        "ib_write_lat",
        "spread",
        "ib_send_lat",
        "spread",
        "ratio",
    ];
    println!("{}", t.line('#', &head));
    println!(
        "{}",
        t.line('#', &["(B)", "(us)", "(us)", "(us)", "(us)", "(us)", "(us)", "(us)", ""])
    );
    for r in lat {
        let (m, p) = (median(&r.ours), median(&r.write));
        let cells = [
            r.size.to_string(),
            fixed(m, 1),
            range(&r.ours, 1),
            fixed(spread(&r.min).0, 1),
            fixed(p, 1),
            range(&r.write, 1),
            fixed(median(&r.send), 1),
            range(&r.send, 1),
            fixed(ratio(m, p), 2),
        ];
        println!("{}", t.line(' ', &cells));
    }
}

/// Every round's numbers, as one JSON object; a number that was not measured is `null`.
fn print_json(h: &Header, bw: &[Row], lat: &[Row]) {
    let o = h.o;
    let bw: Vec<_> = bw
        .iter()
        .map(|r| {
            let (m, p) = (median(&r.ours), median(&r.write));
            json!({
                "size": r.size,
                "window": window(r.size),
                "ferroce_gbps": r.ours,
                "ferroce_bytes": r.bytes,
                "ferroce_seconds": r.secs,
                "ferroce_gbps_median": m,
                "ib_write_bw_gbps": r.write,
                "ib_write_bw_gbps_median": p,
                "ratio": ratio(m, p),
            })
        })
        .collect();
    let lat: Vec<_> = lat
        .iter()
        .map(|r| {
            let (m, p) = (median(&r.ours), median(&r.write));
            json!({
                "size": r.size,
                "ferroce_us": r.ours,
                "ferroce_min_us": r.min,
                "ferroce_us_median": m,
                "ib_write_lat_us": r.write,
                "ib_write_lat_us_median": p,
                "ib_send_lat_us": r.send,
                "ib_send_lat_us_median": median(&r.send),
                "ratio_vs_write_lat": ratio(m, p),
            })
        })
        .collect();
    let dev = |d: &Dev| json!({"dev": d.index, "name": d.name, "host": d.host});
    out::print_json(&json!({
        "plugin": o.plugin,
        "abi": 12,
        "sender": dev(&h.tx),
        "receiver": dev(&h.rx),
        "rounds": o.rounds,
        "seconds": o.seconds,
        "warmup_seconds": h.warm,
        "perftest": o.perftest,
        "perftest_seconds": h.pt_secs,
        "lat_iters": o.iters,
        "lat_warmup": o.iters / 10,
        "lat_depth": LAT_DEPTH,
        "bandwidth": bw,
        "latency": lat,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn parse(s: &str) -> Result<Opts, String> {
        let words = std::iter::once("perf").chain(s.split_whitespace());
        Cli::try_parse_from(words).map_err(|e| e.to_string())?.a.opts()
    }

    #[test]
    fn options() {
        let o = parse("--rounds 5 --seconds 0.5 --json --no-perftest --dev-send 2 --dev-recv 3")
            .unwrap();
        let devs = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            (o.mode, o.rounds, o.seconds, o.json, o.perftest, o.devs),
            (Mode::Local, 5, 0.5, true, false, devs("2", "3"))
        );
        let o = parse("--plugin /x/libnccl-net-ferroce.so --dev-recv rxe1").unwrap();
        assert_eq!(
            (o.plugin.as_str(), o.rounds, o.seconds, o.devs, o.perftest),
            ("/x/libnccl-net-ferroce.so", 3, 2.0, devs("0", "rxe1"), true)
        );
        let o = parse("--listen --dev rxe1 --port 7000").unwrap();
        assert_eq!((o.mode, o.devs.1, o.port), (Mode::Listen, "rxe1".into(), 7000));
        let o = parse("--connect h:1 --rounds 1 --json").unwrap();
        assert_eq!(
            (o.mode, o.devs.0, o.perftest),
            (Mode::Connect("h:1".into()), "0".into(), false)
        );
        for bad in [
            "--rounds",
            "--rounds 0",
            "--rounds x",
            "--seconds 0",
            "--seconds nan",
            "--bogus",
            "--dev-send",
            "--dev-send --json",
            "--dev rxe0",
            "--port 5",
            "--listen --connect h:1",
            "--listen --listen",
            "--connect",
            "--connect h:1 --port 5",
            "--connect h:1 --dev-send rxe0",
            "--listen --rounds 2",
            "--listen --port 70000",
            "--listen --dev",
            "extra",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn statistics() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 1.0]), 1.0);
        assert!(median(&[]).is_nan());
        assert_eq!(spread(&[2.0, f64::NAN, 5.0, 1.0]), (1.0, 5.0));
        assert_eq!(range(&[], 1), "-");
        assert!(ratio(1.0, 0.0).is_nan());
        assert_eq!((window(8), window(1 << 20), window(8 << 20)), (32, 32, 4));
    }
}
