"""Reading a step's rows: every sample under its own seed, ahead of the step in DataLoader workers.

``SeededReads`` wraps the user's map-style dataset: ``read(index, epoch)`` is ``dataset[index]``
with Python's, NumPy's and torch's CPU generators seeded for that sample and epoch and restored
afterwards. ``ReadAhead`` hands the loader the rows of the step it asks for, read by DataLoader
workers ahead of time in the order the sampler will ask for them (or in the main process with
``num_workers = 0``), so that the loader itself runs in the main process where the per-step
width exchange can run ([Note: the global width] in ``global_width.py``).

[Note: randomness tied to the sample]
A random transform of sample k in epoch e draws from generators seeded with
``sample_seed(seed, e, k)`` (a hash of the three), whatever rank, worker or step reads it, so
another plan, a live switch of b_i, or a second read of the same row (the global width's extra
row) sees the same values. The generators are forked around the read: the process's own streams
(dropout, the worker's) are as if the read had not drawn at all. What is not tied to a sample
is seeded per rank as stock Trainer does: DataLoader workers run ``seed_worker(worker_id,
num_workers, rank)``. Generators the dataset owns (a ``numpy.random.Generator`` attribute) and
CUDA generators are not reached: such a dataset can give different rows to different reads,
which the global width detects as item sizes that differ across ranks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from hf_cephalo.runtime.sampler import StepIndices, WeightedBatchSampler

__all__ = ["Rows", "SeededReads", "ReadAhead", "sample_seed", "preserved_rng", "read_sample"]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch`` (a 63-bit hash of the three integers)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(epoch)}:{int(index)}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@contextlib.contextmanager
def preserved_rng(seed: int | None = None) -> Iterator[None]:
    """Run the body with Python's, NumPy's and torch's CPU generators seeded with ``seed``
    (None: as they are), and give them back their states afterwards. Only the CPU generator:
    ``torch.manual_seed`` would also reseed every CUDA device's (left reseeded, as only the
    CPU's is given back), and costs a formatted stack per call on a machine without one."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.default_generator.manual_seed(seed)
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def read_sample(dataset, index: int, *, seed: int, epoch: int) -> Any:
    """``dataset[index]`` as every Cephalo loader reads it in ``epoch`` ([Note: randomness tied
    to the sample]); a single-process reference reads its rows with this too."""
    with preserved_rng(sample_seed(seed, epoch, index)):
        return dataset[index]


class Rows(list):
    """One step's samples as read (a ``list``), with the ``StepIndices`` they were read for;
    ``widths`` (per sample, axis name -> width) once measured; ``error`` when reading failed."""

    def __init__(self, samples=(), indices: StepIndices | None = None) -> None:
        super().__init__(samples)
        self.indices = indices if indices is not None else StepIndices()
        self.widths: list[dict[str, int]] | None = None
        self.error: BaseException | None = None

    def __reduce__(self):  # back from DataLoader workers with its attributes
        return (_rows, (list(self), self.indices, self.widths))


def _rows(samples, indices, widths) -> Rows:
    rows = Rows(samples, indices)
    rows.widths = widths
    return rows


class SeededReads(torch.utils.data.Dataset):
    """The user's dataset read per sample under its seed ([Note: randomness tied to the
    sample]); ``__getitems__`` takes a step's ``StepIndices`` and returns its ``Rows``."""

    def __init__(self, dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.read(index, 0)

    def read(self, index: int, epoch: int) -> Any:
        return read_sample(self.dataset, index, seed=self.seed, epoch=epoch)

    def __getitems__(self, indices: StepIndices) -> Rows:
        # one read per sample (not the dataset's own batched __getitems__): a batched
        # transform would draw for the batch, not for each sample
        return Rows([self.read(i, indices.epoch) for i in indices], indices)


class _Tagged:
    """Worker-side collate: ``(indices, fn(rows))``, so the main process can check that a
    prefetched step is the one the loader asks for."""

    def __init__(self, fn: Callable[[Rows], Any]) -> None:
        self.fn = fn

    def __call__(self, rows: Rows) -> tuple[StepIndices, Any]:
        return rows.indices, self.fn(rows)


class _StepsFrom:
    """The read-ahead loader's batch sampler: the steps of one epoch from a given step on."""

    def __init__(self, sampler: WeightedBatchSampler, whole: bool) -> None:
        self.sampler, self.whole = sampler, whole
        self.epoch = self.first_step = 0

    def __iter__(self) -> Iterator[StepIndices]:
        return self.sampler.iter_steps(self.epoch, self.first_step, whole=self.whole)

    def __len__(self) -> int:
        return max(0, (self.epoch + 1) * len(self.sampler) - self.first_step)


class ReadAhead:
    """``get(indices)``: ``fn(rows)`` for the rows of the step ``indices`` (this rank's share,
    or with ``whole`` the whole global batch of that step).

    With ``num_workers > 0`` an inner DataLoader reads and runs ``fn`` in its workers from the
    step asked for on, in the sampler's order; a step that is not the one prefetched (a live
    switch recorded after it was read ahead, a skip on resume, a new epoch) is read in the main
    process and the read-ahead restarts after it. Worker seeding: ``seed_worker`` per rank, the
    workers' base seed from a generator of their own (the main process's streams stay as stock).
    """

    def __init__(self, reads: SeededReads, sampler: WeightedBatchSampler,
                 fn: Callable[[Rows], Any], *, whole: bool, loader_kwargs: dict[str, Any]) -> None:
        self.reads, self.sampler, self.fn, self.whole = reads, sampler, fn, whole
        self.num_workers = int(loader_kwargs.get("num_workers", 0))
        self._loader: DataLoader | None = None
        self._iter = None
        self._next: tuple[int, int] | None = None
        self.stale_steps = 0  # prefetched steps that were not the one asked for (read again)
        if self.num_workers > 0:
            from transformers.trainer_utils import seed_worker

            self._steps = _StepsFrom(sampler, whole)
            generator = torch.Generator()
            generator.manual_seed(sample_seed(reads.seed, -1, sampler.rank))
            self._loader = DataLoader(
                reads, batch_sampler=self._steps, collate_fn=_Tagged(fn), generator=generator,
                worker_init_fn=functools.partial(seed_worker, num_workers=self.num_workers,
                                                 rank=sampler.rank), **loader_kwargs)

    def get(self, indices: StepIndices) -> Any:
        want = self.sampler.whole_step(indices) if self.whole else indices
        if self._loader is None:
            return self.fn(self.reads.__getitems__(want))
        if self._iter is None or self._next != (want.epoch, want.step):
            self._restart(want.epoch, want.step)
        self._next = (want.epoch, want.step + 1)
        got = next(self._iter, None)
        if got is not None and got[0].same_step(want):
            return got[1]
        self._iter = None  # stale (see the class doc): read this step here, restart after it
        self.stale_steps += 1
        return self.fn(self.reads.__getitems__(want))

    def _restart(self, epoch: int, step: int) -> None:
        self._iter = None  # first: a non-persistent iterator's workers stop before new ones start
        self._steps.epoch, self._steps.first_step = epoch, step
        self._iter = iter(self._loader)
