"""A Hugging Face safetensors checkpoint as a key -> file map, and element-range reads from it.

``resolve_checkpoint`` turns a local folder or a Hub id into a ``CheckpointFiles``: a single
``model.safetensors`` or the shards listed by ``model.safetensors.index.json``, resolved through
the normal Hugging Face cache (``transformers.utils.cached_file``: local folders as they are,
Hub ids from the cache, downloaded only when missing and allowed; ``HF_HUB_OFFLINE=1`` /
``local_files_only=True`` never touch the network).

``read_range`` reads ``[start, stop)`` of one tensor's flattened elements: the rows covering
the range via ``safe_open(...).get_slice`` (never the whole tensor unless the range needs it),
cut to the range and converted to the requested dtype. A reader of a sharded unit calls it
once per parameter that overlaps its shard, so it reads about its own share of the file.

Also the primitives the ``checkpoint`` package (sharded checkpoints) and ``export.py`` (streamed
HF save) share, kept here so imports point one way (checkpoint -> export -> checkpoint_files):
``CheckpointError`` / ``DAMAGED``, ``fsync_file`` and ``errors_on_every_rank``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class CheckpointFiles:
    """A resolved safetensors checkpoint.

    source: what the user gave (folder or Hub id), for messages.
    weight_map: checkpoint key -> absolute file path (every key of every file).
    index_path: the ``model.safetensors.index.json`` it came from, or None for one file.
    key_mapping: the user's key renames (regex -> replacement), as ``from_pretrained``'s
        ``key_mapping``; applied by ``checkpoint_keys.checkpoint_key_map`` before the model's own.
    """

    source: str
    weight_map: dict[str, str]
    index_path: str | None = None
    key_mapping: dict[str, str] | None = None
    _shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> list[str]:
        """The distinct files, sorted."""
        return sorted(set(self.weight_map.values()))

    def where(self) -> str:
        """The index file, or the single file, for error messages."""
        return self.index_path or (self.files[0] if self.files else self.source)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key`` (read from the file header; cached after ``check_files``)."""
        if key not in self._shapes:
            self.check_files([self.weight_map[key]])
        return self._shapes[key]

    def check_files(self, paths: Iterable[str] | None = None) -> None:
        """Open each file's header: every key the map puts there must be in it.

        Raises ValueError naming the file for a missing, truncated or corrupt file (safetensors
        checks that the header covers the whole file) or a key the index assigns to a file that
        lacks it. Reads only headers.
        """
        from safetensors import safe_open

        for path in (self.files if paths is None else sorted(set(paths))):
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint file {path} (listed in {self.where()}) does not "
                                 "exist: download the complete checkpoint")
            try:
                with safe_open(path, framework="pt") as f:
                    keys = set(f.keys())
                    for key in keys:
                        self._shapes[key] = tuple(f.get_slice(key).get_shape())
            except Exception as exc:  # safetensors raises its own error type
                raise ValueError(f"checkpoint file {path} cannot be read as safetensors "
                                 f"({exc}); it may be truncated or corrupt: download it "
                                 "again") from exc
            missing = sorted(k for k, p in self.weight_map.items() if p == path and k not in keys)
            if missing:
                raise ValueError(f"{self.where()} maps {missing[:5]} to {path}, but that file "
                                 "does not contain them: the index and its files disagree; "
                                 "download the complete checkpoint again")


