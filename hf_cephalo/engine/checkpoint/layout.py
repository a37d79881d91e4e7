"""The on-disk format of a sharded checkpoint: file names, the parsed layout, the model fingerprint.

A checkpoint directory holds (``FILES`` names them):

* ``cephalo_layout.json`` (rank 0): format version, model fingerprint, world size and, per unit
  (layers in order, then the embedding unit and the head unit), its numel, trainable numel, per-rank numel and every
  parameter's fqn / aliases / shape / flat offset; the model buffers' keys; the model config.
* ``cephalo_shard_rank<R>.safetensors`` (rank R): ``units.<u>.param`` — (n_R,) this rank's slice
  of unit u's flat buffer; ``units.<u>.optim.<key>`` — (t_R,) every optimizer state tensor with
  the shard's shape (AdamW: ``exp_avg``, ``exp_avg_sq``), t_R = the trainable part of the
  slice. Its safetensors metadata (JSON) carries the rank, the fingerprint, 0-dim optimizer
  state (AdamW ``step``) per unit and the optimizer's param groups (lr, betas, ...); a 0-dim
  state the unit's parameters disagree on (one the optimizer skipped) is a tensor
  ``units.<u>.optim.<key>@per_element`` instead.
* ``cephalo_buffers.safetensors`` (rank 0): the model's persistent buffers.
* ``cephalo_complete.json`` (rank 0, written LAST): size and CRC-32 of each shard file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMAT", "READABLE_FORMATS", "FILES", "CheckpointLayout", "buffer_keys",
           "model_fingerprint"]


FORMAT = "hf_cephalo.sharded/2"
# /1: the root was ONE unit ("root", after the layers); /2 splits it into "embed" and "head".
# Offline merging (read_full_state_dict, export_hf) reads both: it goes by parameter offsets.
# Resuming (load_sharded*) needs the engine's units: a /1 checkpoint gets a CheckpointError
# saying to export it and start from the exported model (see docs/checkpoints.md).
READABLE_FORMATS = (FORMAT, "hf_cephalo.sharded/1")


class FILES:
    """File names inside a checkpoint directory."""

    LAYOUT = "cephalo_layout.json"
    BUFFERS = "cephalo_buffers.safetensors"
    COMPLETE = "cephalo_complete.json"

    @staticmethod
    def shard(rank: int) -> str:
        return f"cephalo_shard_rank{rank}.safetensors"


@dataclass(frozen=True)
class CheckpointLayout:
    """Parsed ``cephalo_layout.json``.

    world_size: ranks that wrote the checkpoint; units: per unit (engine order: layers, then
    the embedding and head units; format /1: layers, then one root unit) a dict with
    ``name``, ``numel``, ``trainable_numel``, ``numel_per_rank`` (list of ints),
    ``trainable_per_rank`` (each rank's trainable shard, [Note: two parts per unit] in
    ``flat_param.py``; absent in checkpoints of the older prefix layout, whose ranks held
    contiguous ranges of ``[trainable | frozen]``), ``dtypes`` ([trainable, frozen] storage
    dtype names; absent: one dtype) and ``params`` (fqn, aliases, shape, offset, numel,
    requires_grad); buffers: buffer keys; fingerprint:
    ``model_fingerprint`` of the saved model; config: the model config dict (or None).
    """

    directory: str
    world_size: int
    units: list[dict[str, Any]]
    buffers: list[str]
    fingerprint: dict[str, str]
    config: dict[str, Any] | None
    format: str = FORMAT


# ---- model identity ---------------------------------------------------------------------------
def buffer_keys(engine) -> list[str]:
    param_keys = {a for u in engine.shard_metadata() for p in u.params for a in p.aliases}
    return [k for k in engine.staged.model.state_dict(keep_vars=True) if k not in param_keys]


def model_fingerprint(engine) -> dict[str, str]:
    """{"model_class", "sha256"}: the class name and a hash of every parameter's unit, fqn,
    aliases, shape and dtype, and the buffer keys — the same for every plan and world size."""
    h = hashlib.sha256()
    for unit in engine.shard_metadata():
        for p in unit.params:
            h.update(f"{unit.name}|{p.fqn}|{','.join(p.aliases)}|{tuple(p.shape)}|"
                     f"{p.requires_grad}\n".encode())
    h.update(f"dtype {engine.dtype}\n".encode())
    for key in buffer_keys(engine):
        h.update(f"buffer {key}\n".encode())
    return {"model_class": type(engine.staged.model).__name__, "sha256": h.hexdigest()}
