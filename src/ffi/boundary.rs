//! The one funnel every exported function runs through.
//!
//! The sequence, for every entry point: the caller first sets NCCL's "not ready" outputs
//! (`*comm = NULL`, `*request = NULL`); the body runs inside [`guard`]; outputs are written only
//! by a body that succeeds; a failure is logged once at WARN, naming the call, and mapped to an
//! `ncclResult_t` by [`code`]. A panic never unwinds into C: it becomes `ncclInternalError`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::abi::ncclResult_t;
use crate::error::Error;

/// The one mapping from ferroce errors to NCCL result codes.
pub fn code(e: &Error) -> ncclResult_t {
    match e {
        Error::Verbs { .. } | Error::Os { .. } | Error::Local(_) => ncclResult_t::ncclSystemError,
        Error::Internal(_) => ncclResult_t::ncclInternalError,
        Error::InvalidArgument(_) => ncclResult_t::ncclInvalidArgument,
        Error::Config { .. } | Error::NoDevice(_) | Error::InvalidUsage(_) => {
            ncclResult_t::ncclInvalidUsage
        }
        Error::Remote(_) => ncclResult_t::ncclRemoteError,
    }
}

/// Runs `body` for the exported function `call`, catching panics and logging failures.
pub fn guard(call: &'static str, body: impl FnOnce() -> Result<(), Error>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) => {
            log::warn!("{call}: {e}");
            code(&e)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            log::warn!("{call}: internal error (panic: {what}); returning ncclInternalError");
            ncclResult_t::ncclInternalError
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_success() {
        assert_eq!(guard("t", || Ok(())), ncclResult_t::ncclSuccess);
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let r = guard("t", || panic!("boom"));
        assert_eq!(r, ncclResult_t::ncclInternalError);
        let r = guard("t", || {
            let v: Vec<u8> = Vec::new();
            let _ = v[usize::MAX >> 1]; // an index panic, as a bug would raise
            Ok(())
        });
        assert_eq!(r, ncclResult_t::ncclInternalError);
    }

    #[test]
    fn a_panic_through_an_extern_c_fn_is_caught() {
        // The same shape as every export: an extern "C" fn whose body is the guard.
        extern "C" fn exported() -> ncclResult_t {
            guard("exported", || panic!("inside an export"))
        }
        assert_eq!(exported(), ncclResult_t::ncclInternalError);
    }

    #[test]
    fn errors_map_by_fault() {
        assert_eq!(code(&Error::verbs("ibv_x", 5, "d")), ncclResult_t::ncclSystemError);
        assert_eq!(code(&Error::Internal("x".into())), ncclResult_t::ncclInternalError);
        assert_eq!(code(&Error::InvalidArgument("x".into())), ncclResult_t::ncclInvalidArgument);
        assert_eq!(code(&Error::config("K", "v", "r")), ncclResult_t::ncclInvalidUsage);
        assert_eq!(code(&Error::NoDevice("x".into())), ncclResult_t::ncclInvalidUsage);
        assert_eq!(code(&Error::Remote("x".into())), ncclResult_t::ncclRemoteError);
        assert_eq!(code(&Error::Local("x".into())), ncclResult_t::ncclSystemError);
    }
}
