#!/usr/bin/env bash
# Sets up .venv with the dev extras and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh dev
exec .venv/bin/python -m pytest -q "$@"
