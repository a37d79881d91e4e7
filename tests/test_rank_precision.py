"""Precision per rank (issue 25): each rank computes in its own precision inside one job.

One 3-rank process group (ranks computing in fp32 / bf16 / fp16, fp32 master weights, fp32
all-gathers and reduce-scatters, ONE loss scaler for the job) runs every sub-case:

* exactness: the first step's shard gradients, the loss of every step and the parameters
  after each step equal a single-process reference that computes each sample in the precision
  of the rank it was assigned to (same microbatches, same global item count N, the same
  scaler on every sample) — see ``reference_run``. Tolerances: the first step's gradients at
  the fp32 parity tolerances (rtol 1e-5, atol 1e-6): every microbatch's gradient is computed
  by the same ops on the same fp32 weights, only the fp32 sums over microbatches and ranks are
  in another order. Losses: rtol 1e-6 (fp32 sums of the same per-microbatch losses). Parameters
  after step k: atol k·lr·2^-8, rtol 2^-8: a different fp32 summation order can flip one bf16
  rounding (2^-8 relative, the coarsest precision in the job) of a weight or activation in a
  later step, changing that step's gradient by about that much; AdamW's update lr·m/sqrt(v)
  then moves a parameter by at most about lr·2^-8 per step. A reference that computes the bf16
  rank's samples in fp32 instead is shown to MISS the gradient tolerance (the test can fail).
* an overflow injected into the fp16 rank's microbatch at step 1: every rank skips step 1
  (found-inf all-reduced), the scales equal the reference's ``GradScaler`` sequence.
* resume: a sharded checkpoint + the scaler state written after step 2 of the fp32/bf16/fp16
  job on one plan is loaded by a job computing in fp16/fp32/bf16 on another plan (another
  state layout, an idle rank); steps 3-5 equal the reference that switches assignment there.
* bad input (before any collective): a precision list of the wrong length, a precision the
  device lacks, an fp16 rank with an optimizer the scaler cannot unscale.

Pure parts (no process group): parsing, ``auto``, the spec-sheet checks, the plan's per-rank
precisions and their JSON, the planner pricing each rank at its precision.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

from hf_cephalo.engine import CephaloEngine, EnginePrecision
from hf_cephalo.engine.checkpoint import load_checkpoint, save_checkpoint
from hf_cephalo.engine.rank_precision import (DTYPES, check_scalable_optimizer, rank_precision,
                                              resolve_rank_precisions)
from hf_cephalo.planner.optimize import optimize
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.precision import (auto_precision, capability_precisions,
                                           parse_rank_precisions, rank_precisions_tag)
from hf_cephalo.profiles.specs import (ClusterSpec, estimate_cluster_profile, rank_precisions_for,
                                       spec_precisions)
from tests.dist_utils import run_ranks, test_timeout
from tests.test_mixed_precision import (LR, OverflowStaged, overflow_microbatches,
                                        reference_grads, set_fp32_sum, step_and_record, toy,
                                        local_reference)
from tests.test_engine_parity import make_batch

RTOL, ATOL = 1e-5, 1e-6  # fp32 parity tolerances
U_BF16 = 2.0 ** -8  # unit roundoff of bf16, the coarsest precision of the job
PLAN_A = dict(sizes_b=[2, 5, 1], sizes_m=[2, 2, 1], ratios=[0.1, 0.6, 0.3])
PLAN_B = dict(sizes_b=[3, 0, 4], sizes_m=[1, 1, 2], ratios=[0.5, 0.2, 0.3])
PREC_A = ["fp32", "bf16", "fp16"]
PREC_B = ["fp16", "fp32", "bf16"]
STEPS, SWITCH, OVERFLOW_STEP = 6, 3, 1


def batches_for(seed: int = 31):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        ids, labels = make_batch(gen, 8, 6, 24)
        out.append((ids, labels, 2 if step == OVERFLOW_STEP else -1))  # the fp16 rank of A
    return out


def assignment(step: int):
    return (PLAN_A, PREC_A) if step < SWITCH else (PLAN_B, PREC_B)


def reference_run(batches, wrong_rank1_fp32: bool = False):
    """Single process, full batch: each rank's microbatches computed in that rank's precision
    (fp32 master weights, the same GradScaler scale on every sample), summed in fp32 over
    the global batch, unscaled, AdamW. Returns per step (loss, scale, skipped, params,
    first-step grads)."""
    ref = toy(11, True)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    losses, scales, skipped, params, grads0 = [], [], [], [], None
    for step in range(STEPS):
        plan, prec = assignment(step)
        per_rank = [overflow_microbatches(plan, batches[step], r) for r in range(3)]
        num_items = sum(OverflowStaged(ref).count_items(mb) for mbs in per_rank for mb in mbs)
        opt.zero_grad(set_to_none=True)
        per_mb: dict = {}
        loss_sum = 0.0
        for r, mbs in enumerate(per_rank):
            dtype = DTYPES[prec[r]]
            if wrong_rank1_fp32 and r == 1:
                dtype = None
            g = reference_grads(ref, mbs, num_items, dtype, None, scaler.scale, OverflowStaged)
            for name, gs in g.items():
                per_mb.setdefault(name, []).extend(gs)
            loss_sum += _loss_sum(ref, mbs, dtype)
        set_fp32_sum(ref, per_mb)
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in ref.named_parameters()}
        scaler.unscale_(opt)
        step_and_record(scaler, opt, step, scales, skipped)
        losses.append(loss_sum / num_items)
        params.append(copy.deepcopy(ref.state_dict()))
    return dict(losses=losses, scales=scales, skipped=skipped, params=params, grads0=grads0,
                grads0_scale=2.0 ** 12)


@torch.no_grad()
def _loss_sum(ref, mbs, dtype) -> float:
    """The summed loss of ``mbs`` computed in ``dtype`` (the forward reference_grads ran)."""
    from hf_cephalo.models.base import AutocastStagedModel

    staged = OverflowStaged(ref)
    if dtype is not None:
        staged = AutocastStagedModel(staged, "cpu", dtype)
    total = 0.0
    for mb in mbs:
        hidden, ctx = staged.embed(mb)
        for i in range(len(ref.blocks)):
            hidden = staged.run_unit(i, hidden, ctx)
        total += float(staged.head_loss(hidden, mb, ctx).loss_sum)
    return total


def engine_run(rank, tmp, batches, first: int, last: int):
    """Steps first..last-1 of the per-rank job (assignment A, or B after SWITCH); A saves a
    checkpoint + the scaler before SWITCH, B starts from it."""
    plan, prec = assignment(first)
    mine = rank_precision(prec, rank)
    engine = CephaloEngine(OverflowStaged(toy(11, True)), plan["ratios"], precision=mine.engine)
    assert mine.loss_scaling and mine.engine.param is None  # mixed job: fp32 gathers
    opt = torch.optim.AdamW(engine.parameters(), lr=LR)
    scaler = engine.make_grad_scaler(init_scale=2.0 ** 12, growth_interval=3)
    if first == SWITCH:
        load_checkpoint(engine, os.path.join(tmp, "ckpt"), opt)
        scaler.load_state_dict(torch.load(os.path.join(tmp, "scaler.pt"), weights_only=True))
    out = dict(losses=[], scales=[], skipped=[], params=[], grads0=None)
    for step in range(first, last):
        engine.zero_grad()
        res = engine.train_step(overflow_microbatches(plan, batches[step], rank),
                                loss_scale=scaler)
        if step == 0:
            out["grads0"] = [p.grad.clone() for p in engine.parameters()]
        scaler.unscale_(opt)
        step_and_record(scaler, opt, step, out["scales"], out["skipped"])
        out["losses"].append(res.loss)
        out["params"].append(engine.full_state_dict())
    if last == SWITCH:
        save_checkpoint(engine, os.path.join(tmp, "ckpt"), opt)
        if rank == 0:
            torch.save(scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
        torch.distributed.barrier()
    return engine, out


def exactness_case(rank, tmp) -> dict:
    batches = batches_for()
    ref = reference_run(batches)
    engine_a, a = engine_run(rank, tmp, batches, 0, SWITCH)
    _, b = engine_run(rank, tmp, batches, SWITCH, STEPS)
    # first step's shard gradients (still scaled by the same 2^12 as the reference's)
    expected = local_reference(engine_a, ref["grads0"])
    worst_grad = 0.0
    for got, exp in zip(a["grads0"], expected):
        torch.testing.assert_close(got.double(), exp, rtol=RTOL, atol=ATOL * ref["grads0_scale"])
        if got.numel():
            worst_grad = max(worst_grad, float((got.double() - exp).abs().max()))
    # the same check against a reference computing the bf16 rank in fp32 must fail
    wrong = local_reference(engine_a, reference_run(batches, wrong_rank1_fp32=True)["grads0"])
    missed = any(not torch.allclose(got.double(), exp, rtol=RTOL, atol=ATOL * ref["grads0_scale"])
                 for got, exp in zip(a["grads0"], wrong))
    missed = _all_ranks_any(missed)
    assert missed, "a reference computing rank 1 in fp32 matched the bf16 rank's gradients"
    losses, scales, skipped = a["losses"] + b["losses"], a["scales"] + b["scales"], \
        a["skipped"] + b["skipped"]
    assert skipped == ref["skipped"] == [OVERFLOW_STEP], (skipped, ref["skipped"])
    assert scales == ref["scales"], (scales, ref["scales"])
    for step, (got, exp) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - exp) <= 1e-6 * abs(exp), (step, got, exp)  # the overflow is in backward
    worst_param = {}
    if rank == 0:
        for step, full in enumerate(a["params"] + b["params"]):
            for key, value in ref["params"][step].items():
                torch.testing.assert_close(full[key], value, rtol=U_BF16,
                                           atol=(step + 1) * LR * U_BF16,
                                           msg=lambda m: f"{key} after step {step}: {m}")
            worst_param[step] = max(float((full[k] - v).abs().max())
                                    for k, v in ref["params"][step].items())
    return dict(skipped=skipped, scales=scales, worst_grad=worst_grad, worst_param=worst_param)


def _all_ranks_any(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    torch.distributed.all_reduce(t)
    return bool(t.item())


def trainer_case(rank, world, out_dir) -> dict:
    """CephaloTrainer with --cephalo_precision fp32,bf16,fp16 and no plan: each rank is
    profiled in its own precision at start, the plan records the three precisions, each rank's
    engine autocasts in its own with fp32 gathers, EVERY rank trains with the job's scaler
    (loss_scale logged, the same on every rank), 3 steps of finite losses."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world),
                      HF_CEPHALO_PROFILE_CACHE=os.path.join(out_dir, "cache"),
                      HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE="2")
    for name in ("PLAN_FILE", "PROFILE_FILE", "EMULATE_MEMORY_CAP_BYTES", "EMULATE_SLOWDOWN"):
        os.environ.pop("HF_CEPHALO_" + name, None)
    from hf_cephalo.integrations.trainer.trainer import CephaloTrainer
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments
    from tests.models_fixtures import build
    from tests.test_trainer import _collate, _dataset, _samples

    args = CephaloTrainingArguments(output_dir=out_dir, report_to="none", learning_rate=1e-3,
                                    max_steps=3, logging_steps=1, save_strategy="no", seed=3,
                                    max_grad_norm=1.0, disable_tqdm=True,
                                    cephalo_global_batch_size=8,
                                    cephalo_precision=",".join(PREC_A))
    trainer = CephaloTrainer(model=build("llama"), args=args, data_collator=_collate,
                             train_dataset=_dataset(_samples("llama", 24, 0)))
    assert trainer.plan.rank_precisions == PREC_A, trainer.plan.ranks
    assert trainer.plan.precision == "float32+autocast-per-rank"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return dict(autocast=str(trainer.engine.precision.compute),
                param_dtype=str(trainer.engine.precision.param),
                scaler=type(trainer.accelerator.scaler).__name__,
                scales=[h["loss_scale"] for h in logs], losses=[h["loss"] for h in logs])


