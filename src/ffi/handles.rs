//! Typed conversions between NCCL's raw pointers and ferroce objects, and the register of
//! every object NCCL holds. Every NULL check lives here, so the entry points stay three lines
//! of plumbing.
//!
//! What NCCL holds, and how a call reaches it:
//! - a listener, a send or receive comm: a boxed [`Owned`]. A call takes it through its gate
//!   (one atomic swap, no lock, no allocation), so two `&mut` to one object never exist: a
//!   second thread in at the same time gets an error, not an alias.
//! - an `mhandle`: a boxed [`MrSlot`], read through `&` by the data path of any comm.
//! - a request: the address of a [`Req`] in its comm's fixed array, naming the comm.
//! - a context: a `CommContext` in its own register ([`ctx`]), each call holding an `Arc`.
//!
//! Every listener, comm and `mhandle` is entered in one register ([`LIVE`]) when it is handed
//! out and leaves it when NCCL closes or deregisters it. The last `finalize` ends whatever is
//! still there ([`end_all`]): the objects are dropped (so their queue pairs, sockets and
//! registrations go, and with them every reference to the device state), while the small box
//! NCCL points at stays, marked ended. A later call on it is an error; closing or
//! deregistering it frees the box and reports the error. Closing a pointer the register does
//! not know (closed twice, never ours) is an error that touches nothing.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::transport::data::{RecvComm, ReqKind, SendComm};
use crate::transport::reg::MrHandle;
use crate::transport::setup::Listener;
use crate::transport::{CommContext, Net};
use crate::verbs::FastMap;

/// An out-pointer NCCL must supply.
///
/// # Safety
/// `p` must be NULL or valid for writes of `T` for the duration of the call.
pub unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: the caller guarantees p is NULL or valid; NULL is rejected here.
    unsafe { p.as_mut() }.ok_or_else(|| Error::Internal(format!("NULL {what}")))
}

/// Sets a "not ready" pointer output before the body runs, if NCCL gave one.
///
/// # Safety
/// As for [`out`].
pub unsafe fn clear(p: *mut *mut c_void) {
    // SAFETY: the caller guarantees p is NULL or valid for writes.
    if let Some(slot) = unsafe { p.as_mut() } {
        *slot = std::ptr::null_mut();
    }
}

/// The contexts NCCL holds (one per communicator since v11, and the one legacy context), by
/// the address NCCL was given. A call takes its own reference, so a `finalize` on another
/// thread never frees a context under it; a second `finalize`, or a call after it, finds no
/// entry and is an error.
struct Contexts<T>(Lazy<Mutex<FastMap<usize, Arc<T>>>>);

impl<T> Contexts<T> {
    const fn new() -> Contexts<T> {
        Contexts(Lazy::new(|| Mutex::new(FastMap::default())))
    }

    fn map(&self) -> MutexGuard<'_, FastMap<usize, Arc<T>>> {
        // Every update is one insert or remove: a panic cannot leave it half done.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, value: T) -> *mut c_void {
        let value = Arc::new(value);
        let p = Arc::as_ptr(&value) as *mut c_void;
        self.map().insert(p as usize, value);
        p
    }

    fn get(&self, p: *mut c_void) -> Result<Arc<T>> {
        let live = self.map().get(&(p as usize)).cloned();
        live.ok_or_else(|| not_live(p))
    }

    fn remove(&self, p: *mut c_void) -> Result<Arc<T>> {
        self.map().remove(&(p as usize)).ok_or_else(|| not_live(p))
    }
}

fn not_live(p: *mut c_void) -> Error {
    if p.is_null() {
        return Error::Internal("NULL ctx".into());
    }
    Error::Internal(format!("ctx {p:p} is not live (finalized already, or never one of ours)"))
}

static CONTEXTS: Contexts<CommContext> = Contexts::new();

/// Hands a context to NCCL.
pub fn ctx_into_raw(c: CommContext) -> *mut c_void {
    CONTEXTS.insert(c)
}

/// Takes back a context NCCL finalizes: an error, touching nothing, if it is not live (NULL,
/// finalized already, never ours).
pub fn ctx_finalize(p: *mut c_void) -> Result<Arc<CommContext>> {
    CONTEXTS.remove(p)
}

/// The communicator context of a call: its own reference, valid however long the call takes;
/// an error if NCCL finalized it (or never had it from us).
pub fn ctx(p: *mut c_void) -> Result<Arc<CommContext>> {
    CONTEXTS.get(p)
}

