//! Connection setup with no I/O inside (in the style of quinn-proto): the connector's exchange
//! ([`Dial`]) and the listener's ([`Listen`]). Here live the framing of the fixed-size
//! messages, the stages and their deadlines, who is a stranger and who is the peer, the caps on
//! unproven connections (per listener and per process) and the rate limit of the rejection
//! WARNs.
//!
//! The shell (`setup`) owns the sockets, the clock and the verbs objects. It calls `advance`
//! with `now` and what its last command produced (an [`Input`]) and does what the returned
//! [`Cmd`] says: wait for the TCP connect, write or read bytes, build this side's endpoint, move
//! the queue pairs to RTR and RTS along a [`QpPlan`], or stop (wait for the next call, close a
//! stranger, done, fail). Nothing here reads a clock, touches a socket or names a verbs type, so
//! `setup/tests.rs` drives both ends over a simulated network and clock.
//!
//! Invariants:
//! - Each stage has a deadline, checked only when the shell reports that it would block: a step
//!   that moves never fails for time, a silent one always does once its deadline has passed
//!   (strictly: `now > deadline`). Only a new stage moves a deadline, never a partial message.
//! - A connection is proven once it sent a valid hello with this listener's nonce. Before that,
//!   whatever it does drops it alone; after, its failures fail `accept`.
//! - The acceptor moves its queue pairs to RTS before its reply goes out, the connector before
//!   its ready: no CTS is ever written before the sender's QP can take it.
//! - No connection is ever pushed out to make room for another. A listener holds at most
//!   [`MAX_PENDING`] connections that have not proven themselves ([`MAX_PER_SOURCE`] of them
//!   from one address), the process at most [`MAX_UNPROVEN`] over all its listeners; a
//!   newcomer beyond any cap has a short [`GRACE`] to prove itself (at most [`MAX_GRACE`] at
//!   once; beyond that it is read once) and is refused unless it did. So strangers that arrive after the rightful peer cannot
//!   knock it off, strangers that came first cannot keep it out (its hello leaves with its TCP
//!   connection), and what they cost is bounded.
//! - A hello is served only if its QP count is within this side's own configured count
//!   (`NCCL_IB_QPS_PER_CONNECTION`), whatever the wire says.
//!
//! Error classes: what the peer or the network caused (closed, garbled, late, wrong nonce) is
//! `Error::Remote`; a failure of our own side that the shell reports ([`Input::Local`]: queue
//! pairs, registration, a fatal device) keeps its class through `Error::context`.
#![doc = include_str!("doc/setup.md")]

use std::collections::VecDeque;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::data::MAX_MEMBERS;
use crate::error::Error;
use wire::{End, Handle, Kind, MAX_QPS, MSG_LEN, Msg, Reject, header_len};

pub mod wire;

/// The most connections a listener holds before they prove themselves. A newcomer beyond it is
/// refused rather than any of them pushed out: one that arrived first, as the rightful peer's
/// connection may have, keeps its place however many come after it.
pub const MAX_PENDING: usize = 64;
/// The most of a listener's [`MAX_PENDING`] places that connections from one source address
/// hold: one host's strangers cannot fill a listener's places, which connections from
/// elsewhere (the rightful peer's among them) still find. A connection beyond it is admitted
/// as one beyond any cap is (its [`GRACE`]), so the rightful peer that shares its address with
/// strangers is no worse off than without it.
pub const MAX_PER_SOURCE: usize = MAX_PENDING / 4;
/// The most connections that have not proven themselves in the whole process, over all its
/// listeners, beyond each listener's first. Each holds an fd for up to [`HELLO_TIMEOUT`], and
/// NCCL keeps a listener per connection being set up, so a per-listener cap alone would let
/// enough listeners exhaust the process's fds. A listener's first unproven connection is not
/// counted: it may be the rightful peer's, taken before its hello arrived, and a large job has
/// hundreds of those in flight at once (NCCL connects up to 128 peers per round, over several
/// channels), none of which a count of strangers may refuse. So the fds are bounded by the
/// listeners NCCL opened plus 256 (a quarter of the usual soft open-files limit). Not a knob:
/// a job that needs more is under attack, and more would only cost more fds.
pub const MAX_UNPROVEN: usize = 256;
/// How long a connection admitted beyond a cap may wait for its hello before it is refused,
/// instead of a single read: the rightful peer's hello leaves with its TCP connection (its
/// first `connect` call waits for that), but the listener may take the connection a moment
/// before the hello lands. Strangers that filled every place first then cannot keep it out.
pub const GRACE: Duration = Duration::from_millis(500);
/// The most connections a listener holds in their [`GRACE`] at once (each an fd for at most
/// that long), as many as its places: strangers that hold every place and come back in bursts
/// as they are dropped must not use up the graces too. A newcomer beyond it is read once and,
/// unless that proves it, refused.
pub const MAX_GRACE: usize = MAX_PENDING;
/// How long a connection may take to prove itself with its hello (never longer than
/// `FERROCE_SETUP_TIMEOUT_MS`). A stranger holds a slot at most this long. The rightful peer
/// sends its hello on NCCL's next `connect` call after its TCP connection completes, so this
/// leaves room for a proxy thread busy elsewhere (e.g. registering buffers) in between.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `accept` stops taking connections after the process ran out of fds or memory
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM); the connections already taken are still served.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Turned-away connections logged one by one per listener; the rest are counted.
pub const REJECT_WARNS: u64 = 8;
/// At most this often a count of the unlogged ones, while they keep coming.
pub const REJECT_SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// The count of connections that have not proven themselves, shared by the listeners of a
/// process (the shell has one for the process; a test makes its own).
#[derive(Debug)]
pub struct Unproven {
    cap: usize,
    held: AtomicUsize,
}

