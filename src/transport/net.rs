//! The plugin's shared state and its lifetime.
//!
//! NCCL ≥ 2.28 calls `init` once per communicator and `finalize` once per successful `init`,
//! and may `dlclose` the library after the last `finalize`. So the device state ([`Net`]) is
//! created by the first `init`, shared by every [`CommContext`], and released when the last
//! context is finalized. Nothing outlives the last `finalize`: before the state is released,
//! `ffi` ends whatever NCCL left open (connects in progress, listeners, comms, registrations;
//! the `on_last` of [`finalize`]), which drops every other reference to it; the event thread
//! is stopped and joined whatever references remain, and the device contexts close with the
//! last reference. A later `init` discovers the devices afresh (same order, so device indices
//! are stable).
//!
//! Older ABIs (v6–v10) call `init` once per load and never `finalize`; `ffi` keeps one context
//! for them for the life of the library.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::config::Config;
use crate::error::{Error, Result};

use std::sync::atomic::{AtomicBool, Ordering};

use super::device::{self, DeviceFlags, NetDevice, Queue};
use super::gid::GidChoice;
use super::profile::Profiler;
use crate::verbs;
use ferroce_core::data::MAX_MEMBERS;

/// The devices and configuration shared by every communicator.
pub struct Net {
    pub config: Config,
    pub devices: Vec<NetDevice>,
    /// Stopped and joined at the last `finalize` (or when the state drops), so the library
    /// can be unloaded.
    events: Mutex<Option<EventThread>>,
}

impl Net {
    /// Stops and joins the event thread, if it runs.
    fn stop_events(&self) {
        let t = self.events.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            t.stop();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.stop_events();
    }
}

/// A port the event thread reports on: its number, its device's name, its flags.
type Watched = (u8, String, Arc<DeviceFlags>);

