"""Live re-balancing of (b_i, m_i, l_i): refit the profile to what was measured, re-plan with the
state fixed, decide whether to switch (docs/design.md contract 7; docs/adaptive.md).

Pure (no torch, no process group): every rank calls ``decide_batch_switch`` with the SAME
exchanged measurements and gets the same decision, so a switch needs no plan broadcast and no
rank can be left waiting in a collective the others skipped ([Note: one decision on every rank]
in ``runtime/adaptive.py``).

The refit is the issue's rule: each rank's device profile has its forward and backward times
F_i(m), B_i(m) multiplied by s_i = measured / predicted unit compute per step at its current
(b_i, m_i), where predicted = num_units · (l·F(m) + l·(F(m) + B(m))) of the START profile
(forward, then recompute + backward; ``cost.rank_compute_s``). The refit always starts from the
start profile, so it does not drift with repeated switches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize_fixed_state
from hf_cephalo.planner.predict import predict, predicted_unit_compute_s
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["MEASUREMENT_FIELDS", "Measurement", "SwitchDecision", "StateDecision",
           "predicted_unit_compute_s", "refit_cluster", "split_key", "decide_batch_switch",
           "decide_state_switch", "DEFAULT_THRESHOLD", "DEFAULT_HYSTERESIS_STEPS",
           "DEFAULT_CONFIRMATIONS"]

DEFAULT_THRESHOLD = 0.05  # switch only when the predicted step time drops by more than this
DEFAULT_HYSTERESIS_STEPS = 20  # at most one switch per this many steps
DEFAULT_CONFIRMATIONS = 2  # consecutive exchanges that must each predict a gain above threshold

MEASUREMENT_FIELDS = ("steps", "unit_compute_s", "step_s", "wait_s", "batch_size")
"""The floats one rank contributes to the exchange, in this order (``Measurement``)."""


class Measurement(NamedTuple):
    """One rank's robust estimate over the steps since the last exchange (medians).

    Attributes:
        steps: steps measured (0: none).
        unit_compute_s: forward + recompute + backward of all units per step, seconds.
        step_s: wall time of one training step, seconds.
        wait_s: step_s minus all timed compute (embedding, units, head): collectives not hidden
            behind compute, waiting for slower ranks, the optimizer step, data; seconds.
        batch_size: the b_i the steps ran with (samples); must be the plan's.
    """

    steps: float
    unit_compute_s: float
    step_s: float
    wait_s: float
    batch_size: float


class SwitchDecision(NamedTuple):
    """What every rank does at the next step boundary.

    Attributes:
        switch: take ``plan`` from the next step on.
        plan: the new plan if ``switch``, else the running one.
        reason: one line: why (not).
        predicted_before_s / predicted_after_s: the iteration time of the running / the
            re-made plan on the refit profile, seconds (None when not computed).
        scales: s_i per rank, measured / profiled unit compute (1.0 where unknown).
        invalid_ranks: ranks whose measurements were missing or not finite (kept at their
            current (b_i, m_i, l_i)), with the reason per rank in ``invalid_reasons``.
        invalid_reasons: one text per invalid rank.
        streak: consecutive exchanges, this one included, whose re-made plan beat the running
            one by more than the threshold (0 after a switch or when it did not).
    """

    switch: bool
    plan: Plan
    reason: str
    predicted_before_s: float | None
    predicted_after_s: float | None
    scales: list[float]
    invalid_ranks: list[int]
    invalid_reasons: list[str]
    streak: int = 0


# [Note: no flapping between measured plans]
# The refit scales each rank's whole F(m), B(m) curve by what it measured at ONE microbatch size.
# Where the profile's curve has the wrong shape (a profile taken under other load), the scale
# read at plan A's m predicts plan B faster, and the scale read at B's m predicts A faster: the
# plan flaps (seen on the main job: [6, 10] -> [4, 12] -> [6, 10] -> ...). Plans already run
# have a measured step time, which beats any prediction: a switch back to one of them needs its
# measurement to beat the running plan's.


def split_key(plan: Plan) -> str:
    """The (b_i, m_i) split of ``plan`` as a string key (rank order)."""
    return ";".join(f"{r.batch_size}x{r.microbatch_size}" for r in plan.ranks)


def refit_cluster(cluster: ClusterProfile, scales: Sequence[float]) -> ClusterProfile:
    """``cluster`` with device i's compute tables multiplied by ``scales[i]`` (> 0).

    The tables are the units' ``fwd_s`` / ``bwd_s`` and, where profiled, the root's
    ``embed_s`` / ``head_s``: s_i is read from the units' compute alone (the only compute the
    exchange times), and a device that runs its units s_i times slower (throttled, shared) runs
    its embedding and head slower alike, as the emulated slowdown does (profiler/emulate.py).
    ``planner.predict.refit_to_measured`` (the write-back after a run) scales the root tables
    by their own measured factor instead, which the live exchange does not carry.

    Raises:
        ValueError: a scale that is not finite and positive, or not one per rank.
    """
    if len(scales) != cluster.world_size:
        raise ValueError(f"{len(scales)} scales for {cluster.world_size} ranks")
    devices = []
    for i, (d, s) in enumerate(zip(cluster.devices, scales)):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"scale of rank {i} is {s!r}: need a finite factor > 0")
        if s != 1.0:
            d = dataclasses.replace(
                d, fwd_s=[x * s for x in d.fwd_s], bwd_s=[x * s for x in d.bwd_s],
                embed_s=None if d.embed_s is None else [x * s for x in d.embed_s],
                head_s=None if d.head_s is None else [x * s for x in d.head_s])
        devices.append(d)
    return dataclasses.replace(cluster, devices=devices)


def _check_row(row: Sequence[float], rank: int, plan: Plan) -> str | None:
    """Why ``row`` cannot be used (None: usable)."""
    if len(row) != len(MEASUREMENT_FIELDS):
        return f"{len(row)} numbers, expected {len(MEASUREMENT_FIELDS)}"
    m = Measurement(*(float(x) for x in row))
    if not all(math.isfinite(x) for x in m):
        return "a non-finite timing (" + ", ".join(
            f"{k}={v}" for k, v in m._asdict().items() if not math.isfinite(v)) + ")"
    if m.steps < 1:
        return "no steps measured"
    if int(m.batch_size) != plan.ranks[rank].batch_size:
        return f"measured at b_i = {int(m.batch_size)}, the plan has {plan.ranks[rank].batch_size}"
    if m.unit_compute_s < 0 or m.step_s <= 0:
        return f"impossible timings (unit compute {m.unit_compute_s} s, step {m.step_s} s)"
    if plan.ranks[rank].batch_size > 0 and m.unit_compute_s == 0:
        return "no unit compute timed (the compute timer is off on this rank)"
    return None


def decide_batch_switch(cluster: ClusterProfile, plan: Plan, rows: Sequence[Sequence[float]], *,
                        step: int, last_switch_step: int | None,
                        threshold: float = DEFAULT_THRESHOLD,
                        hysteresis_steps: int = DEFAULT_HYSTERESIS_STEPS,
                        previous_scales: Sequence[float] | None = None,
                        caps_bytes: Sequence[float | None] | None = None,
                        streak: int = 0,
                        confirmations: int = DEFAULT_CONFIRMATIONS,
                        measured_step_s: Mapping[str, float] | None = None) -> SwitchDecision:
    """Whether to switch the running ``plan`` to a re-balanced (b_i, m_i, l_i), and to what.

    A pure function of its arguments (every rank passes the same exchanged ``rows`` and gets
    the same answer). Steps: refit the START profile ``cluster`` to the measurements
    (``refit_cluster``); re-plan with r_i fixed (``optimize.optimize_fixed_state``; ranks
    with unusable measurements keep their (b_i, m_i, l_i) and their previous scale); switch iff
    the re-made plan fits every memory cap (the model's c·C_i and the emulated ``caps_bytes``),
    differs from the running one, at least ``hysteresis_steps`` steps passed since
    ``last_switch_step``, and its predicted iteration time is below (1 - ``threshold``) times
    the running plan's on the same refit profile at ``confirmations`` consecutive exchanges
    (``streak`` counts the ones before this; one noisy window does not move the plan, and the
    switch uses the latest measurements).

    Args:
        cluster: the profile the job started from (rank order).
        plan: the running plan.
        rows: per rank, the ``MEASUREMENT_FIELDS`` floats it measured (NaN: missing).
        step: the global step just finished.
        last_switch_step: the step after which the last switch happened (None: never).
        threshold: relative gain needed, in (0, 1).
        hysteresis_steps: steps between switches (>= 0).
        previous_scales: the last decision's scales (kept for ranks without a usable row).
        caps_bytes: emulated memory capacity per rank in bytes, or None.
        streak: the previous decision's ``streak``.
        confirmations: exchanges in a row that must predict the gain (>= 1).
        measured_step_s: ``split_key`` of each plan this run already ran -> its measured step
            time (seconds, the slowest rank's median). A plan that ran before is switched back
            to only if it MEASURED faster than the running plan by more than ``threshold``
            ([Note: no flapping between measured plans]).

    Raises:
        ValueError: ``rows`` has not one row per rank.
    """
    n = cluster.world_size
    if len(rows) != n:
        raise ValueError(f"{len(rows)} measurement rows for {n} ranks")
    scales = list(previous_scales) if previous_scales is not None else [1.0] * n
    invalid, reasons = [], []
    for i, row in enumerate(rows):
        why = _check_row(row, i, plan)
        if why is not None:
            invalid.append(i)
            reasons.append(why)
            continue
        predicted = predicted_unit_compute_s(plan, cluster, i)
        if plan.ranks[i].batch_size > 0 and predicted > 0:
            scales[i] = float(row[1]) / predicted

    def keep(reason: str, before=None, after=None) -> SwitchDecision:
        return SwitchDecision(False, plan, reason, before, after, scales, invalid, reasons)

    if len(invalid) == n:
        return keep("no rank has usable measurements")
    fit = refit_cluster(cluster, scales)
    before = predict(plan, fit).iteration_s
    if last_switch_step is not None and step - last_switch_step < hysteresis_steps:
        return keep(f"last switch {step - last_switch_step} steps ago (hysteresis "
                    f"{hysteresis_steps})", before)
    try:
        new = optimize_fixed_state(fit, plan, frozen_ranks=invalid)
    except InfeasiblePlanError as exc:
        return keep(f"no re-balanced plan fits: {exc}", before)
    after = new.predicted_iteration_s
    pred = predict(new, fit)
    over = [i for i, (p, cap) in enumerate(zip(pred.ranks, caps_bytes or [None] * n))
            if not p.fits or (cap is not None and p.memory_bytes > cap)]
    if over:
        return keep(f"the re-balanced plan would exceed the memory cap of rank(s) {over}",
                    before, after)
    split = [(r.batch_size, r.microbatch_size) for r in new.ranks]
    if split == [(r.batch_size, r.microbatch_size) for r in plan.ranks]:
        return keep("the running plan is still the best", before, after)
    if not after < (1.0 - threshold) * before:
        return keep(f"predicted gain {100 * (1 - after / before):.1f}% is not above the "
                    f"threshold {100 * threshold:.1f}%", before, after)
    ran = (measured_step_s or {}).get(split_key(new))
    now = (measured_step_s or {}).get(split_key(plan))
    if ran is not None and now is not None and not ran < (1.0 - threshold) * now:
        return keep(f"that split ran before at {ran:.4f} s per step (measured), not faster than "
                    f"the running {now:.4f} s by more than {100 * threshold:.1f}%", before, after)
    if streak + 1 < confirmations:
        return SwitchDecision(False, plan, f"predicted gain {100 * (1 - after / before):.1f}% "
                              f"seen at {streak + 1} of {confirmations} exchanges in a row",
                              before, after, scales, invalid, reasons, streak + 1)
    return SwitchDecision(True, new, f"predicted {before:.4f} s -> {after:.4f} s per step",
                          before, after, scales, invalid, reasons)


class StateDecision(NamedTuple):
    """The ``--cephalo_adaptive state`` decision: re-lay r_i in memory, or the batch decision.

    Attributes:
        relayout: move state to ``plan``'s r_i (and its b_i, m_i, l_i) at the next boundary.
        plan: the plan with r_i free if ``relayout``; else ``batch.plan``.
        reason: one line: why (not).
        batch: the batch-only decision (r_i fixed) the state decision was weighed against.
        predicted_fixed_s: iteration time of the best plan with r_i fixed on the refit profile
            (None: no such plan fits the caps), seconds.
        predicted_free_s: iteration time of the plan with r_i free (None: none fits), seconds.
    """

    relayout: bool
    plan: Plan
    reason: str
    batch: SwitchDecision
    predicted_fixed_s: float | None
    predicted_free_s: float | None


def decide_state_switch(cluster: ClusterProfile, plan: Plan, rows: Sequence[Sequence[float]], *,
                        step: int, last_switch_step: int | None,
                        threshold: float = DEFAULT_THRESHOLD,
                        hysteresis_steps: int = DEFAULT_HYSTERESIS_STEPS,
                        previous_scales: Sequence[float] | None = None,
                        caps_bytes: Sequence[float | None] | None = None,
                        streak: int = 0,
                        confirmations: int = DEFAULT_CONFIRMATIONS,
                        measured_step_s: Mapping[str, float] | None = None) -> StateDecision:
    """Whether to re-lay the training state (r_i) in memory, pure like ``decide_batch_switch``.

    First the batch decision (r_i fixed, ``decide_batch_switch``: the cheap switch). Then the
    plan with r_i free: ``optimize`` on the same refit profile (exact b_i, m_i, l_i and the greedy
    state partition, ``state.partition_state``). It is taken instead when every rank's
    measurements are usable, no switch happened in the last ``hysteresis_steps`` steps, it fits
    every cap (the model's and ``caps_bytes``), its r_i differ from the running ones, it beats
    the running plan by more than ``threshold`` at ``confirmations`` exchanges in a row
    (``streak`` as in ``decide_batch_switch``), and either no plan with r_i fixed fits the caps
    any more, or it beats the best plan with r_i fixed by more than ``threshold`` (moving state
    costs collectives; the gain must be worth it).
    """
    from hf_cephalo.planner.optimize import optimize

    batch = decide_batch_switch(cluster, plan, rows, step=step, last_switch_step=last_switch_step,
                                threshold=threshold, hysteresis_steps=hysteresis_steps,
                                previous_scales=previous_scales, caps_bytes=caps_bytes,
                                streak=streak, confirmations=confirmations,
                                measured_step_s=measured_step_s)

    def keep(reason: str, fixed=None, free=None) -> StateDecision:
        return StateDecision(False, batch.plan, f"{batch.reason}; state: {reason}", batch,
                             fixed, free)

    if batch.invalid_ranks:
        return keep("not re-laid while a rank's measurements are unusable")
    if last_switch_step is not None and step - last_switch_step < hysteresis_steps:
        return keep("hysteresis")
    fit = refit_cluster(cluster, batch.scales)
    before = predict(plan, fit).iteration_s
    try:
        fixed_s = optimize_fixed_state(fit, plan).predicted_iteration_s
    except InfeasiblePlanError:
        fixed_s = None
    try:
        free = optimize(fit, plan.global_batch_size, plan.memory_fraction,
                        root_resident=plan.root_resident,
                        activation_checkpointing=plan.activation_checkpointing)
    except InfeasiblePlanError as exc:
        return keep(f"no plan with r_i free fits: {exc}", fixed_s)
    free_s = free.predicted_iteration_s
    pred = predict(free, fit)
    n = cluster.world_size
    if not all(p.fits and (cap is None or p.memory_bytes <= cap)
               for p, cap in zip(pred.ranks, caps_bytes or [None] * n)):
        return keep("the plan with r_i free would exceed a memory cap", fixed_s, free_s)
    if all(abs(a - b) <= 1e-12 for a, b in zip(free.state_ratios, plan.state_ratios)):
        return keep("the greedy r_i are the running ones", fixed_s, free_s)
    if not free_s < (1.0 - threshold) * before:
        return keep(f"r_i free gains {100 * (1 - free_s / before):.1f}% over the running plan, "
                    f"not above {100 * threshold:.1f}%", fixed_s, free_s)
    if fixed_s is not None and not free_s < (1.0 - threshold) * fixed_s:
        return keep(f"r_i free ({free_s:.4f} s) is not better than r_i fixed ({fixed_s:.4f} s) "
                    f"by more than {100 * threshold:.1f}%", fixed_s, free_s)
    if streak + 1 < confirmations:  # the caller keeps ``batch.streak`` for the next exchange
        return StateDecision(False, plan, f"r_i free gain seen at {streak + 1} of "
                             f"{confirmations} exchanges in a row",
                             batch._replace(switch=False, plan=plan, streak=streak + 1),
                             fixed_s, free_s)
    why = "no plan with r_i fixed fits the caps" if fixed_s is None else \
        f"r_i fixed {fixed_s:.4f} s"
    return StateDecision(True, free, f"re-lay r_i: predicted {before:.4f} s -> {free_s:.4f} s "
                         f"per step ({why})", batch, fixed_s, free_s)