impl Unproven {
    pub const fn new(cap: usize) -> Unproven {
        Unproven { cap, held: AtomicUsize::new(0) }
    }

    /// How many are held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// A place for one more, unless `cap` are held.
    fn take(self: &Arc<Self>) -> Option<Place> {
        let more = |n: usize| (n < self.cap).then_some(n + 1);
        self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, more).ok()?;
        Some(Place(Some(self.clone())))
    }
}

/// One unproven connection's place: in the process's count (given back when the connection
/// proves itself or goes, whichever way it goes: dropped, the listener closed), or, for a
/// listener's first, outside it (`None`).
#[derive(Debug)]
struct Place(Option<Arc<Unproven>>);

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(count) = &self.0 {
            count.held.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// How a connection uses its queue pairs: chosen by the connector, followed by the acceptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub nqps: usize,
    pub sports: [u16; MAX_QPS],
    pub split: bool,
    /// Traffic class of the data QPs (the connector's), and of the receiver's control writes
    /// unless its own `NCCL_IB_FIFO_TC` says otherwise ([`Policy::receiver_tc`]).
    pub tc: u8,
    pub sl: u8,
}

impl Policy {
    /// The connector's choice, as its hello carries it.
    pub fn of(m: &Msg) -> Policy {
        Policy {
            nqps: usize::from(m.nqps),
            sports: m.sports,
            split: m.split,
            tc: m.traffic_class,
            sl: m.sl,
        }
    }

    /// The traffic class of the receiver's queue pairs, which carry its clear-to-send writes:
    /// its own `NCCL_IB_FIFO_TC` if set, else the sender's data class, as NCCL's receiver does.
    pub fn receiver_tc(&self, own_fifo_tc: Option<u8>) -> u8 {
        own_fifo_tc.unwrap_or(self.tc)
    }
}

/// What only the shell knows of this side's message: its queue pairs, port and buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub qpns: [u32; MAX_QPS],
    pub gid: [u8; 16],
    /// `ibv_mtu` enum of the port's active MTU.
    pub mtu: u8,
    pub port: u8,
    /// The buffer the peer writes into (the connector's FIFO, the acceptor's size records).
    pub buf_addr: u64,
    pub buf_rkey: u32,
    pub max_msg: u32,
    /// Its device's member ports (1, or a fused device's): the fields above are the first's,
    /// `more` the others'.
    pub members: u8,
    pub more: [End; MAX_MEMBERS - 1],
}

/// The message one side sends: its endpoint under the connection's policy.
fn message(kind: Kind, nonce: u64, p: &Policy, l: &Local) -> Msg {
    Msg {
        kind,
        nonce,
        nqps: p.nqps as u8,
        qpns: l.qpns,
        sports: p.sports,
        split: p.split,
        sl: p.sl,
        mtu: l.mtu,
        port: l.port,
        traffic_class: p.tc,
        gid: l.gid,
        buf_addr: l.buf_addr,
        buf_rkey: l.buf_rkey,
        max_msg: l.max_msg,
        members: l.members,
        more: l.more,
    }
}

/// Where QP `i` of this side goes on RTR, and how: the shell adds what its device knows (port,
/// GID index, its own MTU: the path MTU is the smaller one) and the RTS attributes of the
/// configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpPlan {
    /// The queue pairs of the connection (the acceptor creates this many).
    pub nqps: usize,
    /// Whether the sender splits each message across them (the receiver's pools follow).
    pub split: bool,
    pub remote_qpns: [u32; MAX_QPS],
    /// The UDP source port of each QP (its flow label).
    pub sports: [u16; MAX_QPS],
    /// The remote member ports' ends (their GIDs and active MTUs; lane `q` goes to
    /// `q % remote_members`).
    pub remote_members: usize,
    pub remote_ends: [End; MAX_MEMBERS],
    pub traffic_class: u8,
    pub sl: u8,
    /// What each QP's first packet sequence number is drawn from ([`first_psn`]): the
    /// listener's random nonce, which both ends hold and the network never carried.
    pub psn_seed: u64,
}

impl QpPlan {
    /// Towards the endpoint in `remote`, with the connection's source ports and service level
    /// and traffic class `tc`.
    pub fn towards(remote: &Msg, p: &Policy, tc: u8) -> QpPlan {
        QpPlan {
            nqps: p.nqps,
            split: p.split,
            remote_qpns: remote.qpns,
            sports: p.sports,
            remote_members: usize::from(remote.members.max(1)),
            remote_ends: std::array::from_fn(|m| remote.end(m)),
            traffic_class: tc,
            sl: p.sl,
            psn_seed: remote.nonce,
        }
    }
}

/// The first packet sequence number of the queue pair numbered `qpn` on a connection whose
/// PSNs are drawn from `seed`: its send queue's, and the peer's receive queue's for it (both
/// ends compute it alike from what each knows). 24 bits, spread over the whole space, so that
/// a packet forged or left over from another connection does not fall in the window, as it
/// would if every QP started at 0.
pub fn first_psn(seed: u64, qpn: u32) -> u32 {
    // splitmix64's finaliser over the seed and the QP number.
    let mut z = seed ^ u64::from(qpn).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) & 0xff_ffff) as u32
}

