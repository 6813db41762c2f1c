//! Generates the Rust view of `include/ferroce_net.h` (the ncclNet ABI v6..v12) with bindgen,
//! keeping bindgen's layout tests so every size and offset is checked by `cargo test`, and gives
//! the cdylib the soname NCCL looks for.

use std::{env, path::PathBuf};

fn main() {
    let header = "include/ferroce_net.h";
    println!("cargo:rerun-if-changed={header}");
    let bindings = bindgen::Builder::default()
        .header(header)
        .allowlist_type("nccl.*")
        .allowlist_var("NCCL_.*")
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .layout_tests(true)
        .derive_default(true)
        .generate()
        .expect("bindgen failed on include/ferroce_net.h");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("abi.rs");
    bindings.write_to_file(&out).expect("write abi.rs");
    // NCCL opens the plugin as libnccl-net-<name>.so; give the library that soname.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl-net-ferroce.so");
}
