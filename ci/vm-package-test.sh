#!/usr/bin/env bash
# Runs INSIDE the Soft-RoCE VM (ci/vm.sh), after ci/test.sh installed the Debian package on the
# host (the guest runs the host's userspace): ferroce as a user who installed the package has
# it. Nothing from the build tree and no LD_LIBRARY_PATH: the tool is /usr/bin/ferroce, and the
# plugin is found by NCCL's own lookup (dlopen of libnccl-net-ferroce.so, NCCL_NET_PLUGIN=ferroce).
#   1. the loader's cache knows the plugin, in the package's folder;
#   2. `ferroce load` opens it as NCCL_NET_PLUGIN=ferroce does, every table v6..v12;
#   3. `ferroce doctor --selftest` passes: rxe0 sends to rxe1 through it, the data verified;
#   4. the manual page and the completions are where man and the shells look.
main() {
  set -euo pipefail
  fail() { echo "vm-package-test: FAILED: $*" >&2; exit 1; }
  [[ "${FERROCE_IN_VM:-}" == 1 ]] || fail "not inside the Soft-RoCE VM; run through ci/vm.sh"
  unset LD_LIBRARY_PATH FERROCE_PLUGIN_DIR
  cd /
  local exe lib out
  exe=$(command -v ferroce) || fail "no ferroce on PATH"
  [[ $exe == /usr/bin/ferroce ]] || fail "ferroce is $exe, not the package's /usr/bin/ferroce"
  # awk reads to the end: an early exit would end ldconfig with SIGPIPE (pipefail).
  lib=$(ldconfig -p | awk '$1 == "libnccl-net-ferroce.so" && !f { f = $NF } END { print f }')
  # /lib is /usr/lib on a merged-/usr system: the cache may name either.
  [[ -n $lib && $(realpath "$lib") == /usr/lib/*/libnccl-net-ferroce.so ]] ||
    fail "the loader's cache does not hold the package's plugin (got '${lib:-nothing}')"
  echo "vm-package-test: the loader finds $lib"
  out=$(ferroce load ferroce) || fail "ferroce load: $out"
  echo "$out"
  grep -q 'ncclNetPlugin_v12 name="ferroce"' <<<"$out" || fail "ncclNetPlugin_v12 not opened"
  out=$(ferroce doctor --dev rxe0 --selftest --json) || fail "ferroce doctor --selftest: $out"
  python3 -c 'import json,sys
r = json.load(sys.stdin)
s = r["selftest"]
assert s and s["verified"] == "every byte received matches the bytes sent", s
print("vm-package-test: doctor self-test verified:", {k: v for k, v in s.items() if k != "verified"})' <<<"$out" ||
    fail "the self-test did not verify its data: $out"
  local f
  for f in /usr/share/man/man1/ferroce.1.gz /usr/share/bash-completion/completions/ferroce \
    /usr/share/zsh/vendor-completions/_ferroce /usr/share/fish/vendor_completions.d/ferroce.fish; do
    [[ -s $f ]] || fail "$f is missing or empty"
  done
  zcat /usr/share/man/man1/ferroce.1.gz | grep -q '^\.TH ferroce 1' || fail "the man page is not roff"
  echo "vm-package-test: passed"
}
main "$@"