/// What the shell's last command produced; `Poll` starts a call.
#[derive(Debug)]
pub enum Input<'a> {
    /// A new call (after [`Cmd::Wait`]): nothing happened in between.
    Poll,
    /// The last command cannot go on without blocking.
    Blocked,
    /// The TCP connection is up (after [`Cmd::AwaitConnect`]).
    Connected,
    /// Bytes read (after [`Cmd::Recv`]): at most as many as asked for, at least one.
    Received(&'a [u8]),
    /// The peer closed the connection (a read returned 0).
    Closed,
    /// This many bytes of [`Cmd::Send`] went out.
    Sent(usize),
    /// The socket failed (connect, read or write): the OS's words.
    Failed(String),
    /// This side's endpoint (after [`Cmd::Endpoint`]).
    Endpoint(Box<Local>),
    /// The queue pairs are at RTS (after [`Cmd::ConnectQps`]).
    QpsReady,
    /// Our own side failed the last command ([`Cmd::Endpoint`] or [`Cmd::ConnectQps`]).
    Local(Error),
}

/// What the shell does next.
#[derive(Debug)]
pub enum Cmd<'a> {
    /// Check the TCP connect: answer `Connected`, `Blocked` or `Failed`.
    AwaitConnect,
    /// Build this side's endpoint: answer `Endpoint` or `Local`.
    Endpoint,
    /// Write these bytes: answer `Sent`, `Blocked` or `Failed`.
    Send(&'a [u8]),
    /// Read at most this many bytes: answer `Received`, `Closed`, `Blocked` or `Failed`.
    Recv(usize),
    /// Move the queue pairs to RTR and RTS along the plan (the acceptor creates them first):
    /// answer `QpsReady` or `Local`.
    ConnectQps(Box<QpPlan>),
    /// Nothing more until the next call.
    Wait,
    /// The listener dropped this connection, which had not proven itself: close it.
    Close,
    /// Connected; the peer's message (the reply to a connector, the hello to an acceptor). A
    /// listener has dropped every other connection: close them.
    Done(Box<Msg>),
    /// The setup failed (a listener: its proven peer did; close that connection).
    Fail(Error),
}

/// What one step of a machine leads to, before it is said as a [`Cmd`].
enum Next {
    /// The current stage's command.
    Go,
    Wait,
    Done(Box<Msg>),
    Fail(Error),
    /// Not (yet) our peer: drop the connection, keep listening.
    Stranger(String),
}

/// Why a connection's incoming bytes are unusable.
#[derive(Debug)]
pub enum Bad {
    Reject(Reject),
    /// The peer closed after this many bytes of a message.
    Closed(usize),
}

impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bad::Reject(r) => write!(f, "{r}"),
            Bad::Closed(0) => write!(f, "connection closed"),
            Bad::Closed(n) => {
                write!(f, "connection closed after {n} of {MSG_LEN} bytes (truncated message)")
            }
        }
    }
}

/// The bytes of one connection's messages in flight: the one being received and the one being
/// sent.
struct Frame {
    rx: [u8; MSG_LEN],
    rx_len: usize,
    tx: [u8; MSG_LEN],
    tx_off: usize,
}

impl Frame {
    fn new() -> Frame {
        Frame { rx: [0; MSG_LEN], rx_len: 0, tx: [0; MSG_LEN], tx_off: MSG_LEN }
    }

    fn queue(&mut self, msg: &Msg) {
        self.tx = msg.encode();
        self.tx_off = 0;
    }

    fn unsent(&self) -> &[u8] {
        &self.tx[self.tx_off..]
    }

    /// Counts `n` more bytes out; `true` once the queued message is.
    fn sent(&mut self, n: usize) -> bool {
        self.tx_off = (self.tx_off + n).min(MSG_LEN);
        self.tx_off == MSG_LEN
    }

    fn missing(&self) -> usize {
        MSG_LEN - self.rx_len
    }

    /// Takes bytes in; `Some` once a whole message is. The header is checked as soon as it is
    /// in, so a garbage peer is rejected without waiting for more bytes.
    fn received(&mut self, bytes: &[u8]) -> Result<Option<[u8; MSG_LEN]>, Bad> {
        debug_assert!(bytes.len() <= self.missing(), "read more than asked for");
        let n = bytes.len().min(self.missing());
        let before = self.rx_len;
        self.rx[before..before + n].copy_from_slice(&bytes[..n]);
        self.rx_len += n;
        if before < header_len() && self.rx_len >= header_len() {
            Msg::check_header(&self.rx).map_err(Bad::Reject)?;
        }
        if self.rx_len < MSG_LEN {
            return Ok(None);
        }
        self.rx_len = 0;
        Ok(Some(self.rx))
    }

    fn closed(&self) -> Bad {
        Bad::Closed(self.rx_len)
    }
}

/// A failure of our own side while serving or connecting to the proven peer (queue pairs,
/// registration, a fatal device): it keeps its class (`ncclSystemError`), with `what` in front.
pub fn ours(what: String) -> impl FnOnce(Error) -> Error {
    move |e| e.context(what)
}

