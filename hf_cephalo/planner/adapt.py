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

The switch rule ([Note: a switch must pay against the noise]) weighs the predicted gain against
each rank's measured noise, and remembers what every split measured and whether the last switch
paid (``SwitchHistory``, handed back with each decision).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize_fixed_state
from hf_cephalo.planner.predict import predict, predicted_unit_compute_s
from hf_cephalo.planner.types import Plan
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["MEASUREMENT_FIELDS", "Measurement", "SwitchDecision", "StateDecision",
           "ScaleWindow", "LastSwitch", "SwitchHistory",
           "predicted_unit_compute_s", "refit_cluster", "split_key", "scale_error",
           "relative_logs", "window_noise", "agreeing_run", "ScaleLevel", "window_level",
           "pessimistic_gain", "moved_ranks",
           "decide_batch_switch",
           "decide_state_switch", "DEFAULT_THRESHOLD", "DEFAULT_HYSTERESIS_STEPS",
           "DEFAULT_CONFIRMATIONS", "DEFAULT_CONFIDENCE_Z", "DEFAULT_NOISE_FLOOR",
           "DEFAULT_PAYOFF_FRACTION"]

DEFAULT_THRESHOLD = 0.05  # least predicted gain a switch needs, at the unfavourable end of noise
DEFAULT_HYSTERESIS_STEPS = 20  # at most one switch per this many steps
DEFAULT_CONFIRMATIONS = 2  # consecutive exchanges that must each show the gain (and the move)
DEFAULT_CONFIDENCE_Z = 2.0  # a rank's scale is taken as uncertain by this many standard errors
DEFAULT_NOISE_FLOOR = 0.03  # least relative standard error of one window's scale
DEFAULT_PAYOFF_FRACTION = 0.5  # a switch paid if it measured at least this share of its gain
NOISE_WINDOWS = 12  # past windows on the running split whose spread measures its noise
MIN_NOISE_WINDOWS = 4  # fewer past windows tell no spread: the window's own noise stands

MEASUREMENT_FIELDS = ("steps", "unit_compute_s", "step_s", "wait_s", "batch_size",
                      "unit_compute_mad_s")
"""The floats one rank contributes to the exchange, in this order (``Measurement``)."""

# sqrt(pi / 2): the asymptotic standard error of a sample median is sqrt(pi/2)·sigma/sqrt(n) for
# normal data; 1.4826: sigma = 1.4826 x MAD for normal data (the MAD's consistency factor).
_MEDIAN_SE_PER_SIGMA = math.sqrt(math.pi / 2)
_SIGMA_PER_MAD = 1.4826


class Measurement(NamedTuple):
    """One rank's robust estimate over the steps since the last exchange (medians).

    Attributes:
        steps: steps measured (0: none).
        unit_compute_s: forward + recompute + backward of all units per step, seconds.
        step_s: wall time of one training step, seconds.
        wait_s: step_s minus all timed compute (embedding, units, head): collectives not hidden
            behind compute, waiting for slower ranks, the optimizer step, data; seconds.
        batch_size: the b_i the steps ran with (samples); must be the plan's.
        unit_compute_mad_s: the median absolute deviation of the steps' unit compute from
            ``unit_compute_s`` (the window's spread; 0 for one step), seconds.
    """

    steps: float
    unit_compute_s: float
    step_s: float
    wait_s: float
    batch_size: float
    unit_compute_mad_s: float


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
            one by more than the threshold at the unfavourable end of the noise (0 after a
            switch or when it did not).
        history: what the next decision needs of this one (pass it back as
            ``measured_step_s``): every split's measured step, this window's scales, the
            last switch and whether it paid.
        notice: one line when this exchange found that the last switch did not pay
            (``SwitchHistory``), else None.
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
    history: "SwitchHistory | None" = None
    notice: str | None = None


