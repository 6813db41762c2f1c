//! ncclNet v11: v12 with 4 virtual-device slots and no rail/plane ids.

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: Exported<ncclNet_v11_t> = Exported(ncclNet_v11_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(plugin::init),
    devices: Some(plugin::devices),
    getProperties: Some(plugin::get_properties),
    listen: Some(plugin::listen),
    connect: Some(plugin::connect),
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
    finalize: Some(plugin::finalize),
    setNetAttr: None,
});

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v11_t:
    name pciPath guid ptrSupport regIsGlobal forceFlush speed port latency maxComms maxRecvs
    netDeviceType netDeviceVersion vProps maxP2pBytes maxCollBytes maxMultiRequestSize
}
