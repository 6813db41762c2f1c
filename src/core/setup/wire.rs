//! The connection-setup wire format: the 128-byte handle NCCL carries from `listen` to the
//! peer's `connect`, and the fixed-size messages the two sides exchange over TCP.
//!
//! Pure encode/decode, little-endian, versioned. Everything a peer sends is validated (magic,
//! version, kind, length, and the listener's random nonce, which ties a connection to one
//! `listen`), so a stray or hostile connection is rejected with a reason, never trusted.
//!
//! Exchange: connector → `Hello`; acceptor → `Reply`; connector → `Ready`. Each carries the
//! sender's endpoint (QP number, GID, MTU, port) and, where relevant, the address and rkey of
//! the buffer the peer writes into (the sender's FIFO in `Hello`, the receiver's size records
//! in `Reply`).

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};

use crate::data::{FIFO_AREA, MAX_MEMBERS, SIZE_AREA};

pub const MAGIC: u64 = 0x3145_434f_5252_4546; // "FERROCE1", little-endian
/// The protocol version both ends must share: 2 since the CTS FIFO's dense layout (32-byte
/// entries, the head entry of every slot in one array), which a version-1 peer would misread;
/// 3 since lane repair (a mailbox word after the FIFO and after the size records, and work
/// requests tagged with their lane's life), which a version-2 peer would never answer; 4 since
/// a repaired lane gets new queue pairs (two-word mailboxes that carry their numbers); 5 since
/// CTS entries carry a key per member port (64-byte entries), for comms over fused devices; 6
/// since lane failover fences before it re-sends (fence requests and receipts after the FIFO,
/// an ack after every optional row), which a version-5 peer would never answer; 7 since a
/// fused device spans up to 8 ports (longer messages, 8 keys in a CTS entry); 8 since a whole
/// message's immediate carries sizes below 32 MiB, which a version-7 peer would misread; 9
/// since an optional row is a whole message (a write with immediate, no ack word: the
/// receipts and the size area's mailbox one word lower), which a version-8 peer would misread.
pub const VERSION: u32 = 9;
pub const HANDLE_SIZE: usize = 128;
/// Bytes 96..128 of the handle are never sent: the connector keeps its resumable state there.
pub const HANDLE_STATE_OFFSET: usize = 96;
/// The most queue pairs one connection may use (`NCCL_IB_QPS_PER_CONNECTION`).
pub const MAX_QPS: usize = 128;
/// 96 bytes of fields, then the QP numbers (u32) and UDP source ports (u16) of up to 128 QPs,
/// then the ends of member ports 1 to 7.
pub const MSG_LEN: usize = MORE_AT + (MAX_MEMBERS - 1) * END_LEN;
/// Where the other member ports' ends start (after the QP numbers and source ports), and the
/// bytes of each.
const MORE_AT: usize = 96 + MAX_QPS * 6;
const END_LEN: usize = 24;
const HEADER_LEN: usize = 32;

/// What `listen` publishes. An IPv6 address keeps its scope id (the interface index of a
/// link-local address, bytes 40..44), as NCCL's own socket address does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    pub addr: SocketAddr,
    pub nonce: u64,
    /// How many member ports the listener's device spans (1, or a fused device's count): the
    /// connector opens lanes for the larger of both ends' counts.
    pub members: u8,
}

/// Why bytes from a peer were rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reject {
    Magic(u64),
    Version(u32),
    Kind(u32),
    Length(u32),
    Nonce,
    Field(&'static str),
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::Magic(m) => write!(f, "bad magic {m:#018x} (not a ferroce peer)"),
            Reject::Version(v) => write!(f, "protocol version {v}, expected {VERSION}"),
            Reject::Kind(k) => write!(f, "unexpected message kind {k}"),
            Reject::Length(l) => write!(f, "message length {l}, expected {MSG_LEN}"),
            Reject::Nonce => {
                write!(f, "nonce does not match this listener (stale or foreign handle)")
            }
            Reject::Field(what) => write!(f, "invalid field {what}"),
        }
    }
}

fn put<const N: usize>(b: &mut [u8], off: usize, v: [u8; N]) {
    b[off..off + N].copy_from_slice(&v);
}

fn get<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    b[off..off + N].try_into().expect("in bounds")
}

