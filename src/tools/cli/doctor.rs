//! `ferroce doctor [--dev NAME] [--json] [--selftest] [--peer HOST:PORT] [--plugin
//! NAME_OR_PATH]`: explains this host's RoCE set-up in one screen per device, with the
//! plugin's own decisions (device discovery, `NCCL_IB_HCA`, the GID choice, GPUDirect
//! detection, the knob parser), and says what blocks NCCL from using ferroce. Devices, GIDs
//! and their sysfs facts are read through the plugin's own code (`ferroce::transport::device`,
//! `ferroce::verbs::sysfs`), so what doctor shows is what the plugin would do.
//!
//! With `--peer`, the other end is a `ferroce perf --listen` on another host, reached through
//! perf's ranks and control connection ([`crate::perf::Pair`]): it answers `PORT` with its port
//! facts ([`port_facts`], from the same code as this host's screen), the two ends are compared
//! (MTUs), and the plugin connects to it; `--selftest` then sends to it instead of between two
//! local devices.
//!
//! Every finding is one line with a level:
//! - `BLOCK`: NCCL cannot use ferroce on this host as configured (exit status 1);
//! - `WARN`: it works, but worse than it could, or a knob is probably not what was meant;
//! - `NOTE`: a fact worth knowing that needs no action.
//!
//! Nothing is written: sysfs is only read, and the self-test moves data between two local
//! ports (the `--dev` one sending, the next device NCCL sees receiving) or to the peer,
//! through the plugin's C ABI, as NCCL would.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use ferroce::config::Config;
use ferroce::transport::device::{self, gid_table, mtu_bytes, nccl_speed_mbps, nccl_table_index};
use ferroce::transport::gid::{self, GidChoice, GidEntry, GidType};
use ferroce::verbs::{self, LinkLayer, PortState, sysfs};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::{ECHO, Library};
use ferroce_tools::out::rounded;
use ferroce_tools::wait::until;
use serde_json::{Value, json};

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
    active_speed_ex: u32,
    active_width: u8,
    /// `ibv_query_port_speed` in units of 100 Mb/s, where libibverbs has it.
    port_speed: Option<u64>,
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
    /// What the plugin tells NCCL about this port, when discovery kept it.
    nccl: Option<InUse>,
}

/// A port the plugin offers NCCL, as `getProperties` describes it.
#[derive(Clone, Debug)]
struct InUse {
    /// NCCL's device number.
    index: usize,
    /// The plugin's name for it.
    name: String,
    /// The port number NCCL is told (not always the verbs port: see `device::nccl_places`).
    port: i32,
    pci_path: Option<String>,
    /// The plugin's GPUDirect decision.
    gdr: String,
}

impl Port {
    fn key(&self) -> String {
        format!("{}:{}", self.dev, self.port)
    }
}

/// Explain this host's RoCE set-up and what blocks NCCL from using ferroce
///
/// One screen per device: ports, MTUs, GIDs and the plugin's choice, congestion control,
/// counters, memlock, GPUDirect, the knobs set, and advice. Exit status 1 names each blocking
/// problem.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// This host's device or port (rxe0, mlx5_0:1): the only one shown, the self-test's sender
    #[arg(long, value_name = "NAME")]
    dev: Option<String>,
    /// One JSON object instead of the text
    #[arg(long)]
    json: bool,
    /// A short verified transfer: to the next local device NCCL sees, or to --peer
    #[arg(long)]
    selftest: bool,
    /// A `ferroce perf --listen [--dev D]` on the other host (the HOST:PORT it prints): its port
    /// facts beside ours, MTU mismatches between the two ends
    #[arg(long, value_name = "HOST:PORT", value_parser = host_port)]
    peer: Option<String>,
    /// The plugin as NCCL_NET_PLUGIN names it, or a path
    #[arg(long, value_name = "NAME_OR_PATH", default_value = "ferroce")]
    plugin: String,
}

/// `HOST:PORT` with a host and a port from 1 to 65535 (`[fe80::1]:4000` included).
fn host_port(v: &str) -> Result<String, String> {
    let ok = v
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if ok { Ok(v.into()) } else { Err("not HOST:PORT".into()) }
}

