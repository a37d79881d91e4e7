"""Saving a LoRA ``PeftModel`` trained by the engine: the adapter in PEFT's own format.

``save_peft_adapter`` gathers only the trainable tensors (``engine.trainable_state_dict``: the
LoRA matrices and any ``modules_to_save`` copies; the frozen base never travels) and hands them
to PEFT's own ``PeftModel.save_pretrained(dir, state_dict=...)``, which picks the adapter keys
(``get_peft_model_state_dict``), renames them as PEFT does (``...lora_A.weight``, the adapter
name dropped) and writes ``adapter_model.safetensors`` + ``adapter_config.json``: the directory
loads with ``PeftModel.from_pretrained(base_model, dir)``. Merged full weights come from a
checkpoint through ``peft_merge.export_merged_lora`` (``hf-cephalo export --merge-lora``), which
also runs ``check_adapter_matches`` on an adapter directory given as its config.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from hf_cephalo.file_modes import apply_default_mode

__all__ = ["save_peft_adapter", "load_peft_adapter", "ADAPTER_FILES", "check_adapter_matches"]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def save_peft_adapter(engine, peft_model: nn.Module, out_dir: str) -> list[str] | None:
    """Collective (every rank): write the adapter of ``peft_model`` (the PeftModel the engine
    trains, hollow while sharded) into ``out_dir`` from rank 0.

    Returns the written file names on rank 0, None elsewhere. Bytes gathered: 4 x trainable
    elements (fp32), nothing of the frozen base.
    """
    trainable = engine.trainable_state_dict()  # collective
    if engine.rank != 0:
        return None
    prefix = "base_model.model."
    state_dict = {prefix + name: value for name, value in trainable.items()}
    os.makedirs(out_dir, exist_ok=True)
    # PEFT's own writer: key renaming, embedding-layer policy and config as peft writes them
    peft_model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    written = [f for f in ADAPTER_FILES if os.path.isfile(os.path.join(out_dir, f))]
    for name in written:  # safetensors writes 0o600: [Note: file modes]
        apply_default_mode(os.path.join(out_dir, name))
    return written


def check_adapter_matches(adapter_dir: str, base_model: nn.Module) -> None:
    """Raise ValueError when the adapter in ``adapter_dir`` was not trained on ``base_model``'s
    architecture: a LoRA key whose module is not in the base model, or a LoRA matrix whose
    shape does not fit the base module's (in, out) features. Reads only the adapter files.
    """
    from safetensors import safe_open

    config_path = os.path.join(adapter_dir, ADAPTER_FILES[1])
    if not os.path.isfile(config_path):
        raise ValueError(f"{adapter_dir}: no {ADAPTER_FILES[1]} (not a PEFT adapter directory; "
                         "save one with trainer.save_model on a PeftModel)")
    with open(config_path) as f:
        base_name = json.load(f).get("base_model_name_or_path")
    modules = dict(base_model.named_modules())
    with safe_open(os.path.join(adapter_dir, ADAPTER_FILES[0]), framework="pt") as f:
        for key in f.keys():
            if ".lora_A." not in key and ".lora_B." not in key:
                continue
            module_name = key.removeprefix("base_model.model.").split(".lora_")[0]
            target = modules.get(module_name)
            shape = f.get_slice(key).get_shape()
            fits = target is not None and hasattr(target, "in_features") and (
                shape[1] == target.in_features if ".lora_A." in key else
                shape[0] == target.out_features)
            if not fits:
                have = "no such module" if target is None else \
                    f"{type(target).__name__}{tuple(getattr(target, 'weight', torch.empty(0)).shape)}"
                raise ValueError(
                    f"{adapter_dir}: adapter tensor {key} {tuple(shape)} does not fit the base "
                    f"model {type(base_model).__name__} ({module_name}: {have}); the adapter was "
                    f"trained on {base_name or 'another base model'}: load that base model")


def load_peft_adapter(engine, peft_model: nn.Module, adapter_dir: str) -> None:
    """Read the adapter in ``adapter_dir`` (``adapter_model.safetensors``, as ``save_peft_adapter``
    or PEFT's ``save_pretrained`` write it) into the engine's TRAINABLE shards (the LoRA matrices
    and ``modules_to_save`` copies), on any plan; the frozen base keeps its values, as
    ``PeftModel.from_pretrained(base, dir)`` keeps the base it is given.

    No collective: each rank reads only the elements of its own shards. The file key of each
    trainable parameter is the one PEFT's own ``get_peft_model_state_dict`` gives it (the writer's
    renaming, run over one placeholder tensor per parameter), so no names are matched by hand.
    Everything is checked before the first value is copied.

    Raises:
        ValueError: the adapter file is missing, lacks a trainable parameter, or stores another
            shape (a different LoRA rank or targets): names the key and the file.
    """
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    from hf_cephalo.engine.checkpoint_files import read_range

    path = os.path.join(adapter_dir, ADAPTER_FILES[0])
    if not os.path.isfile(path):
        raise ValueError(f"{path}: missing — the LoRA adapter weights; give a directory written "
                         "by trainer.save_model (or PeftModel.save_pretrained)")
    units = engine.all_units()
    infos = [info for unit in units for info in unit.infos if info.requires_grad]
    prefix = "base_model.model."  # the PeftModel's names of the engine's (inner model's) names
    probes = {info.fqn: torch.empty(0) for info in infos}
    renamed = get_peft_model_state_dict(peft_model, adapter_name=peft_model.active_adapter,
                                        state_dict={prefix + k: v for k, v in probes.items()})
    key_of = {id(value): key for key, value in renamed.items()}
    with safe_open(path, framework="pt") as f:
        stored = set(f.keys())
        keys = {}
        for info in infos:
            key = key_of.get(id(probes[info.fqn]))
            if key is None or key not in stored:
                raise ValueError(f"{path}: no tensor for the trainable parameter {info.fqn} "
                                 f"(PEFT's key {key!r}): an adapter of another LoRA setup; load "
                                 "the adapter this model was configured for")
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(info.shape):
                raise ValueError(f"{path}: {key} has shape {shape}, the model's {info.fqn} "
                                 f"{tuple(info.shape)}: an adapter of another LoRA rank or base "
                                 "model")
            keys[info.fqn] = key
        with torch.no_grad():
            for unit in units:
                for start, stop, local in unit.local_segments():
                    for info in unit.infos:
                        lo, hi = max(start, info.offset), min(stop, info.offset + info.numel)
                        if info.requires_grad and lo < hi:
                            local[lo - start:hi - start].copy_(read_range(
                                f, keys[info.fqn], tuple(info.shape), lo - info.offset,
                                hi - info.offset, local.dtype))
