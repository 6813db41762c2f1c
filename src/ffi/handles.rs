//! Typed conversions between NCCL's raw pointers and ferroce objects. Every NULL check lives
//! here, so the entry points stay three lines of plumbing.

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

/// A send or receive comm, as NCCL holds it: `regMr` and `deregMr` accept either.
pub enum AnyComm {
    Send(Box<SendComm>),
    Recv(Box<RecvComm>),
}

impl AnyComm {
    pub fn device(&self) -> (&Arc<Net>, usize) {
        match self {
            AnyComm::Send(c) => (&c.net, c.dev),
            AnyComm::Recv(c) => (&c.net, c.dev),
        }
    }
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
