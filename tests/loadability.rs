//! The plugin loads the way NCCL loads it, exports exactly the ABI symbols, and fails `init`
//! cleanly (one WARN that says why, no crash) when it cannot run. Runs on any host.

mod common;

use std::ffi::{CStr, c_int, c_void};
use std::process::Command;
use std::ptr::null_mut;

use common::*;
use ferroce::ffi::VERSIONS;
use ferroce::ffi::abi::*;
use ferroce_tools::driver::Driver;
use ferroce_tools::loader::{Library, capture_logger, take_captured};

/// The plugin's v12 table, which the tests below call directly.
fn v12(lib: &Library) -> &ncclNet_v12_t {
    // SAFETY: the symbol is an ncclNet_v12_t.
    unsafe { lib.table::<ncclNet_v12_t>(c"ncclNetPlugin_v12") }.unwrap()
}

/// The serial lock and the plugin, on a host without RDMA devices; `None` (saying so) on one
/// with them, where the no-device path is left to the unit tests.
fn without_devices() -> Option<(std::sync::MutexGuard<'static, ()>, Library)> {
    let devices = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count() > 0);
    if devices.unwrap_or(false) {
        eprintln!("this host has RDMA devices; the no-device path is covered by unit tests");
        return None;
    }
    Some((serial(), open_plugin()))
}

#[test]
fn exported_dynamic_symbols_are_exactly_the_listed_tables() {
    let lib = plugin_dir().join("libnccl-net-ferroce.so");
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output().expect("run nm");
    assert!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect();
    names.sort();
    let mut want: Vec<String> = VERSIONS.iter().map(|v| format!("ncclNetPlugin_v{v}")).collect();
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn soname_is_the_name_nccl_looks_for() {
    let lib = plugin_dir().join("libnccl-net-ferroce.so");
    let out = Command::new("readelf").arg("-d").arg(&lib).output().expect("run readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libnccl-net-ferroce.so]"), "{text}");
}

#[test]
fn nccl_net_plugin_name_resolves_through_ld_library_path() {
    // NCCL_NET_PLUGIN=ferroce: dlopen("ferroce") fails, then dlopen("libnccl-net-ferroce.so")
    // succeeds through LD_LIBRARY_PATH. A child process, because the loader reads
    // LD_LIBRARY_PATH only at start-up.
    let out = Command::new(common::ferroce_exe())
        .args(["load", "ferroce"])
        .env("LD_LIBRARY_PATH", plugin_dir())
        .output()
        .expect("run ferroce load");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("as libnccl-net-ferroce.so"), "{stdout}");
    for v in VERSIONS {
        assert!(stdout.contains(&format!("ncclNetPlugin_v{v} name=\"ferroce\"")), "{stdout}");
    }
}

#[test]
fn a_missing_plugin_is_reported_not_crashed() {
    let out = Command::new(common::ferroce_exe())
        .args(["load", "ferroce"])
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .expect("run ferroce load");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("libnccl-net-ferroce.so"), "{stderr}");
}

/// Every line the plugin logged used the fixed "%s" format (the capture logger flags others).
fn assert_well_formed(lines: &[(i32, u64, String)]) {
    for (_, flags, msg) in lines {
        assert!(!msg.starts_with("BAD FORMAT"), "{msg}");
        assert!(msg.starts_with("NET/ferroce: "), "{msg}");
        assert_ne!(flags & u64::from(NCCL_NET), 0, "not under NET: {msg}");
    }
}

fn warns(lines: &[(i32, u64, String)]) -> Vec<String> {
    lines.iter().filter(|l| l.0 == 2).map(|l| l.2.clone()).collect()
}

#[test]
fn init_without_devices_fails_with_one_warn_saying_why() {
    let Some((_g, lib)) = without_devices() else { return };
    let net = v12(&lib);
    take_captured();
    let mut ctx: *mut c_void = std::ptr::dangling_mut::<c_void>(); // must be reset to NULL
    let mut cfg = ncclNetCommConfig_v10_t { trafficClass: -1 };
    // SAFETY: valid pointers per the ABI.
    let r = unsafe { net.init.unwrap()(&mut ctx, 7, &mut cfg, capture_logger(), None) };
    assert_eq!(r, ncclResult_t::ncclInvalidUsage);
    assert!(ctx.is_null(), "ctx must be NULL after a failed init");
    let lines = take_captured();
    assert_well_formed(&lines);
    let w = warns(&lines);
    assert_eq!(w.len(), 1, "{lines:?}");
    assert!(w[0].contains("init") && w[0].contains("no RDMA devices"), "{}", w[0]);
}

/// Lines NCCL shows at `NCCL_DEBUG=INFO`: WARN and INFO (and VERSION, ABORT), not TRACE.
fn shown_at_info(lines: &[(i32, u64, String)]) -> Vec<String> {
    let trace = ncclDebugLogLevel::NCCL_LOG_TRACE.0 as i32;
    lines.iter().filter(|l| l.0 < trace).map(|l| l.2.clone()).collect()
}

