//! Typed conversions between NCCL's raw pointers and ferroce objects. Every NULL check lives
//! here, so the entry points stay three lines of plumbing.

use std::ffi::c_void;

use crate::error::{Error, Result};

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
