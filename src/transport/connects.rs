//! The connects in progress, parked between `connect` calls under a random id that `ffi` keeps
//! in the state bytes of NCCL's handle buffer. Those bytes are only ever looked up, never taken
//! for a pointer, so a garbled or foreign handle is simply not found, and a connect not found is
//! an error: never a silent new connect. [`step`] is the whole of one `connect` call.
//!
//! An entry leaves when its connect finishes or fails (taken and not parked again), when it
//! expires, when the table is full, or at the last `finalize`:
//! - a connect NCCL has not advanced for one setup timeout has passed its own deadline (each
//!   stage's deadline is at most one timeout after the call that last advanced it), so it
//!   expires then: NCCL abandoned it (`ncclCommAbort`, an error elsewhere);
//! - beyond [`MAX_CONNECTS`] at once, the one advanced least recently is pushed out;
//! - the last `finalize` purges the table ([`end_all`]), so no socket or queue pair outlives it.
//!
//! Every operation is O(1) (amortized): a map by id, and the park order, which is the deadline
//! order because every deadline is the park time plus the same setup timeout. Parking again
//! leaves a stale entry in the order; stale entries are skipped, and dropped in one pass when
//! they outnumber the live ones.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use once_cell::sync::Lazy;

use super::CommContext;
use super::data::SendComm;
use super::setup::Connector;
use crate::error::{Error, Result};
use ferroce_core::setup::wire::Handle;

/// The most connects in progress at once.
pub const MAX_CONNECTS: usize = 4096;

/// What one `connect` call came to.
pub enum Step {
    /// Connected.
    Done(Box<SendComm>),
    /// Not yet: NCCL calls again with the same handle, which must carry this id.
    Parked(u64),
}

/// One `connect` call towards the listener `h`: advances the connect parked under `id`, or, for
/// `id` 0, starts one on `dev` in the context `ctx` gives (asked for only then, so a stale id is
/// reported as such whatever the context). `tc` is the call's own traffic class (v10), which
/// wins over the context's. On error the connect is gone (its connector dropped, closing
/// everything it built).
pub fn step(
    id: u64,
    h: Handle,
    dev: i32,
    tc: Option<u8>,
    (ctx, owner): (impl FnOnce() -> Result<Arc<CommContext>>, usize),
) -> Result<Step> {
    // Abandoned connects go first (dropped once the table is unlocked).
    let expired = connects().expire(Instant::now());
    drop(expired);
    let (id, mut p) = if id != 0 {
        // A parked connect is taken only for the same listener.
        let p = connects().take(id, |p| p.connector.handle() == h).map_err(|m| m.error(id))?;
        (id, p)
    } else {
        let c = ctx()?;
        let connector = Box::new(Connector::start(&c, dev, h, tc.or(c.traffic_class))?);
        (fresh_id()?, Pending { connector, timeout: c.net.config.setup_timeout, owner })
    };
    if let Some(comm) = p.connector.progress()? {
        return Ok(Step::Done(comm));
    }
    let deadline = Instant::now() + p.timeout;
    let pushed_out = connects().park(id, p, deadline);
    if let Some((_, old)) = pushed_out {
        log::warn!(
            "connect: {MAX_CONNECTS} connects in progress; dropped the one to {} advanced least \
             recently (NCCL's next connect call for it fails)",
            old.connector.handle().addr
        );
    }
    Ok(Step::Parked(id))
}

/// Ends the connects in progress that context `owner` started (its `finalize`): how many.
pub fn end_owned(owner: usize) -> usize {
    let purged = connects().purge_if(|p| p.owner == owner);
    purged.len()
}

/// Ends every connect in progress (the last `finalize`).
pub fn end_all() {
    let purged = connects().purge();
    if !purged.is_empty() {
        log::info!("finalize: ended {} connect(s) NCCL left unfinished", purged.len());
    }
}

/// A connect between two calls, the timeout its deadline is measured with, and the context it
/// was started under (an opaque token: `ffi`'s address for it).
struct Pending {
    connector: Box<Connector>,
    timeout: Duration,
    owner: usize,
}

static CONNECTS: Lazy<Mutex<Parked<Pending>>> = Lazy::new(|| Mutex::new(Parked::new(MAX_CONNECTS)));

fn connects() -> MutexGuard<'static, Parked<Pending>> {
    // Every change is whole before the lock is released: a poisoned table is still usable.
    CONNECTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a parked value was not found.
