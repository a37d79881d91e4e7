"""Cross-layer KV sharing on the generic path: the keys / values a layer stores, as side inputs.

[Note: KV sharing as made side inputs]
Gemma 3n and Gemma 4 with ``num_kv_shared_layers > 0`` create one dict per forward
(``shared_kv_states``, a ``KVSharingDict``) and pass it to every layer; a "store" layer writes
its keys and values into it (``dict[layer_type] = (k, v)``) and the later "reuse" layers read
them instead of computing their own, so their gradient flows back into the store layer's
k / v projections. The generic path records that dict among the layer arguments (empty: the
stubs write nothing) and never hands it to a layer. Instead each store layer is a unit that
MAKES side inputs (``StagedModel.produce_side_inputs``): it runs on a fresh dict holding what
the earlier store layers made, and what it writes there, its (k, v), is appended to the ctx
(``GenericContext.made``). Every later layer runs on a fresh dict of the same class filled
from ``made`` (the entries of the store layers before it, a later one replacing an earlier
one of the same key, as in the model's forward), whose tensors are side inputs like the
per-layer inputs: the engine hands them out as leaves, sums their gradients over the reuse
layers and backpropagates the sums through the store unit's recompute ([Note: side inputs]
in engine/schedule.py). The store unit's output comes from that same run (kept for the
``run_unit`` call that follows on the same input), so its dropout draws and its compute are
those of one layer call.

Which layers store is found on the self-check's tiny copy: the layers whose run writes into
a dict argument that a later layer reads (it differs or fails without it), and a boolean
attribute of the layers' modules that is True on exactly those (``store_full_length_kv`` of
the attention); the real model's store layers are those whose attribute is True
(``store_layers``). A layer that writes into the dict although it is no store layer, or a
store layer that writes nothing, is an error (``written``'s callers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class KVSharing:
    """How a model's layers share keys / values (``Layout.kv``).

    slot: the layer argument holding the dict the layers share (positional index after the
        hidden states, or keyword: ``"shared_kv_states"``).
    marker: the dotted path, inside a layer, of the boolean attribute that is True on the
        layers that store (``"self_attn.store_full_length_kv"``).
    """

    slot: int | str
    marker: str


def slot_value(call: tuple[tuple, dict], slot: int | str) -> Any:
    """The argument ``slot`` of a recorded layer call (args, kwargs); None where absent."""
    args, kwargs = call
    if isinstance(slot, int):
        return args[slot] if slot < len(args) else None
    return kwargs.get(slot)


def with_slot(call: tuple[tuple, dict], slot: int | str, value: Any) -> tuple[tuple, dict]:
    """A copy of the layer call with argument ``slot`` replaced by ``value``."""
    args, kwargs = call
    if isinstance(slot, int):
        return args[:slot] + (value,) + args[slot + 1:], kwargs
    return args, {**kwargs, slot: value}


def shared_call(kv: KVSharing, call: tuple[tuple, dict], index: int,
                made: tuple) -> tuple[tuple[tuple, dict], MutableMapping, dict]:
    """Layer ``index``'s call with a fresh shared dict: ``(call, fresh, given)``, ``fresh``
    holding the entries of ``made`` ((layer, key, value) in making order) of the layers before
    ``index``, ``given`` a plain copy of them to find what the layer writes (``written``)."""
    recorded = slot_value(call, kv.slot)
    if not isinstance(recorded, MutableMapping):
        raise ValueError(f"layer {index} takes no dict of shared keys / values as argument "
                         f"{kv.slot!r}, where the self-check's tiny copy did")
    fresh = type(recorded)()
    for layer, key, value in made:
        if layer < index:
            fresh[key] = value
    return with_slot(call, kv.slot, fresh), fresh, dict(fresh)


def written(given: dict, fresh: MutableMapping) -> list[tuple[Any, Any]]:
    """The (key, value) pairs a layer wrote into ``fresh`` (new keys, or replaced values)."""
    return [(k, v) for k, v in fresh.items() if k not in given or given[k] is not v]


def made_tensors(made: tuple) -> list[torch.Tensor]:
    """The floating tensors of ``made``'s values, in making order (each a side input)."""
    return [t for _, _, value in made for t in pytree.tree_leaves(value)
            if torch.is_tensor(t) and t.is_floating_point()]


