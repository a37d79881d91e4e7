"""A decoder sequence classifier through CephaloTrainer equals STOCK Trainer (issue 33, item 5).

One run_ranks call (2 gloo ranks, plan b = [1, 3], m = [1, 2], uneven state 0.35 / 0.65) trains
``LlamaForSequenceClassification`` on left-padded rows (a reward-model / classifier setup) for
2 SGD steps with clipping, then evaluates and predicts; the test process does the same with stock
``Trainer`` in one process (per_device batch 4 = the global batch, sequential order, so both
see the same global batches). Compared: logged losses and gradient norms, final weights (the
user's model object after ``trainer.unshard_model()``), eval loss and the predicted logits in
dataset order. fp32, rtol 1e-5 / atol 1e-6 as tests/test_trainer_parity.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import transformers

from tests.dist_utils import budget_s, run_ranks, test_timeout
from tests.models_fixtures import NUM_LABELS, PAD, SEQ, build

RTOL, ATOL = 1e-5, 1e-6
LR, MAX_NORM, SEED, N_TRAIN, N_EVAL, STEPS = 0.1, 0.5, 7, 8, 6, 2
SIZES, MICRO, RATIOS = [1, 3], [1, 2], [0.35, 0.65]
ARCH = "llama_cls"
JOB_S = 40.0  # measured 2-rank job on the 2-core machine under load
pytestmark = test_timeout(JOB_S, margin_s=90.0)  # + the stock run and imports in this process


def _samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Left-padded rows of random length with one class label each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (), generator=g))
        ids = torch.full((SEQ,), PAD, dtype=torch.long)
        ids[SEQ - length:] = torch.randint(1, 97, (length,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": (ids != PAD).long(),
                     "labels": torch.randint(0, NUM_LABELS, (), generator=g)})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _args_kwargs(out_dir: str) -> dict:
    return dict(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=LR,
                max_grad_norm=MAX_NORM, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=SEED, train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True)


def _logs(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _worker(rank, world_size, out_dir):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    args = CephaloTrainingArguments(**_args_kwargs(os.path.join(out_dir, "cephalo")))
    trainer = CephaloTrainer(model=build(ARCH), args=args, data_collator=_collate,
                             plan=Plan.from_ratios(SIZES, MICRO, RATIOS),
                             train_dataset=_samples(N_TRAIN, 0))
    trainer.train()
    losses, norms = _logs(trainer)
    eval_loss = trainer.evaluate(_samples(N_EVAL, 1))["eval_loss"]
    predictions = trainer.predict(_samples(N_EVAL, 1)).predictions
    model = trainer.unshard_model()
    return dict(losses=losses, norms=norms, eval_loss=eval_loss,
                predictions=np.asarray(predictions),
                state={k: v.detach().clone().numpy() for k, v in model.state_dict().items()})


@pytest.fixture(scope="module")
def cephalo(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("seqcls_trainer"))
    return run_ranks(_worker, 2, out_dir, timeout_s=budget_s(JOB_S))


def _stock(out_dir):
    args = transformers.TrainingArguments(per_device_train_batch_size=sum(SIZES),
                                          **_args_kwargs(out_dir))
    model = build(ARCH)
    trainer = transformers.Trainer(model=model, args=args, data_collator=_collate,
                                   train_dataset=_samples(N_TRAIN, 0))
    trainer.train()
    losses, norms = _logs(trainer)
    eval_loss = trainer.evaluate(_samples(N_EVAL, 1))["eval_loss"]
    return dict(losses=losses, norms=norms, eval_loss=eval_loss,
                predictions=trainer.predict(_samples(N_EVAL, 1)).predictions,
                state={k: v.detach().clone() for k, v in model.state_dict().items()})


def test_llama_classifier_trainer_equals_stock(cephalo, tmp_path):
    ref = _stock(str(tmp_path / "stock"))
    assert len(ref["losses"]) == STEPS and max(ref["norms"]) > MAX_NORM  # clipping was active
    for rank, got in enumerate(cephalo):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                       torch.tensor(ref[key], dtype=torch.float64),
                                       rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
        torch.testing.assert_close(got["eval_loss"], ref["eval_loss"], rtol=RTOL, atol=ATOL)
        assert got["predictions"].shape == (N_EVAL, NUM_LABELS)
        torch.testing.assert_close(torch.as_tensor(got["predictions"]),
                                   torch.as_tensor(ref["predictions"]), rtol=RTOL, atol=ATOL)
        assert set(got["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.as_tensor(got["state"][key]), value, rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"rank {rank} {key}: {m}")
    worst = {k: max(float(np.abs(np.asarray(g[k]) - np.asarray(ref[k])).max()) for g in cephalo)
             for k in ("losses", "norms", "eval_loss", "predictions")}
    worst["state"] = max(float((torch.as_tensor(g["state"][k]) - v).abs().max())
                         for g in cephalo for k, v in ref["state"].items())
    print("trainer max |diff| " + " ".join(f"{k} {v:.2e}" for k, v in worst.items()))
