"""Stock Trainer's loss normalisation where it differs by model class (docs/trainer_support.md,
"The loss is divided as stock divides it").

Stock Trainer divides a causal LM's summed next-token loss by ``num_items_in_batch``, counted
over ``labels[..., 1:]`` only when the model's ``loss_type`` (read from its CLASS NAME) maps to
``ForCausalLMLoss``; ``GPT2LMHeadModel`` and a user subclass whose name lacks ``ForCausalLM``
(``HalfMLPQwen3(Qwen3ForCausalLM)``) get ``loss_type`` None, so stock counts every label != -100,
one per row more than the loss scores ([Note: stock's item count follows the loss type] in
hf_cephalo/runtime/stock_items.py). CephaloTrainer follows the same rule: its logged loss,
gradient norm, eval loss and (SGD, learning rate 0.1) the next step's loss equal stock's on one
process, for GPT-2, the subclass, the subclass with a ``compute_loss_func``, and Llama (whose
loss type is the causal LM's: the scored tokens). Each case's data makes the two counts differ
by more than 2 %, so a door that divided by the scored tokens fails.
Also: a subclass overriding ``forward`` is refused for that reason alone.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests.dist_utils import run_ranks, test_timeout
from tests.models_fixtures import build

pytestmark = test_timeout(90.0)

N_TRAIN, N_EVAL, BATCH, STEPS, SEQ = 8, 4, 4, 2, 12


class HalfMLPQwen3(transformers.Qwen3ForCausalLM):
    """A user's subclass: its name lacks ``ForCausalLM``, so transformers gives it no
    ``loss_type`` (the loss itself is still the causal LM's)."""


class HalfLossQwen3(transformers.Qwen3ForCausalLM):
    """A user's subclass with its own forward (a custom loss), which the engine would bypass."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 0.5
        return out


def _qwen3(cls):
    torch.manual_seed(0)
    return cls(transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8)).eval()


def _token_loss_sum(outputs, labels, num_items_in_batch=None):
    """A user loss: the shifted token cross entropy summed, over stock's count."""
    logits = outputs.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), reduction="sum")
    return loss / num_items_in_batch


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
    return dict(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=0.1,
                max_grad_norm=1e9, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=3, train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True,
                per_device_train_batch_size=BATCH, per_device_eval_batch_size=N_EVAL)


def _run(trainer) -> dict:
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(losses=[h["loss"] for h in logs], norms=[h["grad_norm"] for h in logs],
                eval_loss=trainer.evaluate()["eval_loss"])


CASES = {
    # dropout off (GPT-2's default is 0.1): the two trainers would draw different masks
    "gpt2": (lambda: build("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), {}),
    "subclass": (lambda: _qwen3(HalfMLPQwen3), {}),
    "subclass+compute_loss_func": (lambda: _qwen3(HalfMLPQwen3),
                                   {"compute_loss_func": _token_loss_sum}),
    "llama": (lambda: build("llama"), {}),
}


def _worker(rank, world_size, out_dir):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    results = {}
    for case, (make, extra) in CASES.items():
        kw = dict(train_dataset=_samples(N_TRAIN, 0), eval_dataset=_samples(N_EVAL, 1),
                  data_collator=_collate, **extra)
        tag = case.replace("+", "-")
        cephalo_args = CephaloTrainingArguments(**_args(os.path.join(out_dir, f"cephalo-{tag}")))
        stock_args = transformers.TrainingArguments(**_args(os.path.join(out_dir, f"stock-{tag}")))
        results[case] = {
            "loss_type": make().loss_type,
            "cephalo": _run(CephaloTrainer(model=make(), args=cephalo_args,
                                           plan=Plan.from_ratios([BATCH], [2], [1.0]), **kw)),
            "stock": _run(transformers.Trainer(model=make(), args=stock_args, **kw))}
    return results


def _counts(rows) -> tuple[int, int]:
    """(labels != -100, scored tokens = labels[1:] != -100) over ``rows``."""
    labels = torch.stack([r["labels"] for r in rows])
    return int((labels != -100).sum()), int((labels[:, 1:] != -100).sum())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    [results] = run_ranks(_worker, 1, str(tmp_path_factory.mktemp("loss_type")), timeout_s=300)
    return results


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_grad_norm_and_eval_loss_equal_stock(runs, case):
    train = _samples(N_TRAIN, 0)
    ratios = [(lambda c: c[0] / c[1])(_counts(train[s * BATCH:(s + 1) * BATCH]))
              for s in range(STEPS)]
    assert min(ratios) > 1.02  # the two counts differ visibly on this data
    assert (runs[case]["loss_type"] is None) == (case != "llama")
    ours, stock = runs[case]["cephalo"], runs[case]["stock"]
    assert len(ours["losses"]) == len(stock["losses"]) == STEPS
    _close(ours["losses"], stock["losses"])  # step 2's loss: after step 1's SGD update
    _close(ours["norms"], stock["norms"])
    _close(ours["eval_loss"], stock["eval_loss"])


def test_forward_override_is_refused_for_that_reason_alone(tmp_path):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    args = CephaloTrainingArguments(**_args(str(tmp_path)))
    with pytest.raises(ValueError) as refused:
        CephaloTrainer(model=_qwen3(HalfLossQwen3), args=args, train_dataset=_samples(4, 0),
                       data_collator=_collate, plan=Plan.from_ratios([BATCH], [2], [1.0]))
    message = str(refused.value)
    assert message.startswith("model forward (override) is not supported by CephaloTrainer")
    assert "not a causal LM" not in message and "settings of this script" not in message
