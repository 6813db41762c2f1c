//! The checks of `ferroce doctor`: each names what is wrong, with a level, through `add`.

use std::path::Path;

use ferroce::config::Config;
use ferroce::transport::gid::{self, GidChoice, GidType};
use ferroce::verbs::{LinkLayer, PortState};

use super::{Level, MEMLOCK_BLOCK, NETDEV_FOR_4096, gid_kind, state_name};
use crate::ports::{Port, PortFacts, read};

/// What is wrong with one port that `NCCL_IB_HCA` keeps: not ACTIVE, its GID, its MTU, its
/// congestion control. `named`: `--dev` asked for it.
pub fn check_port(
    p: &Port,
    config: &Config,
    named: bool,
    add: &mut impl FnMut(Level, &str, String),
) {
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
        Ok(c) => check_gid(p, c, config, add),
    }
    check_link(p, add);
}

/// The GID the plugin chose on `p`: of the RoCE version asked for, and reachable.
fn check_gid(p: &Port, c: &GidChoice, config: &Config, add: &mut impl FnMut(Level, &str, String)) {
    let key = p.key();
    let entry = p.gids.iter().find(|g| g.index == c.index);
    let kind = entry.map_or(GidType::Unknown, |g| g.kind);
    let want = if config.roce_version == 1 { GidType::RoceV1 } else { GidType::RoceV2 };
    let ethernet = p.link_layer == LinkLayer::Ethernet;
    if ethernet && kind != want && kind != GidType::Unknown {
        let better = p
            .gids
            .iter()
            .find(|g| g.kind == want)
            .map_or(String::new(), |g| format!("; index {} is {}", g.index, gid_kind(g.kind)));
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
            format!("{} chose GID index {}, whose RoCE version sysfs does not say", c.why, c.index),
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

/// The port's MTU against its interface's, and whether its congestion control is visible.
fn check_link(p: &Port, add: &mut impl FnMut(Level, &str, String)) {
    let key = p.key();
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
pub fn check_mtus(ports: &[Port], add: &mut impl FnMut(Level, &str, String)) {
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

/// `RLIMIT_MEMLOCK`, and whether `CAP_IPC_LOCK` lifts it.
pub struct Memlock {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
    pub ipc_lock: bool,
}

impl Memlock {
    pub fn read() -> Memlock {
        // CAP_IPC_LOCK (bit 14) in the effective set: the kernel does not apply the limit.
        let ipc_lock = read(Path::new("/proc/self/status"))
            .and_then(|s| {
                let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
                u64::from_str_radix(&hex, 16).ok()
            })
            .is_some_and(|caps| caps & (1 << 14) != 0);
        // A failed getrlimit reads as a limit of 0, which blocks.
        let (soft, hard) = ferroce_tools::sys::memlock().unwrap_or((Some(0), Some(0)));
        Memlock { soft, hard, ipc_lock }
    }

    pub fn show(v: Option<u64>) -> String {
        v.map_or("unlimited".into(), |b| format!("{} KiB", b / 1024))
    }

    pub fn check(&self, add: &mut impl FnMut(Level, &str, String)) {
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

pub fn advice(ports: &[Port], config: &Config, memlock: &Memlock) -> Vec<String> {
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

/// A connection runs at the smaller active MTU of its two ends, and a frame larger than the
/// smaller netdev MTU is dropped on the way: two ends that differ in either are named.
pub fn check_peer_mtu(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::tests::port;
    use crate::ports::tests::facts;

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
