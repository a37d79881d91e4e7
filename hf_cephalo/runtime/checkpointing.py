"""Saving and resuming a session's training state, for every front end (docs/checkpoints.md).

The sequence of a checkpoint's steps is written here once, and every door goes through it
(``Session.save_checkpoint`` / ``Session.resume``); a door only adds its own files (the
Trainer's ``trainer_state.json``, ``scheduler.pt`` and ``rng_state_<r>.pth``, Accelerate's
``random_states_<r>.pkl``). What the runtime writes is the same in every door (a Trainer
checkpoint and a loop's ``save_state`` folder hold the same sharded state; the Trainer refuses
to resume a loop's folder, which has no ``trainer_state.json``, and says how to start from its
exported weights):

- ``save_checkpoint``: in a staging folder published after its completeness marker
  (``atomic_checkpoint``), the ``save_model`` files where the settings promise them
  (``save_model_files``), each rank's parameter and optimizer shards with their layout
  (``save_shards``: ``engine.checkpoint.save_sharded``) and, by rank 0, the plan and run record
  the checkpoint was trained with (``plan.json``, ``cephalo_run.json``: elastic resumes check B
  and model), a LoRA model's ``adapter_config.json`` and ``cephalo_contents.json``; then the
  door's own files, through its callback;
- ``resolve_resume``: ``True`` -> the newest complete ``checkpoint-N`` of the output directory;
- ``Resume``: the checkpoint checked against this run (same model, same global batch size;
  ``elastic.check_resume``), the plan it ran on adopted where live re-balancing had moved it,
  and the resume reported at the first step (``prepare_resume``, ``ElasticProgress``); then
  this rank's shards of its weights and optimizer state, re-laid for this plan and world size,
  and the LR scheduler's position (``load_checkpoint_weights``, ``load_optimizer``,
  ``load_scheduler``), errors raised on every rank.

Every rank reads the same files and raises the same error, so no rank is left in a collective.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from hf_cephalo.engine.checkpoint import (CheckpointError, atomic_checkpoint_dir, damaged_remedy,
                                          errors_on_every_rank, is_complete, load_sharded,
                                          load_sharded_optimizer, newest_complete_checkpoint,
                                          save_sharded)

from hf_cephalo.planner import Plan
from hf_cephalo.runtime.checkpoint_contents import CheckpointContents, check_contents
from hf_cephalo.runtime.elastic import (RunRecord, check_resume, latest_checkpoint,
                                        read_checkpoint_record, run_fingerprint,
                                        write_checkpoint_record)

if TYPE_CHECKING:
    from hf_cephalo.runtime.session import Session

__all__ = ["save_checkpoint", "Resume", "atomic_checkpoint", "save_shards", "save_run_record",
           "save_model_files", "save_adapter_config", "resolve_resume", "prepare_resume",
           "adopt_checkpoint_plan", "load_weights", "load_checkpoint_weights", "load_optimizer",
           "load_scheduler", "is_complete", "CheckpointError"]

logger = logging.getLogger(__name__)


@contextmanager
def atomic_checkpoint(session: "Session", directory: str,
                      contents: CheckpointContents) -> Iterator[str]:
    """Collective (every rank): a checkpoint written atomically. Yields the hidden staging
    folder each rank writes its files into; on exit every rank's files are checked against
    ``contents`` (what the run's settings promise) and the folder is renamed to ``directory``
    after the completeness marker ([Note: atomic checkpoints] in engine/checkpoint/atomic.py), so a
    run killed mid-save leaves no ``directory``. Each door adds its own files inside."""
    with atomic_checkpoint_dir(directory, session.engine.group, check=lambda staging:
                               check_contents(staging, contents, when="save")) as staging:
        yield staging


def save_shards(session: "Session", directory: str, optimizer) -> None:
    """Every rank: its parameter and optimizer shards with their layout into ``directory``."""
    save_sharded(session.engine, directory, optimizer)


def save_checkpoint(session: "Session", directory: str, *, optimizer, global_step: int,
                    contents: CheckpointContents, add_files: Callable[[str], None],
                    model_files: Callable[[str], None] | None = None) -> None:
    """Collective (every rank): ``session``'s checkpoint at ``global_step`` into ``directory``,
    written atomically (``atomic_checkpoint``); the engine's part of every door's checkpoint is
    composed here, once.

    Into the staging folder: the ``save_model`` files when ``contents`` promises them
    (``save_only_model`` or ``cephalo_save_full_model``; collective, streamed:
    ``model_files(staging)``, by default ``save_model_files`` with the job's
    ``max_shard_size``; the Trainer passes its ``save_model``, which stock's checkpoint calls
    and a subclass may override), every rank's parameter and ``optimizer`` shards unless
    ``save_only_model`` (``save_shards``), and by rank 0 the plan and run record
    (``save_run_record``), a LoRA model's ``adapter_config.json`` and ``contents`` itself
    (``cephalo_contents.json``). Then every rank calls ``add_files(staging)``, where the front
    end writes its own files (the Trainer's ``trainer_state.json``, ``scheduler.pt``, RNG
    states; a loop's Accelerate-style state). On exit every promised file is checked and the
    folder is renamed to ``directory`` after the completeness marker."""
    with atomic_checkpoint(session, directory, contents) as staging:
        if contents.has_model_files:
            if model_files is None:
                save_model_files(session, staging, session.job.settings.max_shard_size)
            else:
                model_files(staging)
        if contents.has_shards:
            save_shards(session, staging, optimizer)
        if session.job.is_main:
            save_run_record(session, staging, global_step)
            save_adapter_config(session.model, staging)
            contents.write(staging)
        add_files(staging)


def save_run_record(session: "Session", directory: str, global_step: int) -> None:
    """Rank 0: the plan and ``RunRecord`` the checkpoint was trained with (elastic resumes
    check B, the model and the world against them)."""
    plan = session.plan
    model = session.engine.staged.model
    record = RunRecord(global_batch_size=plan.global_batch_size,
                       model_fingerprint=run_fingerprint(model),
                       model_class=type(model).__name__, world_size=plan.world_size,
                       device_names=[r.device for r in plan.ranks], global_step=global_step,
                       saved_time_s=time.time())
    write_checkpoint_record(directory, plan, record)


def resolve_resume(output_dir: str, value) -> str | None:
    """The checkpoint a ``resume_from_checkpoint`` value names: a path as it is, ``True`` the
    newest complete ``checkpoint-N`` in ``output_dir``, falsy: None.

    Raises ValueError: True but ``output_dir`` holds no complete checkpoint (naming the
    incomplete ones)."""
    if value is True:
        found = latest_checkpoint(output_dir)
        if found is None:
            incomplete = newest_complete_checkpoint(output_dir).skipped
            which = (f" (only incomplete ones, without the completeness marker: "
                     f"{', '.join(incomplete)})" if incomplete else "")
            raise ValueError(f"resume_from_checkpoint=True but {output_dir!r} holds no complete "
                             f"checkpoint-N{which}; start without it")
        return found
    return value or None


def prepare_resume(session: "Session", checkpoint: str, *, global_step: int | None = None) -> int:
    """Check ``checkpoint`` against this run, adopt the plan it ran on where live re-balancing
    moved it, and arm the resume report; returns the checkpoint's global step (its record's,
    else ``global_step``, else the ``checkpoint-N`` suffix, else 0).

    Raises ValueError (every rank, before any state is read): another model, another global
    batch size ([Note: world-independent trajectory] in ``elastic.py``)."""
    old_plan, record = read_checkpoint_record(checkpoint)
    model = session.engine.staged.model
    check_resume(checkpoint, record, session.plan, run_fingerprint(model), type(model).__name__,
                 session.job.global_batch_size_given)
    if session.controller is not None:  # continue from the last live switch (same world)
        adopt_checkpoint_plan(session, old_plan)
    suffix = str(checkpoint).rstrip("/").rsplit("-", 1)[-1]
    step = record.global_step if record is not None else global_step if global_step is not None \
        else int(suffix) if suffix.isdigit() else 0
    session.progress.arm(checkpoint, step, old_plan, None if record is None else record.world_size)
    return step


def adopt_checkpoint_plan(session: "Session", checkpoint_plan: Plan | None) -> None:
    """Continue a resumed adaptive run from the plan its checkpoint ran on (same world,
    devices and B; ``planning.adopt_checkpoint_split`` / ``adopt_checkpoint_state``).

    ``adaptive state``: when the checkpoint's r_i differ from the engine's (a live re-layout
    happened before it was saved), the engine's state is re-laid onto them in memory here,
    before the checkpoint is read (collective; the optimizer holds no state yet, so only the
    freshly initialized parameter shards move), and loading then fills the checkpoint's shards
    onto the checkpoint's own layout. Every rank reads the same files, so every rank takes the
    same branch."""
    from hf_cephalo.runtime.planning import (adopt_checkpoint_split, adopt_checkpoint_state,
                                             resume_banner)
    from hf_cephalo.runtime.report import format_plan_table

    start = session.plan
    new = None
    if session.controller.mode == "state":
        new = adopt_checkpoint_state(session.plan, checkpoint_plan, session.cluster_profile)
        if new is not None:
            session.relayout_state(new)  # sets session.plan
    if new is None:
        session.plan = adopt_checkpoint_split(session.plan, checkpoint_plan,
                                              session.cluster_profile)
    if session.plan is not start:
        plan = session.plan
        session.split_schedule.switch(0, plan.batch_sizes, plan.microbatch_sizes)
        if session.job.is_main:
            # the plan printed at start is not the one that runs: say so, and keep plan.json
            # beside the outputs in step with it
            print(f"[hf-cephalo] {resume_banner(plan, checkpoint_plan, new is not None)}:\n"
                  + format_plan_table(plan), flush=True)
            if session.job.output_dir is not None:
                plan.save(os.path.join(session.job.output_dir, "plan.json"))


def load_weights(session: "Session", checkpoint: str, contents: CheckpointContents | None,
                 ) -> None:
    """This rank's shards of ``checkpoint``'s weights into the engine, on any plan (no
    collective): from the sharded state when the checkpoint has it (exact), else from the
    ``save_model`` files (``save_only_model``; read slice by slice as
    ``from_pretrained_sharded`` does; a LoRA PeftModel's adapter into the trainable shards,
    the frozen base kept, as ``PeftModel.from_pretrained``)."""
    from hf_cephalo.engine.loading import load_weights_into_engine
    from hf_cephalo.engine.peft_save import load_peft_adapter

    if contents is None or contents.has_shards:
        load_sharded(session.engine, checkpoint)
    elif contents.peft:
        load_peft_adapter(session.engine, session.model, checkpoint)
    else:
        load_weights_into_engine(session.engine, checkpoint)


def load_checkpoint_weights(session: "Session", checkpoint: str, *, when: str = "resume",
                            weights_only: bool = False) -> CheckpointContents | None:
    """Check ``checkpoint``'s promised files (``check_contents``: ``when`` names the action in
    its messages; ``weights_only``: the weight files only), then load its weights
    (``load_weights``); a bad shard on one rank stops all ranks (``CheckpointError`` on every
    rank). Returns the checkpoint's recorded contents (None for one without the record)."""
    what = "load the checkpoint" if when == "resume" else f"{when} from {checkpoint}"
    with errors_on_every_rank(session.engine.group, what=what):
        contents = check_contents(checkpoint, when=when, weights_only=weights_only)
        load_weights(session, checkpoint, contents)
    return contents


