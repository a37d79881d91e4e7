"""A self-check refusal by how a model's forward runs its layers: inside a custom autograd
function (``torch.autograd.Function``, whose forward runs with autograd off and whose
backward recomputes the layers its own way), which the generic path cannot split."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hf_cephalo.models.generic import StructureError


def _autograd_function_name() -> str | None:
    """The name of the ``torch.autograd.Function`` whose forward is running (found on the
    call stack by its ``ctx`` argument, a backward node such as ``_ReversibleFunctionBackward``),
    or None."""
    frame = inspect.currentframe()
    while frame is not None:
        ctx = frame.f_locals.get("ctx")
        if frame.f_code.co_name == "forward" and \
                isinstance(ctx, torch.autograd.function.BackwardCFunction):
            return type(ctx).__name__.removesuffix("Backward")
        frame = frame.f_back
    return None


def refuse_layers_in_autograd_function(model: nn.Module, batch: dict, layers: str) -> None:
    """StructureError for a model whose own forward on ``batch`` (B, S) with autograd on runs
    the layers of its stack ``layers`` (a ModuleList's name) with autograd off: inside a
    custom autograd function (Reformer's ``_ReversibleFunction``: reversible residual layers,
    run without a graph and recomputed from their outputs in its backward). The generic path
    runs each layer as a unit with its own graph and backward, not that function's; the model's
    forward never runs the layers in the tiny check otherwise. A forward that fails here is
    left to the comparison that follows to report."""
    calls: list[tuple[bool, str | None]] = []

    def seen(*_):
        grad = torch.is_grad_enabled()
        calls.append((grad, None if grad else _autograd_function_name()))

    hooks = [m.register_forward_pre_hook(seen) for m in model.get_submodule(layers)]
    try:
        with torch.enable_grad():
            model(**batch)
    except Exception:  # noqa: BLE001 - the comparison reports a forward that fails
        pass
    finally:
        for hook in hooks:
            hook.remove()
    off = [fn for grad, fn in calls if not grad]
    if off:
        inside = f"inside the custom autograd function {off[0]}" if off[0] else \
            "with autograd off"
        raise StructureError(
            f"{type(model).__name__}'s forward runs its layers ({layers}) {inside}, whose "
            "own backward computes their gradients (reversible layers, e.g., recompute each "
            "layer's input from its output); the generic path runs each layer as a unit with "
            "its own graph and autograd's backward, so it cannot stage them")
