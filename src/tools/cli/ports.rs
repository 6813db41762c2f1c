//! The RDMA ports of this host as sysfs and verbs describe them, with the GID the plugin would
//! choose on each: what `ferroce doctor` shows and checks, and the facts a `ferroce perf` rank
//! answers `PORT` with ([`port_facts`]), so that `doctor --peer` compares the two ends from the
//! same code. Devices, GIDs and their sysfs facts are read through the plugin's own code
//! (`ferroce::transport::device`, `ferroce::verbs::sysfs`), so what is shown is what the plugin
//! would do. Only reads.

use std::collections::BTreeMap;
use std::path::Path;

use ferroce::config::Config;
use ferroce::transport::device::{gid_table, mtu_bytes};
use ferroce::transport::gid::{self, GidChoice, GidEntry};
use ferroce::verbs::{self, LinkLayer, PortState, sysfs};

/// One counter of a port.
pub struct Counter {
    /// `counters` (the port's standard counters) or `hw_counters` (the driver's own).
    pub group: &'static str,
    pub name: String,
    pub value: u64,
}

/// One (RDMA device, port), as the doctor shows it.
pub struct Port {
    pub dev: String,
    pub port: u8,
    /// `NCCL_IB_HCA` (and `--dev`) keep it.
    pub kept: bool,
    pub state: PortState,
    pub link_layer: LinkLayer,
    pub active_speed: u8,
    pub active_speed_ex: u32,
    pub active_width: u8,
    /// `ibv_query_port_speed` in units of 100 Mb/s, where libibverbs has it.
    pub port_speed: Option<u64>,
    pub active_mtu: u32,
    pub max_mtu: u32,
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
    pub gids: Vec<GidEntry>,
    pub choice: Result<GidChoice, String>,
    /// Congestion-control files found in sysfs: (path relative to /sys/class/net/IF, value).
    pub cc: Vec<(String, String)>,
    /// No PCI parent (rxe, siw): a software device with no NIC queues to configure.
    pub software: bool,
    pub counters: Vec<Counter>,
    /// What the plugin tells NCCL about this port, when discovery kept it.
    pub nccl: Option<InUse>,
}

/// A port the plugin offers NCCL, as `getProperties` describes it.
#[derive(Clone, Debug)]
pub struct InUse {
    /// NCCL's device number.
    pub index: usize,
    /// The plugin's name for it.
    pub name: String,
    /// The port number NCCL is told (not always the verbs port: see `device::nccl_places`).
    pub port: i32,
    pub pci_path: Option<String>,
    /// The plugin's GPUDirect decision.
    pub gdr: String,
}

impl Port {
    pub fn key(&self) -> String {
        format!("{}:{}", self.dev, self.port)
    }
}

/// Every port of every RDMA device, with what the plugin would choose on it.
pub fn read_ports(config: &Config, in_use: &BTreeMap<String, InUse>) -> Result<Vec<Port>, String> {
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
pub fn read(path: &Path) -> Option<String> {
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
pub fn counters(dev: &str, port: u8) -> Vec<Counter> {
    let dir = Path::new(sysfs::ROOT).join(format!("class/infiniband/{dev}/ports/{port}/counters"));
    let standard = files(&dir).into_iter().filter_map(|(name, v)| Some((name, v.parse().ok()?)));
    let standard = standard.map(|(name, value)| Counter { group: "counters", name, value });
    let hw = sysfs::hw_counters(dev, port).into_iter();
    standard.chain(hw.map(|(name, value)| Counter { group: "hw_counters", name, value })).collect()
}

/// What a counter means, for the names the common drivers (rxe, mlx5, and the standard port
/// counters) use; `None` for names not known here.
pub fn meaning(name: &str) -> Option<&'static str> {
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

/// One end of a connection as `--peer` compares the two: what `PORT` carries over perf's
/// control connection, one `key=value` word per fact (`-` for unknown).
#[derive(Clone, Debug, PartialEq)]
pub struct PortFacts {
    /// `dev:port`.
    pub port: String,
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
    pub active_mtu: u32,
    pub max_mtu: u32,
    /// The GID ferroce chose: its index and IP address.
    pub gid: Option<(u8, String)>,
}

impl PortFacts {
    pub fn of(p: &Port) -> PortFacts {
        PortFacts {
            port: p.key(),
            netdev: p.netdev.clone(),
            netdev_mtu: p.netdev_mtu,
            active_mtu: p.active_mtu,
            max_mtu: p.max_mtu,
            gid: p.choice.as_ref().ok().map(|c| (c.index, c.ip().to_string())),
        }
    }

    pub fn encode(&self) -> String {
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

    pub fn decode(line: &str) -> Result<PortFacts, String> {
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
    pub fn desc(&self) -> String {
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
    // The plugin names a port after its device (several ports of one device share the name);
    // among a device's ports it uses the kept, ACTIVE ones.
    let mut found: Vec<&Port> =
        ports.iter().filter(|p| p.key() == name || (p.dev == name && p.kept)).collect();
    found.sort_by_key(|p| p.state != PortState::Active);
    let p = found.first().ok_or_else(|| format!("PORT: no RDMA port for device {name:?}"))?;
    Ok(PortFacts::of(p).encode())
}

/// `dev:port` → its counters by `group/name`.
pub fn counter_map(key: &str) -> BTreeMap<String, u64> {
    let Some((dev, port)) = key.rsplit_once(':') else { return BTreeMap::new() };
    let Ok(port) = port.parse() else { return BTreeMap::new() };
    counters(dev, port).into_iter().map(|c| (format!("{}/{}", c.group, c.name), c.value)).collect()
}

#[cfg(test)]
pub mod tests {
    use super::*;

    pub fn facts(port: &str, netdev: &str, netdev_mtu: u32, active: u32) -> PortFacts {
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
}
