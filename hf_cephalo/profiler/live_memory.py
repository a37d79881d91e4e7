"""Peak bytes of live tensors on CPU, where no allocator statistics exist.

``LiveTensorBytes`` is a ``TorchDispatchMode``: every operator's output storage that did not
exist before (not a view or in-place result of an input) is recorded with a weak reference;
storages whose tensors are all gone are dropped before each new record, and a storage resized
in place since (``untyped_storage().resize_``, which is no operator) counts at its new size.
``peak_bytes`` is the largest sum of recorded storages seen after any operator: the peak of
tensors allocated inside the context (tensors allocated before it are not counted). Used by
the profiler for the CPU compute memory and by tests for the engine's real peak. Granularity:
one operator (a temporary freed inside a fused kernel is not seen, as on CUDA's allocator it
would be).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorBytes"]


class LiveTensorBytes(TorchDispatchMode):
    """Context manager: ``current_bytes`` / ``peak_bytes`` of tensors allocated inside it."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (ref, nbytes)
        self.current_bytes = 0
        self.peak_bytes = 0

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                self.current_bytes -= self._live.pop(key)[1]
                continue
            # a storage resized in place (the engine frees a kept unit's gathered buffer with
            # ``resize_(0)`` and refills it: flat_param.py [Note: kept graphs across reshard])
            now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            if now != nbytes:
                self._live[key] = (ref, now)
                self.current_bytes += now - nbytes

    def reset_peak(self) -> None:
        self._sweep()
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: stable when it is resized in place
            if storage.nbytes() and key not in inputs and key not in self._live:
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out
