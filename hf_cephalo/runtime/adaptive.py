"""Live re-balancing while training: measure, exchange, decide, switch (docs/adaptive.md).

``AdaptiveController`` (``--cephalo_adaptive batch``, the default, or ``state``), driven by the
runtime's session after every optimizer step, in every front end: every rank times its steps
(the session's ``StepTimer``); every ``cephalo_adaptive_interval`` steps each rank's medians go
into ONE fixed-size float64 all-gather (``MEASUREMENT_FIELDS``); every rank decides from the
exchanged numbers (``planning.replan_live`` -> ``planner.adapt.decide_batch_switch``, or
``decide_state_switch`` in state mode; [Note: a switch must pay against the noise] in
planner/adapt.py); a switch happens at the step boundary (``Session.switch_plan``: the loader's
``SplitSchedule``, [Note: switching the split live] in sampler.py; in state mode after
``Session.relayout_state``). Each step in detail, and the records a switch writes:
docs/adaptive.md, "What happens while training".

[Note: one decision on every rank]
Every rank must take the same switch at the same step, or the next step's collectives would
not match (a hang) and the global batch would be split inconsistently (samples lost or
duplicated). The decision is therefore a pure function (``decide_batch_switch``) of numbers
every rank holds identically: the start profile and plan (same on every rank before training),
the exchanged float64 tensor (an all-gather gives every rank the same bytes), and the step
counters. A rank's own local measurements never enter the decision except through the
exchange; missing or non-finite numbers are part of the exchanged tensor too, so every rank
sees the same NaN and leaves the same rank at its plan.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hf_cephalo.console import print_line
from hf_cephalo.planner import Plan
from hf_cephalo.planner.adapt import MEASUREMENT_FIELDS, SwitchDecision
from hf_cephalo.runtime.report import StepTime

__all__ = ["AdaptiveController", "REPLANS_NAME", "format_switch"]

logger = logging.getLogger(__name__)

REPLANS_NAME = "cephalo_replans.jsonl"  # in output_dir: one record per live switch


def format_switch(step: int, old: Plan, new: Plan, decision: SwitchDecision,
                  old_scales: list[float]) -> str:
    """The one line rank 0 prints for a switch."""
    # scales are unit compute time / the start profile's prediction; old_scales are those of
    # the last switch (1.0 before any): the change is said as one factor, since then
    since = "since the last switch" if any(o != 1.0 for o in old_scales) else "than profiled"
    changed = [f"rank {i} {max(s / o, o / s):.2f}x {'slower' if s > o else 'faster'}"
               for i, (s, o) in enumerate(zip(decision.scales, old_scales))
               if o > 0 and s > 0 and abs(s / o - 1) > 0.10]
    speed = ", ".join(changed) + f" {since}" if changed else "speeds as measured"
    ratios = "r_i unchanged" if new.state_ratios == old.state_ratios else (
        "r_i " + "/".join(f"{r:.3f}" for r in old.state_ratios) + " -> " +
        "/".join(f"{r:.3f}" for r in new.state_ratios))
    return (f"Cephalo re-plan after step {step}: {speed} (unit compute / profile: "
            f"{', '.join(f'{s:.2f}' for s in decision.scales)}); b_i {old.batch_sizes} -> "
            f"{new.batch_sizes}, m_i {old.microbatch_sizes} -> {new.microbatch_sizes}, {ratios}; "
            f"predicted step {decision.predicted_before_s:.4f} s -> "
            f"{decision.predicted_after_s:.4f} s")


class AdaptiveController:
    """Measures every step, exchanges every ``interval`` steps, switches b_i / m_i / l_i live.

    Args:
        session: the runtime ``Session`` (its ``plan``, ``engine``, ``cluster_profile``,
            ``split_schedule``, ``timer`` and ``relayout_state`` are read and used).
        interval: steps between exchanges (>= 1).
        threshold: relative predicted gain a switch needs, in (0, 1).
        hysteresis_steps: steps between switches at least.
        caps_bytes: emulated memory capacity per rank (bytes) or None.
        mode: "batch", or "state": the decision may also re-lay r_i
            (``planner.adapt.decide_state_switch``), done by ``session.relayout_state(plan)``
            (collective, at the step boundary) before the new split applies.

    Attributes:
        decisions: every decision taken, in order, as dicts (same on every rank).
        last_switch_step: the step after which the last switch happened (None: never).
        records: the switch records (also appended to ``output_dir/cephalo_replans.jsonl``).
    """

    def __init__(self, session, *, interval: int, threshold: float, hysteresis_steps: int,
                 caps_bytes: list[float | None] | None = None, mode: str = "batch"):
        self.session, self.mode = session, mode
        self.interval, self.threshold = interval, threshold
        self.hysteresis_steps, self.caps_bytes = hysteresis_steps, caps_bytes
        self.decisions: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.last_switch_step: int | None = None
        self._window: list[StepTime] = []
        self._skip_next = True  # the first step (of the run, after a switch) is not measured
        self._scales: list[float] | None = None
        self._streak = 0  # exchanges in a row that predicted a gain (planner.adapt)
        self._measured_step_s = {}  # the decisions' SwitchHistory (planner.adapt)
        self._switch_scales: list[float] | None = None

    # ---- measure -------------------------------------------------------------------------
    def step_end(self, step: StepTime, global_step: int, epoch: float | None,
                 is_last_step: bool) -> dict[str, Any] | None:
        """After optimizer step ``global_step`` (timed as ``step``): keep the measurement, and
        every ``interval`` steps (not after the last one) exchange and decide. Returns the
        switch record when the plan changed, else None."""
        if self._skip_next or not step.full:  # one-time costs, or a partial last global batch
            self._skip_next = False
        else:
            self._window.append(step)
        if global_step % self.interval == 0 and not is_last_step:
            return self._exchange_and_decide(global_step, epoch)
        return None

    def local_row(self) -> list[float]:
        """This rank's ``MEASUREMENT_FIELDS`` over the window (NaN where nothing was timed)."""
        b = self.session.plan.ranks[self.session.job.rank].batch_size
        if not self._window:
            return [0.0, math.nan, math.nan, math.nan, float(b), math.nan]
        steps = [s.step_s for s in self._window]
        units = [s.unit_s for s in self._window]
        computes = [s.compute_s for s in self._window]
        step = statistics.median(steps)
        unit = statistics.median(units) if all(math.isfinite(u) for u in units) else math.nan
        compute = statistics.median(computes) if all(math.isfinite(c) for c in computes) \
            else math.nan
        # the window's spread: the decision weighs a move against it (planner.adapt.scale_error)
        mad = statistics.median(abs(u - unit) for u in units) if math.isfinite(unit) \
            else math.nan
        return [float(len(steps)), unit, step, step - compute, float(b), mad]

    # ---- exchange + decide ---------------------------------------------------------------
    def _exchange(self, row: list[float]) -> list[list[float]]:
        """[Note: one decision on every rank]: one all-gather of a fixed-size float64 tensor."""
        group = self.session.engine.group
        world = dist.get_world_size(group)
        device = self.session.job.device if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        mine = torch.tensor(row, dtype=torch.float64, device=device)  # (K,)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
        return [t.cpu().tolist() for t in out]

    def _exchange_and_decide(self, global_step: int, epoch: float | None):
        from hf_cephalo.runtime.planning import replan_live

        rows = self._exchange(self.local_row())
        self._window = []
        session = self.session
        # measured_step_s: the last decision's SwitchHistory (each split's fastest measured
        # step, the last window, the last switch's payoff): the decision updates it from rows
        decision = replan_live(session.cluster_profile, session.plan, rows,
                               step=global_step, last_switch_step=self.last_switch_step,
                               threshold=self.threshold, hysteresis_steps=self.hysteresis_steps,
                               previous_scales=self._scales, caps_bytes=self.caps_bytes,
                               streak=self._streak, mode=self.mode,
                               measured_step_s=self._measured_step_s)
        relayout = getattr(decision, "relayout", False)
        if self.mode == "state":  # a StateDecision: its batch part, or the re-layout
            decision = decision.batch if not relayout else decision.batch._replace(
                switch=True, plan=decision.plan, reason=decision.reason,
                predicted_after_s=decision.predicted_free_s, streak=0)
        self._streak = decision.streak
        self._measured_step_s = decision.history
        if decision.notice and session.job.is_main:  # a switch that did not pay
            logger.warning("adaptive re-balancing after step %d: %s", global_step,
                           decision.notice)
        if self._switch_scales is None:
            self._switch_scales = [1.0] * len(decision.scales)
        self._scales = decision.scales
        record = dict(step=global_step, switch=decision.switch, reason=decision.reason,
                      predicted_before_s=decision.predicted_before_s,
                      predicted_after_s=decision.predicted_after_s, scales=decision.scales,
                      invalid_ranks=decision.invalid_ranks,
                      invalid_reasons=decision.invalid_reasons,
                      rows=rows, batch_sizes=decision.plan.batch_sizes,
                      relayout=decision.switch and relayout,
                      state_ratios=decision.plan.state_ratios)
        self.decisions.append(record)
        if decision.invalid_ranks and session.job.is_main:
            logger.warning("adaptive re-balancing after step %d: %s; kept at their current "
                           "b_i / m_i / l_i", global_step, "; ".join(
                               f"rank {i}: {why}" for i, why in
                               zip(decision.invalid_ranks, decision.invalid_reasons)))
        if decision.switch:
            return self._switch(global_step, epoch, decision, rows, relayout)
        return None

    def _switch(self, global_step: int, epoch: float | None, decision: SwitchDecision, rows,
                relayout: bool = False) -> dict[str, Any]:
        session, old, new = self.session, self.session.plan, decision.plan
        session.switch_plan(new, global_step, relayout=relayout, scales=decision.scales)
        self.last_switch_step = global_step
        self._skip_next = True
        line = format_switch(global_step, old, new, decision, self._switch_scales)
        self._switch_scales = list(decision.scales)
        record = dict(step=global_step, epoch=epoch,
                      mode="state" if relayout else "batch",
                      old_batch_sizes=old.batch_sizes, new_batch_sizes=new.batch_sizes,
                      old_microbatch_sizes=old.microbatch_sizes,
                      new_microbatch_sizes=new.microbatch_sizes,
                      old_state_ratios=old.state_ratios, new_state_ratios=new.state_ratios,
                      scales=decision.scales,
                      predicted_before_s=decision.predicted_before_s,
                      predicted_after_s=decision.predicted_after_s, measurements=rows,
                      measurement_fields=list(MEASUREMENT_FIELDS), time_s=time.time())
        self.records.append(record)
        if session.job.is_main:
            print_line(line)
        if session.job.is_main and session.job.output_dir is not None:
            os.makedirs(session.job.output_dir, exist_ok=True)
            with open(os.path.join(session.job.output_dir, REPLANS_NAME), "a") as f:
                f.write(json.dumps(record) + "\n")
        return record
