#!/usr/bin/env bash
# System packages mithrilfs needs: fuse3 (fusermount3, for mounts without root),
# ninja-build and openssl (torch.utils.cpp_extension builds with ninja; Inductor hashes its headers with openssl),
# g++ (the tests run torch.compile's C++ backend), and redis-server for the
# shared-tier tests.  mithrilfs itself is pure Python: no libfuse, no compiler.
# The sidecar-image tests (tests/container) build and run the Dockerfile with podman
# and runc (crun cannot start containers on hosts with hybrid cgroups), run the compose
# file with podman-compose, and make their base image with debootstrap: no registry.
# faketime (libfaketime) runs one node of the clock-skew tests with its wall clock moved.
# It also lets FUSE requests carry 2 MiB (fs.fuse.max_pages_limit 512, default 256; a cap only, for
# daemons that ask): a large file written through the mount then lands in 2 MiB folios, and a
# passed-through mapping of it takes one page-table entry per 2 MiB, as a plain file does.
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
limit=/proc/sys/fs/fuse/max_pages_limit
if [ -e "$limit" ] && [ "$(cat "$limit")" -lt 512 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    if echo 512 | $SUDO tee "$limit" >/dev/null 2>&1; then
        echo "fs.fuse.max_pages_limit = 512" | $SUDO tee /etc/sysctl.d/60-mithrilfs-fuse.conf >/dev/null || true
    else
        echo "install-system-deps: cannot raise fs.fuse.max_pages_limit (a container?): writes stay in 1 MiB pieces" >&2
    fi
fi
echo "system packages ready: ${pkgs[*]}"
