//! Every knob ferroce reads, in one place: typed, documented, parsed once per initialisation.
//! At INFO only the knobs the environment set get a line, as NCCL's own do; the whole table is
//! logged at TRACE and shown by `ferroce knobs`.
//!
//! NCCL's own `NCCL_IB_*` names are honoured where the meaning matches, so users can switch
//! plugins without relearning; ferroce's own knobs start with `FERROCE_`. A malformed value is
//! an [`Error::Config`] naming the knob, never a silent default. A well-formed value that would
//! make a wait unbounded (timeout 0, RNR retry 7) is replaced by a bounded one with a WARN,
//! unless `FERROCE_ALLOW_UNBOUNDED=1` asks for it. The README's knob table is written from
//! [`KNOBS`].
//!
//! Callers: `transport` (at init), the tools in `src/tools`.

pub mod hca;

use std::net::IpAddr;
use std::time::Duration;

use crate::error::{Error, Result};
use hca::HcaFilter;

/// A documented knob: its environment variable, default and meaning.
pub struct Knob {
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

macro_rules! knobs {
    ($($name:literal, $default:literal, $meaning:literal;)*) => {
        pub const KNOBS: &[Knob] = &[$(Knob { name: $name, default: $default, meaning: $meaning }),*];
    };
}

knobs! {
    "NCCL_IB_HCA", "(all devices)", "device/port filter, NCCL syntax: [^][=]name[:port[:rail[:plane]]],...";
    "NCCL_IB_MERGE_VFS", "1", "1: the virtual functions of one NIC share its pciPath, so NCCL's topology places them as one card; 0: each VF keeps its own (the PCI function digit is merged either way)";
    "NCCL_IB_DEVICE_PCI_ORDER", "1", "1: devices are numbered in PCI order (bus id of each device's PCI function, software devices last), as NCCL numbers them; 0: name order";
    "NCCL_IB_MERGE_NICS", "1", "1: makeVDevice fuses the ports NCCL asks for into one NCCL device (NIC fusion); 0: it refuses, and NCCL uses each port alone";
    "NCCL_IB_GID_INDEX", "-1", "GID index for every device; -1 chooses automatically";
    "FERROCE_GID_INDEX", "(unset)", "per-device GID index, e.g. rxe0:1,rxe1:3; wins over NCCL_IB_GID_INDEX";
    "FERROCE_GID_NETDEV", "(unset)", "only GIDs on these interfaces, e.g. eth2,eth3";
    "FERROCE_GID_IP", "(unset)", "the GID holding one of these IP addresses (may be link-local)";
    "NCCL_IB_ADDR_FAMILY", "AF_INET", "address family of the automatic GID choice: AF_INET or AF_INET6";
    "NCCL_IB_ADDR_RANGE", "(any)", "CIDR range the automatic GID choice must fall in, e.g. 10.0.0.0/8";
    "NCCL_IB_ROCE_VERSION_NUM", "2", "RoCE version of the automatic GID choice (1 or 2)";
    "NCCL_IB_TIMEOUT", "20", "QP ACK timeout exponent: 4.096 us x 2^value per attempt (1..=31)";
    "NCCL_IB_RETRY_CNT", "7", "QP transport retry count (0..=7; rxe treats 7 as unlimited)";
    "FERROCE_RNR_RETRY", "6", "QP RNR retry count (0..=6; 7 would retry forever)";
    "FERROCE_ALLOW_UNBOUNDED", "0", "1: accept NCCL_IB_TIMEOUT=0 and FERROCE_RNR_RETRY=7 (waits without bound)";
    "FERROCE_PROGRESS_TIMEOUT_MS", "0", "error when posted work sees no completion for this long; 0: 2x the retry bound + 10 s (none with an unbounded NCCL_IB_TIMEOUT=0)";
    "FERROCE_PROBE_INTERVAL_MS", "5000", "a comm that waits with no completion for this long probes its peer (a zero-length write): a dead peer fails within this + the retry bound";
    "FERROCE_STATS_INTERVAL_S", "0", "every this many seconds each comm logs its statistics line at INFO (also logged at close); 0: only at close; both only with NCCL_DEBUG=INFO or TRACE, the levels at which NCCL shows INFO lines (below them the line is not made and the port counters are not read)";
    "NCCL_IB_QPS_PER_CONNECTION", "2", "queue pairs per connection (1..=128), each with its own UDP source port; 2 (NCCL's is 1): a second ECMP path, and a lane to fail over to";
    "NCCL_IB_SPLIT_DATA_ON_QPS", "0", "1: split every message across the QPs; 0: whole messages round-robin";
    "FERROCE_PATH_AWARE", "1", "1: place work by each QP's measured path (a whole message on the cheaper of two QPs; a QP under a quarter of the fastest one's rate gets no new work); 0: strict rotation and equal chunks";
    "NCCL_IB_RESILIENCY_PORT_FAILOVER", "1", "1: a lane (a port of a fused device) whose path or port fails hands its work to the comm's other lanes, and the comm goes on; 0: any lane's failure fails the comm (NCCL's default is 0; ferroce's lanes fail over unless told not to)";
    "FERROCE_LANE_STALL_MS", "250", "a lane with work outstanding that completes nothing for this long (or 4x its longest recent wait, plus its oldest chunk's time at the lane's rate, if larger) while another lane of the comm completes is fenced and its work moves to the others, at any NCCL_IB_TIMEOUT; a lane whose port goes down is fenced at once; 0: off (only the retry bound fails a lane over)";
    "NCCL_IB_RESILIENCY_PORT_RECOVERY", "1", "1: failed lanes are repaired (NCCL_IB_RESILIENCY_PORT_RECOVERY_*), and rebuilt at once when their port is ACTIVE again; 0: a failed lane stays out (NCCL's default is 0)";
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", "5", "lane repair: attempts to rebuild a failed lane (a new queue pair at both ends, proven by a probe) before it stays out; 0: failed lanes stay out";
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_START_DELAY", "200", "lane repair: ms from a lane's failure to its first repair attempt; each failed attempt doubles the wait";
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT", "5000", "lane repair: ms an attempt waits for the peer's answer, then for the probe of the rebuilt lane, before it counts as failed";
    "FERROCE_SPORT_BASE", "49152", "first RoCEv2 UDP source port (49152..=65535)";
    "FERROCE_SPORT_RANGE", "65536 - base", "number of source ports used from the base (at most 16384)";
    "FERROCE_SPORT_SPREAD", "1", "1: the connections of a process to one peer get disjoint port blocks (each direction its own half of the range); 0: every connection uses base+i";
    "NCCL_IB_TC", "-1", "traffic class (DSCP << 2 | ECN) of the data QPs; -1: the communicator's, else 0";
    "NCCL_IB_FIFO_TC", "-1", "read by the receiver: traffic class of its QPs, which carry its control (CTS) writes; -1: the sender's data one (as NCCL)";
    "NCCL_IB_SL", "-1", "service level; -1: the communicator's traffic class (the SL field's 4 bits of it), else 0";
    "NCCL_SOCKET_IFNAME", "(the GID's interface)", "interfaces for the connection-setup listener, NCCL syntax: prefixes, =exact, ^exclude, lists";
    "FERROCE_SETUP_TIMEOUT_MS", "120000", "deadline of each connection-setup step (TCP connect, each handshake message, waiting for a peer)";
    "FERROCE_FORCE_FLUSH", "0", "1: iflush issues the GPUDirect RDMA-read flush even for host memory (testing)";
    "FERROCE_NET_PROFILER", "1", "1: per-QP profiler events to the callback NCCL gives init (v10+); 0: none";
    "NCCL_DMABUF_ENABLE", "1", "0: never offer dma-buf registration of GPU memory (peer memory still works)";
    "NCCL_GDR_FLUSH_DISABLE", "0", "1: no RDMA-read flush after receives into GPU memory";
    "NCCL_IB_PCI_RELAXED_ORDERING", "2", "relaxed ordering for NCCL's buffers: 0 off, 1 on (WARN where impossible), 2 on where the provider accepts it";
    "NCCL_IB_QUERY_PORT_SPEED", "1", "0: the port speed from its active speed and width, not ibv_query_port_speed (as NCCL)";
}

/// NCCL's knobs that ferroce accepts (as NCCL reads them) but takes nothing from, and why.
const IGNORED: [(&str, &str); 6] = [
    (
        "NCCL_IB_RESILIENCY_PORT_FAILOVER_MAX_ATTEMPTS",
        "a failed lane's work moves to the comm's other lanes as often as lanes fail, while one lives",
    ),
    (
        "NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY",
        "work moves off a failed lane at once (FERROCE_LANE_STALL_MS fences a silent one)",
    ),
    (
        "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_INTERVAL",
        "a repaired lane is proven by one probe write, not by keep-alive messages",
    ),
    (
        "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_SIZE",
        "a repaired lane is proven by one probe write, not by keep-alive messages",
    ),
    (
        "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_SEQUENCE_SIZE",
        "a repaired lane is proven by one probe write, not by keep-alive messages",
    ),
    (
        "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_TIMEOUT",
        "NCCL_IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT bounds each wait of a repair",
    ),
];

/// Which addresses the automatic GID choice wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// A CIDR range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> (u128, u8) {
            match ip {
                IpAddr::V4(v4) => (u128::from(u32::from(v4)) << 96, 32),
                IpAddr::V6(v6) => (u128::from(v6), 128),
            }
        };
        let ((a, wa), (b, wb)) = (bits(self.addr), bits(ip));
        if wa != wb {
            return false;
        }
        let mask = if self.len == 0 { 0 } else { u128::MAX << (128 - u32::from(self.len)) };
        a & mask == b & mask
    }
}

