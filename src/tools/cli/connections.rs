//! `ferroce connections`: what a plugin spends per connection, and how that grows. An
//! all-to-all job opens a send and a receive comm to every peer on every channel, thousands per
//! process, so the cost of one pair is paid thousands of times.
//!
//! Two rank processes, as in NCCL, connect to each other `N` times over (each rank listens,
//! connects to the other's handle and accepts, as NCCL's proxy does for a peer) and keep every
//! comm open. Around each batch the orchestrator reads what each rank process holds: resident
//! memory (with the queues a provider maps in) and pinned memory (`/proc/PID/status`), file
//! descriptors, and the QPs, CQs
//! and MRs `rdma resource show` lists for it. A pair's figure is the growth over the batch
//! divided by `N`, per rank; its setup time is the wall time of its `connect` and `accept` calls
//! on the slower rank (the ranks take their turns through the orchestrator's pipes, which is
//! not counted).

use std::time::Duration;

use crate::rank::num;
use crate::rank::pair::LocalPair;
use ferroce_tools::out::{Table, fixed};
use ferroce_tools::sys::{memory_fds, rdma_counts};

/// How long one connection may take.
const LIMIT: Duration = Duration::from_secs(180);

/// Counts what a plugin holds per send/receive comm pair at 1, 64 and 1,024 pairs
///
/// Two rank processes connect to each other N times over and keep every comm open; the growth
/// of each process's memory (resident and pinned), fds, QPs, CQs and MRs over the batch, per
/// pair, and each pair's setup time. One host, two devices; needs iproute2's rdma.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    ranks: LocalPair,
    /// The batch sizes, in pairs, each from 1 to 4096
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', default_value = "1,64,1024",
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pairs: Vec<u64>,
}

/// What one rank process holds: VmRSS, VmPin, fds, QPs, CQs, MRs.
type Held = [f64; 6];

fn held(pid: u32) -> Result<Held, String> {
    let (rss, pin, fds) = memory_fds(pid)?;
    let r = rdma_counts(pid)?;
    Ok([rss as f64, pin as f64, fds as f64, r.qp as f64, r.cq as f64, r.mr as f64])
}

pub fn connections(a: &Args) -> Result<(), String> {
    let plugin = a.ranks.plugin();
    let mut pair = a.ranks.open(|_| Vec::new())?;
    pair.connect()?;
    let pids = pair.pids().ok_or("the ranks have no pids")?;
    println!("# ferroce connections: {plugin}, {} <-> {}", pair.tx.name, pair.rx.name);
    println!("# per send/receive comm pair, per rank process (the mean of the two ranks)");
    let t = Table { widths: &[6, 10, 10, 10, 10, 7, 7, 7, 7], gap: 2 };
    let head = ["pairs", "setup p50", "setup p99", "RSS", "pinned", "fds", "QPs", "CQs", "MRs"];
    println!("{}", t.line('#', &head));
    println!("{}", t.line('#', &["", "(ms)", "(ms)", "(KiB)", "(KiB)", "", "", "", ""]));
    for &n in &a.pairs {
        let before = [held(pids.0)?, held(pids.1)?];
        let mut setup = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (s, r) = pair.ask_both(("C-LISTEN", "C-LISTEN"), "CHANDLE", LIMIT)?;
            let handle = |v: &[String]| v.first().cloned().ok_or("CHANDLE without a handle");
            let (s, r) = (handle(&s)?, handle(&r)?);
            let cmds = (format!("C-KEEP {r}"), format!("C-KEEP {s}"));
            let (s, r) = pair.ask_both((&cmds.0, &cmds.1), "KEPT", LIMIT)?;
            let us = |v: &[String]| num::<f64>("KEPT", v.first().map(|s| &s[..]));
            setup.push(us(&s)?.max(us(&r)?) / 1000.0);
        }
        let after = [held(pids.0)?, held(pids.1)?];
        pair.ask_both(("C-CLOSEALL", "C-CLOSEALL"), "CLOSED", LIMIT)?;
        let per = |i: usize| {
            let grown = (after[0][i] - before[0][i]) + (after[1][i] - before[1][i]);
            grown / 2.0 / n as f64
        };
        setup.sort_by(f64::total_cmp);
        let at = |q: f64| setup[((setup.len() - 1) as f64 * q).round() as usize];
        let cells = [
            n.to_string(),
            fixed(at(0.5), 1),
            fixed(at(0.99), 1),
            fixed(per(0) / 1024.0, 0),
            fixed(per(1) / 1024.0, 0),
            fixed(per(2), 1),
            fixed(per(3), 1),
            fixed(per(4), 1),
            fixed(per(5), 1),
        ];
        println!("{}", t.line(' ', &cells.each_ref().map(String::as_str)));
    }
    pair.quit_and_wait(LIMIT)
}
