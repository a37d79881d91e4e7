"""The plan's memory: every buffer the engine allocates, per rank (docs/planner.md "Memory model").

Pure Python/numpy. One function per term, each citing the engine code it mirrors; the optimizer
(``optimize.py``), the predictions (``predict.py``) and the brute-force tests all price memory
through ``rank_memory_bytes`` and ``host_memory_bytes`` only.

[Note: memory terms]
Symbols: e = ``ModelProfile.param_bytes`` (element size of the flat buffers), N_u / N_r = elements
of one unit / of the root (embeddings + final norm + head), L = units, W = world size,
a = ``ModelProfile.boundary_bytes_per_sample`` (one sample's hidden state at a unit boundary),
rank i with b samples in microbatches of m, P_u = the largest shard of a unit (``ceil(N/W)`` when
even). Device memory of rank i = r_i·S + M_i(m, b) with

    M_i(m, b) = max( max(A_i(m) + E_bwd, A_head,i(m) + E_head) + D(m, b),  E_end )   (b > 0)
    M_i(0, 0) = E_idle                                                            (idle rank)

* r_i·S: training state, S = 16 B per parameter for fp32 Adam (paper §2.4): the local shard
  ``FlatParamUnit.local`` (4), its ``shard_param.grad`` (4), Adam's two moments (8). Frozen
  elements hold only the shard (4 B): S over-counts them.
* A_i(m): the profiled activation memory of ONE microbatch in a unit's recompute + backward
  (``DeviceProfile.compute_memory_bytes``, least-squares line); A_head,i(m): the same for the
  head's loss + backward beside the last unit's kept forward graph (``head_memory_bytes``;
  A_i(m) when absent). Both measured with the persistent gradient buffers already allocated
  (profiler/measure.py ``_compute_memory``).
* E_bwd: the engine buffers alive during a unit's backward (schedule.py
  ``LayeredStep.backward``): e·[N_u (current unit, ``_full``) + N_u (its flat gradient
  ``_leaf.grad``) + G_u (the next unit's all-gather in flight: output + send buffer) + R_u (the
  previous unit's reduce-scatter in flight: input + output)] + e·2·N_r when ``root_resident``
  (root gathered + full gradient, kept all step).
* E_head: during the head (``LayeredStep.head``): e·(2·N_r + N_u) (root gathered + its
  gradient; the last unit is not resharded before backward; no prefetch in flight).
* D(m, b): boundary tensors on the device (offload.py ``ActivationStash``): without offload every
  microbatch's boundary activation of every unit boundary is kept, (L + 1)·b·a at the end of the
  forward; with offload (CUDA) the current and prefetched input and boundary gradient plus the
  live copy, 5·m·a.
* E_end: the root's reduce-scatter at the end of the step (no activations then):
  e·(2·N_r + R_r + R_u) when ``root_resident`` (root gathered + gradient + its reduce-scatter
  buffers + unit 0's reduce-scatter in flight).
* E_idle: a rank without samples still gathers every unit and joins every reduce-scatter:
  e·(N_u + G_u + R_u + N_r) (the root is gathered, it gets no gradient).
* Host (pinned, CUDA offload only): (L + 1)·b·a per rank, summed over the ranks of one machine
  against c × that machine's RAM (``ClusterProfile.host_memory_bytes``).

G and R depend on the engine's collectives: ``collective_buffers`` is the one place that knows
them. Plans price variable-size collectives (G_u = N_u, R_u = N_u + the rank's shard: the
engine once the collectives branch is merged); ``padded=True`` prices the padded equal-size
collectives of engine/collectives.py before it (G_u = W·P_u [+ P_u send copy],
R_u = W·P_u + P_u), which tests use to check the terms against today's engine.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from hf_cephalo.profiler.types import ClusterProfile, DeviceProfile, ModelProfile

__all__ = ["CollectiveBuffers", "EngineBuffers", "collective_buffers", "engine_buffers",
           "activation_bytes", "head_activation_bytes", "device_stash_bytes", "host_memory_bytes", "rank_memory_bytes",
           "memory_line"]

# Device copies of boundary tensors with offload: current input + boundary gradient, their
# prefetched successors, and the live copy of the last offloaded tensor (offload.py).
_OFFLOADED_DEVICE_COPIES = 5


class CollectiveBuffers(NamedTuple):
    """Elements one collective of one unit keeps alive on one rank while in flight."""

    allgather_numel: int  # gathered output + send buffer
    reduce_scatter_numel: int  # input + output


def collective_buffers(unit_numel: int, world_size: int, row: Sequence[int] | None = None,
                       rank: int | None = None, *, padded: bool = False) -> CollectiveBuffers:
    """Buffers of one unit's all-gather and reduce-scatter on ``rank`` (elements).

    Default: variable-size collectives without padding (the collectives branch's engine, which
    the plans target): the all-gather output is the (N,) gathered unit itself and the send
    buffer is the local shard (no copy); the reduce-scatter input is the unit's gradient split
    in place (no copy, N while in flight) and its output this rank's shard (``row[rank]``, or
    ceil(N/W) before a layout exists). ``padded=True``: the padded equal-size collectives of
    engine/collectives.py before that change, P = max(row): all-gather output W·P plus a padded
    send copy of P when the rank's shard is smaller; reduce-scatter input W·P (a copy, or the
    gradient itself when even) and output P. Change the engine's collectives, change this.
    """
    n, w = int(unit_numel), int(world_size)
    if row is None:
        pad = mine = math.ceil(n / w)
    else:
        pad, mine = max(int(x) for x in row), int(row[rank])
    if not padded:
        return CollectiveBuffers(n, n + mine)
    send = pad if mine < pad else 0
    return CollectiveBuffers(w * pad + send, w * pad + pad)


class EngineBuffers(NamedTuple):
    """Per-rank engine buffer bytes independent of m (see [Note: memory terms])."""

    backward_bytes: float  # E_bwd: alive while a unit's microbatch recomputes + backpropagates
    head_bytes: float  # E_head: alive while the head's loss + backward runs
    end_bytes: float  # E_end: the root's reduce-scatter at the end of the step
    idle_bytes: float  # E_idle: a rank without samples


def _in_flight_numel(nu: int, world_size: int, layout, rank, padded: bool) -> tuple[int, int]:
    """(G + R during a unit's backward, R of unit 0) in elements, the largest over the units.

    During unit i's backward the engine holds unit i-1's all-gather and unit i+1's
    reduce-scatter in flight; with a layout those units' own rows are used (a padded buffer
    depends on its unit's largest shard), else even shards.
    """
    if layout is None:
        c = collective_buffers(nu, world_size, padded=padded)
        return c.allgather_numel + c.reduce_scatter_numel, c.reduce_scatter_numel
    bufs = [collective_buffers(nu, world_size, row, rank, padded=padded) for row in layout[:-1]]
    worst = max((bufs[i - 1].allgather_numel if i > 0 else 0)
                + (bufs[i + 1].reduce_scatter_numel if i + 1 < len(bufs) else 0)
                for i in range(len(bufs)))
    return worst, bufs[0].reduce_scatter_numel


def engine_buffers(model: ModelProfile, world_size: int, *, root_resident: bool = True,
                   layout: Sequence[Sequence[int]] | None = None,
                   rank: int | None = None, padded: bool = False) -> EngineBuffers:
    """E_step, E_end, E_idle of [Note: memory terms] in bytes.

    Args:
        model: the model profile (N_u, N_r, e).
        world_size: W.
        root_resident: the root stays gathered with its full gradient for the whole step (the
            engine today); False prices a root gathered only around its uses.
        layout / rank: the plan's per-unit shard layout (``Plan.unit_layout``, root LAST) and
            the rank, for the collective buffers of that layout; None prices even shards.
        padded: price the padded equal-size collectives (``collective_buffers``).
    """
    e, nu, nr = model.param_bytes, model.params_per_unit, model.params_other
    in_flight, rs_unit0 = _in_flight_numel(nu, world_size, layout, rank, padded)
    cr = collective_buffers(nr, world_size, None if layout is None else layout[-1], rank,
                            padded=padded)
    backward = 2 * nu + in_flight + (2 * nr if root_resident else 0)
    head = 2 * nr + nu  # root gathered + its gradient; the last unit stays gathered
    end = 2 * nr + cr.reduce_scatter_numel + rs_unit0 if root_resident else 0
    idle = nu + in_flight + nr
    return EngineBuffers(e * backward, e * head, e * end, e * idle)


def memory_line(device: DeviceProfile) -> tuple[float, float]:
    """(slope bytes/sample, intercept bytes) of the least-squares activation-memory line."""
    ms = np.asarray(device.microbatch_sizes, dtype=np.float64)
    vs = np.asarray(device.compute_memory_bytes, dtype=np.float64)
    if len(ms) == 1:
        return float(vs[0] / ms[0]), 0.0
    slope, intercept = np.polyfit(ms, vs, 1)
    return float(slope), float(intercept)


def activation_bytes(device: DeviceProfile, m) -> np.ndarray:
    """A_i(m): the profiled activation memory line at microbatch size m (bytes, >= 0; 0 at m=0)."""
    slope, intercept = memory_line(device)
    m = np.asarray(m, dtype=np.float64)
    return np.where(m > 0, np.maximum(slope * m + intercept, 0.0), 0.0)


def head_activation_bytes(device: DeviceProfile, m) -> np.ndarray:
    """A_head,i(m): the head phase's line (``head_memory_bytes``), else A_i(m) (bytes)."""
    if device.head_memory_bytes is None:
        return activation_bytes(device, m)
    return activation_bytes(DeviceProfile(
        name=device.name, memory_capacity_bytes=device.memory_capacity_bytes,
        microbatch_sizes=device.microbatch_sizes, fwd_s=device.fwd_s, bwd_s=device.bwd_s,
        compute_memory_bytes=device.head_memory_bytes), m)


def device_stash_bytes(model: ModelProfile, m, b, offload: bool) -> np.ndarray:
    """D(m, b): boundary tensors on the device, bytes (see [Note: memory terms])."""
    a = model.boundary_bytes_per_sample
    if offload:
        return _OFFLOADED_DEVICE_COPIES * a * np.asarray(m, dtype=np.float64)
    return (model.num_units + 1) * a * np.asarray(b, dtype=np.float64)


def host_memory_bytes(model: ModelProfile, b, offload: bool) -> np.ndarray:
    """Pinned host bytes of one rank's offloaded boundary tensors, (L + 1)·b·a (0 without)."""
    if not offload:
        return np.zeros(np.shape(b))
    return (model.num_units + 1) * model.boundary_bytes_per_sample * np.asarray(b, np.float64)


def rank_memory_bytes(cluster: ClusterProfile, rank: int, m, b, *, root_resident: bool = True,
                      layout: Sequence[Sequence[int]] | None = None,
                      padded: bool = False) -> np.ndarray:
    """M_i(m, b): device bytes of rank ``rank`` besides its training state (vectorized over m, b).

    ``b = 0`` (with m = 0) is an idle rank: E_idle. ``layout`` / ``padded``: see
    ``engine_buffers``. A profile whose compute memory already
    includes the engine's buffers (format 1, ``ClusterProfile.buffers_in_compute_memory``) is
    priced as before, A_i(m) alone (0 when idle).
    """
    device, model = cluster.devices[rank], cluster.model
    m = np.asarray(m, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    act = activation_bytes(device, m)
    if cluster.buffers_in_compute_memory:
        return np.where(b > 0, act, 0.0)
    buf = engine_buffers(model, cluster.world_size, root_resident=root_resident, layout=layout,
                         rank=rank, padded=padded)
    phases = np.maximum(act + buf.backward_bytes,
                        head_activation_bytes(device, m) + buf.head_bytes)
    busy = np.maximum(phases + device_stash_bytes(model, m, b, cluster.offload_activations),
                      buf.end_bytes)
    return np.where(b > 0, busy, buf.idle_bytes)
