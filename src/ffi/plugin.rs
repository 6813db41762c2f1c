//! The plugin's entry points, written once against the newest signatures: `entries` fills each
//! table member with one of these where its signature is the newest, else with a shim that
//! adapts an older signature (`legacy` holds the shims several versions share).
//!
//! Every function is plumbing around a safe call: clear the "not ready" outputs, run the body in
//! [`guard`], write outputs only on success.

use std::ffi::{CString, c_char, c_int, c_void};
use std::mem::MaybeUninit;
use std::sync::Mutex;

use super::abi::*;
use super::handles::{self, AnyComm, clear, out};
use super::narrow::Narrow;
use super::{guard, log};
use crate::error::{Error, Result};
use crate::transport;
use crate::transport::connects::{self, Step};
use crate::transport::data::{Buf, FLUSH_BASE, MAX_RECVS, ReqKind, buf_within};
use crate::transport::mr_cache::MemKind;
use crate::transport::props::Props;
use crate::transport::reg;
use crate::transport::setup::Listener;
use ferroce_core::setup::wire::{self, HANDLE_SIZE};

pub(super) unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    log::install(logger);
    // SAFETY: NCCL passes a valid ctx slot (or NULL, rejected by `out`).
    unsafe { clear(ctx) };
    guard("init", || {
        // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
        let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.trafficClass);
        // SAFETY: checked non-NULL by `out`; valid for writes per the ABI. Checked before the
        // context exists, so a context is never made that NCCL cannot finalize.
        let slot = unsafe { out(ctx, "ctx") }?;
        let c = transport::net::init(comm_id, tc)?;
        c.set_profiler(super::profiler::of(profiler));
        *slot = handles::ctx_into_raw(c);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    // NCCL finalizes the NULL context of an `init` that failed (no device on this host, say):
    // nothing was made, so there is nothing to end and nothing to warn about.
    if ctx.is_null() {
        ::log::debug!("finalize: NULL context (init failed or never ran); nothing to do");
        return ncclResult_t::ncclSuccess;
    }
    guard("finalize", || {
        // A context finalized twice, or never ours, is an error that touches nothing.
        let owner = ctx as usize;
        let ctx = handles::ctx_finalize(ctx)?;
        end_context(owner);
        transport::net::finalize(ctx, end_everything);
        Ok(())
    })
}

/// A context's `finalize`: ends what was made under it and NCCL left open (its connects in
/// progress, listeners and comms; other contexts' stay), with one WARN and the counts.
fn end_context(owner: usize) {
    let connects = transport::connects::end_owned(owner);
    let e = handles::end_owned(Some(owner));
    if connects + e.listeners + e.comms > 0 {
        ::log::warn!(
            "finalize: closed {} listener(s) and {} comm(s) and ended {connects} connect(s) in \
             progress that this communicator left open; calls on them are errors from now on \
             (other communicators' are untouched)",
            e.listeners,
            e.comms
        );
    }
    if e.busy > 0 {
        ::log::warn!(
            "finalize: {} of this communicator's listener(s) or comm(s) were still inside a call \
             on another thread; they stay alive",
            e.busy
        );
    }
}

/// The last `finalize`, before the device state goes: ends every connect in progress and
/// every listener, comm and registration NCCL still holds, so nothing holds the device state
/// any more and the library can be unloaded.
fn end_everything() {
    transport::connects::end_all();
    let e = handles::end_all();
    if e.listeners + e.comms > 0 {
        ::log::warn!(
            "finalize: closed {} listener(s) and {} comm(s) NCCL never closed; calls on them \
             are errors from now on",
            e.listeners,
            e.comms
        );
    }
    if e.mrs > 0 {
        ::log::warn!(
            "finalize: deregistered {} memory registration(s) NCCL never deregistered; deregMr \
             on them is an error from now on",
            e.mrs
        );
    }
    if e.busy > 0 {
        ::log::warn!(
            "finalize: {} listener(s) or comm(s) were still inside a call on another thread; \
             they, the registrations and the device state stay alive",
            e.busy
        );
    }
}

pub(super) unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        let n = transport::net::current()?.ndevices();
        // SAFETY: NCCL passes a valid int pointer (NULL rejected by `out`).
        *unsafe { out(ndev, "ndev") }? = c_int::try_from(n).unwrap_or(c_int::MAX);
        Ok(())
    })
}

