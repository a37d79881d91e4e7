#!/usr/bin/env bash
# Install everything from nothing into .venv, then run the whole test suite (CPU, gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
