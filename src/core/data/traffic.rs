//! Per-lane traffic counters: what each queue pair carried, by message size, for the statistics
//! line and for placement's view of a lane's share.

/// What a comm moved, for its statistics: messages, bytes, and a record per QP.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    pub messages: u64,
    /// The receiver's bytes delivered (the sender's stay 0).
    pub delivered: u64,
    /// One record per QP: one allocation per comm, not one per counter.
    pub lanes: Vec<LaneTraffic>,
}

/// What one QP carried, and what happened to it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaneTraffic {
    /// The sender's bytes posted (chunks sent again count again); the receiver's stay 0: it
    /// cannot tell how the sender cut a message.
    pub bytes: u64,
    /// Chunks posted (sender) or arrived (receiver, counted once).
    pub chunks: u64,
    pub errors: u64,
    /// The sender's estimate of the path: bytes per second retired while busy.
    pub rate: Option<f64>,
    /// Out now (its path or queue pair failed), out for good (every repair attempt failed,
    /// or repair is off), and how often it was repaired.
    pub down: bool,
    pub kept_out: bool,
    pub repaired: u64,
    /// The sender's fences of it, each answered by the receiver with what it had counted of
    /// the lane's chunks in flight: one per failure, and one per failed repair attempt.
    pub fenced: u64,
    /// Its stalls: it completed nothing for its stall bound while another lane did, or its
    /// port went down, and it was fenced ([`super::stall`]).
    pub stalled: u64,
    /// The sender's bytes posted by the size of their message: under 64 KiB, under 1 MiB, and
    /// larger ([`size_class`]).
    pub by_size: [u64; 3],
}

/// The size class of a message of `bytes` for [`LaneTraffic::by_size`].
pub fn size_class(bytes: u64) -> usize {
    match bytes {
        0..0x1_0000 => 0,
        0x1_0000..0x10_0000 => 1,
        _ => 2,
    }
}

impl Traffic {
    pub(super) fn new(nqps: usize) -> Traffic {
        Traffic { messages: 0, delivered: 0, lanes: vec![LaneTraffic::default(); nqps] }
    }

    /// Bytes moved: the sender's posted, or the receiver's delivered.
    pub fn total(&self) -> u64 {
        self.sum(|l| l.bytes) + self.delivered
    }

    /// One counter summed over the lanes.
    pub fn sum(&self, counter: impl Fn(&LaneTraffic) -> u64) -> u64 {
        self.lanes.iter().map(counter).sum()
    }

    /// One counter of each lane, in lane order.
    pub fn each<T>(&self, counter: impl Fn(&LaneTraffic) -> T) -> Vec<T> {
        self.lanes.iter().map(counter).collect()
    }
}
