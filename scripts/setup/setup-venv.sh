#!/usr/bin/env bash
# A virtualenv in .venv with mithrilfs (editable) and its test extras
# (torch==2.13.0 CPU and triton==3.8.0, pinned), and `mithrilfs` on PATH (scripts/setup/link-cli.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "mithrilfs needs Python 3.11 or newer")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c 'import mithrilfs, torch, triton; print("venv ready: torch", torch.__version__, "triton", triton.__version__)'
# `mithrilfs` on PATH: /usr/local/bin/mithrilfs -> .venv/bin/mithrilfs as root, else the line to add
bash scripts/setup/link-cli.sh .venv
