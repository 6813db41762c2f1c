//! Protection domains and memory regions.
//!
//! A [`Pd`] keeps its device [`Context`] alive; an [`Mr`] keeps its `Pd` alive. Drop releases
//! each exactly once, logging (never panicking on) a failed release.
//!
//! Three ways to register: host (or peer-memory GPU) pointers with `ibv_reg_mr`, the same with
//! `ibv_reg_mr_iova2` when an optional access flag (relaxed ordering) is asked for, and a
//! dma-buf fd with `ibv_reg_dmabuf_mr`. The last two are resolved at run time ([`super::sym`]).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, RwLock, RwLockReadGuard};

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
    /// The registrations of this PD the CPU may read, by local key: the only memory a
    /// [`super::Qp::post_send`] copies inline (the provider's CPU reads inline data).
    cpu: RwLock<FastMap<u32, (u64, u64)>>,
}

/// [`Pd::cpu_readable`]'s guard.
pub(super) struct CpuReadable<'a>(RwLockReadGuard<'a, FastMap<u32, (u64, u64)>>);

impl CpuReadable<'_> {
    /// Whether `[addr, addr + len)` lies in a registration under `lkey` that the CPU may read.
    pub(super) fn covers(&self, lkey: u32, addr: u64, len: u32) -> bool {
        let end = addr.checked_add(u64::from(len));
        self.0.get(&lkey).is_some_and(|&(a, l)| a <= addr && end.is_some_and(|e| e <= a + l))
    }
}

