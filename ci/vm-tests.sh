#!/usr/bin/env bash
# Runs INSIDE the Soft-RoCE VM (ci/vm.sh): every VM test of the given test binaries, each test
# in its own process (the plugin's global state starts fresh for each), then the perftest
# platform check. Any failure, or finding no tests at all, fails the run loudly.
# Usage: ci/vm.sh ci/vm-tests.sh KIND:BINARY...
#   main:BINARY     a test program with its own main (`test = false` in Cargo.toml): run once;
#   harness:BINARY  a libtest binary: each of its #[ignore]d tests (the VM ones) in turn; one
#                   with none is host-only and said so.
# ci/test.sh derives these words from Cargo's build of every test target, so the list of VM
# tests is Cargo.toml's (plus each file's #[ignore] marks) and nothing else.
main() {
  set -euo pipefail
  fail() { echo "vm-tests: FAILED: $*" >&2; exit 1; }
  [[ "${FERROCE_IN_VM:-}" == 1 ]] || fail "not inside the Soft-RoCE VM; run through ci/vm.sh"
  [[ $# -gt 0 ]] || fail "no test binaries given"
  [[ -n "${FERROCE_PLUGIN_DIR:-}" ]] || fail "FERROCE_PLUGIN_DIR is not set"
  echo "vm-tests: kernel $(uname -r); RDMA devices:"
  rdma link show
  local passed=0 arg bin t
  for arg in "$@"; do
    bin=${arg#*:}
    case "$arg" in
      main:*)
        echo "vm-tests: $(basename "$bin")"
        timeout -k 5 900 "$bin" || fail "$(basename "$bin")"
        passed=$((passed + 1))
        ;;
      harness:*)
        local tests
        tests=$("$bin" --list --ignored --format terse | sed -n 's/: test$//p')
        if [[ -z "$tests" ]]; then
          echo "vm-tests: $(basename "$bin"): no VM tests (host only; cargo test ran it)"
          continue
        fi
        for t in $tests; do
          echo "vm-tests: $(basename "$bin") :: $t"
          timeout -k 5 300 "$bin" --ignored --exact "$t" --test-threads=1 --nocapture ||
            fail "$(basename "$bin") :: $t"
          passed=$((passed + 1))
        done
        ;;
      *) fail "not KIND:BINARY (kind main or harness): $arg" ;;
    esac
  done
  ((passed > 0)) || fail "no VM tests found in: $*"
  echo "vm-tests: $passed VM tests passed on $(echo $FERROCE_VM_DEVS)"
  "$(dirname "$0")/vm-perftest-smoke.sh" || fail "perftest ib_write_bw between rxe0 and rxe1"
}
main "$@"
