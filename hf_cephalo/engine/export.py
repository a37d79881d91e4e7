"""Streamed Hugging Face save: sharded safetensors written one unit at a time.

``save_pretrained_streamed`` (collective) and ``export_hf`` (offline, from a sharded checkpoint)
write what ``save_pretrained(out_dir, max_shard_size=...)`` writes for the same weights.

[Note: streamed save]
The file split is planned on META tensors (shapes and dtypes from the shard metadata, after
``save_pretrained``'s own key edits) by ``split_torch_state_dict_into_shards``, so it equals
``save_pretrained``'s before any tensor is gathered. Files are then written in order, the units
each needs gathered one at a time, so rank 0 holds at most ONE output file's tensors plus ONE
gathered unit (safetensors writes a file whole). Each file is written aside and renamed into
place (shards, index, configs; stale weight files removed last); a rank 0 that fails to write
still joins every remaining gather, and every rank raises at the end (``errors_on_every_rank``).
Steps in full: docs/checkpoints.md, "Streamed save".
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch

from hf_cephalo.file_modes import apply_default_mode
from hf_cephalo.units import DEFAULT_MAX_SHARD_SIZE

from .checkpoint_files import errors_on_every_rank, fsync_file
from .merged_keys import (SAVE_FIX, MergedKeys, MergedSlice, merge_spec, merged_shape,
                          stored_slices)

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "WEIGHTS_NAME", "INDEX_NAME", "PROCESSOR_FILES",
           "SavedTensor", "HFFilePlan", "SaveResult", "parse_max_shard_size", "plan_hf_files",
           "streamed_save_problem",
           "engine_sources", "write_hf_files", "write_hf_configs", "remove_stale_weights",
           "copy_processor_files", "save_pretrained_streamed"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# tokenizer / processor files copied next to an export when the checkpoint has them
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "processor_config.json",
                   "image_processor_config.json", "video_preprocessor_config.json",
                   "feature_extractor_config.json", "spiece.model", "sentencepiece.bpe.model")


class SavedTensor(NamedTuple):
    """Where one saved tensor comes from.

    unit: index of the unit holding it (``shard_metadata()`` / layout order), None for a buffer;
    name: its key in that unit's ``FullUnit.tensors`` (or the buffer key); shape, dtype: as saved;
    select: for one expert's tensor split from a merged parameter on save, its place in that
    parameter ([Note: merged expert tensors] in ``merged_keys.py``); None: the whole tensor.
    """

    unit: int | None
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    select: MergedSlice | None = None


class HFFilePlan(NamedTuple):
    """The planned output: ``files`` (file name -> saved keys, in writing order), ``sources``
    (saved key -> ``SavedTensor``), ``unit_order`` (units to gather, in order, repeats allowed),
    ``index`` (the index JSON dict, None for a single file)."""

    files: dict[str, list[str]]
    sources: dict[str, SavedTensor]
    unit_order: list[int]
    index: dict[str, Any] | None


class SaveResult(NamedTuple):
    """What a streamed save wrote: ``files`` (weight file names), ``total_size_bytes`` (tensor
    bytes, as the index's ``total_size``), ``peak_file_bytes`` (largest file's tensor bytes)."""

    files: list[str]
    total_size_bytes: int
    peak_file_bytes: int


def parse_max_shard_size(max_shard_size: int | str) -> int:
    """``max_shard_size`` as bytes: an int > 0 or a string like ``"5GB"`` / ``"500MB"``
    (units TB, GB, MB, KB, powers of 1000, as ``save_pretrained``). Raises ValueError."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        raise ValueError(f"max_shard_size = {max_shard_size!r}: give bytes (int > 0) or a string "
                         "such as '5GB'")
    try:
        size = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) \
            else int(max_shard_size)
    except ValueError as e:
        raise ValueError(f"max_shard_size = {max_shard_size!r}: {e}") from None
    if size <= 0:
        raise ValueError(f"max_shard_size = {max_shard_size!r}: must be > 0 bytes")
    return size


