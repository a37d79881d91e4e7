"""``hf-cephalo`` command line. Subcommands live in one registry (``SUBCOMMANDS``).

Adding a subcommand (``profile``, ``simulate``, ``export``, ...)::

    from hf_cephalo.cli import register_subcommand
    register_subcommand("simulate", "predict a plan", add_arguments=_add, run=_run)

or add an entry to ``_BUILTIN`` below. ``run(args) -> int`` returns the exit status; a
``ValueError`` it raises is printed as ``error: ...`` with exit status 2 (bad user input); under
a launcher with several ranks (``torchrun ... -m hf_cephalo.cli profile``) only the first rank
with that message prints it, and the launcher's report names it (``rank_errors``).
Heavy imports (torch, matplotlib) happen inside ``run`` so ``hf-cephalo plan`` starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NamedTuple, Sequence

from hf_cephalo.planner.types import (ACTIVATION_CHECKPOINTING_CHOICES,
                                      activation_checkpointing_mode,
                                      activation_checkpointing_setting,
                                      parse_activation_checkpointing)

__all__ = ["main", "register_subcommand", "SUBCOMMANDS"]

DEFAULT_EFFICIENCY = 0.5  # --efficiency of spec-sheet estimates
DEFAULT_PRECISION = "fp32"  # --precision of spec-sheet estimates

class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(name: str, help: str, *, add_arguments, run) -> None:
    """Register ``hf-cephalo <name>``; ValueError if the name is taken."""
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} is already registered")
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


# --- plan ------------------------------------------------------------------------------------
def _add_cluster_source_arguments(p: argparse.ArgumentParser, model_example: str) -> None:
    """--profile | --cluster (+ --model, --efficiency): where ``_load_cluster`` gets the
    cluster profile."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="measured cluster profile JSON (docs/profiles.md)")
    src.add_argument("--cluster", help="cluster YAML of GPU types per machine (spec-sheet "
                                       "estimate; needs --model)")
    p.add_argument("--model", help=f"model shape for --cluster, e.g. {model_example} "
                                   f"(see docs/planner.md)")
    p.add_argument("--efficiency", type=float, default=None,
                   help=f"assumed fraction of peak FLOP/s for --cluster estimates (default "
                        f"{DEFAULT_EFFICIENCY}; not with --profile)")
    p.add_argument("--root-resident", action="store_true",
                   help="price the engine keeping its embedding and head units gathered with "
                        "their gradients all step (CephaloEngine root_resident=True; recorded "
                        "in the plan, the trainer builds the engine with it) instead of the "
                        "default split root, gathered around its uses")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="with --cluster: plan LoRA fine-tuning of rank r instead of full "
                        "fine-tuning (only the adapter carries gradient and optimizer state)")
    p.add_argument("--lora-targets", nargs="+", default=["q", "v"],
                   help="attention projections LoRA adapts, of q k v o (default: q v)")
    p.add_argument("--frozen-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="storage of the frozen base with --lora-rank: fp32 (4 B) or bf16 (2 B; "
                        "the engine keeps a bf16 base beside fp32 adapters, each sharded by r_i)")


def _precision_arg(value: str) -> str:
    """``--precision``: fp32 / bf16 / fp16, ``auto`` or a comma list of those (one per rank;
    its length is checked against the cluster)."""
    names = value.replace(",", " ").split()
    if value != "auto" and (not names or any(n not in ("fp32", "bf16", "fp16") for n in names)):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give fp32, bf16, fp16, auto, or one of those per rank (bf16,fp16,fp32)")
    return value


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    _add_cluster_source_arguments(p, "llama-3b")
    p.add_argument("--global-batch-size", "-B", type=int, required=True,
                   help="B, samples per iteration over all ranks")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="c, fraction of each GPU's memory the plan may use (default 0.8)")
    p.add_argument("--no-idle", action="store_true",
                   help="require every rank to process at least one sample (b_i >= 1)")
    p.add_argument("--precision", type=_precision_arg, default=None,
                   help=f"peak FLOP/s column for --cluster estimates: fp32, bf16, fp16 (every "
                        f"rank), auto (each GPU its fastest: bf16 > fp16 > fp32) or a per-rank "
                        f"list such as bf16,fp16,fp32 (default {DEFAULT_PRECISION}; not with "
                        "--profile); the plan records each rank's precision")
    p.add_argument("--activation-checkpointing", type=_checkpointing_word,
                   choices=ACTIVATION_CHECKPOINTING_CHOICES, default="true",
                   help="true (default): the engine recomputes each unit's forward in its "
                        "backward (the paper's schedule); false: it keeps every microbatch's "
                        "forward graph (no recompute, ~1/4 less compute, activation memory "
                        "grows with layers x microbatches; needs a profile with "
                        "kept_graph_bytes); auto: plan both, keep the faster one that fits "
                        "(any case: True works). "
                        "Recorded in the plan; the trainer builds the engine with it")
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--save-profile", help="write the (estimated) cluster profile JSON here")
    p.add_argument("--plot", help="write a plot (file name ending in .png, .pdf, .svg, ...): "
                                  "per-GPU batch share and state share, and predicted peak memory "
                                  "against each GPU's usable cap c·C_i (GiB)")


