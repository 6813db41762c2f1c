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
    /// common one (else none) and its plane is NCCL's virtual one ([`virtual_plane`]).
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
            plane: if ports.len() > 1 {
                let planes: Vec<Option<i16>> = self.devices.iter().map(|d| d.plane).collect();
                Some(virtual_plane(&planes, &members))
            } else {
                d.plane
            },
            members,
        })
    }
}

/// NCCL's mark of a fused device's plane (`NCCL_IB_PLANE_VIRT_BIT`), and the places below it.
const PLANE_PLACES: usize = 14;
const VIRTUAL_PLANE: i16 = 1 << PLANE_PLACES;

/// A fused device's `planeId`, as NCCL's IB transport forms it: bit 14 (its mark of a virtual
/// plane) and, for each member port, bit `i` where `i` is the place of the port's plane among
/// the distinct planes of all devices (`planes`, in device order; place 0 is "no plane").
fn virtual_plane(planes: &[Option<i16>], members: &[usize]) -> i16 {
    let mut distinct: Vec<Option<i16>> = vec![None];
    for p in planes {
        if !distinct.contains(p) {
            distinct.push(*p);
        }
    }
    members.iter().fold(VIRTUAL_PLANE, |acc, &m| {
        let i = distinct.iter().position(|p| *p == planes[m]).unwrap_or(0);
        acc | if i < PLANE_PLACES { 1 << i } else { 0 }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fused_devices_plane_is_nccls_virtual_plane() {
        // No planes set (NCCL_IB_HCA without :plane): every port at place 0.
        assert_eq!(virtual_plane(&[None, None, None], &[0, 1]), 0x4001);
        // Planes 7 and 9 take places 1 and 2 (place 0 is "none"), in device order.
        let planes = [Some(7), Some(9), Some(7), None];
        assert_eq!(virtual_plane(&planes, &[0, 1]), 0x4000 | 0b110);
        assert_eq!(virtual_plane(&planes, &[0, 2]), 0x4000 | 0b010);
        assert_eq!(virtual_plane(&planes, &[1, 3]), 0x4000 | 0b101);
    }
}