/// The one thread that reads the devices' asynchronous events: GID changes mark the GID stale
/// (new connections re-read the table), a fatal device error or a broken event fd marks the
/// device failed (and that fd is not polled again), an error on a queue pair or CQ fails the
/// comm that owns it, port state changes are logged. It wakes every 100 ms to see whether it
/// must stop.
struct EventThread {
    stop: Arc<AtomicBool>,
    /// Set by the thread itself as it starts, cleared as the last thing it does.
    running: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl EventThread {
    fn start(devices: &[NetDevice]) -> Result<EventThread> {
        // One entry per distinct context (ports of one device share its event queue).
        let mut watched: Vec<(Arc<verbs::Context>, Vec<Watched>)> = Vec::new();
        for d in devices {
            let entry = (d.port, d.name.clone(), d.flags.clone());
            match watched.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &d.ctx)) {
                Some((_, ports)) => ports.push(entry),
                None => {
                    d.ctx.async_nonblocking()?;
                    watched.push((d.ctx.clone(), vec![entry]));
                }
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let running = Arc::new(AtomicBool::new(true));
        let ran = running.clone();
        let handle = std::thread::Builder::new()
            .name("ferroce-events".into())
            .spawn(move || {
                // Indices into `watched` of the fds still polled.
                let mut live: Vec<usize> = (0..watched.len()).collect();
                while !stopping.load(Ordering::Acquire) {
                    let contexts: Vec<&verbs::Context> =
                        live.iter().map(|&i| &*watched[i].0).collect();
                    let mut broken = Vec::new();
                    for (i, ev) in verbs::wait_async(&contexts, 100) {
                        if matches!(ev, verbs::AsyncEvent::Broken(_)) {
                            broken.push(live[i]);
                        }
                        handle_event(&watched[live[i]].1, ev);
                    }
                    live.retain(|i| !broken.contains(i));
                }
                ran.store(false, Ordering::Release);
            })
            .map_err(|err| Error::Os {
                call: "thread spawn",
                err,
                context: "async events".into(),
            })?;
        Ok(EventThread { stop, running, handle })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let joined = self.handle.join();
        if joined.is_err() {
            log::warn!("the async-event thread panicked");
        }
        // Joined: the thread ran its last instruction (unless it panicked on the way).
        debug_assert!(joined.is_err() || !self.running.load(Ordering::Acquire));
    }
}

fn handle_event(ports: &[Watched], ev: verbs::AsyncEvent) {
    let device = ports.first().map_or("?", |p| p.1.as_str());
    use verbs::AsyncEvent::*;
    let on_port = |p: u8| ports.iter().filter(move |(port, _, _)| *port == p || p == 0);
    match ev {
        GidChange(p) => {
            for (_, name, flags) in on_port(p) {
                log::info!(
                    "{name}: GID table changed; new connections will choose their GID again"
                );
                flags.gid_stale.store(true, Ordering::Release);
            }
        }
        PortError(p) => {
            for (_, name, flags) in on_port(p) {
                flags.port_down.store(true, Ordering::Release);
                flags.news.fetch_add(1, Ordering::AcqRel);
                log::warn!(
                    "{name}: port went down (IBV_EVENT_PORT_ERR); check the link with `rdma link show`"
                );
            }
        }
        PortActive(p) => {
            for (_, name, flags) in on_port(p) {
                log::info!("{name}: port is ACTIVE again; its failed lanes are tried again");
                flags.port_down.store(false, Ordering::Release);
                flags.port_up.fetch_add(1, Ordering::AcqRel);
                flags.news.fetch_add(1, Ordering::AcqRel);
            }
        }
        DeviceFatal => {
            for (_, name, flags) in ports {
                log::warn!(
                    "{name}: fatal device error (IBV_EVENT_DEVICE_FATAL); its connections fail from now on"
                );
                flags.set_fatal("a fatal device error (IBV_EVENT_DEVICE_FATAL)".into());
            }
        }
        Broken(how) => {
            for (_, name, flags) in ports {
                log::warn!(
                    "{name}: its async event fd failed ({how}); the device is treated as gone: \
                     its connections fail from now on and its events are no longer read"
                );
                flags.set_fatal(format!("its async event fd failed ({how})"));
            }
        }
        QpError { qpn, what } => {
            let why = format!(
                "asynchronous {what} on queue pair {qpn:#x} of {device}: the queue pair is in the \
                 error state; see dmesg and `rdma resource show qp`"
            );
            raise(ports, Queue::Qp(qpn), why);
        }
        CqError { cq } => {
            let why = format!(
                "asynchronous CQ_ERR on {device}: the completion queue overran or failed; \
                 see dmesg"
            );
            raise(ports, Queue::Cq(cq), why);
        }
        Other(kind) => log::info!("async event {kind} on {device}"),
    }
}

/// Fails the comm that owns `queue` (whichever port of the context it is on) with one WARN.
fn raise(ports: &[Watched], queue: Queue, why: String) {
    match ports.iter().find_map(|(_, _, flags)| flags.raise(queue, why.clone())) {
        Some(comm) => log::warn!(
            "{comm}: {why}; a queue pair's lane fails over where another lane lives, else (and \
             for a completion queue) this connection fails from now on"
        ),
        None => log::warn!("{why} (no open connection owns it)"),
    }
}

/// What `init` hands NCCL as `ctx`: one per communicator.
pub struct CommContext {
    pub net: Arc<Net>,
    pub comm_id: u64,
    /// From the v10+ communicator config; `None` when NCCL leaves it undefined.
    pub traffic_class: Option<u8>,
    /// Where this communicator's profiler events go (v10+ `init`); set by `ffi`. A lock, not a
    /// field, because v10's one context takes the callback of each `init`.
    profiler: Mutex<Option<Arc<dyn Profiler>>>,
}

impl CommContext {
    pub fn set_profiler(&self, p: Option<Arc<dyn Profiler>>) {
        *self.profiler.lock().unwrap_or_else(|p| p.into_inner()) = p;
    }

    /// The profiler new comms report to: none without a callback or with
    /// `FERROCE_NET_PROFILER=0`.
    pub fn profiler(&self) -> Option<Arc<dyn Profiler>> {
        let p = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).clone();
        p.filter(|_| self.net.config.net_profiler)
    }
}

struct Registry {
    net: Option<Arc<Net>>,
    contexts: usize,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { net: None, contexts: 0 });

fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding the lock leaves consistent data (every update is one assignment),
    // so a poisoned lock is still usable.
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

impl Net {
    fn open() -> Result<Net> {
        log::info!(target: "init", "ferroce {}", env!("CARGO_PKG_VERSION"));
        let config = Config::from_env()?;
        config.log();
        let devices = device::discover(&config)?;
        // Only worth saying when there is a device to register memory with.
        log_memlock(crate::os::memlock_limit());
        for (i, d) in devices.iter().enumerate() {
            let gid = d.gid(&config).map_err(|e| match e {
                Error::NoDevice(why) => why,
                other => other.to_string(),
            });
            log_device(i, d, &gid);
        }
        let events = Mutex::new(Some(EventThread::start(&devices)?));
        Ok(Net { config, devices, events })
    }

    pub fn device(&self, dev: i32) -> Result<&NetDevice> {
        usize::try_from(dev).ok().and_then(|d| self.devices.get(d)).ok_or_else(|| {
            Error::InvalidUsage(format!("device {dev} out of range (have {})", self.devices.len()))
        })
    }