# ---- planning (pure: no process group, no tensor data) -------------------------------------
class _AliasProbe:
    """Stand-in model for ``remove_tied_weights_from_state_dict`` over meta tensors: module tree
    (for ``_tied_weights_keys``) of the real model, tensor identity from the shard metadata."""

    def __init__(self, model: torch.nn.Module, identity: Mapping[str, Any]):
        self._model, self._identity = model, identity

    def named_modules(self, *args, **kwargs):
        return self._model.named_modules(*args, **kwargs)

    def get_parameter_or_buffer(self, name: str):
        return self._identity[name]


def plan_hf_files(model: torch.nn.Module, sources: Mapping[str, SavedTensor], *,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  total_parameters: int) -> HFFilePlan:
    """Plan the files ``save_pretrained`` would write (see [Note: streamed save]).

    Args:
        model: the model (any device, placeholders or meta parameters are fine: only its
            module tree, ``_tied_weights_keys``, ``_keys_to_ignore_on_save`` and weight
            conversions are read).
        sources: every ``model.state_dict()`` key in that order (tied aliases included; aliases
            of one tensor share ``unit`` and ``name``).
        total_parameters: distinct parameter elements (the index's ``total_parameters``).
    Raises:
        ValueError: a bad ``max_shard_size``.
        NotImplementedError: the model's weight conversions split or combine tensors other
            than stacked experts (``merged_keys.merge_spec``).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    limit = parse_max_shard_size(max_shard_size)
    metas = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in sources.items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        metas.pop(key, None)
    saved: dict[str, SavedTensor] = {}
    storages: dict[str, tuple[tuple, int]] = {}
    for new, old in _apply_hf_key_edits(model, metas, sources).items():
        if isinstance(old, _Split):  # one expert split off a merged parameter
            shape = _slice_shape(sources[old.key].shape, old.select)
            saved[new] = sources[old.key]._replace(shape=shape, select=old.select)
            storages[new] = (old.storage, old.storage_numel)
        else:
            saved[new] = sources[old]
    split = _split_like_save_pretrained(saved, storages, limit)
    files = {name: list(keys) for name, keys in split.filename_to_tensors.items()}
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": int(total_parameters), **split.metadata},
                 "weight_map": dict(split.tensor_to_filename)}
    return HFFilePlan(files, saved, _unit_order(files, saved), index)


def _split_like_save_pretrained(saved: Mapping[str, SavedTensor],
                                storages: Mapping[str, tuple[tuple, int]], limit: int):
    """``split_torch_state_dict_into_shards`` over meta tensors of ``saved``, with the storage
    sharing ``save_pretrained``'s tensors have: the experts split off one merged parameter
    share one storage (``storages``: key -> (storage id, its element count)), so stock puts
    them into the file of the first and counts the storage once ([Note: merged expert
    tensors] in ``merged_keys.py``)."""
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    metas = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in saved.items()}
    by_id = {id(t): k for k, t in metas.items()}

    def storage_id(t: torch.Tensor):
        return storages.get(by_id[id(t)], (None,))[0]

    def storage_size(t: torch.Tensor) -> int:
        key = by_id[id(t)]
        numel = storages[key][1] if key in storages else t.numel()
        return numel * t.element_size()

    return split_state_dict_into_shards_factory(
        metas, get_storage_size=storage_size, get_storage_id=storage_id,
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=limit)


class _Split(NamedTuple):
    """A saved tensor split off merged parameter ``key`` at ``select``; ``storage``, of
    ``storage_numel`` elements: the storage it shares in ``save_pretrained``."""

    key: str
    select: MergedSlice
    storage: tuple
    storage_numel: int


def _apply_hf_key_edits(model, metas: dict[str, torch.Tensor],
                        sources: Mapping[str, SavedTensor]) -> dict[str, Any]:
    """Drop tied aliases and apply transformers' save conversions as ``save_pretrained`` does:
    {saved key: state-dict key, or (state-dict key, ``MergedSlice``) for one expert split off a
    merged parameter}, in saving order."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):  # plain module: keep the first name of a tensor
        seen: set[tuple] = set()
        out = {}
        for key in metas:
            ident = (sources[key].unit, sources[key].name)
            if ident not in seen:
                seen.add(ident)
                out[key] = key
        return out
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    tokens: dict[tuple, object] = {}  # one object per distinct tensor: the probe compares ids
    identity = {k: tokens.setdefault((s.unit, s.name), object()) for k, s in sources.items()}
    kept = remove_tied_weights_from_state_dict(dict(metas), _AliasProbe(model, identity))
    by_id = {id(t): k for k, t in kept.items()}
    reverted = revert_weight_conversion(model, dict(kept))
    split = {k: t for k, t in reverted.items() if id(t) not in by_id}
    selects = _split_sources(model, split, kept) if split else {}
    out = {}
    for new, t in reverted.items():
        out[new] = by_id[id(t)] if new not in selects else selects[new]
    return out


