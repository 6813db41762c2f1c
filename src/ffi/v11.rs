//! ncclNet v11: v12 with 4 virtual-device slots and no rail/plane ids.

use super::abi::*;
use super::narrow::narrow;

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v11_t:
    name pciPath guid ptrSupport regIsGlobal forceFlush speed port latency maxComms maxRecvs
    netDeviceType netDeviceVersion vProps maxP2pBytes maxCollBytes maxMultiRequestSize
}
