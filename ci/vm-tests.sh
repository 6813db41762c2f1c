#!/usr/bin/env bash
# Runs INSIDE the Soft-RoCE VM (ci/vm.sh): every VM test of the given test binaries, each test
# in its own process (the plugin's global state starts fresh for each), then the perftest
# platform check. Every test runs, whatever failed before it; the failures are listed at the
# end, each with its last lines, and any failure, or finding no tests at all, fails the run.
# Usage: ci/vm.sh ci/vm-tests.sh KIND:BINARY...
#   main:BINARY     a test program with its own main (`test = false` in Cargo.toml): run once;
#   harness:BINARY  a libtest binary: each of its #[ignore]d tests (the VM ones) in turn; one
#                   with none is host-only and said so.
# FERROCE_VM_NO_PERFTEST=1 leaves out the perftest platform check at the end.
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
  local passed=0 failed=() arg bin t out log
  out=$(mktemp -d)
  # One test: its output to the console and to a log; a failure is noted with its log.
  one() {
    local name=$1 limit=$2; shift 2
    log="$out/$((passed + ${#failed[@]})).log"
    echo "vm-tests: $name"
    if timeout -k 5 "$limit" "$@" 2>&1 | tee "$log"; then # pipefail: the test's status
      passed=$((passed + 1))
    else
      echo "vm-tests: FAILED: $name" >&2
      failed+=("$name|$log")
    fi
  }
  for arg in "$@"; do
    bin=${arg#*:}
    case "$arg" in
      main:*) one "$(basename "$bin")" 900 "$bin" ;;
      harness:*)
        local tests
        tests=$("$bin" --list --ignored --format terse | sed -n 's/: test$//p')
        if [[ -z "$tests" ]]; then
          echo "vm-tests: $(basename "$bin"): no VM tests (host only; cargo test ran it)"
          continue
        fi
        for t in $tests; do
          one "$(basename "$bin") :: $t" 300 "$bin" --ignored --exact "$t" --test-threads=1 --nocapture
        done
        ;;
      *) fail "not KIND:BINARY (kind main or harness): $arg" ;;
    esac
  done
  # FERROCE_VM_NO_PERFTEST=1 (ci/sanitizers.sh, which checks the plugin, not the platform)
  # leaves the platform check out.
  if [[ ${FERROCE_VM_NO_PERFTEST:-0} == 1 ]]; then
    echo "vm-tests: the perftest platform check left out (FERROCE_VM_NO_PERFTEST=1)"
  elif "$(dirname "$0")/vm-perftest-smoke.sh"; then
    passed=$((passed + 1))
  else
    failed+=("perftest ib_write_bw between rxe0 and rxe1|/dev/null")
  fi
  if ((${#failed[@]} > 0)); then
    echo >&2
    echo "vm-tests: ${#failed[@]} of $((passed + ${#failed[@]})) failed; each with its last lines:" >&2
    local f
    for f in "${failed[@]}"; do
      echo "--- vm-tests: FAILED: ${f%%|*}" >&2
      tail -n 25 "${f#*|}" >&2
    done
    echo "vm-tests: FAILED: ${#failed[@]} test(s): $(printf '%s; ' "${failed[@]%%|*}")" >&2
    exit 1
  fi
  ((passed > 0)) || fail "no VM tests found in: $*"
  echo "vm-tests: $passed VM tests passed on $(echo $FERROCE_VM_DEVS)"
}
main "$@"
