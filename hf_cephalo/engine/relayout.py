"""In-memory re-layout of the training state onto a new plan's r_i (issue 22 item 3; docs/design.md
contract 7; docs/engine.md "Re-layout in memory").

Usage (every rank, at a step boundary: after ``optimizer.step()`` and ``zero_grad()``)::

    relayout_state(engine, optimizer, layout)   # shards + optimizer state move; no files

[Note: re-layout in memory]
A unit's flat index ``[trainable | frozen]`` is the same under every plan; a plan only moves the
per-rank cut points. So a re-layout is, per unit and part, one ``all_to_all_single`` in which
rank s gives rank d the overlap of s's old range with d's new range: what ``load_sharded``
reads from a checkpoint onto a new plan (the same values bit for bit), and only elements that
change owner cross the wire. It moves everything on the trainable shard (parameter shard,
per-element optimizer state, a persisting gradient) and the frozen shard, one unit at a time
(peak: one unit's new shard-set), and keeps the optimizer's parameters the same objects, so
param groups, wrappers and LR schedulers stay valid. Every check, the one ``all_gather_object``
included, runs before any state moves, so ranks that disagree all raise instead of pairing the
wrong tensors. Collective, memory, identity and checks in detail: docs/engine.md, "Re-layout
in memory".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .flat_param import FlatParamUnit, ShardedState, split_unit_row
from .param_shards import load_unit_states, unit_states

if TYPE_CHECKING:
    from .engine import CephaloEngine

__all__ = ["relayout_state", "exchange_splits"]


class Splits(NamedTuple):
    """One rank's side of a re-layout exchange of one part: ``send[d]`` elements of its old
    shard go to rank d, ``recv[s]`` elements of its new shard come from rank s (rank order;
    the own entry is the overlap that stays)."""

    send: list[int]
    recv: list[int]


def exchange_splits(old_counts: Sequence[int], new_counts: Sequence[int], rank: int) -> Splits:
    """``all_to_all_single`` split sizes moving a part from ``old_counts`` to ``new_counts``.

    Both are (W,) per-rank element counts of the same part (same sum); rank r holds the
    contiguous range starting at ``sum(counts[:r])``. ``send[d]`` = overlap of this rank's old
    range with rank d's new range, ``recv[s]`` = overlap of rank s's old range with this rank's
    new range; both are contiguous and in rank order within the old / new shard.
    """
    assert sum(old_counts) == sum(new_counts), (old_counts, new_counts)

    def ranges(counts):
        starts = [sum(counts[:r]) for r in range(len(counts))]
        return [(s, s + int(n)) for s, n in zip(starts, counts)]

    old, new = ranges(old_counts), ranges(new_counts)

    def overlap(a, b) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    return Splits([overlap(old[rank], n) for n in new], [overlap(o, new[rank]) for o in old])


def relayout_state(engine: "CephaloEngine", optimizer: torch.optim.Optimizer | None,
                   layout: Sequence[Sequence[int]], *, root_resident: bool | None = None) -> None:
    """Collective: move the engine's shards and the optimizer state onto the shard ``layout``.

    Every rank calls it with the same layout at a step boundary (no unit gathered, no
    collective in flight: after ``optimizer.step()`` / ``zero_grad()``). Per unit, one at a
    time, the parameter shards (trainable and frozen parts), every per-element optimizer state
    tensor and any shard gradient that persists move by ``all_to_all_single`` to the unit's new
    row; see [Note: re-layout in memory]. Shapes: rank r's trainable tensors go from (k_r,) to
    (k'_r,) and its frozen shard from (f_r,) to (f'_r,), the counts of
    ``flat_param.split_unit_row`` for the old and the new row (zeros allowed). Afterwards the
    engine's shards and the optimizer state equal, bit for bit, those of an engine built with
    ``shard_layout=layout`` that loaded a checkpoint saved just before
    (``checkpoint.save_checkpoint`` + ``load_sharded`` + ``load_sharded_optimizer``). A plan's
    layout is ``plan.unit_layout(engine.unit_numels())`` (the runtime's
    ``Session.relayout_state`` checks the plan against the job first). b_i / m_i / l_i are not
    engine state: the caller feeds the new split's microbatches from the next step on.

    Args:
        engine: the ``CephaloEngine``.
        optimizer: a torch optimizer over ``engine.parameters()`` or over the per-parameter
            shards ``engine.param_shards`` (element-wise state and 0-dim scalars, e.g.
            ``torch.optim.AdamW``; any param groups), or None (parameters only).
        layout: per unit (``all_units()`` order: layers, then the embedding and head units) the
            elements each rank holds, rank order; each row sums to the unit's numel.
        root_resident: the root units' gathering from now on (``CephaloEngine``'s
            ``root_resident``); None keeps it.

    Raises (all before any collective, unless noted):
        ValueError: a layout of another shape (units, world size, a row's sum); an optimizer
            holding tensors that are not the engine's; after the one metadata exchange, on every
            rank alike: ranks passed different layouts or hold different optimizer state keys,
            scalars or gradients.
        NotImplementedError: optimizer state that is neither per-element nor 0-dim.
        RuntimeError: called mid-step (a unit gathered, a collective in flight, a gradient being
            accumulated), or an earlier step raised part-way (``check_usable``). If an
            exchange itself fails, the engine refuses further collective calls as after a
            failed step.
    """
    engine.check_usable("relayout_state")
    _check_step_boundary(engine)
    layout = _check_layout(engine, layout)
    holdings = _local_holdings(engine, optimizer)
    resident = engine.root_resident if root_resident is None else bool(root_resident)
    _agree(engine, layout, resident, holdings)  # the first collective
    try:
        for u, (unit, row, held) in enumerate(zip(engine.all_units(), layout, holdings)):
            if row != unit.numel_per_rank:
                _move_unit(engine, optimizer, u, unit, row, held)
    except BaseException as exc:
        engine.abandon_step(None, exc, "relayout_state")
        raise
    engine.root_resident = resident
    engine.root = dataclasses.replace(engine.root, resident=resident)


# ---- checks (local, before any collective) ------------------------------------------------------
def _check_step_boundary(engine: "CephaloEngine") -> None:
    for unit in engine.all_units():
        if not unit.at_rest:
            raise RuntimeError(f"relayout_state called mid-step: {unit.name} is "
                               f"{'gathered' if unit.state is ShardedState.UNSHARDED else 'busy'}"
                               " (a collective in flight or a gradient being accumulated); call "
                               "it at a step boundary, after optimizer.step() and zero_grad(), "
                               "on every rank")


def _check_layout(engine: "CephaloEngine", layout) -> list[list[int]]:
    """``layout`` as int rows, one per unit of ``world_size`` counts summing to the unit's
    numel (ValueError naming the first row that does not)."""
    units = engine.all_units()
    rows = [[int(n) for n in row] for row in layout]
    if len(rows) != len(units):
        raise ValueError(f"relayout_state: the layout has {len(rows)} rows but the engine has "
                         f"{len(units)} units (layers, then the embedding and head units)")
    for unit, row in zip(units, rows):
        if len(row) != engine.world_size or sum(row) != unit.numel or min(row) < 0:
            raise ValueError(f"relayout_state: the row of {unit.name} is {row}: it needs "
                             f"{engine.world_size} counts >= 0 (one per rank) summing to the "
                             f"unit's {unit.numel} elements; a change of world size is an "
                             "elastic restart from a checkpoint")
    return rows


class _UnitHoldings(NamedTuple):
    """What this rank holds for one unit besides its parameter shards: ``state`` (the
    optimizer's state dict of the shard parameter, or None), ``element_keys`` (sorted keys of
    its per-element tensors), ``scalars`` ({key: value} of the rest, JSON-comparable),
    ``has_grad`` (a shard gradient persists)."""

    state: dict | None
    element_keys: list[str]
    scalars: dict[str, Any]
    has_grad: bool


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise NotImplementedError(
                f"optimizer state {where} is a tensor of shape {tuple(value.shape)} that is not "
                "shard-aligned; the re-layout (like sharded checkpoints) moves per-element state "
                "and 0-dim scalars only: use an element-wise optimizer such as "
                "torch.optim.AdamW (--optim adamw_torch)")
        return [str(value.dtype), value.item()]
    return repr(value)


def _local_holdings(engine: "CephaloEngine", optimizer) -> list[_UnitHoldings]:
    params = engine.parameters()
    states = {} if optimizer is None else unit_states(engine, optimizer, "relayout_state")
    out = []
    for u, p in enumerate(params):
        state = states.get(u)
        keys, scalars = [], {}
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == p.shape:
                keys.append(key)
            else:
                scalars[key] = _scalar(value, f"{key!r} of {engine.all_units()[u].name}")
        out.append(_UnitHoldings(state or None, sorted(keys), scalars, p.grad is not None))
    return out


def _agree(engine: "CephaloEngine", layout, resident: bool, holdings) -> None:
    """ONE ``all_gather_object``: every rank raises the same ValueError when the ranks passed
    different layouts or hold different optimizer state / gradients (their exchanges would not
    pair up), before any state moves."""
    digest = hashlib.sha256(json.dumps([layout, resident], sort_keys=True,
                                       default=str).encode()).hexdigest()
    mine = (digest, [(h.state is not None, h.element_keys, h.scalars, h.has_grad)
                     for h in holdings])
    everyone: list = [None] * engine.world_size
    dist.all_gather_object(everyone, mine, group=engine.group)
    if any(d != digest for d, _ in everyone):
        raise ValueError(f"relayout_state: the ranks passed different layouts (digests "
                         f"{[d[:12] for d, _ in everyone]}); every rank must re-lay onto the same "
                         "layout (compute it from exchanged numbers only)")
    names = [u.name for u in engine.all_units()]
    for u, name in enumerate(names):
        views = [held[u] for _, held in everyone]
        if any(v != views[0] for v in views):
            raise ValueError(f"relayout_state: the ranks hold different optimizer state or "
                             f"gradients for {name} ((has state, per-element keys, scalars, has "
                             f"gradient) by rank: {views}); re-lay out at a step boundary where "
                             "every rank stepped the same optimizer")


# ---- the exchange -------------------------------------------------------------------------------
def _move(old: torch.Tensor, old_counts: Sequence[int], new_counts: Sequence[int],
          engine: "CephaloEngine") -> torch.Tensor:
    """This rank's (new_counts[rank],) shard of a part, from every rank's old shard (one
    ``all_to_all_single``; counted in ``stats.relayout_*``)."""
    rank, stats = engine.rank, engine.stats
    splits = exchange_splits(old_counts, new_counts, rank)
    new = old.new_empty(int(new_counts[rank]))
    dist.all_to_all_single(new, old.detach().contiguous(), splits.recv, splits.send,
                           group=engine.group)
    es = old.element_size()
    stats.relayout_count += 1
    stats.relayout_sent_bytes += (sum(splits.send) - splits.send[rank]) * es
    stats.relayout_received_bytes += (sum(splits.recv) - splits.recv[rank]) * es
    return new


def _move_unit(engine: "CephaloEngine", optimizer, index: int, unit: FlatParamUnit,
               row: list[int], held: _UnitHoldings) -> None:
    """Re-lay one unit: move every tensor on its shards, then swap them in together."""
    new_k, new_f = split_unit_row(row, unit.trainable_numel)
    p = unit.shard_param
    param = _move(unit.trainable.local, unit.trainable_per_rank, new_k, engine)
    state = {key: _move(held.state[key], unit.trainable_per_rank, new_k, engine)
             for key in held.element_keys}
    grad = _move(p.grad, unit.trainable_per_rank, new_k, engine) if held.has_grad else None
    frozen = _move(unit.frozen.local, unit.frozen_per_rank, new_f, engine) \
        if unit.frozen.numel else unit.frozen.local
    new_bytes = sum(t.numel() * t.element_size() for t in (param, *state.values(), grad)
                    if t is not None)
    if unit.frozen.numel:
        new_bytes += frozen.numel() * frozen.element_size()
    engine.stats.peak_relayout_buffer_bytes = max(engine.stats.peak_relayout_buffer_bytes,
                                                  new_bytes)
    with torch.no_grad():
        p.grad = None  # the old gradient's shape no longer matches once the data is swapped
        unit.adopt_layout(row, param, frozen)
        p.grad = grad
    if engine.has_param_shards:  # [Note: per-parameter shards]: same objects, new slices
        engine.param_shards.rebind_unit(index)
    if held.state is not None:
        load_unit_states(engine, optimizer, {index: {**held.state, **state}}, "relayout_state")
    if engine.has_param_shards:
        engine.param_shards.bind_grads()