def _require_matplotlib(flag: str = "--plot") -> None:
    """ValueError with the install hint when matplotlib is missing (checked before solving)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib, which is not installed; "
                         "pip install 'hf-cephalo[plot]' (or drop --plot)") from None


def _check_input_file(path: str, flag: str, what: str) -> None:
    """ValueError unless ``path`` is an existing, readable file (not a directory)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give the {what} file inside it")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path!r} does not exist; give the path of a {what} file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path!r} is not readable; check its permissions")


def _check_output_file(path: str, flag: str, example: str) -> None:
    """ValueError unless a file can be written at ``path``: not a directory, in an existing
    writable directory (checked before any solving, measuring or printing)."""
    if not path or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path such as "
                         f"{os.path.join(path or '.', example)!r}")
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{flag} {path!r}: directory {out_dir!r} does not exist; create it or "
                         "give another path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path!r} exists and is not writable; give another path")
    elif not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: directory {out_dir!r} is not writable; give "
                         "another path")


def _plot_formats() -> list[str]:
    """File extensions matplotlib writes without extra tools (pgf needs LaTeX)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def _check_plot_path(path: str, flag: str = "--plot", example: str = "plot.png") -> None:
    """matplotlib installed, ``path`` a writable file whose extension names a format matplotlib
    writes (it would otherwise append '.png' and write elsewhere); before any solving."""
    _require_matplotlib(flag)
    _check_output_file(path, flag, example)
    ext = os.path.splitext(path)[1][1:].lower()
    formats = _plot_formats()
    if ext not in formats:
        stem = os.path.splitext(path)[0] if ext else path
        raise ValueError(f"{flag} {path!r}: the file name must end in an image format matplotlib "
                         f"writes ({', '.join('.' + f for f in formats)}), e.g. {stem + '.png'!r}")


def _check_distinct_paths(args: argparse.Namespace, outputs: Sequence[str],
                          inputs: Sequence[str] = ("profile", "cluster")) -> None:
    """Refuse two outputs at one path, or an output that would overwrite an input file."""
    seen: dict[str, str] = {}
    for name in list(inputs) + list(outputs):
        path = getattr(args, name, None)
        if not path:
            continue
        key = os.path.realpath(path)
        flag = "--" + name.replace("_", "-")
        if key in seen:
            raise ValueError(f"{flag} {path!r} is the same file as {seen[key]}; give separate "
                             "paths")
        seen[key] = f"{flag} {path!r}" + (" (an input)" if name in inputs else "")


def _check_fraction(value: float | None, flag: str, what: str, note: str) -> None:
    if value is not None and not 0 < value <= 1:  # also refuses nan
        raise ValueError(f"{flag} {value}: {what} must be in (0, 1] ({note})")


def _check_common_plan_options(args: argparse.Namespace, outputs: Sequence[str]) -> None:
    """Checks shared by plan and simulate, all before reading, solving or printing anything."""
    _check_fraction(args.memory_fraction, "--memory-fraction", "memory fraction",
                    "the share of each GPU's memory a plan may use; default 0.8")
    _check_fraction(args.efficiency, "--efficiency", "efficiency",
                    f"the assumed share of peak FLOP/s; default {DEFAULT_EFFICIENCY}")
    if args.profile:
        _check_input_file(args.profile, "--profile", "cluster profile JSON")
    else:
        _check_input_file(args.cluster, "--cluster", "cluster YAML")
    for name in outputs:
        path = getattr(args, name)
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "plot":
            _check_plot_path(path, flag)
        else:
            example = "profile.json" if name == "save_profile" else "plan.json"
            _check_output_file(path, flag, example)
    _check_distinct_paths(args, outputs)


def _load_cluster(args: argparse.Namespace, *, precision_applies_to_profile: bool = False):
    """The cluster profile of ``--profile``, or the spec-sheet estimate of ``--cluster``.

    ``--efficiency`` (and ``--precision``, unless the caller uses it for something else) only
    shape spec-sheet estimates: given explicitly with ``--profile`` they are refused rather
    than silently ignored.
    """
    if args.profile:
        from hf_cephalo.profiles.types import ClusterProfile

        if getattr(args, "lora_rank", None) is not None:
            raise ValueError(f"--lora-rank {args.lora_rank} applies only to --cluster estimates; "
                             f"the profile {args.profile} already fixes the model (profile the "
                             "PeftModel as it will train: hf-cephalo profile / CephaloTrainer)")
        if args.model:
            raise ValueError(f"--model {args.model} applies only to --cluster estimates; the "
                             f"profile {args.profile} already fixes the model (drop --model, or "
                             "use --cluster with --model)")
        ignored = [f"--efficiency {args.efficiency}"] if args.efficiency is not None else []
        if args.precision is not None and not precision_applies_to_profile:
            ignored.append(f"--precision {args.precision}")
        if ignored:
            raise ValueError(f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'}"
                             f" only to --cluster spec-sheet estimates; the profile "
                             f"{args.profile} already holds each GPU's times (drop "
                             f"{' and '.join(f.split()[0] for f in ignored)}, or use --cluster "
                             "with --model)")
        return ClusterProfile.load(args.profile)
    if not args.model:
        raise ValueError("--cluster needs --model (one of the shapes in docs/planner.md, "
                         "e.g. --model llama-3b)")
    from hf_cephalo.profiles.specs import estimate_cluster_profile, load_cluster_yaml

    return _apply_lora(estimate_cluster_profile(load_cluster_yaml(args.cluster), args.model,
                                                **_estimate_options(args)), args)


def _spec_cluster(args: argparse.Namespace):
    """The ClusterSpec of ``--cluster`` (restricted to ``--gpu-types`` where given)."""
    from hf_cephalo.profiles.specs import load_cluster_yaml

    if getattr(args, "gpu_types", None):
        return _restrict_gpu_types(args)
    return load_cluster_yaml(args.cluster)


def _auto_precision_plan(args: argparse.Namespace, spec, global_batch_size: int):
    """``--precision auto`` on a spec-sheet cluster: (profile, plan) of the precision policy
    with the shortest predicted iteration (``planner.precision.choose_precision``: each
    precision every GPU runs, and each GPU's fastest); prints the candidates' samples/s."""
    from hf_cephalo.planner.optimize import optimize
    from hf_cephalo.planner.precision import choose_precision, precision_candidates
    from hf_cephalo.profiles.specs import estimate_cluster_profile, spec_precisions

    def plan_for(precisions):
        options = dict(_estimate_options(args), precision=precisions)
        cluster = _apply_lora(estimate_cluster_profile(spec, args.model, **options), args)
        return cluster, optimize(cluster, global_batch_size, args.memory_fraction,
                                 allow_idle=not args.no_idle, root_resident=args.root_resident,
                                 activation_checkpointing=_checkpointing_arg(args))

    choice = choose_precision(precision_candidates([spec_precisions(g) for g in spec.gpus]),
                              plan_for)
    rates = ", ".join(f"{label} {global_batch_size / t:.2f}" if t else f"{label} infeasible"
                      for label, t in choice.predicted_s.items())
    runs = []  # rank order, consecutive equal precisions grouped: "bf16 x3, fp32 x3, fp16 x2"
    for p in choice.precisions:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    print(f"precision auto (B = {global_batch_size}): {choice.label} "
          f"[{', '.join(f'{p} x{n}' for p, n in runs)}]; predicted samples/s per policy: {rates}")
    return plan_for(choice.precisions)[0], choice.plan


def _apply_lora(cluster, args: argparse.Namespace):
    """The spec-sheet cluster with its model as ``--lora-rank`` trains it (unchanged without)."""
    if getattr(args, "lora_rank", None) is None:
        return cluster
    from dataclasses import replace

    from hf_cephalo.profiles.specs import get_model_shape, lora_model_profile

    frozen = 2.0 if args.frozen_dtype == "bf16" else 4.0
    model = lora_model_profile(cluster.model, get_model_shape(args.model), args.lora_rank,
                               tuple(args.lora_targets), frozen)
    return replace(cluster, model=model)


def _estimate_options(args: argparse.Namespace) -> dict:
    """efficiency and precision of spec-sheet estimates, the defaults where not given."""
    return {"efficiency": DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency,
            "precision": args.precision or DEFAULT_PRECISION}


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
    if _checkpointing_arg(args) is False:  # recompute instead of keeping every graph
        batch = "--activation-checkpointing true or auto, " + batch
    return (f"; to fit: {batch}a --memory-fraction closer to 1 (now {args.memory_fraction}), "
            f"less memory per GPU ({smaller}), or more GPUs")


def _checkpointing_word(value: str) -> str:
    """argparse ``type`` of ``--activation-checkpointing``: the one parser of the choice
    (``planner.types.parse_activation_checkpointing``, any case), its message on a bad value."""
    try:
        return parse_activation_checkpointing(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _checkpointing_arg(args: argparse.Namespace) -> bool | None:
    """``--activation-checkpointing`` as ``optimize``'s argument (None: auto)."""
    return activation_checkpointing_setting(getattr(args, "activation_checkpointing", "true"))


def _auto_precision_checkpointing_reason(args: argparse.Namespace, cluster) -> str:
    """Why ``--activation-checkpointing auto`` beside ``--precision auto`` chose ("" without
    auto): that path plans through ``optimize``, so the reason is what it compared."""
    from hf_cephalo.planner.optimize import has_kept_graph_profile

    if _checkpointing_arg(args) is not None:
        return ""
    if not has_kept_graph_profile(cluster):
        return ("the profile has no kept_graph_bytes (spec-sheet or older measurement), so "
                "only on was planned")
    return "the faster of both plans that fits"


def _run_plan(args: argparse.Namespace) -> int:
    from hf_cephalo.planner.optimize import (InfeasiblePlanError, optimize,
                                             optimize_auto_checkpointing)
    from hf_cephalo.planner.simulate import extrapolation_note, predict
    from hf_cephalo.profiles.types import format_bytes

    _check_common_plan_options(args, ("out", "save_profile", "plot"))
    cluster = _load_cluster(args)
    auto = args.precision == "auto" and not args.profile  # the profile of the chosen policy
    if args.save_profile and not auto:
        cluster.save(args.save_profile)
    try:
        if auto:
            cluster, plan = _auto_precision_plan(args, _spec_cluster(args), args.global_batch_size)
            reason = _auto_precision_checkpointing_reason(args, cluster)
        elif _checkpointing_arg(args) is None:  # auto: keep why, for the mode's line
            plan, reason = optimize_auto_checkpointing(
                cluster, args.global_batch_size, args.memory_fraction,
                allow_idle=not args.no_idle, root_resident=args.root_resident)
        else:
            reason = ""
            plan = optimize(cluster, args.global_batch_size, args.memory_fraction,
                            allow_idle=not args.no_idle, root_resident=args.root_resident,
                            activation_checkpointing=_checkpointing_arg(args))
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
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if args.plot:
        plot_plan(plan, pred, args.plot)
        print(f"plot written to {args.plot}")
    return 0


# --- simulate --------------------------------------------------------------------------------
def _add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    _add_cluster_source_arguments(p, "llama-7b")
    p.add_argument("--global-batch-size", "-B", type=int, nargs="+", required=True,
                   help="B, samples per iteration; several values compare plans across B")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="c, fraction of each GPU's memory a plan may use (default 0.8)")
    p.add_argument("--gpu-types", nargs="+",
                   help="with --cluster: keep only the machines of these GPU types")
    p.add_argument("--no-idle", action="store_true",
                   help="Cephalo plan: every rank processes at least one sample (b_i >= 1)")
    p.add_argument("--precision", type=_precision_arg, default=None,
                   help=f"peak FLOP/s column for estimates and batch-proportional: fp32, bf16, "
                        f"fp16, auto (each GPU its fastest) or a per-rank list such as "
                        f"bf16,fp16,fp32 (default {DEFAULT_PRECISION})")
    p.add_argument("--plot", help="write a plot (file name ending in .png, .pdf, .svg, ...) of "
                                  "predicted samples/s per plan and predicted peak memory "
                                  "against the usable cap c·C_i (GiB per GPU type; with "
                                  "several -B, memory / cap of the fullest rank)")


