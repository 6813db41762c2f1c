//! The few system calls the tools make beyond what `std` offers: the memlock limit `ferroce
//! doctor` reports, and the polite end of a child (SIGTERM, which `timeout` forwards) for
//! perftest's runs under `ferroce perf` and the tests' helpers; and what a process holds (its
//! RDMA resources, memory and fds) for `ferroce connections` and the tests' census.

use std::process::Child;

/// `RLIMIT_MEMLOCK` as (soft, hard) in bytes, `None` meaning unlimited; `None` for both
/// numbers' pair when the call fails.
pub fn memlock() -> Option<(Option<u64>, Option<u64>)> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-pointer for getrlimit.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0;
    let lim = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    ok.then(|| (lim(r.rlim_cur), lim(r.rlim_max)))
}

/// Sends `sig` to `child` unless it has exited already (a reaped child's pid may be another
/// process's by now).
pub fn signal(child: &mut Child, sig: libc::c_int) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: kill(2) of our own child, not yet reaped, so the pid is still its.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    }
}

/// Ends `child` with SIGTERM and reaps it.
pub fn terminate(child: &mut Child) {
    signal(child, libc::SIGTERM);
    let _ = child.wait();
}

/// The QPs, CQs, MRs and PDs that process `pid` holds on the RDMA devices (the entries of
/// `rdma resource show qp|cq|mr|pd` owned by it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdmaCounts {
    pub qp: usize,
    pub cq: usize,
    pub mr: usize,
    pub pd: usize,
}

impl std::fmt::Display for RdmaCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "qp {} cq {} mr {} pd {}", self.qp, self.cq, self.mr, self.pd)
    }
}

/// The [`RdmaCounts`] of process `pid`, from `rdma resource show` (iproute2's `rdma`).
pub fn rdma_counts(pid: u32) -> Result<RdmaCounts, String> {
    let owned = |kind: &str| -> Result<usize, String> {
        let out = std::process::Command::new("rdma")
            .args(["resource", "show", kind])
            .output()
            .map_err(|e| format!("rdma resource show {kind}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "rdma resource show {kind}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let want = pid.to_string();
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w.windows(2).any(|p| p[0] == "pid" && p[1] == want)
            })
            .count())
    };
    Ok(RdmaCounts { qp: owned("qp")?, cq: owned("cq")?, mr: owned("mr")?, pd: owned("pd")? })
}

/// Process `pid`'s resident memory and pinned memory (`VmRSS`, `VmPin` of `/proc/PID/status`)
/// in bytes, and its open file descriptors. Resident memory includes the queues a provider maps
/// in from the kernel (Soft-RoCE's).
pub fn memory_fds(pid: u32) -> Result<(u64, u64, usize), String> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let kib = |field: &str| -> Result<u64, String> {
        let v = status.lines().find_map(|l| l.strip_prefix(field));
        let v = v.and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
        v.map(|k| k << 10).ok_or_else(|| format!("{path} has no {field}"))
    };
    let fds =
        std::fs::read_dir(format!("/proc/{pid}/fd")).map_err(|e| format!("fds of {pid}: {e}"))?;
    Ok((kib("VmRSS:")?, kib("VmPin:")?, fds.count()))
}
