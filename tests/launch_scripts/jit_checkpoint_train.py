"""Worker for tests/test_trainer_launch.py::test_sigterm_saves_resumable_checkpoint, started by
torchrun on 2 CPU processes (gloo), CephaloTrainer with plan b = [1, 3] and enable_jit_checkpoint.

Usage:
  jit_checkpoint_train.py interrupted OUT_DIR   train "forever" (max_steps 10000); after every
      step rank 0 writes the step to OUT_DIR/progress so the test can SIGTERM the launcher
      mid-run; the JIT checkpoint stops training. Rank 0 writes OUT_DIR/interrupted.json.
  jit_checkpoint_train.py resume OUT_DIR STEP   the uninterrupted reference run from scratch to
      STEP + 2 steps (OUT_DIR/reference), then a run resumed from OUT_DIR/run/checkpoint-STEP
      to STEP + 2; rank 0 writes OUT_DIR/resume.json (both log histories and final weights).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.models_fixtures import build  # noqa: E402

SIZES, MICRO, RATIOS = [1, 3], [1, 2], [0.35, 0.65]
STEP_PAUSE_S = 0.05  # slows the interrupted run so a SIGTERM lands mid-run


def samples(n: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long),
                     "labels": labels})
    return rows


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class Progress(TrainerCallback):
    """Rank 0 writes the finished step to OUT_DIR/progress, then every rank pauses."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if self.path is None:
            return
        if state.is_world_process_zero:
            with open(self.path + ".tmp", "w") as f:
                f.write(str(state.global_step))
            os.replace(self.path + ".tmp", self.path)
        time.sleep(STEP_PAUSE_S)


def trainer(output_dir: str, max_steps: int, progress: str | None = None):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    args = CephaloTrainingArguments(
        output_dir=output_dir, report_to="none", optim="adamw_torch", learning_rate=1e-3,
        lr_scheduler_type="constant", max_steps=max_steps, logging_steps=1, save_strategy="no",
        seed=3, disable_tqdm=True, use_cpu=True, enable_jit_checkpoint=True)
    return CephaloTrainer(model=build("llama"), args=args,
                          plan=Plan.from_ratios(SIZES, MICRO, RATIOS), data_collator=collate,
                          train_dataset=samples(), callbacks=[Progress(progress)])


def losses(t) -> list[list[float]]:
    return [[h["step"], h["loss"]] for h in t.state.log_history if "loss" in h]


def weights(t) -> dict[str, list[float]]:
    model = t.unshard_model()
    return {k: v.detach().double().flatten().tolist() for k, v in model.state_dict().items()}


def main(mode: str, out_dir: str, *rest: str) -> None:
    rank0 = int(os.environ["RANK"]) == 0
    if mode == "interrupted":
        t = trainer(os.path.join(out_dir, "run"), 10_000, os.path.join(out_dir, "progress"))
        t.train()
        result = dict(global_step=t.state.global_step, losses=losses(t))
    else:
        step = int(rest[0])
        ref = trainer(os.path.join(out_dir, "reference"), step + 2)
        ref.train()
        resumed = trainer(os.path.join(out_dir, "run"), step + 2)
        resumed.train(resume_from_checkpoint=os.path.join(out_dir, "run", f"checkpoint-{step}"))
        result = dict(reference=dict(losses=losses(ref), weights=weights(ref)),
                      resumed=dict(losses=losses(resumed), weights=weights(resumed)))
    if rank0:
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
