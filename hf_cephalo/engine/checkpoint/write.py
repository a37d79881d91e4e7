"""Writing a sharded checkpoint: each rank's shard file, rank 0's layout and buffers.

``save_sharded`` writes this rank's slice of every unit (and its optimizer state: per-element
tensors with the shard's shape, scalars and param groups as JSON) into a directory;
``save_checkpoint`` wraps it in ``atomic_checkpoint_dir`` (``atomic.py``). ``from_json``
decodes the optimizer values ``save_sharded`` encodes, for ``load.py``. The files are those
``layout.py`` describes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from hf_cephalo.file_modes import apply_default_mode

from ..param_shards import unit_states
from .atomic import atomic_checkpoint_dir, record_file
from .layout import FILES, FORMAT, buffer_keys, model_fingerprint

__all__ = ["save_sharded", "save_checkpoint", "from_json"]


def _units_description(engine) -> list[dict[str, Any]]:
    out = []
    for meta, unit in zip(engine.shard_metadata(), engine.all_units()):
        out.append(dict(name=meta.name, numel=int(meta.numel),
                        trainable_numel=int(meta.trainable_numel),
                        numel_per_rank=[int(n) for n in meta.numel_per_rank],
                        trainable_per_rank=[int(n) for n in unit.trainable_per_rank],
                        dtypes=[str(unit.dtype).removeprefix("torch."),
                                str(unit.frozen_dtype).removeprefix("torch.")],
                        params=[dict(fqn=p.fqn, aliases=list(p.aliases), shape=list(p.shape),
                                     offset=int(p.offset), numel=int(p.numel),
                                     requires_grad=bool(p.requires_grad)) for p in meta.params]))
    return out


def _optimizer_state_by_unit(engine, optimizer) -> tuple[dict, list[dict]]:
    """{unit index: optimizer state of its trainable shard}, param groups (no params); the
    optimizer may hold the flat shards or the per-parameter shards (``param_shards.py``)."""
    by_unit = unit_states(engine, optimizer, "save_sharded")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return by_unit, groups


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise NotImplementedError(f"optimizer state {where} is a tensor of shape "
                                      f"{tuple(value.shape)} that is not shard-aligned; sharded "
                                      "checkpoints support per-element state and scalars only: "
                                      "use an element-wise optimizer such as torch.optim.AdamW "
                                      "(--optim adamw_torch)")
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list":
                [_json_value(v, where) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotImplementedError(f"optimizer state {where} = {value!r} cannot be saved as JSON; "
                              "use an element-wise optimizer such as torch.optim.AdamW "
                              "(--optim adamw_torch)")


def from_json(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict) and "tuple" in value:
        return tuple(from_json(v) for v in value["tuple"])
    if isinstance(value, dict) and "list" in value:
        return [from_json(v) for v in value["list"]]
    return value


def save_sharded(engine, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write this rank's shard (and on rank 0 the layout and buffers) into ``directory``.

    Every rank calls it (no collective; ``directory`` must exist). Not atomic by itself: wrap
    it in ``atomic_checkpoint_dir`` (``save_checkpoint`` does both).

    Args:
        engine: the ``CephaloEngine`` (parameters SHARDED, i.e. outside ``train_step``).
        optimizer: built over ``engine.parameters()``; per-element state tensors (shape of the
            shard) and 0-dim state are saved, e.g. AdamW's exp_avg, exp_avg_sq, step.
    Raises:
        ValueError: the optimizer holds parameters that are not the engine's.
        NotImplementedError: optimizer state that is neither per-element nor 0-dim.
    """
    rank, fingerprint = engine.rank, model_fingerprint(engine)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict] = []
    for u, unit in enumerate(engine.all_units()):
        tensors[f"units.{u}.param"] = unit.trainable.local.detach().to("cpu", copy=True)
        if unit.frozen.numel:  # the frozen shard in its own dtype
            tensors[f"units.{u}.frozen"] = unit.frozen.local.detach().to("cpu", copy=True)
    if optimizer is not None:
        by_unit, raw_groups = _optimizer_state_by_unit(engine, optimizer)
        groups = [{k: _json_value(v, f"param_groups.{k}") for k, v in g.items()}
                  for g in raw_groups]
        params = engine.parameters()
        for u, state in by_unit.items():
            scalars[str(u)] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and \
                        value.shape == params[u].shape:
                    tensors[f"units.{u}.optim.{key}"] = value.detach().to("cpu", copy=True)
                else:
                    scalars[str(u)][key] = _json_value(value, f"{key} of unit {u}")
    meta = {"format": FORMAT, "rank": rank, "world_size": engine.world_size,
            "fingerprint": fingerprint, "has_optimizer": optimizer is not None,
            "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_scalars": scalars, "param_groups": groups}
    path = os.path.join(directory, FILES.shard(rank))
    save_file(tensors, path, metadata={"cephalo": json.dumps(meta)})
    apply_default_mode(path)  # safetensors writes 0o600: [Note: file modes]
    record_file(path)
    if rank == 0:
        _save_rank0_files(engine, directory, fingerprint)


def _save_rank0_files(engine, directory: str, fingerprint: dict[str, str]) -> None:
    model = engine.staged.model
    keys = buffer_keys(engine)
    buffers = {k: model.get_buffer(k).detach().to("cpu", copy=True).contiguous() for k in keys}
    save_file(buffers, os.path.join(directory, FILES.BUFFERS), metadata={"format": FORMAT})
    apply_default_mode(os.path.join(directory, FILES.BUFFERS))  # [Note: file modes]
    record_file(os.path.join(directory, FILES.BUFFERS))
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else None
    if config_dict is not None:
        # the class that trained, as save_pretrained records it: a config loaded from a
        # pretrained checkpoint still names that checkpoint's class (e.g. BertModel for a
        # BertForSequenceClassification fine-tuned from it), and export builds this class
        config_dict["architectures"] = [type(model).__name__]
    layout = {"format": FORMAT, "world_size": engine.world_size, "fingerprint": fingerprint,
              "units": _units_description(engine), "buffers": keys, "config": config_dict}
    with open(os.path.join(directory, FILES.LAYOUT), "w") as f:
        json.dump(layout, f, indent=1, default=str)


def save_checkpoint(engine, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Collective: ``save_sharded`` into ``path`` atomically (see [Note: atomic checkpoints] in
    ``atomic.py``).

    Raises RuntimeError (before any collective) when an earlier step raised part-way
    (``CephaloEngine.check_usable``)."""
    engine.check_usable("save_checkpoint")
    with atomic_checkpoint_dir(path, engine.group) as staging:
        save_sharded(engine, staging, optimizer)