def worker(rank: int, world: int, tmp: str) -> dict:
    torch.use_deterministic_algorithms(True)
    report = exactness_case(rank, tmp)
    torch.use_deterministic_algorithms(False)
    report["trainer"] = trainer_case(rank, world, os.path.join(tmp, "trainer"))
    return report


@test_timeout(300)
def test_rank_precision_three_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(worker, 3, tmp, timeout_s=300)
    for r in reports:  # every rank skipped the same step and saw the same scales
        assert (r["skipped"], r["scales"]) == (reports[0]["skipped"], reports[0]["scales"])
    trained = [r["trainer"] for r in reports]
    assert [t["autocast"] for t in trained] == ["None", "torch.bfloat16", "torch.float16"]
    assert all(t["param_dtype"] == "None" for t in trained)  # fp32 all-gathers
    assert all(t["scaler"] == "CephaloGradScaler" for t in trained)  # also on fp32 / bf16
    assert len(trained[0]["losses"]) == 3 and all(map(math.isfinite, trained[0]["losses"]))
    assert all(t["scales"] == trained[0]["scales"] and t["losses"] == trained[0]["losses"]
               for t in trained)
    print(f"per-rank precision fp32/bf16/fp16: {reports[0]}")


# --- pure parts --------------------------------------------------------------------------------