def _restrict_gpu_types(args: argparse.Namespace):
    """The cluster YAML with only the machines whose GPUs are all of ``--gpu-types``."""
    from hf_cephalo.profiles.specs import ClusterSpec, get_gpu_spec, load_cluster_yaml

    spec = load_cluster_yaml(args.cluster)
    keep = {get_gpu_spec(g).name for g in args.gpu_types}
    machines = [m for m in spec.machines if m and all(get_gpu_spec(g).name in keep for g in m)]
    if not machines:
        example = " ".join(sorted({get_gpu_spec(g).name for g in next(m for m in spec.machines
                                                                       if m)}))
        raise ValueError(f"--gpu-types {args.gpu_types}: no machine of {args.cluster} has only "
                         f"these GPU types (machines: {spec.machines}); list every GPU type of "
                         f"the machines to keep, e.g. --gpu-types {example}")
    return ClusterSpec(name=f"{spec.name} [{'+'.join(sorted(keep))}]", machines=machines,
                       interconnect_gbps=spec.interconnect_gbps,
                       intra_machine_gbps=spec.intra_machine_gbps)


def _peak_flops(cluster, precision: str):
    """Spec-sheet peak TFLOP/s per rank, or None if a device type is not in the tables."""
    from hf_cephalo.profiles.specs import get_gpu_spec

    from hf_cephalo.profiles.precision import parse_rank_precisions
    from hf_cephalo.profiles.specs import spec_precisions

    try:
        specs = [get_gpu_spec(d.name) for d in cluster.devices]
    except ValueError:
        return None
    per_rank = cluster.extra.get("rank_precisions")
    if per_rank is None and precision not in ("fp32", "bf16", "fp16"):
        per_rank = parse_rank_precisions(precision, len(specs)) or \
            [spec_precisions(s)[0] for s in specs]  # auto
    columns = {"bf16": "bf16_tflops", "fp16": "fp16_tflops", "fp32": "fp32_tflops"}
    peaks = [getattr(s, columns[p]) for s, p in
             zip(specs, per_rank or [precision] * len(specs))]
    return None if any(p is None for p in peaks) else peaks


