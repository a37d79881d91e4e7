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
import os
import re
import shutil
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch

from hf_cephalo.file_modes import apply_default_mode
from hf_cephalo.units import DEFAULT_MAX_SHARD_SIZE

from .checkpoint_files import errors_on_every_rank, fsync_file

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "WEIGHTS_NAME", "INDEX_NAME", "PROCESSOR_FILES",
           "SavedTensor", "HFFilePlan", "SaveResult", "parse_max_shard_size", "plan_hf_files",
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
    name: its key in that unit's ``FullUnit.tensors`` (or the buffer key); shape, dtype: as saved.
    """

    unit: int | None
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


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
        NotImplementedError: the model's weight conversions combine tensors (only renames can
            be streamed).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    limit = parse_max_shard_size(max_shard_size)
    metas = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in sources.items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        metas.pop(key, None)
    renamed = _apply_hf_key_edits(model, metas, sources)
    saved = {new: sources[old] for new, old in renamed.items()}
    split = split_torch_state_dict_into_shards(
        {k: metas[old] for k, old in renamed.items()},
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=limit)
    files = {name: list(keys) for name, keys in split.filename_to_tensors.items()}
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": int(total_parameters), **split.metadata},
                 "weight_map": dict(split.tensor_to_filename)}
    return HFFilePlan(files, saved, _unit_order(files, saved), index)


def _apply_hf_key_edits(model, metas: dict[str, torch.Tensor],
                        sources: Mapping[str, SavedTensor]) -> dict[str, str]:
    """Drop tied aliases and apply renames as ``save_pretrained`` does: {saved key: state-dict
    key}, in saving order."""
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
    if any(id(t) not in by_id for t in reverted.values()) or len(reverted) != len(kept):
        raise NotImplementedError(
            f"{type(model).__name__} has weight conversions that combine or split tensors on "
            "save (transformers' conversion mapping); the streamed save handles renames only: "
            "gather the model on every rank instead (trainer.unshard_model(), then "
            "model.save_pretrained)")
    return {new: by_id[id(t)] for new, t in reverted.items()}


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
            tensors[key] = current.tensors[src.name].detach().to("cpu", copy=True).contiguous()
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
