#!/usr/bin/env bash
# The plugin under the checkers of undefined behaviour, on the nightly toolchain (ci/test.sh
# runs this; ci/install.sh adds nightly's rust-src and miri):
#   1. Miri: the tests of the handle register, the gates and the FFI boundary (what NCCL's
#      pointers reach, and the code that frees under concurrency);
#   2. AddressSanitizer with LeakSanitizer: every host unit test of the plugin;
#   3. ThreadSanitizer: every host unit test of the plugin, then the concurrency and census
#      programs against a ThreadSanitizer build of the plugin, in the Soft-RoCE VM.
# std is rebuilt with each sanitizer (-Zbuild-std): an uninstrumented std hides its own
# synchronisation (futex mutexes, fences) and makes ThreadSanitizer report races that are not.
# Any report fails the run; nothing is suppressed.
# Usage: ci/sanitizers.sh [miri|asan|tsan]...   (all three by default)
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  local t0=$SECONDS target=x86_64-unknown-linux-gnu
  say() { echo "sanitizers: $* ($((SECONDS - t0)) s)"; }
  fail() { echo "sanitizers: FAILED: $*" >&2; exit 1; }
  cargo +nightly miri --version >/dev/null 2>&1 ||
    fail "no nightly toolchain with miri and rust-src: run ci/install.sh"
  local what=("$@")
  ((${#what[@]} > 0)) || what=(miri asan tsan)
  for w in "${what[@]}"; do
    case $w in
      miri)
        say "Miri: the handle register, gates and FFI boundary"
        # The register keeps addresses as integers (NCCL's pointers come back as such).
        MIRIFLAGS=-Zmiri-permissive-provenance CARGO_TARGET_DIR=target/miri \
          cargo +nightly miri test --locked --lib -- ffi::
        ;;
      asan)
        say "AddressSanitizer and LeakSanitizer: the plugin's host unit tests"
        RUSTFLAGS=-Zsanitizer=address ASAN_OPTIONS=detect_leaks=1 CARGO_TARGET_DIR=target/asan \
          cargo +nightly test -Zbuild-std --target $target --locked --lib
        ;;
      tsan)
        say "ThreadSanitizer: the plugin's host unit tests"
        # halt_on_error: the first report fails the process, whatever the test then does.
        export TSAN_OPTIONS=halt_on_error=1
        RUSTFLAGS=-Zsanitizer=thread CARGO_TARGET_DIR=target/tsan \
          cargo +nightly test -Zbuild-std --target $target --locked --lib
        say "ThreadSanitizer: the concurrency and census programs in the Soft-RoCE VM"
        # The programs dlopen the plugin, which calls the sanitizer's runtime in the program:
        # --export-dynamic makes the runtime's symbols visible to it.
        local dir=target/tsan/$target/release bins
        bins=$(RUSTFLAGS="-Zsanitizer=thread -Cdebuginfo=1 -Clink-arg=-Wl,--export-dynamic" \
          CARGO_TARGET_DIR=target/tsan cargo +nightly build -Zbuild-std --target $target \
          --release --locked --lib --test concurrency --test census --message-format=json |
          python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print("main:" + m["executable"])')
        [[ $(wc -l <<<"$bins") == 2 ]] || fail "the concurrency and census programs were not built"
        [[ $(nm -D "$dir/libferroce.so") == *__tsan_func_entry* ]] ||
          fail "the plugin is not instrumented"
        cp -f "$dir/libferroce.so" "$dir/libnccl-net-ferroce.so"
        # shellcheck disable=SC2086 # one word per binary
        FERROCE_PLUGIN_DIR="$PWD/$dir" FERROCE_VM_NO_PERFTEST=1 ci/vm.sh \
          "TSAN_OPTIONS=halt_on_error=1 ci/vm-tests.sh $(echo $bins)"
        ;;
      *) fail "unknown checker $w (miri, asan or tsan)" ;;
    esac
  done
  say "passed: ${what[*]}"
}
main "$@"
