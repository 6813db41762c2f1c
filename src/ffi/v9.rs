//! ncclNet v9: like v10 without profiler handles and without the connect config.

use super::abi::*;
use super::{Exported, PLUGIN_NAME, legacy, v10, v12};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: Exported<ncclNet_v9_t> = Exported(ncclNet_v9_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init),
    devices: Some(v12::devices),
    getProperties: Some(v10::get_properties),
    listen: Some(legacy::listen),
    connect: Some(legacy::connect),
    accept: Some(v12::accept),
    regMr: Some(v12::reg_mr),
    regMrDmaBuf: Some(v12::reg_mr_dma_buf),
    deregMr: Some(v12::dereg_mr),
    isend: Some(legacy::isend_v9),
    irecv: Some(legacy::irecv_v9),
    iflush: Some(v12::iflush),
    test: Some(v12::test),
    closeSend: Some(v12::close_send),
    closeRecv: Some(v12::close_recv),
    closeListen: Some(v12::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
});

pub(super) unsafe extern "C" fn init(logger: ncclDebugLogger_t) -> ncclResult_t {
    legacy::init(logger)
}
