#!/usr/bin/env bash
# Install everything from nothing into .venv, then run the whole test suite (CPU, gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Byte-compile the repository's own modules once: with PYTHONDONTWRITEBYTECODE set, every rank
# and launched process of the suite would compile them from source again
.venv/bin/python -m compileall -q -j 0 hf_cephalo tests examples benchmarks || true  # pytest says why
# Two pytest workers, each running whole test files (--dist loadfile: a module's process-group
# fixture runs once): the multi-rank tests wait on each other's collectives and launches often
# enough that two at a time finish sooner on 2 cores. Add -n 0 to run in one process.
# The files go out in xdist's order: tests/conftest.py, [Note: test file order].
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 "$@"
