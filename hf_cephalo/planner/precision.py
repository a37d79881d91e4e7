"""The planner's choice of precision per rank (``--precision auto``; docs/planner.md
"Precision per rank").

The fastest precision of every GPU alone is not always the fastest job: when the ranks differ,
the engine all-gathers the fp32 master (docs/engine.md "Precision per rank"), twice the bytes of
a job gathered in one 16-bit dtype. On a cluster whose GPUs all run fp16 (A10G, V100, T4) at
the rate of their bf16, fp16 for every rank moves half the all-gather bytes at the same compute
speed. So ``auto`` plans every candidate — each GPU's fastest precision, and each precision
every GPU runs — and keeps the one with the shortest predicted iteration.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

from hf_cephalo.planner.optimize import InfeasiblePlanError
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.precision import FASTEST_FIRST
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["PrecisionChoice", "precision_candidates", "choose_precision"]


class PrecisionChoice(NamedTuple):
    """label: the chosen candidate ("bf16", "fp16", "fp32" for one precision for all, or
    "per-rank fastest"); precisions: per rank; plan; predicted_s: per candidate label its
    predicted iteration seconds (None: infeasible)."""

    label: str
    precisions: list[str]
    plan: Plan
    predicted_s: dict[str, float | None]


def precision_candidates(supported: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """Per-rank precision lists to plan: each precision every rank runs (one for all; 16-bit
    first), then each rank's fastest (``supported[i]`` fastest first) when that differs."""
    out = {}
    for p in FASTEST_FIRST:
        if all(p in s for s in supported):
            out[p] = [p] * len(supported)
    fastest = [s[0] for s in supported]
    if fastest not in out.values():
        out["per-rank fastest"] = fastest
    return out


def choose_precision(candidates: Mapping[str, list[str]],
                     plan_for: Callable[[list[str]], tuple[ClusterProfile, Plan]]
                     ) -> PrecisionChoice:
    """The candidate whose plan (``plan_for(precisions) -> (profile, plan)``) has the shortest
    ``predicted_iteration_s``; on a tie the earlier candidate (fewer gathered bytes).
    Raises InfeasiblePlanError when no candidate fits (the last candidate's error)."""
    best, times, last_error = None, {}, None
    for label, precisions in candidates.items():
        try:
            _, plan = plan_for(precisions)
        except InfeasiblePlanError as e:
            times[label], last_error = None, e
            continue
        times[label] = plan.predicted_iteration_s
        if best is None or plan.predicted_iteration_s < best[2].predicted_iteration_s:
            best = (label, precisions, plan)
    if best is None:
        raise last_error
    return PrecisionChoice(best[0], list(best[1]), best[2], times)
