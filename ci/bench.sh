#!/usr/bin/env bash
# The main command: on a fresh machine, install, build, boot the Soft-RoCE VM, show the devices
# ferroce finds, and run the benchmark: two ranks through the plugin's ABI next to perftest
# ib_write_bw / ib_write_lat on the same rxe0 -> rxe1 link, with the ratio per size.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  ci/install.sh
  ci/build.sh
  LD_LIBRARY_PATH="$PWD/target/release" ci/vm.sh \
    'target/release/ferroce info ferroce && target/release/ferroce perf'
}
main "$@"
