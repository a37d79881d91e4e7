"""Stock scripts CephaloTrainer used to refuse (issue 31, item 5), with stock Trainer's numbers.

- ``gradient_accumulation_steps = 4``: B = per-device x world x 4; stock's step counts, epoch
  fractions, learning rates, logged losses (stock's ``num_items_in_batch``), gradient norms and
  final weights; a resume mid-epoch through the loader's stand-ins;
- ``optimizers=(AdamW with a no-decay group built by parameter name, LambdaLR)`` built before
  the trainer: re-pointed in place (same objects, class, groups, hyperparameters);
- a ``datasets`` stream (``to_iterable_dataset`` + a seeded shuffle buffer, ``max_steps``
  beyond one pass, so ``set_epoch`` matters), alone, with ``gradient_accumulation_steps`` and
  resumed mid-epoch from a checkpoint.

ONE run_ranks call per world size (2 ranks: b = [3, 5]; 3 ranks: b = [4, 0, 8], rank 1 idle,
uneven state) trains every sub-case; the test process trains each with stock ``Trainer`` on
ONE process over the full global batch (per-device B / k with k accumulation steps), sequential
order. fp32, rtol 1e-5 / atol 1e-6. Adam's eps is 1e-4 (a near-zero true gradient's rounding
noise would otherwise become +-lr steps that depend on the reduction order:
tests/test_checkpoint_trainer.py); the other cases use SGD.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests.dist_utils import budget_s, portable, run_ranks, test_timeout
from tests.models_fixtures import build

RTOL, ATOL = 1e-5, 1e-6
K = 4  # gradient_accumulation_steps
WORLDS = {2: ([3, 5], [1, 2], [0.35, 0.65]),  # B = 8 = 1 per device x 2 x K
          3: ([4, 0, 8], [2, 0, 3], [0.2, 0.3, 0.5])}  # B = 12 = 1 x 3 x K; rank 1 idle
# Seconds per world's job, measured on the 2-core machine under load ~7 (42 s and 62 s):
# [Note: test time budgets] in dist_utils.py.
JOB_S = {2: 45.0, 3: 65.0}
pytestmark = test_timeout(*JOB_S.values(), margin_s=120)
ARCH = {"optimizers": dict(attention_bias=True, mlp_bias=True)}  # biases for the no-decay group


def _rows(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 97, (12,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100  # uneven item counts
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * 12,
                     "labels": labels.tolist()})
    return rows


def _collate(rows):
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def _stream(num_rows: int):
    """A datasets stream with a seeded shuffle buffer (each pass, set_epoch, reorders it)."""
    import datasets

    rows = _rows(num_rows, seed=1)
    table = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})
    return table.to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=5)


def _no_decay(name: str) -> bool:
    return "bias" in name or "norm" in name


def _optimizers(model):
    """AdamW with a decay group and a no-decay group (own lr) chosen by parameter NAME, and a
    LambdaLR over it: built before the trainer, as a stock script does."""
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
         {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": 0.02}],
        lr=0.01, eps=1e-4, betas=(0.8, 0.9))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))


# sub-case: (TrainingArguments overrides, train dataset as a function of B, k)
CASES = {
    "ga4": (dict(num_train_epochs=2, gradient_accumulation_steps=K, save_strategy="steps",
                 save_steps=4),
            lambda B: _rows(B * 5 // 2)),  # 2 full global batches and a half: 3 steps/epoch
    "optimizers": (dict(max_steps=4, save_strategy="steps", save_steps=2),
                   lambda B: _rows(B * 5 // 2)),
    "stream": (dict(max_steps=5, save_strategy="steps", save_steps=2),
               lambda B: _stream(B * 5 // 2)),  # one pass: 3 steps, the last one short
    "stream_ga4": (dict(max_steps=3, gradient_accumulation_steps=K),
                   lambda B: _stream(2 * B)),  # one pass: 2 steps
}


def _args_kwargs(case: str, out_dir: str) -> dict:
    extra, _ = CASES[case]
    return {**dict(output_dir=os.path.join(out_dir, case), report_to="none", optim="sgd",
                   learning_rate=0.05, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                   seed=7, train_sampling_strategy="sequential", disable_tqdm=True,
                   use_cpu=True), **extra}


def _summary(trainer, model) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(logs=[{k: h[k] for k in ("step", "epoch", "loss", "grad_norm", "learning_rate")}
                      for h in logs],
                global_step=trainer.state.global_step,
                state={k: v.detach().clone() for k, v in model.state_dict().items()})


# ---- the multi-rank side --------------------------------------------------------------------

def _cephalo(case, out_dir, sizes, resume=None, **overrides):
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from hf_cephalo.planner import Plan

    B = sum(sizes[0])
    model = build("llama", **ARCH.get(case, {}))
    kwargs = dict(optimizers=_optimizers(model)) if case == "optimizers" else {}
    args = CephaloTrainingArguments(per_device_train_batch_size=1,
                                    **{**_args_kwargs(case, out_dir), **overrides})
    trainer = CephaloTrainer(model=model, args=args, plan=Plan.from_ratios(*sizes),
                             data_collator=_collate, train_dataset=CASES[case][1](B), **kwargs)
    out = {}
    if case == "optimizers":  # the user's objects, re-pointed in place
        optimizer, scheduler = kwargs["optimizers"]
        shards = trainer.engine.param_shards
        out["same_objects"] = (trainer.optimizer is optimizer,
                               trainer.lr_scheduler is scheduler,
                               scheduler.optimizer is optimizer)
        out["groups"] = [({k: v for k, v in g.items() if k != "params"},
                          sorted(n for n, p in shards.named_parameters()
                                 if any(p is q for q in g["params"])))
                         for g in optimizer.param_groups]
    if case.startswith("ga"):
        out["loader_len"] = len(trainer.get_train_dataloader())
    trainer.train(resume_from_checkpoint=resume)
    return {**out, **_summary(trainer, trainer.unshard_model())}


def _worker(rank, world_size, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    sizes = WORLDS[world_size]
    out_dir = os.path.join(out_dir, str(world_size))
    results = {case: _cephalo(case, out_dir, sizes) for case in CASES}
    # resumed mid-epoch: the stream from checkpoint-2 (2 of the first pass's 3 steps), the
    # accumulating run from checkpoint-4 (1 of the second epoch's 3 steps), the user's
    # optimizer and scheduler from checkpoint-2 (their state)
    for case, step in (("stream", 2), ("ga4", 4), ("optimizers", 2)):
        results[f"{case}_resumed"] = _cephalo(
            case, os.path.join(out_dir, "resumed"), sizes, save_strategy="no",
            resume=os.path.join(out_dir, case, f"checkpoint-{step}"))
    return portable(results, to_numpy=True)


@pytest.fixture(scope="module")
def cephalo(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("lifted"))
    return {w: portable(run_ranks(_worker, w, out_dir, timeout_s=budget_s(JOB_S[w])), False)
            for w in WORLDS}


# ---- the stock side (one process, the full global batch) -------------------------------------

_STOCK: dict = {}


def _stock(case, world, tmp_path_factory, *, k=None):
    """Stock Trainer on one process: per-device batch B / k with k accumulation steps."""
    key = (case, world, k)
    if key not in _STOCK:
        extra, dataset = CASES[case]
        B = sum(WORLDS[world][0])
        kwargs = _args_kwargs(case, str(tmp_path_factory.mktemp("stock")))
        k = kwargs.get("gradient_accumulation_steps", 1) if k is None else k
        kwargs.update(gradient_accumulation_steps=k, save_strategy="no")
        args = transformers.TrainingArguments(per_device_train_batch_size=B // k, **kwargs)
        model = build("llama", **ARCH.get(case, {}))
        extra_kwargs = dict(optimizers=_optimizers(model)) if case == "optimizers" else {}
        trainer = transformers.Trainer(model=model, args=args, data_collator=_collate,
                                       train_dataset=dataset(B), **extra_kwargs)
        trainer.train()
        _STOCK[key] = _summary(trainer, model)
        if not case.startswith("stream"):
            _STOCK[key]["loader_len"] = len(trainer.get_train_dataloader())
    return _STOCK[key]


def _max_diffs(got, ref) -> dict[str, float]:
    """The largest absolute differences (reported by the test on failure and in -s output)."""
    def diff(key):
        return max(abs(a[key] - b[key]) for a, b in zip(got["logs"], ref["logs"]))
    return dict(loss=diff("loss"), grad_norm=diff("grad_norm"),
                weights=max(float((torch.as_tensor(got["state"][k]) - v).abs().max())
                            for k, v in ref["state"].items()))


def _assert_same_run(got, ref, what):
    """Same steps, epochs and learning rates; losses, gradient norms and final weights equal
    to fp32 rounding."""
    assert [h["step"] for h in got["logs"]] == [h["step"] for h in ref["logs"]], what
    for key in ("epoch", "learning_rate"):
        assert [h[key] for h in got["logs"]] == pytest.approx([h[key] for h in ref["logs"]],
                                                              rel=1e-12), (what, key)
    assert got["global_step"] == ref["global_step"], what
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([h[key] for h in got["logs"]], dtype=torch.float64),
                                   torch.tensor([h[key] for h in ref["logs"]], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL, msg=f"{what}: {key}")
    assert set(got["state"]) == set(ref["state"]), what
    for key, value in ref["state"].items():
        torch.testing.assert_close(torch.as_tensor(got["state"][key]), value, rtol=RTOL,
                                   atol=ATOL, msg=f"{what}: {key}")
    print(what, "max |difference| vs stock:", _max_diffs(got, ref))


@pytest.mark.parametrize("world", WORLDS)
def test_gradient_accumulation_as_stock(cephalo, tmp_path_factory, world):
    """k = 4: stock's loader length (per-device batches), 3 optimizer steps per epoch, epoch
    fractions 0.4 / 0.8 / 1.0, losses with num_items_in_batch, norms, weights, also resumed
    mid-epoch; and stock with k = 4 equals stock over the whole global batch at once (what both
    compute)."""
    ref = _stock("ga4", world, tmp_path_factory)
    assert [h["epoch"] for h in ref["logs"]][:3] == pytest.approx([0.4, 0.8, 1.0])
    for rank, got in enumerate(cephalo[world]):
        assert got["ga4"]["loader_len"] == ref["loader_len"] == 10
        _assert_same_run(got["ga4"], ref, f"ga4, {world} ranks, rank {rank}")
        resumed = got["ga4_resumed"]  # from checkpoint-4: 1 global batch of epoch 2 skipped
        assert [h["step"] for h in resumed["logs"]] == [1, 2, 3, 4, 5, 6]
        _assert_same_run(resumed, ref, f"ga4 resumed, {world} ranks, rank {rank}")
    whole = _stock("ga4", world, tmp_path_factory, k=1)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([h[key] for h in whole["logs"]]),
                                   torch.tensor([h[key] for h in ref["logs"]]),
                                   rtol=RTOL, atol=ATOL)
    for key, value in ref["state"].items():
        torch.testing.assert_close(whole["state"][key], value, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("world", WORLDS)
def test_optimizers_as_stock(cephalo, tmp_path_factory, world):
    """optimizers=(AdamW by-name groups, LambdaLR): the same objects, each group's
    hyperparameters and parameters (by name), and stock's run, also resumed from a
    checkpoint."""
    ref = _stock("optimizers", world, tmp_path_factory)
    model = build("llama", **ARCH["optimizers"])
    names = [n for n, _ in model.named_parameters()]
    for rank, got in enumerate(cephalo[world]):
        run = got["optimizers"]
        assert run["same_objects"] == [True, True, True]
        (decay, decay_names), (no_decay, no_decay_names) = run["groups"]
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert decay["initial_lr"] == 0.01 and no_decay["initial_lr"] == 0.02
        assert decay["eps"] == no_decay["eps"] == 1e-4
        assert decay_names == sorted(n for n in names if not _no_decay(n))
        assert no_decay_names == sorted(n for n in names if _no_decay(n))
        _assert_same_run(run, ref, f"optimizers, {world} ranks, rank {rank}")
        # resumed from checkpoint-2: AdamW's moments and LambdaLR's position restored
        _assert_same_run(got["optimizers_resumed"], ref,
                         f"optimizers resumed, {world} ranks, rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_streamed_dataset_as_stock(cephalo, tmp_path_factory, world):
    """A stream over two passes (the first ends with a short global batch), alone and with
    k = 4 accumulation steps: stock's steps, epochs, numbers."""
    ref = _stock("stream", world, tmp_path_factory)
    assert [h["epoch"] for h in ref["logs"]] == pytest.approx([0.2, 0.4, 0.6, 1.2, 1.4])
    ref_ga = _stock("stream_ga4", world, tmp_path_factory)
    for rank, got in enumerate(cephalo[world]):
        _assert_same_run(got["stream"], ref, f"stream, {world} ranks, rank {rank}")
        _assert_same_run(got["stream_ga4"], ref_ga, f"stream_ga4, {world} ranks, rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_streamed_resume_mid_epoch(cephalo, tmp_path_factory, world):
    """Resumed from checkpoint-2 (2 of the first pass's 3 global batches consumed): the
    consumed batches are skipped, steps 3-5 and the final weights are stock's uninterrupted
    run's."""
    ref = _stock("stream", world, tmp_path_factory)
    for rank, got in enumerate(cephalo[world]):
        resumed = got["stream_resumed"]
        assert [h["step"] for h in resumed["logs"]] == [1, 2, 3, 4, 5]  # 1-2: checkpoint's log
        _assert_same_run(resumed, ref, f"stream resumed, {world} ranks, rank {rank}")


# ---- one process, no process group ------------------------------------------------------------

def test_stand_ins_give_stock_loader_lengths_and_skips():
    """The accumulating loader's length is stock's per-device batch count (B / k per batch,
    the last one short) for full, short and dropped last global batches; each step's share
    comes first, then its stand-ins; accelerate's skip_first_batches(loader, m k) (stock's
    resume) starts at global batch m, reading nothing it skips."""
    from accelerate import skip_first_batches
    from torch.utils.data import DataLoader

    from hf_cephalo.integrations.trainer.accumulation import (AccumulationStep,
                                                              with_accumulation_steps)
    from hf_cephalo.runtime.data import weighted_loader

    reads = []

    class Rows(list):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    for n, B, k, drop_last in ((20, 8, 4, False), (24, 8, 4, False), (22, 8, 4, False),
                               (23, 8, 2, False), (22, 8, 4, True), (30, 12, 3, False)):
        rows = Rows({"x": i} for i in range(n))
        inner = weighted_loader(rows, list, batch_sizes=[B // 2, B - B // 2], rank=1,
                                microbatch_size=2, seed=0, shuffle=False, drop_last=drop_last,
                                collate="global_batch")  # no process group here
        loader = with_accumulation_steps(inner, k)
        stock = DataLoader(range(n), batch_size=B // k, drop_last=drop_last)
        # drop_last: the short global batch goes (stock keeps its full per-device batches)
        assert len(loader) == (n // B * k if drop_last else len(stock)), (n, B, k)
        items = list(loader)
        assert len(items) == len(loader)
        real = [i for i, item in enumerate(items) if not isinstance(item, AccumulationStep)]
        assert real == list(range(0, len(items), k)), (n, B, k)
        reads.clear()
        skipped = list(skip_first_batches(loader, k))  # one optimizer step done
        assert [isinstance(x, AccumulationStep) for x in skipped] == \
            [isinstance(x, AccumulationStep) for x in items[k:]]
        assert min(reads) >= B, "a skipped global batch was read"


def test_stream_with_a_length():
    """A torch IterableDataset with a length: its global batches and their count, each rank's
    share (b = [1, 0, 2], rank 2; the last row too, by the largest remainder); with stand-ins
    the stock loader's length (10 rows, B = 3, k = 3: 3 x 3 + 1)."""
    from torch.utils.data import IterableDataset

    from hf_cephalo.integrations.trainer.accumulation import (AccumulationStep,
                                                              with_accumulation_steps)
    from hf_cephalo.runtime.streaming import stream_loader

    class Counted(IterableDataset):
        def __iter__(self):
            yield from ({"x": torch.tensor([i])} for i in range(10))

        def __len__(self):
            return 10

    def rows(batch):
        return [int(x) for mb in batch for x in mb["x"]]

    loader = stream_loader(Counted(), _collate_tensors, batch_sizes=[1, 0, 2], rank=2,
                           microbatch_size=1)
    assert len(loader) == 4
    assert [rows(b) for b in loader] == [[1, 2], [4, 5], [7, 8], [9]]
    stock = with_accumulation_steps(loader, 3)
    items = list(stock)
    assert len(stock) == len(items) == 10
    assert [rows(b) for b in items if not isinstance(b, AccumulationStep)] == \
        [[1, 2], [4, 5], [7, 8], [9]]


def _collate_tensors(rows):
    return {k: torch.stack([r[k] for r in rows]).squeeze(-1) for k in rows[0]}


def test_drop_last_with_accumulation_warns(caplog):
    """dataloader_drop_last with k > 1 drops the short last global batch: said when stock
    would have trained some of its rows (22 rows, B = 8, k = 4: 6 of the last 6)."""
    import logging

    from hf_cephalo.integrations.trainer.accumulation import warn_rows_dropped

    with caplog.at_level(logging.WARNING, logger="hf_cephalo"):
        warn_rows_dropped(range(22), 8, 4)
        warn_rows_dropped(range(21), 8, 4)  # 5 left: stock keeps 4
        warn_rows_dropped(range(17), 8, 4)  # 1 left: stock drops it too
        warn_rows_dropped(range(22), 8, 1)  # no accumulation: stock drops the same
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "would still train 6 of them" in said[0] \
        and "would still train 4 of them" in said[1], said


def test_refusals_before_any_collective(tmp_path, monkeypatch):
    """What cannot work is refused at construction in the one message, before any process
    group: an optimizer that stepped, one over another model's tensors, a non-element-wise
    one, a scheduler bound to another optimizer or without one; a stream without max_steps;
    a streamed eval dataset. A stream with max_steps passes the checks."""
    from torch.utils.data import IterableDataset

    from hf_cephalo.integrations.trainer.preflight import dataset_problems
    from hf_cephalo.integrations.trainer.support import RefusedSettings
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    class Stream(IterableDataset):
        def __iter__(self):
            yield from _rows(2)

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    model = build("llama")
    stepped = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    stepped.step()
    other = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    elsewhere = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  lambda s: 1.0)
    cases = [((stepped, None), "optimizers: the optimizer already holds state"),
             ((other, None), r"optimizers: param group 0 holds a tensor of shape \(3,\) that is "
                             "not a parameter of the model"),
             ((lbfgs, None), "optimizers: LBFGS is not an element-wise optimizer"),
             ((fresh, elsewhere), "optimizers: the LR scheduler LambdaLR is bound to another "
                                  "optimizer"),
             ((None, elsewhere), "optimizers: a scheduler without its optimizer")]
    args = CephaloTrainingArguments(output_dir=str(tmp_path), report_to="none")
    for optimizers, pattern in cases:
        with pytest.raises(RefusedSettings, match=pattern):
            CephaloTrainer(model=model, args=args, optimizers=optimizers)
    with pytest.raises(RefusedSettings, match="train_dataset: Stream is a stream without a "
                                              "length.*set --max_steps") as info:
        CephaloTrainer(model=model, args=args, train_dataset=Stream(), eval_dataset=Stream())
    assert "eval_dataset: Stream is a stream" in str(info.value)
    assert not torch.distributed.is_initialized()
    assert dataset_problems(Stream(), None, max_steps=3) == []
    assert dataset_problems(_stream(4), None, max_steps=3) == []


def test_plan_line_names_the_global_batch(tmp_path, monkeypatch):
    """B = per_device_train_batch_size x world size x gradient_accumulation_steps, said in the
    plan line; a plan or --cephalo_global_batch_size fixes B instead (nothing derived)."""
    from hf_cephalo.integrations.trainer.training_args import (CephaloTrainingArguments,
                                                       job_from_training_args)
    from hf_cephalo.planner import Plan
    from hf_cephalo.runtime.report import format_plan_table

    monkeypatch.delenv("HF_CEPHALO_PLAN_FILE", raising=False)
    monkeypatch.delenv("HF_CEPHALO_GLOBAL_BATCH_SIZE", raising=False)
    args = CephaloTrainingArguments(output_dir=str(tmp_path), report_to="none",
                                    per_device_train_batch_size=2, gradient_accumulation_steps=4)
    job = job_from_training_args(args, 3)
    assert job.global_batch_size == 24 and not job.global_batch_size_given
    plan = Plan.from_ratios([10, 0, 14], [5, 0, 7], [0.4, 0.2, 0.4])
    assert format_plan_table(plan, "", job.global_batch_origin).startswith(
        "Cephalo plan: global batch size 24 (per_device_train_batch_size 2 x 3 processes x "
        "gradient_accumulation_steps 4), uneven state")
    assert job_from_training_args(args, 3, plan=plan).global_batch_origin == ""
