//! Older ABI structs made from their newest counterparts: the properties and virtual-device
//! structs of v6–v11 are v12's with fewer (or narrower) fields. Used by `plugin` (which fills
//! any version's properties) and by the shims in `legacy` and the `vN` files.

use std::ffi::c_int;

use super::abi::*;

/// A struct of some version made from its newest counterpart `N`: itself, or an older struct
/// with fewer fields (see [`narrow!`]).
pub trait Narrow<N> {
    fn narrow(newest: &N) -> Self;
}

impl<T: Copy> Narrow<T> for T {
    fn narrow(newest: &T) -> T {
        *newest
    }
}

/// Makes an older properties struct `Narrow` from the newest one: it has the fields listed,
/// each narrowed from the newest one's field of that name.
macro_rules! narrow {
    ($ty:ident: $($field:ident)*) => {
        impl $crate::ffi::narrow::Narrow<ncclNetProperties_v12_t> for $ty {
            fn narrow(p: &ncclNetProperties_v12_t) -> $ty {
                use $crate::ffi::narrow::Narrow;
                $ty { $($field: Narrow::narrow(&p.$field)),* }
            }
        }
    };
}
pub(super) use narrow;

/// The v9–v11 view of the newest virtual-device properties (4 slots instead of 8).
impl Narrow<ncclNetVDeviceProps_v12_t> for ncclNetVDeviceProps_v9_t {
    fn narrow(p: &ncclNetVDeviceProps_v12_t) -> Self {
        let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V11 as usize];
        let n = devs.len();
        devs.copy_from_slice(&p.devs[..n]);
        ncclNetVDeviceProps_v9_t { ndevs: p.ndevs.min(devs.len() as c_int), devs }
    }
}
