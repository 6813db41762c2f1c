//! Connection setup: `listen`, and the resumable `connect` and `accept`. This is the shell
//! around `ferroce_core::setup`, which holds the logic; here are the TCP sockets (non-blocking, through
//! `crate::os`), the clock and the verbs objects (queue pairs, their transitions, the flush QP).
//! A call feeds the machine what the sockets and verbs did and does what it answers, until it
//! says to wait (`Ok(None)`), or the connection is done or failed. `accept` reads the clock
//! once per call (every pending connection is judged at the same instant), `connect` at each
//! step (a QP transition can take milliseconds).
//!
//! Called by `ffi` (listen, accept, closeListen) and by `connects` (connect), which parks a
//! connector between calls under an id in the handle's state bytes. Nothing here decides anything the machine could: a
//! shell that only moves bytes and runs verbs is what the VM tests exercise, and the machine
//! is what `ferroce_core::setup`'s tests check.
//!
//! Every step has a deadline (`FERROCE_SETUP_TIMEOUT_MS`); a passed deadline is an error
//! naming the peer and the step.
//!
//! The listener serves any connection until it proves itself with a hello carrying this
//! listener's nonce. Each `accept` call first reads the hellos already waiting, then takes new
//! connections. It holds at most [`MAX_PENDING`] unproven ones, the process at most
//! [`MAX_UNPROVEN`] over all listeners; a newcomer beyond either is read once and refused
//! unless its hello was in, and nobody is pushed out for it. Each gets [`HELLO_TIMEOUT`] to
//! send its hello, and one that fails (wrong magic, version, length or nonce, more QPs than
//! `NCCL_IB_QPS_PER_CONNECTION`, a truncated message, silence) is dropped alone, with a WARN
//! for the first [`REJECT_WARNS`] and a count for the rest. Nothing a stranger does moves the
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

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use once_cell::sync::Lazy;
use std::time::{Duration, Instant};

use super::data::{
    FLUSH_QUEUE, Flusher, Path, Peer, RecvComm, RecvParts, SendComm, SendParts, port_of,
};
use super::device;
use super::ecmp;
use super::gid::{self, GidChoice};
use super::net::{CommContext, Net};
use super::profile::Profiler;
use crate::error::{Error, Result};
use crate::verbs::{self, RegisteredBuf, RtrAttr, RtsAttr};
use ferroce_core::data::MAX_MEMBERS;
use ferroce_core::setup::wire::{End, Handle, MAX_QPS, MSG_LEN, Msg};
pub use ferroce_core::setup::{
    ACCEPT_BACKOFF, GRACE, HELLO_TIMEOUT, MAX_GRACE, MAX_PENDING, MAX_UNPROVEN,
    REJECT_SUMMARY_EVERY, REJECT_WARNS,
};
use ferroce_core::setup::{
    AcceptErr, Cmd, ConnId, Dial, Input, Listen, Local, Policy, QpPlan, Unproven, first_psn, ours,
};

/// The connections to this process's listeners that have not proven themselves.
static UNPROVEN: Lazy<Arc<Unproven>> = Lazy::new(|| Arc::new(Unproven::new(MAX_UNPROVEN)));

/// Makes an accepted or connecting socket fit for the handshake: non-blocking, and no Nagle
/// delay on its small messages.
fn prepare(stream: &TcpStream) -> io::Result<()> {
    stream.set_nonblocking(true)?;
    stream.set_nodelay(true)
}

/// Writes what it can of `bytes`, for the machine.
fn write(stream: &mut TcpStream, bytes: &[u8]) -> Input<'static> {
    loop {
        return match stream.write(bytes) {
            Ok(0) => Input::Failed(io::Error::from(io::ErrorKind::WriteZero).to_string()),
            Ok(n) => Input::Sent(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Input::Blocked,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Input::Failed(e.to_string()),
        };
    }
}

