#!/usr/bin/env bash
# Builds the plugin in release mode and gives it the file name NCCL looks for with
# NCCL_NET_PLUGIN=ferroce: target/release/libnccl-net-ferroce.so (cargo cannot emit a
# hyphenated library name itself; the soname is already set by build.rs). The `ferroce` tool
# (package ferroce-tools, in src/tools) lands beside it as target/release/ferroce, where it
# looks for the plugin by default and where the VM tests look for the tool.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  cargo build --release --workspace --lib --bins
  cp -f target/release/libferroce.so target/release/libnccl-net-ferroce.so.tmp
  mv -f target/release/libnccl-net-ferroce.so.tmp target/release/libnccl-net-ferroce.so
  echo "built $(pwd)/target/release/libnccl-net-ferroce.so"
}
main "$@"
