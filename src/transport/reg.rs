//! `regMr`/`deregMr` for host memory, through the device's registration cache.

use std::sync::Arc;

use super::net::Net;
use crate::error::{Error, Result};
use crate::verbs::{self, Mr};

/// What `regMr` hands NCCL as `mhandle`.
pub struct MrHandle {
    pub mr: Arc<Mr>,
    start: u64,
    end: u64,
    net: Arc<Net>,
    dev: usize,
}

const ACCESS: u32 =
    verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_WRITE | verbs::ACCESS_REMOTE_READ;

/// Registers host memory `[addr, addr + len)` on device `dev`, reusing a cached registration.
pub fn register(net: &Arc<Net>, dev: usize, addr: u64, len: u64) -> Result<MrHandle> {
    let d = &net.devices[dev];
    let mut cache = d.mrs.lock().unwrap_or_else(|p| p.into_inner());
    let lease = cache.acquire(addr, len, |start, len| {
        let len =
            usize::try_from(len).map_err(|_| Error::Internal(format!("region of {len} bytes")))?;
        // NCCL keeps the memory mapped until deregMr, as the ABI requires.
        Mr::register_host(&d.pd, start, len, ACCESS).map(Arc::new)
    })?;
    Ok(MrHandle { mr: lease.reg, start: lease.start, end: lease.end, net: net.clone(), dev })
}

/// Releases one registration; the region is deregistered when its last user lets go.
pub fn deregister(h: MrHandle) {
    let d = &h.net.devices[h.dev];
    let last = d.mrs.lock().unwrap_or_else(|p| p.into_inner()).release(h.start, h.end);
    drop(last); // the MR itself goes when the last Arc (cache or in-flight use) drops
}
