"""Sharded checkpoints of a ``CephaloEngine``: save per rank, load onto any plan / world size.

A checkpoint directory holds (``FILES`` names them):

* ``cephalo_layout.json`` (rank 0): format version, model fingerprint, world size and, per unit
  (layers in order, then the embedding unit and the head unit), its numel, trainable numel, per-rank numel and every
  parameter's fqn / aliases / shape / flat offset; the model buffers' keys; the model config.
* ``cephalo_shard_rank<R>.safetensors`` (rank R): ``units.<u>.param`` — (n_R,) this rank's slice
  of unit u's flat buffer; ``units.<u>.optim.<key>`` — (t_R,) every optimizer state tensor with
  the shard's shape (AdamW: ``exp_avg``, ``exp_avg_sq``), t_R = the trainable part of the
  slice. Its safetensors metadata (JSON) carries the rank, the fingerprint, 0-dim optimizer
  state (AdamW ``step``) per unit and the optimizer's param groups (lr, betas, ...).
* ``cephalo_buffers.safetensors`` (rank 0): the model's persistent buffers.
* ``cephalo_complete.json`` (rank 0, written LAST): size and CRC-32 of each shard file.

[Note: atomic checkpoints] ``atomic_checkpoint_dir`` writes everything into a hidden sibling
``.tmp-<name>``, fsyncs, writes the completeness marker, then renames the directory into place.
A run killed at any moment leaves either no ``<name>`` at all or a complete one;
``newest_complete_checkpoint`` (and transformers' ``get_last_checkpoint``: regex
``^checkpoint-\\d+$``) never sees the staging directory, and ``load_sharded`` refuses a
directory without the marker.

Re-layout: a unit's flat buffer is the same on every plan (same parameter order), only the
per-rank cut points differ, so each rank of the new plan copies the overlap of its new range
with every old rank's range (``safetensors`` reads just those slices). Optimizer state tensors
are cut the same way over the trainable prefix. Loading needs no process group (every rank
reads the files it overlaps; the directory must be visible to every rank).

Loading never executes code: tensors come through ``safetensors``, everything else is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hf_cephalo.file_modes import apply_default_mode

# the file primitives export.py shares live in checkpoint_files.py (imports point one way:
# checkpoint -> export -> checkpoint_files); re-exported here, where callers import them
from .checkpoint_files import DAMAGED, CheckpointError, errors_on_every_rank
from .param_shards import split_unit_states, unit_states
from .checkpoint_files import fsync_file as _fsync_file
from .export import (PROCESSOR_FILES, SavedTensor, copy_processor_files, parse_max_shard_size,
                     plan_hf_files, remove_stale_weights, write_hf_configs, write_hf_files)

__all__ = ["FORMAT", "FILES", "CheckpointError", "CheckpointLayout", "atomic_checkpoint_dir",
           "save_sharded", "save_checkpoint", "staging_path", "load_sharded",
           "load_checkpoint", "errors_on_every_rank", "load_sharded_optimizer", "read_layout",
           "read_full_state_dict", "export_hf", "check_export_target", "is_complete", "model_fingerprint",
           "NewestCheckpoint", "newest_complete_checkpoint", "DAMAGED", "damaged_remedy",
           "earlier_complete_checkpoint"]

FORMAT = "hf_cephalo.sharded/2"
# /1: the root was ONE unit ("root", after the layers); /2 splits it into "embed" and "head".
# Offline merging (read_full_state_dict, export_hf) reads both: it goes by parameter offsets.
# Resuming (load_sharded*) needs the engine's units: a /1 checkpoint gets a CheckpointError
# saying to export it and start from the exported model (see docs/checkpoints.md).
READABLE_FORMATS = (FORMAT, "hf_cephalo.sharded/1")


class FILES:
    """File names inside a checkpoint directory."""

    LAYOUT = "cephalo_layout.json"
    BUFFERS = "cephalo_buffers.safetensors"
    COMPLETE = "cephalo_complete.json"

    @staticmethod
    def shard(rank: int) -> str:
        return f"cephalo_shard_rank{rank}.safetensors"


@dataclass(frozen=True)
class CheckpointLayout:
    """Parsed ``cephalo_layout.json``.

    world_size: ranks that wrote the checkpoint; units: per unit (engine order: layers, then
    the embedding and head units; format /1: layers, then one root unit) a dict with
    ``name``, ``numel``, ``trainable_numel``, ``numel_per_rank`` (list of ints),
    ``trainable_per_rank`` (each rank's trainable shard, [Note: two parts per unit] in
    ``flat_param.py``; absent in checkpoints of the older prefix layout, whose ranks held
    contiguous ranges of ``[trainable | frozen]``), ``dtypes`` ([trainable, frozen] storage
    dtype names; absent: one dtype) and ``params`` (fqn, aliases, shape, offset, numel,
    requires_grad); buffers: buffer keys; fingerprint:
    ``model_fingerprint`` of the saved model; config: the model config dict (or None).
    """

    directory: str
    world_size: int
    units: list[dict[str, Any]]
    buffers: list[str]
    fingerprint: dict[str, str]
    config: dict[str, Any] | None
    format: str = FORMAT


# ---- model identity ---------------------------------------------------------------------------
def _units_description(engine) -> list[dict[str, Any]]:
    out = []
    for meta, unit in zip(engine.shard_metadata(), engine.all_units()):
        out.append(dict(name=meta.name, numel=int(meta.numel),
                        trainable_numel=int(meta.trainable_numel),
                        numel_per_rank=[int(n) for n in meta.numel_per_rank],
                        trainable_per_rank=[int(n) for n in unit.trainable_per_rank],
                        dtypes=[str(unit.dtype).removeprefix("torch."),
                                str(unit.frozen_dtype).removeprefix("torch.")],
                        params=[dict(fqn=p.fqn, aliases=list(p.aliases), shape=list(p.shape),
                                     offset=int(p.offset), numel=int(p.numel),
                                     requires_grad=bool(p.requires_grad)) for p in meta.params]))
    return out


def _buffer_keys(engine) -> list[str]:
    param_keys = {a for u in engine.shard_metadata() for p in u.params for a in p.aliases}
    return [k for k in engine.staged.model.state_dict(keep_vars=True) if k not in param_keys]


def model_fingerprint(engine) -> dict[str, str]:
    """{"model_class", "sha256"}: the class name and a hash of every parameter's unit, fqn,
    aliases, shape and dtype, and the buffer keys — the same for every plan and world size."""
    h = hashlib.sha256()
    for unit in engine.shard_metadata():
        for p in unit.params:
            h.update(f"{unit.name}|{p.fqn}|{','.join(p.aliases)}|{tuple(p.shape)}|"
                     f"{p.requires_grad}\n".encode())
    h.update(f"dtype {engine.dtype}\n".encode())
    for key in _buffer_keys(engine):
        h.update(f"buffer {key}\n".encode())
    return {"model_class": type(engine.staged.model).__name__, "sha256": h.hexdigest()}


# ---- atomic directory ---------------------------------------------------------------------------
def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(group) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(os.path.join(dirpath, name))
        _fsync_file(dirpath)


def staging_path(path: str) -> str:
    """The hidden sibling ``.tmp-<name>`` a checkpoint ``path`` is written into first."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")


