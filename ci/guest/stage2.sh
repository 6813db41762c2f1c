#!/bin/bash
# Stage 2 of the ferroce test VM: PID 1 after switch_root, running the host's
# bash on the overlay root that stage 1 (ci/guest/init) built.
#
#   stage2.sh RUN_DIR MTU RXE
#
# It brings up two Soft-RoCE devices that talk RoCEv2 to each other through a
# veth pair (rxe0 on vethA 198.18.0.1, rxe1 on vethB 198.18.0.2), runs the
# command that ci/vm.sh left in RUN_DIR with its stdout/stderr on two
# virtio-serial ports, writes the exit code to RUN_DIR/rc and powers off.
# If the devices cannot be set up it writes RUN_DIR/setup-error instead.
#
# Why one network namespace: rxe on 6.1 hard-codes init_net for its route
# lookup and its UDP/4791 sockets, so namespaces do not work. rxe routes with
# the oif set to its own netdev, so the packets really cross the veth pair; the
# receiver then sees a local source address, which is why rp_filter is off and
# accept_local is on (otherwise: martians, and ARP fails).
#
# ci/vm.sh copies this file into the run directory for every run, and all of
# the code sits in main(): bash reads a script lazily while running it, so an
# edit of the source during a run, or the 9p root going away during power-off,
# must not be able to feed it new lines.

main() {
    set -u
    local run=$1 mtu=$2 rxe=$3
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    export HOME=/root LANG=C.UTF-8

    # /run first: the FIFO there is what power_off and the polls wait on with
    # the read builtin, without forking a sleep.
    mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
    mkfifo -m 600 /run/ferroce-wait

    log "start"
    SETUP_ERROR=""
    if setup "$mtu" "$rxe"; then
        log "ready"
        run_command "$run" "$mtu" "$rxe"
    else
        log "setup error: $SETUP_ERROR"
        printf '%s\n' "$SETUP_ERROR" >"$run/setup-error.tmp" && mv -f "$run/setup-error.tmp" "$run/setup-error"
    fi
    power_off
}

setup() {
    local mtu=$1 rxe=$2

    mkdir -p /dev/pts /dev/shm
    mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
    ln -sfn /proc/self/fd /dev/fd
    ln -sfn /proc/self/fd/0 /dev/stdin
    ln -sfn /proc/self/fd/1 /dev/stdout
    ln -sfn /proc/self/fd/2 /dev/stderr
    # Borrow the host's name: the host's /etc/hosts (visible through the
    # overlay) usually resolves it, which gethostname()+lookup callers expect.
    local name=""
    [[ -r /etc/hostname ]] && read -r name </etc/hostname
    [[ -n $name ]] && echo "$name" >/proc/sys/kernel/hostname
    step "ip link set lo up" ip link set lo up || return 1

    # Memory registration pins pages against RLIMIT_MEMLOCK; NCCL-style tests
    # also open many fds (QPs, CQs, sockets).
    ulimit -l unlimited || { SETUP_ERROR="ulimit -l unlimited failed"; return 1; }
    ulimit -n 65536 || { SETUP_ERROR="ulimit -n 65536 failed"; return 1; }

    # Our output ports, by name: their /dev/vportNpM numbering is not ours to rely on.
    local d port
    OUT_PORT="" ERR_PORT=""
    for d in /sys/class/virtio-ports/vport*; do
        [[ -r $d/name ]] || continue
        read -r port <"$d/name"
        case $port in
            ferroce.out) OUT_PORT=/dev/${d##*/} ;;
            ferroce.err) ERR_PORT=/dev/${d##*/} ;;
        esac
    done
    if [[ -z $OUT_PORT || -z $ERR_PORT ]]; then
        SETUP_ERROR="virtio-serial ports ferroce.out/ferroce.err not found"
        return 1
    fi

    [[ $rxe == 1 ]] || return 0

    step "modprobe rdma_rxe ib_uverbs rdma_ucm veth" modprobe -a rdma_rxe ib_uverbs rdma_ucm veth || return 1
    step "ip link add vethA type veth peer name vethB" ip link add vethA type veth peer name vethB || return 1
    step "mtu $mtu on vethA" ip link set vethA mtu "$mtu" || return 1
    step "mtu $mtu on vethB" ip link set vethB mtu "$mtu" || return 1
    local k
    for k in all default vethA vethB; do
        if ! echo 0 >"/proc/sys/net/ipv4/conf/$k/rp_filter" ||
            ! echo 1 >"/proc/sys/net/ipv4/conf/$k/accept_local"; then
            SETUP_ERROR="sysctl rp_filter/accept_local for $k failed"
            return 1
        fi
    done
    step "198.18.0.1/24 on vethA" ip addr add 198.18.0.1/24 dev vethA || return 1
    step "198.18.0.2/24 on vethB" ip addr add 198.18.0.2/24 dev vethB || return 1
    step "vethA up" ip link set vethA up || return 1
    step "vethB up" ip link set vethB up || return 1
    step "rdma link add rxe0" rdma link add rxe0 type rxe netdev vethA || return 1
    step "rdma link add rxe1" rdma link add rxe1 type rxe netdev vethB || return 1

    # The port goes ACTIVE and the IPv4 GID appears asynchronously (netdev
    # events). Poll every 50 ms for at most 10 s.
    local i
    GIDX0="" GIDX1=""
    for ((i = 0; i < 200; i++)); do
        [[ -z $GIDX0 ]] && GIDX0=$(roce_v2_gid rxe0 1)
        [[ -z $GIDX1 ]] && GIDX1=$(roce_v2_gid rxe1 2)
        [[ -n $GIDX0 && -n $GIDX1 ]] && return 0
        read -r -t 0.05 <>/run/ferroce-wait
    done
    SETUP_ERROR="rxe0/rxe1 not ACTIVE with a RoCE v2 GID for 198.18.0.1/2 after 10 s:"
    SETUP_ERROR+=" rxe0 state=$(cat /sys/class/infiniband/rxe0/ports/1/state 2>&1) gid=${GIDX0:-none},"
    SETUP_ERROR+=" rxe1 state=$(cat /sys/class/infiniband/rxe1/ports/1/state 2>&1) gid=${GIDX1:-none}"
    return 1
}

