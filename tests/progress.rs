//! Progress never waits on the other side's next call, on real verbs (Soft-RoCE in the VM):
//! once `irecv` has returned a request, the sender can match it with no further call on the
//! receiving comm. Each test has a deadline and fails, naming the call that waited, where a
//! row waits for the receiver's next call (the program of the first test hung for ever in
//! `isend` before every row went out at its `irecv`). `#[ignore]`d on the host; `ci/vm-tests.sh`
//! runs them in the VM.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use ferroce_tools::driver::{Close, Driver, Ptr};

/// Messages each rank posts, then sends.
const N: usize = 32;
const SIZE: usize = 4096;

/// How long one call may be retried before the test says what it waited for.
const DEADLINE: Duration = Duration::from_secs(20);

fn byte(k: usize, i: usize, from: u8) -> u8 {
    (i as u8).wrapping_mul(31) ^ k as u8 ^ from
}

/// Calls `f` until it returns `Some`, at most [`DEADLINE`]; `what` names the wait.
fn spin<T>(what: &str, mut f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    let t = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if t.elapsed() > DEADLINE {
            return Err(format!("{what}: nothing after {DEADLINE:?}"));
        }
    }
}

/// One rank's end of one direction: `n` buffers of [`SIZE`] registered on `comm`.
struct Bufs {
    data: Vec<Vec<u8>>,
    mhs: Vec<Ptr>,
}

impl Bufs {
    fn new(drv: &Driver, comm: Ptr, n: usize, fill: impl Fn(usize, usize) -> u8) -> Bufs {
        let mut data: Vec<Vec<u8>> =
            (0..n).map(|k| (0..SIZE).map(|i| fill(k, i)).collect()).collect();
        let mhs =
            data.iter_mut().map(|d| drv.reg_mr(comm, d.as_mut_ptr(), SIZE).unwrap()).collect();
        Bufs { data, mhs }
    }

    fn free(self, drv: &Driver, comm: Ptr) {
        for mh in self.mhs {
            drv.dereg_mr(comm, mh).unwrap();
        }
    }
}

/// Deregisters both ends' buffers and closes the pair `send` → `recv`.
fn close_pair(
    drv: &Driver,
    (send, sb): (Ptr, Bufs),
    (recv, rb): (Ptr, Bufs),
) -> Result<(), String> {
    sb.free(drv, send);
    rb.free(drv, recv);
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)
}

/// Posts receives `0..n` of `bufs` on `recv`, each `irecv` retried until it returns a request.
fn post(drv: &Driver, recv: Ptr, bufs: &mut Bufs, n: usize) -> Result<Vec<Ptr>, String> {
    (0..n)
        .map(|k| {
            let p = bufs.data[k].as_mut_ptr();
            spin(&format!("irecv {k}"), || {
                drv.irecv(recv, &[p], &[SIZE], &[0], &[bufs.mhs[k]], false)
            })
        })
        .collect()
}

/// Sends `0..n` of `bufs` on `send`, each `isend` retried until it returns a request, with no
/// call on any receiving comm in between.
fn send_all(drv: &Driver, send: Ptr, bufs: &mut Bufs, n: usize) -> Result<Vec<Ptr>, String> {
    (0..n)
        .map(|k| {
            let p = bufs.data[k].as_mut_ptr();
            let what = format!(
                "isend {k} of {n} (the receiver posted all {n} receives and makes no call until \
                 every isend returned): its row never reached the sender"
            );
            spin(&what, || drv.isend(send, p, SIZE, 0, bufs.mhs[k]))
        })
        .collect()
}

/// Tests every request until done.
fn finish(drv: &Driver, reqs: &[Ptr]) -> Result<(), String> {
    for (k, &r) in reqs.iter().enumerate() {
        let sizes = spin(&format!("test of request {k}"), || drv.test(r))?;
        if sizes[0] != 0 && sizes[0] as usize != SIZE {
            return Err(format!("request {k}: {} bytes", sizes[0]));
        }
    }
    Ok(())
}

/// The program of plugin test suites, as two ranks in one thread, over two new pairs of comms
/// on `ctx`: each rank posts [`N`] receives, then rank A sends its [`N`] messages to B, then B
/// to A, each `isend` retried until it returns a request before the next; only then are all
/// requests tested. Every byte is checked (`t` seeds the data).
fn program(drv: &Driver, ctx: Ptr, t: u8) -> Result<(), String> {
    let (send_ab, recv_ab) = pair(drv, ctx, 1, 0)?;
    let (send_ba, recv_ba) = pair(drv, ctx, 0, 1)?;
    let mut rb = Bufs::new(drv, recv_ab, N, |_, _| 0);
    let mut ra = Bufs::new(drv, recv_ba, N, |_, _| 0);
    let mut sa = Bufs::new(drv, send_ab, N, |k, i| byte(k, i, t));
    let mut sb = Bufs::new(drv, send_ba, N, |k, i| byte(k, i, !t));
    let mut reqs = post(drv, recv_ba, &mut ra, N)?;
    reqs.extend(post(drv, recv_ab, &mut rb, N)?);
    reqs.extend(send_all(drv, send_ab, &mut sa, N)?);
    reqs.extend(send_all(drv, send_ba, &mut sb, N)?);
    finish(drv, &reqs)?;
    if (0..N).any(|k| rb.data[k] != sa.data[k] || ra.data[k] != sb.data[k]) {
        return Err("data corrupted".into());
    }
    close_pair(drv, (send_ab, sa), (recv_ab, rb))?;
    close_pair(drv, (send_ba, sb), (recv_ba, ra))
}

