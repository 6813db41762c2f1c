//! Drives a loaded plugin through any ABI version (v6–v12) the way NCCL's proxy thread does,
//! behind one interface. Used by the `ferroce` tool and the tests; the plugin never calls it.
//!
//! Sizes are `size_t` here; for v6–v8 they are narrowed to `int` exactly as NCCL's own shims do,
//! so a test through v6 exercises the plugin's `int` entry points.
//!
//! Every call takes the newest arguments and goes through its member's trait (`shapes!`),
//! which has one impl per signature the member has had; each version's `Members` come from
//! the plugin's list of versions (`ferroce::ncclnet_versions!`). So a new version whose members
//! keep known signatures needs nothing here, and a new signature is one more line in `shapes!`.
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

/// A plugin opened at one ABI version.
pub struct Driver<'a> {
    lib: &'a Library,
    /// Read again after `init`: a plugin may fill its table in there (the Mellanox plugin
    /// exports name and `init` only, and copies the rest in at `init`), as NCCL reads the
    /// members only after `init`.
    m: std::cell::Cell<Members<'a>>,
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

/// What a member returned, or why it could not be called (a size that does not fit its `int`).
type Called = Result<ncclResult_t, String>;

/// One trait per member, which calls it with the newest arguments whatever its signature: one
/// impl per signature the member has had, which passes what that signature takes, as NCCL's
/// shims do (no context before v11, `int` sizes before v8/v9, ...).
macro_rules! shapes {
    ($($tr:ident $params:tt { $(fn $ps:tt => $es:tt;)* })*) => {$(
        shape!($tr $params);
        $(shape!($tr $params $ps $es);)*
    )*};
}

/// The trait of one member (its newest arguments), or its impl for one signature.
macro_rules! shape {
    ($tr:ident ($($a:ident: $at:ty),*)) => {
        trait $tr {
            /// # Safety
            /// The member's contract.
            #[allow(clippy::too_many_arguments)]
            unsafe fn call(&self, $($a: $at),*) -> Called;
        }
    };
    ($tr:ident ($($a:ident: $at:ty),*) ($($p:ty),*) ($($e:expr),*)) => {
        impl $tr for unsafe extern "C" fn($($p),*) -> ncclResult_t {
            #[allow(unused_variables, clippy::too_many_arguments)]
            unsafe fn call(&self, $($a: $at),*) -> Called {
                // SAFETY: the member's contract, which the caller upholds.
                Ok(unsafe { (*self)($($e),*) })
            }
        }
    };
}

type Log = ncclDebugLogger_t;
type Prof = ncclProfilerCallback_t;
type Cfg = *mut ncclNetCommConfig_v10_t;
type DevComm = *mut *mut ncclNetDeviceHandle_v7_t;
type VProps9 = ncclNetVDeviceProps_v9_t;
type VProps12 = ncclNetVDeviceProps_v12_t;

