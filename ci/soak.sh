#!/usr/bin/env bash
# ci/soak.sh [SECONDS] -- the fault soak (tests/soak.rs) for as long as asked (default 600 s):
# builds the release plugin and the soak binary on the host, boots the Soft-RoCE VM and runs
# the soak there. CI runs the same program for 120 s through ci/vm-tests.sh.
# SOAK_SEED=S replays a seed printed by an earlier run; SOAK_ONLY="loss" runs just the phases
# whose name contains it.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  local secs=${1:-600}
  if ! [[ "$secs" =~ ^[0-9]+$ ]] || ((secs < 8)); then
    echo "usage: ci/soak.sh [SECONDS >= 8]" >&2
    exit 2
  fi
  ci/build.sh
  local bin
  bin=$(cargo test --release --locked --no-run --test soak --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
  [[ -n "$bin" ]] || { echo "ci/soak.sh: the soak binary was not built" >&2; exit 1; }
  # The soak, plus connection setup and drains, plus the boot; never less than ci/vm.sh's default.
  local t=$((secs + 600))
  ((t >= 1200)) || t=1200
  export FERROCE_VM_TIMEOUT=${FERROCE_VM_TIMEOUT:-$t}
  FERROCE_PLUGIN_DIR="$PWD/target/release" ci/vm.sh "$bin" --seconds "$secs" ${SOAK_SEED:+--seed "$SOAK_SEED"} ${SOAK_ONLY:+--only "$SOAK_ONLY"}
}
main "$@"
