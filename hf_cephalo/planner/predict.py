"""Predict time and memory of ANY plan (optimized, even split, hand-made) with the cost model.

Used by the optimizer to fill ``predicted_iteration_s``, by the baselines (``simulate.py``) and
the CLI tables. Hand-made plans may have a smaller last microbatch
(``RankPlan.last_microbatch_size``); its forward/backward time is F(m_last), B(m_last)
(``cost.rank_compute_s``). Pure Python/numpy.
"""

from __future__ import annotations

from typing import NamedTuple

from hf_cephalo.planner import cost
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiler.types import ClusterProfile

__all__ = ["RankPrediction", "Prediction", "predict"]


class RankPrediction(NamedTuple):
    unit_time_s: float  # T_i, one unit forward + backward, seconds
    compute_memory_bytes: float  # M_i(m_i), bytes (0 for an idle rank)
    memory_bytes: float  # r_i·S + M_i(m_i), bytes
    cap_bytes: float  # c·C_i, bytes
    fits: bool  # memory_bytes <= cap_bytes


class Prediction(NamedTuple):
    ranks: list[RankPrediction]
    iteration_s: float  # num_units · max_i T_i, seconds
    samples_per_s: float  # B / iteration_s
    fits: bool  # every rank under its cap


def predict(plan: Plan, cluster: ClusterProfile, memory_fraction: float | None = None) -> Prediction:
    """Per-rank unit time and memory of ``plan`` on ``cluster`` (docs/design.md contract 2).

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
    out = []
    for r, d in zip(plan.ranks, cluster.devices):
        if r.batch_size == 0:
            t = cost.idle_unit_time_s(cluster.comm, plan.uneven_state)
            mem = 0.0
        else:
            # l·F and l·(F + B) of the contract, with the last microbatch's own size.
            f, b = cost.rank_compute_s(d, r.batch_size, r.microbatch_size)
            t = float(cost.unit_time_s(f, b, 1, cluster.comm, plan.uneven_state))
            mem = float(cost.compute_memory_bytes(d, r.microbatch_size))
        total = r.state_ratio * S + mem
        cap = c * d.memory_capacity_bytes
        out.append(RankPrediction(t, mem, total, cap, total <= cap * (1 + 1e-9)))
    it = cost.iteration_time_s([p.unit_time_s for p in out], cluster.model.num_units)
    return Prediction(out, it, plan.global_batch_size / it, all(p.fits for p in out))
