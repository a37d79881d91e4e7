"""Task heads on the encoder-decoder adapters: question answering and sequence classification of
T5, mT5, UMT5, BART, mBART and MVP, LED's question answering, and T5Gemma's and T5Gemma 2's
token and sequence classification.

[Note: encoder-decoder task heads]
The units, embedding and side inputs are the family's seq2seq adapter's (models/seq2seq.py
[Note: encoder-decoder units], seq2seq_families.py, seq2seq_t5_kin.py); what changes is H and
where the decoder's input comes from. Without ``decoder_input_ids`` these models' forwards feed
the decoder their own shift of ``input_ids`` (T5's ``_shift_right``, BART's and mBART's
``shift_tokens_right``: the same shift their generation heads apply to ``labels``), so
``labels`` here are the task's, never the decoder's input. H is the decoder stack's output (its
final norm where the family has one: T5's norm and dropout, mBART's ``layer_norm``; BART has
none) and then:

- question answering: ``qa_outputs`` on every decoder position, (m, T, 2) start and end logits
  stacked; the loss is stock's ``(CE(start) + CE(end)) / 2`` as a sum over rows, items = rows
  (``generic_heads.answer_loss_sum``). A position outside the decoder's T positions is refused
  before the step's first collective, as on the generic path (stock ignores it with separate
  counts for the two terms).
- sequence classification: the decoder output at each row's last ``<eos>`` of ``input_ids``,
  through ``classification_head``; the loss by HF's ``problem_type`` rule as a sum
  (``ClassifierStagedModel``): items = rows (single-label), label elements (regression,
  multi-label). Stock refuses a batch whose rows have different numbers of ``<eos>`` tokens, or
  a row with none; the head refuses such a microbatch in ``count_items`` (before any
  collective), per microbatch as stock per forward call.

- token classification (T5Gemma, T5Gemma 2): ``score`` on every decoder position, the summed
  cross entropy against ``labels`` (m, S) as given, items = labels != -100.
- T5Gemma's and T5Gemma 2's sequence classification: ``score`` at each row's last non-pad
  position by the model's own rule (T5Gemma: of ``input_ids``, plus one for the decoder's
  right shift; T5Gemma 2: of the decoder's input), at most T - 1; ``problem_type``'s loss.

Every stock loss here is a mean over the batch's rows (or label elements), so the engine's
division of the summed microbatch losses by the global item count gives it exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_cephalo.models.base import HeadOutput, Microbatch
from hf_cephalo.models.generic_heads import (QA_LABELS, answer_loss_sum, check_answer_positions,
                                             token_loss_sum)
from hf_cephalo.models.hf_common import ClassifierStagedModel, require_key
from hf_cephalo.models.seq2seq import BartStagedModel, T5StagedModel
from hf_cephalo.models.seq2seq_families import MBartStagedModel
from hf_cephalo.models.seq2seq_gemma import T5Gemma2StagedModel, T5GemmaStagedModel
from hf_cephalo.models.seq2seq_kin import LEDStagedModel, MvpStagedModel
from hf_cephalo.models.seq2seq_t5_kin import UMT5StagedModel


class Seq2SeqTaskHead:
    """The part every task head shares (mixed in before a family's seq2seq adapter): the
    decoder's input is ``decoder_input_ids`` (m, T) where given, else the family's shift of
    ``input_ids`` (m, S), T = S. The family's decoder output comes from a mixin listed after
    the task head (``T5DecoderOutput``, ...): ``decoder_norms()``, the modules it uses (head
    modules), and ``decoder_output(hidden)``, the last decoder layer's output (m, T, H) -> the
    decoder stack's output (m, T, H)."""

    def decoder_ids(self, microbatch: Microbatch) -> torch.Tensor:
        """``decoder_input_ids`` as the model's forward takes them (ValueError without them
        and ``input_ids``)."""
        ids = microbatch.get("decoder_input_ids")
        if ids is not None:
            return ids
        return self.shift_labels(require_key(microbatch, "input_ids", type(self).__name__))

    def decoder_length(self, microbatch: Microbatch) -> int | None:
        """T, the decoder's positions for this microbatch (None without input ids)."""
        ids = microbatch.get("decoder_input_ids")
        ids = microbatch.get("input_ids") if ids is None else ids
        return int(ids.shape[1]) if torch.is_tensor(ids) and ids.dim() > 1 else None

    def logits_length(self, inputs: Microbatch) -> int:
        """T of per-position logits (m, T, C): the decoder's positions (0 without input ids)."""
        return self.decoder_length(inputs) or 0


class NormDropoutOutput:
    """A decoder output that is the decoder's final norm (its attribute ``norm_name``) and
    dropout of the last layer's output."""

    norm_name = "norm"

    def decoder_norms(self) -> list[nn.Module]:
        return [getattr(self.stacks()[1], self.norm_name)]

    def decoder_output(self, hidden: torch.Tensor) -> torch.Tensor:
        dec = self.stacks()[1]
        return dec.dropout(getattr(dec, self.norm_name)(hidden))


class T5DecoderOutput(NormDropoutOutput):
    """T5's decoder output: its ``final_layer_norm`` and dropout."""

    norm_name = "final_layer_norm"


class BartDecoderOutput:
    """BART's decoder output: its last layer's output (no final norm)."""

    def decoder_norms(self) -> list[nn.Module]:
        return []

    def decoder_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class MBartDecoderOutput:
    """mBART's decoder output: its final ``layer_norm``."""

    def decoder_norms(self) -> list[nn.Module]:
        return [self.stacks()[1].layer_norm]

    def decoder_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stacks()[1].layer_norm(hidden)


class GemmaDecoderOutput(NormDropoutOutput):
    """T5Gemma's and T5Gemma 2's decoder output: its final ``norm`` and dropout."""


class TransformerBody:
    """T5's classifiers keep the encoder-decoder in ``transformer`` (a ``T5Model``)."""

    def body(self, model: nn.Module) -> nn.Module:
        return model.transformer


class QuestionAnsweringHead(Seq2SeqTaskHead):
    """Extractive question answering on the decoder ([Note: encoder-decoder task heads]):
    ``head_logits`` (m, T, 2), the start and end logits stacked on the last dimension (the
    model's ``start_logits`` / ``end_logits``: ``prediction_outputs``); microbatch keys
    ``start_positions`` / ``end_positions`` (m,) or (m, 1). Raises ValueError for a position
    outside [0, T) (``count_items``, before any collective) or missing positions (the loss)."""

    prediction_outputs = ("start_logits", "end_logits")
    """The model's outputs ``head_logits`` stacks on its last dimension, in that order."""

    def token_logits_width(self) -> int:
        """2: the start and end logits of every decoder position."""
        return 2

    def head_modules(self) -> list[nn.Module]:
        return [*self.decoder_norms(), self.model.qa_outputs]

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """(m, T, H) -> (m, T, 2), as ``qa_outputs`` of the decoder's output in the model."""
        return self.model.qa_outputs(self.decoder_output(hidden))

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        positions = [require_key(microbatch, k, type(self).__name__) for k in QA_LABELS]
        return answer_loss_sum(logits, positions, type(self.model).__name__)

    def count_items(self, microbatch: Microbatch) -> int:
        """Rows (each scored once for its start and once for its end); 0 without positions."""
        positions = [microbatch.get(k) for k in QA_LABELS]
        if any(p is None for p in positions):
            return 0
        length = self.decoder_length(microbatch)
        if length is not None:
            check_answer_positions(positions, length, type(self.model).__name__)
        return int(positions[0].reshape(-1).shape[0])


class TokenClassificationHead(Seq2SeqTaskHead):
    """Token classification on the decoder ([Note: encoder-decoder task heads]): the decoder
    reads the model's shift of ``input_ids`` (T = S), ``head_logits`` (m, T, num_labels) =
    ``score`` of the decoder's output at every position; the summed cross entropy against
    ``labels`` (m, S) as given (-100 ignored, stock's ``ForTokenClassification`` loss as a sum),
    items = labels != -100. ValueError without ``labels`` (the loss)."""

    def token_logits_width(self) -> int:
        """C = ``config.num_labels`` of the logits (m, T, C)."""
        return int(self.model.config.num_labels)

    def head_modules(self) -> list[nn.Module]:
        return [*self.decoder_norms(), self.model.score]

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """(m, T, H) -> (m, T, num_labels), as ``model(**microbatch).logits``."""
        return self.model.score(self.decoder_output(hidden))

    def loss_from_logits(self, logits: torch.Tensor, microbatch: Microbatch) -> HeadOutput:
        return token_loss_sum(logits, require_key(microbatch, "labels", type(self).__name__))

    def count_items(self, microbatch: Microbatch) -> int:
        """Positions with label != -100; 0 without ``labels``."""
        labels = microbatch.get("labels")
        return 0 if labels is None else int((labels != -100).sum().item())


def eos_pooled(hidden: torch.Tensor, input_ids: torch.Tensor, eos_token_id: int,
               model_name: str) -> torch.Tensor:
    """Each row's hidden state at its last ``eos_token_id`` of ``input_ids``: hidden (m, T, H),
    input_ids (m, S) with T = S -> (m, H), as the BART and T5 classifiers pool. ValueError with
    stock's words for rows with different numbers of ``<eos>`` tokens or a row without one
    (``check_eos``)."""
    check_eos(input_ids, eos_token_id, model_name)
    eos_mask = input_ids.eq(eos_token_id).to(hidden.device)
    selected = hidden[eos_mask, :]
    return selected.view(hidden.shape[0], -1, hidden.shape[-1])[:, -1, :]


def check_eos(input_ids: torch.Tensor, eos_token_id: int | None, model_name: str) -> None:
    """ValueError unless every row of ``input_ids`` (m, S) holds the same number (>= 1) of
    ``eos_token_id`` tokens, the rule stock's classifier forward enforces per call."""
    if input_ids.shape[0] == 0:
        return
    counts = input_ids.eq(eos_token_id).sum(1) if eos_token_id is not None \
        else torch.zeros(input_ids.shape[0], dtype=torch.long)
    if torch.unique(counts).numel() != 1:
        raise ValueError(f"{model_name}: All examples must have the same number of <eos> tokens "
                         f"(the rows of this microbatch hold {counts.tolist()} of "
                         f"eos_token_id {eos_token_id}); the classifier pools each row at its "
                         "last <eos>, as stock does")
    if int(counts[0]) < 1:
        raise ValueError(f"{model_name}: Each example must contain at least one <eos> token "
                         f"(eos_token_id {eos_token_id}): the classifier pools each row at its "
                         "last <eos>, as stock does; end every row with the tokenizer's eos")


class SequenceClassificationHead(Seq2SeqTaskHead, ClassifierStagedModel):
    """Sequence classification on the decoder ([Note: encoder-decoder task heads]):
    ``head_logits`` (m, num_labels) from the decoder output at each row's last ``<eos>``;
    the loss and items of ``ClassifierStagedModel``. Raises ValueError for a microbatch whose
    rows hold different numbers of ``<eos>`` tokens or none (``count_items``, before any
    collective; ``check_eos``) or without ``labels`` (the loss)."""

    token_logits_width = None  # one row of logits per sample, not per position

    def head_modules(self) -> list[nn.Module]:
        return [*self.decoder_norms(), self.model.classification_head]

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """(m, T, H) -> (m, num_labels), as ``model(**microbatch).logits``."""
        ids = require_key(microbatch, "input_ids", type(self).__name__)
        pooled = eos_pooled(self.decoder_output(hidden), ids, self.model.config.eos_token_id,
                            type(self.model).__name__)
        return self.model.classification_head(pooled)

    def count_items(self, microbatch: Microbatch) -> int:
        ids = microbatch.get("input_ids")
        if torch.is_tensor(ids):
            check_eos(ids, self.model.config.eos_token_id, type(self.model).__name__)
        return super().count_items(microbatch)


class T5QuestionAnsweringStagedModel(QuestionAnsweringHead, T5DecoderOutput, T5StagedModel):
    """``T5ForQuestionAnswering`` / ``MT5ForQuestionAnswering``: T5's units and embedding."""

    model_classes = ("T5ForQuestionAnswering", "MT5ForQuestionAnswering")


class UMT5QuestionAnsweringStagedModel(QuestionAnsweringHead, T5DecoderOutput, UMT5StagedModel):
    """``UMT5ForQuestionAnswering``: UMT5's units and embedding."""

    model_classes = ("UMT5ForQuestionAnswering",)


class T5SequenceClassifierStagedModel(SequenceClassificationHead, T5DecoderOutput,
                                      TransformerBody, T5StagedModel):
    """``T5ForSequenceClassification`` / ``MT5ForSequenceClassification``: T5's units and
    embedding under ``transformer``."""

    model_classes = ("T5ForSequenceClassification", "MT5ForSequenceClassification")


class UMT5SequenceClassifierStagedModel(SequenceClassificationHead, T5DecoderOutput,
                                        TransformerBody, UMT5StagedModel):
    """``UMT5ForSequenceClassification``: UMT5's units and embedding under ``transformer``."""

    model_classes = ("UMT5ForSequenceClassification",)


class BartQuestionAnsweringStagedModel(QuestionAnsweringHead, BartDecoderOutput,
                                       BartStagedModel):
    """``BartForQuestionAnswering``: BART's units and embedding."""

    model_classes = ("BartForQuestionAnswering",)


class BartSequenceClassifierStagedModel(SequenceClassificationHead, BartDecoderOutput,
                                        BartStagedModel):
    """``BartForSequenceClassification``: BART's units and embedding."""

    model_classes = ("BartForSequenceClassification",)


class MBartQuestionAnsweringStagedModel(QuestionAnsweringHead, MBartDecoderOutput,
                                        MBartStagedModel):
    """``MBartForQuestionAnswering``: mBART's units, embedding and shift."""

    model_classes = ("MBartForQuestionAnswering",)


class MBartSequenceClassifierStagedModel(SequenceClassificationHead, MBartDecoderOutput,
                                         MBartStagedModel):
    """``MBartForSequenceClassification``: mBART's units, embedding and shift."""

    model_classes = ("MBartForSequenceClassification",)


class MvpQuestionAnsweringStagedModel(QuestionAnsweringHead, BartDecoderOutput, MvpStagedModel):
    """``MvpForQuestionAnswering``: MVP's units, embedding steps and layer calls (BART's
    decoder output: no final norm)."""

    model_classes = ("MvpForQuestionAnswering",)


class MvpSequenceClassifierStagedModel(SequenceClassificationHead, BartDecoderOutput,
                                       MvpStagedModel):
    """``MvpForSequenceClassification``: MVP's units, embedding steps and layer calls."""

    model_classes = ("MvpForSequenceClassification",)


class LEDQuestionAnsweringStagedModel(QuestionAnsweringHead, BartDecoderOutput, LEDStagedModel):
    """``LEDForQuestionAnswering``: LED's units (the Longformer encoder on the input padded to
    its window, cut back in the first decoder unit) under ``led``; no final decoder norm."""

    model_classes = ("LEDForQuestionAnswering",)


class EncoderDecoderMode:
    """A head whose model may be built without its decoder (T5Gemma's classifiers take
    ``is_encoder_decoder``; T5Gemma 2's always have one): raises ValueError for such a model, which has no decoder to
    stage (this adapter stages the encoder-decoder form, the default)."""

    def __init__(self, model: nn.Module):
        if not getattr(model.config, "is_encoder_decoder", True):
            raise ValueError(
                "it was built with is_encoder_decoder=False (its encoder only), and hf_cephalo "
                "stages this head as an encoder-decoder only; build it with "
                "is_encoder_decoder=True (the default)")
        super().__init__(model)


class T5GemmaTokenClassifierStagedModel(EncoderDecoderMode, TokenClassificationHead,
                                        GemmaDecoderOutput, T5GemmaStagedModel):
    """``T5GemmaForTokenClassification`` as an encoder-decoder (``config.is_encoder_decoder``,
    its default): T5Gemma's units, embedding and masks; ``score`` on the decoder's output."""

    model_classes = ("T5GemmaForTokenClassification",)


class Gemma2TextHead:
    """T5Gemma 2's task heads on text (mixed in first): the unused vision tower and projector
    on the head side, as for its generation head, and a microbatch with ``pixel_values``
    refused when its items are counted (before any collective; ``check_inputs``)."""

    def head_modules(self) -> list[nn.Module]:
        encoder = self.model.model.encoder
        return [*super().head_modules(), encoder.vision_tower, encoder.multi_modal_projector]

    def count_items(self, microbatch: Microbatch) -> int:
        self.check_inputs(microbatch)
        return super().count_items(microbatch)


class T5Gemma2TokenClassifierStagedModel(Gemma2TextHead, TokenClassificationHead,
                                         GemmaDecoderOutput, T5Gemma2StagedModel):
    """``T5Gemma2ForTokenClassification`` on text: T5Gemma 2's units, embedding and masks;
    ``score`` on the decoder's output; the unused vision tower and projector on the head side
    (a microbatch with ``pixel_values`` is refused, as for its generation head)."""

    model_classes = ("T5Gemma2ForTokenClassification",)


class LastTokenSeq2SeqClassifier(Seq2SeqTaskHead, ClassifierStagedModel):
    """Sequence classification on the decoder's last non-pad position (T5Gemma's classifiers):
    ``head_logits`` (m, num_labels) = ``score`` of the decoder's output (m, T, H) at each row's
    ``pooled_positions``; the loss and items of ``ClassifierStagedModel``. Raises ValueError
    for a model without ``pad_token_id`` (stock pools position -1 for a batch of one row and
    refuses more; a microbatch is not stock's batch, so the staging refuses it up front)."""

    token_logits_width = None  # one row of logits per sample, not per position

    def __init__(self, model: nn.Module):
        if model.config.pad_token_id is None:
            raise ValueError("its config has no pad_token_id, which its classifier needs to "
                             "find each row's last token (stock refuses batches of more than "
                             "one row without it); set config.pad_token_id")
        super().__init__(model)

    def head_modules(self) -> list[nn.Module]:
        return [*self.decoder_norms(), self.model.score]

    def pooled_positions(self, microbatch: Microbatch, length: int) -> torch.Tensor:
        """Each row's pooled decoder position (m,): T5Gemma's rule, the last non-pad token of
        ``input_ids`` plus one (the decoder reads their right shift), at most T - 1."""
        ids = require_key(microbatch, "input_ids", type(self).__name__)
        return last_non_pad(ids, self.model.config.pad_token_id, 1, length)

    def head_logits(self, hidden: torch.Tensor, microbatch: Microbatch, ctx: Any) -> torch.Tensor:
        """(m, T, H) -> (m, num_labels), as ``model(**microbatch).logits``."""
        logits = self.model.score(self.decoder_output(hidden))
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, self.pooled_positions(microbatch, logits.shape[1]).to(logits.device)]


