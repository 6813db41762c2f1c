//! ECMP control: the RoCEv2 UDP source port of every queue pair.
//!
//! Switches hash a RoCEv2 packet's 5-tuple, in which only the UDP source port varies between
//! the flows of two hosts. The kernel derives that port from the GRH flow label
//! (`rdma_flow_label_to_udp_sport`: `0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14))`; mlx5
//! since Linux 5.8, rxe since 5.17), so a label below 0x4000 gives port `0xC000 | label`.
//! ferroce gives every QP of a connection its own, deterministic port from
//! `FERROCE_SPORT_BASE` .. `+FERROCE_SPORT_RANGE`. With `FERROCE_SPORT_SPREAD=1` the
//! connections of one process to one peer get disjoint blocks of ports ([`Blocks`]): the
//! connector takes the next block of its own half of the range (the lower address takes the
//! lower half, so the two directions between two hosts never meet), starting from a random
//! offset per process and peer. Both ends set the same label on their QP, so requests and ACKs
//! of a QP share the port.
//!
//! Arithmetic, plus the per-peer block counters; `setup` applies it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

/// The UDP source port the kernel uses for flow label `fl`.
pub fn port_of_label(fl: u32) -> u16 {
    (0xc000 | ((fl & 0x3fff) ^ ((fl & 0xf_c000) >> 14))) as u16
}

/// The flow label that makes the kernel use `port` (49152..=65535).
pub fn label_of_port(port: u16) -> u32 {
    debug_assert!(port >= 0xc000);
    u32::from(port & 0x3fff)
}

/// The source ports of `nqps` QPs without spreading (`FERROCE_SPORT_SPREAD=0`):
/// `base + i % range`, the same for every connection.
pub fn source_ports(base: u16, range: u16, nqps: usize) -> Vec<u16> {
    let range = u64::from(range.max(1));
    (0..nqps as u64).map(|i| base + (i % range) as u16).collect()
}

/// The blocks of source ports this process has handed out, per peer address.
pub struct Blocks {
    seed: u64,
    next: Mutex<HashMap<IpAddr, u64>>,
}

impl Blocks {
    pub fn new(seed: u64) -> Blocks {
        Blocks { seed, next: Mutex::new(HashMap::new()) }
    }

    /// The ports of the next connection from `own` to `peer`: block `k` (the number of earlier
    /// connections to `peer`) of `nqps` consecutive ports in this direction's half of the
    /// range, from a random start. Blocks repeat only after the half is used up.
    pub fn take(&self, base: u16, range: u16, nqps: usize, own: IpAddr, peer: IpAddr) -> Vec<u16> {
        let k = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let k = next.entry(peer).or_insert(0);
            *k += 1;
            *k - 1
        };
        let range = u64::from(range.max(1));
        let canon = |a: IpAddr| match a {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        // Halves only where a block fits in one; else both directions share the whole range.
        let (lo, len) = match (canon(own).cmp(&canon(peer)), range / 2 >= nqps as u64) {
            (std::cmp::Ordering::Less, true) => (0, range / 2),
            (std::cmp::Ordering::Greater, true) => (range / 2, range - range / 2),
            _ => (0, range),
        };
        let start = mix(self.seed ^ mix(u128::from(canon(peer)) as u64)) % len;
        let first = start + k * nqps as u64;
        (0..nqps as u64).map(|i| base + (lo + (first + i) % len) as u16).collect()
    }
}

/// A 64-bit finaliser (splitmix64), so nearby keys land far apart in the range.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_formula_matches_the_reference_example() {
        assert_eq!(port_of_label(0x12345), 58177);
        assert_eq!(port_of_label(0), 0xc000);
    }

    #[test]
    fn every_port_round_trips_through_its_label() {
        for port in 0xc000..=0xffffu16 {
            let fl = label_of_port(port);
            assert!(fl < 0x10_0000, "20-bit flow label");
            assert_eq!(port_of_label(fl), port);
        }
    }

    #[test]
    fn ports_are_distinct_and_deterministic() {
        let p = source_ports(0xc000, 0x4000, 8);
        assert_eq!(p, (0xc000..0xc008).collect::<Vec<u16>>());
        // Wraps inside the range.
        assert_eq!(source_ports(65534, 2, 3), [65534, 65535, 65534]);
    }

    #[test]
    fn blocks_to_one_peer_are_disjoint_and_the_directions_never_meet() {
        let (a, b): (IpAddr, IpAddr) =
            ("198.18.0.1".parse().unwrap(), "198.18.0.2".parse().unwrap());
        for seed in 0..50u64 {
            let (pa, pb) = (Blocks::new(seed), Blocks::new(seed ^ 0xabc));
            let mut seen = std::collections::HashSet::new();
            // 64 connections each way, 4 QPs: 512 ports of an 8192-port half each.
            for _ in 0..64 {
                for p in pa
                    .take(0xc000, 0x4000, 4, a, b)
                    .into_iter()
                    .chain(pb.take(0xc000, 0x4000, 4, b, a))
                {
                    assert!(p >= 0xc000, "port {p} below the base");
                    assert!(seen.insert(p), "seed {seed}: port {p} used twice between a and b");
                }
            }
        }
        // The lower address takes the lower half.
        let low = Blocks::new(7).take(0xc000, 0x4000, 2, a, b);
        assert!(low.iter().all(|&p| p < 0xe000), "{low:?}");
        let high = Blocks::new(7).take(0xc000, 0x4000, 2, b, a);
        assert!(high.iter().all(|&p| p >= 0xe000), "{high:?}");
        // A range too small to halve still gives distinct ports within the range.
        let tiny = Blocks::new(1).take(60000, 3, 3, a, b);
        assert_eq!(tiny.iter().collect::<std::collections::HashSet<_>>().len(), 3);
        assert!(tiny.iter().all(|&p| (60000..60003).contains(&p)));
    }
}
