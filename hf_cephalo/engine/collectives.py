"""Padded equal-size collectives over uneven shards, on public ``torch.distributed`` only.

[Note: padded uneven collectives]
A unit of N elements is split at element granularity into per-rank shards of ``n_r`` elements
(``sum(n_r) == N``, zeros allowed). Every rank keeps its shard in a buffer padded to
``P = max(n_r)`` and the collectives move ``world_size * P`` elements with the equal-size
``all_gather_single`` / ``reduce_scatter_single`` (named ``*_into_tensor`` / ``*_tensor`` before
torch 2.13), which gloo and NCCL both support; list-based uneven all-gather fails on gloo. A rank
holding zero elements still sends its padding. Gradients are reduced with SUM only: the engine
normalizes by the all-reduced global item count before backward (docs/design.md contract 4), never with
AVG or a division by the world size (gloo has neither AVG nor PREMUL_SUM).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .stats import CollectiveStats

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherResult(NamedTuple):
    """An issued all-gather: ``output`` is (world_size * P,) and valid after ``work.wait()``."""

    output: torch.Tensor
    work: dist.Work | None


class ReduceScatterResult(NamedTuple):
    """An issued reduce-scatter: ``output`` is this rank's (P,) summed slice, valid after ``wait``.

    ``full`` is set by the all-reduce fallback: then ``output`` is a view into it.
    """

    output: torch.Tensor
    work: dist.Work | None
    full: torch.Tensor | None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_padded(local_padded: torch.Tensor, world_size: int, group, stats: CollectiveStats,
                      *, async_op: bool) -> AllGatherResult:
    """All-gather each rank's padded shard (P,) into a (world_size * P,) buffer.

    See [Note: padded uneven collectives]. Counted in ``stats.all_gather_*``.
    """
    output = torch.empty(world_size * local_padded.numel(), dtype=local_padded.dtype,
                         device=local_padded.device)
    stats.all_gather_count += 1
    stats.all_gather_bytes += _bytes(output)
    work = _all_gather_single(output, local_padded, group=group, async_op=async_op)
    return AllGatherResult(output, work if async_op else None)


def reduce_scatter_padded(full_padded: torch.Tensor, world_size: int, rank: int, group,
                          stats: CollectiveStats, *, async_op: bool,
                          use_all_reduce: bool = False) -> ReduceScatterResult:
    """SUM-reduce-scatter a (world_size * P,) buffer; this rank receives its (P,) slice.

    ``use_all_reduce`` selects the fallback for backends without reduce-scatter: all-reduce the
    whole buffer, then slice (``world_size`` times the receive volume). Counted in
    ``stats.reduce_scatter_*``.
    """
    pad = full_padded.numel() // world_size
    stats.reduce_scatter_count += 1
    stats.reduce_scatter_bytes += _bytes(full_padded)
    if use_all_reduce:
        work = dist.all_reduce(full_padded, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return ReduceScatterResult(full_padded[rank * pad:(rank + 1) * pad], work, full_padded)
    output = torch.empty(pad, dtype=full_padded.dtype, device=full_padded.device)
    work = _reduce_scatter_single(output, full_padded, op=dist.ReduceOp.SUM, group=group,
                                  async_op=async_op)
    return ReduceScatterResult(output, work if async_op else None, None)


def all_reduce_sum(t: torch.Tensor, group, stats: CollectiveStats) -> torch.Tensor:
    """In-place synchronous SUM all-reduce of a small tensor (item counts, loss sums, norms)."""
    stats.all_reduce_count += 1
    stats.all_reduce_bytes += _bytes(t)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def reduce_scatter_supported(group) -> bool:
    """Whether the group's backend implements reduce-scatter (gloo and NCCL do in torch >= 2.x)."""
    backend = dist.get_backend(group)
    return str(backend).lower() in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "xccl")
