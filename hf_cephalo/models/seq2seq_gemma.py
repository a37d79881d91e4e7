"""Adapters for Gemma's encoder-decoders: T5Gemma's and T5Gemma 2's
``...ForConditionalGeneration``.

The units and side inputs of models/seq2seq.py ([Note: encoder-decoder units]): encoder layers,
then decoder layers, the first decoder unit making the encoder's output from the last encoder
layer's (the encoder's final ``norm`` and dropout, which join that unit). Both stacks are
Gemma decoders' layers (pre- and post-norms, rotary positions, sliding-window and full
attention layers by ``config.layer_types``, logit soft-capping); what the adapters re-state is
each stack's code around its layers, as its forward has it:

* T5Gemma: token embeddings scaled by sqrt(hidden_size) outside the embedding; one rotary
  cos / sin for every layer; masks by layer type (bidirectional, and bidirectional within the
  sliding window, in the encoder; causal and sliding-window causal in the decoder), each built
  from a 2-D mask that is the given one or, without one, the input's non-pad tokens (the
  model's ``make_default_2d_attention_mask``); the decoder's cross-attention mask from
  ``attention_mask`` as given.
* T5Gemma 2: the scale (and the end-of-image token's own embedding) inside the embedding
  module; a rotary cos / sin per layer type; no default 2-D mask; the encoder's sliding window
  a bidirectional band (the model's ``sliding_window_mask_function``); each decoder layer's one
  merged attention over the decoder's tokens and the encoder's output, its mask the
  self-attention mask of the layer's type joined with the cross-attention mask.

Each stack's position ids are the microbatch's (``position_ids``, ``decoder_position_ids``),
else 0..L-1. H is the decoder's final ``norm`` and dropout, ``lm_head`` and, where the decoder's
config sets ``final_logit_softcapping``, cap x tanh(logits / cap); the loss is the model's own
cross entropy over ``labels`` as given (its ``ForMaskedLM`` loss: no shift, -100 ignored),
the decoder's input its own shift of them (``bos_token_id`` of the decoder's config first).

**T5Gemma 2 on text.** Its encoder has a SigLIP vision tower and a projector whose image
tokens replace the image placeholders of ``input_ids`` when the forward gets ``pixel_values``;
on text the forward never calls them. The adapter stages the text path, as the generic path
stages a vision-language model's language model (docs/adding_a_model.md, "Vision-language
models on text"): the tower and the projector sit on the head side and get no gradient, as in
the model's own text-only backward, and a microbatch with ``pixel_values`` is refused
(``TextOnlyInputError``, already when the engine counts its items, before any collective).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.generic import TextOnlyInputError
from hf_cephalo.models.hf_common import require_key
from hf_cephalo.models.seq2seq import Seq2SeqContext, Seq2SeqStagedModel

FULL, SLIDING = "full_attention", "sliding_attention"


class GemmaStackInputs(NamedTuple):
    """One stack's parameter-free layer inputs as its forward makes them: ``masks`` by layer
    type (T5Gemma 2's decoder: each joined with the cross-attention mask), ``position_ids``
    (1 or m, L) and ``rotary``, the (cos, sin) by layer type."""

    masks: dict
    position_ids: torch.Tensor
    rotary: dict


def _positions(given: torch.Tensor | None, embeds: torch.Tensor) -> torch.Tensor:
    """The given position ids, else 0..L-1 (1, L), as the stacks' forwards make them."""
    if given is not None:
        return given
    return torch.arange(embeds.shape[1], device=embeds.device)[None]


class T5GemmaStagedModel(Seq2SeqStagedModel):
    """``T5GemmaForConditionalGeneration`` (see the module note): units = encoder ``layers``,
    then decoder ``layers`` (the first with the encoder's final ``norm``); E = each stack's
    ``embed_tokens`` and ``rotary_emb``; H = the decoder's ``norm`` and ``lm_head`` (tied to
    the decoder's ``embed_tokens`` by default).

    Microbatch keys: ``input_ids`` (m, S), optional ``attention_mask`` and ``position_ids``
    (m, S), ``labels`` (m, T) with -100 ignored, optional ``decoder_input_ids``,
    ``decoder_attention_mask`` and ``decoder_position_ids`` (m, T). Raises ValueError (per
    microbatch) without ``input_ids``, or without both ``labels`` and ``decoder_input_ids``."""

    model_classes = ("T5GemmaForConditionalGeneration",)

    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        return model.model.encoder.layers, model.model.decoder.layers

    def junction_modules(self, model: nn.Module) -> list[nn.Module]:
        return [self.encoder_of(model).norm]

    def encoder_of(self, model: nn.Module) -> nn.Module:
        """The encoder stack of ``model`` (the one holding its layers and final norm)."""
        return model.model.encoder

    def stacks(self) -> tuple[nn.Module, nn.Module]:
        return self.encoder_of(self.model), self.model.model.decoder

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [enc.embed_tokens, enc.rotary_emb, dec.embed_tokens, dec.rotary_emb]

    def head_modules(self) -> list[nn.Module]:
        return [self.stacks()[1].norm, self.model.lm_head]

    def prepare_for_training(self) -> None:
        """As every adapter's, and each stack's own config without a cache too: the decoder's
        forward reads ``use_cache`` from its config (True in T5Gemma's), and with a cache it
        would build its masks without the default 2-D mask."""
        super().prepare_for_training()
        for stack in self.stacks():
            if getattr(stack.config, "use_cache", False):
                stack.config.use_cache = False

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self.model._shift_right(labels)

    def scaled(self, stack: nn.Module, embeds: torch.Tensor) -> torch.Tensor:
        """The hidden states into the stack's layer 0 from its token embeddings."""
        normalizer = torch.tensor(stack.config.hidden_size ** 0.5, dtype=embeds.dtype)
        return stack.dropout(embeds * normalizer)

    def self_masks(self, stack: nn.Module, embeds: torch.Tensor, mask: torch.Tensor | None,
                   position_ids: torch.Tensor) -> dict:
        """The stack's self-attention masks by layer type, as its forward builds them from
        ``mask`` (a default one already filled in)."""
        from transformers import masking_utils as mu

        kw = dict(config=stack.config, inputs_embeds=embeds, attention_mask=mask)
        if stack is self.stacks()[1]:
            kw.update(cache=None, position_ids=position_ids)
            return {FULL: mu.create_causal_mask(**kw),
                    SLIDING: mu.create_sliding_window_causal_mask(**kw)}
        return {FULL: mu.create_bidirectional_mask(**kw),
                SLIDING: mu.create_bidirectional_sliding_window_mask(**kw)}

    def stack_inputs(self, stack: nn.Module, ids: torch.Tensor, embeds: torch.Tensor,
                     mask: torch.Tensor | None, positions: torch.Tensor | None,
                     cross: Any) -> tuple[torch.Tensor, GemmaStackInputs]:
        """(the hidden into layer 0, the layers' inputs) of one stack from its input ``ids``
        and their ``embeds`` (the stack's ``embed_tokens`` of them). ``cross``: unused here
        (T5Gemma's decoder layers take the cross-attention mask apart)."""
        from transformers.models.t5gemma.modeling_t5gemma import make_default_2d_attention_mask

        positions = _positions(positions, embeds)
        if mask is None:
            mask = make_default_2d_attention_mask(ids, embeds, stack.config.pad_token_id)
        masks = self.self_masks(stack, embeds, mask, positions)
        hidden = self.scaled(stack, embeds)
        cos_sin = stack.rotary_emb(hidden, positions)
        return hidden, GemmaStackInputs(masks, positions, {FULL: cos_sin, SLIDING: cos_sin})

    def cross_mask(self, microbatch: Microbatch, dec_embeds: torch.Tensor,
                   enc_embeds: torch.Tensor) -> Any:
        """The decoder's cross-attention mask, from ``attention_mask`` as given."""
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(
            config=self.stacks()[1].config, inputs_embeds=dec_embeds,
            attention_mask=microbatch.get("attention_mask"), encoder_hidden_states=enc_embeds)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_ids (m, S) -> the hidden into encoder layer 0 (m, S, H); the ctx with each
        stack's ``GemmaStackInputs`` (``enc_mask``, ``dec_mask``), the cross-attention mask
        and the decoder's input hidden (m, T, H)."""
        ids = require_key(microbatch, "input_ids", type(self).__name__)
        enc, dec = self.stacks()
        enc_embeds = enc.embed_tokens(ids)
        hidden, enc_in = self.stack_inputs(enc, ids, enc_embeds, microbatch.get("attention_mask"),
                                           microbatch.get("position_ids"), None)
        dec_ids = self.decoder_ids(microbatch)
        dec_embeds = dec.embed_tokens(dec_ids)
        cross = self.cross_mask(microbatch, dec_embeds, enc_embeds)
        dec_hidden, dec_in = self.stack_inputs(
            dec, dec_ids, dec_embeds, microbatch.get("decoder_attention_mask"),
            microbatch.get("decoder_position_ids"), cross)
        return hidden, Seq2SeqContext(enc_mask=enc_in, dec_mask=dec_in, cross_mask=cross,
                                      dec_hidden=dec_hidden)

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output: its final ``norm`` and dropout of ``hidden``."""
        enc = self.stacks()[0]
        return [enc.dropout(enc.norm(hidden))]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        enc = self.stacks()[0]
        kind, inputs = enc.config.layer_types[i], ctx.enc_mask
        return enc.layers[i](hidden, inputs.rotary[kind], inputs.masks[kind],
                             inputs.position_ids)

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        dec = self.stacks()[1]
        kind, inputs = dec.config.layer_types[i], ctx.dec_mask
        return dec.layers[i](hidden, inputs.rotary[kind], inputs.masks[kind],
                             inputs.position_ids, None, False, self.made(ctx, "enc_out"),
                             ctx.cross_mask)

    def softcap(self) -> float | None:
        """The decoder config's ``final_logit_softcapping``, as the model's head reads it."""
        return self.model.get_decoder().config.final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dec = self.stacks()[1]
        logits = self.model.lm_head(dec.dropout(dec.norm(hidden)))
        cap = self.softcap()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class T5Gemma2StagedModel(T5GemmaStagedModel):
    """``T5Gemma2ForConditionalGeneration`` on text (see the module note): units = the text
    encoder's ``layers``, then the decoder's (merged attention); E = each stack's
    ``embed_tokens`` (tied) and ``rotary_emb``; H = the decoder's ``norm``, ``lm_head`` (tied
    to the embedding) and the unused vision tower and projector.

    Microbatch keys: T5Gemma's. Raises ``TextOnlyInputError`` (a ValueError; per microbatch,
    when counting its items) for a microbatch with ``pixel_values``."""

    model_classes = ("T5Gemma2ForConditionalGeneration",)

    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        return model.model.encoder.text_model.layers, model.model.decoder.layers

    def encoder_of(self, model: nn.Module) -> nn.Module:
        return model.model.encoder.text_model

    def head_modules(self) -> list[nn.Module]:
        encoder = self.model.model.encoder
        return [*super().head_modules(), encoder.vision_tower, encoder.multi_modal_projector]

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self.model.prepare_decoder_input_ids_from_labels(labels)

    def check_inputs(self, microbatch: Microbatch) -> None:
        """TextOnlyInputError for a microbatch with ``pixel_values``."""
        if microbatch.get("pixel_values") is not None:
            raise TextOnlyInputError(
                f"{type(self.model).__name__} is staged for text-only fine-tuning: on text its "
                "own forward never calls model.model.encoder.vision_tower or "
                "model.model.encoder.multi_modal_projector, and the staging is exact for that "
                "forward only. This microbatch also carries pixel_values, which the staged "
                "model does not run. Drop that key from the batch (text-only data; e.g. the "
                "tokenizer's output instead of the processor's), or train the multimodal "
                "model through a hand-written adapter (docs/adding_a_model.md).")

    def count_items(self, microbatch: Microbatch) -> int:
        """Label tokens != -100, after ``check_inputs`` (the engine counts items before a
        step's first collective)."""
        self.check_inputs(microbatch)
        return super().count_items(microbatch)

    def scaled(self, stack: nn.Module, embeds: torch.Tensor) -> torch.Tensor:
        return stack.dropout(embeds)  # the embedding module scales

    def self_masks(self, stack: nn.Module, embeds: torch.Tensor, mask: torch.Tensor | None,
                   position_ids: torch.Tensor) -> dict:
        from transformers import masking_utils as mu
        from transformers.models.t5gemma2.modeling_t5gemma2 import sliding_window_mask_function

        kw = dict(config=stack.config, inputs_embeds=embeds, attention_mask=mask)
        if stack is self.stacks()[1]:
            kw.update(cache=None, position_ids=position_ids, allow_is_causal_skip=False)
            return {FULL: mu.create_causal_mask(**kw),
                    SLIDING: mu.create_sliding_window_causal_mask(**kw)}
        band = sliding_window_mask_function(stack.config.sliding_window, is_causal=False)
        return {FULL: mu.create_bidirectional_mask(**kw),
                SLIDING: mu.create_bidirectional_mask(**kw, and_mask_function=band)}

    def stack_inputs(self, stack: nn.Module, ids: torch.Tensor, embeds: torch.Tensor,
                     mask: torch.Tensor | None, positions: torch.Tensor | None,
                     cross: Any) -> tuple[torch.Tensor, GemmaStackInputs]:
        """As T5Gemma's, without a default 2-D mask, with a rotary cos / sin per layer type
        and, in the decoder (``cross`` given), each self-attention mask joined with ``cross``
        along the keys."""
        positions = _positions(positions, embeds)
        masks = self.self_masks(stack, embeds, mask, positions)
        if cross is not None:
            masks = {kind: torch.cat([m, cross], dim=-1) for kind, m in masks.items()}
        rotary = {kind: stack.rotary_emb(embeds, positions, kind)
                  for kind in set(stack.config.layer_types)}
        return self.scaled(stack, embeds), GemmaStackInputs(masks, positions, rotary)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        self.check_inputs(microbatch)
        return super().embed(microbatch)

    def cross_mask(self, microbatch: Microbatch, dec_embeds: torch.Tensor,
                   enc_embeds: torch.Tensor) -> Any:
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(
            config=self.stacks()[1].config, inputs_embeds=dec_embeds,
            attention_mask=microbatch.get("attention_mask"), encoder_hidden_states=enc_embeds,
            allow_is_bidirectional_skip=False)

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        dec = self.stacks()[1]
        kind, inputs = dec.config.layer_types[i], ctx.dec_mask
        return dec.layers[i](hidden, inputs.rotary[kind], inputs.masks[kind],
                             inputs.position_ids, None, False, self.made(ctx, "enc_out"))

    def softcap(self) -> float | None:
        return self.model.config.decoder.final_logit_softcapping
