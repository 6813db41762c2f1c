#!/usr/bin/env bash
# GPU-side checks for ferroce. Run only on a machine with an NVIDIA GPU and its driver; no network
# access is needed, and an RDMA NIC only for part (c) (without one it is skipped). Needs a C
# compiler and, for part (b), an NCCL installation (a PyTorch environment has one:
# nvidia-nccl-cu12).
#
#   ci/gpu-check.sh [PLUGIN_DIR]     PLUGIN_DIR holds libnccl-net-ferroce.so (default
#                                    target/release, from ci/build.sh); NCCL_LIB=/path/to/
#                                    libnccl.so.2 picks the NCCL to load
#
# What it proves:
#  (a) dma-buf: real GPU memory (cuMemAlloc) exports as a dma-buf fd exactly the way NCCL's
#      core does before it calls a plugin's regMrDmaBuf (cuMemGetHandleForAddressRange over
#      [ptr, roundup(size, host page))), and the fd covers the range ferroce would register
#      ([0, size) at iova = ptr), also for a sub-range starting one GPU page in; the fd closes.
#  (b) NCCL: the real NCCL loads ferroce by NCCL_NET_PLUGIN=ferroce and its calls return. On a
#      host with no RDMA device, ferroce says why it has none (its only WARN: any other, such as
#      one from NCCL's finalize(NULL) after the failed init, fails) and NCCL falls back to
#      another network without crashing; on one with an RDMA device (/sys/class/infiniband),
#      NCCL uses ferroce, ferroce lists its devices, and it WARNs of nothing.
#  (c) send from GPU memory: ferroce (ncclNet v12) connects device 0 to itself, registers
#      cuMemAlloc'd memory (regMrDmaBuf, else regMr NCCL_PTR_CUDA) and sends 8, 256 and 4096 B
#      from it into host memory, byte-exact; a CPU read of GPU memory (say, a small send
#      inlined) dies with SIGSEGV here. Needs an RDMA NIC; without one it is SKIPPED.
# (a) and (b) cannot prove a GPUDirect transfer; (c) does, on a host with an RDMA NIC. Record the
# result (GPU, driver, NCCL version, the dma-buf sizes, the NIC) in README's GPUDirect section.
#
# Exit: 0 all checks passed, 1 a check failed, 2 nothing failed but a part was skipped.
main() {
  set -euo pipefail
  local plugin_dir=${1:-}
  if [[ -n $plugin_dir ]]; then plugin_dir=$(cd "$plugin_dir" && pwd); fi
  cd "$(dirname "$0")/.."
  plugin_dir=${plugin_dir:-$(pwd)/target/release}
  local plugin=$plugin_dir/libnccl-net-ferroce.so
  if [[ ! -f $plugin ]]; then
    echo "gpu-check: $plugin is missing; build it with ci/build.sh (or pass the folder holding it)" >&2
    exit 1
  fi

  local work summary=() failed=0 skipped=0
  work=$(mktemp -d /tmp/ferroce-gpu-check.XXXXXX)
  pass() { summary+=("PASS $*"); }
  fail() { summary+=("FAIL $*"); failed=1; }
  skip() { summary+=("SKIP $*"); skipped=1; }
  # The C program's exit status, as a verdict: 2 is its "something needed is absent".
  verdict() {
    local what=$1 rc=$2 log=$3
    case $rc in
      0) pass "$what" ;;
      1) fail "$what (see FAIL lines above)" ;;
      2) skip "$what: $(grep -m1 'SKIP-REASON' "$log" || echo 'no reason given')" ;;
      124 | 137) fail "$what: timed out after 120 s (or SIGKILL)" ;;
      *) if ((rc > 128)); then fail "$what: killed by signal $((rc - 128))"; else fail "$what: exit $rc"; fi ;;
    esac
  }

  echo "=== gpu-check: GPUs"
  if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi -L || echo "nvidia-smi -L failed"
  else
    echo "no nvidia-smi on PATH"
  fi

  echo "=== gpu-check: plugin $plugin"
  # A missing libibverbs stops NCCL from loading the plugin at all; say so before it hides
  # among NCCL's INFO lines. With no network, carry libibverbs.so.1 and libnl-*.so next to it.
  if LD_LIBRARY_PATH="$plugin_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$plugin" | grep 'not found'; then
    echo "gpu-check: WARNING: the plugin has unresolved libraries (above); install rdma-core's" \
      "libibverbs1 or put the libraries in $plugin_dir"
  fi

  local nccl
  nccl=$(find_nccl) || true
  if [[ -n $nccl ]]; then
    echo "=== gpu-check: NCCL $nccl"
  else
    echo "gpu-check: ***** NO libnccl.so.2 FOUND (set NCCL_LIB=/path/to/libnccl.so.2): part (b) is SKIPPED *****"
  fi

  echo "=== gpu-check: compiling ci/gpu/gpu_check.c"
  local bin=$work/gpu_check
  cc -O1 -Wall -Werror -I include -o "$bin" ci/gpu/gpu_check.c -ldl

  # One case of the C program, with the plugin's folder on the library path: its log shown,
  # its verdict recorded, and `rc` and `log` left for what follows.
  local rc log
  run_case() {
    local what=$1 name=$2
    shift 2
    rc=0 log=$work/$name.log
    LD_LIBRARY_PATH="$plugin_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      timeout -k 10 120 "$bin" "$@" >"$log" 2>&1 || rc=$?
    cat "$log"
    verdict "$what" "$rc" "$log"
  }

  echo "=== gpu-check: (a) dma-buf export of GPU memory"
  run_case "(a) dma-buf export" dmabuf dmabuf

  if [[ -n $nccl ]]; then
    local rdma
    rdma=$(ls /sys/class/infiniband 2>/dev/null | wc -l)
    echo "=== gpu-check: (b) ferroce under NCCL, one rank, $rdma RDMA device(s)"
    run_case "(b) NCCL calls return, no crash" nccl nccl "$nccl"
    local version
    version=$(grep -o -m1 'NCCL version [0-9.]*' "$log") || version="NCCL version unknown"
    summary+=("     $nccl: $version")
    # A skip (no libcuda) means NCCL never reached its network setup: nothing to look for.
    if ((rc != 2)); then
      echo "=== gpu-check: (b) what NCCL's log shows"
      expect "(b) NCCL loaded ferroce" 'Loaded net plugin ferroce|external network plugin .*ferroce' "$log"
    fi
    if ((rc != 2 && rdma > 0)); then
      expect "(b) NCCL uses ferroce" 'Using network ferroce' "$log"
      expect "(b) ferroce lists its devices" 'NET/ferroce: device 0: ' "$log"
      refuse "(b) ferroce WARNs of nothing" 'NET/ferroce:' "$log" 'NCCL (INFO|TRACE) NET/ferroce:'
    elif ((rc != 2)); then
      expect "(b) ferroce says why it has no device" 'NET/ferroce: .*(no usable RDMA device|no RDMA devices)' "$log"
      expect "(b) NCCL fell back to another network" 'Using network' "$log" 'Using network ferroce'
      # Where there is no RDMA NIC, that one WARN is all ferroce may say above INFO: anything
      # else (a false "internal error" from finalize, say) is printed by every rank of a job.
      refuse "(b) ferroce WARNs of nothing but its missing device" 'NET/ferroce:' "$log" \
        'NCCL (INFO|TRACE) NET/ferroce:|no usable RDMA device'
      echo "--- other plugin and ferroce lines:"
      grep -E 'NET/Plugin|NCCL_NET_PLUGIN|NET/ferroce|Using network' "$log" | head -n 20 || true
    fi
  else
    skip "(b) ferroce under NCCL: no libnccl.so.2 found (set NCCL_LIB)"
  fi

  echo "=== gpu-check: (c) send from GPU memory through the plugin"
  run_case "(c) send from GPU memory through the plugin" send send "$plugin"

  echo
  echo "=== gpu-check summary (logs and binary in $work)"
  printf '%s\n' "${summary[@]}"
  if ((failed)); then
    echo "gpu-check: FAILED"
    exit 1
  elif ((skipped)); then
    echo "gpu-check: nothing failed, but a part was SKIPPED (above)"
    exit 2
  fi
  echo "gpu-check: all checks passed"
}

