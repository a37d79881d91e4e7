"""CephaloTrainer with --fp16 on 2 gloo ranks: fp16 autocast (fp16 gathered parameters by
default) and the engine's loss scaler (a ShardedGradScaler) as ``accelerator.scaler``:
``loss_scale`` logged every step, ``scaler.pt`` in checkpoints, and resuming from checkpoint-3
on ANOTHER plan logs the same loss scales for steps 4-6 as the uninterrupted run. Both runs use
transformers' default optimizer (``adamw_torch_fused``: a fused optimizer takes the scaler's
found-inf flag itself, [Note: found-inf shape for fused optimizers] in ``engine/grad_scaler.py``).
"""

from __future__ import annotations

import os

import torch

from tests.dist_utils import run_ranks
from tests.models_fixtures import build
from tests.test_trainer import _collate, _dataset, _samples


def _train(out_dir, plan, resume=None):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    # optim not given: transformers' default, the fused AdamW
    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none",
                                    learning_rate=1e-3, max_steps=6, logging_steps=1,
                                    save_strategy="steps", save_steps=3, seed=3, fp16=True,
                                    max_grad_norm=1.0, disable_tqdm=True)
    trainer = CephaloTrainer(model=build("llama"), args=args, plan=plan, data_collator=_collate,
                             train_dataset=_dataset(_samples("llama", 24, 0)))
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(steps=[h["step"] for h in logs], scales=[h["loss_scale"] for h in logs],
                losses=[h["loss"] for h in logs], param_dtype=str(trainer.engine.precision.param),
                autocast=str(trainer.engine.precision.compute),
                scaler=type(trainer.accelerator.scaler).__name__,
                optim=getattr(args.optim, "value", args.optim),
                fused=trainer.optimizer.optimizer.defaults.get("fused"))


def _worker(rank, world, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    from hf_cephalo.planner import Plan

    first = _train(out_dir, Plan.from_ratios([3, 1], [1, 1], [0.3, 0.7]))
    has_scaler = os.path.isfile(os.path.join(out_dir, "checkpoint-3", "scaler.pt"))
    resumed = _train(out_dir, Plan.from_ratios([2, 2], [2, 1], [0.6, 0.4]),
                     resume=os.path.join(out_dir, "checkpoint-3"))
    return dict(first=first, resumed=resumed, has_scaler=has_scaler)


def test_fp16_trainer_scaler_logged_saved_resumed(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path), timeout_s=400)
    first, resumed = results[0]["first"], results[0]["resumed"]
    assert first["autocast"] == "torch.float16" and first["param_dtype"] == "torch.float16"
    assert first["scaler"] == "CephaloGradScaler" and results[0]["has_scaler"]
    assert (first["optim"], first["fused"]) == ("adamw_torch_fused", True), first
    assert first["steps"] == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(first["losses"])))
    # the resumed log history starts with the checkpoint's (steps 1-3), then its own 4-6
    assert resumed["steps"] == [1, 2, 3, 4, 5, 6]
    assert resumed["scales"] == first["scales"], (first["scales"], resumed["scales"])
    assert results[1]["first"]["scales"] == first["scales"]  # every rank the same scale
    print(first, resumed)
