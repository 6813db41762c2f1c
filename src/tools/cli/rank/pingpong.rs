//! One side of a ping-pong (`LAT`; see the [module docs](super)), polled as NCCL's proxy polls
//! a channel, and [`Rank::lat`], which runs one (`LAT`) for the rank `serve` runs.

use std::collections::VecDeque;
use std::time::Instant;

use ferroce_tools::buffer::pattern;
use ferroce_tools::driver::Ptr;
use ferroce_tools::out::{mean, median};
use ferroce_tools::wait::Stall;

use super::serve::Rank;
use super::{Proto, STEP, flag};

/// One side of a ping-pong, polled as NCCL's proxy polls (see the module docs): receives
/// posted ahead up to the depth, at most one send of ours in flight.
pub(super) struct PingPong<'r, 'a> {
    rank: &'r Rank<'a>,
    size: usize,
    depth: usize,
    /// Messages each way in the whole run: receives beyond it would stay posted.
    total: usize,
    proto: Proto,
    /// Receives posted and not yet tested done, oldest first.
    recvs: VecDeque<Ptr>,
    posted: usize,
    /// Receives tested done.
    pub(super) received: usize,
    /// Messages the application has seen arrive (and is done with): the buffer of their step
    /// is free again.
    pub(super) seen: usize,
    /// A send wanted but not yet taken by the plugin.
    want_send: bool,
    /// Our send in flight, not yet tested done.
    send: Option<Ptr>,
    stall: Stall,
}

impl<'r, 'a> PingPong<'r, 'a> {
    pub(super) fn new(
        rank: &'r Rank<'a>,
        size: usize,
        depth: usize,
        total: usize,
        proto: Proto,
    ) -> Self {
        PingPong {
            rank,
            size,
            depth,
            total,
            proto,
            recvs: VecDeque::with_capacity(depth),
            posted: 0,
            received: 0,
            seen: 0,
            want_send: false,
            send: None,
            stall: Stall::nccl(),
        }
    }

    /// One pass of the proxy: post a receive and the wanted send, then test the oldest receive
    /// and our send once each. True if anything moved.
    ///
    /// A receive is posted for a step whose buffer is free, as NCCL's proxy does: at most the
    /// depth ahead of the messages seen, and only while fewer than the depth of requests are
    /// outstanding (a step's request is tested done before the step is posted again). With
    /// optional receives, which may test done at once, the first rule is the one that holds.
    fn pass(&mut self) -> Result<bool, String> {
        let (rank, size, ll) = (self.rank, self.size, self.proto == Proto::Ll);
        let mut moved = false;
        if self.recvs.len() < self.depth
            && self.posted < (self.seen + self.depth).min(self.total)
            && let Some(r) = rank.irecv(size, ll)?
        {
            self.recvs.push_back(r);
            self.posted += 1;
            moved = true;
        }
        if self.want_send
            && let Some(s) = rank.isend(size)?
        {
            self.send = Some(s);
            self.want_send = false;
            moved = true;
        }
        if let Some(&r) = self.recvs.front()
            && let Some(got) = rank.drv.test(r)?
        {
            // An optional receive's size is not reported: NCCL reads the flags instead.
            if !ll {
                Rank::check(size, got)?;
            }
            self.recvs.pop_front();
            self.received += 1;
            moved = true;
        }
        if let Some(s) = self.send
            && rank.drv.test(s)?.is_some()
        {
            self.send = None;
            moved = true;
        }
        Ok(moved)
    }

    /// Whether message `i` has arrived: its receive tested done (Simple), or its flag in the
    /// buffer (LL; whether its request was tested done yet does not matter).
    pub(super) fn arrived(&self, i: usize) -> bool {
        match self.proto {
            Proto::Simple => self.received > i,
            Proto::Ll => self.rank.last_received(self.size) == flag(i),
        }
    }

    /// No send of ours wanted or in flight.
    pub(super) fn send_idle(&self) -> bool {
        !self.want_send && self.send.is_none()
    }

    /// Hands message `i` to the next pass, flagged for LL. Only when [`Self::send_idle`].
    pub(super) fn start_send(&mut self, i: usize) {
        if self.proto == Proto::Ll {
            self.rank.stamp(self.size, flag(i));
        }
        self.want_send = true;
    }

    /// Passes until `done`, which is checked before each pass.
    pub(super) fn wait(&mut self, what: &str, done: impl Fn(&Self) -> bool) -> Result<(), String> {
        loop {
            if done(self) {
                return Ok(());
            }
            if self.pass()? {
                self.stall.moved();
            } else if self.stall.idle(STEP) {
                return Err(format!(
                    "ping-pong at {} B ({}): no progress for {STEP:?} waiting for {what} \
                     ({} of {} received)",
                    self.size,
                    self.proto.word(),
                    self.received,
                    self.total
                ));
            }
        }
    }
}

impl Rank<'_> {
    /// Ping-pong of `warm + iters + 1` messages (one more than samples: a sample is the time
    /// between two pings). The leader replies `LAT p50_us mean_us min_us`, the other side `LAT`.
    pub(super) fn lat(
        &self,
        size: usize,
        iters: usize,
        warm: usize,
        depth: usize,
        proto: Proto,
        leader: bool,
    ) -> Result<String, String> {
        let total = warm + iters + 1;
        self.clear(size);
        let mut p = PingPong::new(self, size, depth, total, proto);
        let mut stamps = Vec::with_capacity(if leader { total } else { 0 });
        for i in 0..total {
            // Our previous message must have left before the buffer takes the next flag.
            if leader {
                p.wait("a ping's send", |p| p.send_idle())?;
                stamps.push(Instant::now());
                p.start_send(i);
                p.wait("a pong", |p| p.arrived(i))?;
            } else {
                p.wait("a ping", |p| p.arrived(i) && p.send_idle())?;
                p.start_send(i);
            }
            p.seen = i + 1;
        }
        p.wait("the last requests", |p| p.send_idle() && p.received == total)?;
        if proto == Proto::Ll {
            // The next run sends the pattern again.
            self.stamp(size, pattern(0, size - 1));
        }
        self.verify(size, (proto == Proto::Ll).then(|| flag(total - 1)))?;
        if !leader {
            return Ok("LAT".into());
        }
        let mut half: Vec<f64> =
            stamps.windows(2).skip(warm).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / 2.0).collect();
        half.sort_by(f64::total_cmp);
        let min = half.first().copied().unwrap_or(f64::NAN);
        Ok(format!("LAT {:.3} {:.3} {min:.3}", median(&half), mean(&half)))
    }
}
