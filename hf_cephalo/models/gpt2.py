"""Adapter for GPT2LMHeadModel.

Layout (transformers 5.x): ``transformer.wte`` + ``transformer.wpe`` (learned positions) ->
``transformer.drop`` -> ``transformer.h[i]`` -> ``transformer.ln_f`` -> ``lm_head``. The head
weight is tied to ``wte`` by default: the embedding unit holds that one storage (the head unit
keeps ``ln_f``), so its gradient is the sum of the embedding use and the head use, exactly as in
the model.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import (FULL, CausalLMStagedModel, DecoderContext,
                                         build_causal_masks, microbatch_position_ids, require_key)


class GPT2StagedModel(CausalLMStagedModel):
    """GPT-2 causal LM as a staged model.

    Microbatch keys: ``input_ids`` (m, S) (required), ``attention_mask`` (m, S), ``position_ids``
    (m, S) (packed sequences), ``token_type_ids`` (m, S) (embedded with ``wte`` like the model
    does), ``labels`` (m, S) with -100 ignored (shifted inside ``head_loss``). With
    ``add_cross_attention=True`` the cross-attention weights get no encoder states and hence no
    gradient, as in the model's own forward without ``encoder_hidden_states``.
    """

    model_classes = ("GPT2LMHeadModel",)

    def units(self) -> list[nn.Module]:
        return list(self.model.transformer.h)

    def embed_modules(self) -> list[nn.Module]:
        t = self.model.transformer
        return [t.wte, t.wpe]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.transformer.ln_f, self.model.lm_head]

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, DecoderContext]:
        """input_ids (m, S) -> token + position (+ token type) embeddings (m, S, H), dropout."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        t = self.model.transformer
        inputs_embeds = t.wte(input_ids)
        position_ids = microbatch_position_ids(microbatch, input_ids)
        hidden = inputs_embeds + t.wpe(position_ids)
        masks = build_causal_masks(self.model.config, [FULL], inputs_embeds,
                                   microbatch.get("attention_mask"), position_ids)
        token_type_ids = microbatch.get("token_type_ids")
        if token_type_ids is not None:
            hidden = hidden + t.wte(token_type_ids)
        return t.drop(hidden), DecoderContext(masks, position_ids)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: DecoderContext) -> torch.Tensor:
        """GPT2Block ``index``: (m, S, H) -> (m, S, H)."""
        block = self.model.transformer.h[index]
        return block(hidden, None, ctx.masks[FULL], None, encoder_attention_mask=None,
                     use_cache=False, position_ids=ctx.position_ids)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: DecoderContext) -> torch.Tensor:
        """ln_f + lm_head: (m, S, H) -> logits (m, S, V)."""
        return self.model.lm_head(self.model.transformer.ln_f(hidden))