shapes! {
    Init(ctx: *mut Ptr, id: u64, cfg: Cfg, log: Log, prof: Prof) {
        fn(Log) => (log);
        fn(Log, Prof) => (log, prof);
        fn(*mut Ptr, u64, Cfg, Log, Prof) => (ctx, id, cfg, log, prof);
    }
    Devices(n: *mut c_int) {
        fn(*mut c_int) => (n);
    }
    Listen(ctx: Ptr, dev: c_int, h: Ptr, comm: *mut Ptr) {
        fn(c_int, Ptr, *mut Ptr) => (dev, h, comm);
        fn(Ptr, c_int, Ptr, *mut Ptr) => (ctx, dev, h, comm);
    }
    Connect(ctx: Ptr, dev: c_int, cfg: Cfg, h: Ptr, comm: *mut Ptr, dc: DevComm) {
        fn(c_int, Ptr, *mut Ptr) => (dev, h, comm);
        fn(c_int, Ptr, *mut Ptr, DevComm) => (dev, h, comm, dc);
        fn(c_int, Cfg, Ptr, *mut Ptr, DevComm) => (dev, cfg, h, comm, dc);
        fn(Ptr, c_int, Ptr, *mut Ptr, DevComm) => (ctx, dev, h, comm, dc);
    }
    Accept(listen: Ptr, comm: *mut Ptr, dc: DevComm) {
        fn(Ptr, *mut Ptr) => (listen, comm);
        fn(Ptr, *mut Ptr, DevComm) => (listen, comm, dc);
    }
    RegMr(comm: Ptr, d: Ptr, size: usize, ty: c_int, mh: *mut Ptr) {
        fn(Ptr, Ptr, c_int, c_int, *mut Ptr) => (comm, d, int(size)?, ty, mh);
        fn(Ptr, Ptr, usize, c_int, *mut Ptr) => (comm, d, size, ty, mh);
    }
    RegMrDmaBuf(comm: Ptr, d: Ptr, size: usize, ty: c_int, offset: u64, fd: c_int, mh: *mut Ptr) {
        fn(Ptr, Ptr, usize, c_int, u64, c_int, *mut Ptr) => (comm, d, size, ty, offset, fd, mh);
    }
    DeregMr(comm: Ptr, mh: Ptr) {
        fn(Ptr, Ptr) => (comm, mh);
    }
    Isend(comm: Ptr, d: Ptr, size: usize, tag: c_int, mh: Ptr, ph: Ptr, req: *mut Ptr) {
        fn(Ptr, Ptr, c_int, c_int, Ptr, *mut Ptr) => (comm, d, int(size)?, tag, mh, req);
        fn(Ptr, Ptr, usize, c_int, Ptr, *mut Ptr) => (comm, d, size, tag, mh, req);
        fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, *mut Ptr) => (comm, d, size, tag, mh, ph, req);
    }
    Irecv(
        comm: Ptr,
        n: c_int,
        d: *mut Ptr,
        s64: *mut usize,
        s32: *mut c_int,
        tg: *mut c_int,
        mh: *mut Ptr,
        ph: *mut Ptr,
        req: *mut Ptr
    ) {
        fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut c_int, *mut Ptr, *mut Ptr) =>
            (comm, n, d, s32, tg, mh, req);
        fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr) =>
            (comm, n, d, s64, tg, mh, req);
        fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr, *mut Ptr) =>
            (comm, n, d, s64, tg, mh, ph, req);
    }
    Iflush(comm: Ptr, n: c_int, d: *mut Ptr, s: *mut c_int, mh: *mut Ptr, req: *mut Ptr) {
        fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut Ptr, *mut Ptr) => (comm, n, d, s, mh, req);
    }
    Test(req: Ptr, done: *mut c_int, sizes: *mut c_int) {
        fn(Ptr, *mut c_int, *mut c_int) => (req, done, sizes);
    }
    Release(p: Ptr) {
        fn(Ptr) => (p);
    }
    MakeVDevice(d: *mut c_int, devs: &[c_int]) {
        fn(*mut c_int, *mut VProps9) => (d, &mut VProps9 { ndevs: len(devs), devs: ports(devs) });
        fn(*mut c_int, *mut VProps12) => (d, &mut VProps12 { ndevs: len(devs), devs: ports(devs) });
    }
}

fn len(devs: &[c_int]) -> c_int {
    devs.len() as c_int
}

/// The first `N` of `devs`, zero-padded.
fn ports<const N: usize>(devs: &[c_int]) -> [c_int; N] {
    let mut slots = [0; N];
    for (s, &d) in slots.iter_mut().zip(devs) {
        *s = d;
    }
    slots
}

/// `getProperties`, for the properties struct of each version.
trait GetProperties {
    /// # Safety
    /// The member's contract.
    unsafe fn call(&self, dev: c_int) -> Result<Properties, String>;
}

impl<P: Default + Read> GetProperties for unsafe extern "C" fn(c_int, *mut P) -> ncclResult_t {
    unsafe fn call(&self, dev: c_int) -> Result<Properties, String> {
        let mut p = P::default();
        // SAFETY: a valid out-pointer of the version's properties type.
        ok("getProperties", unsafe { (*self)(dev, &mut p) })?;
        // SAFETY: what the plugin just wrote.
        unsafe { p.read() }
    }
}

/// A version's properties struct, read into [`Properties`].
trait Read {
    /// # Safety
    /// Its strings are NULL or NUL-terminated, as the plugin writes them.
    unsafe fn read(&self) -> Result<Properties, String>;
}

