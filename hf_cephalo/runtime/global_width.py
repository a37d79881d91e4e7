"""Each rank collates only its own rows, padded to the width of the whole global batch.

A collator that pads to the longest row it is given (transformers' ``DataCollatorWithPadding``,
``DataCollatorForLanguageModeling``, ``DataCollatorForSeq2Seq``, TRL's collators, a plain
pad-to-longest function; right or left, with ``pad_to_multiple_of``) gives a row the same
tensors in any batch that has the same width. ``GlobalWidthCollator`` gets there without
reading the whole batch: see the note.

[Note: the global width]
The width a row asks for is measured on it alone: the trailing shape of ``collate_fn([row])``,
per output tensor and dimension (an axis: ``"input_ids[1]"``); a batch's width on an axis is
the largest of its rows' (``check_global_width`` verifies this, and everything below, for the
collator and data at hand on the first step). Per step, in the main process, every rank
all-gathers for each axis its widest row (width, position in the global batch, dataset index);
ranks with no rows send none. Each rank then collates its rows plus, for every axis where its
own rows are narrower than the global batch, the global batch's widest row (lowest position on
ties), read again under that row's seed ([Note: randomness tied to the sample] in
``sample_reads.py``): at most one extra row per distinct widest row, usually zero or one. It
drops the extra rows, checks that every axis has the global width, and cuts its microbatches.
The rows equal those of the whole global batch collated at once. A second one-integer exchange
makes a failure anywhere in the step fail every rank ([Note: a rank that fails while loading]
in ``exchange.py``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from hf_cephalo.runtime.exchange import StepExchange
from hf_cephalo.runtime.sample_reads import Rows, SeededReads, preserved_rng
from hf_cephalo.runtime.sampler import cut_rows, split_counts, split_microbatches

__all__ = ["GlobalWidthCollator", "WidthMeasure", "check_global_width", "row_widths",
           "collator_name", "MAX_AXES"]

MAX_AXES = 32
"""Output axes (tensor, dimension >= 1) one step's exchange carries; a collator with more keeps
the whole-batch collation (``check_global_width`` says so)."""

_HEADER = 2  # status, number of axes
_SLOT = 4  # axis id, width, position in the global batch, dataset index


def collator_name(collate_fn: Any) -> str:
    """The user's collator's name (seen through the Trainer's ``RemoveColumnsCollator``)."""
    inner = getattr(collate_fn, "data_collator", collate_fn)
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _tensor_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key in obj:
            yield from _tensor_leaves(obj[key], f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensor_leaves(value, f"{path}[{i}]")


def row_widths(batch: Any, num_rows: int, who: str) -> dict[str, int]:
    """Axis name -> width of a collated batch of ``num_rows`` rows (every tensor leaf, every
    dimension after the first). Raises ValueError naming ``who`` (the collator) for a tensor
    whose first dimension is not the rows."""
    widths = {}
    for path, tensor in _tensor_leaves(batch):
        if tensor.dim() == 0 or tensor.shape[0] != num_rows:
            raise ValueError(f"data collator {who} returned {path!r} of shape "
                             f"{tuple(tensor.shape)} for {num_rows} samples: its first "
                             "dimension is not the samples, so its rows cannot be collated per "
                             "rank")
        for dim in range(1, tensor.dim()):
            widths[f"{path}[{dim}]"] = int(tensor.shape[dim])
    return widths


def _axis_id(name: str) -> int:
    return zlib.crc32(name.encode()) % (2**31 - 1) + 1  # > 0: 0 marks an empty slot


class WidthMeasure:
    """Worker-side step of the global width: each row's widths, ``collate_fn([row])``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn, self.name = collate_fn, collator_name(collate_fn)

    def __call__(self, rows: Rows) -> Rows:
        rows.widths = [row_widths(self.collate_fn([s]), 1, self.name) for s in rows]
        return rows


class _Widest(NamedTuple):
    width: int
    position: int  # in the global batch
    index: int  # in the dataset


def _widest(widths: Sequence[Mapping[str, int]], start: int,
            indices: Sequence[int]) -> dict[str, _Widest]:
    """Per axis, the widest of these rows (lowest position on ties)."""
    best: dict[str, _Widest] = {}
    for j, row in enumerate(widths):
        for name, width in row.items():
            if name not in best or width > best[name].width:
                best[name] = _Widest(width, start + j, indices[j])
    return best


def _extra_rows(mine: Mapping[str, _Widest], target: Mapping[Any, _Widest]) -> list[_Widest]:
    """The global batch's widest rows where these rows are narrower (one per position)."""
    need = {}
    for key, widest in target.items():
        if key not in mine or mine[key].width < widest.width:
            need.setdefault(widest.position, widest)
    return [need[p] for p in sorted(need)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _probe_subsets(num_rows: int, batch_sizes: Sequence[int]) -> list[range]:
    """The rank slices of the step's split, the two halves, the first and the last row."""
    counts = split_counts(num_rows, batch_sizes)
    bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]
    subsets = [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    half = num_rows // 2
    subsets += [range(0, half), range(half, num_rows), range(0, 1), range(num_rows - 1, num_rows)]
    return [s for s in dict.fromkeys(subsets) if len(s)]


def _private_copy(collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """A deep copy of ``collate_fn`` (a generator it owns included), or ``collate_fn`` itself
    where it cannot be copied (a closure over such state is then advanced by the check)."""
    import copy
    try:
        return copy.deepcopy(collate_fn)
    except Exception:  # noqa: BLE001 - an uncopyable collator: checked as it is
        return collate_fn


def check_global_width(collate_fn: Callable[[list[Any]], Any], samples: Sequence[Any],
                       batch_sizes: Sequence[int]) -> str | None:
    """Whether collating rows plus the global batch's widest rows reproduces the whole-batch
    collation of ``samples`` (one global batch) exactly, for the rank slices of
    ``batch_sizes`` and a few other subsets ([Note: the global width]). Returns None if so,
    else the reason. The generators are given back their states, and the check calls a copy
    of the collator, so a random collator is not advanced by the check, neither the global
    generators nor its own (``DataCollatorForLanguageModeling(seed=...)`` keeps one): its
    draws stay those of one process calling it once per global batch."""
    name = collator_name(collate_fn)
    try:
        collate_fn = _private_copy(collate_fn)
        with preserved_rng():
            full = collate_fn(list(samples))
            full_widths = row_widths(full, len(samples), name)
            widths = [row_widths(collate_fn([s]), 1, name) for s in samples]
            widest = _widest(widths, 0, range(len(samples)))
            if len(widest) > MAX_AXES:
                return f"its output has {len(widest)} padded axes (more than {MAX_AXES})"
            if {k: w.width for k, w in widest.items()} != full_widths:
                return (f"the whole batch's widths {full_widths} are not the widest rows' "
                        f"{ {k: w.width for k, w in widest.items()} }")
            for subset in _probe_subsets(len(samples), batch_sizes):
                mine = _widest([widths[j] for j in subset], subset.start, subset)
                extra = [w.position for w in _extra_rows(mine, widest)]
                part = collate_fn([samples[j] for j in subset] + [samples[p] for p in extra])
                got = cut_rows(part, 0, len(subset), len(subset) + len(extra))
                if not _same(got, cut_rows(full, subset.start, subset.stop, len(samples))):
                    return (f"rows {subset.start}..{subset.stop - 1} collated with the widest "
                            "rows differ from the same rows of the whole batch (the collator "
                            "does more than pad each row to the batch's width, e.g. draws "
                            "random masks)")
    except Exception as e:  # noqa: BLE001 - any failure means: keep the whole-batch collation
        return f"{type(e).__name__}: {e}"
    return None


class GlobalWidthCollator:
    """The main-process collate of a per-rank loader: this rank's ``Rows`` (widths measured
    by ``WidthMeasure``) -> its microbatches, padded as the whole global batch ([Note: the
    global width]). Collective: call it on every rank of ``exchange`` at every step.

    Args:
        collate_fn: the user's collator. reads: the seeded dataset (the extra rows).
        exchange: the ranks that split the global batch. rank: this rank's index in the split.
        microbatch_size: m_i when the step carries none (no live schedule).
        description: what the loader loads, for error messages ("training").
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], reads: SeededReads,
                 exchange: StepExchange, rank: int, microbatch_size: int | None,
                 description: str = "data") -> None:
        self.collate_fn, self.reads, self.exchange = collate_fn, reads, exchange
        self.rank, self.microbatch_size, self.description = rank, microbatch_size, description
        self.name = collator_name(collate_fn)
        self.extra_reads = 0  # rows read for their width only, this loader's lifetime

    def __call__(self, rows: Rows) -> list[Any]:
        indices = rows.indices
        what = f"{self.description}, step {indices.step} (epoch {indices.epoch})"
        error, mine = rows.error, {}
        if error is None:
            try:
                mine = _widest(rows.widths or [], indices.start, indices)
                if len(mine) > MAX_AXES:
                    raise ValueError(f"data collator {self.name} returned {len(mine)} padded "
                                     f"axes (at most {MAX_AXES} per step)")
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = e
        table = self.exchange.gather(self._report(mine, error))
        self.exchange.fail_together([row[0] for row in table], error, what)
        microbatches = []
        try:
            microbatches = self._collate(rows, mine, self._merge(table))
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
        self.exchange.agree(error, what)
        return microbatches

    def _report(self, mine: Mapping[str, _Widest], error: BaseException | None) -> list[int]:
        vector = [0] * (_HEADER + _SLOT * MAX_AXES)
        vector[0] = 0 if error is None else 1
        if error is None:
            vector[1] = len(mine)
            for slot, (name, w) in enumerate(sorted(mine.items())):
                at = _HEADER + _SLOT * slot
                vector[at:at + _SLOT] = [_axis_id(name), w.width, w.position, w.index]
        return vector

    @staticmethod
    def _merge(table: Sequence[Sequence[int]]) -> dict[int, _Widest]:
        """Axis id -> the global batch's widest row (lowest position on ties)."""
        best: dict[int, _Widest] = {}
        for row in table:
            for slot in range(row[1]):
                axis, width, position, index = row[_HEADER + _SLOT * slot:][:_SLOT]
                old = best.get(axis)
                if old is None or (width, -position) > (old.width, -old.position):
                    best[axis] = _Widest(width, position, index)
        return best

    def _collate(self, rows: Rows, mine: Mapping[str, _Widest],
                 target: Mapping[int, _Widest]) -> list[Any]:
        """Rows + the global batch's widest rows where these are narrower -> collate, check
        every axis has the global width, drop the extra rows, cut the microbatches."""
        if not rows:
            return []
        indices = rows.indices
        extras = self._extra_samples(indices.epoch, {_axis_id(k): w for k, w in mine.items()},
                                     target)
        total = len(rows) + len(extras)
        batch = self.collate_fn(list(rows) + extras)
        for name, width in row_widths(batch, total, self.name).items():
            want = target.get(_axis_id(name))
            if want is not None and width != want.width:
                raise ValueError(
                    f"data collator {self.name} returned {name} of width {width} on rank "
                    f"{self.rank}, but the global batch's width is {want.width} (its widest "
                    "row alone): the collator's width is not the widest row's, so its rows "
                    "cannot be collated per rank; use --cephalo_collate global_batch")
        size = self.microbatch_size if indices.microbatch_sizes is None or \
            self.microbatch_size is None else max(indices.microbatch_sizes[self.rank], 1)
        return [cut_rows(batch, chunk[0], chunk[-1] + 1, total)
                for chunk in split_microbatches(range(len(rows)), size)]

    def _extra_samples(self, epoch: int, mine: Mapping[int, _Widest],
                       target: Mapping[int, _Widest]) -> list[Any]:
        """The widest rows these rows lack, read again under their seed; each must have the
        width its own rank reported on the axes it is the widest of."""
        extras = []
        for widest in _extra_rows(mine, target):
            sample = self.reads.read(widest.index, epoch)
            for name, width in row_widths(self.collate_fn([sample]), 1, self.name).items():
                want = target.get(_axis_id(name))
                if want is not None and want.position == widest.position and width != want.width:
                    raise ValueError(
                        f"dataset item {widest.index} (epoch {epoch}), collated alone by "
                        f"{self.name}, gives {name} width {width} on rank {self.rank} but "
                        f"{want.width} on the rank whose row it is: a dataset item must not "
                        "depend on the rank or worker that reads it (draw random transforms "
                        "from torch / numpy / random, which are seeded per sample, not from a "
                        "generator the dataset owns)")
            extras.append(sample)
        self.extra_reads += len(extras)
        return extras
