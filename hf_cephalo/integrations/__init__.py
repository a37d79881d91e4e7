"""Hugging Face integrations: CephaloTrainingArguments, CephaloAccelerator/Plugin, the weighted
batch sampler and the demo datasets. Names are imported lazily (transformers is heavy)."""

from importlib import import_module

_EXPORTS = {
    "CephaloTrainingArguments": "training_args",
    "CephaloDistributedType": "accelerate",
    "CephaloPlugin": "accelerate",
    "CephaloAccelerator": "accelerate",
    "WeightedBatchSampler": "sampler",
    "MicrobatchCollator": "sampler",
    "split_counts": "sampler",
    "split_microbatches": "sampler",
    "pydoc_text_dataset": "data",
    "train_bpe_tokenizer": "data",
    "group_texts": "data",
    "digits_image_datasets": "data",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
