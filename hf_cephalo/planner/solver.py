"""The exact threshold search behind ``optimize.py`` (private to the planner; docs/planner.md
"Optimizer" has the whole derivation and its complexity).

1. Candidate unit times = every T_i(l, m) with l·m ≤ B and M_i(m) under its cap, plus the idle
   time (``_device_options``). The optimum is one of them.
2. ``Case.feasible(t)``: rank i may take batch b iff some (l, m) with l·m = b has T_i ≤ t; a
   boolean sumset (FFT convolution) says whether Σ b_i = B is reachable, a min-plus knapsack
   gives the least Σ M_i for (III). Identical GPUs are grouped (``device_groups``), their
   k-fold sums computed by doubling.
3. ``Case.solve``: binary search over the sorted candidates (feasibility is monotone in t).
4. ``Case.reconstruct``: backtrack through the sumset tree to per-rank batch sizes, then per
   rank the (l, m) with T_i ≤ t (least memory in the uneven case, then least time).

``diagnose`` names the binding constraint when no case is feasible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hf_cephalo.planner import cost, memory
from hf_cephalo.planner.rows import sample_words
from hf_cephalo.profiles.types import ClusterProfile, format_bytes

__all__ = ["Assignment", "FixedState", "Case", "device_groups", "fixed_state_groups",
           "num_convolutions", "diagnose"]

_MEM_RTOL = 1e-12


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
    s: np.ndarray  # (K,) one unit of a forward-only scoring pass, s ([Note: scoring passes])
    idle_ok: bool
    idle_t: float
    idle_mem: float  # M_i of the idle rank (the engine's buffers), bytes
    idle_s: float  # one unit of a scoring pass on the idle rank (its all-gather), s


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
        scoring = cost.forward_unit_time_s(l_rep * f[idx], comm, uneven)
    else:
        m_rep = l_rep = np.zeros(0, dtype=np.int64)
        t = memv = scoring = np.zeros(0)
    idle_mem = float(mem_of(0, 0))
    if only is not None:  # a frozen rank: its current (b, m, l), or idle, and nothing else
        keep = (m_rep == only[1]) & (l_rep == only[2]) if only[0] > 0 else np.zeros(len(m_rep), bool)
        m_rep, l_rep, t, memv = m_rep[keep], l_rep[keep], t[keep], memv[keep]
        scoring = scoring[keep]
        idle_ok = idle_ok and only[0] == 0
    return _Options(b=m_rep * l_rep, m=m_rep, l=l_rep, t=t, mem=memv, s=scoring,
                    idle_ok=idle_ok and bool(ok(idle_mem)), idle_t=cost.idle_unit_time_s(comm, uneven),
                    idle_mem=idle_mem, idle_s=float(cost.forward_unit_time_s(0.0, comm, uneven)))


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


def _first_true(lo: int, hi: int, pred) -> int | None:
    """Smallest index in [lo, hi) where the monotone predicate ``pred`` (False...True) holds,
    or None (binary search; ``pred(hi - 1)`` first)."""
    if lo >= hi or not pred(hi - 1):
        return None
    hi -= 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# [Note: scoring passes]
# An RL step (GRPO / RLOO) runs, besides the training step, k forward-only layered passes over
# the same split (the old policy's and the reference's log-probabilities,
# ``generation.forward_pass_s``): per unit each rank's forwards plus one all-gather, every rank
# waiting for the slowest at each unit. Its priced time is a second maximum,
#     L·max_i (T_i + extra_i / L) + k·L·max_i s_i(b_i, m_i),
# not a maximum of per-rank sums (the passes are separate phases), so the threshold search on
# one maximum does not apply. Both maxima are thresholds: feasible(t, s) keeps the options with
# unit time <= t AND scoring unit time <= s, monotone in each. The optimum lies on the Pareto
# staircase of (t, s): for the least feasible t, the least s feasible with it; then the least t
# feasible with any smaller s, and so on. ``Case.solve_scored`` walks that staircase with two
# binary searches per corner and keeps the least t + k·s, stopping once t + k·s_min cannot
# improve (s_min: the least s feasible at any t) — exact, since every assignment is dominated
# by a corner. With k = 0 the optimizer runs the one-maximum search, unchanged.
class Case:
    """One case (even or uneven) of the problem with grouped identical devices.

    ``groups``: lists of ranks with identical options; with a host-memory limit each group lies
    in one machine (``device_groups``) and every machine's sub-tree is cut at the largest batch
    its host RAM takes ([Note: host memory in the knapsack]).
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
        ss = [o.s for o in self.options] + [[o.idle_s] for o in self.options if o.idle_ok]
        self.scoring_candidates = np.unique(np.concatenate([np.asarray(v, dtype=np.float64)
                                                            for v in ss]))
        self.machine_caps = _machine_batch_caps(cluster, c) if host_limit else None

    def _leaf_bool(self, k: int, t: float, s: float = np.inf) -> np.ndarray:
        o = self.options[k]
        a = np.zeros(self.B + 1, dtype=bool)
        a[o.b[(o.t <= t) & (o.s <= s)]] = True
        a[0] = o.idle_ok and o.idle_t <= t and o.idle_s <= s
        return a

    def _leaf_mem(self, k: int, t: float, s: float = np.inf) -> np.ndarray:
        o = self.options[k]
        w = np.full(self.B + 1, np.inf)
        sel = (o.t <= t) & (o.s <= s)
        np.minimum.at(w, o.b[sel], o.mem[sel])
        w[0] = o.idle_mem if (o.idle_ok and o.idle_t <= t and o.idle_s <= s) else np.inf
        return w

    def tree(self, t: float, minplus: bool, s: float = np.inf) -> _Node:
        """The sumset (boolean) or knapsack (min-plus) tree of the options with unit time <= t
        and scoring-pass unit time <= s ([Note: scoring passes])."""
        conv = _minplus_conv if minplus else _bool_conv
        by_machine: dict[int, _Node] = {}
        for k, ranks in enumerate(self.groups):
            leaf_table = self._leaf_mem(k, t, s) if minplus else self._leaf_bool(k, t, s)
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

    def feasible(self, t: float, minplus: bool, s: float = np.inf) -> bool:
        if self.infeasible_even_state:
            return False
        table = self.tree(t, minplus, s).table
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

    def feasible_both(self, t: float, s: float) -> bool:
        """Whether some assignment has every rank's unit time <= t and scoring-pass unit time
        <= s and meets (I)-(III) (the min-plus check only where (III) binds: uneven)."""
        return self.feasible(t, False, s) and (not self.aggregate or self.feasible(t, True, s))

    def solve_scored(self, k: float, below: float) -> tuple[float, float] | None:
        """The (t, s) minimizing t + k·s over the feasible assignments, if t + k·s < ``below``,
        else None: the staircase walk of [Note: scoring passes]. k > 0."""
        T, S = self.candidates, self.scoring_candidates
        j_lb = _first_true(0, len(S), lambda j: self.feasible_both(np.inf, S[j]))
        if j_lb is None:
            return None
        s_lb, best, best_obj = S[j_lb], None, below
        i_lo, j_hi = 0, len(S)
        while j_hi > j_lb:
            # only t with t + k·s_lb <= best can still improve (every later s is >= s_lb)
            hi = int(np.searchsorted(T, best_obj - k * s_lb, side="right"))
            i = _first_true(i_lo, hi, lambda i: self.feasible_both(T[i], S[j_hi - 1]))
            if i is None:
                break
            j = _first_true(j_lb, j_hi, lambda j: self.feasible_both(T[i], S[j]))
            if T[i] + k * S[j] < best_obj:
                best, best_obj = (float(T[i]), float(S[j])), T[i] + k * S[j]
            i_lo, j_hi = i + 1, j  # the next corner: a smaller s needs a larger t
        return best

    def reconstruct(self, t: float, world_size: int, s: float = np.inf) -> Assignment:
        minplus = self.aggregate
        parts: list = []
        _assign(self.tree(t, minplus, s), self.B, minplus, parts)
        per_group = {k: [] for k in range(len(self.groups))}
        for k, b in parts:
            per_group[k].append(b)
        bs, ms, ls = [0] * world_size, [0] * world_size, [0] * world_size
        for k, ranks in enumerate(self.groups):
            o = self.options[k]
            for rank, b in zip(ranks, sorted(per_group[k], reverse=True)):
                if b == 0:
                    continue
                sel = np.flatnonzero((o.b == b) & (o.t <= t) & (o.s <= s))
                # Uneven: the knapsack assumed the least memory for b; among those, least time.
                key = np.lexsort((o.t[sel], o.mem[sel])) if minplus else np.argsort(o.t[sel])
                j = sel[key[0]]
                bs[rank], ms[rank], ls[rank] = b, int(o.m[j]), int(o.l[j])
        return Assignment(bs, ms, ls, self.uneven, t)


def device_groups(cluster: ClusterProfile, c: float = 1.0) -> list[list[int]]:
    """Ranks with identical options (same device profile; same machine under a host limit)."""
    caps = _machine_batch_caps(cluster, c)
    seen: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        machine = caps[0][i] if caps else None
        seen.setdefault(json.dumps([machine, d.to_json()], sort_keys=True), []).append(i)
    return list(seen.values())


def fixed_state_groups(cluster: ClusterProfile, fixed: FixedState) -> list[list[int]]:
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


def num_convolutions(groups: list[list[int]]) -> int:
    """Semiring convolutions in one feasibility check's tree (doubling per group + joins)."""
    return sum(len(g).bit_length() - 1 + bin(len(g)).count("1") - 1 for g in groups) + \
        len(groups) - 1


def diagnose(cluster: ClusterProfile, B: int, c: float, allow_idle: bool,
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
        text = (f"({devs[i].name}): microbatch size 1{sample_words(cluster)} needs "
                f"{format_bytes(need1[i])}, "
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
    relaxed = Case(cluster, device_groups(cluster), B, c, True, allow_idle, root_resident,
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


def _batch_limits(cluster: ClusterProfile, relaxed: "Case", B: int, c: float,
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
