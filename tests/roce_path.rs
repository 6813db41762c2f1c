//! RoCEv2 path control on the wire, inside the Soft-RoCE VM: UDP source ports per QP (ECMP),
//! the split of bytes across QPs, DSCP from the traffic-class knobs, bounded failure on a dead
//! path or a vanished peer device, and the GID knobs. tcpdump on vethA is the witness; each test
//! prints its evidence. `#[ignore]`d on the host; `ci/vm-tests.sh` runs them in the VM.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ferroce::transport::ecmp;
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::take_captured;

const SENDER: [u8; 4] = [198, 18, 0, 1];

/// Sends `count` messages of `size` bytes from rxe0 to rxe1 on a fresh connection, with the
/// current environment's knobs; returns the INFO lines the plugin logged.
fn traffic(size: usize, count: usize, comm_tc: i32) -> Vec<String> {
    set_env(&[("NCCL_DEBUG", Some("INFO"))]); // the statistics lines
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init_with_tc(1, comm_tc).unwrap();
    take_captured();
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    for i in 0..count {
        transfer(&drv, send, recv, size, i as u8).unwrap();
    }
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, recv).unwrap();
    drv.finalize(ctx).unwrap();
    take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect()
}

/// The source ports the plugin logged for its connection ("UDP source ports [a, b]").
fn logged_ports(info: &[String]) -> Vec<u16> {
    let line = info.iter().find(|l| l.contains("connected to")).expect("connection INFO line");
    let list = line.split("UDP source ports [").nth(1).unwrap().split(']').next().unwrap();
    list.split(',').map(|p| p.trim().parse().unwrap()).collect()
}

/// Per source port: (packets, UDP bytes) of the sender's RDMA WRITE packets, and the set of all
/// source ports seen in either direction.
fn by_port(pkts: &[Packet]) -> (BTreeMap<u16, (u64, u64)>, Vec<u16>) {
    let mut writes = BTreeMap::new();
    for p in pkts.iter().filter(|p| p.src == SENDER && (0x06..=0x0b).contains(&p.opcode)) {
        let e = writes.entry(p.sport).or_insert((0, 0));
        e.0 += 1;
        e.1 += u64::from(p.udp_len);
    }
    let mut all: Vec<u16> = pkts.iter().map(|p| p.sport).collect();
    all.sort();
    all.dedup();
    (writes, all)
}

