//! Safe RAII wrappers over `rdma-sys` (libibverbs).
//!
//! This layer knows nothing about NCCL: it opens devices, answers queries and closes what it
//! opened. Every handle owns its raw pointer (and, for child objects, an `Arc` to its parent)
//! so destruction order is right by construction. Failures come back as
//! [`Error::Verbs`](crate::error::Error) naming the verb and its errno.
//!
//! Callers: `transport` only.

#![allow(unsafe_code)]

mod buf;
mod cq;
mod device;
mod events;
mod pd;
mod qp;
mod sym;
pub mod sysfs;

pub use buf::RegisteredBuf;
pub use cq::{Cq, POLL_BATCH, WC_RECV_RDMA_WITH_IMM};
pub use device::{Context, DeviceAttr, LinkLayer, PortAttr, PortState, open_all};
pub use events::{AsyncEvent, wait_async};
pub use pd::{
    ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE,
    DmabufProbe, FastMap, ForeignMem, Mr, Pd,
};
pub use qp::{Qp, QpCaps, RtrAttr, RtsAttr};
pub use sym::SYMBOLS;
