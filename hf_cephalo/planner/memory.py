"""The plan's memory: every buffer the engine allocates, per rank (docs/planner.md "Memory model").

Pure Python/numpy. One function per term, each citing the engine code it mirrors; the optimizer
(``optimize.py``), the predictions (``predict.py``) and the brute-force tests all price memory
through ``rank_memory_bytes`` and ``host_memory_bytes`` only.

[Note: memory terms]
Device memory of rank i is r_i·S + M_i(m, b): its shards' training state plus, over the phases
of engine/schedule.py [Note: layered schedule], the peak of the gathered units, their flat
gradients, the collectives' buffers in flight (flat_param.py [Note: communication buffers]),
one microbatch's profiled activations and the stashed boundary tensors; an idle rank holds
E_idle. Each term mirrors one engine allocation at the moment the engine makes it, and each is
a per-rank constant, a function of m or linear in b, so the optimizer's search stays exact.
Change a term with the engine, never alone (tests/test_plan_memory.py compares them). Symbols,
phases, precision, frozen parameters, ``root_resident``: docs/planner.md, "Memory model".
Without activation checkpointing: [Note: memory without activation checkpointing] below.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from hf_cephalo.profiles.types import ClusterProfile, DeviceProfile, ModelProfile

__all__ = ["CollectiveBuffers", "EngineBuffers", "collective_buffers", "engine_buffers",
           "activation_bytes", "head_activation_bytes", "embed_activation_bytes",
           "device_stash_bytes", "side_input_bytes", "host_memory_bytes", "rank_memory_bytes", "memory_line",
           "model_layout_numels", "kept_graph_bytes", "kept_graphs_bytes"]

# Device copies of boundary tensors with offload: current input + boundary gradient, their
# prefetched successors, and the live copy of the last offloaded tensor (offload.py).
_OFFLOADED_DEVICE_COPIES = 5


class CollectiveBuffers(NamedTuple):
    """Elements one unit's collectives keep alive on one rank while in flight."""

    allgather_numel: int  # G: the (N,) output, which becomes the gathered unit
    reduce_scatter_numel: int  # R: the (N,) gradient it reads + this rank's (k,) output


def collective_buffers(unit_numel: int, world_size: int, row: Sequence[int] | None = None,
                       rank: int | None = None) -> CollectiveBuffers:
    """Buffers of one unit's all-gather and reduce-scatter on ``rank`` (elements).

    The engine's variable-size collectives (engine/collectives.py [Note: uneven collectives]):
    the all-gather sends the local shard itself and its output is the (N,) gathered unit; the
    reduce-scatter reads the unit's gradient in place (no copy, N while in flight) and writes
    this rank's shard (``row[rank]``, or ceil(N/W) before a layout exists). Change the
    engine's collectives, change this.
    """
    n = int(unit_numel)
    mine = math.ceil(n / int(world_size)) if row is None else int(row[rank])
    return CollectiveBuffers(n, n + mine)


class EngineBuffers(NamedTuple):
    """Per-rank engine buffer bytes of each moment of the step, independent of m and b
    (see [Note: memory terms])."""

    unit_bytes: float  # E_unit: a unit's microbatch recomputes + backpropagates
    head_bytes: float  # E_head: the head's loss + backward runs
    between_bytes: float  # E_between: reduce-scatters issued between phases, no activations
    embed_bytes: float  # E_emb: the embedding backward and its reduce-scatter
    idle_bytes: float  # E_idle: a rank without samples


def model_layout_numels(model: ModelProfile) -> list[int]:
    """Elements of the engine's units in its order: the L layers, the embedding, the head."""
    split = model.root_split()
    return model.unit_numels() + [split.embed_numel, split.head_numel]


class _Unit(NamedTuple):
    """One unit as this rank sees it (elements): its numel N, trainable numel Nt (engine/
    flat_param.py [Note: two parts per unit]), this rank's shard k and its trainable share kt
    (``split_unit_row``: Nt·k/N up to rounding)."""

    n: float
    nt: float
    k: float
    kt: float

    @classmethod
    def of(cls, n: float, nt: float, k: float) -> "_Unit":
        return cls(float(n), float(nt), float(k), nt * k / n if n else 0.0)

    def __add__(self, other: "_Unit") -> "_Unit":  # type: ignore[override]
        return _Unit(*(a + b for a, b in zip(self, other)))


