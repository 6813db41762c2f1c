//! Connection setup: `listen`, and the resumable `connect` and `accept` state machines.
//!
//! Both machines advance as far as they can without blocking and return `Ok(None)` to be called
//! again. Every step has a deadline (`FERROCE_SETUP_TIMEOUT_MS`); a passed deadline is an error
//! naming the peer and the step.
//!
//! The listener rejects connections that are not the rightful peer (wrong magic, version,
//! length or nonce, a truncated message, or silence until the deadline) with one WARN each and
//! keeps serving; only a peer that proved itself and then fails makes `accept` fail.
//!
//! Exchange: connector → `Hello` (its QP, GID, MTU, FIFO); acceptor → `Reply` (its QP, GID,
//! MTU, size records), after moving its QP to RTS; connector → `Ready`, after moving its QP to
//! RTS. So no CTS is ever written before the sender's QP can take it.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

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
    /// else 0 (NCCL's precedence); source ports from `ecmp`.
    fn local(net: &Net, comm_tc: Option<u8>, spread_key: u64) -> Policy {
        let c = &net.config;
        let nqps = c.qps_per_conn;
        let ports = ecmp::source_ports(
            c.sport_base,
            c.sport_range,
            nqps,
            c.sport_spread.then_some(spread_key),
        );
        let mut sports = [0; MAX_QPS];
        sports[..nqps].copy_from_slice(&ports);
        let tc = c.tc.or(comm_tc).unwrap_or(0);
        Policy { nqps, sports, split: c.split_data, tc, fifo_tc: c.fifo_tc.unwrap_or(tc), sl: c.sl }
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

/// A bound listener: what `listen` returns.
pub struct Listener {
    listener: TcpListener,
    handle: Handle,
    net: Arc<Net>,
    dev: usize,
    pending: Vec<Pending>,
    /// Deadline for some peer to prove itself; extended while bad connections keep the
    /// listener busy.
    deadline: Option<Instant>,
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
            pending: Vec::new(),
            deadline: None,
        })
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    fn timeout(&self) -> std::time::Duration {
        self.net.config.setup_timeout
    }

    /// Advances every pending connection; `Some` once the rightful peer is connected.
    pub fn accept(&mut self) -> Result<Option<Box<RecvComm>>> {
        let now = Instant::now();
        self.deadline.get_or_insert(now + self.timeout());
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    let link = Link::new(stream, peer).map_err(|err| Error::Os {
                        call: "setsockopt",
                        err,
                        context: peer.to_string(),
                    })?;
                    self.pending.push(Pending {
                        link,
                        stage: Stage::AwaitHello,
                        deadline: now + self.timeout(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    return Err(Error::Os {
                        call: "accept",
                        err,
                        context: self.handle.addr.to_string(),
                    });
                }
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            match self.step(i, now) {
                Ok(Some(comm)) => {
                    self.pending.clear(); // anything else on this listener is not our peer
                    return Ok(Some(comm));
                }
                Ok(None) => i += 1,
                Err(Drop(why)) => {
                    let p = self.pending.swap_remove(i);
                    log::warn!(
                        "listener {} (device {}): rejected connection from {}: {why}; still waiting for the peer",
                        self.handle.addr,
                        self.net.devices[self.dev].name,
                        p.link.peer
                    );
                    self.deadline = Some(now + self.timeout());
                }
                Err(Fail(e)) => return Err(e),
            }
        }
        if self.pending.is_empty() && self.deadline.is_some_and(|d| now > d) {
            return Err(Error::Remote(format!(
                "accept on {}: no peer connected within {} ms (step: wait for connection; \
                 FERROCE_SETUP_TIMEOUT_MS)",
                self.handle.addr,
                self.timeout().as_millis()
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
        let fail = |step: &str, why: String| {
            Fail(Error::Remote(format!("accept from {peer}: {step}: {why}")))
        };
        loop {
            match &mut p.stage {
                Stage::AwaitHello => {
                    let Some(bytes) = p.link.recv().map_err(|b| Drop(b.to_string()))? else {
                        if now > p.deadline {
                            return Err(Drop(format!(
                                "no hello within {} ms",
                                timeout.as_millis()
                            )));
                        }
                        return Ok(None);
                    };
                    let hello =
                        Msg::decode(&bytes, Kind::Hello, nonce).map_err(|r| Drop(r.to_string()))?;
                    // The peer proved itself: from here on, failures are errors.
                    let acc = accept_parts(&net, dev, &hello)
                        .map_err(|e| fail("create queue pair", e.to_string()))?;
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
                    .map_err(|e| fail("reply", e.to_string()))?;
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

/// How one pending connection ended a step badly.
enum StepErr {
    /// Not our peer: drop the connection, keep listening.
    Drop(String),
    /// Our peer failed: `accept` fails.
    Fail(Error),
}
use StepErr::{Drop, Fail};

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
        let policy = Policy::local(&net, comm_tc, handle.nonce);
        let parts = Some(SendParts::new(&net, dev, policy.nqps)?);
        let deadline = Instant::now() + net.config.setup_timeout;
        Ok(Connector { net, dev, policy, handle, link, stage: CStage::Connecting, parts, deadline })
    }

    fn fail(&self, step: &str, why: impl std::fmt::Display) -> Error {
        Error::Remote(format!("connect to {}: {step}: {why}", self.handle.addr))
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
                    )?;
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
                    )?;
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
