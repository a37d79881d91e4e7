"""A user's Trainer loss (``compute_loss`` override, ``compute_loss_func``, label smoothing) as
the engine's head loss.

Stock ``Trainer.compute_loss(model, inputs, num_items_in_batch)`` calls the model and turns its
outputs into a loss. The engine never calls the model: it runs the layers itself and the head
phase asks the adapter for a loss SUM per microbatch (``StagedModel.head_loss``), divided by the
global item count N. ``UserLossStagedModel`` bridges the two: per microbatch it computes the
head's logits, hands the trainer's ``compute_loss`` a stand-in model (``EngineOutputs``) whose
call returns those logits (and the adapter's loss, normalized by N, when ``labels`` are passed,
as an HF model given ``num_items_in_batch`` does), with ``num_items_in_batch = N`` — and returns
``loss * N`` as the sum, so the engine's division gives back the user's loss.

Exactness (see [Note: global item count for user losses] in models/base.py): the step's
gradient equals stock Trainer's full-batch gradient when the user loss is a SUM over items
divided by ``num_items_in_batch`` — then the microbatches' losses add up to the full batch's.
A per-microbatch mean (``loss.mean()``) is not: it weights microbatches of different sizes
equally. Stock Trainer has the same requirement across gradient accumulation steps and ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutput

from hf_cephalo.models.base import (HeadEvalOutput, HeadOutput, Microbatch, StagedModel,
                                    WrappedStagedModel, global_num_items)
from hf_cephalo.models.hf_common import CausalLMStagedModel

__all__ = ["EngineOutputs", "UserLossStagedModel"]

ComputeLoss = Callable[..., torch.Tensor]
"""``compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None) -> loss``."""


def _causal(staged: StagedModel) -> bool:
    inner = staged
    while not isinstance(inner, CausalLMStagedModel) and hasattr(inner, "inner"):
        inner = inner.inner
    return isinstance(inner, CausalLMStagedModel)


class EngineOutputs:
    """The model ``compute_loss`` sees: calling it returns the engine's outputs for THIS
    microbatch (``logits``; ``loss`` = the adapter's loss sum / N when ``labels`` are passed).

    Anything else (``config``, ``training``...) is the real model's attribute. Raises ValueError
    when called twice or with inputs other than the microbatch's (such a loss needs the whole
    model call, which the layered engine cannot reproduce exactly).
    """

    def __init__(self, staged: StagedModel, logits: torch.Tensor, microbatch: Microbatch,
                 num_items: int, causal: bool):
        self._staged, self._logits, self._mb = staged, logits, microbatch
        self._num_items, self._causal, self._calls = num_items, causal, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._staged.model, name)

    def __call__(self, **inputs: Any):
        self._calls += 1
        if self._calls > 1:
            raise ValueError("compute_loss called the model twice for one microbatch: the engine "
                             "runs one forward per microbatch; compute the loss from one call's "
                             "outputs (docs/trainer_support.md)")
        for key, value in inputs.items():
            if key in ("labels", "num_items_in_batch", "return_dict"):
                continue
            mine = self._mb.get(key)
            if not (value is mine or (isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor)
                                      and value.shape == mine.shape and torch.equal(value, mine))):
                raise ValueError(f"compute_loss called the model with input {key!r} different from "
                                 "the microbatch's: the engine computes the forward from the "
                                 "batch as collated; change the batch in the data collator instead")
        loss = None
        labels = inputs.get("labels")
        if labels is not None:
            out = self._staged.loss_from_logits(self._logits, {**self._mb, "labels": labels})
            loss = out.loss_sum / self._num_items
        cls = CausalLMOutputWithPast if self._causal else SequenceClassifierOutput
        return cls(loss=loss, logits=self._logits)


class UserLossStagedModel(WrappedStagedModel):
    """Delegates to ``inner``; the head loss is ``compute_loss(EngineOutputs, microbatch,
    num_items_in_batch=N) * N`` (see the module docstring).

    Args:
        inner: the model's adapter (must offer ``loss_from_logits``: the HF adapters do).
        compute_loss: the trainer's bound ``compute_loss``.
    """

    def __init__(self, inner: StagedModel, compute_loss: ComputeLoss):
        super().__init__(inner)
        self.compute_loss = compute_loss
        self.causal = _causal(inner)

    def _user_loss(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        num_items = global_num_items()
        if num_items is None:
            raise RuntimeError("UserLossStagedModel.head_loss runs inside the engine's step or "
                               "evaluation only (global_num_items_scope)")
        count = torch.tensor(num_items, device=logits.device)
        model = EngineOutputs(self.inner, logits, microbatch, num_items, self.causal)
        loss = self.compute_loss(model, dict(microbatch), return_outputs=False,
                                 num_items_in_batch=count)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError(f"compute_loss returned {type(loss).__name__} "
                             f"{getattr(loss, 'shape', '')}: it must return a 1-element loss tensor")
        return HeadOutput(loss.reshape(()) * num_items, self.inner.count_items(microbatch))

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        return self._user_loss(self.head_logits(hidden, microbatch, ctx), microbatch)

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        logits = self.head_logits(hidden, microbatch, ctx)
        return HeadEvalOutput(self._user_loss(logits, microbatch), logits)
