#!/usr/bin/env bash
# Builds the plugin in release mode and gives it the file name NCCL looks for with
# NCCL_NET_PLUGIN=ferroce: target/release/libnccl-net-ferroce.so (cargo cannot emit a
# hyphenated library name itself; the soname is already set by build.rs).
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  cargo build --release --lib --bins
  cp -f target/release/libferroce.so target/release/libnccl-net-ferroce.so.tmp
  mv -f target/release/libnccl-net-ferroce.so.tmp target/release/libnccl-net-ferroce.so
  echo "built $(pwd)/target/release/libnccl-net-ferroce.so"
}
main "$@"
