//! Facts about an RDMA device that only sysfs (`/sys/class/infiniband/<dev>`) holds.
//!
//! Everything here is best-effort: a missing or unreadable entry is `None`, never an error,
//! because virtual devices such as rxe lack some of them.

use std::path::{Path, PathBuf};

const CLASS: &str = "/sys/class/infiniband";

/// The realpath of the device's parent (its PCI function), or of the device's own sysfs
/// directory when it has no parent (rxe, siw). `None` if neither resolves.
pub fn device_path(dev: &str) -> Option<PathBuf> {
    let base = Path::new(CLASS).join(dev);
    std::fs::canonicalize(base.join("device")).or_else(|_| std::fs::canonicalize(&base)).ok()
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