# [Note: a switch must pay against the noise]
# Windows move with co-tenants, data-loader hiccups and checkpoint writes; a re-plan that
# follows them flip-flops (docs/adaptive.md, "The switch rule"). A switch is taken only when,
# at two exchanges in a row:
# - it gains more than the threshold at the unfavourable end of each rank's interval
#   level·exp(±z·e_i) (``window_level``, ``pessimistic_gain``): the level is the median of the
#   latest windows that agree, e_i the larger of the window's own error (its MAD) and the
#   window-to-window noise of the relative speeds, over sqrt(windows agreeing);
# - a rank's relative speed moved out of what the running plan was made for (the profile for
#   the start plan, the first window on a switched-to split: a refit read at another m is no
#   move), or the split ran before and its FASTEST measured step beats the running split's
#   (load only slows). A switch that did not pay is noticed (one line); once reversed it is
#   not made again (the split it went to measured slower).
#
# [Note: no flapping between measured plans]
# The refit scales each rank's whole F(m), B(m) curve by what it measured at ONE microbatch size.
# Where the profile's curve has the wrong shape (a profile taken under other load), the scale
# read at plan A's m predicts plan B faster, and the scale read at B's m predicts A faster: the
# plan flaps (seen on the main job: [6, 10] -> [4, 12] -> [6, 10] -> ...). Plans already run
# have a measured step time, which beats any prediction: a switch back to one of them needs its
# measurement to beat the running plan's.


class ScaleWindow(NamedTuple):
    """The scales one exchange measured on one split.

    Attributes:
        split: ``split_key`` of the plan the window ran on.
        scales: s_i per rank (the previous value where a rank had no usable numbers).
        errors: relative standard error of each s_i (``scale_error``; the noise floor where
            not measured).
        measured: per rank, whether s_i was measured in this window (b_i > 0, usable row).
    """

    split: str
    scales: tuple[float, ...]
    errors: tuple[float, ...]
    measured: tuple[bool, ...]


class LastSwitch(NamedTuple):
    """A switch whose payoff is not yet measured.

    Attributes:
        from_split / to_split: ``split_key`` before and after.
        step: the step after which it happened.
        predicted_gain: 1 - after / before of the decision (point estimate), in (0, 1).
        from_step_s: the step time the window before the switch measured (the slowest rank's
            median), seconds; None when not measured.
        window: the scales it was decided on.
    """

    from_split: str
    to_split: str
    step: int
    predicted_gain: float
    from_step_s: float | None
    window: ScaleWindow


@dataclasses.dataclass(frozen=True)
class SwitchHistory(Mapping):
    """What the decisions of one run remember, as a mapping ``split_key`` -> the fastest step
    time any window measured on that split (seconds, the slowest rank's median: load only
    slows a step, so the fastest credible figure is the split's own).

    Built by the decisions only (pass ``decision.history`` back as ``measured_step_s``); a plain
    mapping ``split_key -> seconds`` is taken as the fastest figures of a fresh history.

    Attributes:
        fastest_s: split -> fastest measured step, seconds.
        windows: the last ``NOISE_WINDOWS`` exchanges' scales on the running split, oldest
            first (empty right after a switch).
        reference: the scales the running split is judged against: None = the profile (each
            scale 1.0 at the noise floor); a window with no scales = the next window on
            ``reference.split`` becomes it (right after a switch).
        last_switch: the switch whose payoff the next window on its split measures.
        unpaid: the switches that did not pay (``last_switch`` values), oldest first.
    """

    fastest_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    windows: tuple[ScaleWindow, ...] = ()
    reference: ScaleWindow | None = None
    last_switch: LastSwitch | None = None
    unpaid: tuple[LastSwitch, ...] = ()

    def __getitem__(self, key: str) -> float:
        return self.fastest_s[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fastest_s)

    def __len__(self) -> int:
        return len(self.fastest_s)

    @classmethod
    def of(cls, value: Mapping[str, float] | None) -> "SwitchHistory":
        """``value`` itself if a history, else a fresh one with ``value`` as fastest figures."""
        if isinstance(value, SwitchHistory):
            return value
        return cls(fastest_s=dict(value or {}))


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
    if m.unit_compute_s < 0 or m.step_s <= 0 or m.unit_compute_mad_s < 0:
        return (f"impossible timings (unit compute {m.unit_compute_s} s, step {m.step_s} s, "
                f"spread {m.unit_compute_mad_s} s)")
    if plan.ranks[rank].batch_size > 0 and m.unit_compute_s == 0:
        return "no unit compute timed (the compute timer is off on this rank)"
    return None


