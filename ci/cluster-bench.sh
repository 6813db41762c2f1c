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

# bw FROM TO PORT: ib_write_bw of 1 MiB writes for 3 s from rank FROM to rank TO, in Gb/s.
bw() {
  local devs gids ips server out
  read -ra devs <<<"$FERROCE_VM_DEVS"
  read -ra gids <<<"$FERROCE_VM_GIDX"
  read -ra ips <<<"$FERROCE_VM_IPS"
  timeout 60 ib_write_bw -d "${devs[$2]}" -x "${gids[$2]}" -p "$3" -F -D 3 -s 1048576 --report_gbits \
    >/dev/null 2>&1 &
  server=$!
  for _ in $(seq 200); do ss -Hltn "sport = :$3" | grep -q . && break; sleep 0.1; done
  # From the iterations done in the 3 s: perftest's own Gb/s column reads 0 whenever its clock
  # calibration fails, which it often does on a busy VM.
  out=$(timeout 60 ib_write_bw -d "${devs[$1]}" -x "${gids[$1]}" -p "$3" -F -D 3 -s 1048576 \
    --report_gbits "${ips[$2]}" | awk '$1 == 1048576 { printf "%.4f", $2 * 1048576 * 8 / 3 / 1e9 }')
  wait "$server" || true
  echo "${out:-0}"
}

in_vm() {
  local n=$FERROCE_VM_RANKS link ring i coll out busbw
  link=$(bw 0 1 18515)
  awk -v l="$link" 'BEGIN { exit !(l > 0) }' || { echo "cluster-bench: ib_write_bw failed" >&2; exit 1; }
  echo "# link: ib_write_bw rank 0 -> rank 1 alone, 1 MiB writes, 3 s: $link Gb/s"
  # The ring's links all busy at once, as in a ring collective: each rank writes to the next.
  for ((i = 0; i < n; i++)); do bw "$i" $(((i + 1) % n)) $((18600 + i)) >"/tmp/ring.$i" & done
  wait
  ring=$(cat /tmp/ring.* | awk '{ s += $1; n++ } END { printf "%.4f", s / n }')
  echo "# ring: ib_write_bw on all $n links at once (rank i -> i+1): $ring Gb/s per link on average ($(cat /tmp/ring.* | paste -sd' '))"
  for coll in allreduce allgather reducescatter; do
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
    out=$(target/release/ferroce collective "$coll" ${BENCH_ARGS:--b 1M -e 16M -f 4 -n 3 -w 1})
    echo "$out"
    busbw=$(awk '!/^#/ && NF == 9 { b = $8 } END { print b }' <<<"$out")
    awk -v b="$busbw" -v l="$link" -v r="$ring" -v c="$coll" -v n="$n" 'BEGIN {
      printf "# %s, %d ranks, largest size: busbw %.4f GB/s = %.2f x the link alone (%.4f GB/s), %.2f x a ring link (%.4f GB/s)\n",
        c, n, b, b / (l / 8), l / 8, b / (r / 8), r / 8 }'
  done
}

main "$@"
