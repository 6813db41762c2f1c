//! Device discovery: every (RDMA device, ACTIVE port) that `NCCL_IB_HCA` keeps becomes one NCCL
//! net device, in a stable order (device name, then port) so that every rank numbers its
//! devices the same way.
//!
//! What NCCL's topology search is told about each device (`pciPath`, `port`, `speed`) follows
//! NCCL's own IB transport exactly ([`nccl_places`], [`nccl_speed_mbps`]), so NCCL places and
//! weighs ferroce's NICs as it would its own.
//!
//! When nothing is usable, discovery fails with one message that says why (no device at all,
//! everything filtered out by `NCCL_IB_HCA`, or no ACTIVE port), so NCCL's fallback to another
//! transport is explained instead of silent.

use crossbeam_queue::ArrayQueue;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::gdr::{self, Gdr};
use super::gid::{self, GidChoice, GidEntry, GidType};
use super::mr_cache::MrCache;
use crate::config::Config;
use crate::config::hca::HcaFilter;
use crate::error::{Error, Result};
use crate::verbs::{self, FastMap, LinkLayer, Mr, Pd, PortState};

/// One NCCL net device: a port of an RDMA device.
pub struct NetDevice {
    /// The name NCCL sees: its RDMA device's, as NCCL's own transport names it, so the ports
    /// of a dual-port device share it and `NCCL_NET_FORCE_MERGE` tells them apart by NCCL's
    /// port (`mlx5_0:1,mlx5_0:3`).
    pub name: String,
    /// The verbs port number, which the QPs are set up on.
    pub port: u8,
    /// The port number NCCL is told: `port` plus the earlier devices on the same card (see
    /// [`nccl_places`]).
    pub nccl_port: i32,
    pub ctx: Arc<verbs::Context>,
    pub guid: u64,
    /// As NCCL's IB transport computes it ([`nccl_speed_mbps`]).
    pub speed_mbps: i32,
    pub max_qp: i32,
    pub link_layer: LinkLayer,
    pub active_mtu: u32,
    pub max_msg_sz: u32,
    /// The pciPath NCCL is told: the card's merged PCI path, or the device's own sysfs dir when
    /// it has no PCI parent (see [`read_places`]).
    pub pci_path: Option<String>,
    pub rail: Option<i16>,
    pub plane: Option<i16>,
    /// The protection domain every comm on this device shares.
    pub pd: Arc<Pd>,
    /// The GID new connections use, or why there is none; re-chosen after a GID change.
    gid: Mutex<Result<GidChoice, String>>,
    /// Set by the async-event thread; read by every connection setup and data-path call.
    pub flags: Arc<DeviceFlags>,
    /// Registrations shared by every comm on this device.
    pub mrs: Mutex<MrCache<Arc<Mr>>>,
    /// What GPU memory it registers (GPUDirect RDMA), decided at discovery.
    pub gdr: Gdr,
    /// The port's hardware counters as last read, and when ([`NetDevice::hw_counters`]).
    counters: Mutex<Option<(Duration, Arc<Counters>)>>,
}

/// A port's hardware counters by name.
pub type Counters = Vec<(String, u64)>;

/// How long one read of a port's hardware counters serves: the comms that open or close
/// together (an all-to-all's setup, thousands of comms) share one read of a few dozen sysfs
/// files. A comm's statistics line reports what moved over its life, so one that lives less
/// than this may report that nothing did.
const COUNTERS_FRESH: Duration = Duration::from_millis(100);

/// What the async-event thread reports about a device.
#[derive(Debug, Default)]
pub struct DeviceFlags {
    /// The port's GID table changed: the next connection re-reads it.
    pub gid_stale: AtomicBool,
    /// How many times the port came back (`IBV_EVENT_PORT_ACTIVE`): comms try their lanes on
    /// it again.
    pub port_up: AtomicU64,
    /// The port went down (`IBV_EVENT_PORT_ERR`) and has not come back.
    pub port_down: AtomicBool,
    /// Counts what a comm's progress loop must see at once: the port going down or coming
    /// back, a comm's queue failing (its alarm raised), the device failing. Bumped after the
    /// change, so a loop that sees a new count sees the change; until the count moves, a loop
    /// reads none of them (the idle run, once per `IDLE_EVERY`, still checks the device and
    /// the comm's whole-comm alarm).
    pub news: AtomicU64,
    /// The device reported `IBV_EVENT_DEVICE_FATAL`, or its event fd broke: every later call
    /// fails.
    pub fatal: AtomicBool,
    /// Why, when `fatal` is set.
    pub fatal_why: OnceLock<String>,
    /// The comms on this device, by the queues an async error can name.
    alarms: Mutex<FastMap<Queue, Arc<Alarm>>>,
}

/// A queue an asynchronous error event names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Queue {
    /// A queue pair, by number.
    Qp(u32),
    /// A completion queue, by [`verbs::Cq::id`].
    Cq(usize),
}

/// Raised by the async-event thread when one of a comm's queues fails (`QP_FATAL`,
/// `QP_REQ_ERR`, `QP_ACCESS_ERR`, `CQ_ERR`); the comm's progress loop reads it.
#[derive(Debug)]
pub struct Alarm {
    /// The comm, for the WARN: e.g. "send comm to 198.18.0.2:4000".
    pub comm: String,
    /// What fails the whole comm: its CQ failed, or more queue pairs than `lanes` holds.
    pub raised: OnceLock<String>,
    /// Queue pairs that failed, with why: the comm takes each for a lane failure (it fails
    /// the comm only if no lane is left).
    pub lanes: ArrayQueue<(u32, String)>,
}

