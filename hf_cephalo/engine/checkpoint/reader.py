"""Reading a sharded checkpoint: its layout, and verified element ranges of its tensors.

``read_layout`` checks the completeness marker and parses ``cephalo_layout.json``;
``ShardReader`` opens shard files on demand, checking each against the marker (size, CRC-32)
and its header, and reads element ranges of a unit's flat buffer across the old ranks' files.

Re-layout: a unit's flat buffer is the same on every plan (same parameter order), only the
per-rank cut points differ, so each rank of the new plan copies the overlap of its new range
with every old rank's range (``safetensors`` reads just those slices). Optimizer state tensors
are cut the same way over the trainable prefix. Loading needs no process group (every rank
reads the files it overlaps; the directory must be visible to every rank).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint_files import CheckpointError
from .atomic import file_crc32
from .discovery import damaged_remedy, run_folder_hint
from .layout import FILES, FORMAT, READABLE_FORMATS, CheckpointLayout

__all__ = ["read_layout", "ShardReader", "read_parts", "read_buffers", "unit_views"]


def _read_json(path: str, what: str, formats: tuple[str, ...] = READABLE_FORMATS) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); {damaged_remedy(os.path.dirname(path))}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({what}): {e}; "
                              f"{damaged_remedy(os.path.dirname(path))}") from None
    if not isinstance(data, dict) or data.get("format") not in formats:
        raise CheckpointError(f"{path}: not a {FORMAT} file (format "
                              f"{data.get('format') if isinstance(data, dict) else None!r}); "
                              f"this release reads {', '.join(formats)}: a checkpoint of a newer "
                              "hf_cephalo needs that release (upgrade)")
    return data


def read_layout(directory: str) -> CheckpointLayout:
    """Check the completeness marker and parse the layout of a checkpoint directory.

    Raises CheckpointError: the directory or marker is missing (a save that did not finish),
    or the layout file is missing / corrupt.
    """
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory; give the path of a "
                              "checkpoint-N directory written by CephaloTrainer (or "
                              "save_checkpoint)")
    marker = os.path.join(directory, FILES.COMPLETE)
    if not os.path.isfile(marker) and not os.path.isfile(os.path.join(directory, FILES.LAYOUT)):
        hint = run_folder_hint(directory)
        if hint:  # a run's output_dir given instead of one of its checkpoints
            raise CheckpointError(hint)
        raise CheckpointError(f"{directory}: not a Cephalo sharded checkpoint (no {FILES.LAYOUT}, "
                              f"no {FILES.COMPLETE}); to start from a plain model directory, "
                              "load it with from_pretrained and train without resuming")
    if not os.path.isfile(marker):
        raise CheckpointError(f"{marker}: missing — {directory} is an incomplete checkpoint (its "
                              "save did not finish, e.g. the run was killed); resume from an "
                              "earlier checkpoint")
    _read_json(marker, "completeness marker")
    model_files = [n for n in ("model.safetensors", "model.safetensors.index.json",
                               "adapter_model.safetensors")
                   if os.path.isfile(os.path.join(directory, n))]
    if model_files and not os.path.isfile(os.path.join(directory, FILES.LAYOUT)):
        raise CheckpointError(f"{directory}: no sharded state ({FILES.LAYOUT}): a checkpoint saved "
                              f"with save_only_model=True holds the model as {model_files[0]} "
                              "already; load it with from_pretrained (a LoRA adapter: "
                              "PeftModel.from_pretrained), or resume from it with CephaloTrainer")
    data = _read_json(os.path.join(directory, FILES.LAYOUT), "shard layout")
    try:
        return CheckpointLayout(directory, int(data["world_size"]), list(data["units"]),
                                list(data["buffers"]), dict(data["fingerprint"]),
                                data.get("config"), data["format"])
    except (KeyError, TypeError, ValueError) as e:
        path = os.path.join(directory, FILES.LAYOUT)
        raise CheckpointError(f"{path}: corrupt layout ({e}); {damaged_remedy(directory)}") \
            from None


class ShardReader:
    """Opens shard files on demand, verifying size / CRC-32 against the marker and the header."""

    def __init__(self, layout: CheckpointLayout, verify: bool = True):
        self.layout, self.verify = layout, verify
        marker = _read_json(os.path.join(layout.directory, FILES.COMPLETE), "completeness marker")
        self.expected = marker.get("files", {})
        self._open: dict[str, Any] = {}
        self.meta: dict[int, dict] = {}

    def remedy(self) -> str:
        """The end of an error about a damaged file of this checkpoint (``damaged_remedy``)."""
        return damaged_remedy(self.layout.directory)

    def open(self, name: str):
        if name in self._open:
            return self._open[name]
        path = os.path.join(self.layout.directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (a shard of a {self.layout.world_size}-rank "
                                  "checkpoint; copy every cephalo_* file of the checkpoint)")
        want = self.expected.get(name)
        if want is None:
            raise CheckpointError(f"{path}: not listed in {FILES.COMPLETE} (a file from "
                                  f"another save?); {self.remedy()}")
        size = os.path.getsize(path)
        if size != want["size_bytes"]:
            raise CheckpointError(f"{path}: corrupt — {size} bytes, the checkpoint recorded "
                                  f"{want['size_bytes']} (truncated or overwritten); "
                                  f"{self.remedy()}")
        if self.verify and "crc32" in want and file_crc32(path) != want["crc32"]:
            raise CheckpointError(f"{path}: corrupt — CRC-32 does not match the one recorded "
                                  f"at save; {self.remedy()}")
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors file ({e}); "
                                  f"{self.remedy()}") from None
        self._open[name] = handle
        return handle

    def shard_meta(self, rank: int) -> dict:
        if rank not in self.meta:
            name = FILES.shard(rank)
            path = os.path.join(self.layout.directory, name)
            try:
                meta = json.loads((self.open(name).metadata() or {})["cephalo"])
            except (KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt shard metadata ({e}); "
                                      f"{self.remedy()}") from None
            if meta.get("fingerprint") != self.layout.fingerprint or meta.get("rank") != rank:
                raise CheckpointError(
                    f"{path}: shard of another checkpoint (model {meta.get('fingerprint')}, rank "
                    f"{meta.get('rank')}), expected rank {rank} of {self.layout.fingerprint}; "
                    f"{self.remedy()}")
            self.meta[rank] = meta
        return self.meta[rank]

    def read_range(self, unit: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of unit ``unit``'s flat index ``[trainable | frozen]``
        (``key`` "param": parameters; "optim.<name>": optimizer state, trainable elements
        only), concatenated over the old ranks' files; [start, stop) lies in one part, and the
        result has the dtype that part was saved in."""
        pieces = []
        for r, lo_r, hi_r, tensor_key in _saved_segments(self.layout.units[unit], unit, key):
            lo, hi = max(start, lo_r), min(stop, hi_r)
            if lo >= hi:
                continue
            name = FILES.shard(r)
            self.shard_meta(r)
            handle = self.open(name)
            if tensor_key not in handle.keys():
                raise CheckpointError(f"{os.path.join(self.layout.directory, name)}: no tensor "
                                      f"{tensor_key!r} (corrupt or written without an "
                                      f"optimizer); {self.remedy()}")
            sl = handle.get_slice(tensor_key)
            if sl.get_shape() != [hi_r - lo_r]:
                raise CheckpointError(f"{os.path.join(self.layout.directory, name)}: tensor "
                                      f"{tensor_key!r} has shape {sl.get_shape()}, the layout says "
                                      f"[{hi_r - lo_r}]; {self.remedy()}")
            pieces.append(sl[lo - lo_r:hi - lo_r])
        got = sum(p.numel() for p in pieces)
        assert got == stop - start, f"re-layout read {got} of {stop - start} elements"
        return torch.cat(pieces) if pieces else torch.zeros(0)


