//! The one error type of ferroce.
//!
//! Each variant says who is at fault, which decides the `ncclResult_t` NCCL sees (the mapping
//! lives in `ffi::boundary`, the only place that knows NCCL's codes):
//! - [`Error::Verbs`] and [`Error::Os`]: the OS or the RDMA stack (`ncclSystemError`);
//! - [`Error::Local`]: our own side failed outside a call, e.g. a fatal device or a completion
//!   error the local NIC caused (`ncclSystemError`);
//! - [`Error::Internal`]: misuse by the caller, e.g. a NULL pointer (`ncclInternalError`);
//! - [`Error::InvalidArgument`]: an argument the device cannot take, e.g. a memory type that
//!   `ptrSupport` does not list (`ncclInvalidArgument`);
//! - [`Error::Config`] and [`Error::NoDevice`]: the user's configuration (`ncclInvalidUsage`);
//! - [`Error::Remote`]: only what the peer or the network caused: a peer that misbehaved or
//!   died, retries exhausted on the path (`ncclRemoteError`).

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
    /// The local device or NIC failed (not a call's errno): a fatal device, a local protection
    /// or length error, an async QP or CQ error; the text names the device and what to check.
    Local(String),
    /// The peer or the network failed; the text carries an actionable hint.
    Remote(String),
    /// An argument this device cannot take (a memory type `ptrSupport` does not list).
    InvalidArgument(String),
    /// A call NCCL's own transport answers with `ncclInvalidUsage` (a device index out of
    /// range).
    InvalidUsage(String),
}

impl Error {
    pub fn verbs(verb: &'static str, errno: i32, context: &str) -> Self {
        Error::Verbs { verb, errno, context: context.to_string() }
    }

    pub fn config(knob: &'static str, value: &str, reason: impl Into<String>) -> Self {
        Error::Config { knob, value: value.to_string(), reason: reason.into() }
    }

    /// The same error with `what` in front of its context, keeping its variant: a local
    /// failure met while serving a peer stays local (its `ncclResult_t` does not change).
    pub fn context(self, what: impl fmt::Display) -> Self {
        match self {
            Error::Verbs { verb, errno, context } => {
                Error::Verbs { verb, errno, context: format!("{what}: {context}") }
            }
            Error::Os { call, err, context } => {
                Error::Os { call, err, context: format!("{what}: {context}") }
            }
            Error::Config { .. } => self,
            Error::NoDevice(why) => Error::NoDevice(format!("{what}: {why}")),
            Error::Internal(why) => Error::Internal(format!("{what}: {why}")),
            Error::Local(why) => Error::Local(format!("{what}: {why}")),
            Error::Remote(why) => Error::Remote(format!("{what}: {why}")),
            Error::InvalidArgument(why) => Error::InvalidArgument(format!("{what}: {why}")),
            Error::InvalidUsage(why) => Error::InvalidUsage(format!("{what}: {why}")),
        }
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
            Error::Local(what) | Error::Remote(what) => write!(f, "{what}"),
            Error::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
            Error::InvalidUsage(what) => write!(f, "invalid usage: {what}"),
        }
    }
}

impl std::error::Error for Error {}
