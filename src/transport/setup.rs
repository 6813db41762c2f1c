//! Connection setup: `listen`, and the resumable `connect` and `accept` state machines.
//!
//! Both machines advance as far as they can without blocking and return `Ok(None)` to be called
//! again. Every step has a deadline (`FERROCE_SETUP_TIMEOUT_MS`); a passed deadline is an error
//! naming the peer and the step.
//!
//! The listener serves any connection until it proves itself with a hello carrying this
//! listener's nonce. It holds at most [`MAX_PENDING`] unproven ones (a newcomer pushes out the
//! oldest), gives each [`HELLO_TIMEOUT`] to send its hello, and drops one that fails (wrong
//! magic, version, length or nonce, a truncated message, silence) alone, with a WARN for the
//! first [`REJECT_WARNS`] and a count for the rest. Nothing a stranger does moves the
//! listener's own deadline: the rightful peer must prove itself within
//! `FERROCE_SETUP_TIMEOUT_MS` of the first `accept` call. `accept(2)` errors that concern one
//! connection are skipped, running out of fds backs off, and only a broken listening socket
//! fails `accept`. A peer that proved itself and then fails makes `accept` fail.
//!
//! Error classes: what the peer or the network caused (closed, garbled, late, wrong nonce) is
//! `Error::Remote`; a failure of our own side (queue pairs, registration, a fatal device)
//! keeps its class through `Error::context`.
//!
//! Exchange: connector → `Hello` (its QP, GID, MTU, FIFO); acceptor → `Reply` (its QP, GID,
//! MTU, size records), after moving its QP to RTS; connector → `Ready`, after moving its QP to
//! RTS. So no CTS is ever written before the sender's QP can take it.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use once_cell::sync::Lazy;
use std::time::{Duration, Instant};

use super::comm::{Flusher, Path, RecvComm, RecvParts, SendComm, SendParts};
use super::device;
use super::ecmp;
use super::gid::{self, GidChoice};
use super::handshake::{Handle, Kind, MAX_QPS, MSG_LEN, Msg, Reject, header_len};
use super::net::{CommContext, Net};
use crate::error::{Error, Result};
use crate::verbs::{self, RegisteredBuf, RtrAttr, RtsAttr};

/// One TCP connection carrying fixed-size handshake messages, without blocking.
struct Link {
    stream: TcpStream,
    peer: SocketAddr,
    rx: [u8; MSG_LEN],
    rx_len: usize,
    tx: [u8; MSG_LEN],
    tx_off: usize,
}

