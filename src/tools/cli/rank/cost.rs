//! A rank's side of `ferroce instructions`: every plugin call whose cost is counted goes
//! through one of the [`counted`] wrappers below, and the orchestrator runs the ranks under
//! callgrind with collection switched on only inside them (`--toggle-collect`), so each
//! wrapper's inclusive count is what the plugin spent in those calls, whatever the plugin.
//!
//! The commands keep the two ranks in lockstep through the orchestrator, so a `test` is called
//! when its request has most likely completed; each reply counts the calls that found nothing
//! (an `isend` with no receive posted, a `test` not yet done), which the orchestrator prices at
//! the idle cost it measures separately.
//!
//! - `C-POST size` (receiver): one counted `irecv`; replies `POSTED`. With a last word `warm`,
//!   this and the next two commands are a warm-up message, not counted.
//! - `C-SEND size` (sender): counted `isend` until it gives a request, then counted `test`
//!   until done; replies `SENT empty`.
//! - `C-DONE size` (receiver): counted `test` until done; replies `DONE empty`.
//! - `C-IDLE n`: the sender calls `isend` `n` times with nothing posted, the receiver posts a
//!   receive and calls `test` `n` times before anything is sent; both must find nothing.
//!   `C-FINISH` then completes that receive with an uncounted message. Both reply `IDLE`.
//! - `C-LISTEN` then `C-CONNECT hex`: one counted `listen`, then counted `connect` and
//!   `accept` until both comms exist, then counted closes; replies `CHANDLE hex` and
//!   `CONNECTED calls`.
//! - `C-LISTEN` then `C-KEEP hex` (`ferroce connections`): `connect` and `accept` until both
//!   comms exist, uncounted and timed, and both kept open; replies `KEPT microseconds`.
//!   `C-CLOSEALL` closes every kept pair and replies `CLOSED n`.

use std::time::{Duration, Instant};

use ferroce_tools::driver::{Close, Ptr};
use ferroce_tools::handle::{from_hex, to_hex};

use super::serve::Rank;
use super::{STEP, num};

/// The wrappers callgrind counts inside. Each is its own function, never inlined, so its name
/// (`ferroce::rank::cost::counted::NAME`) is in the profile; the closure it runs is. Each keeps
/// its own number, so no two have the same code (the compiler merges identical functions, and
/// callgrind would then see one name for both).
pub mod counted {
    macro_rules! wrappers {
        ($($name:ident = $n:literal),*) => {$(
            #[inline(never)]
            pub fn $name<R>(f: impl FnOnce() -> R) -> R {
                std::hint::black_box($n);
                std::hint::black_box(f())
            }
        )*};
    }
    wrappers!(
        post_8 = 1,
        post_4k = 2,
        post_1m = 3,
        test_8 = 4,
        test_4k = 5,
        test_1m = 6,
        idle_isend = 7,
        idle_test = 8,
        listen = 9,
        connect = 10,
        accept = 11,
        close = 12
    );
}

/// Runs `f` in the size's post wrapper (`test`: its test wrapper), or uncounted for a warm-up
/// message (`size` 0 stands for none).
fn counted_as<R>(size: usize, test: bool, f: impl FnOnce() -> R) -> Result<R, String> {
    use counted::*;
    Ok(match (size, test) {
        (0, _) => f(),
        (8, false) => post_8(f),
        (4096, false) => post_4k(f),
        (1048576, false) => post_1m(f),
        (8, true) => test_8(f),
        (4096, true) => test_4k(f),
        (1048576, true) => test_1m(f),
        (s, _) => return Err(format!("no counted size {s}")),
    })
}

fn post<R>(size: usize, f: impl FnOnce() -> R) -> Result<R, String> {
    counted_as(size, false, f)
}

fn test<R>(size: usize, f: impl FnOnce() -> R) -> Result<R, String> {
    counted_as(size, true, f)
}

/// A pause long enough for the wire, before each `test` of either rank: 2 ms, and 1 ms more per
/// 16 KiB (Soft-RoCE under emulation moves about 25 MB/s, less under callgrind). A `test` that
/// finds its send still on the wire is priced at the cost of an empty receive `test`, which a
/// send `test` with a large message in flight (its stall check and placement) exceeds: few of
/// them keep the count of a large message steady from run to run.
fn pause(size: usize) {
    std::thread::sleep(Duration::from_millis(2 + (size >> 14) as u64));
}

/// Calls `step` (after a pause) until it yields, for at most [`STEP`]: the value and how many
/// calls found nothing.
fn until_some<T>(
    what: &str,
    size: usize,
    mut step: impl FnMut() -> Result<Option<T>, String>,
) -> Result<(T, u64), String> {
    let end = Instant::now() + STEP;
    let mut empty = 0;
    loop {
        pause(size);
        if let Some(v) = step()? {
            return Ok((v, empty));
        }
        empty += 1;
        if Instant::now() > end {
            return Err(format!("{what}: nothing within {STEP:?}"));
        }
    }
}

