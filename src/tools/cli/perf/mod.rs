//! `ferroce perf`: the plugin measured the way NCCL drives it, next to perftest on the same
//! devices in the same boot.
//!
//! Two ranks are two processes, as in NCCL, polled as NCCL's proxy thread polls: the ranks and
//! the commands this orchestrator gives them are [`crate::rank`]'s. `--depth` (default 8) sets
//! the receives posted ahead. A bandwidth run lasts `--seconds` per size, with the depth in
//! flight but at most [`WINDOW_BYTES`] (and never fewer than 2 for that cap).
//!
//! Each of `--rounds` rounds (default 5) measures size by size, and each size first through
//! ferroce, then at once through perftest on the same two devices ([`perftest`]):
//! `ib_write_bw` and `ib_send_bw` (and `ib_write_bw -q N` when `NCCL_IB_QPS_PER_CONNECTION`
//! gives the ranks N lanes) beside the bandwidth, `ib_write_lat` and `ib_send_lat` beside the
//! latency. So drift in the VM hits a size's numbers alike. The tables give each number's median
//! over the rounds, the spread (min-max) of the main ones, and ferroce / perftest for the median
//! (p50) and the mean latency alike; `--json` gives every round's numbers and each one's median,
//! mean, min and max ([`report`]).
//!
//! perftest converts CPU cycles to time with the "cpu MHz" it reads, which an emulated CPU may
//! get wrong. So once per run the orchestrator times two `ib_write_lat` runs of different
//! lengths against the wall clock: the wall time of the extra iterations, halved, is what
//! perftest should report for them (connection setup and teardown cancel out).

use ferroce_tools::loader::default_plugin;

use crate::rank::pair::{Pair, remote_rank, spawn_rank};
use crate::rank::{Lat, MAX, Proto, WINDOW};
use perftest::{BW_AVERAGE, Perftest, Port, T_AVG, T_MIN, T_TYPICAL, clock_check, port};
use report::{Dev, Header};

mod perftest;
mod report;

const BW_SIZES: [usize; 6] = [8, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20];
/// Latency sizes, in both protocols: LL carries small messages.
const LAT_SIZES: [usize; 2] = [8, 4 << 10];
/// Latency iterations by default (`--iters`); the warm-up is a tenth as many.
const LAT_ITERS: usize = 1000;
/// Receives posted ahead by default (`--depth`): NCCL's `NCCL_STEPS`, one receive per step.
const DEPTH: usize = 8;
/// Bytes in flight at most: with 32 x 8 MiB the untimed drain at Soft-RoCE speed would take
/// longer than the measurement; 32 MiB is far above any link's bandwidth-delay product.
const WINDOW_BYTES: usize = 32 << 20;

/// Bandwidth requests in flight for `size`-byte messages: the depth, unless that puts more than
/// [`WINDOW_BYTES`] in flight (a cap that leaves at least 2).
fn window(size: usize, depth: usize) -> usize {
    (WINDOW_BYTES / size).max(2).min(depth)
}

fn warmup(seconds: f64) -> f64 {
    (seconds * 0.1).min(1.0)
}

/// Which side of the benchmark this process is.
#[derive(Debug, PartialEq)]
pub enum Mode {
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
    /// One host: another ncclNet plugin measured beside this one, size by size in every round
    /// (its own two rank processes), as NCCL_NET_PLUGIN names it or a path
    #[arg(long, value_name = "NAME_OR_PATH")]
    versus: Option<String>,
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
    /// Another plugin measured beside it (one host only).
    versus: Option<String>,
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
            _ if self.versus.is_some() && mode != Mode::Local => {
                return Err("--versus is for one host".into());
            }
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
            plugin: self.plugin.clone().unwrap_or_else(default_plugin),
            versus: self.versus.clone(),
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
    /// The `--versus` plugin's.
    versus: Vec<f64>,
}

/// Every round's latency numbers of one size.
#[derive(Default)]
struct LatRow {
    size: usize,
    simple: LatSeries,
    ll: LatSeries,
    write: LatSeries,
    send: LatSeries,
    /// The `--versus` plugin's Simple and LL.
    versus: LatSeries,
    versus_ll: LatSeries,
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
pub fn perf(o: &Opts) -> Result<(), String> {
    let recv = match &o.mode {
        Mode::Listen => return crate::rank::serve::listen(&o.plugin, &o.devs.1, o.port),
        Mode::Local => spawn_rank("recv", &o.plugin, &o.devs.1)?,
        Mode::Connect(addr) => remote_rank(addr)?,
    };
    let mut pair = Pair::open(recv, spawn_rank("send", &o.plugin, &o.devs.0)?)?;
    let mut versus = match &o.versus {
        Some(p) => {
            let mut v =
                Pair::open(spawn_rank("recv", p, &o.devs.1)?, spawn_rank("send", p, &o.devs.0)?)?;
            v.connect()?;
            Some(v)
        }
        None => None,
    };
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
            if let Some(v) = &mut versus {
                let (bytes, secs) = v.bw(row.size, row.window, o.seconds, plan.warm, None)?;
                let gbps = bytes * 8.0 / secs / 1e9;
                eprintln!("{tag}: versus bandwidth  {:>8} B: {gbps:.4} Gb/s", row.size);
                row.versus.push(gbps);
            }
        }
        for row in &mut lat {
            lat_size(&mut pair, &plan, &tag, row)?;
            if let Some(v) = &mut versus {
                for (proto, into) in
                    [(Proto::Simple, &mut row.versus), (Proto::Ll, &mut row.versus_ll)]
                {
                    let l = v.lat(row.size, (o.iters, o.iters / 10), o.depth, proto)?;
                    eprintln!(
                        "{tag}: versus {:<10} {:>8} B: p50 {:.1} us, mean {:.1} us",
                        proto.word(),
                        row.size,
                        l.p50,
                        l.avg
                    );
                    into.push(l);
                }
            }
        }
    }
    pair.quit()?;
    if let Some(v) = &mut versus {
        v.quit()?;
    }

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
        report::print_json(&header, &bw, &lat)
    } else {
        report::print_table(&header, &bw, &lat)
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
        let o = parse("--versus /y/libnccl-net.so").unwrap();
        assert_eq!(o.versus.as_deref(), Some("/y/libnccl-net.so"));
        assert_eq!(parse("").unwrap().versus, None);
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
            "--listen --versus x",
            "--connect h:1 --versus x",
            "--versus",
            "extra",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_bandwidth_window_is_the_depth_within_32_mib() {
        let sizes = [8, 1 << 20, 4 << 20, 8 << 20, 32 << 20];
        assert_eq!(sizes.map(|s| window(s, 8)), [8, 8, 8, 4, 2]);
        assert_eq!(sizes.map(|s| window(s, 32)), [32, 32, 8, 4, 2]);
        assert_eq!(sizes.map(|s| window(s, 1)), [1, 1, 1, 1, 1]);
    }
}
