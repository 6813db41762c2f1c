//! ferroce: an NCCL network plugin (`ncclNet` v6–v12) for RDMA over Converged Ethernet.
//!
//! # Architecture
//! Three layers call only downward, never up: `ffi` → `transport` → `verbs`. Beneath them all
//! is the `ferroce-core` crate (`src/core`): the data-path and setup cores, the error type and
//! the work-request types, with no I/O, no `unsafe` and no dependencies, so the compiler holds
//! that the cores reach nothing of this crate. `os` and `config` import none of the three
//! layers, so any layer may use them. The imports as they run:
//!
//! ```text
//!   ffi ────► transport ────► verbs
//!    │          │   │          │  │
//!    │          │   ▼          ▼  │
//!    │          │  ferroce_core (data, setup, wr, error) ◄── config
//!    │          ▼                 │
//!    └────────► os ◄──────────────┘
//! ```
//!
//! - [`ffi`]: the C ABI. Exported vtables `ncclNetPlugin_v6` … `ncclNetPlugin_v12`, each a table
//!   over one version-neutral set of entry points (`ffi::plugin`). Every entry point runs
//!   through one panic-catching funnel that maps [`error::Error`] to `ncclResult_t`.
//! - [`transport`]: NCCL semantics (devices, properties, connection setup, the data path, the
//!   shared state's lifetime), and the shells that drive the cores: `transport::data` drives
//!   `ferroce_core::data`, `transport::setup` drives `ferroce_core::setup`. `unsafe` is
//!   forbidden there by the compiler.
//! - [`verbs`]: safe RAII wrappers over libibverbs that know nothing about NCCL.
//! - [`wr`] (re-exported from the core): work requests and completions as plain data, and the
//!   names of completion statuses; the data-path core sees only these, never `verbs`.
//! - [`os`]: the few libc calls std lacks (non-blocking connect, interface addresses,
//!   `getrandom`, page size, the coarse clock, the memlock limit). Any layer may use it; it uses
//!   nothing of ferroce.
//! - [`config`] holds every knob (read by `transport`); [`error`] (re-exported from the core)
//!   the one error type, used by every module that can fail and itself using none.
//!
//! # Safety model
//! All raw pointers from NCCL are converted in `ffi::handles` (NULL-checked, typed); all raw
//! verbs pointers live in `verbs`, owned by RAII types; `os` keeps its libc pointers inside each
//! call. No panic crosses the C boundary.
//!
//! The compiler holds to this: `unsafe` is denied crate-wide and allowed only in `ffi`, `verbs`
//! and `os`; `transport` forbids it outright, and so does the whole of `ferroce-core`.

#![deny(unsafe_code)]

pub mod config;
pub mod ffi;
pub mod os;
pub mod transport;
pub mod verbs;

pub use ferroce_core::{error, wr};

/// The design of the plugin, for those who work on it.
pub mod design {
    #![doc = include_str!("doc/design.md")]
}

/// Every test and what it proves.
pub mod testing {
    #![doc = include_str!("doc/testing.md")]
}

/// Every measurement, with its method.
pub mod performance {
    #![doc = include_str!("doc/performance.md")]
}
