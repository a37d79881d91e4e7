"""``gradient_accumulation_steps`` in the Trainer door: the stock loop counts k batches per
optimizer step, the engine sees the global batch once (docs/trainer_support.md "Gradient
accumulation").

[Note: the stock loop's k batches]
With ``gradient_accumulation_steps = k`` stock ``Trainer`` draws and counts k per-device
batches per optimizer step: its ``step``, ``steps_in_epoch`` (the loader's length), steps per
epoch, epoch fractions, the batches a resume skips, the optimizer step after the k-th batch.
Here one optimizer step is ONE engine step over this rank's share of the whole global batch
B. So the training loader yields each step's share, then ``AccumulationStep`` stand-ins (empty
lists) for the other per-device batches stock would draw: k - 1, or ceil(n k / B) - 1 after a
short last global batch of n rows (stock's count when k divides B; a stream of unknown length:
always k - 1). The loader's length, and so everything the loop counts, is stock's;
``training_step`` runs the engine on the share and returns 0 for a stand-in, so the logged
loss is the step's global item mean, stock's sum of k per-batch losses over
``num_items_in_batch``. Map-style stand-ins come from the batch sampler (a resume skips index
lists, reading nothing), a stream's from the stream.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, IterableDataset

from hf_cephalo.runtime import is_stream

__all__ = ["AccumulationStep", "with_accumulation_steps", "accumulation_steps_of",
           "warn_rows_dropped"]

logger = logging.getLogger(__name__)


class AccumulationStep(list):
    """Stands for one of the per-device batches stock would draw after this rank's share of a
    global batch ([Note: the stock loop's k batches]): empty, nothing to compute."""


def accumulation_steps_of(num_rows: int, global_batch_size: int, k: int) -> int:
    """The per-device batches stock draws for a global batch of ``num_rows`` rows: k for a full
    one, ceil(num_rows k / B) for a short last one."""
    if num_rows >= global_batch_size:
        return k
    return max(math.ceil(num_rows * k / global_batch_size), 1)


def _last_rows(num_rows: int, global_batch_size: int, drop_last: bool) -> int:
    partial = num_rows % global_batch_size
    return global_batch_size if drop_last or not partial else partial


class _WithStandIns:
    """A batch sampler yielding the inner sampler's per-step index lists, each followed by its
    ``AccumulationStep`` stand-ins; other attributes are the inner sampler's."""

    def __init__(self, inner, k: int) -> None:
        self.inner, self.k = inner, k

    def _counts(self) -> tuple[int, int]:
        """(global batches of the epoch, per-device batches of the last one)."""
        inner = self.inner
        last = _last_rows(inner.dataset_length, inner.global_batch_size, inner.drop_last)
        return len(inner), accumulation_steps_of(last, inner.global_batch_size, self.k)

    def __iter__(self) -> Iterator[list[int]]:
        num_batches, last = self._counts()
        for j, indices in enumerate(self.inner):  # the inner sampler marks the split schedule
            yield indices
            for _ in range((last if j == num_batches - 1 else self.k) - 1):
                yield AccumulationStep()

    def __len__(self) -> int:
        num_batches, last = self._counts()
        return 0 if num_batches == 0 else (num_batches - 1) * self.k + last

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Fetch:
    """The loader's dataset: an ``AccumulationStep`` index list fetches a stand-in; any other
    is the inner dataset's rows (``__getitems__`` where it has one)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def __getitems__(self, indices) -> Any:
        if isinstance(indices, AccumulationStep):
            return AccumulationStep()
        if getattr(self.inner, "__getitems__", None):
            return self.inner.__getitems__(indices)
        return [self.inner[i] for i in indices]

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _StreamWithStandIns(IterableDataset):
    """A ``StreamSteps`` whose global batches are each followed by their stand-ins: k - 1,
    or for a stream with a length, fewer after its short last global batch (as
    ``_WithStandIns``)."""

    def __init__(self, inner, k: int) -> None:
        self.inner, self.k = inner, k

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def _counts(self) -> tuple[int, int]:
        """As ``_WithStandIns._counts``; TypeError for a stream without a length."""
        inner = self.inner
        num_batches = len(inner)
        last = _last_rows(inner.dataset_length, inner.global_batch_size, inner.drop_last)
        return num_batches, accumulation_steps_of(last, inner.global_batch_size, self.k)

    def __len__(self) -> int:
        num_batches, last = self._counts()
        return 0 if num_batches == 0 else (num_batches - 1) * self.k + last

    def __iter__(self) -> Iterator[Any]:
        try:
            num_batches, last = self._counts()
        except TypeError:  # no length: every global batch is k per-device batches
            num_batches, last = -1, self.k
        for j, rows in enumerate(self.inner):
            yield rows
            for _ in range((last if j == num_batches - 1 else self.k) - 1):
                yield AccumulationStep()


class _PassStandIns:
    """The loader's collate function: a stand-in passes, anything else is collated."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Any:
        return data if isinstance(data, AccumulationStep) else self.collate_fn(data)


_LOADER_KWARGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                  "multiprocessing_context", "generator", "prefetch_factor",
                  "persistent_workers", "pin_memory_device")


def with_accumulation_steps(loader: DataLoader, k: int) -> DataLoader:
    """``loader`` (the runtime's training loader: a weighted batch sampler over a map-style
    dataset, or a stream) rebuilt, same class and settings, to yield each step's share followed
    by its ``AccumulationStep`` stand-ins ([Note: the stock loop's k batches]); k = 1: itself."""
    if k == 1:
        return loader
    kwargs = {name: getattr(loader, name) for name in _LOADER_KWARGS if hasattr(loader, name)}
    collate = _PassStandIns(loader.collate_fn)
    if isinstance(loader.dataset, IterableDataset):
        return type(loader)(_StreamWithStandIns(loader.dataset, k), batch_size=None,
                            collate_fn=collate, **kwargs)
    return type(loader)(_Fetch(loader.dataset),
                        batch_sampler=_WithStandIns(loader.batch_sampler, k),
                        collate_fn=collate, **kwargs)


def warn_rows_dropped(dataset, global_batch_size: int, k: int) -> None:
    """``dataloader_drop_last`` with k > 1: Cephalo drops the short last GLOBAL batch; stock
    drops only the short last per-device batch and trains the full ones before it as a shorter
    last step. Warn when that leaves rows out that stock trains on (never for k = 1; a stream:
    its length is not known up front)."""
    if is_stream(dataset):
        return
    partial = len(dataset) % global_batch_size
    kept_by_stock = partial * k // global_batch_size * global_batch_size // k
    if kept_by_stock:
        logger.warning("--dataloader_drop_last with --gradient_accumulation_steps %d: the last "
                       "%d rows of each epoch (a short global batch of %d) are dropped; stock "
                       "Trainer would still train %d of them as a shorter last step", k,
                       partial, global_batch_size, kept_by_stock)