/// The parsed configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub ib_hca: HcaFilter,
    /// `NCCL_IB_MERGE_VFS`: the pciPath NCCL is told also merges a VF into its card.
    pub merge_vfs: bool,
    /// `NCCL_IB_DEVICE_PCI_ORDER`: devices numbered in PCI order (else name order).
    pub pci_order: bool,
    /// `NCCL_IB_MERGE_NICS`: `makeVDevice` may fuse ports into one NCCL device.
    pub merge_nics: bool,
    pub gid_index: Option<u8>,
    pub gid_index_per_dev: Vec<(String, u8)>,
    pub gid_netdevs: Vec<String>,
    pub gid_ips: Vec<IpAddr>,
    pub addr_family: Family,
    pub addr_range: Option<Cidr>,
    pub roce_version: u8,
    pub ib_timeout: u8,
    pub ib_retry_cnt: u8,
    pub rnr_retry: u8,
    pub progress_timeout: Duration,
    pub probe_interval: Duration,
    /// `FERROCE_STATS_INTERVAL_S`; `None`: statistics only at close.
    pub stats_interval: Option<Duration>,
    /// `NCCL_DEBUG` is `INFO` or `TRACE`: NCCL shows INFO lines, so the statistics lines are
    /// made (and the port counters read for them).
    pub stats: bool,
    pub qps_per_conn: usize,
    pub split_data: bool,
    pub path_aware: bool,
    /// `NCCL_IB_RESILIENCY_PORT_FAILOVER`: a failed lane's work moves to the others.
    pub failover: bool,
    /// `FERROCE_LANE_STALL_MS`: the floor of a lane's stall bound; `None`: off.
    pub lane_stall: Option<Duration>,
    /// Lane repair: attempts (0: none, also with `NCCL_IB_RESILIENCY_PORT_RECOVERY=0`), the
    /// first delay, the bound of each wait.
    pub repair_attempts: u32,
    pub repair_delay: Duration,
    pub repair_timeout: Duration,
    pub sport_base: u16,
    pub sport_range: u16,
    pub sport_spread: bool,
    pub tc: Option<u8>,
    pub fifo_tc: Option<u8>,
    /// `NCCL_IB_SL`; `None`: the communicator's traffic class, else 0 (NCCL's rule).
    pub sl: Option<u8>,
    /// `NCCL_SOCKET_IFNAME`, in NCCL's list syntax (prefixes, `=` exact, `^` exclude).
    pub socket_ifname: Option<HcaFilter>,
    pub setup_timeout: Duration,
    pub force_flush: bool,
    /// `FERROCE_NET_PROFILER`: report profiler events where NCCL gives a callback.
    pub net_profiler: bool,
    pub dmabuf_enable: bool,
    pub gdr_flush_disable: bool,
    /// `NCCL_IB_PCI_RELAXED_ORDERING`: 0 off, 1 on, 2 auto.
    pub relaxed_ordering: u8,
    /// `NCCL_IB_QUERY_PORT_SPEED`: the speed from `ibv_query_port_speed` where it exists.
    pub query_port_speed: bool,
    /// Every knob in [`KNOBS`] order: what it became, and what the environment said.
    pub effective: Vec<Effective>,
    /// Values replaced to keep every wait bounded: one WARN each at init.
    pub warnings: Vec<String>,
}

impl Default for Config {
    fn default() -> Config {
        Config::from_lookup(|_| None).expect("defaults are valid")
    }
}

/// One knob as read: what ferroce uses, and the environment's value where it set one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    pub name: &'static str,
    pub value: String,
    /// The value as the environment gave it (trimmed); `None` when unset or empty.
    pub set: Option<String>,
}

