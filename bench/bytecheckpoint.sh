#!/usr/bin/env bash
# ByteCheckpoint column of the side-by-side benchmark.
#
#   bench/bytecheckpoint.sh [--quick] [--runs N] [--skip-setup]
#
# ByteCheckpoint 0.0.2 (PyPI) pins torch>=2.1,<=2.5.0, so it cannot share omnickpt's venv (torch
# 2.13). This script builds its own venv, bench/.venv-bcp (gitignored), with the newest torch the
# pin allows (2.5.0), then runs bench/bcp_driver.py in it: the same workloads, process layout
# (2 gloo ranks on CPU) and disk as bench/compare.py, and merges its figures into
# bench/out/results.json when compare.py has written one.
#
# Obstacle worth knowing: PyPI only has the CUDA build of torch 2.5.0 for Linux x86_64 (the CPU
# build lives on download.pytorch.org, unreachable here), so the install pulls ~0.9 GB of torch plus
# ~2.5 GB of nvidia-*-cu12 wheels that torch imports at start-up even with no GPU. About 5 GB of
# disk and a few minutes on a fast PyPI link; the script checks free space first.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-bcp"
PY_BASE="${BCP_PYTHON:-}"
SKIP_SETUP=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --skip-setup) SKIP_SETUP=1 ;;
    *) ARGS+=("$a") ;;
  esac
done

if [[ -z "$PY_BASE" ]]; then
  # Same interpreter as omnickpt's venv when there is one (same Python for both columns).
  if [[ -f "$HERE/../.venv/pyvenv.cfg" ]]; then
    PY_BASE="$(sed -n 's/^executable = //p' "$HERE/../.venv/pyvenv.cfg")"
  fi
  PY_BASE="${PY_BASE:-python3}"
fi

need_setup=0
if [[ $SKIP_SETUP -eq 0 ]]; then
  if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import bytecheckpoint, torch" >/dev/null 2>&1; then
    need_setup=1
  fi
fi
if [[ $need_setup -eq 1 ]]; then
  free_kb=$(df -Pk "$HERE" | awk 'NR==2 {print $4}')
  if (( free_kb < 8 * 1024 * 1024 )); then
    echo "bytecheckpoint.sh: need ~8 GB free under $HERE for torch 2.5.0 + CUDA wheels, have $((free_kb / 1024)) MB; skipping the ByteCheckpoint column" >&2
    exit 3
  fi
  echo "== setting up $VENV (torch 2.5.0 from PyPI: CUDA build, ~3.4 GB download)" >&2
  "$PY_BASE" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip >/dev/null
  # bytecheckpoint 0.0.2 requires torch<=2.5.0: pin it so pip does not try 2.5.1 and backtrack.
  if ! "$VENV/bin/pip" install --quiet "torch==2.5.0" "bytecheckpoint==0.0.2"; then
    echo "bytecheckpoint.sh: pip could not install torch==2.5.0 + bytecheckpoint==0.0.2; see the pip output above; skipping the ByteCheckpoint column" >&2
    exit 3
  fi
fi

# Its INFO logging prints several lines per call on every rank; keep errors only (its warnings
# here are about the missing GPU and the absent extra_state).
export BYTECHECKPOINT_LOGGING_LEVEL="${BYTECHECKPOINT_LOGGING_LEVEL:-ERROR}"
# ... and its torch.load(weights_only=False) FutureWarning, printed on every load by every rank.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"
"$VENV/bin/python" -c "import torch, bytecheckpoint; print('torch', torch.__version__, 'bytecheckpoint', getattr(bytecheckpoint, '__version__', '0.0.2'))" >&2
exec "$VENV/bin/python" "$HERE/bcp_driver.py" "${ARGS[@]+"${ARGS[@]}"}"
