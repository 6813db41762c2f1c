//! Registered buffers shared with the NIC: control structures that the local NIC or the peer's
//! NIC reads and writes behind the CPU's back (the sender's FIFO, the receiver's size records,
//! staging areas, the flush target).
//!
//! Every access is an atomic load (acquire) or store (release) of an aligned `u64`, so the
//! compiler neither caches nor reorders reads of memory a NIC may write at any time, and two
//! threads that share a buffer (it is `Sync`) never race. Offsets are bounds-checked. The only
//! references into the memory are `&AtomicU64`s, whose value may change under them.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::pd::{Mr, Pd};
use crate::error::{Error, Result};

pub struct RegisteredBuf {
    ptr: *mut u8,
    layout: Layout,
    /// One registration per protection domain it was registered with (a comm's member ports).
    mrs: Vec<Mr>,
}

// SAFETY: the buffer is owned memory; nothing in it is tied to the thread that allocated it.
unsafe impl Send for RegisteredBuf {}
// SAFETY: shared access only reads the fields set in `new` and reads or writes the memory
// through atomics (`load_u64`, `store_u64`): concurrent calls cannot race.
unsafe impl Sync for RegisteredBuf {}

impl RegisteredBuf {
    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access`.
    pub fn new(pd: &Arc<Pd>, len: usize, access: u32) -> Result<RegisteredBuf> {
        RegisteredBuf::on(&[pd], len, access)
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access` in each of
    /// `pds` (the member ports of a comm over a fused device): key `m` is `pds[m]`'s.
    pub fn on(pds: &[&Arc<Pd>], len: usize, access: u32) -> Result<RegisteredBuf> {
        let layout = Layout::from_size_align(len.max(8), 4096)
            .map_err(|e| Error::Internal(format!("buffer layout: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Internal(format!("out of memory for a {len}-byte buffer")));
        }
        let mut buf = RegisteredBuf { ptr, layout, mrs: Vec::with_capacity(pds.len()) };
        for pd in pds {
            // SAFETY: the allocation lives until Drop, which drops the MRs first; Rust reaches
            // it only through atomics, which a NIC's writes cannot invalidate.
            let mr = unsafe { Mr::register(pd, ptr.cast(), layout.size(), access) }?;
            pd.note_cpu(&mr); // host memory this process allocated
            buf.mrs.push(mr);
        }
        Ok(buf)
    }

    fn mr(&self, member: usize) -> &Mr {
        self.mrs.get(member).unwrap_or_else(|| panic!("no registration {member}"))
    }

    /// The local key of its registration with member port `member` (0: the first or only).
    pub fn lkey_on(&self, member: usize) -> u32 {
        self.mr(member).lkey
    }

    pub fn lkey(&self) -> u32 {
        self.lkey_on(0)
    }

    /// Its remote keys, one per member port it was registered with.
    pub fn rkeys(&self) -> Vec<u32> {
        self.mrs.iter().map(|m| m.rkey).collect()
    }

    pub fn rkey(&self) -> u32 {
        self.mr(0).rkey
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }

    /// The address of byte `off`, for work requests.
    pub fn addr(&self, off: usize) -> u64 {
        assert!(off <= self.len(), "offset {off} past buffer of {}", self.len());
        self.ptr as u64 + off as u64
    }

    /// The word at `off` (8-byte aligned) as an atomic.
    fn word(&self, off: usize) -> &AtomicU64 {
        &self.words::<1>(off)[0]
    }

    /// The `N` words from `off` (8-byte aligned) as atomics, with one bounds check.
    fn words<const N: usize>(&self, off: usize) -> &[AtomicU64; N] {
        let inside = off.checked_add(8 * N).is_some_and(|end| end <= self.len());
        assert!(off.is_multiple_of(8) && inside, "bad {N}-word offset {off}");
        // SAFETY: in bounds and aligned (page-aligned base, off.is_multiple_of(8); `[AtomicU64;
        // N]` is N aligned words); the memory lives as long as `self`, and Rust only ever
        // accesses it atomically (the NIC's DMA is not a Rust access).
        unsafe { &*self.ptr.add(off).cast::<[AtomicU64; N]>() }
    }

    /// Reads the `N` words from `off` (8-byte aligned) in order, each as [`Self::load_u64`].
    pub fn load_n<const N: usize>(&self, off: usize) -> [u64; N] {
        let w = self.words::<N>(off);
        std::array::from_fn(|i| w[i].load(Ordering::Acquire))
    }

    /// Writes `v` at the `N` words from `off` (8-byte aligned) in order, each as
    /// [`Self::store_u64`].
    pub fn store_n<const N: usize>(&self, off: usize, v: [u64; N]) {
        for (w, v) in self.words::<N>(off).iter().zip(v) {
            w.store(v, Ordering::Release);
        }
    }

    /// Reads the `u64` at `off` (8-byte aligned), as the NIC last wrote it.
    pub fn load_u64(&self, off: usize) -> u64 {
        self.word(off).load(Ordering::Acquire)
    }

    /// Writes `v` at `off` (8-byte aligned) before the NIC is told to read it (the provider
    /// fences before it rings the doorbell).
    pub fn store_u64(&self, off: usize, v: u64) {
        self.word(off).store(v, Ordering::Release)
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        self.mrs.clear(); // deregister before the memory goes
        // SAFETY: ptr came from alloc_zeroed with this layout and is freed once.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}
