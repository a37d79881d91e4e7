"""Uneven collectives vs even shards: counted bytes and measured time (gloo ranks on CPU).

For world sizes 2, 3 and 4 (one gloo process group each) and a model of ``--units`` layer
units of ``--unit-mb`` MB plus a root unit 1.5x that size (fp32), it lays the units out

* even: the planner's layout for equal ratios (every unit split exactly evenly);
* for state ratios the planner gives on the example clusters (``hf-cephalo plan`` on
  examples/clusters/cluster_a.yaml and cluster_b.yaml, a 2-4 rank subset of the ranks, ratios
  rescaled to sum 1): the planner's ratio-split layout ("ratio-split") and the layout the
  planner produced before (every unit it could even, the rest poured rank by rank: "pour");

and runs one all-gather and one reduce-scatter per unit through

* "variable": the engine's collectives (``engine.collectives``, no padding), and
* "padded": the engine's former mechanism (every shard padded to the unit's largest one,
  equal-size ``all_gather_single`` / ``reduce_scatter_single``, unpad copy after the gather);
* "a2a": the all-gather as gloo's ``all_to_all_single`` with split sizes (the alternative to
  the engine's per-owner broadcasts on gloo; reduce-scatter as "variable").

Counted bytes per rank are the logical exchange's payload (``CollectiveStats``; padded: (W - 1)
x the padded shard each way). Printed as ratios to the even layout's variable run: totals over
ranks, the largest per-rank sent and received bytes (the received next to its lower bound
(1 - r_i) / (1 - 1/W) for that rank: a rank that holds little of a unit must receive the rest
of it, whatever the mechanism), and the time of all the units'
all-gathers / reduce-scatters (median of ``--reps`` after one warm-up, slowest rank).

Usage: python benchmarks/bench_collectives.py [--unit-mb 4] [--units 3] [--reps 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from rank_launch import free_port, run_ranks  # this folder is on sys.path

# (label, cluster yaml, model, global batch size, devices of the rank subset per world size)
PLAN_SOURCES = [
    ("A llama-7b B256", "cluster_a", "llama-7b", 256,
     {2: ["A6000", "P100"], 3: ["A6000", "P40", "P100"], 4: ["L4", "A6000", "P40", "P100"]}),
    ("B gpt-6.7b B1024", "cluster_b", "gpt-6.7b", 1024,
     {2: ["V100-16GB", "A10G"], 3: ["A10G", "V100-16GB", "T4"],
      4: ["A10G", "V100-16GB", "T4", "T4"]}),
    ("B gpt-6.7b B4096", "cluster_b", "gpt-6.7b", 4096,
     {2: ["A10G", "T4"], 3: ["A10G", "V100-16GB", "T4"], 4: ["A10G", "A10G", "V100-16GB", "T4"]}),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- layouts ------------------------------------------------------------------------------------
def plan_ratios(cluster: str, model: str, batch: int) -> list[tuple[str, float]]:
    """(device, r_i) per rank of ``hf-cephalo plan`` (spec-sheet estimate)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        subprocess.run([sys.executable, "-m", "hf_cephalo.cli", "plan", "--cluster",
                        os.path.join(ROOT, "examples", "clusters", f"{cluster}.yaml"),
                        "--model", model, "--global-batch-size", str(batch), "--out", out],
                       check=True, capture_output=True, cwd=ROOT)
        with open(out) as f:
            plan = json.load(f)
    return [(r["device"], float(r["state_ratio"])) for r in plan["ranks"]]


def subset_ratios(ranks: list[tuple[str, float]], devices: list[str]) -> list[float]:
    """The ratios of the first unused rank of each listed device, rescaled to sum 1."""
    used, picked = set(), []
    for name in devices:
        i = next(i for i, (d, _) in enumerate(ranks) if d == name and i not in used)
        used.add(i)
        picked.append(ranks[i][1])
    total = sum(picked)
    return [r / total for r in picked] if total > 0 else [1.0 / len(picked)] * len(picked)


def pour_layout(ratios: list[float], numels: list[int]) -> list[list[int]]:
    """The planner's layout before ratio-splitting (kept here as the baseline): as many units
    split evenly as the targets allow, the rest poured rank by rank over the other units."""
    from hf_cephalo.planner.state import integer_targets
    targets = integer_targets(ratios, sum(numels))
    holders = [i for i, r in enumerate(ratios) if r > 0]
    layout = [[0] * len(ratios) for _ in numels]
    remaining, uneven = list(targets), []
    for u in sorted(range(len(numels)), key=lambda u: numels[u]):
        q, rem = divmod(numels[u], len(holders))
        extra = sorted(holders, key=lambda i: -remaining[i])[:rem]
        parts = {i: q + (i in extra) for i in holders}
        if all(remaining[i] >= parts[i] for i in holders):
            for i in holders:
                layout[u][i] = parts[i]
                remaining[i] -= parts[i]
        else:
            uneven.append(u)
    rank_iter = iter(holders)
    rank = next(rank_iter)
    for u in sorted(uneven):
        left = numels[u]
        while left > 0:
            while remaining[rank] == 0:
                rank = next(rank_iter)
            take = min(left, remaining[rank])
            layout[u][rank] += take
            remaining[rank] -= take
            left -= take
    return layout