def _slice_shape(shape: tuple[int, ...], sl: MergedSlice) -> tuple[int, ...]:
    entry = list(shape[1:])
    if sl.dim is not None:
        entry[sl.dim] = sl.length
    return tuple(entry)


def select_saved(tensor: torch.Tensor, sl: MergedSlice | None) -> torch.Tensor:
    """The saved tensor ``sl`` picks from ``tensor`` (a view; ``tensor`` itself for None)."""
    if sl is None:
        return tensor
    entry = tensor[sl.entry]
    return entry if sl.dim is None else entry.narrow(sl.dim, sl.start, sl.length)


def _stock_storage(key: str, shape: tuple[int, ...], merged: MergedKeys,
                   pattern: int) -> tuple[tuple, int]:
    """(storage id, element count) in ``save_pretrained`` of a tensor of source pattern
    ``pattern`` split off parameter ``key``: its reverse
    ops are ``SplitModulelist`` views of the parameter, after ``Chunk`` (one ``.contiguous()``
    copy per pattern, unless the chunk is contiguous already) when the patterns were
    concatenated."""
    if merged.cat_dim is None:
        return (key,), math.prod(shape)
    dim = merged.cat_dim + 1
    chunk = torch.empty(shape, device="meta").chunk(len(merged.keys), dim)[0]
    if chunk.is_contiguous():
        return (key,), math.prod(shape)
    return (key, pattern), chunk.numel()


def _save_conversions(model) -> list:
    """The forward transforms ``revert_weight_conversion`` inverts on save (its choice)."""
    import copy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return copy.deepcopy(list(conversions))


