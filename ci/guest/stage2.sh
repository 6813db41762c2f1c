#!/bin/bash
# Stage 2 of the ferroce test VM: PID 1 after switch_root, running the host's
# bash on the overlay root that stage 1 (ci/guest/init) built.
#
#   stage2.sh RUN_DIR MTU RXE      (and ferroce.ranks=N on the kernel command line)
#
# It brings up Soft-RoCE devices that talk RoCEv2 to each other: with N=0 two
# of them through a veth pair (rxe0 on vethA 198.18.0.1, rxe1 on vethB
# 198.18.0.2); with N in 2..8 one per rank, rxe<i> on vethR<i> 198.18.0.<i+1>,
# each veth's peer vethR<i>b a port of the bridge br0. Then it runs the
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
    local run=$1 mtu=$2 rxe=$3 ranks=0 word
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    export HOME=/root LANG=C.UTF-8

    # /run first: the FIFO there is what power_off and the polls wait on with
    # the read builtin, without forking a sleep.
    mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
    mkfifo -m 600 /run/ferroce-wait

    # Stage 1 passes on only what it has always passed; the rank count is
    # read here from the same kernel command line.
    for word in $(</proc/cmdline); do
        case $word in ferroce.ranks=*) ranks=${word#*=} ;; esac
    done

    log "start"
    SETUP_ERROR=""
    if setup "$mtu" "$rxe" "$ranks"; then
        log "ready"
        run_command "$run" "$mtu" "$rxe" "$ranks"
    else
        log "setup error: $SETUP_ERROR"
        printf '%s\n' "$SETUP_ERROR" >"$run/setup-error.tmp" && mv -f "$run/setup-error.tmp" "$run/setup-error"
    fi
    power_off
}

setup() {
    local mtu=$1 rxe=$2 ranks=$3

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
    # The first clsact qdisc of the system switches on the kernel's ingress and
    # egress static keys, which patches the code of the receive path (int3,
    # then IPIs). Under TCG, a vCPU then busy in that path can spin on the
    # patch site for good: the tests that add a clsact to a veth under load
    # locked the guest up (soft lockup in __netif_receive_skb_core). One
    # filterless clsact on lo, before any traffic, keeps both keys on for the
    # whole run, so the tests' own qdiscs never patch code.
    step "tc qdisc add dev lo clsact" tc qdisc add dev lo clsact || return 1

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

    local i
    if [[ $ranks == 0 ]]; then
        setup_pair "$mtu" || return 1
    elif [[ $ranks == [2-8] ]]; then
        setup_bridge "$mtu" "$ranks" || return 1
    else
        SETUP_ERROR="ferroce.ranks=$ranks: not 0 or 2..8"
        return 1
    fi

    # The ports go ACTIVE and the IPv4 GIDs appear asynchronously (netdev
    # events). Poll every 50 ms for at most 10 s, by the clock: a round of
    # polls can take a while when a slow host slows the guest down.
    local end=$((SECONDS + 10))
    GIDX=()
    until all_gids; do
        if ((SECONDS >= end)); then
            SETUP_ERROR="after 10 s, still no ACTIVE port with the RoCE v2 GID of its IPv4 address on:"
            for i in "${!DEVS[@]}"; do
                [[ -n ${GIDX[i]} ]] && continue
                SETUP_ERROR+=" ${DEVS[i]} on ${NETDEVS[i]} (${IPS[i]}, port state $(cat "/sys/class/infiniband/${DEVS[i]}/ports/1/state" 2>&1));"
            done
            return 1
        fi
        read -r -t 0.05 <>/run/ferroce-wait
    done
}

# setup_pair MTU: rxe0 on vethA and rxe1 on vethB, the two ends of one veth pair.
setup_pair() {
    local mtu=$1
    DEVS=(rxe0 rxe1) NETDEVS=(vethA vethB) IPS=(198.18.0.1 198.18.0.2)
    step "modprobe rdma_rxe ib_uverbs rdma_ucm veth" modprobe -a rdma_rxe ib_uverbs rdma_ucm veth || return 1
    step "ip link add vethA type veth peer name vethB" ip link add vethA type veth peer name vethB || return 1
    step "mtu $mtu on vethA" ip link set vethA mtu "$mtu" || return 1
    step "mtu $mtu on vethB" ip link set vethB mtu "$mtu" || return 1
    ipv4_conf "rp_filter=0 accept_local=1" all default vethA vethB || return 1
    step "198.18.0.1/24 on vethA" ip addr add 198.18.0.1/24 dev vethA || return 1
    step "198.18.0.2/24 on vethB" ip addr add 198.18.0.2/24 dev vethB || return 1
    step "vethA up" ip link set vethA up || return 1
    step "vethB up" ip link set vethB up || return 1
    step "rdma link add rxe0" rdma link add rxe0 type rxe netdev vethA || return 1
    step "rdma link add rxe1" rdma link add rxe1 type rxe netdev vethB || return 1
}

