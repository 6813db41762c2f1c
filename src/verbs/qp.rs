//! Reliable-connected queue pairs: creation, the INIT → RTR → RTS transitions, and posting.
//!
//! Posting builds the work-request chain on the stack: no allocation on the data path.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_sys as sys;

use super::cq::Cq;
use super::device::errno;
use super::pd::Pd;
use crate::error::{Error, Result};
use crate::wr::{MAX_CHAIN, Op, SendWr};

pub struct Qp {
    raw: *mut sys::ibv_qp,
    qpn: u32,
    max_inline: u32,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

// SAFETY: verbs QPs may be used from any thread; posting is serialised by the provider.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

#[derive(Clone, Copy, Debug)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    /// Inline payload to ask for; the QP gets what the device grants (see [`Qp::max_inline`]).
    pub max_inline: u32,
}

/// What the RTR transition needs: the remote end and the path to it.
#[derive(Clone, Copy, Debug)]
pub struct RtrAttr {
    pub port: u8,
    /// `ibv_mtu` enum value.
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub flow_label: u32,
    pub traffic_class: u8,
    pub sl: u8,
    /// The first packet sequence number expected from the peer.
    pub rq_psn: u32,
}

/// What the RTS transition needs: the retry policy.
#[derive(Clone, Copy, Debug)]
pub struct RtsAttr {
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// The first packet sequence number this QP sends.
    pub sq_psn: u32,
}

fn zeroed_attr() -> sys::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain data for which all-zero bytes are valid.
    unsafe { MaybeUninit::zeroed().assume_init() }
}

use sys::ibv_qp_attr_mask as M;

impl Qp {
    /// An RC QP. A device that refuses the inline size asked for is asked again for 64 bytes,
    /// then none: inline is an optimisation, never a requirement.
    pub fn create_rc(pd: &Arc<Pd>, cq: &Arc<Cq>, caps: QpCaps) -> Result<Qp> {
        let create = |inline: u32| {
            // SAFETY: all-zero is a valid ibv_qp_init_attr; the fields we need are set below.
            let mut init: sys::ibv_qp_init_attr = unsafe { MaybeUninit::zeroed().assume_init() };
            init.send_cq = cq.raw();
            init.recv_cq = cq.raw();
            init.cap.max_send_wr = caps.max_send_wr;
            init.cap.max_recv_wr = caps.max_recv_wr;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            init.cap.max_inline_data = inline;
            init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
            // SAFETY: pd is live and init is valid; the QP holds Arcs to its PD and CQ.
            let raw = unsafe { sys::ibv_create_qp(pd.raw(), &mut init) };
            // ibv_create_qp writes back what the device granted.
            (raw, init.cap.max_inline_data)
        };
        let (mut raw, mut max_inline) = create(caps.max_inline);
        for smaller in [64, 0] {
            if raw.is_null() && caps.max_inline > smaller {
                (raw, max_inline) = create(smaller);
            }
        }
        if raw.is_null() {
            return Err(Error::verbs("ibv_create_qp", errno(), pd.context().name()));
        }
        // SAFETY: raw is a valid QP.
        let qpn = unsafe { (*raw).qp_num };
        Ok(Qp { raw, qpn, max_inline, pd: pd.clone(), _cq: cq.clone() })
    }