fn print_evidence(title: &str, pkts: &[Packet]) {
    let (writes, all) = by_port(pkts);
    eprintln!(
        "tcpdump -i vethA 'udp port 4791' ({title}): {} packets, source ports {all:?}",
        pkts.len()
    );
    for (port, (n, bytes)) in &writes {
        eprintln!("  sport {port}: {n} RDMA WRITE packets from 198.18.0.1, {bytes} UDP bytes");
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn split_mode_uses_exactly_the_computed_ports_with_equal_shares() {
    let _g = vm_serial();
    // Equal chunks exactly: path-aware placement may leave a lane out of a message where its
    // path measured slow (on a busy host a healthy one can, for a moment; that lane still
    // carries at least half its share over a sweep of sizes, see
    // every_lane_carries_its_share_on_a_clean_link).
    set_env(&[
        ("NCCL_IB_QPS_PER_CONNECTION", Some("4")),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", Some("1")),
        ("FERROCE_SPORT_BASE", Some("50000")),
        ("FERROCE_SPORT_SPREAD", Some("0")),
        ("FERROCE_PATH_AWARE", Some("0")),
    ]);
    let cap = Capture::start("vethA");
    let info = traffic(1 << 20, 8, -1);
    let pkts = cap.stop();
    set_env(&[
        ("NCCL_IB_QPS_PER_CONNECTION", None),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", None),
        ("FERROCE_SPORT_BASE", None),
        ("FERROCE_SPORT_SPREAD", None),
        ("FERROCE_PATH_AWARE", None),
    ]);
    print_evidence("4 QPs, split, base 50000", &pkts);
    let want = ecmp::source_ports(50000, 15536, 4); // range: from the base to 65535
    assert_eq!(want, [50000, 50001, 50002, 50003]);
    assert_eq!(logged_ports(&info), want, "the log names the ports");
    let (writes, all) = by_port(&pkts);
    assert_eq!(all, want, "exactly the 4 computed ports appear, in both directions");
    assert_eq!(writes.keys().copied().collect::<Vec<_>>(), want);
    let mean = writes.values().map(|w| w.1 as f64).sum::<f64>() / 4.0;
    for (port, (_, bytes)) in &writes {
        let dev = (*bytes as f64 - mean).abs() / mean;
        assert!(
            dev <= 0.05,
            "sport {port} carried {bytes} bytes, {:.1}% off the mean {mean:.0}",
            dev * 100.0
        );
    }
    // The statistics at close, on both ends: 8 messages of 1 MiB, each QP's port with a
    // quarter of the bytes (the sender's) or 8 chunks (the receiver's) and no failed
    // completion, and the device's counters that moved.
    for end in ["send comm to", "receive comm from"] {
        let line = info
            .iter()
            .find(|l| l.contains(end) && l.contains("closed"))
            .unwrap_or_else(|| panic!("no {end} statistics line: {info:#?}"));
        eprintln!("  {line}");
        assert!(line.contains("8 messages, 8.0 MiB"), "{line}");
        for port in &want {
            let qp = if end == "send comm to" {
                format!("sport {port}: 2.0 MiB (25.0%), 0 failed completions, 8 chunks")
            } else {
                format!("sport {port}: 0 failed completions, 8 chunks")
            };
            assert!(line.contains(&qp), "{qp}: {line}");
        }
        assert!(
            line.contains("hw_counters over this time: ") && line.contains("_pkts +"),
            "{line}"
        );
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn round_robin_and_spread_ports_are_the_logged_ones() {
    let _g = vm_serial();
    // Round-robin with the default spread: two connections to one peer get disjoint blocks.
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", Some("3")), ("NCCL_IB_SPLIT_DATA_ON_QPS", Some("0"))]);
    let cap = Capture::start("vethA");
    let first = logged_ports(&traffic(65536, 6, -1));
    let second = logged_ports(&traffic(65536, 6, -1));
    let pkts = cap.stop();
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", None), ("NCCL_IB_SPLIT_DATA_ON_QPS", None)]);
    print_evidence("2 connections x 3 QPs, round-robin, spread", &pkts);
    eprintln!("  logged: first {first:?}, second {second:?}");
    let mut want: Vec<u16> = first.iter().chain(&second).copied().collect();
    want.sort();
    want.dedup();
    assert_eq!(want.len(), 6, "two spread connections use 6 distinct ports: {first:?} {second:?}");
    let (writes, all) = by_port(&pkts);
    assert_eq!(all, want, "the wire shows exactly the logged ports");
    assert_eq!(writes.len(), 6, "round-robin puts messages on every QP: {writes:?}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn dscp_on_the_wire_matches_the_traffic_class_knobs() {
    let _g = vm_serial();
    // NCCL_IB_TC for data, NCCL_IB_FIFO_TC for the receiver's control writes and ACKs.
    set_env(&[("NCCL_IB_TC", Some("104")), ("NCCL_IB_FIFO_TC", Some("184"))]);
    let cap = Capture::start("vethA");
    let knob_info = traffic(65536, 4, -1);
    let pkts = cap.stop();
    set_env(&[("NCCL_IB_TC", None), ("NCCL_IB_FIFO_TC", None)]);
    // The communicator's traffic class (v11+ config) when NCCL_IB_TC is unset; with
    // NCCL_IB_SL unset it is the service level too (its 4 bits: 72 & 15 = 8), as in NCCL.
    let cap = Capture::start("vethA");
    let comm_info = traffic(65536, 4, 72);
    let comm = cap.stop();
    set_env(&[("NCCL_IB_SL", Some("3"))]);
    let sl_info = traffic(4096, 1, 72);
    set_env(&[("NCCL_IB_SL", None)]);
    let sl_of = |info: &[String]| {
        let line = info.iter().find(|l| l.contains("connected to")).expect("connection line");
        line.split(", sl ").nth(1).and_then(|r| r.split(',').next()).unwrap_or("").to_string()
    };
    let sls = [sl_of(&knob_info), sl_of(&comm_info), sl_of(&sl_info)];
    eprintln!(
        "service levels logged: no comm tc {}, comm tc 72 {}, NCCL_IB_SL=3 {}",
        sls[0], sls[1], sls[2]
    );
    assert_eq!(sls, ["0", "8", "3"], "SL: 0 by default, the comm's traffic class, the knob");
    let tos = |pkts: &[Packet], src: [u8; 4]| {
        let mut t: Vec<u8> = pkts.iter().filter(|p| p.src == src).map(|p| p.tos).collect();
        t.sort();
        t.dedup();
        t
    };
    let (data, ctl, comm_data) =
        (tos(&pkts, SENDER), tos(&pkts, [198, 18, 0, 2]), tos(&comm, SENDER));
    eprintln!(
        "IPv4 TOS seen: data {data:?} (DSCP {:?}), control {ctl:?} (DSCP {:?}), comm config {comm_data:?}",
        data.iter().map(|t| t >> 2).collect::<Vec<_>>(),
        ctl.iter().map(|t| t >> 2).collect::<Vec<_>>()
    );
    assert_eq!(data, [104], "data packets carry NCCL_IB_TC (DSCP 26)");
    assert_eq!(ctl, [184], "control writes and ACKs carry NCCL_IB_FIFO_TC (DSCP 46)");
    assert_eq!(comm_data, [72], "the communicator's traffic class (DSCP 18)");
}

fn netem(args: &[&str]) {
    run("tc", &[&["qdisc"], args].concat());
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn total_loss_fails_pending_requests_within_the_retry_bound() {
    let _g = vm_serial();
    set_env(&[("NCCL_IB_TIMEOUT", Some("14")), ("NCCL_IB_RETRY_CNT", Some("3"))]);
    let (took, err, warns) = send_into_total_loss();
    set_env(&[("NCCL_IB_TIMEOUT", None), ("NCCL_IB_RETRY_CNT", None)]);
    let bound = ferroce::config::retry_bound(14, 3);
    let margin = Duration::from_secs(2);
    eprintln!(
        "100% loss: error after {took:?} (bound {bound:?} + {margin:?} margin): {err}\n  {warns:#?}"
    );
    assert!(err.contains("ncclResult 6"), "{err}");
    assert!(took <= bound + margin, "failed after {took:?}, bound {bound:?}");
    let w =
        warns.iter().find(|w| w.contains("retry exceeded")).unwrap_or_else(|| panic!("{warns:#?}"));
    for needle in ["198.18.0.2", "GID", "MTU", "PFC/ECN", "NCCL_IB_TIMEOUT"] {
        assert!(w.contains(needle), "the WARN should mention {needle}: {w}");
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn total_loss_with_unending_retries_fails_at_the_progress_deadline() {
    let _g = vm_serial();
    // rxe treats retry_cnt 7 as "retry forever": only ferroce's progress deadline ends this.
    set_env(&[
        ("NCCL_IB_TIMEOUT", Some("12")),
        ("NCCL_IB_RETRY_CNT", Some("7")),
        ("FERROCE_PROGRESS_TIMEOUT_MS", Some("2000")),
    ]);
    let (took, err, warns) = send_into_total_loss();
    set_env(&[
        ("NCCL_IB_TIMEOUT", None),
        ("NCCL_IB_RETRY_CNT", None),
        ("FERROCE_PROGRESS_TIMEOUT_MS", None),
    ]);
    eprintln!("100% loss, retry 7: error after {took:?} (deadline 2 s): {err}\n  {warns:#?}");
    assert!(err.contains("ncclResult 6"), "{err}");
    // Not before the deadline (a busy machine only makes it later); the upper bound is a
    // generous deadline, not a measure.
    assert!(took >= Duration::from_millis(1900) && took <= Duration::from_secs(20), "{took:?}");
    let w = warns
        .iter()
        .find(|w| w.contains("FERROCE_PROGRESS_TIMEOUT_MS"))
        .unwrap_or_else(|| panic!("{warns:#?}"));
    for needle in ["198.18.0.2", "GID", "MTU", "PFC/ECN", "NCCL_IB_TIMEOUT"] {
        assert!(w.contains(needle), "the WARN should mention {needle}: {w}");
    }
}

/// Connects rxe0 -> rxe1 with the current knobs, lets the receive's CTS land, drops every
/// packet leaving vethA, and sends 1 MiB: how long until `test` fails, its error, the WARNs.
fn send_into_total_loss() -> (Duration, String, Vec<String>) {
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    let mut src = vec![7u8; 1 << 20];
    let mut dst = vec![0u8; 1 << 20];
    let smh = drv.reg_mr(send, src.as_mut_ptr(), src.len()).unwrap();
    let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), dst.len()).unwrap();
    until("irecv", || drv.irecv(recv, &[dst.as_mut_ptr()], &[1 << 20], &[0], &[rmh], false))
        .unwrap();
    std::thread::sleep(Duration::from_millis(500)); // let the CTS land before the path dies
    take_captured();
    netem(&["add", "dev", "vethA", "root", "netem", "loss", "100%"]);
    let t = Instant::now();
    let req: Ptr = until("isend", || drv.isend(send, src.as_mut_ptr(), 1 << 20, 0, smh)).unwrap();
    let err = loop {
        match drv.test(req) {
            Ok(None) => {}
            Ok(Some(_)) => break String::from("completed despite 100% loss"),
            Err(e) => break e,
        }
        if t.elapsed() > Duration::from_secs(30) {
            break String::from("no error within 30 s");
        }
    };
    let took = t.elapsed();
    netem(&["del", "dev", "vethA", "root"]);
    let warns: Vec<String> = warnings();
    let _ = (drv.close(Close::Send, send), drv.close(Close::Recv, recv));
    drv.finalize(ctx).unwrap();
    (took, err, warns)
}

/// One lane's path black-holed mid-run, as a bad switch port or ECMP member does: a tc u32
/// filter drops every packet arriving at vethB with that lane's UDP source port. With 4 lanes, in
/// both split modes, for lane 0 (whose path also carries the receiver's CTS rows, through the
/// sender's ACKs) and another: every message arrives intact, one WARN names the lane and its
/// port, and the live lanes carry on.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_dead_lane_fails_over_to_the_live_ones() {
    let _g = vm_serial();
    for (split, lane) in [("1", 2), ("0", 0), ("1", 0), ("0", 3)] {
        let r = with_four_lanes(split, None, || failover_run(lane));
        let (port, took, warns) = r.unwrap_or_else(|e| panic!("split {split}, lane {lane}: {e}"));
        eprintln!(
            "split {split}: lane {lane} (sport {port}) dropped after 12 messages; 48 messages \
             verified; the longest message after the drop took {took:?} (retry bound \
             {:?})\n  {warns:#?}",
            ferroce::config::retry_bound(17, 4)
        );
        // One WARN from the sender. The receiver warns only where the dead lane carried its
        // CTS rows (lane 0: the sender's ACKs of them share that lane's path), and then only
        // if its own writes run out of retries before the sender's repair request reaches it
        // (serving that, it moves its rows off the lane and rebuilds it, with nothing to warn
        // of): at most one.
        let of = |end: &str| -> Vec<&String> {
            warns.iter().filter(|w| w.contains("lane ") && w.contains(end)).collect()
        };
        let (sent, got) = (of("of the send comm"), of("of the receive comm"));
        assert_eq!(sent.len(), 1, "one sender WARN for the failed lane: {warns:#?}");
        assert!(got.len() <= usize::from(lane == 0), "receiver WARNs: {warns:#?}");
        for w in sent.iter().chain(&got) {
            for needle in
                [format!("lane {lane} "), format!("UDP source port {port}"), "ECMP".into()]
            {
                assert!(w.contains(&needle), "the WARN should name {needle}: {w}");
            }
        }
    }
}

/// A lane's path dies at NCCL's default timeouts, nothing set by hand (`NCCL_IB_TIMEOUT=20`,
/// `NCCL_IB_RETRY_CNT=7`: on Soft-RoCE the retries never run out, on a ConnectX they take
/// about 34 s): the lane's packets vanish at vethB, 8 verified messages in. The stall bound
/// (`FERROCE_LANE_STALL_MS`) must fence it and move its work to the live lane: the run goes on,
/// every message verified, with one WARN naming the stall. The drop is lifted after 16 more
/// messages, and the lane is repaired while messages keep flowing. 2 lanes (the default),
/// lane 0 (the control lane) and lane 1, both split modes. Prints the longest a message took
/// after the drop (the time from the path's death to its work moving) and the repair's time.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_dead_path_fails_over_at_nccls_default_timeouts() {
    let _g = vm_serial();
    for (split, lane) in [("0", 1), ("1", 0), ("0", 0), ("1", 1)] {
        set_env(&[("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split))]);
        let r =
            on_a_pair(lane, |drv, send, recv, port| default_timeouts_run(drv, (send, recv), port));
        clear_paths();
        set_env(&[("NCCL_IB_SPLIT_DATA_ON_QPS", None)]);
        let ((took, repaired_in, warns), _) =
            r.unwrap_or_else(|e| panic!("split {split}, lane {lane}: {e}"));
        eprintln!(
            "split {split}, lane {lane}: the longest message after the drop took {took:?}; \
             repaired {repaired_in:.2} s after the lift\n  {warns:#?}"
        );
        let stalled = |w: &String| {
            w.contains(&format!("lane {lane} on "))
                && w.contains("of the send comm")
                && w.contains("FERROCE_LANE_STALL_MS")
        };
        assert!(
            warns.iter().any(stalled),
            "split {split}, lane {lane}: no stall WARN for the lane: {warns:#?}"
        );
    }
}

/// LL with a dead control lane, at NCCL's default timeouts: optional receives (NCCL's LL and
/// LL128, whose arrival NCCL sees in the data) go whole on both lanes, as whole messages do;
/// lane 0 carries the receiver's CTS rows too. 8 messages in, lane 0's packets vanish at vethB;
/// the stall bound fences it, the LL messages and the rows move to lane 1, and every one of 32
/// messages still lands: the receiver watches each buffer for its bytes (host memory, as NCCL
/// watches the flags), then poisons it and posts it again (a ring of 8). One WARN names the
/// stall.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn ll_messages_move_off_a_dead_control_lane() {
    let _g = vm_serial();
    let r = on_a_pair(0, |drv, send, recv, port| ll_run(drv, (send, recv), port));
    clear_paths();
    let ((took, warns), _) = r.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("LL, lane 0 dropped: the longest message after the drop took {took:?}\n  {warns:#?}");
    let stalled = |w: &String| {
        w.contains("lane 0 on ")
            && w.contains("of the send comm")
            && w.contains("FERROCE_LANE_STALL_MS")
    };
    assert!(warns.iter().any(stalled), "no stall WARN for lane 0: {warns:#?}");
}

/// [`ll_messages_move_off_a_dead_control_lane`]'s run: the longest message after the drop,
/// and the WARNs.
fn ll_run(
    drv: &Driver,
    (send, recv): (Ptr, Ptr),
    port: u16,
) -> Result<(Duration, Vec<String>), String> {
    const SIZE: usize = 4096;
    const RING: usize = 8;
    let pattern = |m: usize| -> Vec<u8> {
        (0..SIZE).map(|k| (k as u8).wrapping_mul(7).wrapping_add(m as u8) | 1).collect()
    };
    let mut src = vec![vec![0u8; SIZE]; RING];
    let mut dst = vec![vec![0xeeu8; SIZE]; RING];
    let smh = (src.iter_mut().map(|b| drv.reg_mr(send, b.as_mut_ptr(), SIZE)))
        .collect::<Result<Vec<_>, _>>()?;
    let rmh = (dst.iter_mut().map(|b| drv.reg_mr(recv, b.as_mut_ptr(), SIZE)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut took = Duration::ZERO;
    for m in 0..32 {
        if m == 8 {
            drop_on_vethb(&["sport", &port.to_string()]);
        }
        let k = m % RING;
        let t = Instant::now();
        src[k].copy_from_slice(&pattern(m));
        let p = dst[k].as_mut_ptr();
        let r = until("irecv", || drv.irecv(recv, &[p], &[SIZE], &[0], &[rmh[k]], true))?;
        let (mut sreq, mut sent, mut got) = (None, None, None);
        until("LL message", || {
            match sreq {
                None => sreq = drv.isend(send, src[k].as_mut_ptr(), SIZE, 0, smh[k])?,
                Some(q) if sent.is_none() => sent = drv.test(q)?,
                Some(_) => {}
            }
            if got.is_none() {
                got = drv.test(r)?;
            }
            // The data is watched as NCCL watches its flags: read, never written, until whole.
            // SAFETY: `dst[k]` holds SIZE bytes, registered as host memory; the NIC may write
            // it meanwhile, hence a volatile read.
            let landed = unsafe { std::ptr::read_volatile(dst[k].as_ptr().cast::<[u8; SIZE]>()) };
            Ok((sent.is_some() && got.is_some() && landed[..] == pattern(m)[..]).then_some(()))
        })
        .map_err(|e| format!("message {m}: {e}; {:#?}", warnings()))?;
        dst[k].fill(0xee); // NCCL consumed it: the buffer is posted again, poisoned
        if m >= 8 {
            took = took.max(t.elapsed());
        }
    }
    for mh in smh {
        drv.dereg_mr(send, mh)?;
    }
    for mh in rmh {
        drv.dereg_mr(recv, mh)?;
    }
    Ok((took, warnings()))
}

/// [`a_dead_path_fails_over_at_nccls_default_timeouts`]'s run on one pair: the longest message
/// after the drop, seconds from the lift to the repair INFO, and the WARNs.
fn default_timeouts_run(
    drv: &Driver,
    (send, recv): (Ptr, Ptr),
    port: u16,
) -> Result<(Duration, f64, Vec<String>), String> {
    let sizes = [4096usize, 65536, 262_144, 300_000];
    let (mut warns, mut repaired) = (Vec::new(), false);
    let mut log = |warns: &mut Vec<String>| {
        for (level, _, line) in take_captured() {
            match level {
                2 => warns.push(line),
                3 if line.contains(" is repaired") => repaired = true,
                _ => {}
            }
        }
        repaired
    };
    let mut took = Duration::ZERO;
    let mut lifted = None;
    let start = Instant::now();
    for i in 0.. {
        if i == 8 {
            drop_on_vethb(&["sport", &port.to_string()]);
        }
        if i == 24 {
            clear_paths();
            lifted = Some(Instant::now());
        }
        if lifted.is_some() && log(&mut warns) {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            return Err(format!("no repair within 120 s of the start: {warns:#?}"));
        }
        let t = Instant::now();
        transfer_polling(drv, send, recv, sizes[i % sizes.len()], i as u8)
            .map_err(|e| format!("message {i}: {e}; {warns:#?}"))?;
        if (8..24).contains(&i) {
            took = took.max(t.elapsed());
        }
        log(&mut warns);
    }
    let repaired_in = lifted.map_or(0.0, |l| l.elapsed().as_secs_f64());
    Ok((took, repaired_in, warns))
}

/// On a clean link every lane carries its share: 2 and 4 lanes, both split modes, path-aware
/// placement on (the default), one connection streaming (8 in flight) 4 KiB, 64 KiB, 1 MiB and
/// 4 MiB messages in turn, as a benchmark's sweep does. Each lane's bytes are counted on the
/// wire, per UDP source port (tcpdump on vethA, one capture per size): every lane sends writes
/// at every size; each carries at least half of its equal share at every size but one, and
/// over the sweep (its mean share of the four sizes). Placement may move work off a slow or
/// dead lane, never off a healthy one for long: a healthy lane can look slow for a moment on a
/// busy host and lose most of one size's messages, never more. Prints the shares.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn every_lane_carries_its_share_on_a_clean_link() {
    let _g = vm_serial();
    for (lanes, split) in [(2, "0"), (2, "1"), (4, "0"), (4, "1")] {
        let n = lanes.to_string();
        let knobs = [
            ("NCCL_IB_QPS_PER_CONNECTION", Some(n.as_str())),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split)),
        ];
        set_env(&knobs);
        let r = on_a_pair(0, |drv, send, recv, _| {
            let mut shares = Vec::new();
            for (size, count) in [(4096, 64), (65536, 32), (1 << 20, 8), (4 << 20, 2 * lanes)] {
                let cap = Capture::start("vethA");
                stream(drv, (send, recv), size, count, 8)?;
                let (writes, _) = by_port(&cap.stop());
                let total: u64 = writes.values().map(|w| w.1).sum();
                let share: Vec<f64> =
                    writes.values().map(|w| w.1 as f64 / total.max(1) as f64).collect();
                shares.push((size, writes.len(), share));
            }
            Ok(shares)
        });
        set_env(&knobs.map(|(k, _)| (k, None)));
        let (shares, _) = r.unwrap_or_else(|e| panic!("{lanes} lanes, split {split}: {e}"));
        let pct =
            |v: &[f64]| -> Vec<String> { v.iter().map(|s| format!("{:.1}%", 100.0 * s)).collect() };
        let half = 0.5 / lanes as f64;
        let (mut mean, mut short) = (vec![0.0; lanes], Vec::new());
        for (size, ports, share) in &shares {
            eprintln!(
                "{lanes} lanes, split {split}, {size} B: shares per source port {:?}",
                pct(share)
            );
            assert_eq!(*ports, lanes, "{lanes} lanes, split {split}, {size} B: {:?}", pct(share));
            for (m, s) in mean.iter_mut().zip(share) {
                *m += s / shares.len() as f64;
            }
            if share.iter().any(|&s| s < half) {
                short.push(size);
            }
        }
        // One size may miss the bound, not two: on a busy host (CI's hog) split mode once left
        // lane 0 4.7% of the 64 KiB messages (a batch of completions charged its first chunk
        // every descheduled wait, `place::Nic`), and later one lane 8.0% of the 4 MiB ones (the
        // one completion polled after the host was away was charged the absence,
        // `place::avoided`), each time at one size of the sweep.
        assert!(
            short.len() <= 1,
            "{lanes} lanes, split {split}: a lane under half its share at {short:?} B"
        );
        assert!(
            mean.iter().all(|&m| m >= half),
            "{lanes} lanes, split {split}: a lane under half its share over the sweep: {:?}",
            pct(&mean)
        );
        eprintln!("{lanes} lanes, split {split}: mean shares over the sweep {:?}", pct(&mean));
    }
}

/// A lane whose path drops only the receiver-to-sender direction (a tc u32 filter on vethA's
/// ingress matching its UDP source port, which both ends' QPs of a lane share: the receiver's
/// ACKs and its own writes on that lane vanish) for 4 s, longer than the retry bound (2.7 s),
/// mid-run, with receive buffers reused as NCCL reuses them (8 receives posted ahead, over 32
/// buffers taken in turn, each posted again once its receive completed). The sender's writes on that lane keep landing
/// and the receiver completes those receives; after the retry bound the sender may send again
/// only what the receiver did not count. Every message is verified when it completes, and its
/// buffer then handed on as NCCL hands it on: filled with a poison byte, as the next user of
/// the buffer would write it. The poison is checked right before the buffer is posted again,
/// and in every buffer once more after a grace period: any write into a completed receive, even
/// of the same bytes, breaks it. Both split modes, 2 and 4 lanes, lane 0 (the control lane)
/// among them. 48 messages of 16 KiB per case: small enough that many chunks land within rxe's window of
/// 128 packets not acknowledged, so that receives complete while their ACKs are lost.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn an_ack_only_black_hole_never_writes_a_completed_receive() {
    let _g = vm_serial();
    for (split, lanes, lane) in [("0", "2", 1), ("1", "2", 0), ("1", "4", 2), ("0", "4", 0)] {
        let knobs = [
            ("NCCL_IB_QPS_PER_CONNECTION", Some(lanes)),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split)),
            ("NCCL_IB_TIMEOUT", Some("17")),
            ("NCCL_IB_RETRY_CNT", Some("4")),
        ];
        let r = with_knobs(&knobs, || on_a_pair(lane, ring_run));
        let (fences, _) =
            r.unwrap_or_else(|e| panic!("split {split}, {lanes} lanes, lane {lane}: {e}"));
        eprintln!("split {split}, {lanes} lanes, lane {lane}: 48 messages verified\n  {fences:#?}");
    }
}

/// A receive comm closes while its sender waits on it. The receiver's ACKs on lane 1 are lost
/// (dropped at vethA), so every receive completes, but the sender's writes on that lane run out
/// of retries, and it asks the receiver, through lane 0, to fence the lane. With nothing
/// outstanding the receiver's NCCL no longer calls it, and closes it: the close must answer the
/// fence first (`RecvCore::owes_answer`), so that the sender's last sends complete, none of them
/// failed. Without the answer, they would wait for it until the repair timeout, with the
/// receiver's queue pairs gone. Repair is off (`NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX=0`),
/// so nothing else goes to the closed end, and so is the stall bound (it comes with repair): only
/// the retry bound (2.7 s) fails the lane. 8 messages of 16 KiB, 2 lanes, whole messages in
/// rotation.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_closing_receiver_answers_the_fence_its_sender_waits_for() {
    let _g = vm_serial();
    let knobs = [
        ("NCCL_IB_QPS_PER_CONNECTION", Some("2")),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", Some("0")),
        ("FERROCE_PATH_AWARE", Some("0")),
        ("NCCL_IB_TIMEOUT", Some("17")),
        ("NCCL_IB_RETRY_CNT", Some("4")),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", Some("0")),
        ("NCCL_DEBUG", Some("INFO")),
    ];
    let r = with_knobs(&knobs, close_while_fenced);
    let (closed_in, fenced) = r.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("the receive comm closed in {closed_in:?}; every send completed\n  {fenced}");
}

/// [`a_closing_receiver_answers_the_fence_its_sender_waits_for`]'s run: how long the receive
/// comm's close took, and the sender's INFO that the lane is fenced at both ends.
fn close_while_fenced() -> Result<(Duration, String), String> {
    const SIZE: usize = 16 << 10;
    const COUNT: usize = 8;
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let (ctx, send, recv, ports) = connected(&drv)?;
    drop_acks_on_vetha(ports[1]);
    let pattern = |k: usize| -> Vec<u8> {
        (0..SIZE).map(|i| (i as u8).wrapping_mul(31) ^ (k as u8).wrapping_add(1)).collect()
    };
    let mut src: Vec<Vec<u8>> = (0..COUNT).map(pattern).collect();
    let mut dst: Vec<Vec<u8>> = vec![vec![0u8; SIZE]; COUNT];
    let smh: Vec<Ptr> = (src.iter_mut().map(|b| drv.reg_mr(send, b.as_mut_ptr(), SIZE)))
        .collect::<Result<_, _>>()?;
    let rmh: Vec<Ptr> = (dst.iter_mut().map(|b| drv.reg_mr(recv, b.as_mut_ptr(), SIZE)))
        .collect::<Result<_, _>>()?;
    let mut rreqs = Vec::new();
    for (b, &m) in dst.iter_mut().zip(&rmh) {
        let post = || drv.irecv(recv, &[b.as_mut_ptr()], &[SIZE], &[0], &[m], false);
        rreqs.push(until("irecv", post)?);
    }
    let mut sreqs = Vec::new();
    for (b, &m) in src.iter_mut().zip(&smh) {
        sreqs.push(until("isend", || drv.isend(send, b.as_mut_ptr(), SIZE, 0, m))?);
    }
    let test_all = |reqs: &[Ptr], done: &mut [bool], what: &str| -> Result<bool, String> {
        for (k, (&r, d)) in reqs.iter().zip(done.iter_mut()).enumerate().filter(|(_, (_, d))| !**d)
        {
            *d = drv.test(r).map_err(|e| format!("{what} {k} failed: {e}"))?.is_some();
        }
        Ok(done.iter().all(|&d| d))
    };
    // Both ends polled, as NCCL's proxy does, until every receive completed.
    let (mut got, mut sent) = (vec![false; COUNT], vec![false; COUNT]);
    until("the receives", || {
        test_all(&sreqs, &mut sent, "send")?;
        Ok(test_all(&rreqs, &mut got, "receive")?.then_some(()))
    })?;
    for (k, b) in dst.iter().enumerate() {
        if *b != pattern(k) {
            return Err(format!("message {k} arrived corrupted"));
        }
    }
    // The receiver is done; only the sender is polled, until its lane fails (its WARN) and a
    // second more, so that its fence request is in the receiver's mailbox. Nothing may answer
    // the fence before the receive comm closes.
    let mut failed_at: Option<Instant> = None;
    ferroce_tools::wait::until("the sender's lane failure", Duration::from_secs(60), || {
        if test_all(&sreqs, &mut sent, "send")? {
            return Err("every send completed before the receiver closed: no ACK was lost".into());
        }
        for (level, _, line) in take_captured() {
            if line.contains("is fenced at both ends") {
                return Err(format!("the fence was answered before the close: {line}"));
            }
            if level == 2 && line.contains("lane 1 ") && failed_at.is_none() {
                failed_at = Some(Instant::now());
            }
        }
        Ok(failed_at.filter(|t| t.elapsed() > Duration::from_secs(1)).map(drop))
    })?;
    for m in rmh {
        drv.dereg_mr(recv, m)?;
    }
    let t = Instant::now();
    drv.close(Close::Recv, recv)?;
    let closed_in = t.elapsed();
    until("the sends, after the receiver closed", || {
        Ok(test_all(&sreqs, &mut sent, "send")?.then_some(()))
    })?;
    let infos = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2);
    let fenced = infos.into_iter().find(|l| l.contains("is fenced at both ends"));
    let fenced = fenced.ok_or("no INFO that the lane is fenced at both ends")?;
    for m in smh {
        drv.dereg_mr(send, m)?;
    }
    drv.close(Close::Send, send)?;
    drv.finalize(ctx)?;
    Ok((closed_in, fenced))
}