def _run_simulate(args: argparse.Namespace) -> int:
    from hf_cephalo.planner import simulate
    from hf_cephalo.planner.optimize import check_problem_size
    from hf_cephalo.profiles.types import format_bytes

    bad = [B for B in args.global_batch_size if B < 1]
    if bad:
        raise ValueError(f"global batch size must be an integer >= 1, got {bad[0]} "
                         f"(in -B {' '.join(map(str, args.global_batch_size))})")
    _check_common_plan_options(args, ("plot",))
    if args.gpu_types and not args.cluster:
        raise ValueError("--gpu-types needs --cluster (a measured profile fixes its ranks)")
    if args.gpu_types:
        if not args.model:
            raise ValueError("--cluster needs --model (e.g. --model llama-7b)")
        from hf_cephalo.profiles.specs import estimate_cluster_profile

        cluster = _apply_lora(estimate_cluster_profile(_restrict_gpu_types(args), args.model,
                                                       **_estimate_options(args)), args)
    else:
        cluster = _load_cluster(args, precision_applies_to_profile=True)
    for B in args.global_batch_size:  # refuse any too-large B before printing any table
        check_problem_size(cluster, B, args.memory_fraction)
    peaks = _peak_flops(cluster, args.precision or DEFAULT_PRECISION)
    name = cluster.extra.get("cluster", "cluster")
    counts: dict[str, int] = {}
    for d in cluster.devices:
        counts[d.name] = counts.get(d.name, 0) + 1
    print(f"profile: {cluster.source}, model {cluster.model.name}, {name}: {cluster.world_size} "
          f"ranks ({', '.join(f'{k} x {t}' for t, k in counts.items())}), training state "
          f"{format_bytes(cluster.model.state_bytes)}, memory fraction {args.memory_fraction}")
    if cluster.source != "measured":
        print("note: spec-sheet estimates; measured profiles (hf-cephalo profile) replace them")
    results = {}
    for B in args.global_batch_size:
        if args.precision == "auto" and args.cluster:  # the planner's policy for this B
            cluster = _auto_precision_plan(args, _spec_cluster(args), B)[0]
            peaks = _peak_flops(cluster, "auto")
        results[B] = simulate.compare_plans(cluster, B, args.memory_fraction, peak_flops=peaks,
                                            allow_idle=not args.no_idle,
                                            root_resident=args.root_resident)
        print(f"\nglobal batch size {B} (memory cells: GiB used by the fullest rank of the type, "
              "'!' over the cap, then its b_i/m_i)")
        print(simulate.format_comparison_table(cluster, results[B]))
    if len(results) > 1:
        print("\npredicted samples/s by global batch size")
        print(simulate.format_sweep_table(results))
    if args.plot:
        simulate.plot_comparison(results, args.plot,
                                 title=f"{cluster.model.name} on {name} ({cluster.source})")
        print(f"plot written to {args.plot}")
    return 0


