//! ncclNet v7: v8 with an `int` size in `regMr` and no `regIsGlobal`.

use super::abi::*;
use super::narrow::narrow;

// Its properties struct has these fields of the newest one.
narrow! {
    ncclNetProperties_v7_t:
    name pciPath guid ptrSupport speed port latency maxComms maxRecvs netDeviceType
    netDeviceVersion
}
