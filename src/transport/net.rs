//! The plugin's shared state and its lifetime.
//!
//! NCCL ≥ 2.28 calls `init` once per communicator and `finalize` once per successful `init`,
//! and may `dlclose` the library after the last `finalize`. So the device state ([`Net`]) is
//! created by the first `init`, shared by every [`CommContext`], and released when the last
//! context is finalized: nothing outlives the last `finalize` except what comms still hold.
//! A later `init` discovers the devices afresh (same order, so device indices are stable).
//!
//! Older ABIs (v6–v10) call `init` once per load and never `finalize`; `ffi` keeps one context
//! for them for the life of the library.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::config::Config;
use crate::error::{Error, Result};

use super::device::{self, NetDevice};

/// The devices and configuration shared by every communicator.
pub struct Net {
    pub config: Config,
    pub devices: Vec<NetDevice>,
}

/// What `init` hands NCCL as `ctx`: one per communicator.
pub struct CommContext {
    pub net: Arc<Net>,
    pub comm_id: u64,
    /// From the v10+ communicator config; `None` when NCCL leaves it undefined.
    pub traffic_class: Option<u8>,
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
        let config = Config::from_env()?;
        config.log();
        let devices = device::discover(&config)?;
        for (i, d) in devices.iter().enumerate() {
            match &d.gid {
                Ok(g) => log::info!(
                    target: "init",
                    "device {i}: {} uses GID index {} ({}, {} on {}): {}",
                    d.name,
                    g.index,
                    std::net::Ipv6Addr::from(g.gid),
                    g.ip(),
                    g.netdev.as_deref().unwrap_or("?"),
                    g.why
                ),
                Err(e) => log::warn!("device {i}: {e}"),
            }
            log::info!(
                target: "init",
                "device {i}: {} port {} ({:?}), {} Mbps, active MTU {}, guid {:#018x}, max_qp {}, \
                 sysfs {}",
                d.name,
                d.port,
                d.link_layer,
                d.speed_mbps,
                device::mtu_bytes(d.active_mtu),
                d.guid,
                d.max_qp,
                d.pci_path.as_deref().unwrap_or("(none)")
            );
        }
        Ok(Net { config, devices })
    }

    pub fn device(&self, dev: i32) -> Result<&NetDevice> {
        usize::try_from(dev).ok().and_then(|d| self.devices.get(d)).ok_or_else(|| {
            Error::Internal(format!("device {dev} out of range (have {})", self.devices.len()))
        })
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
    Ok(CommContext { net, comm_id, traffic_class })
}

/// Ends a communicator context; the last one releases the shared device state.
pub fn finalize(ctx: CommContext) {
    drop(ctx);
    let mut reg = registry();
    reg.contexts = reg.contexts.saturating_sub(1);
    if reg.contexts == 0 {
        reg.net = None;
    }
}

/// The shared state, for calls that carry no context (`devices`, `getProperties`).
pub fn current() -> Result<Arc<Net>> {
    registry().net.clone().ok_or_else(|| Error::Internal("called before a successful init".into()))
}
