//! ncclNet v7: v8 with an `int` size in `regMr` and no `regIsGlobal`.

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v7: Exported<ncclNet_v7_t> = Exported(ncclNet_v7_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(legacy::init),
    devices: Some(plugin::devices),
    getProperties: Some(plugin::get_properties),
    listen: Some(legacy::listen),
    connect: Some(legacy::connect),
    accept: Some(plugin::accept),
    regMr: Some(legacy::reg_mr_int),
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
    ncclNetProperties_v7_t:
    name pciPath guid ptrSupport speed port latency maxComms maxRecvs netDeviceType
    netDeviceVersion
}