class _Shards(NamedTuple):
    """Every unit of this rank: layers, embedding, head."""

    units: list[_Unit]
    embed: _Unit
    head: _Unit


def _shards(model: ModelProfile, world_size: int, layout, rank) -> _Shards:
    numels = model_layout_numels(model)
    _, nt_embed, nt_head = model.unit_trainable_numels()
    nts = model.layer_trainable_numels() + [nt_embed, nt_head]
    if layout is None:
        ks = [collective_buffers(n, world_size).reduce_scatter_numel - n for n in numels]
    else:
        if len(layout) != len(numels):
            raise ValueError(f"layout has {len(layout)} rows; the engine has {len(numels)} units "
                             f"({model.num_units} layers, the embedding, the head): use "
                             "planner.predict.plan_layout")
        ks = [collective_buffers(n, world_size, row, rank).reduce_scatter_numel - n
              for n, row in zip(numels, layout)]
    units = [_Unit.of(n, nt, k) for n, nt, k in zip(numels, nts, ks)]
    return _Shards(units[:-2], units[-2], units[-1])


class _Sizes(NamedTuple):
    """Element sizes of the engine's buffers (bytes): gathered trainable parts and their
    all-gathers (e_p), gathered frozen parts (e_f: their storage dtype unless stored in the
    training dtype, then e_p), unit gradients (e, the fp32 accumulator), reduce-scatters (e_r);
    see [Note: memory terms]. Gradients and reduce-scatters cover the Nt trainable elements
    only; an all-gather covers both parts."""

    gathered: float  # e_p
    grad: float  # e
    reduce: float  # e_r
    frozen: float  # e_f, gathered frozen element
    frozen_cast: bool  # the frozen part's all-gather sends a cast copy of the shard

    @classmethod
    def of(cls, model: ModelProfile) -> "_Sizes":
        own = model.frozen_bytes_per_param != model.param_bytes  # stored in its own dtype
        frozen = model.frozen_bytes_per_param if own else model.param_gather_bytes
        return cls(model.param_gather_bytes, model.param_bytes, model.grad_reduce_bytes,
                   frozen, not own and frozen != model.param_bytes)

    def unit(self, u: _Unit) -> float:
        """The gathered unit: e_p·Nt + e_f·(N - Nt)."""
        return self.gathered * u.nt + self.frozen * (u.n - u.nt)

    def gradient(self, u: _Unit) -> float:
        """The unit's gradient accumulator, e·Nt."""
        return self.grad * u.nt

    def ag(self, u: _Unit) -> float:
        """G: an all-gather in flight, its (N,) output (+ the cast send copies when low)."""
        cast = (self.gathered * u.kt if self.gathered != self.grad else 0.0) + \
            (self.frozen * (u.k - u.kt) if self.frozen_cast else 0.0)
        return self.unit(u) + cast

    def rs(self, u: _Unit) -> float:
        """R: a reduce-scatter in flight, its (Nt,) input and (kt,) output at e_r."""
        return self.reduce * (u.nt + u.kt)

    def issue(self, u: _Unit) -> float:
        """The unit's gradient at its reduce-scatter's issue: the (Nt,) accumulator and the
        (kt,) output, or with a low e_r the accumulator and its (Nt,) cast copy (the larger)."""
        if self.reduce == self.grad:
            return self.grad * (u.nt + u.kt)
        return max(self.grad * u.nt + self.reduce * u.nt, self.rs(u))


