"""Adapters for more of BART's kin: Blenderbot, Blenderbot-small, PLBart, MVP, M2M100, FSMT,
BigBird-Pegasus, LED and PEGASUS-X's ``...ForConditionalGeneration``.

The units and side inputs of models/seq2seq.py ([Note: encoder-decoder units], BART's adapter)
and, where a family has them, each stack's final norms (``FinalNorms``,
models/seq2seq_families.py). What differs is each family's own code around the layers,
re-stated as its forward has it, with its own modules and label shift called:

* Blenderbot: token embeddings scaled inside the embedding module, learned positions, no
  embedding LayerNorm; each stack's final ``layer_norm`` (pre-LN layers).
* Blenderbot-small: the encoder scales its token embeddings by ``embed_scale`` and normalises
  tokens plus positions; the decoder neither scales nor normalises the positions (its forward
  applies ``layernorm_embedding`` to the token embeddings alone, then adds the positions).
* PLBart: BART's embeddings and layers with mBART's label shift (each row's last non-pad token,
  the language id, moves to the front: PLBart has no single decoder start token).
* MVP: BART's layout with ``embed_scale`` outside the embedding, positions from the ids, layers
  that take (and here get no) prompts and return tuples; its prompt tuning (``use_prompt``) is
  refused. The decoder's causal mask is built from ``decoder_attention_mask`` as given.
* M2M100: scaled token embeddings, sinusoidal positions counted from each row's non-pad tokens,
  final norms, a head without ``final_logits_bias``.
* FSMT: fairseq's layers, which run sequence-first and take key-padding masks; its decoder's
  input without ``decoder_input_ids`` is its shift of ``input_ids`` (see ``FSMTStagedModel``).
* BigBird-Pegasus: Blenderbot's embeddings, final norms named ``layernorm_embedding``, BART's
  head; full attention only (block-sparse attention is refused).
* LED: BART's layout under ``model.led``, an encoder of Longformer layers on the input padded
  to a multiple of ``attention_window`` (see ``LEDStagedModel``).
* PEGASUS-X: encoder layers that carry global tokens beside the tokens, joined into one
  boundary between units (see ``PegasusXStagedModel``).

Each loss is the model's own mean cross entropy over ``labels`` (-100 ignored); layer drop is
refused as for BART (M2M100's default config has 0.05: set both to 0 to train it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_cephalo.models.base import Microbatch
from hf_cephalo.models.hf_common import require_key
from hf_cephalo.models.seq2seq import BartStagedModel, Seq2SeqContext
from hf_cephalo.models.seq2seq_families import FinalNorms, MarianStagedModel


NOT_EXACT = {
    "NllbMoeForConditionalGeneration": (
        "its MoE layers route over the whole batch's tokens at once (each expert takes at most "
        "expert_capacity of them, counted across the batch, in order or by router probability), "
        "so a token's experts depend on the other rows and microbatches do not compute what "
        "the model computes on the whole batch (its default config also has layer drop 0.05)"),
}
"""Encoder-decoders of BART's kin that no adapter can train exactly -> why (the registry's
refusal of them says it)."""


def _dropout(hidden: torch.Tensor, stack: nn.Module) -> torch.Tensor:
    """The stack's embedding dropout (``stack.dropout`` is a probability in these families)."""
    return F.dropout(hidden, p=stack.dropout, training=stack.training)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Decoder positions 0..T-1 (T,), as the decoders make them without a cache."""
    return torch.arange(ids.shape[1], device=ids.device)


class BlenderbotStagedModel(FinalNorms, MarianStagedModel):
    """``BlenderbotForConditionalGeneration``: Marian's embedding modules (no embedding
    LayerNorm) with the scale inside ``embed_tokens``, learned positions, each stack's final
    ``layer_norm`` (``FinalNorms``), BART's label shift (Blenderbot's copy of it)."""

    model_classes = ("BlenderbotForConditionalGeneration",)


    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids)
        return embeds, _dropout(embeds + enc.embed_positions(embeds.shape[:-1]), enc)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids)
        hidden = embeds + dec.embed_positions(ids.shape, 0, position_ids=_positions(ids))
        return embeds, _dropout(hidden, dec)


class BlenderbotSmallStagedModel(BartStagedModel):
    """``BlenderbotSmallForConditionalGeneration``: BART's modules, layers, head and label shift
    (Blenderbot-small's copy), its own embedding steps (see the module note)."""

    model_classes = ("BlenderbotSmallForConditionalGeneration",)


    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids) * enc.embed_scale
        hidden = enc.layernorm_embedding(embeds + enc.embed_positions(embeds.shape[:-1]))
        return embeds, _dropout(hidden, enc)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids)  # the decoder's forward does not scale them
        positions = dec.embed_positions(ids.shape, 0, position_ids=_positions(ids))
        return embeds, _dropout(dec.layernorm_embedding(embeds) + positions, dec)