/// The magic and version that open both the handle and every message.
fn check_magic_version(b: &[u8]) -> Result<(), Reject> {
    let magic = u64::from_le_bytes(get(b, 0));
    if magic != MAGIC {
        return Err(Reject::Magic(magic));
    }
    let version = u32::from_le_bytes(get(b, 8));
    if version != VERSION {
        return Err(Reject::Version(version));
    }
    Ok(())
}

impl Handle {
    /// Writes the published part; the connector-state bytes are zeroed.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) {
        out.fill(0);
        put(out, 0, MAGIC.to_le_bytes());
        put(out, 8, VERSION.to_le_bytes());
        let (family, ip) = match self.addr.ip() {
            IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6u8, v6.octets()),
        };
        out[12] = family;
        out[13] = self.members;
        put(out, 14, self.addr.port().to_le_bytes());
        put(out, 16, ip);
        put(out, 32, self.nonce.to_le_bytes());
        if let SocketAddr::V6(a) = self.addr {
            put(out, 40, a.scope_id().to_le_bytes());
        }
    }

    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Result<Handle, Reject> {
        check_magic_version(b)?;
        let v6 = Ipv6Addr::from(get::<16>(b, 16));
        let port = u16::from_le_bytes(get(b, 14));
        if port == 0 {
            return Err(Reject::Field("handle port"));
        }
        let addr = match b[12] {
            4 => SocketAddr::new(
                IpAddr::V4(v6.to_ipv4_mapped().ok_or(Reject::Field("handle address"))?),
                port,
            ),
            6 => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, u32::from_le_bytes(get(b, 40)))),
            _ => return Err(Reject::Field("handle family")),
        };
        if !(1..=MAX_MEMBERS as u8).contains(&b[13]) {
            return Err(Reject::Field("handle members"));
        }
        Ok(Handle { addr, nonce: u64::from_le_bytes(get(b, 32)), members: b[13] })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    Hello = 1,
    Reply = 2,
    Ready = 3,
}

/// One side's endpoint and buffer, as sent to the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    pub kind: Kind,
    pub nonce: u64,
    /// Queue pairs in use (1..=128) and their numbers.
    pub nqps: u8,
    pub qpns: [u32; MAX_QPS],
    /// The RoCEv2 UDP source port of each QP; the connector chooses, both ends use them.
    pub sports: [u16; MAX_QPS],
    /// Whether each message is split across the QPs (else whole messages round-robin).
    pub split: bool,
    /// The service level. (Byte 34, before it, is reserved: the receiver's control writes take
    /// its own `NCCL_IB_FIFO_TC`, not the sender's.)
    pub sl: u8,
    /// `ibv_mtu` enum of the sender's port (1..=5).
    pub mtu: u8,
    pub port: u8,
    /// The connector's traffic class; both sides use it.
    pub traffic_class: u8,
    pub gid: [u8; 16],
    pub buf_addr: u64,
    pub buf_rkey: u32,
    /// The sender's largest message (`max_msg_sz` of its port).
    pub max_msg: u32,
    /// Member ports of the sender's device (1..=8): `gid`, `mtu`, `port` and `buf_rkey` are
    /// the first's, `more` the others'.
    pub members: u8,
    pub more: [End; MAX_MEMBERS - 1],
}

/// One member port's end of a connection: its GID, active MTU (`ibv_mtu`), port number, and
/// the key of the side's buffer (FIFO or size records) on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct End {
    pub gid: [u8; 16],
    pub mtu: u8,
    pub port: u8,
    pub rkey: u32,
}

impl Msg {
    /// Member port `m`'s end.
    pub fn end(&self, m: usize) -> End {
        match m {
            0 => End { gid: self.gid, mtu: self.mtu, port: self.port, rkey: self.buf_rkey },
            m => self.more[m - 1],
        }
    }

    /// Every member port's end.
    pub fn ends(&self) -> Vec<End> {
        (0..usize::from(self.members.max(1))).map(|m| self.end(m)).collect()
    }
}

