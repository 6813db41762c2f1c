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
        # ci/test.sh and ci/bench.sh read cargo's JSON with it.
        python3
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
    else
        echo "install.sh: installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
    check_rust
}

# Debian 12's own rustc (1.63) predates edition 2024, so the toolchain comes from rustup; this
# checks it is there and new enough, and says exactly what to do when it is not.
check_rust() {
    local need=1.85 have
    local fix="install Rust >= $need with rustup (https://rustup.rs):
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
    . \"\$HOME/.cargo/env\""
    if ! command -v cargo >/dev/null || ! command -v rustc >/dev/null; then
        echo "install.sh: no Rust toolchain on PATH (if rustup installed one: . \"\$HOME/.cargo/env\"); $fix" >&2
        exit 1
    fi
    have=$(rustc --version | awk '{print $2}')
    if [[ $(printf '%s\n' "$need" "$have" | sort -V | head -n1) != "$need" ]]; then
        echo "install.sh: rustc $have is too old for edition 2024 (needs $need); rustup update stable, or $fix" >&2
        exit 1
    fi
    local c
    for c in fmt clippy; do
        if ! cargo "$c" --version >/dev/null 2>&1; then
            echo "install.sh: cargo $c is missing (ci/test.sh runs it): rustup component add ${c/fmt/rustfmt}" >&2
            exit 1
        fi
    done
    echo "install.sh: rustc $have (edition 2024 needs $need), cargo fmt and clippy present"
    check_nightly
}

# ci/sanitizers.sh needs a nightly toolchain with Miri and std's source (-Zbuild-std). It adds
# the components to the nightly already installed (no newer nightly is fetched when one is
# there), from rustup's own distribution server.
check_nightly() {
    if ! rustup run nightly rustc --version >/dev/null 2>&1; then
        echo "install.sh: installing a nightly toolchain for ci/sanitizers.sh"
        rustup toolchain install nightly --profile minimal
    fi
    if ! cargo +nightly miri --version >/dev/null 2>&1 ||
        [[ ! -d "$(rustc +nightly --print sysroot)/lib/rustlib/src/rust/library" ]]; then
        rustup component add --toolchain nightly rust-src miri
    fi
    echo "install.sh: $(rustc +nightly --version) with $(cargo +nightly miri --version) and rust-src"
}

main "$@"
