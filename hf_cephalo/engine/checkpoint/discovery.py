"""Finding checkpoints by their completeness marker, and what to do about a damaged one.

``newest_complete_checkpoint`` picks the ``checkpoint-N`` of an output directory to resume
from; ``earlier_complete_checkpoint`` / ``damaged_remedy`` name the checkpoint to fall back to
when one is refused as damaged (the end of every such CheckpointError); ``run_folder_hint``
explains a run's output directory given where a checkpoint was expected. Only file names,
sizes and the marker are read, never the tensors.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from ..checkpoint_files import DAMAGED
from .atomic import is_complete
from .layout import FILES

__all__ = ["NewestCheckpoint", "newest_complete_checkpoint", "earlier_complete_checkpoint",
           "damaged_remedy", "run_folder_hint"]


def run_folder_hint(directory: str) -> str | None:
    """For a run's output_dir given instead of a checkpoint: the ``checkpoint-N`` directories
    it holds, newest first, each without its marker called incomplete, and the newest complete
    one to give instead. None when ``directory`` holds no ``checkpoint-N``."""
    found = []
    for name in os.listdir(directory):
        prefix, _, step = name.partition("-")
        if prefix == "checkpoint" and step.isdigit() and os.path.isdir(os.path.join(directory, name)):
            found.append((int(step), name, is_complete(os.path.join(directory, name))))
    if not found:
        return None
    found.sort(reverse=True)
    listed = ", ".join(name + ("" if complete else " (incomplete)") for _, name, complete in found)
    complete = [name for _, name, ok in found if ok]
    advice = (f"give a checkpoint, e.g. the newest complete one: "
              f"{os.path.join(directory, complete[0])}" if complete else
              "none of them is complete (every save was interrupted)")
    return f"{directory}: a run folder, not a checkpoint; it holds {listed}; {advice}"


class NewestCheckpoint(NamedTuple):
    """``newest_complete_checkpoint``'s answer: ``path`` (the newest complete ``checkpoint-N``,
    None if none is complete) and ``skipped`` (the newer ``checkpoint-N`` directories without the
    completeness marker, newest first; with ``path`` None: every ``checkpoint-N`` found)."""

    path: str | None
    skipped: list[str]


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-<step>


def newest_complete_checkpoint(output_dir: str) -> NewestCheckpoint:
    """The ``checkpoint-N`` with the largest N in ``output_dir`` that carries the completeness
    marker (``is_complete``), and the newer ones passed over (e.g. copied without the marker,
    or published by a release that did not write one). Staging ``.tmp-checkpoint-N``
    directories never match. A missing ``output_dir`` gives ``NewestCheckpoint(None, [])``."""
    if not os.path.isdir(output_dir):
        return NewestCheckpoint(None, [])
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := _CHECKPOINT_RE.match(name))
                    and os.path.isdir(os.path.join(output_dir, name))), reverse=True)
    skipped = []
    for _, name in found:
        path = os.path.join(output_dir, name)
        if is_complete(path):
            return NewestCheckpoint(path, skipped)
        skipped.append(path)
    return NewestCheckpoint(None, skipped)


def _sizes_match_marker(directory: str) -> bool:
    """Whether every file ``directory``'s completeness marker lists is there at its recorded
    size (a stat per file; CRC-32s are checked when the files are read)."""
    try:
        with open(os.path.join(directory, FILES.COMPLETE)) as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(directory, name)) == record["size_bytes"]
                   for name, record in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # unreadable marker, a listed file gone: not a checkpoint to point to


def earlier_complete_checkpoint(directory: str) -> str | None:
    """For a ``checkpoint-N`` refused as damaged: the newest ``checkpoint-M`` beside it (same
    parent, M < N) that carries the completeness marker and whose files are all at the sizes
    the marker recorded; None when there is none, or ``directory`` is not named
    ``checkpoint-N`` (transformers' ``PREFIX_CHECKPOINT_DIR``)."""
    parent, name = os.path.split(os.path.normpath(directory))
    match = _CHECKPOINT_RE.match(name)
    if match is None or not os.path.isdir(parent or "."):
        return None
    earlier = sorted(((int(m.group(1)), entry) for entry in os.listdir(parent or ".")
                      if (m := _CHECKPOINT_RE.match(entry))
                      and int(m.group(1)) < int(match.group(1))), reverse=True)
    for _, entry in earlier:
        path = os.path.join(parent, entry)
        if os.path.isdir(path) and is_complete(path) and _sizes_match_marker(path):
            return path
    return None


def damaged_remedy(directory: str) -> str:
    """What to do about a damaged checkpoint ``directory`` (the end of every CheckpointError
    about a corrupt or missing file in it): copy it again, or resume from the newest complete
    checkpoint before it, named with the flag that takes it (``earlier_complete_checkpoint``).
    ``DAMAGED`` itself when ``directory`` is not a ``checkpoint-N``."""
    directory = os.path.normpath(directory)
    if _CHECKPOINT_RE.match(os.path.basename(directory)) is None:
        return DAMAGED
    earlier = earlier_complete_checkpoint(directory)
    if earlier is None:
        return (f"the checkpoint is damaged: copy the directory again ({os.path.dirname(directory)} "
                "holds no complete checkpoint-N before it)")
    return (f"the checkpoint is damaged: copy the directory again, or resume from the newest "
            f"complete checkpoint before it, {earlier}: --resume_from_checkpoint {earlier} (in "
            f"Python train(resume_from_checkpoint={earlier!r}); `hf-cephalo export {earlier}` "
            "exports it)")
