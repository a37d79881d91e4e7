"""Planner speed: seconds per solve, and the ratio against the paper's recurrence.

Cases (issue 2, item 10): Cluster B (64 GPUs: 16 A10G, 16 V100-16GB, 32 T4, 100 Gbit/s) at
B = 256, 512, 1024, and 512 GPUs (8 x Cluster B) at B = 4096, with spec-sheet profiles. The
reference recurrence (``planner/reference.py``, O(N·B³·log B)) is run on Cluster B at growing B,
each in a child process limited to 60 s; the ratio is taken on the largest B it finishes, against
the optimizer solving the same instance (idle ranks off, as in the paper) -- and both must agree.

Run: ``python benchmarks/bench_planner.py [--model gpt-6.7b] [--repeats 3]``.
Targets on 2 CPU cores: 64 GPUs / B = 1024 <= 2 s; 512 GPUs / B = 4096 <= 30 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time

from hf_cephalo.planner.optimize import optimize, solve_assignment
from hf_cephalo.planner.reference import reference_unit_time
from hf_cephalo.profiles.specs import ClusterSpec, estimate_cluster_profile

REFERENCE_LIMIT_S = 60.0


def cluster_b(copies: int = 1, smoke: bool = False) -> ClusterSpec:
    machines = ([["A10G"] * 8] * 2 + [["V100-16GB"] * 8] * 2 + [["T4"] * 8] * 4) * copies
    if smoke:  # one machine of each GPU type: 24 GPUs
        machines = [machines[0], machines[2], machines[4]]
    return ClusterSpec(name=f"cluster-b x{copies}", machines=machines, interconnect_gbps=100)


def time_solve(profile, B: int, repeats: int) -> tuple[float, object]:
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = optimize(profile, B)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), plan


def _reference_child(model: str, B: int, smoke: bool = False) -> None:
    profile = estimate_cluster_profile(cluster_b(smoke=smoke), model)
    t0 = time.perf_counter()
    value = reference_unit_time(profile, B)
    print(f"{time.perf_counter() - t0!r} {value!r}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-6.7b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference-batch-sizes", default="64,128,256,384,512")
    ap.add_argument("--_reference", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="smallest settings: one solve per case, the first two cases, the "
                         "reference recurrence on 24 of Cluster B's GPUs at B = 24 (the "
                         "suite's check that the benchmark runs)")
    args = ap.parse_args(argv)
    if args._reference:
        _reference_child(args.model, args._reference, args.smoke)
        return
    if args.smoke:
        args.repeats, args.reference_batch_sizes = 1, "24"
    print(f"model {args.model}, spec-sheet profiles, median of {args.repeats} solves")
    print(f"{'case':<34} {'s/solve':>9} {'sharding':>9} {'iteration s':>12}")
    cases = [(1, 256), (1, 512)] if args.smoke else [(1, 256), (1, 512), (1, 1024), (8, 4096)]
    for copies, B in cases:
        profile = estimate_cluster_profile(cluster_b(copies), args.model)
        s, plan = time_solve(profile, B, args.repeats)
        name = f"{profile.world_size} GPUs, B = {B}"
        print(f"{name:<34} {s:>9.3f} {'uneven' if plan.uneven_state else 'even':>9} "
              f"{plan.predicted_iteration_s:>12.3f}")
    # A state-bound variant: 45x the layers so that aggregate memory (III) binds and the
    # min-plus knapsack path of the optimizer is exercised at full size.
    profile = estimate_cluster_profile(cluster_b(1 if args.smoke else 8), args.model)
    profile.model = dataclasses.replace(profile.model, num_units=(5 if args.smoke else 45)
                                        * profile.model.num_units)
    s, plan = time_solve(profile, 256 if args.smoke else 4096, args.repeats)
    name = f"{profile.world_size} GPUs, B = {plan.global_batch_size}, state-bound"
    print(f"{name:<34} {s:>9.3f} {'uneven' if plan.uneven_state else 'even':>9} "
          f"{plan.predicted_iteration_s:>12.3f}")

    print(f"\nreference recurrence on Cluster B (child process, limit {REFERENCE_LIMIT_S:.0f} s)")
    last = None
    profile = estimate_cluster_profile(cluster_b(smoke=args.smoke), args.model)
    for B in [int(x) for x in args.reference_batch_sizes.split(",")]:
        try:
            r = subprocess.run([sys.executable, __file__, "--model", args.model,
                                "--_reference", str(B), *(["--smoke"] if args.smoke else [])],
                               capture_output=True, text=True,
                               timeout=REFERENCE_LIMIT_S, check=True)
        except subprocess.TimeoutExpired:
            print(f"  B = {B}: reference did not finish within {REFERENCE_LIMIT_S:.0f} s")
            break
        ref_s, ref_value = (float(x) for x in r.stdout.split())
        t0 = time.perf_counter()
        ours = solve_assignment(profile, B, allow_idle=False).unit_time_s
        ours_s = time.perf_counter() - t0
        agree = abs(ours - ref_value) <= 1e-9 * ref_value
        print(f"  B = {B}: reference {ref_s:.3f} s, optimizer {ours_s:.4f} s, "
              f"ratio {ref_s / ours_s:.0f}x, same optimum: {agree}")
        if not agree:
            raise SystemExit(f"optimum differs: reference {ref_value}, optimizer {ours}")
        last = (B, ref_s, ours_s)
    if last:
        B, ref_s, ours_s = last
        print(f"\nlargest reference instance: {profile.world_size} GPUs, B = {B}: optimizer is "
              f"{ref_s / ours_s:.0f}x faster ({ours_s:.4f} s vs {ref_s:.2f} s)")


if __name__ == "__main__":
    main()