/// The NCCL-like ring of [`an_ack_only_black_hole_never_writes_a_completed_receive`]: the
/// fence INFOs the sender logged.
fn ring_run(drv: &Driver, send: Ptr, recv: Ptr, port: u16) -> Result<Vec<String>, String> {
    const RING: usize = 8;
    const BUFS: usize = 32;
    const SIZE: usize = 16 << 10;
    const COUNT: usize = 48;
    let pattern = |k: usize| -> Vec<u8> {
        (0..SIZE)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(k as u8 ^ (i >> 12) as u8))
            .collect()
    };
    // NCCL hands a completed buffer on (to another peer's transfer from the shared pool, back
    // to the application): 32 receive buffers in turn, so that each one rests, poisoned, while
    // the next 24 messages arrive, with 8 receives posted ahead at most.
    let mut rbufs: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0u8; SIZE]).collect();
    let mut sbufs: Vec<Vec<u8>> = (0..RING).map(|_| vec![0u8; SIZE]).collect();
    let rmh: Vec<Ptr> = (rbufs.iter_mut().map(|b| drv.reg_mr(recv, b.as_mut_ptr(), SIZE)))
        .collect::<Result<_, _>>()?;
    let smh: Vec<Ptr> = (sbufs.iter_mut().map(|b| drv.reg_mr(send, b.as_mut_ptr(), SIZE)))
        .collect::<Result<_, _>>()?;
    // Per ring slot: the receive and send in flight (message, request), and the message the
    // slot's receive buffer last completed with.
    let mut recvs: Vec<Option<(usize, Ptr)>> = vec![None; BUFS];
    let mut sends: Vec<Option<Ptr>> = vec![None; RING];
    let mut holds: Vec<Option<usize>> = vec![None; BUFS];
    let (mut posted, mut sent, mut got) = (0, 0, 0);
    let (mut dropped, mut lifted): (Option<Instant>, bool) = (None, false);
    let t0 = Instant::now();
    const POISON: u8 = 0xee;
    let check = |b: &[u8], k: usize| -> Result<(), String> {
        match b == pattern(k).as_slice() {
            true => Ok(()),
            false => Err(format!("message {k} arrived corrupted")),
        }
    };
    let poisoned = |b: &[u8], k: usize, when: &str| -> Result<(), String> {
        match b.iter().position(|&x| x != POISON) {
            None => Ok(()),
            Some(at) => Err(format!(
                "message {k}'s receive buffer was written {when}, after its receive completed \
                 and the buffer was handed on (first changed byte at {at}): a write into a \
                 completed receive"
            )),
        }
    };
    while got < COUNT || sends.iter().any(Option::is_some) {
        if t0.elapsed() > Duration::from_secs(180) {
            return Err(format!(
                "not done in 180 s: {got} received, {sent} sent; {:#?}",
                warnings()
            ));
        }
        if sent == COUNT / 2 && dropped.is_none() {
            drop_acks_on_vetha(port);
            dropped = Some(Instant::now());
        }
        if dropped.is_some_and(|t| t.elapsed() > Duration::from_secs(4)) && !lifted {
            clear_paths();
            lifted = true;
        }
        // NCCL posts a slot's buffer again only once its receive completed.
        let ahead = recvs.iter().filter(|r| r.is_some()).count();
        if posted < COUNT && ahead < RING && recvs[posted % BUFS].is_none() {
            let slot = posted % BUFS;
            if let Some(k) = holds[slot] {
                poisoned(&rbufs[slot], k, "before it was posted again")?;
            }
            let b = rbufs[slot].as_mut_ptr();
            if let Some(req) = drv.irecv(recv, &[b], &[SIZE], &[0], &[rmh[slot]], false)? {
                recvs[slot] = Some((posted, req));
                posted += 1;
            }
        }
        if sent < COUNT && sends[sent % RING].is_none() {
            let slot = sent % RING;
            sbufs[slot].copy_from_slice(&pattern(sent));
            if let Some(req) = drv.isend(send, sbufs[slot].as_mut_ptr(), SIZE, 0, smh[slot])? {
                sends[slot] = Some(req);
                sent += 1;
            }
        }
        for s in sends.iter_mut() {
            if let Some(req) = *s
                && drv.test(req)?.is_some()
            {
                *s = None;
            }
        }
        for slot in 0..BUFS {
            if let Some((k, req)) = recvs[slot]
                && let Some(sizes) = drv.test(req)?
            {
                if sizes[0] as usize != SIZE {
                    return Err(format!("message {k}: {} bytes", sizes[0]));
                }
                check(&rbufs[slot], k)?;
                rbufs[slot].fill(POISON); // handed on: its next user writes it
                (recvs[slot], holds[slot]) = (None, Some(k));
                got += 1;
            }
        }
    }
    clear_paths();
    // The grace period: a late write would land now.
    std::thread::sleep(Duration::from_secs(3));
    for (slot, k) in holds.iter().enumerate() {
        poisoned(&rbufs[slot], k.expect("completed"), "after the run")?;
    }
    for r in rmh {
        drv.dereg_mr(recv, r)?;
    }
    for s in smh {
        drv.dereg_mr(send, s)?;
    }
    let infos = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2);
    Ok(infos.filter(|l| l.contains("is fenced at both ends")).collect())
}