# ---- the two mechanisms ------------------------------------------------------------------------
def variable_ops(sizes, rank, stats):
    from hf_cephalo.engine import collectives as C
    local = torch.ones(sizes[rank])
    grad = torch.ones(sum(sizes))

    def ag():
        return C.all_gather_shards(local, sizes, rank, None, stats, async_op=False).output

    def rs():
        return C.reduce_scatter_shards(grad, sizes, rank, None, stats, async_op=False).output
    return ag, rs


def all_to_all_ops(sizes, rank, stats):
    """gloo's other uneven all-gather: ``all_to_all_single`` with split sizes, which needs a
    (W * n_self,) send copy; the reduce-scatter as ``variable``. Not what the engine uses: the
    comparison is why (see [Note: uneven collectives])."""
    ag_var, rs = variable_ops(sizes, rank, stats)
    ws, local = len(sizes), torch.ones(sizes[rank])

    def ag():
        if len(set(sizes)) == 1:
            return ag_var()
        out = torch.empty(sum(sizes))
        dist.all_to_all_single(out, local.repeat(ws), output_split_sizes=list(sizes),
                               input_split_sizes=[sizes[rank]] * ws)
        stats.all_gather_sent_bytes += (ws - 1) * sizes[rank] * 4
        stats.all_gather_received_bytes += (sum(sizes) - sizes[rank]) * 4
        return out
    return ag, rs


def padded_ops(sizes, rank, stats):
    """The former engine path: pad to P, equal-size collective, unpad (copies included)."""
    ws, pad = len(sizes), max(sizes)
    local, grad = torch.ones(sizes[rank]), torch.ones(sum(sizes))
    starts = [sum(sizes[:r]) for r in range(ws)]
    es = 4

    def ag():
        send = local if sizes[rank] == pad else torch.zeros(pad)
        if send is not local:
            send[:sizes[rank]].copy_(local)
        out = torch.empty(ws * pad)
        dist.all_gather_into_tensor(out, send)
        stats.all_gather_sent_bytes += (ws - 1) * pad * es
        stats.all_gather_received_bytes += (ws - 1) * pad * es
        if len(set(sizes)) == 1:
            return out
        return torch.cat([out[r * pad:r * pad + n] for r, n in enumerate(sizes)])

    def rs():
        full = grad if len(set(sizes)) == 1 else torch.zeros(ws * pad)
        if full is not grad:
            for r, (s, n) in enumerate(zip(starts, sizes)):
                full[r * pad:r * pad + n].copy_(grad[s:s + n])
        out = torch.empty(pad)
        dist.reduce_scatter_tensor(out, full)
        stats.reduce_scatter_sent_bytes += (ws - 1) * pad * es
        stats.reduce_scatter_received_bytes += (ws - 1) * pad * es
        return out
    return ag, rs


MECHANISMS = (("variable", variable_ops), ("padded", padded_ops), ("a2a", all_to_all_ops))


def time_units(ops, kind) -> float:
    """Seconds for one ``kind`` ("ag" / "rs") collective of every unit, each after a barrier."""
    total = 0.0
    for ag, rs in ops:
        dist.barrier()
        t0 = time.perf_counter()
        (ag if kind == "ag" else rs)()
        total += time.perf_counter() - t0
    return total


def worker(rank, world, port, cases, reps, queue):
    """Every (case, mechanism) once per repetition, interleaved, so that load changes on a
    shared machine hit all alike; counts from the first timed repetition."""
    from hf_cephalo.engine.stats import CollectiveStats
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = []
        for name, ratios, layout in cases:
            for mech, make in MECHANISMS:
                stats = CollectiveStats()
                runs.append((name, ratios, mech, stats, [make(row, rank, stats) for row in layout]))
        times = [{"ag": [], "rs": []} for _ in runs]
        counts = [None] * len(runs)
        for rep in range(reps + 1):  # repetition 0 warms up
            for k, (_, _, _, stats, ops) in enumerate(runs):
                stats.reset()
                for kind in ("ag", "rs"):
                    t = time_units(ops, kind)
                    if rep:
                        times[k][kind].append(t)
                counts[k] = stats.as_dict()
        results = []
        for k, (name, ratios, mech, _, _) in enumerate(runs):
            med = torch.tensor([statistics.median(times[k]["ag"]),
                                statistics.median(times[k]["rs"])], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, counts[k])
            results.append((name, ratios, mech, per_rank, med.tolist()))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