# roce_v2_gid DEV N: print the GID index of ::ffff:198.18.0.N with type
# "RoCE v2" if DEV's port 1 is ACTIVE; print nothing otherwise. It was index 1
# on every boot so far, but that is the kernel's choice, not a contract.
roce_v2_gid() {
    local p=/sys/class/infiniband/$1/ports/1 want state gid type i
    printf -v want '0000:0000:0000:0000:0000:ffff:c612:%04x' "$2"
    state=""
    read -r state 2>/dev/null <"$p/state"
    [[ $state == *ACTIVE* ]] || return 0
    for ((i = 0; ; i++)); do
        [[ -e $p/gids/$i ]] || return 0
        read -r gid 2>/dev/null <"$p/gids/$i" || continue
        [[ $gid == "$want" ]] || continue
        # Unused entries make this read fail with EINVAL, hence the 2>/dev/null.
        type=""
        read -r type 2>/dev/null <"$p/gid_attrs/types/$i"
        if [[ $type == "RoCE v2" ]]; then
            echo "$i"
            return 0
        fi
    done
}

run_command() {
    local run=$1 mtu=$2 rxe=$3 cmd="" cwd="" rc
    # read -d '' keeps the command byte for byte (newlines included); it
    # returns 1 at end of file, which is expected here.
    IFS= read -r -d '' cmd <"$run/cmd"
    IFS= read -r -d '' cwd <"$run/cwd"
    cwd=${cwd%$'\n'}

    # Its mtime (set by the host's clock over 9p) is ci/vm.sh's "boot" time.
    touch "$run/started"
    (
        exec </dev/null >"$OUT_PORT" 2>"$ERR_PORT"
        set +u
        # The caller's environment first, then ours, so ours wins.
        # shellcheck disable=SC1091
        . "$run/env"
        export FERROCE_IN_VM=1 FERROCE_VM_MTU="$mtu"
        if [[ $rxe == 1 ]]; then
            export FERROCE_VM_DEVS="rxe0 rxe1" FERROCE_VM_NETDEVS="vethA vethB"
            export FERROCE_VM_IPS="198.18.0.1 198.18.0.2" FERROCE_VM_GIDX="$GIDX0 $GIDX1"
        fi
        cd -- "$cwd" || {
            echo "ferroce-vm: cannot cd to $cwd in the guest" >&2
            exit 125
        }
        exec bash -c "$cmd"
    )
    rc=$?
    log "command exited with $rc"
    echo "$rc" >"$run/rc.tmp" && mv -f "$run/rc.tmp" "$run/rc"
}

# step DESCRIPTION COMMAND...: run COMMAND; on failure keep its output in
# SETUP_ERROR so that ci/vm.sh can say exactly what went wrong.
step() {
    local what=$1 out
    shift
    if ! out=$("$@" 2>&1); then
        SETUP_ERROR="$what: ${out:-failed}"
        return 1
    fi
}

log() {
    local up
    read -r up _ </proc/uptime
    echo "ferroce-vm stage2 [${up}s]: $*"
}

power_off() {
    # sync is the last exec: once sysrq 'o' runs, the 9p root (bash's own
    # binary, any external command) may vanish under us. Give QEMU ~0.2 s to
    # drain the virtio-serial queues, then wait with builtins only. If PID 1
    # returned instead, the kernel would panic (panic=-1 reboots, and QEMU's
    # -no-reboot turns that into an exit too, but with a noisy console).
    sync
    read -r -t 0.2 <>/run/ferroce-wait
    echo o >/proc/sysrq-trigger
    while :; do
        read -r -t 60 <>/run/ferroce-wait
    done
}

main "$@"
