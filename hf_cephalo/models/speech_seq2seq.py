"""Adapters for speech-to-text encoder-decoders beside Whisper's (models/whisper.py):
``Speech2TextForConditionalGeneration`` and ``MoonshineForConditionalGeneration``.

The encoder-decoder units of models/seq2seq.py ([Note: encoder-decoder units]): E runs the
model's own audio front end on the microbatch's audio and embeds the decoder's tokens; the first
decoder unit makes the encoder's output with the encoder's final norm; H is the decoder's final
norm and the LM head; the loss is the model's own mean cross entropy over ``labels`` (-100
ignored), the decoder's input its own shift of them. As each model's forward:

* Speech2Text: ``input_features`` (m, frames, input_feat_per_channel x input_channels) through
  the convolutional subsampler (``conv``: stride-2 convolutions with GLU), scaled by
  ``embed_scale``, plus sinusoidal positions counted over the subsampled frames that are not
  padding; a frame ``attention_mask`` (m, frames) is subsampled by the model's own
  ``_get_feature_vector_attention_mask`` and masks the encoder and the cross-attention. The
  decoder scales its token embeddings by ``embed_scale`` and adds sinusoidal positions counted
  over its non-pad tokens; its causal mask comes from ``decoder_attention_mask`` as given.
* Moonshine: raw audio ``input_values`` (m, samples) through ``conv1`` -> tanh -> ``groupnorm``
  -> ``conv2`` -> GELU -> ``conv3`` -> GELU; an ``attention_mask`` (m, samples) is strided down
  to the frames (every 384th sample). Both stacks use rotary positions (each layer's cos / sin
  are made in its unit from the stack's parameter-free ``rotary_emb``, as the stack's forward
  makes them once); the head is ``proj_out`` (tied to the decoder's ``embed_tokens``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import require_key
from hf_cephalo.models.seq2seq import BartStagedModel, Seq2SeqContext
from hf_cephalo.models.seq2seq_families import FinalNorms


class AudioInput(NamedTuple):
    """The encoder's input from the audio: the front end's output ``embeds`` (m, P, H) (the
    mask builders read its shape), ``hidden`` (m, P, H) into encoder layer 0 and the frame
    mask (m, P) (None without an ``attention_mask``)."""

    embeds: torch.Tensor
    hidden: torch.Tensor
    frame_mask: torch.Tensor | None


def _audio_context(staged: BartStagedModel, microbatch: Microbatch, audio: AudioInput,
                   self_mask: torch.Tensor | None) -> Seq2SeqContext:
    """The masks as the model's stacks build them (encoder and cross-attention from the frame
    mask, the decoder's causal mask from ``self_mask``) and the decoder's input hidden."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    encoder, decoder = staged.stacks()
    ids = staged.decoder_ids(microbatch)
    dec_embeds, dec_hidden = staged.decoder_input(ids)
    positions = torch.arange(ids.shape[1], device=dec_embeds.device)[None]
    return Seq2SeqContext(
        enc_mask=create_bidirectional_mask(config=encoder.config, inputs_embeds=audio.embeds,
                                           attention_mask=audio.frame_mask),
        dec_mask=create_causal_mask(config=decoder.config, inputs_embeds=dec_embeds,
                                    attention_mask=self_mask, cache=None, position_ids=positions),
        cross_mask=create_bidirectional_mask(config=decoder.config, inputs_embeds=dec_embeds,
                                             attention_mask=audio.frame_mask,
                                             encoder_hidden_states=audio.embeds),
        dec_hidden=dec_hidden)


