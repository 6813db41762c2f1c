#!/usr/bin/env bash
# ci/vm.sh COMMAND...  -- run COMMAND inside a throw-away Soft-RoCE VM.
#
# Boots a stock Debian kernel (the newest /lib/modules/<ver> that has
# rdma_rxe and a /boot/vmlinuz-<ver>; ci/install.sh installs one) in QEMU. The
# guest runs the host's own userspace (host / over 9p, read-only, under an
# overlay with a tmpfs upper layer) and has two rxe devices that speak RoCEv2 to
# each other over a veth pair (or, with FERROCE_VM_RANKS=N, N of them on one
# bridge: one per rank of a multi-rank test). COMMAND runs in the caller's cwd;
# the repository, the cwd and the run directory's parent are shared read-write
# at their host paths, so host-built binaries work unchanged. Writes anywhere
# else are lost.
# One argument is a bash -c string; several are joined with printf '%q '.
# Build on the host (cargo/gcc), only run in the VM.
#
# The command sees the caller's exported environment (minus session/terminal
# variables) plus:
#   FERROCE_IN_VM=1
#   FERROCE_VM_DEVS="rxe0 rxe1"          FERROCE_VM_NETDEVS="vethA vethB"
#   FERROCE_VM_IPS="198.18.0.1 198.18.0.2"
#   FERROCE_VM_GIDX="<rxe0 idx> <rxe1 idx>"  (the RoCE v2 GID ::ffff:198.18.0.N)
#   FERROCE_VM_RANKS=0                   FERROCE_VM_BRIDGE=""
#   FERROCE_VM_MTU=<netdev MTU>
# or, with FERROCE_VM_RANKS=N (2..8), one entry per rank i = 0..N-1:
#   FERROCE_VM_DEVS="rxe0 ... rxe<N-1>"  FERROCE_VM_NETDEVS="vethR0 ... vethR<N-1>"
#   FERROCE_VM_IPS="198.18.0.1 ... 198.18.0.<N>"
#   FERROCE_VM_GIDX="<rxe0 idx> ... <rxe<N-1> idx>"
#   FERROCE_VM_RANKS=N                   FERROCE_VM_BRIDGE=br0
# (the device variables only with FERROCE_VM_RXE=1, the default)
# with RLIMIT_MEMLOCK unlimited and RLIMIT_NOFILE 65536, stdin /dev/null, and
# stdout/stderr streamed back separately.
#
# Exit status: the command's own; 124 if FERROCE_VM_TIMEOUT ran out; 125 if
# the VM or the harness failed (the command did not run, or its result is
# unknown: the setup error and the console tail are printed); 129/130/143 if
# this script got SIGHUP/SIGINT/SIGTERM. Nothing is left behind in any case.
#
# Knobs (environment):
#   FERROCE_VM_TIMEOUT  seconds for the whole QEMU run (default 1200; 0: none)
#   FERROCE_VM_MTU      veth MTU (default 1500; rxe active_mtu 1024, 4096 at 9000)
#   FERROCE_VM_MEM      guest MiB (default 2048)
#   FERROCE_VM_SMP      guest vCPUs (default 2)
#   FERROCE_VM_ACCEL    tcg|kvm (default: kvm only if /dev/kvm is writable and
#                       kvm_intel/kvm_amd is loaded; a kvm_pvm /dev/kvm cannot
#                       boot a stock kernel)
#   FERROCE_VM_KERNEL   kernel version to boot (default: newest usable)
#   FERROCE_VM_RXE      0 to skip the rxe/veth setup (default 1)
#   FERROCE_VM_RANKS    0: the veth pair above (default); N in 2..8: N ranks,
#                       rank i's rxe<i> on vethR<i> (198.18.0.<i+1>/24), whose
#                       peer vethR<i>b is a port of bridge br0 (no STP, no
#                       forwarding delay, no IPv6; arp_ignore=1 and
#                       arp_announce=2 so each address is answered by its own
#                       vethR only). Only RoCE crosses br0: TCP between ranks
#                       (perftest's handshake, a plugin's setup socket) goes
#                       over lo, as every address is local. FERROCE_VM_MTU
#                       applies to every veth end and br0.
#   FERROCE_VM_SHARES   extra host directories to share read-write, ':'-separated
#   FERROCE_VM_CACHE    cache of the ELF vmlinux and initramfs
#                       (default /var/cache/ferroce-vm)
#   FERROCE_VM_RUNS     parent of the per-run directories (default /tmp/ferroce-vm)
#   FERROCE_VM_KEEP     1 to keep the run directory (console.log, qemu.log)
#   FERROCE_VM_QUIET    1 to drop the informational "vm:" lines (errors stay)
#
# Timing on the 2-core TCG dev machine: about 6-7 s from launch to command
# (also with FERROCE_VM_RANKS=8, whose ip/rdma commands run in batches);
# budget 20 s per boot when two VMs share the cores.
set -euo pipefail

