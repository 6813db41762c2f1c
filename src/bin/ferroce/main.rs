//! `ferroce`: user-facing checks of the plugin, run through its C ABI exactly as NCCL uses it.
//!
//! - `ferroce load [NAME]`: opens the plugin the way `NCCL_NET_PLUGIN=NAME` does (default
//!   `ferroce`, so `libnccl-net-ferroce.so` on `LD_LIBRARY_PATH`) and checks every exported
//!   table `ncclNetPlugin_v6` … `_v12`.
//! - `ferroce info [NAME]`: also initialises it and describes each device NCCL would see.
//! - `ferroce perf [--plugin NAME_OR_PATH] [--rounds N] [--seconds S] [--json] [--no-perftest]
//!   [--dev-send D] [--dev-recv D]`: the benchmark on one host (two rank processes through the
//!   plugin, then perftest on the same devices, rounds of both, and the ratio). It runs its
//!   ranks as `ferroce perf-rank ...`, which is not meant to be run by hand.
//! - `ferroce perf --listen [--dev D] [--port P]` and `ferroce perf --connect HOST:PORT
//!   [--dev D] ...`: the same benchmark between two hosts; the listening side receives and
//!   prints `HANDLE HOST:PORT DEVICE`, the connecting side sends and prints the tables. The
//!   listening side is also the peer of `ferroce doctor --peer`.
//! - `ferroce doctor [--dev NAME] [--json] [--selftest] [--peer HOST:PORT] [--plugin
//!   NAME_OR_PATH]`: explains this host's RoCE set-up (ports, MTUs, GIDs and the plugin's
//!   choice, congestion control, counters, memlock, GPUDirect, knobs, advice), one screen per
//!   device; with `--peer`, the other end's port beside ours and a transfer to it; exit status 1
//!   names each blocking problem.
//! - `ferroce collective allreduce|allgather|reducescatter [OPTIONS]`: ring collectives over
//!   the plugin between N rank processes (started here, or one per host with `--rank` and a
//!   shared `--rendezvous` directory), with nccl-tests' table.
//! - `ferroce core-bench [MESSAGES] [normal|optional]`: the protocol core's cost per message on
//!   this host.
//!
//! Exit status 0 on success, 1 on any failure (with the reason on stderr).

use std::ffi::{CStr, CString, c_void};
use std::process::ExitCode;

use crate::harness::loader::{Library, capture_logger};
use ferroce::ffi::abi::*;

// The harness serves the tests as well; this binary uses part of it.
#[allow(dead_code)]
#[path = "../../harness/mod.rs"]
mod harness;

mod collective;
mod corebench;
mod doctor;
mod perf;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.get(1).map_or("ferroce", String::as_str);
    let result = match args.first().map(String::as_str) {
        Some("load") => load(name).map(|_| ()),
        Some("info") => info(name),
        Some("perf") => perf::perf(&args[1..], doctor::port_facts),
        Some("perf-rank") => perf::rank(&args[1..], doctor::port_facts),
        Some("doctor") => doctor::doctor(&args[1..]),
        Some("collective") => collective::collective(&args[1..]),
        Some("core-bench") => corebench::core_bench(&args[1..]),
        _ => Err(format!(
            "usage: ferroce load [NAME] | ferroce info [NAME] | \
             ferroce core-bench [MESSAGES] [normal|optional]\n{}\nusage: {}\n{}",
            perf::USAGE,
            doctor::USAGE,
            collective::USAGE
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load(name: &str) -> Result<Library, String> {
    let lib = Library::open_like_nccl(name)?;
    println!("loaded {name:?} as {}", lib.opened_as);
    for v in (6..=12).rev() {
        let sym = CString::new(format!("ncclNetPlugin_v{v}")).expect("no NUL");
        // SAFETY: every version's table starts with `const char* name`; only that is read.
        let table = unsafe { lib.table::<*const std::ffi::c_char>(&sym) }
            .ok_or_else(|| format!("{} lacks {}", lib.opened_as, sym.to_string_lossy()))?;
        // SAFETY: the name member points to a static NUL-terminated string.
        let n = unsafe { CStr::from_ptr(*table) }.to_string_lossy();
        if n != "ferroce" {
            return Err(format!("{} has name {n:?}", sym.to_string_lossy()));
        }
        println!("  {} name={n:?}", sym.to_string_lossy());
    }
    Ok(lib)
}

fn check(what: &str, r: ncclResult_t) -> Result<(), String> {
    if r == ncclResult_t::ncclSuccess { Ok(()) } else { Err(format!("{what} returned {}", r.0)) }
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        "(null)".into()
    } else {
        // SAFETY: the plugin returns NUL-terminated strings that outlive this call.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn info(name: &str) -> Result<(), String> {
    let lib = load(name)?;
    // SAFETY: ncclNetPlugin_v12 is an ncclNet_v12_t; `net` is not used after `lib` drops.
    let net = unsafe { lib.table::<ncclNet_v12_t>(c"ncclNetPlugin_v12") }.ok_or("no v12")?;
    crate::harness::loader::ECHO.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let mut config = ncclNetCommConfig_v10_t { trafficClass: -1 };
    // SAFETY: valid out-pointers; the ABI's init contract.
    let r = unsafe { net.init.ok_or("no init")?(&mut ctx, 1, &mut config, capture_logger(), None) };
    let log = crate::harness::loader::take_captured();
    for (level, _, line) in &log {
        if *level <= 2 {
            eprintln!("{}: {line}", if *level == 2 { "WARN" } else { "ERROR" });
        }
    }
    check("init", r)?;
    let mut n = 0;
    // SAFETY: valid out-pointer.
    check("devices", unsafe { net.devices.ok_or("no devices")?(&mut n) })?;
    println!("{n} device(s):");
    for dev in 0..n {
        let mut p = ncclNetProperties_v12_t::default();
        // SAFETY: valid out-pointer.
        check("getProperties", unsafe {
            net.getProperties.ok_or("no getProperties")?(dev, &mut p)
        })?;
        println!(
            "  [{dev}] {} port {}: {} Mbps, guid {:#018x}, maxComms {}, maxRecvs {}, ptrSupport {:#x}, \
             latency {} us, maxP2pBytes {}, rail {} plane {}, pciPath {}",
            cstr(p.name),
            p.port,
            p.speed,
            p.guid,
            p.maxComms,
            p.maxRecvs,
            p.ptrSupport,
            p.latency,
            p.maxP2pBytes,
            p.railId,
            p.planeId,
            cstr(p.pciPath)
        );
        // The plugin's own account of GPUDirect RDMA for this device, as logged at init.
        let tag = format!("device {dev}: {} GPUDirect RDMA", cstr(p.name));
        if let Some((_, _, line)) = log.iter().find(|l| l.2.contains(&tag)) {
            println!("      {}", &line[line.find("GPUDirect").unwrap_or(0)..]);
        }
    }
    // SAFETY: ctx came from init and is finalized once.
    check("finalize", unsafe { net.finalize.ok_or("no finalize")?(ctx) })
}
