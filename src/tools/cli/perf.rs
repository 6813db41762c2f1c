//! `ferroce perf`: the plugin measured the way NCCL drives it, next to perftest on the same
//! devices in the same boot.
//!
//! Two ranks are two processes, as in NCCL: this orchestrator runs `ferroce perf-rank send|recv`
//! twice and talks to each over its stdin/stdout, one line per message. Each rank loads the
//! plugin with `dlopen`, drives its v12 ABI through [`Driver`], listens on its device and
//! connects to the other's handle (which the orchestrator relays), so each rank has a send comm
//! and a receive comm. Buffers are registered once; then the ranks run the commands they get.
//!
//! A rank polls as NCCL's proxy thread does. The proxy keeps `NCCL_STEPS` (8) receives posted
//! ahead per channel, one `irecv` per step (never several steps in one call); it spins over its
//! operations, and in each pass it first posts what it may, then tests only the oldest
//! outstanding request of each direction, once. It posts a step's receive again only when the
//! step's buffer is free (its message was seen) and its request was tested done. It yields the
//! CPU after a pass that moved nothing and after every 8th pass in a row that did
//! ([`Stall::nccl`]). `--depth` (default 8) sets the receives posted ahead; the orchestrator
//! passes it to the ranks in each command.
//!
//! - `BW size window seconds warm-up [MESSAGES]`: rank 0 sends, rank 1 receives, `--seconds`
//!   per size. The receiver keeps `window` receives posted ahead and the sender `window` sends
//!   in flight: the depth, but at most [`WINDOW_BYTES`] in flight (and never fewer than 2 for
//!   that cap). The receiver's clock decides: after a warm-up it times whole messages from one
//!   completion to the first completion `--seconds` later, then stops posting and names the
//!   number of receives it posted (`POSTED n`); the orchestrator relays that to the sender
//!   (`STOP n`), which sends exactly that many. Nothing stays posted, and the drain is not timed.
//!   The optional `MESSAGES` ends the timing after that many messages if the time has not ended
//!   it first (`ferroce doctor --peer --selftest`).
//! - `LAT size iterations warm-up depth simple|ll`: ping-pong with `depth` receives posted ahead
//!   on each side. Rank 0 stamps each ping; a sample is half the time between two pings
//!   (perftest's method), so everything the application does in a round trip counts. Rank 0
//!   replies with the median (p50), the mean and the fastest sample.
//!   - `simple` (NCCL's Simple protocol): a message has arrived when its receive tests done.
//!   - `ll` (NCCL's LL and LL128): receives are optional (`NCCL_NET_OPTIONAL_RECV_COMPLETION`),
//!     so the plugin may call them done before the data is there; in NCCL the GPU sees the data
//!     arrive through flags inside it. Here the sender stamps a flag that changes with every
//!     message into the last byte of its buffer, and the receiver watches for it in its own
//!     buffer (a volatile read per pass) while it keeps testing the oldest receive, as the proxy
//!     keeps calling into the plugin while the GPU watches. One thread plays both parts, so the
//!     watch also pauses while the proxy part yields.
//!
//! Before `PEER`, a rank also answers `PORT` with its port's facts (`doctor::port_facts`,
//! handed in by `main`), so `ferroce doctor --peer` can compare the two ends through the same
//! connection; [`Pair`] is the orchestrator's side that both use.
//!
//! Each of `--rounds` rounds (default 5) measures size by size, and each size first through
//! ferroce, then at once through perftest on the same two devices: `ib_write_bw` and
//! `ib_send_bw` (and `ib_write_bw -q N` when `NCCL_IB_QPS_PER_CONNECTION` gives the ranks N
//! lanes) beside the bandwidth, `ib_write_lat` and `ib_send_lat` beside the latency. So drift in
//! the VM hits a size's numbers alike. The tables give each number's median over the rounds,
//! the spread (min-max) of the main ones, and ferroce / perftest for the median (p50) and the
//! mean latency alike; `--json` gives every round's numbers and each one's median, mean, min
//! and max.
//!
//! perftest converts CPU cycles to time with the "cpu MHz" it reads, which an emulated CPU may
//! get wrong. So once per run the orchestrator times two `ib_write_lat` runs of different
//! lengths against the wall clock: the wall time of the extra iterations, halved, is what
//! perftest should report for them (connection setup and teardown cancel out).

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
use ferroce_tools::wait::{NCCL_APPENDOP_FREQ, Stall};
use serde_json::json;

const BW_SIZES: [usize; 6] = [8, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20];
/// Latency sizes, in both protocols: LL carries small messages.
const LAT_SIZES: [usize; 2] = [8, 4 << 10];
/// Latency iterations by default (`--iters`); the warm-up is a tenth as many.
const LAT_ITERS: usize = 1000;
/// Receives posted ahead by default (`--depth`): NCCL's `NCCL_STEPS`, one receive per step.
const DEPTH: usize = 8;
/// Requests in flight per direction at most: NCCL's `NCCL_NET_MAX_REQUESTS`.
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
/// The two lengths of the perftest clock check, in iterations.
const CLOCK_ITERS: (usize, usize) = (500, 2500);

/// Bandwidth requests in flight for `size`-byte messages: the depth, unless that puts more than
/// [`WINDOW_BYTES`] in flight (a cap that leaves at least 2).
fn window(size: usize, depth: usize) -> usize {
    (WINDOW_BYTES / size).max(2).min(depth)
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

/// The flag an LL message `i` carries in its last byte: never 0 (the cleared buffer) and never
/// the flag of message `i - 1`, so the receiver cannot mistake the previous message for it.
fn flag(i: usize) -> u8 {
    (i % 255) as u8 + 1
}

/// NCCL's protocols as far as the network sees them.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Proto {
    /// Every receive completes through the plugin.
    Simple,
    /// Optional receives: the data's flags tell their arrival.
    Ll,
}

