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
    mr: Option<Mr>,
}

// SAFETY: the buffer is owned memory; nothing in it is tied to the thread that allocated it.
unsafe impl Send for RegisteredBuf {}
// SAFETY: shared access only reads the fields set in `new` and reads or writes the memory
// through atomics (`load_u64`, `store_u64`): concurrent calls cannot race.
unsafe impl Sync for RegisteredBuf {}

impl RegisteredBuf {
    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access`.
    pub fn new(pd: &Arc<Pd>, len: usize, access: u32) -> Result<RegisteredBuf> {
        let layout = Layout::from_size_align(len.max(8), 4096)
            .map_err(|e| Error::Internal(format!("buffer layout: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Internal(format!("out of memory for a {len}-byte buffer")));
        }
        let mut buf = RegisteredBuf { ptr, layout, mr: None };
        // SAFETY: the allocation lives until Drop, which drops the MR first; Rust reaches it
        // only through atomics, which a NIC's writes cannot invalidate.
        buf.mr = Some(unsafe { Mr::register(pd, ptr.cast(), layout.size(), access) }?);
        Ok(buf)
    }

    fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("registered in new")
    }

    pub fn lkey(&self) -> u32 {
        self.mr().lkey
    }

    pub fn rkey(&self) -> u32 {
        self.mr().rkey
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
        assert!(off.is_multiple_of(8) && off + 8 <= self.len(), "bad u64 offset {off}");
        // SAFETY: in bounds and aligned (page-aligned base, off.is_multiple_of(8)); the memory
        // lives as long as `self`, and Rust only ever accesses it atomically (the NIC's DMA is
        // not a Rust access).
        unsafe { AtomicU64::from_ptr(self.ptr.add(off).cast::<u64>()) }
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
        drop(self.mr.take()); // deregister before the memory goes
        // SAFETY: ptr came from alloc_zeroed with this layout and is freed once.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}
