//! Both ends of connection setup over a simulated network and clock, with no sockets or verbs:
//! the rightful connector and any number of strangers talk to one listener through simulated
//! TCP connections that move any number of bytes per read or write, close or are cut at any
//! byte, change a byte in flight, or stay silent. Each end is called at its own pace, as NCCL's
//! proxy threads call `connect` and `accept`.
//!
//! What must hold: the rightful peer connects whatever the strangers do before, during and
//! after it, and both ends move their queue pairs towards each other before the message that
//! lets the other side send; a stranger is dropped alone, with its reason, within
//! [`HELLO_TIMEOUT`]; a deadline fires just after it passes on a silent end and never on a slow
//! live one; nobody is pushed out for a newcomer, so hundreds of strangers between the peer's
//! connect and its hello never knock it off, while the caps hold per listener and across a
//! process's listeners; a hello never gets more queue pairs than this side's own count; every
//! failure has the class of whoever caused it.
//!
//! Mutants of `setup.rs` (when it was `transport/setup/machine.rs`) these tests kill (each
//! applied by hand, seen failing, reverted):
//! - the connector's deadline check with `>=` for `>`:
//!   `a_silent_listener_fails_the_connector_just_after_its_deadline`;
//! - the connector's deadline not moved at a new stage: `a_slow_peer_at_every_step_is_not_late`;
//! - the listener's cap with `held > MAX_PENDING` (one too many):
//!   `the_cap_is_exactly_max_pending`;
//! - the process's cap unchecked: `the_process_cap_spans_listeners`;
//! - a listener's first unproven connection counted against the process's cap (so a large
//!   job's rightful peers, hundreds in flight at once, could be refused):
//!   `the_process_cap_spans_listeners`, `the_cap_is_exactly_max_pending`,
//!   `a_proven_peer_gives_its_place_back`;
//! - a proven peer keeping its place in the process's count:
//!   `a_proven_peer_gives_its_place_back`;
//! - `Place` not given back when dropped: `the_cap_is_exactly_max_pending`,
//!   `the_process_cap_spans_listeners`;
//! - a newcomer beyond the cap refused even though its waiting hello proved it:
//!   `a_full_listener_still_reads_a_newcomers_waiting_hello`;
//! - the oldest unproven connection pushed out for a newcomer (the admission before issue 18):
//!   `a_flood_between_the_peers_connect_and_its_hello_does_not_knock_it_off`,
//!   `a_flood_between_connect_and_hello_never_knocks_the_peer_off` (the old code itself
//!   fails the first in 4 of its 6 cases: "send hello: Broken pipe");
//! - the hello's QP count unbounded, or bounded with `>=`:
//!   `a_hello_for_more_qps_than_ours_is_refused`, `no_hello_gets_more_qps_than_ours`
//!   (unbounded also `each_kind_of_stranger_is_dropped_with_its_reason`);
//! - no header check before the whole message is in:
//!   `each_kind_of_stranger_is_dropped_with_its_reason`;
//! - the hello deadline never checked, or `FERROCE_SETUP_TIMEOUT_MS` instead of
//!   [`HELLO_TIMEOUT`]: `a_silent_stranger_is_dropped_just_after_the_hello_timeout`;
//! - the listener's deadline failing a wait whose peer proved itself:
//!   `a_slow_peer_at_every_step_is_not_late`;
//! - the listener's deadline moved while strangers are pending:
//!   `the_listener_fails_when_no_peer_proves_itself_in_time`;
//! - the listener's deadline kept after its peer connected:
//!   `a_second_wait_on_the_listener_has_its_own_deadline`;
//! - the reply's or the ready's deadline not moved at its stage:
//!   `a_slow_reader_of_the_reply_gets_its_timeout_for_each_step`;
//! - a bad hello failing `accept` instead of dropping the stranger:
//!   `strangers_before_during_and_after_the_peer_are_dropped_alone`;
//! - the acceptor's QPs with the data traffic class instead of the FIFO's: every test that
//!   connects (`World::assert_connected`);
//! - `RejectLog::note` with `<` for `<=`: `rejections_are_logged_eight_times_then_counted`;
//! - the reply's QP count unchecked: `a_reply_for_another_qp_count_fails_the_connector`.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// Linux errno values the simulated verbs fail with (the core has no libc).
const EINVAL: i32 = 22;
const ENOMEM: i32 = 12;

const TIMEOUT: Duration = Duration::from_secs(20);
const NONCE: u64 = 0x0123_4567_89ab_cdef;
const LISTENER: &str = "10.0.0.1:4000";
const UP: usize = 0;
const DOWN: usize = 1;
const CLIENT: usize = 0;
const SERVER: usize = 1;

fn handle() -> Handle {
    Handle { addr: LISTENER.parse().unwrap(), nonce: NONCE, members: 1 }
}

fn policy(nqps: usize) -> Policy {
    let mut sports = [0; MAX_QPS];
    for (i, p) in sports[..nqps].iter_mut().enumerate() {
        *p = 0xc000 + 7 * i as u16;
    }
    Policy { nqps, sports, split: nqps > 1, tc: 106, sl: 3 }
}

/// Side 1 connects, side 2 listens.
fn local(side: u32, nqps: usize) -> Local {
    Local {
        qpns: std::array::from_fn(|i| if i < nqps { side << 16 | (i as u32 + 1) } else { 0 }),
        gid: [side as u8; 16],
        mtu: 2 + side as u8,
        port: 1,
        buf_addr: 0x10_0000 * u64::from(side),
        buf_rkey: 0x100 + side,
        max_msg: 1 << 30,
        members: 1,
        more: Default::default(),
    }
}

fn hello(nqps: usize) -> [u8; MSG_LEN] {
    message(Kind::Hello, NONCE, &policy(nqps), &local(1, nqps)).encode()
}

/// The listener's `NCCL_IB_QPS_PER_CONNECTION` in a `World`: above every count the tests dial
/// with, below what a hello may carry.
const MAX_QPS_HERE: usize = 8;
/// The listener's own `NCCL_IB_FIFO_TC` (the connector's data class is 106).
const FIFO_TC: u8 = 96;

fn unproven() -> Arc<Unproven> {
    Arc::new(Unproven::new(MAX_UNPROVEN))
}

fn listen(describe: &str, max_qps: usize, unproven: &Arc<Unproven>) -> Listen {
    Listen::new(handle(), describe.into(), TIMEOUT, (max_qps, Some(FIFO_TC)), unproven.clone())
}

fn verbs_error(what: &str) -> Error {
    Error::verbs("ibv_modify_qp", EINVAL, what)
}

// --- the simulated network --------------------------------------------------------------------

/// One TCP connection: bytes in flight each way (`UP` to the listener, `DOWN` to the client).
struct Sock {
    /// The client's address, as the listener sees it.
    peer: SocketAddr,
    /// When the listener's kernel completes the connection (its connect succeeds then).
    arrive: Option<u64>,
    /// `accept(2)` took it.
    taken: bool,
    queue: [VecDeque<u8>; 2],
    written: [usize; 2],
    /// Each end closed its side (the client gave up or finished; the listener dropped it).
    closed: [bool; 2],
    /// The most bytes one read or write moves.
    chunk: usize,
    /// The most bytes in flight, per direction: a write beyond it would block.
    window: [usize; 2],
    /// The connection closes both ways once this many bytes went in this direction.
    cut: Option<(usize, usize)>,
    /// Byte `offset` of this direction is xor-ed with `mask` on the way.
    garble: Option<(usize, usize, u8)>,
}

impl Sock {
    fn new(peer: SocketAddr, arrive: Option<u64>) -> Sock {
        Sock {
            peer,
            arrive,
            taken: false,
            queue: [VecDeque::new(), VecDeque::new()],
            written: [0; 2],
            closed: [false; 2],
            chunk: MSG_LEN,
            window: [4 * MSG_LEN; 2],
            cut: None,
            garble: None,
        }
    }