    /// NCCL's devices: the physical ports, then the fused devices `makeVDevice` made.
    pub fn ndevices(&self) -> usize {
        self.devices.len() + fused().len()
    }

    /// The member ports (indices of physical devices) of NCCL device `dev`: itself, or the
    /// ports of a fused device.
    pub fn members(&self, dev: i32) -> Result<Vec<usize>> {
        let n = self.devices.len();
        let out_of_range =
            || Error::InvalidUsage(format!("device {dev} out of range (have {})", self.ndevices()));
        let d = usize::try_from(dev).map_err(|_| out_of_range())?;
        if d < n {
            return Ok(vec![d]);
        }
        // The lock is let go before `out_of_range` takes it again.
        let members = fused().get(d - n).cloned();
        let members = members.ok_or_else(out_of_range)?;
        resolve(&members, &self.ports()).map_err(|gone| {
            Error::InvalidUsage(format!(
                "fused device {dev}'s port {gone} is gone since it was made (a new init found \
                 other ports)"
            ))
        })
    }

    /// Each physical port's identity: its name and verbs port.
    fn ports(&self) -> Vec<PortId> {
        self.devices.iter().map(|d| (d.name.clone(), d.port)).collect()
    }

    /// `makeVDevice`: one NCCL device over the ports `devs` ([`fusion`] says which may
    /// fuse). The same ports asked again give the same device; a single port is itself.
    pub fn make_vdevice(&self, devs: &[i32]) -> Result<i32> {
        let n = self.devices.len();
        let layers: Vec<_> = self.devices.iter().map(|d| d.link_layer).collect();
        let members = fusion(devs, &layers, self.config.merge_nics)?;
        if let [one] = members[..] {
            return Ok(one as i32);
        }
        let id = |m: &usize| (self.devices[*m].name.clone(), self.devices[*m].port);
        let ids: Vec<PortId> = members.iter().map(id).collect();
        let mut fused = fused();
        let index = match fused.iter().position(|f| *f == ids) {
            Some(i) => i,
            None => {
                fused.push(ids);
                fused.len() - 1
            }
        };
        let dev = (n + index) as i32;
        let names: Vec<&str> = members.iter().map(|&m| self.devices[m].name.as_str()).collect();
        log::info!(target: "init", "device {dev}: {} fuses ports {members:?}", names.join("+"));
        Ok(dev)
    }
}

/// The ports `devs` of a fused device, as NCCL's IB transport allows them: 1 to
/// [`MAX_MEMBERS`] distinct physical ports (of `layers`, each port's link layer) of one link
/// layer, and more than one only with `NCCL_IB_MERGE_NICS=1` (`merge`).
fn fusion<L: PartialEq + std::fmt::Debug>(
    devs: &[i32],
    layers: &[L],
    merge: bool,
) -> Result<Vec<usize>> {
    let refuse = |why: String| Err(Error::InvalidUsage(format!("makeVDevice {devs:?}: {why}")));
    if devs.is_empty() || devs.len() > MAX_MEMBERS {
        return refuse(format!("a fused device has 1 to {MAX_MEMBERS} ports"));
    }
    if devs.len() > 1 && !merge {
        return refuse("NCCL_IB_MERGE_NICS=0".into());
    }
    let n = layers.len();
    let mut members = Vec::with_capacity(devs.len());
    for &d in devs {
        match usize::try_from(d).ok().filter(|&d| d < n) {
            Some(d) if !members.contains(&d) => members.push(d),
            Some(_) => return refuse(format!("port {d} given twice")),
            None => return refuse(format!("{d} is not a port (have {n})")),
        }
    }
    if let Some(&m) = members.iter().find(|&&m| layers[m] != layers[members[0]]) {
        return refuse(format!(
            "port {} is {:?} and port {m} is {:?}: ports of one link layer only; NCCL_IB_HCA \
             can select them",
            members[0], layers[members[0]], layers[m]
        ));
    }
    Ok(members)
}

/// A physical port by what names it across a new discovery: its device name and verbs port.
type PortId = (String, u8);

/// The fused devices `makeVDevice` made, by their index after the physical ports: each one's
/// member ports, by identity. They outlive the device state (NCCL makes them once per process
/// and keeps using their numbers across `finalize` and `init`); a new `init` may number the
/// ports otherwise, or miss one, so they are found again by name ([`resolve`]).
static FUSED: Mutex<Vec<Vec<PortId>>> = Mutex::new(Vec::new());

