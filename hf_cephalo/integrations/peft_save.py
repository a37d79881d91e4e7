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

__all__ = ["save_peft_adapter", "ADAPTER_FILES", "check_adapter_matches"]

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