#[derive(Debug, PartialEq, Eq)]
enum Miss {
    /// No entry under the id: never parked, finished, expired, pushed out or purged.
    Unknown,
    /// The entry under the id belongs to another listener: it stays.
    Foreign,
}

impl Miss {
    fn error(self, id: u64) -> Error {
        Error::Internal(match self {
            Miss::Unknown => format!(
                "connect: no connect in progress under id {id:#018x} (it failed, expired after \
                 FERROCE_SETUP_TIMEOUT_MS without a call, was pushed out by {MAX_CONNECTS} \
                 others, or finalize ended it)"
            ),
            Miss::Foreign => {
                format!("connect: id {id:#018x} belongs to a connect to another listener")
            }
        })
    }
}

struct Entry<T> {
    /// The park this entry came from; an order entry with another number is stale.
    seq: u64,
    value: T,
}

/// A bounded table of values parked between calls under 64-bit ids, each until its deadline.
struct Parked<T> {
    cap: usize,
    seq: u64,
    map: HashMap<u64, Entry<T>>,
    /// (seq, id, deadline) in park order, stale entries included.
    order: VecDeque<(u64, u64, Instant)>,
}

impl<T> Parked<T> {
    fn new(cap: usize) -> Self {
        Parked { cap, seq: 0, map: HashMap::new(), order: VecDeque::new() }
    }

    fn is_live(&self, seq: u64, id: u64) -> bool {
        self.map.get(&id).is_some_and(|e| e.seq == seq)
    }

    /// The oldest live entry of the order, stale ones before it dropped.
    fn front(&mut self) -> Option<(u64, Instant)> {
        while let Some(&(seq, id, deadline)) = self.order.front() {
            if self.is_live(seq, id) {
                return Some((id, deadline));
            }
            self.order.pop_front();
        }
        None
    }