impl Proto {
    fn word(self) -> &'static str {
        match self {
            Proto::Simple => "simple",
            Proto::Ll => "ll",
        }
    }

    fn parse(w: Option<&str>) -> Result<Proto, String> {
        match w {
            Some("simple") => Ok(Proto::Simple),
            Some("ll") => Ok(Proto::Ll),
            w => Err(format!("LAT protocol: expected simple or ll, got {w:?}")),
        }
    }
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
        let addr = ferroce_core::setup::wire::Handle::decode(&handle)
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
            // Sizes and depths index the buffers and the plugin's 32 slots, and a --listen rank
            // takes its commands from the network: each is checked.
            let within = |what: &str, w: Option<&str>, max: usize| {
                let v: usize = num(what, w)?;
                if (1..=max).contains(&v) {
                    Ok(v)
                } else {
                    Err(format!("{what} {v}: not 1..={max}"))
                }
            };
            let reply = match w.next() {
                Some("BW") if sender => self.bw_send(
                    within("BW size", w.next(), MAX)?,
                    within("BW window", w.next(), WINDOW)?,
                )?,
                Some("BW") => self.bw_recv(
                    within("BW size", w.next(), MAX)?,
                    within("BW window", w.next(), WINDOW)?,
                    num("BW seconds", w.next())?,
                    num("BW warm-up", w.next())?,
                    w.next().map(|m| num("BW messages", Some(m))).transpose()?,
                )?,
                Some("LAT") => self.lat(
                    within("LAT size", w.next(), MAX)?,
                    num("LAT iterations", w.next())?,
                    num("LAT warm-up", w.next())?,
                    within("LAT depth", w.next(), WINDOW)?,
                    Proto::parse(w.next())?,
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

    /// One receive of `size` bytes into the receive buffer; `optional` as for NCCL's LL.
    fn irecv(&self, size: usize, optional: bool) -> Result<Option<Ptr>, String> {
        self.drv.irecv(self.recv, &[self.rbuf], &[size], &[0], &[self.rmh], optional)
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

    /// The last byte of the first `size` of the receive buffer, read afresh from memory: the
    /// NIC writes it behind the compiler's back. `size` is 1..=MAX.
    fn last_received(&self, size: usize) -> u8 {
        // SAFETY: in bounds of the MAX-byte buffer that lives as long as self; a byte is read
        // whole, whatever the NIC writes meanwhile.
        unsafe { std::ptr::read_volatile(self.rbuf.add(size - 1)) }
    }

    /// Writes the last byte of the first `size` of the send buffer (`size` is 1..=MAX); only
    /// while no send is in flight.
    fn stamp(&self, size: usize, v: u8) {
        // SAFETY: in bounds of the MAX-byte buffer that lives as long as self; the callers hold
        // no send in flight, so the NIC does not read it meanwhile.
        unsafe { std::ptr::write_volatile(self.sbuf.add(size - 1), v) }
    }

    /// The last message received must be the sender's pattern, byte for byte, except that an
    /// LL message ends with the flag `last` instead (the buffer was zeroed before the first
    /// receive was posted, so a message that never landed fails too). Only while no receive is
    /// posted.
    fn verify(&self, size: usize, last: Option<u8>) -> Result<(), String> {
        // SAFETY: as in `clear`: in bounds, and nothing writes the buffer meanwhile.
        let got = unsafe { std::slice::from_raw_parts(self.rbuf, size.min(MAX)) };
        let want = |i: usize| match last {
            Some(f) if i + 1 == got.len() => f,
            _ => pattern(i),
        };
        match got.iter().enumerate().position(|(i, &b)| b != want(i)) {
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
        let mut stall = Stall::nccl();
        loop {
            let mut moved = false;
            if end.is_none()
                && q.len() < window
                && let Some(r) = self.irecv(size, false)?
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
        self.verify(size, None)?;
        let ((t0, d0), (t1, d1)) = start.zip(end).ok_or("bandwidth: not timed")?;
        Ok(format!("BW {} {:.9}", (d1 - d0) * size as u64, (t1 - t0).as_secs_f64()))
    }

    /// Keeps `window` sends in flight until told how many the receiver posted. A pass posts
    /// first and then tests the oldest send, as NCCL's proxy does.
    fn bw_send(&self, size: usize, window: usize) -> Result<String, String> {
        let mut q = VecDeque::with_capacity(window);
        let (mut sent, mut stop) = (0u64, None);
        let mut stall = Stall::nccl();
        loop {
            let mut moved = false;
            if q.len() < window
                && stop.is_none_or(|n| sent < n)
                && let Some(r) = self.isend(size)?
            {
                q.push_back(r);
                sent += 1;
                moved = true;
            }
            if let Some(&r) = q.front()
                && self.drv.test(r)?.is_some()
            {
                q.pop_front();
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

    /// Ping-pong of `warm + iters + 1` messages (one more than samples: a sample is the time
    /// between two pings). The leader replies `LAT p50_us mean_us min_us`, the other side `LAT`.
    fn lat(
        &self,
        size: usize,
        iters: usize,
        warm: usize,
        depth: usize,
        proto: Proto,
        leader: bool,
    ) -> Result<String, String> {
        let total = warm + iters + 1;
        self.clear(size);
        let mut p = PingPong::new(self, size, depth, total, proto);
        let mut stamps = Vec::with_capacity(if leader { total } else { 0 });
        for i in 0..total {
            // Our previous message must have left before the buffer takes the next flag.
            if leader {
                p.wait("a ping's send", |p| p.send_idle())?;
                stamps.push(Instant::now());
                p.start_send(i);
                p.wait("a pong", |p| p.arrived(i))?;
            } else {
                p.wait("a ping", |p| p.arrived(i) && p.send_idle())?;
                p.start_send(i);
            }
            p.seen = i + 1;
        }
        p.wait("the last requests", |p| p.send_idle() && p.received == total)?;
        if proto == Proto::Ll {
            // The next run sends the pattern again.
            self.stamp(size, pattern(size - 1));
        }
        self.verify(size, (proto == Proto::Ll).then(|| flag(total - 1)))?;
        if !leader {
            return Ok("LAT".into());
        }
        let mut half: Vec<f64> =
            stamps.windows(2).skip(warm).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / 2.0).collect();
        half.sort_by(f64::total_cmp);
        let min = half.first().copied().unwrap_or(f64::NAN);
        Ok(format!("LAT {:.3} {:.3} {min:.3}", median(&half), mean(&half)))
    }
}

/// One side of a ping-pong, polled as NCCL's proxy polls (see the module docs): receives
/// posted ahead up to the depth, at most one send of ours in flight.
struct PingPong<'r, 'a> {
    rank: &'r Rank<'a>,
    size: usize,
    depth: usize,
    /// Messages each way in the whole run: receives beyond it would stay posted.
    total: usize,
    proto: Proto,
    /// Receives posted and not yet tested done, oldest first.
    recvs: VecDeque<Ptr>,
    posted: usize,
    /// Receives tested done.
    received: usize,
    /// Messages the application has seen arrive (and is done with): the buffer of their step
    /// is free again.
    seen: usize,
    /// A send wanted but not yet taken by the plugin.
    want_send: bool,
    /// Our send in flight, not yet tested done.
    send: Option<Ptr>,
    stall: Stall,
}

impl<'r, 'a> PingPong<'r, 'a> {
    fn new(rank: &'r Rank<'a>, size: usize, depth: usize, total: usize, proto: Proto) -> Self {
        PingPong {
            rank,
            size,
            depth,
            total,
            proto,
            recvs: VecDeque::with_capacity(depth),
            posted: 0,
            received: 0,
            seen: 0,
            want_send: false,
            send: None,
            stall: Stall::nccl(),
        }
    }

    /// One pass of the proxy: post a receive and the wanted send, then test the oldest receive
    /// and our send once each. True if anything moved.
    ///
    /// A receive is posted for a step whose buffer is free, as NCCL's proxy does: at most the
    /// depth ahead of the messages seen, and only while fewer than the depth of requests are
    /// outstanding (a step's request is tested done before the step is posted again). With
    /// optional receives, which may test done at once, the first rule is the one that holds.
    fn pass(&mut self) -> Result<bool, String> {
        let (rank, size, ll) = (self.rank, self.size, self.proto == Proto::Ll);
        let mut moved = false;
        if self.recvs.len() < self.depth
            && self.posted < (self.seen + self.depth).min(self.total)
            && let Some(r) = rank.irecv(size, ll)?
        {
            self.recvs.push_back(r);
            self.posted += 1;
            moved = true;
        }
        if self.want_send
            && let Some(s) = rank.isend(size)?
        {
            self.send = Some(s);
            self.want_send = false;
            moved = true;
        }
        if let Some(&r) = self.recvs.front()
            && let Some(got) = rank.drv.test(r)?
        {
            // An optional receive's size is not reported: NCCL reads the flags instead.
            if !ll {
                Rank::check(size, got)?;
            }
            self.recvs.pop_front();
            self.received += 1;
            moved = true;
        }
        if let Some(s) = self.send
            && rank.drv.test(s)?.is_some()
        {
            self.send = None;
            moved = true;
        }
        Ok(moved)
    }

    /// Whether message `i` has arrived: its receive tested done (Simple), or its flag in the
    /// buffer (LL; whether its request was tested done yet does not matter).
    fn arrived(&self, i: usize) -> bool {
        match self.proto {
            Proto::Simple => self.received > i,
            Proto::Ll => self.rank.last_received(self.size) == flag(i),
        }
    }

    /// No send of ours wanted or in flight.
    fn send_idle(&self) -> bool {
        !self.want_send && self.send.is_none()
    }

    /// Hands message `i` to the next pass, flagged for LL. Only when [`Self::send_idle`].
    fn start_send(&mut self, i: usize) {
        if self.proto == Proto::Ll {
            self.rank.stamp(self.size, flag(i));
        }
        self.want_send = true;
    }

    /// Passes until `done`, which is checked before each pass.
    fn wait(&mut self, what: &str, done: impl Fn(&Self) -> bool) -> Result<(), String> {
        loop {
            if done(self) {
                return Ok(());
            }
            if self.pass()? {
                self.stall.moved();
            } else if self.stall.idle(STEP) {
                return Err(format!(
                    "ping-pong at {} B ({}): no progress for {STEP:?} waiting for {what} \
                     ({} of {} received)",
                    self.size,
                    self.proto.word(),
                    self.received,
                    self.total
                ));
            }
        }
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

    /// One ping-pong run with `depth` receives posted ahead: the median, the mean and the
    /// minimum half round trip, in us.
    fn lat(
        &mut self,
        size: usize,
        (iters, warm): (usize, usize),
        depth: usize,
        proto: Proto,
    ) -> Result<Lat, String> {
        let cmd = format!("LAT {size} {iters} {warm} {depth} {}", proto.word());
        self.recv.tell(&cmd)?;
        self.send.tell(&cmd)?;
        let r = self.send.answer("LAT", LIMIT, &mut self.recv)?;
        self.recv.answer("LAT", LIMIT, &mut self.send)?;
        let word = |i: usize, what: &str| num(what, r.get(i).map(String::as_str));
        Ok(Lat { p50: word(0, "LAT p50")?, avg: word(1, "LAT mean")?, min: word(2, "LAT min")? })
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
/// Bandwidth per message size and ping-pong latency (NCCL's Simple and LL protocols), polled as
/// NCCL's proxy polls, with --depth receives posted ahead. Each size is measured in rounds, right
/// before perftest's ib_write_bw and ib_send_bw, or ib_write_lat and ib_send_lat, between the
/// same two devices (one host only); the tables show the medians, the spread and the ratios.
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
    /// Rounds of the whole set [default: 5]
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
    /// Receives posted ahead (and bandwidth requests in flight, at most 32 MiB), 1 to 32; NCCL
    /// keeps 8 (NCCL_STEPS) [default: 8]
    #[arg(long, value_name = "N")]
    depth: Option<usize>,
    /// Skip the check of perftest's clock against the wall clock (run once when perftest runs)
    #[arg(long)]
    no_clock_check: bool,
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
    depth: usize,
    clock_check: bool,
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
            ("--depth", self.depth.is_some()),
            ("--no-clock-check", self.no_clock_check),
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
        let perftest = mode == Mode::Local && !self.no_perftest;
        let o = Opts {
            perftest,
            clock_check: perftest && !self.no_clock_check,
            mode,
            plugin: self.plugin.clone().unwrap_or_else(crate::default_plugin),
            rounds: self.rounds.unwrap_or(5),
            seconds: self.seconds.unwrap_or(2.0),
            json: self.json,
            devs,
            port: self.port.unwrap_or(0),
            max_size: self.max_size.unwrap_or(MAX),
            iters: self.iters.unwrap_or(LAT_ITERS),
            depth: self.depth.unwrap_or(DEPTH),
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
        if !(1..=WINDOW).contains(&o.depth) {
            return Err(format!("--depth must be from 1 to {WINDOW}"));
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
/// `timeout` (perftest's retry count 7 means "forever" on rxe). `label` names a column that
/// must be in the output, so a different layout is an error, not a wrong number.
struct Perftest<'a> {
    tx: &'a Port,
    rx: &'a Port,
    limit: u64,
    label: &'a str,
}

/// Columns of perftest's result rows: `#bytes #iterations BW-peak BW-average MsgRate` for
/// bandwidth, `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%` for latency.
const BW_AVERAGE: usize = 3;
const T_MIN: usize = 2;
const T_TYPICAL: usize = 4;
const T_AVG: usize = 5;

impl Perftest<'_> {
    /// Columns `cols` of the result row. A zero in the first (nothing completed while perftest
    /// sampled: rxe stalls now and then) gets one more try, then counts as no result (NaN).
    fn run(&self, tool: &str, extra: &[&str], cols: &[usize]) -> Result<Vec<f64>, String> {
        for _ in 0..2 {
            let (row, _) = self.once(tool, extra)?;
            let v = cols
                .iter()
                .map(|&c| row.get(c).copied().ok_or(format!("{tool}: no column {c} in {row:?}")))
                .collect::<Result<Vec<f64>, String>>()?;
            if v.first().is_some_and(|&x| x > 0.0) {
                return Ok(v);
            }
            eprintln!(
                "# {tool} {}: 0 measured (nothing completed while it sampled)",
                extra.join(" ")
            );
        }
        eprintln!("# {tool} {}: no result; left out of the statistics", extra.join(" "));
        Ok(vec![f64::NAN; cols.len()])
    }

    /// The result row, and how long the client ran by the wall clock.
    fn once(&self, tool: &str, extra: &[&str]) -> Result<(Vec<f64>, Duration), String> {
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
        let t0 = Instant::now();
        let out = cmd(tx).arg(&rx.ip).output();
        let wall = t0.elapsed();
        stop(&mut server);
        let out = out.map_err(|e| format!("{tool}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let (t, r) = (&tx.name, &rx.name);
            return Err(format!("{tool} {t} -> {r} failed ({}): {text}{err}", out.status));
        }
        if !text.contains(self.label) {
            return Err(format!("{tool}: no {:?} column in its output: {text}", self.label));
        }
        let row = text
            .lines()
            .rev()
            .map(|l| l.split_whitespace().map_while(|w| w.parse::<f64>().ok()).collect::<Vec<_>>())
            .find(|v| v.len() >= 5)
            .ok_or_else(|| format!("no result row from {tool}: {text}"))?;
        Ok((row, wall))
    }
}

/// perftest's clock against the wall clock: what `ib_write_lat -s 8` reports for the extra
/// iterations of a longer run, and their wall time.
struct Clock {
    /// The client's wall time of each run, in seconds.
    walls: (f64, f64),
    /// t_avg of each run, in us.
    avgs: (f64, f64),
    /// The extra iterations' wall time, per iteration and one way, in us.
    wall_us: f64,
    /// What perftest reported for them: its total for the longer run minus its total for the
    /// shorter, per extra iteration, in us.
    reported_us: f64,
}

/// Times [`CLOCK_ITERS`] iterations of `ib_write_lat -s 8` (see the module docs). Setup and
/// teardown take the same time in both runs, so the difference is the extra iterations alone.
fn clock_check(tx: &Port, rx: &Port) -> Result<Clock, String> {
    let pt = Perftest { tx, rx, limit: 120, label: "t_avg" };
    let run = |n: usize| -> Result<(f64, f64), String> {
        let (row, wall) = pt.once("ib_write_lat", &["-s", "8", "-n", &n.to_string()])?;
        let avg = row.get(T_AVG).copied().ok_or(format!("ib_write_lat: no t_avg in {row:?}"))?;
        Ok((wall.as_secs_f64(), avg))
    };
    let (a, b) = CLOCK_ITERS;
    let ((wa, ta), (wb, tb)) = (run(a)?, run(b)?);
    let extra = (b - a) as f64;
    Ok(Clock {
        walls: (wa, wb),
        avgs: (ta, tb),
        // A client iteration is one round trip: half of it is one way, as t_avg is.
        wall_us: (wb - wa) * 1e6 / extra / 2.0,
        reported_us: (b as f64 * tb - a as f64 * ta) / extra,
    })
}

impl Clock {
    fn line(&self) -> String {
        let (a, b) = CLOCK_ITERS;
        // The ratio is wall / perftest: above 1, perftest's clock runs slow.
        format!(
            "# perftest clock check: ib_write_lat -n {b} minus -n {a}, one way per iteration: \
             wall {} us, perftest {} us, ratio {}",
            fixed(self.wall_us, 1),
            fixed(self.reported_us, 1),
            fixed(ratio(self.wall_us, self.reported_us), 3)
        )
    }
}

/// The finite numbers of `v`: a NaN is a round with no result.
fn finite(v: &[f64]) -> impl Iterator<Item = f64> + Clone + '_ {
    v.iter().copied().filter(|x| x.is_finite())
}

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = finite(v).collect();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn mean(v: &[f64]) -> f64 {
    let n = finite(v).count();
    if n == 0 { f64::NAN } else { finite(v).sum::<f64>() / n as f64 }
}

/// The smallest and the largest number; NaN for both when there is none.
fn spread(v: &[f64]) -> (f64, f64) {
    let f = finite(v);
    match f.clone().next() {
        None => (f64::NAN, f64::NAN),
        Some(x) => (f.clone().fold(x, f64::min), f.fold(x, f64::max)),
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// One latency run's numbers, in us: the median (p50) and the mean half round trip, and the
/// fastest. perftest's are its t_typical, t_avg and t_min.
struct Lat {
    p50: f64,
    avg: f64,
    min: f64,
}

/// One latency measurement's numbers, one per round.
#[derive(Default)]
struct LatSeries {
    p50: Vec<f64>,
    avg: Vec<f64>,
    min: Vec<f64>,
}

impl LatSeries {
    fn push(&mut self, l: Lat) {
        self.p50.push(l.p50);
        self.avg.push(l.avg);
        self.min.push(l.min);
    }
}

/// Every round's bandwidth numbers of one size, in Gb/s.
#[derive(Default)]
struct BwRow {
    size: usize,
    /// Requests in flight each way.
    window: usize,
    ours: Vec<f64>,
    /// What the receiver timed: bytes and seconds.
    bytes: Vec<f64>,
    secs: Vec<f64>,
    write: Vec<f64>,
    send: Vec<f64>,
    /// `ib_write_bw -q lanes`, when the ranks use more than one lane.
    write_q: Vec<f64>,
}

/// Every round's latency numbers of one size.
#[derive(Default)]
struct LatRow {
    size: usize,
    simple: LatSeries,
    ll: LatSeries,
    write: LatSeries,
    send: LatSeries,
}

/// What every measurement of a run shares.
struct Plan<'a> {
    o: &'a Opts,
    /// perftest's devices, when it runs.
    ports: Option<(&'a Port, &'a Port)>,
    /// The ranks' lanes (`NCCL_IB_QPS_PER_CONNECTION`).
    lanes: usize,
    warm: f64,
    pt_secs: u64,
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
    // The rank processes inherit this environment, so they read the same lanes.
    let lanes = ferroce::config::Config::from_env().map(|c| c.qps_per_conn).unwrap_or(1);
    let plan = Plan {
        o,
        ports: ports.as_ref().map(|(tx, rx)| (tx, rx)),
        lanes,
        warm: warmup(o.seconds),
        pt_secs: o.seconds.round().max(1.0) as u64,
    };

    let clock = match plan.ports {
        Some((tx, rx)) if o.clock_check => match clock_check(tx, rx) {
            Ok(c) => {
                eprintln!("{}", c.line());
                Some(c)
            }
            Err(e) => {
                eprintln!("# perftest clock check: failed: {e}");
                None
            }
        },
        _ => None,
    };
    let sizes = |all: &[usize]| all.iter().copied().filter(|&s| s <= o.max_size).collect();
    let sizes: (Vec<usize>, Vec<usize>) = (sizes(&BW_SIZES), sizes(&LAT_SIZES));
    let mut bw: Vec<BwRow> = sizes
        .0
        .iter()
        .map(|&size| BwRow { size, window: window(size, o.depth), ..BwRow::default() })
        .collect();
    let mut lat: Vec<LatRow> =
        sizes.1.iter().map(|&size| LatRow { size, ..LatRow::default() }).collect();
    for round in 1..=o.rounds {
        let tag = format!("# round {round}/{}", o.rounds);
        for row in &mut bw {
            bw_size(&mut pair, &plan, &tag, row)?;
        }
        for row in &mut lat {
            lat_size(&mut pair, &plan, &tag, row)?;
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
    let header = Header { plan: &plan, tx, rx, clock };
    if o.json {
        print_json(&header, &bw, &lat)
    } else {
        print_table(&header, &bw, &lat)
    }
    Ok(())
}

/// One size's bandwidth in one round: ferroce, then each perftest reference.
fn bw_size(pair: &mut Pair, plan: &Plan, tag: &str, row: &mut BwRow) -> Result<(), String> {
    let (o, size) = (plan.o, row.size);
    let (bytes, secs) = pair.bw(size, row.window, o.seconds, plan.warm, None)?;
    let gbps = bytes * 8.0 / secs / 1e9;
    eprintln!("{tag}: ferroce bandwidth {size:>8} B: {gbps:.4} Gb/s ({bytes} B in {secs:.2} s)");
    row.ours.push(gbps);
    row.bytes.push(bytes);
    row.secs.push(secs);
    let Some((tx, rx)) = plan.ports else { return Ok(()) };
    let (s, d, q) = (size.to_string(), plan.pt_secs.to_string(), plan.lanes.to_string());
    let args = ["-s", &s, "-D", &d, "--report_gbits"];
    let pt = Perftest { tx, rx, limit: 60 + 4 * plan.pt_secs, label: "BW average[Gb/sec]" };
    let qn = format!("ib_write_bw -q {q}");
    // As many bytes in flight over the N queue pairs as ferroce has over its N lanes: perftest's
    // default of 128 messages per queue pair overruns Soft-RoCE with N of them (at 1 MiB and
    // up nothing completes in the measured time).
    let t = (row.window / plan.lanes).max(1).to_string();
    let mut runs = vec![("ib_write_bw", "ib_write_bw", args.to_vec(), &mut row.write)];
    runs.push(("ib_send_bw", "ib_send_bw", args.to_vec(), &mut row.send));
    if plan.lanes > 1 {
        let extra = [&args[..], &["-q", &q, "-t", &t]].concat();
        runs.push(("ib_write_bw", &qn, extra, &mut row.write_q));
    }
    for (tool, name, args, into) in runs {
        let v = pt.run(tool, &args, &[BW_AVERAGE])?[0];
        eprintln!("{tag}: {name:<17} {size:>8} B: {v:.4} Gb/s");
        into.push(v);
    }
    Ok(())
}

/// One size's latency in one round: ferroce's Simple and LL, then each perftest reference.
fn lat_size(pair: &mut Pair, plan: &Plan, tag: &str, row: &mut LatRow) -> Result<(), String> {
    let (o, size) = (plan.o, row.size);
    let show = |what: &str, l: &Lat| {
        eprintln!(
            "{tag}: {what:<17} {size:>8} B: p50 {:.1} us, mean {:.1} us, min {:.1} us",
            l.p50, l.avg, l.min
        )
    };
    for (proto, into) in [(Proto::Simple, &mut row.simple), (Proto::Ll, &mut row.ll)] {
        let l = pair.lat(size, (o.iters, o.iters / 10), o.depth, proto)?;
        show(&format!("ferroce {}", proto.word()), &l);
        into.push(l);
    }
    let Some((tx, rx)) = plan.ports else { return Ok(()) };
    let (s, n) = (size.to_string(), o.iters.to_string());
    let pt = Perftest { tx, rx, limit: 120, label: "t_avg" };
    for (tool, into) in [("ib_write_lat", &mut row.write), ("ib_send_lat", &mut row.send)] {
        let v = pt.run(tool, &["-s", &s, "-n", &n], &[T_TYPICAL, T_AVG, T_MIN])?;
        let l = Lat { p50: v[0], avg: v[1], min: v[2] };
        show(tool, &l);
        into.push(l);
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
    plan: &'a Plan<'a>,
    tx: Dev<'a>,
    rx: Dev<'a>,
    clock: Option<Clock>,
}

fn range(v: &[f64], prec: usize) -> String {
    let (a, b) = spread(v);
    if a.is_finite() { format!("{}-{}", fixed(a, prec), fixed(b, prec)) } else { "-".into() }
}

/// A heading over groups of a table's columns: each `(columns, name)` spans that many columns
/// (the gaps between them included), right-aligned.
fn groups(t: &Table, spans: &[(usize, &str)]) -> String {
    let mut widths = Vec::with_capacity(spans.len());
    let mut cols = t.widths.iter();
    for &(n, _) in spans {
        let w: usize = cols.by_ref().take(n).sum();
        widths.push(w + (n - 1) * t.gap);
    }
    let names: Vec<&str> = spans.iter().map(|&(_, name)| name).collect();
    Table { widths: &widths, gap: t.gap }.line('#', &names)
}

fn print_table(h: &Header, bw: &[BwRow], lat: &[LatRow]) {
    let (plan, o) = (h.plan, h.plan.o);
    let hosts = if o.mode == Mode::Local { "one host" } else { "two hosts" };
    println!("# ferroce perf: plugin {} through ncclNet v12, two processes, {hosts}", o.plugin);
    println!(
        "#   rank 0 sends on {} (dev {}, {}), rank 1 receives on {} (dev {}, {})",
        h.tx.name, h.tx.index, h.tx.host, h.rx.name, h.rx.index, h.rx.host
    );
    println!("#   every receive checked for its length, the last of each run byte for byte");
    println!(
        "#   polled as NCCL's proxy: {} receives posted ahead, one irecv each; a pass posts, \
         then tests the",
        o.depth
    );
    println!(
        "#   oldest request of each direction once; yield after an idle pass and after every \
         {NCCL_APPENDOP_FREQ}th busy one"
    );
    if o.mode != Mode::Local {
        println!("#   perftest: skipped with two hosts (it needs both devices on one host)");
    } else if !o.perftest {
        println!("#   perftest: skipped (--no-perftest)");
    } else {
        println!("#   each size: ferroce, then at once perftest on the same devices (-F)");
    }
    println!(
        "#   {} round(s); a number is the median over the rounds, min-max their spread; \
         ratio: ferroce / perftest",
        o.rounds
    );
    println!("#   --json: every round's numbers, and each one's median, mean, min and max");
    if let Some(c) = &h.clock {
        println!("{}", c.line());
    }
    println!(
        "#   bandwidth: algbw on the receiver's clock, {} s per size after {:.2} s warm-up \
         (mean: ferroce's over the rounds),",
        o.seconds, plan.warm
    );
    println!(
        "#   {} receives posted ahead and as many sends in flight (fewer where that passes {} MiB: \
         {} at 8 MiB);",
        o.depth,
        WINDOW_BYTES >> 20,
        window(MAX, o.depth)
    );
    println!("#   perftest -D {} --report_gbits, BW average", plan.pt_secs);
    let q = plan.lanes > 1;
    if q {
        println!(
            "#   the ranks use {} lanes (NCCL_IB_QPS_PER_CONNECTION): also ib_write_bw -q {} -t W/{} \
             (W: ferroce's window, so both have the same bytes in flight)",
            plan.lanes, plan.lanes, plan.lanes
        );
    }
    let widths: &[usize] = &[9, 9, 9, 15, 11, 15, 10, 5, 11, 6];
    let t = Table { widths: if q { widths } else { &widths[..8] }, gap: 2 };
    let qn = format!("-q {}", plan.lanes);
    println!(
        "{}",
        t.line(
            '#',
            &[
                "size",
                "ferroce",
                "mean",
                "min-max",
                "ib_write_bw",
                "min-max",
                "ib_send_bw",
                "ratio",
                "ib_write_bw",
                "ratio"
            ]
        )
    );
    let unit = "(Gb/s)";
    let units = ["(B)", unit, unit, unit, unit, unit, unit, "", &format!("{qn} {unit}"), &qn];
    println!("{}", t.line('#', &units).trim_end());
    for r in bw {
        let (m, w, wq) = (median(&r.ours), median(&r.write), median(&r.write_q));
        let cells = [
            r.size.to_string(),
            fixed(m, 4),
            fixed(mean(&r.ours), 4),
            range(&r.ours, 4),
            fixed(w, 4),
            range(&r.write, 4),
            fixed(median(&r.send), 4),
            fixed(ratio(m, w), 2),
            fixed(wq, 4),
            fixed(ratio(m, wq), 2),
        ];
        println!("{}", t.line(' ', &cells));
    }
    println!();
    println!(
        "#   latency: ping-pong, half the round trip; {} iterations after {} warm-up, {} \
         receives posted ahead;",
        o.iters,
        o.iters / 10,
        o.depth
    );
    println!(
        "#   Simple: receives complete through the plugin; LL: optional receives, arrival seen \
         by a flag in the data"
    );
    println!(
        "#   p50 and mean: of a round's samples (perftest -n {}: t_typical and t_avg); min: the \
         fastest of all rounds",
        o.iters
    );
    let t = Table { widths: &[7, 7, 7, 11, 6, 7, 7, 7, 7, 7, 7, 5, 5, 6, 7], gap: 1 };
    let spans = [
        (1, ""),
        (4, "ferroce Simple"),
        (2, "ferroce LL"),
        (2, "ib_write_lat"),
        (2, "ib_send_lat"),
        (4, "ratio vs ib_write_lat"),
    ];
    println!("{}", groups(&t, &spans));
    let head = [
        "size",
        "p50",
        "mean",
        "p50 min-max",
        "min",
        "p50",
        "mean",
        "p50",
        "mean",
        "p50",
        "mean",
        "p50",
        "mean",
        "LL p50",
        "LL mean",
    ];
    println!("{}", t.line('#', &head));
    let us = "(us)";
    let units = ["(B)", us, us, us, us, us, us, us, us, us, us, "", "", "", ""];
    println!("{}", t.line('#', &units).trim_end());
    for r in lat {
        let (p, a) = (median(&r.simple.p50), median(&r.simple.avg));
        let (lp, la) = (median(&r.ll.p50), median(&r.ll.avg));
        let (wp, wa) = (median(&r.write.p50), median(&r.write.avg));
        let cells = [
            r.size.to_string(),
            fixed(p, 1),
            fixed(a, 1),
            range(&r.simple.p50, 1),
            fixed(spread(&r.simple.min).0, 1),
            fixed(lp, 1),
            fixed(la, 1),
            fixed(wp, 1),
            fixed(wa, 1),
            fixed(median(&r.send.p50), 1),
            fixed(median(&r.send.avg), 1),
            fixed(ratio(p, wp), 2),
            fixed(ratio(a, wa), 2),
            fixed(ratio(lp, wp), 2),
            fixed(ratio(la, wa), 2),
        ];
        println!("{}", t.line(' ', &cells));
    }
}

/// `key`: every round's numbers; `key_median`, `key_mean`, `key_min`, `key_max`: over them.
fn put(m: &mut serde_json::Map<String, serde_json::Value>, key: &str, v: &[f64]) {
    let (lo, hi) = spread(v);
    m.insert(key.into(), json!(v));
    for (stat, x) in [("median", median(v)), ("mean", mean(v)), ("min", lo), ("max", hi)] {
        m.insert(format!("{key}_{stat}"), json!(x));
    }
}

/// Every round's numbers, as one JSON object; a number that was not measured is `null`.
fn print_json(h: &Header, bw: &[BwRow], lat: &[LatRow]) {
    let (plan, o) = (h.plan, h.plan.o);
    let bw: Vec<_> = bw
        .iter()
        .map(|r| {
            let mut m = serde_json::Map::new();
            m.insert("size".into(), json!(r.size));
            m.insert("window".into(), json!(r.window));
            put(&mut m, "ferroce_gbps", &r.ours);
            m.insert("ferroce_bytes".into(), json!(r.bytes));
            m.insert("ferroce_seconds".into(), json!(r.secs));
            put(&mut m, "ib_write_bw_gbps", &r.write);
            put(&mut m, "ib_send_bw_gbps", &r.send);
            let ours = median(&r.ours);
            m.insert("ratio".into(), json!(ratio(ours, median(&r.write))));
            if plan.lanes > 1 {
                put(&mut m, "ib_write_bw_q_gbps", &r.write_q);
                m.insert("ratio_q".into(), json!(ratio(ours, median(&r.write_q))));
            }
            serde_json::Value::Object(m)
        })
        .collect();
    let lat: Vec<_> = lat
        .iter()
        .map(|r| {
            let mut m = serde_json::Map::new();
            m.insert("size".into(), json!(r.size));
            let series = [
                ("ferroce", &r.simple),
                ("ferroce_ll", &r.ll),
                ("ib_write_lat", &r.write),
                ("ib_send_lat", &r.send),
            ];
            for (name, s) in series {
                put(&mut m, &format!("{name}_p50_us"), &s.p50);
                put(&mut m, &format!("{name}_mean_us"), &s.avg);
                put(&mut m, &format!("{name}_min_us"), &s.min);
            }
            let (wp, wa) = (median(&r.write.p50), median(&r.write.avg));
            for (name, s) in [("ratio", &r.simple), ("ll_ratio", &r.ll)] {
                m.insert(format!("{name}_p50"), json!(ratio(median(&s.p50), wp)));
                m.insert(format!("{name}_mean"), json!(ratio(median(&s.avg), wa)));
            }
            serde_json::Value::Object(m)
        })
        .collect();
    let clock = h.clock.as_ref().map(|c| {
        json!({
            "tool": "ib_write_lat -s 8",
            "iters": [CLOCK_ITERS.0, CLOCK_ITERS.1],
            "wall_seconds": [c.walls.0, c.walls.1],
            "t_avg_us": [c.avgs.0, c.avgs.1],
            "wall_us_per_iter": c.wall_us,
            "perftest_us_per_iter": c.reported_us,
            "ratio": ratio(c.wall_us, c.reported_us),
        })
    });
    let dev = |d: &Dev| json!({"dev": d.index, "name": d.name, "host": d.host});
    out::print_json(&json!({
        "plugin": o.plugin,
        "abi": 12,
        "sender": dev(&h.tx),
        "receiver": dev(&h.rx),
        "rounds": o.rounds,
        "depth": o.depth,
        "lanes": plan.lanes,
        "yield_busy_every": NCCL_APPENDOP_FREQ,
        "seconds": o.seconds,
        "warmup_seconds": plan.warm,
        "perftest": o.perftest,
        "perftest_seconds": plan.pt_secs,
        "clock_check": clock,
        "lat_iters": o.iters,
        "lat_warmup": o.iters / 10,
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
        let o = parse("--rounds 2 --seconds 0.5 --json --no-perftest --dev-send 2 --dev-recv 3")
            .unwrap();
        let devs = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            (o.mode, o.rounds, o.seconds, o.json, o.perftest, o.clock_check, o.devs),
            (Mode::Local, 2, 0.5, true, false, false, devs("2", "3"))
        );
        let o = parse("--plugin /x/libnccl-net-ferroce.so --dev-recv rxe1").unwrap();
        assert_eq!(
            (o.plugin.as_str(), o.rounds, o.seconds, o.devs, o.perftest),
            ("/x/libnccl-net-ferroce.so", 5, 2.0, devs("0", "rxe1"), true)
        );
        assert_eq!((o.depth, o.clock_check, o.iters), (8, true, 1000));
        let o = parse("--depth 1 --no-clock-check").unwrap();
        assert_eq!((o.depth, o.clock_check, o.perftest), (1, false, true));
        assert_eq!(parse("--depth 32").unwrap().depth, 32);
        let o = parse("--listen --dev rxe1 --port 7000").unwrap();
        assert_eq!((o.mode, o.devs.1, o.port), (Mode::Listen, "rxe1".into(), 7000));
        let o = parse("--connect h:1 --rounds 1 --json --depth 4").unwrap();
        assert_eq!(
            (o.mode, o.devs.0, o.perftest, o.clock_check, o.depth),
            (Mode::Connect("h:1".into()), "0".into(), false, false, 4)
        );
        for bad in [
            "--rounds",
            "--rounds 0",
            "--rounds x",
            "--seconds 0",
            "--seconds nan",
            "--depth 0",
            "--depth 33",
            "--depth",
            "--depth -1",
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
            "--listen --depth 4",
            "--listen --no-clock-check",
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
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        assert_eq!(mean(&[f64::NAN, 4.0, 2.0]), 3.0);
        assert!(mean(&[f64::NAN]).is_nan());
        assert_eq!(spread(&[2.0, f64::NAN, 5.0, 1.0]), (1.0, 5.0));
        assert!(spread(&[f64::NAN]).0.is_nan());
        assert_eq!(range(&[], 1), "-");
        assert_eq!(range(&[2.25, 1.0], 1), "1.0-2.2");
        assert!(ratio(1.0, 0.0).is_nan());
        assert_eq!(ratio(3.0, 2.0), 1.5);
    }

    #[test]
    fn the_bandwidth_window_is_the_depth_within_32_mib() {
        let sizes = [8, 1 << 20, 4 << 20, 8 << 20, 32 << 20];
        assert_eq!(sizes.map(|s| window(s, 8)), [8, 8, 8, 4, 2]);
        assert_eq!(sizes.map(|s| window(s, 32)), [32, 32, 8, 4, 2]);
        assert_eq!(sizes.map(|s| window(s, 1)), [1, 1, 1, 1, 1]);
    }

    #[test]
    fn ll_flags_never_repeat_back_to_back_nor_look_like_a_cleared_buffer() {
        for i in 0..2000 {
            assert_ne!(flag(i), 0, "{i}");
            assert_ne!(flag(i), flag(i + 1), "{i}");
        }
        assert_eq!((flag(0), flag(254), flag(255)), (1, 255, 1));
    }

    #[test]
    fn protocols_cross_the_command_line_by_name() {
        for p in [Proto::Simple, Proto::Ll] {
            assert_eq!(Proto::parse(Some(p.word())), Ok(p));
        }
        assert!(Proto::parse(Some("LL128")).is_err());
        assert!(Proto::parse(None).is_err());
    }

    #[test]
    fn group_headings_span_their_columns() {
        let t = Table { widths: &[4, 3, 3, 5], gap: 1 };
        let g = groups(&t, &[(1, ""), (2, "ab"), (1, "c")]);
        assert_eq!(g, "#         ab     c");
        assert_eq!(g.len(), t.line(' ', &["1", "2", "3", "4"]).len());
    }

    #[test]
    fn json_series_carry_rounds_and_their_statistics() {
        let mut m = serde_json::Map::new();
        put(&mut m, "x", &[3.0, f64::NAN, 1.0]);
        let v = serde_json::Value::Object(m).to_string();
        assert_eq!(
            v,
            r#"{"x":[3.0,null,1.0],"x_median":2.0,"x_mean":2.0,"x_min":1.0,"x_max":3.0}"#
        );
        let mut m = serde_json::Map::new();
        put(&mut m, "y", &[]);
        let v = serde_json::Value::Object(m).to_string();
        assert_eq!(v, r#"{"y":[],"y_median":null,"y_mean":null,"y_min":null,"y_max":null}"#);
    }
}
