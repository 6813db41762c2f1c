//! ECMP control: the RoCEv2 UDP source port of every queue pair.
//!
//! Switches hash a RoCEv2 packet's 5-tuple, in which only the UDP source port varies between
//! the flows of two hosts. The kernel derives that port from the GRH flow label
//! (`rdma_flow_label_to_udp_sport`: `0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14))`; mlx5
//! since Linux 5.8, rxe since 5.17), so a label below 0x4000 gives port `0xC000 | label`.
//! ferroce gives every QP of a connection its own, deterministic port from
//! `FERROCE_SPORT_BASE` .. `+FERROCE_SPORT_RANGE`; with `FERROCE_SPORT_SPREAD=1` each
//! connection starts at its own offset (from the listener's nonce), so many connections between
//! the same two hosts do not all land on the same ports. Both ends set the same label on their
//! QP, so requests and ACKs of a QP share the port.
//!
//! Pure arithmetic; `setup` applies it.

/// The UDP source port the kernel uses for flow label `fl`.
pub fn port_of_label(fl: u32) -> u16 {
    (0xc000 | ((fl & 0x3fff) ^ ((fl & 0xf_c000) >> 14))) as u16
}

/// The flow label that makes the kernel use `port` (49152..=65535).
pub fn label_of_port(port: u16) -> u32 {
    debug_assert!(port >= 0xc000);
    u32::from(port & 0x3fff)
}

/// The source ports of `nqps` QPs: `base + (offset + i) % range`.
pub fn source_ports(base: u16, range: u16, nqps: usize, spread_key: Option<u64>) -> Vec<u16> {
    let range = u64::from(range.max(1));
    let offset = spread_key.map_or(0, |k| mix(k) % range);
    (0..nqps as u64).map(|i| base + ((offset + i) % range) as u16).collect()
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
        let p = source_ports(0xc000, 0x4000, 8, None);
        assert_eq!(p, (0xc000..0xc008).collect::<Vec<u16>>());
        let a = source_ports(50000, 1000, 128, Some(42));
        assert_eq!(a, source_ports(50000, 1000, 128, Some(42)));
        let set: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(set.len(), 128);
        assert!(a.iter().all(|&x| (50000..51000).contains(&x)));
        // Wraps inside the range.
        assert_eq!(source_ports(65534, 2, 3, None), [65534, 65535, 65534]);
    }

    #[test]
    fn spread_gives_connections_different_offsets() {
        let starts: std::collections::HashSet<u16> =
            (0..64u64).map(|k| source_ports(0xc000, 0x4000, 1, Some(k))[0]).collect();
        assert!(starts.len() >= 60, "64 connections share only {} start ports", starts.len());
    }
}
