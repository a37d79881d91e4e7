"""Offline use of a sharded checkpoint (no process group): a full state dict, a Hugging Face export.

``read_full_state_dict`` merges the shards into ``model.state_dict()``'s keys;
``export_hf`` streams them, one unit at a time, into the files ``save_pretrained`` writes
(``engine/export.py``), after ``check_export_target``. ``meta_model``, ``layout_sources`` and
``layout_units`` are shared with the LoRA merge (``engine/peft_merge.py``). Both checkpoint
formats are read: merging goes by parameter offsets.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint_files import CheckpointError
from ..export import (DEFAULT_MAX_SHARD_SIZE, PROCESSOR_FILES, SavedTensor, copy_processor_files,
                      parse_max_shard_size, plan_hf_files, remove_stale_weights, write_hf_configs,
                      write_hf_files)
from .layout import FILES, CheckpointLayout
from .reader import ShardReader, read_buffers, read_layout, read_parts, unit_views

__all__ = ["read_full_state_dict", "check_export_target", "export_hf", "meta_model",
           "layout_sources", "layout_units"]


def read_full_state_dict(directory: str, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Merge a sharded checkpoint into the model's full state dict (no process group).

    Returns ``model.state_dict()``'s keys (CPU tensors; tied aliases share one tensor).
    Raises CheckpointError as ``load_sharded``.
    """
    layout = read_layout(directory)
    reader = ShardReader(layout, verify)
    out: dict[str, torch.Tensor] = {}
    for u, info in enumerate(layout.units):
        copies: dict[int, torch.Tensor] = {}  # tied aliases share one tensor
        for alias, view in unit_views(info, read_parts(reader, u)).items():
            out[alias] = copies.setdefault(id(view), view.clone())
    out.update(read_buffers(layout, reader))
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
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> str:
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
    model = meta_model(layout)
    reader = ShardReader(layout, verify)
    sources, total_numel, dtype = layout_sources(layout, reader, model)
    plan = plan_hf_files(model, sources, max_shard_size=max_shard_size,
                         total_parameters=total_numel)
    buffers = read_buffers(layout, reader)
    os.makedirs(out_dir, exist_ok=True)
    result = write_hf_files(out_dir, plan, layout_units(reader, plan.unit_order),
                            buffers=buffers)
    write_hf_configs(out_dir, model, dtype)
    remove_stale_weights(out_dir, result.files)
    copy_processor_files(directory, out_dir)
    return out_dir


def meta_model(layout: CheckpointLayout):
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


def layout_sources(layout: CheckpointLayout, reader: ShardReader, model):
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


def layout_units(reader: ShardReader, order: list[int]):
    """Yield ``FullUnit`` per unit index in ``order``, read from the shard files."""
    from ..state_dicts import FullUnit

    for u in order:
        info = reader.layout.units[u]
        yield FullUnit(u, unit_views(info, read_parts(reader, u)))
