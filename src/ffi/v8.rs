//! ncclNet v8: `int` sizes in `isend`/`irecv`, no virtual devices in the properties.

use std::ffi::c_int;

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: Exported<ncclNet_v8_t> = Exported(ncclNet_v8_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(legacy::init),
    devices: Some(plugin::devices),
    getProperties: Some(get_properties),
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

unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v8_t,
) -> ncclResult_t {
    legacy::get_properties(dev, props, |p| {
        narrow!(
            p,
            ncclNetProperties_v8_t {
                name,
                pciPath,
                guid,
                ptrSupport,
                regIsGlobal,
                speed,
                port,
                latency,
                maxComms,
                maxRecvs,
                netDeviceType,
                netDeviceVersion
            }
        )
    })
}
