"""``hf-cephalo export --merge-lora``: merged full weights from a sharded LoRA checkpoint.

``export_merged_lora`` turns a checkpoint of a LoRA ``PeftModel`` run into what
``peft_model.merge_and_unload().save_pretrained(dir)`` writes, loadable by the base class.

[Note: streamed LoRA merge]
PEFT's own code does every step, one unit at a time, never on the whole model. Names: a META
PeftModel rebuilt from the layout and adapter configs (its keys and shapes must equal the
checkpoint's) and a ``merge_and_unload()``-ed meta copy, mapped by tensor identity. Values: each
LoRA layer's own ``LoraLayer.merge()`` on its unit's tensors. Files: the streamed writer
([Note: streamed save]). So the merge is PEFT's (renames, fan_in_fan_out, rsLoRA, DoRA), and
memory stays one unit + one LoRA layer + one output file; every LoRA tensor must live in its
base layer's unit ([Note: LoRA in the engine] in ``models/peft_lora.py``). Steps in full:
docs/checkpoints.md, "Streamed LoRA merge".
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Iterator

import torch
from torch import nn

from hf_cephalo.engine.checkpoint import (FILES, CheckpointError, CheckpointLayout,
                                          check_export_target, read_layout)
from hf_cephalo.engine.checkpoint.offline import layout_sources, layout_units, meta_model
from hf_cephalo.engine.checkpoint.reader import ShardReader, read_buffers
from hf_cephalo.engine.state_dicts import FullUnit
from hf_cephalo.engine.export import (DEFAULT_MAX_SHARD_SIZE, SavedTensor, copy_processor_files,
                                      parse_max_shard_size, plan_hf_files, remove_stale_weights,
                                      write_hf_configs, write_hf_files)

from hf_cephalo.engine.peft_save import ADAPTER_FILES, check_adapter_matches

__all__ = ["export_merged_lora", "lora_checkpoint_keys"]

_LORA_KEY = re.compile(r"\.lora_[AB]\.([^.]+)\.")


def lora_checkpoint_keys(layout: CheckpointLayout) -> list[str]:
    """The LoRA matrices (``*.lora_A.<adapter>.*`` / ``*.lora_B.<adapter>.*`` parameter names)
    of a checkpoint layout; empty for a checkpoint of a model without LoRA."""
    return [p["fqn"] for info in layout.units for p in info["params"] if _LORA_KEY.search(p["fqn"])]


def export_merged_lora(directory: str, out_dir: str, *, adapter_config: str | None = None,
                       verify: bool = True, overwrite: bool = False,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Write merged full weights of a LoRA checkpoint as a ``from_pretrained`` directory.

    Offline (no process group); see [Note: streamed LoRA merge] for the method and memory.
    Args:
        directory: a sharded checkpoint of a LoRA ``PeftModel`` run.
        out_dir: the model directory to write (checked by ``check_export_target``).
        adapter_config: ``adapter_config.json`` or a directory holding it (e.g. what
            ``trainer.save_model`` wrote); default: the one in ``directory`` (trainer checkpoints
            of a PeftModel carry it). If that directory also holds ``adapter_model.safetensors``
            it must fit the checkpoint's base model (``check_adapter_matches``).
        max_shard_size: as ``export_hf``.
    Returns out_dir.
    Raises:
        CheckpointError (a ValueError): the checkpoint holds no LoRA matrices (export it without
            merging), has several adapters, or no adapter config is found; the adapter config is
            not LoRA, names modules the base model lacks, or gives other keys / shapes than the
            checkpoint's (an adapter of another model or another rank); anything ``export_hf``
            refuses. ValueError: an adapter for another base model, a bad ``max_shard_size``.
    """
    parse_max_shard_size(max_shard_size)
    check_export_target(directory, out_dir, overwrite=overwrite)
    layout = read_layout(directory)
    adapter_name = _adapter_name(layout)
    config_dir, config = _read_lora_config(directory, adapter_config)
    if os.path.isfile(os.path.join(config_dir, ADAPTER_FILES[0])):
        check_adapter_matches(config_dir, meta_model(layout))
    reader = ShardReader(layout, verify)
    peft_inner = _meta_peft(layout, config, adapter_name, config_dir).base_model.model
    peft_sources, total_numel, dtype = _checked_sources(layout, reader, peft_inner, config_dir)
    unloading = _meta_peft(layout, config, adapter_name, config_dir)
    origin = {id(t): k for k, t in unloading.base_model.model.state_dict(keep_vars=True).items()}
    merged = unloading.merge_and_unload()  # PEFT's renames (meta: no data moves)
    sources = {k: peft_sources[origin[id(t)]]
               for k, t in merged.state_dict(keep_vars=True).items()}
    # the merged model's dtype as save_pretrained records it (its first floating parameter):
    # a bf16 base stays bf16 after the merge, whatever the fp32 adapters were
    dtype = next((src.dtype for src in sources.values() if src.dtype.is_floating_point), dtype)
    plan = plan_hf_files(merged, sources, max_shard_size=max_shard_size,
                         total_parameters=total_numel)
    layers = _lora_layers_by_unit(peft_inner, peft_sources)
    buffers = read_buffers(layout, reader)
    os.makedirs(out_dir, exist_ok=True)
    units = _merged_units(layout_units(reader, plan.unit_order), layers, adapter_name)
    result = write_hf_files(out_dir, plan, units, buffers=buffers)
    write_hf_configs(out_dir, merged, dtype)
    remove_stale_weights(out_dir, result.files)
    copy_processor_files(directory, out_dir)
    return out_dir