impl Msg {
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        put(&mut b, 0, MAGIC.to_le_bytes());
        put(&mut b, 8, VERSION.to_le_bytes());
        put(&mut b, 12, (self.kind as u32).to_le_bytes());
        put(&mut b, 16, (MSG_LEN as u32).to_le_bytes());
        put(&mut b, 24, self.nonce.to_le_bytes());
        b[32] = self.nqps;
        b[33] = u8::from(self.split);
        b[35] = self.sl;
        for i in 0..MAX_QPS {
            put(&mut b, 96 + 4 * i, self.qpns[i].to_le_bytes());
            put(&mut b, 96 + 4 * MAX_QPS + 2 * i, self.sports[i].to_le_bytes());
        }
        b[36] = self.mtu;
        b[37] = self.port;
        b[38] = self.traffic_class;
        put(&mut b, 40, self.gid);
        put(&mut b, 56, self.buf_addr.to_le_bytes());
        put(&mut b, 64, self.buf_rkey.to_le_bytes());
        put(&mut b, 68, self.max_msg.to_le_bytes());
        b[39] = self.members;
        for (i, e) in self.more.iter().enumerate() {
            let at = MORE_AT + i * END_LEN;
            put(&mut b, at, e.gid);
            put(&mut b, at + 16, e.rkey.to_le_bytes());
            b[at + 20] = e.mtu;
            b[at + 21] = e.port;
        }
        b
    }

    /// Checks the header alone (the first 32 bytes), so a bad peer is rejected as soon as it
    /// has said enough.
    pub fn check_header(b: &[u8]) -> Result<(), Reject> {
        debug_assert!(b.len() >= HEADER_LEN);
        check_magic_version(b)?;
        let len = u32::from_le_bytes(get(b, 16));
        if len as usize != MSG_LEN {
            return Err(Reject::Length(len));
        }
        Ok(())
    }

    pub fn decode(b: &[u8; MSG_LEN], want: Kind, nonce: u64) -> Result<Msg, Reject> {
        Self::check_header(b)?;
        let kind = u32::from_le_bytes(get(b, 12));
        if kind != want as u32 {
            return Err(Reject::Kind(kind));
        }
        if u64::from_le_bytes(get(b, 24)) != nonce {
            return Err(Reject::Nonce);
        }
        let m = Msg {
            kind: want,
            nonce,
            nqps: b[32],
            split: b[33] == 1,
            sl: b[35],
            qpns: std::array::from_fn(|i| u32::from_le_bytes(get(b, 96 + 4 * i))),
            sports: std::array::from_fn(|i| u16::from_le_bytes(get(b, 96 + 4 * MAX_QPS + 2 * i))),
            mtu: b[36],
            port: b[37],
            traffic_class: b[38],
            gid: get(b, 40),
            buf_addr: u64::from_le_bytes(get(b, 56)),
            buf_rkey: u32::from_le_bytes(get(b, 64)),
            max_msg: u32::from_le_bytes(get(b, 68)),
            members: b[39],
            more: std::array::from_fn(|i| {
                let at = MORE_AT + i * END_LEN;
                End {
                    gid: get(b, at),
                    rkey: u32::from_le_bytes(get(b, at + 16)),
                    mtu: b[at + 20],
                    port: b[at + 21],
                }
            }),
        };
        if want != Kind::Ready {
            let n = usize::from(m.nqps);
            if !(1..=MAX_QPS).contains(&n) || b[33] > 1 || m.sl > 15 {
                return Err(Reject::Field("nqps, split or sl"));
            }
            if m.qpns[..n].iter().any(|&q| q == 0 || q > 0xff_ffff) {
                return Err(Reject::Field("qpn"));
            }
            if m.sports[..n].iter().any(|&p| p < 0xc000) {
                return Err(Reject::Field("source port"));
            }
            if !(1..=5).contains(&m.mtu) {
                return Err(Reject::Field("mtu"));
            }
            if m.port == 0 || m.buf_addr == 0 || m.max_msg == 0 {
                return Err(Reject::Field("port, buffer or max_msg"));
            }
            if m.buf_addr.checked_add(AREA_BYTES).is_none() {
                return Err(Reject::Field("buffer (its area would wrap the address space)"));
            }
            if !(1..=MAX_MEMBERS as u8).contains(&m.members) {
                return Err(Reject::Field("members"));
            }
            let more = &m.more[..usize::from(m.members) - 1];
            if more.iter().any(|e| !(1..=5).contains(&e.mtu) || e.port == 0) {
                return Err(Reject::Field("a member port's mtu or port"));
            }
        }
        Ok(m)
    }
}

