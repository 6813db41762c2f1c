//! Which GID a connection uses, and why.
//!
//! Pure logic over a GID table read once per device at discovery. The automatic choice follows
//! NCCL's preference for RoCEv2 with an IPv4 address, and never takes a zero or link-local GID:
//! 1. `NCCL_IB_GID_INDEX`, when set, wins (it must name a non-zero entry);
//! 2. else the first RoCE v2 GID holding an IPv4 address (`::ffff:a.b.c.d`);
//! 3. else the first RoCE v2 GID with a global IPv6 address;
//! 4. on an InfiniBand port, index 0.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
    gid[0] == 0xfe && gid[1] & 0xc0 == 0x80
}

fn is_ipv4(gid: &[u8; 16]) -> bool {
    matches!(ip_of(gid), IpAddr::V4(v4) if v4 != Ipv4Addr::UNSPECIFIED)
}

/// Chooses the GID for a RoCE port (`ethernet`) or an InfiniBand port.
pub fn choose(
    dev: &str,
    table: &[GidEntry],
    forced: Option<u8>,
    ethernet: bool,
) -> Result<GidChoice> {
    let pick = |e: &GidEntry, why: String| GidChoice {
        index: e.index,
        gid: e.gid,
        netdev: e.netdev.clone(),
        why,
    };
    if let Some(i) = forced {
        return match table.iter().find(|e| e.index == i && !is_zero(&e.gid)) {
            Some(e) => Ok(pick(e, "NCCL_IB_GID_INDEX".into())),
            None => Err(Error::config(
                "NCCL_IB_GID_INDEX",
                &i.to_string(),
                format!(
                    "{dev} has no GID at index {i} (see /sys/class/infiniband/{dev}/ports/*/gids)"
                ),
            )),
        };
    }
    if let Some(e) = table.iter().find(|e| !ethernet && e.index == 0) {
        return Ok(pick(e, "InfiniBand port: index 0".into()));
    }
    let v2 =
        |e: &&GidEntry| e.kind == GidType::RoceV2 && !is_zero(&e.gid) && !is_link_local(&e.gid);
    if let Some(e) = table.iter().filter(v2).find(|e| is_ipv4(&e.gid)) {
        return Ok(pick(e, "first RoCE v2 GID with an IPv4 address".into()));
    }
    if let Some(e) = table.iter().find(v2) {
        return Ok(pick(e, "first RoCE v2 GID with a global IPv6 address (no IPv4 one)".into()));
    }
    Err(Error::NoDevice(format!(
        "{dev} has no RoCE v2 GID with an IP address; give its interface an address or set \
         NCCL_IB_GID_INDEX"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, gid: &str, kind: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: gid.parse::<Ipv6Addr>().unwrap().octets(),
            kind,
            netdev: Some("eth0".into()),
        }
    }

    fn rxe_table() -> Vec<GidEntry> {
        vec![entry(0, "fe80::1", GidType::RoceV2), entry(1, "::ffff:198.18.0.1", GidType::RoceV2)]
    }

    #[test]
    fn picks_the_ipv4_rocev2_gid() {
        let c = choose("rxe0", &rxe_table(), None, true).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.ip().to_string(), "198.18.0.1");
    }

    #[test]
    fn prefers_v2_over_v1_and_skips_link_local_and_zero() {
        let t = vec![
            entry(0, "fe80::1", GidType::RoceV2),
            entry(1, "::", GidType::RoceV2),
            entry(2, "::ffff:10.0.0.1", GidType::RoceV1),
            entry(3, "2001:db8::5", GidType::RoceV2),
            entry(4, "::ffff:10.0.0.1", GidType::RoceV2),
        ];
        assert_eq!(choose("d", &t, None, true).unwrap().index, 4);
        assert_eq!(choose("d", &t[..4], None, true).unwrap().index, 3);
        assert!(choose("d", &t[..3], None, true).is_err());
    }

    #[test]
    fn unknown_types_are_not_chosen_automatically() {
        let t = vec![entry(0, "::ffff:10.0.0.1", GidType::Unknown)];
        assert!(choose("d", &t, None, true).is_err());
        assert_eq!(choose("d", &t, Some(0), true).unwrap().why, "NCCL_IB_GID_INDEX");
    }

    #[test]
    fn forced_index_must_exist() {
        assert_eq!(choose("rxe0", &rxe_table(), Some(0), true).unwrap().index, 0);
        let e = choose("rxe0", &rxe_table(), Some(7), true).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_GID_INDEX") && e.contains("index 7"), "{e}");
    }

    #[test]
    fn infiniband_uses_index_zero() {
        let t = vec![entry(0, "fe80::2", GidType::Unknown)];
        assert_eq!(choose("mlx5_0", &t, None, false).unwrap().index, 0);
    }
}