class PLBartStagedModel(BartStagedModel):
    """``PLBartForConditionalGeneration``: BART's units, embeddings and head; PLBart's label
    shift (mBART's rule, see the module note)."""

    model_classes = ("PLBartForConditionalGeneration",)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        from transformers.models.plbart.modeling_plbart import shift_tokens_right

        return shift_tokens_right(labels, self.model.config.pad_token_id)


class MvpStagedModel(BartStagedModel):
    """``MvpForConditionalGeneration``: BART's modules and head, MVP's embedding steps and
    layer calls (see the module note). Raises ValueError for a model with ``use_prompt``: its
    layer-wise prompts are made once per forward by modules every layer reads, which no unit
    owns."""

    model_classes = ("MvpForConditionalGeneration",)

    def __init__(self, model: nn.Module):
        if getattr(model.config, "use_prompt", False):
            raise ValueError(
                f"{type(model).__name__} has use_prompt=True: its layer-wise prompts are made "
                "once per forward by the encoder's and decoder's prompt modules and read by every "
                "layer, which hf_cephalo's units (each owning its own parameters) do not stage; "
                "fine-tune it with config.use_prompt = False")
        super().__init__(model)


    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids) * enc.embed_scale
        hidden = enc.layernorm_embedding(embeds + enc.embed_positions(input_ids))
        return embeds, _dropout(hidden, enc)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids) * dec.embed_scale
        hidden = dec.layernorm_embedding(embeds + dec.embed_positions(ids, 0))
        return embeds, _dropout(hidden, dec)

    def decoder_self_mask_input(self, mask: torch.Tensor | None,
                                embeds: torch.Tensor) -> torch.Tensor | None:
        return mask  # MvpDecoder.forward builds its causal mask from the mask as given

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.model.model.encoder.layers[i](hidden, ctx.enc_mask, self_attn_prompt=None)[0]

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.model.model.decoder.layers[i](
            hidden, ctx.dec_mask, self.made(ctx, "enc_out"), encoder_attention_mask=ctx.cross_mask,
            self_attn_prompt=None, cross_attn_prompt=None, cache=None, use_cache=False)[0]


class M2M100StagedModel(FinalNorms, MarianStagedModel):
    """``M2M100ForConditionalGeneration``: Marian's embedding modules with the scale inside
    ``embed_tokens``, M2M100's sinusoidal positions (from the ids: pad tokens keep the pad
    position), each stack's final ``layer_norm``; H = the decoder's norm and ``lm_head`` (no
    ``final_logits_bias``)."""

    model_classes = ("M2M100ForConditionalGeneration",)


    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids)
        positions = enc.embed_positions(input_ids, embeds).to(embeds.device)
        return embeds, _dropout(embeds + positions, enc)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids)
        positions = dec.embed_positions(ids, embeds, 0).to(embeds.device)
        return embeds, _dropout(embeds + positions, dec)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.decoder.layer_norm(hidden))


class FSMTMasks(NamedTuple):
    """FSMT's decoder masks as its forward makes them: ``causal`` (T, T) float, -inf above the
    diagonal; ``padding`` (m, T) bool, True at pad tokens (None where the decoder's input has
    none and no ``decoder_attention_mask`` is given)."""

    causal: torch.Tensor
    padding: torch.Tensor | None