def _unit_moments(model: ModelProfile, k: _Shards, resident: bool,
                  z: _Sizes) -> tuple[float, float, float]:
    """Bytes (largest busy, largest between, largest idle) unit moment over the units i:
    e_p·N_u + e·N_u + G(i-1) + R(i+1) (N_u split into its trainable and frozen parts), the
    same with unit i's reduce-scatter issued, and a rank without gradients issuing zeros."""
    L = model.num_units
    tied = model.root_split().tied
    busy = between = idle = 0.0
    for i in range(L):
        u = k.units[i]
        if i > 0:
            ag = z.ag(k.units[i - 1])
        else:
            ag = 0.0 if resident else z.ag(k.embed)
        if i + 1 < L:
            rs = z.rs(k.units[i + 1])
        else:
            rs = 0.0 if resident else z.rs(k.head) + (z.rs(k.embed) if tied else 0.0)
        rest = z.unit(u) + ag + rs
        busy = max(busy, rest + z.gradient(u))
        between = max(between, rest + z.issue(u))
        idle = max(idle, rest + z.rs(u))
    return busy, between, idle


def engine_buffers(model: ModelProfile, world_size: int, *, root_resident: bool = False,
                   layout: Sequence[Sequence[int]] | None = None,
                   rank: int | None = None) -> EngineBuffers:
    """E_unit, E_head, E_between, E_emb, E_idle of [Note: memory terms] in bytes.

    Args:
        model: the model profile (N_u, the root's split, the trainable numel of each unit,
            e, e_p, e_r, e_f).
        world_size: W.
        root_resident: the engine's ``root_resident``: E and H gathered (with their gradients)
            all step; False (the engine's default) gathers each around its uses.
        layout / rank: the plan's per-unit shard layout (``predict.plan_layout``: the L layers,
            the embedding, the head) and the rank; None prices even shards.
    Raises:
        ValueError: a layout with another number of rows than the engine has units.
    """
    z = _Sizes.of(model)
    tied = model.root_split().tied
    k = _shards(model, world_size, layout, rank)
    E, H, last = k.embed, k.head, k.units[-1]
    busy, between, idle_unit = _unit_moments(model, k, root_resident, z)
    r0 = z.rs(k.units[0])  # unit 0's reduce-scatter, in flight in the embedding backward
    g_p = z.unit(H) + (z.unit(E) if tied else 0.0)  # the head phase's units gathered
    grads_p = z.gradient(H) + (z.gradient(E) if tied else 0.0)  # ... and their gradients
    if root_resident:  # both gathered all step; the head phase's gradients from the head on
        R = E + H
        held = z.unit(R) + grads_p
        head = z.unit(R) + z.unit(last) + grads_p
        ends = z.issue(R) - z.gradient(R)  # the root's reduce-scatters at the end
        embed = z.unit(R) + z.gradient(R) + r0 + ends
        idle_embed = z.unit(R) + r0 + z.rs(R)
        idle = max(idle_unit + z.unit(R), z.unit(R) + z.unit(last), idle_embed)
        return EngineBuffers(busy + held, head, between + held, embed, idle)
    head = g_p + z.unit(last) + grads_p
    head_between = g_p + z.unit(last) + grads_p - z.gradient(H) + z.issue(H)
    if tied:  # H's reduce-scatter in flight, its gathered buffer released, E's issued
        head_between = max(head_between, z.unit(E) + z.unit(last) + z.rs(H) + z.issue(E))
    embed = z.unit(E) + z.issue(E) + r0
    idle_head = z.unit(last) + g_p + z.rs(H)
    if tied:
        idle_head = max(idle_head, z.unit(last) + z.unit(E) + z.rs(H) + z.rs(E))
    idle = max(idle_unit, idle_head, z.unit(E) + z.rs(E) + r0)
    return EngineBuffers(busy, head, max(between, head_between), embed, idle)


def memory_line(device: DeviceProfile) -> tuple[float, float]:
    """(slope bytes/sample, intercept bytes) of the least-squares activation-memory line: the
    line α·r + β through the profiled rows r, per sample of k = ``rows_per_sample`` rows
    (α·k, β) (planner/rows.py)."""
    ms = np.asarray(device.microbatch_sizes, dtype=np.float64)
    vs = np.asarray(device.compute_memory_bytes, dtype=np.float64)
    if len(ms) == 1:
        return float(vs[0] / ms[0]) * device.rows_per_sample, 0.0
    slope, intercept = np.polyfit(ms, vs, 1)
    return float(slope) * device.rows_per_sample, float(intercept)


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
        compute_memory_bytes=device.head_memory_bytes,
        rows_per_sample=device.rows_per_sample), m)