class Speech2TextStagedModel(FinalNorms, BartStagedModel):
    """``Speech2TextForConditionalGeneration`` (see the module note): BART's stacks, layer calls
    and layer-drop refusal, each stack's final ``layer_norm`` (``FinalNorms``), Speech2Text's
    audio front end, embeddings, label shift and head (``lm_head``, no bias).

    Microbatch keys: ``input_features`` (m, frames, features) float, optional ``attention_mask``
    (m, frames), ``labels`` (m, T) with -100 ignored, optional ``decoder_input_ids`` /
    ``decoder_attention_mask`` (m, T). Raises ValueError (per microbatch) without
    ``input_features``, or without both ``labels`` and ``decoder_input_ids``."""

    model_classes = ("Speech2TextForConditionalGeneration",)

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [enc.conv, enc.embed_positions, dec.embed_tokens, dec.embed_positions]


    def audio_input(self, features: torch.Tensor, mask: torch.Tensor | None) -> AudioInput:
        """input_features (m, frames, C) and their mask (m, frames) -> ``AudioInput`` over the
        subsampled frames, as ``Speech2TextEncoder.forward``."""
        enc = self.stacks()[0]
        embeds = enc.conv(features) * enc.embed_scale
        if mask is not None:
            mask = enc._get_feature_vector_attention_mask(embeds.shape[1], mask)
            padding = mask.ne(1).long()
        else:
            padding = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        hidden = embeds + enc.embed_positions(padding)
        return AudioInput(embeds, F.dropout(hidden, p=enc.dropout, training=enc.training), mask)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids) * dec.embed_scale
        hidden = embeds + dec.embed_positions(ids, cache_length=0)
        return embeds, F.dropout(hidden, p=dec.dropout, training=dec.training)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_features -> encoder hidden (m, P, H) over the P subsampled frames; the ctx
        with the masks and the decoder's input hidden (m, T, H)."""
        features = require_key(microbatch, "input_features", type(self).__name__)
        audio = self.audio_input(features, microbatch.get("attention_mask"))
        ctx = _audio_context(self, microbatch, audio, microbatch.get("decoder_attention_mask"))
        return audio.hidden, ctx

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.decoder.layer_norm(hidden))


class MoonshineStagedModel(BartStagedModel):
    """``MoonshineForConditionalGeneration`` (see the module note): units = encoder ``layers``,
    then decoder ``layers`` (the first with the encoder's final ``layer_norm``); E = the audio
    front end and the decoder's ``embed_tokens``; H = the decoder's ``norm`` and ``proj_out``.

    Microbatch keys: ``input_values`` (m, samples) float, optional ``attention_mask``
    (m, samples), ``labels`` (m, T) with -100 ignored, optional ``decoder_input_ids`` /
    ``decoder_attention_mask`` (m, T). Raises ValueError (per microbatch) without
    ``input_values``, or without both ``labels`` and ``decoder_input_ids``."""

    model_classes = ("MoonshineForConditionalGeneration",)

    def layer_drop(self) -> float:
        return 0.0  # Moonshine's stacks run every layer

    def junction_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.encoder.layer_norm]

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [enc.conv1, enc.groupnorm, enc.conv2, enc.conv3, dec.embed_tokens]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.decoder.norm, self.model.proj_out]


    def audio_input(self, values: torch.Tensor, mask: torch.Tensor | None) -> AudioInput:
        """input_values (m, samples) and their mask (m, samples) -> ``AudioInput`` over the
        frames, as ``MoonshineEncoder.forward``."""
        enc = self.stacks()[0]
        hidden = enc.groupnorm(torch.tanh(enc.conv1(values.unsqueeze(1))))
        hidden = F.gelu(enc.conv3(F.gelu(enc.conv2(hidden)))).permute(0, 2, 1)
        if mask is not None:
            frames = enc._get_feat_extract_output_lengths(mask.shape[-1])
            stride = 64 * 3 * 2  # the convolutions' strides, as the encoder's forward has it
            mask = mask[..., ::stride][..., :frames]
        return AudioInput(hidden, hidden, mask)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.stacks()[1].embed_tokens(ids)
        return embeds, embeds

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_values -> encoder hidden (m, P, H) over the P frames; the ctx with the masks
        and the decoder's input hidden (m, T, H)."""
        values = require_key(microbatch, "input_values", type(self).__name__)
        audio = self.audio_input(values, microbatch.get("attention_mask"))
        ctx = _audio_context(self, microbatch, audio, microbatch.get("decoder_attention_mask"))
        return audio.hidden, ctx

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output: its final ``layer_norm`` of the last encoder layer's output."""
        return [self.model.model.encoder.layer_norm(hidden)]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        enc = self.stacks()[0]
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        return enc.layers[i](hidden, attention_mask=ctx.enc_mask, position_ids=positions,
                             position_embeddings=enc.rotary_emb(hidden, position_ids=positions))

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        dec = self.stacks()[1]
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        return dec.layers[i](
            hidden, ctx.dec_mask, self.made(ctx, "enc_out"),
            encoder_attention_mask=ctx.cross_mask, position_ids=positions, cache=None,
            use_cache=False, position_embeddings=dec.rotary_emb(hidden, position_ids=positions))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.proj_out(self.model.model.decoder.norm(hidden))