/// The larger of the two control areas a peer's `buf_addr` names (the connector's FIFO, the
/// acceptor's size records), in bytes: every address the data path derives from it lies in
/// `[buf_addr, buf_addr + AREA_BYTES)`, which `decode` checks does not wrap.
pub const AREA_BYTES: u64 = 8 * (if FIFO_AREA > SIZE_AREA { FIFO_AREA } else { SIZE_AREA }) as u64;

/// The header length: a reader validates this much before reading the rest.
pub const fn header_len() -> usize {
    HEADER_LEN
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: Kind) -> Msg {
        Msg {
            kind,
            nonce: 0xdead_beef_1234,
            nqps: 2,
            qpns: std::array::from_fn(|i| if i < 2 { 0x11 + i as u32 } else { 0 }),
            sports: std::array::from_fn(|i| if i < 2 { 0xc000 + i as u16 } else { 0 }),
            split: true,
            sl: 3,
            mtu: 3,
            port: 1,
            traffic_class: 106,
            gid: [7; 16],
            buf_addr: 0x7f00_0000_1000,
            buf_rkey: 0x1234,
            max_msg: 8 << 20,
            members: 1,
            more: Default::default(),
        }
    }

    #[test]
    fn handle_round_trips_v4_and_v6() {
        for addr in ["198.18.0.1:40000", "[2001:db8::1]:5"] {
            let h = Handle { addr: addr.parse().unwrap(), nonce: 99, members: 1 };
            let mut b = [0xaa; HANDLE_SIZE];
            h.encode(&mut b);
            assert!(b[HANDLE_STATE_OFFSET..].iter().all(|&x| x == 0));
            assert_eq!(Handle::decode(&b).unwrap(), h);
        }
    }

    #[test]
    fn handle_keeps_the_scope_of_a_link_local_address() {
        let addr = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 4000, 0, 7));
        let h = Handle { addr, nonce: 5, members: 1 };
        let mut b = [0; HANDLE_SIZE];
        h.encode(&mut b);
        let back = Handle::decode(&b).unwrap();
        assert_eq!(back, h);
        let SocketAddr::V6(a) = back.addr else { panic!("not v6: {back:?}") };
        assert_eq!(a.scope_id(), 7);
        // An IPv4 handle carries no scope: those bytes stay zero.
        Handle { addr: "10.0.0.1:9".parse().unwrap(), nonce: 5, members: 1 }.encode(&mut b);
        assert!(b[40..44].iter().all(|&x| x == 0));
    }

    #[test]
    fn handle_rejects_garbage() {
        let mut b = [0u8; HANDLE_SIZE];
        assert!(matches!(Handle::decode(&b), Err(Reject::Magic(0))));
        Handle { addr: "10.0.0.1:1".parse().unwrap(), nonce: 1, members: 1 }.encode(&mut b);
        let mut v = b;
        v[8] = 10;
        assert_eq!(Handle::decode(&v), Err(Reject::Version(10)));
        let mut f = b;
        f[12] = 5;
        assert_eq!(Handle::decode(&f), Err(Reject::Field("handle family")));
        let mut p = b;
        p[14] = 0;
        assert_eq!(Handle::decode(&p), Err(Reject::Field("handle port")));
    }

    #[test]
    fn messages_round_trip() {
        for kind in [Kind::Hello, Kind::Reply, Kind::Ready] {
            let m = msg(kind);
            assert_eq!(Msg::decode(&m.encode(), kind, m.nonce).unwrap(), m);
        }
    }

    /// A fused end of v12's 8 ports: every member's end comes back, and a ninth is refused.
    #[test]
    fn messages_carry_eight_member_ends() {
        let more = std::array::from_fn(|i| End {
            gid: [i as u8 + 1; 16],
            mtu: 1 + i as u8 % 5,
            port: 1 + i as u8,
            rkey: 0x1000 + i as u32,
        });
        let m = Msg { members: 8, more, ..msg(Kind::Hello) };
        let back = Msg::decode(&m.encode(), Kind::Hello, m.nonce).unwrap();
        assert_eq!(back.ends().len(), 8);
        assert_eq!(back.end(7), End { gid: [7; 16], mtu: 2, port: 7, rkey: 0x1006 });
        assert_eq!(back, m);
        let mut nine = m.encode();
        nine[39] = 9;
        assert_eq!(Msg::decode(&nine, Kind::Hello, m.nonce), Err(Reject::Field("members")));
        let mut b = [0; HANDLE_SIZE];
        Handle { addr: "10.0.0.1:1".parse().unwrap(), nonce: 1, members: 8 }.encode(&mut b);
        assert_eq!(Handle::decode(&b).unwrap().members, 8);
        b[13] = 9;
        assert_eq!(Handle::decode(&b), Err(Reject::Field("handle members")));
    }

    #[test]
    fn messages_reject_each_bad_field() {
        let good = msg(Kind::Hello).encode();
        let n = msg(Kind::Hello).nonce;
        let bad = |off: usize, val: u8| {
            let mut b = good;
            b[off] = val;
            Msg::decode(&b, Kind::Hello, n).unwrap_err()
        };
        assert!(matches!(bad(0, 0), Reject::Magic(_)));
        assert_eq!(bad(8, 1), Reject::Version(1), "a version-1 peer (the old CTS layout)");
        assert_eq!(bad(8, 7), Reject::Version(7), "a version-7 peer (256 KiB in an immediate)");
        assert_eq!(bad(8, 8), Reject::Version(8), "a version-8 peer (an ack word after LL data)");
        assert_eq!(bad(12, 2), Reject::Kind(2));
        assert!(matches!(bad(16, 200), Reject::Length(l) if l as usize != MSG_LEN));
        assert_eq!(bad(24, 0), Reject::Nonce);
        assert_eq!(bad(36, 9), Reject::Field("mtu"));
        assert_eq!(bad(37, 0), Reject::Field("port, buffer or max_msg"));
        assert_eq!(bad(32, 0), Reject::Field("nqps, split or sl"));
        assert_eq!(bad(32, 129), Reject::Field("nqps, split or sl"));
        assert_eq!(bad(33, 2), Reject::Field("nqps, split or sl"));
        assert_eq!(bad(35, 16), Reject::Field("nqps, split or sl"));
        let mut q = good;
        q[100..104].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(Msg::decode(&q, Kind::Hello, n), Err(Reject::Field("qpn")));
        let mut p = good;
        p[96 + 4 * MAX_QPS..96 + 4 * MAX_QPS + 2].copy_from_slice(&4791u16.to_le_bytes());
        assert_eq!(Msg::decode(&p, Kind::Hello, n), Err(Reject::Field("source port")));
        assert_eq!(Msg::decode(&good, Kind::Reply, n), Err(Reject::Kind(1)));
    }

    #[test]
    fn header_check_needs_only_the_header() {
        let good = msg(Kind::Reply).encode();
        assert_eq!(Msg::check_header(&good[..header_len()]), Ok(()));
        let mut long = good;
        long[16..20].copy_from_slice(&4096u32.to_le_bytes());
        assert_eq!(Msg::check_header(&long[..header_len()]), Err(Reject::Length(4096)));
    }
}

