//! `ferroce doctor [--dev NAME] [--json] [--selftest] [--plugin NAME_OR_PATH]`: explains this
//! host's RoCE set-up in one screen per device, with the plugin's own decisions (device
//! discovery, `NCCL_IB_HCA`, the GID choice, GPUDirect detection, the knob parser), and says
//! what blocks NCCL from using ferroce.
//!
//! Every finding is one line with a level:
//! - `BLOCK`: NCCL cannot use ferroce on this host as configured (exit status 1);
//! - `WARN`: it works, but worse than it could, or a knob is probably not what was meant;
//! - `NOTE`: a fact worth knowing that needs no action.
//!
//! Nothing is written: sysfs is only read, and the self-test moves data between two local
//! ports through the plugin's C ABI, as NCCL would.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use ferroce::config::Config;
use ferroce::transport::device::{self, gid_table, mtu_bytes, speed_mbps};
use ferroce::transport::gid::{self, GidChoice, GidEntry, GidType};
use ferroce::verbs::{self, LinkLayer, PortState};

pub const USAGE: &str = "ferroce doctor [--dev NAME] [--json] [--selftest] [--plugin NAME_OR_PATH]";

/// Below this `RLIMIT_MEMLOCK` (without `CAP_IPC_LOCK`) registration of NCCL's buffers fails:
/// one ring of 8 channels already registers 8 x 4 MiB per peer and direction.
const MEMLOCK_BLOCK: u64 = 64 << 20;
/// An Ethernet MTU at least this large carries a 4096-byte RoCE payload with its headers
/// (Ethernet, IP, UDP, BTH, RETH, ICRC; rxe reserves 80 bytes).
const NETDEV_FOR_4096: u32 = 4096 + 80;
/// The self-test: this many messages of this size, rxe-sized (tens of MiB in all).
const SELFTEST_MSG: usize = 4 << 20;
const SELFTEST_MSGS: usize = 8;
const SELFTEST_DEPTH: usize = 4;
const SELFTEST_LIMIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Note,
    Warn,
    Block,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Note => "NOTE",
            Level::Warn => "WARN",
            Level::Block => "BLOCK",
        }
    }
}

#[derive(Clone, Debug)]
struct Finding {
    level: Level,
    /// The device (`rxe0:1`) or area (`memlock`, `env`) it is about.
    about: String,
    what: String,
}

struct Counter {
    /// `counters` (the port's standard counters) or `hw_counters` (the driver's own).
    group: &'static str,
    name: String,
    value: u64,
}

/// One (RDMA device, port), as the doctor shows it.
struct Port {
    dev: String,
    port: u8,
    /// `NCCL_IB_HCA` (and `--dev`) keep it.
    kept: bool,
    state: PortState,
    link_layer: LinkLayer,
    active_speed: u8,
    active_width: u8,
    active_mtu: u32,
    max_mtu: u32,
    netdev: Option<String>,
    netdev_mtu: Option<u32>,
    gids: Vec<GidEntry>,
    choice: Result<GidChoice, String>,
    /// Congestion-control files found in sysfs: (path relative to /sys/class/net/IF, value).
    cc: Vec<(String, String)>,
    /// No PCI parent (rxe, siw): a software device with no NIC queues to configure.
    software: bool,
    counters: Vec<Counter>,
    /// The plugin's GPUDirect decision, when discovery kept this port.
    gdr: Option<String>,
}

impl Port {
    fn key(&self) -> String {
        format!("{}:{}", self.dev, self.port)
    }
}

struct Options {
    dev: Option<String>,
    json: bool,
    selftest: bool,
    plugin: String,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options { dev: None, json: false, selftest: false, plugin: "ferroce".into() };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next().cloned().ok_or_else(|| format!("{name} needs a value\nusage: {USAGE}"))
        };
        match a.as_str() {
            "--dev" => o.dev = Some(value("--dev")?),
            "--plugin" => o.plugin = value("--plugin")?,
            "--json" => o.json = true,
            "--selftest" => o.selftest = true,
            other => return Err(format!("unknown argument {other:?}\nusage: {USAGE}")),
        }
    }
    Ok(o)
}

