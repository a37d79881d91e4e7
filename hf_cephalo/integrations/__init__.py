"""Hugging Face front ends over the Cephalo runtime (``hf_cephalo.runtime``): CephaloTrainer,
CephaloTrainingArguments, CephaloSFTTrainer / CephaloSFTConfig and CephaloDPOTrainer /
CephaloDPOConfig (TRL: the ``trl`` extra),
CephaloAccelerator/Plugin, the demo datasets and the scripts' output switches (progress bars,
load reports). Names are imported lazily
(transformers is heavy): every name in a submodule's ``__all__`` is listed here, so
``from hf_cephalo.integrations import CephaloTrainer`` imports only what it needs."""

from importlib import import_module

_EXPORTS = {
    # trainer
    "CephaloTrainer": "trainer",
    "CephaloTrainerMixin": "trainer",
    "format_plan_table": "trainer",
    "format_loss_trend": "trainer",
    # TRL (the trl extra)
    "CephaloSFTTrainer": "trl_sft",
    "CephaloSFTConfig": "trl_sft",
    "CephaloDPOTrainer": "trl_dpo",
    "CephaloDPOConfig": "trl_dpo",
    # training_args
    "CephaloTrainingArguments": "training_args",
    "CephaloArguments": "training_args",
    "job_from_training_args": "training_args",
    # accelerate
    "CephaloDistributedType": "accelerate",
    "CephaloPlugin": "accelerate",
    "CephaloAccelerator": "accelerate",
    "ENV_PREFIX": "accelerate",
    "ACTIVATION_OFFLOAD_CHOICES": "accelerate",
    "ADAPTIVE_CHOICES": "accelerate",
    # the runtime's public names a script uses (hf_cephalo.runtime holds the rest)
    "latest_checkpoint": "hf_cephalo.runtime.elastic",
    # pretrained
    "from_pretrained_sharded": "pretrained",
    # quiet
    "disable_progress_bars": "quiet",
    "progress_bars_from_rank_zero": "quiet",
    "print_line": "quiet",
    "quiet_load_report": "quiet",
    "LOAD_REPORT_LOGGER": "quiet",
    # data
    "pydoc_texts": "data",
    "pydoc_text_dataset": "data",
    "pydoc_paragraph_classes": "data",
    "stratified_split": "data",
    "minilm_path": "data",
    "PYDOC_TOPIC_GROUPS": "data",
    "PYDOC_PARAGRAPH_LABELS": "data",
    "train_bpe_tokenizer": "data",
    "pydoc_chat_pairs": "data",
    "pydoc_chat_dataset": "data",
    "pydoc_preference_dataset": "data",
    "train_chat_tokenizer": "data",
    "CHAT_TEMPLATE": "data",
    "CHAT_FORMATS": "data",
    "group_texts": "data",
    "digits_image_datasets": "data",
    "EOS_TOKEN": "data",
    "PAD_TOKEN": "data",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = _EXPORTS[name]
        return getattr(import_module(module if module.startswith("hf_cephalo.")
                                     else f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
