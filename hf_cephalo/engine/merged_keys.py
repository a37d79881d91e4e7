"""Checkpoint tensors that transformers merges into one parameter (MoE experts), read and written
range by range.

[Note: merged expert tensors]
transformers 5 fuses the experts of a MoE layer into one parameter (``experts.gate_up_proj``
(E, 2I, H), ``experts.down_proj`` (E, H, I)) while checkpoints, ``save_pretrained``'s
included, store one tensor per expert (``experts.<e>.gate_proj.weight`` (I, H), ...). Its
``WeightConverter`` stacks each source pattern's tensors in ``dot_natural_key`` order
(``MergeModulelist(dim=0)``) and, for several patterns, concatenates the stacks in the
converter's pattern order (``Concatenate(dim=d)``, d >= 1). Every element of the parameter is
then one element of one stored tensor, so a flat range of the parameter is a list of
contiguous ranges of stored tensors (``merged_reads``): a rank reads only its shard's elements,
never a whole expert it does not hold. Saving inverts it with views: stored tensor (k, e) is
``P[e].narrow(d - 1, offset_k, size_k)`` (``MergedSlice``), the names and shapes taken from
transformers' own ``revert_weight_conversion`` run on meta tensors. Op chains other than these
two are refused (NotImplementedError naming them) before any tensor is read.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Sequence

__all__ = ["MergedKeys", "MergedSlice", "merge_spec", "merged_shape", "merged_reads",
           "stored_slices", "LOAD_FIX", "SAVE_FIX"]


class MergedKeys(NamedTuple):
    """The stored tensors one parameter is merged from.

    keys: per source pattern (the converter's order), the stored keys in stacking order
        (``dot_natural_key``): ``keys[k][e]`` is entry e of pattern k.
    cat_dim: the axis of ONE stacked entry along which the patterns are concatenated
        (the converter's ``Concatenate`` dim - 1); None for one pattern (stacking only).
    """

    keys: tuple[tuple[str, ...], ...]
    cat_dim: int | None


class MergedSlice(NamedTuple):
    """Where a stored tensor lies in its merged parameter ``P``: ``P[entry].narrow(dim, start,
    length)`` (``dim`` None: the whole ``P[entry]``)."""

    entry: int
    dim: int | None
    start: int
    length: int


LOAD_FIX = ("load the model with from_pretrained on the CPU and pass it to the engine, or "
            "re-save the checkpoint in the model's own layout")
SAVE_FIX = ("gather the model on every rank instead (trainer.unshard_model(), then "
            "model.save_pretrained)")


def merge_spec(converter, fix: str = LOAD_FIX) -> int | None:
    """The ``cat_dim`` a transformers ``WeightConverter`` gives ``MergedKeys``.

    Raises NotImplementedError (ending in ``fix``: what to do instead) for any op chain other
    than ``[MergeModulelist(dim=0)]`` and ``[MergeModulelist(dim=0), Concatenate(dim=d >= 1)]``
    (the MoE expert layouts): others (fused qkv chunks, transposes, ...) are not streamed range
    by range.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1:
            return None
        if (len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1
                and ops[1].num_shards_attribute is None):
            return ops[1].dim - 1
    raise NotImplementedError(
        f"transformers converts checkpoint tensors {converter.source_patterns} into "
        f"{converter.target_patterns} with {ops}; hf_cephalo reads and writes stacked and "
        "concatenated experts (MergeModulelist(dim=0), then Concatenate(dim>=1)) range by "
        f"range, not this conversion: {fix}")


def merged_shape(merged: MergedKeys, shapes: Sequence[Sequence[tuple[int, ...]]]
                 ) -> tuple[int, ...] | None:
    """The parameter shape transformers builds from stored tensors of ``shapes[k][e]`` (every
    entry of a pattern the same shape; the patterns equal off ``cat_dim``), or None when they
    cannot be merged."""
    firsts = [s[0] for s in shapes]
    if any(len(s) == 0 or any(tuple(x) != tuple(s[0]) for x in s) for s in shapes):
        return None
    counts = {len(s) for s in shapes}
    if len(counts) != 1:
        return None
    if merged.cat_dim is None:
        return (len(shapes[0]), *firsts[0]) if len(firsts) == 1 else None
    d = merged.cat_dim
    if any(len(f) <= d or tuple(f[:d]) + tuple(f[d + 1:]) != tuple(firsts[0][:d]) +
           tuple(firsts[0][d + 1:]) for f in firsts):
        return None
    entry = list(firsts[0])
    entry[d] = sum(f[d] for f in firsts)
    return (len(shapes[0]), *entry)


def _row_lengths(merged: MergedKeys, shape: tuple[int, ...],
                 sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(rows per entry, each pattern's contiguous run per row) of a parameter of ``shape``
    merged from patterns of ``sizes`` along ``cat_dim``."""
    entry = shape[1:]
    if merged.cat_dim is None:
        return 1, [math.prod(entry)]
    d = merged.cat_dim
    inner = math.prod(entry[d + 1:])
    return math.prod(entry[:d]), [n * inner for n in sizes]


def merged_reads(merged: MergedKeys, shape: tuple[int, ...], sizes: Sequence[int],
                 lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """The stored ranges that make elements ``[lo, hi)`` of the flattened parameter.

    Args:
        shape: the parameter's shape (E, ...); sizes: each pattern's size along ``cat_dim``
            (ignored without one).
    Yields:
        (stored key, start, stop, offset): elements ``[start, stop)`` of that stored tensor
        flattened are elements ``[lo + offset, lo + offset + stop - start)`` of the parameter,
        in order and covering ``[lo, hi)`` exactly.
    """
    outer, runs = _row_lengths(merged, shape, sizes)
    row_len = sum(runs)
    row = lo // row_len if row_len else 0
    while row_len and row * row_len < hi:
        entry, o = divmod(row, outer)
        base = row * row_len
        for k, n in enumerate(runs):
            s, t = max(lo, base), min(hi, base + n)
            if s < t:
                yield merged.keys[k][entry], o * n + s - base, o * n + t - base, s - lo
            base += n
        row += 1


def stored_slices(merged: MergedKeys, sizes: Sequence[int]
                  ) -> dict[str, tuple[int, MergedSlice]]:
    """Stored key -> (its pattern's index, its ``MergedSlice`` of the parameter)."""
    out = {}
    for k, keys in enumerate(merged.keys):
        start = sum(sizes[:k])
        for e, key in enumerate(keys):
            out[key] = (k, MergedSlice(e, merged.cat_dim,
                                       start if merged.cat_dim is not None else 0,
                                       sizes[k] if merged.cat_dim is not None else 0))
    return out
