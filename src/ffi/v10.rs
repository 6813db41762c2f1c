//! ncclNet v10: no per-communicator context (`init` once per load, no `finalize`); `connect`
//! receives the communicator config instead.

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::{Exported, PLUGIN_NAME, legacy, v12};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: Exported<ncclNet_v10_t> = Exported(ncclNet_v10_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init),
    devices: Some(v12::devices),
    getProperties: Some(get_properties),
    listen: Some(legacy::listen),
    connect: Some(connect),
    accept: Some(v12::accept),
    regMr: Some(v12::reg_mr),
    regMrDmaBuf: Some(v12::reg_mr_dma_buf),
    deregMr: Some(v12::dereg_mr),
    isend: Some(v12::isend),
    irecv: Some(v12::irecv),
    iflush: Some(v12::iflush),
    test: Some(v12::test),
    closeSend: Some(v12::close_send),
    closeRecv: Some(v12::close_recv),
    closeListen: Some(v12::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
});

unsafe extern "C" fn init(
    logger: ncclDebugLogger_t,
    _prof: ncclProfilerCallback_t,
) -> ncclResult_t {
    legacy::init(logger)
}

pub(super) unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v9_t,
) -> ncclResult_t {
    legacy::get_properties(dev, props, legacy::props_v9)
}

unsafe extern "C" fn connect(
    dev: c_int,
    config: *mut ncclNetCommConfig_v10_t,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
    let tc = unsafe { config.as_ref() }.map(|c| c.trafficClass);
    // SAFETY: forwarded under the same contract; the legacy context lives with the library.
    unsafe { v12::connect_with(legacy::ctx(), tc, dev, handle, send_comm) }
}
