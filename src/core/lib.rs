//! ferroce's cores: what the plugin decides, as state machines that do no I/O.
//!
//! The plugin (`ferroce`) is a shell around these. Its transport posts the work requests a core
//! asks for, feeds the core the completions it polls, and carries bytes over the sockets the
//! setup core asks to write; the core decides everything else. This crate depends on nothing,
//! and `unsafe` is forbidden in it, so the compiler holds the rule that the cores reach no
//! verbs, no sockets and no libc, and every path through them runs in host tests.
//!
//! - [`data`]: the data path of one connection: the wire encoding of work-request ids,
//!   immediates and clear-to-send rows, lane health, the send side with its failover, the
//!   receive side, send-queue accounting, path-aware placement and lane repair. Driven by
//!   `ferroce::transport::data`.
//! - [`setup`]: connection setup, one state machine per connect and per listener, and its wire
//!   format ([`setup::wire`]). Driven by `ferroce::transport::setup`.
//! - [`error`]: the one error type of ferroce.
//! - [`wr`]: work requests and completions as plain data.

#![forbid(unsafe_code)]

pub mod data;
pub mod error;
pub mod setup;
pub mod wr;
