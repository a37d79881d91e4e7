"""CephaloTrainer vs STOCK Trainer (issue 13): the same options give the same numbers.

One run_ranks call (2 gloo ranks, plan b = [1, 3], m = [1, 2]) trains every sub-case through
CephaloTrainer; the test process trains the same sub-cases with stock ``Trainer`` in one process
(per_device_train_batch_size = 4 = the global batch, sequential order, so both see the same
global batches) and compares the logged losses and gradient norms and the final weights (the
user's model object after ``trainer.unshard_model()``). fp32, SGD/AdamW, tolerances as
tests/test_engine_parity.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from hf_cephalo.runtime.sampler import WeightedBatchSampler
from tests.dist_utils import run_ranks
from tests.models_fixtures import build

RTOL, ATOL = 1e-5, 1e-6
LR, MAX_NORM, SEED, N_TRAIN, STEPS = 0.1, 0.5, 7, 8, 2
SIZES, MICRO, RATIOS = [1, 3], [1, 2], [0.35, 0.65]
# Llama with biases (attention and MLP) as well as RMSNorm scales: weight decay must skip both.
# (GPT-2, whose loss stock divides by the UNSHIFTED label count since its loss_type is None:
# tests/test_stock_loss_type.py.)
CONFIG = {"llama_bias": dict(attention_bias=True, mlp_bias=True)}
ARCH = {"llama_bias": "llama"}


def _samples(n: int, seed: int, labels: bool = True) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (12,), generator=g)
        row = {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long)}
        if labels:
            lab = ids.clone()
            lab[: int(torch.randint(0, 6, (), generator=g))] = -100  # uneven item counts
            row["labels"] = lab
        rows.append(row)
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def squares_loss(outputs, labels, num_items_in_batch=None):
    """A user loss in the HF convention: a sum over scored tokens / num_items_in_batch."""
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0),
                                                  reduction="none") + 0.01 * logits.pow(2).mean(-1)
    return (per_token * (targets != -100)).sum() / num_items_in_batch


class _OverrideMixin:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        labels = inputs["labels"][..., 1:]
        extra = outputs.logits[..., :-1, :].pow(2).mean(-1)[labels != -100].sum() / num_items_in_batch
        loss = outputs.loss + 0.05 * extra
        return (loss, outputs) if return_outputs else loss


class StockOverride(_OverrideMixin, transformers.Trainer):
    pass


def _cephalo_override():
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer

    return type("CephaloOverride", (_OverrideMixin, CephaloTrainer), {})


# sub-case: (arch, TrainingArguments overrides, Trainer kwargs name)
CASES = {
    "plain": ("llama", {}, None),
    "optimizer_cls": ("llama", {}, "optimizer_cls"),
    "label_smoothing": ("llama", dict(label_smoothing_factor=0.1), None),
    "loss_func": ("llama", {}, "loss_func"),
    "loss_override": ("llama", {}, "override"),
    "weight_decay_sgd": ("llama_bias", dict(weight_decay=0.5), None),
    # a large epsilon: Adam's g / (|g| + eps) would turn fp32 rounding noise in near-zero
    # gradients into full-size updates (as the other cases use SGD to avoid)
    "weight_decay_adamw": ("llama_bias", dict(weight_decay=0.5, optim="adamw_torch",
                                              learning_rate=0.01, adam_epsilon=1e-3), None),
    "gradient_checkpointing": ("llama", dict(gradient_checkpointing=True), None),
}


def _trainer_kwargs(kind):
    if kind == "optimizer_cls":
        return dict(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": LR, "momentum": 0.5}))
    if kind == "loss_func":
        return dict(compute_loss_func=squares_loss)
    return {}


def _args_kwargs(case: str, out_dir: str) -> dict:
    _, extra, _ = CASES[case]
    return {**dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                   learning_rate=LR, max_grad_norm=MAX_NORM, max_steps=STEPS, logging_steps=1,
                   save_strategy="no", seed=SEED, train_sampling_strategy="sequential",
                   disable_tqdm=True, use_cpu=True), **extra}


def _logs(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


# ---- the 2-rank side -------------------------------------------------------------------------

def _worker(rank, world_size, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    results = {case: _cephalo_case(case, out_dir) for case in CASES}
    results["model_object"] = _model_object_case(out_dir)
    results["loaders"] = _loader_case(out_dir)
    return _to_numpy(results)


def _to_numpy(obj):
    """Tensors as numpy arrays: torch.multiprocessing would pass tensors as shared-memory file
    descriptors that die with the worker."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _cephalo_trainer(case, out_dir, **kwargs):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    arch, _, kind = CASES[case]
    cls = _cephalo_override() if kind == "override" else CephaloTrainer
    args = CephaloTrainingArguments(**{**_args_kwargs(case, out_dir), **kwargs.pop("args", {})})
    return cls(model=build(ARCH.get(arch, arch), **CONFIG.get(arch, {})), args=args,
               plan=Plan.from_ratios(SIZES, MICRO, RATIOS), data_collator=_collate,
               train_dataset=_samples(N_TRAIN, 0), **_trainer_kwargs(kind), **kwargs)


