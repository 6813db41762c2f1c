//! Safe RAII wrappers over `rdma-sys` (libibverbs).
//!
//! This layer knows nothing about NCCL: it opens devices, answers queries and closes what it
//! opened. Every handle owns its raw pointer (and, for child objects, an `Arc` to its parent)
//! so destruction order is right by construction. Failures come back as
//! [`Error::Verbs`](crate::error::Error) naming the verb and its errno.
//!
//! Callers: `transport` only.

mod device;
pub mod sysfs;

pub use device::{Context, DeviceAttr, LinkLayer, PortAttr, PortState, open_all};
