"""The Accelerate-loop door: ``CephaloAccelerator`` / ``CephaloPlugin``, a drop-in for
``Accelerator`` in a custom training loop (names imported lazily)."""

from importlib import import_module

_EXPORTS = {
    "CephaloAccelerator": "accelerator",
    "CephaloPlugin": "accelerator",
    "CephaloDistributedType": "accelerator",
    "ACTIVATION_OFFLOAD_CHOICES": "accelerator",
    "ADAPTIVE_CHOICES": "accelerator",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
