"""Per-parameter shards: this rank's slice of every trainable parameter, for optimizers.

[Note: per-parameter shards]
A unit's trainable shard (``shard_param``) is a flat slice of ``[p_0 | p_1 | ...]``
([Note: flat unit layout] in ``flat_param.py``). ``ParamShards`` cuts it into one 1-D
``nn.Parameter`` per trainable parameter (tied weights once): this rank's elements of it,
possibly none, a VIEW of the shard's storage, so an optimizer keeps the user's parameter groups.
After every backward each one's ``.grad`` points at its slice of the shard gradient
(``bind_grads``); after a re-layout the same Parameter objects are re-pointed at the new shards
(``rebind``), so param groups, LR schedulers and state keys stay valid. Checkpoints and
re-layouts see the optimizer state per unit in flat order (``unit_states`` /
``load_unit_states``), the format of an optimizer over the flat shards (``engine.parameters()``,
still supported). docs/engine.md, "Per-parameter shards".

[Note: parameters without a gradient]
A parameter the model's forward does not reach in a step (a DeepSeek-V3.2 / GLM-5 indexer, a
pooler a causal LM never calls, the vision tower of text-only fine-tuning, an expert module no
token chose) gets no ``.grad`` on stock, and ``optimizer.step()`` skips it: no weight decay, no
moment update, no step count. Here its slice of the flat gradient is zeros, and a step over
zeros still decays it and moves its moments. So each unit records which of its parameters a
backward reached (a post-accumulate-grad hook per leaf: ``FlatParamUnit.touched``), the engine
sums the flags over the ranks inside the step's loss all-reduce (no extra collective for
``train_step``; one small all-reduce for an open step's ``backward_step``), and
``hold_untouched``'s step hooks hide the ``.grad`` of every parameter no rank reached since
``zero_grad`` while the optimizer steps: it skips them, as stock does. A parameter never
reached then gets a fresh state (zeros, step 0: AdamW's first real step from it equals a first
step from no state), so every unit's state stays complete for checkpoints and re-layouts. An
optimizer over the flat shards (``engine.parameters()``) cannot skip part of a shard: with it,
an unreached parameter is stepped on a zero gradient.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import nn

from . import collectives as C

__all__ = ["ParamShards", "ParamSlice", "unit_states", "split_unit_states", "load_unit_states",
           "OptimizerLayout", "optimizer_layout"]


class ParamSlice(NamedTuple):
    """Where one parameter's shard sits: its unit, [lo, hi) inside the unit's (k_r,) trainable
    shard, and its names (the first is ``named_parameters``' name)."""

    unit: int
    lo: int
    hi: int
    names: tuple[str, ...]


class ParamShards:
    """One 1-D ``nn.Parameter`` per trainable parameter, viewing this rank's slice of the unit
    shards (see [Note: per-parameter shards]).

    Args:
        units: the engine's units in ``engine.parameters()`` order.
        rank: this rank.
    """

    def __init__(self, units: Sequence[Any], rank: int) -> None:
        self._units, self.rank = list(units), rank
        self.slices: list[ParamSlice] = []
        self.params: list[nn.Parameter] = []
        for u, unit in enumerate(self._units):
            for lo, hi, info in self._ranges(unit):
                self.slices.append(ParamSlice(u, lo, hi, tuple(info.aliases)))
                self.params.append(nn.Parameter(unit.shard_param.detach()[lo:hi]))
        self.by_name = {name: p for s, p in zip(self.slices, self.params) for name in s.names}

    @property
    def untouched(self) -> list[int]:
        """Indices into ``params`` of the parameters no rank has given a gradient since
        ``zero_grad`` (the units' ``unreached``, in the same order: [Note: parameters without
        a gradient])."""
        flags = (f for unit in self._units for f in unit.unreached)
        return [k for k, unreached in enumerate(flags) if unreached]

    def hold_untouched(self, optimizer: torch.optim.Optimizer) -> None:
        """Step hooks on ``optimizer`` (over these shards): during ``optimizer.step()`` every
        parameter in ``untouched`` has ``.grad`` None, so the optimizer skips it as stock skips
        a parameter its forward did not reach; afterwards its ``.grad`` is back, and one that
        has never been stepped gets a fresh state (zeros, step 0) shaped like the others', so
        every unit's state stays complete for checkpoints and re-layouts. Idempotent. See
        [Note: parameters without a gradient]."""
        if getattr(optimizer, "_cephalo_holds_untouched", None) is self:
            return
        held: list[tuple[nn.Parameter, torch.Tensor | None]] = []

        def before(opt, args, kwargs) -> None:
            held.clear()
            for k in self.untouched:
                p = self.params[k]
                held.append((p, p.grad))
                p.grad = None

        def after(opt, args, kwargs) -> None:
            if not held:
                return
            like = next((opt.state[q] for g in opt.param_groups for q in g["params"]
                         if opt.state.get(q)), None)
            like_param = next((q for g in opt.param_groups for q in g["params"]
                               if opt.state.get(q) is like), None)
            for p, grad in held:
                p.grad = grad
                if like is not None and not opt.state.get(p):
                    opt.state[p] = {key: (torch.zeros(p.shape, dtype=v.dtype, device=v.device)
                                          if _per_element(v, like_param) else _fresh(v))
                                    for key, v in like.items()}
            held.clear()

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
        optimizer._cephalo_holds_untouched = self

    def _ranges(self, unit) -> Iterator[tuple[int, int, Any]]:
        """(lo, hi, info) of each trainable parameter within this rank's trainable shard."""
        start = unit.trainable.starts[self.rank]
        count = unit.trainable.numel_per_rank[self.rank]
        for info in unit.infos:
            if info.requires_grad:  # trainable parameters come first, offsets within Nt
                lo = min(max(info.offset, start), start + count) - start
                hi = max(min(info.offset + info.numel, start + count) - start, lo)
                yield lo, hi, info

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(first name, shard) per trainable parameter, in unit order."""
        for s, p in zip(self.slices, self.params):
            yield s.names[0], p

    def bind_grads(self) -> None:
        """Each shard's ``.grad`` := its slice of the unit's shard gradient (None where the
        unit has none)."""
        for s, p in zip(self.slices, self.params):
            grad = self._units[s.unit].shard_param.grad
            p.grad = None if grad is None else grad[s.lo:s.hi]

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def rebind_unit(self, unit: int) -> None:
        """After unit ``unit`` was re-laid: its parameters' same Parameter objects, each a view
        of its new slice (their ``.grad`` dropped: the old slices no longer exist)."""
        shard = self._units[unit].shard_param.detach()
        new = iter(self._ranges(self._units[unit]))
        with torch.no_grad():
            for i, s in enumerate(self.slices):
                if s.unit == unit:
                    lo, hi, info = next(new)
                    assert tuple(info.aliases) == s.names
                    self.slices[i] = ParamSlice(unit, lo, hi, s.names)
                    self.params[i].grad = None
                    self.params[i].data = shard[lo:hi]

    def unit_params(self, unit: int) -> list[tuple[nn.Parameter, ParamSlice]]:
        return [(p, s) for p, s in zip(self.params, self.slices) if s.unit == unit]


class OptimizerLayout(NamedTuple):
    """How an optimizer's parameters map onto the units: ``flat`` (over ``engine.parameters()``,
    one per unit) or over per-parameter shards (``shards``)."""

    flat: bool
    shards: ParamShards | None


def optimizer_layout(engine, optimizer: torch.optim.Optimizer, what: str) -> OptimizerLayout:
    """Which parameters ``optimizer`` holds; ValueError naming ``what`` for any other tensor."""
    flat = {id(p) for p in engine.parameters()}
    shards = engine.param_shards if engine.has_param_shards else None
    pieces = set() if shards is None else {id(p) for p in shards.params}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if all(id(p) in flat for p in held):
        return OptimizerLayout(True, None)
    if shards is not None and all(id(p) in pieces for p in held):
        return OptimizerLayout(False, shards)
    raise ValueError(f"{what}: the optimizer holds a tensor that is neither one of "
                     "engine.parameters() nor one of the per-parameter shards "
                     "(engine.param_shards); build it over one of them only")


PER_ELEMENT = "@per_element"
"""Suffix of a 0-dim optimizer state (AdamW's ``step``) stored one value per element because
the parameters of a unit disagree on it (``unit_states``)."""


def unit_states(engine, optimizer: torch.optim.Optimizer, what: str
                ) -> dict[int, dict[str, Any]]:
    """{unit index: optimizer state of its trainable shard} for the units with state: per-element
    tensors as (k_r,) (per-parameter shards concatenated in flat order), scalars (AdamW's
    ``step``) as they are. Where the parameters of a unit hold different 0-dim tensor scalars
    on any rank (a parameter the optimizer skipped: [Note: parameters without a gradient]),
    every rank stores that key per element as ``key + PER_ELEMENT`` (one small all-reduce
    decides, so every rank writes the same keys); ``split_unit_states`` turns it back into one
    0-dim value per parameter. ValueError when only some parameters of a unit have state or
    they disagree on a scalar that is not a 0-dim tensor. Collective when the optimizer holds
    the per-parameter shards and the world size is above 1."""
    layout = optimizer_layout(engine, optimizer, what)
    params = engine.parameters()
    if layout.flat:
        return {u: optimizer.state[p] for u, p in enumerate(params) if p in optimizer.state}
    members = [layout.shards.unit_params(u) for u in range(len(params))]
    states = [[optimizer.state.get(p) for p, _ in m] for m in members]
    differs = torch.tensor([float(_disagree(st)) for st in states], dtype=torch.float64,
                           device=engine.device)
    if engine.world_size > 1:
        C.all_reduce_sum(differs, engine.group, engine.stats)
    out: dict[int, dict[str, Any]] = {}
    for u in range(len(params)):
        if not members[u] or all(not s for s in states[u]):
            continue
        out[u] = _merge_unit(u, members[u], states[u], bool(differs[u] > 0), what)
    return out


def _disagree(states: list) -> bool:
    """Whether the (stateful) parameters of a unit hold different 0-dim tensors under a key."""
    held = [s for s in states if s]
    for key in held[0] if held else ():
        values = [s[key] for s in held if torch.is_tensor(s.get(key)) and s[key].dim() == 0]
        if any(not _same(v, values[0]) for v in values[1:]):
            return True
    return False


def _merge_unit(u: int, members, states, per_element_scalars: bool, what: str) -> dict:
    if any(not s for s in states):
        raise ValueError(f"{what}: only some parameters of unit {u} have optimizer state "
                         "(a parameter group was never stepped?); step every group alike")
    merged: dict[str, Any] = {}
    for key, first in states[0].items():
        if all(_per_element(s.get(key), p) for (p, _), s in zip(members, states)):
            merged[key] = torch.cat([s[key] for s in states])
        elif per_element_scalars and torch.is_tensor(first) and first.dim() == 0:
            merged[key + PER_ELEMENT] = torch.cat([s[key].reshape(1).expand(p.numel())
                                                   for (p, _), s in zip(members, states)])
        else:
            if any(not _same(s[key], first) for s in states):
                raise ValueError(f"{what}: the parameters of unit {u} hold different "
                                 f"optimizer state {key!r}; step every group alike")
            merged[key] = first
    return merged


def _per_element(value: Any, param: torch.Tensor) -> bool:
    """A state tensor with one entry per element of ``param`` (AdamW's moments)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == param.shape


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def split_unit_states(engine, optimizer: torch.optim.Optimizer,
                      states: dict[int, dict[str, Any]], what: str
                      ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """(parameter, state) pairs of ``optimizer``'s parameters for units' states as
    ``unit_states`` returns them (for this rank's current shards): the flat shard's state as it
    is, or split over the per-parameter shards (per-element tensors cut at their slices,
    scalars copied to each)."""
    layout = optimizer_layout(engine, optimizer, what)
    params = engine.parameters()
    out = []
    for u, state in states.items():
        if layout.flat:
            out.append((params[u], state))
            continue
        for p, s in layout.shards.unit_params(u):
            mine = {}
            for key, value in state.items():
                if key.endswith(PER_ELEMENT):  # one 0-dim value per parameter (unit_states)
                    piece = value[s.lo:s.hi]
                    mine[key[:-len(PER_ELEMENT)]] = piece[0].clone() if piece.numel() else \
                        value.new_zeros(())
                else:
                    mine[key] = value[s.lo:s.hi].clone() if _per_element(value, params[u]) \
                        else _copy(value)
            out.append((p, mine))
    return out


def load_unit_states(engine, optimizer: torch.optim.Optimizer,
                     states: dict[int, dict[str, Any]], what: str) -> None:
    """Set each unit's optimizer state (``split_unit_states``) into ``optimizer.state``."""
    for param, state in split_unit_states(engine, optimizer, states, what):
        optimizer.state[param] = state


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _fresh(value: Any) -> Any:
    """A state entry as a first step finds it: tensors zero-filled, numbers 0."""
    if torch.is_tensor(value):
        return torch.zeros_like(value)
    return type(value)(0) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else value