impl Rank<'_> {
    /// One `C-...` command; the reply.
    pub(super) fn cost(
        &self,
        cmd: &str,
        w: &mut std::str::SplitWhitespace,
        sender: bool,
    ) -> Result<String, String> {
        // `size [warm]`: the message's size, and the wrapper's (0: a warm-up, uncounted).
        let size = |w: &mut std::str::SplitWhitespace| {
            let s = num::<usize>("size", w.next())?;
            Ok::<_, String>((s, if w.next() == Some("warm") { 0 } else { s }))
        };
        match (cmd, sender) {
            ("C-POST", false) => {
                let (s, c) = size(w)?;
                let req = post(c, || self.irecv(s, false))??;
                *self.pending.borrow_mut() = Some(req.ok_or("irecv gave no request")?);
                Ok("POSTED".into())
            }
            ("C-SEND", true) => {
                let (s, c) = size(w)?;
                let (req, e1) = until_some("isend", 0, || post(c, || self.isend(s))?)?;
                let (_, e2) = until_some("send test", s, || test(c, || self.drv.test(req))?)?;
                Ok(format!("SENT {}", e1 + e2))
            }
            ("C-DONE", false) => {
                let (s, c) = size(w)?;
                let req = self.pending.borrow_mut().take().ok_or("C-DONE before C-POST")?;
                let (got, e) = until_some("recv test", s, || test(c, || self.drv.test(req))?)?;
                Self::check(s, got)?;
                Ok(format!("DONE {e}"))
            }
            ("C-IDLE", true) => {
                let n: usize = num("n", w.next())?;
                for _ in 0..n {
                    if counted::idle_isend(|| self.isend(8))?.is_some() {
                        return Err("isend found a receive posted during C-IDLE".into());
                    }
                }
                Ok("IDLE".into())
            }
            ("C-IDLE", false) => {
                let n: usize = num("n", w.next())?;
                let req = self.irecv(8, false)?.ok_or("irecv gave no request")?;
                for _ in 0..n {
                    if counted::idle_test(|| self.drv.test(req))?.is_some() {
                        return Err("a receive completed with nothing sent".into());
                    }
                }
                *self.pending.borrow_mut() = Some(req);
                Ok("IDLE".into())
            }
            ("C-FINISH", true) => {
                let (req, _) = until_some("isend", 0, || self.isend(8))?;
                until_some("send test", 8, || self.drv.test(req))?;
                Ok("IDLE".into())
            }
            ("C-FINISH", false) => {
                let req = self.pending.borrow_mut().take().ok_or("C-FINISH before C-IDLE")?;
                until_some("recv test", 8, || self.drv.test(req))?;
                Ok("IDLE".into())
            }
            ("C-LISTEN", _) => {
                let (handle, listen) = counted::listen(|| self.drv.listen(self.ctx, self.dev))?;
                *self.pending.borrow_mut() = Some(listen);
                Ok(format!("CHANDLE {}", to_hex(&handle)))
            }
            ("C-KEEP", _) => {
                let mut peer = from_hex(w.next().ok_or("C-KEEP without a handle")?)?;
                let listen = self.pending.borrow_mut().take().ok_or("C-KEEP before C-LISTEN")?;
                let t = Instant::now();
                let (send, recv) =
                    self.drv.connect_both(self.ctx, self.dev, &mut peer, listen, STEP)?;
                let us = t.elapsed().as_micros();
                self.kept.borrow_mut().push((send, recv));
                self.drv.close(Close::Listen, listen)?;
                Ok(format!("KEPT {us}"))
            }
            ("C-CLOSEALL", _) => {
                let n = self.kept.borrow().len();
                self.close_kept()?;
                Ok(format!("CLOSED {n}"))
            }
            ("C-CONNECT", _) => {
                let mut peer = from_hex(w.next().ok_or("C-CONNECT without a handle")?)?;
                let listen = self.pending.borrow_mut().take().ok_or("C-CONNECT before C-LISTEN")?;
                let calls = self.connect_counted(&mut peer, listen)?;
                Ok(format!("CONNECTED {calls}"))
            }
            _ => Err(format!("{cmd} is not for the {} rank", if sender { "send" } else { "recv" })),
        }
    }

    /// Closes the comm pairs `C-KEEP` kept, all of them whatever fails: the first error.
    pub(super) fn close_kept(&self) -> Result<(), String> {
        let mut first = Ok(());
        for (send, recv) in self.kept.borrow_mut().drain(..) {
            for r in [self.drv.close(Close::Send, send), self.drv.close(Close::Recv, recv)] {
                first = first.and(r);
            }
        }
        first
    }

    /// Counted `connect` and `accept` until both comms exist, then counted closes of the two
    /// comms and the listener: how many connect and accept calls it took.
    fn connect_counted(&self, peer: &mut [u8; 128], listen: Ptr) -> Result<u64, String> {
        let (mut send, mut recv, mut calls) = (None, None, 0);
        let end = Instant::now() + STEP;
        let (send, recv) = loop {
            if send.is_none() {
                send = counted::connect(|| self.drv.connect(self.ctx, self.dev, peer))?;
                calls += 1;
            }
            if recv.is_none() {
                recv = counted::accept(|| self.drv.accept(listen))?;
                calls += 1;
            }
            if let (Some(s), Some(r)) = (send, recv) {
                break (s, r);
            }
            if Instant::now() > end {
                return Err(format!("connect and accept: not done within {STEP:?}"));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        counted::close(|| self.drv.close(Close::Send, send))?;
        counted::close(|| self.drv.close(Close::Recv, recv))?;
        counted::close(|| self.drv.close(Close::Listen, listen))?;
        Ok(calls)
    }
}
