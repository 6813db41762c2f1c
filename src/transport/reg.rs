//! `regMr`, `regMrDmaBuf` and `deregMr`, through the device's registration cache.
//!
//! Host memory and peer-memory GPU pointers go through `ibv_reg_mr`; a dma-buf fd through
//! `ibv_reg_dmabuf_mr`. A memory type the device's `ptrSupport` does not list is refused before
//! any verb runs. The fd of a dma-buf is only used during the call: NCCL closes it right after.

use std::sync::Arc;

use super::mr_cache::MemKind;
use super::net::Net;
use crate::error::{Error, Result};
use crate::verbs::{self, ForeignMem, Mr};
use ferroce_core::data::{Keys, MAX_MEMBERS};

/// What `regMr` hands NCCL as `mhandle`: the region's registration on each member port of the
/// comm it was made on.
pub struct MrHandle {
    pub kind: MemKind,
    pub parts: Vec<Part>,
    /// The parts' local and remote keys in part order, and the range all their MRs cover: a
    /// buffer inside it, on a comm whose member ports are the parts' devices in that order,
    /// carries these keys (what `buf_within` would find part by part).
    pub keys: (Keys, Keys),
    pub common: (u64, u64),
    net: Arc<Net>,
}

/// The registration on one port: its device index, the MR, and the cached range it leases.
pub struct Part {
    pub dev: usize,
    pub mr: Arc<Mr>,
    start: u64,
    end: u64,
}

/// Registers on each of `devs` with `one`; a failure releases what was made.
fn on_each(
    net: &Arc<Net>,
    devs: &[usize],
    kind: MemKind,
    mut one: impl FnMut(usize) -> Result<super::mr_cache::Lease<Arc<Mr>>>,
) -> Result<MrHandle> {
    let mut h = MrHandle {
        kind,
        parts: Vec::with_capacity(devs.len()),
        keys: Default::default(),
        common: (0, u64::MAX),
        net: net.clone(),
    };
    debug_assert!(devs.len() <= MAX_MEMBERS, "a comm has at most {MAX_MEMBERS} member ports");
    for &dev in devs {
        debug_assert!(!h.parts.iter().any(|p| p.dev == dev), "device {dev} twice in {devs:?}");
        match one(dev) {
            Ok(lease) => {
                let (mr, start, end) = (lease.reg, lease.start, lease.end);
                let m = h.parts.len();
                if m < MAX_MEMBERS {
                    (h.keys.0[m], h.keys.1[m]) = (mr.lkey, mr.rkey);
                }
                // A range that wraps (no MR does) leaves only empty buffers to the fast path,
                // as the search would.
                let covered = mr.addr.checked_add(mr.len as u64).unwrap_or(0);
                h.common = (h.common.0.max(mr.addr), h.common.1.min(covered));
                h.parts.push(Part { dev, mr, start, end });
            }
            Err(e) => {
                deregister(h);
                return Err(e);
            }
        }
    }
    Ok(h)
}

/// What NCCL's buffers allow. `regMr` does not say whether a buffer will send or receive, so
/// every one takes the peer's RDMA writes (with local write, as verbs requires). Remote read
/// only on a device with a flush QP: the flush reads the last received buffer through its own
/// loopback QP, the only QP that grants remote read. Relaxed ordering where the device takes
/// it; only NCCL's buffers get it: ferroce's own control structures (the CTS FIFO, the size
/// records) are registered elsewhere with strict ordering.
fn access(net: &Net, dev: usize) -> u32 {
    let g = &net.devices[dev].gdr;
    let ro = if g.relaxed_ordering { verbs::ACCESS_RELAXED_ORDERING } else { 0 };
    let read = if g.flush { verbs::ACCESS_REMOTE_READ } else { 0 };
    verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE | read | ro
}

/// Refuses a memory kind the device's `ptrSupport` does not list.
fn check_supported(net: &Net, dev: usize, kind: MemKind) -> Result<()> {
    let d = &net.devices[dev];
    let ok = match kind {
        MemKind::Host => true,
        MemKind::Cuda => d.gdr.cuda,
        MemKind::DmaBuf => d.gdr.dmabuf,
    };
    if ok {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{kind:?} memory on {}, whose ptrSupport is {} ({})",
        d.name,
        d.gdr.ptr_names(),
        d.gdr.why
    )))
}

/// Registers `mem` (host or peer-memory GPU memory) on each port of `devs` (a comm's member
/// ports), reusing cached registrations of the same kind.
pub fn register(
    net: &Arc<Net>,
    devs: &[usize],
    kind: MemKind,
    mem: ForeignMem,
) -> Result<MrHandle> {
    on_each(net, devs, kind, |dev| {
        check_supported(net, dev, kind)?;
        let d = &net.devices[dev];
        let access = access(net, dev);
        let mut cache = d.mrs.lock().unwrap_or_else(|p| p.into_inner());
        cache.acquire(kind, mem.addr(), mem.len(), |start, len| {
            // The cache rounds out to whole pages, which `mem`'s contract covers.
            let pages = mem.widen(start, len, crate::os::page_size())?;
            Mr::register_host(&d.pd, pages, access).map(Arc::new)
        })
    })
}

/// Registers `[offset, offset + len)` of the dma-buf `fd` on each port of `devs`, at the
/// address `addr` NCCL uses for it. The fd is neither kept nor closed.
pub fn register_dmabuf(
    net: &Arc<Net>,
    devs: &[usize],
    addr: u64,
    len: u64,
    (offset, fd): (u64, i32),
) -> Result<MrHandle> {
    on_each(net, devs, MemKind::DmaBuf, |dev| dmabuf_on(net, dev, addr, len, (offset, fd)))
}

fn dmabuf_on(
    net: &Arc<Net>,
    dev: usize,
    addr: u64,
    len: u64,
    (offset, fd): (u64, i32),
) -> Result<super::mr_cache::Lease<Arc<Mr>>> {
    check_supported(net, dev, MemKind::DmaBuf)?;
    let d = &net.devices[dev];
    let access = access(net, dev);
    let mut cache = d.mrs.lock().unwrap_or_else(|p| p.into_inner());
    cache.acquire(MemKind::DmaBuf, addr, len, |start, len| {
        // The exact range: `start` is `addr` and `len` the requested length (never rounded).
        Mr::register_dmabuf(&d.pd, offset, size(len)?, start, fd, access).map(Arc::new).map_err(
            |e| match e {
                Error::Verbs { verb, errno, context } => Error::Verbs {
                    verb,
                    errno,
                    context: format!(
                        "{context}; check: kernel >= 5.12, an RDMA driver with dma-buf support, \
                         the GPU driver's dma-buf export, or set NCCL_DMABUF_ENABLE=0 to use \
                         peer memory (nvidia-peermem) instead"
                    ),
                },
                other => other,
            },
        )
    })
}

fn size(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| Error::Internal(format!("region of {len} bytes")))
}

/// Releases one registration (on each of its ports); a region is deregistered when its last
/// user lets go.
pub fn deregister(h: MrHandle) {
    for p in h.parts {
        let d = &h.net.devices[p.dev];
        let last = d.mrs.lock().unwrap_or_else(|e| e.into_inner()).release(h.kind, p.start, p.end);
        drop(last); // the MR itself goes when the last Arc (cache or in-flight use) drops
    }
}