/// The RoCE packets arriving at vethA with UDP source port `port`: the receiver's ACKs and its
/// own writes on the lane with that port, not the sender's writes ([`clear_paths`] lifts it).
fn drop_acks_on_vetha(port: u16) {
    run("tc", &["qdisc", "add", "dev", "vethA", "clsact"]);
    run(
        "tc",
        &[
            "filter",
            "add",
            "dev",
            "vethA",
            "ingress",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            "protocol",
            "17",
            "0xff",
            "match",
            "ip",
            "sport",
            &port.to_string(),
            "0xffff",
            "action",
            "drop",
        ],
    );
}

/// A dead lane comes back: 4 lanes, strict rotation (`FERROCE_PATH_AWARE=0`, so the lane's
/// bytes are known), lane 2's source port dropped on vethB's ingress after 12 messages, the
/// drop lifted once the sender has warned and sent 8 more. The lane is rebuilt at both ends
/// (an attempt under way while the path is dead retries its probe, or fails), rejoins, and
/// then carries its share of
/// 24 more messages: its bytes at close exceed what it carried before the drop by at least
/// half that share. Every message is verified, in both split modes; the throughput before,
/// while the lane is dead, while it is repaired and after is printed. 64 MiB.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_dead_lane_is_repaired_once_its_path_answers_again() {
    let _g = vm_serial();
    for split in ["0", "1"] {
        let r = with_four_lanes(split, Some(("FERROCE_PATH_AWARE", "0")), || {
            repair_run(2, split == "1")
        });
        let r = r.unwrap_or_else(|e| panic!("split {split}: {e}"));
        eprintln!("split {split}: {r:#?}");
        let (before, after) = r.lane_mib;
        assert!(
            after >= before + r.share_after / 2.0,
            "split {split}: lane 2 carried {before:.2} MiB before the drop and {after:.2} at \
             close; its share after the repair was {:.2}",
            r.share_after
        );
        let sent: Vec<&String> =
            r.warns.iter().filter(|w| w.contains("of the send comm")).collect();
        assert_eq!(sent.len(), 1, "one sender WARN, for the failure: {:#?}", r.warns);
    }
}