/// [`Read`] for each properties struct: the fields every version has, then what `$newer`
/// gives from `$p` (`maxP2pBytes`, the rail and plane, the ports of `vProps`).
macro_rules! read {
    ($($ty:ty => |$p:ident| $newer:expr;)*) => {$(
        impl Read for $ty {
            unsafe fn read(&self) -> Result<Properties, String> {
                let $p = self;
                let (max_p2p_bytes, rail_plane, vprops) = $newer;
                Ok(Properties {
                    // SAFETY: the plugin's strings are NUL-terminated and live as long as the
                    // library (or are NULL).
                    name: unsafe { cstr($p.name) }.ok_or("getProperties gave no name")?,
                    // SAFETY: as above.
                    pci_path: unsafe { cstr($p.pciPath) },
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
                })
            }
        }
    )*};
}
read! {
    ncclNetProperties_v6_t => |p| (None, None, None);
    ncclNetProperties_v7_t => |p| (None, None, None);
    ncclNetProperties_v8_t => |p| (None, None, None);
    ncclNetProperties_v9_t => |p| (Some(p.maxP2pBytes), None, vp(p.vProps.ndevs, &p.vProps.devs));
    ncclNetProperties_v11_t => |p| (Some(p.maxP2pBytes), None, vp(p.vProps.ndevs, &p.vProps.devs));
    ncclNetProperties_v12_t => |p| {
        let rail_plane = Some((p.railId, p.planeId));
        (Some(p.maxP2pBytes), rail_plane, vp(p.vProps.ndevs, &p.vProps.devs))
    };
}

/// The ports a `vProps` lists.
fn vp(ndevs: c_int, devs: &[c_int]) -> Option<Vec<c_int>> {
    Some(devs[..(ndevs.clamp(0, devs.len() as c_int) as usize)].to_vec())
}

/// The members of one version's table, each behind the trait that calls it with the newest
/// arguments: `None` where the version has no such member, `Some(None)` where it is NULL.
#[allow(non_snake_case)]
#[derive(Clone, Copy, Default)]
struct Members<'a> {
    init: Option<Option<&'a dyn Init>>,
    devices: Option<Option<&'a dyn Devices>>,
    getProperties: Option<Option<&'a dyn GetProperties>>,
    listen: Option<Option<&'a dyn Listen>>,
    connect: Option<Option<&'a dyn Connect>>,
    accept: Option<Option<&'a dyn Accept>>,
    regMr: Option<Option<&'a dyn RegMr>>,
    regMrDmaBuf: Option<Option<&'a dyn RegMrDmaBuf>>,
    deregMr: Option<Option<&'a dyn DeregMr>>,
    isend: Option<Option<&'a dyn Isend>>,
    irecv: Option<Option<&'a dyn Irecv>>,
    iflush: Option<Option<&'a dyn Iflush>>,
    test: Option<Option<&'a dyn Test>>,
    closeSend: Option<Option<&'a dyn Release>>,
    closeRecv: Option<Option<&'a dyn Release>>,
    closeListen: Option<Option<&'a dyn Release>>,
    makeVDevice: Option<Option<&'a dyn MakeVDevice>>,
    finalize: Option<Option<&'a dyn Release>>,
    /// Members of a device plugin: never called (a host plugin's are NULL), here so that every
    /// member a version lists has its field.
    #[allow(dead_code)]
    getDeviceMr: Option<Option<&'a dyn std::any::Any>>,
    #[allow(dead_code)]
    irecvConsumed: Option<Option<&'a dyn std::any::Any>>,
    #[allow(dead_code)]
    setNetAttr: Option<Option<&'a dyn std::any::Any>>,
}

/// The member, or why it cannot be called.
fn member<T>(m: Option<Option<T>>) -> Result<T, String> {
    m.ok_or("not a member of this version")?.ok_or_else(|| "member is NULL".to_string())
}

/// The [`Members`] of table `$t`: those named, the others `None`.
macro_rules! members {
    ($t:ident: $($f:ident)*) => {
        Members { $($f: Some($t.$f.as_ref().map(|f| f as _)),)* ..Default::default() }
    };
}

/// [`Members`] of each listed version, and the table of a version in a library.
macro_rules! versions {
    ($($n:literal $v:ident $t:ident { $($extra:ident)* }),*) => {
        $(impl<'a> From<&'a $t> for Members<'a> {
            // The newest versions list every member: the update then has nothing left to fill.
            #[allow(clippy::needless_update)]
            fn from(t: &'a $t) -> Members<'a> {
                members!(t: init devices getProperties listen connect accept regMr regMrDmaBuf
                    deregMr isend irecv iflush test closeSend closeRecv closeListen $($extra)*)
            }
        })*

        /// The members of `lib`'s table of `version`.
        ///
        /// # Safety
        /// The symbol of each version has that version's table type.
        unsafe fn open_table(lib: &Library, version: u32) -> Result<Members<'_>, String> {
            let sym = CString::new(format!("ncclNetPlugin_v{version}")).expect("no NUL");
            let missing = || format!("no symbol ncclNetPlugin_v{version}");
            match version {
                // SAFETY: per the contract above.
                $($n => Ok(unsafe { lib.table::<$t>(&sym) }.ok_or_else(missing)?.into()),)*
                v => Err(format!("no ABI version {v}")),
            }
        }
    };
}
ferroce::ncclnet_versions!(versions);

