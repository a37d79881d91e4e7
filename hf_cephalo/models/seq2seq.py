"""Adapters for encoder-decoder language models: T5 and BART (``...ForConditionalGeneration``).

[Note: encoder-decoder units]
One sequence of units: E | encoder layers | decoder layers | H. E embeds both token streams:
the encoder's input (the boundary into encoder layer 0) and the decoder's input, a side input
the first decoder unit reads (``decoder_input_ids`` from the microbatch, else the model's own
shift of ``labels``: T5's ``_shift_right``, BART's ``shift_tokens_right``). The first decoder
unit (index ``Le``, the number of encoder layers) takes the last encoder layer's output as its
boundary input and MAKES the encoder's output from it (``produce_side_inputs``: T5's encoder
final norm and dropout, which therefore belong to that unit; BART's encoder has none, so the
output is the boundary input itself), then runs decoder layer 0 on the decoder embeddings; every
decoder unit's cross-attention reads the encoder's output (a side input made by a unit:
engine/schedule.py [Note: side inputs]), so its gradient, summed over the decoder units, flows
back into the encoder through that unit's backward. T5's relative position bias is the same
kind of tensor: each stack's layer 0 computes it from its own ``relative_attention_bias`` and
every later layer of the stack reads it (``Seq2SeqContext.made``: encoder bias by unit 0,
encoder output and decoder bias by unit ``Le``). H is the decoder's final norm (T5) and the LM
head; the loss is the models' own cross entropy over ``labels`` as given (no shift; -100
ignored), summed.

Why adapters and not the generic path (models/generic.py): that path runs the model's own
forward with ONE layer stack swapped for stubs and needs each layer's output to go straight to
the next. Here the model's forward runs two stacks with code between them (T5's encoder final
norm and dropout, the position biases a layer hands to the next, the decoder's masks built from
the encoder's output), so staging it from the model's own code would need a second recording
pass per stack and a junction the stubs cannot see. These adapters call the models' own layers,
embeddings, mask builders and label shifts and re-state only the glue (each stack's few lines
around its layers and the head); tests/test_generic_engine_parity.py proves them equal to the
model's own forward and backward on the whole batch.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_cephalo.models.base import HeadOutput, Microbatch
from hf_cephalo.models.hf_common import HFStagedModel, require_key


def own_shift_tokens_right(model: nn.Module):
    """``shift_tokens_right`` of the modeling module of ``model``'s class, or of its nearest base
    class whose module defines one. Raises ValueError if none does."""
    for cls in type(model).__mro__:
        shift = getattr(sys.modules.get(cls.__module__), "shift_tokens_right", None)
        if shift is not None:
            return shift
    raise ValueError(f"no modeling module of {type(model).__name__} or its base classes defines "
                     "shift_tokens_right; give the microbatch decoder_input_ids")


class Seq2SeqContext(NamedTuple):
    """One microbatch's ctx: the attention masks as the models' stacks build them (encoder
    self-attention, decoder causal self-attention, decoder cross-attention), the decoder's
    input hidden states (m, T, H), a side input E makes, and ``made``: the side inputs units
    made so far, in unit order (``Seq2SeqStagedModel.made_names``)."""

    enc_mask: Any
    dec_mask: Any
    cross_mask: Any
    dec_hidden: torch.Tensor
    made: tuple = ()


class Seq2SeqStagedModel(HFStagedModel):
    """Common part of the encoder-decoder adapters ([Note: encoder-decoder units]).

    Microbatch keys: ``input_ids`` (m, S), optional ``attention_mask`` (m, S), ``labels``
    (m, T) with -100 ignored (``DataCollatorForSeq2Seq``), optional ``decoder_input_ids`` and
    ``decoder_attention_mask`` (m, T). Subclasses give the stacks, their input steps, the layer
    calls, the made side inputs and the head. Raises ValueError without ``labels`` and
    ``decoder_input_ids``, or for a model with layer drop (its layers skipped at random in
    training, which no staged schedule replays).
    """

    made_names: tuple[str, ...] = ("enc_out",)
    """The side inputs units make, in making order (``Seq2SeqContext.made``)."""

    def __init__(self, model: nn.Module):
        enc_layers, dec_layers = self.layer_lists(model)
        if not len(enc_layers) or not len(dec_layers):
            raise ValueError(f"{type(model).__name__} has {len(enc_layers)} encoder and "
                             f"{len(dec_layers)} decoder layers; hf_cephalo stages an "
                             "encoder-decoder with at least one of each")
        junction = self.junction_modules(model)
        first = nn.ModuleList([*junction, dec_layers[0]]) if junction else dec_layers[0]
        self.num_encoder_units = len(enc_layers)
        self._units = [*enc_layers, first, *list(dec_layers)[1:]]
        super().__init__(model)
        self.refuse_layer_drop()

    def token_logits_width(self) -> int:
        """V of the LM logits (m, T, V): the output projection's ``out_features`` (not its
        weight's rows: a sharded weight is a placeholder between steps), else the config's
        ``vocab_size``."""
        width = getattr(self.model.get_output_embeddings(), "out_features", None)
        return int(width) if isinstance(width, int) else \
            int(self.model.config.get_text_config().vocab_size)

    def logits_length(self, inputs: Microbatch) -> int:
        """T of the logits (m, T, ...) of ``inputs``: the decoder's positions, the width of
        ``decoder_input_ids``, else of ``labels`` (0 without either)."""
        ids = inputs.get("decoder_input_ids")
        ids = inputs.get("labels") if ids is None else ids
        return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() > 1 else 0

    # ---- family hooks -------------------------------------------------------------------
    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        """(encoder layers, decoder layers) of ``model``."""
        raise NotImplementedError

    def junction_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules between the stacks (run on the last encoder layer's output): they join the
        first decoder unit. Default: none."""
        return []

    def stacks(self) -> tuple[nn.Module, nn.Module]:
        """(encoder, decoder) stack modules (their ``config`` builds the masks)."""
        raise NotImplementedError

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The model's own labels -> ``decoder_input_ids`` shift."""
        raise NotImplementedError

    def encoder_source(self, microbatch: Microbatch) -> torch.Tensor:
        """What ``encoder_input`` takes from the microbatch: ``input_ids`` (m, S) (ValueError
        without them). Pop2Piano's adapter takes its ``input_features`` instead."""
        return require_key(microbatch, "input_ids", type(self).__name__)

    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds, hidden into encoder layer 0), both (m, S, H)."""
        raise NotImplementedError

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds, hidden into decoder layer 0), both (m, T, H)."""
        raise NotImplementedError

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """The side inputs unit ``index`` makes from its boundary input ``hidden``."""
        raise NotImplementedError

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        raise NotImplementedError

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        raise NotImplementedError

    def decoder_self_mask_input(self, mask: torch.Tensor | None,
                                embeds: torch.Tensor) -> torch.Tensor | None:
        """The 2-D mask the decoder stack hands its causal mask builder. Default: as given."""
        return mask

    def layer_drop(self) -> float:
        """The larger of the model's encoder / decoder layer-drop probabilities."""
        return 0.0

    # ---- the StagedModel contract ---------------------------------------------------------
    def refuse_layer_drop(self) -> None:
        """ValueError for a model whose layers are skipped at random in training."""
        if self.layer_drop() > 0:
            raise ValueError(
                f"{type(self.model).__name__} has layer drop {self.layer_drop()} (its layers "
                "are skipped at random in training); hf_cephalo's schedule runs every layer: "
                "set config.encoder_layerdrop = config.decoder_layerdrop = 0")

    def units(self) -> list[nn.Module]:
        """Encoder layers, then the decoder layers (the first with the junction modules)."""
        return list(self._units)

    def hidden_shape_changes(self) -> bool:
        """The boundary goes from (m, S, H) to (m, T, H) at the first decoder unit."""
        return True

    def produces_side_inputs(self, index: int) -> bool:
        return index in self.making_units()

    def making_units(self) -> tuple[int, ...]:
        """Units that make side inputs. Default: the first decoder unit (the encoder output)."""
        return (self.num_encoder_units,)

    def produce_side_inputs(self, index: int, hidden: torch.Tensor,
                            ctx: Seq2SeqContext) -> Seq2SeqContext:
        return ctx._replace(made=ctx.made + tuple(self.make(index, hidden, ctx)))

    def side_inputs(self, ctx: Seq2SeqContext) -> list[torch.Tensor]:
        return [ctx.dec_hidden, *ctx.made]

    def with_side_inputs(self, ctx: Seq2SeqContext, tensors: list) -> Seq2SeqContext:
        return ctx._replace(dec_hidden=tensors[0], made=tuple(tensors[1:]))

    def made(self, ctx: Seq2SeqContext, name: str) -> torch.Tensor:
        """The made side input ``name`` of ``made_names`` in ``ctx``."""
        return ctx.made[self.made_names.index(name)]

    def decoder_ids(self, microbatch: Microbatch) -> torch.Tensor:
        """``decoder_input_ids`` as the model's forward takes them: given, else its shift of
        ``labels`` (ValueError with neither)."""
        ids = microbatch.get("decoder_input_ids")
        if ids is not None:
            return ids
        if microbatch.get("labels") is None:
            raise ValueError(f"{type(self).__name__}: the microbatch has neither 'labels' nor "
                             f"'decoder_input_ids' (keys present: {sorted(microbatch)}); a "
                             "seq2seq batch needs one (DataCollatorForSeq2Seq gives labels)")
        return self.shift_labels(microbatch["labels"])

    def embed(self, microbatch: Microbatch) -> tuple[torch.Tensor, Seq2SeqContext]:
        """input_ids (m, S) (``encoder_source``) -> encoder hidden (m, S, H); the ctx with the
        masks and the decoder's input hidden (m, T, H)."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        mask = microbatch.get("attention_mask")
        encoder, decoder = self.stacks()
        enc_embeds, hidden = self.encoder_input(self.encoder_source(microbatch))
        dec_embeds, dec_hidden = self.decoder_input(self.decoder_ids(microbatch))
        dec_mask = self.decoder_self_mask_input(microbatch.get("decoder_attention_mask"),
                                                dec_embeds)
        ctx = Seq2SeqContext(
            enc_mask=create_bidirectional_mask(config=encoder.config, inputs_embeds=enc_embeds,
                                               attention_mask=mask),
            dec_mask=create_causal_mask(config=decoder.config, inputs_embeds=dec_embeds,
                                        attention_mask=dec_mask, cache=None),
            cross_mask=create_bidirectional_mask(config=decoder.config, inputs_embeds=dec_embeds,
                                                 attention_mask=mask,
                                                 encoder_hidden_states=enc_embeds),
            dec_hidden=dec_hidden)
        return hidden, ctx

    def run_unit(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        """Encoder layer ``index`` (m, S, H) -> (m, S, H); decoder layer ``index - Le`` on the
        previous decoder unit's output (the first: on the decoder's input hidden) -> (m, T, H)."""
        le = self.num_encoder_units
        if index < le:
            return self.encoder_layer(index, hidden, ctx)
        return self.decoder_layer(index - le, ctx.dec_hidden if index == le else hidden, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output (m, T, H) -> logits (m, T, V) as the model's own."""
        raise NotImplementedError

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        return self.logits(hidden)

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        """The models' cross entropy over ``labels`` as given (-100 ignored), summed."""
        labels = require_key(microbatch, "labels", type(self).__name__)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   labels.reshape(-1).to(logits.device), ignore_index=-100,
                                   reduction="sum")
        return HeadOutput(loss_sum, int((labels != -100).sum()))

    def count_items(self, microbatch: Microbatch) -> int:
        """Label tokens != -100 (0 without ``labels``)."""
        labels = microbatch.get("labels")
        return 0 if labels is None else int((labels != -100).sum())