# ---- the noise of a window ---------------------------------------------------------------------
def scale_error(m: Measurement, *, noise_floor: float = DEFAULT_NOISE_FLOOR) -> float:
    """The relative standard error of a window's median unit compute (so of its scale s_i).

    sqrt(pi/2) · 1.4826 · MAD / (median · sqrt(steps)): the asymptotic standard error of a
    sample median of n normal draws is sqrt(pi/2)·sigma/sqrt(n), and sigma = 1.4826·MAD for
    normal data (robust: one hiccup in a window moves neither median nor MAD much). At least
    ``noise_floor``: a window of one step has no spread, and a profile is no exact figure.
    """
    if m.unit_compute_s <= 0 or m.steps < 1:
        return noise_floor
    se = (_MEDIAN_SE_PER_SIGMA * _SIGMA_PER_MAD * m.unit_compute_mad_s
          / (m.unit_compute_s * math.sqrt(m.steps)))
    return max(noise_floor, se)


def relative_logs(window: ScaleWindow) -> list[float | None]:
    """ln s_i less the mean ln s_j of the ranks ``window`` measured (None where it did not
    measure rank i): the speeds relative to each other, which is what a re-balance follows. A
    co-tenant on shared cores or a busy host slows every rank at once; that moves no split.
    With one measured rank, its ln s_i itself."""
    logs = [math.log(s) if ok else None for s, ok in zip(window.scales, window.measured)]
    known = [x for x in logs if x is not None]
    centre = statistics.fmean(known) if len(known) >= 2 else 0.0
    return [None if x is None else x - centre for x in logs]


def window_noise(windows: Sequence[ScaleWindow], rank: int) -> float:
    """How much ``rank``'s relative speed (``relative_logs``) moves from one window to the next
    in ``windows`` (oldest first): 1.4826 x the median |x_k - x_(k-1)| / sqrt(2), the standard
    deviation of one window's reading for normal data; from successive differences, so one
    real step in the level costs one difference, not the estimate. 0 with fewer than
    ``MIN_NOISE_WINDOWS`` windows that measured the rank."""
    logs = [x for x in (relative_logs(w)[rank] for w in windows) if x is not None]
    if len(logs) < MIN_NOISE_WINDOWS:
        return 0.0
    steps = [abs(b - a) for a, b in zip(logs, logs[1:])]
    return _SIGMA_PER_MAD * statistics.median(steps) / math.sqrt(2)


def agreeing_run(past: Sequence[ScaleWindow], window: ScaleWindow, noise: Sequence[float], *,
                 z: float = DEFAULT_CONFIDENCE_Z) -> int:
    """How many windows, ``window`` and the latest of ``past`` back from it, read the same
    relative speeds (``relative_logs``) as ``window`` within the noise: for every rank both
    measured, |x - x_now| <= z·sqrt(2)·max(noise_i, e_i, e_i now). At least 1."""
    now, run = relative_logs(window), 1
    for w in reversed(past):
        then = relative_logs(w)
        if not all(a is None or b is None or abs(a - b) <= z * math.sqrt(2) * max(
                noise[i], w.errors[i], window.errors[i])
                for i, (a, b) in enumerate(zip(then, now))):
            break
        run += 1
    return run


class ScaleLevel(NamedTuple):
    """``window_level``'s answer, per rank: the level s_i, its interval [lo_i, hi_i], and how
    many windows agreed on it (``run``)."""

    scales: list[float]
    lo: list[float]
    hi: list[float]
    run: int


def window_level(past: Sequence[ScaleWindow], window: ScaleWindow, *,
                 z: float = DEFAULT_CONFIDENCE_Z,
                 noise_floor: float = DEFAULT_NOISE_FLOOR) -> ScaleLevel:
    """The level of each rank's scale now, from ``window`` and the latest of ``past`` (the
    same split, oldest first) that agree with it (``agreeing_run``, at most ``NOISE_WINDOWS``):
    the median of their s_i, with error e_i = max(floor, max(window's e_i, window-to-window
    noise of ``past``) / sqrt(run)); the interval is level · exp(±z·e_i). Ranks ``window`` did
    not measure keep its s_i (the previous value) at the floor."""
    n = len(window.scales)
    sigma = [window_noise(past, i) for i in range(n)]
    run = min(agreeing_run(past, window, sigma, z=z), NOISE_WINDOWS)
    runs = (*past[len(past) - run + 1:], window)
    level, lo, hi = [], [], []
    for i in range(n):
        s, e = window.scales[i], noise_floor
        if window.measured[i]:
            s = math.exp(statistics.median(math.log(w.scales[i]) for w in runs
                                           if w.measured[i]))
            e = max(noise_floor, max(window.errors[i], sigma[i]) / math.sqrt(run))
        level.append(s)
        lo.append(s * math.exp(-z * e))
        hi.append(s * math.exp(z * e))
    return ScaleLevel(level, lo, hi, run)