@contextlib.contextmanager
def atomic_checkpoint_dir(path: str, group: dist.ProcessGroup | None = None, *,
                          check: Callable[[str], None] | None = None) -> Iterator[str]:
    """Collective (every rank): yield a staging directory; on exit publish it as ``path``.

    See [Note: atomic checkpoints]. On exit: every rank fsyncs what is there, the ranks exchange
    the sizes and CRC-32 of the shard files they wrote (``save_sharded``; one
    ``all_gather_object``, which is also the barrier), rank 0 runs ``check(staging)`` (raises
    ValueError when the directory lacks what it must hold), writes ``cephalo_complete.json``,
    renames the staging directory to ``path`` (replacing an existing one) and fsyncs the
    parent; one more ``all_gather_object`` (the barrier) tells every rank whether rank 0
    succeeded. If the body raises, nothing is published (the staging directory stays until the
    next save of the same path removes it).

    Raises:
        CheckpointError: on every rank when ``check`` (or publishing) failed on rank 0; the
            checkpoint is then not marked complete and not published.
    """
    final, staging = os.path.abspath(path), staging_path(path)
    rank = _rank(group)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
        os.makedirs(staging)
    _barrier(group)
    _RECORDS[staging] = {}
    try:
        yield staging
    finally:
        records = _RECORDS.pop(staging)
    _fsync_tree(staging)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list[dict | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, records, group=group)  # also the barrier after writing
        records = {k: v for r in everyone for k, v in (r or {}).items()}
    with errors_on_every_rank(group, what=f"publish the checkpoint {final}"):
        if rank == 0:
            if check is not None:
                check(staging)  # never mark complete what lacks a promised file
            _write_marker(staging, records)
            old = os.path.join(os.path.dirname(final), f".old-{os.path.basename(final)}")
            if os.path.exists(final):
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(staging, final)
            _fsync_file(os.path.dirname(final))
            shutil.rmtree(old, ignore_errors=True)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# staging directory -> {file name: {"size_bytes", "crc32"}} of the files this rank wrote there
_RECORDS: dict[str, dict[str, dict[str, int]]] = {}


def _record(path: str) -> None:
    """Remember the size and CRC-32 of a file just written (read back from the page cache by
    the rank that wrote it, so no rank reads the whole checkpoint) for the marker."""
    directory = os.path.abspath(os.path.dirname(path))
    if directory in _RECORDS:
        _RECORDS[directory][os.path.basename(path)] = {"size_bytes": os.path.getsize(path),
                                                       "crc32": _crc32(path)}


def _write_marker(directory: str, records: dict[str, dict[str, int]]) -> None:
    files = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            files[name] = records.get(name, {"size_bytes": os.path.getsize(full)})
    tmp = os.path.join(directory, FILES.COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    apply_default_mode(tmp)  # [Note: file modes]
    os.rename(tmp, os.path.join(directory, FILES.COMPLETE))


def _run_folder_hint(directory: str) -> str | None:
    """For a run's output_dir given instead of a checkpoint: the ``checkpoint-N`` directories
    it holds, newest first, each without its marker called incomplete, and the newest complete
    one to give instead. None when ``directory`` holds no ``checkpoint-N``."""
    found = []
    for name in os.listdir(directory):
        prefix, _, step = name.partition("-")
        if prefix == "checkpoint" and step.isdigit() and os.path.isdir(os.path.join(directory, name)):
            found.append((int(step), name, is_complete(os.path.join(directory, name))))
    if not found:
        return None
    found.sort(reverse=True)
    listed = ", ".join(name + ("" if complete else " (incomplete)") for _, name, complete in found)
    complete = [name for _, name, ok in found if ok]
    advice = (f"give a checkpoint, e.g. the newest complete one: "
              f"{os.path.join(directory, complete[0])}" if complete else
              "none of them is complete (every save was interrupted)")
    return f"{directory}: a run folder, not a checkpoint; it holds {listed}; {advice}"


def is_complete(directory: str) -> bool:
    """True if ``directory`` carries the completeness marker (written last by a save)."""
    return os.path.isfile(os.path.join(directory, FILES.COMPLETE))


class NewestCheckpoint(NamedTuple):
    """``newest_complete_checkpoint``'s answer: ``path`` (the newest complete ``checkpoint-N``,
    None if none is complete) and ``skipped`` (the newer ``checkpoint-N`` directories without the
    completeness marker, newest first; with ``path`` None: every ``checkpoint-N`` found)."""

    path: str | None
    skipped: list[str]


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-<step>


def newest_complete_checkpoint(output_dir: str) -> NewestCheckpoint:
    """The ``checkpoint-N`` with the largest N in ``output_dir`` that carries the completeness
    marker (``is_complete``), and the newer ones passed over (e.g. copied without the marker,
    or published by a release that did not write one). Staging ``.tmp-checkpoint-N``
    directories never match. A missing ``output_dir`` gives ``NewestCheckpoint(None, [])``."""
    if not os.path.isdir(output_dir):
        return NewestCheckpoint(None, [])
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := _CHECKPOINT_RE.match(name))
                    and os.path.isdir(os.path.join(output_dir, name))), reverse=True)
    skipped = []
    for _, name in found:
        path = os.path.join(output_dir, name)
        if is_complete(path):
            return NewestCheckpoint(path, skipped)
        skipped.append(path)
    return NewestCheckpoint(None, skipped)


