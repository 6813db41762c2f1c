//! GPUDirect RDMA: which GPU memory a device can register, decided once per device at init.
//!
//! - Peer memory (`NCCL_PTR_CUDA`): a kernel module (nvidia-peermem, or the older nv_peer_mem)
//!   lets `ibv_reg_mr` pin GPU pointers. It is present when one of [`PEER_MEMORY_FILES`] exists.
//! - dma-buf (`NCCL_PTR_DMABUF`): the RDMA driver registers a GPU buffer exported as a dma-buf
//!   fd. A probe with fd -1 fails with EBADF on a capable driver, EOPNOTSUPP/EPROTONOSUPPORT
//!   otherwise. `NCCL_DMABUF_ENABLE=0` turns it off, as in NCCL.
//! - The flush: a receive that landed in GPU memory is made visible to the GPU by an RDMA read
//!   on a loopback QP, which only devices that can do GPUDirect create
//!   (`NCCL_GDR_FLUSH_DISABLE=1` off, `FERROCE_FORCE_FLUSH=1` always).
//! - Relaxed ordering (`NCCL_IB_PCI_RELAXED_ORDERING`) for the MRs of NCCL's buffers.
//!
//! [`decide`] is pure: (files present, probe answers, knobs) in, the decision and its reason out.
//! Callers: `device` (discovery) and the INFO line of `net`.

use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::verbs::DmabufProbe;

/// Any one of these (relative to the sysfs root's parent, normally `/`) means peer memory.
pub const PEER_MEMORY_FILES: [&str; 3] = [
    "sys/kernel/mm/memory_peers/nv_mem/version",
    "sys/kernel/mm/memory_peers/nv_mem_nc/version",
    "sys/module/nvidia_peermem/version",
];

/// The first peer-memory file that exists under `root`.
pub fn peer_memory(root: &Path) -> Option<PathBuf> {
    PEER_MEMORY_FILES.iter().map(|f| root.join(f)).find(|p| p.exists())
}

/// What one device can do with GPU memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gdr {
    /// `regMr` takes GPU pointers (`NCCL_PTR_CUDA`).
    pub cuda: bool,
    /// `regMrDmaBuf` works (`NCCL_PTR_DMABUF`).
    pub dmabuf: bool,
    /// Receive comms get the loopback flush QP.
    pub flush: bool,
    /// Registrations of NCCL's buffers carry `IBV_ACCESS_RELAXED_ORDERING`.
    pub relaxed_ordering: bool,
    /// One line: the result and why, for the INFO line and `ferroce info`.
    pub why: String,
    /// A knob that asked for something this device cannot do.
    pub warning: Option<String>,
}

impl Gdr {
    /// `HOST`, `HOST|CUDA`, `HOST|DMABUF` or `HOST|CUDA|DMABUF`.
    pub fn ptr_names(&self) -> String {
        let mut s = String::from("HOST");
        if self.cuda {
            s += "|CUDA";
        }
        if self.dmabuf {
            s += "|DMABUF";
        }
        s
    }
}

fn errno_name(e: i32) -> String {
    match e {
        libc::EOPNOTSUPP => "EOPNOTSUPP".into(),
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT".into(),
        libc::EBADF => "EBADF".into(),
        0 => "success".into(),
        e => format!("errno {e}"),
    }
}

