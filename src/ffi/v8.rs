//! ncclNet v8: `int` sizes in `isend`/`irecv`, no virtual devices in the properties.

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: Exported<ncclNet_v8_t> = Exported(ncclNet_v8_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(legacy::init),
    devices: Some(plugin::devices),
    getProperties: Some(plugin::get_properties),
    listen: Some(legacy::listen),
    connect: Some(legacy::connect),
    accept: Some(plugin::accept),
    regMr: Some(plugin::reg_mr),
    regMrDmaBuf: Some(plugin::reg_mr_dma_buf),
    deregMr: Some(plugin::dereg_mr),
    isend: Some(legacy::isend_int),
    irecv: Some(legacy::irecv_int),
    iflush: Some(plugin::iflush),
    test: Some(plugin::test),
    closeSend: Some(plugin::close_send),
    closeRecv: Some(plugin::close_recv),
    closeListen: Some(plugin::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
});

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v8_t:
    name pciPath guid ptrSupport regIsGlobal speed port latency maxComms maxRecvs netDeviceType
    netDeviceVersion
}
