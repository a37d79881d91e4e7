"""Adapters for BART's kin: mBART's and Pegasus's ``...ForConditionalGeneration`` and
``MarianMTModel``.

The units and side inputs of models/seq2seq.py ([Note: encoder-decoder units], BART's adapter);
what differs is each family's own code around the layers, called or re-stated as its forward
has it:

* mBART: BART plus a final ``layer_norm`` on each stack (the encoder's makes the encoder's
  output in the first decoder unit; the decoder's is on the head side), and its own label shift
  (the last non-pad token of each row, the language id, moves to the front).
* Marian: no embedding LayerNorm and no final norms; token embeddings scaled by
  ``embed_scale`` outside the embedding, fixed sinusoidal positions.
* Pegasus: Marian's inputs with a final ``layer_norm`` on each stack (pre-LN layers).

Each head is ``lm_head`` plus ``final_logits_bias``; the loss is the models' own mean cross
entropy over ``labels`` (-100 ignored). Layer drop is refused as for BART.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_cephalo.models.seq2seq import BartStagedModel, Seq2SeqContext


class FinalNorms:
    """Each stack's final norm (pre-LN stacks: mBART, Pegasus, ``layer_norm``; BigBird-Pegasus
    names it ``layernorm_embedding``: ``final_norm_name``): the encoder's makes the encoder's
    output in the first decoder unit, the decoder's is on the head side before ``lm_head`` and
    ``final_logits_bias``. Mixed in before a ``BartStagedModel``."""

    final_norm_name = "layer_norm"
    """The attribute of each stack that holds its final norm."""

    def junction_modules(self, model: nn.Module) -> list[nn.Module]:
        return [getattr(model.model.encoder, self.final_norm_name)]

    def head_modules(self) -> list[nn.Module]:
        return [getattr(self.model.model.decoder, self.final_norm_name), self.model.lm_head]

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output: its final norm of the last encoder layer's output."""
        return [getattr(self.model.model.encoder, self.final_norm_name)(hidden)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = getattr(self.model.model.decoder, self.final_norm_name)
        logits = self.model.lm_head(norm(hidden))
        return logits + self.model.final_logits_bias.to(logits.device)


class MBartStagedModel(FinalNorms, BartStagedModel):
    """``MBartForConditionalGeneration``: BART's units, each stack's final ``layer_norm``
    (``FinalNorms``) and mBART's label shift (see the module note)."""

    model_classes = ("MBartForConditionalGeneration",)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        from transformers.models.mbart.modeling_mbart import shift_tokens_right

        return shift_tokens_right(labels, self.model.config.pad_token_id)


class MarianStagedModel(BartStagedModel):
    """``MarianMTModel``: scaled token embeddings and sinusoidal positions, no embedding
    LayerNorm, no final norms (see the module note)."""

    model_classes = ("MarianMTModel",)

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        modules = [self.model.model.shared, enc.embed_tokens, enc.embed_positions,
                   dec.embed_tokens, dec.embed_positions]
        return [m for m in modules if m is not None]


    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids) * enc.embed_scale
        hidden = embeds + enc.embed_positions(embeds.shape[:-1])
        return embeds, F.dropout(hidden, p=enc.dropout, training=enc.training)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids) * dec.embed_scale
        position_ids = torch.arange(ids.shape[1], device=embeds.device)
        hidden = embeds + dec.embed_positions(ids.shape, 0, position_ids=position_ids)
        return embeds, F.dropout(hidden, p=dec.dropout, training=dec.training)


class PegasusStagedModel(FinalNorms, MarianStagedModel):
    """``PegasusForConditionalGeneration``: Marian's inputs, Pegasus's own label shift (as every
    family's, ``BartStagedModel.shift_labels``), each stack's final ``layer_norm``
    (``FinalNorms``; see the module note)."""

    model_classes = ("PegasusForConditionalGeneration",)
