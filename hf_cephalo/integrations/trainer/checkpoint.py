"""The Trainer doors' saving, checkpoints and resume over the runtime (docs/checkpoints.md).

``EngineCheckpointMixin`` keeps stock ``Trainer``'s checkpoint folder (``checkpoint-N`` with
``trainer_state.json``, ``scheduler.pt``, ``rng_state*.pth``, rotation, best-model tracking)
and replaces what the engine holds: the session writes the engine's part of every checkpoint
and resumes it (``Session.save_checkpoint`` / ``Session.resume``, ``runtime/checkpointing.py``:
the weights and optimizer state sharded, loadable onto any plan and world size; the model files
streamed one unit at a time; the folder written aside and renamed after its completeness
marker, [Note: atomic checkpoints] in engine/checkpoint/atomic.py); this door adds stock's own
files and calls each step at the moment stock ``Trainer`` reaches it.
"""

from __future__ import annotations

import logging
import os

import torch

from hf_cephalo.runtime import CheckpointContents, resolve_resume

__all__ = ["EngineCheckpointMixin", "unwrap_optimizer"]

logger = logging.getLogger(__name__)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class EngineCheckpointMixin:
    """Saving and resuming for a ``Trainer`` subclass on the runtime (``self.session``)."""

    _resume = None  # the session's Resume of the checkpoint train() resumes from

    # ---- saving --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective (call on every rank): write a ``from_pretrained`` model directory
        (``Session.save_model_files``: streamed, rank 0 never holds the whole model; a LoRA
        ``PeftModel``: its adapter, as stock). Rank 0 also writes the processing class
        (tokenizer) and ``training_args.bin``, as stock ``Trainer._save`` does."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.session.save_model_files(output_dir, self.args.cephalo_max_shard_size)
        if self.args.should_save:
            self._save_side_files(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_side_files(self, output_dir: str) -> None:
        """Rank 0: the processing class (tokenizer / processor) and ``training_args.bin``, as
        stock ``Trainer._save`` writes them next to the weights."""
        from transformers.trainer import TRAINING_ARGS_NAME

        os.makedirs(output_dir, exist_ok=True)
        processor = self.processing_class
        if processor is None:
            processor = getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # ---- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial=None) -> None:
        """Collective: the stock checkpoint contents, written atomically.

        The session writes the engine's part (``Session.save_checkpoint``: the sharded engine
        state, the plan and run record, a LoRA PeftModel's ``adapter_config.json``; the full
        model only with ``cephalo_save_full_model`` or ``save_only_model``, through
        ``save_model`` as stock's checkpoint writes it) and this door adds stock's files
        (``_save_trainer_files``: scheduler, scaler, RNG, ``trainer_state.json``, the tokenizer
        and ``training_args.bin``), all into a hidden ``.tmp-checkpoint-N`` that
        is renamed to ``checkpoint-N`` after the completeness marker; a run killed mid-save
        leaves no ``checkpoint-N``. ``hf-cephalo export checkpoint-N --out DIR`` writes the
        full model from it on demand.
        """
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._set_best_model_checkpoint(run_dir, output_dir)  # before trainer_state.json, as stock
        contents = self._checkpoint_contents()
        # [Note: a checkpoint holds what its settings promise] in checkpoint_contents.py
        self.session.save_checkpoint(
            output_dir, optimizer=unwrap_optimizer(self.optimizer),
            global_step=self.state.global_step, contents=contents,
            model_files=lambda staging: self.save_model(staging, _internal_call=True),
            add_files=lambda staging: self._save_trainer_files(staging, contents))
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=True)

    def _save_trainer_files(self, staging: str, contents: CheckpointContents) -> None:
        """Every rank: stock's own files of a checkpoint into its staging folder, beside the
        engine's part: the tokenizer and ``training_args.bin`` (rank 0; ``save_model`` wrote
        them with the model files), and unless ``save_only_model`` (as stock) ``scheduler.pt``,
        ``scaler.pt`` and each rank's RNG state; then (rank 0) ``trainer_state.json`` with the
        callbacks' states."""
        if self.args.should_save and not contents.has_model_files:
            self._save_side_files(staging)
        if contents.has_shards:  # not save_only_model: parameters + optimizer, as stock
            self._save_optimizer_and_scheduler(staging)
            self._save_scaler(staging)
            self._save_rng_state(staging)
        if self.args.should_save:
            self._save_callback_states()
            self.state.save_to_json(os.path.join(staging, "trainer_state.json"))

    def _save_callback_states(self) -> None:
        """Stock's ``ExportableState`` callbacks into ``state.stateful_callbacks``."""
        from transformers.trainer_callback import ExportableState

        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state

    def _set_best_model_checkpoint(self, run_dir: str, output_dir: str) -> None:
        """Stock's ``state.best_model_checkpoint`` update, made before the checkpoint's
        ``trainer_state.json`` is written (stock writes the weights first, so a new best is
        already on disk then; here ``output_dir`` appears only at the atomic rename, after the
        state file, so it counts as existing)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if best == output_dir or os.path.exists(best):
                self.state.best_model_checkpoint = best

    def _checkpoint_contents(self) -> CheckpointContents:
        """What this run's checkpoints hold, by its save settings (``CheckpointContents``)."""
        from hf_cephalo.runtime import is_peft_model

        return CheckpointContents(save_only_model=bool(self.args.save_only_model),
                                  save_full_model=bool(self.args.cephalo_save_full_model),
                                  peft=is_peft_model(self.model),
                                  scaler=self.accelerator.scaler is not None,
                                  scheduler=self.lr_scheduler is not None,
                                  world_size=self.session.job.world_size)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Rank 0: ``scheduler.pt``. The parameter and optimizer shards are already in
        ``output_dir`` (every rank's, written by ``Session.save_checkpoint`` before stock's
        files)."""
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    # ---- resume ------------------------------------------------------------------------------
    def _prepare_resume(self, resume_from_checkpoint):
        """The checkpoint to resume from (True: the newest complete one), checked against this
        run (same model, same global batch size) and reported on the first step. Every rank
        reads the same files and raises the same ValueError, before the checkpoint's state is
        read (``Session.resume``, kept for the loads of stock's ``train``)."""
        self._resume = None
        checkpoint = resolve_resume(self.args.output_dir, resume_from_checkpoint)
        if checkpoint:
            from hf_cephalo.runtime import read_contents

            contents = read_contents(checkpoint)
            if contents is not None and contents.front_end == "accelerate":
                raise ValueError(
                    f"{checkpoint} was written by a custom Accelerate loop (save_state), which "
                    "keeps no trainer_state.json: resume it with accelerator.load_state in that "
                    "loop; to start a Trainer run from its weights, export them (hf-cephalo "
                    "export) and load the model from the exported folder")
            self._resume = self.session.resume(checkpoint)
        return checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Load the sharded parameters and buffers, re-laid for this plan / world size
        (``resume_from_checkpoint`` is the one ``_prepare_resume`` began resuming from).

        Raises ``CheckpointError`` (a ValueError naming the file)
        for an incomplete, corrupt or other-model checkpoint — before training starts.
        """
        self._resume.load_weights()
        if self._resume.weights_only and self.is_world_process_zero():  # said once
            logger.warning(f"{resume_from_checkpoint} was saved with save_only_model=True: it "
                           "holds the model weights and trainer state but no optimizer, LR "
                           "scheduler, scaler or RNG state; resuming as stock Trainer does, with "
                           "those restarted fresh (the LR schedule starts again from step 0)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer state re-laid for this plan (exact values) and the scheduler's position.

        Reads only safetensors, JSON and ``torch.load(weights_only=True)``.
        """
        if checkpoint is None or self._resume.weights_only:
            return  # save_only_model: stock finds no optimizer.pt / scheduler.pt and skips both
        self._resume.load_optimizer(unwrap_optimizer(self.optimizer), self.lr_scheduler)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the engine's shards
        (any plan; each rank reads only its slices), so ``save_model``, ``evaluate`` and
        ``unshard_model`` after training see them. Weights only, as stock (the optimizer keeps
        the last step's state).

        Raises:
            CheckpointError: (every rank) the best checkpoint lacks a weight file its settings
                promised (names it and the setting), or a file is corrupt.
        """
        path = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {path} (score: {self.state.best_metric}).")
        self.session.load_checkpoint_weights(path, when="load the best model", weights_only=True)
