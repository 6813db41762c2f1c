//! A first-in, first-out queue of small `Copy` values in a power-of-two array, for the queues
//! the hot path pushes to and pops from on every message: a push or a pop is a mask and a
//! store or load, inline (a `VecDeque`'s push is a call with its own growth and wrap checks).
//! It grows, doubling, only when full; the queues that use it are sized not to be.

#[derive(Clone, Debug)]
pub(super) struct Ring<T> {
    buf: Box<[T]>,
    /// Where the oldest value is, and how many there are.
    head: usize,
    len: usize,
}

impl<T: Copy + Default> Default for Ring<T> {
    fn default() -> Ring<T> {
        Ring::with_capacity(1)
    }
}

impl<T: Copy + Default> Ring<T> {
    /// Room for `n` values (rounded up to a power of two) before the first growth.
    pub(super) fn with_capacity(n: usize) -> Ring<T> {
        Ring { buf: vec![T::default(); n.max(1).next_power_of_two()].into(), head: 0, len: 0 }
    }

    fn at(&self, k: usize) -> usize {
        (self.head + k) & (self.buf.len() - 1)
    }

    #[inline(always)]
    pub(super) fn push_back(&mut self, v: T) {
        if self.len == self.buf.len() {
            self.grow();
        }
        let i = self.at(self.len);
        self.buf[i] = v;
        self.len += 1;
    }

    #[inline(always)]
    pub(super) fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let v = self.buf[self.head];
        self.head = self.at(1);
        self.len -= 1;
        Some(v)
    }

    pub(super) fn front(&self) -> Option<&T> {
        (self.len > 0).then(|| &self.buf[self.head])
    }

    pub(super) fn back(&self) -> Option<&T> {
        (self.len > 0).then(|| &self.buf[self.at(self.len - 1)])
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn clear(&mut self) {
        (self.head, self.len) = (0, 0);
    }

    /// Twice the room, the values kept in order from the start.
    #[cold]
    fn grow(&mut self) {
        let mut buf = vec![T::default(); self.buf.len() * 2];
        for (k, v) in buf.iter_mut().take(self.len).enumerate() {
            *v = self.buf[self.at(k)];
        }
        (self.buf, self.head) = (buf.into(), 0);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::Ring;

    /// Against `VecDeque`, through wraps and growths, with every operation in a mixed order.
    #[test]
    fn behaves_as_a_vecdeque() {
        let (mut ring, mut model) = (Ring::with_capacity(3), VecDeque::new());
        let mut x = 0x2545_f491_u64;
        for i in 0..10_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 7 {
                0..=2 => {
                    ring.push_back(i);
                    model.push_back(i);
                }
                3..=5 => assert_eq!(ring.pop_front(), model.pop_front()),
                _ if i % 500 == 0 => {
                    ring.clear();
                    model.clear();
                }
                _ => {}
            }
            assert_eq!((ring.len(), ring.is_empty()), (model.len(), model.is_empty()));
            assert_eq!((ring.front(), ring.back()), (model.front(), model.back()));
        }
        assert!(ring.buf.len() > 4, "the mix never made it grow");
    }
}
