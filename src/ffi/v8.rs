//! ncclNet v8: `int` sizes in `isend`/`irecv`, no virtual devices in the properties.

use std::ffi::c_int;

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, v9, v12};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: Exported<ncclNet_v8_t> = Exported(ncclNet_v8_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(v9::init),
    devices: Some(v12::devices),
    getProperties: Some(get_properties),
    listen: Some(legacy::listen),
    connect: Some(legacy::connect),
    accept: Some(v12::accept),
    regMr: Some(v12::reg_mr),
    regMrDmaBuf: Some(v12::reg_mr_dma_buf),
    deregMr: Some(v12::dereg_mr),
    isend: Some(legacy::isend_int),
    irecv: Some(legacy::irecv_int),
    iflush: Some(v12::iflush),
    test: Some(v12::test),
    closeSend: Some(v12::close_send),
    closeRecv: Some(v12::close_recv),
    closeListen: Some(v12::close_listen),
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