/// A failure the peer or the network caused (closed, garbled, late, wrong nonce): `Remote`.
fn theirs(what: &str, why: impl fmt::Display) -> Error {
    Error::Remote(format!("{what}: {why}"))
}

/// An input the current stage cannot take: a bug of the shell, failed rather than trusted.
fn misuse(what: &str, stage: impl fmt::Debug, input: &Input<'_>) -> Next {
    Next::Fail(Error::Internal(format!("{what}: {input:?} in stage {stage:?}")))
}

// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DialStage {
    Connecting,
    Hello,
    SendHello,
    AwaitReply,
    ConnectQps,
    SendReady,
    Ended,
}

/// The connector's exchange: TCP connect, hello out, reply in, queue pairs to RTS, ready out.
pub struct Dial {
    /// "connect to ADDR", in front of every error.
    what: String,
    nonce: u64,
    policy: Policy,
    timeout: Duration,
    stage: DialStage,
    deadline: Instant,
    frame: Frame,
    /// The reply, once in.
    reply: Option<Box<Msg>>,
}

impl Dial {
    /// Starts towards the listener behind `handle` (the shell started the TCP connect at `now`),
    /// with `timeout` for each stage.
    pub fn new(handle: Handle, policy: Policy, timeout: Duration, now: Instant) -> Dial {
        Dial {
            what: format!("connect to {}", handle.addr),
            nonce: handle.nonce,
            policy,
            timeout,
            stage: DialStage::Connecting,
            deadline: now + timeout,
            frame: Frame::new(),
            reply: None,
        }
    }

    /// Takes what the last command produced (`Input::Poll` on a new call); says what to do next.
    pub fn advance(&mut self, now: Instant, input: Input<'_>) -> Cmd<'_> {
        match self.step(now, input) {
            Next::Go => self.command(),
            Next::Wait => Cmd::Wait,
            Next::Done(reply) => {
                self.stage = DialStage::Ended;
                Cmd::Done(reply)
            }
            Next::Fail(e) => {
                self.stage = DialStage::Ended;
                Cmd::Fail(e)
            }
            // A connector has no strangers: it talks to one listener.
            Next::Stranger(why) => Cmd::Fail(Error::Internal(why)),
        }
    }

    fn command(&self) -> Cmd<'_> {
        match self.stage {
            DialStage::Connecting => Cmd::AwaitConnect,
            DialStage::Hello => Cmd::Endpoint,
            DialStage::SendHello | DialStage::SendReady => Cmd::Send(self.frame.unsent()),
            DialStage::AwaitReply => Cmd::Recv(self.frame.missing()),
            DialStage::ConnectQps => {
                let reply = self.reply.as_ref().expect("a reply before its queue pairs");
                Cmd::ConnectQps(Box::new(QpPlan::towards(reply, &self.policy, self.policy.tc)))
            }
            DialStage::Ended => {
                Cmd::Fail(Error::Internal(format!("{}: the setup already ended", self.what)))
            }
        }
    }

    /// The step's name in errors.
    fn step_name(&self) -> &'static str {
        match self.stage {
            DialStage::Connecting => "TCP connect",
            DialStage::Hello => "hello",
            DialStage::SendHello => "send hello",
            DialStage::AwaitReply => "wait for reply",
            DialStage::ConnectQps => "connect queue pairs",
            DialStage::SendReady => "send ready",
            DialStage::Ended => "ended",
        }
    }

    fn step(&mut self, now: Instant, input: Input<'_>) -> Next {
        use DialStage as S;
        let step = self.step_name();
        match (self.stage, input) {
            (S::Ended, input) => misuse(&self.what, self.stage, &input),
            (_, Input::Poll) => Next::Go,
            (S::Connecting | S::SendHello | S::AwaitReply | S::SendReady, Input::Blocked) => {
                self.check_deadline(now, step)
            }
            (S::Connecting | S::SendHello | S::AwaitReply | S::SendReady, Input::Failed(e)) => {
                Next::Fail(self.fail(step, e))
            }
            (S::Connecting, Input::Connected) => {
                self.stage = S::Hello;
                Next::Go
            }
            (S::Hello, Input::Endpoint(local)) => {
                self.frame.queue(&message(Kind::Hello, self.nonce, &self.policy, &local));
                self.next(S::SendHello, now)
            }
            (S::Hello | S::ConnectQps, Input::Local(e)) => {
                Next::Fail(ours(format!("{}: {step}", self.what))(e))
            }
            (S::SendHello | S::SendReady, Input::Sent(n)) => {
                if !self.frame.sent(n) {
                    Next::Go
                } else if self.stage == S::SendHello {
                    self.next(S::AwaitReply, now)
                } else {
                    Next::Done(self.reply.take().expect("a reply before the ready"))
                }
            }
            (S::AwaitReply, Input::Received(bytes)) => self.reply(bytes),
            (S::AwaitReply, Input::Closed) => Next::Fail(self.fail(step, self.frame.closed())),
            (S::ConnectQps, Input::QpsReady) => {
                let reply = self.reply.as_ref().expect("a reply before its queue pairs");
                let ready = Msg { kind: Kind::Ready, ..**reply };
                self.frame.queue(&ready);
                self.next(S::SendReady, now)
            }
            (stage, input) => misuse(&self.what, stage, &input),
        }
    }

    /// A whole reply, or part of one.
    fn reply(&mut self, bytes: &[u8]) -> Next {
        let step = "wait for reply";
        let bytes = match self.frame.received(bytes) {
            Ok(Some(b)) => b,
            Ok(None) => return Next::Go,
            Err(bad) => return Next::Fail(self.fail(step, bad)),
        };
        let reply = match Msg::decode(&bytes, Kind::Reply, self.nonce) {
            Ok(m) => m,
            Err(r) => return Next::Fail(self.fail(step, r)),
        };
        if usize::from(reply.nqps) != self.policy.nqps {
            return Next::Fail(
                self.fail(step, format!("peer has {} QPs, not {}", reply.nqps, self.policy.nqps)),
            );
        }
        self.reply = Some(Box::new(reply));
        self.stage = DialStage::ConnectQps;
        Next::Go
    }

    /// A failure the peer or the network caused.
    fn fail(&self, step: &str, why: impl fmt::Display) -> Error {
        theirs(&format!("{}: {step}", self.what), why)
    }

    fn check_deadline(&self, now: Instant, step: &str) -> Next {
        if now > self.deadline {
            return Next::Fail(self.fail(
                step,
                format!(
                    "no progress within {} ms (FERROCE_SETUP_TIMEOUT_MS)",
                    self.timeout.as_millis()
                ),
            ));
        }
        Next::Wait
    }

    fn next(&mut self, stage: DialStage, now: Instant) -> Next {
        self.stage = stage;
        self.deadline = now + self.timeout;
        Next::Go
    }
}