/// NCCL's sequence on a host with no RDMA device, through every version's table: `init` fails
/// with one WARN saying why, in at most 8 lines at INFO; then NCCL calls `finalize` with the NULL
/// context (v11+), which succeeds and logs nothing above TRACE.
#[test]
fn every_versions_init_fails_the_same_way_without_devices_and_finalize_null_is_quiet() {
    let Some((_g, lib)) = without_devices() else { return };
    for &v in VERSIONS {
        let driver = Driver::new(&lib, v).unwrap();
        take_captured();
        let (r, ctx) = driver.init_raw(7, -1).unwrap();
        assert_eq!(r, ncclResult_t::ncclInvalidUsage, "v{v}");
        assert!(ctx.is_null(), "v{v}");
        let lines = take_captured();
        assert_well_formed(&lines);
        assert_eq!(warns(&lines).len(), 1, "v{v}: {lines:?}");
        let info = shown_at_info(&lines);
        assert!(info.len() <= 8, "v{v}: {} lines at INFO without a device: {info:#?}", info.len());
        assert_eq!(driver.finalize(ctx), Ok(()), "v{v}: finalize(NULL) after a failed init");
        let after = take_captured();
        assert!(shown_at_info(&after).is_empty(), "v{v}: finalize(NULL) logged {after:?}");
    }
}

#[test]
fn a_malformed_knob_fails_init_and_names_the_knob() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    // SAFETY: tests touching the environment hold the SERIAL lock.
    unsafe { std::env::set_var("NCCL_IB_HCA", "rxe0:notaport") };
    take_captured();
    let mut ctx: *mut c_void = null_mut();
    // SAFETY: valid pointers per the ABI.
    let r = unsafe { net.init.unwrap()(&mut ctx, 1, null_mut(), capture_logger(), None) };
    // SAFETY: as above.
    unsafe { std::env::remove_var("NCCL_IB_HCA") };
    assert_eq!(r, ncclResult_t::ncclInvalidUsage);
    assert!(ctx.is_null());
    let w = warns(&take_captured());
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("NCCL_IB_HCA") && w[0].contains("notaport"), "{}", w[0]);
}

#[test]
fn calls_before_init_and_null_pointers_are_errors_not_crashes() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    let mut n: c_int = -5;
    // SAFETY: deliberately called before init / with NULL, which the ABI must survive.
    unsafe {
        assert_eq!(net.devices.unwrap()(&mut n), ncclResult_t::ncclInternalError);
        assert_eq!(n, -5, "no output on failure");
        assert_eq!(net.devices.unwrap()(null_mut()), ncclResult_t::ncclInternalError);
        let mut p = ncclNetProperties_v12_t::default();
        assert_eq!(net.getProperties.unwrap()(0, &mut p), ncclResult_t::ncclInternalError);
        assert_eq!(net.getProperties.unwrap()(0, null_mut()), ncclResult_t::ncclInternalError);
        // finalize(NULL) is what NCCL calls after a failed init: nothing to end.
        assert_eq!(net.finalize.unwrap()(null_mut()), ncclResult_t::ncclSuccess);
        // A NULL ctx slot is refused before any device is opened (so no context is made that
        // NCCL could never finalize).
        assert_eq!(
            net.init.unwrap()(null_mut(), 1, null_mut(), capture_logger(), None),
            ncclResult_t::ncclInternalError
        );
    }
    take_captured();
}

#[test]
fn unimplemented_calls_report_an_error_and_clear_their_outputs() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    let stale = std::ptr::dangling_mut::<c_void>();
    let mut handle = [0u8; 128];
    let (mut a, mut b, mut c, mut d) = (stale, stale, stale, stale);
    // SAFETY: valid out-pointers; the plugin must not touch the others.
    unsafe {
        let h = handle.as_mut_ptr().cast();
        assert_ne!(net.listen.unwrap()(null_mut(), 0, h, &mut a), ncclResult_t::ncclSuccess);
        assert_ne!(
            net.connect.unwrap()(null_mut(), 0, h, &mut b, null_mut()),
            ncclResult_t::ncclSuccess
        );
        assert_ne!(net.accept.unwrap()(null_mut(), &mut c, null_mut()), ncclResult_t::ncclSuccess);
        let dmabuf = net.regMrDmaBuf.unwrap()(null_mut(), null_mut(), 4096, 2, 0, -1, &mut d);
        assert_ne!(dmabuf, ncclResult_t::ncclSuccess);
    }
    assert!(a.is_null() && b.is_null() && c.is_null() && d.is_null());
    // The members the ABI lets a host plugin leave NULL are NULL; makeVDevice (NIC fusion) is
    // there, and before init it is an error that leaves its output alone.
    assert!(net.irecvConsumed.is_none() && net.getDeviceMr.is_none());
    assert!(net.setNetAttr.is_none());
    let mut vdev = -7;
    let mut props = ncclNetVDeviceProps_v12_t { ndevs: 2, ..Default::default() };
    // SAFETY: valid pointers per the makeVDevice contract.
    let r = unsafe { net.makeVDevice.expect("makeVDevice")(&mut vdev, &mut props) };
    assert!(r != ncclResult_t::ncclSuccess && vdev == -7);
    // SAFETY: name is a static C string.
    assert_eq!(unsafe { CStr::from_ptr(net.name) }, c"ferroce");
    take_captured();
}

