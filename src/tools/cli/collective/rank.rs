//! One rank of `ferroce collective`: its channels connected around the ring through the
//! rendezvous directory, its buffers registered, and every size run and timed, rank 0 printing
//! nccl-tests' table.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferroce_tools::buffer::HostBuf;
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};
use ferroce_tools::loader::{ECHO, Library, flush_log};
use ferroce_tools::out::Table;
use ferroce_tools::wait::Stall;

use super::ring::{Plan, expected, input, plan};
use super::{Args, COMM_ID, Coll, SETUP, SLICE, STALL, STEPS};

/// One channel's comms and what its peers are called in messages.
struct Channel {
    send: Ptr,
    recv: Ptr,
    /// "rank 2 (198.18.0.3, rxe2)": the next rank, which this channel sends to.
    next: String,
    /// The previous rank, which this channel receives from.
    prev: String,
}

/// Writes `text` to `path` atomically (a peer never reads half a handle).
fn publish(path: &Path, text: &str) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The handle and description rank `rank` published for channel `ch`, once it exists.
fn lookup(dir: &Path, rank: usize, ch: usize) -> Result<Option<([u8; 128], String)>, String> {
    let path = dir.join(format!("rank{rank}.ch{ch}"));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let (h, who) = text.trim().split_once(' ').unwrap_or((text.trim(), "?"));
    let h = from_hex(h).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some((h, format!("rank {rank} ({who})"))))
}

pub fn run_rank(o: &Args, rank: usize) -> Result<(), String> {
    let r = rank_inner(o, rank);
    flush_log();
    r.map_err(|e| format!("rank {rank}: {e}"))
}

