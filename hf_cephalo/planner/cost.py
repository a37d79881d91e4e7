"""The latency/memory model of the paper (§2.4), docs/design.md contract 2.

All functions are pure numpy and vectorize over the microbatch size ``m`` (an int or an int
array). Units: seconds and bytes. Used by the optimizer (``optimize.py``), the state partition
(``state.py``) and the plan simulator (``simulate.py``).

* F_i(m), B_i(m): the profiled value at a profiled m; linear interpolation between profiled
  points; beyond the largest profiled m, the least-squares line through the upper profiled
  points (the upper half, at least two) -- "sublinear for small m, linear after" (paper §2.4,
  Fig. 5 left). A profile with only m = 1 extrapolates proportionally (F(m) = m·F(1)).
* A_i(m): least-squares line through all profiled activation-memory points (paper Fig. 5
  right); with only m = 1, proportional. Clamped at 0. The engine's buffers come on top
  (``memory.py``, [Note: memory terms]): M_i(m, b) = every device byte besides the state.
* Per-unit latency with l microbatches of size m (all-gather of the next unit overlaps compute;
  backward recomputes the forward because activations are checkpointed):
  ``T_i(l, m) = max(l·F(m), AG·u) + max(l·(F(m) + B(m)), (AG + RS)·u)``,
  u = the profile's measured ``CommProfile.uneven_factor`` if the plan shards the training
  state unevenly (1.15, the paper's bound, for profiles without a measurement), else 1. An idle rank (b_i = 0) pays
  ``AG·u + (AG + RS)·u`` and has no compute memory.
* Iteration time = num_units · max_i T_i.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

from hf_cephalo.planner.memory import activation_bytes, memory_line  # noqa: F401 (re-export)
from hf_cephalo.profiler.types import ClusterProfile, CommProfile, DeviceProfile

__all__ = [
    "UNEVEN_FACTOR",
    "DEFAULT_MEMORY_FRACTION",
    "fwd_time_s",
    "bwd_time_s",
    "compute_memory_bytes",
    "RankComputeTimes",
    "rank_compute_s",
    "uneven_factor",
    "unit_time_s",
    "unit_comm",
    "idle_unit_time_s",
    "iteration_time_s",
    "is_uneven",
]

UNEVEN_FACTOR = 1.15
"""u when not measured: collective slowdown of uneven shards, the paper's bound (§2.4/§3)."""
DEFAULT_MEMORY_FRACTION = 0.8
"""c: the fraction of each GPU's memory the plan may use (paper §3: cap at 80 %)."""