/// A dead lane whose path never answers again: each repair attempt (a new QP at both ends,
/// then a probe that runs out of retries) fails, logged at INFO, and after
/// `NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX` (2 here) the lane stays out, with one WARN
/// and `it stays out` on the statistics line. Messages keep flowing, verified, throughout.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_lane_whose_path_stays_dead_stays_out_after_its_attempts() {
    let _g = vm_serial();
    let knobs = [
        ("FERROCE_PATH_AWARE", Some("0")),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", Some("2")),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY_START_DELAY", Some("100")),
    ];
    let r = with_knobs(&knobs, || with_four_lanes("0", None, || stays_out_run(1)));
    let (attempts, warns, stats, secs) = r.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("lane 1 stays out after {secs:.1} s: {attempts:#?}\n{warns:#?}\n{stats}");
    assert_eq!(attempts.len(), 1, "one INFO for the first failed attempt: {attempts:#?}");
    assert!(attempts[0].starts_with("repair attempt 1 of lane 1 "), "{}", attempts[0]);
    let sent: Vec<&String> = warns.iter().filter(|w| w.contains("of the send comm")).collect();
    assert_eq!(sent.len(), 2, "a WARN for the failure, one for staying out: {warns:#?}");
    assert!(sent[1].contains("stays out: 2 repair attempt(s) failed"), "{}", sent[1]);
    let qp1 = stats.split("; QP ").nth(2).unwrap_or_default();
    assert!(qp1.starts_with("1 ") && qp1.contains("out (failed; it stays out)"), "{stats}");
}

/// Drops lane `lane` after 4 messages and sends 16 KiB messages until the sender's WARN that
/// the lane stays out (at most 60 s): the INFOs of failed attempts, the WARNs, the sender's
/// statistics line at close, and the seconds from the drop to the WARN.
fn stays_out_run(lane: usize) -> Result<(Vec<String>, Vec<String>, String, f64), String> {
    let run = |drv: &Driver, send, recv, port: u16| {
        let (mut warns, mut attempts) = (Vec::new(), Vec::new());
        let mut dropped = None;
        for i in 0.. {
            if i == 4 {
                drop_on_vethb(&["sport", &port.to_string()]);
                dropped = Some(Instant::now());
            }
            if dropped.is_some_and(|t| t.elapsed() > Duration::from_secs(60)) {
                return Err(format!("no WARN that the lane stays out in 60 s: {warns:#?}"));
            }
            transfer_polling(drv, send, recv, 16384, i as u8)
                .map_err(|e| format!("message {i}: {e}; {warns:#?} {attempts:#?}"))?;
            for (level, _, line) in take_captured() {
                match level {
                    2 => warns.push(line),
                    3 if line.contains(": repair attempt ") => attempts.push(line),
                    _ => {}
                }
            }
            if warns.iter().any(|w| w.contains(" stays out: ")) {
                break;
            }
        }
        Ok((attempts, warns, dropped.map_or(0.0, |t| t.elapsed().as_secs_f64())))
    };
    let ((attempts, warns, secs), closed) = on_a_pair(lane, run)?;
    let stats = closed.into_iter().find(|l| l.contains("send comm to") && l.contains("closed"));
    let strip = |l: String| l.trim_start_matches("NET/ferroce: ").to_string();
    let attempts = attempts.into_iter().map(strip).collect();
    Ok((attempts, warns.into_iter().map(strip).collect(), stats.unwrap_or_default(), secs))
}

/// Connects rxe0 -> rxe1 (with the knobs set), runs `f` on the driver, the send and receive
/// comms and lane `lane`'s UDP source port, then closes both and finalizes: what `f` returned,
/// and the INFO lines logged after it (the comms' statistics lines).
fn on_a_pair<T>(
    lane: usize,
    f: impl FnOnce(&Driver, Ptr, Ptr, u16) -> Result<T, String>,
) -> Result<(T, Vec<String>), String> {
    set_env(&[("NCCL_DEBUG", Some("INFO"))]); // the statistics lines
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let (ctx, send, recv, ports) = connected(&drv)?;
    let r = f(&drv, send, recv, ports[lane])?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    let closed = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect();
    Ok((r, closed))
}

/// A context and a pair connected rxe0 -> rxe1 with the knobs set: the context, the send and
/// receive comms, and the lanes' UDP source ports the sender logged.
fn connected(drv: &Driver) -> Result<(Ptr, Ptr, Ptr, Vec<u16>), String> {
    let ctx = drv.init(1)?;
    take_captured();
    let (send, recv) = pair(drv, ctx, 1, 0)?;
    let info: Vec<String> = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect();
    Ok((ctx, send, recv, logged_ports(&info)))
}

/// When a phase of [`repair_run`] ends: given its messages so far, the WARNs and the INFOs.
type PhaseEnd<'a> = dyn FnMut(usize, &[String], &[String]) -> bool + 'a;

/// What [`repair_run`] measured.
#[derive(Debug)]
#[allow(dead_code)] // printed
struct Repaired {
    /// MiB/s: before the drop, while the lane was dead, from the lift to the repair, after.
    mibs: [f64; 4],
    /// Seconds from the lift to the INFO that the lane is repaired.
    repaired_in: f64,
    /// The lane's MiB as expected before the drop (rotation), and at close (its statistics).
    lane_mib: (f64, f64),
    /// Its expected MiB of the 24 messages after the repair.
    share_after: f64,
    warns: Vec<String>,
    infos: Vec<String>,
}

fn repair_run(lane: usize, split: bool) -> Result<Repaired, String> {
    let run = |drv: &Driver, send, recv, port: u16| {
        let sizes = [4096usize, 65536, 1 << 20, 300_000];
        // The lane's part of message `i`: whole messages rotate over the 4 lanes (message i on
        // lane i % 4), split ones give each lane a quarter.
        let part = |i: usize| {
            let size = sizes[i % 4] as f64 / f64::from(1 << 20);
            if split {
                size / 4.0
            } else if i % 4 == lane {
                size
            } else {
                0.0
            }
        };
        let (mut warns, mut infos) = (Vec::new(), Vec::new());
        let log = |warns: &mut Vec<String>, infos: &mut Vec<String>| {
            for (level, _, line) in take_captured() {
                match level {
                    2 => warns.push(line),
                    3 if line.contains(" is repaired") || line.contains("repair attempt") => {
                        infos.push(line)
                    }
                    _ => {}
                }
            }
        };
        let next = std::cell::Cell::new(0usize);
        let phase = |until: &mut PhaseEnd,
                     warns: &mut Vec<String>,
                     infos: &mut Vec<String>|
         -> Result<f64, String> {
            let (t, first) = (Instant::now(), next.get());
            let mut bytes = 0;
            while !until(next.get() - first, warns, infos) {
                let i = next.get();
                if t.elapsed() > Duration::from_secs(60) {
                    return Err(format!("no end of the phase in 60 s: {warns:#?} {infos:#?}"));
                }
                transfer_polling(drv, send, recv, sizes[i % 4], i as u8)
                    .map_err(|e| format!("message {i}: {e}; {warns:#?} {infos:#?}"))?;
                bytes += sizes[i % 4];
                next.set(i + 1);
                log(warns, infos);
            }
            Ok(bytes as f64 / f64::from(1 << 20) / t.elapsed().as_secs_f64())
        };
        let clean = phase(&mut |n, _, _| n == 12, &mut warns, &mut infos)?;
        let before: f64 = (0..12).map(part).sum();
        drop_on_vethb(&["sport", &port.to_string()]);
        let mut warned = None;
        let dead = phase(
            &mut |n, w, _| {
                if warned.is_none() && !w.is_empty() {
                    warned = Some(n);
                }
                warned.is_some_and(|at| n >= at + 8)
            },
            &mut warns,
            &mut infos,
        )?;
        clear_paths();
        let lifted = Instant::now();
        let repairing = phase(
            &mut |_, _, inf| inf.iter().any(|l| l.contains(" is repaired")),
            &mut warns,
            &mut infos,
        )?;
        let repaired_in = lifted.elapsed().as_secs_f64();
        let from = next.get();
        let after = phase(&mut |n, _, _| n == 24, &mut warns, &mut infos)?;
        let share_after: f64 = (from..from + 24).map(part).sum();
        Ok(Repaired {
            mibs: [clean, dead, repairing, after],
            repaired_in,
            lane_mib: (before, 0.0),
            share_after,
            warns,
            infos,
        })
    };
    let (mut r, closed) = on_a_pair(lane, run)?;
    r.lane_mib.1 = sender_stats(&closed)[lane].0;
    Ok(r)
}

/// Sends `size` bytes over a connected pair as NCCL's proxy drives the two comms from one
/// thread: each pass posts or tests the send and tests the receive, so that both ends see a
/// lane fail (the sender moves its chunks, the receiver its CTS rows); the bytes are checked.
fn transfer_polling(
    drv: &Driver,
    send: Ptr,
    recv: Ptr,
    size: usize,
    seed: u8,
) -> Result<(), String> {
    let mut src: Vec<u8> =
        (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let mut dst = vec![0u8; size];
    let smh = drv.reg_mr(send, src.as_mut_ptr(), size)?;
    let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), size)?;
    let rreq =
        until("irecv", || drv.irecv(recv, &[dst.as_mut_ptr()], &[size], &[0], &[rmh], false))?;
    let (mut sreq, mut sent, mut got) = (None, None, None);
    until("send and receive", || {
        match sreq {
            None => sreq = drv.isend(send, src.as_mut_ptr(), size, 0, smh)?,
            Some(q) if sent.is_none() => sent = drv.test(q)?,
            Some(_) => {}
        }
        if got.is_none() {
            got = drv.test(rreq)?;
        }
        Ok((got.is_some() && sent.is_some()).then_some(()))
    })?;
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    let got = got.expect("done")[0] as usize;
    if got != size {
        return Err(format!("received {got} bytes, expected {size}"));
    }
    if dst != src {
        return Err("data corrupted".into());
    }
    Ok(())
}

/// Connects rxe0 -> rxe1 with 4 lanes, sends 12 verified messages of mixed sizes, black-holes
/// `lane`'s source port on vethA, and sends 36 more: the lane's port, the longest a message
/// took after the drop (the time from the path's death to its chunks moving), and the WARNs.
fn failover_run(lane: usize) -> Result<(u16, Duration, Vec<String>), String> {
    let run = |drv: &Driver, send, recv, port: u16| {
        let sizes = [4096, 65536, 1 << 20, 300_000];
        let mut took = Duration::ZERO;
        for i in 0..48 {
            if i == 12 {
                drop_on_vethb(&["sport", &port.to_string()]);
            }
            let t = Instant::now();
            if let Err(e) = transfer_polling(drv, send, recv, sizes[i % sizes.len()], i as u8) {
                let qps = Command::new("rdma").args(["res", "show", "qp"]).output();
                let qps = qps.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
                return Err(format!("message {i}: {e}; WARNs {:#?}; QPs: {qps:?}", warnings()));
            }
            if i >= 12 {
                took = took.max(t.elapsed());
            }
        }
        Ok((port, took, warnings()))
    };
    on_a_pair(lane, run).map(|(r, _)| r)
}

