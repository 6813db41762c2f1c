//! Work requests and completions as plain data: what the data-path core ([`crate::data`])
//! asks to post and what it is fed back, and the names of completion statuses.
//!
//! Invariants: no dependency beyond `core`, no `unsafe`, no I/O (the compiler enforces the
//! `unsafe` part), so the core can be driven by tests with no RDMA stack at all. `verbs`
//! translates these to and from `ibv_send_wr` and `ibv_wc`; its tests check [`status_name`]
//! against libibverbs' own `ibv_wc_status_str`, so the two cannot drift.
//!
//! Callers: [`crate::data`], and in the plugin `verbs` (posting, polling) and `transport::data`,
//! which feeds the core.

/// The most work requests one post chains together.
pub const MAX_CHAIN: usize = 16;

/// The operation of one send work request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Op {
    #[default]
    Write,
    /// RDMA write that also consumes a receive at the peer and delivers `imm` (host order).
    WriteImm(u32),
    Read,
}

/// One send work request; `local` is `(addr, len, lkey)`, absent for a zero-byte operation.
/// `inline`: the provider copies the bytes at post time; one longer than the QP's `max_inline`
/// goes from its registered memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: Op,
    pub signaled: bool,
    pub local: Option<(u64, u32, u32)>,
    pub remote_addr: u64,
    pub rkey: u32,
    pub inline: bool,
}

/// One work completion, reduced to what callers use.
#[derive(Clone, Copy, Debug, Default)]
pub struct Completion {
    pub wr_id: u64,
    /// `ibv_wc_status`: 0 is success; [`status_name`] reads it.
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// The immediate data, in host order, when the completion carries one.
    pub imm: Option<u32>,
    pub qp_num: u32,
}

/// The name libibverbs gives an `ibv_wc_status` value (what `ibv_wc_status_str` returns), for
/// error messages: a table rather than the library call keeps the core free of FFI.
pub fn status_name(status: u32) -> &'static str {
    match status {
        0 => "success",
        1 => "local length error",
        2 => "local QP operation error",
        3 => "local EE context operation error",
        4 => "local protection error",
        5 => "Work Request Flushed Error",
        6 => "memory management operation error",
        7 => "bad response error",
        8 => "local access error",
        9 => "remote invalid request error",
        10 => "remote access error",
        11 => "remote operation error",
        12 => "transport retry counter exceeded",
        13 => "RNR retry counter exceeded",
        14 => "local RDD violation error",
        15 => "remote invalid RD request",
        16 => "aborted error",
        17 => "invalid EE context number",
        18 => "invalid EE context state",
        19 => "fatal error",
        20 => "response timeout error",
        21 => "general error",
        22 => "TM error",
        23 => "TM software rendezvous",
        _ => "unknown",
    }
}
