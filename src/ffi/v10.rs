//! ncclNet v10: no per-communicator context (`init` once per load, no `finalize`); `connect`
//! receives the communicator config instead.

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::{Exported, PLUGIN_NAME, legacy, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: Exported<ncclNet_v10_t> = Exported(ncclNet_v10_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init),
    devices: Some(plugin::devices),
    getProperties: Some(plugin::get_properties),
    listen: Some(legacy::listen),
    connect: Some(connect),
    accept: Some(plugin::accept),
    regMr: Some(plugin::reg_mr),
    regMrDmaBuf: Some(plugin::reg_mr_dma_buf),
    deregMr: Some(plugin::dereg_mr),
    isend: Some(plugin::isend),
    irecv: Some(plugin::irecv),
    iflush: Some(plugin::iflush),
    test: Some(plugin::test),
    closeSend: Some(plugin::close_send),
    closeRecv: Some(plugin::close_recv),
    closeListen: Some(plugin::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: Some(legacy::make_vdevice_v9),
});

unsafe extern "C" fn init(logger: ncclDebugLogger_t, prof: ncclProfilerCallback_t) -> ncclResult_t {
    legacy::init_with(logger, prof)
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
    unsafe { plugin::connect_with(legacy::ctx(), tc, dev, handle, send_comm) }
}
