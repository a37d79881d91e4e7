"""The Accelerate-loop door: ``CephaloAccelerator`` / ``CephaloPlugin``, a drop-in for
``Accelerator`` in a custom training loop (names imported lazily)."""

from hf_cephalo.lazy import lazy_exports

_EXPORTS = {
    "CephaloAccelerator": "accelerator",
    "CephaloPlugin": "accelerator",
    "CephaloDistributedType": "accelerator",
    "ACTIVATION_OFFLOAD_CHOICES": "accelerator",
    "ADAPTIVE_CHOICES": "accelerator",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
