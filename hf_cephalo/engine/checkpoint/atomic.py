"""Publishing a checkpoint directory atomically, with its completeness marker.

[Note: atomic checkpoints] ``atomic_checkpoint_dir`` writes everything into a hidden sibling
``.tmp-<name>``, fsyncs, writes the completeness marker, then renames the directory into place.
A run killed at any moment leaves either no ``<name>`` at all or a complete one;
``newest_complete_checkpoint`` (and transformers' ``get_last_checkpoint``: regex
``^checkpoint-\\d+$``) never sees the staging directory, and ``load_sharded`` refuses a
directory without the marker.

``record_file`` notes the size and CRC-32 of each file a rank writes into the staging
directory, for the marker (``cephalo_complete.json``); ``is_complete`` tests for the marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from typing import Callable, Iterator

import torch.distributed as dist

from hf_cephalo.file_modes import apply_default_mode

from ..checkpoint_files import errors_on_every_rank
from ..checkpoint_files import fsync_file as _fsync_file
from .layout import FILES, FORMAT

__all__ = ["staging_path", "atomic_checkpoint_dir", "file_crc32", "record_file", "is_complete"]


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(group) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(os.path.join(dirpath, name))
        _fsync_file(dirpath)


def staging_path(path: str) -> str:
    """The hidden sibling ``.tmp-<name>`` a checkpoint ``path`` is written into first."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")


@contextlib.contextmanager
def atomic_checkpoint_dir(path: str, group: dist.ProcessGroup | None = None, *,
                          check: Callable[[str], None] | None = None) -> Iterator[str]:
    """Collective (every rank): yield a staging directory; on exit publish it as ``path``.

    See [Note: atomic checkpoints]. On exit: every rank fsyncs what is there, the ranks exchange
    the sizes and CRC-32 of the shard files they wrote (``save_sharded``; one
    ``all_gather_object``, which is also the barrier), rank 0 runs ``check(staging)`` (raises
    ValueError when the directory lacks what it must hold), writes ``cephalo_complete.json``,
    renames the staging directory to ``path`` (replacing an existing one) and fsyncs the
    parent; one more ``all_gather_object`` (the barrier) tells every rank whether rank 0
    succeeded. If the body raises, nothing is published (the staging directory stays until the
    next save of the same path removes it).

    Raises:
        CheckpointError: on every rank when ``check`` (or publishing) failed on rank 0; the
            checkpoint is then not marked complete and not published.
    """
    final, staging = os.path.abspath(path), staging_path(path)
    rank = _rank(group)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
        os.makedirs(staging)
    _barrier(group)
    _RECORDS[staging] = {}
    try:
        yield staging
    finally:
        records = _RECORDS.pop(staging)
    _fsync_tree(staging)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list[dict | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, records, group=group)  # also the barrier after writing
        records = {k: v for r in everyone for k, v in (r or {}).items()}
    with errors_on_every_rank(group, what=f"publish the checkpoint {final}"):
        if rank == 0:
            if check is not None:
                check(staging)  # never mark complete what lacks a promised file
            _write_marker(staging, records)
            old = os.path.join(os.path.dirname(final), f".old-{os.path.basename(final)}")
            if os.path.exists(final):
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(staging, final)
            _fsync_file(os.path.dirname(final))
            shutil.rmtree(old, ignore_errors=True)


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# staging directory -> {file name: {"size_bytes", "crc32"}} of the files this rank wrote there
_RECORDS: dict[str, dict[str, dict[str, int]]] = {}


def record_file(path: str) -> None:
    """Remember the size and CRC-32 of a file just written (read back from the page cache by
    the rank that wrote it, so no rank reads the whole checkpoint) for the marker."""
    directory = os.path.abspath(os.path.dirname(path))
    if directory in _RECORDS:
        _RECORDS[directory][os.path.basename(path)] = {"size_bytes": os.path.getsize(path),
                                                       "crc32": file_crc32(path)}


def _write_marker(directory: str, records: dict[str, dict[str, int]]) -> None:
    files = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            files[name] = records.get(name, {"size_bytes": os.path.getsize(full)})
    tmp = os.path.join(directory, FILES.COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    apply_default_mode(tmp)  # [Note: file modes]
    os.rename(tmp, os.path.join(directory, FILES.COMPLETE))


def is_complete(directory: str) -> bool:
    """True if ``directory`` carries the completeness marker (written last by a save)."""
    return os.path.isfile(os.path.join(directory, FILES.COMPLETE))