def load_optimizer(session: "Session", optimizer, checkpoint: str) -> None:
    """The optimizer state of ``checkpoint`` re-laid for this plan (exact values); errors on
    every rank (``CheckpointError``). Reads only safetensors and JSON."""
    with errors_on_every_rank(session.engine.group):
        load_sharded_optimizer(session.engine, optimizer, checkpoint)


def load_scheduler(session: "Session", scheduler, checkpoint: str,
                   name: str = "scheduler.pt") -> None:
    """The LR scheduler's position from ``checkpoint/name``; a missing file is a
    ``CheckpointError`` naming it, raised on every rank alike."""
    path = os.path.join(checkpoint, name)
    with errors_on_every_rank(session.engine.group):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the LR scheduler's position); "
                                  f"{damaged_remedy(checkpoint)}")
        scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


class Resume:
    """The engine's side of resuming ``session`` from ``checkpoint``, in the one order every
    door takes it (``Session.resume`` builds it).

    Building it checks the checkpoint against this run, adopts the plan it ran on where live
    re-balancing had moved it and arms the resume report (``prepare_resume``): before the
    front end's loaders draw a batch or any state is read. ``load_weights`` then reads this
    rank's shards of its weights, and ``load_optimizer`` the optimizer state and the LR
    scheduler's position. A custom loop takes them back to back (``load``); the Trainer at
    the moments stock ``train`` reaches them (``_load_from_checkpoint``, then
    ``_load_optimizer_and_scheduler`` once the optimizer exists).

    Attributes:
        checkpoint: the checkpoint folder.
        step: its global step (``prepare_resume``; ``global_step`` when it has no record).
        contents: its recorded contents once ``load_weights`` has read them (None before, and
            for a checkpoint without ``cephalo_contents.json``).
    """

    def __init__(self, session: "Session", checkpoint: str, *,
                 global_step: int | None = None) -> None:
        self.session = session
        self.checkpoint = checkpoint
        self.step = prepare_resume(session, checkpoint, global_step=global_step)
        self.contents: CheckpointContents | None = None

    @property
    def weights_only(self) -> bool:
        """The checkpoint was saved with ``save_only_model``: weights, no optimizer state."""
        return self.contents is not None and self.contents.save_only_model

    def load_weights(self) -> CheckpointContents | None:
        """This rank's shards of the checkpoint's weights (``load_checkpoint_weights``);
        returns its recorded contents."""
        self.contents = load_checkpoint_weights(self.session, self.checkpoint)
        return self.contents

    def load_optimizer(self, optimizer, scheduler=None) -> None:
        """The optimizer state re-laid for this plan (``load_optimizer``) and, given a
        ``scheduler``, its position from ``scheduler.pt`` (``load_scheduler``)."""
        load_optimizer(self.session, optimizer, self.checkpoint)
        if scheduler is not None:
            load_scheduler(self.session, scheduler, self.checkpoint)

    def load(self, optimizer=None, scheduler=None) -> None:
        """``load_weights``, then (given an ``optimizer``) ``load_optimizer``."""
        self.load_weights()
        if optimizer is not None:
            self.load_optimizer(optimizer, scheduler)


