"""The latency/memory model of the paper (§2.4), docs/design.md contract 2.

Pure numpy, vectorized over the microbatch size ``m`` (an int or an int array); seconds and
bytes. Used by the optimizer (``optimize.py``), the state partition (``state.py``) and the plan
simulator (``simulate.py``). F_i(m), B_i(m) interpolate the profile, A_i(m) is a line through
the profiled activation memory (the engine's buffers on top: ``memory.py``, [Note: memory
terms]), T_i(l, m) is one unit's time with the next unit's all-gather and its reduce-scatter
overlapped ([Note: unit time without activation checkpointing]), and the terms outside the units
are [Note: step terms]; a profile without those terms prices them at 0, the paper's model.
Formulas, the uneven factor u and an idle rank's terms: docs/planner.md, "Cost model".
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

from hf_cephalo.planner.memory import activation_bytes, memory_line  # noqa: F401 (re-export)
from hf_cephalo.planner.types import DEFAULT_MEMORY_FRACTION  # noqa: F401 (re-export)
from hf_cephalo.profiles.types import ClusterProfile, CommProfile, DeviceProfile

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
    "forward_unit_time_s",
    "iteration_time_s",
    "is_uneven",
    "STEP_ALLREDUCES",
    "root_compute_s",
    "optimizer_step_s",
    "rank_extra_s",
    "step_comm_s",
    "blocking_collectives",
    "StepTerms",
    "step_terms",
    "step_time_from_terms",
]

UNEVEN_FACTOR = 1.15
"""u when not measured: collective slowdown of uneven shards, the paper's bound (§2.4/§3)."""


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


def _rows(device: DeviceProfile, m) -> np.ndarray:
    """The sequence rows of a microbatch of ``m`` samples: k·m (k = ``rows_per_sample``)."""
    return device.rows_per_sample * np.asarray(m, dtype=np.float64)


def fwd_time_s(device: DeviceProfile, m) -> np.ndarray:
    """F_i(m): forward time of one unit for one microbatch of ``m`` samples (seconds), m >= 1;
    the profiled per-row curve at k·m rows (planner/rows.py)."""
    return _curve(device.microbatch_sizes, device.fwd_s, _rows(device, m))


