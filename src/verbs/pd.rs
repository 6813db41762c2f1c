//! Protection domains and memory regions.
//!
//! A [`Pd`] keeps its device [`Context`] alive; an [`Mr`] keeps its `Pd` alive. Drop releases
//! each exactly once, logging (never panicking on) a failed release.

use std::ffi::c_void;
use std::sync::Arc;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};

/// `IBV_ACCESS_*` flags.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 2;
pub const ACCESS_REMOTE_READ: u32 = 4;

pub struct Pd {
    raw: *mut sys::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread; the PD is only freed in Drop.
unsafe impl Send for Pd {}
// SAFETY: as above; registering MRs on one PD from several threads is allowed by verbs.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: the context is open for the lifetime of the returned Pd (it holds an Arc).
        let raw = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        if raw.is_null() {
            return Err(Error::verbs("ibv_alloc_pd", errno(), ctx.name()));
        }
        Ok(Arc::new(Pd { raw, ctx: ctx.clone() }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(super) fn raw(&self) -> *mut sys::ibv_pd {
        self.raw
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: raw is a live PD; every MR/QP on it holds an Arc<Pd>, so none remain.
        let rc = unsafe { sys::ibv_dealloc_pd(self.raw) };
        if rc != 0 {
            log::warn!("ibv_dealloc_pd({}) failed: errno {rc}", self.ctx.name());
        }
    }
}

/// A registered memory region.
pub struct Mr {
    raw: *mut sys::ibv_mr,
    pd: Arc<Pd>,
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

// SAFETY: an MR is an immutable kernel object once registered; only Drop frees it.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// The range must stay mapped for the life of the returned `Mr`: the NIC reads and writes it.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *mut c_void, len: usize, access: u32) -> Result<Mr> {
        // SAFETY: pd is live; the caller guarantees the range.
        let raw = unsafe { sys::ibv_reg_mr(pd.raw, addr, len, access as i32) };
        if raw.is_null() {
            let e = errno();
            let what = format!("{} ({len} bytes at {addr:p}; check `ulimit -l`)", pd.ctx.name());
            return Err(Error::verbs("ibv_reg_mr", e, &what));
        }
        // SAFETY: raw is a valid ibv_mr returned by the successful registration.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        Ok(Mr { raw, pd: pd.clone(), addr: addr as u64, len, lkey, rkey })
    }
}

impl Mr {
    /// Registers memory the caller (NCCL) owns and promises to keep mapped while registered.
    ///
    /// This is the registration `regMr` does on NCCL's behalf: the ncclNet contract, not Rust,
    /// guarantees the range stays mapped until the matching `deregMr`. An unmapped range is
    /// refused by the kernel (`EFAULT`).
    pub fn register_host(pd: &Arc<Pd>, addr: u64, len: usize, access: u32) -> Result<Mr> {
        // SAFETY: the kernel pins and validates the pages; NCCL keeps them mapped until
        // deregistration (the ncclNet ABI contract for regMr/deregMr).
        unsafe { Mr::register(pd, addr as *mut c_void, len, access) }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: raw is a live MR, deregistered once.
        let rc = unsafe { sys::ibv_dereg_mr(self.raw) };
        if rc != 0 {
            log::warn!("ibv_dereg_mr({}) failed: errno {rc}", self.pd.ctx.name());
        }
    }
}