/// A map keyed by integers that are ours or the provider's, never an attacker's (memory keys,
/// queue numbers, the addresses of the plugin's own boxes), hashed by one multiplication:
/// SipHash cost more than an inline post, and about 1,000 instructions a close in the handle
/// register. Only integer keys hash well (bytes are folded in without mixing).
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// [`FastMap`]'s hasher: Fibonacci hashing of an integer key, rotated so that the low bits
/// (which pick the bucket) come from the product's high bits, which depend on every bit of the
/// key (a box's address has its low four bits clear).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = bytes.iter().fold(self.0, |h, &b| h.rotate_left(8) ^ u64::from(b));
    }
    fn write_u32(&mut self, k: u32) {
        self.write_u64(u64::from(k));
    }
    fn write_u64(&mut self, k: u64) {
        // One key: `k` times the constant; more than one are mixed in.
        self.0 = (self.0.rotate_left(26) ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_usize(&mut self, k: usize) {
        self.write_u64(k as u64);
    }
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
        Ok(Arc::new(Pd { raw, ctx: ctx.clone(), cpu: RwLock::new(HashMap::default()) }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Notes the registration `mr` as memory the CPU may read (until `mr` goes).
    pub(super) fn note_cpu(&self, mr: &Mr) {
        let mut cpu = self.cpu.write().unwrap_or_else(|p| p.into_inner());
        cpu.insert(mr.lkey, (mr.addr, mr.len as u64));
    }

    /// The registrations the CPU may read, held for a post: none of them is deregistered
    /// (nor its memory freed) while the guard lives.
    pub(super) fn cpu_readable(&self) -> CpuReadable<'_> {
        CpuReadable(self.cpu.read().unwrap_or_else(|p| p.into_inner()))
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
    /// No Rust reference may point into the range for the life of the returned `Mr`: the NIC
    /// reads and writes it behind the compiler's back (whatever `access` allows). It should stay
    /// mapped as long, or the NIC reaches pages the process no longer sees.
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

/// Memory that no Rust object owns or borrows (NCCL's buffers), vouched for by whoever makes
/// one: the only memory [`Mr::register_host`] registers. Making one is the unsafe step; the
/// registration itself is then safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignMem {
    addr: u64,
    len: u64,
    /// Vouched to be host memory the CPU may read ([`ForeignMem::host`]).
    cpu: bool,
}

impl ForeignMem {
    /// # Safety
    /// For as long as any memory region registered over `[addr, addr + len)` exists, no Rust
    /// reference may point into that range or into the rest of the pages that hold it: a NIC
    /// may write it at any time, behind the compiler's back (the peer's RDMA writes, which the
    /// registration allows). A range that is not mapped is harmless: the kernel refuses it.
    pub unsafe fn new(addr: u64, len: u64) -> ForeignMem {
        ForeignMem { addr, len, cpu: false }
    }

    /// The same, for host memory: its registration may be the source of inline sends, which
    /// the provider copies with the CPU.
    ///
    /// # Safety
    /// As for [`ForeignMem::new`]; and the range is host memory that the CPU may read for as
    /// long as any memory region registered over it exists (never GPU memory).
    pub unsafe fn host(addr: u64, len: u64) -> ForeignMem {
        ForeignMem { addr, len, cpu: true }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `[start, start + len)` if it covers this memory and lies in the pages of `page` bytes
    /// (a power of two) that hold it, which the contract of [`ForeignMem::new`] covers too:
    /// the registration cache registers whole pages, as the kernel pins them anyway.
    pub fn widen(&self, start: u64, len: u64, page: u64) -> Result<ForeignMem> {
        let end = start.checked_add(len);
        let mine = self.addr.checked_add(self.len);
        let first = self.addr & !page.wrapping_sub(1);
        let last = mine.and_then(|m| m.checked_next_multiple_of(page.max(1)));
        match (end, mine, last) {
            (Some(end), Some(mine), Some(last))
                if page.is_power_of_two()
                    && first <= start
                    && start <= self.addr
                    && mine <= end
                    && end <= last =>
            {
                Ok(ForeignMem { addr: start, len, cpu: self.cpu })
            }
            _ => Err(Error::Internal(format!(
                "{start:#x}+{len} is not within the {page}-byte pages of {:#x}+{}",
                self.addr, self.len
            ))),
        }
    }
}

impl Mr {
    /// Registers memory nothing in Rust owns (NCCL's buffers: host memory, or GPU memory through
    /// peer memory); [`ForeignMem::new`] carries the contract. NCCL keeps the range mapped until
    /// the matching `deregMr` (the ncclNet ABI); an unmapped range is refused by the kernel
    /// (`EFAULT`), and pages unmapped later stay pinned by the MR until it goes.
    pub fn register_host(pd: &Arc<Pd>, mem: ForeignMem, access: u32) -> Result<Mr> {
        let len = usize::try_from(mem.len)
            .map_err(|_| Error::Internal(format!("region of {} bytes", mem.len)))?;
        // SAFETY: the maker of `mem` vouched that no Rust object lives in it for as long as
        // the MR exists; the kernel pins and validates the pages.
        let mr = unsafe { Mr::register(pd, mem.addr as *mut c_void, len, access) }?;
        if mem.cpu {
            pd.note_cpu(&mr);
        }
        Ok(mr)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let mut cpu = self.pd.cpu.write().unwrap_or_else(|p| p.into_inner());
        if cpu.get(&self.lkey).is_some_and(|&(a, _)| a == self.addr) {
            cpu.remove(&self.lkey);
        }
        drop(cpu);
        // SAFETY: raw is a live MR, deregistered once.
        let rc = unsafe { sys::ibv_dereg_mr(self.raw) };
        if rc != 0 {
            log::warn!("ibv_dereg_mr({}) failed: errno {rc}", self.pd.ctx.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_memory_widens_only_to_its_own_pages() {
        // SAFETY: never registered: only the range arithmetic is tested.
        let mem = unsafe { ForeignMem::new(0x1_0100, 0x200) };
        let ok = |start, len| mem.widen(start, len, 0x1000).map(|m| (m.addr(), m.len())).ok();
        assert_eq!(ok(0x1_0000, 0x1000), Some((0x1_0000, 0x1000)), "its page");
        assert_eq!(ok(0x1_0100, 0x200), Some((0x1_0100, 0x200)), "itself");
        assert_eq!(ok(0x1_0000, 0x1001), None, "into the next page");
        assert_eq!(ok(0x0_ff00, 0x1100), None, "into the page before");
        assert_eq!(ok(0x1_0200, 0x100), None, "less than itself");
        assert_eq!(ok(u64::MAX, 2), None, "wrapping");
        assert!(mem.widen(0x1_0000, 0x1000, 3000).is_err(), "a page that is no power of two");
        assert!(mem.widen(0x1_0000, 0x1000, 0).is_err());
        // SAFETY: as above.
        let end = unsafe { ForeignMem::new(u64::MAX - 8, 8) };
        assert!(end.widen(u64::MAX - 8, 8, 0x1000).is_err(), "its last page wraps");
    }
}