def test_parse_and_auto():
    assert parse_rank_precisions("bf16,bf16, fp16 fp32", 4) == ["bf16", "bf16", "fp16", "fp32"]
    assert parse_rank_precisions("auto", 4) is None
    with pytest.raises(ValueError, match="3 entries but the world size is 4"):
        parse_rank_precisions("bf16,fp16,fp32", 4)
    with pytest.raises(ValueError, match=r"\['fp8'\] not one of"):
        parse_rank_precisions("fp8,fp32", 2)
    assert [auto_precision(c) for c in [None, (9, 0), (8, 6), (7, 5), (7, 0), (6, 0), (6, 1),
                                        (5, 2)]] == ["fp32", "bf16", "bf16", "fp16", "fp16",
                                                     "fp16", "fp32", "fp32"]
    assert capability_precisions(None) == ("bf16", "fp16", "fp32")  # CPU: any
    got = resolve_rank_precisions("auto", 3, ["A6000", "T4", "P40"], [(8, 6), (7, 5), (6, 1)])
    assert got == ["bf16", "fp16", "fp32"]
    assert resolve_rank_precisions("auto", 2, ["cpu", "cpu"], [None, None]) == ["fp32", "fp32"]
    assert rank_precision(["bf16", "bf16"], 1) == (
        EnginePrecision(torch.bfloat16, torch.bfloat16, None), False)
    assert rank_precision(["bf16", "fp32"], 0) == (EnginePrecision(torch.bfloat16, None, None), False)
    assert rank_precision(["bf16", "fp16"], 0).loss_scaling
    assert rank_precisions_tag(["bf16", "fp16"]) == "float32+autocast-per-rank"
    assert rank_precisions_tag(["bf16"] * 2) == "float32+autocast-bf16+gather-bf16"
    check_scalable_optimizer(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))]),
                             ["bf16", "fp32"], ["a", "b"])  # no fp16 rank: no scaler needed