/// Queue-pair errors a comm's alarm holds until its progress loop takes them.
const LANE_ERRORS: usize = 8;

/// A comm's registration in its device's alarm table; dropping it unregisters the comm.
pub struct Watch {
    flags: Arc<DeviceFlags>,
    pub alarm: Arc<Alarm>,
    /// The queues it registered (lane repair swaps one): what its drop takes out, without a
    /// walk of every comm's on the device.
    queues: Mutex<Vec<Queue>>,
}

impl Watch {
    /// Its device's count of news ([`DeviceFlags::news`]).
    #[inline]
    pub fn news(&self) -> u64 {
        self.flags.news.load(Ordering::Acquire)
    }

    /// Lane repair replaced queue `old` with `new`: `new` is watched instead, and an error of
    /// `old` still waiting in the alarm is nobody's any more (dropped).
    pub fn swap(&self, old: Queue, new: Queue) {
        let mut alarms = self.flags.alarms.lock().unwrap_or_else(|p| p.into_inner());
        if alarms.get(&old).is_some_and(|a| Arc::ptr_eq(a, &self.alarm)) {
            alarms.remove(&old);
        }
        alarms.insert(new, self.alarm.clone());
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.retain(|q| *q != old);
        queues.push(new);
        // No raise can push meanwhile: it holds the table's lock.
        for _ in 0..self.alarm.lanes.len() {
            match self.alarm.lanes.pop() {
                Some((qpn, _)) if Queue::Qp(qpn) == old => {}
                Some(e) => {
                    let _ = self.alarm.lanes.push(e);
                }
                None => break,
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut alarms = self.flags.alarms.lock().unwrap_or_else(|p| p.into_inner());
        let queues = self.queues.get_mut().unwrap_or_else(|p| p.into_inner());
        for q in queues.iter() {
            // Only its own entries: a queue number may already be reused by a newer comm.
            if alarms.get(q).is_some_and(|a| Arc::ptr_eq(a, &self.alarm)) {
                alarms.remove(q);
            }
        }
    }
}

impl DeviceFlags {
    /// Registers a comm's queues, so an async error on any of them raises its alarm.
    pub fn watch(self: &Arc<Self>, comm: String, queues: Vec<Queue>) -> Watch {
        let alarm =
            Arc::new(Alarm { comm, raised: OnceLock::new(), lanes: ArrayQueue::new(LANE_ERRORS) });
        let mut alarms = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
        for q in &queues {
            alarms.insert(*q, alarm.clone());
        }
        drop(alarms);
        Watch { flags: self.clone(), alarm, queues: Mutex::new(queues) }
    }

    /// Raises the alarm of the comm that owns `queue` with `why`: a queue pair's error goes
    /// to its lanes (the whole alarm if they are full), a CQ's to the whole. The comm's name,
    /// if one does (the queue may belong to a comm being closed, or to nothing of ours).
    pub fn raise(&self, queue: Queue, why: String) -> Option<String> {
        let alarms = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
        let alarm = alarms.get(&queue)?;
        let whole = match queue {
            Queue::Qp(qpn) => alarm.lanes.push((qpn, why)).err().map(|(_, why)| why),
            Queue::Cq(_) => Some(why),
        };
        if let Some(why) = whole {
            let _ = alarm.raised.set(why);
        }
        self.news.fetch_add(1, Ordering::AcqRel);
        Some(alarm.comm.clone())
    }

    /// Marks the device failed (the first reason is kept).
    pub fn set_fatal(&self, why: String) {
        let _ = self.fatal_why.set(why);
        self.fatal.store(true, Ordering::Release);
        self.news.fetch_add(1, Ordering::AcqRel);
    }
}

/// The queue pairs one comm uses with `qps_per_conn` per connection
/// (`NCCL_IB_QPS_PER_CONNECTION`): a send comm has that many, a receive comm as many plus the
/// loopback flush QP on a device that flushes. Counted as the larger, so that any mix of send
/// and receive comms fits.
pub fn qps_per_comm(qps_per_conn: usize, flush: bool) -> usize {
    qps_per_conn.max(1) + usize::from(flush)
}

/// `maxComms` for NCCL: how many comms the device's `max_qp` holds at [`qps_per_comm`] each.
pub fn max_comms(max_qp: i32, qps_per_conn: usize, flush: bool) -> i32 {
    let per = i32::try_from(qps_per_comm(qps_per_conn, flush)).unwrap_or(i32::MAX);
    max_qp.max(0) / per
}

impl NetDevice {
    /// What NCCL is told as this device's `maxComms` (see [`max_comms`]).
    pub fn max_comms(&self, qps_per_conn: usize) -> i32 {
        max_comms(self.max_qp, qps_per_conn, self.gdr.flush)
    }

    /// The GID for a new connection, re-chosen first if the table changed.
    pub fn gid(&self, config: &Config) -> Result<GidChoice> {
        let mut gid = self.gid.lock().unwrap_or_else(|p| p.into_inner());
        if self.flags.gid_stale.swap(false, Ordering::AcqRel) {
            *gid = choose_gid(&self.name, &self.ctx, self.port, self.link_layer, config);
            log_gid(&self.name, &gid, "after a GID table change");
        }
        gid.clone().map_err(Error::NoDevice)
    }

    /// The port's hardware counters, read again when the last read is older than
    /// [`COUNTERS_FRESH`].
    pub fn hw_counters(&self) -> Arc<Counters> {
        let now = crate::os::coarse_now();
        let mut last = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        match &*last {
            Some((at, c)) if now.saturating_sub(*at) < COUNTERS_FRESH => c.clone(),
            _ => {
                let c = Arc::new(verbs::sysfs::hw_counters(self.ctx.name(), self.port));
                *last = Some((now, c.clone()));
                c
            }
        }
    }

    /// An error if the device has failed fatally.
    pub fn check_alive(&self) -> Result<()> {
        if self.flags.fatal.load(Ordering::Acquire) {
            let why = self.flags.fatal_why.get().map_or("a fatal device error", |w| w.as_str());
            return Err(Error::Local(format!(
                "{} failed: {why}; see dmesg and `rdma link show`",
                self.name
            )));
        }
        Ok(())
    }
}

/// Reads the port's GID table and chooses from it; the error is the reason as text.
fn choose_gid(
    name: &str,
    ctx: &verbs::Context,
    port: u8,
    link: LinkLayer,
    config: &Config,
) -> Result<GidChoice, String> {
    let len = ctx.query_port(port).map(|pa| pa.gid_tbl_len).map_err(|e| e.to_string())?;
    let table = gid_table(ctx, port, len);
    gid::choose(name, &table, config, link == LinkLayer::Ethernet).map_err(|e| match e {
        Error::NoDevice(why) => why,
        other => other.to_string(),
    })
}

/// Which GID a port uses and why, in words.
pub fn gid_words(g: &GidChoice) -> String {
    format!(
        "GID index {} ({}, {} on {}): {}",
        g.index,
        std::net::Ipv6Addr::from(g.gid),
        g.ip(),
        g.netdev.as_deref().unwrap_or("?"),
        g.why
    )
}

/// One line that says which GID a device uses and why (INFO), or why it has none (WARN).
fn log_gid(name: &str, gid: &Result<GidChoice, String>, when: &str) {
    match gid {
        Ok(g) => log::info!(target: "init", "{name} uses {} {when}", gid_words(g)),
        Err(e) => log::warn!("{name} {when}: {e}"),
    }
}

/// What selection needs to know about one port; filled from verbs, or by tests.
#[derive(Clone, Debug)]
pub struct PortInfo {
    pub dev: String,
    pub port: u8,
    pub state: PortState,
    pub link_layer: LinkLayer,
}

/// A usable port: its index in the list given to [`select`] and its `NCCL_IB_HCA` tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selected {
    pub index: usize,
    pub rail: Option<i16>,
    pub plane: Option<i16>,
}

/// Picks the usable ports, or says why there are none.
pub fn select(ports: &[PortInfo], filter: &HcaFilter) -> Result<Vec<Selected>> {
    if ports.is_empty() {
        return Err(Error::NoDevice(
            "no RDMA devices found (is the RDMA driver loaded? Soft-RoCE: `rdma link add rxe0 \
             type rxe netdev <ifname>`)"
                .into(),
        ));
    }
    let kept: Vec<_> = ports
        .iter()
        .enumerate()
        .filter_map(|(i, p)| filter.select(&p.dev, p.port.into()).map(|e| (i, e)))
        .collect();
    if kept.is_empty() {
        let all: Vec<_> = ports.iter().map(|p| format!("{}:{}", p.dev, p.port)).collect();
        return Err(Error::NoDevice(format!(
            "every device was filtered out by NCCL_IB_HCA={} (available: {})",
            filter.raw,
            all.join(", ")
        )));
    }
    let usable: Vec<_> = kept
        .iter()
        .filter(|(i, _)| {
            let p = &ports[*i];
            p.state == PortState::Active && !matches!(p.link_layer, LinkLayer::Unspecified(_))
        })
        .map(|(i, e)| Selected {
            index: *i,
            rail: e.and_then(|e| e.rail),
            plane: e.and_then(|e| e.plane),
        })
        .collect();
    if usable.is_empty() {
        let states: Vec<_> = kept
            .iter()
            .map(|(i, _)| {
                let p = &ports[*i];
                format!("{}:{} is {}", p.dev, p.port, describe(p))
            })
            .collect();
        return Err(Error::NoDevice(format!(
            "no ACTIVE port ({}); check the link with `rdma link show` and `ip link`",
            states.join(", ")
        )));
    }
    Ok(usable)
}

fn describe(p: &PortInfo) -> String {
    match (p.state, p.link_layer) {
        (PortState::Active, LinkLayer::Unspecified(l)) => format!("ACTIVE with link layer {l}"),
        (PortState::Active, _) => "ACTIVE".into(),
        (PortState::Other(1), _) => "DOWN".into(),
        (PortState::Other(2), _) => "INIT".into(),
        (PortState::Other(3), _) => "ARMED".into(),
        (PortState::Other(s), _) => format!("in state {s}"),
    }
}

/// Per-lane rate in Mbps of the verbs speed codes, by their lowest set bit: SDR, DDR, QDR,
/// FDR10, FDR, EDR, HDR, NDR, XDR.
const LANE_MBPS: [i32; 9] = [2500, 5000, 10000, 10000, 14000, 25000, 50000, 100000, 200000];
/// Lanes of the verbs width codes, by their lowest set bit: 1x, 4x, 8x, 12x, 2x.
const LANES: [i32; 5] = [1, 4, 8, 12, 2];

/// NCCL's index into a table of `len` entries for a verbs code: its lowest set bit among bits
/// 0..len-2; any other code (0, or only higher bits) takes the last entry.
pub fn nccl_table_index(code: u32, len: usize) -> usize {
    (code.trailing_zeros() as usize).min(len - 1)
}

/// The port speed in Mbps, as NCCL's IB transport computes it: from `ibv_query_port_speed` (in
/// units of 100 Mb/s) where the library has it and it succeeded, else per-lane rate × lanes,
/// the rate coded by `active_speed_ex` when non-zero, else by `active_speed`.
pub fn nccl_speed_mbps(
    port_speed_100mbps: Option<u64>,
    active_speed_ex: u32,
    active_speed: u8,
    active_width: u8,
) -> i32 {
    if let Some(s) = port_speed_100mbps {
        return i32::try_from(s.saturating_mul(100)).unwrap_or(i32::MAX);
    }
    let code = if active_speed_ex != 0 { active_speed_ex } else { active_speed.into() };
    LANE_MBPS[nccl_table_index(code, LANE_MBPS.len())]
        * LANES[nccl_table_index(active_width.into(), LANES.len())]
}

/// Where NCCL's topology search places a net device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclPlace {
    /// The `pciPath` NCCL is told.
    pub pci_path: Option<String>,
    /// The `port` NCCL is told.
    pub port: i32,
}

