"""Adapters for Llama-shaped decoders: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
their ``*ForSequenceClassification`` heads.

Layout (transformers 5.x): ``model.model.embed_tokens`` -> ``model.model.layers[i]`` ->
``model.model.norm`` -> ``model.lm_head`` (causal LM) or ``model.score`` (sequence
classification, ``GenericForSequenceClassification`` in transformers/modeling_layers.py); rotary
cos/sin come from ``model.model.rotary_emb`` (no parameters). Both heads share one decoder body
(``LlamaDecoderBody``). Embedding unit: embed_tokens, rotary_emb (buffers only); head unit: norm,
lm_head or score (with ``tie_word_embeddings=True`` the shared weight lives once, in the
embedding unit).

Masks: one per attention type, built like the model's forward builds them — Llama:
``create_causal_mask``; Mistral: ``create_sliding_window_causal_mask`` when
``config.sliding_window`` is set; Qwen2: one mask per entry of ``config.layer_types``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import (CAUSAL_MASK_BUILDERS, FULL, SLIDING, CausalLMStagedModel,
                                         DecoderContext, HFStagedModel,
                                         LastTokenClassifierStagedModel, build_causal_masks,
                                         microbatch_position_ids, require_key, rotary_cos_sin)


class LlamaDecoderBody(HFStagedModel):
    """The decoder body of the Llama / Mistral / Qwen2 adapters (``model.model``, a
    ``LlamaModel`` / ``MistralModel`` / ``Qwen2Model``): units, embedding, masks, rotary cos/sin.
    The head (and with it the loss) is the subclass's.

    Microbatch keys: ``input_ids`` (m, S) int64 (required), ``attention_mask`` (m, S) 0/1
    (optional; padding, left or right), ``position_ids`` (m, S) (optional; packed sequences
    restart at 0 and get a block-diagonal causal mask).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        config = model.config
        self._layer_types = [self._layer_type(config, i) for i in range(self.num_units)]
        unknown = sorted(set(self._layer_types) - CAUSAL_MASK_BUILDERS.keys())
        if unknown:
            raise ValueError(f"{type(model).__name__}: config.layer_types contains {unknown}; "
                             f"this adapter supports {sorted(CAUSAL_MASK_BUILDERS)}; another "
                             "attention type needs its own adapter (docs/adding_a_model.md).")

    @staticmethod
    def _layer_type(config: Any, index: int) -> str:
        layer_types = getattr(config, "layer_types", None)
        if layer_types:  # Qwen2 (and Llama variants that declare per-layer attention types)
            return layer_types[index]
        if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
            return SLIDING  # MistralModel.forward uses one sliding-window mask for every layer
        return FULL

    # ---- structure ----
    def units(self) -> list[nn.Module]:
        return list(self.model.model.layers[: self.model.config.num_hidden_layers])

    def embed_modules(self) -> list[nn.Module]:
        inner = self.model.model
        return [inner.embed_tokens, inner.rotary_emb]

    # ---- computation ----
    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, DecoderContext]:
        """input_ids (m, S) -> hidden (m, S, H) and the microbatch's masks and rotary cos/sin."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        position_ids = microbatch_position_ids(microbatch, input_ids)
        masks = build_causal_masks(self.model.config, self._layer_types, hidden,
                                   microbatch.get("attention_mask"), position_ids)
        cos_sin = rotary_cos_sin(inner.rotary_emb, hidden, position_ids)
        return hidden, DecoderContext(masks, position_ids, cos_sin)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: DecoderContext) -> torch.Tensor:
        """Decoder layer ``index``: (m, S, H) -> (m, S, H)."""
        layer = self.model.model.layers[index]
        return layer(hidden, attention_mask=ctx.masks[self._layer_types[index]],
                     position_embeddings=ctx.position_embeddings,
                     position_ids=ctx.position_ids, use_cache=False)


class LlamaStagedModel(LlamaDecoderBody, CausalLMStagedModel):
    """Llama / Mistral / Qwen2 causal LM as a staged model.

    Microbatch keys: those of ``LlamaDecoderBody`` and ``labels`` (m, S) with -100 ignored
    (required for the loss; ``labels = input_ids`` style, shifted inside ``head_loss`` as the
    model does).
    """

    model_classes = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.norm, self.model.lm_head]

    def final_hidden(self, hidden: torch.Tensor, microbatch: Microbatch,
                     ctx: DecoderContext) -> torch.Tensor:
        """Final RMSNorm: (m, S, H) -> (m, S, H) (logits = lm_head of it, ``head_logits``)."""
        return self.model.model.norm(hidden)

    def output_head(self) -> nn.Module:
        return self.model.lm_head


class LlamaSequenceClassifierStagedModel(LlamaDecoderBody, LastTokenClassifierStagedModel):
    """Llama / Mistral / Qwen2 sequence classifier (reward models, classifiers on a decoder) as a
    staged model: the decoder body, then ``norm`` -> ``score`` on every position, pooled at each
    row's last non-pad token (``pool_last_non_pad``, as the model's forward).

    Microbatch keys: those of ``LlamaDecoderBody`` (``input_ids`` also gives the pooled
    position: the rightmost token != ``config.pad_token_id``) and ``labels``: (m,) int64 class
    ids (-100 ignored) or float targets for regression / multi-label (``problem_type``).
    Items = samples (label elements for regression / multi-label).
    """

    model_classes = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                     "Qwen2ForSequenceClassification")

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.norm, self.model.score]

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm + score: (m, S, H) -> (m, S, num_labels)."""
        return self.model.score(self.model.model.norm(hidden))
