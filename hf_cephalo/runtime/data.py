"""The loader builder every front end uses: this rank's b_i rows of each global batch.

``weighted_loader`` turns a map-style dataset and the user's collator into the DataLoader a rank
iterates: a ``WeightedBatchSampler`` (``sampler.py``), every sample read under its own seed
(``sample_reads.py``), one of the collations ``COLLATE_CHOICES`` ([Note: padding independent of
the plan] in ``sampler.py``; docs/data.md, "The three collations"). Used by every front end.

[Note: the loader runs in the main process]
The loader a front end iterates has ``num_workers = 0``: its dataset (``_StepSource``) and
collate function run in the main process, where the per-step exchange can run (workers have no
process group). The DataLoader workers the user asked for read ahead inside it
(``ReadAhead``). So the loader survives what a front end may rebuild it from: stock Trainer's
resume (``accelerate.skip_first_batches``) makes a plain DataLoader of its dataset, batch
sampler and collate function, and gets the same steps.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader

from hf_cephalo.runtime.exchange import StepExchange
from hf_cephalo.runtime.global_width import (GlobalWidthCollator, WidthMeasure,
                                             check_global_width, collator_name)
from hf_cephalo.runtime.sample_reads import ReadAhead, Rows, SeededReads
from hf_cephalo.runtime.settings import COLLATE_CHOICES
from hf_cephalo.runtime.sampler import (GlobalBatchCollator, MicrobatchCollator, SplitSchedule,
                                        StepIndices, WeightedBatchSampler,
                                        packs_without_padding)

__all__ = ["EpochDataLoader", "LoaderOptions", "weighted_loader", "COLLATE_CHOICES"]

logger = logging.getLogger(__name__)

_REPORTED: set[str] = set()  # the collators whose fallback this process said already


class _Mode(enum.Enum):
    GLOBAL_WIDTH = "global_width"
    GLOBAL_BATCH = "global_batch"
    MICROBATCH = "microbatch"


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
        """The read-ahead DataLoader's worker settings ([Note: the loader runs in the main
        process]; pinning is the outer loader's, after collation)."""
        extra = {} if self.num_workers == 0 else dict(
            persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context)
        return dict(num_workers=self.num_workers, **extra)


class _StepSource(torch.utils.data.Dataset):
    """The dataset of the loader a front end iterates, read in the main process ([Note: the
    loader runs in the main process]): ``__getitems__(indices)`` decides the collation on the
    first step (collective for "global_width": ``check_global_width`` on that step's global
    batch, then the ranks agree) and returns the step as read ahead; ``finish`` (the loader's
    collate function) completes it: the width exchange, or nothing."""

    def __init__(self, reads: SeededReads, sampler: WeightedBatchSampler, collate_fn,
                 mode: _Mode, *, microbatch_size: int | None, schedule: SplitSchedule | None,
                 exchange: StepExchange | None, loader_kwargs: dict[str, Any],
                 description: str) -> None:
        self.reads, self.sampler, self.collate_fn, self.requested = reads, sampler, collate_fn, mode
        self.microbatch_size, self.schedule, self.exchange = microbatch_size, schedule, exchange
        self.loader_kwargs, self.description = loader_kwargs, description
        self.mode: _Mode | None = None
        self._ahead: ReadAhead | None = None
        self._width: GlobalWidthCollator | None = None

    @property
    def dataset(self):
        """The user's dataset."""
        return self.reads.dataset

    def __len__(self) -> int:
        return len(self.reads)

    def __getitem__(self, index: int) -> Any:
        return self.reads[index]

    def __getitems__(self, indices: StepIndices) -> Any:
        if self.mode is None:
            self._start(indices)
        if self.mode is not _Mode.GLOBAL_WIDTH:
            return self._ahead.get(indices)
        try:
            return self._ahead.get(indices)
        except Exception as e:  # noqa: BLE001 - every rank raises it in the exchange
            rows = Rows([], indices)
            rows.error = e
            return rows

    def finish(self, data: Any) -> list[Any]:
        return self._width(data) if self.mode is _Mode.GLOBAL_WIDTH else data

    def _start(self, indices: StepIndices) -> None:
        mode = self.requested
        if mode is _Mode.GLOBAL_WIDTH and not self._global_width_reproduces(indices):
            mode = _Mode.GLOBAL_BATCH
        rank, collate_fn = self.sampler.rank, self.collate_fn
        if mode is _Mode.GLOBAL_WIDTH:
            self._width = GlobalWidthCollator(collate_fn, self.reads, self.exchange, rank,
                                              self.microbatch_size, self.description)
            fn = WidthMeasure(collate_fn)
        elif mode is _Mode.GLOBAL_BATCH:
            fn = GlobalBatchCollator(collate_fn, self.sampler.batch_sizes, rank,
                                     self.microbatch_size, self.schedule)
        else:
            fn = MicrobatchCollator(collate_fn, self.microbatch_size, self.schedule, rank)
        self._ahead = ReadAhead(self.reads, self.sampler, fn, whole=mode is _Mode.GLOBAL_BATCH,
                                loader_kwargs=self.loader_kwargs)
        self.mode = mode

    def _global_width_reproduces(self, indices: StepIndices) -> bool:
        """Collective: ``check_global_width`` on this step's whole global batch (read once, in
        the main process), agreed by every rank; a 'no' is logged once by rank 0."""
        error = reason = None
        try:
            whole = self.sampler.whole_step(indices)
            samples = [self.reads.read(i, whole.epoch) for i in whole]
            reason = check_global_width(self.collate_fn, samples, whole.batch_sizes)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = e
        codes = [row[0] for row in self.exchange.gather([2 if error else int(reason is not None)])]
        self.exchange.fail_together([int(c == 2) for c in codes], error,
                                    f"{self.description}: checking the collator on step "
                                    f"{indices.step}")
        if not any(codes):
            return True
        reason = reason or "the check failed on another rank"
        name = collator_name(self.collate_fn)
        if self.exchange.rank == 0 and name not in _REPORTED:
            _REPORTED.add(name)
            logger.warning("hf_cephalo: the data collator %s cannot be applied to each rank's "
                           "rows padded to the global batch's width (%s); every rank reads and "
                           "collates the whole global batch instead (collate 'global_batch': "
                           "the same padding, O(B) data work per rank)", name, reason)
        return False


