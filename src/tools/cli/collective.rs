//! `ferroce collective`: ring collectives over the plugin's C ABI, driven the way NCCL's proxy
//! drives a network plugin, with nccl-tests' output. A stand-in for nccl-tests where there are
//! no GPUs.
//!
//! Every rank is one process that loads the plugin with `dlopen` and drives its v12 ABI through
//! [`Driver`]. Per channel a rank listens once, publishes the handle in the rendezvous
//! directory, connects a send comm to the next rank's handle and accepts a receive comm from the
//! previous rank. A collective is a sequence of ring steps, each sending one block of the
//! buffer to the next rank and receiving one from the previous; the blocks are split between
//! the channels and cut into slices of at most [`SLICE`] bytes, with up to [`STEPS`] slices in
//! flight per channel and direction (NCCL's simple protocol: a 4 MiB buffer of 8 steps).
//! Reduce-scatter steps receive into a staging slot and add it to the buffer; all-gather steps
//! receive in place. A slice is sent on once the slice it depends on (the same slice of the
//! previous step) has arrived.
//!
//! Without `--rank` the command is the launcher: it starts all ranks on this host, rank `i`
//! bound to device `i` with `NCCL_IB_HCA`, prints rank 0's table and every rank's connect time,
//! and fails if any rank fails.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use ferroce_tools::buffer::HostBuf;
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};
use ferroce_tools::loader::{ECHO, Library, default_plugin, flush_log};
use ferroce_tools::out::Table;
use ferroce_tools::proc::Proc;
use ferroce_tools::wait::Stall;

/// Bytes per slice, NCCL's simple-protocol step (a 4 MiB buffer in 8 steps).
const SLICE: usize = 512 << 10;
/// Slices in flight per channel and direction: NCCL_STEPS.
const STEPS: usize = 8;
/// How long a rank waits for its peers' handles and for its comms to connect.
const SETUP: Duration = Duration::from_secs(120);
/// How long a collective may make no progress at all before the rank gives up: a backstop, the
/// plugin's own progress deadline and liveness probe fail a dead peer's requests first.
const STALL: Duration = Duration::from_secs(180);
/// How long the launcher lets the other ranks fail on their own (naming their dead peers)
/// after one failed, before it kills them: the plugin's liveness bound is seconds, but a rank
/// still connecting would otherwise wait out [`SETUP`].
const GRACE: Duration = Duration::from_secs(30);
/// NCCL passes the same communicator id to every rank's `init`.
const COMM_ID: u64 = 0xc011_ec71;

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Coll {
    #[value(name = "allreduce")]
    AllReduce,
    #[value(name = "allgather")]
    AllGather,
    #[value(name = "reducescatter")]
    ReduceScatter,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reducescatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor: what each link carries relative to the data size.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter => (n - 1.0) / n,
        }
    }

    /// Elements of the working buffer for a test of `bytes` bytes, and the count nccl-tests
    /// prints (all-gather and reduce-scatter: per rank).
    fn counts(self, bytes: usize, n: usize) -> (usize, usize) {
        let total = bytes / 4;
        match self {
            Coll::AllReduce => (total, total),
            Coll::AllGather | Coll::ReduceScatter => ((total / n) * n, total / n),
        }
    }
}

/// Ring collectives over N ranks, with nccl-tests' table and option letters
///
/// Without --rank: starts all ranks on this host, rank i on device i (NCCL_IB_HCA), and prints
/// rank 0's table. With --rank: runs one rank of a cluster whose ranks share --rendezvous.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The collective
    #[arg(value_enum)]
    coll: Coll,
    /// Ranks [default: the devices in FERROCE_VM_DEVS, else 2]
    #[arg(long, value_name = "N")]
    nranks: Option<usize>,
    /// Launcher: each rank's device [default: FERROCE_VM_DEVS, else indices 0..N-1]
    #[arg(long, value_name = "D0,D1,..", value_delimiter = ',')]
    devs: Option<Vec<String>>,
    /// Run rank R only (needs --rendezvous, a directory all ranks share)
    #[arg(long, value_name = "R")]
    rank: Option<usize>,
    /// Where ranks publish their handles [launcher: a fresh temporary directory]
    #[arg(long, value_name = "DIR")]
    rendezvous: Option<PathBuf>,
    /// --rank: this rank's device, a name or index [default: the first offered]
    #[arg(long, value_name = "D", default_value = "0")]
    dev: String,
    /// Smallest size (K, M, G suffixes)
    #[arg(short = 'b', long = "minbytes", value_name = "BYTES", default_value = "8", value_parser = size)]
    min: usize,
    /// Largest size
    #[arg(short = 'e', long = "maxbytes", value_name = "BYTES", default_value = "64M", value_parser = size)]
    max: usize,
    /// Size multiplier
    #[arg(short = 'f', long = "stepfactor", value_name = "F", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size
    #[arg(short = 'n', long = "iters", value_name = "N", default_value_t = 20)]
    iters: usize,
    /// Untimed iterations per size
    #[arg(short = 'w', long = "warmup_iters", value_name = "N", default_value_t = 5)]
    warmup: usize,
    /// 0: skip the data check after each size
    #[arg(short = 'c', long = "check", value_name = "0|1", default_value_t = 1)]
    check: usize,
    /// Channels, each a send and a receive comm
    #[arg(long, value_name = "C", default_value_t = 2)]
    channels: usize,
    /// The plugin as NCCL_NET_PLUGIN names it, or a path [default: libnccl-net-ferroce.so next
    /// to this program, else `ferroce`]
    #[arg(long, value_name = "NAME_OR_PATH")]
    plugin: Option<String>,
}

