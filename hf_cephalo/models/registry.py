"""Find the staged-model adapter for a Hugging Face model by its class (docs/design.md contract 5).

Lookup walks the model's class hierarchy, so a user subclass of ``LlamaForCausalLM`` gets the
Llama adapter. Users add their own architectures with ``register_adapter`` (see
docs/adding_a_model.md).
"""

from __future__ import annotations

import transformers
from torch import nn

from hf_cephalo.models.base import StagedModel
from hf_cephalo.models.bert import BertStagedModel
from hf_cephalo.models.gpt2 import GPT2StagedModel
from hf_cephalo.models.gpt_neox import GPTNeoXStagedModel
from hf_cephalo.models.llama import LlamaStagedModel
from hf_cephalo.models.vit import ViTStagedModel

_ADAPTERS: dict[str, type[StagedModel]] = {}

MIN_TRANSFORMERS_MAJOR = 5
"""The built-in adapters follow transformers 5.x module layouts and mask builders (tested with
5.24); 4.x lays models out differently (e.g. ``vit.encoder.layer``, ``past_key_values``)."""


def check_transformers_version(version: str) -> None:
    """Raise ValueError if ``version`` (e.g. "4.46.0") is older than the adapters support."""
    major = int(version.split(".")[0])
    if major < MIN_TRANSFORMERS_MAJOR:
        raise ValueError(f"hf_cephalo's model adapters need "
                         f"transformers>={MIN_TRANSFORMERS_MAJOR}.0 "
                         f"(found {version}); upgrade with `pip install -U 'transformers>=5'`.")


def register_adapter(model_class: type | str, adapter: type[StagedModel]) -> None:
    """Use ``adapter`` (a ``StagedModel`` subclass taking the model as its only argument) for
    models of class ``model_class`` (the class or its ``__name__``) and their subclasses.

    Raises TypeError if ``adapter`` is not a StagedModel subclass. A later registration for the
    same class name replaces the earlier one.
    """
    if not (isinstance(adapter, type) and issubclass(adapter, StagedModel)):
        raise TypeError(f"adapter must be a StagedModel subclass, got {adapter!r}")
    name = model_class if isinstance(model_class, str) else model_class.__name__
    _ADAPTERS[name] = adapter


def supported_model_classes() -> list[str]:
    """Names of the model classes with a registered adapter, sorted."""
    return sorted(_ADAPTERS)


def adapter_for(model: nn.Module) -> type[StagedModel]:
    """The adapter class registered for ``model``'s class or its nearest registered base class.

    Raises ValueError naming the supported classes if there is none.
    """
    for cls in type(model).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__]
    raise ValueError(f"hf_cephalo has no staged-model adapter for {type(model).__name__}; "
                     f"supported model classes: {', '.join(supported_model_classes())}. To train "
                     f"another architecture, write an adapter and register it with "
                     f"hf_cephalo.models.register_adapter (see docs/adding_a_model.md).")


def stage_model(model: nn.Module) -> StagedModel:
    """Wrap a Hugging Face model in its staged-model adapter (no copy; shares parameters).

    Raises ValueError for an unsupported class, for a built-in adapter with transformers < 5,
    or when the adapter's root modules and units do not cover ``model.parameters()`` exactly
    (e.g. extra modules attached to the model).
    """
    if isinstance(model, StagedModel):
        return model
    adapter = adapter_for(model)
    if adapter.__module__.startswith("hf_cephalo.models."):
        check_transformers_version(transformers.__version__)
    return adapter(model)


for _adapter in (LlamaStagedModel, GPT2StagedModel, GPTNeoXStagedModel, ViTStagedModel,
                 BertStagedModel):
    for _name in _adapter.model_classes:
        register_adapter(_name, _adapter)
