"""Adapter for ``WhisperForConditionalGeneration`` (speech-to-text fine-tuning).

The encoder-decoder units of models/seq2seq.py ([Note: encoder-decoder units]) with Whisper's
inputs: E runs the audio front end (``conv1`` -> GELU -> ``conv2`` -> GELU, the fixed sinusoidal
``embed_positions``, dropout) on ``input_features`` (m, num_mel_bins, 2 x max_source_positions)
and embeds the decoder's tokens (``embed_tokens`` + learned positions, dropout); the first decoder
unit makes the encoder's output with the encoder's final ``layer_norm``; H = the decoder's final
``layer_norm`` and ``proj_out`` (tied to ``embed_tokens``). As the model's own forward: no mask on
the encoder or the cross-attention (Whisper ignores ``attention_mask`` there), the decoder's
causal mask from ``decoder_attention_mask``, ``decoder_input_ids`` = ``shift_tokens_right`` of
``labels`` with ``decoder_start_token_id``, the loss the mean cross entropy over labels != -100.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import require_key
from hf_cephalo.models.seq2seq import BartStagedModel, Seq2SeqContext
from hf_cephalo.models.seq2seq_families import FinalNorms


class WhisperStagedModel(FinalNorms, BartStagedModel):
    """``WhisperForConditionalGeneration`` as a staged model (see the module note): BART's
    stacks, layer calls and layer-drop refusal (Whisper's layers take the same arguments), each
    stack's final ``layer_norm`` (``FinalNorms``), Whisper's own inputs and head.

    Microbatch keys: ``input_features`` (m, num_mel_bins, 2 x max_source_positions) float,
    ``labels`` (m, T) with -100 ignored, optional ``decoder_input_ids`` / ``decoder_attention_mask``
    (m, T). Raises ValueError (at construction) for SpecAugment (``apply_spec_augment``: its
    masks are drawn from numpy's global RNG per forward, which no staged schedule replays) or
    layer drop; (per microbatch, as the model's own forward) for input features of another
    length or labels longer than ``max_target_positions``."""

    model_classes = ("WhisperForConditionalGeneration",)

    def __init__(self, model: nn.Module):
        super().__init__(model)
        if getattr(model.config, "apply_spec_augment", False):
            raise ValueError(
                f"{type(model).__name__} has apply_spec_augment=True: SpecAugment masks the "
                "input features with masks drawn from numpy's global RNG in every training "
                "forward, which the staged schedule cannot replay per microbatch; set "
                "config.apply_spec_augment = False (augment the features in the data pipeline)")

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [enc.conv1, enc.conv2, enc.embed_positions, dec.embed_tokens, dec.embed_positions]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.decoder.layer_norm, self.model.proj_out]


    def encoder_input(self, input_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_features (m, mels, 2 x P) -> (the front end's output, the hidden into encoder
        layer 0), both (m, P, H)."""
        enc = self.model.model.encoder
        expected = enc.max_source_positions * enc.conv1.stride[0] * enc.conv2.stride[0]
        if input_features.shape[-1] != expected:
            raise ValueError(f"Whisper expects the mel input features to be of length {expected}"
                             f", but found {input_features.shape[-1]}. Make sure to pad the "
                             f"input mel features to {expected}.")
        embeds = F.gelu(enc.conv2(F.gelu(enc.conv1(input_features)))).permute(0, 2, 1)
        positions = torch.arange(enc.embed_positions.num_embeddings, device=embeds.device)
        hidden = embeds + enc.embed_positions(positions)
        return embeds, F.dropout(hidden, p=enc.dropout, training=enc.training)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.model.model.decoder
        embeds = dec.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1], device=embeds.device)[None].repeat(len(ids), 1)
        hidden = embeds + dec.embed_positions(ids, position_ids=position_ids).to(embeds.device)
        return embeds, F.dropout(hidden, p=dec.dropout, training=dec.training)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_features -> encoder hidden (m, P, H); the ctx with the decoder's causal mask and
        its input hidden (m, T, H) (no encoder or cross-attention mask, as the model's own)."""
        from transformers.masking_utils import create_causal_mask

        features = require_key(microbatch, "input_features", type(self).__name__)
        labels = microbatch.get("labels")
        limit = self.model.config.max_target_positions
        if labels is not None and labels.shape[1] > limit:
            raise ValueError(f"Labels' sequence length {labels.shape[1]} cannot exceed the "
                             f"maximum allowed length of {limit} tokens.")
        _, hidden = self.encoder_input(features)
        ids = self.decoder_ids(microbatch)
        dec_embeds, dec_hidden = self.decoder_input(ids)
        positions = torch.arange(ids.shape[1], device=dec_embeds.device)[None].repeat(len(ids), 1)
        dec_mask = create_causal_mask(config=self.stacks()[1].config, inputs_embeds=dec_embeds,
                                      attention_mask=microbatch.get("decoder_attention_mask"),
                                      cache=None, position_ids=positions)
        return hidden, Seq2SeqContext(enc_mask=None, dec_mask=dec_mask, cross_mask=None,
                                      dec_hidden=dec_hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.proj_out(self.model.model.decoder.layer_norm(hidden))
