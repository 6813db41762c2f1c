#!/usr/bin/env bash
# The main command: on a fresh machine, install, build, boot the Soft-RoCE VM, show the devices
# ferroce finds, and run the benchmark: two rank processes through the plugin's ABI, polled as
# NCCL's proxy polls (8 receives posted ahead by default, --depth), and for each size right after
# them perftest on the same rxe0 -> rxe1 link: ib_write_bw and ib_send_bw (plus ib_write_bw -q N
# when NCCL_IB_QPS_PER_CONNECTION=N is exported), ib_write_lat and ib_send_lat beside the Simple and LL
# latency. 5 rounds by default; per size the median, the spread and ferroce / perftest, and one
# check of perftest's clock against the wall clock.
#
#   ci/bench.sh [ferroce perf options]     e.g. ci/bench.sh --rounds 3 --depth 4 --json
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
  # Five rounds with up to four perftest runs per size may outlast vm.sh's default 20 minutes.
  FERROCE_VM_TIMEOUT=${FERROCE_VM_TIMEOUT:-2700} LD_LIBRARY_PATH="$PWD/target/release" ci/vm.sh \
    "target/release/ferroce info ferroce $info && target/release/ferroce perf$args" >&3
}
main "$@"
