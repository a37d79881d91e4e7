#!/usr/bin/env bash
# Engine checks that need one CUDA GPU: the CUDA-path tests and the engine benchmark on one GPU.
# Budget: under 15 minutes (the compile checks compile Triton kernels once; inductor's
# on-disk cache makes a rerun faster). Usage: scripts/gpu_check.sh  (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
echo "== CUDA engine tests (streams, offload, bf16 autocast, fp16 + ShardedGradScaler, loading)"
timeout 300 "$PY" -m pytest -q -m gpu -k "not compile" tests/gpu/test_engine_cuda.py \
  tests/gpu/test_loading_cuda.py
echo "== precision per rank: auto from the capability, the job scaler exact for bf16/fp32 ranks"
timeout 180 "$PY" -m pytest -q -m gpu tests/gpu/test_rank_precision_cuda.py
echo "== torch.compile per unit on CUDA (inductor / Triton): exactness, dropout replay"
timeout 400 "$PY" -m pytest -q -m gpu tests/gpu/test_engine_cuda.py -k compile
echo "== engine benchmark (1 GPU, NCCL)"
timeout 180 "$PY" benchmarks/bench_engine.py --device cuda --world-size 1 --steps 3 \
  --layers 4 --hidden 1024 --intermediate 2816 --heads 16 --vocab 8192 --seq 512 \
  --local-batch 8 --peak-m 1
echo "== mixed precision: Cephalo param_dtype bf16 vs FSDP2 MixedPrecisionPolicy (1 GPU)"
timeout 120 "$PY" benchmarks/bench_engine.py --device cuda --world-size 1 --steps 3 \
  --layers 4 --hidden 1024 --intermediate 2816 --heads 16 --vocab 8192 --seq 512 \
  --local-batch 8 --param-dtype bf16
echo "== eager vs torch.compile: Cephalo per unit vs FSDP2 per layer; the physical bound (1 GPU)"
timeout 300 "$PY" benchmarks/bench_engine.py --device cuda --world-size 1 --steps 3 \
  --layers 4 --hidden 1024 --intermediate 2816 --heads 16 --vocab 8192 --seq 512 \
  --local-batch 8 --compile
