//! ferroce: an NCCL network plugin (`ncclNet` v6–v12) for RDMA over Converged Ethernet.
//!
//! # Architecture
//! Three layers, each calling only downward:
//! - [`ffi`]: the C ABI. Exported vtables `ncclNetPlugin_v6` … `ncclNetPlugin_v12`, each a table
//!   over one version-neutral set of entry points (`ffi::plugin`). Every entry point runs
//!   through one panic-catching funnel that maps [`error::Error`] to `ncclResult_t`.
//! - [`transport`]: NCCL semantics (devices, properties, the shared state's lifetime). No
//!   `unsafe` code.
//! - [`verbs`]: safe RAII wrappers over libibverbs that know nothing about NCCL.
//! - [`wr`]: work requests and completions as plain data, shared by `transport` and `verbs`, so
//!   the data-path core sees no verbs.
//!
//! [`config`] holds every knob; [`error`] the one error type.
//!
//! # Safety model
//! All raw pointers from NCCL are converted in `ffi::handles` (NULL-checked, typed); all raw
//! verbs pointers live in `verbs`, owned by RAII types. No panic crosses the C boundary.

pub mod config;
pub mod error;
pub mod ffi;
pub mod os;
pub mod transport;
pub mod verbs;
pub mod wr;