/// `getProperties` of every version: the newest properties, narrowed to the version's struct.
pub(super) unsafe extern "C" fn get_properties<T: Narrow<ncclNetProperties_v12_t>>(
    dev: c_int,
    props: *mut T,
) -> ncclResult_t {
    guard("getProperties", || {
        let p = properties(dev)?;
        // SAFETY: NCCL passes a valid properties struct of this version (NULL rejected).
        *unsafe { out(props, "props") }? = T::narrow(&p);
        Ok(())
    })
}

/// The properties of device `dev` in the newest struct (v12).
fn properties(dev: c_int) -> Result<ncclNetProperties_v12_t> {
    let p = transport::net::current()?.props(dev)?;
    let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V12 as usize];
    for (slot, &m) in devs.iter_mut().zip(&p.members) {
        *slot = m as c_int;
    }
    let undef = NCCL_NET_ID_UNDEF as i16;
    Ok(ncclNetProperties_v12_t {
        name: intern(&p.name),
        pciPath: p.pci_path.as_deref().map_or(std::ptr::null_mut(), intern),
        guid: p.guid,
        ptrSupport: ptr_support(&p),
        regIsGlobal: 1,
        forceFlush: 0,
        speed: p.speed_mbps,
        port: p.port,
        latency: p.latency,
        maxComms: p.max_comms,
        maxRecvs: p.max_recvs as c_int,
        netDeviceType: ncclNetDeviceType::NCCL_NET_DEVICE_HOST,
        netDeviceVersion: NCCL_NET_DEVICE_INVALID_VERSION as c_int,
        vProps: ncclNetVDeviceProps_v12_t { ndevs: p.members.len() as c_int, devs },
        maxP2pBytes: ferroce_core::data::MAX_MESSAGE as usize,
        maxCollBytes: NCCL_MAX_COLLNET_SIZE as usize,
        maxMultiRequestSize: 1,
        railId: p.rail.unwrap_or(undef),
        planeId: p.plane.unwrap_or(undef),
    })
}

/// `makeVDevice` of v12: a fused device over `props->devs[..ndevs]` (physical ports), its
/// index in `*d`.
pub(super) unsafe extern "C" fn make_vdevice(
    d: *mut c_int,
    props: *mut ncclNetVDeviceProps_v12_t,
) -> ncclResult_t {
    guard("makeVDevice", || {
        // SAFETY: NCCL passes NULL or a valid props struct for the call.
        let p = unsafe { props.as_ref() }.ok_or_else(|| Error::Internal("NULL props".into()))?;
        let n = usize::try_from(p.ndevs).ok().filter(|&n| n <= p.devs.len());
        let n =
            n.ok_or_else(|| Error::InvalidUsage(format!("makeVDevice of {} ports", p.ndevs)))?;
        let dev = transport::net::current()?.make_vdevice(&p.devs[..n])?;
        // SAFETY: a valid int per the ABI (NULL rejected by `out`).
        *unsafe { out(d, "d") }? = dev;
        Ok(())
    })
}

/// `NCCL_PTR_HOST`, plus `_CUDA` with peer memory, plus `_DMABUF` where dma-buf works.
fn ptr_support(p: &Props) -> c_int {
    let mut bits = NCCL_PTR_HOST;
    if p.cuda {
        bits |= NCCL_PTR_CUDA;
    }
    if p.dmabuf {
        bits |= NCCL_PTR_DMABUF;
    }
    bits as c_int
}

/// NCCL may keep the `name` and `pciPath` pointers of the properties, so they must outlive the
/// device state; each distinct string is stored once for the life of the library.
fn intern(s: &str) -> *mut c_char {
    static STRINGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());
    let mut strings = STRINGS.lock().unwrap_or_else(|p| p.into_inner());
    let c = CString::new(s.replace('\0', "")).unwrap_or_default();
    if let Some(hit) = strings.iter().find(|x| **x == c) {
        return hit.as_ptr().cast_mut();
    }
    // The heap buffer of a CString does not move when the Vec reallocates.
    let ptr = c.as_ptr().cast_mut();
    strings.push(c);
    ptr
}

/// Where a connect in progress keeps its id in NCCL's handle buffer between `connect` calls
/// (the bytes `listen` leaves zero and never sends).
const STATE: usize = wire::HANDLE_STATE_OFFSET;

