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
from hf_cephalo.models.gpt2 import GPT2SequenceClassifierStagedModel, GPT2StagedModel
from hf_cephalo.models.gpt_neox import GPTNeoXStagedModel
from hf_cephalo.models.llama import LlamaSequenceClassifierStagedModel, LlamaStagedModel
from hf_cephalo.models.peft_lora import is_peft_model, unwrap_peft_model
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


class UnsupportedModelError(ValueError):
    """No adapter for a model's class. ``alternatives``: supported classes of the same
    architecture (same ``config.model_type``), e.g. ``["BertForSequenceClassification"]`` for a
    ``BertModel``; empty when the architecture itself has no adapter."""

    def __init__(self, message: str, alternatives: list[str]):
        super().__init__(message)
        self.alternatives = alternatives


def _same_architecture(model: nn.Module) -> list[str]:
    """Supported class names whose config has the model's ``model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return []
    return [name for name in supported_model_classes()
            if getattr(getattr(getattr(transformers, name, None), "config_class", None),
                       "model_type", None) == model_type]


def adapter_for(model: nn.Module) -> type[StagedModel]:
    """The adapter class registered for ``model``'s class or its nearest registered base class.

    Raises:
        UnsupportedModelError (a ValueError): no adapter; the message names the supported
            classes and, when one of them has the same architecture (a bare ``BertModel`` vs
            ``BertForSequenceClassification``), says to load that class instead.
        ValueError: a PEFT ``PeftModel`` that is not one LoRA adapter (``peft_lora.py``).

    A LoRA ``PeftModel`` gets the adapter of the model it wraps (``peft_model.base_model.model``).
    """
    if is_peft_model(model):
        model = unwrap_peft_model(model)
    for cls in type(model).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__]
    name = type(model).__name__
    same = _same_architecture(model)
    if same:
        raise UnsupportedModelError(
            f"hf_cephalo has no staged-model adapter for {name}; the supported class of this "
            f"architecture is {', '.join(same)}: load the model as {same[0]} (e.g. "
            f"{same[0]}.from_pretrained(path))", same)
    raise UnsupportedModelError(
        f"hf_cephalo has no staged-model adapter for {name}; supported model classes: "
        f"{', '.join(supported_model_classes())}. To train another architecture, write an adapter "
        f"and register it with hf_cephalo.models.register_adapter (see docs/adding_a_model.md).", [])


def stage_model(model: nn.Module) -> StagedModel:
    """Wrap a Hugging Face model in its staged-model adapter (no copy; shares parameters).

    A LoRA ``PeftModel`` is staged as the model it wraps, LoRA layers inside the units (see
    [Note: LoRA in the engine] in ``peft_lora.py``); ``staged.model`` is then the wrapped model.

    Raises ValueError (``UnsupportedModelError``) for an unsupported class, ValueError for a
    PEFT wrapper other than one LoRA adapter, ValueError for a built-in adapter with transformers < 5,
    or when the adapter's root modules and units do not cover ``model.parameters()`` exactly
    (e.g. extra modules attached to the model).
    """
    if isinstance(model, StagedModel):
        return model
    adapter = adapter_for(model)
    if is_peft_model(model):
        model = model.base_model.model
    if adapter.__module__.startswith("hf_cephalo.models."):
        check_transformers_version(transformers.__version__)
    return adapter(model)


for _adapter in (LlamaStagedModel, LlamaSequenceClassifierStagedModel, GPT2StagedModel,
                 GPT2SequenceClassifierStagedModel, GPTNeoXStagedModel, ViTStagedModel,
                 BertStagedModel):
    for _name in _adapter.model_classes:
        register_adapter(_name, _adapter)