/// The entry point: prints the report; an error (exit status 1) when something blocks.
pub fn doctor(args: &[String]) -> Result<(), String> {
    let opts = parse(args)?;
    let mut findings = Vec::new();
    let mut add = |level, about: &str, what: String| {
        findings.push(Finding { level, about: about.into(), what });
    };
    let config = match Config::from_env() {
        Ok(c) => {
            for w in &c.warnings {
                add(Level::Warn, "env", w.clone());
            }
            c
        }
        Err(e) => {
            add(Level::Block, "env", format!("malformed knob: {e}"));
            Config::default()
        }
    };

    // What the plugin itself would do at init: its device list, or why it has none.
    let discovered = device::discover(&config);
    let in_use: BTreeMap<String, String> = match &discovered {
        Ok(devs) => devs
            .iter()
            .map(|d| (format!("{}:{}", d.ctx.name(), d.port), d.gdr.why.clone()))
            .collect(),
        Err(e) => {
            add(Level::Block, "discovery", format!("the plugin finds no usable device: {e}"));
            BTreeMap::new()
        }
    };
    if let Ok(devs) = &discovered {
        for d in devs {
            if let Some(w) = &d.gdr.warning {
                add(Level::Warn, &d.name, w.clone());
            }
        }
    }
    drop(discovered);

    let mut ports = read_ports(&config, &in_use)?;
    // NCCL's device numbers follow discovery order: the kept ACTIVE ports with a GID.
    let nccl_devs: Vec<String> = ports
        .iter()
        .filter(|p| p.kept && p.state == PortState::Active && p.choice.is_ok())
        .map(Port::key)
        .collect();
    if let Some(want) = &opts.dev {
        ports.retain(|p| &p.dev == want || &p.key() == want);
        if ports.is_empty() {
            add(Level::Block, "--dev", format!("{want:?} names no RDMA device or port"));
        }
        for p in &mut ports {
            p.kept = true;
        }
    }
    if !config.ib_hca.is_empty() {
        let names: Vec<String> = ports.iter().map(|p| p.dev.clone()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        for typo in config.ib_hca.unmatched(&names) {
            add(
                Level::Warn,
                "env",
                format!("NCCL_IB_HCA={}: {typo:?} matches no RDMA device", config.ib_hca.raw),
            );
        }
    }
    for p in &ports {
        check_port(p, &config, opts.dev.is_some(), &mut add);
    }
    check_mtus(&ports, &mut add);
    let memlock = Memlock::read();
    memlock.check(&mut add);

    let selftest = if opts.selftest {
        match selftest(&opts.plugin, &nccl_devs) {
            Ok(s) => Some(s),
            Err(e) => {
                add(Level::Block, "self-test", e);
                None
            }
        }
    } else {
        None
    };
    let env = knob_env();
    let advice = advice(&ports, &config, &memlock);
    findings.sort_by_key(|f| std::cmp::Reverse(f.level));

    let report = Report {
        ports: &ports,
        findings: &findings,
        memlock: &memlock,
        env: &env,
        advice: &advice,
        selftest: selftest.as_ref(),
    };
    let out = if opts.json { json(&report) } else { text(&report) };
    print!("{out}");
    let blocking: Vec<_> = findings.iter().filter(|f| f.level == Level::Block).collect();
    if blocking.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "doctor: {} blocking problem(s) ({})",
            blocking.len(),
            blocking
                .iter()
                .map(|f| format!("{}: {}", f.about, f.what))
                .collect::<Vec<_>>()
                .join("; ")
        ))
    }
}

/// Every port of every RDMA device, with what the plugin would choose on it.
fn read_ports(config: &Config, in_use: &BTreeMap<String, String>) -> Result<Vec<Port>, String> {
    let (_, opened) = verbs::open_all(|_| true).map_err(|e| e.to_string())?;
    let mut ports = Vec::new();
    for ctx in opened {
        let ctx = ctx.map_err(|e| e.to_string())?;
        let attr = ctx.query_device().map_err(|e| e.to_string())?;
        for port in 1..=attr.phys_port_cnt {
            let pa = ctx.query_port(port).map_err(|e| e.to_string())?;
            let dev = ctx.name().to_string();
            let gids = gid_table(&ctx, port, pa.gid_tbl_len);
            let ethernet = pa.link_layer == LinkLayer::Ethernet;
            let choice = gid::choose(&dev, &gids, config, ethernet).map_err(|e| match e {
                ferroce::error::Error::NoDevice(why) => why,
                other => other.to_string(),
            });
            let netdev = choice
                .as_ref()
                .ok()
                .and_then(|c| c.netdev.clone())
                .or_else(|| gids.iter().find_map(|g| g.netdev.clone()))
                .or_else(|| {
                    read(&format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs/0"))
                });
            let netdev_mtu = netdev
                .as_ref()
                .and_then(|n| read(&format!("/sys/class/net/{n}/mtu"))?.parse().ok());
            let software =
                std::fs::metadata(format!("/sys/class/infiniband/{dev}/device")).is_err();
            ports.push(Port {
                kept: config.ib_hca.select(&dev, port.into()).is_some(),
                gdr: in_use.get(&format!("{dev}:{port}")).cloned(),
                cc: netdev.as_deref().map(congestion_control).unwrap_or_default(),
                counters: counters(&dev, port),
                dev,
                port,
                state: pa.state,
                link_layer: pa.link_layer,
                active_speed: pa.active_speed,
                active_width: pa.active_width,
                active_mtu: mtu_bytes(pa.active_mtu),
                max_mtu: mtu_bytes(pa.max_mtu),
                netdev,
                netdev_mtu,
                gids,
                choice,
                software,
            });
        }
    }
    Ok(ports)
}

fn read(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    Some(s.trim().to_string())
}

/// Files under `dir`, sorted, with their trimmed contents (unreadable ones left out).
fn files(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_file()
            && let Some(v) = read(&p.to_string_lossy())
        {
            out.push((e.file_name().to_string_lossy().into_owned(), v));
        }
    }
    out.sort();
    out
}

/// ECN (per priority: `ecn/roce_np/enable/N` marks and answers with CNPs, `ecn/roce_rp/enable/N`
/// slows down on CNPs: together DCQCN), PFC and trust mode (`qos/pfc`, `qos/trust`, as
/// MLNX_OFED's mlx5 exposes them), wherever the driver puts them under the netdev.
fn congestion_control(netdev: &str) -> Vec<(String, String)> {
    let base = std::path::Path::new("/sys/class/net").join(netdev);
    let mut out = Vec::new();
    for side in ["roce_np", "roce_rp"] {
        for (prio, v) in files(&base.join("ecn").join(side).join("enable")) {
            out.push((format!("ecn/{side}/enable/{prio}"), v));
        }
    }
    for f in ["pfc", "trust", "dscp2prio", "tc_bw"] {
        if let Some(v) = read(&base.join("qos").join(f).to_string_lossy()) {
            out.push((format!("qos/{f}"), v.lines().collect::<Vec<_>>().join(" | ")));
        }
    }
    out
}

fn counters(dev: &str, port: u8) -> Vec<Counter> {
    let base = std::path::PathBuf::from(format!("/sys/class/infiniband/{dev}/ports/{port}"));
    let mut out = Vec::new();
    for group in ["counters", "hw_counters"] {
        for (name, v) in files(&base.join(group)) {
            if let Ok(value) = v.parse() {
                out.push(Counter { group, name, value });
            }
        }
    }
    out
}