/// NCCL's handle buffer, NULL rejected.
///
/// # Safety
/// `handle` must be NULL or valid for reads and writes of `HANDLE_SIZE` (128) bytes, with no
/// other reference to them, for `'a`.
unsafe fn handle_bytes<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    // SAFETY: per the contract.
    unsafe { handle.cast::<[u8; HANDLE_SIZE]>().as_mut() }
        .ok_or_else(|| Error::Internal("NULL handle".into()))
}

pub(super) unsafe extern "C" fn listen(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(listen_comm) };
    guard("listen", || {
        let l = Listener::new(&*handles::ctx(ctx)?, dev)?;
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes, for the call.
        l.handle().encode(unsafe { handle_bytes(handle) }?);
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(listen_comm, "listenComm") }? = handles::listener_into_raw(l, ctx as usize);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn connect(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: forwarded; v11+ carries the traffic class in the context.
    unsafe { connect_with(ctx, None, dev, handle, send_comm) }
}

/// `connect` of every version: `tc` is the v10 per-connect traffic class, if any.
///
/// # Safety
/// The ncclNet `connect` contract.
pub(super) unsafe fn connect_with(
    ctx: *mut c_void,
    tc: Option<c_int>,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(send_comm) };
    guard("connect", || {
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes, for the call.
        let bytes = unsafe { handle_bytes(handle) }?;
        let id = u64::from_le_bytes(bytes[STATE..STATE + 8].try_into().expect("8 bytes"));
        // Cleared until this call parks the connect again: after an error, nothing points at
        // a connect that no longer exists.
        bytes[STATE..HANDLE_SIZE].fill(0);
        let h = wire::Handle::decode(bytes)
            .map_err(|r| Error::Internal(format!("connect: invalid handle: {r}")))?;
        let tc = tc.and_then(|t| u8::try_from(t).ok());
        match connects::step(id, h, dev, tc, (|| handles::ctx(ctx), ctx as usize))? {
            Step::Done(comm) => {
                // SAFETY: valid slot per the ABI (NULL rejected).
                *unsafe { out(send_comm, "sendComm") }? =
                    handles::comm_into_raw(AnyComm::Send(comm), ctx as usize);
            }
            Step::Parked(id) => bytes[STATE..STATE + 8].copy_from_slice(&id.to_le_bytes()),
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _recv_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(recv_comm) };
    guard("accept", || {
        // SAFETY: listen_comm came from listen and is not closed.
        let mut l = unsafe { handles::listener(listen_comm) }?.enter("listenComm")?;
        if let Some(comm) = l.accept()? {
            // The comm belongs to the context the listener was made under.
            let owner = handles::owner_of(listen_comm);
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(recv_comm, "recvComm") }? =
                handles::comm_into_raw(AnyComm::Recv(comm), owner);
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    type_: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(mhandle) };
    guard("regMr", || {
        let kind = match type_ as u32 {
            NCCL_PTR_HOST => MemKind::Host,
            NCCL_PTR_CUDA => MemKind::Cuda,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "regMr type {type_} (regMr takes NCCL_PTR_HOST or NCCL_PTR_CUDA)"
                )));
            }
        };
        // SAFETY: comm came from connect/accept and is not closed.
        let c = unsafe { handles::comm(comm) }?;
        // The buffer is NCCL's, lent to the network until deregMr (the ncclNet contract for
        // regMr): no Rust object lives in it. The rest of its pages (the cache registers whole
        // pages, as NCCL's own transport does) is NCCL's page-granular allocation too; a
        // buffer that shares a page with other memory has it written only by a peer writing
        // outside the buffers it was offered.
        let (addr, len) = (data as u64, size as u64);
        let mem = match kind {
            // SAFETY: as above; NCCL_PTR_HOST is host memory the CPU may read (small sends
            // from it may go inline).
            MemKind::Host => unsafe { crate::verbs::ForeignMem::host(addr, len) },
            // SAFETY: as above; GPU memory, never read by the CPU.
            _ => unsafe { crate::verbs::ForeignMem::new(addr, len) },
        };
        let h = reg::register(&c.net()?, &c.devs, kind, mem)?;
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(mhandle, "mhandle") }? = handles::mr_into_raw(h);
        Ok(())
    })
}