// ---------------------------------------------------------------------------------------------

/// What a listener holds every connection to.
#[derive(Clone, Copy, Debug)]
struct Terms {
    nonce: u64,
    /// The listener's own deadline for each step of a proven peer.
    timeout: Duration,
    /// The most QPs a hello may ask for per port of the end with more ports: this side's
    /// `NCCL_IB_QPS_PER_CONNECTION`.
    max_qps: usize,
    /// This side's ports (one, or a fused device's).
    ports: usize,
    /// This side's `NCCL_IB_FIFO_TC`: the traffic class of its queue pairs, which carry the
    /// clear-to-send writes (`None`: the sender's data class), as NCCL's receiver chooses it.
    fifo_tc: Option<u8>,
}

impl Terms {
    /// The most QPs `hello` may ask for: the connector opens `NCCL_IB_QPS_PER_CONNECTION`
    /// per port of the end with more ports.
    fn bound(&self, hello: &Msg) -> usize {
        self.max_qps * self.ports.max(usize::from(hello.members)).max(1)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AnswerStage {
    AwaitHello,
    ConnectQps,
    Reply,
    SendReply,
    AwaitReady,
}

/// The acceptor's side of one connection: hello in, queue pairs to RTS, reply out, ready in.
struct Answer {
    peer: SocketAddr,
    /// "accept from PEER", in front of every error of a proven peer.
    what: String,
    stage: AnswerStage,
    deadline: Instant,
    frame: Frame,
    /// The hello, once in: the connection is proven.
    hello: Option<Box<Msg>>,
}

impl Answer {
    fn new(peer: SocketAddr, deadline: Instant) -> Answer {
        Answer {
            peer,
            what: format!("accept from {peer}"),
            stage: AnswerStage::AwaitHello,
            deadline,
            frame: Frame::new(),
            hello: None,
        }
    }

    /// Whether this connection sent a valid hello with this listener's nonce.
    fn proven(&self) -> bool {
        self.stage != AnswerStage::AwaitHello
    }

    fn hello(&self) -> &Msg {
        self.hello.as_ref().expect("proven")
    }

    fn command(&self, terms: &Terms) -> Cmd<'_> {
        match self.stage {
            AnswerStage::AwaitHello | AnswerStage::AwaitReady => Cmd::Recv(self.frame.missing()),
            AnswerStage::ConnectQps => {
                // The receiver's QPs carry the control (CTS) writes: its own FIFO traffic class.
                let p = Policy::of(self.hello());
                let tc = p.receiver_tc(terms.fifo_tc);
                Cmd::ConnectQps(Box::new(QpPlan::towards(self.hello(), &p, tc)))
            }
            AnswerStage::Reply => Cmd::Endpoint,
            AnswerStage::SendReply => Cmd::Send(self.frame.unsent()),
        }
    }

    fn step(&mut self, now: Instant, input: Input<'_>, terms: &Terms) -> Next {
        use AnswerStage as S;
        let (nonce, timeout) = (terms.nonce, terms.timeout);
        match (self.stage, input) {
            (_, Input::Poll) => Next::Go,
            (S::AwaitHello, Input::Received(bytes)) => self.take_hello(bytes, terms),
            (S::AwaitHello, Input::Closed) => Next::Stranger(self.frame.closed().to_string()),
            (S::AwaitHello, Input::Failed(e)) => Next::Stranger(e),
            (S::AwaitHello, Input::Blocked) if now > self.deadline => Next::Stranger(format!(
                "no hello within {} ms",
                HELLO_TIMEOUT.min(timeout).as_millis()
            )),
            (S::ConnectQps, Input::QpsReady) => {
                self.stage = S::Reply;
                Next::Go
            }
            (S::ConnectQps, Input::Local(e)) => {
                Next::Fail(ours(format!("{}: create queue pairs", self.what))(e))
            }
            (S::Reply, Input::Endpoint(local)) => {
                let reply = message(Kind::Reply, nonce, &Policy::of(self.hello()), &local);
                self.frame.queue(&reply);
                self.next(S::SendReply, now + timeout)
            }
            (S::Reply, Input::Local(e)) => Next::Fail(ours(format!("{}: reply", self.what))(e)),
            (S::SendReply, Input::Sent(n)) => {
                if self.frame.sent(n) {
                    self.next(S::AwaitReady, now + timeout)
                } else {
                    Next::Go
                }
            }
            (S::SendReply, Input::Blocked) if now > self.deadline => {
                Next::Fail(self.fail("send reply", "deadline passed"))
            }
            (S::SendReply, Input::Failed(e)) => Next::Fail(self.fail("send reply", e)),
            (S::AwaitReady, Input::Received(bytes)) => self.take_ready(bytes, nonce),
            (S::AwaitReady, Input::Closed) => {
                Next::Fail(self.fail("wait for ready", self.frame.closed()))
            }
            (S::AwaitReady, Input::Failed(e)) => Next::Fail(self.fail("wait for ready", e)),
            (S::AwaitReady, Input::Blocked) if now > self.deadline => Next::Fail(
                self.fail("wait for ready", format!("no answer within {} ms", timeout.as_millis())),
            ),
            (S::AwaitHello | S::SendReply | S::AwaitReady, Input::Blocked) => Next::Wait,
            (stage, input) => misuse(&self.what, stage, &input),
        }
    }

    fn take_hello(&mut self, bytes: &[u8], terms: &Terms) -> Next {
        let bytes = match self.frame.received(bytes) {
            Ok(Some(b)) => b,
            Ok(None) => return Next::Go,
            Err(bad) => return Next::Stranger(bad.to_string()),
        };
        match Msg::decode(&bytes, Kind::Hello, terms.nonce) {
            // The wire's count would be taken as given up to 128 QPs (and their memory): it is
            // bounded by our own. NCCL's ranks share one setting, so a rightful peer is within.
            Ok(hello) if usize::from(hello.nqps) > terms.bound(&hello) => Next::Stranger(format!(
                "its hello asks for {} QPs, more than {} here (NCCL_IB_QPS_PER_CONNECTION={} \
                     per port of the end with more ports: set it alike on every rank)",
                hello.nqps,
                terms.bound(&hello),
                terms.max_qps
            )),
            Ok(hello) => {
                // The peer proved itself: from here on, failures are errors, each of the class
                // of whoever caused it.
                self.hello = Some(Box::new(hello));
                self.stage = AnswerStage::ConnectQps;
                Next::Go
            }
            Err(r) => Next::Stranger(r.to_string()),
        }
    }

    fn take_ready(&mut self, bytes: &[u8], nonce: u64) -> Next {
        let bytes = match self.frame.received(bytes) {
            Ok(Some(b)) => b,
            Ok(None) => return Next::Go,
            Err(bad) => return Next::Fail(self.fail("wait for ready", bad)),
        };
        match Msg::decode(&bytes, Kind::Ready, nonce) {
            Ok(_) => Next::Done(self.hello.take().expect("proven")),
            Err(r) => Next::Fail(self.fail("wait for ready", r)),
        }
    }

    fn fail(&self, step: &str, why: impl fmt::Display) -> Error {
        theirs(&format!("{}: {step}", self.what), why)
    }

    fn next(&mut self, stage: AnswerStage, deadline: Instant) -> Next {
        self.stage = stage;
        self.deadline = deadline;
        Next::Go
    }
}

/// What an `accept(2)` error means for the listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptErr {
    /// Nothing more to take now.
    Empty,
    /// That one connection failed (accept(2): network errors of the new socket, EINTR, EPERM
    /// from a firewall): take the next.
    Transient,
    /// The process or system is out of fds or memory: stop taking connections for
    /// [`ACCEPT_BACKOFF`], keep serving those already taken.
    Exhausted,
    /// The listening socket itself is broken (EBADF, EINVAL, ENOTSOCK, ...).
    Fatal,
}

