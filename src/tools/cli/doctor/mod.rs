//! `ferroce doctor [--dev NAME] [--json] [--selftest] [--peer HOST:PORT] [--plugin
//! NAME_OR_PATH]`: explains this host's RoCE set-up in one screen per device, with the
//! plugin's own decisions (device discovery, `NCCL_IB_HCA`, the GID choice, GPUDirect
//! detection, the knob parser), and says what blocks NCCL from using ferroce. Devices, GIDs
//! and their sysfs facts are read through the plugin's own code (`ferroce::transport::device`,
//! `ferroce::verbs::sysfs`), so what doctor shows is what the plugin would do.
//!
//! With `--peer`, the other end is a `ferroce perf --listen` on another host, reached through
//! perf's ranks and control connection ([`crate::rank::pair::Pair`]): it answers `PORT` with its
//! port facts ([`crate::ports::port_facts`], from the same code as this host's screen), the two
//! ends are compared (MTUs), and the plugin connects to it; `--selftest` then sends to it
//! instead of between two local devices ([`transfer`]).
//!
//! Every finding is one line with a level:
//! - `BLOCK`: NCCL cannot use ferroce on this host as configured (exit status 1);
//! - `WARN`: it works, but worse than it could, or a knob is probably not what was meant;
//! - `NOTE`: a fact worth knowing that needs no action.
//!
//! Nothing is written: sysfs is only read, and the self-test moves data between two local
//! ports (the `--dev` one sending, the next device NCCL sees receiving) or to the peer,
//! through the plugin's C ABI, as NCCL would.
//!
//! The ports are [`crate::ports`]'s; here are the findings ([`checks`]), and the report as text
//! ([`text`]) or JSON ([`json`]).

use std::collections::BTreeMap;
use std::time::Duration;

use ferroce::config::Config;
use ferroce::transport::device::{self, nccl_speed_mbps, nccl_table_index};
use ferroce::transport::gid::GidType;
use ferroce::verbs::{LinkLayer, PortState};

use crate::ports::{InUse, Port, read_ports};
use checks::{Memlock, advice, check_mtus, check_port};
use transfer::{PeerReport, SelfTest, local_selftest, sender, with_peer};

mod checks;
mod json;
mod text;
mod transfer;

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
    let out = if opts.json { json::json(&report) } else { text::text(&report) };
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
            out.push(format!(
                "NCCL_NET_FORCE_MERGE={f}: NCCL fuses these groups as named (a WARN above says \
                 if a group cannot match)"
            ));
        }
        out
    }
}

/// What stops `NCCL_NET_FORCE_MERGE` from fusing as written, read as NCCL reads it: groups by
/// `;`, entries by `,`, each `name[:port]` matching a device whose name is exactly `name` (and
/// whose NCCL port is `port`). NCCL fails init when a group matches fewer devices than it has
/// entries; a device whose name holds `:`, `,` or `;` cannot be named at all. `devs`: each NCCL
/// device's name and port, in NCCL's numbering.
fn force_merge_problems(force: Option<&str>, devs: &[(&str, i32)]) -> Vec<String> {
    let Some(force) = force else { return Vec::new() };
    let mut out = Vec::new();
    for (name, _) in devs.iter().filter(|(n, _)| n.contains([':', ',', ';'])) {
        out.push(format!(
            "device {name}'s name holds one of `:,;`, NCCL's separators: no NCCL_NET_FORCE_MERGE \
             entry can name it"
        ));
    }
    for group in force.split(';').map(str::trim).filter(|g| !g.is_empty()) {
        let entries: Vec<(&str, Option<i32>)> = group
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| match e.split_once(':') {
                Some((n, p)) => (n, p.trim().parse().ok()),
                None => (e, None),
            })
            .collect();
        let matched: Vec<usize> = (0..devs.len())
            .filter(|&d| {
                let (name, port) = devs[d];
                entries.iter().any(|&(n, p)| n == name && p.is_none_or(|p| p == port))
            })
            .collect();
        if matched.len() != entries.len() {
            let all: Vec<String> = devs.iter().map(|(n, p)| format!("{n}:{p}")).collect();
            out.push(format!(
                "group `{group}` matches {} device(s) ({matched:?}) for its {} entries: NCCL \
                 fails init (\"Only matched {} devices\"); names match exactly, with NCCL's \
                 port after `:`; the devices here: {}",
                matched.len(),
                entries.len(),
                matched.len(),
                all.join(", ")
            ));
        }
    }
    out
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
    let named: Vec<(&str, i32)> = devs.iter().map(|d| (d.name.as_str(), d.nccl_port)).collect();
    let order: Vec<String> =
        named.iter().enumerate().map(|(i, (n, _))| format!("{i} {n}")).collect();
    let rule = if config.pci_order {
        "PCI order, as NCCL numbers its own (NCCL_IB_DEVICE_PCI_ORDER=1)"
    } else {
        "name order (NCCL_IB_DEVICE_PCI_ORDER=0)"
    };
    add(Level::Note, "order", format!("NCCL's device numbers, in {rule}: {}", order.join(", ")));
    for w in force_merge_problems(fusion.force.as_deref(), &named) {
        add(Level::Warn, "NCCL_NET_FORCE_MERGE", w);
    }
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

#[cfg(test)]
pub mod tests {
    use super::*;

    #[test]
    fn force_merge_groups_must_match_as_nccl_matches_them() {
        let devs = [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2:1", 1), ("mlx5_2:2", 3)];
        assert!(force_merge_problems(None, &devs).is_empty());
        let ok = force_merge_problems(Some("mlx5_0,mlx5_1"), &devs[..2]);
        assert!(ok.is_empty(), "{ok:?}");
        assert!(force_merge_problems(Some("mlx5_0:1, mlx5_1:1"), &devs[..2]).is_empty());
        let w = force_merge_problems(Some("mlx5_0,mlx5_9;mlx5_1:2"), &devs[..2]);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("group `mlx5_0,mlx5_9` matches 1 device(s) ([0]) for its 2"));
        assert!(w[1].contains("group `mlx5_1:2` matches 0 device(s)"), "{w:?}");
        // The two ports of a dual-port device, named as NCCL names them: told apart by port.
        let dual = [("mlx5_0", 1), ("mlx5_0", 3)];
        assert!(force_merge_problems(Some("mlx5_0:1,mlx5_0:3"), &dual).is_empty());
        assert!(force_merge_problems(Some("mlx5_0"), &dual)[0].contains("matches 2 device(s)"));
        // A name with NCCL's port separator (ferroce's old names) cannot be written at all.
        let w = force_merge_problems(Some("mlx5_2:1,mlx5_2:2"), &devs);
        assert!(w[0].contains("device mlx5_2:1's name holds one of"), "{w:?}");
        assert!(w.iter().any(|l| l.contains("matches 0 device(s)")), "{w:?}");
    }
    use ferroce::transport::gid::{self, GidEntry};

    pub fn port(kinds: &[(u8, &str, GidType)], config: &Config) -> Port {
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
}
