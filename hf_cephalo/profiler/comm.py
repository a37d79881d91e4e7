"""The collectives' times on this cluster (``CommProfile``), through the engine's own collectives.

- ``allgather_s`` / ``reducescatter_s``: one unit with EVEN shards over the whole world through
  the engine's own collectives; the slowest rank's median (every rank plans with the same
  numbers). ``uneven_factor`` u: the same unit split by the most skewed state ratios the
  memory caps allow (``planner.state.skewed_state_ratios``), timed the same way, divided by
  the even time (docs/planner.md "The uneven factor u").
- the root's collectives of one step, one 8-byte all-reduce, and the wait of an all-reduce
  reached from compute (``collective_wait_s``).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from hf_cephalo.models.base import StagedModel
from hf_cephalo.profiler.hardware import sync_device
from hf_cephalo.profiler.model_facts import mean_unit_numel, model_dtype, model_profile
from hf_cephalo.profiles.types import CommProfile

__all__ = ["measure_comm"]


def _time_unit_collectives(numel_per_rank: Sequence[int], dtype, device, group, repeats: int,
                           use_all_reduce: bool) -> tuple[float, float]:
    """Median (all-gather s, reduce-scatter s) of one unit whose shards are ``numel_per_rank``,
    through the engine's own collectives (collective on every rank).

    The one call site of the engine's collective API in the profiler: the variable-size
    collectives the engine runs (``all_gather_shards`` / ``reduce_scatter_shards``, the
    single-tensor fast path when the shards are equal), with these shard sizes.
    """
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats

    rank = dist.get_rank(group)
    sizes = [int(n) for n in numel_per_rank]
    shard = torch.ones(sizes[rank], dtype=dtype, device=device)  # 1D, this rank's shard
    stats = CollectiveStats()
    ag, rs = [], []
    for k in range(1 + repeats):
        dist.barrier(group)
        sync_device(device)
        t0 = time.perf_counter()
        full = C.all_gather_shards(shard, sizes, rank, group, stats, async_op=False).output
        sync_device(device)
        t1 = time.perf_counter()
        dist.barrier(group)
        sync_device(device)
        t2 = time.perf_counter()
        C.reduce_scatter_shards(full, sizes, rank, group, stats, async_op=False,
                                use_all_reduce=use_all_reduce)
        sync_device(device)
        t3 = time.perf_counter()
        if k:
            ag.append(t1 - t0)
            rs.append(t3 - t2)
    return statistics.median(ag), statistics.median(rs)


def measure_comm(staged: StagedModel, *, device: torch.device | str, repeats: int = 5,
                 group: dist.ProcessGroup | None = None,
                 state_ratios: Sequence[float] | None = None) -> CommProfile:
    """One unit's all-gather and reduce-scatter (collective on every rank), and u; a unit of
    the layers' mean size where they differ (``mean_unit_numel``).

    AG and RS: EVEN shards. ``state_ratios`` (e.g. ``planner.state.skewed_state_ratios``): the
    same unit split by those ratios (``integer_targets``, as a ratio-split unit of the plan's
    layout) is timed too, and ``uneven_factor`` u = (AG + RS uneven) / (AG + RS even), clamped
    at 1 (an uneven layout is never priced cheaper than even: below 1 is timing noise). Uses the
    engine's collectives (``_time_unit_collectives``), the reduce-scatter fallback included
    where the backend lacks reduce-scatter. Slowest rank's medians, identical on every rank.
    Without a process group or with world size 1: zeros and no u.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return CommProfile(allgather_s=0.0, reducescatter_s=0.0)
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.planner.state import integer_targets

    device = torch.device(device)
    n = dist.get_world_size(group)
    numel = mean_unit_numel(staged)  # [Note: layers of different sizes] in model_facts.py
    dtype, fallback = model_dtype(staged), not C.reduce_scatter_supported(group)
    even = integer_targets([1.0 / n] * n, numel)
    times = list(_time_unit_collectives(even, dtype, device, group, repeats, fallback))
    times += _time_root_collectives(staged, n, dtype, device, group, repeats, fallback)
    if state_ratios is not None:
        row = integer_targets(state_ratios, numel)
        times += _time_unit_collectives(row, dtype, device, group, repeats, fallback)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    ag, rs = float(t[0]), float(t[1])
    # gloo's copies and reductions run on the host cores the CPU ranks compute on
    root = dict(root_allgather_s=float(t[2]), root_reducescatter_s=float(t[3]),
                allreduce_s=float(t[4]), collective_wait_s=float(t[5]),
                overlaps_compute=device.type == "cuda")
    if state_ratios is None:
        return CommProfile(allgather_s=ag, reducescatter_s=rs, **root)
    u = max(1.0, float(t[6] + t[7]) / max(ag + rs, 1e-12))
    return CommProfile(allgather_s=ag, reducescatter_s=rs, uneven_factor=u,
                       uneven_state_ratios=[float(r) for r in state_ratios], **root)


