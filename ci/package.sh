#!/usr/bin/env bash
# Builds the Debian package of ferroce with dpkg-deb, Debian's own package builder:
#   target/debian/ferroce_<version>_<arch>.deb
# It holds
#   /usr/lib/<multiarch>/libnccl-net-ferroce.so   where NCCL's dlopen finds it with
#                                                  NCCL_NET_PLUGIN=ferroce, no LD_LIBRARY_PATH
#   /usr/bin/ferroce                               the tool (doctor, perf, info, ...)
#   /usr/share/man/man1/ferroce.1.gz               its manual page (`ferroce man`, from clap)
#   bash, zsh and fish completions                 (`ferroce completions SHELL`)
#   /usr/share/doc/ferroce/                        README.md and the copyright notice
# and an ldconfig trigger, so the loader's cache knows the plugin once dpkg is done.
# Usage: ci/package.sh   (after ci/build.sh; prints the .deb's path last)
main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  local rel=target/release
  [[ -f $rel/libnccl-net-ferroce.so && -x $rel/ferroce ]] ||
    { echo "package.sh: build first: ci/build.sh" >&2; exit 1; }
  local version arch multiarch
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
  arch=$(dpkg --print-architecture)
  multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
  local root=target/debian/root
  rm -rf "$root"
  install -D -m 0644 $rel/libnccl-net-ferroce.so "$root/usr/lib/$multiarch/libnccl-net-ferroce.so"
  install -D -m 0755 $rel/ferroce "$root/usr/bin/ferroce"
  strip --strip-unneeded "$root/usr/lib/$multiarch/libnccl-net-ferroce.so" "$root/usr/bin/ferroce"
  mkdir -p "$root/usr/share/man/man1" "$root/usr/share/bash-completion/completions" \
    "$root/usr/share/zsh/vendor-completions" "$root/usr/share/fish/vendor_completions.d" \
    "$root/usr/share/doc/ferroce" "$root/DEBIAN"
  $rel/ferroce man | gzip -9n >"$root/usr/share/man/man1/ferroce.1.gz"
  $rel/ferroce completions bash >"$root/usr/share/bash-completion/completions/ferroce"
  $rel/ferroce completions zsh >"$root/usr/share/zsh/vendor-completions/_ferroce"
  $rel/ferroce completions fish >"$root/usr/share/fish/vendor_completions.d/ferroce.fish"
  install -m 0644 README.md "$root/usr/share/doc/ferroce/README.md"
  printf '%s\n' "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/" \
    "Upstream-Name: ferroce" "" "Files: *" "Copyright: the ferroce authors" \
    "License: see the ferroce repository" >"$root/usr/share/doc/ferroce/copyright"
  local size
  size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
  cat >"$root/DEBIAN/control" <<EOF
Package: ferroce
Version: $version
Architecture: $arch
Maintainer: ferroce developers <ferroce@localhost>
Installed-Size: $size
Depends: libc6 (>= 2.34), libibverbs1 (>= 39)
Recommends: rdma-core, ibverbs-providers
Section: net
Priority: optional
Description: NCCL network plugin for RDMA over Converged Ethernet (RoCEv2)
 ferroce implements NCCL's ncclNet ABI (v6 to v12) over ibverbs for RoCEv2
 fabrics: GID selection that explains itself, several queue pairs per
 connection each on its own UDP source port for ECMP, bounded timeouts,
 GPUDirect RDMA, and a doctor that names misconfigurations.
 .
 NCCL loads it with NCCL_NET_PLUGIN=ferroce.
EOF
  echo "activate-noawait ldconfig" >"$root/DEBIAN/triggers"
  local deb=target/debian/ferroce_${version}_${arch}.deb
  dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
  dpkg-deb --info "$deb" | sed -n '/Package:/,/Depends:/p'
  dpkg-deb --contents "$deb" | awk '{print "  " $NF}'
  echo "$PWD/$deb"
}
main "$@"
