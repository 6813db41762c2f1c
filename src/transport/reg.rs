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

/// What `regMr` hands NCCL as `mhandle`.
pub struct MrHandle {
    pub mr: Arc<Mr>,
    pub kind: MemKind,
    start: u64,
    end: u64,
    net: Arc<Net>,
    dev: usize,
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

/// Registers `mem` (host or peer-memory GPU memory) on device `dev`, reusing a cached
/// registration of the same kind.
pub fn register(net: &Arc<Net>, dev: usize, kind: MemKind, mem: ForeignMem) -> Result<MrHandle> {
    check_supported(net, dev, kind)?;
    let d = &net.devices[dev];
    let access = access(net, dev);
    let mut cache = d.mrs.lock().unwrap_or_else(|p| p.into_inner());
    let lease = cache.acquire(kind, mem.addr(), mem.len(), |start, len| {
        // The cache rounds out to whole pages, which `mem`'s contract covers.
        let pages = mem.widen(start, len, crate::os::page_size())?;
        Mr::register_host(&d.pd, pages, access).map(Arc::new)
    })?;
    Ok(handle(net, dev, lease))
}

/// Registers `[offset, offset + len)` of the dma-buf `fd` on device `dev`, at the address
/// `addr` NCCL uses for it. The fd is neither kept nor closed.
pub fn register_dmabuf(
    net: &Arc<Net>,
    dev: usize,
    addr: u64,
    len: u64,
    offset: u64,
    fd: i32,
) -> Result<MrHandle> {
    check_supported(net, dev, MemKind::DmaBuf)?;
    let d = &net.devices[dev];
    let access = access(net, dev);
    let mut cache = d.mrs.lock().unwrap_or_else(|p| p.into_inner());
    let lease = cache.acquire(MemKind::DmaBuf, addr, len, |start, len| {
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
    })?;
    Ok(handle(net, dev, lease))
}

fn size(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| Error::Internal(format!("region of {len} bytes")))
}

fn handle(net: &Arc<Net>, dev: usize, lease: super::mr_cache::Lease<Arc<Mr>>) -> MrHandle {
    let (mr, kind, start, end) = (lease.reg, lease.kind, lease.start, lease.end);
    MrHandle { mr, kind, start, end, net: net.clone(), dev }
}

/// Releases one registration; the region is deregistered when its last user lets go.
pub fn deregister(h: MrHandle) {
    let d = &h.net.devices[h.dev];
    let last = d.mrs.lock().unwrap_or_else(|p| p.into_inner()).release(h.kind, h.start, h.end);
    drop(last); // the MR itself goes when the last Arc (cache or in-flight use) drops
}
