//! The few OS calls std does not offer: a non-blocking TCP connect, a zero-timeout writability
//! check, the addresses of the network interfaces, `getrandom`, the page size, the coarse
//! clock, and the locked-memory limit.
//!
//! The bottom layer beside `verbs`: it imports nothing of ferroce, and its `unsafe` stays inside
//! each call (no pointer outlives one). Callers: `transport` (connection setup, init, clocks),
//! `verbs` (the memlock hint of a failed registration), `ffi` (random connect ids).

#![allow(unsafe_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};

/// Starts a TCP connection without waiting for it; see [`connected`].
pub fn connect_nonblocking(addr: SocketAddr) -> io::Result<TcpStream> {
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own; TcpStream closes it on drop.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (storage, len) = sockaddr(addr);
    // SAFETY: storage holds a valid sockaddr of `len` bytes.
    let rc = unsafe { libc::connect(fd, (&raw const storage).cast(), len) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    Ok(stream)
}

/// Whether a connection started by [`connect_nonblocking`] is established, waiting up to
/// `wait` for it (`Ok(false)`: not yet). A refused or failed connection is an error.
pub fn connected(stream: &TcpStream, wait: std::time::Duration) -> io::Result<bool> {
    let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    let ms = wait.as_millis().min(1000) as libc::c_int;
    // SAFETY: one valid pollfd, a bounded timeout.
    let rc = unsafe { libc::poll(&mut p, 1, ms) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if rc == 0 {
        return Ok(false);
    }
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    Ok(p.revents & libc::POLLOUT != 0)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut s).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as u16,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut s).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (s, len as libc::socklen_t)
}

/// Every (interface name, address) pair of the host, from `getifaddrs`.
pub fn interface_addrs() -> io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-NULL and its family says which sockaddr it is.
        let ip = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()))
            }
            libc::AF_INET6 => {
                // SAFETY: AF_INET6 addresses are sockaddr_in6.
                let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// 64 random bits from the kernel (`getrandom`), for connection nonces.
pub fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: b is writable for 8 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(b))
}

/// The system page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

/// `CLOCK_MONOTONIC_COARSE`: the time of the last scheduler tick, read from the vDSO without
/// touching the clock source (which under emulation can cost microseconds per read).
pub fn coarse_now() -> std::time::Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec; this clock exists on every Linux since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The precise monotonic clock: for path-aware placement, read once per post and per batch
/// of completions (it may cost microseconds in a VM with no stable TSC).
pub fn precise_now() -> std::time::Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited (or unreadable).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return None;
    }
    (r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Below this, registering NCCL's buffers is likely to fail.
pub const MEMLOCK_MIN: u64 = 64 << 20;

/// What to do about a locked-memory limit: the text every memlock message ends with.
pub fn memlock_hint(limit: Option<u64>) -> String {
    let now = match limit {
        None => "unlimited".to_string(),
        Some(b) => format!("{} KiB", b / 1024),
    };
    format!(
        "RLIMIT_MEMLOCK is {now}; RDMA registration pins memory against it: raise it with \
         `ulimit -l unlimited` (or /etc/security/limits.conf), in a container with \
         `--ulimit memlock=-1` (docker) or the runtime's equivalent, under systemd with \
         LimitMEMLOCK=infinity"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memlock_hint_names_the_value_and_the_fixes() {
        let h = memlock_hint(Some(64 << 10));
        for want in ["RLIMIT_MEMLOCK is 64 KiB", "ulimit -l", "--ulimit memlock=-1", "LimitMEMLOCK"]
        {
            assert!(h.contains(want), "{want}: {h}");
        }
        assert!(memlock_hint(None).contains("unlimited"));
        assert_eq!(MEMLOCK_MIN, 64 << 20);
    }
}
