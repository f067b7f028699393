#!/usr/bin/env bash
# Put the virtualenv's `mithrilfs` on PATH, so that after the set-up a user types `mithrilfs`
# (the console script lives in VENV/bin, which no shell has on its PATH).
#   bash scripts/setup/link-cli.sh [VENV]  VENV: the virtualenv (default: the checkout's .venv)
#   MITHRILFS_BIN_DIR                      where the link goes (default /usr/local/bin)
# As root (or wherever MITHRILFS_BIN_DIR is writable) it links BIN_DIR/mithrilfs to VENV/bin/mithrilfs,
# replacing only an earlier link: a mithrilfs installed there some other way is left alone, and said so.
# Otherwise it prints the one line that puts VENV/bin on PATH.  It never fails the set-up.
set -euo pipefail
venv="$(cd "${1:-$(dirname "$0")/../../.venv}" && pwd)"
exe="$venv/bin/mithrilfs"
bin_dir="${MITHRILFS_BIN_DIR:-/usr/local/bin}"
[ -x "$exe" ] || { echo "link-cli: $exe is missing: run scripts/setup/setup-venv.sh first" >&2; exit 1; }
link="$bin_dir/mithrilfs"
if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "mithrilfs: $link exists and is not this set-up's link: left alone; use $exe or put $venv/bin first on PATH"
elif [ -d "$bin_dir" ] && [ -w "$bin_dir" ]; then
    ln -sfn "$exe" "$link"
    echo "mithrilfs: $link -> $exe"
    case ":$PATH:" in
        *":$bin_dir:"*) ;;
        *) echo "mithrilfs: $bin_dir is not on your PATH: export PATH=\"$bin_dir:\$PATH\"" ;;
    esac
else
    echo "mithrilfs: to type mithrilfs, put the virtualenv on your PATH (e.g. in ~/.profile):"
    echo "export PATH=\"$venv/bin:\$PATH\""
fi
