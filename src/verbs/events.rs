//! Asynchronous device events (`ibv_get_async_event`), read without blocking forever: the
//! async fds are made non-blocking and waited on with `poll` and a timeout, so the thread that
//! reads them can be stopped and joined.

use std::mem::MaybeUninit;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};

/// The events callers act on; everything else is `Other` with its `ibv_event_type`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    GidChange(u8),
    PortActive(u8),
    PortError(u8),
    DeviceFatal,
    /// An error on one queue pair (`QP_FATAL`, `QP_REQ_ERR` or `QP_ACCESS_ERR`): its number.
    QpError {
        qpn: u32,
        what: &'static str,
    },
    /// `CQ_ERR` on the completion queue with this [`super::Cq::id`].
    CqError {
        cq: usize,
    },
    /// The async fd itself failed (POLLERR, POLLHUP, POLLNVAL, or a read error other than
    /// "no event"): the device is gone or unusable, and the fd is no longer read.
    Broken(String),
    Other(u32),
}

const IBV_EVENT_CQ_ERR: u32 = 0;
const IBV_EVENT_QP_FATAL: u32 = 1;
const IBV_EVENT_QP_REQ_ERR: u32 = 2;
const IBV_EVENT_QP_ACCESS_ERR: u32 = 3;
const IBV_EVENT_DEVICE_FATAL: u32 = 8;
const IBV_EVENT_PORT_ACTIVE: u32 = 9;
const IBV_EVENT_PORT_ERR: u32 = 10;
const IBV_EVENT_GID_CHANGE: u32 = 18;

impl Context {
    /// Makes the async event fd non-blocking (once, before [`wait_async`]).
    pub fn async_nonblocking(&self) -> Result<()> {
        // SAFETY: raw is an open context; async_fd is its event file descriptor.
        let fd = unsafe { (*self.raw()).async_fd };
        // SAFETY: fcntl on a descriptor we do not close.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::verbs("fcntl(async_fd)", errno(), self.name()));
        }
        Ok(())
    }

    fn async_fd(&self) -> i32 {
        // SAFETY: raw is an open context.
        unsafe { (*self.raw()).async_fd }
    }

    /// Reads one pending event and acknowledges it: `Ok(None)` when there is none, `Err` with
    /// the errno when the fd cannot be read.
    fn read_event(&self) -> std::result::Result<Option<AsyncEvent>, i32> {
        let mut ev = MaybeUninit::<sys::ibv_async_event>::zeroed();
        // SAFETY: raw is open; ev is writable; the fd is non-blocking.
        if unsafe { sys::ibv_get_async_event(self.raw(), ev.as_mut_ptr()) } != 0 {
            let e = errno();
            return if e == libc::EAGAIN || e == libc::EINTR { Ok(None) } else { Err(e) };
        }
        // The type is read as a plain u32 (offset 8): a value the binding's enum does not know
        // must not become an invalid enum. The element (offset 0) is the port number, or the
        // QP or CQ pointer, per the type.
        // SAFETY: ev was filled by ibv_get_async_event; the layout is union (8 bytes) + enum.
        let (kind, element) = unsafe {
            let p = ev.as_ptr().cast::<u8>();
            (p.add(8).cast::<u32>().read(), p.cast::<usize>().read())
        };
        let port = u8::try_from(element as u32 as i32).unwrap_or(0);
        let qp_error = |what| {
            let qp = element as *const sys::ibv_qp;
            // SAFETY: for QP events the element is the QP, which cannot be destroyed before
            // this event is acknowledged (ibv_destroy_qp waits for its events' acks).
            let qpn = unsafe { qp.as_ref() }.map_or(0, |q| q.qp_num);
            AsyncEvent::QpError { qpn, what }
        };
        let event = match kind {
            IBV_EVENT_GID_CHANGE => AsyncEvent::GidChange(port),
            IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive(port),
            IBV_EVENT_PORT_ERR => AsyncEvent::PortError(port),
            IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
            IBV_EVENT_QP_FATAL => qp_error("QP_FATAL"),
            IBV_EVENT_QP_REQ_ERR => qp_error("QP_REQ_ERR"),
            IBV_EVENT_QP_ACCESS_ERR => qp_error("QP_ACCESS_ERR"),
            IBV_EVENT_CQ_ERR => AsyncEvent::CqError { cq: element },
            other => AsyncEvent::Other(other),
        };
        // SAFETY: every event returned must be acknowledged exactly once.
        unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
        Ok(Some(event))
    }
}

/// What `poll` reported for one async fd.
#[derive(Debug, PartialEq, Eq)]
enum Readiness {
    Idle,
    Readable,
    /// The fd is broken; the text says how.
    Broken(&'static str),
}

fn readiness(revents: libc::c_short) -> Readiness {
    if revents & libc::POLLNVAL != 0 {
        Readiness::Broken("POLLNVAL (the fd is closed)")
    } else if revents & libc::POLLERR != 0 {
        Readiness::Broken("POLLERR")
    } else if revents & libc::POLLHUP != 0 {
        Readiness::Broken("POLLHUP (the device went away)")
    } else if revents & libc::POLLIN != 0 {
        Readiness::Readable
    } else {
        Readiness::Idle
    }
}

/// Waits up to `timeout_ms` for events on any of `contexts`; returns `(index, event)` pairs.
/// A context whose fd is broken yields one [`AsyncEvent::Broken`]; the caller must stop
/// passing it (else `poll` returns at once, every time).
pub fn wait_async(contexts: &[&Context], timeout_ms: i32) -> Vec<(usize, AsyncEvent)> {
    if contexts.is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(timeout_ms.max(0) as u64));
        return Vec::new();
    }
    let mut fds: Vec<libc::pollfd> = contexts
        .iter()
        .map(|c| libc::pollfd { fd: c.async_fd(), events: libc::POLLIN, revents: 0 })
        .collect();
    // SAFETY: fds is a valid array of fds.len() pollfds.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    let mut out = Vec::new();
    if n <= 0 {
        return out;
    }
    for (i, p) in fds.iter().enumerate() {
        match readiness(p.revents) {
            Readiness::Idle => {}
            Readiness::Broken(how) => out.push((i, AsyncEvent::Broken(how.into()))),
            Readiness::Readable => loop {
                match contexts[i].read_event() {
                    Ok(Some(ev)) => out.push((i, ev)),
                    Ok(None) => break,
                    Err(e) => {
                        let why = std::io::Error::from_raw_os_error(e);
                        out.push((i, AsyncEvent::Broken(format!("ibv_get_async_event: {why}"))));
                        break;
                    }
                }
            },
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_fd_is_told_apart_from_an_event() {
        assert_eq!(readiness(0), Readiness::Idle);
        assert_eq!(readiness(libc::POLLIN), Readiness::Readable);
        for bad in [libc::POLLERR, libc::POLLHUP, libc::POLLNVAL, libc::POLLIN | libc::POLLHUP] {
            assert!(matches!(readiness(bad), Readiness::Broken(_)), "{bad:#x}");
        }
    }
}
