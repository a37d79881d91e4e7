"""Adapter for ViTForImageClassification.

Layout (transformers 5.x): ``vit.embeddings`` (patch projection, [CLS] token, learned
positions) -> ``vit.layers[i]`` -> ``vit.layernorm`` -> [CLS] hidden state -> ``classifier``.
The classification model builds ``ViTModel(add_pooling_layer=False)``, so there is no pooler.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import ClassifierStagedModel, EncoderContext, require_key


class ViTStagedModel(ClassifierStagedModel):
    """ViT image classifier as a staged model.

    Microbatch keys: ``pixel_values`` (m, C, H, W) float (required; cast to the weights' dtype
    like the model does), ``labels`` (m,) int64 class ids (-100 ignored), or float targets for
    regression / multi-label (see ``hf_common.classification_loss_sum``). Items = samples.
    """

    model_classes = ("ViTForImageClassification",)

    def units(self) -> list[nn.Module]:
        return list(self.model.vit.layers)

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.vit.embeddings]

    def head_modules(self) -> list[nn.Module]:
        vit = self.model.vit
        modules = [vit.layernorm, self.model.classifier]
        return modules + ([vit.pooler] if vit.pooler is not None else [])

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, EncoderContext]:
        """pixel_values (m, C, H, W) -> hidden (m, 1 + num_patches, H)."""
        pixel_values = require_key(microbatch, "pixel_values", type(self).__name__)
        vit = self.model.vit
        dtype = vit.embeddings.patch_embeddings.projection.weight.dtype
        hidden = vit.embeddings(pixel_values.to(dtype),
                                interpolate_pos_encoding=microbatch.get("interpolate_pos_encoding"))
        mask = create_bidirectional_mask(config=self.model.config, inputs_embeds=hidden,
                                         attention_mask=microbatch.get("attention_mask"))
        return hidden, EncoderContext(mask)

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: EncoderContext) -> torch.Tensor:
        """ViTLayer ``index``: (m, S, H) -> (m, S, H)."""
        return self.model.vit.layers[index](hidden, ctx.mask)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch,
                    ctx: EncoderContext) -> torch.Tensor:
        """layernorm -> [CLS] -> classifier: (m, S, H) -> logits (m, num_labels)."""
        return self.model.classifier(self.model.vit.layernorm(hidden)[:, 0, :])
