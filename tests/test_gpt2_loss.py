"""GPT-2's loss normalisation against stock Trainer (docs/trainer_support.md, "Losses").

Stock Trainer divides a causal LM's summed next-token loss by ``num_items_in_batch``, which it
counts over ``labels[..., 1:]`` only when the model's ``loss_type`` maps to ``ForCausalLMLoss``.
GPT2LMHeadModel has ``loss_type`` None, so stock counts every label != -100 (one per row more
than it scores): its logged loss, eval loss and gradient norm are (scored tokens) / (labels)
times the scored-token mean. CephaloTrainer logs the scored-token mean for every model (the
choice and its reason: docs/trainer_support.md). This test pins the documented relation
exactly, step by step, for training loss, gradient norm and eval loss, and shows Llama (whose
loss_type stock recognises) equal to stock. A transformers release that changes stock's GPT-2
count makes it fail, so the page is updated with it.

One process (the relation is per global batch; the 2-rank run is the same count, all-reduced).
SGD with learning rate 0 keeps the weights fixed, so every step compares the same model.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests.dist_utils import run_ranks, test_timeout
from tests.models_fixtures import build

pytestmark = test_timeout(60.0)

N_TRAIN, N_EVAL, BATCH, STEPS, SEQ = 8, 4, 4, 2, 12


def _samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (SEQ,), generator=g)
        labels = ids.clone()
        labels[SEQ - int(torch.randint(0, 6, (), generator=g)):] = -100  # uneven item counts
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _args(out_dir: str) -> dict:
    return dict(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=0.0,
                max_grad_norm=1e9, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=3, train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True,
                per_device_train_batch_size=BATCH, per_device_eval_batch_size=N_EVAL)


def _run(trainer) -> dict:
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(losses=[h["loss"] for h in logs], norms=[h["grad_norm"] for h in logs],
                eval_loss=trainer.evaluate()["eval_loss"])


def _worker(rank, world_size, out_dir):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    results = {}
    # dropout off (GPT-2's default is 0.1): the two trainers draw different dropout masks
    config = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}
    for arch in ("gpt2", "llama"):
        kw = dict(train_dataset=_samples(N_TRAIN, 0), eval_dataset=_samples(N_EVAL, 1),
                  data_collator=_collate)
        cephalo_args = CephaloTrainingArguments(**_args(os.path.join(out_dir, f"cephalo-{arch}")))
        stock_args = transformers.TrainingArguments(**_args(os.path.join(out_dir, f"stock-{arch}")))
        results[arch] = {
            "cephalo": _run(CephaloTrainer(model=build(arch, **config[arch]),
                                           args=cephalo_args,
                                           plan=Plan.from_ratios([BATCH], [2], [1.0]), **kw)),
            "stock": _run(transformers.Trainer(model=build(arch, **config[arch]),
                                               args=stock_args, **kw))}
    return results


def _counts(rows) -> tuple[int, int]:
    """(labels != -100, scored tokens = labels[1:] != -100) over ``rows``."""
    labels = torch.stack([r["labels"] for r in rows])
    return int((labels != -100).sum()), int((labels[:, 1:] != -100).sum())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    [results] = run_ranks(_worker, 1, str(tmp_path_factory.mktemp("gpt2_loss")), timeout_s=240)
    return results


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_gpt2_logs_the_scored_token_mean_stock_divides_by_every_label(runs):
    train = _samples(N_TRAIN, 0)
    # per step: stock's value x (labels / scored tokens) = the scored-token mean Cephalo logs
    ratios = [(lambda c: c[0] / c[1])(_counts(train[s * BATCH:(s + 1) * BATCH]))
              for s in range(STEPS)]
    assert min(ratios) > 1.02  # the two normalisations differ visibly on this data
    ours, stock = runs["gpt2"]["cephalo"], runs["gpt2"]["stock"]
    assert len(ours["losses"]) == len(stock["losses"]) == STEPS
    _close(ours["losses"], [s * r for s, r in zip(stock["losses"], ratios)])
    _close(ours["norms"], [s * r for s, r in zip(stock["norms"], ratios)])
    labels, scored = _counts(_samples(N_EVAL, 1))  # one evaluation batch
    _close(ours["eval_loss"], stock["eval_loss"] * labels / scored)


def test_llama_matches_stock(runs):
    """Control: where stock counts the scored tokens (loss_type ForCausalLM), the values agree."""
    ours, stock = runs["llama"]["cephalo"], runs["llama"]["stock"]
    _close(ours["losses"], stock["losses"])
    _close(ours["norms"], stock["norms"])
    _close(ours["eval_loss"], stock["eval_loss"])
