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
``num_items_in_batch``, as stock does), on 2 ranks. A user loss runs on the stand-in model's
outputs (``logits`` (m, T, V), T the decoder's positions; ``runtime/user_loss.py``). The
accelerate loop takes them too (``CephaloAccelerator.prepare``; T5 with the model's own loss on
2 ranks and on 3 with an idle rank equals one process with the whole global batch:
tests/test_accelerate_loop.py). Not checked, so refused before any collective: TRL's trainers
and reference models, whose outputs and item counts are those of one token sequence per row.
"""

from __future__ import annotations

from torch import nn

from hf_cephalo.models.base import StagedModel
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