def _cluster():
    return ClusterSpec(name="mixed", machines=[["A6000", "V100-16GB"], ["P40"]],
                       interconnect_gbps=50)


def test_spec_sheet_precisions_and_plan():
    cluster = _cluster()
    assert spec_precisions("P40") == ("fp32",) and spec_precisions("T4") == ("fp16", "fp32")
    assert rank_precisions_for(cluster, "auto") == ["bf16", "fp16", "fp32"]
    with pytest.raises(ValueError, match=r"rank 1 \(V100-16GB\): bf16"):
        rank_precisions_for(cluster, "bf16,bf16,fp32")
    with pytest.raises(ValueError, match="no bf16 support"):  # one precision for all: as before
        estimate_cluster_profile(cluster, "llama-3b", precision="bf16")
    auto = estimate_cluster_profile(cluster, "llama-3b", precision="auto")
    fp32 = estimate_cluster_profile(cluster, "llama-3b", precision="fp32")
    assert auto.extra["rank_precisions"] == ["bf16", "fp16", "fp32"]
    assert auto.extra["dtype"] == "float32+autocast-per-rank"
    assert auto.model.gathered_param_bytes == fp32.model.gathered_param_bytes  # fp32 gathers
    # each rank priced at its precision: A6000 4x, V100 8x faster, P40 unchanged
    for d_auto, d_32, speedup in zip(auto.devices, fp32.devices, [4.0, 125 / 15.7, 1.0]):
        assert d_auto.fwd_s[-1] < d_32.fwd_s[-1] / speedup * 1.01
        assert d_auto.fwd_s[-1] > d_32.fwd_s[-1] / speedup * 0.99 - 1e-3
    plan = optimize(auto, 16)
    assert plan.rank_precisions == ["bf16", "fp16", "fp32"]
    assert plan.precision == "float32+autocast-per-rank"
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.rank_precisions == plan.rank_precisions
    assert optimize(auto, 16).predicted_iteration_s < optimize(fp32, 16).predicted_iteration_s
    old = optimize(fp32, 16).to_json()
    assert all("precision" not in r for r in old["ranks"])  # one-precision plans read as before
    assert Plan.from_json(old).rank_precisions is None
    bad = plan.to_json()
    bad["ranks"][0]["precision"] = "fp8"
    with pytest.raises(ValueError, match=r"plan rank 0 \(A6000\): precision must be one of"):
        Plan.from_json(bad)