impl<'a> Driver<'a> {
    pub fn new(lib: &'a Library, version: u32) -> Result<Driver<'a>, String> {
        // SAFETY: each symbol has the table type of its version; the members do not outlive
        // `lib` (the lifetime ties them).
        let m = unsafe { open_table(lib, version) }?;
        Ok(Driver { lib, m: std::cell::Cell::new(m), version, profiler: None })
    }

    /// The newest ABI version `lib` exports (of those ferroce knows): how NCCL picks one.
    pub fn newest(lib: &'a Library) -> Result<Driver<'a>, String> {
        // VERSIONS lists the newest first.
        ferroce::ffi::VERSIONS
            .iter()
            .find_map(|&v| Driver::new(lib, v).ok())
            .ok_or_else(|| format!("{}: no ncclNetPlugin_v6..v12 table", lib.opened_as))
    }

    /// `init`; the returned context is NULL for v6–v10 (their calls need none).
    pub fn init(&self, comm_id: u64) -> Result<Ptr, String> {
        self.init_with_tc(comm_id, -1)
    }

    /// `init` with a communicator traffic class (v11+; -1 for none).
    pub fn init_with_tc(&self, comm_id: u64, traffic_class: c_int) -> Result<Ptr, String> {
        let (r, ctx) = self.init_raw(comm_id, traffic_class)?;
        ok("init", r).map(|_| ctx)
    }

    /// `init` as it returned, with the context it left (NULL for v6–v10).
    pub fn init_raw(
        &self,
        comm_id: u64,
        traffic_class: c_int,
    ) -> Result<(ncclResult_t, Ptr), String> {
        let log = capture_logger();
        let mut ctx = null_mut();
        let mut cfg = ncclNetCommConfig_v10_t { trafficClass: traffic_class };
        // SAFETY: valid arguments per each version's init contract.
        let r = unsafe {
            member(self.m.get().init)?.call(&mut ctx, comm_id, &mut cfg, log, self.profiler)
        };
        // SAFETY: as in `new`.
        self.m.set(unsafe { open_table(self.lib, self.version) }?);
        Ok((r?, ctx))
    }

    /// `finalize` for v11+; nothing for older versions (NCCL never reaches theirs).
    pub fn finalize(&self, ctx: Ptr) -> Result<(), String> {
        if self.m.get().finalize.is_none() {
            return Ok(());
        }
        // SAFETY: ctx came from init.
        let r = unsafe { member(self.m.get().finalize)?.call(ctx) };
        ok("finalize", r?)
    }

    pub fn devices(&self) -> Result<c_int, String> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { member(self.m.get().devices)?.call(&mut n) };
        ok("devices", r?).map(|_| n)
    }

    pub fn listen(&self, ctx: Ptr, dev: c_int) -> Result<([u8; 128], Ptr), String> {
        let mut handle = [0u8; 128];
        let h = handle.as_mut_ptr().cast();
        let mut comm = null_mut();
        // SAFETY: valid arguments per the listen contract.
        let r = unsafe { member(self.m.get().listen)?.call(ctx, dev, h, &mut comm) };
        ok("listen", r?)?;
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
            member(self.m.get().connect)?.call(ctx, dev, &mut cfg, h, &mut comm, &mut dc)
        };
        ok("connect", r?).map(|_| (!comm.is_null()).then_some(comm))
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
        let r = unsafe { member(self.m.get().accept)?.call(listen, &mut comm, &mut dc) };
        ok("accept", r?).map(|_| (!comm.is_null()).then_some(comm))
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
        // SAFETY: valid arguments per the regMr contract; the memory outlives the registration.
        let r = unsafe { member(self.m.get().regMr)?.call(comm, data.cast(), size, ty, &mut mh) };
        registered("regMr", r?, mh)
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
        let reg = member(self.m.get().regMrDmaBuf)?;
        // SAFETY: valid arguments per the regMrDmaBuf contract (same in every version).
        let r = unsafe { reg.call(comm, d, size, ty, offset, fd, &mut mh) };
        registered("regMrDmaBuf", r?, mh)
    }

    /// What `getProperties` of this version says about device `dev`; the fields a version
    /// lacks are `None`.
    pub fn properties(&self, dev: c_int) -> Result<Properties, String> {
        // SAFETY: the plugin's getProperties contract.
        unsafe { member(self.m.get().getProperties)?.call(dev) }
    }