# --- export ----------------------------------------------------------------------------------
def _add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a sharded checkpoint directory (a Trainer checkpoint-N or "
                                      "one written by hf_cephalo.engine.checkpoint.save_checkpoint)")
    p.add_argument("--out", required=True, help="write the Hugging Face model directory here")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the CRC-32 check of the shard files (sizes are still checked)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow --out to be a non-empty directory that is not a previous export "
                        "(never the checkpoint directory itself)")
    p.add_argument("--max-shard-size", default="50GB",
                   help="largest weight file, as save_pretrained's max_shard_size: bytes or a "
                        "size such as '5GB' (units TB, GB, MB, KB; powers of 1000). Larger "
                        "weights go into model-0000k-of-0000n.safetensors files with an index "
                        "(default 50GB, save_pretrained's)")
    p.add_argument("--merge-lora", action="store_true",
                   help="the checkpoint is of a LoRA PeftModel run: write the base model with "
                        "the adapter merged into its weights (PEFT's merge_and_unload, streamed "
                        "one unit at a time), loadable with the base class's from_pretrained")
    p.add_argument("--adapter-config",
                   help="with --merge-lora: adapter_config.json (or its directory) when the "
                        "checkpoint has none (engine-level checkpoints); default: the "
                        "checkpoint's own")