impl Effective {
    /// The INFO line of a knob the environment set, as NCCL words its own: the value as read,
    /// and what it became where that differs.
    pub fn set_line(&self) -> Option<String> {
        let raw = self.set.as_ref()?;
        Some(if *raw == self.value {
            format!("{} set by environment to {raw}", self.name)
        } else {
            format!("{} set by environment to {raw}, used as {}", self.name, self.value)
        })
    }
}

/// Whether NCCL shows INFO lines at this `NCCL_DEBUG` level: `INFO` or `TRACE`, in any case.
pub fn shows_info(nccl_debug: &str) -> bool {
    let level = nccl_debug.trim();
    level.eq_ignore_ascii_case("INFO") || level.eq_ignore_ascii_case("TRACE")
}

/// Reads knobs and records what each ended up as.
struct Reader<F: Fn(&str) -> Option<String>> {
    get: F,
    effective: Vec<Effective>,
    /// Values replaced by what ferroce uses instead, in words, for one WARN each.
    warnings: Vec<String>,
}

impl<F: Fn(&str) -> Option<String>> Reader<F> {
    fn raw(&self, knob: &'static str) -> Option<String> {
        (self.get)(knob).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
    }

    fn record(&mut self, knob: &'static str, value: impl ToString) {
        let set = self.raw(knob);
        self.effective.push(Effective { name: knob, value: value.to_string(), set });
    }

    /// A recorded value replaced by what ferroce uses instead (`why` is its WARN).
    fn replace(&mut self, knob: &'static str, value: impl ToString, why: String) {
        if let Some(e) = self.effective.iter_mut().find(|e| e.name == knob) {
            e.value = value.to_string();
        }
        self.warnings.push(why);
    }

    /// An integer within `range`, or `default` when unset; written as NCCL reads integers
    /// (`strtoll` with base 0: `0x68`, `010` octal, a sign), but the whole value must be one.
    fn int<T>(
        &mut self,
        knob: &'static str,
        default: T,
        range: std::ops::RangeInclusive<T>,
    ) -> Result<T>
    where
        T: TryFrom<i128> + PartialOrd + std::fmt::Display + Copy,
    {
        let v = match self.raw(knob) {
            None => default,
            Some(raw) => {
                let out_of_range =
                    || format!("out of range: must be in {}..={}", range.start(), range.end());
                let v = parse_int(&raw).map_err(|why| match why {
                    IntError::NotAnInteger => Error::config(knob, &raw, "not an integer"),
                    IntError::TooLarge => Error::config(knob, &raw, out_of_range()),
                })?;
                match T::try_from(v) {
                    Ok(v) if range.contains(&v) => v,
                    _ => return Err(Error::config(knob, &raw, out_of_range())),
                }
            }
        };
        self.record(knob, v);
        Ok(v)
    }

    /// One of NCCL's on/off knobs, read as NCCL reads it: any integer, and any but 0 is on.
    fn flag(&mut self, knob: &'static str, default: bool) -> Result<bool> {
        let v = self.int(knob, i64::from(default), i64::MIN..=i64::MAX)? != 0;
        if let Some(e) = self.effective.iter_mut().rfind(|e| e.name == knob) {
            e.value = u8::from(v).to_string();
        }
        Ok(v)
    }

    /// A byte-wide knob of NCCL's (a traffic class, a service level) with -1 for unset: any
    /// integer NCCL takes, cut to the `bits` the NIC uses (NCCL hands the value to verbs, whose
    /// field is a byte and whose NIC reads its low bits), with a WARN when that changes it.
    fn byte(&mut self, knob: &'static str, bits: u32) -> Result<Option<u8>> {
        let v = self.int(knob, -1i64, i64::MIN..=i64::MAX)?;
        if v == -1 {
            return Ok(None);
        }
        let cut = (v as u64 & ((1u64 << bits) - 1)) as u8;
        if i64::from(cut) != v {
            let why = format!(
                "{knob}={v} is wider than the {bits} bits the NIC takes: {cut} is used (NCCL \
                 passes it on the same way)"
            );
            self.replace(knob, cut, why);
        }
        Ok(Some(cut))
    }

    /// NCCL's knobs that ferroce reads nothing from: accepted as NCCL reads them, with one
    /// WARN each that is set, saying why it changes nothing.
    fn ignored(&mut self) -> Result<()> {
        for (knob, why) in IGNORED {
            if self.raw(knob).is_some() {
                let v = self.int(knob, 0i64, i64::MIN..=i64::MAX)?;
                self.warnings.push(format!("{knob}={v} is ignored by ferroce: {why}"));
            }
        }
        Ok(())
    }