def _upper_line(ms: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the upper profiled points."""
    k = max(2, math.ceil(len(ms) / 2))
    slope, intercept = np.polyfit(ms[-k:], values[-k:], 1)
    return float(slope), float(intercept)


def _curve(ms_profiled: Sequence[int], values: Sequence[float], m) -> np.ndarray:
    ms = np.asarray(ms_profiled, dtype=np.float64)
    vs = np.asarray(values, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    if len(ms) == 1:
        return vs[0] * m / ms[0]
    out = np.interp(m, ms, vs)
    beyond = m > ms[-1]
    if np.any(beyond):
        slope, intercept = _upper_line(ms, vs)
        out = np.where(beyond, np.maximum(slope * m + intercept, 0.0), out)
    return out


def fwd_time_s(device: DeviceProfile, m) -> np.ndarray:
    """F_i(m): forward time of one unit for one microbatch of size ``m`` (seconds), m >= 1."""
    return _curve(device.microbatch_sizes, device.fwd_s, m)


def bwd_time_s(device: DeviceProfile, m) -> np.ndarray:
    """B_i(m): backward time (without recompute) of one unit, microbatch size ``m`` (seconds)."""
    return _curve(device.microbatch_sizes, device.bwd_s, m)


def compute_memory_bytes(device: DeviceProfile, m) -> np.ndarray:
    """A_i(m): the profiled activation memory line at microbatch size ``m``, bytes (0 at m = 0).

    The engine's buffers, the stash and the state come on top: ``memory.rank_memory_bytes``.
    """
    return activation_bytes(device, m)


class RankComputeTimes(NamedTuple):
    """Forward and backward seconds of ALL microbatches of one rank for one unit."""

    fwd_s: np.ndarray  # Σ_j F(m_j), seconds
    bwd_s: np.ndarray  # Σ_j B(m_j), seconds


def rank_compute_s(device: DeviceProfile, batch_size: int, microbatch_size) -> RankComputeTimes:
    """l·F(m) and l·B(m) of the cost model, with a smaller last microbatch priced at its own size.

    ``l = ceil(b / m)`` microbatches: ``l - 1`` of size m and the last of
    ``m_last = b - (l - 1)·m`` samples (``RankPlan.last_microbatch_size``); optimizer plans have
    m_last = m. ``microbatch_size`` may be an int array (vectorized over m); ``batch_size`` 0
    gives 0 seconds. Raises nothing; callers validate b, m >= 1.
    """
    m = np.asarray(microbatch_size, dtype=np.int64)
    if batch_size == 0:
        zero = np.zeros(m.shape)
        return RankComputeTimes(zero, zero)
    ls = -(-batch_size // m)  # ceil
    last = batch_size - (ls - 1) * m
    fwd = (ls - 1) * fwd_time_s(device, m) + fwd_time_s(device, last)
    bwd = (ls - 1) * bwd_time_s(device, m) + bwd_time_s(device, last)
    return RankComputeTimes(fwd, bwd)


def uneven_factor(comm: CommProfile) -> float:
    """u: the profile's measured uneven factor, else the paper's bound ``UNEVEN_FACTOR`` (1.15)."""
    return UNEVEN_FACTOR if comm.uneven_factor is None else float(comm.uneven_factor)


def unit_comm(cluster: ClusterProfile) -> CommProfile:
    """AG and RS of one unit at the job's collective element sizes, seconds.

    The profile's ``allgather_s`` / ``reducescatter_s`` move the unit in its master dtype
    (``ModelProfile.param_bytes``: ``profiler.measure.measure_comm`` times the model's own
    dtype; spec-sheet estimates assume fp32). A low-precision ``param_dtype`` all-gathers e_p
    bytes per element and a low ``reduce_dtype`` reduce-scatters e_r, so the times scale by
    e_p / e and e_r / e (bandwidth-bound collectives; the latency part is scaled too, an
    underestimate for small units).
    """
    model, comm = cluster.model, cluster.comm
    ag = model.param_gather_bytes / model.param_bytes
    rs = model.grad_reduce_bytes / model.param_bytes
    if ag == 1.0 and rs == 1.0:
        return comm
    return dataclasses.replace(comm, allgather_s=comm.allgather_s * ag,
                               reducescatter_s=comm.reducescatter_s * rs)


def unit_time_s(fwd_s, bwd_s, num_microbatches, comm: CommProfile, uneven: bool) -> np.ndarray:
    """T_i(l, m) for one unit (forward + backward with recompute), seconds.

    Args:
        fwd_s, bwd_s: F_i(m), B_i(m) (scalars or arrays, broadcast together).
        num_microbatches: l (0 for an idle rank, which then only waits on the collectives).
        comm: AG and RS for one unit with even shards.
        uneven: whether the plan shards state unevenly (u = ``uneven_factor(comm)``).
    """
    u = uneven_factor(comm) if uneven else 1.0
    ag = comm.allgather_s * u
    agrs = (comm.allgather_s + comm.reducescatter_s) * u
    l = np.asarray(num_microbatches, dtype=np.float64)
    f = np.asarray(fwd_s, dtype=np.float64)
    b = np.asarray(bwd_s, dtype=np.float64)
    return np.maximum(l * f, ag) + np.maximum(l * (f + b), agrs)


def idle_unit_time_s(comm: CommProfile, uneven: bool) -> float:
    """T_i of a rank with b_i = 0: ``AG·u + (AG + RS)·u`` seconds."""
    return float(unit_time_s(0.0, 0.0, 0, comm, uneven))


def iteration_time_s(unit_times_s: Sequence[float], num_units: int) -> float:
    """num_units · max_i T_i, seconds."""
    return float(num_units * max(unit_times_s))


def is_uneven(cluster: ClusterProfile, compute_memory: Sequence[float],
              memory_fraction: float) -> bool:
    """docs/design.md contract 2: uneven iff S/N + M_i > c·C_i for some rank.

    ``compute_memory``: M_i per rank, every byte besides the state (``memory.rank_memory_bytes``).
    """
    n = cluster.world_size
    share = cluster.model.state_bytes / n
    return any(share + mem > memory_fraction * d.memory_capacity_bytes
               for d, mem in zip(cluster.devices, compute_memory))
