//! The client side of the ncclNet ABI, for the tools in `src/bin` and the tests: open the
//! plugin the way NCCL does (`loader`) and drive it through any ABI version the way NCCL's
//! proxy does (`driver`). Not part of the plugin: the library never declares this module;
//! the `ferroce` binary and the tests include it by path.

pub mod driver;
pub mod loader;
