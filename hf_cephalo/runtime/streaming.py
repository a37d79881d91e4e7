"""Streamed datasets: this rank's rows of each global batch, read from a stream.

[Note: every rank reads the stream]
A stream (a torch ``IterableDataset``; ``datasets`` ``streaming=True`` or
``to_iterable_dataset()``) has no indices to permute or split. Every rank iterates the SAME
stream from its start, cuts it into consecutive global batches of B rows (the last one shorter,
or dropped with ``drop_last``) and keeps its rows of each: the contiguous slice
``split_counts`` gives it by the b_i in force at that step (global step = global batches drawn
so far in the run), collated as for a map-style dataset (``GlobalBatchCollator`` or
``MicrobatchCollator``). One process with the whole global batch reads the same consecutive
rows per step, so the trajectory is that process's; Accelerate's dispatching loader hands out
the same batches (rank 0 reads and sends them). The price: every rank reads and transforms
all B rows of every step. The stream must give every rank the same rows in the same order (a
seeded shuffle buffer does; ``set_epoch`` reaches the dataset), so it is read in the main
process (DataLoader workers would each read a part). A resume skips the consumed global
batches by reading them: a stream cannot seek (stock's ``skip_first_batches`` does the same).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Sequence

from torch.utils.data import DataLoader, IterableDataset

from hf_cephalo.runtime.sampler import (GlobalBatchCollator, MicrobatchCollator, SplitSchedule,
                                        packs_without_padding, split_counts)

__all__ = ["is_stream", "StreamSteps", "StreamDataLoader", "stream_loader"]


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream: a torch ``IterableDataset`` (``datasets``'
    ``IterableDataset`` is one when torch is installed) or anything without a length."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return True
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        return False
    return isinstance(dataset, datasets.IterableDataset)


class StreamSteps(IterableDataset):
    """The global batches of a stream (see [Note: every rank reads the stream]): per step the
    list of ``whole`` global batch rows, or this rank's share of them.

    Args:
        dataset: the stream (iterable; ``set_epoch`` is forwarded when it has one).
        batch_sizes: b_i per rank (samples); B = their sum.
        rank: this rank.
        drop_last: drop a last global batch shorter than B.
        whole: yield the whole global batch (for ``GlobalBatchCollator``) instead of the share.
        schedule: the live split; the step drawn is recorded in ``schedule.current_step``.

    ``len()`` is the number of global batches when the stream has a length; otherwise it raises
    TypeError (as a DataLoader over a stream does: front ends then need ``max_steps``).
    """

    def __init__(self, dataset, batch_sizes: Sequence[int], rank: int, *, drop_last: bool = False,
                 whole: bool = True, schedule: SplitSchedule | None = None) -> None:
        split_counts(0, batch_sizes)  # validates the sizes
        self.dataset, self.batch_sizes, self.rank = dataset, list(batch_sizes), rank
        self.drop_last, self.whole, self.schedule = drop_last, whole, schedule
        self.steps_drawn = 0  # global batches drawn in this run, over epochs (the global step)

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    @property
    def dataset_length(self) -> int:
        """The stream's number of rows (TypeError when it has no length)."""
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        full, partial = divmod(self.dataset_length, self.global_batch_size)
        return full + (1 if partial and not self.drop_last else 0)

    def _sizes_at(self, step: int) -> list[int]:
        return self.batch_sizes if self.schedule is None else self.schedule.batch_sizes_at(step)

    def __iter__(self) -> Iterator[list[Any]]:
        rows = iter(self.dataset)
        B = self.global_batch_size
        while True:
            batch = list(itertools.islice(rows, B))
            if not batch or (self.drop_last and len(batch) < B):
                return
            step = self.steps_drawn
            self.steps_drawn += 1
            if self.schedule is not None:
                self.schedule.current_step = step
            if self.whole:  # GlobalBatchCollator splits it by this step's sizes
                yield batch
                continue
            counts = split_counts(len(batch), self._sizes_at(step))
            start = sum(counts[:self.rank])
            yield batch[start:start + counts[self.rank]]


class StreamDataLoader(DataLoader):
    """DataLoader over ``StreamSteps`` whose ``set_epoch`` reaches the stream (the Trainer and
    Accelerate call it between epochs)."""

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def stream_loader(dataset, collate_fn: Callable[[list[Any]], Any], *, batch_sizes: Sequence[int],
                  rank: int, microbatch_size: int | None, drop_last: bool = False,
                  schedule: SplitSchedule | None = None, collate: str = "global_batch",
                  pin_memory: bool = False) -> StreamDataLoader:
    """This rank's loader over a stream: per step a list of collated microbatches of
    ``microbatch_size`` (m_i; None: the rank's rows as one batch) holding its rows of the
    global batch (``[]`` when it has none). ``collate``: "microbatch" collates each microbatch
    on its own, any other mode the whole global batch once (a packing collator that pads
    nothing: per microbatch in every mode), as ``weighted_loader``. Reads in the main process
    ([Note: every rank reads the stream])."""
    whole = collate != "microbatch" and not packs_without_padding(collate_fn)
    steps = StreamSteps(dataset, batch_sizes, rank, drop_last=drop_last, whole=whole,
                        schedule=schedule)
    collator = (GlobalBatchCollator(collate_fn, batch_sizes, rank, microbatch_size, schedule)
                if whole else MicrobatchCollator(collate_fn, microbatch_size, schedule, rank))
    return StreamDataLoader(steps, batch_size=None, collate_fn=collator, num_workers=0,
                            pin_memory=pin_memory)

