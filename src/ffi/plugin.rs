//! The plugin's entry points, written once: the `vN` modules only export tables that point here,
//! or at shims that adapt an older signature (`legacy` holds the shims several versions share).
//! The signatures are the newest ABI's, so the newest table points here directly, and adding a
//! version means adding one `vN` file.
//!
//! Every function is plumbing around a safe call: clear the "not ready" outputs, run the body in
//! [`guard`], write outputs only on success.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Mutex;

use once_cell::sync::Lazy;

use super::abi::*;
use super::handles::{self, AnyComm, CommHandle, clear, out};
use super::{guard, log};
use crate::error::{Error, Result};
use crate::transport::comm::{Buf, FLUSH_BASE, MAX_RECVS, RecvComm, ReqKind, SendComm};
use crate::transport::handshake::{self, HANDLE_SIZE};
use crate::transport::mr_cache::MemKind;
use crate::transport::reg::{self, MrHandle};
use crate::transport::setup::{Connector, Listener};
use crate::transport::{self, CommContext, NetDevice};

pub(super) unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    _profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    log::install(logger);
    // SAFETY: NCCL passes a valid ctx slot (or NULL, rejected by `out`).
    unsafe { clear(ctx) };
    guard("init", || {
        // SAFETY: NCCL passes NULL or a valid config for the duration of the call.
        let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.trafficClass);
        let c = transport::net::init(comm_id, tc)?;
        // SAFETY: checked non-NULL by `out`; valid for writes per the ABI.
        *unsafe { out(ctx, "ctx") }? = handles::into_raw(c);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    guard("finalize", || {
        // SAFETY: ctx is what init returned, and NCCL finalizes it exactly once.
        transport::net::finalize(unsafe { handles::take::<CommContext>(ctx, "ctx") }?);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        let n = transport::net::current()?.devices.len();
        // SAFETY: NCCL passes a valid int pointer (NULL rejected by `out`).
        *unsafe { out(ndev, "ndev") }? = c_int::try_from(n).unwrap_or(c_int::MAX);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v12_t,
) -> ncclResult_t {
    guard("getProperties", || {
        let p = properties(dev)?;
        // SAFETY: NCCL passes a valid properties struct (NULL rejected by `out`).
        *unsafe { out(props, "props") }? = p;
        Ok(())
    })
}

/// The properties of device `dev` in the newest struct (v12); older versions narrow this.
pub(super) fn properties(dev: c_int) -> Result<ncclNetProperties_v12_t> {
    let net = transport::net::current()?;
    let d = net.device(dev)?;
    let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V12 as usize];
    devs[0] = dev;
    Ok(ncclNetProperties_v12_t {
        name: intern(&d.name),
        pciPath: d.pci_path.as_deref().map_or(std::ptr::null_mut(), intern),
        guid: d.guid,
        ptrSupport: ptr_support(d),
        regIsGlobal: 1,
        forceFlush: 0,
        speed: d.speed_mbps,
        port: d.nccl_port,
        latency: 0.0,
        maxComms: d.max_comms(net.config.qps_per_conn),
        maxRecvs: MAX_RECVS as c_int,
        netDeviceType: ncclNetDeviceType::NCCL_NET_DEVICE_HOST,
        netDeviceVersion: NCCL_NET_DEVICE_INVALID_VERSION as c_int,
        vProps: ncclNetVDeviceProps_v12_t { ndevs: 1, devs },
        maxP2pBytes: NCCL_MAX_NET_SIZE_BYTES as usize,
        maxCollBytes: NCCL_MAX_COLLNET_SIZE as usize,
        maxMultiRequestSize: 1,
        railId: rail_or_undef(d, |d| d.rail),
        planeId: rail_or_undef(d, |d| d.plane),
    })
}

/// `NCCL_PTR_HOST`, plus `_CUDA` with peer memory, plus `_DMABUF` where dma-buf works.
fn ptr_support(d: &NetDevice) -> c_int {
    let mut bits = NCCL_PTR_HOST;
    if d.gdr.cuda {
        bits |= NCCL_PTR_CUDA;
    }
    if d.gdr.dmabuf {
        bits |= NCCL_PTR_DMABUF;
    }
    bits as c_int
}

fn rail_or_undef(d: &NetDevice, f: impl Fn(&NetDevice) -> Option<i16>) -> i16 {
    f(d).unwrap_or(NCCL_NET_ID_UNDEF as i16)
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
const STATE: usize = handshake::HANDLE_STATE_OFFSET;
/// The most connects in progress at once. NCCL may abandon a connect (an error elsewhere, a
/// job torn down); beyond this many, the one advanced least recently is dropped.
const MAX_CONNECTS: usize = 4096;

/// Connects in progress, keyed by a random id kept in the handle's state bytes: those bytes are
/// only ever looked up, never taken for a pointer, so a garbled or foreign handle is simply not
/// found. An entry leaves when its connect finishes or fails, or when it is pushed out.
static CONNECTS: Lazy<Mutex<Parked<Box<Connector>>>> =
    Lazy::new(|| Mutex::new(Parked::new(MAX_CONNECTS)));

fn connects() -> std::sync::MutexGuard<'static, Parked<Box<Connector>>> {
    CONNECTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A bounded table of values parked between calls under 64-bit ids; when full, parking pushes
/// out the value parked longest ago.
struct Parked<T> {
    cap: usize,
    /// Park order: each park takes the next number.
    seq: u64,
    map: HashMap<u64, (u64, T)>,
}

impl<T> Parked<T> {
    fn new(cap: usize) -> Self {
        Parked { cap, seq: 0, map: HashMap::new() }
    }

    /// Parks `v` under `id` (a new id, or one just taken); returns what was pushed out.
    fn park(&mut self, id: u64, v: T) -> Option<(u64, T)> {
        let mut out = None;
        if self.map.len() >= self.cap && !self.map.contains_key(&id) {
            let oldest = self.map.iter().min_by_key(|(_, (seq, _))| *seq).map(|(k, _)| *k);
            out = oldest.and_then(|k| self.map.remove(&k).map(|(_, v)| (k, v)));
        }
        self.seq += 1;
        self.map.insert(id, (self.seq, v));
        out
    }

    /// Takes the value under `id` if there is one and `belongs` accepts it.
    fn take(&mut self, id: u64, belongs: impl FnOnce(&T) -> bool) -> Option<T> {
        let (_, v) = self.map.get(&id)?;
        if !belongs(v) {
            return None;
        }
        self.map.remove(&id).map(|(_, v)| v)
    }

    fn contains(&self, id: u64) -> bool {
        self.map.contains_key(&id)
    }
}

/// A fresh id for a connect in progress: random, non-zero (zero means "none"), unused.
fn fresh_id() -> Result<u64> {
    loop {
        let id = crate::os::random_u64().map_err(|err| Error::Os {
            call: "getrandom",
            err,
            context: "connect id".into(),
        })?;
        if id != 0 && !connects().contains(id) {
            return Ok(id);
        }
    }
}

fn handle_bytes<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes, valid for the call.
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
        // SAFETY: ctx is what init returned (or the legacy context).
        let l = Listener::new(unsafe { handles::ctx(ctx) }?, dev)?;
        l.handle().encode(handle_bytes(handle)?);
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(listen_comm, "listenComm") }? = handles::into_raw(l);
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
        let bytes = handle_bytes(handle)?;
        let id = u64::from_le_bytes(bytes[STATE..STATE + 8].try_into().expect("8 bytes"));
        // Cleared until this call parks the connect again: after an error, nothing points at
        // a connect that no longer exists.
        bytes[STATE..HANDLE_SIZE].fill(0);
        // The published part, decoded afresh on every call: a parked connect is taken only for
        // the same listener, and without one a connect starts.
        let decoded = handshake::Handle::decode(bytes)
            .map_err(|r| Error::Internal(format!("connect: invalid handle: {r}")));
        let parked = match (&decoded, id) {
            (Ok(h), id) if id != 0 => connects().take(id, |c| c.handle() == *h),
            _ => None,
        };
        let (id, mut connector) = match parked {
            Some(c) => (id, c),
            None => {
                let h = decoded?;
                // SAFETY: ctx is what init returned (or the legacy context).
                let c = unsafe { handles::ctx(ctx) }?;
                let tc = tc.and_then(|t| u8::try_from(t).ok()).or(c.traffic_class);
                (fresh_id()?, Box::new(Connector::start(c, dev, h, tc)?))
            }
        };
        // On error the connector is dropped here, closing everything it built.
        if let Some(comm) = connector.progress()? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(send_comm, "sendComm") }? =
                handles::into_raw(CommHandle::new(AnyComm::Send(comm)));
            return Ok(());
        }
        let pushed_out = connects().park(id, connector);
        bytes[STATE..STATE + 8].copy_from_slice(&id.to_le_bytes());
        if let Some((_, old)) = pushed_out {
            ::log::warn!(
                "connect: {MAX_CONNECTS} connects in progress; dropped the one to {} advanced \
                 least recently (NCCL stopped calling connect for it)",
                old.handle().addr
            );
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
        // SAFETY: listen_comm came from listen and is used by this thread only.
        let l = unsafe { handles::borrow::<Listener>(listen_comm, "listenComm") }?;
        if let Some(comm) = l.accept()? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(recv_comm, "recvComm") }? =
                handles::into_raw(CommHandle::new(AnyComm::Recv(comm)));
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
        // SAFETY: comm came from connect/accept.
        let c = unsafe { handles::comm_shared(comm) }?;
        let (net, dev) = (&c.net, c.dev);
        // SAFETY: the buffer is NCCL's, lent to the network until deregMr (the ncclNet
        // contract for regMr): no Rust object lives in it. The rest of its pages (the cache
        // registers whole pages, as NCCL's own transport does) is NCCL's page-granular
        // allocation too; a buffer that shares a page with other memory has it written only
        // by a peer writing outside the buffers it was offered.
        let mem = unsafe { crate::verbs::ForeignMem::new(data as u64, size as u64) };
        let h = reg::register(net, dev, kind, mem)?;
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(mhandle, "mhandle") }? = handles::into_raw(h);
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
        // SAFETY: comm came from connect/accept.
        let c = unsafe { handles::comm_shared(comm) }?;
        let (net, dev) = (&c.net, c.dev);
        let h = reg::register_dmabuf(net, dev, data as u64, size as u64, offset, fd)?;
        // SAFETY: valid slot per the ABI (NULL rejected).
        *unsafe { out(mhandle, "mhandle") }? = handles::into_raw(h);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    guard("deregMr", || {
        if !mhandle.is_null() {
            // SAFETY: mhandle came from regMr and is deregistered once.
            reg::deregister(unsafe { handles::take::<MrHandle>(mhandle, "mhandle") }?);
        }
        Ok(())
    })
}