def _sizes_match_marker(directory: str) -> bool:
    """Whether every file ``directory``'s completeness marker lists is there at its recorded
    size (a stat per file; CRC-32s are checked when the files are read)."""
    try:
        with open(os.path.join(directory, FILES.COMPLETE)) as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(directory, name)) == record["size_bytes"]
                   for name, record in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # unreadable marker, a listed file gone: not a checkpoint to point to


def earlier_complete_checkpoint(directory: str) -> str | None:
    """For a ``checkpoint-N`` refused as damaged: the newest ``checkpoint-M`` beside it (same
    parent, M < N) that carries the completeness marker and whose files are all at the sizes
    the marker recorded; None when there is none, or ``directory`` is not named
    ``checkpoint-N`` (transformers' ``PREFIX_CHECKPOINT_DIR``)."""
    parent, name = os.path.split(os.path.normpath(directory))
    match = _CHECKPOINT_RE.match(name)
    if match is None or not os.path.isdir(parent or "."):
        return None
    earlier = sorted(((int(m.group(1)), entry) for entry in os.listdir(parent or ".")
                      if (m := _CHECKPOINT_RE.match(entry))
                      and int(m.group(1)) < int(match.group(1))), reverse=True)
    for _, entry in earlier:
        path = os.path.join(parent, entry)
        if os.path.isdir(path) and is_complete(path) and _sizes_match_marker(path):
            return path
    return None


def damaged_remedy(directory: str) -> str:
    """What to do about a damaged checkpoint ``directory`` (the end of every CheckpointError
    about a corrupt or missing file in it): copy it again, or resume from the newest complete
    checkpoint before it, named with the flag that takes it (``earlier_complete_checkpoint``).
    ``DAMAGED`` itself when ``directory`` is not a ``checkpoint-N``."""
    directory = os.path.normpath(directory)
    if _CHECKPOINT_RE.match(os.path.basename(directory)) is None:
        return DAMAGED
    earlier = earlier_complete_checkpoint(directory)
    if earlier is None:
        return (f"the checkpoint is damaged: copy the directory again ({os.path.dirname(directory)} "
                "holds no complete checkpoint-N before it)")
    return (f"the checkpoint is damaged: copy the directory again, or resume from the newest "
            f"complete checkpoint before it, {earlier}: --resume_from_checkpoint {earlier} (in "
            f"Python train(resume_from_checkpoint={earlier!r}); `hf-cephalo export {earlier}` "
            "exports it)")


# ---- save -------------------------------------------------------------------------------------
def _optimizer_state_by_unit(engine, optimizer) -> tuple[dict, list[dict]]:
    """{unit index: optimizer state of its trainable shard}, param groups (no params); the
    optimizer may hold the flat shards or the per-parameter shards (``param_shards.py``)."""
    by_unit = unit_states(engine, optimizer, "save_sharded")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return by_unit, groups


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise NotImplementedError(f"optimizer state {where} is a tensor of shape "
                                      f"{tuple(value.shape)} that is not shard-aligned; sharded "
                                      "checkpoints support per-element state and scalars only: "
                                      "use an element-wise optimizer such as torch.optim.AdamW "
                                      "(--optim adamw_torch)")
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list":
                [_json_value(v, where) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotImplementedError(f"optimizer state {where} = {value!r} cannot be saved as JSON; "
                              "use an element-wise optimizer such as torch.optim.AdamW "
                              "(--optim adamw_torch)")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_from_json(v) for v in value["tuple"])
    if isinstance(value, dict) and "list" in value:
        return [_from_json(v) for v in value["list"]]
    return value