def _time_root_collectives(staged: StagedModel, world_size: int, dtype, device, group,
                           repeats: int, use_all_reduce: bool) -> list[float]:
    """[root all-gathers s, root reduce-scatters s, one 8-byte all-reduce s] of one step as the
    engine's split root issues them ([Note: layered schedule] in engine/schedule.py): the
    embedding unit E gathered twice and the head unit H once, H's and E's gradients
    reduce-scattered once each; a tied head gathers E a third time and reduce-scatters its
    head-use gradient too. Even shards, this rank's medians (collective on every rank)."""
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats
    from hf_cephalo.planner.state import integer_targets

    model = model_profile(staged)
    n_embed, n_head, tied = model.root_split()
    ag_e, rs_e = _time_unit_collectives(integer_targets([1.0 / world_size] * world_size,
                                                        max(n_embed, world_size)),
                                        dtype, device, group, repeats, use_all_reduce)
    ag_h, rs_h = _time_unit_collectives(integer_targets([1.0 / world_size] * world_size,
                                                        max(n_head, world_size)),
                                        dtype, device, group, repeats, use_all_reduce)
    stats, times = CollectiveStats(), []
    for k in range(1 + repeats):
        t = torch.ones(1, dtype=torch.int64, device=device)
        dist.barrier(group)
        sync_device(device)
        t0 = time.perf_counter()
        C.all_reduce_sum(t, group, stats)
        sync_device(device)
        if k:
            times.append(time.perf_counter() - t0)
    gathers_e, reduces_e = (3, 2) if tied else (2, 1)
    allreduce_s = statistics.median(times)
    return [gathers_e * ag_e + ag_h, reduces_e * rs_e + rs_h, allreduce_s,
            _time_rendezvous(device, group, repeats, allreduce_s)]


def _time_rendezvous(device, group, repeats: int, allreduce_s: float) -> float:
    """``CommProfile.collective_wait_s``: an 8-byte all-reduce reached from compute (the same
    ~1 ms of matrix products on every rank, no barrier) minus the same all-reduce reached
    from a barrier, seconds, at least 0. The rank that arrives last sets the pace, so the
    smallest of the ranks' medians is taken (a MIN all-reduce; collective on every rank)."""
    from hf_cephalo.engine import collectives as C
    from hf_cephalo.engine.stats import CollectiveStats

    a = torch.randn(192, 192, device=device)
    stats, waits = CollectiveStats(), []
    dist.barrier(group)
    for k in range(1 + 4 * repeats):
        for _ in range(4):
            a = torch.tanh(a @ a)
        sync_device(device)
        t0 = time.perf_counter()
        C.all_reduce_sum(torch.ones(1, dtype=torch.int64, device=device), group, stats)
        sync_device(device)
        if k:
            waits.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(waits)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return max(0.0, float(t) - allreduce_s)
