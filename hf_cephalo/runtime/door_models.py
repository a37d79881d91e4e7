"""Staging a model for a door (``CephaloTrainer``, ``CephaloAccelerator.prepare``, TRL's
trainers): ``models.stage_model`` less the models the engine trains but a door does not take
yet.

[Note: encoder-decoders at the doors]
The encoder-decoders with adapters (T5, BART, mBART, Marian, Pegasus, Whisper, BART's kin,
T5's kin, Speech2Text, Moonshine, T5Gemma, T5Gemma 2: models/seq2seq.py, seq2seq_families.py,
seq2seq_kin.py, seq2seq_t5_kin.py, seq2seq_gemma.py, whisper.py, speech_seq2seq.py) train
exactly on the engine.
``CephaloTrainer`` (and ``CephaloSeq2SeqTrainer``) takes them with the model's own loss; for T5,
BART, Whisper, LED, PEGASUS-X and T5Gemma its training (losses, gradient norms, weights), ``evaluate``'s loss,
``predict``'s logits (at the labelled positions: the gathered rows are padded with -100 beyond
each rank's widest) and the model ``save_model`` writes equal stock's with the whole global
batch, on ``DataCollatorForSeq2Seq`` (Whisper: log-mel) batches (the global width pads the
encoder's and the decoder's axes apart: runtime/global_width.py), on 2 ranks with an uneven plan
and on 3 with an idle rank (tests/test_generic_trainer_parity.py); so do T5 with
``label_smoothing_factor`` (stock's smoother on the decoder's logits, unshifted; the eval loss
too) and BART with a ``compute_loss_func`` (handed the label tokens != -100 as
``num_items_in_batch``, as stock does), on 2 ranks, where the batch carries
``decoder_input_ids`` (``check_decoder_inputs``: stock removes the labels before such a
forward). A user loss runs on the stand-in model's
outputs (``logits`` (m, T, V), T the decoder's positions; ``runtime/user_loss.py``). The
accelerate loop takes them too (``CephaloAccelerator.prepare``; T5 with the model's own loss on
2 ranks and on 3 with an idle rank equals one process with the whole global batch:
tests/test_accelerate_loop.py). Not checked, so refused before any collective: TRL's trainers
and reference models, whose outputs and item counts are those of one token sequence per row.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from hf_cephalo.models.base import Microbatch, StagedModel
from hf_cephalo.models.registry import stage_model as stage_any_model
from hf_cephalo.models.seq2seq import Seq2SeqStagedModel


def stage_model(model: nn.Module, *, seq2seq: bool = False) -> StagedModel:
    """``hf_cephalo.models.stage_model(model)`` for a door; ``seq2seq``: the door takes
    encoder-decoders ([Note: encoder-decoders at the doors]: ``CephaloTrainer`` does).

    Raises:
        ValueError: as ``models.stage_model`` (an unsupported class, ...), and, without
            ``seq2seq``, for an encoder-decoder (T5's and BART's
            ``...ForConditionalGeneration``). Raised before any collective.
    """
    staged = stage_any_model(model)
    if isinstance(staged, Seq2SeqStagedModel) and not seq2seq:
        raise ValueError(
            f"{type(staged.model).__name__} is an encoder-decoder: hf_cephalo's engine trains "
            "it exactly, and so does CephaloTrainer with the model's own loss, but this door "
            "does not take encoder-decoders yet (its outputs and item counts are checked for "
            "one token sequence per row, not an encoder's and a decoder's). Nothing was run")
    return staged


def check_decoder_inputs(staged: StagedModel, inputs: dict) -> None:
    """ValueError where ``staged`` is an encoder-decoder and ``inputs`` (a model call's, or a
    microbatch a loss of the user's will call the model on without its labels) carry neither
    ``labels`` nor ``decoder_input_ids``: stock's model then builds its decoder input from
    something else than the labels' shift (BART from ``input_ids``; T5 fails), while the
    engine's forward runs on the labels' shift; nothing otherwise."""
    if isinstance(staged, Seq2SeqStagedModel) and inputs.get("labels") is None and \
            inputs.get("decoder_input_ids") is None:
        raise ValueError(
            f"{type(staged.model).__name__} is an encoder-decoder and the model is called "
            "without labels and without decoder_input_ids (stock Trainer removes the labels "
            "before the forward for label smoothing and compute_loss_func): its forward would "
            "then build its decoder input from something other than the labels (BART: "
            "input_ids; T5: an error), which the engine does not run. Put decoder_input_ids "
            "in the batch: DataCollatorForSeq2Seq(tokenizer, model=model) makes them from the "
            "labels")


def seq2seq_user_loss_items(staged: StagedModel) -> Callable[[Microbatch], int] | None:
    """For an encoder-decoder under a loss that calls the model without its labels (label
    smoothing, ``compute_loss_func``): the model's item count, after ``check_decoder_inputs``
    on the microbatch less its labels (the engine counts items before a step's first
    collective); None for any other model."""
    if not isinstance(staged, Seq2SeqStagedModel):
        return None

    def count(microbatch: Microbatch) -> int:
        if microbatch.get("labels") is not None:
            check_decoder_inputs(staged, {k: v for k, v in microbatch.items() if k != "labels"})
        return staged.count_items(microbatch)
    return count
