"""Exact optimizer for (b_i, m_i, l_i) under the cost model of ``cost.py`` (docs/design.md contract 2).

Problem (paper §2.4): minimize max_i T_i(l_i, m_i) (with each rank's root compute and
bookkeeping spread over its units: cost.py [Note: step terms]) subject to (I) Σ b_i = B,
b_i = l_i·m_i (b_i = 0 allowed: an idle rank), (II) M_i(m_i) ≤ c·C_i for b_i > 0, (III) S + Σ M_i ≤ c·Σ C_i.
T_i depends on whether the state is sharded unevenly (u = 1.15), which depends on the choice, so
two cases are solved and the better one kept: even (u = 1: every rank holds S/N, so (II) becomes
M_i(m_i) ≤ c·C_i − S/N and (III) holds automatically) and uneven (u = 1.15: (II) and (III) as
written, searched only below the even optimum, which makes min(even, uneven) the exact minimum:
an even-feasible choice only ever looks slower under u = 1.15).

The threshold search of each case is ``solver.py``; then the greedy state partition
(``state.partition_state``) for uneven plans, 1/N otherwise. The paper's O(N·B³·log B)
recurrence is kept in ``reference.py`` for cross-checking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.generation import forward_pass_s
from hf_cephalo.planner.predict import predict
from hf_cephalo.planner.solver import (Assignment, Case, FixedState, device_groups, diagnose,
                                       fixed_state_groups, num_convolutions)
from hf_cephalo.planner.state import layout_unit_shards, partition_state
from hf_cephalo.planner.types import Plan, RankPlan, check_batch_and_fraction
from hf_cephalo.profiles.types import ClusterProfile, format_bytes
from hf_cephalo.units import GIB

__all__ = ["optimize", "optimize_auto_checkpointing", "AutoCheckpointing", "optimize_fixed_state",
           "has_kept_graph_profile", "solve_assignment", "check_scoring_passes", "scored_step_s",
           "Assignment", "FixedState", "InfeasiblePlanError", "check_problem_size",
           "estimate_problem_size", "format_bytes"]


class InfeasiblePlanError(ValueError):
    """No plan fits; the message names the binding constraint and ``constraint`` its kind,
    so that callers can add the flags that relax it: "device" (a rank's microbatch of one
    sample exceeds its memory cap), "aggregate" (training state plus the batch's compute exceed
    the cluster's memory; a smaller global batch would fit), "state" (as "aggregate", but at any
    global batch size: state plus the per-rank buffers alone do not fit), "batch" (each rank's
    cap limits its batch b_i, e.g. the kept graphs without activation checkpointing, and
    together the ranks take fewer than B samples; a smaller global batch would fit), "idle"
    (B < world size and idle ranks not allowed), "host" (pinned
    host memory of the activation offload), or "" (not known)."""

    def __init__(self, message: str, constraint: str = "") -> None:
        super().__init__(message)
        self.constraint = constraint


def _check_inputs(cluster: ClusterProfile, B: int, c: float) -> None:
    if not isinstance(cluster, ClusterProfile):
        raise TypeError(f"cluster must be a ClusterProfile, got {type(cluster).__name__}")
    check_batch_and_fraction(B, c)


# Upfront size limits of one solve (see ``check_problem_size``). Calibrated on 2 CPU cores:
# 2e10 work units is about 10-30 s; the options arrays are the solver's dominant memory.
MAX_SOLVER_WORK = 2e10
MAX_SOLVER_MEMORY_BYTES = 4 * GIB
_BYTES_PER_OPTION = 96  # retained (b, m, l, t, mem) in 2 cases + construction temporaries
_PY_CALL_WORK = 3000  # one min-plus row update (a NumPy call) in element operations


def estimate_problem_size(cluster: ClusterProfile, global_batch_size: int,
                          memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION) -> tuple[float, float]:
    """(work, memory bytes) upper estimates of one ``solve_assignment`` call, in closed form.

    work: element operations of one min-plus feasibility check, convolutions × (B²/2 + a
    per-row NumPy call cost × B) plus the (l, m) options scanned. memory: the (l, m) options of
    every device type in both cases; per type K ≤ B·(ln m_max + 1) options, m_max the largest
    microbatch size whose compute memory fits c·C_i (linear memory model, ``cost.memory_line``).
    Nothing of size B is allocated, so absurd B are estimated instantly.
    """
    B = int(global_batch_size)
    groups = device_groups(cluster)
    options = 0.0
    for g in groups:
        d = cluster.devices[g[0]]
        slope, intercept = cost.memory_line(d)
        cap = memory_fraction * d.memory_capacity_bytes
        m_max = float(B) if slope <= 0 else min(float(B), max(0.0, (cap - intercept) / slope))
        if m_max >= 1:
            options += B * (np.log(m_max) + 1.0)
    convs = num_convolutions(groups)
    work = convs * (B * B / 2.0 + _PY_CALL_WORK * B) + options
    return work, options * _BYTES_PER_OPTION


def check_problem_size(cluster: ClusterProfile, global_batch_size: int,
                       memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION) -> None:
    """Refuse instances whose solve would take minutes or exhaust memory (before allocating).

    Limits: ``MAX_SOLVER_WORK`` element operations per feasibility check and
    ``MAX_SOLVER_MEMORY_BYTES`` (module constants; raise them to accept a longer solve).
    Work grows as B² × (convolutions, ~ number of device types × log2 ranks per type).

    Raises:
        ValueError: the estimate exceeds a limit; the message gives B, the estimate, the
            limit and the largest B within it.
    """
    B = int(global_batch_size)
    work, mem = estimate_problem_size(cluster, B, memory_fraction)
    if work <= MAX_SOLVER_WORK and mem <= MAX_SOLVER_MEMORY_BYTES:
        return
    lo, hi = 1, B  # largest B within both limits (both estimates grow with B)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        w, m = estimate_problem_size(cluster, mid, memory_fraction)
        lo, hi = (mid, hi) if w <= MAX_SOLVER_WORK and m <= MAX_SOLVER_MEMORY_BYTES else \
            (lo, mid - 1)
    what = (f"~{work:.2g} operations per feasibility check (limit {MAX_SOLVER_WORK:.2g})"
            if work > MAX_SOLVER_WORK else
            f"~{format_bytes(mem)} of solver memory (limit {format_bytes(MAX_SOLVER_MEMORY_BYTES)})")
    raise ValueError(
        f"global batch size {B} is too large to plan exactly for {cluster.world_size} ranks "
        f"({len(device_groups(cluster))} device profiles): it needs {what}; the largest "
        f"global batch size within the limits for this cluster is {lo}. Plan a smaller global "
        "batch size (or raise hf_cephalo.planner.optimize.MAX_SOLVER_WORK / "
        "MAX_SOLVER_MEMORY_BYTES to accept a longer solve)")


def check_scoring_passes(scoring_passes: float) -> float:
    """``scoring_passes`` as a float k >= 0 (forward-only passes per optimizer step; a
    fraction when a generation round feeds several steps).

    Raises:
        ValueError: k negative, not finite or not a number (a bool included).
    """
    k = scoring_passes
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not np.isfinite(k) or k < 0:
        raise ValueError(f"scoring_passes must be a finite number >= 0 (forward-only passes per "
                         f"optimizer step), got {scoring_passes!r}")
    return float(k)


def _solve_cases(even: Case, uneven: Case, k: float, world_size: int) -> Assignment | None:
    """The better of the two cases (module doc), or None when neither is feasible. k = 0: the
    threshold search of max_i T_i; k > 0: the least max_i T_i + k·max_i s_i (solver.py
    [Note: scoring passes]), the uneven case searched only below the even optimum."""
    if k == 0:
        t_even = even.solve(np.inf)
        t_uneven = uneven.solve(np.inf if t_even is None else t_even)
        if t_uneven is not None:
            return uneven.reconstruct(t_uneven, world_size)
        return None if t_even is None else even.reconstruct(t_even, world_size)
    ts_even = even.solve_scored(k, np.inf)
    ts_uneven = uneven.solve_scored(k, np.inf if ts_even is None else
                                    ts_even[0] + k * ts_even[1])
    for case, ts in ((uneven, ts_uneven), (even, ts_even)):
        if ts is not None:
            return case.reconstruct(ts[0], world_size, ts[1])
    return None


def solve_assignment(cluster: ClusterProfile, global_batch_size: int,
                     memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                     allow_idle: bool = True, root_resident: bool = False,
                     activation_checkpointing: bool = True,
                     scoring_passes: float = 0.0) -> Assignment:
    """Exact minimum of max_i T_i over (b_i, m_i, l_i) under (I)-(III); see module doc. With
    ``scoring_passes`` k > 0: of max_i T_i + k·max_i s_i, s_i one unit of rank i's forward-only
    pass (``cost.forward_unit_time_s``; solver.py [Note: scoring passes]), so that
    L × it is the training compute phase plus k ``generation.forward_pass_s``.

    Memory per rank is ``memory.rank_memory_bytes`` (every engine buffer, see [Note: memory
    terms]); with activation offload and host RAM figures each machine's batch is limited by
    its RAM (solver.py [Note: host memory in the knapsack]). ``root_resident``: see ``optimize``;
    ``activation_checkpointing`` (one setting, True or False): the engine's, priced by
    ``cost.unit_time_s`` and ``memory.rank_memory_bytes``.

    Raises:
        InfeasiblePlanError (a ValueError): no assignment fits; the message names the binding
            constraint (a rank whose microbatch size 1 exceeds its cap, aggregate memory, each
            rank's largest batch b_i within its cap summing to less than B, or a machine's
            host memory); never an empty reason.
        ValueError: B < 1, memory_fraction outside (0, 1], scoring_passes not a finite
            number >= 0; an instance too large to solve within ``MAX_SOLVER_WORK`` /
            ``MAX_SOLVER_MEMORY_BYTES`` (``check_problem_size``).
    """
    B, c = global_batch_size, memory_fraction
    _check_inputs(cluster, B, c)
    k = check_scoring_passes(scoring_passes)
    check_problem_size(cluster, B, c)
    groups = device_groups(cluster)
    ac = activation_checkpointing
    even = Case(cluster, groups, B, c, False, allow_idle, root_resident, checkpointing=ac)
    uneven = Case(cluster, groups, B, c, True, allow_idle, root_resident, checkpointing=ac)
    found = _solve_cases(even, uneven, k, cluster.world_size)
    if found is not None:
        return found
    diagnosis = diagnose(cluster, B, c, allow_idle, root_resident, ac)
    raise InfeasiblePlanError(f"no plan for global batch size {B} fits: "
                              f"{diagnosis.message or 'no assignment meets every memory cap'}",
                              diagnosis.constraint)


# [Note: state ratios on their own layout]
# The knapsack prices each rank's reduce-scatter outputs (its shard k of a unit, memory.py) at
# even shards, before any ratio exists; a rank the partition then gives a larger share holds
# larger shards, so water-filling on those prices could fill it a few shards past its cap.
# The ratios are therefore poured again on the memory of their own layout, a few times: k is
# a small part of M_i, so the ratios settle at once; ``predict`` checks the result.
_LAYOUT_REPOURS = 3


def _partition_on_layout(cluster: ClusterProfile, a: "Assignment", mem: list[float],
                         root_resident: bool, checkpointing: bool = True) -> list[float]:
    """Water-filling ratios r_i, re-poured on the memory of their own shard layout."""
    caps = [d.memory_capacity_bytes for d in cluster.devices]
    S = cluster.model.state_bytes
    ratios = partition_state(S, mem, caps)
    if cluster.buffers_in_compute_memory:
        return ratios
    numels = memory.model_layout_numels(cluster.model)
    for _ in range(_LAYOUT_REPOURS):
        layout = layout_unit_shards(ratios, numels)
        mem = [float(memory.rank_memory_bytes(cluster, i, m, b, root_resident=root_resident,
                                              layout=layout,
                                              activation_checkpointing=checkpointing))
               for i, (m, b) in enumerate(zip(a.microbatch_sizes, a.batch_sizes))]
        ratios = partition_state(S, mem, caps)
    return ratios


def has_kept_graph_profile(cluster: ClusterProfile) -> bool:
    """Whether every device profile has ``kept_graph_bytes``, so a plan without activation
    checkpointing can be priced (profiles measured before it, spec sheets: no)."""
    return all(d.kept_graph_bytes is not None for d in cluster.devices)


def optimize(cluster: ClusterProfile, global_batch_size: int,
             memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
             allow_idle: bool = True, root_resident: bool = False,
             activation_checkpointing: bool | None = True,
             scoring_passes: float = 0.0) -> Plan:
    """The optimal Plan: exact (b_i, m_i, l_i) plus greedy state ratios r_i.

    Args:
        cluster: profiles of the model, every rank's device and the collectives.
        global_batch_size: B, samples per iteration (>= 1).
        memory_fraction: c, fraction of each device's (and machine's host) memory the plan
            may use.
        allow_idle: allow ranks with b_i = 0 (they still hold state and join collectives).
        root_resident: price the engine's ``root_resident=True`` (embedding and head units
            gathered with their gradients all step); False (the engine's default) prices each
            root unit gathered around its uses. Recorded in the plan; the trainer builds the
            engine with it.
        activation_checkpointing: True (default, the paper's schedule: recompute in
            backward); False: the engine keeps every forward graph (faster, activation memory
            L·l_i·K(m_i), docs/planner.md); None: plan both (each an exact search) and keep
            the one with the smaller predicted step time that fits (checkpointing on a tie;
            without the profile's ``kept_graph_bytes`` only checkpointing is planned).
            Recorded in the plan; the trainer builds the engine with it.
        scoring_passes: k >= 0, forward-only layered passes over the same split per optimizer
            step (an RL step's old-policy and reference log-probabilities; a fraction when a
            generation round feeds several steps). The objective is then the training step
            plus k × ``generation.forward_pass_s`` (solver.py [Note: scoring passes]), still
            exact; 0 (default): the training step alone, the plans of before.
            ``predicted_iteration_s`` stays the training step's.

    Raises:
        InfeasiblePlanError / ValueError: see ``solve_assignment`` (for None: when no setting
            fits, the error of the checkpointing plan). ValueError: False with a profile
            without ``kept_graph_bytes``; scoring_passes not a finite number >= 0.
    """
    if activation_checkpointing is None:
        return optimize_auto_checkpointing(cluster, global_batch_size, memory_fraction,
                                           allow_idle=allow_idle, root_resident=root_resident,
                                           scoring_passes=scoring_passes).plan
    if not activation_checkpointing and not has_kept_graph_profile(cluster):
        missing = [d.name for d in cluster.devices if d.kept_graph_bytes is None]
        raise ValueError(f"activation checkpointing off needs the profile's kept_graph_bytes "
                         f"(the memory of the kept forward graphs), which the device profiles "
                         f"{sorted(set(missing))} lack: re-profile with this version "
                         "(`hf-cephalo profile`; a cached entry is measured anew) or plan with "
                         "activation checkpointing")
    return _optimize_one(cluster, global_batch_size, memory_fraction, allow_idle,
                         root_resident, bool(activation_checkpointing), fallback_error=False,
                         scoring_passes=scoring_passes)


class AutoCheckpointing(NamedTuple):
    """``optimize_auto_checkpointing``'s result: the plan and why its setting was chosen."""

    plan: Plan
    reason: str  # e.g. "off does not fit: ..." or "faster than on, predicted 0.8 s vs 1.1 s"


def optimize_auto_checkpointing(cluster: ClusterProfile, global_batch_size: int,
                                memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                                allow_idle: bool = True, root_resident: bool = False,
                                scoring_passes: float = 0.0) -> AutoCheckpointing:
    """``optimize(..., activation_checkpointing=None)`` with the reason of its choice, the
    text the CLI and the trainer print after ``[auto: ...]``: which setting did not fit (with
    the planner's diagnosis), or both predicted times (seconds: the iteration, plus k scoring
    passes with ``scoring_passes`` k > 0, ``scored_step_s``), or that the profile has no
    ``kept_graph_bytes`` so only checkpointing was planned.

    Raises:
        InfeasiblePlanError / ValueError: as ``optimize`` (neither setting fits: the error of
            the checkpointing plan).
    """
    args = (cluster, global_batch_size, memory_fraction, allow_idle, root_resident)
    on = _optimize_one(*args, True, fallback_error=True, scoring_passes=scoring_passes)
    if not has_kept_graph_profile(cluster):
        if isinstance(on, Exception):
            raise on
        return AutoCheckpointing(on, "the profile has no kept_graph_bytes (spec-sheet or older "
                                     "measurement), so only on was planned")
    off = _optimize_one(*args, False, fallback_error=True, scoring_passes=scoring_passes)
    if isinstance(on, Exception) and isinstance(off, Exception):
        raise on
    if isinstance(off, Exception):
        return AutoCheckpointing(on, f"off does not fit: {_reason(off)}")
    if isinstance(on, Exception):
        return AutoCheckpointing(off, f"on does not fit: {_reason(on)}")
    t_on, t_off = (scored_step_s(p, cluster, scoring_passes) for p in (on, off))
    if t_off < t_on:
        return AutoCheckpointing(off, f"faster than on, predicted {t_off:.3f} s vs {t_on:.3f} s")
    return AutoCheckpointing(on, f"{'as fast as' if t_on == t_off else 'faster than'} off, "
                                 f"predicted {t_on:.3f} s vs {t_off:.3f} s")


def _reason(error: InfeasiblePlanError) -> str:
    """The diagnosis of an infeasible plan without its "no plan for ... fits: " head."""
    text = str(error)
    head = "fits: "
    return text[text.index(head) + len(head):] if head in text else text


def scored_step_s(plan: Plan, cluster: ClusterProfile, scoring_passes: float = 0.0) -> float:
    """What ``optimize(..., scoring_passes=k)`` minimizes, seconds: the plan's predicted
    training step (``predict``; ``plan.predicted_iteration_s`` where set) plus k forward-only
    passes (``generation.forward_pass_s``); k = 0: the training step. Raises ValueError for k
    not a finite number >= 0."""
    k = check_scoring_passes(scoring_passes)
    step = plan.predicted_iteration_s
    if step is None:
        step = predict(plan, cluster).iteration_s
    return step + (k * forward_pass_s(plan, cluster) if k else 0.0)


def _optimize_one(cluster: ClusterProfile, global_batch_size: int, memory_fraction: float,
                  allow_idle: bool, root_resident: bool, checkpointing: bool,
                  fallback_error: bool, scoring_passes: float = 0.0):
    """``optimize`` for one activation-checkpointing setting; with ``fallback_error`` an
    ``InfeasiblePlanError`` is returned instead of raised (the other setting may fit)."""
    try:
        a = solve_assignment(cluster, global_batch_size, memory_fraction, allow_idle=allow_idle,
                             root_resident=root_resident, activation_checkpointing=checkpointing,
                             scoring_passes=scoring_passes)
    except InfeasiblePlanError as e:
        if fallback_error:
            return e
        raise
    devs = cluster.devices
    N = cluster.world_size
    mem = [float(memory.rank_memory_bytes(cluster, i, m, b, root_resident=root_resident,
                                          activation_checkpointing=checkpointing))
           for i, (m, b) in enumerate(zip(a.microbatch_sizes, a.batch_sizes))]
    uneven = cost.is_uneven(cluster, mem, memory_fraction)
    if uneven:
        ratios = _partition_on_layout(cluster, a, mem, root_resident, checkpointing)
    else:
        ratios = [1.0 / N] * N
    # precision per rank (docs/engine.md "Precision per rank"): each device profile was
    # made at its rank's precision, the plan records which
    rank_precisions = cluster.extra.get("rank_precisions") or [None] * N
    ranks = [RankPlan(rank=i, device=d.name, batch_size=a.batch_sizes[i],
                      microbatch_size=a.microbatch_sizes[i],
                      num_microbatches=a.num_microbatches[i], state_ratio=ratios[i],
                      memory_capacity_bytes=d.memory_capacity_bytes,
                      precision=rank_precisions[i])
             for i, d in enumerate(devs)]
    model = cluster.model
    plan = Plan(global_batch_size=global_batch_size, memory_fraction=memory_fraction,
                uneven_state=uneven, ranks=ranks, root_resident=root_resident,
                activation_checkpointing=checkpointing,
                precision=cluster.extra.get("dtype"),  # [Note: precision tags]
                model={"name": model.name, "num_units": model.num_units,
                       "params_per_unit": model.params_per_unit,
                       "params_other": model.params_other})
    pred = predict(plan, cluster)
    for r, p in zip(plan.ranks, pred.ranks):
        r.predicted_memory_bytes = p.memory_bytes  # priced with the plan's own shard layout
    plan.predicted_iteration_s = pred.iteration_s
    return plan


def optimize_fixed_state(cluster: ClusterProfile, plan: Plan, *,
                         frozen_ranks: Sequence[int] = (), allow_idle: bool = True) -> Plan:
    """The optimal (b_i, m_i, l_i) for ``plan``'s own state ratios r_i and shard layout.

    The re-plan of a live switch that moves no state (docs/design.md contract 7): the same
    threshold search as ``optimize`` with rank i's memory cap c·C_i − r_i·S (the state it holds
    now) priced with the engine's current shard layout, the collectives priced as ``plan``
    (uneven or not), the same B and memory fraction c. Ranks in ``frozen_ranks`` keep their
    (b_i, m_i, l_i). The result keeps r_i, ``uneven_state``, ``root_resident``,
    ``activation_checkpointing`` (priced as ``plan`` runs) and the precision tag of ``plan``;
    ``predicted_*`` come from ``predict`` on ``cluster``.

    Raises:
        InfeasiblePlanError: no (b_i, m_i, l_i) fits the caps with this state layout.
        ValueError: ``plan`` does not fit ``cluster`` (world size, model).
    """
    from hf_cephalo.planner.predict import plan_layout

    plan.validate_for(cluster.world_size, cluster.model)
    layout = None if cluster.buffers_in_compute_memory else plan_layout(plan, cluster)
    frozen = {i: (plan.ranks[i].batch_size, plan.ranks[i].microbatch_size,
                  plan.ranks[i].num_microbatches) for i in frozen_ranks}
    fixed = FixedState(list(plan.state_ratios), plan.uneven_state, layout, frozen)
    case = Case(cluster, fixed_state_groups(cluster, fixed), plan.global_batch_size,
                plan.memory_fraction, plan.uneven_state, allow_idle, plan.root_resident,
                fixed=fixed, checkpointing=plan.activation_checkpointing)
    t = case.solve(np.inf)
    if t is None:
        raise InfeasiblePlanError(
            f"no (b_i, m_i, l_i) for global batch size {plan.global_batch_size} fits the memory "
            f"caps with the current state ratios {[round(r, 4) for r in plan.state_ratios]}",
            "state")
    a = case.reconstruct(t, cluster.world_size)
    ranks = [dataclasses.replace(r, batch_size=a.batch_sizes[i],
                                 microbatch_size=a.microbatch_sizes[i],
                                 num_microbatches=a.num_microbatches[i])
             for i, r in enumerate(plan.ranks)]
    new = dataclasses.replace(plan, ranks=ranks)
    pred = predict(new, cluster)
    for r, p in zip(new.ranks, pred.ranks):
        r.predicted_memory_bytes = p.memory_bytes
    new.predicted_iteration_s = pred.iteration_s
    return new
