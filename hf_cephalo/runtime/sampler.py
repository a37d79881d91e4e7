"""Weighted batch sampler: rank i gets exactly b_i samples of every global batch.

Every rank builds the SAME permutation of the dataset (seeded by ``seed + epoch``), cuts it into
global batches of B = sum_i b_i indices (ordered by ``train_sampling_strategy``: random,
sequential or group_by_length) and takes its own contiguous slice of each: a pure function of
(epoch, seed, dataset length, batch sizes), so no communication is needed and every rank takes
the same number of steps. Each step's slice is a ``StepIndices``, which also says where its
indices sit in which global batch, split how. docs/accelerate.md, "The weighted batch sampler".
"""

# [Note: last partial global batch]
# When the dataset length N is not a multiple of B, the last global batch holds n = N mod B
# samples. They are split proportionally to b_i with the largest-remainder method (exact integer
# arithmetic, ties to the lower rank): rank i gets floor(n·b_i/B) or one more, never more than
# b_i, and a rank with b_i = 0 gets none. No sample is duplicated or dropped (unless
# ``drop_last``), so every sample is used exactly once per epoch. A rank may therefore get ZERO
# samples in the last step (e.g. 1 leftover sample on 3 ranks); it still yields an empty list
# so that it joins the step's collectives — the loader's width exchange and the engine's, which
# accepts an empty microbatch list.

# [Note: padding independent of the plan]
# A collator pads the rows it is given to the longest of them, and padding is not neutral (with
# left padding the first real token is predicted from a pad position; GPT-2 without
# ``position_ids`` numbers positions from the first column), so a row must get the width of its
# whole global batch, whatever the plan. Three ways (``runtime/data.py``, docs/data.md):
# "global_width" (default): a rank reads and collates its b_i rows only, padded to the global
# batch's width by a per-step exchange ([Note: the global width] in ``global_width.py``);
# "global_batch" (``GlobalBatchCollator``): every rank reads and collates all B rows and keeps
# its own, the fallback for a collator the first is not exact for; "microbatch"
# (``MicrobatchCollator``): each microbatch padded on its own, plan-dependent. A packing
# collator that pads nothing (``DataCollatorWithFlattening`` with ``position_ids``) gives the
# same tokens however the samples are grouped and makes one row that cannot be cut into
# samples: it is applied per microbatch in every mode (``packs_without_padding``).

# [Note: switching the split live]
# A live re-balance (``runtime/adaptive.py``) changes b_i and m_i between two steps. The
# global batches do not change (they depend on seed, epoch, dataset length and B only); only
# their split does. ``SplitSchedule`` records which (b_i, m_i) hold from which global step
# (``epoch · steps_per_epoch + index in the epoch``); the sampler reads it when it draws step k
# (the loader itself runs in the main process and does not run ahead: after the previous step
# ended) and writes the split into step k's ``StepIndices``, which every collator cuts by. A
# step that DataLoader workers read ahead under the old split is not that step any more
# (``StepIndices.same_step``): it is read again (``ReadAhead``), so a switch recorded at a step
# boundary applies to the next step on every rank.

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = [
    "StepIndices",
    "WeightedBatchSampler",
    "SplitSchedule",
    "MicrobatchCollator",
    "GlobalBatchCollator",
    "packs_without_padding",
    "split_counts",
    "split_microbatches",
    "global_batches",
    "cut_rows",
    "split_rows",
]


def _check_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = list(batch_sizes)
    if not sizes:
        raise ValueError("batch_sizes is empty; give one batch size b_i (samples) per rank")
    for rank, b in enumerate(sizes):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"batch_sizes[{rank}] = {b!r}: each per-rank batch size must be an "
                             f"integer >= 0 (samples); got {sizes}")
    if sum(sizes) == 0:
        raise ValueError(f"batch_sizes {sizes} sum to 0: at least one rank must take samples")
    return sizes


