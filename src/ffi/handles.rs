//! Typed conversions between NCCL's raw pointers and ferroce objects. Every NULL check lives
//! here, so the entry points stay three lines of plumbing.

use std::cell::UnsafeCell;
use std::ffi::c_void;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::transport::comm::{RecvComm, ReqHeader, SendComm};
use crate::transport::reg::MrHandle;
use crate::transport::{CommContext, Net};

/// An out-pointer NCCL must supply.
///
/// # Safety
/// `p` must be NULL or valid for writes of `T` for the duration of the call.
pub unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: the caller guarantees p is NULL or valid; NULL is rejected here.
    unsafe { p.as_mut() }.ok_or_else(|| Error::Internal(format!("NULL {what}")))
}

/// Sets a "not ready" pointer output before the body runs, if NCCL gave one.
///
/// # Safety
/// As for [`out`].
pub unsafe fn clear(p: *mut *mut c_void) {
    // SAFETY: the caller guarantees p is NULL or valid for writes.
    if let Some(slot) = unsafe { p.as_mut() } {
        *slot = std::ptr::null_mut();
    }
}

/// Hands ownership of `value` to NCCL.
pub fn into_raw<T>(value: T) -> *mut c_void {
    Box::into_raw(Box::new(value)).cast()
}

/// Takes back ownership from NCCL.
///
/// # Safety
/// `p` must be NULL or a pointer produced by [`into_raw`] for a `T`, not yet taken back.
pub unsafe fn take<T>(p: *mut c_void, what: &str) -> Result<T> {
    if p.is_null() {
        return Err(Error::Internal(format!("NULL {what}")));
    }
    // SAFETY: per the contract p came from Box::into_raw::<T> and is taken back once.
    Ok(*unsafe { Box::from_raw(p.cast::<T>()) })
}

/// An object ferroce handed to NCCL as `void*`, borrowed for one call.
///
/// # Safety
/// `p` must be NULL or a pointer produced by [`into_raw`] for a `T` that is still alive, and
/// not borrowed elsewhere for the duration of the call (NCCL uses each comm from one thread).
pub unsafe fn borrow<'a, T>(p: *mut c_void, what: &str) -> Result<&'a mut T> {
    // SAFETY: per the contract, a non-NULL p points to a live, unaliased T made by into_raw.
    unsafe { p.cast::<T>().as_mut() }.ok_or_else(|| Error::Internal(format!("NULL {what}")))
}

/// A send or receive comm.
pub enum AnyComm {
    Send(Box<SendComm>),
    Recv(Box<RecvComm>),
}

/// What NCCL holds as a send or receive comm. Which calls may run at once, per the ncclNet
/// contract: NCCL's proxy thread drives a comm's data path (`isend`, `irecv`, `iflush`,
/// `test`, close) from one thread, while `regMr`/`regMrDmaBuf`/`deregMr` may come from another
/// thread at the same time. So registration only reads the immutable part (`net`, `dev`)
/// through `&`, and the comm itself sits in an `UnsafeCell` that only the data-path calls
/// reach (through [`comm_mut`]): no two `&mut` to one comm ever exist.
pub struct CommHandle {
    pub net: Arc<Net>,
    pub dev: usize,
    comm: UnsafeCell<AnyComm>,
}

impl CommHandle {
    pub fn new(comm: AnyComm) -> CommHandle {
        let (net, dev) = match &comm {
            AnyComm::Send(c) => (c.net.clone(), c.dev),
            AnyComm::Recv(c) => (c.net.clone(), c.dev),
        };
        CommHandle { net, dev, comm: UnsafeCell::new(comm) }
    }
}

/// The shared, immutable part of a comm, for registration.
///
/// # Safety
/// `p` must be NULL or a live pointer made by [`into_raw`] from a [`CommHandle`].
pub unsafe fn comm_shared<'a>(p: *mut c_void) -> Result<&'a CommHandle> {
    // SAFETY: per the contract; `&` is sound next to a data-path call, which only touches the
    // UnsafeCell.
    unsafe { p.cast::<CommHandle>().as_ref() }.ok_or_else(|| Error::Internal("NULL comm".into()))
}

/// The comm, for a data-path call.
///
/// # Safety
/// As for [`comm_shared`], and the caller is the one thread NCCL drives this comm's data path
/// from, so this is the only `&mut` to it.
pub unsafe fn comm_mut<'a>(p: *mut c_void) -> Result<&'a mut AnyComm> {
    // SAFETY: forwarded contract; the UnsafeCell permits mutation behind the shared handle.
    Ok(unsafe { &mut *comm_shared(p)?.comm.get() })
}

/// The communicator context of a v11+ call.
///
/// # Safety
/// As for [`borrow`].
pub unsafe fn ctx<'a>(p: *mut c_void) -> Result<&'a CommContext> {
    // SAFETY: forwarded contract.
    unsafe { borrow::<CommContext>(p, "ctx") }.map(|c| &*c)
}

/// The registration behind an `mhandle`.
///
/// # Safety
/// As for [`borrow`], for an `MrHandle` from `regMr`.
pub unsafe fn mr<'a>(p: *mut c_void) -> Result<&'a MrHandle> {
    // SAFETY: forwarded contract.
    unsafe { borrow::<MrHandle>(p, "mhandle") }.map(|m| &*m)
}

/// The `ReqHeader` behind a request pointer, copied out.
///
/// # Safety
/// `p` must be NULL or a request pointer ferroce returned and NCCL has not seen complete.
pub unsafe fn request(p: *mut c_void) -> Result<ReqHeader> {
    // SAFETY: per the contract p points into a live comm's header array.
    unsafe { p.cast::<ReqHeader>().as_ref() }
        .copied()
        .ok_or_else(|| Error::Internal("NULL request".into()))
}

/// The comm that owns a request.
///
/// # Safety
/// `h` must come from [`request`] on a live request, and `T` must be the comm type its kind
/// names.
pub unsafe fn owner<'a, T>(h: &ReqHeader) -> &'a mut T {
    // SAFETY: owner is the address of the boxed comm, alive while its requests are.
    unsafe { &mut *(h.owner as *mut T) }
}
