//! NCCL's profiler callback (v10+ `init`) behind transport's [`Profiler`]: each event is one
//! call, with the IB descriptor (version 1) NCCL's own transport uses, so profiler plugins
//! read ferroce's events as they read NCCL's.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::abi::*;
use crate::transport::profile::{Profiler, QpEvent};

type Callback =
    unsafe extern "C" fn(*mut *mut c_void, i32, *mut c_void, i64, *mut c_void) -> ncclResult_t;

/// The callback NCCL passed `init`.
struct Nccl(Callback);

/// `pluginId`: the IB network type and the descriptor's version.
const PLUGIN_ID: i64 = (NCCL_PROFILER_NET_TYPE_IB | NCCL_PROFILER_NET_IB_VER) as i64;

/// The callback as a [`Profiler`]; `None` for a NULL callback.
pub fn of(cb: ncclProfilerCallback_t) -> Option<Arc<dyn Profiler>> {
    cb.map(|f| Arc::new(Nccl(f)) as Arc<dyn Profiler>)
}

/// A failed callback is said once: events are advisory, the data path goes on.
fn refused(what: &str, r: ncclResult_t) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if r != ncclResult_t::ncclSuccess && !SAID.swap(true, Ordering::Relaxed) {
        ::log::warn!(
            "the profiler callback returned ncclResult {} on {what}; events go on (said once)",
            r.0
        );
    }
}

impl Profiler for Nccl {
    fn start(&self, phandle: usize, e: &QpEvent) -> usize {
        let qp = ncclProfilerNetIbQp_v1_t {
            device: e.device,
            wr_id: e.wr_id,
            opcode: e.opcode,
            qpNum: e.qpn as i32,
            length: e.length as usize,
        };
        let mut descr = ncclProfilerNetIbDescr_v1_t {
            type_: ncclProfilerNetIbEventType::ncclProfileQp.0 as u8,
            __bindgen_anon_1: ncclProfilerNetIbDescr_v1_t__bindgen_ty_1 { qp },
        };
        let mut handle = null_mut();
        let start = ncclProfilerNetEventType::ncclProfilerNetEventStart.0 as i32;
        let ext = (&raw mut descr).cast();
        // SAFETY: the callback NCCL gave init, called as its ABI says: a slot for the event's
        // handle, the phandle NCCL gave this request (never NULL here), and a descriptor that
        // lives for the call.
        let r = unsafe { (self.0)(&mut handle, start, phandle as *mut c_void, PLUGIN_ID, ext) };
        refused("start", r);
        handle as usize
    }

    fn stop(&self, event: usize) {
        let mut handle = event as *mut c_void;
        let stop = ncclProfilerNetEventType::ncclProfilerNetEventStop.0 as i32;
        // SAFETY: as above; the handle is the one its start returned, passed back once.
        let r = unsafe { (self.0)(&mut handle, stop, null_mut(), 0, null_mut()) };
        refused("stop", r);
    }
}
