//! Connection set-up between ranks, as NCCL does it: the receiving rank listens and hands its
//! 128-byte handle to the sender out of band; the sender connects to it while the receiver
//! accepts, each calling again until its comm exists. Used by `ferroce perf` and `collective`
//! and by every test that connects comms, in one process or two.
//!
//! Between processes the handle travels as one line, `HANDLE <256 hex digits>` (a rank may add
//! words after it), on the receiver's stdout or a socket: [`handle_line`] writes it and
//! [`handle_in`] reads it back.

use std::ffi::c_int;
use std::io::Write;
use std::time::Duration;

use crate::driver::{Close, Driver, Ptr};
use crate::handle::{LEN, from_hex, to_hex};
use crate::wait::until;

/// `HANDLE <hex>`: how a listening rank announces its handle.
pub fn handle_line(h: &[u8; LEN]) -> String {
    format!("HANDLE {}", to_hex(h))
}

/// The handle in a line that starts `HANDLE <hex>` (words after it are the caller's).
pub fn handle_in(line: &str) -> Result<[u8; LEN], String> {
    let mut w = line.split_whitespace();
    match (w.next(), w.next()) {
        (Some("HANDLE"), Some(hex)) => from_hex(hex),
        _ => Err(format!("expected HANDLE <hex>, got {line:?}")),
    }
}

/// Writes `line` to stdout at once: a rank's answer, which its orchestrator waits for.
pub fn say(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|_| out.flush()).map_err(|e| format!("stdout: {e}"))
}

/// The sending end: a send comm on `dev` to the listener of `handle`, within `limit`.
pub fn connect_to(
    drv: &Driver,
    ctx: Ptr,
    dev: c_int,
    handle: &mut [u8; LEN],
    limit: Duration,
) -> Result<Ptr, String> {
    until("connect", limit, || drv.connect(ctx, dev, handle))
}

/// The receiving end: listens on `dev`, hands the handle to `announce`, and accepts one
/// receive comm within `limit`; the listener is closed after.
pub fn accept_one(
    drv: &Driver,
    ctx: Ptr,
    dev: c_int,
    limit: Duration,
    announce: impl FnOnce(&[u8; LEN]) -> Result<(), String>,
) -> Result<Ptr, String> {
    let (h, listen) = drv.listen(ctx, dev)?;
    announce(&h)?;
    let comm = until("accept", limit, || drv.accept(listen))?;
    drv.close(Close::Listen, listen)?;
    Ok(comm)
}

/// One end of a two-process test: the receiver (no `peer`) listens on `dev` and says its
/// [`handle_line`] on stdout; the sender connects to the `peer` handle, in hex. The comm.
pub fn one_comm(
    drv: &Driver,
    ctx: Ptr,
    dev: c_int,
    peer: Option<&str>,
    limit: Duration,
) -> Result<Ptr, String> {
    match peer {
        Some(hex) => connect_to(drv, ctx, dev, &mut from_hex(hex)?, limit),
        None => accept_one(drv, ctx, dev, limit, |h| say(&handle_line(h))),
    }
}

/// A send comm on `sdev` connected to a receive comm on `rdev`, both driven from this thread
/// (connect and accept never block): `(send, recv)`.
pub fn pair(
    drv: &Driver,
    ctx: Ptr,
    rdev: c_int,
    sdev: c_int,
    limit: Duration,
) -> Result<(Ptr, Ptr), String> {
    let (mut handle, listen) = drv.listen(ctx, rdev)?;
    let comms = drv.connect_both(ctx, sdev, &mut handle, listen, limit)?;
    drv.close(Close::Listen, listen)?;
    Ok(comms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_lines_round_trip_with_words_after() {
        let h: [u8; LEN] = std::array::from_fn(|i| i as u8);
        assert_eq!(handle_in(&handle_line(&h)), Ok(h));
        assert_eq!(handle_in(&format!("{} rxe0 1", handle_line(&h))), Ok(h));
        assert!(handle_in("READY").is_err());
        assert!(handle_in("HANDLE").is_err());
        assert!(handle_in("HANDLE 00").is_err());
    }
}