    fn write(&mut self, from: usize, bytes: &[u8]) -> Input<'static> {
        if self.cut == Some((from, self.written[from])) {
            self.closed = [true; 2];
        }
        if self.closed.iter().any(|&c| c) {
            return Input::Failed("Broken pipe (os error 32)".into());
        }
        let mut n = bytes.len().min(self.chunk).min(self.window[from] - self.queue[from].len());
        if let Some((dir, at)) = self.cut.filter(|c| c.0 == from) {
            n = n.min(at - self.written[dir]);
        }
        if n == 0 {
            return Input::Blocked;
        }
        for (i, &b) in bytes[..n].iter().enumerate() {
            let off = self.written[from] + i;
            let mask = match self.garble {
                Some((dir, at, mask)) if dir == from && at == off => mask,
                _ => 0,
            };
            self.queue[from].push_back(b ^ mask);
        }
        self.written[from] += n;
        if self.cut == Some((from, self.written[from])) {
            self.closed = [true; 2];
        }
        Input::Sent(n)
    }

    fn read<'b>(&mut self, to: usize, buf: &'b mut [u8]) -> Input<'b> {
        let q = &mut self.queue[1 - to];
        if q.is_empty() {
            return if self.closed[1 - to] { Input::Closed } else { Input::Blocked };
        }
        let n = buf.len().min(self.chunk).min(q.len());
        for b in &mut buf[..n] {
            *b = q.pop_front().expect("counted");
        }
        Input::Received(&buf[..n])
    }
}

/// The rightful connector, as `Connector::progress` drives its machine.
struct Dialer {
    core: Dial,
    sock: usize,
    local: Local,
    refused: bool,
    fail_endpoint: Option<Error>,
    fail_qps: Option<Error>,
    /// Its plan, and the bytes it had sent when it connected its queue pairs.
    plan: Option<(QpPlan, usize)>,
    outcome: Option<Result<Msg, Error>>,
    every: u64,
    next: u64,
}

/// The listener, as `Listener::accept` drives its machine.
struct Acceptor {
    core: Listen,
    local: Local,
    conns: HashMap<ConnId, usize>,
    /// Per proven connection: its plan, and the bytes it had sent down by then.
    plans: Vec<(usize, QpPlan, usize)>,
    fail_endpoint: Option<Error>,
    fail_qps: Option<Error>,
    outcome: Option<Result<(usize, Msg), Error>>,
    warnings: Vec<String>,
    /// When the listener dropped each connection it did not connect.
    dropped_at: HashMap<usize, u64>,
    /// Connections dropped as strangers (not those still pending when the peer connected).
    rejected: u64,
    every: u64,
    next: u64,
}

/// A client that writes `bytes` as soon as it can, then closes if `close`.
struct Stranger {
    sock: usize,
    bytes: Vec<u8>,
    sent: usize,
    close: bool,
}

struct World {
    t0: Instant,
    now: u64,
    socks: Vec<Sock>,
    dialer: Option<Dialer>,
    acceptor: Acceptor,
    strangers: Vec<Stranger>,
}

