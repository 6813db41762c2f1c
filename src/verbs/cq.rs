//! Completion queues, polled without blocking.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_sys as sys;

use super::device::{Context, errno};
use crate::error::{Error, Result};
use crate::wr::Completion;

pub struct Cq {
    raw: *mut sys::ibv_cq,
    ctx: Arc<Context>,
}

// SAFETY: verbs CQs may be polled from any thread; only Drop frees it.
unsafe impl Send for Cq {}
// SAFETY: as above (the provider serialises concurrent polls).
unsafe impl Sync for Cq {}

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

    /// Polls up to [`POLL_BATCH`] completions and calls `each(i, n, c)` with every one in
    /// order (`i` of `n`); returns `n`. No buffer is written for an empty poll.
    #[inline(always)]
    pub fn poll_with(&self, mut each: impl FnMut(usize, usize, &Completion)) -> Result<usize> {
        let mut wc = [const { MaybeUninit::<sys::ibv_wc>::uninit() }; POLL_BATCH];
        // SAFETY: raw is a live CQ and wc has room for POLL_BATCH entries.
        let n = unsafe { sys::ibv_poll_cq(self.raw, POLL_BATCH as i32, wc.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::verbs("ibv_poll_cq", -n, self.ctx.name()));
        }
        for (i, w) in wc[..n as usize].iter().enumerate() {
            // SAFETY: the first n entries were written by ibv_poll_cq.
            let w = unsafe { w.assume_init_ref() };
            let with_imm = w.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let imm = if with_imm {
                // SAFETY: imm_data is the union member valid when IBV_WC_WITH_IMM is set.
                Some(unsafe { w.imm_data_invalidated_rkey_union.imm_data })
            } else {
                None
            };
            let c = Completion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                imm: imm.map(u32::from_be),
                qp_num: w.qp_num,
            };
            each(i, n as usize, &c);
        }
        Ok(n as usize)
    }
}

/// Completions one [`Cq::poll_with`] takes at most.
pub const POLL_BATCH: usize = 16;

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: raw is live; every QP using it holds an Arc<Cq>, so none remain.
        let rc = unsafe { sys::ibv_destroy_cq(self.raw) };
        if rc != 0 {
            log::warn!("ibv_destroy_cq({}) failed: errno {rc}", self.ctx.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_the_ones_libibverbs_prints() {
        // Past the last status too, where both say "unknown".
        for status in 0..=40 {
            // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
            let theirs = unsafe { std::ffi::CStr::from_ptr(sys::ibv_wc_status_str(status)) };
            assert_eq!(crate::wr::status_name(status), theirs.to_str().unwrap(), "status {status}");
        }
    }
}