main() {
    T0=$(now_ns)
    case ${1:-} in
        "") die "usage: ci/vm.sh COMMAND... (see the header of $0)" ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    esac

    CI_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
    REPO=$(cd "$CI_DIR/.." && pwd -P)
    TIMEOUT_S=$(uint FERROCE_VM_TIMEOUT 1200)
    MTU=$(uint FERROCE_VM_MTU 1500)
    MEM=$(uint FERROCE_VM_MEM 2048)
    SMP=$(uint FERROCE_VM_SMP 2)
    RXE=${FERROCE_VM_RXE:-1}
    [[ $RXE == [01] ]] || die "FERROCE_VM_RXE must be 0 or 1, not '$RXE'"
    RANKS=${FERROCE_VM_RANKS:-0}
    [[ $RANKS == 0 || $RANKS == [2-8] ]] ||
        die "FERROCE_VM_RANKS must be 0 (the rxe0/rxe1 pair) or a rank count 2..8, not '$RANKS'"
    [[ $RANKS == 0 || $RXE == 1 ]] || die "FERROCE_VM_RANKS=$RANKS needs the rxe setup (FERROCE_VM_RXE=1)"
    QUIET=${FERROCE_VM_QUIET:-0}

    # Everything the EXIT trap may have to undo, set before it can fire.
    RUN="" QEMU_PID="" READER_PIDS=() BUILD_TMP=()
    trap cleanup EXIT
    trap 'exit 129' HUP
    trap 'exit 130' INT
    trap 'exit 143' TERM

    pick_accel
    pick_kernel
    open_cache
    prepare_kernel_image
    prepare_initramfs
    exec {LOCK_FD}>&- # the cache is consistent now; let other runs in

    make_run_dir "$@"
    launch
    report
}

pick_accel() {
    case ${FERROCE_VM_ACCEL:-} in
        tcg | kvm) ACCEL=$FERROCE_VM_ACCEL ;;
        "")
            # kvm_pvm also provides a writable /dev/kvm, but only runs
            # PVM-enlightened guests: a stock kernel hangs silently there.
            if [[ -w /dev/kvm ]] && [[ -e /sys/module/kvm_intel || -e /sys/module/kvm_amd ]]; then
                ACCEL=kvm
            else
                ACCEL=tcg
            fi
            ;;
        *) die "FERROCE_VM_ACCEL must be tcg or kvm, not '$FERROCE_VM_ACCEL'" ;;
    esac
    if [[ $ACCEL == kvm ]]; then
        ACCEL_ARGS=(-accel kvm -cpu host)
    else
        # Multi-threaded TCG gives each vCPU a host thread, so an rxe requester
        # and responder each get a core; a big translation cache avoids
        # retranslating the kernel's hot paths.
        # shellcheck disable=SC2054 # commas inside one QEMU option value
        ACCEL_ARGS=(-accel tcg,thread=multi,tb-size=512 -cpu max)
    fi
}

