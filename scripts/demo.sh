#!/usr/bin/env bash
# The main job on a fresh machine (2 CPU cores, no GPU): set up .venv, plan an uneven 2-rank job,
# train a small Llama with CephaloTrainer under stock `accelerate launch` on 2 CPU processes,
# save, reload with from_pretrained (logits checked against the trained model) and generate.
# About 3-5 min on 2 cores.
#   bash scripts/demo.sh                     # everything
#   SKIP_SETUP=1 bash scripts/demo.sh        # reuse an existing .venv
#   DEMO_PLAN=handmade bash scripts/demo.sh  # a fixed hand-made plan instead of profiling
#   bash scripts/demo.sh --max_steps 50      # extra flags go to examples/train_clm.py
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUTPUT_DIR:-outputs/demo}
DEMO_PLAN=${DEMO_PLAN:-auto}

if [ -z "${SKIP_SETUP:-}" ]; then
  echo "== setting up .venv (scripts/setup_env.sh)"
  bash scripts/setup_env.sh
fi
mkdir -p "$OUT"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1

case "$DEMO_PLAN" in
  auto)
    # Two identical CPU ranks made heterogeneous by emulation: rank 0 computes 2x slower,
    # rank 1 may use only 25 MB. CephaloTrainer profiles both ranks at start (cached on disk),
    # runs the exact planner for global batch 16, and saves profile.json and plan.json.
    echo "== plan: profiled at start on an emulated cluster (rank 0 2x slower, rank 1 capped at 25 MB)"
    PLAN_ARGS=(--cephalo_global_batch_size 16 --cephalo_emulate_slowdown 2 1
               --cephalo_emulate_memory_cap_bytes 4000000000 25000000) ;;
  handmade)
    echo "== plan: hand-made uneven 2-rank plan (not measured) in $OUT/plan.json"
    .venv/bin/python - "$OUT/plan.json" <<'PY'
import sys
from hf_cephalo.planner import Plan
# rank 1 plays the faster device with less memory: 10 of 16 samples, 40% of the training state
Plan.from_ratios(batch_sizes=[6, 10], microbatch_sizes=[3, 5], state_ratios=[0.6, 0.4],
                 devices=["cpu-slow", "cpu-fast"]).save(sys.argv[1])
PY
    PLAN_ARGS=(--cephalo_plan_file "$OUT/plan.json") ;;
  *) echo "DEMO_PLAN=$DEMO_PLAN: use 'auto' or 'handmade'" >&2; exit 2 ;;
esac

echo "== accelerate launch on 2 CPU processes (accelerate_configs/cephalo_cpu.yaml)"
.venv/bin/accelerate launch --config_file accelerate_configs/cephalo_cpu.yaml \
  examples/train_clm.py "${PLAN_ARGS[@]}" \
  --output_dir "$OUT/clm" \
  --hidden_size 128 --num_layers 4 --num_heads 4 --block_size 64 \
  --max_steps 300 --learning_rate 2e-3 --warmup_steps 20 --lr_scheduler_type cosine \
  --logging_steps 25 --save_strategy no --report_to none --disable_tqdm true --seed 0 \
  "$@"
echo "== done: checkpoint in $OUT/clm/final"
