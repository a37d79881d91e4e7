"""Adapter for GPTNeoXForCausalLM (Pythia and friends).

Layout (transformers 5.x): ``gpt_neox.embed_in`` -> ``gpt_neox.emb_dropout`` ->
``gpt_neox.layers[i]`` (rotary cos/sin from ``gpt_neox.rotary_emb``) ->
``gpt_neox.final_layer_norm`` -> ``lm_head`` (untied unless ``tie_word_embeddings``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import (FULL, CausalLMStagedModel, DecoderContext,
                                         build_causal_masks, microbatch_position_ids, require_key,
                                         rotary_cos_sin)


class GPTNeoXStagedModel(CausalLMStagedModel):
    """GPT-NeoX causal LM as a staged model. Microbatch keys as for ``LlamaStagedModel``."""

    model_classes = ("GPTNeoXForCausalLM",)

    def units(self) -> list[nn.Module]:
        return list(self.model.gpt_neox.layers)

    def embed_modules(self) -> list[nn.Module]:
        g = self.model.gpt_neox
        return [g.embed_in, g.rotary_emb]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.gpt_neox.final_layer_norm, self.model.lm_head]

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, DecoderContext]:
        """input_ids (m, S) -> hidden (m, S, H) and the microbatch's mask and rotary cos/sin."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        g = self.model.gpt_neox
        inputs_embeds = g.embed_in(input_ids)
        position_ids = microbatch_position_ids(microbatch, input_ids)
        masks = build_causal_masks(self.model.config, [FULL], inputs_embeds,
                                   microbatch.get("attention_mask"), position_ids)
        hidden = g.emb_dropout(inputs_embeds)
        cos_sin = rotary_cos_sin(g.rotary_emb, hidden, position_ids)
        return hidden, DecoderContext(masks, position_ids, cos_sin)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: DecoderContext) -> torch.Tensor:
        """GPTNeoXLayer ``index``: (m, S, H) -> (m, S, H)."""
        return self.model.gpt_neox.layers[index](
            hidden, attention_mask=ctx.masks[FULL], position_ids=ctx.position_ids,
            use_cache=False, position_embeddings=ctx.position_embeddings)

    def final_hidden(self, hidden: torch.Tensor, microbatch: Microbatch,
                     ctx: DecoderContext) -> torch.Tensor:
        """final_layer_norm: (m, S, H) -> (m, S, H) (logits = lm_head of it, ``head_logits``)."""
        return self.model.gpt_neox.final_layer_norm(hidden)

    def output_head(self) -> nn.Module:
        return self.model.lm_head
