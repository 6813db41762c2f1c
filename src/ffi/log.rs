//! The `log` facade, routed to NCCL's logger.
//!
//! NCCL's logger is printf-style and C-variadic. ferroce always passes the fixed format `"%s"`
//! and one NUL-terminated message, so no device name or user text is ever read as a format
//! (a wrong argument there crashes NCCL). Records go to the NET subsystem; records logged with
//! `target: "init"` also go to INIT, which NCCL shows by default with `NCCL_DEBUG=INFO`.
//!
//! Before NCCL hands over its logger (tools, tests), warnings go to stderr, INFO too when
//! `NCCL_DEBUG` is `INFO` or `TRACE`, and `debug`/`trace` records (NCCL's TRACE) when it is
//! `TRACE`.

use std::ffi::{CString, c_char, c_int};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::abi::{NCCL_INIT, NCCL_NET, ncclDebugLogLevel, ncclDebugLogger_t};

/// NCCL's logger as an address; 0 when none was given.
static NCCL_LOGGER: AtomicUsize = AtomicUsize::new(0);

struct NcclLog;
static LOGGER: NcclLog = NcclLog;

/// Installs the facade (idempotent) and records NCCL's logger if one is given.
pub fn install(logger: ncclDebugLogger_t) {
    if let Some(f) = logger {
        NCCL_LOGGER.store(f as usize, Ordering::Release);
    }
    if ::log::set_logger(&LOGGER).is_ok() {
        ::log::set_max_level(::log::LevelFilter::Debug);
    }
}

/// Whether a line of `level` goes to stderr when NCCL gave no logger: WARN always, INFO and
/// TRACE as `NCCL_DEBUG` asks.
fn stderr_shows(level: ncclDebugLogLevel) -> bool {
    let debug = std::env::var("NCCL_DEBUG").unwrap_or_default();
    match level {
        ncclDebugLogLevel::NCCL_LOG_WARN => true,
        ncclDebugLogLevel::NCCL_LOG_INFO => crate::config::shows_info(&debug),
        _ => debug.trim().eq_ignore_ascii_case("TRACE"),
    }
}

/// The message exactly as it is handed to NCCL: prefixed, and with no interior NUL.
pub fn c_message(text: &str) -> CString {
    const PREFIX: &[u8] = b"NET/ferroce: ";
    let mut bytes = Vec::with_capacity(PREFIX.len() + text.len() + 1);
    bytes.extend_from_slice(PREFIX);
    // A NUL is a byte of its own in UTF-8 (never part of another character), so dropping NUL
    // bytes leaves valid text; the common line has none and is copied whole.
    if text.as_bytes().contains(&0) {
        bytes.extend(text.bytes().filter(|&b| b != 0));
    } else {
        bytes.extend_from_slice(text.as_bytes());
    }
    CString::new(bytes).unwrap_or_default()
}

impl ::log::Log for NcclLog {
    fn enabled(&self, _: &::log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &::log::Record) {
        use ::log::Level;
        let level = match record.level() {
            Level::Error | Level::Warn => ncclDebugLogLevel::NCCL_LOG_WARN,
            Level::Info => ncclDebugLogLevel::NCCL_LOG_INFO,
            Level::Debug | Level::Trace => ncclDebugLogLevel::NCCL_LOG_TRACE,
        };
        let flags = if record.target() == "init" { NCCL_INIT | NCCL_NET } else { NCCL_NET };
        let flags = std::ffi::c_ulong::from(flags);
        let msg = c_message(&record.args().to_string());
        let addr = NCCL_LOGGER.load(Ordering::Acquire);
        if addr == 0 {
            if stderr_shows(level) {
                eprintln!("{}", msg.to_string_lossy());
            }
            return;
        }
        type Logger = unsafe extern "C" fn(
            ncclDebugLogLevel,
            std::ffi::c_ulong,
            *const c_char,
            c_int,
            *const c_char,
            ...
        );
        // SAFETY: addr was stored from a non-NULL ncclDebugLogger_t of exactly this type.
        let f: Logger = unsafe { std::mem::transmute::<usize, Logger>(addr) };
        let line = record.line().map_or(0, |l| c_int::try_from(l).unwrap_or(0));
        // SAFETY: NCCL's logger takes a printf format; "%s" consumes exactly the one
        // NUL-terminated string we pass, and all pointers outlive the call.
        unsafe { f(level, flags, c"ferroce".as_ptr(), line, c"%s".as_ptr(), msg.as_ptr()) };
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_prefixed_and_nul_free() {
        assert_eq!(c_message("a\0b %s %n").to_str().unwrap(), "NET/ferroce: ab %s %n");
        assert_eq!(c_message("\0é\0→").to_str().unwrap(), "NET/ferroce: é→");
        assert_eq!(c_message("rxe0: 1 ok").to_str().unwrap(), "NET/ferroce: rxe0: 1 ok");
    }
}
