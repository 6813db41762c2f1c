//! Device enumeration and queries: `ibv_get_device_list`, `ibv_open_device`,
//! `ibv_query_device`, `ibv_query_port`, `ibv_query_port_speed`, `ibv_query_gid`.
//!
//! Invariant: a [`Context`] is open from construction until `Drop`, which closes it exactly once.
//! libibverbs documents these calls as thread-safe, so a `Context` may be shared between threads.

use std::ffi::{CStr, c_int};
use std::mem::{MaybeUninit, offset_of, size_of};

use rdma_sys as sys;

use crate::error::{Error, Result};

/// An open verbs device (`struct ibv_context`).
pub struct Context {
    raw: *mut sys::ibv_context,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread; the queries we make are thread-safe
// and the pointer is only freed in Drop, when no other reference exists.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates Rust-visible state.
unsafe impl Sync for Context {}

/// `ibv_port_state`, reduced to what callers decide on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    Active,
    /// Any other state, with its raw value for diagnostics.
    Other(u32),
}

/// The link layer of a port (`IBV_LINK_LAYER_*` in verbs.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
    Unspecified(u8),
}

/// What callers need from `ibv_device_attr`.
#[derive(Clone, Debug)]
pub struct DeviceAttr {
    /// `sys_image_guid` in host byte order.
    pub sys_image_guid: u64,
    pub max_qp: i32,
    pub phys_port_cnt: u8,
}

/// What callers need from `ibv_port_attr`.
#[derive(Clone, Debug)]
pub struct PortAttr {
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// `ibv_mtu` enum value (1 = 256 … 5 = 4096).
    pub active_mtu: u32,
    pub max_mtu: u32,
    pub active_speed: u8,
    /// The 32-bit speed code of newer kernels and libibverbs (XDR and beyond); 0 where either
    /// lacks it, and then `active_speed` holds the speed.
    pub active_speed_ex: u32,
    pub active_width: u8,
    pub gid_tbl_len: i32,
    pub max_msg_sz: u32,
}

/// `struct ibv_port_attr` as newer rdma-core lays it out: the 52 bytes rdma-sys knows (rdma-core
/// 44's struct, ending with `port_cap_flags2`), then `active_speed_ex`.
#[repr(C)]
struct PortAttrEx {
    base: sys::ibv_port_attr,
    active_speed_ex: u32,
}

const _: () = assert!(size_of::<sys::ibv_port_attr>() == 52);
const _: () = assert!(offset_of!(PortAttrEx, active_speed_ex) == 52);

type QueryPortOp = unsafe extern "C" fn(
    context: *mut sys::ibv_context,
    port_num: u8,
    port_attr: *mut sys::ibv_port_attr,
    port_attr_len: usize,
) -> c_int;

/// The library's length-taking `query_port` in the context's `verbs_context`, found as verbs.h's
/// inline `verbs_get_ctx_op` finds it; `None` for a context without one. rdma-sys's copy of that
/// lookup is private, and compares the marker with `u32::MAX` where verbs.h has `UINTPTR_MAX`.
///
/// The op zeroes the whole buffer of the length given before the provider fills what it knows,
/// and copies only that length out of a library-sized buffer when it is shorter, so a field the
/// library does not have reads 0.
///
/// # Safety
/// `ctx` is an open context.
unsafe fn query_port_op(ctx: *mut sys::ibv_context) -> Option<QueryPortOp> {
    // SAFETY: ctx is an open context, so its fields may be read.
    if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
        return None;
    }
    // SAFETY: that marker says ctx is the `context` member of a `verbs_context` the library
    // allocated, so stepping back by the member's offset stays inside that allocation.
    let vctx = unsafe {
        ctx.cast::<u8>().sub(offset_of!(sys::verbs_context, context)).cast::<sys::verbs_context>()
    };
    // `sz` (just before `context`, always present) counts the bytes the library filled in, from
    // its oldest op to the end: the struct grows at the front, so a newer op is only there
    // when `sz` reaches back to it.
    let need = size_of::<sys::verbs_context>() - offset_of!(sys::verbs_context, query_port);
    // SAFETY: as above; `sz` lies in every version of the struct.
    if unsafe { (*vctx).sz } < need {
        return None;
    }
    // SAFETY: `sz` says the `query_port` slot lies inside the library's struct.
    unsafe { (*vctx).query_port }
}

