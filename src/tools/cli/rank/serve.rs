//! One rank (see the [module docs](super)): a `ferroce perf-rank` child serving its
//! orchestrator over stdin and stdout, or the receiving rank of `ferroce perf --listen` serving
//! one `--connect` orchestrator over TCP.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use ferroce_tools::buffer::{HostBuf, pattern};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::from_hex;
use ferroce_tools::loader::{ECHO, Library, flush_log};
use ferroce_tools::proc::lines_of;
use ferroce_tools::rank::handle_line;
use ferroce_tools::wait::Stall;

use super::{COMM_ID, IDLE, MAX, Proto, STEP, WINDOW, num};
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

/// One rank's comms and registered buffers.
pub(super) struct Rank<'a> {
    io: Io,
    pub(super) drv: Driver<'a>,
    pub(super) ctx: Ptr,
    /// The plugin's index of this rank's device.
    pub(super) dev: c_int,
    send: Ptr,
    recv: Ptr,
    /// A request or listener one `C-...` command leaves for the next ([`super::cost`]).
    pub(super) pending: RefCell<Option<Ptr>>,
    /// The comm pairs `C-KEEP` made and keeps open: (send, recv).
    pub(super) kept: RefCell<Vec<(Ptr, Ptr)>>,
    /// Two separate buffers: a rank sends and receives at once in ping-pong. The send buffer
    /// holds the pattern every receive is checked against.
    sbuf: HostBuf,
    rbuf: HostBuf,
    smh: Ptr,
    rmh: Ptr,
}

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

pub fn rank(a: &RankArgs) -> Result<(), String> {
    run_rank(matches!(a.role, Role::Send), &a.plugin, &a.dev, |_, _| {
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
    io: impl FnOnce(&str, Result<SocketAddr, String>) -> Result<Io, String>,
) -> Result<(), String> {
    let role = if sender { "send" } else { "recv" };
    ECHO.store(false, Ordering::Relaxed);
    let mut chan = None;
    let r = (|| {
        let lib = Library::open_like_nccl(plugin)?;
        let drv = Driver::newest(&lib)?;
        let ctx = drv.init(COMM_ID)?;
        let (dev, name) = drv.resolve(dev)?;
        let (handle, listen) = drv.listen(ctx, dev)?;
        // Where ferroce listens (another plugin's handle is its own business).
        let addr = ferroce_core::setup::wire::Handle::decode(&handle)
            .map(|h| h.addr)
            .map_err(|e| format!("not ferroce's handle: {e}"));
        let io = &*chan.insert(io(&name, addr)?);
        io.say(&format!("{} {name} {dev}", handle_line(&handle)))?;
        // `PORT` (from `ferroce doctor --peer`) may come first: this port's facts, asked before
        // the connection so they arrive even where connecting fails.
        let line = loop {
            match io.next(STEP)? {
                l if l == "PORT" => {
                    io.say(&format!("PORT {}", crate::ports::port_facts(&name)?))?
                }
                l => break l,
            }
        };
        let peer = line.strip_prefix("PEER ").ok_or(format!("expected PEER: {line}"))?;
        let mut peer = from_hex(peer)?;
        let (send, recv) = drv.connect_both(ctx, dev, &mut peer, listen, STEP)?;
        drv.close(Close::Listen, listen)?;
        let (sbuf, rbuf) = (HostBuf::patterned(MAX, 0), HostBuf::new(MAX));
        let smh = drv.reg_mr(send, sbuf.ptr(), MAX)?;
        let rmh = drv.reg_mr(recv, rbuf.ptr(), MAX)?;
        let io = chan.take().ok_or("no channel")?;
        let pending = RefCell::new(None);
        let kept = RefCell::new(Vec::new());
        let r = Rank { io, drv, ctx, dev, send, recv, pending, kept, sbuf, rbuf, smh, rmh };
        r.io.say("READY")?;
        flush_log();
        let mut result = r.serve(sender);
        if let Err(e) = r.close_kept() {
            result = result.and(Err(e));
        }
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
        // The buffers are freed after their registrations (r's other fields drop here).
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
                Some(c) if c.starts_with("C-") => self.cost(c, &mut w, sender)?,
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
    pub(super) fn irecv(&self, size: usize, optional: bool) -> Result<Option<Ptr>, String> {
        self.drv.irecv(self.recv, &[self.rbuf.ptr()], &[size], &[0], &[self.rmh], optional)
    }

    pub(super) fn isend(&self, size: usize) -> Result<Option<Ptr>, String> {
        self.drv.isend(self.send, self.sbuf.ptr(), size, 0, self.smh)
    }

    /// Zeroes the receive buffer's first `size` bytes; only while no receive is posted.
    pub(super) fn clear(&self, size: usize) {
        self.rbuf.zero(0..size.min(MAX));
    }

    /// The last byte of the first `size` of the receive buffer, read afresh from memory: the
    /// NIC writes it behind the compiler's back. `size` is 1..=MAX.
    pub(super) fn last_received(&self, size: usize) -> u8 {
        self.rbuf.get(size - 1)
    }

    /// Writes the last byte of the first `size` of the send buffer (`size` is 1..=MAX); only
    /// while no send is in flight.
    pub(super) fn stamp(&self, size: usize, v: u8) {
        self.sbuf.set(size - 1, v);
    }

    /// The last message received must be the sender's pattern, byte for byte, except that an
    /// LL message ends with the flag `last` instead (the buffer was zeroed before the first
    /// receive was posted, so a message that never landed fails too). Only while no receive is
    /// posted.
    pub(super) fn verify(&self, size: usize, last: Option<u8>) -> Result<(), String> {
        let n = size.min(MAX);
        let want = |i: usize| match last {
            Some(f) if i + 1 == n => f,
            _ => pattern(0, i),
        };
        match self.rbuf.mismatch(0..n, want) {
            None => Ok(()),
            Some(i) => Err(format!("a {size}-byte message arrived corrupted at byte {i}")),
        }
    }

    /// A completed receive must carry the whole message.
    pub(super) fn check(size: usize, got: [c_int; 8]) -> Result<(), String> {
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
}

/// `ferroce perf --listen`: the receiving rank of a two-host run. It listens through the
/// plugin, offers a TCP control connection on the same address (printed as `HANDLE
/// HOST:PORT DEVICE`), and serves one `--connect` orchestrator as a `perf-rank recv` child
/// serves the single-host one.
pub fn listen(plugin: &str, dev: &str, port: u16) -> Result<(), String> {
    run_rank(false, plugin, dev, |name, plugin_addr| {
        let bind = SocketAddr::new(plugin_addr?.ip(), port);
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
