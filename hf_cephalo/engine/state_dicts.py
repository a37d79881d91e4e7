"""Whole-model views of a ``CephaloEngine``'s sharded parameters: full units and state dicts.

``iter_full_units`` gathers one unit at a time (``FullUnit``: every parameter name -> a view
of the gathered buffer), what the streamed save is built on; ``full_state_dict`` /
``trainable_state_dict`` assemble ``model.state_dict()``'s keys (or the trainable ones) on
rank 0; ``load_full_state_dict`` takes every rank's shards from a full dict.
``state_dict_keys`` maps each state-dict key to its parameter or buffer at construction.
The ``CephaloEngine`` methods of the same names delegate here.
"""

from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from .flat_param import FlatParamUnit

__all__ = ["FullUnit", "state_dict_keys", "iter_full_units", "full_state_dict",
           "trainable_state_dict", "load_full_state_dict"]


class FullUnit(NamedTuple):
    """One unit's full (gathered) parameters, as ``CephaloEngine.iter_full_units`` yields them.

    index: the unit's position in ``shard_metadata()`` (layers in order, root unit(s) after).
    tensors: every parameter name (tied aliases included, each alias the SAME tensor object) ->
        a view of the gathered flat buffer with the parameter's shape, on the engine's device in
        the training dtype. Valid until the iterator advances (copy what you keep).
    """

    index: int
    tensors: dict[str, torch.Tensor]


def _param_views(unit: FlatParamUnit, full) -> dict[str, torch.Tensor]:
    """Every alias of every parameter -> one view of the unit's full parts ``full``
    (``FlatParamUnit.gather_full``)."""
    out: dict[str, torch.Tensor] = {}
    for info, view in zip(unit.infos, unit.param_views(full)):
        out.update((alias, view) for alias in info.aliases)
    return out


def state_dict_keys(engine, fqns: dict[int, list[str]]) -> list[tuple[str, str, str]]:
    """(key, 'param', the parameter's first fqn) or (key, 'buffer', key) in
    ``model.state_dict()`` order (fqns, not parameter ids: the originals do not survive
    construction)."""
    out = []
    for key, value in engine.staged.model.state_dict(keep_vars=True).items():
        names = fqns.get(id(value)) if isinstance(value, nn.Parameter) else None
        out.append((key, "param", names[0]) if names else (key, "buffer", key))
    return out


def iter_full_units(engine, order: Sequence[int] | None = None) -> Iterator[FullUnit]:
    """Collective generator: gather one unit at a time, in ``order`` (unit indices of
    ``shard_metadata()``, repeats allowed; default: every unit once, in that order).

    Every rank must run it to the end (``for ... in``): each step is one all-gather of one
    unit. Rank 0 gets one ``FullUnit`` per entry of ``order``; the other ranks take part in
    the gathers and get nothing. At most one gathered unit is alive at a time as long as
    the caller drops the previous ``FullUnit`` before advancing (see [Note: streamed save]
    in ``export.py``).

    Raises:
        ValueError: an index outside ``range(len(shard_metadata()))`` (before any gather).
        RuntimeError: an earlier step raised part-way (``check_usable``).
    """
    engine.check_usable("iter_full_units")
    units = engine.all_units()
    order = list(range(len(units))) if order is None else [int(i) for i in order]
    bad = [i for i in order if not 0 <= i < len(units)]
    if bad:
        raise ValueError(f"iter_full_units: unit indices {bad} are outside 0..{len(units) - 1}")
    return _gather_units(engine, order)


def _gather_units(engine, order: list[int]) -> Iterator[FullUnit]:
    units = engine.all_units()
    for index in order:
        unit = units[index]
        full = unit.gather_full()
        if engine.rank == 0:
            yield FullUnit(index, _param_views(unit, full))
        del full  # before the next gather: one gathered unit alive at a time


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Collective: rank 0 gets ``model.state_dict()``'s keys (CPU tensors in the training
    dtype — fp32 for an fp32 model — tied aliases included, each alias the same tensor)
    with the current values; other ranks get None.

    Holds the whole model on rank 0: for small models and tests. To write a large model,
    stream it (``hf_cephalo.engine.export.save_pretrained_streamed``)."""
    engine.check_usable("full_state_dict")
    by_key: dict[str, torch.Tensor] = {}
    for full_unit in engine.iter_full_units():
        copies: dict[int, torch.Tensor] = {}
        for key, view in full_unit.tensors.items():
            if id(view) not in copies:
                copies[id(view)] = view.detach().to("cpu", copy=True)
            by_key[key] = copies[id(view)]
    if engine.rank != 0:
        return None
    model = engine.staged.model
    return {key: by_key[ref] if kind == "param" else
            model.get_buffer(ref).detach().to("cpu", copy=True)
            for key, kind, ref in engine._key_map}


def trainable_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Collective: rank 0 gets {parameter name: CPU tensor} for every trainable parameter
    (every alias of a tied one), other ranks None. Gathers only the trainable prefix of
    each unit that has one (bytes moved: the trainable elements, e.g. a LoRA adapter's;
    frozen base weights never travel). Raises RuntimeError as ``check_usable``."""
    engine.check_usable("trainable_state_dict")
    out: dict[str, torch.Tensor] = {}
    for unit in engine.all_units():
        if unit.trainable_numel == 0:
            continue
        flat = unit.gather_trainable()
        if engine.rank != 0:
            continue
        for info in unit.infos:
            if info.requires_grad:  # the trainable part starts at flat index 0
                value = flat[info.offset:info.offset + info.numel].view(info.shape).clone()
                out.update({alias: value for alias in info.aliases})
    return out if engine.rank == 0 else None


def load_full_state_dict(engine, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Every rank passes the same full dict (``model.state_dict()`` keys); takes its shards.

    Raises ValueError naming missing / unexpected keys or a shape mismatch (no collective).
    """
    engine.check_usable("load_full_state_dict")
    expected = {key for key, _, _ in engine._key_map}
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}; pass a state dict of this model, with "
                         "model.state_dict()'s keys")
    key_of = {}
    for key, kind, ref in engine._key_map:
        if kind == "param":
            key_of.setdefault(ref, key)
    for unit in engine.all_units():
        tensors = [state_dict[key_of[info.fqn]] for info in unit.infos]
        unit.load_flat(unit.flat_from_tensors(tensors))
    with torch.no_grad():
        for key, kind, ref in engine._key_map:
            if kind == "buffer":
                engine.staged.model.get_buffer(ref).copy_(state_dict[key])