pub(super) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Opens every RDMA device the system lists whose name `wanted` accepts, in name order; also
/// returns the names of all listed devices. A device that cannot be opened is reported as an
/// error (the caller decides whether that is fatal).
pub fn open_all(wanted: impl Fn(&str) -> bool) -> Result<(Vec<String>, Vec<Result<Context>>)> {
    let mut n = 0;
    // SAFETY: ibv_get_device_list writes the count to `n` and returns a NULL-terminated array
    // (or NULL with errno set), which we free below after reading it.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = errno();
        // No kernel support at all (no uverbs) is "no devices", not a failure.
        if e == libc::ENOSYS || e == libc::ENOENT || e == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        return Err(Error::verbs("ibv_get_device_list", e, "listing RDMA devices"));
    }
    let mut out = Vec::new();
    let mut names = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: i < n, and the array holds n valid device pointers.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a valid ibv_device; the name is a NUL-terminated string it owns.
        let name =
            unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
        names.push(name.clone());
        if !wanted(&name) {
            continue;
        }
        // SAFETY: dev is valid until ibv_free_device_list; an opened context stays valid after.
        let raw = unsafe { sys::ibv_open_device(dev) };
        out.push(if raw.is_null() {
            Err(Error::verbs("ibv_open_device", errno(), &name))
        } else {
            Ok(Context { raw, name })
        });
    }
    // SAFETY: list came from ibv_get_device_list and is freed once; opened contexts survive.
    unsafe { sys::ibv_free_device_list(list) };
    out.sort_by(|a, b| match (a, b) {
        (Ok(a), Ok(b)) => a.name.cmp(&b.name),
        _ => std::cmp::Ordering::Equal,
    });
    names.sort();
    Ok((names, out))
}

impl Context {
    pub(super) fn raw(&self) -> *mut sys::ibv_context {
        self.raw
    }

    /// The kernel device name, e.g. `rxe0` or `mlx5_0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr = MaybeUninit::<sys::ibv_device_attr>::zeroed();
        // SAFETY: raw is an open context and attr is a writable ibv_device_attr.
        let rc = unsafe { sys::ibv_query_device(self.raw, attr.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_device", rc, &self.name));
        }
        // SAFETY: zero-initialised and filled by a successful query.
        let attr = unsafe { attr.assume_init() };
        Ok(DeviceAttr {
            sys_image_guid: u64::from_be(attr.sys_image_guid),
            max_qp: attr.max_qp,
            phys_port_cnt: attr.phys_port_cnt,
        })
    }

    /// The port's attributes, with `active_speed_ex` where the library and kernel have it.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = MaybeUninit::<PortAttrEx>::zeroed();
        let ptr = attr.as_mut_ptr();
        // SAFETY: raw is an open context.
        let op = unsafe { query_port_op(self.raw) };
        // SAFETY: raw is open and ptr is a writable PortAttrEx of the length passed.
        let ext = op.map(|op| unsafe { op(self.raw, port, ptr.cast(), size_of::<PortAttrEx>()) });
        let rc = if ext == Some(0) {
            0
        } else {
            // The fixed-size query; `active_speed_ex` stays 0.
            // SAFETY: raw is open; `base` is a writable ibv_port_attr inside attr.
            unsafe {
                ptr.write_bytes(0, 1);
                sys::___ibv_query_port(self.raw, port, &raw mut (*ptr).base)
            }
        };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_port", rc, &format!("{} port {port}", self.name)));
        }
        // SAFETY: zero-initialised and filled by a successful query.
        let PortAttrEx { base: a, active_speed_ex } = unsafe { attr.assume_init() };
        Ok(PortAttr {
            state: if a.state == sys::ibv_port_state::IBV_PORT_ACTIVE {
                PortState::Active
            } else {
                PortState::Other(a.state)
            },
            link_layer: match a.link_layer {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                other => LinkLayer::Unspecified(other),
            },
            active_mtu: a.active_mtu,
            max_mtu: a.max_mtu,
            active_speed: a.active_speed,
            active_speed_ex,
            active_width: a.active_width,
            gid_tbl_len: a.gid_tbl_len,
            max_msg_sz: a.max_msg_sz,
        })
    }

    /// The port's speed in units of 100 Mb/s from `ibv_query_port_speed`; `None` where the
    /// library lacks it or it fails (then the speed comes from the port attributes).
    pub fn query_port_speed(&self, port: u8) -> Option<u64> {
        let f = super::SYMBOLS.query_port_speed?;
        let mut speed = 0u64;
        // SAFETY: raw is an open context, speed a writable u64; the symbol has this signature.
        let rc = unsafe { f(self.raw, port.into(), &mut speed) };
        (rc == 0).then_some(speed)
    }

    /// The raw 16-byte GID at `index` of `port`.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16]> {
        let mut gid = MaybeUninit::<sys::ibv_gid>::zeroed();
        // SAFETY: raw is an open context and gid is a writable ibv_gid.
        let rc = unsafe { sys::ibv_query_gid(self.raw, port, index, gid.as_mut_ptr()) };
        if rc != 0 {
            let what = format!("{} port {port} index {index}", self.name);
            return Err(Error::verbs("ibv_query_gid", errno(), &what));
        }
        // SAFETY: filled by a successful query; every bit pattern is a valid [u8; 16].
        Ok(unsafe { gid.assume_init().raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: raw is open and this is the only close.
        let rc = unsafe { sys::ibv_close_device(self.raw) };
        if rc != 0 {
            log::warn!("ibv_close_device({}) failed: errno {}", self.name, errno());
        }
    }
}