// --- the register ------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Listen,
    Comm,
    Mr,
}

/// The address of every listener, comm and `mhandle` NCCL holds, by kind, with the context it
/// was made under (0 for registrations, which NCCL may share between communicators: they end
/// with the last `finalize` only).
static LIVE: Lazy<Mutex<FastMap<usize, (Kind, usize)>>> =
    Lazy::new(|| Mutex::new(FastMap::default()));

fn live() -> MutexGuard<'static, FastMap<usize, (Kind, usize)>> {
    // Every update is one insert or remove: a panic cannot leave it half done.
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

fn enter<T>(b: Box<T>, kind: Kind, owner: usize) -> *mut c_void {
    let p = Box::into_raw(b);
    live().insert(p as usize, (kind, owner));
    p.cast()
}

/// The context the listener or comm `p` was made under (0 if the register does not hold it).
pub fn owner_of(p: *mut c_void) -> usize {
    live().get(&(p as usize)).map_or(0, |&(_, owner)| owner)
}

/// Takes a registered box out of the register, if it knows `p` as `kind`; otherwise touches
/// nothing. The caller owns the box from here, but gets a pointer, not a `Box`: a `Box` claims
/// sole access, which only holds once no call is inside (see [`close_owned`]).
fn leave<T>(p: *mut c_void, kind: Kind, what: &str) -> Result<*mut T> {
    if p.is_null() {
        return Err(Error::Internal(format!("NULL {what}")));
    }
    let mut live = live();
    if live.get(&(p as usize)).map(|e| e.0) != Some(kind) {
        return Err(Error::Internal(format!(
            "{what} {p:p} is not open (closed already, or never one of ours)"
        )));
    }
    live.remove(&(p as usize));
    Ok(p.cast::<T>())
}

fn ended(what: &str) -> Error {
    Error::Internal(format!("{what} outlived the last finalize, which closed it"))
}

// --- exclusive objects: listeners and comms ----------------------------------------------------

/// An object one call at a time may use, and that the last `finalize` may end.
pub struct Owned<T> {
    /// Held by the call inside (or by `finalize` ending it).
    gate: AtomicBool,
    /// `None` once ended. Reached only through the gate.
    value: UnsafeCell<Option<T>>,
}

// SAFETY: the value is only reached by the one thread holding the gate (`Gate`, `end`), so
// sharing an `Owned` hands the value from thread to thread, which `T: Send` allows.
unsafe impl<T: Send> Sync for Owned<T> {}

impl<T> Owned<T> {
    fn new(value: T) -> Owned<T> {
        Owned { gate: AtomicBool::new(false), value: UnsafeCell::new(Some(value)) }
    }

    fn try_lock(&self) -> bool {
        self.gate.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// The value, for one call: an error if another thread is inside or finalize ended it.
    pub fn enter(&self, what: &str) -> Result<Gate<'_, T>> {
        if !self.try_lock() {
            return Err(Error::Internal(format!("{what} used by two threads at once")));
        }
        let g = Gate(self);
        // SAFETY: the gate is held, so this is the only reference to the value.
        if unsafe { &*self.value.get() }.is_none() {
            return Err(ended(what));
        }
        Ok(g)
    }

    /// Takes the value out, waiting until `deadline` for a call inside to leave; `Err(())` if
    /// one did not.
    fn end(&self, deadline: Instant) -> std::result::Result<Option<T>, ()> {
        while !self.try_lock() {
            if Instant::now() > deadline {
                return Err(());
            }
            std::thread::yield_now();
        }
        let _g = Gate(self);
        // SAFETY: the gate is held, so this is the only reference to the value.
        Ok(unsafe { &mut *self.value.get() }.take())
    }
}

/// One call's exclusive use of an [`Owned`] value; releases the gate when dropped.
pub struct Gate<'a, T>(&'a Owned<T>);

impl<T> std::ops::Deref for Gate<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the gate is held (see `DerefMut`); `enter` checked the value is present and
        // only `end`, which needs the gate, removes it.
        unsafe { &*self.0.value.get() }.as_ref().expect("checked by enter")
    }
}

impl<T> std::ops::DerefMut for Gate<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this thread holds the gate, so no other reference to the value exists.
        unsafe { &mut *self.0.value.get() }.as_mut().expect("checked by enter")
    }
}

impl<T> Drop for Gate<'_, T> {
    fn drop(&mut self) {
        self.0.gate.store(false, Ordering::Release);
    }
}

