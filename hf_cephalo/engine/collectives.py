"""Variable-size collectives over uneven shards, on public ``torch.distributed`` only.

[Note: uneven collectives]
A unit of N elements is split at element granularity into per-rank shards of ``n_r`` elements
(``sum(n_r) == N``, zeros allowed) and nothing is padded: every collective moves exactly the
elements of the logical exchange. The all-gather's output IS the unit's gathered (N,) buffer,
shards in rank order; the reduce-scatter's input is the unit's (Nt,) trainable gradient split
by each rank's trainable count ``k_r`` (views, no copy), its output this rank's (k_r,) sum.
Equal shards take the single-tensor collective, unequal ones the list form (on gloo, which
rejects an unequal list all-gather, one broadcast per owner). A rank with a zero-size shard
still joins every collective, so no rank waits for one another skipped. SUM only: the engine
divides by the all-reduced global item count before backward (gloo has no AVG).
``CollectiveStats`` counts the logical exchange's payload per rank, whatever the backend runs.
Per backend, measured times and byte counts: docs/engine.md, "Collectives".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .stats import CollectiveStats

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherResult(NamedTuple):
    """An issued all-gather: ``output`` is the (N,) gathered buffer, valid after ``work.wait()``
    (``work`` None for a synchronous call)."""

    output: torch.Tensor
    work: object | None


class ReduceScatterResult(NamedTuple):
    """An issued reduce-scatter: ``output`` is this rank's (k_self,) summed slice, valid after
    ``work.wait()``. ``full`` is set by the all-reduce fallback: then ``output`` is a view into
    it (the reduced (Nt,) input)."""

    output: torch.Tensor
    work: object | None
    full: torch.Tensor | None


class WorkList:
    """Several issued async collectives waited on as one (``wait`` waits for all)."""

    def __init__(self, works: Sequence):
        self.works = [w for w in works if w is not None]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _uses_gloo(group, t: torch.Tensor) -> bool:
    """Whether ``t``'s collectives run on gloo (pure gloo, or a CPU tensor of a mixed group)."""
    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend and ("nccl" not in backend or t.device.type == "cpu")


def all_gather_shards(local: torch.Tensor, sizes: Sequence[int], rank: int, group,
                      stats: CollectiveStats, *, async_op: bool) -> AllGatherResult:
    """Gather every rank's (n_r,) shard into a fresh (N,) buffer, shards in rank order.

    Args:
        local: (sizes[rank],) this rank's shard (contiguous). sizes: (W,) elements per rank.
    See [Note: uneven collectives]; counted in ``stats.all_gather_*``.
    """
    sizes = [int(n) for n in sizes]
    assert local.numel() == sizes[rank], (local.numel(), sizes, rank)
    output = torch.empty(sum(sizes), dtype=local.dtype, device=local.device)
    es = local.element_size()
    stats.all_gather_count += 1
    stats.all_gather_sent_bytes += (len(sizes) - 1) * sizes[rank] * es
    stats.all_gather_received_bytes += (sum(sizes) - sizes[rank]) * es
    if len(set(sizes)) == 1:
        work = _all_gather_single(output, local, group=group, async_op=async_op)
    elif _uses_gloo(group, local):
        views = list(output.split(sizes))
        views[rank].copy_(local)
        work = WorkList([dist.broadcast(v, group=group, group_src=r, async_op=async_op)
                         for r, v in enumerate(views)])
    else:
        work = dist.all_gather(list(output.split(sizes)), local, group=group, async_op=async_op)
    return AllGatherResult(output, work if async_op else None)


def reduce_scatter_shards(grad: torch.Tensor, counts: Sequence[int], rank: int, group,
                          stats: CollectiveStats, *, async_op: bool,
                          use_all_reduce: bool = False) -> ReduceScatterResult:
    """SUM-reduce-scatter a (Nt,) buffer split by ``counts``; this rank receives its slice.

    Args:
        grad: (sum(counts),) contiguous input; the all-reduce fallback overwrites it.
        counts: (W,) elements per rank (zeros allowed).
    Returns the (counts[rank],) summed slice (fresh, or a view into ``grad`` for the fallback).
    See [Note: uneven collectives]; counted in ``stats.reduce_scatter_*``.
    """
    counts = [int(k) for k in counts]
    world_size, total, mine = len(counts), sum(counts), counts[rank]
    assert grad.numel() == total, (grad.numel(), counts)
    es = grad.element_size()
    stats.reduce_scatter_count += 1
    if use_all_reduce:
        ring_bytes = 2 * (world_size - 1) * total // world_size * es
        stats.reduce_scatter_sent_bytes += ring_bytes
        stats.reduce_scatter_received_bytes += ring_bytes
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        start = sum(counts[:rank])
        return ReduceScatterResult(grad[start:start + mine], work, grad)
    stats.reduce_scatter_sent_bytes += (total - mine) * es
    stats.reduce_scatter_received_bytes += (world_size - 1) * mine * es
    output = torch.empty(mine, dtype=grad.dtype, device=grad.device)
    if len(set(counts)) == 1:
        work = _reduce_scatter_single(output, grad, op=dist.ReduceOp.SUM, group=group,
                                      async_op=async_op)
    else:
        work = dist.reduce_scatter(output, list(grad.split(counts)), op=dist.ReduceOp.SUM,
                                   group=group, async_op=async_op)
    return ReduceScatterResult(output, work if async_op else None, None)


def all_reduce_sum(t: torch.Tensor, group, stats: CollectiveStats) -> torch.Tensor:
    """In-place synchronous SUM all-reduce of a small tensor (item counts, loss sums, norms)."""
    stats.all_reduce_count += 1
    stats.all_reduce_bytes += t.numel() * t.element_size()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def reduce_scatter_supported(group) -> bool:
    """Whether the group's backend implements reduce-scatter (gloo and NCCL do in torch >= 2.x)."""
    backend = dist.get_backend(group)
    return str(backend).lower() in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "xccl")
