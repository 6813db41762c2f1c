//! A cluster in a box: N ranks on Soft-RoCE, each its own process bound to its own rxe device
//! on its own veth, all on one bridge (`FERROCE_VM_RANKS=4 ci/vm.sh`), running `ferroce
//! collective` (ring collectives through the plugin's C ABI, 2 channels each).
//!
//! - **Collectives:** all-reduce, all-gather and reduce-scatter over 4 ranks at 8 B, 32 KiB and
//!   2 MiB; every element of every rank is checked by the ranks (a wrong one fails the rank),
//!   and the table must show each size with `#wrong` 0.
//! - **A path that dies mid-all-reduce:** 4 ranks, 2 lanes per connection (the default); once
//!   rank 0 has received 4 MiB of the run's ~18, a u32 filter on every rank's veth drops each RoCE packet whose UDP source port
//!   is odd: one lane of every connection (its two ports are consecutive), both ways. The
//!   all-reduce finishes with `#wrong` 0, and the ranks warn of failed lanes. Three runs: a
//!   retry bound of 2.7 s, then NCCL's default timeouts (where only the stall bound moves
//!   work) with whole messages and with split data; in the last two the drop is lifted 1.5 s
//!   later (and the run is 36 all-reduces, not 12), and some lane must be repaired before the
//!   run ends.
//! - **A rank that cannot start** (a device that does not exist): it fails naming the device,
//!   and the launcher ends the rank left waiting for it: exit 1 within 60 s, not a hang.
//! - **ECMP:** with 4 QPs per connection, a capture on the bridge sees every connection's
//!   traffic on exactly the UDP source ports it logged, and no two connections between the same
//!   pair of hosts share a port; with 2 ranks (connections both ways between one pair) and 4.
//! - **Failure of one rank:** 4 ranks run an endless all-reduce; rank 2 is killed with SIGKILL.
//!   Every other rank must exit non-zero within the bound with a remote error naming a ring
//!   neighbour that has died (rank 2, or one that failed of it first: the failure travels round
//!   the ring both ways), and at least one must name rank 2. The liveness knobs make the bound
//!   short, as in `tests/liveness.rs`.
//!
//! Built with its own `main` (`harness = false`) and run by `ci/vm-tests.sh` in a VM booted
//! with `FERROCE_VM_RANKS=4`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Capture, plugin_dir};

