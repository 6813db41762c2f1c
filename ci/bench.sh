#!/usr/bin/env bash
# The main command: on a fresh machine, install, build, boot the Soft-RoCE VM, show the devices
# ferroce finds, and run the benchmark: two rank processes through the plugin's ABI, then
# perftest ib_write_bw / ib_write_lat / ib_send_lat on the same rxe0 -> rxe1 link, in rounds,
# with the median, the spread and the ratio per size.
#
#   ci/bench.sh [ferroce perf options]     e.g. ci/bench.sh --rounds 5 --json
#
# With --json, stdout carries only the JSON object; everything else goes to stderr.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  local info="" args=""
  # The arguments cross into the VM inside a bash -c string, so each is quoted once.
  [[ $# -eq 0 ]] || args=$(printf ' %q' "$@")
  exec 3>&1
  if [[ " $* " == *" --json "* ]]; then
    exec 1>&2
    info=">&2"
  fi
  ci/install.sh
  ci/build.sh
  LD_LIBRARY_PATH="$PWD/target/release" ci/vm.sh \
    "target/release/ferroce info ferroce $info && target/release/ferroce perf$args" >&3
}
main "$@"
