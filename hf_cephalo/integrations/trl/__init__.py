"""The TRL doors (the ``trl`` extra): ``CephaloSFTTrainer`` / ``CephaloSFTConfig`` and
``CephaloDPOTrainer`` / ``CephaloDPOConfig``, drop-ins for TRL's (names imported lazily: the
package imports without trl)."""

from importlib import import_module

_EXPORTS = {
    "CephaloSFTTrainer": "sft",
    "CephaloSFTConfig": "sft",
    "CephaloDPOTrainer": "dpo",
    "CephaloDPOConfig": "dpo",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