def save_sharded(engine, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write this rank's shard (and on rank 0 the layout and buffers) into ``directory``.

    Every rank calls it (no collective; ``directory`` must exist). Not atomic by itself: wrap
    it in ``atomic_checkpoint_dir`` (``save_checkpoint`` does both).

    Args:
        engine: the ``CephaloEngine`` (parameters SHARDED, i.e. outside ``train_step``).
        optimizer: built over ``engine.parameters()``; per-element state tensors (shape of the
            shard) and 0-dim state are saved, e.g. AdamW's exp_avg, exp_avg_sq, step.
    Raises:
        ValueError: the optimizer holds parameters that are not the engine's.
        NotImplementedError: optimizer state that is neither per-element nor 0-dim.
    """
    rank, fingerprint = engine.rank, model_fingerprint(engine)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict] = []
    for u, unit in enumerate(engine.all_units()):
        tensors[f"units.{u}.param"] = unit.trainable.local.detach().to("cpu", copy=True)
        if unit.frozen.numel:  # the frozen shard in its own dtype
            tensors[f"units.{u}.frozen"] = unit.frozen.local.detach().to("cpu", copy=True)
    if optimizer is not None:
        by_unit, raw_groups = _optimizer_state_by_unit(engine, optimizer)
        groups = [{k: _json_value(v, f"param_groups.{k}") for k, v in g.items()}
                  for g in raw_groups]
        params = engine.parameters()
        for u, state in by_unit.items():
            scalars[str(u)] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and \
                        value.shape == params[u].shape:
                    tensors[f"units.{u}.optim.{key}"] = value.detach().to("cpu", copy=True)
                else:
                    scalars[str(u)][key] = _json_value(value, f"{key} of unit {u}")
    meta = {"format": FORMAT, "rank": rank, "world_size": engine.world_size,
            "fingerprint": fingerprint, "has_optimizer": optimizer is not None,
            "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_scalars": scalars, "param_groups": groups}
    path = os.path.join(directory, FILES.shard(rank))
    save_file(tensors, path, metadata={"cephalo": json.dumps(meta)})
    apply_default_mode(path)  # safetensors writes 0o600: [Note: file modes]
    _record(path)
    if rank == 0:
        _save_rank0_files(engine, directory, fingerprint)


def _save_rank0_files(engine, directory: str, fingerprint: dict[str, str]) -> None:
    model = engine.staged.model
    keys = _buffer_keys(engine)
    buffers = {k: model.get_buffer(k).detach().to("cpu", copy=True).contiguous() for k in keys}
    save_file(buffers, os.path.join(directory, FILES.BUFFERS), metadata={"format": FORMAT})
    apply_default_mode(os.path.join(directory, FILES.BUFFERS))  # [Note: file modes]
    _record(os.path.join(directory, FILES.BUFFERS))
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else None
    if config_dict is not None:
        # the class that trained, as save_pretrained records it: a config loaded from a
        # pretrained checkpoint still names that checkpoint's class (e.g. BertModel for a
        # BertForSequenceClassification fine-tuned from it), and export builds this class
        config_dict["architectures"] = [type(model).__name__]
    layout = {"format": FORMAT, "world_size": engine.world_size, "fingerprint": fingerprint,
              "units": _units_description(engine), "buffers": keys, "config": config_dict}
    with open(os.path.join(directory, FILES.LAYOUT), "w") as f:
        json.dump(layout, f, indent=1, default=str)


def save_checkpoint(engine, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Collective: ``save_sharded`` into ``path`` atomically (see [Note: atomic checkpoints]).

    Raises RuntimeError (before any collective) when an earlier step raised part-way
    (``CephaloEngine.check_usable``)."""
    engine.check_usable("save_checkpoint")
    with atomic_checkpoint_dir(path, engine.group) as staging:
        save_sharded(engine, staging, optimizer)


# ---- read -------------------------------------------------------------------------------------
def _read_json(path: str, what: str, formats: tuple[str, ...] = READABLE_FORMATS) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); {damaged_remedy(os.path.dirname(path))}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({what}): {e}; "
                              f"{damaged_remedy(os.path.dirname(path))}") from None
    if not isinstance(data, dict) or data.get("format") not in formats:
        raise CheckpointError(f"{path}: not a {FORMAT} file (format "
                              f"{data.get('format') if isinstance(data, dict) else None!r}); "
                              f"this release reads {', '.join(formats)}: a checkpoint of a newer "
                              "hf_cephalo needs that release (upgrade)")
    return data


def read_layout(directory: str) -> CheckpointLayout:
    """Check the completeness marker and parse the layout of a checkpoint directory.

    Raises CheckpointError: the directory or marker is missing (a save that did not finish),
    or the layout file is missing / corrupt.
    """
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory; give the path of a "
                              "checkpoint-N directory written by CephaloTrainer (or "
                              "save_checkpoint)")
    marker = os.path.join(directory, FILES.COMPLETE)
    if not os.path.isfile(marker) and not os.path.isfile(os.path.join(directory, FILES.LAYOUT)):
        hint = _run_folder_hint(directory)
        if hint:  # a run's output_dir given instead of one of its checkpoints
            raise CheckpointError(hint)
        raise CheckpointError(f"{directory}: not a Cephalo sharded checkpoint (no {FILES.LAYOUT}, "
                              f"no {FILES.COMPLETE}); to start from a plain model directory, "
                              "load it with from_pretrained and train without resuming")
    if not os.path.isfile(marker):
        raise CheckpointError(f"{marker}: missing — {directory} is an incomplete checkpoint (its "
                              "save did not finish, e.g. the run was killed); resume from an "
                              "earlier checkpoint")
    _read_json(marker, "completeness marker")
    model_files = [n for n in ("model.safetensors", "model.safetensors.index.json",
                               "adapter_model.safetensors")
                   if os.path.isfile(os.path.join(directory, n))]
    if model_files and not os.path.isfile(os.path.join(directory, FILES.LAYOUT)):
        raise CheckpointError(f"{directory}: no sharded state ({FILES.LAYOUT}): a checkpoint saved "
                              f"with save_only_model=True holds the model as {model_files[0]} "
                              "already; load it with from_pretrained (a LoRA adapter: "
                              "PeftModel.from_pretrained), or resume from it with CephaloTrainer")
    data = _read_json(os.path.join(directory, FILES.LAYOUT), "shard layout")
    try:
        return CheckpointLayout(directory, int(data["world_size"]), list(data["units"]),
                                list(data["buffers"]), dict(data["fingerprint"]),
                                data.get("config"), data["format"])
    except (KeyError, TypeError, ValueError) as e:
        path = os.path.join(directory, FILES.LAYOUT)
        raise CheckpointError(f"{path}: corrupt layout ({e}); {damaged_remedy(directory)}") \
            from None