/// What a counter means, for the names the common drivers (rxe, mlx5, and the standard port
/// counters) use; `None` for names not known here.
fn meaning(name: &str) -> Option<&'static str> {
    Some(match name {
        // Standard port counters (IB PMA), also kept by RoCE drivers.
        "port_xmit_data" => "data sent, in units of 4 bytes",
        "port_rcv_data" => "data received, in units of 4 bytes",
        "port_xmit_packets" | "unicast_xmit_packets" => "packets sent",
        "port_rcv_packets" | "unicast_rcv_packets" => "packets received",
        "multicast_xmit_packets" => "multicast packets sent",
        "multicast_rcv_packets" => "multicast packets received",
        "port_xmit_discards" => "DROPS: packets the port discarded instead of sending",
        "port_rcv_errors" => "received packets with errors (dropped)",
        "port_xmit_wait" => {
            "ticks the port had data but no credit to send (pause/PFC back-pressure)"
        }
        "port_rcv_remote_physical_errors" => "received packets marked bad upstream",
        "port_rcv_switch_relay_errors" => "received packets that could not be forwarded",
        "port_xmit_constraint_errors" | "port_rcv_constraint_errors" => {
            "packets dropped by partition or filter checks"
        }
        "symbol_error" => "line coding errors: a bad cable or optic",
        "link_error_recovery" => "times the link retrained",
        "link_downed" => "times the link went down",
        "local_link_integrity_errors" => "local physical errors over the threshold",
        "excessive_buffer_overrun_errors" => "receive buffer overruns",
        "VL15_dropped" => "management packets dropped",
        // rxe (Soft-RoCE).
        "sent_pkts" => "RoCE packets sent",
        "rcvd_pkts" => "RoCE packets received",
        "duplicate_request" => "requests received twice: the sender retransmitted",
        "out_of_seq_request" => {
            "OUT-OF-SEQUENCE requests received (a packet was lost or reordered)"
        }
        "rcvd_rnr_err" => "RNR NAKs received: the peer had no receive posted",
        "send_rnr_err" => "RNR NAKs sent: a request came before a receive was posted",
        "rcvd_seq_err" => "sequence-error NAKs received: the peer saw a gap, we RETRANSMIT",
        "ack_deferred" => "ACKs coalesced (deferred)",
        "retry_exceeded_err" => "ACK TIMEOUTS that ran out of retries: the QP failed",
        "retry_rnr_exceeded_err" => "RNR retries ran out: the QP failed",
        "completer_retry_err" => "RETRANSMITS after an ACK timeout",
        "send_err" => "packets the network stack failed to send (DROPS)",
        "rdma_sends" => "RDMA sends",
        "rdma_recvs" => "RDMA receives",
        // mlx5.
        "out_of_sequence" => "OUT-OF-SEQUENCE packets received (loss or reordering)",
        "packet_seq_err" => "sequence-error NAKs received: we RETRANSMIT",
        "implied_nak_seq_err" => "gaps implied by a later ACK: we RETRANSMIT",
        "local_ack_timeout_err" => {
            "ACK TIMEOUTS: we RETRANSMIT (loss, or a too-short NCCL_IB_TIMEOUT)"
        }
        "rnr_nak_retry_err" => "RNR retries ran out: the QP failed",
        "out_of_buffer" => "DROPS: no receive WQE posted",
        "np_cnp_sent" => "CNPs sent: ECN-marked packets arrived (congestion seen here)",
        "np_ecn_marked_roce_packets" => "ECN-marked RoCE packets received",
        "rp_cnp_handled" => "CNPs handled: this sender slowed down (DCQCN)",
        "rp_cnp_ignored" => "CNPs ignored",
        "roce_adp_retrans" => "adaptive RETRANSMITS",
        "roce_adp_retrans_to" => "adaptive retransmission timeouts",
        "roce_slow_restart" => "slow restarts after loss",
        "roce_slow_restart_cnps" => "CNPs sent by slow restart",
        "roce_slow_restart_trans" => "transitions to slow restart",
        "rx_icrc_encapsulated" => "DROPS: packets with a bad ICRC",
        "resp_local_length_error" => "receives longer than the posted buffer",
        "resp_cqe_error" | "req_cqe_error" => "completions with an error",
        "resp_cqe_flush_error" | "req_cqe_flush_error" => "completions flushed by a QP in error",
        "req_remote_invalid_request" => "requests the peer rejected as invalid",
        "req_remote_access_errors" | "resp_remote_access_errors" => {
            "RDMA access violations (bad rkey or range)"
        }
        "rx_read_requests" => "RDMA READ requests received",
        "rx_write_requests" => "RDMA WRITE requests received",
        "rx_atomic_requests" => "atomic requests received",
        "rx_dct_connect" => "DC connections received",
        "lifespan" => "ms between hw_counter refreshes",
        _ => return None,
    })
}

fn state_name(s: PortState) -> String {
    match s {
        PortState::Active => "ACTIVE".into(),
        PortState::Other(1) => "DOWN".into(),
        PortState::Other(2) => "INIT".into(),
        PortState::Other(3) => "ARMED".into(),
        PortState::Other(n) => format!("state {n}"),
    }
}

fn link_name(l: LinkLayer) -> String {
    match l {
        LinkLayer::Ethernet => "Ethernet (RoCE)".into(),
        LinkLayer::InfiniBand => "InfiniBand".into(),
        LinkLayer::Unspecified(n) => format!("unknown link layer {n}"),
    }
}

