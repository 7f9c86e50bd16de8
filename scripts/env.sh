#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs omnickpt with the
# extras named in $1 (e.g. "dev"). torch is pinned to 2.13.0 so pip takes the CPU wheel from the
# machine's cache instead of pulling several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/pip install -q --disable-pip-version-check -e "$spec" 2>&1 | grep -v "is ignored" || true
if [[ ",$extras," == *",dev,"* ]]; then
  # The Megatron tests need megatron-core 0.12.2 (the last release that imports on a CPU-only
  # machine); its declared dependencies are not needed for what omnickpt touches.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "megatron-core==0.12.2" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -c "import omnickpt, torch" || { echo "omnickpt did not install into .venv" >&2; exit 1; }