def _run_export(args: argparse.Namespace) -> int:
    checkpoint, out = os.path.realpath(args.checkpoint), os.path.realpath(args.out)
    if os.path.commonpath([checkpoint, out]) == checkpoint:
        where = "the checkpoint directory itself" if out == checkpoint else \
            "inside the checkpoint directory"
        raise ValueError(f"--out {args.out!r} is {where} ({args.checkpoint!r}); the export "
                         "would mix model files into the checkpoint: give a directory outside it")
    from hf_cephalo.engine.checkpoint import export_hf

    if args.adapter_config is not None and not args.merge_lora:
        raise ValueError(f"--adapter-config {args.adapter_config!r} is read only with "
                         "--merge-lora; add --merge-lora or drop --adapter-config")
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    kwargs = dict(verify=not args.no_verify, overwrite=args.overwrite, max_shard_size=size)
    if args.merge_lora:
        from hf_cephalo.engine.peft_merge import export_merged_lora

        out = export_merged_lora(args.checkpoint, args.out, adapter_config=args.adapter_config,
                                 **kwargs)
    else:
        out = export_hf(args.checkpoint, args.out, **kwargs)
    weights = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    merged = " with the LoRA adapter merged" if args.merge_lora else ""
    print(f"exported {args.checkpoint} to {out}{merged}: {len(weights)} weight file(s) "
          f"(load with from_pretrained)")
    return 0


# --- profile ---------------------------------------------------------------------------------
def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", required=True,
                   help="Hugging Face model config: a config.json file or a directory holding one "
                        "(the model is built from it with random weights; nothing is downloaded)")
    p.add_argument("--model-class", help="model class, e.g. LlamaForCausalLM (default: the "
                                         "config's first 'architectures' entry)")
    p.add_argument("--out", required=True, help="write the cluster profile JSON here (rank 0)")
    p.add_argument("--sequence-length", type=int, default=128,
                   help="tokens per sample of the profiled microbatches (default 128)")
    p.add_argument("--max-microbatch-size", type=int, default=8,
                   help="M: microbatch sizes 1..M are profiled (default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="parameter dtype of the profiled model: float32 (default; also for "
                        "--precision bf16) or bfloat16 (a model trained in bfloat16 parameters); "
                        "float16 is refused (Cephalo does not train in float16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per microbatch size (median)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="bf16 / fp16: time the forward under that autocast, as training with "
                        "--bf16 / --fp16 runs (default fp32)")
    p.add_argument("--param-dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="gathered-parameter dtype of the job (cephalo_param_dtype): auto "
                        "(default: the --precision dtype, as the trainer's default), fp32, or "
                        "the --precision dtype; the unit is profiled gathered in it")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="gradient reduce-scatter dtype of the job (cephalo_reduce_dtype): fp32 "
                        "(default) or the param dtype; recorded in the profile's precision")
    p.add_argument("--emulate-slowdown", help="emulation: per-rank compute slowdown, e.g. '1,3'")
    p.add_argument("--emulate-memory-cap-bytes",
                   help="emulation: per-rank memory capacity in bytes, e.g. '8e9,4e9'")
    p.add_argument("--no-cache", action="store_true", help="measure even if a cached profile exists")
    p.add_argument("--verbose", action="store_true", help="progress of every rank once a second, "
                   "with the time of each microbatch size (default: rank 0, a line every 15 s)")
    p.add_argument("--cache-dir", help="profile cache directory (default $HF_CEPHALO_PROFILE_CACHE "
                                       "or ~/.cache/hf_cephalo/profiles)")


