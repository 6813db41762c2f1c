//! ncclNet v10: no per-communicator context (`init` once per load, no `finalize`); `connect`
//! receives the communicator config instead.

use std::ffi::{c_int, c_void};

use super::abi::*;
use super::entries::{DevComm, Ptr, entries};
use super::{legacy, plugin};

entries! {
    init {
        fn(ncclDebugLogger_t, ncclProfilerCallback_t) => init;
    }
    connect {
        fn(c_int, *mut ncclNetCommConfig_v10_t, Ptr, *mut Ptr, DevComm) => connect;
    }
}

unsafe extern "C" fn init(logger: ncclDebugLogger_t, prof: ncclProfilerCallback_t) -> ncclResult_t {
    legacy::init_with(logger, prof)
}

unsafe extern "C" fn connect(
    dev: c_int,
    config: *mut ncclNetCommConfig_v10_t,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
    let tc = unsafe { config.as_ref() }.map(|c| c.trafficClass);
    // SAFETY: forwarded under the same contract; the legacy context lives with the library.
    unsafe { plugin::connect_with(legacy::ctx(), tc, dev, handle, send_comm) }
}
