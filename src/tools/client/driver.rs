//! Drives a loaded plugin through any ABI version (v6–v12) the way NCCL's proxy thread does,
//! behind one interface. Used by the `ferroce` tool and the tests; the plugin never calls it.
//!
//! Sizes are `size_t` here; for v6–v8 they are narrowed to `int` exactly as NCCL's own shims do,
//! so a test through v6 exercises the plugin's `int` entry points.
//!
//! The methods take the plugin's opaque handles and buffer pointers as raw pointers and pass
//! them through unchanged: this is a test and benchmark harness for a C ABI, whose callers own
//! those pointers exactly as NCCL does. They are not marked `unsafe` so the tests read like
//! NCCL's proxy loop; the lint below says so.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::time::Duration;

use crate::loader::{Library, capture_logger};
use crate::wait::until;
use ferroce::ffi::abi::*;

/// The table of one version, borrowed from the library.
#[derive(Clone, Copy)]
enum Table<'a> {
    V6(&'a ncclNet_v6_t),
    V7(&'a ncclNet_v7_t),
    V8(&'a ncclNet_v8_t),
    V9(&'a ncclNet_v9_t),
    V10(&'a ncclNet_v10_t),
    V11(&'a ncclNet_v11_t),
    V12(&'a ncclNet_v12_t),
}

/// A plugin opened at one ABI version.
pub struct Driver<'a> {
    table: Table<'a>,
    pub version: u32,
    /// The profiler callback `init` passes (v10+); none unless set.
    pub profiler: ncclProfilerCallback_t,
}

pub type Ptr = *mut c_void;

fn ok(what: &str, r: ncclResult_t) -> Result<(), String> {
    if r == ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(format!("{what} returned ncclResult {}", r.0))
    }
}

fn int(size: usize) -> Result<c_int, String> {
    c_int::try_from(size).map_err(|_| format!("size {size} does not fit an int (v6-v8)"))
}

macro_rules! call {
    ($f:expr) => {
        $f.ok_or_else(|| "member is NULL".to_string())?
    };
}

impl<'a> Driver<'a> {
    pub fn new(lib: &'a Library, version: u32) -> Result<Driver<'a>, String> {
        let sym = CString::new(format!("ncclNetPlugin_v{version}")).expect("no NUL");
        let missing = || format!("no symbol ncclNetPlugin_v{version}");
        // SAFETY: each symbol has the table type of its version; the references do not outlive
        // `lib` (the lifetime ties them).
        let table = unsafe {
            match version {
                6 => Table::V6(lib.table(&sym).ok_or_else(missing)?),
                7 => Table::V7(lib.table(&sym).ok_or_else(missing)?),
                8 => Table::V8(lib.table(&sym).ok_or_else(missing)?),
                9 => Table::V9(lib.table(&sym).ok_or_else(missing)?),
                10 => Table::V10(lib.table(&sym).ok_or_else(missing)?),
                11 => Table::V11(lib.table(&sym).ok_or_else(missing)?),
                12 => Table::V12(lib.table(&sym).ok_or_else(missing)?),
                v => return Err(format!("no ABI version {v}")),
            }
        };
        Ok(Driver { table, version, profiler: None })
    }

    /// `init`; the returned context is NULL for v6–v10 (their calls need none).
    pub fn init(&self, comm_id: u64) -> Result<Ptr, String> {
        self.init_with_tc(comm_id, -1)
    }

    /// `init` with a communicator traffic class (v11+; -1 for none).
    pub fn init_with_tc(&self, comm_id: u64, traffic_class: c_int) -> Result<Ptr, String> {
        let log = capture_logger();
        let mut ctx = null_mut();
        let mut cfg = ncclNetCommConfig_v10_t { trafficClass: traffic_class };
        // SAFETY: valid arguments per each version's init contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.init)(log),
                Table::V7(t) => call!(t.init)(log),
                Table::V8(t) => call!(t.init)(log),
                Table::V9(t) => call!(t.init)(log),
                Table::V10(t) => call!(t.init)(log, self.profiler),
                Table::V11(t) => call!(t.init)(&mut ctx, comm_id, &mut cfg, log, self.profiler),
                Table::V12(t) => call!(t.init)(&mut ctx, comm_id, &mut cfg, log, self.profiler),
            }
        };
        ok("init", r).map(|_| ctx)
    }

    /// `finalize` for v11+; nothing for older versions (NCCL never reaches theirs).
    pub fn finalize(&self, ctx: Ptr) -> Result<(), String> {
        // SAFETY: ctx came from init.
        let r = unsafe {
            match self.table {
                Table::V11(t) => call!(t.finalize)(ctx),
                Table::V12(t) => call!(t.finalize)(ctx),
                _ => return Ok(()),
            }
        };
        ok("finalize", r)
    }

    pub fn devices(&self) -> Result<c_int, String> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.devices)(&mut n),
                Table::V7(t) => call!(t.devices)(&mut n),
                Table::V8(t) => call!(t.devices)(&mut n),
                Table::V9(t) => call!(t.devices)(&mut n),
                Table::V10(t) => call!(t.devices)(&mut n),
                Table::V11(t) => call!(t.devices)(&mut n),
                Table::V12(t) => call!(t.devices)(&mut n),
            }
        };
        ok("devices", r).map(|_| n)
    }

    pub fn listen(&self, ctx: Ptr, dev: c_int) -> Result<([u8; 128], Ptr), String> {
        let mut handle = [0u8; 128];
        let h = handle.as_mut_ptr().cast();
        let mut comm = null_mut();
        // SAFETY: valid arguments per the listen contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.listen)(dev, h, &mut comm),
                Table::V7(t) => call!(t.listen)(dev, h, &mut comm),
                Table::V8(t) => call!(t.listen)(dev, h, &mut comm),
                Table::V9(t) => call!(t.listen)(dev, h, &mut comm),
                Table::V10(t) => call!(t.listen)(dev, h, &mut comm),
                Table::V11(t) => call!(t.listen)(ctx, dev, h, &mut comm),
                Table::V12(t) => call!(t.listen)(ctx, dev, h, &mut comm),
            }
        };
        ok("listen", r)?;
        if comm.is_null() {
            return Err("listen succeeded with a NULL listenComm".into());
        }
        Ok((handle, comm))
    }

    /// One `connect` call; `None` means "call again" (with the same handle buffer).
    pub fn connect(
        &self,
        ctx: Ptr,
        dev: c_int,
        handle: &mut [u8; 128],
    ) -> Result<Option<Ptr>, String> {
        let h = handle.as_mut_ptr().cast();
        let mut comm = null_mut();
        let mut dc: *mut ncclNetDeviceHandle_v7_t = null_mut();
        let mut cfg = ncclNetCommConfig_v10_t { trafficClass: -1 };
        // SAFETY: valid arguments per the connect contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.connect)(dev, h, &mut comm),
                Table::V7(t) => call!(t.connect)(dev, h, &mut comm, &mut dc),
                Table::V8(t) => call!(t.connect)(dev, h, &mut comm, &mut dc),
                Table::V9(t) => call!(t.connect)(dev, h, &mut comm, &mut dc),
                Table::V10(t) => call!(t.connect)(dev, &mut cfg, h, &mut comm, &mut dc),
                Table::V11(t) => call!(t.connect)(ctx, dev, h, &mut comm, &mut dc),
                Table::V12(t) => call!(t.connect)(ctx, dev, h, &mut comm, &mut dc),
            }
        };
        ok("connect", r).map(|_| (!comm.is_null()).then_some(comm))
    }

    /// Drives `connect` (on `dev`, towards `handle`) and `accept` (on `listen`) from one thread
    /// until both ends exist, for at most `limit`: how one process connects to a peer whose
    /// listener may be its own. Returns `(sendComm, recvComm)`.
    pub fn connect_both(
        &self,
        ctx: Ptr,
        dev: c_int,
        handle: &mut [u8; 128],
        listen: Ptr,
        limit: Duration,
    ) -> Result<(Ptr, Ptr), String> {
        let (mut send, mut recv) = (None, None);
        until("connect and accept", limit, || {
            if send.is_none() {
                send = self.connect(ctx, dev, handle)?;
            }
            if recv.is_none() {
                recv = self.accept(listen)?;
            }
            Ok(send.zip(recv))
        })
    }

    /// One `accept` call; `None` means "call again".
    pub fn accept(&self, listen: Ptr) -> Result<Option<Ptr>, String> {
        let mut comm = null_mut();
        let mut dc: *mut ncclNetDeviceHandle_v7_t = null_mut();
        // SAFETY: valid arguments per the accept contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.accept)(listen, &mut comm),
                Table::V7(t) => call!(t.accept)(listen, &mut comm, &mut dc),
                Table::V8(t) => call!(t.accept)(listen, &mut comm, &mut dc),
                Table::V9(t) => call!(t.accept)(listen, &mut comm, &mut dc),
                Table::V10(t) => call!(t.accept)(listen, &mut comm, &mut dc),
                Table::V11(t) => call!(t.accept)(listen, &mut comm, &mut dc),
                Table::V12(t) => call!(t.accept)(listen, &mut comm, &mut dc),
            }
        };
        ok("accept", r).map(|_| (!comm.is_null()).then_some(comm))
    }

    pub fn reg_mr(&self, comm: Ptr, data: *mut u8, size: usize) -> Result<Ptr, String> {
        self.reg_mr_type(comm, data, size, NCCL_PTR_HOST as c_int)
    }

    /// `regMr` with an explicit memory type (`NCCL_PTR_HOST`, `NCCL_PTR_CUDA`, ...).
    pub fn reg_mr_type(
        &self,
        comm: Ptr,
        data: *mut u8,
        size: usize,
        ty: c_int,
    ) -> Result<Ptr, String> {
        let mut mh = null_mut();
        let d = data.cast();
        // SAFETY: valid arguments per the regMr contract; the memory outlives the registration.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.regMr)(comm, d, int(size)?, ty, &mut mh),
                Table::V7(t) => call!(t.regMr)(comm, d, int(size)?, ty, &mut mh),
                Table::V8(t) => call!(t.regMr)(comm, d, size, ty, &mut mh),
                Table::V9(t) => call!(t.regMr)(comm, d, size, ty, &mut mh),
                Table::V10(t) => call!(t.regMr)(comm, d, size, ty, &mut mh),
                Table::V11(t) => call!(t.regMr)(comm, d, size, ty, &mut mh),
                Table::V12(t) => call!(t.regMr)(comm, d, size, ty, &mut mh),
            }
        };
        ok("regMr", r)?;
        if mh.is_null() {
            return Err("regMr succeeded with a NULL mhandle".into());
        }
        Ok(mh)
    }

    /// `regMrDmaBuf` as NCCL calls it: `[offset, offset + size)` of `fd`, used at `data`.
    pub fn reg_mr_dmabuf(
        &self,
        comm: Ptr,
        data: *mut u8,
        size: usize,
        ty: c_int,
        offset: u64,
        fd: c_int,
    ) -> Result<Ptr, String> {
        let mut mh = null_mut();
        let d = data.cast();
        // SAFETY: valid arguments per the regMrDmaBuf contract (same in every version).
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V7(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V8(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V9(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V10(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V11(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
                Table::V12(t) => call!(t.regMrDmaBuf)(comm, d, size, ty, offset, fd, &mut mh),
            }
        };
        ok("regMrDmaBuf", r)?;
        if mh.is_null() {
            return Err("regMrDmaBuf succeeded with a NULL mhandle".into());
        }
        Ok(mh)
    }

    /// What `getProperties` of this version says about device `dev`; the fields a version
    /// lacks are `None`.
    pub fn properties(&self, dev: c_int) -> Result<Properties, String> {
        macro_rules! get {
            ($t:expr, $ty:ty, |$p:ident| $newer:expr) => {{
                let mut $p = <$ty>::default();
                ok("getProperties", call!($t.getProperties)(dev, &mut $p))?;
                let (max_p2p_bytes, rail_plane, vprops) = $newer;
                Properties {
                    // SAFETY: the plugin's strings are NUL-terminated and live as long as the
                    // library (or are NULL).
                    name: cstr($p.name).ok_or("getProperties gave no name")?,
                    pci_path: cstr($p.pciPath),
                    guid: $p.guid,
                    ptr_support: $p.ptrSupport,
                    speed: $p.speed,
                    port: $p.port,
                    latency: $p.latency,
                    max_comms: $p.maxComms,
                    max_recvs: $p.maxRecvs,
                    max_p2p_bytes,
                    rail_plane,
                    vprops,
                }
            }};
        }
        // SAFETY: valid out-pointers of each version's properties type.
        let p = unsafe {
            match self.table {
                Table::V6(t) => get!(t, ncclNetProperties_v6_t, |p| (None, None, None)),
                Table::V7(t) => get!(t, ncclNetProperties_v7_t, |p| (None, None, None)),
                Table::V8(t) => get!(t, ncclNetProperties_v8_t, |p| (None, None, None)),
                Table::V9(t) => {
                    get!(t, ncclNetProperties_v9_t, |p| (Some(p.maxP2pBytes), None, vp(&p.vProps)))
                }
                Table::V10(t) => {
                    get!(t, ncclNetProperties_v9_t, |p| (Some(p.maxP2pBytes), None, vp(&p.vProps)))
                }
                Table::V11(t) => {
                    get!(t, ncclNetProperties_v11_t, |p| (Some(p.maxP2pBytes), None, vp(&p.vProps)))
                }
                Table::V12(t) => get!(t, ncclNetProperties_v12_t, |p| {
                    let v = &p.vProps;
                    let devs = v.devs[..(v.ndevs.clamp(0, 8) as usize)].to_vec();
                    (Some(p.maxP2pBytes), Some((p.railId, p.planeId)), Some(devs))
                }),
            }
        };
        Ok(p)
    }

    /// `makeVDevice` (v9+): one NCCL device fusing the ports `devs`; its index.
    pub fn make_vdevice(&self, devs: &[c_int]) -> Result<c_int, String> {
        let mut d = -1;
        let mut p12 =
            ncclNetVDeviceProps_v12_t { ndevs: devs.len() as c_int, ..Default::default() };
        let mut p9 = ncclNetVDeviceProps_v9_t { ndevs: devs.len() as c_int, ..Default::default() };
        for (i, &x) in devs.iter().enumerate() {
            if let Some(s) = p12.devs.get_mut(i) {
                *s = x;
            }
            if let Some(s) = p9.devs.get_mut(i) {
                *s = x;
            }
        }
        // SAFETY: valid out-pointer and props per the makeVDevice contract.
        let r = unsafe {
            match self.table {
                Table::V9(t) => call!(t.makeVDevice)(&mut d, &mut p9),
                Table::V10(t) => call!(t.makeVDevice)(&mut d, &mut p9),
                Table::V11(t) => call!(t.makeVDevice)(&mut d, &mut p9),
                Table::V12(t) => call!(t.makeVDevice)(&mut d, &mut p12),
                _ => return Err(format!("v{} has no makeVDevice", self.version)),
            }
        };
        ok("makeVDevice", r).map(|_| d)
    }

    /// The device `want` names: its name as the plugin reports it (`rxe0`, or `mlx5_0:1` where
    /// one device has several ports; the part before `:` is enough when unique), or its index
    /// among the devices the plugin offers after `NCCL_IB_HCA`. Returns the index and name.
    pub fn resolve(&self, want: &str) -> Result<(c_int, String), String> {
        let n = self.devices()?;
        let names =
            (0..n).map(|d| Ok(self.properties(d)?.name)).collect::<Result<Vec<_>, String>>()?;
        let found: Vec<usize> = match want.parse::<usize>() {
            Ok(i) if i < names.len() => vec![i],
            Ok(_) => vec![],
            Err(_) => {
                let exact: Vec<usize> = (0..names.len()).filter(|&i| names[i] == want).collect();
                if exact.is_empty() {
                    (0..names.len()).filter(|&i| names[i].split(':').next() == Some(want)).collect()
                } else {
                    exact
                }
            }
        };
        match found[..] {
            [i] => Ok((i as c_int, names[i].clone())),
            _ => Err(format!(
                "device {want:?} is not one device the plugin offers: {names:?} (NCCL_IB_HCA={})",
                std::env::var("NCCL_IB_HCA").unwrap_or_else(|_| "unset".into())
            )),
        }
    }

    pub fn dereg_mr(&self, comm: Ptr, mh: Ptr) -> Result<(), String> {
        // SAFETY: mh came from regMr.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.deregMr)(comm, mh),
                Table::V7(t) => call!(t.deregMr)(comm, mh),
                Table::V8(t) => call!(t.deregMr)(comm, mh),
                Table::V9(t) => call!(t.deregMr)(comm, mh),
                Table::V10(t) => call!(t.deregMr)(comm, mh),
                Table::V11(t) => call!(t.deregMr)(comm, mh),
                Table::V12(t) => call!(t.deregMr)(comm, mh),
            }
        };
        ok("deregMr", r)
    }

    /// One `isend`; `None` means "not yet, call again".
    pub fn isend(
        &self,
        comm: Ptr,
        data: *mut u8,
        size: usize,
        tag: c_int,
        mh: Ptr,
    ) -> Result<Option<Ptr>, String> {
        self.isend_p(comm, data, size, tag, mh, null_mut())
    }

    /// `isend` with a profiler handle (passed from v10 on).
    pub fn isend_p(
        &self,
        comm: Ptr,
        data: *mut u8,
        size: usize,
        tag: c_int,
        mh: Ptr,
        ph: Ptr,
    ) -> Result<Option<Ptr>, String> {
        let mut req = null_mut();
        let d = data.cast();
        // SAFETY: valid arguments per the isend contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.isend)(comm, d, int(size)?, tag, mh, &mut req),
                Table::V7(t) => call!(t.isend)(comm, d, int(size)?, tag, mh, &mut req),
                Table::V8(t) => call!(t.isend)(comm, d, int(size)?, tag, mh, &mut req),
                Table::V9(t) => call!(t.isend)(comm, d, size, tag, mh, &mut req),
                Table::V10(t) => call!(t.isend)(comm, d, size, tag, mh, ph, &mut req),
                Table::V11(t) => call!(t.isend)(comm, d, size, tag, mh, ph, &mut req),
                Table::V12(t) => call!(t.isend)(comm, d, size, tag, mh, ph, &mut req),
            }
        };
        ok("isend", r).map(|_| (!req.is_null()).then_some(req))
    }

    /// One `irecv` of `data.len()` buffers; `None` means "not yet, call again". With
    /// `optional`, the request slot is pre-set to `NCCL_NET_OPTIONAL_RECV_COMPLETION` as NCCL
    /// does for LL/LL128 receives.
    pub fn irecv(
        &self,
        comm: Ptr,
        data: &[*mut u8],
        sizes: &[usize],
        tags: &[c_int],
        mhs: &[Ptr],
        optional: bool,
    ) -> Result<Option<Ptr>, String> {
        self.irecv_p(comm, data, sizes, tags, mhs, optional, &[])
    }

    /// `irecv` with profiler handles, one per buffer (passed from v10 on; empty: NULL).
    #[allow(clippy::too_many_arguments)]
    pub fn irecv_p(
        &self,
        comm: Ptr,
        data: &[*mut u8],
        sizes: &[usize],
        tags: &[c_int],
        mhs: &[Ptr],
        optional: bool,
        phs: &[Ptr],
    ) -> Result<Option<Ptr>, String> {
        let n = data.len();
        assert!(phs.is_empty() || phs.len() == n);
        let mut ph: [Ptr; 8] = [null_mut(); 8];
        ph[..phs.len()].copy_from_slice(phs);
        let ph = if phs.is_empty() { null_mut() } else { ph.as_mut_ptr() };
        assert!(n <= 8 && sizes.len() == n && tags.len() == n && mhs.len() == n);
        let mut d: [Ptr; 8] = [null_mut(); 8];
        let mut s64 = [0usize; 8];
        let mut s32 = [0 as c_int; 8];
        let mut tg = [0 as c_int; 8];
        let mut mh: [Ptr; 8] = [null_mut(); 8];
        for i in 0..n {
            d[i] = data[i].cast();
            s64[i] = sizes[i];
            s32[i] = int(sizes[i]).unwrap_or(c_int::MAX);
            tg[i] = tags[i];
            mh[i] = mhs[i];
        }
        let mut req: Ptr =
            if optional { NCCL_NET_OPTIONAL_RECV_COMPLETION as usize as Ptr } else { null_mut() };
        let n = n as c_int;
        let (d, tg, mh) = (d.as_mut_ptr(), tg.as_mut_ptr(), mh.as_mut_ptr());
        // SAFETY: valid arrays of n entries per the irecv contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.irecv)(comm, n, d, s32.as_mut_ptr(), tg, mh, &mut req),
                Table::V7(t) => call!(t.irecv)(comm, n, d, s32.as_mut_ptr(), tg, mh, &mut req),
                Table::V8(t) => call!(t.irecv)(comm, n, d, s32.as_mut_ptr(), tg, mh, &mut req),
                Table::V9(t) => call!(t.irecv)(comm, n, d, s64.as_mut_ptr(), tg, mh, &mut req),
                Table::V10(t) => call!(t.irecv)(comm, n, d, s64.as_mut_ptr(), tg, mh, ph, &mut req),
                Table::V11(t) => call!(t.irecv)(comm, n, d, s64.as_mut_ptr(), tg, mh, ph, &mut req),
                Table::V12(t) => call!(t.irecv)(comm, n, d, s64.as_mut_ptr(), tg, mh, ph, &mut req),
            }
        };
        ok("irecv", r)?;
        if req as usize == NCCL_NET_OPTIONAL_RECV_COMPLETION as usize {
            return Err("irecv left the optional-completion marker in *request".into());
        }
        Ok((!req.is_null()).then_some(req))
    }

    /// `iflush` of one buffer; `None` when the plugin says there is nothing to flush.
    pub fn iflush(
        &self,
        comm: Ptr,
        data: *mut u8,
        size: c_int,
        mh: Ptr,
    ) -> Result<Option<Ptr>, String> {
        let mut req = null_mut();
        let (mut d, mut s, mut m): (Ptr, c_int, Ptr) = (data.cast(), size, mh);
        // SAFETY: one-entry arrays per the iflush contract.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V7(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V8(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V9(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V10(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V11(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
                Table::V12(t) => call!(t.iflush)(comm, 1, &mut d, &mut s, &mut m, &mut req),
            }
        };
        ok("iflush", r).map(|_| (!req.is_null()).then_some(req))
    }

    /// One `test`; `Some(sizes)` once done (8 slots, as NCCL passes them, zeroed first).
    pub fn test(&self, req: Ptr) -> Result<Option<[c_int; 8]>, String> {
        let mut done = 0;
        let mut sizes = [0 as c_int; 8];
        let s = sizes.as_mut_ptr();
        // SAFETY: req came from isend/irecv/iflush and is not yet reported done.
        let r = unsafe {
            match self.table {
                Table::V6(t) => call!(t.test)(req, &mut done, s),
                Table::V7(t) => call!(t.test)(req, &mut done, s),
                Table::V8(t) => call!(t.test)(req, &mut done, s),
                Table::V9(t) => call!(t.test)(req, &mut done, s),
                Table::V10(t) => call!(t.test)(req, &mut done, s),
                Table::V11(t) => call!(t.test)(req, &mut done, s),
                Table::V12(t) => call!(t.test)(req, &mut done, s),
            }
        };
        ok("test", r).map(|_| (done == 1).then_some(sizes))
    }

    /// `closeSend`, `closeRecv` or `closeListen`.
    pub fn close(&self, which: Close, comm: Ptr) -> Result<(), String> {
        macro_rules! pick {
            ($t:expr) => {
                match which {
                    Close::Send => call!($t.closeSend)(comm),
                    Close::Recv => call!($t.closeRecv)(comm),
                    Close::Listen => call!($t.closeListen)(comm),
                }
            };
        }
        // SAFETY: comm came from connect/accept/listen and is closed once.
        let r = unsafe {
            match self.table {
                Table::V6(t) => pick!(t),
                Table::V7(t) => pick!(t),
                Table::V8(t) => pick!(t),
                Table::V9(t) => pick!(t),
                Table::V10(t) => pick!(t),
                Table::V11(t) => pick!(t),
                Table::V12(t) => pick!(t),
            }
        };
        ok("close", r)
    }
}

/// A device as `getProperties` describes it, in any version.
#[derive(Clone, Debug)]
pub struct Properties {
    /// The plugin's name for it (`rxe0`, `mlx5_0:1`).
    pub name: String,
    pub pci_path: Option<String>,
    pub guid: u64,
    pub ptr_support: c_int,
    /// Mb/s.
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    /// v9 and later.
    pub max_p2p_bytes: Option<usize>,
    /// `railId` and `planeId`: v12.
    pub rail_plane: Option<(i16, i16)>,
    /// The physical ports of the device (`vProps`): v9 and later.
    pub vprops: Option<Vec<c_int>>,
}

/// The ports a v9–v11 `vProps` lists.
fn vp(v: &ncclNetVDeviceProps_v9_t) -> Option<Vec<c_int>> {
    Some(v.devs[..(v.ndevs.clamp(0, 4) as usize)].to_vec())
}

/// A string the plugin returned.
///
/// # Safety
/// `p` is NULL or NUL-terminated and valid while the result is built.
unsafe fn cstr(p: *const c_char) -> Option<String> {
    // SAFETY: per the contract above.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[derive(Clone, Copy, Debug)]
pub enum Close {
    Send,
    Recv,
    Listen,
}