    /// Parks `v` under `id` (a new id, or one just taken) until `deadline`; returns what was
    /// pushed out to make room.
    fn park(&mut self, id: u64, v: T, deadline: Instant) -> Option<(u64, T)> {
        let mut out = None;
        if self.map.len() >= self.cap
            && !self.map.contains_key(&id)
            && let Some((old, _)) = self.front()
        {
            out = self.map.remove(&old).map(|e| (old, e.value));
        }
        self.seq += 1;
        self.map.insert(id, Entry { seq: self.seq, value: v });
        self.order.push_back((self.seq, id, deadline));
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order.retain(|&(seq, id, _)| map.get(&id).is_some_and(|e| e.seq == seq));
        }
        out
    }

    /// Takes the value under `id` if there is one and `belongs` accepts it.
    fn take(&mut self, id: u64, belongs: impl FnOnce(&T) -> bool) -> Result<T, Miss> {
        let e = self.map.get(&id).ok_or(Miss::Unknown)?;
        if !belongs(&e.value) {
            return Err(Miss::Foreign);
        }
        Ok(self.map.remove(&id).expect("just found").value)
    }

    fn contains(&self, id: u64) -> bool {
        self.map.contains_key(&id)
    }

    /// Removes the values whose deadline passed before `now` (strictly, as the setup machine
    /// judges its own deadlines).
    fn expire(&mut self, now: Instant) -> Vec<T> {
        let mut gone = Vec::new();
        while let Some((id, deadline)) = self.front() {
            if now <= deadline {
                break;
            }
            self.order.pop_front();
            gone.extend(self.map.remove(&id).map(|e| e.value));
        }
        gone
    }

    /// Removes every value.
    fn purge(&mut self) -> Vec<T> {
        self.order.clear();
        self.map.drain().map(|(_, e)| e.value).collect()
    }

    /// Removes the values `mine` picks (their order entries go stale, dropped as usual).
    fn purge_if(&mut self, mine: impl Fn(&T) -> bool) -> Vec<T> {
        let ids: Vec<u64> =
            self.map.iter().filter(|(_, e)| mine(&e.value)).map(|(&id, _)| id).collect();
        ids.into_iter().filter_map(|id| self.map.remove(&id)).map(|e| e.value).collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Instant::now()
    }
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn parked_values_are_found_by_id_only_and_leave_when_taken() {
        let now = t0();
        let mut t = Parked::new(3);
        assert_eq!(t.park(10, "a", now + S), None);
        assert_eq!(t.park(20, "b", now + S), None);
        assert_eq!(t.take(99, |_| true), Err(Miss::Unknown), "an unknown id is an error");
        assert_eq!(t.take(10, |v| *v == "other"), Err(Miss::Foreign));
        assert!(t.contains(10), "another listener's entry stays");
        assert_eq!(t.take(10, |v| *v == "a"), Ok("a"));
        assert_eq!(t.take(10, |_| true), Err(Miss::Unknown), "taken once");
    }

    #[test]
    fn a_full_table_pushes_out_the_value_advanced_least_recently_and_forgets_it() {
        let now = t0();
        let mut t = Parked::new(3);
        for (id, v) in [(1, 'a'), (2, 'b'), (3, 'c')] {
            assert_eq!(t.park(id, v, now + S), None);
        }
        // 1 is advanced again (taken and parked): 2 is now the stalest.
        let a = t.take(1, |_| true).unwrap();
        assert_eq!(t.park(1, a, now + S), None);
        assert_eq!(t.park(4, 'd', now + S), Some((2, 'b')));
        assert_eq!(t.park(5, 'e', now + S), Some((3, 'c')));
        assert_eq!(t.len(), 3);
        // Re-parking a present id never pushes anything out.
        assert_eq!(t.park(5, 'f', now + S), None);
        assert_eq!(t.len(), 3);
        // What was pushed out is an error when NCCL comes back for it, not a new connect.
        assert_eq!(t.take(2, |_| true), Err(Miss::Unknown));
        assert!(Miss::Unknown.error(2).to_string().contains("no connect in progress"));
    }

    #[test]
    fn values_expire_strictly_after_their_deadline_in_deadline_order() {
        let now = t0();
        let mut t = Parked::new(8);
        t.park(1, 'a', now + S);
        t.park(2, 'b', now + 2 * S);
        t.park(3, 'c', now + 3 * S);
        // 1 is advanced again later: its new deadline is behind 3's.
        let a = t.take(1, |_| true).unwrap();
        t.park(1, a, now + 4 * S);
        assert_eq!(t.expire(now + S), Vec::<char>::new(), "not before the deadline");
        assert_eq!(t.expire(now + 2 * S + Duration::from_nanos(1)), vec!['b']);
        assert_eq!(t.expire(now + 3 * S + Duration::from_nanos(1)), vec!['c']);
        assert!(t.contains(1), "its first deadline no longer counts");
        assert_eq!(t.expire(now + 5 * S), vec!['a']);
        assert_eq!(t.len(), 0);
        assert_eq!(t.take(2, |_| true), Err(Miss::Unknown), "an expired id is an error");
    }

    #[test]
    fn purge_empties_the_table() {
        let now = t0();
        let mut t = Parked::new(8);
        for id in 1..=5 {
            t.park(id, id, now + S);
        }
        let mut all = t.purge();
        all.sort();
        assert_eq!(all, vec![1, 2, 3, 4, 5]);
        assert_eq!(t.len(), 0);
        assert!(t.expire(now + 9 * S).is_empty());
        assert_eq!(t.take(3, |_| true), Err(Miss::Unknown));
    }

    #[test]
    fn the_order_stays_proportional_to_the_live_entries() {
        // One connect advanced a million times, next to a few others: the stale entries of
        // its earlier parks are dropped as they pile up, and every park stays O(1) amortized.
        let now = t0();
        let mut t = Parked::new(MAX_CONNECTS);
        for id in 2..=4 {
            t.park(id, 0u32, now + S);
        }
        for i in 0..1_000_000u32 {
            let v = t.take(1, |_| true).unwrap_or(i);
            t.park(1, v, now + S);
            assert!(t.order.len() <= 2 * t.len() + 17);
        }
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn a_full_table_evicts_in_constant_time() {
        // 4096 live entries, then 100k more parks: each evicts the front without a scan (a
        // scan would make this quadratic: 4e8 steps).
        let now = t0();
        let mut t = Parked::new(MAX_CONNECTS);
        for id in 0..MAX_CONNECTS as u64 {
            t.park(id, id, now + S);
        }
        let start = Instant::now();
        for id in MAX_CONNECTS as u64..MAX_CONNECTS as u64 + 100_000 {
            let (old, v) = t.park(id, id, now + S).expect("full: the oldest goes");
            assert_eq!((old, v), (id - MAX_CONNECTS as u64, id - MAX_CONNECTS as u64));
        }
        assert_eq!(t.len(), MAX_CONNECTS);
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    }
}