def split_counts(num_samples: int, batch_sizes: Sequence[int]) -> list[int]:
    """Split ``num_samples`` (<= sum of ``batch_sizes``) proportionally to ``batch_sizes``.

    Largest-remainder method with exact integer arithmetic; ties go to the lower rank. Returns
    per-rank counts (samples) that sum to ``num_samples``, with ``count_i <= batch_sizes[i]``
    and ``count_i == 0`` where ``batch_sizes[i] == 0``. For ``num_samples == sum(batch_sizes)``
    this returns ``batch_sizes`` itself. See [Note: last partial global batch].

    Raises ValueError if ``num_samples`` is negative or larger than the global batch size.
    """
    sizes = _check_batch_sizes(batch_sizes)
    global_batch_size = sum(sizes)
    if not 0 <= num_samples <= global_batch_size:
        raise ValueError(f"num_samples = {num_samples} must be in [0, {global_batch_size}] "
                         f"(the global batch size, sum of {sizes})")
    quotients = [num_samples * b // global_batch_size for b in sizes]
    remainders = [num_samples * b % global_batch_size for b in sizes]
    missing = num_samples - sum(quotients)
    # Sum of remainders / B == missing and every remainder < B, so the `missing` largest
    # remainders are all > 0: a rank with b_i = 0 (remainder 0) never receives a sample.
    order = sorted(range(len(sizes)), key=lambda r: (-remainders[r], r))
    for rank in order[:missing]:
        quotients[rank] += 1
    return quotients


def global_batches(dataset_length: int, global_batch_size: int, *, epoch: int = 0, seed: int = 0,
                   shuffle: bool = True, drop_last: bool = False,
                   lengths: Sequence[int] | None = None) -> list[list[int]]:
    """The epoch's global batches: lists of dataset indices, ``global_batch_size`` each.

    The permutation is ``torch.randperm(dataset_length)`` from a generator seeded with
    ``seed + epoch`` (identical on every rank), or ``range(dataset_length)`` without shuffle.
    With ``lengths`` (one per sample; group-by-length), the order is stock Trainer's
    ``get_length_grouped_indices(lengths, global_batch_size)`` with that generator.
    The last batch is shorter unless ``drop_last`` (then it is dropped).
    Raises ValueError for a negative length, a batch size < 1 or a wrong number of lengths.
    """
    if dataset_length < 0 or global_batch_size < 1:
        raise ValueError(f"dataset_length = {dataset_length} must be >= 0 and global_batch_size = "
                         f"{global_batch_size} must be >= 1 (samples)")
    if lengths is not None and len(lengths) != dataset_length:
        raise ValueError(f"{len(lengths)} lengths for {dataset_length} samples: give one length "
                         "(tokens) per sample")
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    if lengths is not None:
        from transformers.trainer_pt_utils import get_length_grouped_indices

        order = get_length_grouped_indices(list(lengths), global_batch_size, generator=generator) \
            if dataset_length else []
    elif shuffle:
        order = torch.randperm(dataset_length, generator=generator).tolist()
    else:
        order = list(range(dataset_length))
    stop = dataset_length - dataset_length % global_batch_size if drop_last else dataset_length
    return [order[start:min(start + global_batch_size, stop)]
            for start in range(0, stop, global_batch_size)]


def split_microbatches(indices: Sequence[Any],
                       microbatch_size: int | None) -> list[list[Any]]:
    """Cut a rank's batch into consecutive microbatches of ``microbatch_size`` (m_i) items.

    A full batch b_i = l_i·m_i gives exactly l_i microbatches; a partial last batch gives
    ceil(len/m_i) microbatches, the last one shorter; an empty batch gives ``[]``. None: the
    whole batch as one (a custom loop's model cuts it into the plan's m_i itself).
    Raises ValueError if ``microbatch_size < 1``.
    """
    items = list(indices)
    if microbatch_size is None:
        return [items] if items else []
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size = {microbatch_size!r} must be an integer >= 1 (samples)")
    return [items[i:i + microbatch_size] for i in range(0, len(items), microbatch_size)]


class StepIndices(list):
    """The dataset indices of one step's rows for one rank (a ``list`` of ints), with where they
    sit: the rows are positions ``start .. start + len - 1`` of the global batch of global step
    ``step`` (epoch ``epoch``), split by ``batch_sizes`` (b_i per rank, in force when the step
    was drawn). ``microbatch_sizes``: m_i per rank in force then (None: the loader's fixed
    m_i). ``whole``: the list is the whole global batch (for ``GlobalBatchCollator``), not a
    rank's share. Equal to a plain list of the same indices."""

    def __init__(self, indices: Sequence[int] = (), *, epoch: int = 0, step: int = 0,
                 start: int = 0, batch_sizes: Sequence[int] = (),
                 microbatch_sizes: Sequence[int] | None = None, whole: bool = False) -> None:
        super().__init__(indices)
        self.epoch, self.step, self.start, self.whole = epoch, step, start, whole
        self.batch_sizes = list(batch_sizes)
        self.microbatch_sizes = None if microbatch_sizes is None else list(microbatch_sizes)

    def same_step(self, other: "StepIndices") -> bool:
        """The same rows of the same step, split and cut the same way (a prefetched step is
        still valid: [Note: switching the split live])."""
        return (list(self) == list(other) and self.meta() == other.meta())

    def meta(self) -> tuple:
        return (self.epoch, self.step, self.start, self.batch_sizes, self.microbatch_sizes,
                self.whole)

    def __reduce__(self):  # pickled to DataLoader workers with its attributes
        return (_step_indices, (list(self), self.meta()))


def _step_indices(indices: list[int], meta: tuple) -> StepIndices:
    epoch, step, start, batch_sizes, microbatch_sizes, whole = meta
    return StepIndices(indices, epoch=epoch, step=step, start=start, batch_sizes=batch_sizes,
                       microbatch_sizes=microbatch_sizes, whole=whole)


class SplitSchedule:
    """The per-rank split (b_i, m_i) in force at each global step; see [Note: switching the
    split live].

    Args:
        batch_sizes: b_i per rank from step 0 (samples).
        microbatch_sizes: m_i per rank from step 0 (samples; 0 for an idle rank).

    Attributes:
        current_step: the global step whose indices the sampler drew last (None before).
    """

    def __init__(self, batch_sizes: Sequence[int], microbatch_sizes: Sequence[int]) -> None:
        self._entries: list[tuple[int, list[int], list[int]]] = []
        self.current_step: int | None = None
        self.switch(0, batch_sizes, microbatch_sizes)

    def switch(self, from_step: int, batch_sizes: Sequence[int],
               microbatch_sizes: Sequence[int]) -> None:
        """Use ``batch_sizes`` / ``microbatch_sizes`` from global step ``from_step`` on.

        Raises ValueError: invalid sizes, another global batch size or world size than the
        schedule's, or ``from_step`` before the last switch."""
        sizes = _check_batch_sizes(batch_sizes)
        micro = [int(m) for m in microbatch_sizes]
        if len(micro) != len(sizes) or any(m < 0 or (b > 0 and m < 1)
                                           for b, m in zip(sizes, micro)):
            raise ValueError(f"microbatch sizes {micro} do not fit batch sizes {sizes}: one "
                             "m_i >= 1 per rank with b_i > 0")
        if self._entries:
            last_step, last_sizes, _ = self._entries[-1]
            if sum(sizes) != sum(last_sizes) or len(sizes) != len(last_sizes):
                raise ValueError(f"batch sizes {sizes} change the global batch size or world "
                                 f"size of {last_sizes}: a live switch keeps both")
            if from_step < last_step:
                raise ValueError(f"switch from step {from_step} is before the last one "
                                 f"(step {last_step})")
            if from_step == last_step:
                self._entries.pop()
        self._entries.append((int(from_step), sizes, micro))

    def batch_sizes_at(self, step: int) -> list[int]:
        """b_i per rank in force at global step ``step``."""
        return self._at(step)[1]

    def microbatch_sizes_at(self, step: int) -> list[int]:
        """m_i per rank in force at global step ``step``."""
        return self._at(step)[2]

    def _at(self, step: int) -> tuple[int, list[int], list[int]]:
        current = self._entries[0]
        for entry in self._entries:
            if entry[0] <= step:
                current = entry
        return current


class WeightedBatchSampler(Sampler[list[int]]):
    """Batch sampler that yields, per step, this rank's b_i indices of the global batch.

    Args:
        dataset_length: number of samples N in the dataset.
        batch_sizes: per-rank batch sizes b_i in rank order (samples; zeros allowed); the
            global batch size is B = sum(batch_sizes).
        rank: this process's rank (index into ``batch_sizes``).
        seed: base seed; the permutation of epoch e uses ``seed + e`` (call ``set_epoch``).
        shuffle: permute the dataset each epoch (False for evaluation: dataset order).
        drop_last: drop the last partial global batch instead of splitting it.
        lengths: per-sample lengths: group-by-length order (see ``global_batches``).
        yield_global_batch: yield the whole global batch at every step (for
            ``GlobalBatchCollator``, which keeps this rank's rows after collating it) instead of
            this rank's share; ``local_batches`` gives this rank's share either way.
        schedule: a ``SplitSchedule`` whose sizes replace ``batch_sizes`` from the step they
            are recorded for ([Note: switching the split live]); None: ``batch_sizes`` always.

    Every rank yields ``len(self)`` lists (= ceil(N/B), or floor with ``drop_last``); the lists
    of all ranks at one step are disjoint and together form the global batch; over an epoch each
    index appears exactly once. Lists may be empty in the last step (see module note).

    Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=MicrobatchCollator(...))``
    and do NOT pass that loader to ``Accelerator.prepare`` (it would re-shard it by world size);
    ``CephaloAccelerator.prepare_data_loader`` returns such loaders unchanged.

    Raises ValueError for a negative length, invalid batch sizes, or a rank out of range.
    """

    def __init__(self, dataset_length: int, batch_sizes: Sequence[int], rank: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 lengths: Sequence[int] | None = None, yield_global_batch: bool = False,
                 schedule: SplitSchedule | None = None) -> None:
        self.batch_sizes = _check_batch_sizes(batch_sizes)
        self.yield_global_batch = bool(yield_global_batch)
        if schedule is not None and sum(schedule.batch_sizes_at(0)) != sum(self.batch_sizes):
            raise ValueError(f"the split schedule's global batch size "
                             f"{sum(schedule.batch_sizes_at(0))} differs from batch_sizes "
                             f"{self.batch_sizes}")
        self.schedule = schedule
        if isinstance(dataset_length, bool) or not isinstance(dataset_length, int) or dataset_length < 0:
            raise ValueError(f"dataset_length = {dataset_length!r} must be an integer >= 0 (samples)")
        if not 0 <= rank < len(self.batch_sizes):
            raise ValueError(f"rank = {rank} is out of range for {len(self.batch_sizes)} per-rank "
                             f"batch sizes {self.batch_sizes}; the plan must have one entry per rank")
        self.dataset_length = dataset_length
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        if self.lengths is not None and len(self.lengths) != dataset_length:
            raise ValueError(f"{len(self.lengths)} lengths for {dataset_length} samples: give one "
                             "length (tokens) per sample")
        self.epoch = 0
        self.skip_batches = 0  # batches of the epoch the next iteration skips (see __iter__)
        self._cached: tuple[tuple, list[list[int]]] | None = None

    @property
    def global_batch_size(self) -> int:
        """B = sum of the per-rank batch sizes (samples per optimizer step, all ranks)."""
        return sum(self.batch_sizes)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (same call on every rank)."""
        self.epoch = epoch

    def _global_batches(self, epoch: int) -> list[list[int]]:
        key = (epoch, self.seed, self.shuffle, self.drop_last, self.dataset_length,
               self.global_batch_size)
        if self._cached is None or self._cached[0] != key:  # one epoch's permutation, kept
            self._cached = (key, global_batches(
                self.dataset_length, self.global_batch_size, epoch=epoch, seed=self.seed,
                shuffle=self.shuffle, drop_last=self.drop_last, lengths=self.lengths))
        return self._cached[1]

    def whole_step(self, indices: StepIndices) -> StepIndices:
        """The whole global batch of the step ``indices`` come from, with their split."""
        batch = self._global_batches(indices.epoch)[indices.step - indices.epoch * len(self)]
        return StepIndices(batch, epoch=indices.epoch, step=indices.step, start=0,
                           batch_sizes=indices.batch_sizes,
                           microbatch_sizes=indices.microbatch_sizes, whole=True)

    def rank_batches(self, rank: int) -> list[list[int]]:
        """All of ``rank``'s per-step index lists for the current epoch (pure; no communication)."""
        return list(self.iter_steps(self.epoch, rank=rank))

    def _sizes_at(self, step: int) -> list[int]:
        return self.batch_sizes if self.schedule is None else self.schedule.batch_sizes_at(step)

    def iter_steps(self, epoch: int, first_step: int = 0, *, rank: int | None = None,
                   whole: bool = False, mark: bool = False) -> Iterator[StepIndices]:
        """Per step of ``epoch`` from global step ``first_step`` on, ``rank``'s share of the
        global batch (this sampler's rank for None), or the whole global batch (``whole``),
        with the split read when the step is drawn; with ``mark`` the schedule learns the
        step drawn ([Note: switching the split live]). Pure otherwise (read-ahead uses it)."""
        rank = self.rank if rank is None else rank
        first = epoch * len(self)  # global step of this epoch's first batch
        for k, batch in enumerate(self._global_batches(epoch)):
            step = first + k
            if step < first_step:
                continue
            if mark and self.schedule is not None:
                self.schedule.current_step = step
            sizes = self._sizes_at(step)  # read when drawn
            micro = None if self.schedule is None else self.schedule.microbatch_sizes_at(step)
            counts = split_counts(len(batch), sizes)
            start = 0 if whole else sum(counts[:rank])
            rows = batch if whole else batch[start:start + counts[rank]]
            yield StepIndices(rows, epoch=epoch, step=step, start=start, batch_sizes=sizes,
                              microbatch_sizes=micro, whole=whole)

    def local_batches(self) -> list[list[int]]:
        """This rank's per-step index lists (the rows its loader's microbatches hold, in order),
        whether the loader is fed global batches or not."""
        return self.rank_batches(self.rank)

    def __iter__(self) -> Iterator[StepIndices]:
        # skip_batches: a resumed custom loop's accelerator.skip_first_batches (never read)
        first = self.epoch * len(self) + self.skip_batches
        yield from self.iter_steps(self.epoch, first, whole=self.yield_global_batch, mark=True)

    def __len__(self) -> int:
        full, partial = divmod(self.dataset_length, self.global_batch_size)
        return full + (1 if partial and not self.drop_last else 0)


class MicrobatchCollator:
    """DataLoader ``collate_fn`` that turns a rank's batch into a list of collated microbatches.

    ``collate_fn`` (e.g. a ``DataCollatorForLanguageModeling``) is applied to each microbatch of
    ``microbatch_size`` samples separately, so padding is per microbatch: it depends on the plan
    ([Note: padding independent of the plan]). An empty batch (a rank with no samples in the
    last step) gives ``[]``. With a ``schedule`` (and this ``rank``) the microbatch size is the
    one in force at the step the sampler drew last ([Note: switching the split live]).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], microbatch_size: int | None,
                 schedule: SplitSchedule | None = None, rank: int = 0) -> None:
        split_microbatches([], microbatch_size)  # validates microbatch_size
        self.collate_fn = collate_fn
        self.microbatch_size = microbatch_size
        self.schedule, self.rank = schedule, rank

    def __call__(self, samples: list[Any]) -> list[Any]:
        _, size = step_split(samples, None, self.microbatch_size, self.schedule, self.rank)
        return [self.collate_fn(chunk) for chunk in split_microbatches(list(samples), size)]


def packs_without_padding(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is transformers' ``DataCollatorWithFlattening`` returning
    ``position_ids``, or a collator that says it flattens (``padding_free`` True: TRL's
    ``DataCollatorForLanguageModeling``), seen through the Trainer's ``RemoveColumnsCollator``
    wrapper: it packs the samples into one row without padding, each sequence's positions
    restarting at 0, so per-microbatch application is independent of the plan ([Note: padding
    independent of the plan])."""
    from transformers import DataCollatorWithFlattening

    inner = getattr(collate_fn, "data_collator", collate_fn)
    if getattr(inner, "padding_free", False) is True:
        return True
    return isinstance(inner, DataCollatorWithFlattening) and bool(inner.return_position_ids)


class GlobalBatchCollator:
    """DataLoader ``collate_fn`` for a loader fed whole global batches
    (``WeightedBatchSampler(..., yield_global_batch=True)``): collate the global batch once,
    keep this rank's rows, cut them into microbatches ([Note: padding independent of the
    plan]).

    Args:
        collate_fn: the user's collator, called once per step with all samples of the global
            batch (in global-batch order, as one process with the whole batch would call it).
        batch_sizes: per-rank batch sizes b_i (samples), rank order; a partial last global batch
            is split with ``split_counts``, as the sampler splits it.
        rank: this rank.
        microbatch_size: m_i (samples).
        schedule: the sampler's ``SplitSchedule``: the split (b_i) and m_i in force at the step
            the sampler drew last replace ``batch_sizes`` / ``microbatch_size`` ([Note:
            switching the split live]); None: those always.

    Returns (per call) a list of microbatches, each the collated structure (dict,
    ``BatchEncoding``, tuple, ...) with every tensor cut to the microbatch's rows along dim 0;
    ``[]`` for a rank without samples in this step (the collator is not called then).
    Raises ValueError when the collated batch holds a tensor whose first dimension is not the
    number of samples (its rows cannot be told apart): use ``--cephalo_collate microbatch``.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], batch_sizes: Sequence[int],
                 rank: int, microbatch_size: int | None,
                 schedule: SplitSchedule | None = None) -> None:
        split_microbatches([], microbatch_size)  # validates microbatch_size
        self.batch_sizes = _check_batch_sizes(batch_sizes)
        if not 0 <= rank < len(self.batch_sizes):
            raise ValueError(f"rank = {rank} is out of range for {len(self.batch_sizes)} per-rank "
                             f"batch sizes {self.batch_sizes}")
        self.collate_fn, self.rank, self.microbatch_size = collate_fn, rank, microbatch_size
        self.schedule = schedule

    def __call__(self, samples: list[Any]) -> list[Any]:
        sizes, size = step_split(samples, self.batch_sizes, self.microbatch_size, self.schedule,
                                 self.rank)
        counts = split_counts(len(samples), sizes)
        start, count = sum(counts[:self.rank]), counts[self.rank]
        if count == 0:
            return []
        batch = self.collate_fn(list(samples))
        size = count if size is None else size  # None: the rank's rows as one batch
        return [cut_rows(batch, start + lo, start + min(lo + size, count), len(samples))
                for lo in range(0, count, size)]


def step_split(samples: Any, batch_sizes: list[int] | None, microbatch_size: int | None,
               schedule: SplitSchedule | None, rank: int) -> tuple[list[int] | None, int | None]:
    """(b_i per rank, this rank's m_i) for a step's samples: those recorded with the step's
    indices when it was drawn (``samples.indices``, a ``StepIndices``: the loader's read-ahead
    path), else the schedule's at the step the sampler drew last, else the fixed ones ([Note:
    switching the split live]). ``microbatch_size`` None stays None: one batch of the rank's
    rows, whatever m_i is in force."""
    indices = getattr(samples, "indices", None)
    if isinstance(indices, StepIndices):
        micro = microbatch_size if indices.microbatch_sizes is None or microbatch_size is None \
            else max(indices.microbatch_sizes[rank], 1)
        return indices.batch_sizes, micro
    if schedule is not None and schedule.current_step is not None:
        step = schedule.current_step
        micro = None if microbatch_size is None else \
            max(schedule.microbatch_sizes_at(step)[rank], 1)
        return schedule.batch_sizes_at(step), micro
    return batch_sizes, microbatch_size


def cut_rows(batch: Any, start: int, stop: int, num_samples: int, *, strict: bool = True) -> Any:
    """``batch`` with every tensor cut to rows ``[start, stop)`` (dim 0), and every per-row
    field too: a list / tuple of ``num_samples`` non-tensor items under a mapping key (ids,
    texts, sources a collator passes through) is cut to the same rows, so each rank and
    microbatch holds its own rows' metadata. The container types (dict, ``BatchEncoding``,
    list, tuple, namedtuple) and other non-tensor leaves are kept.

    Raises ValueError (``strict``) for a tensor whose first dimension is not ``num_samples``;
    not ``strict``: a 0-d tensor is kept and other tensors are cut as they are.
    """
    def cut_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != num_samples:
            if not strict:
                return tensor if tensor.dim() == 0 else tensor[start:stop]
            raise ValueError(f"the data collator returned a tensor of shape {tuple(tensor.shape)} "
                             f"for {num_samples} samples: its first dimension is not the "
                             "samples, so the global batch cannot be split into ranks and "
                             "microbatches after collating it; make the collator return one "
                             "row per sample, or collate per microbatch with "
                             "--cephalo_collate microbatch (padding then depends on the plan)")
        return tensor[start:stop]

    def cut(value: Any, field: bool) -> Any:
        if torch.is_tensor(value):
            return cut_tensor(value)
        if isinstance(value, Mapping):
            return type(value)({k: cut(v, True) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            named = hasattr(value, "_fields")
            if field and not named and len(value) == num_samples \
                    and not any(torch.is_tensor(v) for v in value):
                return value[start:stop]  # one entry per sample
            items = [cut(v, False) for v in value]
            return type(value)(*items) if named else type(value)(items)
        return value

    return cut(batch, False)


def split_rows(batch: Mapping[str, Any], size: int) -> list[Any]:
    """``batch`` (a dict whose tensors hold R rows: one rank's rows of a step) cut into
    microbatches of at most ``size`` rows (R = 0: none), by ``cut_rows`` (per-row fields cut
    too).

    Raises ValueError: a tensor whose first dimension is not R (its rows cannot be told
    apart: e.g. a padding-free packing collator's single row)."""
    rows = next((v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0), 0)
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() == 0 or value.shape[0] != rows):
            raise ValueError(f"the batch's {key!r} has shape {tuple(value.shape)} but the batch "
                             f"holds {rows} rows: every tensor's first dimension must be the "
                             "samples, so that this rank's rows can be cut into microbatches")
    return [cut_rows(batch, lo, min(lo + size, rows), rows)
            for lo in range(0, rows, max(size, 1))]