/// The rate limit of one kind of WARN: the first [`REJECT_WARNS`] are logged one by one, the
/// rest only counted and reported as one line when [`RejectLog::summary`] says so.
#[derive(Debug, Default)]
struct RejectLog {
    total: u64,
    /// Counted since the last summary, not logged.
    unreported: u64,
    /// When the first of `unreported` came.
    quiet_since: Option<Instant>,
}

impl RejectLog {
    /// Counts one; `true` if this one is to be logged by itself.
    fn note(&mut self, now: Instant) -> bool {
        self.total += 1;
        if self.total <= REJECT_WARNS {
            return true;
        }
        self.unreported += 1;
        self.quiet_since.get_or_insert(now);
        false
    }

    /// Whether this is the last one logged by itself (its line says the rest are counted).
    fn last_logged(&self) -> bool {
        self.total == REJECT_WARNS
    }

    /// `(unreported, total)` when a summary line is due: `force`d (the peer arrived, the
    /// listener closes) or [`REJECT_SUMMARY_EVERY`] after the first unreported one.
    fn summary(&mut self, now: Instant, force: bool) -> Option<(u64, u64)> {
        let since = self.quiet_since?;
        if !force && now < since + REJECT_SUMMARY_EVERY {
            return None;
        }
        let n = std::mem::take(&mut self.unreported);
        self.quiet_since = None;
        Some((n, self.total))
    }
}

