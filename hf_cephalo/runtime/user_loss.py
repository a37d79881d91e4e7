"""A user's Trainer loss (``compute_loss`` override, ``compute_loss_func``, label smoothing, a
Trainer subclass's own loss such as TRL's) as the engine's head loss.

Stock ``Trainer.compute_loss(model, inputs, num_items_in_batch)`` calls the model and turns its
outputs into a loss. The engine never calls the model: it runs the layers itself and the head
phase asks the adapter for a loss SUM per microbatch (``StagedModel.head_loss``), divided by the
global item count N. ``UserLossStagedModel`` bridges the two: per microbatch it hands the
trainer's ``compute_loss`` a stand-in model (``EngineOutputs``) whose call returns this
microbatch's outputs computed from the head's input — the logits (and the adapter's loss,
normalized by N, when ``labels`` are passed, as an HF model given ``num_items_in_batch`` does),
or what a registered call variant computes instead (TRL's ``fused_lm_head=True``: per-token
log-probabilities without the logits, ``integrations/trl/fused.py``) — with ``num_items_in_batch = N``, and
returns ``loss * N`` as the sum, so the engine's division gives back the user's loss. Nothing
is computed that the loss does not ask for: the logits only when it reads them.

Exactness (see [Note: global item count for user losses] in models/base.py): the step's
gradient equals stock Trainer's full-batch gradient when the user loss is a SUM over items
divided by ``num_items_in_batch`` — then the microbatches' losses add up to the full batch's.
A per-microbatch mean (``loss.mean()``) is not: it weights microbatches of different sizes
equally. Stock Trainer has the same requirement across gradient accumulation steps and ranks.
Collectives and metrics inside the loss: [Note: collectives inside the engine's head] in
``head_calls.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutput

from hf_cephalo.runtime.head_calls import HeadCalls
from hf_cephalo.models.registry import causal_lm_class_names
from hf_cephalo.models.base import (HeadEvalOutput, HeadOutput, Microbatch, StagedModel,
                                    WrappedStagedModel, global_num_items, refuse_global_loss)
from hf_cephalo.runtime.door_models import check_decoder_inputs
from hf_cephalo.models.hf_common import (CausalLMStagedModel, causal_adapter, empty_logits,
                                         is_causal_lm)

__all__ = ["CallVariant", "EngineOutputs", "HeadView", "UserLossStagedModel"]

ComputeLoss = Callable[..., torch.Tensor]
"""``compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None) -> loss``."""

# model-call options with one accepted value each: what the engine's forward always does
_CALL_OPTIONS = {"use_cache": (False, None), "return_dict": (True, None),
                 "output_attentions": (False, None), "output_hidden_states": (False, None)}
# HF model arguments the stand-in reads itself (not inputs to compare with the microbatch);
# output_router_logits: the router loss's value, which the engine computed over the global batch
_LOSS_ARGUMENTS = ("labels", "num_items_in_batch", "shift_labels", "output_router_logits")


class HeadView:
    """One microbatch in the engine's head, as a user loss may use it: ``hidden`` (m, S, H),
    the last unit's output; ``final_hidden()`` through the final norm; ``output_head()`` the
    (V, H) projection; ``logits()`` (m, S, V) or (m, num_labels), computed once, on demand."""

    def __init__(self, staged: StagedModel, hidden: torch.Tensor, microbatch: Microbatch,
                 ctx: Any, logits: torch.Tensor | None = None) -> None:
        self.staged, self.hidden, self.microbatch, self.ctx = staged, hidden, microbatch, ctx
        self._logits = logits

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.staged.head_logits(self.hidden, self.microbatch, self.ctx)
        return self._logits

    def _causal(self, what: str) -> CausalLMStagedModel:
        adapter = causal_adapter(self.staged)
        if adapter is None:
            raise ValueError(f"{what} needs a causal language model; "
                             f"{type(self.staged.model).__name__} is not one")
        return adapter

    def final_hidden(self) -> torch.Tensor:
        """(m, S, H) after the final norm (the backbone's ``last_hidden_state``)."""
        return self._causal("final_hidden").final_hidden(self.hidden, self.microbatch, self.ctx)

    def output_head(self) -> torch.nn.Module:
        return self._causal("output_head").output_head()

    def output_projection(self) -> torch.nn.Module:
        """The projection ``final_hidden()`` feeds, before any logit scaling / softcapping
        (``CausalLMStagedModel.output_projection``)."""
        return self._causal("output_projection").output_projection()


def stock_smoother_shift(model: torch.nn.Module) -> bool:
    """Whether stock Trainer's label smoother shifts the labels for ``model`` (a model, not a
    PEFT wrapper): its class is in transformers' causal-LM mapping, whether or not the model's
    own loss shifts (``BartForCausalLM``'s does not; ``Qwen3_5ForConditionalGeneration``, not
    in the mapping, is not shifted although its loss is)."""
    return type(model).__name__ in causal_lm_class_names()


class CallVariant(Protocol):
    """A model call the stand-in answers differently, selected by a truthy keyword argument
    (e.g. TRL's ``fused_lm_head=True``)."""

    def __call__(self, view: HeadView, inputs: dict[str, Any]) -> Any:
        """This microbatch's outputs from the head (``inputs``: the call's arguments)."""

    def empty(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        """The same outputs for zero rows (the replay of ``head_calls.py``)."""


class EngineOutputs:
    """The model ``compute_loss`` sees: calling it returns the engine's outputs for THIS
    microbatch (``logits``; ``loss`` = the adapter's loss sum / N when ``labels`` are passed;
    or a registered ``CallVariant``'s outputs), or zero-row outputs in the replay (``view``
    None).

    Anything else (``config``, ``training``...) is the real model's attribute. Raises ValueError
    when called twice, with inputs other than the microbatch's, or with an option the engine's
    forward does not honour (``output_hidden_states=True``...): such a loss needs the whole
    model call, which the layered engine cannot reproduce exactly.
    """

    def __init__(self, staged: StagedModel, view: HeadView | None, num_items: int,
                 variants: Mapping[str, CallVariant]) -> None:
        self._staged, self._view, self._num_items = staged, view, num_items
        self._variants, self._calls = variants, 0
        self.cephalo_causal_lm = is_causal_lm(staged)
        self.cephalo_smoother_shift = stock_smoother_shift(staged.model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._staged.model, name)

    def __call__(self, **inputs: Any):
        self._calls += 1
        if self._calls > 1:
            raise ValueError("compute_loss called the model twice for one microbatch: the engine "
                             "runs one forward per microbatch; compute the loss from one call's "
                             "outputs (docs/trainer_support.md)")
        variant = next((v for key, v in self._variants.items() if inputs.pop(key, False)), None)
        for key in [k for k in inputs if k in _CALL_OPTIONS]:
            value = inputs.pop(key)
            if value not in _CALL_OPTIONS[key]:
                raise ValueError(f"compute_loss called the model with {key}={value!r}: the "
                                 f"engine's forward runs with {key}={_CALL_OPTIONS[key][0]!r} "
                                 "and returns the logits only")
        if self._view is not None:
            self._check_inputs(inputs)
            check_decoder_inputs(self._staged, inputs)  # an encoder-decoder called without both
            if inputs.get("output_router_logits") and \
                    self._staged.global_loss_output() is None:
                raise ValueError("compute_loss called the model with output_router_logits=True, "
                                 "but the model adds no router loss (its config's "
                                 "output_router_logits is off, or it has no router): set "
                                 "model.config.output_router_logits = True before the trainer, "
                                 "or do not ask for the router logits")
        if variant is not None:
            return variant(self._view, inputs) if self._view is not None else \
                variant.empty(self._staged.model, inputs)
        return self._default(inputs)

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        microbatch = self._view.microbatch
        for key, value in inputs.items():
            if key in _LOSS_ARGUMENTS:
                continue
            mine = microbatch.get(key)
            same = value is mine or (isinstance(value, torch.Tensor) and
                                     isinstance(mine, torch.Tensor) and
                                     value.shape == mine.shape and torch.equal(value, mine))
            if not same:
                raise ValueError(f"compute_loss called the model with input {key!r} different "
                                 "from the microbatch's: the engine computes the forward from the "
                                 "batch as collated; change the batch in the data collator instead")

    def _default(self, inputs: dict[str, Any]):
        causal = self.cephalo_causal_lm
        cls = CausalLMOutputWithPast if causal else SequenceClassifierOutput
        labels = inputs.get("labels")
        if self._view is None:  # the replay: zero rows
            return cls(loss=None if labels is None else torch.zeros(()),
                       logits=empty_logits(self._staged, inputs))
        logits = self._view.logits()
        loss = None
        if labels is not None:
            out = self._staged.loss_from_logits(logits, {**self._view.microbatch, "labels": labels})
            loss = out.loss_sum / self._num_items
        return cls(loss=loss, logits=logits)


class UserLossStagedModel(WrappedStagedModel):
    """Delegates to ``inner``; the head loss is ``compute_loss(EngineOutputs, microbatch,
    num_items_in_batch=N) * N`` (see the module docstring).

    Args:
        inner: the model's adapter (must offer ``loss_from_logits``: the HF adapters do).
        compute_loss: the trainer's bound ``compute_loss``.
        head_calls: runs each call in the two phases of [Note: collectives inside the engine's
            head] (None: called directly).
        variants: keyword -> ``CallVariant`` the stand-in model answers (e.g. TRL's
            ``fused_lm_head``).
        global_loss_apart: the trainer's loss leaves the model's global-batch term (the MoE
            router loss) to the engine, which adds it once per step with its gradient
            ([Note: global router loss]); its loss only reads the term's value
            (``StagedModel.global_loss_output``, e.g. as ``outputs.aux_loss`` for a metric).
            False (default): such a model is refused (``refuse_global_loss``), since a user
            loss would add the term per microbatch, or not at all.
    Raises:
        ValueError: ``inner`` adds a global-batch term and ``global_loss_apart`` is False.
    """

    def __init__(self, inner: StagedModel, compute_loss: ComputeLoss, *,
                 head_calls: HeadCalls | None = None,
                 variants: Mapping[str, CallVariant] | None = None,
                 count_items: Callable[[Microbatch], int] | None = None,
                 global_loss_apart: bool = False):
        if not global_loss_apart:
            refuse_global_loss(inner, "a custom compute_loss / compute_loss_func")
        super().__init__(inner)
        self.compute_loss = compute_loss
        self.head_calls = head_calls
        self.variants = dict(variants or {})
        self._count_items = count_items

    def count_items(self, microbatch: Microbatch) -> int:
        """The items N the loss is a sum over: ``count_items`` as given (a front end's rule for
        the ``num_items_in_batch`` it hands the loss, e.g. stock Trainer's), else the model's."""
        if self._count_items is not None:
            return self._count_items(microbatch)
        return self.inner.count_items(microbatch)

    def _user_loss(self, view: HeadView) -> HeadOutput:
        num_items = global_num_items()
        if num_items is None:
            raise RuntimeError("UserLossStagedModel.head_loss runs inside the engine's step or "
                               "evaluation only (global_num_items_scope)")
        model = EngineOutputs(self.inner, view, num_items, self.variants)

        def run() -> torch.Tensor:
            loss = self.compute_loss(model, dict(view.microbatch), return_outputs=False,
                                     num_items_in_batch=torch.tensor(num_items,
                                                                     device=view.hidden.device))
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise ValueError(f"compute_loss returned {type(loss).__name__} "
                                 f"{getattr(loss, 'shape', '')}: it must return a 1-element loss "
                                 "tensor")
            return loss.reshape(())

        loss = run() if self.head_calls is None else \
            self.head_calls.call(run, fallback=lambda: view.hidden.sum() * 0)
        return HeadOutput(loss * num_items, self.count_items(view.microbatch))

    def replay(self, inputs: dict[str, Any], num_items: int) -> None:
        """``compute_loss`` once on zero-row ``inputs`` (the step's replay, ``head_calls.py``);
        the loss is discarded."""
        model = EngineOutputs(self.inner, None, num_items, self.variants)
        device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), None)
        self.compute_loss(model, inputs, return_outputs=False,
                          num_items_in_batch=torch.tensor(num_items, device=device))

    def head_loss(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> HeadOutput:
        return self._user_loss(HeadView(self.inner, hidden, microbatch, ctx))

    def head_loss_and_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                             ctx: Any) -> HeadEvalOutput:
        view = HeadView(self.inner, hidden, microbatch, ctx)
        logits = view.logits()
        return HeadEvalOutput(self._user_loss(view), logits)