/// The indices in `ports` of a fused device's `members`, or the first member not there (then
/// the device is an error, never other ports).
fn resolve(members: &[PortId], ports: &[PortId]) -> std::result::Result<Vec<usize>, String> {
    members
        .iter()
        .map(|m| ports.iter().position(|p| p == m).ok_or_else(|| format!("{} {}", m.0, m.1)))
        .collect()
}

fn fused() -> MutexGuard<'static, Vec<Vec<PortId>>> {
    FUSED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A port's one INFO line at init: the port, the GID it uses and why (a WARN instead when it
/// has none), and what memory it takes; the details (and why GPUDirect is what it is) at
/// NCCL's TRACE.
fn log_device(i: usize, d: &NetDevice, gid: &std::result::Result<GidChoice, String>) {
    let port = format!(
        "{} port {}, {:?} {} Mbps, MTU {}",
        d.name,
        d.port,
        d.link_layer,
        d.speed_mbps,
        device::mtu_bytes(d.active_mtu)
    );
    let gdr = format!("GPUDirect RDMA {} (`ferroce doctor` says why)", d.gdr.ptr_names());
    match gid {
        Ok(g) => log::info!(target: "init", "device {i}: {port}, {}; {gdr}", device::gid_words(g)),
        Err(e) => log::warn!("device {i}: {port}: no usable GID: {e}"),
    }
    log::debug!(
        "device {i}: {} guid {:#018x}, max_qp {}, sysfs {}",
        d.name,
        d.guid,
        d.max_qp,
        d.pci_path.as_deref().unwrap_or("(none)")
    );
    log::debug!("device {i}: {} {}", d.name, d.gdr.why);
    if let Some(w) = &d.gdr.warning {
        log::warn!("device {i}: {}: {w}", d.name);
    }
}

/// The locked-memory limit at init: INFO when it is not unlimited, WARN when it is so low that
/// registering NCCL's buffers is likely to fail.
fn log_memlock(limit: Option<u64>) {
    match limit {
        Some(b) if b < crate::os::MEMLOCK_MIN => {
            log::warn!("{} (below 64 MiB)", crate::os::memlock_hint(limit))
        }
        Some(_) => log::info!(target: "init", "{}", crate::os::memlock_hint(limit)),
        None => {}
    }
}

/// Creates a communicator context, discovering the devices if no other context is alive.
pub fn init(comm_id: u64, traffic_class: i32) -> Result<CommContext> {
    let traffic_class = match traffic_class {
        -1 => None,
        tc => Some(u8::try_from(tc).map_err(|_| {
            Error::config("ncclConfig_t.trafficClass", &tc.to_string(), "must be -1 or 0..=255")
        })?),
    };
    let mut reg = registry();
    let net = match &reg.net {
        Some(net) => net.clone(),
        None => {
            let net = Arc::new(Net::open()?);
            reg.net = Some(net.clone());
            net
        }
    };
    reg.contexts += 1;
    Ok(CommContext { net, comm_id, traffic_class, profiler: Mutex::new(None) })
}

/// Ends a communicator context. The last one runs `on_last` (which ends what still holds the
/// device state) and releases the state, all under the registry's lock, so a concurrent
/// `init` waits for the old state to be gone before it opens a new one.
pub fn finalize(ctx: Arc<CommContext>, on_last: impl FnOnce()) {
    // A call still inside on another thread keeps its own reference until it returns.
    drop(ctx);
    let mut reg = registry();
    reg.contexts = reg.contexts.saturating_sub(1);
    if reg.contexts > 0 {
        return;
    }
    on_last();
    if let Some(net) = reg.net.take() {
        release(net);
    }
}

/// Lets go of the device state: the event thread stops now, and the devices close with the
/// last reference, which, once `ffi` has ended everything, is this one.
fn release(net: Arc<Net>) {
    net.stop_events();
    let others = Arc::strong_count(&net) - 1;
    if others > 0 {
        log::warn!(
            "finalize: {others} reference(s) to the device state remain (see the WARN above); \
             its devices stay open until they go"
        );
    }
}