    /// A comma-separated list.
    fn list(&mut self, knob: &'static str) -> Vec<String> {
        let v: Vec<String> = self
            .raw(knob)
            .map(|s| s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
            .unwrap_or_default();
        self.record(knob, if v.is_empty() { "(unset)".into() } else { v.join(",") });
        v
    }

    /// `NCCL_IB_HCA`: which devices and ports.
    fn hca(&mut self) -> Result<HcaFilter> {
        let ib_hca = match self.raw("NCCL_IB_HCA") {
            None => HcaFilter::default(),
            Some(v) => HcaFilter::parse(&v).map_err(|e| Error::config("NCCL_IB_HCA", &v, e.0))?,
        };
        self.record(
            "NCCL_IB_HCA",
            if ib_hca.is_empty() { "(all devices)".into() } else { ib_hca.raw.clone() },
        );
        Ok(ib_hca)
    }

    /// `FERROCE_GID_INDEX`: a GID index per device, as `device:index`.
    fn gid_index_per_dev(&mut self) -> Result<Vec<(String, u8)>> {
        let mut gid_index_per_dev = Vec::new();
        for item in self.list("FERROCE_GID_INDEX") {
            let bad =
                || Error::config("FERROCE_GID_INDEX", &item, "expected device:index, e.g. rxe0:1");
            let (dev, idx) = item.split_once(':').ok_or_else(bad)?;
            let idx = parse_int(idx.trim()).ok().and_then(|i| u8::try_from(i).ok());
            gid_index_per_dev.push((dev.trim().to_string(), idx.ok_or_else(bad)?));
        }
        Ok(gid_index_per_dev)
    }

    /// `FERROCE_GID_IP`: the addresses whose GIDs to prefer.
    fn gid_ips(&mut self) -> Result<Vec<IpAddr>> {
        let ips = self.list("FERROCE_GID_IP");
        let ip = |s: &String| {
            parse_ip(s).ok_or_else(|| Error::config("FERROCE_GID_IP", s, "not an IP address"))
        };
        ips.iter().map(ip).collect()
    }

    /// `NCCL_IB_ADDR_FAMILY`.
    fn addr_family(&mut self) -> Family {
        // NCCL treats any value but AF_INET6 as AF_INET; ferroce says so.
        let family_raw = self.raw("NCCL_IB_ADDR_FAMILY");
        let addr_family = match family_raw.as_deref() {
            None | Some("AF_INET") => Family::V4,
            Some("AF_INET6") => Family::V6,
            Some(other) => {
                self.warnings.push(format!(
                    "NCCL_IB_ADDR_FAMILY={other} is neither AF_INET nor AF_INET6; using AF_INET"
                ));
                Family::V4
            }
        };
        self.record(
            "NCCL_IB_ADDR_FAMILY",
            if addr_family == Family::V6 { "AF_INET6" } else { "AF_INET" },
        );
        addr_family
    }

    /// `NCCL_IB_ADDR_RANGE`: a CIDR the GID's address must lie in.
    fn addr_range(&mut self) -> Result<Option<Cidr>> {
        let range_raw = self.raw("NCCL_IB_ADDR_RANGE");
        self.record("NCCL_IB_ADDR_RANGE", range_raw.clone().unwrap_or("(any)".into()));
        let addr_range = match range_raw {
            None => None,
            Some(v) => Some(parse_cidr(&v).ok_or_else(|| {
                Error::config(
                    "NCCL_IB_ADDR_RANGE",
                    &v,
                    "expected address/prefix-length, e.g. 10.0.0.0/8",
                )
            })?),
        };
        Ok(addr_range)
    }

    /// The ACK timeout, the retry counts and the progress deadline, kept bounded unless
    /// `FERROCE_ALLOW_UNBOUNDED` asks otherwise: `(ib_timeout, ib_retry_cnt, rnr_retry,
    /// progress_timeout)`.
    fn timeouts(&mut self) -> Result<(u8, u8, u8, Duration)> {
        // Timeouts: parse, then keep them bounded unless asked not to.
        let allow = self.int("FERROCE_ALLOW_UNBOUNDED", 0u8, 0..=1)? == 1;
        let mut ib_timeout = self.int("NCCL_IB_TIMEOUT", 20u8, 0..=255)?;
        if ib_timeout >= 32 || (ib_timeout == 0 && !allow) {
            let why = format!(
                "NCCL_IB_TIMEOUT={ib_timeout} {}; using 20 (4.3 s per attempt){}",
                if ib_timeout == 0 {
                    "disables the ACK timeout (a dead peer hangs the job)"
                } else {
                    "does not fit the 5-bit field"
                },
                if ib_timeout == 0 { "; FERROCE_ALLOW_UNBOUNDED=1 keeps 0" } else { "" }
            );
            ib_timeout = 20;
            self.replace("NCCL_IB_TIMEOUT", ib_timeout, why);
        }
        let ib_retry_cnt = self.int("NCCL_IB_RETRY_CNT", 7u8, 0..=7)?;
        let mut rnr_retry = self.int("FERROCE_RNR_RETRY", 6u8, 0..=7)?;
        if rnr_retry == 7 && !allow {
            rnr_retry = 6;
            let why = "FERROCE_RNR_RETRY=7 retries forever; using 6 (FERROCE_ALLOW_UNBOUNDED=1 \
                       keeps 7)";
            self.replace("FERROCE_RNR_RETRY", rnr_retry, why.into());
        }
        let progress_ms = self.int("FERROCE_PROGRESS_TIMEOUT_MS", 0u64, 0..=86_400_000)?;
        let bound = retry_bound(ib_timeout, ib_retry_cnt);
        let progress_timeout = match progress_ms {
            // NCCL_IB_TIMEOUT=0 kept on purpose disables the ACK timeout: the derived deadline
            // would be 10 s, far tighter than what was asked for, so there is none.
            0 if ib_timeout == 0 => Duration::MAX,
            0 => bound * 2 + Duration::from_secs(10),
            ms => {
                let t = Duration::from_millis(ms);
                if t < bound && ib_timeout != 0 {
                    self.warnings.push(format!(
                        "FERROCE_PROGRESS_TIMEOUT_MS={ms} is below the retry bound of {} ms \
                         (NCCL_IB_TIMEOUT {ib_timeout}, NCCL_IB_RETRY_CNT {ib_retry_cnt}): a \
                         path that only needs its retries is declared dead early",
                        bound.as_millis()
                    ));
                }
                t
            }
        };
        Ok((ib_timeout, ib_retry_cnt, rnr_retry, progress_timeout))
    }

    /// `FERROCE_LANE_STALL_MS`, with its floor from the ACK timeout `ib_timeout`.
    fn lane_stall(&mut self, ib_timeout: u8) -> Result<Option<Duration>> {
        let stall_ms = self.int("FERROCE_LANE_STALL_MS", 250u64, 0..=3_600_000)?;
        // A lost packet costs the lane one ACK timeout, and losses come in runs. Where up to
        // four of them fit in about a second (NCCL_IB_TIMEOUT 17 or less, a lossy fabric's
        // tuning), the floor covers as many as fit, so resends are not taken for a dead path;
        // where an attempt is longer, a loss would stall the lane longer than a dead path may,
        // and fencing it (then repairing it) is the cheaper of the two.
        let attempt = retry_bound(ib_timeout, 0);
        let fits = [4, 3, 2].map(|k| attempt * k);
        let cover = fits.into_iter().find(|c| *c <= Duration::from_millis(1100));
        let cover = cover.unwrap_or(Duration::ZERO);
        let lane_stall = (stall_ms > 0).then(|| Duration::from_millis(stall_ms).max(cover));
        Ok(lane_stall)
    }

    /// Lane repair: `(attempts, delay, ack timeout)`; no attempt without `failover`.
    fn repair(&mut self, failover: bool) -> Result<(u32, Duration, Duration)> {
        let recovery = self.flag("NCCL_IB_RESILIENCY_PORT_RECOVERY", true)?;
        let repair_attempts =
            self.int("NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", 5u32, 0..=u32::MAX)?;
        // No failover, nothing to repair; no recovery, no attempt.
        let repair_attempts = if failover && recovery { repair_attempts } else { 0 };
        let repair_delay = Duration::from_millis(self.int(
            "NCCL_IB_RESILIENCY_PORT_RECOVERY_START_DELAY",
            200u64,
            0..=3_600_000,
        )?);
        let repair_timeout = Duration::from_millis(self.int(
            "NCCL_IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT",
            5000u64,
            10..=3_600_000,
        )?);
        Ok((repair_attempts, repair_delay, repair_timeout))
    }

    /// The UDP source ports of the lanes: `(base, range)`.
    fn sports(&mut self) -> Result<(u16, u16)> {
        let sport_base = self.int("FERROCE_SPORT_BASE", 0xc000u16, 0xc000..=0xffff)?;
        // By default the range runs from the base to the top of the port space.
        let top = (0x1_0000 - u32::from(sport_base)) as u16;
        let sport_range = self.int("FERROCE_SPORT_RANGE", top, 1..=0x4000)?;
        if u32::from(sport_base) + u32::from(sport_range) > 0x1_0000 {
            return Err(Error::config(
                "FERROCE_SPORT_RANGE",
                &sport_range.to_string(),
                format!("FERROCE_SPORT_BASE {sport_base} + range must stay within 65535"),
            ));
        }
        Ok((sport_base, sport_range))
    }

    /// `NCCL_SOCKET_IFNAME`.
    fn socket_ifname(&mut self) -> Result<Option<HcaFilter>> {
        let socket_ifname = match self.raw("NCCL_SOCKET_IFNAME") {
            None => None,
            Some(v) => Some(parse_ifname(&v)?),
        };
        self.record(
            "NCCL_SOCKET_IFNAME",
            socket_ifname.as_ref().map_or("(the GID's interface)".into(), |f| f.raw.clone()),
        );
        Ok(socket_ifname)
    }
}

impl Config {
    /// Reads the process environment. A knob whose value is not UTF-8 is ignored with a WARN.
    pub fn from_env() -> Result<Config> {
        let mut cfg = Self::from_lookup(|k| std::env::var(k).ok())?;
        for k in KNOBS {
            if std::env::var_os(k.name).is_some_and(|v| v.to_str().is_none()) {
                let v = std::env::var_os(k.name).unwrap_or_default();
                cfg.warnings.push(format!(
                    "{}={} is not valid UTF-8; ignored (the default applies)",
                    k.name,
                    v.to_string_lossy()
                ));
            }
        }
        Ok(cfg)
    }