# ---- primitives shared by checkpoint/ and export.py ---------------------------------------
class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt or of another model.

    The message names the file, what is wrong and what to do.
    """


DAMAGED = ("the checkpoint is damaged: copy the directory again, or resume from (or export) an "
           "earlier checkpoint (a Trainer's checkpoint-N, a save_state folder)")
"""The next step of every error about a corrupt or inconsistent checkpoint file."""


def fsync_file(path: str) -> None:
    """fsync ``path`` (a file or a directory); a file already renamed away is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # another rank's temporary file, renamed meanwhile
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def errors_on_every_rank(group: dist.ProcessGroup | None = None,
                         what: str = "load the checkpoint") -> Iterator[None]:
    """Collective: if the body raises on ANY rank, raise on EVERY rank (no rank runs ahead
    into a training collective while another gave up, which would hang).

    One ``all_gather_object`` of the error messages after the body. With one rank the error is
    re-raised as it is. With several, every rank raises CheckpointError with the same message,
    quoting the first failing rank's error (``"rank R could not <what>: <Type>: ..."``; the
    failing rank's own exception is its ``__cause__``), so the launcher shows it once
    ([Note: one error report per job] in hf_cephalo/rank_errors.py). A failing rank whose error
    differs from the first one's raises its own (``"rank <own> could not ..."``): also news.
    """
    error: BaseException | None = None
    try:
        yield
    except (ValueError, NotImplementedError, OSError) as e:  # CheckpointError is a ValueError
        error = e
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, mine, group=group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    rank, message = failed[0]
    if mine is not None and mine != message:
        rank, message = dist.get_rank(group), mine
    raise CheckpointError(f"rank {rank} could not {what}: {message}") from error


def _cached(name_or_path: str, filename: str, kwargs: Mapping) -> str | None:
    from transformers.utils import cached_file

    return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **kwargs)


def resolve_checkpoint(name_or_path: str | os.PathLike, **hub_kwargs) -> CheckpointFiles:
    """Resolve a folder or Hub id to its safetensors files (sharded index first).

    ``hub_kwargs``: ``cached_file`` options (``revision``, ``cache_dir``, ``token``,
    ``local_files_only``, ``subfolder``).
    Raises ValueError when neither ``model.safetensors.index.json`` nor ``model.safetensors``
    can be found (e.g. a ``pytorch_model.bin``-only checkpoint, or offline without a cached
    copy), or an index without a ``weight_map``.
    """
    source = os.fspath(name_or_path)
    index = _cached(source, INDEX_FILE, hub_kwargs)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map': not a safetensors index; download "
                             "the checkpoint again or re-save it with save_pretrained")
        paths = {}
        for filename in sorted(set(weight_map.values())):
            path = _cached(source, filename, hub_kwargs)
            if path is None:
                raise ValueError(f"{index} lists {filename}, which cannot be found in "
                                 f"{source}: download the complete checkpoint")
            paths[filename] = os.path.abspath(path)
        return CheckpointFiles(source, {k: paths[v] for k, v in weight_map.items()},
                               os.path.abspath(index))
    single = _cached(source, SINGLE_FILE, hub_kwargs)
    if single is None:
        raise ValueError(f"{source!r}: neither {INDEX_FILE} nor {SINGLE_FILE} found (locally, "
                         "in the Hugging Face cache, or on the Hub when online); sharded "
                         "loading reads safetensors only: convert the checkpoint by loading "
                         "it with from_pretrained and writing it with save_pretrained (which "
                         "writes safetensors)")
    from safetensors import safe_open

    single = os.path.abspath(single)
    try:
        with safe_open(single, framework="pt") as f:
            keys = list(f.keys())
    except Exception as exc:
        raise ValueError(f"checkpoint file {single} cannot be read as safetensors ({exc}); it "
                         "may be truncated or corrupt: download it again") from exc
    return CheckpointFiles(source, {k: single for k in keys})


def read_range(handle, key: str, shape: tuple[int, ...], start: int, stop: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of tensor ``key`` flattened (row-major), as a 1-D ``dtype``
    tensor of ``stop - start`` elements.

    ``handle``: an open ``safe_open`` file. Reads only the rows of dimension 0 that cover the
    range (a 0-d or 1-d tensor: the range itself), then cuts and converts them.
    """
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(1)[start:stop].to(dtype)
    row_numel = 1
    for d in shape[1:]:
        row_numel *= d
    if row_numel == 0:
        return torch.zeros(0, dtype=dtype)
    first, last = start // row_numel, -(-stop // row_numel)
    rows = handle.get_slice(key)[first:last]
    flat = rows.reshape(-1)[start - first * row_numel:stop - first * row_numel]
    return flat.to(dtype)
