"""Adapters for T5's kin: mT5, UMT5, LongT5 and Pop2Piano's ``...ForConditionalGeneration``,
and the encoder-only token classifiers of T5 and mT5.

The units and side inputs of models/seq2seq.py ([Note: encoder-decoder units], T5's adapter);
what differs is each family's own code around the layers:

* mT5: T5's code under other class names (transformers copies it), except that its LM head
  never scales the decoder's output by d_model^-0.5 (its config has no
  ``scale_decoder_outputs``; mT5 checkpoints do not tie the head to the embedding).
* UMT5: every layer has its own ``relative_attention_bias`` and computes its position bias
  itself, so no layer hands one to the next: the only made side input is the encoder's output
  (the first decoder unit, from the encoder's final norm and dropout).
* ``T5ForTokenClassification`` / ``MT5ForTokenClassification``: T5's encoder alone
  (``transformer`` is a ``T5EncoderModel``) with ``dropout`` and ``classifier`` on every
  position. Its layer 0 computes the position bias every later layer reads, which the generic
  path (one recorded call per layer, made before any layer ran) cannot see: its later layers
  would get no bias. Here unit 0 makes the bias as in the seq2seq adapter. (UMT5's token
  classifier has per-layer biases and trains exactly on the generic path.)

* LongT5: T5's decoder; its encoder's layers attend locally (``"local"``: blocks of
  ``local_radius + 1`` tokens and their neighbours) or also to per-block aggregates
  (``"transient-global"``). Its encoder's mask is the stack's own (the local block mask, or
  the 2-D padding mask, ones without one), and the position bias layer 0 hands on has the
  padding folded in (and, transient-global, the side bias to the global blocks), which unit 0
  makes as the layer's attention does (``longt5_encoder_bias``).

* Pop2Piano (piano covers of pop audio): T5's code under Pop2Piano's names, whose encoder
  takes the ``input_features`` its feature extractor gives (m, frames, d_model) as its input
  embeddings (or ``input_ids`` through ``shared``). Its ``mel_conditioner`` (the composer
  embedding ``generate`` puts before the features) is never called by the forward: it sits on
  the embedding side and gets no gradient, as in the model's own backward.

Refused, with the reason, by ``registry._encoder_decoder``: Switch Transformers (MoE layers
whose router z-loss and auxiliary loss the model adds over the whole batch; see
``T5_KIN_REFUSALS``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from hf_cephalo.models.base import HeadOutput, Microbatch
from hf_cephalo.models.generic_heads import token_loss_sum
from hf_cephalo.models.hf_common import IGNORE_INDEX, HFStagedModel, require_key
from hf_cephalo.models.seq2seq import Seq2SeqContext, T5StagedModel


class MT5StagedModel(T5StagedModel):
    """``MT5ForConditionalGeneration``: T5's adapter; the head is the decoder's final norm
    and dropout and ``lm_head``, unscaled."""

    model_classes = ("MT5ForConditionalGeneration",)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output (m, T, H) -> logits (m, T, V) as the model's own."""
        dec = self.stacks()[1]
        return self.model.lm_head(dec.dropout(dec.final_layer_norm(hidden)))