/// Per-lane rate and lane count of the verbs encodings, e.g. ("25 Gb/s EDR", "4x").
fn speed_parts(speed: u8, width: u8) -> (String, String) {
    const LANE: [&str; 8] = [
        "2.5 Gb/s SDR",
        "5 Gb/s DDR",
        "10 Gb/s QDR",
        "10 Gb/s FDR10",
        "14 Gb/s FDR",
        "25 Gb/s EDR",
        "50 Gb/s HDR",
        "100 Gb/s NDR",
    ];
    const LANES: [&str; 5] = ["1x", "4x", "8x", "12x", "2x"];
    let lane = LANE
        .get(speed.trailing_zeros() as usize)
        .map_or(format!("code {speed}"), |s| s.to_string());
    let lanes = LANES
        .get(width.trailing_zeros() as usize)
        .map_or(format!("code {width}"), |s| s.to_string());
    (lane, lanes)
}

fn gid_kind(k: GidType) -> &'static str {
    match k {
        GidType::RoceV2 => "RoCE v2",
        GidType::RoceV1 => "RoCE v1",
        GidType::Unknown => "unknown",
    }
}

fn check_port(p: &Port, config: &Config, named: bool, add: &mut impl FnMut(Level, &str, String)) {
    let key = p.key();
    if !p.kept {
        return;
    }
    if p.state != PortState::Active {
        let asked = named || !config.ib_hca.is_empty();
        add(
            if asked { Level::Block } else { Level::Warn },
            &key,
            format!(
                "port is {}, not ACTIVE: the plugin skips it (check the cable/link with `ip link` and `rdma link show`)",
                state_name(p.state)
            ),
        );
        return;
    }
    match &p.choice {
        Err(e) => add(Level::Block, &key, format!("no usable GID: {e}")),
        Ok(c) => {
            let entry = p.gids.iter().find(|g| g.index == c.index);
            let kind = entry.map_or(GidType::Unknown, |g| g.kind);
            let want = if config.roce_version == 1 { GidType::RoceV1 } else { GidType::RoceV2 };
            let ethernet = p.link_layer == LinkLayer::Ethernet;
            if ethernet && kind != want && kind != GidType::Unknown {
                let better = p.gids.iter().find(|g| g.kind == want).map_or(String::new(), |g| {
                    format!("; index {} is {}", g.index, gid_kind(g.kind))
                });
                add(
                    Level::Block,
                    &key,
                    format!(
                        "{} chose GID index {}, a {} GID, but NCCL_IB_ROCE_VERSION_NUM={} wants {}{better}",
                        c.why,
                        c.index,
                        gid_kind(kind),
                        config.roce_version,
                        gid_kind(want)
                    ),
                );
            } else if ethernet && kind == GidType::Unknown {
                add(
                    Level::Warn,
                    &key,
                    format!(
                        "{} chose GID index {}, whose RoCE version sysfs does not say",
                        c.why, c.index
                    ),
                );
            }
            if gid::is_link_local_ip(c.ip()) {
                add(
                    Level::Warn,
                    &key,
                    format!(
                        "GID index {} is link-local ({}): a peer on another host cannot reach it",
                        c.index,
                        c.ip()
                    ),
                );
            }
        }
    }
    if let Some(mtu) = p.netdev_mtu
        && mtu >= NETDEV_FOR_4096
        && p.max_mtu >= 4096
        && p.active_mtu < 4096
    {
        add(
            Level::Warn,
            &key,
            format!(
                "{} has MTU {mtu}, enough for RoCE MTU 4096, but the port's active MTU is {}",
                p.netdev.as_deref().unwrap_or("?"),
                p.active_mtu
            ),
        );
    }
    if p.cc.is_empty() && p.software {
        add(
            Level::Note,
            &key,
            "congestion control not exposed by this driver (a software device: nothing to configure)".into(),
        );
    } else if p.cc.is_empty() && p.link_layer == LinkLayer::Ethernet {
        add(
            Level::Warn,
            &key,
            "congestion control (ECN/PFC) not visible in sysfs: check it with the vendor's tools (mlnx_qos, lldptool)".into(),
        );
    }
}

/// The path MTU of a connection is the smaller active MTU of its two ends: local ports that
/// differ (or whose interfaces do) mean some pairs run at the smaller one.
fn check_mtus(ports: &[Port], add: &mut impl FnMut(Level, &str, String)) {
    let used: Vec<&Port> =
        ports.iter().filter(|p| p.kept && p.state == PortState::Active).collect();
    let desc = |p: &Port| {
        format!(
            "{} (active {}, {} MTU {})",
            p.key(),
            p.active_mtu,
            p.netdev.as_deref().unwrap_or("?"),
            p.netdev_mtu.map_or("?".into(), |m| m.to_string())
        )
    };
    let differ = |f: &dyn Fn(&Port) -> Option<u32>| {
        let vals: std::collections::BTreeSet<u32> = used.iter().filter_map(|p| f(p)).collect();
        vals.len() > 1
    };
    if differ(&|p| Some(p.active_mtu)) || differ(&|p| p.netdev_mtu) {
        let all: Vec<String> = used.iter().map(|p| desc(p)).collect();
        add(
            Level::Warn,
            "mtu",
            format!(
                "MTU mismatch between ports: {}; connections between them run at the smaller, and a switch port set lower drops the larger frames",
                all.join(", ")
            ),
        );
    }
}

struct Memlock {
    soft: Option<u64>,
    hard: Option<u64>,
    ipc_lock: bool,
}

