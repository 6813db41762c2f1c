//! Protection domains and memory regions.
//!
//! A [`Pd`] keeps its device [`Context`] alive; an [`Mr`] keeps its `Pd` alive. Drop releases
//! each exactly once, logging (never panicking on) a failed release.
//!
//! Three ways to register: host (or peer-memory GPU) pointers with `ibv_reg_mr`, the same with
//! `ibv_reg_mr_iova2` when an optional access flag (relaxed ordering) is asked for, and a
//! dma-buf fd with `ibv_reg_dmabuf_mr`. The last two are resolved at run time ([`super::sym`]).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};

/// `IBV_ACCESS_*` flags.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 2;
pub const ACCESS_REMOTE_READ: u32 = 4;
/// `IBV_ACCESS_RELAXED_ORDERING`: the NIC may write the region with PCIe relaxed ordering. An
/// optional flag: a provider that does not know it ignores it.
pub const ACCESS_RELAXED_ORDERING: u32 = 1 << 20;

/// What `ibv_reg_dmabuf_mr(pd, 0, 0, 0, fd -1, 0)` says about a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmabufProbe {
    /// libibverbs has no `ibv_reg_dmabuf_mr` (rdma-core < 34).
    NoSymbol,
    /// The errno of the (necessarily failed) probe: EBADF means the path exists.
    Errno(i32),
}

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

    /// Asks the device whether it registers dma-bufs: with fd -1 a capable driver fails with
    /// EBADF, an incapable one with EOPNOTSUPP or EPROTONOSUPPORT (NCCL's probe).
    pub fn probe_dmabuf(&self) -> DmabufProbe {
        let Some(reg) = super::sym::SYMBOLS.reg_dmabuf_mr else { return DmabufProbe::NoSymbol };
        // SAFETY: the PD is live; fd -1 never names memory, so nothing is registered.
        let mr = unsafe { reg(self.raw, 0, 0, 0, -1, 0) };
        let e = errno();
        if !mr.is_null() {
            // SAFETY: an MR the probe created after all; released at once.
            unsafe { sys::ibv_dereg_mr(mr) };
            return DmabufProbe::Errno(0);
        }
        DmabufProbe::Errno(e)
    }

    /// Whether a registration with `IBV_ACCESS_RELAXED_ORDERING` succeeds on this device.
    pub fn accepts_relaxed_ordering(self: &Arc<Pd>) -> bool {
        let Some(reg) = super::sym::SYMBOLS.reg_mr_iova2 else { return false };
        let page = Box::new([0u8; 4096]);
        let ptr = page.as_ptr() as *mut c_void;
        let access = ACCESS_LOCAL_WRITE | ACCESS_RELAXED_ORDERING;
        // SAFETY: the PD is live and the buffer outlives the MR, released right here.
        let mr = unsafe { reg(self.raw, ptr, page.len(), ptr as u64, access) };
        if mr.is_null() {
            return false;
        }
        // SAFETY: the MR just created, released once.
        unsafe { sys::ibv_dereg_mr(mr) };
        true
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
    /// An optional access flag (relaxed ordering) goes through `ibv_reg_mr_iova2`, or is dropped
    /// when libibverbs lacks it.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *mut c_void, len: usize, access: u32) -> Result<Mr> {
        let iova2 = super::sym::SYMBOLS.reg_mr_iova2;
        let (raw, verb) = match iova2 {
            Some(reg) if access & ACCESS_RELAXED_ORDERING != 0 => {
                // SAFETY: pd is live; the caller guarantees the range; iova = addr.
                (unsafe { reg(pd.raw, addr, len, addr as u64, access) }, "ibv_reg_mr_iova2")
            }
            _ => {
                let access = (access & !ACCESS_RELAXED_ORDERING) as i32;
                // SAFETY: pd is live; the caller guarantees the range.
                (unsafe { sys::ibv_reg_mr(pd.raw, addr, len, access) }, "ibv_reg_mr")
            }
        };
        let what = || format!("{} ({len} bytes at {addr:p})", pd.ctx.name());
        Mr::wrap(pd, raw, verb, what, addr as u64, len)
    }

    /// Registers `[offset, offset + len)` of the dma-buf `fd`, addressed by the peer as `iova`.
    /// The fd is only used during the call; the caller keeps ownership of it.
    pub fn register_dmabuf(
        pd: &Arc<Pd>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<Mr> {
        let Some(reg) = super::sym::SYMBOLS.reg_dmabuf_mr else {
            let what = format!("{} (libibverbs lacks it: rdma-core < 34)", pd.ctx.name());
            return Err(Error::verbs("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP, &what));
        };
        // SAFETY: pd is live; the kernel validates the fd and the range against the dma-buf,
        // which the exporter keeps alive for as long as the MR exists.
        let raw = unsafe { reg(pd.raw, offset, len, iova, fd, access as c_int) };
        let what = || {
            format!("{} (fd {fd}, offset {offset}, {len} bytes at iova {iova:#x})", pd.ctx.name())
        };
        Mr::wrap(pd, raw, "ibv_reg_dmabuf_mr", what, iova, len)
    }

    fn wrap(
        pd: &Arc<Pd>,
        raw: *mut sys::ibv_mr,
        verb: &'static str,
        what: impl FnOnce() -> String,
        addr: u64,
        len: usize,
    ) -> Result<Mr> {
        if raw.is_null() {
            let e = errno();
            let mut what = what();
            if e == libc::ENOMEM {
                what = format!("{what}; {}", crate::os::memlock_hint(crate::os::memlock_limit()));
            }
            return Err(Error::verbs(verb, e, &what));
        }
        // SAFETY: raw is a valid ibv_mr returned by a successful registration.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        Ok(Mr { raw, pd: pd.clone(), addr, len, lkey, rkey })
    }
}

impl Mr {
    /// Registers memory the caller (NCCL) owns and promises to keep mapped while registered:
    /// host memory, or GPU memory through peer memory.
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
