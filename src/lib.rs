//! ferroce: an NCCL network plugin (`ncclNet` v6–v12) for RDMA over Converged Ethernet.
//!
//! # Architecture
//! Three layers call only downward, never up: `ffi` → `transport` → `verbs`. Four modules
//! import none of the three, so any layer may use them: `wr` and `os` (nothing of ferroce),
//! `config` (only `error`) and `error` (nothing). The imports as they run:
//!
//! ```text
//!   ffi ────► transport ────► verbs
//!    │           │    │        │  │
//!    │           │    └► wr ◄──┘  │
//!    │           ▼                │
//!    └─────────► os ◄─────────────┘
//!
//!   transport ──► config ──► error ◄── ffi, transport, verbs
//! ```
//!
//! - [`ffi`]: the C ABI. Exported vtables `ncclNetPlugin_v6` … `ncclNetPlugin_v12`, each a table
//!   over one version-neutral set of entry points (`ffi::plugin`). Every entry point runs
//!   through one panic-catching funnel that maps [`error::Error`] to `ncclResult_t`.
//! - [`transport`]: NCCL semantics (devices, properties, connection setup, the data path, the
//!   shared state's lifetime). `unsafe` is forbidden there by the compiler.
//! - [`verbs`]: safe RAII wrappers over libibverbs that know nothing about NCCL.
//! - [`wr`]: work requests and completions as plain data, and the names of completion statuses;
//!   the data-path core (`transport::proto`) sees only these, never `verbs`. Used by
//!   `transport` and `verbs`; no `unsafe`, no dependencies.
//! - [`os`]: the few libc calls std lacks (non-blocking connect, interface addresses,
//!   `getrandom`, page size, the coarse clock, the memlock limit). Any layer may use it; it uses
//!   nothing of ferroce.
//! - [`config`] holds every knob (read by `transport`); [`error`] the one error type, used by
//!   every module that can fail and itself using none.
//!
//! # Safety model
//! All raw pointers from NCCL are converted in `ffi::handles` (NULL-checked, typed); all raw
//! verbs pointers live in `verbs`, owned by RAII types; `os` keeps its libc pointers inside each
//! call. No panic crosses the C boundary.
//!
//! The compiler holds to this: `unsafe` is denied crate-wide and allowed only in `ffi`, `verbs`
//! and `os`; `transport` and `wr` forbid it outright.

#![deny(unsafe_code)]

pub mod config;
pub mod error;
pub mod ffi;
pub mod os;
pub mod transport;
pub mod verbs;
pub mod wr;
