"""Adapter for BertForSequenceClassification.

Layout (transformers 5.x): ``bert.embeddings`` (word + token type + position, LayerNorm,
dropout) -> ``bert.encoder.layer[i]`` -> ``bert.pooler`` ([CLS] -> dense -> tanh) -> ``dropout``
-> ``classifier``. The pooler is used by this head and lives in the head unit with the
classifier. A model built without a pooler (``bert.pooler is None``) is rejected, since this
head needs it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import ClassifierStagedModel, EncoderContext, require_key


class BertStagedModel(ClassifierStagedModel):
    """BERT sequence classifier as a staged model.

    Microbatch keys: ``input_ids`` (m, S) (required), ``attention_mask`` (m, S) 0/1,
    ``token_type_ids`` (m, S), ``position_ids`` (m, S), ``labels`` (m,) int64 (-100 ignored) or
    float targets for regression / multi-label. Items = samples (label elements for
    regression / multi-label).
    """

    model_classes = ("BertForSequenceClassification",)

    def __init__(self, model: nn.Module):
        if model.bert.pooler is None:
            raise ValueError("BertForSequenceClassification without a pooler (bert.pooler is None) "
                             "cannot run its head; build it with "
                             "BertModel(add_pooling_layer=True).")
        super().__init__(model)

    def units(self) -> list[nn.Module]:
        return list(self.model.bert.encoder.layer)

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.bert.embeddings]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.bert.pooler, self.model.classifier]

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, EncoderContext]:
        """input_ids (m, S) -> embeddings (m, S, H) and the microbatch's attention mask."""
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        bert = self.model.bert
        position_ids = microbatch.get("position_ids")
        hidden = bert.embeddings(input_ids=input_ids, position_ids=position_ids,
                                 token_type_ids=microbatch.get("token_type_ids"))
        attention_mask = microbatch.get("attention_mask")
        if self.model.config.is_decoder:  # mirrors BertModel._create_attention_masks
            mask = create_causal_mask(config=self.model.config, inputs_embeds=hidden,
                                      attention_mask=attention_mask, cache=None)
        else:
            mask = create_bidirectional_mask(config=self.model.config, inputs_embeds=hidden,
                                             attention_mask=attention_mask)
        return hidden, EncoderContext(mask, position_ids)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: EncoderContext) -> torch.Tensor:
        """BertLayer ``index``: (m, S, H) -> (m, S, H)."""
        return self.model.bert.encoder.layer[index](hidden, ctx.mask, None,
                                                    encoder_attention_mask=None, cache=None,
                                                    position_ids=ctx.position_ids)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: EncoderContext) -> torch.Tensor:
        """pooler ([CLS] -> dense -> tanh) -> dropout -> classifier:
        (m, S, H) -> logits (m, num_labels)."""
        pooled = self.model.bert.pooler(hidden)
        return self.model.classifier(self.model.dropout(pooled))
