"""``hf-cephalo simulate``: predict throughput and memory of Cephalo's plan and the baselines
(even split, compute or memory balance only, batch ∝ peak FLOP/s) on one cluster profile.

Several ``-B`` values compare the plans across global batch sizes (a sweep table); every value
is checked, and too-large instances refused, before any table is printed. The tables and the
plot are the planner's (``planner.simulate``); this module reads the options and the cluster.
"""

from __future__ import annotations

import argparse

from hf_cephalo.cli.arguments import (DEFAULT_PRECISION, add_cluster_source_arguments,
                                      check_common_plan_options, precision_arg)
from hf_cephalo.cli.cluster import (apply_lora, auto_precision_plan, estimate_options,
                                    load_cluster, model_shape, restrict_gpu_types, spec_cluster)
from hf_cephalo.planner.types import DEFAULT_MEMORY_FRACTION

__all__ = ["add_simulate_arguments", "run_simulate"]


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_source_arguments(p, "llama-7b")
    p.add_argument("--global-batch-size", "-B", type=int, nargs="+", required=True,
                   help="B, samples per iteration; several values compare plans across B")
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="c, fraction of each GPU's memory a plan may use (default "
                        f"{DEFAULT_MEMORY_FRACTION})")
    p.add_argument("--gpu-types", nargs="+",
                   help="with --cluster: keep only the machines of these GPU types")
    p.add_argument("--no-idle", action="store_true",
                   help="Cephalo plan: every rank processes at least one sample (b_i >= 1)")
    p.add_argument("--precision", type=precision_arg, default=None,
                   help=f"peak FLOP/s column for estimates and batch-proportional: fp32, bf16, "
                        f"fp16, auto (each GPU its fastest) or a per-rank list such as "
                        f"bf16,fp16,fp32 (default {DEFAULT_PRECISION})")
    p.add_argument("--plot", help="write a plot (file name ending in .png, .pdf, .svg, ...) of "
                                  "predicted samples/s per plan and predicted peak memory "
                                  "against the usable cap c·C_i (GiB per GPU type; with "
                                  "several -B, memory / cap of the fullest rank)")


def _peak_flops(cluster, precision: str):
    """Spec-sheet peak TFLOP/s per rank, or None if a device type is not in the tables."""
    from hf_cephalo.profiles.specs import get_gpu_spec

    from hf_cephalo.profiles.precision import PRECISIONS, parse_rank_precisions
    from hf_cephalo.profiles.specs import spec_precisions

    try:
        specs = [get_gpu_spec(d.name) for d in cluster.devices]
    except ValueError:
        return None
    per_rank = cluster.extra.get("rank_precisions")
    if per_rank is None and precision not in PRECISIONS:
        per_rank = parse_rank_precisions(precision, len(specs)) or \
            [spec_precisions(s)[0] for s in specs]  # auto
    peaks = [s.tflops(p) for s, p in zip(specs, per_rank or [precision] * len(specs))]
    return None if any(p is None for p in peaks) else peaks


def run_simulate(args: argparse.Namespace) -> int:
    from hf_cephalo.planner import simulate
    from hf_cephalo.planner.optimize import check_problem_size
    from hf_cephalo.profiles.types import format_bytes

    bad = [B for B in args.global_batch_size if B < 1]
    if bad:
        raise ValueError(f"global batch size must be an integer >= 1, got {bad[0]} "
                         f"(in -B {' '.join(map(str, args.global_batch_size))})")
    check_common_plan_options(args, ("plot",))
    if args.gpu_types and not args.cluster:
        raise ValueError("--gpu-types needs --cluster (a measured profile fixes its ranks)")
    if args.gpu_types:
        from hf_cephalo.profiles.specs import estimate_cluster_profile

        cluster = apply_lora(estimate_cluster_profile(restrict_gpu_types(args), model_shape(args),
                                                       **estimate_options(args)), args)
    else:
        cluster = load_cluster(args, precision_applies_to_profile=True)
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
            cluster = auto_precision_plan(args, spec_cluster(args), B)[0]
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