class FSMTStagedModel(BartStagedModel):
    """``FSMTForConditionalGeneration`` (fairseq's WMT19 translation models): BART's units with
    FSMT's own code around them. Its layers run sequence-first (S, m, H): each unit transposes
    the (m, S, H) boundary in and out. Masks are key-padding masks (True at padding), the
    decoder's causal mask additive, all made as ``FSMTModel.forward`` makes them; no
    ``decoder_input_ids`` means the model's own shift of ``input_ids`` (not of ``labels``: its
    forward's fairseq default), each row's last non-pad token moved to the front. Token
    embeddings are scaled by ``embed_scale``, positions sinusoidal from the non-pad tokens; H
    = the decoder's ``output_projection``; the loss the mean cross entropy over ``labels``."""

    model_classes = ("FSMTForConditionalGeneration",)

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [enc.embed_tokens, enc.embed_positions, dec.embed_tokens, dec.embed_positions]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.decoder.output_projection]

    def decoder_ids(self, microbatch: Microbatch) -> torch.Tensor:
        """``decoder_input_ids`` as given, else FSMT's shift of ``input_ids`` (m, T)."""
        from transformers.models.fsmt.modeling_fsmt import shift_tokens_right

        ids = microbatch.get("decoder_input_ids")
        if ids is not None:
            return ids
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        return shift_tokens_right(input_ids.clone(), self.model.config.pad_token_id)

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_ids (m, S) -> encoder hidden (m, S, H); the ctx with the key-padding masks
        (``cross_mask`` = ``enc_mask``), ``FSMTMasks`` as ``dec_mask`` and the decoder's input
        hidden (m, T, H)."""
        from transformers.models.fsmt.modeling_fsmt import (_prepare_fsmt_decoder_inputs,
                                                            invert_mask)

        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        mask = microbatch.get("attention_mask")
        enc, dec = self.stacks()
        ids, padding, causal = _prepare_fsmt_decoder_inputs(
            self.model.config, input_ids, decoder_input_ids=self.decoder_ids(microbatch),
            decoder_padding_mask=microbatch.get("decoder_attention_mask"),
            causal_mask_dtype=dec.embed_tokens.weight.dtype)
        hidden = enc.embed_tokens(input_ids) * enc.embed_scale + enc.embed_positions(input_ids)
        dec_hidden = dec.embed_tokens(ids) * dec.embed_scale + dec.embed_positions(ids)
        key_padding = None if mask is None else invert_mask(mask)
        return _dropout(hidden, enc), Seq2SeqContext(
            enc_mask=key_padding, dec_mask=FSMTMasks(causal, padding), cross_mask=key_padding,
            dec_hidden=_dropout(dec_hidden, dec))

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        out = self.model.model.encoder.layers[i](hidden.transpose(0, 1), ctx.enc_mask)[0]
        return out.transpose(0, 1)

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        out = self.model.model.decoder.layers[i](
            hidden.transpose(0, 1), self.made(ctx, "enc_out").transpose(0, 1),
            encoder_attn_mask=ctx.cross_mask, layer_state=None, causal_mask=ctx.dec_mask.causal,
            decoder_padding_mask=ctx.dec_mask.padding)[0]
        return out.transpose(0, 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.decoder.output_projection(hidden)


class BigBirdPegasusStagedModel(BlenderbotStagedModel):
    """``BigBirdPegasusForConditionalGeneration`` with full attention: Blenderbot's embedding
    steps (scaled token embeddings, learned positions), each stack's ``layernorm_embedding``
    applied after its layers (as BigBird-Pegasus's forward does: its final norms), BART's head
    (``lm_head`` plus ``final_logits_bias``) and label shift (BigBird-Pegasus's copy).

    Raises ValueError for an encoder with block-sparse attention (``attention_type``
    ``"block_sparse"``, the default config's): not staged yet (the encoder pads its input to a
    multiple of ``block_size``, builds block masks and falls back to full attention per
    forward, all inside its forward). Its own forward switches a model to full attention for
    rows of at most (5 + 2 x num_random_blocks) x block_size tokens, as on the check's tiny
    copy."""

    model_classes = ("BigBirdPegasusForConditionalGeneration",)
    final_norm_name = "layernorm_embedding"

    def __init__(self, model: nn.Module):
        kind = model.model.encoder.attention_type
        if kind != "original_full":
            cfg = model.config
            limit = (5 + 2 * cfg.num_random_blocks) * cfg.block_size
            raise ValueError(
                f"{type(model).__name__} has attention_type={kind!r}: hf_cephalo stages "
                "BigBird-Pegasus with full attention only (block-sparse attention pads the "
                "encoder's input to a multiple of block_size and builds its block masks inside "
                "the encoder's forward; not staged yet). Train it with full attention: "
                "model.model.encoder.set_attention_type('original_full') (its own forward "
                f"switches to it for inputs of at most {limit} tokens)")
        super().__init__(model)


class LEDEncoderMasks(NamedTuple):
    """LED's encoder masks as its forward makes them over the input padded to a multiple of
    ``attention_window``: ``mask`` (m, S') float (0 local, negative at padding, positive at
    global tokens), ``is_index_masked`` / ``is_index_global_attn`` (m, S') bool,
    ``is_global_attn`` (any global token in the microbatch) and ``length``, S before the
    padding (the encoder's output is cut back to it)."""

    mask: torch.Tensor
    is_index_masked: torch.Tensor
    is_index_global_attn: torch.Tensor
    is_global_attn: bool
    length: int


class LEDStagedModel(BartStagedModel):
    """``LEDForConditionalGeneration`` (Longformer-Encoder-Decoder): BART's layout under
    ``model.led``; the encoder's Longformer layers (sliding-window attention plus global
    tokens from an optional ``global_attention_mask`` (m, S)) run on the input padded to a
    multiple of ``attention_window`` with ``LEDEncoderMasks``, by the encoder's own
    ``_merge_to_attention_mask`` and ``_pad_to_window_size``; the first decoder unit cuts the
    encoder's output back to S. Unscaled token embeddings, learned positions and
    ``layernorm_embedding`` in both stacks; the decoder's causal mask from
    ``decoder_attention_mask`` as given; H = ``lm_head`` plus ``final_logits_bias``."""

    model_classes = ("LEDForConditionalGeneration",)

    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        return model.led.encoder.layers, model.led.decoder.layers

    def stacks(self) -> tuple[nn.Module, nn.Module]:
        return self.model.led.encoder, self.model.led.decoder

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [self.model.led.shared, enc.embed_tokens, enc.embed_positions,
                enc.layernorm_embedding, dec.embed_tokens, dec.embed_positions,
                dec.layernorm_embedding]


    def encoder_input(self, microbatch: Microbatch) -> tuple[torch.Tensor, LEDEncoderMasks]:
        """input_ids (m, S) -> (the hidden into encoder layer 0 (m, S', H), its masks)."""
        from transformers.models.led.modeling_led import _prepare_4d_attention_mask_inverted

        enc = self.stacks()[0]
        input_ids = require_key(microbatch, "input_ids", type(self).__name__)
        embeds = enc.embed_tokens(input_ids)
        mask = microbatch.get("attention_mask")
        mask = torch.ones(embeds.shape[:-1], device=embeds.device, dtype=torch.long) \
            if mask is None else mask
        if microbatch.get("global_attention_mask") is not None:
            mask = enc._merge_to_attention_mask(mask, microbatch["global_attention_mask"])
        _, ids, mask, embeds = enc._pad_to_window_size(
            input_ids=input_ids, attention_mask=mask, inputs_embeds=embeds,
            pad_token_id=self.model.config.pad_token_id)
        mask = _prepare_4d_attention_mask_inverted(mask, embeds.dtype)[:, 0, 0, :]
        hidden = enc.layernorm_embedding(embeds + enc.embed_positions(ids.size()))
        glob = mask > 0
        return _dropout(hidden, enc), LEDEncoderMasks(mask, mask < 0, glob,
                                                      bool(glob.flatten().any().item()),
                                                      input_ids.shape[1])

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_ids (m, S) -> encoder hidden (m, S', H); the ctx with ``LEDEncoderMasks``, the
        decoder's masks and its input hidden (m, T, H)."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        hidden, enc_masks = self.encoder_input(microbatch)
        dec = self.stacks()[1]
        ids = self.decoder_ids(microbatch)
        embeds = dec.embed_tokens(ids)
        dec_hidden = dec.layernorm_embedding(embeds + dec.embed_positions(ids.size(), 0))
        dec_mask = None if ids.shape[1] <= 1 else create_causal_mask(
            config=dec.config, inputs_embeds=embeds,
            attention_mask=microbatch.get("decoder_attention_mask"), cache=None)
        cross_mask = create_bidirectional_mask(
            config=dec.config, inputs_embeds=embeds, attention_mask=microbatch.get(
                "attention_mask"), encoder_hidden_states=hidden[:, :enc_masks.length])
        return hidden, Seq2SeqContext(enc_mask=enc_masks, dec_mask=dec_mask,
                                      cross_mask=cross_mask, dec_hidden=_dropout(dec_hidden, dec))

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output: the last encoder layer's, cut back to the S input tokens."""
        return [hidden[:, :ctx.enc_mask.length].clone()]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        masks = ctx.enc_mask
        return self.model.led.encoder.layers[i](
            hidden, attention_mask=masks.mask, is_index_masked=masks.is_index_masked,
            is_index_global_attn=masks.is_index_global_attn,
            is_global_attn=masks.is_global_attn)[0]

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.model.led.decoder.layers[i](
            hidden, ctx.dec_mask, self.made(ctx, "enc_out"),
            encoder_attention_mask=ctx.cross_mask, cache=None, use_cache=False)[0]


class PegasusXEncoderMask(NamedTuple):
    """PEGASUS-X's encoder mask as its forward makes it: ``mask`` (m, S') float, 0 at tokens
    and the dtype's minimum at padding (S' = S padded to a multiple of ``block_size``), and
    ``length`` S (the encoder's output is cut back to it)."""

    mask: torch.Tensor
    length: int


class PegasusXStagedModel(BlenderbotStagedModel):
    """``PegasusXForConditionalGeneration``: Blenderbot's embedding modules plus the encoder's
    ``embed_global`` (its global tokens), the encoder's input padded to a multiple of
    ``block_size``, each stack's final ``layer_norm``, ``lm_head`` without a bias.

    PEGASUS-X's encoder layers take and return two tensors, the tokens' (m, S', H) and the
    global tokens' (m, G, H) hidden states: the boundary between encoder units is both joined
    along the sequence (m, S' + G, H), split again in each unit (an exact copy either way); the
    first decoder unit makes the encoder's output from the tokens' part, cut back to S, with
    the encoder's final norm."""

    model_classes = ("PegasusXForConditionalGeneration",)

    def embed_modules(self) -> list[nn.Module]:
        return [*super().embed_modules(), self.stacks()[0].embed_global]


    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_ids (m, S) -> the encoder's tokens and global tokens (m, S' + G, H); the ctx
        with ``PegasusXEncoderMask``, the decoder's masks and input hidden (m, T, H)."""
        hidden, ctx = super().embed(microbatch)
        enc = self.stacks()[0]
        mask = microbatch.get("attention_mask")
        mask = torch.ones(*hidden.shape[:-1], dtype=hidden.dtype, device=hidden.device) \
            if mask is None else mask.to(dtype=hidden.dtype)
        lowest, inverted = torch.finfo(hidden.dtype).min, 1.0 - mask
        mask = inverted.masked_fill(inverted.to(torch.bool), lowest)
        batch_size, length, _ = hidden.shape
        if length % self.model.config.block_size != 0:  # as PegasusXEncoder.forward
            pad = self.model.config.block_size - length % self.model.config.block_size
            hidden = F.pad(hidden, pad=(0, 0, 0, pad), value=0)
            mask = F.pad(mask, pad=(0, pad), value=lowest)
        ids = torch.arange(self.model.config.num_global_tokens, device=hidden.device)
        hidden = torch.cat([hidden, enc.embed_global(ids[None].expand(batch_size, -1))], dim=1)
        return hidden, ctx._replace(enc_mask=PegasusXEncoderMask(mask, length))

    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids)
        return embeds, _dropout(embeds + enc.embed_positions(embeds), enc)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids)
        positions = dec.embed_positions(embeds, 0, _positions(ids)[:, None])
        return embeds, _dropout(embeds + positions, dec)

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        split = hidden.shape[1] - self.model.config.num_global_tokens
        tokens, global_tokens = self.stacks()[0].layers[i](
            hidden[:, :split], hidden[:, split:], ctx.enc_mask.mask)
        return torch.cat([tokens, global_tokens], dim=1)

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The encoder's output: its final ``layer_norm`` of the tokens' part, cut back to S."""
        return [self.stacks()[0].layer_norm(hidden[:, :ctx.enc_mask.length])]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.decoder.layer_norm(hidden))
