"""Find the staged-model adapter for a Hugging Face model by its class (DESIGN contract 5).

Lookup walks the model's class hierarchy, so a user subclass of ``LlamaForCausalLM`` gets the
Llama adapter. Users add their own architectures with ``register_adapter`` (see
docs/adding_a_model.md).
"""

from __future__ import annotations

from torch import nn

from hf_cephalo.models.base import StagedModel
from hf_cephalo.models.bert import BertStagedModel
from hf_cephalo.models.gpt2 import GPT2StagedModel
from hf_cephalo.models.gpt_neox import GPTNeoXStagedModel
from hf_cephalo.models.llama import LlamaStagedModel
from hf_cephalo.models.vit import ViTStagedModel

_ADAPTERS: dict[str, type[StagedModel]] = {}


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

    Raises ValueError for an unsupported class, or when the adapter's root modules and units do
    not cover ``model.parameters()`` exactly (e.g. extra modules attached to the model).
    """
    if isinstance(model, StagedModel):
        return model
    return adapter_for(model)(model)


for _adapter in (LlamaStagedModel, GPT2StagedModel, GPTNeoXStagedModel, ViTStagedModel,
                 BertStagedModel):
    for _name in _adapter.model_classes:
        register_adapter(_name, _adapter)
