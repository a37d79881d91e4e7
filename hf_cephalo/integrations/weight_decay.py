"""Weight decay by parameter name over flat shards, exactly as stock Trainer applies it.

Stock ``Trainer.create_optimizer`` builds two parameter groups: the names from
``get_decay_parameter_names`` (weights) with ``weight_decay`` and the rest (biases, LayerNorm /
RMSNorm scales) with 0. A flat shard mixes both kinds, so CephaloTrainer gives the optimizer
its shards with ``weight_decay = 0`` and applies the decay itself, per element, in a step
pre-hook (``ShardWeightDecay``), with the optimizer's own formula:

- decoupled (AdamW, or ``decoupled_weight_decay=True``): ``p *= 1 - lr * wd`` before the update
  (what ``torch.optim.AdamW`` does first in its step);
- coupled L2 (SGD, Adam, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD): ``grad += wd * p``
  before the update (what those optimizers do first in their step).

The mask is computed from names and the shard layout, so it is rebuilt for any plan: optimizer
state checkpoints are unchanged (one parameter group, ``weight_decay = 0``) and still reshard
onto other plans (docs/checkpoints.md).
"""

from __future__ import annotations

import enum
from typing import Any, Iterable

import torch

from hf_cephalo.engine.flat_param import split_unit_row

__all__ = ["DecayRule", "decay_rule", "shard_decay_masks", "ShardWeightDecay"]

_COUPLED = (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad, torch.optim.RMSprop,
            torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD)


class DecayRule(enum.Enum):
    DECOUPLED = "decoupled"  # p *= 1 - lr * wd
    COUPLED = "coupled"      # grad += wd * p


def decay_rule(optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> DecayRule:
    """How ``optimizer_cls`` applies ``weight_decay``.

    Raises ValueError for an optimizer whose rule is not known (its decay cannot be restricted
    to the stock decay parameters over flat shards): the message names the optimizer and the
    supported ones.
    """
    if issubclass(optimizer_cls, torch.optim.AdamW) or optimizer_kwargs.get("decoupled_weight_decay"):
        return DecayRule.DECOUPLED
    if issubclass(optimizer_cls, _COUPLED):
        return DecayRule.COUPLED
    raise ValueError(
        f"weight_decay > 0 with optimizer {optimizer_cls.__name__}: CephaloTrainer applies the "
        "decay per element of the flat shards (biases and norms excluded, as stock Trainer) and "
        "knows the rule of torch's AdamW (decoupled) and SGD/Adam/Adagrad/RMSprop/Adamax/NAdam/"
        "RAdam/ASGD (coupled L2); use one of those (e.g. --optim adamw_torch) or weight_decay=0")


def shard_decay_masks(shard_metadata, rank: int, decay_names: Iterable[str]) -> list[torch.Tensor]:
    """One bool mask per trainable shard (``engine.parameters()`` order): True where the element
    belongs to a parameter named in ``decay_names`` (its first name, as ``named_parameters``).

    shard_metadata: ``engine.shard_metadata()`` (per unit: per-rank numel, trainable count,
    parameter offsets); rank: this rank. Masks are CPU tensors of the shards' lengths.
    """
    decay = set(decay_names)
    masks = []
    for meta in shard_metadata:
        # this rank's trainable shard ([Note: two parts per unit] in engine/flat_param.py)
        counts, _ = split_unit_row(meta.numel_per_rank, meta.trainable_numel)
        start, local = sum(counts[:rank]), counts[rank]
        mask = torch.zeros(local, dtype=torch.bool)
        for info in meta.params:
            if info.requires_grad and info.fqn in decay:
                lo, hi = max(info.offset, start), min(info.offset + info.numel, start + local)
                if lo < hi:
                    mask[lo - start:hi - start] = True
        masks.append(mask)
    return masks


class ShardWeightDecay:
    """Optimizer step pre-hook applying ``weight_decay`` where ``masks`` is True (see module).

    Register with ``optimizer.register_step_pre_hook(ShardWeightDecay(...))``; the optimizer's
    own groups carry ``weight_decay = 0``. ``lr`` is read from each parameter's group at every
    step (schedulers change it).
    """

    def __init__(self, params: list[torch.Tensor], masks: list[torch.Tensor], weight_decay: float,
                 rule: DecayRule):
        self.set_masks(params, masks)
        self.weight_decay, self.rule = float(weight_decay), rule

    def set_masks(self, params: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        """Use ``masks`` (one bool mask per shard, ``shard_decay_masks``) for ``params`` from
        now on: after an in-memory re-layout the shards keep their identity but not their
        elements (``engine/relayout.py``)."""
        if len(params) != len(masks):
            raise ValueError(f"{len(params)} shards but {len(masks)} decay masks")
        self.masks = {id(p): m.to(p.device) for p, m in zip(params, masks)}

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        wd = self.weight_decay
        for group in optimizer.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                mask = self.masks.get(id(p))
                if mask is None or p.grad is None or not bool(mask.any()):
                    continue
                if self.rule is DecayRule.DECOUPLED:
                    p.copy_(torch.where(mask, p.mul(1 - lr * wd), p))
                else:
                    p.grad.copy_(torch.where(mask, p.grad.add(p, alpha=wd), p.grad))