fn rank_inner(o: &Args, rank: usize) -> Result<(), String> {
    let n = o.nranks.ok_or("no --nranks")?;
    let dir = o.rendezvous.as_deref().ok_or("no --rendezvous")?;
    ECHO.store(false, Ordering::Relaxed);
    let lib = Library::open_like_nccl(&o.plugin())?;
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(COMM_ID)?;
    let (dev, name) = drv.resolve(&o.dev)?;
    let t0 = Instant::now();
    let mut listens = Vec::new();
    for ch in 0..o.channels {
        let (handle, listen) = drv.listen(ctx, dev)?;
        let addr = ferroce_core::setup::wire::Handle::decode(&handle)
            .map_err(|e| format!("the plugin's own handle: {e}"))?
            .addr;
        let path = dir.join(format!("rank{rank}.ch{ch}"));
        if path.exists() {
            return Err(format!("{} exists: use a fresh --rendezvous directory", path.display()));
        }
        publish(&path, &format!("{} {}, {name}\n", to_hex(&handle), addr.ip()))?;
        listens.push(listen);
    }
    let chans = connect_ring(&drv, ctx, dev, dir, rank, n, &listens)?;
    for l in listens {
        drv.close(Close::Listen, l)?;
    }
    println!("# connected in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    flush_log();
    let result = sizes(o, &drv, &chans, rank, n, &name);
    // Teardown runs whatever failed; the first error is the one returned.
    let mut result = result;
    for c in &chans {
        for e in [drv.close(Close::Send, c.send), drv.close(Close::Recv, c.recv)] {
            if let (Err(e), Ok(())) = (e, &result) {
                result = Err(format!("teardown: {e}"));
            }
        }
    }
    if let (Err(e), Ok(())) = (drv.finalize(ctx), &result) {
        result = Err(format!("finalize: {e}"));
    }
    result
}

/// Connects every channel's send comm to the next rank and accepts its receive comm from the
/// previous one, all at once and from one thread, as NCCL's proxy does.
fn connect_ring(
    drv: &Driver,
    ctx: Ptr,
    dev: c_int,
    dir: &Path,
    rank: usize,
    n: usize,
    listens: &[Ptr],
) -> Result<Vec<Channel>, String> {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let c = listens.len();
    let mut peer: Vec<Option<([u8; 128], String)>> = vec![None; c];
    let mut send: Vec<Option<Ptr>> = vec![None; c];
    let mut recv: Vec<Option<Ptr>> = vec![None; c];
    let mut prev_who: Vec<Option<String>> = vec![None; c];
    let deadline = Instant::now() + SETUP;
    loop {
        let mut moved = false;
        for ch in 0..c {
            if peer[ch].is_none() {
                peer[ch] = lookup(dir, next, ch)?;
            }
            if prev_who[ch].is_none() {
                prev_who[ch] = lookup(dir, prev, ch)?.map(|p| p.1);
            }
            if let (None, Some((h, who))) = (send[ch], peer[ch].as_mut()) {
                send[ch] = drv
                    .connect(ctx, dev, h)
                    .map_err(|e| format!("channel {ch}: connecting to {who}: {e}"))?;
                moved |= send[ch].is_some();
            }
            if recv[ch].is_none() {
                recv[ch] = drv
                    .accept(listens[ch])
                    .map_err(|e| format!("channel {ch}: accepting from rank {prev}: {e}"))?;
                moved |= recv[ch].is_some();
            }
        }
        if send.iter().chain(&recv).all(Option::is_some) {
            break;
        }
        if Instant::now() > deadline {
            let missing: Vec<String> = (0..c)
                .flat_map(|ch| {
                    let s = send[ch].is_none().then(|| format!("channel {ch} send to rank {next}"));
                    let r = recv[ch]
                        .is_none()
                        .then(|| format!("channel {ch} receive from rank {prev}"));
                    s.into_iter().chain(r)
                })
                .collect();
            return Err(format!("not connected within {SETUP:?}: {}", missing.join(", ")));
        }
        if !moved {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok((0..c)
        .map(|ch| Channel {
            send: send[ch].expect("checked above"),
            recv: recv[ch].expect("checked above"),
            next: peer[ch].as_ref().map_or(format!("rank {next}"), |p| p.1.clone()),
            prev: prev_who[ch].clone().unwrap_or(format!("rank {prev}")),
        })
        .collect())
}

/// One channel's progress through its plan.
struct Run<'p> {
    plan: &'p Plan,
    /// Sends posted so far; the oldest `sends.len()` of them are still in flight.
    sent: usize,
    sends: VecDeque<Ptr>,
    /// Receives posted so far; the oldest `recvs.len()` of them are still in flight.
    posted: usize,
    recvs: VecDeque<(Ptr, usize)>,
    /// Staging slots not in use by a posted reduce receive.
    free: Vec<usize>,
}

impl Run<'_> {
    fn send_done(&self) -> usize {
        self.sent - self.sends.len()
    }

    fn recv_done(&self) -> usize {
        self.posted - self.recvs.len()
    }
}

/// The working buffer and the staging slots, registered with every channel's comms; every
/// registration made is undone when this drops, also after a failure half-way.
struct Buffers<'d, 'a> {
    drv: &'d Driver<'a>,
    /// The working buffer, `count` floats.
    data: HostBuf,
    /// Per channel: [`STEPS`] slots of [`SLICE`] bytes that reduce receives land in.
    staging: Vec<HostBuf>,
    /// Per channel: the data buffer's handle with the send and the receive comm, and each
    /// staging slot's with the receive comm.
    mhs: Vec<(Ptr, Ptr, Vec<Ptr>)>,
    /// Every (comm, handle) registered, in order.
    regs: Vec<(Ptr, Ptr)>,
}

impl<'d, 'a> Buffers<'d, 'a> {
    fn new(drv: &'d Driver<'a>, chans: &[Channel], count: usize) -> Result<Self, String> {
        let mut b = Buffers {
            drv,
            data: HostBuf::new(count * 4),
            staging: (0..chans.len()).map(|_| HostBuf::new(STEPS * SLICE)).collect(),
            mhs: Vec::new(),
            regs: Vec::new(),
        };
        for (ch, c) in chans.iter().enumerate() {
            let (ptr, len) = (b.data.ptr(), b.data.len());
            let smh = b.reg(c.send, ptr, len)?;
            let rmh = b.reg(c.recv, ptr, len)?;
            let slots = (0..STEPS)
                .map(|s| b.reg(c.recv, b.staging[ch].at(s * SLICE), SLICE))
                .collect::<Result<Vec<_>, _>>()?;
            b.mhs.push((smh, rmh, slots));
        }
        Ok(b)
    }

    fn reg(&mut self, comm: Ptr, ptr: *mut u8, len: usize) -> Result<Ptr, String> {
        let mh = self.drv.reg_mr(comm, ptr, len)?;
        self.regs.push((comm, mh));
        Ok(mh)
    }
}

impl Drop for Buffers<'_, '_> {
    fn drop(&mut self) {
        for (comm, mh) in self.regs.drain(..).rev() {
            if let Err(e) = self.drv.dereg_mr(comm, mh) {
                eprintln!("deregMr: {e}");
            }
        }
    }
}

/// nccl-tests' columns: the mark and the size, count, type, redop, root, time, algbw, busbw,
/// #wrong.
const TABLE: Table = Table { widths: &[13, 12, 8, 6, 6, 10, 9, 9, 6], gap: 1 };

/// Every size of the collective, with the table on rank 0.
fn sizes(
    o: &Args,
    drv: &Driver,
    chans: &[Channel],
    rank: usize,
    n: usize,
    dev: &str,
) -> Result<(), String> {
    let coll = o.coll;
    let mut b = Buffers::new(drv, chans, coll.counts(o.max, n).0.max(1))?;
    if rank == 0 {
        print_header(o, n, chans.len(), dev);
    }
    let (mut wrong_total, mut busbw_sum, mut rows) = (0usize, 0.0, 0usize);
    let mut size = o.min;
    while size <= o.max {
        let (count, shown) = coll.counts(size, n);
        if shown > 0 {
            let (us, wrong) = one_size(o, drv, chans, &mut b, rank, n, count)?;
            wrong_total += wrong;
            let bytes = count * 4;
            let algbw = bytes as f64 / us / 1e3;
            let busbw = algbw * coll.bus_factor(n);
            busbw_sum += busbw;
            rows += 1;
            if rank == 0 {
                let wrong = if o.check != 0 { wrong.to_string() } else { "N/A".into() };
                let redop = if coll == Coll::AllGather { "none" } else { "sum" };
                let cells = [
                    bytes.to_string(),
                    shown.to_string(),
                    "float".into(),
                    redop.into(),
                    "-1".into(),
                    format!("{us:.1}"),
                    format!("{algbw:.4}"),
                    format!("{busbw:.4}"),
                    wrong,
                ];
                println!("{}", TABLE.line(' ', &cells));
            } else if wrong > 0 {
                eprintln!("rank {rank}: size {bytes}: {wrong} wrong elements");
            }
            std::io::stdout().flush().map_err(|e| e.to_string())?;
            flush_log();
        }
        size = size.saturating_mul(o.factor);
    }
    if rank == 0 {
        println!(
            "# Out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {:.4}", busbw_sum / rows.max(1) as f64);
    }
    if wrong_total > 0 {
        return Err(format!("{wrong_total} wrong elements"));
    }
    Ok(())
}

/// Rank 0's lines above the table, as nccl-tests prints them.
fn print_header(o: &Args, n: usize, chans: usize, dev: &str) {
    println!(
        "# ferroce collective {}: {n} ranks, {chans} channels, rank 0 on {dev}",
        o.coll.name()
    );
    println!(
        "# slices of {} KiB, up to {STEPS} in flight per channel; {} warm-up and {} timed iterations per size",
        SLICE >> 10,
        o.warmup,
        o.iters
    );
    println!("#");
    let head = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"];
    println!("{}", TABLE.line('#', &head));
    let units = ["(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""];
    println!("{}", TABLE.line('#', &units));
}

/// One size of `count` elements: the warm-up, the timed iterations and (with `-c`) one more,
/// checked. Returns the time per iteration in us and the number of wrong elements.
fn one_size(
    o: &Args,
    drv: &Driver,
    chans: &[Channel],
    b: &mut Buffers,
    rank: usize,
    n: usize,
    count: usize,
) -> Result<(f64, usize), String> {
    let coll = o.coll;
    let plans: Vec<Plan> =
        (0..chans.len()).map(|ch| plan(coll, count, n, rank, ch, chans.len())).collect();
    let fill = |d: &mut [f32]| {
        d.iter_mut().enumerate().for_each(|(i, x)| *x = input(coll, count, n, rank, i))
    };
    fill(&mut b.data.floats_mut()[..count]);
    for _ in 0..o.warmup {
        once(drv, chans, &plans, b)?;
    }
    let t = Instant::now();
    for _ in 0..o.iters {
        once(drv, chans, &plans, b)?;
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
    if o.check == 0 {
        return Ok((us, 0));
    }
    fill(&mut b.data.floats_mut()[..count]);
    once(drv, chans, &plans, b)?;
    let got = b.data.floats_mut();
    let wrong = (0..count)
        .filter(|&i| expected(coll, count, n, rank, i).is_some_and(|e| got[i] != e))
        .count();
    Ok((us, wrong))
}

/// One collective on every channel, driven from this thread until all of it is done.
fn once(drv: &Driver, chans: &[Channel], plans: &[Plan], b: &mut Buffers) -> Result<(), String> {
    let mut runs: Vec<Run> = plans
        .iter()
        .map(|p| Run {
            plan: p,
            sent: 0,
            sends: VecDeque::new(),
            posted: 0,
            recvs: VecDeque::new(),
            free: (0..STEPS).rev().collect(),
        })
        .collect();
    let mut stall = Stall::default();
    loop {
        let mut moved = false;
        let mut done = true;
        for (ch, (run, c)) in runs.iter_mut().zip(chans).enumerate() {
            moved |= run.receive(drv, c, ch, b)?;
            moved |= run.send(drv, c, ch, b)?;
            done &=
                run.send_done() == run.plan.sends.len() && run.recv_done() == run.plan.recvs.len();
        }
        if done {
            return Ok(());
        }
        if moved {
            stall.moved();
        } else if stall.idle(STALL) {
            let pending: Vec<String> = runs
                .iter()
                .zip(chans)
                .enumerate()
                .map(|(ch, (r, c))| {
                    format!(
                        "channel {ch}: {}/{} sends to {}, {}/{} receives from {}",
                        r.send_done(),
                        r.plan.sends.len(),
                        c.next,
                        r.recv_done(),
                        r.plan.recvs.len(),
                        c.prev
                    )
                })
                .collect();
            return Err(format!("no progress for {STALL:?}: {}", pending.join("; ")));
        }
    }
}

impl Run<'_> {
    /// Posts receives in order, up to [`STEPS`] ahead (a reduce needs a free staging slot),
    /// and completes the finished ones in order, a reduce adding its slot into the buffer.
    /// True if anything moved.
    fn receive(
        &mut self,
        drv: &Driver,
        c: &Channel,
        ch: usize,
        b: &mut Buffers,
    ) -> Result<bool, String> {
        let (rmh, slots) = (b.mhs[ch].1, &b.mhs[ch].2);
        let p = self.plan;
        let fail = |e: String| format!("channel {ch}: receiving from {}: {e}", c.prev);
        let mut moved = false;
        while self.posted < p.recvs.len() && self.recvs.len() < STEPS {
            let (s, reduce) = p.recvs[self.posted];
            let (ptr, mh, slot) = if reduce {
                let Some(&slot) = self.free.last() else { break };
                (b.staging[ch].at(slot * SLICE), slots[slot], slot)
            } else {
                // In place. An earlier step's send of this range may not have reported its
                // completion yet, but its data has left: what lands here was reduced from it
                // by the ranks after us.
                (b.data.at(s.off * 4), rmh, usize::MAX)
            };
            let Some(q) =
                drv.irecv(c.recv, &[ptr], &[s.len * 4], &[0], &[mh], false).map_err(fail)?
            else {
                break;
            };
            if reduce {
                self.free.pop();
            }
            self.recvs.push_back((q, slot));
            self.posted += 1;
            moved = true;
        }
        while let Some(&(q, slot)) = self.recvs.front() {
            let Some(got) = drv.test(q).map_err(fail)? else { break };
            let (s, reduce) = p.recvs[self.recv_done()];
            if got[0] as usize != s.len * 4 {
                return Err(fail(format!("received {} bytes, expected {}", got[0], s.len * 4)));
            }
            if reduce {
                // The slot holds the completed receive of `s.len` floats. No request uses it or
                // this range of the data: a slot is reused only after this, and this range is
                // sent on only by a later step, whose send waits for this receive.
                let src = &b.staging[ch].floats_mut()[slot * SLICE / 4..][..s.len];
                let dst = &mut b.data.floats_mut()[s.off..][..s.len];
                dst.iter_mut().zip(src).for_each(|(d, x)| *d += x);
                self.free.push(slot);
            }
            self.recvs.pop_front();
            moved = true;
        }
        Ok(moved)
    }

    /// Posts sends in order, up to [`STEPS`] in flight, each once the slice it forwards is
    /// here, and completes the finished ones. True if anything moved.
    fn send(&mut self, drv: &Driver, c: &Channel, ch: usize, b: &Buffers) -> Result<bool, String> {
        let smh = b.mhs[ch].0;
        let p = self.plan;
        let fail = |e: String| format!("channel {ch}: sending to {}: {e}", c.next);
        let mut moved = false;
        while self.sent < p.sends.len() && self.sends.len() < STEPS {
            let (s, dep) = p.sends[self.sent];
            if dep.is_some_and(|d| d >= self.recv_done()) {
                break;
            }
            let ptr = b.data.at(s.off * 4);
            let Some(q) = drv.isend(c.send, ptr, s.len * 4, 0, smh).map_err(fail)? else { break };
            self.sends.push_back(q);
            self.sent += 1;
            moved = true;
        }
        while let Some(&q) = self.sends.front() {
            if drv.test(q).map_err(fail)?.is_none() {
                break;
            }
            self.sends.pop_front();
            moved = true;
        }
        Ok(moved)
    }
}