def _split_sources(model, split: Mapping[str, torch.Tensor],
                   kept: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, MergedSlice]]:
    """Each tensor ``revert_weight_conversion`` split off a merged parameter (meta, by saved
    key) -> (the parameter's state-dict key, its ``MergedSlice``): the saved keys are mapped
    forward by transformers' own loading renames, as ``checkpoint_keys`` maps a checkpoint.
    Raises NotImplementedError for a split that is not stacked experts."""
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)

    conversions = _save_conversions(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    stacks: dict[str, dict[str, list[str]]] = {}
    for key in sorted(split, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters)
        if pattern is None or renamed not in kept:
            raise NotImplementedError(
                f"{type(model).__name__}: transformers' save conversion writes {key!r}, which "
                "its loading conversion does not map back onto one parameter; the streamed "
                f"save writes renamed and per-expert tensors only: {SAVE_FIX}")
        stacks.setdefault(renamed, {}).setdefault(pattern, []).append(key)
    out = {}
    for renamed, per_pattern in stacks.items():
        converter = by_pattern[next(iter(per_pattern))]
        merged = MergedKeys(tuple(tuple(per_pattern.get(p, ())) for p in
                                  converter.source_patterns), merge_spec(converter, SAVE_FIX))
        shapes = [[tuple(split[k].shape) for k in keys] for keys in merged.keys]
        if merged_shape(merged, shapes) != tuple(kept[renamed].shape):
            raise NotImplementedError(
                f"{type(model).__name__}: transformers saves {renamed} "
                f"{tuple(kept[renamed].shape)} as {sum(map(len, shapes))} tensors that do not "
                f"stack back into it; {SAVE_FIX}")
        sizes = [s[0][merged.cat_dim] if merged.cat_dim is not None else 0 for s in shapes]
        shape = tuple(kept[renamed].shape)
        for k, (pattern, sl) in stored_slices(merged, sizes).items():
            out[k] = _Split(renamed, sl, *_stock_storage(renamed, shape, merged, pattern))
    return out


def streamed_save_problem(model: torch.nn.Module) -> str | None:
    """Why the streamed save (``save_model``, ``hf-cephalo export``) would refuse ``model``:
    its ``save_pretrained`` layout converts tensors other than stacked experts
    (``merged_keys.merge_spec``); None when it can be written. Reads names and shapes only
    (meta, placeholder or real parameters)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    state = model.state_dict(keep_vars=True)
    sources = {k: SavedTensor(0, str(id(v)), tuple(v.shape), v.dtype) for k, v in state.items()}
    metas = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in sources.items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        metas.pop(key, None)
    try:
        _apply_hf_key_edits(model, metas, sources)
    except NotImplementedError as exc:
        return str(exc)
    return None


def _unit_order(files: Mapping[str, list[str]], sources: Mapping[str, SavedTensor]) -> list[int]:
    """Units in the order the files' keys need them, consecutive repeats merged."""
    order: list[int] = []
    for keys in files.values():
        for key in keys:
            unit = sources[key].unit
            if unit is not None and (not order or order[-1] != unit):
                order.append(unit)
    return order


# ---- writing (rank 0) -------------------------------------------------------------------------
def _write_aside(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a hidden sibling, fsync, rename over ``path`` (atomic per file) with
    the mode ``open()`` would give it (safetensors writes 0o600: [Note: file modes])."""
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    write(tmp)
    apply_default_mode(tmp)
    fsync_file(tmp)
    os.replace(tmp, path)


def write_hf_files(out_dir: str, plan: HFFilePlan, units: Iterable, *,
                   buffers: Mapping[str, torch.Tensor]) -> SaveResult:
    """Write the planned weight files (and the index) from a stream of units.

    ``units`` yields ``FullUnit``-like objects (``.index``, ``.tensors``) in
    ``plan.unit_order``; ``buffers``: buffer key -> tensor. Each file is written once all its
    tensors are copied to CPU; the previous unit is dropped before the next is drawn, so at
    most one file's copies and one unit are alive ([Note: streamed save]).

    Raises:
        OSError: a write failed. RuntimeError: the stream does not follow ``plan.unit_order``.
    """
    from safetensors.torch import save_file

    stream: Iterator = iter(units)
    current = None
    total = peak = 0
    for name, keys in plan.files.items():
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            src = plan.sources[key]
            if src.unit is None:
                tensors[key] = buffers[src.name].detach().to("cpu", copy=True).contiguous()
                continue
            while current is None or current.index != src.unit:
                current = None  # drop the previous unit before gathering the next
                current = next(stream, None)
                if current is None:
                    raise RuntimeError(f"unit stream ended before unit {src.unit} ({key})")
            tensors[key] = select_saved(current.tensors[src.name], src.select).detach().to(
                "cpu", copy=True).contiguous()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total, peak = total + size, max(peak, size)
        _write_aside(os.path.join(out_dir, name),
                     lambda tmp, t=tensors: save_file(t, tmp, metadata={"format": "pt"}))
        del tensors
    current = None
    if next(stream, None) is not None:
        raise RuntimeError("unit stream yielded more units than the plan needs")
    if plan.index is not None:
        _write_aside(os.path.join(out_dir, INDEX_NAME), lambda tmp: _write_json(
            tmp, plan.index, sort_keys=True))
    return SaveResult(list(plan.files), total, peak)


def _write_json(path: str, data: dict, *, sort_keys: bool) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def write_hf_configs(out_dir: str, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``config.json`` (with ``dtype`` and ``architectures`` as ``save_pretrained`` records
    them) and, for generative models, ``generation_config.json``; nothing for a plain module."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    staging = os.path.join(out_dir, ".tmp-configs")  # the library's own writers, then renamed
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    model.config.save_pretrained(staging)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    for name in sorted(os.listdir(staging)):
        fsync_file(os.path.join(staging, name))
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    os.rmdir(staging)


def remove_stale_weights(out_dir: str, written: Iterable[str]) -> list[str]:
    """Remove weight files of an earlier save that this save did not write (``model.safetensors``,
    ``model-*-of-*.safetensors``, the index); returns their names."""
    written = set(written)
    if len(written) > 1:
        written.add(INDEX_NAME)
    stale = [n for n in os.listdir(out_dir) if n not in written and
             (n in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.fullmatch(n))]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    return stale


def copy_processor_files(src_dir: str, out_dir: str) -> list[str]:
    """Copy tokenizer / processor files (``PROCESSOR_FILES``) found in ``src_dir`` into
    ``out_dir`` (each written aside, then renamed); returns the names copied."""
    copied = []
    for name in PROCESSOR_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            _write_aside(os.path.join(out_dir, name), lambda tmp: shutil.copyfile(path, tmp))
            copied.append(name)
    return copied


# ---- the engine's save ------------------------------------------------------------------------
def engine_sources(engine) -> tuple[dict[str, SavedTensor], int]:
    """(saved-tensor sources in ``model.state_dict()`` order, distinct parameter elements) of a
    ``CephaloEngine``: parameters from the shard metadata, buffers from the model."""
    where: dict[str, SavedTensor] = {}
    total = 0
    for u, meta in enumerate(engine.shard_metadata()):
        unit = engine.all_units()[u]
        total += int(meta.numel)
        for p in meta.params:  # each tensor in its part's storage dtype, as save_pretrained
            dtype = unit.dtype if p.requires_grad else unit.frozen_dtype
            for alias in p.aliases:
                where[alias] = SavedTensor(u, p.fqn, tuple(p.shape), dtype)
    model = engine.staged.model
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        out[key] = where[key] if key in where else \
            SavedTensor(None, key, tuple(value.shape), value.dtype)
    return out, total


def save_pretrained_streamed(engine, out_dir: str, *,
                             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> SaveResult | None:
    """Collective: write ``engine``'s model like ``save_pretrained(out_dir, max_shard_size=...)``,
    gathering one unit at a time ([Note: streamed save]).

    Every rank calls it; rank 0 writes (``out_dir`` is created) and gets the ``SaveResult``,
    the others get None. Peak extra memory on rank 0: one output file's tensors (about
    ``max_shard_size``, or the largest single tensor) plus one gathered unit.

    Raises (on every rank):
        ValueError: a bad ``max_shard_size`` or ``out_dir`` is an existing file (before any
            collective). NotImplementedError: see ``plan_hf_files``.
        CheckpointError: rank 0 could not write ("rank 0 could not save the model to ...",
            the same message on every rank; raised after the gathers finished). With one rank
            the OSError itself.
        RuntimeError: an earlier step raised part-way (``check_usable``).
    """
    engine.check_usable("save_pretrained_streamed")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"save target {out_dir} is an existing file; give a directory")
    model = engine.staged.model
    sources, total_parameters = engine_sources(engine)
    plan = plan_hf_files(model, sources, max_shard_size=max_shard_size,
                         total_parameters=total_parameters)
    units = engine.iter_full_units(plan.unit_order)
    result = None
    with errors_on_every_rank(engine.group, what=f"save the model to {out_dir}"):
        try:
            if engine.rank == 0:
                result = _write_model_dir(out_dir, plan, units, model, engine.dtype)
        finally:
            for _ in units:  # finish the gathers (all of them on ranks > 0, the rest on error)
                pass
    return result


def _write_model_dir(out_dir: str, plan: HFFilePlan, units, model, dtype) -> SaveResult:
    os.makedirs(out_dir, exist_ok=True)
    buffers = {s.name: model.get_buffer(s.name) for s in plan.sources.values() if s.unit is None}
    result = write_hf_files(out_dir, plan, units, buffers=buffers)
    write_hf_configs(out_dir, model, dtype)
    remove_stale_weights(out_dir, result.files)
    return result
