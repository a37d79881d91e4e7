"""Stock Trainer's ``num_items_in_batch``: the N a causal LM's summed loss is divided by.

[Note: stock's item count follows the loss type]
Stock ``Trainer`` counts ``num_items_in_batch`` over ``labels[..., 1:]`` (the tokens a causal
LM's shifted loss scores) only when the model's ``loss_type`` resolves to ``ForCausalLMLoss``
in transformers' ``LOSS_MAPPING`` and the model is not an encoder-decoder
(``Trainer._loss_shifts_labels``); otherwise over every label != -100. ``loss_type`` comes from
the CLASS NAME (``PreTrainedModel.__init__``: the name itself, else the first ``LOSS_MAPPING``
key it contains), so ``GPT2LMHeadModel`` and a user subclass ``HalfMLPQwen3(Qwen3ForCausalLM)``
get None, while ``loss_function`` still computes the shifted causal-LM loss: stock divides
that sum by one label per row more than it scores. The count is handed to the model only when
it takes loss keyword arguments (``accepts_loss_kwargs``, else a ``**kwargs`` forward), and to
``compute_loss_func``. The engine's N follows the same rule (``stock_item_count``), so logged
loss, gradient (norm) and eval loss equal stock's for every class.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from hf_cephalo.models.base import Microbatch, StagedModel, WrappedStagedModel

__all__ = ["stock_count_shifts", "accepts_loss_kwargs", "label_count", "stock_item_count",
           "ItemCountStagedModel"]


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a PEFT wrapper (stock reads the base model's loss type)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def stock_count_shifts(model: torch.nn.Module) -> bool:
    """Whether stock Trainer counts ``num_items_in_batch`` over ``labels[..., 1:]`` for
    ``model``: its ``loss_type`` maps to ``ForCausalLMLoss`` and it is not an encoder-decoder
    ([Note: stock's item count follows the loss type])."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    base = _base(model)
    return (LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss
            and not getattr(getattr(base, "config", None), "is_encoder_decoder", False))


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether stock Trainer hands ``model`` its ``num_items_in_batch``: the model's
    ``accepts_loss_kwargs``, else whether its forward takes ``**kwargs``."""
    base = _base(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def label_count(shift: bool) -> Callable[[Microbatch], int]:
    """A microbatch's items as stock counts them: its ``shift_labels`` where the collator made
    them, else the labels != -100 (``labels[..., 1:]`` with ``shift``); 0 without labels."""
    def count(microbatch: Microbatch) -> int:
        labels = microbatch.get("shift_labels")
        if labels is None:
            labels = microbatch.get("labels")
            if labels is None:
                return 0
            labels = labels[..., 1:] if shift else labels
        return int(labels.ne(-100).sum().item())
    return count


def stock_item_count(model: torch.nn.Module,
                     staged: StagedModel) -> Callable[[Microbatch], int] | None:
    """The count stock Trainer divides ``model``'s own causal-LM loss by, where it differs from
    the staged model's (every label where its loss type is not the causal LM's and the model
    takes the count); None where they agree (the staged model's own count stands)."""
    from hf_cephalo.models.hf_common import is_causal_lm

    if not is_causal_lm(staged) or not getattr(staged, "label_shift", True):
        return None
    if stock_count_shifts(model) or not accepts_loss_kwargs(model):
        return None
    return label_count(shift=False)


class ItemCountStagedModel(WrappedStagedModel):
    """``inner`` with another item count N (a front end's rule, e.g. stock Trainer's:
    ``stock_item_count``); every other call is ``inner``'s. The inner count still runs first,
    so a microbatch it refuses is refused as before (before any collective)."""

    def __init__(self, inner: StagedModel, count_items: Callable[[Microbatch], int]):
        super().__init__(inner)
        self._count_items = count_items

    def count_items(self, microbatch: Microbatch) -> int:
        self.inner.count_items(microbatch)
        return self._count_items(microbatch)
