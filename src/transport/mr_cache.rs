//! The registration cache: one memory region per range and memory kind per device, shared by
//! every comm that registers it, released when the last user deregisters.
//!
//! `regMr` asks for `[addr, addr + len)` of host or peer-memory GPU memory: the cache rounds it
//! out to whole pages and reuses a registration of the same kind that covers the rounded range,
//! or registers the rounded range. A dma-buf range is never rounded: only the part NCCL
//! exported exists behind the fd, so it is registered exactly and reused only by requests
//! inside it. Kinds never share entries: a host MR cannot stand in for a GPU one.
//!
//! Pure interval logic, generic over the registration type so it is tested without verbs. The
//! owner (a device) serialises access with a mutex.

/// Where registered memory lives, and so how it is registered and whether it needs a flush.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    Host,
    /// GPU memory through peer memory (`regMr` with `NCCL_PTR_CUDA`).
    Cuda,
    /// GPU memory through a dma-buf fd (`regMrDmaBuf`).
    DmaBuf,
}

impl MemKind {
    /// Memory the NIC writes over PCIe into a GPU: receives into it need the flush.
    pub fn is_gpu(self) -> bool {
        self != MemKind::Host
    }
}

/// A cached registration and its users.
struct Entry<T> {
    kind: MemKind,
    start: u64,
    end: u64,
    users: usize,
    reg: T,
}

pub struct MrCache<T> {
    page: u64,
    entries: Vec<Entry<T>>,
}

/// What [`MrCache::acquire`] gives back: the registration and the key to release it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease<T> {
    pub reg: T,
    pub kind: MemKind,
    pub start: u64,
    pub end: u64,
}

impl<T: Clone> MrCache<T> {
    pub fn new(page: u64) -> MrCache<T> {
        assert!(page.is_power_of_two(), "page size {page}");
        MrCache { page, entries: Vec::new() }
    }

    /// The page-aligned range that covers `[addr, addr + len)`; a zero length covers one byte.
    pub fn round(&self, addr: u64, len: u64) -> (u64, u64) {
        let start = addr & !(self.page - 1);
        let end = addr.saturating_add(len.max(1)).saturating_add(self.page - 1) & !(self.page - 1);
        (start, end)
    }

    /// The range registered for a request: page-rounded, except a dma-buf's exact one.
    pub fn span(&self, kind: MemKind, addr: u64, len: u64) -> (u64, u64) {
        match kind {
            MemKind::DmaBuf => (addr, addr.saturating_add(len.max(1))),
            MemKind::Host | MemKind::Cuda => self.round(addr, len),
        }
    }

    /// Finds a registration of `kind` covering the range or creates one with
    /// `register(start, len)`.
    pub fn acquire<E>(
        &mut self,
        kind: MemKind,
        addr: u64,
        len: u64,
        register: impl FnOnce(u64, u64) -> Result<T, E>,
    ) -> Result<Lease<T>, E> {
        let (start, end) = self.span(kind, addr, len);
        let hit = |e: &&mut Entry<T>| e.kind == kind && e.start <= start && end <= e.end;
        if let Some(e) = self.entries.iter_mut().find(hit) {
            e.users += 1;
            return Ok(Lease { reg: e.reg.clone(), kind, start: e.start, end: e.end });
        }
        let reg = register(start, end - start)?;
        self.entries.push(Entry { kind, start, end, users: 1, reg: reg.clone() });
        Ok(Lease { reg, kind, start, end })
    }

    /// Drops one user of a lease's registration; returns the registration when that was the
    /// last user (the caller then lets it go), `None` otherwise.
    pub fn release(&mut self, kind: MemKind, start: u64, end: u64) -> Option<T> {
        let i =
            self.entries.iter().position(|e| e.kind == kind && e.start == start && e.end == end)?;
        self.entries[i].users -= 1;
        (self.entries[i].users == 0).then(|| self.entries.swap_remove(i).reg)
    }

