//! The two ranks of `ferroce perf`, and the protocol their orchestrator drives them with; also
//! how `ferroce doctor --peer` reaches a `ferroce perf --listen` on another host.
//!
//! Two ranks are two processes, as in NCCL: the orchestrator runs `ferroce perf-rank send|recv`
//! twice (or reaches the receiving one over TCP) and talks to each one line per message
//! ([`pair::Pair`]). Each rank loads the plugin with `dlopen`, drives its v12 ABI through
//! [`Driver`](ferroce_tools::driver::Driver), listens on its device and says `HANDLE hex name
//! index`; told `PEER hex`, it connects to the other's handle (which the orchestrator relays),
//! so each rank has a send comm and a receive comm, registers its two buffers once and says
//! `READY`. Then it runs the commands it gets ([`serve`]).
//!
//! A rank polls as NCCL's proxy thread does. The proxy keeps `NCCL_STEPS` (8) receives posted
//! ahead per channel, one `irecv` per step (never several steps in one call); it spins over its
//! operations, and in each pass it first posts what it may, then tests only the oldest
//! outstanding request of each direction, once. It posts a step's receive again only when the
//! step's buffer is free (its message was seen) and its request was tested done. It yields the
//! CPU after a pass that moved nothing and after every 8th pass in a row that did
//! ([`Stall::nccl`](ferroce_tools::wait::Stall::nccl)). The depth (the receives posted ahead)
//! comes with each command.
//!
//! - `BW size window seconds warm-up [MESSAGES]`: rank 0 sends, rank 1 receives. The receiver
//!   keeps `window` receives posted ahead and the sender `window` sends in flight. The
//!   receiver's clock decides: after a warm-up it times whole messages from one completion to
//!   the first completion `seconds` later, then stops posting and names the number of receives
//!   it posted (`POSTED n`); the orchestrator relays that to the sender (`STOP n`), which sends
//!   exactly that many. Nothing stays posted, and the drain is not timed. The optional
//!   `MESSAGES` ends the timing after that many messages if the time has not ended it first
//!   (`ferroce doctor --peer --selftest`).
//! - `LAT size iterations warm-up depth simple|ll`: ping-pong with `depth` receives posted ahead
//!   on each side ([`pingpong`]). Rank 0 stamps each ping; a sample is half the time between
//!   two pings (perftest's method), so everything the application does in a round trip counts.
//!   Rank 0 replies with the median (p50), the mean and the fastest sample.
//!   - `simple` (NCCL's Simple protocol): a message has arrived when its receive tests done.
//!   - `ll` (NCCL's LL and LL128): receives are optional (`NCCL_NET_OPTIONAL_RECV_COMPLETION`),
//!     so the plugin may call them done before the data is there; in NCCL the GPU sees the data
//!     arrive through flags inside it. Here the sender stamps a flag that changes with every
//!     message into the last byte of its buffer, and the receiver watches for it in its own
//!     buffer (a volatile read per pass) while it keeps testing the oldest receive, as the proxy
//!     keeps calling into the plugin while the GPU watches. One thread plays both parts, so the
//!     watch also pauses while the proxy part yields.
//! - `QUIT`: the rank tears down and says `BYE`.
//!
//! Before `PEER`, a rank also answers `PORT` with its port's facts
//! ([`crate::ports::port_facts`]), so `ferroce doctor --peer` can compare the two ends through
//! the same connection.

use std::time::Duration;

mod cost;
pub mod pair;
mod pingpong;
pub mod serve;

/// Bytes of each rank's buffers: the largest message.
pub const MAX: usize = 8 << 20;
/// Requests in flight per direction at most: NCCL's `NCCL_NET_MAX_REQUESTS`.
pub const WINDOW: usize = 32;
/// How long one plugin step may make no progress before the rank gives up.
const STEP: Duration = Duration::from_secs(120);
/// How long a rank waits for its next command (perftest runs in between).
const IDLE: Duration = Duration::from_secs(1800);
/// Any shared value: NCCL passes the same communicator id to every rank's `init`.
const COMM_ID: u64 = 0xfe77_0ce0;

/// Word `what` of a command or reply, as a number.
pub fn num<T: std::str::FromStr>(what: &str, s: Option<&str>) -> Result<T, String> {
    let s = s.ok_or_else(|| format!("{what}: missing"))?;
    s.parse().map_err(|_| format!("{what}: not a number: {s:?}"))
}

/// The flag an LL message `i` carries in its last byte: never 0 (the cleared buffer) and never
/// the flag of message `i - 1`, so the receiver cannot mistake the previous message for it.
fn flag(i: usize) -> u8 {
    (i % 255) as u8 + 1
}

/// NCCL's protocols as far as the network sees them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Proto {
    /// Every receive completes through the plugin.
    Simple,
    /// Optional receives: the data's flags tell their arrival.
    Ll,
}

impl Proto {
    pub fn word(self) -> &'static str {
        match self {
            Proto::Simple => "simple",
            Proto::Ll => "ll",
        }
    }

    fn parse(w: Option<&str>) -> Result<Proto, String> {
        match w {
            Some("simple") => Ok(Proto::Simple),
            Some("ll") => Ok(Proto::Ll),
            w => Err(format!("LAT protocol: expected simple or ll, got {w:?}")),
        }
    }
}

/// One latency run's numbers, in us: the median (p50) and the mean half round trip, and the
/// fastest. perftest's are its t_typical, t_avg and t_min.
pub struct Lat {
    pub p50: f64,
    pub avg: f64,
    pub min: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ll_flags_never_repeat_back_to_back_nor_look_like_a_cleared_buffer() {
        for i in 0..2000 {
            assert_ne!(flag(i), 0, "{i}");
            assert_ne!(flag(i), flag(i + 1), "{i}");
        }
        assert_eq!((flag(0), flag(254), flag(255)), (1, 255, 1));
    }

    #[test]
    fn protocols_cross_the_command_line_by_name() {
        for p in [Proto::Simple, Proto::Ll] {
            assert_eq!(Proto::parse(Some(p.word())), Ok(p));
        }
        assert!(Proto::parse(Some("LL128")).is_err());
        assert!(Proto::parse(None).is_err());
    }
}