/// Waits (bounded) for a sysfs condition.
fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(secs), "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn rxe1_ready() -> bool {
    let state =
        std::fs::read_to_string("/sys/class/infiniband/rxe1/ports/1/state").unwrap_or_default();
    let gid =
        std::fs::read_to_string("/sys/class/infiniband/rxe1/ports/1/gids/1").unwrap_or_default();
    state.contains("ACTIVE") && gid.contains("c612:0002")
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_deleted_peer_device_fails_the_sender_within_the_progress_deadline() {
    let _g = vm_serial();
    // retry 7 never ends on rxe: only ferroce's own progress deadline can end the wait.
    set_env(&[("FERROCE_PROGRESS_TIMEOUT_MS", Some("3000")), ("NCCL_IB_RETRY_CNT", Some("7"))]);
    // The peer: a receiving rank of `ferroce perf` on rxe1 in its own process, driven over its
    // stdin and stdout (HANDLE, PEER, READY), then told to keep receives of MSG bytes posted.
    const MSG: usize = 8 << 20; // the rank's buffer size, so every receive is exactly one send
    let plugin = plugin_dir().join("libnccl-net-ferroce.so");
    let mut peer = Command::new(common::ferroce_exe())
        .args(["perf-rank", "recv", plugin.to_str().unwrap(), "rxe1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_peer = peer.stdin.take().unwrap();
    let mut lines = std::io::BufReader::new(peer.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let mut handle = ferroce_tools::rank::handle_in(&first).unwrap();
    // Like a sender on another host, this process must not hold rxe1 open (deleting a device
    // waits for every process using it): NCCL_IB_HCA keeps ferroce from opening it at all.
    set_env(&[("NCCL_IB_HCA", Some("=rxe0"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    set_env(&[
        ("FERROCE_PROGRESS_TIMEOUT_MS", None),
        ("NCCL_IB_RETRY_CNT", None),
        ("NCCL_IB_HCA", None),
    ]);
    // The rank connects back to us as well (each rank has a send and a receive comm).
    let (ours, listen) = drv.listen(ctx, 0).unwrap();
    writeln!(to_peer, "PEER {}", ferroce_tools::handle::to_hex(&ours)).unwrap();
    let (send, back) =
        drv.connect_both(ctx, 0, &mut handle, listen, Duration::from_secs(60)).unwrap();
    drv.close(Close::Listen, listen).unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "READY");
    // Bandwidth for an hour (the test kills it long before): four receives always posted.
    writeln!(to_peer, "BW {MSG} 4 3600 0").unwrap();
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let mut src: Vec<u8> = (0..MSG).map(|i| (i % 251) as u8).collect();
    let mh = drv.reg_mr(send, src.as_mut_ptr(), src.len()).unwrap();
    // A healthy first message, then 16 MiB in flight (two messages) when the peer's device goes
    // away.
    let q = until("isend", || drv.isend(send, src.as_mut_ptr(), MSG, 0, mh)).unwrap();
    until("test", || drv.test(q)).unwrap();
    let mut inflight: Vec<_> = (0..2)
        .map(|_| until("isend", || drv.isend(send, src.as_mut_ptr(), MSG, 0, mh)).unwrap())
        .collect();
    // `rdma link delete` of a device in use waits for its users to go: run it in the
    // background, then kill the peer process that holds rxe1.
    let mut del = Command::new("rdma").args(["link", "delete", "rxe1"]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    peer.kill().unwrap();
    peer.wait().unwrap();
    let t0 = Instant::now();
    let del = loop {
        if let Some(st) = del.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = del.kill();
            break del.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let t = Instant::now();
    // The dying peer's queue pairs can outlive the kill until the device is gone, and then
    // all 16 MiB may land first (a run in a few, some days). Then a next send either waits for
    // a CTS that never comes (its probe goes unanswered) or writes into a row the dead peer
    // left posted: that must fail within the deadline as well (with nothing in flight at the
    // delete, tried by hand: the error after 3.0 s, the progress deadline).
    let err = loop {
        let next = match inflight.first() {
            Some(&q) => drv.test(q).map(|done| done.map(drop)),
            None => drv.isend(send, src.as_mut_ptr(), MSG, 0, mh).map(|q| {
                inflight.extend(q);
                None
            }),
        };
        match next {
            Ok(None) => {}
            Ok(Some(())) => {
                inflight.remove(0);
            }
            Err(e) => break e,
        }
        if t.elapsed() > Duration::from_secs(60) {
            break String::from("no error within 60 s");
        }
    };
    let took = t.elapsed();
    let warns: Vec<String> = warnings();
    // Put rxe1 back for whatever runs next in this VM.
    wait_for("rxe1 re-added", 20, || {
        Command::new("rdma")
            .args(["link", "add", "rxe1", "type", "rxe", "netdev", "vethB"])
            .status()
            .is_ok_and(|s| s.success())
            || std::path::Path::new("/sys/class/infiniband/rxe1").exists()
    });
    wait_for("rxe1 back", 20, rxe1_ready);
    eprintln!("peer device deleted: sender error after {took:?}: {err}\n  {warns:#?}");
    assert!(del.success(), "rdma link delete rxe1");
    assert!(err.contains("ncclResult 6"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    // Depending on timing the in-flight write meets the dying peer's torn-down registration
    // (remote access error) or silence (the progress deadline): either way a bounded error
    // that names the peer and the path.
    assert!(
        warns.iter().any(|w| w.contains("198.18.0.2") && w.contains("rxe0 GID 198.18.0.1")),
        "{warns:#?}"
    );
    drv.dereg_mr(send, mh).unwrap();
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, back).unwrap();
    drv.finalize(ctx).unwrap();
}

fn ip(args: &[&str]) {
    run("ip", args);
}

/// The GID line the plugin logs for rxe0 under the given knobs.
fn chosen(vars: &[(&str, &str)]) -> Result<String, String> {
    let set: Vec<(&str, Option<&str>)> = vars.iter().map(|(k, v)| (*k, Some(*v))).collect();
    set_env(&set);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    take_captured();
    let r = drv.init(1);
    let lines = take_captured();
    let unset: Vec<(&str, Option<&str>)> = vars.iter().map(|(k, _)| (*k, None)).collect();
    set_env(&unset);
    if let Ok(ctx) = r {
        drv.finalize(ctx).unwrap();
    }
    let line = lines
        .iter()
        .find(|l| l.2.contains("device 0: rxe0"))
        .or(lines.iter().find(|l| l.2.contains("rxe0 has no")));
    match line {
        Some(l) if l.0 == 3 => Ok(l.2.clone()),
        Some(l) => Err(l.2.clone()),
        None => Err(format!("no GID line: {lines:#?}")),
    }
}

fn gid_index_of(ip_text: &str) -> u8 {
    for i in 0..16 {
        let gid = std::fs::read_to_string(format!("/sys/class/infiniband/rxe0/ports/1/gids/{i}"))
            .unwrap_or_default();
        let addr: std::net::Ipv6Addr =
            gid.trim().parse().unwrap_or(std::net::Ipv6Addr::UNSPECIFIED);
        if ferroce::transport::gid::ip_of(&addr.octets()).to_string() == ip_text {
            return i;
        }
    }
    panic!("no GID for {ip_text}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn gid_knobs_pick_the_expected_gid() {
    let _g = vm_serial();
    ip(&["addr", "add", "198.18.1.1/24", "dev", "vethA"]);
    ip(&["addr", "add", "fd00:198:18::1/64", "dev", "vethA", "nodad"]);
    wait_for("new GIDs", 20, || {
        (0..16)
            .filter_map(|i| {
                std::fs::read_to_string(format!("/sys/class/infiniband/rxe0/ports/1/gids/{i}")).ok()
            })
            .filter(|g| g.contains("c612:0101") || g.starts_with("fd00"))
            .count()
            == 2
    });
    let v4b = gid_index_of("198.18.1.1");
    let v6 = gid_index_of("fd00:198:18::1");
    let v6_s = v6.to_string();
    let per_dev = format!("rxe0:{v4b},rxe1:1");
    type Case<'a> = (Vec<(&'a str, &'a str)>, Result<&'a str, &'a str>);
    let cases: Vec<Case> = vec![
        (vec![], Ok("198.18.0.1 on vethA")),
        (vec![("NCCL_IB_ADDR_RANGE", "198.18.1.0/24")], Ok("198.18.1.1 on vethA")),
        (vec![("NCCL_IB_ADDR_FAMILY", "AF_INET6")], Ok("fd00:198:18::1 on vethA")),
        (vec![("NCCL_IB_GID_INDEX", v6_s.as_str())], Ok("fd00:198:18::1 on vethA")),
        (
            vec![("FERROCE_GID_INDEX", per_dev.as_str()), ("NCCL_IB_GID_INDEX", "1")],
            Ok("198.18.1.1 on vethA"),
        ),
        (vec![("FERROCE_GID_IP", "198.18.1.1")], Ok("198.18.1.1 on vethA")),
        (
            vec![("FERROCE_GID_NETDEV", "vethA"), ("NCCL_IB_ADDR_RANGE", "198.18.1.0/24")],
            Ok("198.18.1.1"),
        ),
        (vec![("FERROCE_GID_NETDEV", "vethB")], Err("FERROCE_GID_NETDEV vethB")),
        (vec![("NCCL_IB_ROCE_VERSION_NUM", "1")], Err("RoCE v1")),
    ];
    let mut failures = Vec::new();
    for (vars, want) in &cases {
        let got = chosen(vars);
        eprintln!("{vars:?}\n  -> {got:?}");
        let ok = match (&got, want) {
            (Ok(line), Ok(w)) => line.contains(w),
            (Err(line), Err(w)) => line.contains(w),
            _ => false,
        };
        if !ok {
            failures.push(format!("{vars:?}: got {got:?}, want {want:?}"));
        }
    }
    ip(&["addr", "del", "198.18.1.1/24", "dev", "vethA"]);
    ip(&["addr", "del", "fd00:198:18::1/64", "dev", "vethA"]);
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn after_a_gid_change_new_connections_use_the_new_table() {
    let _g = vm_serial();
    set_env(&[("NCCL_IB_ADDR_RANGE", Some("198.18.2.0/24"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    set_env(&[("NCCL_IB_ADDR_RANGE", None)]);
    // No GID in the range yet: listening fails and says why.
    let before = drv.listen(ctx, 1);
    assert!(before.is_err(), "listened without a usable GID");
    take_captured();
    ip(&["addr", "add", "198.18.2.1/24", "dev", "vethA"]);
    ip(&["addr", "add", "198.18.2.2/24", "dev", "vethB"]);
    // The async-event thread hears the GID changes.
    let mut seen = Vec::new();
    wait_for("GID change events", 20, || {
        seen.extend(take_captured().into_iter().map(|l| l.2));
        ["rxe0", "rxe1"]
            .iter()
            .all(|d| seen.iter().any(|l| l.contains(&format!("{d}: GID table changed"))))
    });
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    transfer(&drv, send, recv, 65536, 9).unwrap();
    let lines: Vec<String> = take_captured().into_iter().map(|l| l.2).collect();
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, recv).unwrap();
    drv.finalize(ctx).unwrap();
    ip(&["addr", "del", "198.18.2.1/24", "dev", "vethA"]);
    ip(&["addr", "del", "198.18.2.2/24", "dev", "vethB"]);
    eprintln!("{before:?}\n{seen:#?}\n{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("rxe0 uses GID index")
            && l.contains("198.18.2.1")
            && l.contains("after a GID table change")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("connected to")
            && l.contains("GID 198.18.2.1")
            && l.contains("-> 198.18.2.2")),
        "{lines:#?}"
    );
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_link_local_gid_still_connects_and_moves_data() {
    let _g = vm_serial();
    // GID index 0 on rxe is the IPv6 link-local one; the setup socket must not bind it.
    set_env(&[("NCCL_IB_GID_INDEX", Some("0"))]);
    let info = traffic(65536, 3, -1);
    set_env(&[("NCCL_IB_GID_INDEX", None)]);
    let line = info.iter().find(|l| l.contains("connected to")).expect("connection INFO line");
    eprintln!("  {line}");
    assert!(line.contains("(index 0)") && line.contains("fe80::"), "{line}");
    // The peer by its RoCE address (the link-local GID), the setup by its TCP one.
    assert!(line.contains("connected to fe80::"), "the peer by its GID: {line}");
    assert!(line.contains("(tcp 198.18.0."), "setup over the routable address: {line}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn socket_ifname_in_nccl_syntax_picks_the_setup_interface() {
    let _g = vm_serial();
    // Both devices' listeners on vethB's address (exact name), then on the first interface
    // an exclude list keeps: data still flows between the GIDs.
    for (ifname, want) in
        [("=vethB", "198.18.0.2"), ("^=lo,vethA", "198.18.0.2"), ("veth", "198.18.0.")]
    {
        set_env(&[("NCCL_SOCKET_IFNAME", Some(ifname))]);
        let info = traffic(4096, 2, -1);
        set_env(&[("NCCL_SOCKET_IFNAME", None)]);
        let line = info.iter().find(|l| l.contains("connected to")).expect("connection INFO line");
        eprintln!("  NCCL_SOCKET_IFNAME={ifname}: {line}");
        assert!(line.contains(&format!("(tcp {want}")), "{ifname}: {line}");
    }
    // An interface list that keeps nothing usable fails listen naming the knob.
    set_env(&[("NCCL_SOCKET_IFNAME", Some("=nosuch0"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(7).unwrap();
    let Err(e) = drv.listen(ctx, 1) else { panic!("listen with no usable interface succeeded") };
    set_env(&[("NCCL_SOCKET_IFNAME", None)]);
    let warns: Vec<String> =
        take_captured().into_iter().filter(|l| l.0 == 2).map(|l| l.2).collect();
    assert!(e.contains("ncclResult 5"), "ncclInvalidUsage: {e}");
    assert!(
        warns.iter().any(|w| w.contains("NCCL_SOCKET_IFNAME") && w.contains("nosuch0")),
        "{warns:#?}"
    );
    drv.finalize(ctx).unwrap();
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn statistics_are_logged_periodically_for_long_jobs_at_nccl_debug_info() {
    let _g = vm_serial();
    set_env(&[("FERROCE_STATS_INTERVAL_S", Some("1")), ("NCCL_DEBUG", Some("INFO"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(3).unwrap();
    take_captured();
    let born = Instant::now();
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    let t = Instant::now();
    let mut n = 0;
    while t.elapsed() < Duration::from_millis(3500) {
        transfer(&drv, send, recv, 4096, n as u8).unwrap();
        n += 1;
    }
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, recv).unwrap();
    // How long the comms lived: a busy host can stretch the last transfer past 3.5 s.
    let lived = born.elapsed();
    drv.finalize(ctx).unwrap();
    set_env(&[("FERROCE_STATS_INTERVAL_S", None)]);
    let info: Vec<String> = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect();
    for end in ["send comm to", "receive comm from"] {
        let periodic: Vec<&String> =
            info.iter().filter(|l| l.contains(end) && l.contains(" messages, ")).collect();
        eprintln!(
            "  {end}: {} statistics lines over {n} messages, the comm open {lived:.1?}",
            periodic.len()
        );
        // One per second while it lives (one fewer or more under a coarse clock), then the one
        // at close.
        let most = lived.as_secs() as usize + 3;
        assert!((3..=most).contains(&periodic.len()), "open {lived:.1?}: {periodic:#?}");
        assert!(
            periodic.last().unwrap().contains(&format!("closed: {n} messages")),
            "{periodic:#?}"
        );
    }
    // Below NCCL_DEBUG=INFO NCCL shows no INFO line: none is made, periodic or at close.
    set_env(&[("FERROCE_STATS_INTERVAL_S", Some("1")), ("NCCL_DEBUG", Some("WARN"))]);
    let ctx = drv.init(4).unwrap();
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) {
        transfer(&drv, send, recv, 4096, 7).unwrap();
    }
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, recv).unwrap();
    drv.finalize(ctx).unwrap();
    set_env(&[("FERROCE_STATS_INTERVAL_S", None), ("NCCL_DEBUG", None)]);
    let lines: Vec<String> = take_captured().into_iter().map(|l| l.2).collect();
    let stats: Vec<&String> = lines.iter().filter(|l| l.contains(" messages, ")).collect();
    assert!(stats.is_empty(), "statistics lines at NCCL_DEBUG=WARN: {stats:#?}");
}

/// Streams `count` verified messages of `size` bytes from `send` to `recv`, `depth` in flight,
/// as NCCL's proxy drives a channel: each pass tops up the receives and the sends and tests
/// the oldest of each. The time it took.
fn stream(
    drv: &Driver,
    (send, recv): (Ptr, Ptr),
    size: usize,
    count: usize,
    depth: usize,
) -> Result<Duration, String> {
    let fill = |i: usize| -> Vec<u8> {
        (0..size).map(|k| (k as u8).wrapping_mul(31).wrapping_add(i as u8)).collect()
    };
    let mut src: Vec<Vec<u8>> = vec![vec![0; size]; depth];
    let mut dst: Vec<Vec<u8>> = vec![vec![0; size]; depth];
    let smh = (src.iter_mut().map(|b| drv.reg_mr(send, b.as_mut_ptr(), size)))
        .collect::<Result<Vec<_>, _>>()?;
    let rmh = (dst.iter_mut().map(|b| drv.reg_mr(recv, b.as_mut_ptr(), size)))
        .collect::<Result<Vec<_>, _>>()?;
    let (mut recvs, mut sends) =
        (std::collections::VecDeque::new(), std::collections::VecDeque::new());
    let (mut rposted, mut sposted, mut rdone, mut sdone, mut filled) = (0, 0, 0, 0, usize::MAX);
    let t = Instant::now();
    until("stream", || {
        if rposted < count && rposted - rdone < depth {
            let k = rposted % depth;
            let p = dst[k].as_mut_ptr();
            if let Some(r) = drv.irecv(recv, &[p], &[size], &[0], &[rmh[k]], false)? {
                recvs.push_back(r);
                rposted += 1;
            }
        }
        if sposted < count && sposted - sdone < depth {
            let k = sposted % depth;
            if filled != sposted {
                src[k].copy_from_slice(&fill(sposted)); // in place: it is registered
                filled = sposted;
            }
            if let Some(s) = drv.isend(send, src[k].as_mut_ptr(), size, 0, smh[k])? {
                sends.push_back(s);
                sposted += 1;
            }
        }
        if let Some(&s) = sends.front()
            && drv.test(s)?.is_some()
        {
            sends.pop_front();
            sdone += 1;
        }
        if let Some(&r) = recvs.front()
            && let Some(got) = drv.test(r)?
        {
            if got[0] as usize != size || dst[rdone % depth] != fill(rdone) {
                return Err(format!("message {rdone}: {} bytes, or its data corrupted", got[0]));
            }
            recvs.pop_front();
            rdone += 1;
        }
        Ok((rdone == count && sdone == count).then_some(()))
    })?;
    let took = t.elapsed();
    for m in smh {
        drv.dereg_mr(send, m)?;
    }
    for m in rmh {
        drv.dereg_mr(recv, m)?;
    }
    Ok(took)
}

/// The sender's share of the bytes per QP, from its statistics line at close.
fn shares(info: &[String]) -> Vec<f64> {
    sender_stats(info).into_iter().map(|(_, share)| share).collect()
}

/// The sender's MiB and share of the bytes per QP, from its statistics line at close.
fn sender_stats(info: &[String]) -> Vec<(f64, f64)> {
    let line = info.iter().find(|l| l.contains("send comm to") && l.contains("closed"));
    let line = line.unwrap_or_else(|| panic!("no sender statistics line: {info:#?}"));
    line.split("; QP ")
        .skip(1)
        .map(|qp| {
            let bytes = qp.split(": ").nth(1).and_then(|r| r.split_once(" MiB ("));
            let (mib, rest) = bytes.unwrap_or_else(|| panic!("no bytes in {qp}"));
            let share = rest.split('%').next().and_then(|p| p.parse().ok());
            let mib = mib.parse().ok();
            mib.zip(share).unwrap_or_else(|| panic!("no bytes or share in {qp}"))
        })
        .collect()
}

/// Port `port`'s path turns slow: its packets arriving at vethB go through ifb0, whose netem
/// delays them 5 ms and drops 1%. The other lanes' packets take no queue at all (a queue on
/// their path would reorder them; see `failover_run`).
fn slow_path(port: u16) {
    run("ip", &["link", "add", "ifb0", "type", "ifb"]);
    run("ip", &["link", "set", "ifb0", "up"]);
    run("tc", &["qdisc", "add", "dev", "ifb0", "root", "netem", "delay", "5ms", "loss", "1%"]);
    run("tc", &["qdisc", "add", "dev", "vethB", "clsact"]);
    let p = port.to_string();
    run(
        "tc",
        &[
            "filter", "add", "dev", "vethB", "ingress", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "17", "0xff", "match", "ip", "sport", &p, "0xffff",
            "action", "mirred", "egress", "redirect", "dev", "ifb0",
        ],
    );
}

/// Removes what `slow_path` added, if anything (so quietly).
fn clear_paths() {
    let quiet = |cmd: &str, args: &[&str]| {
        let _ = Command::new(cmd).args(args).stderr(Stdio::null()).status();
    };
    quiet("tc", &["qdisc", "del", "dev", "vethB", "clsact"]);
    quiet("tc", &["qdisc", "del", "dev", "vethA", "clsact"]);
    quiet("ip", &["link", "del", "ifb0"]);
}

/// Runs `f` on 4 lanes in split mode `split` (and `extra`), with a retry bound of 2.7 s
/// (`NCCL_IB_TIMEOUT=17`, `NCCL_IB_RETRY_CNT=4`: a shorter one may run out on a live lane
/// under emulation); then the paths are clear and the knobs unset again, however `f` ended.
fn with_four_lanes<T>(split: &str, extra: Option<(&str, &str)>, f: impl FnOnce() -> T) -> T {
    let mut knobs = vec![
        ("NCCL_IB_QPS_PER_CONNECTION", Some("4")),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split)),
        ("NCCL_IB_TIMEOUT", Some("17")),
        ("NCCL_IB_RETRY_CNT", Some("4")),
    ];
    knobs.extend(extra.map(|(k, v)| (k, Some(v))));
    with_knobs(&knobs, f)
}

/// Runs `f` with the environment `knobs` set, then lifts every drop (a failed run may leave
/// one) and unsets them.
fn with_knobs<T>(knobs: &[(&str, Option<&str>)], f: impl FnOnce() -> T) -> T {
    set_env(knobs);
    let r = f();
    clear_paths();
    set_env(&knobs.iter().map(|&(k, _)| (k, None)).collect::<Vec<_>>());
    r
}

/// The RoCE packets arriving at vethB whose UDP header matches `field value` (`sport 49153`,
/// `dport 4791`) vanish there, as in a fabric that black-holes them ([`clear_paths`] lifts
/// it). A drop on vethA's egress is no black hole: under a clsact hook rxe sees a failed send
/// and resends at once, forever, spending no retries; under a root qdisc vethA is no longer
/// `noqueue`, another CPU may dequeue a QP's packets into its own backlog, and the reordering
/// costs retries on the healthy lanes too.
fn drop_on_vethb(&[field, value]: &[&str; 2]) {
    run("tc", &["qdisc", "add", "dev", "vethB", "clsact"]);
    run(
        "tc",
        &[
            "filter", "add", "dev", "vethB", "ingress", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "17", "0xff", "match", "ip", field, value, "0xffff",
            "action", "drop",
        ],
    );
}

/// Messages of a [`slow_run`] that teach placement the paths before the timed ones. A slowed
/// path shows itself in losses (a go-back-N resend costs a round trip of its 5 ms): 8 left a
/// run now and then with the slow lane unknown and a tail loss in the timed messages.
const LEARN: usize = 16;

/// One streaming run over `lanes` lanes (lane 1's path slowed if `slow`), in split mode or
/// not, path-aware or not: [`LEARN`] messages of 256 KiB to learn the paths (4 to warm up a
/// clean run), then `count` timed.
/// MiB/s, and the sender's share of the bytes per lane.
fn slow_run(
    split: &str,
    lanes: usize,
    slow: bool,
    aware: &str,
    count: usize,
) -> Result<(f64, Vec<f64>), String> {
    let n = lanes.to_string();
    set_env(&[
        ("NCCL_IB_QPS_PER_CONNECTION", Some(&n)),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split)),
        ("FERROCE_PATH_AWARE", Some(aware)),
        // A lost tail packet waits out one ACK timeout: 0.54 s, not the default 4.3 s.
        ("NCCL_IB_TIMEOUT", Some("17")),
        ("NCCL_DEBUG", Some("INFO")), // the statistics lines
    ]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    take_captured();
    let comms = pair(&drv, ctx, 1, 0)?;
    let info: Vec<String> = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect();
    // A clean run classifies every packet just the same (under emulation the filter's CPU
    // time is bandwidth), with a port no lane uses.
    slow_path(if slow { logged_ports(&info)[1] } else { 1 });
    let size = 256 << 10;
    let learn = if slow { LEARN } else { 4 };
    let took =
        stream(&drv, comms, size, learn, 4).and_then(|_| stream(&drv, comms, size, count, 4));
    clear_paths();
    let took = took?;
    drv.close(Close::Send, comms.0)?;
    drv.close(Close::Recv, comms.1)?;
    drv.finalize(ctx)?;
    let info: Vec<String> = take_captured().into_iter().filter(|l| l.0 == 3).map(|l| l.2).collect();
    let mibs = (size * count) as f64 / f64::from(1 << 20) / took.as_secs_f64();
    Ok((mibs, shares(&info)))
}

/// A slow path (5 ms and 1% loss on lane 1's source port), path-aware, whole messages: the
/// healthy lanes carry at least 80% of the bytes once the paths are learnt ([`LEARN`]
/// messages), in the median of 5 rounds (a clean 3-lane run and a slowed 4-lane run of 32
/// timed messages each); with `FERROCE_PATH_AWARE=0` and `FERROCE_LANE_STALL_MS=0` the slow
/// lane keeps its quarter (the comparison). The bandwidth ratio to the clean run is printed,
/// not asserted: it is the benchmark's (`ferroce_core::data`, "Slow paths", has it), and under
/// emulation on a busy machine one round's ratio ranges from 0.14x to 1.2x. Split mode is measured and printed. 160 MiB.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_slow_path_loses_its_work_to_the_healthy_ones() {
    let _g = vm_serial();
    // Both modes are measured, then judged, so that a run shows both.
    let mut results = Vec::new();
    for split in ["0", "1"] {
        // Each round runs a clean and a slowed run back to back, and the median round's ratio
        // is judged: a run under emulation varies by a third from one to the next, and the
        // pair shares the VM's pace of the moment (medians of unpaired runs missed the bar
        // on equal speeds). Where the bar is asserted, 5 rounds timing 32 messages: with 16,
        // a message the learning still gave the slow lane weighed 1/16 of the time.
        let (rounds, count) = if split == "0" { (5, 32) } else { (3, 16) };
        let runs = (|| {
            let mut pairs = Vec::new();
            for _ in 0..rounds {
                let clean = slow_run(split, 3, false, "1", count)?;
                let aware = slow_run(split, 4, true, "1", count)?;
                pairs.push((aware.0 / clean.0, clean, aware));
            }
            pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (r, c, a) in &pairs {
                eprintln!("split {split}: {r:.2}x: clean {c:.1?}, path-aware {a:.1?}");
            }
            // Strict rotation, and no stall fences either: the slow lane's 1% loss stalls it
            // for an ACK timeout now and then, which the stall bound would act on.
            set_env(&[("FERROCE_LANE_STALL_MS", Some("0"))]);
            let rotating = slow_run(split, 4, true, "0", 16);
            set_env(&[("FERROCE_LANE_STALL_MS", None)]);
            let rotating = rotating?;
            Ok::<_, String>((pairs.swap_remove(rounds / 2), rotating))
        })();
        clear_paths();
        set_env(&[
            ("NCCL_IB_QPS_PER_CONNECTION", None),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", None),
            ("FERROCE_PATH_AWARE", None),
            ("NCCL_IB_TIMEOUT", None),
        ]);
        let ((ratio, clean, aware), rotating) =
            runs.unwrap_or_else(|e| panic!("split {split}: {e}"));
        eprintln!(
            "split {split}: the median round: clean 3 lanes {:.1} MiB/s; lane 1 slowed, \
             path-aware {:.1} MiB/s ({ratio:.2}x), shares {:?}; rotating {:.1} MiB/s, shares \
             {:?}",
            clean.0, aware.0, aware.1, rotating.0, rotating.1
        );
        results.push((split, ratio, aware.1, rotating.1));
    }
    // The goal (0.9x in whole-message mode) is a benchmark: what is asserted is where the
    // bytes went. Split mode is printed: its slow lane keeps its share in one round of three
    // or so (a lane's rate shows the delay only once it loses packets).
    for (split, ratio, aware, rotating) in results {
        assert!(rotating[1] >= 20.0, "split {split}: rotation gave lane 1 {:.1}%", rotating[1]);
        if split == "0" {
            let kept = aware[1];
            assert!(kept <= 20.0, "split {split}: the slow lane kept {kept:.1}% ({ratio:.2}x)");
        }
    }
}

/// Every path dies mid-run (the drop matches every RoCE packet arriving at vethB): the comm
/// fails with ncclRemoteError (6) on the sender within the liveness bound; nothing hangs.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn every_path_dead_fails_the_comm_within_the_bound() {
    let _g = vm_serial();
    for split in ["0", "1"] {
        let r = with_four_lanes(split, None, || {
            let lib = open_plugin();
            let drv = Driver::new(&lib, 12)?;
            let ctx = drv.init(1)?;
            let comms = pair(&drv, ctx, 1, 0)?;
            stream(&drv, comms, 256 << 10, 4, 4)?;
            drop_on_vethb(&["dport", "4791"]);
            let t = Instant::now();
            let e = match stream(&drv, comms, 256 << 10, 8, 4) {
                Ok(_) => return Err("the run completed with every path dead".into()),
                Err(e) => e,
            };
            let took = t.elapsed();
            let _ = drv.close(Close::Send, comms.0);
            let _ = drv.close(Close::Recv, comms.1);
            drv.finalize(ctx)?;
            Ok::<_, String>((e, took, warnings()))
        });
        let (e, took, warns) = r.unwrap_or_else(|e| panic!("split {split}: {e}"));
        let bound = ferroce::config::retry_bound(17, 4);
        eprintln!(
            "split {split}: failed after {took:?} (retry bound {bound:?}): {e}\n  {warns:#?}"
        );
        assert!(e.contains("ncclResult 6"), "split {split}: not a remote error: {e}");
        // Each lane runs out on its own bound; lanes with work fail together, an idle one on
        // the first work moved to it: at most one bound per lane, and a margin.
        assert!(took < 4 * bound + Duration::from_secs(5), "split {split}: took {took:?}");
    }
}