/// `regMrDmaBuf` of every version (the signature never changed): registers `[offset, offset +
/// size)` of the dma-buf `fd` at the address `data`. `type` is NCCL_PTR_CUDA in practice; the
/// fd says what the memory is, so any type NCCL passes is accepted. The fd stays NCCL's.
pub(super) unsafe extern "C" fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    _type: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(mhandle) };
    guard("regMrDmaBuf", || {
        // SAFETY: comm came from connect/accept and is not closed.
        let c = unsafe { handles::comm(comm) }?;
        let (addr, len) = (data as u64, size as u64);
        let h = reg::register_dmabuf(&c.net()?, &c.devs, addr, len, (offset, fd))?;
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(mhandle, "mhandle") }? = handles::mr_into_raw(h);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    guard("deregMr", || {
        if !mhandle.is_null() {
            reg::deregister(handles::close_mr(mhandle)?);
        }
        Ok(())
    })
}

/// The registered buffer `[data, data + size)` under `mhandle`, with its keys on the member
/// ports `devs` of the comm whose gate the call holds.
///
/// # Safety
/// `mhandle` must be NULL or an `mhandle` from `regMr`/`regMrDmaBuf` not yet deregistered, for
/// the call.
#[inline(always)]
unsafe fn buf(data: *mut c_void, size: u64, mhandle: *mut c_void, devs: &[usize]) -> Result<Buf> {
    if mhandle.is_null() {
        if size == 0 {
            return Ok(Buf { addr: data as u64, ..Buf::default() });
        }
        return Err(Error::Internal("NULL mhandle for a non-empty buffer".into()));
    }
    // SAFETY: mhandle came from regMr and is alive until deregMr; the caller holds a comm's
    // gate.
    let h = unsafe { handles::mr(mhandle) }?;
    buf_within(h, devs, data as u64, size)
}

/// What `isend`, `irecv` and `iflush` share: `body` runs in the guard on the comm `comm` (under
/// its gate) with its member ports, and a request it posts goes out through `request`, which is
/// cleared first ("not yet" is a NULL request).
///
/// # Safety
/// `comm` came from connect or accept and is not closed; `request` is NULL or a valid slot.
unsafe fn post(
    call: &'static str,
    comm: *mut c_void,
    request: *mut *mut c_void,
    body: impl FnOnce(&mut AnyComm, &[usize]) -> Result<Option<usize>>,
) -> ncclResult_t {
    // SAFETY: per the contract.
    unsafe { clear(request) };
    guard(call, || {
        // SAFETY: per the contract.
        let h = unsafe { handles::comm(comm) }?;
        if let Some(id) = body(&mut *h.enter()?, &h.devs)? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(request, "request") }? = h.request(id);
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let send = |c: &mut AnyComm, devs: &[usize]| {
        let AnyComm::Send(c) = c else {
            return Err(Error::Internal("isend on a receive comm".into()));
        };
        // SAFETY: NCCL passes an mhandle it registered and has not deregistered, and the
        // lookup runs inside this call.
        let lookup = || unsafe { buf(data, size as u64, mhandle, devs) };
        c.isend(lookup, tag, phandle as usize)
    };
    // SAFETY: send_comm came from connect and is not closed; NCCL passes NULL or a valid slot.
    unsafe { post("isend", send_comm, request, send) }
}

#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // NCCL pre-stores NCCL_NET_OPTIONAL_RECV_COMPLETION in *request for receives whose data it
    // detects itself (LL/LL128): read it before the slot is cleared.
    // SAFETY: NCCL passes NULL or a valid slot.
    let optional = unsafe { request.as_ref() }
        .is_some_and(|r| *r as usize == NCCL_NET_OPTIONAL_RECV_COMPLETION as usize);
    let recv = |c: &mut AnyComm, devs: &[usize]| {
        let AnyComm::Recv(c) = c else {
            return Err(Error::Internal("irecv on a send comm".into()));
        };
        let count = usize::try_from(n).ok().filter(|k| (1..=MAX_RECVS).contains(k));
        let count = count
            .ok_or_else(|| Error::Internal(format!("irecv n={n}, must be 1..={MAX_RECVS}")))?;
        if data.is_null() || sizes.is_null() || tags.is_null() || mhandles.is_null() {
            return Err(Error::Internal("irecv: NULL array".into()));
        }
        // Only the `count` entries NCCL passes are written (zeroing all eight, most of a
        // kilobyte, cost about 60 instructions a receive).
        let mut bufs = [MaybeUninit::<(Buf, c_int)>::uninit(); MAX_RECVS];
        let mut ph = [0usize; MAX_RECVS];
        for (i, b) in bufs.iter_mut().enumerate().take(count) {
            // SAFETY: NCCL passes n valid entries in each array.
            let (d, s, t, m) =
                unsafe { (*data.add(i), *sizes.add(i), *tags.add(i), *mhandles.add(i)) };
            // SAFETY: NCCL passes mhandles it registered and has not deregistered.
            b.write((unsafe { buf(d, s as u64, m, devs) }?, t));
            if !phandles.is_null() {
                // SAFETY: a non-NULL phandles has n entries (v10+).
                ph[i] = unsafe { *phandles.add(i) } as usize;
            }
        }
        let written = &bufs[..count];
        // SAFETY: `written` is the first `count` (1..=MAX_RECVS, checked above) entries, each
        // written by the loop (a failed lookup returned first); `MaybeUninit<T>` has `T`'s
        // layout, and `(Buf, c_int)` is `Copy`: nothing is dropped.
        let bufs =
            unsafe { &*(written as *const [MaybeUninit<(Buf, c_int)>] as *const [(Buf, c_int)]) };
        c.irecv(bufs, optional, &ph[..count])
    };
    // SAFETY: recv_comm came from accept and is not closed; the slot is as above.
    unsafe { post("irecv", recv_comm, request, recv) }
}

