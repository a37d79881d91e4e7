"""Which checkpoint key feeds which model parameter: transformers' own renames, no hand matching.

[Note: checkpoint keys through transformers' mapping]
A checkpoint's stored names need not be the model's parameter names (renames registered in
transformers' code, legacy names, a missing or extra ``base_model_prefix``, the user's
``key_mapping``). ``checkpoint_key_map`` resolves every key with the functions
``from_pretrained`` itself uses, in its order (``get_model_conversion_mapping``, then
``rename_source_key`` per key), so a checkpoint loads sharded exactly when, and the way,
``from_pretrained`` loads it. A converter that stacks per-expert tensors into one parameter is
resolved into the stored keys of each stacked entry (``MergedKeys``, [Note: merged expert
tensors] in ``merged_keys.py``), which a rank reads range by range; any other converter is
refused (NotImplementedError naming it). The transforms that matched are kept as
``model._weight_conversions``, so saves write the checkpoint's own names again. Examples and the steps in full: docs/checkpoints.md,
"Checkpoint keys through transformers' mapping".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from torch import nn

from .merged_keys import MergedKeys, merge_spec

__all__ = ["KeyMap", "checkpoint_key_map"]


class KeyMap(NamedTuple):
    """How a checkpoint's keys feed a model.

    to_checkpoint: model state-dict key -> the checkpoint key read for it (the first checkpoint
        key, in ``dot_natural_key`` order, that transformers maps onto it).
    unexpected: checkpoint keys that map onto no model key (``from_pretrained`` reports them as
        unexpected and skips them; e.g. a pretraining head).
    merged: model state-dict key -> the stored tensors transformers merges into it (MoE
        experts stored one tensor per expert; ``merged_keys.MergedKeys``).
    """

    to_checkpoint: dict[str, str]
    unexpected: list[str]
    merged: dict[str, MergedKeys] = {}


def checkpoint_key_map(model: nn.Module, checkpoint_keys: Iterable[str], *,
                       key_mapping: Mapping[str, str] | None = None) -> KeyMap:
    """Resolve ``checkpoint_keys`` onto ``model``'s state-dict keys as ``from_pretrained`` does
    (see [Note: checkpoint keys through transformers' mapping]).

    Args:
        model: the model (any device: meta is fine, only its module tree, config and
            state-dict keys are read). A module that is not a transformers ``PreTrainedModel``
            is matched by equal names.
        checkpoint_keys: every key of the checkpoint (all files).
        key_mapping: the user's renames, regex -> replacement, as ``from_pretrained``'s
            ``key_mapping`` (applied before the model's own).
    Returns:
        A ``KeyMap``. Sets ``model._weight_conversions`` to the transforms that matched, as
        ``from_pretrained`` does, so that saving writes the checkpoint's own names.
    Raises:
        NotImplementedError: a checkpoint key that transformers converts other than by stacking
            experts (``merged_keys.merge_spec``): its ranges cannot be read shard by shard.
    """
    from transformers import PreTrainedModel

    model_keys = model.state_dict(keep_vars=True)
    if not isinstance(model, PreTrainedModel):
        if key_mapping:
            raise ValueError(f"key_mapping = {dict(key_mapping)} applies to transformers models "
                             f"only; {type(model).__name__} is not one: rename the checkpoint's "
                             "keys or give the module the checkpoint's names")
        keys = list(checkpoint_keys)
        return KeyMap({k: k for k in keys if k in model_keys},
                      [k for k in keys if k not in model_keys])
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)

    conversions = get_model_conversion_mapping(model, dict(key_mapping) if key_mapping else None)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = model.base_model_prefix
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    to_checkpoint: dict[str, str] = {}
    unexpected: list[str] = []
    stacks: dict[str, dict[str, list[str]]] = {}  # model key -> source pattern -> stored keys
    # dot_natural_key order, as stock: some renamings keep state across keys (GroupWeightRename),
    # and converters stack each pattern's tensors in this order
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix,
                                                 meta_state_dict=model_keys)
        if renamed not in model_keys:
            unexpected.append(key)
        elif pattern is not None:
            stacks.setdefault(renamed, {}).setdefault(pattern, []).append(key)
        else:
            to_checkpoint.setdefault(renamed, key)
    merged = {}
    for renamed, per_pattern in stacks.items():
        converter = by_pattern[next(iter(per_pattern))]
        cat_dim = merge_spec(converter)
        merged[renamed] = MergedKeys(tuple(tuple(per_pattern.get(p, ()))
                                           for p in converter.source_patterns), cat_dim)
    model._weight_conversions = [c for c in conversions if c.was_used()]
    return KeyMap(to_checkpoint, unexpected, merged)