/// Reads what it can into `buf` (as much as the machine asked for), for the machine.
fn read<'b>(stream: &mut TcpStream, buf: &'b mut [u8]) -> Input<'b> {
    loop {
        return match stream.read(buf) {
            Ok(0) => Input::Closed,
            Ok(n) => Input::Received(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Input::Blocked,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Input::Failed(e.to_string()),
        };
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

/// The connector's choice: `NCCL_IB_TC` if set, else the communicator's traffic class, else 0
/// (NCCL's precedence), and the same for `NCCL_IB_SL` (the communicator's traffic class in the
/// SL field's 4 bits, as a NIC takes NCCL's value); source ports from `ecmp`, for a connection
/// from the address `own` to `peer`.
fn local_policy(net: &Net, comm_tc: Option<u8>, own: IpAddr, peer: IpAddr, ports: usize) -> Policy {
    let c = &net.config;
    // NCCL_IB_QPS_PER_CONNECTION per member port of the end with more of them, as NCCL does.
    let nqps = (c.qps_per_conn * ports).min(MAX_QPS);
    let sport_list = if c.sport_spread {
        PORT_BLOCKS.take(c.sport_base, c.sport_range, nqps, own, peer)
    } else {
        ecmp::source_ports(c.sport_base, c.sport_range, nqps)
    };
    let mut sports = [0; MAX_QPS];
    sports[..nqps].copy_from_slice(&sport_list);
    let tc = c.tc.or(comm_tc).unwrap_or(0);
    let sl = c.sl.or(comm_tc.map(|t| t & 0xf)).unwrap_or(0);
    // A fused end splits every message across its lanes, so that one message uses every port,
    // as NCCL's IB transport does for a fused device whatever NCCL_IB_SPLIT_DATA_ON_QPS says.
    let split = c.split_data || ports > 1;
    Policy { nqps, sports, split, tc, sl }
}

/// This side's endpoint: its queue pairs, each member port's GID, MTU and port, and the
/// buffer the peer writes into (with its key on each member port).
fn endpoint(net: &Net, devs: &[usize], qps: &[verbs::Qp], buf: &RegisteredBuf) -> Result<Local> {
    let mut qpns = [0; MAX_QPS];
    for (slot, qp) in qpns.iter_mut().zip(qps) {
        *slot = qp.qpn();
    }
    let rkeys = buf.rkeys();
    let mut ends = [End::default(); MAX_MEMBERS];
    for (m, &dev) in devs.iter().enumerate() {
        let d = &net.devices[dev];
        let gid = gid_of(net, dev)?.gid;
        ends[m] = End { gid, mtu: d.active_mtu as u8, port: d.port, rkey: rkeys[m] };
    }
    let max_msg = devs.iter().map(|&d| net.devices[d].max_msg_sz).min().unwrap_or(0);
    Ok(Local {
        qpns,
        gid: ends[0].gid,
        mtu: ends[0].mtu,
        port: ends[0].port,
        buf_addr: buf.addr(0),
        buf_rkey: ends[0].rkey,
        max_msg,
        members: devs.len() as u8,
        more: std::array::from_fn(|i| ends[i + 1]),
    })
}

/// RTR then RTS of each QP along the plan: lane `i` from member port `i % ours` to the
/// peer's `i % theirs`, towards its remote QP, with its flow label (so its UDP source port),
/// the plan's traffic class and service level. The path MTU is the smaller of the two ports'
/// active MTUs. The attributes each QP got, for lane repair.
fn connect_qps(
    net: &Net,
    devs: &[usize],
    qps: &[verbs::Qp],
    plan: &QpPlan,
) -> Result<Vec<(RtrAttr, RtsAttr)>> {
    let gids = devs.iter().map(|&dev| gid_of(net, dev)).collect::<Result<Vec<_>>>()?;
    let c = &net.config;
    let mut links = Vec::with_capacity(qps.len());
    for (i, qp) in qps.iter().enumerate() {
        let m = port_of(i, devs.len());
        let (d, gid) = (&net.devices[devs[m]], &gids[m]);
        let remote = plan.remote_ends[port_of(i, plan.remote_members)];
        let rtr = RtrAttr {
            port: d.port,
            path_mtu: d.active_mtu.min(u32::from(remote.mtu)),
            dest_qpn: plan.remote_qpns[i],
            dgid: remote.gid,
            sgid_index: gid.index,
            flow_label: ecmp::label_of_port(plan.sports[i]),
            traffic_class: plan.traffic_class,
            sl: plan.sl,
            rq_psn: first_psn(plan.psn_seed, plan.remote_qpns[i]),
        };
        let rts = RtsAttr {
            timeout: c.ib_timeout,
            retry_cnt: c.ib_retry_cnt,
            rnr_retry: c.rnr_retry,
            sq_psn: first_psn(plan.psn_seed, qp.qpn()),
        };
        qp.to_rtr(&rtr)?;
        qp.to_rts(&rts)?;
        links.push((rtr, rts));
    }
    Ok(links)
}

/// What to show when this connection fails, and its INFO line; `peer` names the peer. Each
/// member port's GID pair (lane `q` runs on the `q % n`-th).
fn path(net: &Net, devs: &[usize], peer: String, remote: &Msg, p: &Policy, tc: u8) -> Path {
    let c = &net.config;
    let theirs = remote.ends();
    let n = devs.len().max(theirs.len());
    let pair = |m: usize| {
        let (dev, end) = (devs[m % devs.len()], theirs[m % theirs.len()]);
        let d = &net.devices[dev];
        let local =
            gid_of(net, dev).map(|g| format!("{} (index {})", g.ip(), g.index)).unwrap_or_default();
        let mtu = device::mtu_bytes(d.active_mtu.min(u32::from(end.mtu)));
        format!("{} GID {local} -> {}, path MTU {mtu}", d.name, gid::ip_of(&end.gid))
    };
    let pairs: Vec<String> = (0..n).map(pair).collect();
    let describe = format!(
        "{}, tc {tc}, sl {}, NCCL_IB_TIMEOUT {} / NCCL_IB_RETRY_CNT {} (retries end after {:.3} s)",
        pairs.join("; "),
        p.sl,
        c.ib_timeout,
        c.ib_retry_cnt,
        c.retry_bound().as_secs_f64()
    );
    let ports = (0..p.nqps).map(|q| {
        let d = &net.devices[devs[port_of(q, devs.len())]];
        format!("{} port {}", d.name, d.port)
    });
    Path { peer, describe, sports: p.sports[..p.nqps].to_vec(), ports: ports.collect() }
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

/// A bound listener: what `listen` returns.
pub struct Listener {
    listener: TcpListener,
    handle: Handle,
    net: Arc<Net>,
    /// The member ports of its NCCL device (one, or a fused device's).
    devs: Vec<usize>,
    core: Listen,
    /// The sockets of the machine's pending connections, and what was built for a proven one.
    conns: HashMap<ConnId, Conn>,
    /// Where the accepted comm's profiler events go (the communicator's).
    profiler: Option<Arc<dyn Profiler>>,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    accepted: Option<Accepted>,
}

/// The verbs side of a proven peer's connection.
struct Accepted {
    parts: RecvParts,
    flushers: Vec<Flusher>,
    links: Vec<(RtrAttr, RtsAttr)>,
}

impl Listener {
    pub fn new(ctx: &CommContext, dev: i32) -> Result<Listener> {
        let net = ctx.net.clone();
        let devs = net.members(dev)?;
        let d = &net.devices[devs[0]];
        let ip = listen_ip(&net, devs[0])?;
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
        let handle = Handle { addr, nonce, members: devs.len() as u8 };
        let names: Vec<&str> = devs.iter().map(|&m| net.devices[m].name.as_str()).collect();
        let describe = format!("listener {addr} (device {})", names.join("+"));
        let c = &net.config;
        let max_qps = c.qps_per_conn;
        let terms = (max_qps, c.fifo_tc);
        let core = Listen::new(handle, describe, c.setup_timeout, terms, UNPROVEN.clone());
        let profiler = ctx.profiler();
        let conns = HashMap::new();
        Ok(Listener { listener, handle, net, devs, core, conns, profiler })
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Advances every pending connection; `Some` once the rightful peer is connected.
    ///
    /// A connection that has not proven itself (valid hello, this listener's nonce) and fails
    /// is dropped alone. Only the proven peer's failure, or no proven peer by the deadline,
    /// makes `accept` fail.
    pub fn accept(&mut self) -> Result<Option<Box<RecvComm>>> {
        let now = Instant::now();
        let r = self.accept_at(now);
        self.log_warnings();
        r
    }

    fn log_warnings(&mut self) {
        for line in self.core.take_warnings() {
            log::warn!("{line}");
        }
    }

    fn accept_at(&mut self, now: Instant) -> Result<Option<Box<RecvComm>>> {
        let take = self.core.begin(now);
        // The hellos already waiting first: nothing taken in now can get ahead of them.
        if let Some(comm) = self.serve_all(self.core.ids(), now)? {
            return Ok(Some(comm));
        }
        if take {
            let new = self.take_new(now)?;
            if let Some(comm) = self.serve_all(new, now)? {
                return Ok(Some(comm));
            }
        }
        self.core.end(now)?;
        Ok(None)
    }

    fn serve_all(&mut self, ids: Vec<ConnId>, now: Instant) -> Result<Option<Box<RecvComm>>> {
        for id in ids {
            if let Some(comm) = self.serve(id, now)? {
                return Ok(Some(comm));
            }
        }
        Ok(None)
    }

    /// Takes the connections waiting in the kernel, at most [`MAX_PENDING`] per call, so a
    /// flood cannot keep the listener from serving those it has; their ids, to be served in
    /// this call (one beyond a cap is refused at its first wait).
    fn take_new(&mut self, now: Instant) -> Result<Vec<ConnId>> {
        let mut ids = Vec::new();
        for _ in 0..MAX_PENDING {
            match self.listener.accept() {
                Ok((stream, peer)) => match prepare(&stream) {
                    Ok(()) => {
                        let id = self.core.admit(peer, now);
                        self.conns.insert(id, Conn { stream, peer, accepted: None });
                        ids.push(id);
                    }
                    Err(e) => self.core.refuse(&peer, &format!("setsockopt: {e}"), now),
                },
                Err(err) => {
                    match self.core.accept_failed(classify_accept(err.raw_os_error()), &err, now) {
                        AcceptErr::Empty | AcceptErr::Exhausted => break,
                        AcceptErr::Transient => {}
                        AcceptErr::Fatal => {
                            let context = self.core.describe().to_string();
                            return Err(Error::Os { call: "accept", err, context });
                        }
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Advances connection `id` as far as it goes without blocking.
    fn serve(&mut self, id: ConnId, now: Instant) -> Result<Option<Box<RecvComm>>> {
        let mut buf = [0u8; MSG_LEN];
        let mut input = Input::Poll;
        loop {
            // In the order the machine wrote them, before anything this step logs itself.
            self.log_warnings();
            let conn = self.conns.get_mut(&id).expect("a socket for every pending connection");
            input = match self.core.advance(id, now, input) {
                Cmd::Recv(n) => read(&mut conn.stream, &mut buf[..n]),
                Cmd::Send(bytes) => write(&mut conn.stream, bytes),
                Cmd::ConnectQps(plan) => match accept_parts(&self.net, &self.devs, &plan) {
                    Ok(acc) => {
                        conn.accepted = Some(acc);
                        Input::QpsReady
                    }
                    Err(e) => Input::Local(e),
                },
                Cmd::Endpoint => {
                    let parts = &conn.accepted.as_ref().expect("queue pairs first").parts;
                    match endpoint(&self.net, &self.devs, &parts.q.qps, &parts.sizes) {
                        Ok(local) => Input::Endpoint(Box::new(local)),
                        Err(e) => Input::Local(e),
                    }
                }
                Cmd::Wait => return Ok(None),
                Cmd::Close => {
                    self.conns.remove(&id);
                    return Ok(None);
                }
                Cmd::Fail(e) => {
                    self.conns.remove(&id);
                    return Err(e);
                }
                Cmd::Done(hello) => return Ok(Some(self.finish(id, &hello))),
                Cmd::AwaitConnect => {
                    return Err(Error::Internal("accept: the machine asked for a connect".into()));
                }
            };
        }
    }

    /// The peer of connection `id` connected with `hello`: every other connection goes.
    fn finish(&mut self, id: ConnId, hello: &Msg) -> Box<RecvComm> {
        let conn = self.conns.remove(&id).expect("a socket for every pending connection");
        self.conns.clear();
        let acc = conn.accepted.expect("queue pairs before done");
        let fifo = Peer { addr: hello.buf_addr, rkeys: rkeys(hello), max_msg: 0 };
        let policy = Policy::of(hello);
        // The peer's RoCE address: the TCP one is our own when both ends share a host.
        let peer = format!("{} (tcp {})", gid::ip_of(&hello.gid), conn.peer);
        let tc = policy.receiver_tc(self.net.config.fifo_tc);
        let path = path(&self.net, &self.devs, peer, hello, &policy, tc);
        log_connection("accepted from", &path, &policy);
        let theirs = usize::from(hello.members);
        RecvComm::new(
            acc.parts,
            acc.flushers,
            &acc.links,
            self.net.clone(),
            path,
            (theirs, fifo),
            self.profiler.clone(),
        )
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.core.close(Instant::now());
        self.log_warnings();
    }
}

/// The keys of the peer's buffer on each of its member ports.
fn rkeys(m: &Msg) -> Vec<u32> {
    m.ends().iter().map(|e| e.rkey).collect()
}

/// The proven peer's queue pairs, at RTS along `plan`, and the flush QPs where needed.
fn accept_parts(net: &Arc<Net>, devs: &[usize], plan: &QpPlan) -> Result<Accepted> {
    let parts = RecvParts::new(net, devs, (plan.nqps, plan.split))?;
    let links = connect_qps(net, devs, &parts.q.qps, plan)?;
    let flushers = if super::data::needs_flush(net, devs) {
        (0..devs.len()).map(|m| flusher(net, devs[m], &parts.q.cqs[m])).collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    Ok(Accepted { parts, flushers, links })
}

/// A queue pair on port `dev` connected to itself, for the RDMA-read flush.
fn flusher(net: &Arc<Net>, dev: usize, cq: &Arc<verbs::Cq>) -> Result<Flusher> {
    let d = &net.devices[dev];
    let qp = verbs::Qp::create_rc(
        &d.pd,
        cq,
        verbs::QpCaps { max_send_wr: FLUSH_QUEUE as u32, max_recv_wr: 1, max_inline: 0 },
    )?;
    qp.to_init(d.port, Flusher::ACCESS)?;
    let target = RegisteredBuf::new(&d.pd, 8, super::data::FLUSH_TARGET)?;
    let me = endpoint(net, &[dev], std::slice::from_ref(&qp), &target)?;
    let mut remote_ends = [End::default(); MAX_MEMBERS];
    remote_ends[0] = End { gid: me.gid, mtu: me.mtu, port: me.port, rkey: me.buf_rkey };
    let loopback = QpPlan {
        nqps: 1,
        split: false,
        remote_qpns: me.qpns,
        sports: [0xc000; MAX_QPS],
        remote_members: 1,
        remote_ends,
        traffic_class: 0,
        sl: 0,
        psn_seed: crate::os::random_u64().map_err(|err| Error::Os {
            call: "getrandom",
            err,
            context: "the flush QP's PSN seed".into(),
        })?,
    };
    connect_qps(net, &[dev], std::slice::from_ref(&qp), &loopback)?;
    Ok(Flusher { qp, target })
}

// ---------------------------------------------------------------------------------------------

/// The connector's resumable state, kept between `connect` calls.
pub struct Connector {
    net: Arc<Net>,
    /// The member ports of its NCCL device (one, or a fused device's).
    devs: Vec<usize>,
    policy: Policy,
    handle: Handle,
    stream: TcpStream,
    core: Dial,
    parts: Option<SendParts>,
    /// What each QP was connected with, once it is (for lane repair).
    links: Vec<(RtrAttr, RtsAttr)>,
    /// Where the comm's profiler events go (the communicator's).
    profiler: Option<Arc<dyn Profiler>>,
    /// Whether a call already waited for the TCP connection ([`CONNECT_WAIT`]).
    waited: bool,
}

/// How long the first `connect` call waits for its TCP connection, so that its hello goes out
/// in the same call: the listener then finds it at its first read of the connection, and
/// strangers that filled its places before cannot keep the rightful peer out. Later calls
/// do not wait.
const CONNECT_WAIT: Duration = Duration::from_millis(20);

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
        let devs = net.members(dev)?;
        let peer = handle.addr;
        let stream = crate::os::connect_nonblocking(peer).map_err(|err| Error::Os {
            call: "connect",
            err,
            context: peer.to_string(),
        })?;
        prepare(&stream).map_err(|err| Error::Os {
            call: "setsockopt",
            err,
            context: peer.to_string(),
        })?;
        let own = IpAddr::V6(gid_of(&net, devs[0])?.gid.into());
        let ports = devs.len().max(usize::from(handle.members));
        let policy = local_policy(&net, comm_tc, own, peer.ip(), ports);
        let parts = SendParts::new(&net, &devs, policy.nqps)
            .map_err(ours(format!("connect to {peer}: create queue pairs")))?;
        let parts = Some(parts);
        let core = Dial::new(handle, policy, net.config.setup_timeout, Instant::now());
        let profiler = ctx.profiler();
        let links = Vec::new();
        let waited = false;
        Ok(Connector { net, devs, policy, handle, stream, core, parts, links, profiler, waited })
    }

    /// The listener this connector is connecting to.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Advances; `Some` once connected.
    pub fn progress(&mut self) -> Result<Option<Box<SendComm>>> {
        let mut buf = [0u8; MSG_LEN];
        let mut input = Input::Poll;
        loop {
            let parts = &self.parts;
            let parts = || parts.as_ref().expect("parts until connected");
            input = match self.core.advance(Instant::now(), input) {
                Cmd::AwaitConnect => {
                    let wait = if self.waited { Duration::ZERO } else { CONNECT_WAIT };
                    self.waited = true;
                    match crate::os::connected(&self.stream, wait) {
                        Ok(true) => Input::Connected,
                        Ok(false) => Input::Blocked,
                        Err(e) => Input::Failed(e.to_string()),
                    }
                }
                Cmd::Endpoint => {
                    match endpoint(&self.net, &self.devs, &parts().q.qps, &parts().fifo) {
                        Ok(local) => Input::Endpoint(Box::new(local)),
                        Err(e) => Input::Local(e),
                    }
                }
                Cmd::Send(bytes) => write(&mut self.stream, bytes),
                Cmd::Recv(n) => read(&mut self.stream, &mut buf[..n]),
                Cmd::ConnectQps(plan) => {
                    match connect_qps(&self.net, &self.devs, &parts().q.qps, &plan) {
                        Ok(links) => {
                            self.links = links;
                            Input::QpsReady
                        }
                        Err(e) => Input::Local(e),
                    }
                }
                Cmd::Wait => return Ok(None),
                Cmd::Done(reply) => return Ok(Some(self.finish(&reply))),
                Cmd::Fail(e) => return Err(e),
                Cmd::Close => {
                    return Err(Error::Internal("connect: the machine closed a stranger".into()));
                }
            };
        }
    }

    fn finish(&mut self, reply: &Msg) -> Box<SendComm> {
        let parts = self.parts.take().expect("parts until connected");
        let ours = self.devs.iter().map(|&d| self.net.devices[d].max_msg_sz).min().unwrap_or(0);
        let max_msg = u64::from(ours.min(reply.max_msg));
        let sizes = Peer { addr: reply.buf_addr, rkeys: rkeys(reply), max_msg };
        let p = &self.policy;
        let peer = format!("{} (tcp {})", gid::ip_of(&reply.gid), self.handle.addr);
        let path = path(&self.net, &self.devs, peer, reply, p, p.tc);
        log_connection("connected to", &path, p);
        let theirs = usize::from(reply.members);
        SendComm::new(
            parts,
            &self.links,
            self.net.clone(),
            path,
            p.split,
            (theirs, sizes),
            self.profiler.clone(),
        )
    }
}

/// What an `accept(2)` error means for the listener, from its errno (the core knows no errno).
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
