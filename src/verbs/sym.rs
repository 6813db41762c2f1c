//! libibverbs entry points newer than the base ABI, resolved at run time: `ibv_reg_dmabuf_mr`
//! (IBVERBS_1.12, rdma-core ≥ 34), `ibv_reg_mr_iova2` (IBVERBS_1.8) and
//! `ibv_query_port_speed` (IBVERBS_1.16; Debian 12's rdma-core 44 lacks it). Linking them directly
//! would stop the plugin from loading against an older libibverbs; resolved here, a missing
//! one just means "unsupported".
//!
//! The global scope is searched first, as the dynamic linker does for a directly linked symbol,
//! so an `LD_PRELOAD` interposer is honoured (the test stand-in for a dma-buf NIC uses this).
//! When libibverbs is not in the global scope (NCCL opens the plugin `RTLD_LOCAL`), the symbol
//! is looked up in the already loaded libibverbs at its version.

use std::ffi::{CStr, c_int, c_uint, c_void};

use once_cell::sync::Lazy;
use rdma_sys as sys;

pub type RegDmabufMr = unsafe extern "C" fn(
    pd: *mut sys::ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut sys::ibv_mr;

pub type RegMrIova2 = unsafe extern "C" fn(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut sys::ibv_mr;

/// Writes the port's speed in units of 100 Mb/s to `port_speed`; 0 on success, else an errno.
pub type QueryPortSpeed = unsafe extern "C" fn(
    context: *mut sys::ibv_context,
    port_num: u32,
    port_speed: *mut u64,
) -> c_int;

pub struct Symbols {
    pub reg_dmabuf_mr: Option<RegDmabufMr>,
    pub reg_mr_iova2: Option<RegMrIova2>,
    pub query_port_speed: Option<QueryPortSpeed>,
}

pub static SYMBOLS: Lazy<Symbols> = Lazy::new(|| Symbols {
    // SAFETY: the symbols, when present, have exactly these C signatures (verbs.h).
    reg_dmabuf_mr: resolve(c"ibv_reg_dmabuf_mr", c"IBVERBS_1.12")
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, RegDmabufMr>(p) }),
    // SAFETY: as above.
    reg_mr_iova2: resolve(c"ibv_reg_mr_iova2", c"IBVERBS_1.8")
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, RegMrIova2>(p) }),
    // SAFETY: as above.
    query_port_speed: resolve(c"ibv_query_port_speed", c"IBVERBS_1.16")
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, QueryPortSpeed>(p) }),
});

fn resolve(name: &CStr, version: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a valid C string only reads the loader's tables.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if !p.is_null() {
        return Some(p);
    }
    // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (the plugin links
    // libibverbs, so it is); the handle is released right after the lookup.
    unsafe {
        let h = libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return None;
        }
        let p = libc::dlvsym(h, name.as_ptr(), version.as_ptr());
        libc::dlclose(h);
        (!p.is_null()).then_some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_symbols_resolve_against_the_build_machines_libibverbs() {
        // Debian 12 ships rdma-core 44, which has both; a missing one would be `None`, not an
        // error, and the plugin would still load.
        assert!(SYMBOLS.reg_dmabuf_mr.is_some());
        assert!(SYMBOLS.reg_mr_iova2.is_some());
        assert!(resolve(c"ibv_no_such_verb", c"IBVERBS_1.1").is_none());
    }
}
