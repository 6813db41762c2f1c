//! The C boundary: the only module with `extern "C"`, `#[unsafe(no_mangle)]`, `void*` casts and
//! NCCL out-pointers.
//!
//! - `abi`: the bindgen view of `include/ferroce_net.h`.
//! - `boundary`: the one funnel every entry point runs through (panic catching, error codes).
//! - `handles`: typed conversions between NCCL's `void*` and ferroce objects.
//! - `log`: the `log` facade onto NCCL's logger.
//! - `plugin`: the entry points, written once against the newest signatures.
//! - `legacy`: the shims several older versions share (no context, `int` sizes, narrower
//!   property structs).
//! - `v12` … `v6`: one exported table per ABI version, naming `plugin` and `legacy` only. A new
//!   version is one more file here.

#![allow(unsafe_code)]

pub mod abi;
mod boundary;
mod handles;
mod legacy;
pub mod log;
mod plugin;
mod v10;
mod v11;
mod v12;
mod v6;
mod v7;
mod v8;
mod v9;

pub use boundary::guard;

/// A vtable exported to C. `#[repr(transparent)]` keeps the ABI layout of `T`.
#[repr(transparent)]
pub struct Exported<T>(pub T);

// SAFETY: the exported tables are immutable statics holding function pointers and a pointer to
// a static C string, so sharing them between threads is sound.
unsafe impl<T> Sync for Exported<T> {}

/// The struct `name` of every exported version; NCCL matches `NCCL_NET` against it.
pub const PLUGIN_NAME: &std::ffi::CStr = c"ferroce";
