//! The few system calls the tools make beyond what `std` offers: the memlock limit `ferroce
//! doctor` reports, and the polite end of a child (SIGTERM, which `timeout` forwards) for
//! perftest's runs under `ferroce perf` and the tests' helpers.

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
