//! NCCL semantics on top of `verbs`: which devices exist, what NCCL is told about them, and the
//! lifetime of the plugin's shared state across communicators.
//!
//! No `unsafe` here, and the compiler holds to it: raw pointers stay in `ffi` (above), `verbs`
//! (below) and `os`.

#![forbid(unsafe_code)]

pub mod connects;
pub mod data;
pub mod device;
pub mod ecmp;
pub mod gdr;
pub mod gid;
pub mod mr_cache;
pub mod net;
pub mod profile;
pub mod props;
pub mod reg;
pub mod setup;
pub mod stats;

pub use device::NetDevice;
pub use net::{CommContext, Net};