/// The shared state, for calls that carry no context (`devices`, `getProperties`).
pub fn current() -> Result<Arc<Net>> {
    registry().net.clone().ok_or_else(|| Error::Internal("called before a successful init".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::AsyncEvent;

    fn ports() -> Vec<Watched> {
        let flags = || Arc::new(DeviceFlags::default());
        vec![(1, "mlx5_0".into(), flags()), (2, "mlx5_0_2".into(), flags())]
    }

    /// What `makeVDevice` fuses and what it refuses, each refusal saying why.
    #[test]
    fn fusion_takes_distinct_ports_of_one_link_layer() {
        let layers = ["eth", "eth", "eth", "ib", "eth", "eth", "eth", "eth", "eth", "eth"];
        assert_eq!(fusion(&[1, 0], &layers, true).unwrap(), vec![1, 0]);
        let eight = [0, 1, 2, 4, 5, 6, 7, 8];
        assert_eq!(fusion(&eight, &layers, true).unwrap(), vec![0, 1, 2, 4, 5, 6, 7, 8], "v12's 8");
        assert_eq!(fusion(&[2], &layers, false).unwrap(), vec![2], "one port needs no merging");
        let refused = |devs: &[i32], merge: bool| match fusion(devs, &layers, merge) {
            Err(Error::InvalidUsage(why)) => why,
            other => panic!("{devs:?}: {other:?}"),
        };
        assert!(refused(&[0, 1], false).contains("NCCL_IB_MERGE_NICS=0"));
        assert!(refused(&[], true).contains("1 to 8 ports"));
        assert!(refused(&[0, 1, 2, 4, 5, 6, 7, 8, 9], true).contains("1 to 8 ports"));
        assert!(refused(&[0, 0], true).contains("given twice"));
        assert!(refused(&[0, 10], true).contains("10 is not a port"));
        assert!(refused(&[-1, 0], true).contains("-1 is not a port"));
        assert!(refused(&[0, 3], true).contains("one link layer"));
    }

    #[test]
    fn a_fused_device_finds_its_ports_by_name_after_a_new_discovery() {
        let id = |n: &str, p: u8| (n.to_string(), p);
        let members = [id("mlx5_1", 1), id("mlx5_3", 1)];
        let before = [id("mlx5_0", 1), id("mlx5_1", 1), id("mlx5_2", 1), id("mlx5_3", 1)];
        assert_eq!(resolve(&members, &before), Ok(vec![1, 3]));
        // mlx5_0 is gone at the next init: the others move down, and the device follows them.
        assert_eq!(resolve(&members, &before[1..]), Ok(vec![0, 2]));
        // A member gone: an error naming it, never the port now at its old index.
        let without = [id("mlx5_0", 1), id("mlx5_2", 1), id("mlx5_3", 1), id("mlx5_4", 1)];
        assert_eq!(resolve(&members, &without), Err("mlx5_1 1".into()));
    }

    #[test]
    fn finalize_joins_the_event_thread_before_it_returns() {
        // The one thread the plugin starts: `stop` (what the last finalize and a dropped
        // state call) returns only once the thread has run its last instruction, so nothing
        // of the plugin runs when NCCL unloads it. (Its /proc/self/task entry may linger a
        // moment longer: tests that count threads wait for the count to settle.)
        for _ in 0..20 {
            let t = EventThread::start(&[]).expect("start");
            let running = t.running.clone();
            t.stop();
            assert!(!running.load(Ordering::Acquire), "the event thread outlived its join");
        }
        let net = Net {
            config: Config::from_lookup(|_| None).expect("defaults"),
            devices: Vec::new(),
            events: Mutex::new(Some(EventThread::start(&[]).expect("start"))),
        };
        let lock = net.events.lock().unwrap();
        let running = lock.as_ref().map(|t| t.running.clone()).expect("started");
        drop(lock);
        drop(net);
        assert!(!running.load(Ordering::Acquire), "a dropped state left its thread running");
    }

    #[test]
    fn queue_errors_reach_their_comm_and_a_broken_fd_the_device() {
        let ports = ports();
        let watch = ports[1].2.watch("send comm to peer".into(), vec![Queue::Qp(0x11)]);
        handle_event(&ports, AsyncEvent::QpError { qpn: 0x11, what: "QP_FATAL" });
        let (qpn, why) = watch.alarm.lanes.pop().expect("the owner's lane error is queued");
        assert!(qpn == 0x11 && why.contains("QP_FATAL") && why.contains("0x11"), "{why}");
        // An error on a queue no comm owns fails nothing.
        handle_event(&ports, AsyncEvent::QpError { qpn: 0x12, what: "QP_REQ_ERR" });
        handle_event(&ports, AsyncEvent::CqError { cq: 0x99 });
        assert!(ports.iter().all(|p| !p.2.fatal.load(Ordering::Acquire)));
        handle_event(&ports, AsyncEvent::Broken("POLLHUP (the device went away)".into()));
        for p in &ports {
            assert!(p.2.fatal.load(Ordering::Acquire));
            assert!(p.2.fatal_why.get().unwrap().contains("POLLHUP"));
        }
    }
}
