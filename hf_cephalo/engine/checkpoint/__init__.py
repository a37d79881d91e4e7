"""Sharded checkpoints of a ``CephaloEngine``: save per rank, load onto any plan / world size.

- ``layout.py``: the files of a checkpoint directory (``FILES``), ``CheckpointLayout``, the
  model fingerprint;
- ``atomic.py``: the staging directory published by rename, and the completeness marker
  ([Note: atomic checkpoints]); ``discovery.py``: the newest complete checkpoint, the remedy
  for a damaged one;
- ``write.py``: ``save_sharded`` / ``save_checkpoint``; ``reader.py``: the verified reader
  (layout, tensor ranges, re-layout); ``load.py``: loading into an engine (parameters, buffers,
  optimizer state); ``offline.py``: ``read_full_state_dict`` and ``export_hf``.

Loading never executes code: tensors come through ``safetensors``, everything else is JSON.
"""

from __future__ import annotations

# the file primitives export.py shares live in checkpoint_files.py (imports point one way:
# checkpoint -> export -> checkpoint_files); re-exported here, where callers import them
from ..checkpoint_files import DAMAGED, CheckpointError, errors_on_every_rank
from .atomic import atomic_checkpoint_dir, is_complete, staging_path
from .discovery import (NewestCheckpoint, damaged_remedy, earlier_complete_checkpoint,
                        newest_complete_checkpoint)
from .layout import FILES, FORMAT, CheckpointLayout, model_fingerprint
from .load import load_checkpoint, load_sharded, load_sharded_optimizer
from .offline import check_export_target, export_hf, read_full_state_dict
from .reader import read_layout
from .write import save_checkpoint, save_sharded

__all__ = ["FORMAT", "FILES", "CheckpointError", "CheckpointLayout", "atomic_checkpoint_dir",
           "save_sharded", "save_checkpoint", "staging_path", "load_sharded",
           "load_checkpoint", "errors_on_every_rank", "load_sharded_optimizer", "read_layout",
           "read_full_state_dict", "export_hf", "check_export_target", "is_complete", "model_fingerprint",
           "NewestCheckpoint", "newest_complete_checkpoint", "DAMAGED", "damaged_remedy",
           "earlier_complete_checkpoint"]
