"""Mixed precision: fp16 with the sharded loss scaler, low-precision gathered parameters.

One process group per world size (2 and 3 ranks) runs every sub-case:

* param dtype bf16 / fp16 (reduce dtype fp32 or the low dtype), uneven plans: the first step's
  shard gradients and the parameters after 3 AdamW steps equal a single-process reference that
  applies the same casts (a copy of the fp32 master cast to the low dtype for each step's
  compute, the per-microbatch low-precision gradients accumulated in fp32) at the fp32
  tolerances of the parity tests (rtol 1e-5, atol 1e-6): the only difference is the order of
  fp32 sums over microbatches and ranks. A low reduce dtype rounds the summed gradient once
  more (to 8 / 11 mantissa bits), so there the gradient is compared at that dtype's resolution
  (rtol 2^-7 / 2^-10) and the parameters only after one step.
* counted all-gathered bytes (sent and received) exactly half of the fp32-gathered run's;
  reduce-scatter bytes half with a low reduce dtype, equal otherwise.
* l = 1 vs l = 8 microbatches: each accumulated gradient is within the recursive fp32
  summation bound (l - 1)·2^-24·Σ_j |g_j| of the float64 sum of its microbatch gradients; a
  bf16 accumulator of the same gradients breaks that bound (shown in the test).
* fp16 autocast + ``engine.make_grad_scaler()`` (ShardedGradScaler) over 20 steps, an overflow
  injected into ONE rank's microbatch at step 5 (its embedding gradient multiplied by inf):
  every rank skips step 5, and the loss-scale sequence and the skipped steps equal
  single-process ``torch.amp.GradScaler("cpu")`` training on the full batch (same microbatches,
  same casts). Resuming at step 10 from a sharded checkpoint + the scaler's state dict on
  ANOTHER plan gives the same scale sequence afterwards.
* fused AdamW (``fused=True``, transformers' default ``adamw_torch_fused``) under that scaler,
  with and without ``unscale_`` before ``step``: same scales, same skipped step (an overflow on
  one rank) and the same parameters as non-fused AdamW (rtol 1e-6, atol 1e-7); an inf in one
  rank's shard only skips the fused step on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile

import pytest
import torch

from hf_cephalo.engine import CephaloEngine, EnginePrecision
from hf_cephalo.engine.checkpoint import load_checkpoint, save_checkpoint
from hf_cephalo.models.base import AutocastStagedModel
from hf_cephalo.models.toy import ToyConfig, ToyLM, ToyStaged
from tests.dist_utils import run_ranks
from tests.test_engine_parity import make_batch, split_microbatches

RTOL, ATOL = 1e-5, 1e-6  # the fp32 parity tolerances
EPS32 = 2.0 ** -24  # unit roundoff of fp32
LR = 1e-3


def toy(seed: int, tie: bool, layers: int = 2) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(ToyConfig(vocab_size=24, hidden_size=8, num_heads=2, num_layers=layers,
                           mlp_ratio=2, max_seq_len=8, tie_embeddings=tie))


class _Blowup(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf (an injected overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class OverflowStaged(ToyStaged):
    """ToyStaged whose embedding gradient overflows for a microbatch with an "overflow" key."""

    def embed(self, microbatch):
        hidden, ctx = super().embed(microbatch)
        return (_Blowup.apply(hidden) if "overflow" in microbatch else hidden), ctx


def all_microbatches(ids, labels, sizes_b, sizes_m, world):
    return [mb for r in range(world) for mb in split_microbatches(ids, labels, sizes_b, sizes_m, r)]


def reference_grads(ref: ToyLM, mbs, num_items: int, autocast, param_dtype, scale_fn=None,
                    staged_cls=ToyStaged):
    """Per-microbatch gradients {name: [g_j]} of the reference applying the engine's casts.

    ``param_dtype``: compute on a copy of ``ref`` cast to it (low-precision gradients per
    microbatch); None: on ``ref`` itself (fp32 parameters, autocast only)."""
    model = copy.deepcopy(ref).to(param_dtype) if param_dtype is not None else ref
    tied = param_dtype is not None and model.head.weight is model.wte.weight
    if tied:  # the engine accumulates the head use and the embedding use apart, in fp32
        model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    staged = staged_cls(model)
    if autocast is not None:
        staged = AutocastStagedModel(staged, "cpu", autocast)
    per_mb = {name: [] for name, _ in ref.named_parameters()}
    for mb in mbs:
        for p in model.parameters():
            p.grad = None
        hidden, ctx = staged.embed(mb)
        for i in range(len(model.blocks)):
            hidden = staged.run_unit(i, hidden, ctx)
        loss = staged.head_loss(hidden, mb, ctx).loss_sum / num_items
        (scale_fn(loss) if scale_fn is not None else loss).backward()
        for name, p in model.named_parameters():
            if name in per_mb:
                per_mb[name].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        if tied:  # the head use kept apart too, for the reduce bound (two reduce-scatters)
            per_mb.setdefault("wte.weight@head", []).append(model.head.weight.grad.float())
            per_mb["wte.weight"][-1] = per_mb["wte.weight"][-1].float() + model.head.weight.grad
    return per_mb


def set_fp32_sum(ref: ToyLM, per_mb) -> None:
    """ref.grad = the fp32 sum of the per-microbatch gradients, in microbatch order."""
    for name, p in ref.named_parameters():
        acc = None
        for g in per_mb[name]:
            acc = g.to(torch.float32) if acc is None else acc.add_(g)
        p.grad = acc


def local_reference(engine: CephaloEngine, grads: dict) -> list[torch.Tensor]:
    """This rank's slice of each unit's flat trainable gradient built from ``grads[fqn]``."""
    out = []
    for unit in engine.all_units():
        flat = torch.cat([grads[i.fqn].reshape(-1).to(torch.float64) for i in unit.infos
                          if i.requires_grad] or [torch.zeros(0, dtype=torch.float64)])
        start = unit.trainable.starts[unit.rank]
        out.append(flat[start:start + unit.local_trainable_numel])
    return out


PLANS = {2: [dict(sizes_b=[5, 2], sizes_m=[2, 1], ratios=[0.7, 0.3]),
             dict(sizes_b=[1, 6], sizes_m=[1, 3], ratios=[0.0, 1.0])],
         3: [dict(sizes_b=[3, 0, 4], sizes_m=[1, 1, 2], ratios=[0.5, 0.2, 0.3]),
             dict(sizes_b=[2, 5, 1], sizes_m=[2, 2, 1], ratios=[0.1, 0.6, 0.3])]}


def _worst(err: torch.Tensor, bound: torch.Tensor) -> float:
    """max |err| / bound (0 for empty shards)."""
    return float((err.abs() / bound).max()) if err.numel() else 0.0


def _low_reduce_bound(per_mb, plan, world, dtype) -> dict:
    """Elementwise error bound of a reduce-scatter in ``dtype``: each rank's fp32 partial sum
    P_r is rounded to ``dtype`` (unit roundoff u = 2^-8 bf16, 2^-11 fp16) and the W partials are
    summed (at worst in ``dtype`` too): |error| <= (W + 1)·u·Σ_r |P_r| (+ fp32 slack)."""
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    counts = [-(-b // m) if b else 0 for b, m in zip(plan["sizes_b"], plan["sizes_m"])]

    def partials(grads):  # P_r per rank (float64)
        sums, k = [], 0
        for c in counts:
            sums.append(sum((g.double() for g in grads[k:k + c]), torch.zeros(())))
            k += c
        return sums

    out = {}
    for name, grads in per_mb.items():
        if "@" in name:
            continue
        ps = partials(grads)
        if name + "@head" in per_mb:  # a tied weight: each use is reduced (and rounded) apart
            hs = partials(per_mb[name + "@head"])
            total = sum((p - h).abs() + h.abs() for p, h in zip(ps, hs))
        else:
            total = sum(p.abs() for p in ps)
        out[name] = (world + 1) * u * total + 1e-7
    return out


def param_dtype_case(rank, world, plan, dtype, reduce_dtype, tie, seed) -> None:
    model = toy(seed, tie)
    ref = copy.deepcopy(model)
    engine = CephaloEngine(ToyStaged(model), plan["ratios"],
                           precision=EnginePrecision(dtype, dtype, reduce_dtype))
    opt = torch.optim.AdamW(engine.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed)
    low_reduce = reduce_dtype is not None
    steps = 1 if low_reduce else 3
    for step in range(steps):
        ids, labels = make_batch(gen, sum(plan["sizes_b"]), 6, 24)
        mbs = split_microbatches(ids, labels, plan["sizes_b"], plan["sizes_m"], rank)
        out = engine.train_step(mbs)
        every = all_microbatches(ids, labels, plan["sizes_b"], plan["sizes_m"], world)
        per_mb = reference_grads(ref, every, out.num_items, dtype, dtype)
        set_fp32_sum(ref, per_mb)
        if step == 0:
            expected = local_reference(engine, {n: p.grad for n, p in ref.named_parameters()})
            bound = local_reference(engine, _low_reduce_bound(per_mb, plan, world, dtype))
            for u, (p, exp, bnd) in enumerate(zip(engine.parameters(), expected, bound)):
                assert p.grad.dtype == torch.float32
                if low_reduce:  # see _low_reduce_bound
                    ratio = _worst(p.grad.double() - exp, bnd)
                    assert ratio <= 1, \
                        f"{plan} {dtype} unit {u}: low-precision reduce beyond its bound ({ratio})"
                else:
                    torch.testing.assert_close(p.grad.double(), exp, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{plan} {dtype}: {m}")
        opt.step()
        engine.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    full = engine.full_state_dict()
    if rank == 0 and not low_reduce:
        for key, value in ref.state_dict().items():
            assert full[key].dtype == torch.float32  # fp32 master weights
            torch.testing.assert_close(full[key], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{key} {plan} {dtype}: {m}")


def bytes_case(rank, world, plan, dtype) -> None:
    """All-gathered bytes of param_dtype=dtype are exactly half of fp32 gathering."""
    counts = {}
    for pd, rd in ((None, None), (dtype, None), (dtype, dtype)):
        engine = CephaloEngine(ToyStaged(toy(3, True)), plan["ratios"],
                               precision=EnginePrecision(dtype, pd, rd))
        gen = torch.Generator().manual_seed(3)
        ids, labels = make_batch(gen, sum(plan["sizes_b"]), 6, 24)
        engine.train_step(split_microbatches(ids, labels, plan["sizes_b"], plan["sizes_m"], rank))
        s = engine.stats
        counts[(pd, rd)] = (s.all_gather_sent_bytes, s.all_gather_received_bytes,
                            s.reduce_scatter_sent_bytes, s.reduce_scatter_received_bytes)
    f32, low, low_rs = counts[(None, None)], counts[(dtype, None)], counts[(dtype, dtype)]
    assert f32[0] + f32[1] > 0 and (low[0] * 2, low[1] * 2) == f32[:2], (f32, low)
    assert low[2:] == f32[2:], (f32, low)  # fp32 reduce-scatter
    assert (low_rs[2] * 2, low_rs[3] * 2) == f32[2:], (f32, low_rs)


def accumulation_case(rank, world, dtype) -> dict:
    """l = 1 and l = 8 microbatches on rank 0 (others none): each accumulated gradient is within
    the fp32 summation bound of its exact sum; a bf16 accumulator is not."""
    report = {}
    for m in (8, 1):  # l = 1, l = 8
        l_count = 8 // m
        sizes_b = [8] + [0] * (world - 1)
        sizes_m = [m] + [1] * (world - 1)
        model = toy(5, False, layers=3)
        ref = copy.deepcopy(model)
        engine = CephaloEngine(ToyStaged(model), [1.0 / world] * world,
                               precision=EnginePrecision(dtype, dtype))
        gen = torch.Generator().manual_seed(5)
        ids, labels = make_batch(gen, 8, 8, 24, pad_frac=0.0)
        out = engine.train_step(split_microbatches(ids, labels, sizes_b, sizes_m, rank))
        per_mb = reference_grads(ref, all_microbatches(ids, labels, sizes_b, sizes_m, world),
                                 out.num_items, dtype, dtype)
        exact = {n: sum(g.double() for g in gs) for n, gs in per_mb.items()}
        bound = {n: (l_count - 1) * EPS32 * sum(g.double().abs() for g in gs) + 1e-30
                 for n, gs in per_mb.items()}
        low_acc = {n: sum(gs[1:], gs[0].clone()) for n, gs in per_mb.items()}  # bf16 sums
        worst, worst_low = 0.0, 0.0
        for p, exp, bnd, low in zip(engine.parameters(), local_reference(engine, exact),
                                    local_reference(engine, bound),
                                    local_reference(engine, low_acc)):
            worst = max(worst, _worst(p.grad.double() - exp, bnd))
            worst_low = max(worst_low, _worst(low.double() - exp, bnd))
        assert worst <= 1.0, f"l={l_count}: fp32 accumulation exceeds the summation bound ({worst})"
        if l_count > 1 and rank == 0:
            assert worst_low > 1.0, f"a {dtype} accumulator stayed in the fp32 bound ({worst_low})"
        report[l_count] = (worst, worst_low)
    return report


def scaler_run(rank, world, plan, batches, steps, tmp, *, param_dtype, model=None,
               resume_at=None, save_at=None, fused=False, unscale=True, clip=True):
    """fp16 engine training with the sharded scaler; returns (scales, skipped, engine).
    fused: AdamW(fused=True); unscale: call ``scaler.unscale_`` before ``step`` (else ``step``
    does); clip: ``clip_grad_norm_(1.0)`` after ``unscale_``."""
    model = model if model is not None else toy(11, True)
    engine = CephaloEngine(OverflowStaged(model), plan["ratios"],
                           precision=EnginePrecision(torch.float16, param_dtype))
    opt = torch.optim.AdamW(engine.parameters(), lr=LR, fused=fused)
    scaler = engine.make_grad_scaler(init_scale=2.0 ** 12, growth_interval=3)
    first = 0
    if resume_at is not None:
        load_checkpoint(engine, os.path.join(tmp, "ckpt"), opt)
        scaler.load_state_dict(torch.load(os.path.join(tmp, "scaler.pt"), weights_only=True))
        first = resume_at
    scales, skipped = [], []
    for step in range(first, steps):
        if step == save_at:
            save_checkpoint(engine, os.path.join(tmp, "ckpt"), opt)
            if rank == 0:
                torch.save(scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
            torch.distributed.barrier()
        engine.zero_grad()
        engine.train_step(overflow_microbatches(plan, batches[step], rank), loss_scale=scaler)
        if unscale:
            scaler.unscale_(opt)
            if clip:
                engine.clip_grad_norm_(1.0)
        step_and_record(scaler, opt, step, scales, skipped)
    return scales, skipped, engine


def overflow_microbatches(plan, batch, rank) -> list:
    """``rank``'s microbatches of ``batch = (ids, labels, overflow_rank)``; on the overflow
    rank the first one carries the flag that makes OverflowStaged produce an inf."""
    ids, labels, overflow_rank = batch
    mbs = split_microbatches(ids, labels, plan["sizes_b"], plan["sizes_m"], rank)
    if rank == overflow_rank:
        mbs[0] = {**mbs[0], "overflow": torch.ones(())}
    return mbs


def step_and_record(scaler, opt, step, scales, skipped) -> None:
    """``scaler.step`` + ``update``; appends the new scale, and ``step`` to ``skipped`` when the
    scale fell (the step was skipped on an inf)."""
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
    if scales[-1] < before:
        skipped.append(step)


def scaler_reference(plan, batches, steps, world, param_dtype):
    ref = toy(11, True)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    scales, skipped = [], []
    for step in range(steps):
        every = [mb for r in range(world) for mb in overflow_microbatches(plan, batches[step], r)]
        num_items = sum(ToyStaged(ref).count_items(mb) for mb in every)
        opt.zero_grad(set_to_none=True)
        set_fp32_sum(ref, reference_grads(ref, every, num_items, torch.float16, param_dtype,
                                          scaler.scale, OverflowStaged))
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        step_and_record(scaler, opt, step, scales, skipped)
    return scales, skipped, ref


def scaler_case(rank, world, tmp, param_dtype) -> dict:
    plan = PLANS[world][0]
    other = dict(plan, ratios=list(reversed(plan["ratios"])))  # resume onto another plan
    gen = torch.Generator().manual_seed(21)
    batches = []
    for step in range(20):
        ids, labels = make_batch(gen, sum(plan["sizes_b"]), 6, 24)
        batches.append((ids, labels, world - 1 if step == 5 else -1))  # ONE rank overflows
    scales, skipped, engine = scaler_run(rank, world, plan, batches, 20, tmp,
                                         param_dtype=param_dtype, save_at=10)
    ref_scales, ref_skipped, ref = scaler_reference(plan, batches, 20, world, param_dtype)
    assert 5 in skipped and skipped == ref_skipped, (skipped, ref_skipped)
    assert scales == ref_scales, (scales, ref_scales)
    full = engine.full_state_dict()
    worst = 0.0
    if rank == 0:
        for key, value in ref.state_dict().items():
            # fp16 tolerance: the per-microbatch fp16 gradients are bitwise the reference's; the
            # fp32 sums over microbatches and ranks differ in order (~1e-7 relative), which can
            # flip the fp16 rounding of a parameter or activation in a later step (one fp16
            # ulp, 2^-11 relative, of one input), changing that step's gradient by about that
            # much. AdamW's update is lr·m/sqrt(v), so such a flip moves a parameter by about
            # lr·2^-11 = 5e-7 per step; over 20 steps 1e-5. Measured: 6e-8 (no flip here).
            torch.testing.assert_close(full[key], value, rtol=2 ** -11, atol=1e-5,
                                       msg=lambda m: f"{key} fp16 after 20 steps: {m}")
            worst = max(worst, float((full[key] - value).abs().max()))
    resumed, resumed_skipped, _ = scaler_run(rank, world, other, batches, 20, tmp,
                                             param_dtype=param_dtype, model=toy(11, True),
                                             resume_at=10)
    assert resumed == scales[10:], (resumed, scales[10:])
    return dict(scales=scales, skipped=skipped, worst_param_diff=worst)


def fused_case(rank, world) -> dict:
    """Fused AdamW (transformers' default optim) under the engine's scaler, 6 fp16 steps, an
    overflow on ONE rank at step 3: with ``unscale_`` before ``step`` (as the Trainer does) and
    without, the scales, the skipped steps and the parameters equal the non-fused run's
    ([Note: found-inf shape for fused optimizers] in ``engine/grad_scaler.py``)."""
    plan = PLANS[world][0]
    gen = torch.Generator().manual_seed(5)
    batches = []
    for step in range(6):
        ids, labels = make_batch(gen, sum(plan["sizes_b"]), 6, 24)
        batches.append((ids, labels, world - 1 if step == 3 else -1))
    runs = {(fused, unscale): scaler_run(rank, world, plan, batches, 6, None, param_dtype=None,
                                         fused=fused, unscale=unscale, clip=False)
            for fused, unscale in ((False, True), (True, True), (True, False))}
    scales, skipped, engine = runs[False, True]
    assert skipped == [3], skipped
    full = engine.full_state_dict()
    worst = {}
    for (fused, unscale), (f_scales, f_skipped, f_engine) in runs.items():
        assert (f_scales, f_skipped) == (scales, skipped), ((fused, unscale), f_scales, scales)
        f_full = f_engine.full_state_dict()
        if rank == 0 and fused:
            name = f"fused unscale={unscale}"
            for key, value in full.items():
                # fused vs foreach AdamW: the same fp32 update in another operation order;
                # measured: 4.7e-10 (2 ranks), 0 (3 ranks)
                torch.testing.assert_close(f_full[key], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{key} {name}: {m}")
            worst[name] = max(float((f_full[k] - v).abs().max()) for k, v in full.items())
    # an inf in ONE rank's gradients only (the engine's reduce-scatter spreads the one above to
    # every rank): every rank skips, also when step() does the unscale_ for a fused optimizer
    param = torch.nn.Parameter(torch.ones(4))
    scaler = engine.make_grad_scaler(init_scale=8.0)
    scaler.scale(torch.ones(()))  # creates the scale
    param.grad = torch.full((4,), float("inf") if rank == world - 1 else 8.0)
    scaler.step(torch.optim.AdamW([param], lr=LR, fused=True))
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(4)) and scaler.get_scale() == 4.0, (
        param, scaler.get_scale())
    return dict(scales=scales, skipped=skipped, worst_param_diff=worst)


def bad_input_case(rank, world) -> int:
    """Refused before any collective (ValueError naming the value and the fix)."""
    model = toy(1, False)
    cases = [dict(compute=None, param=torch.bfloat16),     # fp32-only compute
             dict(compute=torch.bfloat16, param=torch.float16),
             dict(compute=torch.bfloat16, reduce=torch.bfloat16),  # RS < params
             dict(compute=torch.float16, param=torch.float16, reduce=torch.bfloat16),
             dict(compute=torch.float64)]
    for kwargs in cases:
        try:
            CephaloEngine(ToyStaged(model), precision=EnginePrecision(**kwargs))
        except ValueError as exc:
            assert "dtype" in str(exc), exc
        else:
            raise AssertionError(f"{kwargs} was accepted")
    return len(cases)


def worker(rank: int, world: int, tmp: str) -> dict:
    torch.use_deterministic_algorithms(True)
    assert bad_input_case(rank, world) == 5
    for k, plan in enumerate(PLANS[world]):
        for dtype in (torch.bfloat16, torch.float16):
            for reduce_dtype in (None, dtype):
                param_dtype_case(rank, world, plan, dtype, reduce_dtype, tie=k == 0, seed=k + 7)
        bytes_case(rank, world, plan, torch.bfloat16)
    report = {"accumulation": {str(d): accumulation_case(rank, world, d)
                               for d in (torch.bfloat16, torch.float16)}}
    report["scaler fused"] = fused_case(rank, world)
    for pd in (None, torch.float16):
        report[f"scaler param_dtype={pd}"] = scaler_case(rank, world, os.path.join(tmp, str(pd)),
                                                         pd)
    return report


def _run(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for pd in (None, torch.float16):
            os.makedirs(os.path.join(tmp, str(pd)))
        reports = run_ranks(worker, world, tmp, timeout_s=400)
    for key in reports[0]:
        if key.startswith("scaler"):
            # every rank skipped the same steps and saw the same scales
            assert all(r[key]["skipped"] == reports[0][key]["skipped"] for r in reports)
            assert all(r[key]["scales"] == reports[0][key]["scales"] for r in reports)
    print(f"world {world}: {reports[0]}")


def test_mixed_precision_two_ranks():
    _run(2)


def test_mixed_precision_three_ranks():
    _run(3)


def test_engine_precision_policy():
    """The policy is validated and normalized once, when built: fp32 param / reduce dtypes are
    stored as None (no cast), so equal policies compare equal; it is frozen; the engine takes
    nothing else (TypeError before any collective)."""
    bf16 = torch.bfloat16
    assert EnginePrecision() == EnginePrecision(None, None, None)
    assert EnginePrecision(bf16, torch.float32, torch.float32) == EnginePrecision(bf16)
    assert EnginePrecision(bf16, bf16, bf16).reduce is bf16
    with pytest.raises(dataclasses.FrozenInstanceError):
        EnginePrecision(bf16).compute = torch.float16
    with pytest.raises(ValueError, match="only torch.bfloat16, torch.float16"):
        EnginePrecision(torch.float32)
    with pytest.raises(TypeError, match="pass hf_cephalo.engine.EnginePrecision"):
        CephaloEngine(ToyStaged(toy(1, False)), precision=(bf16, None, None))
