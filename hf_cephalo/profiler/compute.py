"""One unit's compute on this device: its times and memory for microbatch sizes m = 1..M.

``measure_device`` profiles this rank into a ``DeviceProfile`` ([Note: what is measured]):
one unit's forward and recompute + backward times (re-measured when implausible, fitted
non-decreasing in m), its activation memory and kept forward graph, measured through the
engine's own parameter views (``_FlatViews``), compiled first when the engine will compile
(``_compile_unit``), and the step terms outside the units (embedding, head, bookkeeping,
optimizer). The collectives: ``profiler/comm.py``; the whole cluster: ``profiler/measure.py``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable

import torch

from hf_cephalo.engine.compile import (CompileFailure, CompileOptions, graph_count, plural,
                                       record_compile, remote_failure)
from hf_cephalo.engine.flat_param import (ParamLeaves, collect_params, install_param_views,
                                          move_shared_params, param_infos)
from hf_cephalo.models.base import StagedModel, with_side_input_leaves
from hf_cephalo.profiler.hardware import sync_device
from hf_cephalo.profiler.inputs import MakeMicrobatch, MeasureConfig, synthetic_microbatch
from hf_cephalo.profiler.live_memory import LiveTensorBytes
from hf_cephalo.profiler.model_facts import (ProfiledUnit, model_dtype, refuse_reshaping_units,
                                             unit_groups)
from hf_cephalo.profiles.types import DeviceProfile
from hf_cephalo.units import GIB

__all__ = ["measure_device"]

# [Note: what is measured]
# Per rank, with the real model, its dtype and a synthetic microbatch of the training shape
# (``synthetic_microbatch``), each number is what the engine really spends, so the planner's
# sums match the engine's step:
# - ``fwd_s[m]``: one unit's forward without autograd (the engine's forward pass);
# - ``bwd_s[m]``: (recompute WITH autograd + backward) minus the forward of the same repeat, so
#   the cost model's F + B is exactly the engine's backward; medians over interleaved rounds,
#   fitted non-decreasing in m ([Note: implausible backward times] for a bad median);
# - ``compute_memory_bytes[m]`` / ``head_memory_bytes[m]``: the activation memory of ONE
#   microbatch without the engine's own buffers (planner/memory.py prices those), measured with
#   the gradients already allocated (``_compute_memory``);
# - ``kept_graph_bytes[m]``: what one microbatch's forward graph of a unit keeps until its
#   backward when the engine keeps graphs (``activation_checkpointing=False``).
# Each field in detail: docs/profiling.md, "What is measured".

QUIET_INTERVAL_S = 15.0
"""Seconds between two progress lines of a non-verbose profile (rank 0 only)."""


class _FlatViews:
    """Unit 0's parameters as the engine gathers them: per-parameter leaves aliasing one flat
    buffer, their gradients accumulated into one flat gradient.

    Uses the engine's own ``collect_params`` / ``ParamLeaves`` / ``install_param_views`` ([Note:
    parameter views while unsharded] in ``engine/flat_param.py``): before each call the module
    entries point at the leaves (frozen parameters: views of the detached rest), and once
    ``prepare_grad`` ran, backward adds into the flat gradient in place (in the master dtype;
    with a cast, through the leaves' hooks as [Note: low-precision gathered parameters]).
    ``restore`` puts the original parameters back.
    """

    def __init__(self, unit: torch.nn.Module | None = None, collected=None,
                 dtype: torch.dtype | None = None):
        params, uses = collected if collected is not None else \
            collect_params("unit 0", [unit], {})
        self.infos = param_infos("unit", params, {})
        self.uses = [uses[id(p)] for p in params]
        self.originals = [(entries, p) for entries, p in zip(self.uses, params)]
        with torch.no_grad():  # two parts, each in its dtype ([Note: two parts per unit])
            parts = [torch.cat([p.detach().reshape(-1) for p in params
                                if p.requires_grad == trainable]) if any(
                p.requires_grad == trainable for p in params) else torch.zeros(0)
                for trainable in (True, False)]
            if dtype is not None:  # the engine casts the parts stored in the master dtype for
                # the all-gather; a low-precision frozen base is gathered as stored
                master = parts[0].dtype if parts[0].numel() else torch.float32
                parts = [t.to(dtype) if t.dtype == master else t for t in parts]
        self.cast = dtype is not None
        self.master_dtype = params[0].dtype if params and params[0].requires_grad else \
            torch.float32  # trainable first (collect_params)
        self.flat = parts[0]
        self.leaves = ParamLeaves(self.infos, parts[0], requires_grad=True)
        self.frozen = parts[1]

    @property
    def dtype(self) -> torch.dtype:
        """The gathered trainable part's dtype."""
        return self.flat.dtype

    def install(self) -> None:
        install_param_views(self.infos, self.uses, self.leaves.leaves, self.frozen)

    def prepare_grad(self) -> None:
        """The unit's flat (Nt,) gradient, zero-filled in the master dtype, as the engine's
        ``FlatParamUnit.prepare_grad`` before a unit's first backward."""
        if self.leaves.requires_grad and self.leaves.grad is None:
            self.leaves.accumulate_into(torch.zeros(self.flat.numel(), dtype=self.master_dtype,
                                                    device=self.flat.device))

    @staticmethod
    def head_phase(staged: StagedModel, dtype: torch.dtype | None = None) -> list["_FlatViews"]:
        """Views of the units the engine's head phase gathers: the head unit, and the embedding
        unit when the head uses one of its weights (grouped as engine.py ``_build_units``)."""
        embed = collect_params("embed", list(staged.embed_modules()), {})
        head = collect_params("head", list(staged.head_modules()), {})
        embed, head, tied = move_shared_params(embed, head)
        return [_FlatViews(collected=head, dtype=dtype)] + \
            ([_FlatViews(collected=embed, dtype=dtype)] if tied else [])

    def restore(self) -> None:
        for entries, p in self.originals:
            for module, attr in entries:
                module._parameters[attr] = p
        self.release_grad()

    def release_grad(self) -> None:
        """Drop the flat gradient and the leaves' own gradients."""
        for leaf in self.leaves.leaves:
            leaf.grad = None  # the timing rounds' and memory regions' sums, unchecked
        self.leaves.release_grad()


def _unit_backward(staged: StagedModel, hidden: torch.Tensor, ctx: Any,
                   grad: torch.Tensor) -> torch.Tensor:
    """Recompute (forward with autograd) + backward of unit 0, as the engine's backward does
    (side inputs read as leaves that require grad: ``with_side_input_leaves``)."""
    x = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        y = staged.run_unit(0, x, with_side_input_leaves(staged, ctx)[0])
    torch.autograd.backward(y, grad)
    return y.detach()


def _head_backward(staged: StagedModel, hidden: torch.Tensor, mb, ctx: Any) -> None:
    h = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        out = staged.head_loss(h, mb, ctx)
    torch.autograd.backward(out.loss_sum)


def _peak_bytes(device: torch.device, run: Callable[[], None]) -> float:
    """Peak bytes allocated while ``run()`` runs, beyond what was allocated before it.

    CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``). CPU: the peak of
    live tensors allocated inside (``live_memory.LiveTensorBytes``); that counter is a torch
    dispatch mode, which compiled code cannot run under, so compiled units run eagerly here
    (``torch.compiler.set_stance("force_eager")``): on the CPU a compiled profile's memory is
    the eager units' activation memory (the compiled one is not measured), its times are the
    compiled units'.
    """
    if device.type == "cuda":
        sync_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        sync_device(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    with torch.compiler.set_stance("force_eager"), LiveTensorBytes() as live:
        run()
    return float(live.peak_bytes)


def _compute_memory(staged: StagedModel, views: _FlatViews, hidden, mb, ctx, grad,
                    device) -> tuple[float, float]:
    """(unit, head) activation memory of one microbatch in flight, bytes ([Note: what is measured]).

    The persistent buffers the planner prices itself (planner/memory.py) are allocated before
    the measured regions, as after the engine's first microbatch: the unit's and the head
    phase's flat gradients exist (backward adds into them), the input and its boundary
    gradient are stashed. The unit and the head phase's units are gathered as in the engine
    (per-parameter leaves whose gradients backward adds in place into the flat gradient: what
    a backward allocates for them is each parameter's own gradient until its add; flat_param.py
    [Note: parameter views while unsharded]). Two regions: the unit's recompute + backward,
    and the head's loss + backward beside the last unit's kept forward graph (the schedule
    keeps it through the head phase).
    """
    head_views = _FlatViews.head_phase(staged, views.dtype if views.cast else None)
    views.release_grad()  # the timing rounds' sum: allocated anew below, as after a gather
    for v in [views, *head_views]:
        v.prepare_grad()

    def unit_pass() -> None:
        views.install()
        _unit_backward(staged, hidden, ctx, grad)

    def head_pass() -> None:
        for v in [views, *head_views]:
            v.install()
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():  # the kept graph, alive during the head
            y = staged.run_unit(0, x, with_side_input_leaves(staged, ctx)[0])
        _head_backward(staged, y, mb, ctx)

    try:
        return _peak_bytes(device, unit_pass), _peak_bytes(device, head_pass)
    finally:
        for v in head_views:
            v.restore()
        views.release_grad()


def _kept_graph_memory(staged: StagedModel, views: _FlatViews, hidden, ctx, device) -> float:
    """K(m): bytes one microbatch's forward graph of unit 0 keeps alive until its backward.

    The engine without activation checkpointing (engine/schedule.py ``_forward_kept``) runs
    each unit's forward with autograd on the stashed input and keeps ``(input, output)`` until
    the unit's backward. What that costs is what is still allocated after the forward: the
    tensors autograd saved plus the output (the next unit's input). The input was allocated
    before (it is the previous unit's output, or the embedding's) and the parameters are views
    of the gathered buffer, whose storage the engine frees at reshard ([Note: kept graphs
    across reshard] in flat_param.py), so neither is counted. CUDA: ``memory_allocated``
    after minus before; CPU: the live tensors left (``live_memory.LiveTensorBytes``; compiled
    units run eagerly there, as in ``_peak_bytes``).
    """
    x = hidden.detach().requires_grad_(True)
    if device.type == "cuda":
        sync_device(device)
        base = torch.cuda.memory_allocated(device)
        views.install()
        with torch.enable_grad():
            y = staged.run_unit(0, x, ctx)
        sync_device(device)
        kept = float(torch.cuda.memory_allocated(device) - base)
    else:
        with torch.compiler.set_stance("force_eager"), LiveTensorBytes() as live:
            views.install()
            with torch.enable_grad():
                y = staged.run_unit(0, x, ctx)
            live.reset_peak()  # drops what the forward freed: what is left is kept
            kept = float(live.current_bytes)
    del y  # frees the graph
    return kept


# [Note: implausible backward times]
# ``bwd_s[m]`` is (recompute + backward) - forward of the same repeat. The backward of a unit
# costs about two forwards in FLOPs (and the recompute that keeps activations is slower than the
# no-grad forward), so a median below MIN_BWD_TO_FWD x the forward, or not positive at all, is a
# load spike in the forwards on a shared machine, not a real time. Such microbatch sizes are
# re-measured (every rank re-measures when any rank must, keeping the lockstep barriers
# matched) up to MAX_REMEASURES times; a size still implausible then is warned about (rank, m,
# the times) and its backward set to MIN_BWD_TO_FWD x the forward, never silently clamped.
MIN_BWD_TO_FWD = 0.1
MAX_REMEASURES = 2


def _implausible(fwd: float, bwd: float) -> bool:
    return not (bwd > 0.0 and bwd >= MIN_BWD_TO_FWD * fwd)


def _measure_times(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                   name: str, before_each, any_rank) -> tuple[dict[int, float], dict[int, float]]:
    """Per-m median forward and backward seconds, re-measuring implausible backward times.

    See [Note: implausible backward times]. Returns ``(fwd, bwd)`` dicts keyed by m.
    """
    ms = config.microbatch_sizes
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    bad = list(ms)
    for attempt in range(1 + MAX_REMEASURES):
        f_times: dict[int, list[float]] = {m: [] for m in ms}
        fb_times: dict[int, list[float]] = {m: [] for m in ms}
        _time_rounds(staged, config, inputs, views, device, rank, name, before_each,
                     f_times, fb_times)
        for m in bad:
            # bwd per repeat = (recompute + backward) - forward of the SAME repeat, so a load
            # spike in one forward does not cancel the backward of another repeat.
            fwd[m] = statistics.median(f_times[m])
            bwd[m] = statistics.median([fb - f for f, fb in zip(f_times[m], fb_times[m])])
        bad = [m for m in ms if _implausible(fwd[m], bwd[m])]
        again = bool(bad) if any_rank is None else any_rank(bool(bad))
        if not again or attempt == MAX_REMEASURES:
            break
        if bad and config.prints(rank):
            print(f"[hf-cephalo profile] rank {rank} ({name}): implausible backward time for "
                  f"microbatch sizes {bad}; re-measuring", flush=True)
    if bad:
        detail = "; ".join(f"m={m}: fwd {fwd[m] * 1e3:.4f} ms, bwd {bwd[m] * 1e3:.4f} ms"
                           for m in bad)
        message = (f"rank {rank} ({name}): backward time still implausible after "
                   f"{MAX_REMEASURES} re-measurements ({detail}); backward must be positive "
                   f"and at least {MIN_BWD_TO_FWD} x the forward. Using {MIN_BWD_TO_FWD} x the "
                   "forward for these sizes; the machine is probably overloaded: re-profile "
                   "on an idle machine (delete the profile cache entry) for accurate plans")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        print(f"[hf-cephalo profile] WARNING {message}", flush=True)
        for m in bad:
            bwd[m] = MIN_BWD_TO_FWD * fwd[m]
    return fwd, bwd


def _non_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators) of per-m medians.

    A larger microbatch cannot take less time than a smaller one on the same unit; where the
    medians say so it is measurement noise (a shared machine), which would otherwise bend the
    cost model's interpolation. Values that already increase are returned unchanged.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out += [total / count] * int(count)
    return out


def _time_rounds(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                 name: str, before_each, f_times, fb_times) -> None:
    """``warmup + repeats`` rounds over every m; appends per-repeat times (seconds)."""
    ms = config.microbatch_sizes
    rounds = config.warmup + config.repeats
    work_done, total_work = 0, rounds * sum(ms)
    t_start = last_print = time.perf_counter()
    for k in range(rounds):
        for m in ms:
            _, hidden, ctx, grad = inputs[m]
            if before_each is not None:
                before_each()
            sync_device(device)
            t0 = time.perf_counter()
            views.install()  # the engine's use_params before every call
            with torch.no_grad():
                staged.run_unit(0, hidden, ctx)
            sync_device(device)
            t1 = time.perf_counter()
            views.install()
            _unit_backward(staged, hidden, ctx, grad)  # accumulates like layered GA
            sync_device(device)
            t2 = time.perf_counter()
            if k >= config.warmup:
                f_times[m].append(t1 - t0)
                fb_times[m].append(t2 - t1)
            work_done += m
            now = time.perf_counter()
            interval_s = 1.0 if config.verbose else QUIET_INTERVAL_S
            if config.prints(rank) and now - last_print > interval_s and work_done < total_work:
                last_print = now
                left = (now - t_start) / work_done * (total_work - work_done)
                detail = (f"microbatch size {m}/{ms[-1]}: fwd {(t1 - t0) * 1e3:.2f} ms, "
                          f"recompute + bwd {(t2 - t1) * 1e3:.2f} ms; " if config.verbose else "")
                print(f"[hf-cephalo profile] rank {rank} ({name}): round {k + 1}/{rounds}, "
                      f"{detail}about {left:.0f} s left", flush=True)


COMPILE_STOPS = ("Every rank stops while profiling the compiled units for the plan (the "
                 "trainer profiles when no plan file is given)")
"""What a ``CompileFailure`` raised by the profiler says the ranks do next."""


def _compile_unit(staged, config: MeasureConfig, inputs, views: _FlatViews, device, rank: int,
                  name: str, rank_codes: Callable[[int], list[int]] | None) -> None:
    """[Note: compiling before timing] With compile on, the unit's graphs are compiled before
    the timed rounds: one untimed forward and recompute + backward, as ``_time_rounds`` runs
    them, at the smallest and the largest microbatch size (the static graph and the
    dynamic-shape one every other size reuses: [Note: compiled units] in engine/compile.py).
    So a unit that cannot compile fails here, on every rank (the ranks exchange the outcome,
    ``rank_codes``, before the first lockstep barrier), with the engine's wording
    (``CompileFailure``: unit, backend, the root cause, ``--torch_compile False``), never as
    dynamo's raw error in the middle of the timing; and the progress estimate of the rounds
    leaves the compile time out. Rank 0 prints the compile time and graphs, and
    ``record_compile`` keeps them for the engine's compile line (whose probe then finds the
    graphs compiled)."""
    options = CompileOptions(backend=config.compile_backend, mode=config.compile_mode)
    unit_name = f"unit 0 ({type(staged.units()[0]).__name__})"
    ms = config.microbatch_sizes
    failure, before, t0 = None, graph_count(), time.perf_counter()
    try:
        for m in dict.fromkeys([ms[0], ms[-1]]):
            _, hidden, ctx, grad = inputs[m]
            views.install()
            with torch.no_grad():
                staged.run_unit(0, hidden, ctx)
            views.install()
            _unit_backward(staged, hidden, ctx, grad)
        sync_device(device)
    except Exception as exc:  # any compiler error: reported on every rank, never swallowed
        failure = CompileFailure(0, unit_name, options, [rank], exc, stops=COMPILE_STOPS)
    seconds, graphs = time.perf_counter() - t0, graph_count() - before
    code = 0 if failure is None else 1
    codes = rank_codes(code) if rank_codes is not None else [code]
    if failure is not None:
        raise failure.on_ranks(codes)
    remote = remote_failure(codes, options, rank, [unit_name],
                            stops="while profiling the compiled units for the plan")
    if remote is not None:
        raise remote
    record_compile(options, "while profiling", graphs, seconds)
    if config.prints(rank):
        print(f"[hf-cephalo profile] rank {rank} ({name}): torch.compile (backend "
              f"{options.backend}, mode {options.mode}) of the timed unit: "
              f"{plural(graphs, 'graph')} compiled in {seconds:.1f} s (before the timed rounds "
              f"and their time estimate)", flush=True)


# ---- step terms outside the units (planner/cost.py [Note: step terms]) -----------------------
def _embed_backward(staged: StagedModel, mb, grad: torch.Tensor) -> None:
    """The engine's embedding backward: recompute the embedding with autograd, backward."""
    with torch.enable_grad():
        hidden, _ = staged.embed(mb)
    if hidden.requires_grad:
        torch.autograd.backward(hidden, grad)


def _measure_root(staged, config: MeasureConfig, inputs, device,
                  before_each) -> tuple[list[float], list[float]]:
    """Per profiled m, the median (embed_s, head_s) of one microbatch: the embedding's forward
    plus its recompute + backward, and the head's loss forward + backward (the engine's root
    phases, [Note: layered schedule] in engine/schedule.py), seconds. Rounds over every m
    like the unit's, lockstep with ``before_each``."""
    ms = config.microbatch_sizes
    embed: dict[int, list[float]] = {m: [] for m in ms}
    head: dict[int, list[float]] = {m: [] for m in ms}
    for k in range(config.warmup + config.repeats):
        for m in ms:
            mb, hidden, ctx, grad = inputs[m]
            if before_each is not None:
                before_each()
            sync_device(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                staged.embed(mb)
            sync_device(device)
            t1 = time.perf_counter()
            _head_backward(staged, hidden, mb, ctx)
            sync_device(device)
            t2 = time.perf_counter()
            _embed_backward(staged, mb, grad)
            sync_device(device)
            t3 = time.perf_counter()
            if k >= config.warmup:
                embed[m].append((t1 - t0) + (t3 - t2))
                head[m].append(t2 - t1)
    return (_non_decreasing([statistics.median(embed[m]) for m in ms]),
            _non_decreasing([statistics.median(head[m]) for m in ms]))


def _measure_bookkeeping(device: torch.device, repeats: int) -> float:
    """The engine's host bookkeeping per unit and microbatch outside the unit's compute:
    capturing the RNG state before the forward and replaying it around the recompute
    (engine/schedule.py ``RngState``), median seconds."""
    from hf_cephalo.engine.schedule import RngState

    times = []
    for _ in range(max(5, 4 * repeats)):
        t0 = time.perf_counter()
        state = RngState(device)
        fork = state.replay()
        fork.__exit__(None, None, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_optimizer(staged: StagedModel, device: torch.device, repeats: int) -> float:
    """Seconds per parameter element of the optimizer step plus the engine's gradient-norm
    clipping (``CephaloEngine.clip_grad_norm_``) on two unit-sized flat shards: AdamW, fused
    where the device supports it (the Trainer's default ``adamw_torch_fused``)."""
    numel = sum(p.numel() for p in staged.units()[0].parameters() if p.requires_grad) or \
        sum(p.numel() for p in staged.units()[0].parameters())
    dtype = model_dtype(staged)
    params = [torch.zeros(numel, dtype=dtype, device=device, requires_grad=True) for _ in range(2)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:
        opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
        opt.step()
    except (RuntimeError, TypeError):  # no fused kernel for this device / dtype
        opt = torch.optim.AdamW(params, lr=1e-6)
        opt.step()
    times = []
    for _ in range(max(3, repeats)):
        sync_device(device)
        t0 = time.perf_counter()
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for p in params:
            sq += p.grad.double().pow(2).sum()
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        opt.step()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (2 * numel)


def _measure_unit(staged, config: MeasureConfig, inputs, device, rank: int, name: str,
                  before_each, any_rank, rank_codes):
    """Unit 0 of ``staged`` (a ``ProfiledUnit`` for a layer of another size): per m, its
    forward and backward seconds (fitted non-decreasing), its activation memory (unit, head
    phase) and its kept graph, as five lists in the order of ``config.microbatch_sizes``."""
    ms = config.microbatch_sizes
    views = _FlatViews(staged.units()[0], dtype=config.gather_dtype)
    views.prepare_grad()  # backward adds into the unit's flat gradient, as in the engine
    try:
        if config.compile_backend is not None:
            _compile_unit(staged, config, inputs, views, device, rank, name, rank_codes)
        fwd_med, bwd_med = _measure_times(staged, config, inputs, views, device, rank, name,
                                          before_each, any_rank)
        unit_head = [_compute_memory(staged, views, inputs[m][1], inputs[m][0],
                                     inputs[m][2], inputs[m][3], device) for m in ms]
        kept = [_kept_graph_memory(staged, views, inputs[m][1], inputs[m][2], device)
                for m in ms]
    finally:
        views.restore()
    return (_non_decreasing([fwd_med[m] for m in ms]), _non_decreasing([bwd_med[m] for m in ms]),
            [u for u, _ in unit_head], [h for _, h in unit_head], kept)


def measure_device(staged: StagedModel, config: MeasureConfig, *, device: torch.device | str,
                   name: str, capacity_bytes: float, rank: int = 0,
                   make_microbatch: MakeMicrobatch | None = None,
                   before_each: Callable[[], None] | None = None,
                   any_rank: Callable[[bool], bool] | None = None,
                   rank_codes: Callable[[int], list[int]] | None = None) -> DeviceProfile:
    """Profile one unit on this rank for m = 1..M (no collectives unless ``before_each`` has).

    Args:
        staged: the staged model (an ``EmulatedStagedModel`` measures the emulated device);
            its root modules and one unit of each size (``unit_groups``: unit 0 when the
            layers are identical; [Note: layers of different sizes]) are moved to ``device``
            (the other units are never run, so they stay where they are). With layers of
            several sizes, the times and kept graphs recorded are those of the layers' mean
            (each size weighted by its count), the activation memory the largest.
        config: what to profile. device: the compute device. name: recorded device name.
        capacity_bytes: C_i recorded in the profile. rank: used in progress lines.
        make_microbatch: ``m -> microbatch`` override of ``synthetic_microbatch``.
        before_each: called before each timed (round, m) item, outside the timed region
            (``profile_cluster`` passes a barrier: [Note: lockstep profiling]).
        any_rank: ``flag -> True iff flag is True on any rank`` (a collective); decides
            whether every rank re-measures, so lockstep barriers stay matched. None: this
            rank alone ([Note: implausible backward times]).
        rank_codes: ``code -> every rank's code`` (a collective; None: this rank alone); with
            ``config.compile_backend`` set, the ranks exchange whether the unit compiled before
            the first timed item ([Note: compiling before timing]).
    Returns:
        A ``DeviceProfile``; the model's gradients are left as None.
    Raises:
        CompileFailure (engine/compile.py): with ``config.compile_backend`` set, the unit
            failed to compile on this rank; RuntimeError: it failed on another rank.
    """
    refuse_reshaping_units(staged)
    device = torch.device(device)
    groups = unit_groups(staged)  # [Note: layers of different sizes]
    total = sum(count for _, count in groups)
    views_of = [staged if len(groups) == 1 else ProfiledUnit(staged, index)
                for index, _ in groups]
    model = staged.model
    making = [i for i in range(staged.num_units) if staged.produces_side_inputs(i)]
    for module in [*staged.root_modules(),
                   *(staged.units()[i] for i in {*(i for i, _ in groups), *making})]:
        module.to(device)  # only what is run: never the whole model on the device
    was_training = model.training
    model.train()
    params = list(model.parameters())
    make = make_microbatch or (
        lambda m: synthetic_microbatch(model, m, config.sequence_length, device))
    ms = config.microbatch_sizes
    try:
        inputs = {}
        for m in ms:
            mb = {k: v.to(device) for k, v in make(m).items()}
            with torch.no_grad():
                hidden, ctx = staged.embed(mb)
                for index in making:  # what the units read besides the hidden states (T5's
                    # position bias, made by its layer 0), made from the embedding's output
                    ctx = staged.produce_side_inputs(index, hidden, ctx)
            if config.gather_dtype is not None:  # a low-precision embedding's output
                hidden = hidden.to(config.gather_dtype)
            inputs[m] = (mb, hidden, ctx, torch.randn_like(hidden))
        measured = []  # per layer size: (share of the layers, fwd, bwd, unit, head, kept)
        for one, (index, count) in zip(views_of, groups):
            f, b, u, h, k = _measure_unit(one, config, inputs, device, rank, name, before_each,
                                          any_rank, rank_codes)
            measured.append((count / total, f, b, u, h, k))
            if len(groups) > 1 and config.prints(rank):
                print(f"[hf-cephalo profile] rank {rank} ({name}): layer {index} "
                      f"({count} of {total} layers of its size): m={ms[-1]}: fwd "
                      f"{f[-1] * 1e3:.2f} ms, bwd {b[-1] * 1e3:.2f} ms", flush=True)
        # times and kept graphs: the layers' mean (L times it is the sum over the layers);
        # activation memory: the largest layer's (one unit recomputes at a time)
        fwd, bwd, kept = ([sum(g[0] * g[j][i] for g in measured) for i in range(len(ms))]
                          for j in (1, 2, 5))
        mem, head_mem = ([max(g[j][i] for g in measured) for i in range(len(ms))]
                         for j in (3, 4))
        embed_s, head_s = _measure_root(staged, config, inputs, device, before_each)
        bookkeeping_s = _measure_bookkeeping(device, config.repeats)
        optimizer_s = _measure_optimizer(staged, device, config.repeats)
        if config.prints(rank):
            print(f"[hf-cephalo profile] rank {rank} ({name}): done; m={ms[-1]}: fwd "
                  f"{fwd[-1] * 1e3:.2f} ms, bwd {bwd[-1] * 1e3:.2f} ms, compute memory "
                  f"{mem[-1] / GIB:.3f} GiB per unit", flush=True)
    finally:
        for p in params:
            p.grad = None
        model.train(was_training)
    return DeviceProfile(name=name, memory_capacity_bytes=capacity_bytes, microbatch_sizes=ms,
                         fwd_s=fwd, bwd_s=bwd, compute_memory_bytes=mem,
                         head_memory_bytes=head_mem, embed_s=embed_s, head_s=head_s,
                         kept_graph_bytes=kept,
                         microbatch_overhead_s=bookkeeping_s,
                         optimizer_s_per_param=optimizer_s)
