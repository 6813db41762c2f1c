//! The one error type of ferroce.
//!
//! Each variant says who is at fault, which decides the `ncclResult_t` NCCL sees (the mapping
//! lives in `ffi::boundary`, the only place that knows NCCL's codes):
//! - [`Error::Verbs`] and [`Error::Os`]: the OS or the RDMA stack (`ncclSystemError`);
//! - [`Error::Internal`]: misuse by the caller, e.g. a NULL pointer (`ncclInternalError`);
//! - [`Error::InvalidArgument`]: an argument the device cannot take, e.g. a memory type that
//!   `ptrSupport` does not list (`ncclInvalidArgument`);
//! - [`Error::Config`] and [`Error::NoDevice`]: the user's configuration (`ncclInvalidUsage`);
//! - [`Error::Remote`]: the peer or a failed completion (`ncclRemoteError`).

use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
pub enum Error {
    /// A verb failed: its name, the errno it gave, and what it was acting on.
    Verbs { verb: &'static str, errno: i32, context: String },
    /// An OS call outside verbs failed.
    Os { call: &'static str, err: std::io::Error, context: String },
    /// A knob holds a value ferroce cannot use.
    Config { knob: &'static str, value: String, reason: String },
    /// No usable RDMA device; the text says why, so NCCL's fallback is explained.
    NoDevice(String),
    /// The caller broke the ABI contract (NULL pointer, bad index, call before init, ...).
    Internal(String),
    /// The peer misbehaved or a transfer failed; the text carries an actionable hint.
    Remote(String),
    /// An argument this device cannot take (a memory type `ptrSupport` does not list).
    InvalidArgument(String),
}

impl Error {
    pub fn verbs(verb: &'static str, errno: i32, context: &str) -> Self {
        Error::Verbs { verb, errno, context: context.to_string() }
    }

    pub fn config(knob: &'static str, value: &str, reason: impl Into<String>) -> Self {
        Error::Config { knob, value: value.to_string(), reason: reason.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Verbs { verb, errno, context } => write!(
                f,
                "{verb} failed on {context}: {} (errno {errno})",
                std::io::Error::from_raw_os_error(*errno)
            ),
            Error::Os { call, err, context } => write!(f, "{call} failed on {context}: {err}"),
            Error::Config { knob, value, reason } => {
                write!(f, "invalid {knob}={value:?}: {reason}")
            }
            Error::NoDevice(why) => write!(f, "no usable RDMA device: {why}"),
            Error::Internal(what) => write!(f, "internal error: {what}"),
            Error::Remote(what) => write!(f, "{what}"),
            Error::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
        }
    }
}

impl std::error::Error for Error {}
