//! Which entry point fills each member of an exported table, by the member's signature: one
//! impl of [`Entry`] per member and signature it has had, so each version's table is written
//! from its type alone (`tables!` in `mod.rs`). The entry points are `plugin`'s, written
//! against the newest signatures, or shims: `legacy`'s, which several versions share, and those
//! of the one version that has a signature (their impls sit in that version's file).
//!
//! The markers are named after the members, so the tables can name them by field.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::legacy;
use super::narrow::Narrow;
use super::plugin;

/// What fills a member of signature `F` (`None`: it stays NULL).
pub trait Entry<F> {
    const FN: Option<F>;
}

/// `$member`'s entry point for each signature listed.
macro_rules! entries {
    ($($member:ident { $(fn($($p:ty),*) => $f:expr;)* })*) => {$($(
        impl $crate::ffi::entries::Entry<unsafe extern "C" fn($($p),*) -> ncclResult_t>
            for $crate::ffi::entries::$member
        {
            const FN: Option<unsafe extern "C" fn($($p),*) -> ncclResult_t> = Some($f);
        }
    )*)*};
}
pub(super) use entries;

pub struct init;
pub struct devices;
pub struct getProperties;
pub struct listen;
pub struct connect;
pub struct accept;
pub struct regMr;
pub struct regMrDmaBuf;
pub struct deregMr;
pub struct isend;
pub struct irecv;
pub struct iflush;
pub struct test;
pub struct closeSend;
pub struct closeRecv;
pub struct closeListen;
pub struct getDeviceMr;
pub struct irecvConsumed;
pub struct makeVDevice;
pub struct finalize;
pub struct setNetAttr;

pub type Ptr = *mut c_void;
pub type DevComm = *mut *mut ncclNetDeviceHandle_v7_t;

entries! {
    init {
        fn(ncclDebugLogger_t) => legacy::init;
        fn(*mut Ptr, u64, *mut ncclNetCommConfig_v10_t, ncclDebugLogger_t, ncclProfilerCallback_t)
            => plugin::init;
    }
    devices {
        fn(*mut c_int) => plugin::devices;
    }
    listen {
        fn(c_int, Ptr, *mut Ptr) => legacy::listen;
        fn(Ptr, c_int, Ptr, *mut Ptr) => plugin::listen;
    }
    connect {
        fn(c_int, Ptr, *mut Ptr, DevComm) => legacy::connect;
        fn(Ptr, c_int, Ptr, *mut Ptr, DevComm) => plugin::connect;
    }
    accept {
        fn(Ptr, *mut Ptr, DevComm) => plugin::accept;
    }
    regMr {
        fn(Ptr, Ptr, c_int, c_int, *mut Ptr) => legacy::reg_mr_int;
        fn(Ptr, Ptr, usize, c_int, *mut Ptr) => plugin::reg_mr;
    }
    regMrDmaBuf {
        fn(Ptr, Ptr, usize, c_int, u64, c_int, *mut Ptr) => plugin::reg_mr_dma_buf;
    }
    deregMr {
        fn(Ptr, Ptr) => plugin::dereg_mr;
    }
    isend {
        fn(Ptr, Ptr, c_int, c_int, Ptr, *mut Ptr) => legacy::isend_int;
        fn(Ptr, Ptr, usize, c_int, Ptr, *mut Ptr) => legacy::isend_v9;
        fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, *mut Ptr) => plugin::isend;
    }
    irecv {
        fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut c_int, *mut Ptr, *mut Ptr) => legacy::irecv_int;
        fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr) => legacy::irecv_v9;
        fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr, *mut Ptr)
            => plugin::irecv;
    }
    iflush {
        fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut Ptr, *mut Ptr) => plugin::iflush;
    }
    test {
        fn(Ptr, *mut c_int, *mut c_int) => plugin::test;
    }
    closeSend {
        fn(Ptr) => plugin::close_send;
    }
    closeRecv {
        fn(Ptr) => plugin::close_recv;
    }
    closeListen {
        fn(Ptr) => plugin::close_listen;
    }
    makeVDevice {
        fn(*mut c_int, *mut ncclNetVDeviceProps_v9_t) => legacy::make_vdevice_v9;
        fn(*mut c_int, *mut ncclNetVDeviceProps_v12_t) => plugin::make_vdevice;
    }
    finalize {
        fn(Ptr) => plugin::finalize;
    }
}

/// Every version's properties struct, narrowed from the newest.
impl<P: Narrow<ncclNetProperties_v12_t>> Entry<unsafe extern "C" fn(c_int, *mut P) -> ncclResult_t>
    for getProperties
{
    const FN: Option<unsafe extern "C" fn(c_int, *mut P) -> ncclResult_t> =
        Some(plugin::get_properties);
}

/// A host plugin has no device-side handles: NCCL requires `getDeviceMr` and `irecvConsumed`
/// to stay NULL. `setNetAttr` is optional; ferroce does not take NCCL's hints.
impl<F> Entry<F> for getDeviceMr {
    const FN: Option<F> = None;
}
impl<F> Entry<F> for irecvConsumed {
    const FN: Option<F> = None;
}
impl<F> Entry<F> for setNetAttr {
    const FN: Option<F> = None;
}