/// Property tests: whatever bytes a stranger sends, decoding never panics, and what it accepts
/// is a message that encodes back to itself.
#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![Just(Kind::Hello), Just(Kind::Reply), Just(Kind::Ready)]
    }

    /// A message that passes every check of `decode` for `kind`.
    fn valid(kind: Kind) -> impl Strategy<Value = Msg> {
        (
            (1..=MAX_QPS, any::<u64>(), any::<bool>(), 0u8..=15, 1u8..=5),
            (
                1u8..=255,
                any::<u8>(),
                any::<[u8; 16]>(),
                1..=u64::MAX - AREA_BYTES,
                any::<u32>(),
                1..=u32::MAX,
            ),
            (proptest::collection::vec((1u32..=0xff_ffff, 0xc000u16..=0xffff), MAX_QPS)),
        )
            .prop_map(move |((nqps, nonce, split, sl, mtu), rest, qps)| {
                let (port, traffic_class, gid, buf_addr, buf_rkey, max_msg) = rest;
                // Unused slots are zero, as `endpoint` leaves them.
                let slot = |i: usize, v: u32| if i < nqps { v } else { 0 };
                Msg {
                    kind,
                    nonce,
                    nqps: nqps as u8,
                    qpns: std::array::from_fn(|i| slot(i, qps[i].0)),
                    sports: std::array::from_fn(|i| slot(i, u32::from(qps[i].1)) as u16),
                    split,
                    sl,
                    mtu,
                    port,
                    traffic_class,
                    gid,
                    buf_addr,
                    buf_rkey,
                    max_msg,
                    // 1 to 4 member ports; the others' ends valid as the first's.
                    members: (nonce % 4) as u8 + 1,
                    more: std::array::from_fn(|i| End {
                        gid,
                        mtu,
                        port,
                        rkey: buf_rkey ^ (i as u32 + 1),
                    }),
                }
            })
    }

    fn bytes(n: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), n)
    }

    /// Decodes, and checks an accepted message re-encodes to one that decodes to itself.
    fn decode_checked(b: &[u8; MSG_LEN], want: Kind, nonce: u64) -> Result<Msg, Reject> {
        let r = Msg::decode(b, want, nonce);
        if let Ok(m) = &r {
            assert_eq!(m.kind, want);
            assert_eq!(m.nonce, nonce);
            assert_eq!(Msg::decode(&m.encode(), want, nonce).as_ref(), Ok(m));
        }
        r
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in bytes(MSG_LEN), want in kind(), nonce: u64) {
            let b: [u8; MSG_LEN] = b.try_into().unwrap();
            let _ = Msg::check_header(&b[..header_len()]);
            let _ = decode_checked(&b, want, nonce);
            // The nonce in the bytes themselves, so decoding gets past the nonce check.
            let own = u64::from_le_bytes(get(&b, 24));
            let _ = decode_checked(&b, want, own);
        }

        #[test]
        fn a_valid_header_with_a_garbage_body_never_panics(
            body in bytes(MSG_LEN - header_len()), want in kind(), nonce: u64,
        ) {
            let mut b = [0u8; MSG_LEN];
            b[header_len()..].copy_from_slice(&body);
            put(&mut b, 0, MAGIC.to_le_bytes());
            put(&mut b, 8, VERSION.to_le_bytes());
            put(&mut b, 12, (want as u32).to_le_bytes());
            put(&mut b, 16, (MSG_LEN as u32).to_le_bytes());
            put(&mut b, 24, nonce.to_le_bytes());
            prop_assert_eq!(Msg::check_header(&b), Ok(()));
            let _ = decode_checked(&b, want, nonce);
        }

        #[test]
        fn mutated_messages_decode_or_reject(
            m in kind().prop_flat_map(valid),
            edits in proptest::collection::vec((0..MSG_LEN, any::<u8>()), 1..8),
            want in kind(),
        ) {
            let mut b = m.encode();
            for (at, v) in edits {
                b[at] = v;
            }
            let _ = decode_checked(&b, want, m.nonce);
        }

        #[test]
        fn valid_messages_round_trip(m in kind().prop_flat_map(valid)) {
            prop_assert_eq!(decode_checked(&m.encode(), m.kind, m.nonce), Ok(m));
            // Another listener's nonce is always refused.
            prop_assert_eq!(Msg::decode(&m.encode(), m.kind, !m.nonce), Err(Reject::Nonce));
        }

        #[test]
        fn handle_decode_of_any_bytes_never_panics(b in bytes(HANDLE_SIZE)) {
            let b: [u8; HANDLE_SIZE] = b.try_into().unwrap();
            if let Ok(h) = Handle::decode(&b) {
                let mut again = [0u8; HANDLE_SIZE];
                h.encode(&mut again);
                prop_assert_eq!(Handle::decode(&again), Ok(h));
            }
        }

        #[test]
        fn handles_round_trip(v6: bool, ip: [u8; 16], port in 1u16.., scope: u32, nonce: u64) {
            let addr = if v6 {
                SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope))
            } else {
                SocketAddr::new(IpAddr::from([ip[0], ip[1], ip[2], ip[3]]), port)
            };
            let h = Handle { addr, nonce, members: 1 };
            let mut b = [0u8; HANDLE_SIZE];
            h.encode(&mut b);
            prop_assert_eq!(Handle::decode(&b), Ok(h));
        }
    }
}