/// The entry point: prints the report; an error (exit status 1) when something blocks.
pub fn doctor(opts: &Args) -> Result<(), String> {
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

    let (nccl, in_use, fusion) = plugin_devices(&config, &mut add);
    let mut ports = read_ports(&config, &in_use)?;
    check_ports(opts, &config, &mut ports, &mut add);
    let memlock = Memlock::read();
    memlock.check(&mut add);
    let (selftest, peer) = transfers(opts, &nccl, &ports, &mut add);
    let env = knob_env();
    let advice = advice(&ports, &config, &memlock);
    findings.sort_by_key(|f| std::cmp::Reverse(f.level));

    let report = Report {
        fusion: &fusion,
        ports: &ports,
        findings: &findings,
        memlock: &memlock,
        env: &env,
        advice: &advice,
        selftest: selftest.as_ref(),
        peer: peer.as_ref(),
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

/// The NIC fusion NCCL would ask for on this host, and what ferroce does with it.
struct Fusion {
    /// `NCCL_NET_MERGE_LEVEL` (NCCL's default: `PORT`, the ports of one NIC).
    level: String,
    /// `NCCL_NET_FORCE_MERGE`, if set: the groups NCCL fuses as named.
    force: Option<String>,
    /// `NCCL_IB_MERGE_NICS`: ferroce's makeVDevice fuses (else refuses).
    merge_nics: bool,
    /// The ports of each NIC with more than one port NCCL sees (one pciPath): (NCCL's device
    /// number, the plugin's name).
    groups: Vec<Vec<(usize, String)>>,
}

impl Fusion {
    fn of(devs: &[device::NetDevice], config: &Config) -> Fusion {
        let mut groups: Vec<(String, Vec<(usize, String)>)> = Vec::new();
        for (i, d) in devs.iter().enumerate() {
            let Some(path) = &d.pci_path else { continue };
            match groups.iter_mut().find(|(p, _)| p == path) {
                Some((_, g)) => g.push((i, d.name.clone())),
                None => groups.push((path.clone(), vec![(i, d.name.clone())])),
            }
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Fusion {
            level: env("NCCL_NET_MERGE_LEVEL").unwrap_or_else(|| "PORT".into()),
            force: env("NCCL_NET_FORCE_MERGE"),
            merge_nics: config.merge_nics,
            groups: groups.into_iter().map(|(_, g)| g).filter(|g| g.len() > 1).collect(),
        }
    }

    /// Its lines, for the text report.
    fn lines(&self) -> Vec<String> {
        let names = |g: &[(usize, String)]| {
            let n: Vec<&str> = g.iter().map(|(_, n)| n.as_str()).collect();
            let i: Vec<String> = g.iter().map(|(i, _)| i.to_string()).collect();
            format!("{} (devices {})", n.join("+"), i.join(", "))
        };
        let mut out = Vec::new();
        if !self.merge_nics {
            out.push(
                "NCCL_IB_MERGE_NICS=0: ferroce refuses makeVDevice, so NCCL uses each port alone"
                    .to_string(),
            );
        }
        let verb = if self.merge_nics { "NCCL fuses" } else { "NCCL would fuse" };
        for g in &self.groups {
            out.push(format!(
                "{verb} {} into one device (ports of one NIC, NCCL_NET_MERGE_LEVEL={}); its \
                 connections open lanes on every member port and fail over between them",
                names(g),
                self.level
            ));
        }
        if self.groups.is_empty() {
            out.push(format!(
                "no two ports NCCL sees share a NIC: at NCCL_NET_MERGE_LEVEL={} NCCL fuses \
                 nothing and uses each port alone",
                self.level
            ));
        }
        if self.level != "PORT" {
            out.push(format!(
                "NCCL_NET_MERGE_LEVEL={} also fuses NICs that close on the PCI tree; doctor \
                 shows only the ports of one NIC",
                self.level
            ));
        }
        if let Some(f) = &self.force {
            out.push(format!("NCCL_NET_FORCE_MERGE={f}: NCCL fuses these groups as named"));
        }
        out
    }
}

/// What the plugin itself would do at init: NCCL's devices in its numbering, as (port key
/// `dev:port`, the plugin's name for it), what it tells NCCL about each port it uses, and the
/// fusion NCCL would get.
fn plugin_devices(
    config: &Config,
    add: &mut impl FnMut(Level, &str, String),
) -> (Vec<(String, String)>, BTreeMap<String, InUse>, Fusion) {
    let devs = match device::discover(config) {
        Ok(devs) => devs,
        Err(e) => {
            add(Level::Block, "discovery", format!("the plugin finds no usable device: {e}"));
            return (Vec::new(), BTreeMap::new(), Fusion::of(&[], config));
        }
    };
    let fusion = Fusion::of(&devs, config);
    let key = |d: &device::NetDevice| format!("{}:{}", d.ctx.name(), d.port);
    let nccl = devs.iter().map(|d| (key(d), d.name.clone())).collect();
    let in_use = devs
        .iter()
        .enumerate()
        .map(|(index, d)| {
            if let Some(w) = &d.gdr.warning {
                add(Level::Warn, &d.name, w.clone());
            }
            let used = InUse {
                index,
                name: d.name.clone(),
                port: d.nccl_port,
                pci_path: d.pci_path.clone(),
                gdr: d.gdr.why.clone(),
            };
            (key(d), used)
        })
        .collect();
    (nccl, in_use, fusion)
}

/// Narrows `ports` to `--dev`, and names what is wrong with each port and between them.
fn check_ports(
    opts: &Args,
    config: &Config,
    ports: &mut Vec<Port>,
    add: &mut impl FnMut(Level, &str, String),
) {
    if let Some(want) = &opts.dev {
        ports.retain(|p| &p.dev == want || &p.key() == want);
        if ports.is_empty() {
            add(Level::Block, "--dev", format!("{want:?} names no RDMA device or port"));
        }
        for p in ports.iter_mut() {
            p.kept = true;
        }
    }
    if !config.ib_hca.is_empty() {
        let names: Vec<&str> = ports.iter().map(|p| p.dev.as_str()).collect();
        for typo in config.ib_hca.unmatched(&names) {
            add(
                Level::Warn,
                "env",
                format!("NCCL_IB_HCA={}: {typo:?} matches no RDMA device", config.ib_hca.raw),
            );
        }
    }
    for p in ports.iter() {
        check_port(p, config, opts.dev.is_some(), add);
    }
    check_mtus(ports, add);
}

/// The self-test and the peer connection, as asked for: what they measured and learnt.
fn transfers(
    opts: &Args,
    nccl: &[(String, String)],
    ports: &[Port],
    add: &mut impl FnMut(Level, &str, String),
) -> (Option<SelfTest>, Option<PeerReport>) {
    if !opts.selftest && opts.peer.is_none() {
        return (None, None);
    }
    // The sending device, in NCCL's numbering.
    let i = match sender(opts.dev.as_deref(), nccl) {
        Ok(i) => i,
        Err(e) => {
            add(Level::Block, if opts.peer.is_some() { "peer" } else { "self-test" }, e);
            return (None, None);
        }
    };
    if let Some(addr) = &opts.peer {
        let (p, s) = with_peer(addr, opts, &nccl[i], ports, add);
        return (s, Some(p));
    }
    match local_selftest(&opts.plugin, nccl, i) {
        Ok(s) => (Some(s), None),
        Err(e) => {
            add(Level::Block, "self-test", e);
            (None, None)
        }
    }
}

/// Every port of every RDMA device, with what the plugin would choose on it.
fn read_ports(config: &Config, in_use: &BTreeMap<String, InUse>) -> Result<Vec<Port>, String> {
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
                .or_else(|| sysfs::gid_netdev(&dev, port, 0));
            let netdev_mtu = netdev.as_ref().and_then(|n| {
                read(&Path::new(sysfs::ROOT).join("class/net").join(n).join("mtu"))?.parse().ok()
            });
            let software = sysfs::pci_function(Path::new(sysfs::ROOT), &dev).is_none();
            ports.push(Port {
                kept: config.ib_hca.select(&dev, port.into()).is_some(),
                nccl: in_use.get(&format!("{dev}:{port}")).cloned(),
                port_speed: ctx.query_port_speed(port),
                cc: netdev.as_deref().map(congestion_control).unwrap_or_default(),
                counters: counters(&dev, port),
                dev,
                port,
                state: pa.state,
                link_layer: pa.link_layer,
                active_speed: pa.active_speed,
                active_speed_ex: pa.active_speed_ex,
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

/// A sysfs file outside what `ferroce::verbs::sysfs` reads for the plugin (the netdev's MTU,
/// ECN and QoS files, the standard port counters), trimmed; `None` where it is missing.
fn read(path: &Path) -> Option<String> {
    Some(std::fs::read_to_string(path).ok()?.trim().to_string())
}

/// Files under `dir`, sorted, with their trimmed contents (unreadable ones left out).
fn files(dir: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<(String, String)> = entries
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| Some((e.file_name().to_string_lossy().into_owned(), read(&e.path())?)))
        .collect();
    out.sort();
    out
}

/// ECN (per priority: `ecn/roce_np/enable/N` marks and answers with CNPs, `ecn/roce_rp/enable/N`
/// slows down on CNPs: together DCQCN), PFC and trust mode (`qos/pfc`, `qos/trust`, as
/// MLNX_OFED's mlx5 exposes them), wherever the driver puts them under the netdev.
fn congestion_control(netdev: &str) -> Vec<(String, String)> {
    let base = Path::new(sysfs::ROOT).join("class/net").join(netdev);
    let mut out = Vec::new();
    for side in ["roce_np", "roce_rp"] {
        for (prio, v) in files(&base.join("ecn").join(side).join("enable")) {
            out.push((format!("ecn/{side}/enable/{prio}"), v));
        }
    }
    for f in ["pfc", "trust", "dscp2prio", "tc_bw"] {
        if let Some(v) = read(&base.join("qos").join(f)) {
            out.push((format!("qos/{f}"), v.lines().collect::<Vec<_>>().join(" | ")));
        }
    }
    out
}

/// The port's standard counters (`counters/`) and the driver's own (`hw_counters/`, as the
/// plugin reads them).
fn counters(dev: &str, port: u8) -> Vec<Counter> {
    let dir = Path::new(sysfs::ROOT).join(format!("class/infiniband/{dev}/ports/{port}/counters"));
    let standard = files(&dir).into_iter().filter_map(|(name, v)| Some((name, v.parse().ok()?)));
    let standard = standard.map(|(name, value)| Counter { group: "counters", name, value });
    let hw = sysfs::hw_counters(dev, port).into_iter();
    standard.chain(hw.map(|(name, value)| Counter { group: "hw_counters", name, value })).collect()
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

/// The port speed NCCL is told, in Mb/s, and how it is derived, e.g. "25 Gb/s EDR x 4x from
/// active_speed 32, active_width 2": the verbs codes read as NCCL reads them (an unknown code
/// takes the last entry of the table).
fn speed_of(p: &Port) -> (i32, String) {
    const LANE: [&str; 9] = [
        "2.5 Gb/s SDR",
        "5 Gb/s DDR",
        "10 Gb/s QDR",
        "10 Gb/s FDR10",
        "14 Gb/s FDR",
        "25 Gb/s EDR",
        "50 Gb/s HDR",
        "100 Gb/s NDR",
        "200 Gb/s XDR",
    ];
    const LANES: [&str; 5] = ["1x", "4x", "8x", "12x", "2x"];
    let mbps = nccl_speed_mbps(p.port_speed, p.active_speed_ex, p.active_speed, p.active_width);
    if let Some(s) = p.port_speed {
        return (mbps, format!("from ibv_query_port_speed {s} x 100 Mb/s"));
    }
    let (field, code) = if p.active_speed_ex != 0 {
        ("active_speed_ex", p.active_speed_ex)
    } else {
        ("active_speed", p.active_speed.into())
    };
    let lane = LANE[nccl_table_index(code, LANE.len())];
    let lanes = LANES[nccl_table_index(p.active_width.into(), LANES.len())];
    (mbps, format!("{lane} x {lanes} from {field} {code}, active_width {}", p.active_width))
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
        let ipc_lock = read(Path::new("/proc/self/status"))
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
    /// Messages and their size, timed in `seconds`.
    msgs: usize,
    msg: usize,
    seconds: f64,
    /// How the data was checked.
    verified: &'static str,
    /// (port, counter, delta) for every counter that moved.
    deltas: Vec<(String, String, u64)>,
}

impl SelfTest {
    fn bytes(&self) -> usize {
        self.msgs * self.msg
    }
}

/// The self-test's sender: the first NCCL device `--dev` names (a device or a `dev:port`),
/// else NCCL's device 0. An index into `nccl`.
fn sender(dev: Option<&str>, nccl: &[(String, String)]) -> Result<usize, String> {
    let keys: Vec<&str> = nccl.iter().map(|(k, _)| k.as_str()).collect();
    let Some(want) = dev else {
        return if keys.is_empty() { Err("the plugin offers no device".into()) } else { Ok(0) };
    };
    keys.iter()
        .position(|k| *k == want || k.rsplit_once(':').is_some_and(|(d, _)| d == want))
        .ok_or_else(|| format!("--dev {want}: not among the devices the plugin offers {keys:?}"))
}

/// Counter deltas of `key` (`dev:port`) since `before`.
fn deltas(key: &str, before: &BTreeMap<String, u64>) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for (k, v) in counter_map(key) {
        let was = before.get(&k).copied().unwrap_or(0);
        if v != was {
            out.push((key.to_string(), k, v.wrapping_sub(was)));
        }
    }
    out
}

/// Sends from NCCL's device `send_dev` to the next one NCCL sees, in this process.
fn local_selftest(
    plugin: &str,
    nccl: &[(String, String)],
    send_dev: usize,
) -> Result<SelfTest, String> {
    let lib = open_plugin(plugin)?;
    ECHO.store(false, std::sync::atomic::Ordering::Relaxed);
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let n = drv.devices()?;
    let name = |d: i32| nccl.get(d as usize).map_or(format!("device {d}"), |(k, _)| k.clone());
    if n < 2 {
        drv.finalize(ctx)?;
        return Err(format!(
            "the plugin offers {n} device(s) ({}): a local self-test needs a second one to \
             receive; or run `ferroce perf --listen` on another host and pass --peer HOST:PORT",
            name(0)
        ));
    }
    let send_dev = send_dev as i32;
    let recv_dev = (send_dev + 1) % n;
    let before = [send_dev, recv_dev].map(|d| counter_map(&name(d)));
    let (mut handle, listen) = drv.listen(ctx, recv_dev)?;
    let (send, recv) = drv.connect_both(ctx, send_dev, &mut handle, listen, SELFTEST_LIMIT)?;
    drv.close(Close::Listen, listen)?;
    let (seconds, ok) = send_messages(&drv, send, recv)?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    if !ok {
        return Err("self-test: the data arrived corrupted".into());
    }
    let mut deltas = deltas(&name(send_dev), &before[0]);
    deltas.extend(self::deltas(&name(recv_dev), &before[1]));
    Ok(SelfTest {
        from: name(send_dev),
        to: name(recv_dev),
        msgs: SELFTEST_MSGS,
        msg: SELFTEST_MSG,
        seconds,
        verified: "every byte received matches the bytes sent",
        deltas,
    })
}

/// Sends [`SELFTEST_MSGS`] messages from `send` to `recv`, up to [`SELFTEST_DEPTH`] in flight
/// as NCCL keeps several (receives posted first): the seconds taken, and whether the data
/// arrived intact. One thread drives both comms as NCCL's proxy does: each pass posts what it
/// can, then tests; a send whose receive's CTS row is not out yet waits while the receiving
/// comm is tested (ferroce writes CTS rows in batches when the receiver is progressed).
fn send_messages(drv: &Driver, send: Ptr, recv: Ptr) -> Result<(f64, bool), String> {
    let mut src: Vec<u8> = (0..SELFTEST_MSG).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; SELFTEST_MSG];
    let smh = drv.reg_mr(send, src.as_mut_ptr(), SELFTEST_MSG)?;
    let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), SELFTEST_MSG)?;
    let t0 = Instant::now();
    let deadline = t0 + SELFTEST_LIMIT;
    let (mut posted, mut done) = (0, 0);
    let mut flight = std::collections::VecDeque::new();
    // A receive posted whose send the plugin has not taken yet.
    let mut unsent = None;
    while done < SELFTEST_MSGS {
        if Instant::now() > deadline {
            return Err(format!(
                "self-test: {done} of {SELFTEST_MSGS} messages within {SELFTEST_LIMIT:?}"
            ));
        }
        if unsent.is_none() && posted < SELFTEST_MSGS && flight.len() < SELFTEST_DEPTH {
            unsent = Some(until("irecv", SELFTEST_LIMIT, || {
                drv.irecv(recv, &[dst.as_mut_ptr()], &[SELFTEST_MSG], &[0], &[rmh], false)
            })?);
        }
        if let Some(r) = unsent {
            match drv.isend(send, src.as_mut_ptr(), SELFTEST_MSG, 0, smh)? {
                Some(s) => {
                    flight.push_back((Some(s), Some(r)));
                    posted += 1;
                    unsent = None;
                }
                // Its row is not out yet: progress the receiving comm (the receive cannot be
                // complete before its send).
                None if drv.test(r)?.is_some() => {
                    return Err("self-test: a receive completed before its send".into());
                }
                None => {}
            }
        }
        if let Some((s, r)) = flight.front_mut() {
            for q in [s, r] {
                if let Some(req) = *q
                    && drv.test(req)?.is_some()
                {
                    *q = None;
                }
            }
            if flight.front().is_some_and(|(s, r)| s.is_none() && r.is_none()) {
                flight.pop_front();
                done += 1;
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let ok = dst == src;
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    Ok((seconds, ok))
}

/// One end of a connection as `--peer` compares the two: what `PORT` carries over perf's
/// control connection, one `key=value` word per fact (`-` for unknown).
#[derive(Clone, Debug, PartialEq)]
pub struct PortFacts {
    /// `dev:port`.
    port: String,
    netdev: Option<String>,
    netdev_mtu: Option<u32>,
    active_mtu: u32,
    max_mtu: u32,
    /// The GID ferroce chose: its index and IP address.
    gid: Option<(u8, String)>,
}

impl PortFacts {
    fn of(p: &Port) -> PortFacts {
        PortFacts {
            port: p.key(),
            netdev: p.netdev.clone(),
            netdev_mtu: p.netdev_mtu,
            active_mtu: p.active_mtu,
            max_mtu: p.max_mtu,
            gid: p.choice.as_ref().ok().map(|c| (c.index, c.ip().to_string())),
        }
    }

    fn encode(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        format!(
            "port={} netdev={} netdev_mtu={} active_mtu={} max_mtu={} gid={}",
            self.port,
            opt(self.netdev.clone()),
            opt(self.netdev_mtu.map(|m| m.to_string())),
            self.active_mtu,
            self.max_mtu,
            opt(self.gid.as_ref().map(|(i, ip)| format!("{i}/{ip}")))
        )
    }

    fn decode(line: &str) -> Result<PortFacts, String> {
        let words: BTreeMap<&str, &str> =
            line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        let get = |k: &str| {
            let v = words.get(k).ok_or_else(|| format!("the peer's PORT lacks {k}: {line:?}"))?;
            Ok::<_, String>((*v != "-").then_some(*v))
        };
        let num = |k: &str| -> Result<Option<u32>, String> {
            get(k)?.map(|v| v.parse().map_err(|_| format!("the peer's {k} {v:?}"))).transpose()
        };
        let gid = match get("gid")? {
            None => None,
            Some(g) => {
                let (i, ip) = g.split_once('/').ok_or(format!("the peer's gid {g:?}"))?;
                Some((i.parse().map_err(|_| format!("the peer's gid {g:?}"))?, ip.to_string()))
            }
        };
        Ok(PortFacts {
            port: get("port")?.ok_or("the peer names no port")?.to_string(),
            netdev: get("netdev")?.map(str::to_string),
            netdev_mtu: num("netdev_mtu")?,
            active_mtu: num("active_mtu")?.unwrap_or(0),
            max_mtu: num("max_mtu")?.unwrap_or(0),
            gid,
        })
    }

    /// `rxe0:1 (active 1024, vethA MTU 1500)`, as `check_mtus` names a port.
    fn desc(&self) -> String {
        format!(
            "{} (active {}, {} MTU {})",
            self.port,
            self.active_mtu,
            self.netdev.as_deref().unwrap_or("?"),
            self.netdev_mtu.map_or("?".into(), |m| m.to_string())
        )
    }
}

/// The `PORT` answer of a `perf --listen` rank on the plugin device `name` (`rxe1`,
/// `mlx5_0:1`): the port doctor would show for it.
pub fn port_facts(name: &str) -> Result<String, String> {
    let config = Config::from_env().unwrap_or_default();
    let ports = read_ports(&config, &BTreeMap::new())?;
    // The plugin names a device `dev`, or `dev:port` where it uses several ports of one device;
    // among a device's ports it uses the kept, ACTIVE ones.
    let mut found: Vec<&Port> =
        ports.iter().filter(|p| p.key() == name || (p.dev == name && p.kept)).collect();
    found.sort_by_key(|p| p.state != PortState::Active);
    let p = found.first().ok_or_else(|| format!("PORT: no RDMA port for device {name:?}"))?;
    Ok(PortFacts::of(p).encode())
}

/// A connection runs at the smaller active MTU of its two ends, and a frame larger than the
/// smaller netdev MTU is dropped on the way: two ends that differ in either are named.
fn check_peer_mtu(
    here: &PortFacts,
    peer: &PortFacts,
    addr: &str,
    add: &mut impl FnMut(Level, &str, String),
) {
    let netdevs_differ = matches!((here.netdev_mtu, peer.netdev_mtu), (Some(a), Some(b)) if a != b);
    if here.active_mtu == peer.active_mtu && !netdevs_differ {
        return;
    }
    let path = here.active_mtu.min(peer.active_mtu);
    let fix = match (here.netdev_mtu, peer.netdev_mtu) {
        (Some(a), Some(b)) if a != b => {
            let ((low, low_at), (high, high_at)) = if a < b {
                ((here, "here"), (peer, "on the peer"))
            } else {
                ((peer, "on the peer"), (here, "here"))
            };
            let nd = |f: &PortFacts| f.netdev.clone().unwrap_or_else(|| "?".into());
            format!(
                "set {}'s MTU to {} {low_at} (and on every switch port between) to run both at \
                 the larger, or {}'s to {} {high_at} to match",
                nd(low),
                a.max(b),
                nd(high),
                a.min(b)
            )
        }
        _ => format!(
            "the netdev MTUs match, so compare the ports' max MTUs (here {}, peer {}) and the \
             drivers' RoCE MTU settings",
            here.max_mtu, peer.max_mtu
        ),
    };
    add(
        Level::Warn,
        "peer",
        format!(
            "MTU mismatch between the two ends: here {}, peer {} at {addr}; the path MTU is the \
             smaller, {path}: {fix}",
            here.desc(),
            peer.desc()
        ),
    );
}

/// What `--peer` learnt: the two ends' facts (each missing where it could not be read).
struct PeerReport {
    addr: String,
    here: Option<PortFacts>,
    there: Option<PortFacts>,
    /// The plugin connected the two ends.
    connected: bool,
}

/// `--peer`: the peer's facts beside ours, their comparison, a connection through the plugin
/// and (with `--selftest`) a verified transfer to it, by perf's ranks and control connection.
fn with_peer(
    addr: &str,
    opts: &Args,
    (key, name): &(String, String),
    ports: &[Port],
    add: &mut impl FnMut(Level, &str, String),
) -> (PeerReport, Option<SelfTest>) {
    let here = ports.iter().find(|p| &p.key() == key).map(PortFacts::of);
    let mut rep = PeerReport { addr: addr.into(), here, there: None, connected: false };
    let before = counter_map(key);
    let plugin = plugin_path(&opts.plugin);
    let r = (|| {
        let mut pair = crate::perf::Pair::to_peer(addr, &plugin, name)?;
        let there = rep.there.insert(PortFacts::decode(&pair.port()?)?);
        if let Some(here) = &rep.here {
            check_peer_mtu(here, there, addr, add);
        }
        pair.connect()?;
        rep.connected = true;
        let bw = if opts.selftest {
            let msgs = Some(SELFTEST_MSGS as u64);
            let secs = SELFTEST_LIMIT.as_secs_f64();
            Some(pair.bw(SELFTEST_MSG, SELFTEST_DEPTH, secs, 0.0, msgs)?)
        } else {
            None
        };
        pair.quit()?;
        Ok::<_, String>(bw.map(|(bytes, seconds)| SelfTest {
            from: key.clone(),
            to: format!("{} at {addr}", rep.there.as_ref().map_or(name, |t| &t.port)),
            msgs: (bytes / SELFTEST_MSG as f64).round() as usize,
            msg: SELFTEST_MSG,
            seconds,
            verified: "every receive's length checked, the last message byte for byte (by the peer)",
            deltas: deltas(key, &before),
        }))
    })();
    match r {
        Ok(s) => (rep, s),
        Err(e) => {
            add(Level::Block, "peer", e);
            (rep, None)
        }
    }
}

/// The plugin as NCCL would open it, else (a bare name) `libnccl-net-NAME.so` beside this
/// binary, where `ci/build.sh` puts it.
fn open_plugin(name: &str) -> Result<Library, String> {
    Library::open_like_nccl(&plugin_path(name))
}

/// What [`open_plugin`] opens: `name` where NCCL's way finds it, else the path beside this
/// binary (for the ranks of `--peer`, which open the plugin themselves).
fn plugin_path(name: &str) -> String {
    if name.contains('/') || Library::open_like_nccl(name).is_ok() {
        return name.into();
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join(format!("libnccl-net-{name}.so"))))
        .filter(|p| p.exists())
        .map_or(name.into(), |p| p.to_string_lossy().into_owned())
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
    fusion: &'a Fusion,
    ports: &'a [Port],
    findings: &'a [Finding],
    memlock: &'a Memlock,
    env: &'a [(String, String)],
    advice: &'a [String],
    selftest: Option<&'a SelfTest>,
    peer: Option<&'a PeerReport>,
}

fn text(r: &Report) -> String {
    let Report { fusion, ports, findings, memlock, env, advice, selftest, peer } = *r;
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "ferroce doctor: {} RDMA port(s)", ports.len());
    for p in ports {
        port_text(w, p);
    }
    let _ = writeln!(w, "\n== NIC fusion");
    for l in fusion.lines() {
        let _ = writeln!(w, "  {l}");
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
    if let Some(p) = peer {
        peer_text(w, p);
    }
    if let Some(s) = selftest {
        selftest_text(w, s);
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

/// One port's screen.
fn port_text(w: &mut String, p: &Port) {
    let _ = writeln!(
        w,
        "\n== {} port {}{}",
        p.dev,
        p.port,
        if p.kept { "" } else { " (filtered out by NCCL_IB_HCA)" }
    );
    let (mbps, how) = speed_of(p);
    let _ = writeln!(w, "Port");
    let _ = writeln!(w, "  state        {} (only ACTIVE ports carry traffic)", state_name(p.state));
    let _ = writeln!(w, "  link layer   {}", link_name(p.link_layer));
    let _ = writeln!(
        w,
        "  speed        {mbps} Mb/s as NCCL is told: {how}{}",
        if p.software { " (nominal on a software device)" } else { "" }
    );
    match &p.nccl {
        Some(n) => {
            let _ = writeln!(
                w,
                "  NCCL sees    device {} {}: port {}, pciPath {}{}",
                n.index,
                n.name,
                n.port,
                n.pci_path.as_deref().unwrap_or("(none)"),
                if p.software { " (no PCI function: its sysfs dir)" } else { "" }
            );
        }
        None => {
            let _ = writeln!(w, "  NCCL sees    nothing (not a device the plugin offers)");
        }
    }
    let _ = writeln!(w, "  netdev       {}", p.netdev.as_deref().unwrap_or("(none)"));
    let _ = writeln!(
        w,
        "  MTU          netdev {} / active {} / max {} (bytes: the Ethernet MTU of the interface; the RoCE payload MTU the port uses now; the largest it supports)",
        p.netdev_mtu.map_or("?".into(), |m| m.to_string()),
        p.active_mtu,
        p.max_mtu
    );
    port_tables(w, p);
}

/// A port's GID table (with the plugin's choice), congestion control, counters and GPUDirect.
fn port_tables(w: &mut String, p: &Port) {
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
    if let Some(n) = &p.nccl {
        let _ = writeln!(w, "GPUDirect\n  {}", n.gdr);
    }
}

/// The `--peer` section: the two ends side by side.
fn peer_text(w: &mut String, p: &PeerReport) {
    let _ = writeln!(
        w,
        "\n== Peer {} (a `ferroce perf --listen` there){}",
        p.addr,
        if p.connected { "; the plugin connected to it" } else { "" }
    );
    let side = |f: &Option<PortFacts>, what: &dyn Fn(&PortFacts) -> String| {
        f.as_ref().map_or("?".to_string(), what)
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "?".into());
    type Fact = (&'static str, fn(&PortFacts) -> String);
    let rows: [Fact; 6] = [
        ("port", |f| f.port.clone()),
        ("netdev", |f| f.netdev.clone().unwrap_or_else(|| "?".into())),
        ("netdev MTU", |f| f.netdev_mtu.map_or("?".into(), |m| m.to_string())),
        ("active MTU", |f| f.active_mtu.to_string()),
        ("max MTU", |f| f.max_mtu.to_string()),
        ("GID", |f| f.gid.as_ref().map_or("none".into(), |(i, ip)| format!("index {i} {ip}"))),
    ];
    let _ = writeln!(w, "  {:<12} {:<28} peer", "", "here");
    for (label, f) in rows {
        let _ = writeln!(w, "  {label:<12} {:<28} {}", side(&p.here, &f), side(&p.there, &f));
    }
    if let (Some(h), Some(t)) = (&p.here, &p.there) {
        let _ = writeln!(
            w,
            "  path MTU     {} (the smaller active MTU: what a connection between the two uses; \
             frames up to the smaller netdev MTU, {}, cross)",
            h.active_mtu.min(t.active_mtu),
            opt(h.netdev_mtu.zip(t.netdev_mtu).map(|(a, b)| a.min(b).to_string()))
        );
    }
}

/// The self-test section: the transfer and the counters it moved.
fn selftest_text(w: &mut String, s: &SelfTest) {
    let _ = writeln!(w, "\n== Self-test");
    let mb = s.bytes() as f64 / 1e6;
    let _ = writeln!(
        w,
        "  {} -> {}: {} x {} MiB in {:.3} s = {:.1} MB/s ({:.2} Gb/s) through the plugin's C ABI",
        s.from,
        s.to,
        s.msgs,
        s.msg >> 20,
        s.seconds,
        mb / s.seconds,
        mb * 8.0 / 1000.0 / s.seconds
    );
    let _ = writeln!(w, "  data verified: {}", s.verified);
    for (port, k, d) in &s.deltas {
        let name = k.rsplit('/').next().unwrap_or(k);
        let _ = writeln!(w, "  {port:<8} {k:<36} +{d:<12} {}", meaning(name).unwrap_or(""));
    }
}

/// The report as one JSON object (and a newline), the same facts as [`text`].
fn json(r: &Report) -> String {
    let Report { fusion, ports, findings, memlock, env, advice, selftest, peer } = *r;
    let blocking = findings.iter().any(|f| f.level == Level::Block);
    let findings: Vec<Value> = findings
        .iter()
        .map(|f| json!({"level": f.level.name(), "about": f.about, "what": f.what}))
        .collect();
    let env: serde_json::Map<String, Value> = env
        .iter()
        .map(|(k, v)| (k.clone(), json!({"value": v, "meaning": knob_meaning(k)})))
        .collect();
    let selftest = selftest.map(|s| {
        let deltas: Vec<Value> =
            s.deltas.iter().map(|(p, k, d)| json!({"port": p, "counter": k, "delta": d})).collect();
        json!({
            "from": s.from,
            "to": s.to,
            "messages": s.msgs,
            "message_bytes": s.msg,
            "bytes": s.bytes(),
            "seconds": rounded(s.seconds, 6),
            "mb_per_s": rounded(s.bytes() as f64 / 1e6 / s.seconds, 1),
            "verified": s.verified,
            "counter_deltas": deltas,
        })
    });
    let groups: Vec<Value> = fusion
        .groups
        .iter()
        .map(|g| json!(g.iter().map(|(i, n)| json!({"device": i, "name": n})).collect::<Vec<_>>()))
        .collect();
    let fusion = json!({
        "merge_level": fusion.level,
        "force_merge": fusion.force,
        "merge_nics": fusion.merge_nics,
        "groups": groups,
        "lines": fusion.lines(),
    });
    let v = json!({
        "ports": ports.iter().map(port_json).collect::<Vec<_>>(),
        "fusion": fusion,
        "memlock": {"soft": memlock.soft, "hard": memlock.hard, "cap_ipc_lock": memlock.ipc_lock},
        "env": env,
        "selftest": selftest,
        "peer": peer.map(peer_json),
        "advice": advice,
        "findings": findings,
        "blocking": blocking,
    });
    format!("{v}\n")
}

/// One port's screen as JSON.
fn port_json(p: &Port) -> Value {
    let gids: Vec<Value> = p
        .gids
        .iter()
        .map(|g| {
            let ip = gid::ip_of(&g.gid).to_string();
            json!({"index": g.index, "type": gid_kind(g.kind), "ip": ip, "netdev": g.netdev})
        })
        .collect();
    let choice = match &p.choice {
        Ok(c) => json!({"index": c.index, "ip": c.ip().to_string(), "why": c.why}),
        Err(e) => json!({"error": e}),
    };
    let cc: serde_json::Map<String, Value> =
        p.cc.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
    let (mbps, speed_from) = speed_of(p);
    let nccl = p.nccl.as_ref().map(
        |n| json!({"device": n.index, "name": n.name, "port": n.port, "pci_path": n.pci_path}),
    );
    let counters: Vec<Value> = p
        .counters
        .iter()
        .map(|c| {
            json!({"group": c.group, "name": c.name, "value": c.value, "meaning": meaning(&c.name)})
        })
        .collect();
    json!({
        "dev": p.dev,
        "port": p.port,
        "kept": p.kept,
        "state": state_name(p.state),
        "link_layer": link_name(p.link_layer),
        "speed_mbps": mbps,
        "speed_from": speed_from,
        "nccl": nccl,
        "netdev": p.netdev,
        "mtu": {"netdev": p.netdev_mtu, "active": p.active_mtu, "max": p.max_mtu},
        "gids": gids,
        "gid_choice": choice,
        "congestion_control": (!cc.is_empty()).then_some(cc),
        "software_device": p.software,
        "counters": counters,
        "gpudirect": p.nccl.as_ref().map(|n| &n.gdr),
    })
}

/// The `--peer` section as JSON.
fn peer_json(p: &PeerReport) -> Value {
    let facts = |f: &Option<PortFacts>| {
        f.as_ref().map(|f| {
            json!({
                "port": f.port,
                "netdev": f.netdev,
                "mtu": {"netdev": f.netdev_mtu, "active": f.active_mtu, "max": f.max_mtu},
                "gid": f.gid.as_ref().map(|(i, ip)| json!({"index": i, "ip": ip})),
            })
        })
    };
    let (path, same) = match (&p.here, &p.there) {
        (Some(h), Some(t)) => (
            Some(h.active_mtu.min(t.active_mtu)),
            Some(h.active_mtu == t.active_mtu && h.netdev_mtu == t.netdev_mtu),
        ),
        _ => (None, None),
    };
    json!({
        "addr": p.addr,
        "here": facts(&p.here),
        "peer": facts(&p.there),
        "path_mtu": path,
        "mtus_match": same,
        "connected": p.connected,
    })
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
            active_speed_ex: 0,
            active_width: 2,
            port_speed: None,
            active_mtu: 4096,
            max_mtu: 4096,
            netdev: Some("eth0".into()),
            netdev_mtu: Some(9000),
            choice: gid::choose("mlx5_0", &gids, config, true).map_err(|e| e.to_string()),
            gids,
            cc: vec![("ecn/roce_np/enable/3".into(), "1".into())],
            software: false,
            counters: Vec::new(),
            nccl: None,
        }
    }

    #[test]
    fn the_speed_is_nccls_with_its_derivation() {
        let mut p = port(&[], &Config::default());
        let edr = (100000, "25 Gb/s EDR x 4x from active_speed 32, active_width 2".to_string());
        assert_eq!(speed_of(&p), edr);
        p.active_speed_ex = 0x100;
        let xdr = (800000, "200 Gb/s XDR x 4x from active_speed_ex 256, active_width 2".into());
        assert_eq!(speed_of(&p), xdr);
        p.port_speed = Some(4000);
        assert_eq!(speed_of(&p), (400000, "from ibv_query_port_speed 4000 x 100 Mb/s".into()));
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
    fn arguments_are_checked() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let a = |v: &[&str]| {
            let words = std::iter::once("doctor").chain(v.iter().copied());
            Cli::try_parse_from(words).map(|c| c.a).map_err(|e| e.to_string())
        };
        for bad in [
            &["--dev"][..],
            &["--nope"],
            &["--peer"],
            &["--peer", "--selftest"],
            &["--peer", "host"],
            &["--peer", ":5000"],
            &["--peer", "host:0"],
            &["--peer", "host:70000"],
            &["--peer", "host:x"],
            &["--selftest", "extra"],
        ] {
            let e = a(bad).err().unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(e.contains("try '--help'"), "{bad:?}: {e}");
        }
        let o = a(&["--dev", "rxe1", "--json", "--selftest"]).unwrap();
        assert!(o.dev.as_deref() == Some("rxe1") && o.json && o.selftest && o.peer.is_none());
        let o = a(&["--peer", "198.18.0.2:4000", "--selftest"]).unwrap();
        assert_eq!(o.peer.as_deref(), Some("198.18.0.2:4000"));
        let o = a(&["--peer", "[fe80::1]:4000"]).unwrap();
        assert_eq!(o.peer.as_deref(), Some("[fe80::1]:4000"));
    }

    #[test]
    fn the_selftest_sender_is_the_dev_one_or_the_first() {
        let nccl: Vec<(String, String)> = [("rxe0:1", "rxe0"), ("mlx5_0:1", "mlx5_0:1")]
            .iter()
            .map(|(k, n)| (k.to_string(), n.to_string()))
            .collect();
        assert_eq!(sender(None, &nccl), Ok(0));
        assert_eq!(sender(Some("mlx5_0"), &nccl), Ok(1));
        assert_eq!(sender(Some("rxe0:1"), &nccl), Ok(0));
        assert!(sender(Some("rxe9"), &nccl).unwrap_err().contains("rxe9"));
        assert!(sender(None, &[]).is_err());
    }

    fn facts(port: &str, netdev: &str, netdev_mtu: u32, active: u32) -> PortFacts {
        PortFacts {
            port: port.into(),
            netdev: Some(netdev.into()),
            netdev_mtu: Some(netdev_mtu),
            active_mtu: active,
            max_mtu: 4096,
            gid: Some((1, "198.18.0.1".into())),
        }
    }

    #[test]
    fn port_facts_cross_the_wire_intact() {
        let f = facts("mlx5_0:1", "eth0", 9000, 4096);
        assert_eq!(PortFacts::decode(&f.encode()), Ok(f.clone()));
        let bare = PortFacts { netdev: None, netdev_mtu: None, gid: None, ..f };
        assert_eq!(PortFacts::decode(&bare.encode()), Ok(bare.clone()));
        let v6 = PortFacts { gid: Some((3, "fd00::1".into())), ..bare };
        assert_eq!(PortFacts::decode(&v6.encode()), Ok(v6));
        assert!(PortFacts::decode("netdev=eth0 active_mtu=1024").is_err(), "no port");
        assert!(PortFacts::decode(&f_with("active_mtu=big")).is_err());
        assert!(PortFacts::decode(&f_with("gid=1")).is_err());
    }

    fn f_with(word: &str) -> String {
        let key = word.split('=').next().unwrap();
        let f = facts("rxe0:1", "vethA", 1500, 1024).encode();
        f.split(' ')
            .map(|w| if w.starts_with(key) { word } else { w })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn peer_findings(here: &PortFacts, peer: &PortFacts) -> Vec<(Level, String)> {
        let mut out = Vec::new();
        check_peer_mtu(here, peer, "198.18.0.2:4000", &mut |l, _: &str, w| out.push((l, w)));
        out
    }

    #[test]
    fn two_ends_with_different_mtus_warn_naming_both() {
        let here = facts("rxe0:1", "vethA", 1500, 1024);
        assert!(peer_findings(&here, &here.clone()).is_empty(), "equal ends");
        let peer = facts("rxe1:1", "vethB", 9000, 4096);
        let f = peer_findings(&here, &peer);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, Level::Warn);
        let w = &f[0].1;
        for part in [
            "here rxe0:1 (active 1024, vethA MTU 1500)",
            "peer rxe1:1 (active 4096, vethB MTU 9000) at 198.18.0.2:4000",
            "the path MTU is the smaller, 1024",
            "set vethA's MTU to 9000 here",
            "or vethB's to 1500 on the peer",
        ] {
            assert!(w.contains(part), "{part:?} in {w}");
        }
        // The other way round: the peer is the smaller end.
        let w = &peer_findings(&peer, &here)[0].1;
        assert!(w.contains("set vethA's MTU to 9000 on the peer") && w.contains("1024"), "{w}");
        // Same netdev MTU, different active MTUs (a NIC with a lower max): still named.
        let low = PortFacts { active_mtu: 2048, max_mtu: 2048, ..facts("x:1", "eth1", 1500, 0) };
        let w = &peer_findings(&here, &PortFacts { netdev_mtu: Some(9000), ..low.clone() })[0].1;
        assert!(w.contains("set vethA's MTU to 9000"), "{w}");
        let w = &peer_findings(
            &facts("y:1", "eth0", 9000, 4096),
            &PortFacts { netdev_mtu: Some(9000), ..low },
        )[0]
        .1;
        assert!(
            w.contains("max MTUs (here 4096, peer 2048)") && w.contains("smaller, 2048"),
            "{w}"
        );
    }
}
