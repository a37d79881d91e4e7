"""Training-state partition: greedy ratios r_i, then the per-unit shard layout.

Paper §2.4 ("Training State Partition") and §3 (uneven sharding, the 3:1 example).

* ``partition_state``: give state to the rank with the lowest memory utilization
  (r_i·S + M_i) / C_i until all of S is placed. Done in infinitesimal steps this greedy is
  water-filling: r_i·S = max(0, λ·C_i − M_i) with λ chosen so that Σ r_i = 1; computed exactly
  by sorting the breakpoints M_i / C_i, O(N log N). It minimizes the maximum utilization.
* ``layout_unit_shards``: turn r_i into integer element counts per unit so that as few units as
  possible are split unevenly: the smallest units are split evenly among the ranks that hold
  state while every rank's target still covers its even parts; the remaining elements are
  poured rank by rank over the remaining units, so most of those go to a single rank.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["partition_state", "layout_unit_shards", "integer_targets", "skewed_state_ratios"]


def partition_state(state_bytes: float, compute_memory_bytes: Sequence[float],
                    capacity_bytes: Sequence[float]) -> list[float]:
    """Greedy (water-filling) state ratios r_i minimizing max_i (r_i·S + M_i) / C_i.

    Args:
        state_bytes: S, bytes of the whole training state.
        compute_memory_bytes: M_i(m_i) per rank (0 for idle ranks), bytes.
        capacity_bytes: C_i per rank, bytes.

    Returns:
        r_i per rank, non-negative, summing to 1.
    """
    mem = np.asarray(compute_memory_bytes, dtype=np.float64)
    cap = np.asarray(capacity_bytes, dtype=np.float64)
    if len(mem) != len(cap) or len(cap) == 0 or np.any(cap <= 0):
        raise ValueError(f"partition_state: need one positive capacity per rank, got {cap.tolist()}")
    if state_bytes <= 0:
        return [1.0 / len(cap)] * len(cap)
    order = np.argsort(mem / cap, kind="stable")
    # Raise the level λ over the sorted breakpoints until the poured state reaches S.
    level = 0.0
    for k in range(1, len(cap) + 1):
        active = order[:k]
        lam = (state_bytes + mem[active].sum()) / cap[active].sum()
        nxt = mem[order[k]] / cap[order[k]] if k < len(cap) else math.inf
        if lam <= nxt:
            level = lam
            break
    share = np.maximum(level * cap - mem, 0.0)
    ratios = share / share.sum()
    return [float(r) for r in ratios]


def skewed_state_ratios(state_bytes: float, capacity_bytes: Sequence[float],
                        memory_fraction: float = 0.8) -> list[float]:
    """The most skewed state ratios the memory caps allow: the rank with the most memory takes
    as much of S as c·C_i holds, then the next, ... (compute memory ignored: an upper bound on
    the skew of any plan). What the profiler times the uneven factor u for.

    Ties keep rank order. If c·Σ C_i < S no plan fits; the ratios are then proportional to C_i.
    """
    cap = np.asarray(capacity_bytes, dtype=np.float64)
    if len(cap) == 0 or np.any(cap <= 0) or state_bytes <= 0:
        raise ValueError(f"skewed_state_ratios: need positive capacities and state, got "
                         f"{cap.tolist()}, {state_bytes}")
    room = memory_fraction * cap
    if room.sum() < state_bytes:
        return [float(c) for c in cap / cap.sum()]
    ratios = np.zeros(len(cap))
    left = float(state_bytes)
    for i in np.argsort(-cap, kind="stable"):
        take = min(left, room[i])
        ratios[i], left = take / state_bytes, left - take
    return [float(r) for r in ratios / ratios.sum()]


def integer_targets(state_ratios: Sequence[float], total_numel: int) -> list[int]:
    """Per-rank element totals proportional to ``state_ratios`` (largest-remainder rounding).

    Raises:
        ValueError: a ratio negative or not finite, or ratios not summing to 1 (±1e-6).
    """
    r = np.asarray(state_ratios, dtype=np.float64)
    if r.ndim != 1 or len(r) == 0:
        raise ValueError(f"state ratios must be a non-empty list, got {list(state_ratios)}")
    if not np.all(np.isfinite(r)) or np.any(r < 0) or abs(r.sum() - 1.0) > 1e-6:
        raise ValueError(f"state ratios must be >= 0 and sum to 1, got {list(state_ratios)} "
                         f"(sum {float(r.sum()) if np.all(np.isfinite(r)) else 'nan'})")
    exact = r / r.sum() * total_numel
    base = np.floor(exact).astype(np.int64)
    left = total_numel - int(base.sum())
    frac = exact - base
    frac[r == 0] = -1.0  # zero-ratio ranks never receive a leftover element
    for i in np.argsort(-frac, kind="stable")[:left]:
        base[i] += 1
    return [int(x) for x in base]


def layout_unit_shards(state_ratios: Sequence[float],
                       unit_numels: Sequence[int]) -> list[list[int]]:
    """Per-unit, per-rank shard sizes (elements) for the given state ratios.

    Args:
        state_ratios: r_i per rank (>= 0, sum 1).
        unit_numels: elements of each unit, in the engine's order (layers, then the root unit).

    Returns:
        ``layout[u][i]`` = elements of unit u held by rank i; each row sums to
        ``unit_numels[u]``; each rank's total equals ``integer_targets(r, Σ numel)[i]``.
        A unit is "even" when its sizes over the ranks with r_i > 0 differ by at most 1.
        Ranks with r_i = 0 hold nothing. Example: r = (0.75, 0.25), two units of 4 ->
        ``[[2, 2], [4, 0]]`` (one unit 1:1, one 1:0).

    Raises:
        ValueError: bad ratios (see ``integer_targets``) or a negative unit size.
    """
    numels = [int(n) for n in unit_numels]
    if any(n < 0 for n in numels):
        raise ValueError(f"unit sizes must be >= 0, got {numels}")
    targets = integer_targets(state_ratios, sum(numels))
    holders = [i for i, r in enumerate(state_ratios) if r > 0]
    n_hold = len(holders)
    layout = [[0] * len(targets) for _ in numels]
    remaining = list(targets)
    uneven_units = []
    # Even-split the smallest units first: that maximizes how many units stay even.
    for u in sorted(range(len(numels)), key=lambda u: numels[u]):
        q, rem = divmod(numels[u], n_hold)
        # Leftover elements of an even split go to the ranks with the most room left.
        extra = sorted(holders, key=lambda i: -remaining[i])[:rem]
        parts = {i: q + (1 if i in extra else 0) for i in holders}
        if all(remaining[i] >= parts[i] for i in holders):
            for i in holders:
                layout[u][i] = parts[i]
                remaining[i] -= parts[i]
        else:
            uneven_units.append(u)
    # Pour the remaining targets rank by rank over the uneven units, in unit order.
    uneven_units.sort()
    ranks_iter = iter(holders)
    rank = next(ranks_iter, None)
    for u in uneven_units:
        left = numels[u]
        while left > 0:
            while remaining[rank] == 0:
                rank = next(ranks_iter)
            take = min(left, remaining[rank])
            layout[u][rank] += take
            remaining[rank] -= take
            left -= take
    assert all(x == 0 for x in remaining), "layout invariant: every rank's target is filled"
    return layout
