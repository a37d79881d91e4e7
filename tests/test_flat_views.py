"""Parameter views of a unit's flat buffer: ONE flat-gradient accumulation per unit per
microbatch ([Note: parameter views while unsharded] in engine/flat_param.py), tied uses and
frozen parameters included, gradients equal to plain module parameters'. No process group.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hf_cephalo.engine.flat_param import collect_params, install_param_views, param_infos

RTOL, ATOL = 1e-5, 1e-6


class UnitSizedAllocations(TorchDispatchMode):
    """Counts aten results of exactly ``numel`` elements in NEW storage (views and in-place
    results share an input's storage and are not counted), by op name."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
        for t in _tensors(out, None):
            if t.numel() == self.numel and t.untyped_storage().data_ptr() not in inputs:
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


class TiedUnit(nn.Module):
    """Nine trainable parameters (one used twice, tied), two frozen ones."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 16)
        self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 8)
        self.e = nn.Linear(16, 8)
        self.e.weight = self.d.weight            # tied: two entries, one parameter
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(self.frozen(x)))))
        h = torch.tanh(self.c(h))
        return self.d(h) * self.e(h)


def _flat_views(unit: nn.Module):
    fqns: dict[int, list[str]] = {}
    for name, p in unit.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(name)
    params, uses = collect_params("unit", [unit], fqns)
    infos = param_infos("unit", params, fqns)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    nt = sum(i.numel for i in infos if i.requires_grad)
    leaf = flat[:nt].clone().requires_grad_(True)
    return infos, [uses[id(p)] for p in params], leaf, flat[nt:].clone()


def test_one_unit_sized_gradient_allocation_per_microbatch():
    """Per microbatch the backward allocates ONE trainable-sized tensor (the split's
    concatenation; later microbatches add it into ``leaf.grad`` in place). Per-parameter slice
    views allocate a zero-filled unit-sized gradient per parameter plus the sums (17 here)."""
    torch.manual_seed(0)
    unit = TiedUnit()
    reference = copy.deepcopy(unit)
    infos, uses, leaf, frozen = _flat_views(unit)
    assert sum(not i.requires_grad for i in infos) == 2 and len(infos) == 11
    xs = [torch.randn(3, 8) for _ in range(3)]
    for j, x in enumerate(xs):
        install_param_views(infos, uses, leaf, frozen)  # the engine's use_params, per call
        loss = unit(x).square().sum()
        with UnitSizedAllocations(leaf.numel()) as counted:
            loss.backward()
        assert counted.ops == ["cat"], (j, counted.ops)
        reference(x).square().sum().backward()
    for info in infos:
        ref = dict(reference.named_parameters())[info.fqn]
        if info.requires_grad:
            got = leaf.grad[info.offset:info.offset + info.numel].view(info.shape)
            torch.testing.assert_close(got, ref.grad, rtol=RTOL, atol=ATOL)
        else:
            assert ref.grad is None


def test_views_without_grad_and_empty_parts():
    """No autograd (evaluation) and a unit without trainable or frozen parameters."""
    torch.manual_seed(1)
    unit = nn.Linear(4, 4)
    reference = copy.deepcopy(unit)
    infos, uses, leaf, frozen = _flat_views(unit)
    assert frozen.numel() == 0
    with torch.no_grad():
        install_param_views(infos, uses, leaf.detach(), frozen)
        x = torch.randn(2, 4)
        torch.testing.assert_close(unit(x), reference(x), rtol=0, atol=0)
    unit = nn.Linear(4, 4).requires_grad_(False)
    infos, uses, leaf, frozen = _flat_views(unit)
    assert leaf.numel() == 0 and frozen.numel() == 20
    install_param_views(infos, uses, leaf, frozen)
    assert unit.weight.shape == (4, 4) and not unit.weight.requires_grad