class T5StagedModel(Seq2SeqStagedModel):
    """``T5ForConditionalGeneration`` (T5, T5 v1.1, mT5-style configs): units = encoder
    ``block``s, then decoder ``block``s (the first with the encoder's ``final_layer_norm``).
    E = ``shared`` (the stacks' ``embed_tokens`` are tied to it); H = the decoder's final norm
    and ``lm_head`` (scaled by d_model^-0.5 where ``scale_decoder_outputs``)."""

    model_classes = ("T5ForConditionalGeneration",)
    made_names = ("enc_bias", "enc_out", "dec_bias")

    def body(self, model: nn.Module) -> nn.Module:
        """The module of ``model`` holding ``shared``, ``encoder`` and ``decoder``: the model
        itself here (a head whose backbone is a submodule, ``transformer``, overrides it)."""
        return model

    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        return self.body(model).encoder.block, self.body(model).decoder.block

    def junction_modules(self, model: nn.Module) -> list[nn.Module]:
        return [self.body(model).encoder.final_layer_norm]

    def stacks(self) -> tuple[nn.Module, nn.Module]:
        return self.body(self.model).encoder, self.body(self.model).decoder

    def making_units(self) -> tuple[int, ...]:
        return (0, self.num_encoder_units)

    def embed_modules(self) -> list[nn.Module]:
        m = self.body(self.model)
        return [m.shared, m.encoder.embed_tokens, m.decoder.embed_tokens]

    def head_modules(self) -> list[nn.Module]:
        return [self.stacks()[1].final_layer_norm, self.model.lm_head]

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self.model._shift_right(labels)

    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.stacks()[0]
        embeds = enc.embed_tokens(input_ids)
        return embeds, enc.dropout(embeds)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.stacks()[1]
        embeds = dec.embed_tokens(ids)
        return embeds, dec.dropout(embeds)

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        """Unit 0: the encoder's position bias (1, heads, S, S); unit Le: the encoder's output
        (final norm, dropout) and the decoder's position bias (1, heads, T, T)."""
        enc, dec = self.stacks()
        if index == 0:
            s = hidden.shape[1]
            return [enc.block[0].layer[0].SelfAttention.compute_bias(s, s, device=hidden.device)]
        t = ctx.dec_hidden.shape[1]
        bias = dec.block[0].layer[0].SelfAttention.compute_bias(t, t, device=hidden.device)
        return [enc.dropout(enc.final_layer_norm(hidden)), bias]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.stacks()[0].block[i](hidden, ctx.enc_mask,
                                           self.made(ctx, "enc_bias"))[0]

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        # the cross-attention's bias: None lets each layer make its zeros, as layer 0 does
        return self.stacks()[1].block[i](
            hidden, ctx.dec_mask, self.made(ctx, "dec_bias"), self.made(ctx, "enc_out"),
            ctx.cross_mask, None, cache=None)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dec = self.stacks()[1]
        out = dec.dropout(dec.final_layer_norm(hidden))
        if self.model.config.scale_decoder_outputs:
            out = out * (self.model.model_dim ** -0.5)
        return self.model.lm_head(out)


