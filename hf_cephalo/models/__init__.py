"""Models as staged models: embedding and head units + identical layer units (docs/design.md contract 5).

``stage_model(model)`` wraps a supported Hugging Face model in its adapter; unknown classes get
a ValueError listing the supported ones. See docs/adding_a_model.md to add an architecture.

The registry (and with it ``transformers``) is imported on first use, so code that only needs
the ``StagedModel`` contract (the engine, toy models) does not pay for importing transformers.
"""

from typing import Any

from hf_cephalo.models.base import (HeadEvalOutput, HeadOutput, Microbatch, StagedModel,
                                    WrappedStagedModel)

_REGISTRY_NAMES = ("UnsupportedModelError", "adapter_for", "adapter_summary",
                   "register_adapter", "stage_model", "supported_model_classes")

__all__ = ["HeadEvalOutput", "HeadOutput", "Microbatch", "StagedModel", "WrappedStagedModel",
           *_REGISTRY_NAMES]


def __getattr__(name: str) -> Any:
    if name in _REGISTRY_NAMES:
        from hf_cephalo.models import registry
        return getattr(registry, name)
    raise AttributeError(f"module 'hf_cephalo.models' has no attribute {name!r}")