impl World {
    /// A listener for QP count `nqps`, called every `every` ms from 0.
    fn new(nqps: usize, every: u64) -> World {
        let describe = format!("listener {LISTENER} (device sim0)");
        World {
            t0: Instant::now(),
            now: 0,
            socks: Vec::new(),
            dialer: None,
            acceptor: Acceptor {
                core: listen(&describe, MAX_QPS_HERE, &unproven()),
                local: local(2, nqps),
                conns: HashMap::new(),
                plans: Vec::new(),
                fail_endpoint: None,
                fail_qps: None,
                outcome: None,
                warnings: Vec::new(),
                dropped_at: HashMap::new(),
                rejected: 0,
                every,
                next: 0,
            },
            strangers: Vec::new(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn sock(&mut self, arrive: Option<u64>) -> usize {
        let i = self.socks.len();
        let peer = SocketAddr::new([10, 0, 1, (i % 250) as u8].into(), 30000 + i as u16);
        self.socks.push(Sock::new(peer, arrive));
        i
    }

    /// The rightful connector: starts at `start`, its TCP connection completes at `arrive`,
    /// it is called every `every` ms.
    fn dial(&mut self, nqps: usize, start: u64, arrive: Option<u64>, every: u64) -> usize {
        let sock = self.sock(arrive);
        self.dialer = Some(Dialer {
            core: Dial::new(handle(), policy(nqps), TIMEOUT, self.at(start)),
            sock,
            local: local(1, nqps),
            refused: false,
            fail_endpoint: None,
            fail_qps: None,
            plan: None,
            outcome: None,
            every,
            next: start,
        });
        sock
    }

    fn stranger(&mut self, arrive: u64, bytes: &[u8], close: bool) -> usize {
        let sock = self.sock(Some(arrive));
        self.strangers.push(Stranger { sock, bytes: bytes.to_vec(), sent: 0, close });
        sock
    }

    fn dialer(&self) -> &Dialer {
        self.dialer.as_ref().expect("a connector")
    }

    /// Runs both ends until `until` ms, or until neither has anything left to do.
    fn run(&mut self, until: u64) {
        loop {
            let dial = self.dialer.as_ref().filter(|d| d.outcome.is_none()).map(|d| d.next);
            let a = &self.acceptor;
            let accept = a.outcome.is_none().then_some(a.next);
            let Some(t) = dial.into_iter().chain(accept).min().filter(|&t| t <= until) else {
                return;
            };
            self.now = t;
            self.push_strangers();
            if dial == Some(t) {
                self.dial_call();
                let d = self.dialer.as_mut().expect("due");
                d.next += d.every;
            }
            if accept == Some(t) {
                self.accept_call();
                self.acceptor.next += self.acceptor.every;
            }
        }
    }

    fn push_strangers(&mut self) {
        for s in &mut self.strangers {
            let sock = &mut self.socks[s.sock];
            if sock.arrive.is_none_or(|a| a > self.now) || sock.closed[CLIENT] {
                continue;
            }
            while s.sent < s.bytes.len() {
                match sock.write(CLIENT, &s.bytes[s.sent..]) {
                    Input::Sent(n) => s.sent += n,
                    _ => break,
                }
            }
            if s.close && s.sent == s.bytes.len() {
                sock.closed[CLIENT] = true;
            }
        }
    }

    /// One `connect` call.
    fn dial_call(&mut self) {
        let now = self.at(self.now);
        let (d, socks) = (self.dialer.as_mut().expect("a connector"), &mut self.socks);
        let sock = &mut socks[d.sock];
        let mut buf = [0u8; MSG_LEN];
        let mut input = Input::Poll;
        loop {
            input = match d.core.advance(now, input) {
                Cmd::AwaitConnect if d.refused => Input::Failed("Connection refused".into()),
                Cmd::AwaitConnect if sock.arrive.is_some_and(|a| a <= self.now) => Input::Connected,
                Cmd::AwaitConnect => Input::Blocked,
                Cmd::Endpoint => match d.fail_endpoint.take() {
                    Some(e) => Input::Local(e),
                    None => Input::Endpoint(Box::new(d.local)),
                },
                Cmd::Send(bytes) => sock.write(CLIENT, bytes),
                Cmd::Recv(n) => sock.read(CLIENT, &mut buf[..n]),
                Cmd::ConnectQps(plan) => {
                    d.plan = Some((*plan, sock.written[UP]));
                    d.fail_qps.take().map_or(Input::QpsReady, Input::Local)
                }
                Cmd::Wait => return,
                Cmd::Done(reply) => {
                    d.outcome = Some(Ok(*reply));
                    sock.closed[CLIENT] = true;
                    return;
                }
                Cmd::Fail(e) => {
                    d.outcome = Some(Err(e));
                    sock.closed[CLIENT] = true;
                    return;
                }
                Cmd::Close => panic!("a connector closed a stranger"),
            };
        }
    }

    /// One `accept` call.
    fn accept_call(&mut self) {
        let now = self.at(self.now);
        let take = self.acceptor.core.begin(now);
        // The hellos already in first, then the newcomers, each served in this call.
        let ids = self.acceptor.core.ids();
        if !self.serve_all(ids, now) && take {
            let new = self.take_new(now);
            self.serve_all(new, now);
        }
        let a = &mut self.acceptor;
        if a.outcome.is_none()
            && let Err(e) = a.core.end(now)
        {
            a.outcome = Some(Err(e));
        }
        a.warnings.extend(a.core.take_warnings());
    }

    /// `true` once `accept` has its answer.
    fn serve_all(&mut self, ids: Vec<ConnId>, now: Instant) -> bool {
        ids.into_iter().any(|id| self.serve(id, now))
    }

    fn take_new(&mut self, now: Instant) -> Vec<ConnId> {
        let mut ready: Vec<usize> = (0..self.socks.len())
            .filter(|&i| {
                !self.socks[i].taken && self.socks[i].arrive.is_some_and(|a| a <= self.now)
            })
            .collect();
        ready.sort_by_key(|&i| (self.socks[i].arrive, i));
        let mut ids = Vec::new();
        for s in ready.into_iter().take(MAX_PENDING) {
            self.socks[s].taken = true;
            let id = self.acceptor.core.admit(self.socks[s].peer, now);
            self.acceptor.conns.insert(id, s);
            ids.push(id);
        }
        ids
    }

    fn drop_sock(&mut self, s: usize) {
        self.socks[s].closed[SERVER] = true;
        self.acceptor.dropped_at.insert(s, self.now);
    }

    /// Serves one connection until it waits; `true` once `accept` has its answer.
    fn serve(&mut self, id: ConnId, now: Instant) -> bool {
        let s = self.acceptor.conns[&id];
        let (a, sock) = (&mut self.acceptor, &mut self.socks[s]);
        let mut buf = [0u8; MSG_LEN];
        let mut input = Input::Poll;
        let end = loop {
            input = match a.core.advance(id, now, input) {
                Cmd::Recv(n) => sock.read(SERVER, &mut buf[..n]),
                Cmd::Send(bytes) => sock.write(SERVER, bytes),
                Cmd::ConnectQps(plan) => {
                    a.plans.push((s, *plan, sock.written[DOWN]));
                    a.fail_qps.take().map_or(Input::QpsReady, Input::Local)
                }
                Cmd::Endpoint => match a.fail_endpoint.take() {
                    Some(e) => Input::Local(e),
                    None => Input::Endpoint(Box::new(a.local)),
                },
                Cmd::Wait => return false,
                end @ (Cmd::Close | Cmd::Fail(_) | Cmd::Done(_)) => break end,
                Cmd::AwaitConnect => panic!("a listener connected"),
            };
        };
        let finished = match end {
            Cmd::Close => {
                a.rejected += 1;
                false
            }
            Cmd::Fail(e) => {
                a.outcome = Some(Err(e));
                true
            }
            Cmd::Done(hello) => {
                a.outcome = Some(Ok((s, *hello)));
                let others: Vec<usize> =
                    a.conns.drain().map(|(_, o)| o).filter(|&o| o != s).collect();
                for o in others {
                    self.drop_sock(o);
                }
                self.socks[s].closed[SERVER] = true;
                return true;
            }
            _ => unreachable!(),
        };
        self.acceptor.conns.remove(&id);
        self.drop_sock(s);
        finished
    }

    /// The rejections of this wait: those logged one by one and those counted.
    fn rejections(&self) -> u64 {
        let w = &self.acceptor.warnings;
        let one_by_one = w.iter().filter(|l| l.contains(": rejected connection from ")).count();
        let counted: u64 = w
            .iter()
            .filter_map(|l| {
                l.split(": ").nth(1)?.split(" more connection(s)").next()?.parse::<u64>().ok()
            })
            .sum();
        one_by_one as u64 + counted
    }

    /// Both ends connected, each to the other, with the QPs moved before they were needed.
    fn assert_connected(&self, nqps: usize) {
        let d = self.dialer();
        let a = &self.acceptor;
        let p = policy(nqps);
        let reply = match &d.outcome {
            Some(Ok(m)) => *m,
            other => panic!("the connector ended with {other:?}"),
        };
        assert_eq!(reply, message(Kind::Reply, NONCE, &p, &a.local));
        let (s, got) = match &a.outcome {
            Some(Ok(x)) => *x,
            other => panic!("the listener ended with {other:?}"),
        };
        assert_eq!(s, d.sock, "the listener connected someone else");
        assert_eq!(got, message(Kind::Hello, NONCE, &p, &d.local));
        // The connector's QPs go to RTS before its ready: it had sent its hello alone.
        let (plan, sent) = d.plan.expect("the connector connected its QPs");
        assert_eq!(sent, MSG_LEN);
        assert_eq!(plan, QpPlan::towards(&reply, &p, p.tc));
        assert_eq!(plan.remote_qpns, a.local.qpns);
        // The acceptor's before its reply, with its own FIFO traffic class.
        let (_, plan, sent) = *a.plans.iter().find(|x| x.0 == s).expect("the acceptor's QPs");
        assert_eq!(sent, 0);
        assert_eq!(
            (plan.remote_qpns, plan.remote_ends[0].gid, plan.remote_ends[0].mtu),
            (d.local.qpns, d.local.gid, d.local.mtu)
        );
        assert_eq!(
            (plan.nqps, plan.split, plan.sports, plan.traffic_class, plan.sl),
            (nqps, p.split, p.sports, FIFO_TC, p.sl)
        );
    }
}

fn remote(e: &Error, want: &str) {
    assert!(matches!(e, Error::Remote(t) if t.contains(want)), "{e:?} is not Remote({want:?}...)");
}

/// Whether an end connected; a failure must be the peer's doing.
fn connected<T>(o: &Option<Result<T, Error>>) -> Result<bool, TestCaseError> {
    match o {
        Some(Ok(_)) => Ok(true),
        Some(Err(e)) => {
            prop_assert!(matches!(e, Error::Remote(_)), "{:?}", e);
            Ok(false)
        }
        None => Err(TestCaseError::fail("an end never decided")),
    }
}

fn listener_error(w: &World) -> &Error {
    match &w.acceptor.outcome {
        Some(Err(e)) => e,
        other => panic!("the listener ended with {other:?}"),
    }
}

fn dialer_error(w: &World) -> &Error {
    match &w.dialer().outcome {
        Some(Err(e)) => e,
        other => panic!("the connector ended with {other:?}"),
    }
}

// --- the rightful peer and strangers ----------------------------------------------------------

/// What a stranger sends.
#[derive(Clone, Debug)]
enum Stray {
    Silent,
    Garbage(Vec<u8>),
    /// The first bytes of a valid hello, then it closes.
    Truncated(usize),
    /// The first bytes of a valid hello, then silence.
    Stalled(usize),
    WrongNonce,
    /// A well-formed message of another kind.
    Reply,
    /// A hello with the right nonce and a QP count of 0.
    NoQps,
    /// A hello with the right nonce and more QPs than the listener's own count.
    TooManyQps(usize),
}

impl Stray {
    fn bytes(&self) -> (Vec<u8>, bool) {
        let h = hello(2);
        match self {
            Stray::Silent => (Vec::new(), false),
            Stray::Garbage(b) => (b.clone(), true),
            Stray::Truncated(n) => (h[..*n].to_vec(), true),
            Stray::Stalled(n) => (h[..*n].to_vec(), false),
            Stray::WrongNonce => {
                let m = message(Kind::Hello, NONCE ^ 1, &policy(2), &local(9, 2));
                (m.encode().to_vec(), false)
            }
            Stray::Reply => {
                (message(Kind::Reply, NONCE, &policy(2), &local(9, 2)).encode().to_vec(), false)
            }
            Stray::NoQps => {
                let mut b = h;
                b[32] = 0;
                (b.to_vec(), false)
            }
            Stray::TooManyQps(n) => {
                (message(Kind::Hello, NONCE, &policy(*n), &local(1, *n)).encode().to_vec(), false)
            }
        }
    }
}

fn stray() -> impl Strategy<Value = Stray> {
    prop_oneof![
        Just(Stray::Silent),
        // Anything but our magic's first byte, so that it is garbage.
        (0u8..0x46, proptest::collection::vec(any::<u8>(), 0..100))
            .prop_map(|(b0, rest)| Stray::Garbage([vec![b0], rest].concat())),
        (0..MSG_LEN).prop_map(Stray::Truncated),
        (0..MSG_LEN).prop_map(Stray::Stalled),
        Just(Stray::WrongNonce),
        Just(Stray::Reply),
        Just(Stray::NoQps),
        (MAX_QPS_HERE + 1..=MAX_QPS).prop_map(Stray::TooManyQps),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_rightful_peer_connects_through_any_chunking(
        nqps in 1usize..=8,
        chunk in 1..=MSG_LEN,
        window in MSG_LEN..=3 * MSG_LEN,
        dial_every in 1u64..2000,
        accept_every in 1u64..2000,
        start in 0u64..3000,
        rtt in 0u64..500,
    ) {
        let mut w = World::new(nqps, accept_every);
        let s = w.dial(nqps, start, Some(start + rtt), dial_every);
        w.socks[s].chunk = chunk;
        w.socks[s].window = [window; 2];
        w.run(60_000);
        w.assert_connected(nqps);
        prop_assert!(w.acceptor.warnings.is_empty(), "{:?}", w.acceptor.warnings);
    }

    #[test]
    fn strangers_before_during_and_after_the_peer_are_dropped_alone(
        strangers in proptest::collection::vec((stray(), 0u64..8000, 1..=MSG_LEN), 0..40),
        later in proptest::collection::vec((stray(), 0u64..8000), 0..10),
        dial_every in 1u64..1500,
        accept_every in 1u64..1500,
        start in 0u64..6000,
    ) {
        let mut w = World::new(2, accept_every);
        for (k, at, chunk) in &strangers {
            let (bytes, close) = k.bytes();
            let s = w.stranger(*at, &bytes, close);
            w.socks[s].chunk = *chunk;
        }
        w.dial(2, start, Some(start), dial_every);
        w.run(60_000);
        w.assert_connected(2);
        // Every stranger the listener took is gone: dropped as a stranger (and counted once,
        // in a line of its own or in the count), or when the peer connected; none held its
        // slot past its hello deadline and the next call.
        let peer = w.dialer().sock;
        for (i, sock) in w.socks.iter().enumerate().filter(|(i, s)| s.taken && *i != peer) {
            let at = w.acceptor.dropped_at.get(&i).copied();
            let arrive = sock.arrive.unwrap();
            let bound = arrive + 5000 + 2 * accept_every;
            prop_assert!(at.is_some_and(|t| t <= bound), "sock {i}: {at:?}");
        }
        prop_assert_eq!(w.rejections(), w.acceptor.rejected);
        // After: a second wait on the same listener, with new strangers, serves the next peer.
        let base = w.now;
        w.acceptor.outcome = None;
        w.acceptor.warnings.clear();
        for (k, at) in &later {
            let (bytes, close) = k.bytes();
            w.stranger(base + at, &bytes, close);
        }
        w.acceptor.next = base + 1;
        w.dial(2, base + 1000, Some(base + 1000), dial_every);
        w.run(base + 60_000);
        w.assert_connected(2);
    }

    /// One byte changed on the way, anywhere in the exchange: never a hang, a local error or a
    /// listener that connects a garbled hello's header; only `Remote` failures.
    #[test]
    fn a_garbled_stream_fails_cleanly(
        dir in 0usize..2,
        off in 0..2 * MSG_LEN,
        mask in 1u8..=255,
    ) {
        let mut w = World::new(2, 10);
        let s = w.dial(2, 0, Some(0), 10);
        w.socks[s].garble = Some((dir, off, mask));
        w.run(100_000);
        let dial_ok = connected(&w.dialer().outcome)?;
        let listen_ok = connected(&w.acceptor.outcome)?;
        // The listener is done only once the connector sent its ready.
        prop_assert!(dial_ok || !listen_ok);
        // Magic, version, kind, length and nonce are checked in every message.
        let header = off % MSG_LEN < 20 || (24..32).contains(&(off % MSG_LEN));
        match (dir, off >= MSG_LEN) {
            // Nothing goes down after the reply.
            (DOWN, true) => prop_assert!(dial_ok && listen_ok),
            // A garbled ready: the connector is done, the listener fails.
            (UP, true) if header => prop_assert!(dial_ok && !listen_ok),
            (_, false) if header => prop_assert!(!dial_ok && !listen_ok),
            _ => {}
        }
    }

    /// The connection closes after `at` bytes one way.
    #[test]
    fn a_cut_stream_fails_cleanly(dir in 0usize..2, at in 0..2 * MSG_LEN) {
        let mut w = World::new(2, 10);
        let s = w.dial(2, 0, Some(0), 10);
        w.socks[s].cut = Some((dir, at));
        w.run(100_000);
        let truncated = |n: usize| if n == 0 {
            "connection closed".to_string()
        } else {
            format!("connection closed after {n} of {MSG_LEN} bytes (truncated message)")
        };
        match (dir, at) {
            (UP, at) if at < MSG_LEN => {
                // A truncated hello is a stranger's: the listener waits on, until its deadline.
                remote(dialer_error(&w), "connect to 10.0.0.1:4000: send hello: Broken pipe");
                remote(listener_error(&w), "no peer connected within 20000 ms");
                let peer = w.socks[s].peer;
                let why = format!("rejected connection from {peer}: {}", truncated(at));
                prop_assert!(w.acceptor.warnings[0].contains(&why), "{:?}", w.acceptor.warnings);
            }
            (UP, MSG_LEN) => {
                remote(dialer_error(&w), "wait for reply: connection closed");
                remote(listener_error(&w), "send reply: Broken pipe");
            }
            (UP, at) => {
                remote(dialer_error(&w), "connect to 10.0.0.1:4000: send ready: Broken pipe");
                let why = format!("wait for ready: {}", truncated(at - MSG_LEN));
                remote(listener_error(&w), &why);
            }
            (_, at) if at < MSG_LEN => {
                let why = format!("wait for reply: {}", truncated(at));
                remote(dialer_error(&w), &why);
                remote(listener_error(&w), "send reply: Broken pipe");
            }
            (_, MSG_LEN) => {
                remote(dialer_error(&w), "connect to 10.0.0.1:4000: send ready: Broken pipe");
                remote(listener_error(&w), "wait for ready: connection closed");
            }
            _ => w.assert_connected(2),
        }
    }
}

#[test]
fn each_kind_of_stranger_is_dropped_with_its_reason() {
    let mut garbage = vec![0xffu8; 40];
    garbage[0] = 0x12;
    let cases: Vec<(Stray, String, u64)> = vec![
        (Stray::Garbage(garbage), "bad magic 0xffffffffffffff12 (not a ferroce peer)".into(), 0),
        (
            Stray::Truncated(100),
            format!("connection closed after 100 of {MSG_LEN} bytes (truncated message)"),
            0,
        ),
        (Stray::Truncated(0), "connection closed".into(), 0),
        (
            Stray::WrongNonce,
            "nonce does not match this listener (stale or foreign handle)".into(),
            0,
        ),
        (Stray::Reply, "unexpected message kind 2".into(), 0),
        (Stray::NoQps, "invalid field nqps, split or sl".into(), 0),
        (
            Stray::TooManyQps(9),
            "its hello asks for 9 QPs, more than 8 here (NCCL_IB_QPS_PER_CONNECTION=8 per port of \
             the end with more ports: set it alike on every rank)"
                .into(),
            0,
        ),
        (Stray::Silent, "no hello within 5000 ms".into(), 5100),
        (Stray::Stalled(40), "no hello within 5000 ms".into(), 5100),
    ];
    for (k, why, when) in cases {
        let mut w = World::new(2, 100);
        let (bytes, close) = k.bytes();
        let s = w.stranger(0, &bytes, close);
        w.run(10_000);
        assert_eq!(w.acceptor.dropped_at.get(&s), Some(&when), "{k:?}");
        let line = format!(
            "listener {LISTENER} (device sim0): rejected connection from {}: {why}; still waiting for the peer",
            w.socks[s].peer
        );
        assert_eq!(w.acceptor.warnings, [line], "{k:?}");
        assert!(w.acceptor.outcome.is_none(), "a stranger failed accept: {k:?}");
    }
}

#[test]
fn a_silent_stranger_is_dropped_just_after_the_hello_timeout() {
    let t0 = Instant::now();
    let mut l = listen("l", MAX_QPS_HERE, &unproven());
    assert!(l.begin(t0));
    let id = l.admit("10.0.0.9:1".parse().unwrap(), t0);
    for after in [0, 5000] {
        let now = t0 + Duration::from_millis(after);
        assert!(matches!(l.advance(id, now, Input::Poll), Cmd::Recv(MSG_LEN)));
        assert!(matches!(l.advance(id, now, Input::Blocked), Cmd::Wait), "dropped at {after} ms");
    }
    let late = t0 + HELLO_TIMEOUT + Duration::from_millis(1);
    assert!(matches!(l.advance(id, late, Input::Poll), Cmd::Recv(MSG_LEN)));
    assert!(matches!(l.advance(id, late, Input::Blocked), Cmd::Close));
    assert!(l.ids().is_empty());
    assert!(l.end(late).is_ok(), "a stranger is no reason to fail");
}

#[test]
fn a_silent_listener_fails_the_connector_just_after_its_deadline() {
    let t0 = Instant::now();
    // No TCP connection ever.
    let mut d = Dial::new(handle(), policy(1), TIMEOUT, t0);
    assert!(matches!(d.advance(t0, Input::Poll), Cmd::AwaitConnect));
    assert!(matches!(d.advance(t0 + TIMEOUT, Input::Blocked), Cmd::Wait));
    let late = t0 + TIMEOUT + Duration::from_millis(1);
    assert!(matches!(d.advance(late, Input::Poll), Cmd::AwaitConnect));
    let Cmd::Fail(e) = d.advance(late, Input::Blocked) else { panic!("not failed") };
    remote(
        &e,
        "connect to 10.0.0.1:4000: TCP connect: no progress within 20000 ms (FERROCE_SETUP_TIMEOUT_MS)",
    );
    // Connected, hello sent, no reply: the deadline runs from the hello.
    let mut w = World::new(1, 1_000_000);
    w.dial(1, 0, Some(3000), 1000);
    w.run(3000 + 20_000);
    assert!(w.dialer().outcome.is_none(), "failed at its deadline");
    w.run(3000 + 21_000);
    remote(
        dialer_error(&w),
        "connect to 10.0.0.1:4000: wait for reply: no progress within 20000 ms",
    );
    assert_eq!(w.socks[w.dialer().sock].written[UP], MSG_LEN);
}

#[test]
fn a_slow_peer_at_every_step_is_not_late() {
    // The listener is called every 19 s. The connector's TCP connect takes 19.5 s, its reply
    // comes 18.5 s after its hello, its ready is read 19 s after the reply: each step within
    // the 20 s timeout, 57 s in all. The listener's own deadline passes before the peer
    // proves itself, in the same call that serves it.
    let mut w = World::new(2, 19_000);
    w.dial(2, 0, Some(19_500), 100);
    w.run(100_000);
    w.assert_connected(2);
    assert_eq!(w.now, 57_000);
}

#[test]
fn a_peer_that_takes_its_time_with_the_hello_is_served() {
    // The listener takes the connection at 0; NCCL's next connect call comes 4.9 s later.
    let mut w = World::new(2, 100);
    w.dial(2, 0, Some(0), 4900);
    w.dialer.as_mut().unwrap().next = 4900;
    w.run(60_000);
    w.assert_connected(2);
}

#[test]
fn a_proven_peer_that_goes_silent_fails_accept() {
    let mut w = World::new(2, 100);
    let s = w.dial(2, 0, Some(0), 100);
    w.run(50);
    assert_eq!(w.socks[s].written[UP], MSG_LEN, "hello sent");
    // NCCL stops calling connect: no ready.
    w.dialer.as_mut().unwrap().next = 1 << 40;
    w.run(100_000);
    let e = listener_error(&w);
    remote(
        e,
        &format!("accept from {}: wait for ready: no answer within 20000 ms", w.socks[s].peer),
    );
    assert_eq!(w.now, 20_100, "failed at the first call after the deadline");
}

#[test]
fn the_listener_fails_when_no_peer_proves_itself_in_time() {
    let mut w = World::new(2, 1000);
    for i in 0..30 {
        // Half of them garbage, half of them silent (pending for 5 s each).
        let bytes: &[u8] = if i % 2 == 0 { b"GET / HTTP/1.1\r\nHost: x\r\n\r\n-----" } else { b"" };
        w.stranger(700 * i, bytes, i % 2 == 0);
    }
    w.run(100_000);
    // Strangers came and were pending all along: the deadline stayed 20 s after the first call.
    assert_eq!(w.now, 21_000);
    let want = format!(
        "accept on 10.0.0.1:4000: no peer connected within 20000 ms (step: wait for connection; \
         FERROCE_SETUP_TIMEOUT_MS; {} other connection(s) rejected meanwhile)",
        w.acceptor.rejected
    );
    remote(listener_error(&w), &want);
    assert!(w.acceptor.rejected >= 20, "{}", w.acceptor.rejected);
}

#[test]
fn a_second_wait_on_the_listener_has_its_own_deadline() {
    let mut w = World::new(2, 100);
    w.dial(2, 0, Some(0), 100);
    w.run(1000);
    w.assert_connected(2);
    // NCCL calls accept again 30 s later, for another connection, which comes 15 s after that.
    w.acceptor.outcome = None;
    w.acceptor.next = 30_000;
    w.dial(2, 45_000, Some(45_000), 100);
    w.run(100_000);
    w.assert_connected(2);
    // And a wait without a peer ends 20 s after its own first call.
    w.acceptor.outcome = None;
    w.acceptor.next = 200_000;
    w.run(300_000);
    remote(listener_error(&w), "no peer connected within 20000 ms");
    assert_eq!(w.now, 220_100);
}

#[test]
fn a_slow_reader_of_the_reply_gets_its_timeout_for_each_step() {
    // The reply goes out half at once and half when the connector reads, 19 s later: the
    // reply's deadline runs from the hello, the ready's from the reply, not from the
    // connection's arrival or from the hello.
    let mut w = World::new(2, 100);
    let s = w.dial(2, 0, Some(0), 19_000);
    w.socks[s].window[DOWN] = MSG_LEN / 2;
    w.run(100_000);
    w.assert_connected(2);
    assert_eq!(w.now, 38_000);
}

#[test]
fn a_flood_never_pushes_out_a_proven_peer() {
    let mut w = World::new(2, 50);
    w.dial(2, 0, Some(0), 50);
    w.run(10);
    // The peer has proven itself; it reads the reply and sends its ready only at 3 s.
    w.dialer.as_mut().unwrap().next = 3000;
    for i in 0..2 * MAX_PENDING {
        w.stranger(100 + i as u64, &[], false);
    }
    w.run(10_000);
    w.assert_connected(2);
    // The peer holds no place once proven: 64 strangers get one, the other 64 are refused.
    assert_eq!(w.rejections(), MAX_PENDING as u64);
}

#[test]
fn rejections_are_logged_eight_times_then_counted() {
    let mut w = World::new(2, 100);
    for i in 0..20 {
        w.stranger(i, &[0; 32], true);
    }
    w.dial(2, 500, Some(500), 100);
    w.run(10_000);
    w.assert_connected(2);
    let lines = &w.acceptor.warnings;
    assert_eq!(lines.len(), REJECT_WARNS as usize + 1, "{lines:?}");
    assert!(lines[7].ends_with("(further rejections are counted, not logged one by one)"));
    assert!(!lines[6].contains("further"));
    assert_eq!(
        lines[8],
        format!(
            "listener {LISTENER} (device sim0): 12 more connection(s) rejected without a line each (20 in total)"
        )
    );
}

#[test]
fn accept_errors_skip_one_connection_or_back_off() {
    let t0 = Instant::now();
    let mut l = listen("l", MAX_QPS_HERE, &unproven());
    assert!(l.begin(t0));
    assert_eq!(l.accept_failed(AcceptErr::Transient, &"aborted", t0), AcceptErr::Transient);
    assert_eq!(l.accept_failed(AcceptErr::Exhausted, &"too many", t0), AcceptErr::Exhausted);
    assert_eq!(l.accept_failed(AcceptErr::Fatal, &"bad", t0), AcceptErr::Fatal);
    let w = l.take_warnings();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains(
            "rejected connection from (unknown): accept: aborted; that connection is lost"
        )
    );
    assert!(w[1].contains("accept: too many; not taking connections for 100 ms"));
    assert!(!l.begin(t0 + ACCEPT_BACKOFF - Duration::from_millis(1)));
    assert!(l.begin(t0 + ACCEPT_BACKOFF));
}

#[test]
fn local_failures_of_either_side_keep_their_class() {
    for (qps, reply_step) in [(true, "create queue pairs"), (false, "reply")] {
        let mut w = World::new(2, 10);
        let s = w.dial(2, 0, Some(0), 10);
        if qps {
            w.acceptor.fail_qps = Some(verbs_error("mlx5_0"));
        } else {
            w.acceptor.fail_endpoint = Some(Error::Local("device dead".into()));
        }
        w.run(60_000);
        let e = listener_error(&w).to_string();
        assert!(e.contains(&format!("accept from {}: {reply_step}", w.socks[s].peer)), "{e}");
        assert!(!matches!(listener_error(&w), Error::Remote(_)));
        // The connector sees only a closed connection: the peer's doing.
        remote(dialer_error(&w), "wait for reply: connection closed");
    }
    for (qps, step) in [(true, "connect queue pairs"), (false, "hello")] {
        let mut w = World::new(2, 10);
        w.dial(2, 0, Some(0), 10);
        let d = w.dialer.as_mut().unwrap();
        if qps {
            d.fail_qps = Some(verbs_error("mlx5_0"));
        } else {
            d.fail_endpoint = Some(Error::Local("device dead".into()));
        }
        w.run(60_000);
        let e = dialer_error(&w);
        assert!(e.to_string().contains(&format!("connect to {LISTENER}: {step}")), "{e}");
        assert!(matches!(e, Error::Verbs { errno: EINVAL, .. } | Error::Local(_)), "{e:?}");
    }
}

#[test]
fn a_refused_connect_is_the_peers_doing() {
    let mut w = World::new(2, 10);
    w.dial(2, 0, None, 10);
    w.dialer.as_mut().unwrap().refused = true;
    w.run(1000);
    remote(dialer_error(&w), "connect to 10.0.0.1:4000: TCP connect: Connection refused");
}

#[test]
fn a_reply_for_another_qp_count_fails_the_connector() {
    let t0 = Instant::now();
    let mut d = Dial::new(handle(), policy(2), TIMEOUT, t0);
    assert!(matches!(d.advance(t0, Input::Connected), Cmd::Endpoint));
    let Cmd::Send(b) = d.advance(t0, Input::Endpoint(Box::new(local(1, 2)))) else { panic!() };
    let n = b.len();
    assert!(matches!(d.advance(t0, Input::Sent(n)), Cmd::Recv(MSG_LEN)));
    let reply = message(Kind::Reply, NONCE, &policy(3), &local(2, 3)).encode();
    let Cmd::Fail(e) = d.advance(t0, Input::Received(&reply)) else { panic!("accepted") };
    remote(&e, "connect to 10.0.0.1:4000: wait for reply: peer has 3 QPs, not 2");
}

#[test]
fn a_machine_that_ended_or_gets_the_wrong_input_fails_without_panicking() {
    let t0 = Instant::now();
    let mut d = Dial::new(handle(), policy(1), TIMEOUT, t0);
    assert!(matches!(d.advance(t0, Input::QpsReady), Cmd::Fail(Error::Internal(_))));
    assert!(matches!(d.advance(t0, Input::Poll), Cmd::Fail(Error::Internal(_))));
    let mut l = listen("l", MAX_QPS_HERE, &unproven());
    assert!(matches!(l.advance(7, t0, Input::Poll), Cmd::Fail(Error::Internal(_))));
}

// --- the edges, unchanged from before the split ------------------------------------------------

#[test]
fn rejections_log_the_first_eight_then_a_count() {
    let t0 = Instant::now();
    let mut log = RejectLog::default();
    assert_eq!(log.summary(t0, true), None, "nothing to report yet");
    for i in 1..=REJECT_WARNS {
        assert!(log.note(t0), "rejection {i} is logged");
        assert_eq!(log.last_logged(), i == REJECT_WARNS);
    }
    assert_eq!(log.summary(t0, true), None, "all were logged");
    for _ in 0..5 {
        assert!(!log.note(t0));
    }
    assert!(!log.last_logged());
    // Not due before the period, unless forced.
    assert_eq!(log.summary(t0 + REJECT_SUMMARY_EVERY / 2, false), None);
    assert_eq!(log.summary(t0 + REJECT_SUMMARY_EVERY, false), Some((5, 13)));
    assert_eq!(log.summary(t0 + REJECT_SUMMARY_EVERY, true), None, "reported once");
    // Counting goes on silently: a listener logs at most eight by themselves.
    assert!(!log.note(t0 + REJECT_SUMMARY_EVERY));
    assert_eq!(log.summary(t0 + REJECT_SUMMARY_EVERY, true), Some((1, 14)));
}

#[test]
fn local_failures_keep_their_class_and_peer_failures_are_remote() {
    // A local failure while serving the proven peer: the verb's error, with the step.
    let e = ours("accept from 10.0.0.2:5: create queue pairs".into())(Error::verbs(
        "ibv_create_qp",
        ENOMEM,
        "mlx5_0",
    ));
    assert!(matches!(e, Error::Verbs { verb: "ibv_create_qp", errno: ENOMEM, .. }));
    assert!(e.to_string().contains("accept from 10.0.0.2:5: create queue pairs"), "{e}");
    let dead = ours("connect to 10.0.0.1:7: hello".into())(Error::Local("device dead".into()));
    assert!(matches!(dead, Error::Local(ref t) if t.contains("connect to 10.0.0.1:7")));
    // What the peer did.
    let r = theirs("accept from 10.0.0.2:5: wait for ready", Reject::Nonce);
    assert!(matches!(r, Error::Remote(ref t) if t.contains("nonce")), "{r}");
    let closed = theirs("connect to 10.0.0.1:7: wait for reply", Bad::Closed(10));
    assert!(matches!(closed, Error::Remote(ref t) if t.contains("truncated")), "{closed}");
}

// --- admission: a flood between the peer's connect and its hello ------------------------------

/// The rightful peer's TCP connection arrives at 0 and its hello at `hello_at` ms; `strangers`
/// silent connections from `sources` addresses arrive in between, spread evenly; the listener
/// is called every `accept_every` ms from `first_accept`.
fn flood_between_connect_and_hello(
    strangers: usize,
    sources: usize,
    hello_at: u64,
    accept_every: u64,
    first_accept: u64,
) -> World {
    let mut w = World::new(2, accept_every);
    w.acceptor.next = first_accept;
    w.dial(2, 0, Some(0), 50);
    w.dialer.as_mut().unwrap().next = hello_at;
    for i in 0..strangers {
        let at = 1 + i as u64 * hello_at.saturating_sub(2) / strangers as u64;
        let s = w.stranger(at, &[], false);
        let ip = [10, 0, 3 + (i % sources / 250) as u8, (i % sources % 250) as u8 + 1];
        w.socks[s].peer = SocketAddr::new(ip.into(), 40_000 + i as u16);
    }
    w.run(60_000);
    w
}

#[test]
fn a_flood_between_the_peers_connect_and_its_hello_does_not_knock_it_off() {
    // From one source and from many; the listener takes the peer's connection before the
    // flood (called every 10 ms) or with it (first called after the hello).
    for sources in [1, 300] {
        for (every, first) in [(10, 0), (10, 1500), (1, 0)] {
            let w = flood_between_connect_and_hello(300, sources, 1000, every, first);
            w.assert_connected(2);
        }
    }
}

#[test]
fn a_full_listener_still_reads_a_newcomers_waiting_hello() {
    // 64 silent strangers hold every place; the peer's hello is in before the listener takes
    // its connection: read once, it proves the peer, which connects. Nobody was pushed out.
    let mut w = World::new(2, 50);
    let silent: Vec<usize> = (0..MAX_PENDING).map(|i| w.stranger(i as u64, &[], false)).collect();
    w.dial(2, 100, Some(100), 50);
    w.run(1000);
    w.assert_connected(2);
    assert_eq!(w.rejections(), 0);
    assert!(silent.iter().all(|s| w.acceptor.dropped_at[s] > 100), "{:?}", w.acceptor.dropped_at);
}

#[test]
fn a_newcomer_beyond_the_cap_proves_itself_within_its_grace() {
    // The same, but the listener is full before the peer comes (the strangers came first, a
    // flood that fills the caps), and the peer's hello comes 400 ms after its connection:
    // within its grace, so it connects, and none of those that came first is pushed out.
    let mut w = World::new(2, 50);
    let silent: Vec<usize> = (0..MAX_PENDING).map(|i| w.stranger(i as u64, &[], false)).collect();
    w.dial(2, 100, Some(100), 50);
    w.dialer.as_mut().unwrap().next = 500;
    w.run(1000);
    w.assert_connected(2);
    assert!(silent.iter().all(|s| w.acceptor.dropped_at[s] >= 500), "{:?}", w.acceptor.dropped_at);
}

#[test]
fn a_newcomer_beyond_the_cap_is_refused_once_its_grace_is_over() {
    // The same with the hello 600 ms after the connection: past the grace (500 ms), the
    // newcomer is refused, not one of those that came first pushed out.
    let mut w = World::new(2, 50);
    for i in 0..MAX_PENDING {
        w.stranger(i as u64, &[], false);
    }
    let s = w.dial(2, 100, Some(100), 50);
    w.dialer.as_mut().unwrap().next = 700;
    w.run(1000);
    remote(dialer_error(&w), "connect to 10.0.0.1:4000: send hello: Broken pipe");
    assert_eq!(w.acceptor.dropped_at[&s], 650, "at the listener's first call past 600 ms");
    let line = format!(
        "listener {LISTENER} (device sim0): rejected connection from {}: refused: 64 \
         connections to this listener have yet to prove themselves (none is pushed out for a \
         newcomer); still waiting for the peer",
        w.socks[s].peer
    );
    assert_eq!(w.acceptor.warnings, [line]);
    assert_eq!(w.acceptor.core.pending.iter().filter(|p| p.place.is_some()).count(), MAX_PENDING);
}

#[test]
fn at_most_max_grace_newcomers_wait_in_their_grace() {
    let t0 = Instant::now();
    let count = unproven();
    let mut l = listen("l", MAX_QPS_HERE, &count);
    l.begin(t0);
    for i in 0..MAX_PENDING + MAX_GRACE {
        let id = l.admit(host(i as u16), t0);
        assert!(matches!(l.advance(id, t0, Input::Poll), Cmd::Recv(MSG_LEN)));
        assert!(matches!(l.advance(id, t0, Input::Blocked), Cmd::Wait), "{i} kept");
    }
    let id = l.admit(host(999), t0);
    assert!(matches!(l.advance(id, t0, Input::Poll), Cmd::Recv(MSG_LEN)));
    assert!(matches!(l.advance(id, t0, Input::Blocked), Cmd::Close), "no grace left: refused");
    assert_eq!(l.ids().len(), MAX_PENDING + MAX_GRACE);
}

/// Host `i`'s address (each its own: one address holds at most [`MAX_PER_SOURCE`] places).
fn host(i: u16) -> SocketAddr {
    SocketAddr::new([10, 1, (i >> 8) as u8, i as u8].into(), 40000)
}

/// Admits a silent connection from host `i` to `l` and serves it once, then again once any
/// grace is over: whether it was kept (it has a place).
fn admit_silent(l: &mut Listen, i: u16, now: Instant) -> bool {
    admit_silent_from(l, host(i), now)
}

fn admit_silent_from(l: &mut Listen, from: SocketAddr, now: Instant) -> bool {
    let id = l.admit(from, now);
    let later = now + GRACE + Duration::from_millis(1);
    for at in [now, later] {
        assert!(matches!(l.advance(id, at, Input::Poll), Cmd::Recv(MSG_LEN)));
        match l.advance(id, at, Input::Blocked) {
            Cmd::Wait => {}
            Cmd::Close => return false,
            other => panic!("{other:?}"),
        }
    }
    true
}

#[test]
fn the_cap_is_exactly_max_pending() {
    let t0 = Instant::now();
    let count = unproven();
    let mut l = listen("l", MAX_QPS_HERE, &count);
    l.begin(t0);
    for i in 0..MAX_PENDING {
        assert!(admit_silent(&mut l, i as u16 + 1, t0), "connection {i} refused");
    }
    assert!(!admit_silent(&mut l, 999, t0), "one too many kept");
    // The listener's first is outside the process's count.
    assert_eq!((l.ids().len(), count.held()), (MAX_PENDING, MAX_PENDING - 1));
    assert_eq!(l.ids(), (0..MAX_PENDING as u64).collect::<Vec<_>>(), "the first ones stay");
    let w = l.take_warnings();
    assert_eq!(w.len(), 1);
    assert!(
        w[0].contains(
            "from 10.1.3.231:40000: refused: 64 connections to this listener have yet to prove \
             themselves (none is pushed out for a newcomer)"
        ),
        "{w:?}"
    );
    // They expire at the hello deadline; then there is room again, and the count is given back.
    let late = t0 + HELLO_TIMEOUT + Duration::from_millis(1);
    for id in l.ids() {
        assert!(matches!(l.advance(id, late, Input::Blocked), Cmd::Close));
    }
    assert_eq!(count.held(), 0);
    assert!(admit_silent(&mut l, 1000, late));
    drop(l);
    assert_eq!(count.held(), 0, "a closed listener gives its places back");
}

#[test]
fn the_receivers_queue_pairs_take_its_own_fifo_tc_else_the_senders_class() {
    let p = policy(2);
    assert_eq!((p.receiver_tc(Some(FIFO_TC)), p.receiver_tc(None)), (FIFO_TC, p.tc));
}

#[test]
fn one_address_holds_at_most_max_per_source_places() {
    // Silent strangers from one address: the first MAX_PER_SOURCE keep places, the next is
    // refused once its grace is over; a connection from anywhere else still finds a place.
    let t0 = Instant::now();
    let count = unproven();
    let mut l = listen("l", MAX_QPS_HERE, &count);
    l.begin(t0);
    let one = |port| SocketAddr::new([10, 9, 9, 9].into(), port);
    for i in 0..MAX_PER_SOURCE {
        assert!(admit_silent_from(&mut l, one(i as u16), t0), "connection {i} refused");
    }
    assert!(!admit_silent_from(&mut l, one(999), t0), "one address held more");
    let w = l.take_warnings();
    assert!(
        w[0].contains(
            "refused: 16 connections from 10.9.9.9 to this listener have yet to prove themselves"
        ),
        "{w:?}"
    );
    assert!(admit_silent(&mut l, 1, t0), "another address found no place");
    assert_eq!(l.ids().len(), MAX_PER_SOURCE + 1);
}

#[test]
fn the_process_cap_spans_listeners() {
    let t0 = Instant::now();
    // Two listeners share a count of 96; each one's first connection is outside it. The first
    // takes 64 (63 counted), the second only 34 (33 counted).
    let count = Arc::new(Unproven::new(96));
    let (mut a, mut b) = (listen("a", 2, &count), listen("b", 2, &count));
    for i in 0..MAX_PENDING {
        assert!(admit_silent(&mut a, i as u16, t0));
    }
    assert_eq!(count.held(), MAX_PENDING - 1);
    for i in 0..34 {
        assert!(admit_silent(&mut b, i, t0), "b's connection {i} refused");
    }
    assert!(!admit_silent(&mut b, 34, t0));
    assert!(!admit_silent(&mut a, 99, t0), "a is full anyway");
    let w = b.take_warnings();
    assert!(
        w[0].contains(
            "refused: 96 connections to this process's listeners have yet to prove themselves"
        ),
        "{w:?}"
    );
    assert_eq!(count.held(), 96);
    // A closes: its places go to b.
    drop(a);
    assert_eq!(count.held(), 33);
    assert!(admit_silent(&mut b, 35, t0));
    // With the process's own cap: once strangers hold all of it, a listener still takes its
    // first connection (it may be the rightful peer's), and only that one.
    let count = unproven();
    let mut full: Vec<Listen> = (0..5).map(|_| listen("l", 2, &count)).collect();
    let mut taken = 0;
    for l in &mut full {
        for i in 0..MAX_PENDING {
            taken += usize::from(admit_silent(l, i as u16, t0));
        }
    }
    assert_eq!(count.held(), MAX_UNPROVEN);
    assert_eq!(taken, MAX_UNPROVEN + 5, "each listener's first is outside the count");
    let mut next = listen("next", 2, &count);
    assert!(admit_silent(&mut next, 1, t0), "a listener's first connection was refused");
    assert!(!admit_silent(&mut next, 2, t0));
}

#[test]
fn a_proven_peer_gives_its_place_back() {
    // The count of unproven connections is shared: a peer that proved itself, and waits for
    // its ready, must not hold a stranger's place.
    let mut w = World::new(2, 50);
    let count = Arc::new(Unproven::new(1));
    w.acceptor.core = listen("listener", MAX_QPS_HERE, &count);
    w.dial(2, 0, Some(0), 50);
    w.run(10);
    w.dialer.as_mut().unwrap().next = 3000;
    assert_eq!(count.held(), 0, "the proven peer still counts");
    // Two strangers: one in the listener's first place (outside the count), one counted.
    let s = [w.stranger(100, &[], false), w.stranger(110, &[], false)];
    w.run(200);
    assert_eq!(count.held(), 1);
    for s in s {
        assert!(!w.acceptor.dropped_at.contains_key(&s), "a stranger found no place");
    }
    w.run(10_000);
    w.assert_connected(2);
    assert_eq!(count.held(), 0);
}

#[test]
fn a_hello_for_more_qps_than_ours_is_refused() {
    for (asked, ours) in [(5, 4), (MAX_QPS, 1), (4, 4), (1, 1)] {
        let mut w = World::new(asked, 50);
        w.acceptor.core = listen("listener", ours, &unproven());
        let s = w.dial(asked, 0, Some(0), 50);
        w.run(30_000);
        if asked <= ours {
            w.assert_connected(asked);
            continue;
        }
        // Dropped as a stranger, with its reason, before any queue pair was made for it.
        assert!(w.acceptor.plans.is_empty());
        assert_eq!(w.acceptor.dropped_at.get(&s), Some(&0));
        let why = format!(
            "rejected connection from {}: its hello asks for {asked} QPs, more than {ours} here \
             (NCCL_IB_QPS_PER_CONNECTION={ours} per port of the end with more ports: set it \
             alike on every rank)",
            w.socks[s].peer
        );
        assert!(w.acceptor.warnings[0].contains(&why), "{:?}", w.acceptor.warnings);
        remote(dialer_error(&w), "connect to 10.0.0.1:4000: wait for reply: connection closed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Hundreds of silent strangers between the peer's connect and its hello, from one source
    /// or many, whenever the listener is called: the peer connects every time.
    #[test]
    fn a_flood_between_connect_and_hello_never_knocks_the_peer_off(
        strangers in 100usize..500,
        sources in prop_oneof![Just(1usize), 2usize..500],
        hello_at in 2u64..4900,
        accept_every in 1u64..300,
        first_accept in 0u64..300,
    ) {
        let w = flood_between_connect_and_hello(
            strangers, sources, hello_at, accept_every, first_accept,
        );
        w.assert_connected(2);
    }

    /// Whatever QP count a hello asks for and whatever ours is, no queue pairs are made beyond
    /// ours, and the peer connects exactly when it asks for no more.
    #[test]
    fn no_hello_gets_more_qps_than_ours(asked in 1..=MAX_QPS, ours in 1..=MAX_QPS) {
        let mut w = World::new(asked, 50);
        w.acceptor.core = listen("listener", ours, &unproven());
        w.dial(asked, 0, Some(0), 50);
        w.run(30_000);
        prop_assert!(w.acceptor.plans.iter().all(|p| p.1.nqps <= ours));
        prop_assert_eq!(connected(&w.dialer().outcome)?, asked <= ours);
    }
}

/// The QPs a hello may ask for: `NCCL_IB_QPS_PER_CONNECTION` per port of the end with more
/// ports, so a fused end's hello (or a fused listener's peer) is within it, and no more.
#[test]
fn a_fused_end_may_ask_for_qps_per_port_of_the_larger_end() {
    let terms = |ports| Terms {
        nonce: NONCE,
        timeout: Duration::from_secs(1),
        max_qps: 2,
        ports,
        fifo_tc: None,
    };
    let hello = |members| Msg { members, ..message(Kind::Hello, NONCE, &policy(2), &local(1, 2)) };
    assert_eq!(terms(1).bound(&hello(1)), 2);
    assert_eq!(terms(1).bound(&hello(3)), 6, "the connector's 3 ports");
    assert_eq!(terms(4).bound(&hello(2)), 8, "the listener's 4 ports");
}

/// Each QP's first PSN: what its sender starts at is what the peer's receiver expects (both
/// ends compute it from the listener's nonce and the sending QP's number), in 24 bits, never
/// the same for every QP or every connection, and spread over the whole space.
#[test]
fn first_psns_agree_at_both_ends_and_differ_by_connection_and_queue_pair() {
    let (a, b) = (0x1234_5678_9abc_def0u64, 0x0fed_cba9_8765_4321u64);
    let qpns = [0x11u32, 0x12, 0x13, 0xff_ffff];
    let mut seen = std::collections::HashSet::new();
    let mut high = 0;
    for seed in [a, b] {
        for &q in &qpns {
            let psn = first_psn(seed, q);
            assert!(psn <= 0xff_ffff, "24 bits: {psn:#x}");
            assert!(seen.insert(psn), "seed {seed:#x} qpn {q:#x}: {psn:#x} repeats");
            high += usize::from(psn >= 0x80_0000);
        }
    }
    assert!((2..=6).contains(&high), "{high} of 8 in the upper half");
    // A plan draws from the nonce its peer's message carries (the listener's, in both).
    let hello = message(Kind::Hello, a, &policy(2), &local(1, 2));
    assert_eq!(QpPlan::towards(&hello, &policy(2), 0).psn_seed, a);
}

/// A peer's control-area address whose area would wrap the address space is refused in the
/// handshake: every address the data path derives from it is then a sum that cannot overflow.
#[test]
fn a_buffer_address_whose_area_wraps_is_refused() {
    let mut m = message(Kind::Hello, NONCE, &policy(2), &local(1, 2));
    m.buf_addr = u64::MAX - wire::AREA_BYTES + 1;
    let r = Msg::decode(&m.encode(), Kind::Hello, NONCE);
    assert_eq!(r, Err(Reject::Field("buffer (its area would wrap the address space)")));
    m.buf_addr = u64::MAX - wire::AREA_BYTES;
    assert_eq!(Msg::decode(&m.encode(), Kind::Hello, NONCE).map(|d| d.buf_addr), Ok(m.buf_addr));
}
