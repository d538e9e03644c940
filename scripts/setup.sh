#!/usr/bin/env bash
# Create .venv/ at the repository root and install nonstop into it.
#   scripts/setup.sh          runtime + the plots extra (matplotlib: `nonstop timeline`'s pictures, --plot)
#   scripts/setup.sh dev      + test and lint tools (dev includes plots), and etcd (scripts/etcd.sh install)
# (`pip install nonstop` alone needs no matplotlib: a picture then fails in one line naming the extra.)
#   NONSTOP_VENV=DIR    the venv (default .venv)
#   NONSTOP_TORCH=X.Y.Z the torch it must hold (default: an importable torch is kept, else 2.13.0);
#                       make test-compat: NONSTOP_VENV=.venv-compat NONSTOP_TORCH=2.14.1
# torch is installed first and pinned to 2.13.0 (on CPU-only machines that is the
# local CPU wheel; a bare `pip install torch` would pull GBs of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "nonstop needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
VENV=${NONSTOP_VENV:-.venv}
TORCH=${NONSTOP_TORCH:-}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit('$TORCH' not in ('', torch.__version__.split('+')[0]))" 2>/dev/null; then
  # Pinned exactly, before nonstop (whose range admits it, so pip keeps it): 2.13.0 resolves to
  # the local CPU wheel on these CPU-only machines; 2.14.1 to the (CUDA) wheel on this disk.
  "${PIP[@]}" "torch==${TORCH:-2.13.0}"
fi
if [ "${1:-}" = "dev" ]; then
  "${PIP[@]}" -e ".[dev]"
  scripts/etcd.sh install  # a real etcd for the control-store tests (Debian's etcd-server; no-op when present)
else
  "${PIP[@]}" -e ".[plots]"
fi
if [ -n "$TORCH" ]; then  # nonstop's torch range must admit it, or pip would have swapped it
  "$VENV/bin/python" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(None if v == '$TORCH' else f'$VENV holds torch {v}, not $TORCH: pyproject.toml must admit $TORCH')"
fi
"$VENV/bin/python" -c "import torch, nonstop; print(f'nonstop {nonstop.__version__} with torch {torch.__version__} in $VENV')"