const RANKS: usize = 4;
const KNOBS: [(&str, &str); 3] =
    [("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "3"), ("FERROCE_PROBE_INTERVAL_MS", "1000")];
/// How long after the kill every other rank must have failed: rank 2's neighbours fail within
/// the probe interval plus the retry bound (1.3 s); rank 0, whose neighbours are those two,
/// one such bound later. Room for TCG.
const BOUND: Duration = Duration::from_secs(20);

fn main() {
    common::exit_on_error("cluster", run());
}

fn run() -> Result<(), String> {
    if std::env::var("FERROCE_IN_VM").as_deref() != Ok("1") {
        return Err("must run inside the Soft-RoCE VM (FERROCE_VM_RANKS=4 ci/vm.sh)".into());
    }
    let devs = vm_list("FERROCE_VM_DEVS");
    if devs.len() < RANKS || std::env::var("FERROCE_VM_BRIDGE").unwrap_or_default().is_empty() {
        return Err(format!(
            "needs the VM's N-rank mode with at least {RANKS} ranks on a bridge \
             (FERROCE_VM_RANKS={RANKS}); it has devices {devs:?}"
        ));
    }
    collectives()?;
    // Finite retries (rxe's 7 never ends) with a bound (2.7 s) that 4 busy ranks keep; then
    // NCCL's defaults, nothing set: rxe retries for ever, and only the stall bound moves work.
    a_dying_path(
        &[("NCCL_IB_TIMEOUT", "17"), ("NCCL_IB_RETRY_CNT", "4")],
        "a retry bound of 2.7 s",
        None,
    )?;
    // At the defaults, in both split modes, the drop is lifted 1.5 s in: the lanes come back.
    let lift = Some(Duration::from_millis(1500));
    a_dying_path(&[], "NCCL's default timeouts", lift)?;
    a_dying_path(&[("NCCL_IB_SPLIT_DATA_ON_QPS", "1")], "split data, default timeouts", lift)?;
    a_rank_that_cannot_start()?;
    ecmp(2)?;
    ecmp(RANKS)?;
    failure()
}

fn vm_list(var: &str) -> Vec<String> {
    std::env::var(var).unwrap_or_default().split_whitespace().map(str::to_string).collect()
}

fn plugin() -> String {
    plugin_dir().join("libnccl-net-ferroce.so").to_string_lossy().into_owned()
}

fn ferroce(args: &[&str]) -> Command {
    let mut c = Command::new(common::ferroce_exe());
    c.arg("collective").args(args).args(["--plugin", &plugin()]);
    c
}

/// Runs the launcher to the end (it bounds its own ranks), with a backstop.
fn launch(args: &[&str], env: &[(&str, &str)]) -> Result<Output, String> {
    let mut c = ferroce(args);
    c.envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().map_err(|e| format!("ferroce collective: {e}"))?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    if !out.status.success() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        return Err(format!("ferroce collective {args:?} failed: {}", out.status));
    }
    Ok(out)
}

fn collectives() -> Result<(), String> {
    for coll in ["allreduce", "allgather", "reducescatter"] {
        let t = Instant::now();
        let n = RANKS.to_string();
        let out = launch(
            &[coll, "--nranks", &n, "-b", "8", "-e", "2M", "-f", "64", "-n", "2", "-w", "1"],
            &[],
        )?;
        let text = String::from_utf8_lossy(&out.stdout);
        // The rows: size, count, type, redop, root, time, algbw, busbw, #wrong.
        let rows: Vec<Vec<&str>> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .collect();
        let sizes: Vec<&str> = rows.iter().map(|r| r[0]).collect();
        // all-gather and reduce-scatter at 8 B: 2 floats are no element per rank, left out.
        let want: &[&str] = if coll == "allreduce" {
            &["8", "512", "32768", "2097152"]
        } else {
            &["512", "32768", "2097152"]
        };
        if sizes != want {
            return Err(format!("{coll}: sizes {sizes:?}, expected {want:?}"));
        }
        if let Some(r) = rows.iter().find(|r| r.len() != 9 || r[8] != "0") {
            return Err(format!("{coll}: row {r:?} is not nine columns with #wrong 0"));
        }
        if !text.contains("# Out of bounds values : 0 OK") {
            return Err(format!("{coll}: no clean summary"));
        }
        // False alarms: a lane fenced on a clean link (counted, not asserted: a fence of a
        // live lane is harmless, and the measure belongs to the benchmark).
        let err = String::from_utf8_lossy(&out.stderr);
        let fenced = err.lines().filter(|l| l.contains("lane ") && l.contains(" failed")).count();
        eprintln!(
            "cluster: {coll} on {RANKS} ranks: {} sizes verified in {:.1} s; lanes fenced on \
             the clean link: {fenced}",
            rows.len(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Adds (or, with `on` false, removes) the drop of every RoCE packet with an odd UDP source
/// port arriving at each rank's veth.
fn odd_ports_dropped(on: bool) -> Result<(), String> {
    for dev in vm_list("FERROCE_VM_NETDEVS") {
        let mut cmds: Vec<Vec<&str>> = vec![vec!["qdisc", "del", "dev", &dev, "clsact"]];
        if on {
            cmds = vec![
                vec!["qdisc", "add", "dev", &dev, "clsact"],
                vec![
                    "filter", "add", "dev", &dev, "ingress", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", "protocol", "17", "0xff", "match", "ip", "dport", "4791",
                    "0xffff", "match", "ip", "sport", "1", "0x0001", "action", "drop",
                ],
            ];
        }
        for args in cmds {
            let st = Command::new("tc").args(&args).status().map_err(|e| format!("tc: {e}"))?;
            if on && !st.success() {
                return Err(format!("tc {args:?}: {st}"));
            }
        }
    }
    Ok(())
}

/// An all-reduce over 4 ranks in which one lane of every connection loses its path a few
/// seconds in, with the knobs `env` (`what`): it finishes, every element checked, and the
/// ranks say which lanes failed. With `lift`, the path answers again that long after the
/// drop, and some rank's lane is repaired before the run ends.
fn a_dying_path(env: &[(&str, &str)], what: &str, lift: Option<Duration>) -> Result<(), String> {
    let t = Instant::now();
    let n = RANKS.to_string();
    // A lifted drop leaves the run time to repair its lanes: three times the all-reduces.
    let iters = if lift.is_some() { "36" } else { "12" };
    let mut c = ferroce(&["allreduce", "--nranks", &n, "-b", "1M", "-e", "1M", "-n", iters]);
    c.envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    if lift.is_some() {
        c.env("NCCL_DEBUG", "INFO"); // the repairs are INFO lines
    }
    // The drop comes once rank 0 has received 4 MiB (of about 18): two or three all-reduces
    // in, whatever the machine's pace.
    let rx = || {
        let dev = vm_list("FERROCE_VM_NETDEVS").into_iter().next().unwrap_or_default();
        let path = format!("/sys/class/net/{dev}/statistics/rx_bytes");
        std::fs::read_to_string(path).ok().and_then(|v| v.trim().parse::<u64>().ok())
    };
    let start = rx().ok_or("no rx_bytes for the first rank's veth")?;
    let mut child = c.spawn().map_err(|e| format!("ferroce collective: {e}"))?;
    let t0 = Instant::now();
    while rx().unwrap_or(start) < start + (4 << 20) {
        if t0.elapsed() > Duration::from_secs(120) || matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
            return Err("the all-reduce ended (or moved nothing for 120 s) before the drop".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let at = t0.elapsed();
    let dropped = odd_ports_dropped(true);
    // With `lift`, the drop goes once that long has passed (unless the run ended first), and
    // the run goes on; else it goes when the run ends.
    let lifted = lift.map(|lift| {
        let t1 = Instant::now();
        while t1.elapsed() < lift && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        (t1.elapsed() >= lift, odd_ports_dropped(false))
    });
    let out = child.wait_with_output().map_err(|e| e.to_string());
    let (in_time, cleared) = lifted.unwrap_or_else(|| (true, odd_ports_dropped(false)));
    cleared?;
    dropped?;
    if !in_time {
        return Err(format!("{what}: the all-reduce ended before the drop was lifted"));
    }
    let out = out?;
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    print!("{text}");
    let lanes: Vec<&str> =
        err.lines().filter(|l| l.contains("lane ") && l.contains("failed")).collect();
    for l in &lanes {
        eprintln!("  {l}");
    }
    if !out.status.success() {
        eprint!("{err}");
        return Err(format!("the all-reduce with a dying path failed: {}", out.status));
    }
    let row = text.lines().find(|l| !l.starts_with('#')).unwrap_or_default();
    let cols: Vec<&str> = row.split_whitespace().collect();
    if cols.len() != 9 || cols[0] != "1048576" || cols[8] != "0" {
        return Err(format!("the all-reduce row {row:?} is not 1 MiB with #wrong 0"));
    }
    if lanes.is_empty() {
        return Err(format!("no rank warned of a failed lane: the drop missed the run\n{err}"));
    }
    let stalls = lanes.iter().filter(|l| l.contains("FERROCE_LANE_STALL_MS")).count();
    let repaired = err.lines().filter(|l| l.contains(" is repaired")).count();
    if lift.is_some() && repaired == 0 {
        eprint!("{err}");
        return Err(format!("{what}: no lane was repaired after the drop was lifted"));
    }
    let repairs = match lift {
        Some(_) => format!(", {repaired} lanes repaired after the lift"),
        None => String::new(),
    };
    eprintln!(
        "cluster: all-reduce of 1 MiB x {iters} on {RANKS} ranks, {what}, with one lane of every \
         connection dropped {:.1} s in (4 MiB received by rank 0): #wrong 0, {} lane WARNs \
         ({stalls} of them stalls){repairs}, {:.1} s",
        at.as_secs_f64(),
        lanes.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A rank given a device that does not exist fails at once with the device named, and the
/// launcher ends the rank left waiting for it within its grace period: an error, not a hang.
fn a_rank_that_cannot_start() -> Result<(), String> {
    let t = Instant::now();
    let out = ferroce(&["allreduce", "--devs", "rxe0,rxe9", "-b", "8", "-e", "8"])
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&out.stderr);
    let secs = t.elapsed().as_secs_f64();
    eprintln!("cluster: --devs rxe0,rxe9: {} after {secs:.1} s:\n{err}", out.status);
    if out.status.success() || !err.contains("rxe9") || secs > 60.0 {
        return Err(format!("a rank on a missing device: {} after {secs:.1} s", out.status));
    }
    Ok(())
}

/// One connection as its connector logged it.
#[derive(Debug)]
struct Conn {
    own: String,
    peer: String,
    ports: Vec<u16>,
}

/// The connections in `NCCL_DEBUG=INFO` output: `connected to ...: ... UDP source ports [a, b],
/// rxeN GID OWN (index i) -> PEER, ...`.
fn connections(log: &str) -> Result<Vec<Conn>, String> {
    let mut v = Vec::new();
    for l in log.lines().filter(|l| l.contains("NET/ferroce: connected to ")) {
        let bad = || format!("unexpected connection line: {l}");
        let ports = l
            .split("UDP source ports [")
            .nth(1)
            .and_then(|s| s.split(']').next())
            .ok_or_else(bad)?;
        let ports = ports
            .split(", ")
            .map(|p| p.parse::<u16>().map_err(|_| bad()))
            .collect::<Result<Vec<_>, _>>()?;
        let gid = l.split(" GID ").nth(1).ok_or_else(bad)?;
        let own = gid.split(' ').next().ok_or_else(bad)?.to_string();
        let peer =
            gid.split(" -> ").nth(1).and_then(|s| s.split(',').next()).ok_or_else(bad)?.to_string();
        v.push(Conn { own, peer, ports });
    }
    Ok(v)
}

fn ecmp(n: usize) -> Result<(), String> {
    let bridge = std::env::var("FERROCE_VM_BRIDGE").unwrap_or_default();
    let cap = Capture::start(&bridge);
    let nr = n.to_string();
    let env = [("NCCL_DEBUG", "INFO"), ("NCCL_IB_QPS_PER_CONNECTION", "4")];
    let out =
        launch(&["allreduce", "--nranks", &nr, "-b", "1M", "-e", "1M", "-n", "2", "-w", "0"], &env);
    let pkts = cap.stop();
    let out = out?;
    let conns = connections(&String::from_utf8_lossy(&out.stderr))?;
    if conns.len() != 2 * n {
        return Err(format!(
            "{n} ranks: {} connections logged, expected {} (2 channels each)",
            conns.len(),
            2 * n
        ));
    }
    let ip = |s: &str| {
        s.parse::<std::net::Ipv4Addr>().map(|a| a.octets()).map_err(|e| format!("{s}: {e}"))
    };
    // Every logged port carries traffic between the connection's two hosts (requests one way,
    // ACKs the other), and no packet between ranks uses a port nobody logged.
    let mut per_pair: BTreeMap<([u8; 4], [u8; 4]), Vec<u16>> = BTreeMap::new();
    for c in &conns {
        let (a, b) = (ip(&c.own)?, ip(&c.peer)?);
        for &p in &c.ports {
            let seen = pkts
                .iter()
                .filter(|k| k.sport == p && ((k.src, k.dst) == (a, b) || (k.src, k.dst) == (b, a)))
                .count();
            if seen == 0 {
                return Err(format!(
                    "{n} ranks: port {p} of {} -> {} carried no packet on {bridge}",
                    c.own, c.peer
                ));
            }
        }
        per_pair.entry((a.min(b), a.max(b))).or_default().extend(&c.ports);
    }
    let logged: BTreeSet<u16> = conns.iter().flat_map(|c| c.ports.iter().copied()).collect();
    if let Some(k) = pkts.iter().find(|k| !logged.contains(&k.sport)) {
        return Err(format!("{n} ranks: a packet {k:?} on a port no connection logged"));
    }
    for ((a, b), ports) in &per_pair {
        let distinct: BTreeSet<_> = ports.iter().collect();
        if distinct.len() != ports.len() {
            return Err(format!(
                "{n} ranks: connections between {a:?} and {b:?} share ports: {ports:?}"
            ));
        }
        eprintln!(
            "cluster: {n} ranks: hosts {a:?} and {b:?}: {} connections on {} distinct ports",
            ports.len() / 4,
            ports.len()
        );
    }
    eprintln!(
        "cluster: {n} ranks: {} packets on {bridge}, all on the {} logged ports",
        pkts.len(),
        logged.len()
    );
    Ok(())
}

fn failure() -> Result<(), String> {
    let devs = vm_list("FERROCE_VM_DEVS");
    let dir = std::env::temp_dir().join(format!("ferroce-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut ranks: Vec<Child> = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    let kill_all = |ranks: &mut Vec<Child>| {
        for c in ranks.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    for (r, dev) in devs.iter().take(RANKS).enumerate() {
        let (rs, ns, d) = (r.to_string(), RANKS.to_string(), dir.to_string_lossy().into_owned());
        let mut c = ferroce(&[
            "allreduce",
            "--rank",
            &rs,
            "--nranks",
            &ns,
            "--rendezvous",
            &d,
            "-b",
            "4M",
            "-e",
            "4M",
            "-n",
            "1000000",
            "-w",
            "0",
            "-c",
            "0",
        ]);
        c.env("NCCL_IB_HCA", format!("={dev}"))
            .envs(KNOBS)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().map_err(|e| e.to_string())?;
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send((r, l));
                }
            });
        }
        ranks.push(child);
    }
    let mut log: Vec<Vec<String>> = vec![Vec::new(); RANKS];
    let collect = |rx: &std::sync::mpsc::Receiver<(usize, String)>,
                   log: &mut Vec<Vec<String>>,
                   until: Instant| {
        while let Ok((r, l)) = rx.recv_timeout(
            until.saturating_duration_since(Instant::now()).min(Duration::from_millis(100)),
        ) {
            eprintln!("  rank {r}: {l}");
            log[r].push(l);
            if Instant::now() > until {
                break;
            }
        }
    };
    // Wait for every rank to be connected, then let the all-reduce run a moment.
    let t = Instant::now();
    while log.iter().any(|l| !l.iter().any(|x| x.starts_with("# connected in"))) {
        if t.elapsed() > Duration::from_secs(120)
            || ranks.iter_mut().any(|c| matches!(c.try_wait(), Ok(Some(_))))
        {
            kill_all(&mut ranks);
            return Err("the ranks did not all connect (or one exited) within 120 s".into());
        }
        collect(&rx, &mut log, Instant::now() + Duration::from_millis(200));
    }
    collect(&rx, &mut log, Instant::now() + Duration::from_secs(2));
    ranks[2].kill().map_err(|e| e.to_string())?;
    let killed = Instant::now();
    let _ = ranks[2].wait();
    eprintln!("cluster: killed rank 2 (SIGKILL) in the middle of the all-reduce");
    let mut result = Ok(());
    let mut names_rank_2 = false;
    let mut exits: Vec<Option<(f64, std::process::ExitStatus)>> = vec![None; RANKS];
    while killed.elapsed() < BOUND && (0..RANKS).any(|r| r != 2 && exits[r].is_none()) {
        collect(&rx, &mut log, Instant::now() + Duration::from_millis(100));
        for r in (0..RANKS).filter(|&r| r != 2) {
            if exits[r].is_none()
                && let Ok(Some(st)) = ranks[r].try_wait()
            {
                exits[r] = Some((killed.elapsed().as_secs_f64(), st));
            }
        }
    }
    collect(&rx, &mut log, Instant::now() + Duration::from_millis(500));
    kill_all(&mut ranks);
    let _ = std::fs::remove_dir_all(&dir);
    for r in (0..RANKS).filter(|&r| r != 2) {
        let Some((s, st)) = exits[r] else {
            result = Err(format!("rank {r} still ran {BOUND:?} after rank 2 was killed"));
            continue;
        };
        let failed = log[r]
            .iter()
            .find(|l| l.starts_with(&format!("ferroce: rank {r}: ")))
            .cloned()
            .unwrap_or_default();
        eprintln!("cluster: rank {r} exited {st} {s:.2} s after the kill: {failed}");
        // A dead peer is named: a ring neighbour, which by now has died, rank 2 itself or one
        // that failed of it first (the failure travels round the ring both ways, and a rank's
        // send to a neighbour that has just exited can fail before its own probe of rank 2
        // does), with the plugin's remote-error class.
        let (prev, next) = ((r + RANKS - 1) % RANKS, (r + 1) % RANKS);
        let named = [prev, next].into_iter().find(|p| failed.contains(&format!("rank {p} (")));
        if st.success() || named.is_none() || !failed.contains("ncclResult 6") {
            result = Err(format!("rank {r} exited {st} without naming a dead peer: {failed:?}"));
        }
        names_rank_2 |= named == Some(2);
    }
    if result.is_ok() && !names_rank_2 {
        result = Err("no rank named rank 2, the one that was killed".into());
    }
    result
}
