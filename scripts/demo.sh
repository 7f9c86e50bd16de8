#!/usr/bin/env bash
# Sets up .venv (scripts/env.sh) and runs the demo: FSDP2 training on 2 CPU ranks with async
# saves, then a resume on 1 rank as a plain module; exits non-zero if the losses do not continue.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/python examples/demo.py "$@"