def moved_ranks(level: ScaleLevel, measured: Sequence[bool], reference: ScaleWindow, *,
                z: float = DEFAULT_CONFIDENCE_Z) -> list[int]:
    """The ranks whose relative speed moved: the interval [lo_i, hi_i] of ``level``, taken
    relative to its other measured ranks (as ``relative_logs``), lies wholly outside
    ``reference``'s relative s_i · exp(±z·e_i); only ranks measured now and then."""
    now = relative_logs(ScaleWindow("", tuple(level.scales), (), tuple(measured)))
    then = relative_logs(reference)
    out = []
    for i, (a, b) in enumerate(zip(level.lo, level.hi)):
        if now[i] is None or then[i] is None:
            continue
        shift = now[i] - math.log(level.scales[i])  # the same shift for the whole interval
        e = reference.errors[i]
        if math.log(b) + shift < then[i] - z * e or math.log(a) + shift > then[i] + z * e:
            out.append(i)
    return out


def pessimistic_gain(cluster: ClusterProfile, running: Plan, new: Plan, scales: Sequence[float],
                     lo: Sequence[float], hi: Sequence[float]) -> float:
    """1 - T(new) / T(running) on the refit where the noise works against the switch: a rank
    that ``new`` gives more unit compute than ``running`` at ``hi``, one it gives less at
    ``lo``, the others at ``scales`` (T: ``predict``'s iteration time, seconds)."""
    corner = []
    for i, s in enumerate(scales):
        more = predicted_unit_compute_s(new, cluster, i) - \
            predicted_unit_compute_s(running, cluster, i)
        corner.append(hi[i] if more > 0 else lo[i] if more < 0 else s)
    fit = refit_cluster(cluster, corner)
    return 1.0 - predict(new, fit).iteration_s / predict(running, fit).iteration_s


class _Assessment(NamedTuple):
    """One exchange read: the scales and their noise, and the history with this window in."""

    level: ScaleLevel  # the point scales and their intervals
    window: ScaleWindow
    reference: ScaleWindow  # what the running split was planned for
    invalid: list[int]
    reasons: list[str]
    step_s: float | None  # the window's step: the slowest rank's median, seconds
    history: SwitchHistory  # with this window, as if nothing is switched
    notice: str | None


def _assess(cluster: ClusterProfile, plan: Plan, rows: Sequence[Sequence[float]],
            previous_scales: Sequence[float] | None, measured_step_s, *, z: float,
            noise_floor: float, payoff: float) -> _Assessment:
    """Read ``rows`` into the scales' level (``window_level``) and the history with them."""
    n = cluster.world_size
    if len(rows) != n:
        raise ValueError(f"{len(rows)} measurement rows for {n} ranks")
    scales = list(previous_scales) if previous_scales is not None else [1.0] * n
    errors, measured = [noise_floor] * n, [False] * n
    invalid, reasons, steps = [], [], []
    for i, row in enumerate(rows):
        why = _check_row(row, i, plan)
        if why is not None:
            invalid.append(i)
            reasons.append(why)
            continue
        m = Measurement(*(float(x) for x in row))
        steps.append(m.step_s)
        predicted = predicted_unit_compute_s(plan, cluster, i)
        if plan.ranks[i].batch_size > 0 and predicted > 0:
            scales[i] = m.unit_compute_s / predicted
            errors[i], measured[i] = scale_error(m, noise_floor=noise_floor), True
    key = split_key(plan)
    history = SwitchHistory.of(measured_step_s)
    past = tuple(w for w in history.windows if w.split == key)
    window = ScaleWindow(key, tuple(scales), tuple(errors), tuple(measured))
    step_s = max(steps) if len(steps) == n else None
    fastest = dict(history.fastest_s)
    if step_s is not None:
        fastest[key] = min(fastest.get(key, math.inf), step_s)
    last, unpaid, notice = history.last_switch, history.unpaid, None
    if last is not None and last.to_split == key and step_s is not None:
        notice = _payoff_notice(last, step_s, payoff)
        unpaid = (*unpaid, last) if notice else unpaid
        last = None  # measured: paid or not
    reference, judged_by = history.reference, None
    if reference is not None and (reference.split != key or not reference.scales):
        # the first window on a switched-to split that measured every working rank is what
        # it is judged by; until then nothing on it counts as moved
        complete = all(measured[i] for i, r in enumerate(plan.ranks) if r.batch_size > 0)
        reference = window if complete else ScaleWindow(key, (), (), ())
        judged_by = window
    # the level of each scale: the latest windows that agree, against the split's noise
    level = window_level(past, window, z=z, noise_floor=noise_floor)
    profile = ScaleWindow(key, (1.0,) * n, (noise_floor,) * n,
                          tuple(r.batch_size > 0 for r in plan.ranks))
    history = SwitchHistory(fastest_s=fastest, windows=(*past, window)[-NOISE_WINDOWS:],
                            reference=reference, last_switch=last, unpaid=unpaid)
    return _Assessment(level, window, judged_by or reference or profile, invalid, reasons,
                       step_s, history, notice)


