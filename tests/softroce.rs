//! Device discovery on real verbs: Soft-RoCE (rxe0 on vethA, rxe1 on vethB) inside the VM that
//! `ci/vm.sh` boots. Every test here is `#[ignore]`d on the host and run in the guest by
//! `ci/vm-tests.sh` with `--ignored`; inside the guest a missing device is a failure, not a skip.

mod common;

use std::ffi::{CStr, CString, c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use common::*;
use ferroce::ffi::abi::*;
use ferroce_core::setup::wire::{Handle, Kind, Msg};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::{Library, capture_logger, take_captured};
use ferroce_tools::sys::rdma_counts;

fn v12(lib: &Library) -> &ncclNet_v12_t {
    // SAFETY: the symbol is an ncclNet_v12_t; the reference does not outlive `lib`.
    unsafe { lib.table::<ncclNet_v12_t>(c"ncclNetPlugin_v12") }.expect("ncclNetPlugin_v12")
}

fn cstr(p: *const std::ffi::c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the plugin returns static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// init (v12) with `NCCL_IB_HCA` set to `hca` (or unset), returning the result, the context
/// and the device names.
fn init_with(net: &ncclNet_v12_t, hca: Option<&str>) -> (ncclResult_t, *mut c_void, Vec<String>) {
    // SAFETY: every test here holds the SERIAL lock while it changes the environment.
    unsafe {
        match hca {
            Some(v) => std::env::set_var("NCCL_IB_HCA", v),
            None => std::env::remove_var("NCCL_IB_HCA"),
        }
    }
    let mut ctx = null_mut();
    let mut cfg = ncclNetCommConfig_v10_t { trafficClass: -1 };
    // SAFETY: valid pointers per the ABI.
    let r = unsafe { net.init.unwrap()(&mut ctx, 42, &mut cfg, capture_logger(), None) };
    // SAFETY: as above.
    unsafe { std::env::remove_var("NCCL_IB_HCA") };
    let mut names = Vec::new();
    if r == ncclResult_t::ncclSuccess {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointers.
        assert_eq!(unsafe { net.devices.unwrap()(&mut n) }, ncclResult_t::ncclSuccess);
        for d in 0..n {
            let mut p = ncclNetProperties_v12_t::default();
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { net.getProperties.unwrap()(d, &mut p) }, ncclResult_t::ncclSuccess);
            names.push(cstr(p.name));
        }
    }
    (r, ctx, names)
}

fn finalize(net: &ncclNet_v12_t, ctx: *mut c_void) {
    // SAFETY: ctx came from a successful init and is finalized once.
    assert_eq!(unsafe { net.finalize.unwrap()(ctx) }, ncclResult_t::ncclSuccess);
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn devices_are_rxe0_and_rxe1() {
    with_plugin(|lib| {
        let net = v12(lib);
        let (r, ctx, names) = init_with(net, None);
        assert_eq!(r, ncclResult_t::ncclSuccess, "{:?}", take_captured());
        assert_eq!(names, ["rxe0", "rxe1"]);
        finalize(net, ctx);
        // Each device is described once at INFO, with well-formed logging.
        let lines = take_captured();
        for dev in ["rxe0", "rxe1"] {
            let n = lines
                .iter()
                .filter(|l| l.0 == 3 && l.2.contains(&format!(": {dev} port 1")))
                .count();
            assert_eq!(n, 1, "{dev}: {lines:?}");
        }
        assert!(lines.iter().all(|l| !l.2.starts_with("BAD FORMAT")), "{lines:?}");
    });
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn properties_pass_the_checks_in_every_version() {
    with_plugin(|lib| {
        let net = v12(lib);
        let (r, ctx, _) = init_with(net, None);
        assert_eq!(r, ncclResult_t::ncclSuccess);
        let mut names = std::collections::HashSet::new();
        for dev in 0..2 {
            let mut p = ncclNetProperties_v12_t::default();
            // SAFETY: valid out-pointer.
            let r = unsafe { net.getProperties.unwrap()(dev, &mut p) };
            assert_eq!(r, ncclResult_t::ncclSuccess);
            let name = cstr(p.name);
            assert!(names.insert(name.clone()), "duplicate name {name}");
            // pciPath: the realpath of the device's sysfs dir (rxe has no PCI parent).
            let pci = cstr(p.pciPath);
            let want = std::fs::canonicalize(format!("/sys/class/infiniband/{name}")).unwrap();
            let want = std::fs::canonicalize(format!("/sys/class/infiniband/{name}/device"))
                .unwrap_or(want);
            assert_eq!(pci, want.to_string_lossy(), "{name}");
            // guid: the sys_image_guid that sysfs shows as xxxx:xxxx:xxxx:xxxx.
            let sys =
                std::fs::read_to_string(format!("/sys/class/infiniband/{name}/sys_image_guid"))
                    .unwrap();
            assert_eq!(format!("{:016x}", p.guid), sys.trim().replace(':', ""), "{name} guid");
            assert_eq!(p.speed, 10000, "{name}: rxe reports 10 Gbps, 1X");
            assert_eq!(p.port, 1);
            assert_eq!(p.latency, 0.0);
            assert!(p.maxComms > 1000, "{name} maxComms {}", p.maxComms);
            assert_eq!(p.maxRecvs, 8);
            assert_eq!(p.ptrSupport, NCCL_PTR_HOST as c_int);
            assert_eq!(p.netDeviceType, ncclNetDeviceType::NCCL_NET_DEVICE_HOST);
            assert_eq!(p.netDeviceVersion, 0);
            assert_eq!(p.vProps.ndevs, 1);
            assert_eq!(p.vProps.devs[0], dev);
            assert!(p.maxP2pBytes > 0 && p.maxP2pBytes as u64 <= NCCL_MAX_NET_SIZE_BYTES);
            assert_eq!((p.railId, p.planeId), (-1, -1));
            assert_eq!(p.maxMultiRequestSize, 1);

            // The older versions report the same values through their own layouts.
            let mut p11 = ncclNetProperties_v11_t::default();
            let mut p9 = ncclNetProperties_v9_t::default();
            let mut p8 = ncclNetProperties_v8_t::default();
            let mut p7 = ncclNetProperties_v7_t::default();
            let mut p6 = ncclNetProperties_v6_t::default();
            // SAFETY: each symbol has its version's table type; out-pointers are valid.
            unsafe {
                let t11 = lib.table::<ncclNet_v11_t>(c"ncclNetPlugin_v11").unwrap();
                let t10 = lib.table::<ncclNet_v10_t>(c"ncclNetPlugin_v10").unwrap();
                let t9 = lib.table::<ncclNet_v9_t>(c"ncclNetPlugin_v9").unwrap();
                let t8 = lib.table::<ncclNet_v8_t>(c"ncclNetPlugin_v8").unwrap();
                let t7 = lib.table::<ncclNet_v7_t>(c"ncclNetPlugin_v7").unwrap();
                let t6 = lib.table::<ncclNet_v6_t>(c"ncclNetPlugin_v6").unwrap();
                assert_eq!(t11.getProperties.unwrap()(dev, &mut p11), ncclResult_t::ncclSuccess);
                let mut p10 = ncclNetProperties_v9_t::default();
                assert_eq!(t10.getProperties.unwrap()(dev, &mut p10), ncclResult_t::ncclSuccess);
                assert_eq!(t9.getProperties.unwrap()(dev, &mut p9), ncclResult_t::ncclSuccess);
                assert_eq!(t8.getProperties.unwrap()(dev, &mut p8), ncclResult_t::ncclSuccess);
                assert_eq!(t7.getProperties.unwrap()(dev, &mut p7), ncclResult_t::ncclSuccess);
                assert_eq!(t6.getProperties.unwrap()(dev, &mut p6), ncclResult_t::ncclSuccess);
                assert_eq!((p10.speed, p10.guid, p10.vProps.devs[0]), (p.speed, p.guid, dev));
            }
            assert_eq!(
                (cstr(p11.name), p11.speed, p11.maxP2pBytes),
                (name.clone(), p.speed, p.maxP2pBytes)
            );
            assert_eq!((p11.vProps.ndevs, p11.vProps.devs[0]), (1, dev));
            assert_eq!(
                (cstr(p9.name), p9.guid, p9.maxRecvs, p9.port),
                (name.clone(), p.guid, 8, 1)
            );
            assert_eq!((p9.vProps.ndevs, p9.vProps.devs[0]), (1, dev));
            assert_eq!(
                (cstr(p8.pciPath), p8.speed, p8.maxComms),
                (pci.clone(), p.speed, p.maxComms)
            );
            assert_eq!((p8.netDeviceType, p7.netDeviceType), (p.netDeviceType, p.netDeviceType));
            assert_eq!(
                (cstr(p7.name), p7.guid, p7.ptrSupport),
                (name.clone(), p.guid, p.ptrSupport)
            );
            assert_eq!(
                (cstr(p6.name), cstr(p6.pciPath), p6.speed, p6.maxRecvs),
                (name, pci, p.speed, 8)
            );
        }
        // A device index out of range is the caller's misuse, as in NCCL's transport: in every
        // version, ncclInvalidUsage.
        for dev in [2, -1, c_int::MAX] {
            let mut p = ncclNetProperties_v12_t::default();
            let mut p6 = ncclNetProperties_v6_t::default();
            // SAFETY: valid out-pointers; each table has its version's type.
            let (r12, r6) = unsafe {
                let t6 = lib.table::<ncclNet_v6_t>(c"ncclNetPlugin_v6").unwrap();
                (net.getProperties.unwrap()(dev, &mut p), t6.getProperties.unwrap()(dev, &mut p6))
            };
            assert_eq!((r12, r6), (ncclResult_t::ncclInvalidUsage, ncclResult_t::ncclInvalidUsage));
        }
        finalize(net, ctx);
        take_captured();
    });
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn nccl_ib_hca_forms_select_what_they_should() {
    with_plugin(|lib| {
        let net = v12(lib);
        for (hca, want) in [
            ("rxe1", &["rxe1"][..]),
            ("^rxe0", &["rxe1"]),
            ("=rxe1", &["rxe1"]),
            ("rxe0:1", &["rxe0"]),
            ("rxe", &["rxe0", "rxe1"]),
            ("rxe1,rxe0", &["rxe0", "rxe1"]),
            ("^=rxe", &["rxe0", "rxe1"]),
            ("rxe0::5:6", &["rxe0"]),
        ] {
            let (r, ctx, names) = init_with(net, Some(hca));
            assert_eq!(r, ncclResult_t::ncclSuccess, "NCCL_IB_HCA={hca}: {:?}", take_captured());
            assert_eq!(names, want, "NCCL_IB_HCA={hca}");
            if hca == "rxe0::5:6" {
                let mut p = ncclNetProperties_v12_t::default();
                // SAFETY: valid out-pointer.
                unsafe { net.getProperties.unwrap()(0, &mut p) };
                assert_eq!((p.railId, p.planeId), (5, 6));
            }
            finalize(net, ctx);
        }
        // Filters that keep nothing fail init with one WARN naming the filter, after one naming
        // each entry that matches no device at all (a typo).
        for (hca, typo) in
            [("=rxe", Some("rxe")), ("rxe0:2", None), ("^rxe", None), ("mlx5", Some("mlx5"))]
        {
            take_captured();
            let (r, ctx, _) = init_with(net, Some(hca));
            assert_eq!(r, ncclResult_t::ncclInvalidUsage, "NCCL_IB_HCA={hca}");
            assert!(ctx.is_null());
            let warns: Vec<_> = take_captured().into_iter().filter(|l| l.0 == 2).collect();
            assert_eq!(warns.len(), 1 + usize::from(typo.is_some()), "{warns:?}");
            if let Some(t) = typo {
                assert!(warns[0].2.contains(&format!("{t:?} matches no RDMA device")), "{warns:?}");
            }
            let last = &warns[warns.len() - 1].2;
            assert!(last.contains(&format!("filtered out by NCCL_IB_HCA={hca}")), "{warns:?}");
        }
        // A typo next to a good entry: init succeeds with what matched, and the typo is named.
        take_captured();
        let (r, ctx, names) = init_with(net, Some("rxe0,mxl5_0"));
        assert_eq!((r, names), (ncclResult_t::ncclSuccess, vec!["rxe0".to_string()]));
        let warns: Vec<_> = take_captured().into_iter().filter(|l| l.0 == 2).collect();
        assert_eq!(warns.len(), 1, "{warns:?}");
        assert!(warns[0].2.contains("\"mxl5_0\" matches no RDMA device (devices: rxe0, rxe1)"));
        finalize(net, ctx);
    });
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn legacy_versions_see_the_same_devices() {
    let _g = vm_serial();
    // A fresh load, so the once-per-load legacy init really runs here.
    let lib = open_plugin();
    type Init = unsafe extern "C" fn(ncclDebugLogger_t) -> ncclResult_t;
    type Devices = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
    for v in [6, 7, 8, 9] {
        let sym = CString::new(format!("ncclNetPlugin_v{v}")).unwrap();
        // SAFETY: v6..v9 tables start with name, init(logger), devices(int*).
        let t = unsafe { lib.table::<(*const i8, Option<Init>, Option<Devices>)>(&sym) }.unwrap();
        let mut n = 0;
        // SAFETY: per the v6..v9 ABI.
        unsafe {
            assert_eq!(t.1.unwrap()(capture_logger()), ncclResult_t::ncclSuccess, "v{v}");
            assert_eq!(t.2.unwrap()(&mut n), ncclResult_t::ncclSuccess, "v{v}");
        }
        assert_eq!(n, 2, "v{v}");
    }
    take_captured();
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn ten_init_traffic_finalize_dlclose_cycles_in_one_process() {
    let _g = vm_serial();
    let mapped =
        || std::fs::read_to_string("/proc/self/maps").unwrap().contains("libnccl-net-ferroce.so");
    for cycle in 0..10 {
        let lib = open_plugin();
        let drv = Driver::new(&lib, 12).unwrap();
        let ctx = drv.init(cycle).unwrap();
        let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
        transfer(&drv, send, recv, 100_000, cycle as u8).unwrap();
        drv.close(Close::Send, send).unwrap();
        drv.close(Close::Recv, recv).unwrap();
        drv.finalize(ctx).unwrap();
        drop(lib); // dlclose: NCCL >= 2.28 unloads the plugin after the last finalize
        eprintln!(
            "cycle {cycle}: after dlclose the library is {}",
            if mapped() { "still mapped" } else { "unloaded" }
        );
    }
    take_captured();
}

/// What a rank prints at `NCCL_DEBUG=INFO` (WARN and INFO; not TRACE) from `init` through its
/// first connection (a send and a receive comm, rxe0 to rxe1), with only `env` of the NCCL and
/// ferroce variables set.
fn info_lines_to_first_connection(lib: &Library, env: &[(&str, &str)]) -> Vec<String> {
    let ours: Vec<String> = std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("NCCL_") || k.starts_with("FERROCE_"))
        .collect();
    let saved: Vec<(String, Option<String>)> =
        ours.iter().map(|k| (k.clone(), std::env::var(k).ok())).collect();
    let unset: Vec<(&str, Option<&str>)> = ours.iter().map(|k| (k.as_str(), None)).collect();
    set_env(&unset);
    set_env(&env.iter().map(|&(k, v)| (k, Some(v))).collect::<Vec<_>>());
    take_captured();
    let drv = Driver::new(lib, 12).unwrap();
    let ctx = drv.init(36).unwrap();
    let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
    let trace = ncclDebugLogLevel::NCCL_LOG_TRACE.0 as i32;
    let lines = take_captured().into_iter().filter(|l| l.0 < trace).map(|l| l.2).collect();
    close_both(&drv, send, recv).unwrap();
    drv.finalize(ctx).unwrap();
    set_env(&env.iter().map(|&(k, _)| (k, None)).collect::<Vec<_>>());
    set_env(&saved.iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect::<Vec<_>>());
    take_captured();
    lines
}

/// At INFO a rank says little from `init` to its first connection: with no knob set, the
/// version, one line per port (the GID it chose and why), the memlock limit where it is not
/// unlimited, and one line per end of the connection; nothing else and no WARN. Two knobs set
/// add exactly their two lines, each with the value as read. Both are printed for the README.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn from_init_to_the_first_connection_a_rank_prints_one_screen_at_info() {
    with_plugin(|lib| {
        let plain = info_lines_to_first_connection(lib, &[]);
        eprintln!("--- at INFO, no knob set:\n{}", plain.join("\n"));
        let version = format!("NET/ferroce: ferroce {}", env!("CARGO_PKG_VERSION"));
        assert_eq!(plain.first(), Some(&version), "{plain:#?}");
        let mut per_port = [0, 0];
        for l in &plain[1..] {
            let l = l.strip_prefix("NET/ferroce: ").unwrap_or(l);
            if let Some(dev) = (0..2).find(|d| l.starts_with(&format!("device {d}: rxe{d} port 1")))
            {
                assert!(l.contains("GID index 1 (") && l.contains("GPUDirect RDMA HOST"), "{l}");
                per_port[dev] += 1;
            } else {
                let known = ["RLIMIT_MEMLOCK is ", "connected to ", "accepted from "];
                assert!(known.iter().any(|k| l.starts_with(k)), "an unexpected INFO line: {l}");
            }
        }
        assert_eq!(per_port, [1, 1], "one line per port: {plain:#?}");
        assert!(plain.len() <= 6, "{} lines: {plain:#?}", plain.len());

        let env = [("NCCL_IB_TIMEOUT", "0x12"), ("NCCL_IB_QPS_PER_CONNECTION", "4")];
        let two = info_lines_to_first_connection(lib, &env);
        eprintln!("--- at INFO, two knobs set:\n{}", two.join("\n"));
        assert_eq!(two.len(), plain.len() + 2, "{two:#?}");
        for must in [
            "NET/ferroce: NCCL_IB_TIMEOUT set by environment to 0x12, used as 18",
            "NET/ferroce: NCCL_IB_QPS_PER_CONNECTION set by environment to 4",
        ] {
            assert!(two.iter().any(|l| l == must), "missing {must:?} in {two:#?}");
        }
    });
}

/// Waits (bounded) until both rxe ports report `want` in sysfs.
fn wait_ports(want: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let states: Vec<String> = ["rxe0", "rxe1"]
            .iter()
            .map(|d| {
                std::fs::read_to_string(format!("/sys/class/infiniband/{d}/ports/1/state")).unwrap()
            })
            .collect();
        if states.iter().all(|s| s.contains(want)) {
            return;
        }
        assert!(Instant::now() < deadline, "ports did not become {want}: {states:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ip_link(state: &str) {
    run("ip", &["link", "set", "vethA", state]);
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn no_active_port_fails_init_with_the_port_states() {
    with_plugin(|lib| {
        let net = v12(lib);
        // Taking one end of the veth pair down takes both rxe ports down.
        ip_link("down");
        wait_ports("DOWN");
        take_captured();
        let (r, ctx, _) = init_with(net, None);
        let lines = take_captured();
        ip_link("up");
        wait_ports("ACTIVE");
        assert_eq!(r, ncclResult_t::ncclInvalidUsage);
        assert!(ctx.is_null());
        let warns: Vec<_> = lines.iter().filter(|l| l.0 == 2).collect();
        assert_eq!(warns.len(), 1, "{lines:?}");
        assert!(
            warns[0].2.contains("no ACTIVE port") && warns[0].2.contains("rxe0:1 is DOWN"),
            "{warns:?}"
        );
        // And the devices are usable again once the link is back.
        let (r, ctx, names) = init_with(net, None);
        assert_eq!(r, ncclResult_t::ncclSuccess);
        assert_eq!(names, ["rxe0", "rxe1"]);
        finalize(net, ctx);
    });
}

fn hello(nonce: u64) -> Msg {
    Msg {
        kind: Kind::Hello,
        nonce,
        nqps: 1,
        qpns: std::array::from_fn(|i| if i == 0 { 0x77 } else { 0 }),
        sports: [0xc000; 128],
        split: false,
        sl: 0,
        mtu: 3,
        port: 1,
        traffic_class: 0,
        gid: "::ffff:198.18.0.1".parse::<std::net::Ipv6Addr>().unwrap().octets(),
        buf_addr: 0x1000,
        buf_rkey: 1,
        max_msg: 1 << 20,
        members: 1,
        more: Default::default(),
    }
}

/// Posts `wr` (signaled) on `qp` and waits up to 60 s for its completion on `cq`: its status.
fn completion(
    qp: &ferroce::verbs::Qp,
    cq: &ferroce::verbs::Cq,
    wr: ferroce_core::wr::SendWr,
) -> u32 {
    let wr_id = wr.wr_id;
    qp.post_send(&[wr]).unwrap();
    let (mut status, t) = (None, Instant::now());
    while status.is_none() {
        cq.poll_with(|_, _, c| {
            assert_eq!(c.wr_id, wr_id);
            status = Some(c.status);
        })
        .unwrap();
        assert!(t.elapsed() < Duration::from_secs(60), "no completion");
    }
    status.unwrap()
}

/// Least privilege on real verbs: a connector of our own (raw verbs on rxe0, speaking the
/// handshake itself) reaches the plugin's receive QP. An RDMA write into the receiver's size
/// records goes through (the path works), and an RDMA read of the same words is refused by the
/// receiver's queue pair: no queue pair a peer reaches grants remote reads.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn the_receivers_nic_refuses_a_peers_rdma_read() {
    use ferroce::verbs::{self, Cq, Pd, Qp, QpCaps, RegisteredBuf};
    use ferroce_core::wr::{Op, SendWr};
    use std::io::{Read, Write};
    use std::sync::Arc;
    let _g = vm_serial();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    let (handle, listen) = drv.listen(ctx, 1).unwrap();
    let h = Handle::decode(&handle).unwrap();

    // Our end on rxe0: one RC QP that grants nothing, a CQ, a local buffer.
    let (_, mut ctxs) = verbs::open_all(|n| n == "rxe0").unwrap();
    let dev = Arc::new(ctxs.remove(0).unwrap());
    let pd = Pd::new(&dev).unwrap();
    let cq = Cq::new(&dev, 16).unwrap();
    let caps = QpCaps { max_send_wr: 8, max_recv_wr: 1, max_inline: 64 };
    let qp = Qp::create_rc(&pd, &cq, caps).unwrap();
    qp.to_init(1, 0).unwrap();
    let local = RegisteredBuf::new(&pd, 64, verbs::ACCESS_LOCAL_WRITE).unwrap();
    let ours: std::net::Ipv6Addr = "::ffff:198.18.0.1".parse().unwrap();
    let sgid = (0..16).find(|&i| dev.query_gid(1, i).is_ok_and(|g| g == ours.octets()));
    let sgid = sgid.expect("rxe0's RoCE v2 GID") as u8;

    // The handshake: our hello, the plugin's reply (its QP and size records), our ready.
    let mut hi = hello(h.nonce);
    hi.qpns[0] = qp.qpn();
    hi.gid = ours.octets();
    hi.buf_addr = local.addr(0);
    hi.buf_rkey = local.rkey();
    let mut s = std::net::TcpStream::connect(h.addr).unwrap();
    s.write_all(&hi.encode()).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut reply = [0u8; ferroce_core::setup::wire::MSG_LEN];
    let (mut got, t) = (0, Instant::now());
    while got < reply.len() {
        assert_eq!(drv.accept(listen).unwrap(), None, "no comm before our ready");
        match s.read(&mut reply[got..]) {
            Ok(0) => panic!("the plugin closed the connection"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no reply");
    }
    let reply = Msg::decode(&reply, Kind::Reply, h.nonce).expect("a valid reply");
    connect_qp(&qp, &reply, sgid, h.nonce);
    let ready = Msg { kind: Kind::Ready, ..hi };
    s.write_all(&ready.encode()).unwrap();
    let t = Instant::now();
    let comm = loop {
        if let Some(c) = drv.accept(listen).unwrap() {
            break c;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no comm after our ready");
    };

    // One operation at a time; its completion's status.
    let op = |op: Op, wr_id: u64| -> u32 {
        let local = Some((local.addr(0), 8, local.lkey()));
        let (remote_addr, rkey) = (reply.buf_addr, reply.buf_rkey);
        let wr = SendWr { wr_id, op, signaled: true, local, remote_addr, rkey, inline: false };
        completion(&qp, &cq, wr)
    };
    assert_eq!(op(Op::Write, 1), 0, "a write into the size records goes through");
    // Inline data is copied by the CPU: from our registered host buffer it goes; from memory
    // no host registration covers (here a stack array, with the buffer's key) the post is
    // refused before the provider reads a byte.
    let inline = |addr: u64| SendWr {
        wr_id: 3,
        op: Op::Write,
        signaled: false,
        local: Some((addr, 8, local.lkey())),
        remote_addr: reply.buf_addr,
        rkey: reply.buf_rkey,
        inline: true,
    };
    let stray = [0u8; 8];
    let e = qp.post_send(&[inline(stray.as_ptr() as u64)]).expect_err("inline from elsewhere");
    assert!(e.to_string().contains("no registration of host memory covers it"), "{e}");
    qp.post_send(&[inline(local.addr(0))]).expect("inline from a host registration");
    // IBV_WC_REM_INV_REQ_ERR: the responder's QP does not allow the operation (its access
    // flags), before any memory key is looked at (that refusal would be REM_ACCESS_ERR, 10).
    let read = op(Op::Read, 2);
    assert_eq!(read, 9, "the read is refused by the receiver's QP (status {read})");
    drv.close(Close::Recv, comm).unwrap();
    drv.close(Close::Listen, listen).unwrap();
    drv.finalize(ctx).unwrap();
}

/// Brings our raw queue pair `qp` to RTS towards the plugin's first QP in `peer` (its hello or
/// reply), from our GID at index `sgid`, with the PSNs both ends derive from `nonce`.
fn connect_qp(qp: &ferroce::verbs::Qp, peer: &Msg, sgid: u8, nonce: u64) {
    use ferroce::verbs::{RtrAttr, RtsAttr};
    let rtr = RtrAttr {
        port: 1,
        path_mtu: 3,
        dest_qpn: peer.qpns[0],
        dgid: peer.gid,
        sgid_index: sgid,
        flow_label: 0,
        traffic_class: 0,
        sl: 0,
        rq_psn: ferroce_core::setup::first_psn(nonce, peer.qpns[0]),
    };
    qp.to_rtr(&rtr).unwrap();
    let sq_psn = ferroce_core::setup::first_psn(nonce, qp.qpn());
    qp.to_rts(&RtsAttr { timeout: 14, retry_cnt: 3, rnr_retry: 3, sq_psn }).unwrap();
}

/// Least privilege on the sending side, on real verbs: a listener of our own (raw verbs on
/// rxe1, speaking the handshake itself) takes the plugin's connect. The receiver must write
/// its clear-to-send rows into the sender's FIFO, so the sender's queue pair takes writes, but
/// its FIFO's key covers the FIFO alone: a write into the FIFO goes through (the path works),
/// and then an RDMA read of it, or a write one byte past it with its key, is refused by the
/// sender's NIC. Each refusal takes a connection of its own (the refused queue pair goes to
/// the error state).
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn the_senders_nic_refuses_a_read_and_a_write_outside_its_fifo() {
    use ferroce::verbs::{self, Cq, Pd, Qp, QpCaps, RegisteredBuf};
    use ferroce_core::data::FIFO_AREA;
    use ferroce_core::setup::wire::MSG_LEN;
    use ferroce_core::wr::{Op, SendWr};
    use std::io::{Read, Write};
    use std::sync::Arc;
    let _g = vm_serial();
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", Some("1"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", None)]);

    // Our end on rxe1: a queue pair that grants nothing, a CQ, a zeroed local buffer.
    let (_, mut ctxs) = verbs::open_all(|n| n == "rxe1").unwrap();
    let dev = Arc::new(ctxs.remove(0).unwrap());
    let pd = Pd::new(&dev).unwrap();
    let ours: std::net::Ipv6Addr = "::ffff:198.18.0.2".parse().unwrap();
    let sgid = (0..16).find(|&i| dev.query_gid(1, i).is_ok_and(|g| g == ours.octets()));
    let sgid = sgid.expect("rxe1's RoCE v2 GID") as u8;
    let local = RegisteredBuf::new(&pd, 64, verbs::ACCESS_LOCAL_WRITE).unwrap();
    let tcp = std::net::TcpListener::bind("198.18.0.2:0").unwrap();

    // One connection from the plugin; `offset` and `op` the refused operation, whose status is
    // returned after a write into the FIFO went through.
    let refused = |op: Op, offset: u64| -> u32 {
        let nonce = 0x5eed_0000 + offset;
        let h = Handle { addr: tcp.local_addr().unwrap(), nonce, members: 1 };
        let mut handle = [0u8; 128];
        h.encode(&mut handle);
        let cq = Cq::new(&dev, 16).unwrap();
        let caps = QpCaps { max_send_wr: 8, max_recv_wr: 1, max_inline: 0 };
        let qp = Qp::create_rc(&pd, &cq, caps).unwrap();
        qp.to_init(1, 0).unwrap();
        let t = Instant::now();
        let mut send = drv.connect(ctx, 0, &mut handle).unwrap();
        let (mut s, _) = tcp.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut hello = [0u8; MSG_LEN];
        s.read_exact(&mut hello).expect("the plugin's hello");
        let hello = Msg::decode(&hello, Kind::Hello, nonce).expect("a valid hello");
        assert_eq!(hello.nqps, 1);
        connect_qp(&qp, &hello, sgid, nonce);
        let mut reply = Msg { kind: Kind::Reply, gid: ours.octets(), ..hello };
        reply.qpns = std::array::from_fn(|i| if i == 0 { qp.qpn() } else { 0 });
        (reply.buf_addr, reply.buf_rkey) = (local.addr(0), local.rkey());
        s.write_all(&reply.encode()).unwrap();
        while send.is_none() {
            send = drv.connect(ctx, 0, &mut handle).unwrap();
            assert!(t.elapsed() < Duration::from_secs(30), "no comm after our reply");
        }
        let post = |op: Op, remote_addr: u64, wr_id: u64| -> u32 {
            let (local, rkey) = (Some((local.addr(0), 8, local.lkey())), hello.buf_rkey);
            let wr = SendWr { wr_id, op, signaled: true, local, remote_addr, rkey, inline: false };
            completion(&qp, &cq, wr)
        };
        // Zeros over the FIFO's first row, which is zero: nothing the sender reads changes.
        assert_eq!(post(Op::Write, hello.buf_addr, 1), 0, "a write into the FIFO goes through");
        let status = post(op, hello.buf_addr + offset, 2);
        drv.close(Close::Send, send.unwrap()).unwrap();
        status
    };
    // IBV_WC_REM_INV_REQ_ERR (9): the sender's queue pair does not allow remote reads.
    assert_eq!(refused(Op::Read, 0), 9, "a read of the sender's FIFO");
    // IBV_WC_REM_ACCESS_ERR (10): the key does not cover the byte past the FIFO.
    assert_eq!(refused(Op::Write, 8 * FIFO_AREA as u64), 10, "a write past the FIFO");
    drv.finalize(ctx).unwrap();
}

/// Nothing outlives its communicator. Context A leaves a listener, a connect in progress and
/// a connected pair open and finalizes while context B runs traffic: A's are ended (one WARN
/// with the counts, their queue pairs gone, calls on them errors), B's traffic goes on, and
/// closing A's ended objects frees them. Then B finalizes.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_communicators_finalize_ends_its_own_objects_and_no_others() {
    let _g = vm_serial();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let (a, b) = (drv.init(1).unwrap(), drv.init(2).unwrap());
    let (bs, br) = pair(&drv, b, 1, 0).unwrap();
    transfer(&drv, bs, br, 4096, 1).unwrap();
    let (mut ha, la) = drv.listen(a, 1).unwrap();
    assert_eq!(drv.connect(a, 0, &mut ha).unwrap(), None, "parked until accepted");
    let (as_, ar) = pair(&drv, a, 1, 0).unwrap();
    // SAFETY: gettid has no preconditions (the kernel files QPs under the thread making them).
    let tid = unsafe { libc::gettid() } as u32;
    let qps = |what: &str| rdma_counts(tid).unwrap_or_else(|e| panic!("{what}: {e}")).qp;
    let both = qps("both communicators");
    let _ = take_captured();
    drv.finalize(a).unwrap();
    let warned: Vec<_> = take_captured().into_iter().filter(|l| l.0 == 2).collect();
    let want = "closed 1 listener(s) and 2 comm(s) and ended 1 connect(s) in progress";
    assert!(warned.len() == 1 && warned[0].2.contains(want), "{warned:?}");
    let after_a = settle(&4, Duration::from_secs(10), || qps("after A's finalize"));
    assert_eq!(after_a, 4, "B's pair only (of {both})");
    let accept = drv.accept(la).expect_err("accept on A's ended listener");
    assert!(accept.contains("returned ncclResult 3"), "{accept}");
    transfer(&drv, bs, br, 65536, 2).expect("B's traffic goes on");
    for (which, comm) in [(Close::Send, as_), (Close::Recv, ar), (Close::Listen, la)] {
        let e = drv.close(which, comm).expect_err("closing an ended object reports it");
        assert!(e.contains("returned ncclResult 3"), "{e}");
    }
    close_both(&drv, bs, br).unwrap();
    drv.finalize(b).unwrap();
    assert_eq!(settle(&0, Duration::from_secs(10), || qps("after both")), 0);
}

/// A second `finalize` of a context, and a `listen` or `connect` on it after its `finalize`,
/// are errors (`ncclInternalError` and a WARN that names it): nothing is freed twice or read
/// after it is freed. Another communicator's context in the same process is untouched.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_finalized_context_is_an_error_never_undefined() {
    let _g = vm_serial();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let (a, b) = (drv.init(1).unwrap(), drv.init(2).unwrap());
    drv.finalize(a).unwrap();
    let _ = take_captured();
    let internal = "returned ncclResult 3";
    let again = drv.finalize(a).expect_err("a second finalize of the same context");
    assert!(again.contains(internal), "{again}");
    let listen = drv.listen(a, 0).expect_err("listen on a finalized context");
    assert!(listen.contains(internal), "{listen}");
    let (mut handle, l) = drv.listen(b, 1).expect("the other context still listens");
    let connect = drv.connect(a, 0, &mut handle).expect_err("connect on a finalized context");
    assert!(connect.contains(internal), "{connect}");
    let warned = take_captured();
    let named =
        warned.iter().filter(|w| w.0 == 2 && w.2.contains("is not live (finalized already"));
    assert_eq!(named.count(), 3, "one WARN per refused call: {warned:?}");
    drv.close(Close::Listen, l).unwrap();
    drv.finalize(b).unwrap();
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn garbage_and_silent_peers_are_dropped_and_the_rightful_peer_is_served() {
    use std::io::Write;
    let _g = vm_serial();
    // Long enough for the stranger's own 5 s hello deadline to come first: junk never extends
    // the wait for the rightful peer, so that wait must outlast the junk.
    // SAFETY: tests that change the environment hold the SERIAL lock.
    unsafe { std::env::set_var("FERROCE_SETUP_TIMEOUT_MS", "20000") };
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    let (mut handle, listen) = drv.listen(ctx, 1).unwrap();
    let h = Handle::decode(&handle).unwrap();
    take_captured();
    let mut header_only = hello(h.nonce).encode();
    header_only[16..20].copy_from_slice(&4096u32.to_le_bytes());
    let mut old_version = hello(h.nonce).encode();
    old_version[8] = 0;
    let attacks: Vec<(&str, Vec<u8>)> = vec![
        ("bad magic", (0..96u8).map(|i| i.wrapping_mul(37)).collect()),
        ("message length 4096", header_only.to_vec()),
        ("protocol version 0", old_version.to_vec()),
        ("nonce does not match", hello(h.nonce ^ 1).encode().to_vec()),
        ("truncated message", hello(h.nonce).encode()[..50].to_vec()),
        ("no hello within 5000 ms", Vec::new()),
    ];
    let mut socks = Vec::new();
    for (_, bytes) in &attacks {
        let mut s = std::net::TcpStream::connect(h.addr).unwrap();
        s.write_all(bytes).unwrap();
        socks.push(s);
    }
    socks[4].shutdown(std::net::Shutdown::Both).unwrap(); // the truncated one closes early
    // accept keeps answering "not yet" (never an error, never blocking) while it sorts them
    // out; the silent one is dropped at the stranger's 5 s hello deadline.
    let t = Instant::now();
    let mut warns: Vec<String> = Vec::new();
    while warns.len() < attacks.len() {
        let c0 = Instant::now();
        assert_eq!(drv.accept(listen).unwrap(), None);
        assert!(c0.elapsed() < Duration::from_secs(3), "accept blocked"); // the silent peer would block 5 s
        warns.extend(warnings());
        assert!(t.elapsed() < Duration::from_secs(15), "not all rejected: {warns:#?}");
    }
    assert!(
        t.elapsed() >= Duration::from_millis(4900),
        "the silent peer was dropped before its deadline"
    );
    for (why, _) in &attacks {
        assert_eq!(warns.iter().filter(|w| w.contains(why)).count(), 1, "{why}: {warns:#?}");
    }
    assert_eq!(warns.len(), attacks.len(), "{warns:#?}");
    assert!(warns.iter().all(|w| w.contains("rejected connection from 198.18.0.")), "{warns:#?}");
    // The rightful peer still gets through, and data flows.
    let (send, recv) =
        drv.connect_both(ctx, 0, &mut handle, listen, Duration::from_secs(30)).unwrap();
    transfer(&drv, send, recv, 65536, 3).unwrap();
    drv.close(Close::Listen, listen).unwrap();
    drv.close(Close::Send, send).unwrap();
    drv.close(Close::Recv, recv).unwrap();
    drv.finalize(ctx).unwrap();
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_peer_that_dies_after_its_hello_fails_accept_naming_peer_and_step() {
    use std::io::Write;
    in_vm(1, &[("FERROCE_SETUP_TIMEOUT_MS", Some("1500"))], |drv, ctx| {
        let (handle, listen) = drv.listen(ctx, 1).unwrap();
        let h = Handle::decode(&handle).unwrap();
        let mut s = Some(std::net::TcpStream::connect(h.addr).unwrap());
        let me = s.as_ref().unwrap().local_addr().unwrap();
        s.as_mut().unwrap().write_all(&hello(h.nonce).encode()).unwrap();
        let t = Instant::now();
        let err = loop {
            match drv.accept(listen) {
                Ok(None) => {}
                Ok(Some(_)) => panic!("accepted a dead peer"),
                Err(e) => break e,
            }
            if t.elapsed() > Duration::from_millis(300) {
                drop(s.take()); // the peer dies after its hello was answered
            }
            assert!(t.elapsed() < Duration::from_secs(10), "accept did not fail in time");
        };
        assert!(err.contains("ncclResult 6"), "{err}");
        let warns: Vec<String> = warnings();
        let w = warns
            .iter()
            .find(|w| w.contains("accept from"))
            .unwrap_or_else(|| panic!("{warns:#?}"));
        assert!(w.contains(&me.to_string()) && w.contains("wait for ready"), "{w}");
        drv.close(Close::Listen, listen).unwrap();
    });
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_silent_listener_fails_connect_within_the_deadline() {
    in_vm(1, &[("FERROCE_SETUP_TIMEOUT_MS", Some("1500"))], |drv, ctx| {
        let silent = std::net::TcpListener::bind("198.18.0.2:0").unwrap();
        let mut handle = [0u8; 128];
        Handle { addr: silent.local_addr().unwrap(), nonce: 5, members: 1 }.encode(&mut handle);
        let t = Instant::now();
        let err = loop {
            match drv.connect(ctx, 0, &mut handle) {
                Ok(None) => {}
                Ok(Some(_)) => panic!("connected to a silent listener"),
                Err(e) => break e,
            }
            assert!(t.elapsed() < Duration::from_secs(20), "connect did not fail in time");
        };
        let took = t.elapsed();
        // Not before the setup deadline (a busy machine only makes it later).
        assert!(took >= Duration::from_millis(1400), "{took:?}");
        assert!(err.contains("ncclResult 6"), "{err}");
        let warns: Vec<String> = warnings();
        let want = format!("connect to {}: wait for reply", silent.local_addr().unwrap());
        assert!(
            warns.iter().any(|w| w.contains(&want) && w.contains("FERROCE_SETUP_TIMEOUT_MS")),
            "{warns:#?}"
        );
    });
}

/// A send larger than its receive is truncated to the receive's size, as NCCL's transport and
/// the Mellanox plugin do: both ends complete with the receive's size, exactly those bytes
/// land, nothing past them is written, and one WARN per comm names both sizes.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_send_larger_than_the_posted_receive_is_truncated() {
    in_vm(1, &[], |drv, ctx| {
        let (send, recv) = pair(drv, ctx, 1, 0).unwrap();
        let mut src: Vec<u8> = (0..8192).map(|i| (i % 251) as u8 + 1).collect();
        let mut dst = vec![0u8; 8192];
        let smh = drv.reg_mr(send, src.as_mut_ptr(), src.len()).unwrap();
        let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), dst.len()).unwrap();
        take_captured();
        let t = Instant::now();
        for (posted, sent) in [(100, 200), (1000, 8192), (4096, 4096)] {
            let d = dst.as_mut_ptr();
            let rreq =
                until("irecv", || drv.irecv(recv, &[d], &[posted], &[0], &[rmh], false)).unwrap();
            let sreq = until("isend", || drv.isend(send, src.as_mut_ptr(), sent, 0, smh)).unwrap();
            let ss = until("test send", || drv.test(sreq)).unwrap();
            let rs = until("test recv", || drv.test(rreq)).unwrap();
            assert_eq!((ss[0], rs[0]), (posted as i32, posted as i32), "{sent} into {posted}");
            assert_eq!(dst[..posted], src[..posted], "{sent} into {posted}: the bytes");
            assert!(dst[posted..].iter().all(|&b| b == 0), "{sent} into {posted}: written past it");
            dst.fill(0);
        }
        assert!(t.elapsed() < Duration::from_secs(10), "truncation took {:?}", t.elapsed());
        let warns: Vec<String> = warnings();
        assert!(
            warns.len() == 1
                && warns[0].contains("200 bytes")
                && warns[0].contains("receive of 100"),
            "one WARN per comm, naming both sizes: {warns:#?}"
        );
        drv.dereg_mr(send, smh).unwrap();
        drv.dereg_mr(recv, rmh).unwrap();
        drv.close(Close::Send, send).unwrap();
        drv.close(Close::Recv, recv).unwrap();
    });
}

/// QP, CQ and MR counts of rxe0 and rxe1 from `rdma resource show`.
fn rdma_resources() -> String {
    let out = std::process::Command::new("rdma").args(["resource", "show"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let get = |k: &str| f.iter().position(|x| *x == k).map_or("?", |i| f[i + 1]);
            format!(
                "{} qp {} cq {} mr {} pd {}",
                f.get(1).unwrap_or(&"?"),
                get("qp"),
                get("cq"),
                get("mr"),
                get("pd")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_thousand_connect_transfer_close_cycles_leak_nothing() {
    with_plugin(|lib| {
        let drv = Driver::new(lib, 12).unwrap();
        let ctx = drv.init(1).unwrap();
        // Warm up once so lazily created state is counted in the baseline.
        let (s, r) = pair(&drv, ctx, 1, 0).unwrap();
        transfer(&drv, s, r, 10, 0).unwrap();
        drv.close(Close::Send, s).unwrap();
        drv.close(Close::Recv, r).unwrap();
        let before = rdma_resources();
        let t = Instant::now();
        let mut dst = vec![0u8; 4096];
        for cycle in 0..1000u32 {
            let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
            transfer(&drv, send, recv, 1 + (cycle as usize * 97) % 4096, cycle as u8).unwrap();
            if cycle % 3 == 0 {
                // Close with a receive still in flight: it must be torn down too.
                let mh = drv.reg_mr(recv, dst.as_mut_ptr(), dst.len()).unwrap();
                until("irecv", || {
                    drv.irecv(recv, &[dst.as_mut_ptr()], &[4096], &[0], &[mh], false)
                })
                .unwrap();
                drv.close(Close::Recv, recv).unwrap();
                drv.close(Close::Send, send).unwrap();
                drv.dereg_mr(recv, mh).unwrap();
            } else {
                drv.close(Close::Send, send).unwrap();
                drv.close(Close::Recv, recv).unwrap();
            }
        }
        let after = rdma_resources();
        eprintln!(
            "1000 cycles in {:.1} s\n  before: {before}\n  after:  {after}",
            t.elapsed().as_secs_f64()
        );
        assert_eq!(before, after);
        assert!(!before.contains('?'), "could not parse `rdma resource show`: {before}");
        drv.finalize(ctx).unwrap();
        take_captured();
    });
}

/// What a protection domain per comm would cost, for the choice of one per device
/// (`ferroce_core::setup`, "What a peer can reach"): the time to allocate and free a PD, the
/// memory a held PD takes in this process, and the
/// registration every extra comm would repeat for each buffer it could no longer share (an MR
/// belongs to one PD, and NCCL registers a buffer once for every comm on the device:
/// `regIsGlobal`). Prints one line with the numbers.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn pd_cost() {
    use ferroce::verbs::{self, ForeignMem, Mr, Pd};
    let _g = vm_serial();
    let (_, mut ctxs) = verbs::open_all(|n| n == "rxe0").unwrap();
    let ctx = std::sync::Arc::new(ctxs.remove(0).unwrap());
    let _warm = Pd::new(&ctx).unwrap();
    const N: usize = 1000;
    // The kernel files each PD under the thread that made it (libtest runs this test on a
    // thread of its own), and `rdma resource show` calls that id the pid.
    // SAFETY: gettid has no preconditions.
    let pid = unsafe { libc::gettid() } as u32;
    // The kernel's side of a PD is slab memory: the VM's total, quiet but for this test.
    let slab = || {
        let m = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib = m.lines().find_map(|l| l.strip_prefix("Slab:")).unwrap();
        kib.split_whitespace().next().unwrap().parse::<i64>().unwrap() << 10
    };
    let (rss0, slab0, pds0) = (rss_bytes(), slab(), rdma_counts(pid).unwrap().pd);
    let t = Instant::now();
    let pds: Vec<_> = (0..N).map(|_| Pd::new(&ctx).unwrap()).collect();
    let alloc = t.elapsed();
    let (rss1, slab1, pds1) = (rss_bytes(), slab(), rdma_counts(pid).unwrap().pd);
    let t = Instant::now();
    drop(pds);
    let dealloc = t.elapsed();
    let pds2 = rdma_counts(pid).unwrap().pd;
    assert_eq!((pds1 - pds0, pds2), (N, pds0), "the kernel saw each PD come and go");

    // One registration of a buffer the size of NCCL's (4 MiB: NCCL_BUFFSIZE) and a larger one,
    // each in its own PD, pages already touched as NCCL's pinned buffers are.
    let reg_ms = |len: usize| {
        let pd = Pd::new(&ctx).unwrap();
        let mut buf = vec![1u8; len];
        let access = verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE;
        // SAFETY: nothing reads or writes `buf` while the MR lives, and no QP can reach it.
        let mem = unsafe { ForeignMem::new(buf.as_mut_ptr() as u64, len as u64) };
        let t = Instant::now();
        let mr = Mr::register_host(&pd, mem, access).unwrap();
        let took = t.elapsed();
        drop(mr);
        drop(buf);
        took.as_secs_f64() * 1e3
    };
    let (reg4, reg64) = (reg_ms(4 << 20), reg_ms(64 << 20));

    let us = |d: Duration| d.as_secs_f64() * 1e6 / N as f64;
    let bytes_each = rss1.saturating_sub(rss0) as f64 / N as f64;
    eprintln!(
        "pd_cost on rxe0: {N} PDs: ibv_alloc_pd {:.1} us each, ibv_dealloc_pd {:.1} us each, \
         RssAnon +{:.0} bytes each (+{} KiB for {N}), kernel slab {:+.0} bytes each, kernel \
         PD objects +{}; ibv_reg_mr of a 4 MiB buffer {reg4:.2} ms, of 64 MiB {reg64:.2} ms \
         (what each extra PD repeats per buffer)",
        us(alloc),
        us(dealloc),
        bytes_each,
        rss1.saturating_sub(rss0) >> 10,
        (slab1 - slab0) as f64 / N as f64,
        pds1 - pds0
    );
    for v in [us(alloc), us(dealloc), reg4, reg64] {
        assert!(v.is_finite() && v > 0.0, "{v}");
    }
}

/// One message of the profiler test: the receive's buffer sizes (several: a multi-receive),
/// the bytes sent to each, and whether NCCL gives it profiler handles.
struct Profiled {
    posted: Vec<usize>,
    sent: Vec<usize>,
    handles: bool,
    optional: bool,
}

/// The net profiler, in each version that has one (v10, v11, v12): every request NCCL gives a
/// handle is reported, per queue-pair post, exactly once, and stopped exactly once, by the
/// time `test` says it is done; the fields say what was posted (IB descriptor v1: device 0,
/// the QP, RDMA write or write-with-immediate, the request's bytes). Each send chunk the
/// comm's statistics count is one work request reported (the handle-less message aside); a
/// NULL callback reports nothing.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn net_profiler_events_report_every_post_once_in_v10_v11_v12() {
    use ferroce_tools::profiler;
    with_plugin(|lib| {
        set_env(&[("NCCL_DEBUG", Some("INFO"))]); // the send comm's statistics line
        let m = |posted: &[usize], sent: &[usize], handles, optional| Profiled {
            posted: posted.to_vec(),
            sent: sent.to_vec(),
            handles,
            optional,
        };
        let msgs = [
            m(&[64], &[0], true, false),
            m(&[4096], &[1], true, false),
            m(&[8192], &[4096], true, false),
            m(&[100_000, 4096, 300_000], &[70_000, 0, 300_000], true, false),
            m(&[1 << 20], &[1 << 20], true, false),
            m(&[4096], &[4096], false, false),
            m(&[2048], &[2048], true, true),
            m(&[300_000], &[300_000], true, false),
        ];
        const IB_V1: i64 = (1 << 16) | 1;
        for v in [10, 11, 12] {
            let mut drv = Driver::new(lib, v).unwrap();
            drv.profiler = profiler::callback();
            let ctx = drv.init(7).unwrap();
            let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
            profiler::take();
            take_captured();
            let total: usize = msgs.iter().flat_map(|m| m.posted.iter()).sum();
            let mut src: Vec<u8> = (0..total).map(|i| (i % 249) as u8 + 3).collect();
            let mut dst = vec![0u8; total];
            let smh = drv.reg_mr(send, src.as_mut_ptr(), total).unwrap();
            let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), total).unwrap();
            // (phandle, bytes, buffers of its row) of each send; phandles of each receive
            // buffer.
            let mut sends: Vec<(usize, usize, usize)> = Vec::new();
            let mut recvs: Vec<usize> = Vec::new();
            let mut at = 0;
            for (k, msg) in msgs.iter().enumerate() {
                let n = msg.posted.len();
                let ph = |side: usize, r: usize| {
                    if msg.handles { (0x1000 * (side + 1) + 16 * k + r) as Ptr } else { null_mut() }
                };
                let offs: Vec<usize> = msg
                    .posted
                    .iter()
                    .scan(at, |a, &p| Some(std::mem::replace(a, *a + p)))
                    .collect();
                let bufs: Vec<*mut u8> = offs.iter().map(|&o| dst[o..].as_mut_ptr()).collect();
                let rph: Vec<Ptr> = (0..n).map(|r| ph(1, r)).collect();
                let tags: Vec<c_int> = (0..n as c_int).collect();
                let rmhs = vec![rmh; n];
                let rreq = until("irecv", || {
                    drv.irecv_p(recv, &bufs, &msg.posted, &tags, &rmhs, msg.optional, &rph)
                })
                .unwrap();
                let mut sreqs = Vec::new();
                for r in (0..n).rev() {
                    let s = src[offs[r]..].as_mut_ptr();
                    let (size, p) = (msg.sent[r], ph(0, r));
                    sreqs.push(
                        until("isend", || drv.isend_p(send, s, size, r as c_int, smh, p)).unwrap(),
                    );
                    if msg.handles {
                        sends.push((p as usize, size, n));
                    }
                }
                for s in sreqs {
                    until("test send", || drv.test(s)).unwrap();
                }
                let got = until("test recv", || drv.test(rreq)).unwrap();
                if msg.handles {
                    recvs.extend(rph.iter().map(|&p| p as usize));
                }
                // An optional receive too: it completes once its data landed.
                for r in 0..n {
                    assert_eq!(got[r] as usize, msg.sent[r], "v{v} message {k} buffer {r}: size");
                    let (o, len) = (offs[r], msg.sent[r]);
                    assert!(dst[o..o + len] == src[o..o + len], "v{v} message {k}: data");
                }
                // Done means stopped: every event of this message's requests has its one stop.
                let mine = |e: &profiler::Event| (e.phandle & 0xff0) >> 4 == k && msg.handles;
                for e in profiler::snapshot().iter().filter(|e| mine(e)) {
                    assert_eq!(e.stops, 1, "v{v} message {k}: stopped once when done: {e:?}");
                }
                at += msg.posted.iter().sum::<usize>();
            }
            drv.dereg_mr(send, smh).unwrap();
            drv.dereg_mr(recv, rmh).unwrap();
            drv.close(Close::Send, send).unwrap();
            drv.close(Close::Recv, recv).unwrap();
            let (events, misuse) = profiler::take();
            assert!(misuse.is_empty(), "v{v}: callback misused: {misuse:?}");
            for e in &events {
                assert_eq!(
                    (e.plugin_id, e.kind, e.device, e.stops),
                    (IB_V1, 1, 0, 1),
                    "v{v}: {e:?}"
                );
                assert!(e.qpn != 0 && (e.opcode == 0 || e.opcode == 1), "v{v}: {e:?}");
            }
            // Sends: one event per request (2 QPs, whole messages: one chunk each), its bytes; the
            // immediate ends a message whose size it carries (one buffer below 32 MiB, whole, an
            // optional receive's too), else it is all a request without bytes gets.
            for &(ph, size, nreqs) in &sends {
                let mine: Vec<_> = events.iter().filter(|e| e.phandle == ph).collect();
                assert_eq!(mine.len(), 1, "v{v}: send {ph:#x}: {mine:?}");
                let imm = nreqs == 1 && size < 32 << 20 || size == 0;
                assert_eq!(
                    (mine[0].length, mine[0].opcode),
                    (size, i32::from(imm)),
                    "v{v} {ph:#x}"
                );
            }
            // Receives: one event per buffer, the write of its 64-byte CTS entry.
            for &ph in &recvs {
                let mine: Vec<_> = events.iter().filter(|e| e.phandle == ph).collect();
                assert_eq!(mine.len(), 1, "v{v}: receive {ph:#x}: {mine:?}");
                assert_eq!((mine[0].length, mine[0].opcode), (64, 0), "v{v}: receive {ph:#x}");
            }
            assert_eq!(events.len(), sends.len() + recvs.len(), "v{v}: nothing else reported");
            // Each chunk the send comm counted is one work request reported (the message without
            // handles aside): the chunks' (wr_id, QP) pairs.
            let mut posts: Vec<(u64, u32)> =
                events.iter().filter(|e| e.phandle < 0x2000).map(|e| (e.wr_id, e.qpn)).collect();
            posts.sort_unstable();
            posts.dedup();
            let closed = take_captured()
                .into_iter()
                .map(|l| l.2)
                .find(|l| l.contains("send comm to") && l.contains(" closed: "))
                .expect("the send comm's statistics line");
            let chunks: usize = closed
                .split("; QP ")
                .skip(1)
                .map(|q| q.split(" chunks").next().unwrap().rsplit(' ').next().unwrap())
                .map(|n| n.parse::<usize>().unwrap())
                .sum();
            assert_eq!(posts.len() + 1, chunks, "v{v}: every chunk reported once: {closed}");
            drv.finalize(ctx).unwrap();
        }
        // No callback: nothing is reported.
        let drv = Driver::new(lib, 12).unwrap();
        let ctx = drv.init(8).unwrap();
        let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
        transfer(&drv, send, recv, 4096, 1).unwrap();
        drv.close(Close::Send, send).unwrap();
        drv.close(Close::Recv, recv).unwrap();
        drv.finalize(ctx).unwrap();
        let (events, misuse) = profiler::take();
        assert!(events.is_empty() && misuse.is_empty(), "{events:?} {misuse:?}");
    });
}