def test_bad_input_names_rank_and_device():
    """Refused with the rank and device named; pure checks every rank runs alike before the
    engine is built, so no collective has started."""
    names = ["cpu"] * 3
    with pytest.raises(ValueError, match="2 entries but the world size is 3"):
        resolve_rank_precisions("bf16,fp16", 3, names, [None] * 3)
    with pytest.raises(ValueError, match=r"rank 1 \(V100\): bf16 \(it runs fp16, fp32\); "
                                         r"rank 2 \(P40\): fp16"):
        resolve_rank_precisions("bf16,bf16,fp16", 3, ["A100", "V100", "P40"],
                                [(8, 0), (7, 0), (6, 1)])
    with pytest.raises(ValueError, match=r"rank 2 \(cpu\) compute in fp16.*LBFGS cannot be "
                                         "unscaled"):
        check_scalable_optimizer(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))]),
                                 PREC_A, names)
    check_scalable_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), PREC_A,
                             names)


def test_training_args_refusals(tmp_path, monkeypatch):
    """--cephalo_precision beside a one-precision flag, a bad name, and a plan made at start
    are refused before any process group work."""
    from hf_cephalo.integrations.trainer.training_args import (CephaloTrainingArguments,
                                                       job_from_training_args)
    from hf_cephalo.models import stage_model
    from hf_cephalo.runtime.planning import resolve_plan
    from tests.models_fixtures import build

    def make(**kw):
        return CephaloTrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)

    with pytest.raises(ValueError, match="--cephalo_precision fp32,bf16 sets each rank's "
                                         "precision, but --bf16"):
        make(cephalo_precision="fp32,bf16", bf16=True)
    with pytest.raises(ValueError, match="but --cephalo_param_dtype bf16"):
        make(cephalo_precision="auto", cephalo_param_dtype="bf16")
    with pytest.raises(ValueError, match="precision = 'fp8,fp32'.*HF_CEPHALO_PRECISION"):
        make(cephalo_precision="fp8,fp32")
    monkeypatch.setenv("HF_CEPHALO_PRECISION", "bf16, fp16")
    args = make()
    assert args.cephalo_precision == "bf16,fp16"  # environment fallback, normalized
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    args = make(cephalo_profile_file=str(profile))
    with pytest.raises(NotImplementedError, match="a profile file holds every rank measured "
                                                  "in one precision"):
        resolve_plan(job_from_training_args(args, 2), stage_model(build("llama")))


def test_cli_precision_auto_and_lists(tmp_path, capsys):
    """`hf-cephalo plan/simulate --precision auto|LIST` on the paper's clusters: auto plans
    every policy and keeps the fastest (per rank on Cluster A, fp16 for all on Cluster B at
    B = 512, where mixing would all-gather fp32), the plan JSON records each rank's precision,
    a list of the wrong length or a GPU without the precision is refused (exit 2)."""
    from hf_cephalo.cli import main

    clusters = Path(__file__).resolve().parent.parent / "examples" / "clusters"
    a, b = str(clusters / "cluster_a.yaml"), str(clusters / "cluster_b.yaml")
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", a, "--model", "llama-3b", "-B", "128", "--precision",
                 "auto", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "precision auto (B = 128): per-rank fastest [bf16 x3, fp32 x3, fp16 x2]" in text
    assert "P100 [fp16]" in text
    plan = Plan.load(out)
    assert plan.rank_precisions == ["bf16"] * 3 + ["fp32"] * 3 + ["fp16"] * 2
    fp32 = main(["plan", "--cluster", a, "--model", "llama-3b", "-B", "128"])
    text32 = capsys.readouterr().out
    assert fp32 == 0 and "[fp" not in text32  # one-precision output unchanged
    assert main(["simulate", "--cluster", b, "--model", "llama-7b", "-B", "512",
                 "--precision", "auto"]) == 0
    text = capsys.readouterr().out
    assert "precision auto (B = 512): fp16 [fp16 x64]" in text and "per-rank fastest" in text
    assert main(["plan", "--cluster", a, "--model", "llama-3b", "-B", "128", "--precision",
                 "bf16,fp32"]) == 2
    assert "2 entries but the world size is 8" in capsys.readouterr().err
    assert main(["plan", "--cluster", a, "--model", "llama-3b", "-B", "128", "--precision",
                 "bf16," * 7 + "bf16"]) == 2
    assert "rank 3 (P40): bf16 (it runs fp32)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", a, "--model", "llama-3b", "-B", "128", "--precision", "fp8"])
