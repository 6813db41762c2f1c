//! The ring: what each rank sends and receives, slice by slice, in one collective, and what its
//! buffer holds before and after. Pure arithmetic, checked by simulating whole rings.

use super::{Coll, SLICE};

/// One slice the ring moves: elements `[off, off + len)` of the working buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slice {
    pub off: usize,
    pub len: usize,
}

/// What one channel sends and receives in one collective, in order.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// Each send, with the index of the receive it must wait for (none on the first step).
    pub sends: Vec<(Slice, Option<usize>)>,
    /// Each receive, and whether it is added to the buffer (reduce) or lands in place.
    pub recvs: Vec<(Slice, bool)>,
}

/// Rank `rank`'s part for channel `ch` of `chans` of a ring collective over `count` elements.
///
/// The buffer is `n` blocks (block `b` belongs to rank `b` at the end); reduce-scatter step `k`
/// sends block `rank - k - 1` and adds block `rank - k - 2` into the buffer, so rank `r` ends
/// with the sum of block `r`; all-gather step `k` sends block `rank - k` and receives block
/// `rank - k - 1` in place. Each block is split between the channels and cut into slices; the
/// slices of a step pair up with the next step's by position, since the block a step receives is
/// the one the next step sends.
pub fn plan(coll: Coll, count: usize, n: usize, rank: usize, ch: usize, chans: usize) -> Plan {
    let block = |b: usize| {
        let (lo, hi) = (b * count / n, (b + 1) * count / n);
        let (clo, chi) = (lo + (hi - lo) * ch / chans, lo + (hi - lo) * (ch + 1) / chans);
        let per = SLICE / 4;
        (clo..chi).step_by(per).map(move |s| Slice { off: s, len: per.min(chi - s) })
    };
    let m = |x: usize| x % n;
    let mut steps: Vec<(usize, usize, bool)> = Vec::new();
    if coll != Coll::AllGather {
        steps.extend((0..n - 1).map(|k| (m(rank + 2 * n - k - 1), m(rank + 2 * n - k - 2), true)));
    }
    if coll != Coll::ReduceScatter {
        steps.extend((0..n - 1).map(|k| (m(rank + 2 * n - k), m(rank + 2 * n - k - 1), false)));
    }
    let mut p = Plan::default();
    let mut prev_recvs: Vec<usize> = Vec::new();
    for (k, &(sb, rb, reduce)) in steps.iter().enumerate() {
        for (j, s) in block(sb).enumerate() {
            p.sends.push((s, (k > 0).then(|| prev_recvs[j])));
        }
        prev_recvs.clear();
        for s in block(rb) {
            prev_recvs.push(p.recvs.len());
            p.recvs.push((s, reduce));
        }
    }
    p
}

/// The rank whose block holds element `i` of `count`: block `b` is `[b·count/n, (b+1)·count/n)`.
fn owner(count: usize, n: usize, i: usize) -> usize {
    // The first b with (b+1)·count/n > i; the estimate is at most one block short.
    let mut b = i * n / count.max(1);
    while (b + 1) * count / n <= i {
        b += 1;
    }
    b
}

/// The value rank `r` puts at element `i` of its buffer. Small integers, so float sums are
/// exact.
pub fn input(coll: Coll, count: usize, n: usize, r: usize, i: usize) -> f32 {
    let v = (i % 1021 + 1) as f32;
    match coll {
        // Only a rank's own block is its input; the rest must be overwritten.
        Coll::AllGather if owner(count, n, i) == r => (r + 1) as f32 * 10_000.0 + v,
        Coll::AllGather => -1.0,
        _ => (r + 1) as f32 * v,
    }
}

