"""The one step timer and the predicted-vs-measured report (the paper's model-accuracy check, §4).

``StepTimer`` times every optimizer step of a run on this rank: the wall seconds, and the compute
the ``EmulatedStagedModel`` timer saw (all of it, and the units' forward + recompute + backward).
The adaptive controller (``adaptive.py``) and the accuracy report read the same ``StepTime``
records, so both see the same steps.

``AccuracyReport`` warns after the first steps when the measured step time is slower than the
prediction by more than 15% (naming the term of the cost model that is off), and prints, at the end of
training, each rank's predicted vs measured unit compute time per step, step time and memory.
After a live switch it compares the figures measured since the switch with the prediction of
the plan in force from the refit profile, and says so.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hf_cephalo.planner import Plan, memory, predict
from hf_cephalo.planner.types import activation_checkpointing_mode
from hf_cephalo.planner.predict import (MeasuredStep, measured_speeds, predicted_unit_compute_s,
                                        refit_to_measured)
from hf_cephalo.profiler.emulate import find_emulated
from hf_cephalo.profiles.cache import write_back_measured
from hf_cephalo.units import GIB

__all__ = ["StepTime", "StepTimer", "AccuracyReport", "format_accuracy_table", "format_plan_table",
           "format_scoring_line", "diagnose_step_time", "STEP_TIME_TOLERANCE"]

logger = logging.getLogger(__name__)


class StepTime(NamedTuple):
    """One optimizer step on this rank: wall seconds, the units' compute seconds and all compute
    seconds (NaN where the adapter is not timed: CUDA without emulation), the samples the rank
    processed and whether that was its full b_i (not a partial last global batch)."""

    step_s: float
    unit_s: float
    compute_s: float
    num_samples: int | None
    full: bool


class StepTimer:
    """Times optimizer steps (``begin`` / ``end``); ``steps`` keeps every ``StepTime``.

    Args:
        staged: the engine's adapter; its ``EmulatedStagedModel`` (if any) times the compute.
    """

    def __init__(self, staged) -> None:
        emulated = find_emulated(staged)
        self._compute = None if emulated is None else emulated.timer
        self.steps: list[StepTime] = []
        self._t0: float | None = None
        self._c0: tuple[float, float] | None = None

    def begin(self) -> None:
        self._t0 = time.perf_counter()
        self._c0 = None if self._compute is None else (self._compute.unit_s,
                                                       self._compute.compute_s)

    def end(self, num_samples: int | None, batch_size: int) -> StepTime:
        """Close the step begun last; ``num_samples`` this rank processed (None: unknown),
        ``batch_size`` its b_i in force."""
        assert self._t0 is not None, "StepTimer.end without begin"
        step_s = time.perf_counter() - self._t0
        unit = compute = math.nan
        if self._compute is not None and self._c0 is not None:
            unit = self._compute.unit_s - self._c0[0]
            compute = self._compute.compute_s - self._c0[1]
        record = StepTime(step_s, unit, compute, num_samples,
                          num_samples is None or num_samples == batch_size)
        self.steps.append(record)
        self._t0 = None
        return record


# ---- the plan -----------------------------------------------------------------------------
def format_plan_table(plan: Plan, checkpointing_reason: str = "", batch_origin: str = "") -> str:
    """The plan as a text table: one row per rank (batch, microbatch, microbatches, state %);
    the header says the global batch size (with ``batch_origin``, how the front end derived
    it, in parentheses), whether the state is uneven, the activation
    checkpointing mode (``on``: recompute in backward; ``off``: forward graphs kept; with
    ``checkpointing_reason``, why ``--cephalo_activation_checkpointing auto`` chose it, as
    ``[auto: ...]``) and the predicted iteration time."""
    # full device names: emulated ones differ only after the base name ("cpu [emulated 2x ...]")
    width = max([12] + [len(r.device) for r in plan.ranks])
    mode = activation_checkpointing_mode(plan.activation_checkpointing, checkpointing_reason)
    origin = f" ({batch_origin})" if batch_origin else ""
    rows = [f"Cephalo plan: global batch size {plan.global_batch_size}{origin}, uneven state "
            f"{plan.uneven_state}, activation checkpointing {mode}, predicted iteration "
            f"{'-' if plan.predicted_iteration_s is None else f'{plan.predicted_iteration_s:.3f} s'}",
            f"{'rank':>4} {'device':<{width}} {'b_i':>5} {'m_i':>5} {'l_i':>5} {'r_i %':>7}"]
    per_rank = plan.rank_precisions is not None  # precision per rank: one more column
    if per_rank:
        rows[-1] += "  precision"
    for r in plan.ranks:
        rows.append(f"{r.rank:>4} {r.device:<{width}} {r.batch_size:>5} {r.microbatch_size:>5} "
                    f"{r.num_microbatches:>5} {100 * r.state_ratio:>7.2f}"
                    + (f"  {r.precision}" if per_rank else ""))
    return "\n".join(rows)


def format_scoring_line(plan: Plan, cluster, scoring_passes: float) -> str:
    """The line under the plan of a door with forward-only scoring passes (GRPO / RLOO:
    ``Job.scoring_passes`` k per step): the predicted training step, one pass
    (``planner.generation.forward_pass_s``) and training + k passes, seconds — what the start
    plan minimizes (``planner.optimize(..., scoring_passes=k)``). The plan's "predicted
    iteration" above stays the training step's."""
    from hf_cephalo.planner.generation import forward_pass_s
    from hf_cephalo.planner.optimize import scored_step_s

    training = scored_step_s(plan, cluster)  # k = 0: the predicted training step
    one = forward_pass_s(plan, cluster)
    return (f"RL step as planned: training {training:.3f} s + {scoring_passes:g} forward-only "
            f"scoring pass(es) per step (old policy / reference log-probabilities) x "
            f"{one:.3f} s = {training + scoring_passes * one:.3f} s predicted; generation is "
            "planned apart")


