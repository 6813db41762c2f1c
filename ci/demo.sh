#!/usr/bin/env bash
# One command on a fresh machine: install, build, boot the Soft-RoCE VM and show ferroce
# finding and describing its RDMA devices through the plugin ABI, as NCCL would load it.
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  ci/install.sh
  ci/build.sh
  LD_LIBRARY_PATH="$PWD/target/release" ci/vm.sh \
    'rdma link show && NCCL_DEBUG=INFO target/release/ferroce info ferroce'
}
main "$@"
