//! The C boundary: the only module with `extern "C"`, `#[unsafe(no_mangle)]`, `void*` casts and
//! NCCL out-pointers.
//!
//! - `abi`: the bindgen view of `include/ferroce_net.h`.
//! - `boundary`: the one funnel every entry point runs through (panic catching, error codes).
//! - `handles`: typed conversions between NCCL's `void*` and ferroce objects, and the register
//!   of everything NCCL holds, which the last `finalize` ends.
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
mod profiler;
mod v10;
mod v11;
mod v12;
mod v6;
mod v7;
mod v8;
mod v9;

pub use boundary::guard;

/// A vtable exported to C. `#[repr(transparent)]` keeps the ABI layout of `T`. Only the ncclNet
/// tables ([`Table`]) are shareable between threads.
#[repr(transparent)]
pub struct Exported<T>(pub T);

/// The ncclNet tables: `Option`s of `extern "C"` function pointers, plus `name`, a
/// `*const c_char`. That raw pointer is the only thing that keeps them from being `Sync` on
/// their own.
pub trait Table {}

/// Marks each listed type a [`Table`], after checking that it is the ncclNet table of its
/// version: its `name` field is a `*const c_char`.
macro_rules! tables {
    ($($t:ty),*) => {$(
        impl Table for $t {}
        const _: fn(&$t) -> *const std::ffi::c_char = |t| t.name;
    )*};
}
tables!(
    abi::ncclNet_v6_t,
    abi::ncclNet_v7_t,
    abi::ncclNet_v8_t,
    abi::ncclNet_v9_t,
    abi::ncclNet_v10_t,
    abi::ncclNet_v11_t,
    abi::ncclNet_v12_t
);

// SAFETY: a `Table` holds function pointers (Sync) and `name`, which every export sets to
// `PLUGIN_NAME`, a static C string nobody writes; the exports are immutable statics. So
// reading one from any thread is sound.
unsafe impl<T: Table> Sync for Exported<T> {}

/// The struct `name` of every exported version; NCCL matches `NCCL_NET` against it.
pub const PLUGIN_NAME: &std::ffi::CStr = c"ferroce";
