"""Self-check refusals read off the tiny copy's own forward on the check's batch: layers run
inside a custom autograd function (``torch.autograd.Function``, whose forward runs with
autograd off and whose backward recomputes the layers its own way), and a token head whose
logits are not one row per input token. Either is a structure the generic path cannot stage,
named here by its cause rather than by the error the staging would hit."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hf_cephalo.models.generic import StructureError
from hf_cephalo.models.generic_heads import QA_LABELS, TOKEN_TASKS


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


def _own_forward(model: nn.Module, batch: dict, layers: str) -> tuple[Any, list]:
    """(the model's output on ``batch`` without its labels, or None where that forward fails;
    for each call of a layer of the stack ``layers``: whether autograd was on, and the
    autograd function it ran inside where it was off)."""
    calls: list[tuple[bool, str | None]] = []

    def seen(*_):
        grad = torch.is_grad_enabled()
        calls.append((grad, None if grad else _autograd_function_name()))

    hooks = [m.register_forward_pre_hook(seen) for m in model.get_submodule(layers)]
    inputs = {k: v for k, v in batch.items() if k != "labels" and k not in QA_LABELS}
    try:
        with torch.enable_grad():
            out = model(**inputs)
    except Exception:  # noqa: BLE001 - the comparison reports a forward that fails
        out = None
    finally:
        for hook in hooks:
            hook.remove()
    return out, calls


def refuse_by_own_forward(model: nn.Module, batch: dict, layers: str, task: str) -> None:
    """StructureError for a tiny copy whose own forward on ``batch`` (input ids (B, S)), with
    autograd on, runs the layers of its stack ``layers`` (a ModuleList's name) with autograd
    off: inside a custom autograd function (Reformer's ``_ReversibleFunction``: reversible
    residual layers, recomputed from their outputs in its backward), not the per-unit graphs
    the generic path builds; or, for a token ``task`` (masked LM, token classification), whose
    logits are not (B, S, ...): a head predicting a fixed number of positions (Perceiver's
    decoder queries max_position_embeddings positions, its inputs padded to that length)."""
    out, calls = _own_forward(model, batch, layers)
    off = [fn for grad, fn in calls if not grad]
    name = type(model).__name__
    if off:
        inside = f"inside the custom autograd function {off[0]}" if off[0] else \
            "with autograd off"
        raise StructureError(
            f"{name}'s forward runs its layers ({layers}) {inside}, whose own backward "
            "computes their gradients (reversible layers, e.g., recompute each layer's input "
            "from its output); the generic path runs each layer as a unit with its own graph "
            "and autograd's backward, so it cannot stage them")
    logits = getattr(out, "logits", None)
    ids = batch.get("input_ids")
    if task in TOKEN_TASKS and isinstance(logits, torch.Tensor) and ids is not None \
            and logits.dim() >= 2 and tuple(logits.shape[:2]) != tuple(ids.shape):
        raise StructureError(
            f"{name}'s logits hold {logits.shape[1]} positions for rows of {ids.shape[1]} "
            "tokens: its head predicts a fixed number of positions (its inputs padded to "
            "that length), not one per input token, which the generic token heads score")
