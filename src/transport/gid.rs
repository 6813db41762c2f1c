//! Which GID a connection uses, and why.
//!
//! Pure logic over a GID table (read from verbs and sysfs by `device`). In order:
//! 1. a per-device index (`FERROCE_GID_INDEX=rxe0:1`), then `NCCL_IB_GID_INDEX`;
//! 2. the GID holding an address listed in `FERROCE_GID_IP` (link-local allowed: it was asked);
//! 3. automatically, NCCL-compatible: the first GID of the wanted RoCE version
//!    (`NCCL_IB_ROCE_VERSION_NUM`) and address family (`NCCL_IB_ADDR_FAMILY`), inside
//!    `NCCL_IB_ADDR_RANGE` and on a `FERROCE_GID_NETDEV` interface when those are set, never zero
//!    or link-local; with no range set and nothing in the wanted family, the other family;
//! 4. on an InfiniBand port, index 0.
//!
//! An entry whose sysfs type could not be read is `Unknown`: never chosen automatically, but
//! usable when named explicitly.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::config::{Config, Family};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    RoceV2,
    RoceV1,
    /// sysfs did not say (an unreadable entry is unknown, not an error).
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u8,
    pub gid: [u8; 16],
    pub kind: GidType,
    pub netdev: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidChoice {
    pub index: u8,
    pub gid: [u8; 16],
    pub netdev: Option<String>,
    /// Why this entry: shown in the INFO line.
    pub why: String,
}

impl GidChoice {
    /// The IP address a RoCE GID encodes.
    pub fn ip(&self) -> IpAddr {
        ip_of(&self.gid)
    }
}