def _per_rank_list(text: str | None, cast, flag: str):
    if text is None:
        return None
    try:
        return [cast(float(x)) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated numbers, one per rank") from None


def _check_profile_dtype(dtype: str, precision: str) -> None:
    """Refuse a --dtype / --precision pair no Cephalo job trains with: its profile would be
    refused by every job (profiles record the dtype and jobs check it)."""
    if dtype == "float16":
        raise ValueError("--dtype float16: Cephalo does not train in float16 parameters (fp16 "
                         "training is fp16 autocast over float32 master weights with a sharded "
                         "loss scaler), so no job could use this profile; use --dtype float32 "
                         "(with --precision fp16 / bf16 for training with --fp16 / --bf16) or "
                         "--dtype bfloat16")
    if dtype != "float32" and precision != "fp32":
        raise ValueError(f"--dtype {dtype} with --precision {precision}: {precision} autocast runs "
                         "over float32 "
                         "parameters (master weights) and the engine refuses other parameter "
                         "dtypes, so no job could use this profile; use --dtype float32 "
                         "--precision bf16 (training with --bf16), or --dtype bfloat16 "
                         "--precision fp32 (a model trained in bfloat16 parameters)")


def _read_model_config(path: str) -> tuple[str, dict]:
    """(config file, its JSON) of --model-config: a config.json or a directory holding one.
    ValueError naming the file when it is missing, not JSON or not a Hugging Face config."""
    import json

    if not os.path.exists(path):
        raise ValueError(f"model config {path!r} does not exist; give a config.json file or a "
                         "directory holding one")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"model config directory {path!r} holds no config.json; give a "
                         "config.json file or a directory holding one")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model config {file!r} is not valid JSON ({e}); give a Hugging Face "
                         "config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"model config {file!r} has no 'model_type'; give a Hugging Face "
                         "config.json (the one save_pretrained writes beside the weights)")
    return file, data


