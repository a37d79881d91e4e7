"""Predict time and memory of ANY plan (optimized, even split, hand-made) with the cost model.

Used by the optimizer to fill ``predicted_iteration_s``, by the baselines (``simulate.py``) and
the CLI tables. Hand-made plans may have a smaller last microbatch
(``RankPlan.last_microbatch_size``); its forward/backward time is F(m_last), B(m_last)
(``cost.rank_compute_s``). Pure Python/numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["RankPrediction", "MachinePrediction", "Prediction", "predict", "plan_layout",
           "MeasuredStep", "predicted_unit_compute_s", "refit_to_measured", "measured_speeds"]


class RankPrediction(NamedTuple):
    unit_time_s: float  # T_i, one unit forward + backward, seconds
    compute_memory_bytes: float  # M_i(m_i, b_i): every device byte besides the state (idle: buffers)
    memory_bytes: float  # r_i·S + M_i, bytes
    cap_bytes: float  # c·C_i, bytes
    fits: bool  # memory_bytes <= cap_bytes
    step: cost.StepTerms | None = None  # the rank's step terms ([Note: step terms] in cost.py)


class MachinePrediction(NamedTuple):
    host_bytes: float  # pinned offload bytes of the machine's ranks, Σ (L + 1)·b_i·a
    cap_bytes: float  # c × the machine's RAM (inf when not known)
    fits: bool


class Prediction(NamedTuple):
    ranks: list[RankPrediction]
    iteration_s: float  # the step time of cost.py [Note: step terms], seconds
    samples_per_s: float  # B / iteration_s
    fits: bool  # every rank under its cap and every machine's host memory under its cap
    machines: list[MachinePrediction] = []  # per machine (ClusterProfile.machines_of_ranks)


def plan_layout(plan: Plan, cluster: ClusterProfile) -> list[list[int]]:
    """The engine's per-unit shard layout of ``plan``: the L layers, then the embedding and the
    head unit (``memory.model_layout_numels``; engine.py ``_build_units``)."""
    return plan.unit_layout(memory.model_layout_numels(cluster.model))


def predict(plan: Plan, cluster: ClusterProfile, memory_fraction: float | None = None) -> Prediction:
    """Per-rank unit time, step terms and memory of ``plan`` on ``cluster`` (docs/design.md
    contract 2). The iteration time is the step of [Note: step terms] in ``cost.py`` (the
    slowest rank's units, root compute and bookkeeping, the slowest optimizer step and host
    overhead, the step's collectives outside the units); with a profile of the units alone
    (no step terms) num_units · max_i T_i.

    Memory: r_i·S + ``memory.rank_memory_bytes`` with the collective buffers of the plan's own
    shard layout, ``plan.root_resident`` and ``plan.activation_checkpointing`` (the cost and
    memory models without recompute: cost.py, memory.py); host memory per machine.

    Args:
        plan: any Plan with ``plan.world_size == cluster.world_size``.
        cluster: the profiles.
        memory_fraction: c for the caps; defaults to ``plan.memory_fraction``.

    Raises:
        ValueError: world-size or model mismatch (``Plan.validate_for``).
    """
    plan.validate_for(cluster.world_size, cluster.model)
    c = plan.memory_fraction if memory_fraction is None else memory_fraction
    S = cluster.model.state_bytes
    layout = None if cluster.buffers_in_compute_memory else plan_layout(plan, cluster)
    out = []
    for i, (r, d) in enumerate(zip(plan.ranks, cluster.devices)):
        if r.batch_size == 0:
            t = cost.idle_unit_time_s(cost.unit_comm(cluster), plan.uneven_state)
        else:
            # l·F and l·(F + B) of the contract, with the last microbatch's own size.
            f, b = cost.rank_compute_s(d, r.batch_size, r.microbatch_size)
            t = float(cost.unit_time_s(f, b, 1, cost.unit_comm(cluster), plan.uneven_state,
                                       activation_checkpointing=plan.activation_checkpointing))
        mem = float(memory.rank_memory_bytes(
            cluster, i, r.microbatch_size, r.batch_size, root_resident=plan.root_resident,
            layout=layout, activation_checkpointing=plan.activation_checkpointing))
        total = r.state_ratio * S + mem
        cap = c * d.memory_capacity_bytes
        out.append(RankPrediction(t, mem, total, cap, total <= cap * (1 + 1e-9)))
    terms = cost.step_terms(cluster, [p.unit_time_s for p in out],
                            [r.batch_size for r in plan.ranks],
                            [r.microbatch_size for r in plan.ranks], plan.state_ratios)
    out = [p._replace(step=s) for p, s in zip(out, terms)]
    machines = _machines(plan, cluster, c)
    it = cost.step_time_from_terms(terms)
    fits = all(p.fits for p in out) and all(m.fits for m in machines)
    return Prediction(out, it, plan.global_batch_size / it, fits, machines)


def _machines(plan: Plan, cluster: ClusterProfile, c: float) -> list[MachinePrediction]:
    owner = cluster.machines_of_ranks
    host = [0.0] * (max(owner) + 1)
    for r, k in zip(plan.ranks, owner):
        host[k] += float(memory.host_memory_bytes(cluster.model, r.batch_size,
                                                  cluster.offload_activations))
    out = []
    for k, need in enumerate(host):
        cap = np.inf if cluster.host_memory_bytes is None else c * cluster.host_memory_bytes[k]
        out.append(MachinePrediction(need, cap, need <= cap * (1 + 1e-9)))
    return out


# ---- back from what a run measured ------------------------------------------------------------
class MeasuredStep(NamedTuple):
    """What one rank measured over a training run (medians over the steps after warm-up)."""

    step_s: float | None  # the step, seconds
    unit_compute_s: float | None  # forward (+ recompute) + backward of every unit, s per step
    root_compute_s: float | None  # embedding + head compute, seconds per step


def predicted_unit_compute_s(plan: Plan, cluster: ClusterProfile, rank: int) -> float:
    """num_units · (l·F + l·(F + B)) of one rank, seconds per step (unit compute only);
    without activation checkpointing num_units · l·(F + B) (no recompute: cost.py [Note: unit
    time without activation checkpointing])."""
    r, d = plan.ranks[rank], cluster.devices[rank]
    f, b = cost.rank_compute_s(d, r.batch_size, r.microbatch_size)
    forwards = 2 if plan.activation_checkpointing else 1
    return cluster.model.num_units * float(forwards * f + b)


def _usable(x) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def _scaled(values, factor):
    return None if values is None else [v * factor for v in values]


def refit_to_measured(plan: Plan, cluster: ClusterProfile,
                      measured: Sequence[MeasuredStep]) -> ClusterProfile:
    """``cluster`` with each rank's profile refit to what ``plan`` measured in training.

    Per rank with samples: ``fwd_s`` / ``bwd_s`` scaled by measured / predicted unit compute,
    ``embed_s`` / ``head_s`` by measured / predicted root compute (each table keeps its shape
    in m; a term not measured keeps its profiled values). Then the part of the measured step
    (the slowest rank's) that the refit model still does not explain goes into every rank's
    ``step_overhead_s`` (clamped at 0: the host term of cost.py [Note: step terms]), so
    ``predict(plan, refit).iteration_s`` equals the measured step whenever the rest of the
    model does not already exceed it. Missing or non-finite measurements are skipped. Pure:
    the input is not changed.

    Raises:
        ValueError: ``measured`` has not one entry per rank, or the plan does not fit the
            cluster (``Plan.validate_for``).
    """
    if len(measured) != cluster.world_size:
        raise ValueError(f"refit: {len(measured)} measurements for world size "
                         f"{cluster.world_size}; give one per rank")
    devices = []
    for i, (r, d, got) in enumerate(zip(plan.ranks, cluster.devices, measured)):
        d = dataclasses.replace(d)
        if r.batch_size > 0 and _usable(got.unit_compute_s):
            k = got.unit_compute_s / predicted_unit_compute_s(plan, cluster, i)
            d.fwd_s, d.bwd_s = _scaled(d.fwd_s, k), _scaled(d.bwd_s, k)
        pred_root = float(cost.root_compute_s(d, r.batch_size, r.microbatch_size))
        if r.batch_size > 0 and _usable(got.root_compute_s) and pred_root > 0:
            k = got.root_compute_s / pred_root
            d.embed_s, d.head_s = _scaled(d.embed_s, k), _scaled(d.head_s, k)
        devices.append(d)
    refit = dataclasses.replace(cluster, devices=devices)
    steps = [m.step_s for m in measured if _usable(m.step_s)]
    if steps:
        residual = max(steps) - predict(plan, refit).iteration_s
        for d in devices:
            d.step_overhead_s = max(0.0, d.step_overhead_s + residual)
    return refit


def measured_speeds(plan: Plan, cluster: ClusterProfile,
                    measured: Sequence[MeasuredStep]) -> list[dict[str, float]]:
    """Per rank, how much slower than ``cluster`` predicts it the run ran (dimensionless,
    1 = as predicted), by each meter it measured: "unit compute" (measured / predicted unit
    compute per step, where the compute was timed and the rank had samples) and "step" (the
    measured step / ``predict``'s iteration time; a co-tenant also slows the collectives and
    the host, which the unit compute does not show). The load meters of the profile cache's
    write-back (``profiles.cache.judge_write_back``). Pure.

    Raises:
        ValueError: ``measured`` has not one entry per rank.
    """
    if len(measured) != cluster.world_size:
        raise ValueError(f"{len(measured)} measurements for world size {cluster.world_size}")
    step = predict(plan, cluster).iteration_s
    out: list[dict[str, float]] = []
    for i, (r, got) in enumerate(zip(plan.ranks, measured)):
        speeds = {}
        predicted = predicted_unit_compute_s(plan, cluster, i) if r.batch_size > 0 else 0.0
        if _usable(got.unit_compute_s) and predicted > 0:
            speeds["unit compute"] = got.unit_compute_s / predicted
        if _usable(got.step_s) and step > 0:
            speeds["step"] = got.step_s / step
        out.append(speeds)
    return out
