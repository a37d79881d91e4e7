"""The model object a user passed to CephaloTrainer: guarded while sharded, restorable.

[Note: the user's model while sharded]
The engine shards the model's parameters: while a unit is not in use its module parameter
entries are empty (0,) placeholders (``engine/flat_param.py``), so the model object the user
holds (and ``trainer.model``) is hollow between and after steps. Calling it, or
``save_pretrained`` without an explicit ``state_dict``, would fail obscurely or silently write
empty tensors. ``guard_sharded_model`` makes both raise a RuntimeError that names the fixes:
``trainer.save_model(dir)`` (collective; rank 0 writes a ``from_pretrained`` checkpoint) or
``trainer.unshard_model()`` (collective; full copies of the weights on every rank, after which
the model works like a stock Trainer's). The guard tests the parameter count at each call, so
it follows the engine: a model restored by ``restore_full_model`` works until the engine's
next step or evaluation re-shards it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..models.base import in_staged_call

__all__ = ["SHARDED_MODEL_MESSAGE", "guard_sharded_model", "is_sharded", "restore_full_model"]

SHARDED_MODEL_MESSAGE = (
    "this model's parameters are sharded across ranks by hf_cephalo (its local tensors are "
    "empty placeholders): save it with trainer.save_model(output_dir) or, in an Accelerate loop, "
    "accelerator.save_model(model, output_dir) (every rank calls it; rank 0 writes a "
    "from_pretrained checkpoint); get full weights back into this object with "
    "trainer.unshard_model() (every rank) or accelerator.get_state_dict(model); to generate, "
    "call generate on the trainer or on the prepared model instead (collective; "
    "docs/generation.md)")


def is_sharded(model: nn.Module, full_numel: int) -> bool:
    """True when the model's parameter entries hold fewer than ``full_numel`` elements."""
    return sum(p.numel() for p in model.parameters()) != full_numel


def guard_sharded_model(model: nn.Module, full_numel: int) -> None:
    """Make ``model(...)`` and ``model.save_pretrained(dir)`` (without ``state_dict``) raise
    RuntimeError(``SHARDED_MODEL_MESSAGE``) while ``is_sharded``. Idempotent."""
    if getattr(model, "_cephalo_guarded", False):
        return

    def forward_pre_hook(module, args, kwargs):
        if not in_staged_call() and is_sharded(module, full_numel):
            raise RuntimeError(f"{type(module).__name__}.forward: {SHARDED_MODEL_MESSAGE}")

    model.register_forward_pre_hook(forward_pre_hook, with_kwargs=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is not None:
        @functools.wraps(save_pretrained)
        def guarded_save_pretrained(*args, **kwargs):
            if kwargs.get("state_dict") is None and is_sharded(model, full_numel):
                raise RuntimeError(f"save_pretrained: {SHARDED_MODEL_MESSAGE}")
            return save_pretrained(*args, **kwargs)

        model.save_pretrained = guarded_save_pretrained
    model._cephalo_guarded = True


@torch.no_grad()
def restore_full_model(engine) -> None:
    """Collective: every rank's model gets full copies (own storage, ``nn.Parameter`` with the
    original ``requires_grad``; tied weights stay one parameter) of the engine's current
    weights. The engine's shards are unchanged."""
    engine.check_usable("unshard_model")
    for unit in engine.all_units():
        full = unit.gather_full()
        for info, uses, view in zip(unit.infos, unit.uses, unit.param_views(full)):
            piece = view.clone()
            param = nn.Parameter(piece, requires_grad=info.requires_grad)
            for module, attr in uses:
                module._parameters[attr] = param
