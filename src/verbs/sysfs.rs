//! Facts about an RDMA device that only sysfs (`/sys/class/infiniband/<dev>`) holds.
//!
//! Everything here is best-effort: a missing or unreadable entry is `None`, never an error,
//! because virtual devices such as rxe lack some of them.

use std::path::{Path, PathBuf};

const CLASS: &str = "/sys/class/infiniband";

/// Where sysfs is mounted; the functions that take a root are given this outside tests.
pub const ROOT: &str = "/sys";

/// The realpath of `<root>/class/infiniband/<dev>/device`: the device's PCI function, the path
/// NCCL reads. `None` for a device without a parent (rxe, siw).
pub fn pci_function(root: &Path, dev: &str) -> Option<PathBuf> {
    std::fs::canonicalize(root.join("class/infiniband").join(dev).join("device")).ok()
}

/// The realpath of the device's own directory, `<root>/class/infiniband/<dev>`.
pub fn device_dir(root: &Path, dev: &str) -> Option<PathBuf> {
    std::fs::canonicalize(root.join("class/infiniband").join(dev)).ok()
}

/// The network interfaces behind a port's GID entry, e.g. `vethA` (RoCE only).
pub fn gid_netdev(dev: &str, port: u8, index: i32) -> Option<String> {
    read_trimmed(&format!("{CLASS}/{dev}/ports/{port}/gid_attrs/ndevs/{index}"))
}

/// The GID type string of an entry, e.g. `RoCE v2` or `IB/RoCE v1`.
pub fn gid_type(dev: &str, port: u8, index: i32) -> Option<String> {
    read_trimmed(&format!("{CLASS}/{dev}/ports/{port}/gid_attrs/types/{index}"))
}

fn read_trimmed(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// A port's hardware counters (`ports/<port>/hw_counters/*`) by name, sorted; empty where the
/// driver has none. `lifespan` is a setting, not a counter, and is left out.
pub fn hw_counters(dev: &str, port: u8) -> Vec<(String, u64)> {
    let dir = format!("{CLASS}/{dev}/ports/{port}/hw_counters");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut out: Vec<(String, u64)> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let value = read_trimmed(&format!("{dir}/{name}"))?.parse().ok()?;
            (name != "lifespan").then_some((name, value))
        })
        .collect();
    out.sort();
    out
}
