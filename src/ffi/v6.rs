//! ncclNet v6: no device handles in `connect`/`accept`, no device type in the properties.

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::legacy::{self, narrow};
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v6: Exported<ncclNet_v6_t> = Exported(ncclNet_v6_t {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(legacy::init),
    devices: Some(plugin::devices),
    getProperties: Some(plugin::get_properties),
    listen: Some(legacy::listen),
    connect: Some(connect),
    accept: Some(accept),
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
});

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v6_t:
    name pciPath guid ptrSupport speed port latency maxComms maxRecvs
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: forwarded unchanged; a host plugin needs no device handle.
    unsafe { legacy::connect(dev, handle, send_comm, std::ptr::null_mut()) }
}

unsafe extern "C" fn accept(listen_comm: *mut c_void, recv_comm: *mut *mut c_void) -> ncclResult_t {
    // SAFETY: forwarded unchanged; a host plugin needs no device handle.
    unsafe { plugin::accept(listen_comm, recv_comm, std::ptr::null_mut()) }
}