/// Hands a listener made under context `owner` to NCCL.
pub fn listener_into_raw(l: Listener, owner: usize) -> *mut c_void {
    enter(Box::new(Owned::new(l)), Kind::Listen, owner)
}

/// The listener behind `p`.
///
/// # Safety
/// `p` must be NULL or a pointer from [`listener_into_raw`] that NCCL has not closed.
pub unsafe fn listener<'a>(p: *mut c_void) -> Result<&'a Owned<Listener>> {
    // SAFETY: per the contract the box is alive; only `&` is made (the gate guards the rest).
    unsafe { p.cast::<Owned<Listener>>().as_ref() }
        .ok_or_else(|| Error::Internal("NULL listenComm".into()))
}

/// Takes back a listener NCCL closes.
pub fn close_listener(p: *mut c_void) -> Result<()> {
    let b = leave::<Owned<Listener>>(p, Kind::Listen, "listenComm")?;
    // SAFETY: `leave` just took `b` out of the register, so it is closed exactly once.
    unsafe { close_owned(b, |o| o, "listenComm") }
}

/// Frees a closed object once no call is inside it: its gate is taken first (a call on
/// another thread, against the ncclNet contract, is waited for up to [`PATIENCE`]). One still
/// inside after that keeps the object: it is leaked, never freed under that call. Until the
/// gate is taken only shared references to the box exist (Miri caught a `Box` made first:
/// moving it asserts sole access while the other call still reads through its `&`).
///
/// # Safety
/// `b` is a live box from `Box::into_raw` that no one else will free or close.
unsafe fn close_owned<B, T>(b: *mut B, owned: impl Fn(&B) -> &Owned<T>, what: &str) -> Result<()> {
    // SAFETY: per the contract `b` is alive; shared access only, as a call inside may hold one.
    let ended_now = owned(unsafe { &*b }).end(Instant::now() + PATIENCE);
    let free = || {
        // SAFETY: the gate was taken and released with no call inside, and the register no
        // longer holds `b`, so no call can reach it: this is the only access, and the last.
        drop(unsafe { Box::from_raw(b) })
    };
    match ended_now {
        Ok(Some(value)) => {
            drop(value);
            free();
            Ok(())
        }
        Ok(None) => {
            free();
            Err(ended(what))
        }
        Err(()) => Err(Error::Internal(format!(
            "{what} closed while a call on another thread was inside it for over {} s; it \
                 stays allocated (leaked), never freed under that call",
            PATIENCE.as_secs()
        ))),
    }
}

// --- comms and their requests ------------------------------------------------------------------

/// A send or receive comm.
pub enum AnyComm {
    Send(Box<SendComm>),
    Recv(Box<RecvComm>),
}

/// What NCCL's request pointer points at: an entry of its comm's fixed array, written once
/// when the comm is handed out and only read afterwards.
#[repr(C)]
pub struct Req {
    /// The address of the comm's box.
    owner: usize,
    pub kind: ReqKind,
    pub index: u16,
}

/// What NCCL holds as a send or receive comm. Which calls may run at once, per the ncclNet
/// contract: NCCL's proxy thread drives a comm's data path (`isend`, `irecv`, `iflush`,
/// `test`, close) from one thread, while `regMr`/`regMrDmaBuf`/`deregMr` may come from another
/// thread at the same time. So the data path goes through the comm's gate, and registration
/// only reads the device state through a lock of its own.
pub struct CommHandle {
    /// The device state, for registration; `None` once finalize ended the comm.
    net: Mutex<Option<Arc<Net>>>,
    /// Its member ports (device indices), for registration.
    pub devs: Vec<usize>,
    comm: Owned<AnyComm>,
    reqs: Box<[Req]>,
}

/// Hands a comm made under context `owner` to NCCL: its request array names it.
pub fn comm_into_raw(comm: AnyComm, owner: usize) -> *mut c_void {
    let (net, devs, reqs): (_, _, Box<[Req]>) = match &comm {
        AnyComm::Send(c) => {
            (c.lanes.net.clone(), c.lanes.devs.clone(), reqs_of(SendComm::requests()))
        }
        AnyComm::Recv(c) => {
            (c.lanes.net.clone(), c.lanes.devs.clone(), reqs_of(RecvComm::requests()))
        }
    };
    let net = Mutex::new(Some(net));
    let mut b = Box::new(CommHandle { net, devs, comm: Owned::new(comm), reqs });
    let me = &*b as *const CommHandle as usize;
    b.reqs.iter_mut().for_each(|r| r.owner = me);
    enter(b, Kind::Comm, owner)
}

