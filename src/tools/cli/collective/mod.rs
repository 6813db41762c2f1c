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
//! The ring's plans are [`ring`]'s, one rank's set-up and progress [`rank`]'s.
//!
//! Without `--rank` the command is the launcher: it starts all ranks on this host, rank `i`
//! bound to device `i` with `NCCL_IB_HCA`, prints rank 0's table and every rank's connect time,
//! and fails if any rank fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use ferroce_tools::loader::default_plugin;
use ferroce_tools::proc::Proc;

mod rank;
mod ring;

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
        Some(rank) => rank::run_rank(o, rank),
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

#[cfg(test)]
mod tests {
    use super::*;

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