pick_kernel() {
    local v
    KVER=""
    if [[ -n ${FERROCE_VM_KERNEL:-} ]]; then
        usable_kernel "$FERROCE_VM_KERNEL" ||
            die "FERROCE_VM_KERNEL=$FERROCE_VM_KERNEL: need /boot/vmlinuz-<ver> and rdma_rxe.ko* in /lib/modules/<ver>"
        KVER=$FERROCE_VM_KERNEL
        return
    fi
    # The host's own running kernel usually has no vmlinuz here (or no rxe),
    # so this picks the linux-image-amd64 one.
    for v in $(printf '%s\n' /lib/modules/* | sed 's|.*/||' | sort -V); do
        if usable_kernel "$v"; then KVER=$v; fi
    done
    [[ -n $KVER ]] ||
        die "no kernel with rdma_rxe and /boot/vmlinuz-<ver> found; run ci/install.sh (linux-image-amd64)"
}

usable_kernel() {
    [[ -r /boot/vmlinuz-$1 ]] &&
        compgen -G "/lib/modules/$1/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*" >/dev/null
}

# Take the cache lock (held until both images are in place). Runs on one
# machine share the cache; the lock makes the first one build and the others
# wait for it instead of racing on half-written files.
open_cache() {
    CACHE=${FERROCE_VM_CACHE:-/var/cache/ferroce-vm}
    if ! mkdir -p "$CACHE" 2>/dev/null || [[ ! -w $CACHE ]]; then
        [[ -z ${FERROCE_VM_CACHE:-} ]] || die "cache directory $CACHE is not writable"
        CACHE=${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ferroce-vm
        mkdir -p "$CACHE" || die "cannot create cache directory $CACHE"
    fi
    exec {LOCK_FD}>>"$CACHE/lock"
    flock -w 900 "$LOCK_FD" || die "timed out waiting for the cache lock $CACHE/lock"
    # Entries unused for two weeks belong to kernels or scripts long gone.
    find "$CACHE" -maxdepth 1 -type f \( -name 'vmlinux-*' -o -name 'initramfs-*' \) \
        -mtime +14 -delete 2>/dev/null || true
}

# Booting the compressed bzImage under TCG spends ~3 s per boot in the xz
# decompressor. Extract the ELF vmlinux once (QEMU boots it through its PVH
# entry point) and cache it; fall back to the bzImage if that fails.
prepare_kernel_image() {
    local vmlinuz=/boot/vmlinuz-$KVER sum elf tmp off t
    sum=$(sha256sum <"$vmlinuz")
    elf=$CACHE/vmlinux-$KVER-${sum:0:16}
    KERNEL_IMG=$vmlinuz
    if [[ -s $elf ]]; then
        KERNEL_IMG=$elf
        touch "$elf"
        return
    fi
    [[ -e $elf.failed ]] && return # tried before; do not pay for it every run

    t=$(now_ns)
    tmp=$elf.tmp.$$
    BUILD_TMP+=("$tmp")
    # The xz stream sits somewhere inside the bzImage; its magic may also
    # occur by chance, so try each candidate until one decompresses to an ELF.
    for off in $(LC_ALL=C grep -aboP '\xfd\x37\x7a\x58\x5a\x00' "$vmlinuz" | cut -d: -f1 || true); do
        # xz must succeed (a corrupt stream could still start with an ELF
        # header); tail dying of SIGPIPE after the stream's end is expected.
        if xz -dc --single-stream <(tail -c +$((off + 1)) "$vmlinuz") >"$tmp" 2>/dev/null &&
            [[ $(head -c 4 "$tmp" | od -An -tx1 | tr -d ' \n') == 7f454c46 ]]; then
            mv -f "$tmp" "$elf"
            KERNEL_IMG=$elf
            info "cached ELF vmlinux for $KVER in $(secs $(($(now_ns) - t)))s: $elf"
            return
        fi
    done
    rm -f "$tmp"
    : >"$elf.failed"
    info "warning: no ELF vmlinux found inside $vmlinuz; booting the bzImage (about 3 s slower)"
}

# The initramfs holds only what it takes to reach the host's root over 9p:
# busybox, stage 1 and the virtio/9p/overlay modules. It is cached under a hash
# of everything that goes into it, so editing ci/guest/init rebuilds it.
prepare_initramfs() {
    local mods=() m kind path out key dir i name t
    for m in virtio_pci virtio_console 9pnet_virtio 9p overlay; do
        out=$(modprobe -S "$KVER" --show-depends "$m") || die "modprobe -S $KVER --show-depends $m failed"
        while read -r kind path _; do
            [[ $kind == insmod ]] || continue # "builtin ..." needs nothing
            [[ " ${mods[*]} " == *" $path "* ]] || mods+=("$path")
        done <<<"$out"
    done

    # Contents (and module names), not paths: two checkouts share an entry.
    key=$({
        echo "ferroce initramfs v1 $KVER ${mods[*]##*/}"
        cat "$CI_DIR/guest/init" /bin/busybox "${mods[@]}"
    } | sha256sum)
    INITRD=$CACHE/initramfs-$KVER-${key:0:16}.cpio.gz
    if [[ -s $INITRD ]]; then
        touch "$INITRD"
        return
    fi

    t=$(now_ns)
    dir=$(mktemp -d "$CACHE/build.XXXXXX")
    BUILD_TMP+=("$dir" "$INITRD.tmp.$$")
    mkdir -p "$dir/bin" "$dir/modules" "$dir/proc" "$dir/sys" "$dir/dev"
    cp /bin/busybox "$dir/bin/busybox"
    install -m 755 "$CI_DIR/guest/init" "$dir/init"
    : >"$dir/modules.order"
    i=0
    for path in "${mods[@]}"; do
        # busybox insmod takes plain .ko files only.
        name=$(printf '%02d-%s' "$i" "$(basename "$path")")
        case $path in
            *.ko.xz) xz -dc "$path" >"$dir/modules/${name%.xz}"; name=${name%.xz} ;;
            *.ko.zst) zstd -qdc "$path" >"$dir/modules/${name%.zst}"; name=${name%.zst} ;;
            *.ko.gz) gzip -dc "$path" >"$dir/modules/${name%.gz}"; name=${name%.gz} ;;
            *) cp "$path" "$dir/modules/$name" ;;
        esac
        echo "$name" >>"$dir/modules.order"
        i=$((i + 1))
    done
    (cd "$dir" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet | gzip -1) >"$INITRD.tmp.$$"
    mv -f "$INITRD.tmp.$$" "$INITRD"
    rm -rf "$dir"
    info "cached initramfs ($i modules) in $(secs $(($(now_ns) - t)))s: $INITRD"
}