/// A byte count with an optional K, M or G suffix (powers of 1024), as nccl-tests takes them.
fn bytes(s: &str) -> Option<usize> {
    let (num, mul) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// [`bytes`] for clap.
fn size(s: &str) -> Result<usize, String> {
    bytes(s).ok_or_else(|| "not a size (a number with an optional K, M or G)".into())
}

impl Args {
    /// The rules across options that clap does not check.
    pub fn check(&self) -> Result<(), String> {
        let o = self;
        if o.factor < 2
            || o.min == 0
            || o.min > o.max
            || o.iters == 0
            || !(1..=32).contains(&o.channels)
        {
            return Err("need -f >= 2, 0 < -b <= -e, -n >= 1 and --channels 1..=32".into());
        }
        if o.max > 1 << 30 {
            return Err("-e is at most 1G".into());
        }
        if let Some(n) = o.nranks
            && !(2..=64).contains(&n)
        {
            return Err(format!("--nranks {n}: need 2..=64"));
        }
        match (o.rank, &o.rendezvous, o.nranks) {
            (Some(r), Some(_), Some(n)) if r < n => {}
            (Some(_), _, _) => return Err("--rank needs --nranks N > R and --rendezvous".into()),
            (None, _, _) => {}
        }
        if o.rank.is_some() && o.devs.is_some() {
            return Err("--devs is for the launcher; a rank takes --dev".into());
        }
        Ok(())
    }

    fn plugin(&self) -> String {
        self.plugin.clone().unwrap_or_else(default_plugin)
    }
}

pub fn collective(o: &Args) -> Result<(), String> {
    match o.rank {
        Some(rank) => run_rank(o, rank),
        None => launch(o),
    }
}

// ---------------------------------------------------------------------------------------------
// The launcher.

/// Starts every rank as a child process on this host and relays their output.
fn launch(o: &Args) -> Result<(), String> {
    let devs = launch_devs(o)?;
    let n = devs.len();
    let dir = std::env::temp_dir().join(format!("ferroce-collective-{}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _cleanup = RemoveDir(dir.clone());
    // Each Proc kills its rank when dropped: an early return leaves none running.
    let mut ranks = (0..n)
        .map(|rank| Proc::spawn(&format!("rank {rank}"), rank_cmd(o, rank, n, &dir, &devs[rank])))
        .collect::<Result<Vec<_>, _>>()?;
    let t0 = Instant::now();
    let (connect_ms, mut result) = watch(&mut ranks);
    for (rank, p) in ranks.iter_mut().enumerate() {
        let st = p.finish(Duration::from_secs(10));
        if result.is_ok() && !st.is_some_and(|s| s.success()) {
            result = Err(format!("rank {rank} failed ({st:?}); see its message above"));
        }
    }
    if result.is_ok() {
        let max = connect_ms.iter().copied().fold(0.0, f64::max);
        println!(
            "# Connect time: {max:.0} ms for the slowest of {n} ranks ({} comms each, {:.1} s in all)",
            2 * o.channels,
            t0.elapsed().as_secs_f64()
        );
    }
    result
}

/// Each rank's device: `--devs`, else the VM's devices (`FERROCE_VM_DEVS`), else indices.
fn launch_devs(o: &Args) -> Result<Vec<String>, String> {
    let vm_devs: Vec<String> = std::env::var("FERROCE_VM_DEVS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    Ok(match (&o.devs, o.nranks) {
        (Some(d), None) => d.clone(),
        (Some(d), Some(n)) if d.len() == n => d.clone(),
        (Some(d), Some(n)) => {
            return Err(format!("--devs names {} devices for {n} ranks", d.len()));
        }
        (None, Some(n)) if vm_devs.len() >= n => vm_devs[..n].to_vec(),
        (None, Some(n)) => (0..n).map(|i| i.to_string()).collect(),
        (None, None) if vm_devs.len() >= 2 => vm_devs,
        (None, None) => vec!["0".into(), "1".into()],
    })
}

/// `ferroce collective ... --rank R` for rank `rank` of `n` on `dev`, with the launcher's
/// options.
fn rank_cmd(o: &Args, rank: usize, n: usize, dir: &Path, dev: &str) -> Command {
    let mut cmd = Proc::me(&["collective", o.coll.name(), "--rank", &rank.to_string()]);
    cmd.args(["--nranks", &n.to_string(), "--rendezvous", &dir.to_string_lossy()]);
    for (flag, v) in [
        ("-b", o.min),
        ("-e", o.max),
        ("-f", o.factor),
        ("-n", o.iters),
        ("-w", o.warmup),
        ("-c", o.check),
        ("--channels", o.channels),
    ] {
        cmd.args([flag, &v.to_string()]);
    }
    cmd.args(["--plugin", &o.plugin()]);
    // Bound to its device the way a user binds an NCCL rank: NCCL_IB_HCA. A name is matched
    // exactly; an index needs every device visible.
    if dev.parse::<usize>().is_ok() {
        cmd.args(["--dev", dev]);
    } else {
        cmd.env("NCCL_IB_HCA", format!("={dev}")).args(["--dev", "0"]);
    }
    cmd
}

/// Relays rank 0's lines and collects every rank's connect time until all output has ended.
/// Ranks bound their own waits; after one fails, the rest get [`GRACE`] to fail on their own
/// (naming their dead peers) before the launcher gives up on them.
fn watch(ranks: &mut [Proc]) -> (Vec<f64>, Result<(), String>) {
    let mut open = vec![true; ranks.len()];
    let mut connect_ms = Vec::new();
    let mut failed: Option<Instant> = None;
    let mut result = Ok(());
    while open.contains(&true) {
        if failed.is_some_and(|t| t.elapsed() > GRACE) {
            let first = result.err().unwrap_or_default();
            let why = format!("{first}; the ranks still running {GRACE:?} later were killed");
            return (connect_ms, Err(why));
        }
        let mut moved = false;
        for (rank, p) in ranks.iter_mut().enumerate() {
            loop {
                match p.lines.try_recv() {
                    Ok(line) => {
                        moved = true;
                        match line.strip_prefix("# connected in ") {
                            Some(t) => connect_ms
                                .extend(t.split(' ').next().and_then(|ms| ms.parse::<f64>().ok())),
                            None if rank == 0 => println!("{line}"),
                            None => {}
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open[rank] = false;
                        break;
                    }
                }
            }
            if let Ok(Some(st)) = p.try_wait()
                && !st.success()
                && failed.is_none()
            {
                failed = Some(Instant::now());
                result = Err(format!("rank {rank} failed ({st}); see its message above"));
            }
        }
        if !moved {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (connect_ms, result)
}

struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// One rank.

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

fn run_rank(o: &Args, rank: usize) -> Result<(), String> {
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

/// One slice the ring moves: elements `[off, off + len)` of the working buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Slice {
    off: usize,
    len: usize,
}

/// What one channel sends and receives in one collective, in order.
#[derive(Debug, Default, PartialEq)]
struct Plan {
    /// Each send, with the index of the receive it must wait for (none on the first step).
    sends: Vec<(Slice, Option<usize>)>,
    /// Each receive, and whether it is added to the buffer (reduce) or lands in place.
    recvs: Vec<(Slice, bool)>,
}

/// Rank `rank`'s part for channel `ch` of `chans` of a ring collective over `count` elements.
///
/// The buffer is `n` blocks (block `b` belongs to rank `b` at the end); reduce-scatter step `k`
/// sends block `rank - k - 1` and adds block `rank - k - 2` into the buffer, so rank `r` ends
/// with the sum of block `r`; all-gather step `k` sends block `rank - k` and receives block
/// `rank - k - 1` in place. Each block is split between the channels and cut into slices; the
/// slices of a step pair up with the next step's by position, since the block a step receives is
/// the one the next step sends.
fn plan(coll: Coll, count: usize, n: usize, rank: usize, ch: usize, chans: usize) -> Plan {
    let block = |b: usize| {
        let (lo, hi) = (b * count / n, (b + 1) * count / n);
        let (clo, chi) = (lo + (hi - lo) * ch / chans, lo + (hi - lo) * (ch + 1) / chans);
        let per = SLICE / 4;
        (clo..chi).step_by(per).map(move |s| Slice { off: s, len: per.min(chi - s) })
    };
    let m = |x: usize| x % n;
    let mut steps: Vec<(usize, usize, bool)> = Vec::new();
    if coll != Coll::AllGather {
        steps.extend((0..n - 1).map(|k| (m(rank + 2 * n - k - 1), m(rank + 2 * n - k - 2), true)));
    }
    if coll != Coll::ReduceScatter {
        steps.extend((0..n - 1).map(|k| (m(rank + 2 * n - k), m(rank + 2 * n - k - 1), false)));
    }
    let mut p = Plan::default();
    let mut prev_recvs: Vec<usize> = Vec::new();
    for (k, &(sb, rb, reduce)) in steps.iter().enumerate() {
        for (j, s) in block(sb).enumerate() {
            p.sends.push((s, (k > 0).then(|| prev_recvs[j])));
        }
        prev_recvs.clear();
        for s in block(rb) {
            prev_recvs.push(p.recvs.len());
            p.recvs.push((s, reduce));
        }
    }
    p
}

/// The rank whose block holds element `i` of `count`: block `b` is `[b·count/n, (b+1)·count/n)`.
fn owner(count: usize, n: usize, i: usize) -> usize {
    // The first b with (b+1)·count/n > i; the estimate is at most one block short.
    let mut b = i * n / count.max(1);
    while (b + 1) * count / n <= i {
        b += 1;
    }
    b
}

/// The value rank `r` puts at element `i` of its buffer. Small integers, so float sums are
/// exact.
fn input(coll: Coll, count: usize, n: usize, r: usize, i: usize) -> f32 {
    let v = (i % 1021 + 1) as f32;
    match coll {
        // Only a rank's own block is its input; the rest must be overwritten.
        Coll::AllGather if owner(count, n, i) == r => (r + 1) as f32 * 10_000.0 + v,
        Coll::AllGather => -1.0,
        _ => (r + 1) as f32 * v,
    }
}

/// What the collective must leave at element `i` of rank `r`'s buffer; `None` where nothing is
/// defined (a reduce-scatter's other blocks).
fn expected(coll: Coll, count: usize, n: usize, r: usize, i: usize) -> Option<f32> {
    let v = (i % 1021 + 1) as f32;
    let owner = owner(count, n, i);
    match coll {
        Coll::AllReduce => Some((n * (n + 1) / 2) as f32 * v),
        Coll::AllGather => Some((owner + 1) as f32 * 10_000.0 + v),
        Coll::ReduceScatter => (owner == r).then(|| (n * (n + 1) / 2) as f32 * v),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the ring on the plans `make` gives: every rank's sends must meet the next
    /// rank's receives slice by slice, and running them in dependency order must give the
    /// expected result.
    fn simulate(
        coll: Coll,
        count: usize,
        n: usize,
        chans: usize,
        make: impl Fn(usize, usize) -> Plan,
    ) {
        let mut bufs: Vec<Vec<f32>> =
            (0..n).map(|r| (0..count).map(|i| input(coll, count, n, r, i)).collect()).collect();
        for ch in 0..chans {
            let plans: Vec<Plan> = (0..n).map(|r| make(r, ch)).collect();
            for r in 0..n {
                let next = &plans[(r + 1) % n];
                assert_eq!(plans[r].sends.len(), next.recvs.len(), "{coll:?} n={n} count={count}");
                for ((s, _), (q, _)) in plans[r].sends.iter().zip(&next.recvs) {
                    assert_eq!(s, q, "rank {r} sends what rank {} receives", (r + 1) % n);
                    assert!(s.len > 0 && s.len * 4 <= SLICE);
                }
            }
            // Step through: a rank may send once its dependency has been received.
            let mut sent = vec![0; n];
            let mut recvd = vec![0; n];
            loop {
                let mut moved = false;
                for r in 0..n {
                    let p = &plans[r];
                    let to = (r + 1) % n;
                    while sent[r] < p.sends.len() && p.sends[sent[r]].1.is_none_or(|d| d < recvd[r])
                    {
                        let (s, _) = p.sends[sent[r]];
                        let (q, reduce) = plans[to].recvs[recvd[to]];
                        let src: Vec<f32> = bufs[r][s.off..s.off + s.len].to_vec();
                        for (d, x) in bufs[to][q.off..q.off + q.len].iter_mut().zip(src) {
                            if reduce { *d += x } else { *d = x }
                        }
                        sent[r] += 1;
                        recvd[to] += 1;
                        moved = true;
                    }
                }
                if !moved {
                    break;
                }
            }
            for r in 0..n {
                assert_eq!(sent[r], plans[r].sends.len(), "rank {r} channel {ch} deadlocked");
            }
        }
        for (r, b) in bufs.iter().enumerate() {
            for (i, x) in b.iter().enumerate() {
                if let Some(e) = expected(coll, count, n, r, i) {
                    assert_eq!(*x, e, "{coll:?} n={n} count={count} rank {r} element {i}");
                }
            }
        }
    }

    #[test]
    fn ring_plans_compute_the_collectives() {
        for coll in [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter] {
            for n in [2, 3, 4, 8] {
                for count in [1, 2, 7, 64, 1000, 3 * SLICE / 4 + 5] {
                    let count = coll.counts(count * 4, n).0;
                    for chans in [1, 2, 3] {
                        simulate(coll, count, n, chans, |r, ch| plan(coll, count, n, r, ch, chans));
                    }
                }
            }
        }
    }

    #[test]
    fn the_simulation_catches_wrong_plans() {
        let (count, n) = (3000, 4);
        type Spoil = fn(&mut Plan);
        let broken: [(&str, Spoil); 3] = [
            ("all-gather steps that reduce", |p| p.recvs.iter_mut().for_each(|r| r.1 = true)),
            ("a send that does not wait", |p| p.sends.iter_mut().for_each(|s| s.1 = None)),
            ("a slice one element short", |p| p.recvs[0].0.len -= 1),
        ];
        for (what, spoil) in broken {
            let r = std::panic::catch_unwind(|| {
                simulate(Coll::AllReduce, count, n, 1, |r, ch| {
                    let mut p = plan(Coll::AllReduce, count, n, r, ch, 1);
                    spoil(&mut p);
                    p
                })
            });
            assert!(r.is_err(), "{what} passed the simulation");
        }
        assert_eq!(owner(10, 4, 0), 0);
        assert_eq!(owner(10, 4, 9), 3);
        assert_eq!(
            (0..10).map(|i| owner(10, 4, i)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
        );
    }

    #[test]
    fn options() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let a = |s: &str| {
            let words = std::iter::once("collective").chain(s.split_whitespace());
            let a = Cli::try_parse_from(words).map_err(|e| e.to_string())?.a;
            a.check().map(|()| a)
        };
        let o = a("allreduce -b 8 -e 64M -f 4 -n 3 -w 1 --channels 1").unwrap();
        assert_eq!(
            (o.min, o.max, o.factor, o.iters, o.warmup, o.channels),
            (8, 64 << 20, 4, 3, 1, 1)
        );
        let o = a(
            "allgather --minbytes 1K --maxbytes 2K --stepfactor 2 --iters 1 --warmup_iters 0 -c 0",
        )
        .unwrap();
        assert_eq!((o.coll, o.min, o.max, o.check), (Coll::AllGather, 1024, 2048, 0));
        assert_eq!(a("reducescatter --devs rxe0,rxe1").unwrap().devs.unwrap(), ["rxe0", "rxe1"]);
        assert!(a("allreduce --rank 1 --nranks 2 --rendezvous /tmp/x").is_ok());
        for bad in [
            "",
            "broadcast",
            "allreduce -b",
            "allreduce -b 1X",
            "allreduce -f 1",
            "allreduce -b 1M -e 1K",
            "allreduce --rank 2 --nranks 2 --rendezvous /tmp/x",
            "allreduce --rank 0 --nranks 2",
            "allreduce --nranks 1",
            "allreduce --channels 0",
            "allreduce --channels 33",
            "allreduce --frobnicate",
        ] {
            assert!(a(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(bytes("4K"), Some(4096));
        assert_eq!(bytes("1G"), Some(1 << 30));
        assert_eq!(bytes("x"), None);
    }

    #[test]
    fn bus_bandwidth_factors_are_nccl_tests() {
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Coll::AllGather.bus_factor(4), 0.75);
        assert_eq!(Coll::ReduceScatter.counts(64, 4), (16, 4));
        assert_eq!(Coll::AllGather.counts(8, 4), (0, 0));
    }
}
