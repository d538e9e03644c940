#!/usr/bin/env bash
# Create .venv/ at the repository root and install nonstop into it.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh dev      + test and lint tools, and etcd (scripts/etcd.sh install)
# torch is installed first and pinned to 2.13.0 (on CPU-only machines that is the
# local CPU wheel; a bare `pip install torch` would pull GBs of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "nonstop needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # Pinned exactly: on these CPU-only machines this resolves to the local CPU wheel.
  "${PIP[@]}" "torch==2.13.0"
fi
if [ "${1:-}" = "dev" ]; then
  "${PIP[@]}" -e ".[dev]"
  scripts/etcd.sh install  # a real etcd for the control-store tests (Debian's etcd-server; no-op when present)
else
  "${PIP[@]}" -e .
fi
.venv/bin/python -c 'import torch, nonstop; print(f"nonstop {nonstop.__version__} with torch {torch.__version__} in .venv")'