make_run_dir() {
    RUNS=${FERROCE_VM_RUNS:-/tmp/ferroce-vm}
    if [[ ! -d $RUNS ]]; then
        # Sticky and world-writable like /tmp: several users' runs may share it.
        if ! mkdir -p "$RUNS" || ! chmod 1777 "$RUNS"; then die "cannot create $RUNS"; fi
    fi
    RUNS=$(cd "$RUNS" && pwd -P)
    check_path "$RUNS"
    # Leftovers of runs that were SIGKILLed (no EXIT trap); a day is far
    # beyond any sane FERROCE_VM_TIMEOUT.
    find "$RUNS" -mindepth 1 -maxdepth 1 -type d -name 'run.*' -mmin +1440 \
        -exec rm -rf {} + 2>/dev/null || true
    RUN=$(mktemp -d "$RUNS/run.XXXXXX")

    if [[ $# -eq 1 ]]; then
        printf '%s' "$1" >"$RUN/cmd"
    else
        printf '%q ' "$@" >"$RUN/cmd"
    fi
    CWD=$(pwd -P)
    printf '%s' "$CWD" >"$RUN/cwd"
    write_env >"$RUN/env"
    # A private copy per run: editing ci/guest/stage2.sh while a VM runs must
    # not change the script under that VM's bash (which reads it lazily).
    cp "$CI_DIR/guest/stage2.sh" "$RUN/stage2.sh"
    mkfifo "$RUN/out.fifo" "$RUN/err.fifo"

    # Shared read-write at their host paths. A directory inside another shared
    # one is covered by it; "/" is never shared (the host root stays read-only).
    local cands=("$REPO" "$CWD" "$RUNS") p q keep extra
    if [[ -n ${FERROCE_VM_SHARES:-} ]]; then
        IFS=: read -r -a extra <<<"$FERROCE_VM_SHARES"
        for p in "${extra[@]}"; do
            [[ -n $p ]] || continue
            [[ -d $p ]] || die "FERROCE_VM_SHARES: $p is not a directory"
            cands+=("$(cd "$p" && pwd -P)")
        done
    fi
    SHARES=()
    while read -r p; do
        [[ $p != / ]] || continue
        check_path "$p"
        keep=1
        for q in "${SHARES[@]}"; do
            [[ $p == "$q" || $p == "$q"/* ]] && keep=0
        done
        [[ $keep == 0 ]] || SHARES+=("$p")
    done < <(printf '%s\n' "${cands[@]}" | awk '{ print length($0) "\t" $0 }' | sort -n -k1,1 | cut -f2-)
}

# Exported variables, re-exported by the guest before the command runs.
# Session- and terminal-bound ones would only mislead inside the VM; read-only
# ones (EUID, PPID, ...) cannot be assigned by the guest's bash.
write_env() {
    local name
    for name in $(compgen -e); do
        case $name in
            PWD | OLDPWD | SHLVL | _ | TERM | TERMCAP | COLUMNS | LINES | SHELLOPTS | BASHOPTS | BASH_* | \
                SSH_* | DISPLAY | XAUTHORITY | WINDOWID | TMUX | TMUX_PANE | STY | XDG_RUNTIME_DIR | \
                DBUS_SESSION_BUS_ADDRESS | INVOCATION_ID | JOURNAL_STREAM | NOTIFY_SOCKET | LISTEN_* | \
                FERROCE_IN_VM)
                continue
                ;;
        esac
        [[ -v $name && ${!name@a} != *r* ]] || continue
        printf 'export %s=%q\n' "$name" "${!name}"
    done
}

launch() {
    local append i virtfs=()
    for i in "${!SHARES[@]}"; do
        virtfs+=(-virtfs "local,path=${SHARES[i]},mount_tag=share$i,security_model=none,multidevs=remap")
        append+="${append:+,}share$i=${SHARES[i]}"
    done
    append="console=ttyS0 loglevel=5 panic=-1 oops=panic softlockup_panic=1 nokaslr mitigations=off \
ferroce.run=$RUN ferroce.shares=$append ferroce.mtu=$MTU ferroce.rxe=$RXE ferroce.ranks=$RANKS"

    # The readers must exist before QEMU opens the FIFOs for writing (that
    # open blocks until there is a reader), and must outlive QEMU: once a FIFO
    # has no reader, QEMU throttles the port for good, the guest blocks in
    # write() and the run hangs (spinning) until the timeout. So no plain cat:
    # with `ci/vm.sh ... | head` it would die of SIGPIPE. tee -p drops a broken
    # pipe but keeps copying into /dev/null until EOF.
    tee -p /dev/null <"$RUN/out.fifo" &
    READER_PIDS+=($!)
    tee -p /dev/null <"$RUN/err.fifo" >&2 &
    READER_PIDS+=($!)

    T_LAUNCH=$(now_ns)
    # virtserialports, not a second serial line: they are not ttys, so
    # nothing rewrites LF as CRLF, and stdout and stderr stay separate.
    timeout -k 10 "$TIMEOUT_S" qemu-system-x86_64 \
        "${ACCEL_ARGS[@]}" -M pc -m "$MEM" -smp "$SMP" \
        -nodefaults -no-user-config -display none -no-reboot -nic none \
        -kernel "$KERNEL_IMG" -initrd "$INITRD" -append "$append" \
        -serial "file:$RUN/console.log" \
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
        "${virtfs[@]}" \
        -device virtio-serial-pci \
        -chardev "file,id=out,path=$RUN/out.fifo" -device virtserialport,chardev=out,name=ferroce.out \
        -chardev "file,id=err,path=$RUN/err.fifo" -device virtserialport,chardev=err,name=ferroce.err \
        </dev/null >"$RUN/qemu.log" 2>&1 &
    QEMU_PID=$!
    # wait (unlike a foreground command) returns as soon as a trapped signal
    # arrives, so INT/TERM take effect at once.
    QEMU_RC=0
    wait "$QEMU_PID" || QEMU_RC=$?
    QEMU_PID=""
    T_END=$(now_ns)

    # If QEMU died before opening a FIFO, its reader still blocks in open().
    # Opening read-write never blocks and counts as a writer, so closing it
    # again hands the reader its EOF; data already in the pipe is read first.
    : <>"$RUN/out.fifo"
    : <>"$RUN/err.fifo"
    wait "${READER_PIDS[@]}" || true
    READER_PIDS=()
}

report() {
    local rc boot="" started
    if [[ -e $RUN/started ]]; then
        started=$(stat -c %.9Y "$RUN/started")
        boot=$(secs $((${started/./} - T_LAUNCH)))
    fi
    info "accel=$ACCEL kernel=$KVER boot=${boot:-n/a}${boot:+s} (launch to command)"

    if [[ -s $RUN/rc ]]; then
        rc=$(<"$RUN/rc")
        [[ $rc =~ ^[0-9]+$ ]] || harness_failure "the guest wrote a bad rc: '$rc'"
        info "exit=$rc wall=$(secs $((T_END - T0)))s"
        exit "$rc"
    fi
    if [[ $QEMU_RC == 124 || $QEMU_RC == 137 ]]; then
        echo "vm: TIMEOUT: the VM ran longer than FERROCE_VM_TIMEOUT=${TIMEOUT_S}s; last console lines:" >&2
        console_tail
        echo "vm: exit=124 wall=$(secs $((T_END - T0)))s" >&2
        exit 124
    fi
    if [[ -s $RUN/setup-error ]]; then
        harness_failure "setup error: $(<"$RUN/setup-error")"
    fi
    harness_failure "the VM stopped without a result (qemu exit $QEMU_RC)"
}

harness_failure() {
    {
        echo "vm: FAILED to run the command: $*"
        if [[ -s $RUN/qemu.log ]]; then
            echo "vm: qemu said:"
            sed 's/^/vm| /' "$RUN/qemu.log"
        fi
        echo "vm: last console lines:"
    } >&2
    console_tail
    echo "vm: exit=125 wall=$(secs $(($(now_ns) - T0)))s" >&2
    exit 125
}

console_tail() {
    if [[ -s $RUN/console.log ]]; then
        tail -n 60 "$RUN/console.log" | tr -d '\r' | sed 's/^/vm| /' >&2
    else
        echo "vm| (no console output)" >&2
    fi
}

# shellcheck disable=SC2317 # called through trap
cleanup() {
    local rc=$? pid i state
    set +e
    trap '' HUP INT TERM
    if [[ -n $QEMU_PID ]]; then
        # timeout(1) forwards TERM to QEMU and exits once QEMU is gone. If that
        # takes over 5 s, kill timeout's whole process group (it made one).
        # Until we reap it, an exited child is a zombie, hence the state check.
        kill -TERM "$QEMU_PID" 2>/dev/null
        for ((i = 0; i < 50; i++)); do
            state=Z
            read -r _ _ state _ 2>/dev/null <"/proc/$QEMU_PID/stat"
            [[ $state == Z ]] && break
            sleep 0.1
        done
        [[ $state == Z ]] || kill -KILL -- -"$QEMU_PID" "$QEMU_PID" 2>/dev/null
        wait "$QEMU_PID" 2>/dev/null
    fi
    for pid in "${READER_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    rm -rf "${BUILD_TMP[@]}"
    if [[ -n $RUN ]]; then
        if [[ ${FERROCE_VM_KEEP:-0} == 1 ]]; then
            echo "vm: kept the run directory $RUN" >&2
        else
            rm -rf "$RUN"
        fi
    fi
    exit "$rc"
}

# The guest gets paths on its kernel command line (blank-separated words) and
# in "tag=path,..." lists, and QEMU option values treat ',' specially.
check_path() {
    [[ $1 =~ ^/[A-Za-z0-9._/@+-]*$ ]] ||
        die "path '$1' has characters the VM cannot pass on (only A-Z a-z 0-9 . _ / @ + -)"
}

uint() {
    local v=${!1:-$2}
    [[ $v =~ ^[0-9]+$ ]] || die "$1 must be a non-negative integer, not '$v'"
    echo "$v"
}

now_ns() { date +%s%N; }

secs() { printf '%d.%d' $(($1 / 1000000000)) $(($1 / 100000000 % 10)); }

info() { [[ $QUIET == 1 ]] || echo "vm: $*" >&2; }

die() {
    echo "vm: $*" >&2
    exit 125
}

main "$@"