/// The registered buffer `[data, data + size)` under `mhandle`.
fn buf(data: *mut c_void, size: u64, mhandle: *mut c_void) -> Result<Buf> {
    if mhandle.is_null() {
        if size == 0 {
            return Ok(Buf { addr: data as u64, ..Buf::default() });
        }
        return Err(Error::Internal("NULL mhandle for a non-empty buffer".into()));
    }
    // SAFETY: mhandle came from regMr and is alive until deregMr.
    let h = unsafe { handles::mr(mhandle) }?;
    Buf::within(&h.mr, h.kind, data as u64, size)
}

pub(super) unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    _phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(request) };
    guard("isend", || {
        // SAFETY: send_comm came from connect and is used by this thread only.
        let AnyComm::Send(c) = unsafe { handles::comm_mut(send_comm) }? else {
            return Err(Error::Internal("isend on a receive comm".into()));
        };
        if let Some(id) = c.isend(buf(data, size as u64, mhandle)?, tag)? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(request, "request") }? = (&raw mut c.headers[id]).cast();
        }
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // NCCL pre-stores NCCL_NET_OPTIONAL_RECV_COMPLETION in *request for receives whose data it
    // detects itself (LL/LL128): read it before the slot is cleared.
    // SAFETY: NCCL passes NULL or a valid slot.
    let optional = unsafe { request.as_ref() }
        .is_some_and(|r| *r as usize == NCCL_NET_OPTIONAL_RECV_COMPLETION as usize);
    // SAFETY: as above.
    unsafe { clear(request) };
    guard("irecv", || {
        // SAFETY: recv_comm came from accept and is used by this thread only.
        let AnyComm::Recv(c) = unsafe { handles::comm_mut(recv_comm) }? else {
            return Err(Error::Internal("irecv on a send comm".into()));
        };
        let count = usize::try_from(n).ok().filter(|k| (1..=MAX_RECVS).contains(k));
        let count = count
            .ok_or_else(|| Error::Internal(format!("irecv n={n}, must be 1..={MAX_RECVS}")))?;
        if data.is_null() || sizes.is_null() || tags.is_null() || mhandles.is_null() {
            return Err(Error::Internal("irecv: NULL array".into()));
        }
        let mut bufs = [(Buf::default(), 0); MAX_RECVS];
        for (i, b) in bufs.iter_mut().enumerate().take(count) {
            // SAFETY: NCCL passes n valid entries in each array.
            let (d, s, t, m) =
                unsafe { (*data.add(i), *sizes.add(i), *tags.add(i), *mhandles.add(i)) };
            *b = (buf(d, s as u64, m)?, t);
        }
        if let Some(id) = c.irecv(&bufs[..count], optional)? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(request, "request") }? = (&raw mut c.headers[id]).cast();
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn iflush(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // SAFETY: NCCL passes NULL or a valid slot.
    unsafe { clear(request) };
    guard("iflush", || {
        // SAFETY: recv_comm came from accept and is used by this thread only.
        let AnyComm::Recv(c) = unsafe { handles::comm_mut(recv_comm) }? else {
            return Err(Error::Internal("iflush on a send comm".into()));
        };
        let count = usize::try_from(n).unwrap_or(0).min(MAX_RECVS);
        if count > 0 && (data.is_null() || sizes.is_null() || mhandles.is_null()) {
            return Err(Error::Internal("iflush: NULL array".into()));
        }
        // The non-empty buffers and where they live; the comm picks the one to read.
        let mut bufs = [(Buf::default(), MemKind::Host); MAX_RECVS];
        let mut k = 0;
        for i in 0..count {
            // SAFETY: NCCL passes n valid entries in each array.
            let (d, s, m) = unsafe { (*data.add(i), *sizes.add(i), *mhandles.add(i)) };
            if s > 0 && !m.is_null() {
                // SAFETY: m came from regMr/regMrDmaBuf and is alive until deregMr.
                let kind = unsafe { handles::mr(m) }?.kind;
                bufs[k] = (buf(d, 1, m)?, kind);
                k += 1;
            }
        }
        if let Some(id) = c.iflush(&bufs[..k])? {
            // SAFETY: valid slot per the ABI (NULL rejected).
            *unsafe { out(request, "request") }? = (&raw mut c.headers[id]).cast();
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    guard("test", || {
        // SAFETY: request is a live request pointer returned by isend/irecv/iflush.
        let h = unsafe { handles::request(request) }?;
        // SAFETY: NCCL passes a valid int (NULL rejected).
        let done = unsafe { out(done, "done") }?;
        *done = 0;
        let clamp = |v: u64| c_int::try_from(v).unwrap_or(c_int::MAX);
        match h.kind {
            ReqKind::Send => {
                // SAFETY: a send request's owner is a live SendComm.
                let c = unsafe { handles::owner::<SendComm>(&h) };
                if let Some(size) = c.test(h.index.into())? {
                    // SAFETY: sizes is NULL or has room for one int.
                    if let Some(s) = unsafe { sizes.as_mut() } {
                        *s = clamp(size);
                    }
                    *done = 1;
                }
            }
            ReqKind::Recv | ReqKind::Flush => {
                // SAFETY: a receive or flush request's owner is a live RecvComm.
                let c = unsafe { handles::owner::<RecvComm>(&h) };
                let id =
                    usize::from(h.index) + if h.kind == ReqKind::Flush { FLUSH_BASE } else { 0 };
                let mut got = [0u64; MAX_RECVS];
                if let Some(n) = c.test(id, &mut got)? {
                    if !sizes.is_null() && h.kind == ReqKind::Recv {
                        for (i, &g) in got.iter().enumerate().take(n) {
                            // SAFETY: NCCL passes room for the n sizes of this receive.
                            unsafe { *sizes.add(i) = clamp(g) };
                        }
                    }
                    *done = 1;
                }
            }
        }
        Ok(())
    })
}

pub(super) unsafe extern "C" fn close_send(send_comm: *mut c_void) -> ncclResult_t {
    guard("closeSend", || {
        // SAFETY: send_comm came from connect and is closed once.
        drop(unsafe { handles::take::<CommHandle>(send_comm, "sendComm") }?);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    guard("closeRecv", || {
        // SAFETY: recv_comm came from accept and is closed once.
        drop(unsafe { handles::take::<CommHandle>(recv_comm, "recvComm") }?);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    guard("closeListen", || {
        // SAFETY: listen_comm came from listen and is closed once.
        drop(unsafe { handles::take::<Listener>(listen_comm, "listenComm") }?);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_values_are_found_by_id_only_and_leave_when_taken() {
        let mut t = Parked::new(3);
        assert_eq!(t.park(10, "a"), None);
        assert_eq!(t.park(20, "b"), None);
        assert_eq!(t.take(99, |_| true), None, "an unknown id is not found");
        assert_eq!(t.take(10, |v| *v == "other"), None, "another listener's entry stays");
        assert!(t.contains(10));
        assert_eq!(t.take(10, |v| *v == "a"), Some("a"));
        assert_eq!(t.take(10, |_| true), None, "taken once");
    }

    #[test]
    fn a_full_table_pushes_out_the_value_advanced_least_recently() {
        let mut t = Parked::new(3);
        for (id, v) in [(1, 'a'), (2, 'b'), (3, 'c')] {
            assert_eq!(t.park(id, v), None);
        }
        // 1 is advanced again (taken and parked): 2 is now the stalest.
        let a = t.take(1, |_| true).unwrap();
        assert_eq!(t.park(1, a), None);
        assert_eq!(t.park(4, 'd'), Some((2, 'b')));
        assert_eq!(t.park(5, 'e'), Some((3, 'c')));
        assert_eq!(t.map.len(), 3);
        // Re-parking a present id never pushes anything out.
        assert_eq!(t.park(5, 'f'), None);
        assert_eq!(t.map.len(), 3);
    }
}
