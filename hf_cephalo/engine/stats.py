"""Counters of the collectives an engine issued (counts and bytes), for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(kw_only=True)
class CollectiveStats:
    """Collectives issued by this rank since the last ``reset()``.

    All-gather and reduce-scatter bytes are this rank's payload of the logical exchange, sent
    and received, whatever algorithm the backend runs (see [Note: uneven collectives] in
    ``collectives.py``): with W ranks, a unit of N elements (Nt trainable), this rank's shard of
    n elements (k trainable) and e bytes per element, one all-gather counts sent (W - 1)·n·e
    and received (N - n)·e; one reduce-scatter sent (Nt - k)·e and received (W - 1)·k·e; the
    reduce-scatter's all-reduce fallback a ring's 2·(W - 1)·Nt // W·e each way. Ranks with
    different shares count different values. ``all_reduce_bytes`` is the size of the small
    reduced tensors.

    The ``peak_*`` fields are memory accounting of the schedule, in elements (numel), taken at
    every unshard / gradient allocation:
    ``peak_unsharded_numel``: most parameter elements held unsharded at once;
    ``peak_unsharded_grad_numel``: most elements of full (unsharded) unit gradients alive at once;
    ``peak_stash_*_bytes``: most bytes of stashed boundary tensors at once (device / pinned host);
    ``peak_comm_buffer_bytes``: most bytes of transient communication buffers alive at once (a
    gathered output between issue and wait, a reduce-scatter output between issue and wait, the
    zero input of a rank without a gradient): see [Note: communication buffers] in
    ``flat_param.py``.
    ``relayout_*``: the in-memory re-layout's all-to-alls (``relayout.py``): sent / received
    count only the elements that change owner (what stays on a rank is copied locally), so
    they equal the ideal, the bytes whose owner changes; ``peak_relayout_buffer_bytes`` is the
    largest new shard-set of one unit (parameters, optimizer state, gradient) alive beside the
    old one.
    """

    all_gather_count: int = 0      # all-gathers (one per unshard of a unit)
    all_gather_sent_bytes: int = 0
    all_gather_received_bytes: int = 0
    reduce_scatter_count: int = 0  # reduce-scatters (or all-reduce fallbacks) of unit gradients
    reduce_scatter_sent_bytes: int = 0
    reduce_scatter_received_bytes: int = 0
    all_reduce_count: int = 0      # small all-reduces (item counts, loss sums, norms)
    all_reduce_bytes: int = 0
    peak_unsharded_numel: int = 0
    peak_unsharded_grad_numel: int = 0
    peak_stash_device_bytes: int = 0   # boundary activations/grads stashed on the compute device
    peak_stash_host_bytes: int = 0     # ... offloaded to pinned CPU memory (CUDA offload only)
    host_syncs: int = 0  # host waits for the compute stream (CUDA; [Note: host waits for the
    #                      compute stream] in offload.py)
    peak_comm_buffer_bytes: int = 0    # transient send/receive buffers of collectives
    relayout_count: int = 0  # all-to-alls of in-memory re-layouts (``relayout.py``), one per
    #                          moved tensor (parameter part, optimizer state, gradient) per unit
    relayout_sent_bytes: int = 0       # elements this rank gave to another owner, times e
    relayout_received_bytes: int = 0   # elements this rank took over from another owner, times e
    peak_relayout_buffer_bytes: int = 0  # most bytes of new shards allocated before the old
    #                                      ones of their unit were dropped (one unit at a time)

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