def _payoff_notice(last: LastSwitch, step_s: float, payoff: float) -> str | None:
    """The line saying ``last`` did not pay, measured at ``step_s`` seconds per step on its new
    split against the window before it (None: it paid, or the window before had no figure)."""
    if last.from_step_s is None:
        return None
    delivered = 1.0 - step_s / last.from_step_s
    if delivered >= payoff * last.predicted_gain:
        return None
    return (f"the switch after step {last.step} ({last.from_split} -> {last.to_split}) did not "
            f"pay: predicted {100 * last.predicted_gain:.1f}% faster, measured "
            f"{100 * delivered:+.1f}% ({last.from_step_s:.4f} s -> {step_s:.4f} s per step)")


def _switched_history(a: _Assessment, new: Plan, step: int, gain: float) -> SwitchHistory:
    """``a.history`` after switching to ``new`` (its payoff and first window still to come)."""
    key = split_key(new)
    return dataclasses.replace(
        a.history, windows=(), reference=ScaleWindow(key, (), (), ()),
        last_switch=LastSwitch(a.window.split, key, step, gain, a.step_s, a.window))


def _gate(cluster: ClusterProfile, plan: Plan, new: Plan, a: _Assessment, *, threshold: float,
          z: float) -> str | None:
    """Why ``new`` must not replace the running ``plan`` although its point prediction gains
    more than ``threshold`` (None: it may): [Note: a switch must pay against the noise]."""
    gain = pessimistic_gain(cluster, plan, new, a.level.scales, a.level.lo, a.level.hi)
    if not gain > threshold:
        windows = f"{a.level.run} window{'s' if a.level.run > 1 else ''} agreeing"
        return (f"only {100 * gain:.1f}% at the unfavourable end of the measured noise "
                f"(±{z:g} standard errors, {windows}), not above the threshold "
                f"{100 * threshold:.1f}%")
    old_key, new_key = split_key(plan), split_key(new)
    ran, now = a.history.fastest_s.get(new_key), a.history.fastest_s.get(old_key)
    if ran is not None and now is not None and new_key != old_key:  # r_i alone: not "ran"
        if not ran < (1.0 - threshold) * now:
            return (f"that split ran before at {ran:.4f} s per step (measured), not faster than "
                    f"the running {now:.4f} s by more than {100 * threshold:.1f}%")
        return None  # measured faster: the measurement is the gain, no move needed
    if not moved_ranks(a.level, a.window.measured, a.reference, z=z):
        planned = "the profile" if a.history.reference is None else "its first window"
        return (f"no rank's speed moved beyond its noise from what the running split was planned "
                f"for ({planned})")
    return None