/// What NCCL's IB transport reports for each of `devs` (verbs port, realpath of the device's
/// `device` link), given in NCCL's device order:
/// - the path with its last character (the PCI function digit) set to `0`, so the ports and
///   PFs of one card share a path; with `merge_vfs` also the two device digits before the
///   `.`, so its VFs do too;
/// - the verbs port plus the number of earlier devices on the same card, so the ports of one
///   card stay distinct. Paths match on all but their last 4 characters with `merge_vfs`, else
///   all but the last. A device with no path counts for none.
pub fn nccl_places(devs: &[(u8, Option<&str>)], merge_vfs: bool) -> Vec<NcclPlace> {
    let paths: Vec<Option<String>> =
        devs.iter().map(|(_, p)| p.map(|p| merge_pci_path(p, merge_vfs))).collect();
    let keep = if merge_vfs { 4 } else { 1 };
    paths
        .iter()
        .zip(devs)
        .enumerate()
        .map(|(i, (path, (port, _)))| {
            let earlier = path.as_deref().map_or(0, |p| {
                let n = p.len().saturating_sub(keep);
                paths[..i]
                    .iter()
                    .flatten()
                    .filter(|q| q.as_bytes().get(..n) == Some(&p.as_bytes()[..n]))
                    .count()
            });
            NcclPlace { pci_path: path.clone(), port: i32::from(*port) + earlier as i32 }
        })
        .collect()
}

