"""Counting the tensors an autograd backward allocates (no process group)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class UnitSizedAllocations(TorchDispatchMode):
    """Counts aten results of exactly one of ``numels`` elements in NEW storage (views and
    in-place results share an input's storage and are not counted), by op name."""

    def __init__(self, numels):
        super().__init__()
        self.numels = {numels} if isinstance(numels, int) else set(numels)
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
        for t in _tensors(out, None):
            if t.numel() in self.numels and t.untyped_storage().data_ptr() not in inputs:
                self.ops.append(func.overloadpacket.__name__)
        return out


def _tensors(args, kwargs):
    flat = list(args) if isinstance(args, (tuple, list)) else [args]
    flat += list((kwargs or {}).values())
    out = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out
