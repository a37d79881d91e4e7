"""``save_state`` / ``load_state`` of a prepared custom loop (docs/checkpoints.md, "Custom loops").

A custom loop's checkpoint folder holds the runtime's sharded training state (each rank's
parameter and optimizer shards with their layout, the plan and run record, written by
``Session.save_checkpoint``: ``runtime/checkpointing.py``; loadable onto any plan and world
size), and beside it what Accelerate's ``save_state`` keeps, which this door adds through the
session's callback: each LR scheduler's ``state_dict`` (``scheduler.pt``,
``scheduler_<i>.pt``), every rank's RNG states (``random_states_<rank>.pkl``: Python, NumPy,
torch, CUDA), the loss scaler (``scaler.pt``), the objects given to
``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``) and the prepared loaders' position
(``cephalo_loaders.json``: the epoch in progress and the batches handed out) and each
scheduler's steps per optimizer step (``cephalo_schedulers.json``: a resume on another world
size keeps the schedule, [Note: the LR schedule across world sizes] in ``loop.py``). It is written
aside and renamed after its completeness marker (``atomic_checkpoint_dir``): a save killed
midway publishes nothing. The full model is not in it: ``accelerator.save_model`` or
``hf-cephalo export`` write one.

``load_state`` checks the checkpoint against this run (same model, same global batch size) and
reads this rank's shards re-laid for the current plan (``Session.resume``), then restores its
own files: the schedulers, the RNG states (this rank's file, else rank 0's on a larger world),
the scaler, the registered objects and the loaders' epoch: the next iteration of the training
loader continues that epoch's permutation, from its start (as stock;
``accelerator.skip_first_batches(loader, n)`` skips the batches done) or, with
``DataLoaderConfiguration(use_stateful_dataloader=True)``, from the position saved.
"""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import torch

from hf_cephalo.runtime import LOADERS_NAME, CheckpointContents

__all__ = ["save_loop_state", "load_loop_state", "LOADERS_NAME", "SCHEDULERS_NAME"]

SCHEDULERS_NAME = "cephalo_schedulers.json"
"""Each prepared scheduler's steps per optimizer step ([Note: the LR schedule across world
sizes] in ``loop.py``): what a resume on another world size keeps."""


def _scheduler_name(i: int) -> str:
    return "scheduler.pt" if i == 0 else f"scheduler_{i}.pt"


def _rng_state() -> dict:
    state = {"random": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_loop_state(accelerator, output_dir: str) -> str:
    """Collective (every rank): the loop's checkpoint into ``output_dir`` (see the module
    note); returns the folder."""
    from hf_cephalo.runtime import is_peft_model

    loop = accelerator.cephalo_loop
    session = loop.session
    optimizer = session.optimizer
    contents = CheckpointContents(save_only_model=False, save_full_model=False,
                                  peft=is_peft_model(session.model),
                                  scaler=accelerator.scaler is not None,
                                  scheduler=bool(accelerator._schedulers),
                                  world_size=session.job.world_size, front_end="accelerate")
    session.save_checkpoint(output_dir, optimizer=optimizer, global_step=session.global_step,
                            contents=contents,
                            add_files=lambda staging: _save_loop_files(accelerator, staging))
    return output_dir


def _save_loop_files(accelerator, staging: str) -> None:
    """Every rank: the loop's own files beside the session's (the module note): its RNG
    states; rank 0 also the schedulers, the scaler, the registered objects and the loaders."""
    session = accelerator.cephalo_loop.session
    with open(os.path.join(staging, f"random_states_{session.job.rank}.pkl"), "wb") as f:
        pickle.dump(_rng_state(), f)
    if not session.job.is_main:
        return
    for i, scheduler in enumerate(accelerator._schedulers):
        torch.save(scheduler.state_dict(), os.path.join(staging, _scheduler_name(i)))
    with open(os.path.join(staging, SCHEDULERS_NAME), "w") as f:
        json.dump([getattr(s, "steps_per_optimizer_step", None)
                   for s in accelerator._schedulers], f)
    if accelerator.scaler is not None:
        torch.save(accelerator.scaler.state_dict(), os.path.join(staging, "scaler.pt"))
    for i, obj in enumerate(accelerator._custom_objects):
        torch.save(obj.state_dict(), os.path.join(staging, f"custom_checkpoint_{i}.pkl"))
    with open(os.path.join(staging, LOADERS_NAME), "w") as f:
        json.dump([loader.state() for loader in accelerator.cephalo_loaders], f)


def load_loop_state(accelerator, input_dir: str) -> None:
    """Collective (every rank): restore the loop from ``input_dir`` onto this plan and world
    (see the module note).

    Raises (every rank alike, before any state is changed where possible): ValueError for a
    checkpoint of another model or global batch size; ``CheckpointError`` for a missing,
    incomplete or corrupt one."""
    loop = accelerator.cephalo_loop
    session = loop.session
    resume = session.resume(input_dir)
    resume.load(session.optimizer)  # weights, then the optimizer state (when there is one)
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(torch.load(os.path.join(input_dir, _scheduler_name(i)),
                                             weights_only=True))
    _restore_scheduler_steps(accelerator, input_dir)
    path = os.path.join(input_dir, "scaler.pt")
    if accelerator.scaler is not None and os.path.isfile(path):
        accelerator.scaler.load_state_dict(torch.load(path, weights_only=True))
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(torch.load(os.path.join(input_dir, f"custom_checkpoint_{i}.pkl"),
                                       weights_only=False))
    own = os.path.join(input_dir, f"random_states_{session.job.rank}.pkl")
    with open(own if os.path.isfile(own) else os.path.join(input_dir, "random_states_0.pkl"),
              "rb") as f:
        _set_rng_state(pickle.load(f))
    _restore_loaders(accelerator, input_dir)
    session.global_step = resume.step


def _restore_scheduler_steps(accelerator, input_dir: str) -> None:
    """The saved run's scheduler steps per optimizer step, kept on this world size (a
    checkpoint without the file: the count in force stays)."""
    path = os.path.join(input_dir, SCHEDULERS_NAME)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        counts = json.load(f)
    for scheduler, count in zip(accelerator._schedulers, counts):
        if count is not None and hasattr(scheduler, "steps_per_optimizer_step"):
            scheduler.steps_per_optimizer_step = int(count)


def _restore_loaders(accelerator, input_dir: str) -> None:
    path = os.path.join(input_dir, LOADERS_NAME)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        states = json.load(f)
    stateful = bool(getattr(accelerator.dataloader_config, "use_stateful_dataloader", False))
    for loader, state in zip(accelerator.cephalo_loaders, states):
        loader.epoch = int(state["epoch"])
        loader._skip_next = int(state["position"]) if stateful else 0