impl Memlock {
    fn read() -> Memlock {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a valid out-pointer for getrlimit.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0;
        let lim = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
        // CAP_IPC_LOCK (bit 14) in the effective set: the kernel does not apply the limit.
        let ipc_lock = read("/proc/self/status")
            .and_then(|s| {
                let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
                u64::from_str_radix(&hex, 16).ok()
            })
            .is_some_and(|caps| caps & (1 << 14) != 0);
        if ok {
            Memlock { soft: lim(r.rlim_cur), hard: lim(r.rlim_max), ipc_lock }
        } else {
            Memlock { soft: Some(0), hard: Some(0), ipc_lock }
        }
    }

    fn show(v: Option<u64>) -> String {
        v.map_or("unlimited".into(), |b| format!("{} KiB", b / 1024))
    }

    fn check(&self, add: &mut impl FnMut(Level, &str, String)) {
        let Some(soft) = self.soft else { return };
        if self.ipc_lock {
            return;
        }
        if soft < MEMLOCK_BLOCK {
            add(
                Level::Block,
                "memlock",
                format!(
                    "RLIMIT_MEMLOCK is {} (under {} MiB) and the process lacks CAP_IPC_LOCK: registering NCCL's buffers will fail; run with `ulimit -l unlimited`",
                    Self::show(Some(soft)),
                    MEMLOCK_BLOCK >> 20
                ),
            );
        } else {
            add(
                Level::Warn,
                "memlock",
                format!(
                    "RLIMIT_MEMLOCK is {}: a large job may exceed it; `ulimit -l unlimited` is safer",
                    Self::show(Some(soft))
                ),
            );
        }
    }
}

/// The NCCL and ferroce variables currently set, sorted.
fn knob_env() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("FERROCE_"))
        .collect();
    v.sort();
    v
}

/// What the plugin does with a variable of the environment.
fn knob_meaning(name: &str) -> String {
    match ferroce::config::KNOBS.iter().find(|k| k.name == name) {
        Some(k) => format!("{}; default {}", k.meaning, k.default),
        None if name.starts_with("NCCL_") => "read by NCCL, not by the plugin".into(),
        None => "not a knob of the plugin".into(),
    }
}

fn advice(ports: &[Port], config: &Config, memlock: &Memlock) -> Vec<String> {
    let mut out = vec!["export NCCL_NET_PLUGIN=ferroce".to_string()];
    let used: Vec<&Port> = ports
        .iter()
        .filter(|p| p.kept && p.state == PortState::Active && p.choice.is_ok())
        .collect();
    if !used.is_empty() {
        let list: Vec<String> = used.iter().map(|p| p.key()).collect();
        out.push(format!("export NCCL_IB_HCA=={}", list.join(",")));
        let idx: std::collections::BTreeSet<u8> =
            used.iter().filter_map(|p| p.choice.as_ref().ok().map(|c| c.index)).collect();
        let forced = config.gid_index.is_some() || !config.gid_index_per_dev.is_empty();
        if !forced {
            if idx.len() == 1 {
                out.push(format!(
                    "export NCCL_IB_GID_INDEX={}   # optional: pins the automatic choice (the same on every port here)",
                    idx.iter().next().unwrap_or(&0)
                ));
            } else {
                let per: Vec<String> = used
                    .iter()
                    .filter_map(|p| Some(format!("{}:{}", p.dev, p.choice.as_ref().ok()?.index)))
                    .collect();
                out.push(format!(
                    "export FERROCE_GID_INDEX={}   # optional: pins the automatic choice per device",
                    per.join(",")
                ));
            }
        }
        if used.iter().any(|p| p.max_mtu >= 4096 && p.active_mtu < 4096) {
            out.push(format!(
                "# RoCE MTU 4096 needs a netdev MTU of at least {NETDEV_FOR_4096} (9000 is usual) on the NICs and every switch port"
            ));
        }
    }
    if memlock.soft.is_some() {
        out.push("ulimit -l unlimited   # or LimitMEMLOCK=infinity / --ulimit memlock=-1 / the IPC_LOCK capability".into());
    }
    out
}

// ---- self-test ----

struct SelfTest {
    from: String,
    to: String,
    bytes: usize,
    seconds: f64,
    /// (port, counter, delta) for every counter that moved.
    deltas: Vec<(String, String, u64)>,
}