def _cephalo_case(case, out_dir):
    trainer = _cephalo_trainer(case, out_dir)
    layer_calls = []
    layer = trainer.engine.staged.units()[0]
    hook = layer.register_forward_hook(lambda *a: layer_calls.append(1))
    trainer.train()
    hook.remove()
    losses, norms = _logs(trainer)
    model = trainer.unshard_model()
    return dict(losses=losses, norms=norms,
                state={k: v.detach().clone() for k, v in model.state_dict().items()},
                layer_calls=len(layer_calls),
                model_checkpointing=any(getattr(m, "gradient_checkpointing", False) is True
                                        for m in model.modules()),
                args_checkpointing=(trainer.args.gradient_checkpointing,
                                    trainer.args.activation_checkpointing))


def _model_object_case(out_dir):
    """The user's model object: guarded while sharded, usable after unshard_model(); predict
    without labels returns predictions and no loss."""
    trainer = _cephalo_trainer("plain", out_dir)
    model = trainer.model
    trainer.train()
    batch = _collate(_samples(2, 3, labels=False))
    errors = []
    for call in (lambda: model(**batch),
                 lambda: model.save_pretrained(os.path.join(out_dir, "hollow"))):
        try:
            call()
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    unlabeled = trainer.predict(_samples(5, 3, labels=False))
    trainer.unshard_model()
    with torch.no_grad():
        logits = model(**batch).logits
    saved = os.path.join(out_dir, f"restored_rank{torch.distributed.get_rank()}")
    model.save_pretrained(saved)
    return dict(errors=errors, logits=logits, saved=saved,
                predictions=unlabeled.predictions, label_ids=unlabeled.label_ids,
                metrics=unlabeled.metrics)


def _loader_case(out_dir):
    """sequential / group_by_length / dataloader_drop_last: this rank's per-step indices."""
    import datasets

    rows = _samples(10, 5)
    lengths = [3, 9, 4, 12, 1, 7, 7, 2, 11, 5]
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                     "labels": [r["labels"].tolist() for r in rows],
                                     "length": lengths})
    out = {}
    for name, extra in (("sequential", dict(train_sampling_strategy="sequential")),
                        ("group_by_length", dict(train_sampling_strategy="group_by_length")),
                        ("drop_last", dict(dataloader_drop_last=True))):
        trainer = _cephalo_trainer("plain", out_dir, args=extra)
        trainer.train_dataset = ds
        loader = trainer.get_train_dataloader()
        out[name] = loader.batch_sampler.local_batches()  # this rank's rows of each step
    return out


@pytest.fixture(scope="module")
def cephalo(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("parity"))
    return run_ranks(_worker, 2, out_dir, timeout_s=420)


# ---- the stock side ----------------------------------------------------------------------------

_STOCK: dict = {}


def _stock(case, tmp_path_factory):
    if case not in _STOCK:
        arch, _, kind = CASES[case]
        out_dir = str(tmp_path_factory.mktemp("stock"))
        cls = StockOverride if kind == "override" else transformers.Trainer
        args = transformers.TrainingArguments(per_device_train_batch_size=sum(SIZES),
                                              **_args_kwargs(case, out_dir))
        model = build(ARCH.get(arch, arch), **CONFIG.get(arch, {}))
        trainer = cls(model=model, args=args, data_collator=_collate,
                      train_dataset=_samples(N_TRAIN, 0), **_trainer_kwargs(kind))
        trainer.train()
        losses, norms = _logs(trainer)
        _STOCK[case] = dict(losses=losses, norms=norms, model=model,
                            state={k: v.detach().clone() for k, v in model.state_dict().items()})
    return _STOCK[case]


