"""The paper's dynamic program D(i, j, k), transcribed directly (paper §2.4), for cross-checks.

D(i, j, k) = minimum unit time for the first i GPUs to process total batch j with total
microbatch size k (k = Σ m):

    D(i, j, k) = min over (l, m) of max(D(i-1, j - l·m, k - m), T_{i,l,m})
                 with l·m <= j, m <= k, M(m) <= cap_i,

and the answer is min_k D(N, B, k) over the k meeting the aggregate memory constraint. As in
the paper, every GPU gets l >= 1 (no idle ranks) and one compute-memory model M(m) is shared by
all GPUs, so the aggregate compute memory of a state is N·M0 + slope·k (M linear). The even and
uneven cases are solved as in ``optimize.py``. Memory per rank is ``memory.rank_memory_bytes``
(per (l, m) for the caps; aggregated in closed form, which needs the unit/head phases to bind
over the buffers between phases and the embedding backward, and no host-memory limit). O(N·B³·log B) time, O(B²) memory per layer: for
small instances and the benchmark baseline only.
"""

from __future__ import annotations

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.profiles.types import ClusterProfile

__all__ = ["reference_unit_time"]


def _aggregate_memory(cluster: ClusterProfile, B: int) -> np.ndarray:
    """Σ_i M_i(m_i, b_i) for Σ m_i = k, k = 0..B, Σ b_i = B (linear: see ``reference_unit_time``)."""
    model, N = cluster.model, cluster.world_size
    slope, m0 = cost.memory_line(cluster.devices[0])
    ks = np.arange(B + 1, dtype=np.float64)
    if cluster.buffers_in_compute_memory:
        return N * m0 + slope * ks
    buf = memory.engine_buffers(model, N)
    step = max(buf.unit_bytes, buf.head_bytes)  # one activation line (no head curve)
    stash = memory.device_stash_bytes(model, 1, 1, cluster.offload_activations)
    if cluster.offload_activations:  # 5·m·a per rank
        return N * (m0 + step) + (slope + stash) * ks
    return N * (m0 + step) + slope * ks + stash * B  # (L + 1)·b·a per rank sums to (L + 1)·B·a


def _solve_case(cluster: ClusterProfile, B: int, c: float, uneven: bool) -> float:
    devs = cluster.devices
    N, S = len(devs), cluster.model.state_bytes
    inf = np.inf
    D = np.full((B + 1, B + 1), inf)  # D[j, k] for the first i GPUs
    D[0, 0] = 0.0
    for d in devs:
        cap = c * d.memory_capacity_bytes - (0.0 if uneven else S / N)
        if not uneven and S / N > c * d.memory_capacity_bytes:
            return inf
        new = np.full_like(D, inf)
        rank = devs.index(d)
        for m in range(1, B + 1):
            f, bw = float(cost.fwd_time_s(d, m)), float(cost.bwd_time_s(d, m))
            for l in range(1, B // m + 1):
                if float(memory.rank_memory_bytes(cluster, rank, m, l * m)) > cap * (1 + 1e-12):
                    continue
                t = float(cost.unit_time_s(f, bw, l, cost.unit_comm(cluster), uneven)) + \
                    float(cost.rank_extra_s(cluster, rank, l * m, m)) / cluster.model.num_units
                b = l * m
                # new[j, k] = min(new[j, k], max(D[j - b, k - m], t)) for all j >= b, k >= m
                np.minimum(new[b:, m:], np.maximum(D[: B + 1 - b, : B + 1 - m], t),
                           out=new[b:, m:])
        D = new
    agg = _aggregate_memory(cluster, B)  # Σ_i M_i for Σ_i m_i = k (one linear memory model)
    budget = c * sum(x.memory_capacity_bytes for x in devs) - S
    ok = agg <= budget + abs(budget) * 1e-12 if uneven else np.ones(B + 1, dtype=bool)
    vals = D[B, ok]
    return float(vals.min()) if len(vals) else inf


def reference_unit_time(cluster: ClusterProfile, global_batch_size: int,
                        memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION) -> float:
    """Optimal max_i T_i by the paper's recurrence (no idle ranks); ``inf`` if infeasible.

    Raises:
        ValueError: the devices do not share one compute-memory line (the paper's assumption
            that makes k = Σ m determine the aggregate memory), or a non-linear (clamped) line.
    """
    lines = np.array([cost.memory_line(d) for d in cluster.devices])
    if not np.allclose(lines, lines[0], rtol=1e-9, atol=1.0):
        raise ValueError(f"reference DP needs one compute-memory model shared by all devices, "
                         f"got (slope, intercept) lines {lines.tolist()}")
    slope, m0 = lines[0]
    if slope < 0 or m0 < 0:
        raise ValueError(f"reference DP needs a non-negative memory line, got slope {slope}, "
                         f"intercept {m0}")
    if any(d.head_memory_bytes is not None for d in cluster.devices):
        raise ValueError("reference DP needs one activation line per device; the head-phase "
                         "curve (head_memory_bytes) makes M_i a maximum of two lines")
    model = cluster.model
    buf = memory.engine_buffers(model, cluster.world_size)
    step = max(buf.unit_bytes, buf.head_bytes)
    # M_i is the unit/head line when it binds at m = 1 and grows at least as fast as the
    # embedding backward's (m·a) for larger m
    other = max(buf.between_bytes,
                buf.embed_bytes + float(memory.embed_activation_bytes(model, 1)))
    if not cluster.buffers_in_compute_memory and (
            other > m0 + slope + step or slope < model.boundary_bytes_per_sample):
        raise ValueError("reference DP needs M_i linear in m: the buffers between phases or of "
                         f"the embedding backward ({other:.0f} B at m = 1) exceed the smallest "
                         "busy memory, or the activation line grows slower than the "
                         "embedding's output")
    if cluster.host_memory_bytes is not None and cluster.offload_activations:
        raise ValueError("reference DP has no host-memory constraint; drop host_memory_bytes")
    B, c = global_batch_size, memory_fraction
    even = _solve_case(cluster, B, c, uneven=False)
    uneven = _solve_case(cluster, B, c, uneven=True)
    return min(even, uneven)
