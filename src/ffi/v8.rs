//! ncclNet v8: `int` sizes in `isend`/`irecv`, no virtual devices in the properties.

use super::abi::*;
use super::narrow::narrow;

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v8_t:
    name pciPath guid ptrSupport regIsGlobal speed port latency maxComms maxRecvs netDeviceType
    netDeviceVersion
}