/// A listener's own name for one of its connections.
pub type ConnId = u64;

struct Pending {
    id: ConnId,
    answer: Answer,
    /// Its place in the process's count while it has not proven itself; `None` for one
    /// admitted beyond a cap (it has its [`GRACE`], if one is free, to prove itself; else it is
    /// read once and, unless that proves it, refused) and for a proven one.
    place: Option<Place>,
    /// Until when one admitted beyond a cap may still prove itself.
    grace: Option<Instant>,
}

/// The listener's exchange: the connections it serves until one proves itself and connects.
///
/// One `accept` call is [`Listen::begin`]; [`Listen::advance`] on each of [`Listen::ids`]
/// until it waits, so the hellos already in are read before anything new is taken; then, if
/// `begin` allowed, the connections the kernel hands over ([`Listen::admit`],
/// [`Listen::accept_failed`]), each advanced in the same call (one admitted beyond a cap is
/// refused at its first wait); and [`Listen::end`]. WARN lines collect in
/// [`Listen::take_warnings`].
pub struct Listen {
    handle: Handle,
    /// "listener ADDR (device NAME)", in front of every WARN.
    describe: String,
    terms: Terms,
    /// The process's count of unproven connections.
    unproven: Arc<Unproven>,
    /// Connections being served, oldest first: at most [`MAX_PENDING`] unproven ones with a
    /// place, plus those admitted in this call beyond a cap, plus proven ones.
    pending: VecDeque<Pending>,
    /// When the wait for the rightful peer ends: `timeout` after the first `accept` call of
    /// this wait. Nothing a stranger does moves it.
    deadline: Option<Instant>,
    /// No `accept(2)` before this (the process ran out of fds or memory).
    paused_until: Option<Instant>,
    rejects: RejectLog,
    exhausted: RejectLog,
    next_id: ConnId,
    warnings: Vec<String>,
}

impl Listen {
    /// A listener that serves hellos of at most `max_qps` QPs, its queue pairs in traffic
    /// class `fifo_tc` (else the sender's), its unproven connections counted in `unproven`.
    pub fn new(
        handle: Handle,
        describe: String,
        timeout: Duration,
        (max_qps, fifo_tc): (usize, Option<u8>),
        unproven: Arc<Unproven>,
    ) -> Listen {
        Listen {
            handle,
            describe,
            terms: Terms {
                nonce: handle.nonce,
                timeout,
                max_qps,
                ports: handle.members.into(),
                fifo_tc,
            },
            unproven,
            pending: VecDeque::new(),
            deadline: None,
            paused_until: None,
            rejects: RejectLog::default(),
            exhausted: RejectLog::default(),
            next_id: 0,
            warnings: Vec::new(),
        }
    }

    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// The WARN lines since the last call.
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// Starts an `accept` call: the first of a wait sets its deadline. Whether to take new
    /// connections now (not while backing off after running out of fds or memory).
    pub fn begin(&mut self, now: Instant) -> bool {
        self.deadline.get_or_insert(now + self.terms.timeout);
        if self.paused_until.is_some_and(|t| now < t) {
            return false;
        }
        self.paused_until = None;
        true
    }

    /// A connection the kernel handed over, from `peer`: its id. Nothing is pushed out for
    /// it. Beyond a cap it has no place: the shell advances it in this same call, and at its
    /// first wait it is refused unless it proved itself (its hello was already in) or a place
    /// came free.
    pub fn admit(&mut self, peer: SocketAddr, now: Instant) -> ConnId {
        let id = self.next_id;
        self.next_id += 1;
        let answer = Answer::new(peer, now + HELLO_TIMEOUT.min(self.terms.timeout));
        let place = self.place(peer.ip()).ok();
        self.pending.push_back(Pending { id, answer, place, grace: None });
        id
    }

    /// A place for one more unproven connection, from `from`, or why there is none.
    fn place(&self, from: IpAddr) -> Result<Place, String> {
        let held = self.pending.iter().filter(|p| p.place.is_some());
        let (held, theirs) =
            held.fold((0, 0), |(n, t), p| (n + 1, t + usize::from(p.answer.peer.ip() == from)));
        if held == 0 {
            return Ok(Place(None));
        }
        if theirs >= MAX_PER_SOURCE {
            return Err(format!(
                "refused: {MAX_PER_SOURCE} connections from {from} to this listener have yet \
                 to prove themselves (the most from one address)"
            ));
        }
        if held >= MAX_PENDING {
            return Err(format!(
                "refused: {MAX_PENDING} connections to this listener have yet to prove \
                 themselves (none is pushed out for a newcomer)"
            ));
        }
        self.unproven.take().ok_or_else(|| {
            format!(
                "refused: {} connections to this process's listeners have yet to prove \
                 themselves (none is pushed out for a newcomer)",
                self.unproven.cap
            )
        })
    }

    /// A connection turned away before it was admitted (the shell could not set it up).
    pub fn refuse(&mut self, from: &dyn fmt::Display, why: &str, now: Instant) {
        self.reject(from, why, now);
    }

