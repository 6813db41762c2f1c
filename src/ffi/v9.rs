//! ncclNet v9: like v10 without profiler handles and without the connect config.

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: Exported<ncclNet_v9_t> = Exported(ncclNet_v9_t {
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
    isend: Some(legacy::isend_v9),
    irecv: Some(legacy::irecv_v9),
    iflush: Some(plugin::iflush),
    test: Some(plugin::test),
    closeSend: Some(plugin::close_send),
    closeRecv: Some(plugin::close_recv),
    closeListen: Some(plugin::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: Some(legacy::make_vdevice_v9),
});

// Its properties struct (v10 shares it) has these fields of the newest one.
narrow! {
    ncclNetProperties_v9_t:
    name pciPath guid ptrSupport regIsGlobal forceFlush speed port latency maxComms maxRecvs
    netDeviceType netDeviceVersion vProps maxP2pBytes maxCollBytes
}
