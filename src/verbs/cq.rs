//! Completion queues, polled without blocking.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};

pub struct Cq {
    raw: *mut sys::ibv_cq,
    ctx: Arc<Context>,
}

// SAFETY: verbs CQs may be polled from any thread; only Drop frees it.
unsafe impl Send for Cq {}
// SAFETY: as above (the provider serialises concurrent polls).
unsafe impl Sync for Cq {}

/// One work completion, reduced to what callers use.
#[derive(Clone, Copy, Debug, Default)]
pub struct Completion {
    pub wr_id: u64,
    /// `ibv_wc_status`: 0 is success.
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// The immediate data, in host order, when the completion carries one.
    pub imm: Option<u32>,
    pub qp_num: u32,
}

/// `IBV_WC_RECV_RDMA_WITH_IMM`.
pub const WC_RECV_RDMA_WITH_IMM: u32 = 129;

impl Cq {
    pub fn new(ctx: &Arc<Context>, cqe: i32) -> Result<Arc<Cq>> {
        // SAFETY: ctx is open; no channel, no context pointer.
        let raw = unsafe {
            sys::ibv_create_cq(ctx.raw(), cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        if raw.is_null() {
            return Err(Error::verbs("ibv_create_cq", errno(), ctx.name()));
        }
        Ok(Arc::new(Cq { raw, ctx: ctx.clone() }))
    }

    pub(super) fn raw(&self) -> *mut sys::ibv_cq {
        self.raw
    }

    /// What names this CQ in an asynchronous `CQ_ERR` event (its address; stable while it lives).
    pub fn id(&self) -> usize {
        self.raw as usize
    }

    /// Polls up to `out.len()` (at most 16) completions; returns how many were written.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let mut wc = [const { MaybeUninit::<sys::ibv_wc>::uninit() }; 16];
        let max = out.len().min(wc.len()) as i32;
        // SAFETY: raw is a live CQ and wc has room for `max` entries.
        let n = unsafe { sys::ibv_poll_cq(self.raw, max, wc.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::verbs("ibv_poll_cq", -n, self.ctx.name()));
        }
        for (o, w) in out.iter_mut().zip(&wc[..n as usize]) {
            // SAFETY: the first n entries were written by ibv_poll_cq.
            let w = unsafe { w.assume_init_ref() };
            let with_imm = w.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            *o = Completion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                // SAFETY: imm_data is the union member valid when IBV_WC_WITH_IMM is set.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
                qp_num: w.qp_num,
            };
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: raw is live; every QP using it holds an Arc<Cq>, so none remain.
        let rc = unsafe { sys::ibv_destroy_cq(self.raw) };
        if rc != 0 {
            log::warn!("ibv_destroy_cq({}) failed: errno {rc}", self.ctx.name());
        }
    }
}

/// A readable name for an `ibv_wc_status`.
pub fn status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-NULL static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
