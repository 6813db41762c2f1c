//! Host memory the plugin registers and the NIC reads and writes: an owned, page-aligned buffer
//! whose address the [`crate::driver`] hands to `regMr`, `isend` and `irecv`, with safe ways
//! to fill it, check it and watch it. Used by `ferroce perf`, `doctor --selftest` and
//! `collective`, and by the tests.
//!
//! The NIC writes the memory behind the compiler's back, so nothing here keeps a Rust reference
//! to it across calls: every access goes through the raw pointer, and a byte that a receive
//! may be writing (an LL flag) is read volatile. What the bytes hold while a request is in
//! flight is the caller's business, as it is NCCL's: any value is a valid byte or float.
//!
//! Also here: the data pattern every transfer of the tools and tests sends, so that a receive
//! can be checked byte for byte against what its sender put in.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Page alignment, as NCCL's buffers have: registration pins whole pages either way.
const ALIGN: usize = 4096;

/// Byte `i` of a message with pattern `seed`: a period of 251 (a prime), so a block that lands
/// at the wrong offset, by a page or by a power of two, does not match.
pub fn pattern(seed: u8, i: usize) -> u8 {
    ((i % 251) as u8).wrapping_add(seed)
}

/// An owned, zeroed, page-aligned host buffer.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl HostBuf {
    /// `len` zero bytes (at least one is allocated, so even an empty buffer has an address).
    pub fn new(len: usize) -> HostBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HostBuf { ptr, len }
    }

    /// `len` bytes of [`pattern`] `seed`.
    pub fn patterned(len: usize, seed: u8) -> HostBuf {
        let b = HostBuf::new(len);
        b.fill(0..len, seed);
        b
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), ALIGN).expect("a buffer size within isize")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of byte `off` (`off <= len`), for the driver: the plugin and the NIC use it,
    /// never this process through it.
    pub fn at(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len, "offset {off} past a {}-byte buffer", self.len);
        self.ptr.as_ptr().wrapping_add(off)
    }

    /// The start address, for the driver.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes `range`, checked against the buffer.
    fn span(&self, range: std::ops::Range<usize>) -> (*mut u8, usize) {
        assert!(range.start <= range.end && range.end <= self.len, "{range:?} of {}", self.len);
        (self.at(range.start), range.end - range.start)
    }

    /// Writes [`pattern`] `seed` over `range`, byte `i` of the range being pattern byte `i`.
    pub fn fill(&self, range: std::ops::Range<usize>, seed: u8) {
        let (p, n) = self.span(range);
        for i in 0..n {
            // SAFETY: in bounds (span); no reference to the memory exists.
            unsafe { p.add(i).write(pattern(seed, i)) }
        }
    }

    /// Zeroes `range`.
    pub fn zero(&self, range: std::ops::Range<usize>) {
        let (p, n) = self.span(range);
        // SAFETY: in bounds (span); no reference to the memory exists.
        unsafe { p.write_bytes(0, n) }
    }

    /// Byte `i`, read afresh from memory (the NIC may have written it since the last look).
    pub fn get(&self, i: usize) -> u8 {
        let (p, _) = self.span(i..i + 1);
        // SAFETY: in bounds; a byte is read whole, whatever the NIC writes meanwhile.
        unsafe { p.read_volatile() }
    }

    /// Writes byte `i` to memory at once (the NIC reads it when a send goes out).
    pub fn set(&self, i: usize, v: u8) {
        let (p, _) = self.span(i..i + 1);
        // SAFETY: in bounds; no reference to the memory exists.
        unsafe { p.write_volatile(v) }
    }

    /// The first offset in `range` whose byte is not `want(i)` (`i` counted from the range's
    /// start), or `None` when all match.
    pub fn mismatch(
        &self,
        range: std::ops::Range<usize>,
        want: impl Fn(usize) -> u8,
    ) -> Option<usize> {
        let (p, n) = self.span(range);
        // SAFETY: in bounds; reads of plain bytes, none kept.
        (0..n).find(|&i| unsafe { p.add(i).read() } != want(i))
    }

    /// `range` against [`pattern`] `seed`: an error naming the first byte that differs.
    pub fn check(&self, range: std::ops::Range<usize>, seed: u8) -> Result<(), String> {
        let n = range.len();
        match self.mismatch(range, |i| pattern(seed, i)) {
            None => Ok(()),
            Some(i) => Err(format!("a {n}-byte message arrived corrupted at byte {i}")),
        }
    }

    /// A copy of `range`.
    pub fn to_vec(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        let (p, n) = self.span(range);
        let mut v = vec![0u8; n];
        // SAFETY: in bounds; the copy does not overlap a fresh Vec.
        unsafe { p.copy_to_nonoverlapping(v.as_mut_ptr(), n) };
        v
    }

    /// Copies `bytes` in at `off`.
    pub fn write(&self, off: usize, bytes: &[u8]) {
        let (p, n) = self.span(off..off + bytes.len());
        // SAFETY: in bounds; a slice of this process does not overlap this allocation while
        // no reference to it exists.
        unsafe { p.copy_from_nonoverlapping(bytes.as_ptr(), n) };
    }

    /// The buffer as `f32`s (its length rounded down to whole floats). Exclusive, as the
    /// methods above write through `&self`: no shared view of the memory is ever handed out.
    pub fn floats_mut(&mut self) -> &mut [f32] {
        // SAFETY: page-aligned, so aligned for f32; `len / 4` floats lie inside; any bits are a
        // valid f32; `&mut self` makes this the only reference for its lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<f32>(), self.len / 4) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_check_and_the_bytes_between() {
        let b = HostBuf::new(1000);
        assert_eq!(b.ptr() as usize % ALIGN, 0);
        assert!(b.check(0..10, 0).is_err(), "zeroed, and pattern 0 starts 0, 1, ...");
        b.fill(100..600, 7);
        assert_eq!(b.check(100..600, 7), Ok(()));
        assert_eq!((b.get(99), b.get(100), b.get(101), b.get(351)), (0, 7, 8, 7));
        b.set(300, 0);
        assert_eq!(
            b.check(100..600, 7),
            Err("a 500-byte message arrived corrupted at byte 200".into())
        );
        b.zero(0..1000);
        assert!(b.to_vec(0..1000).iter().all(|&x| x == 0));
        b.write(10, &[1, 2, 3]);
        assert_eq!(b.to_vec(9..14), [0, 1, 2, 3, 0]);
        let e = HostBuf::new(0);
        assert!(e.is_empty() && !e.ptr().is_null());
    }

    #[test]
    fn floats_see_the_same_memory() {
        let mut b = HostBuf::new(16);
        b.floats_mut()[1] = 1.5;
        assert_eq!(b.floats_mut(), [0.0, 1.5, 0.0, 0.0]);
        assert_eq!(b.to_vec(4..8), 1.5f32.to_ne_bytes());
    }

    #[test]
    #[should_panic]
    fn a_range_past_the_end_panics() {
        HostBuf::new(8).fill(4..9, 0);
    }
}
