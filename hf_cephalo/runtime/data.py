"""The loader builder every front end uses: this rank's b_i rows of each global batch.

One function (``weighted_loader``) turns a map-style dataset and the user's collator into the
DataLoader a rank iterates: a ``WeightedBatchSampler`` (every rank the same permutation, its own
contiguous slice of each global batch; ``sampler.py``) and a collator that pads as one process
with the whole global batch would (``GlobalBatchCollator``) or per microbatch
(``MicrobatchCollator``, ``collate="microbatch"``). The CephaloTrainer, the Accelerate loop and
the TRL trainers build their loaders here; what differs between them (column pruning, the
sampling strategy's lengths, the Trainer's own collator wrapper) is decided by the front end
before the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch.utils.data import DataLoader

from hf_cephalo.runtime.sampler import (GlobalBatchCollator, MicrobatchCollator, SplitSchedule,
                                        WeightedBatchSampler, packs_without_padding)

__all__ = ["EpochDataLoader", "LoaderOptions", "weighted_loader", "COLLATE_CHOICES"]

COLLATE_CHOICES = ("global_batch", "microbatch")


class EpochDataLoader(DataLoader):
    """DataLoader whose ``set_epoch`` reaches its ``WeightedBatchSampler`` (Trainer and
    Accelerate call it between epochs)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """The DataLoader's own settings, passed through (``torch.utils.data.DataLoader``)."""

    num_workers: int = 0
    """Worker processes (0: load in the main process)."""
    pin_memory: bool = False
    """Pin host memory of the collated batches (CUDA)."""
    persistent_workers: bool = False
    """Keep the workers between epochs (num_workers > 0 only)."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead (num_workers > 0 only; None: torch's default)."""
    multiprocessing_context: Any = None
    """The workers' start method (num_workers > 0 only)."""

    def dataloader_kwargs(self) -> dict[str, Any]:
        extra = {} if self.num_workers == 0 else dict(
            persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context)
        return dict(num_workers=self.num_workers, pin_memory=self.pin_memory, **extra)


def weighted_loader(dataset, collate_fn: Callable[[list[Any]], Any], *,
                    batch_sizes: Sequence[int], rank: int, microbatch_size: int | None, seed: int,
                    shuffle: bool, drop_last: bool = False,
                    lengths: Sequence[int] | None = None, schedule: SplitSchedule | None = None,
                    collate: str = "global_batch",
                    options: LoaderOptions = LoaderOptions()) -> EpochDataLoader:
    """This rank's loader: per step a list of collated microbatches of ``microbatch_size``
    samples (m_i) holding its b_i rows of the global batch (``[]`` when it has none).

    Args:
        dataset: map-style (has ``__len__``).
        collate_fn: the user's collator (a list of samples -> a batch).
        batch_sizes: b_i per rank (samples); B = their sum.
        rank: this rank. microbatch_size: m_i (samples, >= 1); None: the rank's rows of a step
            as ONE batch (a custom loop, whose model cuts them into the plan's m_i).
        seed: the permutation of epoch e is seeded ``seed + e`` (identical on every rank).
        shuffle: random order (else dataset order). drop_last: drop a partial last global batch.
        lengths: per-sample lengths: group-by-length order instead (``sampler.global_batches``).
        schedule: the live split (``SplitSchedule``) the sampler and collator read at each step.
        collate: "global_batch" (padding as one process with the whole global batch) or
            "microbatch" (per microbatch); a packing collator that pads nothing is applied per
            microbatch either way ([Note: padding independent of the plan] in ``sampler.py``).
        options: the DataLoader's worker / pinning settings.

    Raises:
        ValueError: a dataset without a length, or an unknown ``collate``.
    """
    if not hasattr(dataset, "__len__"):
        raise ValueError(f"{type(dataset).__name__} has no length: the weighted split of each "
                         "global batch by the per-rank batch sizes b_i needs a map-style "
                         "dataset; materialize it first, e.g. datasets.Dataset.from_generator")
    if collate not in COLLATE_CHOICES:
        raise ValueError(f"collate = {collate!r}: use one of {COLLATE_CHOICES}")
    whole = collate == "global_batch" and not packs_without_padding(collate_fn)
    sampler = WeightedBatchSampler(len(dataset), batch_sizes, rank, seed=seed, shuffle=shuffle,
                                   drop_last=drop_last, lengths=lengths,
                                   yield_global_batch=whole, schedule=schedule)
    collator = (GlobalBatchCollator(collate_fn, batch_sizes, rank, microbatch_size, schedule)
                if whole else MicrobatchCollator(collate_fn, microbatch_size, schedule, rank))
    return EpochDataLoader(dataset, batch_sampler=sampler, collate_fn=collator,
                           **options.dataloader_kwargs())