def _assert_same_run(got, ref):
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                               torch.tensor(ref["norms"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
    assert set(got["state"]) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(torch.as_tensor(got["state"][key]), value, rtol=RTOL, atol=ATOL,
                                   msg=key)


@pytest.mark.parametrize("case", ["plain", "optimizer_cls"])
def test_matches_stock_trainer(cephalo, tmp_path_factory, case):
    """No option (and optimizer_cls_and_kwargs): same losses, norms and final weights."""
    for rank_result in cephalo:
        _assert_same_run(rank_result[case], _stock(case, tmp_path_factory))
    assert max(_stock(case, tmp_path_factory)["norms"]) > MAX_NORM  # clipping was active


def test_label_smoothing_as_stock(cephalo, tmp_path_factory):
    """label_smoothing_factor=0.1: stock's LabelSmoother, normalized by the global count."""
    ref = _stock("label_smoothing", tmp_path_factory)
    for rank_result in cephalo:
        _assert_same_run(rank_result["label_smoothing"], ref)
    assert abs(ref["losses"][0] - _stock("plain", tmp_path_factory)["losses"][0]) > 1e-4


def test_compute_loss_func_as_stock(cephalo, tmp_path_factory):
    ref = _stock("loss_func", tmp_path_factory)
    for rank_result in cephalo:
        _assert_same_run(rank_result["loss_func"], ref)
    assert abs(ref["losses"][0] - _stock("plain", tmp_path_factory)["losses"][0]) > 1e-4


def test_compute_loss_override_as_stock(cephalo, tmp_path_factory):
    ref = _stock("loss_override", tmp_path_factory)
    for rank_result in cephalo:
        _assert_same_run(rank_result["loss_override"], ref)
    assert abs(ref["losses"][0] - _stock("plain", tmp_path_factory)["losses"][0]) > 1e-4


@pytest.mark.parametrize("case", ["weight_decay_sgd", "weight_decay_adamw"])
def test_weight_decay_as_stock(cephalo, tmp_path_factory, case):
    """Biases and LayerNorm weights are not decayed (stock get_decay_parameter_names)."""
    ref = _stock(case, tmp_path_factory)
    for rank_result in cephalo:
        _assert_same_run(rank_result[case], ref)


def test_gradient_checkpointing_recomputes_once(cephalo, tmp_path_factory):
    """The engine's recompute is the checkpointing: layer 0 runs as often as without the flag
    (forward + one recompute per microbatch), the model's own checkpointing stays off, and the
    numbers equal stock Trainer's with gradient_checkpointing=True."""
    for rank, rank_result in enumerate(cephalo):
        got, plain = rank_result["gradient_checkpointing"], rank_result["plain"]
        num_microbatches = -(-SIZES[rank] // MICRO[rank])
        assert got["layer_calls"] == plain["layer_calls"] == 2 * num_microbatches * STEPS
        assert not got["model_checkpointing"] and got["args_checkpointing"] == (False, False)
        _assert_same_run(got, _stock("gradient_checkpointing", tmp_path_factory))


def test_model_object_after_train(cephalo, tmp_path_factory):
    """While sharded, calling the user's model or save_pretrained raises naming
    trainer.save_model; after trainer.unshard_model() it computes stock's logits and saves a
    loadable checkpoint."""
    ref = _stock("plain", tmp_path_factory)["model"].eval()
    batch = _collate(_samples(2, 3, labels=False))
    with torch.no_grad():
        ref_logits = ref(**batch).logits
    for rank_result in cephalo:
        got = rank_result["model_object"]
        assert all(e is not None and "trainer.save_model" in e for e in got["errors"]), got["errors"]
        torch.testing.assert_close(torch.as_tensor(got["logits"]), ref_logits, rtol=RTOL, atol=ATOL)
    loaded = type(ref).from_pretrained(cephalo[0]["model_object"]["saved"]).eval()  # rank 0 writes
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, ref_logits, rtol=RTOL, atol=ATOL)


def test_predict_without_labels_as_stock(cephalo, tmp_path_factory):
    """predict() on a dataset without labels: predictions, no label_ids and no loss (stock)."""
    ref = _stock("plain", tmp_path_factory)["model"].eval()
    with torch.no_grad():
        ref_logits = ref(**_collate(_samples(5, 3, labels=False))).logits
    for rank_result in cephalo:
        got = rank_result["model_object"]
        assert got["label_ids"] is None and "test_loss" not in got["metrics"], got["metrics"]
        torch.testing.assert_close(torch.as_tensor(got["predictions"]), ref_logits,
                                   rtol=RTOL, atol=ATOL)


def test_sampling_strategies_as_stock(cephalo):
    """sequential: stock's global batches in dataset order; group_by_length: stock's
    get_length_grouped_indices over the 'length' column (generator seed + epoch), both split by
    b_i; every rank's share of each global batch is its b_i slice."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = [3, 9, 4, 12, 1, 7, 7, 2, 11, 5]
    B = sum(SIZES)
    g = torch.Generator().manual_seed(SEED)
    grouped = get_length_grouped_indices(lengths, B, generator=g)
    for order, name in ((list(range(10)), "sequential"), (grouped, "group_by_length")):
        batches = [order[i:i + B] for i in range(0, 10, B)]
        steps = [cephalo[0]["loaders"][name][s] + cephalo[1]["loaders"][name][s]
                 for s in range(len(batches))]
        assert steps == batches, (name, steps, batches)
    assert cephalo[0]["loaders"]["group_by_length"][0] == [grouped[0]]
    assert lengths[grouped[0]] == max(lengths)  # longest first, as stock


def test_loader_options(cephalo):
    """dataloader_drop_last drops the last partial GLOBAL batch (10 samples, B = 4: 2 steps)."""
    for rank, rank_result in enumerate(cephalo):
        steps = rank_result["loaders"]["drop_last"]
        assert [len(s) for s in steps] == [SIZES[rank]] * 2


def test_group_by_length_sampler_unit():
    """WeightedBatchSampler with lengths: every sample once, stock grouping per epoch."""
    lengths = [5, 1, 8, 3, 3, 9, 2]
    seen = []
    for rank in range(2):
        sampler = WeightedBatchSampler(7, SIZES, rank, seed=3, lengths=lengths)
        sampler.set_epoch(1)
        seen += [i for b in sampler for i in b]
    assert sorted(seen) == list(range(7))
    with pytest.raises(ValueError, match="2 lengths for 7 samples"):
        WeightedBatchSampler(7, SIZES, 0, lengths=[1, 2])
