//! ferroce-tools: the client side of the plugin's ncclNet ABI, for the `ferroce` tool and the
//! integration tests. It is a crate of its own so that it is compiled once and never reaches the
//! shipped `.so`: the plugin does not depend on it, only its dev-dependencies do.
//!
//! - [`loader`] opens the plugin the way NCCL does and captures what it logs;
//! - [`driver`] calls it through any ABI version (v6–v12) the way NCCL's proxy thread does;
//! - [`buffer`] is the host memory it registers, and the data pattern every transfer checks;
//! - [`handle`] carries the 128-byte connection handle between processes as hex;
//! - [`rank`] connects comms: listen, hand over the handle, connect and accept;
//! - [`proc`] runs the other ranks of a test or benchmark and reads their lines;
//! - [`profiler`] records the net profiler events the plugin reports;
//! - [`wait`] bounds every "call again" loop;
//! - [`out`] writes the tools' tables and JSON;
//! - [`rng`] gives both sides of a test the same schedule;
//! - [`sys`] holds the few system calls the tools make beyond `std`.
//!
//! This is where the tools' `unsafe` lives (the `ferroce` program itself forbids it): each
//! block says why it is sound, and the modules offer safe functions on top of them.

pub mod buffer;
pub mod driver;
pub mod handle;
pub mod loader;
pub mod out;
pub mod proc;
pub mod profiler;
pub mod rank;
pub mod rng;
pub mod sys;
pub mod wait;
