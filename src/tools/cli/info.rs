//! `ferroce info [NAME]`: initialises the plugin through its v12 table, as NCCL would, and
//! describes each device it offers: what `getProperties` says, and the plugin's own account of
//! GPUDirect RDMA as it logged it at init. Called by `main` after `load` checked the tables.

use std::sync::atomic::Ordering;

use ferroce_tools::driver::Driver;
use ferroce_tools::loader::{ECHO, Library, take_captured};

pub fn info(lib: &Library) -> Result<(), String> {
    let drv = Driver::new(lib, 12)?;
    // The log is shown below, filtered: errors and warnings now, each device's GPUDirect line
    // under it.
    ECHO.store(false, Ordering::Relaxed);
    let ctx = drv.init(1);
    let log = take_captured();
    for (level, _, line) in &log {
        if *level <= 2 {
            eprintln!("{}: {line}", if *level == 2 { "WARN" } else { "ERROR" });
        }
    }
    let ctx = ctx?;
    let n = drv.devices()?;
    println!("{n} device(s):");
    for dev in 0..n {
        let p = drv.properties(dev)?;
        let (rail, plane) = p.rail_plane.unwrap_or_default();
        println!(
            "  [{dev}] {} port {}: {} Mbps, guid {:#018x}, maxComms {}, maxRecvs {}, ptrSupport {:#x}, \
             latency {} us, maxP2pBytes {}, rail {rail} plane {plane}, pciPath {}",
            p.name,
            p.port,
            p.speed,
            p.guid,
            p.max_comms,
            p.max_recvs,
            p.ptr_support,
            p.latency,
            p.max_p2p_bytes.unwrap_or_default(),
            p.pci_path.as_deref().unwrap_or("(null)")
        );
        let tag = format!("device {dev}: {} GPUDirect RDMA", p.name);
        if let Some((_, _, line)) = log.iter().find(|l| l.2.contains(&tag)) {
            println!("      {}", &line[line.find("GPUDirect").unwrap_or(0)..]);
        }
    }
    drv.finalize(ctx)
}