fn reqs_of(ids: impl Iterator<Item = (ReqKind, u16)>) -> Box<[Req]> {
    ids.map(|(kind, index)| Req { owner: 0, kind, index }).collect()
}

impl CommHandle {
    /// The device state, for registration.
    pub fn net(&self) -> Result<Arc<Net>> {
        let net = self.net.lock().unwrap_or_else(|p| p.into_inner());
        net.clone().ok_or_else(|| ended("comm"))
    }

    /// The comm, for one data-path call.
    pub fn enter(&self) -> Result<Gate<'_, AnyComm>> {
        self.comm.enter("comm")
    }

    /// NCCL's request pointer for request `id` of this comm.
    pub fn request(&self, id: usize) -> *mut c_void {
        (&raw const self.reqs[id]).cast_mut().cast()
    }
}

/// The comm behind `p`.
///
/// # Safety
/// `p` must be NULL or a pointer from [`comm_into_raw`] that NCCL has not closed.
pub unsafe fn comm<'a>(p: *mut c_void) -> Result<&'a CommHandle> {
    // SAFETY: per the contract the box is alive; only `&` is made (the gate and the lock
    // guard what changes).
    unsafe { p.cast::<CommHandle>().as_ref() }.ok_or_else(|| Error::Internal("NULL comm".into()))
}

/// A request and the comm it belongs to.
///
/// # Safety
/// `p` must be NULL or a request pointer ferroce returned, whose comm NCCL has not closed.
pub unsafe fn request<'a>(p: *mut c_void) -> Result<(&'a Req, &'a CommHandle)> {
    // SAFETY: per the contract p is an entry of a live comm's request array.
    let r = unsafe { p.cast::<Req>().as_ref() }
        .ok_or_else(|| Error::Internal("NULL request".into()))?;
    // SAFETY: `owner` was set to the comm's own box, alive while its requests are.
    Ok((r, unsafe { &*(r.owner as *const CommHandle) }))
}

/// Takes back a comm NCCL closes.
pub fn close_comm(p: *mut c_void, what: &str) -> Result<()> {
    let b = leave::<CommHandle>(p, Kind::Comm, what)?;
    // SAFETY: `leave` just took `b` out of the register, so it is closed exactly once.
    unsafe { close_owned(b, |h| &h.comm, what) }
}

// --- registrations -----------------------------------------------------------------------------

/// What NCCL holds as an `mhandle`.
pub struct MrSlot(UnsafeCell<Option<MrHandle>>);

// SAFETY: the data path reads the registration through `&` from any comm's thread; only
// `end_all` (after it has ended every comm, so no data-path call is inside) and `close_mr`
// (NCCL deregisters a handle no call is using, per the ncclNet contract) change it, both under
// the register's lock.
unsafe impl Sync for MrSlot {}

/// Hands a registration to NCCL.
pub fn mr_into_raw(h: MrHandle) -> *mut c_void {
    enter(Box::new(MrSlot(UnsafeCell::new(Some(h)))), Kind::Mr, 0)
}

/// The registration behind an `mhandle`.
///
/// # Safety
/// `p` must be NULL or a pointer from [`mr_into_raw`] that NCCL has not deregistered, and the
/// caller holds the gate of a comm (see [`MrSlot`]).
pub unsafe fn mr<'a>(p: *mut c_void) -> Result<&'a MrHandle> {
    // SAFETY: per the contract the box is alive and nothing changes it during the call.
    let slot = unsafe { p.cast::<MrSlot>().as_ref() }
        .ok_or_else(|| Error::Internal("NULL mhandle".into()))?;
    // SAFETY: as above: only shared references exist while a comm's gate is held.
    unsafe { &*slot.0.get() }.as_ref().ok_or_else(|| ended("mhandle"))
}

/// Takes back a registration NCCL deregisters.
pub fn close_mr(p: *mut c_void) -> Result<MrHandle> {
    let b = leave::<MrSlot>(p, Kind::Mr, "mhandle")?;
    // SAFETY: `leave` just took it out of the register (once), and NCCL deregisters a handle
    // no call is using (see [`MrSlot`]).
    unsafe { Box::from_raw(b) }.0.into_inner().ok_or_else(|| ended("mhandle"))
}

// --- the last finalize -------------------------------------------------------------------------