# ---- report ------------------------------------------------------------------------------------
def report(world, results):
    keys = ("all_gather_sent_bytes", "all_gather_received_bytes", "reduce_scatter_sent_bytes",
            "reduce_scatter_received_bytes")
    even = next(r for r in results if r[0] == "even" and r[2] == "variable")
    base = {k: sum(s[k] for s in even[3]) for k in keys}
    per_rank_even = {k: even[3][0][k] for k in keys}  # every rank the same
    print(f"\n== {world} gloo ranks: ratios to the even layout's variable-size run")
    print(f"{'layout':<28} {'mechanism':<9} {'AG tot':>6} {'RS tot':>6} {'AG sent':>7} "
          f"{'AG recv':>7} {'bound':>5} {'AG time':>7} {'RS time':>7}   r_i")
    print(f"{'':<28} {'':<9} {'':>6} {'':>6} {'max':>7} {'max':>7} {'':>5}")
    for name, ratios, mech, per_rank, (ag_s, rs_s) in results:
        ag_tot = sum(s[keys[0]] + s[keys[1]] for s in per_rank) / (base[keys[0]] + base[keys[1]])
        rs_tot = sum(s[keys[2]] + s[keys[3]] for s in per_rank) / (base[keys[2]] + base[keys[3]])
        sent = max(s[keys[0]] for s in per_rank) / per_rank_even[keys[0]]
        worst = max(range(world), key=lambda r: per_rank[r][keys[1]])
        recv = per_rank[worst][keys[1]] / per_rank_even[keys[1]]
        bound = f"{(1 - ratios[worst]) / (1 - 1 / world):5.2f}" if mech != "padded" else "-"
        print(f"{name:<28} {mech:<9} {ag_tot:6.2f} {rs_tot:6.2f} {sent:7.2f} {recv:7.2f} "
              f"{bound:>5} {ag_s / even[4][0]:7.2f} {rs_s / even[4][1]:7.2f}   "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"even, variable: all-gathers {even[4][0] * 1e3:.1f} ms, reduce-scatters "
          f"{even[4][1] * 1e3:.1f} ms for all units")


def cases_for(world, numels, sources):
    from hf_cephalo.planner.state import layout_unit_shards
    cases = [("even", [1.0 / world] * world, layout_unit_shards([1.0 / world] * world, numels))]
    for label, ranks, subsets in sources:
        ratios = subset_ratios(ranks, subsets[world])
        cases.append((f"{label} ratio-split", ratios, layout_unit_shards(ratios, numels)))
        cases.append((f"{label} pour", ratios, pour_layout(ratios, numels)))
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--unit-mb", type=float, default=4.0, help="layer unit size, MB of fp32")
    p.add_argument("--units", type=int, default=3, help="layer units (plus one root unit)")
    p.add_argument("--reps", type=int, default=4, help="timed repetitions (median)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--quick", action="store_true", help="1 MB units, 3 reps")
    p.add_argument("--smoke", action="store_true",
                   help="smallest settings: 2 ranks, 0.05 MB units, 1 repetition (the suite's "
                        "check that the benchmark runs; numbers meaningless)")
    args = p.parse_args(argv)
    if args.smoke:
        args.unit_mb, args.units, args.reps, args.worlds = 0.05, 2, 1, [2]
    if args.quick:
        args.unit_mb, args.reps = 1.0, 3
    unit = int(args.unit_mb * 2**20 / 4) // 12 * 12  # divisible by 2, 3, 4: even is exact
    numels = [unit] * args.units + [unit * 3 // 2]
    sources = [(label, plan_ratios(c, m, b), subsets) for label, c, m, b, subsets in PLAN_SOURCES]
    for label, ranks, _ in sources:
        print(f"plan {label}: r_i = {[round(r, 4) for _, r in ranks][:8]}"
              f"{' ...' if len(ranks) > 8 else ''} ({len(ranks)} ranks)")
    for world in args.worlds:
        port = free_port()
        cases = cases_for(world, numels, sources)
        [results] = run_ranks(worker, [(r, world, port, cases, args.reps) for r in range(world)],
                              timeout_s=600, expect=1)
        report(world, results)


if __name__ == "__main__":
    main()
