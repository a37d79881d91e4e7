"""Counters of the collectives an engine issued (counts and bytes), for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(kw_only=True)
class CollectiveStats:
    """Collectives issued by this rank since the last ``reset()``.

    Byte counts are the size of the full (padded) collective buffer: the gathered output of an
    all-gather, the input of a reduce-scatter, the reduced tensor of an all-reduce. Every rank
    counts the same values (the schedule is rank-identical).

    The ``peak_*`` fields are memory accounting of the schedule, in elements (numel), taken at
    every unshard / gradient allocation:
    ``peak_unsharded_numel``: most parameter elements held unsharded at once;
    ``peak_unsharded_grad_numel``: most elements of full (unsharded) unit gradients alive at once;
    ``peak_stash_*_bytes``: most bytes of stashed boundary tensors at once (device / pinned host).
    """

    all_gather_count: int = 0      # all-gathers (one per unshard of a unit)
    all_gather_bytes: int = 0      # bytes of gathered outputs, padding included
    reduce_scatter_count: int = 0  # reduce-scatters (or all-reduce fallbacks) of unit gradients
    reduce_scatter_bytes: int = 0  # bytes of reduce-scatter inputs, padding included
    all_reduce_count: int = 0      # small all-reduces (item counts, loss sums, norms)
    all_reduce_bytes: int = 0
    peak_unsharded_numel: int = 0
    peak_unsharded_grad_numel: int = 0
    peak_stash_device_bytes: int = 0   # boundary activations/grads stashed on the compute device
    peak_stash_host_bytes: int = 0     # ... offloaded to pinned CPU memory (CUDA offload only)
    host_syncs: int = 0  # host waits for the compute stream (CUDA; [Note: host waits for the
    #                      compute stream] in offload.py)

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