/// Whether `ip` is IPv6 link-local (fe80::/10): usable only with a scope id, and not an
/// address a peer on another host can be handed.
pub fn is_link_local_ip(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// The address the connection-setup listener binds for a GID: the GID's own address, unless it
/// is link-local; then a routable address of the same interface (IPv4 first), as NCCL's setup
/// socket never depends on the GID being routable. `None`: the interface has none.
pub fn listen_ip_for(gid_ip: IpAddr, interface_ips: &[IpAddr]) -> Option<IpAddr> {
    if !is_link_local_ip(gid_ip) {
        return Some(gid_ip);
    }
    let routable = |v4: bool| {
        interface_ips.iter().copied().find(|ip| ip.is_ipv4() == v4 && !is_link_local_ip(*ip))
    };
    routable(true).or_else(|| routable(false))
}

/// The address in a GID: IPv4 for `::ffff:a.b.c.d`, else the IPv6 address.
pub fn ip_of(gid: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

fn is_zero(gid: &[u8; 16]) -> bool {
    gid.iter().all(|&b| b == 0)
}

fn is_link_local(gid: &[u8; 16]) -> bool {
    is_link_local_ip(ip_of(gid))
}

fn is_ipv4(gid: &[u8; 16]) -> bool {
    matches!(ip_of(gid), IpAddr::V4(v4) if v4 != Ipv4Addr::UNSPECIFIED)
}

/// Chooses the GID of device `dev` for a RoCE port (`ethernet`) or an InfiniBand port.
pub fn choose(dev: &str, table: &[GidEntry], cfg: &Config, ethernet: bool) -> Result<GidChoice> {
    let pick = |e: &GidEntry, why: String| GidChoice {
        index: e.index,
        gid: e.gid,
        netdev: e.netdev.clone(),
        why,
    };
    let forced = cfg
        .gid_index_per_dev
        .iter()
        .find(|(d, _)| d == dev)
        .map(|(_, i)| (*i, "FERROCE_GID_INDEX"))
        .or(cfg.gid_index.map(|i| (i, "NCCL_IB_GID_INDEX")));
    if let Some((i, knob)) = forced {
        return match table.iter().find(|e| e.index == i && !is_zero(&e.gid)) {
            Some(e) => Ok(pick(e, format!("{knob}={i}"))),
            None => Err(Error::config(
                knob,
                &i.to_string(),
                format!(
                    "{dev} has no GID at index {i} (see /sys/class/infiniband/{dev}/ports/*/gids)"
                ),
            )),
        };
    }
    if !cfg.gid_ips.is_empty() {
        return table
            .iter()
            .find(|e| cfg.gid_ips.contains(&ip_of(&e.gid)))
            .map(|e| pick(e, format!("FERROCE_GID_IP lists {}", ip_of(&e.gid))))
            .ok_or_else(|| {
                Error::NoDevice(format!("{dev} has no GID holding any of FERROCE_GID_IP"))
            });
    }
    if let Some(e) = table.iter().find(|e| !ethernet && e.index == 0) {
        return Ok(pick(e, "InfiniBand port: index 0".into()));
    }
    let version = if cfg.roce_version == 1 { GidType::RoceV1 } else { GidType::RoceV2 };
    let fits = |e: &&GidEntry| {
        e.kind == version
            && !is_zero(&e.gid)
            && !is_link_local(&e.gid)
            && (cfg.gid_netdevs.is_empty()
                || e.netdev.as_ref().is_some_and(|n| cfg.gid_netdevs.contains(n)))
            && cfg.addr_range.is_none_or(|r| r.contains(ip_of(&e.gid)))
    };
    let v4 = |e: &&GidEntry| is_ipv4(&e.gid);
    // A range names its own family (NCCL would silently ignore a range of the other family).
    let family = match cfg.addr_range {
        Some(r) if r.addr.is_ipv4() => Family::V4,
        Some(_) => Family::V6,
        None => cfg.addr_family,
    };
    let (want, other) = match family {
        Family::V4 => ("AF_INET", "AF_INET6"),
        Family::V6 => ("AF_INET6", "AF_INET"),
    };
    let of_family =
        |fam: Family| table.iter().filter(fits).find(move |e| (fam == Family::V4) == v4(e));
    let mut why = format!("first RoCE v{} {want} GID", cfg.roce_version);
    if let Some(r) = cfg.addr_range {
        why += &format!(" in NCCL_IB_ADDR_RANGE {}/{}", r.addr, r.len);
    }
    if !cfg.gid_netdevs.is_empty() {
        why += &format!(" on FERROCE_GID_NETDEV {}", cfg.gid_netdevs.join(","));
    }
    if let Some(e) = of_family(family) {
        return Ok(pick(e, why));
    }
    let flipped = if family == Family::V4 { Family::V6 } else { Family::V4 };
    if let Some(e) = of_family(flipped).filter(|_| cfg.addr_range.is_none()) {
        return Ok(pick(e, format!("{why}: none, so the first {other} one")));
    }
    Err(Error::NoDevice(format!(
        "{dev} has no usable GID ({why} wanted; zero and link-local GIDs are never chosen automatically); give its interface an address or set NCCL_IB_GID_INDEX / FERROCE_GID_INDEX"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, gid: &str, kind: GidType, netdev: &str) -> GidEntry {
        GidEntry {
            index,
            gid: gid.parse::<Ipv6Addr>().unwrap().octets(),
            kind,
            netdev: Some(netdev.into()),
        }
    }

    /// rxe0 as the VM test leaves it: link-local, two IPv4 addresses, a ULA IPv6 address.
    fn table() -> Vec<GidEntry> {
        use GidType::*;
        vec![
            entry(0, "fe80::1", RoceV2, "vethA"),
            entry(1, "::ffff:198.18.0.1", RoceV2, "vethA"),
            entry(2, "::ffff:198.18.1.1", RoceV2, "vethA"),
            entry(3, "fd00:198:18::1", RoceV2, "vethA"),
            entry(4, "::ffff:10.9.9.9", RoceV1, "vethA"),
            entry(5, "::ffff:10.7.7.7", Unknown, "eth9"),
        ]
    }

    fn cfg(pairs: &[(&'static str, &'static str)]) -> Config {
        let pairs = pairs.to_vec();
        Config::from_lookup(move |k| {
            pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        })
        .unwrap()
    }

    fn idx(pairs: &[(&'static str, &'static str)]) -> Result<u8> {
        choose("rxe0", &table(), &cfg(pairs), true).map(|c| c.index)
    }

    #[test]
    fn automatic_choice_is_nccl_compatible() {
        let c = choose("rxe0", &table(), &cfg(&[]), true).unwrap();
        assert_eq!((c.index, c.ip().to_string()), (1, "198.18.0.1".into()));
        assert!(c.why.contains("RoCE v2 AF_INET"), "{}", c.why);
        assert_eq!(idx(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6")]).unwrap(), 3);
        assert_eq!(idx(&[("NCCL_IB_ADDR_RANGE", "198.18.1.0/24")]).unwrap(), 2);
        assert_eq!(idx(&[("NCCL_IB_ADDR_RANGE", "fd00::/8")]).unwrap(), 3);
        assert_eq!(idx(&[("NCCL_IB_ROCE_VERSION_NUM", "1")]).unwrap(), 4);
    }

    #[test]
    fn explicit_choices_win() {
        assert_eq!(idx(&[("NCCL_IB_GID_INDEX", "2")]).unwrap(), 2);
        assert_eq!(
            idx(&[("FERROCE_GID_INDEX", "rxe1:1,rxe0:3"), ("NCCL_IB_GID_INDEX", "2")]).unwrap(),
            3
        );
        assert_eq!(idx(&[("FERROCE_GID_INDEX", "rxe1:1"), ("NCCL_IB_GID_INDEX", "2")]).unwrap(), 2);
        // Link-local and unknown-type entries only when asked for.
        assert_eq!(idx(&[("FERROCE_GID_IP", "fe80::1")]).unwrap(), 0);
        assert_eq!(idx(&[("NCCL_IB_GID_INDEX", "5")]).unwrap(), 5);
        let e = idx(&[("NCCL_IB_GID_INDEX", "9")]).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_GID_INDEX") && e.contains("index 9"), "{e}");
    }

    #[test]
    fn netdev_filter_and_failures_explain_themselves() {
        assert!(idx(&[("FERROCE_GID_NETDEV", "eth9")]).is_err(), "unknown type is never automatic");
        let e = idx(&[("FERROCE_GID_NETDEV", "vethB")]).unwrap_err().to_string();
        assert!(e.contains("FERROCE_GID_NETDEV vethB") && e.contains("rxe0"), "{e}");
        assert!(
            idx(&[("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")]).is_err(),
            "v2 only, and no v2 in 10/8"
        );
        // Only a link-local GID: refused automatically.
        let ll = vec![entry(0, "fe80::1", GidType::RoceV2, "vethA")];
        assert!(choose("rxe0", &ll, &cfg(&[]), true).is_err());
    }

    #[test]
    fn falls_back_to_the_other_family_only_without_a_range() {
        let v6_only = vec![
            entry(0, "fe80::1", GidType::RoceV2, "e"),
            entry(1, "2001:db8::5", GidType::RoceV2, "e"),
        ];
        let c = choose("d", &v6_only, &cfg(&[]), true).unwrap();
        assert_eq!(c.index, 1);
        assert!(c.why.contains("AF_INET6"), "{}", c.why);
        assert!(
            choose("d", &v6_only, &cfg(&[("NCCL_IB_ADDR_RANGE", "2001:db8::/32")]), true).is_ok()
        );
        assert!(
            choose("d", &v6_only, &cfg(&[("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")]), true).is_err()
        );
    }

    #[test]
    fn infiniband_uses_index_zero() {
        let t = vec![entry(0, "fe80::2", GidType::Unknown, "ib0")];
        assert_eq!(choose("mlx5_0", &t, &cfg(&[]), false).unwrap().index, 0);
    }

    #[test]
    fn a_link_local_gid_listens_on_a_routable_address_of_its_interface() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let on_iface = [ip("fe80::1"), ip("fd00::5"), ip("198.18.0.1")];
        assert_eq!(listen_ip_for(ip("198.18.0.1"), &on_iface), Some(ip("198.18.0.1")));
        assert_eq!(listen_ip_for(ip("fd00::5"), &[]), Some(ip("fd00::5")));
        assert_eq!(listen_ip_for(ip("fe80::1"), &on_iface), Some(ip("198.18.0.1")));
        assert_eq!(listen_ip_for(ip("fe80::1"), &on_iface[..2]), Some(ip("fd00::5")));
        assert_eq!(listen_ip_for(ip("fe80::1"), &on_iface[..1]), None);
        assert!(is_link_local_ip(ip("febf::1")) && !is_link_local_ip(ip("fec0::1")));
    }
}
