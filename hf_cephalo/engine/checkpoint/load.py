"""Loading a sharded checkpoint into a ``CephaloEngine``: parameters, buffers, optimizer state.

Any plan and world size: each rank reads the slices of the old ranks' files that its new shard
overlaps (``reader.py``, re-layout). ``load_sharded`` / ``load_sharded_optimizer`` need no
process group; ``load_checkpoint`` runs both with errors raised on every rank. A checkpoint of
another model (fingerprint) or of the older one-root-unit format is refused before anything
is copied into the engine.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..checkpoint_files import CheckpointError, errors_on_every_rank
from ..param_shards import split_unit_states
from .layout import FILES, FORMAT, CheckpointLayout, model_fingerprint
from .reader import ShardReader, read_buffers, read_layout
from .write import from_json

__all__ = ["load_checkpoint", "load_sharded", "load_sharded_optimizer"]


def _check_model(layout: CheckpointLayout, engine) -> None:
    if layout.format != FORMAT:
        raise CheckpointError(
            f"{os.path.join(layout.directory, FILES.LAYOUT)}: format {layout.format} keeps the "
            f"root (embeddings + head) as one unit; this engine ({FORMAT}) has separate "
            "embedding and head units, so it cannot resume from it. Export the model "
            "(hf-cephalo export, or hf_cephalo.engine.checkpoint.export_hf, which read this "
            "format) and start from the exported folder (optimizer state starts fresh), or "
            "resume with the hf_cephalo release that wrote it")
    mine = model_fingerprint(engine)
    if mine != layout.fingerprint:
        raise CheckpointError(
            f"{os.path.join(layout.directory, FILES.LAYOUT)}: checkpoint of another model "
            f"({layout.fingerprint['model_class']}, parameter hash "
            f"{layout.fingerprint['sha256'][:12]}) than the engine's "
            f"({mine['model_class']}, {mine['sha256'][:12]}): parameter names, shapes, dtype or "
            "unit split differ; resume with the model it was saved from (same class, config, "
            "dtype and LoRA setup), or start a new output_dir")


def load_checkpoint(engine, directory: str, optimizer: torch.optim.Optimizer | None = None, *,
                    verify: bool = True) -> None:
    """Collective: ``load_sharded`` (+ ``load_sharded_optimizer``) with errors raised on every
    rank (``errors_on_every_rank``). Raises CheckpointError as those functions, RuntimeError
    (before any collective) when an earlier step raised part-way."""
    engine.check_usable("load_checkpoint")
    with errors_on_every_rank(engine.group):
        load_sharded(engine, directory, verify=verify)
        if optimizer is not None:
            load_sharded_optimizer(engine, optimizer, directory, verify=verify)


def _flat_units(engine) -> list:
    return engine.all_units()


def load_sharded(engine, directory: str, *, verify: bool = True) -> None:
    """Load the parameters and buffers of a checkpoint into ``engine`` (any plan / world size).

    Every rank calls it (no collective); each reads the slices its new shard overlaps.

    Raises:
        CheckpointError: incomplete checkpoint (no marker), missing / truncated / corrupt file
            (size or CRC-32 mismatch, bad header), or a checkpoint of another model — the
            message names the file. Raised before anything is copied into the engine.
    """
    layout = read_layout(directory)
    _check_model(layout, engine)
    reader = ShardReader(layout, verify)
    new_locals = []  # (this rank's shard tensor, its values), per non-empty part
    for u, unit in enumerate(_flat_units(engine)):
        new_locals += [(local, reader.read_range(u, "param", lo, hi))
                       for lo, hi, local in unit.local_segments()]
    buffers = read_buffers(layout, reader)
    with torch.no_grad():
        for local, values in new_locals:
            local.copy_(values.to(local.dtype))
        for key, value in buffers.items():
            engine.staged.model.get_buffer(key).copy_(value)


def load_sharded_optimizer(engine, optimizer: torch.optim.Optimizer, directory: str, *,
                           verify: bool = True) -> None:
    """Load optimizer state (re-laid for this plan) and param-group values into ``optimizer``.

    ``optimizer`` must be built over ``engine.parameters()`` with the same class as the saved
    one. Scalars such as AdamW's ``step`` must agree over the old ranks of a unit.

    Raises:
        CheckpointError: as ``load_sharded``; the checkpoint has no optimizer state or that of
            another optimizer class; old ranks disagree on a unit's scalar state.
        ValueError: a different number of param groups.
    """
    layout = read_layout(directory)
    _check_model(layout, engine)
    reader = ShardReader(layout, verify)
    metas = [reader.shard_meta(r) for r in range(layout.world_size)]
    path0 = os.path.join(directory, FILES.shard(0))
    if not metas[0]["has_optimizer"]:
        raise CheckpointError(f"{path0}: the checkpoint was saved without optimizer state, "
                              "so training cannot resume from it; export its "
                              "weights (hf-cephalo export) and start from them, or resume from a "
                              "checkpoint saved with the optimizer")
    if metas[0].get("optimizer_class") != type(optimizer).__name__:
        raise CheckpointError(f"{path0}: optimizer state of {metas[0].get('optimizer_class')}, "
                              f"but the optimizer is {type(optimizer).__name__}; resume with the "
                              "same optimizer")
    state_dict = optimizer.state_dict()
    saved_groups = [{k: from_json(v) for k, v in g.items()} for g in metas[0]["param_groups"]]
    if len(saved_groups) != len(state_dict["param_groups"]):
        raise ValueError(f"{path0}: the checkpoint's optimizer has {len(saved_groups)} param "
                         f"groups, this one {len(state_dict['param_groups'])}; build the optimizer "
                         "with the saved run's parameter groups")
    states = {}
    for u, unit in enumerate(_flat_units(engine)):
        state = _unit_optimizer_state(reader, metas, u, unit)
        if state is not None:
            states[u] = state
    for group, saved in zip(state_dict["param_groups"], saved_groups):
        for key, value in saved.items():
            if key in group:
                group[key] = value
    index_of = {id(p): i for i, p in
                enumerate(p for group in optimizer.param_groups for p in group["params"])}
    # load_state_dict casts each state to its parameter's device (and floating dtype) as usual
    state_dict["state"] = {index_of[id(p)]: state for p, state in
                           split_unit_states(engine, optimizer, states, "load_sharded_optimizer")}
    optimizer.load_state_dict(state_dict)


def _unit_optimizer_state(reader: ShardReader, metas: list[dict], u: int, unit) -> dict | None:
    """The optimizer state of this rank's new shard of unit ``u`` (None if never stepped)."""
    info = reader.layout.units[u]
    holders = [r for r, m in enumerate(metas) if str(u) in m["optimizer_scalars"]]
    if not holders:
        return None
    scalars: dict[str, Any] = {}
    for r in holders:
        for key, value in metas[r]["optimizer_scalars"][str(u)].items():
            if key in scalars and scalars[key] != value:
                raise CheckpointError(
                    f"{os.path.join(reader.layout.directory, FILES.shard(r))}: optimizer state "
                    f"{key!r} of unit {info['name']} is {value}, rank {holders[0]} has "
                    f"{scalars[key]} (shards of different steps?); {reader.remedy()}")
            scalars[key] = value
    handle = reader.open(FILES.shard(holders[0]))
    prefix = f"units.{u}.optim."
    keys = [k[len(prefix):] for k in handle.keys() if k.startswith(prefix)]
    state = {k: from_json(v) for k, v in scalars.items()}
    lo, hi = unit.trainable.flat_range(unit.rank)
    for key in keys:
        state[key] = reader.read_range(u, f"optim.{key}", lo, hi)
    return state