    /// The inline payload this QP takes, in bytes.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Moves the QP to `state` (its name, for the error only: formatted when one occurs).
    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, state: &str) -> Result<()> {
        // SAFETY: the QP is live and attr is a fully initialised ibv_qp_attr.
        let rc = unsafe { sys::ibv_modify_qp(self.raw, attr, mask as i32) };
        if rc != 0 {
            let what = format!("{} QP {:#x} to {state}", self.pd.context().name(), self.qpn);
            return Err(Error::verbs("ibv_modify_qp", rc, &what));
        }
        Ok(())
    }

    pub fn to_init(&self, port: u8, access: u32) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = access;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_PKEY_INDEX.0
            | M::IBV_QP_PORT.0
            | M::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut a, mask, "INIT")
    }

    pub fn to_rtr(&self, r: &RtrAttr) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = r.path_mtu;
        a.dest_qp_num = r.dest_qpn;
        a.rq_psn = r.rq_psn & 0xff_ffff;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = r.dgid;
        a.ah_attr.grh.sgid_index = r.sgid_index;
        a.ah_attr.grh.flow_label = r.flow_label;
        a.ah_attr.grh.hop_limit = 255;
        a.ah_attr.grh.traffic_class = r.traffic_class;
        a.ah_attr.sl = r.sl;
        a.ah_attr.port_num = r.port;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_AV.0
            | M::IBV_QP_PATH_MTU.0
            | M::IBV_QP_DEST_QPN.0
            | M::IBV_QP_RQ_PSN.0
            | M::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | M::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut a, mask, "RTR")
    }

    pub fn to_rts(&self, r: &RtsAttr) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = r.sq_psn & 0xff_ffff;
        a.timeout = r.timeout;
        a.retry_cnt = r.retry_cnt;
        a.rnr_retry = r.rnr_retry;
        a.max_rd_atomic = 1;
        let mask = M::IBV_QP_STATE.0
            | M::IBV_QP_SQ_PSN.0
            | M::IBV_QP_TIMEOUT.0
            | M::IBV_QP_RETRY_CNT.0
            | M::IBV_QP_RNR_RETRY.0
            | M::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut a, mask, "RTS")
    }

    /// Moves the QP to ERR so outstanding work requests flush before it is destroyed.
    pub fn to_error(&self) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, M::IBV_QP_STATE.0, "ERR")
    }

    /// Posts up to [`MAX_CHAIN`] send work requests as one chain. Only the entries used are
    /// written: nothing is zeroed per post.
    #[inline(always)]
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        assert!(wrs.len() <= MAX_CHAIN, "post_send chain of {} > {MAX_CHAIN}", wrs.len());
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges = [const { MaybeUninit::<sys::ibv_sge>::uninit() }; MAX_CHAIN];
        let mut chain = [const { MaybeUninit::<sys::ibv_send_wr>::uninit() }; MAX_CHAIN];
        let base = chain.as_mut_ptr().cast::<sys::ibv_send_wr>();
        // Taken at the first inline entry and held until the provider has copied the inline
        // bytes: no registration it vouched for goes meanwhile.
        let mut cpu = None;
        for (i, w) in wrs.iter().enumerate() {
            let (sg_list, num_sge) = match w.local {
                Some((addr, length, lkey)) => {
                    (sges[i].write(sys::ibv_sge { addr, length, lkey }) as *mut _, 1)
                }
                None => (std::ptr::null_mut(), 0),
            };
            let (opcode, imm) = match w.op {
                Op::Write => (sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0),
                Op::WriteImm(imm) => (sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, imm.to_be()),
                Op::Read => (sys::ibv_wr_opcode::IBV_WR_RDMA_READ, 0),
            };
            let mut flags = 0;
            if w.signaled {
                flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if let Some((addr, len, lkey)) = w.local.filter(|l| w.inline && l.1 <= self.max_inline)
            {
                // The provider copies inline data with the CPU: only from memory registered as
                // host memory, never GPU memory or memory that is not ours.
                if !cpu.get_or_insert_with(|| self.pd.cpu_readable()).covers(lkey, addr, len) {
                    return Err(Error::Internal(format!(
                        "inline send of {len} bytes at {addr:#x} (lkey {lkey:#x}): no \
                         registration of host memory covers it"
                    )));
                }
                flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            // The next entry (inside the array: i + 1 < wrs.len() <= MAX_CHAIN), or the end.
            let next =
                if i + 1 < wrs.len() { base.wrapping_add(i + 1) } else { std::ptr::null_mut() };
            // SAFETY: i < MAX_CHAIN: inside the array, which is reached only through `base`
            // from here on (so the pointers the provider follows stay valid); all-zero is a
            // valid ibv_send_wr, and every field the provider reads for an RDMA write or read
            // is set right after, in place.
            let c = unsafe {
                base.add(i).write(MaybeUninit::zeroed().assume_init());
                &mut *base.add(i)
            };
            c.wr_id = w.wr_id;
            c.next = next;
            c.sg_list = sg_list;
            c.num_sge = num_sge;
            c.opcode = opcode;
            c.send_flags = flags;
            c.imm_data_invalidated_rkey_union.imm_data = imm;
            c.wr.rdma = sys::rdma_t { remote_addr: w.remote_addr, rkey: w.rkey };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the first wrs.len() entries of the chain and their SGEs are initialised and
        // live on this stack frame for the duration of the call; inline payloads are copied by
        // the provider during it, and the other registered buffers are kept alive by the
        // caller until completion.
        let rc = unsafe { sys::ibv_post_send(self.raw, base, &mut bad) };
        drop(cpu);
        if rc != 0 {
            return Err(Error::verbs("ibv_post_send", rc, &format!("QP {:#x}", self.qpn)));
        }
        Ok(())
    }

    /// Posts `n` receives of id `wr_id` with no buffer (each only absorbs an RDMA write with
    /// immediate), as chains of up to [`MAX_CHAIN`].
    pub fn post_recv(&self, wr_id: u64, n: usize) -> Result<()> {
        // SAFETY: all-zero is a valid ibv_recv_wr (no SGEs, no next).
        let mut chain: [sys::ibv_recv_wr; MAX_CHAIN] =
            unsafe { MaybeUninit::zeroed().assume_init() };
        let mut left = n;
        while left > 0 {
            let len = left.min(MAX_CHAIN);
            let base = chain.as_mut_ptr();
            for i in 0..len {
                // SAFETY: i < len <= MAX_CHAIN, inside the array; only `base` reaches it here.
                let wr = unsafe { &mut *base.add(i) };
                wr.wr_id = wr_id;
                // The next entry (inside the array: i + 1 < len), or the chain's end.
                wr.next = if i + 1 < len { base.wrapping_add(i + 1) } else { std::ptr::null_mut() };
            }
            let mut bad = std::ptr::null_mut();
            // SAFETY: the first `len` entries are initialised and linked, and live for the call;
            // the QP is live.
            let rc = unsafe { sys::ibv_post_recv(self.raw, base, &mut bad) };
            if rc != 0 {
                return Err(Error::verbs("ibv_post_recv", rc, &format!("QP {:#x}", self.qpn)));
            }
            left -= len;
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: raw is live and destroyed once; its CQ and PD outlive it (Arcs held).
        let rc = unsafe { sys::ibv_destroy_qp(self.raw) };
        if rc != 0 {
            log::warn!("ibv_destroy_qp({:#x}) failed: errno {rc}", self.qpn);
        }
    }
}
