"""The Cephalo side of a TRL config: ``CephaloTRLConfig`` + a TRL config class, made a dataclass
by ``trl_config_dataclass`` (``CephaloSFTConfig`` in sft.py, ``CephaloDPOConfig`` in
dpo.py); and ``TRLModelCard``, what the TRL trainers add to each checkpoint. Imports no TRL.
"""

from __future__ import annotations

import dataclasses

from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

__all__ = ["CephaloTRLConfig", "TRLModelCard", "trl_config_dataclass", "dataset_columns"]


class CephaloTRLConfig(CephaloTrainingArguments):
    """``CephaloTrainingArguments``' rules (environment fallbacks, validation, CPU
    auto-detection, ``refused_settings``) for a TRL config, with TRL's ``bf16`` default
    (``trl.trainer.base_config._BaseConfig``: True unless ``fp16``) settled first, since the
    Cephalo precision checks read it."""

    def cephalo_refusal_source(self) -> dict[str, str]:
        """Who refuses this config's settings, and the page that classifies them
        (``support.RefusedSettings``): the TRL trainer, docs/trl.md."""
        name = type(self).__name__.replace("Config", "Trainer")
        return {"who": name, "docs": "docs/trl.md and docs/trainer_support.md"}

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16
        super().__post_init__()


def trl_config_dataclass(trl_config: type):
    """Class decorator: ``cls`` (a ``CephaloTRLConfig`` + ``trl_config`` subclass) as a
    dataclass whose ``TrainingArguments`` fields are ``trl_config``'s, defaults and help
    included.

    Without this, the ``TrainingArguments`` fields would carry ``CephaloTrainingArguments``'
    (stock) defaults: a dataclass takes each base's fields in reverse MRO order, and
    ``CephaloTrainingArguments`` (a dataclass of every ``TrainingArguments`` field) comes last,
    hiding the TRL config's own defaults (``learning_rate`` 2e-5, ``logging_steps`` 10,
    ``bf16`` None -> True, ``gradient_checkpointing`` True).
    """
    def decorate(cls: type) -> type:
        stock = {f.name for f in dataclasses.fields(CephaloTrainingArguments)}
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for f in dataclasses.fields(trl_config):
            if f.name not in stock or f.name in annotations:
                continue
            annotations[f.name] = f.type
            default = {"default": f.default} if f.default is not dataclasses.MISSING else \
                {"default_factory": f.default_factory}
            setattr(cls, f.name, dataclasses.field(**default, init=f.init, repr=f.repr,
                                                   metadata=f.metadata))
        cls.__annotations__ = annotations
        return dataclasses.dataclass(cls)
    return decorate


class TRLModelByName:
    """Put before ``CephaloTrainerMixin`` in a TRL trainer's bases: ``model="org/name"`` (TRL's
    reference scripts pass ``model_args.model_name_or_path``) is loaded as stock TRL loads it,
    with the config's ``model_init_kwargs``, but on the meta device so that each rank reads only
    its shards (``pretrained.load_named_model``; its refusals are ValueErrors raised before any
    collective); whole, as stock, where a ``peft_config`` adds adapter weights no checkpoint
    holds (PEFT draws them from the random stream of the whole model)."""

    _hides_used_init_kwargs = False
    """SFT: once the door has loaded the model with ``model_init_kwargs``, SFTTrainer would say
    they "will be ignored" (it sees a model object); they are hidden from it during its
    ``__init__`` and restored after. DPO keeps them visible: it loads its reference copy with
    them."""

    def __init__(self, *args, **kwargs) -> None:
        self._used_init_kwargs = None
        try:
            super().__init__(*args, **kwargs)
        finally:
            if self._used_init_kwargs is not None:
                config, value = self._used_init_kwargs
                config.model_init_kwargs = value

    def _load_named_model(self, name: str, args, whole: bool = False):
        from hf_cephalo.runtime import load_named_model

        model = load_named_model(name, getattr(args, "model_init_kwargs", None),
                                 door=type(self).__name__,
                                 trust_remote_code=getattr(args, "trust_remote_code", False),
                                 whole=whole)
        if self._hides_used_init_kwargs and getattr(args, "model_init_kwargs", None):
            self._used_init_kwargs = (args, args.model_init_kwargs)
            args.model_init_kwargs = None
        return model


class TRLModelCard:
    """Put before ``CephaloTrainerMixin`` in a TRL trainer's bases: each checkpoint gets TRL's
    model card (``create_model_card``, as TRL's own ``_save_checkpoint`` does), then the
    engine's checkpoint (``CephaloTrainerMixin._save_checkpoint``)."""

    def _save_checkpoint(self, model, trial) -> None:
        import os

        name = os.path.basename(os.path.normpath(self.args.output_dir)) \
            if self.args.hub_model_id is None else self.args.hub_model_id.split("/")[-1]
        self.create_model_card(model_name=name)
        super()._save_checkpoint(model, trial)


def dataset_columns(kwargs: dict) -> list[tuple[str, set[str]]]:
    """(name, column names) of a TRL trainer's ``train_dataset`` and ``eval_dataset`` (each of a
    dict of eval datasets as ``eval_dataset['name']``), as its error messages name them; a
    dataset without a known list of columns (a stream, a plain list, None) is left out."""
    evaluation = kwargs.get("eval_dataset")
    named = [("train_dataset", kwargs.get("train_dataset"))] + (
        [(f"eval_dataset[{k!r}]", d) for k, d in evaluation.items()]
        if isinstance(evaluation, dict) else [("eval_dataset", evaluation)])
    out = []
    for name, dataset in named:
        names = getattr(dataset, "column_names", None)
        if isinstance(names, (list, tuple)):
            out.append((name, set(names)))
    return out
