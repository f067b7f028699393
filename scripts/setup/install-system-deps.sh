#!/usr/bin/env bash
# System packages mithrilfs needs: fuse3 (fusermount3, for mounts without root),
# ninja-build and openssl (torch.utils.cpp_extension builds with ninja; Inductor hashes its headers with openssl),
# g++ (the tests run torch.compile's C++ backend), and redis-server for the
# shared-tier tests.  mithrilfs itself is pure Python: no libfuse, no compiler.
# The sidecar-image tests (tests/container) build and run the Dockerfile with podman
# and runc (crun cannot start containers on hosts with hybrid cgroups), run the compose
# file with podman-compose, and make their base image with debootstrap: no registry.
# faketime (libfaketime) runs one node of the clock-skew tests with its wall clock moved.
set -euo pipefail
pkgs=(fuse3 g++ ninja-build openssl redis-server podman runc podman-compose debootstrap faketime)
missing=()
for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
[ -e /dev/fuse ] || { echo "install-system-deps: /dev/fuse is missing: FUSE cannot work here" >&2; exit 1; }
echo "system packages ready: ${pkgs[*]}"