pub(super) unsafe extern "C" fn iflush(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    let flush = |c: &mut AnyComm, devs: &[usize]| {
        let AnyComm::Recv(c) = c else {
            return Err(Error::Internal("iflush on a send comm".into()));
        };
        let count = usize::try_from(n).unwrap_or(0).min(MAX_RECVS);
        if count > 0 && (data.is_null() || sizes.is_null() || mhandles.is_null()) {
            return Err(Error::Internal("iflush: NULL array".into()));
        }
        // The non-empty buffers (each knows whether it is host memory); the comm picks the one
        // to read.
        let mut bufs = [Buf::default(); MAX_RECVS];
        let mut k = 0;
        for i in 0..count {
            // SAFETY: NCCL passes n valid entries in each array.
            let (d, s, m) = unsafe { (*data.add(i), *sizes.add(i), *mhandles.add(i)) };
            if s > 0 && !m.is_null() {
                // SAFETY: NCCL passes mhandles it registered and has not deregistered.
                bufs[k] = unsafe { buf(d, 1, m, devs) }?;
                k += 1;
            }
        }
        c.iflush(&bufs[..k])
    };
    // SAFETY: recv_comm came from accept and is not closed; NCCL passes NULL or a valid slot.
    unsafe { post("iflush", recv_comm, request, flush) }
}

pub(super) unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    guard("test", || {
        // SAFETY: request is a request pointer returned by isend/irecv/iflush, of a comm NCCL
        // has not closed.
        let (r, h) = unsafe { handles::request(request) }?;
        // SAFETY: NCCL passes a valid int (NULL rejected).
        let done = unsafe { out(done, "done") }?;
        *done = 0;
        let clamp = |v: u64| c_int::try_from(v).unwrap_or(c_int::MAX);
        match (&mut *h.enter()?, r.kind) {
            (AnyComm::Send(c), ReqKind::Send) => {
                if let Some(size) = c.test(r.index.into())? {
                    // SAFETY: sizes is NULL or has room for one int.
                    if let Some(s) = unsafe { sizes.as_mut() } {
                        *s = clamp(size);
                    }
                    *done = 1;
                }
            }
            (AnyComm::Recv(c), kind @ (ReqKind::Recv | ReqKind::Flush)) => {
                let id = usize::from(r.index) + if kind == ReqKind::Flush { FLUSH_BASE } else { 0 };
                let mut got = [0u64; MAX_RECVS];
                if let Some(n) = c.test(id, &mut got)? {
                    if !sizes.is_null() && kind == ReqKind::Recv {
                        for (i, &g) in got.iter().enumerate().take(n) {
                            // SAFETY: NCCL passes room for the n sizes of this receive.
                            unsafe { *sizes.add(i) = clamp(g) };
                        }
                    }
                    *done = 1;
                }
            }
            _ => return Err(Error::Internal("a request of the wrong kind for its comm".into())),
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn close_send(send_comm: *mut c_void) -> ncclResult_t {
    guard("closeSend", || handles::close_comm(send_comm, "sendComm"))
}

pub(super) unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    guard("closeRecv", || handles::close_comm(recv_comm, "recvComm"))
}

pub(super) unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    guard("closeListen", || handles::close_listener(listen_comm))
}
