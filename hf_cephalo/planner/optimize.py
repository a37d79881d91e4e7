"""Exact optimizer for (b_i, m_i, l_i) under the cost model of ``cost.py`` (docs/design.md contract 2).

Problem (paper §2.4): minimize max_i T_i(l_i, m_i) (with each rank's root compute and
bookkeeping spread over its units: cost.py [Note: step terms]) subject to (I) Σ b_i = B,
b_i = l_i·m_i (b_i = 0 allowed: an idle rank), (II) M_i(m_i) ≤ c·C_i for b_i > 0, (III) S + Σ M_i ≤ c·Σ C_i.
T_i depends on whether the state is sharded unevenly (u = 1.15), which depends on the choice, so
two cases are solved and the better one kept:

* even case (u = 1): every rank must hold S/N, so (II) becomes M_i(m_i) ≤ c·C_i − S/N (and an
  idle rank needs S/N ≤ c·C_i); (III) then holds automatically.
* uneven case (u = 1.15): (II) and (III) as written. Searching only below the even optimum
  makes min(even, uneven) the exact minimum of the model (an even-feasible choice only ever
  looks slower under u = 1.15).

Algorithm (threshold search; see docs/planner.md):

1. Candidate unit times = every T_i(l, m) with l·m ≤ B and M_i(m) under its cap, plus the idle
   time. The optimum is one of them.
2. ``feasible(t)``: rank i may take batch b iff some (l, m) with l·m = b has T_i ≤ t. Whether
   Σ b_i = B is reachable is a boolean sumset (FFT convolution); for (III) a min-plus knapsack
   gives the least Σ M_i over all reachable assignments. Identical GPUs are grouped and their
   k-fold sums computed by doubling, so a check costs O(G·log n·B log B) (boolean) or
   O(G·log n·B²) (min-plus) for G device types.
3. Binary search over the sorted candidates (feasibility is monotone in t); min-plus checks
   only start above the boolean optimum and stop at the even optimum.
4. Backtrack through the sumset tree to per-rank batch sizes; per rank choose the (l, m) with
   T_i ≤ t (least memory in the uneven case, then least time).

Then the greedy state partition (``state.partition_state``) for uneven plans, 1/N otherwise.
The paper's O(N·B³·log B) recurrence is kept in ``reference.py`` for cross-checking.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.predict import predict
from hf_cephalo.planner.state import layout_unit_shards, partition_state
from hf_cephalo.planner.types import Plan, RankPlan, check_batch_and_fraction
from hf_cephalo.profiles.types import ClusterProfile, format_bytes
from hf_cephalo.units import GIB

__all__ = ["optimize", "optimize_auto_checkpointing", "AutoCheckpointing", "optimize_fixed_state",
           "has_kept_graph_profile", "solve_assignment",
           "Assignment", "FixedState", "InfeasiblePlanError", "check_problem_size",
           "estimate_problem_size", "format_bytes"]

_MEM_RTOL = 1e-12


class InfeasiblePlanError(ValueError):
    """No plan fits; the message names the binding constraint and ``constraint`` its kind,
    so that callers can add the flags that relax it: "device" (a rank's microbatch of one
    sample exceeds its memory cap), "aggregate" (training state plus the batch's compute exceed
    the cluster's memory; a smaller global batch would fit), "state" (as "aggregate", but at any
    global batch size: state plus the per-rank buffers alone do not fit), "batch" (each rank's
    cap limits its batch b_i, e.g. the kept graphs without activation checkpointing, and
    together the ranks take fewer than B samples; a smaller global batch would fit), "idle"
    (B < world size and idle ranks not allowed), "host" (pinned
    host memory of the activation offload), or "" (not known)."""

    def __init__(self, message: str, constraint: str = "") -> None:
        super().__init__(message)
        self.constraint = constraint


class _Diagnosis(NamedTuple):
    constraint: str  # InfeasiblePlanError.constraint
    message: str


class Assignment(NamedTuple):
    """Per-rank solution of the (b, m, l) problem before the state partition."""

    batch_sizes: list[int]
    microbatch_sizes: list[int]
    num_microbatches: list[int]
    uneven: bool
    unit_time_s: float  # max_i (T_i + extra_i / L), seconds (cost.py [Note: step terms])


class FixedState(NamedTuple):
    """A re-plan of (b_i, m_i, l_i) that keeps the engine's training-state layout as it is.

    Attributes:
        state_ratios: r_i per rank (the running plan's).
        uneven: whether the running plan is uneven (prices the collectives with u or 1).
        layout: the engine's per-unit shard layout (``predict.plan_layout``), elements; None for
            profiles whose compute memory includes the engine's buffers.
        frozen: rank -> (b, m, l) kept as is (a rank whose measurements are missing).
    """

    state_ratios: list[float]
    uneven: bool
    layout: list[list[int]] | None
    frozen: dict[int, tuple[int, int, int]]


@dataclass
class _Options:
    """All (l, m) choices of one device type in one case, flattened."""

    b: np.ndarray  # (K,) int batch sizes l·m
    m: np.ndarray  # (K,) int
    l: np.ndarray  # (K,) int
    t: np.ndarray  # (K,) unit time, s
    mem: np.ndarray  # (K,) memory besides the state M_i(m, b), bytes
    idle_ok: bool
    idle_t: float
    idle_mem: float  # M_i of the idle rank (the engine's buffers), bytes


def _device_options(cluster: ClusterProfile, rank: int, B: int, mem_cap: float, uneven: bool,
                    idle_ok: bool, root_resident: bool, layout=None,
                    only: tuple[int, int, int] | None = None,
                    checkpointing: bool = True) -> _Options:
    """Every (l, m) of ``rank`` with l·m <= B whose memory M_i(m, l·m) fits ``mem_cap``
    (``layout``: price the buffers of that shard layout; ``only``: keep just that (b, m, l);
    ``checkpointing``: the engine's ``activation_checkpointing``)."""
    device, comm = cluster.devices[rank], cost.unit_comm(cluster)

    def mem_of(m, b):
        return memory.rank_memory_bytes(cluster, rank, m, b, root_resident=root_resident,
                                        layout=layout, activation_checkpointing=checkpointing)

    ok = lambda mem: mem <= mem_cap * (1 + _MEM_RTOL)  # noqa: E731
    ms = np.arange(1, B + 1)
    ms = ms[ok(mem_of(ms, ms))]  # l = 1 is the least memory of every m (stash, kept graphs
    # grow with b)
    if len(ms):
        f = cost.fwd_time_s(device, ms)
        bw = cost.bwd_time_s(device, ms)
        counts = B // ms
        m_rep = np.repeat(ms, counts)
        starts = np.cumsum(counts) - counts
        l_rep = np.arange(len(m_rep)) - np.repeat(starts, counts) + 1
        idx = np.repeat(np.arange(len(ms)), counts)
        memv = mem_of(m_rep, m_rep * l_rep)
        keep = ok(memv)
        m_rep, l_rep, idx, memv = m_rep[keep], l_rep[keep], idx[keep], memv[keep]
        # T_i with the rank's root compute and bookkeeping spread over its L units
        # (cost.py [Note: step terms]): max_i of it is the compute phase / L, exactly
        t = cost.unit_time_s(f[idx], bw[idx], l_rep, comm, uneven,
                             activation_checkpointing=checkpointing) + \
            cost.rank_extra_s(cluster, rank, m_rep * l_rep, m_rep) / cluster.model.num_units
    else:
        m_rep = l_rep = np.zeros(0, dtype=np.int64)
        t = memv = np.zeros(0)
    idle_mem = float(mem_of(0, 0))
    if only is not None:  # a frozen rank: its current (b, m, l), or idle, and nothing else
        keep = (m_rep == only[1]) & (l_rep == only[2]) if only[0] > 0 else np.zeros(len(m_rep), bool)
        m_rep, l_rep, t, memv = m_rep[keep], l_rep[keep], t[keep], memv[keep]
        idle_ok = idle_ok and only[0] == 0
    return _Options(b=m_rep * l_rep, m=m_rep, l=l_rep, t=t, mem=memv,
                    idle_ok=idle_ok and bool(ok(idle_mem)), idle_t=cost.idle_unit_time_s(comm, uneven),
                    idle_mem=idle_mem)


# --- semirings: boolean sumset (FFT) and min-plus ----------------------------------------------
def _bool_conv(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = len(x)
    if not x.any() or not y.any():
        return np.zeros(n, dtype=bool)
    size = 1 << (2 * n - 1).bit_length()
    z = np.fft.irfft(np.fft.rfft(x.astype(np.float64), size) *
                     np.fft.rfft(y.astype(np.float64), size), size)[:n]
    return z > 0.5


def _minplus_conv(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = len(x)
    out = np.full(n, np.inf)
    fx, fy = np.flatnonzero(np.isfinite(x)), np.flatnonzero(np.isfinite(y))
    if len(fx) == 0 or len(fy) == 0:
        return out
    if len(fx) > len(fy):
        x, y, fx, fy = y, x, fy, fx
    lo, hi = fy[0], fy[-1] + 1
    ys = y[lo:hi]
    for s in fx:
        a, b = s + lo, min(s + hi, n)
        if a >= n:
            break
        np.minimum(out[a:b], x[s] + ys[: b - a], out=out[a:b])
    return out


class _Node:
    """A table over batch sums 0..B for ``count`` ranks, with its two children (or a leaf)."""

    __slots__ = ("table", "left", "right", "count", "group")

    def __init__(self, table, count, left=None, right=None, group=None):
        self.table, self.count, self.left, self.right, self.group = table, count, left, right, group


def _power(leaf: _Node, n: int, conv) -> _Node:
    pows = [leaf]
    while (1 << len(pows)) <= n:
        p = pows[-1]
        pows.append(_Node(conv(p.table, p.table), 2 * p.count, p, p))
    acc = None
    for k, p in enumerate(pows):
        if n >> k & 1:
            acc = p if acc is None else _Node(conv(acc.table, p.table), acc.count + p.count, acc, p)
    return acc


def _split(node: _Node, target: int, minplus: bool) -> int:
    """Part of ``target`` that goes to node.left (balanced by rank count among optimal splits)."""
    x, y = node.left.table, node.right.table
    xs = np.arange(target + 1)
    if minplus:
        vals = x[: target + 1] + y[target::-1]
        ok = vals <= vals.min()
    else:
        ok = x[: target + 1] & y[target::-1]
    cand = xs[ok]
    want = target * node.left.count / node.count
    return int(cand[np.argmin(np.abs(cand - want))])


def _assign(node: _Node, target: int, minplus: bool, out: list) -> None:
    stack = [(node, target)]
    while stack:
        nd, tg = stack.pop()
        if nd.left is None:
            out.append((nd.group, tg))
            continue
        part = _split(nd, tg, minplus)
        stack.append((nd.right, tg - part))
        stack.append((nd.left, part))


# [Note: host memory in the knapsack]
# With activation offload every rank pins (L + 1)·a bytes per sample in its machine's RAM
# (memory.host_memory_bytes), so the ranks of machine k may take at most
# floor(c·H_k / ((L + 1)·a)) samples together. The optimizer builds each machine's sub-tree
# (identical GPUs of that machine by doubling), sets every entry above that batch to
# infeasible, then joins the machines: exact, since the limit only depends on the machine's
# batch sum. Without offload or host RAM figures there is no cut (and groups span machines).
def _machine_batch_caps(cluster: ClusterProfile, c: float):
    """(machine per rank, largest batch per machine) when host memory limits the plan, else None."""
    model = cluster.model
    per_sample = float(memory.host_memory_bytes(model, 1, cluster.offload_activations))
    if cluster.host_memory_bytes is None or per_sample <= 0 or cluster.buffers_in_compute_memory:
        return None
    caps = {k: int(np.floor(c * h / per_sample * (1 + _MEM_RTOL)))
            for k, h in enumerate(cluster.host_memory_bytes)}
    return cluster.machines_of_ranks, caps


def _cut(node: _Node, max_batch: int, minplus: bool) -> _Node:
    """``node`` with every batch sum above ``max_batch`` made infeasible (same children)."""
    table = node.table.copy()
    table[max_batch + 1:] = np.inf if minplus else False
    return _Node(table, node.count, node.left, node.right, node.group)


class _Case:
    """One case (even or uneven) of the problem with grouped identical devices.

    ``groups``: lists of ranks with identical options; with a host-memory limit each group lies
    in one machine (``_groups``) and every machine's sub-tree is cut at the largest batch its
    host RAM takes ([Note: host memory in the knapsack]).
    """

    def __init__(self, cluster: ClusterProfile, groups, B: int, c: float, uneven: bool,
                 allow_idle: bool, root_resident: bool = False, host_limit: bool = True,
                 fixed: FixedState | None = None, checkpointing: bool = True):
        self.B, self.uneven, self.groups = B, uneven, groups
        # With the state fixed every rank's cap is c·C_i − r_i·S, which implies (III).
        self.aggregate = uneven and fixed is None
        S, N = cluster.model.state_bytes, cluster.world_size
        self.mem_budget = c * sum(d.memory_capacity_bytes for d in cluster.devices) - S
        self.options = []
        state = [(fixed.state_ratios[r[0]] * S if fixed else 0.0 if uneven else S / N)
                 for r in groups]
        for ranks, held in zip(groups, state):
            d = cluster.devices[ranks[0]]
            idle_ok = allow_idle and held <= c * d.memory_capacity_bytes
            self.options.append(_device_options(
                cluster, ranks[0], B, c * d.memory_capacity_bytes - held, uneven, idle_ok,
                root_resident, layout=None if fixed is None else fixed.layout,
                only=None if fixed is None else fixed.frozen.get(ranks[0]),
                checkpointing=checkpointing))
        self.infeasible_even_state = (fixed is not None or not uneven) and any(
            held > c * cluster.devices[r[0]].memory_capacity_bytes
            for r, held in zip(groups, state))
        ts = [o.t for o in self.options] + [[o.idle_t] for o in self.options if o.idle_ok]
        self.candidates = np.unique(np.concatenate([np.asarray(t, dtype=np.float64) for t in ts]))
        self.machine_caps = _machine_batch_caps(cluster, c) if host_limit else None

    def _leaf_bool(self, k: int, t: float) -> np.ndarray:
        o = self.options[k]
        a = np.zeros(self.B + 1, dtype=bool)
        a[o.b[o.t <= t]] = True
        a[0] = o.idle_ok and o.idle_t <= t
        return a

    def _leaf_mem(self, k: int, t: float) -> np.ndarray:
        o = self.options[k]
        w = np.full(self.B + 1, np.inf)
        sel = o.t <= t
        np.minimum.at(w, o.b[sel], o.mem[sel])
        w[0] = o.idle_mem if (o.idle_ok and o.idle_t <= t) else np.inf
        return w

    def tree(self, t: float, minplus: bool) -> _Node:
        conv = _minplus_conv if minplus else _bool_conv
        by_machine: dict[int, _Node] = {}
        for k, ranks in enumerate(self.groups):
            leaf_table = self._leaf_mem(k, t) if minplus else self._leaf_bool(k, t)
            p = _power(_Node(leaf_table, 1, group=k), len(ranks), conv)
            key = self.machine_caps[0][ranks[0]] if self.machine_caps else 0
            root = by_machine.get(key)
            by_machine[key] = p if root is None else _Node(conv(root.table, p.table),
                                                           root.count + p.count, root, p)
        root = None
        for key, node in by_machine.items():
            if self.machine_caps:
                node = _cut(node, self.machine_caps[1][key], minplus)
            root = node if root is None else _Node(conv(root.table, node.table),
                                                   root.count + node.count, root, node)
        return root

    def feasible(self, t: float, minplus: bool) -> bool:
        if self.infeasible_even_state:
            return False
        table = self.tree(t, minplus).table
        if minplus:
            return bool(table[self.B] <= self.mem_budget + abs(self.mem_budget) * _MEM_RTOL)
        return bool(table[self.B])

    def search(self, lo: int, hi: int, minplus: bool) -> int | None:
        """Smallest candidate index in [lo, hi) that is feasible, or None."""
        if lo >= hi or not self.feasible(self.candidates[hi - 1], minplus):
            return None
        hi -= 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(self.candidates[mid], minplus):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def solve(self, below: float) -> float | None:
        """The optimal unit time of this case if it is < ``below``, else None."""
        hi = int(np.searchsorted(self.candidates, below, side="left"))
        idx = self.search(0, hi, minplus=False)
        if idx is not None and self.aggregate:
            idx = self.search(idx, hi, minplus=True)
        return None if idx is None else float(self.candidates[idx])

    def reconstruct(self, t: float, world_size: int) -> Assignment:
        minplus = self.aggregate
        parts: list = []
        _assign(self.tree(t, minplus), self.B, minplus, parts)
        per_group = {k: [] for k in range(len(self.groups))}
        for k, b in parts:
            per_group[k].append(b)
        bs, ms, ls = [0] * world_size, [0] * world_size, [0] * world_size
        for k, ranks in enumerate(self.groups):
            o = self.options[k]
            for rank, b in zip(ranks, sorted(per_group[k], reverse=True)):
                if b == 0:
                    continue
                sel = np.flatnonzero((o.b == b) & (o.t <= t))
                # Uneven: the knapsack assumed the least memory for b; among those, least time.
                key = np.lexsort((o.t[sel], o.mem[sel])) if minplus else np.argsort(o.t[sel])
                j = sel[key[0]]
                bs[rank], ms[rank], ls[rank] = b, int(o.m[j]), int(o.l[j])
        return Assignment(bs, ms, ls, self.uneven, t)


def _groups(cluster: ClusterProfile, c: float = 1.0) -> list[list[int]]:
    """Ranks with identical options (same device profile; same machine under a host limit)."""
    caps = _machine_batch_caps(cluster, c)
    seen: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        machine = caps[0][i] if caps else None
        seen.setdefault(json.dumps([machine, d.to_json()], sort_keys=True), []).append(i)
    return list(seen.values())


def _check_inputs(cluster: ClusterProfile, B: int, c: float) -> None:
    if not isinstance(cluster, ClusterProfile):
        raise TypeError(f"cluster must be a ClusterProfile, got {type(cluster).__name__}")
    check_batch_and_fraction(B, c)


# Upfront size limits of one solve (see ``check_problem_size``). Calibrated on 2 CPU cores:
# 2e10 work units is about 10-30 s; the options arrays are the solver's dominant memory.
MAX_SOLVER_WORK = 2e10
MAX_SOLVER_MEMORY_BYTES = 4 * GIB
_BYTES_PER_OPTION = 96  # retained (b, m, l, t, mem) in 2 cases + construction temporaries
_PY_CALL_WORK = 3000  # one min-plus row update (a NumPy call) in element operations


def _num_convolutions(groups: list[list[int]]) -> int:
    """Semiring convolutions in one feasibility check's tree (doubling per group + joins)."""
    return sum(len(g).bit_length() - 1 + bin(len(g)).count("1") - 1 for g in groups) + \
        len(groups) - 1


def estimate_problem_size(cluster: ClusterProfile, global_batch_size: int,
                          memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION) -> tuple[float, float]:
    """(work, memory bytes) upper estimates of one ``solve_assignment`` call, in closed form.

    work: element operations of one min-plus feasibility check, convolutions × (B²/2 + a
    per-row NumPy call cost × B) plus the (l, m) options scanned. memory: the (l, m) options of
    every device type in both cases; per type K ≤ B·(ln m_max + 1) options, m_max the largest
    microbatch size whose compute memory fits c·C_i (linear memory model, ``cost.memory_line``).
    Nothing of size B is allocated, so absurd B are estimated instantly.
    """
    B = int(global_batch_size)
    groups = _groups(cluster)
    options = 0.0
    for g in groups:
        d = cluster.devices[g[0]]
        slope, intercept = cost.memory_line(d)
        cap = memory_fraction * d.memory_capacity_bytes
        m_max = float(B) if slope <= 0 else min(float(B), max(0.0, (cap - intercept) / slope))
        if m_max >= 1:
            options += B * (np.log(m_max) + 1.0)
    convs = _num_convolutions(groups)
    work = convs * (B * B / 2.0 + _PY_CALL_WORK * B) + options
    return work, options * _BYTES_PER_OPTION


def check_problem_size(cluster: ClusterProfile, global_batch_size: int,
                       memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION) -> None:
    """Refuse instances whose solve would take minutes or exhaust memory (before allocating).

    Limits: ``MAX_SOLVER_WORK`` element operations per feasibility check and
    ``MAX_SOLVER_MEMORY_BYTES`` (module constants; raise them to accept a longer solve).
    Work grows as B² × (convolutions, ~ number of device types × log2 ranks per type).

    Raises:
        ValueError: the estimate exceeds a limit; the message gives B, the estimate, the
            limit and the largest B within it.
    """
    B = int(global_batch_size)
    work, mem = estimate_problem_size(cluster, B, memory_fraction)
    if work <= MAX_SOLVER_WORK and mem <= MAX_SOLVER_MEMORY_BYTES:
        return
    lo, hi = 1, B  # largest B within both limits (both estimates grow with B)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        w, m = estimate_problem_size(cluster, mid, memory_fraction)
        lo, hi = (mid, hi) if w <= MAX_SOLVER_WORK and m <= MAX_SOLVER_MEMORY_BYTES else \
            (lo, mid - 1)
    what = (f"~{work:.2g} operations per feasibility check (limit {MAX_SOLVER_WORK:.2g})"
            if work > MAX_SOLVER_WORK else
            f"~{format_bytes(mem)} of solver memory (limit {format_bytes(MAX_SOLVER_MEMORY_BYTES)})")
    raise ValueError(
        f"global batch size {B} is too large to plan exactly for {cluster.world_size} ranks "
        f"({len(_groups(cluster))} device profiles): it needs {what}; the largest global batch "
        f"size within the limits for this cluster is {lo}. Plan a smaller global batch size "
        "(or raise hf_cephalo.planner.optimize.MAX_SOLVER_WORK / MAX_SOLVER_MEMORY_BYTES to "
        "accept a longer solve)")


def _diagnose(cluster: ClusterProfile, B: int, c: float, allow_idle: bool,
              root_resident: bool, checkpointing: bool = True) -> _Diagnosis:
    """Name the binding constraint of an infeasible problem."""
    devs = cluster.devices
    need1 = [float(memory.rank_memory_bytes(cluster, i, 1, 1, root_resident=root_resident,
                                            activation_checkpointing=checkpointing))
             for i in range(len(devs))]
    too_big = [i for i, d in enumerate(devs) if need1[i] > c * d.memory_capacity_bytes]
    # one entry per run of consecutive ranks with the same text (64 equal lines bury the point)
    runs: list[tuple[list[int], str]] = []
    for i in too_big:
        text = (f"({devs[i].name}): microbatch size 1 needs {format_bytes(need1[i])}, "
                f"cap {format_bytes(c * devs[i].memory_capacity_bytes)}")
        if runs and runs[-1][1] == text and runs[-1][0][-1] == i - 1:
            runs[-1][0].append(i)
        else:
            runs.append(([i], text))
    msgs = [(f"rank {r[0]} " if len(r) == 1 else f"ranks {r[0]}-{r[-1]} ") + text
            for r, text in runs]
    if too_big and len(too_big) == len(devs):
        return _Diagnosis("device", "; ".join(msgs))
    if too_big and not allow_idle:
        return _Diagnosis("idle", "; ".join(msgs) + "; let these ranks idle")
    if not allow_idle and B < len(devs):
        return _Diagnosis("idle", f"every rank needs at least one sample but the global batch "
                          f"size {B} is smaller than the world size {len(devs)}; allow idle "
                          "ranks or raise the batch size")
    S = cluster.model.state_bytes
    total = sum(d.memory_capacity_bytes for d in devs)
    relaxed = _Case(cluster, _groups(cluster), B, c, True, allow_idle, root_resident,
                    host_limit=False, checkpointing=checkpointing)
    table = relaxed.tree(np.inf, minplus=True).table
    min_compute = float(table[B])
    if not np.isfinite(min_compute):
        return _Diagnosis("batch", "; ".join(msgs + [_batch_limits(
            cluster, relaxed, B, c, root_resident, checkpointing, set(too_big))]))
    budget = relaxed.mem_budget * (1 + _MEM_RTOL)
    if min_compute > budget:
        head = (f"aggregate memory: model state {format_bytes(S)} + compute "
                f"{format_bytes(min_compute)} exceeds {c} × {format_bytes(total)}")
        # The compute floor (every rank's gathered-unit and gradient buffers) does not shrink
        # with B: when even B = 1 does not fit, a smaller batch is no remedy.
        if float(table[1]) > budget:
            return _Diagnosis("state", f"{head}, at any global batch size (B = 1 still needs "
                              f"compute {format_bytes(float(table[1]))})")
        return _Diagnosis("aggregate", head)
    return _diagnose_host(cluster, B, c)


def _rank_names(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0-3" (consecutive) or "ranks 0, 2, 5"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _batch_limits(cluster: ClusterProfile, relaxed: "_Case", B: int, c: float,
                  root_resident: bool, checkpointing: bool, skip: set[int]) -> str:
    """Why no per-rank batches b_i that each fit their rank's cap add up to B: the largest b_i
    of every device group (ranks in ``skip`` fit no microbatch at all and are named by the
    caller), what b_i + 1 needs at its best microbatch size, and their sum."""
    L, parts, total = cluster.model.num_units, [], 0
    for ranks, o in zip(relaxed.groups, relaxed.options):
        ranks = [r for r in ranks if r not in skip]
        if not ranks:
            continue
        i, bmax = ranks[0], int(o.b.max()) if len(o.b) else 0
        total += bmax * len(ranks)
        text = f"{_rank_names(ranks)} ({cluster.devices[i].name}): b_i <= {bmax}"
        if bmax < B:
            nxt = bmax + 1
            ms = np.arange(1, nxt + 1)
            need = memory.rank_memory_bytes(cluster, i, ms, np.full(len(ms), nxt),
                                            root_resident=root_resident,
                                            activation_checkpointing=checkpointing)
            k = int(np.argmin(need))
            kept = "" if checkpointing else \
                f", {format_bytes(float(memory.kept_graphs_bytes(cluster, i, ms[k], nxt)))} " \
                "of it kept graphs"
            cap = c * cluster.devices[i].memory_capacity_bytes
            text += (f" (b_i = {nxt} needs at least {format_bytes(float(need[k]))} at m_i = "
                     f"{ms[k]}{kept}; cap {format_bytes(cap)})")
        parts.append(text)
    if total < B:
        why = (f"without activation checkpointing the kept forward graphs of all microbatches, "
               f"L·b_i·K(m_i) bytes (L = {L} units, K per sample and unit from the profile's "
               "kept_graph_bytes), stay until the backward and grow with each rank's batch "
               "b_i, which is what does not fit" if not checkpointing else
               "each rank's memory grows with its batch b_i (the boundary stash)")
        return (f"{why}: {'; '.join(parts)}; together at most {total} samples, fewer than the "
                f"global batch size {B}")
    return (f"no per-rank batch sizes within the memory caps ({'; '.join(parts)}) add up to "
            f"the global batch size {B}")


def _diagnose_host(cluster: ClusterProfile, B: int, c: float) -> _Diagnosis:
    """The host-memory message: feasible on the devices, not within the machines' RAM."""
    caps = _machine_batch_caps(cluster, c)
    per_sample = float(memory.host_memory_bytes(cluster.model, 1, cluster.offload_activations))
    if caps is None:
        return _Diagnosis("", "no assignment meets every rank's memory cap")
    limits = ", ".join(f"machine {k}: {format_bytes(c * h)} = {caps[1][k]} samples"
                       for k, h in enumerate(cluster.host_memory_bytes))
    return _Diagnosis("host", f"host memory: the offloaded boundary activations need "
                      f"{format_bytes(per_sample)} of pinned host memory per sample ((L + 1) x "
                      f"sequence x hidden x bytes); within {c} x each machine's RAM ({limits}) "
                      f"no assignment of the {B} samples meets the device caps too. Lower the "
                      "global batch size or add host RAM")


def solve_assignment(cluster: ClusterProfile, global_batch_size: int,
                     memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                     allow_idle: bool = True, root_resident: bool = False,
                     activation_checkpointing: bool = True) -> Assignment:
    """Exact minimum of max_i T_i over (b_i, m_i, l_i) under (I)-(III); see module doc.

    Memory per rank is ``memory.rank_memory_bytes`` (every engine buffer, see [Note: memory
    terms]); with activation offload and host RAM figures each machine's batch is limited by
    its RAM ([Note: host memory in the knapsack]). ``root_resident``: see ``optimize``;
    ``activation_checkpointing`` (one setting, True or False): the engine's, priced by
    ``cost.unit_time_s`` and ``memory.rank_memory_bytes``.

    Raises:
        InfeasiblePlanError (a ValueError): no assignment fits; the message names the binding
            constraint (a rank whose microbatch size 1 exceeds its cap, aggregate memory, each
            rank's largest batch b_i within its cap summing to less than B, or a machine's
            host memory); never an empty reason.
        ValueError: B < 1, memory_fraction outside (0, 1]; an instance too large to solve
            within ``MAX_SOLVER_WORK`` / ``MAX_SOLVER_MEMORY_BYTES`` (``check_problem_size``).
    """
    B, c = global_batch_size, memory_fraction
    _check_inputs(cluster, B, c)
    check_problem_size(cluster, B, c)
    groups = _groups(cluster)
    ac = activation_checkpointing
    even = _Case(cluster, groups, B, c, False, allow_idle, root_resident, checkpointing=ac)
    t_even = even.solve(np.inf)
    uneven = _Case(cluster, groups, B, c, True, allow_idle, root_resident, checkpointing=ac)
    t_uneven = uneven.solve(np.inf if t_even is None else t_even)
    if t_uneven is not None:
        return uneven.reconstruct(t_uneven, cluster.world_size)
    if t_even is not None:
        return even.reconstruct(t_even, cluster.world_size)
    diagnosis = _diagnose(cluster, B, c, allow_idle, root_resident, ac)
    raise InfeasiblePlanError(f"no plan for global batch size {B} fits: "
                              f"{diagnosis.message or 'no assignment meets every memory cap'}",
                              diagnosis.constraint)


# [Note: state ratios on their own layout]
# The knapsack prices each rank's reduce-scatter outputs (its shard k of a unit, memory.py) at
# even shards, before any ratio exists; a rank the partition then gives a larger share holds
# larger shards, so water-filling on those prices could fill it a few shards past its cap.
# The ratios are therefore poured again on the memory of their own layout, a few times: k is
# a small part of M_i, so the ratios settle at once; ``predict`` checks the result.
_LAYOUT_REPOURS = 3


def _partition_on_layout(cluster: ClusterProfile, a: "Assignment", mem: list[float],
                         root_resident: bool, checkpointing: bool = True) -> list[float]:
    """Water-filling ratios r_i, re-poured on the memory of their own shard layout."""
    caps = [d.memory_capacity_bytes for d in cluster.devices]
    S = cluster.model.state_bytes
    ratios = partition_state(S, mem, caps)
    if cluster.buffers_in_compute_memory:
        return ratios
    numels = memory.model_layout_numels(cluster.model)
    for _ in range(_LAYOUT_REPOURS):
        layout = layout_unit_shards(ratios, numels)
        mem = [float(memory.rank_memory_bytes(cluster, i, m, b, root_resident=root_resident,
                                              layout=layout,
                                              activation_checkpointing=checkpointing))
               for i, (m, b) in enumerate(zip(a.microbatch_sizes, a.batch_sizes))]
        ratios = partition_state(S, mem, caps)
    return ratios


def has_kept_graph_profile(cluster: ClusterProfile) -> bool:
    """Whether every device profile has ``kept_graph_bytes``, so a plan without activation
    checkpointing can be priced (profiles measured before it, spec sheets: no)."""
    return all(d.kept_graph_bytes is not None for d in cluster.devices)


def optimize(cluster: ClusterProfile, global_batch_size: int,
             memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
             allow_idle: bool = True, root_resident: bool = False,
             activation_checkpointing: bool | None = True) -> Plan:
    """The optimal Plan: exact (b_i, m_i, l_i) plus greedy state ratios r_i.

    Args:
        cluster: profiles of the model, every rank's device and the collectives.
        global_batch_size: B, samples per iteration (>= 1).
        memory_fraction: c, fraction of each device's (and machine's host) memory the plan
            may use.
        allow_idle: allow ranks with b_i = 0 (they still hold state and join collectives).
        root_resident: price the engine's ``root_resident=True`` (embedding and head units
            gathered with their gradients all step); False (the engine's default) prices each
            root unit gathered around its uses. Recorded in the plan; the trainer builds the
            engine with it.
        activation_checkpointing: True (default, the paper's schedule: recompute in
            backward); False: the engine keeps every forward graph (faster, activation memory
            L·l_i·K(m_i), docs/planner.md); None: plan both (each an exact search) and keep
            the one with the smaller predicted step time that fits (checkpointing on a tie;
            without the profile's ``kept_graph_bytes`` only checkpointing is planned).
            Recorded in the plan; the trainer builds the engine with it.

    Raises:
        InfeasiblePlanError / ValueError: see ``solve_assignment`` (for None: when no setting
            fits, the error of the checkpointing plan). ValueError: False with a profile
            without ``kept_graph_bytes``.
    """
    if activation_checkpointing is None:
        return optimize_auto_checkpointing(cluster, global_batch_size, memory_fraction,
                                           allow_idle=allow_idle,
                                           root_resident=root_resident).plan
    if not activation_checkpointing and not has_kept_graph_profile(cluster):
        missing = [d.name for d in cluster.devices if d.kept_graph_bytes is None]
        raise ValueError(f"activation checkpointing off needs the profile's kept_graph_bytes "
                         f"(the memory of the kept forward graphs), which the device profiles "
                         f"{sorted(set(missing))} lack: re-profile with this version "
                         "(`hf-cephalo profile`; a cached entry is measured anew) or plan with "
                         "activation checkpointing")
    return _optimize_one(cluster, global_batch_size, memory_fraction, allow_idle,
                         root_resident, bool(activation_checkpointing), fallback_error=False)


class AutoCheckpointing(NamedTuple):
    """``optimize_auto_checkpointing``'s result: the plan and why its setting was chosen."""

    plan: Plan
    reason: str  # e.g. "off does not fit: ..." or "faster than on, predicted 0.8 s vs 1.1 s"


def optimize_auto_checkpointing(cluster: ClusterProfile, global_batch_size: int,
                                memory_fraction: float = cost.DEFAULT_MEMORY_FRACTION, *,
                                allow_idle: bool = True,
                                root_resident: bool = False) -> AutoCheckpointing:
    """``optimize(..., activation_checkpointing=None)`` with the reason of its choice, the
    text the CLI and the trainer print after ``[auto: ...]``: which setting did not fit (with
    the planner's diagnosis), or both predicted iteration times (seconds), or that the profile
    has no ``kept_graph_bytes`` so only checkpointing was planned.

    Raises:
        InfeasiblePlanError / ValueError: as ``optimize`` (neither setting fits: the error of
            the checkpointing plan).
    """
    args = (cluster, global_batch_size, memory_fraction, allow_idle, root_resident)
    on = _optimize_one(*args, True, fallback_error=True)
    if not has_kept_graph_profile(cluster):
        if isinstance(on, Exception):
            raise on
        return AutoCheckpointing(on, "the profile has no kept_graph_bytes (spec-sheet or older "
                                     "measurement), so only on was planned")
    off = _optimize_one(*args, False, fallback_error=True)
    if isinstance(on, Exception) and isinstance(off, Exception):
        raise on
    if isinstance(off, Exception):
        return AutoCheckpointing(on, f"off does not fit: {_reason(off)}")
    if isinstance(on, Exception):
        return AutoCheckpointing(off, f"on does not fit: {_reason(on)}")
    t_on, t_off = on.predicted_iteration_s, off.predicted_iteration_s
    if t_off < t_on:
        return AutoCheckpointing(off, f"faster than on, predicted {t_off:.3f} s vs {t_on:.3f} s")
    return AutoCheckpointing(on, f"{'as fast as' if t_on == t_off else 'faster than'} off, "
                                 f"predicted {t_on:.3f} s vs {t_off:.3f} s")


def _reason(error: InfeasiblePlanError) -> str:
    """The diagnosis of an infeasible plan without its "no plan for ... fits: " head."""
    text = str(error)
    head = "fits: "
    return text[text.index(head) + len(head):] if head in text else text


def _optimize_one(cluster: ClusterProfile, global_batch_size: int, memory_fraction: float,
                  allow_idle: bool, root_resident: bool, checkpointing: bool,
                  fallback_error: bool):
    """``optimize`` for one activation-checkpointing setting; with ``fallback_error`` an
    ``InfeasiblePlanError`` is returned instead of raised (the other setting may fit)."""
    try:
        a = solve_assignment(cluster, global_batch_size, memory_fraction, allow_idle=allow_idle,
                             root_resident=root_resident, activation_checkpointing=checkpointing)
    except InfeasiblePlanError as e:
        if fallback_error:
            return e
        raise
    devs = cluster.devices
    N = cluster.world_size
    mem = [float(memory.rank_memory_bytes(cluster, i, m, b, root_resident=root_resident,
                                          activation_checkpointing=checkpointing))
           for i, (m, b) in enumerate(zip(a.microbatch_sizes, a.batch_sizes))]
    uneven = cost.is_uneven(cluster, mem, memory_fraction)
    if uneven:
        ratios = _partition_on_layout(cluster, a, mem, root_resident, checkpointing)
    else:
        ratios = [1.0 / N] * N
    # precision per rank (docs/engine.md "Precision per rank"): each device profile was
    # made at its rank's precision, the plan records which
    rank_precisions = cluster.extra.get("rank_precisions") or [None] * N
    ranks = [RankPlan(rank=i, device=d.name, batch_size=a.batch_sizes[i],
                      microbatch_size=a.microbatch_sizes[i],
                      num_microbatches=a.num_microbatches[i], state_ratio=ratios[i],
                      memory_capacity_bytes=d.memory_capacity_bytes,
                      precision=rank_precisions[i])
             for i, d in enumerate(devs)]
    model = cluster.model
    plan = Plan(global_batch_size=global_batch_size, memory_fraction=memory_fraction,
                uneven_state=uneven, ranks=ranks, root_resident=root_resident,
                activation_checkpointing=checkpointing,
                precision=cluster.extra.get("dtype"),  # [Note: precision tags]
                model={"name": model.name, "num_units": model.num_units,
                       "params_per_unit": model.params_per_unit,
                       "params_other": model.params_other})
    pred = predict(plan, cluster)
    for r, p in zip(plan.ranks, pred.ranks):
        r.predicted_memory_bytes = p.memory_bytes  # priced with the plan's own shard layout
    plan.predicted_iteration_s = pred.iteration_s
    return plan


def _fixed_groups(cluster: ClusterProfile, fixed: FixedState) -> list[list[int]]:
    """Ranks with identical options when the state layout is fixed: same device profile, same
    machine under a host limit, same shards of every unit, same frozen (b, m, l)."""
    caps = _machine_batch_caps(cluster, 1.0)
    seen: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        row = None if fixed.layout is None else [unit[i] for unit in fixed.layout]
        key = [caps[0][i] if caps else None, d.to_json(), fixed.state_ratios[i], row,
               fixed.frozen.get(i)]
        seen.setdefault(json.dumps(key, sort_keys=True), []).append(i)
    return list(seen.values())


def optimize_fixed_state(cluster: ClusterProfile, plan: Plan, *,
                         frozen_ranks: Sequence[int] = (), allow_idle: bool = True) -> Plan:
    """The optimal (b_i, m_i, l_i) for ``plan``'s own state ratios r_i and shard layout.

    The re-plan of a live switch that moves no state (docs/design.md contract 7): the same
    threshold search as ``optimize`` with rank i's memory cap c·C_i − r_i·S (the state it holds
    now) priced with the engine's current shard layout, the collectives priced as ``plan``
    (uneven or not), the same B and memory fraction c. Ranks in ``frozen_ranks`` keep their
    (b_i, m_i, l_i). The result keeps r_i, ``uneven_state``, ``root_resident``,
    ``activation_checkpointing`` (priced as ``plan`` runs) and the precision tag of ``plan``;
    ``predicted_*`` come from ``predict`` on ``cluster``.

    Raises:
        InfeasiblePlanError: no (b_i, m_i, l_i) fits the caps with this state layout.
        ValueError: ``plan`` does not fit ``cluster`` (world size, model).
    """
    from hf_cephalo.planner.predict import plan_layout

    plan.validate_for(cluster.world_size, cluster.model)
    layout = None if cluster.buffers_in_compute_memory else plan_layout(plan, cluster)
    frozen = {i: (plan.ranks[i].batch_size, plan.ranks[i].microbatch_size,
                  plan.ranks[i].num_microbatches) for i in frozen_ranks}
    fixed = FixedState(list(plan.state_ratios), plan.uneven_state, layout, frozen)
    case = _Case(cluster, _fixed_groups(cluster, fixed), plan.global_batch_size,
                 plan.memory_fraction, plan.uneven_state, allow_idle, plan.root_resident,
                 fixed=fixed, checkpointing=plan.activation_checkpointing)
    t = case.solve(np.inf)
    if t is None:
        raise InfeasiblePlanError(
            f"no (b_i, m_i, l_i) for global batch size {plan.global_batch_size} fits the memory "
            f"caps with the current state ratios {[round(r, 4) for r in plan.state_ratios]}",
            "state")
    a = case.reconstruct(t, cluster.world_size)
    ranks = [dataclasses.replace(r, batch_size=a.batch_sizes[i],
                                 microbatch_size=a.microbatch_sizes[i],
                                 num_microbatches=a.num_microbatches[i])
             for i, r in enumerate(plan.ranks)]
    new = dataclasses.replace(plan, ranks=ranks)
    pred = predict(new, cluster)
    for r, p in zip(new.ranks, pred.ranks):
        r.predicted_memory_bytes = p.memory_bytes
    new.predicted_iteration_s = pred.iteration_s
    return new
