//! ncclNet v12: the one implementation. Older versions (`v11` … `v6`) adapt their arguments and
//! call the functions here.
//!
//! Every function is plumbing around a safe call: clear the "not ready" outputs, run the body in
//! [`guard`], write outputs only on success.

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Mutex;

use super::abi::*;
use super::handles::{self, clear, out};
use super::{Exported, PLUGIN_NAME, guard, log};
use crate::error::{Error, Result};
use crate::transport::{self, CommContext, NetDevice};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v12: Exported<ncclNet_v12_t> = Exported(ncclNet_v12_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr),
    regMrDmaBuf: None, // NCCL_PTR_DMABUF is not advertised yet
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,   // host plugin: no device-side handles
    irecvConsumed: None, // must stay NULL for a host plugin
    makeVDevice: None,   // no NIC fusion: NCCL uses the physical devices
    finalize: Some(finalize),
    setNetAttr: None,
});

pub(super) unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    _profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    log::install(logger);
    // SAFETY: NCCL passes a valid ctx slot (or NULL, rejected by `out`).
    unsafe { clear(ctx) };
    guard("init", || {
        // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
        let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.trafficClass);
        let c = transport::net::init(comm_id, tc)?;
        // SAFETY: checked non-NULL by `out`; valid for writes per the ABI.
        *unsafe { out(ctx, "ctx") }? = handles::into_raw(c);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    guard("finalize", || {
        // SAFETY: ctx is what init returned, and NCCL finalizes it exactly once.
        transport::net::finalize(unsafe { handles::take::<CommContext>(ctx, "ctx") }?);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        let n = transport::net::current()?.devices.len();
        // SAFETY: NCCL passes a valid int pointer (NULL rejected by `out`).
        *unsafe { out(ndev, "ndev") }? = c_int::try_from(n).unwrap_or(c_int::MAX);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v12_t,
) -> ncclResult_t {
    guard("getProperties", || {
        let p = properties(dev)?;
        // SAFETY: NCCL passes a valid properties struct (NULL rejected by `out`).
        *unsafe { out(props, "props") }? = p;
        Ok(())
    })
}

/// The v12 properties of device `dev`; older versions narrow this.
pub(super) fn properties(dev: c_int) -> Result<ncclNetProperties_v12_t> {
    let net = transport::net::current()?;
    let d = net.device(dev)?;
    let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V12 as usize];
    devs[0] = dev;
    Ok(ncclNetProperties_v12_t {
        name: intern(&d.name),
        pciPath: d.pci_path.as_deref().map_or(std::ptr::null_mut(), intern),
        guid: d.guid,
        ptrSupport: NCCL_PTR_HOST as c_int,
        regIsGlobal: 0,
        forceFlush: 0,
        speed: d.speed_mbps,
        port: d.port.into(),
        latency: 0.0,
        maxComms: d.max_qp,
        maxRecvs: MAX_RECVS,
        netDeviceType: ncclNetDeviceType::NCCL_NET_DEVICE_HOST,
        netDeviceVersion: NCCL_NET_DEVICE_INVALID_VERSION as c_int,
        vProps: ncclNetVDeviceProps_v12_t { ndevs: 1, devs },
        maxP2pBytes: NCCL_MAX_NET_SIZE_BYTES as usize,
        maxCollBytes: NCCL_MAX_COLLNET_SIZE as usize,
        maxMultiRequestSize: 1,
        railId: rail_or_undef(d, |d| d.rail),
        planeId: rail_or_undef(d, |d| d.plane),
    })
}

/// Receives one `irecv` may group.
pub(super) const MAX_RECVS: c_int = 8;

fn rail_or_undef(d: &NetDevice, f: impl Fn(&NetDevice) -> Option<i16>) -> i16 {
    f(d).unwrap_or(NCCL_NET_ID_UNDEF as i16)
}

/// NCCL may keep the `name` and `pciPath` pointers of the properties, so they must outlive the
/// device state; each distinct string is stored once for the life of the library.
fn intern(s: &str) -> *mut c_char {
    static STRINGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());
    let mut strings = STRINGS.lock().unwrap_or_else(|p| p.into_inner());
    let c = CString::new(s.replace('\0', "")).unwrap_or_default();
    if let Some(hit) = strings.iter().find(|x| **x == c) {
        return hit.as_ptr().cast_mut();
    }
    // The heap buffer of a CString does not move when the Vec reallocates.
    let ptr = c.as_ptr().cast_mut();
    strings.push(c);
    ptr
}

/// The entry points of the data path. They report an error (never success) until they are
/// implemented; NCCL then aborts the communicator cleanly instead of hanging.
fn unsupported(call: &'static str, outs: &[*mut *mut c_void]) -> ncclResult_t {
    for &p in outs {
        // SAFETY: each is an out-slot NCCL passed for this call, NULL or valid for writes.
        unsafe { clear(p) };
    }
    guard(call, || Err(Error::Unsupported(call)))
}

pub(super) unsafe extern "C" fn listen(
    _ctx: *mut c_void,
    _dev: c_int,
    _handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    unsupported("listen", &[listen_comm])
}

pub(super) unsafe extern "C" fn connect(
    _ctx: *mut c_void,
    _dev: c_int,
    _handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    unsupported("connect", &[send_comm])
}

pub(super) unsafe extern "C" fn accept(
    _listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _recv_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    unsupported("accept", &[recv_comm])
}

pub(super) unsafe extern "C" fn reg_mr(
    _comm: *mut c_void,
    _data: *mut c_void,
    _size: usize,
    _type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    unsupported("regMr", &[mhandle])
}

pub(super) unsafe extern "C" fn dereg_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
) -> ncclResult_t {
    unsupported("deregMr", &[])
}

pub(super) unsafe extern "C" fn isend(
    _send_comm: *mut c_void,
    _data: *mut c_void,
    _size: usize,
    _tag: c_int,
    _mhandle: *mut c_void,
    _phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    unsupported("isend", &[request])
}

#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn irecv(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut usize,
    _tags: *mut c_int,
    _mhandles: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    unsupported("irecv", &[request])
}

pub(super) unsafe extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    unsupported("iflush", &[request])
}

pub(super) unsafe extern "C" fn test(
    _request: *mut c_void,
    _done: *mut c_int,
    _sizes: *mut c_int,
) -> ncclResult_t {
    unsupported("test", &[])
}

pub(super) unsafe extern "C" fn close_send(_send_comm: *mut c_void) -> ncclResult_t {
    unsupported("closeSend", &[])
}

pub(super) unsafe extern "C" fn close_recv(_recv_comm: *mut c_void) -> ncclResult_t {
    unsupported("closeRecv", &[])
}

pub(super) unsafe extern "C" fn close_listen(_listen_comm: *mut c_void) -> ncclResult_t {
    unsupported("closeListen", &[])
}