    /// Reads knobs through `get`, so tests need not touch the process environment.
    ///
    /// Long on purpose: one line per knob, in the order of [`KNOBS`], then the struct they fill;
    /// what takes more than a line is a method of the reader.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut r = Reader { get, effective: Vec::new(), warnings: Vec::new() };

        let ib_hca = r.hca()?;
        let merge_vfs = r.flag("NCCL_IB_MERGE_VFS", true)?;
        let pci_order = r.flag("NCCL_IB_DEVICE_PCI_ORDER", true)?;
        let merge_nics = r.flag("NCCL_IB_MERGE_NICS", true)?;
        let gid_index = u8::try_from(r.int("NCCL_IB_GID_INDEX", -1i32, -1..=255)?).ok();
        let gid_index_per_dev = r.gid_index_per_dev()?;
        let gid_netdevs = r.list("FERROCE_GID_NETDEV");
        let gid_ips = r.gid_ips()?;
        let addr_family = r.addr_family();
        let addr_range = r.addr_range()?;
        let roce_version = r.int("NCCL_IB_ROCE_VERSION_NUM", 2u8, 1..=2)?;

        let (ib_timeout, ib_retry_cnt, rnr_retry, progress_timeout) = r.timeouts()?;
        let probe_interval =
            Duration::from_millis(r.int("FERROCE_PROBE_INTERVAL_MS", 5000u64, 10..=86_400_000)?);

        let stats_s = r.int("FERROCE_STATS_INTERVAL_S", 0u64, 0..=86_400)?;
        let stats_interval = (stats_s > 0).then(|| Duration::from_secs(stats_s));
        let stats = r.raw("NCCL_DEBUG").is_some_and(|v| shows_info(&v));
        let qps_per_conn = r.int("NCCL_IB_QPS_PER_CONNECTION", 2usize, 1..=128)?;
        let split_data = r.flag("NCCL_IB_SPLIT_DATA_ON_QPS", false)?;
        let path_aware = r.int("FERROCE_PATH_AWARE", 1u8, 0..=1)? == 1;
        let failover = r.flag("NCCL_IB_RESILIENCY_PORT_FAILOVER", true)?;
        let lane_stall = r.lane_stall(ib_timeout)?;
        let (repair_attempts, repair_delay, repair_timeout) = r.repair(failover)?;
        let (sport_base, sport_range) = r.sports()?;
        let sport_spread = r.int("FERROCE_SPORT_SPREAD", 1u8, 0..=1)? == 1;
        let tc = r.byte("NCCL_IB_TC", 8)?;
        let fifo_tc = r.byte("NCCL_IB_FIFO_TC", 8)?;
        let sl = r.byte("NCCL_IB_SL", 4)?;
        let socket_ifname = r.socket_ifname()?;
        let setup_timeout =
            Duration::from_millis(r.int("FERROCE_SETUP_TIMEOUT_MS", 120_000u64, 1..=86_400_000)?);
        let force_flush = r.int("FERROCE_FORCE_FLUSH", 0u8, 0..=1)? == 1;
        let net_profiler = r.int("FERROCE_NET_PROFILER", 1u8, 0..=1)? == 1;
        let dmabuf_enable = r.flag("NCCL_DMABUF_ENABLE", true)?;
        let gdr_flush_disable = r.flag("NCCL_GDR_FLUSH_DISABLE", false)?;
        let query_port_speed = r.flag("NCCL_IB_QUERY_PORT_SPEED", true)?;
        r.ignored()?;
        let relaxed_ordering = r.int("NCCL_IB_PCI_RELAXED_ORDERING", 2u8, 0..=2)?;

        let mut effective = std::mem::take(&mut r.effective);
        effective.sort_by_key(|e| KNOBS.iter().position(|d| d.name == e.name));
        Ok(Config {
            ib_hca,
            merge_vfs,
            pci_order,
            merge_nics,
            gid_index,
            gid_index_per_dev,
            gid_netdevs,
            gid_ips,
            addr_family,
            addr_range,
            roce_version,
            ib_timeout,
            ib_retry_cnt,
            rnr_retry,
            progress_timeout,
            probe_interval,
            stats_interval,
            stats,
            qps_per_conn,
            split_data,
            path_aware,
            failover,
            lane_stall,
            repair_attempts,
            repair_delay,
            repair_timeout,
            sport_base,
            sport_range,
            sport_spread,
            tc,
            fifo_tc,
            sl,
            socket_ifname,
            setup_timeout,
            force_flush,
            net_profiler,
            dmabuf_enable,
            gdr_flush_disable,
            relaxed_ordering,
            query_port_speed,
            effective,
            warnings: r.warnings,
        })
    }

    /// One INFO line per knob the environment set, one line per knob at NCCL's TRACE (`debug`
    /// here), and one WARN per replaced value.
    pub fn log(&self) {
        for e in &self.effective {
            if let Some(line) = e.set_line() {
                log::info!(target: "init", "{line}");
            }
            let meaning = KNOBS.iter().find(|k| k.name == e.name).map_or("", |k| k.meaning);
            log::debug!("knob {}={} ({meaning})", e.name, e.value);
        }
        for w in &self.warnings {
            log::warn!("{w}");
        }
    }