fn selftest(plugin: &str, names: &[String]) -> Result<SelfTest, String> {
    use crate::harness::driver::{Close, Driver, until};
    use crate::harness::loader::ECHO;
    let lib = open_plugin(plugin)?;
    ECHO.store(false, std::sync::atomic::Ordering::Relaxed);
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let n = drv.devices()?;
    let (send_dev, recv_dev) = if n >= 2 { (0, 1) } else { (0, 0) };
    if n < 1 {
        return Err("self-test: the plugin has no device".into());
    }
    let name = |d: i32| names.get(d as usize).cloned().unwrap_or(format!("device {d}"));
    let before: Vec<_> = [send_dev, recv_dev].iter().map(|&d| counter_map(&name(d))).collect();
    let (mut handle, listen) = drv.listen(ctx, recv_dev)?;
    let (send, recv) = drv.connect_both(ctx, send_dev, &mut handle, listen, SELFTEST_LIMIT)?;
    drv.close(Close::Listen, listen)?;
    let mut src: Vec<u8> = (0..SELFTEST_MSG).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; SELFTEST_MSG];
    let smh = drv.reg_mr(send, src.as_mut_ptr(), SELFTEST_MSG)?;
    let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), SELFTEST_MSG)?;
    // Up to SELFTEST_DEPTH messages in flight, as NCCL keeps several: receives first.
    let t0 = Instant::now();
    let deadline = t0 + SELFTEST_LIMIT;
    let (mut posted, mut done) = (0, 0);
    let mut flight = std::collections::VecDeque::new();
    while done < SELFTEST_MSGS {
        if Instant::now() > deadline {
            return Err(format!(
                "self-test: {done} of {SELFTEST_MSGS} messages within {SELFTEST_LIMIT:?}"
            ));
        }
        if posted < SELFTEST_MSGS && flight.len() < SELFTEST_DEPTH {
            let r = until("irecv", SELFTEST_LIMIT, || {
                drv.irecv(recv, &[dst.as_mut_ptr()], &[SELFTEST_MSG], &[0], &[rmh], false)
            })?;
            let s = until("isend", SELFTEST_LIMIT, || {
                drv.isend(send, src.as_mut_ptr(), SELFTEST_MSG, 0, smh)
            })?;
            flight.push_back((Some(s), Some(r)));
            posted += 1;
        }
        if let Some((s, r)) = flight.front_mut() {
            if let Some(q) = *s
                && drv.test(q)?.is_some()
            {
                *s = None;
            }
            if let Some(q) = *r
                && drv.test(q)?.is_some()
            {
                *r = None;
            }
            if s.is_none() && r.is_none() {
                flight.pop_front();
                done += 1;
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let ok = dst == src;
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    if !ok {
        return Err("self-test: the data arrived corrupted".into());
    }
    let mut deltas = Vec::new();
    for (i, d) in [send_dev, recv_dev].iter().enumerate() {
        if i == 1 && recv_dev == send_dev {
            break;
        }
        for (k, v) in counter_map(&name(*d)) {
            let was = before[i].get(&k).copied().unwrap_or(0);
            if v != was {
                deltas.push((name(*d), k, v.wrapping_sub(was)));
            }
        }
    }
    Ok(SelfTest {
        from: name(send_dev),
        to: name(recv_dev),
        bytes: SELFTEST_MSG * SELFTEST_MSGS,
        seconds,
        deltas,
    })
}

/// The plugin as NCCL would open it, else (a bare name) `libnccl-net-NAME.so` beside this
/// binary, where `ci/build.sh` puts it.
fn open_plugin(name: &str) -> Result<crate::harness::loader::Library, String> {
    use crate::harness::loader::Library;
    let first = Library::open_like_nccl(name);
    if first.is_ok() || name.contains('/') {
        return first;
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join(format!("libnccl-net-{name}.so"))))
        .filter(|p| p.exists());
    match beside {
        Some(p) => Library::open(&p.to_string_lossy()),
        None => first,
    }
}

/// `dev:port` → its counters by `group/name`.
fn counter_map(key: &str) -> BTreeMap<String, u64> {
    let Some((dev, port)) = key.rsplit_once(':') else { return BTreeMap::new() };
    let Ok(port) = port.parse() else { return BTreeMap::new() };
    counters(dev, port).into_iter().map(|c| (format!("{}/{}", c.group, c.name), c.value)).collect()
}

// ---- output ----

/// Everything the doctor found, as both outputs show it.
struct Report<'a> {
    ports: &'a [Port],
    findings: &'a [Finding],
    memlock: &'a Memlock,
    env: &'a [(String, String)],
    advice: &'a [String],
    selftest: Option<&'a SelfTest>,
}

fn text(r: &Report) -> String {
    let Report { ports, findings, memlock, env, advice, selftest } = *r;
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "ferroce doctor: {} RDMA port(s)", ports.len());
    for p in ports {
        let _ = writeln!(
            w,
            "\n== {} port {}{}",
            p.dev,
            p.port,
            if p.kept { "" } else { " (filtered out by NCCL_IB_HCA)" }
        );
        let (lane, lanes) = speed_parts(p.active_speed, p.active_width);
        let _ = writeln!(w, "Port");
        let _ =
            writeln!(w, "  state        {} (only ACTIVE ports carry traffic)", state_name(p.state));
        let _ = writeln!(w, "  link layer   {}", link_name(p.link_layer));
        let _ = writeln!(
            w,
            "  speed        {lane} x {lanes} = {} Mb/s (per-lane rate x lanes, as the port reports it{})",
            speed_mbps(p.active_speed, p.active_width),
            if p.software { "; nominal on a software device" } else { "" }
        );
        let _ = writeln!(w, "  netdev       {}", p.netdev.as_deref().unwrap_or("(none)"));
        let _ = writeln!(
            w,
            "  MTU          netdev {} / active {} / max {} (bytes: the Ethernet MTU of the interface; the RoCE payload MTU the port uses now; the largest it supports)",
            p.netdev_mtu.map_or("?".into(), |m| m.to_string()),
            p.active_mtu,
            p.max_mtu
        );
        let _ = writeln!(w, "GID table (index, version, address, interface)");
        if p.gids.is_empty() {
            let _ = writeln!(w, "  (empty)");
        }
        for g in &p.gids {
            let mark = matches!(&p.choice, Ok(c) if c.index == g.index);
            let _ = writeln!(
                w,
                "  {} {:>3}  {:<8} {:<40} {}",
                if mark { "*" } else { " " },
                g.index,
                gid_kind(g.kind),
                gid::ip_of(&g.gid).to_string(),
                g.netdev.as_deref().unwrap_or("-")
            );
        }
        match &p.choice {
            Ok(c) => {
                let _ = writeln!(w, "  ferroce uses * index {}: {}", c.index, c.why);
            }
            Err(e) => {
                let _ = writeln!(w, "  ferroce has no GID here: {e}");
            }
        }
        let _ = writeln!(
            w,
            "Congestion control (read from /sys/class/net/{}/)",
            p.netdev.as_deref().unwrap_or("?")
        );
        if p.cc.is_empty() {
            let _ = writeln!(
                w,
                "  not exposed by this driver{}",
                if p.software {
                    " (a software device: no NIC queues, no ECN marking, no PFC)"
                } else {
                    ""
                }
            );
        }
        for (k, v) in &p.cc {
            let _ = writeln!(w, "  {k} = {v}");
        }
        let _ = writeln!(
            w,
            "Counters (since the device appeared; /sys/class/infiniband/{}/ports/{}/)",
            p.dev, p.port
        );
        if p.counters.is_empty() {
            let _ = writeln!(w, "  none exposed");
        }
        for c in &p.counters {
            let _ = writeln!(
                w,
                "  {:<11} {:<28} {:>14}  {}",
                c.group,
                c.name,
                c.value,
                meaning(&c.name).unwrap_or("")
            );
        }
        if let Some(g) = &p.gdr {
            let _ = writeln!(w, "GPUDirect\n  {g}");
        }
    }
    let _ = writeln!(w, "\n== Limits and environment");
    let _ = writeln!(
        w,
        "  RLIMIT_MEMLOCK  soft {} / hard {} (memory a process may pin for RDMA){}",
        Memlock::show(memlock.soft),
        Memlock::show(memlock.hard),
        if memlock.ipc_lock { "; CAP_IPC_LOCK is held, so the limit does not apply" } else { "" }
    );
    if env.is_empty() {
        let _ = writeln!(w, "  no NCCL_* or FERROCE_* variable is set");
    }
    for (k, v) in env {
        let _ = writeln!(w, "  {k}={v}   ({})", knob_meaning(k));
    }
    if let Some(s) = selftest {
        let _ = writeln!(w, "\n== Self-test");
        let mb = s.bytes as f64 / 1e6;
        let _ = writeln!(
            w,
            "  {} -> {}: {} x {} MiB in {:.3} s = {:.1} MB/s ({:.2} Gb/s) through the plugin's C ABI",
            s.from,
            s.to,
            SELFTEST_MSGS,
            SELFTEST_MSG >> 20,
            s.seconds,
            mb / s.seconds,
            mb * 8.0 / 1000.0 / s.seconds
        );
        for (port, k, d) in &s.deltas {
            let name = k.rsplit('/').next().unwrap_or(k);
            let _ = writeln!(w, "  {port:<8} {k:<36} +{d:<12} {}", meaning(name).unwrap_or(""));
        }
    }
    let _ = writeln!(w, "\n== Advice");
    for a in advice {
        let _ = writeln!(w, "  {a}");
    }
    let _ = writeln!(w, "\n== Findings");
    if findings.is_empty() {
        let _ = writeln!(w, "  none: nothing blocks ferroce on this host");
    }
    for f in findings {
        let _ = writeln!(w, "{:<5} {}: {}", f.level.name(), f.about, f.what);
    }
    o
}