def decide_batch_switch(cluster: ClusterProfile, plan: Plan, rows: Sequence[Sequence[float]], *,
                        step: int, last_switch_step: int | None,
                        threshold: float = DEFAULT_THRESHOLD,
                        hysteresis_steps: int = DEFAULT_HYSTERESIS_STEPS,
                        previous_scales: Sequence[float] | None = None,
                        caps_bytes: Sequence[float | None] | None = None,
                        streak: int = 0,
                        confirmations: int = DEFAULT_CONFIRMATIONS,
                        measured_step_s: Mapping[str, float] | None = None,
                        z: float = DEFAULT_CONFIDENCE_Z,
                        noise_floor: float = DEFAULT_NOISE_FLOOR,
                        payoff: float = DEFAULT_PAYOFF_FRACTION) -> SwitchDecision:
    """Whether to switch the running ``plan`` to a re-balanced (b_i, m_i, l_i), and to what.

    A pure function of its arguments (every rank passes the same exchanged ``rows`` and gets
    the same answer). Steps: refit the START profile ``cluster`` to the measurements
    (``refit_cluster``); re-plan with r_i fixed (``optimize.optimize_fixed_state``; ranks
    with unusable measurements keep their (b_i, m_i, l_i) and their previous scale); switch iff
    the re-made plan fits every memory cap (the model's c·C_i and the emulated ``caps_bytes``),
    differs from the running one, at least ``hysteresis_steps`` steps passed since
    ``last_switch_step``, and, at ``confirmations`` consecutive exchanges (``streak`` counts
    the ones before this; the switch uses the latest measurements), its predicted iteration
    time on the refit is below (1 - ``threshold``) times the running plan's both at the point
    estimate and at the unfavourable end of each rank's noise, and it passes the rest of
    [Note: a switch must pay against the noise]: a rank moved, or the split measured faster
    before; not a switch that did not pay in these speeds.

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
        measured_step_s: the previous decision's ``history`` (a ``SwitchHistory``), or a plain
            mapping ``split_key`` -> measured step seconds (the fastest figures of a fresh
            history). A plan that ran before is switched back to only if it MEASURED faster
            than the running plan by more than ``threshold`` ([Note: no flapping between
            measured plans]).
        z: standard errors on each side of a rank's scale (> 0).
        noise_floor: least relative standard error of a window's scale (>= 0).
        payoff: share of its predicted gain a switch must measure, or it did not pay.

    Raises:
        ValueError: ``rows`` has not one row per rank.
    """
    a = _assess(cluster, plan, rows, previous_scales, measured_step_s, z=z,
                noise_floor=noise_floor, payoff=payoff)
    scales, invalid, reasons = a.level.scales, a.invalid, a.reasons

    def keep(reason: str, before=None, after=None, streak_now: int = 0) -> SwitchDecision:
        if a.notice:
            reason = f"{reason}; {a.notice}"
        return SwitchDecision(False, plan, reason, before, after, scales, invalid, reasons,
                              streak_now, a.history, a.notice)

    if len(invalid) == cluster.world_size:
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
    over = _over_caps(new, fit, caps_bytes)
    if over:
        return keep(f"the re-balanced plan would exceed the memory cap of rank(s) {over}",
                    before, after)
    split = [(r.batch_size, r.microbatch_size) for r in new.ranks]
    if split == [(r.batch_size, r.microbatch_size) for r in plan.ranks]:
        return keep("the running plan is still the best", before, after)
    gain = 1.0 - after / before
    if not after < (1.0 - threshold) * before:
        return keep(f"predicted gain {100 * gain:.1f}% is not above the "
                    f"threshold {100 * threshold:.1f}%", before, after)
    why = _gate(cluster, plan, new, a, threshold=threshold, z=z)
    if why is not None:
        return keep(f"predicted gain {100 * gain:.1f}%, but {why}", before, after)
    if streak + 1 < confirmations:
        return keep(f"predicted gain {100 * gain:.1f}% seen at {streak + 1} of {confirmations} "
                    "exchanges in a row", before, after, streak + 1)
    return SwitchDecision(True, new, f"predicted {before:.4f} s -> {after:.4f} s per step",
                          before, after, scales, invalid, reasons, 0,
                          _switched_history(a, new, step, gain), a.notice)