# ---- predicted vs measured --------------------------------------------------------------------
def format_accuracy_table(rows: list[dict[str, Any]], predicted_iteration_s: float | None,
                          switched_at: int | None = None) -> str:
    """Text table of ``AccuracyReport`` rows (one per rank); ``switched_at``: the step of the
    last live switch (the figures are then those since it, the predictions the refit
    profile's for the plan in force)."""
    head = (f"{'rank':>4} {'b_i':>4} {'m_i':>4} {'unit compute s/step pred':>25} {'measured':>9} "
            f"{'step s pred':>12} {'measured':>9} {'memory GiB pred':>16} {'measured':>9}")
    since = "" if switched_at is None else (
        f"; the plan changed live after step {switched_at}: figures of the steps since then, "
        "predicted by the refit profile for the plan in force")
    lines = ["Cephalo cost model accuracy (predicted vs measured, median over steps after the "
             f"first{since})",
             head]
    for r in rows:
        def fmt(v, scale=1.0, width=9):
            return f"{'-':>{width}}" if v is None else f"{v / scale:>{width}.4f}"
        lines.append(f"{r['rank']:>4} {r['b']:>4} {r['m']:>4} "
                     f"{fmt(r['pred_compute_s'], width=25)} {fmt(r['compute_s'])} "
                     f"{fmt(predicted_iteration_s, width=12)} {fmt(r['step_s'])} "
                     f"{fmt(r['pred_memory_bytes'], GIB, 16)} {fmt(r['memory_bytes'], GIB)}")
    lines.append("unit compute: forward + recompute (with activation checkpointing) + backward "
                 "of all units on this rank; "
                 "memory on CPU is accounted (state tensors + the memory model's buffers and "
                 "profiled activations), on CUDA the allocator peak")
    return "\n".join(lines)


STEP_TIME_TOLERANCE = 0.15  # relative gap between predicted and measured step time that warns


