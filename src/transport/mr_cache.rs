//! The registration cache: one memory region per page-aligned range per device, shared by every
//! comm that registers it, released when the last user deregisters.
//!
//! `regMr` asks for `[addr, addr + len)`. The cache rounds it out to whole pages and reuses an
//! existing registration that covers the rounded range; otherwise it registers the rounded
//! range. Pure interval logic, generic over the registration type so it is tested without
//! verbs. The owner (a device) serialises access with a mutex.

/// A cached registration and its users.
struct Entry<T> {
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

    /// Finds a registration covering the range or creates one with `register(start, len)`.
    pub fn acquire<E>(
        &mut self,
        addr: u64,
        len: u64,
        register: impl FnOnce(u64, u64) -> Result<T, E>,
    ) -> Result<Lease<T>, E> {
        let (start, end) = self.round(addr, len);
        if let Some(e) = self.entries.iter_mut().find(|e| e.start <= start && end <= e.end) {
            e.users += 1;
            return Ok(Lease { reg: e.reg.clone(), start: e.start, end: e.end });
        }
        let reg = register(start, end - start)?;
        self.entries.push(Entry { start, end, users: 1, reg: reg.clone() });
        Ok(Lease { reg, start, end })
    }

    /// Drops one user of a lease's registration; returns the registration when that was the
    /// last user (the caller then lets it go), `None` otherwise.
    pub fn release(&mut self, start: u64, end: u64) -> Option<T> {
        let i = self.entries.iter().position(|e| e.start == start && e.end == end)?;
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
        let a = c.acquire(100, 8000, reg_counter(&mut n)).unwrap();
        let b = c.acquire(100, 8000, reg_counter(&mut n)).unwrap();
        let inner = c.acquire(PAGE, 10, reg_counter(&mut n)).unwrap();
        assert_eq!((a.reg, b.reg, inner.reg, n), (1, 1, 1, 1));
        assert_eq!(c.len(), 1);
        assert_eq!(c.release(a.start, a.end), None);
        assert_eq!(c.release(b.start, b.end), None);
        assert_eq!(c.release(inner.start, inner.end), Some(1));
        assert!(c.is_empty());
    }

    #[test]
    fn a_larger_range_gets_its_own_registration() {
        let mut c = MrCache::new(PAGE);
        let mut n = 0;
        let small = c.acquire(0, 10, reg_counter(&mut n)).unwrap();
        let big = c.acquire(0, 3 * PAGE, reg_counter(&mut n)).unwrap();
        assert_ne!(small.reg, big.reg);
        // A later small one is covered by whichever comes first.
        assert_eq!(c.acquire(10, 10, reg_counter(&mut n)).unwrap().reg, small.reg);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_failed_registration_leaves_no_entry() {
        let mut c = MrCache::<u32>::new(PAGE);
        assert_eq!(c.acquire(0, 10, |_, _| Err("boom")), Err("boom"));
        assert!(c.is_empty());
        assert_eq!(c.release(0, PAGE), None);
    }

    /// Random interleavings against a simple model: every lease covers its request, the number
    /// of users of each registration matches the outstanding leases, and releasing everything
    /// empties the cache.
    #[test]
    fn property_random_acquire_release() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _round in 0..200 {
            let mut c = MrCache::new(PAGE);
            let mut next = 0u32;
            let mut regs = std::collections::HashMap::new(); // id -> (start, len) registered
            let mut leases: Vec<Lease<u32>> = Vec::new();
            for _ in 0..60 {
                if leases.is_empty() || rand(3) > 0 {
                    let addr = rand(16 * PAGE);
                    let len = rand(4 * PAGE);
                    let lease = c
                        .acquire(addr, len, |s, l| {
                            next += 1;
                            regs.insert(next, (s, l));
                            Ok::<_, ()>(next)
                        })
                        .unwrap();
                    let (s, l) = regs[&lease.reg];
                    assert!(s <= addr && addr + len.max(1) <= s + l, "lease does not cover");
                    assert_eq!((s % PAGE, l % PAGE), (0, 0));
                    leases.push(lease);
                } else {
                    let l = leases.swap_remove(rand(leases.len() as u64) as usize);
                    let last = c.release(l.start, l.end);
                    let still = leases.iter().any(|o| o.reg == l.reg);
                    assert_eq!(last.is_some(), !still, "freed while in use, or leaked");
                }
                let live: std::collections::HashSet<_> = leases.iter().map(|l| l.reg).collect();
                assert_eq!(c.len(), live.len());
            }
            for l in leases.drain(..) {
                c.release(l.start, l.end);
            }
            assert!(c.is_empty());
        }
    }
}