class BartStagedModel(Seq2SeqStagedModel):
    """``BartForConditionalGeneration``: units = encoder ``layers``, then decoder ``layers``.
    E = ``shared``, each stack's (tied) token and learned position embeddings and embedding
    LayerNorm; H = ``lm_head`` (tied to ``shared``) plus ``final_logits_bias``. BART's encoder
    output is its last layer's output: the first decoder unit makes it as a copy of its
    boundary input (the stash may move that tensor off the device)."""

    model_classes = ("BartForConditionalGeneration",)

    def layer_lists(self, model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
        return model.model.encoder.layers, model.model.decoder.layers

    def stacks(self) -> tuple[nn.Module, nn.Module]:
        return self.model.model.encoder, self.model.model.decoder

    def layer_drop(self) -> float:
        cfg = self.model.config
        return max(cfg.encoder_layerdrop, cfg.decoder_layerdrop)

    def embed_modules(self) -> list[nn.Module]:
        enc, dec = self.stacks()
        return [self.model.model.shared, enc.embed_tokens, enc.embed_positions,
                enc.layernorm_embedding, dec.embed_tokens, dec.embed_positions,
                dec.layernorm_embedding]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.lm_head]

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The model's own ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)``:
        each family's modeling module has its copy (BART, Marian, Pegasus, Blenderbot, LED,
        Whisper, ...), taken from the module of the model's class or of its nearest base class
        that defines one (a user's subclass lives elsewhere). mBART and PLBart shift without a
        start token and override this."""
        cfg = self.model.config
        return own_shift_tokens_right(self.model)(labels, cfg.pad_token_id,
                                                  cfg.decoder_start_token_id)

    def encoder_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.model.model.encoder
        embeds = enc.embed_tokens(input_ids)
        hidden = embeds + enc.embed_positions(embeds[:, :, -1]).to(embeds.device)
        hidden = enc.layernorm_embedding(hidden)
        return embeds, F.dropout(hidden, p=enc.dropout, training=enc.training)

    def decoder_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dec = self.model.model.decoder
        embeds = dec.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1], device=embeds.device)
        hidden = embeds + dec.embed_positions(ids, 0, position_ids=position_ids).to(embeds.device)
        hidden = dec.layernorm_embedding(hidden)
        return embeds, F.dropout(hidden, p=dec.dropout, training=dec.training)

    def decoder_self_mask_input(self, mask: torch.Tensor | None,
                                embeds: torch.Tensor) -> torch.Tensor | None:
        if mask is None:  # as BartDecoder.forward: all ones
            return torch.ones(embeds.shape[:2], device=embeds.device)
        return mask

    def make(self, index: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> list:
        return [hidden.clone()]

    def encoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.model.model.encoder.layers[i](hidden, ctx.enc_mask)

    def decoder_layer(self, i: int, hidden: torch.Tensor, ctx: Seq2SeqContext) -> torch.Tensor:
        return self.model.model.decoder.layers[i](
            hidden, ctx.dec_mask, self.made(ctx, "enc_out"),
            encoder_attention_mask=ctx.cross_mask, cache=None, use_cache=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        return logits + self.model.final_logits_bias.to(logits.device)