def _adapter_name(layout: CheckpointLayout) -> str:
    names = sorted({_LORA_KEY.search(k).group(1) for k in lora_checkpoint_keys(layout)})
    path = os.path.join(layout.directory, FILES.LAYOUT)
    if not names:
        raise CheckpointError(f"{path}: the checkpoint holds no LoRA matrices (no *.lora_A.* / "
                              "*.lora_B.* parameters): it is a full model; export it without "
                              "--merge-lora (merge_lora=False)")
    if len(names) > 1:
        raise CheckpointError(f"{path}: LoRA matrices of several adapters {names}; "
                              "--merge-lora merges one adapter")
    return names[0]


def _read_lora_config(directory: str, adapter_config: str | None):
    """(directory of the config, ``LoraConfig``) from ``adapter_config`` or the checkpoint."""
    from peft import LoraConfig

    path = adapter_config if adapter_config is not None else directory
    if os.path.isdir(path):
        path = os.path.join(path, ADAPTER_FILES[1])
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing — the LoRA config (rank, alpha, targets) is needed "
                              "to merge; give --adapter-config DIR (CLI) / adapter_config=DIR: the "
                              "adapter directory trainer.save_model wrote, or a saved LoraConfig")
    with open(path) as f:
        data = json.load(f)
    kind = str(data.get("peft_type"))
    if kind != "LORA":
        raise CheckpointError(f"{path}: peft_type {kind}; --merge-lora merges LoRA adapters only")
    return os.path.dirname(path), LoraConfig.from_pretrained(os.path.dirname(path))


def _meta_peft(layout: CheckpointLayout, config, adapter_name: str, config_dir: str):
    """A ``PeftModel`` of ``config`` around the checkpoint's base model, on the meta device."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(meta_model(layout), copy.deepcopy(config),
                                    adapter_name=adapter_name, low_cpu_mem_usage=True)
    except ValueError as e:  # e.g. target modules that the base model lacks
        raise CheckpointError(f"{config_dir}: the adapter config does not fit the checkpoint's "
                              f"base model ({e}); give the adapter config of this run") from None
    return peft_model


def _checked_sources(layout, reader, peft_inner, config_dir):
    """``layout_sources`` of the meta PeftModel, its shapes checked against the checkpoint."""
    try:
        sources, total_numel, dtype = layout_sources(layout, reader, peft_inner)
    except CheckpointError as e:
        raise CheckpointError(f"{config_dir}: the adapter config gives other keys than the "
                              f"checkpoint's (an adapter of another run?): {e}") from None
    for key, tensor in peft_inner.state_dict(keep_vars=True).items():
        if tuple(tensor.shape) != sources[key].shape:
            raise CheckpointError(
                f"{config_dir}: {key} has shape {tuple(sources[key].shape)} in the checkpoint, "
                f"{tuple(tensor.shape)} under the adapter config (another rank r?); give the "
                "adapter config of this run")
    return sources, total_numel, dtype


def _lora_layers_by_unit(peft_inner: nn.Module, sources: dict[str, SavedTensor]):
    """unit -> [(module name, meta LoRA layer)]; every tensor of a layer in its base's unit."""
    from peft.tuners.lora import LoraLayer

    out: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in peft_inner.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        units = {sources[f"{name}.{k}"].unit for k in module.state_dict()}
        if len(units) != 1:
            raise NotImplementedError(f"LoRA layer {name}: its tensors span units {sorted(units)}"
                                      "; the streamed merge needs them in one unit")
        out.setdefault(units.pop(), []).append((name, module))
    return out


def _merged_units(units: Iterator[FullUnit], layers, adapter_name: str) -> Iterator[FullUnit]:
    """Each unit with its LoRA layers' ``base_layer`` tensors replaced by the merged ones."""
    for unit in units:
        tensors = dict(unit.tensors)
        for name, meta_layer in layers.get(unit.index, ()):
            layer = copy.deepcopy(meta_layer)
            own = {k: tensors[f"{name}.{k}"].clone() for k in layer.state_dict()}
            layer.load_state_dict(own, assign=True)
            with torch.no_grad():
                layer.merge(adapter_names=[adapter_name])
            for key, value in layer.get_base_layer().state_dict().items():
                tensors[f"{name}.base_layer.{key}"] = value
        yield FullUnit(unit.index, tensors)
