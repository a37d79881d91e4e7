"""``enable_jit_checkpoint``: save a checkpoint on SIGTERM, with every rank saving at the same step.

[Note: JIT checkpoint agreed by all ranks]
Stock ``Trainer``'s SIGTERM handling (``transformers.trainer_jit_checkpoint``) raises a
per-process flag a grace after the signal and saves at the first hook that sees it; each rank
sees the signal at its own moment, so the ranks can reach the collective save at different
steps and the job hangs. A CephaloTrainer save is collective (every rank writes its shards), so
the decision must be too: ``AgreedJITCheckpointCallback`` keeps stock's signal handling and, at
every step end and epoch end (hooks every rank reaches at the same global step), all-reduces
the flags (MAX); once any rank was signalled EVERY rank saves ``checkpoint-<global_step>``
(atomic), skips that step's regular save and stops. Cost: one int32 all-reduce per step, only
with ``enable_jit_checkpoint``. Details: docs/checkpoints.md, "JIT checkpoint agreed by all
ranks".
"""

from __future__ import annotations

import logging

from transformers.trainer_jit_checkpoint import JITCheckpointCallback

__all__ = ["AgreedJITCheckpointCallback", "replace_jit_checkpoint_callback"]

logger = logging.getLogger(__name__)


class AgreedJITCheckpointCallback(JITCheckpointCallback):
    """Stock ``JITCheckpointCallback`` with the save decided by all ranks together (see
    [Note: JIT checkpoint agreed by all ranks]).

    Args:
        trainer: the ``CephaloTrainer`` (its ``engine.group`` is the process group agreed over).
        manager: stock's ``CheckpointManager`` that already holds the SIGTERM handler.
    """

    def __init__(self, trainer, manager) -> None:
        super().__init__()
        self.trainer = trainer
        self.jit_manager = manager
        self._saved = False

    # stock saves from these hooks on its own rank's flag alone: not a collective decision point
    def on_step_begin(self, args, state, control, **kwargs):
        return None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        return None

    def on_step_end(self, args, state, control, **kwargs):
        self._save_if_any_rank_signalled(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._save_if_any_rank_signalled(state, control)

    def _save_if_any_rank_signalled(self, state, control) -> None:
        if self._saved or not self._any_rank_signalled():
            return
        self._saved = True
        self.jit_manager.is_checkpoint_requested = False
        control.should_save = False  # this step's regular checkpoint IS the JIT checkpoint
        control.should_training_stop = True
        logger.warning("SIGTERM: every rank saves the just-in-time checkpoint of step %d",
                       state.global_step)
        self.trainer._save_checkpoint(self.trainer.model, trial=None)

    def _any_rank_signalled(self) -> bool:
        """Collective, every rank calls it: one all-reduce (MAX) of the ranks' flags."""
        return self.trainer.session.any_rank(self.jit_manager.is_checkpoint_requested)


def replace_jit_checkpoint_callback(trainer) -> None:
    """Swap the stock ``JITCheckpointCallback`` that ``Trainer.__init__`` added for
    ``enable_jit_checkpoint`` for ``AgreedJITCheckpointCallback`` over the same manager (the
    SIGTERM handler stays installed once). No-op without ``enable_jit_checkpoint``."""
    if not trainer.args.enable_jit_checkpoint:
        return
    stock = next(cb for cb in trainer.callback_handler.callbacks
                 if type(cb) is JITCheckpointCallback)
    trainer.remove_callback(stock)
    trainer.add_callback(AgreedJITCheckpointCallback(trainer, stock.jit_manager))
