"""CephaloSeq2SeqTrainer / CephaloSeq2SeqTrainingArguments: transformers' ``Seq2SeqTrainer`` /
``Seq2SeqTrainingArguments`` on the Cephalo runtime.

The trainer is ``CephaloTrainerMixin`` on ``Seq2SeqTrainer`` (the way every Trainer subclass is
put on the runtime, trainer.py): training, ``evaluate()`` and ``predict()`` run through the
engine exactly as ``CephaloTrainer``'s (the loss, the teacher-forced logits given to
``compute_metrics``, or the generated ids with ``predict_with_generate=True``);
``Seq2SeqTrainer``'s own ``evaluate`` / ``predict`` still run and set what they set
(``generation_config`` onto the model at construction).

[Note: predict_with_generate]
With ``predict_with_generate=True`` (encoder-decoders reading token ids), ``evaluate()`` /
``predict()`` return what stock's ``prediction_step`` returns: the teacher-forced loss, and as
predictions the generated decoder token ids (the start token, then the completion), decoded on
the sharded engine once per evaluation step, every rank its rows ([Note: encoder-decoder
generation] in engine/generation.py). The generation keywords resolve as stock resolves them
(``generation_max_length`` / ``generation_num_beams`` / the call's keywords over the model's
``generation_config``; ``max_length`` counts the start token); the config's logits processors
run as in ``generate``; greedy decoding, or sampling keyed by the dataset index (so it does
not depend on the plan, and differs from stock's draws). Ids and labels are laid out as stock
lays out ONE batch holding the whole evaluation set: padded to the longest with the generation
pad / -100, then to ``generation_config.max_length`` with the pad token. Refused before any
collective: ``num_beams`` > 1 and the other settings ``runtime.resolve_generation`` names.

Which models train: those ``CephaloTrainer`` trains (docs/supported_models.md); a model the
runtime cannot stage is refused by the registry with its reason, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_cephalo.integrations.shared import markdown_table, not_applicable, stock
from hf_cephalo.integrations.trainer.generate_eval import (GenerateEvaluationMixin,
                                                           generation_problems)
from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

__all__ = ["CephaloSeq2SeqTrainer", "CephaloSeq2SeqTrainingArguments", "SEQ2SEQ_FIELD_SUPPORT",
           "render_seq2seq_markdown"]

_PARITY = "tests/test_generic_trainer_parity.py::test_zoo_trainer_matches_stock_two_ranks"

SEQ2SEQ_FIELD_SUPPORT = {
    "sortish_sampler": not_applicable(
        "no Trainer code of the installed transformers reads it (stock accepts it and does "
        "nothing either); the plan's sampler decides the order"),
    "predict_with_generate": stock(
        "evaluate() / predict() score the generated token ids, decoded on the sharded engine "
        "(encoder-decoders reading token ids; greedy, or sampling keyed by the dataset index; "
        "ids and labels laid out as stock's one batch of the whole set: "
        "hf_cephalo/integrations/trainer/seq2seq.py, [Note: predict_with_generate]); refused "
        "for a decoder-only model, and with beam search or another setting the keyed decode "
        "does not honour (named in the error)", _PARITY),
    "generation_max_length": stock(
        "with predict_with_generate=True the max_length of the generation keywords, as stock "
        "(decoder tokens, counting the start token); without it stock reads it nowhere and "
        "any value changes nothing", _PARITY),
    "generation_num_beams": stock(
        "with predict_with_generate=True: 1 works as stock (greedy decoding), > 1 is refused "
        "(beam search is not built: the keyed decode runs one sequence per row); without it "
        "stock reads it nowhere and any value changes nothing", _PARITY),
    "generation_config": stock(
        "stock Seq2SeqTrainer.__init__ loads it and sets it as the model's generation_config, "
        "which save_model writes with the model (generation_config.json) and "
        "predict_with_generate decodes with", _PARITY),
}
"""The fields ``Seq2SeqTrainingArguments`` adds to ``TrainingArguments`` -> support (the other
fields: ``support.FIELD_SUPPORT``)."""


@dataclass
class CephaloSeq2SeqTrainingArguments(CephaloTrainingArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` plus the ``cephalo_*`` settings: the rules, defaults and
    errors of ``CephaloTrainingArguments``; the seq2seq fields are classified in
    ``SEQ2SEQ_FIELD_SUPPORT`` (``generation_num_beams`` > 1 with ``predict_with_generate=True``
    is refused by ``CephaloSeq2SeqTrainer``, with every other refused setting, before any
    collective)."""

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this class's own fields (``support.training_args_problems``)."""
        return SEQ2SEQ_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments``' and ``generation_num_beams`` > 1 with
        ``predict_with_generate=True`` ([Note: predict_with_generate])."""
        refused = super().refused_settings()
        if self.predict_with_generate and (self.generation_num_beams or 1) > 1:
            refused["generation_num_beams"] = (
                f"--generation_num_beams = {self.generation_num_beams} with "
                "--predict_with_generate is not supported by Cephalo: beam search is not "
                "built (the sharded decode runs greedy decoding or keyed sampling, one "
                "sequence per row); use --generation_num_beams 1")
        return refused


class CephaloSeq2SeqTrainer(GenerateEvaluationMixin, CephaloTrainerMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` on the Cephalo runtime (see the module note; the arguments and errors
    are ``CephaloTrainerMixin``'s). ``args``: ``CephaloSeq2SeqTrainingArguments``.

    Raises ``RefusedSettings`` (a ValueError, before any collective) for
    ``predict_with_generate=True`` on a decoder-only model or with a generation setting the
    sharded decode does not honour (``generation_num_beams`` or the model's / ``args``'
    ``generation_config`` ``num_beams`` > 1, ...: [Note: predict_with_generate]) and every
    setting ``CephaloTrainer`` refuses, all in one message; ``evaluate`` / ``predict`` raise
    ValueError, on every rank before any collective, for such a generation keyword."""

    def __init__(self, model=None, args=None, **kwargs):
        self._generation_args = args  # read by _hook_problems, before the process group
        super().__init__(model, args, **kwargs)

    def _hook_problems(self, model, kwargs) -> list[str]:
        return super()._hook_problems(model, kwargs) + \
            generation_problems(model, self._generation_args)


def render_seq2seq_markdown() -> str:
    """The table of the seq2seq fields in docs/trainer_support.md (section "Seq2SeqTrainer")."""
    return "\n".join(markdown_table("Seq2SeqTrainingArguments fields", SEQ2SEQ_FIELD_SUPPORT,
                                    level=3))
