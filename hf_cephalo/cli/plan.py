"""``hf-cephalo plan``: choose per-rank batch, microbatch and state share (exact optimizer).

Prints the per-rank table (``format_plan_table``: b_i, m_i, l_i, r_i, predicted memory against
each cap, unit time), the state sharding, the activation checkpointing mode and the predicted
iteration time; writes the plan JSON (``--out``), the cluster profile (``--save-profile``) and
a plot (``--plot``, ``plan_figure``). An infeasible plan's error gets the flags that relax its
binding constraint (``_infeasible_remedy``).
"""

from __future__ import annotations

import argparse

from hf_cephalo.cli.arguments import (DEFAULT_PRECISION, add_cluster_source_arguments,
                                      check_common_plan_options, checkpointing_arg,
                                      checkpointing_word, precision_arg)
from hf_cephalo.cli.cluster import auto_precision_plan, load_cluster, spec_cluster
from hf_cephalo.planner.types import (ACTIVATION_CHECKPOINTING_CHOICES,
                                      DEFAULT_MEMORY_FRACTION, activation_checkpointing_mode)

__all__ = ["add_plan_arguments", "run_plan", "even_split_line", "format_plan_table",
           "plan_figure", "plot_plan"]


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_source_arguments(p, "llama-3b")
    p.add_argument("--global-batch-size", "-B", type=int, required=True,
                   help="B, samples per iteration over all ranks")
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="c, fraction of each GPU's memory the plan may use (default "
                        f"{DEFAULT_MEMORY_FRACTION})")
    p.add_argument("--no-idle", action="store_true",
                   help="require every rank to process at least one sample (b_i >= 1)")
    p.add_argument("--precision", type=precision_arg, default=None,
                   help=f"peak FLOP/s column for --cluster estimates: fp32, bf16, fp16 (every "
                        f"rank), auto (each GPU its fastest: bf16 > fp16 > fp32) or a per-rank "
                        f"list such as bf16,fp16,fp32 (default {DEFAULT_PRECISION}; not with "
                        "--profile); the plan records each rank's precision")
    p.add_argument("--activation-checkpointing", type=checkpointing_word,
                   choices=ACTIVATION_CHECKPOINTING_CHOICES, default="true",
                   help="true (default): the engine recomputes each unit's forward in its "
                        "backward (the paper's schedule); false: it keeps every microbatch's "
                        "forward graph (no recompute, ~1/4 less compute, activation memory "
                        "grows with layers x microbatches; needs a profile with "
                        "kept_graph_bytes); auto: plan both, keep the faster one that fits "
                        "(any case: True works). "
                        "Recorded in the plan; the trainer builds the engine with it")
    p.add_argument("--scoring-passes", type=float, default=0.0, metavar="K",
                   help="K forward-only passes over the same split per optimizer step (a GRPO / "
                        "RLOO step's old-policy and reference log-probabilities; a fraction when "
                        "a generation round feeds several steps): the plan minimizes the "
                        "training step plus K passes (default 0: the training step alone; not "
                        "with --precision auto)")
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--save-profile", help="write the (estimated) cluster profile JSON here")
    p.add_argument("--plot", help="write a plot (file name ending in .png, .pdf, .svg, ...): "
                                  "per-GPU batch share and state share, and predicted peak memory "
                                  "against each GPU's usable cap c·C_i (GiB)")