def diagnose_step_time(rows: list[dict[str, Any]], predicted_iteration_s: float | None,
                       tolerance: float = STEP_TIME_TOLERANCE) -> str | None:
    """A warning when the measured step time is SLOWER than the prediction by more than
    ``tolerance`` (relative), naming the term of the cost model that is off most; None when
    within it or faster (nobody waits longer than planned; the end-of-run accuracy table still
    shows the gap).

    Measured step = the slowest rank's median step seconds (``rows[i]["step_s"]``, steps after
    the first). Terms: compute = the measured vs predicted unit compute (forward + recompute +
    backward, seconds per step) of the rank with the most measured compute; the rest of the
    step (measured step - that compute vs predicted iteration - predicted compute) is the
    collectives (all-gather / reduce-scatter not hidden behind compute), the embedding and head,
    and waiting for slower ranks. Without compute timings (CUDA without emulation) the term is
    not named.
    """
    steps = [r["step_s"] for r in rows if r.get("step_s")]
    if not predicted_iteration_s or not steps:
        return None
    measured = max(steps)
    gap = measured / predicted_iteration_s - 1.0
    if gap <= tolerance:  # within, or faster than predicted
        return None
    head = (f"measured step time {measured:.3f} s (slowest rank, median after the first step) "
            f"is {measured / predicted_iteration_s:.2f}x the predicted {predicted_iteration_s:.3f} s")
    timed = [r for r in rows if r.get("compute_s") is not None
             and r.get("pred_compute_s") is not None and r.get("b")]
    if not timed:
        return head + "; no compute timings on this device to tell which term is off"
    slow = max(timed, key=lambda r: r["compute_s"])
    compute_gap = slow["compute_s"] - slow["pred_compute_s"]
    rest_measured = measured - slow["compute_s"]
    rest_predicted = predicted_iteration_s - slow["pred_compute_s"]
    if abs(compute_gap) >= abs(rest_measured - rest_predicted):
        term = (f"compute: rank {slow['rank']}'s unit forward/backward took "
                f"{slow['compute_s']:.3f} s per step, predicted {slow['pred_compute_s']:.3f} s "
                "(re-profile under the same load and sequence length)")
    else:
        term = (f"collectives and waiting: the step outside unit compute took "
                f"{rest_measured:.3f} s, predicted {max(rest_predicted, 0.0):.3f} s (embedding "
                "and head compute, optimizer step, the root's collectives and all-reduces, "
                "all-gather / reduce-scatter not hidden behind compute, ranks waiting for each "
                "other: planner/cost.py [Note: step terms]; a profile without these terms "
                "prices them at 0: re-profile with this version, and the next run starts from "
                "what this one measured, written back to the profile cache at train end)")
    return f"{head}; the term off most is {term}"


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite and len(finite) == len(values) else None