/// The decision for one device.
///
/// `peer`: the peer-memory file found, if any. `dmabuf`: the probe's answer. `ro_accepted`:
/// whether a registration with relaxed ordering succeeded (`None`: libibverbs lacks
/// `ibv_reg_mr_iova2`).
pub fn decide(
    peer: Option<&Path>,
    dmabuf: DmabufProbe,
    ro_accepted: Option<bool>,
    config: &Config,
) -> Gdr {
    let mut why = Vec::new();
    let cuda = peer.is_some();
    why.push(match peer {
        Some(f) => format!("peer memory: {} exists", f.display()),
        None => format!(
            "no peer memory (none of /{} exists; load nvidia-peermem)",
            PEER_MEMORY_FILES.join(", /")
        ),
    });
    let capable = match dmabuf {
        DmabufProbe::NoSymbol => {
            why.push("dma-buf: libibverbs lacks ibv_reg_dmabuf_mr (rdma-core < 34)".into());
            false
        }
        DmabufProbe::Errno(e) if e == libc::EOPNOTSUPP || e == libc::EPROTONOSUPPORT => {
            why.push(format!(
                "dma-buf: the ibv_reg_dmabuf_mr probe answered {} (the driver or kernel cannot \
                 register dma-bufs; kernel >= 5.12 and a capable driver are needed)",
                errno_name(e)
            ));
            false
        }
        DmabufProbe::Errno(e) => {
            why.push(format!("dma-buf: the ibv_reg_dmabuf_mr probe answered {}", errno_name(e)));
            true
        }
    };
    let dmabuf = capable && config.dmabuf_enable;
    if capable && !config.dmabuf_enable {
        why.push("dma-buf off by NCCL_DMABUF_ENABLE=0".into());
    }
    let gpu = cuda || dmabuf;
    let flush = config.force_flush || (gpu && !config.gdr_flush_disable);
    why.push(
        match (flush, gpu) {
            (true, true) => "flush: RDMA read after each GPU receive",
            (true, false) => "flush: forced by FERROCE_FORCE_FLUSH=1",
            (false, true) => "flush: off by NCCL_GDR_FLUSH_DISABLE=1",
            (false, false) => "flush: not needed (no GPU memory)",
        }
        .into(),
    );
    let mut warning = None;
    let relaxed_ordering = match (config.relaxed_ordering, ro_accepted) {
        (0, _) => {
            why.push("relaxed ordering off (NCCL_IB_PCI_RELAXED_ORDERING=0)".into());
            false
        }
        (_, Some(true)) => {
            why.push(
                "relaxed ordering on (the provider accepts IBV_ACCESS_RELAXED_ORDERING)".into(),
            );
            true
        }
        (mode, accepted) => {
            let reason = match accepted {
                None => "libibverbs lacks ibv_reg_mr_iova2",
                _ => "the provider refuses IBV_ACCESS_RELAXED_ORDERING",
            };
            why.push(format!("relaxed ordering off ({reason})"));
            if mode == 1 {
                warning = Some(format!(
                    "NCCL_IB_PCI_RELAXED_ORDERING=1 cannot be honoured: {reason}; registering \
                     with strict ordering"
                ));
            }
            false
        }
    };
    let mut g = Gdr { cuda, dmabuf, flush, relaxed_ordering, why: String::new(), warning };
    g.why = format!("GPUDirect RDMA {}: {}", g.ptr_names(), why.join("; "));
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knobs(vars: &[(&'static str, &'static str)]) -> Config {
        let vars = vars.to_vec();
        Config::from_lookup(move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
            .unwrap()
    }

    const EBADF: DmabufProbe = DmabufProbe::Errno(libc::EBADF);
    const NOTSUP: DmabufProbe = DmabufProbe::Errno(libc::EOPNOTSUPP);

    #[test]
    fn plain_rxe_is_host_only_and_says_why() {
        let g = decide(None, NOTSUP, Some(true), &Config::default());
        assert_eq!((g.cuda, g.dmabuf, g.flush), (false, false, false));
        assert_eq!(g.ptr_names(), "HOST");
        assert!(g.why.contains("no peer memory") && g.why.contains("EOPNOTSUPP"), "{}", g.why);
        assert!(g.why.contains("/sys/module/nvidia_peermem/version"), "{}", g.why);
        let g = decide(None, DmabufProbe::Errno(libc::EPROTONOSUPPORT), None, &Config::default());
        assert!(!g.dmabuf && g.why.contains("EPROTONOSUPPORT"), "{}", g.why);
    }

    #[test]
    fn each_source_adds_its_pointer_type() {
        let peer = Path::new("/sys/module/nvidia_peermem/version");
        let g = decide(Some(peer), NOTSUP, None, &Config::default());
        assert_eq!(
            (g.cuda, g.dmabuf, g.flush, g.ptr_names().as_str()),
            (true, false, true, "HOST|CUDA")
        );
        let g = decide(None, EBADF, None, &Config::default());
        assert_eq!((g.cuda, g.dmabuf, g.flush), (false, true, true));
        assert!(g.why.contains("EBADF"), "{}", g.why);
        let g = decide(Some(peer), EBADF, None, &Config::default());
        assert_eq!(g.ptr_names(), "HOST|CUDA|DMABUF");
    }

    #[test]
    fn a_libibverbs_without_the_symbol_is_unsupported() {
        let g = decide(None, DmabufProbe::NoSymbol, None, &Config::default());
        assert!(!g.dmabuf && g.why.contains("rdma-core < 34"), "{}", g.why);
    }

    #[test]
    fn nccl_dmabuf_enable_0_turns_dmabuf_off() {
        let g = decide(None, EBADF, None, &knobs(&[("NCCL_DMABUF_ENABLE", "0")]));
        assert_eq!((g.dmabuf, g.flush), (false, false));
        assert!(g.why.contains("NCCL_DMABUF_ENABLE=0"), "{}", g.why);
    }

    #[test]
    fn flush_follows_gpu_support_and_the_knobs() {
        let peer = Path::new("/x");
        let off = knobs(&[("NCCL_GDR_FLUSH_DISABLE", "1")]);
        assert!(!decide(Some(peer), NOTSUP, None, &off).flush);
        let forced = knobs(&[("FERROCE_FORCE_FLUSH", "1")]);
        assert!(decide(None, NOTSUP, None, &forced).flush);
    }

    #[test]
    fn relaxed_ordering_modes() {
        let ro = |mode: &'static str, accepted| {
            decide(None, NOTSUP, accepted, &knobs(&[("NCCL_IB_PCI_RELAXED_ORDERING", mode)]))
        };
        assert!(!ro("0", Some(true)).relaxed_ordering);
        assert!(ro("2", Some(true)).relaxed_ordering);
        let auto_off = ro("2", Some(false));
        assert!(!auto_off.relaxed_ordering && auto_off.warning.is_none());
        assert!(ro("1", Some(true)).relaxed_ordering);
        let asked = ro("1", None);
        assert!(!asked.relaxed_ordering);
        assert!(asked.warning.unwrap().contains("ibv_reg_mr_iova2"));
    }

    #[test]
    fn peer_memory_files_are_found_under_the_given_root() {
        let root = std::env::temp_dir().join(format!("ferroce-gdr-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(peer_memory(&root), None);
        for f in PEER_MEMORY_FILES {
            let p = root.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, "1.0\n").unwrap();
            assert_eq!(peer_memory(&root).as_deref(), Some(p.as_path()), "{f}");
            std::fs::remove_file(&p).unwrap();
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
