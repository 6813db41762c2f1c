//! What the older ABIs (v6–v11) share when they adapt onto [`plugin`]'s (newest) signatures.
//!
//! - v6–v10 have no per-communicator `init`/`finalize`: NCCL calls `init` once per load. Their
//!   calls run on one context created by the first such `init` and kept for the life of the
//!   library.
//! - v6–v8 pass `int` sizes, v9+ `size_t`; conversions reject negative sizes instead of
//!   wrapping them.
//! - Property structs are the newest one with fewer fields: `narrow!` (in [`super::narrow`])
//!   names them, and [`plugin::get_properties`] fills any version's.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::abi::*;
use super::handles::{self, clear};
use super::{guard, log, plugin};
use crate::error::{Error, Result};
use crate::transport;
use crate::transport::data::MAX_RECVS;

/// The context every v6–v10 call runs on; NULL until the first legacy `init` succeeds.
static LEGACY_CTX: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static LEGACY_INIT: Mutex<()> = Mutex::new(());

/// `init` of v6–v9: once per load, no context returned to NCCL.
pub extern "C" fn init(logger: ncclDebugLogger_t) -> ncclResult_t {
    init_with(logger, None)
}

/// `init` of v10, which also passes the profiler callback: comms connected or accepted from
/// now on report to it.
pub fn init_with(logger: ncclDebugLogger_t, profiler: ncclProfilerCallback_t) -> ncclResult_t {
    log::install(logger);
    guard("init", || {
        let _once = LEGACY_INIT.lock().unwrap_or_else(|p| p.into_inner());
        if LEGACY_CTX.load(Ordering::Acquire).is_null() {
            let ctx = transport::net::init(0, NCCL_NET_TRAFFIC_CLASS_UNDEF)?;
            LEGACY_CTX.store(handles::ctx_into_raw(ctx), Ordering::Release);
        }
        handles::ctx(ctx())?.set_profiler(super::profiler::of(profiler));
        Ok(())
    })
}

/// The context v6–v10 calls pass on to [`plugin`] (NULL before `init`, which `plugin` reports).
pub fn ctx() -> *mut c_void {
    LEGACY_CTX.load(Ordering::Acquire)
}

/// `makeVDevice` of v9–v11: their props hold 4 ports; widened to the newest.
pub unsafe extern "C" fn make_vdevice_v9(
    d: *mut c_int,
    props: *mut ncclNetVDeviceProps_v9_t,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid props struct for the call.
    let Some(p) = (unsafe { props.as_ref() }) else {
        // SAFETY: NULL props: the newest entry point reports it.
        return unsafe { plugin::make_vdevice(d, std::ptr::null_mut()) };
    };
    let mut wide = ncclNetVDeviceProps_v12_t { ndevs: p.ndevs, ..Default::default() };
    wide.devs[..p.devs.len()].copy_from_slice(&p.devs);
    if p.ndevs > p.devs.len() as c_int {
        wide.ndevs = c_int::MAX; // refused there, as more ports than the struct holds
    }
    // SAFETY: forwarded under the same contract, with a struct that lives for the call.
    unsafe { plugin::make_vdevice(d, &mut wide) }
}

fn size_of_int(size: c_int) -> Result<usize> {
    usize::try_from(size).map_err(|_| Error::Internal(format!("negative size {size}")))
}

/// `isend` with an `int` size (v6–v8).
pub unsafe extern "C" fn isend_int(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid request slot.
    unsafe { clear(request) };
    match size_of_int(size) {
        // SAFETY: the remaining arguments are forwarded unchanged under the same contract.
        Ok(size) => unsafe {
            plugin::isend(send_comm, data, size, tag, mhandle, std::ptr::null_mut(), request)
        },
        Err(e) => guard("isend", || Err(e)),
    }
}

/// `irecv` with `int` sizes (v6–v8). Every one of the `n` sizes is converted, so grouped
/// receives work in these versions too.
pub unsafe extern "C" fn irecv_int(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let mut wide = [0usize; MAX_RECVS];
    let converted = (|| {
        let count = usize::try_from(n)
            .ok()
            .filter(|&k| (1..=wide.len()).contains(&k))
            .ok_or_else(|| Error::Internal(format!("irecv n={n}, must be 1..={}", wide.len())))?;
        if sizes.is_null() {
            return Err(Error::Internal("NULL sizes".into()));
        }
        // SAFETY: NCCL passes n valid sizes.
        let narrow = unsafe { std::slice::from_raw_parts(sizes, count) };
        for (w, &s) in wide.iter_mut().zip(narrow) {
            *w = size_of_int(s)?;
        }
        Ok(())
    })();
    match converted {
        // SAFETY: the other arguments are forwarded unchanged under the same contract.
        Ok(()) => unsafe {
            plugin::irecv(
                recv_comm,
                n,
                data,
                wide.as_mut_ptr(),
                tags,
                mhandles,
                std::ptr::null_mut(),
                request,
            )
        },
        Err(e) => {
            // SAFETY: NCCL passes NULL or a valid request slot.
            unsafe { clear(request) };
            guard("irecv", || Err(e))
        }
    }
}

/// `isend` without a profiler handle (v9).
pub unsafe extern "C" fn isend_v9(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: forwarded unchanged under the same contract.
    unsafe { plugin::isend(send_comm, data, size, tag, mhandle, std::ptr::null_mut(), request) }
}

/// `irecv` without profiler handles (v9).
pub unsafe extern "C" fn irecv_v9(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: forwarded unchanged under the same contract.
    unsafe {
        plugin::irecv(recv_comm, n, data, sizes, tags, mhandles, std::ptr::null_mut(), request)
    }
}

/// `listen` without a context (v6–v10).
pub unsafe extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: forwarded unchanged; the legacy context lives as long as the library.
    unsafe { plugin::listen(ctx(), dev, handle, listen_comm) }
}

/// `connect` without a context (v7–v9).
pub unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: forwarded unchanged; the legacy context lives as long as the library.
    unsafe { plugin::connect(ctx(), dev, handle, send_comm, send_dev_comm) }
}

/// `regMr` with an `int` size (v6, v7).
pub unsafe extern "C" fn reg_mr_int(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    type_: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid mhandle slot.
    unsafe { clear(mhandle) };
    match size_of_int(size) {
        // SAFETY: forwarded unchanged under the same contract.
        Ok(size) => unsafe { plugin::reg_mr(comm, data, size, type_, mhandle) },
        Err(e) => guard("regMr", || Err(e)),
    }
}
