"""Parameters of a gathered unit as per-parameter leaves aliasing its flat buffer: a
microbatch's backward adds into the unit's ONE flat gradient in place and allocates no
unit-sized tensor ([Note: parameter views while unsharded] in engine/flat_param.py), tied uses,
frozen parameters and low-precision leaves included, gradients equal to plain module
parameters'. No process group.
"""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hf_cephalo.engine.flat_param import (ParamLeaves, collect_params, install_param_views,
                                          param_infos)
from tests.alloc_counts import UnitSizedAllocations

RTOL, ATOL = 1e-5, 1e-6


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


def _flat_views(unit: nn.Module, dtype: torch.dtype | None = None):
    """(infos, uses, trainable (Nt,), frozen) of ``unit``, the parts cast to ``dtype``."""
    fqns: dict[int, list[str]] = {}
    for name, p in unit.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(name)
    params, uses = collect_params("unit", [unit], fqns)
    infos = param_infos("unit", params, fqns)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(dtype or torch.float32)
    nt = sum(i.numel for i in infos if i.requires_grad)
    return infos, [uses[id(p)] for p in params], flat[:nt].clone(), flat[nt:].clone()


def _split_views(infos, uses, leaf, frozen) -> None:
    """The scheme the leaves replaced: ONE split of an (Nt,) leaf into views (its backward
    concatenates the pieces' gradients), kept here to show the counter sees that."""
    nt = leaf.numel()
    pieces = [*torch.split(leaf, [i.numel for i in infos if i.requires_grad]),
              *torch.split(frozen, [i.numel for i in infos if not i.requires_grad])]
    assert all(i.requires_grad == (i.offset < nt) for i in infos)
    for info, entries, piece in zip(infos, uses, pieces):
        for module, attr in entries:
            module._parameters[attr] = piece.view(info.shape)


def test_no_unit_sized_allocation_in_a_microbatch_backward():
    """Once the flat gradient exists, no microbatch's backward allocates a tensor of the
    unit's trainable size: each parameter's gradient is added in place into its view of the
    flat gradient (tied: one leaf, two uses). The split views it replaced allocated one per
    microbatch (the concatenation). Gradients equal plain parameters' over 3 microbatches."""
    torch.manual_seed(0)
    unit = TiedUnit()
    reference = copy.deepcopy(unit)
    infos, uses, trainable, frozen = _flat_views(unit)
    assert sum(not i.requires_grad for i in infos) == 2 and len(infos) == 11
    leaves = ParamLeaves(infos, trainable, requires_grad=True)
    grad = torch.zeros_like(trainable)
    leaves.accumulate_into(grad)
    for leaf in leaves.leaves:  # aliases: no copy of the gathered buffer
        assert leaf.untyped_storage().data_ptr() == trainable.untyped_storage().data_ptr()
    xs = [torch.randn(3, 8) for _ in range(3)]
    for j, x in enumerate(xs):
        install_param_views(infos, uses, leaves.leaves, frozen)  # the engine's use_params
        loss = unit(x).square().sum()
        with UnitSizedAllocations(trainable.numel()) as counted:
            loss.backward()
        assert counted.ops == [], (j, counted.ops)
        reference(x).square().sum().backward()
    assert unit.d.weight is unit.e.weight  # the tied entries hold the same leaf
    for info in infos:
        ref = dict(reference.named_parameters())[info.fqn]
        if info.requires_grad:
            got = grad[info.offset:info.offset + info.numel].view(info.shape)
            torch.testing.assert_close(got, ref.grad, rtol=RTOL, atol=ATOL)
        else:
            assert ref.grad is None
    leaves.release_grad()
    assert all(leaf.grad is None for leaf in leaves.leaves)

    old = TiedUnit()  # the counter does see the old scheme's concatenation
    infos, uses, trainable, frozen = _flat_views(old)
    leaf = trainable.requires_grad_(True)
    for _ in range(2):
        _split_views(infos, uses, leaf, frozen)
        loss = old(xs[0]).square().sum()
        with UnitSizedAllocations(leaf.numel()) as counted:
            loss.backward()
        assert counted.ops == ["cat"], counted.ops


def test_low_precision_leaves_accumulate_in_fp32():
    """bf16 leaves with an fp32 flat gradient: per-parameter hooks add each microbatch's bf16
    gradient into it (no unit-sized tensor in either dtype), equal to the bf16 module's
    per-microbatch gradients summed in fp32."""
    torch.manual_seed(2)
    unit = TiedUnit()
    reference = copy.deepcopy(unit).to(torch.bfloat16)
    unit.to(torch.bfloat16)
    infos, uses, trainable, frozen = _flat_views(unit, torch.bfloat16)
    leaves = ParamLeaves(infos, trainable, requires_grad=True)
    grad = torch.zeros(trainable.numel(), dtype=torch.float32)
    leaves.accumulate_into(grad)
    expected = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()
                if p.requires_grad}
    for x in [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]:
        install_param_views(infos, uses, leaves.leaves, frozen)
        loss = unit(x).float().square().sum()
        with UnitSizedAllocations(trainable.numel()) as counted:
            loss.backward()
        assert counted.ops == [] and all(leaf.grad is None for leaf in leaves.leaves)
        reference.zero_grad()
        reference(x).float().square().sum().backward()
        for n, p in reference.named_parameters():
            if p.requires_grad:
                expected[n] += p.grad.float()
    for info in infos:
        if info.requires_grad:
            got = grad[info.offset:info.offset + info.numel].view(info.shape)
            torch.testing.assert_close(got, expected[info.fqn], rtol=0, atol=0)
    # the hooks hold no reference to the leaves: dropping them frees the gathered buffer at
    # once (a leaf -> hook -> leaves cycle kept every gathered unit until a gc pass)
    storage = StorageWeakRef(trainable.untyped_storage())
    gc.disable()
    try:
        leaves.release_grad()
        for entries in uses:
            for module, attr in entries:
                module._parameters[attr] = None
        del leaves, trainable, loss
        assert storage.expired()
    finally:
        gc.enable()


def test_views_without_grad_and_empty_parts():
    """No autograd (evaluation) and a unit without trainable or frozen parameters."""
    torch.manual_seed(1)
    unit = nn.Linear(4, 4)
    reference = copy.deepcopy(unit)
    infos, uses, trainable, frozen = _flat_views(unit)
    assert frozen.numel() == 0
    leaves = ParamLeaves(infos, trainable, requires_grad=False)
    with torch.no_grad():
        install_param_views(infos, uses, leaves.leaves, frozen)
        x = torch.randn(2, 4)
        torch.testing.assert_close(unit(x), reference(x), rtol=0, atol=0)
    assert not unit.weight.requires_grad
    unit = nn.Linear(4, 4).requires_grad_(False)
    infos, uses, trainable, frozen = _flat_views(unit)
    assert trainable.numel() == 0 and frozen.numel() == 20
    leaves = ParamLeaves(infos, trainable, requires_grad=True)
    assert leaves.leaves == [] and not leaves.requires_grad
    install_param_views(infos, uses, leaves.leaves, frozen)
    assert unit.weight.shape == (4, 4) and not unit.weight.requires_grad
