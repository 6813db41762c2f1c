#!/usr/bin/env bash
# Runs INSIDE the Soft-RoCE VM (ci/vm.sh): every VM test of the given test binaries, each test
# in its own process (the plugin's global state starts fresh for each), then the perftest
# platform check. Any failure, or finding no tests at all, fails the run loudly.
# Usage: ci/vm.sh ci/vm-tests.sh <test-binary>...
main() {
  set -euo pipefail
  fail() { echo "vm-tests: FAILED: $*" >&2; exit 1; }
  [[ "${FERROCE_IN_VM:-}" == 1 ]] || fail "not inside the Soft-RoCE VM; run through ci/vm.sh"
  [[ $# -gt 0 ]] || fail "no test binaries given"
  [[ -n "${FERROCE_PLUGIN_DIR:-}" ]] || fail "FERROCE_PLUGIN_DIR is not set"
  echo "vm-tests: kernel $(uname -r); RDMA devices:"
  rdma link show
  local passed=0 bin t own_main
  for bin in "$@"; do
    case "$(basename "$bin")" in
      netclient-* | gpudirect-* | liveness-* | fuzz_listener-* | soak-* | concurrency-* | census-* | cluster-*) own_main=1 ;;
      *) own_main=0 ;;
    esac
    if ((own_main)); then
      # Test programs with their own main: the two-process test client (every ABI version,
      # every byte verified), the GPUDirect scenarios and the liveness scenarios (each in
      # child processes).
      echo "vm-tests: $(basename "$bin")"
      timeout -k 5 900 "$bin" || fail "$(basename "$bin")"
      passed=$((passed + 1))
      continue
    fi
    local tests
    tests=$("$bin" --list --ignored --format terse | sed -n 's/: test$//p')
    [[ -n "$tests" ]] || fail "no VM tests found in $bin"
    for t in $tests; do
      echo "vm-tests: $(basename "$bin") :: $t"
      timeout -k 5 300 "$bin" --ignored --exact "$t" --test-threads=1 --nocapture ||
        fail "$(basename "$bin") :: $t"
      passed=$((passed + 1))
    done
  done
  echo "vm-tests: $passed VM tests passed on $(echo $FERROCE_VM_DEVS)"
  "$(dirname "$0")/vm-perftest-smoke.sh" || fail "perftest ib_write_bw between rxe0 and rxe1"
}
main "$@"
