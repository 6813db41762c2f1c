//! ncclNet v11: v12 with 4 virtual-device slots and no rail/plane ids.

use std::ffi::c_int;

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, v12};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: Exported<ncclNet_v11_t> = Exported(ncclNet_v11_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(v12::init),
    devices: Some(v12::devices),
    getProperties: Some(get_properties),
    listen: Some(v12::listen),
    connect: Some(v12::connect),
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
    finalize: Some(v12::finalize),
    setNetAttr: None,
});

unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v11_t,
) -> ncclResult_t {
    legacy::get_properties(dev, props, |p| ncclNetProperties_v11_t {
        vProps: legacy::vprops_v9(&p.vProps),
        ..narrow!(
            p,
            ncclNetProperties_v11_t {
                name,
                pciPath,
                guid,
                ptrSupport,
                regIsGlobal,
                forceFlush,
                speed,
                port,
                latency,
                maxComms,
                maxRecvs,
                netDeviceType,
                netDeviceVersion,
                maxP2pBytes,
                maxCollBytes,
                maxMultiRequestSize
            }
        )
    })
}
