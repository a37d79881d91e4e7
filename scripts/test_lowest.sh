#!/usr/bin/env bash
# The lowest versions pyproject.toml declares (constraints/lowest.txt), installed into
# .venv-lowest, and a representative subset of the tests run on them: the Trainer, loop and TRL
# doors against their references, the generic decoder path, LoRA, checkpoints and the engine.
# Not part of the README's test command (CI installs the newest releases); run it when a bound
# in pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-lowest/bin/python ]; then
  "$PY" -m venv .venv-lowest
fi
.venv-lowest/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv-lowest/bin/python -m pip install -q "torch==2.13.0"
.venv-lowest/bin/python -m pip install -q -c constraints/lowest.txt -e ".[test]"
.venv-lowest/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|datasets|numpy|safetensors|tokenizers|pyyaml|peft|trl) "
exec .venv-lowest/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_training_args.py tests/test_models_exactness.py tests/test_trainer_parity.py \
  tests/test_accelerate_loop.py tests/test_lora.py tests/test_engine_parity.py \
  tests/test_generic_engine_parity.py tests/test_checkpoint.py tests/test_trl_sft.py \
  tests/test_trl_dpo.py tests/test_generic_doors.py "$@"
