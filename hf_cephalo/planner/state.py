"""Training-state partition: greedy ratios r_i, then the per-unit shard layout.

Paper §2.4 ("Training State Partition") and §3 (uneven sharding, the 3:1 example).

* ``partition_state``: give state to the rank with the lowest memory utilization
  (r_i·S + M_i) / C_i until all of S is placed. Done in infinitesimal steps this greedy is
  water-filling: r_i·S = max(0, λ·C_i − M_i) with λ chosen so that Σ r_i = 1; computed exactly
  by sorting the breakpoints M_i / C_i, O(N log N). It minimizes the maximum utilization.
* ``layout_unit_shards``: turn r_i into integer element counts per unit: every unit is split
  by the ratios (see [Note: ratio-split layout]), so an uneven unit's collectives move about
  what an even split's do (no rank holds most of a unit alone).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hf_cephalo.planner.types import DEFAULT_MEMORY_FRACTION

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
                        memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> list[float]:
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
    """Per-unit, per-rank shard sizes (elements): every unit split by the ratios.

    [Note: ratio-split layout]
    Each rank holds its r_i share of EVERY unit (``layout[u][i]`` is r_i·numel_u rounded), so
    every unit has the same shape of split and one measured uneven-collective factor applies to
    all of them, and no rank's piece of a unit is ever much larger than r_i of it (an
    all-gather moves N - n_i per rank, never a padded multiple). Rounding carries each rank's
    error from unit to unit: unit u gives rank i ``r_i·(numel_0 + ... + numel_u)`` minus what
    rank i already holds, rounded by largest remainder (never below 0), so each rank's running
    total stays within one element of its exact share r_i·Σ numel. The final totals usually
    equal ``integer_targets(r, Σ numel)``; they can differ from it by one element when a rank
    with a tiny share got an element early that a later unit cannot take back. Ranks with
    r_i = 0 hold nothing.

    Args:
        state_ratios: r_i per rank (>= 0, sum 1).
        unit_numels: elements of each unit, in the engine's order (any list: the engine passes
            its layers, then the embedding unit, then the head unit).

    Returns:
        ``layout[u][i]`` = elements of unit u held by rank i (>= 0); each row sums to
        ``unit_numels[u]``; each entry is within 2 elements of r_i·numel_u (usually 1); each
        rank's total is within 1 element of r_i·Σ numel. Example: r = (0.75, 0.25), two units
        of 4 -> ``[[3, 1], [3, 1]]``.

    Raises:
        ValueError: bad ratios (see ``integer_targets``) or a negative unit size.
    """
    numels = [int(n) for n in unit_numels]
    if any(n < 0 for n in numels):
        raise ValueError(f"unit sizes must be >= 0, got {numels}")
    integer_targets(state_ratios, sum(numels))  # validates the ratios (ValueError)
    r = np.asarray(state_ratios, dtype=np.float64)
    r = r / r.sum()
    holds = r > 0
    given = np.zeros(len(r), dtype=np.int64)
    layout, cumulative = [], 0
    for numel in numels:
        cumulative += numel
        row = _round_share(r * cumulative - given, numel, holds)
        given += row
        layout.append([int(x) for x in row])
    return layout


def _round_share(want: np.ndarray, numel: int, holds: np.ndarray) -> np.ndarray:
    """Non-negative integers summing to ``numel``, each near ``want`` (largest remainder).

    ``want`` sums to ``numel``; entries may be slightly negative (a rank that got a rounded-up
    element earlier). Ranks where ``holds`` is False get 0.
    """
    base = np.where(holds, np.maximum(np.floor(want), 0), 0).astype(np.int64)
    frac = np.where(holds, want - base, -np.inf)
    left = numel - int(base.sum())
    for i in np.argsort(-frac, kind="stable")[:max(left, 0)]:
        base[i] += 1
    while left < 0:  # clamping a negative want at 0 gave out too much: take back from the
        i = int(np.argmin(np.where(base > 0, frac, np.inf)))  # most over-served rank
        base[i] -= 1
        frac[i] += 1
        left += 1
    return base