    /// `makeVDevice` (v9+): one NCCL device fusing the ports `devs`; its index.
    pub fn make_vdevice(&self, devs: &[c_int]) -> Result<c_int, String> {
        if self.m.get().makeVDevice.is_none() {
            return Err(format!("v{} has no makeVDevice", self.version));
        }
        let mut d = -1;
        // SAFETY: valid out-pointer and props per the makeVDevice contract.
        let r = unsafe { member(self.m.get().makeVDevice)?.call(&mut d, devs) };
        ok("makeVDevice", r?).map(|_| d)
    }

    /// The device `want` names: its name as the plugin reports it (`rxe0`), with `:port` (the
    /// port NCCL is told) where one device has several ports (`mlx5_0:3`), or its index among
    /// the devices the plugin offers after `NCCL_IB_HCA`. Returns the index and name.
    pub fn resolve(&self, want: &str) -> Result<(c_int, String), String> {
        let n = self.devices()?;
        let named = (0..n)
            .map(|d| self.properties(d).map(|p| (p.name, p.port)))
            .collect::<Result<Vec<_>, String>>()?;
        // `name`, or `name:port` with the port NCCL is told (the ports of a dual-port device
        // share its name, as in NCCL's NCCL_NET_FORCE_MERGE).
        let (name, port) = match want.rsplit_once(':').map(|(n, p)| (n, p.parse::<c_int>())) {
            Some((n, Ok(p))) => (n, Some(p)),
            _ => (want, None),
        };
        let found: Vec<usize> = match want.parse::<usize>() {
            Ok(i) if i < named.len() => vec![i],
            Ok(_) => vec![],
            Err(_) => (0..named.len())
                .filter(|&i| named[i].0 == name && port.is_none_or(|p| p == named[i].1))
                .collect(),
        };
        let names: Vec<String> = named.iter().map(|(n, p)| format!("{n}:{p}")).collect();
        match found[..] {
            [i] => Ok((i as c_int, named[i].0.clone())),
            _ => Err(format!(
                "device {want:?} is not one device the plugin offers: {names:?} (NCCL_IB_HCA={})",
                std::env::var("NCCL_IB_HCA").unwrap_or_else(|_| "unset".into())
            )),
        }
    }

    pub fn dereg_mr(&self, comm: Ptr, mh: Ptr) -> Result<(), String> {
        // SAFETY: mh came from regMr.
        let r = unsafe { member(self.m.get().deregMr)?.call(comm, mh) };
        ok("deregMr", r?)
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
        // SAFETY: valid arguments per the isend contract.
        let r = unsafe {
            member(self.m.get().isend)?.call(comm, data.cast(), size, tag, mh, ph, &mut req)
        };
        ok("isend", r?).map(|_| (!req.is_null()).then_some(req))
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
        let (s64, s32) = (s64.as_mut_ptr(), s32.as_mut_ptr());
        // SAFETY: valid arrays of n entries per the irecv contract.
        let r =
            unsafe { member(self.m.get().irecv)?.call(comm, n, d, s64, s32, tg, mh, ph, &mut req) };
        ok("irecv", r?)?;
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
        let r =
            unsafe { member(self.m.get().iflush)?.call(comm, 1, &mut d, &mut s, &mut m, &mut req) };
        ok("iflush", r?).map(|_| (!req.is_null()).then_some(req))
    }

    /// One `test`; `Some(sizes)` once done (8 slots, as NCCL passes them, zeroed first).
    pub fn test(&self, req: Ptr) -> Result<Option<[c_int; 8]>, String> {
        let mut done = 0;
        let mut sizes = [0 as c_int; 8];
        // SAFETY: req came from isend/irecv/iflush and is not yet reported done.
        let r = unsafe { member(self.m.get().test)?.call(req, &mut done, sizes.as_mut_ptr()) };
        ok("test", r?).map(|_| (done == 1).then_some(sizes))
    }

    /// `closeSend`, `closeRecv` or `closeListen`.
    pub fn close(&self, which: Close, comm: Ptr) -> Result<(), String> {
        let close = match which {
            Close::Send => self.m.get().closeSend,
            Close::Recv => self.m.get().closeRecv,
            Close::Listen => self.m.get().closeListen,
        };
        // SAFETY: comm came from connect/accept/listen and is closed once.
        let r = unsafe { member(close)?.call(comm) };
        ok("close", r?)
    }
}

/// A registration's handle, once `what` succeeded with one.
fn registered(what: &str, r: ncclResult_t, mh: Ptr) -> Result<Ptr, String> {
    ok(what, r)?;
    if mh.is_null() {
        return Err(format!("{what} succeeded with a NULL mhandle"));
    }
    Ok(mh)
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