def last_non_pad(ids: torch.Tensor, pad_token_id: int, shift: int, length: int) -> torch.Tensor:
    """The rightmost position of ``ids`` (m, S) that is not ``pad_token_id`` (0 for a row of
    pads), plus ``shift``, clamped to ``length`` - 1: (m,), as T5Gemma's classifiers pool."""
    mask = (ids != pad_token_id).to(torch.int32)
    last = (torch.arange(ids.shape[-1], device=ids.device, dtype=torch.int32) * mask).argmax(-1)
    return torch.clamp(last + shift, max=length - 1)


class T5GemmaSequenceClassifierStagedModel(EncoderDecoderMode, LastTokenSeq2SeqClassifier,
                                           GemmaDecoderOutput, T5GemmaStagedModel):
    """``T5GemmaForSequenceClassification`` as an encoder-decoder: T5Gemma's units, embedding
    and masks; ``score`` at each row's last token (``pooled_positions``)."""

    model_classes = ("T5GemmaForSequenceClassification",)


class T5Gemma2SequenceClassifierStagedModel(Gemma2TextHead, LastTokenSeq2SeqClassifier,
                                            GemmaDecoderOutput, T5Gemma2StagedModel):
    """``T5Gemma2ForSequenceClassification`` on text: T5Gemma 2's units, embedding and masks;
    ``score`` at each row's last non-pad decoder token (its own rule: of the decoder's input,
    unshifted); the vision tower and projector on the head side, unused."""

    model_classes = ("T5Gemma2ForSequenceClassification",)

    def pooled_positions(self, microbatch: Microbatch, length: int) -> torch.Tensor:
        return last_non_pad(self.decoder_ids(microbatch), self.model.config.pad_token_id, 0,
                            length)


SEQ2SEQ_HEAD_ADAPTERS = (
    T5QuestionAnsweringStagedModel, UMT5QuestionAnsweringStagedModel,
    T5SequenceClassifierStagedModel, UMT5SequenceClassifierStagedModel,
    BartQuestionAnsweringStagedModel, BartSequenceClassifierStagedModel,
    MBartQuestionAnsweringStagedModel, MBartSequenceClassifierStagedModel,
    MvpQuestionAnsweringStagedModel, MvpSequenceClassifierStagedModel,
    LEDQuestionAnsweringStagedModel, T5GemmaTokenClassifierStagedModel,
    T5Gemma2TokenClassifierStagedModel, T5GemmaSequenceClassifierStagedModel,
    T5Gemma2SequenceClassifierStagedModel)
"""The task-head adapters of this module (registered by models/registry.py)."""