def _check_model_class(name: str, file: str, data: dict) -> None:
    """Refuse --model-class when its config type is not the config's model_type (the model
    would fail deep inside transformers, e.g. a LlamaConfig has no 'embd_pdrop')."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        return  # build_model_from_config names the missing class
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"--model-class {name} is not a concrete transformers model class; "
                         "give the model's own class, e.g. "
                         f"{(data.get('architectures') or ['LlamaForCausalLM'])[0]}")
    expected = getattr(getattr(cls, "config_class", None), "model_type", "")
    if expected and expected != data["model_type"]:
        archs = data.get("architectures") or []
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(data["model_type"])
        except ImportError:
            causal = None
        hint = (f"pass --model-class {archs[0]} (the config's architecture) or omit it" if archs
                else f"pass a {data['model_type']} model class such as {causal}" if causal
                else f"pass a {data['model_type']} model class")
        raise ValueError(f"--model-class {name} builds from a {expected!r} config but "
                         f"{file!r} has model_type {data['model_type']!r}; {hint}")


def _run_profile(args: argparse.Namespace) -> int:
    """Profile every rank (one process per rank under torchrun / accelerate launch, or one)."""
    _check_profile_dtype(args.dtype, args.precision)
    config_file, config_data = _read_model_config(args.model_config)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes --out: check before measuring
        _check_output_file(args.out, "--out", "profile.json")

    import torch
    import torch.distributed as dist

    from hf_cephalo.models import UnsupportedModelError, stage_model
    from hf_cephalo.profiles.cache import ProfileCache
    from hf_cephalo.profiler.emulate import EmulationConfig
    from hf_cephalo.profiler.measure import (MeasureConfig, build_model_from_config,
                                             max_positions, profile_cluster)
    from hf_cephalo.profiles.types import format_bytes

    config = MeasureConfig(max_microbatch_size=args.max_microbatch_size,
                           sequence_length=args.sequence_length, repeats=args.repeats,
                           precision=args.precision, verbose=args.verbose,
                           param_dtype=args.precision if args.param_dtype == "auto"
                           else args.param_dtype, reduce_dtype=args.reduce_dtype)
    slow = _per_rank_list(args.emulate_slowdown, float, "--emulate-slowdown")
    caps = _per_rank_list(args.emulate_memory_cap_bytes, int, "--emulate-memory-cap-bytes")
    emulation = None if slow is None and caps is None else \
        EmulationConfig(slowdown=slow, memory_cap_bytes=caps)
    if args.model_class:
        _check_model_class(args.model_class, config_file, config_data)
    try:
        model = build_model_from_config(args.model_config, args.model_class,
                                        getattr(torch, args.dtype))
    except ValueError as e:  # keep the first line; transformers appends ~200 config names
        from hf_cephalo.models import supported_model_classes

        raise ValueError(f"{str(e).splitlines()[0].rstrip('.;: ')}; hf_cephalo trains the "
                         f"causal-LM and sequence-classification heads of transformers' models, "
                         f"and through adapters: {', '.join(supported_model_classes())}") from None
    except (AttributeError, TypeError, KeyError) as e:  # a class that does not fit the config
        name = args.model_class or (config_data.get("architectures") or
                                    ["AutoModelForCausalLM"])[0]
        raise ValueError(f"cannot build {name} from model config {config_file!r} (model_type "
                         f"{config_data['model_type']!r}): {type(e).__name__}: {e}; pass a "
                         "--model-class that fits this config") from None
    try:
        staged = stage_model(model)
    except UnsupportedModelError as e:
        if not e.alternatives:
            raise
        raise ValueError(f"model config {config_file!r} builds {type(model).__name__}, a base "
                         f"model without a head, which hf_cephalo cannot train; pass --model-class "
                         f"{e.alternatives[0]} (supported heads of this architecture: "
                         f"{', '.join(e.alternatives)}) and train the model as that class; for "
                         "another head see docs/adding_a_model.md") from None
    limit = None if getattr(model, "main_input_name", "input_ids") == "pixel_values" \
        else max_positions(model)
    if limit is not None and args.sequence_length > limit:  # before any collective
        raise ValueError(f"--sequence-length {args.sequence_length} exceeds the model's {limit} "
                         f"positions (model config {config_file!r}); give --sequence-length "
                         f"{limit} or less")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # device_id binds the NCCL communicator to this rank's GPU (a barrier before any
            # collective would otherwise guess global rank % local GPU count)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    cache = False if args.no_cache else ProfileCache(args.cache_dir)
    try:
        cluster = profile_cluster(staged, config, device=device, emulation=emulation, cache=cache)
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        cluster.save(args.out)
        m = cluster.model
        print(f"model {m.name}: {m.num_units} units x {m.params_per_unit} params + "
              f"{m.params_other} other; all-gather {cluster.comm.allgather_s * 1e3:.2f} ms, "
              f"reduce-scatter {cluster.comm.reducescatter_s * 1e3:.2f} ms per unit")
        for i, d in enumerate(cluster.devices):
            print(f"rank {i} {d.name}: m=1 fwd {d.fwd_s[0] * 1e3:.2f} ms bwd {d.bwd_s[0] * 1e3:.2f} ms, "
                  f"m={d.microbatch_sizes[-1]} fwd {d.fwd_s[-1] * 1e3:.2f} ms bwd "
                  f"{d.bwd_s[-1] * 1e3:.2f} ms, compute memory {format_bytes(d.compute_memory_bytes[-1])}")
        print(f"cluster profile written to {args.out}")
    return 0


_BUILTIN = {
    "plan": Subcommand("choose per-rank batch, microbatch and state share (exact optimizer)",
                       _add_plan_arguments, _run_plan),
    "simulate": Subcommand("predict throughput and memory of Cephalo's plan and the baselines "
                           "(even split, compute or memory balance only, batch ∝ peak FLOP/s)",
                           _add_simulate_arguments, _run_simulate),
    "export": Subcommand("merge a sharded checkpoint into a Hugging Face model directory "
                         "(offline, no process group)", _add_export_arguments, _run_export),
    "profile": Subcommand("measure this cluster (one unit's forward/backward and memory per rank, "
                          "collectives) and write a cluster profile JSON",
                          _add_profile_arguments, _run_profile),
}
for _name, _sub in _BUILTIN.items():
    SUBCOMMANDS.setdefault(_name, _sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-cephalo", description="Heterogeneous-GPU training "
                                     "for Hugging Face models (Cephalo).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        spec.add_arguments(p)
        p.set_defaults(_run=spec.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-cephalo`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except ValueError as e:
        _print_error(str(e), type(e).__name__)
        return 2
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except OSError as e:  # a path the checks above did not foresee: the message, no traceback
        _print_error(_os_error_message(e), type(e).__name__)
        return 2


def _print_error(message: str, kind: str) -> None:
    """``error: <message>`` on stderr; under a launcher once per job (the first rank with this
    message prints, the launcher's report names it: ``rank_errors.report_error_once``)."""
    from hf_cephalo.rank_errors import report_error_once

    if report_error_once(message, kind):
        print(f"error: {message}", file=sys.stderr, flush=True)


def _os_error_message(e: OSError) -> str:
    """'<reason>: <path>' and what to do, for a file the command could not read or write."""
    if e.filename is None:
        return str(e)
    paths = repr(e.filename) + (f" -> {e.filename2!r}" if e.filename2 is not None else "")
    return f"{e.strerror or e}: {paths}; check the path and its permissions"


if __name__ == "__main__":
    sys.exit(main())
