//! Asynchronous device events (`ibv_get_async_event`), read without blocking forever: the
//! async fds are made non-blocking and waited on with `poll` and a timeout, so the thread that
//! reads them can be stopped and joined.

use std::mem::MaybeUninit;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};

/// The events callers act on; everything else is `Other` with its `ibv_event_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    GidChange(u8),
    PortActive(u8),
    PortError(u8),
    DeviceFatal,
    Other(u32),
}

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

    /// Reads one pending event, if any, and acknowledges it.
    fn read_event(&self) -> Option<AsyncEvent> {
        let mut ev = MaybeUninit::<sys::ibv_async_event>::zeroed();
        // SAFETY: raw is open; ev is writable; the fd is non-blocking.
        if unsafe { sys::ibv_get_async_event(self.raw(), ev.as_mut_ptr()) } != 0 {
            return None;
        }
        // The type is read as a plain u32 (offset 8): a value the binding's enum does not know
        // must not become an invalid enum.
        // SAFETY: ev was filled by ibv_get_async_event; the layout is union (8 bytes) + enum.
        let (kind, port) = unsafe {
            let p = ev.as_ptr().cast::<u8>();
            (p.add(8).cast::<u32>().read(), p.cast::<i32>().read())
        };
        // SAFETY: every event returned must be acknowledged exactly once.
        unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
        let port = u8::try_from(port).unwrap_or(0);
        Some(match kind {
            IBV_EVENT_GID_CHANGE => AsyncEvent::GidChange(port),
            IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive(port),
            IBV_EVENT_PORT_ERR => AsyncEvent::PortError(port),
            IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
            other => AsyncEvent::Other(other),
        })
    }
}

/// Waits up to `timeout_ms` for events on any of `contexts`; returns `(index, event)` pairs.
pub fn wait_async(contexts: &[&Context], timeout_ms: i32) -> Vec<(usize, AsyncEvent)> {
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
        if p.revents & libc::POLLIN != 0 {
            while let Some(ev) = contexts[i].read_event() {
                out.push((i, ev));
            }
        }
    }
    out
}