/// [`program`] with `lanes` QPs per connection in `split` mode, in a context of its own.
fn post_then_send(lanes: &str, split: &str) -> Result<(), String> {
    let knobs = [("NCCL_IB_QPS_PER_CONNECTION", lanes), ("NCCL_IB_SPLIT_DATA_ON_QPS", split)];
    set_env(&knobs.map(|(k, v)| (k, Some(v))));
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let r = program(&drv, ctx, 0xa);
    drv.finalize(ctx)?;
    set_env(&knobs.map(|(k, _)| (k, None)));
    r
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn two_ranks_that_post_then_send_do_not_deadlock() {
    let _g = vm_serial();
    for (lanes, split) in [("1", "0"), ("2", "0"), ("2", "1"), ("4", "0"), ("4", "1")] {
        post_then_send(lanes, split)
            .unwrap_or_else(|e| panic!("{lanes} QP(s), split {split}: {e}"));
        eprintln!("{lanes} QP(s), split {split}: {} messages each way, verified", N);
    }
}

/// The same program in 4 threads at once, each with its own two pairs of comms (2 QPs, split),
/// over one context, as NCCL's proxy threads share one.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn four_threads_each_with_its_own_pairs_post_then_send() {
    let _g = vm_serial();
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", Some("2")), ("NCCL_IB_SPLIT_DATA_ON_QPS", Some("1"))]);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(1).unwrap();
    let shared = Shared((&drv, ctx));
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                s.spawn(move || {
                    let (drv, ctx) = shared.get();
                    program(drv, ctx, t)
                })
            })
            .collect();
        threads.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
    });
    drv.finalize(ctx).unwrap();
    set_env(&[("NCCL_IB_QPS_PER_CONNECTION", None), ("NCCL_IB_SPLIT_DATA_ON_QPS", None)]);
    for (t, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("thread {t}: {e}"));
    }
}

/// A receiving thread posts [`N`] receives and then sleeps until the sending thread says it is
/// done (at most 60 s): the sender, spinning on `isend`, gets every request while the receiver
/// makes no call at all; then both test their requests.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_sender_spinning_while_the_receiver_sleeps_gets_every_row() {
    in_vm(1, &[], |drv, ctx| {
        let (send, recv) = pair(drv, ctx, 1, 0).unwrap();
        let mut rbufs = Bufs::new(drv, recv, N, |_, _| 0);
        let mut sbufs = Bufs::new(drv, send, N, |k, i| byte(k, i, 7));
        let rreqs = post(drv, recv, &mut rbufs, N).unwrap();
        let done = AtomicBool::new(false);
        // The plugin's handles are raw pointers: they cross to the sending thread as addresses.
        let send_addr = send as usize;
        let bufs: Vec<(usize, usize)> =
            (0..N).map(|k| (sbufs.data[k].as_mut_ptr() as usize, sbufs.mhs[k] as usize)).collect();
        let sent: Result<Vec<usize>, String> = std::thread::scope(|s| {
            let sender = s.spawn(|| {
                let lib = open_plugin();
                let drv = Driver::new(&lib, 12)?;
                let r: Result<Vec<usize>, String> = (bufs.iter().enumerate())
                    .map(|(k, &(p, mh))| {
                        let what = format!("isend {k} while the receiver sleeps");
                        let isend =
                            || drv.isend(send_addr as Ptr, p as *mut u8, SIZE, 0, mh as Ptr);
                        spin(&what, isend).map(|r| r as usize)
                    })
                    .collect();
                done.store(true, Ordering::Release);
                r
            });
            // The receiving "rank" sleeps: no call on its comm until the sender is done.
            let t = Instant::now();
            while !done.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(10));
            }
            sender.join().unwrap_or_else(|_| Err("the sending thread panicked".into()))
        });
        let sreqs: Vec<Ptr> = sent.unwrap().into_iter().map(|p| p as Ptr).collect();
        finish(drv, &sreqs).unwrap();
        finish(drv, &rreqs).unwrap();
        assert!((0..N).all(|k| rbufs.data[k] == sbufs.data[k]), "data corrupted");
        close_pair(drv, (send, sbufs), (recv, rbufs)).unwrap();
    });
}

/// The latency pattern, one message at a time: post one receive, then spin on `isend` with no
/// call on the receiving comm until it returns a request, then test both. 200 messages, in
/// both split modes of 2 QPs.
#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn one_message_at_a_time_needs_no_call_on_the_receiver_to_match() {
    let _g = vm_serial();
    for split in ["0", "1"] {
        set_env(&[("NCCL_IB_SPLIT_DATA_ON_QPS", Some(split))]);
        let lib = open_plugin();
        let drv = Driver::new(&lib, 12).unwrap();
        let ctx = drv.init(1).unwrap();
        let (send, recv) = pair(&drv, ctx, 1, 0).unwrap();
        let mut rbufs = Bufs::new(&drv, recv, 1, |_, _| 0);
        let mut sbufs = Bufs::new(&drv, send, 1, |_, _| 0);
        for k in 0..200 {
            sbufs.data[0].iter_mut().enumerate().for_each(|(i, b)| *b = byte(k, i, 3));
            let r = post(&drv, recv, &mut rbufs, 1).unwrap();
            let s = send_all(&drv, send, &mut sbufs, 1)
                .unwrap_or_else(|e| panic!("split {split}, message {k}: {e}"));
            finish(&drv, &s).unwrap();
            finish(&drv, &r).unwrap();
            assert!(rbufs.data[0] == sbufs.data[0], "split {split}, message {k}: data");
        }
        close_pair(&drv, (send, sbufs), (recv, rbufs)).unwrap();
        drv.finalize(ctx).unwrap();
        set_env(&[("NCCL_IB_SPLIT_DATA_ON_QPS", None)]);
        eprintln!("split {split}: 200 messages one at a time, each matched with no receiver call");
    }
}
