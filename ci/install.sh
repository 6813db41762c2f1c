#!/usr/bin/env bash
# Install the host packages that the Soft-RoCE test VM (ci/vm.sh) and the Rust
# build need. CI runs this on every run, so it must be idempotent and cheap when
# nothing is missing: it only touches apt when dpkg says a package is absent.
#
# Never add qemu-utils here: a preinstalled backports qemu-utils conflicts with
# Debian 12's qemu-system-common, and apt resolves that by removing packages.
# ci/vm.sh needs nothing from it.
set -euo pipefail

main() {
    if [[ $(id -u) -ne 0 ]]; then
        echo "install.sh: must run as root (apt-get install)" >&2
        exit 1
    fi

    local pkgs=(
        # The VM: a stock Debian kernel with rdma_rxe (only its vmlinuz and
        # module tree are used; the host keeps running its own kernel), qemu,
        # and busybox for the initramfs.
        linux-image-amd64 qemu-system-x86 busybox-static kmod cpio xz-utils
        # Userspace verbs, RDMA CM and the tools the tests run inside the VM;
        # iproute2 provides `rdma link add`.
        rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev
        rdmacm-utils perftest tcpdump iproute2
        # The Rust build: bindgen needs libclang, rdma-sys finds verbs via pkg-config.
        clang libclang-dev pkg-config
        # The test-only dma-buf stand-in (tests/dmabuf_standin.c) is plain C.
        gcc libc6-dev
    )

    local missing=() p
    for p in "${pkgs[@]}"; do
        # dpkg-query also knows removed-but-configured packages, so check the
        # status (want "install ok installed", or "hold ...") not its exit code.
        if [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) != *" ok installed" ]]; then
            missing+=("$p")
        fi
    done

    if [[ ${#missing[@]} -eq 0 ]]; then
        echo "install.sh: all ${#pkgs[@]} packages already installed"
        return 0
    fi

    echo "install.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

main "$@"