    /// Live registrations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn reg_counter(n: &mut u32) -> impl FnOnce(u64, u64) -> Result<u32, ()> + '_ {
        move |_, _| {
            *n += 1;
            Ok(*n)
        }
    }

    #[test]
    fn rounds_to_pages() {
        let c = MrCache::<u32>::new(PAGE);
        assert_eq!(c.round(0, 1), (0, PAGE));
        assert_eq!(c.round(1, PAGE), (0, 2 * PAGE));
        assert_eq!(c.round(PAGE, PAGE), (PAGE, 2 * PAGE));
        assert_eq!(c.round(PAGE + 5, 0), (PAGE, 2 * PAGE));
        assert_eq!(c.round(u64::MAX - 10, 5).0, !(PAGE - 1));
    }

    #[test]
    fn same_range_twice_is_one_registration() {
        let mut c = MrCache::new(PAGE);
        let mut n = 0;
        let a = c.acquire(MemKind::Host, 100, 8000, reg_counter(&mut n)).unwrap();
        let b = c.acquire(MemKind::Host, 100, 8000, reg_counter(&mut n)).unwrap();
        let inner = c.acquire(MemKind::Host, PAGE, 10, reg_counter(&mut n)).unwrap();
        assert_eq!((a.reg, b.reg, inner.reg, n), (1, 1, 1, 1));
        assert_eq!(c.len(), 1);
        assert_eq!(c.release(MemKind::Host, a.start, a.end), None);
        assert_eq!(c.release(MemKind::Host, b.start, b.end), None);
        assert_eq!(c.release(MemKind::Host, inner.start, inner.end), Some(1));
        assert!(c.is_empty());
    }

    #[test]
    fn a_larger_range_gets_its_own_registration() {
        let mut c = MrCache::new(PAGE);
        let mut n = 0;
        let small = c.acquire(MemKind::Host, 0, 10, reg_counter(&mut n)).unwrap();
        let big = c.acquire(MemKind::Host, 0, 3 * PAGE, reg_counter(&mut n)).unwrap();
        assert_ne!(small.reg, big.reg);
        // A later small one is covered by whichever comes first.
        assert_eq!(c.acquire(MemKind::Host, 10, 10, reg_counter(&mut n)).unwrap().reg, small.reg);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_failed_registration_leaves_no_entry() {
        let mut c = MrCache::<u32>::new(PAGE);
        assert_eq!(c.acquire(MemKind::Host, 0, 10, |_, _| Err("boom")), Err("boom"));
        assert!(c.is_empty());
        assert_eq!(c.release(MemKind::Host, 0, PAGE), None);
    }

    #[test]
    fn kinds_never_share_a_registration() {
        let mut c = MrCache::new(PAGE);
        let mut n = 0;
        let host = c.acquire(MemKind::Host, 0, 2 * PAGE, reg_counter(&mut n)).unwrap();
        let cuda = c.acquire(MemKind::Cuda, 0, PAGE, reg_counter(&mut n)).unwrap();
        let dmabuf = c.acquire(MemKind::DmaBuf, 0, PAGE, reg_counter(&mut n)).unwrap();
        assert_eq!((host.reg, cuda.reg, dmabuf.reg), (1, 2, 3));
        // Releasing with the wrong kind finds nothing.
        assert_eq!(c.release(MemKind::Cuda, host.start, host.end), None);
        assert_eq!(c.release(MemKind::DmaBuf, host.start, host.end), None);
        assert_eq!(c.len(), 3);
        assert_eq!(c.release(MemKind::Host, host.start, host.end), Some(1));
    }

    #[test]
    fn a_dmabuf_range_is_registered_exactly() {
        let mut c = MrCache::new(PAGE);
        let mut got = Vec::new();
        let mut reg = |s, l| {
            got.push((s, l));
            Ok::<_, ()>(got.len())
        };
        let a = c.acquire(MemKind::DmaBuf, PAGE + 100, 5000, &mut reg).unwrap();
        assert_eq!((a.start, a.end), (PAGE + 100, PAGE + 5100));
        // Inside it: reused. Reaching one byte past it: a registration of its own, exact too.
        let inner = c.acquire(MemKind::DmaBuf, PAGE + 200, 4900, &mut reg).unwrap();
        assert_eq!(inner.reg, a.reg);
        let past = c.acquire(MemKind::DmaBuf, PAGE + 200, 4901, &mut reg).unwrap();
        assert_ne!(past.reg, a.reg);
        assert_eq!(got, [(PAGE + 100, 5000), (PAGE + 200, 4901)]);
    }

    /// Random interleavings of all three kinds against a simple model: every lease covers its
    /// request with a registration of its kind (page-aligned except for dma-buf, which is
    /// never larger than asked when it is registered), the number of users of each
    /// registration matches the outstanding leases, and releasing everything empties the cache.
    #[test]
    fn property_random_acquire_release() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        const KINDS: [MemKind; 3] = [MemKind::Host, MemKind::Cuda, MemKind::DmaBuf];
        for _round in 0..200 {
            let mut c = MrCache::new(PAGE);
            let mut next = 0u32;
            // id -> (kind, start, len) registered
            let mut regs = std::collections::HashMap::new();
            let mut leases: Vec<Lease<u32>> = Vec::new();
            for _ in 0..60 {
                if leases.is_empty() || rand(3) > 0 {
                    let kind = KINDS[rand(3) as usize];
                    let addr = rand(16 * PAGE);
                    let len = rand(4 * PAGE);
                    let lease = c
                        .acquire(kind, addr, len, |s, l| {
                            next += 1;
                            regs.insert(next, (kind, s, l));
                            if kind == MemKind::DmaBuf {
                                assert_eq!((s, l), (addr, len.max(1)), "dma-buf rounded");
                            }
                            Ok::<_, ()>(next)
                        })
                        .unwrap();
                    let (k, s, l) = regs[&lease.reg];
                    assert_eq!((k, lease.kind), (kind, kind), "lease of another kind");
                    assert!(s <= addr && addr + len.max(1) <= s + l, "lease does not cover");
                    if kind != MemKind::DmaBuf {
                        assert_eq!((s % PAGE, l % PAGE), (0, 0));
                    }
                    leases.push(lease);
                } else {
                    let l = leases.swap_remove(rand(leases.len() as u64) as usize);
                    let last = c.release(l.kind, l.start, l.end);
                    let still = leases.iter().any(|o| o.reg == l.reg);
                    assert_eq!(last.is_some(), !still, "freed while in use, or leaked");
                }
                let live: std::collections::HashSet<_> = leases.iter().map(|l| l.reg).collect();
                assert_eq!(c.len(), live.len());
            }
            for l in leases.drain(..) {
                c.release(l.kind, l.start, l.end);
            }
            assert!(c.is_empty());
        }
    }
}
