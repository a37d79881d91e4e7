"""Adapters for GPT2LMHeadModel and GPT2ForSequenceClassification.

Layout (transformers 5.x): ``transformer.wte`` + ``transformer.wpe`` (learned positions) ->
``transformer.drop`` -> ``transformer.h[i]`` -> ``transformer.ln_f`` -> ``lm_head`` (causal LM)
or ``score`` (sequence classification). Both heads share one decoder body
(``GPT2DecoderBody``). The LM head weight is tied to ``wte`` by default: the embedding unit
holds that one storage (the head unit keeps ``ln_f``), so its gradient is the sum of the
embedding use and the head use, exactly as in the model.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import (FULL, CausalLMStagedModel, DecoderContext, HFStagedModel,
                                         LastTokenClassifierStagedModel, build_causal_masks,
                                         microbatch_position_ids, require_key)


class GPT2DecoderBody(HFStagedModel):
    """The decoder body of the GPT-2 adapters (``model.transformer``, a ``GPT2Model``): units,
    embedding, masks. The head (and with it the loss) is the subclass's.

    Microbatch keys: ``input_ids`` (m, S) (required), ``attention_mask`` (m, S) (padding, left
    or right), ``position_ids`` (m, S) (packed sequences), ``token_type_ids`` (m, S) (embedded
    with ``wte`` like the model does). With ``add_cross_attention=True`` the cross-attention
    weights get no encoder states and hence no gradient, as in the model's own forward without
    ``encoder_hidden_states``.
    """

    def units(self) -> list[nn.Module]:
        return list(self.model.transformer.h)

    def embed_modules(self) -> list[nn.Module]:
        t = self.model.transformer
        return [t.wte, t.wpe]

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


class GPT2StagedModel(GPT2DecoderBody, CausalLMStagedModel):
    """GPT-2 causal LM as a staged model.

    Microbatch keys: those of ``GPT2DecoderBody`` and ``labels`` (m, S) with -100 ignored
    (shifted inside ``head_loss``).
    """

    model_classes = ("GPT2LMHeadModel",)

    def head_modules(self) -> list[nn.Module]:
        return [self.model.transformer.ln_f, self.model.lm_head]

    def final_hidden(self, hidden: torch.Tensor, microbatch: Microbatch,
                     ctx: DecoderContext) -> torch.Tensor:
        """ln_f: (m, S, H) -> (m, S, H) (logits = lm_head of it, ``head_logits``)."""
        return self.model.transformer.ln_f(hidden)

    def output_head(self) -> nn.Module:
        return self.model.lm_head


class GPT2SequenceClassifierStagedModel(GPT2DecoderBody, LastTokenClassifierStagedModel):
    """GPT-2 sequence classifier as a staged model: the decoder body, then ``ln_f`` -> ``score``
    on every position, pooled at each row's last non-pad token (``pool_last_non_pad``, as
    ``GPT2ForSequenceClassification.forward``).

    Microbatch keys: those of ``GPT2DecoderBody`` and ``labels``: (m,) int64 class ids (-100
    ignored) or float targets for regression / multi-label. GPT-2 configs have no pad token by
    default: set ``config.pad_token_id`` (e.g. to the eos id) for microbatches of more than one
    row, as stock requires for batches of more than one row.
    """

    model_classes = ("GPT2ForSequenceClassification",)

    def head_modules(self) -> list[nn.Module]:
        return [self.model.transformer.ln_f, self.model.score]

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """ln_f + score: (m, S, H) -> (m, S, num_labels)."""
        return self.model.score(self.model.transformer.ln_f(hidden))