/// Installs the capturing logger (`init` does that first, even when it then fails: here on a
/// NULL ctx slot) and empties the capture.
fn install_logger(net: &ncclNet_v12_t) {
    // SAFETY: init with a NULL ctx slot fails cleanly after installing the logger.
    let r = unsafe { net.init.unwrap()(null_mut(), 1, null_mut(), capture_logger(), None) };
    assert_ne!(r, ncclResult_t::ncclSuccess);
    take_captured();
}

#[test]
fn pointers_the_plugin_never_handed_out_are_errors_that_touch_nothing() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    // Memory the plugin must neither read as an object nor free.
    let mut foreign = [0x5au8; 256];
    let p: *mut c_void = foreign.as_mut_ptr().cast();
    install_logger(net);
    // SAFETY: deliberately misused; the register refuses pointers it does not hold.
    unsafe {
        assert_eq!(net.closeSend.unwrap()(p), ncclResult_t::ncclInternalError);
        assert_eq!(net.closeRecv.unwrap()(p), ncclResult_t::ncclInternalError);
        assert_eq!(net.closeListen.unwrap()(p), ncclResult_t::ncclInternalError);
        assert_eq!(net.deregMr.unwrap()(null_mut(), p), ncclResult_t::ncclInternalError);
        assert_eq!(net.closeSend.unwrap()(null_mut()), ncclResult_t::ncclInternalError);
    }
    assert!(foreign.iter().all(|&b| b == 0x5a), "the plugin wrote to memory it does not own");
    let w = warns(&take_captured());
    assert_eq!(w.len(), 5, "{w:?}");
    assert!(w[..4].iter().all(|l| l.contains("not open")), "{w:?}");
}

#[test]
fn a_connect_id_the_plugin_does_not_know_is_an_error_not_a_new_connect() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    // A well-formed handle whose state bytes name a connect that does not exist (finished,
    // expired, pushed out or ended by finalize, as far as the plugin can tell).
    let h = ferroce_core::setup::wire::Handle {
        addr: "127.0.0.1:9".parse().unwrap(),
        nonce: 0x1234_5678,
        members: 1,
    };
    let mut handle = [0u8; 128];
    h.encode(&mut handle);
    let state = ferroce_core::setup::wire::HANDLE_STATE_OFFSET;
    handle[state..state + 8].copy_from_slice(&0x0bad_c0de_u64.to_le_bytes());
    let mut comm = std::ptr::dangling_mut::<c_void>();
    install_logger(net);
    // SAFETY: valid pointers; ctx is NULL, which a new connect would have to use (and fail on).
    let r = unsafe {
        net.connect.unwrap()(null_mut(), 0, handle.as_mut_ptr().cast(), &mut comm, null_mut())
    };
    assert_eq!(r, ncclResult_t::ncclInternalError);
    assert!(comm.is_null());
    assert!(handle[state..].iter().all(|&b| b == 0), "the stale id is cleared");
    let w = warns(&take_captured());
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("no connect in progress under id 0x000000000badc0de"), "{}", w[0]);
}

#[test]
fn after_a_failed_init_finalize_succeeds_every_call_is_a_clean_error_and_init_can_be_retried() {
    let _g = serial();
    let lib = open_plugin();
    let net = v12(&lib);
    for _ in 0..2 {
        // SAFETY: tests touching the environment hold the SERIAL lock.
        unsafe { std::env::set_var("NCCL_IB_HCA", "rxe0:notaport") };
        let mut ctx: *mut c_void = std::ptr::dangling_mut::<c_void>();
        let mut n: c_int = -5;
        // SAFETY: valid pointers per the ABI; finalize and devices with no context alive.
        unsafe {
            let r = net.init.unwrap()(&mut ctx, 1, null_mut(), capture_logger(), None);
            std::env::remove_var("NCCL_IB_HCA");
            assert_eq!(r, ncclResult_t::ncclInvalidUsage);
            assert!(ctx.is_null());
            assert_eq!(net.finalize.unwrap()(ctx), ncclResult_t::ncclSuccess);
            assert_eq!(net.devices.unwrap()(&mut n), ncclResult_t::ncclInternalError);
        }
        assert_eq!(n, -5);
        take_captured();
    }
}