def run_plan(args: argparse.Namespace) -> int:
    from hf_cephalo.planner.optimize import (InfeasiblePlanError, optimize,
                                             optimize_auto_checkpointing)
    from hf_cephalo.planner.generation import forward_pass_s
    from hf_cephalo.planner.simulate import extrapolation_note, predict
    from hf_cephalo.profiles.types import format_bytes

    check_common_plan_options(args, ("out", "save_profile", "plot"))
    k = _scoring_passes(args)
    cluster = load_cluster(args)
    auto = args.precision == "auto" and not args.profile  # the profile of the chosen policy
    if args.save_profile and not auto:
        cluster.save(args.save_profile)
    try:
        if auto:
            cluster, plan = auto_precision_plan(args, spec_cluster(args), args.global_batch_size)
            reason = _auto_precision_checkpointing_reason(args, cluster)
        elif checkpointing_arg(args) is None:  # auto: keep why, for the mode's line
            plan, reason = optimize_auto_checkpointing(
                cluster, args.global_batch_size, args.memory_fraction,
                allow_idle=not args.no_idle, root_resident=args.root_resident, scoring_passes=k)
        else:
            reason = ""
            plan = optimize(cluster, args.global_batch_size, args.memory_fraction,
                            allow_idle=not args.no_idle, root_resident=args.root_resident,
                            activation_checkpointing=checkpointing_arg(args), scoring_passes=k)
    except InfeasiblePlanError as e:
        raise InfeasiblePlanError(f"{e}{_infeasible_remedy(args, cluster, e.constraint)}",
                                  e.constraint) from None
    if args.save_profile and auto:
        cluster.save(args.save_profile)
    pred = predict(plan, cluster)
    print(f"profile: {cluster.source}, model {cluster.model.name}, "
          f"{cluster.world_size} ranks, training state {format_bytes(cluster.model.state_bytes)}")
    if cluster.source != "measured":
        print("note: spec-sheet estimates; measured profiles (hf-cephalo profile) replace them")
    print(format_plan_table(plan, pred))
    note = extrapolation_note(plan, cluster)
    if note:
        print(note)
    print(f"state sharding: {'uneven' if plan.uneven_state else 'even'}")
    print("activation checkpointing: "
          + activation_checkpointing_mode(plan.activation_checkpointing, reason))
    print(f"predicted iteration time: {pred.iteration_s:.3f} s, "
          f"{pred.samples_per_s:.2f} samples/s")
    if k:
        one = forward_pass_s(plan, cluster)
        print(f"with {k:g} forward-only scoring pass(es) per step ({one:.3f} s each): "
              f"{pred.iteration_s + k * one:.3f} s predicted per step, what this plan minimizes")
    print(even_split_line(cluster, plan, pred))
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if args.plot:
        plot_plan(plan, pred, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _scoring_passes(args: argparse.Namespace) -> float:
    """``--scoring-passes`` checked before anything is read or solved.

    Raises ValueError (the CLI's ``error: ...``, exit status 2): K negative or not finite,
    or given with ``--precision auto`` (whose choice compares training steps only)."""
    k = args.scoring_passes
    if not (k >= 0 and k != float("inf")):  # also refuses nan
        raise ValueError(f"--scoring-passes {k}: must be a finite number >= 0 (forward-only "
                         "passes per optimizer step)")
    if k and args.precision == "auto" and not args.profile:
        raise ValueError("--scoring-passes with --precision auto: the precision choice compares "
                         "training steps only; give a precision (fp32, bf16, fp16 or a list)")
    return k


def even_split_line(cluster, plan, prediction) -> str:
    """The plan's predicted speed-up over FSDP's even split of the same batch on the same
    cluster (``planner.simulate.even_split_plan``: b_i = B/N, r_i = 1/N, the fastest common
    microbatch that fits), or why there is none (the even split does not fit)."""
    from hf_cephalo.planner.simulate import even_split_plan, predict

    even = even_split_plan(cluster, plan.global_batch_size, plan.memory_fraction,
                           root_resident=plan.root_resident)
    even_pred = predict(even, cluster)
    if not even_pred.fits:
        over = sorted({r.device for r, p in zip(even.ranks, even_pred.ranks) if not p.fits})
        return (f"even split (b_i = B/N, r_i = 1/N): does not fit ({', '.join(over)} over the "
                f"cap), so no speed-up is defined; this plan is what makes the job run")
    speedup = prediction.samples_per_s / even_pred.samples_per_s
    return (f"predicted speed-up over an even split: {speedup:.2f}x (even split: "
            f"{even_pred.iteration_s:.3f} s, "
            f"{even_pred.samples_per_s:.2f} samples/s)")


def format_plan_table(plan, prediction) -> str:
    """The per-rank table printed by ``hf-cephalo plan``; columns are sized to their values."""
    from hf_cephalo.profiles.types import format_bytes

    mems = [f"{format_bytes(p.memory_bytes)} / {format_bytes(p.cap_bytes)}"
            for p in prediction.ranks]
    names = [r.device if r.precision is None else f"{r.device} [{r.precision}]"
             for r in plan.ranks]  # precision per rank: shown beside the device
    wd = max([len("device")] + [len(n) for n in names])
    wb = max([5] + [len(str(r.batch_size)) for r in plan.ranks])
    wm = max([len("memory used / cap")] + [len(m) for m in mems])
    head = (f"{'rank':>4}  {'device':<{wd}} {'b_i':>{wb}} {'m_i':>4} {'l_i':>4} {'r_i':>7}  "
            f"{'memory used / cap':>{wm}}  {'unit time (ms)':>14}")
    lines = [head, "-" * len(head)]
    for r, p, mem, name in zip(plan.ranks, prediction.ranks, mems, names):
        lines.append(f"{r.rank:>4}  {name:<{wd}} {r.batch_size:>{wb}} "
                     f"{r.microbatch_size:>4} {r.num_microbatches:>4} {r.state_ratio:>7.4f}  "
                     f"{mem:>{wm}}  {p.unit_time_s * 1e3:>14.2f}")
    return "\n".join(lines)


def plan_figure(plan, prediction):
    """The figure of ``hf-cephalo plan --plot`` (matplotlib imported lazily; no file written).

    Top panel: per rank, batch share b_i / B beside state share r_i. Bottom panel: per rank the
    predicted peak memory of the planner's memory model (``prediction.ranks[i].memory_bytes``
    = r_i·S + M_i, drawn stacked as state r_i·S and compute M_i) against the usable cap c·C_i
    (``cap_bytes``, the optimizer's constraint), a black marker, in GiB, with the share of the
    cap in use printed above each rank; a rank over its cap is drawn red.

    Args:
        plan: the Plan.
        prediction: ``predict(plan, cluster)``, one RankPrediction per rank of ``plan``.

    Returns:
        A ``matplotlib.figure.Figure`` (not registered with pyplot) with two axes, shares then
        memory; the memory axis holds bar containers labelled ``"state r_i·S"`` and
        ``"compute M_i"`` and a line labelled ``"usable cap c·C_i"`` (values in GiB).

    Raises:
        ValueError: ``prediction`` does not have one entry per rank of ``plan``.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    import numpy as np

    from hf_cephalo.units import GIB

    n = plan.world_size
    if len(prediction.ranks) != n:
        raise ValueError(f"prediction has {len(prediction.ranks)} ranks, the plan {n}; pass "
                         "predict(plan, cluster)")
    x = np.arange(n)
    fig = Figure(figsize=(max(6.0, 0.35 * n + 2), 6.0))
    share, mem = fig.subplots(2, 1, sharex=True)
    share.bar(x - 0.2, [b / plan.global_batch_size for b in plan.batch_sizes], 0.4,
              label="batch share b_i / B")
    share.bar(x + 0.2, plan.state_ratios, 0.4, label="state share r_i")
    share.set_ylim(0, 1.3 * max(max(plan.batch_sizes) / plan.global_batch_size,
                                max(plan.state_ratios)))  # headroom for the legend
    share.set_ylabel("fraction")
    share.set_title(f"Cephalo plan, B = {plan.global_batch_size}")
    share.legend(fontsize=8, ncol=2, loc="upper center")

    state = [p.memory_bytes / GIB - p.compute_memory_bytes / GIB for p in prediction.ranks]
    compute = [p.compute_memory_bytes / GIB for p in prediction.ranks]
    over = [not p.fits for p in prediction.ranks]
    mem.bar(x, state, 0.6, label="state r_i·S", color=["C3" if o else "C1" for o in over])
    mem.bar(x, compute, 0.6, bottom=state, label="compute M_i",
            color=["C3" if o else "C2" for o in over], alpha=0.6)
    marker_pt = max(8.0, 40.0 - n)  # about a bar's width
    mem.plot(x, [p.cap_bytes / GIB for p in prediction.ranks], linestyle="none", marker="_",
             markersize=marker_pt, markeredgewidth=2.5, color="black", label="usable cap c·C_i")
    top = max(max(p.memory_bytes, p.cap_bytes) for p in prediction.ranks) / GIB
    mem.set_ylim(0, 1.3 * top)  # headroom for the legend above the bars and caps
    # the share of each cap in use, printed: with caps of very different size (a 3 GiB cap
    # beside a 25 MB one) the small bars and markers are too flat to read. Offset in points
    # above the cap marker (half its 2.5 pt line + a gap), so the label never sits on it.
    for i, p in enumerate(prediction.ranks):
        mem.annotate(f"{p.memory_bytes / p.cap_bytes:.0%}" if p.cap_bytes > 0 else "",
                     (x[i], max(p.memory_bytes, p.cap_bytes) / GIB), xytext=(0, 4),
                     textcoords="offset points", ha="center", va="bottom",
                     fontsize=7 if n <= 16 else 5, rotation=0 if n <= 16 else 90)
    mem.set_ylabel("GiB")
    mem.set_title(f"predicted peak memory per GPU vs its cap (c = {plan.memory_fraction:g})",
                  fontsize=9)
    # legend from fixed-colour patches: a bar container's entry takes its first bar's colour,
    # red when rank 0 is over its cap
    handles = [Line2D([], [], color="black", linewidth=2.5, label="usable cap c·C_i"),
               Patch(color="C1", label="state r_i·S"),
               Patch(color="C2", alpha=0.6, label="compute M_i")]
    if any(over):
        handles.append(Patch(color="C3", label="over the cap"))
    mem.legend(handles=handles, fontsize=8, ncol=len(handles), loc="upper center")
    mem.set_xticks(x, [f"{r.rank}\n{r.device}" for r in plan.ranks],
                   fontsize=8 if n <= 16 else 5)
    fig.tight_layout()
    return fig


def plot_plan(plan, prediction, path: str) -> None:
    """Write ``plan_figure(plan, prediction)`` to ``path`` (format from its extension)."""
    plan_figure(plan, prediction).savefig(path, dpi=120)


def _half_precision_flag(cluster) -> str | None:
    """``--precision bf16`` when every device supports bf16, else ``--precision fp16`` when every
    device has an fp16 rate (V100, T4, P100, P40: no bf16), else None; devices without a
    spec-sheet entry (measured, emulated) do not restrict it."""
    from hf_cephalo.profiles.specs import get_gpu_spec

    specs = []
    for d in cluster.devices:
        try:
            specs.append(get_gpu_spec(d.name))
        except (KeyError, ValueError):
            continue
    if all(s.bf16_tflops is not None for s in specs):
        return "--precision bf16"
    if all(s.fp16_tflops is not None for s in specs):
        return "--precision fp16"
    return None


def _infeasible_remedy(args: argparse.Namespace, cluster, constraint: str) -> str:
    """The flags that relax an infeasible plan's binding constraint (``InfeasiblePlanError.
    constraint``), or "" where its message already says what to do."""
    if constraint == "idle":
        more = f", or -B >= {cluster.world_size}" if args.global_batch_size < cluster.world_size \
            else ""
        return f" (drop --no-idle{more})"
    if constraint not in ("device", "aggregate", "state", "batch"):
        return ""
    half = _half_precision_flag(cluster)
    if args.profile:
        smaller = (f"a profile measured with hf-cephalo profile {half or '--precision bf16'}, or "
                   "of the LoRA model")
    else:
        flags = [f for f, given in ((half, half is None or args.precision in ("bf16", "fp16")),
                                    ("--lora-rank R", args.lora_rank is not None)) if not given]
        smaller = " or ".join(flags) or "a smaller model"
    batch = "a smaller -B, " if constraint in ("aggregate", "batch") else ""
    if checkpointing_arg(args) is False:  # recompute instead of keeping every graph
        batch = "--activation-checkpointing true or auto, " + batch
    return (f"; to fit: {batch}a --memory-fraction closer to 1 (now {args.memory_fraction}), "
            f"less memory per GPU ({smaller}), or more GPUs")


def _auto_precision_checkpointing_reason(args: argparse.Namespace, cluster) -> str:
    """Why ``--activation-checkpointing auto`` beside ``--precision auto`` chose ("" without
    auto): that path plans through ``optimize``, so the reason is what it compared."""
    from hf_cephalo.planner.optimize import has_kept_graph_profile

    if checkpointing_arg(args) is not None:
        return ""
    if not has_kept_graph_profile(cluster):
        return ("the profile has no kept_graph_bytes (spec-sheet or older measurement), so "
                "only on was planned")
    return "the faster of both plans that fits"