/// `…/0000:3b:01.3` → `…/0000:3b:01.0`, or `…/0000:3b:00.0` with `merge_vfs`.
fn merge_pci_path(path: &str, merge_vfs: bool) -> String {
    let mut b = path.as_bytes().to_vec();
    let n = b.len();
    let digits: &[usize] = if merge_vfs { &[1, 3, 4] } else { &[1] };
    for &back in digits.iter().filter(|&&back| back <= n) {
        b[n - back] = b'0';
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// [`nccl_places`] for `devs` (RDMA device, verbs port), reading each device's PCI function
/// under the sysfs `root`. A device without one (rxe, siw) is where NCCL's own transport
/// reports no path; it gets its own sysfs directory instead, unmerged, counted for no other
/// device: one path per software device, and ports that stay their verbs ports.
pub fn read_places(root: &Path, devs: &[(String, u8)], merge_vfs: bool) -> Vec<NcclPlace> {
    let text = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
    let pci: Vec<Option<String>> =
        devs.iter().map(|(dev, _)| verbs::sysfs::pci_function(root, dev).map(text)).collect();
    let input: Vec<(u8, Option<&str>)> =
        devs.iter().zip(&pci).map(|((_, port), p)| (*port, p.as_deref())).collect();
    let mut places = nccl_places(&input, merge_vfs);
    for (place, (dev, _)) in places.iter_mut().zip(devs) {
        if place.pci_path.is_none() {
            place.pci_path = verbs::sysfs::device_dir(root, dev).map(text);
        }
    }
    places
}

/// NCCL's sort key of a device, from the realpath of its PCI function: the hex digits of the
/// path's last component (`0000:3b:00.1` → 0x3b001), as NCCL's `pciPathToInt64` reads them;
/// `None` without a path (software devices), which NCCL orders last.
pub fn nccl_pci_key(path: Option<&str>) -> Option<i64> {
    let last = path?.trim_end_matches('/').rsplit('/').next()?;
    let hex: String = last
        .chars()
        .filter(|&c| c != '.' && c != ':')
        .take_while(char::is_ascii_hexdigit)
        .take(16)
        .collect();
    Some(i64::from_str_radix(&hex, 16).unwrap_or(0))
}

/// The order NCCL numbers `devs` (RDMA device, port) in with `NCCL_IB_DEVICE_PCI_ORDER` (its
/// default): by [`nccl_pci_key`] of each device's PCI function under the sysfs `root`, devices
/// without one last, ties (ports of one device, software devices) in name order. So device
/// indices, and the ports NCCL is told, match NCCL's own transport on every node, even where
/// name order differs (`mlx5_10` before `mlx5_2`).
pub fn pci_order(root: &Path, devs: &[(String, u8)]) -> Vec<usize> {
    let keys: Vec<Option<i64>> = devs
        .iter()
        .map(|(dev, _)| {
            let path = verbs::sysfs::pci_function(root, dev);
            nccl_pci_key(path.as_deref().and_then(Path::to_str))
        })
        .collect();
    let mut order: Vec<usize> = (0..devs.len()).collect();
    order.sort_by_key(|&i| (keys[i].is_none(), keys[i]));
    order
}

/// Opens the RDMA devices and returns the usable ports as NCCL devices.
pub fn discover(config: &Config) -> Result<Vec<NetDevice>> {
    let (ports, found) = open_ports(config)?;
    let mut usable = select(&ports, &config.ib_hca)?;
    let root = Path::new(verbs::sysfs::ROOT);
    let key = |s: &Selected| (ports[s.index].dev.clone(), ports[s.index].port);
    if config.pci_order {
        let keys: Vec<_> = usable.iter().map(key).collect();
        usable = pci_order(root, &keys).into_iter().map(|i| usable[i].clone()).collect();
    }
    let keys: Vec<_> = usable.iter().map(key).collect();
    let names: Vec<String> = keys.iter().map(|(dev, _)| dev.clone()).collect();
    let places = read_places(root, &keys, config.merge_vfs);
    let devices = usable
        .into_iter()
        .zip(names)
        .zip(places)
        .map(|((sel, name), place)| net_device(&found[sel.index], sel, name, place, config))
        .collect::<Result<Vec<_>>>()?;
    warn_unused_gid_indices(config, &devices);
    Ok(devices)
}

/// An open port: its device, the device's attributes, its number and its attributes.
struct Found {
    ctx: Arc<verbs::Context>,
    attr: verbs::DeviceAttr,
    port: u8,
    pa: verbs::PortAttr,
}

/// Opens the devices `NCCL_IB_HCA` may keep (warning about names in it that match none) and
/// lists every port of each, with what [`select`] needs to know about it.
fn open_ports(config: &Config) -> Result<(Vec<PortInfo>, Vec<Found>)> {
    let (all, opened) = verbs::open_all(|name| config.ib_hca.may_keep(name))?;
    let names: Vec<&str> = all.iter().map(String::as_str).collect();
    for typo in config.ib_hca.unmatched(&names) {
        log::warn!(
            "NCCL_IB_HCA={}: {typo:?} matches no RDMA device (devices: {})",
            config.ib_hca.raw,
            if names.is_empty() { "none".into() } else { names.join(", ") }
        );
    }
    if opened.is_empty() && !all.is_empty() {
        return Err(Error::NoDevice(format!(
            "every device was filtered out by NCCL_IB_HCA={} (available: {})",
            config.ib_hca.raw,
            all.join(", ")
        )));
    }
    let (mut ports, mut found) = (Vec::new(), Vec::new());
    for ctx in opened {
        let ctx = match ctx {
            Ok(c) => Arc::new(c),
            Err(e) => {
                log::warn!("skipping device: {e}");
                continue;
            }
        };
        let attr = ctx.query_device()?;
        for port in 1..=attr.phys_port_cnt {
            let pa = ctx.query_port(port)?;
            let (state, link_layer) = (pa.state, pa.link_layer);
            ports.push(PortInfo { dev: ctx.name().to_string(), port, state, link_layer });
            found.push(Found { ctx: ctx.clone(), attr: attr.clone(), port, pa });
        }
    }
    Ok((ports, found))
}

/// The NCCL device of the selected port `found`, named `name` and placed at `place`: its GID
/// chosen, its protection domain made and its GPU memory support probed.
fn net_device(
    found: &Found,
    sel: Selected,
    name: String,
    place: NcclPlace,
    config: &Config,
) -> Result<NetDevice> {
    let Found { ctx, attr, port, pa } = found;
    let port = *port;
    let gid = choose_gid(&name, ctx, port, pa.link_layer, config);
    let pd = Pd::new(ctx)?;
    Ok(NetDevice {
        gdr: gpudirect(&pd, config),
        pd,
        gid: Mutex::new(gid),
        flags: Arc::default(),
        mrs: Mutex::new(MrCache::new(crate::os::page_size())),
        counters: Mutex::new(None),
        pci_path: place.pci_path,
        name,
        port,
        nccl_port: place.port,
        speed_mbps: nccl_speed_mbps(
            config.query_port_speed.then(|| ctx.query_port_speed(port)).flatten(),
            pa.active_speed_ex,
            pa.active_speed,
            pa.active_width,
        ),
        ctx: ctx.clone(),
        guid: attr.sys_image_guid,
        max_qp: attr.max_qp,
        link_layer: pa.link_layer,
        active_mtu: pa.active_mtu,
        max_msg_sz: pa.max_msg_sz,
        rail: sel.rail,
        plane: sel.plane,
    })
}

/// A WARN for each `FERROCE_GID_INDEX` entry that names no device in use.
fn warn_unused_gid_indices(config: &Config, devices: &[NetDevice]) {
    for (dev, index) in &config.gid_index_per_dev {
        if !devices.iter().any(|d| &d.name == dev) {
            let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
            log::warn!(
                "FERROCE_GID_INDEX: {dev:?} (index {index}) names no device in use (devices: {})",
                names.join(", ")
            );
        }
    }
}

/// Probes what the device can do with GPU memory (see [`gdr`]); peer memory is looked for
/// under the real `/`.
fn gpudirect(pd: &Arc<Pd>, config: &Config) -> Gdr {
    let peer = gdr::peer_memory(std::path::Path::new("/"));
    let ro = match (config.relaxed_ordering, verbs::SYMBOLS.reg_mr_iova2) {
        (0, _) => Some(false), // not asked for: no probe registration
        (_, None) => None,
        (_, Some(_)) => Some(pd.accepts_relaxed_ordering()),
    };
    gdr::decide(peer.as_deref(), pd.probe_dmabuf(), ro, config)
}

/// The non-empty entries of a port's GID table, with their type and interface from sysfs.
pub fn gid_table(ctx: &verbs::Context, port: u8, len: i32) -> Vec<GidEntry> {
    (0..len.clamp(0, 256))
        .filter_map(|i| {
            let raw = ctx.query_gid(port, i).ok()?;
            if raw.iter().all(|&b| b == 0) {
                return None;
            }
            let kind = match verbs::sysfs::gid_type(ctx.name(), port, i).as_deref() {
                Some("RoCE v2") => GidType::RoceV2,
                Some("IB/RoCE v1") | Some("RoCE v1") => GidType::RoceV1,
                _ => GidType::Unknown,
            };
            let netdev = verbs::sysfs::gid_netdev(ctx.name(), port, i);
            Some(GidEntry { index: u8::try_from(i).ok()?, gid: raw, kind, netdev })
        })
        .collect()
}

/// The MTU in bytes of an `ibv_mtu` enum value.
pub fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) { 128 << mtu } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `maxComms` counts every QP a comm uses, not one: a receive comm with 4 QPs per
    /// connection and the flush QP takes 5 of the device's `max_qp`.
    #[test]
    fn max_comms_counts_every_queue_pair_of_a_comm() {
        assert_eq!(qps_per_comm(1, false), 1);
        assert_eq!(qps_per_comm(1, true), 2);
        assert_eq!(qps_per_comm(4, true), 5);
        assert_eq!(max_comms(131_072, 1, false), 131_072);
        assert_eq!(max_comms(131_072, 1, true), 65_536);
        assert_eq!(max_comms(131_072, 4, true), 26_214);
        assert_eq!(max_comms(100, 128, true), 0, "not even one comm fits");
        assert_eq!(max_comms(-1, 2, false), 0);
        assert_eq!(max_comms(i32::MAX, 0, false), i32::MAX, "a QP count below 1 counts as 1");
    }

    fn port(dev: &str, port: u8, active: bool) -> PortInfo {
        PortInfo {
            dev: dev.into(),
            port,
            state: if active { PortState::Active } else { PortState::Other(1) },
            link_layer: LinkLayer::Ethernet,
        }
    }

    fn filter(v: &str) -> HcaFilter {
        HcaFilter::parse(v).unwrap()
    }

    #[test]
    fn an_async_error_raises_the_alarm_of_the_comm_that_owns_the_queue() {
        let flags = Arc::new(DeviceFlags::default());
        let a = flags.watch("send comm to a".into(), vec![Queue::Qp(7), Queue::Cq(0x1000)]);
        let b = flags.watch("receive comm from b".into(), vec![Queue::Qp(8)]);
        assert_eq!(flags.raise(Queue::Qp(9), "x".into()), None, "no comm owns QP 9");
        assert_eq!(flags.news.load(Ordering::Acquire), 0, "nobody's error is no comm's news");
        assert_eq!(flags.raise(Queue::Cq(0x1000), "CQ_ERR".into()).unwrap(), "send comm to a");
        // The comms' progress loops read their alarms only once the news count moves.
        assert_eq!(flags.news.load(Ordering::Acquire), 1);
        assert_eq!(a.alarm.raised.get().unwrap(), "CQ_ERR");
        assert!(b.alarm.raised.get().is_none(), "only the owner is failed");
        // A queue pair's error is a lane's, for the comm to take; the first cause is kept.
        flags.raise(Queue::Qp(7), "QP_FATAL".into());
        assert_eq!(a.alarm.raised.get().unwrap(), "CQ_ERR");
        assert_eq!(a.alarm.lanes.pop(), Some((7, "QP_FATAL".to_string())));
        // More lane errors than the hand-off holds fail the whole comm (the cap, abused).
        for i in 0..=LANE_ERRORS {
            flags.raise(Queue::Qp(8), format!("QP_FATAL {i}"));
        }
        assert_eq!(b.alarm.lanes.len(), LANE_ERRORS);
        assert_eq!(b.alarm.raised.get().unwrap(), &format!("QP_FATAL {LANE_ERRORS}"));
        // A closed comm is unregistered, but not a newer comm that reuses its QP number.
        drop(a);
        let c = flags.watch("send comm to c".into(), vec![Queue::Qp(8)]);
        drop(b);
        assert_eq!(flags.raise(Queue::Qp(8), "QP_ACCESS_ERR".into()).unwrap(), "send comm to c");
        assert_eq!(c.alarm.lanes.pop().unwrap().1, "QP_ACCESS_ERR");
        assert_eq!(flags.raise(Queue::Cq(0x1000), "x".into()), None);
        // Lane repair swaps a queue pair: the new one is watched, the old one's waiting error
        // is dropped, and a later error of the old one is nobody's.
        flags.raise(Queue::Qp(8), "QP_FATAL old".into());
        c.swap(Queue::Qp(8), Queue::Qp(9));
        assert!(c.alarm.lanes.is_empty(), "the old QP's error is gone");
        assert_eq!(flags.raise(Queue::Qp(8), "late".into()), None);
        assert_eq!(flags.raise(Queue::Qp(9), "QP_FATAL new".into()).unwrap(), "send comm to c");
        assert_eq!(c.alarm.lanes.pop().unwrap(), (9, "QP_FATAL new".to_string()));
        drop(c);
        assert!(flags.alarms.lock().unwrap().is_empty());
    }

    #[test]
    fn no_devices_says_so() {
        let e = select(&[], &HcaFilter::default()).unwrap_err().to_string();
        assert!(e.contains("no RDMA devices"), "{e}");
    }

    #[test]
    fn all_filtered_names_the_filter() {
        let ports = [port("rxe0", 1, true), port("rxe1", 1, true)];
        let e = select(&ports, &filter("mlx5")).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_HCA=mlx5") && e.contains("rxe0:1, rxe1:1"), "{e}");
    }

    #[test]
    fn no_active_port_names_the_state() {
        let ports = [port("rxe0", 1, false), port("rxe1", 1, true)];
        let e = select(&ports, &filter("rxe0")).unwrap_err().to_string();
        assert!(e.contains("no ACTIVE port") && e.contains("rxe0:1 is DOWN"), "{e}");
    }

    #[test]
    fn inactive_and_unknown_link_layers_are_skipped() {
        let mut odd = port("x0", 1, true);
        odd.link_layer = LinkLayer::Unspecified(0);
        let ports = [port("rxe0", 1, false), port("rxe1", 1, true), odd];
        let got = select(&ports, &HcaFilter::default()).unwrap();
        assert_eq!(got, vec![Selected { index: 1, rail: None, plane: None }]);
    }

    #[test]
    fn rail_and_plane_come_from_the_filter() {
        let ports = [port("mlx5_0", 1, true)];
        assert_eq!(
            select(&ports, &filter("mlx5_0:1:2:3")).unwrap(),
            vec![Selected { index: 0, rail: Some(2), plane: Some(3) }]
        );
    }

    #[test]
    fn speed_is_what_nccl_computes() {
        // ibv_query_port_speed, in units of 100 Mb/s, wins over the port attributes.
        assert_eq!(nccl_speed_mbps(Some(4000), 0x100, 0, 2), 400000);
        // XDR is only in active_speed_ex (bit 8); 4x.
        assert_eq!(nccl_speed_mbps(None, 0x100, 0, 2), 800000);
        // active_speed_ex, when set, wins over active_speed.
        assert_eq!(nccl_speed_mbps(None, 32, 64, 2), 100000);
        assert_eq!(nccl_speed_mbps(None, 0, 128, 2), 400000); // NDR 4x
        assert_eq!(nccl_speed_mbps(None, 0, 128, 16), 200000); // NDR 2x
        assert_eq!(nccl_speed_mbps(None, 0, 64, 2), 200000); // HDR 4x
        assert_eq!(nccl_speed_mbps(None, 0, 32, 2), 100000); // EDR 4x
        assert_eq!(nccl_speed_mbps(None, 0, 32, 8), 300000); // EDR 12x
        assert_eq!(nccl_speed_mbps(None, 0, 8, 1), 10000); // FDR10 1x (rxe on a 10G veth)
        assert_eq!(nccl_speed_mbps(None, 0, 4, 1), 10000); // QDR 1x
        assert_eq!(nccl_speed_mbps(None, 0, 1, 1), 2500); // SDR 1x
        // Unknown codes take the last entry: XDR per lane, 2 lanes.
        assert_eq!(nccl_speed_mbps(None, 0, 0, 1), 200000);
        assert_eq!(nccl_speed_mbps(None, 0x200, 0, 2), 800000);
        assert_eq!(nccl_speed_mbps(None, 0, 1, 0), 5000);
        assert_eq!(nccl_speed_mbps(None, 0, 1, 32), 5000);
    }

    #[test]
    fn one_card_with_two_ports_in_one_function_reports_ports_1_and_3() {
        let p = "/sys/devices/pci0000:00/0000:00:02.0/0000:3b:00.0";
        let got = nccl_places(&[(1, Some(p)), (2, Some(p))], true);
        let port = |port| NcclPlace { pci_path: Some(p.into()), port };
        assert_eq!(got, [port(1), port(3)]);
        // NCCL has no path for a device without a `device` link, and counts it for none.
        let got = nccl_places(&[(1, None), (1, None)], true);
        assert_eq!(
            got,
            [NcclPlace { pci_path: None, port: 1 }, NcclPlace { pci_path: None, port: 1 }]
        );
    }

    /// A sysfs tree under a fresh temporary directory, removed on drop.
    struct FakeSys(std::path::PathBuf);

    impl FakeSys {
        fn new(tag: &str) -> FakeSys {
            let root =
                std::env::temp_dir().join(format!("ferroce-sysfs-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("class/infiniband")).unwrap();
            // Canonical, so expected paths compare with realpaths.
            FakeSys(std::fs::canonicalize(root).unwrap())
        }

        /// `dev` is a PCI device at function `f` (e.g. `0000:3b:00.1`).
        fn pci(&self, dev: &str, f: &str) -> &Self {
            let function = self.0.join("devices/pci0000:00/0000:00:02.0").join(f);
            let dir = self.0.join("class/infiniband").join(dev);
            std::fs::create_dir_all(&function).unwrap();
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::symlink(function, dir.join("device")).unwrap();
            self
        }

        /// `dev` is a software device (no `device` link), as rxe is.
        fn software(&self, dev: &str) -> &Self {
            let dir = self.0.join("devices/virtual/infiniband").join(dev);
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::symlink(dir, self.0.join("class/infiniband").join(dev)).unwrap();
            self
        }

        fn places(&self, devs: &[(&str, u8)], merge_vfs: bool) -> Vec<(String, i32)> {
            let devs: Vec<(String, u8)> = devs.iter().map(|(d, p)| (d.to_string(), *p)).collect();
            read_places(&self.0, &devs, merge_vfs)
                .into_iter()
                .map(|p| {
                    let path = p.pci_path.unwrap();
                    let rel = path.strip_prefix(&*self.0.to_string_lossy()).unwrap().to_string();
                    (rel, p.port)
                })
                .collect()
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn place(path: &str, port: i32) -> (String, i32) {
        (path.to_string(), port)
    }

    /// The place of a port of the PCI function `f` that [`FakeSys::pci`] made.
    fn card(f: &str, port: i32) -> (String, i32) {
        place(&format!("/devices/pci0000:00/0000:00:02.0/{f}"), port)
    }

    #[test]
    fn devices_take_nccls_pci_order_not_their_name_order() {
        // Name order puts mlx5_10 before mlx5_2; NCCL sorts by the PCI function's bus id.
        let sys = FakeSys::new("order");
        sys.pci("mlx5_2", "0000:3b:00.0")
            .pci("mlx5_10", "0000:d8:00.0")
            .pci("mlx5_3", "0000:3b:00.1")
            .software("rxe0");
        let devs: Vec<(String, u8)> =
            [("mlx5_10", 1), ("mlx5_2", 1), ("mlx5_2", 2), ("mlx5_3", 1), ("rxe0", 1)]
                .iter()
                .map(|(d, p)| (d.to_string(), *p))
                .collect();
        let order = pci_order(&sys.0, &devs);
        let names: Vec<String> =
            order.iter().map(|&i| format!("{}:{}", devs[i].0, devs[i].1)).collect();
        assert_eq!(names, ["mlx5_2:1", "mlx5_2:2", "mlx5_3:1", "mlx5_10:1", "rxe0:1"]);
        assert_eq!(
            nccl_pci_key(Some("/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0/")),
            Some(0x2000)
        );
        assert_eq!(nccl_pci_key(Some("/x/0001:af:1f.7")), Some(0x1af1f7));
        assert_eq!(nccl_pci_key(None), None);
    }

    #[test]
    fn the_two_pfs_of_a_dual_port_card_share_its_pci_path_and_number_their_ports() {
        let sys = FakeSys::new("dual-pf");
        sys.pci("mlx5_0", "0000:3b:00.0")
            .pci("mlx5_1", "0000:3b:00.1")
            .pci("mlx5_2", "0000:5e:00.0");
        let devs = [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2", 1)];
        let want = [card("0000:3b:00.0", 1), card("0000:3b:00.0", 2), card("0000:5e:00.0", 1)];
        assert_eq!(sys.places(&devs, true), want);
        assert_eq!(sys.places(&devs, false), want);
    }

    #[test]
    fn vfs_merge_into_their_card_unless_nccl_ib_merge_vfs_is_0() {
        let sys = FakeSys::new("vf");
        sys.pci("mlx5_0", "0000:3b:00.0")
            .pci("mlx5_2", "0000:3b:00.2")
            .pci("mlx5_3", "0000:3b:01.3");
        let devs = [("mlx5_0", 1), ("mlx5_2", 1), ("mlx5_3", 1)];
        // Merged, the VF on function 01.3 is the card's third port; unmerged, its own first.
        let (merged, own) = ("0000:3b:00.0", "0000:3b:01.0");
        let third = |vf, port| [card(merged, 1), card(merged, 2), card(vf, port)];
        assert_eq!(sys.places(&devs, true), third(merged, 3));
        assert_eq!(sys.places(&devs, false), third(own, 1));
    }

    #[test]
    fn a_software_device_reports_its_own_sysfs_dir_unmerged_and_its_verbs_port() {
        // NCCL's own transport would report no pciPath here; see read_places.
        let sys = FakeSys::new("rxe");
        sys.software("rxe0").software("rxe1").pci("mlx5_0", "0000:3b:00.1");
        let devs = [("mlx5_0", 1), ("rxe0", 1), ("rxe1", 1)];
        assert_eq!(
            sys.places(&devs, true),
            [
                card("0000:3b:00.0", 1),
                place("/devices/virtual/infiniband/rxe0", 1),
                place("/devices/virtual/infiniband/rxe1", 1),
            ]
        );
    }

    #[test]
    fn mtu_enum_to_bytes() {
        assert_eq!([1, 2, 3, 4, 5, 0, 6].map(mtu_bytes), [256, 512, 1024, 2048, 4096, 0, 0]);
    }
}
