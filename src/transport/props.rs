//! What NCCL is told about a device (`getProperties`), as a plain struct: `ffi` only writes it
//! into each version's C struct. A device is a physical port, or a fused device that
//! `makeVDevice` made over several ports; NCCL's IB transport sets the rules for the latter.

use super::data::MAX_RECVS;
use super::{Net, NetDevice};
use crate::error::Result;

/// What `getProperties` reports about one NCCL device, in any ABI version.
#[derive(Clone, Debug, PartialEq)]
pub struct Props {
    /// `mlx5_0`; a fused device's joins its ports' (`mlx5_0+mlx5_1`).
    pub name: String,
    pub pci_path: Option<String>,
    pub guid: u64,
    /// GPU memory through peer memory (`NCCL_PTR_CUDA`); host memory always works.
    pub cuda: bool,
    /// GPU memory through dma-buf (`NCCL_PTR_DMABUF`).
    pub dmabuf: bool,
    /// Mb/s.
    pub speed_mbps: i32,
    pub port: i32,
    /// µs.
    pub latency: f32,
    pub max_comms: i32,
    pub max_recvs: usize,
    /// The physical ports it is made of (`vProps`): itself, or a fused device's.
    pub members: Vec<usize>,
    pub rail: Option<i16>,
    pub plane: Option<i16>,
}

impl Net {
    /// The properties of NCCL device `dev`. A fused device's are its first port's, as NCCL's IB
    /// transport gives them, except: its name joins the ports', its speed is their sum, its
    /// members list them, the QPs a comm takes scale with its ports, its rail is the ports'
    /// common one (else none) and it has no plane.
    pub fn props(&self, dev: i32) -> Result<Props> {
        let members = self.members(dev)?;
        let ports: Vec<&NetDevice> = members.iter().map(|&m| &self.devices[m]).collect();
        let d = ports[0];
        let names: Vec<&str> = ports.iter().map(|p| p.name.as_str()).collect();
        let qps = self.config.qps_per_conn * ports.len();
        Ok(Props {
            name: names.join("+"),
            pci_path: d.pci_path.clone(),
            guid: d.guid,
            cuda: d.gdr.cuda,
            dmabuf: d.gdr.dmabuf,
            speed_mbps: ports.iter().map(|p| p.speed_mbps).sum(),
            port: d.nccl_port,
            latency: 0.0,
            max_comms: ports.iter().map(|p| p.max_comms(qps)).min().unwrap_or(0),
            max_recvs: MAX_RECVS,
            rail: ports
                .iter()
                .map(|p| p.rail)
                .reduce(|a, b| if a == b { a } else { None })
                .flatten(),
            plane: if ports.len() > 1 { None } else { d.plane },
            members,
        })
    }
}