class UMT5StagedModel(T5StagedModel):
    """``UMT5ForConditionalGeneration``: T5's units, embedding and head; each layer computes
    its own position bias, so the first decoder unit makes the encoder's output only."""

    model_classes = ("UMT5ForConditionalGeneration",)
    made_names = ("enc_out",)

    def making_units(self) -> tuple[int, ...]:
        return (self.num_encoder_units,)

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output (m, S, H): its final norm and dropout of ``hidden``."""
        enc = self.stacks()[0]
        return [enc.dropout(enc.final_layer_norm(hidden))]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.stacks()[0].block[i](hidden, ctx.enc_mask)

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.stacks()[1].block[i](hidden, ctx.dec_mask, self.made(ctx, "enc_out"),
                                         encoder_attention_mask=ctx.cross_mask, cache=None)


class Pop2PianoStagedModel(T5StagedModel):
    """``Pop2PianoForConditionalGeneration`` (see the module note): T5's units, position
    biases, junction, head (scaled by d_model^-0.5 where ``scale_decoder_outputs``) and label
    shift. Microbatch keys: ``input_features`` (m, frames, d_model) float, or ``input_ids``
    (m, S); optional ``attention_mask`` (m, frames or S), ``labels`` (m, T) with -100
    ignored, optional ``decoder_input_ids`` / ``decoder_attention_mask`` (m, T). Raises
    ValueError (per microbatch) with both or neither of ``input_features`` and ``input_ids``,
    as the model's own forward does."""

    model_classes = ("Pop2PianoForConditionalGeneration",)

    def embed_modules(self) -> list[nn.Module]:
        return [*super().embed_modules(), self.model.mel_conditioner]

    def encoder_source(self, microbatch: Microbatch) -> torch.Tensor:
        """``input_features`` (m, frames, d_model), else ``input_ids`` (m, S)."""
        features = microbatch.get("input_features")
        if features is None:
            return super().encoder_source(microbatch)
        if microbatch.get("input_ids") is not None:
            raise ValueError(f"{type(self).__name__}: the microbatch has both input_features "
                             "and input_ids; the model's encoder takes one of them")
        return features

    def encoder_input(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The features as the encoder's input embeddings, or the ids' embeddings; dropout."""
        if not source.is_floating_point():
            return super().encoder_input(source)
        return source, self.stacks()[0].dropout(source)


class LongT5StagedModel(T5StagedModel):
    """``LongT5ForConditionalGeneration``: T5's units, embedding, decoder and head; the encoder's
    own mask and the position bias its layer 0 computes (see the module note)."""

    model_classes = ("LongT5ForConditionalGeneration",)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """As T5's, with the encoder's mask as LongT5's stack builds it: the 2-D padding mask
        (ones without one) for transient-global attention, its local block mask for local."""
        from transformers.models.longt5.modeling_longt5 import _get_local_attention_mask

        hidden, ctx = super().embed(microbatch)
        mask = microbatch.get("attention_mask")
        if mask is None:
            mask = torch.ones(hidden.shape[:2], device=hidden.device)
        enc = self.stacks()[0]
        if enc.config.encoder_attention_type == "local":
            mask = _get_local_attention_mask(mask, enc.block_len, hidden.device)
        return hidden, ctx._replace(enc_mask=mask)

    def decoder_self_mask_input(self, mask: torch.Tensor | None,
                                embeds: torch.Tensor) -> torch.Tensor | None:
        if mask is None:  # as LongT5Stack.forward: all ones
            return torch.ones(embeds.shape[:2], device=embeds.device)
        return mask

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """Unit 0: the encoder's position bias (``longt5_encoder_bias``); unit Le: T5's."""
        if index == 0:
            return [longt5_encoder_bias(self.stacks()[0].block[0].layer[0], ctx.enc_mask,
                                        hidden)]
        return super().make(index, hidden, ctx)


def longt5_encoder_bias(attention_layer: nn.Module, mask: torch.Tensor,
                        hidden: torch.Tensor) -> torch.Tensor:
    """The position bias LongT5's encoder layer 0 (``attention_layer``: its self-attention
    wrapper) computes and hands on, as its attention's forward does: the relative bias of a
    block (1, 1, heads, L, 3L) plus the local mask's -1e10 at padding, (m, blocks, heads, L, 3L);
    transient-global: concatenated with the side bias to the global blocks, (m, blocks, heads,
    L, 3L + G). ``mask``: the layer's mask (the local block mask; transient-global: the 2-D
    padding mask (m, S)); ``hidden`` (m, S, H) gives the scores' dtype."""
    from transformers.models.longt5 import modeling_longt5 as lt

    local = getattr(attention_layer, "LocalSelfAttention", None)
    if local is not None:
        bias = local.compute_bias(local.block_len)
        return bias + torch.where(mask > 0, 0.0, -1e10).transpose(1, 2)
    attn = attention_layer.TransientGlobalSelfAttention
    dtype = torch.get_autocast_dtype(hidden.device.type) \
        if torch.is_autocast_enabled(hidden.device.type) else attn.q.weight.dtype
    _, segments = lt._make_global_fixed_block_ids(mask, attn.global_block_size)
    local_mask = lt._get_local_attention_mask(mask, attn.block_len, hidden.device)
    bias = attn.compute_bias(attn.block_len) + \
        torch.where(local_mask > 0, 0.0, -1e10).transpose(1, 2)
    side = attn.compute_side_bias(mask, segments)
    side = lt._split_into_blocks(side, attn.block_len, dim=-2).transpose(1, 2)
    return torch.cat([bias.type(dtype), side.type(dtype).to(bias.device)], dim=-1)


