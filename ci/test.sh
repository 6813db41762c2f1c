#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls exactly this):
#   1. install what is needed (apt packages, kernel image, qemu);
#   2. style gates over the whole workspace (the plugin, src/core and src/tools): cargo fmt
#      --check, cargo clippy -D warnings, cargo doc with warnings as errors;
#   3. host tests of the whole workspace: unit tests, ABI layout, loadability, the tools'
#      command line (cargo test);
#   4. build the release plugin and the test binaries on the host, boot the Soft-RoCE VM and
#      run the VM tests against rxe0/rxe1 inside it, plus perftest between the same devices;
#   5. boot it again with 4 ranks on one bridge and run the cluster test (ring collectives,
#      ECMP ports, the failure of one rank), then with 8 for the NIC-fusion tests (up to 8
#      fused ports);
#   6. the Debian package (ci/package.sh): installed on this host as a user would, then, in the
#      VM, the installed tool finds the installed plugin by NCCL's own lookup and a self-test
#      transfer verifies its data, with no LD_LIBRARY_PATH; then removed again;
#   7. the checkers of undefined behaviour (ci/sanitizers.sh): Miri on the handle register and
#      FFI boundary, AddressSanitizer on the unit tests, ThreadSanitizer on the unit tests and
#      on the concurrency and census programs in the VM.
# Steps 4 and 5 run with one core busy: a CPU-bound process of this script's own (`yes`) runs
# beside them, as other jobs do on a shared build machine (FERROCE_CI_HOG=0 leaves it out).
# A VM that does not boot fails the run; nothing is skipped.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  local t0=$SECONDS
  step() { echo; echo "=== ci/test.sh: $* ($((SECONDS - t0)) s)"; }

  step "install"
  ci/install.sh

  step "style"
  cargo fmt --all --check
  # --all-targets leaves out the test programs with their own main (test = false), so they
  # get their own pass.
  cargo clippy --workspace --all-targets --locked -- -D warnings
  cargo clippy --locked --test '*' -- -D warnings
  # The design, the protocol and the test catalogue live in the module documentation: it must
  # build with no warning, so a broken intra-doc link fails the run. Private items are
  # documented (the cores' docs name their internals), so links to them are allowed.
  RUSTDOCFLAGS='-D warnings -A rustdoc::private-intra-doc-links' \
    cargo doc --workspace --no-deps --lib --document-private-items --locked

  step "host tests"
  cargo test --workspace --locked

  step "build release plugin and VM test binaries"
  ci/build.sh
  # Every test target in Cargo.toml, as KIND:BINARY for ci/vm-tests.sh: a program with its own
  # main (`test = false`) runs as a whole, a libtest binary runs its #[ignore]d (VM) tests. So
  # Cargo.toml is the one list of VM tests.
  local bins
  bins=$(cargo test --release --locked --no-run --test '*' --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(("harness:" if m["target"]["test"] else "main:") + m["executable"])')
  [[ -n "$bins" ]] || { echo "ci/test.sh: no VM test binaries were built" >&2; exit 1; }
  # The test-only stand-in for a dma-buf-capable NIC, preloaded by the gpudirect test.
  cc -shared -fPIC -O1 -Wall -Werror -o target/release/libferroce-dmabuf-standin.so \
    tests/dmabuf_standin.c -ldl

  # The cluster and NIC-fusion tests need boots of their own, each rank an rxe device on one
  # bridge: 4 ranks for the cluster, 8 for fusion (v12 fuses up to 8 ports).
  local cluster fusion
  cluster=$(grep -E '/cluster-' <<<"$bins" || true)
  fusion=$(grep -E '/fusion-' <<<"$bins" || true)
  bins=$(grep -v -E '/(cluster|fusion)-' <<<"$bins" || true)
  [[ $(wc -l <<<"$cluster") == 1 && $(wc -l <<<"$fusion") == 1 && -n $cluster && -n $fusion ]] ||
    { echo "ci/test.sh: the cluster and fusion tests were not both built" >&2; exit 1; }

  local hog=
  if [[ ${FERROCE_CI_HOG:-1} != 0 ]]; then
    yes >/dev/null &
    hog=$!
    # The PID goes into the trap now: `hog` is main's local, gone when the trap runs.
    # shellcheck disable=SC2064
    trap "kill $hog 2>/dev/null || true" EXIT
    echo "ci/test.sh: one core busy beside the VM tests: pid $hog (yes > /dev/null)"
  fi

  step "VM tests on Soft-RoCE"
  # About 15 minutes on an idle machine, and TCG slows down 2-3x on a busy one: the VM's own
  # limit (ci/vm.sh's 20 min default) must not be what fails a run; each test has its own.
  # shellcheck disable=SC2086 # one word per binary
  FERROCE_VM_TIMEOUT=${FERROCE_VM_TIMEOUT:-2700} FERROCE_PLUGIN_DIR="$PWD/target/release" \
    ci/vm.sh ci/vm-tests.sh $bins

  step "cluster tests on Soft-RoCE: 4 ranks on one bridge"
  FERROCE_VM_RANKS=4 FERROCE_PLUGIN_DIR="$PWD/target/release" ci/vm.sh ci/vm-tests.sh "$cluster"
  step "NIC-fusion tests on Soft-RoCE: 8 ports on one bridge"
  FERROCE_VM_RANKS=8 FERROCE_PLUGIN_DIR="$PWD/target/release" ci/vm.sh ci/vm-tests.sh "$fusion"
  if [[ -n $hog ]]; then
    kill "$hog"
    echo "ci/test.sh: stopped the CPU hog (pid $hog)"
  fi

  step "the Debian package: installed, used from its paths in the VM, removed"
  local deb
  deb=$(ci/package.sh | tail -n 1)
  dpkg -i "$deb"
  FERROCE_VM_TIMEOUT=600 ci/vm.sh ci/vm-package-test.sh
  dpkg -r ferroce
  [[ ! -e /usr/bin/ferroce ]] || { echo "ci/test.sh: dpkg -r left /usr/bin/ferroce" >&2; exit 1; }

  step "Miri, AddressSanitizer and ThreadSanitizer"
  ci/sanitizers.sh

  step "done: all tests passed in $((SECONDS - t0)) s"
}
main "$@"
