"""The baselines Cephalo is compared with (paper §4: FSDP, Cephalo-CB, Cephalo-MB, Whale-style
batch ∝ speed), each predicted with the same cost model (``predict.py``), and their tables/plots.

Used by the CLI tables (``hf-cephalo plan``, ``hf-cephalo simulate``) and by the
paper-reproduction tests. ``predict`` / ``Prediction`` are re-exported from ``predict.py`` for
older imports. Imports point one way: cost <- predict <- optimize <- simulate. Baseline
definitions: ``[Note: baselines]`` below and docs/paper_reproduction.md. Pure Python/numpy;
matplotlib is imported only by ``comparison_figure``.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.optimize import InfeasiblePlanError, optimize
from hf_cephalo.planner.predict import Prediction, RankPrediction, predict
from hf_cephalo.planner.state import integer_targets, partition_state
from hf_cephalo.planner.types import Plan, check_batch_and_fraction
from hf_cephalo.profiles.types import ClusterProfile
from hf_cephalo.units import GIB

__all__ = [
    "RankPrediction", "Prediction", "predict", "BASELINES", "BASELINE_LABELS", "PlanComparison",
    "even_split_plan", "compute_balance_plan", "memory_balance_plan", "speed_proportional_plan",
    "compare_plans", "format_comparison_table", "format_sweep_table", "comparison_figure",
    "plot_comparison", "extrapolation_note",
]



# --- baselines (paper §4, Fig. 7 ablation and Supplementary D) -------------------------------
# [Note: baselines] Every baseline is a Plan predicted with the SAME cost model as Cephalo, so
# the comparison isolates the choice of (b_i, m_i, r_i). Definitions (docs/paper_reproduction.md):
#   even      b_i = B/N (the first B mod N ranks take one more), r_i = 1/N, one microbatch size m
#             for every rank: the fastest m in 1..ceil(B/N) whose memory fits every cap.
#   compute   b_i minimizes max_i T_i(1, b_i) (one microbatch, m_i = b_i: balance without
#             gradient accumulation), r_i = 1/N, memory ignored while choosing.
#   memory    b_i = B/N as in ``even``, m_i = 1, r_i from the greedy partition (state.py).
#   speed     b_i ∝ peak FLOP/s (largest remainder), r_i = 1/N, per rank the fastest m_i whose
#             memory fits its cap (Whale-style: sharded state, batch by spec-sheet speed).
#   cephalo   ``optimize``.
# A plan that needs more than c·C_i on some rank is kept and marked out of memory.

BASELINES = ("even", "compute_balance", "memory_balance", "speed_proportional", "cephalo")
BASELINE_LABELS = {
    "even": "even FSDP split",
    "compute_balance": "compute balance only",
    "memory_balance": "memory balance only (m=1)",
    "speed_proportional": "batch ∝ peak FLOP/s",
    "cephalo": "Cephalo",
}


class PlanComparison(NamedTuple):
    """One row of a comparison: a baseline's plan and its prediction.

    ``plan``/``prediction`` are None when no plan exists (Cephalo infeasible, or no peak FLOP/s
    for the speed-proportional baseline); ``note`` then says why. ``fits`` is False for a plan
    over a memory cap (out of memory) and for a missing plan.
    """

    name: str  # key in BASELINES
    label: str  # human-readable name
    plan: Plan | None
    prediction: Prediction | None
    note: str  # "" when the plan fits; else "out of memory: ..." or why there is no plan

    @property
    def fits(self) -> bool:
        return self.prediction is not None and self.prediction.fits

    @property
    def samples_per_s(self) -> float:
        """Predicted throughput (samples/s); nan without a plan. Also set for OOM plans."""
        return self.prediction.samples_per_s if self.prediction is not None else float("nan")


def _hand_plan(cluster: ClusterProfile, batch_sizes, microbatch_sizes, state_ratios,
               memory_fraction: float, root_resident: bool = False) -> Plan:
    """A Plan with device names, memory estimates and the model fingerprint filled in."""
    devs = cluster.devices
    plan = Plan.from_ratios(batch_sizes, microbatch_sizes, state_ratios,
                            devices=[d.name for d in devs], memory_fraction=memory_fraction,
                            root_resident=root_resident)
    model = cluster.model
    plan.model = {"name": model.name, "num_units": model.num_units,
                  "params_per_unit": model.params_per_unit, "params_other": model.params_other}
    pred = predict(plan, cluster)
    for r, p, d in zip(plan.ranks, pred.ranks, devs):
        r.predicted_memory_bytes = p.memory_bytes
        r.memory_capacity_bytes = d.memory_capacity_bytes
    plan.predicted_iteration_s = pred.iteration_s
    return plan


def _even_batch_sizes(world_size: int, global_batch_size: int) -> list[int]:
    q, rem = divmod(global_batch_size, world_size)
    return [q + (1 if i < rem else 0) for i in range(world_size)]


def even_split_plan(cluster: ClusterProfile, global_batch_size: int,
                    memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                    root_resident: bool = False) -> Plan:
    """FSDP's even split: b_i = B/N, r_i = 1/N, the fastest common microbatch size that fits.

    Tries m = 1..ceil(B/N) (the last microbatch of a rank may be smaller); if no m fits every
    cap, returns m = 1 (the least memory), which ``predict`` reports as not fitting.
    """
    check_batch_and_fraction(global_batch_size, memory_fraction)
    n = cluster.world_size
    sizes = _even_batch_sizes(n, global_batch_size)
    best, best_t = None, math.inf
    for m in range(1, max(sizes) + 1):
        pred = predict(Plan.from_ratios(sizes, [m] * n, [1.0 / n] * n,
                                        memory_fraction=memory_fraction,
                                        root_resident=root_resident), cluster)
        if pred.fits and pred.iteration_s < best_t:
            best, best_t = m, pred.iteration_s
    return _hand_plan(cluster, sizes, [best or 1] * n, [1.0 / n] * n, memory_fraction,
                      root_resident)


def compute_balance_plan(cluster: ClusterProfile, global_batch_size: int,
                         memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                         root_resident: bool = False) -> Plan:
    """Compute balance alone: b_i minimizing max_i T_i(1, b_i) (with the root compute of
    cost.py [Note: step terms]), m_i = b_i, r_i = 1/N.

    The batch goes where the cost model says compute is fastest, with no gradient
    accumulation and no memory balancing (the paper's Cephalo-CB, §4 Fig. 7); memory is not
    considered while choosing, so the plan may not fit (``predict(...).fits`` is False).
    Exact: binary search over the candidate times T_i(1, b), b <= B.
    """
    check_batch_and_fraction(global_batch_size, memory_fraction)
    B, devs, comm = global_batch_size, cluster.devices, cost.unit_comm(cluster)
    bs = np.arange(1, B + 1)
    # times[i][b] = T_i(1, b); b = 0 is the idle rank. Prefix max: b is allowed at threshold t
    # only if every smaller batch is too (so lowering b_i later never raises T_i above t).
    # T_i(1, b) with the rank's root compute and bookkeeping over its L units: the compute
    # phase per unit (cost.py [Note: step terms])
    times = []
    L = cluster.model.num_units
    for i, d in enumerate(devs):
        t = cost.unit_time_s(cost.fwd_time_s(d, bs), cost.bwd_time_s(d, bs), 1, comm, False) + \
            cost.rank_extra_s(cluster, i, bs, bs) / L
        times.append(np.concatenate([[cost.idle_unit_time_s(comm, False)], t]))
    prefix = [np.maximum.accumulate(t) for t in times]
    cands = np.unique(np.concatenate(times))

    def max_batches(t: float) -> list[int]:
        return [int(np.searchsorted(p, t, side="right")) - 1 for p in prefix]

    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max_batches(cands[mid])) >= B:
            hi = mid
        else:
            lo = mid + 1
    sizes = max_batches(cands[lo])
    # Take the surplus from the rank with the largest unit time first.
    for _ in range(sum(sizes) - B):
        i = max((k for k in range(len(sizes)) if sizes[k] > 0),
                key=lambda k: times[k][sizes[k]])
        sizes[i] -= 1
    n = cluster.world_size
    return _hand_plan(cluster, sizes, sizes, [1.0 / n] * n, memory_fraction, root_resident)


def memory_balance_plan(cluster: ClusterProfile, global_batch_size: int,
                        memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                        root_resident: bool = False) -> Plan:
    """Memory balance alone: b_i = B/N, m_i = 1, greedy state ratios r_i (Cephalo-MB, Fig. 7).

    The state is partitioned by the greedy of ``state.partition_state`` for the compute
    memory M_i(1); the plan does not fit only if S + Σ M_i(1) exceeds c·Σ C_i.
    """
    check_batch_and_fraction(global_batch_size, memory_fraction)
    sizes = _even_batch_sizes(cluster.world_size, global_batch_size)
    micro = [1 if b else 0 for b in sizes]
    mem = [float(memory.rank_memory_bytes(cluster, i, m, b, root_resident=root_resident))
           for i, (m, b) in enumerate(zip(micro, sizes))]
    ratios = partition_state(cluster.model.state_bytes, mem,
                             [d.memory_capacity_bytes for d in cluster.devices])
    return _hand_plan(cluster, sizes, micro, ratios, memory_fraction, root_resident)


def speed_proportional_plan(cluster: ClusterProfile, global_batch_size: int,
                            peak_flops: Sequence[float],
                            memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                            root_resident: bool = False) -> Plan:
    """Whale-style: b_i ∝ peak FLOP/s, r_i = 1/N, per rank the fastest m_i that fits.

    Args:
        peak_flops: per rank, any unit (only ratios matter), e.g. spec-sheet TFLOP/s.

    Each rank tries m = 1..b_i (the last microbatch may be smaller) and keeps the fastest
    T_i with S/N + M_i(m) <= c·C_i; if none fits it takes m = 1 and the plan does not fit.

    Raises:
        ValueError: wrong number of peaks, or a peak that is not positive.
    """
    check_batch_and_fraction(global_batch_size, memory_fraction)
    n, S = cluster.world_size, cluster.model.state_bytes
    peaks = [float(p) for p in peak_flops]
    if len(peaks) != n or not all(math.isfinite(p) and p > 0 for p in peaks):
        raise ValueError(f"peak_flops needs one positive value per rank ({n} ranks), got {peaks}")
    sizes = integer_targets([p / sum(peaks) for p in peaks], global_batch_size)
    micro = []
    for i, (d, b) in enumerate(zip(cluster.devices, sizes)):
        if b == 0:
            micro.append(0)
            continue
        ms = np.arange(1, b + 1)
        f, bw = cost.rank_compute_s(d, b, ms)
        t = cost.unit_time_s(f, bw, 1, cost.unit_comm(cluster), False) + \
            cost.rank_extra_s(cluster, i, b, ms) / cluster.model.num_units
        ok = S / n + memory.rank_memory_bytes(cluster, i, ms, b,
                                              root_resident=root_resident) <= \
            memory_fraction * d.memory_capacity_bytes
        micro.append(int(ms[ok][np.argmin(t[ok])]) if ok.any() else 1)
    return _hand_plan(cluster, sizes, micro, [1.0 / n] * n, memory_fraction, root_resident)


def _oom_note(plan: Plan, pred: Prediction) -> str:
    over: dict[str, list[int]] = {}
    for r, p in zip(plan.ranks, pred.ranks):
        if not p.fits:
            over.setdefault(r.device, []).append(r.rank)
    return "out of memory: " + ", ".join(f"{dev} (ranks {', '.join(map(str, ranks))})"
                                         for dev, ranks in over.items())


def compare_plans(cluster: ClusterProfile, global_batch_size: int,
                  memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                  peak_flops: Sequence[float] | None = None,
                  allow_idle: bool = True, root_resident: bool = False) -> list[PlanComparison]:
    """Build and predict every plan of ``BASELINES`` (in that order) for one global batch size.

    Args:
        cluster: profiles (measured or spec-sheet).
        global_batch_size: B, samples per iteration.
        memory_fraction: c, the cap fraction used to build plans and mark out-of-memory ones.
        peak_flops: per-rank peak FLOP/s for the speed-proportional baseline; None leaves
            that row without a plan (note says why).
        allow_idle: passed to ``optimize`` for the Cephalo plan.
        root_resident: every plan is priced (and the Cephalo plan made) for the engine's
            ``root_resident=True``; False (default) for the split root.

    Returns:
        One PlanComparison per baseline; a plan over a cap has ``fits == False`` and a note
        naming the GPU types and ranks out of memory; an infeasible Cephalo problem has
        ``plan is None`` and the optimizer's message as note.

    Raises:
        ValueError: B < 1, memory_fraction outside (0, 1], bad peak_flops.
    """
    rr = {"root_resident": root_resident}
    builders = {
        "even": lambda: even_split_plan(cluster, global_batch_size, memory_fraction, **rr),
        "compute_balance": lambda: compute_balance_plan(cluster, global_batch_size,
                                                        memory_fraction, **rr),
        "memory_balance": lambda: memory_balance_plan(cluster, global_batch_size,
                                                      memory_fraction, **rr),
        "speed_proportional": None if peak_flops is None else (
            lambda: speed_proportional_plan(cluster, global_batch_size, peak_flops,
                                            memory_fraction, **rr)),
        "cephalo": lambda: optimize(cluster, global_batch_size, memory_fraction,
                                    allow_idle=allow_idle, **rr),
    }
    out = []
    for name in BASELINES:
        build = builders[name]
        if build is None:
            out.append(PlanComparison(name, BASELINE_LABELS[name], None, None,
                                      "no peak FLOP/s for these devices"))
            continue
        try:
            plan = build()
        except InfeasiblePlanError as e:
            out.append(PlanComparison(name, BASELINE_LABELS[name], None, None, f"infeasible: {e}"))
            continue
        pred = predict(plan, cluster)
        out.append(PlanComparison(name, BASELINE_LABELS[name], plan, pred,
                                  "" if pred.fits else _oom_note(plan, pred)))
    return out


# --- report: table and plot ------------------------------------------------------------------
def _device_types(cluster: ClusterProfile) -> list[str]:
    return list(dict.fromkeys(d.name for d in cluster.devices))


def format_comparison_table(cluster: ClusterProfile, rows: Sequence[PlanComparison]) -> str:
    """Text table: throughput, iteration time, speedup over the even split, status, and per
    GPU type the largest memory of its ranks (GiB, ``!`` over the cap) with that rank's b/m."""
    types = _device_types(cluster)
    even = next((r for r in rows if r.name == "even" and r.prediction is not None), None)
    cells = [f"{t} ≤{_cap_gib(cluster, t, rows):.1f}" for t in types]
    width = [max(12, len(c)) for c in cells]
    head = (f"{'plan':<26} {'samples/s':>9} {'iter (s)':>9} {'vs even':>8}  "
            + "  ".join(f"{c:>{w}}" for c, w in zip(cells, width)) + "  status")
    lines = [head, "-" * len(head)]
    for row in rows:
        if row.prediction is None:
            lines.append(f"{row.label:<26} {'-':>9} {'-':>9} {'-':>8}  "
                         + "  ".join(f"{'-':>{w}}" for w in width) + f"  {row.note}")
            continue
        pred, plan = row.prediction, row.plan
        speedup = (f"{pred.samples_per_s / even.prediction.samples_per_s:7.2f}x"
                   if even is not None else f"{'-':>8}")
        mem = []
        for t, w in zip(types, width):
            k = _fullest_rank_of_type(plan, pred, t)
            p, r = pred.ranks[k], plan.ranks[k]
            mark = "!" if not p.fits else " "
            cell = f"{p.memory_bytes / GIB:.1f}{mark} {r.batch_size}/{r.microbatch_size}"
            mem.append(f"{cell:>{w}}")
        status = "ok" if row.fits else row.note
        lines.append(f"{row.label:<26} {pred.samples_per_s:>9.2f} {pred.iteration_s:>9.2f} "
                     f"{speedup}  " + "  ".join(mem) + f"  {status}")
    return "\n".join(lines)


def _cap_gib(cluster: ClusterProfile, device: str, rows: Sequence[PlanComparison]) -> float:
    """c·C of a device type in GiB, c taken from the first plan (or the default)."""
    c = next((r.plan.memory_fraction for r in rows if r.plan is not None),
             cost.DEFAULT_MEMORY_FRACTION)
    cap = next(d.memory_capacity_bytes for d in cluster.devices if d.name == device)
    return c * cap / GIB


def _fullest_rank_of_type(plan: Plan, pred: Prediction, device: str) -> int:
    """The rank of GPU type ``device`` with the most predicted memory (table and plot cells)."""
    return max((i for i, r in enumerate(plan.ranks) if r.device == device),
               key=lambda i: pred.ranks[i].memory_bytes)


def comparison_figure(results: Mapping[int, Sequence[PlanComparison]], title: str = ""):
    """The figure of ``hf-cephalo simulate --plot`` (matplotlib imported lazily; no file).

    Top panel, one global batch size: a bar per plan, out-of-memory bars hatched and labelled;
    several: samples/s against B, one line per plan, out-of-memory points drawn as crosses.
    Bottom panel (the memory model, ``predict``), one B: per plan and GPU type the predicted
    peak memory of the type's fullest rank (GiB, as the table's cells) with that rank's usable
    cap c·C_i as a black marker; several B: per plan the largest memory / cap over the ranks
    against B, with the cap (1.0) as a line.

    Returns:
        A ``matplotlib.figure.Figure`` (not registered with pyplot) with two axes, throughput
        then memory. One B: the memory axis holds one bar container per GPU type labelled with
        the type and one line labelled ``"usable cap c·C_i"`` (GiB, plans without a plan left
        out). Several B: one line per plan labelled with its label.
    """
    from matplotlib.figure import Figure

    sizes = sorted(results)
    fig = Figure(figsize=(7.5, 7.0))
    ax, mem = fig.subplots(2, 1)
    if len(sizes) == 1:
        rows = results[sizes[0]]
        xs = np.arange(len(rows))
        for x, row in zip(xs, rows):
            v = 0.0 if row.prediction is None else row.samples_per_s
            ax.bar(x, v, 0.6, color="C0" if row.fits else "lightgray",
                   hatch=None if row.fits else "//", edgecolor="black")
            if not row.fits:
                ax.text(x, v, "OOM" if row.prediction is not None else "no plan",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [r.label for r in rows], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("predicted samples/s")
        ax.set_title(title or f"global batch size {sizes[0]}")
        _memory_by_type_panel(mem, rows)
    else:
        for k, name in enumerate(BASELINES):
            pts = [(b, r) for b in sizes for r in results[b] if r.name == name]
            if not any(r.prediction is not None for _, r in pts):
                continue
            ok = [(b, r.samples_per_s) for b, r in pts if r.fits]
            oom = [(b, r.samples_per_s) for b, r in pts if r.prediction is not None and not r.fits]
            label = pts[0][1].label
            # Plans often coincide (e.g. Cephalo = compute balance while it fits): distinct
            # markers and line styles keep every line visible.
            ax.plot([b for b, _ in ok], [v for _, v in ok], color=f"C{k}", label=label,
                    marker="os^Dv"[k % 5], linestyle=("-", "--", ":", "-.")[k % 4], alpha=0.85)
            if oom:
                ax.plot([b for b, _ in oom], [v for _, v in oom], "x", color=f"C{k}",
                        markersize=9, label=f"{label}: out of memory")
            have = [(b, r) for b, r in pts if r.prediction is not None]
            mem.plot([b for b, _ in have],
                     [max(p.memory_bytes / p.cap_bytes for p in r.prediction.ranks)
                      for _, r in have],
                     color=f"C{k}", label=label, marker="os^Dv"[k % 5],
                     linestyle=("-", "--", ":", "-.")[k % 4], alpha=0.85)
        ax.set_xlabel("global batch size")
        ax.set_ylabel("predicted samples/s")
        ax.set_title(title)
        ax.legend(fontsize=7)
        mem.axhline(1.0, color="black", linewidth=1.5, label="usable cap c·C_i")
        mem.set_xlabel("global batch size")
        mem.set_ylabel("peak memory / cap\n(fullest rank)")
        mem.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _memory_by_type_panel(ax, rows: Sequence[PlanComparison]) -> None:
    """Grouped bars: per plan (group) and GPU type (bar) the fullest rank's memory in GiB,
    hatched over its cap, with its cap c·C_i as a marker."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    types = list(dict.fromkeys(r.device for row in rows if row.plan is not None
                               for r in row.plan.ranks))
    width = 0.8 / max(1, len(types))
    caps_x, caps = [], []
    for j, t in enumerate(types):
        xs, used, over = [], [], []
        for x, row in enumerate(rows):
            if row.prediction is None:
                continue
            p = row.prediction.ranks[_fullest_rank_of_type(row.plan, row.prediction, t)]
            xs.append(x - 0.4 + (j + 0.5) * width)
            used.append(p.memory_bytes / GIB)
            over.append(not p.fits)
            caps_x.append(xs[-1])
            caps.append(p.cap_bytes / GIB)
        ax.bar(xs, used, width, label=t, color=f"C{j}", edgecolor="black",
               hatch=["//" if o else None for o in over])
    ax.plot(caps_x, caps, linestyle="none", marker="_", markersize=max(6.0, 40.0 * width),
            markeredgewidth=2.5, color="black", label="usable cap c·C_i")
    ax.set_xticks(np.arange(len(rows)), [r.label for r in rows], rotation=20, ha="right",
                  fontsize=8)
    if caps:
        ax.set_ylim(0, 1.3 * max(max(caps), max(p.memory_bytes for row in rows
                                                 if row.prediction is not None
                                                 for p in row.prediction.ranks) / GIB))
    ax.set_ylabel("GiB")
    ax.set_title("predicted peak memory of each GPU type's fullest rank", fontsize=9)
    # legend from plain patches: a bar container's entry takes its first bar's hatch
    handles = [Line2D([], [], color="black", linewidth=2.5, label="usable cap c·C_i")]
    handles += [Patch(facecolor=f"C{j}", edgecolor="black", label=t) for j, t in enumerate(types)]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="over its cap"))
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center")


def plot_comparison(results: Mapping[int, Sequence[PlanComparison]], path: str,
                    title: str = "") -> None:
    """Write ``comparison_figure(results, title)`` to ``path`` (format from its extension)."""
    comparison_figure(results, title).savefig(path, dpi=120)


def format_sweep_table(results: Mapping[int, Sequence[PlanComparison]]) -> str:
    """Samples/s of every plan (rows) at every global batch size (columns); ``OOM`` marks a
    plan over a memory cap (its would-be throughput in parentheses), ``-`` a missing plan."""
    sizes = sorted(results)
    head = f"{'plan':<26}" + "".join(f"{f'B={b}':>15}" for b in sizes)
    lines = [head, "-" * len(head)]
    for name in BASELINES:
        cells = []
        label = BASELINE_LABELS[name]
        for b in sizes:
            row = next(r for r in results[b] if r.name == name)
            if row.prediction is None:
                cells.append(f"{'-':>15}")
            elif row.fits:
                cells.append(f"{row.samples_per_s:>15.2f}")
            else:
                cells.append(f"{f'OOM ({row.samples_per_s:.2f})':>15}")
        lines.append(f"{label:<26}" + "".join(cells))
    return "\n".join(lines)


def extrapolation_note(plan: Plan, cluster: ClusterProfile) -> str | None:
    """A note naming the ranks whose microbatch size m_i lies beyond their profiled microbatch
    sizes (their times and memory are extrapolated: linear fits, planner/cost.py, paper §2.4),
    or None when every m_i was profiled or interpolated.

    Also None for a spec-sheet estimate (``cluster.source != "measured"``): its times and
    memory are linear in m by construction (profiles/specs.py), so the linear extrapolation is
    exactly the estimate's own formula, and the advice to measure larger microbatches with
    ``hf-cephalo profile`` would be wrong where no GPU is at hand (``hf-cephalo plan`` prints
    that measured profiles replace spec-sheet estimates).
    """
    if cluster.source != "measured":
        return None
    # profiled rows; a microbatch of m samples is k·m rows (planner/rows.py)
    profiled = [max(d.microbatch_sizes) for d in cluster.devices]
    rows = [d.rows_per_sample for d in cluster.devices]
    beyond = [(r.rank, r.microbatch_size, profiled[r.rank], rows[r.rank]) for r in plan.ranks
              if r.batch_size > 0 and r.microbatch_size * rows[r.rank] > profiled[r.rank]]
    if not beyond:
        return None
    ranks = ", ".join(f"rank {i} m={m} (profiled up to {top})" if k == 1 else
                      f"rank {i} m={m} ({k * m} rows, profiled up to {top} rows)"
                      for i, m, top, k in beyond)
    return (f"note: {ranks}: beyond the profiled microbatch sizes, so its times and memory are "
            "extrapolated (linear fit, paper §2.4); to measure them, profile with "
            "hf-cephalo profile --max-microbatch-size N (or HF_CEPHALO_PROFILE_MAX_MICROBATCH_SIZE)")
