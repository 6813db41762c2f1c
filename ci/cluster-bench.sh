#!/usr/bin/env bash
# The cluster benchmark: for each N, a VM with N Soft-RoCE ranks on one bridge
# (FERROCE_VM_RANKS=N), the link's bandwidth by perftest (ib_write_bw rxe0 -> rxe1, 1 MiB writes)
# and then `ferroce collective` all-reduce, all-gather and reduce-scatter over all N ranks in the
# same boot, with nccl-tests' table, the connect time and busbw / link bandwidth.
#
#   ci/cluster-bench.sh [N ...]          (default: 2 4 8)
#   environment: BENCH_ARGS (default "-b 1M -e 16M -f 4 -n 3 -w 1"), the collectives' sizes
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  if [[ ${1:-} == --in-vm ]]; then
    in_vm
    return
  fi
  local ns=("$@")
  [[ ${#ns[@]} -gt 0 ]] || ns=(2 4 8)
  ci/install.sh
  ci/build.sh
  local n
  for n in "${ns[@]}"; do
    echo "=== $n ranks"
    FERROCE_VM_RANKS=$n FERROCE_VM_QUIET=1 ci/vm.sh ci/cluster-bench.sh --in-vm
  done
}

in_vm() {
  local dev0 dev1 gid0 gid1 ip1 server link
  read -r dev0 dev1 _ <<<"$FERROCE_VM_DEVS"
  read -r gid0 gid1 _ <<<"$FERROCE_VM_GIDX"
  read -r _ ip1 _ <<<"$FERROCE_VM_IPS"
  timeout 60 ib_write_bw -d "$dev1" -x "$gid1" -F -D 3 -s 1048576 --report_gbits >/tmp/server.log 2>&1 &
  server=$!
  for _ in $(seq 200); do ss -Hltn 'sport = :18515' | grep -q . && break; sleep 0.1; done
  link=$(timeout 60 ib_write_bw -d "$dev0" -x "$gid0" -F -D 3 -s 1048576 --report_gbits "$ip1" |
    awk '$1 == 1048576 { print $4 }')
  wait "$server" || true
  [[ -n $link ]] || { echo "cluster-bench: ib_write_bw gave no number" >&2; exit 1; }
  echo "# link: ib_write_bw $dev0 -> $dev1, 1 MiB writes, 3 s: $link Gb/s"
  local coll out busbw
  for coll in allreduce allgather reducescatter; do
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
    out=$(target/release/ferroce collective "$coll" ${BENCH_ARGS:--b 1M -e 16M -f 4 -n 3 -w 1})
    echo "$out"
    busbw=$(awk '!/^#/ && NF == 9 { b = $8 } END { print b }' <<<"$out")
    awk -v b="$busbw" -v l="$link" -v c="$coll" -v n="$FERROCE_VM_RANKS" \
      'BEGIN { printf "# %s, %d ranks, largest size: busbw %.4f GB/s = %.2f x the link (%.4f GB/s)\n", c, n, b, b / (l / 8), l / 8 }'
  done
}
main "$@"