class EncoderContext(NamedTuple):
    """One microbatch's ctx for T5's encoder alone: the bidirectional mask its stack builds
    and ``made``: the position bias (1, heads, S, S) once unit 0 made it."""

    mask: Any
    made: tuple = ()


class T5TokenClassifierStagedModel(HFStagedModel):
    """``T5ForTokenClassification`` / ``MT5ForTokenClassification``: units = the encoder's
    ``block``s; E = ``shared`` (the encoder's ``embed_tokens`` is tied to it) and the input
    dropout; unit 0 makes the position bias every layer reads; H = the encoder's final norm and
    dropout, then the model's ``dropout`` and ``classifier``: logits (m, S, num_labels), the
    summed cross entropy against ``labels`` (m, S) as given (-100 ignored), items = labels !=
    -100. Raises ValueError (``require_key``) for a microbatch without ``input_ids`` or, in
    the loss, without ``labels``."""

    model_classes = ("T5ForTokenClassification", "MT5ForTokenClassification")

    def __init__(self, model: nn.Module):
        self._units = list(model.transformer.encoder.block)
        super().__init__(model)

    def encoder(self) -> nn.Module:
        """The encoder stack (``transformer.encoder``)."""
        return self.model.transformer.encoder

    def units(self) -> list[nn.Module]:
        return list(self._units)

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.transformer.shared, self.encoder().embed_tokens]

    def head_modules(self) -> list[nn.Module]:
        return [self.encoder().final_layer_norm, self.model.classifier]

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, EncoderContext]:
        """input_ids (m, S) -> the hidden states into layer 0 (m, S, H) and the ctx."""
        from transformers.masking_utils import create_bidirectional_mask

        ids = require_key(microbatch, "input_ids", type(self).__name__)
        enc = self.encoder()
        embeds = enc.embed_tokens(ids)
        mask = create_bidirectional_mask(config=enc.config, inputs_embeds=embeds,
                                         attention_mask=microbatch.get("attention_mask"))
        return enc.dropout(embeds), EncoderContext(mask)

    def produces_side_inputs(self, index: int) -> bool:
        return index == 0

    def produce_side_inputs(self, index: int, hidden: torch.Tensor,
                            ctx: EncoderContext) -> EncoderContext:
        """Unit 0: the position bias (1, heads, S, S) from its ``relative_attention_bias``."""
        s = hidden.shape[1]
        attention = self.encoder().block[0].layer[0].SelfAttention
        return ctx._replace(made=(attention.compute_bias(s, s, device=hidden.device),))

    def side_inputs(self, ctx: EncoderContext) -> list[torch.Tensor]:
        return list(ctx.made)

    def with_side_inputs(self, ctx: EncoderContext, tensors: list) -> EncoderContext:
        return ctx._replace(made=tuple(tensors))

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: EncoderContext) -> torch.Tensor:
        """Encoder layer ``index``: (m, S, H) -> (m, S, H)."""
        return self.encoder().block[index](hidden, ctx.mask, ctx.made[0])[0]

    def token_logits_width(self) -> int:
        """C of the logits (m, S, C): ``config.num_labels``."""
        return int(self.model.config.num_labels)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """The last layer's output (m, S, H) -> logits (m, S, num_labels), as the model's."""
        enc = self.encoder()
        out = enc.dropout(enc.final_layer_norm(hidden))
        return self.model.classifier(self.model.dropout(out))

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        return token_loss_sum(logits, require_key(microbatch, "labels", type(self).__name__))

    def count_items(self, microbatch: Microbatch) -> int:
        """Positions with label != -100; 0 without ``labels``."""
        labels = microbatch.get("labels")
        return 0 if labels is None else int((labels != IGNORE_INDEX).sum().item())


T5_KIN_REFUSALS = {
    "SwitchTransformersForConditionalGeneration": (
        "its sparse (MoE) layers return router logits from which the model adds a router "
        "z-loss and a load-balancing loss over the whole batch of both stacks, a loss term "
        "no encoder-decoder adapter carries yet"),
}
"""T5 kin refused, class -> the reason (``registry._encoder_decoder`` names it)."""