def embed_activation_bytes(model: ModelProfile, m) -> np.ndarray:
    """A_emb(m): the embedding backward's temporaries, e_p·Nt_E + m·(a + s) bytes (the dense
    weight gradients of its Nt_E trainable elements in the gathered dtype, each added in place
    into the unit's flat gradient: no concatenation; the recomputed embedding output and side
    inputs, s = ``side_bytes_per_sample``, 0 without side inputs). The embedding's other
    intermediates (a side input's projection and norm) are not priced."""
    e, nt_embed = model.param_gather_bytes, model.unit_trainable_numels()[1]
    per_sample = model.boundary_bytes_per_sample + model.side_bytes_per_sample
    return e * nt_embed + per_sample * np.asarray(m, dtype=np.float64)


def device_stash_bytes(model: ModelProfile, m, b, offload: bool,
                       levels: int | None = None) -> np.ndarray:
    """D(m, b): boundary tensors on the device, bytes (see [Note: memory terms]).

    ``levels``: unit boundaries whose tensors are stashed, L + 1 when None (the forward's end,
    the head and the units' backward); 1 in the embedding backward (D_1).
    """
    a = model.boundary_bytes_per_sample
    if offload:
        return _OFFLOADED_DEVICE_COPIES * a * np.asarray(m, dtype=np.float64)
    levels = model.num_units + 1 if levels is None else levels
    return levels * a * np.asarray(b, dtype=np.float64)


def side_input_bytes(model: ModelProfile, b) -> np.ndarray:
    """s·b: one rank's side inputs on the device, bytes (s = ``side_bytes_per_sample`` =
    s_E + s_U, the bytes per sample of those the embedding makes and of those a unit k makes,
    e.g. an encoder's output; engine/schedule.py [Note: side inputs]). The embedding's live in
    each microbatch's ctx from the forward's embedding to E's backward, a unit's from k's
    forward to k's backward; their gradient sums, s·b more at most, exist only in the backward
    (``rank_memory_bytes`` adds them to the unit and embedding phases, where the backward runs:
    [Note: side inputs by phase]; an upper bound after k's backward). Not offloaded."""
    return model.side_bytes_per_sample * np.asarray(b, dtype=np.float64)


def host_memory_bytes(model: ModelProfile, b, offload: bool) -> np.ndarray:
    """Pinned host bytes of one rank's offloaded boundary tensors, (L + 1)·b·a (0 without)."""
    if not offload:
        return np.zeros(np.shape(b))
    return (model.num_units + 1) * model.boundary_bytes_per_sample * np.asarray(b, np.float64)


def kept_graph_bytes(device: DeviceProfile, m) -> np.ndarray:
    """K_i(m): bytes one microbatch's kept forward graph of one unit holds until its backward
    (the profile's ``kept_graph_bytes``: saved tensors + output), on the least-squares line
    through the profiled points like A_i(m); 0 at m = 0.

    Raises:
        ValueError: the profile has no ``kept_graph_bytes`` (measured before it existed, or a
            spec-sheet profile): only plans with activation checkpointing can be priced.
    """
    if device.kept_graph_bytes is None:
        raise ValueError(f"device profile {device.name!r} has no kept_graph_bytes, so a plan "
                         "without activation checkpointing cannot be priced; re-profile with "
                         "this version (`hf-cephalo profile`, or delete the profile cache "
                         "entry) or plan with activation checkpointing")
    return activation_bytes(DeviceProfile(
        name=device.name, memory_capacity_bytes=device.memory_capacity_bytes,
        microbatch_sizes=device.microbatch_sizes, fwd_s=device.fwd_s, bwd_s=device.bwd_s,
        compute_memory_bytes=device.kept_graph_bytes,
        rows_per_sample=device.rows_per_sample), m)


