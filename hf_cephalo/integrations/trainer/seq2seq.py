"""CephaloSeq2SeqTrainer / CephaloSeq2SeqTrainingArguments: transformers' ``Seq2SeqTrainer`` /
``Seq2SeqTrainingArguments`` on the Cephalo runtime.

The trainer is ``CephaloTrainerMixin`` on ``Seq2SeqTrainer`` (the way every Trainer subclass is
put on the runtime, trainer.py): training, ``evaluate()`` and ``predict()`` run through the
engine exactly as ``CephaloTrainer``'s (the loss, the teacher-forced logits given to
``compute_metrics``); ``Seq2SeqTrainer``'s own ``evaluate`` / ``predict`` still run first and
set what they set (``generation_max_length`` / ``generation_num_beams`` into the generation
keywords, ``generation_config`` onto the model at construction).

[Note: predict_with_generate]
Stock ``Seq2SeqTrainer.prediction_step`` answers ``predict_with_generate=True`` by calling
``model.generate`` on the whole model inside the evaluation loop. The engine's decode path
(docs/generation.md) runs decoder-only models, and the evaluation loop here goes through
``engine.evaluate`` (the teacher-forced forward), so ``predict_with_generate=True`` is refused
up front with the reason rather than silently scored on teacher-forced logits. Generation after
training: ``trainer.generate(...)`` (decoder-only models, sharded) or
``trainer.unshard_model().generate(...)``.

Which models train: those ``CephaloTrainer`` trains (docs/supported_models.md); a model the
runtime cannot stage is refused by the registry with its reason, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_cephalo.integrations.shared import inherited, markdown_table, not_applicable, refused
from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

__all__ = ["CephaloSeq2SeqTrainer", "CephaloSeq2SeqTrainingArguments", "SEQ2SEQ_FIELD_SUPPORT",
           "render_seq2seq_markdown"]

_GENERATE_ONLY = ("read by stock only with predict_with_generate=True (the generation keywords "
                  "of evaluate() / predict()), which Cephalo refuses; any value is accepted and, "
                  "as on stock without predict_with_generate, changes nothing")

SEQ2SEQ_FIELD_SUPPORT = {
    "sortish_sampler": not_applicable(
        "no Trainer code of the installed transformers reads it (stock accepts it and does "
        "nothing either); the plan's sampler decides the order"),
    "predict_with_generate": refused(
        "evaluation runs the teacher-forced forward through the engine; generating inside the "
        "evaluation loop is not built (hf_cephalo/integrations/trainer/seq2seq.py, [Note: "
        "predict_with_generate]): leave it False (eval loss and teacher-forced logits), and "
        "generate after training with trainer.generate(...) (decoder-only models) or "
        "trainer.unshard_model().generate(...)"),
    "generation_max_length": inherited(_GENERATE_ONLY),
    "generation_num_beams": inherited(_GENERATE_ONLY),
    "generation_config": inherited(
        "stock Seq2SeqTrainer.__init__ loads it and sets it as the model's generation_config, "
        "which save_model writes with the model (generation_config.json)"),
}
"""The fields ``Seq2SeqTrainingArguments`` adds to ``TrainingArguments`` -> support (the other
fields: ``support.FIELD_SUPPORT``)."""


@dataclass
class CephaloSeq2SeqTrainingArguments(CephaloTrainingArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` plus the ``cephalo_*`` settings: the rules, defaults and
    errors of ``CephaloTrainingArguments``; the seq2seq fields are classified in
    ``SEQ2SEQ_FIELD_SUPPORT`` (``predict_with_generate=True`` is refused by
    ``CephaloSeq2SeqTrainer``, with every other refused setting, before any collective)."""

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this class's own fields (``support.training_args_problems``)."""
        return SEQ2SEQ_FIELD_SUPPORT


class CephaloSeq2SeqTrainer(CephaloTrainerMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` on the Cephalo runtime (see the module note; the arguments and errors
    are ``CephaloTrainerMixin``'s). ``args``: ``CephaloSeq2SeqTrainingArguments``.

    Raises ``RefusedSettings`` (a ValueError, before any collective) for
    ``predict_with_generate=True`` ([Note: predict_with_generate]) and every setting
    ``CephaloTrainer`` refuses, all in one message."""


def render_seq2seq_markdown() -> str:
    """The table of the seq2seq fields in docs/trainer_support.md (section "Seq2SeqTrainer")."""
    return "\n".join(markdown_table("Seq2SeqTrainingArguments fields", SEQ2SEQ_FIELD_SUPPORT,
                                    level=3))
