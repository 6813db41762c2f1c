//! ncclNet v6: no device handles in `connect`/`accept`, no device type in the properties.

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::entries::{Ptr, entries};
use super::legacy;
use super::narrow::narrow;
use super::plugin;

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v6_t:
    name pciPath guid ptrSupport speed port latency maxComms maxRecvs
}

entries! {
    connect {
        fn(c_int, Ptr, *mut Ptr) => connect;
    }
    accept {
        fn(Ptr, *mut Ptr) => accept;
    }
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