class AccuracyReport:
    """Predicted vs measured per rank, from the session's ``StepTimer`` (see the module note).

    Collective (one ``all_gather_object`` each, on every rank at the same step): after
    ``CHECK_AFTER_STEPS`` steps past the first one (the first step pays one-time costs and is
    not counted), rank 0 logs ``diagnose_step_time``'s warning when the step time is slower by
    more than 15%, so a long job learns early that its plan rests on a wrong model; it is skipped when
    that step is the last one (the train-end check covers it). At ``train_end`` the table and
    the same check over the steps on the plan in force, whose warning is logged only when the
    early one was not. Results are kept in ``self.early_rows`` and ``self.rows`` (rank order,
    same on every rank).

    Args:
        session: the runtime ``Session`` (its ``job``, ``plan``, ``cluster_profile``,
            ``live_cluster``, ``engine``, ``optimizer``, ``timer`` and ``last_switch_step``).
    """

    CHECK_AFTER_STEPS = 5
    """Steps after the first one before the early step-time check (median of these steps)."""

    def __init__(self, session) -> None:
        self.session = session
        self.written_back: list[str] = []  # profile cache entries refit at train end (rank 0)
        self.rows: list[dict[str, Any]] = []
        self.early_rows: list[dict[str, Any]] = []
        self.early_warning: str | None = None
        self._first = 0  # index into timer.steps of this training run's first step
        self._segment = 0  # ... of the first step on the plan in force

    def train_begin(self) -> None:
        self.early_rows, self.early_warning = [], None
        self._first = self._segment = len(self.session.timer.steps)
        if self.session.job.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.session.job.device)

    def plan_switched(self) -> None:
        """A live switch: the figures from the next step on belong to the new plan."""
        self._segment = len(self.session.timer.steps)

    def step_end(self, is_last_step: bool) -> None:
        if len(self.session.timer.steps) - self._first == self.CHECK_AFTER_STEPS + 1 \
                and not is_last_step:
            self.early_rows = self._gather(self._first)
            if self.session.job.is_main:
                self.early_warning = diagnose_step_time(
                    self.early_rows, self._predicted_iteration_s())
                if self.early_warning:
                    logger.warning("after %d steps: %s", self.CHECK_AFTER_STEPS + 1,
                                   self.early_warning)

    def _cluster(self):
        """The profile whose predictions the figures are compared with: the refit one after a
        live switch, else the start profile."""
        return self.session.live_cluster or self.session.cluster_profile

    def _predicted_iteration_s(self) -> float | None:
        plan, cluster = self.session.plan, self._cluster()
        if cluster is not None and self.session.live_cluster is not None:
            return predict(plan, cluster).iteration_s
        return plan.predicted_iteration_s

    def _measured_memory_bytes(self) -> float | None:
        session = self.session
        device = session.job.device
        if device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(device))
        cluster, plan = self._cluster(), session.plan
        # Accounted: each shard's parameter and gradient, plus the optimizer's state tensors.
        state = 0
        optimizer = session.optimizer
        for p in session.engine.parameters():
            state += 2 * p.numel() * p.element_size()
        if optimizer is not None:
            state += sum(v.numel() * v.element_size() for s in optimizer.state.values()
                         for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        if cluster is None:
            return float(state)
        rank = session.job.rank
        r = plan.ranks[rank]
        compute = float(memory.rank_memory_bytes(
            cluster, rank, r.microbatch_size, r.batch_size, root_resident=plan.root_resident,
            activation_checkpointing=plan.activation_checkpointing))
        return state + compute

    def _gather(self, start: int) -> list[dict[str, Any]]:
        """Every rank's row (collective): medians over the steps from ``start`` on, the first
        of them left out."""
        session = self.session
        plan, cluster, rank = session.plan, self._cluster(), session.job.rank
        steps = session.timer.steps[start:]
        steps = steps[1:] or steps
        pred = predict(plan, cluster).ranks[rank] if cluster is not None else None
        row = dict(rank=rank, b=plan.ranks[rank].batch_size, m=plan.ranks[rank].microbatch_size,
                   step_s=_median([s.step_s for s in steps]) if steps else None,
                   compute_s=_median([s.unit_s for s in steps]) if steps else None,
                   root_s=_median([s.compute_s - s.unit_s for s in steps]) if steps else None,
                   pred_compute_s=None if cluster is None else
                   predicted_unit_compute_s(plan, cluster, rank),
                   pred_memory_bytes=None if pred is None else pred.memory_bytes,
                   memory_bytes=self._measured_memory_bytes())
        world = session.job.world_size
        if world == 1:
            return [row]
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row, group=session.engine.group)
        return rows

    def train_end(self) -> None:
        session = self.session
        self.rows = self._gather(self._segment)
        if session.job.is_main:
            predicted = self._predicted_iteration_s()
            switched = session.last_switch_step if self._segment > self._first else None
            print(format_accuracy_table(self.rows, predicted, switched), flush=True)
            warning = diagnose_step_time(self.rows, predicted)
            if warning and not self.early_warning:  # said once; the table shows the numbers
                logger.warning(warning)
        self._write_back()

    def _write_back(self) -> None:
        """The start profile refit to this run's measurements on the plan in force
        (``refit_to_measured``), written by rank 0 over the profile cache entries it came from,
        so the next run plans from them; nothing for a plan or profile file, or a run too short
        to time a step after the first. Collective (a barrier after the write: a front end made
        next in the same processes reads the new entries on every rank)."""
        session = self.session
        cluster, plan = session.cluster_profile, session.plan
        if cluster is None or len(session.timer.steps) - self._segment < 2 \
                or "profile_cache" not in cluster.extra \
                or session.job.settings.profile_file is not None:  # a file records its cache too
            return
        if session.job.is_main:
            measured = [MeasuredStep(r["step_s"], r["compute_s"], r.get("root_s"))
                        for r in self.rows]
            refit = refit_to_measured(plan, cluster, measured)
            # [Note: the cache does not learn load] (profiles/cache.py): a loaded run is kept out
            done = write_back_measured(cluster.extra, refit.devices,
                                       measured_speeds(plan, cluster, measured),
                                       steps=len(session.timer.steps) - self._segment - 1)
            self.written_back = [str(p) for p in done.written]
            logger.info("%s", done.line)
        if session.job.world_size > 1:
            dist.barrier(group=session.engine.group)