def kept_graphs_bytes(cluster: ClusterProfile, rank: int, m, b) -> np.ndarray:
    """L·Σ_j K_i(m_j): every kept graph of rank ``rank`` with b samples in microbatches of m
    (the last one b - (l - 1)·m samples, l = ceil(b / m)), bytes; 0 for b = 0. See [Note:
    memory without activation checkpointing]."""
    device, L = cluster.devices[rank], cluster.model.num_units
    m = np.asarray(m, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    safe_m = np.maximum(m, 1.0)
    ls = np.ceil(b / safe_m)
    last = b - np.maximum(ls - 1, 0.0) * safe_m
    per_unit = np.maximum(ls - 1, 0.0) * kept_graph_bytes(device, safe_m) + \
        kept_graph_bytes(device, last)
    return np.where(b > 0, L * per_unit, 0.0)


# [Note: memory without activation checkpointing]
# With ``activation_checkpointing=False`` (schedule.py ``_forward_kept``) every (unit,
# microbatch) forward graph, K(m) bytes each (``kept_graph_bytes``), lives from its forward to
# its unit's backward, so all L·l of them are alive through the head phase, the peak. The
# terms add them on top of the checkpointing model without counting one graph twice (A_i(m)
# and A_head,i(m) already hold one) and without counting the gathered parameters a graph saves
# (reshard frees their storage: [Note: kept graphs across reshard] in flat_param.py). Each
# term per moment: docs/planner.md, "Activation checkpointing as a planned choice".
def rank_memory_bytes(cluster: ClusterProfile, rank: int, m, b, *, root_resident: bool = False,
                      layout: Sequence[Sequence[int]] | None = None,
                      activation_checkpointing: bool = True) -> np.ndarray:
    """M_i(m, b): device bytes of rank ``rank`` besides its training state (vectorized over m, b).

    ``b = 0`` (with m = 0) is an idle rank: E_idle. ``root_resident`` / ``layout``: see
    ``engine_buffers``. ``activation_checkpointing=False``: the engine keeps every forward
    graph ([Note: memory without activation checkpointing]; needs the profile's
    ``kept_graph_bytes``, else ValueError from ``kept_graph_bytes``). A profile whose compute
    memory already includes the engine's buffers (format 1,
    ``ClusterProfile.buffers_in_compute_memory``) is priced as before, A_i(m) alone (0 when
    idle; plus the other kept graphs without checkpointing).
    """
    device, model = cluster.devices[rank], cluster.model
    m = np.asarray(m, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    act = activation_bytes(device, m)
    kept = 0.0 if activation_checkpointing else kept_graphs_bytes(cluster, rank, m, b)
    others = 0.0 if activation_checkpointing else \
        np.maximum(kept - kept_graph_bytes(device, np.maximum(m, 1.0)), 0.0)
    if cluster.buffers_in_compute_memory:
        return np.where(b > 0, act + others, 0.0)
    buf = engine_buffers(model, cluster.world_size, root_resident=root_resident, layout=layout,
                         rank=rank)
    offload = cluster.offload_activations
    side = side_input_bytes(model, b)  # [Note: side inputs by phase]
    phases = np.maximum(np.maximum(act + buf.unit_bytes + side,
                                   head_activation_bytes(device, m) + buf.head_bytes) + others,
                        buf.between_bytes + kept)
    stash_levels = None if activation_checkpointing or offload else 2
    embed = embed_activation_bytes(model, m) + buf.embed_bytes + \
        device_stash_bytes(model, m, b, offload, levels=1) + side
    busy = np.maximum(phases + device_stash_bytes(model, m, b, offload, levels=stash_levels),
                      embed) + side
    return np.where(b > 0, busy, buf.idle_bytes)


# [Note: side inputs by phase]
# A side input's values (s·b on a rank) are alive in every phase of the step, from the
# forward's embedding to E's backward. Their per-microbatch gradient sums appear with the
# first unit backward that reads them and reach s·b; E's backward frees them microbatch by
# microbatch. So the unit phase (whose peak is a backward recompute) and the embedding phase
# (E's backward) hold 2·s·b, the head and between phases s·b. Measured against the engine's
# peak in tests/test_plan_memory.py (Gemma 3n rows).