class _Finish:
    """The loader's collate function: ``_StepSource.finish`` (kept by a rebuilt loader)."""

    def __init__(self, source: _StepSource) -> None:
        self.source = source

    def __call__(self, data: Any) -> list[Any]:
        return self.source.finish(data)


def weighted_loader(dataset, collate_fn: Callable[[list[Any]], Any], *,
                    batch_sizes: Sequence[int], rank: int, microbatch_size: int | None, seed: int,
                    shuffle: bool, drop_last: bool = False,
                    lengths: Sequence[int] | None = None, schedule: SplitSchedule | None = None,
                    collate: str = "global_width", options: LoaderOptions = LoaderOptions(),
                    sample_seed: int | None = None, group=None,
                    device: torch.device | str | None = None,
                    description: str = "data") -> EpochDataLoader:
    """This rank's loader: per step a list of collated microbatches of ``microbatch_size``
    samples (m_i) holding its b_i rows of the global batch (``[]`` when it has none). For
    "global_width" every step is a collective over ``group``: iterate it on every rank. The
    loader itself has ``num_workers = 0``; ``options.num_workers`` read ahead inside it ([Note:
    the loader runs in the main process]).

    Args:
        dataset: map-style (has ``__len__``).
        collate_fn: the user's collator (a list of samples -> a batch).
        batch_sizes: b_i per rank (samples); B = their sum.
        rank: this rank (its index in ``batch_sizes`` and in ``group``).
        microbatch_size: m_i (samples, >= 1); None: the rank's rows of a step as ONE batch (a
            custom loop, whose model cuts them into the plan's m_i).
        seed: the permutation of epoch e is seeded ``seed + e`` (identical on every rank).
        shuffle: random order (else dataset order). drop_last: drop a partial last global batch.
        lengths: per-sample lengths: group-by-length order instead (``sampler.global_batches``).
        schedule: the live split (``SplitSchedule``) the sampler and collator read at each step.
        collate: one of ``COLLATE_CHOICES`` (the module note; the ``collate`` setting's help).
        options: the DataLoader's worker / pinning settings.
        sample_seed: the seed of each sample's random transforms ([Note: randomness tied to
            the sample] in ``sample_reads.py``); the Trainer passes its ``seed``. None: ``seed``.
        group: the process group of the ranks in ``batch_sizes`` ("global_width" exchanges
            over it every step; None: the default group).
        device: the exchange's tensors' device (None: CUDA for an NCCL-only group, else CPU).
        description: what the loader loads, for error messages ("training", "evaluation").

    Raises:
        ValueError: a dataset without a length, an unknown ``collate``, or for "global_width"
            on several ranks a process group that is missing or is not the ranks of the split.
    """
    if not hasattr(dataset, "__len__"):
        raise ValueError(f"{type(dataset).__name__} has no length: the weighted split of each "
                         "global batch by the per-rank batch sizes b_i needs a map-style "
                         "dataset; materialize it first, e.g. datasets.Dataset.from_generator")
    if collate not in COLLATE_CHOICES:
        raise ValueError(f"collate = {collate!r}: use one of {COLLATE_CHOICES}")
    mode = _Mode(collate)
    if packs_without_padding(collate_fn):
        mode = _Mode.MICROBATCH
    elif mode is _Mode.GLOBAL_WIDTH and len(batch_sizes) == 1:
        mode = _Mode.GLOBAL_BATCH  # one rank holds the whole batch: nothing to exchange
    sampler = WeightedBatchSampler(len(dataset), batch_sizes, rank, seed=seed, shuffle=shuffle,
                                   drop_last=drop_last, lengths=lengths, schedule=schedule)
    exchange = _exchange(group, device, batch_sizes, rank) if mode is _Mode.GLOBAL_WIDTH else None
    reads = SeededReads(dataset, seed if sample_seed is None else sample_seed)
    source = _StepSource(reads, sampler, collate_fn, mode, microbatch_size=microbatch_size,
                         schedule=schedule, exchange=exchange,
                         loader_kwargs=options.dataloader_kwargs(), description=description)
    MicrobatchCollator(collate_fn, microbatch_size)  # validates microbatch_size now
    return EpochDataLoader(source, batch_sampler=sampler, collate_fn=_Finish(source),
                           num_workers=0, pin_memory=options.pin_memory)


def _exchange(group, device, batch_sizes: Sequence[int], rank: int) -> StepExchange:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"collate 'global_width' on {len(batch_sizes)} ranks exchanges each "
                         "step's widths over torch.distributed, which is not initialized: call "
                         "init_process_group first, or use collate 'global_batch'")
    exchange = StepExchange(group, device)
    if (exchange.world_size, exchange.rank) != (len(batch_sizes), rank):
        raise ValueError(f"the process group has {exchange.world_size} ranks and this process "
                         f"is rank {exchange.rank} in it, but the split has {len(batch_sizes)} "
                         f"ranks ({list(batch_sizes)}) and this loader is for rank {rank}: pass "
                         "the group of the ranks that split the global batch")
    return exchange