# Records a PASS with the log lines that match (less those matching the optional 4th
# argument), or a FAIL when none do.
expect() {
  local what=$1 pattern=$2 log=$3 unwanted=${4:-^\$} lines=()
  mapfile -t lines < <(grep -E -- "$pattern" "$log" | grep -Ev -- "$unwanted" | head -n 5)
  if ((${#lines[@]})); then
    pass "$what"
    echo "PASS $what:"
  else
    fail "$what: no line matches /$pattern/${4:+ other than /$4/}"
    echo "FAIL $what: no line matches /$pattern/${4:+ other than /$4/}"
  fi
  ((${#lines[@]} == 0)) || printf '    %s\n' "${lines[@]}"
}

# The opposite of `expect`: a FAIL showing the log lines that match (less those matching the
# 4th argument), a PASS when none do.
refuse() {
  local what=$1 pattern=$2 log=$3 allowed=$4 lines=()
  mapfile -t lines < <(grep -E -- "$pattern" "$log" | grep -Ev -- "$allowed" | head -n 5)
  if ((${#lines[@]})); then
    fail "$what: $(head -c 200 <<<"${lines[0]}")"
    echo "FAIL $what; unexpected:"
    printf '    %s\n' "${lines[@]}"
  else
    pass "$what"
    echo "PASS $what"
  fi
}

# Prints the path of libnccl.so.2: $NCCL_LIB, the loader cache, a pip wheel, common folders.
find_nccl() {
  if [[ -n ${NCCL_LIB:-} ]]; then
    [[ -f $NCCL_LIB ]] || { echo "gpu-check: NCCL_LIB=$NCCL_LIB does not exist" >&2; return 1; }
    echo "$NCCL_LIB"
    return
  fi
  local p d
  p=$(ldconfig -p 2>/dev/null | awk '$1 == "libnccl.so.2" { print $NF; exit }') || true
  # nvidia is a namespace package: no __file__, only __path__.
  [[ -n $p ]] || p=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) || true
  if [[ -n $p && -f $p ]]; then
    echo "$p"
    return
  fi
  for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/local/cuda/lib64 /usr/local/lib /usr/lib64; do
    [[ -f $d/libnccl.so.2 ]] && { echo "$d/libnccl.so.2"; return; }
  done
  return 1
}

main "$@"