impl Link {
    fn new(stream: TcpStream, peer: SocketAddr) -> io::Result<Link> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        Ok(Link { stream, peer, rx: [0; MSG_LEN], rx_len: 0, tx: [0; MSG_LEN], tx_off: MSG_LEN })
    }

    fn queue(&mut self, msg: &Msg) {
        self.tx = msg.encode();
        self.tx_off = 0;
    }

    /// Sends what it can; `true` once the queued message is out.
    fn flush(&mut self) -> io::Result<bool> {
        while self.tx_off < MSG_LEN {
            match self.stream.write(&self.tx[self.tx_off..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.tx_off += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Receives what it can; `Some` once a whole message is in. The header is checked as soon
    /// as it arrives, so a garbage peer is rejected without waiting for more bytes.
    fn recv(&mut self) -> std::result::Result<Option<[u8; MSG_LEN]>, Bad> {
        while self.rx_len < MSG_LEN {
            match self.stream.read(&mut self.rx[self.rx_len..]) {
                Ok(0) => return Err(Bad::Closed(self.rx_len)),
                Ok(n) => {
                    let before = self.rx_len;
                    self.rx_len += n;
                    if before < header_len() && self.rx_len >= header_len() {
                        Msg::check_header(&self.rx).map_err(Bad::Reject)?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Bad::Io(e)),
            }
        }
        self.rx_len = 0;
        Ok(Some(self.rx))
    }
}

/// Why a link's incoming bytes are unusable.
#[derive(Debug)]
enum Bad {
    Reject(Reject),
    /// The peer closed after this many bytes of a message.
    Closed(usize),
    Io(io::Error),
}

impl std::fmt::Display for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bad::Reject(r) => write!(f, "{r}"),
            Bad::Closed(0) => write!(f, "connection closed"),
            Bad::Closed(n) => {
                write!(f, "connection closed after {n} of {MSG_LEN} bytes (truncated message)")
            }
            Bad::Io(e) => write!(f, "{e}"),
        }
    }
}

fn gid_of(net: &Net, dev: usize) -> Result<GidChoice> {
    let d = &net.devices[dev];
    d.check_alive()?;
    d.gid(&net.config)
}

/// The source-port blocks of this process's connections, per peer (`FERROCE_SPORT_SPREAD=1`),
/// from a random start per process.
static PORT_BLOCKS: Lazy<ecmp::Blocks> = Lazy::new(|| {
    let seed = crate::os::random_u64().unwrap_or_else(|_| u64::from(std::process::id()));
    ecmp::Blocks::new(seed)
});

/// How a connection uses its queue pairs: chosen by the connector, followed by the acceptor.
#[derive(Clone, Copy, Debug)]
struct Policy {
    nqps: usize,
    sports: [u16; MAX_QPS],
    split: bool,
    /// Traffic class of the data QPs (the connector's) and of the receiver's control writes.
    tc: u8,
    fifo_tc: u8,
    sl: u8,
}

impl Policy {
    /// The connector's choice: `NCCL_IB_TC` if set, else the communicator's traffic class,
    /// else 0 (NCCL's precedence), and the same for `NCCL_IB_SL` (the communicator's traffic
    /// class in the SL field's 4 bits, as a NIC takes NCCL's value); source ports from `ecmp`,
    /// for a connection from the address `own` to `peer`.
    fn local(net: &Net, comm_tc: Option<u8>, own: IpAddr, peer: IpAddr) -> Policy {
        let c = &net.config;
        let nqps = c.qps_per_conn;
        let ports = if c.sport_spread {
            PORT_BLOCKS.take(c.sport_base, c.sport_range, nqps, own, peer)
        } else {
            ecmp::source_ports(c.sport_base, c.sport_range, nqps)
        };
        let mut sports = [0; MAX_QPS];
        sports[..nqps].copy_from_slice(&ports);
        let tc = c.tc.or(comm_tc).unwrap_or(0);
        let sl = c.sl.or(comm_tc.map(|t| t & 0xf)).unwrap_or(0);
        Policy { nqps, sports, split: c.split_data, tc, fifo_tc: c.fifo_tc.unwrap_or(tc), sl }
    }

    fn of(m: &Msg) -> Policy {
        Policy {
            nqps: usize::from(m.nqps),
            sports: m.sports,
            split: m.split,
            tc: m.traffic_class,
            fifo_tc: m.fifo_tc,
            sl: m.sl,
        }
    }
}

/// The local endpoint message of one side.
fn endpoint(
    net: &Net,
    dev: usize,
    kind: Kind,
    nonce: u64,
    qps: &[verbs::Qp],
    p: &Policy,
    buf: &RegisteredBuf,
) -> Result<Msg> {
    let d = &net.devices[dev];
    let mut qpns = [0; MAX_QPS];
    for (slot, qp) in qpns.iter_mut().zip(qps) {
        *slot = qp.qpn();
    }
    Ok(Msg {
        kind,
        nonce,
        nqps: p.nqps as u8,
        qpns,
        sports: p.sports,
        split: p.split,
        fifo_tc: p.fifo_tc,
        sl: p.sl,
        mtu: d.active_mtu as u8,
        port: d.port,
        traffic_class: p.tc,
        gid: gid_of(net, dev)?.gid,
        buf_addr: buf.addr(0),
        buf_rkey: buf.rkey(),
        max_msg: d.max_msg_sz,
    })
}

/// RTR then RTS of each QP towards its remote QP, with its flow label (so its UDP source
/// port), traffic class `tc` and the policy's service level. The path MTU is the smaller of the
/// two ports' active MTUs.
fn connect_qps(
    net: &Net,
    dev: usize,
    qps: &[verbs::Qp],
    remote: &Msg,
    p: &Policy,
    tc: u8,
) -> Result<()> {
    let d = &net.devices[dev];
    let gid = gid_of(net, dev)?;
    let c = &net.config;
    for (i, qp) in qps.iter().enumerate() {
        qp.to_rtr(&RtrAttr {
            port: d.port,
            path_mtu: d.active_mtu.min(u32::from(remote.mtu)),
            dest_qpn: remote.qpns[i],
            dgid: remote.gid,
            sgid_index: gid.index,
            flow_label: ecmp::label_of_port(p.sports[i]),
            traffic_class: tc,
            sl: p.sl,
        })?;
        qp.to_rts(&RtsAttr {
            timeout: c.ib_timeout,
            retry_cnt: c.ib_retry_cnt,
            rnr_retry: c.rnr_retry,
        })?;
    }
    Ok(())
}

/// What to show when this connection fails, and its INFO line.
fn path(net: &Net, dev: usize, peer: SocketAddr, remote: &Msg, p: &Policy, tc: u8) -> Path {
    let d = &net.devices[dev];
    let c = &net.config;
    let local =
        gid_of(net, dev).map(|g| format!("{} (index {})", g.ip(), g.index)).unwrap_or_default();
    let mtu = device::mtu_bytes(d.active_mtu.min(u32::from(remote.mtu)));
    let describe = format!(
        "{} GID {local} -> {}, path MTU {mtu}, tc {tc}, sl {}, NCCL_IB_TIMEOUT {} / NCCL_IB_RETRY_CNT {} (retries end after {:.3} s)",
        d.name,
        gid::ip_of(&remote.gid),
        p.sl,
        c.ib_timeout,
        c.ib_retry_cnt,
        c.retry_bound().as_secs_f64()
    );
    Path { peer: peer.to_string(), describe, sports: p.sports[..p.nqps].to_vec() }
}

fn log_connection(role: &str, path: &Path, p: &Policy) {
    log::info!(
        "{role} {}: {} QP(s), {}, UDP source ports {:?}, {}",
        path.peer,
        p.nqps,
        if p.split { "messages split across QPs" } else { "messages round-robin over QPs" },
        path.sports,
        path.describe
    );
}

// ---------------------------------------------------------------------------------------------

/// The most connections a listener serves before they prove themselves; when another
/// arrives, the oldest unproven one is dropped.
pub const MAX_PENDING: usize = 64;
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

/// A bound listener: what `listen` returns.
pub struct Listener {
    listener: TcpListener,
    handle: Handle,
    net: Arc<Net>,
    dev: usize,
    /// Connections being served, oldest first; at most [`MAX_PENDING`].
    pending: VecDeque<Pending>,
    /// When the wait for the rightful peer ends: `FERROCE_SETUP_TIMEOUT_MS` after the first
    /// `accept` call of this wait. Nothing a stranger does moves it.
    deadline: Option<Instant>,
    /// No `accept(2)` before this (the process ran out of fds or memory).
    paused_until: Option<Instant>,
    rejects: RejectLog,
    exhausted: RejectLog,
}

enum Stage {
    AwaitHello,
    SendReply(Box<Accepted>),
    AwaitReady(Box<Accepted>),
}

struct Accepted {
    parts: RecvParts,
    flusher: Option<Flusher>,
    remote: Msg,
}

struct Pending {
    link: Link,
    stage: Stage,
    deadline: Instant,
}

impl Pending {
    /// Whether this connection sent a valid hello with this listener's nonce.
    fn proven(&self) -> bool {
        !matches!(self.stage, Stage::AwaitHello)
    }
}

/// Appends `new` to `q`, which holds at most `cap`. When full, the oldest item `evictable`
/// allows is taken out to make room; if none may go, `new` is refused. Returns the item that
/// did not stay, if any.
fn admit<T>(q: &mut VecDeque<T>, new: T, cap: usize, evictable: impl Fn(&T) -> bool) -> Option<T> {
    let mut out = None;
    if q.len() >= cap {
        match q.iter().position(evictable) {
            Some(i) => out = q.remove(i),
            None => return Some(new),
        }
    }
    q.push_back(new);
    out
}

/// What an `accept(2)` error means for the listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AcceptErr {
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

fn classify_accept(errno: Option<i32>) -> AcceptErr {
    match errno {
        Some(libc::EAGAIN) => AcceptErr::Empty,
        Some(
            libc::EINTR
            | libc::ECONNABORTED
            | libc::ECONNRESET
            | libc::EPROTO
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::EPERM
            | libc::ETIMEDOUT
            | libc::ENOSR
            | libc::ESOCKTNOSUPPORT
            | libc::EPROTONOSUPPORT,
        ) => AcceptErr::Transient,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptErr::Exhausted,
        _ => AcceptErr::Fatal,
    }
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

/// A failure of our own side while serving or connecting to the proven peer (queue pairs,
/// registration, a fatal device): it keeps its class (`ncclSystemError`), with `what` in front.
fn ours(what: String) -> impl FnOnce(Error) -> Error {
    move |e| e.context(what)
}

/// A failure the peer or the network caused (closed, garbled, late, wrong nonce): `Remote`.
fn theirs(what: &str, why: impl std::fmt::Display) -> Error {
    Error::Remote(format!("{what}: {why}"))
}

/// The addresses of interface `name`.
fn interface_ips(name: &str) -> Result<Vec<IpAddr>> {
    let addrs = crate::os::interface_addrs().map_err(|err| Error::Os {
        call: "getifaddrs",
        err,
        context: name.to_string(),
    })?;
    Ok(addrs.into_iter().filter(|(n, _)| n == name).map(|(_, ip)| ip).collect())
}

/// The address the listener binds: an address of the first interface `NCCL_SOCKET_IFNAME`
/// keeps (IPv4 first, then routable IPv6), else the IP in the device's GID (the address of the
/// interface that owns it), or, for a link-local GID, a routable address of that interface.
fn listen_ip(net: &Net, dev: usize) -> Result<IpAddr> {
    if let Some(filter) = &net.config.socket_ifname {
        let all = crate::os::interface_addrs().map_err(|err| Error::Os {
            call: "getifaddrs",
            err,
            context: "NCCL_SOCKET_IFNAME".into(),
        })?;
        let kept: Vec<IpAddr> =
            all.into_iter().filter(|(n, _)| filter.keeps(n)).map(|(_, ip)| ip).collect();
        let routable = |ip: &&IpAddr| !super::gid::is_link_local_ip(**ip);
        return kept
            .iter()
            .find(|ip| ip.is_ipv4())
            .or_else(|| kept.iter().find(routable))
            .copied()
            .ok_or_else(|| {
                Error::config(
                    "NCCL_SOCKET_IFNAME",
                    &filter.raw,
                    "no interface it keeps has an IPv4 or routable IPv6 address",
                )
            });
    }
    let g = gid_of(net, dev)?;
    if !super::gid::is_link_local_ip(g.ip()) {
        return Ok(g.ip());
    }
    // A link-local GID (e.g. NCCL_IB_GID_INDEX=0 on rxe): RoCE uses it, the setup socket does
    // not; it binds a routable address of the same interface.
    let netdev = g.netdev.clone().unwrap_or_default();
    super::gid::listen_ip_for(g.ip(), &interface_ips(&netdev)?).ok_or_else(|| {
        Error::NoDevice(format!(
            "{}: its GID {} is link-local and interface {netdev:?} has no routable address \
             for the connection-setup socket; set NCCL_SOCKET_IFNAME",
            net.devices[dev].name,
            g.ip()
        ))
    })
}

impl Listener {
    pub fn new(ctx: &CommContext, dev: i32) -> Result<Listener> {
        let net = ctx.net.clone();
        let d = net.device(dev)?;
        let dev = dev as usize;
        let ip = listen_ip(&net, dev)?;
        let what = format!("{ip} for {}", d.name);
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|err| Error::Os {
            call: "bind",
            err,
            context: what.clone(),
        })?;
        listener.set_nonblocking(true).map_err(|err| Error::Os {
            call: "fcntl",
            err,
            context: what.clone(),
        })?;
        let addr = listener.local_addr().map_err(|err| Error::Os {
            call: "getsockname",
            err,
            context: what,
        })?;
        let nonce = crate::os::random_u64().map_err(|err| Error::Os {
            call: "getrandom",
            err,
            context: "nonce".into(),
        })?;
        Ok(Listener {
            listener,
            handle: Handle { addr, nonce },
            net,
            dev,
            pending: VecDeque::new(),
            deadline: None,
            paused_until: None,
            rejects: RejectLog::default(),
            exhausted: RejectLog::default(),
        })
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    fn timeout(&self) -> Duration {
        self.net.config.setup_timeout
    }

    fn describe(&self) -> String {
        format!("listener {} (device {})", self.handle.addr, self.net.devices[self.dev].name)
    }

    /// Logs one turned-away connection, or counts it once [`REJECT_WARNS`] were logged.
    fn reject(&mut self, from: &dyn std::fmt::Display, why: &str, now: Instant) {
        if self.rejects.note(now) {
            let more = if self.rejects.last_logged() {
                " (further rejections are counted, not logged one by one)"
            } else {
                ""
            };
            log::warn!(
                "{}: rejected connection from {from}: {why}; still waiting for the peer{more}",
                self.describe()
            );
        }
    }

    /// The count of the rejections not logged one by one, when one is due.
    fn summarize(&mut self, now: Instant, force: bool) {
        if let Some((n, total)) = self.rejects.summary(now, force) {
            log::warn!(
                "{}: {n} more connection(s) rejected without a line each ({total} in total)",
                self.describe()
            );
        }
        if let Some((n, total)) = self.exhausted.summary(now, force) {
            log::warn!(
                "{}: accept ran out of fds or memory {n} more time(s) ({total} in total)",
                self.describe()
            );
        }
    }

    /// Takes the connections waiting in the kernel, at most [`MAX_PENDING`] per call, so a
    /// flood cannot keep the listener from serving those it has.
    fn take_new(&mut self, now: Instant) -> Result<()> {
        if self.paused_until.is_some_and(|t| now < t) {
            return Ok(());
        }
        self.paused_until = None;
        let hello_deadline = now + HELLO_TIMEOUT.min(self.timeout());
        for _ in 0..MAX_PENDING {
            let err = match self.listener.accept() {
                Ok((stream, peer)) => {
                    match Link::new(stream, peer) {
                        Ok(link) => {
                            let p = Pending {
                                link,
                                stage: Stage::AwaitHello,
                                deadline: hello_deadline,
                            };
                            if let Some(out) =
                                admit(&mut self.pending, p, MAX_PENDING, |p| !p.proven())
                            {
                                let why = format!(
                                    "{MAX_PENDING} connections pending; dropped the oldest that had not proven itself"
                                );
                                self.reject(&out.link.peer, &why, now);
                            }
                        }
                        Err(e) => self.reject(&peer, &format!("setsockopt: {e}"), now),
                    }
                    continue;
                }
                Err(e) => e,
            };
            match classify_accept(err.raw_os_error()) {
                AcceptErr::Empty => break,
                AcceptErr::Transient => {
                    self.reject(
                        &"(unknown)",
                        &format!("accept: {err}; that connection is lost"),
                        now,
                    );
                }
                AcceptErr::Exhausted => {
                    self.paused_until = Some(now + ACCEPT_BACKOFF);
                    if self.exhausted.note(now) {
                        log::warn!(
                            "{}: accept: {err}; not taking connections for {} ms (raise the \
                             open-files limit `ulimit -n` if this persists)",
                            self.describe(),
                            ACCEPT_BACKOFF.as_millis()
                        );
                    }
                    break;
                }
                AcceptErr::Fatal => {
                    return Err(Error::Os { call: "accept", err, context: self.describe() });
                }
            }
        }
        Ok(())
    }

    /// Advances every pending connection; `Some` once the rightful peer is connected.
    ///
    /// A connection that has not proven itself (valid hello, this listener's nonce) and fails
    /// is dropped alone. Only the proven peer's failure, or no proven peer by the deadline,
    /// makes `accept` fail.
    pub fn accept(&mut self) -> Result<Option<Box<RecvComm>>> {
        let now = Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.timeout());
        self.take_new(now)?;
        let mut i = 0;
        while i < self.pending.len() {
            match self.step(i, now) {
                Ok(Some(comm)) => {
                    // Anything else on this listener is not our peer; a next wait starts anew.
                    self.pending.clear();
                    self.deadline = None;
                    self.summarize(now, true);
                    return Ok(Some(comm));
                }
                Ok(None) => i += 1,
                Err(Stranger(why)) => {
                    if let Some(p) = self.pending.remove(i) {
                        self.reject(&p.link.peer, &why, now);
                    }
                }
                Err(Peer(e)) => {
                    self.pending.remove(i);
                    return Err(e);
                }
            }
        }
        self.summarize(now, false);
        if now > deadline && !self.pending.iter().any(Pending::proven) {
            return Err(Error::Remote(format!(
                "accept on {}: no peer connected within {} ms (step: wait for connection; \
                 FERROCE_SETUP_TIMEOUT_MS; {} other connection(s) rejected meanwhile)",
                self.handle.addr,
                self.timeout().as_millis(),
                self.rejects.total
            )));
        }
        Ok(None)
    }

    fn step(
        &mut self,
        i: usize,
        now: Instant,
    ) -> std::result::Result<Option<Box<RecvComm>>, StepErr> {
        let net = self.net.clone();
        let (dev, nonce, timeout) = (self.dev, self.handle.nonce, self.timeout());
        let p = &mut self.pending[i];
        let peer = p.link.peer;
        let what = format!("accept from {peer}");
        let fail = |step: &str, why: String| Peer(theirs(&format!("{what}: {step}"), why));
        loop {
            match &mut p.stage {
                Stage::AwaitHello => {
                    let Some(bytes) = p.link.recv().map_err(|b| Stranger(b.to_string()))? else {
                        if now > p.deadline {
                            return Err(Stranger(format!(
                                "no hello within {} ms",
                                HELLO_TIMEOUT.min(timeout).as_millis()
                            )));
                        }
                        return Ok(None);
                    };
                    let hello = Msg::decode(&bytes, Kind::Hello, nonce)
                        .map_err(|r| Stranger(r.to_string()))?;
                    // The peer proved itself: from here on, failures are errors, each of the
                    // class of whoever caused it.
                    let acc = accept_parts(&net, dev, &hello)
                        .map_err(ours(format!("{what}: create queue pairs")))
                        .map_err(Peer)?;
                    let policy = Policy::of(&hello);
                    let reply = endpoint(
                        &net,
                        dev,
                        Kind::Reply,
                        nonce,
                        &acc.parts.qps,
                        &policy,
                        &acc.parts.sizes,
                    )
                    .map_err(ours(format!("{what}: reply")))
                    .map_err(Peer)?;
                    p.link.queue(&reply);
                    p.stage = Stage::SendReply(Box::new(acc));
                    p.deadline = now + timeout;
                }
                Stage::SendReply(_) => {
                    if !p.link.flush().map_err(|e| fail("send reply", e.to_string()))? {
                        return if now > p.deadline {
                            Err(fail("send reply", "deadline passed".into()))
                        } else {
                            Ok(None)
                        };
                    }
                    let Stage::SendReply(acc) = std::mem::replace(&mut p.stage, Stage::AwaitHello)
                    else {
                        unreachable!()
                    };
                    p.stage = Stage::AwaitReady(acc);
                    p.deadline = now + timeout;
                }
                Stage::AwaitReady(_) => {
                    let got = p.link.recv().map_err(|b| fail("wait for ready", b.to_string()))?;
                    let Some(bytes) = got else {
                        if now > p.deadline {
                            return Err(fail(
                                "wait for ready",
                                format!("no answer within {} ms", timeout.as_millis()),
                            ));
                        }
                        return Ok(None);
                    };
                    Msg::decode(&bytes, Kind::Ready, nonce)
                        .map_err(|r| fail("wait for ready", r.to_string()))?;
                    let Stage::AwaitReady(acc) = std::mem::replace(&mut p.stage, Stage::AwaitHello)
                    else {
                        unreachable!()
                    };
                    let acc = *acc;
                    let remote_fifo = (acc.remote.buf_addr, acc.remote.buf_rkey);
                    let policy = Policy::of(&acc.remote);
                    let path = path(&net, dev, peer, &acc.remote, &policy, policy.fifo_tc);
                    log_connection("accepted from", &path, &policy);
                    return Ok(Some(RecvComm::new(
                        acc.parts,
                        acc.flusher,
                        net,
                        dev,
                        path,
                        policy.split,
                        remote_fifo,
                    )));
                }
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.summarize(Instant::now(), true);
    }
}

/// How one pending connection ended a step badly.
enum StepErr {
    /// Not (yet) our peer: drop the connection, keep listening.
    Stranger(String),
    /// Our peer failed: `accept` fails with this error.
    Peer(Error),
}
use StepErr::{Peer, Stranger};

fn accept_parts(net: &Arc<Net>, dev: usize, hello: &Msg) -> Result<Accepted> {
    let policy = Policy::of(hello);
    let parts = RecvParts::new(net, dev, policy.nqps)?;
    // The receiver's QPs carry the control (CTS) writes: they use the FIFO traffic class.
    connect_qps(net, dev, &parts.qps, hello, &policy, policy.fifo_tc)?;
    // Only devices that can write GPU memory need the flush QP (or FERROCE_FORCE_FLUSH=1).
    let flusher = if net.devices[dev].gdr.flush { Some(flusher(net, dev, &parts)?) } else { None };
    Ok(Accepted { parts, flusher, remote: *hello })
}

/// A queue pair connected to itself, for the RDMA-read flush.
fn flusher(net: &Arc<Net>, dev: usize, parts: &RecvParts) -> Result<Flusher> {
    let d = &net.devices[dev];
    let cq = parts.cq.clone();
    let qp = verbs::Qp::create_rc(
        &d.pd,
        &cq,
        verbs::QpCaps { max_send_wr: 64, max_recv_wr: 1, max_inline: 0 },
    )?;
    qp.to_init(d.port, verbs::ACCESS_LOCAL_WRITE | verbs::ACCESS_REMOTE_READ)?;
    let target = RegisteredBuf::new(&d.pd, 8, verbs::ACCESS_LOCAL_WRITE)?;
    let loopback =
        Policy { nqps: 1, sports: [0xc000; MAX_QPS], split: false, tc: 0, fifo_tc: 0, sl: 0 };
    let me = endpoint(net, dev, Kind::Hello, 0, std::slice::from_ref(&qp), &loopback, &target)?;
    connect_qps(net, dev, std::slice::from_ref(&qp), &me, &loopback, 0)?;
    Ok(Flusher { qp, target })
}

// ---------------------------------------------------------------------------------------------

enum CStage {
    Connecting,
    SendHello,
    AwaitReply,
    SendReady(Box<Msg>),
}

/// The connector's resumable state, kept between `connect` calls.
pub struct Connector {
    net: Arc<Net>,
    dev: usize,
    policy: Policy,
    handle: Handle,
    link: Link,
    stage: CStage,
    parts: Option<SendParts>,
    deadline: Instant,
}

impl Connector {
    /// Starts connecting to the listener behind `handle`. `comm_tc` is the traffic class of
    /// this communicator, if it has one.
    pub fn start(
        ctx: &CommContext,
        dev: i32,
        handle: Handle,
        comm_tc: Option<u8>,
    ) -> Result<Connector> {
        let net = ctx.net.clone();
        net.device(dev)?;
        let dev = dev as usize;
        let peer = handle.addr;
        let stream = crate::os::connect_nonblocking(peer).map_err(|err| Error::Os {
            call: "connect",
            err,
            context: peer.to_string(),
        })?;
        let link = Link::new(stream, peer).map_err(|err| Error::Os {
            call: "setsockopt",
            err,
            context: peer.to_string(),
        })?;
        let own = IpAddr::V6(gid_of(&net, dev)?.gid.into());
        let policy = Policy::local(&net, comm_tc, own, peer.ip());
        let parts = SendParts::new(&net, dev, policy.nqps)
            .map_err(ours(format!("connect to {peer}: create queue pairs")))?;
        let parts = Some(parts);
        let deadline = Instant::now() + net.config.setup_timeout;
        Ok(Connector { net, dev, policy, handle, link, stage: CStage::Connecting, parts, deadline })
    }

    /// The listener this connector is connecting to.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// A failure the peer or the network caused.
    fn fail(&self, step: &str, why: impl std::fmt::Display) -> Error {
        theirs(&format!("connect to {}: {step}", self.handle.addr), why)
    }

    /// A failure of our own side, keeping its class.
    fn local(&self, step: &str) -> impl FnOnce(Error) -> Error {
        ours(format!("connect to {}: {step}", self.handle.addr))
    }

    fn check_deadline(&self, step: &str) -> Result<()> {
        if Instant::now() > self.deadline {
            return Err(self.fail(
                step,
                format!(
                    "no progress within {} ms (FERROCE_SETUP_TIMEOUT_MS)",
                    self.net.config.setup_timeout.as_millis()
                ),
            ));
        }
        Ok(())
    }

    fn next(&mut self, stage: CStage) {
        self.stage = stage;
        self.deadline = Instant::now() + self.net.config.setup_timeout;
    }

    /// Advances; `Some` once connected.
    pub fn progress(&mut self) -> Result<Option<Box<SendComm>>> {
        loop {
            match &self.stage {
                CStage::Connecting => {
                    if !crate::os::connected(&self.link.stream)
                        .map_err(|e| self.fail("TCP connect", e))?
                    {
                        self.check_deadline("TCP connect")?;
                        return Ok(None);
                    }
                    let parts = self.parts.as_ref().expect("parts until connected");
                    let hello = endpoint(
                        &self.net,
                        self.dev,
                        Kind::Hello,
                        self.handle.nonce,
                        &parts.qps,
                        &self.policy,
                        &parts.fifo,
                    )
                    .map_err(self.local("hello"))?;
                    self.link.queue(&hello);
                    self.next(CStage::SendHello);
                }
                CStage::SendHello => {
                    if !self.link.flush().map_err(|e| self.fail("send hello", e))? {
                        self.check_deadline("send hello")?;
                        return Ok(None);
                    }
                    self.next(CStage::AwaitReply);
                }
                CStage::AwaitReply => {
                    let Some(bytes) =
                        self.link.recv().map_err(|b| self.fail("wait for reply", b))?
                    else {
                        self.check_deadline("wait for reply")?;
                        return Ok(None);
                    };
                    let reply = Msg::decode(&bytes, Kind::Reply, self.handle.nonce)
                        .map_err(|r| self.fail("wait for reply", r))?;
                    if usize::from(reply.nqps) != self.policy.nqps {
                        return Err(self.fail(
                            "wait for reply",
                            format!("peer has {} QPs, not {}", reply.nqps, self.policy.nqps),
                        ));
                    }
                    let parts = self.parts.as_ref().expect("parts until connected");
                    connect_qps(
                        &self.net,
                        self.dev,
                        &parts.qps,
                        &reply,
                        &self.policy,
                        self.policy.tc,
                    )
                    .map_err(self.local("connect queue pairs"))?;
                    let ready = Msg { kind: Kind::Ready, ..reply };
                    self.link.queue(&ready);
                    self.next(CStage::SendReady(Box::new(reply)));
                }
                CStage::SendReady(reply) => {
                    let reply = **reply;
                    if !self.link.flush().map_err(|e| self.fail("send ready", e))? {
                        self.check_deadline("send ready")?;
                        return Ok(None);
                    }
                    let parts = self.parts.take().expect("parts until connected");
                    let max_msg =
                        u64::from(self.net.devices[self.dev].max_msg_sz.min(reply.max_msg));
                    let p = &self.policy;
                    let path = path(&self.net, self.dev, self.handle.addr, &reply, p, p.tc);
                    log_connection("connected to", &path, p);
                    return Ok(Some(SendComm::new(
                        parts,
                        self.net.clone(),
                        self.dev,
                        path,
                        p.split,
                        (reply.buf_addr, reply.buf_rkey),
                        max_msg,
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admit_drops_the_oldest_evictable_when_full() {
        let mut q: VecDeque<u32> = VecDeque::new();
        for i in 0..4 {
            assert_eq!(admit(&mut q, i, 4, |_| true), None);
        }
        // Full: the oldest goes, arrival order stays.
        assert_eq!(admit(&mut q, 4, 4, |_| true), Some(0));
        assert_eq!(q, [1, 2, 3, 4]);
        // Odd numbers stand for proven connections: never pushed out.
        assert_eq!(admit(&mut q, 5, 4, |x| x % 2 == 0), Some(2));
        assert_eq!(q, [1, 3, 4, 5]);
        assert_eq!(admit(&mut q, 6, 4, |x| x % 2 == 0), Some(4));
        assert_eq!(q, [1, 3, 5, 6]);
        // Nothing may go but the newcomer's predecessor 6; then nothing: the newcomer is refused.
        assert_eq!(admit(&mut q, 7, 4, |x| x % 2 == 0), Some(6));
        assert_eq!(admit(&mut q, 8, 4, |x| x % 2 == 0), Some(8));
        assert_eq!(q, [1, 3, 5, 7]);
    }

    #[test]
    fn accept_errors_are_classified_as_accept_2_says() {
        for e in [
            libc::ECONNABORTED,
            libc::EPROTO,
            libc::ENETDOWN,
            libc::ENOPROTOOPT,
            libc::EHOSTDOWN,
            libc::ENONET,
            libc::EHOSTUNREACH,
            libc::EOPNOTSUPP,
            libc::ENETUNREACH,
            libc::EPERM,
            libc::EINTR,
            libc::ETIMEDOUT,
        ] {
            assert_eq!(classify_accept(Some(e)), AcceptErr::Transient, "errno {e}");
        }
        assert_eq!(classify_accept(Some(libc::EAGAIN)), AcceptErr::Empty);
        assert_eq!(classify_accept(Some(libc::EWOULDBLOCK)), AcceptErr::Empty);
        for e in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert_eq!(classify_accept(Some(e)), AcceptErr::Exhausted, "errno {e}");
        }
        for e in [Some(libc::EBADF), Some(libc::EINVAL), Some(libc::ENOTSOCK), None] {
            assert_eq!(classify_accept(e), AcceptErr::Fatal, "errno {e:?}");
        }
    }

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
            libc::ENOMEM,
            "mlx5_0",
        ));
        assert!(matches!(e, Error::Verbs { verb: "ibv_create_qp", errno: libc::ENOMEM, .. }));
        assert!(e.to_string().contains("accept from 10.0.0.2:5: create queue pairs"), "{e}");
        let dead = ours("connect to 10.0.0.1:7: hello".into())(Error::Local("device dead".into()));
        assert!(matches!(dead, Error::Local(ref t) if t.contains("connect to 10.0.0.1:7")));
        // What the peer did.
        let r = theirs("accept from 10.0.0.2:5: wait for ready", Reject::Nonce);
        assert!(matches!(r, Error::Remote(ref t) if t.contains("nonce")), "{r}");
        let closed = theirs("connect to 10.0.0.1:7: wait for reply", Bad::Closed(10));
        assert!(matches!(closed, Error::Remote(ref t) if t.contains("truncated")), "{closed}");
    }
}