# setup_bridge MTU N: one device per rank i < N, rxe<i> on vethR<i>
# (198.18.0.<i+1>), whose peer vethR<i>b is a port of br0: every rank reaches
# every other one through one switch. The ip and rdma commands go in batches:
# each exec from the 9p root costs 0.1-0.5 s under TCG, and 8 ranks need 60.
setup_bridge() {
    local mtu=$1 n=$2 i dev create="" configure="" rxe=""
    local sysctls="rp_filter=0 accept_local=1 arp_ignore=1 arp_announce=2"
    DEVS=() NETDEVS=() IPS=()
    for ((i = 0; i < n; i++)); do
        DEVS+=("rxe$i") NETDEVS+=("vethR$i") IPS+=("198.18.0.$((i + 1))")
    done
    step "modprobe rdma_rxe ib_uverbs rdma_ucm veth bridge" modprobe -a rdma_rxe ib_uverbs rdma_ucm veth bridge || return 1
    # All ranks' addresses are local to every vethR, and br0 floods ARP to all
    # of them: without arp_ignore/arp_announce each vethR answers for every
    # address, frames land on the wrong netdev and rxe drops them (retransmits
    # turned a ~1 ms pingpong iteration into ~250 ms).
    ipv4_conf "$sysctls" all default || return 1

    # No STP and no forwarding delay: the ports forward at once.
    create="link add br0 type bridge forward_delay 0 stp_state 0"
    for i in "${!DEVS[@]}"; do
        dev=${NETDEVS[i]}
        create+=$'\n'"link add $dev type veth peer name ${dev}b"
        configure+="link set $dev mtu $mtu"$'\n'"link set ${dev}b mtu $mtu master br0 up"$'\n'
        configure+="addr add ${IPS[i]}/24 dev $dev"$'\n'"link set $dev up"$'\n'
        rxe+="${rxe:+$'\n'}link add ${DEVS[i]} type rxe netdev $dev"
    done
    configure+="link set br0 mtu $mtu up"
    batch ip "$create" || return 1
    # Before anything is up: the bridge and its ports carry only the ranks'
    # IPv4 RoCE frames, nothing of their own.
    no_ipv6 br0 || return 1
    for dev in "${NETDEVS[@]}"; do
        no_ipv6 "${dev}b" || return 1
        ipv4_conf "$sysctls" "$dev" || return 1
    done
    batch ip "$configure" || return 1
    batch rdma "$rxe" || return 1
}

# batch ip|rdma COMMANDS: run the tool once for all COMMANDS (one a line); on
# failure SETUP_ERROR names the command that failed and quotes the tool.
batch() {
    local out cmds n=0
    out=$("$1" -b - 2>&1 <<<"$2") && return 0
    mapfile -t cmds <<<"$2"
    [[ $out =~ Command\ failed\ -:([0-9]+) ]] && n=${BASH_REMATCH[1]}
    if ((n > 0 && n <= ${#cmds[@]})); then
        SETUP_ERROR="$1 ${cmds[n - 1]}: ${out%%$'\n'Command failed*}"
    else
        SETUP_ERROR="$1 -b failed: ${out:-no output}"
    fi
    return 1
}

# ipv4_conf "KEY=VALUE ..." IFACE...: set net.ipv4.conf.IFACE.KEY for each.
ipv4_conf() {
    local kv k
    for k in "${@:2}"; do
        for kv in $1; do
            echo "${kv#*=}" >"/proc/sys/net/ipv4/conf/$k/${kv%%=*}" || {
                SETUP_ERROR="sysctl net.ipv4.conf.$k.$kv failed"
                return 1
            }
        done
    done
}

# no_ipv6 IFACE
no_ipv6() {
    echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6" || {
        SETUP_ERROR="disabling IPv6 on $1 failed"
        return 1
    }
}

# all_gids: fill in GIDX[i] for each device i that has its RoCE v2 GID now;
# succeed once every device has one.
all_gids() {
    local i ok=0
    for i in "${!DEVS[@]}"; do
        [[ -n ${GIDX[i]:-} ]] || GIDX[i]=$(roce_v2_gid "${DEVS[i]}" "${IPS[i]##*.}")
        [[ -n ${GIDX[i]} ]] || ok=1
    done
    return "$ok"
}

# roce_v2_gid DEV N: print the GID index of ::ffff:198.18.0.N with type
# "RoCE v2" if DEV's port 1 is ACTIVE; print nothing otherwise. It was index 1
# on every boot so far, but that is the kernel's choice, not a contract. The
# scan stops at the first empty entry: the kernel fills the table from the
# first free slot and nothing deletes an entry here, while a scan of all of
# rxe's 1024 entries takes about 2 s under TCG.
roce_v2_gid() {
    local p=/sys/class/infiniband/$1/ports/1 want state gid type i
    printf -v want '0000:0000:0000:0000:0000:ffff:c612:%04x' "$2"
    state=""
    read -r state 2>/dev/null <"$p/state"
    [[ $state == *ACTIVE* ]] || return 0
    for ((i = 0; ; i++)); do
        [[ -e $p/gids/$i ]] || return 0
        read -r gid 2>/dev/null <"$p/gids/$i" || continue
        [[ $gid == 0000:0000:0000:0000:0000:0000:0000:0000 ]] && return 0
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
    local run=$1 mtu=$2 rxe=$3 ranks=$4 cmd="" cwd="" rc
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
            export FERROCE_VM_DEVS="${DEVS[*]}" FERROCE_VM_NETDEVS="${NETDEVS[*]}"
            export FERROCE_VM_IPS="${IPS[*]}" FERROCE_VM_GIDX="${GIDX[*]}"
            export FERROCE_VM_RANKS="$ranks" FERROCE_VM_BRIDGE=""
            ((ranks == 0)) || FERROCE_VM_BRIDGE=br0
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