/// What the collective must leave at element `i` of rank `r`'s buffer; `None` where nothing is
/// defined (a reduce-scatter's other blocks).
pub fn expected(coll: Coll, count: usize, n: usize, r: usize, i: usize) -> Option<f32> {
    let v = (i % 1021 + 1) as f32;
    let owner = owner(count, n, i);
    match coll {
        Coll::AllReduce => Some((n * (n + 1) / 2) as f32 * v),
        Coll::AllGather => Some((owner + 1) as f32 * 10_000.0 + v),
        Coll::ReduceScatter => (owner == r).then(|| (n * (n + 1) / 2) as f32 * v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the ring on the plans `make` gives: every rank's sends must meet the next
    /// rank's receives slice by slice, and running them in dependency order must give the
    /// expected result.
    fn simulate(
        coll: Coll,
        count: usize,
        n: usize,
        chans: usize,
        make: impl Fn(usize, usize) -> Plan,
    ) {
        let mut bufs: Vec<Vec<f32>> =
            (0..n).map(|r| (0..count).map(|i| input(coll, count, n, r, i)).collect()).collect();
        for ch in 0..chans {
            let plans: Vec<Plan> = (0..n).map(|r| make(r, ch)).collect();
            for r in 0..n {
                let next = &plans[(r + 1) % n];
                assert_eq!(plans[r].sends.len(), next.recvs.len(), "{coll:?} n={n} count={count}");
                for ((s, _), (q, _)) in plans[r].sends.iter().zip(&next.recvs) {
                    assert_eq!(s, q, "rank {r} sends what rank {} receives", (r + 1) % n);
                    assert!(s.len > 0 && s.len * 4 <= SLICE);
                }
            }
            // Step through: a rank may send once its dependency has been received.
            let mut sent = vec![0; n];
            let mut recvd = vec![0; n];
            loop {
                let mut moved = false;
                for r in 0..n {
                    let p = &plans[r];
                    let to = (r + 1) % n;
                    while sent[r] < p.sends.len() && p.sends[sent[r]].1.is_none_or(|d| d < recvd[r])
                    {
                        let (s, _) = p.sends[sent[r]];
                        let (q, reduce) = plans[to].recvs[recvd[to]];
                        let src: Vec<f32> = bufs[r][s.off..s.off + s.len].to_vec();
                        for (d, x) in bufs[to][q.off..q.off + q.len].iter_mut().zip(src) {
                            if reduce { *d += x } else { *d = x }
                        }
                        sent[r] += 1;
                        recvd[to] += 1;
                        moved = true;
                    }
                }
                if !moved {
                    break;
                }
            }
            for r in 0..n {
                assert_eq!(sent[r], plans[r].sends.len(), "rank {r} channel {ch} deadlocked");
            }
        }
        for (r, b) in bufs.iter().enumerate() {
            for (i, x) in b.iter().enumerate() {
                if let Some(e) = expected(coll, count, n, r, i) {
                    assert_eq!(*x, e, "{coll:?} n={n} count={count} rank {r} element {i}");
                }
            }
        }
    }

    #[test]
    fn ring_plans_compute_the_collectives() {
        for coll in [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter] {
            for n in [2, 3, 4, 8] {
                for count in [1, 2, 7, 64, 1000, 3 * SLICE / 4 + 5] {
                    let count = coll.counts(count * 4, n).0;
                    for chans in [1, 2, 3] {
                        simulate(coll, count, n, chans, |r, ch| plan(coll, count, n, r, ch, chans));
                    }
                }
            }
        }
    }

    #[test]
    fn the_simulation_catches_wrong_plans() {
        let (count, n) = (3000, 4);
        type Spoil = fn(&mut Plan);
        let broken: [(&str, Spoil); 3] = [
            ("all-gather steps that reduce", |p| p.recvs.iter_mut().for_each(|r| r.1 = true)),
            ("a send that does not wait", |p| p.sends.iter_mut().for_each(|s| s.1 = None)),
            ("a slice one element short", |p| p.recvs[0].0.len -= 1),
        ];
        for (what, spoil) in broken {
            let r = std::panic::catch_unwind(|| {
                simulate(Coll::AllReduce, count, n, 1, |r, ch| {
                    let mut p = plan(Coll::AllReduce, count, n, r, ch, 1);
                    spoil(&mut p);
                    p
                })
            });
            assert!(r.is_err(), "{what} passed the simulation");
        }
        assert_eq!(owner(10, 4, 0), 0);
        assert_eq!(owner(10, 4, 9), 3);
        assert_eq!(
            (0..10).map(|i| owner(10, 4, i)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
        );
    }
}