/// A JSON string literal.
fn js(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o += "\\\"",
            '\\' => o += "\\\\",
            '\n' => o += "\\n",
            c if (c as u32) < 0x20 => o += &format!("\\u{:04x}", c as u32),
            c => o.push(c),
        }
    }
    o + "\""
}

fn jopt(s: Option<&str>) -> String {
    s.map_or("null".into(), js)
}

fn json(r: &Report) -> String {
    let Report { ports, findings, memlock, env, advice, selftest } = *r;
    let num = |v: Option<u64>| v.map_or("null".into(), |v| v.to_string());
    let mut devs = Vec::new();
    for p in ports {
        let gids: Vec<String> = p
            .gids
            .iter()
            .map(|g| {
                format!(
                    "{{\"index\":{},\"type\":{},\"ip\":{},\"netdev\":{}}}",
                    g.index,
                    js(gid_kind(g.kind)),
                    js(&gid::ip_of(&g.gid).to_string()),
                    jopt(g.netdev.as_deref())
                )
            })
            .collect();
        let choice = match &p.choice {
            Ok(c) => format!(
                "{{\"index\":{},\"ip\":{},\"why\":{}}}",
                c.index,
                js(&c.ip().to_string()),
                js(&c.why)
            ),
            Err(e) => format!("{{\"error\":{}}}", js(e)),
        };
        let cc: Vec<String> = p.cc.iter().map(|(k, v)| format!("{}:{}", js(k), js(v))).collect();
        let counters: Vec<String> = p
            .counters
            .iter()
            .map(|c| {
                format!(
                    "{{\"group\":{},\"name\":{},\"value\":{},\"meaning\":{}}}",
                    js(c.group),
                    js(&c.name),
                    c.value,
                    jopt(meaning(&c.name))
                )
            })
            .collect();
        devs.push(format!(
            "{{\"dev\":{},\"port\":{},\"kept\":{},\"state\":{},\"link_layer\":{},\"speed_mbps\":{},\"netdev\":{},\"mtu\":{{\"netdev\":{},\"active\":{},\"max\":{}}},\"gids\":[{}],\"gid_choice\":{},\"congestion_control\":{},\"software_device\":{},\"counters\":[{}],\"gpudirect\":{}}}",
            js(&p.dev),
            p.port,
            p.kept,
            js(&state_name(p.state)),
            js(&link_name(p.link_layer)),
            speed_mbps(p.active_speed, p.active_width),
            jopt(p.netdev.as_deref()),
            num(p.netdev_mtu.map(u64::from)),
            p.active_mtu,
            p.max_mtu,
            gids.join(","),
            choice,
            if cc.is_empty() { "null".into() } else { format!("{{{}}}", cc.join(",")) },
            p.software,
            counters.join(","),
            jopt(p.gdr.as_deref()),
        ));
    }
    let blocking = findings.iter().any(|f| f.level == Level::Block);
    let findings: Vec<String> = findings
        .iter()
        .map(|f| {
            format!(
                "{{\"level\":{},\"about\":{},\"what\":{}}}",
                js(f.level.name()),
                js(&f.about),
                js(&f.what)
            )
        })
        .collect();
    let env: Vec<String> = env
        .iter()
        .map(|(k, v)| {
            format!("{}:{{\"value\":{},\"meaning\":{}}}", js(k), js(v), js(&knob_meaning(k)))
        })
        .collect();
    let advice: Vec<String> = advice.iter().map(|a| js(a)).collect();
    let selftest = selftest.map_or("null".into(), |s| {
        let d: Vec<String> = s
            .deltas
            .iter()
            .map(|(p, k, d)| format!("{{\"port\":{},\"counter\":{},\"delta\":{d}}}", js(p), js(k)))
            .collect();
        format!(
            "{{\"from\":{},\"to\":{},\"bytes\":{},\"seconds\":{:.6},\"mb_per_s\":{:.1},\"counter_deltas\":[{}]}}",
            js(&s.from),
            js(&s.to),
            s.bytes,
            s.seconds,
            s.bytes as f64 / 1e6 / s.seconds,
            d.join(",")
        )
    });
    format!(
        "{{\"ports\":[{}],\"memlock\":{{\"soft\":{},\"hard\":{},\"cap_ipc_lock\":{}}},\"env\":{{{}}},\"selftest\":{},\"advice\":[{}],\"findings\":[{}],\"blocking\":{}}}\n",
        devs.join(","),
        num(memlock.soft),
        num(memlock.hard),
        memlock.ipc_lock,
        env.join(","),
        selftest,
        advice.join(","),
        findings.join(","),
        blocking
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(kinds: &[(u8, &str, GidType)], config: &Config) -> Port {
        let gids: Vec<GidEntry> = kinds
            .iter()
            .map(|(index, ip, kind)| GidEntry {
                index: *index,
                gid: ip.parse::<std::net::Ipv6Addr>().unwrap().octets(),
                kind: *kind,
                netdev: Some("eth0".into()),
            })
            .collect();
        Port {
            dev: "mlx5_0".into(),
            port: 1,
            kept: true,
            state: PortState::Active,
            link_layer: LinkLayer::Ethernet,
            active_speed: 32,
            active_width: 2,
            active_mtu: 4096,
            max_mtu: 4096,
            netdev: Some("eth0".into()),
            netdev_mtu: Some(9000),
            choice: gid::choose("mlx5_0", &gids, config, true).map_err(|e| e.to_string()),
            gids,
            cc: vec![("ecn/roce_np/enable/3".into(), "1".into())],
            software: false,
            counters: Vec::new(),
            gdr: None,
        }
    }

    fn findings(p: &Port, config: &Config) -> Vec<(Level, String)> {
        let mut out = Vec::new();
        check_port(p, config, false, &mut |l, _: &str, w| out.push((l, w)));
        out
    }

    fn config(vars: &[(&str, &str)]) -> Config {
        Config::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
            .unwrap()
    }

    const TABLE: [(u8, &str, GidType); 3] = [
        (0, "fe80::1", GidType::RoceV1),
        (1, "::ffff:10.0.0.1", GidType::RoceV1),
        (3, "::ffff:10.0.0.1", GidType::RoceV2),
    ];

    #[test]
    fn a_gid_index_at_a_v1_gid_blocks_and_names_the_v2_one() {
        let c = config(&[("NCCL_IB_GID_INDEX", "1")]);
        let f = findings(&port(&TABLE, &c), &c);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, Level::Block);
        assert!(f[0].1.contains("NCCL_IB_GID_INDEX=1") && f[0].1.contains("RoCE v1"), "{f:?}");
        assert!(f[0].1.contains("index 3 is RoCE v2"), "{f:?}");
    }

    #[test]
    fn the_automatic_choice_on_a_good_port_finds_nothing() {
        let c = config(&[]);
        let p = port(&TABLE, &c);
        assert_eq!(p.choice.as_ref().unwrap().index, 3);
        assert!(findings(&p, &c).is_empty());
    }

    #[test]
    fn a_low_active_mtu_under_a_jumbo_netdev_warns() {
        let c = config(&[]);
        let mut p = port(&TABLE, &c);
        p.active_mtu = 1024;
        let f = findings(&p, &c);
        assert!(f.len() == 1 && f[0].0 == Level::Warn && f[0].1.contains("MTU 9000"), "{f:?}");
        p.netdev_mtu = Some(1500);
        assert!(findings(&p, &c).is_empty(), "1500 cannot carry 4096");
    }

    #[test]
    fn hardware_without_visible_congestion_control_warns() {
        let c = config(&[]);
        let mut p = port(&TABLE, &c);
        p.cc.clear();
        let f = findings(&p, &c);
        assert!(f.len() == 1 && f[0].0 == Level::Warn && f[0].1.contains("ECN/PFC"), "{f:?}");
        p.software = true;
        assert_eq!(findings(&p, &c)[0].0, Level::Note);
    }

    #[test]
    fn a_port_not_active_blocks_when_asked_for() {
        let c = config(&[]);
        let mut p = port(&TABLE, &c);
        p.state = PortState::Other(1);
        assert_eq!(findings(&p, &c)[0].0, Level::Warn, "skipped among others");
        let c = config(&[("NCCL_IB_HCA", "mlx5_0")]);
        assert_eq!(findings(&p, &c)[0].0, Level::Block, "named by NCCL_IB_HCA");
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(js("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
    }

    #[test]
    fn arguments_are_checked() {
        let a = |v: &[&str]| parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(a(&["--dev"]).is_err());
        assert!(a(&["--nope"]).is_err());
        let o = a(&["--dev", "rxe1", "--json", "--selftest"]).unwrap();
        assert!(o.dev.as_deref() == Some("rxe1") && o.json && o.selftest);
    }
}
