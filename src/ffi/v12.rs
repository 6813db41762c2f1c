//! ncclNet v12, the newest ABI: the table of [`plugin`]'s entry points as they are.

use super::abi::*;
use super::{Exported, PLUGIN_NAME, plugin};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v12: Exported<ncclNet_v12_t> = Exported(ncclNet_v12_t {
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
    getDeviceMr: None,   // host plugin: no device-side handles
    irecvConsumed: None, // must stay NULL for a host plugin
    makeVDevice: Some(plugin::make_vdevice),
    finalize: Some(plugin::finalize),
    setNetAttr: None,
});
