"""PEFT LoRA models: the ``PeftModel`` wrapper seen through the adapter of the model it wraps.

[Note: LoRA in the engine]
``get_peft_model(model, LoraConfig(...))`` replaces each targeted ``nn.Linear`` by a LoRA layer
that keeps the original as ``base_layer`` (frozen) and adds ``lora_A`` / ``lora_B`` (trainable)
as its submodules, so every LoRA parameter is a parameter of the transformer layer it belongs
to and lands in that layer's unit; ``modules_to_save`` copies (e.g. a classifier) stay in the
head unit. The staged model is the registered adapter of the wrapped transformers model
(``peft_model.base_model.model``): the adapters call modules, never read weights directly, so
LoRA's forward runs unchanged. In each unit's flat buffer the trainable (adapter) parameters
come first ([Note: flat unit layout] in ``engine/flat_param.py``): frozen base weights are
sharded by the same per-unit layout but get no gradient, are never reduce-scattered and carry
no optimizer state. Only LoRA (``PeftType.LORA``) is supported: prompt / prefix methods add
parameters outside any layer and change the inputs the adapters build.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["is_peft_model", "unwrap_peft_model", "SUPPORTED_PEFT_TYPES"]

SUPPORTED_PEFT_TYPES = ("LORA",)


def is_peft_model(model: Any) -> bool:
    """True for a PEFT ``PeftModel`` (any task subclass); peft need not be installed."""
    return any(cls.__name__ == "PeftModel" for cls in type(model).__mro__)


def _peft_type_name(config: Any) -> str:
    peft_type = getattr(config, "peft_type", None)
    return str(getattr(peft_type, "value", peft_type))


def check_peft_model(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` is a PeftModel with exactly one LoRA adapter that
    wraps at least one module and has trainable parameters.

    The messages name the offending method, adapters or modules and the fix.
    """
    configs = dict(getattr(model, "peft_config", {}) or {})
    if len(configs) != 1:
        raise ValueError(f"{type(model).__name__} carries adapters {sorted(configs)}; hf_cephalo "
                         "trains one LoRA adapter at a time: delete the others "
                         "(peft_model.delete_adapter(name)) or merge them first")
    (name, config), = configs.items()
    kind = _peft_type_name(config)
    if kind not in SUPPORTED_PEFT_TYPES:
        raise ValueError(f"PEFT method {kind} (adapter {name!r}) is not supported by hf_cephalo; "
                         f"supported: {', '.join(SUPPORTED_PEFT_TYPES)} (peft.LoraConfig). "
                         "Prompt/prefix methods add parameters outside the transformer layers")
    lora_layers = [n for n, m in model.named_modules()
                   if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and name in m.lora_A]
    if not lora_layers:
        raise ValueError(f"the LoRA adapter {name!r} wraps no module (target_modules="
                         f"{sorted(getattr(config, 'target_modules', None) or [])} match nothing "
                         "in the base model); name the Linear layers to adapt, e.g. "
                         "target_modules=['q_proj', 'v_proj'] (Llama) or ['query', 'value'] (BERT)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"the LoRA adapter {name!r} has no trainable parameter (loaded with "
                         "PeftModel.from_pretrained(..., is_trainable=False)?); load it with "
                         "is_trainable=True to train it")


def unwrap_peft_model(model: nn.Module) -> nn.Module:
    """The transformers model a checked LoRA ``PeftModel`` wraps (``model.base_model.model``),
    its LoRA layers inside. Raises ValueError as ``check_peft_model``."""
    check_peft_model(model)
    return model.base_model.model
