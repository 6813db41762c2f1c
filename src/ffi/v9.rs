//! ncclNet v9: like v10 without profiler handles and without the connect config.

use super::abi::*;
use super::narrow::narrow;

// Its properties struct (v10 shares it) has these fields of the newest one.
narrow! {
    ncclNetProperties_v9_t:
    name pciPath guid ptrSupport regIsGlobal forceFlush speed port latency maxComms maxRecvs
    netDeviceType netDeviceVersion vProps maxP2pBytes maxCollBytes
}
