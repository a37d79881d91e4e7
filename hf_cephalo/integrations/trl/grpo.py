"""CephaloGRPOTrainer and CephaloGRPOConfig: TRL's ``GRPOTrainer`` on the Cephalo runtime.

``CephaloTrainerMixin`` + ``GRPOTrainer`` (``CephaloGRPOConfig``: every ``GRPOConfig`` field plus
the ``cephalo_*`` settings). GRPOTrainer builds its reward functions, processing classes and
metrics inside the mixin's ``super().__init__``; then the mixin builds the session. One optimizer
step trains one generation batch of B rows (B = the plan's global batch; B / G prompts, each
G times in a row), rank i its b_i rows; the steps of a generation round read as one process
with the whole batch reads them ([Note: rows of a generation batch] in rollout.py):

1. completions come from ONE method, ``_cephalo_rollout``: the user's ``rollout_func``,
   called with the whole groups this rank's rows touch, in order, or without one the engine's
   built-in generation (``builtin_generation.py``, keyed sampling: the same completions as
   stock on one process with ``hf_cephalo.reproducible_rollout``);
2. rewards per row on the rank that holds it (TRL's own ``_calculate_rewards``), gathered in
   global row order; advantages as one process computes them (``rollout.group_advantages``);
3. the old policy's and the reference's per-token log-probabilities by forward-only passes
   over this rank's microbatches (the policy's engine, a second engine over TRL's ``ref_model``,
   or the policy with its LoRA adapter off: [Note: the reference log-probabilities] in dpo.py);
4. GRPOTrainer's own ``compute_loss`` per microbatch in the engine's head, its loss rescaled
   to the microbatch's share of the one-process loss ([Note: each loss type's normalizer]).

[Note: each loss type's normalizer]
The engine's step adds ``compute_loss`` of every microbatch; the one-process loss of the
batch is the sum of those shares when each is ``TRL's microbatch loss x its share``:
``dapo``: TRL divides the token sum by ``num_items_in_batch`` (here the GLOBAL batch's loss
tokens; ``accelerator.num_processes`` is 1 in the head): share 1. ``bnpo``: TRL divides by the
microbatch's tokens; one process by the batch's: share tokens_mb / N, N = the batch's loss
tokens. ``grpo``: a mean over the microbatch's rows of per-row token means; one process over
the batch's rows: share rows_mb / N, N = B. ``dr_grpo``: the token sum over
rows_mb x max_completion_length: share rows_mb / N, N = B. Items counted by
``rollout_door.CompletionItems``.

Requires the ``trl`` extra (written against TRL 1.16). docs/trl.md, "GRPO: CephaloGRPOTrainer".
"""

from __future__ import annotations

from typing import Any

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # the optional extra
    raise ImportError("CephaloGRPOTrainer needs TRL: pip install 'hf-cephalo[trl]' "
                      "(trl>=1.16)") from exc

from hf_cephalo.integrations.trainer.trainer import CephaloTrainerMixin
from hf_cephalo.integrations.trl.config import (CephaloTRLConfig, TRLModelByName, TRLModelCard,
                                                 trl_config_dataclass)
from hf_cephalo.integrations.trl.rollout_door import RolloutDoor, loss_mask, one_step_per_generation
from hf_cephalo.integrations.trl.rollout_step import RolloutStep
from hf_cephalo.integrations.trl.support import GRPO_FIELD_SUPPORT

__all__ = ["CephaloGRPOConfig", "CephaloGRPOTrainer"]

PER_TOKEN_LOSSES = ("dapo", "bnpo")
"""Loss types whose item count is the batch's loss tokens; the others count rows."""
BUILT_LOSSES = ("dapo", "bnpo", "grpo", "dr_grpo")


@trl_config_dataclass(GRPOConfig)
class CephaloGRPOConfig(CephaloTRLConfig, GRPOConfig):
    """``GRPOConfig`` plus the ``cephalo_*`` settings (``CephaloTRLConfig``: the rules of
    ``CephaloTrainingArguments``; ``trl_config_dataclass``: GRPOConfig's own defaults).

    The generation batch is Cephalo's global batch B (the plan's; ``generation_batch_size`` is
    set to it by the trainer): one optimizer step trains it. Raises ValueError as
    ``CephaloTrainingArguments`` and ``GRPOConfig`` do; settings the engine cannot honour are
    refused by ``CephaloGRPOTrainer`` in one message (``refused_settings``)."""

    @staticmethod
    def cephalo_field_support() -> dict:
        """The table of this config's own fields (``support.training_args_problems``)."""
        return GRPO_FIELD_SUPPORT

    def refused_settings(self) -> dict[str, str]:
        """``CephaloTrainingArguments.refused_settings`` plus the GRPO values the table cannot
        word per field."""
        refused = super().refused_settings()
        refused.update(one_step_per_generation(self))
        if self.loss_type not in BUILT_LOSSES:
            refused["loss_type"] = (
                f"--loss_type {self.loss_type!r}: not validated on the engine (built and tested "
                f"against stock: {', '.join(BUILT_LOSSES)})")
        return refused


class CephaloGRPOTrainer(TRLModelByName, TRLModelCard, RolloutDoor, CephaloTrainerMixin,
                         GRPOTrainer):
    """``GRPOTrainer`` on the Cephalo runtime (see the module note and ``CephaloTrainerMixin``
    for the arguments and errors; ``reward_funcs``, ``rollout_func`` ... as GRPOTrainer's).

    Raises ``RefusedSettings`` (a ValueError; before any collective, in the mixin's one refusal
    message) for: built-in generation settings it does not reproduce (without a
    ``rollout_func``: ``builtin_generation.generation_problems``), tools / environments, multimodal prompts, an evaluation dataset, an iterable dataset, a
    global batch that ``num_generations`` does not divide, a shuffled dataset read for more
    than one epoch, and the config's refused values (``CephaloGRPOConfig.refused_settings``,
    the field table). At a step: ``LoaderStepError`` (a ValueError) on EVERY rank when the
    rollout or a reward function raised on some rank.
    """

    _rollout_step_class = RolloutStep

    def __init__(self, model, reward_funcs=None, args=None, **kwargs: Any) -> None:
        super().__init__(model, args, reward_funcs=reward_funcs, **kwargs)

    def _per_token_items(self) -> bool:
        return self.loss_type in PER_TOKEN_LOSSES

    def _loss_share(self, inputs: dict[str, Any], num_items_in_batch):
        """The factor from TRL's microbatch loss to its share of the one-process loss
        ([Note: each loss type's normalizer])."""
        if self.loss_type == "dapo":
            return 1.0
        if self.loss_type == "bnpo":
            return loss_mask(inputs).sum().clamp(min=1.0) / num_items_in_batch
        return inputs["input_ids"].shape[0] / num_items_in_batch  # grpo, dr_grpo: per row
