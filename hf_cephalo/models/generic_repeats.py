"""Layers the model's forward calls several times in a row (ALBERT's shared layer group).

[Note: repeated layer calls]
ALBERT shares one layer group's parameters across its depth: ``albert_layer_groups`` holds
``num_hidden_groups`` modules, and the forward calls group g for ``num_hidden_layers /
num_hidden_groups`` consecutive layers, each call on the previous call's output. The generic
path stages such a stack with one unit per module, as ever: unit g runs its module once per
recorded call, in order, so the unit's parameters are gathered once per pass and their
gradient is the sum over the calls, as in the model's own backward. ``trace_layout`` accepts a
call order made of one run of consecutive calls per layer, in layer order ([0, 0, 0],
[0, 0, 1, 1]); any other order is still refused. The tiny copy has fewer calls per run than the
model (``num_hidden_layers`` is shrunk), so the staging never fixes a count: ``embed`` records
every call the forward makes, and, since the last layer's last call cannot be told from its
first one, ends the forward where the first module outside the layers is called after them
(``stop_after_layers``), before any head module or dropout runs. What this path does not
combine with repeats (KV sharing, side inputs, plain extras: ``repeats_problem``; modules
called between the calls: ``trace_layout``) is refused.
"""

from __future__ import annotations

import contextlib
from itertools import groupby
from typing import Callable, Iterator

import torch
from torch import nn

from hf_cephalo.models.generic_outputs import call_layer


def runs_in_order(order: list[int], num_layers: int) -> bool:
    """Whether ``order`` (the layer indices in call order) is one run of consecutive calls per
    layer, in layer order: ``[0, 0, 1, 1]`` for 2 layers, not ``[0, 1, 0]``."""
    return [i for i, _ in groupby(order)] == list(range(num_layers))


def check_order(name: str, order: list[int], num_layers: int, called_at: list[int],
                error: type[Exception]) -> None:
    """Raise ``error`` with the reason unless the call order ``order`` of ``num_layers`` layers
    can be staged: each layer once in order, or one run of calls per layer in order with no
    other module called between the first and the last layer call (``called_at``: per module
    call outside the layers, how many layer calls came before it)."""
    if order == list(range(num_layers)):
        return
    if not runs_in_order(order, num_layers):
        raise error(f"the forward of {name} calls its layers in the order {order[:12]}, not "
                    "each once (or each in one run of calls) in order")
    if any(0 < k < len(order) for k in called_at):
        raise error(f"the forward of {name} calls its layers several times each (order "
                    f"{order[:12]}) and runs other modules between those calls; the generic "
                    "path runs each layer's calls back to back")


@contextlib.contextmanager
def stop_after_layers(model: nn.Module, layers_name: str, started: Callable[[], bool],
                      stop: type[Exception]) -> Iterator[None]:
    """While active, the first call of a module outside the layers (and not holding them) made
    once ``started()`` is true raises ``stop`` (it ends ``embed``'s forward after the last
    layer call, [Note: repeated layer calls])."""
    layers = model.get_submodule(layers_name)
    inside = {id(m) for m in layers.modules()}

    def hook(module, args):
        if started():
            raise stop

    handles = [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
               if n and id(m) not in inside and not (layers_name + ".").startswith(n + ".")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def repeats_problem(name: str, kv: object, side: tuple, plain_extras: bool) -> str | None:
    """Why a layout whose forward repeats layer calls cannot be staged, or None."""
    if kv is not None or side or plain_extras:
        return (f"the forward of {name} calls its layers several times each, and its layers "
                "also share keys / values, take side inputs or return extra data; the generic "
                "path does not combine these")
    return None


def run_repeated(layer: nn.Module, hidden: torch.Tensor, calls: list[tuple[tuple, dict]],
                 form: int | str | None) -> torch.Tensor:
    """``layer`` once per recorded call, each on the previous call's output (of form ``form``,
    ``generic_outputs.layer_form``): (m, S, H) -> same."""
    for call in calls:
        hidden = call_layer(layer, hidden, call, form)
    return hidden
