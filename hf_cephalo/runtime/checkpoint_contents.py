"""What a ``CephaloTrainer`` checkpoint promises to hold, checked before it is marked complete
and again before it is resumed from or loaded as the best model.

[Note: a checkpoint holds what its settings promise]
A checkpoint's files follow from the save settings of the run that wrote it: the sharded engine
state (parameters AND optimizer state) unless ``save_only_model``, else what stock
``Trainer.save_model`` writes (a LoRA ``PeftModel``: the adapter files); the ``save_model``
files too with ``cephalo_save_full_model``; ``scheduler.pt`` without ``save_only_model``;
``scaler.pt`` with ``--fp16`` and without ``save_only_model``, as stock. ``CheckpointContents``
records the settings in ``cephalo_contents.json``; ``missing_files`` lists each promised file
that is absent with the setting that promised it. The trainer runs it on rank 0 before writing
the completeness marker (a checkpoint missing a promised file is never marked complete: the save
raises on every rank instead) and on every rank before resuming or loading the best model (a
``CheckpointError`` naming the file and the setting). Files per setting: docs/checkpoints.md,
"What each save setting puts into a checkpoint".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

from hf_cephalo.engine.checkpoint import FILES, CheckpointError, damaged_remedy
from hf_cephalo.engine.export import INDEX_NAME, WEIGHTS_NAME
from hf_cephalo.engine.peft_save import ADAPTER_FILES

__all__ = ["CONTENTS_NAME", "CheckpointContents", "MissingFile", "missing_files",
           "read_contents", "check_contents"]

CONTENTS_NAME = "cephalo_contents.json"
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's names
SCALER_NAME = "scaler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
LOADERS_NAME = "cephalo_loaders.json"  # a custom loop's save_state


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointContents:
    """The save settings a checkpoint was written with (``cephalo_contents.json``).

    Attributes:
        save_only_model: ``TrainingArguments.save_only_model``: model files, no optimizer,
            scheduler, scaler or RNG state.
        save_full_model: ``cephalo_save_full_model``: the ``save_model`` files beside the shards.
        peft: the model is a LoRA ``PeftModel`` (``save_model`` writes the adapter only).
        scaler: an fp16 loss scaler existed (``--fp16``).
        scheduler: an LR scheduler existed.
        world_size: ranks that wrote it (one parameter/optimizer shard each).
        front_end: who wrote it: "trainer" (``trainer_state.json``, stock's folder) or
            "accelerate" (a custom loop's ``save_state``: every rank's RNG states and the
            loaders' positions instead).
    """

    save_only_model: bool
    save_full_model: bool
    peft: bool
    scaler: bool
    scheduler: bool
    world_size: int
    front_end: str = "trainer"

    @property
    def has_model_files(self) -> bool:
        """The checkpoint holds what ``save_model`` writes (``from_pretrained`` loads it)."""
        return self.save_only_model or self.save_full_model

    @property
    def has_shards(self) -> bool:
        """The checkpoint holds the sharded engine state (parameters and optimizer)."""
        return not self.save_only_model

    def to_json(self) -> dict[str, Any]:
        return {"format": "hf_cephalo.contents/1", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str) -> "CheckpointContents":
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields if f.default is dataclasses.MISSING]  # required keys
        if not isinstance(data, dict) or any(n not in data for n in names):
            raise CheckpointError(f"{path}: corrupt (keys {names} expected); "
                                  f"{damaged_remedy(os.path.dirname(path))}")
        return cls(**{f.name: data[f.name] for f in fields if f.name in data})

    def write(self, directory: str) -> None:
        """Rank 0: write ``cephalo_contents.json`` into ``directory`` (a staging directory)."""
        from hf_cephalo.file_modes import apply_default_mode

        path = os.path.join(directory, CONTENTS_NAME)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        apply_default_mode(path)


class MissingFile(NamedTuple):
    """A promised file that is absent: ``name``, ``what`` it holds, the ``setting`` that
    promised it, its ``kind`` ("weights", "training state" or "trainer state")."""

    name: str
    what: str
    setting: str
    kind: str = "weights"


def _model_files(directory: str) -> list[str] | None:
    """The weight files ``save_model`` wrote into ``directory`` (None: neither the single file
    nor an index); an index's listed shards are returned so their absence is noticed."""
    if os.path.isfile(os.path.join(directory, INDEX_NAME)):
        with open(os.path.join(directory, INDEX_NAME)) as f:
            try:
                weight_map = json.load(f).get("weight_map") or {}
            except (json.JSONDecodeError, AttributeError):
                return [INDEX_NAME + " (unreadable)"]
        return [INDEX_NAME, *sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
        return [WEIGHTS_NAME]
    return None


def missing_files(directory: str, contents: CheckpointContents) -> list[MissingFile]:
    """Every file ``contents``' settings promise that ``directory`` lacks (empty: complete)."""
    out: list[MissingFile] = []
    if not contents.save_only_model:
        setting = "save_only_model=False (the default)"
        names = [FILES.LAYOUT, FILES.BUFFERS] + [FILES.shard(r) for r in range(contents.world_size)]
        out += [MissingFile(n, "the sharded parameters and optimizer state", setting)
                for n in names]
        if contents.scheduler:
            out.append(MissingFile(SCHEDULER_NAME, "the LR scheduler's position", setting,
                                   "training state"))
        if contents.scaler:
            out.append(MissingFile(SCALER_NAME, "the fp16 loss scaler",
                                   "fp16=True with save_only_model=False", "training state"))
    if contents.has_model_files:
        setting = ("save_only_model=True" if contents.save_only_model
                   else "cephalo_save_full_model=True")
        if contents.peft:
            out += [MissingFile(n, "the LoRA adapter (save_model)", setting) for n in ADAPTER_FILES]
        else:
            files = _model_files(directory)
            if files is None:
                out.append(MissingFile(WEIGHTS_NAME, "the model weights (save_model: "
                                       f"{WEIGHTS_NAME} or {INDEX_NAME})", setting))
            else:
                out += [MissingFile(n, "the model weights (save_model)", setting) for n in files]
            out.append(MissingFile("config.json", "the model config (save_model)", setting))
    if contents.front_end == "accelerate":
        out += [MissingFile(f"random_states_{r}.pkl", "a rank's RNG states", "save_state",
                            "training state") for r in range(contents.world_size)]
        out.append(MissingFile(LOADERS_NAME, "the prepared loaders' positions", "save_state",
                               "training state"))
    else:
        out.append(MissingFile(TRAINER_STATE_NAME, "the trainer state", "any setting",
                               "trainer state"))
    return [m for m in out if not os.path.isfile(os.path.join(directory, m.name))]


def read_contents(directory: str) -> CheckpointContents | None:
    """The settings recorded in ``directory`` (None: a checkpoint written before they were
    recorded, which always holds the sharded state)."""
    path = os.path.join(directory, CONTENTS_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return CheckpointContents.from_json(json.load(f), path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e}); {damaged_remedy(directory)}") \
            from None


def check_contents(directory: str, contents: CheckpointContents | None = None, *,
                   when: str = "resume", weights_only: bool = False) -> CheckpointContents | None:
    """Raise ``CheckpointError`` naming the first missing promised file and its setting.

    ``contents`` None: read it from ``directory``; a checkpoint without the record (written by
    an earlier release) is checked for its sharded weights only, and loading checks those
    files. ``weights_only``: only the files the weights are read from (loading the best model).
    Returns the contents (None for a checkpoint without the record).
    """
    if contents is None:
        contents = read_contents(directory)
        if contents is None:
            if (os.path.isfile(os.path.join(directory, FILES.COMPLETE))
                    and not os.path.isfile(os.path.join(directory, FILES.LAYOUT))):
                raise CheckpointError(
                    f"{os.path.join(directory, FILES.LAYOUT)}: missing — {directory} holds no "
                    "model weights (an earlier hf_cephalo release wrote save_only_model=True "
                    f"checkpoints without them); cannot {when} from it: use a checkpoint saved "
                    "without save_only_model, or one written by this release")
            return None
    missing = missing_files(directory, contents)
    if weights_only:
        missing = [m for m in missing if m.kind == "weights"]
    if missing:
        first = missing[0]
        others = f" (also missing: {', '.join(m.name for m in missing[1:])})" if missing[1:] else ""
        advice = ("the checkpoint is incomplete: it is not marked complete" if when == "save"
                  else f"cannot {when} from it; {damaged_remedy(directory)}")
        raise CheckpointError(f"{os.path.join(directory, first.name)}: missing — {first.what}, "
                              f"which a checkpoint saved with {first.setting} holds{others}; "
                              f"{advice}")
    return contents
