#!/usr/bin/env bash
# System packages mithrilfs needs: FUSE 3 (runtime and headers to build pyfuse3),
# pkg-config, a C compiler, and redis-server for the shared-tier tests.
set -euo pipefail
pkgs=(fuse3 libfuse3-dev pkg-config gcc redis-server)
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
