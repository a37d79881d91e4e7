"""The Trainer door: ``CephaloTrainer`` / ``CephaloTrainingArguments``, drop-ins for
transformers' ``Trainer`` / ``TrainingArguments`` (names imported lazily)."""

from importlib import import_module

_EXPORTS = {
    "CephaloTrainer": "trainer",
    "CephaloTrainerMixin": "trainer",
    "format_plan_table": "trainer",
    "format_loss_trend": "trainer",
    "CephaloTrainingArguments": "training_args",
    "CephaloArguments": "training_args",
    "job_from_training_args": "training_args",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
