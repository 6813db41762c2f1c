//! Per-lane traffic counters: what each queue pair carried, by message size, for the statistics
//! line and for placement's view of a lane's share.

/// What a comm moved, for its statistics: messages, bytes, and per QP the chunks, the failed
/// completions, and (the sender's) bytes posted and the path's measured rate.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    pub messages: u64,
    /// The sender's bytes posted on each QP (chunks sent again count again); the receiver's
    /// stay 0: it cannot tell how the sender cut a message.
    pub bytes: Vec<u64>,
    /// The receiver's bytes delivered (the sender's stay 0).
    pub delivered: u64,
    /// Chunks posted on (sender) or arrived on (receiver, counted once) each QP.
    pub chunks: Vec<u64>,
    pub errors: Vec<u64>,
    /// The sender's estimate of each QP's path: bytes per second retired while busy.
    pub rate: Vec<Option<f64>>,
    /// The lanes out now (their path or queue pair failed), those that stay out (every repair
    /// attempt failed, or repair is off), and how often each was repaired.
    pub down: Vec<bool>,
    pub kept_out: Vec<bool>,
    pub repaired: Vec<u64>,
    /// The sender's fences of each lane: failures after which the receiver said which of the
    /// lane's chunks in flight it had counted.
    pub fenced: Vec<u64>,
    /// Each lane's stalls: it completed nothing for its stall bound while another lane did,
    /// or its port went down, and it was fenced ([`super::stall`]).
    pub stalled: Vec<u64>,
    /// The sender's bytes posted on each lane by the size of their message: under 64 KiB,
    /// under 1 MiB, and larger ([`size_class`]).
    pub by_size: Vec<[u64; 3]>,
}

/// The size class of a message of `bytes` for [`Traffic::by_size`].
pub fn size_class(bytes: u64) -> usize {
    match bytes {
        0..0x1_0000 => 0,
        0x1_0000..0x10_0000 => 1,
        _ => 2,
    }
}

impl Traffic {
    pub(super) fn new(nqps: usize) -> Traffic {
        Traffic {
            messages: 0,
            bytes: vec![0; nqps],
            delivered: 0,
            chunks: vec![0; nqps],
            errors: vec![0; nqps],
            rate: vec![None; nqps],
            down: vec![false; nqps],
            kept_out: vec![false; nqps],
            repaired: vec![0; nqps],
            fenced: vec![0; nqps],
            stalled: vec![0; nqps],
            by_size: vec![[0; 3]; nqps],
        }
    }

    /// Bytes moved: the sender's posted, or the receiver's delivered.
    pub fn total(&self) -> u64 {
        self.bytes.iter().sum::<u64>() + self.delivered
    }
}