/// How long the last `finalize` waits, for all of them together, for calls still inside comms
/// or listeners (the register's lock is held meanwhile).
const PATIENCE: Duration = Duration::from_secs(1);

/// What [`end_all`] found still open.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Ended {
    pub listeners: usize,
    pub comms: usize,
    pub mrs: usize,
    /// Objects a call was still inside of (they, and the registrations, were left alone).
    pub busy: usize,
}

/// Ends every listener, comm and registration NCCL still holds, for the last `finalize`:
/// first the listeners and comms (waiting briefly for a call inside), then, once no comm's
/// data path can be reading one, the registrations, each returned to its device's cache.
pub fn end_all() -> Ended {
    end_owned(None)
}

/// Ends the listeners and comms made under context `owner` (its `finalize`, while other
/// contexts live on; registrations stay, as NCCL may share them), or with `None` everything
/// [`end_all`] ends.
pub fn end_owned(owner: Option<usize>) -> Ended {
    let live = live();
    let mut e = Ended::default();
    let deadline = Instant::now() + PATIENCE;
    let mine = |o: usize| owner.is_none_or(|w| w == o);
    for (&addr, &(kind, _)) in live.iter().filter(|(_, (_, o))| mine(*o)) {
        let r = match kind {
            // SAFETY: the register holds live boxes of the kind it records.
            Kind::Listen => unsafe { &*(addr as *const Owned<Listener>) }.end(deadline).map(|v| {
                e.listeners += usize::from(v.is_some());
            }),
            Kind::Comm => {
                // SAFETY: as above.
                let h = unsafe { &*(addr as *const CommHandle) };
                h.comm.end(deadline).map(|v| {
                    e.comms += usize::from(v.is_some());
                    h.net.lock().unwrap_or_else(|p| p.into_inner()).take();
                })
            }
            Kind::Mr => Ok(()),
        };
        e.busy += usize::from(r.is_err());
    }
    if e.busy > 0 || owner.is_some() {
        return e;
    }
    for (&addr, _) in live.iter().filter(|(_, k)| k.0 == Kind::Mr) {
        // SAFETY: a live MrSlot box; every comm is ended, so no data-path call reads it, and
        // deregMr waits for the register's lock held here.
        let slot = unsafe { &mut *(*(addr as *const MrSlot)).0.get() };
        if let Some(h) = slot.take() {
            crate::transport::reg::deregister(h);
            e.mrs += 1;
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A close while a call is inside on another thread (against the ncclNet contract) waits
    /// for the call to leave before it frees anything; a call that stays past the patience
    /// keeps its object, leaked rather than freed under it.
    #[test]
    fn a_close_takes_the_gate_and_never_frees_under_a_call() {
        use std::sync::atomic::AtomicBool;
        use std::sync::mpsc::channel;
        // The call leaves while the close waits (released 50 ms into its 1 s), or only once
        // the close gave up on it.
        for leaves in [true, false] {
            let addr = Box::into_raw(Box::new(Owned::new(vec![7u8; 64]))) as usize;
            let left = Arc::new(AtomicBool::new(false));
            let ((inside, entered), (release, go)) = (channel(), channel::<()>());
            let call = {
                let left = left.clone();
                std::thread::spawn(move || {
                    // SAFETY: the box lives until close frees it, which waits for this gate.
                    let o = unsafe { &*(addr as *const Owned<Vec<u8>>) };
                    let g = o.enter("comm").expect("free");
                    inside.send(()).unwrap();
                    go.recv().unwrap();
                    assert_eq!(g[63], 7, "the value is intact under the call");
                    left.store(true, Ordering::SeqCst);
                })
            };
            entered.recv().unwrap();
            let close = std::thread::spawn(move || {
                // SAFETY: addr came from Box::into_raw above and is closed once.
                unsafe { close_owned(addr as *mut Owned<Vec<u8>>, |o| o, "sendComm") }
                    .map_err(|e| e.to_string())
            });
            if leaves {
                std::thread::sleep(Duration::from_millis(50));
                release.send(()).unwrap();
                close.join().unwrap().expect("closed once the call left");
                assert!(left.load(Ordering::SeqCst), "closed only after the call left");
            } else {
                let e = close.join().unwrap().expect_err("a call inside past the patience");
                assert!(e.contains("leaked"), "{e}");
                release.send(()).unwrap();
                call.join().expect("the call ran to its end on valid memory");
                // The test frees what the close left, so leak checkers see none.
                // SAFETY: the call has left and the close gave the box up.
                drop(unsafe { Box::from_raw(addr as *mut Owned<Vec<u8>>) });
                continue;
            }
            call.join().expect("the call ran to its end on valid memory");
        }
    }

    /// A context finalized twice, or used after its finalize, is an error that touches
    /// nothing; a call that took its reference first keeps a valid context.
    #[test]
    fn a_context_is_finalized_once_and_never_used_after() {
        static CTXS: Contexts<String> = Contexts::new();
        let p = CTXS.insert("comm A".to_string());
        let q = CTXS.insert("comm B".to_string());
        let inside = CTXS.get(p).expect("live");
        assert_eq!(*CTXS.remove(p).expect("the first finalize"), "comm A");
        let again = CTXS.remove(p).expect_err("a second finalize").to_string();
        assert!(again.contains("not live (finalized already"), "{again}");
        assert!(CTXS.get(p).is_err(), "a call after finalize");
        assert_eq!(*inside, "comm A", "the call that was inside still has its context");
        assert_eq!(*CTXS.get(q).expect("the other context is untouched"), "comm B");
        let null = CTXS.get(std::ptr::null_mut()).expect_err("NULL").to_string();
        assert_eq!(null, "internal error: NULL ctx");
        let never = CTXS.remove(0x1000 as *mut c_void).expect_err("never ours").to_string();
        assert!(never.contains("never one of ours"), "{never}");
    }

    #[test]
    fn one_thread_at_a_time_gets_the_value() {
        let o = Owned::new(5u32);
        let mut g = o.enter("x").expect("free");
        *g += 1;
        let again = o.enter("x").err().expect("held");
        assert!(again.to_string().contains("two threads"), "{again}");
        std::thread::scope(|s| {
            let other = s.spawn(|| o.enter("x").map(|_| ()));
            assert!(other.join().unwrap().is_err(), "another thread is refused, not aliased");
        });
        drop(g);
        assert_eq!(*o.enter("x").expect("released"), 6);
    }

    #[test]
    fn an_ended_value_is_an_error_for_every_later_call() {
        let o = Owned::new(String::from("comm"));
        let soon = Instant::now() + PATIENCE;
        assert_eq!(o.end(soon), Ok(Some("comm".into())));
        let e = o.enter("sendComm").err().expect("ended");
        assert!(e.to_string().contains("outlived the last finalize"), "{e}");
        assert_eq!(o.end(soon), Ok(None), "ending twice finds nothing");
        // SAFETY: a fresh box, closed once.
        let closed = unsafe { close_owned(Box::into_raw(Box::new(o)), |o| o, "sendComm") };
        let closed = closed.expect_err("closing it");
        assert!(closed.to_string().contains("outlived the last finalize"), "{closed}");
    }

    #[test]
    fn end_waits_for_a_call_inside_and_gives_up_on_one_that_stays() {
        let o = Owned::new(1u8);
        let g = o.enter("x").unwrap();
        let after = |d| Instant::now() + Duration::from_millis(d);
        assert_eq!(o.end(after(20)), Err(()), "a call stays inside");
        std::thread::scope(|s| {
            let ender = s.spawn(|| o.end(after(10_000)));
            std::thread::sleep(Duration::from_millis(20));
            drop(g);
            assert_eq!(ender.join().unwrap(), Ok(Some(1)), "ends once the call leaves");
        });
    }

    #[test]
    fn the_register_hands_back_only_what_it_handed_out_and_only_once() {
        let p = enter(Box::new(Owned::new(7u64)), Kind::Listen, 0);
        assert!(leave::<Owned<u64>>(p, Kind::Comm, "sendComm").is_err(), "wrong kind");
        let b = leave::<Owned<u64>>(p, Kind::Listen, "listenComm").expect("registered");
        // SAFETY: `leave` handed the box back to this test, once.
        let b = unsafe { Box::from_raw(b) };
        assert_eq!(b.end(Instant::now()), Ok(Some(7)));
        let twice = leave::<Owned<u64>>(p, Kind::Listen, "listenComm").expect_err("gone");
        assert!(twice.to_string().contains("not open"), "{twice}");
        let mut local = 0u64;
        let foreign: *mut c_void = (&raw mut local).cast();
        assert!(leave::<Owned<u64>>(foreign, Kind::Listen, "listenComm").is_err());
        assert!(leave::<Owned<u64>>(std::ptr::null_mut(), Kind::Mr, "mhandle").is_err());
    }
}
