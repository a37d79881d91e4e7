"""CephaloSFTTrainer vs STOCK TRL SFTTrainer (issue 31): the same settings give the same numbers.

One run_ranks call per world size trains every sub-case through CephaloSFTTrainer: 2 gloo ranks
with the uneven plan b = [1, 3], m = [1, 2], and 3 ranks with b = [1, 3, 0], m = [1, 1, 0]
(different l_i and an idle rank). The test process trains the same sub-cases with stock
``SFTTrainer`` in ONE process with the whole global batch (per_device_train_batch_size = 4,
sequential order: the same global batches) and compares, per step, the logged loss, grad_norm
and TRL's metrics (entropy, mean_token_accuracy, num_tokens), then the final weights (the
user's model object after ``trainer.unshard_model()``). fp32, SGD, rtol 1e-5 / atol 1e-6.

Also on the 3-rank run: a user ``compute_loss`` (on CephaloTrainer) that logs metrics through
``accelerator.gather_for_metrics`` — 0-dim sums and per-sample rows — equals the same class on
stock ``Trainer``; one that calls ``torch.distributed.all_reduce`` is refused on every rank
with the same error, without hanging.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import portable, run_ranks, test_timeout
from tests.trl_fixtures import (B, SEED, SFT_CASES, assert_same_state, chat_dataset,
                                load_tokenizer, offline_env, plan, save_tokenizer, tiny_llama)

trl = pytest.importorskip("trl")

RTOL, ATOL = 1e-5, 1e-6
LR, STEPS = 0.5, 3
METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
EVAL_CASE = "assistant_only"  # also evaluates: TRL's eval metrics per global eval batch


def _sft_kwargs(case: str, out_dir: str) -> dict:
    _, extra = SFT_CASES[case]
    return dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
                seed=SEED, train_sampling_strategy="sequential", bf16=False,
                gradient_checkpointing=False, disable_tqdm=True, use_cpu=True,
                prediction_loss_only=True, **extra)


def _datasets(case: str):
    fmt, _ = SFT_CASES[case]
    train = chat_dataset(fmt)
    return train, (chat_dataset(fmt, 2 * B, offset=40) if case == EVAL_CASE else None)


def _logs(history, prefix=""):
    rows = [h for h in history if prefix + "loss" in h and "train_loss" not in h]
    return {m: [h[prefix + m] for h in rows if prefix + m in h] for m in METRICS}


# ---- the Cephalo side --------------------------------------------------------------------------

def _worker(rank, world_size, out_dir, tokenizer_path):
    offline_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {case: _cephalo_sft(case, world_size, out_dir, tokenizer_path)
               for case in SFT_CASES}
    if world_size == 3:
        results["gather_metrics"] = _cephalo_gather_metrics(world_size, out_dir)
        results["raw_collective"] = _cephalo_raw_collective(world_size, out_dir)
    else:
        results["resume"] = _cephalo_resume(world_size, out_dir, tokenizer_path)
    return portable(results, True)


def _cephalo_resume(world_size, out_dir, tokenizer_path, case="packing_bfd_padding_free"):
    """A checkpoint of step 2 written by one CephaloSFTTrainer, resumed by a fresh one (the
    tiny Llama's special tokens differ from the tokenizer's: Trainer.train realigns them)."""
    from hf_cephalo.integrations import CephaloSFTConfig, CephaloSFTTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    kwargs = {**_sft_kwargs(case, os.path.join(out_dir, "resume")), "save_strategy": "steps",
              "save_steps": 2}
    states = []
    for resume in (None, os.path.join(kwargs["output_dir"], "checkpoint-2")):
        trainer = CephaloSFTTrainer(model=tiny_llama(len(tokenizer)),
                                    args=CephaloSFTConfig(**kwargs), processing_class=tokenizer,
                                    train_dataset=_datasets(case)[0], plan=plan(world_size))
        trainer.train(resume_from_checkpoint=resume)
        states.append({"logs": _logs(trainer.state.log_history),
                       "state": {k: v.detach().clone()
                                 for k, v in trainer.unshard_model().state_dict().items()}})
    return states


def _cephalo_sft(case, world_size, out_dir, tokenizer_path):
    from hf_cephalo.integrations import CephaloSFTConfig, CephaloSFTTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    train, evaluation = _datasets(case)
    args = CephaloSFTConfig(**_sft_kwargs(case, os.path.join(out_dir, f"w{world_size}")),
                            per_device_eval_batch_size=1)
    trainer = CephaloSFTTrainer(model=tiny_llama(len(tokenizer)), args=args, train_dataset=train,
                                eval_dataset=evaluation, processing_class=tokenizer,
                                plan=plan(world_size))
    trainer.train()
    out = {"logs": _logs(trainer.state.log_history)}
    if evaluation is not None:
        out["eval"] = trainer.evaluate()
    model = trainer.unshard_model()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


# a user loss in the HF convention that logs its own metrics through gather_for_metrics, as
# TRL's trainers do: 0-dim sums (tokens, correct tokens) and per-sample rows (each row's summed
# loss, of which the metric takes a maximum: a function of every row, not of sums)
class _GatherMetricsMixin:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        logits, labels = outputs.logits[:, :-1], inputs["labels"][:, 1:]
        mask = labels != -100
        per_token = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels.clamp(min=0), reduction="none") * mask
        loss = per_token.sum() / num_items_in_batch
        tokens = self.accelerator.gather_for_metrics(mask.sum()).sum()
        correct = self.accelerator.gather_for_metrics(
            ((logits.argmax(-1) == labels) & mask).sum()).sum()
        rows = self.accelerator.gather_for_metrics(per_token.sum(-1).detach())
        self._my_metrics.setdefault("accuracy", []).append((correct / tokens).item())
        self._my_metrics.setdefault("max_row_loss", []).append(rows.max().item())
        self._my_metrics.setdefault("rows", []).append(rows.numel())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, start_time=None):
        logs.update({k: sum(v) / len(v) for k, v in self._my_metrics.items()})
        self._my_metrics.clear()
        super().log(logs, start_time)


class _RawCollectiveMixin:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model(**inputs).loss
        torch.distributed.all_reduce(loss.detach().clone())  # would pair the wrong calls
        return loss


def _user_trainer(mixin, world_size, out_dir):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from tests.models_fixtures import build
    from tests.test_trainer_parity import _collate, _samples

    cls = type(f"Cephalo{mixin.__name__}", (mixin, CephaloTrainer), {})
    args = CephaloTrainingArguments(**_user_args(os.path.join(out_dir, mixin.__name__)))
    trainer = cls(model=build("llama"), args=args, plan=plan(world_size),
                  data_collator=_collate, train_dataset=_samples(3 * B, 0))
    trainer._my_metrics = {}
    return trainer


def _user_args(out_dir):
    return dict(output_dir=out_dir, report_to="none", optim="sgd", learning_rate=0.1,
                max_steps=STEPS, logging_steps=1, save_strategy="no", seed=SEED,
                train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True)


def _cephalo_gather_metrics(world_size, out_dir):
    trainer = _user_trainer(_GatherMetricsMixin, world_size, out_dir)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "accuracy" in h]
    return {"logs": {k: [h[k] for h in logs] for k in ("loss", "accuracy", "max_row_loss",
                                                         "rows")},
            "state": {k: v.detach().clone()
                      for k, v in trainer.unshard_model().state_dict().items()}}


def _cephalo_raw_collective(world_size, out_dir):
    from hf_cephalo.runtime.head_calls import HeadCallError

    trainer = _user_trainer(_RawCollectiveMixin, world_size, out_dir)
    try:
        trainer.train()
    except HeadCallError as exc:
        return {"error": str(exc), "steps": trainer.state.global_step}
    return {"error": None, "steps": trainer.state.global_step}


# one run_ranks per world size, every sub-case inside (measured: 43 s and 54 s at load 11)
QUIET_S = {2: 45.0, 3: 60.0}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    offline_env()
    return save_tokenizer(str(tmp_path_factory.mktemp("chat_tokenizer")))


_RUNS: dict = {}


def _cephalo(world_size, tmp_path_factory, tokenizer_path):
    from tests.dist_utils import budget_s

    if world_size not in _RUNS:
        out_dir = str(tmp_path_factory.mktemp(f"cephalo_sft_w{world_size}"))
        _RUNS[world_size] = run_ranks(_worker, world_size, out_dir, tokenizer_path,
                                      timeout_s=budget_s(QUIET_S[world_size]))
    return _RUNS[world_size]


# ---- the stock side -------------------------------------------------------------------------

_STOCK: dict = {}


def _stock_sft(case, tmp_path_factory, tokenizer_path):
    if case not in _STOCK:
        from trl import SFTConfig, SFTTrainer

        offline_env()
        tokenizer = load_tokenizer(tokenizer_path)
        train, evaluation = _datasets(case)
        out_dir = str(tmp_path_factory.mktemp("stock_sft"))
        args = SFTConfig(**_sft_kwargs(case, out_dir), per_device_train_batch_size=B,
                         per_device_eval_batch_size=B)
        model = tiny_llama(len(tokenizer))
        trainer = SFTTrainer(model=model, args=args, train_dataset=train,
                             eval_dataset=evaluation, processing_class=tokenizer)
        trainer.train()
        out = {"logs": _logs(trainer.state.log_history),
               "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        if evaluation is not None:
            out["eval"] = trainer.evaluate()
        _STOCK[case] = out
    return _STOCK[case]


def _stock_user(mixin, tmp_path_factory):
    key = mixin.__name__
    if key not in _STOCK:
        import transformers

        from tests.models_fixtures import build
        from tests.test_trainer_parity import _collate, _samples

        cls = type(f"Stock{mixin.__name__}", (mixin, transformers.Trainer), {})
        model = build("llama")
        args = transformers.TrainingArguments(
            per_device_train_batch_size=B,
            **_user_args(str(tmp_path_factory.mktemp("stock_user"))))
        trainer = cls(model=model, args=args, data_collator=_collate,
                      train_dataset=_samples(3 * B, 0))
        trainer._my_metrics = {}
        trainer.train()
        logs = [h for h in trainer.state.log_history if "accuracy" in h]
        _STOCK[key] = {"logs": {k: [h[k] for h in logs]
                                for k in ("loss", "accuracy", "max_row_loss", "rows")},
                       "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return _STOCK[key]


def _close(got, ref, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(ref, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


def _assert_same_run(got, ref, metrics=METRICS):
    for metric in metrics:
        assert len(got["logs"][metric]) == len(ref["logs"][metric]) == STEPS, metric
        _close(got["logs"][metric], ref["logs"][metric], metric)
    assert_same_state(got["state"], ref["state"], RTOL, ATOL)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_matches_stock(case, world_size, tmp_path_factory, tokenizer_path):
    """Every SFT setting, 2 and 3 ranks (uneven plan; different l_i and an idle rank): per-step
    loss, grad_norm, entropy, mean_token_accuracy and num_tokens, and the final weights, equal
    stock SFTTrainer's on one process with the whole global batch."""
    ref = _stock_sft(case, tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        _assert_same_run(rank_result[case], ref)
    # the run trained and the metrics are informative (a test that cannot fail is a defect)
    assert ref["logs"]["loss"][0] != ref["logs"]["loss"][-1]
    assert ref["logs"]["num_tokens"][-1] > ref["logs"]["num_tokens"][0] > 0


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_sft_settings_differ(tmp_path_factory, tokenizer_path):
    """The sub-cases are different runs (each setting changes the numbers), and some step's
    token accuracy is above zero, so mean_token_accuracy is compared on real values."""
    losses = {case: _stock_sft(case, tmp_path_factory, tokenizer_path)["logs"]["loss"][0]
              for case in SFT_CASES}
    assert len({round(v, 6) for v in losses.values()}) == len(losses), losses
    assert any(max(_stock_sft(case, tmp_path_factory, tokenizer_path)["logs"]
                   ["mean_token_accuracy"]) > 0 for case in SFT_CASES)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sft_eval_metrics_match_stock(world_size, tmp_path_factory, tokenizer_path):
    """evaluate(): TRL's eval entropy / mean_token_accuracy per global eval batch (stock: one
    process, per_device_eval_batch_size = the global batch) are stock's."""
    ref = _stock_sft(EVAL_CASE, tmp_path_factory, tokenizer_path)["eval"]
    for rank_result in _cephalo(world_size, tmp_path_factory, tokenizer_path):
        got = rank_result[EVAL_CASE]["eval"]
        for key in ("eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"):
            _close([got[key]], [ref[key]], key)


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_sft_resume_from_checkpoint(tmp_path_factory, tokenizer_path):
    """2 ranks, padding-free packing: resuming the step-2 checkpoint gives step 3's loss,
    metrics and weights of the uninterrupted run (stock's on one process). TRL keeps its token
    counter outside the checkpoint (stock SFTTrainer restarts num_tokens at 0 on resume too):
    the resumed step 3 counts its own tokens."""
    ref = _stock_sft("packing_bfd_padding_free", tmp_path_factory, tokenizer_path)
    for rank_result in _cephalo(2, tmp_path_factory, tokenizer_path):
        full, resumed = rank_result["resume"]
        _assert_same_run(full, ref)
        # steps 1-2 come from the checkpoint's trainer_state.json, step 3 is trained again
        _assert_same_run(resumed, ref, metrics=[m for m in METRICS if m != "num_tokens"])
        tokens = ref["logs"]["num_tokens"]
        assert resumed["logs"]["num_tokens"] == [*tokens[:2], tokens[2] - tokens[1]]


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_user_compute_loss_gather_for_metrics(tmp_path_factory, tokenizer_path):
    """A user compute_loss calling gather_for_metrics three times per call, on 2 ranks with
    l = [1, 3] plus an idle rank: completes, and its metrics (token accuracy from 0-dim sums,
    the largest per-row loss over every row of the global batch), the loss and the weights
    equal stock Trainer's on one process."""
    ref = _stock_user(_GatherMetricsMixin, tmp_path_factory)
    for rank_result in _cephalo(3, tmp_path_factory, tokenizer_path):
        got = rank_result["gather_metrics"]
        assert got["logs"]["rows"] == ref["logs"]["rows"] == [B] * STEPS  # every row once
        _assert_same_run(got, ref, metrics=("loss", "accuracy", "max_row_loss"))


@test_timeout(QUIET_S[2], QUIET_S[3], margin_s=240)
def test_raw_collective_in_loss_refused_on_every_rank(tmp_path_factory, tokenizer_path):
    """torch.distributed.all_reduce inside compute_loss (ranks run 1, 3 and 0 microbatches):
    every rank raises the same HeadCallError at the first step's exchange, no update applied,
    nothing hangs."""
    results = [r["raw_collective"] for r in _cephalo(3, tmp_path_factory, tokenizer_path)]
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    (error,) = errors
    assert "torch.distributed.all_reduce" in error and "rank(s) [0, 1]" in error, error
    assert all(r["steps"] == 0 for r in results)
