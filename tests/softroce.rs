//! Device discovery on real verbs: Soft-RoCE (rxe0 on vethA, rxe1 on vethB) inside the VM that
//! `ci/vm.sh` boots. Every test here is `#[ignore]`d on the host and run in the guest by
//! `ci/vm-tests.sh` with `--ignored`; inside the guest a missing device is a failure, not a skip.

mod common;

use std::ffi::{CStr, CString, c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use common::*;
use ferroce::ffi::abi::*;
use ferroce::ffi::loader::{Library, capture_logger, take_captured};

/// Fails loudly unless this runs inside the test VM.
fn require_vm() {
    assert_eq!(
        std::env::var("FERROCE_IN_VM").as_deref(),
        Ok("1"),
        "this test must run inside the Soft-RoCE VM (ci/vm.sh); it cannot pass elsewhere"
    );
}

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
    require_vm();
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    let (r, ctx, names) = init_with(net, None);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{:?}", take_captured());
    assert_eq!(names, ["rxe0", "rxe1"]);
    finalize(net, ctx);
    // Each device is described once at INFO, with well-formed logging.
    let lines = take_captured();
    for dev in ["rxe0", "rxe1"] {
        let n =
            lines.iter().filter(|l| l.0 == 3 && l.2.contains(&format!(": {dev} port 1"))).count();
        assert_eq!(n, 1, "{dev}: {lines:?}");
    }
    assert!(lines.iter().all(|l| !l.2.starts_with("BAD FORMAT")), "{lines:?}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn properties_pass_the_checks_in_every_version() {
    require_vm();
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    let (r, ctx, _) = init_with(net, None);
    assert_eq!(r, ncclResult_t::ncclSuccess);
    let mut names = std::collections::HashSet::new();
    for dev in 0..2 {
        let mut p = ncclNetProperties_v12_t::default();
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { net.getProperties.unwrap()(dev, &mut p) }, ncclResult_t::ncclSuccess);
        let name = cstr(p.name);
        assert!(names.insert(name.clone()), "duplicate name {name}");
        // pciPath: the realpath of the device's sysfs dir (rxe has no PCI parent).
        let pci = cstr(p.pciPath);
        let want = std::fs::canonicalize(format!("/sys/class/infiniband/{name}")).unwrap();
        let want =
            std::fs::canonicalize(format!("/sys/class/infiniband/{name}/device")).unwrap_or(want);
        assert_eq!(pci, want.to_string_lossy(), "{name}");
        // guid: the sys_image_guid that sysfs shows as xxxx:xxxx:xxxx:xxxx.
        let sys = std::fs::read_to_string(format!("/sys/class/infiniband/{name}/sys_image_guid"))
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
        assert_eq!((cstr(p9.name), p9.guid, p9.maxRecvs, p9.port), (name.clone(), p.guid, 8, 1));
        assert_eq!((p9.vProps.ndevs, p9.vProps.devs[0]), (1, dev));
        assert_eq!((cstr(p8.pciPath), p8.speed, p8.maxComms), (pci.clone(), p.speed, p.maxComms));
        assert_eq!((p8.netDeviceType, p7.netDeviceType), (p.netDeviceType, p.netDeviceType));
        assert_eq!((cstr(p7.name), p7.guid, p7.ptrSupport), (name.clone(), p.guid, p.ptrSupport));
        assert_eq!(
            (cstr(p6.name), cstr(p6.pciPath), p6.speed, p6.maxRecvs),
            (name, pci, p.speed, 8)
        );
    }
    finalize(net, ctx);
    take_captured();
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn nccl_ib_hca_forms_select_what_they_should() {
    require_vm();
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
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
    // Filters that keep nothing fail init with one WARN naming the filter.
    for hca in ["=rxe", "rxe0:2", "^rxe", "mlx5"] {
        take_captured();
        let (r, ctx, _) = init_with(net, Some(hca));
        assert_eq!(r, ncclResult_t::ncclInvalidUsage, "NCCL_IB_HCA={hca}");
        assert!(ctx.is_null());
        let warns: Vec<_> = take_captured().into_iter().filter(|l| l.0 == 2).collect();
        assert_eq!(warns.len(), 1, "{warns:?}");
        assert!(warns[0].2.contains(&format!("filtered out by NCCL_IB_HCA={hca}")), "{warns:?}");
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn legacy_versions_see_the_same_devices() {
    require_vm();
    let _g = serial();
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
fn ten_init_finalize_dlclose_cycles_in_one_process() {
    require_vm();
    let _g = serial();
    for cycle in 0..10 {
        let lib = open_plugin();
        let net = v12(&lib);
        let (r, ctx, names) = init_with(net, None);
        assert_eq!(r, ncclResult_t::ncclSuccess, "cycle {cycle}");
        assert_eq!(names, ["rxe0", "rxe1"], "cycle {cycle}");
        finalize(net, ctx);
        drop(lib); // dlclose
    }
    take_captured();
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
    let ok =
        std::process::Command::new("ip").args(["link", "set", "vethA", state]).status().unwrap();
    assert!(ok.success(), "ip link set vethA {state}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn no_active_port_fails_init_with_the_port_states() {
    require_vm();
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
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
}