def save_model_files(session: "Session", output_dir: str, max_shard_size) -> None:
    """Collective (every rank): a ``from_pretrained`` model directory of the current weights.

    The engine streams the weights one unit at a time into the files ``save_pretrained``
    writes (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` + index above
    ``max_shard_size``; tied weights once; config and generation config;
    ``engine.export.save_pretrained_streamed``): rank 0 holds one output file plus one unit,
    never the whole model. A LoRA ``PeftModel`` saves its adapter only, as stock Trainer does:
    ``adapter_model.safetensors`` + ``adapter_config.json`` in PEFT's key names, loadable with
    ``PeftModel.from_pretrained(base, dir)``; only the adapter tensors are gathered
    (``peft_save.py``).
    """
    from hf_cephalo.engine.export import save_pretrained_streamed
    from hf_cephalo.models.peft_lora import is_peft_model
    from hf_cephalo.engine.peft_save import save_peft_adapter

    if is_peft_model(session.model):
        save_peft_adapter(session.engine, session.model, output_dir)
    else:
        save_pretrained_streamed(session.engine, output_dir, max_shard_size=max_shard_size)


def save_adapter_config(model, directory: str) -> None:
    """A LoRA ``PeftModel``'s ``adapter_config.json`` into a checkpoint: ``hf-cephalo export
    --merge-lora`` needs its rank, alpha and targets (``hf_cephalo/engine/peft_merge.py``)."""
    import copy

    from hf_cephalo.models.peft_lora import is_peft_model

    if not is_peft_model(model):
        return
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    config.inference_mode = True  # as PeftModel.save_pretrained records it
    config.save_pretrained(directory)