class _ShardReader:
    """Opens shard files on demand, verifying size / CRC-32 against the marker and the header."""

    def __init__(self, layout: CheckpointLayout, verify: bool = True):
        self.layout, self.verify = layout, verify
        marker = _read_json(os.path.join(layout.directory, FILES.COMPLETE), "completeness marker")
        self.expected = marker.get("files", {})
        self._open: dict[str, Any] = {}
        self.meta: dict[int, dict] = {}

    def remedy(self) -> str:
        """The end of an error about a damaged file of this checkpoint (``damaged_remedy``)."""
        return damaged_remedy(self.layout.directory)

    def open(self, name: str):
        if name in self._open:
            return self._open[name]
        path = os.path.join(self.layout.directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (a shard of a {self.layout.world_size}-rank "
                                  "checkpoint; copy every cephalo_* file of the checkpoint)")
        want = self.expected.get(name)
        if want is None:
            raise CheckpointError(f"{path}: not listed in {FILES.COMPLETE} (a file from "
                                  f"another save?); {self.remedy()}")
        size = os.path.getsize(path)
        if size != want["size_bytes"]:
            raise CheckpointError(f"{path}: corrupt — {size} bytes, the checkpoint recorded "
                                  f"{want['size_bytes']} (truncated or overwritten); "
                                  f"{self.remedy()}")
        if self.verify and "crc32" in want and _crc32(path) != want["crc32"]:
            raise CheckpointError(f"{path}: corrupt — CRC-32 does not match the one recorded "
                                  f"at save; {self.remedy()}")
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors file ({e}); "
                                  f"{self.remedy()}") from None
        self._open[name] = handle
        return handle

    def shard_meta(self, rank: int) -> dict:
        if rank not in self.meta:
            name = FILES.shard(rank)
            path = os.path.join(self.layout.directory, name)
            try:
                meta = json.loads((self.open(name).metadata() or {})["cephalo"])
            except (KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt shard metadata ({e}); "
                                      f"{self.remedy()}") from None
            if meta.get("fingerprint") != self.layout.fingerprint or meta.get("rank") != rank:
                raise CheckpointError(
                    f"{path}: shard of another checkpoint (model {meta.get('fingerprint')}, rank "
                    f"{meta.get('rank')}), expected rank {rank} of {self.layout.fingerprint}; "
                    f"{self.remedy()}")
            self.meta[rank] = meta
        return self.meta[rank]

    def read_range(self, unit: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of unit ``unit``'s flat index ``[trainable | frozen]``
        (``key`` "param": parameters; "optim.<name>": optimizer state, trainable elements
        only), concatenated over the old ranks' files; [start, stop) lies in one part, and the
        result has the dtype that part was saved in."""
        pieces = []
        for r, lo_r, hi_r, tensor_key in _saved_segments(self.layout.units[unit], unit, key):
            lo, hi = max(start, lo_r), min(stop, hi_r)
            if lo >= hi:
                continue
            name = FILES.shard(r)
            self.shard_meta(r)
            handle = self.open(name)
            if tensor_key not in handle.keys():
                raise CheckpointError(f"{os.path.join(self.layout.directory, name)}: no tensor "
                                      f"{tensor_key!r} (corrupt or written without an "
                                      f"optimizer); {self.remedy()}")
            sl = handle.get_slice(tensor_key)
            if sl.get_shape() != [hi_r - lo_r]:
                raise CheckpointError(f"{os.path.join(self.layout.directory, name)}: tensor "
                                      f"{tensor_key!r} has shape {sl.get_shape()}, the layout says "
                                      f"[{hi_r - lo_r}]; {self.remedy()}")
            pieces.append(sl[lo - lo_r:hi - lo_r])
        got = sum(p.numel() for p in pieces)
        assert got == stop - start, f"re-layout read {got} of {stop - start} elements"
        return torch.cat(pieces) if pieces else torch.zeros(0)


def _saved_segments(info: dict[str, Any], u: int, key: str) -> list[tuple[int, int, int, str]]:
    """(old rank, lo, hi, tensor key): the flat-index ranges [lo, hi) of unit ``u`` each old
    rank saved under ``key`` ("param" or "optim.<name>"), empty ones left out."""
    nt = int(info["trainable_numel"])
    if "trainable_per_rank" not in info:  # older prefix layout: contiguous [trainable | frozen]
        out, begin = [], 0
        for r, n in enumerate(info["numel_per_rank"]):
            stop = begin + n if key == "param" else max(begin, min(begin + n, nt))
            out.append((r, begin, stop, f"units.{u}.{key}"))
            begin += n
        return [(r, lo, hi, k) for r, lo, hi, k in out if hi > lo]
    counts = [int(k) for k in info["trainable_per_rank"]]
    frozen = [int(n) - k for n, k in zip(info["numel_per_rank"], counts)]
    out = [(r, sum(counts[:r]), sum(counts[:r + 1]), f"units.{u}.{key}")
           for r in range(len(counts))]
    if key == "param":
        out += [(r, nt + sum(frozen[:r]), nt + sum(frozen[:r + 1]), f"units.{u}.frozen")
                for r in range(len(frozen))]
    return [(r, lo, hi, k) for r, lo, hi, k in out if hi > lo]


def _read_parts(reader: "_ShardReader", u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit ``u``'s full parts ``(trainable (Nt,), frozen (N - Nt,))`` from the shard files."""
    info = reader.layout.units[u]
    nt, n = int(info["trainable_numel"]), int(info["numel"])
    return reader.read_range(u, "param", 0, nt), reader.read_range(u, "param", nt, n)


def _check_model(layout: CheckpointLayout, engine) -> None:
    if layout.format != FORMAT:
        raise CheckpointError(
            f"{os.path.join(layout.directory, FILES.LAYOUT)}: format {layout.format} keeps the "
            f"root (embeddings + head) as one unit; this engine ({FORMAT}) has separate "
            "embedding and head units, so it cannot resume from it. Export the model "
            "(hf-cephalo export, or hf_cephalo.engine.checkpoint.export_hf, which read this "
            "format) and start from the exported folder (optimizer state starts fresh), or "
            "resume with the hf_cephalo release that wrote it")
    mine = model_fingerprint(engine)
    if mine != layout.fingerprint:
        raise CheckpointError(
            f"{os.path.join(layout.directory, FILES.LAYOUT)}: checkpoint of another model "
            f"({layout.fingerprint['model_class']}, parameter hash "
            f"{layout.fingerprint['sha256'][:12]}) than the engine's "
            f"({mine['model_class']}, {mine['sha256'][:12]}): parameter names, shapes, dtype or "
            "unit split differ; resume with the model it was saved from (same class, config, "
            "dtype and LoRA setup), or start a new output_dir")


def load_checkpoint(engine, directory: str, optimizer: torch.optim.Optimizer | None = None, *,
                    verify: bool = True) -> None:
    """Collective: ``load_sharded`` (+ ``load_sharded_optimizer``) with errors raised on every
    rank (``errors_on_every_rank``). Raises CheckpointError as those functions, RuntimeError
    (before any collective) when an earlier step raised part-way."""
    engine.check_usable("load_checkpoint")
    with errors_on_every_rank(engine.group):
        load_sharded(engine, directory, verify=verify)
        if optimizer is not None:
            load_sharded_optimizer(engine, optimizer, directory, verify=verify)


def _flat_units(engine) -> list:
    return engine.all_units()


def load_sharded(engine, directory: str, *, verify: bool = True) -> None:
    """Load the parameters and buffers of a checkpoint into ``engine`` (any plan / world size).

    Every rank calls it (no collective); each reads the slices its new shard overlaps.

    Raises:
        CheckpointError: incomplete checkpoint (no marker), missing / truncated / corrupt file
            (size or CRC-32 mismatch, bad header), or a checkpoint of another model — the
            message names the file. Raised before anything is copied into the engine.
    """
    layout = read_layout(directory)
    _check_model(layout, engine)
    reader = _ShardReader(layout, verify)
    new_locals = []  # (this rank's shard tensor, its values), per non-empty part
    for u, unit in enumerate(_flat_units(engine)):
        new_locals += [(local, reader.read_range(u, "param", lo, hi))
                       for lo, hi, local in unit.local_segments()]
    buffers = _read_buffers(layout, reader)
    with torch.no_grad():
        for local, values in new_locals:
            local.copy_(values.to(local.dtype))
        for key, value in buffers.items():
            engine.staged.model.get_buffer(key).copy_(value)


def _read_buffers(layout: CheckpointLayout, reader: _ShardReader) -> dict[str, torch.Tensor]:
    handle = reader.open(FILES.BUFFERS)
    missing = [k for k in layout.buffers if k not in handle.keys()]
    if missing:
        raise CheckpointError(f"{os.path.join(layout.directory, FILES.BUFFERS)}: missing buffers "
                              f"{missing}; {damaged_remedy(layout.directory)}")
    return {k: handle.get_tensor(k) for k in layout.buffers}


def load_sharded_optimizer(engine, optimizer: torch.optim.Optimizer, directory: str, *,
                           verify: bool = True) -> None:
    """Load optimizer state (re-laid for this plan) and param-group values into ``optimizer``.

    ``optimizer`` must be built over ``engine.parameters()`` with the same class as the saved
    one. Scalars such as AdamW's ``step`` must agree over the old ranks of a unit.

    Raises:
        CheckpointError: as ``load_sharded``; the checkpoint has no optimizer state or that of
            another optimizer class; old ranks disagree on a unit's scalar state.
        ValueError: a different number of param groups.
    """
    layout = read_layout(directory)
    _check_model(layout, engine)
    reader = _ShardReader(layout, verify)
    metas = [reader.shard_meta(r) for r in range(layout.world_size)]
    path0 = os.path.join(directory, FILES.shard(0))
    if not metas[0]["has_optimizer"]:
        raise CheckpointError(f"{path0}: the checkpoint was saved without optimizer state, "
                              "so training cannot resume from it; export its "
                              "weights (hf-cephalo export) and start from them, or resume from a "
                              "checkpoint saved with the optimizer")
    if metas[0].get("optimizer_class") != type(optimizer).__name__:
        raise CheckpointError(f"{path0}: optimizer state of {metas[0].get('optimizer_class')}, "
                              f"but the optimizer is {type(optimizer).__name__}; resume with the "
                              "same optimizer")
    state_dict = optimizer.state_dict()
    saved_groups = [{k: _from_json(v) for k, v in g.items()} for g in metas[0]["param_groups"]]
    if len(saved_groups) != len(state_dict["param_groups"]):
        raise ValueError(f"{path0}: the checkpoint's optimizer has {len(saved_groups)} param "
                         f"groups, this one {len(state_dict['param_groups'])}; build the optimizer "
                         "with the saved run's parameter groups")
    states = {}
    for u, unit in enumerate(_flat_units(engine)):
        state = _unit_optimizer_state(reader, metas, u, unit)
        if state is not None:
            states[u] = state
    for group, saved in zip(state_dict["param_groups"], saved_groups):
        for key, value in saved.items():
            if key in group:
                group[key] = value
    index_of = {id(p): i for i, p in
                enumerate(p for group in optimizer.param_groups for p in group["params"])}
    # load_state_dict casts each state to its parameter's device (and floating dtype) as usual
    state_dict["state"] = {index_of[id(p)]: state for p, state in
                           split_unit_states(engine, optimizer, states, "load_sharded_optimizer")}
    optimizer.load_state_dict(state_dict)


def _unit_optimizer_state(reader: _ShardReader, metas: list[dict], u: int, unit) -> dict | None:
    """The optimizer state of this rank's new shard of unit ``u`` (None if never stepped)."""
    info = reader.layout.units[u]
    holders = [r for r, m in enumerate(metas) if str(u) in m["optimizer_scalars"]]
    if not holders:
        return None
    scalars: dict[str, Any] = {}
    for r in holders:
        for key, value in metas[r]["optimizer_scalars"][str(u)].items():
            if key in scalars and scalars[key] != value:
                raise CheckpointError(
                    f"{os.path.join(reader.layout.directory, FILES.shard(r))}: optimizer state "
                    f"{key!r} of unit {info['name']} is {value}, rank {holders[0]} has "
                    f"{scalars[key]} (shards of different steps?); {reader.remedy()}")
            scalars[key] = value
    handle = reader.open(FILES.shard(holders[0]))
    prefix = f"units.{u}.optim."
    keys = [k[len(prefix):] for k in handle.keys() if k.startswith(prefix)]
    state = {k: _from_json(v) for k, v in scalars.items()}
    lo, hi = unit.trainable.flat_range(unit.rank)
    for key in keys:
        state[key] = reader.read_range(u, f"optim.{key}", lo, hi)
    return state


# ---- offline merge ----------------------------------------------------------------------------
def read_full_state_dict(directory: str, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Merge a sharded checkpoint into the model's full state dict (no process group).

    Returns ``model.state_dict()``'s keys (CPU tensors; tied aliases share one tensor).
    Raises CheckpointError as ``load_sharded``.
    """
    layout = read_layout(directory)
    reader = _ShardReader(layout, verify)
    out: dict[str, torch.Tensor] = {}
    for u, info in enumerate(layout.units):
        copies: dict[int, torch.Tensor] = {}  # tied aliases share one tensor
        for alias, view in _unit_views(info, _read_parts(reader, u)).items():
            out[alias] = copies.setdefault(id(view), view.clone())
    out.update(_read_buffers(layout, reader))
    return out


# Files ``save_pretrained`` writes: a directory holding only these is a previous export.
_EXPORT_FILE_PREFIXES = ("model", "config.json", "generation_config.json")


def _is_previous_export(names: list[str]) -> bool:
    return all((n.startswith(_EXPORT_FILE_PREFIXES) and n.endswith((".safetensors", ".json")))
               or n in PROCESSOR_FILES or n.startswith(".tmp-") for n in names)


def check_export_target(directory: str, out_dir: str, *, overwrite: bool = False) -> None:
    """Refuse an ``export_hf`` target that would lose data or silently write nothing.

    Allowed: a missing path, an empty directory, or a directory holding only files that
    ``save_pretrained`` writes (``config.json``, ``generation_config.json``,
    ``model*.safetensors``, ``model.safetensors.index.json``, the tokenizer / processor files
    an export copies, hidden ``.tmp-*`` leftovers: a previous export, replaced).
    ``overwrite=True`` also allows any other directory (files of the same names are replaced).

    Raises:
        CheckpointError: out_dir is an existing file; out_dir is the checkpoint directory
            itself or inside it (never allowed: the export could replace checkpoint files or
            mix model files into them); out_dir is a
            non-empty directory that is not a previous export and ``overwrite`` is False.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"export target {out_dir}: an existing file, not a directory; "
                              "give a new or empty directory path")
    ckpt, target = os.path.realpath(directory), os.path.realpath(out_dir)
    if target != ckpt and os.path.commonpath([ckpt, target]) == ckpt:
        raise CheckpointError(f"export target {out_dir} is inside the checkpoint directory "
                              f"{directory}; the export would mix model files into the "
                              "checkpoint: give a directory outside it")
    if os.path.isdir(out_dir):
        if os.path.isdir(directory) and os.path.samefile(directory, out_dir):
            raise CheckpointError(f"export target {out_dir} is the checkpoint directory itself; "
                                  "give a separate output directory")
        names = os.listdir(out_dir)
        if names and not overwrite and not _is_previous_export(names):
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise CheckpointError(f"export target {out_dir} is a non-empty directory that is not "
                                  f"a previous export (holds {shown}); give a new or empty "
                                  "directory, or pass overwrite=True (CLI: --overwrite)")


def export_hf(directory: str, out_dir: str, *, verify: bool = True, overwrite: bool = False,
              max_shard_size: int | str = "50GB") -> str:
    """Write a ``from_pretrained``-loadable model directory from a sharded checkpoint.

    Offline (no process group). The model class named by the saved config's ``architectures``
    is built on the meta device from ``transformers`` (never remote code) for its key names,
    tied weights and configs only; the weights stream from the shard files ONE unit at a time
    into the files ``save_pretrained(out_dir, max_shard_size=max_shard_size)`` would write
    (``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index; tied weights once;
    ``config.json``, ``generation_config.json``; see ``export.py`` [Note: streamed save]).
    Tokenizer / processor files in the checkpoint directory (``export.PROCESSOR_FILES``) are
    copied next to the weights. Memory: one output file's tensors plus one unit. Returns
    out_dir. The target is checked first (``check_export_target``).

    Raises:
        CheckpointError: as ``read_full_state_dict``; no config in the checkpoint; a config
            that needs remote code or names no transformers class; checkpoint keys that do not
            match that class's; a refused target (see ``check_export_target``).
        ValueError: a bad ``max_shard_size`` (before anything is read).
    """
    parse_max_shard_size(max_shard_size)
    check_export_target(directory, out_dir, overwrite=overwrite)
    layout = read_layout(directory)
    model = _meta_model(layout)
    reader = _ShardReader(layout, verify)
    sources, total_numel, dtype = _layout_sources(layout, reader, model)
    plan = plan_hf_files(model, sources, max_shard_size=max_shard_size,
                         total_parameters=total_numel)
    buffers = _read_buffers(layout, reader)
    os.makedirs(out_dir, exist_ok=True)
    result = write_hf_files(out_dir, plan, _layout_units(reader, plan.unit_order),
                            buffers=buffers)
    write_hf_configs(out_dir, model, dtype)
    remove_stale_weights(out_dir, result.files)
    copy_processor_files(directory, out_dir)
    return out_dir


def _meta_model(layout: CheckpointLayout):
    """The checkpoint's transformers model class built on the meta device from its config."""
    import transformers

    layout_path = os.path.join(layout.directory, FILES.LAYOUT)
    config_dict = layout.config
    if not config_dict or not config_dict.get("architectures"):
        raise CheckpointError(f"{layout_path}: no model config with 'architectures' (the model "
                              "was not a transformers PreTrainedModel); read the weights with "
                              "hf_cephalo.engine.checkpoint.read_full_state_dict and save them "
                              "with the model's own code")
    if config_dict.get("auto_map"):
        raise CheckpointError(f"{layout_path}: the config needs remote code (auto_map); export "
                              "never executes code from a checkpoint: read the weights with "
                              "hf_cephalo.engine.checkpoint.read_full_state_dict and save them "
                              "with the model's own code")
    arch = config_dict["architectures"][0]
    model_cls = getattr(transformers, arch, None)
    if model_cls is None or not isinstance(model_cls, type):
        raise CheckpointError(f"{layout_path}: architecture {arch!r} is not a class of the "
                              f"installed transformers {transformers.__version__} (a custom or "
                              "newer class?): read the weights with hf_cephalo.engine.checkpoint."
                              "read_full_state_dict")
    config = model_cls.config_class.from_dict({k: v for k, v in config_dict.items()
                                               if k not in ("transformers_version",)})
    with torch.device("meta"):
        return model_cls(config)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}


