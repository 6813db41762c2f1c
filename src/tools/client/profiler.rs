//! A test profiler: an ncclProfilerCallback that records every net event it is given, as a
//! profiler plugin behind NCCL's core would see them, so tests can check what the plugin
//! reports. Events are process-wide, as NCCL's callback is.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use ferroce::ffi::abi::*;

/// One start event and what happened to it.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub phandle: usize,
    pub plugin_id: i64,
    pub kind: u8,
    pub device: i32,
    pub wr_id: u64,
    pub opcode: i32,
    pub qpn: u32,
    pub length: usize,
    /// How many times it was stopped.
    pub stops: u32,
}

struct Log {
    events: Vec<Event>,
    /// Calls that broke the contract: a NULL handle or descriptor, an unknown type, a stop of
    /// an unknown event.
    misuse: Vec<String>,
}

static LOG: Mutex<Log> = Mutex::new(Log { events: Vec::new(), misuse: Vec::new() });

fn log() -> std::sync::MutexGuard<'static, Log> {
    LOG.lock().unwrap_or_else(|p| p.into_inner())
}

/// The callback to pass `init`.
pub fn callback() -> ncclProfilerCallback_t {
    Some(record)
}

/// The events recorded so far (kept).
pub fn snapshot() -> Vec<Event> {
    log().events.clone()
}

/// The events recorded since the last call, and the calls that broke the contract. Only
/// between comms: the plugin's open events hold numbers into the list.
pub fn take() -> (Vec<Event>, Vec<String>) {
    let mut l = log();
    (std::mem::take(&mut l.events), std::mem::take(&mut l.misuse))
}

/// Start: records the event and hands back its number (from 1) as the event handle; stop:
/// counts the stop of the event whose handle it is given.
unsafe extern "C" fn record(
    e_handle: *mut *mut c_void,
    kind: c_int,
    p_handle: *mut c_void,
    plugin_id: i64,
    ext: *mut c_void,
) -> ncclResult_t {
    let mut l = log();
    if e_handle.is_null() {
        l.misuse.push(format!("type {kind} without an event handle slot"));
        return ncclResult_t::ncclInvalidArgument;
    }
    match kind {
        0 => {
            if p_handle.is_null() || ext.is_null() {
                l.misuse.push(format!("start with pHandle {p_handle:?} and descriptor {ext:?}"));
                return ncclResult_t::ncclInvalidArgument;
            }
            // SAFETY: the plugin passes its descriptor (IB, version 1) for the call.
            let d = unsafe { &*ext.cast::<ncclProfilerNetIbDescr_v1_t>() };
            // SAFETY: `qp` is the union's only member.
            let qp = unsafe { d.__bindgen_anon_1.qp };
            l.events.push(Event {
                phandle: p_handle as usize,
                plugin_id,
                kind: d.type_,
                device: qp.device,
                wr_id: qp.wr_id,
                opcode: qp.opcode,
                qpn: qp.qpNum as u32,
                length: qp.length,
                stops: 0,
            });
            let n = l.events.len();
            // SAFETY: checked non-NULL; the plugin gives a slot for the handle.
            unsafe { *e_handle = n as *mut c_void };
        }
        1 => {
            // SAFETY: as above.
            let n = unsafe { *e_handle } as usize;
            match n.checked_sub(1).and_then(|i| l.events.get_mut(i)) {
                Some(e) => e.stops += 1,
                None => l.misuse.push(format!("stop of unknown event {n}")),
            }
        }
        k => l.misuse.push(format!("event type {k}")),
    }
    ncclResult_t::ncclSuccess
}