    /// An `accept(2)` error, as the shell classed it (and `err` in words): what the shell does
    /// next.
    pub fn accept_failed(
        &mut self,
        class: AcceptErr,
        err: &dyn fmt::Display,
        now: Instant,
    ) -> AcceptErr {
        match class {
            AcceptErr::Transient => {
                let why = format!("accept: {err}; that connection is lost");
                self.reject(&"(unknown)", &why, now);
            }
            AcceptErr::Exhausted => {
                self.paused_until = Some(now + ACCEPT_BACKOFF);
                if self.exhausted.note(now) {
                    self.warnings.push(format!(
                        "{}: accept: {err}; not taking connections for {} ms (raise the \
                         open-files limit `ulimit -n` if this persists)",
                        self.describe,
                        ACCEPT_BACKOFF.as_millis()
                    ));
                }
            }
            AcceptErr::Empty | AcceptErr::Fatal => {}
        }
        class
    }

    /// The connections being served, oldest first: the order of one `accept` call.
    pub fn ids(&self) -> Vec<ConnId> {
        self.pending.iter().map(|p| p.id).collect()
    }

    /// Advances connection `id`: takes what its last command produced, says what to do next.
    ///
    /// A connection that has not proven itself (valid hello, this listener's nonce) and fails
    /// is dropped alone (`Close`). Only the proven peer's failure fails `accept` (`Fail`).
    pub fn advance(&mut self, id: ConnId, now: Instant, input: Input<'_>) -> Cmd<'_> {
        let Some(i) = self.pending.iter().position(|p| p.id == id) else {
            let e = format!("{}: no pending connection {id}", self.describe);
            return Cmd::Fail(Error::Internal(e));
        };
        let p = &mut self.pending[i];
        let next = p.answer.step(now, input, &self.terms);
        if p.answer.proven() {
            // Proven: out of the count of strangers, and served to its end.
            p.place = None;
        }
        match next {
            Next::Go => self.pending[i].answer.command(&self.terms),
            Next::Wait => self.wait(i, now),
            Next::Stranger(why) => {
                let p = self.pending.remove(i).expect("found above");
                self.reject(&p.answer.peer, &why, now);
                Cmd::Close
            }
            Next::Fail(e) => {
                self.pending.remove(i);
                Cmd::Fail(e)
            }
            Next::Done(hello) => {
                // Anything else on this listener is not our peer; a next wait starts anew.
                self.pending.clear();
                self.deadline = None;
                self.summarize(now, true);
                Cmd::Done(hello)
            }
        }
    }

    /// Connection `i` waits: it keeps its place, or gets one now, or is refused.
    fn wait(&mut self, i: usize, now: Instant) -> Cmd<'_> {
        let p = &self.pending[i];
        if p.place.is_some() || p.answer.proven() {
            return Cmd::Wait;
        }
        match self.place(p.answer.peer.ip()) {
            Ok(place) => {
                self.pending[i].place = Some(place);
                self.pending[i].grace = None;
                Cmd::Wait
            }
            Err(why) => {
                let in_grace = |p: &&Pending| p.grace.is_some() && !p.answer.proven();
                let graced = self.pending.iter().filter(in_grace).count();
                match self.pending[i].grace {
                    Some(until) if now <= until => return Cmd::Wait,
                    None if graced < MAX_GRACE => {
                        self.pending[i].grace = Some(now + GRACE);
                        return Cmd::Wait;
                    }
                    _ => {}
                }
                let p = self.pending.remove(i).expect("found by the caller");
                self.reject(&p.answer.peer, &why, now);
                Cmd::Close
            }
        }
    }

    /// Ends an `accept` call that connected nothing: the periodic count of rejections, and
    /// the listener's deadline when no connection has proven itself.
    pub fn end(&mut self, now: Instant) -> Result<(), Error> {
        self.summarize(now, false);
        let late = self.deadline.is_some_and(|d| now > d);
        if late && !self.pending.iter().any(|p| p.answer.proven()) {
            return Err(Error::Remote(format!(
                "accept on {}: no peer connected within {} ms (step: wait for connection; \
                 FERROCE_SETUP_TIMEOUT_MS; {} other connection(s) rejected meanwhile)",
                self.handle.addr,
                self.terms.timeout.as_millis(),
                self.rejects.total
            )));
        }
        Ok(())
    }

    /// The listener closes: the last counts.
    pub fn close(&mut self, now: Instant) {
        self.summarize(now, true);
    }

    /// Logs one turned-away connection, or counts it once [`REJECT_WARNS`] were logged.
    fn reject(&mut self, from: &dyn fmt::Display, why: &str, now: Instant) {
        if self.rejects.note(now) {
            let more = if self.rejects.last_logged() {
                " (further rejections are counted, not logged one by one)"
            } else {
                ""
            };
            self.warnings.push(format!(
                "{}: rejected connection from {from}: {why}; still waiting for the peer{more}",
                self.describe
            ));
        }
    }

    /// The count of the rejections not logged one by one, when one is due.
    fn summarize(&mut self, now: Instant, force: bool) {
        if let Some((n, total)) = self.rejects.summary(now, force) {
            self.warnings.push(format!(
                "{}: {n} more connection(s) rejected without a line each ({total} in total)",
                self.describe
            ));
        }
        if let Some((n, total)) = self.exhausted.summary(now, force) {
            self.warnings.push(format!(
                "{}: accept ran out of fds or memory {n} more time(s) ({total} in total)",
                self.describe
            ));
        }
    }
}

#[cfg(test)]
mod tests;