def _layout_sources(layout: CheckpointLayout, reader: _ShardReader, model):
    """(saved-tensor sources in the model's state-dict order, distinct parameter elements,
    parameter dtype) of a checkpoint; CheckpointError if its keys are not the model's."""
    unit, rank = next(((u, r) for u, info in enumerate(layout.units)
                       for r, n in enumerate(info["numel_per_rank"]) if n), (0, 0))
    code = reader.open(FILES.shard(rank)).get_slice(f"units.{unit}.param").get_dtype()
    dtype = _SAFETENSORS_DTYPES.get(code, torch.float32)  # one dtype (older checkpoints)

    def dtype_of(info, p) -> torch.dtype:
        if "dtypes" not in info:
            return dtype
        return getattr(torch, info["dtypes"][0 if p["requires_grad"] else 1])

    where = {alias: SavedTensor(u, p["fqn"], tuple(p["shape"]), dtype_of(info, p))
             for u, info in enumerate(layout.units) for p in info["params"]
             for alias in p["aliases"]}
    buffers = set(layout.buffers)
    keys = list(model.state_dict(keep_vars=True))
    missing = [k for k in keys if k not in where and k not in buffers]
    unexpected = sorted((set(where) | buffers) - set(keys))
    if missing or unexpected:
        lora = [k for k in unexpected if ".lora_A." in k]
        if lora and ".lora_A." not in "".join(keys):
            # the fix first: the key lists of a LoRA checkpoint run to hundreds of names
            raise CheckpointError(
                f"{layout.directory} is a LoRA checkpoint ({len(unexpected)} adapter/base keys "
                f"{type(model).__name__} does not have, e.g. {lora[0]}): export merged "
                "weights with --merge-lora (hf_cephalo.engine.peft_merge."
                "export_merged_lora), or save the adapter with trainer.save_model")
        raise CheckpointError(f"{os.path.join(layout.directory, FILES.LAYOUT)}: keys do not "
                              f"match {type(model).__name__}: missing {missing}, unexpected "
                              f"{unexpected}; read the weights with hf_cephalo.engine.checkpoint."
                              "read_full_state_dict")
    meta = model.state_dict(keep_vars=True)
    sources = {k: where[k] if k in where else
               SavedTensor(None, k, tuple(meta[k].shape), meta[k].dtype) for k in keys}
    return sources, sum(int(info["numel"]) for info in layout.units), dtype


def _layout_units(reader: _ShardReader, order: list[int]):
    """Yield ``FullUnit`` per unit index in ``order``, read from the shard files."""
    from .engine import FullUnit

    for u in order:
        info = reader.layout.units[u]
        yield FullUnit(u, _unit_views(info, _read_parts(reader, u)))


def _unit_views(info: dict[str, Any], parts) -> dict[str, torch.Tensor]:
    """Every alias -> a view of the unit's full parts ``(trainable, frozen)``."""
    out: dict[str, torch.Tensor] = {}
    nt = int(info["trainable_numel"])
    for p in info["params"]:
        flat, lo = (parts[0], p["offset"]) if p["requires_grad"] else (parts[1], p["offset"] - nt)
        view = flat[lo:lo + p["numel"]].view(p["shape"])
        out.update((alias, view) for alias in p["aliases"])
    return out
