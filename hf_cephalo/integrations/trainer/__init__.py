"""The Trainer door: ``CephaloTrainer`` / ``CephaloTrainingArguments`` and
``CephaloSeq2SeqTrainer`` / ``CephaloSeq2SeqTrainingArguments``, drop-ins for transformers'
``Trainer`` / ``TrainingArguments`` and ``Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments`` (names
imported lazily)."""

from hf_cephalo.lazy import lazy_exports

_EXPORTS = {
    "CephaloTrainer": "trainer",
    "CephaloTrainerMixin": "trainer",
    "format_plan_table": "trainer",
    "format_loss_trend": "trainer",
    "CompletionsCallback": "completions",
    "CephaloTrainingArguments": "training_args",
    "CephaloSeq2SeqTrainer": "seq2seq",
    "CephaloSeq2SeqTrainingArguments": "seq2seq",
    "CephaloArguments": "training_args",
    "job_from_training_args": "training_args",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