def _attribute(module: nn.Module, path: str) -> Any:
    head, _, name = path.rpartition(".")
    try:
        return getattr(module.get_submodule(head) if head else module, name, None)
    except AttributeError:
        return None


def store_layers(layers: nn.ModuleList, kv: KVSharing | None) -> frozenset[int]:
    """The indices of the layers whose marker attribute is True (the store layers)."""
    if kv is None:
        return frozenset()
    return frozenset(i for i, layer in enumerate(layers) if _attribute(layer, kv.marker) is True)


def _markers(layers: nn.ModuleList, stores: set[int]) -> list[str]:
    """Dotted paths of boolean attributes of the layers' modules True on exactly ``stores``."""
    found = []
    for name, module in layers[0].named_modules():
        for attr, value in vars(module).items():
            path = f"{name}.{attr}" if name else attr
            if isinstance(value, bool) and not attr.startswith("_") and \
                    {i for i, layer in enumerate(layers) if _attribute(layer, path) is True} \
                    == stores:
                found.append(path)
    return found


def find_kv_sharing(staged: Any, batch: dict,
                    refuse: Callable[[str], Exception]) -> KVSharing | None:
    """On the self-check's tiny copy (``staged``: staged without ``Layout.kv``, so its layers
    run on the recorded dict and write into it as in the model's forward): the KV sharing of
    its layers, or None where no layer reads what another wrote into a dict they share
    (Gemma 4's default stores keys / values nobody reads). ``refuse(message)``: the error to
    raise where the sharing takes another form."""
    with torch.no_grad():
        hidden, ctx = staged.embed({k: v for k, v in batch.items() if k != "labels"})
        if not any(isinstance(v, MutableMapping) for args, kwargs in ctx.calls
                   for v in [*args, *kwargs.values()]):
            return None  # no dict the layers share: nothing to run
        writers: dict[int, set] = {}
        hiddens = []
        for i in range(staged.num_units):
            dicts = {key: v for key, v in [*enumerate(ctx.calls[i][0]), *ctx.calls[i][1].items()]
                     if isinstance(v, MutableMapping)}
            before = {key: dict(v) for key, v in dicts.items()}
            hiddens.append(hidden)
            hidden = staged.run_unit(i, hidden, ctx)
            slots = {key for key, v in dicts.items() if written(before[key], v)}
            if slots:
                writers[i] = slots
        if not writers:
            return None
        slots = set().union(*writers.values())
        if len(slots) != 1:
            raise refuse(f"layers write into several dicts they share ({sorted(slots, key=str)})")
        slot = next(iter(slots))
        readers = [j for j in range(min(writers) + 1, staged.num_units)
                   if not _same_without(staged, j, hiddens, hidden, ctx, slot)]
    if not readers:
        return None
    layers = staged.units()
    markers = _markers(nn.ModuleList(layers), set(writers))
    if not markers:
        raise refuse(f"layers {sorted(writers)} store keys / values that layers {readers} "
                     "read, and no boolean attribute of the layers marks the storing ones "
                     "(as Gemma 3n's and Gemma 4's store_full_length_kv does), so the staging "
                     "cannot tell a model's storing layers")
    return KVSharing(slot, markers[0])


def _same_without(staged: Any, j: int, hiddens: list, last: torch.Tensor, ctx: Any,
                  slot: int | str) -> bool:
    """Whether layer ``j`` gives the same output on an empty shared dict (it reads none)."""
    recorded = slot_value(ctx.calls[j], slot)
    calls = list(ctx.calls)
    calls[j] = with_slot(calls[j], slot, type(recorded)())
    expected = hiddens[j + 1] if j + 1 < len(hiddens) else last
    try:
        out = staged.run_unit(j, hiddens[j], dataclasses.replace(ctx, calls=calls))
        return torch.equal(out, expected)
    except Exception:  # noqa: BLE001 - a layer that cannot run without the dict reads it
        return False