def _over_caps(new: Plan, fit: ClusterProfile, caps_bytes) -> list[int]:
    """Ranks where ``new`` exceeds the model's c·C_i or the emulated cap (bytes)."""
    pred = predict(new, fit)
    return [i for i, (p, cap) in enumerate(zip(pred.ranks, caps_bytes or [None] * len(pred.ranks)))
            if not p.fits or (cap is not None and p.memory_bytes > cap)]


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
                        measured_step_s: Mapping[str, float] | None = None,
                        z: float = DEFAULT_CONFIDENCE_Z,
                        noise_floor: float = DEFAULT_NOISE_FLOOR,
                        payoff: float = DEFAULT_PAYOFF_FRACTION) -> StateDecision:
    """Whether to re-lay the training state (r_i) in memory, pure like ``decide_batch_switch``.

    First the batch decision (r_i fixed, ``decide_batch_switch``: the cheap switch). Then the
    plan with r_i free: ``optimize`` on the same refit profile (exact b_i, m_i, l_i and the greedy
    state partition, ``state.partition_state``). It is taken instead when every rank's
    measurements are usable, no switch happened in the last ``hysteresis_steps`` steps, it fits
    every cap (the model's and ``caps_bytes``), its r_i differ from the running ones, it beats
    the running plan by more than ``threshold`` (at the point estimate and at the unfavourable
    end of the noise, with the rest of [Note: a switch must pay against the noise]) at
    ``confirmations`` exchanges in a row (``streak`` as in ``decide_batch_switch``), and either
    no plan with r_i fixed fits the caps any more, or it beats the best plan with r_i fixed by
    more than ``threshold`` on the point estimate (moving state costs collectives; the gain
    must be worth it). ``batch.history`` is the history to pass back in every case.
    """
    from hf_cephalo.planner.optimize import optimize

    kw = dict(z=z, noise_floor=noise_floor, payoff=payoff)
    batch = decide_batch_switch(cluster, plan, rows, step=step, last_switch_step=last_switch_step,
                                threshold=threshold, hysteresis_steps=hysteresis_steps,
                                previous_scales=previous_scales, caps_bytes=caps_bytes,
                                streak=streak, confirmations=confirmations,
                                measured_step_s=measured_step_s, **kw)

    def keep(reason: str, fixed=None, free=None) -> StateDecision:
        return StateDecision(False, batch.plan, f"{batch.reason}; state: {reason}", batch,
                             fixed, free)

    if batch.invalid_ranks:
        return keep("not re-laid while a rank's measurements are unusable")
    if last_switch_step is not None and step - last_switch_step < hysteresis_steps:
        return keep("hysteresis")
    a = _assess(cluster, plan, rows, previous_scales, measured_step_s, **kw)
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
    if _over_caps(free, fit, caps_bytes):
        return keep("the plan with r_i free would exceed a memory cap", fixed_s, free_s)
    if all(abs(x - y) <= 1e-12 for x, y in zip(free.state_ratios, plan.state_ratios)):
        return keep("the greedy r_i are the running ones", fixed_s, free_s)
    if not free_s < (1.0 - threshold) * before:
        return keep(f"r_i free gains {100 * (1 - free_s / before):.1f}% over the running plan, "
                    f"not above {100 * threshold:.1f}%", fixed_s, free_s)
    why = _gate(cluster, plan, free, a, threshold=threshold, z=z)
    if why is not None:
        return keep(f"r_i free gains {100 * (1 - free_s / before):.1f}%, but {why}",
                    fixed_s, free_s)
    if fixed_s is not None and not free_s < (1.0 - threshold) * fixed_s:
        return keep(f"r_i free ({free_s:.4f} s) is not better than r_i fixed ({fixed_s:.4f} s) "
                    f"by more than {100 * threshold:.1f}%", fixed_s, free_s)
    if streak + 1 < confirmations:  # the caller keeps ``batch.streak`` for the next exchange
        return StateDecision(False, plan, f"r_i free gain seen at {streak + 1} of "
                             f"{confirmations} exchanges in a row",
                             batch._replace(switch=False, plan=plan, streak=streak + 1,
                                            history=a.history),
                             fixed_s, free_s)
    why = "no plan with r_i fixed fits the caps" if fixed_s is None else \
        f"r_i fixed {fixed_s:.4f} s"
    moved = batch._replace(history=_switched_history(a, free, step, 1.0 - free_s / before))
    return StateDecision(True, free, f"re-lay r_i: predicted {before:.4f} s -> {free_s:.4f} s "
                         f"per step ({why})", moved, fixed_s, free_s)
