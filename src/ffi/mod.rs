//! The C boundary: the only module with `extern "C"`, exported symbols, `void*` casts and NCCL
//! out-pointers.
//!
//! - `abi`: the bindgen view of `include/ferroce_net.h`.
//! - `boundary`: the one funnel every entry point runs through (panic catching, error codes).
//! - `handles`: typed conversions between NCCL's `void*` and ferroce objects, and the register
//!   of everything NCCL holds, which the last `finalize` ends.
//! - `log`: the `log` facade onto NCCL's logger.
//! - `plugin`: the entry points, written once against the newest signatures.
//! - `legacy`: the shims several older versions share (no context, `int` sizes, narrower
//!   property structs).
//! - `narrow`: the older property structs, made from the newest (`Narrow`, `narrow!`).
//! - `entries`: which of those fills each member of a table, by the member's signature.
//! - `v12` … `v6`: what one version alone has (its properties struct's fields, shims of a
//!   signature no other version has). Each version's table is written from its type by
//!   `tables!` below. A new version is its struct in `include/ferroce_net.h`, one more file
//!   here and one entry in [`ncclnet_versions!`](crate::ncclnet_versions).

#![allow(unsafe_code)]

/// The ncclNet versions, newest first, one entry a version: its number, its module here, its
/// table type, and the members that table has beyond v6's. Everything
/// that differs by version reads this list: the modules and checks below, the client driver in
/// ferroce-tools, the ABI layout tests and `tests/loadability.rs`. Calls `$then!` with it.
#[macro_export]
macro_rules! ncclnet_versions {
    ($then:ident) => {
        $then! {
            12 v12 ncclNet_v12_t { getDeviceMr irecvConsumed makeVDevice finalize setNetAttr },
            11 v11 ncclNet_v11_t { getDeviceMr irecvConsumed makeVDevice finalize setNetAttr },
            10 v10 ncclNet_v10_t { getDeviceMr irecvConsumed makeVDevice },
            9 v9 ncclNet_v9_t { getDeviceMr irecvConsumed makeVDevice },
            8 v8 ncclNet_v8_t { getDeviceMr irecvConsumed },
            7 v7 ncclNet_v7_t { getDeviceMr irecvConsumed },
            6 v6 ncclNet_v6_t {}
        }
    };
}

pub mod abi;
mod boundary;
mod entries;
mod handles;
mod legacy;
pub mod log;
mod narrow;
mod plugin;
mod profiler;

pub use boundary::guard;

/// A vtable exported to C. `#[repr(transparent)]` keeps the ABI layout of `T`. Only the ncclNet
/// tables ([`Table`]) are shareable between threads.
#[repr(transparent)]
pub struct Exported<T>(pub T);

/// The ncclNet tables: `Option`s of `extern "C"` function pointers, plus `name`, a
/// `*const c_char`. That raw pointer is the only thing that keeps them from being `Sync` on
/// their own.
///
/// # Safety
/// Implemented only for the ncclNet table types in [`abi`], whose only non-`Sync` field is a
/// `name` that points at a static C string nobody writes: [`Exported`] of any other type could
/// be shared between threads unsoundly.
pub unsafe trait Table {}

/// For each listed version: its module, its table type marked a [`Table`], its table exported
/// under the symbol NCCL looks up (`ncclNetPlugin_v12`), and its number in [`VERSIONS`].
macro_rules! tables {
    ($($n:literal $v:ident $t:ident { $($extra:ident)* }),*) => {
        $(
            mod $v;
            // SAFETY: an ncclNet table of `abi`, as the trait requires.
            unsafe impl Table for abi::$t {}
            const _: () = {
                #[unsafe(export_name = concat!("ncclNetPlugin_", stringify!($v)))]
                static TABLE: Exported<abi::$t> = Exported(table!($t: init devices getProperties
                    listen connect accept regMr regMrDmaBuf deregMr isend irecv iflush test
                    closeSend closeRecv closeListen $($extra)*));
            };
        )*
        /// The ABI versions the plugin exports, newest first.
        pub const VERSIONS: &[u32] = &[$($n),*];
    };
}

/// The table of type `$t` whose members are those named, each filled by the [`entries`] entry
/// point of its signature (a table that lacks a member named, or has one not named, fails to
/// compile).
macro_rules! table {
    ($t:ident: $($member:ident)*) => {
        abi::$t {
            name: PLUGIN_NAME.as_ptr(),
            $($member: <entries::$member as entries::Entry<_>>::FN,)*
        }
    };
}
ncclnet_versions!(tables);

// SAFETY: a `Table` holds function pointers (Sync) and `name`, which every export sets to
// `PLUGIN_NAME`, a static C string nobody writes; the exports are immutable statics. So
// reading one from any thread is sound.
unsafe impl<T: Table> Sync for Exported<T> {}

/// The struct `name` of every exported version; NCCL matches `NCCL_NET` against it.
pub const PLUGIN_NAME: &std::ffi::CStr = c"ferroce";
