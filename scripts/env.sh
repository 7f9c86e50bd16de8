#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs omnickpt with the
# extras named in $1 (e.g. "dev"). torch is pinned to 2.13.0 so pip takes the CPU wheel from the
# machine's cache instead of pulling several GB of CUDA packages.
#
# Each stage says what it does on stderr before it starts (the first run takes a minute or more, most
# of it installing torch); pip runs quietly, its warnings and errors are shown, and a failed install
# stops the script with pip's exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

say() { echo "env.sh: $*" >&2; }

# pip quietly, less the "... is ignored" lines that every run prints about the pinned extras; anything
# else pip says (a warning, an error) is shown, and its failure is this script's.
pip_install() {
  local status=0
  .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" >&2 || true; } \
    || status=$?
  if [ "$status" -ne 0 ]; then
    say "failed (exit $status): pip install $*"
    exit "$status"
  fi
}

if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($(python3 --version 2>&1))"
  python3 -m venv .venv
else
  say "using the virtual environment .venv"
fi
say "installing torch 2.13.0 (the CPU wheel: a minute or more the first time, seconds after)"
pip_install "torch==2.13.0"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
say "installing omnickpt (editable) with ${extras:+the extras $extras and }its dependencies"
pip_install -e "$spec"
if [[ ",$extras," == *",dev,"* ]]; then
  # The Megatron tests need megatron-core 0.12.2 (the last release that imports on a CPU-only
  # machine); its declared dependencies are not needed for what omnickpt touches.
  say "installing megatron-core 0.12.2 (without its dependencies: the Megatron tests need only the package)"
  pip_install --no-deps "megatron-core==0.12.2"
  # DeepSpeed on CPU ranks compiles its shared-memory collective op (g++, about a minute here) the first
  # time a process initialises its communication; built now, once per machine, the tests load it.
  if command -v g++ >/dev/null && .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
    say "building DeepSpeed's CPU communication op (once per machine; seconds when already built)"
    DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
      >/dev/null || say "could not build DeepSpeed's CPU op: the DeepSpeed tests will build it"
  fi
fi
.venv/bin/python -c "import torch, omnickpt.api" || { say "omnickpt did not install into .venv"; exit 1; }
say "ready: .venv (the omnickpt command is .venv/bin/omnickpt, or on PATH after: source .venv/bin/activate)"