def bwd_time_s(device: DeviceProfile, m) -> np.ndarray:
    """B_i(m): backward time (without recompute) of one unit, microbatch of ``m`` samples
    (seconds; the per-row curve at k·m rows)."""
    return _curve(device.microbatch_sizes, device.bwd_s, _rows(device, m))


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
    (``ModelProfile.param_bytes``: ``profiler.comm.measure_comm`` times the model's own
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


# [Note: unit time without activation checkpointing]
# F(m) is one unit's forward without autograd and B(m) = (recompute + backward) - forward of the
# same repeat (profiler/compute.py), so F + B is what one microbatch's recompute with autograd
# plus its backward costs. With checkpointing a unit runs l forwards, then l recomputes +
# backwards:
#     T = max(l·F, AG·u) + max(l·(F + B), (AG + RS)·u).
# Without it (engine ``activation_checkpointing=False``) each forward runs once with autograd and
# the backward pass runs the backward proper, the same F + B per microbatch, priced as
#     T = max(l·F, AG·u) + max(l·B, (AG + RS)·u).
# The root terms and the bookkeeping o_i are the same in both modes. Why this split between the
# passes: docs/planner.md, "Activation checkpointing as a planned choice".
def unit_time_s(fwd_s, bwd_s, num_microbatches, comm: CommProfile, uneven: bool, *,
                activation_checkpointing: bool = True) -> np.ndarray:
    """T_i(l, m) for one unit (forward + backward, with or without recompute), seconds.

    Args:
        fwd_s, bwd_s: F_i(m), B_i(m) (scalars or arrays, broadcast together).
        num_microbatches: l (0 for an idle rank, which then only waits on the collectives).
        comm: AG and RS for one unit with even shards.
        uneven: whether the plan shards state unevenly (u = ``uneven_factor(comm)``).
        activation_checkpointing: True (the paper's model): the backward recomputes the
            forward, ``max(l·F, AG·u) + max(l·(F + B), (AG + RS)·u)``; False: the forward's
            graphs are kept, ``max(l·F, AG·u) + max(l·B, (AG + RS)·u)`` ([Note: unit time
            without activation checkpointing]).

    With ``comm.overlaps_compute`` False (CPU ranks, gloo) the collectives add to the compute:
    ``l·F + AG·u + l·(F + B) + (AG + RS)·u`` (without checkpointing ``l·F + AG·u + l·B +
    (AG + RS)·u``).
    """
    u = uneven_factor(comm) if uneven else 1.0
    ag = comm.allgather_s * u
    agrs = (comm.allgather_s + comm.reducescatter_s) * u
    l = np.asarray(num_microbatches, dtype=np.float64)
    f = np.asarray(fwd_s, dtype=np.float64)
    b = np.asarray(bwd_s, dtype=np.float64)
    backward = l * (f + b) if activation_checkpointing else l * b
    if not comm.overlaps_compute:  # the collectives take the compute's cores: they add
        return l * f + ag + backward + agrs
    return np.maximum(l * f, ag) + np.maximum(backward, agrs)


def forward_unit_time_s(fwd_s, comm: CommProfile, uneven: bool) -> np.ndarray:
    """One unit of a forward-only layered pass (the old policy's or the reference's
    log-probabilities of an RL step) on a rank whose microbatches' forwards of that unit take
    ``fwd_s`` = Σ_j F_i(m_j) seconds (0 for an idle rank): ``max(fwd_s, AG·u)``, the next
    unit's all-gather hidden under the compute, or ``fwd_s + AG·u`` where the collectives take
    the compute's cores (``comm.overlaps_compute`` False); u = ``uneven_factor(comm)`` when
    ``uneven``, else 1. Seconds; vectorized over ``fwd_s``; raises nothing. The forward half
    of ``unit_time_s`` (docs/planner.md, "Scoring passes in the objective")."""
    ag = comm.allgather_s * (uneven_factor(comm) if uneven else 1.0)
    f = np.asarray(fwd_s, dtype=np.float64)
    if not comm.overlaps_compute:
        return f + ag
    return np.maximum(f, ag)


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


# [Note: step terms]
# The paper prices the L units only; on small models and on CPU the rest of a step is a large
# part of it (~40 % on the main job). A step runs in phases separated by collectives, and at each
# one every rank waits for the slowest:
#
#     step = max_i busy_i + max_i opt_i + max_i s_i + C
#
# busy_i: the compute phase (units, embedding and head per microbatch, bookkeeping); opt_i: the
# optimizer on the shard; s_i: the loop's own time; C: the collectives no compute hides. Pricing
# the compute phase as the slowest rank's total (one rank slowest throughout) keeps the
# optimizer exact: max_i busy_i = L·max_i (T_i + extra_i / L) (``rank_extra_s``), while opt_i,
# s_i and C do not depend on (b_i, m_i, l_i). Each term, its profile field and w:
# docs/planner.md, "Cost model".
STEP_ALLREDUCES = 3
"""Small all-reduces per training step: the global item count, the loss sum, the gradient norm."""


def _per_microbatch_sum(ms_profiled, values, batch_size, microbatch_size,
                        rows_per_sample: int = 1) -> np.ndarray:
    """Σ_j v(k·m_j) over ceil(b/m) microbatches (the last one of b - (l-1)·m samples; k rows
    per sample), seconds; vectorized over b and m; 0 for b = 0 or a table that is None."""
    b = np.asarray(batch_size, dtype=np.int64)
    m = np.maximum(np.asarray(microbatch_size, dtype=np.int64), 1)
    if values is None:
        return np.zeros(np.broadcast(b, m).shape)
    ls = -(-b // m)
    last = np.maximum(b - np.maximum(ls - 1, 0) * m, 1)
    k = rows_per_sample
    total = np.maximum(ls - 1, 0) * _curve(ms_profiled, values, k * m) + \
        _curve(ms_profiled, values, k * last)
    return np.where(b > 0, total, 0.0)


def root_compute_s(device: DeviceProfile, batch_size, microbatch_size) -> np.ndarray:
    """Σ_j (E(m_j) + H(m_j)): embedding (forward + recompute + backward) and head (loss +
    backward) compute of a rank's microbatches, seconds. b and m broadcast together; 0 for
    b = 0 or a profile without ``embed_s`` / ``head_s``."""
    ms, k = device.microbatch_sizes, device.rows_per_sample
    return (_per_microbatch_sum(ms, device.embed_s, batch_size, microbatch_size, k)
            + _per_microbatch_sum(ms, device.head_s, batch_size, microbatch_size, k))


def rank_extra_s(cluster: ClusterProfile, rank: int, batch_size, microbatch_size) -> np.ndarray:
    """busy_i - L·T_i of [Note: step terms]: root compute and engine bookkeeping of ``rank``
    with b samples in microbatches of m, seconds. b and m (int arrays allowed) broadcast
    together; 0 for an idle rank (b = 0)."""
    device, L = cluster.devices[rank], cluster.model.num_units
    b = np.asarray(batch_size, dtype=np.int64)
    m = np.maximum(np.asarray(microbatch_size, dtype=np.int64), 1)
    return root_compute_s(device, b, m) + (-(-b // m)) * L * device.microbatch_overhead_s


def optimizer_step_s(device: DeviceProfile, model, state_ratio: float) -> float:
    """opt_i = r_i · P_t · p_i: optimizer step + clipping on a shard of ``state_ratio`` of the
    trainable parameters, seconds (``DeviceProfile.optimizer_s_per_param``)."""
    return float(state_ratio) * model.num_trainable_params * device.optimizer_s_per_param


def blocking_collectives(num_units: int) -> int:
    """Collectives a step waits on (engine/schedule.py [Note: layered schedule], split root):
    per unit its forward all-gather, its backward all-gather and reduce-scatter (3L); the
    embedding unit's two all-gathers, the head's all-gather, the reduce-scatters waited at the
    end (head and embedding); the ``STEP_ALLREDUCES`` all-reduces: 3L + 8."""
    return 3 * num_units + 5 + STEP_ALLREDUCES


def step_comm_s(cluster: ClusterProfile) -> float:
    """C of [Note: step terms]: the root's collectives, the step's small all-reduces and the
    rendezvous of every blocking collective (``CommProfile.collective_wait_s`` ×
    ``blocking_collectives``), seconds, at the job's collective element sizes (scaled as
    ``unit_comm``)."""
    model, comm = cluster.model, cluster.comm
    ag = model.param_gather_bytes / model.param_bytes
    rs = model.grad_reduce_bytes / model.param_bytes
    return comm.root_allgather_s * ag + comm.root_reducescatter_s * rs + \
        STEP_ALLREDUCES * comm.allreduce_s + \
        blocking_collectives(model.num_units) * comm.collective_wait_s


class StepTerms(NamedTuple):
    """One rank's share of a training step, seconds ([Note: step terms]); their sum is the
    step time, the same on every rank."""

    units_s: float  # L·T_i: the units' compute and the collectives it hides
    root_s: float  # embedding + head compute of the rank's microbatches
    bookkeeping_s: float  # engine bookkeeping: l_i·L·o_i
    optimizer_s: float  # optimizer step + clipping on the rank's shard
    host_s: float  # the training loop's own time per step
    comm_s: float  # the step's collectives outside the units (same on every rank)
    wait_s: float  # waiting for slower ranks at the phases' collectives

    @property
    def busy_s(self) -> float:
        """Compute phase: units + root + bookkeeping, seconds."""
        return self.units_s + self.root_s + self.bookkeeping_s

    @property
    def step_s(self) -> float:
        """The step time, seconds (every term; equal on every rank up to rounding)."""
        return sum(self)


def step_terms(cluster: ClusterProfile, unit_times_s: Sequence[float],
               batch_sizes: Sequence[int], microbatch_sizes: Sequence[int],
               state_ratios: Sequence[float]) -> list[StepTerms]:
    """Every rank's ``StepTerms`` (rank order) for T_i = ``unit_times_s`` (``unit_time_s``, an
    idle rank's ``idle_unit_time_s``), b_i, m_i and r_i. The step time is
    ``step_time_from_terms``."""
    L, model = cluster.model.num_units, cluster.model
    comm = step_comm_s(cluster)
    rows = []
    for i, (t, b, m, r) in enumerate(zip(unit_times_s, batch_sizes, microbatch_sizes,
                                         state_ratios)):
        d = cluster.devices[i]
        ls = -(-int(b) // max(int(m), 1))
        rows.append((L * float(t), float(root_compute_s(d, b, m)),
                     ls * L * d.microbatch_overhead_s, optimizer_step_s(d, model, r),
                     d.step_overhead_s))
    busy = [u + r + k for u, r, k, _, _ in rows]
    top = (max(busy), max(r[3] for r in rows), max(r[4] for r in rows))
    return [StepTerms(*row, comm_s=comm,
                      wait_s=(top[0] - w) + (top[1] - row[3]) + (top[2] - row[4]))
            for row, w in zip(rows, busy)]


def step_time_from_terms(terms: Sequence[StepTerms]) -> float:
    """max_i busy_i + max_i opt_i + max_i s_i + C, seconds; with no step terms in the profile
    exactly num_units · max_i T_i (``iteration_time_s``)."""
    return (max(t.busy_s for t in terms) + max(t.optimizer_s for t in terms)
            + max(t.host_s for t in terms) + terms[0].comm_s)