def _saved_segments(info: dict[str, Any], u: int, key: str) -> list[tuple[int, int, int, str]]:
    """(old rank, lo, hi, tensor key): the flat-index ranges [lo, hi) of unit ``u`` each old
    rank saved under ``key`` ("param" or "optim.<name>"), empty ones left out."""
    nt = int(info["trainable_numel"])
    if "trainable_per_rank" not in info:  # older prefix layout: contiguous [trainable | frozen]
        out, begin = [], 0
        for r, n in enumerate(info["numel_per_rank"]):
            stop = begin + n if key == "param" else max(begin, min(begin + n, nt))
            out.append((r, begin, stop, f"units.{u}.{key}"))
            begin += n
        return [(r, lo, hi, k) for r, lo, hi, k in out if hi > lo]
    counts = [int(k) for k in info["trainable_per_rank"]]
    frozen = [int(n) - k for n, k in zip(info["numel_per_rank"], counts)]
    out = [(r, sum(counts[:r]), sum(counts[:r + 1]), f"units.{u}.{key}")
           for r in range(len(counts))]
    if key == "param":
        out += [(r, nt + sum(frozen[:r]), nt + sum(frozen[:r + 1]), f"units.{u}.frozen")
                for r in range(len(frozen))]
    return [(r, lo, hi, k) for r, lo, hi, k in out if hi > lo]


def read_parts(reader: "ShardReader", u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit ``u``'s full parts ``(trainable (Nt,), frozen (N - Nt,))`` from the shard files."""
    info = reader.layout.units[u]
    nt, n = int(info["trainable_numel"]), int(info["numel"])
    return reader.read_range(u, "param", 0, nt), reader.read_range(u, "param", nt, n)


def read_buffers(layout: CheckpointLayout, reader: ShardReader) -> dict[str, torch.Tensor]:
    handle = reader.open(FILES.BUFFERS)
    missing = [k for k in layout.buffers if k not in handle.keys()]
    if missing:
        raise CheckpointError(f"{os.path.join(layout.directory, FILES.BUFFERS)}: missing buffers "
                              f"{missing}; {damaged_remedy(layout.directory)}")
    return {k: handle.get_tensor(k) for k in layout.buffers}


def unit_views(info: dict[str, Any], parts) -> dict[str, torch.Tensor]:
    """Every alias -> a view of the unit's full parts ``(trainable, frozen)``."""
    out: dict[str, torch.Tensor] = {}
    nt = int(info["trainable_numel"])
    for p in info["params"]:
        flat, lo = (parts[0], p["offset"]) if p["requires_grad"] else (parts[1], p["offset"] - nt)
        view = flat[lo:lo + p["numel"]].view(p["shape"])
        out.update((alias, view) for alias in p["aliases"])
    return out