    /// How long a transfer to a dead peer takes to fail by retries alone.
    pub fn retry_bound(&self) -> Duration {
        retry_bound(self.ib_timeout, self.ib_retry_cnt)
    }
}

/// 4.096 µs × 2^timeout × (retry + 1): the time to `IBV_WC_RETRY_EXC_ERR` on a dead path.
pub fn retry_bound(timeout: u8, retry: u8) -> Duration {
    Duration::from_nanos(4096 << timeout.min(31)) * (u32::from(retry) + 1)
}

/// Why a value is not an integer NCCL would accept.
#[derive(Debug, PartialEq, Eq)]
enum IntError {
    NotAnInteger,
    /// Beyond what any knob can hold.
    TooLarge,
}

/// An integer as C's `strtoll(s, NULL, 0)` reads it: an optional sign, then `0x`/`0X` and hex
/// digits, or `0` and octal digits, or decimal digits. Unlike `strtoll`, trailing text is an
/// error rather than ignored.
fn parse_int(s: &str) -> std::result::Result<i128, IntError> {
    let (neg, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (radix, digits) = if let Some(h) = body.strip_prefix("0x").or(body.strip_prefix("0X")) {
        (16, h)
    } else if body.len() > 1 && body.starts_with('0') {
        (8, &body[1..])
    } else {
        (10, body)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(IntError::NotAnInteger);
    }
    // Only digits are left: the one failure is overflow.
    let v = i128::from_str_radix(digits, radix).map_err(|_| IntError::TooLarge)?;
    Ok(if neg { -v } else { v })
}

/// A literal IP address, allowing an IPv6 zone (`fe80::1%eth0`): a GID has no zone, so it is
/// dropped.
fn parse_ip(s: &str) -> Option<IpAddr> {
    let addr = match s.split_once('%') {
        Some((a, zone)) if !zone.is_empty() && a.contains(':') => a,
        Some(_) => return None,
        None => s,
    };
    addr.parse().ok()
}

/// `NCCL_SOCKET_IFNAME`: NCCL's list syntax as for `NCCL_IB_HCA`, with names only.
fn parse_ifname(v: &str) -> Result<HcaFilter> {
    let bad = |why: String| Error::config("NCCL_SOCKET_IFNAME", v, why);
    let f = HcaFilter::parse(v).map_err(|e| bad(e.0))?;
    if f.entries.iter().any(|e| e.port.is_some() || e.rail.is_some() || e.plane.is_some()) {
        return Err(bad("expected interface names (e.g. eth0,eth1, =eth0 or ^docker,lo)".into()));
    }
    if f.entries.is_empty() {
        return Err(bad("names no interface".into()));
    }
    Ok(f)
}

fn parse_cidr(v: &str) -> Option<Cidr> {
    let (addr, len) = v.split_once('/')?;
    let addr: IpAddr = addr.trim().parse().ok()?;
    let len: u8 = len.trim().parse().ok()?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some(Cidr { addr, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(knob: &'static str, value: &'static str) -> Result<Config> {
        Config::from_lookup(move |k| (k == knob).then(|| value.to_string()))
    }

    fn with2(a: (&'static str, &'static str), b: (&'static str, &'static str)) -> Result<Config> {
        Config::from_lookup(move |k| {
            [a, b].iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults() {
        let d = Config::default();
        assert!(d.ib_hca.is_empty());
        assert_eq!(
            (d.ib_timeout, d.ib_retry_cnt, d.rnr_retry, d.gid_index, d.force_flush),
            (20, 7, 6, None, false)
        );
        assert_eq!(
            (d.qps_per_conn, d.split_data, d.sport_base, d.sport_range, d.sport_spread),
            (2, false, 49152, 16384, true)
        );
        assert_eq!(
            (d.repair_attempts, d.repair_delay, d.repair_timeout),
            (5, Duration::from_millis(200), Duration::from_secs(5))
        );
        assert_eq!(
            (d.tc, d.fifo_tc, d.sl, d.addr_family, d.roce_version),
            (None, None, None, Family::V4, 2)
        );
        assert_eq!(d.setup_timeout, Duration::from_secs(120));
        assert_eq!(d.probe_interval, Duration::from_secs(5));
        assert_eq!(d.stats_interval, None);
        let c = with("FERROCE_STATS_INTERVAL_S", "30").unwrap();
        assert_eq!(c.stats_interval, Some(Duration::from_secs(30)));
        // Statistics lines only where NCCL shows INFO lines.
        assert!(!d.stats);
        for (v, shown) in [("INFO", true), ("trace", true), ("WARN", false), ("VERSION", false)] {
            assert_eq!(with("NCCL_DEBUG", v).unwrap().stats, shown, "NCCL_DEBUG={v}");
        }
        assert_eq!((d.dmabuf_enable, d.gdr_flush_disable, d.relaxed_ordering), (true, false, 2));
        assert!(d.merge_vfs);
        assert!(!with("NCCL_IB_MERGE_VFS", "0").unwrap().merge_vfs);
        // 2 x (4.096 us x 2^20 x 8) + 10 s
        assert_eq!(d.progress_timeout.as_millis(), 2 * 34_359_738 / 1000 + 10_000);
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn every_knob_is_documented_and_reported() {
        let d = Config::default();
        let names: Vec<&str> = d.effective.iter().map(|e| e.name).collect();
        let documented: Vec<&str> = KNOBS.iter().map(|k| k.name).collect();
        assert_eq!(names, documented, "every knob read is in KNOBS, in order, and vice versa");
        for k in KNOBS {
            assert!(k.name.starts_with("NCCL_") || k.name.starts_with("FERROCE_"), "{}", k.name);
        }
    }

    #[test]
    fn only_knobs_the_environment_set_get_an_info_line() {
        let lines = |c: &Config| -> Vec<String> {
            c.effective.iter().filter_map(Effective::set_line).collect()
        };
        assert!(lines(&Config::default()).is_empty(), "{:?}", lines(&Config::default()));
        let c = with2(("NCCL_IB_TIMEOUT", " 0x14 "), ("NCCL_IB_QPS_PER_CONNECTION", "4")).unwrap();
        assert_eq!(
            lines(&c),
            [
                "NCCL_IB_TIMEOUT set by environment to 0x14, used as 20",
                "NCCL_IB_QPS_PER_CONNECTION set by environment to 4"
            ]
        );
        // An empty value is unset, as NCCL reads it.
        assert!(lines(&with("NCCL_IB_TIMEOUT", " ").unwrap()).is_empty());
        // A value replaced to keep waits bounded says what it became (and WARNs).
        let c = with("FERROCE_RNR_RETRY", "7").unwrap();
        assert_eq!(lines(&c), ["FERROCE_RNR_RETRY set by environment to 7, used as 6"]);
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    }

    #[test]
    fn the_readme_lists_every_knob() {
        let readme = include_str!("../README.md");
        for k in KNOBS {
            assert!(
                readme.contains(&format!("| `{}` |", k.name)),
                "README knob table lacks {}",
                k.name
            );
        }
    }

    #[test]
    fn malformed_values_name_the_knob() {
        for (k, v) in [
            ("NCCL_IB_HCA", "rxe0:x"),
            ("NCCL_IB_TIMEOUT", "ten"),
            ("NCCL_IB_RETRY_CNT", "8"),
            ("NCCL_IB_GID_INDEX", "256"),
            ("FERROCE_GID_INDEX", "rxe0"),
            ("FERROCE_GID_INDEX", "rxe0:x"),
            ("FERROCE_GID_IP", "10.0.0"),
            ("NCCL_IB_ADDR_RANGE", "10.0.0.0"),
            ("NCCL_IB_ADDR_RANGE", "10.0.0.0/33"),
            ("NCCL_IB_QPS_PER_CONNECTION", "0"),
            ("NCCL_IB_QPS_PER_CONNECTION", "129"),
            ("FERROCE_SPORT_BASE", "1000"),
            ("FERROCE_SETUP_TIMEOUT_MS", "0"),
            ("FERROCE_FORCE_FLUSH", "yes"),
            ("FERROCE_PROBE_INTERVAL_MS", "5"),
            ("FERROCE_STATS_INTERVAL_S", "86401"),
            ("NCCL_IB_PCI_RELAXED_ORDERING", "3"),
            ("NCCL_IB_MERGE_VFS", "yes"),
            ("NCCL_IB_SL", "high"),
            ("NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY", "soon"),
        ] {
            let e = with(k, v).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{k}={v}: {e}");
        }
        let e =
            with2(("FERROCE_SPORT_BASE", "65000"), ("FERROCE_SPORT_RANGE", "1000")).unwrap_err();
        assert!(e.to_string().contains("FERROCE_SPORT_RANGE"), "{e}");
    }

    #[test]
    fn nccls_knobs_take_every_integer_nccl_takes() {
        // On/off: any integer, and any but 0 is on.
        for (v, on) in [("2", true), ("-1", true), ("0x10", true), ("0", false)] {
            let c = with("NCCL_IB_MERGE_VFS", v).unwrap();
            assert_eq!(c.merge_vfs, on, "{v}");
            assert_eq!(with("NCCL_GDR_FLUSH_DISABLE", v).unwrap().gdr_flush_disable, on);
            assert_eq!(with("NCCL_DMABUF_ENABLE", v).unwrap().dmabuf_enable, on);
            assert_eq!(with("NCCL_IB_SPLIT_DATA_ON_QPS", v).unwrap().split_data, on);
        }
        assert!(!with("NCCL_IB_QUERY_PORT_SPEED", "0").unwrap().query_port_speed);
        assert!(Config::from_lookup(|_| None).unwrap().query_port_speed);
        // A service level or traffic class wider than the NIC's field: its low bits, and a WARN.
        for (k, v, want) in
            [("NCCL_IB_SL", "19", 3), ("NCCL_IB_SL", "16", 0), ("NCCL_IB_TC", "300", 44)]
        {
            let c = with(k, v).unwrap();
            assert_eq!(if k == "NCCL_IB_SL" { c.sl } else { c.tc }, Some(want), "{k}={v}");
            assert!(c.warnings[0].contains(&format!("{k}={v} is wider than")), "{:?}", c.warnings);
        }
        let c = with("NCCL_IB_SL", "15").unwrap();
        assert_eq!((c.sl, c.warnings.len()), (Some(15), 0));
        // What ferroce takes nothing from: accepted, one WARN naming it and why.
        let c = with("NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY", "10").unwrap();
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].starts_with(
            "NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY=10 is ignored by ferroce: "
        ));
        assert_eq!(
            with("NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", "1000").unwrap().repair_attempts,
            1000
        );
    }

    #[test]
    fn integers_are_read_as_nccl_reads_them() {
        assert_eq!(parse_int("0x68"), Ok(0x68));
        assert_eq!(parse_int("0X1f"), Ok(31));
        assert_eq!(parse_int("010"), Ok(8));
        assert_eq!(parse_int("0"), Ok(0));
        assert_eq!(parse_int("-1"), Ok(-1));
        assert_eq!(parse_int("+7"), Ok(7));
        for bad in ["", "-", "0x", "08", "1e3", "12abc", "0x1g", " 1", "--1", "1.0"] {
            assert_eq!(parse_int(bad), Err(IntError::NotAnInteger), "{bad:?}");
        }
        assert_eq!(parse_int(&"9".repeat(60)), Err(IntError::TooLarge));
        assert_eq!(with("NCCL_IB_TC", "0x68").unwrap().tc, Some(0x68));
        assert_eq!(with("NCCL_IB_TIMEOUT", "016").unwrap().ib_timeout, 14);
        assert_eq!(with("NCCL_IB_GID_INDEX", "0x3").unwrap().gid_index, Some(3));
        let c = with("FERROCE_GID_INDEX", "rxe0:0x3").unwrap();
        assert_eq!(c.gid_index_per_dev, vec![("rxe0".to_string(), 3)]);
        // Out of range says so, also past every integer type, and for negatives of unsigned.
        for (k, v) in [
            ("NCCL_IB_TIMEOUT", "99999999999999999999999999"),
            ("FERROCE_SETUP_TIMEOUT_MS", "-5"),
            ("NCCL_IB_QPS_PER_CONNECTION", "0201"), // octal 129
        ] {
            let e = with(k, v).unwrap_err().to_string();
            assert!(e.contains("out of range") && e.contains(k), "{k}={v}: {e}");
        }
        let e = with("NCCL_IB_TIMEOUT", "14s").unwrap_err().to_string();
        assert!(e.contains("not an integer"), "{e}");
    }

    #[test]
    fn socket_ifname_takes_nccls_list_syntax() {
        let f = with("NCCL_SOCKET_IFNAME", "eth,ib").unwrap().socket_ifname.unwrap();
        assert!(f.keeps("eth0") && f.keeps("ib1") && !f.keeps("docker0"));
        let f = with("NCCL_SOCKET_IFNAME", "=eth0").unwrap().socket_ifname.unwrap();
        assert!(f.keeps("eth0") && !f.keeps("eth01"));
        let f = with("NCCL_SOCKET_IFNAME", "^docker,lo").unwrap().socket_ifname.unwrap();
        assert!(f.keeps("eth0") && !f.keeps("docker0") && !f.keeps("lo"));
        let f = with("NCCL_SOCKET_IFNAME", "^=veth").unwrap().socket_ifname.unwrap();
        assert!(f.keeps("vethA") && !f.keeps("veth"));
        for bad in ["eth0:1", "^", "=^eth0"] {
            let e = with("NCCL_SOCKET_IFNAME", bad).unwrap_err().to_string();
            assert!(e.contains("NCCL_SOCKET_IFNAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn an_ipv6_zone_is_accepted_and_dropped() {
        let c = with("FERROCE_GID_IP", "fe80::1%vethA,10.0.0.1").unwrap();
        assert_eq!(
            c.gid_ips,
            vec!["fe80::1".parse::<IpAddr>().unwrap(), "10.0.0.1".parse().unwrap()]
        );
        for bad in ["10.0.0.1%eth0", "fe80::1%"] {
            assert!(with("FERROCE_GID_IP", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unbounded_waits_are_replaced_with_a_warning() {
        let c = with("NCCL_IB_TIMEOUT", "0").unwrap();
        assert_eq!(c.ib_timeout, 20);
        assert!(c.warnings[0].contains("NCCL_IB_TIMEOUT=0"), "{:?}", c.warnings);
        let c = with("NCCL_IB_TIMEOUT", "40").unwrap();
        assert_eq!((c.ib_timeout, c.warnings.len()), (20, 1));
        let c = with("FERROCE_RNR_RETRY", "7").unwrap();
        assert_eq!((c.rnr_retry, c.warnings.len()), (6, 1));
        // The explicit opt-in keeps them.
        let c = with2(("NCCL_IB_TIMEOUT", "0"), ("FERROCE_ALLOW_UNBOUNDED", "1")).unwrap();
        assert_eq!((c.ib_timeout, c.warnings.len()), (0, 0));
        let c = with2(("FERROCE_RNR_RETRY", "7"), ("FERROCE_ALLOW_UNBOUNDED", "1")).unwrap();
        assert_eq!(c.rnr_retry, 7);
    }

    #[test]
    fn timeout_knobs_never_tighten_what_was_asked_for() {
        // An unbounded ACK timeout, asked for, gets no derived progress deadline.
        let c = with2(("NCCL_IB_TIMEOUT", "0"), ("FERROCE_ALLOW_UNBOUNDED", "1")).unwrap();
        assert_eq!(c.progress_timeout, Duration::MAX);
        // A progress deadline below the retry bound is kept, with a WARN.
        let c = with2(("NCCL_IB_TIMEOUT", "20"), ("FERROCE_PROGRESS_TIMEOUT_MS", "1000")).unwrap();
        assert_eq!(c.progress_timeout, Duration::from_secs(1));
        assert!(c.warnings.iter().any(|w| w.contains("below the retry bound")), "{:?}", c.warnings);
        let c = with("FERROCE_PROGRESS_TIMEOUT_MS", "60000").unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn parses_the_other_knobs() {
        assert_eq!(with("NCCL_IB_TIMEOUT", " 14 ").unwrap().ib_timeout, 14);
        assert_eq!(with("NCCL_IB_GID_INDEX", "3").unwrap().gid_index, Some(3));
        let c = with("FERROCE_GID_INDEX", "rxe0:1, rxe1:3").unwrap();
        assert_eq!(c.gid_index_per_dev, [("rxe0".to_string(), 1), ("rxe1".to_string(), 3)]);
        assert_eq!(with("FERROCE_GID_NETDEV", "eth2,eth3").unwrap().gid_netdevs, ["eth2", "eth3"]);
        assert_eq!(with("NCCL_IB_ADDR_FAMILY", "AF_INET6").unwrap().addr_family, Family::V6);
        let c = with("NCCL_IB_ADDR_FAMILY", "inet6").unwrap();
        assert_eq!((c.addr_family, c.warnings.len()), (Family::V4, 1));
        let r = with("NCCL_IB_ADDR_RANGE", "198.18.0.0/24").unwrap().addr_range.unwrap();
        assert!(
            r.contains("198.18.0.7".parse().unwrap()) && !r.contains("198.19.0.7".parse().unwrap())
        );
        assert!(!r.contains("::1".parse().unwrap()));
        let r = with("NCCL_IB_ADDR_RANGE", "fd00::/8").unwrap().addr_range.unwrap();
        assert!(r.contains("fd12::1".parse().unwrap()) && !r.contains("fe80::1".parse().unwrap()));
        assert_eq!(with("NCCL_IB_TC", "106").unwrap().tc, Some(106));
        assert_eq!(with("NCCL_IB_SL", "3").unwrap().sl, Some(3));
        assert_eq!(
            with("FERROCE_PROGRESS_TIMEOUT_MS", "1500").unwrap().progress_timeout.as_millis(),
            1500
        );
        assert_eq!(retry_bound(14, 3).as_micros(), 268_435);
        // The stall floor: 250 ms at NCCL's timeouts, up to four ACK timeouts where those are
        // short.
        let stall = |c: Config| c.lane_stall.map(|d| d.as_millis());
        assert_eq!(stall(with("NCCL_IB_TIMEOUT", "20").unwrap()), Some(250));
        assert_eq!(stall(with("NCCL_IB_TIMEOUT", "18").unwrap()), Some(250));
        assert_eq!(stall(with("NCCL_IB_TIMEOUT", "17").unwrap()), Some(1073));
        assert_eq!(stall(with("NCCL_IB_TIMEOUT", "16").unwrap()), Some(1073));
        assert_eq!(stall(with("NCCL_IB_TIMEOUT", "14").unwrap()), Some(268));
        assert_eq!(stall(with("FERROCE_LANE_STALL_MS", "0").unwrap()), None);
        assert!(with("FERROCE_LANE_STALL_MS", "soon").is_err());
        let c = with("NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX", "0").unwrap();
        assert_eq!(c.repair_attempts, 0);
        let c = with("NCCL_IB_RESILIENCY_PORT_RECOVERY", "0").unwrap();
        assert_eq!((c.repair_attempts, c.failover), (0, true));
        let c = with("NCCL_IB_RESILIENCY_PORT_FAILOVER", "0").unwrap();
        assert_eq!((c.repair_attempts, c.failover), (0, false));
        assert!(Config::default().failover);
        let c = with("NCCL_IB_RESILIENCY_PORT_RECOVERY_START_DELAY", "50").unwrap();
        assert_eq!(c.repair_delay, Duration::from_millis(50));
        assert!(with("NCCL_IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT", "5").is_err());
    }
}
